//! `POST /v1/responses`: OpenAI's Responses API, served through the chat pipeline.
//!
//! The request is translated into the chat request it means, which [`super::chat`] then
//! validates, renders and tokenizes as any other; its errors and ignored fields are named
//! back in the Responses request's own terms (`input[2].content[0]`, `max_output_tokens`,
//! `text.format.schema`, `tools[1].parameters`). The answer is a `response` object, or its
//! stream of typed events (built by [`crate::response::ResponseBuilder`]).
//!
//! The translation:
//! - `instructions` -> a first `system` message; `input` (a string, or a list of items) ->
//!   the messages. Message items keep their role (`developer` as chat treats it); their
//!   `input_text`/`output_text` parts become text parts, `refusal` parts stay. A
//!   `function_call` item becomes a tool call of the assistant turn it follows (consecutive
//!   calls, and the text before them, are one turn); a `function_call_output` item a `tool`
//!   message (with the called function's `name` when an earlier item names it); a
//!   `reasoning` item the next assistant turn's `reasoning_content`.
//! - `max_output_tokens` -> `max_completion_tokens`; function `tools` (flat) -> chat's nested
//!   ones (`[]`: none); `tool_choice: {"type": "function", "name"}` -> chat's named choice;
//!   `text.format` -> `response_format`; `include: ["message.output_text.logprobs"]` ->
//!   `logprobs`, with `top_logprobs` alternatives (alone, as OpenAI's, it asks for nothing).
//! - `previous_response_id`: the stored response's conversation (its input items, then its
//!   output items; not its instructions) comes before `input` ([`crate::response_store`]).
//! - Everything else (`model`, `stream`, `temperature`, `top_p`, `user`, the sampling
//!   extensions chat takes) passes through as it is.
//!
//! Decisions:
//! - `store` (OpenAI's default true) keeps the finished response in this process's memory,
//!   within `--responses-store-mib`; with no store it is echoed false (and reported when sent
//!   true). An `item_reference` input item (its `type` may be left out: an `id` alone) is the
//!   stored item with its id, from any stored
//!   response's conversation or output (an unknown id is a 400 `item_not_found` on
//!   `input[i].id`; OpenAI's default store makes every item of a conversation referable).
//! - `background: true` (which needs `store`): the request returns at once with the response
//!   `queued` (streamed: its events as they come, which the client may leave and read again,
//!   `GET /v1/responses/{id}?stream=true&starting_after=N`); the response runs on whether or not
//!   anyone listens, and its stored entry follows it ([`crate::response_store::BackgroundRun`]).
//!   It can be cancelled. A response still running cannot be continued
//!   (`previous_response_id`), as its output is not known yet.
//! - `conversation` (OpenAI's Conversations API, [`super::conversations`]): the conversation's
//!   items come before `input` as `previous_response_id`'s do (the two together are a 400), and
//!   the finished response's input and output items join it, whatever `store` says.
//! - A function tool is `strict` only when it says so (OpenAI's Responses default is true; a
//!   default this server cannot enforce in every tool-call format would be reported on
//!   requests that never sent it).
//! - Chat-only fields (`messages`, `max_tokens`, `response_format`, `n`, ...) are a 400 that
//!   names the Responses field to send instead, as OpenAI refuses them.
//! - `reasoning.effort`/`summary`, `text.verbosity`, `max_tool_calls` (built-in tools only),
//!   `include` entries other than output logprobs, and `stream_options` do nothing here and
//!   are reported.

use std::sync::Arc;

use serde_json::{json, Map, Value};

use super::chat::{missing, require_str, tool_message, unknown_keys_in, CallNames};
use super::common::{
    as_object, check_metadata, invalid_type, kind_of, new_id, parse_body, rename_error, rename_quoted, set,
    settle_ignored, unsupported,
};
use super::{chat, Checked, Endpoint, Handled};
use crate::conversation_store::Lease;
use crate::error::ApiError;
use crate::item_log::{Item, Log};
use crate::response_store::{BackgroundRun, ResponseStore};
use crate::router::Router;

/// The `include` entry that asks for the output text's logprobs.
pub(crate) const LOGPROBS_INCLUDE: &str = "message.output_text.logprobs";

/// Chat Completions fields that have another name (or no meaning) in the Responses API.
const CHAT_ONLY: [(&str, &str); 9] = [
    ("messages", "send the conversation as `input` (and system instructions as `instructions`)"),
    ("max_tokens", "send `max_output_tokens`"),
    ("max_completion_tokens", "send `max_output_tokens`"),
    ("response_format", "send `text.format`"),
    ("n", "the Responses API makes one output per request"),
    ("logprobs", "send `include: [\"message.output_text.logprobs\"]` (and `top_logprobs`)"),
    ("echo", "the Responses API has no echo"),
    ("functions", "send function `tools`"),
    ("function_call", "send `tool_choice`"),
];

/// OpenAI's built-in tool types, none of which this server runs.
const BUILT_IN_TOOLS: [&str; 12] = [
    "web_search",
    "web_search_preview",
    "file_search",
    "computer_use_preview",
    "computer_use",
    "code_interpreter",
    "image_generation",
    "mcp",
    "local_shell",
    "shell",
    "apply_patch",
    "custom",
];

/// The keys of a message item, a function call item and a function call output item that
/// mean something here (`id` and `status` come back with items a client echoes).
const MESSAGE_ITEM_KEYS: [&str; 5] = ["type", "role", "content", "id", "status"];
const CALL_ITEM_KEYS: [&str; 6] = ["type", "call_id", "name", "arguments", "id", "status"];
const OUTPUT_ITEM_KEYS: [&str; 5] = ["type", "call_id", "output", "id", "status"];
const REASONING_ITEM_KEYS: [&str; 6] = ["type", "id", "summary", "content", "encrypted_content", "status"];

/// The request's fields a `response` object echoes back, as the client sent them (or their
/// defaults): `instructions`, `max_output_tokens`, `metadata`, `parallel_tool_calls`,
/// `previous_response_id`, `reasoning`, `store`, `text`, `tool_choice`, `tools`,
/// `top_logprobs`, `truncation`, `user`, `max_tool_calls`, `temperature`, `top_p`; and, for a
/// response to be stored, where and what conversation it answers.
#[derive(Clone, Debug)]
pub struct Echo {
    pub fields: Map<String, Value>,
    /// `store`: the store the finished response goes to, and the conversation it answered
    /// (the continued responses' items, then this request's input, each with an `id`).
    pub store: Option<(Arc<ResponseStore>, Arc<Log>)>,
    /// `conversation`: the conversation the finished response's items join.
    pub conversation: Option<Joins>,
    /// `background: true`: its entry in the store, from its `queued` object on.
    pub background: Option<Arc<BackgroundRun>>,
}

/// The conversation a response belongs to, and the input items that join it (before the
/// response's output items) once the response is done; the response holds it meanwhile
/// (`lease`: None when the request is only counted, `/v1/responses/input_tokens`).
#[derive(Clone, Debug)]
pub struct Joins {
    pub id: String,
    pub input: Vec<Arc<Item>>,
    pub lease: Option<Arc<Lease>>,
}

impl PartialEq for Echo {
    fn eq(&self, other: &Self) -> bool {
        let store = match (&self.store, &other.store) {
            (Some((a, x)), Some((b, y))) => Arc::ptr_eq(a, b) && x.values() == y.values(),
            (a, b) => a.is_none() && b.is_none(),
        };
        let conversation = match (&self.conversation, &other.conversation) {
            (Some(a), Some(b)) => {
                let values = |items: &[Arc<Item>]| items.iter().map(|i| i.value()).collect::<Vec<_>>();
                a.id == b.id && values(&a.input) == values(&b.input)
            }
            (a, b) => a.is_none() && b.is_none(),
        };
        self.fields == other.fields && store && conversation && self.background.is_some() == other.background.is_some()
    }
}

