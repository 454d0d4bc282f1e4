//! `POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API, served
//! through the chat pipeline.
//!
//! As with [`super::responses`], the request is translated into the chat request it means,
//! which [`super::chat`] validates, renders and tokenizes; its errors and ignored fields are
//! named back in the Messages request's terms (`messages[1].content[2].input`, `max_tokens`,
//! `tools[0].input_schema`, `stop_sequences`). The answer is a `message` object, or its stream
//! of events (built by [`crate::response::ResponseBuilder`]). Errors on these routes have
//! Anthropic's shape ([`crate::error::ApiError::to_anthropic_json`]).
//!
//! The translation:
//! - `system` (a string or text blocks) -> a first `system` message.
//! - Each message's content (a string or blocks): `text` blocks -> text parts; an assistant's
//!   `tool_use` blocks -> its `tool_calls` (`input` as the JSON `arguments`), its `thinking`
//!   blocks -> its `reasoning_content`; a user's `tool_result` blocks -> `tool` messages (with
//!   the called tool's `name`), in block order with the user's text around them.
//!   Consecutive turns of one role are one turn, as Anthropic combines them.
//! - A last `assistant` message is a prefill: the answer continues it
//!   (`continue_final_message`), and holds only what was generated after it.
//! - `max_tokens` -> `max_completion_tokens`; `stop_sequences` -> `stop`; `metadata.user_id`
//!   -> `user`; custom `tools` (`input_schema`) -> function tools; `tool_choice` `auto`,
//!   `any`, `tool` (named), `none` -> chat's `auto`, `required`, the named function, `none`,
//!   and `disable_parallel_tool_use: true` -> `parallel_tool_calls: false`;
//!   `output_config.format` (and the beta `output_format`) -> `response_format` `json_schema`.
//! - `temperature`, `top_p`, `top_k`, `stream` and the extensions chat takes (`min_p`, `seed`,
//!   `chat_template_kwargs`, `priority`, ...) pass through as they are.
//!
//! Anthropic's rules for a conversation are checked before the translation, as its API does
//! (a chat template would render a broken one without complaint): every message's content is
//! non-empty (but a final assistant message's), text holds more than whitespace (system blocks
//! included), a prefill does not end in whitespace, each `tool_use` is answered by a
//! `tool_result` at the start of the next user turn, each `tool_result` answers a `tool_use` of
//! the turn before, `tool_use` ids are unique, and a conversation holding tool blocks defines
//! `tools`.
//!
//! Decisions:
//! - `cache_control` (on blocks, tools or the request) is accepted and not reported: this
//!   server's prefix cache reuses every shared prefix by itself, which is what a cache
//!   breakpoint asks for.
//! - `thinking`: a model's thinking comes back as `thinking` blocks (with an empty `signature`)
//!   when a reasoning parser reads its output. On a template that switches thinking with the
//!   `enable_thinking` variable (Qwen3's), `thinking` sets it: `disabled` -> false, `enabled`
//!   or `adaptive` -> true (unless the request's `chat_template_kwargs` sets it itself).
//!   Otherwise `thinking` is reported as ignored when it asks for what the model will not do
//!   (thinking from a model without a reasoning parser, `disabled` on one with a parser that
//!   cannot be switched off). Where the thinking is parsed, `budget_tokens` bounds it as
//!   chat's `thinking_token_budget` does: the think block is closed once it is spent.
//! - `is_error: true` on a tool result is reported (templates have no place for it); images,
//!   documents, server tools, `mcp_servers` and `container` are a 400 `unsupported_parameter`.
//! - OpenAI fields with a Messages counterpart (`stop`, `max_completion_tokens`,
//!   `response_format`, `parallel_tool_calls`, ...) are a 400 naming the field to send, and
//!   OpenAI-only outputs (`n`, `logprobs`, `stream_options`, ...) a 400: a `message` has no
//!   place for them.

use serde_json::{json, Map, Value};

use super::chat::{missing, require_str, tool_message, unknown_keys_in, CallNames};
use super::common::{
    as_object, invalid_type, kind_of, parse_body, rename_error, rename_quoted, set, settle_ignored, unsupported,
    AsksNothing,
};
use super::{chat, Checked, Endpoint, Handled};
use crate::error::{ApiError, Overflow};
use crate::router::Router;

mod rules;

/// OpenAI fields, and what to send to this route instead.
const OPENAI_ONLY: [(&str, &str); 16] = [
    ("max_completion_tokens", "send `max_tokens`"),
    ("stop", "send `stop_sequences`"),
    ("response_format", "send `output_config.format`"),
    ("parallel_tool_calls", "send `tool_choice.disable_parallel_tool_use`"),
    ("functions", "send `tools`"),
    ("function_call", "send `tool_choice`"),
    ("n", "the Messages API makes one message per request"),
    ("logprobs", "a `message` has no logprobs"),
    ("top_logprobs", "a `message` has no logprobs"),
    ("prompt_logprobs", "a `message` has no logprobs"),
    ("return_token_ids", "a `message` has no token ids"),
    ("return_tokens_as_token_ids", "a `message` has no logprobs"),
    ("echo", "the Messages API has no echo"),
    (
        "repetition_detection",
        "a `message`'s `stop_reason` has no value for a repetition (vLLM's field is on chat and completions)",
    ),
    ("stream_options", "a Messages stream always ends with the message's usage"),
    ("continuous_usage_stats", "a Messages stream always ends with the message's usage"),
];

/// The keys of the blocks this route reads (`cache_control` and a null `citations` are
/// accepted as they are).
const TEXT_KEYS: [&str; 4] = ["type", "text", "cache_control", "citations"];
const TOOL_USE_KEYS: [&str; 5] = ["type", "id", "name", "input", "cache_control"];
const TOOL_RESULT_KEYS: [&str; 5] = ["type", "tool_use_id", "content", "is_error", "cache_control"];
const THINKING_KEYS: [&str; 3] = ["type", "thinking", "signature"];
const TOOL_KEYS: [&str; 6] = ["type", "name", "description", "input_schema", "cache_control", "strict"];

