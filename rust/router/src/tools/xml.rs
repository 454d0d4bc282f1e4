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

use serde_json::{Map, Value};

use super::{call_id, ToolCallFormat, ToolEvent, Unenforceable, CLOSE, OPEN};
use crate::protocol::schema_edit;
use crate::structured::{lark_literal, GrammarSource};

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
            out.push(ToolEvent::Start { id: call_id(ToolCallFormat::Qwen3Xml), name: name.to_string() });
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
    if schema.is_none_or(|s| is_text(s, root)) {
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
        Ok(v) if types.is_empty() || types.iter().any(|t| json_type_fits(&v, t)) => v,
        _ => as_string(),
    }
}

/// Keywords that shape a value as JSON (an object, an array, a number, or schemas combined):
/// a schema without a `type` that uses one means JSON, not text.
const JSON_SHAPED: [&str; 22] = [
    "properties",
    "patternProperties",
    "additionalProperties",
    "required",
    "minProperties",
    "maxProperties",
    "items",
    "prefixItems",
    "contains",
    "minItems",
    "maxItems",
    "uniqueItems",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    "allOf",
    "anyOf",
    "oneOf",
    "not",
    "$ref",
];

/// Whether a parameter's value is raw text (its schema allows only strings, or names no type
/// and nothing JSON-shaped: a description, `nullable`, `maxLength`, an `x-` key) rather than
/// JSON. A schema whose types cannot be told (refs that do not resolve, parts without
/// `type`) but that shapes the value as JSON is JSON: the grammar then leaves it to the JSON
/// engine, which follows all of it.
fn is_text(schema: &Value, root: &Value) -> bool {
    let mut types = Vec::new();
    schema_types(schema, root, &mut types);
    if !types.is_empty() {
        return types.iter().all(|t| t == "string");
    }
    match schema_edit::resolve(root, schema) {
        Value::Object(o) => !o.keys().any(|k| JSON_SHAPED.contains(&k.as_str())),
        _ => true,
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
/// text without `</` (or their literals, or text of bounded length), other types as compact
/// JSON.
///
/// The XML format is a rule per top-level property, so some `parameters` cannot be enforced
/// by it: root combinators and conditionals, `required` names outside `properties`, string
/// `pattern`s and `format`s, names that would break the markup. Those are refused (the JSON
/// formats take them) rather than generated unchecked.
pub(crate) fn forced_grammar(functions: &[&Value], parallel: bool) -> Result<GrammarSource, Unenforceable> {
    let lit = lark_literal;
    let start = if parallel { "start: block (\"\\n\" block)*" } else { "start: block" };
    let mut rules = vec![start.to_string(), format!("block: {} function {}", lit(&format!("{OPEN}\n")), lit(CLOSE))];
    let names: Vec<String> = (0..functions.len()).map(|i| format!("f{i}")).collect();
    rules.push(format!("function: {}", names.join(" | ")));
    for (i, f) in functions.iter().enumerate() {
        let refuse = |at: String, why: String| Unenforceable { function: i, at, why };
        let name = f.get("name").and_then(Value::as_str).unwrap_or_default();
        let mut closed = f.get("parameters").cloned().unwrap_or(Value::Null);
        schema_edit::localize_refs(&mut closed);
        schema_edit::close_objects(&mut closed);
        let (props, required) = root_shape(&closed).map_err(|(at, why)| refuse(at, why))?;
        let mut body = vec![lit(&format!("{FUNCTION}{name}>\n"))];
        for (j, (key, schema)) in props.into_iter().flatten().enumerate() {
            let at = format!(".properties.{key}");
            if key.contains(['>', '<', '\n']) {
                return Err(refuse(at, format!("the name {key:?}, which a `<parameter=...>` tag cannot hold")));
            }
            let value = value_grammar(schema, &closed).map_err(|(rest, why)| refuse(format!("{at}{rest}"), why))?;
            let rule = format!("f{i}_p{j}");
            let open = lit(&format!("{PARAMETER}{key}>\n"));
            rules.push(format!("{rule}: {open} {value}"));
            body.push(if required.contains(&key.as_str()) { rule } else { format!("{rule}?") });
        }
        body.push(lit(&format!("{FUNCTION_END}\n")));
        rules.push(format!("f{i}: {}", body.join(" ")));
    }
    rules.push(r"TEXT_VALUE: /([^<]|<[^\/])*\n<\/parameter>\n/".to_string());
    Ok(GrammarSource::Lark(rules.join("\n") + "\n"))
}

/// Where in a function's `parameters` (a path such as `.properties.city.pattern`) the XML
/// format cannot enforce what the schema asks, and why.
type Refusal = (String, String);

/// Keywords that constrain an object through more than its listed properties: a rule per
/// property cannot follow them.
const ROOT_REFUSED: [&str; 13] = [
    "allOf",
    "anyOf",
    "oneOf",
    "not",
    "if",
    "then",
    "else",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "patternProperties",
    "propertyNames",
    "enum",
];

/// The properties (if listed) and the required names of an arguments object.
type Shape<'a> = (Option<&'a Map<String, Value>>, Vec<&'a str>);

/// The [`Shape`] of the parameters' object schema (through a root `$ref`), or why the XML
/// format cannot enforce it.
fn root_shape(params: &Value) -> Result<Shape<'_>, Refusal> {
    if params.is_null() {
        return Ok((None, Vec::new()));
    }
    let mut at = String::new();
    let mut schema = params;
    if let Some(target) = schema.get("$ref").and_then(Value::as_str) {
        let beside = ["properties", "required", "type", "additionalProperties", "minProperties", "maxProperties"];
        if let Some(key) = beside.iter().chain(&ROOT_REFUSED).find(|k| schema.get(**k).is_some()) {
            return Err((format!(".{key}"), "a root `$ref` beside other keywords (two schemas for one object)".into()));
        }
        schema = schema_edit::resolve(params, schema);
        at = target.trim_start_matches('#').replace('/', ".");
    }
    let keyword = |key: &str| format!("{at}.{key}");
    if let Some(key) = ROOT_REFUSED.iter().chain(&["const", "$ref"]).find(|k| schema.get(**k).is_some()) {
        return Err((keyword(key), format!("`{key}` on the arguments object")));
    }
    let is_object = |t: &Value| t.as_str() == Some("object");
    match schema.get("type") {
        None => {}
        Some(Value::Array(ts)) if ts.iter().any(is_object) => {}
        Some(t) if is_object(t) => {}
        Some(_) => return Err((keyword("type"), "arguments that are not an object".into())),
    }
    let props = schema.get("properties").and_then(Value::as_object);
    let required: Vec<&str> =
        schema.get("required").and_then(Value::as_array).into_iter().flatten().filter_map(Value::as_str).collect();
    if let Some(missing) = required.iter().find(|r| !props.is_some_and(|p| p.contains_key(**r))) {
        return Err((keyword("required"), format!("the required name {missing:?}, which `properties` does not list")));
    }
    let count = |key: &str| schema.get(key).and_then(Value::as_u64);
    if count("minProperties").is_some_and(|n| n > required.len() as u64) {
        return Err((keyword("minProperties"), "`minProperties` beyond the required names".into()));
    }
    if count("maxProperties").is_some_and(|n| n < props.map_or(0, |p| p.len()) as u64) {
        return Err((keyword("maxProperties"), "`maxProperties` below the number of properties".into()));
    }
    Ok((props, required))
}

/// A parameter's value and its closing tag; `root` is the function's `parameters`, which the
/// value's local `$ref`s point into.
fn value_grammar(schema: &Value, root: &Value) -> Result<String, Refusal> {
    let close = lark_literal(&format!("\n{PARAMETER_END}\n"));
    let resolved = schema_edit::resolve(root, schema);
    if is_text(resolved, root) {
        return Ok(match string_value(resolved, root, 8)? {
            Text::Free => "TEXT_VALUE".to_string(),
            Text::Literals(options) if options.is_empty() => {
                return Err((String::new(), "no string satisfies the value's schema".into()))
            }
            Text::Literals(options) => {
                let options: Vec<String> = options.iter().map(|o| lark_literal(o)).collect();
                format!("({}) {close}", options.join(" | "))
            }
            Text::Bounded(min, max) => {
                let max = max.map_or(String::new(), |m| m.to_string());
                format!(r"/[^<]{{{min},{max}}}\n<\/parameter>\n/")
            }
        });
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
    let schema = crate::structured::for_generation(&schema);
    Ok(format!("%json {} {close}", serde_json::to_string(&schema).expect("JSON values serialize")))
}

/// The raw text a string-only value may be.
#[derive(Debug, PartialEq)]
enum Text {
    /// Anything without `</`.
    Free,
    /// One of these strings.
    Literals(Vec<String>),
    /// Between this many characters and at most that many (JSON Schema counts characters),
    /// none of them `<`.
    Bounded(u64, Option<u64>),
}

/// Longest `minLength`/`maxLength` a raw-text value's grammar counts to.
const MAX_BOUNDED_LENGTH: u64 = 100_000;

/// What text a value whose schema allows only strings may be: `enum` and `const` give
/// literals, `minLength`/`maxLength` a bounded length, a union of literal sets their union,
/// a single `allOf` part (pydantic v1's wrapper of a `$ref`) that part. A `pattern`, a
/// `format` or any other combination is refused: the value is raw text, not a JSON string,
/// so the JSON engine's string rules do not apply to it.
fn string_value(schema: &Value, root: &Value, depth: u32) -> Result<Text, Refusal> {
    let schema = schema_edit::resolve(root, schema);
    let refuse = |key: &str, why: &str| Err((format!(".{key}"), why.to_string()));
    // NOTE: `format` is an annotation unless a schema opts in to asserting it (JSON Schema
    // 2020-12); in raw text it is left unenforced, as most JSON engines leave the formats
    // they do not know.
    for key in ["pattern", "not", "if", "contentEncoding", "contentMediaType"] {
        if schema.get(key).is_some() {
            return refuse(key, &format!("`{key}` on a string value"));
        }
    }
    let length = |key: &str| schema.get(key).and_then(Value::as_u64);
    let (min, max) = (length("minLength"), length("maxLength"));
    if let (Some(lo), Some(hi)) = (min, max) {
        if lo > hi {
            return refuse("minLength", "`minLength` above `maxLength`");
        }
    }
    if min.max(max).is_some_and(|n| n > MAX_BOUNDED_LENGTH) {
        let key = if max.is_some_and(|n| n > MAX_BOUNDED_LENGTH) { "maxLength" } else { "minLength" };
        return refuse(key, &format!("`{key}` beyond {MAX_BOUNDED_LENGTH} characters"));
    }
    let fits = |s: &str| {
        let n = s.chars().count() as u64;
        min.is_none_or(|m| n >= m) && max.is_none_or(|m| n <= m)
    };
    let mut literals: Option<Vec<String>> = None;
    if let Some(values) = schema.get("enum").and_then(Value::as_array) {
        literals = Some(values.iter().filter_map(Value::as_str).map(str::to_string).collect());
    }
    if let Some(c) = schema.get("const") {
        let c = c.as_str().map(str::to_string);
        let kept = c.into_iter().filter(|c| literals.as_ref().is_none_or(|l| l.contains(c))).collect();
        literals = Some(kept);
    }
    let combined: Vec<&str> = ["allOf", "anyOf", "oneOf"].into_iter().filter(|k| schema.get(*k).is_some()).collect();
    if let Some(key) = combined.first() {
        if combined.len() > 1 || literals.is_some() || min.is_some() || max.is_some() || depth == 0 {
            return refuse(key, &format!("`{key}` beside other string keywords"));
        }
        let parts = schema[*key].as_array().map(Vec::as_slice).unwrap_or_default();
        let within = |j: usize, part: &Value| {
            string_value(part, root, depth - 1).map_err(|(at, why)| (format!(".{key}[{j}]{at}"), why))
        };
        if *key == "allOf" {
            return match parts {
                [one] => within(0, one),
                _ => refuse(key, "`allOf` of several string schemas"),
            };
        }
        let mut union: Vec<String> = Vec::new();
        let mut free = false;
        for (j, part) in parts.iter().enumerate() {
            match within(j, part)? {
                Text::Free => free = true,
                Text::Literals(options) if *key == "oneOf" && options.iter().any(|o| union.contains(o)) => {
                    return refuse(key, "`oneOf` branches that share a string")
                }
                Text::Literals(options) => union.extend(options),
                Text::Bounded(..) => return refuse(key, "a union of string lengths"),
            }
        }
        if free && *key == "oneOf" && !union.is_empty() {
            return refuse(key, "`oneOf` of free text and literals");
        }
        return Ok(if free { Text::Free } else { Text::Literals(union) });
    }
    if let Some(bad) = literals.iter().flatten().find(|l| l.contains("</")) {
        // the parser ends a value at its first `</parameter>`
        return Err((String::new(), format!("the string {bad:?}, which holds `</`")));
    }
    Ok(match literals {
        Some(options) => Text::Literals(options.into_iter().filter(|o| fits(o)).collect()),
        None if min.is_some() || max.is_some() => Text::Bounded(min.unwrap_or(0), max),
        None => Text::Free,
    })
}
