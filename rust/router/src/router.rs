//! [`Router`]: the protocol layer's one entry point. It owns the tokenizer, the chat
//! templates and the serving configuration, and speaks four verbs: `prepare` a generation
//! request, `handle` the routes answered at once (tokenize, detokenize, render), and list
//! the `models`. It is `Send + Sync`; every method takes `&self`.

use std::sync::{Arc, RwLock, RwLockReadGuard};

use serde::Deserialize;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::lora::LoraTable;
use crate::protocol::{
    chat, common::unix_now, completion, embeddings, generate, messages, responses, score, tokenize, Endpoint, Handled,
    Prepared,
};
use crate::template::TemplateSet;
use crate::tokenizer::Tokenizer;

/// generation_config.json, applied between the request and OpenAI's defaults.
#[derive(Deserialize, Debug, Clone, Default, PartialEq)]
pub struct GenerationDefaults {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i32>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub max_tokens: Option<u32>,
}

/// `--responses-store-mib`'s default: 64 MiB of stored responses.
fn default_responses_store_bytes() -> usize {
    64 << 20
}

fn default_max_logprobs() -> u32 {
    20
}

/// Enough for long conversations through large templates; stops a runaway template.
fn default_template_fuel() -> u64 {
    50_000_000
}

#[derive(Deserialize, Debug, Clone, PartialEq)]
pub struct RouterConfig {
    /// Every alias the model answers to; the first is its root name.
    pub served_model_names: Vec<String>,
    pub max_model_len: u32,
    /// Unknown and inert fields are a 400 instead of a header.
    #[serde(default)]
    pub strict_fields: bool,
    /// vLLM's `--enable-force-include-usage`: every stream ends with its usage chunk.
    #[serde(default)]
    pub force_include_usage: bool,
    /// vLLM's `--return-tokens-as-token-ids`: the default of the request field of that name.
    #[serde(default)]
    pub return_tokens_as_token_ids: bool,
    /// Every special token a chat template sees by name, as transformers passes its
    /// `special_tokens_map`: `bos_token`, `eos_token`, `unk_token`, `pad_token`, a model's own
    /// such as `image_token`.
    #[serde(default)]
    pub special_tokens: std::collections::BTreeMap<String, String>,
    #[serde(default)]
    pub eos_token_ids: Vec<u32>,
    #[serde(default)]
    pub generation_defaults: GenerationDefaults,
    #[serde(default = "default_max_logprobs")]
    pub max_logprobs: u32,
    #[serde(default = "default_template_fuel")]
    pub template_fuel: u64,
    /// `--tool-call-format`: "json", "hermes", "llama3_json", "mistral" or "qwen3_xml" (alias "qwen3_coder"); None
    /// detects it from the chat template.
    #[serde(default)]
    pub tool_call_format: Option<crate::tools::ToolCallFormat>,
    /// Overrides the detected message-content format of the template (`--chat-template-content-format`).
    #[serde(default)]
    pub chat_template_content_format: Option<crate::content_format::ContentFormat>,
    /// `--reasoning-parser`: "think" or "none"; None detects it from the chat template.
    #[serde(default)]
    pub reasoning_parser: Option<crate::reasoning::ReasoningParser>,
    /// `--parse-special-tokens-in-messages`: a special token's text in a chat message (as
    /// `<|im_end|>`) is that token, as transformers and vLLM tokenize it; by default it is
    /// text, as OpenAI reads message content (a message cannot end its turn or open another).
    #[serde(default)]
    pub parse_special_tokens_in_messages: bool,
    /// `--default-chat-template-kwargs` (vLLM's): what every chat render gets, under the
    /// request's own `chat_template_kwargs` (whose keys win).
    #[serde(default)]
    pub default_chat_template_kwargs: serde_json::Map<String, serde_json::Value>,
    /// OpenAI's `system_fingerprint`: names what the output depends on besides the request
    /// (build, weights, device, numerics), so a client can tell why a seed's output moved.
    /// None: sent as null.
    #[serde(default)]
    pub system_fingerprint: Option<String>,
    /// The model as loaded (its path or hub id): `/v1/models`' `root`. None: the first
    /// served name.
    #[serde(default)]
    pub model_root: Option<String>,
    /// Bytes of `/v1/responses` answers kept for `previous_response_id` and
    /// `GET /v1/responses/{id}` (oldest forgotten first); 0 keeps none.
    #[serde(default = "default_responses_store_bytes")]
    pub responses_store_bytes: usize,
    /// How `/v1/embeddings` pools the model's hidden states; None: the route refuses.
    #[serde(default)]
    pub embeddings: Option<embeddings::EmbeddingConfig>,
    /// `--fim`: completions' `suffix` is served when the vocabulary has a FIM token set
    /// ([`crate::fim`]); false refuses it.
    #[serde(default = "default_true")]
    pub fim: bool,
    /// `--lora-modules`: the LoRA adapters served beside the base model, each under its own
    /// name (a request's `model`); adapter i runs as index i + 1 in the scheduler's plans.
    /// The router moves them into its [`LoraTable`](crate::lora::LoraTable), which runtime
    /// loading changes: read them with [`Router::lora_adapters`].
    #[serde(default)]
    pub lora_adapters: Vec<LoraAdapter>,
}

