//! `response_format` `{"type": "structural_tag"}` (vLLM's, in xgrammar's terms): free text and
//! tagged structures, compiled to one grammar in llguidance's Lark dialect.
//!
//! Two shapes are accepted, as vLLM accepts them:
//! - `{"format": <format>}`: a tree of formats (`const_string`, `json_schema`, `regex`,
//!   `any_text`, `sequence`, `or`, `tag`, `triggered_tags`, `tags_with_separator`);
//! - the legacy `{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`: free text in
//!   which each trigger opens one of the structures that begin with it.
//!
//! xgrammar's `grammar` format (its own EBNF dialect) and `qwen_xml_parameter` are refused.
//!
//! NOTE: llguidance lexes greedily: free text (`any_text`, the text around triggered tags)
//! would swallow whatever a later element starts with, so free text must end what holds it
//! (its sequence, its tag, the tags after it), unless it is a tag's content, which then ends
//! lazily at the tag's `end`. Each translated format says where its output may end in free
//! text ([`Expr::open`]), and what would follow such text is refused. Text between
//! triggered tags is lazy up to its first trigger (`pre` rules), and the text after the last
//! tag holds no trigger, so a trigger always opens a tag.

use serde_json::{json, Map, Value};

use super::common::{as_object, invalid_type, kind_of, unsupported};
use super::constrained::{missing, string_field};
use crate::error::ApiError;
use crate::structured::{check_for_engine, check_regex, for_generation, lark_literal};

/// How deeply formats may nest (the translation recurses once per level).
const MAX_DEPTH: usize = 32;

/// A structural tag as a grammar: its Lark text, and the JSON schemas inlined in it with the
/// param of each (a schema the engine refuses is blamed at its own param).
#[derive(Clone, Debug, PartialEq)]
pub struct Tagged {
    pub lark: String,
    pub schemas: Vec<(String, Value)>,
}

/// `obj` (a `response_format` of type `structural_tag`, or `structured_outputs.structural_tag`)
/// as a grammar. Keys that mean nothing are reported into `inert`.
pub fn parse(obj: &Map<String, Value>, param: &str, inert: &mut Vec<String>) -> Result<Tagged, ApiError> {
    let mut t = Translator { rules: Vec::new(), schemas: Vec::new(), inert };
    let format = obj.get("format").filter(|v| !v.is_null());
    let structures = obj.get("structures").filter(|v| !v.is_null());
    let start = match (format, structures) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid(
                format!("{param}.structures"),
                "Send either `format` or the legacy `structures` and `triggers`, not both.",
            ))
        }
        (Some(f), None) => {
            unknown_keys(obj, &["type", "format"], param, t.inert);
            t.format(f, &format!("{param}.format"), 0)?.text
        }
        (None, Some(_)) => {
            unknown_keys(obj, &["type", "structures", "triggers"], param, t.inert);
            t.legacy(obj, param)?
        }
        (None, None) => {
            return Err(ApiError::with_code(
                "missing_required_parameter",
                Some(format!("{param}.format")),
                format!("Missing required parameter: `{param}.format` (or the legacy `structures` and `triggers`)."),
            ))
        }
    };
    let mut lark = format!("start: {start}\n");
    for rule in &t.rules {
        lark.push_str(rule);
        lark.push('\n');
    }
    Ok(Tagged { lark, schemas: t.schemas })
}

fn unknown_keys(obj: &Map<String, Value>, known: &[&str], param: &str, inert: &mut Vec<String>) {
    inert.extend(obj.keys().filter(|k| !known.contains(&k.as_str())).map(|k| format!("{param}.{k}")));
}

fn swallowed(at: &str) -> ApiError {
    ApiError::invalid(
        at,
        format!(
            "`{at}` is free text (`any_text`, or the text around `triggered_tags`) with more output after it (the \
             rest of its sequence, its tag's `end`, or more tags), which the text would swallow: free text must \
             come last, or be a tag's whole content (which then ends at the tag's `end`)."
        ),
    )
}

struct Translator<'a> {
    /// Rules after `start`, one line each.
    rules: Vec<String>,
    schemas: Vec<(String, Value)>,
    inert: &'a mut Vec<String>,
}

/// A format as a grammar expression.
struct Expr {
    text: String,
    /// Where its output may end in free text (the param of that text), which would swallow
    /// anything after it.
    open: Option<String>,
}

impl Expr {
    fn closed(text: String) -> Self {
        Expr { text, open: None }
    }
}

