//! Qwen3-Coder's XML tool calls: reading a block as it streams, typing each parameter's
//! text by the function's schema, and the grammar that forces a block.
//!
//! A block, after `<tool_call>`:
//! ```text
//! <function=get_weather>
//! <parameter=city>
//! Paris
//! </parameter>
//! <parameter=days>
//! 3
//! </parameter>
//! </function>
//! </tool_call>
//! ```
//! Values are raw text (one newline after the opening tag and one before the closing tag
//! belong to the markup). The arguments are JSON built by us: `{` goes out with the first
//! parameter, each parameter as it closes (`"city": "Paris"`, then `, "days": 3`), and `}`
//! when the function closes, so the fragments always concatenate to a JSON prefix.
//!
//! Typing (the schema of the parameter under the function's `parameters.properties`): a
//! value is a JSON string unless the schema allows a non-string type and the text parses
//! as JSON of an allowed type (`3` for an integer, `true` for a boolean, `[1, 2]` for an
//! array). Unknown functions or parameters give strings.

use std::collections::HashMap;

use serde_json::Value;

use super::{call_id, ToolEvent, CLOSE, OPEN};
use crate::protocol::schema_edit;
use crate::structured::GrammarSource;

pub(crate) const FUNCTION: &str = "<function=";
const FUNCTION_END: &str = "</function>";
const PARAMETER: &str = "<parameter=";
const PARAMETER_END: &str = "</parameter>";

/// What an XML block's reader made of the text so far.
pub(crate) enum XmlProgress {
    NeedMore,
    /// The block is not a call (nothing was committed): give its text back.
    NotACall,
    /// The function closed: the call is complete; what follows is back in the buffer.
    Done,
}

/// Reads one block's body (after `<tool_call>`).
#[derive(Default)]
pub(crate) struct XmlReader {
    /// The body's text so far.
    text: String,
    /// Read up to here.
    at: usize,
    /// The function's name, once `<function=NAME>` is complete (the call is committed).
    name: Option<String>,
    params: usize,
    /// No `</parameter>` starts before this offset of `text`: a long value is searched once,
    /// not again from its start on every push.
    searched: usize,
}

impl XmlReader {
    pub(crate) fn committed(&self) -> bool {
        self.name.is_some()
    }

    pub(crate) fn text(&self) -> &str {
        &self.text
    }

    pub(crate) fn feed(
        &mut self,
        buf: &mut String,
        out: &mut Vec<ToolEvent>,
        parameters: &HashMap<String, Value>,
    ) -> XmlProgress {
        self.text.push_str(buf);
        buf.clear();
        if self.name.is_none() {
            let rest = self.text.trim_start();
            let lead = self.text.len() - rest.len();
            if !rest.starts_with(FUNCTION) {
                return if FUNCTION.starts_with(rest) { XmlProgress::NeedMore } else { XmlProgress::NotACall };
            }
            let after = &rest[FUNCTION.len()..];
            let Some(end) = after.find('>') else {
                return if after.contains(['<', '\n']) { XmlProgress::NotACall } else { XmlProgress::NeedMore };
            };
            let name = after[..end].trim();
            if name.is_empty() || name.contains(['<', '\n']) {
                return XmlProgress::NotACall;
            }
            out.push(ToolEvent::Start { id: call_id(), name: name.to_string() });
            self.name = Some(name.to_string());
            self.at = lead + FUNCTION.len() + end + 1;
        }
        loop {
            let rest = &self.text[self.at..];
            let body = rest.trim_start();
            let ws = rest.len() - body.len();
            if let Some(tag) = body.strip_prefix(PARAMETER) {
                let Some(key_end) = tag.find('>') else { return XmlProgress::NeedMore };
                let value_from = &tag[key_end + 1..];
                let value_at = self.text.len() - value_from.len();
                let Some(value_end) = find_from(&self.text, self.searched.max(value_at), PARAMETER_END) else {
                    self.searched = self.text.len().saturating_sub(PARAMETER_END.len() - 1).max(value_at);
                    return XmlProgress::NeedMore;
                };
                let value_end = value_end - value_at;
                let key = tag[..key_end].trim();
                let raw = value_from[..value_end].strip_prefix('\n').unwrap_or(&value_from[..value_end]);
                let raw = raw.strip_suffix('\n').unwrap_or(raw);
                let root = self.name.as_ref().and_then(|f| parameters.get(f));
                let body = root.map(|r| schema_edit::resolve(r, r));
                let schema = body.and_then(|p| p.get("properties")).and_then(|p| p.get(key));
                let value = typed_value(raw, schema, root.unwrap_or(&Value::Null));
                let sep = if self.params == 0 { "{" } else { ", " };
                let key_json = serde_json::to_string(key).expect("strings serialize");
                out.push(ToolEvent::Args(format!("{sep}{key_json}: {value}")));
                self.params += 1;
                self.at += ws + PARAMETER.len() + key_end + 1 + value_end + PARAMETER_END.len();
                continue;
            }
            if body.starts_with(FUNCTION_END) || !(PARAMETER.starts_with(body) || FUNCTION_END.starts_with(body)) {
                // The function closed, or text that is neither a parameter nor the close:
                // the call ends here and that text is read after it.
                out.push(ToolEvent::Args(if self.params == 0 { "{}" } else { "}" }.to_string()));
                let skip = if body.starts_with(FUNCTION_END) { ws + FUNCTION_END.len() } else { 0 };
                buf.push_str(&self.text[self.at + skip..]);
                self.text.truncate(self.at + skip);
                return XmlProgress::Done;
            }
            return XmlProgress::NeedMore;
        }
    }
}

