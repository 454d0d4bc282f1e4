//! Which shape of message `content` a chat template expects.
//!
//! Clients may send `content` as a string or as a list of text parts. Templates differ: some
//! loop over the parts (`{% for part in message['content'] %}`), most concatenate
//! `message['content']` as a string and would print a list's repr. So each template's format is
//! detected from its text (`OpenAi`: it walks the parts; `String`: it does not) and can be
//! overridden (`--chat-template-content-format`). For `String` templates, text parts are joined
//! with "\n" before rendering, as vLLM does; string content passes through untouched.
//!
//! An assistant's `{"type": "refusal", "refusal": ...}` part becomes a text part of that text.
//!
//! String content reaches an `OpenAi` template as a string: most such templates test
//! `is string` and print it, some only for some roles (Mistral-Small-3.1 concatenates the
//! system prompt as a string but walks a user turn's parts). Detection reads the template's
//! text, and misses templates that reach the parts another way (through an alias, a macro's
//! parameter, a filter). So when a render leaves out some of the messages' text, the chat
//! route renders once more with parts as sent and strings as one text part each, and keeps
//! that if it shows all of it (`chat::render`). `--chat-template-content-format` renders one
//! shape as told: `openai` wraps strings as one part each.
//!
//! A message without content (`content: null` or absent: an assistant turn that only calls
//! tools) reaches the template as `""` for `String` templates and as `[]` for `OpenAi` ones, as
//! vLLM renders it: templates concatenate or loop over `content` without checking for none.
//!
//! Assistant `tool_calls` arrive with `function.arguments` as a JSON string (OpenAI's wire
//! shape), but templates read it as a mapping (`arguments | tojson`, Qwen3-Coder's
//! `arguments | items`). A string that holds a JSON object is given to the template as that
//! object, as vLLM does; any other string is left as it is.

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::Value;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ContentFormat {
    /// The template concatenates `content` as a string.
    String,
    /// The template iterates `content` as OpenAI's list of parts.
    OpenAi,
}

impl ContentFormat {
    /// Detect from the template text: a `{% for ... %}` tag over something named `content`, or
    /// indexing into `content` (`content[0]`, `content'][0]`), means the template walks parts.
    pub fn detect(source: &str) -> Self {
        let compact: String = source.chars().filter(|c| !c.is_whitespace()).collect();
        let indexes_parts = ["content'][0]", "content\"][0]", "content[0]"].iter().any(|p| compact.contains(p));
        let loops_parts = source.split("{%").skip(1).any(|tag| {
            let tag = tag.split("%}").next().unwrap_or("").trim_start_matches(['-', '+']).trim_start();
            tag.starts_with("for ") && tag.split(" in ").nth(1).is_some_and(|iterable| iterable.contains("content"))
        });
        if indexes_parts || loops_parts {
            Self::OpenAi
        } else {
            Self::String
        }
    }
}

/// The messages as the template should see them: unchanged unless the template wants strings
/// and some message sent a list of text parts, some message has no content, or an assistant
/// message carries tool calls whose arguments are a JSON object in a string.
pub fn normalize(messages: &Value, format: ContentFormat) -> Cow<'_, Value> {
    let joins = |m: &Value| format == ContentFormat::String && m.get("content").is_some_and(Value::is_array);
    let Some(list) = messages.as_array() else { return Cow::Borrowed(messages) };
    if !list.iter().any(|m| joins(m) || lacks_content(m) || has_refusal(m) || string_arguments(m).next().is_some()) {
        return Cow::Borrowed(messages);
    }
    let normalized = list
        .iter()
        .map(|m| {
            let mut m = m.clone();
            if let Some(Value::Array(parts)) = m.get_mut("content") {
                // An assistant's refusal is its text, as vLLM renders it.
                for part in parts.iter_mut().filter(|p| is_refusal(p)) {
                    let text = part.get("refusal").cloned().unwrap_or_default();
                    *part = serde_json::json!({"type": "text", "text": text});
                }
            }
            if lacks_content(&m) {
                m["content"] = match format {
                    ContentFormat::String => Value::String(String::new()),
                    ContentFormat::OpenAi => Value::Array(Vec::new()),
                };
            }
            if joins(&m) {
                let parts = m["content"].as_array().into_iter().flatten();
                let text: Vec<&str> = parts.filter_map(|p| p.get("text").and_then(Value::as_str)).collect();
                m["content"] = Value::String(text.join("\n"));
            }
            if let Some(Value::Array(calls)) = m.get_mut("tool_calls") {
                for call in calls {
                    let Some(args) = call.get_mut("function").and_then(|f| f.get_mut("arguments")) else { continue };
                    if let Some(object) = args.as_str().and_then(json_object) {
                        *args = object;
                    }
                }
            }
            m
        })
        .collect();
    Cow::Owned(Value::Array(normalized))
}

/// The messages' text, trimmed and non-empty: each string `content` and each text part's
/// `text`. What a render should show.
pub fn message_texts(messages: &Value) -> Vec<&str> {
    let mut texts = Vec::new();
    for content in messages.as_array().into_iter().flatten().filter_map(|m| m.get("content")) {
        match content {
            Value::String(s) => texts.push(s.as_str()),
            Value::Array(parts) => texts.extend(parts.iter().filter_map(|p| p.get("text")?.as_str())),
            _ => {}
        }
    }
    texts.into_iter().map(str::trim).filter(|t| !t.is_empty()).collect()
}

