//! AVX2 dot products of a group of 8 packed rows (`pack`'s layout) with up to 4 tokens' int8
//! blocks: lane r of every vector is row r of the group.
//!
//! Per record (one block of each of the 8 rows) and token, each 32-byte integer chunk holds 4
//! weights of every row; the token's 4 matching int8 activations are broadcast to all lanes
//! (`vpbroadcastd`, a load), and `vpmaddubsw` (unsigned x signed bytes -> pairwise i16 sums)
//! then `vpmaddwd` by 1 sum each row's 4 products into its i32 lane. `vpmaddubsw` wants its
//! first operand unsigned: the Q4 nibbles are (0..=15; Q4_0's `- 8` goes to the offset term
//! `m * s`); Q8_0 uses |w| and moves w's sign onto x (`vpsignb`). No i16 saturation: a Q4
//! pair is at most 2 * 15 * 127 = 3810, so the 8 of a block (4 chunks of low and high
//! nibbles) sum in i16 before one `vpmaddwd`; a Q8_0 pair reaches 2 * 128 * 127 = 32512, so
//! each chunk widens to i32 at once.
//!
//! The block's exact i32 sums are then converted (exactly: |sum| < 2^24) and scaled per lane:
//! `acc = fma(sum, d * dx, acc)`, the 8 rows' f16 scales `d` (and Q4_1's mins `m`) loaded and
//! converted as one vector; Q4 adds `off = fma(m, s, off)`. With AVX-VNNI, `vpdpbusd` does a
//! chunk's multiply and 4-way sum into the i32 lanes in one instruction. Every lane runs the
//! same operations whatever the other lanes and tokens hold, which is what keeps a row's
//! result independent of the call's other rows and tokens, and equal to the portable path's
//! bits.
//!
//! Weights come from DRAM in a real decode step (a step reads every layer once, 66 MB for
//! SmolLM2, far past the caches), and one thread's share of a layer's matrix is 100-800 KB:
//! too short a stream for the hardware prefetchers to reach full speed. So the kernel asks
//! for the lines `AHEAD` bytes past each record it reads, and a thread's range starts by
//! asking for its first `AHEAD` bytes.
//! NOTE: measured on SmolLM2's 30 layers from memory (`benches/quant_decode.py`, 2 threads):
//! 1.16-1.26x at `AHEAD` = 4 KiB over no prefetch; 1 KiB gained less, 8 and 16 KiB no more.

use super::pack::{header_bytes, record_bytes};
use super::{Lanes, Pass, QuantType, BLOCK};
use std::arch::x86_64::*;

/// lanes[j][r] = dot(token j of the pass, row r of the group) for j < pass.n.
///
/// # Safety
/// The CPU must support avx2, fma and f16c; `pass.check(group.len(), ty)` holds.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn group(ty: QuantType, group: &[u8], pass: &Pass, lanes: &mut Lanes) {
    dispatch::<false>(ty, group, pass, lanes)
}

/// `group` with AVX-VNNI's `vpdpbusd` for the integer products: the same i32 sums, so the
/// same results, in fewer instructions.
///
/// # Safety
/// The CPU must support avx2, fma, f16c and avxvnni; `pass.check(group.len(), ty)` holds.
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
pub(super) unsafe fn group_vnni(ty: QuantType, group: &[u8], pass: &Pass, lanes: &mut Lanes) {
    dispatch::<true>(ty, group, pass, lanes)
}

