//! Tool calls: the text format a model writes them in, the grammar that forces them
//! (`tool_choice: "required"` or a named function), and the parser that turns generated
//! text back into `tool_calls`.
//!
//! Formats:
//! - `hermes`: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block per
//!   call; chosen when the chat template's text mentions `<tool_call>` (Hermes, Qwen2.5+).
//! - `json`: llmserve's default for templates that know no tool format (SmolLM2): the whole
//!   output is one call object `{"name": ..., "arguments": {...}}`, or, when parallel calls
//!   are allowed, a JSON array of them. It is only used under a forced `tool_choice`: with
//!   `"auto"` and no known format, a model's JSON-looking text stays text.
//!
//! Invariant: the parser never loses text. What is not a complete, well-formed call is
//! returned as content; only whitespace around calls is dropped.

use serde_json::{json, Value};

use crate::structured::GrammarSource;

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// How a chat request's output is read for tool calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ToolParsing {
    pub format: ToolCallFormat,
    /// false: the choice ends when its first call completes.
    pub parallel: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ToolCallFormat {
    Json,
    Hermes,
}

impl ToolCallFormat {
    /// `--tool-call-format` values: "json", "hermes".
    pub fn from_name(s: &str) -> Option<Self> {
        match s {
            "json" => Some(Self::Json),
            "hermes" => Some(Self::Hermes),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Json => "json",
            Self::Hermes => "hermes",
        }
    }

    /// The format a chat template teaches its model, if it teaches one we parse.
    pub fn detect(template_source: &str) -> Option<Self> {
        template_source.contains(OPEN).then_some(Self::Hermes)
    }

    /// The grammar forcing at least one call (exactly one unless `parallel`) to one of
    /// `functions` (each the `function` object of a tool as sent), with arguments that
    /// match that function's `parameters` schema.
    pub fn forced_grammar(self, functions: &[&Value], parallel: bool) -> GrammarSource {
        let calls: Vec<Value> = functions.iter().map(|f| call_schema(f)).collect();
        let one = if calls.len() == 1 { calls[0].clone() } else { json!({"anyOf": calls}) };
        match self {
            Self::Json if parallel => GrammarSource::JsonSchema(json!({"type": "array", "items": one, "minItems": 1})),
            Self::Json => GrammarSource::JsonSchema(one),
            Self::Hermes => {
                let mut schema = one;
                schema["x-guidance"] =
                    json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "});
                let start = if parallel { "start: call (\"\\n\" call)*" } else { "start: call" };
                GrammarSource::Lark(format!(
                    "{start}\ncall: \"{OPEN}\\n\" %json {schema} \"\\n{CLOSE}\"\n",
                    schema = serde_json::to_string(&schema).expect("JSON values serialize")
                ))
            }
        }
    }
}

/// The schema of one call to `function`.
fn call_schema(function: &Value) -> Value {
    let name = function.get("name").cloned().unwrap_or(Value::Null);
    let params = match function.get("parameters") {
        Some(p @ Value::Object(_)) => p.clone(),
        _ => json!({"type": "object", "properties": {}}),
    };
    json!({
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": false,
    })
}

/// One parsed call; `arguments` is the JSON text of the arguments object.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    pub arguments: String,
}

/// What a push or the finish produced: content to send and calls completed.
#[derive(Debug, Default, PartialEq)]
pub struct Parsed {
    pub content: String,
    pub calls: Vec<ToolCall>,
}

/// Splits one choice's generated text into content and tool calls, incrementally.
pub struct ToolCallParser {
    format: ToolCallFormat,
    /// Text not yet classified (a possible `<tool_call>` prefix, an open block, or, for the
    /// json format, everything).
    buf: String,
    inside: bool,
    /// Whitespace-only content held back: dropped if it only surrounds calls.
    held_ws: String,
    found: usize,
}

impl ToolCallParser {
    pub fn new(format: ToolCallFormat) -> Self {
        Self { format, buf: String::new(), inside: false, held_ws: String::new(), found: 0 }
    }

