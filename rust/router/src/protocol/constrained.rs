//! `response_format` and forced `tool_choice`: the grammar a request's output must follow.
//!
//! Accepted formats: `text`; `json_object`; `json_schema` (`name`, `schema`, `strict`, and
//! `description`, which no prompt holds: reported when non-empty); and three extensions,
//! `{"type": "regex", "regex": ...}`, `{"type": "grammar", "grammar": <Lark>}` and vLLM's
//! `{"type": "structural_tag", ...}` (see [`super::structural_tag`]). Every
//! constrained format is compiled here, at prepare time (see [`crate::structured`]), so what
//! the engine cannot enforce is a 400.
//!
//! NOTE: `strict` is accepted either way and changes nothing: the grammar enforces the
//! schema in both cases, which is what `strict: true` promises and more than `false` asks.
//! `ignore_eos` and `min_tokens` are refused alongside a grammar: the grammar decides when
//! the output is complete, and both would have to be silently overridden.

use serde_json::{json, Value};

use super::common::{as_object, invalid_type, kind_of, unsupported};
use super::SamplingParams;
use crate::error::ApiError;
use crate::router::Router;
use crate::structured::{Grammar, GrammarSource};

pub(super) fn missing(param: &str) -> ApiError {
    ApiError::with_code(
        "missing_required_parameter",
        Some(param.to_string()),
        format!("Missing required parameter: `{param}`."),
    )
}

pub(super) fn string_field(obj: &serde_json::Map<String, Value>, key: &str, param: &str) -> Result<String, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Err(missing(param)),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(other) => Err(invalid_type(param, format!("`{param}` must be a string, not {}.", kind_of(other)))),
    }
}

/// An optional key of `obj` (absent or null passes) whose value must be of one JSON kind.
fn optional_kind(
    obj: &serde_json::Map<String, Value>,
    key: &str,
    param: &'static str,
    is_kind: fn(&Value) -> bool,
    kind: &str,
) -> Result<(), ApiError> {
    match obj.get(key) {
        Some(v) if !v.is_null() && !is_kind(v) => {
            Err(invalid_type(param, format!("`{key}` must be {kind}, not {}.", kind_of(v))))
        }
        _ => Ok(()),
    }
}

/// Keys of `response_format` and of its `json_schema` that mean nothing to the server (e.g.
/// vLLM-style `{"type": "json_object", "schema": ...}`, whose schema would otherwise be
/// dropped without a word).
pub fn response_format_unknown_keys(v: Option<&Value>) -> Vec<String> {
    let Some(rf) = v else { return Vec::new() };
    // Each type reads its own key: `regex` with type "regex", and so on; a key of another
    // type (a `json_schema` next to type "json_object") has no effect and is reported.
    let known: &[&str] = match rf.get("type").and_then(Value::as_str) {
        // (a structural tag reports its own keys as it is read: `structural_tag::parse`)
        Some("structural_tag") => return Vec::new(),
        Some("json_schema") => &["type", "json_schema"],
        Some("regex") => &["type", "regex"],
        Some("grammar") => &["type", "grammar"],
        _ => &["type"],
    };
    let mut out = super::chat::unknown_keys_of(rf, known, "response_format");
    if let (Some(js), Some("json_schema")) = (rf.get("json_schema"), rf.get("type").and_then(Value::as_str)) {
        out.extend(super::chat::unknown_keys_of(
            js,
            &["name", "description", "schema", "strict"],
            "response_format.json_schema",
        ));
        // OpenAI shows the description to the model; no prompt here ever holds it, so a
        // non-empty one is reported, as a tool's unseen description is.
        if js.get("description").and_then(Value::as_str).is_some_and(|d| !d.is_empty()) {
            out.push("response_format.json_schema.description".into());
        }
    }
    out
}

