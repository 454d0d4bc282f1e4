//! [`ResponseBuilder`]: the bytes a generation request sends back, streamed as SSE chunks or
//! as one JSON body, for chat and completions; a Responses API request runs as a one-choice
//! chat request whose chunks and body become its events and `response` object (`responses`),
//! and an Anthropic Messages request likewise becomes a `message` and its events (`messages`).
//!
//! Invariants (streaming): every chunk shares the request's `id`, `created` and `model`; a
//! chat choice's first chunk carries `delta.role = "assistant"`; each choice ends with
//! exactly one chunk holding its `finish_reason` (pushes after that are dropped); the stream
//! ends with `data: [DONE]`. Bodies are written by serde (f32 logprobs keep their short
//! form); only the SSE framing is written by hand.
//!
//! Tool calls (chat with `tools`): each choice's text goes through a
//! [`ToolCallParser`]; content is only the text outside calls, calls become
//! `message.tool_calls` (or, streamed, a `delta.tool_calls` chunk with `index`, `id` and
//! `function.name` as soon as the name is known, then `function.arguments` fragments as they
//! are generated), and a choice that made a call and ended normally finishes with
//! `"tool_calls"` (`"stop"` under a named `tool_choice`, as OpenAI's). Streamed and not, the calls are the same events, so the arguments a
//! client concatenates equal the non-streamed ones, with one exception: under `"auto"`, a
//! non-streamed choice with a call whose arguments are not a JSON object (the model wrote
//! `{"a": 1,}`, or EOS cut the call off; `max_tokens` cutting it off is exempt, as in
//! OpenAI's, and so is a stop string or stop token, which the finish's `stop_reason` names)
//! answers its whole text as content, without calls, as vLLM's parsers do, since clients
//! `json.loads` the arguments; a stream has already sent the call's pieces by then.
//!
//! A request that sent OpenAI's deprecated `functions` ([`ToolParsing::functions`]) gets its
//! one call as `message.function_call` (streamed: `delta.function_call` pieces) and finishes
//! `"function_call"` where a tools request would finish `"tool_calls"`.
//!
//! Reasoning (chat with a reasoning parser, [`Prepared::reasoning`]): each choice's text first
//! goes through a [`ReasoningSplitter`]; its thinking becomes `message.reasoning_content`
//! (streamed: `delta.reasoning_content` chunks), and only the rest is content (and read for
//! tool calls). Reasoning tokens count as completion tokens.

mod embeddings;
mod generate;
mod messages;
mod responses;

use std::sync::Arc;

use serde::ser::SerializeMap;
use serde::{Serialize, Serializer};
use serde_json::{json, Value};

use crate::detokenizer::{Detokenizer, StopConfig};
use crate::error::ApiError;
use crate::protocol::{Endpoint, Prepared};
use crate::reasoning::ReasoningSplitter;
use crate::tokenizer::Tokenizer;
use crate::tools::{ToolCallParser, ToolChoice, ToolEvent, ToolParsing};

/// One server-sent event: `event: <name>` when it has one, then `data: <data>` and the blank
/// line that ends it.
pub(crate) fn sse_frame(out: &mut Vec<u8>, event: Option<&str>, data: &[u8]) {
    if let Some(name) = event {
        out.extend_from_slice(b"event: ");
        out.extend_from_slice(name.as_bytes());
        out.push(b'\n');
    }
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(data);
    out.extend_from_slice(b"\n\n");
}

/// The frame that ends an OpenAI stream.
pub(crate) const SSE_DONE: &[u8] = b"data: [DONE]\n\n";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
    ToolCalls,
    /// vLLM's `repetition_detection` ended it (`crate::repetition`).
    Repetition,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::ToolCalls => "tool_calls",
            Self::Repetition => "repetition",
        }
    }
}

/// One generated token's logprobs entry, read only when the request asked for logprobs.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenOut {
    pub id: u32,
    pub logprob: f32,
    /// The top alternatives, most likely first.
    pub top: Vec<(u32, f32)>,
    /// Chars of the choice's text emitted before this token (completions `text_offset`, to
    /// which the builder adds the prompt's length).
    pub text_offset: usize,
}

/// One choice's progress in a step: the text now safe to send, the tokens whose logprobs go
/// with it, the ids sampled (each counts in `usage`; listed by `return_token_ids`), and the
/// finish when the choice ended. `tokens` and `ids` differ when a token's text is held back
/// for a possible stop string (its logprobs follow its text) or was trimmed away with one, or
/// is a stop token whose text is not shown (their logprobs never go out). `stop_reason` is
/// the stop string or stop token id that ended it (None for eos, length, or a grammar that
/// completed).
#[derive(Clone, Copy, Debug)]
pub struct ChoiceDelta<'a> {
    pub text: &'a str,
    pub tokens: &'a [TokenOut],
    pub ids: &'a [u32],
    pub finish: Option<FinishReason>,
    pub stop_reason: Option<StopReason<'a>>,
}

/// What matched a stop rule: on the wire a string (`stop`) or an integer (`stop_token_ids`),
/// as vLLM sends it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum StopReason<'a> {
    Text(&'a str),
    Token(u32),
}

/// A [`StopReason`] kept past its push.
#[derive(Clone, Debug, PartialEq, Eq)]
enum OwnedStop {
    Text(String),
    Token(u32),
}

impl OwnedStop {
    fn of(r: StopReason) -> Self {
        match r {
            StopReason::Text(s) => Self::Text(s.to_string()),
            StopReason::Token(t) => Self::Token(t),
        }
    }

    fn as_ref(&self) -> StopReason<'_> {
        match self {
            Self::Text(s) => StopReason::Text(s),
            Self::Token(t) => StopReason::Token(*t),
        }
    }
}

/// A sequence's output not yet pushed to its choices. The tokens one step brings (several when
/// it confirmed drafts) go out together, one chunk per choice, as vLLM sends a step's tokens;
/// with `--stream-interval` a stream also waits for that many tokens between chunks.
#[derive(Debug, Default)]
pub struct UnsentDelta {
    text: String,
    tokens: Vec<TokenOut>,
    ids: Vec<u32>,
    finish: Option<FinishReason>,
    stop_reason: Option<OwnedStop>,
    /// Whether a push has gone out for this sequence (a stream's first tokens go at once).
    sent: bool,
    /// Its finish went out: nothing more is added.
    closed: bool,
}

impl UnsentDelta {
    /// Appends a token's delta, as [`ChoiceDelta`]'s fields (nothing once the sequence has
    /// finished).
    pub fn add(
        &mut self,
        text: &str,
        mut tokens: Vec<TokenOut>,
        ids: &[u32],
        finish: Option<FinishReason>,
        stop_reason: Option<StopReason>,
    ) {
        if self.closed || self.finish.is_some() {
            return;
        }
        self.text.push_str(text);
        self.tokens.append(&mut tokens);
        self.ids.extend_from_slice(ids);
        self.finish = finish;
        self.stop_reason = stop_reason.map(OwnedStop::of);
    }

    /// Whether it should go out now: it holds something, and the sequence finished, or
    /// nothing went out before, or it holds at least `interval` tokens.
    pub fn due(&self, interval: usize) -> bool {
        let held = !self.ids.is_empty() || self.finish.is_some();
        held && (self.finish.is_some() || !self.sent || self.ids.len() >= interval)
    }

    /// What it holds, as one delta.
    pub fn delta(&self) -> ChoiceDelta<'_> {
        ChoiceDelta {
            text: &self.text,
            tokens: &self.tokens,
            ids: &self.ids,
            finish: self.finish,
            stop_reason: self.stop_reason.as_ref().map(OwnedStop::as_ref),
        }
    }

    /// Empties it once its delta went out.
    pub fn clear(&mut self) {
        self.text.clear();
        self.tokens.clear();
        self.ids.clear();
        self.sent = true;
        self.closed |= self.finish.take().is_some();
        self.stop_reason = None;
    }
}

/// A logprob as the wire shows it: -inf (a banned token) becomes -9999, as vLLM does, since
/// JSON has no infinity.
fn wire_lp(x: f32) -> f32 {
    if x.is_finite() {
        x
    } else {
        -9999.0
    }
}

#[derive(Serialize, Clone, Debug)]
struct ChatTop {
    token: String,
    logprob: f32,
    bytes: Vec<u8>,
}

#[derive(Serialize, Clone, Debug)]
struct ChatLogprob {
    token: String,
    logprob: f32,
    bytes: Vec<u8>,
    top_logprobs: Vec<ChatTop>,
}

/// Chat's `logprobs`: the content tokens', and OpenAI's `refusal`, which holds a refusal's
/// tokens and is null here (no model's output is read as a refusal).
#[derive(Serialize, Clone, Debug, Default)]
struct ChatLogprobs {
    content: Vec<ChatLogprob>,
    refusal: Option<Vec<ChatLogprob>>,
}

/// Completions' `top_logprobs` entry: token text -> logprob, most likely first, and the
/// token itself when it is not among them (OpenAI: "up to `logprobs + 1` elements"; `logprobs:
/// 0` gives the token alone). Two ids with one text keep the likelier one's value, except
/// that the token's own text always maps to its own logprob (as `tokens`/`token_logprobs`
/// pair them).
#[derive(Clone, Debug, Default)]
struct TopMap(Vec<(String, f32)>);

impl Serialize for TopMap {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            map.serialize_entry(k, v)?;
        }
        map.end()
    }
}

#[derive(Serialize, Clone, Debug, Default)]
struct CompletionLogprobs {
    tokens: Vec<String>,
    /// None (null) only for the first token of an echoed prompt, which has no context.
    token_logprobs: Vec<Option<f32>>,
    top_logprobs: Vec<Option<TopMap>>,
    text_offset: Vec<usize>,
}

