//! JSON Schemas the grammar engine (llguidance) cannot compile without failing itself, refused
//! before it sees them: a failure there is no error but the end of the process.
//!
//! - An `integer` schema's bound at or past ±2^63. llguidance holds integer bounds as 64-bit
//!   integers: one past them is clamped (the schema would say another range than the one
//!   enforced), and -2^63, whose negation is itself, sends its range builder into a recursion
//!   that never ends.
//! - Schemas nested deeper than [`MAX_SCHEMA_DEPTH`] levels, counting through local `$ref`s.
//!   llguidance compiles a schema by recursion, refs followed as they come: a body can nest
//!   only 128 levels of JSON, but a chain of a thousand `$defs` each naming the next is a
//!   small body that overflows the stack.
//! - A Lark grammar of more than [`MAX_LARK_RULES`] rules: its rules are compiled by
//!   recursion too, a chain of rules each naming the next one level deeper (llguidance limits
//!   the nesting inside a rule and a regex itself).

use std::collections::HashMap;

use serde_json::Value;

/// Levels of JSON a schema may nest, its `$ref`s followed (a ref back into a schema being
/// walked, a recursive model's, adds none). A chain of `$defs` each an object whose property
/// names the next takes three a link: llguidance compiled 700 links (2100 levels), and
/// overflowed its stack at 1000; real schemas (pydantic models) nest a few dozen.
pub const MAX_SCHEMA_DEPTH: usize = 512;

/// Rules and terminals a client's Lark grammar may define. A chain of rules each naming the
/// next took about 3 KB of stack a rule (8 MB held 2000, not 3000); grammars written for
/// generation (JSON's, SQL's) define a few dozen to a few hundred.
pub const MAX_LARK_RULES: usize = 500;

/// Keywords whose values are data, not schemas.
const DATA: [&str; 4] = ["const", "enum", "default", "examples"];

/// The bounds an `integer` schema may hold: within 64-bit integers (-2^63 excluded).
const INTEGER_BOUND: f64 = 9_223_372_036_854_775_808.0;

/// Ok, or why the grammar engine cannot compile `schema`: it nests deeper than
/// `MAX_SCHEMA_DEPTH` (its integer bounds are checked with its other keywords,
/// `structured::check_keywords`).
pub fn check_depth(schema: &Value) -> Result<(), String> {
    let mut walk = Depth { root: schema, heights: HashMap::new(), open: Vec::new() };
    match walk.height(schema, 1) {
        Some(_) => Ok(()),
        None => Err(format!(
            "it nests more than {MAX_SCHEMA_DEPTH} levels deep (its `$ref`s followed), more than the grammar \
             engine follows"
        )),
    }
}

/// Ok, or why the grammar engine cannot compile the Lark grammar `lark`: more rule and
/// terminal definitions (a line's first word, then `:`) than `MAX_LARK_RULES`.
pub fn check_lark(lark: &str) -> Result<(), String> {
    let defines = |line: &str| {
        let line = line.trim_start().trim_start_matches(['?', '!']);
        let name_end = line.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(line.len());
        let rest = line[name_end..].trim_start();
        // (`name[params]`, `name.priority`, then the colon)
        let rest = rest.strip_prefix('[').and_then(|r| r.split_once(']')).map_or(rest, |(_, r)| r.trim_start());
        let rest =
            rest.strip_prefix('.').map_or(rest, |r| r.trim_start_matches(|c: char| c.is_ascii_digit() || c == '-'));
        name_end > 0 && rest.trim_start().starts_with(':')
    };
    let rules = lark.lines().filter(|l| defines(l)).count();
    if rules > MAX_LARK_RULES {
        return Err(format!(
            "it defines {rules} rules and terminals, more than the {MAX_LARK_RULES} the grammar engine compiles"
        ));
    }
    Ok(())
}

/// The JSON schemas a Lark grammar inlines (llguidance's `%json {...}`): a forced call's
/// `parameters`, a client's grammar. Text after a `%json` that is no JSON value is left to
/// the engine.
pub fn inlined_schemas(lark: &str) -> Vec<Value> {
    lark.match_indices("%json")
        .filter_map(|(at, tag)| {
            let rest = &lark[at + tag.len()..];
            serde_json::Deserializer::from_str(rest).into_iter::<Value>().next()?.ok()
        })
        .collect()
}

/// The first bound of an `integer` schema that is at or past ±2^63, if any.
pub fn bound_past_64_bits(obj: &serde_json::Map<String, Value>) -> Option<&'static str> {
    let integer = match obj.get("type") {
        Some(Value::String(t)) => t == "integer",
        Some(Value::Array(types)) => types.iter().any(|t| t == "integer"),
        _ => false,
    };
    let keys = ["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"];
    keys.into_iter().filter(|_| integer).find(|key| obj.get(*key).is_some_and(beyond_64_bits))
}

/// Whether a number is at or past ±2^63 (integers compared exactly; a float as it is).
fn beyond_64_bits(v: &Value) -> bool {
    match (v.as_i64(), v.as_u64(), v.as_f64()) {
        (Some(i), _, _) => i == i64::MIN,
        (None, Some(u), _) => u > i64::MAX as u64,
        (None, None, Some(f)) => f.abs() >= INTEGER_BOUND,
        _ => false,
    }
}

/// The depth of a schema's JSON with its local `$ref`s followed, each target's height
/// computed once.
struct Depth<'a> {
    root: &'a Value,
    /// Each ref's target's height.
    heights: HashMap<&'a str, usize>,
    /// The refs being followed.
    open: Vec<&'a str>,
}