/// Block types the Messages API has that a text model served here cannot take.
const MEDIA_BLOCKS: [&str; 4] = ["image", "document", "search_result", "container_upload"];

/// Where one chat message came from, in the Messages request's terms.
#[derive(Default)]
struct Origin {
    /// `messages[i]`, or `system`.
    path: String,
    /// The path of each of its content parts (`messages[i].content[j]`); empty when its content
    /// is the message's string (`messages[i].content`).
    parts: Vec<String>,
    /// The `tool_use` block of each of its tool calls.
    calls: Vec<String>,
    /// A tool message: its `tool_result` block.
    result: Option<String>,
    /// An assistant turn's `thinking` block (the last, when there are several).
    thinking: Option<String>,
}

/// The chat messages of `system` and `messages`, and where each came from.
#[derive(Default)]
struct Conversation {
    messages: Vec<Value>,
    origins: Vec<Origin>,
    /// The names of the calls `messages` made, for the results that answer them.
    call_names: CallNames,
    ignored: Vec<String>,
    /// The last message is the client's assistant turn: a prefill the answer continues.
    prefill: bool,
}

impl Conversation {
    /// The chat message that `role`'s next content joins: the last one when it has that role
    /// (Anthropic combines consecutive turns), else a new one from `path`.
    fn turn(&mut self, role: &str, path: &str) -> usize {
        let joins = self.messages.last().is_some_and(|m| m["role"] == role);
        if !joins {
            let content = if role == "assistant" { Value::Null } else { json!([]) };
            self.messages.push(json!({"role": role, "content": content}));
            self.origins.push(Origin { path: path.to_string(), ..Origin::default() });
        }
        self.messages.len() - 1
    }

    /// Adds a text part (from `from`) to the turn at `at`.
    fn text(&mut self, at: usize, text: &str, from: String) {
        let content = &mut self.messages[at]["content"];
        if let Value::String(s) = content {
            // a string turn joined by a later one becomes parts
            let first = json!({"type": "text", "text": std::mem::take(s)});
            let origin = &mut self.origins[at];
            origin.parts = vec![format!("{}.content", origin.path)];
            *content = json!([first]);
        }
        if content.is_null() {
            *content = json!([]);
        }
        content.as_array_mut().expect("content parts").push(json!({"type": "text", "text": text}));
        self.origins[at].parts.push(from);
    }

    fn message(&mut self, i: usize, m: &Value) -> Result<(), ApiError> {
        let p = format!("messages[{i}]");
        let obj = as_object(m, p.clone(), "Each message")?;
        self.ignored.extend(unknown_keys_in(obj, &["role", "content"], &p));
        let role = require_str(obj, "role", &p)?;
        // (a `system` message, the anthropic SDK's `SystemMessageParam`, is a system turn where
        // it stands; right after the top-level `system`, one turn with it)
        if !matches!(role, "user" | "assistant" | "system") {
            return Err(ApiError::invalid(
                format!("{p}.role"),
                format!("Unknown role {role:?}: expected \"user\", \"assistant\" or \"system\"."),
            ));
        }
        match obj.get("content") {
            None => Err(missing(format!("{p}.content"))),
            Some(Value::String(s)) => {
                let joins = self.messages.last().is_some_and(|m| m["role"] == role);
                if joins {
                    let at = self.turn(role, &p);
                    self.text(at, s, format!("{p}.content"));
                } else {
                    self.messages.push(json!({"role": role, "content": s}));
                    self.origins.push(Origin { path: p, ..Origin::default() });
                }
                Ok(())
            }
            Some(Value::Array(blocks)) => {
                if blocks.is_empty() {
                    return Err(ApiError::invalid(
                        format!("{p}.content"),
                        "`content` must not be an empty list: send at least one block.",
                    ));
                }
                for (j, block) in blocks.iter().enumerate() {
                    self.block(role, &p, &format!("{p}.content[{j}]"), block)?;
                }
                Ok(())
            }
            Some(other) => Err(invalid_type(
                format!("{p}.content"),
                format!("`content` must be a string or a list of content blocks, not {}.", kind_of(other)),
            )),
        }
    }

