//! The OpenAI request protocol: typed request bodies per endpoint, and their validation
//! into a [`Prepared`] request the engine can run.
//!
//! Every rule of the API contract that can be decided before generation is decided here:
//! types, ranges, conflicting fields, the served model name, the chat template, the
//! tokenized prompt and the context budget. The rule is that an accepted field either does
//! what it says or the client is told: fields that have no effect are named in the
//! `llmserve-ignored-fields` header (or rejected with `strict_fields`), unused
//! `chat_template_kwargs` keys in `llmserve-unused-template-kwargs`, and features that are
//! not implemented (`suffix`, ...) are a 400 `unsupported_parameter`, never silently dropped.
//! `response_format` and forced `tool_choice` compile to grammars here (see
//! [`crate::structured`]), so a schema the engine cannot enforce is a 400 before generation.
//!
//! Parsing is two-staged: the body is read as JSON (`invalid_json` otherwise), then each
//! endpoint's typed structs are filled with serde through `serde_path_to_error`, so that a
//! wrong type or a missing field is reported with its field path (`messages[2].content`).
//! Polymorphic fields (`stop`, `seed`, `prompt`, `messages`, `tools`, `tool_choice`,
//! `response_format`) are kept as JSON values and checked by hand, again with paths.
//!
//! Layout: `common` (parsing, sampling parameters, ignored fields), `budget` (context
//! checks), `chat` (with `functions`, chat's deprecated function-calling fields read as tools),
//! `completion`, `tokenize` (the tokenize/detokenize/render bodies).
//!
//! Decisions: `tool_choice: "none"` keeps the tools out of the template (the model must not
//! call them, so it is not shown them); `parallel_tool_calls: false` is enforced by the grammar
//! under a forced `tool_choice`, and under `"auto"` by ending the choice as its first call
//! completes; `continue_final_message: true` turns the
//! default `add_generation_prompt` off (both sent as true is a 400); `user` is kept in
//! [`Prepared::user`] for the log and is not reported as ignored.

pub mod budget;
pub mod chat;
pub mod common;
pub mod completion;
pub mod constrained;
pub mod conversations;
pub mod embeddings;
pub(crate) mod functions;
pub mod gbnf;
pub mod generate;
pub mod messages;
pub mod responses;
pub(crate) mod schema_check;
pub(crate) mod schema_edit;
pub mod score;
pub mod stored_chat;
pub mod structural_tag;
pub mod tokenize;

use serde_json::Value;

use crate::error::ApiError;

/// The routes the router understands. `Chat` and `Completion` generate (see
/// [`crate::router::Router::prepare`]); the others are answered at once
/// ([`crate::router::Router::handle`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completion,
    /// OpenAI's Responses API: validated and rendered as a chat request, answered as a
    /// `response` object (or its stream of events).
    Responses,
    /// Anthropic's Messages API (`/v1/messages`): validated and rendered as a chat request,
    /// answered as a `message` object (or its stream of events).
    Messages,
    /// vLLM's tokens-in, tokens-out route (`/inference/v1/generate`): validated as a completion
    /// of token ids, answered with token ids (see [`generate`]).
    Generate,
    /// `/v1/messages/count_tokens`: the prompt's token count, answered at once.
    MessagesCountTokens,
    /// `/v1/responses/input_tokens`: the Responses request's prompt token count, at once.
    ResponsesInputTokens,
    /// `/v1/embeddings`: each input's prompt runs and nothing is sampled; answered with
    /// the pooled hidden states.
    Embeddings,
    /// vLLM's `/score`: text pairs scored by their embeddings' cosine similarity.
    Score,
    /// vLLM's `/rerank`: documents ranked by their embeddings' cosine similarity to a query.
    Rerank,
    Tokenize,
    Detokenize,
    ChatRender,
    CompletionRender,
}

