//! llmserve._core: the only PyO3 crate.
//!
//! It exports the whole Rust surface from this one place: `Router` (protocol: prepare,
//! tokenize, render), `Prepared` (a validated request on its way to the engine), `Core` (the
//! scheduler plus each request's output state: add / abort / schedule / commit / stats),
//! `Plan` (one step's flat columns as numpy arrays), the `ApiError` exception hierarchy and
//! the CPU kernels over numpy views: `paged_decode_attention` (decode attention),
//! `quant_matmul` (quantized GEMV) with `quant_pack` (its weight layout), `dequantize` (GGUF
//! blocks to float32), `apply_token_bitmask` (a grammar's mask on logits), `rope_rows` (RoPE in
//! place on a prompt step's q and k heads) and `CpuDecoder` (every decoder layer of a few-token
//! decode step in one call).
//! Every call that takes time releases the GIL; data crosses once per step as flat buffers.
//! Each wraps a type or function of the pure crates (router, core, scheduler, kernels), which
//! hold the logic and its Rust tests.

mod core;
mod decoder;
mod errors;
mod kernels;
mod plan;
mod quant;
mod router;

use pyo3::prelude::*;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<router::PyRouter>()?;
    m.add_class::<router::PyPrepared>()?;
    m.add_class::<core::PyCore>()?;
    m.add_class::<plan::PyPlan>()?;
    m.add_class::<decoder::PyCpuDecoder>()?;
    m.add_function(wrap_pyfunction!(kernels::paged_decode_attention, m)?)?;
    m.add_function(wrap_pyfunction!(quant::quant_matmul, m)?)?;
    m.add_function(wrap_pyfunction!(quant::quant_pack, m)?)?;
    m.add_function(wrap_pyfunction!(quant::dequantize, m)?)?;
    m.add_function(wrap_pyfunction!(quant::dequantize_packed, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::apply_token_bitmask, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::rope_rows, m)?)?;
    m.add_function(wrap_pyfunction!(errors::responses_error_event, m)?)?;
    errors::register(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("numerics_revision", llmserve_kernels::NUMERICS_REVISION)?;
    let build = pyo3::types::PyDict::new(m.py());
    build.set_item("profile", env!("LLMSERVE_BUILD_PROFILE"))?;
    build.set_item("target", env!("LLMSERVE_BUILD_TARGET"))?;
    build.set_item("rustc", env!("LLMSERVE_BUILD_RUSTC"))?;
    build.set_item("commit", Some(env!("LLMSERVE_BUILD_COMMIT")).filter(|c| !c.is_empty()))?;
    m.add("build_info", build)?;
    Ok(())
}