    /// One content block `b` (at path `bp`) of the message at `p`.
    fn block(&mut self, role: &str, p: &str, bp: &str, b: &Value) -> Result<(), ApiError> {
        let obj = as_object(b, bp.to_string(), "Each content block")?;
        let kind = require_str(obj, "type", bp)?;
        let assistant = role == "assistant";
        if role == "system" && kind != "text" {
            return Err(ApiError::invalid(format!("{bp}.type"), "System messages hold text blocks only."));
        }
        match kind {
            "text" => {
                self.ignored.extend(text_block_keys(obj, bp)?);
                let text = require_str(obj, "text", bp)?;
                let at = self.turn(role, p);
                self.text(at, text, bp.to_string());
            }
            "tool_use" if assistant => {
                self.ignored.extend(block_keys(obj, &TOOL_USE_KEYS, bp)?);
                let id = require_str(obj, "id", bp)?;
                let name = require_str(obj, "name", bp)?;
                let input = match obj.get("input") {
                    Some(Value::Object(o)) => Value::Object(o.clone()),
                    None | Some(Value::Null) => return Err(missing(format!("{bp}.input"))),
                    Some(other) => {
                        return Err(invalid_type(
                            format!("{bp}.input"),
                            format!("`input` must be an object, not {}.", kind_of(other)),
                        ))
                    }
                };
                let arguments = serde_json::to_string(&input).expect("JSON values serialize");
                let call = json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}});
                let at = self.turn(role, p);
                let calls = self.messages[at].as_object_mut().expect("a message").entry("tool_calls");
                calls.or_insert_with(|| json!([])).as_array_mut().expect("tool_calls is a list").push(call);
                self.origins[at].calls.push(bp.to_string());
            }
            "thinking" if assistant => {
                self.ignored.extend(unknown_keys_in(obj, &THINKING_KEYS, bp));
                let thinking = require_str(obj, "thinking", bp)?;
                let at = self.turn(role, p);
                let message = self.messages[at].as_object_mut().expect("a message");
                let text = match message.get("reasoning_content").and_then(Value::as_str) {
                    Some(earlier) => format!("{earlier}{thinking}"),
                    None => thinking.to_string(),
                };
                message.insert("reasoning_content".into(), Value::String(text));
                self.origins[at].thinking = Some(bp.to_string());
            }
            // (Anthropic's encrypted thinking: nothing here can read it)
            "redacted_thinking" if assistant => self.ignored.push(bp.to_string()),
            "tool_result" if !assistant => self.tool_result(bp, obj)?,
            "tool_use" | "thinking" | "redacted_thinking" => {
                return Err(ApiError::invalid(
                    format!("{bp}.type"),
                    format!("A {role} message cannot hold a {kind:?} block: only assistant messages do."),
                ))
            }
            "tool_result" => {
                return Err(ApiError::invalid(
                    format!("{bp}.type"),
                    "An assistant message cannot hold a \"tool_result\" block: send it in the next user message.",
                ))
            }
            media if MEDIA_BLOCKS.contains(&media) => {
                return Err(unsupported(
                    format!("{bp}.type"),
                    format!("Content blocks of type {media:?} are not supported: this server serves text models."),
                ))
            }
            other => {
                return Err(unsupported(
                    format!("{bp}.type"),
                    format!(
                        "Content blocks of type {other:?} are not supported: this server takes \"text\", \
                         \"tool_use\", \"tool_result\" and \"thinking\" blocks."
                    ),
                ))
            }
        }
        Ok(())
    }

    /// A `tool_result` block -> a `tool` message, named after the call it answers.
    fn tool_result(&mut self, bp: &str, obj: &Map<String, Value>) -> Result<(), ApiError> {
        self.ignored.extend(block_keys(obj, &TOOL_RESULT_KEYS, bp)?);
        let id = require_str(obj, "tool_use_id", bp)?;
        let content = match obj.get("content") {
            None | Some(Value::Null) => Value::String(String::new()),
            Some(Value::String(s)) => Value::String(s.clone()),
            // (no blocks: an empty result, as no `content` is; chat refuses an empty list of parts)
            Some(Value::Array(blocks)) if blocks.is_empty() => Value::String(String::new()),
            Some(Value::Array(blocks)) => {
                let mut parts = Vec::with_capacity(blocks.len());
                for (k, block) in blocks.iter().enumerate() {
                    let kp = format!("{bp}.content[{k}]");
                    let part = as_object(block, kp.clone(), "Each content block")?;
                    match require_str(part, "type", &kp)? {
                        "text" => {
                            self.ignored.extend(block_keys(part, &TEXT_KEYS, &kp)?);
                            parts.push(json!({"type": "text", "text": require_str(part, "text", &kp)?}));
                        }
                        kind => {
                            return Err(unsupported(
                                format!("{kp}.type"),
                                format!("Tool results of type {kind:?} are not supported: send text."),
                            ))
                        }
                    }
                }
                Value::Array(parts)
            }
            Some(other) => {
                return Err(invalid_type(
                    format!("{bp}.content"),
                    format!("`content` must be a string or a list of text blocks, not {}.", kind_of(other)),
                ))
            }
        };
        match set(obj, "is_error") {
            None | Some(Value::Bool(false)) => {}
            Some(Value::Bool(true)) => self.ignored.push(format!("{bp}.is_error")),
            Some(other) => {
                return Err(invalid_type(
                    format!("{bp}.is_error"),
                    format!("`is_error` must be a boolean, not {}.", kind_of(other)),
                ))
            }
        }
        let (message, _) = tool_message(&self.messages, &mut self.call_names, id, content);
        self.messages.push(message);
        self.origins.push(Origin { path: bp.to_string(), result: Some(bp.to_string()), ..Origin::default() });
        Ok(())
    }

    /// A chat `param` in the Messages request's terms.
    fn rename(&self, param: &str) -> String {
        if let Some(rest) = param.strip_prefix("messages[") {
            let Some((index, rest)) = rest.split_once(']') else { return "messages".into() };
            let Some(origin) = index.parse::<usize>().ok().and_then(|i| self.origins.get(i)) else {
                return "messages".into();
            };
            return origin.rename(rest);
        }
        if let Some(rest) = param.strip_prefix("tools[") {
            if let Some((i, tail)) = rest.split_once(']') {
                let tail = tail.strip_prefix(".function").unwrap_or(tail);
                let tail = tail.strip_prefix(".parameters").map_or(tail.to_string(), |t| format!(".input_schema{t}"));
                return format!("tools[{i}]{tail}");
            }
        }
        if let Some(rest) = param.strip_prefix("response_format") {
            let rest = rest.strip_prefix(".json_schema").unwrap_or(rest);
            return format!("output_config.format{rest}");
        }
        if let Some(rest) = param.strip_prefix("stop") {
            if rest.is_empty() || rest.starts_with('[') {
                return format!("stop_sequences{rest}");
            }
        }
        match param {
            "max_completion_tokens" => "max_tokens".into(),
            "tool_choice.function.name" => "tool_choice.name".into(),
            "tool_choice.function" => "tool_choice".into(),
            "parallel_tool_calls" => "tool_choice.disable_parallel_tool_use".into(),
            "user" => "metadata.user_id".into(),
            // (a prefill continued under a grammar, which chat refuses)
            "continue_final_message" | "add_generation_prompt" if self.prefill => {
                format!("messages[{}]", self.origins.len().saturating_sub(1))
            }
            other => other.into(),
        }
    }

    /// What chat reported as ignored (`param`), as the fields of this request that had no
    /// effect: a message's `tool_calls` are its `tool_use` blocks, and a tool result's `name`
    /// (which the translation added) is nothing the client sent.
    fn reported(&self, param: &str) -> Vec<String> {
        let origin = param
            .strip_prefix("messages[")
            .and_then(|rest| rest.split_once(']'))
            .and_then(|(i, rest)| Some((self.origins.get(i.parse::<usize>().ok()?)?, rest)));
        match origin {
            Some((o, ".name")) if o.result.is_some() => Vec::new(),
            Some((o, ".tool_calls")) if !o.calls.is_empty() => o.calls.clone(),
            _ => vec![self.rename(param)],
        }
    }

    /// `message` with the chat fields it quotes renamed, and chat's wording of the context
    /// error.
    fn words(&self, message: String, param: Option<&str>) -> String {
        let chat_fields =
            ["messages[", "tools[", "tool_choice.function", "response_format", "max_completion_tokens", "stop"];
        let out = rename_quoted(&message, |part| {
            if param.is_some_and(|p| p.starts_with("chat_template_kwargs")) {
                return None;
            }
            chat_fields.iter().any(|f| part.starts_with(f)).then(|| self.rename(part))
        });
        let out = out
            .replace("`tool_call_id`", "`tool_use_id`")
            .replace("`arguments`", "`input`")
            .replace("`parameters`", "`input_schema`")
            .replace("Function names are", "Tool names are")
            .replace(", as in OpenAI's API;", ";")
            .replace(
                "(response_format, structured_outputs, a forced tool_choice or strict tools)",
                "(output_config.format, a `tool_choice` of type any or tool, or strict tools)",
            );
        if !self.prefill {
            return out;
        }
        // (chat's and the template's wording of a continued final message: the template's
        // errors name the flag without backticks)
        out.replace("continue_final_message is set but", "the final assistant message (a prefill) is continued, but")
            .replace("`continue_final_message`", "a final assistant message (a prefill)")
            .replace("`add_generation_prompt`", "a final assistant message (a prefill)")
    }
}

