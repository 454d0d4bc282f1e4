//! Jinja2's filters and tests where minijinja's differ from them, registered over minijinja's
//! own by [`register`]. Each follows the Jinja2 3.1 function of the same name (`do_join`,
//! `do_int`, ...) under Python's rules.

use super::pyjson::py_str;
use minijinja::value::{Kwargs, Rest, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value};

pub fn register(env: &mut Environment<'static>) {
    // Jinja2's that minijinja keeps apart
    env.add_filter("striptags", minijinja_contrib::filters::striptags);
    env.add_filter("filesizeformat", minijinja_contrib::filters::filesizeformat);
    env.add_function("joiner", minijinja_contrib::globals::joiner);
    env.add_function("cycler", |items: Rest<Value>| minijinja_contrib::globals::cycler(items.0));
    env.add_filter("truncate", truncate);
    env.add_filter("urlencode", urlencode);
    env.add_filter("join", join);
    env.add_filter("int", int);
    env.add_filter("float", float);
    env.add_filter("replace", replace);
    env.add_filter("length", length);
    env.add_filter("count", length);
    env.add_filter("round", round);
    env.add_filter("title", title);
    env.add_filter("wordcount", wordcount);
    env.add_filter("center", center);
    env.add_filter("max", |value: Value, args: Rest<Value>, kwargs: Kwargs| extreme(value, &args, &kwargs, true));
    env.add_filter("min", |value: Value, args: Rest<Value>, kwargs: Kwargs| extreme(value, &args, &kwargs, false));
    env.add_filter("xmlattr", xmlattr);
    env.add_test("iterable", is_iterable);
    env.add_test("sequence", is_sequence);
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

/// `is sequence`: Python's `len(value)` and `value[...]` both work, so strings and dicts are
/// sequences too (and an undefined value, whose Jinja2 type has both); `none`, numbers and
/// iterators are not.
fn is_sequence(v: &Value) -> bool {
    matches!(v.kind(), ValueKind::String | ValueKind::Bytes | ValueKind::Seq | ValueKind::Map | ValueKind::Undefined)
}

fn undefined_error(v: &Value) -> Result<(), Error> {
    if v.is_undefined() {
        // (Jinja2's Undefined refuses int() and float())
        return Err(Error::new(ErrorKind::UndefinedError, "int() or float() of an undefined value"));
    }
    Ok(())
}

/// `int(default=0, base=10)`: Python's `int(value)` (`int(value, base)` for a string), else
/// `int(float(value))`, else `default`: `'x'|int` is 0, `'3.7'|int` is 3, `'0x1A'|int(0, 16)`
/// is 26, `'1_000'|int` is 1000.
fn int(value: Value, args: Rest<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let default = arg(&args, &kwargs, 0, "default")?.unwrap_or(Value::from(0));
    let base = arg(&args, &kwargs, 1, "base")?.map_or(Ok(10), i64::try_from)?;
    kwargs.assert_all_used()?;
    undefined_error(&value)?;
    let from_float = |f: f64| {
        // (Python's ints have no bound; past i128 the default stands in for the big number)
        if f.is_finite() && f.abs() < 1.7e38 {
            Value::from(f.trunc() as i128)
        } else {
            default.clone()
        }
    };
    Ok(match value.kind() {
        ValueKind::Bool => Value::from(value.is_true() as i64),
        ValueKind::Number if value.is_integer() => value,
        ValueKind::Number => from_float(f64::try_from(value).unwrap_or(f64::NAN)),
        ValueKind::String => {
            let s = value.as_str().unwrap_or_default();
            match u32::try_from(base).ok().and_then(|b| py_int(s, b)) {
                Some(n) => Value::from(n),
                None => py_float(s).map_or(default.clone(), from_float),
            }
        }
        _ => default,
    })
}

/// `float(default=0.0)`: Python's `float(value)`, else `default`.
fn float(value: Value, args: Rest<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let default = arg(&args, &kwargs, 0, "default")?.unwrap_or(Value::from(0.0));
    kwargs.assert_all_used()?;
    undefined_error(&value)?;
    Ok(match value.kind() {
        ValueKind::Bool => Value::from(value.is_true() as i64 as f64),
        ValueKind::Number => Value::from(f64::try_from(value).unwrap_or(f64::NAN)),
        ValueKind::String => py_float(value.as_str().unwrap_or_default()).map_or(default, Value::from),
        _ => default,
    })
}

/// Python's `int(s, base)`: whitespace around, a sign, a `0x`/`0o`/`0b` prefix (base 0 reads
/// it; 16, 8 and 2 allow theirs), single underscores between digits.
fn py_int(s: &str, base: u32) -> Option<i128> {
    let t = s.trim();
    let (negative, t) = match t.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, t.strip_prefix('+').unwrap_or(t)),
    };
    let prefix = t.get(..2).map(str::to_ascii_lowercase);
    let prefixed_base = match prefix.as_deref() {
        Some("0x") => Some(16),
        Some("0o") => Some(8),
        Some("0b") => Some(2),
        _ => None,
    };
    let (base, body) = match prefixed_base {
        Some(b) if base == 0 || base == b => (b, t[2..].strip_prefix('_').unwrap_or(&t[2..])),
        _ if base == 0 => {
            // base 0 refuses leading zeros on a decimal ("010"), as Python 3 does
            if t.len() > 1 && t.starts_with('0') && t.bytes().any(|b| !matches!(b, b'0' | b'_')) {
                return None;
            }
            (10, t)
        }
        _ => (base, t),
    };
    if !(2..=36).contains(&base) || body.is_empty() || body.starts_with('_') || body.ends_with('_') {
        return None;
    }
    if body.contains("__") || !body.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
        return None;
    }
    let digits: String = body.chars().filter(|&c| c != '_').collect();
    let n = i128::from_str_radix(&digits, base).ok()?;
    Some(if negative { -n } else { n })
}

