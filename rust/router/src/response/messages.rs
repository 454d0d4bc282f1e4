//! Anthropic's Messages API answer: a `message` object, or (streamed) its events.
//!
//! The builder runs a Messages request as a chat request with one choice; this module turns
//! what that choice produced into a `message`'s content blocks (`thinking`, `text`,
//! `tool_use`), its `stop_reason` and its `usage`. Streamed, every chat chunk is transcoded
//! into events ([`EventStream::on_chunk`]):
//!
//! ```text
//! message_start                          (with the first output, or at the end if none came)
//! per content block, in the order generated:
//!   content_block_start
//!   thinking: thinking_delta...   text: text_delta...   tool_use: input_json_delta...
//!   content_block_stop
//! message_delta                          (stop_reason, stop_sequence, the whole usage)
//! message_stop
//! ```
//!
//! Each event is an SSE frame `event: <type>` + `data: <json>` whose JSON carries `type`; as
//! Anthropic's, the stream has no `data: [DONE]`. `stop_reason`: `end_turn` (the model ended
//! its turn, or a stop token id ended it), `stop_sequence` (with the `stop_sequence` that
//! matched), `max_tokens`, or `tool_use` when the answer holds a tool call and was not cut
//! off. Usage follows Anthropic's split: `input_tokens` are the prompt tokens the prefix cache
//! did not hold, `cache_read_input_tokens` those it did.

use serde_json::{json, Value};

use super::{ChatChunkChoice, StopReason};

/// Token counts of a message.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Counts {
    pub prompt: u64,
    pub cached: u64,
    pub output: u64,
    /// Of `output`, those inside the think block; None without a reasoning parser.
    pub thinking: Option<u64>,
}

/// The `usage` object: Anthropic's names, the prompt split into uncached and cached tokens.
pub(super) fn usage(c: Counts) -> Value {
    let mut usage = json!({
        "input_tokens": c.prompt - c.cached.min(c.prompt),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": c.cached.min(c.prompt),
        "output_tokens": c.output,
    });
    if let Some(thinking) = c.thinking {
        usage["output_tokens_details"] = json!({"thinking_tokens": thinking});
    }
    usage
}

/// A block's opening shape (`content_block_start`), or its whole shape once done.
pub(super) fn thinking_block(text: &str) -> Value {
    // (no signature: nothing here signs or checks thinking; clients echo it back as sent)
    json!({"type": "thinking", "thinking": text, "signature": ""})
}

pub(super) fn text_block(text: &str) -> Value {
    json!({"type": "text", "text": text})
}

/// A tool_use block; `arguments` is the call's JSON text (an object; anything else, as a
/// call cut off by `max_tokens` leaves it, is an empty input). The chat call's `call_` id
/// is named as Anthropic names its calls, `toolu_`; a Mistral-format id (9 characters, the
/// only ids its templates take back) stays as it is.
pub(super) fn tool_use_block(id: &str, name: &str, arguments: Option<&str>) -> Value {
    let input = arguments
        .and_then(|a| serde_json::from_str::<Value>(a).ok())
        .filter(Value::is_object)
        .unwrap_or_else(|| json!({}));
    let id = match id.strip_prefix("call_") {
        Some(rest) => format!("toolu_{rest}"),
        None => id.to_string(),
    };
    json!({"type": "tool_use", "id": id, "name": name, "input": input})
}

/// What a choice's answer holds of tool calls, for its `stop_reason`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Calls {
    None,
    /// Every call it opened ended.
    Whole,
    /// A call it opened never ended (a stop sequence or `max_tokens` cut it).
    Cut,
}

/// `stop_reason` and `stop_sequence` of a choice that ended with the chat finish `finish`
/// ("stop", "length", "tool_calls") and chat's `stop_reason`, given the calls its answer
/// holds: `tool_use` says the calls are whole, so a stop sequence that cut one is the stop.
pub(super) fn stop(finish: &str, matched: Option<StopReason>, calls: Calls) -> (&'static str, Value) {
    match (finish, matched) {
        ("length", _) => ("max_tokens", Value::Null),
        (_, Some(StopReason::Text(s))) if calls != Calls::Whole => ("stop_sequence", json!(s)),
        _ if calls != Calls::None => ("tool_use", Value::Null),
        _ => ("end_turn", Value::Null),
    }
}

/// The `message` object.
pub(super) fn message_object(
    id: &str,
    model: &str,
    content: Vec<Value>,
    stop: Option<(&str, Value)>,
    usage: Value,
) -> Value {
    let (stop_reason, stop_sequence) = match stop {
        Some((reason, sequence)) => (json!(reason), sequence),
        None => (Value::Null, Value::Null),
    };
    json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": usage,
    })
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Thinking,
    Text,
    ToolUse,
}

