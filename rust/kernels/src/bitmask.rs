//! Grammar token bitmask: sets the logits of the tokens a grammar forbids to -inf, in place.
//!
//! Layout: `logits` [num_rows, vocab] f32 row-major; `rows` [Rm] i64, the logits row each mask
//! row applies to; `bitmask` [Rm, W] i32 row-major, where bit `t % 32` of word `t / 32` allows
//! token `t` (the words are the bit patterns of u32s, as llguidance packs them).
//!
//! Semantics (the same as the sampler's torch path, which the Python tests use as the oracle):
//! - a token whose bit is 0 becomes -inf, one whose bit is 1 keeps its logit;
//! - tokens at or past `W * 32` (a model vocabulary padded past the tokenizer's) are forbidden;
//! - bits past `vocab` (the last word's padding, or a mask wider than the vocabulary) are ignored;
//! - rows not listed are untouched.
//!
//! Cost: one pass over the masked rows' words. A word with every bit set (the common case of a
//! free-text grammar state) is skipped without touching its 32 logits; a zero word is one fill;
//! the others are one branch-free select per logit, which LLVM vectorizes. This is memory-bound
//! at a few ms for 64 x 49152 on one core, so there is no hand-written SIMD and no threading.

/// Applies mask row `i` to logits row `rows[i]`, for every `i`. `num_rows` is the number of
/// logits rows (`logits.len() / num_rows` is the vocabulary); the mask width `W` is
/// `bitmask.len() / rows.len()`.
///
/// A row listed twice gets both of its masks (their intersection); the Core never lists one twice.
///
/// Errors (nothing is written): `logits.len()` not a multiple of `num_rows`, `bitmask.len()`
/// not a multiple of `rows.len()` (or non-empty with no rows), a row outside `0..num_rows`.
pub fn apply_token_bitmask(logits: &mut [f32], num_rows: usize, rows: &[i64], bitmask: &[i32]) -> Result<(), String> {
    let vocab = match num_rows {
        0 if logits.is_empty() => 0,
        0 => return Err(format!("logits has {} elements but num_rows is 0", logits.len())),
        n if !logits.len().is_multiple_of(n) => {
            return Err(format!("logits has {} elements, not a whole number of {n} rows", logits.len()))
        }
        n => logits.len() / n,
    };
    if rows.is_empty() {
        return if bitmask.is_empty() {
            Ok(())
        } else {
            Err(format!("bitmask has {} words but there are no rows", bitmask.len()))
        };
    }
    if !bitmask.len().is_multiple_of(rows.len()) {
        return Err(format!("bitmask has {} words, not a whole number of {} rows", bitmask.len(), rows.len()));
    }
    let words = bitmask.len() / rows.len();
    // NOTE: every row is checked before the first write, so an error leaves the logits as they were.
    if let Some((i, &row)) = rows.iter().enumerate().find(|&(_, &r)| r < 0 || r as u64 >= num_rows as u64) {
        return Err(format!("rows[{i}] = {row} is outside 0..{num_rows}"));
    }
    if vocab == 0 {
        return Ok(());
    }
    for (i, &row) in rows.iter().enumerate() {
        mask_row(&mut logits[row as usize * vocab..][..vocab], &bitmask[i * words..][..words]);
    }
    Ok(())
}

/// One row: `out` [vocab] under `mask` [W].
fn mask_row(out: &mut [f32], mask: &[i32]) {
    let covered = out.len().min(mask.len().saturating_mul(32));
    let (head, past) = out.split_at_mut(covered);
    past.fill(f32::NEG_INFINITY);
    let mut chunks = head.chunks_exact_mut(32);
    for (chunk, &word) in (&mut chunks).zip(mask) {
        mask_chunk(chunk, word as u32);
    }
    // The last, partial chunk (vocab not a multiple of 32): its word's high bits are ignored.
    let tail = chunks.into_remainder();
    if !tail.is_empty() {
        mask_chunk(tail, mask[covered / 32] as u32);
    }
}

/// Up to 32 logits under one word.
#[inline(always)]
fn mask_chunk(chunk: &mut [f32], word: u32) {
    if word == u32::MAX {
        return;
    }
    if word == 0 {
        chunk.fill(f32::NEG_INFINITY);
        return;
    }
    for (j, x) in chunk.iter_mut().enumerate() {
        // Branch-free select: a branch per bit mispredicts on mixed words.
        *x = if (word >> j) & 1 == 1 { *x } else { f32::NEG_INFINITY };
    }
}

#[cfg(test)]
mod tests {
    use super::apply_token_bitmask;

    const NEG: f32 = f32::NEG_INFINITY;

    /// The obvious per-token reference: token t of mask row i is allowed iff t < W * 32 and bit
    /// t % 32 of word t / 32 is set.
    fn reference(logits: &mut [f32], num_rows: usize, rows: &[i64], bitmask: &[i32]) {
        let vocab = logits.len() / num_rows;
        let words = bitmask.len() / rows.len().max(1);
        for (i, &row) in rows.iter().enumerate() {
            for t in 0..vocab {
                let allowed = t < words * 32 && (bitmask[i * words + t / 32] as u32 >> (t % 32)) & 1 == 1;
                if !allowed {
                    logits[row as usize * vocab + t] = NEG;
                }
            }
        }
    }