impl CompletionLogprobs {
    fn extend(&mut self, other: CompletionLogprobs) {
        self.tokens.extend(other.tokens);
        self.token_logprobs.extend(other.token_logprobs);
        self.top_logprobs.extend(other.top_logprobs);
        self.text_offset.extend(other.text_offset);
    }
}

/// One token of a prompt entry in vLLM's `prompt_logprobs`.
#[derive(Clone, Debug)]
struct PromptLogprob {
    id: u32,
    logprob: f32,
    /// 1 for the likeliest token; None when the runner did not say (alternatives always know).
    rank: Option<u32>,
    decoded_token: String,
}

/// A prompt token's entry in vLLM's `prompt_logprobs`: token id -> `{logprob, rank,
/// decoded_token}`, the prompt token first, then its `prompt_logprobs` alternatives, most
/// likely first (the token itself once, with its own rank).
#[derive(Clone, Debug)]
struct PromptEntry(Vec<PromptLogprob>);

impl Serialize for PromptEntry {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Value<'a> {
            logprob: f32,
            rank: Option<u32>,
            decoded_token: &'a str,
        }
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for t in &self.0 {
            let value = Value { logprob: t.logprob, rank: t.rank, decoded_token: &t.decoded_token };
            map.serialize_entry(&t.id.to_string(), &value)?;
        }
        map.end()
    }
}

#[derive(Serialize, Clone, Copy, Debug, Default)]
struct Usage {
    prompt_tokens: u64,
    completion_tokens: u64,
    total_tokens: u64,
    prompt_tokens_details: PromptTokensDetails,
    /// Chat with a reasoning parser active (vLLM's rule), or with a `prediction`.
    #[serde(skip_serializing_if = "Option::is_none")]
    completion_tokens_details: Option<CompletionTokensDetails>,
}

/// OpenAI's breakdown of `completion_tokens`: those spent inside the think block; with a
/// `prediction`, the prediction's tokens the output holds and the rest of them
/// ([`crate::prediction`]), each choice's summed.
#[derive(Serialize, Clone, Copy, Debug, Default)]
struct CompletionTokensDetails {
    reasoning_tokens: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    accepted_prediction_tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    rejected_prediction_tokens: Option<u64>,
}

/// OpenAI's breakdown of `prompt_tokens`: those whose K/V the prefix cache already held.
#[derive(Serialize, Clone, Copy, Debug, Default)]
struct PromptTokensDetails {
    cached_tokens: u64,
}

#[derive(Serialize)]
struct Chunk<'a, C> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    system_fingerprint: Option<&'a str>,
    choices: Vec<C>,
    /// Absent, or (with `include_usage`) null until the final usage chunk, as OpenAI
    /// documents it.
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Option<Usage>>,
    /// Chat with `return_token_ids`: on each choice's first chunk (vLLM's place for it).
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt_token_ids: Option<&'a [u32]>,
}

#[derive(Serialize, Default)]
struct Delta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<&'a str>,
    /// The thinking, under vLLM's current name and under DeepSeek's (`reasoning_content`,
    /// which vLLM used before, and many clients still read): both carry the same text.
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_calls: Option<Vec<ToolCallDelta<'a>>>,
    /// The deprecated `functions` API's call: its name first, then its arguments' pieces.
    #[serde(skip_serializing_if = "Option::is_none")]
    function_call: Option<FunctionDelta<'a>>,
}

#[derive(Serialize)]
struct FunctionDelta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<&'a str>,
    arguments: &'a str,
}

/// A streamed piece of a call: the first carries `id`, `type` and the name, the next the
/// arguments.
#[derive(Serialize)]
struct ToolCallDelta<'a> {
    index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<&'a str>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    kind: Option<&'static str>,
    function: FunctionDelta<'a>,
}

#[derive(Serialize)]
struct Function<'a> {
    name: &'a str,
    arguments: &'a str,
}

#[derive(Serialize)]
struct ToolCallOut<'a> {
    id: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    function: Function<'a>,
}

/// `stop_reason` appears on the finishing chunk only (null when no stop string matched).
#[derive(Serialize)]
struct ChatChunkChoice<'a> {
    index: u32,
    delta: Delta<'a>,
    logprobs: Option<ChatLogprobs>,
    finish_reason: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stop_reason: Option<Option<StopReason<'a>>>,
    /// `return_token_ids`: the ids sampled since the choice's last chunk that carried some.
    #[serde(skip_serializing_if = "Option::is_none")]
    token_ids: Option<Vec<u32>>,
}

/// A streamed chunk's choice; a Responses request's chunks are chat ones, read as events.
trait ChunkChoice: Serialize {
    fn as_chat(&self) -> Option<&ChatChunkChoice<'_>> {
        None
    }
}

impl ChunkChoice for ChatChunkChoice<'_> {
    fn as_chat(&self) -> Option<&ChatChunkChoice<'_>> {
        Some(self)
    }
}

impl ChunkChoice for CompletionChunkChoice<'_> {}

#[derive(Serialize)]
struct CompletionChunkChoice<'a> {
    index: u32,
    text: &'a str,
    logprobs: Option<CompletionLogprobs>,
    finish_reason: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stop_reason: Option<Option<StopReason<'a>>>,
    /// `return_token_ids`: the prompt's ids, on the choice's first chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt_token_ids: Option<Vec<u32>>,
    /// `return_token_ids`: as chat's (the generated ids alone, also with `echo`).
    #[serde(skip_serializing_if = "Option::is_none")]
    token_ids: Option<Vec<u32>>,
}

/// `content` is null only when the message is tool calls (or could only be) and nothing else.
#[derive(Serialize)]
struct Message<'a> {
    role: &'static str,
    content: Option<&'a str>,
    /// Always null (no model here refuses through a separate channel); OpenAI always sends it.
    refusal: Option<&'a str>,
    /// Present (null when empty) only when a reasoning parser is active; `reasoning` and
    /// `reasoning_content` are the same text under both names, as in [`Delta`].
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning: Option<Option<&'a str>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_content: Option<Option<&'a str>>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tool_calls: Vec<ToolCallOut<'a>>,
    /// The deprecated `functions` API's call, in place of `tool_calls`.
    #[serde(skip_serializing_if = "Option::is_none")]
    function_call: Option<Function<'a>>,
}

#[derive(Serialize)]
struct ChatChoice<'a> {
    index: u32,
    message: Message<'a>,
    logprobs: Option<&'a ChatLogprobs>,
    finish_reason: Option<&'static str>,
    stop_reason: Option<StopReason<'a>>,
    /// `return_token_ids`: every id the choice sampled, its last token included (eos, a stop
    /// token, or one whose text a stop string trimmed), so `len` is its `completion_tokens`.
    #[serde(skip_serializing_if = "Option::is_none")]
    token_ids: Option<&'a [u32]>,
}

#[derive(Serialize)]
struct CompletionChoice<'a> {
    index: u32,
    text: &'a str,
    logprobs: Option<&'a CompletionLogprobs>,
    finish_reason: Option<&'static str>,
    stop_reason: Option<StopReason<'a>>,
    /// `return_token_ids`: the choice's prompt.
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt_token_ids: Option<&'a [u32]>,
    /// vLLM's `prompt_logprobs`: the choice's prompt's entries.
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt_logprobs: Option<&'a [Option<PromptEntry>]>,
    /// `return_token_ids`: as chat's: the generated ids alone, also with `echo` (as vLLM's;
    /// `prompt_token_ids` has the rest).
    #[serde(skip_serializing_if = "Option::is_none")]
    token_ids: Option<&'a [u32]>,
}

#[derive(Default)]
struct ChoiceState {
    /// A chunk (role, or echo) has gone out for this choice.
    started: bool,
    /// Non-streaming: the generated text so far (echo is prepended by `finish`).
    text: String,
    chat_lp: ChatLogprobs,
    comp_lp: CompletionLogprobs,
    completion_tokens: u64,
    finish: Option<FinishReason>,
    stop_reason: Option<OwnedStop>,
    /// Chat with tools: splits the text into content and calls.
    parser: Option<ToolCallParser>,
    /// Non-streaming: the calls parsed so far.
    tool_calls: Vec<ToolCall>,
    /// Non-streaming, with tools: the text the parser read (content and calls), which is
    /// the content if a call turns out broken.
    raw: String,
    /// Chat with a reasoning parser: splits thinking from content.
    reasoning: Option<ReasoningSplitter>,
    /// Non-streaming: the reasoning text so far.
    reasoning_text: String,
    /// Streaming: some content or reasoning text has gone out (a tool-parsing choice's role
    /// chunk starts no content, so one that ends with neither sends its `""` at the end).
    streamed_text: bool,
    /// Streaming with tools: the logprobs of tokens the call parser holds back, sent with the
    /// next chunk that carries something (text, a call piece, the finish).
    held_lp: Vec<ChatLogprob>,
    /// `return_token_ids`: the ids sampled; streaming, those no chunk has carried yet.
    token_ids: Vec<u32>,
    /// Streaming with `return_token_ids`: a chunk has carried the prompt's ids.
    sent_prompt_ids: bool,
    /// `best_of`: the sum of the sampled tokens' logprobs, and their count.
    score: (f64, u32),
    /// Chat's `prediction`: how much of it the choice's tokens hold so far, and what the
    /// current push added (a role chunk's usage is the usage before it).
    predicted: Option<crate::prediction::Alignment>,
    predicted_gain: u64,
}

