//! The activations of one call as int8 blocks of 32 (llama.cpp's q8_1 idea): per block a
//! scale `d = max|x| / 127`, integers `q = round_half_even(x * (127 / max|x|))` in
//! [-127, 127], and `s = d * sum(q)`, the block's sum as the integers represent it, which the
//! Q4 formats' offset term multiplies by the weight block's min.
//!
//! One code path for every instruction set (the AVX2 entry only compiles the same loops with
//! wider vectors), so the integers and scales are bit-identical whichever kernel reads them;
//! the tests' reference (numpy or Rust) reproduces them with the same f32 operations.

use super::{Isa, BLOCK, TOKENS_PER_PASS};

/// 1.5 * 2^23: adding it to |v| < 2^22 leaves round_half_even(v) in the low mantissa bits
/// (the FPU's default rounding), a form that vectorizes even on plain SSE2.
const MAGIC: f32 = 12_582_912.0;

/// The smallest block maximum quantized as it is (127 times the smallest normal f32): below
/// it `127 / amax` nears or passes f32::MAX. Smaller blocks count as zero.
const MIN_AMAX: f32 = 127.0 * f32::MIN_POSITIVE;

/// x [tokens, cols] quantized. The integers keep x's layout; the scales and sums are stored
/// block-major, `d[b * stride + t]` (a kernel pass reads token j's value of block b at
/// `b * stride + t0 + j`).
pub(super) struct Q8Activations {
    pub qs: Vec<i8>, // [tokens, cols]
    pub d: Vec<f32>, // [cols / 32, stride]
    pub s: Vec<f32>, // [cols / 32, stride]: d * sum(q)
    /// tokens rounded up to a multiple of TOKENS_PER_PASS (padding lanes are 0)
    pub stride: usize,
}