/// Whether `rendered` holds every one of `texts`. Templates write messages in order, so each
/// is looked for after the previous one first (one pass over a long conversation), and
/// anywhere only when not found there.
pub fn shows_all(rendered: &str, texts: &[&str]) -> bool {
    let mut at = 0;
    texts.iter().all(|t| match rendered[at..].find(t) {
        Some(i) => {
            at += i + t.len();
            true
        }
        None => rendered.contains(t),
    })
}

/// `messages` with each string `content` as one text part, the shape a template that only
/// walks parts can show.
pub fn wrap_strings(messages: &Value) -> Value {
    let mut out = messages.clone();
    for m in out.as_array_mut().into_iter().flatten() {
        if let Some(text) = m.get("content").and_then(Value::as_str) {
            m["content"] = serde_json::json!([{"type": "text", "text": text}]);
        }
    }
    out
}

fn is_refusal(part: &Value) -> bool {
    part.get("type").and_then(Value::as_str) == Some("refusal")
}

/// A message with a refusal part in its content.
fn has_refusal(message: &Value) -> bool {
    message.get("content").and_then(Value::as_array).is_some_and(|parts| parts.iter().any(is_refusal))
}

/// A message object whose `content` is null or absent.
fn lacks_content(message: &Value) -> bool {
    message.as_object().is_some_and(|o| o.get("content").is_none_or(Value::is_null))
}

/// An assistant message's tool-call arguments sent as strings holding a JSON object.
fn string_arguments(message: &Value) -> impl Iterator<Item = Value> + '_ {
    let calls = message.get("tool_calls").and_then(Value::as_array).into_iter().flatten();
    calls.filter_map(|c| c.get("function")?.get("arguments")?.as_str().and_then(json_object))
}

fn json_object(text: &str) -> Option<Value> {
    serde_json::from_str::<Value>(text).ok().filter(Value::is_object)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn detects_templates_that_walk_parts() {
        let walks = "{% for m in messages %}{% for part in m['content'] %}{{ part['text'] }}{% endfor %}{% endfor %}";
        assert_eq!(ContentFormat::detect(walks), ContentFormat::OpenAi);
        let walks_dot = "{%- for p in message.content -%}{{ p.text }}{%- endfor -%}";
        assert_eq!(ContentFormat::detect(walks_dot), ContentFormat::OpenAi);
        let indexes = "{{ message['content'][0]['text'] }}";
        assert_eq!(ContentFormat::detect(indexes), ContentFormat::OpenAi);
        let concatenates = "{% for message in messages %}{{ '<|im_start|>' + message['content'] }}{% endfor %}";
        assert_eq!(ContentFormat::detect(concatenates), ContentFormat::String);
    }

    #[test]
    fn shows_all_finds_texts_in_order_or_anywhere() {
        assert!(shows_all("<s>be brief</s><s>hello</s>", &["be brief", "hello"]));
        assert!(shows_all("<s>hello</s><sys>be brief</sys>", &["be brief", "hello"]), "a template may reorder");
        assert!(shows_all("hello hello", &["hello", "hello"]));
        assert!(!shows_all("<s>hello</s>", &["be brief", "hello"]));
        assert!(shows_all("anything", &[]));
    }

    #[test]
    fn joins_parts_for_string_templates_only() {
        let messages = json!([
            {"role": "system", "content": "plain"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
        ]);
        let joined = normalize(&messages, ContentFormat::String);
        assert_eq!(joined[1]["content"], "a\nb");
        assert_eq!(joined[0]["content"], "plain");
        assert!(matches!(normalize(&messages, ContentFormat::OpenAi), Cow::Borrowed(_)));
        let strings = json!([{"role": "user", "content": "x"}]);
        assert!(matches!(normalize(&strings, ContentFormat::String), Cow::Borrowed(_)));
    }

    #[test]
    fn refusal_parts_render_as_text() {
        let messages = json!([
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]}
        ]);
        assert_eq!(normalize(&messages, ContentFormat::String)[1]["content"], "I can't.");
        assert_eq!(
            normalize(&messages, ContentFormat::OpenAi)[1]["content"],
            json!([{"type": "text", "text": "I can't."}])
        );
    }

    #[test]
    fn tool_call_arguments_reach_templates_as_objects() {
        let messages = json!([
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"city\": \"Paris\"}"}},
                {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "not json"}},
                {"id": "call_3", "type": "function", "function": {"name": "h", "arguments": {"a": 1}}}
            ]}
        ]);
        let out = normalize(&messages, ContentFormat::OpenAi);
        let calls = &out[1]["tool_calls"];
        assert_eq!(calls[0]["function"]["arguments"], json!({"city": "Paris"}));
        assert_eq!(calls[1]["function"]["arguments"], "not json");
        assert_eq!(calls[2]["function"]["arguments"], json!({"a": 1}));
        let objects_only =
            json!([{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "h", "arguments": {}}}]}]);
        assert!(matches!(normalize(&objects_only, ContentFormat::String), Cow::Borrowed(_)));
    }

    #[test]
    fn missing_content_is_empty_in_the_templates_shape() {
        let messages = json!([
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": null, "tool_calls": []},
            {"role": "assistant"}
        ]);
        let strings = normalize(&messages, ContentFormat::String);
        assert_eq!((&strings[1]["content"], &strings[2]["content"]), (&json!(""), &json!("")));
        assert_eq!(strings[0]["content"], "x");
        let parts = normalize(&messages, ContentFormat::OpenAi);
        assert_eq!((&parts[1]["content"], &parts[2]["content"]), (&json!([]), &json!([])));
    }
}
