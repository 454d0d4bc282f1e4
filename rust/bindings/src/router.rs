//! `Router` and `Prepared`: the protocol side as Python sees it.

use std::collections::HashMap;
use std::sync::Arc;

use llmserve_router::protocol::{Endpoint, Prepared};
use llmserve_router::router::{LoraAdapter, Router, RouterConfig};
use llmserve_router::template::{TemplateSet, TemplateSources};
use llmserve_router::tokenizer::{GgufVocab, Tokenizer};
use llmserve_router::ApiError;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors;

fn endpoint(name: &str) -> PyResult<Endpoint> {
    Endpoint::from_name(name).ok_or_else(|| PyValueError::new_err(format!("unknown endpoint {name:?}")))
}

fn config_err(what: &str, e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(format!("{what}: {e}"))
}

/// Response headers as (name, value) pairs.
type Headers = Vec<(String, String)>;

/// The OpenAI protocol: validation, templates, tokenization, response bodies.
#[pyclass(name = "Router", module = "llmserve._core", frozen)]
pub struct PyRouter {
    pub inner: Arc<Router>,
}

#[pymethods]
impl PyRouter {
    /// Exactly one of `tokenizer_json` (a path) and `gguf_vocab_json` (GgufVocab as JSON)
    /// names the tokenizer. `template_sources_json` and `config_json` are the JSON forms of
    /// `TemplateSources` and `RouterConfig`.
    #[new]
    #[pyo3(signature = (tokenizer_json, gguf_vocab_json, template_sources_json, config_json))]
    fn new(
        py: Python<'_>,
        tokenizer_json: Option<String>,
        gguf_vocab_json: Option<String>,
        template_sources_json: &str,
        config_json: &str,
    ) -> PyResult<Self> {
        let config: RouterConfig = serde_json::from_str(config_json).map_err(|e| config_err("router config", e))?;
        let sources: TemplateSources =
            serde_json::from_str(template_sources_json).map_err(|e| config_err("template sources", e))?;
        let router = py.detach(move || -> Result<Router, String> {
            let tokenizer = match (tokenizer_json, gguf_vocab_json) {
                (Some(path), None) => Tokenizer::from_file(std::path::Path::new(&path))?,
                (None, Some(vocab)) => {
                    let vocab: GgufVocab = serde_json::from_str(&vocab).map_err(|e| e.to_string())?;
                    Tokenizer::from_gguf(&vocab)?
                }
                _ => return Err("give exactly one of tokenizer_json and gguf_vocab_json".into()),
            };
            let templates = TemplateSet::resolve(sources)?;
            Ok(Router::new(tokenizer, templates, config))
        });
        Ok(Self { inner: Arc::new(router.map_err(|e| config_err("tokenizer or chat template", e))?) })
    }

    /// Validate, render and tokenize a chat or completion request. `request_id` (the
    /// `X-Request-Id` header) names it when the body's `request_id` does not.
    #[pyo3(signature = (endpoint_name, body, request_id = None))]
    fn prepare(
        &self,
        py: Python<'_>,
        endpoint_name: &str,
        body: &[u8],
        request_id: Option<String>,
    ) -> PyResult<PyPrepared> {
        let ep = endpoint(endpoint_name)?;
        let router = self.inner.clone();
        let body = body.to_vec();
        match py.detach(move || router.prepare_as(ep, &body, request_id.as_deref())) {
            Ok(p) => Ok(PyPrepared { inner: Some(p) }),
            Err(e) => Err(errors::to_py(py, &e)),
        }
    }

