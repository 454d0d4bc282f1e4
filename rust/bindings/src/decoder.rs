//! `CpuDecoder`: llmserve-kernels' whole-layer decode (`layer::decoder_layer`) over a model's
//! numpy weights, every layer of a step in one call with the GIL released.
//!
//! Built once per model (python/llmserve/models/cpu_decoder.py) from:
//! - `shape`: dict with hidden, num_heads, num_kv_heads, head_dim, intermediate, eps, scale;
//! - `layers`: one dict per layer: input_norm, post_norm f32 [H]; qkv, o_proj, gate_up, down as
//!   (packed u8 from `_core.quant_pack`, ggml_type, rows, cols); optional qkv_bias, o_bias, q_norm,
//!   k_norm f32 vectors; optional `rope` (default true; false: a NoPE layer, q and k not rotated);
//! - `final_norm` (optional): the model's norm after the last layer, f32 [H].
//!
//! The decoder keeps references to those arrays (no copy); it reads them, never writes them.
//! `forward(h, cos, sin, slots, block_tables, seq_lens, k_caches, v_caches, num_threads,
//! kv_dtype="float32")` runs every layer on h [T, H] in place (layouts as in
//! rust/kernels/src/layer.rs), then the final norm if there is one; the caches hold `kv_dtype`
//! (the arrays `paged_decode_attention` takes for it). Every check runs before the first layer
//! writes anything; a bad argument is a ValueError.

use std::sync::Mutex;

use llmserve_kernels::layer::{decoder_layer, rms_norm_rows, DecodeTokens, LayerShape, LayerWeights, Scratch};
use llmserve_kernels::quant::{PackedWeights, QuantType};
use llmserve_kernels::KvElem;
use numpy::{Element, PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::conversion::FromPyObjectOwned;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::kernels::{kv_cache_bits, with_kv_elem, writeable};

fn bad<T>(what: impl std::fmt::Display) -> PyResult<T> {
    Err(PyValueError::new_err(format!("CpuDecoder: {what}")))
}

/// A linear's GGUF blocks, packed (`_core.quant_pack`).
struct Quant {
    data: Py<PyArray2<u8>>,
    ty: QuantType,
    rows: usize,
    cols: usize,
}

struct LayerArrays {
    input_norm: Py<PyArray1<f32>>,
    post_norm: Py<PyArray1<f32>>,
    qkv: Quant,
    qkv_bias: Option<Py<PyArray1<f32>>>,
    q_norm: Option<Py<PyArray1<f32>>>,
    k_norm: Option<Py<PyArray1<f32>>>,
    rope: bool,
    o_proj: Quant,
    o_bias: Option<Py<PyArray1<f32>>>,
    gate_up: Quant,
    down: Quant,
}

/// One layer's arrays borrowed for reading (held while the layers run).
struct Borrowed<'py> {
    vectors: [Option<PyReadonlyArray1<'py, f32>>; 6],
    linears: [PyReadonlyArray2<'py, u8>; 4],
}

fn vector<'py>(py: Python<'py>, a: &Option<Py<PyArray1<f32>>>) -> PyResult<Option<PyReadonlyArray1<'py, f32>>> {
    a.as_ref().map(|a| a.bind(py).try_readonly().map_err(|e| PyValueError::new_err(e.to_string()))).transpose()
}

fn slice<'a>(a: &'a Option<PyReadonlyArray1<'_, f32>>) -> PyResult<Option<&'a [f32]>> {
    a.as_ref().map(|a| a.as_slice().or_else(|_| bad("a norm or bias is not contiguous"))).transpose()
}

impl LayerArrays {
    fn borrow<'py>(&self, py: Python<'py>) -> PyResult<Borrowed<'py>> {
        let own = |a: &Py<PyArray1<f32>>| Some(a.clone_ref(py));
        let vectors = [
            vector(py, &own(&self.input_norm))?,
            vector(py, &own(&self.post_norm))?,
            vector(py, &self.qkv_bias)?,
            vector(py, &self.q_norm)?,
            vector(py, &self.k_norm)?,
            vector(py, &self.o_bias)?,
        ];
        let lin = |q: &Quant| q.data.bind(py).try_readonly().map_err(|e| PyValueError::new_err(e.to_string()));
        Ok(Borrowed { vectors, linears: [lin(&self.qkv)?, lin(&self.o_proj)?, lin(&self.gate_up)?, lin(&self.down)?] })
    }

    fn weights<'a>(&self, b: &'a Borrowed<'_>) -> PyResult<LayerWeights<'a>> {
        let quant = |name: &str, q: &Quant, a: &'a PyReadonlyArray2<'_, u8>| -> PyResult<PackedWeights<'a>> {
            crate::quant::packed_view(a, q.ty, q.rows, q.cols).or_else(|e| bad(format!("{name}: {e}")))
        };
        let [input_norm, post_norm, qkv_bias, q_norm, k_norm, o_bias] = &b.vectors;
        let [qkv, o_proj, gate_up, down] = &b.linears;
        Ok(LayerWeights {
            input_norm: slice(input_norm)?.expect("always present"),
            post_norm: slice(post_norm)?.expect("always present"),
            qkv: quant("qkv", &self.qkv, qkv)?,
            qkv_bias: slice(qkv_bias)?,
            q_norm: slice(q_norm)?,
            k_norm: slice(k_norm)?,
            rope: self.rope,
            o_proj: quant("o_proj", &self.o_proj, o_proj)?,
            o_bias: slice(o_bias)?,
            gate_up: quant("gate_up", &self.gate_up, gate_up)?,
            down: quant("down", &self.down, down)?,
        })
    }
}