/// A tag: what its output begins with, the expression of its content, what it ends with, and
/// where it may end in free text (its content's, when it has no `end`).
struct Tag {
    begin: String,
    content: String,
    end: String,
    open: Option<String>,
}

impl Translator<'_> {
    /// A new rule with body `body`; its name.
    fn rule(&mut self, body: &str) -> String {
        self.define("st", "", body)
    }

    /// A new terminal (a single lexeme: `&` and `~` combine only those) with body `body`; its name.
    fn terminal(&mut self, body: &str) -> String {
        self.define("ST", "", body)
    }

    /// A new lazy rule (it ends as soon as its text matches) of the regex terminal `body`.
    fn lazy_rule(&mut self, body: &str) -> String {
        self.define("st", "[lazy]", body)
    }

    fn define(&mut self, prefix: &str, attributes: &str, body: &str) -> String {
        let name = format!("{prefix}{}", self.rules.len());
        self.rules.push(format!("{name}{attributes}: {body}"));
        name
    }

    fn format(&mut self, v: &Value, at: &str, depth: usize) -> Result<Expr, ApiError> {
        if depth > MAX_DEPTH {
            return Err(ApiError::invalid(at, format!("Formats may nest at most {MAX_DEPTH} deep.")));
        }
        let obj = as_object(v, at, &format!("`{at}`"))?;
        let kind = match obj.get("type") {
            Some(Value::String(t)) => t.as_str(),
            None | Some(Value::Null) => return Err(missing(&format!("{at}.type"))),
            Some(other) => {
                return Err(invalid_type(
                    format!("{at}.type"),
                    format!("`{at}.type` must be a string, not {}.", kind_of(other)),
                ))
            }
        };
        match kind {
            "const_string" => {
                unknown_keys(obj, &["type", "value"], at, self.inert);
                Ok(Expr::closed(lark_literal(&string_field(obj, "value", &format!("{at}.value"))?)))
            }
            "json_schema" => {
                unknown_keys(obj, &["type", "json_schema"], at, self.inert);
                self.json_schema(obj.get("json_schema"), &format!("{at}.json_schema")).map(Expr::closed)
            }
            "regex" => {
                unknown_keys(obj, &["type", "pattern"], at, self.inert);
                let param = format!("{at}.pattern");
                let rx = string_field(obj, "pattern", &param)?;
                check_regex(&rx, "regex").map_err(|cause| {
                    ApiError::invalid(
                        &param,
                        format!("The regular expression cannot be used to constrain generation: {cause}"),
                    )
                })?;
                Ok(Expr::closed(self.rule(&format!("/{}/", llguidance::regex_to_lark(&rx, "dw")))))
            }
            "any_text" => {
                unknown_keys(obj, &["type", "excluded_str"], at, self.inert);
                let excluded = excluded(obj, at)?;
                Ok(Expr { text: self.terminal(&free_text(&excluded)), open: Some(at.to_string()) })
            }
            "sequence" | "or" => {
                unknown_keys(obj, &["type", "elements"], at, self.inert);
                let elements = list(obj, "elements", at)?;
                let mut exprs = Vec::with_capacity(elements.len());
                for (i, e) in elements.iter().enumerate() {
                    exprs.push(self.format(e, &format!("{at}.elements[{i}]"), depth + 1)?);
                }
                let texts: Vec<&str> = exprs.iter().map(|e| e.text.as_str()).collect();
                let (body, open) = if kind == "sequence" {
                    // (free text only at the end: it would swallow the elements after it)
                    if let Some(open) = exprs[..exprs.len() - 1].iter().find_map(|e| e.open.as_deref()) {
                        return Err(swallowed(open));
                    }
                    (texts.join(" "), exprs.last().and_then(|e| e.open.clone()))
                } else {
                    (texts.join(" | "), exprs.iter().find_map(|e| e.open.clone()))
                };
                Ok(Expr { text: self.rule(&body), open })
            }
            "tag" => {
                unknown_keys(obj, &["type", "begin", "content", "end"], at, self.inert);
                let tag = self.tag(obj, at, depth)?;
                Ok(Expr { text: self.rule(&tag_body(&tag, "")), open: tag.open })
            }
            "triggered_tags" => {
                let keys = ["type", "triggers", "tags", "at_least_one", "stop_after_first"];
                unknown_keys(obj, &keys, at, self.inert);
                let triggers = strings(obj.get("triggers"), &format!("{at}.triggers"))?;
                let tags = self.tags(obj, at, depth)?;
                let (at_least_one, stop_after_first) =
                    (flag(obj, "at_least_one", at)?, flag(obj, "stop_after_first", at)?);
                self.triggered(&triggers, &tags, at, &format!("{at}.tags"), at_least_one, stop_after_first)
            }
            "tags_with_separator" => {
                let keys = ["type", "tags", "separator", "at_least_one", "stop_after_first"];
                unknown_keys(obj, &keys, at, self.inert);
                let tags = self.tags(obj, at, depth)?;
                let separator = string_field(obj, "separator", &format!("{at}.separator"))?;
                let (at_least_one, stop_after_first) =
                    (flag(obj, "at_least_one", at)?, flag(obj, "stop_after_first", at)?);
                if let Some(open) = tags.iter().find_map(|t| t.open.as_deref()).filter(|_| !stop_after_first) {
                    return Err(swallowed(open));
                }
                let one = self.rule(&tags.iter().map(|t| tag_body(t, "")).collect::<Vec<_>>().join(" | "));
                let body = match (at_least_one, stop_after_first) {
                    (false, true) => format!("{one}?"),
                    (true, true) => one,
                    (least, false) => {
                        let sep = match separator.is_empty() {
                            true => String::new(),
                            false => format!("{} ", lark_literal(&separator)),
                        };
                        let many = format!("{one} ({sep}{one})*");
                        if least {
                            many
                        } else {
                            format!("({many})?")
                        }
                    }
                };
                let open = tags.iter().find_map(|t| t.open.clone());
                Ok(Expr { text: self.rule(&body), open })
            }
            "grammar" => {
                // xgrammar's EBNF (GBNF: `root ::= ...`), or Lark, as `response_format`'s grammar:
                // a grammar of its own inside this one (llguidance's `%lark { ... }`)
                unknown_keys(obj, &["type", "grammar"], at, self.inert);
                let param = format!("{at}.grammar");
                let lark = super::constrained::lark_of(string_field(obj, "grammar", &param)?, &param)?;
                Ok(Expr::closed(self.rule(&format!("%lark {{\n{lark}\n}}"))))
            }
            "qwen_xml_parameter" => Err(unsupported(
                format!("{at}.type"),
                "Structural tag format \"qwen_xml_parameter\" is not supported: Qwen3-Coder's XML calls are \
                 constrained by `tools` with `tool_choice` (`--tool-call-format qwen3_xml`).",
            )),
            other => Err(ApiError::invalid(
                format!("{at}.type"),
                format!(
                    "Unknown structural tag format {other:?}: expected `const_string`, `json_schema`, `regex`, \
                     `grammar`, `any_text`, `sequence`, `or`, `tag`, `triggered_tags` or `tags_with_separator`."
                ),
            )),
        }
    }

    /// A JSON schema inlined as llguidance's `%json`, edited as `response_format`'s are. As
    /// xgrammar takes it: an object, `true` (any JSON value), or its JSON text (the legacy
    /// `schema`); `false` matches nothing and is refused.
    fn json_schema(&mut self, v: Option<&Value>, param: &str) -> Result<String, ApiError> {
        let parsed;
        let v = match v {
            Some(Value::String(text)) => {
                parsed = serde_json::from_str::<Value>(text)
                    .map_err(|e| ApiError::invalid(param, format!("`{param}` is not valid JSON: {e}.")))?;
                Some(&parsed)
            }
            v => v,
        };
        let mut schema = match v {
            None | Some(Value::Null) => return Err(missing(param)),
            Some(Value::Bool(true)) => json!({}),
            Some(Value::Bool(false)) => {
                return Err(ApiError::invalid(param, format!("`{param}` is `false`: no value matches it.")))
            }
            Some(s) => Value::Object(as_object(s, param, &format!("`{param}`"))?.clone()),
        };
        super::constrained::refuse_looping_ref(&schema, param)?;
        super::schema_edit::close_objects(&mut schema);
        check_for_engine(&schema).map_err(|cause| {
            ApiError::invalid(param, format!("The JSON schema cannot be used to constrain generation: {cause}"))
        })?;
        let body = format!("%json {}", for_generation(&schema));
        self.schemas.push((param.to_string(), schema));
        Ok(self.rule(&body))
    }

    /// A tag object's parts: `begin`, `content` (as a grammar expression) and `end`.
    fn tag(&mut self, obj: &Map<String, Value>, at: &str, depth: usize) -> Result<Tag, ApiError> {
        let (begin, end) =
            (string_field(obj, "begin", &format!("{at}.begin"))?, string_field(obj, "end", &format!("{at}.end"))?);
        let content_at = format!("{at}.content");
        let Some(content) = obj.get("content").filter(|v| !v.is_null()) else { return Err(missing(&content_at)) };
        // Free text that the tag's end closes: lazy, up to the first `end`.
        let is_any_text = content.get("type").and_then(Value::as_str) == Some("any_text");
        if is_any_text && !end.is_empty() {
            let obj = as_object(content, &content_at, &format!("`{content_at}`"))?;
            unknown_keys(obj, &["type", "excluded_str"], &content_at, self.inert);
            let excluded = excluded(obj, &content_at)?;
            // (the lazy text writes the end itself: the tag then ends with nothing more)
            let upto = format!("/(?s:.*){}/", regex_literal(&end));
            let body = match excluded.is_empty() {
                true => upto,
                false => format!("{upto} & ~{}", containing(&excluded)),
            };
            return Ok(Tag { begin, content: self.lazy_rule(&body), end: String::new(), open: None });
        }
        let content = self.format(content, &content_at, depth + 1)?;
        match (content.open, end.is_empty()) {
            (Some(open), false) => Err(swallowed(&open)),
            (open, _) => Ok(Tag { begin, content: content.text, end, open }),
        }
    }

    /// The `tags` of a `triggered_tags` or `tags_with_separator` format.
    fn tags(&mut self, obj: &Map<String, Value>, at: &str, depth: usize) -> Result<Vec<Tag>, ApiError> {
        let items = list(obj, "tags", at)?;
        let mut tags = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            let tag_at = format!("{at}.tags[{i}]");
            let tag = as_object(item, &tag_at, &format!("`{tag_at}`"))?;
            match tag.get("type") {
                None | Some(Value::Null) => {}
                Some(Value::String(t)) if t == "tag" => {}
                Some(_) => return Err(ApiError::invalid(format!("{tag_at}.type"), "A tag's `type` must be \"tag\".")),
            }
            unknown_keys(tag, &["type", "begin", "content", "end"], &tag_at, self.inert);
            tags.push(self.tag(tag, &tag_at, depth + 1)?);
        }
        Ok(tags)
    }

    /// Free text in which each trigger opens one of the tags that begin with it.
    /// `tags_at`: the list the tags came from (their `begin` is blamed there).
    fn triggered(
        &mut self,
        triggers: &[String],
        tags: &[Tag],
        at: &str,
        tags_at: &str,
        at_least_one: bool,
        stop_after_first: bool,
    ) -> Result<Expr, ApiError> {
        if let Some(i) = triggers.iter().position(String::is_empty) {
            return Err(ApiError::invalid(format!("{at}.triggers[{i}]"), "A trigger must not be empty."));
        }
        // each tag's trigger: the one its begin starts with
        let mut of_trigger: Vec<Vec<&Tag>> = vec![Vec::new(); triggers.len()];
        for (i, tag) in tags.iter().enumerate() {
            let starts: Vec<usize> = (0..triggers.len()).filter(|&j| tag.begin.starts_with(&triggers[j])).collect();
            match starts.as_slice() {
                [j] => of_trigger[*j].push(tag),
                _ => {
                    return Err(ApiError::invalid(
                        format!("{tags_at}[{i}].begin"),
                        format!(
                        "A triggered tag's `begin` must start with exactly one of the `triggers`; {:?} starts with {}.",
                        tag.begin,
                        match starts.len() {
                            0 => "none".to_string(),
                            n => format!("{n}"),
                        }
                    ),
                    ))
                }
            }
        }
        // (a trigger that opens no tag could appear nowhere: the text never holds a trigger)
        if let Some(i) = of_trigger.iter().position(Vec::is_empty) {
            return Err(ApiError::invalid(
                format!("{at}.triggers[{i}]"),
                format!("The trigger {:?} opens none of the tags: no tag's `begin` starts with it.", triggers[i]),
            ));
        }
        let any_tag = self.rule(&tags.iter().map(|t| tag_body(t, "")).collect::<Vec<_>>().join(" | "));
        if at_least_one && stop_after_first {
            return Ok(Expr { text: any_tag, open: tags.iter().find_map(|t| t.open.clone()) });
        }
        // (a tag ending in free text would swallow the triggers after it)
        if let Some(open) = tags.iter().find_map(|t| t.open.as_deref()).filter(|_| !stop_after_first) {
            return Err(swallowed(open));
        }
        // text up to (and with) its first trigger, then the rest of a tag that trigger opens
        let mut segments = Vec::new();
        for (trigger, tags) in triggers.iter().zip(&of_trigger) {
            let pre = self.lazy_rule(&format!("/(?s:.*){}/", regex_literal(trigger)));
            let rests: Vec<String> = tags.iter().map(|t| tag_body(t, trigger)).collect();
            segments.push(format!("{pre} ({})", rests.join(" | ")));
        }
        let segment = self.rule(&segments.join(" | "));
        let tail = self.terminal(&free_text(triggers));
        let body = match (at_least_one, stop_after_first) {
            (false, false) => format!("{segment}* {tail}"),
            (true, false) => format!("{any_tag} {segment}* {tail}"),
            (false, true) => format!("{tail} | {segment}"),
            (true, true) => unreachable!("returned above"),
        };
        Ok(Expr { text: self.rule(&body), open: Some(at.to_string()) })
    }

    /// The legacy shape: free text in which each trigger opens one of the structures.
    fn legacy(&mut self, obj: &Map<String, Value>, param: &str) -> Result<String, ApiError> {
        let s_at = format!("{param}.structures");
        let items = list(obj, "structures", param)?;
        let mut tags = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            let at = format!("{s_at}[{i}]");
            let obj = as_object(item, &at, &format!("`{at}`"))?;
            unknown_keys(obj, &["begin", "schema", "end"], &at, self.inert);
            let (begin, end) =
                (string_field(obj, "begin", &format!("{at}.begin"))?, string_field(obj, "end", &format!("{at}.end"))?);
            let content = self.json_schema(obj.get("schema"), &format!("{at}.schema"))?;
            tags.push(Tag { begin, content, end, open: None });
        }
        let triggers = strings(obj.get("triggers"), &format!("{param}.triggers"))?;
        Ok(self.triggered(&triggers, &tags, param, &s_at, false, false)?.text)
    }
}