impl Endpoint {
    /// The names the bindings use: "chat", "completion", "responses", "messages", "generate",
    /// "messages_count_tokens", "responses_input_tokens", "embeddings", "score", "rerank", "tokenize",
    /// "detokenize", "chat_render", "completion_render".
    pub fn from_name(s: &str) -> Option<Self> {
        Some(match s {
            "chat" => Self::Chat,
            "completion" => Self::Completion,
            "responses" => Self::Responses,
            "messages" => Self::Messages,
            "generate" => Self::Generate,
            "messages_count_tokens" => Self::MessagesCountTokens,
            "responses_input_tokens" => Self::ResponsesInputTokens,
            "embeddings" => Self::Embeddings,
            "score" => Self::Score,
            "rerank" => Self::Rerank,
            "tokenize" => Self::Tokenize,
            "detokenize" => Self::Detokenize,
            "chat_render" => Self::ChatRender,
            "completion_render" => Self::CompletionRender,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Chat => "chat",
            Self::Completion => "completion",
            Self::Responses => "responses",
            Self::Messages => "messages",
            Self::Generate => "generate",
            Self::MessagesCountTokens => "messages_count_tokens",
            Self::ResponsesInputTokens => "responses_input_tokens",
            Self::Embeddings => "embeddings",
            Self::Score => "score",
            Self::Rerank => "rerank",
            Self::Tokenize => "tokenize",
            Self::Detokenize => "detokenize",
            Self::ChatRender => "chat_render",
            Self::CompletionRender => "completion_render",
        }
    }
}

/// What an `/invocations` body's keys make it (SageMaker's route, as vLLM serves it), tried in
/// vLLM's order, chat first.
const INVOCATIONS: [(&str, Endpoint); 5] = [
    ("messages", Endpoint::Chat),
    ("prompt", Endpoint::Completion),
    ("input", Endpoint::Embeddings),
    ("text_1", Endpoint::Score),
    ("query", Endpoint::Rerank),
];

/// The endpoint an `/invocations` body is a request of: chat (`messages`), completion
/// (`prompt`), embeddings (`input`), score (`text_1`) or rerank (`query`). A body that is no
/// JSON object goes to chat, whose 400 says what is wrong with it.
pub fn invocation_endpoint(body: &[u8]) -> Result<Endpoint, ApiError> {
    let Ok(Value::Object(fields)) = serde_json::from_slice::<Value>(common::without_bom(body)) else {
        return Ok(Endpoint::Chat);
    };
    INVOCATIONS.iter().find(|(key, _)| fields.contains_key(*key)).map(|&(_, endpoint)| endpoint).ok_or_else(|| {
        ApiError::with_code(
            "invalid_value",
            None,
            "An /invocations body is a chat request (`messages`), a completion (`prompt`), an embeddings request \
             (`input`), a score (`text_1`) or a rerank (`query`).",
        )
    })
}

/// A validated generation request, ready for the engine.
#[derive(Clone, Debug, PartialEq)]
pub struct Prepared {
    /// `Chat`, `Completion`, `Responses`, `Messages`, `Embeddings`, `Score` or `Rerank`.
    pub endpoint: Endpoint,
    /// "chatcmpl-<uuid hex>" / "cmpl-<uuid hex>", or the client's `request_id`.
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// The served name the client sent (an alias is echoed as sent).
    pub model: String,
    /// `RouterConfig::system_fingerprint`, echoed in every body and chunk.
    pub system_fingerprint: Option<String>,
    /// Chat: exactly one. Completions: one per prompt, in order.
    pub prompts: Vec<Vec<u32>>,
    /// The text of each prompt (the rendered template for chat; decoded ids for token
    /// prompts), for `echo`.
    pub prompt_texts: Vec<String>,
    pub params: SamplingParams,
    pub stream: bool,
    pub include_usage: bool,
    pub continuous_usage_stats: bool,
    /// Completions only: prepend the prompt text to each choice.
    pub echo: bool,
    /// vLLM's `return_token_ids`: the response carries the prompt's ids (`prompt_token_ids`)
    /// and every id each choice sampled (`token_ids`).
    pub return_token_ids: bool,
    /// vLLM's `return_tokens_as_token_ids`: logprobs name each token `token_id:<id>`.
    pub tokens_as_ids: bool,
    /// vLLM's `prompt_logprobs` k: the response lists each prompt token's logprob, rank and
    /// k alternatives (`prompt_logprobs` at the top of a chat body, on each completions choice).
    pub prompt_logprobs_k: Option<u32>,
    /// Lower runs first (vLLM's convention); 0 when not sent.
    pub priority: i32,
    pub cache_salt: Option<String>,
    /// `store: true` on a chat request: what keeps the finished completion (None: not kept).
    pub keep: Option<std::sync::Arc<crate::chat_store::Keep>>,
    /// The LoRA adapter the request's `model` names: its index ([`crate::lora`]; 0: the base
    /// model).
    pub lora: u32,
    /// Logged by the server; has no other effect.
    pub user: Option<String>,
    /// Response headers: `llmserve-ignored-fields`, `llmserve-chat-template`,
    /// `llmserve-unused-template-kwargs`, `x-request-id` (the response id).
    pub headers: Vec<(String, String)>,
    /// The request's fields that had no effect (their paths), as `llmserve-ignored-fields`
    /// lists them before the header's escaping and size limit.
    pub ignored: Vec<String>,
    /// The grammar every sequence's tokens must follow (`response_format` json/regex/grammar,
    /// or a forced `tool_choice`); None: unconstrained.
    pub grammar: Option<crate::structured::Grammar>,
    /// Chat with tools the model may call: how tool calls are parsed from the output.
    pub tools: Option<crate::tools::ToolParsing>,
    /// Chat with a reasoning parser active: how the output's thinking is split from its
    /// content (and whether the prompt already opened the think block). None otherwise.
    pub reasoning: Option<crate::reasoning::ReasoningPlan>,
    /// `Responses`: the request's fields a `response` object echoes back. None otherwise.
    pub responses: Option<std::sync::Arc<responses::Echo>>,
    /// `Embeddings`, `Score`, `Rerank`: how each input's hidden states become its embedding
    /// (and the scores of those). None otherwise.
    pub embedding: Option<embeddings::EmbeddingPlan>,
    /// Completions' `best_of` above `n`: `params.n` is `best_of` here.
    pub best_of: Option<BestOf>,
    /// Chat's `echo` (vLLM's): the last message's text, when it is the assistant's, which
    /// each choice's content starts with.
    pub echo_message: Option<String>,
    /// Chat's `prediction` (OpenAI's Predicted Outputs), tokenized: the scheduler drafts from
    /// it, and usage says how much of it each output holds ([`crate::prediction`]). Empty:
    /// none.
    pub prediction: Vec<u32>,
}

/// Completions' `best_of` above `n` (OpenAI's legacy API): each prompt runs `best_of`
/// sequences (`params.n`), whose sampled tokens' logprobs are computed to rank them, and the
/// body returns the `n` of each prompt's with the highest logprob per token (every sampled
/// token counts, the one that ended the choice too); `usage` counts all of them, as OpenAI
/// bills them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BestOf {
    /// The choices returned per prompt (the request's `n`).
    pub n: u32,
    /// The request asked for logprobs itself (else they are computed only to rank).
    pub logprobs: bool,
}