/// Python's `float(s)`: whitespace around, single underscores between digits, `inf`,
/// `infinity` and `nan` in any case (Rust's parser takes the rest of Python's forms).
fn py_float(s: &str) -> Option<f64> {
    let t = s.trim();
    let b = t.as_bytes();
    let underscore_ok = |i: usize| i > 0 && i + 1 < b.len() && b[i - 1].is_ascii_digit() && b[i + 1].is_ascii_digit();
    if (0..b.len()).any(|i| b[i] == b'_' && !underscore_ok(i)) {
        return None;
    }
    t.replace('_', "").parse::<f64>().ok()
}

/// `replace(old, new, count=None)`: Python's `str(s).replace(str(old), str(new), count)`
/// (a negative or missing count replaces all; an empty `old` inserts `new` between
/// characters).
fn replace(value: Value, args: Rest<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let need = |v: Option<Value>, name: &str| {
        v.ok_or_else(|| Error::new(ErrorKind::MissingArgument, format!("replace() needs `{name}`")))
    };
    let old = py_str(&need(arg(&args, &kwargs, 0, "old")?, "old")?)?;
    let new = py_str(&need(arg(&args, &kwargs, 1, "new")?, "new")?)?;
    let count = match arg(&args, &kwargs, 2, "count")? {
        Some(c) if !c.is_none() => usize::try_from(i64::try_from(c)?).ok(),
        _ => None,
    };
    kwargs.assert_all_used()?;
    let s = py_str(&value)?;
    let out = match count {
        None => s.replace(&old, &new),
        Some(n) if !old.is_empty() => s.replacen(&old, &new, n),
        Some(n) => {
            // Python inserts at each of the len + 1 gaps, the first `n` of them
            let mut out = String::new();
            let mut left = n;
            for c in s.chars() {
                if left > 0 {
                    out.push_str(&new);
                    left -= 1;
                }
                out.push(c);
            }
            if left > 0 {
                out.push_str(&new);
            }
            out
        }
    };
    Ok(Value::from(out))
}

/// `length` (and `count`): an undefined value has none (Jinja2's `Undefined.__len__` is 0;
/// minijinja's refuses it), so `m.tool_calls|length > 0` reads a message without calls.
fn length(value: &Value) -> Result<Value, Error> {
    if value.is_undefined() {
        return Ok(Value::from(0));
    }
    minijinja::filters::length(value).map(Value::from)
}

