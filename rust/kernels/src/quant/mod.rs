//! Quantized matrix-vector products over GGUF block formats, for small decode batches.
//!
//! `quant_matmul` computes `out[t, r] = sum_k x[t, k] * w[r, k]` for a few tokens `t` (the
//! server's decode steps of up to 24 sequences), reading `w` as quantized blocks instead of a
//! dequantized fp32 copy: batch-1 decode is bound by reading weights, and Q4_1 is ~6.4x
//! smaller than fp32.
//!
//! Formats (the byte layouts of gguf-py's `gguf/quants.py`, 32 weights per block):
//! - Q8_0, 34 bytes: f16 scale `d`, 32 x i8 `q`;                         w = d * q
//! - Q4_0, 18 bytes: f16 `d`, 16 bytes of nibbles;                       w = d * (q - 8)
//! - Q4_1, 20 bytes: f16 `d`, f16 min `m`, 16 bytes of nibbles;          w = d * q + m
//!
//! In both 4-bit formats byte `i` of the nibbles holds element `i` in its low nibble and
//! element `i + 16` in its high one. The kernels read these blocks regrouped eight rows at a
//! time ([`pack`]: the same bytes in another order, made once when a model loads).
//!
//! Numerics: the activations are quantized too, once per call, to int8 blocks of 32 with one
//! f32 scale each ([`activations`]: `dx = max|x| / 127`, `qx = round_half_even(x * 127 /
//! max|x|)`), and each block's product is an exact integer dot product:
//! `dot(w_blk, x_blk) ~= dw * dx * sum(q * qx) + m * dx * sum(qx)` (Q4_0 is the case
//! `m = -8 dw`). So the result is, up to f32 rounding of the per-block terms, the exact product
//! of the dequantized weights with the int8-rounded activations (as llama.cpp's q8_0 / q8_1
//! activation blocks); it differs from an fp32 matmul by the activations' rounding, about
//! 0.2-0.5% of `sum |x| |w|` per output. Per output the f32 work is fixed: for each block in
//! order, `acc = fma(f32(sum(q * qx)), dw * dx, acc)` and (Q4) `off = fma(m, dx * sum(qx),
//! off)`; the result is `acc + off` (Q8_0: `acc`).
//!
//! Non-finite activations make the outputs of their token NaN (the block cannot be scaled);
//! a block of activations all below ~2e-36 in magnitude counts as zero.
//!
//! Invariants: every input is checked before any work (`Err(String)`, never a panic or an
//! out-of-bounds read); the AVX2 path is taken only when the CPU reports AVX2/FMA/F16C at
//! runtime (the wheel targets generic x86_64), with AVX-VNNI's `vpdpbusd` where the CPU has
//! it, else a portable path doing the same integer and f32 operations in the same order, so
//! all give the same bits; groups of 8 rows are split into contiguous ranges over
//! `num_threads` threads of the kernels' persistent pool, the caller's thread taking the
//! first range, and each output is computed whole by one thread by the fixed operations
//! above, so neither the thread count nor the other tokens of the call change its bits.

mod activations;
#[cfg(target_arch = "x86_64")]
mod avx2;
mod format;
mod pack;
mod portable;

pub use format::{dequantize_row, f16_to_f32, QuantType, QuantWeights, BLOCK};
pub use pack::{pack, packed_len, PackedWeights, GROUP};

use activations::Q8Activations;
use std::ops::Range;
use std::sync::{Mutex, OnceLock};

/// Weights below this many bytes are not worth another thread: handing a part to a pool
/// worker costs about as much as reading this much memory.
const MIN_BYTES_PER_THREAD: usize = 32 * 1024;

/// Tokens handled by one pass over a group's records; more tokens make more passes over the
/// (then L1-resident) records. A pass keeps two accumulators and one integer sum per token
/// (two for Q4 with VNNI at one token, see `avx2`), which with the unpacked weights fit the 16
/// AVX registers.
const TOKENS_PER_PASS: usize = 4;

/// Instruction set a call runs with (a parameter so tests can compare the paths).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// AVX2 with AVX-VNNI's `vpdpbusd` for the integer products (same results as Avx2).
    #[cfg(target_arch = "x86_64")]
    Avx2Vnni,
}

impl Isa {
    /// The fastest path this CPU supports.
    pub fn detect() -> Self {
        *Self::supported().last().expect("Portable is always supported")
    }

    /// Every path this CPU can run, slowest first (detected once).
    pub fn supported() -> &'static [Self] {
        static SUPPORTED: OnceLock<Vec<Isa>> = OnceLock::new();
        SUPPORTED.get_or_init(|| {
            let mut isas = vec![Self::Portable];
            #[cfg(target_arch = "x86_64")]
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c") {
                isas.push(Self::Avx2);
                if is_x86_feature_detected!("avxvnni") {
                    isas.push(Self::Avx2Vnni);
                }
            }
            isas
        })
    }
}

