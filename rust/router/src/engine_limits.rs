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
//! - A Lark grammar (a client's, a structural tag's) of more than [`MAX_LARK_LITERALS`] string
//!   and regex literals: not a crash but time, the square of their count, spent compiling.

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

/// String and regex literals a client's Lark grammar may spell. llguidance compares each
/// lexeme it adds with every one before it: 20,000 literals compiled in about 0.5 s here,
/// 40,000 in 4 s and 100,000 in 22 s, while one request's compile holds a prepare worker.
/// As many as `structured_outputs.choice` may list.
pub const MAX_LARK_LITERALS: usize = 20_000;

/// Keywords whose values are data, not schemas.
const DATA: [&str; 4] = ["const", "enum", "default", "examples"];

/// The bounds an `integer` schema may hold: within 64-bit integers (-2^63 excluded).
const INTEGER_BOUND: f64 = 9_223_372_036_854_775_808.0;

/// Ok, or why the grammar engine cannot compile `schema`: it nests deeper than
/// `MAX_SCHEMA_DEPTH` (its integer bounds are checked with its other keywords,
/// `structured::check_keywords`).
pub fn check_depth(schema: &Value) -> Result<(), String> {
    let mut graph = RefGraph::new(schema);
    if graph.build().is_some() && graph.height() <= MAX_SCHEMA_DEPTH {
        return Ok(());
    }
    if graph.resolutions > MAX_RESOLUTIONS {
        return Err("its `$ref`s name too many places to follow (each against every `$id`)".into());
    }
    Err(format!(
        "it may nest more than {MAX_SCHEMA_DEPTH} levels deep (its `$ref`s followed), more than the grammar \
         engine follows"
    ))
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

/// Ok, or why the grammar engine would take too long to compile the Lark grammar `lark` (a
/// client's, or a structural tag's): more literals than `MAX_LARK_LITERALS`.
pub fn check_lark_literals(lark: &str) -> Result<(), String> {
    let literals = lark_literals(lark);
    if literals > MAX_LARK_LITERALS {
        return Err(format!(
            "it spells {literals} string and regex literals, more than the {MAX_LARK_LITERALS} the grammar \
             engine compiles"
        ));
    }
    Ok(())
}

/// The `"..."` and `/.../` literals of a Lark grammar: escapes skipped, `//` comments and the
/// JSON schemas it inlines (`%json {...}`, compiled apart) left out.
fn lark_literals(lark: &str) -> usize {
    let bytes = lark.as_bytes();
    let (mut i, mut count) = (0, 0);
    // (`i` moves past ASCII bytes only where it slices: never inside a character)
    while i < bytes.len() {
        match bytes[i] {
            b'/' if bytes.get(i + 1) == Some(&b'/') => i = lark[i..].find('\n').map_or(bytes.len(), |n| i + n),
            quote @ (b'"' | b'/') => {
                count += 1;
                i += 1;
                while i < bytes.len() && bytes[i] != quote {
                    i += if bytes[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
            }
            b'%' if lark[i..].starts_with("%json") => {
                i += "%json".len();
                let mut values = serde_json::Deserializer::from_str(&lark[i..]).into_iter::<Value>();
                if values.next().is_some_and(|v| v.is_ok()) {
                    i += values.byte_offset();
                }
            }
            _ => i += 1,
        }
    }
    count
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

/// The first bound at or past ±2^63 of a schema that may be an integer's, if any: one whose
/// `type` is or lists `integer`, or that names no type (llguidance compiles such a schema for
/// every type, an `allOf` branch too, before it meets the type beside it).
pub fn bound_past_64_bits(obj: &serde_json::Map<String, Value>) -> Option<&'static str> {
    let integer = match obj.get("type") {
        Some(Value::String(t)) => t == "integer",
        Some(Value::Array(types)) => types.iter().any(|t| t == "integer"),
        _ => true,
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

/// The most resolving one schema's refs may take, all together: for each ref, the resources
/// (objects with an `$id`) it is looked up against and the targets it names. Past it the
/// schema is refused rather than walked.
const MAX_RESOLUTIONS: usize = 1_000_000;

/// A bound on how deep the grammar engine recurses compiling a schema: its JSON's nesting
/// with every `$ref` followed, as llguidance follows them.
///
/// llguidance compiles each ref (by its normalized URI) once, the first time its traversal
/// meets it, refs within being compiled nesting deeper; a ref met again, or back into one
/// being compiled, costs nothing. How deep that goes depends on the order it meets them, so
/// the bound holds for every order: over the graph whose nodes are the refs (by spelling,
/// finer than llguidance's URIs) and the subschemas they name, a ref outside any cycle adds
/// its target's height, and a cycle of refs adds each of its refs' target heights once (a
/// compile passes through each at most once before meeting one already seen).
///
/// Refs resolve as llguidance's resolver (the `referencing` crate) resolves them, or to
/// more: a JSON pointer (`#/$defs/a`) in the root or in any resource an `$id` opens, an
/// anchor (`#a`: `$anchor`, `$dynamicAnchor`, draft 7's `$id: "#a"`) anywhere, a URI in any
/// resource whose `$id` it may name. More targets only raise the bound.
struct RefGraph<'a> {
    root: &'a Value,
    /// The objects with an `$id` (or draft 4's `id`): the resources a URI may name.
    resources: Vec<(&'a str, &'a Value)>,
    anchors: HashMap<&'a str, Vec<&'a Value>>,
    nodes: Vec<Node<'a>>,
    /// A subschema's node, by address; a ref's, by spelling.
    by_schema: HashMap<*const Value, usize>,
    by_ref: HashMap<&'a str, usize>,
    /// Each node's edges: a subschema's to the refs it holds, with the level each is at (the
    /// subschema itself at 1); a ref's to the subschemas it may name (level 0).
    edges: Vec<Vec<(usize, usize)>>,
    resolutions: usize,
}

enum Node<'a> {
    /// A subschema (the root, or what a ref names) and its height with refs not followed.
    Schema(&'a Value, usize),
    Ref(&'a str),
}

impl<'a> RefGraph<'a> {
    fn new(root: &'a Value) -> Self {
        let mut graph = RefGraph {
            root,
            resources: Vec::new(),
            anchors: HashMap::new(),
            nodes: Vec::new(),
            by_schema: HashMap::new(),
            by_ref: HashMap::new(),
            edges: Vec::new(),
            resolutions: 0,
        };
        graph.index(root, 1);
        graph
    }

    /// The `$id`s and anchors in `v` (the walk bounded as `local` bounds it).
    fn index(&mut self, v: &'a Value, level: usize) {
        if level > MAX_SCHEMA_DEPTH {
            return;
        }
        match v {
            Value::Object(obj) => {
                for (key, sub) in obj {
                    match (key.as_str(), sub) {
                        (k, _) if DATA.contains(&k) => {}
                        ("$id" | "id", Value::String(id)) => {
                            let (uri, anchor) = id.split_once('#').unwrap_or((id, ""));
                            if !uri.is_empty() {
                                self.resources.push((uri, v));
                            }
                            if !anchor.is_empty() {
                                self.anchors.entry(anchor).or_default().push(v);
                            }
                        }
                        ("$anchor" | "$dynamicAnchor", Value::String(name)) => {
                            self.anchors.entry(name).or_default().push(v)
                        }
                        _ => self.index(sub, level + 1),
                    }
                }
            }
            Value::Array(items) => items.iter().for_each(|sub| self.index(sub, level + 1)),
            _ => {}
        }
    }

    /// The subschemas `r` may name; None past `MAX_RESOLUTIONS`.
    fn targets(&mut self, r: &str) -> Option<Vec<&'a Value>> {
        let (uri, fragment) = match r.strip_prefix('#') {
            Some(fragment) => ("", fragment),
            None => r.rsplit_once('#').unwrap_or((r, "")),
        };
        self.resolutions += 1 + self.resources.len();
        if self.resolutions > MAX_RESOLUTIONS {
            return None;
        }
        let mut bases = vec![self.root];
        if uri.is_empty() {
            bases.extend(self.resources.iter().map(|&(_, v)| v));
        } else {
            let named: Vec<&Value> =
                self.resources.iter().filter(|&&(id, _)| may_name(uri, id)).map(|&(_, v)| v).collect();
            if !named.is_empty() {
                bases = named;
            }
        }
        let fragment = crate::protocol::schema_check::percent_decoded(fragment);
        let targets = if fragment.is_empty() {
            bases
        } else if fragment.starts_with('/') {
            bases.iter().filter_map(|base| base.pointer(&fragment)).collect()
        } else {
            self.anchors.get(fragment.as_str()).cloned().unwrap_or_default()
        };
        self.resolutions += targets.len();
        (self.resolutions <= MAX_RESOLUTIONS).then_some(targets)
    }

    fn schema_node(&mut self, v: &'a Value, work: &mut Vec<usize>) -> usize {
        *self.by_schema.entry(v as *const Value).or_insert_with(|| {
            self.nodes.push(Node::Schema(v, 0));
            self.edges.push(Vec::new());
            work.push(self.nodes.len() - 1);
            self.nodes.len() - 1
        })
    }

    /// Every node reachable from the root, with its edges; None when a subschema alone nests
    /// past `MAX_SCHEMA_DEPTH` or the refs resolve to too many targets.
    fn build(&mut self) -> Option<()> {
        let mut work = Vec::new();
        self.schema_node(self.root, &mut work);
        while let Some(node) = work.pop() {
            match self.nodes[node] {
                Node::Schema(v, _) => {
                    let mut refs = Vec::new();
                    let height = local(v, 1, &mut refs)?;
                    self.nodes[node] = Node::Schema(v, height);
                    for (r, level) in refs {
                        let next = *self.by_ref.entry(r).or_insert_with(|| {
                            self.nodes.push(Node::Ref(r));
                            self.edges.push(Vec::new());
                            work.push(self.nodes.len() - 1);
                            self.nodes.len() - 1
                        });
                        self.edges[node].push((next, level));
                    }
                }
                Node::Ref(r) => {
                    for target in self.targets(r)? {
                        let next = self.schema_node(target, &mut work);
                        self.edges[node].push((next, 0));
                    }
                }
            }
        }
        Some(())
    }

    /// The bound on the root's height (`MAX_SCHEMA_DEPTH + 1` stands for anything past it).
    fn height(&self) -> usize {
        let cap = MAX_SCHEMA_DEPTH + 1;
        let mut heights = vec![0usize; self.nodes.len()];
        let mut part_of = vec![0usize; self.nodes.len()];
        for (i, component) in strongly_connected(&self.edges).into_iter().enumerate() {
            component.iter().for_each(|&n| part_of[n] = i);
            let cyclic = component.len() > 1 || self.edges[component[0]].iter().any(|&(to, _)| to == component[0]);
            // (an edge leads into this component or one before it: those it reaches come first)
            let inside = |n: usize| part_of[n] == i;
            // (edges leaving the component lead to components already measured)
            let leaving = component
                .iter()
                .flat_map(|&n| self.edges[n].iter().filter(|&&(to, _)| !inside(to)))
                .map(|&(to, level)| level.saturating_add(heights[to]))
                .max()
                .unwrap_or(0);
            let height = if cyclic {
                // each ref of the cycle compiled once, its target's levels in full (the root's own
                // levels too, when a ref names it), then the way out
                let own = |n: usize| match self.nodes[n] {
                    Node::Schema(_, h) if n == 0 => h,
                    Node::Schema(..) => 0,
                    Node::Ref(_) => self.edges[n].iter().map(|&(to, _)| self.schema_height(to)).max().unwrap_or(0),
                };
                component.iter().map(|&n| own(n)).fold(leaving, usize::saturating_add)
            } else {
                match self.nodes[component[0]] {
                    Node::Schema(_, h) => h.max(leaving),
                    Node::Ref(_) => leaving,
                }
            };
            for &n in &component {
                heights[n] = height.min(cap);
            }
        }
        heights[0]
    }

    fn schema_height(&self, n: usize) -> usize {
        match self.nodes[n] {
            Node::Schema(_, h) => h,
            Node::Ref(_) => 0,
        }
    }
}

/// Whether a ref's URI may name the resource whose `$id` is `id` (the one relative to the
/// other, however the bases between resolve them).
fn may_name(uri: &str, id: &str) -> bool {
    fn plain(s: &str) -> &str {
        let mut s = s.trim_end_matches('/');
        while let Some(rest) = s.strip_prefix("./").or_else(|| s.strip_prefix("../")) {
            s = rest;
        }
        s
    }
    let (uri, id) = (plain(uri), plain(id));
    !uri.is_empty() && !id.is_empty() && (uri.ends_with(id) || id.ends_with(uri))
}

/// The levels `v` (at `level`) and what it holds take, refs not followed, each ref with the
/// level of the object holding it pushed on `refs`; None past `MAX_SCHEMA_DEPTH`.
fn local<'a>(v: &'a Value, level: usize, refs: &mut Vec<(&'a str, usize)>) -> Option<usize> {
    if level > MAX_SCHEMA_DEPTH {
        return None;
    }
    let mut below = 0;
    match v {
        Value::Object(obj) => {
            for (key, sub) in obj {
                match (key.as_str(), sub) {
                    (k, _) if DATA.contains(&k) => {}
                    ("$ref", Value::String(r)) => refs.push((r, level)),
                    _ => below = below.max(local(sub, level + 1, refs)?),
                }
            }
        }
        Value::Array(items) => {
            for sub in items {
                below = below.max(local(sub, level + 1, refs)?);
            }
        }
        _ => return Some(0),
    }
    Some(1 + below)
}

/// The strongly connected components of a graph (Tarjan's, without recursion), each after
/// every component it reaches.
fn strongly_connected(edges: &[Vec<(usize, usize)>]) -> Vec<Vec<usize>> {
    const UNSEEN: usize = usize::MAX;
    let n = edges.len();
    let (mut index, mut low, mut on_stack) = (vec![UNSEEN; n], vec![0; n], vec![false; n]);
    let (mut stack, mut components, mut next) = (Vec::new(), Vec::new(), 0);
    for start in 0..n {
        if index[start] != UNSEEN {
            continue;
        }
        // (node, its next edge to look at)
        let mut calls = vec![(start, 0)];
        index[start] = next;
        low[start] = next;
        next += 1;
        stack.push(start);
        on_stack[start] = true;
        while let Some(&mut (node, ref mut at)) = calls.last_mut() {
            if let Some(&(to, _)) = edges[node].get(*at) {
                *at += 1;
                if index[to] == UNSEEN {
                    index[to] = next;
                    low[to] = next;
                    next += 1;
                    stack.push(to);
                    on_stack[to] = true;
                    calls.push((to, 0));
                } else if on_stack[to] {
                    low[node] = low[node].min(index[to]);
                }
                continue;
            }
            calls.pop();
            if let Some(&(parent, _)) = calls.last() {
                low[parent] = low[parent].min(low[node]);
            }
            if low[node] == index[node] {
                let mut component = Vec::new();
                while let Some(member) = stack.pop() {
                    on_stack[member] = false;
                    component.push(member);
                    if member == node {
                        break;
                    }
                }
                components.push(component);
            }
        }
    }
    components
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
        // a branch that names no type may be an integer's
        let s = json!({"type": "integer", "allOf": [{"minimum": -9_223_372_036_854_775_808i64}]});
        assert!(check(&s).unwrap_err().contains("/allOf/0"));
        assert!(check(&json!({"maximum": 1e19})).is_err());
        // within them, a number's, or data: fine
        for s in [
            json!({"type": "integer", "minimum": i64::MIN + 1, "maximum": i64::MAX}),
            json!({"type": "number", "minimum": -1e300}),
            json!({"type": "number", "allOf": [{"type": "number", "maximum": 1e300}]}),
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

    /// A chain of `links` `$defs` whose refs are spelled by `spell(i)`, each def marked by
    /// `mark(i)` (an anchor, an `$id`).
    fn chain_by(links: usize, mark: impl Fn(usize) -> (String, Value), spell: impl Fn(usize) -> String) -> Value {
        let mut defs = serde_json::Map::new();
        for i in 0..=links {
            let mut def = if i < links {
                json!({"type": "object", "properties": {"a": {"$ref": spell(i + 1)}}, "required": ["a"]})
            } else {
                json!({"type": "integer"})
            };
            let (key, value) = mark(i);
            def[key] = value;
            defs.insert(format!("A{i}"), def);
        }
        json!({"$defs": defs, "$ref": spell(0)})
    }

    #[test]
    fn refs_by_anchor_and_by_id_are_followed() {
        // llguidance resolves these too: a thousand links overflowed its stack
        let anchors = |n| chain_by(n, |i| ("$anchor".into(), json!(format!("a{i}"))), |i| format!("#a{i}"));
        let urns = |n| chain_by(n, |i| ("$id".into(), json!(format!("urn:x:a{i}"))), |i| format!("urn:x:a{i}"));
        let urls = |n| {
            chain_by(n, |i| ("$id".into(), json!(format!("https://x.example/s/a{i}.json"))), |i| format!("a{i}.json"))
        };
        let draft7 = |n| chain_by(n, |i| ("$id".into(), json!(format!("#a{i}"))), |i| format!("#a{i}"));
        for (name, schema) in
            [("anchors", anchors as fn(usize) -> Value), ("urns", urns), ("urls", urls), ("draft7", draft7)]
        {
            assert_eq!(check_depth(&schema(100)), Ok(()), "{name}");
            let err = check_depth(&schema(1000)).unwrap_err();
            assert!(err.contains("512 levels") || err.contains("too many places"), "{name}: {err}");
        }
        assert!(check_depth(&anchors(1000)).unwrap_err().contains("512 levels"));
        // each ref looked up against a thousand `$id`s: past the work allowed
        assert!(check_depth(&urns(1000)).unwrap_err().contains("too many places"));
        // a pointer inside a resource an `$id` opens is followed from it
        let mut inner = chain(1000);
        inner["$id"] = json!("https://x.example/inner.json");
        let s = json!({"properties": {"p": {"$ref": "https://x.example/inner.json"}}, "$defs": {"inner": inner}});
        assert!(check_depth(&s).is_err());
        // a root `$id` with refs by pointer, absolute or not: taken
        let mut s = chain(50);
        s["$id"] = json!("https://x.example/root.json");
        s["properties"] = json!({"b": {"$ref": "https://x.example/root.json#/$defs/A3"}});
        assert_eq!(check_depth(&s), Ok(()));
    }

    #[test]
    fn cycles_count_in_full_whatever_order_they_are_met() {
        // `cycles` cycles of `len` defs each, the last def of each naming the next cycle's first:
        // compiled from C0_0, each cycle is walked whole before the next is entered, however
        // the defs were met first (here `$defs` lists the last cycles first)
        let cycles_of = |cycles: usize, len: usize| {
            let mut defs = serde_json::Map::new();
            for c in (0..cycles).rev() {
                for i in 0..len {
                    let mut props = json!({"a": {"$ref": format!("#/$defs/C{c}_{}", (i + 1) % len)}});
                    if i + 1 == len && c + 1 < cycles {
                        props["b"] = json!({"$ref": format!("#/$defs/C{}_0", c + 1)});
                    }
                    defs.insert(format!("C{c}_{i}"), json!({"type": "object", "properties": props}));
                }
            }
            json!({"$defs": defs, "$ref": "#/$defs/C0_0"})
        };
        assert_eq!(check_depth(&cycles_of(3, 20)), Ok(()));
        assert!(check_depth(&cycles_of(8, 100)).is_err());
        // mutually recursive models (an expression tree) are small cycles: taken
        let expr = json!({"$defs": {
            "expr": {"anyOf": [{"type": "integer"}, {"$ref": "#/$defs/binop"}]},
            "binop": {"type": "object", "properties": {"op": {"enum": ["+", "*"]},
                "l": {"$ref": "#/$defs/expr"}, "r": {"$ref": "#/$defs/expr"}}}}, "$ref": "#/$defs/expr"});
        assert_eq!(check_depth(&expr), Ok(()));
        let root = json!({"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}});
        assert_eq!(check_depth(&root), Ok(()));
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
    fn lark_literals_are_counted() {
        let g = "start: \"a\\\"//\" /b\\/\"/ | C | %json {\"enum\": [\"x\", \"y\"]} // \"not\" /one/\nC: \"é\\é\"i\n";
        assert_eq!(lark_literals(g), 3);
        assert_eq!(lark_literals("start: \"open"), 1);
        let alternatives = |n: usize| format!("start: {}\n", vec!["\"w\""; n].join(" | "));
        assert_eq!(check_lark_literals(&alternatives(MAX_LARK_LITERALS)), Ok(()));
        let err = check_lark_literals(&alternatives(MAX_LARK_LITERALS + 1)).unwrap_err();
        assert!(err.contains(&format!("{} string and regex literals", MAX_LARK_LITERALS + 1)), "{err}");
    }

    #[test]
    fn a_grammar_s_inlined_schemas_are_found() {
        let lark = "start: \"<call>\" body\nbody: %json {\"type\": \"integer\", \"minimum\": -1e19}\nx: %json oops";
        let found = inlined_schemas(lark);
        assert_eq!(found, vec![json!({"type": "integer", "minimum": -1e19})]);
        assert!(crate::structured::check_for_engine(&found[0]).is_err());
    }
}