/// One per request, covering all its choices (`prompts.len() * n`; choice index =
/// prompt_index * n + j).
pub struct ResponseBuilder {
    tokenizer: Arc<Tokenizer>,
    chat: bool,
    /// `include_reasoning: false`: the thinking is split off and counted, never sent.
    hide_reasoning: bool,
    id: String,
    created: u64,
    model: String,
    system_fingerprint: Option<String>,
    stream: bool,
    include_usage: bool,
    continuous_usage_stats: bool,
    echo: bool,
    logprobs: bool,
    return_token_ids: bool,
    /// vLLM's `return_tokens_as_token_ids`: logprobs name tokens `token_id:<id>`.
    tokens_as_ids: bool,
    /// `logprobs` k (0 when not asked).
    logprobs_k: u32,
    /// vLLM's `prompt_logprobs` k, and per prompt its entries so far (the first token's is
    /// None: nothing comes before it). Empty without it.
    prompt_logprobs_k: Option<u32>,
    prompt_entries: Vec<Vec<Option<PromptEntry>>>,
    n: u32,
    prompt_texts: Vec<String>,
    /// The prompts' ids, kept for `return_token_ids` (empty without it).
    prompt_ids: Vec<Vec<u32>>,
    prompt_tokens: u64,
    /// Of `prompt_tokens`, those the prefix cache held, summed as each prompt's first token
    /// reports them.
    cached_prompt_tokens: u64,
    /// Completions with `echo` and `logprobs`: per prompt, its tokens' logprobs so far (the
    /// first has none) and the char offset the next prompt token starts at. Prepended to
    /// each of the prompt's choices when it first produces output. Empty otherwise.
    prompt_lp: Vec<(CompletionLogprobs, Vec<usize>)>,
    choices: Vec<ChoiceState>,
    pending: Vec<u8>,
    done: bool,
    tools: Option<ToolParsing>,
    /// A Responses request: what its `response` object echoes, and (streamed) its events.
    responses: Option<(Arc<crate::protocol::responses::Echo>, responses::EventStream)>,
    /// An Embeddings request: its inputs' pooled hidden states so far.
    embeddings: Option<embeddings::Embeddings>,
    /// An Anthropic Messages request: (streamed) its events so far.
    messages: Option<messages::EventStream>,
    /// vLLM's tokens-in, tokens-out route: token ids out, no text (`generate`).
    generate: bool,
    /// `store: true` on a chat request: keeps the finished completion.
    keep: Option<Arc<crate::chat_store::Keep>>,
    /// The choices' text, reasoning and calls are gathered as they come (not streaming, or
    /// streaming a completion to keep, whose non-streamed body is kept).
    whole: bool,
    /// Completions' `best_of` above `n`: the body returns each prompt's best choices.
    best_of: Option<crate::protocol::BestOf>,
    /// Chat's `echo`: the text each choice's content starts with.
    echo_message: Option<String>,
    /// Chat's `prediction` (its match masks; each choice aligns its tokens with it).
    prediction: Option<crate::prediction::Predicted>,
}

/// A background Responses request's `response` object as it is queued: no output yet.
pub(crate) fn queued_response(prepared: &Prepared, echo: &crate::protocol::responses::Echo) -> Value {
    let mut object = responses::response_object(
        &prepared.id,
        prepared.created,
        &prepared.model,
        echo,
        None,
        Vec::new(),
        Value::Null,
    );
    object["status"] = json!("queued");
    object["background"] = json!(true);
    object
}

impl ResponseBuilder {
    pub fn new(prepared: &Prepared, tokenizer: Arc<Tokenizer>) -> Self {
        let n = prepared.params.n.max(1);
        let tokenizer_ref = tokenizer.clone();
        let tokenizer = &tokenizer_ref;
        let count = prepared.prompts.len() * n as usize;
        let prediction =
            (!prepared.prediction.is_empty()).then(|| crate::prediction::Predicted::new(&prepared.prediction));
        let chat = !matches!(prepared.endpoint, Endpoint::Completion | Endpoint::CompletionRender | Endpoint::Generate);
        let mut builder = Self {
            tokenizer: tokenizer.clone(),
            chat,
            id: prepared.id.clone(),
            created: prepared.created,
            model: prepared.model.clone(),
            system_fingerprint: prepared.system_fingerprint.clone(),
            // (a background response's events are made whether or not its client streams them)
            stream: prepared.stream || prepared.background(),
            include_usage: prepared.include_usage,
            continuous_usage_stats: prepared.continuous_usage_stats,
            echo: prepared.echo,
            logprobs: prepared.shown_logprobs().is_some(),
            return_token_ids: prepared.return_token_ids,
            tokens_as_ids: prepared.tokens_as_ids,
            logprobs_k: prepared.shown_logprobs().unwrap_or(0),
            prompt_logprobs_k: prepared.prompt_logprobs_k,
            prompt_entries: if prepared.prompt_logprobs_k.is_some() {
                prepared.prompts.iter().map(|_| vec![None]).collect()
            } else {
                Vec::new()
            },
            n,
            prompt_texts: prepared.prompt_texts.clone(),
            prompt_ids: if prepared.return_token_ids { prepared.prompts.clone() } else { Vec::new() },
            // Each prompt counts once, however many choices it has.
            prompt_tokens: prepared.prompts.iter().map(|p| p.len() as u64).sum(),
            cached_prompt_tokens: 0,
            prompt_lp: if echo_logprobs(prepared) {
                prepared
                    .prompts
                    .iter()
                    .zip(&prepared.prompt_texts)
                    .map(|(p, text)| {
                        let first =
                            p.first().map(|&id| shown(tokenizer, id, prepared.tokens_as_ids)).unwrap_or_default();
                        let lp = CompletionLogprobs {
                            tokens: vec![first],
                            token_logprobs: vec![None],
                            top_logprobs: vec![None],
                            text_offset: vec![0],
                        };
                        (lp, prompt_offsets(tokenizer, p, text))
                    })
                    .collect()
            } else {
                Vec::new()
            },
            hide_reasoning: prepared.reasoning.is_some_and(|p| p.hidden) && chat,
            choices: (0..count)
                .map(|_| ChoiceState {
                    parser: prepared.tools.as_ref().map(ToolParsing::parser),
                    reasoning: prepared.reasoning.filter(|_| chat).map(ReasoningSplitter::new),
                    predicted: prediction.as_ref().map(crate::prediction::Predicted::start),
                    ..ChoiceState::default()
                })
                .collect(),
            pending: Vec::new(),
            done: false,
            tools: prepared.tools.clone(),
            responses: prepared
                .responses
                .clone()
                .map(|echo| (echo, responses::EventStream::new(prepared.params.logprobs.is_some()))),
            embeddings: prepared
                .embedding
                .clone()
                .map(|plan| embeddings::Embeddings::new(plan, prepared.prompts.len())),
            messages: (prepared.endpoint == Endpoint::Messages)
                .then(|| messages::EventStream::new(&prepared.id, &prepared.model)),
            generate: prepared.endpoint == Endpoint::Generate,
            keep: prepared.keep.clone(),
            whole: !(prepared.stream || prepared.background()) || prepared.keep.is_some(),
            best_of: prepared.best_of,
            echo_message: prepared.echo_message.clone(),
            prediction,
        };
        if let (true, Some((echo, events))) = (builder.stream, builder.responses.as_mut()) {
            let object = match &echo.background {
                Some(run) => {
                    run.start();
                    queued_response(prepared, echo)
                }
                None => responses::response_object(
                    &builder.id,
                    builder.created,
                    &builder.model,
                    echo,
                    None,
                    Vec::new(),
                    Value::Null,
                ),
            };
            events.start(&mut builder.pending, object);
        }
        builder
    }

    /// A background Responses request failed with `err`: its stored entry becomes `failed`,
    /// and the bytes that end it are its `response.failed` event. None for any other request
    /// (or one already cancelled or deleted), which ends with `err` as it is; a streamed one
    /// that asked to be stored, whose client holds its id from `response.created`, is kept
    /// `failed` with the output it had (and joins no conversation, as OpenAI's failed ones).
    pub fn failed(&mut self, err: &ApiError) -> Option<Vec<u8>> {
        let usage = self.responses.is_some().then(|| self.responses_usage());
        let (echo, events) = self.responses.as_mut()?;
        let error = json!({"code": "server_error", "message": err.message()});
        if echo.background.is_none() {
            if let (true, Some((store, input)), Some(usage)) = (self.stream, &echo.store, usage) {
                let output = events.output_so_far();
                let mut object =
                    responses::response_object(&self.id, self.created, &self.model, echo, None, output, usage);
                object["status"] = json!("failed");
                object["error"] = error;
                let items = object["output"]
                    .as_array()
                    .map_or_else(Vec::new, |o| o.iter().map(crate::item_log::Item::new).collect());
                store.put(&self.id, crate::response_store::Stored::new(&object, input.clone(), items));
            }
            return None;
        }
        let body = echo.background.as_ref()?.fail(error)?;
        let response: Value = serde_json::from_slice(&body).expect("stored bodies are JSON");
        events.failed(&mut self.pending, response);
        Some(self.take())
    }

    /// A streamed Responses request's next `sequence_number` (what an `error` event ending it
    /// takes); None for other requests.
    pub fn responses_sequence(&self) -> Option<u64> {
        self.responses.as_ref().filter(|_| self.stream).map(|(_, events)| events.next_sequence())
    }

