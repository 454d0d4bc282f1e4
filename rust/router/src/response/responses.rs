//! The Responses API's answer: a `response` object, or (streamed) its typed events.
//!
//! The builder runs a Responses request as a chat request with one choice; this module turns
//! what that choice produced into Responses' shapes. Streamed, every chat chunk the builder
//! would send is transcoded into events instead ([`EventStream::on_chunk`]):
//!
//! ```text
//! response.created, response.in_progress                      (at the start)
//! per output item, in the order generated:
//!   response.output_item.added
//!   reasoning:     content_part.added, reasoning_text.delta..., reasoning_text.done, content_part.done
//!   message:       content_part.added, output_text.delta...,    output_text.done,    content_part.done
//!   function_call: function_call_arguments.delta..., function_call_arguments.done
//!   response.output_item.done
//! response.completed (or response.incomplete, cut off by `max_output_tokens`)
//! ```
//!
//! Each event is an SSE frame `event: <type>` + `data: <json>` whose JSON carries `type` and
//! a `sequence_number` counting from 0. As OpenAI's, the stream has no `data: [DONE]`. A
//! response with no output at all (an empty answer) has one message item with empty text,
//! streamed and not.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};

use super::{ChatChunkChoice, ChatLogprob, FinishReason};
use crate::item_log;
use crate::protocol::common::{new_id, unix_now};
use crate::protocol::responses::Echo;
use crate::response_store::Stored;

/// An item id: OpenAI's prefixes (`msg_`, `rs_`, `fc_`) and a random hex.
fn item_id(prefix: &str) -> String {
    new_id(prefix).replacen('-', "_", 1)
}

/// One output item, as it stands.
#[derive(Clone, Debug)]
pub(super) enum Item {
    Reasoning { id: String, text: String },
    Message { id: String, text: String, logprobs: Vec<ChatLogprob> },
    FunctionCall { id: String, call_id: String, name: String, arguments: String },
}

impl Item {
    fn id(&self) -> &str {
        match self {
            Self::Reasoning { id, .. } | Self::Message { id, .. } | Self::FunctionCall { id, .. } => id,
        }
    }

    pub(super) fn reasoning(text: &str) -> Self {
        Self::Reasoning { id: item_id("rs"), text: text.to_string() }
    }

    pub(super) fn message(text: &str, logprobs: Vec<ChatLogprob>) -> Self {
        Self::Message { id: item_id("msg"), text: text.to_string(), logprobs }
    }

    pub(super) fn call(call_id: &str, name: &str, arguments: &str) -> Self {
        Self::FunctionCall {
            id: item_id("fc"),
            call_id: call_id.to_string(),
            name: name.to_string(),
            arguments: arguments.to_string(),
        }
    }

    /// The item's content part (reasoning and messages have one).
    fn part(&self, logprobs: bool) -> Option<Value> {
        match self {
            Self::Reasoning { text, .. } => Some(json!({"type": "reasoning_text", "text": text})),
            Self::Message { text, logprobs: lps, .. } => {
                let mut part = json!({"type": "output_text", "text": text, "annotations": []});
                if logprobs {
                    part["logprobs"] = serde_json::to_value(lps).expect("logprobs serialize");
                }
                Some(part)
            }
            Self::FunctionCall { .. } => None,
        }
    }

    /// The item as the `response` object lists it; `status`: "in_progress", "completed" or
    /// "incomplete".
    pub(super) fn to_value(&self, status: &str, logprobs: bool) -> Value {
        match self {
            Self::Reasoning { id, .. } => {
                let content = if status == "in_progress" { json!([]) } else { json!([self.part(logprobs)]) };
                json!({"type": "reasoning", "id": id, "summary": [], "content": content, "status": status})
            }
            Self::Message { id, .. } => {
                let content = if status == "in_progress" { json!([]) } else { json!([self.part(logprobs)]) };
                json!({"type": "message", "id": id, "status": status, "role": "assistant", "content": content})
            }
            Self::FunctionCall { id, call_id, name, arguments } => json!({
                "type": "function_call",
                "id": id,
                "call_id": call_id,
                "name": name,
                "arguments": if status == "in_progress" { "" } else { arguments.as_str() },
                "status": status,
            }),
        }
    }
}