/// `begin content end` of a tag, `begin` without its first `skip` (its trigger, which the text
/// before it wrote).
fn tag_body(tag: &Tag, skip: &str) -> String {
    let begin = &tag.begin[skip.len()..];
    let parts = [
        (!begin.is_empty()).then(|| lark_literal(begin)),
        Some(tag.content.clone()),
        (!tag.end.is_empty()).then(|| lark_literal(&tag.end)),
    ];
    let body: Vec<String> = parts.into_iter().flatten().collect();
    format!("({})", body.join(" "))
}

/// Text that holds none of `excluded` (any text when it is empty): greedy.
fn free_text(excluded: &[String]) -> String {
    match excluded.is_empty() {
        true => "/(?s:.*)/".into(),
        false => format!("/(?s:.*)/ & ~{}", containing(excluded)),
    }
}

/// The regex terminal of text that holds one of `strings`.
fn containing(strings: &[String]) -> String {
    let any: Vec<String> = strings.iter().map(|s| regex_literal(s)).collect();
    format!("/(?s:.*)({})(?s:.*)/", any.join("|"))
}

/// `text` matched literally, inside a Lark `/regex/`.
fn regex_literal(text: &str) -> String {
    llguidance::regex_to_lark(&regex_syntax::escape(text), "")
}