/// The answer of a route that does not generate (`Router::handle`): its JSON body, and the
/// response headers it earned, as a generation's `Prepared::headers` (`llmserve-ignored-fields`;
/// the render routes also `llmserve-chat-template`, `llmserve-unused-template-kwargs`).
#[derive(Clone, Debug)]
pub struct Handled {
    pub body: Vec<u8>,
    pub headers: Vec<(String, String)>,
}

impl Prepared {
    /// A Responses request with `background: true`: it runs whether or not anyone reads it,
    /// and its bytes are its events even when the client does not stream them.
    pub fn background(&self) -> bool {
        self.responses.as_ref().is_some_and(|echo| echo.background.is_some())
    }

    /// The sequences this request queues: one per prompt and distinct choice.
    pub fn num_seqs(&self) -> usize {
        self.prompts.len() * self.params.seqs_per_prompt() as usize
    }

    /// Ok, or the 400 of a request whose sequences could never all be admitted together: more
    /// than `running` (--max-num-seqs) and `waiting` (--max-waiting) hold at once. It names
    /// what to send less of: inputs or texts, choices (`n`, `best_of`) when one prompt's alone
    /// are too many, else prompts.
    pub fn check_fits(&self, running: usize, waiting: usize) -> Result<(), ApiError> {
        let (need, room) = (self.num_seqs(), running + waiting);
        if need <= room {
            return Ok(());
        }
        let limits = format!(
            "the server takes at most {room} at once ({running} running, --max-num-seqs, and {waiting} waiting, \
             --max-waiting)"
        );
        let (param, message) = match self.endpoint {
            Endpoint::Embeddings | Endpoint::Score | Endpoint::Rerank => {
                let (param, noun) = match self.endpoint {
                    Endpoint::Embeddings => ("input", "inputs"),
                    Endpoint::Score => ("text_2", "texts to score"),
                    _ => ("documents", "texts to score"),
                };
                (param, format!("This request has {need} {noun} and {limits}; send fewer per request."))
            }
            _ => {
                let prompts = self.prompts.len();
                let per_prompt = need / prompts;
                let choices = if self.best_of.is_some() { "best_of" } else { "n" };
                // (fewer prompts per request help only if one prompt's choices fit)
                let (param, advice) = if per_prompt > room {
                    (choices, format!("a smaller {choices}"))
                } else {
                    ("prompt", "fewer prompts per request".into())
                };
                let plural = if prompts > 1 { "s" } else { "" };
                (
                    param,
                    format!(
                        "This request would need {need} sequences ({prompts} prompt{plural}, {per_prompt} per prompt) \
                         and {limits}; send {advice}."
                    ),
                )
            }
        };
        Err(ApiError::invalid(param, message))
    }

    /// Some(k): the response returns each prompt token's logprob and k alternatives
    /// (completions' `echo` with `logprobs` k, vLLM's `prompt_logprobs` k; the larger when
    /// both), which the scheduler must then compute.
    pub fn prompt_logprobs(&self) -> Option<u32> {
        let echoed = if self.echo && self.endpoint == Endpoint::Completion { self.shown_logprobs() } else { None };
        echoed.max(self.prompt_logprobs_k)
    }