    /// Answer tokenize, detokenize and the render routes: (the JSON response body, its
    /// response headers).
    fn handle<'py>(
        &self,
        py: Python<'py>,
        endpoint_name: &str,
        body: &[u8],
    ) -> PyResult<(Bound<'py, PyBytes>, Headers)> {
        let ep = endpoint(endpoint_name)?;
        let router = self.inner.clone();
        let body = body.to_vec();
        match py.detach(move || router.handle(ep, &body)) {
            Ok(out) => Ok((PyBytes::new(py, &out.body), out.headers)),
            Err(e) => Err(errors::to_py(py, &e)),
        }
    }

    /// `GET /v1/models` body.
    fn models<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.models())
    }

    /// `GET /v1/models/{id}` body.
    fn model<'py>(&self, py: Python<'py>, id: &str) -> PyResult<Bound<'py, PyBytes>> {
        self.inner.model(id).map(|b| PyBytes::new(py, &b)).map_err(|e| errors::to_py(py, &e))
    }

    /// `GET /v1/responses/{id}`: the stored response, or a 404 ApiError.
    fn stored_response<'py>(&self, py: Python<'py>, id: &str) -> PyResult<Bound<'py, PyBytes>> {
        self.inner.responses().body(id).map(|b| PyBytes::new(py, &b)).map_err(|e| errors::to_py(py, &e))
    }

    /// `POST /v1/responses/{id}/cancel`: a running background response is marked `cancelled`
    /// (stopping its generation is the caller's part); its body, or a 404 or 400 ApiError.
    fn cancel_response<'py>(&self, py: Python<'py>, id: &str) -> PyResult<Bound<'py, PyBytes>> {
        self.inner.responses().cancel(id).map(|b| PyBytes::new(py, &b)).map_err(|e| errors::to_py(py, &e))
    }

    /// Whether the response `id` is stored and ran in the background (running or ended).
    fn background_response(&self, id: &str) -> bool {
        self.inner.responses().get(id).is_ok_and(|s| s.background())
    }

    /// `DELETE /v1/responses/{id}`: forgets it; its body, or a 404 ApiError.
    fn delete_response<'py>(&self, py: Python<'py>, id: &str) -> PyResult<Bound<'py, PyBytes>> {
        self.inner.responses().delete(id).map(|b| PyBytes::new(py, &b)).map_err(|e| errors::to_py(py, &e))
    }

    /// `GET /v1/responses/{id}` (the response as stored) or, with `items`, `GET
    /// /v1/responses/{id}/input_items` (a page of the conversation it answered), with the
    /// query's pairs. Returns (body, headers), or raises ApiError (404 for an unknown id).
    fn read_response<'py>(
        &self,
        py: Python<'py>,
        id: &str,
        items: bool,
        query: Vec<(String, String)>,
    ) -> PyResult<(Bound<'py, PyBytes>, Headers)> {
        match self.inner.stored_response_route(id, items, &query) {
            Ok(out) => Ok((PyBytes::new(py, &out.body), out.headers)),
            Err(e) => Err(errors::to_py(py, &e)),
        }
    }

    /// A `/v1/conversations` route: `method` on the conversation `conversation_id` (None: the
    /// collection), its items (`items`), or one of them (`item_id`); `query` as the URL's pairs.
    /// Returns (body, headers), or raises ApiError.
    #[allow(clippy::too_many_arguments)]
    fn conversations<'py>(
        &self,
        py: Python<'py>,
        method: &str,
        conversation_id: Option<&str>,
        item_id: Option<&str>,
        items: bool,
        query: Vec<(String, String)>,
        body: &[u8],
    ) -> PyResult<(Bound<'py, PyBytes>, Headers)> {
        use llmserve_router::protocol::conversations::Target;
        let target = match (conversation_id, item_id, items) {
            (None, _, _) => Target::All,
            (Some(c), Some(i), _) => Target::Item(c, i),
            (Some(c), None, true) => Target::Items(c),
            (Some(c), None, false) => Target::One(c),
        };
        let router = self.inner.clone();
        let (method, target) = (method.to_string(), target);
        match py.detach(|| router.conversation_route(&method, target, &query, body)) {
            Ok(out) => Ok((PyBytes::new(py, &out.body), out.headers)),
            Err(e) => Err(errors::to_py(py, &e)),
        }
    }

    /// A stored-chat-completions route: `method` on the collection (`completion_id` None), one
    /// completion, or its `messages`; `query` as the URL's pairs. Returns (body, headers), or
    /// raises ApiError.
    fn stored_chat<'py>(
        &self,
        py: Python<'py>,
        method: &str,
        completion_id: Option<&str>,
        messages: bool,
        query: Vec<(String, String)>,
        body: &[u8],
    ) -> PyResult<(Bound<'py, PyBytes>, Headers)> {
        use llmserve_router::protocol::stored_chat::Target;
        let target = match (completion_id, messages) {
            (None, _) => Target::All,
            (Some(id), true) => Target::Messages(id),
            (Some(id), false) => Target::One(id),
        };
        let router = self.inner.clone();
        let method = method.to_string();
        match py.detach(|| router.stored_chat_route(&method, target, &query, body)) {
            Ok(out) => Ok((PyBytes::new(py, &out.body), out.headers)),
            Err(e) => Err(errors::to_py(py, &e)),
        }
    }

    /// `POST /v1/load_lora_adapter`'s body, checked: (name, path, load_inplace, headers), or
    /// raises ApiError (also for a loaded name without `load_inplace`).
    fn check_lora_load(&self, py: Python<'_>, body: &[u8]) -> PyResult<(String, String, bool, Headers)> {
        let load = self.inner.check_lora_load(body).map_err(|e| errors::to_py(py, &e))?;
        Ok((load.name, load.path, load.inplace, load.headers))
    }

    /// A fresh LoRA index to install an adapter's weights under, before `publish_lora`.
    fn reserve_lora(&self) -> u32 {
        self.inner.reserve_lora()
    }

    /// Serves the adapter installed under `index` by `name`; with `replace`, in place of a
    /// loaded adapter of that name, whose index is returned. Raises ApiError for a name taken.
    #[pyo3(signature = (index, name, path, system_fingerprint = None, replace = false))]
    fn publish_lora(
        &self,
        py: Python<'_>,
        index: u32,
        name: String,
        path: String,
        system_fingerprint: Option<String>,
        replace: bool,
    ) -> PyResult<Option<u32>> {
        let adapter = LoraAdapter { name, path, parent: None, system_fingerprint };
        self.inner.publish_lora(index, adapter, replace).map_err(|e| errors::to_py(py, &e))
    }

    /// `POST /v1/unload_lora_adapter`: stops serving the adapter the body names; (its index,
    /// its name, headers), or raises ApiError (404 when none of that name is loaded).
    fn unload_lora(&self, py: Python<'_>, body: &[u8]) -> PyResult<(u32, String, Headers)> {
        self.inner.unload_lora(body).map_err(|e| errors::to_py(py, &e))
    }

    /// Drops an unloaded adapter once the engine has freed its weights.
    fn forget_lora(&self, index: u32) {
        self.inner.forget_lora(index)
    }

    /// The names of the LoRA adapters served now, in load order.
    fn lora_names(&self) -> Vec<String> {
        self.inner.lora_adapters().into_iter().map(|a| a.name).collect()
    }

    /// (origin, hash) of the template chat requests use, or None.
    fn template_info(&self) -> Option<(String, String)> {
        self.inner.templates().select(false).map(|t| (t.origin().to_string(), t.hash().to_string()))
    }

    /// The names of the model's chat templates ("default", "tool_use", ...; empty: none).
    fn template_names(&self) -> Vec<String> {
        self.inner.templates().names().into_iter().map(String::from).collect()
    }

    /// The `--default-chat-template-kwargs` keys no chat template reads; ValueError for one
    /// that names a request field (`messages`, `tools`, ...).
    fn unread_default_kwargs(&self) -> PyResult<Vec<String>> {
        self.inner.unread_default_kwargs().map_err(PyValueError::new_err)
    }

    /// (tool-call format or None, reasoning parser) chat output is read with.
    fn output_parsing(&self) -> (Option<&'static str>, &'static str) {
        let (tools, reasoning) = self.inner.output_parsing();
        (tools.map(|t| t.name()), reasoning.name())
    }

    /// The fill-in-the-middle tokens completions' `suffix` is laid out with, as text (prefix,
    /// suffix, middle), or None.
    fn fim_tokens(&self) -> Option<(String, String, String)> {
        let tok = self.inner.tokenizer();
        let text = |id: u32| tok.id_to_token(id).unwrap_or_default();
        self.inner.fim().map(|f| (text(f.prefix), text(f.suffix), text(f.middle)))
    }

    #[getter]
    fn vocab_size(&self) -> usize {
        self.inner.tokenizer().vocab_size()
    }

    /// Without the added tokens (transformers' `vocab_size`; `vocab_size` counts them).
    #[getter]
    fn base_vocab_size(&self) -> usize {
        self.inner.tokenizer().base_vocab_size()
    }

    /// Every raw vocabulary piece and its id, the added tokens included.
    fn vocab(&self) -> HashMap<String, u32> {
        self.inner.tokenizer().vocab()
    }

    /// The id of a raw vocabulary piece ("Ġthe", "<|im_end|>"), or None.
    fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.tokenizer().token_to_id(token)
    }

    /// The raw vocabulary piece of `id`, or None outside the vocabulary.
    fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.tokenizer().id_to_token(id)
    }

    /// Whether `id` is one of the tokenizer's special tokens.
    fn is_special(&self, id: u32) -> bool {
        self.inner.tokenizer().is_special(id)
    }

    #[getter]
    fn max_model_len(&self) -> u32 {
        self.inner.config().max_model_len
    }

    #[getter]
    fn served_model_names(&self) -> Vec<String> {
        self.inner.config().served_model_names.clone()
    }

    /// The endpoint (a name `prepare` and `handle` take) an `/invocations` body is a request
    /// of, by its keys; raises ApiError for a JSON object of none of them.
    #[staticmethod]
    fn invocation_endpoint(py: Python<'_>, body: &[u8]) -> PyResult<&'static str> {
        llmserve_router::protocol::invocation_endpoint(body).map(|e| e.name()).map_err(|e| errors::to_py(py, &e))
    }

    /// Where a stored response's events are replayed from (`GET /v1/responses/{id}`): None
    /// when `query` does not ask to stream, else the sequence number they start after (-1:
    /// all); raises ApiError for a bad `stream` or `starting_after`.
    #[staticmethod]
    fn replay_start(py: Python<'_>, query: Vec<(String, String)>) -> PyResult<Option<i64>> {
        llmserve_router::protocol::responses::replay_start(&query).map_err(|e| errors::to_py(py, &e))
    }

    /// An `ApiError` exception of a named kind (`unavailable`, `internal`, `unauthorized`,
    /// `not_found`, `model_not_found`, `payload_too_large`, `request_timeout` (`limit` is its
    /// seconds), `invalid_request`, `unsupported_parameter`, `unsupported_media_type`), with
    /// its body built here like every other error.
    #[staticmethod]
    #[pyo3(signature = (kind, message = String::new(), param = None, retry_after = None, limit = None))]
    fn error(
        py: Python<'_>,
        kind: &str,
        message: String,
        param: Option<String>,
        retry_after: Option<u32>,
        limit: Option<usize>,
    ) -> PyResult<Py<PyAny>> {
        let e: ApiError = errors::from_kind(kind, message, param, retry_after, limit)
            .ok_or_else(|| PyValueError::new_err(format!("unknown error kind {kind:?}")))?;
        Ok(errors::to_py(py, &e).into_value(py).into_any())
    }
}

