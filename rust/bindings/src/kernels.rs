//! The CPU kernels of llmserve-kernels over numpy arrays: `paged_decode_attention` (paged-
//! attention decode), `apply_token_bitmask` (a grammar's token mask on the sampler's logits) and
//! `rope_rows` (RoPE in place on the q and k heads of a prompt step's fused qkv rows).
//! torch CPU tensors reach them as zero-copy views (`tensor.numpy()`); the GIL is released while
//! they compute.
//!
//! Shapes of paged_decode_attention: out, q [S, heads, head_dim] f32; k_cache, v_cache
//! [num_blocks, block_size, kv_heads, head_dim] of the `kv_dtype`'s bits (f32; uint16 for
//! bfloat16; uint8 for fp8_e4m3 and fp8_e5m2); block_tables [S, W] i32; seq_lens [S] i32.
//! Shapes of apply_token_bitmask: logits [R, V] f32 (written in place); rows [Rm] i64; bitmask
//! [Rm, W] i32. Shapes of rope_rows: x [T, W] f32 (its first heads * head_dim columns written in
//! place); cos, sin [T, head_dim / 2] f32.
//!
//! Every array must be C-contiguous. A shape mismatch, a non-contiguous array, a bad length,
//! block id or row index is a ValueError (nothing written); a wrong dtype is numpy's TypeError.

use llmserve_kernels::{DecodeShape, KvElem};
use numpy::{
    Element, PyArray, PyArray2, PyArray3, PyArray4, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2,
    PyReadonlyArray3, PyReadwriteArray, PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

fn contiguous<T>(r: Result<T, numpy::NotContiguousError>, name: &str) -> PyResult<T> {
    contiguous_in(r, "paged_decode_attention", name)
}

fn contiguous_in<T>(r: Result<T, numpy::NotContiguousError>, func: &str, name: &str) -> PyResult<T> {
    r.map_err(|_| PyValueError::new_err(format!("{func}: {name} must be C-contiguous")))
}

/// Borrows an output array for writing. Extracting a `PyReadwriteArray` argument directly
/// panics on a read-only or aliased array; borrowing here makes that a ValueError instead.
pub(crate) fn writeable<'py, T: Element, D: numpy::ndarray::Dimension>(
    array: &Bound<'py, PyArray<T, D>>,
    func: &str,
    name: &str,
) -> PyResult<PyReadwriteArray<'py, T, D>> {
    array
        .try_readwrite()
        .map_err(|e| PyValueError::new_err(format!("{func}: {name} must be writeable and not aliased: {e}")))
}

/// out = softmax(scale * q k^T) v for one query token per sequence, read through the block
/// tables; `num_threads` threads (the engine passes torch's thread count). `window` > 0: each
/// sequence attends over its last `window` tokens only (sliding-window attention). `softcap` > 0:
/// each scaled score s is softcap * tanh(s / softcap) (Gemma 2's soft-capping). `kv_dtype`: what
/// the caches hold (`kv_cache_bits` says which numpy dtype carries each).
#[pyfunction]
#[pyo3(signature = (out, q, k_cache, v_cache, block_tables, seq_lens, scale, num_threads, window=0, softcap=0.0, kv_dtype="float32"))]
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_attention(
    py: Python<'_>,
    out: &Bound<'_, PyArray3<f32>>,
    q: PyReadonlyArray3<'_, f32>,
    k_cache: &Bound<'_, PyAny>,
    v_cache: &Bound<'_, PyAny>,
    block_tables: PyReadonlyArray2<'_, i32>,
    seq_lens: PyReadonlyArray1<'_, i32>,
    scale: f32,
    num_threads: usize,
    window: usize,
    softcap: f32,
    kv_dtype: &str,
) -> PyResult<()> {
    with_kv_elem!(kv_dtype, "paged_decode_attention", E => decode_as::<E>(
        py, out, q, k_cache, v_cache, block_tables, seq_lens, scale, num_threads, window, softcap
    ))
}

/// `$body` with the type `$E` the [`KvElem`] that `$name` names (its `NAME`), or a ValueError
/// from `$func` for a name none has.
macro_rules! with_kv_elem {
    ($name:expr, $func:expr, $E:ident => $body:expr) => {
        match $name {
            "float32" => {
                type $E = f32;
                $body
            }
            "bfloat16" => {
                type $E = llmserve_kernels::Bf16;
                $body
            }
            "fp8_e4m3" => {
                type $E = llmserve_kernels::Fp8E4M3;
                $body
            }
            "fp8_e5m2" => {
                type $E = llmserve_kernels::Fp8E5M2;
                $body
            }
            other => Err(pyo3::exceptions::PyValueError::new_err(format!(
                "{}: kv_dtype {other:?} is none of float32, bfloat16, fp8_e4m3, fp8_e5m2",
                $func
            ))),
        }
    };
}
pub(crate) use with_kv_elem;

/// A KV cache array of element type `E`: numpy's array of `E`'s bits (f32, uint16 for bfloat16,
/// uint8 for fp8); another dtype or rank is a TypeError.
pub(crate) fn kv_cache_bits<'py, E: KvElem>(
    a: &Bound<'py, PyAny>,
    func: &str,
    name: &str,
) -> PyResult<Bound<'py, PyArray4<E::Bits>>>
where
    E::Bits: Element,
{
    a.cast::<PyArray4<E::Bits>>().cloned().map_err(|_| {
        let bits = std::any::type_name::<E::Bits>();
        PyTypeError::new_err(format!("{func}: {name} must be a 4-d numpy array of {bits} for kv_dtype {}", E::NAME))
    })
}