/// Validates `response_format`; returns the grammar source it asks for (None: free text)
/// and the param path the source came from. A structural tag's keys that mean nothing are
/// reported into `inert`.
pub fn response_format_source(
    v: Option<&Value>,
    inert: &mut Vec<String>,
) -> Result<Option<(GrammarSource, &'static str)>, ApiError> {
    let obj = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(v) => as_object(v, "response_format", "`response_format`")?,
    };
    let kind = match obj.get("type") {
        None => return Err(missing("response_format.type")),
        Some(Value::String(t)) => t.as_str(),
        Some(other) => {
            return Err(invalid_type(
                "response_format.type",
                format!("`response_format.type` must be a string, not {}.", kind_of(other)),
            ))
        }
    };
    match kind {
        "text" => Ok(None),
        "json_object" => Ok(Some((GrammarSource::JsonSchema(json!({"type": "object"})), "response_format"))),
        "json_schema" => {
            let js = match obj.get("json_schema") {
                None | Some(Value::Null) => return Err(missing("response_format.json_schema")),
                Some(v) => as_object(v, "response_format.json_schema", "`response_format.json_schema`")?,
            };
            let name = string_field(js, "name", "response_format.json_schema.name")?;
            if name.is_empty()
                || name.len() > 64
                || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
            {
                return Err(ApiError::invalid(
                    "response_format.json_schema.name",
                    "`name` must be 1 to 64 characters of a-z, A-Z, 0-9, `_` and `-`.",
                ));
            }
            optional_kind(js, "strict", "response_format.json_schema.strict", Value::is_boolean, "a boolean")?;
            optional_kind(js, "description", "response_format.json_schema.description", Value::is_string, "a string")?;
            let param = "response_format.json_schema.schema";
            let mut schema = match js.get("schema") {
                // OpenAI makes `schema` optional: without one, any JSON object.
                None | Some(Value::Null) => json!({"type": "object"}),
                Some(s) => Value::Object(as_object(s, param, "`schema`")?.clone()),
            };
            refuse_looping_ref(&schema, param)?;
            super::schema_edit::close_objects(&mut schema);
            Ok(Some((GrammarSource::JsonSchema(schema), param)))
        }
        "regex" => Ok(Some((
            GrammarSource::Regex(string_field(obj, "regex", "response_format.regex")?),
            "response_format.regex",
        ))),
        "grammar" => {
            let g = string_field(obj, "grammar", "response_format.grammar")?;
            Ok(Some((GrammarSource::Lark(lark_of(g, "response_format.grammar")?), "response_format.grammar")))
        }
        "structural_tag" => {
            let tagged = super::structural_tag::parse(obj, "response_format", inert)?;
            Ok(Some((GrammarSource::Tagged(tagged), "response_format")))
        }
        other => Err(ApiError::invalid(
            "response_format.type",
            format!(
                "Unknown `response_format.type` {other:?}: expected `text`, `json_object`, `json_schema`, \
                 `structural_tag`, `regex` or `grammar`."
            ),
        )),
    }
}

/// vLLM's ways of asking for a constrained output: `structured_outputs` (`json`, `regex`,
/// `choice`, `grammar`, `json_object`), and the `guided_json` / `guided_regex` /
/// `guided_choice` / `guided_grammar` fields it replaced in vLLM 0.12 (still sent by older
/// clients). They compile to the same grammars as `response_format`; `grammar` is Lark, as
/// vLLM's guidance backend reads it.
pub struct Guided<'a> {
    pub structured_outputs: Option<&'a Value>,
    pub json: Option<&'a Value>,
    pub regex: Option<&'a Value>,
    pub choice: Option<&'a Value>,
    pub grammar: Option<&'a Value>,
}

/// The keys of `structured_outputs` that constrain the output (exactly one may be set).
const STRUCTURED: [(&str, &str); 6] = [
    ("json", "structured_outputs.json"),
    ("regex", "structured_outputs.regex"),
    ("choice", "structured_outputs.choice"),
    ("grammar", "structured_outputs.grammar"),
    ("json_object", "structured_outputs.json_object"),
    ("structural_tag", "structured_outputs.structural_tag"),
];