// NOTE: the kernels below are #[inline(always)] without target features of their own, so
// each is compiled inside the entry above that calls it, with that entry's features.
#[inline(always)]
unsafe fn dispatch<const VNNI: bool>(ty: QuantType, group: &[u8], pass: &Pass, lanes: &mut Lanes) {
    debug_assert!(pass.check(group.len(), ty));
    let t = Tokens { qs: pass.qs.as_ptr(), d: pass.d.as_ptr(), s: pass.s.as_ptr(), nb: pass.nb, stride: pass.stride };
    let g = group.as_ptr();
    // Monomorphized per token count so the accumulators live in registers.
    match (ty, pass.n) {
        (QuantType::Q8_0, 1) => q8::<1, VNNI>(g, &t, lanes),
        (QuantType::Q8_0, 2) => q8::<2, VNNI>(g, &t, lanes),
        (QuantType::Q8_0, 3) => q8::<3, VNNI>(g, &t, lanes),
        (QuantType::Q8_0, _) => q8::<4, VNNI>(g, &t, lanes),
        (QuantType::Q4_0, 1) => q4::<1, false, VNNI>(g, &t, lanes),
        (QuantType::Q4_0, 2) => q4::<2, false, VNNI>(g, &t, lanes),
        (QuantType::Q4_0, 3) => q4::<3, false, VNNI>(g, &t, lanes),
        (QuantType::Q4_0, _) => q4::<4, false, VNNI>(g, &t, lanes),
        (QuantType::Q4_1, 1) => q4::<1, true, VNNI>(g, &t, lanes),
        (QuantType::Q4_1, 2) => q4::<2, true, VNNI>(g, &t, lanes),
        (QuantType::Q4_1, 3) => q4::<3, true, VNNI>(g, &t, lanes),
        (QuantType::Q4_1, _) => q4::<4, true, VNNI>(g, &t, lanes),
    }
}

/// Raw pointers of a `Pass`: token j's block b at `qs + (j nb + b) 32`, its scale (sum) at
/// `d (s) + b stride + j`.
struct Tokens {
    qs: *const i8,
    d: *const f32,
    s: *const f32,
    nb: usize,
    stride: usize,
}

impl Tokens {
    /// Token j's activations k..k + 4 of block b, as one i32 in all 8 lanes.
    #[inline(always)]
    unsafe fn four(&self, j: usize, b: usize, k: usize) -> __m256i {
        let at = self.qs.add((j * self.nb + b) * BLOCK + k) as *const i32;
        _mm256_set1_epi32(at.read_unaligned())
    }

    /// Token j's value of block b in `v` (its scale d or sum s), in all 8 lanes.
    #[inline(always)]
    unsafe fn lanes(&self, v: *const f32, j: usize, b: usize) -> __m256 {
        _mm256_set1_ps(*v.add(b * self.stride + j))
    }
}

/// 8 f16 at `p` as f32 lanes.
#[inline(always)]
unsafe fn halves(p: *const u8) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
}

/// Asks for the cache lines `AHEAD` bytes past a record of `len` bytes: every line of the
/// record that far ahead (into the next groups of the thread's range). Prefetches never
/// fault, so the address may run past the buffer (hence `wrapping_add`).
#[inline(always)]
unsafe fn prefetch_ahead(rec: *const u8, len: usize) {
    let at = rec.wrapping_add(AHEAD);
    let mut off = 0;
    while off < len {
        _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(off) as *const i8);
        off += 64;
    }
}

const AHEAD: usize = 4096;

/// Asks for the first `AHEAD` bytes of a thread's range, which the kernel's own prefetches
/// (that far past the record being read) never cover.
pub(super) fn prefetch_head(data: &[u8]) {
    for line in data[..data.len().min(AHEAD)].chunks(64) {
        // SAFETY: a prefetch reads nothing; SSE is part of x86_64.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(line.as_ptr() as *const i8) };
    }
}

#[inline(always)]
unsafe fn store<const N: usize>(v: &[__m256; N], lanes: &mut Lanes) {
    for j in 0..N {
        _mm256_storeu_ps(lanes[j].as_mut_ptr(), v[j]);
    }
}

