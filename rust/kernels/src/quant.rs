//! Quantized matrix-vector products over GGUF block formats, for small decode batches.
//!
//! `quant_matmul` computes `out[t, r] = sum_k x[t, k] * w[r, k]` for a few tokens `t` (decode
//! steps run 1..=8), reading `w` in the GGUF's own blocks instead of a dequantized fp32 copy:
//! batch-1 decode is bound by reading weights, and Q4_1 is ~6.4x smaller than fp32.
//!
//! Formats (the byte layouts of gguf-py's `gguf/quants.py`, 32 weights per block, blocks of a
//! row contiguous, rows contiguous):
//! - Q8_0, 34 bytes: f16 scale `d`, 32 x i8 `q`;                         w = d * q
//! - Q4_0, 18 bytes: f16 `d`, 16 bytes of nibbles;                       w = d * (q - 8)
//! - Q4_1, 20 bytes: f16 `d`, f16 min `m`, 16 bytes of nibbles;          w = d * q + m
//!
//! In both 4-bit formats byte `i` of the nibbles holds element `i` in its low nibble and
//! element `i + 16` in its high one.
//!
//! Weights are dequantized on the fly inside the dot product, per block:
//! `dot(x_blk, w_blk) = d * dot(x_blk, q) + m * sum(x_blk)` (Q4_0 is the case `m = -8 d`), so
//! the per-block sums of `x` are computed once per call and each block costs one unpack of
//! its integers, shared by every token. Activations stay f32 (no int8 requantization of `x`,
//! unlike llama.cpp): results differ from the fp32 matmul only by summation order.
//!
//! Invariants: every input is checked before any work (`Err(String)`, never a panic or an
//! out-of-bounds read); the AVX2/FMA/F16C path is taken only when the CPU reports those
//! features at runtime (the wheel targets generic x86_64), else a portable path whose loops
//! auto-vectorize; rows are split into contiguous ranges over `num_threads` threads of the
//! kernels' persistent pool, the caller's thread taking the first range.

use std::ops::Range;
use std::sync::Mutex;

/// Weights per block in every format here.
pub const BLOCK: usize = 32;

/// Rows of weights below this many bytes are not worth another thread: handing a part to a
/// pool worker costs about as much as reading this much memory.
const MIN_BYTES_PER_THREAD: usize = 32 * 1024;

/// Tokens handled by one pass over a row; more tokens make more passes over the (then
/// L1-resident) row. Four accumulators plus four unpacked vectors fit the 16 AVX registers.
const TOKENS_PER_PASS: usize = 4;

/// A GGUF block format this module reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantType {
    Q8_0,
    Q4_0,
    Q4_1,
}

impl QuantType {
    /// From ggml's type id (`GGMLQuantizationType`): Q4_0 = 2, Q4_1 = 3, Q8_0 = 8.
    pub fn from_ggml(id: u32) -> Option<Self> {
        match id {
            2 => Some(Self::Q4_0),
            3 => Some(Self::Q4_1),
            8 => Some(Self::Q8_0),
            _ => None,
        }
    }

    pub fn ggml_id(self) -> u32 {
        match self {
            Self::Q4_0 => 2,
            Self::Q4_1 => 3,
            Self::Q8_0 => 8,
        }
    }

    /// Bytes of one block of 32 weights.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::Q8_0 => 34,
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
        }
    }

    /// Bytes of one row of `cols` weights; `cols` must be a positive multiple of 32.
    pub fn row_bytes(self, cols: usize) -> Result<usize, String> {
        if cols == 0 || !cols.is_multiple_of(BLOCK) {
            return Err(format!("cols must be a positive multiple of {BLOCK}, got {cols}"));
        }
        Ok(cols / BLOCK * self.block_bytes())
    }
}

/// A row-major matrix of quantized blocks: `rows` rows of `cols / 32` blocks each.
#[derive(Clone, Copy, Debug)]
pub struct QuantWeights<'a> {
    ty: QuantType,
    rows: usize,
    cols: usize,
    data: &'a [u8],
}

impl<'a> QuantWeights<'a> {
    /// Checks that `data` holds exactly `rows` rows of `cols` weights of type `ty`.
    pub fn new(ty: QuantType, rows: usize, cols: usize, data: &'a [u8]) -> Result<Self, String> {
        let row_bytes = ty.row_bytes(cols)?;
        let expected =
            rows.checked_mul(row_bytes).ok_or_else(|| format!("{rows} rows of {row_bytes} bytes overflow"))?;
        if data.len() != expected {
            return Err(format!("{ty:?} weights of {rows} x {cols} take {expected} bytes, got {}", data.len()));
        }
        Ok(Self { ty, rows, cols, data })
    }