impl Origin {
    /// A chat message's field path (`rest`, after `messages[i]`) from here.
    fn rename(&self, rest: &str) -> String {
        let path = &self.path;
        if let Some(call) = rest.strip_prefix(".tool_calls") {
            let at = call.strip_prefix('[').and_then(|c| c.split_once(']'));
            let block = at.and_then(|(j, _)| self.calls.get(j.parse::<usize>().ok()?));
            return match (block, at) {
                (Some(block), Some((_, tail))) => {
                    let tail = tail.strip_prefix(".function").unwrap_or(tail);
                    let tail = if tail.starts_with(".arguments") { ".input" } else { tail };
                    format!("{block}{tail}")
                }
                _ => self.calls.first().unwrap_or(path).clone(),
            };
        }
        if let Some(result) = &self.result {
            return match rest {
                "" => result.clone(),
                ".tool_call_id" => format!("{result}.tool_use_id"),
                ".name" => result.clone(),
                other => format!("{result}{other}"),
            };
        }
        if let Some(part) = rest.strip_prefix(".content") {
            let at = part.strip_prefix('[').and_then(|c| c.split_once(']'));
            if let Some(from) = at.and_then(|(j, _)| self.parts.get(j.parse::<usize>().ok()?)) {
                let tail = at.map_or("", |(_, t)| t);
                return format!("{from}{tail}");
            }
            return format!("{path}.content{part}");
        }
        if rest.starts_with(".reasoning_content") {
            return self.thinking.clone().unwrap_or_else(|| path.clone());
        }
        format!("{path}{rest}")
    }
}

/// The keys of a text block (at `bp`) that mean nothing here: unknown ones, and its
/// `citations` unless null or empty (no answer cites).
fn text_block_keys(obj: &Map<String, Value>, bp: &str) -> Result<Vec<String>, ApiError> {
    let mut out = block_keys(obj, &TEXT_KEYS, bp)?;
    if set(obj, "citations").is_some_and(|c| c.as_array().is_none_or(|a| !a.is_empty())) {
        out.push(format!("{bp}.citations"));
    }
    Ok(out)
}

/// The chat messages of `system` and `messages`.
fn conversation(obj: &Map<String, Value>) -> Result<Conversation, ApiError> {
    let mut conv = Conversation::default();
    match set(obj, "system") {
        None => {}
        // (no system prompt, as `[]`: a client that always sends one gets the template's
        // default, as one that leaves it out)
        Some(Value::String(s)) if s.is_empty() => {}
        Some(Value::String(s)) => {
            conv.messages.push(json!({"role": "system", "content": s}));
            conv.origins.push(Origin { path: "system".into(), ..Origin::default() });
        }
        Some(Value::Array(blocks)) if blocks.is_empty() => {}
        Some(Value::Array(blocks)) => {
            conv.messages.push(json!({"role": "system", "content": []}));
            conv.origins.push(Origin { path: "system".into(), ..Origin::default() });
            for (j, block) in blocks.iter().enumerate() {
                let bp = format!("system[{j}]");
                let b = as_object(block, bp.clone(), "Each system block")?;
                if require_str(b, "type", &bp)? != "text" {
                    return Err(ApiError::invalid(format!("{bp}.type"), "System blocks have type \"text\"."));
                }
                conv.ignored.extend(text_block_keys(b, &bp)?);
                let text = require_str(b, "text", &bp)?;
                conv.text(0, text, bp);
            }
        }
        Some(other) => {
            return Err(invalid_type(
                "system",
                format!("`system` must be a string or a list of text blocks, not {}.", kind_of(other)),
            ))
        }
    }
    match obj.get("messages") {
        None => return Err(missing("messages".into())),
        Some(Value::Array(list)) => {
            if list.is_empty() {
                return Err(ApiError::invalid("messages", "`messages` must not be an empty list."));
            }
            for (i, m) in list.iter().enumerate() {
                conv.message(i, m)?;
            }
            if list.iter().all(|m| m["role"] == "system") {
                return Err(ApiError::invalid(
                    "messages",
                    "`messages` must hold a user or assistant message: system messages alone are nothing to answer.",
                ));
            }
        }
        Some(other) => {
            return Err(invalid_type("messages", format!("`messages` must be a list, not {}.", kind_of(other))))
        }
    }
    conv.prefill = conv.messages.last().is_some_and(|m| m["role"] == "assistant");
    Ok(conv)
}