    fn usage(&self) -> Usage {
        let completion_tokens = self.choices.iter().map(|c| c.completion_tokens).sum();
        Usage {
            prompt_tokens: self.prompt_tokens,
            completion_tokens,
            total_tokens: self.prompt_tokens + completion_tokens,
            prompt_tokens_details: PromptTokensDetails { cached_tokens: self.cached_prompt_tokens },
            // every choice has a splitter when a reasoning parser is active (chat), none otherwise
            completion_tokens_details: (self.choices.first().is_some_and(|c| c.reasoning.is_some())
                || self.prediction.is_some())
            .then(|| {
                let accepted: u64 = (0..self.choices.len()).map(|i| self.predicted(i)).sum();
                let predicted = self.prediction.as_ref().map(|p| p.len() as u64 * self.choices.len() as u64);
                CompletionTokensDetails {
                    reasoning_tokens: self
                        .choices
                        .iter()
                        .filter_map(|c| c.reasoning.as_ref())
                        .map(|r| r.reasoning_tokens())
                        .sum(),
                    accepted_prediction_tokens: predicted.map(|_| accepted),
                    rejected_prediction_tokens: predicted.map(|all| all - accepted),
                }
            }),
        }
    }

    /// The prediction's tokens choice `idx` holds so far (0 without a prediction).
    fn predicted(&self, idx: usize) -> u64 {
        match (&self.prediction, &self.choices[idx].predicted) {
            (Some(p), Some(a)) => a.common(p),
            _ => 0,
        }
    }

    /// An Embeddings request: one final hidden state the scheduler listed for prompt
    /// `prompt` (`Plan::pool_indices`). Ignored by other requests.
    pub fn add_pooled(&mut self, prompt: u32, row: &[f32]) {
        if let Some(e) = self.embeddings.as_mut() {
            e.add(prompt as usize, row);
        }
    }

    /// One prompt's tokens that came from the prefix cache (its first token reports them).
    pub fn add_cached_prompt_tokens(&mut self, tokens: u32) {
        self.cached_prompt_tokens += u64::from(tokens);
    }

    fn chunk_usage(&self) -> Option<Usage> {
        self.continuous_usage_stats.then(|| self.usage())
    }

    fn frame<C: ChunkChoice>(&mut self, choices: Vec<C>, usage: Option<Usage>) {
        self.frame_with(choices, usage, None);
    }

    /// `frame`, with the ids of prompt `prompt` at the chunk's top (chat's `return_token_ids`).
    /// A Responses request's chunk goes out as its events instead.
    fn frame_with<C: ChunkChoice>(&mut self, choices: Vec<C>, usage: Option<Usage>, prompt: Option<usize>) {
        if let Some(events) = &self.messages {
            // (the usage only for `message_start`: not summed again on every later chunk)
            let counts = (!events.started()).then(|| self.message_counts());
            let calls = messages_calls(&self.choices[0].tool_calls);
            if let Some(events) = self.messages.as_mut() {
                for c in choices.iter().filter_map(ChunkChoice::as_chat) {
                    events.on_chunk(&mut self.pending, c, counts, calls);
                }
            }
            return;
        }
        if let Some((echo, events)) = self.responses.as_mut() {
            for c in choices.iter().filter_map(ChunkChoice::as_chat) {
                if events.progress(&mut self.pending) {
                    echo.background.as_ref().expect("only background responses are queued").progress();
                }
                events.on_chunk(&mut self.pending, c);
            }
            // (a background response's stored object follows its output, a few times a second)
            if let Some(run) = &echo.background {
                if let Some(object) = events.snapshot() {
                    run.snapshot(&object);
                }
            }
            return;
        }
        let chunk = Chunk {
            id: &self.id,
            object: if self.chat { "chat.completion.chunk" } else { "text_completion" },
            created: self.created,
            model: &self.model,
            system_fingerprint: self.system_fingerprint.as_deref(),
            choices,
            usage: if usage.is_some() || self.include_usage { Some(usage) } else { None },
            prompt_token_ids: prompt.and_then(|p| self.prompt_ids.get(p)).map(Vec::as_slice),
        };
        sse_frame(&mut self.pending, None, &serde_json::to_vec(&chunk).expect("chunks serialize"));
    }

    /// `return_token_ids`, streaming: the ids a choice's next chunk carries (those no chunk
    /// has carried yet); None without it.
    fn take_ids(&mut self, idx: usize) -> Option<Vec<u32>> {
        self.return_token_ids.then(|| std::mem::take(&mut self.choices[idx].token_ids))
    }

    /// `return_token_ids`, streaming: the index of the prompt whose ids a choice's chunk
    /// carries, for its first chunk only.
    fn take_prompt(&mut self, idx: usize) -> Option<usize> {
        let state = &mut self.choices[idx];
        let first = self.return_token_ids && !state.sent_prompt_ids;
        state.sent_prompt_ids = true;
        first.then_some(idx / self.n as usize)
    }

    /// A token as logprobs name it: its text, or `token_id:<id>`.
    fn token_str(&self, id: u32) -> String {
        shown(&self.tokenizer, id, self.tokens_as_ids)
    }

    /// A token's `bytes` in chat logprobs: its own, or (named by id) the name's, as vLLM's.
    fn token_bytes(&self, id: u32) -> Vec<u8> {
        if self.tokens_as_ids {
            self.token_str(id).into_bytes()
        } else {
            self.tokenizer.token_bytes(id)
        }
    }

    fn chat_logprobs(&self, tokens: &[TokenOut]) -> Vec<ChatLogprob> {
        tokens
            .iter()
            .map(|tok| ChatLogprob {
                token: self.token_str(tok.id),
                logprob: wire_lp(tok.logprob),
                bytes: self.token_bytes(tok.id),
                top_logprobs: tok
                    .top
                    .iter()
                    .map(|&(id, lp)| ChatTop {
                        token: self.token_str(id),
                        logprob: wire_lp(lp),
                        bytes: self.token_bytes(id),
                    })
                    .collect(),
            })
            .collect()
    }

    /// `tok`'s first `k` alternatives, and the token itself when they lack it.
    fn top_map(&self, tok: &TokenOut, k: usize) -> TopMap {
        let own = self.token_str(tok.id);
        let mut map = TopMap::default();
        let mut own_listed = false;
        for &(id, lp) in tok.top.iter().take(k) {
            let s = self.token_str(id);
            // (another id that shows as the token's text, e.g. both partial UTF-8 as U+FFFD:
            // the text looks up the token's own logprob)
            if (s == own && id != tok.id) || map.0.iter().any(|(k, _)| *k == s) {
                continue;
            }
            own_listed |= id == tok.id;
            map.0.push((s, wire_lp(lp)));
        }
        if !own_listed {
            map.0.push((own, wire_lp(tok.logprob)));
        }
        map
    }

    fn completion_logprobs(&self, tokens: &[TokenOut], offset_shift: usize) -> CompletionLogprobs {
        let mut out = CompletionLogprobs::default();
        for tok in tokens {
            out.tokens.push(self.token_str(tok.id));
            out.token_logprobs.push(Some(wire_lp(tok.logprob)));
            out.top_logprobs.push(Some(self.top_map(tok, usize::MAX)));
            out.text_offset.push(tok.text_offset + offset_shift);
        }
        out
    }

    /// Completions with `echo` and `logprobs`, and vLLM's `prompt_logprobs`: the next prompt
    /// tokens of prompt `prompt`, in order from its second token, each with its logprob given
    /// the tokens before it (`id` is the prompt token; `text_offset` is ignored: the builder
    /// counts it from the start of the prompt) and, when known, its rank (`ranks[i]`: 1 + how
    /// many other tokens were at least as likely). `top` may hold more alternatives than one
    /// use wants (the larger k of the two); each takes its own. Must arrive before the
    /// prompt's choices first push. Ignored for any other request.
    pub fn push_prompt_logprobs(&mut self, prompt: u32, tokens: &[TokenOut], ranks: &[u32]) {
        let p = prompt as usize;
        if let Some(k) = self.prompt_logprobs_k.filter(|_| p < self.prompt_entries.len()) {
            let mut add = Vec::with_capacity(tokens.len());
            for (i, tok) in tokens.iter().enumerate() {
                let mut entry = vec![PromptLogprob {
                    id: tok.id,
                    logprob: wire_lp(tok.logprob),
                    rank: ranks.get(i).copied(),
                    // (text, also under return_tokens_as_token_ids: the id is the key)
                    decoded_token: self.tokenizer.token_str(tok.id),
                }];
                let top = tok.top.iter().take(k as usize).enumerate().filter(|(_, (id, _))| *id != tok.id);
                entry.extend(top.map(|(r, &(id, lp))| PromptLogprob {
                    id,
                    logprob: wire_lp(lp),
                    rank: Some(r as u32 + 1),
                    decoded_token: self.tokenizer.token_str(id),
                }));
                add.push(Some(PromptEntry(entry)));
            }
            self.prompt_entries[p].extend(add);
        }
        let Some((lp, offsets)) = self.prompt_lp.get(p) else { return };
        let next = lp.tokens.len();
        let k = self.logprobs_k as usize;
        let mut add = CompletionLogprobs::default();
        for (i, tok) in tokens.iter().enumerate() {
            add.text_offset.push(offsets.get(next + i).copied().unwrap_or_default());
            add.tokens.push(self.token_str(tok.id));
            add.token_logprobs.push(Some(wire_lp(tok.logprob)));
            add.top_logprobs.push(Some(self.top_map(tok, k)));
        }
        self.prompt_lp[p].0.extend(add);
    }

