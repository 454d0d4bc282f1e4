//! Jinja2's filters and tests where minijinja's differ from them, registered over minijinja's
//! own by [`register`]. Each follows the Jinja2 3.1 function of the same name (`do_join`,
//! `do_int`, ...) under Python's rules.

use super::pyjson::py_str;
use minijinja::value::{Kwargs, Rest, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value};

pub fn register(env: &mut Environment<'static>) {
    env.add_filter("join", join);
    env.add_test("iterable", is_iterable);
}

/// Python's type name, for the errors Python would raise.
fn type_name(v: &Value) -> &'static str {
    match v.kind() {
        ValueKind::None => "NoneType",
        ValueKind::Bool => "bool",
        ValueKind::Number if v.is_integer() => "int",
        ValueKind::Number => "float",
        ValueKind::String => "str",
        ValueKind::Seq => "list",
        ValueKind::Map => "dict",
        _ => "object",
    }
}

/// Whether Python can iterate `v` (minijinja iterates `none` as empty; Python refuses).
fn iterable(v: &Value) -> bool {
    !matches!(v.kind(), ValueKind::None | ValueKind::Number | ValueKind::Bool) && v.try_iter().is_ok()
}

/// `is iterable`: `iter(value)` succeeds (an undefined value iterates as empty; `none` does not).
fn is_iterable(v: &Value) -> bool {
    iterable(v)
}

/// Positional argument `i`, or the keyword `name`.
fn arg(args: &[Value], kwargs: &Kwargs, i: usize, name: &str) -> Result<Option<Value>, Error> {
    let kw: Option<Value> = kwargs.get(name)?;
    Ok(kw.or_else(|| args.get(i).cloned()))
}

/// Jinja2's `make_attrgetter`: `"a.b"` or `"0"` looks up each dotted part in turn (digits as
/// an index); a missing part is undefined.
fn attribute(item: &Value, path: &Value) -> Value {
    let Some(path) = path.as_str() else { return item.get_item(path).unwrap_or_default() };
    let mut v = item.clone();
    for part in path.split('.') {
        let key = part.parse::<i64>().map_or_else(|_| Value::from(part), Value::from);
        v = v.get_item(&key).unwrap_or_default();
    }
    v
}

/// `join(d='', attribute=None)`: `str(d).join(str(x) for x in value)`, each item printed as
/// Python's `str()` (minijinja's own prints a float as `1e16` -> `10000000000000000.0`).
fn join(value: Value, args: Rest<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let sep = arg(&args, &kwargs, 0, "d")?.map(|d| py_str(&d)).transpose()?.unwrap_or_default();
    let path = arg(&args, &kwargs, 1, "attribute")?;
    kwargs.assert_all_used()?;
    if value.is_undefined() {
        return Ok(Value::from(""));
    }
    if !iterable(&value) {
        return Err(Error::new(ErrorKind::InvalidOperation, format!("'{}' object is not iterable", type_name(&value))));
    }
    let mut parts = Vec::new();
    for item in value.try_iter()? {
        let item = match &path {
            Some(p) => attribute(&item, p),
            None => item,
        };
        parts.push(py_str(&item)?);
    }
    Ok(Value::from(parts.join(&sep)))
}