/// The `response` object: `output` and `usage` (null while in progress) as given, the rest
/// from the request (`echo`) and its status.
pub(super) fn response_object(
    id: &str,
    created: u64,
    model: &str,
    echo: &Echo,
    finish: Option<FinishReason>,
    output: Vec<Value>,
    usage: Value,
) -> Value {
    let (status, incomplete) = match finish {
        None => ("in_progress", Value::Null),
        Some(FinishReason::Length) => ("incomplete", json!({"reason": "max_output_tokens"})),
        Some(_) => ("completed", Value::Null),
    };
    let mut object = Map::new();
    object.insert("id".into(), json!(id));
    object.insert("object".into(), json!("response"));
    object.insert("created_at".into(), json!(created));
    object.insert("status".into(), json!(status));
    object.insert("background".into(), json!(echo.background.is_some()));
    object.insert("completed_at".into(), if status == "completed" { json!(unix_now()) } else { Value::Null });
    object.insert("error".into(), Value::Null);
    object.insert("incomplete_details".into(), incomplete);
    object.insert("model".into(), json!(model));
    object.insert("output".into(), Value::Array(output));
    for (k, v) in &echo.fields {
        object.insert(k.clone(), v.clone());
    }
    object.insert("usage".into(), usage);
    Value::Object(object)
}

/// Stores a finished response, when its request asked for that (`store`), and adds its input
/// and output items to its conversation (`conversation`).
pub(super) fn keep(echo: &Echo, id: &str, object: &Value) {
    let joins = echo.conversation.as_ref().and_then(|j| Some((j, j.lease.as_ref()?)));
    if echo.store.is_none() && joins.is_none() {
        return;
    }
    // (the output items are shared by the stored response and the conversation)
    let output: Vec<Arc<item_log::Item>> =
        object["output"].as_array().map_or_else(Vec::new, |o| o.iter().map(item_log::Item::new).collect());
    match (&echo.store, &echo.background) {
        (Some((_, input)), Some(run)) => run.finish(Stored::new(object, input.clone(), output.clone())),
        (Some((store, input)), None) => store.put(id, Stored::new(object, input.clone(), output.clone())),
        (None, _) => {}
    }
    if let Some((joins, lease)) = joins {
        lease.finish(joins.input.iter().cloned().chain(output).collect());
    }
}

/// The usage of a response: OpenAI's `input_tokens`/`output_tokens` names for chat's counts.
pub(super) fn usage(input: u64, cached: u64, output: u64, reasoning: u64) -> Value {
    json!({
        "input_tokens": input,
        // (`cache_write_tokens`: OpenAI's explicit prompt caching, which has no counterpart here)
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": input + output,
    })
}

/// How often a background response's stored object is brought up to date with its output so
/// far (what `GET` shows while it runs, and what a cancel keeps).
const SNAPSHOT_EVERY: Duration = Duration::from_millis(100);

/// A streamed response's events so far.
pub(super) struct EventStream {
    seq: u64,
    /// A background response's object as it goes `in_progress`, until its first output.
    queued: Option<Value>,
    /// The items, in output order; the last is open until `closed` says otherwise.
    items: Vec<Item>,
    open: bool,
    /// How the one choice ended, once it has.
    finish: Option<FinishReason>,
    logprobs: bool,
    /// Logprobs of tokens that showed no text yet (the first bytes of a character), sent with
    /// the message's next delta (or an empty one as it closes).
    pending_lp: Vec<ChatLogprob>,
    /// When the output so far was last taken ([`Self::snapshot`]).
    snapshot_at: Option<Instant>,
    /// A background response's object while it runs (output left out): what a snapshot fills.
    running: Option<Value>,
}

impl EventStream {
    pub(super) fn new(logprobs: bool) -> Self {
        Self {
            seq: 0,
            queued: None,
            items: Vec::new(),
            open: false,
            finish: None,
            logprobs,
            pending_lp: Vec::new(),
            snapshot_at: None,
            running: None,
        }
    }

    /// A background response's object with its output so far, if there is some and the last
    /// was taken `SNAPSHOT_EVERY` ago (or never): the items closed as they closed, the open one
    /// `in_progress` with what it holds.
    pub(super) fn snapshot(&mut self) -> Option<Value> {
        let running = self.running.as_ref()?;
        if self.items.is_empty() || self.snapshot_at.is_some_and(|at| at.elapsed() < SNAPSHOT_EVERY) {
            return None;
        }
        self.snapshot_at = Some(Instant::now());
        let open = self.open.then(|| self.index());
        let items = self.items.iter().enumerate().map(|(i, item)| {
            let mut value = item.to_value("completed", self.logprobs);
            if Some(i) == open {
                value["status"] = json!("in_progress");
            }
            value
        });
        Some(with(running, "output", Value::Array(items.collect())))
    }