    /// Records one choice's progress; when streaming, queues its chunks for [`Self::take`].
    /// Pushes for an unknown or already finished choice are dropped.
    pub fn push(&mut self, choice: u32, delta: &ChoiceDelta) {
        let idx = choice as usize;
        if idx >= self.choices.len() || self.choices[idx].finish.is_some() {
            return;
        }
        // Counted first: every chunk this push sends (reasoning, content, call pieces)
        // carries usage that includes its token, and the first chunk to go out its ids.
        self.choices[idx].completion_tokens += delta.ids.len() as u64;
        let generated = self.choices[idx].completion_tokens;
        let predicted_before = self.predicted(idx);
        if let (Some(p), Some(a)) = (&self.prediction, self.choices[idx].predicted.as_mut()) {
            delta.ids.iter().for_each(|&t| a.push(p, t));
        }
        self.choices[idx].predicted_gain = self.predicted(idx) - predicted_before;
        if self.return_token_ids {
            self.choices[idx].token_ids.extend_from_slice(delta.ids);
        }
        if self.generate {
            return self.push_generate(choice, delta);
        }
        let split = self.choices[idx].reasoning.as_mut().map(|r| {
            let mut split = r.push_tokens(delta.text, delta.tokens.iter().map(|t| t.text_offset));
            if delta.finish.is_some() {
                let rest = r.finish(generated);
                split.reasoning.push_str(&rest.reasoning);
                split.content.push_str(&rest.content);
            }
            split
        });
        let content_delta;
        let content_tokens: Vec<TokenOut>;
        let delta = match &split {
            Some(split) => {
                if !split.reasoning.is_empty() {
                    self.push_reasoning(choice, &split.reasoning);
                }
                // A Responses message's logprobs cover its text alone (the reasoning item has
                // none), as do those of chat's hidden thinking; chat's list every token, as vLLM's.
                let text_only = self.responses.is_some() || self.hide_reasoning;
                let tokens = match &self.choices[idx].reasoning {
                    Some(r) if text_only => {
                        content_tokens = delta.tokens.iter().filter(|t| r.in_content(t.text_offset)).cloned().collect();
                        &content_tokens[..]
                    }
                    _ => delta.tokens,
                };
                content_delta = ChoiceDelta { text: &split.content, tokens, ..*delta };
                &content_delta
            }
            None => delta,
        };
        if self.choices[idx].parser.is_some() {
            return self.push_with_tools(choice, delta);
        }
        self.push_plain(choice, delta);
    }

    /// vLLM's tokens-in, tokens-out route: records a choice's ids (`token_ids`, kept by
    /// `return_token_ids`), logprobs (`held_lp`) and finish; streaming, sends the ids that have
    /// their logprobs (a token held back for a possible stop string gets them later; every
    /// token gets them, as the route keeps the stop string's) and, at the finish, all the rest.
    fn push_generate(&mut self, choice: u32, delta: &ChoiceDelta) {
        let idx = choice as usize;
        let lps = if self.logprobs { self.chat_logprobs(delta.tokens) } else { Vec::new() };
        let c = &mut self.choices[idx];
        c.started = true;
        c.finish = delta.finish;
        c.stop_reason = delta.stop_reason.map(OwnedStop::of);
        c.held_lp.extend(lps);
        if !self.stream {
            return;
        }
        let ready = match delta.finish {
            None if self.logprobs => c.token_ids.len().min(c.held_lp.len()),
            _ => c.token_ids.len(),
        };
        if ready == 0 && delta.finish.is_none() {
            return;
        }
        let ids: Vec<u32> = c.token_ids.drain(..ready).collect();
        let lp_count = if delta.finish.is_some() { c.held_lp.len() } else { ready.min(c.held_lp.len()) };
        let lps: Vec<ChatLogprob> = c.held_lp.drain(..lp_count).collect();
        let usage = self.chunk_usage();
        let chunk = generate::Chunk {
            request_id: &self.id,
            choices: vec![generate::Choice {
                index: choice,
                logprobs: generate::logprobs(self.logprobs, lps),
                finish_reason: delta.finish.map(FinishReason::as_str),
                stop_reason: delta.finish.and(delta.stop_reason),
                token_ids: &ids,
            }],
            usage,
        };
        generate::frame(&mut self.pending, &chunk);
    }

    /// The body of a tokens-in, tokens-out request not streamed.
    fn generate_body(&self) -> Vec<u8> {
        let choices = self
            .choices
            .iter()
            .enumerate()
            .map(|(i, c)| generate::Choice {
                index: i as u32,
                logprobs: generate::logprobs(self.logprobs, c.held_lp.clone()),
                finish_reason: c.finish.map(FinishReason::as_str),
                stop_reason: c.stop_reason.as_ref().map(OwnedStop::as_ref),
                token_ids: &c.token_ids,
            })
            .collect();
        let body = generate::Body {
            request_id: &self.id,
            choices,
            usage: self.usage(),
            prompt_logprobs: self.prompt_entries.first().map(Vec::as_slice),
            kv_transfer_params: None,
        };
        serde_json::to_vec(&body).expect("bodies serialize")
    }

    /// Records a chat choice's reasoning text; streamed, it goes out as its own
    /// `delta.reasoning_content` chunk (after the role chunk when it is the first output).
    fn push_reasoning(&mut self, choice: u32, text: &str) {
        let idx = choice as usize;
        if self.whole {
            self.choices[idx].reasoning_text.push_str(text);
        }
        // (hidden: its ids and usage go out with the next chunk that does)
        if !self.stream || self.hide_reasoning {
            return;
        }
        let first = !self.choices[idx].started;
        self.choices[idx].started = true;
        self.choices[idx].streamed_text = true;
        let role = first.then_some("assistant");
        let c = ChatChunkChoice {
            index: choice,
            // NOTE: no `content: ""` here: an answer cut off while thinking has no content,
            // and a client summing deltas should end with null, as the non-streamed body has.
            delta: Delta {
                role,
                content: None,
                reasoning: Some(text),
                reasoning_content: Some(text),
                tool_calls: None,
                function_call: None,
            },
            logprobs: None,
            finish_reason: None,
            stop_reason: None,
            token_ids: self.take_ids(idx),
        };
        let usage = self.chunk_usage();
        let prompt = self.take_prompt(idx);
        self.frame_with(vec![c], usage, prompt);
    }

    /// Records text, tokens and finish of one choice (no tool-call parsing).
    fn push_plain(&mut self, choice: u32, delta: &ChoiceDelta) {
        let idx = choice as usize;
        let first = !self.choices[idx].started;
        self.choices[idx].started = true;
        self.choices[idx].finish = delta.finish;
        self.choices[idx].stop_reason = delta.stop_reason.map(OwnedStop::of);
        let echo_text =
            if self.echo && !self.chat && first { self.prompt_texts.get(idx / self.n as usize).cloned() } else { None };
        // text_offset counts from the start of the prompt, echoed or not (OpenAI's legacy
        // completions: a token's offset is the same with and without `echo`).
        let shift =
            if self.chat { 0 } else { self.prompt_texts.get(idx / self.n as usize).map_or(0, |p| p.chars().count()) };
        let finish = delta.finish.map(FinishReason::as_str);
        let stop_reason = delta.finish.map(|_| delta.stop_reason);
        // The prompt's logprobs go first, with the echoed prompt.
        let mut prompt_lp = if first { self.prompt_lp.get(idx / self.n as usize).map(|p| p.0.clone()) } else { None };
        let has_lp = self.logprobs && (!delta.tokens.is_empty() || prompt_lp.is_some());

        if self.whole {
            if let Some(echo) = self.echo_message.as_deref().filter(|_| first) {
                self.choices[idx].text.push_str(echo);
            }
            self.choices[idx].text.push_str(delta.text);
            if has_lp {
                if self.chat {
                    let lps = self.chat_logprobs(delta.tokens);
                    self.choices[idx].chat_lp.content.extend(lps);
                } else {
                    let lps = self.completion_logprobs(delta.tokens, shift);
                    let acc = &mut self.choices[idx].comp_lp;
                    // (a completion is gathered only when not streamed: nothing else reads them then)
                    if let Some(p) = prompt_lp.take() {
                        acc.extend(p);
                    }
                    acc.extend(lps);
                }
            }
        }
        if !self.stream {
            return;
        }

        if self.chat {
            if first {
                // NOTE: output forced to be calls has no content, and one that may be calls
                // (auto) may have none: the role chunk starts none, so a client that sums
                // deltas ends with `content` null when only calls came, as non-streamed (an
                // auto answer with neither text nor calls gets its `""` at its end).
                let parsing = self.tools.is_some() && self.choices[idx].parser.is_some();
                // (chat's `echo`: the content starts with the last message's, as the role
                // chunk's; `echo_message` is never set beside a parser)
                let echo = self.echo_message.clone();
                let content = echo.as_deref().unwrap_or("");
                // (nor after hidden thinking, `include_reasoning: false`, as push_reasoning
                // starts none: an answer cut off while thinking has no content)
                let thought = self.choices[idx].reasoning.as_ref().is_some_and(|r| r.reasoning_tokens() > 0);
                let silent = parsing || (thought && echo.is_none());
                let role = ChatChunkChoice {
                    index: choice,
                    delta: Delta { role: Some("assistant"), content: (!silent).then_some(content), ..Delta::default() },
                    logprobs: None,
                    finish_reason: None,
                    stop_reason: None,
                    // (the ids go with the text they make, on the next chunks)
                    token_ids: None,
                };
                // The role chunk comes before the first token (as in vLLM): its usage does
                // not count the tokens of the chunk after it, reasoning ones included (this
                // is the choice's first push, so all it counted came from this one).
                let before = delta.ids.len() as u64;
                let reasoned = self.choices[idx].reasoning.as_ref().map_or(0, ReasoningSplitter::reasoning_tokens);
                let gained = self.choices[idx].predicted_gain;
                let usage = self.chunk_usage().map(|u| Usage {
                    completion_tokens: u.completion_tokens - before,
                    total_tokens: u.total_tokens - before,
                    completion_tokens_details: u.completion_tokens_details.map(|d| CompletionTokensDetails {
                        reasoning_tokens: d.reasoning_tokens - reasoned,
                        accepted_prediction_tokens: d.accepted_prediction_tokens.map(|a| a - gained),
                        rejected_prediction_tokens: d.rejected_prediction_tokens.map(|r| r + gained),
                    }),
                    ..u
                });
                let prompt = self.take_prompt(idx);
                self.frame_with(vec![role], usage, prompt);
            }
            let held = std::mem::take(&mut self.choices[idx].held_lp);
            let has_lp = has_lp || !held.is_empty();
            if delta.text.is_empty() && finish.is_none() && !has_lp {
                return;
            }
            // A choice that sent nothing (a stop string cut all it wrote, or EOS came first)
            // lists no token: its finish carries empty logprobs, adding up to the non-streamed
            // `content: []`; any other finish without tokens carries null, as OpenAI's does.
            let silent = !self.choices[idx].streamed_text && delta.text.is_empty();
            self.choices[idx].streamed_text |= !delta.text.is_empty();
            let logprobs = (has_lp || (self.logprobs && finish.is_some() && silent)).then(|| {
                let mut content = held;
                content.extend(self.chat_logprobs(delta.tokens));
                ChatLogprobs { content, refusal: None }
            });
            let c = ChatChunkChoice {
                index: choice,
                delta: Delta { content: (!delta.text.is_empty()).then_some(delta.text), ..Delta::default() },
                logprobs,
                finish_reason: finish,
                stop_reason,
                token_ids: self.take_ids(idx),
            };
            let usage = self.chunk_usage();
            self.frame(vec![c], usage);
        } else {
            let text = match &echo_text {
                Some(e) => format!("{e}{}", delta.text),
                None => delta.text.to_string(),
            };
            if text.is_empty() && finish.is_none() && !has_lp {
                return;
            }
            // (every chunk of a choice with logprobs has them, empty ones too, as a non-streamed
            // answer that ends without tokens has them and vLLM's chunks do)
            let logprobs = self.logprobs.then(|| {
                let mut lps = prompt_lp.unwrap_or_default();
                lps.extend(self.completion_logprobs(delta.tokens, shift));
                lps
            });
            let prompt_token_ids = self.take_prompt(idx).and_then(|p| self.prompt_ids.get(p)).cloned();
            let c = CompletionChunkChoice {
                index: choice,
                text: &text,
                logprobs,
                finish_reason: finish,
                stop_reason,
                prompt_token_ids,
                token_ids: self.take_ids(idx),
            };
            let usage = self.chunk_usage();
            self.frame(vec![c], usage);
        }
    }

