//! A structural check of a JSON Schema that a client sends as a tool's `parameters`.
//!
//! Under `tool_choice: "auto"` or `"none"` nothing compiles the schema (only forced calls and
//! `response_format` become grammars), so a malformed one would be accepted silently. OpenAI
//! refuses it. This walks the schema and checks the shapes of the keywords whose meaning is
//! fixed: `type` names a JSON type, `properties` maps names to schemas, `required` lists
//! strings, the combinators hold schemas, and a local `$ref` points at something. It does not
//! judge keywords it does not know (the llguidance compiler decides what it can enforce when a
//! schema becomes a grammar).

use std::cell::RefCell;

use serde_json::{Map, Value};

const TYPES: [&str; 7] = ["object", "array", "string", "number", "integer", "boolean", "null"];

/// Keywords whose value is one schema.
const ONE: [&str; 8] = ["items", "additionalProperties", "not", "contains", "propertyNames", "if", "then", "else"];
/// Keywords whose value is an array of schemas.
const MANY: [&str; 4] = ["anyOf", "oneOf", "allOf", "prefixItems"];
/// Keywords whose value maps names to schemas.
const MAPS: [&str; 4] = ["properties", "patternProperties", "$defs", "definitions"];
/// Keywords whose value is a non-negative integer.
const COUNTS: [&str; 6] = ["minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties"];
/// Keywords whose value is a number.
const NUMBERS: [&str; 3] = ["minimum", "maximum", "multipleOf"];
/// A number, or (draft 4, OpenAPI 3.0) a boolean.
const BOUNDS: [&str; 2] = ["exclusiveMinimum", "exclusiveMaximum"];

/// Ok, or what is wrong and where (a JSON-pointer-like path inside the schema).
pub(crate) fn check_schema(root: &Value) -> Result<(), String> {
    walk(root, &Root { value: root, loops: RefCell::default() }, "")
}

/// The schema checked, and which of its refs loop (each followed once).
struct Root<'a> {
    value: &'a Value,
    loops: RefCell<super::schema_edit::RefLoops>,
}

fn walk(schema: &Value, root: &Root<'_>, at: &str) -> Result<(), String> {
    let obj = match schema {
        Value::Bool(_) => return Ok(()),
        Value::Object(o) => o,
        other => return Err(format!("{} must be a schema (an object or a boolean), not {other}", here(at))),
    };
    check_type(obj, at)?;
    if let Some(req) = obj.get("required") {
        let ok = req.as_array().is_some_and(|a| a.iter().all(Value::is_string));
        if !ok {
            return Err(format!("{}/required must be an array of property names", here(at)));
        }
    }
    if let Some(e) = obj.get("enum") {
        if !e.is_array() {
            return Err(format!("{}/enum must be an array", here(at)));
        }
    }
    for key in COUNTS {
        if let Some(v) = obj.get(key) {
            // NOTE: 10.0 is an integer since draft 6 (and what Python writers emit)
            let whole = v.as_f64().is_some_and(|f| f >= 0.0 && f.fract() == 0.0);
            if !whole {
                return Err(format!("{}/{key} must be a non-negative integer", here(at)));
            }
        }
    }
    for key in NUMBERS {
        if let Some(v) = obj.get(key) {
            if !v.is_number() {
                return Err(format!("{}/{key} must be a number", here(at)));
            }
        }
    }
    for key in BOUNDS {
        if let Some(v) = obj.get(key) {
            if !v.is_number() && !v.is_boolean() {
                return Err(format!("{}/{key} must be a number (or, draft 4, a boolean)", here(at)));
            }
        }
    }
    if let Some(p) = obj.get("pattern") {
        if !p.is_string() {
            return Err(format!("{}/pattern must be a string", here(at)));
        }
    }
    if let Some(r) = obj.get("$ref") {
        let Some(r) = r.as_str() else { return Err(format!("{}/$ref must be a string", here(at))) };
        // Only JSON-pointer fragments are checked ("#foo" names an $anchor; other documents are
        // not fetched).
        if (r == "#" || r.starts_with("#/")) && root.value.pointer(&percent_decoded(&r[1..])).is_none() {
            return Err(format!("{}/$ref {r:?} points at nothing in the schema", here(at)));
        }
        if root.loops.borrow_mut().loops(root.value, r) {
            return Err(format!("{}/$ref {r:?} leads only through refs back to itself: no value matches it", here(at)));
        }
    }
    for key in ONE {
        if let Some(v) = obj.get(key) {
            // NOTE: draft 4-7 allowed `items` to be an array of schemas (tuple validation).
            match v {
                Value::Array(items) if key == "items" => each(items, root, &format!("{at}/{key}"))?,
                _ => walk(v, root, &format!("{at}/{key}"))?,
            }
        }
    }
    for key in MANY {
        if let Some(v) = obj.get(key) {
            let Some(items) = v.as_array() else { return Err(format!("{}/{key} must be an array", here(at))) };
            each(items, root, &format!("{at}/{key}"))?;
        }
    }
    for key in MAPS {
        if let Some(v) = obj.get(key) {
            let Some(map) = v.as_object() else {
                return Err(format!("{}/{key} must be an object of schemas", here(at)));
            };
            for (name, sub) in map {
                walk(sub, root, &format!("{at}/{key}/{name}"))?;
            }
        }
    }
    Ok(())
}