/// Custom tools -> chat's function tools (a server tool is a 400).
fn chat_tools(tools: &Value, ignored: &mut Vec<String>) -> Result<Value, ApiError> {
    let list = tools
        .as_array()
        .ok_or_else(|| invalid_type("tools", format!("`tools` must be a list, not {}.", kind_of(tools))))?;
    let mut out = Vec::with_capacity(list.len());
    for (i, tool) in list.iter().enumerate() {
        let p = format!("tools[{i}]");
        let obj = as_object(tool, p.clone(), "Each tool")?;
        match set(obj, "type") {
            None => {}
            Some(Value::String(t)) if t == "custom" => {}
            Some(Value::String(t)) => {
                return Err(unsupported(
                    format!("{p}.type"),
                    format!(
                        "Tools of type {t:?} are not supported: this server runs no server tools and knows no \
                         built-in tool's schema; send custom tools with an `input_schema`."
                    ),
                ))
            }
            Some(other) => {
                return Err(invalid_type(
                    format!("{p}.type"),
                    format!("`type` must be a string, not {}.", kind_of(other)),
                ))
            }
        }
        ignored.extend(block_keys(obj, &TOOL_KEYS, &p)?);
        let name = require_str(obj, "name", &p)?;
        let schema = match obj.get("input_schema") {
            None | Some(Value::Null) => return Err(missing(format!("{p}.input_schema"))),
            Some(schema) => schema.clone(),
        };
        // (in chat's order, `name`, `description`, `parameters`: templates that write the
        // tools as JSON show them to the model so, and a Messages request renders as its chat
        // equivalent)
        let mut function = json!({"name": name});
        if let Some(v) = set(obj, "description") {
            function["description"] = v.clone();
        }
        function["parameters"] = schema;
        if let Some(v) = set(obj, "strict") {
            function["strict"] = v.clone();
        }
        out.push(json!({"type": "function", "function": function}));
    }
    Ok(Value::Array(out))
}

/// Messages' `tool_choice` -> chat's `tool_choice`, and whether it disables parallel calls.
fn chat_tool_choice(choice: &Value, ignored: &mut Vec<String>) -> Result<(Value, bool), ApiError> {
    let obj = as_object(choice, "tool_choice", "`tool_choice`")?;
    ignored.extend(unknown_keys_in(obj, &["type", "name", "disable_parallel_tool_use"], "tool_choice"));
    let serial = match set(obj, "disable_parallel_tool_use") {
        None => false,
        Some(Value::Bool(b)) => *b,
        Some(other) => {
            return Err(invalid_type(
                "tool_choice.disable_parallel_tool_use",
                format!("`disable_parallel_tool_use` must be a boolean, not {}.", kind_of(other)),
            ))
        }
    };
    let chat = match require_str(obj, "type", "tool_choice")? {
        "auto" => json!("auto"),
        "any" => json!("required"),
        "none" => json!("none"),
        "tool" => json!({"type": "function", "function": {"name": require_str(obj, "name", "tool_choice")?}}),
        other => {
            return Err(ApiError::invalid(
                "tool_choice.type",
                format!("Unknown `tool_choice` type {other:?}: expected \"auto\", \"any\", \"tool\" or \"none\"."),
            ))
        }
    };
    Ok((chat, serial))
}

/// `output_config` (or the beta `output_format`) -> chat's `response_format`, if it sets one.
fn response_format(obj: &Map<String, Value>, ignored: &mut Vec<String>) -> Result<Option<Value>, ApiError> {
    let (format, p) = match (set(obj, "output_config"), set(obj, "output_format")) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid(
                "output_format",
                "Send the output format once: as `output_config.format` (or the beta `output_format`), not both.",
            ))
        }
        (Some(config), None) => {
            let config = as_object(config, "output_config", "`output_config`")?;
            ignored.extend(unknown_keys_in(config, &["format"], "output_config"));
            (set(config, "format"), "output_config.format")
        }
        (None, format) => (format, "output_format"),
    };
    let Some(format) = format else { return Ok(None) };
    let f = as_object(format, p, &format!("`{p}`"))?;
    match require_str(f, "type", p)? {
        "json_schema" => {}
        other => {
            return Err(ApiError::invalid(
                format!("{p}.type"),
                format!("Unknown output format {other:?}: expected \"json_schema\"."),
            ))
        }
    }
    ignored.extend(unknown_keys_in(f, &["type", "schema"], p));
    let Some(schema) = set(f, "schema") else { return Err(missing(format!("{p}.schema"))) };
    Ok(Some(json!({"type": "json_schema", "json_schema": {"name": "output", "schema": schema}})))
}

/// A Messages request, translated: the chat request it means, its conversation (for naming
/// chat's errors back) and the fields it reported itself.
struct Translated {
    chat: Value,
    conv: Conversation,
    ignored: Vec<String>,
    /// `thinking` switched the template's `enable_thinking` as it asked.
    switched: bool,
    /// `max_tokens: 0`: the prompt is run to fill the prefix cache, and nothing generated.
    warm_only: bool,
}

/// The value `thinking` gives a template's `enable_thinking`, when the template that renders
/// the request switches a parsed think block with it and the request's `chat_template_kwargs`
/// does not set it already.
fn enable_thinking(router: &Router, obj: &Map<String, Value>, with_tools: bool) -> Option<bool> {
    let kind = set(obj, "thinking")?.get("type")?.as_str()?;
    let on = match kind {
        "disabled" => false,
        "enabled" | "adaptive" | "between_tools" => true,
        _ => return None,
    };
    let template = router.templates().select(with_tools)?;
    let sent = set(obj, "chat_template_kwargs").and_then(|k| k.get("enable_thinking")).is_some();
    (super::chat::switches_thinking(router, template) && !sent).then_some(on)
}

/// The keys of a block (a tool, a system block) that mean nothing here, with its
/// `cache_control` checked ([`cache_control`]).
fn block_keys(obj: &Map<String, Value>, known: &[&str], path: &str) -> Result<Vec<String>, ApiError> {
    let mut out = unknown_keys_in(obj, known, path);
    out.extend(cache_control(obj, &format!("{path}.cache_control"))?);
    Ok(out)
}