/// One served LoRA adapter: its model name and where it was loaded from (`/v1/models`'
/// `root`; its `parent` is `parent` when given, vLLM's `base_model_name`, else the base
/// model's root name).
#[derive(Deserialize, Debug, Clone, PartialEq)]
pub struct LoraAdapter {
    pub name: String,
    pub path: String,
    #[serde(default)]
    pub parent: Option<String>,
    /// Its requests' `system_fingerprint` (the base model's, and the adapter's weights); None:
    /// the base model's.
    #[serde(default)]
    pub system_fingerprint: Option<String>,
}

fn default_true() -> bool {
    true
}

pub struct Router {
    pub(crate) tokenizer: Arc<Tokenizer>,
    /// The special tokens' texts, read as text in chat messages (None: parsed as the tokens,
    /// `--parse-special-tokens-in-messages`).
    pub(crate) special_texts: Option<aho_corasick::AhoCorasick>,
    pub(crate) templates: TemplateSet,
    pub(crate) config: RouterConfig,
    /// Compiled grammars (response_format, forced tool calls), cached by source hash.
    pub(crate) grammars: crate::structured::Grammars,
    /// Stored `/v1/responses` answers.
    pub(crate) responses: Arc<crate::response_store::ResponseStore>,
    /// `/v1/conversations`, within the same bound as the stored responses (counted apart).
    conversations: Arc<crate::conversation_store::ConversationStore>,
    /// Chat completions kept by `store: true`, within the same bound (counted apart).
    chat_store: Arc<crate::chat_store::ChatStore>,
    /// `created` of the model objects: when this router started serving.
    created: u64,
    /// The vocabulary's fill-in-the-middle tokens (None: none, or `--no-fim`).
    pub(crate) fim: Option<crate::fim::Fim>,
    /// The LoRA adapters served, and those unloaded whose requests still run.
    loras: RwLock<LoraTable>,
}

impl Router {
    pub fn new(tokenizer: Tokenizer, templates: TemplateSet, mut config: RouterConfig) -> Self {
        let loras = RwLock::new(LoraTable::new(std::mem::take(&mut config.lora_adapters)));
        let tokenizer = Arc::new(tokenizer);
        let grammars = crate::structured::Grammars::new(tokenizer.clone(), config.eos_token_ids.clone());
        let responses = Arc::new(crate::response_store::ResponseStore::new(config.responses_store_bytes));
        let conversations = Arc::new(crate::conversation_store::ConversationStore::new(config.responses_store_bytes));
        let chat_store = Arc::new(crate::chat_store::ChatStore::new(config.responses_store_bytes));
        let fim = config.fim.then(|| crate::fim::Fim::detect(&tokenizer)).flatten();
        let specials = tokenizer.special_texts();
        let special_texts = (!config.parse_special_tokens_in_messages && !specials.is_empty()).then(|| {
            aho_corasick::AhoCorasick::builder()
                .match_kind(aho_corasick::MatchKind::LeftmostLongest)
                .build(&specials)
                .expect("a few hundred token texts build an automaton")
        });
        Self {
            special_texts,
            tokenizer,
            templates,
            config,
            grammars,
            responses,
            conversations,
            chat_store,
            created: unix_now(),
            fim,
            loras,
        }
    }

    /// The stored `/v1/responses` answers.
    pub fn responses(&self) -> &Arc<crate::response_store::ResponseStore> {
        &self.responses
    }

    /// The conversations (`/v1/conversations`).
    pub fn conversations(&self) -> &Arc<crate::conversation_store::ConversationStore> {
        &self.conversations
    }

    /// The chat completions kept by `store: true`.
    pub fn chat_store(&self) -> &Arc<crate::chat_store::ChatStore> {
        &self.chat_store
    }

