//! A whole decoder layer (Llama, Mistral, Qwen2, Qwen3, SmolLM3) for a step of decode tokens, over
//! GGUF-quantized weights: the CPU fast path of few-token steps.
//!
//! Why: at batch 1 a layer is ~35 small torch ops around four GEMVs, and each op costs a few
//! microseconds of dispatch; for SmolLM2-135M that is ~2-3 ms of a ~16 ms token. Here the
//! norms, RoPE, the KV write, the attention call, SiLU and the residual adds run in one call
//! per layer, and the GEMVs and attention use the crate's kernels.
//!
//! One step of `T` tokens, each the single new token of its own sequence:
//!
//! ```text
//! x = rms_norm(h) * input_norm
//! q | k | v = x Wqkv^T (+ bias);  Qwen3: per-head rms_norm of q and k
//! q, k = rope(q), rope(k)          rotate-half pairs (i, i + d/2), cos/sin rows per token;
//!                                  skipped in SmolLM3's NoPE layers
//! k_cache[slot], v_cache[slot] = k, v
//! h += attention(q; the sequence's cached keys and values) Wo^T (+ bias)
//! x = rms_norm(h) * post_norm
//! g | u = x Wgu^T;  h += (silu(g) * u) Wdown^T
//! ```
//!
//! Layouts (row-major): h [T, H]; cos, sin [T, head_dim / 2]; slots [T] (block * block_size +
//! offset); block_tables [T, W]; seq_lens [T] (context including this token); k_cache,
//! v_cache [num_blocks, block_size, kv_heads, head_dim].
//!
//! Every length, slot, block id and sequence length is checked before anything is written
//! (the GEMVs' own checks cannot fail after `validate`); the result does not depend on the
//! thread count (the kernels compute each output element on one thread).

use crate::decode::{check as check_decode, paged_decode_attention, DecodeShape};
use crate::kv_elem::KvElem;
use crate::quant::{quant_matmul, PackedWeights};

/// The sizes shared by every layer of a model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerShape {
    pub hidden: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub eps: f32,
    pub block_size: usize,
    /// Multiplies q . k before the softmax (usually head_dim^-0.5).
    pub scale: f32,
}

impl LayerShape {
    fn qkv_width(&self) -> usize {
        (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
    }
}

/// One layer's weights: norms as f32 vectors, the four linears as packed GGUF blocks
/// (`quant::pack`).
#[derive(Clone, Copy, Debug)]
pub struct LayerWeights<'a> {
    pub input_norm: &'a [f32],
    pub post_norm: &'a [f32],
    /// [(heads + 2 kv_heads) * head_dim, H]: q rows, then k, then v.
    pub qkv: PackedWeights<'a>,
    pub qkv_bias: Option<&'a [f32]>,
    /// Qwen3's per-head norms of q and k ([head_dim] each), applied before RoPE.
    pub q_norm: Option<&'a [f32]>,
    pub k_norm: Option<&'a [f32]>,
    /// Whether q and k are rotated: false in a NoPE layer (SmolLM3's every fourth).
    pub rope: bool,
    /// [H, heads * head_dim]
    pub o_proj: PackedWeights<'a>,
    pub o_bias: Option<&'a [f32]>,
    /// [2 * intermediate, H]: gate rows, then up.
    pub gate_up: PackedWeights<'a>,
    /// [H, intermediate]
    pub down: PackedWeights<'a>,
}

/// What the step's tokens share across layers (see the module doc for layouts).
#[derive(Clone, Copy, Debug)]
pub struct DecodeTokens<'a> {
    pub cos: &'a [f32],
    pub sin: &'a [f32],
    pub slots: &'a [i64],
    pub block_tables: &'a [i32],
    pub seq_lens: &'a [i32],
}

/// Intermediate buffers, reused by every layer of a step.
#[derive(Default)]
pub struct Scratch {
    x: Vec<f32>,
    qkv: Vec<f32>,
    q: Vec<f32>,
    attn: Vec<f32>,
    up: Vec<f32>,
    act: Vec<f32>,
    out: Vec<f32>,
}

