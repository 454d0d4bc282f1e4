//! The request's JSON as template values that print as Python's `str()` wherever minijinja
//! prints them.
//!
//! minijinja writes `{{ }}` through our formatter ([`super::pyjson::format_value`]), but its
//! `~` operator, `join` and the like go through `Display`, which for its own maps and lists
//! is `{"a": 1.5}` with Rust string escapes. JSON objects and arrays therefore become
//! [`PyDict`] and [`PyList`], whose `Display` is Python's `repr()`. What a template builds
//! itself (a `{'a': 1}` literal, `x + [y]`, `|list`) is minijinja's and keeps its own form,
//! and so does a bare float (`'x' ~ 1e20`): see the module doc of `template`.

use super::pyjson;
use indexmap::IndexMap;
use minijinja::value::{Enumerator, Object, ObjectExt, ObjectRepr, Value};
use serde_json::Value as Json;
use std::fmt;
use std::sync::Arc;

/// A JSON value for the template: objects and arrays as [`PyDict`] / [`PyList`].
pub fn from_json(v: &Json) -> Value {
    match v {
        Json::Object(map) => {
            Value::from_object(PyDict(map.iter().map(|(k, v)| (Value::from(k.as_str()), from_json(v))).collect()))
        }
        Json::Array(items) => Value::from_object(PyList(items.iter().map(from_json).collect())),
        other => Value::from_serialize(other),
    }
}

/// Python's `repr()` of `v` into a formatter. `repr` fails only where iterating a value
/// fails, which ours never do; an error here would make minijinja's `to_string()` panic, so
/// what was written stands.
pub fn write_repr(v: Value, f: &mut fmt::Formatter<'_>) -> fmt::Result {
    let mut out = String::new();
    let _ = pyjson::repr(&v, &mut out);
    f.write_str(&out)
}

/// A JSON object, in its order.
#[derive(Debug)]
pub struct PyDict(IndexMap<Value, Value>);

impl Object for PyDict {
    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        self.0.get(key).cloned()
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        self.mapped_enumerator(|this| Box::new(this.0.keys().cloned()))
    }

    fn enumerator_len(self: &Arc<Self>) -> Option<usize> {
        Some(self.0.len())
    }

    fn render(self: &Arc<Self>, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_repr(Value::from_dyn_object(self.clone()), f)
    }
}

/// A JSON array.
#[derive(Debug)]
pub struct PyList(pub Vec<Value>);

impl Object for PyList {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Seq
    }

    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        self.0.get(key.as_usize()?).cloned()
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        Enumerator::Seq(self.0.len())
    }

    fn render(self: &Arc<Self>, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_repr(Value::from_dyn_object(self.clone()), f)
    }
}
