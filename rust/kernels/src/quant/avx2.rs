//! AVX2 integer dot products of a weight row with up to 4 tokens' int8 blocks.
//!
//! Per block, the weights' integers are loaded once as 32 bytes in element order (Q8_0 as
//! they are; the Q4 nibbles split into low | high halves, which is exactly elements 0..16 |
//! 16..32) and, per token, `vpmaddubsw` (unsigned x signed bytes -> pairwise i16 sums) then
//! `vpmaddwd` by 1 (-> 8 lanes of i32, each the sum of 4 products) give the block's integer
//! dot product in 8 partial sums; those are converted to f32 and accumulated with the block's
//! scale `dw * dx` by one FMA. `vpmaddubsw` wants its first operand unsigned: the Q4 nibbles
//! are (0..=15, the Q4_0 `- 8` goes to the offset term `m * s`); Q8_0 uses |w| and moves w's
//! sign onto x (`vpsignb`). No i16 saturation: |pair| <= 2 * 128 * 127 = 32512.
//!
//! The per-block float work that does not depend on the token is done once for the pass's 4
//! tokens: `dw * dx` and the offset `m * s` as 4-lane vectors over the tokens (the
//! activations store a block's scales and sums token-contiguous). Each token's lane of a
//! vector is computed by the same operations whatever else the pass holds, so a token's
//! result does not depend on the other tokens of the call.
//!
//! Each token keeps two accumulators, for even and odd blocks: with one, every block waited
//! for the previous block's FMA (4 cycles), longer than the block's other work at 1 token.

use super::{Pass, QuantType, BLOCK, TOKENS_PER_PASS};
use std::arch::x86_64::*;

/// acc[j] = dot(token j of the pass, row) for j < pass.n.
///
/// # Safety
/// The CPU must support avx2, fma and f16c; `pass.check(row.len(), ty)` holds.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_row(ty: QuantType, row: &[u8], pass: &Pass, acc: &mut [f32; TOKENS_PER_PASS]) {
    debug_assert!(pass.check(row.len(), ty));
    let t = Tokens { qs: pass.qs.as_ptr(), d: pass.d.as_ptr(), s: pass.s.as_ptr(), nb: pass.nb, stride: pass.stride };
    let row = row.as_ptr();
    // Monomorphized per token count so the accumulators live in registers.
    match (ty, pass.n) {
        (QuantType::Q8_0, 1) => q8::<1>(row, &t, acc),
        (QuantType::Q8_0, 2) => q8::<2>(row, &t, acc),
        (QuantType::Q8_0, 3) => q8::<3>(row, &t, acc),
        (QuantType::Q8_0, _) => q8::<4>(row, &t, acc),
        (QuantType::Q4_0, 1) => q4::<1, false>(row, &t, acc),
        (QuantType::Q4_0, 2) => q4::<2, false>(row, &t, acc),
        (QuantType::Q4_0, 3) => q4::<3, false>(row, &t, acc),
        (QuantType::Q4_0, _) => q4::<4, false>(row, &t, acc),
        (QuantType::Q4_1, 1) => q4::<1, true>(row, &t, acc),
        (QuantType::Q4_1, 2) => q4::<2, true>(row, &t, acc),
        (QuantType::Q4_1, 3) => q4::<3, true>(row, &t, acc),
        (QuantType::Q4_1, _) => q4::<4, true>(row, &t, acc),
    }
}

/// Raw pointers of a `Pass`: token j's block b at `qs + (j nb + b) 32`; the 4 tokens' scales
/// (sums) of block b at `d (s) + b stride`, one 4-lane vector.
struct Tokens {
    qs: *const i8,
    d: *const f32,
    s: *const f32,
    nb: usize,
    stride: usize,
}

impl Tokens {
    /// Block b's dx (or s) for the pass's 4 token lanes.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn lanes(&self, v: *const f32, b: usize) -> __m128 {
        _mm_loadu_ps(v.add(b * self.stride))
    }
}

/// The block's leading f16 values as f32 lanes: lane 0 its scale d, lane 1 (Q4_1) its min m.
///
/// NOTE: one 8-byte load (every block is longer) converted whole. Converting each f16 from a
/// 2-byte load, LLVM inserted the word into a register it knew to be zero in its upper lanes,
/// which was the block loop's offset accumulator: every block then waited for the previous
/// block's offset (a ~12-cycle chain), the Q4 kernels' bottleneck.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn halves(blk: *const u8) -> __m128 {
    _mm_cvtph_ps(_mm_loadl_epi64(blk as *const __m128i))
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