    pub fn ty(&self) -> QuantType {
        self.ty
    }
    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn cols(&self) -> usize {
        self.cols
    }
    pub fn row_bytes(&self) -> usize {
        self.cols / BLOCK * self.ty.block_bytes()
    }
}

/// Instruction set a call runs with (a parameter so tests can compare both paths).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
}

impl Isa {
    /// The fastest path this CPU supports.
    pub fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c") {
            return Self::Avx2;
        }
        Self::Portable
    }
}

/// out f32 [tokens, rows] = x f32 [tokens, cols] @ w^T, with `w` read as quantized blocks.
///
/// `num_threads` (>= 1) is an upper bound: small matrices use fewer threads.
pub fn quant_matmul(
    out: &mut [f32],
    x: &[f32],
    tokens: usize,
    w: &QuantWeights,
    num_threads: usize,
) -> Result<(), String> {
    quant_matmul_with(out, x, tokens, w, num_threads, Isa::detect())
}

/// `quant_matmul` on a chosen instruction set; Err if this CPU lacks it.
pub fn quant_matmul_with(
    out: &mut [f32],
    x: &[f32],
    tokens: usize,
    w: &QuantWeights,
    num_threads: usize,
    isa: Isa,
) -> Result<(), String> {
    if num_threads == 0 {
        return Err("num_threads must be at least 1".into());
    }
    if Some(x.len()) != tokens.checked_mul(w.cols) {
        return Err(format!("x has {} values, expected tokens {tokens} x cols {}", x.len(), w.cols));
    }
    if Some(out.len()) != tokens.checked_mul(w.rows) {
        return Err(format!("out has {} values, expected tokens {tokens} x rows {}", out.len(), w.rows));
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 && Isa::detect() != Isa::Avx2 {
        return Err("this CPU lacks AVX2/FMA/F16C".into());
    }
    if tokens == 0 || w.rows == 0 {
        return Ok(());
    }

    let nb = w.cols / BLOCK;
    // Per-block sums of x [tokens, nb]: the Q4 formats' offset term needs them per block.
    let xsum: Vec<f32> = x.chunks_exact(BLOCK).map(|b| b.iter().sum()).collect();
    let x_lanes;
    let x = match isa {
        Isa::Portable => x,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => {
            x_lanes = avx2::to_lane_order(w.ty, x);
            &x_lanes[..]
        }
    };
    let call = Call { ty: w.ty, x, xsum: &xsum, tokens, cols: w.cols, nb, isa };

    let row_bytes = w.row_bytes();
    let by_size = (w.data.len() / MIN_BYTES_PER_THREAD).max(1);
    let ranges = split_rows(w.rows, num_threads.min(by_size));

    // Each range gets, for every token, its own disjoint slice of that token's output row.
    let mut parts: Vec<Vec<&mut [f32]>> = ranges.iter().map(|_| Vec::with_capacity(tokens)).collect();
    for out_row in out.chunks_exact_mut(w.rows) {
        let mut rest = out_row;
        for (part, range) in parts.iter_mut().zip(&ranges) {
            let (head, tail) = rest.split_at_mut(range.len());
            part.push(head);
            rest = tail;
        }
    }
    let data_of = |r: &Range<usize>| &w.data[r.start * row_bytes..r.end * row_bytes];

    // Each part's slices are taken by exactly one thread; the mutex only makes that visible
    // to the borrow checker (never contended).
    let parts: Vec<Mutex<Vec<&mut [f32]>>> = parts.into_iter().map(Mutex::new).collect();
    crate::pool::parallel(ranges.len(), &|i| {
        let mut part = parts[i].lock().unwrap_or_else(|e| e.into_inner());
        call.rows(data_of(&ranges[i]), &mut part);
    });
    Ok(())
}

/// `n` rows split into at most `parts` contiguous, near-equal, non-empty ranges.
fn split_rows(n: usize, parts: usize) -> Vec<Range<usize>> {
    let parts = parts.clamp(1, n.max(1));
    (0..parts).map(|i| n * i / parts..n * (i + 1) / parts).collect()
}

/// One call's shared, read-only inputs.
struct Call<'a> {
    ty: QuantType,
    x: &'a [f32],    // [tokens, cols], each block in the lane order of `isa`'s unpacking
    xsum: &'a [f32], // [tokens, nb]
    tokens: usize,
    cols: usize,
    nb: usize,
    isa: Isa,
}