/// The offset of `needle` (ASCII) in `hay` at or after byte `from`, which need not be a char
/// boundary: the match is by bytes, and an ASCII match always starts on one.
fn find_from(hay: &str, from: usize, needle: &str) -> Option<usize> {
    let bytes = hay.as_bytes().get(from..)?;
    bytes.windows(needle.len()).position(|w| w == needle.as_bytes()).map(|i| from + i)
}

/// The JSON a parameter's text stands for, given the parameter's schema (and the function's
/// `parameters`, which its local `$ref`s point into).
pub(crate) fn typed_value(raw: &str, schema: Option<&Value>, root: &Value) -> Value {
    let mut types = Vec::new();
    if let Some(s) = schema {
        schema_types(s, root, &mut types);
    }
    let as_string = || Value::String(raw.to_string());
    if types.is_empty() || types.iter().all(|t| t == "string") {
        return as_string();
    }
    let text = raw.trim();
    if types.iter().any(|t| t == "boolean") {
        for (word, b) in [("true", true), ("false", false)] {
            if text.eq_ignore_ascii_case(word) {
                return Value::Bool(b);
            }
        }
    }
    match serde_json::from_str::<Value>(text) {
        Ok(v) if types.iter().any(|t| json_type_fits(&v, t)) => v,
        _ => as_string(),
    }
}

/// The JSON types a schema allows, from `type`, `enum`, `const`, `anyOf`, `oneOf` and `allOf`
/// (pydantic v1 wraps a `$ref` in one), following local refs.
fn schema_types(schema: &Value, root: &Value, types: &mut Vec<String>) {
    schema_types_within(schema, root, types, 8);
}