    use crate::tests::Rng;

    impl Rng {
        /// Words that are all ones, all zeros or random, in about equal shares: each of the
        /// kernel's three word paths is taken.
        fn word(&mut self) -> i32 {
            match self.next() % 3 {
                0 => -1,
                1 => 0,
                _ => self.next() as i32,
            }
        }
    }

    fn logits(n: usize) -> Vec<f32> {
        (0..n).map(|i| i as f32 * 0.5 - 7.0).collect()
    }

    fn check(num_rows: usize, vocab: usize, words: usize, rows: &[i64], seed: u64) {
        let mut rng = Rng(seed | 1);
        let bitmask: Vec<i32> = (0..rows.len() * words).map(|_| rng.word()).collect();
        let mut got = logits(num_rows * vocab);
        let mut want = got.clone();
        apply_token_bitmask(&mut got, num_rows, rows, &bitmask).unwrap();
        reference(&mut want, num_rows, rows, &bitmask);
        assert_eq!(got, want, "num_rows {num_rows} vocab {vocab} words {words} rows {rows:?}");
    }

    #[test]
    fn matches_the_reference_on_every_shape_edge() {
        for vocab in [1usize, 31, 32, 33, 63, 64, 65, 100, 1000] {
            let exact = vocab.div_ceil(32);
            // W = ceil(V / 32), narrower (padded model vocabulary), wider, and zero.
            for words in [exact, exact.saturating_sub(1), exact + 2, 0] {
                for (seed, rows) in [&[0i64, 2, 3][..], &[3, 1], &[2], &[]].into_iter().enumerate() {
                    check(4, vocab, words, rows, seed as u64 * 7919 + vocab as u64);
                }
            }
        }
    }

    #[test]
    fn unlisted_rows_are_untouched_and_allowed_logits_kept() {
        let mut l = logits(3 * 40);
        let before = l.clone();
        // row 1: tokens 0 and 33 allowed; the bits of 40..64 (past the vocabulary) are set too
        apply_token_bitmask(&mut l, 3, &[1], &[1, (1 << 1) | !0xff]).unwrap();
        assert_eq!(l[..40], before[..40]);
        assert_eq!(l[80..], before[80..]);
        let finite: Vec<usize> = (0..40).filter(|&t| l[40 + t].is_finite()).collect();
        assert_eq!(finite, [0, 33]);
        assert_eq!((l[40], l[73]), (before[40], before[73]));
    }

    #[test]
    fn all_ones_keeps_and_all_zeros_forbids_everything() {
        let mut l = logits(2 * 70);
        let before = l.clone();
        apply_token_bitmask(&mut l, 2, &[0, 1], &[-1, -1, -1, 0, 0, 0]).unwrap();
        assert_eq!(l[..70], before[..70]);
        assert!(l[70..].iter().all(|&x| x == NEG));
    }

    #[test]
    fn past_the_mask_width_is_forbidden() {
        let mut l = vec![1.0f32; 40];
        apply_token_bitmask(&mut l, 1, &[0], &[-1]).unwrap();
        assert!(l[..32].iter().all(|&x| x == 1.0));
        assert!(l[32..].iter().all(|&x| x == NEG));
    }

    #[test]
    fn a_repeated_row_gets_the_intersection() {
        let mut l = vec![1.0f32; 32];
        apply_token_bitmask(&mut l, 1, &[0, 0], &[0b0110, 0b1100]).unwrap();
        let finite: Vec<usize> = (0..32).filter(|&t| l[t].is_finite()).collect();
        assert_eq!(finite, [2]);
    }

    #[test]
    fn bad_arguments_are_errors_and_write_nothing() {
        let mut l = logits(2 * 8);
        let before = l.clone();
        let cases: [(usize, &[i64], &[i32], &str); 6] = [
            (2, &[0, 2], &[0, 0], "rows[1] = 2 is outside 0..2"),
            (2, &[-1], &[0], "rows[0] = -1 is outside 0..2"),
            (3, &[0], &[0], "not a whole number of 3 rows"),
            (0, &[0], &[0], "num_rows is 0"),
            (2, &[0, 1], &[0, 0, 0], "bitmask has 3 words"),
            (2, &[], &[0], "there are no rows"),
        ];
        for (num_rows, rows, bits, msg) in cases {
            let err = apply_token_bitmask(&mut l, num_rows, rows, bits).unwrap_err();
            assert!(err.contains(msg), "{err:?} should say {msg:?}");
            assert_eq!(l, before);
        }
    }

    #[test]
    fn empty_logits_and_rows_are_fine() {
        apply_token_bitmask(&mut [], 0, &[], &[]).unwrap();
        apply_token_bitmask(&mut [], 3, &[1], &[0, 0]).unwrap(); // vocab 0: nothing to mask
    }
}
