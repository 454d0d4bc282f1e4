//! Python's view of values: `json.dumps` for `tojson`, `str()` for `{{ value }}`.

use minijinja::value::ValueKind;
use minijinja::{Error, ErrorKind, Output, State, Value};
use std::fmt::Write;

pub struct JsonOptions {
    pub ensure_ascii: bool,
    pub indent: Option<String>,
    pub separators: Option<(String, String)>,
    pub sort_keys: bool,
}

impl Default for JsonOptions {
    /// transformers' defaults (note `ensure_ascii=False`, unlike json.dumps).
    fn default() -> Self {
        Self { ensure_ascii: false, indent: None, separators: None, sort_keys: false }
    }
}

/// `indent=`: an int (spaces; negative means none, as Python) or a string.
pub fn indent_from(v: &Value) -> Result<Option<String>, Error> {
    if v.is_none() || v.is_undefined() {
        Ok(None)
    } else if let Some(s) = v.as_str() {
        Ok(Some(s.to_string()))
    } else if let Some(n) = v.as_i64() {
        Ok(Some(" ".repeat(n.max(0) as usize)))
    } else {
        Err(Error::new(ErrorKind::InvalidOperation, "tojson indent must be an integer or a string"))
    }
}

/// `separators=(item_sep, key_sep)`.
pub fn separators_from(v: &Value) -> Result<Option<(String, String)>, Error> {
    if v.is_none() || v.is_undefined() {
        return Ok(None);
    }
    let parts: Vec<Value> = v.try_iter()?.collect();
    match parts.as_slice() {
        [a, b] if a.as_str().is_some() && b.as_str().is_some() => {
            Ok(Some((a.as_str().unwrap_or_default().into(), b.as_str().unwrap_or_default().into())))
        }
        _ => Err(Error::new(ErrorKind::InvalidOperation, "tojson separators must be two strings")),
    }
}

pub fn dumps(v: &Value, opts: &JsonOptions) -> Result<String, Error> {
    let (item, key) = match (&opts.separators, &opts.indent) {
        (Some((i, k)), _) => (i.clone(), k.clone()),
        (None, None) => (", ".into(), ": ".into()),
        (None, Some(_)) => (",".into(), ": ".into()),
    };
    let mut out = String::new();
    Dumper { opts, item: &item, key: &key }.value(v, 0, &mut out)?;
    Ok(out)
}

struct Dumper<'a> {
    opts: &'a JsonOptions,
    item: &'a str,
    key: &'a str,
}

impl Dumper<'_> {
    fn newline(&self, level: usize, out: &mut String) {
        if let Some(ind) = &self.opts.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(ind);
            }
        }
    }

    fn value(&self, v: &Value, level: usize, out: &mut String) -> Result<(), Error> {
        match v.kind() {
            ValueKind::Undefined | ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number => out.push_str(&json_number(v)),
            ValueKind::String => string(v.as_str().unwrap_or_default(), self.opts.ensure_ascii, out),
            ValueKind::Map => {
                let mut entries: Vec<(String, Value)> = Vec::new();
                for k in v.try_iter()? {
                    let item = v.get_item(&k)?;
                    entries.push((json_key(&k), item));
                }
                if self.opts.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(&b.0));
                }
                if entries.is_empty() {
                    out.push_str("{}");
                    return Ok(());
                }
                out.push('{');
                for (i, (k, item)) in entries.iter().enumerate() {
                    if i > 0 {
                        out.push_str(self.item);
                    }
                    self.newline(level + 1, out);
                    string(k, self.opts.ensure_ascii, out);
                    out.push_str(self.key);
                    self.value(item, level + 1, out)?;
                }
                self.newline(level, out);
                out.push('}');
            }
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = v.try_iter()?.collect();
                if items.is_empty() {
                    out.push_str("[]");
                    return Ok(());
                }
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(self.item);
                    }
                    self.newline(level + 1, out);
                    self.value(item, level + 1, out)?;
                }
                self.newline(level, out);
                out.push(']');
            }
            _ => string(&v.to_string(), self.opts.ensure_ascii, out),
        }
        Ok(())
    }
}

/// Python turns non-string keys into strings: `1` -> "1", `True` -> "true", `None` -> "null".
fn json_key(k: &Value) -> String {
    match k.kind() {
        ValueKind::String => k.as_str().unwrap_or_default().to_string(),
        ValueKind::Bool => (if k.is_true() { "true" } else { "false" }).into(),
        ValueKind::None | ValueKind::Undefined => "null".into(),
        ValueKind::Number => json_number(k),
        _ => k.to_string(),
    }
}

fn json_number(v: &Value) -> String {
    if v.is_integer() {
        return v.to_string();
    }
    let f = f64::try_from(v.clone()).unwrap_or(f64::NAN);
    if f.is_nan() {
        "NaN".into()
    } else if f.is_infinite() {
        (if f > 0.0 { "Infinity" } else { "-Infinity" }).into()
    } else {
        float_repr(f)
    }
}