/// A streamed message's events so far.
pub(super) struct EventStream {
    id: String,
    model: String,
    started: bool,
    /// Each block's kind, in order; the last is open while `open`.
    blocks: Vec<Kind>,
    open: bool,
    /// How the choice ended (chat's finish), what stop rule matched, once it has.
    finish: Option<(&'static str, Value)>,
}

impl EventStream {
    pub(super) fn new(id: &str, model: &str) -> Self {
        Self {
            id: id.to_string(),
            model: model.to_string(),
            started: false,
            blocks: Vec::new(),
            open: false,
            finish: None,
        }
    }

    /// Queues one event: `event: <type>` and its JSON with `type`.
    fn event(out: &mut Vec<u8>, kind: &str, mut data: Value) {
        data["type"] = json!(kind);
        super::sse_frame(out, Some(kind), &serde_json::to_vec(&data).expect("events serialize"));
    }

    /// `message_start`, once: the message with no content yet, and its input usage.
    fn start(&mut self, out: &mut Vec<u8>, counts: Counts) {
        if self.started {
            return;
        }
        self.started = true;
        let message = message_object(&self.id, &self.model, Vec::new(), None, usage(counts));
        Self::event(out, "message_start", json!({"message": message}));
    }

    fn close(&mut self, out: &mut Vec<u8>) {
        if self.open {
            self.open = false;
            Self::event(out, "content_block_stop", json!({"index": self.blocks.len() - 1}));
        }
    }

    /// Opens a block of `kind` whose opening shape is `block` (closing the open one).
    fn open(&mut self, out: &mut Vec<u8>, kind: Kind, block: Value) {
        self.close(out);
        self.blocks.push(kind);
        self.open = true;
        Self::event(out, "content_block_start", json!({"index": self.blocks.len() - 1, "content_block": block}));
    }

    /// A delta of the open block of `kind` (opened with `empty` when another one is open).
    fn delta(&mut self, out: &mut Vec<u8>, kind: Kind, delta: Value) {
        if !(self.open && self.blocks.last() == Some(&kind)) {
            let empty = match kind {
                Kind::Thinking => thinking_block(""),
                _ => text_block(""),
            };
            self.open(out, kind, empty);
        }
        Self::event(out, "content_block_delta", json!({"index": self.blocks.len() - 1, "delta": delta}));
    }

    /// Whether `message_start` has gone out (until it has, each chunk needs the usage so far).
    pub(super) fn started(&self) -> bool {
        self.started
    }

    /// One chat chunk of the choice, as events (`counts`: the usage so far, which
    /// `message_start` carries when this chunk is the first; None once it has gone out).
    /// `calls`: what the answer holds of calls so far.
    pub(super) fn on_chunk(&mut self, out: &mut Vec<u8>, c: &ChatChunkChoice, counts: Option<Counts>, calls: Calls) {
        if let Some(counts) = counts {
            self.start(out, counts);
        }
        if let Some(text) = c.delta.reasoning_content.filter(|t| !t.is_empty()) {
            self.delta(out, Kind::Thinking, json!({"type": "thinking_delta", "thinking": text}));
        }
        if let Some(text) = c.delta.content.filter(|t| !t.is_empty()) {
            self.delta(out, Kind::Text, json!({"type": "text_delta", "text": text}));
        }
        for call in c.delta.tool_calls.iter().flatten() {
            if let (Some(id), Some(name)) = (call.id, call.function.name) {
                self.open(out, Kind::ToolUse, tool_use_block(id, name, None));
            }
            if !call.function.arguments.is_empty() && self.open && self.blocks.last() == Some(&Kind::ToolUse) {
                let index = self.blocks.len() - 1;
                let delta = json!({"type": "input_json_delta", "partial_json": call.function.arguments});
                Self::event(out, "content_block_delta", json!({"index": index, "delta": delta}));
            }
        }
        if let Some(finish) = c.finish_reason {
            self.close(out);
            let (reason, sequence) = stop(finish, c.stop_reason.flatten(), calls);
            self.finish = Some((reason, sequence));
        }
    }

    /// The last events: `message_delta` with the stop and the whole usage, and `message_stop`.
    pub(super) fn end(&mut self, out: &mut Vec<u8>, counts: Counts) {
        self.start(out, counts);
        self.close(out);
        let (reason, sequence) = self.finish.take().unwrap_or(("end_turn", Value::Null));
        let delta = json!({"stop_reason": reason, "stop_sequence": sequence});
        Self::event(out, "message_delta", json!({"delta": delta, "usage": usage(counts)}));
        Self::event(out, "message_stop", json!({}));
    }
}