    /// `push` for a chat choice whose text may hold tool calls.
    fn push_with_tools(&mut self, choice: u32, delta: &ChoiceDelta) {
        let idx = choice as usize;
        let parallel = self.tools.as_ref().is_some_and(|t| t.parallel);
        // NOTE: a named tool_choice finishes "stop" as OpenAI's does (the function was
        // forced, the model did not choose to call); auto and required finish "tool_calls".
        let named = self.tools.as_ref().is_some_and(|t| t.choice == ToolChoice::Named);
        let call_finish = if named { FinishReason::Stop } else { FinishReason::ToolCalls };
        if self.whole {
            self.choices[idx].raw.push_str(delta.text);
        }
        let parser = self.choices[idx].parser.as_mut().expect("checked by push");
        let mut events = parser.push(delta.text);
        let mut finish = delta.finish;
        let mut stop_reason = delta.stop_reason;
        // NOTE: without parallel calls the choice ends as its first call completes; the
        // engine stops its sequence when it sees `choice_finished`.
        let first_end = |events: &[ToolEvent]| events.iter().position(|e| *e == ToolEvent::End);
        if let Some(end) = first_end(&events).filter(|_| !parallel) {
            events.truncate(end + 1);
            finish = Some(call_finish);
            stop_reason = None;
        } else if finish.is_some() {
            events.extend(parser.finish());
            if let Some(end) = first_end(&events).filter(|_| !parallel) {
                events.truncate(end + 1);
            }
        }
        // An end after calls is the calls' finish; but a stop string or stop token that cut
        // a call short stays a "stop" that names it (the arguments are not whole). One after
        // complete calls (an agent's "Observation:") still ends in the calls, its
        // `stop_reason` naming it (as vLLM's).
        let cut_short = stop_reason.is_some() && parser.calls_ended() < parser.calls_started();
        if finish == Some(FinishReason::Stop) && parser.calls_started() > 0 && !cut_short {
            finish = Some(call_finish);
        }
        let has_text = events.iter().any(|e| matches!(e, ToolEvent::Content(c) if !c.is_empty()));
        // Content and the calls' pieces in the order of the text (a push may hold a call's end
        // and the text after it), then the finish on its own chunk. The push's logprobs ride on
        // its first content; tokens that are only call markup carry theirs on the first piece
        // they send (as vLLM), or on the finishing chunk, not on an empty chunk before it.
        let pieces = |e: &ToolEvent| matches!(e, ToolEvent::Start { .. } | ToolEvent::Args(_));
        let mut pending_lp = None;
        // (the push's tokens, for the first content that goes out)
        let mut content_tokens = None;
        if self.stream && self.logprobs && !has_text && !delta.tokens.is_empty() {
            let mut lps = std::mem::take(&mut self.choices[idx].held_lp);
            let these = self.chat_logprobs(delta.tokens);
            if self.whole {
                // (a kept stream's body lists them as a non-streamed one does)
                self.choices[idx].chat_lp.content.extend(these.iter().cloned());
            }
            lps.extend(these);
            self.push_plain(choice, &ChoiceDelta { text: "", tokens: &[], finish: None, stop_reason: None, ..*delta });
            if events.iter().any(pieces) || finish.is_some() {
                pending_lp = Some(ChatLogprobs { content: lps, refusal: None });
            } else {
                self.choices[idx].held_lp = lps;
            }
        } else if !has_text {
            self.push_plain(choice, &ChoiceDelta { text: "", finish: None, stop_reason: None, ..*delta });
        } else {
            if !self.choices[idx].started {
                // (the role chunk before anything else)
                let none = ChoiceDelta { text: "", tokens: &[], finish: None, stop_reason: None, ..*delta };
                self.push_plain(choice, &none);
            }
            content_tokens = Some(delta.tokens);
        }
        // Content gathered since the last piece, sent before the next one (or at the end).
        let mut run = String::new();
        let mut send_run = |this: &mut Self, run: &mut String| {
            if !run.is_empty() {
                let tokens = content_tokens.take().unwrap_or(&[]);
                this.push_plain(choice, &ChoiceDelta { text: run, tokens, finish: None, stop_reason: None, ..*delta });
                run.clear();
            }
        };
        for event in merge_args(events) {
            if let ToolEvent::Content(c) = &event {
                run.push_str(c);
                continue;
            }
            send_run(self, &mut run);
            let state = &mut self.choices[idx];
            match &event {
                ToolEvent::Content(_) => continue, // (gathered into `run` above)
                ToolEvent::End => {
                    if let Some(call) = state.tool_calls.last_mut() {
                        call.ended = true;
                    }
                    continue;
                }
                ToolEvent::Start { id, name } => state.tool_calls.push(ToolCall {
                    id: id.clone(),
                    name: name.clone(),
                    arguments: String::new(),
                    ended: false,
                }),
                ToolEvent::Args(a) => match state.tool_calls.last_mut() {
                    Some(call) => call.arguments.push_str(a),
                    None => continue,
                },
            }
            if !self.stream {
                continue;
            }
            let index = self.choices[idx].tool_calls.len() - 1;
            let (id, function) = match &event {
                ToolEvent::Start { id, name } => (Some(id.as_str()), FunctionDelta { name: Some(name), arguments: "" }),
                ToolEvent::Args(a) => (None, FunctionDelta { name: None, arguments: a }),
                _ => unreachable!("skipped above"),
            };
            let delta = if self.functions() {
                Delta { function_call: Some(function), ..Delta::default() }
            } else {
                let kind = id.map(|_| "function");
                Delta { tool_calls: Some(vec![ToolCallDelta { index, id, kind, function }]), ..Delta::default() }
            };
            let c = ChatChunkChoice {
                index: choice,
                delta,
                logprobs: pending_lp.take(),
                finish_reason: None,
                stop_reason: None,
                token_ids: self.take_ids(idx),
            };
            let usage = self.chunk_usage();
            self.frame(vec![c], usage);
        }
        send_run(self, &mut run);
        if let (true, Some(f)) = (self.stream, finish) {
            // an auto answer that ended with neither text nor calls: its content is "", as
            // the non-streamed message's (the role chunk held it back)
            let state = &self.choices[idx];
            let forced = self.tools.as_ref().is_some_and(|t| t.choice.is_forced());
            let thought = state.reasoning.as_ref().is_some_and(|r| r.reasoning_tokens() > 0);
            let silent = !state.streamed_text && state.tool_calls.is_empty();
            let empty = !forced && silent && !thought;
            let c = ChatChunkChoice {
                index: choice,
                delta: Delta { content: empty.then_some(""), ..Delta::default() },
                // (empty ones for a choice that listed no token, as above)
                logprobs: pending_lp.take().or_else(|| (self.logprobs && silent).then(ChatLogprobs::default)),
                finish_reason: Some(self.finish_name(f)),
                stop_reason: Some(stop_reason),
                token_ids: self.take_ids(idx),
            };
            let usage = self.chunk_usage();
            self.frame(vec![c], usage);
        }
        let state = &mut self.choices[idx];
        state.finish = finish;
        state.stop_reason = stop_reason.map(OwnedStop::of);
    }