/// An input item as a stored conversation lists it (OpenAI's input item shapes): with an `id`
/// (one of OpenAI's prefixes when the client sent none) and a `status`, only the keys its
/// type has (what was reported as ignored is not kept), and a message's content as parts of
/// its role's types (`input_text`, or an assistant's `output_text` with its `annotations`).
fn listed(item: &Value) -> Value {
    let Some(obj) = item.as_object() else { return item.clone() };
    let kind = match obj.get("type").and_then(Value::as_str) {
        None if obj.contains_key("role") => "message",
        Some(kind) => kind,
        None => "message",
    };
    let known: &[&str] = match kind {
        "function_call" => &CALL_ITEM_KEYS,
        "function_call_output" => &OUTPUT_ITEM_KEYS,
        "reasoning" => &REASONING_ITEM_KEYS,
        _ => &MESSAGE_ITEM_KEYS,
    };
    let mut out: Map<String, Value> = obj
        .iter()
        .filter(|(k, v)| known.contains(&k.as_str()) && !v.is_null())
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    out.insert("type".into(), json!(kind));
    if kind == "message" {
        let assistant = obj.get("role").and_then(Value::as_str) == Some("assistant");
        let text_part = |text: &Value| {
            if assistant {
                json!({"type": "output_text", "text": text, "annotations": []})
            } else {
                json!({"type": "input_text", "text": text})
            }
        };
        let content = match obj.get("content") {
            Some(Value::Array(parts)) => parts
                .iter()
                .map(|part| match part.get("type").and_then(Value::as_str) {
                    Some("refusal") => json!({"type": "refusal", "refusal": part["refusal"]}),
                    _ => text_part(&part["text"]),
                })
                .collect(),
            Some(text) => vec![text_part(text)],
            None => Vec::new(),
        };
        out.insert("content".into(), Value::Array(content));
    }
    if kind != "reasoning" {
        out.entry("status").or_insert_with(|| json!("completed"));
    }
    if !out.contains_key("id") {
        let prefix = match kind {
            "function_call" => "fc",
            "function_call_output" => "fco",
            "reasoning" => "rs",
            _ => "msg",
        };
        out.insert("id".into(), Value::String(new_id(prefix).replacen('-', "_", 1)));
    }
    Value::Object(out)
}

/// Where each chat message came from: its Responses path, and the paths of the items each of
/// its tool calls came from.
#[derive(Default)]
struct Origins {
    messages: Vec<Origin>,
    /// The chat fields the translation added (a tool result's `name`): never reported.
    added: Vec<String>,
}

/// Where one chat message came from.
struct Origin {
    /// The item's path (`input[3]`, `instructions`, `input` for a string input).
    path: String,
    /// The paths of the `function_call` items its tool calls came from.
    calls: Vec<String>,
    /// The item's name for the message's `content` (`output` for a function call's result).
    content: &'static str,
    /// It came from the continued response (`previous_response_id`): nothing about it is
    /// reported, since this request did not send it.
    previous: bool,
}

impl Origins {
    /// A reported chat field in the Responses request's terms: a message's `tool_calls`
    /// (dropped by a template without tool support) are the `function_call` items they came
    /// from.
    fn rename_reported(&self, param: &str) -> Vec<String> {
        let calls = param
            .strip_prefix("messages[")
            .and_then(|rest| rest.strip_suffix("].tool_calls"))
            .and_then(|i| self.messages.get(i.parse::<usize>().ok()?))
            .filter(|origin| !origin.calls.is_empty());
        let index = param.strip_prefix("messages[").and_then(|r| r.split_once(']')).map(|(i, _)| i);
        let from_previous = index.and_then(|i| self.messages.get(i.parse::<usize>().ok()?)).is_some_and(|o| o.previous);
        match calls {
            _ if from_previous => Vec::new(),
            Some(origin) => origin.calls.clone(),
            None => vec![self.rename(param)],
        }
    }

    /// The field whose items come before the input (`conversation`, `previous_response_id`),
    /// if any.
    fn continued(&self) -> Option<&str> {
        self.messages.iter().find(|o| o.previous).map(|o| o.path.as_str())
    }

    /// A chat `param` in the Responses request's terms.
    fn rename(&self, param: &str) -> String {
        if let Some(rest) = param.strip_prefix("messages[") {
            let Some((index, rest)) = rest.split_once(']') else { return "input".into() };
            let Some(origin) = index.parse::<usize>().ok().and_then(|i| self.messages.get(i)) else {
                return "input".into();
            };
            if let Some(call) = rest.strip_prefix(".tool_calls") {
                let at = call.strip_prefix('[').and_then(|c| c.split_once(']'));
                let call_path = at.and_then(|(j, _)| origin.calls.get(j.parse::<usize>().ok()?));
                return match (call_path, at) {
                    (Some(call_path), Some((_, tail))) => {
                        format!("{call_path}{}", tail.strip_prefix(".function").unwrap_or(tail))
                    }
                    _ => origin.calls.first().unwrap_or(&origin.path).clone(),
                };
            }
            // (a function call output's `tool_call_id` is its `call_id`, its `content` its `output`)
            let rest = match rest.strip_prefix(".content") {
                Some(tail) => format!(".{}{tail}", origin.content),
                None => rest.replace(".tool_call_id", ".call_id"),
            };
            return format!("{}{rest}", origin.path);
        }
        if param == "messages" {
            // (the whole conversation, as when the context is too long: what came before the
            // input is the part a client trims)
            return self.continued().unwrap_or("input").into();
        }
        if let Some(rest) = param.strip_prefix("tools[") {
            // tools[i].function.x -> tools[i].x
            if let Some((i, tail)) = rest.split_once(']') {
                return format!("tools[{i}]{}", tail.strip_prefix(".function").unwrap_or(tail));
            }
        }
        if let Some(rest) = param.strip_prefix("response_format") {
            let rest = rest.strip_prefix(".json_schema").unwrap_or(rest);
            return format!("text.format{rest}");
        }
        if let Some(rest) = param.strip_prefix("tool_choice.allowed_tools") {
            // tool_choice.allowed_tools.tools[i].function.name -> tool_choice.tools[i].name
            return format!("tool_choice{}", rest.replace("].function", "]"));
        }
        match param {
            "max_completion_tokens" => "max_output_tokens".into(),
            "tool_choice.function.name" => "tool_choice.name".into(),
            "tool_choice.function" => "tool_choice".into(),
            "logprobs" => "include".into(),
            "reasoning_effort" => "reasoning.effort".into(),
            other => other.into(),
        }
    }

    /// `message` with the chat fields it quotes (`` `tools[0].function.name` ``) renamed, and
    /// chat's wording of the context error.
    fn words(&self, message: String, param: Option<&str>) -> String {
        // (`chat_template_kwargs.messages` names a template variable, not a field)
        if param.is_some_and(|p| p.starts_with("chat_template_kwargs")) {
            return message.replace("send it as a request field", "send it as the request's own field");
        }
        let chat_fields = [
            "messages",
            "tools[",
            "tool_choice.function",
            "response_format",
            "max_completion_tokens",
            "reasoning_effort",
        ];
        let out =
            rename_quoted(&message, |part| chat_fields.iter().any(|f| part.starts_with(f)).then(|| self.rename(part)));
        let (have, shorten) = match self.continued() {
            Some("conversation") => (
                "the conversation's items and the input have",
                "delete items from the conversation, or shorten the input",
            ),
            Some(_) => {
                ("the continued response and the input have", "continue from an earlier response, or shorten the input")
            }
            None => ("the input has", "shorten the input"),
        };
        let out = out
            .replace("the messages have", have)
            .replace("the messages render", "the input renders")
            .replace("shorten the messages", shorten)
            .replace("(response_format,", "(text.format,");
        // (a function call output's content is its `output`)
        match param.map(|p| self.rename(p)) {
            Some(p) if p.ends_with(".output") => out.replace("`content`", "`output`"),
            _ => out,
        }
    }