impl<'a> Depth<'a> {
    /// The levels `v` (at `level`) and what it holds take; None past `MAX_SCHEMA_DEPTH` (the
    /// walk stops there: its own recursion is bounded too).
    fn height(&mut self, v: &'a Value, level: usize) -> Option<usize> {
        if level > MAX_SCHEMA_DEPTH {
            return None;
        }
        let mut below = 0;
        match v {
            Value::Object(obj) => {
                for (key, sub) in obj {
                    let h = match (key.as_str(), sub) {
                        (k, _) if DATA.contains(&k) => 0,
                        ("$ref", Value::String(r)) => self.target(r, level + 1)?,
                        _ => self.height(sub, level + 1)?,
                    };
                    below = below.max(h);
                }
            }
            Value::Array(items) => {
                for sub in items {
                    below = below.max(self.height(sub, level + 1)?);
                }
            }
            _ => return Some(0),
        }
        Some(1 + below)
    }

    /// The height of what the local ref `r` names, when followed at `level`.
    fn target(&mut self, r: &'a str, level: usize) -> Option<usize> {
        if let Some(&h) = self.heights.get(r) {
            return (level + h <= MAX_SCHEMA_DEPTH + 1).then_some(h);
        }
        let Some(pointer) = r.strip_prefix('#') else { return Some(0) };
        if self.open.contains(&r) {
            return Some(0);
        }
        let Some(target) = self.root.pointer(&crate::protocol::schema_check::percent_decoded(pointer)) else {
            return Some(0);
        };
        self.open.push(r);
        let h = self.height(target, level);
        self.open.pop();
        if let Some(h) = h {
            self.heights.insert(r, h);
        }
        h
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A chain of `links` `$defs`, each an object whose property names the next.
    fn chain(links: usize) -> Value {
        let mut defs = serde_json::Map::new();
        for i in 0..links {
            defs.insert(
                format!("A{i}"),
                json!({"type": "object", "properties": {"a": {"$ref": format!("#/$defs/A{}", i + 1)}}, "required": ["a"]}),
            );
        }
        defs.insert(format!("A{links}"), json!({"type": "integer"}));
        json!({"$defs": defs, "$ref": "#/$defs/A0"})
    }

    #[test]
    fn integer_bounds_past_64_bits_are_refused() {
        let check = crate::structured::check_for_engine;
        for bound in [json!(-1e19), json!(i64::MIN), json!(9_223_372_036_854_775_808u64), json!(1e300)] {
            let s = json!({"type": "object", "properties": {"v": {"type": "integer", "minimum": bound, "maximum": 5}}});
            let err = check(&s).unwrap_err();
            assert!(err.contains("`minimum`") && err.contains("/properties/v"), "{err}");
        }
        let s = json!({"type": ["integer", "null"], "exclusiveMaximum": -9_223_372_036_854_775_808.0});
        assert!(check(&s).unwrap_err().contains("the schema's root"));
        // within them, a number's, or data: fine
        for s in [
            json!({"type": "integer", "minimum": i64::MIN + 1, "maximum": i64::MAX}),
            json!({"type": "number", "minimum": -1e300}),
            json!({"type": "integer", "default": {"type": "integer", "minimum": -1e30}}),
        ] {
            assert_eq!(check(&s), Ok(()), "{s}");
        }
    }

    #[test]
    fn schemas_deeper_than_the_engine_follows_are_refused() {
        let check = check_depth;
        assert_eq!(check(&chain(100)), Ok(()));
        assert!(check(&chain(1000)).unwrap_err().contains("more than 512 levels"));
        // a recursive model (a tree) refers back to itself: no deeper for that
        let tree = json!({"$defs": {"node": {"type": "object", "properties": {
            "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}}, "$ref": "#/$defs/node"});
        assert_eq!(check(&tree), Ok(()));
        // refs shared many times over are walked once each
        let mut defs = serde_json::Map::new();
        for i in 0..60 {
            let next = json!({"$ref": format!("#/$defs/D{}", i + 1)});
            defs.insert(format!("D{i}"), json!({"type": "object", "properties": {"a": next, "b": next, "c": next}}));
        }
        defs.insert("D60".into(), json!({"type": "string"}));
        assert_eq!(check(&json!({"$defs": defs, "$ref": "#/$defs/D0"})), Ok(()));
    }

    #[test]
    fn lark_rules_are_counted() {
        let rules = |n: usize| (0..n).map(|i| format!("r{i}: \"a\" r{}\n", i + 1)).collect::<String>();
        assert_eq!(check_lark(&rules(500)), Ok(()));
        assert!(check_lark(&rules(501)).unwrap_err().contains("501 rules"));
        // definitions in their forms; alternatives on their own lines, comments and %directives are none
        let g = "?start: a\n!b.2 : \"x\"\nc[lazy]: /y/\nNUM: /[0-9]+/\n    | \"z\"\n// d: e\n%import common.WS\n";
        let many = g.repeat(MAX_LARK_RULES);
        assert!(check_lark(&many).unwrap_err().contains(&format!("{} rules", 4 * MAX_LARK_RULES)));
    }

    #[test]
    fn a_grammar_s_inlined_schemas_are_found() {
        let lark = "start: \"<call>\" body\nbody: %json {\"type\": \"integer\", \"minimum\": -1e19}\nx: %json oops";
        let found = inlined_schemas(lark);
        assert_eq!(found, vec![json!({"type": "integer", "minimum": -1e19})]);
        assert!(crate::structured::check_for_engine(&found[0]).is_err());
    }
}