/// `round(precision=0, method='common')`: `common` is Python's `round`, ties to even on the
/// value's exact binary digits (`2.5|round` is 2.0, `2.675|round(2)` 2.67); `floor` and `ceil`
/// round down and up. A float either way, as Jinja2's.
fn round(value: Value, args: Rest<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let precision = arg(&args, &kwargs, 0, "precision")?.map(i32::try_from).transpose()?.unwrap_or(0);
    let method = arg(&args, &kwargs, 1, "method")?;
    kwargs.assert_all_used()?;
    let x = f64::try_from(value.clone())
        .map_err(|_| Error::new(ErrorKind::InvalidOperation, format!("cannot round a {}", type_name(&value))))?;
    let scale = 10f64.powi(precision);
    let out = match method.as_ref().and_then(Value::as_str).unwrap_or("common") {
        // (Rust formats the exact binary value correctly rounded, ties to even, as Python rounds)
        "common" if precision >= 0 => format!("{x:.prec$}", prec = precision as usize).parse().unwrap_or(x),
        "common" => (x / 10f64.powi(-precision)).round_ties_even() * 10f64.powi(-precision),
        "floor" => (x * scale).floor() / scale,
        "ceil" => (x * scale).ceil() / scale,
        other => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("method must be 'common', 'ceil' or 'floor', not {other:?}"),
            ))
        }
    };
    Ok(Value::from(out))
}

/// `title`: each word's first letter upper and the rest lower, words split at whitespace,
/// `-`, `(`, `{`, `[` and `<` as Jinja2's `do_title` splits them (so `what's` stays `What's`).
fn title(value: &Value) -> Result<Value, Error> {
    let s = py_str(value)?;
    let mut out = String::with_capacity(s.len());
    let mut word_start = true;
    for c in s.chars() {
        if c.is_whitespace() || matches!(c, '-' | '(' | '{' | '[' | '<') {
            word_start = true;
            out.push(c);
        } else if word_start {
            out.extend(c.to_uppercase());
            word_start = false;
        } else {
            out.extend(c.to_lowercase());
        }
    }
    Ok(Value::from(out))
}

/// `center(width=80)`: Python's `str.center`.
fn center(value: &Value, width: Option<usize>) -> Result<Value, Error> {
    Ok(Value::from(pad(&py_str(value)?, width.unwrap_or(80), ' ', "center")))
}

/// `truncate(length=255, killwords=False, end='...', leeway=5)`, positional or by name: a
/// string longer than `length + leeway` characters cut to `length` with `end`, at the last
/// space unless `killwords`.
fn truncate(value: &Value, args: Rest<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let names = ["length", "killwords", "end", "leeway"];
    if args.len() > names.len() {
        return Err(Error::new(ErrorKind::TooManyArguments, "truncate takes at most 4 arguments"));
    }
    let arg = |i: usize| -> Result<Option<Value>, Error> {
        Ok(args.get(i).cloned().or(kwargs.get::<Option<Value>>(names[i])?).filter(|v| !v.is_none()))
    };
    let count = |v: Option<Value>, default: usize| v.map_or(Ok(default), usize::try_from);
    let length = count(arg(0)?, 255)?;
    let killwords = arg(1)?.is_some_and(|v| v.is_true());
    let end = arg(2)?.map_or_else(|| "...".to_string(), |v| v.to_string());
    let leeway = count(arg(3)?, 5)?;
    kwargs.assert_all_used()?;
    let s = py_str(value)?;
    let chars: Vec<char> = s.chars().collect();
    let end_len = end.chars().count();
    if length < end_len {
        return Err(Error::new(ErrorKind::InvalidOperation, format!("expected length >= {end_len}, got {length}")));
    }
    if chars.len() <= length + leeway {
        return Ok(Value::from(s));
    }
    let kept: String = chars[..length - end_len].iter().collect();
    let kept = if killwords { kept.as_str() } else { kept.rsplit_once(' ').map_or(kept.as_str(), |(head, _)| head) };
    Ok(Value::from(format!("{kept}{end}")))
}

/// `urlencode`: a string (or any non-iterable) percent-encoded as UTF-8 keeping `/`; a dict's
/// items or a list's pairs as a query string (`k=v&...`, spaces as `+`), as Jinja2's.
fn urlencode(value: &Value) -> Result<Value, Error> {
    let quote = |v: &Value, query: bool| -> Result<String, Error> {
        let mut out = String::new();
        for b in py_str(v)?.bytes() {
            match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'_' | b'.' | b'-' | b'~' => out.push(b as char),
                b'/' if !query => out.push('/'),
                b' ' if query => out.push('+'),
                _ => out.push_str(&format!("%{b:02X}")),
            }
        }
        Ok(out)
    };
    let pairs: Vec<(Value, Value)> = match value.kind() {
        ValueKind::Map => {
            value.try_iter()?.map(|k| (value.get_item(&k).unwrap_or_default(), k)).map(|(v, k)| (k, v)).collect()
        }
        ValueKind::Seq | ValueKind::Iterable => value
            .try_iter()?
            .map(|pair| Ok((pair.get_item_by_index(0)?, pair.get_item_by_index(1)?)))
            .collect::<Result<_, Error>>()?,
        _ => return Ok(Value::from(quote(value, false)?)),
    };
    let encoded: Vec<String> = pairs
        .iter()
        .map(|(k, v)| Ok(format!("{}={}", quote(k, true)?, quote(v, true)?)))
        .collect::<Result<_, Error>>()?;
    Ok(Value::from(encoded.join("&")))
}