    /// The logprobs k the response shows (None: none, though `best_of` may compute them).
    pub fn shown_logprobs(&self) -> Option<u32> {
        self.params.logprobs.filter(|_| self.best_of.is_none_or(|b| b.logprobs))
    }
}

/// Sampling and stopping parameters, defaults already resolved (request ->
/// generation_config.json -> OpenAI).
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Choices per prompt, 1..=128.
    pub n: u32,
    /// 0 is greedy.
    pub temperature: f32,
    pub top_p: f32,
    /// 0 = off (the request's -1 and 0 both mean off).
    pub top_k: i32,
    pub min_p: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub repetition_penalty: f32,
    /// Any JSON integer; negative seeds keep their bits (`i64 as u64`).
    pub seed: Option<u64>,
    /// None: the remaining context of each prompt. Some: fits every prompt (a request's value
    /// is checked, a generation_config.json default shrinks to the room the longest prompt
    /// leaves).
    pub max_tokens: Option<u32>,
    pub min_tokens: u32,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub include_stop_str_in_output: bool,
    pub skip_special_tokens: bool,
    /// Sorted by token id, ids unique and < vocab size, biases in [-100, 100].
    pub logit_bias: Vec<(u32, f32)>,
    /// vLLM's `bad_words`, tokenized: each sequence's last token is banned after the rest.
    pub bad_words: Vec<Vec<u32>>,
    /// vLLM's `allowed_token_ids` (sorted, distinct): the only tokens that may be sampled.
    pub allowed_token_ids: Option<Vec<u32>>,
    /// vLLM's `use_beam_search`: `n` beams instead of `n` samples. None: sampling.
    pub beam_search: Option<BeamSearch>,
    /// None: no logprobs; Some(k): chosen token + k top alternatives.
    pub logprobs: Option<u32>,
    /// vLLM's `repetition_detection`: the choice ends once its output loops. None: off.
    pub repetition: Option<crate::repetition::RepetitionDetection>,
}

/// vLLM's beam search. Each step ranks, for every beam, its `2 * n` likeliest next tokens by
/// the beam's cumulative logprob with that token's (the raw logprobs, as the logprobs field
/// reports them) and keeps the best `n` that do not end it; a token that ends a beam (eos,
/// `stop_token_ids`) sets it aside finished. At the end the finished beams and those cut by
/// length are ranked by their cumulative logprob over their length (prompt included, as vLLM
/// counts it, the ending token not) to the power `length_penalty`, and the best `n` are the
/// choices.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BeamSearch {
    pub length_penalty: f64,
}

impl SamplingParams {
    /// The sequences each prompt runs: greedy choices are all the same, so n > 1 of them run
    /// once and are copied; beam search keeps `n` beams.
    pub fn seqs_per_prompt(&self) -> u32 {
        if self.temperature == 0.0 && self.beam_search.is_none() {
            1
        } else {
            self.n
        }
    }
}

/// What validation produced beyond [`Prepared`]: the render routes report it in their body.
#[derive(Clone, Debug)]
pub(crate) struct Checked {
    pub prepared: Prepared,
    /// (origin, hash) of the chat template used.
    pub template: Option<(String, String)>,
    pub unused_kwargs: Vec<String>,
    pub ignored: Vec<String>,
}

impl Checked {
    /// `ignored` as the request's reported fields and its `llmserve-ignored-fields`.
    pub(crate) fn report(&mut self, mut ignored: Vec<String>) {
        ignored.sort();
        ignored.dedup();
        let prepared = &mut self.prepared;
        prepared.headers.retain(|(k, _)| k != "llmserve-ignored-fields");
        prepared.headers.extend(common::ignored_header(&ignored));
        prepared.ignored = ignored.clone();
        self.ignored = ignored;
    }

    /// A translated request (Responses, Messages) prepared as chat made its own: `ignored` (in
    /// its terms) as its reported fields and `llmserve-ignored-fields`, its `endpoint`, and an
    /// id with its `prefix` (`<prefix>_<id>` when the client named it: `named`, by its
    /// `request_id` or `X-Request-Id`).
    pub(crate) fn adopt(&mut self, ignored: Vec<String>, endpoint: Endpoint, prefix: &str, named: bool) {
        self.report(ignored);
        let prepared = &mut self.prepared;
        prepared.endpoint = endpoint;
        prepared.id = match prepared.id.strip_prefix("chatcmpl-") {
            Some(id) if named => format!("{prefix}_{id}"),
            _ => common::new_id(prefix).replacen('-', "_", 1),
        };
    }
}