    /// `err` with its `param` (and the chat field names its message quotes) renamed.
    fn rename_error(&self, err: ApiError) -> ApiError {
        rename_error(err, |p| self.rename(p), |m, p| self.words(m, p))
    }
}

/// An item's `id`, when it has one: a string that can name it in a URL path
/// (`/v1/conversations/{id}/items/{item_id}`): 1 to 256 characters, none of them `/`,
/// whitespace or control characters.
fn check_item_id(obj: &Map<String, Value>, p: &str) -> Result<(), ApiError> {
    match obj.get("id") {
        None | Some(Value::Null) => Ok(()),
        Some(Value::String(id))
            if (1..=256).contains(&id.chars().count())
                && !id.chars().any(|c| c == '/' || c.is_whitespace() || c.is_control()) =>
        {
            Ok(())
        }
        Some(Value::String(_)) => Err(ApiError::invalid(
            format!("{p}.id"),
            "An item `id` is 1 to 256 characters, without `/`, whitespace or control characters.",
        )),
        Some(other) => Err(invalid_type(format!("{p}.id"), format!("`id` must be a string, not {}.", kind_of(other)))),
    }
}

/// Builds the chat messages from `instructions` and `input`.
struct Conversation {
    /// The field its items are read from: `input` (or a conversation's `items`).
    root: &'static str,
    messages: Vec<Value>,
    /// The names of the calls `messages` made, for the outputs that answer them.
    call_names: CallNames,
    origins: Origins,
    /// A `reasoning` item's text, waiting for the assistant turn it belongs to (and its path).
    reasoning: Option<(String, String)>,
    ignored: Vec<String>,
}

impl Conversation {
    fn new(root: &'static str) -> Self {
        Self {
            root,
            messages: Vec::new(),
            call_names: CallNames::default(),
            origins: Origins::default(),
            reasoning: None,
            ignored: Vec::new(),
        }
    }

    fn push(&mut self, message: Value, path: String) {
        self.push_as(message, path, "content");
    }

    /// `push`, the item naming the message's content `content`.
    fn push_as(&mut self, message: Value, path: String, content: &'static str) {
        self.messages.push(message);
        self.origins.messages.push(Origin { path, calls: Vec::new(), content, previous: false });
    }

    /// An assistant turn: the last message when it is one that calls may join (`joinable`),
    /// else a new one; it takes any waiting reasoning.
    fn assistant(&mut self, path: &str, joinable: bool) -> &mut Map<String, Value> {
        let last_is_assistant = self.messages.last().is_some_and(|m| m["role"] == "assistant");
        if !(joinable && last_is_assistant) {
            self.push(json!({"role": "assistant", "content": null}), path.to_string());
        }
        let message = self.messages.last_mut().and_then(Value::as_object_mut).expect("just pushed");
        if let Some((text, _)) = self.reasoning.take() {
            message.insert("reasoning_content".into(), Value::String(text));
        }
        message
    }

    fn item(&mut self, i: usize, item: &Value) -> Result<(), ApiError> {
        let p = format!("{}[{i}]", self.root);
        let obj = as_object(item, p.clone(), "Each input item")?;
        check_item_id(obj, &p)?;
        let kind = match obj.get("type") {
            None | Some(Value::Null) => "message",
            Some(Value::String(t)) => t.as_str(),
            Some(other) => {
                return Err(invalid_type(
                    format!("{p}.type"),
                    format!("`type` must be a string, not {}.", kind_of(other)),
                ))
            }
        };
        match kind {
            "message" => self.message_item(&p, obj),
            "function_call" => {
                self.ignored.extend(unknown_keys_in(obj, &CALL_ITEM_KEYS, &p));
                let call_id = require_str(obj, "call_id", &p)?;
                if call_id.is_empty() {
                    return Err(ApiError::invalid(format!("{p}.call_id"), "`call_id` must not be empty."));
                }
                let name = require_str(obj, "name", &p)?;
                let arguments = require_str(obj, "arguments", &p)?;
                let call =
                    json!({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}});
                // joins the assistant turn before it: its text, or the calls made beside it
                let message = self.assistant(&p, true);
                let calls = message.entry("tool_calls").or_insert_with(|| json!([]));
                calls.as_array_mut().expect("tool_calls is an array").push(call);
                self.origins.messages.last_mut().expect("an assistant turn").calls.push(p);
                Ok(())
            }
            "function_call_output" => {
                self.ignored.extend(unknown_keys_in(obj, &OUTPUT_ITEM_KEYS, &p));
                let call_id = require_str(obj, "call_id", &p)?;
                let output = match obj.get("output") {
                    Some(Value::String(s)) => Value::String(s.clone()),
                    Some(Value::Array(parts)) => Value::Array(self.parts(&format!("{p}.output"), parts, false)?),
                    None | Some(Value::Null) => return Err(missing(format!("{p}.output"))),
                    Some(other) => {
                        return Err(invalid_type(
                            format!("{p}.output"),
                            format!("`output` must be a string or a list of text parts, not {}.", kind_of(other)),
                        ))
                    }
                };
                let (message, named) = tool_message(&self.messages, &mut self.call_names, call_id, output);
                if named {
                    self.origins.added.push(format!("messages[{}].name", self.messages.len()));
                }
                self.push_as(message, p, "output");
                Ok(())
            }
            "reasoning" => {
                self.ignored.extend(unknown_keys_in(obj, &REASONING_ITEM_KEYS, &p));
                if set(obj, "encrypted_content").is_some() {
                    self.ignored.push(format!("{p}.encrypted_content"));
                }
                // its text (the summary, when the item has no reasoning text)
                let mut unknown = Vec::new();
                let mut texts = |key: &str| -> Result<Vec<String>, ApiError> {
                    let Some(list) = set(obj, key) else { return Ok(Vec::new()) };
                    let list = list.as_array().ok_or_else(|| {
                        invalid_type(format!("{p}.{key}"), format!("`{key}` must be an array, not {}.", kind_of(list)))
                    })?;
                    list.iter()
                        .enumerate()
                        .map(|(j, part)| {
                            let pp = format!("{p}.{key}[{j}]");
                            let part = as_object(part, pp.clone(), "Each part")?;
                            let want = if key == "content" { "reasoning_text" } else { "summary_text" };
                            if part.get("type").and_then(Value::as_str) != Some(want) {
                                return Err(ApiError::invalid(
                                    format!("{pp}.type"),
                                    format!("A reasoning item's `{key}` parts have type {want:?}."),
                                ));
                            }
                            unknown.extend(unknown_keys_in(part, &["type", "text"], &pp));
                            require_str(part, "text", &pp).map(str::to_string)
                        })
                        .collect()
                };
                let content = texts("content")?;
                let summary = texts("summary")?;
                self.ignored.extend(unknown);
                let text = if content.is_empty() { summary.join("\n\n") } else { content.join("") };
                if let Some((_, earlier)) = self.reasoning.replace((text, p)) {
                    self.ignored.push(earlier);
                }
                Ok(())
            }
            other => Err(unsupported(
                format!("{p}.type"),
                format!(
                    "Input items of type {other:?} are not supported: this server accepts messages, \
                     `function_call`, `function_call_output`, `reasoning` and `item_reference` items."
                ),
            )),
        }
    }

    fn message_item(&mut self, p: &str, obj: &Map<String, Value>) -> Result<(), ApiError> {
        self.ignored.extend(unknown_keys_in(obj, &MESSAGE_ITEM_KEYS, p));
        let role = require_str(obj, "role", p)?;
        if !["user", "assistant", "system", "developer"].contains(&role) {
            return Err(ApiError::invalid(
                format!("{p}.role"),
                format!("Unknown role {role:?}: expected one of user, assistant, system, developer."),
            ));
        }
        let content = match obj.get("content") {
            Some(Value::String(s)) => Value::String(s.clone()),
            Some(Value::Array(parts)) => {
                Value::Array(self.parts(&format!("{p}.content"), parts, role == "assistant")?)
            }
            None | Some(Value::Null) => return Err(missing(format!("{p}.content"))),
            Some(other) => {
                return Err(invalid_type(
                    format!("{p}.content"),
                    format!("`content` must be a string or a list of content parts, not {}.", kind_of(other)),
                ))
            }
        };
        if role == "assistant" {
            let message = self.assistant(p, false);
            message.insert("content".into(), content);
        } else {
            if let Some((_, path)) = self.reasoning.take() {
                // reasoning belongs to an assistant turn; one before a user turn has none
                self.ignored.push(path);
            }
            self.push(json!({"role": role, "content": content}), p.to_string());
        }
        Ok(())
    }

    /// Content parts as chat's: `input_text`/`output_text` -> text parts; `refusal` parts
    /// (an assistant's) stay.
    fn parts(&mut self, p: &str, parts: &[Value], assistant: bool) -> Result<Vec<Value>, ApiError> {
        let mut out = Vec::with_capacity(parts.len());
        for (j, part) in parts.iter().enumerate() {
            let pp = format!("{p}[{j}]");
            let obj = as_object(part, pp.clone(), "Each content part")?;
            let kind = require_str(obj, "type", &pp)?;
            match kind {
                "input_text" | "output_text" | "text" => {
                    let known: &[&str] = if kind == "output_text" {
                        // (what this server's own output parts carry)
                        &["type", "text", "annotations", "logprobs"]
                    } else {
                        &["type", "text"]
                    };
                    self.ignored.extend(unknown_keys_in(obj, known, &pp));
                    out.push(json!({"type": "text", "text": require_str(obj, "text", &pp)?}));
                }
                "refusal" if assistant => {
                    out.push(json!({"type": "refusal", "refusal": require_str(obj, "refusal", &pp)?}));
                }
                "input_image" | "input_file" | "input_audio" => {
                    return Err(unsupported(
                        format!("{pp}.type"),
                        format!("Content parts of type {kind:?} are not supported: this server serves text models."),
                    ))
                }
                other => {
                    return Err(ApiError::invalid(
                        format!("{pp}.type"),
                        format!("Unknown content part type {other:?}: expected \"input_text\" (or an assistant's \"output_text\")."),
                    ))
                }
            }
        }
        Ok(out)
    }
}

