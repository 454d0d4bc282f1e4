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
//!   cannot take. Only an object that alone decides its instance's keys is closed: one that
//!   is combined with other schemas on the same instance (an `allOf` part, a base a `$ref`
//!   extends, a union beside `properties`) is left as sent with everything below it and what
//!   its refs reach, since another schema may refine any of its keys; so is everything under
//!   `not` or `if` (narrowing there widens or flips what the whole accepts). So every schema
//!   that was satisfiable stays so.
//! - **Bounding integers:** an `integer` schema with an open side is kept within JSON's
//!   interoperable range, ±(2^53 - 1) (RFC 8259 §6; what JavaScript reads exactly). JSON's
//!   grammar limits no digits, and a small model writes `1000000000...` until `max_tokens`
//!   cuts the JSON off; bounded, the number has at most 16 digits and the JSON closes. A
//!   bound the client set is kept, and no side is added that would empty the range. Schemas
//!   with `enum` or `const` are left alone, and so is everything under `allOf` (another part
//!   bounds the same instance) and every schema holding `not` or `if` (narrowing there widens
//!   what the whole accepts).
//! - **Bounding fractional seconds:** the `date-time` and `time` formats allow any number of
//!   digits after the seconds' point, and a small model writes `00:00:00.0000000000...` until
//!   `max_tokens` cuts the JSON off. Such a string without a `pattern` of its own gets one
//!   that holds the fraction to [`MAX_FRACTION_DIGITS`] digits, under the same rules as the
//!   integers' bounds.
//! - **Bounding email addresses:** the `email` format's local part (before the `@`) has no
//!   length in its grammar, and a small model repeats a piece of it (`%20%20...`) until
//!   `max_tokens` cuts the JSON off. Such a string without a `pattern` gets one that holds it
//!   to RFC 5321's limits, [`MAX_EMAIL_LOCAL`] characters before the `@` and
//!   [`MAX_EMAIL_DOMAIN`] after it. (`uri` and `duration` have no such limit to apply; they
//!   are left as they are.)

use std::collections::{HashMap, HashSet};

use serde_json::{Map, Value};

/// Keys whose values are data, not schemas: a `$ref` inside them is not a reference.
const DATA: [&str; 4] = ["const", "enum", "default", "examples"];
/// Keywords whose value maps names to schemas (the names are not keywords).
const MAPS: [&str; 5] = ["properties", "patternProperties", "$defs", "definitions", "dependentSchemas"];
/// Keywords that shape which keys an object instance has: a schema holding one of them
/// beside `$ref` or a union extends what the ref or union branches say about the same object.
const SHAPES_KEYS: [&str; 12] = [
    "properties",
    "patternProperties",
    "additionalProperties",
    "unevaluatedProperties",
    "required",
    "allOf",
    "anyOf",
    "oneOf",
    "dependentSchemas",
    "dependentRequired",
    "if",
    "not",
];

/// Whether `schema` holds a local `$ref`: one starting with `#`, or one naming the schema
/// itself by its `$id`.
pub fn has_local_ref(schema: &Value) -> bool {
    let id = own_id(schema);
    let mut found = false;
    visit_refs(&mut schema.clone(), &mut |r| found |= r.starts_with('#') || id.is_some_and(|id| names(r, id)));
    found
}

/// The schema's own `$id`, without an empty fragment.
fn own_id(schema: &Value) -> Option<&str> {
    schema.get("$id").and_then(Value::as_str).map(|id| id.trim_end_matches('#')).filter(|id| !id.is_empty())
}

/// Whether `reference` points into the schema whose `$id` is `id` (`<id>` or `<id>#...`).
fn names(reference: &str, id: &str) -> bool {
    reference.strip_prefix(id).is_some_and(|rest| rest.is_empty() || rest.starts_with('#'))
}

/// Rewrite every local `$ref` in `schema` for the schema moving to the JSON pointer `base`
/// (`"/$defs/args0"`) of a new root: `#` becomes `#/$defs/args0`, `#/x` becomes
/// `#/$defs/args0/x`. The schema's own `$id` and `$schema` go: under its new root, `$id`
/// would make its refs resolve against itself; so refs that name the schema by that `$id`
/// (`https://example.com/args.json#/x`) are rewritten as local ones first. Other refs
/// (remote, anchors) are left alone.
pub fn rebase_refs(schema: &mut Value, base: &str) {
    let id = own_id(schema).map(str::to_string);
    if let Value::Object(obj) = schema {
        obj.remove("$id");
        obj.remove("$schema");
    }
    visit_refs(schema, &mut |r| {
        if let Some(id) = id.as_deref().filter(|id| names(r, id)) {
            *r = format!("#{}", r[id.len()..].trim_start_matches('#'));
        }
        if r == "#" || r.starts_with("#/") {
            *r = format!("#{base}{}", &r[1..]);
        }
    });
}