/// `paged_decode_attention` with the caches' element type `E`.
#[allow(clippy::too_many_arguments)]
fn decode_as<E: KvElem>(
    py: Python<'_>,
    out: &Bound<'_, PyArray3<f32>>,
    q: PyReadonlyArray3<'_, f32>,
    k_cache: &Bound<'_, PyAny>,
    v_cache: &Bound<'_, PyAny>,
    block_tables: PyReadonlyArray2<'_, i32>,
    seq_lens: PyReadonlyArray1<'_, i32>,
    scale: f32,
    num_threads: usize,
    window: usize,
    softcap: f32,
) -> PyResult<()>
where
    E::Bits: Element,
{
    const NAME: &str = "paged_decode_attention";
    let k_cache = kv_cache_bits::<E>(k_cache, NAME, "k_cache")?;
    let v_cache = kv_cache_bits::<E>(v_cache, NAME, "v_cache")?;
    let (k_cache, v_cache) = (k_cache.readonly(), v_cache.readonly());
    let mut out = writeable(out, NAME, "out")?;
    let (qs, ks, ts) = (q.shape().to_vec(), k_cache.shape().to_vec(), block_tables.shape().to_vec());
    let bad = |what: String| Err(PyValueError::new_err(format!("{NAME}: {what}")));
    if out.shape() != qs.as_slice() {
        return bad(format!("out {:?} must have q's shape {qs:?}", out.shape()));
    }
    if v_cache.shape() != ks.as_slice() {
        return bad(format!("v_cache {:?} must have k_cache's shape {ks:?}", v_cache.shape()));
    }
    if ks[3] != qs[2] {
        return bad(format!("head_dim differs: q {qs:?}, k_cache {ks:?}"));
    }
    if ts[0] != qs[0] {
        return bad(format!("block_tables {ts:?} must have one row per sequence of q {qs:?}"));
    }
    let shape = DecodeShape {
        num_seqs: qs[0],
        num_heads: qs[1],
        num_kv_heads: ks[2],
        head_dim: qs[2],
        block_size: ks[1],
        block_table_width: ts[1],
        scale,
        window,
        softcap,
    };
    let out = contiguous(out.as_slice_mut(), "out")?;
    let q = contiguous(q.as_slice(), "q")?;
    let k = E::from_bits(contiguous(k_cache.as_slice(), "k_cache")?);
    let v = E::from_bits(contiguous(v_cache.as_slice(), "v_cache")?);
    let tables = contiguous(block_tables.as_slice(), "block_tables")?;
    let lens = contiguous(seq_lens.as_slice(), "seq_lens")?;
    py.detach(|| llmserve_kernels::paged_decode_attention(out, q, k, v, tables, lens, shape, num_threads))
        .map_err(|e| PyValueError::new_err(format!("{NAME}: {e}")))
}

/// Sets logits[rows[i], t] = -inf for every token t that bitmask row i forbids (bit t % 32 of
/// word t / 32 is 0, or t >= W * 32), in place. A row outside 0..R, or a bitmask whose row
/// count is not len(rows), is a ValueError (nothing written).
#[pyfunction]
pub fn apply_token_bitmask(
    py: Python<'_>,
    logits: &Bound<'_, PyArray2<f32>>,
    rows: PyReadonlyArray1<'_, i64>,
    bitmask: PyReadonlyArray2<'_, i32>,
) -> PyResult<()> {
    const NAME: &str = "apply_token_bitmask";
    let mut logits = writeable(logits, NAME, "logits")?;
    let num_rows = logits.shape()[0];
    if bitmask.shape()[0] != rows.len() {
        let what = format!("bitmask {:?} must have one row per entry of rows ({})", bitmask.shape(), rows.len());
        return Err(PyValueError::new_err(format!("{NAME}: {what}")));
    }
    let logits = contiguous_in(logits.as_slice_mut(), NAME, "logits")?;
    let rows = contiguous_in(rows.as_slice(), NAME, "rows")?;
    let bitmask = contiguous_in(bitmask.as_slice(), NAME, "bitmask")?;
    py.detach(|| llmserve_kernels::apply_token_bitmask(logits, num_rows, rows, bitmask))
        .map_err(|e| PyValueError::new_err(format!("{NAME}: {e}")))
}

/// RoPE (rotate-half) in place on the first `heads` heads (of `head_dim`) of every row of x
/// [T, W], row t with cos/sin row t.
#[pyfunction]
pub fn rope_rows(
    py: Python<'_>,
    x: &Bound<'_, PyArray2<f32>>,
    heads: usize,
    head_dim: usize,
    cos: PyReadonlyArray2<'_, f32>,
    sin: PyReadonlyArray2<'_, f32>,
) -> PyResult<()> {
    const NAME: &str = "rope_rows";
    let mut x = writeable(x, NAME, "x")?;
    let row_len = x.shape()[1];
    let x = contiguous_in(x.as_slice_mut(), NAME, "x")?;
    let cos = contiguous_in(cos.as_slice(), NAME, "cos")?;
    let sin = contiguous_in(sin.as_slice(), NAME, "sin")?;
    py.detach(|| llmserve_kernels::layer::rope_rows(x, row_len, heads, head_dim, cos, sin))
        .map_err(|e| PyValueError::new_err(format!("{NAME}: {e}")))
}