    /// `best_of`: a token choice `choice` sampled, with its logprob (every sampled token, the
    /// one that ends the choice too; only `best_of` requests have them computed).
    pub fn score(&mut self, choice: u32, logprob: f32) {
        if let Some(c) = self.choices.get_mut(choice as usize).filter(|_| self.best_of.is_some()) {
            c.score.0 += f64::from(logprob);
            c.score.1 += 1;
        }
    }

    /// The choices the body returns, in order: all of them, or under `best_of` each
    /// prompt's `n` with the highest mean logprob per token (ties: the earlier).
    fn returned(&self) -> Vec<usize> {
        let Some(best) = self.best_of else { return (0..self.choices.len()).collect() };
        let mean = |i: &usize| {
            let (sum, count) = self.choices[*i].score;
            // (a choice that sampled nothing ranks last; NaN ranks below everything)
            if count == 0 || sum.is_nan() {
                f64::NEG_INFINITY
            } else {
                sum / f64::from(count)
            }
        };
        let per_prompt = self.n as usize;
        let mut out = Vec::with_capacity(self.prompt_texts.len() * best.n as usize);
        for start in (0..self.choices.len()).step_by(per_prompt) {
            let mut ranked: Vec<usize> = (start..start + per_prompt).collect();
            ranked.sort_by(|a, b| mean(b).total_cmp(&mean(a)));
            out.extend(ranked.into_iter().take(best.n as usize));
        }
        out
    }

    /// Whether the request used the deprecated `functions` API (its call is a `function_call`).
    fn functions(&self) -> bool {
        self.tools.as_ref().is_some_and(|t| t.functions)
    }

    /// A chat choice's `finish_reason`: a call's is `"function_call"` under the deprecated
    /// `functions` API.
    fn finish_name(&self, finish: FinishReason) -> &'static str {
        match finish {
            FinishReason::ToolCalls if self.functions() => "function_call",
            other => other.as_str(),
        }
    }

    /// Whether `choice`'s tokens must be pushed one by one: the builder may end it itself, at
    /// its one allowed tool call's end (`parallel_tool_calls: false`), and its sequence must
    /// stop at that token.
    pub fn pushes_each_token(&self, choice: u32) -> bool {
        let parallel = self.tools.as_ref().is_some_and(|t| t.parallel);
        !parallel && self.choices.get(choice as usize).is_some_and(|c| c.parser.is_some())
    }

    /// Whether the output goes out as it comes (SSE, or a background response's events).
    pub fn streams(&self) -> bool {
        self.stream
    }

    /// Whether a choice has ended (the builder may end one itself: a completed tool call
    /// under `parallel_tool_calls: false`).
    pub fn choice_finished(&self, choice: u32) -> bool {
        self.choices.get(choice as usize).is_some_and(|c| c.finish.is_some())
    }

    /// SSE frames ready now (streaming); empty when not streaming.
    pub fn take(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.pending)
    }

    /// How a choice ended, once it has.
    pub fn finish_reason(&self, choice: u32) -> Option<FinishReason> {
        self.choices.get(choice as usize).and_then(|c| c.finish)
    }

    pub fn all_finished(&self) -> bool {
        self.choices.iter().all(|c| c.finish.is_some())
    }

    /// Each choice's finish reason (`stop` while it runs) and completion tokens, in order.
    pub fn choice_ends(&self) -> Vec<(&'static str, u32)> {
        let reason = |c: &ChoiceState| c.finish.map_or("stop", FinishReason::as_str);
        self.choices.iter().map(|c| (reason(c), c.completion_tokens.min(u64::from(u32::MAX)) as u32)).collect()
    }

    /// A finished chat choice's content, calls and finish. A call cut off by `max_tokens`
    /// keeps what it had (as OpenAI), and so does one a stop string or stop token cut off (the
    /// finish names it, and the stream has sent the same call); one that ended, or that EOS
    /// cut off, must hold JSON arguments, or (under "auto") the whole text is the content.
    fn resolved<'s>(&self, c: &'s ChoiceState) -> (&'s str, &'s [ToolCall], Option<FinishReason>) {
        let forced = self.tools.as_ref().is_some_and(|t| t.choice.is_forced());
        let cut = matches!(c.finish, Some(FinishReason::Length | FinishReason::Repetition))
            || (c.finish == Some(FinishReason::Stop) && c.stop_reason.is_some());
        let broken = !forced && c.tool_calls.iter().any(|t| (t.ended || !cut) && !t.parses());
        if broken {
            let finish = c.finish.map(|f| if f == FinishReason::ToolCalls { FinishReason::Stop } else { f });
            (c.raw.as_str(), &[][..], finish)
        } else {
            (c.text.as_str(), &c.tool_calls[..], c.finish)
        }
    }

    /// A Responses request's usage: its one choice's tokens.
    fn responses_usage(&self) -> Value {
        let u = self.usage();
        let reasoning = u.completion_tokens_details.map_or(0, |d| d.reasoning_tokens);
        responses::usage(u.prompt_tokens, u.prompt_tokens_details.cached_tokens, u.completion_tokens, reasoning)
    }

    /// A Responses request's `response` object: its choice's reasoning, text and calls as
    /// output items (an answer with none of them is one message with empty text).
    fn responses_body(&self, echo: &crate::protocol::responses::Echo) -> Vec<u8> {
        let c = &self.choices[0];
        let (text, calls, finish) = self.resolved(c);
        let status = if finish == Some(FinishReason::Length) { "incomplete" } else { "completed" };
        let mut items = Vec::new();
        if !c.reasoning_text.is_empty() {
            items.push(responses::Item::reasoning(&c.reasoning_text));
        }
        let mut message = None;
        if !text.is_empty() || (calls.is_empty() && items.is_empty()) {
            message = Some(items.len());
            items.push(responses::Item::message(text, c.chat_lp.content.clone()));
        }
        let first_call = items.len();
        items.extend(calls.iter().map(|t| responses::Item::call(&t.id, &t.name, &t.arguments)));
        let logprobs = self.logprobs;
        // The item being written when the output was cut off: a call not ended, else the
        // message (the body lists it before the calls, wherever its text came), else the last.
        let cut = calls.iter().rposition(|t| !t.ended).map(|i| first_call + i).or(message).unwrap_or(items.len() - 1);
        let output = items
            .iter()
            .enumerate()
            .map(|(i, item)| item.to_value(if i == cut { status } else { "completed" }, logprobs))
            .collect();
        let object = responses::response_object(
            &self.id,
            self.created,
            &self.model,
            echo,
            finish.or(Some(FinishReason::Stop)),
            output,
            self.responses_usage(),
        );
        responses::keep(echo, &self.id, &object);
        serde_json::to_vec(&object).expect("bodies serialize")
    }

    /// A Messages request's token counts: its one choice's.
    fn message_counts(&self) -> messages::Counts {
        let u = self.usage();
        messages::Counts {
            prompt: u.prompt_tokens,
            cached: u.prompt_tokens_details.cached_tokens,
            output: u.completion_tokens,
            thinking: u.completion_tokens_details.map(|d| d.reasoning_tokens),
        }
    }

    /// A Messages request's `message`: its choice's thinking, text and calls as content
    /// blocks. A call cut off by `max_tokens` is still a `tool_use` block, as Anthropic's
    /// (with the input its arguments parse to, else `{}`).
    fn messages_body(&self) -> Vec<u8> {
        let c = &self.choices[0];
        let (text, calls, finish) = self.resolved(c);
        let mut content = Vec::new();
        if !c.reasoning_text.is_empty() {
            content.push(messages::thinking_block(&c.reasoning_text));
        }
        if !text.is_empty() {
            content.push(messages::text_block(text));
        }
        content.extend(calls.iter().map(|t| messages::tool_use_block(&t.id, &t.name, Some(&t.arguments))));
        let finish = finish.map_or("stop", FinishReason::as_str);
        let stop = messages::stop(finish, c.stop_reason.as_ref().map(OwnedStop::as_ref), messages_calls(calls));
        let usage = messages::usage(self.message_counts());
        let object = messages::message_object(&self.id, &self.model, content, Some(stop), usage);
        serde_json::to_vec(&object).expect("bodies serialize")
    }

    /// Streaming: anything not yet taken, the usage chunk (`include_usage`) and
    /// `data: [DONE]` (once; later calls return nothing). Not streaming: the JSON body.
    pub fn finish(&mut self) -> Vec<u8> {
        if self.stream {
            if self.done {
                return Vec::new();
            }
            self.done = true;
            if self.messages.is_some() {
                let counts = self.message_counts();
                if let Some(events) = self.messages.as_mut() {
                    events.end(&mut self.pending, counts);
                }
                // (Anthropic's stream ends with `message_stop`, without `[DONE]`)
                return self.take();
            }
            if self.responses.is_some() {
                let usage = self.responses_usage();
                let (id, created, model) = (&self.id, self.created, &self.model);
                if let Some((echo, events)) = self.responses.as_mut() {
                    events.end(&mut self.pending, |finish, output| {
                        let object = responses::response_object(id, created, model, echo, finish, output, usage);
                        responses::keep(echo, id, &object);
                        object
                    });
                }
                // (OpenAI's Responses stream ends with its last event, without `[DONE]`)
                return self.take();
            }
            if self.include_usage && self.generate {
                let chunk = generate::Chunk { request_id: &self.id, choices: Vec::new(), usage: Some(self.usage()) };
                generate::frame(&mut self.pending, &chunk);
            } else if self.include_usage {
                let usage = self.usage();
                self.frame::<ChatChunkChoice>(Vec::new(), Some(usage));
            }
            if let Some(keep) = &self.keep {
                keep.put(&self.id, self.whole_body(), self.created);
            }
            let mut out = self.take();
            out.extend_from_slice(SSE_DONE);
            return out;
        }
        if let Some((echo, _)) = &self.responses {
            return self.responses_body(echo);
        }
        if self.messages.is_some() {
            return self.messages_body();
        }
        if let Some(e) = &self.embeddings {
            return e.body(&self.id, self.created, &self.model, self.prompt_tokens);
        }
        if self.generate {
            return self.generate_body();
        }
        let body = self.whole_body();
        if let Some(keep) = &self.keep {
            keep.put(&self.id, body.clone(), self.created);
        }
        body
    }

    /// The body of a chat or completion request not streamed: its choices as gathered
    /// (`whole`), and its usage. (A streamed request's, kept by `store: true`, has no
    /// `token_ids`: its chunks carried them.)
    fn whole_body(&self) -> Vec<u8> {
        let ids = self.return_token_ids && !self.stream;
        let usage = self.usage();
        let body = if self.chat {
            let forced = self.tools.as_ref().is_some_and(|t| t.choice.is_forced());
            let functions = self.functions();
            let choices: Vec<ChatChoice> = self
                .choices
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    let (text, calls, finish) = self.resolved(c);
                    let reasoning = c.reasoning.is_some().then(|| {
                        (!c.reasoning_text.is_empty() && !self.hide_reasoning).then_some(c.reasoning_text.as_str())
                    });
                    ChatChoice {
                        index: i as u32,
                        message: Message {
                            role: "assistant",
                            // null when the output was only calls or only thinking (as vLLM), and
                            // when it could only be calls (forced; cut off before one was whole),
                            // as the stream's deltas sum to
                            content: (!text.is_empty() || (calls.is_empty() && c.reasoning_text.is_empty() && !forced))
                                .then_some(text),
                            refusal: None,
                            reasoning,
                            reasoning_content: reasoning,
                            tool_calls: calls
                                .iter()
                                .filter(|_| !functions)
                                .map(|t| ToolCallOut {
                                    id: &t.id,
                                    kind: "function",
                                    function: Function { name: &t.name, arguments: &t.arguments },
                                })
                                .collect(),
                            // (one call at most: the `functions` API makes no parallel calls)
                            function_call: calls
                                .first()
                                .filter(|_| functions)
                                .map(|t| Function { name: &t.name, arguments: &t.arguments }),
                        },
                        logprobs: self.logprobs.then_some(&c.chat_lp),
                        finish_reason: finish.map(|f| self.finish_name(f)),
                        stop_reason: c.stop_reason.as_ref().map(OwnedStop::as_ref),
                        token_ids: ids.then_some(&c.token_ids[..]),
                    }
                })
                .collect();
            serde_json::to_vec(&Body {
                id: &self.id,
                object: "chat.completion",
                created: self.created,
                model: &self.model,
                system_fingerprint: self.system_fingerprint.as_deref(),
                choices,
                usage,
                prompt_token_ids: self.prompt_ids.first().filter(|_| ids).map(Vec::as_slice),
                prompt_logprobs: self.prompt_entries.first().map(Vec::as_slice),
            })
        } else {
            let returned = self.returned();
            let texts: Vec<String> = returned
                .iter()
                .map(|&i| match self.echo.then(|| self.prompt_texts.get(i / self.n as usize)).flatten() {
                    Some(prompt) => format!("{prompt}{}", self.choices[i].text),
                    None => self.choices[i].text.clone(),
                })
                .collect();
            let choices: Vec<CompletionChoice> = returned
                .iter()
                .zip(&texts)
                .enumerate()
                .map(|(index, (&i, text))| (index, i, &self.choices[i], text))
                .map(|(index, i, c, text)| CompletionChoice {
                    index: index as u32,
                    text,
                    logprobs: self.logprobs.then_some(&c.comp_lp),
                    finish_reason: c.finish.map(FinishReason::as_str),
                    stop_reason: c.stop_reason.as_ref().map(OwnedStop::as_ref),
                    prompt_token_ids: self.prompt_ids.get(i / self.n as usize).map(Vec::as_slice),
                    prompt_logprobs: self.prompt_entries.get(i / self.n as usize).map(Vec::as_slice),
                    token_ids: ids.then_some(&c.token_ids[..]),
                })
                .collect();
            serde_json::to_vec(&Body {
                id: &self.id,
                object: "text_completion",
                created: self.created,
                model: &self.model,
                system_fingerprint: self.system_fingerprint.as_deref(),
                choices,
                usage,
                prompt_token_ids: None,
                prompt_logprobs: None,
            })
        };
        body.expect("bodies serialize")
    }
}

