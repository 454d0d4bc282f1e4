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
//! - `llama3_json`: Llama 3.1/3.2: `{"name": ..., "parameters": {...}}`, optionally after
//!   `<|python_tag|>`, several calls separated by `; `; chosen when the template mentions
//!   `<|python_tag|>`, `Environment: ipython` or `"parameters": ` (its tool instructions).
//! - `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`; chosen when the
//!   template mentions `[TOOL_CALLS]`. A bare array at the very start of the output is read
//!   the same way, because `[TOOL_CALLS]` is a special token that detokenizing may drop.
//!
//! Invariant: the parser never loses text. What is not a complete, well-formed call is
//! returned as content; only whitespace (and `;` between llama3 calls) around calls is
//! dropped. The result does not depend on how the text was split into pushes.

use serde_json::{json, Value};

use crate::structured::GrammarSource;

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";
const PYTHON_TAG: &str = "<|python_tag|>";
const MISTRAL_TAG: &str = "[TOOL_CALLS]";

/// How a chat request's output is read for tool calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ToolParsing {
    pub format: ToolCallFormat,
    /// false: the choice ends when its first call completes.
    pub parallel: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolCallFormat {
    Json,
    Hermes,
    #[serde(rename = "llama3_json")]
    Llama3Json,
    Mistral,
}

impl ToolCallFormat {
    /// `--tool-call-format` values: "json", "hermes", "llama3_json", "mistral".
    pub fn from_name(s: &str) -> Option<Self> {
        match s {
            "json" => Some(Self::Json),
            "hermes" => Some(Self::Hermes),
            "llama3_json" => Some(Self::Llama3Json),
            "mistral" => Some(Self::Mistral),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Json => "json",
            Self::Hermes => "hermes",
            Self::Llama3Json => "llama3_json",
            Self::Mistral => "mistral",
        }
    }

    /// The format a chat template teaches its model, if it teaches one we parse.
    /// Hermes goes first: some templates mention several formats' markers in passing.
    pub fn detect(template_source: &str) -> Option<Self> {
        let t = template_source;
        if t.contains(OPEN) {
            Some(Self::Hermes)
        } else if t.contains(MISTRAL_TAG) {
            Some(Self::Mistral)
        } else if t.contains(PYTHON_TAG) || t.contains("Environment: ipython") || t.contains("\"parameters\": ") {
            Some(Self::Llama3Json)
        } else {
            None
        }
    }