/// out f32 [tokens, rows] = x f32 [tokens, cols] @ w^T, with `w` read as packed quantized
/// blocks and `x` rounded to int8 blocks (see the module doc for the numerics).
///
/// `num_threads` (>= 1) is an upper bound: small matrices use fewer threads.
pub fn quant_matmul(
    out: &mut [f32],
    x: &[f32],
    tokens: usize,
    w: &PackedWeights,
    num_threads: usize,
) -> Result<(), String> {
    quant_matmul_with(out, x, tokens, w, num_threads, Isa::detect())
}

/// `quant_matmul` on a chosen instruction set; Err if this CPU lacks it.
pub fn quant_matmul_with(
    out: &mut [f32],
    x: &[f32],
    tokens: usize,
    w: &PackedWeights,
    num_threads: usize,
    isa: Isa,
) -> Result<(), String> {
    if num_threads == 0 {
        return Err("num_threads must be at least 1".into());
    }
    if Some(x.len()) != tokens.checked_mul(w.cols()) {
        return Err(format!("x has {} values, expected tokens {tokens} x cols {}", x.len(), w.cols()));
    }
    if Some(out.len()) != tokens.checked_mul(w.rows()) {
        return Err(format!("out has {} values, expected tokens {tokens} x rows {}", out.len(), w.rows()));
    }
    if !Isa::supported().contains(&isa) {
        return Err(format!("this CPU cannot run the {isa:?} path"));
    }
    if tokens == 0 || w.rows() == 0 {
        return Ok(());
    }

    // Once per call, not per group: every group's dot products read these int8 blocks.
    let act = Q8Activations::quantize(x, tokens, w.cols(), isa);
    let call = Call { ty: w.ty(), act: &act, tokens, cols: w.cols(), nb: w.cols() / BLOCK, isa };

    let group_bytes = w.group_bytes();
    let data = w.data();
    let by_size = (data.len() / MIN_BYTES_PER_THREAD).max(1);
    // NOTE: one fixed range per thread. Handing out chunks from a shared counter (so a late
    // worker costs only the chunks it did not take) was 0.8-1.1x of this on SmolLM2's shapes.
    let ranges = split(w.groups(), num_threads.min(by_size));
    let rows_of = |r: &Range<usize>| r.start * GROUP..(r.end * GROUP).min(w.rows());

    // Each range gets, for every token, its own disjoint slice of that token's output row.
    let mut parts: Vec<Vec<&mut [f32]>> = ranges.iter().map(|_| Vec::with_capacity(tokens)).collect();
    for out_row in out.chunks_exact_mut(w.rows()) {
        let mut rest = out_row;
        for (part, range) in parts.iter_mut().zip(&ranges) {
            let (head, tail) = rest.split_at_mut(rows_of(range).len());
            part.push(head);
            rest = tail;
        }
    }
    let data_of = |r: &Range<usize>| &data[r.start * group_bytes..r.end * group_bytes];

    // Each part's slices are taken by exactly one thread; the mutex only makes that visible
    // to the borrow checker (never contended).
    let parts: Vec<Mutex<Vec<&mut [f32]>>> = parts.into_iter().map(Mutex::new).collect();
    crate::pool::parallel(ranges.len(), &|i| {
        let mut part = parts[i].lock().unwrap_or_else(|e| e.into_inner());
        call.groups(data_of(&ranges[i]), &mut part);
    });
    Ok(())
}

/// out [rows, cols] = a packed matrix's weights in float32 (the values `dequantize_row` gives
/// the blocks it was packed from), on at most `num_threads` threads: for a weight a model
/// keeps only packed, in a step that computes it in float32.
pub fn dequantize_packed(w: &PackedWeights, out: &mut [f32], num_threads: usize) -> Result<(), String> {
    let (rows, cols) = (w.rows(), w.cols());
    if out.len() != rows * cols {
        return Err(format!("out holds {} values, the matrix {rows} x {cols}", out.len()));
    }
    let row_bytes = cols / BLOCK * w.ty().block_bytes();
    let ranges = split(rows, num_threads.max(1));
    let mut parts: Vec<&mut [f32]> = Vec::with_capacity(ranges.len());
    let mut rest = out;
    for range in &ranges {
        let (head, tail) = rest.split_at_mut(range.len() * cols);
        parts.push(head);
        rest = tail;
    }
    let parts: Vec<Mutex<&mut [f32]>> = parts.into_iter().map(Mutex::new).collect();
    let failed = Mutex::new(None);
    crate::pool::parallel(ranges.len(), &|i| {
        let mut part = parts[i].lock().unwrap_or_else(|e| e.into_inner());
        let mut blocks = vec![0u8; row_bytes];
        for (r, o) in ranges[i].clone().zip(part.chunks_exact_mut(cols)) {
            pack::unpack_row(w, r, &mut blocks);
            if let Err(e) = dequantize_row(w.ty(), &blocks, o) {
                *failed.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
                return;
            }
        }
    });
    failed.into_inner().unwrap_or_else(|e| e.into_inner()).map_or(Ok(()), Err)
}

