//! The inner loops of the kernels, written so LLVM auto-vectorizes them (fixed 8-lane f32
//! chunks, several independent accumulators) and generic over `FMA`: `true` only inside
//! functions compiled with `#[target_feature(enable = "avx2,fma")]`, where `mul_add` becomes
//! one instruction. Outside those, `mul_add` would be a libm call, so `FMA = false` keeps the
//! plain multiply-add.
//!
//! Every function here is `#[inline(always)]` so that it is compiled with the target features
//! of the function it lands in.

const LANES: usize = 8;

#[inline(always)]
fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// sum(a[i] * b[i]); `a` and `b` have the same length.
#[inline(always)]
pub(crate) fn dot<const FMA: bool>(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    // NOTE: two accumulators of 8 lanes hide the FMA latency at head_dim 64 (8 chunks of 8).
    let mut acc0 = [0f32; LANES];
    let mut acc1 = [0f32; LANES];
    let mut ca = a.chunks_exact(2 * LANES);
    let mut cb = b.chunks_exact(2 * LANES);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for i in 0..LANES {
            acc0[i] = madd::<FMA>(x[i], y[i], acc0[i]);
            acc1[i] = madd::<FMA>(x[LANES + i], y[LANES + i], acc1[i]);
        }
    }
    let mut tail = 0f32;
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        tail = madd::<FMA>(*x, *y, tail);
    }
    let mut s = [0f32; LANES];
    for i in 0..LANES {
        s[i] = acc0[i] + acc1[i];
    }
    // pairwise: (0+4, 1+5, 2+6, 3+7) then halves, as a horizontal add would
    let s4 = [s[0] + s[4], s[1] + s[5], s[2] + s[6], s[3] + s[7]];
    (s4[0] + s4[2]) + (s4[1] + s4[3]) + tail
}

/// acc[i] += p * x[i]
#[inline(always)]
pub(crate) fn axpy<const FMA: bool>(acc: &mut [f32], p: f32, x: &[f32]) {
    let n = acc.len().min(x.len());
    let (acc, x) = (&mut acc[..n], &x[..n]);
    let mut ca = acc.chunks_exact_mut(LANES);
    let mut cx = x.chunks_exact(LANES);
    for (a, v) in (&mut ca).zip(&mut cx) {
        // NOTE: load, compute, store through a local array: written in place, LLVM guarded the
        // vector loop with an aliasing check that failed and ran the scalar loop instead.
        let mut t = [0f32; LANES];
        t.copy_from_slice(a);
        for i in 0..LANES {
            t[i] = madd::<FMA>(p, v[i], t[i]);
        }
        a.copy_from_slice(&t);
    }
    for (a, v) in ca.into_remainder().iter_mut().zip(cx.remainder()) {
        *a = madd::<FMA>(p, *v, *a);
    }
}

/// x[i] *= c
#[inline(always)]
pub(crate) fn scale(x: &mut [f32], c: f32) {
    for v in x.iter_mut() {
        *v *= c;
    }
}

/// e^x for x <= 0 (scores minus their running max); relative error below 2e-7 on [-87, 0],
/// and inputs below -87 give e^-87 (~1.6e-38), which is 0 for every sum it enters.
///
/// NOTE: `f32::exp` is a libm call per element and does not vectorize; one exp per score
/// per query head is about as many operations as the dot product itself at head_dim 64.
#[inline(always)]
pub(crate) fn exp_neg(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split in two so that n * LN2_HI is exact for |n| < 2^8
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // 1.5 * 2^23: adding it rounds to the nearest integer, which lands in the low mantissa bits
    const MAGIC: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 0.0);
    let t = x * LOG2E + MAGIC;
    let n = t - MAGIC;
    let r = (x - n * LN2_HI) - n * LN2_LO; // |r| <= ln2 / 2
    let mut p = 1.0 / 5040.0;
    p = p * r + 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    // 2^n built from its bits: t's bits are 0x4B40_0000 + n, the biased exponent is n + 127
    let two_n = f32::from_bits(t.to_bits().wrapping_sub(0x4B40_0000 - 127) << 23);
    p * two_n
}

/// x[i] = e^(x[i] - m) for x[i] <= m; returns the sum of the new values.
#[inline(always)]
pub(crate) fn exp_sub_sum(x: &mut [f32], m: f32) -> f32 {
    let mut acc = [0f32; LANES];
    let mut cx = x.chunks_exact_mut(LANES);
    for c in &mut cx {
        for i in 0..LANES {
            c[i] = exp_neg(c[i] - m);
            acc[i] += c[i];
        }
    }
    let mut sum = 0f32;
    for v in cx.into_remainder() {
        *v = exp_neg(*v - m);
        sum += *v;
    }
    sum + acc.iter().sum::<f32>()
}

/// Asks the CPU to start loading the cache lines of `x` into L2 (no effect on the result).
///
/// NOTE: a (sequence, kv head) reads 16-row blocks scattered over the cache, each row a
/// strided 256 bytes: the hardware prefetchers lose the stream at every block boundary, and
/// the kernel stalled on those loads. Prefetching the next block while computing this one
/// hides most of that latency. Into L2, not L1: the decode kernel asks for 4 blocks ahead, 96
/// KiB of SmolLM2's f32 K and V, twice an L1. Measured with `cargo bench --bench decode` (2
/// threads, medians of 30): at 256 x 1025 tokens (the cache from memory) f32 1.04x and
/// bfloat16 1.11x faster than into L1, at 64 x 257 f32 the same and bfloat16 1.1x.
#[inline(always)]
pub(crate) fn prefetch<T>(x: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        let line = 64 / std::mem::size_of::<T>().max(1);
        let mut i = 0;
        while i < x.len() {
            // SAFETY: a prefetch never faults, and the address is inside `x` anyway.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(x.as_ptr().add(i) as *const i8) };
            i += line;
        }
        if let Some(last) = x.last() {
            // the final line when x does not start on a line boundary
            unsafe { _mm_prefetch::<_MM_HINT_T1>(last as *const T as *const i8) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = x;
}

/// The largest element (`-inf` for an empty slice).
#[inline(always)]
pub(crate) fn max(x: &[f32]) -> f32 {
    x.iter().fold(f32::NEG_INFINITY, |a, &b| if b > a { b } else { a })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_neg_matches_libm() {
        let mut x = 0.0f32;
        while x > -87.0 {
            let (got, want) = (exp_neg(x), x.exp());
            assert!(((got - want) / want).abs() < 2e-7, "x={x} got={got} want={want}");
            x -= 0.0137;
        }
        assert!(exp_neg(-1e4) < 1e-37 && exp_neg(f32::NEG_INFINITY) < 1e-37);
        assert_eq!(exp_neg(0.0), 1.0);
    }

    #[test]
    fn dot_and_axpy_handle_tails() {
        for n in [0, 1, 7, 8, 15, 16, 17, 64, 100, 128] {
            let a: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 - 3.0).collect();
            let b: Vec<f32> = (0..n).map(|i| 1.0 - i as f32 * 0.25).collect();
            let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            assert!((dot::<false>(&a, &b) as f64 - want).abs() < 1e-3 * (1.0 + want.abs()));
            let mut acc = b.clone();
            axpy::<false>(&mut acc, 2.0, &a);
            for i in 0..n {
                assert_eq!(acc[i], b[i] + 2.0 * a[i]);
            }
        }
    }
}