    /// A stored-chat-completions route (`GET /v1/chat/completions`, ...): `method` on `target`,
    /// with the query's pairs and the body.
    pub fn stored_chat_route(
        &self,
        method: &str,
        target: crate::protocol::stored_chat::Target<'_>,
        query: &[(String, String)],
        body: &[u8],
    ) -> Result<crate::protocol::Handled, ApiError> {
        crate::protocol::stored_chat::handle(self, method, target, query, body)
    }

    /// `GET /v1/responses/{id}` or, with `items`, `GET /v1/responses/{id}/input_items`.
    pub fn stored_response_route(
        &self,
        id: &str,
        items: bool,
        query: &[(String, String)],
    ) -> Result<crate::protocol::Handled, ApiError> {
        crate::protocol::responses::read_stored(self, id, items, query)
    }

    /// A `/v1/conversations` route: `method` on `target`, with the query's pairs and the body.
    pub fn conversation_route(
        &self,
        method: &str,
        target: crate::protocol::conversations::Target<'_>,
        query: &[(String, String)],
        body: &[u8],
    ) -> Result<crate::protocol::Handled, ApiError> {
        crate::protocol::conversations::handle(self, method, target, query, body)
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    pub fn templates(&self) -> &TemplateSet {
        &self.templates
    }

    /// The fill-in-the-middle tokens completions' `suffix` is laid out with, if any.
    pub fn fim(&self) -> Option<&crate::fim::Fim> {
        self.fim.as_ref()
    }

    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    /// The grammar compiler (Core builds per-sequence matchers from its grammars).
    pub fn grammars(&self) -> &crate::structured::Grammars {
        &self.grammars
    }

    /// How chat output is read: the tool-call format (configured, or detected from the
    /// template tool requests render with; None: only forced calls, in the json format) and
    /// the reasoning parser (configured, or detected from the default template).
    pub fn output_parsing(&self) -> (Option<crate::tools::ToolCallFormat>, crate::reasoning::ReasoningParser) {
        let tools = self
            .config
            .tool_call_format
            .or_else(|| self.templates.select(true).and_then(|t| crate::tools::ToolCallFormat::detect(t.source())));
        let reasoning = self.config.reasoning_parser.unwrap_or_else(|| match self.templates.select(false) {
            Some(t) => crate::reasoning::ReasoningParser::detect(t.source()),
            None => crate::reasoning::ReasoningParser::Off,
        });
        (tools, reasoning)
    }

    /// The `--default-chat-template-kwargs` keys none of the chat templates reads (the start
    /// warns of them), or an error naming one the template gets from the request instead.
    pub fn unread_default_kwargs(&self) -> Result<Vec<String>, String> {
        let keys = self.config.default_chat_template_kwargs.keys();
        if let Some(k) = keys.clone().find(|k| crate::template::RESERVED.contains(&k.as_str())) {
            return Err(format!(
                "--default-chat-template-kwargs may not set `{k}`: the template gets it from each request"
            ));
        }
        let templates: Vec<_> = [false, true].into_iter().filter_map(|tools| self.templates.select(tools)).collect();
        Ok(keys.filter(|k| !templates.iter().any(|t| t.reads(k))).cloned().collect())
    }

    /// Validates a `Chat`, `Completion`, `Responses`, `Messages`, `Embeddings`, `Score` or `Rerank`
    /// request into a [`Prepared`] one.
    pub fn prepare(&self, endpoint: Endpoint, body: &[u8]) -> Result<Prepared, ApiError> {
        self.prepare_as(endpoint, body, None)
    }

    /// `prepare`, with the request's `X-Request-Id` header (`header_id`): it names the
    /// request when the body's `request_id` does not, as in vLLM (`chatcmpl-<id>`), if it is
    /// a valid `request_id` (else the request gets its own id).
    pub fn prepare_as(&self, endpoint: Endpoint, body: &[u8], header_id: Option<&str>) -> Result<Prepared, ApiError> {
        // A header id a response header could not carry back as it is names nothing.
        let header_id = header_id.filter(|id| crate::protocol::common::check_request_id(id).is_ok());
        let mut prepared = match endpoint {
            Endpoint::Chat => chat::prepare(self, body, header_id).map(|c| c.prepared),
            Endpoint::Completion => completion::prepare(self, body, header_id).map(|c| c.prepared),
            Endpoint::Responses => responses::prepare(self, body, header_id).map(|c| c.prepared),
            Endpoint::Messages => messages::prepare(self, body, header_id).map(|c| c.prepared),
            Endpoint::Generate => generate::prepare(self, body, header_id).map(|c| c.prepared),
            Endpoint::Embeddings => embeddings::prepare(self, body, header_id).map(|c| c.prepared),
            Endpoint::Score => score::prepare_score(self, body, header_id).map(|c| c.prepared),
            Endpoint::Rerank => score::prepare_rerank(self, body, header_id).map(|c| c.prepared),
            other => Err(ApiError::Internal {
                message: format!("The `{}` route does not generate; it is answered by `handle`.", other.name()),
            }),
        }?;
        // The response's id also names it in a header, as OpenAI's `x-request-id` does (the
        // SDK's `response._request_id`; logs and proxies read it without parsing the body).
        prepared.headers.push(("x-request-id".into(), prepared.id.clone()));
        if endpoint == Endpoint::Messages {
            // (Anthropic's name for it: its SDK's `message._request_id`)
            prepared.headers.push(("request-id".into(), prepared.id.clone()));
        }
        Ok(prepared)
    }

    /// Answers `Tokenize`, `Detokenize`, `ChatRender`, `CompletionRender`,
    /// `MessagesCountTokens` and `ResponsesInputTokens` with a JSON body.
    pub fn handle(&self, endpoint: Endpoint, body: &[u8]) -> Result<Handled, ApiError> {
        match endpoint {
            Endpoint::Tokenize => tokenize::tokenize(self, body),
            Endpoint::Detokenize => tokenize::detokenize(self, body),
            Endpoint::ChatRender => tokenize::chat_render(self, body),
            Endpoint::CompletionRender => tokenize::completion_render(self, body),
            Endpoint::MessagesCountTokens => messages::count_tokens(self, body),
            Endpoint::ResponsesInputTokens => responses::input_tokens(self, body),
            other => Err(ApiError::Internal {
                message: format!("The `{}` route generates; it goes through `prepare`.", other.name()),
            }),
        }
    }

    /// The `GET /v1/models` body: one object per served name, then one per LoRA adapter. It is
    /// also the page Anthropic's `GET /v1/models` answers (`has_more`, `first_id`, `last_id`),
    /// so both SDKs list them.
    pub fn models(&self) -> Vec<u8> {
        let loras = self.loras();
        let adapters = loras.live().map(|a| &a.name);
        let names: Vec<&String> = self.config.served_model_names.iter().chain(adapters).collect();
        let data: Vec<Value> = names.iter().map(|n| self.model_object(n, &loras)).collect();
        let body = json!({
            "object": "list",
            "data": data,
            "has_more": false,
            "first_id": names.first(),
            "last_id": names.last(),
        });
        serde_json::to_vec(&body).expect("JSON values serialize")
    }

    /// The `GET /v1/models/{id}` body, or 404.
    pub fn model(&self, id: &str) -> Result<Vec<u8>, ApiError> {
        self.check_model(id)?;
        Ok(serde_json::to_vec(&self.model_object(id, &self.loras())).expect("JSON values serialize"))
    }

    /// A model object in vLLM's shape (its clients read `root`, `parent` and `permission`):
    /// `root` is the model as loaded, the same for every alias; a LoRA adapter's is its path,
    /// and its `parent` the base model's root name. It also has the keys of
    /// Anthropic's model object (`type`, `display_name`, `created_at`, `lifecycle`,
    /// `max_input_tokens`, `max_tokens`).
    fn model_object(&self, id: &str, loras: &LoraTable) -> Value {
        use std::hash::{Hash, Hasher};
        let adapter = loras.index_of(id).and_then(|i| loras.get(i));
        let base = self.config.served_model_names.first();
        let mut h = std::collections::hash_map::DefaultHasher::new();
        id.hash(&mut h);
        let created_at = chrono::DateTime::from_timestamp(self.created as i64, 0)
            .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true));
        json!({
            "id": id,
            "object": "model",
            "created": self.created,
            "type": "model",
            "display_name": id,
            "created_at": created_at,
            "lifecycle": "active",
            // (Anthropic's limits: the context holds prompt and output together)
            "max_input_tokens": self.config.max_model_len,
            "max_tokens": self.config.max_model_len,
            "owned_by": "llmserve",
            "root": adapter.map(|a| &a.path).or(self.config.model_root.as_ref()).or(base),
            "parent": adapter.map(|a| a.parent.as_ref().or(base)),
            "max_model_len": self.config.max_model_len,
            // nothing is restricted per model: one permission that allows what the server does
            "permission": [{
                "id": format!("modelperm-{:016x}", h.finish()),
                "object": "model_permission",
                "created": self.created,
                "allow_create_engine": false,
                "allow_sampling": true,
                "allow_logprobs": true,
                "allow_search_indices": false,
                "allow_view": true,
                "allow_fine_tuning": false,
                "organization": "*",
                "group": null,
                "is_blocking": false,
            }],
        })
    }

    /// The `system_fingerprint` of requests through LoRA adapter `lora` (0: the base model).
    pub(crate) fn fingerprint(&self, lora: u32) -> Option<String> {
        let adapter = self.loras().get(lora).and_then(|a| a.system_fingerprint.clone());
        adapter.or_else(|| self.config.system_fingerprint.clone())
    }

    /// A served name, exactly as configured (no LoRA or revision guessing from a colon): 0 for
    /// the base model's names, a LoRA adapter's index plus one for its name.
    pub(crate) fn check_model(&self, name: &str) -> Result<u32, ApiError> {
        if self.config.served_model_names.iter().any(|n| n == name) {
            return Ok(0);
        }
        let loras = self.loras();
        match loras.index_of(name) {
            Some(i) => Ok(i),
            None => {
                let adapters = loras.live().map(|a| a.name.clone());
                let served = self.config.served_model_names.iter().cloned().chain(adapters).collect();
                Err(ApiError::ModelNotFound { model: name.to_string(), served })
            }
        }
    }

    fn loras(&self) -> RwLockReadGuard<'_, LoraTable> {
        self.loras.read().unwrap_or_else(|e| e.into_inner())
    }

    fn loras_mut(&self) -> std::sync::RwLockWriteGuard<'_, LoraTable> {
        self.loras.write().unwrap_or_else(|e| e.into_inner())
    }

    /// The LoRA adapters served now, in load order.
    pub fn lora_adapters(&self) -> Vec<LoraAdapter> {
        self.loras().live().cloned().collect()
    }

    /// How many LoRA adapters are served now.
    pub fn lora_count(&self) -> usize {
        self.loras().live().count()
    }

    /// Whether any LoRA adapter is served, or unloaded while its requests run.
    pub fn has_loras(&self) -> bool {
        self.loras().any()
    }

    /// The name of the adapter of `index` (also one unloaded while its requests run).
    pub fn lora_name(&self, index: u32) -> Option<String> {
        self.loras().get(index).map(|a| a.name.clone())
    }

    /// `POST /v1/load_lora_adapter`'s body, checked: refused when it names the base model, or
    /// a loaded adapter without `load_inplace` (so the weights are not read for nothing).
    pub fn check_lora_load(&self, body: &[u8]) -> Result<crate::lora::LoadRequest, ApiError> {
        let load = crate::lora::parse_load(body, &self.config.served_model_names, self.config.strict_fields)?;
        if !load.inplace && self.loras().index_of(&load.name).is_some() {
            return Err(crate::lora::already_loaded(&load.name));
        }
        Ok(load)
    }

    /// A fresh adapter index to install weights under before [`publish_lora`](Self::publish_lora).
    pub fn reserve_lora(&self) -> u32 {
        self.loras_mut().reserve()
    }

    /// Serves the adapter installed under `index`; with `replace`, in place of a loaded one of
    /// that name (whose index is returned: its weights go once its requests end).
    pub fn publish_lora(&self, index: u32, adapter: LoraAdapter, replace: bool) -> Result<Option<u32>, ApiError> {
        if self.config.served_model_names.contains(&adapter.name) {
            return Err(ApiError::invalid("lora_name", format!("'{}' is the base model's name.", adapter.name)));
        }
        self.loras_mut().publish(index, adapter, replace)
    }

    /// `POST /v1/unload_lora_adapter`: stops serving the adapter its body names; its index
    /// (its weights go once its requests end) and the response headers.
    pub fn unload_lora(&self, body: &[u8]) -> Result<(u32, String, crate::lora::Headers), ApiError> {
        let (name, headers) = crate::lora::parse_unload(body, self.config.strict_fields)?;
        let mut loras = self.loras_mut();
        match loras.retire(&name) {
            Some(index) => Ok((index, name, headers)),
            None => Err(crate::lora::not_loaded(&name, loras.live().map(|a| a.name.clone()).collect())),
        }
    }

    /// Drops an unloaded adapter whose weights the engine has freed.
    pub fn forget_lora(&self, index: u32) {
        self.loras_mut().forget(index)
    }
}