/// A URI fragment with its %XX escapes decoded (invalid escapes are kept as they are).
pub(crate) fn percent_decoded(fragment: &str) -> String {
    let bytes = fragment.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (bytes[i], bytes.get(i + 1).copied().and_then(hex), bytes.get(i + 2).copied().and_then(hex)) {
            (b'%', Some(hi), Some(lo)) => {
                out.push((hi * 16 + lo) as u8);
                i += 3;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn each(items: &[Value], root: &Root<'_>, at: &str) -> Result<(), String> {
    items.iter().enumerate().try_for_each(|(i, s)| walk(s, root, &format!("{at}/{i}")))
}

fn check_type(obj: &Map<String, Value>, at: &str) -> Result<(), String> {
    let bad = |t: &Value| format!("{}/type {t} is not one of {}", here(at), TYPES.join(", "));
    match obj.get("type") {
        None => Ok(()),
        Some(Value::String(t)) if TYPES.contains(&t.as_str()) => Ok(()),
        Some(Value::Array(ts)) if !ts.is_empty() => {
            match ts.iter().find(|t| !t.as_str().is_some_and(|t| TYPES.contains(&t))) {
                Some(t) => Err(bad(t)),
                None => Ok(()),
            }
        }
        Some(t) => Err(bad(t)),
    }
}

fn here(at: &str) -> String {
    if at.is_empty() {
        "the schema".into()
    } else {
        format!("#{at}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn well_formed_schemas_pass() {
        for s in [
            json!({}),
            json!(true),
            json!({"type": "object", "properties": {"a": {"type": "string", "minLength": 1}}, "required": ["a"]}),
            json!({"type": ["string", "null"], "enum": ["x", null]}),
            json!({"$defs": {"p": {"type": "integer", "minimum": 0}}, "properties": {"q": {"$ref": "#/$defs/p"}}}),
            json!({"items": [{"type": "string"}, {"type": "number"}], "additionalProperties": false}),
            json!({"anyOf": [{"type": "string"}, {"type": "object", "x-vendor": 1}], "uniqueItems": true}),
            json!({"$ref": "https://example.com/s.json"}),
            // draft 4 / OpenAPI 3.0 bounds, float counts, anchors, escaped pointers
            json!({"type": "number", "minimum": 0, "exclusiveMinimum": true, "maxLength": 10.0}),
            json!({"$defs": {"a b": {"$anchor": "x"}}, "anyOf": [{"$ref": "#x"}, {"$ref": "#/$defs/a%20b"}]}),
            json!({"items": true, "const": 3, "format": "date-time", "default": null, "type": ["string", "null"]}),
        ] {
            assert_eq!(check_schema(&s), Ok(()), "{s}");
        }
    }

    #[test]
    fn malformed_schemas_say_where() {
        for (s, needle) in [
            (json!({"type": "objekt"}), "the schema/type \"objekt\""),
            (json!({"type": "object", "properties": {"a": {"type": 5}}}), "#/properties/a/type 5"),
            (json!({"type": "object", "required": 5}), "required must be an array"),
            (
                json!({"properties": {"a": {"$ref": "#/nowhere"}}}),
                "#/properties/a/$ref \"#/nowhere\" points at nothing",
            ),
            (json!({"properties": []}), "properties must be an object"),
            (json!({"anyOf": {"type": "string"}}), "anyOf must be an array"),
            (json!({"items": {"type": ["string", "text"]}}), "#/items/type \"text\""),
            (json!({"properties": {"a": "string"}}), "#/properties/a must be a schema"),
            (json!({"maxLength": -1}), "maxLength must be a non-negative integer"),
            (json!({"maxItems": 2.5}), "maxItems must be a non-negative integer"),
            (json!({"exclusiveMinimum": "0"}), "exclusiveMinimum must be a number"),
            (json!("object"), "the schema must be a schema"),
        ] {
            let err = check_schema(&s).unwrap_err();
            assert!(err.contains(needle), "{s}: {err}");
        }
    }
}
