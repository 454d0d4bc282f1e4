//! The element types a paged KV cache may hold (`--kv-cache-dtype`): f32, bfloat16 and the two
//! OCP 8-bit floats, E4M3 (`fp8_e4m3`, torch's `float8_e4m3fn`) and E5M2 (`fp8_e5m2`).
//!
//! The kernels compute in f32: a tile of cached rows is widened to f32 before use, and a new
//! K/V row is narrowed as it is written. Widening is exact for every format. Narrowing rounds to
//! nearest-even and saturates at the format's largest finite value: the same bits as torch's
//! cast after a clamp to that value, which is how the torch path writes the cache
//! (`worker/kv_cache.py`), so a token's cached bytes do not depend on which path wrote them.
//! There are no scales (vLLM's default of 1.0).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// One element of a KV cache. `widen` is exact; `narrow` rounds (see the module doc).
pub trait KvElem: Copy + Send + Sync + 'static {
    /// The name `--kv-cache-dtype` gives it (and the binding takes).
    const NAME: &'static str;
    /// The plain type of its bits (what numpy holds: f32, u16 or u8).
    type Bits: Copy + 'static;
    fn from_bits(s: &[Self::Bits]) -> &[Self];
    fn from_bits_mut(s: &mut [Self::Bits]) -> &mut [Self];
    fn narrow(x: f32) -> Self;
    fn to_f32(self) -> f32;
    /// The cache itself when it already holds f32 (then nothing is widened).
    fn as_f32(_: &[Self]) -> Option<&[f32]> {
        None
    }
    /// dst[i] = src[i] as f32 (`dst` at least as long as `src`), with AVX2 where `simd` is true
    /// (only inside code run after AVX2 and F16C were detected).
    fn widen(src: &[Self], dst: &mut [f32], simd: bool) {
        #[cfg(target_arch = "x86_64")]
        if simd {
            // SAFETY: `simd` is only true after AVX2 and F16C were detected.
            unsafe { Self::widen_avx2(src, dst) };
            return;
        }
        let _ = simd;
        dst.iter_mut().zip(src).for_each(|(d, s)| *d = s.to_f32());
    }
    /// `widen` with AVX2 (8 or 16 values a step); by default the scalar loop (f32's `widen`
    /// copies and never calls it).
    ///
    /// # Safety
    /// The CPU must have AVX2 and F16C.
    #[cfg(target_arch = "x86_64")]
    unsafe fn widen_avx2(src: &[Self], dst: &mut [f32]) {
        dst.iter_mut().zip(src).for_each(|(d, s)| *d = s.to_f32());
    }
}

/// `Bits` and its views for a repr(transparent) wrapper of `$bits`.
macro_rules! transparent_bits {
    ($bits:ty) => {
        type Bits = $bits;
        fn from_bits(s: &[$bits]) -> &[Self] {
            // SAFETY: Self is a repr(transparent) wrapper of the bits.
            unsafe { std::slice::from_raw_parts(s.as_ptr().cast(), s.len()) }
        }
        fn from_bits_mut(s: &mut [$bits]) -> &mut [Self] {
            // SAFETY: as above; the borrow is moved, not copied.
            unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast(), s.len()) }
        }
    };
}

impl KvElem for f32 {
    const NAME: &'static str = "float32";
    type Bits = f32;
    fn from_bits(s: &[f32]) -> &[Self] {
        s
    }
    fn from_bits_mut(s: &mut [f32]) -> &mut [Self] {
        s
    }
    fn narrow(x: f32) -> Self {
        x
    }
    fn to_f32(self) -> f32 {
        self
    }
    fn as_f32(s: &[Self]) -> Option<&[f32]> {
        Some(s)
    }
    fn widen(src: &[Self], dst: &mut [f32], _: bool) {
        dst[..src.len()].copy_from_slice(src);
    }
}

/// bfloat16: the top half of an f32's bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[repr(transparent)]
pub struct Bf16(pub u16);

/// OCP FP8 E4M3 ("fn": no infinities; 0x7F and 0xFF are NaN; largest finite 448).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[repr(transparent)]
pub struct Fp8E4M3(pub u8);