/// Drop the schema's `$id` (and `$schema`), rewriting refs that name it by that `$id` as
/// plain local ones: `rebase_refs` to where it already is. Code that follows refs by JSON
/// pointer (`resolve`, the closing of objects) then sees them.
pub fn localize_refs(schema: &mut Value) {
    rebase_refs(schema, "");
}

/// Calls `f` on every `$ref` of `schema` and its subschemas: the names in a `properties`
/// (or other) map are names, so a property called `default` or `$ref` is still walked.
fn visit_refs(schema: &mut Value, f: &mut impl FnMut(&mut String)) {
    match schema {
        Value::Object(obj) => {
            for (key, v) in obj.iter_mut() {
                match (key.as_str(), v) {
                    ("$ref", Value::String(r)) => f(r),
                    (k, _) if DATA.contains(&k) => {}
                    (k, Value::Object(map)) if MAPS.contains(&k) => map.values_mut().for_each(|s| visit_refs(s, f)),
                    (_, v) => visit_refs(v, f),
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|v| visit_refs(v, f)),
        _ => {}
    }
}

/// Keys beside a `$ref` that say nothing about the value: a schema of only these and the
/// ref is the ref's target and nothing more.
const BESIDE_A_REF: [&str; 10] = [
    "$ref",
    "$defs",
    "definitions",
    "title",
    "description",
    "$comment",
    "default",
    "examples",
    "deprecated",
    "$schema",
];

/// Which local refs of a schema lead, through schemas that are only refs, back to one of them:
/// no value can match such a ref, and a grammar built from it has a dead end (a key whose
/// value can never start) that generation would run into. Each ref's answer is remembered, so
/// a schema's refs are followed once in all (a chain of n refs to refs took n² steps, minutes
/// for a few MB).
#[derive(Default)]
pub struct RefLoops {
    known: HashMap<String, bool>,
}

impl RefLoops {
    /// Whether `reference` leads, in `root`, through schemas that are only refs, back to one
    /// of them.
    pub fn loops(&mut self, root: &Value, reference: &str) -> bool {
        let mut path: Vec<&str> = Vec::new();
        let mut on_path = HashSet::new();
        let mut at = reference;
        let answer = loop {
            if let Some(&known) = self.known.get(at) {
                break known;
            }
            if !on_path.insert(at) {
                break true;
            }
            path.push(at);
            let Some(target) = at.strip_prefix('#').and_then(|p| root.pointer(p)) else { break false };
            let pure = target.as_object().is_some_and(|o| o.keys().all(|k| BESIDE_A_REF.contains(&k.as_str())));
            match target.get("$ref").and_then(Value::as_str) {
                Some(next) if pure => at = next,
                _ => break false,
            }
        };
        // (every ref on the way leads where this one does)
        self.known.extend(path.into_iter().map(|r| (r.to_string(), answer)));
        answer
    }
}

/// The first local `$ref` of `schema` that loops ([`RefLoops`]).
pub fn looping_ref(schema: &Value) -> Option<String> {
    let mut refs = Vec::new();
    visit_refs(&mut schema.clone(), &mut |r| {
        if r.starts_with('#') {
            refs.push(r.clone());
        }
    });
    let mut loops = RefLoops::default();
    refs.into_iter().find(|r| loops.loops(schema, r))
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

/// Give every object schema in `schema` that alone decides its instance's keys (see the
/// module note) and lists `properties`, `additionalProperties: false`. A schema with a ref
/// that is not a plain JSON pointer (an anchor, a percent-encoded or absolute one) is left
/// as sent: which schemas such a ref combines cannot be told from paths.
pub fn close_objects(schema: &mut Value) {
    if has_unmapped_refs(schema) {
        return;
    }
    let targets = Targets::of(schema);
    close_at(schema, &mut String::new(), &targets);
}

fn close_at(schema: &mut Value, path: &mut String, targets: &Targets) {
    let Value::Object(obj) = schema else { return };
    // a schema combined with others on one instance: it and all below it stay as sent
    if targets.frozen_at(path) || combines(obj) {
        return;
    }
    if should_close(obj) {
        obj.insert("additionalProperties".into(), Value::Bool(false));
    }
    let len = path.len();
    for (key, sub) in obj.iter_mut() {
        match (key.as_str(), sub) {
            ("items" | "additionalProperties", s @ Value::Object(_)) => {
                push(path, key);
                close_at(s, path, targets);
            }
            // (a union alone, or one `allOf` part alone: `combines` said no)
            ("items" | "prefixItems" | "anyOf" | "oneOf" | "allOf", Value::Array(subs)) => {
                each(subs, key, path, targets)
            }
            ("properties" | "patternProperties" | "$defs" | "definitions", Value::Object(map)) => {
                for (name, s) in map.iter_mut() {
                    push(path, key);
                    push(path, name);
                    close_at(s, path, targets);
                    path.truncate(len);
                }
            }
            _ => {}
        }
        path.truncate(len);
    }
}

/// Whether `obj` applies several schemas to its instance: a `$ref` or a union beside
/// keywords that shape the object, `allOf` of more than one part, or conditionals. (A union
/// alone is each branch alone; so is a single `allOf` part, as pydantic v1 wraps a `$ref`.)
fn combines(obj: &Map<String, Value>) -> bool {
    let beside = |key: &str| obj.keys().any(|k| k != key && (SHAPES_KEYS.contains(&k.as_str()) || k == "$ref"));
    let parts = |key: &str| obj.get(key).and_then(Value::as_array).map_or(0, Vec::len);
    ["if", "then", "else", "not", "dependentSchemas"].iter().any(|k| obj.contains_key(*k))
        || (obj.contains_key("$ref") && beside("$ref"))
        || parts("allOf") > 1
        || ["allOf", "anyOf", "oneOf"].iter().any(|k| obj.contains_key(*k) && beside(k))
}

/// Whether some `$ref` (or `$dynamicRef`) is not `#` or a plain `#/...` JSON pointer, or
/// a schema names itself (`$anchor`, `$id` below the root).
fn has_unmapped_refs(root: &Value) -> bool {
    let mut unmapped = false;
    visit_refs(&mut root.clone(), &mut |r| unmapped |= !(r == "#" || (r.starts_with("#/") && !r.contains('%'))));
    fn names_itself(v: &Value, at_root: bool) -> bool {
        match v {
            Value::Object(o) => {
                ["$anchor", "$dynamicAnchor", "$dynamicRef", "$recursiveRef"].iter().any(|k| o.contains_key(*k))
                    || (!at_root && o.contains_key("$id"))
                    || o.iter().any(|(k, v)| !DATA.contains(&k.as_str()) && names_itself(v, false))
            }
            Value::Array(items) => items.iter().any(|v| names_itself(v, false)),
            _ => false,
        }
    }
    unmapped || names_itself(root, true)
}

fn each(subs: &mut [Value], key: &str, path: &mut String, targets: &Targets) {
    let len = path.len();
    for (i, s) in subs.iter_mut().enumerate() {
        push(path, key);
        push(path, &i.to_string());
        close_at(s, path, targets);
        path.truncate(len);
    }
}

/// Appends a JSON pointer segment (RFC 6901 escapes).
fn push(path: &mut String, segment: &str) {
    path.push('/');
    path.push_str(&segment.replace('~', "~0").replace('/', "~1"));
}

/// Whether an object that does not `combine` (so has no ref, union, `allOf` or conditional
/// beside its `properties`) may be closed: it leaves other keys unsaid, and closing leaves
/// room for what it requires.
fn should_close(obj: &Map<String, Value>) -> bool {
    let Some(Value::Object(props)) = obj.get("properties") else { return false };
    let open = ["additionalProperties", "patternProperties", "unevaluatedProperties", "dependentRequired"];
    if open.iter().any(|k| obj.contains_key(*k)) {
        return false;
    }
    if obj.get("minProperties").and_then(Value::as_u64).is_some_and(|m| m > props.len() as u64) {
        return false;
    }
    let required = obj.get("required").and_then(Value::as_array).into_iter().flatten();
    required.filter_map(Value::as_str).all(|name| props.contains_key(name))
}

/// The JSON pointers (`/$defs/Base`) of the schemas a `$ref` reaches from where several
/// schemas apply to one instance (see `combines`), or from under `not` or `if`, and what
/// those refer to in turn: nothing in them is closed.
struct Targets {
    frozen: HashSet<String>,
}

impl Targets {
    fn of(root: &Value) -> Self {
        let mut t = Targets { frozen: HashSet::new() };
        t.collect(root, false);
        let mut frontier: Vec<String> = t.frozen.iter().cloned().collect();
        while let Some(p) = frontier.pop() {
            let before = t.frozen.clone();
            if let Some(s) = root.pointer(&p) {
                t.collect(s, true);
            }
            frontier.extend(t.frozen.difference(&before).cloned());
        }
        t
    }

    /// Whether the schema at `path` is a frozen one or inside one.
    fn frozen_at(&self, path: &str) -> bool {
        self.frozen.iter().any(|f| path == f || path.strip_prefix(f.as_str()).is_some_and(|rest| rest.starts_with('/')))
    }

    /// `frozen`: `schema` shares its instance with other schemas (or is under `not`/`if`).
    fn collect(&mut self, schema: &Value, frozen: bool) {
        let Value::Object(obj) = schema else {
            if let Value::Array(items) = schema {
                items.iter().for_each(|s| self.collect(s, frozen));
            }
            return;
        };
        let below = frozen || combines(obj);
        if let Some(target) = obj.get("$ref").and_then(Value::as_str).and_then(|r| r.strip_prefix('#')) {
            if below {
                self.frozen.insert(target.to_string());
            }
        }
        for (key, v) in obj {
            match key.as_str() {
                k if DATA.contains(&k) => {}
                k if MAPS.contains(&k) => v.as_object().into_iter().flatten().for_each(|(_, s)| self.collect(s, below)),
                _ => self.collect(v, below),
            }
        }
    }
}

/// The string `format`s the grammar engine enforces (llguidance's own grammars for them); it
/// refuses any other (`Unknown format`).
pub const ENFORCED_FORMATS: [&str; 10] =
    ["date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri"];

/// Leave out of `schema` what asks nothing the engine can enforce: every `format` it does not
/// enforce (`password`, `binary`, `uri-reference`, `int64`, ...: JSON Schema 2020-12 makes every
/// format an annotation unless a schema asserts it, and pydantic and OpenAPI write such formats
/// for plain strings, `SecretStr`, `bytes`, `Path`), so a schema holding one still constrains
/// all it can; and `uniqueItems: false`, the default (the engine refuses the keyword).
pub fn drop_unenforced_annotations(schema: &mut Value) {
    match schema {
        Value::Array(items) => items.iter_mut().for_each(drop_unenforced_annotations),
        Value::Object(obj) => {
            if obj.get("format").and_then(Value::as_str).is_some_and(|f| !ENFORCED_FORMATS.contains(&f)) {
                obj.remove("format");
            }
            if obj.get("uniqueItems") == Some(&Value::Bool(false)) {
                obj.remove("uniqueItems");
            }
            for (key, v) in obj.iter_mut() {
                match (key.as_str(), v) {
                    (k, _) if DATA.contains(&k) => {}
                    (k, Value::Object(map)) if MAPS.contains(&k) => {
                        map.values_mut().for_each(drop_unenforced_annotations)
                    }
                    (_, v) => drop_unenforced_annotations(v),
                }
            }
        }
        _ => {}
    }
}

/// JSON's interoperable integer range (RFC 8259 §6) is -`SAFE_INTEGER`..=`SAFE_INTEGER`.
pub const SAFE_INTEGER: i64 = (1 << 53) - 1;

/// Digits the fractional seconds of a `date-time` or `time` string may have: nanoseconds, more
/// than its readers keep (Python's datetime and pydantic hold microseconds).
pub const MAX_FRACTION_DIGITS: usize = 9;

/// The longest local part (before the `@`) and domain of an `email` address, in characters:
/// RFC 5321's limits (§4.5.3.1.1-2, in octets).
pub const MAX_EMAIL_LOCAL: usize = 64;
pub const MAX_EMAIL_DOMAIN: usize = 255;

/// Keywords under which an integer schema is not bounded (see the module note).
const UNBOUNDED: [&str; 5] = ["allOf", "not", "if", "then", "else"];

/// Close every open side of the `integer` schemas in `schema` at ±`SAFE_INTEGER`, hold the
/// fractional seconds of its `date-time` and `time` strings to `MAX_FRACTION_DIGITS` and its
/// `email` addresses to RFC 5321's lengths (see the module note).
pub fn bound_values(schema: &mut Value) {
    if holds_keyword(schema, &["not", "if"]) {
        return;
    }
    bound_at(schema);
}

fn bound_at(schema: &mut Value) {
    let obj = match schema {
        Value::Object(obj) => obj,
        Value::Array(items) => return items.iter_mut().for_each(bound_at),
        _ => return,
    };
    if is_integer(obj) && !obj.contains_key("enum") && !obj.contains_key("const") {
        let side = |inclusive: &str, exclusive: &str| {
            obj.get(inclusive).and_then(Value::as_f64).or_else(|| obj.get(exclusive).and_then(Value::as_f64))
        };
        let (lower, upper) = (side("minimum", "exclusiveMinimum"), side("maximum", "exclusiveMaximum"));
        let safe = SAFE_INTEGER as f64;
        if lower.is_none() && upper.is_none_or(|u| u >= -safe) {
            obj.insert("minimum".into(), Value::from(-SAFE_INTEGER));
        }
        if upper.is_none() && lower.is_none_or(|l| l <= safe) {
            obj.insert("maximum".into(), Value::from(SAFE_INTEGER));
        }
    }
    if is_number(obj) {
        // llguidance compares a number's digits with an exclusive bound's as text, and lets
        // through numbers that read back as the bound (`0` under `exclusiveMinimum: 0` with a
        // maximum below 1, `1.0000000000000001`, a double's 1, over 1): the bound becomes the
        // inclusive one of the nearest double inside it (1e-17, the least fraction the number
        // grammar writes without an exponent, for 0), whose every text is inside.
        for (exclusive, inclusive, up) in
            [("exclusiveMinimum", "minimum", true), ("exclusiveMaximum", "maximum", false)]
        {
            let Some(x) = obj.get(exclusive).and_then(Value::as_f64) else { continue };
            let inside = match (x == 0.0, up) {
                (true, true) => 1e-17,
                (true, false) => -1e-17,
                (false, true) => x.next_up(),
                (false, false) => x.next_down(),
            };
            let kept = obj.get(inclusive).and_then(Value::as_f64);
            if kept.is_none_or(|k| if up { inside > k } else { inside < k }) {
                obj.insert(inclusive.into(), Value::from(inside));
            }
            obj.remove(exclusive);
        }
    }
    let free = !obj.contains_key("pattern") && !obj.contains_key("enum") && !obj.contains_key("const");
    let pattern = match obj.get("format").and_then(Value::as_str) {
        // (the formats have one point at most, before the fraction, and a time zone after it:
        // the pattern narrows what they accept to the fractions of up to so many digits)
        Some("date-time" | "time") => Some(format!("^[^.]*(\\.[0-9]{{1,{MAX_FRACTION_DIGITS}}}[^0-9.][^.]*)?$")),
        // (neither part holds an `@` in the format's grammar, no quoted local part)
        Some("email") => Some(format!("^[^@]{{1,{MAX_EMAIL_LOCAL}}}@[^@]{{1,{MAX_EMAIL_DOMAIN}}}$")),
        _ => None,
    };
    if let (Some(pattern), true) = (pattern, free) {
        obj.insert("pattern".into(), Value::from(pattern));
    }
    for (key, v) in obj.iter_mut() {
        match (key.as_str(), v) {
            (k, _) if DATA.contains(&k) || UNBOUNDED.contains(&k) => {}
            (k, Value::Object(map)) if MAPS.contains(&k) => map.values_mut().for_each(bound_at),
            (_, v) => bound_at(v),
        }
    }
}

/// `type: "integer"`, or a list of types with `integer` and no `number` (whose values a
/// bound would also narrow).
fn is_integer(obj: &Map<String, Value>) -> bool {
    match obj.get("type") {
        Some(Value::String(t)) => t == "integer",
        Some(Value::Array(types)) => types.contains(&Value::from("integer")) && !types.contains(&Value::from("number")),
        _ => false,
    }
}

/// `type: "number"`, or a list of types with `number`.
fn is_number(obj: &Map<String, Value>) -> bool {
    match obj.get("type") {
        Some(Value::String(t)) => t == "number",
        Some(Value::Array(types)) => types.contains(&Value::from("number")),
        _ => false,
    }
}

/// Whether any schema in `schema` holds one of `keywords` (names in a `properties` map, and
/// data, are not keywords).
fn holds_keyword(schema: &Value, keywords: &[&str]) -> bool {
    match schema {
        Value::Object(obj) => obj.iter().any(|(key, v)| match (key.as_str(), v) {
            (k, _) if keywords.contains(&k) => true,
            (k, _) if DATA.contains(&k) => false,
            (k, Value::Object(map)) if MAPS.contains(&k) => map.values().any(|s| holds_keyword(s, keywords)),
            (_, v) => holds_keyword(v, keywords),
        }),
        Value::Array(items) => items.iter().any(|v| holds_keyword(v, keywords)),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A chain of `n` refs to refs, from `a0` to `a{n}`, which is `last`.
    fn chain(n: usize, last: Value) -> Value {
        let mut defs: Map<String, Value> =
            (0..n).map(|i| (format!("a{i}"), json!({"$ref": format!("#/$defs/a{}", i + 1)}))).collect();
        defs.insert(format!("a{n}"), last);
        json!({"$ref": "#/$defs/a0", "$defs": defs})
    }

    #[test]
    fn refs_that_loop_are_found_along_long_chains() {
        // (each ref is followed once: 20,000 of them took minutes when each walked its chain)
        assert_eq!(looping_ref(&chain(20_000, json!({"type": "string"}))), None);
        let into_a_loop = chain(20_000, json!({"$ref": "#/$defs/a19000"}));
        assert_eq!(looping_ref(&into_a_loop).as_deref(), Some("#/$defs/a0"));
        let mut loops = RefLoops::default();
        assert!(loops.loops(&into_a_loop, "#/$defs/a19500") && loops.loops(&into_a_loop, "#/$defs/a3"));
        // a ref beside other keywords ends the chain: no loop through it
        let ended = chain(3, json!({"$ref": "#/$defs/a0", "description": "x", "minLength": 1}));
        assert_eq!(looping_ref(&ended), None);
        assert!(RefLoops::default().loops(&chain(2, json!({"$ref": "#/$defs/a1"})), "#/$defs/a0"));
    }

    #[test]
    fn refs_move_with_the_schema_and_data_is_untouched() {
        let mut s = json!({
            "$id": "https://example.com/args.json",
            "type": "object",
            "properties": {
                "unit": {"$ref": "#/$defs/Unit"},
                "child": {"$ref": "#"},
                "remote": {"$ref": "https://example.com/s.json"},
                "fixed": {"const": {"$ref": "#/$defs/Unit"}},
                "default": {"$ref": "#/$defs/Unit"},
            },
            "$defs": {"Unit": {"enum": ["c", "f"]}},
        });
        assert!(has_local_ref(&s));
        rebase_refs(&mut s, "/$defs/args0");
        assert_eq!(s["properties"]["unit"]["$ref"], "#/$defs/args0/$defs/Unit");
        assert_eq!(s["properties"]["child"]["$ref"], "#/$defs/args0");
        assert_eq!(s["properties"]["remote"]["$ref"], "https://example.com/s.json");
        assert_eq!(s["properties"]["fixed"]["const"]["$ref"], "#/$defs/Unit");
        assert_eq!(s["properties"]["default"]["$ref"], "#/$defs/args0/$defs/Unit", "a property named default");
        assert!(s.get("$id").is_none());
        // refs that name the moved schema by its `$id` move with it
        let mut s = json!({"$id": "https://example.com/args.json#", "properties": {
            "a": {"$ref": "https://example.com/args.json#/$defs/U"}, "b": {"$ref": "https://example.com/args.json"},
            "c": {"$ref": "https://example.com/args.jsonx#/$defs/U"}}});
        assert!(has_local_ref(&s));
        rebase_refs(&mut s, "/$defs/args0");
        assert_eq!(s["properties"]["a"]["$ref"], "#/$defs/args0/$defs/U");
        assert_eq!(s["properties"]["b"]["$ref"], "#/$defs/args0");
        assert_eq!(s["properties"]["c"]["$ref"], "https://example.com/args.jsonx#/$defs/U");
        assert!(!has_local_ref(
            &json!({"$id": "https://example.com/a", "properties": {"x": {"$ref": "https://example.com/b"}}})
        ));
        assert!(!has_local_ref(&json!({"enum": [{"$ref": "#"}], "properties": {"$ref": {"type": "string"}}})));
        assert!(has_local_ref(&json!({"properties": {"enum": {"$ref": "#/$defs/E"}}})));
    }

    #[test]
    fn resolve_follows_local_refs() {
        let root = json!({"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"type": "integer"}, "L": {"$ref": "#/$defs/L"}}});
        assert_eq!(resolve(&root, &json!({"$ref": "#/$defs/A"})), &json!({"type": "integer"}));
        assert_eq!(resolve(&root, &json!({"type": "string"})), &json!({"type": "string"}));
        assert_eq!(resolve(&root, &json!({"$ref": "#/$defs/L"})), &json!({"$ref": "#/$defs/L"}));
        assert_eq!(resolve(&root, &json!({"$ref": "#/nope"})), &json!({"$ref": "#/nope"}));
    }

    fn closed(v: &Value) -> bool {
        v.get("additionalProperties") == Some(&json!(false))
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
                "too_few": {"properties": {"x": {}}, "minProperties": 2},
                "composed": {"allOf": [{"properties": {"x": {}}}, {"properties": {"y": {}}}]},
                "negated": {"not": {"properties": {"x": {}}}},
            },
            "required": ["a"],
            "$defs": {"D": {"properties": {"d": {}}}},
        });
        close_objects(&mut s);
        let p = &s["properties"];
        assert!(closed(&s) && closed(&p["a"]) && closed(&p["list"]["items"]));
        assert!(closed(&p["either"]["anyOf"][0]) && closed(&s["$defs"]["D"]));
        assert!(!closed(&p["any"]) && !closed(&p["patterned"]) && !closed(&p["needs_more"]) && !closed(&p["too_few"]));
        assert_eq!(p["open"]["additionalProperties"], json!(true));
        assert!(!closed(&p["composed"]["allOf"][0]) && !closed(&p["negated"]["not"]));
    }

    /// A schema combined with others on the same instance stays open (audit 11: closing
    /// these made satisfiable schemas "Unsatisfiable").
    #[test]
    fn combined_schemas_stay_open() {
        let mut s = json!({
            "type": "object",
            "$defs": {
                "Base": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
                "Alias": {"$ref": "#/$defs/Root"},
                "Root": {"properties": {"r": {}}},
                "Plain": {"properties": {"p": {}}},
                "a/b": {"properties": {"q": {}}},
                "Wrapped": {"properties": {"w": {}}},
            },
            "properties": {
                "dog": {"allOf": [{"$ref": "#/$defs/Base"}, {"properties": {"bark": {}}, "required": ["bark"]}]},
                "cat": {"$ref": "#/$defs/Base", "properties": {"meow": {}}},
                "alias": {"allOf": [{"$ref": "#/$defs/Alias"}, {"properties": {"extra": {}}}]},
                "plain": {"$ref": "#/$defs/Plain"},
                "maybe": {"anyOf": [{"$ref": "#/$defs/Plain"}, {"type": "null"}]},
                "escaped": {"allOf": [{"$ref": "#/$defs/a~1b"}, {"required": ["q"]}]},
                "v1": {"title": "V1", "allOf": [{"$ref": "#/$defs/Wrapped"}]},
                "kind": {
                    "properties": {"kind": {"enum": ["i", "s"]}, "size": {"type": "integer"}},
                    "required": ["kind", "size"],
                    "anyOf": [{"properties": {"kind": {"const": "i"}}}, {"properties": {"kind": {"const": "s"}}}],
                },
                "adds": {"properties": {"kind": {}}, "oneOf": [{"properties": {"x": {}}}, {"properties": {"y": {}}}]},
            },
        });
        close_objects(&mut s);
        let (d, p) = (&s["$defs"], &s["properties"]);
        assert!(!closed(&d["Base"]) && !closed(&d["Root"]) && !closed(&d["a/b"]));
        assert!(!closed(&p["cat"]) && !closed(&p["kind"]) && !closed(&p["adds"]));
        assert!(!closed(&p["kind"]["anyOf"][0]) && !closed(&p["adds"]["oneOf"][1]));
        assert!(closed(&d["Plain"]), "used alone, or as a union branch that is the whole constraint");
        assert!(closed(&d["Wrapped"]), "an allOf of one part is that part");
        let mut one = json!({"oneOf": [{"type": "object", "properties": {"a": {}}},
                                      {"$ref": "#/$defs/B"}], "$defs": {"B": {"properties": {"b": {}}, "required": ["b"]}}});
        close_objects(&mut one);
        // a `oneOf` alone is closed like `anyOf`: llguidance refuses branches it cannot tell
        // apart, which open objects are (audit 14)
        assert!(closed(&one["oneOf"][0]) && closed(&one["$defs"]["B"]));
        // audit 14: what shares an instance with another schema stays open below too
        let mut refined = json!({
            "properties": {"pet": {"type": "object", "properties": {"name": {}}, "required": ["name"]}},
            "allOf": [{"properties": {"pet": {"properties": {"bark": {}}, "required": ["bark"]}}}],
            "$defs": {"U": {"anyOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}},
        });
        refined["properties"]["v"] =
            json!({"allOf": [{"$ref": "#/$defs/U"}, {"properties": {"c": {}}, "required": ["c"]}]});
        close_objects(&mut refined);
        assert!(!closed(&refined["properties"]["pet"]), "{refined}");
        assert!(!closed(&refined["$defs"]["U"]["anyOf"][0]), "reached through a wrapper");
        for unmapped in
            [json!({"$ref": "#/$defs/a%20b"}), json!({"$ref": "#base"}), json!({"$ref": "https://x/s.json"})]
        {
            let mut s = json!({"properties": {"x": unmapped}, "$defs": {"D": {"properties": {"d": {}}}}});
            close_objects(&mut s);
            assert!(!closed(&s) && !closed(&s["$defs"]["D"]), "{s}");
        }
        // under `not` (or `if`), narrowing a schema widens (or flips) what the whole accepts
        let mut neg = json!({"properties": {"v": {"not": {"$ref": "#/$defs/N"}}, "w": {"$ref": "#/$defs/P"}},
                             "$defs": {"N": {"properties": {"x": {"$ref": "#/$defs/M"}}},
                                       "M": {"properties": {"y": {}}}, "P": {"properties": {"p": {}}}}});
        close_objects(&mut neg);
        assert!(!closed(&neg["$defs"]["N"]) && !closed(&neg["$defs"]["M"]), "{neg}");
        assert!(closed(&neg["$defs"]["P"]) && closed(&neg));
        assert!(closed(&s));
    }

    #[test]
    fn open_integers_are_bounded_to_the_interoperable_range() {
        let safe = SAFE_INTEGER;
        let mut s = json!({
            "type": "object",
            "properties": {
                "age": {"type": "integer"},
                "count": {"type": ["integer", "null"], "minimum": 0},
                "below": {"type": "integer", "exclusiveMaximum": 10},
                "huge": {"type": "integer", "minimum": 1e17},
                "ratio": {"type": "number"},
                "either": {"type": ["integer", "number"]},
                "pick": {"type": "integer", "enum": [1, 2]},
                "type": {"type": "integer", "const": 3},
                "list": {"type": "array", "items": {"type": "integer"}},
                "part": {"allOf": [{"type": "integer"}, {"minimum": 1e17}]},
                "at": {"type": "string", "format": "date-time"},
                "own": {"type": "string", "format": "time", "pattern": "^1"},
            },
            "$defs": {"N": {"type": "integer", "maximum": 5}},
            "default": {"type": "integer"},
        });
        bound_values(&mut s);
        let p = &s["properties"];
        assert_eq!((&p["age"]["minimum"], &p["age"]["maximum"]), (&json!(-safe), &json!(safe)));
        assert_eq!((&p["count"]["minimum"], &p["count"]["maximum"]), (&json!(0), &json!(safe)));
        assert_eq!(p["below"], json!({"type": "integer", "exclusiveMaximum": 10, "minimum": -safe}));
        // a client's bound beyond the range is kept, and no side empties it
        assert_eq!(p["huge"], json!({"type": "integer", "minimum": 1e17}));
        for untouched in ["ratio", "either", "pick", "type", "part"] {
            assert!(p[untouched].get("maximum").is_none(), "{untouched}: {}", p[untouched]);
        }
        assert_eq!(p["part"]["allOf"][0], json!({"type": "integer"}));
        assert_eq!(p["list"]["items"]["minimum"], json!(-safe));
        // fractional seconds: at most nine digits, unless the client's pattern says otherwise
        assert_eq!(p["at"]["pattern"], json!("^[^.]*(\\.[0-9]{1,9}[^0-9.][^.]*)?$"));
        assert_eq!(p["own"]["pattern"], json!("^1"));
        assert_eq!(s["$defs"]["N"], json!({"type": "integer", "maximum": 5, "minimum": -safe}));
        assert_eq!(s["default"], json!({"type": "integer"}), "data is not a schema");
        // narrowing under `not` widens what the whole accepts: nothing is bounded then
        let mut neg = json!({"properties": {"a": {"type": "integer"}, "b": {"not": {"$ref": "#/$defs/I"}}},
                             "$defs": {"I": {"type": "integer"}}});
        let sent = neg.clone();
        bound_values(&mut neg);
        assert_eq!(neg, sent);
    }
}