/// `n` items split into at most `parts` contiguous, near-equal, non-empty ranges.
fn split(n: usize, parts: usize) -> Vec<Range<usize>> {
    let parts = parts.clamp(1, n.max(1));
    (0..parts).map(|i| n * i / parts..n * (i + 1) / parts).collect()
}

/// One call's shared, read-only inputs.
struct Call<'a> {
    ty: QuantType,
    act: &'a Q8Activations,
    tokens: usize,
    cols: usize,
    nb: usize,
    isa: Isa,
}

/// One pass's results: lane r of token j is row r of the group.
type Lanes = [[f32; GROUP]; TOKENS_PER_PASS];

impl Call<'_> {
    /// Groups `data` (whole groups) into `outs[t][i]` for each token t and row i of those
    /// groups (`outs[t].len()` rows: the last group's padding rows are not written).
    fn groups(&self, data: &[u8], outs: &mut [&mut [f32]]) {
        let group_bytes = self.nb * pack::record_bytes(self.ty);
        #[cfg(target_arch = "x86_64")]
        avx2::prefetch_head(data);
        let mut lanes: Lanes = [[0.0; GROUP]; TOKENS_PER_PASS];
        for (g, group) in data.chunks_exact(group_bytes).enumerate() {
            let mut t0 = 0;
            while t0 < self.tokens {
                let n = (self.tokens - t0).min(TOKENS_PER_PASS);
                self.pass(group, t0, n, &mut lanes);
                for (j, lane) in lanes[..n].iter().enumerate() {
                    let out = &mut outs[t0 + j][g * GROUP..];
                    let len = out.len().min(GROUP);
                    out[..len].copy_from_slice(&lane[..len]);
                }
                t0 += n;
            }
        }
    }

    /// lanes[j][r] = dot(x[t0 + j], row r of the group) for j < n (n <= TOKENS_PER_PASS, t0
    /// a multiple of it).
    fn pass(&self, group: &[u8], t0: usize, n: usize, lanes: &mut Lanes) {
        let a = self.act;
        let pass = Pass {
            qs: &a.qs[t0 * self.cols..(t0 + n) * self.cols],
            d: &a.d[t0..],
            s: &a.s[t0..],
            stride: a.stride,
            nb: self.nb,
            n,
        };
        match self.isa {
            Isa::Portable => portable::group(self.ty, group, &pass, lanes),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 | Isa::Avx2Vnni => {
                // A few comparisons per group: the unchecked reads below rely on these bounds.
                assert!(pass.check(group.len(), self.ty), "quantized pass layout");
                // SAFETY: quant_matmul_with checked that the CPU supports the isa, and the
                // assert above checked the bounds the kernel reads within.
                unsafe {
                    if self.isa == Isa::Avx2Vnni {
                        avx2::group_vnni(self.ty, group, &pass, lanes)
                    } else {
                        avx2::group(self.ty, group, &pass, lanes)
                    }
                }
            }
        }
    }
}

/// The int8 activations of one kernel pass: tokens t0..t0 + n of the call.
struct Pass<'a> {
    /// [n, nb * 32]: token j's block b at (j nb + b) 32
    qs: &'a [i8],
    /// from t0 on: token j's scale of block b at b stride + j
    d: &'a [f32],
    /// like d: the blocks' d * sum(q)
    s: &'a [f32],
    stride: usize,
    nb: usize,
    n: usize,
}

impl Pass<'_> {
    /// Index of token j's scale / sum of block b.
    #[inline(always)]
    fn at(&self, j: usize, b: usize) -> usize {
        b * self.stride + j
    }

    /// The bounds the AVX2 kernel's unchecked reads rely on.
    fn check(&self, group_len: usize, ty: QuantType) -> bool {
        let lanes = (self.nb - 1) * self.stride + self.n;
        (1..=TOKENS_PER_PASS).contains(&self.n)
            && self.qs.len() == self.n * self.nb * BLOCK
            && self.d.len() >= lanes
            && self.s.len() >= lanes
            && group_len == self.nb * pack::record_bytes(ty)
    }
}