/// A non-empty list at `key`.
fn list<'v>(obj: &'v Map<String, Value>, key: &str, at: &str) -> Result<&'v Vec<Value>, ApiError> {
    let param = format!("{at}.{key}");
    match obj.get(key) {
        None | Some(Value::Null) => Err(missing(&param)),
        Some(Value::Array(items)) if items.is_empty() => {
            Err(ApiError::invalid(&param, format!("`{param}` must list at least one item.")))
        }
        Some(Value::Array(items)) => Ok(items),
        Some(other) => Err(invalid_type(&param, format!("`{param}` must be a list, not {}.", kind_of(other)))),
    }
}

/// A non-empty list of strings (at `param`).
fn strings(v: Option<&Value>, param: &str) -> Result<Vec<String>, ApiError> {
    let items = match v {
        None | Some(Value::Null) => return Err(missing(param)),
        Some(Value::Array(items)) if items.is_empty() => {
            return Err(ApiError::invalid(param, format!("`{param}` must list at least one item.")))
        }
        Some(Value::Array(items)) => items,
        Some(other) => return Err(invalid_type(param, format!("`{param}` must be a list, not {}.", kind_of(other)))),
    };
    items
        .iter()
        .enumerate()
        .map(|(i, v)| match v {
            Value::String(s) => Ok(s.clone()),
            other => Err(invalid_type(
                format!("{param}[{i}]"),
                format!("`{param}[{i}]` must be a string, not {}.", kind_of(other)),
            )),
        })
        .collect()
}