/// The items of a list with references resolved: the list, and at each referenced index the
/// stored item itself (a response keeps that one rather than a copy of it).
type Resolved = (Value, Vec<Option<Arc<Item>>>);

/// `input` (the list at `root`) with each `item_reference` item replaced by the stored item it
/// names (as it is listed: with its `id`), from a stored response or a conversation; `None`
/// when it has no references. A reference's keys beside `type` and `id` are reported in
/// `ignored`.
fn resolve_references(
    router: &Router,
    input: Option<&Value>,
    root: &str,
    ignored: &mut Vec<String>,
) -> Result<Option<Resolved>, ApiError> {
    let store = router.responses();
    let Some(Value::Array(items)) = input else { return Ok(None) };
    // (OpenAI's reference may leave its `type` out: an item of an `id` alone, no role or content)
    let is_reference = |item: &Value| match item.get("type") {
        Some(Value::String(t)) => t == "item_reference",
        None | Some(Value::Null) => {
            item.get("id").is_some() && item.get("role").is_none() && item.get("content").is_none()
        }
        Some(_) => false,
    };
    if !items.iter().any(is_reference) {
        return Ok(None);
    }
    let mut out = Vec::with_capacity(items.len());
    let mut shared = vec![None; items.len()];
    for (i, item) in items.iter().enumerate() {
        if !is_reference(item) {
            out.push(item.clone());
            continue;
        }
        let p = format!("{root}[{i}]");
        if !store.enabled() {
            return Err(unsupported(
                format!("{p}.type"),
                "Item references are not supported: this server stores no responses (--responses-store-mib 0). \
                 Send the item itself.",
            ));
        }
        let obj = item.as_object().expect("an object has a type");
        let id = require_str(obj, "id", &p)?;
        ignored.extend(unknown_keys_in(obj, &["type", "id"], &p));
        let found = store.item(id).or_else(|| router.conversations().find(id)).ok_or_else(|| {
            ApiError::with_code(
                "item_not_found",
                Some(format!("{p}.id")),
                format!(
                    "Item with id {id:?} not found: no stored response or conversation holds it (it was sent \
                     or made with `store: false`, or its responses or conversations were deleted or forgotten \
                     to keep this server's store within its bound)."
                ),
            )
        })?;
        out.push(found.value());
        shared[i] = Some(found);
    }
    Ok(Some((Value::Array(out), shared)))
}

/// OpenAI's 400 for an input item whose `id` an item before it has (the items continued, a
/// reference to one of them, or an output item sent back beside `previous_response_id`): it
/// would stand twice in the prompt and the listed input.
fn refuse_duplicates(previous: &[Value], input: Option<&Value>) -> Result<(), ApiError> {
    let id = |item: &Value| item.get("id").and_then(Value::as_str).map(str::to_string);
    let mut seen: std::collections::HashSet<String> = previous.iter().filter_map(id).collect();
    for (i, item) in input.and_then(Value::as_array).into_iter().flatten().enumerate() {
        if let Some(id) = id(item) {
            if !seen.insert(id.clone()) {
                return Err(ApiError::invalid(
                    format!("input[{i}]"),
                    format!("Duplicate item found with id {id}. Remove duplicate items from your input and try again."),
                ));
            }
        }
    }
    Ok(())
}

/// Items as a conversation keeps them (`/v1/conversations`): `items` checked as input items
/// are (references resolved, errors at `items[i]`) and each listed with its `id`; what they
/// carry that means nothing here is reported in `ignored`.
pub(crate) fn conversation_items(
    router: &Router,
    items: &Value,
    ignored: &mut Vec<String>,
) -> Result<Vec<Value>, ApiError> {
    let resolved = resolve_references(router, Some(items), "items", ignored)?;
    let list = resolved.as_ref().map_or(items, |(v, _)| v).as_array().map(Vec::as_slice).unwrap_or_default();
    let mut conv = Conversation::new("items");
    for (i, item) in list.iter().enumerate() {
        conv.item(i, item)?;
    }
    // (as the chat request of a response checks them: a conversation holding an item that
    // every later response would refuse could never be answered again)
    if !conv.messages.is_empty() {
        chat::validate_messages(&conv.messages).map_err(|e| conv.origins.rename_error(e))?;
    }
    ignored.extend(conv.ignored);
    Ok(list.iter().map(listed).collect())
}

/// The chat messages of `instructions`, the items continued (`previous`: a continued
/// response's, or a conversation's; `from` names the field that asked for them) and `input`,
/// but the first `skip` items of `previous` then `input` (`truncation: "auto"`).
fn conversation(
    obj: &Map<String, Value>,
    input: Option<&Value>,
    previous: &[Value],
    from: &str,
    skip: usize,
) -> Result<Conversation, ApiError> {
    let mut conv = Conversation::new("input");
    match set(obj, "instructions") {
        None => {}
        Some(Value::String(s)) => conv.push(json!({"role": "system", "content": s}), "instructions".into()),
        Some(other) => {
            return Err(invalid_type(
                "instructions",
                format!("`instructions` must be a string, not {}.", kind_of(other)),
            ))
        }
    }
    for item in previous.iter().skip(skip) {
        // (stored items were checked when they were sent; an error here names the response)
        conv.item(0, item).map_err(|e| match e {
            ApiError::InvalidRequest { message, code, .. } => {
                ApiError::InvalidRequest { message, code, param: Some(from.into()) }
            }
            other => other,
        })?;
    }
    // what the continued response holds is named by its id, and never reported
    for origin in &mut conv.origins.messages {
        origin.path = from.into();
        origin.calls.iter_mut().for_each(|c| *c = from.into());
        origin.previous = true;
    }
    conv.ignored.clear();
    conv.reasoning = None;
    match input {
        // (a continued response or conversation may be answered without new input: after the
        // outputs of its calls, say)
        None | Some(Value::Null) if !previous.is_empty() => {}
        None | Some(Value::Null) => return Err(missing("input".into())),
        Some(Value::String(s)) => conv.push(json!({"role": "user", "content": s}), "input".into()),
        Some(Value::Array(items)) => {
            if items.is_empty() {
                return Err(ApiError::invalid("input", "`input` must not be an empty list."));
            }
            // (the items kept keep their indices: an error names them as sent)
            for (i, item) in items.iter().enumerate().skip(skip.saturating_sub(previous.len())) {
                conv.item(i, item)?;
            }
            if let Some((_, path)) = conv.reasoning.take() {
                // reasoning with no assistant turn after it: nothing to attach it to
                conv.ignored.push(path);
            }
        }
        Some(other) => {
            return Err(invalid_type(
                "input",
                format!("`input` must be a string or a list of items, not {}.", kind_of(other)),
            ))
        }
    }
    calls_answered(&conv)?;
    Ok(conv)
}