/// acc += (8 lanes of u[4i..4i+4] . v[4i..4i+4]) as f32 * scale; u unsigned, v signed bytes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn acc_dot(acc: __m256, u: __m256i, v: __m256i, scale: __m256) -> __m256 {
    let pairs = _mm256_maddubs_epi16(u, v);
    let quads = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
    _mm256_fmadd_ps(_mm256_cvtepi32_ps(quads), scale, acc)
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn load_x(t: &Tokens, j: usize, b: usize) -> __m256i {
    _mm256_loadu_si256(t.qs.add((j * t.nb + b) * BLOCK) as *const __m256i)
}

/// Lane j of v in all 8 lanes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn lane(v: __m128, j: usize) -> __m256 {
    _mm256_permutevar8x32_ps(_mm256_castps128_ps256(v), _mm256_set1_epi32(j as i32))
}

/// The 4 lanes of v as an array (the pass's per-token offsets at the end of a row).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn to_array(v: __m128) -> [f32; 4] {
    let mut a = [0f32; 4];
    _mm_storeu_ps(a.as_mut_ptr(), v);
    a
}

/// One Q8_0 block b of the row into `acc` for each of N tokens.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q8_block<const N: usize>(row: *const u8, t: &Tokens, b: usize, acc: &mut [__m256; N]) {
    let blk = row.add(b * 34);
    // dw * dx for the pass's 4 tokens at once
    let scales = _mm_mul_ps(_mm_broadcastss_ps(halves(blk)), t.lanes(t.d, b));
    let w = _mm256_loadu_si256(blk.add(2) as *const __m256i);
    let abs_w = _mm256_sign_epi8(w, w); // -128 stays 0x80, which is 128 unsigned
    for (j, a) in acc.iter_mut().enumerate() {
        let x_signed = _mm256_sign_epi8(load_x(t, j, b), w);
        *a = acc_dot(*a, abs_w, x_signed, lane(scales, j));
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8<const N: usize>(row: *const u8, t: &Tokens, out: &mut [f32; TOKENS_PER_PASS]) {
    let mut even = [_mm256_setzero_ps(); N];
    let mut odd = [_mm256_setzero_ps(); N];
    let mut b = 0;
    while b + 1 < t.nb {
        q8_block(row, t, b, &mut even);
        q8_block(row, t, b + 1, &mut odd);
        b += 2;
    }
    if b < t.nb {
        q8_block(row, t, b, &mut even);
    }
    for j in 0..N {
        out[j] = hsum(_mm256_add_ps(even[j], odd[j]));
    }
}

/// One Q4 block b of the row into `acc` (integer part, per token) and `offset` (min part,
/// lane j for token j) for N tokens.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q4_block<const N: usize, const MIN: bool>(
    row: *const u8,
    t: &Tokens,
    b: usize,
    acc: &mut [__m256; N],
    offset: &mut __m128,
) {
    let bb = if MIN { 20 } else { 18 };
    let blk = row.add(b * bb);
    let dm = halves(blk);
    let d = _mm_broadcastss_ps(dm);
    let m = if MIN { _mm_permute_ps::<0b01_01_01_01>(dm) } else { _mm_mul_ps(d, _mm_set1_ps(-8.0)) };
    // the pass's 4 tokens at once: offset += m * s, and dw * dx
    *offset = _mm_fmadd_ps(m, t.lanes(t.s, b), *offset);
    let scales = _mm_mul_ps(d, t.lanes(t.d, b));
    let packed = _mm_loadu_si128(blk.add(bb - 16) as *const __m128i);
    // low nibbles are elements 0..16, high nibbles 16..32
    let both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
    let w = _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
    for (j, a) in acc.iter_mut().enumerate() {
        *a = acc_dot(*a, w, load_x(t, j, b), lane(scales, j));
    }
}

/// Q4_0 (MIN = false: m = -8 d) and Q4_1 (MIN = true: m read from the block).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4<const N: usize, const MIN: bool>(row: *const u8, t: &Tokens, out: &mut [f32; TOKENS_PER_PASS]) {
    let (mut even, mut odd) = ([_mm256_setzero_ps(); N], [_mm256_setzero_ps(); N]);
    let (mut off_even, mut off_odd) = (_mm_setzero_ps(), _mm_setzero_ps());
    let mut b = 0;
    while b + 1 < t.nb {
        q4_block::<N, MIN>(row, t, b, &mut even, &mut off_even);
        q4_block::<N, MIN>(row, t, b + 1, &mut odd, &mut off_odd);
        b += 2;
    }
    if b < t.nb {
        q4_block::<N, MIN>(row, t, b, &mut even, &mut off_even);
    }
    let offsets = to_array(_mm_add_ps(off_even, off_odd));
    for j in 0..N {
        out[j] = hsum(_mm256_add_ps(even[j], odd[j])) + offsets[j];
    }
}