impl<'a> Guided<'a> {
    /// The grammar asked for (None: none) and the param it came from. Keys of
    /// `structured_outputs` that tune vLLM's backends (`whitespace_pattern`,
    /// `disable_fallback`, ...) are reported into `inert` when they ask for something (not at
    /// null or false), as are a structural tag's keys that mean nothing.
    pub fn source(&self, inert: &mut Vec<String>) -> Result<Option<(GrammarSource, &'static str)>, ApiError> {
        fn set(v: Option<&Value>) -> Option<&Value> {
            v.filter(|v| !v.is_null())
        }
        let mut asked: Vec<(&'static str, &'static str, &'a Value)> = Vec::new();
        if let Some(v) = set(self.structured_outputs) {
            let so = as_object(v, "structured_outputs", "`structured_outputs`")?;
            // `json_object: false` asks for nothing, as null does, and so does a tuning key at
            // false (vLLM's StructuredOutputsParams sends `disable_fallback: false` and the rest of
            // its defaults when a client builds it and passes it whole)
            let tuning = |key: &str| key == "json_object" || !STRUCTURED.iter().any(|(k, _)| *k == key);
            let off = |key: &str, v: &Value| v.is_null() || (*v == Value::Bool(false) && tuning(key));
            for (key, v) in so.iter().filter(|(k, v)| !off(k, v)) {
                match STRUCTURED.iter().find(|(k, _)| k == key) {
                    Some(&(kind, param)) => asked.push((kind, param, v)),
                    None => inert.push(format!("structured_outputs.{key}")),
                }
            }
            let legacy_asks = [self.json, self.regex, self.choice, self.grammar].into_iter().any(|v| set(v).is_some());
            if asked.is_empty() && !legacy_asks {
                // as vLLM: the object is sent to constrain, and tuning keys alone do not
                return Err(ApiError::invalid(
                    "structured_outputs",
                    "`structured_outputs` must set one of `json`, `regex`, `choice`, `grammar`, \
                     `structural_tag` or `json_object: true`.",
                ));
            }
        }
        let legacy = [
            ("json", "guided_json", self.json),
            ("regex", "guided_regex", self.regex),
            ("choice", "guided_choice", self.choice),
            ("grammar", "guided_grammar", self.grammar),
        ];
        asked.extend(legacy.into_iter().filter_map(|(kind, param, v)| set(v).map(|v| (kind, param, v))));
        if let [_, (_, second, _), ..] = asked.as_slice() {
            let names: Vec<&str> = asked.iter().map(|(_, p, _)| *p).collect();
            return Err(ApiError::invalid(
                *second,
                format!("Only one structured-output constraint may be sent, got {}.", names.join(", ")),
            ));
        }
        let Some(&(kind, param, v)) = asked.first() else { return Ok(None) };
        let text = |v: &Value| match v {
            Value::String(s) => Ok(s.clone()),
            other => Err(invalid_type(param, format!("`{param}` must be a string, not {}.", kind_of(other)))),
        };
        let source = match kind {
            "json" => {
                let mut schema = match v {
                    Value::Object(_) => v.clone(),
                    // vLLM takes the schema as JSON text too
                    Value::String(s) => match serde_json::from_str::<Value>(s) {
                        Ok(schema @ Value::Object(_)) => schema,
                        Ok(other) => {
                            return Err(ApiError::invalid(
                                param,
                                format!("`{param}` must be a JSON Schema object, not {}.", kind_of(&other)),
                            ))
                        }
                        // (serde_json's message says where, and names its 128-level depth limit)
                        Err(e) => {
                            return Err(ApiError::invalid(
                                param,
                                format!("`{param}` must be a JSON Schema object; its JSON text does not parse: {e}."),
                            ))
                        }
                    },
                    other => {
                        return Err(invalid_type(
                            param,
                            format!("`{param}` must be a JSON Schema object, not {}.", kind_of(other)),
                        ))
                    }
                };
                refuse_looping_ref(&schema, param)?;
                super::schema_edit::close_objects(&mut schema);
                GrammarSource::JsonSchema(schema)
            }
            "regex" => GrammarSource::Regex(text(v)?),
            "grammar" => GrammarSource::Lark(lark_of(text(v)?, param)?),
            "json_object" => match v {
                Value::Bool(true) => GrammarSource::JsonSchema(json!({"type": "object"})),
                other => {
                    return Err(invalid_type(param, format!("`{param}` must be a boolean, not {}.", kind_of(other))))
                }
            },
            "choice" => GrammarSource::Lark(choice_grammar(v, param)?),
            "structural_tag" => GrammarSource::Tagged(structural_tag(v, param, inert)?),
            _ => unreachable!("STRUCTURED and the legacy fields name no other kind"),
        };
        Ok(Some((source, param)))
    }
}

/// A grammar as the engine compiles it: Lark as sent, GBNF (vLLM's default backend's format,
/// `root ::= ...`) written as Lark ([`super::gbnf`]), or a 400 at `param` saying why it is
/// neither.
pub(super) fn lark_of(grammar: String, param: &str) -> Result<String, ApiError> {
    if !super::gbnf::is_gbnf(&grammar) {
        return Ok(grammar);
    }
    super::gbnf::to_lark(&grammar).map_err(|why| {
        ApiError::invalid(param, format!("`{param}` is a GBNF grammar (`root ::= ...`) that cannot be read: {why}."))
    })
}

/// A 400 for a schema with a `$ref` that leads only through refs back to itself: the
/// grammar engine compiles it, but generation would stop at the dead end with a 500.
pub(super) fn refuse_looping_ref(schema: &Value, param: &str) -> Result<(), ApiError> {
    match super::schema_edit::looping_ref(schema) {
        Some(r) => Err(ApiError::invalid(
            param,
            format!("The schema's `$ref` {r:?} leads only through refs back to itself: no value matches it."),
        )),
        None => Ok(()),
    }
}

/// `structured_outputs.structural_tag`: the structural tag object, or its JSON text (as vLLM
/// takes it); its `type`, when sent, is "structural_tag".
fn structural_tag(v: &Value, param: &str, inert: &mut Vec<String>) -> Result<super::structural_tag::Tagged, ApiError> {
    let parsed;
    let v = match v {
        Value::String(s) => {
            parsed = serde_json::from_str::<Value>(s)
                .map_err(|e| ApiError::invalid(param, format!("`{param}` is not valid JSON: {e}.")))?;
            &parsed
        }
        v => v,
    };
    let obj = as_object(v, param, &format!("`{param}`"))?;
    match obj.get("type") {
        None | Some(Value::Null) => {}
        Some(Value::String(t)) if t == "structural_tag" => {}
        Some(_) => {
            return Err(ApiError::invalid(
                format!("{param}.type"),
                format!("`{param}.type` must be \"structural_tag\"."),
            ))
        }
    }
    super::structural_tag::parse(obj, param, inert)
}

/// Most choices a `choice` list may hold: the grammar engine chooses between at most 2000
/// items per step (a longer list fails at its first token, or worse, in the lexer).
const MAX_CHOICES: usize = 20000;

/// The grammar of exactly one of `choices` (a non-empty list of strings).
fn choice_grammar(choices: &Value, param: &str) -> Result<String, ApiError> {
    let Value::Array(items) = choices else {
        return Err(invalid_type(param, format!("`{param}` must be a list of strings, not {}.", kind_of(choices))));
    };
    if items.is_empty() || items.len() > MAX_CHOICES {
        return Err(ApiError::invalid(
            param,
            format!("`{param}` must list 1 to {MAX_CHOICES} choices, got {}.", items.len()),
        ));
    }
    let mut options = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        match item {
            Value::String(s) if !s.is_empty() => options.push(crate::structured::lark_literal(s)),
            Value::String(_) => {
                return Err(ApiError::invalid(format!("{param}[{i}]"), "A choice must not be empty."));
            }
            other => {
                return Err(invalid_type(
                    format!("{param}[{i}]"),
                    format!("A choice must be a string, not {}.", kind_of(other)),
                ))
            }
        }
    }
    // NOTE: one terminal (a single lexeme, which the lexer matches as one regex) rather than a
    // rule with an alternative per choice: the parser then holds one item per step, not
    // one per choice, and the engine's 2000 items per step do not bound the list.
    Ok(format!("start: CHOICE\nCHOICE: {}\n", options.join(" | ")))
}