#[inline(always)]
unsafe fn q8<const N: usize, const VNNI: bool>(group: *const u8, t: &Tokens, lanes: &mut Lanes) {
    let (rec_len, head) = (record_bytes(QuantType::Q8_0), header_bytes(QuantType::Q8_0));
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); N];
    for b in 0..t.nb {
        let rec = group.add(b * rec_len);
        prefetch_ahead(rec, rec_len);
        let d = halves(rec);
        let mut sums = [_mm256_setzero_si256(); N];
        for c in 0..8 {
            let w = _mm256_loadu_si256(rec.add(head + 32 * c) as *const __m256i);
            let abs_w = _mm256_sign_epi8(w, w); // -128 stays 0x80, which is 128 unsigned
            for (j, sum) in sums.iter_mut().enumerate() {
                let x_signed = _mm256_sign_epi8(t.four(j, b, 4 * c), w);
                *sum = if VNNI {
                    _mm256_dpbusd_avx_epi32(*sum, abs_w, x_signed)
                } else {
                    let pairs = _mm256_maddubs_epi16(abs_w, x_signed);
                    _mm256_add_epi32(*sum, _mm256_madd_epi16(pairs, ones))
                };
            }
        }
        for (j, a) in acc.iter_mut().enumerate() {
            let scale = _mm256_mul_ps(d, t.lanes(t.d, j, b));
            *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[j]), scale, *a);
        }
    }
    store(&acc, lanes);
}

/// Q4_0 (MIN = false: m = -8 d) and Q4_1 (MIN = true: m read from the record).
#[inline(always)]
unsafe fn q4<const N: usize, const MIN: bool, const VNNI: bool>(group: *const u8, t: &Tokens, lanes: &mut Lanes) {
    let ty = if MIN { QuantType::Q4_1 } else { QuantType::Q4_0 };
    let (rec_len, head) = (record_bytes(ty), header_bytes(ty));
    let (ones, nibble) = (_mm256_set1_epi16(1), _mm256_set1_epi8(0x0f));
    let mut acc = [_mm256_setzero_ps(); N];
    let mut off = [_mm256_setzero_ps(); N];
    for b in 0..t.nb {
        let rec = group.add(b * rec_len);
        prefetch_ahead(rec, rec_len);
        let d = halves(rec);
        let m = if MIN { halves(rec.add(16)) } else { _mm256_mul_ps(d, _mm256_set1_ps(-8.0)) };
        // VNNI: i32 sums (of the low and of the high nibbles' products for one token, of both
        // in the first for more); else i16 sums of both in the first
        let mut sums = [[_mm256_setzero_si256(); 2]; N];
        for c in 0..4 {
            let w = _mm256_loadu_si256(rec.add(head + 32 * c) as *const __m256i);
            // low nibbles: elements 4c..4c+4 of each row; high nibbles: 16 + 4c..
            let lo = _mm256_and_si256(w, nibble);
            let hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), nibble);
            for (j, [s_lo, s_hi]) in sums.iter_mut().enumerate() {
                let (x_lo, x_hi) = (t.four(j, b, 4 * c), t.four(j, b, 16 + 4 * c));
                if VNNI && N == 1 {
                    // two chains of vpdpbusd (latency 5): one token's block is latency-bound
                    *s_lo = _mm256_dpbusd_avx_epi32(*s_lo, lo, x_lo);
                    *s_hi = _mm256_dpbusd_avx_epi32(*s_hi, hi, x_hi);
                } else if VNNI {
                    // one chain per token: with a second, 4 tokens' sums spill the 16 registers
                    *s_lo = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(*s_lo, lo, x_lo), hi, x_hi);
                } else {
                    let pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, x_lo), _mm256_maddubs_epi16(hi, x_hi));
                    *s_lo = _mm256_add_epi16(*s_lo, pairs);
                }
            }
        }
        for (j, [s_lo, s_hi]) in sums.iter().enumerate() {
            let sum = if VNNI { _mm256_add_epi32(*s_lo, *s_hi) } else { _mm256_madd_epi16(*s_lo, ones) };
            let scale = _mm256_mul_ps(d, t.lanes(t.d, j, b));
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scale, acc[j]);
            off[j] = _mm256_fmadd_ps(m, t.lanes(t.s, j, b), off[j]);
        }
    }
    for j in 0..N {
        acc[j] = _mm256_add_ps(acc[j], off[j]);
    }
    store(&acc, lanes);
}