/// `any_text`'s `excluded_str`: strings its text must not hold (none when absent).
fn excluded(obj: &Map<String, Value>, at: &str) -> Result<Vec<String>, ApiError> {
    if obj.get("excluded_str").is_none_or(Value::is_null) {
        return Ok(Vec::new());
    }
    let param = format!("{at}.excluded_str");
    let Value::Array(items) = &obj["excluded_str"] else {
        return Err(invalid_type(
            &param,
            format!("`{param}` must be a list of strings, not {}.", kind_of(&obj["excluded_str"])),
        ));
    };
    let mut out = Vec::with_capacity(items.len());
    for (i, v) in items.iter().enumerate() {
        match v {
            Value::String(s) if !s.is_empty() => out.push(s.clone()),
            Value::String(_) => {
                return Err(ApiError::invalid(format!("{param}[{i}]"), "An excluded string must not be empty."))
            }
            other => {
                return Err(invalid_type(
                    format!("{param}[{i}]"),
                    format!("`{param}[{i}]` must be a string, not {}.", kind_of(other)),
                ))
            }
        }
    }
    Ok(out)
}

/// A boolean option (false when absent or null).
fn flag(obj: &Map<String, Value>, key: &str, at: &str) -> Result<bool, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(other) => {
            Err(invalid_type(format!("{at}.{key}"), format!("`{at}.{key}` must be a boolean, not {}.", kind_of(other))))
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::structured::tests::byte_tokenizer;
    use crate::structured::{Grammar, GrammarSource, Grammars};
    use crate::tokenizer::Tokenizer;

    /// A byte-level tokenizer and a grammar engine over it (EOS is token 0).
    fn engine() -> (std::sync::Arc<Tokenizer>, Grammars) {
        let tok = byte_tokenizer();
        (tok.clone(), Grammars::new(tok, vec![0]))
    }

    fn compile(g: &Grammars, tag: Value) -> Grammar {
        let mut inert = Vec::new();
        let tagged = parse(tag.as_object().unwrap(), "response_format", &mut inert).unwrap();
        assert!(inert.is_empty(), "{inert:?}");
        g.compile(&GrammarSource::Tagged(tagged), "response_format").unwrap()
    }

    /// Whether `text` is a whole output of the grammar (every token allowed, and it may end).
    fn whole(grammar: &Grammar, tok: &Tokenizer, text: &str) -> bool {
        let mut m = grammar.matcher();
        for id in tok.encode(text, false) {
            if m.is_stopped() || !m.compute_mask().unwrap().is_allowed(id) {
                return false;
            }
            m.consume_token(id).unwrap();
        }
        m.is_stopped() || m.is_accepting().unwrap()
    }

    fn point() -> Value {
        json!({"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]})
    }

    #[test]
    fn a_grammar_format_is_a_grammar_inside_the_tag() {
        // xgrammar's EBNF (GBNF) or Lark, each a grammar of its own inside the tag's
        let (tok, g) = engine();
        for grammar in ["root ::= \"SELECT \" [a-c]+ (\",\" [a-c]+)*", "start: \"SELECT \" /[a-c]+(,[a-c]+)*/"] {
            let tag = json!({"type": "structural_tag", "format": {"type": "sequence", "elements": [
                {"type": "const_string", "value": "Q: "}, {"type": "grammar", "grammar": grammar},
                {"type": "const_string", "value": ";"}]}});
            let grammar = compile(&g, tag);
            assert!(whole(&grammar, &tok, "Q: SELECT ab,c;"), "{grammar:?}");
            assert!(!whole(&grammar, &tok, "Q: SELECT ab,d;"));
            assert!(!whole(&grammar, &tok, "Q: SELECT ab"));
        }
    }

    #[test]
    fn triggers_open_tags_in_free_text() {
        let (tok, g) = engine();
        let legacy = json!({"type": "structural_tag", "triggers": ["<function="], "structures": [
            {"begin": "<function=f>", "schema": point(), "end": "</function>"},
            {"begin": "<function=g>", "schema": {"type": "string"}, "end": "</function>"}]});
        let format = json!({"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<function="],
            "tags": [{"begin": "<function=f>", "content": {"type": "json_schema", "json_schema": point()}, "end": "</function>"},
                     {"type": "tag", "begin": "<function=g>", "content": {"type": "json_schema", "json_schema": {"type": "string"}},
                      "end": "</function>"}]}});
        for tag in [legacy, format] {
            let grammar = compile(&g, tag);
            for text in [
                "",
                "just text",
                "a <function=f>{\"x\": 1}</function> b",
                "<function=g>\"s\"</function><function=f>{\"x\": 2}</function>",
                "<func <function=f>{\"x\": 1}</function>",
            ] {
                assert!(whole(&grammar, &tok, text), "{text}");
            }
            // a trigger must open a tag, whose content follows its schema and which must close
            for text in
                ["<function=h>", "<function=f>{\"y\": 1}", "<function=f>{\"x\": 1, \"y\": 1}", "<function=f>{\"x\": 1}"]
            {
                assert!(!whole(&grammar, &tok, text), "{text}");
            }
        }
    }

    #[test]
    fn at_least_one_and_stop_after_first_shape_the_tags() {
        let (tok, g) = engine();
        let shaped = |least: bool, first: bool| {
            let tags = json!([{"begin": "<a>", "content": {"type": "const_string", "value": "1"}, "end": "</a>"}]);
            compile(
                &g,
                json!({"format": {"type": "triggered_tags", "triggers": ["<a>"], "tags": tags,
                "at_least_one": least, "stop_after_first": first}}),
            )
        };
        let cases: [(bool, bool, &[&str], &[&str]); 4] = [
            (false, false, &["", "x", "x<a>1</a>y<a>1</a>"], &[]),
            (true, false, &["<a>1</a>", "<a>1</a>y<a>1</a>z"], &["", "x<a>1</a>"]),
            (false, true, &["", "x", "x<a>1</a>"], &["x<a>1</a>y", "<a>1</a><a>1</a>"]),
            (true, true, &["<a>1</a>"], &["", "x<a>1</a>", "<a>1</a>x"]),
        ];
        for (least, first, ok, bad) in cases {
            let grammar = shaped(least, first);
            for text in ok {
                assert!(whole(&grammar, &tok, text), "{least} {first} {text:?}");
            }
            for text in bad {
                assert!(!whole(&grammar, &tok, text), "{least} {first} {text:?}");
            }
        }
    }

    #[test]
    fn tags_with_a_separator_and_nothing_else() {
        let (tok, g) = engine();
        let tags = json!([{"begin": "{\"n\": ", "content": {"type": "json_schema", "json_schema": {"type": "integer"}}, "end": "}"},
                          {"begin": "<b>", "content": {"type": "regex", "pattern": "\\d{2}"}, "end": ""}]);
        let grammar = compile(
            &g,
            json!({"format": {"type": "sequence", "elements": [
            {"type": "const_string", "value": "["},
            {"type": "tags_with_separator", "tags": tags, "separator": ", ", "at_least_one": true},
            {"type": "const_string", "value": "]"}]}}),
        );
        for text in ["[{\"n\": 1}]", "[{\"n\": 1}, <b>12, {\"n\": 3}]"] {
            assert!(whole(&grammar, &tok, text), "{text}");
        }
        for text in ["[]", "[{\"n\": 1},{\"n\": 2}]", "[<b>1]", "[x]"] {
            assert!(!whole(&grammar, &tok, text), "{text}");
        }
    }

    #[test]
    fn any_text_in_a_tag_ends_at_the_end_and_skips_excluded_strings() {
        let (tok, g) = engine();
        let grammar = compile(
            &g,
            json!({"format": {"type": "sequence", "elements": [
            {"type": "tag", "begin": "<think>", "content": {"type": "any_text", "excluded_str": ["<tool>"]}, "end": "</think>"},
            {"type": "or", "elements": [{"type": "const_string", "value": "yes"}, {"type": "any_text"}]}]}}),
        );
        for text in ["<think></think>yes", "<think>a < b</think>anything", "<think>x</think>"] {
            assert!(whole(&grammar, &tok, text), "{text}");
        }
        for text in ["<think>a<tool>b</think>", "x"] {
            assert!(!whole(&grammar, &tok, text), "{text}");
        }
    }

    fn refused(tag: Value) -> ApiError {
        parse(tag.as_object().unwrap(), "response_format", &mut Vec::new()).unwrap_err()
    }

    #[test]
    fn what_cannot_be_enforced_is_refused_where_it_is() {
        let text = json!({"type": "any_text"});
        let one = json!({"type": "const_string", "value": "1"});
        let cases = [
            (json!({"type": "structural_tag"}), "response_format.format"),
            (json!({"format": {"type": "sequence", "elements": [text, one]}}), "response_format.format.elements[0]"),
            (
                json!({"format": {"type": "tag", "begin": "<a>", "end": "</a>", "content": {"type": "sequence",
                "elements": [one, {"type": "triggered_tags", "triggers": ["<"], "tags": [{"begin": "<b>", "content": one, "end": ""}]}]}}}),
                "response_format.format.content.elements[1]",
            ),
            // (a tag without an end that ends in free text, followed by more tags)
            (
                json!({"format": {"type": "tags_with_separator", "separator": ",",
                "tags": [{"begin": "<a>", "content": text, "end": ""}]}}),
                "response_format.format.tags[0].content",
            ),
            (
                json!({"format": {"type": "triggered_tags", "triggers": ["<a"],
                "tags": [{"begin": "<a>", "content": text, "end": ""}]}}),
                "response_format.format.tags[0].content",
            ),
            (json!({"format": {"type": "grammar", "grammar": "root ::= \"a"}}), "response_format.format.grammar"),
            (json!({"format": {"type": "qwen_xml_parameter", "json_schema": {}}}), "response_format.format.type"),
            (json!({"format": {"type": "nope"}}), "response_format.format.type"),
            (
                json!({"format": {"type": "triggered_tags", "triggers": ["<a", "<ab"], "tags": [{"begin": "<abc>", "content": one, "end": ""}]}}),
                "response_format.format.tags[0].begin",
            ),
            (
                json!({"format": {"type": "triggered_tags", "triggers": ["<x"], "tags": [{"begin": "<a>", "content": one, "end": ""}]}}),
                "response_format.format.tags[0].begin",
            ),
            (
                json!({"structures": [{"begin": "<a>", "schema": {}, "end": ""}], "triggers": ["<b"]}),
                "response_format.structures[0].begin",
            ),
            (json!({"structures": [{"begin": "<a>", "schema": {}, "end": ""}]}), "response_format.triggers"),
            (
                json!({"structures": [{"begin": "<a>", "schema": {}, "end": ""}], "triggers": ["<a", "<b"]}),
                "response_format.triggers[1]",
            ),
            (json!({"format": one, "structures": []}), "response_format.structures"),
            (json!({"format": {"type": "regex", "pattern": "("}}), "response_format.format.pattern"),
            (json!({"format": {"type": "sequence", "elements": []}}), "response_format.format.elements"),
            (
                json!({"format": {"type": "json_schema", "json_schema": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}}}),
                "response_format.format.json_schema",
            ),
        ];
        for (tag, param) in cases {
            let err = refused(tag.clone());
            assert_eq!(err.param(), Some(param), "{tag}: {err:?}");
        }
    }

    #[test]
    fn a_schema_the_engine_refuses_is_blamed_at_its_param() {
        let tok = byte_tokenizer();
        let g = Grammars::new(tok, vec![0]);
        let tag = json!({"format": {"type": "sequence", "elements": [{"type": "const_string", "value": "a"},
            {"type": "json_schema", "json_schema": {"type": "array", "uniqueItems": true}}]}});
        let tagged = parse(tag.as_object().unwrap(), "response_format", &mut Vec::new()).unwrap();
        let err = g.compile(&GrammarSource::Tagged(tagged), "response_format").unwrap_err();
        assert_eq!(err.param(), Some("response_format.format.elements[1].json_schema"), "{err:?}");
    }

    #[test]
    fn schemas_as_xgrammar_takes_them() {
        let (tok, g) = engine();
        let any = compile(
            &g,
            json!({"format": {"type": "tag", "begin": "<a>", "end": "</a>",
            "content": {"type": "json_schema", "json_schema": true}}}),
        );
        assert!(whole(&any, &tok, "<a>[1, \"x\"]</a>") && whole(&any, &tok, "<a>null</a>"));
        let text = compile(
            &g,
            json!({"triggers": ["<a"], "structures": [{"begin": "<a>", "end": "</a>",
            "schema": "{\"type\": \"integer\"}"}]}),
        );
        assert!(whole(&text, &tok, "x<a>12</a>") && !whole(&text, &tok, "x<a>\"12\"</a>"));
        let nothing = json!({"format": {"type": "json_schema", "json_schema": false}});
        assert_eq!(refused(nothing).param(), Some("response_format.format.json_schema"));
    }

    #[test]
    fn keys_that_mean_nothing_are_reported() {
        let mut inert = Vec::new();
        let tag = json!({"type": "structural_tag", "x": 1, "format": {"type": "tag", "begin": "a", "end": "b", "y": 2,
            "content": {"type": "any_text", "z": 3}}});
        parse(tag.as_object().unwrap(), "response_format", &mut inert).unwrap();
        assert_eq!(inert, ["response_format.x", "response_format.format.y", "response_format.format.content.z"]);
    }
}
