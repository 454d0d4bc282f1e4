//! AVX2+FMA loops of one decode tile (a block of keys against the query heads of a run of kv
//! heads), for head dims that are a multiple of 64.
//!
//! The portable loops in `simd.rs` compute one q.k dot at a time (a horizontal sum for every
//! score) and add each weighted V row into the accumulators in memory (a load and a store per
//! 8 lanes per key). Here the scores of 8 keys are reduced together, and the accumulators of
//! 64 output lanes stay in registers across the whole tile, which makes a cache-hot tile about
//! 3x faster. The summation order of every score and every output lane is fixed by the key's
//! position alone, so a row's result still does not depend on the batch or the threads.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// One tile: `n` keys (or values) of `kvs` kv heads, each with `g` query heads; row `t` of kv
/// head `kv` starts at `t * row_stride + kv * d`, and query head `j`'s scores at
/// `j * bs` (`n <= bs`).
#[derive(Clone, Copy)]
pub(super) struct Tile {
    pub n: usize,
    pub row_stride: usize,
    pub d: usize,
    pub kvs: usize,
    pub g: usize,
    pub bs: usize,
}

/// `scores[j * bs + t] = qs[j] . keys[t, j / g]` for the query heads `j` of `kvs` kv heads
/// (`qs` is `[kvs * g, d]`, `d % 64 == 0`).
///
/// # Safety
/// The CPU must have AVX2 and FMA; `keys` must hold the tile's rows (`(n - 1) * row_stride +
/// kvs * d` elements at least), `scores` `kvs * g * bs` with `n <= bs`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn scores(qs: &[f32], keys: &[f32], tile: Tile, scores: &mut [f32]) {
    let Tile { n, row_stride, d, kvs, g, bs } = tile;
    debug_assert!(d % 64 == 0 && n >= 1 && n <= bs);
    assert!(keys.len() >= (n - 1) * row_stride + kvs * d && qs.len() >= kvs * g * d && scores.len() >= kvs * g * bs);
    for kv in 0..kvs {
        for j in kv * g..(kv + 1) * g {
            let q = qs.as_ptr().add(j * d);
            let mut t0 = 0;
            while t0 < n {
                // 8 keys at a time; past the last key the last row is read again and its
                // scores dropped, so a short group needs no other code path.
                let mut rows = [keys.as_ptr(); 8];
                for (i, row) in rows.iter_mut().enumerate() {
                    *row = row.add((t0 + i).min(n - 1) * row_stride + kv * d);
                }
                let mut acc = [_mm256_setzero_ps(); 8];
                for c in (0..d).step_by(8) {
                    let qc = _mm256_loadu_ps(q.add(c));
                    for i in 0..8 {
                        acc[i] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(rows[i].add(c)), acc[i]);
                    }
                }
                let sums = hsum8(&acc);
                let m = (n - t0).min(8);
                let dst = &mut scores[j * bs + t0..j * bs + t0 + m];
                if m == 8 {
                    _mm256_storeu_ps(dst.as_mut_ptr(), sums);
                } else {
                    // (a short group: a copy of 8 floats is a memmove call, so only here)
                    let mut lanes = [0f32; 8];
                    _mm256_storeu_ps(lanes.as_mut_ptr(), sums);
                    dst.copy_from_slice(&lanes[..m]);
                }
                t0 += 8;
            }
        }
    }
}

/// Lane i of the result is the sum of the 8 lanes of `a[i]`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn hsum8(a: &[__m256; 8]) -> __m256 {
    // hadd pairs neighbours within each 128-bit half; two rounds leave, per half, the four
    // partial sums of a[0..4] (then a[4..8]) over that half's lanes.
    let h01 = _mm256_hadd_ps(a[0], a[1]);
    let h23 = _mm256_hadd_ps(a[2], a[3]);
    let h45 = _mm256_hadd_ps(a[4], a[5]);
    let h67 = _mm256_hadd_ps(a[6], a[7]);
    let lo = _mm256_hadd_ps(h01, h23); // [a0..a3 over lanes 0-3 | a0..a3 over lanes 4-7]
    let hi = _mm256_hadd_ps(h45, h67);
    let first = _mm256_permute2f128_ps(lo, hi, 0x20); // lanes 0-3 halves of a0..a7
    let second = _mm256_permute2f128_ps(lo, hi, 0x31); // lanes 4-7 halves
    _mm256_add_ps(first, second)
}

/// `acc[j] += sum_t weights[j * bs + t] * vals[t, j / g]` for the query heads of `kvs` kv
/// heads (`acc` is `[kvs * g, d]`, `d % 64 == 0`), in key order.
///
/// # Safety
/// As [`scores`], with `vals` for `keys` and `acc` holding `kvs * g * d` elements.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn accumulate(weights: &[f32], vals: &[f32], tile: Tile, acc: &mut [f32]) {
    let Tile { n, row_stride, d, kvs, g, bs } = tile;
    debug_assert!(d % 64 == 0 && n >= 1 && n <= bs);
    assert!(vals.len() >= (n - 1) * row_stride + kvs * d && acc.len() >= kvs * g * d && weights.len() >= kvs * g * bs);
    for j in 0..kvs * g {
        let kv = j / g;
        let w = &weights[j * bs..j * bs + n];
        for seg in (0..d).step_by(64) {
            let out = acc.as_mut_ptr().add(j * d + seg);
            let mut r = [_mm256_setzero_ps(); 8];
            for (c, x) in r.iter_mut().enumerate() {
                *x = _mm256_loadu_ps(out.add(8 * c));
            }
            for (t, &p) in w.iter().enumerate() {
                let v = vals.as_ptr().add(t * row_stride + kv * d + seg);
                let p = _mm256_set1_ps(p);
                for (c, x) in r.iter_mut().enumerate() {
                    *x = _mm256_fmadd_ps(p, _mm256_loadu_ps(v.add(8 * c)), *x);
                }
            }
            for (c, x) in r.iter().enumerate() {
                _mm256_storeu_ps(out.add(8 * c), *x);
            }
        }
    }
}