/// OpenAI's rule for a conversation's function calls: each `function_call` has one
/// `function_call_output` after it, and each output answers a call before it (else a 400:
/// the model would read a result of nothing, or a call that never returned).
fn calls_answered(conv: &Conversation) -> Result<(), ApiError> {
    // the calls: (call_id, the path of their item, answered); the unanswered ones' places by id,
    // earliest first (an output answers the earliest open call of its id)
    let mut calls: Vec<(&str, &str, bool)> = Vec::new();
    let mut open: std::collections::HashMap<&str, std::collections::VecDeque<usize>> = Default::default();
    for (m, origin) in conv.messages.iter().zip(&conv.origins.messages) {
        let made = m["tool_calls"].as_array().map(Vec::as_slice).unwrap_or_default();
        for (call, path) in made.iter().zip(&origin.calls) {
            let id = call["id"].as_str().unwrap_or_default();
            open.entry(id).or_default().push_back(calls.len());
            calls.push((id, path, false));
        }
        if m["role"] == "tool" {
            let id = m["tool_call_id"].as_str().unwrap_or_default();
            let Some(k) = open.get_mut(id).and_then(|places| places.pop_front()) else {
                let at = if origin.previous { origin.path.clone() } else { format!("{}.call_id", origin.path) };
                return Err(ApiError::invalid(
                    at,
                    format!(
                        "No function call found for the function call output with call_id {id:?}: an output \
                         answers a `function_call` item before it, once."
                    ),
                ));
            };
            calls[k].2 = true;
        }
    }
    match calls.iter().find(|(_, _, answered)| !answered) {
        Some((id, at, _)) => Err(ApiError::invalid(
            *at,
            format!(
                "No function call output found for the function call {id:?}: each `function_call` item needs \
                 a `function_call_output` item after it with its `call_id`."
            ),
        )),
        None => Ok(()),
    }
}

/// Where `truncation: "auto"` may cut a conversation (`previous`, then `input`): before each of
/// its items but the first that is a user message, so the turns kept start with the user's and
/// no call is parted from its output. The input's last item is never dropped.
fn cut_points(previous: &[Value], input: Option<&Value>) -> Vec<usize> {
    let listed = match input {
        Some(Value::Array(items)) => items.as_slice(),
        _ => &[],
    };
    // (a string input is one user message, after the items continued)
    let total = previous.len() + listed.len().max(1);
    let user = |item: &Value| {
        item.get("type").is_none_or(|t| t.is_null() || *t == "message") && item.get("role") == Some(&json!("user"))
    };
    let items = previous.iter().chain(listed);
    let users = items.enumerate().filter(|&(k, item)| k > 0 && user(item)).map(|(k, _)| k);
    users.filter(|&k| k < total).chain((listed.is_empty() && !previous.is_empty()).then_some(previous.len())).collect()
}

/// `truncation: "auto"`: the request whose conversation drops the fewest first items (at one of
/// `cuts`, ascending) and fits the context; None when even the shortest does not. `attempt`
/// prepares a conversation; `dropped(k)` is the conversation without its first k items.
fn truncated<T>(
    attempt: &mut impl FnMut(Conversation) -> Result<T, ApiError>,
    dropped: impl Fn(usize) -> Result<Conversation, ApiError>,
    cuts: &[usize],
) -> Result<Option<T>, ApiError> {
    // (a conversation that fits still fits with more dropped: the least such cut is found by
    // bisection, each try one render and tokenization)
    let (mut lo, mut hi, mut best) = (0, cuts.len(), None);
    while lo < hi {
        let mid = (lo + hi) / 2;
        match attempt(dropped(cuts[mid])?) {
            Err(e) if e.code() == "context_length_exceeded" => lo = mid + 1,
            done => {
                best = Some(done?);
                hi = mid;
            }
        }
    }
    Ok(best)
}

/// A flat function tool -> chat's `{"type": "function", "function": {...}}`.
fn chat_tools(tools: &Value) -> Result<Value, ApiError> {
    let list = tools
        .as_array()
        .ok_or_else(|| invalid_type("tools", format!("`tools` must be an array, not {}.", kind_of(tools))))?;
    let mut out = Vec::with_capacity(list.len());
    for (i, tool) in list.iter().enumerate() {
        let p = format!("tools[{i}]");
        let obj = as_object(tool, p.clone(), "Each tool")?;
        match require_str(obj, "type", &p)? {
            "function" => {}
            t if BUILT_IN_TOOLS.contains(&t) || t.starts_with("web_search") || t.starts_with("computer") => {
                return Err(unsupported(
                    format!("{p}.type"),
                    format!("Tools of type {t:?} are not supported: this server runs no built-in tools; send function tools."),
                ))
            }
            t => return Err(ApiError::invalid(format!("{p}.type"), format!("Unknown tool type {t:?}: expected \"function\"."))),
        }
        let mut function = obj.clone();
        function.remove("type");
        out.push(json!({"type": "function", "function": function}));
    }
    Ok(Value::Array(out))
}

/// Responses' `tool_choice` -> chat's (keys of a named choice beside `type` and `name` are
/// reported in `ignored`).
fn chat_tool_choice(choice: &Value, ignored: &mut Vec<String>) -> Result<Value, ApiError> {
    let Value::Object(obj) = choice else { return Ok(choice.clone()) };
    match require_str(obj, "type", "tool_choice")? {
        "function" => {
            let name = require_str(obj, "name", "tool_choice")?;
            ignored.extend(unknown_keys_in(obj, &["type", "name"], "tool_choice"));
            Ok(json!({"type": "function", "function": {"name": name}}))
        }
        "allowed_tools" => {
            // chat's nesting of the same choice (which checks it, and reports its other keys)
            let mut allowed = obj.clone();
            allowed.remove("type");
            if let Some(Value::Array(tools)) = allowed.get_mut("tools") {
                for tool in tools.iter_mut().filter_map(Value::as_object_mut) {
                    let name = tool.remove("name").unwrap_or(Value::Null);
                    tool.insert("function".into(), json!({"name": name}));
                }
            }
            Ok(json!({"type": "allowed_tools", "allowed_tools": allowed}))
        }
        t => Err(unsupported(
            "tool_choice.type",
            format!("`tool_choice` of type {t:?} is not supported: send \"none\", \"auto\", \"required\", {{\"type\": \"function\", \"name\": ...}} or {{\"type\": \"allowed_tools\", ...}}."),
        )),
    }
}

/// Responses' `text.format` -> chat's `response_format`.
fn response_format(format: &Value) -> Result<Value, ApiError> {
    let obj = as_object(format, "text.format", "`text.format`")?;
    Ok(match require_str(obj, "type", "text.format")? {
        "json_schema" => {
            if set(obj, "schema").is_none() {
                return Err(missing("text.format.schema".into()));
            }
            let mut schema = obj.clone();
            schema.remove("type");
            json!({"type": "json_schema", "json_schema": schema})
        }
        _ => format.clone(),
    })
}