/// Anthropic's `cache_control` at `p`: `{"type": "ephemeral", "ttl": "5m" | "1h"}`. The prefix
/// cache reuses every shared prefix by itself, so a breakpoint asks for nothing; `ttl: "1h"`
/// asks for a lifetime the cache does not promise and is reported (as is any other key); a
/// value of another shape is a 400, as Anthropic's API answers it.
fn cache_control(obj: &Map<String, Value>, p: &str) -> Result<Vec<String>, ApiError> {
    let Some(cc) = set(obj, "cache_control") else { return Ok(Vec::new()) };
    let cc = as_object(cc, p.to_string(), "`cache_control`")?;
    if require_str(cc, "type", p)? != "ephemeral" {
        return Err(ApiError::invalid(format!("{p}.type"), "`cache_control.type` must be \"ephemeral\"."));
    }
    let mut out = unknown_keys_in(cc, &["type", "ttl"], p);
    match set(cc, "ttl") {
        None => {}
        Some(Value::String(t)) if t == "5m" => {}
        Some(Value::String(t)) if t == "1h" => out.push(format!("{p}.ttl")),
        Some(_) => return Err(ApiError::invalid(format!("{p}.ttl"), "`cache_control.ttl` must be \"5m\" or \"1h\".")),
    }
    Ok(out)
}

/// Anthropic fields at the values that ask for what this server does anyway: the standard
/// speed and capacity, billing to the caller, no context edits, no thread, the requested model
/// alone. They pass without a word, as `thinking: {"type": "disabled"}` does.
const NO_OPS: [(&str, AsksNothing); 6] = [
    ("speed", |v| v == "standard"),
    ("service_tier", |v| v == "standard_only" || v == "auto"),
    ("billing_policy", |v| {
        v.as_object().is_some_and(|o| {
            o.get("bill_to") == Some(&json!("self")) && o.keys().all(|k| k == "type" || k == "bill_to")
        })
    }),
    ("context_management", |v| {
        v.as_object()
            .is_some_and(|o| o.get("edits").and_then(Value::as_array).is_some_and(Vec::is_empty) && o.len() == 1)
    }),
    ("thread", |v| *v == Value::Bool(false)),
    ("fallbacks", |v| v == "default"),
];

/// The error code of a refused `thread` (Anthropic's, which its SDK recovers from).
pub const THREAD_UNSUPPORTED: &str = "thread_unsupported_request";

