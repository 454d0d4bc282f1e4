//! AVX-512 loops of one decode tile (`Isa::Avx512`):
//! - the scores, with the tile's keys transposed into lanes ([`transpose_keys`], then
//!   [`score_jobs`]): no horizontal sum per score, and one transposition for every query
//!   vector that reads the tile. These sums are this path's own (decode.rs's module doc);
//! - the tile's online softmax, 16 lanes at a time ([`online_softmax`]);
//! - the values' half, the weighted sum of V rows ([`accumulate`]), for head dims that are a
//!   multiple of 64. Each output lane is the AVX2 loop's sum in the same order (the lane's
//!   running sum, one fused multiply-add per key in key order), so those bits are the AVX2
//!   path's; only more of them are computed per instruction.
//!
//! NOTE: the AVX2 V loop keeps one query head's 64 output lanes in 8 registers and loads every
//! V row once per head (9 loads per 8 fused multiply-adds). Here the 32 registers hold 64 lanes
//! of 3 query heads at once, so each V row is loaded once for the 3 (7 loads per 12).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::avx2::Tile;

/// `acc[j] += sum_t weights[j * bs + t] * vals[t, j / g]` for the query heads of `kvs` kv
/// heads (`acc` is `[kvs * g, d]`, `d % 64 == 0`), in key order: [`super::avx2::accumulate`]'s
/// result, bit for bit.
///
/// # Safety
/// The CPU must have AVX-512F; `vals` must hold the tile's rows (`(n - 1) * row_stride + kvs *
/// d` elements at least), `acc` `kvs * g * d` and `weights` `kvs * g * bs`, with `n <= bs`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn accumulate(weights: &[f32], vals: &[f32], tile: Tile, acc: &mut [f32]) {
    let Tile { n, row_stride, d, kvs, g, bs } = tile;
    debug_assert!(d % 64 == 0 && n >= 1 && n <= bs);
    assert!(vals.len() >= (n - 1) * row_stride + kvs * d && acc.len() >= kvs * g * d && weights.len() >= kvs * g * bs);
    for kv in 0..kvs {
        let mut j = kv * g;
        while j < (kv + 1) * g {
            let heads = ((kv + 1) * g - j).min(3);
            for seg in (0..d).step_by(64) {
                let v = vals.as_ptr().add(kv * d + seg);
                match heads {
                    3 => heads_segment::<3>(weights, v, tile, acc, j, seg),
                    2 => heads_segment::<2>(weights, v, tile, acc, j, seg),
                    _ => heads_segment::<1>(weights, v, tile, acc, j, seg),
                }
            }
            j += heads;
        }
    }
}

/// Query heads j..j + H, output lanes seg..seg + 64: their accumulators stay in registers over
/// the tile's `n` keys (`v` points at the first key's lanes of this segment).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn heads_segment<const H: usize>(
    weights: &[f32],
    v: *const f32,
    tile: Tile,
    acc: &mut [f32],
    j: usize,
    seg: usize,
) {
    let Tile { n, row_stride, d, bs, .. } = tile;
    let mut r = [[_mm512_setzero_ps(); 4]; H];
    for (h, lanes) in r.iter_mut().enumerate() {
        let out = acc.as_ptr().add((j + h) * d + seg);
        for (c, x) in lanes.iter_mut().enumerate() {
            *x = _mm512_loadu_ps(out.add(16 * c));
        }
    }
    for t in 0..n {
        let row = v.add(t * row_stride);
        let vs = [0, 1, 2, 3].map(|c| _mm512_loadu_ps(row.add(16 * c)));
        for (h, lanes) in r.iter_mut().enumerate() {
            let p = _mm512_set1_ps(*weights.get_unchecked((j + h) * bs + t));
            for (x, v) in lanes.iter_mut().zip(vs) {
                *x = _mm512_fmadd_ps(p, v, *x);
            }
        }
    }
    for (h, lanes) in r.iter().enumerate() {
        let out = acc.as_mut_ptr().add((j + h) * d + seg);
        for (c, x) in lanes.iter().enumerate() {
            _mm512_storeu_ps(out.add(16 * c), *x);
        }
    }
}