/// OCP FP8 E5M2 (IEEE-like: the top byte of an f16; largest finite 57344).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[repr(transparent)]
pub struct Fp8E5M2(pub u8);

impl KvElem for Bf16 {
    const NAME: &'static str = "bfloat16";
    transparent_bits!(u16);
    fn narrow(x: f32) -> Self {
        if x.is_nan() {
            return Bf16(0x7FC0);
        }
        let b = x.to_bits();
        Bf16(((b + 0x7FFF + ((b >> 16) & 1)) >> 16) as u16)
    }
    fn to_f32(self) -> f32 {
        f32::from_bits(u32::from(self.0) << 16)
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn widen_avx2(src: &[Self], dst: &mut [f32]) {
        widen_bf16_avx2(src, dst)
    }
}

/// The value of an 8-bit float's `code`, with `MAN` mantissa bits and exponent bias `BIAS`;
/// `top(mantissa)` is the value of a code with the top exponent, where it is not a number
/// (None: it is one).
#[inline]
fn fp8_value<const MAN: u32, const BIAS: i32>(code: u8, top: impl Fn(u32) -> Option<f32>) -> f32 {
    let top_exponent = (1 << (7 - MAN)) - 1;
    let (e, m) = (u32::from(code >> MAN) & top_exponent, u32::from(code) & ((1 << MAN) - 1));
    let normal = || f32::from_bits(((e as i32 - BIAS + 127) as u32) << 23 | m << (23 - MAN));
    let magnitude = match e {
        // a subnormal: m steps of 2^(1 - BIAS - MAN), exact in f32
        0 => m as f32 * f32::from_bits(((127 + 1 - BIAS - MAN as i32) as u32) << 23),
        _ if e == top_exponent => top(m).unwrap_or_else(normal),
        _ => normal(),
    };
    f32::from_bits(magnitude.to_bits() | u32::from(code >> 7) << 31)
}

/// An 8-bit float with `MAN` mantissa bits and exponent bias `BIAS`, saturated at `max`.
#[inline]
fn fp8_narrow<const MAN: u32, const BIAS: i32>(x: f32, max: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    if x.is_nan() {
        return sign | 0x7F;
    }
    let a = x.abs().min(max);
    let min_normal = f32::from_bits(((1 - BIAS + 127) as u32) << 23);
    if a < min_normal {
        // a subnormal (or zero): a multiple of 2^(1 - BIAS - MAN); a multiply by a power of two
        // is exact, so this rounds once. 2^MAN is the smallest normal's code.
        let steps = f32::from_bits(((BIAS - 1 + MAN as i32 + 127) as u32) << 23);
        return sign | (a * steps).round_ties_even() as u8;
    }
    let shift = 23 - MAN;
    let b = a.to_bits();
    let r = b + ((1 << (shift - 1)) - 1) + ((b >> shift) & 1); // round the mantissa, nearest-even
    let e = (r >> 23) as i32 - 127 + BIAS;
    sign | ((e as u32) << MAN | (r >> shift) & ((1 << MAN) - 1)) as u8
}

impl KvElem for Fp8E4M3 {
    const NAME: &'static str = "fp8_e4m3";
    transparent_bits!(u8);
    fn narrow(x: f32) -> Self {
        Fp8E4M3(fp8_narrow::<3, 7>(x, 448.0))
    }
    fn to_f32(self) -> f32 {
        fp8_value::<3, 7>(self.0, |m| (m == 7).then_some(f32::NAN))
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn widen_avx2(src: &[Self], dst: &mut [f32]) {
        widen_e4m3_avx2(as_bytes(src), dst)
    }
}

impl KvElem for Fp8E5M2 {
    const NAME: &'static str = "fp8_e5m2";
    transparent_bits!(u8);
    fn narrow(x: f32) -> Self {
        Fp8E5M2(fp8_narrow::<2, 15>(x, 57344.0))
    }
    fn to_f32(self) -> f32 {
        fp8_value::<2, 15>(self.0, |m| Some(if m == 0 { f32::INFINITY } else { f32::NAN }))
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn widen_avx2(src: &[Self], dst: &mut [f32]) {
        widen_e5m2_avx2(as_bytes(src), dst)
    }
}

#[cfg(target_arch = "x86_64")]
fn as_bytes<T: KvElem>(s: &[T]) -> &[u8] {
    debug_assert_eq!(std::mem::size_of::<T>(), 1);
    // SAFETY: only called with the repr(transparent) u8 wrappers above.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<u8>(), s.len()) }
}

/// 8 bf16 at a time: zero-extend to 32 bits and shift into the top half.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn widen_bf16_avx2(src: &[Bf16], dst: &mut [f32]) {
    assert!(dst.len() >= src.len());
    let n = src.len() / 8 * 8;
    let (s, d) = (src.as_ptr().cast::<u16>(), dst.as_mut_ptr());
    for i in (0..n).step_by(8) {
        let halves = _mm_loadu_si128(s.add(i).cast());
        let bits = _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(halves));
        _mm256_storeu_ps(d.add(i), _mm256_castsi256_ps(bits));
    }
    for i in n..src.len() {
        dst[i] = src[i].to_f32();
    }
}

/// 8 E5M2 at a time: each is an f16's top byte, which F16C widens exactly (subnormals too).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn widen_e5m2_avx2(src: &[u8], dst: &mut [f32]) {
    assert!(dst.len() >= src.len());
    let n = src.len() / 8 * 8;
    let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
    for i in (0..n).step_by(8) {
        let halves = _mm_slli_epi16::<8>(_mm_cvtepu8_epi16(_mm_loadl_epi64(s.add(i).cast())));
        _mm256_storeu_ps(d.add(i), _mm256_cvtph_ps(halves));
    }
    for i in n..src.len() {
        dst[i] = Fp8E5M2(src[i]).to_f32();
    }
}