/// Translates a Messages request (`count`: a `count_tokens` one, which has no `max_tokens`).
fn translate(router: &Router, obj: &Map<String, Value>, count: bool) -> Result<Translated, ApiError> {
    for (key, why) in OPENAI_ONLY {
        if set(obj, key).is_some() {
            return Err(unsupported(key, format!("`{key}` is not a Messages API field: {why}.")));
        }
    }
    // (an empty `mcp_servers` list asks for none; `container` is a string or an object, never a list)
    for key in ["mcp_servers", "container"] {
        if set(obj, key).is_some_and(|v| key == "container" || v.as_array().is_none_or(|a| !a.is_empty())) {
            return Err(unsupported(key, format!("`{key}` is not supported: this server runs no server tools.")));
        }
    }
    // A compaction request asks for a summary block in place of an answer (`stop_reason:
    // "compaction"`), which this server does not write (count_tokens ignores it, as Anthropic's)
    if !count && set(obj, "compaction").is_some() {
        return Err(unsupported(
            "compaction",
            "Compaction (`compaction`) is not supported: this server writes no compaction blocks; send the \
             conversation in `messages`.",
        ));
    }
    // A thread's later turns send only their new messages: answered as the whole conversation
    // they would get a different reply. The anthropic SDK's tool runner reads this rejection
    // (its `error.details`) and sends the whole history instead (audit 78).
    if set(obj, "thread").is_some_and(|v| *v != Value::Bool(false)) {
        return Err(ApiError::with_code(
            THREAD_UNSUPPORTED,
            Some("thread".into()),
            "Message threads (`thread`) are not supported: this server keeps no conversations; send the whole \
             conversation in `messages`.",
        ));
    }
    match obj.get("max_tokens") {
        None if !count => return Err(missing("max_tokens".into())),
        Some(Value::Null) if !count => {
            return Err(invalid_type("max_tokens", "`max_tokens` must be an integer, not null."))
        }
        // (chat's own check would say "at least 1": here 0 warms the prompt cache)
        Some(Value::Number(n)) if !count && n.as_i64().is_some_and(|n| n < 0) => {
            return Err(ApiError::invalid("max_tokens", format!("`max_tokens` must be at least 0, got {n}.")));
        }
        _ => {}
    }
    let mut ignored = Vec::new();
    let conv = conversation(obj)?;
    // (`tools: []` is no tools, and `tool_choice` auto or none beside none asks for nothing)
    let tools = set(obj, "tools").filter(|t| t.as_array().is_none_or(|a| !a.is_empty()));
    rules::check_turns(obj, tools.is_some())?;
    ignored.extend(conv.ignored.iter().cloned());

    // (vLLM's chat switch for returning the thinking: a message returns it as its `thinking`
    // blocks)
    if set(obj, "include_reasoning").is_some_and(|v| *v != Value::Bool(true)) {
        ignored.push("include_reasoning".into());
    }
    // (OpenAI's stored completions are chat's: a message is not stored)
    if set(obj, "store").is_some_and(|v| *v != Value::Bool(false)) {
        ignored.push("store".into());
    }
    const OWN: [&str; 15] = [
        "store",
        "include_reasoning",
        "messages",
        "system",
        "max_tokens",
        "stop_sequences",
        "metadata",
        "tools",
        "tool_choice",
        "thinking",
        "output_config",
        "output_format",
        "cache_control",
        "mcp_servers",
        "container",
    ];
    ignored.extend(cache_control(obj, "cache_control")?);
    let no_op = |k: &str, v: &Value| NO_OPS.iter().any(|(name, asks_nothing)| *name == k && asks_nothing(v));
    let mut chat: Map<String, Value> = obj
        .iter()
        .filter(|(k, v)| !OWN.contains(&k.as_str()) && !no_op(k, v))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    if count {
        // (counting generates nothing: a `max_tokens` or `stream` copied along asks for nothing)
        ignored.extend(["max_tokens", "stream"].iter().filter(|k| set(obj, k).is_some()).map(|k| k.to_string()));
        chat.remove("stream");
    }
    chat.insert("messages".into(), Value::Array(conv.messages.clone()));
    // (0, Anthropic's way to warm the prompt cache, is prepared as 1 and run as 0: chat takes
    // no 0)
    let warm_only = !count && set(obj, "max_tokens") == Some(&json!(0));
    if let Some(max) = set(obj, "max_tokens").filter(|_| !count) {
        chat.insert("max_completion_tokens".into(), if warm_only { json!(1) } else { max.clone() });
    }
    if let Some(stop) = set(obj, "stop_sequences") {
        if !stop.is_array() {
            return Err(invalid_type(
                "stop_sequences",
                format!("`stop_sequences` must be a list of strings, not {}.", kind_of(stop)),
            ));
        }
        chat.insert("stop".into(), stop.clone());
    }
    if let Some(metadata) = set(obj, "metadata") {
        let m = as_object(metadata, "metadata", "`metadata`")?;
        ignored.extend(unknown_keys_in(m, &["user_id"], "metadata"));
        match set(m, "user_id") {
            None => {}
            Some(Value::String(id)) => {
                // (a top-level `user`, vLLM's field, is what the request is logged by otherwise)
                let replaced = chat.insert("user".into(), Value::String(id.clone()));
                ignored.extend(replaced.map(|_| "user".to_string()));
            }
            Some(other) => {
                return Err(invalid_type(
                    "metadata.user_id",
                    format!("`user_id` must be a string, not {}.", kind_of(other)),
                ))
            }
        }
    }
    if let Some(tools) = tools {
        chat.insert("tools".into(), chat_tools(tools, &mut ignored)?);
    }
    if let Some(choice) = set(obj, "tool_choice") {
        let (choice, serial) = chat_tool_choice(choice, &mut ignored)?;
        let asks_nothing = choice == json!("auto") || choice == json!("none");
        if tools.is_some() || !asks_nothing {
            chat.insert("tool_choice".into(), choice);
        }
        if serial && tools.is_some() {
            chat.insert("parallel_tool_calls".into(), Value::Bool(false));
        } else if serial {
            ignored.push("tool_choice.disable_parallel_tool_use".into());
        }
    }
    if let Some(format) = response_format(obj, &mut ignored)? {
        chat.insert("response_format".into(), format);
    }
    let with_tools = tools.is_some() && chat.get("tool_choice") != Some(&json!("none"));
    let switched = match enable_thinking(router, obj, with_tools) {
        Some(on) => match chat.entry("chat_template_kwargs").or_insert_with(|| json!({})) {
            Value::Object(kwargs) => {
                kwargs.insert("enable_thinking".into(), Value::Bool(on));
                true
            }
            // (not an object: chat's 400)
            _ => false,
        },
        None => false,
    };
    if conv.prefill {
        // the answer continues the client's last assistant turn (unless it said otherwise)
        chat.entry("continue_final_message").or_insert(Value::Bool(true));
        chat.entry("add_generation_prompt").or_insert(Value::Bool(false));
    }
    Ok(Translated { chat: Value::Object(chat), conv, ignored, switched, warm_only })
}

/// What `thinking` asks for that this request will not do, given whether the model's
/// thinking is parsed (`reasoning`) and whether `thinking` switched it (`switched`).
fn thinking_ignored(obj: &Map<String, Value>, reasoning: bool, switched: bool) -> Result<Vec<String>, ApiError> {
    let Some(thinking) = set(obj, "thinking") else { return Ok(Vec::new()) };
    let t = as_object(thinking, "thinking", "`thinking`")?;
    let mut out = unknown_keys_in(t, &["type", "budget_tokens", "display"], "thinking");
    let kind = require_str(t, "type", "thinking")?;
    if kind == "enabled" {
        // (required by Anthropic's API; its bounds, at least 1024 and below `max_tokens`, are
        // not: they would keep thinking from short contexts)
        match t.get("budget_tokens") {
            None => return Err(missing("thinking.budget_tokens".into())),
            Some(Value::Null) => {
                return Err(invalid_type("thinking.budget_tokens", "`budget_tokens` must be an integer, not null."))
            }
            Some(_) => {}
        }
    }
    // (checked whatever the model: a request is refused or not alike on every one)
    if set(t, "budget_tokens").is_some_and(|b| !b.is_u64()) {
        return Err(invalid_type("thinking.budget_tokens", "`budget_tokens` must be a non-negative integer."));
    }
    match kind {
        "disabled" if reasoning && !switched => out.push("thinking".into()),
        // (a disabled config has only its `type`: a budget or display for it asks for nothing)
        "disabled" => out.extend(["budget_tokens", "display"].iter().filter(|k| set(t, k).is_some()).map(|k| format!("thinking.{k}"))),
        "enabled" | "adaptive" | "between_tools" if !reasoning => out.push("thinking".into()),
        "enabled" | "adaptive" | "between_tools" => {
            // (`budget_tokens` bounds the thinking: see `thinking_budget`)
            if set(t, "display").is_some_and(|d| d != "summarized") {
                out.push("thinking.display".into());
            }
        }
        other => {
            return Err(ApiError::invalid(
                "thinking.type",
                format!(
                    "Unknown `thinking` type {other:?}: expected \"enabled\", \"adaptive\", \"between_tools\" or \"disabled\"."
                ),
            ))
        }
    }
    Ok(out)
}

