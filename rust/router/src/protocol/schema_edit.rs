//! Rewrites of a client's JSON Schema before it becomes a grammar.
//!
//! - **Moving a schema:** a tool's `parameters` is placed inside a larger schema (the call
//!   object `{"name", "arguments"}`), where its local `$ref`s (`#/$defs/Unit`, or `#` for a
//!   recursive schema) would point at the wrong place. `rebase_refs` rewrites them to the
//!   schema's new location; `resolve` follows them where code must read a referenced schema.
//! - **Closing objects:** an object schema that lists its `properties` but says nothing of
//!   others gets `additionalProperties: false`, as vLLM's default grammar backend (xgrammar)
//!   and OpenAI's strict mode treat it. JSON Schema would allow extra keys there, and a small
//!   model fills them with invented ones, which the function the arguments are meant for
//!   cannot take. Every output still validates against the schema as sent.

use serde_json::{Map, Value};

/// Keys whose values are data, not schemas: a `$ref` inside them is not a reference.
const DATA: [&str; 4] = ["const", "enum", "default", "examples"];

/// Keywords that hold one schema (or a map or array of them) whose objects may be closed:
/// the ones an instance must match. Not `not`, `if` or `contains` (closing inside them would
/// change what they accept), and not `allOf`, whose branches each see the whole object.
const CLOSABLE_ONE: [&str; 2] = ["items", "additionalProperties"];
const CLOSABLE_MANY: [&str; 3] = ["anyOf", "oneOf", "prefixItems"];
const CLOSABLE_MAPS: [&str; 4] = ["properties", "patternProperties", "$defs", "definitions"];

/// Whether `schema` holds a local `$ref` (one starting with `#`).
pub fn has_local_ref(schema: &Value) -> bool {
    match schema {
        Value::Object(obj) => obj.iter().any(|(key, v)| match (key.as_str(), v) {
            ("$ref", Value::String(r)) => r.starts_with('#'),
            (k, _) if DATA.contains(&k) => false,
            _ => has_local_ref(v),
        }),
        Value::Array(items) => items.iter().any(has_local_ref),
        _ => false,
    }
}