fn schema_types_within(schema: &Value, root: &Value, types: &mut Vec<String>, depth: u32) {
    let schema = schema_edit::resolve(root, schema);
    match schema.get("type") {
        Some(Value::String(t)) => types.push(t.clone()),
        Some(Value::Array(ts)) => types.extend(ts.iter().filter_map(Value::as_str).map(str::to_string)),
        _ => {}
    }
    let values = schema.get("enum").and_then(Value::as_array).into_iter().flatten().chain(schema.get("const"));
    for v in values {
        types.push(type_name(v).to_string());
    }
    for key in ["anyOf", "oneOf", "allOf"] {
        for sub in schema.get(key).and_then(Value::as_array).into_iter().flatten().filter(|_| depth > 0) {
            schema_types_within(sub, root, types, depth - 1);
        }
    }
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "integer",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

fn json_type_fits(v: &Value, t: &str) -> bool {
    let actual = type_name(v);
    actual == t || (t == "number" && actual == "integer")
}

/// The grammar forcing XML blocks calling one of `functions`: each function's parameters in
/// schema order (the required ones always, the others optionally), string values as free
/// text without `</`, enums as their literals, other types as compact JSON.
pub(crate) fn forced_grammar(functions: &[&Value], parallel: bool) -> GrammarSource {
    let lit = |s: &str| serde_json::to_string(s).expect("strings serialize");
    let start = if parallel { "start: block (\"\\n\" block)*" } else { "start: block" };
    let mut rules = vec![start.to_string(), format!("block: {} function {}", lit(&format!("{OPEN}\n")), lit(CLOSE))];
    let names: Vec<String> = (0..functions.len()).map(|i| format!("f{i}")).collect();
    rules.push(format!("function: {}", names.join(" | ")));
    for (i, f) in functions.iter().enumerate() {
        let name = f.get("name").and_then(Value::as_str).unwrap_or_default();
        let mut closed = f.get("parameters").cloned().unwrap_or(Value::Null);
        schema_edit::close_objects(&mut closed);
        // (parameters that are a `$ref` to the object schema read as that schema)
        let params = Some(schema_edit::resolve(&closed, &closed)).filter(|p| !p.is_null());
        let props = params.and_then(|p| p.get("properties")).and_then(Value::as_object);
        let required: Vec<&str> = params
            .and_then(|p| p.get("required"))
            .and_then(Value::as_array)
            .map(|r| r.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let mut body = vec![lit(&format!("{FUNCTION}{name}>\n"))];
        for (j, (key, schema)) in props.into_iter().flatten().enumerate() {
            let rule = format!("f{i}_p{j}");
            let open = lit(&format!("{PARAMETER}{key}>\n"));
            rules.push(format!("{rule}: {open} {}", value_grammar(schema, &closed)));
            body.push(if required.contains(&key.as_str()) { rule } else { format!("{rule}?") });
        }
        body.push(lit(&format!("{FUNCTION_END}\n")));
        rules.push(format!("f{i}: {}", body.join(" ")));
    }
    rules.push(r"TEXT_VALUE: /([^<]|<[^\/])*\n<\/parameter>\n/".to_string());
    GrammarSource::Lark(rules.join("\n") + "\n")
}

/// A parameter's value and its closing tag; `root` is the function's `parameters`, which the
/// value's local `$ref`s point into.
fn value_grammar(schema: &Value, root: &Value) -> String {
    let close = serde_json::to_string(&format!("\n{PARAMETER_END}\n")).expect("strings serialize");
    let resolved = schema_edit::resolve(root, schema);
    let enum_strings: Option<Vec<String>> = resolved.get("enum").and_then(Value::as_array).and_then(|vs| {
        vs.iter().map(|v| v.as_str().map(|s| serde_json::to_string(s).expect("strings serialize"))).collect()
    });
    if let Some(options) = enum_strings.filter(|o| !o.is_empty()) {
        return format!("({}) {close}", options.join(" | "));
    }
    let mut types = Vec::new();
    schema_types(resolved, root, &mut types);
    if types.is_empty() || types.iter().all(|t| t == "string") {
        return "TEXT_VALUE".to_string();
    }
    let mut schema = schema.clone();
    if schema_edit::has_local_ref(&schema) {
        // the value becomes its own root: the parameters it refers into come along
        const BASE: &str = "/$defs/llmserve_parameters";
        let mut params = root.clone();
        schema_edit::rebase_refs(&mut params, BASE);
        schema_edit::rebase_refs(&mut schema, BASE);
        if !schema.get("$defs").is_some_and(Value::is_object) {
            schema["$defs"] = serde_json::json!({});
        }
        schema["$defs"]["llmserve_parameters"] = params;
    }
    if let Value::Object(obj) = &mut schema {
        obj.insert(
            "x-guidance".into(),
            serde_json::json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
        );
    }
    format!("%json {} {close}", serde_json::to_string(&schema).expect("JSON values serialize"))
}