impl Call<'_> {
    /// Rows `data` (whole rows) into `outs[t][i]` for each token t and row i of `data`.
    fn rows(&self, data: &[u8], outs: &mut [&mut [f32]]) {
        let row_bytes = self.nb * self.ty.block_bytes();
        let mut acc = [0f32; TOKENS_PER_PASS];
        for (i, row) in data.chunks_exact(row_bytes).enumerate() {
            let mut t0 = 0;
            while t0 < self.tokens {
                let n = (self.tokens - t0).min(TOKENS_PER_PASS);
                self.dot_row(row, t0, n, &mut acc);
                for j in 0..n {
                    outs[t0 + j][i] = acc[j];
                }
                t0 += n;
            }
        }
    }

    /// acc[j] = dot(x[t0 + j], row) for j < n (n <= TOKENS_PER_PASS).
    fn dot_row(&self, row: &[u8], t0: usize, n: usize, acc: &mut [f32; TOKENS_PER_PASS]) {
        let x = &self.x[t0 * self.cols..(t0 + n) * self.cols];
        let xsum = &self.xsum[t0 * self.nb..(t0 + n) * self.nb];
        match self.isa {
            Isa::Portable => portable::dot_row(self.ty, row, x, xsum, self.nb, n, acc),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: Isa::Avx2 is only used after Isa::detect() confirmed the features, and
            // the slices above hold n tokens of cols values / nb sums, row holds nb blocks.
            Isa::Avx2 => unsafe { avx2::dot_row(self.ty, row, x, xsum, self.nb, n, acc) },
        }
    }
}

/// IEEE half -> single, exact for every value (subnormals, infinities, NaN included).
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h as u32) & 0x8000) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    let bits = match exp {
        0 if man == 0 => sign,
        0 => {
            // subnormal: man * 2^-24, exact in f32
            let v = man as f32 * (1.0 / 16_777_216.0);
            return if sign != 0 { -v } else { v };
        }
        31 => sign | 0x7f80_0000 | (man << 13),
        _ => sign | ((exp + 112) << 23) | (man << 13),
    };
    f32::from_bits(bits)
}

fn read_f16(bytes: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([bytes[at], bytes[at + 1]]))
}

/// Dequantizes one row of blocks into `out` (`out.len()` = 32 x blocks): the reference the
/// tests compare against, written straight from the format definitions.
pub fn dequantize_row(ty: QuantType, row: &[u8], out: &mut [f32]) -> Result<(), String> {
    let bb = ty.block_bytes();
    if !row.len().is_multiple_of(bb) || out.len() != row.len() / bb * BLOCK {
        return Err(format!("{ty:?}: {} bytes do not dequantize to {} values", row.len(), out.len()));
    }
    for (blk, o) in row.chunks_exact(bb).zip(out.chunks_exact_mut(BLOCK)) {
        let d = read_f16(blk, 0);
        match ty {
            QuantType::Q8_0 => {
                for (o, &q) in o.iter_mut().zip(&blk[2..]) {
                    *o = d * (q as i8) as f32;
                }
            }
            QuantType::Q4_0 | QuantType::Q4_1 => {
                let (m, qs) = match ty {
                    QuantType::Q4_1 => (read_f16(blk, 2), &blk[4..]),
                    _ => (0.0, &blk[2..]),
                };
                for (i, &b) in qs.iter().enumerate() {
                    let (lo, hi) = ((b & 0x0f) as f32, (b >> 4) as f32);
                    if ty == QuantType::Q4_0 {
                        o[i] = d * (lo - 8.0);
                        o[i + 16] = d * (hi - 8.0);
                    } else {
                        o[i] = d * lo + m;
                        o[i + 16] = d * hi + m;
                    }
                }
            }
        }
    }
    Ok(())
}

/// Scale and offset of a block: w = d * q + m with q the block's raw integers
/// (unsigned nibbles for the Q4 formats, so Q4_0's `- 8` becomes m = -8 d).
#[inline(always)]
fn scale_min(ty: QuantType, blk: &[u8]) -> (f32, f32) {
    let d = read_f16(blk, 0);
    match ty {
        QuantType::Q8_0 => (d, 0.0),
        QuantType::Q4_0 => (d, -8.0 * d),
        QuantType::Q4_1 => (d, read_f16(blk, 2)),
    }
}