/// Rewrite every local `$ref` in `schema` for the schema moving to the JSON pointer `base`
/// (`"/$defs/args0"`) of a new root: `#` becomes `#/$defs/args0`, `#/x` becomes
/// `#/$defs/args0/x`. Other refs (remote, anchors) are left alone.
pub fn rebase_refs(schema: &mut Value, base: &str) {
    match schema {
        Value::Object(obj) => {
            for (key, v) in obj.iter_mut() {
                match (key.as_str(), v) {
                    ("$ref", Value::String(r)) if r == "#" || r.starts_with("#/") => {
                        *r = format!("#{base}{}", &r[1..]);
                    }
                    (k, _) if DATA.contains(&k) => {}
                    (_, v) => rebase_refs(v, base),
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|v| rebase_refs(v, base)),
        _ => {}
    }
}

/// `schema`, or the schema its local `$ref`s lead to in `root` (a few hops at most; an
/// unresolvable or cyclic ref gives the last schema reached).
pub fn resolve<'a>(root: &'a Value, mut schema: &'a Value) -> &'a Value {
    for _ in 0..16 {
        let Some(target) = schema.get("$ref").and_then(Value::as_str).and_then(|r| r.strip_prefix('#')) else {
            break;
        };
        match root.pointer(target) {
            Some(next) => schema = next,
            None => break,
        }
    }
    schema
}

/// Give every object schema in `schema` that lists `properties`, leaves `additionalProperties`,
/// `patternProperties` and `unevaluatedProperties` unsaid, and requires only listed names,
/// `additionalProperties: false` (see the module note).
pub fn close_objects(schema: &mut Value) {
    let Value::Object(obj) = schema else { return };
    if should_close(obj) {
        obj.insert("additionalProperties".into(), Value::Bool(false));
    }
    for key in CLOSABLE_ONE {
        if let Some(sub) = obj.get_mut(key) {
            close_objects(sub);
        }
    }
    for key in CLOSABLE_MANY {
        if let Some(Value::Array(subs)) = obj.get_mut(key) {
            subs.iter_mut().for_each(close_objects);
        }
    }
    for key in CLOSABLE_MAPS {
        if let Some(Value::Object(subs)) = obj.get_mut(key) {
            subs.values_mut().for_each(close_objects);
        }
    }
}

fn should_close(obj: &Map<String, Value>) -> bool {
    let Some(Value::Object(props)) = obj.get("properties") else { return false };
    let open = ["additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "$ref"];
    if open.iter().any(|k| obj.contains_key(*k)) {
        return false;
    }
    let required = obj.get("required").and_then(Value::as_array).into_iter().flatten();
    required.filter_map(Value::as_str).all(|name| props.contains_key(name))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn refs_move_with_the_schema_and_data_is_untouched() {
        let mut s = json!({
            "type": "object",
            "properties": {
                "unit": {"$ref": "#/$defs/Unit"},
                "child": {"$ref": "#"},
                "remote": {"$ref": "https://example.com/s.json"},
                "fixed": {"const": {"$ref": "#/$defs/Unit"}},
            },
            "$defs": {"Unit": {"enum": ["c", "f"]}},
        });
        assert!(has_local_ref(&s));
        rebase_refs(&mut s, "/$defs/args0");
        assert_eq!(s["properties"]["unit"]["$ref"], "#/$defs/args0/$defs/Unit");
        assert_eq!(s["properties"]["child"]["$ref"], "#/$defs/args0");
        assert_eq!(s["properties"]["remote"]["$ref"], "https://example.com/s.json");
        assert_eq!(s["properties"]["fixed"]["const"]["$ref"], "#/$defs/Unit");
        assert!(!has_local_ref(&json!({"enum": [{"$ref": "#"}], "properties": {"$ref": {"type": "string"}}})));
    }

    #[test]
    fn resolve_follows_local_refs() {
        let root = json!({"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"type": "integer"}, "L": {"$ref": "#/$defs/L"}}});
        assert_eq!(resolve(&root, &json!({"$ref": "#/$defs/A"})), &json!({"type": "integer"}));
        assert_eq!(resolve(&root, &json!({"type": "string"})), &json!({"type": "string"}));
        assert_eq!(resolve(&root, &json!({"$ref": "#/$defs/L"})), &json!({"$ref": "#/$defs/L"}));
        assert_eq!(resolve(&root, &json!({"$ref": "#/nope"})), &json!({"$ref": "#/nope"}));
    }

    #[test]
    fn objects_with_listed_properties_are_closed() {
        let mut s = json!({
            "type": "object",
            "properties": {
                "a": {"type": "object", "properties": {"x": {"type": "integer"}}},
                "list": {"type": "array", "items": {"properties": {"y": {}}}},
                "either": {"anyOf": [{"properties": {"z": {}}}, {"type": "null"}]},
                "any": {"type": "object"},
                "open": {"properties": {"x": {}}, "additionalProperties": true},
                "patterned": {"properties": {"x": {}}, "patternProperties": {"^p": {}}},
                "needs_more": {"properties": {"x": {}}, "required": ["x", "y"]},
                "composed": {"allOf": [{"properties": {"x": {}}}, {"properties": {"y": {}}}]},
                "negated": {"not": {"properties": {"x": {}}}},
            },
            "required": ["a"],
            "$defs": {"D": {"properties": {"d": {}}}},
        });
        close_objects(&mut s);
        let closed = |v: &Value| v.get("additionalProperties") == Some(&json!(false));
        let p = &s["properties"];
        assert!(closed(&s) && closed(&p["a"]) && closed(&p["list"]["items"]));
        assert!(closed(&p["either"]["anyOf"][0]) && closed(&s["$defs"]["D"]));
        assert!(!closed(&p["any"]) && !closed(&p["patterned"]) && !closed(&p["needs_more"]));
        assert_eq!(p["open"]["additionalProperties"], json!(true));
        assert!(!closed(&p["composed"]["allOf"][0]) && !closed(&p["negated"]["not"]));
    }
}