/// `thinking.budget_tokens` of a request that thinks (checked by `thinking_ignored`): the most
/// tokens each think block may hold, as chat's `thinking_token_budget` (Anthropic's API calls
/// it a target; here the block is closed once it is spent).
fn thinking_budget(obj: &Map<String, Value>) -> Option<u32> {
    let t = set(obj, "thinking")?;
    let on = matches!(t.get("type").and_then(Value::as_str), Some("enabled" | "adaptive" | "between_tools"));
    // (more tokens than any context holds is no bound at all)
    on.then(|| t.get("budget_tokens")?.as_u64()).flatten().map(|b| u32::try_from(b).unwrap_or(u32::MAX))
}

/// A context overflow in the words of Anthropic's API, which clients match on (LangChain's
/// ChatAnthropic raises its ContextOverflowError on "prompt is too long"): "prompt is too long:
/// N tokens > M maximum", or for a prompt that fits but leaves too little room for
/// `max_tokens`, "input length and `max_tokens` exceed context limit: N + K > M, ...". Other
/// errors as they are.
fn anthropic_overflow(err: ApiError) -> ApiError {
    let ApiError::ContextLengthExceeded { param, sizes: Some(sizes), .. } = err else {
        return err;
    };
    let Overflow { prompt, max_tokens, limit } = sizes;
    let message = match max_tokens {
        Some(m) if prompt <= limit => format!(
            "input length and `max_tokens` exceed context limit: {prompt} + {m} > {limit}, decrease input length \
             or `max_tokens` and try again"
        ),
        // (a prompt that fills the context leaves no room for a token: one fewer is the most)
        _ => {
            format!("prompt is too long: {prompt} tokens > {} maximum", if prompt > limit { limit } else { limit - 1 })
        }
    };
    ApiError::ContextLengthExceeded { message, param, sizes: Some(sizes) }
}

/// Validates a Messages request and prepares the chat request it means.
pub(crate) fn prepare(router: &Router, body: &[u8], header_id: Option<&str>) -> Result<Checked, ApiError> {
    let value = parse_body(body)?;
    let obj = value.as_object().expect("parse_body checks");
    let Translated { chat, conv, ignored, switched, warm_only } = translate(router, obj, false)?;
    // ours first: under strict field checking they are the 400
    let mut ignored = settle_ignored(ignored, router.config.strict_fields)?;
    let mut checked = chat::prepare_value(router, &chat, header_id)
        .map_err(|e| anthropic_overflow(rename_error(e, |p| conv.rename(p), |m, p| conv.words(m, p))))?;
    // (a grammar that fails while generating is named as this route names its fields)
    if let Some(grammar) = checked.prepared.grammar.as_mut() {
        grammar.rename_param(|p| conv.rename(p));
    }
    if warm_only {
        // (nothing is generated: no call either, not even a forced one's empty `input`)
        checked.prepared.params.max_tokens = Some(0);
        checked.prepared.tools = None;
    }
    let thinking = thinking_ignored(obj, checked.prepared.reasoning.is_some(), switched)?;
    ignored.extend(settle_ignored(thinking, router.config.strict_fields)?);
    if let (Some(budget), Some(plan)) = (thinking_budget(obj), checked.prepared.reasoning.as_mut()) {
        if checked.prepared.params.beam_search.is_some() {
            return Err(unsupported(
                "thinking.budget_tokens",
                "`thinking.budget_tokens` cannot be combined with `use_beam_search`: beams are not sampled, so their \
                 thinking cannot be closed for them.",
            ));
        }
        plan.budget = Some(budget);
    }

    ignored.extend(checked.ignored.iter().flat_map(|p| conv.reported(p)));
    let ignored = settle_ignored(ignored, router.config.strict_fields)?;
    let named = obj.get("request_id").is_some_and(Value::is_string) || header_id.is_some();
    checked.adopt(ignored, Endpoint::Messages, "msg", named);
    Ok(checked)
}

/// `POST /v1/messages/count_tokens`: `{"input_tokens": N}`, the tokens the request's prompt
/// (system prompt, messages and tools, through the chat template) comes to.
pub(crate) fn count_tokens(router: &Router, body: &[u8]) -> Result<Handled, ApiError> {
    let value = parse_body(body)?;
    let obj = value.as_object().expect("parse_body checks");
    let Translated { chat, conv, ignored, switched, .. } = translate(router, obj, true)?;
    let ignored = settle_ignored(ignored, router.config.strict_fields)?;
    let checked = chat::prepare_to_count(router, &chat)
        .map_err(|e| rename_error(e, |p| conv.rename(p), |m, p| conv.words(m, p)))?;
    let thinking = thinking_ignored(obj, checked.prepared.reasoning.is_some(), switched)?;
    let chat_ignored = checked.ignored.iter().flat_map(|p| conv.reported(p));
    let all = ignored.into_iter().chain(chat_ignored).chain(thinking).collect();
    let ignored = settle_ignored(all, router.config.strict_fields)?;
    let tokens = checked.prepared.prompts.first().map_or(0, Vec::len);
    let body = serde_json::to_vec(&json!({"input_tokens": tokens})).expect("bodies serialize");
    Ok(Handled { body, headers: super::common::ignored_header(&ignored).into_iter().collect() })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::budget::check_context;

    fn worded(prompt: usize, max_tokens: Option<u32>) -> String {
        let param = max_tokens.map(|_| "max_completion_tokens");
        anthropic_overflow(check_context(prompt, max_tokens, param, 100, "messages").unwrap_err()).message()
    }

    #[test]
    fn overflows_read_as_anthropics_api_words_them() {
        assert_eq!(worded(120, Some(8)), "prompt is too long: 120 tokens > 100 maximum");
        assert_eq!(
            worded(100, Some(8)),
            "input length and `max_tokens` exceed context limit: 100 + 8 > 100, decrease input length or \
             `max_tokens` and try again"
        );
        // (a prompt that fills the context leaves no room: 99 tokens is the most)
        assert_eq!(worded(100, None), "prompt is too long: 100 tokens > 99 maximum");
        let other = ApiError::invalid("top_k", "no");
        assert_eq!(anthropic_overflow(other.clone()), other);
    }
}