/// Python's `repr(float)`: shortest round-trip digits, fixed notation for exponents in
/// [-4, 16), else `d.ddde+XX`.
pub fn float_repr(f: f64) -> String {
    if f.is_nan() {
        return "nan".into();
    }
    if f.is_infinite() {
        return (if f > 0.0 { "inf" } else { "-inf" }).into();
    }
    let sci = format!("{:e}", f.abs());
    let (mant, exp) = sci.split_once('e').expect("{:e} has an exponent");
    let exp: i32 = exp.parse().expect("exponent is an integer");
    let digits: String = mant.chars().filter(|c| c.is_ascii_digit()).collect();
    let sign = if f.is_sign_negative() { "-" } else { "" };
    if (-4..16).contains(&exp) {
        if exp >= 0 {
            let int_len = exp as usize + 1;
            let (int, frac) = if digits.len() > int_len {
                (digits[..int_len].to_string(), digits[int_len..].to_string())
            } else {
                (format!("{digits:0<int_len$}"), "0".to_string())
            };
            format!("{sign}{int}.{frac}")
        } else {
            format!("{sign}0.{}{digits}", "0".repeat((-exp - 1) as usize))
        }
    } else {
        let (first, rest) = digits.split_at(1);
        let frac = if rest.is_empty() { String::new() } else { format!(".{rest}") };
        let esign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{first}{frac}e{esign}{:02}", exp.abs())
    }
}

/// A JSON string as Python's json module writes it.
fn string(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && !(' '..='~').contains(&c) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{:04x}", unit);
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `str.isprintable()` for one character, which decides what `repr()` escapes: every
/// "Other" (Cc, Cf, Cs, Co, Cn) and "Separator" (Zl, Zp, Zs) character but the ASCII space.
///
/// NOTE: the categories are Unicode 16.0's (the crate's data); Python has its own Unicode
/// version (3.11: 14.0, 3.12: 15.0, 3.13: 15.1, 3.14: 16.0), so a code point assigned after
/// the server's Python version is printed here but escaped (`\U...`) by an older Python.
fn is_printable(c: char) -> bool {
    use unicode_general_category::{get_general_category, GeneralCategory as G};
    c == ' '
        || !matches!(
            get_general_category(c),
            G::Control
                | G::Format
                | G::Surrogate
                | G::PrivateUse
                | G::Unassigned
                | G::LineSeparator
                | G::ParagraphSeparator
                | G::SpaceSeparator
        )
}

/// Python's `repr()` for values inside containers.
pub fn repr(v: &Value, out: &mut String) -> Result<(), Error> {
    match v.kind() {
        ValueKind::String => {
            let s = v.as_str().unwrap_or_default();
            let quote = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
            out.push(quote);
            for c in s.chars() {
                match c {
                    '\\' => out.push_str("\\\\"),
                    '\n' => out.push_str("\\n"),
                    '\r' => out.push_str("\\r"),
                    '\t' => out.push_str("\\t"),
                    c if c == quote => {
                        out.push('\\');
                        out.push(c);
                    }
                    c if !is_printable(c) => {
                        let _ = match c as u32 {
                            n @ 0..=0xff => write!(out, "\\x{n:02x}"),
                            n @ 0x100..=0xffff => write!(out, "\\u{n:04x}"),
                            n => write!(out, "\\U{n:08x}"),
                        };
                    }
                    c => out.push(c),
                }
            }
            out.push(quote);
        }
        ValueKind::Map => {
            out.push('{');
            for (i, k) in v.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                repr(&k, out)?;
                out.push_str(": ");
                repr(&v.get_item(&k)?, out)?;
            }
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            for (i, item) in v.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                repr(&item, out)?;
            }
            out.push(']');
        }
        _ => out.push_str(&py_str(v)?),
    }
    Ok(())
}

/// Python's `str()`, which is what Jinja2 prints.
pub fn py_str(v: &Value) -> Result<String, Error> {
    Ok(match v.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::None => "None".into(),
        ValueKind::Bool => (if v.is_true() { "True" } else { "False" }).into(),
        ValueKind::Number if !v.is_integer() => float_repr(f64::try_from(v.clone()).unwrap_or(f64::NAN)),
        // (lazy sequences too: a slice or `a + b` of lists is a list in Python)
        ValueKind::Map | ValueKind::Seq | ValueKind::Iterable => {
            let mut s = String::new();
            repr(v, &mut s)?;
            s
        }
        _ => v.to_string(),
    })
}

/// The `string` filter: Python's `str()` (a dict as `{'k': 'v'}`, as Jinja2 writes it).
pub fn string_filter(v: Value) -> Result<Value, Error> {
    Ok(match v.kind() {
        ValueKind::String => v, // (keeps a safe string safe)
        _ => Value::from(py_str(&v)?),
    })
}

/// The formatter for `{{ ... }}`: print values as Jinja2 under Python would.
pub fn format_value(out: &mut Output, _state: &State, v: &Value) -> Result<(), Error> {
    let s = py_str(v)?;
    out.write_str(&s).map_err(|_| Error::new(ErrorKind::WriteFailure, "cannot write output"))
}