    pub fn calls_found(&self) -> usize {
        self.found
    }

    pub fn push(&mut self, text: &str) -> Parsed {
        self.buf.push_str(text);
        let mut out = Parsed::default();
        if self.format == ToolCallFormat::Json {
            return out;
        }
        loop {
            if self.inside {
                let Some(end) = self.buf.find(CLOSE) else { break };
                let body = self.buf[..end].to_string();
                self.buf.drain(..end + CLOSE.len());
                self.inside = false;
                match parse_call(body.trim()) {
                    Some(call) => self.call(call, &mut out),
                    None => self.content(&format!("{OPEN}{body}{CLOSE}"), &mut out),
                }
            } else if let Some(start) = self.buf.find(OPEN) {
                let before = self.buf[..start].to_string();
                self.content(&before, &mut out);
                self.buf.drain(..start + OPEN.len());
                self.inside = true;
            } else {
                // Keep back the longest tail that may still grow into `<tool_call>`.
                let keep = (1..OPEN.len().min(self.buf.len() + 1))
                    .rev()
                    .find(|&k| {
                        self.buf.is_char_boundary(self.buf.len() - k)
                            && OPEN.starts_with(&self.buf[self.buf.len() - k..])
                    })
                    .unwrap_or(0);
                let emit: String = self.buf.drain(..self.buf.len() - keep).collect();
                self.content(&emit, &mut out);
                break;
            }
        }
        out
    }

    /// Generation ended: classify what is left.
    pub fn finish(&mut self) -> Parsed {
        let mut out = Parsed::default();
        let rest = std::mem::take(&mut self.buf);
        match self.format {
            ToolCallFormat::Json => match parse_json_calls(rest.trim()) {
                Some(calls) => calls.into_iter().for_each(|c| self.call(c, &mut out)),
                None => self.content(&rest, &mut out),
            },
            ToolCallFormat::Hermes => {
                let text = if self.inside { format!("{OPEN}{rest}") } else { rest };
                self.inside = false;
                self.content(&text, &mut out);
            }
        }
        if self.found == 0 {
            out.content.push_str(&std::mem::take(&mut self.held_ws));
        }
        out
    }

    fn content(&mut self, text: &str, out: &mut Parsed) {
        if text.is_empty() {
            return;
        }
        if text.trim().is_empty() {
            self.held_ws.push_str(text);
            return;
        }
        // Whitespace before the first call is content; after a call it only separates blocks.
        let ws = std::mem::take(&mut self.held_ws);
        if self.found == 0 {
            out.content.push_str(&ws);
        }
        out.content.push_str(text);
    }

    fn call(&mut self, (name, arguments): (String, String), out: &mut Parsed) {
        self.held_ws.clear();
        self.found += 1;
        out.calls.push(ToolCall {
            id: format!("call_{}", &uuid::Uuid::new_v4().simple().to_string()[..24]),
            name,
            arguments,
        });
    }
}

/// `{"name": ..., "arguments": {...}}` (also `parameters`, or arguments as a JSON string).
fn call_from_value(v: &Value) -> Option<(String, String)> {
    let obj = v.as_object()?;
    let name = obj.get("name")?.as_str()?.to_string();
    let args = match obj.get("arguments").or_else(|| obj.get("parameters")) {
        None => json!({}),
        Some(Value::String(s)) => serde_json::from_str::<Value>(s).ok().filter(Value::is_object)?,
        Some(v @ Value::Object(_)) => v.clone(),
        Some(_) => return None,
    };
    Some((name, serde_json::to_string(&args).expect("JSON values serialize")))
}

fn parse_call(text: &str) -> Option<(String, String)> {
    call_from_value(&serde_json::from_str(text).ok()?)
}