fn sized(buf: &mut Vec<f32>, n: usize) -> &mut [f32] {
    buf.resize(n, 0.0);
    &mut buf[..n]
}

fn check_len(name: &str, got: usize, want: usize) -> Result<(), String> {
    if got == want {
        Ok(())
    } else {
        Err(format!("{name} has {got} elements, expected {want}"))
    }
}

fn check_linear(name: &str, w: &PackedWeights, rows: usize, cols: usize) -> Result<(), String> {
    if (w.rows(), w.cols()) == (rows, cols) {
        Ok(())
    } else {
        Err(format!("{name} is [{}, {}], expected [{rows}, {cols}]", w.rows(), w.cols()))
    }
}

impl LayerWeights<'_> {
    /// Checks every weight's size against the model's shape.
    pub fn check(&self, s: &LayerShape) -> Result<(), String> {
        let (hd, d) = (s.hidden, s.head_dim);
        if d == 0 || d % 2 != 0 || s.num_heads == 0 || s.num_kv_heads == 0 {
            return Err(format!("head_dim must be even and > 0, and there must be heads: {s:?}"));
        }
        check_len("input_norm", self.input_norm.len(), hd)?;
        check_len("post_norm", self.post_norm.len(), hd)?;
        check_linear("qkv", &self.qkv, s.qkv_width(), hd)?;
        check_linear("o_proj", &self.o_proj, hd, s.num_heads * d)?;
        check_linear("gate_up", &self.gate_up, 2 * s.intermediate, hd)?;
        check_linear("down", &self.down, hd, s.intermediate)?;
        for (name, v, n) in [("qkv_bias", self.qkv_bias, s.qkv_width()), ("o_bias", self.o_bias, hd)] {
            if let Some(v) = v {
                check_len(name, v.len(), n)?;
            }
        }
        for (name, v) in [("q_norm", self.q_norm), ("k_norm", self.k_norm)] {
            if let Some(v) = v {
                check_len(name, v.len(), d)?;
            }
        }
        Ok(())
    }
}

/// Checks every size of one layer call (nothing has been written yet when this fails).
fn validate<E: KvElem>(
    h: &[f32],
    tokens: usize,
    w: &LayerWeights,
    s: &LayerShape,
    step: &DecodeTokens,
    k_cache: &[E],
    v_cache: &[E],
) -> Result<(), String> {
    w.check(s)?;
    let d = s.head_dim;
    if s.block_size == 0 {
        return Err("block_size must be > 0".into());
    }
    check_len("h", h.len(), tokens * s.hidden)?;
    check_len("cos", step.cos.len(), tokens * d / 2)?;
    check_len("sin", step.sin.len(), tokens * d / 2)?;
    check_len("slots", step.slots.len(), tokens)?;
    let slot_len = s.num_kv_heads * d;
    if k_cache.len() != v_cache.len() || !k_cache.len().is_multiple_of(slot_len * s.block_size) {
        return Err(format!(
            "k_cache ({}) and v_cache ({}) must hold the same whole number of blocks of {} elements",
            k_cache.len(),
            v_cache.len(),
            slot_len * s.block_size
        ));
    }
    let num_slots = k_cache.len() / slot_len;
    if let Some(&bad) = step.slots.iter().find(|&&slot| slot < 0 || slot as usize >= num_slots) {
        return Err(format!("slot {bad} is outside the cache's 0..{num_slots}"));
    }
    Ok(())
}

/// 1 / sqrt(mean(row^2) + eps). NOTE: accumulated in f64, so it matches torch's fp32
/// rms_norm to rounding whatever the row's length.
fn inv_rms(row: &[f32], eps: f32) -> f32 {
    let mean = row.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / row.len() as f64;
    (1.0 / (mean + f64::from(eps)).sqrt()) as f32
}