/// Keys in lanes: `kt[c * 16 + t] = keys[t * row_stride + c]` for the tile's `n` keys (`t < n
/// <= 16`) and `c < d` (`d % 16 == 0`), 0 in the lanes of t >= n. `keys` points at the first
/// key's row of one kv head.
///
/// # Safety
/// The CPU must have AVX-512F; `keys` must hold `(n - 1) * row_stride + d` elements from where
/// it points, `kt` `16 * d`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn transpose_keys(keys: *const f32, n: usize, row_stride: usize, d: usize, kt: *mut f32) {
    debug_assert!(d.is_multiple_of(16) && (1..=16).contains(&n));
    for s in (0..d).step_by(16) {
        let r: [__m512; 16] = std::array::from_fn(|t| {
            if t < n {
                _mm512_loadu_ps(keys.add(t * row_stride + s))
            } else {
                _mm512_setzero_ps()
            }
        });
        for (c, col) in transpose16(r).iter().enumerate() {
            _mm512_storeu_ps(kt.add((s + c) * 16), *col);
        }
    }
}

/// The 16 x 16 transpose of `r` (row t, lane c -> row c, lane t).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn transpose16(r: [__m512; 16]) -> [__m512; 16] {
    // t[2p], t[2p + 1]: rows 2p and 2p + 1 interleaved; per 128-bit lane l, columns 4l, 4l + 1
    // (then 4l + 2, 4l + 3) of the two rows
    let t: [__m512; 16] = std::array::from_fn(|i| {
        let (a, b) = (r[i & !1], r[i | 1]);
        if i % 2 == 0 {
            _mm512_unpacklo_ps(a, b)
        } else {
            _mm512_unpackhi_ps(a, b)
        }
    });
    // u[4q + k]: per 128-bit lane l, column 4l + k of rows 4q..4q + 4
    let u: [__m512; 16] = std::array::from_fn(|i| {
        let (q, k) = (i / 4, i % 4);
        let (a, b) = (_mm512_castps_pd(t[4 * q + k / 2]), _mm512_castps_pd(t[4 * q + k / 2 + 2]));
        _mm512_castpd_ps(if k % 2 == 0 { _mm512_unpacklo_pd(a, b) } else { _mm512_unpackhi_pd(a, b) })
    });
    // column 4l + k gathers lane l of u[k], u[4 + k], u[8 + k], u[12 + k]
    let mut out = [_mm512_setzero_ps(); 16];
    for k in 0..4 {
        let a_lo = _mm512_shuffle_f32x4::<0x44>(u[k], u[4 + k]);
        let a_hi = _mm512_shuffle_f32x4::<0xEE>(u[k], u[4 + k]);
        let b_lo = _mm512_shuffle_f32x4::<0x44>(u[8 + k], u[12 + k]);
        let b_hi = _mm512_shuffle_f32x4::<0xEE>(u[8 + k], u[12 + k]);
        out[k] = _mm512_shuffle_f32x4::<0x88>(a_lo, b_lo);
        out[4 + k] = _mm512_shuffle_f32x4::<0xDD>(a_lo, b_lo);
        out[8 + k] = _mm512_shuffle_f32x4::<0x88>(a_hi, b_hi);
        out[12 + k] = _mm512_shuffle_f32x4::<0xDD>(a_hi, b_hi);
    }
    out
}

/// One query vector's scores against a tile of keys in lanes: `out[t] = q . k_t` for t < n.
#[derive(Clone, Copy)]
pub(super) struct Job {
    pub q: *const f32,
    pub out: *mut f32,
    pub n: usize,
}