mod portable {
    //! Plain loops the compiler vectorizes for the baseline target (SSE2 on x86_64).
    use super::{scale_min, QuantType, BLOCK, TOKENS_PER_PASS};

    pub(super) fn dot_row(
        ty: QuantType,
        row: &[u8],
        x: &[f32],    // [n, nb * 32]
        xsum: &[f32], // [n, nb]
        nb: usize,
        n: usize,
        acc: &mut [f32; TOKENS_PER_PASS],
    ) {
        let bb = ty.block_bytes();
        let cols = nb * BLOCK;
        *acc = [0.0; TOKENS_PER_PASS];
        let mut q = [0f32; BLOCK];
        for (b, blk) in row.chunks_exact(bb).enumerate() {
            let (d, m) = scale_min(ty, blk);
            unpack(ty, blk, &mut q);
            for j in 0..n {
                let xb = &x[j * cols + b * BLOCK..j * cols + (b + 1) * BLOCK];
                // 8 independent partial sums: vectorizes and breaks the add dependency chain.
                let mut s = [0f32; 8];
                for (qc, xc) in q.chunks_exact(8).zip(xb.chunks_exact(8)) {
                    for l in 0..8 {
                        s[l] += qc[l] * xc[l];
                    }
                }
                acc[j] += d * s.iter().sum::<f32>() + m * xsum[j * nb + b];
            }
        }
    }