/// x[t] = rms_norm(src[t]) * weight for each row of `width`.
fn rms_norm(x: &mut [f32], src: &[f32], weight: &[f32], width: usize, eps: f32) {
    for (row, src) in x.chunks_exact_mut(width).zip(src.chunks_exact(width)) {
        let inv = inv_rms(src, eps);
        for ((o, &v), &g) in row.iter_mut().zip(src).zip(weight) {
            *o = v * inv * g;
        }
    }
}

/// Every row of `rows` (rows of `weight.len()` values) through rms_norm(row) * weight in
/// place: the model's final norm after the last layer.
pub fn rms_norm_rows(rows: &mut [f32], weight: &[f32], eps: f32) {
    if !weight.is_empty() {
        rows.chunks_exact_mut(weight.len()).for_each(|row| rms_norm_in_place(row, weight, eps));
    }
}

fn rms_norm_in_place(row: &mut [f32], weight: &[f32], eps: f32) {
    let inv = inv_rms(row, eps);
    row.iter_mut().zip(weight).for_each(|(v, &g)| *v = *v * inv * g);
}

/// RoPE in place on the first `heads` heads of every row of `rows` (rows of `row_len` values,
/// heads of `head_dim`): row t takes cos/sin row t ([T, head_dim / 2] each). The torch path's
/// prompt steps (`RotaryEmbedding.apply`: one call where torch runs eight ops); each value is
/// the same f32 products and sum as those ops', so the same bits.
pub fn rope_rows(
    rows: &mut [f32],
    row_len: usize,
    heads: usize,
    head_dim: usize,
    cos: &[f32],
    sin: &[f32],
) -> Result<(), String> {
    if head_dim == 0 || !head_dim.is_multiple_of(2) {
        return Err(format!("head_dim {head_dim} must be even and positive"));
    }
    if heads.checked_mul(head_dim).is_none_or(|w| w > row_len) {
        return Err(format!("{heads} heads of {head_dim} do not fit a row of {row_len}"));
    }
    if row_len == 0 || !rows.len().is_multiple_of(row_len) {
        return Err(format!("{} values are not rows of {row_len}", rows.len()));
    }
    let (tokens, half) = (rows.len() / row_len, head_dim / 2);
    if cos.len() != tokens * half || sin.len() != tokens * half {
        return Err(format!("cos and sin must be [{tokens}, {half}] (got {} and {} values)", cos.len(), sin.len()));
    }
    for (t, row) in rows.chunks_exact_mut(row_len).enumerate() {
        let (c, s) = (&cos[t * half..][..half], &sin[t * half..][..half]);
        row[..heads * head_dim].chunks_exact_mut(head_dim).for_each(|head| rope(head, c, s));
    }
    Ok(())
}

/// Rotate-half RoPE of one head in place: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
fn rope(head: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = head.len() / 2;
    let (x1, x2) = head.split_at_mut(half);
    for i in 0..half {
        let (a, b) = (x1[i], x2[i]);
        x1[i] = a * cos[i] - b * sin[i];
        x2[i] = b * cos[i] + a * sin[i];
    }
}

fn add_bias(rows: &mut [f32], bias: Option<&[f32]>) {
    if let Some(bias) = bias {
        for row in rows.chunks_exact_mut(bias.len()) {
            row.iter_mut().zip(bias).for_each(|(o, b)| *o += b);
        }
    }
}