/// Every job's scores against the keys `kt` (laid out by [`transpose_keys`]). Each score is two
/// running sums, `s0 = fma(q[c], k_t[c], s0)` over the even c in order from 0 and `s1` likewise
/// over the odd ones, then `s0 + s1`: what it is does not depend on which jobs run beside it.
/// (One sum alone was 1.45x further from the exact result than AVX2's tree, two 1.17x, four as
/// close but 7-10% slower, on `tests.rs`'s random cases.)
///
/// NOTE: no horizontal sums (the AVX2 loop reduces 8 lanes for every score): a key per lane,
/// and up to 12 jobs at once, so that each row of `kt` is loaded once for all of them and enough
/// independent sums are in flight to hide the fused multiply-add's latency.
///
/// # Safety
/// The CPU must have AVX-512F; `kt` must hold `16 * d` elements, each job's `q` `d` and `out` `n`
/// (`1 <= n <= 16`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn score_jobs(kt: *const f32, jobs: &[Job], d: usize) {
    if jobs.is_empty() {
        return;
    }
    let size = jobs.len().div_ceil(jobs.len().div_ceil(12)); // even blocks of at most 12
    for block in jobs.chunks(size) {
        match block.len() {
            1 => job_block::<1>(kt, block, d),
            2 => job_block::<2>(kt, block, d),
            3 => job_block::<3>(kt, block, d),
            4 => job_block::<4>(kt, block, d),
            5 => job_block::<5>(kt, block, d),
            6 => job_block::<6>(kt, block, d),
            7 => job_block::<7>(kt, block, d),
            8 => job_block::<8>(kt, block, d),
            9 => job_block::<9>(kt, block, d),
            10 => job_block::<10>(kt, block, d),
            11 => job_block::<11>(kt, block, d),
            _ => job_block::<12>(kt, block, d),
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn job_block<const Q: usize>(kt: *const f32, jobs: &[Job], d: usize) {
    let jobs: [Job; Q] = std::array::from_fn(|i| jobs[i]);
    let (mut even, mut odd) = ([_mm512_setzero_ps(); Q], [_mm512_setzero_ps(); Q]);
    for c in (0..d).step_by(2) {
        let (k0, k1) = (_mm512_loadu_ps(kt.add(16 * c)), _mm512_loadu_ps(kt.add(16 * c + 16)));
        for ((s0, s1), job) in even.iter_mut().zip(odd.iter_mut()).zip(&jobs) {
            *s0 = _mm512_fmadd_ps(_mm512_set1_ps(*job.q.add(c)), k0, *s0);
            *s1 = _mm512_fmadd_ps(_mm512_set1_ps(*job.q.add(c + 1)), k1, *s1);
        }
    }
    for ((s0, s1), job) in even.iter().zip(&odd).zip(&jobs) {
        _mm512_mask_storeu_ps(job.out, ((1u32 << job.n) - 1) as u16, _mm512_add_ps(*s0, *s1));
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use crate::decode::Isa;
    use crate::tests::Rng;

    /// Whether this CPU runs these loops (else the test says so and checks nothing).
    fn detected() -> bool {
        let wide = Isa::detect() == Isa::Avx512;
        if !wide {
            eprintln!("no AVX-512F: not checked");
        }
        wide
    }

    #[test]
    fn the_values_sums_are_avx2s_bit_for_bit() {
        if !detected() {
            return;
        }
        let mut rng = Rng(7);
        for (kvs, g, d) in [(3, 3, 64), (2, 4, 128), (1, 1, 64), (2, 5, 64)] {
            for n in [1, 7, 16] {
                let (bs, row_stride) = (16, kvs * d);
                let tile = Tile { n, row_stride, d, kvs, g, bs };
                let vals = rng.vec(bs * row_stride, 1.0);
                let weights = rng.vec(kvs * g * bs, 1.0);
                let start = rng.vec(kvs * g * d, 1.0);
                let (mut wide, mut narrow) = (start.clone(), start);
                // SAFETY: AVX-512F (and so AVX2 and FMA) detected above; sizes as documented.
                unsafe {
                    accumulate(&weights, &vals, tile, &mut wide);
                    super::super::avx2::accumulate(&weights, &vals, tile, &mut narrow);
                }
                let same = wide.iter().zip(&narrow).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "kvs {kvs} g {g} d {d} n {n}");
            }
        }
    }

    #[test]
    fn keys_go_to_lanes() {
        if !detected() {
            return;
        }
        let mut rng = Rng(8);
        for (d, row_stride, n) in [(64, 192, 16), (32, 40, 5), (128, 128, 1)] {
            let keys = rng.vec(15 * row_stride + d, 1.0);
            let mut kt = vec![f32::NAN; 16 * d];
            // SAFETY: AVX-512F detected above; keys holds (n - 1) * row_stride + d elements.
            unsafe { transpose_keys(keys.as_ptr(), n, row_stride, d, kt.as_mut_ptr()) };
            for c in 0..d {
                for t in 0..16 {
                    let want = if t < n { keys[t * row_stride + c] } else { 0.0 };
                    assert_eq!(kt[c * 16 + t].to_bits(), want.to_bits(), "d {d} n {n} c {c} t {t}");
                }
            }
        }
    }
}

/// One tile's online-softmax step for each query head (the scalar loop's, `online_softmax` in
/// decode.rs, in vector form): head j's `n` scores at `scores[j * bs..]` become their weights
/// e^(s - m'), where m' is the larger of the head's running max `m[j]` and the tile's; what was
/// summed under a smaller max (`l[j]` and the head's `d` accumulators) is rescaled to m' first,
/// and the weights' sum is added to `l[j]`.
///
/// # Safety
/// The CPU must have AVX-512F; `scores` must hold `heads * bs` elements (`1 <= n <= bs`,
/// `n <= 16`), `m` and `l` `heads`, `acc` `heads * d` (`d % 16 == 0`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn online_softmax(
    scores: &mut [f32],
    n: usize,
    bs: usize,
    m: &mut [f32],
    l: &mut [f32],
    acc: &mut [f32],
) {
    let (heads, d) = (m.len(), acc.len() / m.len().max(1));
    assert!(scores.len() >= heads * bs && l.len() == heads && (1..=bs.min(16)).contains(&n) && d.is_multiple_of(16));
    let mask = ((1u32 << n) - 1) as u16;
    for j in 0..heads {
        let at = scores.as_mut_ptr().add(j * bs);
        let x = _mm512_mask_loadu_ps(_mm512_set1_ps(f32::NEG_INFINITY), mask, at);
        let new_m = m[j].max(_mm512_reduce_max_ps(x));
        if new_m > m[j] {
            // rescale what was accumulated under the old max (0 on the first tile)
            let c = crate::simd::exp_neg(m[j] - new_m);
            l[j] *= c;
            let a = acc.as_mut_ptr().add(j * d);
            for i in (0..d).step_by(16) {
                _mm512_storeu_ps(a.add(i), _mm512_mul_ps(_mm512_loadu_ps(a.add(i)), _mm512_set1_ps(c)));
            }
            m[j] = new_m;
        }
        let w = _mm512_maskz_mov_ps(mask, exp_neg(_mm512_sub_ps(x, _mm512_set1_ps(new_m))));
        _mm512_mask_storeu_ps(at, mask, w);
        l[j] += _mm512_reduce_add_ps(w);
    }
}

/// e^x lane by lane for x <= 0: `simd::exp_neg`'s range reduction and polynomial, with fused
/// multiply-adds.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn exp_neg(x: __m512) -> __m512 {
    let c = |v: f32| _mm512_set1_ps(v);
    let x = _mm512_min_ps(_mm512_max_ps(x, c(-87.0)), c(0.0));
    let t = _mm512_fmadd_ps(x, c(std::f32::consts::LOG2_E), c(12_582_912.0));
    let n = _mm512_sub_ps(t, c(12_582_912.0));
    let r = _mm512_fnmadd_ps(n, c(1.428_606_8e-6), _mm512_fnmadd_ps(n, c(0.693_145_75), x));
    let mut p = c(1.0 / 5040.0);
    for k in [1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = _mm512_fmadd_ps(p, r, c(k));
    }
    let two_n = _mm512_slli_epi32::<23>(_mm512_sub_epi32(_mm512_castps_si512(t), _mm512_set1_epi32(0x4B40_0000 - 127)));
    _mm512_mul_ps(p, _mm512_castsi512_ps(two_n))
}
