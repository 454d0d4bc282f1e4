//! `Core` for Python: llmserve_core's engine core, with numpy arrays in and bytes out.

use llmserve_core::{Core, Masks, Output, PromptLogprobs};
use llmserve_scheduler::Plan;
use numpy::{PyReadonlyArray1, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::errors;
use crate::plan::PyPlan;
use crate::router::{PyPrepared, PyRouter};

/// The engine core: owned by the engine thread.
#[pyclass(name = "Core", module = "llmserve._core")]
pub struct PyCore {
    state: Core,
}

/// One step's output as Python sees it: (handle, bytes, finished, error, new_tokens,
/// ends), where `finished` is None or how the request ended ("stop", "length",
/// "tool_calls", "error": its first choice's finish reason) and `ends` each choice's
/// (finish reason, completion tokens) once it ended normally (else empty).
type PyOutput = (u64, Py<PyBytes>, Option<&'static str>, bool, u32, llmserve_core::ChoiceEnds);

fn py_plan(py: Python<'_>, plan: Option<(Plan, Masks)>) -> PyResult<Option<PyPlan>> {
    plan.map(|(plan, masks)| PyPlan::new(py, plan, masks)).transpose()
}

fn outputs(py: Python<'_>, out: Vec<Output>) -> Vec<PyOutput> {
    out.into_iter().map(|(h, b, f, e, n, l)| (h, PyBytes::new(py, &b).unbind(), f, e, n, l)).collect()
}

#[pymethods]
impl PyCore {
    #[new]
    fn new(router: &PyRouter, config_json: &str) -> PyResult<Self> {
        Ok(Self { state: Core::new(router.inner.clone(), config_json).map_err(PyValueError::new_err)? })
    }

    /// Queue a prepared request; returns its handle.
    fn add(&mut self, py: Python<'_>, prepared: &mut PyPrepared) -> PyResult<u64> {
        let p = prepared.inner.take().ok_or_else(|| PyValueError::new_err("this request was already added"))?;
        let state = &mut self.state;
        py.detach(|| state.add(p)).map_err(|e| errors::to_py(py, &e))
    }

    /// Drop a request (client gone): its blocks are freed now. Unknown handles are ignored.
    fn abort(&mut self, handle: u64) -> bool {
        self.state.abort(handle)
    }

    /// The next step's plan, or None when nothing can run. Discards any plan still awaiting
    /// commit.
    fn schedule(&mut self, py: Python<'_>) -> PyResult<Option<PyPlan>> {
        let state = &mut self.state;
        py_plan(py, py.detach(|| state.schedule()))
    }

    /// The plan after the one awaiting commit, made while the model runs that one, or None
    /// when it cannot be made before that plan's tokens are known (commit, then `schedule`).
    /// Its `input_ids` hold `-1 - r` where a sequence's token is the one row `r` of the
    /// awaiting plan samples. Commits answer the plans in order.
    fn schedule_ahead(&mut self, py: Python<'_>) -> PyResult<Option<PyPlan>> {
        let state = &mut self.state;
        py_plan(py, py.detach(|| state.schedule_ahead()))
    }

    /// Apply the oldest awaiting plan's samples (one per plan row) and, when it listed prompt-logprob
    /// entries, their logprobs (`[P]`), top alternatives (`[P, K]`; ids < 0 are padding) and
    /// optionally ranks (`[P]`: 1 + how many tokens were at least as likely).
    /// `pooled` (`[Q, H]`): the final hidden state of each pooling entry the plan listed
    /// (required when it listed any).
    /// Returns, per request touched, `(handle, bytes, finished, error, new_tokens, ends)`.
    #[pyo3(signature = (tokens, logprobs, top_ids, top_logprobs, prompt_logprobs=None, prompt_top_ids=None, prompt_top_logprobs=None, prompt_ranks=None, pooled=None))]
    #[allow(clippy::too_many_arguments)]
    fn commit(
        &mut self,
        py: Python<'_>,
        tokens: PyReadonlyArray1<'_, i64>,
        logprobs: PyReadonlyArray1<'_, f32>,
        top_ids: PyReadonlyArray2<'_, i64>,
        top_logprobs: PyReadonlyArray2<'_, f32>,
        prompt_logprobs: Option<PyReadonlyArray1<'_, f32>>,
        prompt_top_ids: Option<PyReadonlyArray2<'_, i64>>,
        prompt_top_logprobs: Option<PyReadonlyArray2<'_, f32>>,
        prompt_ranks: Option<PyReadonlyArray1<'_, i64>>,
        pooled: Option<PyReadonlyArray2<'_, f32>>,
    ) -> PyResult<Vec<PyOutput>> {
        let pooled = pooled.map(|rows| (rows.as_array().iter().copied().collect::<Vec<f32>>(), rows.shape()[1]));
        let prompt = match (prompt_logprobs, prompt_top_ids, prompt_top_logprobs) {
            (Some(lp), Some(ids), Some(tlp)) => {
                if tlp.shape() != ids.shape() {
                    return Err(PyValueError::new_err(format!(
                        "prompt_top_ids {:?} and prompt_top_logprobs {:?} differ in shape",
                        ids.shape(),
                        tlp.shape()
                    )));
                }
                Some(PromptLogprobs {
                    logprobs: lp.as_array().iter().copied().collect(),
                    top_ids: ids.as_array().iter().copied().collect(),
                    top_lps: tlp.as_array().iter().copied().collect(),
                    k: ids.shape()[1],
                    ranks: prompt_ranks
                        .map(|r| r.as_array().iter().map(|&r| r.clamp(1, i64::from(u32::MAX)) as u32).collect())
                        .unwrap_or_default(),
                })
            }
            (None, None, None) => None,
            _ => {
                return Err(PyValueError::new_err(
                    "prompt_logprobs, prompt_top_ids and prompt_top_logprobs go together",
                ))
            }
        };
        let toks: Vec<u32> = tokens.as_array().iter().map(|&t| t as u32).collect();
        let lps: Vec<f32> = logprobs.as_array().iter().copied().collect();
        let k = top_ids.shape()[1];
        if top_logprobs.shape()[1] != k {
            return Err(PyValueError::new_err("top_ids and top_logprobs differ in width"));
        }
        let tids: Vec<i64> = top_ids.as_array().iter().copied().collect();
        let tlps: Vec<f32> = top_logprobs.as_array().iter().copied().collect();
        let state = &mut self.state;
        let pooled = pooled.as_ref().map(|(rows, width)| (rows.as_slice(), *width));
        let out = py.detach(|| state.commit(&toks, &lps, &tids, &tlps, k, prompt.as_ref(), pooled));
        Ok(outputs(py, out.map_err(PyValueError::new_err)?))
    }

    /// A step failed: end each request the plans awaiting commit touched with a 500 (or an
    /// SSE error frame if its stream had begun), and discard those plans.
    fn fail_plan(&mut self, py: Python<'_>, message: &str) -> Vec<PyOutput> {
        let out = self.state.fail_plan(message);
        outputs(py, out)
    }

    /// Handles of the requests the last plan held for the first time (each handle is listed
    /// by one plan in its life): the engine times how long each waited in the queue.
    fn first_scheduled(&self) -> Vec<u64> {
        self.state.first_scheduled().to_vec()
    }

    fn has_work(&self) -> bool {
        self.state.scheduler().has_work()
    }

    /// Empty the prefix cache; how many blocks it held (`Scheduler::reset_prefix_cache`).
    fn reset_prefix_cache(&mut self) -> usize {
        self.state.reset_prefix_cache()
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.state.scheduler().stats();
        let d = PyDict::new(py);
        let usable = s.num_blocks.saturating_sub(1).max(1);
        d.set_item("running", s.running)?;
        d.set_item("waiting", s.waiting)?;
        d.set_item("num_blocks", s.num_blocks)?;
        d.set_item("used_blocks", s.used_blocks)?;
        d.set_item("cached_blocks", s.cached_blocks)?;
        d.set_item("kv_cache_usage", s.used_blocks as f64 / usable as f64)?;
        d.set_item("prefix_hit_tokens", s.prefix_hit_tokens)?;
        d.set_item("prefix_query_tokens", s.prefix_query_tokens)?;
        d.set_item("preemptions", s.preemptions)?;
        d.set_item("spec_drafts", s.spec_drafts)?;
        d.set_item("spec_draft_tokens", s.spec_draft_tokens)?;
        d.set_item("spec_accepted_tokens", s.spec_accepted_tokens)?;
        d.set_item("spec_accepted_per_pos", s.spec_accepted_per_pos)?;
        d.set_item("requests", self.state.num_requests())?;
        // (vLLM's lora_requests_info: which adapters run and wait; only with adapters)
        let router = self.state.router();
        d.set_item("loras_served", router.lora_count())?;
        if router.has_loras() {
            let (running, waiting) = self.state.scheduler().adapters();
            let names = |ids: &[u32]| -> Vec<String> { ids.iter().filter_map(|&i| router.lora_name(i)).collect() };
            d.set_item("running_loras", names(&running))?;
            d.set_item("waiting_loras", names(&waiting))?;
            // (the adapters a request still holds: an unloaded one's weights go when none does)
            let in_use: std::collections::BTreeSet<u32> = running.into_iter().chain(waiting).collect();
            d.set_item("loras_in_use", in_use.into_iter().collect::<Vec<_>>())?;
        }
        Ok(d)
    }
}