/// Runs one decoder layer on `tokens` decode tokens: `h` [T, H] is updated in place, and the
/// tokens' K/V are written to the caches (narrowed to the caches' element type, see
/// `kv_elem`). `threads` bounds the GEMV and attention threads.
#[allow(clippy::too_many_arguments)]
pub fn decoder_layer<E: KvElem>(
    h: &mut [f32],
    tokens: usize,
    w: &LayerWeights,
    s: &LayerShape,
    step: &DecodeTokens,
    k_cache: &mut [E],
    v_cache: &mut [E],
    scratch: &mut Scratch,
    threads: usize,
) -> Result<(), String> {
    validate(h, tokens, w, s, step, k_cache, v_cache)?;
    if tokens == 0 {
        return Ok(());
    }
    let (hd, d, nh, nkv) = (s.hidden, s.head_dim, s.num_heads, s.num_kv_heads);
    let width = s.qkv_width();
    // The table width follows from the tables' length; the attention kernel checks the rest.
    if !step.block_tables.len().is_multiple_of(tokens) {
        return Err(format!("block_tables ({}) is not {tokens} rows", step.block_tables.len()));
    }
    let attn_shape = DecodeShape {
        num_seqs: tokens,
        num_heads: nh,
        num_kv_heads: nkv,
        head_dim: d,
        block_size: s.block_size,
        block_table_width: step.block_tables.len() / tokens,
        scale: s.scale,
        window: 0,
        softcap: 0.0,
    };

    // attention block
    let x = sized(&mut scratch.x, tokens * hd);
    rms_norm(x, h, w.input_norm, hd, s.eps);
    let qkv = sized(&mut scratch.qkv, tokens * width);
    quant_matmul(qkv, x, tokens, &w.qkv, threads)?;
    add_bias(qkv, w.qkv_bias);
    let q = sized(&mut scratch.q, tokens * nh * d);
    let half = d / 2;
    for t in 0..tokens {
        let row = &mut qkv[t * width..][..width];
        let (cos, sin) = (&step.cos[t * half..][..half], &step.sin[t * half..][..half]);
        for (j, head) in row[..(nh + nkv) * d].chunks_exact_mut(d).enumerate() {
            if let Some(norm) = if j < nh { w.q_norm } else { w.k_norm } {
                rms_norm_in_place(head, norm, s.eps);
            }
            if w.rope {
                rope(head, cos, sin);
            }
        }
        q[t * nh * d..][..nh * d].copy_from_slice(&row[..nh * d]);
    }
    // The attention's own checks (tables, lengths) run before the caches are written.
    check_decode(q, k_cache, v_cache, step.block_tables, step.seq_lens, attn_shape)?;
    for (t, row) in qkv.chunks_exact(width).enumerate() {
        let slot = step.slots[t] as usize * nkv * d;
        let (k, v) = (&row[nh * d..][..nkv * d], &row[(nh + nkv) * d..][..nkv * d]);
        k_cache[slot..][..nkv * d].iter_mut().zip(k).for_each(|(c, &x)| *c = E::narrow(x));
        v_cache[slot..][..nkv * d].iter_mut().zip(v).for_each(|(c, &x)| *c = E::narrow(x));
    }
    let attn = sized(&mut scratch.attn, tokens * nh * d);
    paged_decode_attention(attn, q, k_cache, v_cache, step.block_tables, step.seq_lens, attn_shape, threads)?;
    let out = sized(&mut scratch.out, tokens * hd);
    quant_matmul(out, attn, tokens, &w.o_proj, threads)?;
    add_bias(out, w.o_bias);
    h.iter_mut().zip(out.iter()).for_each(|(a, b)| *a += b);

    // MLP block
    let x = sized(&mut scratch.x, tokens * hd);
    rms_norm(x, h, w.post_norm, hd, s.eps);
    let inter = s.intermediate;
    let up = sized(&mut scratch.up, tokens * 2 * inter);
    quant_matmul(up, x, tokens, &w.gate_up, threads)?;
    let act = sized(&mut scratch.act, tokens * inter);
    for (a, gu) in act.chunks_exact_mut(inter).zip(up.chunks_exact(2 * inter)) {
        let (g, u) = gu.split_at(inter);
        for ((o, &g), &u) in a.iter_mut().zip(g).zip(u) {
            *o = g / (1.0 + (-g).exp()) * u;
        }
    }
    let out = sized(&mut scratch.out, tokens * hd);
    quant_matmul(out, act, tokens, &w.down, threads)?;
    h.iter_mut().zip(out.iter()).for_each(|(a, b)| *a += b);
    Ok(())
}

#[cfg(test)]
mod tests;