/// One call of a choice; `arguments` is the JSON text of its arguments.
#[derive(Debug)]
struct ToolCall {
    id: String,
    name: String,
    arguments: String,
    /// The call completed (one cut off by the output's end keeps what it had).
    ended: bool,
}

impl ToolCall {
    /// Whether the arguments are a JSON object.
    fn parses(&self) -> bool {
        serde_json::from_str::<serde_json::Value>(&self.arguments).is_ok_and(|v| v.is_object())
    }
}

/// Consecutive argument fragments as one (fewer stream chunks, same concatenation).
fn merge_args(events: Vec<ToolEvent>) -> Vec<ToolEvent> {
    let mut out: Vec<ToolEvent> = Vec::with_capacity(events.len());
    for e in events {
        match (out.last_mut(), e) {
            (Some(ToolEvent::Args(prev)), ToolEvent::Args(a)) => prev.push_str(&a),
            (_, e) => out.push(e),
        }
    }
    out
}

/// Where each prompt token's text starts in the echoed prompt `text`, in chars: the text
/// decoded before it, so the bytes of one multi-byte character (several byte-level tokens)
/// all start where that character does, and offsets never run past the text or go backwards.
/// A special token the text does not hold where it stands takes no width: one the tokenizer
/// added around a text prompt (a BOS), which the echo, the prompt as sent, leaves out.
fn prompt_offsets(tokenizer: &Arc<Tokenizer>, ids: &[u32], text: &str) -> Vec<usize> {
    let mut d = Detokenizer::new(tokenizer.clone(), &[], StopConfig::default());
    ids.iter()
        .map(|&id| {
            let at = d.decoded_len();
            let absent = tokenizer.is_special(id) && {
                let rest = text.char_indices().nth(at).map_or("", |(i, _)| &text[i..]);
                !rest.starts_with(&tokenizer.decode(&[id], false))
            };
            if !absent {
                d.push(id);
            }
            at
        })
        .collect()
}

/// A token as logprobs name it: its text, or with `return_tokens_as_token_ids` `token_id:<id>`
/// (vLLM's form, which keeps tokens whose text is not whole UTF-8 apart).
fn shown(tokenizer: &Tokenizer, id: u32, as_id: bool) -> String {
    if as_id {
        format!("token_id:{id}")
    } else {
        tokenizer.token_str(id)
    }
}

/// What a Messages answer's calls are, for its `stop_reason`.
fn messages_calls(calls: &[ToolCall]) -> messages::Calls {
    match calls {
        [] => messages::Calls::None,
        _ if calls.iter().all(|t| t.ended) => messages::Calls::Whole,
        _ => messages::Calls::Cut,
    }
}

/// Completions that echo the prompt with logprobs also return the prompt's logprobs.
fn echo_logprobs(prepared: &Prepared) -> bool {
    prepared.echo && prepared.endpoint == Endpoint::Completion && prepared.shown_logprobs().is_some()
}

#[derive(Serialize)]
struct Body<'a, C> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    system_fingerprint: Option<&'a str>,
    choices: Vec<C>,
    usage: Usage,
    /// Chat with `return_token_ids`: the rendered prompt's ids (completions give each
    /// choice's).
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt_token_ids: Option<&'a [u32]>,
    /// Chat with vLLM's `prompt_logprobs`: the rendered prompt's entries (completions give
    /// each choice's).
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt_logprobs: Option<&'a [Option<PromptEntry>]>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(id: u32, text_offset: usize) -> TokenOut {
        TokenOut { id, logprob: -1.0, top: Vec::new(), text_offset }
    }

    fn push(u: &mut UnsentDelta, id: u32, text: &str, finish: Option<FinishReason>) {
        let stop = finish.map(|_| StopReason::Text("."));
        u.add(text, vec![token(id, id as usize)], &[id], finish, stop);
    }

    #[test]
    fn unsent_output_goes_first_then_by_interval_then_at_the_end() {
        let mut u = UnsentDelta::default();
        assert!(!u.due(1), "nothing held");
        push(&mut u, 1, "a", None);
        assert!(u.due(4), "the first tokens go at once");
        u.clear();
        push(&mut u, 2, "b", None);
        push(&mut u, 3, "", None); // (text held back: the token still counts)
        assert!(!u.due(4) && u.due(2));
        push(&mut u, 4, "cd", None);
        let d = u.delta();
        assert_eq!((d.text, d.ids, d.tokens.len(), d.finish), ("bcd", &[2, 3, 4][..], 3, None));
        push(&mut u, 5, "e", Some(FinishReason::Stop));
        assert!(u.due(100), "the finish goes at once");
        let d = u.delta();
        assert_eq!(
            (d.text, d.ids.len(), d.finish, d.stop_reason),
            ("bcde", 4, Some(FinishReason::Stop), Some(StopReason::Text(".")))
        );
        u.clear();
        push(&mut u, 6, "f", None);
        assert!(!u.due(1) && u.delta().ids.is_empty(), "nothing is added after the finish went out");
    }
}
