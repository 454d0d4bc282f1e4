//! `Plan`: one step's flat columns handed to the model runner as numpy arrays.
//!
//! The vectors move into numpy without a copy (`PyArray1::from_vec`); nothing crosses per
//! token. Column names and meanings are the table in ARCHITECTURE.md, plus two columns of
//! grammar-constrained decoding that the scheduler never sees (Core computes them):
//! `mask_rows` i64 [Rm], the sampling rows that are constrained, and `token_bitmask`
//! i32 [Rm, ceil(V/32)], each row's allowed tokens packed 32 to a word (bit t % 32 of word
//! t / 32; V = the tokenizer's vocabulary, logits beyond it are never allowed).

use llmserve_core::Masks;
use llmserve_scheduler::Plan;
use numpy::{PyArray1, PyArrayMethods};
use pyo3::prelude::*;

#[pyclass(name = "Plan", module = "llmserve._core", frozen)]
pub struct PyPlan {
    #[pyo3(get)]
    num_tokens: usize,
    #[pyo3(get)]
    num_seqs: usize,
    #[pyo3(get)]
    num_rows: usize,
    #[pyo3(get)]
    block_table_width: usize,
    #[pyo3(get)]
    input_ids: Py<PyAny>,
    #[pyo3(get)]
    positions: Py<PyAny>,
    #[pyo3(get)]
    query_start_loc: Py<PyAny>,
    #[pyo3(get)]
    seq_lens: Py<PyAny>,
    /// `[S]` u32: the LoRA adapter each sequence's tokens run through (0: none).
    #[pyo3(get)]
    lora_ids: Py<PyAny>,
    /// `[S]` i32: how many of each sequence's tokens are its prompt's.
    #[pyo3(get)]
    prompt_lens: Py<PyAny>,
    #[pyo3(get)]
    block_tables: Py<PyAny>,
    #[pyo3(get)]
    slot_mapping: Py<PyAny>,
    #[pyo3(get)]
    copy_src: Py<PyAny>,
    #[pyo3(get)]
    copy_dst: Py<PyAny>,
    #[pyo3(get)]
    logits_indices: Py<PyAny>,
    #[pyo3(get)]
    temperature: Py<PyAny>,
    #[pyo3(get)]
    top_p: Py<PyAny>,
    #[pyo3(get)]
    top_k: Py<PyAny>,
    #[pyo3(get)]
    min_p: Py<PyAny>,
    #[pyo3(get)]
    presence_penalty: Py<PyAny>,
    #[pyo3(get)]
    frequency_penalty: Py<PyAny>,
    #[pyo3(get)]
    repetition_penalty: Py<PyAny>,
    #[pyo3(get)]
    seeds: Py<PyAny>,
    #[pyo3(get)]
    gen_index: Py<PyAny>,
    #[pyo3(get)]
    num_logprobs: Py<PyAny>,
    #[pyo3(get)]
    bias_offsets: Py<PyAny>,
    #[pyo3(get)]
    bias_token_ids: Py<PyAny>,
    #[pyo3(get)]
    bias_values: Py<PyAny>,
    #[pyo3(get)]
    hist_offsets: Py<PyAny>,
    #[pyo3(get)]
    hist_tokens: Py<PyAny>,
    #[pyo3(get)]
    hist_prompt_lens: Py<PyAny>,
    #[pyo3(get)]
    row_req_ids: Py<PyAny>,
    #[pyo3(get)]
    row_seq_index: Py<PyAny>,
    #[pyo3(get)]
    prompt_lp_indices: Py<PyAny>,
    #[pyo3(get)]
    prompt_lp_targets: Py<PyAny>,
    #[pyo3(get)]
    prompt_lp_num: Py<PyAny>,
    #[pyo3(get)]
    pool_indices: Py<PyAny>,
    #[pyo3(get)]
    mask_rows: Py<PyAny>,
    #[pyo3(get)]
    token_bitmask: Py<PyAny>,
}

fn arr<T: numpy::Element>(py: Python<'_>, v: Vec<T>) -> Py<PyAny> {
    PyArray1::from_vec(py, v).into_any().unbind()
}

impl PyPlan {
    pub fn new(py: Python<'_>, p: Plan, masks: Masks) -> PyResult<Self> {
        let (s, w) = (p.num_seqs, p.block_table_width);
        let token_bitmask =
            PyArray1::from_vec(py, masks.bits).reshape([masks.rows.len(), masks.width])?.into_any().unbind();
        let block_tables = PyArray1::from_vec(py, p.block_tables).reshape([s, w])?.into_any().unbind();
        Ok(Self {
            num_tokens: p.num_tokens,
            num_seqs: p.num_seqs,
            num_rows: p.num_rows,
            block_table_width: w,
            input_ids: arr(py, p.input_ids),
            positions: arr(py, p.positions),
            query_start_loc: arr(py, p.query_start_loc),
            seq_lens: arr(py, p.seq_lens),
            lora_ids: arr(py, p.lora_ids),
            prompt_lens: arr(py, p.prompt_lens),
            block_tables,
            slot_mapping: arr(py, p.slot_mapping),
            copy_src: arr(py, p.copy_src),
            copy_dst: arr(py, p.copy_dst),
            logits_indices: arr(py, p.logits_indices),
            temperature: arr(py, p.temperature),
            top_p: arr(py, p.top_p),
            top_k: arr(py, p.top_k),
            min_p: arr(py, p.min_p),
            presence_penalty: arr(py, p.presence_penalty),
            frequency_penalty: arr(py, p.frequency_penalty),
            repetition_penalty: arr(py, p.repetition_penalty),
            seeds: arr(py, p.seeds),
            gen_index: arr(py, p.gen_index),
            num_logprobs: arr(py, p.num_logprobs),
            bias_offsets: arr(py, p.bias_offsets),
            bias_token_ids: arr(py, p.bias_token_ids),
            bias_values: arr(py, p.bias_values),
            hist_offsets: arr(py, p.hist_offsets),
            hist_tokens: arr(py, p.hist_tokens),
            hist_prompt_lens: arr(py, p.hist_prompt_lens),
            row_req_ids: arr(py, p.row_req_ids),
            row_seq_index: arr(py, p.row_seq_index),
            prompt_lp_indices: arr(py, p.prompt_lp_indices),
            prompt_lp_targets: arr(py, p.prompt_lp_targets),
            prompt_lp_num: arr(py, p.prompt_lp_num),
            pool_indices: arr(py, p.pool_indices),
            mask_rows: arr(py, masks.rows),
            token_bitmask,
        })
    }
}