    /// The block's raw integers as f32 (nibbles unsigned).
    fn unpack(ty: QuantType, blk: &[u8], q: &mut [f32; BLOCK]) {
        match ty {
            QuantType::Q8_0 => {
                for (o, &v) in q.iter_mut().zip(&blk[2..2 + BLOCK]) {
                    *o = (v as i8) as f32;
                }
            }
            QuantType::Q4_0 | QuantType::Q4_1 => {
                let qs = &blk[blk.len() - BLOCK / 2..];
                for i in 0..BLOCK / 2 {
                    q[i] = (qs[i] & 0x0f) as f32;
                    q[i + BLOCK / 2] = (qs[i] >> 4) as f32;
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! AVX2 + FMA + F16C: each block's integers are widened to four 8-lane f32 vectors once
    //! and multiplied against every token's x; one vector accumulator per token.
    //!
    //! NOTE: the integers are unpacked with broadcast loads and per-lane variable shifts, not
    //! byte shuffles (`vpmovzxbd` et al. all compete for one shuffle port and made that port
    //! the bottleneck, ~9 cycles a block). The lanes then hold the block's elements in a fixed
    //! order other than 0..32, so x is permuted into that order once per call
    //! (`to_lane_order`); a dot product does not care about order.
    use super::{QuantType, BLOCK, TOKENS_PER_PASS};
    use std::arch::x86_64::*;

    /// Element of the block each lane position holds after unpacking.
    fn lane_order(ty: QuantType) -> [usize; BLOCK] {
        let mut order = [0; BLOCK];
        for (p, o) in order.iter_mut().enumerate() {
            let (v, lane) = (p / 8, p % 8);
            let (b, h) = (lane / 2, lane % 2);
            *o = match ty {
                // vector v: qword v broadcast; lane 2b+h holds byte b of dword h
                QuantType::Q8_0 => 8 * v + 4 * h + b,
                // vector v: dword v broadcast; lane 2b+h holds nibble h of byte b of it
                QuantType::Q4_0 | QuantType::Q4_1 => 16 * h + 4 * v + b,
            };
        }
        order
    }

    /// x [tokens, cols] with each block of 32 reordered into `lane_order`.
    pub(super) fn to_lane_order(ty: QuantType, x: &[f32]) -> Vec<f32> {
        let order = lane_order(ty);
        let mut out = Vec::with_capacity(x.len());
        for blk in x.chunks_exact(BLOCK) {
            out.extend(order.iter().map(|&i| blk[i]));
        }
        out
    }

    /// # Safety
    /// The CPU must support avx2, fma and f16c; `row` holds nb blocks of `ty`, `x` n x nb x 32
    /// values, `xsum` n x nb values, n <= TOKENS_PER_PASS.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_row(
        ty: QuantType,
        row: &[u8],
        x: &[f32],
        xsum: &[f32],
        nb: usize,
        n: usize,
        acc: &mut [f32; TOKENS_PER_PASS],
    ) {
        debug_assert!(row.len() == nb * ty.block_bytes() && x.len() == n * nb * BLOCK);
        debug_assert!(xsum.len() == n * nb && (1..=TOKENS_PER_PASS).contains(&n));
        let (row, x, xsum) = (row.as_ptr(), x.as_ptr(), xsum.as_ptr());
        // Monomorphized per token count so the accumulators live in registers.
        match (ty, n) {
            (QuantType::Q8_0, 1) => q8::<1>(row, x, nb, acc),
            (QuantType::Q8_0, 2) => q8::<2>(row, x, nb, acc),
            (QuantType::Q8_0, 3) => q8::<3>(row, x, nb, acc),
            (QuantType::Q8_0, _) => q8::<4>(row, x, nb, acc),
            (QuantType::Q4_0, 1) => q4::<1, false>(row, x, xsum, nb, acc),
            (QuantType::Q4_0, 2) => q4::<2, false>(row, x, xsum, nb, acc),
            (QuantType::Q4_0, 3) => q4::<3, false>(row, x, xsum, nb, acc),
            (QuantType::Q4_0, _) => q4::<4, false>(row, x, xsum, nb, acc),
            (QuantType::Q4_1, 1) => q4::<1, true>(row, x, xsum, nb, acc),
            (QuantType::Q4_1, 2) => q4::<2, true>(row, x, xsum, nb, acc),
            (QuantType::Q4_1, 3) => q4::<3, true>(row, x, xsum, nb, acc),
            (QuantType::Q4_1, _) => q4::<4, true>(row, x, xsum, nb, acc),
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn half(p: *const u8) -> f32 {
        let bits = (p as *const u16).read_unaligned();
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }

    /// sum over the block of q * x for one token: q as four 8-lane vectors, x at `xp`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn block_dot(q: &[__m256; 4], xp: *const f32) -> __m256 {
        let mut s = _mm256_mul_ps(q[0], _mm256_loadu_ps(xp));
        s = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xp.add(8)), s);
        s = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xp.add(16)), s);
        _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xp.add(24)), s)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q8<const N: usize>(row: *const u8, x: *const f32, nb: usize, out: &mut [f32; TOKENS_PER_PASS]) {
        let cols = nb * BLOCK;
        let up = _mm256_setr_epi32(24, 24, 16, 16, 8, 8, 0, 0);
        let mut acc = [_mm256_setzero_ps(); N];
        for b in 0..nb {
            let blk = row.add(b * 34);
            let d = _mm256_set1_ps(half(blk));
            let qs = blk.add(2);
            let mut q = [_mm256_setzero_ps(); 4];
            for (v, qv) in q.iter_mut().enumerate() {
                // lanes [lo, hi] x 4 of qword v; shifting byte b to the top and back sign-extends it
                let w = _mm256_set1_epi64x((qs.add(8 * v) as *const i64).read_unaligned());
                *qv = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_sllv_epi32(w, up), 24));
            }
            for (j, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(d, block_dot(&q, x.add(j * cols + b * BLOCK)), *a);
            }
        }
        for j in 0..N {
            out[j] = hsum(acc[j]);
        }
    }

    /// Q4_0 (MIN = false: m = -8 d) and Q4_1 (MIN = true: m read from the block).
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4<const N: usize, const MIN: bool>(
        row: *const u8,
        x: *const f32,
        xsum: *const f32,
        nb: usize,
        out: &mut [f32; TOKENS_PER_PASS],
    ) {
        let cols = nb * BLOCK;
        let bb = if MIN { 20 } else { 18 };
        let mask = _mm256_set1_epi32(0x0f);
        let down = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
        let mut acc = [_mm256_setzero_ps(); N];
        let mut offset = [0f32; N];
        for b in 0..nb {
            let blk = row.add(b * bb);
            let d = half(blk);
            let m = if MIN { half(blk.add(2)) } else { -8.0 * d };
            let qs = blk.add(bb - 16);
            let mut q = [_mm256_setzero_ps(); 4];
            for (v, qv) in q.iter_mut().enumerate() {
                // dword v in every lane; lane i keeps nibble i of it
                let w = _mm256_set1_epi32((qs.add(4 * v) as *const i32).read_unaligned());
                *qv = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(w, down), mask));
            }
            let dv = _mm256_set1_ps(d);
            for j in 0..N {
                acc[j] = _mm256_fmadd_ps(dv, block_dot(&q, x.add(j * cols + b * BLOCK)), acc[j]);
                offset[j] += m * *xsum.add(j * nb + b);
            }
        }
        for j in 0..N {
            out[j] = hsum(acc[j]) + offset[j];
        }
    }
}