    /// The output so far, as a response that ended here lists it: the items closed as they
    /// closed, the open one `incomplete` with what it holds.
    pub(super) fn output_so_far(&self) -> Vec<Value> {
        let open = self.open.then(|| self.index());
        let items = self.items.iter().enumerate();
        items
            .map(|(i, item)| item.to_value(if Some(i) == open { "incomplete" } else { "completed" }, self.logprobs))
            .collect()
    }

    /// Queues one event: `event: <type>` and its JSON with `type` and `sequence_number`.
    fn event(&mut self, out: &mut Vec<u8>, kind: &str, mut data: Value) {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.seq);
        self.seq += 1;
        super::sse_frame(out, Some(kind), &serde_json::to_vec(&data).expect("events serialize"));
    }

    /// `response.created` and `response.in_progress`; for a response `queued` (background),
    /// `response.created` and `response.queued`, and `response.in_progress` at its first output
    /// ([`Self::progress`]).
    pub(super) fn start(&mut self, out: &mut Vec<u8>, response: Value) {
        self.event(out, "response.created", json!({"response": response}));
        if response["status"] == "queued" {
            self.event(out, "response.queued", json!({"response": response}));
            self.queued = Some(with(&response, "status", json!("in_progress")));
            self.running = self.queued.clone();
        } else {
            self.event(out, "response.in_progress", json!({"response": response}));
        }
    }

    /// A queued response's first output is coming: `response.in_progress`; whether it was
    /// queued until now.
    pub(super) fn progress(&mut self, out: &mut Vec<u8>) -> bool {
        let Some(response) = self.queued.take() else { return false };
        self.event(out, "response.in_progress", json!({"response": response}));
        true
    }

    /// The `sequence_number` the next event gets.
    pub(super) fn next_sequence(&self) -> u64 {
        self.seq
    }

    /// `response.failed`, with the failed `response`.
    pub(super) fn failed(&mut self, out: &mut Vec<u8>, response: Value) {
        self.event(out, "response.failed", json!({"response": response}));
    }

    fn index(&self) -> usize {
        self.items.len() - 1
    }

    /// Opens `item` (closing the open one).
    fn open(&mut self, out: &mut Vec<u8>, item: Item) {
        self.close(out, "completed");
        self.items.push(item);
        self.open = true;
        let index = self.index();
        let added = self.items[index].to_value("in_progress", self.logprobs);
        self.event(out, "response.output_item.added", json!({"output_index": index, "item": added}));
        let item = &self.items[index];
        let empty = match item {
            Item::Reasoning { .. } => Some(Item::Reasoning { id: String::new(), text: String::new() }),
            Item::Message { .. } => {
                Some(Item::Message { id: String::new(), text: String::new(), logprobs: Vec::new() })
            }
            Item::FunctionCall { .. } => None,
        };
        if let Some(part) = empty.and_then(|e| e.part(self.logprobs)) {
            let id = item.id().to_string();
            self.event(
                out,
                "response.content_part.added",
                json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
            );
        }
    }

    /// Closes the open item, if any, with `status`.
    fn close(&mut self, out: &mut Vec<u8>, status: &str) {
        if !self.open {
            return;
        }
        self.open = false;
        let index = self.index();
        if matches!(self.items[index], Item::Message { .. }) && !self.pending_lp.is_empty() {
            // the last tokens' logprobs, whose text never came (cut inside a character)
            self.text_delta(out, "");
        }
        let item = self.items[index].clone();
        let id = item.id().to_string();
        match &item {
            Item::Reasoning { text, .. } => {
                let at = json!({"item_id": id, "output_index": index, "content_index": 0});
                self.event(out, "response.reasoning_text.done", with(&at, "text", json!(text)));
                let part = item.part(self.logprobs).expect("reasoning has a part");
                self.event(out, "response.content_part.done", with(&at, "part", part));
            }
            Item::Message { text, logprobs, .. } => {
                let at = json!({"item_id": id, "output_index": index, "content_index": 0});
                let mut done = with(&at, "text", json!(text));
                done["logprobs"] = serde_json::to_value(logprobs).expect("logprobs serialize");
                self.event(out, "response.output_text.done", done);
                let part = item.part(self.logprobs).expect("messages have a part");
                self.event(out, "response.content_part.done", with(&at, "part", part));
            }
            Item::FunctionCall { name, arguments, .. } => {
                let done = json!({"item_id": id, "output_index": index, "name": name, "arguments": arguments});
                self.event(out, "response.function_call_arguments.done", done);
            }
        }
        let value = item.to_value(status, self.logprobs);
        self.event(out, "response.output_item.done", json!({"output_index": index, "item": value}));
    }

    /// An `output_text.delta` of the open message: `text` and the logprobs held so far.
    fn text_delta(&mut self, out: &mut Vec<u8>, text: &str) {
        let index = self.index();
        let logprobs = std::mem::take(&mut self.pending_lp);
        if let Some(Item::Message { id, text: all, logprobs: lps }) = self.items.last_mut() {
            all.push_str(text);
            lps.extend(logprobs.iter().cloned());
            let id = id.clone();
            let mut delta = json!({"item_id": id, "output_index": index, "content_index": 0, "delta": text});
            delta["logprobs"] = serde_json::to_value(&logprobs).expect("logprobs serialize");
            self.event(out, "response.output_text.delta", delta);
        }
    }

    /// One chat chunk of the choice, as events.
    pub(super) fn on_chunk(&mut self, out: &mut Vec<u8>, c: &ChatChunkChoice) {
        if let Some(text) = c.delta.reasoning_content.filter(|t| !t.is_empty()) {
            if !(self.open && matches!(self.items.last(), Some(Item::Reasoning { .. }))) {
                self.open(out, Item::reasoning(""));
            }
            let index = self.index();
            if let Some(Item::Reasoning { id, text: all }) = self.items.last_mut() {
                all.push_str(text);
                let id = id.clone();
                self.event(
                    out,
                    "response.reasoning_text.delta",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "delta": text}),
                );
            }
        }
        // (a chunk with call pieces carries the logprobs of the tokens that spelled the call,
        // which have no place in a function_call item)
        if c.delta.tool_calls.is_none() {
            self.pending_lp.extend(c.logprobs.iter().flat_map(|l| l.content.iter().cloned()));
        }
        let text = c.delta.content.unwrap_or_default();
        if !text.is_empty() {
            if !(self.open && matches!(self.items.last(), Some(Item::Message { .. }))) {
                self.open(out, Item::message("", Vec::new()));
            }
            self.text_delta(out, text);
        }
        for call in c.delta.tool_calls.iter().flatten() {
            if let (Some(call_id), Some(name)) = (call.id, call.function.name) {
                self.open(out, Item::call(call_id, name, ""));
            }
            if call.function.arguments.is_empty() {
                continue;
            }
            let index = self.index();
            if let (true, Some(Item::FunctionCall { id, arguments, .. })) = (self.open, self.items.last_mut()) {
                arguments.push_str(call.function.arguments);
                let id = id.clone();
                let delta = json!({"item_id": id, "output_index": index, "delta": call.function.arguments});
                self.event(out, "response.function_call_arguments.delta", delta);
            }
        }
        if let Some(finish) = c.finish_reason {
            let finish = match finish {
                "length" => FinishReason::Length,
                "tool_calls" => FinishReason::ToolCalls,
                _ => FinishReason::Stop,
            };
            self.finish = Some(finish);
            if self.items.is_empty() {
                // an empty answer is still a message, as the body's
                self.open(out, Item::message("", Vec::new()));
            }
            let status = if finish == FinishReason::Length { "incomplete" } else { "completed" };
            self.close(out, status);
        }
    }

    /// The final event: `response.completed` (or `response.incomplete`) with the whole
    /// response, built by `object` from the finish and the items.
    pub(super) fn end(&mut self, out: &mut Vec<u8>, object: impl FnOnce(Option<FinishReason>, Vec<Value>) -> Value) {
        self.progress(out);
        self.close(out, "completed");
        let finish = self.finish.or(Some(FinishReason::Stop));
        let status = if finish == Some(FinishReason::Length) { "incomplete" } else { "completed" };
        let items = self.items.iter().enumerate().map(|(i, item)| {
            // only the last item can have been cut off
            let last = i + 1 == self.items.len();
            item.to_value(if last { status } else { "completed" }, self.logprobs)
        });
        let response = object(finish, items.collect());
        let kind = if status == "incomplete" { "response.incomplete" } else { "response.completed" };
        self.event(out, kind, json!({"response": response}));
    }
}

/// `base` (an object) with `key` set to `value`.
fn with(base: &Value, key: &str, value: Value) -> Value {
    let mut v = base.clone();
    v[key] = value;
    v
}