/// Python's `str.ljust`, `str.rjust` and `str.center` (`how`): `s` padded with `fill` to
/// `width` characters; centred, the odd one goes left when `width` is odd, as CPython's.
pub(super) fn pad(s: &str, width: usize, fill: char, how: &str) -> String {
    let margin = width.saturating_sub(s.chars().count());
    let left = match how {
        "ljust" => 0,
        "rjust" => margin,
        _ => margin / 2 + (margin & width & 1),
    };
    let fill = |n: usize| std::iter::repeat_n(fill, n);
    fill(left).chain(s.chars()).chain(fill(margin - left)).collect()
}

/// `wordcount`: the words in the string, as Jinja2 counts them (runs of word characters).
fn wordcount(value: &Value) -> Result<Value, Error> {
    let s = py_str(value)?;
    let words = s.split(|c: char| !(c.is_alphanumeric() || c == '_')).filter(|w| !w.is_empty()).count();
    Ok(Value::from(words))
}

/// `max`/`min(case_sensitive=False, attribute=None)`: the first largest (smallest) item,
/// compared by its `attribute` when one is named and with strings lower-cased unless
/// `case_sensitive`; undefined for an empty sequence, as Jinja2's.
fn extreme(value: Value, args: &[Value], kwargs: &Kwargs, largest: bool) -> Result<Value, Error> {
    let case_sensitive = arg(args, kwargs, 0, "case_sensitive")?.is_some_and(|v| v.is_true());
    let path = arg(args, kwargs, 1, "attribute")?;
    kwargs.assert_all_used()?;
    if value.is_undefined() {
        return Ok(Value::UNDEFINED);
    }
    if !iterable(&value) {
        return Err(Error::new(ErrorKind::InvalidOperation, format!("'{}' object is not iterable", type_name(&value))));
    }
    let key = |item: &Value| {
        let k = path.as_ref().map_or_else(|| item.clone(), |p| attribute(item, p));
        match k.as_str() {
            Some(s) if !case_sensitive => Value::from(s.to_lowercase()),
            _ => k,
        }
    };
    let mut best: Option<(Value, Value)> = None;
    for item in value.try_iter()? {
        let k = key(&item);
        let better = best.as_ref().is_none_or(|(b, _)| if largest { k > *b } else { k < *b });
        if better {
            best = Some((k, item));
        }
    }
    Ok(best.map_or(Value::UNDEFINED, |(_, item)| item))
}

/// `xmlattr(autospace=True)`: a dict's items as XML attributes, `key="value"` HTML-escaped,
/// none and undefined values left out, a space before them unless `autospace` is false; a key
/// with whitespace, `/`, `>` or `=` is refused, as Jinja2 3.1.4's.
fn xmlattr(value: &Value, autospace: Option<bool>) -> Result<Value, Error> {
    let escape = |s: &str| {
        let mut out = String::with_capacity(s.len());
        for c in s.chars() {
            match c {
                '&' => out.push_str("&amp;"),
                '<' => out.push_str("&lt;"),
                '>' => out.push_str("&gt;"),
                '\'' => out.push_str("&#39;"),
                '"' => out.push_str("&#34;"),
                c => out.push(c),
            }
        }
        out
    };
    if value.kind() != ValueKind::Map {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("'{}' object has no attribute 'items'", type_name(value)),
        ));
    }
    let mut items = Vec::new();
    for key in value.try_iter()? {
        let item = value.get_item(&key)?;
        if item.is_none() || item.is_undefined() {
            continue;
        }
        let Some(name) = key.as_str() else {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("expected string or bytes-like object, got '{}'", type_name(&key)),
            ));
        };
        if name.chars().any(|c| matches!(c, ' ' | '\t' | '\n' | '\r' | '\x0b' | '\x0c' | '/' | '>' | '=')) {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("Invalid character in attribute name: {name:?}"),
            ));
        }
        items.push(format!("{}=\"{}\"", escape(name), escape(&py_str(&item)?)));
    }
    let attrs = items.join(" ");
    Ok(Value::from(if autospace.unwrap_or(true) && !attrs.is_empty() { format!(" {attrs}") } else { attrs }))
}