fn item<'py, T: FromPyObjectOwned<'py>>(d: &Bound<'py, PyDict>, key: &str) -> PyResult<T> {
    match d.get_item(key)? {
        Some(v) => v.extract().map_err(Into::into),
        None => bad(format!("missing {key:?}")),
    }
}

fn optional<'py, T: FromPyObjectOwned<'py>>(d: &Bound<'py, PyDict>, key: &str) -> PyResult<Option<T>> {
    match d.get_item(key)? {
        Some(v) if !v.is_none() => Ok(Some(v.extract().map_err(Into::into)?)),
        _ => Ok(None),
    }
}

fn quant(d: &Bound<'_, PyDict>, key: &str) -> PyResult<Quant> {
    let (data, ggml, rows, cols): (Py<PyArray2<u8>>, u32, usize, usize) = item(d, key)?;
    let Some(ty) = QuantType::from_ggml(ggml) else {
        return bad(format!("{key}: ggml type {ggml} is not Q4_0 (2), Q4_1 (3) or Q8_0 (8)"));
    };
    Ok(Quant { data, ty, rows, cols })
}

#[pyclass(name = "CpuDecoder", module = "llmserve._core", frozen)]
pub struct PyCpuDecoder {
    /// `block_size` is taken from the caches at each call.
    shape: LayerShape,
    layers: Vec<LayerArrays>,
    final_norm: Option<Py<PyArray1<f32>>>,
    scratch: Mutex<Scratch>,
}

#[pymethods]
impl PyCpuDecoder {
    #[new]
    #[pyo3(signature = (shape, layers, final_norm=None))]
    fn new(
        py: Python<'_>,
        shape: &Bound<'_, PyDict>,
        layers: Vec<Bound<'_, PyDict>>,
        final_norm: Option<Py<PyArray1<f32>>>,
    ) -> PyResult<Self> {
        let shape = LayerShape {
            hidden: item(shape, "hidden")?,
            num_heads: item(shape, "num_heads")?,
            num_kv_heads: item(shape, "num_kv_heads")?,
            head_dim: item(shape, "head_dim")?,
            intermediate: item(shape, "intermediate")?,
            eps: item(shape, "eps")?,
            block_size: 1,
            scale: item(shape, "scale")?,
        };
        let layers = layers
            .iter()
            .map(|d| {
                Ok(LayerArrays {
                    input_norm: item(d, "input_norm")?,
                    post_norm: item(d, "post_norm")?,
                    qkv: quant(d, "qkv")?,
                    qkv_bias: optional(d, "qkv_bias")?,
                    q_norm: optional(d, "q_norm")?,
                    k_norm: optional(d, "k_norm")?,
                    rope: optional(d, "rope")?.unwrap_or(true),
                    o_proj: quant(d, "o_proj")?,
                    o_bias: optional(d, "o_bias")?,
                    gate_up: quant(d, "gate_up")?,
                    down: quant(d, "down")?,
                })
            })
            .collect::<PyResult<Vec<_>>>()?;
        for (i, layer) in layers.iter().enumerate() {
            let borrowed = layer.borrow(py)?;
            layer.weights(&borrowed)?.check(&shape).or_else(|e| bad(format!("layer {i}: {e}")))?;
        }
        if let Some(norm) = &final_norm {
            let norm = vector(py, &Some(norm.clone_ref(py)))?;
            let len = slice(&norm)?.map_or(0, <[f32]>::len);
            if len != shape.hidden {
                return bad(format!("final_norm has {len} values, expected hidden {}", shape.hidden));
            }
        }
        Ok(Self { shape, layers, final_norm, scratch: Mutex::new(Scratch::default()) })
    }

    #[getter]
    fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Runs every layer on h [T, H] in place, then the final norm if the decoder has one, and
    /// writes the tokens' K/V to the caches, which hold `kv_dtype` (as `paged_decode_attention`
    /// takes them).
    #[pyo3(signature = (h, cos, sin, slots, block_tables, seq_lens, k_caches, v_caches, num_threads, kv_dtype="float32"))]
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        py: Python<'_>,
        h: &Bound<'_, PyArray2<f32>>,
        cos: PyReadonlyArray2<'_, f32>,
        sin: PyReadonlyArray2<'_, f32>,
        slots: PyReadonlyArray1<'_, i64>,
        block_tables: PyReadonlyArray2<'_, i32>,
        seq_lens: PyReadonlyArray1<'_, i32>,
        k_caches: Vec<Bound<'_, PyAny>>,
        v_caches: Vec<Bound<'_, PyAny>>,
        num_threads: usize,
        kv_dtype: &str,
    ) -> PyResult<()> {
        with_kv_elem!(kv_dtype, "CpuDecoder.forward", E => self.forward_as::<E>(
            py, h, cos, sin, slots, block_tables, seq_lens, &k_caches, &v_caches, num_threads
        ))
    }
}

