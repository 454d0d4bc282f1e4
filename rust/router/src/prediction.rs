//! OpenAI's Predicted Outputs (chat's `prediction`): how many of the prediction's tokens the
//! output holds, for `usage.completion_tokens_details` (`accepted_prediction_tokens`, and the
//! rest of the prediction as `rejected_prediction_tokens`).
//!
//! "Holds" is the longest common subsequence of the prediction's and the choice's token ids:
//! the prediction's tokens that appear in the output, in order. It depends on the output
//! alone, not on which drafts a step happened to check (the scheduler drafts from the
//! prediction to go faster; `llmserve_scheduler::Speculation`), so it is the same however the
//! request was batched.
//!
//! Cost: bit-parallel LCS (Allison and Dix; Hyyrö's form), one pass per output token over
//! ceil(m / 64) words for a prediction of m tokens (the router takes at most max_model_len);
//! the prediction's match masks are made once per request, sparse: O(m) memory whatever its
//! vocabulary.

use std::collections::HashMap;

/// A tokenized prediction and, per distinct token, the bit mask of its positions, as its
/// non-zero words: (word index, bits), ascending.
#[derive(Debug)]
pub struct Predicted {
    len: usize,
    masks: HashMap<u32, Vec<(usize, u64)>>,
}

/// One choice's progress against a [`Predicted`]: the LCS bit vector (a 0 bit per prediction
/// token matched so far).
#[derive(Clone, Debug)]
pub struct Alignment {
    v: Vec<u64>,
}

impl Predicted {
    pub fn new(ids: &[u32]) -> Self {
        let mut masks: HashMap<u32, Vec<(usize, u64)>> = HashMap::new();
        for (i, &t) in ids.iter().enumerate() {
            let words = masks.entry(t).or_default();
            match words.last_mut() {
                Some((w, bits)) if *w == i / 64 => *bits |= 1 << (i % 64),
                _ => words.push((i / 64, 1 << (i % 64))),
            }
        }
        Predicted { len: ids.len(), masks }
    }

    /// The prediction's length in tokens.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A fresh alignment (no output yet).
    pub fn start(&self) -> Alignment {
        Alignment { v: vec![u64::MAX; self.len.div_ceil(64)] }
    }
}

impl Alignment {
    /// The output's next token.
    pub fn push(&mut self, p: &Predicted, token: u32) {
        let Some(mask) = p.masks.get(&token) else { return };
        // V = (V + (V & M)) | (V & !M), the sum carried across words (M's zero words too: a
        // carry runs on through them)
        let mut carry = false;
        let mut words = mask.iter().peekable();
        for (w, v) in self.v.iter_mut().enumerate() {
            let m = match words.peek() {
                Some(&&(at, bits)) if at == w => {
                    words.next();
                    bits
                }
                _ if !carry => continue, // (no bits, no carry: the word stays)
                _ => 0,
            };
            let u = *v & m;
            let (sum, c1) = v.overflowing_add(u);
            let (sum, c2) = sum.overflowing_add(u64::from(carry));
            carry = c1 || c2;
            *v = sum | (*v & !m);
        }
    }

    /// The prediction's tokens the output so far holds (its LCS with the prediction).
    pub fn common(&self, p: &Predicted) -> u64 {
        let ones: u32 = self
            .v
            .iter()
            .enumerate()
            .map(|(w, &v)| {
                let bits = (p.len - w * 64).min(64);
                let low = if bits == 64 { u64::MAX } else { (1u64 << bits) - 1 };
                (v & low).count_ones()
            })
            .sum();
        (p.len as u64) - u64::from(ones)
    }
}

#[cfg(test)]
mod tests {
    use super::Predicted;

    fn lcs(a: &[u32], b: &[u32]) -> u64 {
        let mut row = vec![0u64; b.len() + 1];
        for &x in a {
            let mut diag = 0;
            for (j, &y) in b.iter().enumerate() {
                let up = row[j + 1];
                row[j + 1] = if x == y { diag + 1 } else { up.max(row[j]) };
                diag = up;
            }
        }
        row[b.len()]
    }

    #[test]
    fn common_tokens_are_the_longest_common_subsequence() {
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut next = |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % n) as u32
        };
        // lengths around the 64-bit word boundaries, alphabets small and large
        for &(m, n, alphabet) in
            &[(0, 5, 3), (1, 1, 2), (63, 70, 4), (64, 64, 3), (65, 40, 5), (130, 200, 6), (200, 150, 40)]
        {
            for _ in 0..20 {
                let predicted: Vec<u32> = (0..m).map(|_| next(alphabet)).collect();
                let output: Vec<u32> = (0..n).map(|_| next(alphabet)).collect();
                let p = Predicted::new(&predicted);
                let mut a = p.start();
                for (i, &t) in output.iter().enumerate() {
                    a.push(&p, t);
                    assert_eq!(a.common(&p), lcs(&predicted, &output[..=i]), "m {m} after {} tokens", i + 1);
                }
            }
        }
    }

    #[test]
    fn an_edited_copy_holds_all_but_the_edit() {
        let predicted: Vec<u32> = (0..100).collect();
        let mut output: Vec<u32> = (0..100).collect();
        output[40] = 1000; // one token replaced
        output.insert(70, 2000); // one inserted
        let p = Predicted::new(&predicted);
        let mut a = p.start();
        output.iter().for_each(|&t| a.push(&p, t));
        assert_eq!(a.common(&p), 99);
        assert_eq!(p.len(), 100);
    }
}