/// 16 E4M3 at a time through f16: its bits placed as an f16's (sign to bit 15, exponent and
/// mantissa to bits 13..7) read as 2^-8 of its value, subnormals too, so F16C's exact widening
/// and one multiply by 256 give it; the NaN code is set apart first. (Sign-extended to 16 bits
/// and shifted left by 7, a negative code also sets bit 14, which a mask clears.)
///
/// NOTE: 16 at a time, where E5M2 takes 8: E4M3's integer steps then run once per 16 values,
/// which made a decode tile from L2 ~1.2x faster; E5M2 has one such step, and 16 at a time
/// was slower for it (the extra lane extract).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn widen_e4m3_avx2(src: &[u8], dst: &mut [f32]) {
    assert!(dst.len() >= src.len());
    let n = src.len() / 16 * 16;
    let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
    let (no_bit14, magnitude, nan_magnitude) =
        (_mm256_set1_epi16(0xBFFFu16 as i16), _mm256_set1_epi16(0x7FFF), _mm256_set1_epi16(0x3F80));
    for i in (0..n).step_by(16) {
        let bytes = _mm_loadu_si128(s.add(i).cast());
        let h = _mm256_and_si256(_mm256_slli_epi16::<7>(_mm256_cvtepi8_epi16(bytes)), no_bit14);
        let nan = _mm256_cmpeq_epi16(_mm256_and_si256(h, magnitude), nan_magnitude);
        let halves = _mm256_or_si256(h, _mm256_and_si256(nan, magnitude));
        for (j, part) in [_mm256_castsi256_si128(halves), _mm256_extracti128_si256::<1>(halves)].into_iter().enumerate()
        {
            _mm256_storeu_ps(d.add(i + 8 * j), _mm256_mul_ps(_mm256_cvtph_ps(part), _mm256_set1_ps(256.0)));
        }
    }
    for i in n..src.len() {
        dst[i] = Fp8E4M3(src[i]).to_f32();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn simd_available() -> bool {
        #[cfg(target_arch = "x86_64")]
        return is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c");
        #[cfg(not(target_arch = "x86_64"))]
        false
    }

    /// Every code widened by the AVX2 loop equals the scalar decoding (NaN as NaN), and every
    /// finite code narrows back to itself (-0 included).
    fn round_trips<T: KvElem + PartialEq + std::fmt::Debug>(codes: Vec<T>) {
        let scalar: Vec<f32> = codes.iter().map(|c| c.to_f32()).collect();
        for simd in [false, simd_available()] {
            // (from the second code too: a start off the vector width, and a tail)
            for from in [0, 1] {
                let mut wide = vec![0f32; codes.len() + 3];
                T::widen(&codes[from..], &mut wide, simd);
                for ((a, b), c) in wide.iter().zip(&scalar[from..]).zip(&codes[from..]) {
                    assert!(a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()), "{c:?}: {a} vs {b}");
                }
            }
        }
        for (c, x) in codes.iter().zip(&scalar) {
            if x.is_finite() {
                assert_eq!(T::narrow(*x), *c, "{x}");
            }
        }
    }

    #[test]
    fn every_code_widens_exactly_and_narrows_back() {
        round_trips((0..=255u8).map(Fp8E4M3).collect());
        round_trips((0..=255u8).map(Fp8E5M2).collect());
        // bf16 NaNs are not canonical; the rest are
        round_trips((0..=u16::MAX).map(Bf16).filter(|b| !b.to_f32().is_nan()).collect());
    }

    #[test]
    fn known_values() {
        assert_eq!(Fp8E4M3(0x7E).to_f32(), 448.0);
        assert_eq!(Fp8E4M3(0x01).to_f32(), 2f32.powi(-9));
        assert_eq!(Fp8E4M3(0x08).to_f32(), 2f32.powi(-6));
        assert_eq!(Fp8E4M3(0xB8).to_f32(), -1.0);
        assert!(Fp8E4M3(0x7F).to_f32().is_nan() && Fp8E4M3(0xFF).to_f32().is_nan());
        assert_eq!(Fp8E5M2(0x7B).to_f32(), 57344.0);
        assert_eq!(Fp8E5M2(0x7C).to_f32(), f32::INFINITY);
        assert_eq!(Fp8E5M2(0x01).to_f32(), 2f32.powi(-16));
        assert_eq!(Fp8E5M2(0x3C).to_f32(), 1.0);
        assert_eq!(Bf16(0x3F80).to_f32(), 1.0);
    }

    #[test]
    fn narrowing_rounds_to_nearest_even_and_saturates() {
        // E4M3 around 1 has steps of 1/8: 1 + 1/16 is a tie, to the even 1.0; past it, up
        assert_eq!(Fp8E4M3::narrow(1.0625), Fp8E4M3(0x38));
        assert_eq!(Fp8E4M3::narrow(1.0626), Fp8E4M3(0x39));
        assert_eq!(Fp8E4M3::narrow(1.1875), Fp8E4M3(0x3A)); // 1 + 3/16: a tie, to the even 1.25
        assert_eq!(Fp8E4M3::narrow(1e9), Fp8E4M3(0x7E));
        assert_eq!(Fp8E4M3::narrow(-1e9), Fp8E4M3(0xFE));
        assert_eq!(Fp8E4M3::narrow(f32::INFINITY), Fp8E4M3(0x7E));
        assert_eq!(Fp8E4M3::narrow(2f32.powi(-10)), Fp8E4M3(0)); // half the smallest subnormal: to 0
        assert_eq!(Fp8E4M3::narrow(1.5 * 2f32.powi(-9)), Fp8E4M3(2)); // a subnormal tie, to even
        assert_eq!(Fp8E4M3::narrow(0.0156), Fp8E4M3(0x08)); // just below 2^-6: up to the smallest normal
        assert!(Fp8E4M3::narrow(f32::NAN).to_f32().is_nan());
        assert_eq!(Fp8E5M2::narrow(1e9), Fp8E5M2(0x7B));
        assert_eq!(Fp8E5M2::narrow(1.125), Fp8E5M2(0x3C)); // steps of 1/4: a tie, to even
        assert_eq!(Fp8E5M2::narrow(1.126), Fp8E5M2(0x3D));
        assert_eq!(Bf16::narrow(1.0 + 2f32.powi(-8)), Bf16(0x3F80)); // a tie, to even
        assert_eq!(Bf16::narrow(1.0 + 3.0 * 2f32.powi(-8)), Bf16(0x3F82));
        assert_eq!(Bf16::narrow(f32::NAN), Bf16(0x7FC0));
    }
}