impl Q8Activations {
    /// x [tokens, cols]; `cols` a multiple of 32 (the caller checked it).
    pub fn quantize(x: &[f32], tokens: usize, cols: usize, isa: Isa) -> Self {
        let nb = cols / BLOCK;
        let stride = tokens.div_ceil(TOKENS_PER_PASS) * TOKENS_PER_PASS;
        let mut a = Self { qs: vec![0; tokens * cols], d: vec![0.0; nb * stride], s: vec![0.0; nb * stride], stride };
        match isa {
            Isa::Portable => quantize_blocks(x, nb, &mut a),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: these are only passed after Isa::supported() found the features.
            Isa::Avx2 | Isa::Avx2Vnni => unsafe { quantize_blocks_avx2(x, nb, &mut a) },
        }
        a
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_blocks_avx2(x: &[f32], nb: usize, a: &mut Q8Activations) {
    // Same operations as the portable path (Rust never contracts a * b + c into an FMA), so
    // the same bits; only the vector width differs.
    quantize_blocks(x, nb, a)
}

#[inline(always)]
fn quantize_blocks(x: &[f32], nb: usize, a: &mut Q8Activations) {
    let blocks = x.chunks_exact(BLOCK).zip(a.qs.chunks_exact_mut(BLOCK));
    for (i, (xb, qb)) in blocks.enumerate() {
        let at = (i % nb) * a.stride + i / nb; // block i % nb of token i / nb
        (a.d[at], a.s[at]) = quantize_block(xb.try_into().unwrap(), qb.try_into().unwrap());
    }
}

/// One block: fills `q`, returns (d, s). A non-finite value gives q = 0 and d = s = NaN, so
/// every dot product with the block is NaN instead of a silently wrong number.
#[inline(always)]
fn quantize_block(x: &[f32; BLOCK], q: &mut [i8; BLOCK]) -> (f32, f32) {
    // 8 lanes of max and of the finiteness check, so the loop vectorizes.
    let mut amax = [0f32; 8];
    let mut finite = [true; 8];
    for c in x.chunks_exact(8) {
        for l in 0..8 {
            let a = c[l].abs();
            amax[l] = if a > amax[l] { a } else { amax[l] };
            finite[l] &= a <= f32::MAX;
        }
    }
    if finite.contains(&false) {
        *q = [0; BLOCK];
        return (f32::NAN, f32::NAN);
    }
    let amax = amax.iter().fold(0f32, |m, &a| if a > m { a } else { m });
    if amax < MIN_AMAX {
        // 127 / amax would overflow (or lose the block to subnormals): the block counts as
        // zero, an error below 2e-36 per value.
        *q = [0; BLOCK];
        return (0.0, 0.0);
    }
    let d = amax / 127.0;
    let id = 127.0 / amax;
    let mut sum = 0i32;
    for (q, &v) in q.iter_mut().zip(x) {
        // |v * id| <= 127 (plus rounding), so the integer fits an i8
        let r = (v * id + MAGIC).to_bits() as i32 - MAGIC.to_bits() as i32;
        *q = r as i8;
        sum += r;
    }
    (d, d * sum as f32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_half_to_even_and_maps_the_max_to_127() {
        let mut x = [0f32; BLOCK];
        x[0] = -2.54; // the max: -127
        x[1] = 0.01; // 0.5 -> 0 (half to even)
        x[2] = 0.03; // 1.5 -> 2
        x[3] = 1.0; // 50
        x[4] = -0.05; // -2.5 -> -2
        let mut q = [0i8; BLOCK];
        let (d, s) = quantize_block(&x, &mut q);
        assert_eq!(d, 2.54f32 / 127.0);
        // 0.01 * (127 / 2.54) is 0.5 only up to rounding; check against the same f32 math
        let id = 127.0f32 / 2.54;
        for i in 0..5 {
            assert_eq!(q[i] as f32, (x[i] * id).round_ties_even(), "{i}");
        }
        assert_eq!(q[0], -127);
        assert_eq!(q[3], 50);
        assert_eq!(s, d * q.iter().map(|&v| v as i32).sum::<i32>() as f32);
        for (i, &v) in x.iter().enumerate() {
            assert!((v - d * q[i] as f32).abs() <= d * 0.5 + 1e-7, "{i}");
        }
    }

    #[test]
    fn zero_tiny_and_non_finite_blocks() {
        let mut q = [1i8; BLOCK];
        assert_eq!(quantize_block(&[0.0; BLOCK], &mut q), (0.0, 0.0));
        assert_eq!(q, [0; BLOCK]);
        // 127 / 1e-37 overflows f32: such a block counts as zero (it used to overflow the sum)
        let mut tiny = [1e-37f32; BLOCK];
        tiny[3] = -1e-38;
        q = [1; BLOCK];
        assert_eq!(quantize_block(&tiny, &mut q), (0.0, 0.0));
        assert_eq!(q, [0; BLOCK]);
        let mut small = [0f32; BLOCK];
        small[0] = 2.0 * MIN_AMAX; // still quantized as it is
        assert_eq!(quantize_block(&small, &mut q).0, small[0] / 127.0);
        assert_eq!(q[0], 127);
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut x = [1.0f32; BLOCK];
            x[17] = bad;
            let (d, s) = quantize_block(&x, &mut q);
            assert!(d.is_nan() && s.is_nan());
            assert_eq!(q, [0; BLOCK]);
        }
    }

    #[test]
    fn every_isa_gives_the_same_bits() {
        let x: Vec<f32> = (0..BLOCK * 37).map(|i| ((i * 7919) % 1013) as f32 / 97.0 - 5.0).collect();
        let want = Q8Activations::quantize(&x, 37, BLOCK, Isa::Portable);
        let got = Q8Activations::quantize(&x, 37, BLOCK, Isa::detect());
        assert_eq!(want.stride, 40);
        assert_eq!(got.qs, want.qs);
        assert_eq!(got.d, want.d);
        assert_eq!(got.s, want.s);
    }
}