/// Validates a Responses request and prepares the chat request it means.
pub(crate) fn prepare(router: &Router, body: &[u8], header_id: Option<&str>) -> Result<Checked, ApiError> {
    prepare_as(router, body, header_id, false)
}

/// `prepare`; `counting`: only to count its prompt (`input_tokens`), so a conversation it
/// names is read, not held.
fn prepare_as(router: &Router, body: &[u8], header_id: Option<&str>, counting: bool) -> Result<Checked, ApiError> {
    let value = parse_body(body)?;
    let obj = value.as_object().expect("parse_body checks");
    let mut ignored = Vec::new();
    let mut chat = Map::new();
    let mut echo = Map::new();

    for (key, why) in CHAT_ONLY {
        if set(obj, key).is_some() {
            return Err(unsupported(key, format!("`{key}` is a Chat Completions field: {why}.")));
        }
    }
    // (a `response`'s status has no value for vLLM's "repetition" finish either)
    for key in ["return_token_ids", "prompt_logprobs", "repetition_detection"] {
        if set(obj, key).is_some_and(|v| *v != Value::Bool(false)) {
            return Err(unsupported(
                key,
                format!("`{key}` is not supported on /v1/responses (a `response` object has no place for it); send the request to /v1/chat/completions."),
            ));
        }
    }
    let store = router.responses();
    // the conversation the response belongs to: its items come before `input`, and the
    // response's input and output items join it once it is done
    let conversations = router.conversations();
    let joins = match set(obj, "conversation") {
        None => None,
        Some(_) if set(obj, "previous_response_id").is_some() => {
            return Err(ApiError::invalid(
                "conversation",
                "`conversation` and `previous_response_id` cannot both be given: send one of them (a conversation \
                 holds its earlier responses' items itself).",
            ))
        }
        Some(_) if !conversations.enabled() => {
            return Err(unsupported(
                "conversation",
                "Conversations (`conversation`) are not supported: this server stores none (--responses-store-mib \
                 0). Send the whole conversation in `input`.",
            ))
        }
        Some(Value::String(id)) => Some(id.clone()),
        Some(Value::Object(c)) => {
            ignored.extend(unknown_keys_in(c, &["id"], "conversation"));
            Some(require_str(c, "id", "conversation")?.to_string())
        }
        Some(other) => {
            return Err(invalid_type(
                "conversation",
                format!("`conversation` must be a conversation id or an object with its `id`, not {}.", kind_of(other)),
            ))
        }
    };
    // the items continued: a `previous_response_id`'s conversation and then its output (a
    // conversation's: below, once the input is read), as values and as the log they are
    let (mut previous, mut continued) =
        match set(obj, "previous_response_id") {
            None => (Vec::new(), Log::empty()),
            Some(_) if !store.enabled() => return Err(unsupported(
                "previous_response_id",
                "`previous_response_id` is not supported: this server stores no responses (--responses-store-mib 0). \
                 Send the whole conversation in `input`.",
            )),
            Some(Value::String(id)) => {
                let stored = store.get(id).map_err(|_| {
                    ApiError::with_code(
                        "previous_response_not_found",
                        Some("previous_response_id".into()),
                        format!(
                            "Previous response with id {id:?} not found: it was not stored (`store: false`), was \
                             deleted, or was forgotten to keep this server's store within its bound."
                        ),
                    )
                })?;
                if stored.running() {
                    return Err(ApiError::invalid(
                        "previous_response_id",
                        format!(
                            "Response {id:?} is still running in the background: its output is not known yet. \
                             Continue it once it has completed (poll GET /v1/responses/{id})."
                        ),
                    ));
                }
                let log = stored.answered().clone();
                (log.values(), log)
            }
            Some(other) => {
                return Err(invalid_type(
                    "previous_response_id",
                    format!("`previous_response_id` must be a string, not {}.", kind_of(other)),
                ))
            }
        };
    if set(obj, "prompt").is_some() {
        return Err(unsupported(
            "prompt",
            "Stored prompt templates (`prompt`) are not supported: send `instructions` and `input`.",
        ));
    }
    let background = match set(obj, "background") {
        None => false,
        Some(Value::Bool(b)) => *b,
        Some(other) => {
            return Err(invalid_type("background", format!("`background` must be a boolean, not {}.", kind_of(other))))
        }
    };
    // OpenAI's default is to store; with no store, `store: true` sent is reported
    let keep = match set(obj, "store") {
        None => store.enabled(),
        Some(Value::Bool(false)) => false,
        Some(Value::Bool(true)) if !store.enabled() => {
            ignored.push("store".into());
            false
        }
        Some(Value::Bool(true)) => true,
        Some(other) => {
            return Err(invalid_type("store", format!("`store` must be a boolean, not {}.", kind_of(other))))
        }
    };
    if background && !counting && !keep {
        return Err(if store.enabled() {
            ApiError::invalid(
                "background",
                "A background response must be stored: it is read back by its id. Send `store: true` (the \
                 default) with `background: true`.",
            )
        } else {
            unsupported(
                "background",
                "Background responses are not supported: this server stores no responses (--responses-store-mib \
                 0), and a background response is read back from the store.",
            )
        });
    }
    // `auto`: the conversation's first items are dropped until the prompt fits (below)
    let truncate = match set(obj, "truncation") {
        None => false,
        Some(Value::String(t)) if t == "disabled" => false,
        Some(Value::String(t)) if t == "auto" => true,
        Some(other) => {
            return Err(ApiError::invalid(
                "truncation",
                format!("`truncation` must be \"disabled\" or \"auto\", not {other}."),
            ))
        }
    };
    let resolved = resolve_references(router, obj.get("input"), "input", &mut ignored)?;
    let input = resolved.as_ref().map(|(v, _)| v).or(obj.get("input"));
    // the input items as a stored response or a conversation keeps them (with ids); a
    // referenced item is the stored one itself, so it is held once
    let shared = resolved.as_ref().map(|(_, s)| s.as_slice()).unwrap_or_default();
    let listed_input: Vec<Arc<Item>> = match input {
        _ if !keep && joins.is_none() => Vec::new(),
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, item)| shared.get(i).cloned().flatten().unwrap_or_else(|| Item::new(&listed(item))))
            .collect(),
        // (no input: only the output joins what is continued)
        None | Some(Value::Null) => Vec::new(),
        other => vec![Item::new(&listed(&json!({"type": "message", "role": "user", "content": other})))],
    };
    // a conversation is held from here until the response's items have joined it
    let mut lease = None;
    match &joins {
        Some(id) if counting => previous = conversations.items(id)?,
        Some(id) => {
            let (held, items, log) = conversations.acquire(id, &listed_input)?;
            (lease, previous, continued) = (Some(Arc::new(held)), items, log);
        }
        None => {}
    }
    let from = if joins.is_some() { "conversation" } else { "previous_response_id" };
    refuse_duplicates(&previous, input)?;
    let conv = conversation(obj, input, &previous, from, 0)?;
    ignored.extend(conv.ignored.iter().cloned());

    // logprobs: asked for by `include` or `top_logprobs`
    let mut logprobs = false;
    if let Some(include) = set(obj, "include") {
        let list = include
            .as_array()
            .ok_or_else(|| invalid_type("include", format!("`include` must be an array, not {}.", kind_of(include))))?;
        for (i, entry) in list.iter().enumerate() {
            match entry.as_str() {
                Some(LOGPROBS_INCLUDE) => logprobs = true,
                Some(_) => ignored.push(format!("include[{i}]")),
                None => return Err(invalid_type(format!("include[{i}]"), "Each `include` entry must be a string.")),
            }
        }
    }
    // (as OpenAI's and vLLM's: `include` asks for them, `top_logprobs` says how many
    // alternatives; alone, a non-zero one does nothing and is reported)
    if let Some(k) = set(obj, "top_logprobs") {
        let most = router.config.max_logprobs;
        // (a negative integer is out of range, as one above the most is; anything else is no
        // integer)
        match k.as_i64().or_else(|| k.as_u64().map(|_| i64::MAX)) {
            None => return Err(invalid_type("top_logprobs", "`top_logprobs` must be an integer.")),
            Some(n) if n < 0 || n > i64::from(most) => {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    format!("`top_logprobs` must be between 0 and {most}, got {k}."),
                ))
            }
            Some(_) => {}
        }
    }
    match set(obj, "top_logprobs") {
        Some(k) if logprobs => {
            chat.insert("top_logprobs".into(), k.clone());
        }
        Some(k) if *k != json!(0) => ignored.push("top_logprobs".into()),
        _ => {}
    }
    if logprobs {
        chat.insert("logprobs".into(), Value::Bool(true));
    }
    if let Some(text) = set(obj, "text") {
        let text_obj = as_object(text, "text", "`text`")?;
        if let Some(format) = set(text_obj, "format") {
            chat.insert("response_format".into(), response_format(format)?);
        }
        if set(text_obj, "verbosity").is_some() {
            ignored.push("text.verbosity".into());
        }
        ignored.extend(unknown_keys_in(text_obj, &["format", "verbosity"], "text"));
    }
    if let Some(reasoning) = set(obj, "reasoning") {
        let r = as_object(reasoning, "reasoning", "`reasoning`")?;
        // (chat's `reasoning_effort`, which says whether it did anything; reported as ours)
        if let Some(effort) = set(r, "effort") {
            chat.insert("reasoning_effort".into(), effort.clone());
        }
        let asks = |(k, v): &(&String, &Value)| !v.is_null() && k.as_str() != "effort";
        ignored.extend(r.iter().filter(asks).map(|(k, _)| format!("reasoning.{k}")));
    }
    if let Some(options) = set(obj, "stream_options") {
        let o = as_object(options, "stream_options", "`stream_options`")?;
        if set(obj, "stream") != Some(&Value::Bool(true)) {
            // (as chat refuses it, and OpenAI's reference says it is set only with `stream`)
            return Err(ApiError::invalid("stream_options", "`stream_options` is only allowed with `stream: true`."));
        }
        // (no stream is obfuscated: `include_obfuscation: false` asks for nothing)
        let asks =
            |(k, v): &(&String, &Value)| !(v.is_null() || (*k == "include_obfuscation" && **v == Value::Bool(false)));
        ignored.extend(o.iter().filter(asks).map(|(k, _)| format!("stream_options.{k}")));
    }
    if let Some(metadata) = set(obj, "metadata") {
        check_metadata(as_object(metadata, "metadata", "`metadata`")?)?;
    }
    if let Some(n) = set(obj, "max_tool_calls") {
        if n.is_i64() && !n.is_u64() {
            return Err(ApiError::invalid("max_tool_calls", "`max_tool_calls` must be at least 0."));
        }
        if !n.is_u64() {
            let message = format!("`max_tool_calls` must be an integer, not {}.", kind_of(n));
            return Err(invalid_type("max_tool_calls", message));
        }
        // (it limits calls to built-in tools, of which this server runs none)
        ignored.push("max_tool_calls".into());
    }

    // (chat's name for `reasoning.effort`, and vLLM's chat switch for returning the thinking,
    // which a response returns as its reasoning item: no Responses fields)
    if set(obj, "reasoning_effort").is_some() {
        ignored.push("reasoning_effort".into());
    }
    if set(obj, "include_reasoning").is_some_and(|v| *v != Value::Bool(true)) {
        ignored.push("include_reasoning".into());
    }
    const OWN: [&str; 21] = [
        "reasoning_effort",
        "include_reasoning",
        "input",
        "instructions",
        "max_output_tokens",
        "text",
        "tools",
        "tool_choice",
        "include",
        "top_logprobs",
        "store",
        "previous_response_id",
        "conversation",
        "background",
        "truncation",
        "reasoning",
        "stream_options",
        "metadata",
        "max_tool_calls",
        "prompt",
        "messages",
    ];
    for (k, v) in obj {
        if !OWN.contains(&k.as_str()) {
            chat.insert(k.clone(), v.clone());
        }
    }
    if let Some(max) = obj.get("max_output_tokens") {
        chat.insert("max_completion_tokens".into(), max.clone());
    }
    // (`tools: []`, which every response echoes and agent SDKs send for an agent without
    // tools, is no tools; so is `parallel_tool_calls` beside none: both ask for nothing)
    let tools = set(obj, "tools").filter(|t| t.as_array().is_none_or(|a| !a.is_empty()));
    match tools {
        Some(tools) => {
            chat.insert("tools".into(), chat_tools(tools)?);
        }
        None if set(obj, "parallel_tool_calls").is_some_and(Value::is_boolean) => {
            chat.remove("parallel_tool_calls");
        }
        None => {}
    }
    match set(obj, "tool_choice") {
        // OpenAI's default (which every response echoes), and "none", ask for nothing without
        // tools; chat refuses a `tool_choice` without `tools`
        Some(Value::String(c)) if (c == "auto" || c == "none") && tools.is_none() => {}
        Some(choice) => {
            chat.insert("tool_choice".into(), chat_tool_choice(choice, &mut ignored)?);
        }
        None => {}
    }
    // ours first: under strict field checking they are the 400
    let ignored = settle_ignored(ignored, router.config.strict_fields)?;

    if keep {
        chat::check_kept_id(obj.get("request_id").and_then(Value::as_str))?;
    }
    let header_id = header_id.filter(|id| !keep || chat::path_safe(id));
    // the chat request of a conversation's messages, and where each came from
    let mut chat = Value::Object(chat);
    let mut attempt = |conv: Conversation| {
        chat["messages"] = Value::Array(conv.messages);
        // (with `truncation: auto` the count is of what a response would read: the items that fit)
        let checked = if counting && !truncate {
            chat::prepare_to_count(router, &chat)
        } else {
            chat::prepare_value(router, &chat, header_id)
        };
        match checked {
            Ok(checked) => Ok((checked, conv.origins)),
            Err(e) => Err(conv.origins.rename_error(e)),
        }
    };
    let (mut checked, origins) = match attempt(conv) {
        Err(e) if truncate && e.code() == "context_length_exceeded" => {
            let dropped = |skip| conversation(obj, input, &previous, from, skip);
            truncated(&mut attempt, dropped, &cut_points(&previous, input))?.ok_or(e)?
        }
        done => done?,
    };

    // (a grammar that fails while generating is named as this route names its fields)
    if let Some(grammar) = checked.prepared.grammar.as_mut() {
        grammar.rename_param(|p| origins.rename(p));
    }
    let chat_ignored = checked.ignored.iter().filter(|p| !origins.added.contains(p));
    let all: Vec<String> = chat_ignored.flat_map(|p| origins.rename_reported(p)).chain(ignored).collect();
    let all = settle_ignored(all, router.config.strict_fields)?;
    let named = obj.get("request_id").is_some_and(Value::is_string) || header_id.is_some();
    checked.adopt(all, Endpoint::Responses, "resp", named);
    let prepared = &mut checked.prepared;

    // what the response object echoes
    let sent = |k: &str| set(obj, k).cloned();
    let number = |x: f32| format!("{x}").parse::<f64>().map(Value::from).unwrap_or(Value::Null);
    echo.insert("instructions".into(), sent("instructions").unwrap_or(Value::Null));
    echo.insert("max_output_tokens".into(), sent("max_output_tokens").unwrap_or(Value::Null));
    echo.insert("max_tool_calls".into(), sent("max_tool_calls").unwrap_or(Value::Null));
    echo.insert("metadata".into(), sent("metadata").unwrap_or_else(|| json!({})));
    echo.insert("parallel_tool_calls".into(), sent("parallel_tool_calls").unwrap_or(Value::Bool(true)));
    echo.insert("previous_response_id".into(), sent("previous_response_id").unwrap_or(Value::Null));
    echo.insert("prompt_cache_key".into(), sent("prompt_cache_key").unwrap_or(Value::Null));
    echo.insert("conversation".into(), joins.as_ref().map_or(Value::Null, |id| json!({"id": id})));
    let reasoning = set(obj, "reasoning").and_then(Value::as_object);
    let of = |k: &str| reasoning.and_then(|r| r.get(k)).cloned().unwrap_or(Value::Null);
    echo.insert("reasoning".into(), json!({"effort": of("effort"), "summary": of("summary")}));
    echo.insert("safety_identifier".into(), sent("safety_identifier").unwrap_or(Value::Null));
    // (the tier that served it: there is one, whatever `service_tier` asked for)
    echo.insert("service_tier".into(), json!("default"));
    echo.insert("store".into(), Value::Bool(keep));
    echo.insert("temperature".into(), number(prepared.params.temperature));
    let format = set(obj, "text").and_then(|t| set(t.as_object()?, "format").cloned());
    let mut text = json!({"format": format.unwrap_or_else(|| json!({"type": "text"}))});
    if let Some(v) = set(obj, "text").and_then(|t| t.get("verbosity")).filter(|v| !v.is_null()) {
        text["verbosity"] = v.clone();
    }
    echo.insert("text".into(), text);
    echo.insert("tool_choice".into(), sent("tool_choice").unwrap_or_else(|| json!("auto")));
    echo.insert("tools".into(), sent("tools").unwrap_or_else(|| json!([])));
    echo.insert("top_logprobs".into(), sent("top_logprobs").unwrap_or(json!(0)));
    echo.insert("top_p".into(), number(prepared.params.top_p));
    echo.insert("truncation".into(), json!(if truncate { "auto" } else { "disabled" }));
    echo.insert("user".into(), sent("user").unwrap_or(Value::Null));
    let stored = keep.then(|| (store.clone(), Log::extend(&continued, listed_input.clone())));
    let conversation = joins.map(|id| Joins { id, input: listed_input, lease });
    let mut echo = Echo { fields: echo, store: stored, conversation, background: None };
    if background && !counting {
        // stored `queued` from here: the request returns at once, and is read back by its id
        let object = crate::response::queued_response(prepared, &echo);
        let input = echo.store.as_ref().map(|(_, input)| input.clone()).expect("background responses are kept");
        echo.background = Some(Arc::new(store.begin(&prepared.id, &object, input)?));
    }
    prepared.responses = Some(Arc::new(echo));
    Ok(checked)
}