impl PyCpuDecoder {
    /// `forward` with the caches' element type `E`.
    #[allow(clippy::too_many_arguments)]
    fn forward_as<'py, E: KvElem>(
        &self,
        py: Python<'py>,
        h: &Bound<'py, PyArray2<f32>>,
        cos: PyReadonlyArray2<'py, f32>,
        sin: PyReadonlyArray2<'py, f32>,
        slots: PyReadonlyArray1<'py, i64>,
        block_tables: PyReadonlyArray2<'py, i32>,
        seq_lens: PyReadonlyArray1<'py, i32>,
        k_caches: &[Bound<'py, PyAny>],
        v_caches: &[Bound<'py, PyAny>],
        num_threads: usize,
    ) -> PyResult<()>
    where
        E::Bits: Element,
    {
        const NAME: &str = "CpuDecoder.forward";
        let typed = |caches: &[Bound<'py, PyAny>], name: &str| {
            caches.iter().map(|c| kv_cache_bits::<E>(c, NAME, name)).collect::<PyResult<Vec<_>>>()
        };
        let (k_caches, v_caches) = (typed(k_caches, "k_caches")?, typed(v_caches, "v_caches")?);
        if k_caches.len() != self.layers.len() || v_caches.len() != self.layers.len() {
            return bad(format!(
                "{} layers, but {} K and {} V caches",
                self.layers.len(),
                k_caches.len(),
                v_caches.len()
            ));
        }
        let cache_shape = k_caches.first().map(|c| c.shape().to_vec()).unwrap_or_default();
        if k_caches.iter().chain(&v_caches).any(|c| c.shape() != cache_shape.as_slice()) {
            return bad("every K and V cache must have the same shape");
        }
        let mut shape = self.shape;
        shape.block_size = cache_shape.get(1).copied().unwrap_or(1);
        let tokens = h.shape()[0];
        if block_tables.shape()[0] != tokens {
            return bad(format!("block_tables has {} rows for {tokens} tokens", block_tables.shape()[0]));
        }
        let mut h = writeable(h, NAME, "h")?;
        let mut ks = k_caches.iter().map(|c| writeable(c, NAME, "k_caches")).collect::<PyResult<Vec<_>>>()?;
        let mut vs = v_caches.iter().map(|c| writeable(c, NAME, "v_caches")).collect::<PyResult<Vec<_>>>()?;
        let borrowed = self.layers.iter().map(|l| l.borrow(py)).collect::<PyResult<Vec<_>>>()?;
        let weights = self.layers.iter().zip(&borrowed).map(|(l, b)| l.weights(b)).collect::<PyResult<Vec<_>>>()?;
        let contiguous = |what: &str| PyValueError::new_err(format!("{NAME}: {what} must be C-contiguous"));
        let h = h.as_slice_mut().map_err(|_| contiguous("h"))?;
        let mut ks = ks
            .iter_mut()
            .map(|c| c.as_slice_mut().map(E::from_bits_mut).map_err(|_| contiguous("k_caches")))
            .collect::<PyResult<Vec<_>>>()?;
        let mut vs = vs
            .iter_mut()
            .map(|c| c.as_slice_mut().map(E::from_bits_mut).map_err(|_| contiguous("v_caches")))
            .collect::<PyResult<Vec<_>>>()?;
        let step = DecodeTokens {
            cos: cos.as_slice().map_err(|_| contiguous("cos"))?,
            sin: sin.as_slice().map_err(|_| contiguous("sin"))?,
            slots: slots.as_slice().map_err(|_| contiguous("slots"))?,
            block_tables: block_tables.as_slice().map_err(|_| contiguous("block_tables"))?,
            seq_lens: seq_lens.as_slice().map_err(|_| contiguous("seq_lens"))?,
        };
        let final_norm = vector(py, &self.final_norm.as_ref().map(|n| n.clone_ref(py)))?;
        let final_norm = slice(&final_norm)?;
        let eps = shape.eps;
        let scratch = &self.scratch;
        py.detach(|| {
            let mut scratch = scratch.lock().unwrap_or_else(|e| e.into_inner());
            // NOTE: the step's arguments and every cache's size are the same for all layers
            // and the weights were checked at construction, so if the first layer's checks
            // pass, no later layer fails: an error leaves h and the caches untouched.
            for (i, w) in weights.iter().enumerate() {
                decoder_layer(h, tokens, w, &shape, &step, &mut *ks[i], &mut *vs[i], &mut scratch, num_threads)
                    .map_err(|e| format!("layer {i}: {e}"))?;
            }
            if let Some(norm) = final_norm {
                rms_norm_rows(h, norm, eps);
            }
            Ok::<(), String>(())
        })
        .or_else(bad)
    }
}
