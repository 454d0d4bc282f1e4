//! Anthropic's rules for a conversation (the module doc of [`super`] lists them), checked on
//! `messages` as sent, before the translation.

use serde_json::{Map, Value};

use super::set;
use crate::error::ApiError;

/// One content block of a turn, as the conversation rules see it.
enum Block<'a> {
    Text(&'a str),
    ToolUse(&'a str),
    ToolResult(&'a str),
    Other,
}

/// The blocks of message `i` with their paths (a string content is one text block).
fn blocks_of(m: &Value, i: usize) -> Vec<(String, Block<'_>)> {
    match &m["content"] {
        Value::String(s) => vec![(format!("messages[{i}].content"), Block::Text(s))],
        Value::Array(list) => list
            .iter()
            .enumerate()
            .map(|(j, b)| {
                let id = |key: &str| b[key].as_str().unwrap_or_default();
                let block = match b["type"].as_str() {
                    Some("text") => Block::Text(b["text"].as_str().unwrap_or_default()),
                    Some("tool_use") => Block::ToolUse(id("id")),
                    Some("tool_result") => Block::ToolResult(id("tool_use_id")),
                    _ => Block::Other,
                };
                (format!("messages[{i}].content[{j}]"), block)
            })
            .collect(),
        _ => Vec::new(),
    }
}

/// Anthropic's rules for a conversation (see the module doc), on `messages` as sent (after
/// `conversation` checked their shapes): a 400 naming the block that breaks one.
pub(super) fn check_turns(obj: &Map<String, Value>, has_tools: bool) -> Result<(), ApiError> {
    match set(obj, "system") {
        Some(Value::Array(system)) => {
            if let Some(j) = system.iter().position(|b| b["text"].as_str().is_some_and(blank)) {
                return Err(blank_text(format!("system[{j}].text")));
            }
        }
        // (a string is one text block, as Anthropic reads it; "" is no system prompt, as `[]`)
        Some(Value::String(s)) if !s.is_empty() && blank(s) => return Err(blank_text("system".into())),
        _ => {}
    }
    let Some(Value::Array(list)) = obj.get("messages") else { return Ok(()) };
    let last = list.len() - 1;
    // The tool_use blocks of the last assistant turn not answered yet: (id, path).
    let mut pending: Vec<(&str, String)> = Vec::new();
    let mut ids = std::collections::HashSet::new();
    let mut tool_blocks = None;
    // Whether the user turn so far holds a block other than a tool_result.
    let mut other_first = false;
    for (i, m) in list.iter().enumerate() {
        let assistant = m["role"] == "assistant";
        let turn_starts = i == 0 || list[i - 1]["role"] != m["role"];
        if turn_starts {
            if assistant {
                if let Some((id, at)) = pending.first() {
                    return Err(unanswered(id, at));
                }
            } else {
                other_first = false;
            }
        }
        let prefill = assistant && i == last;
        if m["content"] == "" && !prefill {
            return Err(ApiError::invalid(
                format!("messages[{i}].content"),
                "Every message must have non-empty content, except a final assistant message.",
            ));
        }
        for (path, block) in blocks_of(m, i) {
            match block {
                // (a prefill may be an empty string, and its trailing whitespace has its own
                // error, below)
                Block::Text(text) if blank(text) && !(prefill && (!text.is_empty() || !path.ends_with(']'))) => {
                    let at = if path.ends_with(']') { format!("{path}.text") } else { path };
                    return Err(blank_text(at));
                }
                Block::ToolUse(id) => {
                    if !ids.insert(id) {
                        return Err(ApiError::invalid(
                            format!("{path}.id"),
                            format!("`tool_use` ids must be unique: {id:?} is used more than once."),
                        ));
                    }
                    tool_blocks.get_or_insert_with(|| path.clone());
                    pending.push((id, path));
                }
                Block::ToolResult(id) => {
                    tool_blocks.get_or_insert_with(|| path.clone());
                    if other_first {
                        return Err(ApiError::invalid(
                            path,
                            "`tool_result` blocks must come first in a user message, before any other content.",
                        ));
                    }
                    let Some(k) = pending.iter().position(|(p, _)| *p == id) else {
                        return Err(ApiError::invalid(
                            format!("{path}.tool_use_id"),
                            format!(
                                "Unexpected `tool_use_id` {id:?}: each `tool_result` block answers a `tool_use` \
                                 block of the assistant message right before it, once."
                            ),
                        ));
                    };
                    pending.remove(k);
                }
                Block::Text(_) | Block::Other if !assistant => {
                    if let Some((id, at)) = pending.first() {
                        return Err(unanswered(id, at));
                    }
                    other_first = true;
                }
                Block::Text(_) | Block::Other => {}
            }
        }
    }
    if let Some((id, at)) = pending.first() {
        return Err(unanswered(id, at));
    }
    if let (Some(at), false) = (tool_blocks, has_tools) {
        return Err(ApiError::invalid(
            "tools",
            format!("A request with `tool_use` or `tool_result` blocks ({at}) must define `tools`."),
        ));
    }
    let prefill = &list[last];
    if prefill["role"] == "assistant" {
        let text = match &prefill["content"] {
            Value::String(s) => Some(s.as_str()),
            Value::Array(blocks) => blocks.last().and_then(|b| b["text"].as_str()),
            _ => None,
        };
        if text.is_some_and(|t| t.ends_with(char::is_whitespace)) {
            return Err(ApiError::invalid(
                format!("messages[{last}].content"),
                "The final assistant message (a prefill) cannot end with trailing whitespace.",
            ));
        }
    }
    Ok(())
}

/// Whether a text block holds no text but whitespace (an empty one included).
fn blank(text: &str) -> bool {
    text.trim().is_empty()
}

/// The 400 of a text block at `at` with nothing but whitespace.
fn blank_text(at: String) -> ApiError {
    ApiError::invalid(at, "Text content blocks must contain non-whitespace text.")
}

/// The 400 of a `tool_use` block (at `at`) whose `tool_result` does not follow it.
fn unanswered(id: &str, at: &str) -> ApiError {
    ApiError::invalid(
        at,
        format!(
            "`tool_use` {id:?} has no `tool_result` right after it: each `tool_use` block needs a \
             `tool_result` block at the start of the next user message."
        ),
    )
}