/// Compiles a request's grammar, after refusing the sampling fields that would fight it.
pub(crate) fn compile(
    router: &Router,
    source: Option<(GrammarSource, &'static str)>,
    params: &SamplingParams,
) -> Result<Option<Grammar>, ApiError> {
    let Some((source, param)) = source else { return Ok(None) };
    if params.ignore_eos {
        return Err(ApiError::invalid(
            "ignore_eos",
            "`ignore_eos` cannot be combined with a constrained output (response_format, \
             structured_outputs, a forced tool_choice or strict tools): the grammar decides where the output ends.",
        ));
    }
    if params.min_tokens > 0 {
        return Err(ApiError::invalid(
            "min_tokens",
            "`min_tokens` cannot be combined with a constrained output (response_format, \
             structured_outputs, a forced tool_choice or strict tools): the grammar decides where the output ends.",
        ));
    }
    if params.allowed_token_ids.is_some() {
        // (their intersection may leave a grammar no token to go on with, mid-way)
        return Err(unsupported(
            "allowed_token_ids",
            "`allowed_token_ids` cannot be combined with a constrained output (response_format, \
             structured_outputs, a forced tool_choice or strict tools): the grammar decides which tokens may come.",
        ));
    }
    if params.beam_search.is_some() {
        return Err(super::common::beam_conflict(
            "use_beam_search",
            "a constrained output (response_format, structured_outputs, a forced tool_choice or strict tools)",
        ));
    }
    router.grammars.compile(&source, param).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::structured::tests::{byte_tokenizer, drive, refuses};
    use crate::structured::Grammars;

    #[test]
    fn a_choice_is_exactly_one_of_its_strings() {
        let tok = byte_tokenizer();
        let g = Grammars::new(tok.clone(), vec![0]);
        let choices = json!(["yes", "yes please", "say \"no\"", "a\\b\nc"]);
        let grammar = g.compile(&GrammarSource::Lark(choice_grammar(&choices, "c").unwrap()), "c").unwrap();
        for text in ["yes", "yes please", "say \"no\"", "a\\b\nc"] {
            let mut m = drive(&grammar, &tok, text);
            assert!(m.is_stopped() || m.is_accepting().unwrap(), "{text}");
        }
        assert!(drive(&grammar, &tok, "yes please").is_stopped());
        for wrong in ["no", "yes!", "say no", "a\\bc"] {
            assert!(refuses(&grammar, &tok, wrong), "{wrong}");
        }
        // DEL is escaped (llguidance's lexer refuses it raw)
        g.compile(&GrammarSource::Lark(choice_grammar(&json!(["a\u{7f}b"]), "c").unwrap()), "c").unwrap();
    }
}