/// A validated request, consumed by `Core.add`.
#[pyclass(name = "Prepared", module = "llmserve._core")]
pub struct PyPrepared {
    pub inner: Option<Prepared>,
}

impl PyPrepared {
    fn get(&self) -> PyResult<&Prepared> {
        self.inner.as_ref().ok_or_else(|| PyValueError::new_err("this request was already added to the engine"))
    }
}

#[pymethods]
impl PyPrepared {
    #[getter]
    fn id(&self) -> PyResult<String> {
        Ok(self.get()?.id.clone())
    }
    /// Whether the client asked to stream (a background response's bytes are its events
    /// either way: see `background`).
    #[getter]
    fn stream(&self) -> PyResult<bool> {
        Ok(self.get()?.stream)
    }
    /// A Responses request with `background: true`: it runs whether or not anyone reads it.
    #[getter]
    fn background(&self) -> PyResult<bool> {
        Ok(self.get()?.background())
    }
    #[getter]
    fn model(&self) -> PyResult<String> {
        Ok(self.get()?.model.clone())
    }
    #[getter]
    fn user(&self) -> PyResult<Option<String>> {
        Ok(self.get()?.user.clone())
    }
    #[getter]
    fn priority(&self) -> PyResult<i32> {
        Ok(self.get()?.priority)
    }
    /// The LoRA adapter index the request runs through (0: the base model).
    #[getter]
    fn lora(&self) -> PyResult<u32> {
        Ok(self.get()?.lora)
    }
    /// Response headers the request earned (`llmserve-ignored-fields`, `llmserve-chat-template`).
    #[getter]
    fn headers(&self) -> PyResult<Vec<(String, String)>> {
        Ok(self.get()?.headers.clone())
    }
    /// Prompt tokens over every prompt of the request.
    #[getter]
    fn prompt_tokens(&self) -> PyResult<usize> {
        Ok(self.get()?.prompts.iter().map(Vec::len).sum())
    }
    /// The request's fields that had no effect, every one of them (the header lists at most
    /// 4 KiB of them, escaped to printable ASCII).
    #[getter]
    fn ignored_fields(&self) -> PyResult<Vec<String>> {
        Ok(self.get()?.ignored.clone())
    }
    /// Each prompt's token count (what the metrics need, without copying the ids).
    #[getter]
    fn prompt_lens(&self) -> PyResult<Vec<usize>> {
        Ok(self.get()?.prompts.iter().map(Vec::len).collect())
    }
    #[getter]
    fn prompt_token_ids(&self) -> PyResult<Vec<Vec<u32>>> {
        Ok(self.get()?.prompts.clone())
    }
    /// Sequences run per prompt (`n`, or completions' `best_of` above it).
    #[getter]
    fn n(&self) -> PyResult<u32> {
        Ok(self.get()?.params.n)
    }
    /// Choices returned per prompt (the request's `n`: fewer than run under `best_of`).
    #[getter]
    fn returned_n(&self) -> PyResult<u32> {
        let p = self.get()?;
        Ok(p.best_of.map_or(p.params.n, |b| b.n))
    }
    /// The sequences it queues: one per prompt and distinct choice (greedy choices run once).
    #[getter]
    fn num_seqs(&self) -> PyResult<usize> {
        Ok(self.get()?.num_seqs())
    }
    /// Raises ApiError (400) when its sequences could never all be admitted together: more
    /// than `running` (--max-num-seqs) and `waiting` (--max-waiting) hold.
    fn check_fits(&self, py: Python<'_>, running: usize, waiting: usize) -> PyResult<()> {
        self.get()?.check_fits(running, waiting).map_err(|e| errors::to_py(py, &e))
    }
    /// The most tokens a choice may generate, as resolved (None: the rest of the context).
    #[getter]
    fn max_tokens(&self) -> PyResult<Option<u32>> {
        Ok(self.get()?.params.max_tokens)
    }

    /// What the request asks for, one line per prompt (`--enable-log-requests`): its id (with
    /// the prompt's index when there are several), prompt text, resolved sampling parameters,
    /// prompt token ids and model; `max_len` bounds the text's characters and the ids' count.
    #[pyo3(signature = (max_len=None))]
    fn log_lines(&self, max_len: Option<usize>) -> PyResult<Vec<String>> {
        let p = self.get()?;
        let several = p.prompts.len() > 1;
        let cap = max_len.unwrap_or(usize::MAX);
        Ok(p.prompts
            .iter()
            .enumerate()
            .map(|(i, ids)| {
                let id = if several { format!("{}-{i}", p.id) } else { p.id.clone() };
                let text: String = p.prompt_texts.get(i).map_or("", String::as_str).chars().take(cap).collect();
                let ids = &ids[..ids.len().min(cap)];
                format!(
                    "Received request {id}: prompt: {text:?}, params: {:?}, prompt_token_ids: {ids:?}, model: {:?}",
                    p.params, p.model
                )
            })
            .collect())
    }
}