    /// The grammar forcing at least one call (exactly one unless `parallel`) to one of
    /// `functions` (each the `function` object of a tool as sent), with arguments that
    /// match that function's `parameters` schema.
    ///
    /// The llama3 and mistral grammars leave out their special-token markers (a grammar
    /// literal would be spelled in text tokens the model never saw); the parsers read the
    /// bare JSON the same way.
    pub fn forced_grammar(self, functions: &[&Value], parallel: bool) -> GrammarSource {
        let args_key = if self == Self::Llama3Json { "parameters" } else { "arguments" };
        let calls: Vec<Value> = functions.iter().map(|f| call_schema(f, args_key)).collect();
        let one = if calls.len() == 1 { calls[0].clone() } else { json!({"anyOf": calls}) };
        let fixed_ws = |mut schema: Value| {
            schema["x-guidance"] = json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "});
            serde_json::to_string(&schema).expect("JSON values serialize")
        };
        match self {
            Self::Llama3Json => {
                let start = if parallel { "start: call (\"; \" call)*" } else { "start: call" };
                GrammarSource::Lark(format!("{start}\ncall: %json {}\n", fixed_ws(one)))
            }
            Self::Mistral => {
                let start = if parallel { "start: \"[\" call (\", \" call)* \"]\"" } else { "start: \"[\" call \"]\"" };
                GrammarSource::Lark(format!("{start}\ncall: %json {}\n", fixed_ws(one)))
            }
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

/// The schema of one call to `function`, its arguments under `args_key`.
fn call_schema(function: &Value, args_key: &str) -> Value {
    let name = function.get("name").cloned().unwrap_or(Value::Null);
    let params = match function.get("parameters") {
        Some(p @ Value::Object(_)) => p.clone(),
        _ => json!({"type": "object", "properties": {}}),
    };
    json!({
        "type": "object",
        "properties": {"name": {"const": name}, args_key: params},
        "required": ["name", args_key],
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
    /// Text not yet classified (a possible marker prefix, an open call, or, for the json
    /// format, everything).
    buf: String,
    /// Inside a call; holds the marker that opened it (given back as content if what
    /// follows is not a call). For llama3's bare `{` the marker stays in `buf`, so "".
    inside: Option<&'static str>,
    /// Whitespace seen since the last non-whitespace content: emitted when more content
    /// follows, dropped when a call follows.
    held_ws: String,
    /// Right after a call: whitespace (and llama3's `;`) separates calls, it is not content.
    after_call: bool,
    /// Nothing but whitespace has been seen so far (mistral reads a bare leading array).
    at_start: bool,
    found: usize,
}

impl ToolCallParser {
    pub fn new(format: ToolCallFormat) -> Self {
        Self {
            format,
            buf: String::new(),
            inside: None,
            held_ws: String::new(),
            after_call: false,
            at_start: true,
            found: 0,
        }
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
            if let Some(marker) = self.inside {
                if !self.close_call(marker, &mut out) {
                    break;
                }
            } else if let Some((start, marker)) = self.find_marker() {
                let before = self.buf[..start].to_string();
                self.content(&before, &mut out);
                // A bare `{` or `[` is part of the call's JSON: leave it in the buffer.
                let bare = marker == "{" || marker == "[";
                self.buf.drain(..start + if bare { 0 } else { marker.len() });
                self.inside = Some(if bare { "" } else { marker });
            } else {
                // Keep back the longest tail that may still grow into a marker.
                let keep = (1..self.buf.len() + 1)
                    .rev()
                    .find(|&k| {
                        let i = self.buf.len() - k;
                        self.buf.is_char_boundary(i)
                            && self.markers().iter().any(|m| m.len() > k && m.starts_with(&self.buf[i..]))
                    })
                    .unwrap_or(0);
                let emit: String = self.buf.drain(..self.buf.len() - keep).collect();
                self.content(&emit, &mut out);
                break;
            }
        }
        out
    }

    fn markers(&self) -> &'static [&'static str] {
        match self.format {
            ToolCallFormat::Json => &[],
            ToolCallFormat::Hermes => &[OPEN],
            ToolCallFormat::Llama3Json => &[PYTHON_TAG, "{"],
            ToolCallFormat::Mistral => &[MISTRAL_TAG],
        }
    }

    /// The first marker in `buf` that opens a call.
    fn find_marker(&self) -> Option<(usize, &'static str)> {
        if self.format == ToolCallFormat::Mistral && self.at_start {
            let lead = self.buf.len() - self.buf.trim_start().len();
            let head = &self.buf[lead..];
            if head.starts_with('[') && !head.starts_with(MISTRAL_TAG) {
                // "[", "[TOOL" ... may still grow into the tag: wait for more text.
                if MISTRAL_TAG.starts_with(head) {
                    return None;
                }
                return Some((lead, "["));
            }
        }
        self.markers().iter().filter_map(|m| self.buf.find(m).map(|i| (i, *m))).min_by_key(|(i, _)| *i)
    }

    /// Tries to complete the open call; false while it needs more text.
    fn close_call(&mut self, marker: &'static str, out: &mut Parsed) -> bool {
        if self.format == ToolCallFormat::Hermes {
            let Some(end) = self.buf.find(CLOSE) else { return false };
            let body = self.buf[..end].to_string();
            self.buf.drain(..end + CLOSE.len());
            self.inside = None;
            match parse_call(body.trim()) {
                Some(call) => self.call(call, out),
                None => self.content(&format!("{OPEN}{body}{CLOSE}"), out),
            }
            return true;
        }
        let end = match json_value_end(&self.buf) {
            Scan::Incomplete => return false,
            Scan::NotJson => None,
            Scan::End(end) => Some(end),
        };
        let end = end.unwrap_or(0);
        let body: String = self.buf.drain(..end).collect();
        self.inside = None;
        let calls = match self.format {
            ToolCallFormat::Llama3Json => parse_call(body.trim()).map(|c| vec![c]),
            _ => parse_json_calls(body.trim()),
        };
        match calls {
            Some(calls) if end > 0 => calls.into_iter().for_each(|c| self.call(c, out)),
            _ => self.content(&format!("{marker}{body}"), out),
        }
        true
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
            _ => {
                let marker = self.inside.take().unwrap_or("");
                self.content(&format!("{marker}{rest}"), &mut out);
            }
        }
        if self.found == 0 {
            out.content.push_str(&std::mem::take(&mut self.held_ws));
        }
        out
    }

    /// Emits content so that the result does not depend on how text was split: whitespace
    /// is held until non-whitespace follows, and dropped right after a call.
    fn content(&mut self, text: &str, out: &mut Parsed) {
        let llama3 = self.format == ToolCallFormat::Llama3Json;
        let sep = |c: char| c.is_whitespace() || (llama3 && c == ';');
        let mut rest = text;
        while !rest.is_empty() {
            if self.after_call {
                let t = rest.trim_start_matches(sep);
                rest = t;
                if rest.is_empty() {
                    break;
                }
                self.after_call = false;
            }
            let ws = rest.len() - rest.trim_start().len();
            self.held_ws.push_str(&rest[..ws]);
            rest = &rest[ws..];
            let word = rest.find(char::is_whitespace).unwrap_or(rest.len());
            if word > 0 {
                out.content.push_str(&std::mem::take(&mut self.held_ws));
                out.content.push_str(&rest[..word]);
                self.at_start = false;
                rest = &rest[word..];
            }
        }
    }

    fn call(&mut self, (name, arguments): (String, String), out: &mut Parsed) {
        self.held_ws.clear();
        self.after_call = true;
        self.at_start = false;
        self.found += 1;
        out.calls.push(ToolCall {
            id: format!("call_{}", &uuid::Uuid::new_v4().simple().to_string()[..24]),
            name,
            arguments,
        });
    }
}

enum Scan {
    /// The JSON value ends at this byte offset.
    End(usize),
    Incomplete,
    /// What follows (after whitespace) is not an object or array.
    NotJson,
}

/// Where the object or array at the start of `text` (after whitespace) ends, by bracket
/// depth outside strings; validity is left to serde.
fn json_value_end(text: &str) -> Scan {
    let lead = text.len() - text.trim_start().len();
    match text[lead..].chars().next() {
        None => return Scan::Incomplete,
        Some('{' | '[') => {}
        Some(_) => return Scan::NotJson,
    }
    let (mut depth, mut in_str, mut escaped) = (0usize, false, false);
    for (i, c) in text[lead..].char_indices() {
        if in_str {
            match c {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                '"' => in_str = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => in_str = true,
            '{' | '[' => depth += 1,
            '}' | ']' => {
                depth -= 1;
                if depth == 0 {
                    return Scan::End(lead + i + 1);
                }
            }
            _ => {}
        }
    }
    Scan::Incomplete
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

    /// Recorded-style outputs: (format, text, expected content, expected (name, arguments)).
    /// (format, label, recorded output, expected (name, arguments) calls)
    type Recorded = (ToolCallFormat, &'static str, &'static str, Vec<(&'static str, &'static str)>);

    fn recorded() -> Vec<Recorded> {
        use ToolCallFormat::*;
        vec![
            (
                Hermes,
                "I'll check both cities.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Tōkyō\"}}\n</tool_call>",
                "I'll check both cities.",
                vec![("get_weather", "{\"city\":\"Paris\",\"unit\":\"celsius\"}"), ("get_weather", "{\"city\":\"Tōkyō\"}")],
            ),
            (
                Llama3Json,
                "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}; {\"name\": \"get_time\", \"parameters\": {\"tz\": \"Europe/Paris\"}}",
                "",
                vec![("get_weather", "{\"city\":\"Paris\"}"), ("get_time", "{\"tz\":\"Europe/Paris\"}")],
            ),
            (
                Llama3Json,
                "Let me look that up. {\"name\": \"echo\", \"parameters\": {\"text\": \"a } b \\\" { café\"}}",
                "Let me look that up.",
                vec![("echo", "{\"text\":\"a } b \\\" { café\"}")],
            ),
            (Llama3Json, "Use {x} or {\"a\": 1} here.", "Use {x} or {\"a\": 1} here.", vec![]),
            (
                Hermes,
                "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>\n Done, see  above. ",
                "Done, see  above.",
                vec![("a", "{}")],
            ),
            (
                Mistral,
                "Sure.[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}, {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Tokyo\"}}]",
                "Sure.",
                vec![("get_weather", "{\"city\":\"Paris\"}"), ("get_weather", "{\"city\":\"Tokyo\"}")],
            ),
            // The special token was dropped by detokenizing: a bare array at the start.
            (Mistral, " [{\"name\": \"f\", \"arguments\": {}}]", "", vec![("f", "{}")]),
            (Mistral, "[1, 2] is a list, [TOOL_CALLS] is a tag", "[1, 2] is a list, [TOOL_CALLS] is a tag", vec![]),
            (
                Json,
                "[{\"name\": \"f\", \"arguments\": {\"q\": \"x\"}}, {\"name\": \"g\", \"arguments\": {}}]",
                "",
                vec![("f", "{\"q\":\"x\"}"), ("g", "{}")],
            ),
        ]
    }

    #[test]
    fn recorded_outputs_parse_the_same_however_split() {
        for (format, text, content, calls) in recorded() {
            let want: Vec<(String, String)> = calls.iter().map(|(n, a)| (n.to_string(), a.to_string())).collect();
            let whole = run(format, &[text]);
            assert_eq!(whole, (content.to_string(), want.clone()), "{format:?} {text}");
            for at in (0..=text.len()).filter(|&i| text.is_char_boundary(i)) {
                assert_eq!(run(format, &[&text[..at], &text[at..]]), whole, "{format:?} split at {at}");
            }
            for width in 1..=3 {
                let chars: Vec<char> = text.chars().collect();
                let pieces: Vec<String> = chars.chunks(width).map(|c| c.iter().collect()).collect();
                let pieces: Vec<&str> = pieces.iter().map(String::as_str).collect();
                let split = run(format, &pieces);
                assert_eq!(split, whole, "{format:?} chunks of {width}");
                if !want.is_empty() {
                    for mark in [OPEN, CLOSE, PYTHON_TAG, MISTRAL_TAG] {
                        assert!(!split.0.contains(mark), "{format:?} leaked {mark}");
                    }
                }
            }
        }
    }

    #[test]
    fn new_formats_detect_name_and_grammar() {
        let llama = "Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}.";
        assert_eq!(ToolCallFormat::detect(llama), Some(ToolCallFormat::Llama3Json));
        assert_eq!(ToolCallFormat::detect("{{- \"Environment: ipython\\n\" }}"), Some(ToolCallFormat::Llama3Json));
        assert_eq!(ToolCallFormat::detect("{{ '[TOOL_CALLS]' }}"), Some(ToolCallFormat::Mistral));
        assert_eq!(ToolCallFormat::detect("<tool_call> <|python_tag|> [TOOL_CALLS]"), Some(ToolCallFormat::Hermes));
        for f in [ToolCallFormat::Json, ToolCallFormat::Hermes, ToolCallFormat::Llama3Json, ToolCallFormat::Mistral] {
            assert_eq!(ToolCallFormat::from_name(f.name()), Some(f));
            let via_serde: ToolCallFormat = serde_json::from_value(json!(f.name())).unwrap();
            assert_eq!(via_serde, f);
        }
        let f = json!({"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}});
        match ToolCallFormat::Llama3Json.forced_grammar(&[&f], true) {
            GrammarSource::Lark(g) => assert!(g.contains("\"parameters\"") && g.contains("\"; \" call")),
            other => panic!("{other:?}"),
        }
        match ToolCallFormat::Mistral.forced_grammar(&[&f], false) {
            GrammarSource::Lark(g) => assert!(g.starts_with("start: \"[\" call \"]\"") && g.contains("\"arguments\"")),
            other => panic!("{other:?}"),
        }
    }

    /// The forced grammars accept exactly what the parsers read back as calls.
    #[test]
    fn forced_grammars_accept_what_the_parsers_read() {
        use crate::structured::tests::{byte_tokenizer, drive};
        let tok = byte_tokenizer();
        let g = crate::structured::Grammars::new(tok.clone(), vec![0]);
        let f = json!({"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}},
                                                   "required": ["a"], "additionalProperties": false}});
        let cases = [
            (ToolCallFormat::Llama3Json, false, "{\"name\": \"f\", \"parameters\": {\"a\": 7}}"),
            (
                ToolCallFormat::Llama3Json,
                true,
                "{\"name\": \"f\", \"parameters\": {\"a\": 7}}; {\"name\": \"f\", \"parameters\": {\"a\": 8}}",
            ),
            (ToolCallFormat::Mistral, false, "[{\"name\": \"f\", \"arguments\": {\"a\": 7}}]"),
            (
                ToolCallFormat::Mistral,
                true,
                "[{\"name\": \"f\", \"arguments\": {\"a\": 7}}, {\"name\": \"f\", \"arguments\": {\"a\": 8}}]",
            ),
        ];
        for (format, parallel, text) in cases {
            let grammar = g.compile(&format.forced_grammar(&[&f], parallel), "tools").unwrap();
            drive(&grammar, &tok, text);
            let (content, calls) = run(format, &[text]);
            assert_eq!(content, "", "{format:?}");
            assert_eq!(calls.len(), if parallel { 2 } else { 1 });
            assert_eq!(calls[0], ("f".to_string(), "{\"a\":7}".to_string()));
        }
    }
}
