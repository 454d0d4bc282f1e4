//! `quant_matmul`: llmserve-kernels' quantized GEMV over numpy arrays, for decode steps of a
//! few tokens that read a GGUF's Q8_0 / Q4_0 / Q4_1 weights (the GIL is released while it
//! computes); `quant_pack`: such a matrix's raw blocks into the layout `quant_matmul` reads,
//! once per model; `dequantize`: the raw blocks to float32, as the loader needs it.
//!
//! Shapes: out f32 [T, R] (written), x f32 [T, K], w_raw u8 [R, K / 32 * block_bytes] (the
//! GGUF tensor's raw rows), w_packed u8 [ceil(R / 8), K / 32 * 8 * block_bytes] (what
//! `quant_pack` returns: `llmserve_kernels::quant::pack`'s layout). Every array must be
//! C-contiguous. A shape mismatch, an unknown ggml type, a non-contiguous array or
//! num_threads == 0 is a ValueError (nothing written); a wrong dtype is numpy's TypeError.
//!
//! Numerics: each token's x is rounded to int8 blocks of 32 (one scale per block) before the
//! integer dot products, as llama.cpp does, so the result is the dequantized weights times
//! that rounded x (see `llmserve_kernels::quant`), not exactly the fp32 matmul.

use llmserve_kernels::quant::{dequantize_row, pack, PackedWeights, QuantType, QuantWeights, BLOCK, GROUP};
use numpy::{PyArray2, PyArrayMethods, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// The kernels' type of a ggml type id, or why there is none.
fn quant_type(ggml_type: u32) -> Result<QuantType, String> {
    QuantType::from_ggml(ggml_type)
        .ok_or_else(|| format!("ggml type {ggml_type} is not Q4_0 (2), Q4_1 (3) or Q8_0 (8)"))
}

fn bad<T>(what: impl std::fmt::Display) -> PyResult<T> {
    Err(PyValueError::new_err(format!("quant_matmul: {what}")))
}

/// out[r, :] = row r of `w_raw` read as ggml blocks of `ggml_type`, dequantized exactly as
/// ggml defines the format (the same float32 values as the `gguf` package's `dequantize`).
/// Shapes: out f32 [rows, cols] (written), w_raw u8 [rows, cols / 32 * block_bytes].
#[pyfunction]
pub fn dequantize(
    py: Python<'_>,
    out: &Bound<'_, PyArray2<f32>>,
    w_raw: PyReadonlyArray2<'_, u8>,
    ggml_type: u32,
) -> PyResult<()> {
    let err = |what: String| Err(PyValueError::new_err(format!("dequantize: {what}")));
    let mut out = crate::kernels::writeable(out, "dequantize", "out")?;
    let ty = match quant_type(ggml_type) {
        Ok(ty) => ty,
        Err(e) => return err(e),
    };
    let (ws, os) = (w_raw.shape().to_vec(), out.shape().to_vec());
    match ty.row_bytes(os[1]) {
        Ok(row_bytes) if ws == [os[0], row_bytes] => {}
        Ok(row_bytes) => return err(format!("w_raw {ws:?} must be [{}, {row_bytes}] for out {os:?}", os[0])),
        Err(e) => return err(e),
    }
    let Ok(out) = out.as_slice_mut() else { return err("out must be C-contiguous".into()) };
    let Ok(data) = w_raw.as_slice() else { return err("w_raw must be C-contiguous".into()) };
    let (row_bytes, cols) = (ws[1], os[1]);
    py.detach(|| {
        data.chunks_exact(row_bytes).zip(out.chunks_exact_mut(cols)).try_for_each(|(row, o)| dequantize_row(ty, row, o))
    })
    .or_else(err)
}

/// out[r, :] = row r of a packed matrix (`quant_pack`'s `w_packed` of `ggml_type`) dequantized,
/// the same values as `dequantize` of the blocks it was packed from, on at most `num_threads`
/// threads. Shapes: out f32 [rows, cols] (written), w_packed u8 [ceil(rows / 8), cols / 32 * 8
/// * block_bytes].
#[pyfunction]
pub fn dequantize_packed(
    py: Python<'_>,
    out: &Bound<'_, PyArray2<f32>>,
    w_packed: PyReadonlyArray2<'_, u8>,
    ggml_type: u32,
    num_threads: usize,
) -> PyResult<()> {
    let err = |what: String| Err(PyValueError::new_err(format!("dequantize_packed: {what}")));
    let mut out = crate::kernels::writeable(out, "dequantize_packed", "out")?;
    let ty = match quant_type(ggml_type) {
        Ok(ty) => ty,
        Err(e) => return err(e),
    };
    let [rows, cols] = [out.shape()[0], out.shape()[1]];
    let w = match packed_view(&w_packed, ty, rows, cols) {
        Ok(w) => w,
        Err(e) => return err(e),
    };
    let Ok(out) = out.as_slice_mut() else { return err("out must be C-contiguous".into()) };
    py.detach(|| llmserve_kernels::quant::dequantize_packed(&w, out, num_threads)).or_else(err)
}

/// `w_raw`'s GGUF blocks of `ggml_type` regrouped eight rows at a time: a new uint8 array
/// [ceil(rows / 8), cols / 32 * 8 * block_bytes], the `w_packed` of `quant_matmul`.
#[pyfunction]
pub fn quant_pack<'py>(
    py: Python<'py>,
    w_raw: PyReadonlyArray2<'py, u8>,
    ggml_type: u32,
) -> PyResult<Bound<'py, PyArray2<u8>>> {
    let err = |what: String| Err(PyValueError::new_err(format!("quant_pack: {what}")));
    let ty = match quant_type(ggml_type) {
        Ok(ty) => ty,
        Err(e) => return err(e),
    };
    let [rows, row_bytes] = [w_raw.shape()[0], w_raw.shape()[1]];
    if row_bytes == 0 || !row_bytes.is_multiple_of(ty.block_bytes()) {
        return err(format!("rows of {row_bytes} bytes are not whole {ty:?} blocks"));
    }
    let Ok(data) = w_raw.as_slice() else { return err("w_raw must be C-contiguous".into()) };
    let w = match QuantWeights::new(ty, rows, row_bytes / ty.block_bytes() * BLOCK, data) {
        Ok(w) => w,
        Err(e) => return err(e),
    };
    let packed = py.detach(|| pack(&w));
    let groups = rows.div_ceil(GROUP);
    numpy::PyArray1::from_vec(py, packed).reshape([groups, GROUP * row_bytes])
}