fn parse_json_calls(text: &str) -> Option<Vec<(String, String)>> {
    match serde_json::from_str::<Value>(text).ok()? {
        Value::Array(items) if !items.is_empty() => items.iter().map(call_from_value).collect(),
        v @ Value::Object(_) => Some(vec![call_from_value(&v)?]),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(format: ToolCallFormat, pieces: &[&str]) -> (String, Vec<(String, String)>) {
        let mut p = ToolCallParser::new(format);
        let mut content = String::new();
        let mut calls = Vec::new();
        for piece in pieces {
            let out = p.push(piece);
            content.push_str(&out.content);
            calls.extend(out.calls);
        }
        let out = p.finish();
        content.push_str(&out.content);
        calls.extend(out.calls);
        assert!(calls.iter().all(|c| c.id.starts_with("call_") && c.id.len() == 29));
        (content, calls.into_iter().map(|c| (c.name, c.arguments)).collect())
    }

    #[test]
    fn hermes_calls_split_across_pieces() {
        let pieces = [
            "Let me check.",
            "\n<tool",
            "_call>\n{\"name\": \"get\", \"argu",
            "ments\": {\"city\": \"Paris\"}}\n</tool_call>",
            "\n",
        ];
        let (content, calls) = run(ToolCallFormat::Hermes, &pieces);
        assert_eq!(content, "Let me check.");
        assert_eq!(calls, vec![("get".to_string(), "{\"city\":\"Paris\"}".to_string())]);
    }

    #[test]
    fn hermes_two_calls_and_broken_block_stays_text() {
        let text = "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>\n<tool_call>{\"name\": \"b\", \"arguments\": \"{\\\"x\\\": 1}\"}</tool_call>";
        let (content, calls) = run(ToolCallFormat::Hermes, &[text]);
        assert_eq!(content, "");
        assert_eq!(calls, vec![("a".into(), "{}".into()), ("b".into(), "{\"x\":1}".into())]);
        let (content, calls) = run(ToolCallFormat::Hermes, &["x <tool_call>not json</tool_call> y <tool_call>{\"na"]);
        assert!(calls.is_empty());
        assert_eq!(content, "x <tool_call>not json</tool_call> y <tool_call>{\"na");
        let (content, _) = run(ToolCallFormat::Hermes, &["a < b <tool"]);
        assert_eq!(content, "a < b <tool");
    }

    #[test]
    fn json_format_object_array_and_truncated() {
        let (c, calls) = run(ToolCallFormat::Json, &["{\"name\": \"f\", ", "\"arguments\": {\"a\": [1, 2]}}"]);
        assert_eq!((c.as_str(), calls), ("", vec![("f".into(), "{\"a\":[1,2]}".into())]));
        let (_, calls) = run(
            ToolCallFormat::Json,
            &["[{\"name\": \"f\", \"arguments\": {}}, {\"name\": \"g\", \"arguments\": {}}]"],
        );
        assert_eq!(calls.len(), 2);
        let (c, calls) = run(ToolCallFormat::Json, &["{\"name\": \"f\", \"argum"]);
        assert!(calls.is_empty());
        assert_eq!(c, "{\"name\": \"f\", \"argum");
    }

    #[test]
    fn detect_and_grammar_shapes() {
        assert_eq!(ToolCallFormat::detect("{% if tools %}<tool_call>{% endif %}"), Some(ToolCallFormat::Hermes));
        assert_eq!(ToolCallFormat::detect("{{ messages }}"), None);
        let f = json!({"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}});
        match ToolCallFormat::Json.forced_grammar(&[&f], false) {
            GrammarSource::JsonSchema(s) => assert_eq!(s["properties"]["name"]["const"], "f"),
            other => panic!("{other:?}"),
        }
        match ToolCallFormat::Json.forced_grammar(&[&f, &f], true) {
            GrammarSource::JsonSchema(s) => assert_eq!(s["type"], "array"),
            other => panic!("{other:?}"),
        }
        match ToolCallFormat::Hermes.forced_grammar(&[&f], true) {
            GrammarSource::Lark(g) => assert!(g.contains("%json") && g.contains("call (")),
            other => panic!("{other:?}"),
        }
    }
}