/// `GET /v1/responses/{id}` (`items` false; its `stream` and `starting_after` are read by the
/// caller) or `GET /v1/responses/{id}/input_items` (`items`: `order`, `limit`, `after`), with
/// the query's pairs as sent: output text's `logprobs` only when `include` asks for them, as
/// OpenAI's retrieve shows them; keys these routes do not read are reported.
pub fn read_stored(router: &Router, id: &str, items: bool, query: &[(String, String)]) -> Result<Handled, ApiError> {
    use super::conversations::{answer, includes_logprobs, query_keys, shown};
    let store = router.responses();
    let mut ignored = Vec::new();
    let logprobs = includes_logprobs(query, &mut ignored);
    let object = if items {
        let keys = query_keys(query, &["order", "limit", "after"], &mut ignored);
        let text = |k: &str| keys.get(k).and_then(Value::as_str);
        let values = shown(store.input_values(id)?, logprobs);
        let (page, has_more) =
            crate::response_store::page_of(values, text("order").unwrap_or("desc"), text("limit"), text("after"))?;
        crate::response_store::list_body(page, has_more)
    } else {
        let keys = query_keys(query, &["stream", "starting_after", "include_obfuscation"], &mut ignored);
        // (no event here carries obfuscation: asking for it asks for what never comes)
        if keys.get("include_obfuscation").is_some_and(|v| v != "false") {
            ignored.push("include_obfuscation".into());
        }
        let mut object: Value = serde_json::from_slice(&store.body(id)?).expect("stored bodies are JSON");
        if let Some(Value::Array(output)) = object.get_mut("output") {
            *output = shown(std::mem::take(output), logprobs);
        }
        object
    };
    let ignored = settle_ignored(ignored, router.config.strict_fields)?;
    answer(&object, &ignored)
}