/// out[t, r] = sum_k x[t, k] * w[r, k], with w's rows read from `w_packed` (`quant_pack` of
/// blocks of `ggml_type`: 2 = Q4_0, 3 = Q4_1, 8 = Q8_0) and x rounded to int8 blocks; at most
/// `num_threads` threads.
#[pyfunction]
#[allow(clippy::too_many_arguments)] // the Python signature the brief fixes
pub fn quant_matmul(
    py: Python<'_>,
    out: &Bound<'_, PyArray2<f32>>,
    x: PyReadonlyArray2<'_, f32>,
    w_packed: PyReadonlyArray2<'_, u8>,
    ggml_type: u32,
    rows: usize,
    cols: usize,
    num_threads: usize,
) -> PyResult<()> {
    let mut out = crate::kernels::writeable(out, "quant_matmul", "out")?;
    let ty = match quant_type(ggml_type) {
        Ok(ty) => ty,
        Err(e) => return bad(e),
    };
    let (xs, os) = (x.shape().to_vec(), out.shape().to_vec());
    let w = match packed_view(&w_packed, ty, rows, cols) {
        Ok(w) => w,
        Err(e) => return bad(e),
    };
    if xs[1] != cols {
        return bad(format!("x {xs:?} must have {cols} columns"));
    }
    if os != [xs[0], rows] {
        return bad(format!("out {os:?} must be [{}, {rows}]", xs[0]));
    }
    let Ok(out) = out.as_slice_mut() else { return bad("out must be C-contiguous") };
    let Ok(x) = x.as_slice() else { return bad("x must be C-contiguous") };
    let tokens = xs[0];
    py.detach(|| llmserve_kernels::quant::quant_matmul(out, x, tokens, &w, num_threads)).or_else(bad)
}

/// `a` as packed weights of `rows x cols` of `ty`: its shape must be the one `quant_pack`
/// returns (the byte count alone would also pass raw blocks whose rows are a multiple of 8).
pub(crate) fn packed_view<'a>(
    a: &'a PyReadonlyArray2<'_, u8>,
    ty: QuantType,
    rows: usize,
    cols: usize,
) -> Result<PackedWeights<'a>, String> {
    let want = [rows.div_ceil(GROUP), GROUP * ty.row_bytes(cols)?];
    if a.shape() != want {
        return Err(format!(
            "w_packed {:?} must be {want:?} (quant_pack of {rows} rows of {ty:?} x {cols})",
            a.shape()
        ));
    }
    let data = a.as_slice().map_err(|_| "w_packed must be C-contiguous".to_string())?;
    PackedWeights::new(ty, rows, cols, data)
}