/// Where `GET /v1/responses/{id}` with `stream=true` replays a background response's events
/// from: the sequence number its `starting_after` names (-1 when absent: every event), or
/// None when the query does not ask to stream. The last value of a repeated key counts.
pub fn replay_start(query: &[(String, String)]) -> Result<Option<i64>, ApiError> {
    let last = |key: &str| query.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v.as_str());
    match last("stream").map(str::to_ascii_lowercase).as_deref() {
        None | Some("false" | "0") => return Ok(None),
        Some("true" | "1") => {}
        Some(other) => {
            return Err(ApiError::invalid("stream", format!("`stream` must be true or false, not {other:?}.")));
        }
    }
    match last("starting_after") {
        None => Ok(Some(-1)),
        Some(after) => match after.parse::<i64>() {
            Ok(n) if n >= 0 => Ok(Some(n)),
            _ => Err(ApiError::invalid(
                "starting_after",
                format!("`starting_after` must be an event's sequence number (an integer >= 0), not {after:?}."),
            )),
        },
    }
}

/// The fields of a Responses request (and chat's sampling extensions it passes on) that shape
/// only its generation, not its prompt: a count reports them.
const GENERATION_ONLY: [&str; 27] = [
    "temperature",
    "top_p",
    "top_logprobs",
    "seed",
    "stop",
    "user",
    "metadata",
    "service_tier",
    "include",
    "safety_identifier",
    "prompt_cache_key",
    "max_tool_calls",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "bad_words",
    "allowed_token_ids",
    "priority",
    "request_id",
];

/// `POST /v1/responses/input_tokens`: `{"object": "response.input_tokens", "input_tokens": N}`,
/// the tokens the request's prompt comes to (its instructions, a continued response's
/// conversation, its input and tools, through the chat template), as `POST /v1/responses`
/// would read the same body. The fields that only shape a generation (`max_output_tokens`,
/// `stream`, `store`, `temperature`, `include`, ...) ask for nothing here and are reported
/// (checked as `POST /v1/responses` checks them). `model` may be left out (OpenAI's count
/// takes it so): the served model's.
pub(crate) fn input_tokens(router: &Router, body: &[u8]) -> Result<super::Handled, ApiError> {
    let mut value = parse_body(body)?;
    let obj = value.as_object_mut().expect("parse_body checks");
    let mut ignored = Vec::new();
    for key in ["max_output_tokens", "stream", "stream_options", "store", "background"] {
        if obj.remove(key).is_some_and(|v| !v.is_null()) {
            ignored.push(key.to_string());
        }
    }
    ignored.extend(GENERATION_ONLY.iter().filter(|k| set(obj, k).is_some()).map(|k| k.to_string()));
    if set(obj, "model").is_none() {
        obj.insert("model".into(), json!(router.config.served_model_names[0]));
    }
    // (counted, not answered: nothing of it is stored)
    obj.insert("store".into(), Value::Bool(false));
    let body = serde_json::to_vec(&value).expect("JSON values serialize");
    let checked = prepare_as(router, &body, None, true)?;
    let mut all: Vec<String> = ignored.into_iter().chain(checked.ignored).collect();
    let mut seen = std::collections::HashSet::new();
    all.retain(|k| seen.insert(k.clone()));
    let ignored = settle_ignored(all, router.config.strict_fields)?;
    let tokens = checked.prepared.prompts.first().map_or(0, Vec::len);
    let body = serde_json::to_vec(&json!({"object": "response.input_tokens", "input_tokens": tokens}))
        .expect("bodies serialize");
    Ok(super::Handled { body, headers: super::common::ignored_header(&ignored).into_iter().collect() })
}
