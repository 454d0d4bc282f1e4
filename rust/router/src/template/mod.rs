//! Chat templates: which template a model uses, and rendering it as transformers does.
//!
//! Owns template resolution (`--chat-template` -> `chat_template.jinja` -> tokenizer_config
//! `chat_template`, named templates included -> GGUF metadata) and rendering with minijinja +
//! pycompat, matching `transformers.apply_chat_template` byte for byte:
//! - trim_blocks and lstrip_blocks on, the template's single trailing newline dropped
//!   (Jinja2's defaults, which transformers keeps), loop controls on;
//! - `raise_exception(msg)`, `strftime_now(fmt)`, and a `tojson` filter that writes what
//!   Python's `json.dumps(x, ensure_ascii=False, ...)` writes (see [`pyjson`]);
//! - values print as Python's `str()` (`True`, `None`, `1e+20`, `{'a': 'b'}`) in `{{ }}`,
//!   `|string` and `|join`, and the request's objects and arrays under `~` too
//!   ([`pyvalue`]); `repr()` escapes what `str.isprintable()` refuses; `join`, `int`,
//!   `float`, `replace`, `is sequence`, `is iterable` follow Jinja2 ([`filters`]);
//! - `continue_final_message` by transformers' tag trick: mark the final message's text,
//!   render without a generation prompt, cut right after the mark.
//!
//! The template text is never rewritten but for one tag: transformers' `{% generation %}`
//! (its Jinja extension that marks assistant tokens for training masks, rendering its body as
//! it is, as a caller block with its own scope), which minijinja cannot parse, becomes
//! `{% with %}` (see [`expand_generation_tags`]). Every render runs under a fuel limit, since templates may
//! arrive with requests.
//!
//! Known differences from Jinja2, which minijinja 2 offers no hook to change:
//! - `~` prints through minijinja's `Display`: a bare float in exponent range (`'x' ~ 1e20`
//!   gives `x100000000000000000000.0`, Python `x1e+20`) and a dict or list the template
//!   builds itself (`'x' ~ {'a': 1}` gives `x{"a": 1}`) print minijinja's way; the request's
//!   values and everything in `{{ }}` print as Python.
//! - `'%s=%d' % (a, b)`: minijinja's `%` is arithmetic only (`'%s=%d'|format(a, b)`, which
//!   Jinja2 has too, works); a macro takes no extra arguments (Jinja2's `varargs`/`kwargs`).
//! - no tuple type: `(1, 'a')`, `{'a': 1}.items()|list` and `|dictsort` print as lists
//!   (`[1, 'a']`, Python `(1, 'a')`); `range(3)`, `namespace()` and macros print as their
//!   contents, and `range(3) is sequence` is false (Python: `range(0, 3)`, `<Namespace ...>`,
//!   `<Macro 'f'>`, true); a namespace or macro `is sequence` (Python: false).

use crate::error::ApiError;
use minijinja::value::{Enumerator, Kwargs, Object, Rest};
use minijinja::{Environment, Error, ErrorKind, Value};
use serde_json::Value as Json;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

mod filters;
mod pyjson;
mod pyvalue;
mod strftime;

/// File contents read by Python; resolution happens here.
#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(default)]
pub struct TemplateSources {
    /// `--chat-template` (already read if it was a file)
    pub cli: Option<String>,
    /// chat_template.jinja
    pub folder_jinja: Option<String>,
    /// additional_chat_templates/<name>.jinja, by name (transformers saves the templates
    /// other than "default" there, beside chat_template.jinja)
    pub folder_named: std::collections::BTreeMap<String, String>,
    /// tokenizer_config.json "chat_template": string or [{name, template}]
    pub tokenizer_config: Option<serde_json::Value>,
    /// The file `tokenizer_config` was read from, when not tokenizer_config.json (a
    /// processor-style repo's chat_template.json)
    pub tokenizer_config_file: Option<String>,
    /// tokenizer.chat_template
    pub gguf: Option<String>,
}

/// The templates a model offers, by name ("default", "tool_use", ...).
pub struct TemplateSet {
    templates: Vec<(String, ChatTemplate)>,
}

impl TemplateSet {
    /// Resolution: cli -> the folder's files (chat_template.jinja as "default", the named
    /// ones in additional_chat_templates/) -> tokenizer_config (named: "default",
    /// "tool_use") -> gguf. The first source present wins whole; an empty set means chat
    /// routes answer 400.
    pub fn resolve(sources: TemplateSources) -> Result<Self, String> {
        let present = |s: &Option<String>| s.as_ref().filter(|t| !t.trim().is_empty()).cloned();
        if let Some(cli) = &sources.cli {
            if cli.trim().is_empty() {
                return Err("--chat-template is empty".into());
            }
            return Self::single(cli, "--chat-template");
        }
        let named = sources.folder_named.iter().filter(|(_, text)| !text.trim().is_empty());
        if present(&sources.folder_jinja).is_some() || named.clone().next().is_some() {
            let mut templates = Vec::new();
            if let Some(text) = present(&sources.folder_jinja) {
                templates.push(("default".to_string(), ChatTemplate::new(&text, "chat_template.jinja")?));
            }
            for (name, text) in named {
                let origin = format!("additional_chat_templates/{name}.jinja");
                templates.push((name.clone(), ChatTemplate::new(text, &origin)?));
            }
            return Ok(Self { templates });
        }
        let file = sources.tokenizer_config_file.as_deref().unwrap_or("tokenizer_config.json");
        match &sources.tokenizer_config {
            None | Some(Json::Null) => {}
            Some(Json::String(s)) if s.trim().is_empty() => {}
            Some(Json::String(s)) => return Self::single(s, file),
            Some(Json::Array(items)) => {
                let mut templates = Vec::new();
                for item in items {
                    let (Some(name), Some(text)) = (item["name"].as_str(), item["template"].as_str()) else {
                        return Err(format!("{file} chat_template entries need `name` and `template`"));
                    };
                    let origin = if name == "default" { file.to_string() } else { format!("{file}:{name}") };
                    templates.push((name.to_string(), ChatTemplate::new(text, &origin)?));
                }
                if !templates.is_empty() {
                    return Ok(Self { templates });
                }
            }
            Some(other) => return Err(format!("{file} chat_template must be a string or a list, not {other}")),
        }
        if let Some(text) = present(&sources.gguf) {
            return Self::single(&text, "gguf");
        }
        Ok(Self { templates: Vec::new() })
    }

    fn single(text: &str, origin: &str) -> Result<Self, String> {
        Ok(Self { templates: vec![("default".into(), ChatTemplate::new(text, origin)?)] })
    }

    /// "tool_use" when tools are sent and the model has one, else "default", as transformers.
    pub fn select(&self, has_tools: bool) -> Option<&ChatTemplate> {
        let by_name = |n: &str| self.templates.iter().find(|(name, _)| name == n).map(|(_, t)| t);
        if has_tools {
            if let Some(t) = by_name("tool_use") {
                return Some(t);
            }
        }
        by_name("default")
    }

    pub fn is_empty(&self) -> bool {
        self.templates.is_empty()
    }

    /// The templates' names, in the order the source lists them.
    pub fn names(&self) -> Vec<&str> {
        self.templates.iter().map(|(name, _)| name.as_str()).collect()
    }
}

/// One compiled template.
pub struct ChatTemplate {
    env: Environment<'static>,
    origin: String,
    hash: String,
    /// Names the template reads but never sets: what chat_template_kwargs can reach.
    declared: std::collections::HashSet<String>,
    /// transformers refuses continue_final_message for templates that never say "content".
    mentions_content: bool,
    /// Whether the template walks list-of-parts content or concatenates strings.
    content_format: crate::content_format::ContentFormat,
    source: String,
}

const NAME: &str = "chat_template";
/// transformers' marker for the end of the message to continue (trailing space included).
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";
/// Names the renderer itself sets; chat_template_kwargs may not replace them.
pub const RESERVED: [&str; 4] = ["messages", "tools", "documents", "add_generation_prompt"];

/// The error `raise_exception` carries, so a render error can be told apart from a bug in
/// the template.
#[derive(Debug)]
struct Raised(String);

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg.clone()).with_source(Raised(msg)))
}

/// `{% generation %}` / `{% endgeneration %}` (transformers' tag, any whitespace control) as
/// `{% with %}` / `{% endwith %}`, the same markers kept, so the body renders as in
/// transformers and trim_blocks/lstrip_blocks act on the same tags. transformers renders the
/// body as a `CallBlock`, a macro of its own: a `{% set %}` inside stays inside, as it does
/// in a `with` block (namespace attributes, as there, are written through). Only real tags change:
/// comments, expressions, string literals and `{% raw %}` blocks are copied as they are.
fn expand_generation_tags(source: &str) -> std::borrow::Cow<'_, str> {
    if !source.contains("generation") {
        return source.into();
    }
    // the end of the block opened at `from` (the index after `close`), skipping quoted strings
    fn block_end(s: &str, from: usize, close: &str) -> Option<usize> {
        let bytes = s.as_bytes();
        let mut i = from;
        while i < bytes.len() {
            match bytes[i] {
                q @ (b'\'' | b'"') => {
                    i += 1;
                    while i < bytes.len() && bytes[i] != q {
                        i += if bytes[i] == b'\\' { 2 } else { 1 };
                    }
                    i += 1;
                }
                _ if bytes[i..].starts_with(close.as_bytes()) => return Some(i + close.len()),
                _ => i += 1,
            }
        }
        None
    }
    let tag_word = |inner: &str| inner.trim_matches(['-', '+']).trim().to_string();
    let mut out = String::with_capacity(source.len());
    let mut i = 0;
    while let Some(at) = source[i..].find('{').map(|a| a + i) {
        let rest = &source[at..];
        let (close, is_tag) = match rest.get(..2) {
            Some("{#") => ("#}", false),
            Some("{{") => ("}}", false),
            Some("{%") => ("%}", true),
            _ => {
                out.push_str(&source[i..=at]);
                i = at + 1;
                continue;
            }
        };
        out.push_str(&source[i..at]);
        let Some(end) =
            (if close == "#}" { rest.find(close).map(|e| at + e + 2) } else { block_end(source, at + 2, close) })
        else {
            out.push_str(rest);
            return out.into();
        };
        let block = &source[at..end];
        let inner = &block[2..block.len() - 2];
        let word = if is_tag { tag_word(inner) } else { String::new() };
        if word == "generation" || word == "endgeneration" {
            let open = if inner.starts_with(['-', '+']) { &inner[..1] } else { "" };
            let shut = if inner.ends_with(['-', '+']) { &inner[inner.len() - 1..] } else { "" };
            let w = if word == "generation" { "with" } else { "endwith" };
            out.push_str(&format!("{{%{open} {w} {shut}%}}"));
            i = end;
        } else if word == "raw" {
            // copied through its {% endraw %} (any whitespace control)
            let mut j = end;
            let stop = loop {
                match source[j..].find("{%") {
                    Some(k) => {
                        let tag_at = j + k;
                        let tag_end = source[tag_at..].find("%}").map(|e| tag_at + e + 2).unwrap_or(source.len());
                        if tag_word(&source[tag_at + 2..tag_end.saturating_sub(2).max(tag_at + 2)]) == "endraw" {
                            break tag_end;
                        }
                        j = tag_end;
                    }
                    None => break source.len(),
                }
            };
            out.push_str(&source[at..stop]);
            i = stop;
        } else {
            out.push_str(block);
            i = end;
        }
    }
    out.push_str(&source[i..]);
    out.into()
}

/// Python's str and list methods that pycompat lacks (`rsplit`, `partition`, `removeprefix`,
/// `index`, `count` on lists, ...), then pycompat's.
fn py_methods(state: &minijinja::State, value: &Value, method: &str, args: &[Value]) -> Result<Value, Error> {
    let bad = |m: &str| Error::new(ErrorKind::InvalidOperation, m.to_string());
    let arg_str = |i: usize| args.get(i).and_then(|a| a.as_str().map(str::to_string));
    if let Some(s) = value.as_str() {
        match (method, args.len()) {
            ("removeprefix", 1) | ("removesuffix", 1) => {
                let affix = arg_str(0).ok_or_else(|| bad("the affix must be a string"))?;
                let out = if method == "removeprefix" {
                    s.strip_prefix(affix.as_str())
                } else {
                    s.strip_suffix(affix.as_str())
                };
                return Ok(Value::from(out.unwrap_or(s)));
            }
            ("partition", 1) | ("rpartition", 1) => {
                let sep = arg_str(0).filter(|p| !p.is_empty()).ok_or_else(|| bad("empty separator"))?;
                let found =
                    if method == "partition" { s.split_once(sep.as_str()) } else { s.rsplit_once(sep.as_str()) };
                let parts = match found {
                    Some((a, b)) => [a, sep.as_str(), b],
                    None if method == "partition" => [s, "", ""],
                    None => ["", "", s],
                };
                return Ok(Value::from(parts.iter().map(|p| Value::from(*p)).collect::<Vec<_>>()));
            }
            ("title", 0) => {
                // Python's: a cased letter after an uncased character (or none) is upper, after a
                // cased one lower (`4th` -> `4Th`, `what's` -> `What'S`)
                let mut out = String::with_capacity(s.len());
                let mut after_cased = false;
                for c in s.chars() {
                    let cased = c.is_lowercase() || c.is_uppercase();
                    if cased && !after_cased {
                        out.extend(c.to_uppercase());
                    } else if cased {
                        out.extend(c.to_lowercase());
                    } else {
                        out.push(c);
                    }
                    after_cased = cased;
                }
                return Ok(Value::from(out));
            }
            ("ljust" | "rjust" | "center", 1..=2) => {
                let width = usize::try_from(args[0].clone()).map_err(|_| bad("the width must be an integer"))?;
                let fill = match args.get(1) {
                    None => ' ',
                    Some(f) => {
                        let mut chars = f.as_str().map(str::chars).ok_or_else(|| bad("the fill must be a string"))?;
                        match (chars.next(), chars.next()) {
                            (Some(c), None) => c,
                            _ => return Err(bad("the fill character must be exactly one character long")),
                        }
                    }
                };
                return Ok(Value::from(filters::pad(s, width, fill, method)));
            }
            ("swapcase", 0) => {
                let mut out = String::with_capacity(s.len());
                for c in s.chars() {
                    if c.is_uppercase() {
                        out.extend(c.to_lowercase());
                    } else if c.is_lowercase() {
                        out.extend(c.to_uppercase());
                    } else {
                        out.push(c);
                    }
                }
                return Ok(Value::from(out));
            }
            ("zfill", 1) => {
                let width = usize::try_from(args[0].clone()).map_err(|_| bad("zfill takes an integer"))?;
                let (sign, digits) = match s.strip_prefix(['+', '-']) {
                    Some(rest) => (&s[..1], rest),
                    None => ("", s),
                };
                let pad = width.saturating_sub(s.chars().count());
                return Ok(Value::from(format!("{sign}{}{digits}", "0".repeat(pad))));
            }
            ("index", 1) => {
                let sub = arg_str(0).ok_or_else(|| bad("the substring must be a string"))?;
                let at = s.find(sub.as_str()).ok_or_else(|| bad("substring not found"))?;
                return Ok(Value::from(s[..at].chars().count()));
            }
            ("rsplit", 1..=2) if args.first().is_some_and(|a| a.as_str().is_some()) => {
                let sep = arg_str(0).filter(|p| !p.is_empty()).ok_or_else(|| bad("empty separator"))?;
                let most = match args.get(1) {
                    Some(n) => i64::try_from(n.clone()).map_err(|_| bad("maxsplit must be an integer"))?,
                    None => -1,
                };
                let mut parts: Vec<&str> = if most < 0 {
                    s.rsplit(sep.as_str()).collect()
                } else {
                    s.rsplitn(most as usize + 1, sep.as_str()).collect()
                };
                parts.reverse();
                return Ok(Value::from(parts.into_iter().map(Value::from).collect::<Vec<_>>()));
            }
            _ => {}
        }
    } else if value.kind() == minijinja::value::ValueKind::Seq && args.len() == 1 && matches!(method, "index" | "count")
    {
        let items = value.try_iter()?;
        if method == "count" {
            return Ok(Value::from(items.filter(|v| v == &args[0]).count()));
        }
        let mut items = items;
        return items.position(|v| v == args[0]).map(Value::from).ok_or_else(|| bad("the value is not in the list"));
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// transformers' `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
fn tojson(value: Value, args: Rest<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let mut opts = pyjson::JsonOptions::default();
    let mut positional = args.iter();
    let arg = |name: &str, pos: Option<&Value>| -> Result<Option<Value>, Error> {
        let kw: Option<Value> = kwargs.get(name)?;
        Ok(kw.or_else(|| pos.cloned()))
    };
    if let Some(v) = arg("ensure_ascii", positional.next())? {
        opts.ensure_ascii = v.is_true();
    }
    if let Some(v) = arg("indent", positional.next())? {
        opts.indent = pyjson::indent_from(&v)?;
    }
    if let Some(v) = arg("separators", positional.next())? {
        opts.separators = pyjson::separators_from(&v)?;
    }
    if let Some(v) = arg("sort_keys", positional.next())? {
        opts.sort_keys = v.is_true();
    }
    kwargs.assert_all_used()?;
    Ok(Value::from_safe_string(pyjson::dumps(&value, &opts)?))
}

impl ChatTemplate {
    /// origin: "--chat-template", "chat_template.jinja",
    /// "additional_chat_templates/tool_use.jinja", "tokenizer_config.json",
    /// "tokenizer_config.json:tool_use", "chat_template.json", "gguf"
    pub fn new(source: &str, origin: &str) -> Result<Self, String> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_unknown_method_callback(py_methods);
        env.set_formatter(pyjson::format_value);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime::strftime_now);
        env.add_filter("tojson", tojson);
        env.add_filter("string", pyjson::string_filter);
        filters::register(&mut env);
        env.add_template_owned(NAME, expand_generation_tags(source).into_owned())
            .map_err(|e| format!("chat template from {origin} does not parse: {e}"))?;
        let declared = env.get_template(NAME).map_err(|e| e.to_string())?.undeclared_variables(false);
        let digest = Sha256::digest(source.as_bytes());
        let hex: String = digest.iter().take(8).map(|b| format!("{b:02x}")).collect();
        Ok(Self {
            env,
            origin: origin.to_string(),
            hash: format!("sha256:{hex}"),
            declared,
            mentions_content: source.contains("content"),
            content_format: crate::content_format::ContentFormat::detect(source),
            source: source.to_string(),
        })
    }

    /// Whether the template reads the top-level variable `name` (`tools`, `documents`, a
    /// kwarg): a request field rendered through a variable the template never reads has no
    /// effect.
    pub fn reads(&self, name: &str) -> bool {
        self.declared.contains(name)
    }

    /// The message-content shape this template expects (detected from its text).
    pub fn content_format(&self) -> crate::content_format::ContentFormat {
        self.content_format
    }

    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// The template text (tool-call format detection reads it).
    pub fn source(&self) -> &str {
        &self.source
    }

    /// "sha256:" + first 16 hex chars of the template text's sha256
    pub fn hash(&self) -> &str {
        &self.hash
    }

    pub fn render(&self, input: &RenderInput) -> Result<Rendered, ApiError> {
        self.try_render(input).map_err(ApiError::from)
    }

    /// [`Self::render`], telling a template's `raise_exception` apart from other failures.
    pub fn try_render(&self, input: &RenderInput) -> Result<Rendered, RenderError> {
        let mut messages = alias_reasoning(input.messages);
        if let Some(specials) = input.special_texts {
            mark_special_texts(&mut messages, specials);
        }
        let continued = if input.continue_final_message { Some(self.mark_final_message(&mut messages)?) } else { None };

        let json = pyvalue::from_json;
        let mut ctx: BTreeMap<String, Value> = BTreeMap::new();
        // (a token the tokenizer lacks stays undefined, as in transformers)
        for (name, token) in input.special_tokens {
            ctx.insert(name.clone(), Value::from(token.as_str()));
        }
        let mut unused_kwargs = Vec::new();
        if let Some(kwargs) = input.kwargs {
            for (k, v) in kwargs {
                if RESERVED.contains(&k.as_str()) {
                    return Err(ApiError::invalid(
                        format!("chat_template_kwargs.{k}"),
                        format!("chat_template_kwargs may not set `{k}`; send it as a request field"),
                    )
                    .into());
                }
                if !self.declared.contains(k) {
                    unused_kwargs.push(k.clone());
                }
                ctx.insert(k.clone(), json(v));
            }
        }
        let tracked: Vec<Option<Arc<TrackedMessage>>> =
            messages.as_array().into_iter().flatten().map(TrackedMessage::new).collect();
        let listed = messages.as_array().into_iter().flatten().zip(&tracked);
        let message_values: Vec<Value> =
            listed.map(|(m, t)| t.as_ref().map_or_else(|| json(m), |t| Value::from_dyn_object(t.clone()))).collect();
        ctx.insert("messages".into(), Value::from_object(pyvalue::PyList(message_values)));
        ctx.insert("tools".into(), input.tools.map_or(Value::from(()), json));
        ctx.insert("documents".into(), input.documents.map_or(Value::from(()), json));
        // transformers renders continue_final_message with the prompt flag as given; both
        // set is rejected upstream (400), so this is the caller's flag.
        ctx.insert("add_generation_prompt".into(), Value::from(input.add_generation_prompt));

        let mut env = self.env.clone();
        env.set_fuel(input.fuel);
        let tmpl = env.get_template(NAME).map_err(template_error)?;
        // NOTE: minijinja panics on a few constructs it parses (a `{% break %}` inside a
        // `{% with %}` inside a loop, which `{% generation %}` becomes; a reversed slice,
        // `[::-1]`, of an empty list or string); the request gets a template error, and
        // nothing it holds outlives the render.
        let rendered = quietly_caught(|| tmpl.render(Value::from_iter(ctx)));
        let text = match rendered {
            Ok(r) => r.map_err(template_error)?,
            Err(_) => {
                return Err(ApiError::with_code(
                    "template_error",
                    Some("messages".into()),
                    format!(
                        "{ENGINE_FAILED}: it fails on a reversed slice (`[::-1]`) of an empty list or string, and on \
                         a loop's `break`/`continue` inside a `with` or `generation` block"
                    ),
                )
                .into())
            }
        };
        let text = match continued {
            Some(final_text) => cut_after_final_message(text, &final_text)?,
            None => text,
        };
        let (text, text_spans) = if input.special_texts.is_some() { unmark(&text) } else { (text, Vec::new()) };
        let unread_keys = tracked
            .iter()
            .enumerate()
            .filter_map(|(i, t)| Some((i, t.as_ref()?)))
            .flat_map(|(i, t)| t.unread().map(move |k| (i, k.to_string())))
            .collect();
        Ok(Rendered { text, unused_kwargs, unread_keys, text_spans })
    }

    /// Append transformers' tag to the final message's text; returns that text (untagged).
    fn mark_final_message(&self, messages: &mut Json) -> Result<String, ApiError> {
        let bad = |m: &str| ApiError::invalid("messages", m);
        let last = messages
            .as_array_mut()
            .and_then(|a| a.last_mut())
            .ok_or_else(|| bad("continue_final_message is set but the conversation is empty"))?;
        if !self.mentions_content {
            return Err(bad("continue_final_message is set but the chat template never reads `content`"));
        }
        match last.get_mut("content") {
            Some(Json::String(s)) => {
                let original = s.clone();
                s.push_str(CONTINUE_TAG);
                Ok(original)
            }
            Some(Json::Array(parts)) => {
                // The last part that has text, as transformers picks it.
                for part in parts.iter_mut().rev() {
                    if let Some(Json::String(s)) = part.get_mut("text") {
                        let original = s.clone();
                        s.push_str(CONTINUE_TAG);
                        return Ok(original);
                    }
                }
                Err(bad("continue_final_message is set but the final message has no text to continue"))
            }
            _ => Err(bad("continue_final_message is set but the final message has no content to continue")),
        }
    }
}

/// Cut the render right after the final message's text (where the tag landed).
fn cut_after_final_message(text: String, final_text: &str) -> Result<String, ApiError> {
    let tag = CONTINUE_TAG.trim();
    if !text.contains(final_text.trim()) || !text.contains(tag) {
        return Err(ApiError::invalid(
            "messages",
            "continue_final_message is set but the final message does not appear in the rendered chat; \
             the chat template drops or rewrites part of it",
        ));
    }
    let at = text.rfind(tag).expect("checked above");
    if text[at..].starts_with(CONTINUE_TAG) {
        Ok(text[..at].to_string())
    } else {
        // The template trimmed the message's trailing space, and the tag's with it.
        Ok(text[..at].trim_end().to_string())
    }
}

/// Around each special token's text in a message's text: where it lands in the render (a
/// pair of Unicode noncharacters, which are for a program's internal use). Only such text is
/// marked, so a render whose messages spell no special token is the template's own, byte for
/// byte.
const MARK_OPEN: char = '\u{FDD0}';
const MARK_CLOSE: char = '\u{FDD1}';

/// Mark the special tokens spelled in each message's text (`content`, its text parts, its
/// reasoning) for `unmark`. Marks a client sent are dropped first: they could pair around
/// a token the template wrote.
fn mark_special_texts(messages: &mut Json, specials: &aho_corasick::AhoCorasick) {
    let mark = |s: &mut String| {
        if s.contains([MARK_OPEN, MARK_CLOSE]) {
            s.retain(|c| c != MARK_OPEN && c != MARK_CLOSE);
        }
        if specials.is_match(s.as_str()) {
            let mut out = String::with_capacity(s.len() + 16);
            let mut last = 0;
            for m in specials.find_iter(s.as_str()) {
                out.push_str(&s[last..m.start()]);
                out.push(MARK_OPEN);
                out.push_str(&s[m.start()..m.end()]);
                out.push(MARK_CLOSE);
                last = m.end();
            }
            out.push_str(&s[last..]);
            *s = out;
        }
    };
    for message in messages.as_array_mut().into_iter().flatten() {
        let Some(obj) = message.as_object_mut() else { continue };
        for (key, value) in obj.iter_mut() {
            match (key.as_str(), value) {
                ("content" | "reasoning_content" | "thinking", Json::String(s)) => mark(s),
                ("content", Json::Array(parts)) => {
                    for part in parts {
                        if let Some(Json::String(s)) = part.get_mut("text") {
                            mark(s);
                        }
                    }
                }
                _ => {}
            }
        }
    }
}

/// The render without `mark_special_texts`' marks, and the byte range of each marked text
/// in it. A mark the template split from its pair (slicing the text) is dropped with no range.
fn unmark(marked: &str) -> (String, Vec<(usize, usize)>) {
    if !marked.contains([MARK_OPEN, MARK_CLOSE]) {
        return (marked.to_string(), Vec::new());
    }
    let mut text = String::with_capacity(marked.len());
    let mut spans = Vec::new();
    let mut open = None;
    for c in marked.chars() {
        match c {
            MARK_OPEN => open = Some(text.len()),
            MARK_CLOSE => {
                if let Some(start) = open.take() {
                    spans.push((start, text.len()));
                }
            }
            c => text.push(c),
        }
    }
    (text, spans)
}

/// transformers fills `reasoning_content` from older names for it, and `thinking` for
/// templates that read that, before rendering.
fn alias_reasoning(messages: &Json) -> Json {
    const FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];
    let Some(list) = messages.as_array() else { return messages.clone() };
    let out = list
        .iter()
        .map(|m| {
            let Some(obj) = m.as_object() else { return m.clone() };
            let Some(r) = FIELDS.iter().find_map(|f| obj.get(*f).filter(|v| !v.is_null())) else {
                return m.clone();
            };
            let mut new = serde_json::Map::new();
            new.insert("thinking".into(), r.clone());
            for (k, v) in obj {
                new.insert(k.clone(), v.clone());
            }
            new.insert("reasoning_content".into(), r.clone());
            Json::Object(new)
        })
        .collect();
    Json::Array(out)
}

thread_local! {
    /// Set while `quietly_caught` runs on this thread.
    static CATCHING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// How the error of a render the template engine itself failed in (a panic) begins.
const ENGINE_FAILED: &str = "chat template failed to render: the template engine (minijinja) failed inside it";

/// Whether `err` is a render the template engine itself failed in: not the template's answer
/// to these messages, so no other shape of them is tried (it would be another prompt).
pub fn engine_failed(err: &ApiError) -> bool {
    err.code() == "template_error" && err.message().starts_with(ENGINE_FAILED)
}

/// `f()` under `catch_unwind`, its panic not printed: the request gets an error that says what
/// failed, where the default hook would print a message (and with RUST_BACKTRACE a long
/// backtrace) for each such request. Other threads' panics, and this one's outside `f`, still
/// reach the hook that was installed before.
fn quietly_caught<T>(f: impl FnOnce() -> T) -> std::thread::Result<T> {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !CATCHING.with(std::cell::Cell::get) {
                previous(info);
            }
        }));
    });
    CATCHING.with(|c| c.set(true));
    let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    CATCHING.with(|c| c.set(false));
    out
}

/// Why a render gave no prompt: the template's own `raise_exception` (its refusal of what the
/// messages hold: a 400 with its words, as transformers raises it), or any other failure (the
/// template failed on them, or the request's flags do not fit it).
#[derive(Debug)]
pub enum RenderError {
    Raised(ApiError),
    Failed(ApiError),
}

impl From<ApiError> for RenderError {
    fn from(e: ApiError) -> Self {
        Self::Failed(e)
    }
}

impl From<RenderError> for ApiError {
    fn from(e: RenderError) -> Self {
        match e {
            RenderError::Raised(e) | RenderError::Failed(e) => e,
        }
    }
}

fn template_error(e: Error) -> RenderError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&e);
    while let Some(err) = source {
        if let Some(Raised(msg)) = err.downcast_ref::<Raised>() {
            return RenderError::Raised(ApiError::invalid("messages", msg.clone()));
        }
        source = err.source();
    }
    if e.kind() == ErrorKind::OutOfFuel {
        return ApiError::with_code(
            "template_error",
            Some("messages".into()),
            "chat template rendering exceeded its fuel limit",
        )
        .into();
    }
    // The template is the server's, but what it failed on is the request's messages.
    ApiError::with_code("template_error", Some("messages".into()), format!("chat template failed to render: {e}"))
        .into()
}

pub struct RenderInput<'a> {
    /// array of message objects, as sent
    pub messages: &'a serde_json::Value,
    /// array of tool objects as sent (rendered through the template's `tools`)
    pub tools: Option<&'a serde_json::Value>,
    pub documents: Option<&'a serde_json::Value>,
    pub add_generation_prompt: bool,
    pub continue_final_message: bool,
    /// chat_template_kwargs
    pub kwargs: Option<&'a serde_json::Map<String, serde_json::Value>>,
    /// The special tokens the template sees by name (`bos_token`, `eos_token`, `pad_token`, ...);
    /// `kwargs` override them.
    pub special_tokens: &'a BTreeMap<String, String>,
    pub fuel: Option<u64>,
    /// The texts of the special tokens that the messages' text spells as text, not as those
    /// tokens (`Rendered::text_spans` says where they landed); None: the tokenizer reads them
    /// as the tokens, as transformers does.
    pub special_texts: Option<&'a aho_corasick::AhoCorasick>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Rendered {
    pub text: String,
    /// chat_template_kwargs keys the template never reads
    pub unused_kwargs: Vec<String>,
    /// (message index, key) for each non-null message key this render never looked up
    pub unread_keys: Vec<(usize, String)>,
    /// Byte ranges of `text` where the messages' text spells a special token
    /// (`RenderInput::special_texts`): to be tokenized as text.
    pub text_spans: Vec<(usize, usize)>,
}

/// One message as the template sees it: a map that notes which of its keys the render
/// looks up (`m.name`, `m['name']`, `m.get('name')`, `'name' in m`). Walking the keys
/// (`m.items()`, `m|tojson`) reads them all. What the template's text names elsewhere (a
/// tool's `.name`) does not count, so a key that never reaches the prompt is found exactly.
#[derive(Debug)]
struct TrackedMessage {
    fields: Vec<(String, Value)>,
    read: Vec<AtomicBool>,
}

impl TrackedMessage {
    /// Keys whose value is null are left out, as transformers leaves them out (clients echo
    /// back `tool_calls: null`, which templates that test `is defined` cannot take).
    fn new(message: &Json) -> Option<Arc<Self>> {
        let fields: Vec<(String, Value)> = message
            .as_object()?
            .iter()
            .filter(|(_, v)| !v.is_null())
            .map(|(k, v)| (k.clone(), pyvalue::from_json(v)))
            .collect();
        let read = fields.iter().map(|_| AtomicBool::new(false)).collect();
        Some(Arc::new(Self { fields, read }))
    }

    /// The keys that were never looked up, but for those holding an empty list, which say
    /// nothing a prompt could lose (an echoed reply's `annotations: []`, `tool_calls: []`).
    fn unread(&self) -> impl Iterator<Item = &str> {
        self.fields
            .iter()
            .zip(&self.read)
            .filter(|((_, v), read)| !read.load(Ordering::Relaxed) && !is_empty_list(v))
            .map(|((k, _), _)| k.as_str())
    }
}

fn is_empty_list(v: &Value) -> bool {
    v.kind() == minijinja::value::ValueKind::Seq && v.len() == Some(0)
}

impl Object for TrackedMessage {
    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        let key = key.as_str()?;
        let at = self.fields.iter().position(|(k, _)| k == key)?;
        self.read[at].store(true, Ordering::Relaxed);
        Some(self.fields[at].1.clone())
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        for read in &self.read {
            read.store(true, Ordering::Relaxed);
        }
        Enumerator::Values(self.fields.iter().map(|(k, _)| Value::from(k.as_str())).collect())
    }

    /// `length` and truthiness without counting as reading every key.
    fn enumerator_len(self: &Arc<Self>) -> Option<usize> {
        Some(self.fields.len())
    }

    fn render(self: &Arc<Self>, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        pyvalue::write_repr(Value::from_dyn_object(self.clone()), f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tokens(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(name, token)| (name.to_string(), token.to_string())).collect()
    }

    fn render(tmpl: &str, messages: Json) -> Result<Rendered, ApiError> {
        render_with(tmpl, messages, None)
    }

    fn render_with(
        tmpl: &str,
        messages: Json,
        special_texts: Option<&aho_corasick::AhoCorasick>,
    ) -> Result<Rendered, ApiError> {
        let t = ChatTemplate::new(tmpl, "test").unwrap();
        t.render(&RenderInput {
            messages: &messages,
            tools: None,
            documents: None,
            add_generation_prompt: false,
            continue_final_message: false,
            kwargs: None,
            special_tokens: &tokens(&[("bos_token", "<s>"), ("eos_token", "</s>")]),
            fuel: Some(100_000),
            special_texts,
        })
    }

    #[test]
    fn special_tokens_spelled_in_messages_are_found_where_they_land() {
        let tmpl = "{% for m in messages %}<s>{{ m.content | trim }}</s>{% endfor %}{{ messages[0].thinking }}";
        let specials = aho_corasick::AhoCorasick::builder()
            .match_kind(aho_corasick::MatchKind::LeftmostLongest)
            .build(["<s>", "</s>"])
            .unwrap();
        let render = |messages: Json, specials| render_with(tmpl, messages, specials).unwrap();
        // (the edges' spaces are trimmed as without marks; a client's marks are dropped)
        let messages = json!([{"role": "user", "content": " </s>a<s> ", "reasoning_content": "\u{FDD0}</s>"},
                              {"role": "user", "content": "b\u{FDD1}"}]);
        let out = render(messages.clone(), Some(&specials));
        assert_eq!(out.text, "<s></s>a<s></s><s>b</s></s>");
        assert_eq!(out.text_spans, [(3, 7), (8, 11), (23, 27)]);
        let plain = render(messages, None);
        assert_eq!(plain.text, "<s></s>a<s></s><s>b\u{FDD1}</s>\u{FDD0}</s>");
        assert!(plain.text_spans.is_empty());
    }

    #[test]
    fn python_float_repr() {
        let cases = [
            (1.0, "1.0"),
            (2.5, "2.5"),
            (1e20, "1e+20"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (-3.25e-7, "-3.25e-07"),
            (123456789.125, "123456789.125"),
            (0.1, "0.1"),
            (-0.0, "-0.0"),
        ];
        for (f, want) in cases {
            assert_eq!(pyjson::float_repr(f), want, "{f}");
        }
    }

    #[test]
    fn prints_values_as_python() {
        let out =
            render("{{ true }} {{ none }} {{ [1, 'a', \"it's\"] }} {{ {'k': false} }} {{ 1.5 }} {{ x }}", json!([]))
                .unwrap();
        assert_eq!(out.text, "True None [1, 'a', \"it's\"] {'k': False} 1.5 ");
    }

    #[test]
    fn concat_and_join_print_the_request_values_as_python() {
        let msgs = json!([{"role": "user", "content": "hi", "args": {"a": 1.5, "b": [true, null, 1e20, "it's"]}}]);
        let t = "{{ 'X' ~ messages[0].args }}|{{ messages[0].args.b ~ 'Y' }}|{{ messages[0].args.b | join(',') }}|{{ 'M' ~ messages[0] }}";
        assert_eq!(
            render(t, msgs).unwrap().text,
            "X{'a': 1.5, 'b': [True, None, 1e+20, \"it's\"]}|[True, None, 1e+20, \"it's\"]Y|True,None,1e+20,it's|\
             M{'role': 'user', 'content': 'hi', 'args': {'a': 1.5, 'b': [True, None, 1e+20, \"it's\"]}}"
        );
    }

    #[test]
    fn int_float_replace_and_sequence_as_jinja2() {
        let t =
            "{{ 'x'|int }} {{ 'x'|int(7) }} {{ ' 3.7 '|int }} {{ '0x1A'|int(0, 16) }} {{ '1_0'|int }} {{ none|int }} \
                 {{ 'x'|float }} {{ '1e5'|float }} {{ 'aaa'|replace('a', 'b', 2) }} {{ 'ab'|replace('', '-') }} \
                 {{ 'a' is sequence }} {{ {} is sequence }} {{ 1 is sequence }} {{ none is iterable }}";
        assert_eq!(render(t, json!([])).unwrap().text, "0 7 3 26 10 0 0.0 100000.0 bba -a-b- True True False False");
    }

    #[test]
    fn repr_escapes_what_python_cannot_print() {
        // (the characters themselves in the template's string literals)
        let t = "{{ ['a\u{a0}b', '\u{1F468}\u{200d}\u{1F469}', '\x00\x7f\u{85}', '\u{e000}\u{10ffff}', 'é\u{378}'] }}";
        assert_eq!(
            render(t, json!([])).unwrap().text,
            r"['a\xa0b', '👨\u200d👩', '\x00\x7f\x85', '\ue000\U0010ffff', 'é\u0378']"
        );
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let msgs = json!([{"b": [1, 2.0, {}], "a": "é\"\n\u{1F600}"}]);
        let t = "{{ messages[0] | tojson }}|{{ messages[0] | tojson(sort_keys=true, separators=(',', ':')) }}|{{ messages[0].a | tojson(ensure_ascii=true) }}|{{ messages[0].b | tojson(indent=1) }}";
        let out = render(t, msgs).unwrap();
        assert_eq!(
            out.text,
            "{\"b\": [1, 2.0, {}], \"a\": \"é\\\"\\n\u{1F600}\"}|{\"a\":\"é\\\"\\n\u{1F600}\",\"b\":[1,2.0,{}]}|\"\\u00e9\\\"\\n\\ud83d\\ude00\"|[\n 1,\n 2.0,\n {}\n]"
        );
    }

    #[test]
    fn trims_blocks_and_drops_trailing_newline() {
        let t = "{% for m in messages %}\n  {% if m.role %}\n{{ m.role }}\n  {% endif %}\n{% endfor %}\n";
        let out = render(t, json!([{"role": "user"}, {"role": "assistant"}])).unwrap();
        assert_eq!(out.text, "user\nassistant\n");
    }

    #[test]
    fn filters_and_methods_read_as_jinja2_and_python_do() {
        let text = |t: &str| {
            render(t, json!([{"role": "user", "content": "a"}])).unwrap_or_else(|e| panic!("{t}: {e:?}")).text
        };
        // an undefined value has no length (Jinja2's Undefined), as a message without calls
        assert_eq!(text("{{ messages[0].tool_calls|length }} {{ nope|count }}"), "0 0");
        // Python's round: ties to even on the exact binary value; floor and ceil
        assert_eq!(
            text("{{ 2.5|round }} {{ 0.5|round }} {{ 2.675|round(2) }} {{ 2.7|round(0, 'floor') }}"),
            "2.0 0.0 2.67 2.0"
        );
        assert_eq!(text("{{ 1234|round(-2) }} {{ 2.1|round(method='ceil') }}"), "1200.0 3.0");
        // Jinja2's title filter splits words at spaces and brackets; Python's str.title() at
        // anything uncased
        assert_eq!(text("{{ \"what's 4th\"|title }}|{{ '4th 3.14continue'.title() }}"), "What's 4th|4Th 3.14Continue");
        assert_eq!(text("{{ 'one two_three, four'|wordcount }}"), "3");
        // (each expected text is Jinja2 3.1's render of the same template)
        let centred = format!("   ab  | abc  |{}x{}|", " ".repeat(39), " ".repeat(40));
        assert_eq!(text("{{ 'ab'|center(7) }}|{{ 'abc'|center(6) }}|{{ 'x'|center }}|"), centred);
        assert_eq!(
            text("{{ 'ab'.ljust(5, '*') }}|{{ 'ab'.rjust(5) }}|{{ 'abc'.center(6, '-') }}|{{ 'ab'.center(7, '.') }}|{{ 'toolong'.center(3) }}"),
            "ab***|   ab|-abc--|...ab..|toolong"
        );
        assert_eq!(text("{{ 'Hello ÄÖ ß'.swapcase() }}"), "hELLO äö SS");
        assert_eq!(text("{{ '<b>bold</b>  and <i>it</i>'|striptags }}"), "bold and it");
        assert_eq!(
            text("{{ 'a b c d e f g h i j k l m n o p'|truncate(9) }}|{{ 'hello world foo'|truncate(11, True) }}|{{ 'short'|truncate(20) }}"),
            "a b c...|hello world foo|short"
        );
        assert_eq!(
            text("{{ 1000|filesizeformat }}|{{ 123456789|filesizeformat }}|{{ 1024|filesizeformat(true) }}"),
            "1.0 kB|123.5 MB|1.0 KiB"
        );
        assert_eq!(
            text("{{ 'a b&c/d?é'|urlencode }}|{{ {'q': 'x y', 'n': 1}|urlencode }}"),
            "a%20b%26c/d%3F%C3%A9|q=x+y&n=1"
        );
        assert_eq!(
            text("{% set c = cycler('a','b') %}{% for i in range(3) %}{{ c.next() }}{% endfor %}|{% set j = joiner(', ') %}{% for i in range(3) %}{{ j() }}{{ i }}{% endfor %}"),
            "aba|0, 1, 2"
        );
        assert!(render("{{ 'ab'.center(5, '--') }}", json!([])).is_err());
        // Jinja2's max/min: case-insensitive unless asked, by attribute, the first of equals
        assert_eq!(
            text("{{ ['b','A','a','C']|max }}|{{ ['b','A','a','C']|min }}|{{ ['b','A','a','C']|max(true) }}|{{ ['b','A','a','C']|min(case_sensitive=true) }}"),
            "C|A|b|A"
        );
        assert_eq!(
            text("{{ ([{'n': 2, 'k': 'x'}, {'n': 5, 'k': 'y'}, {'n': 5, 'k': 'z'}]|max(attribute='n')).k }}|{{ [[1, 'b'], [0, 'c']]|max(attribute='1') }}|{{ []|max is undefined }}|{{ [3, 1.5, 2]|min }}"),
            "y|[0, 'c']|True|1.5"
        );
        assert_eq!(
            text("<x{{ {'id': 'a&b', 'title': '\"q\" <t>', 'n': none, 'on': true, 'l': [1, 'x']}|xmlattr }}>|<y{{ {'a': 1}|xmlattr(false) }}>|<z{{ {}|xmlattr }}>"),
            "<x id=\"a&amp;b\" title=\"&#34;q&#34; &lt;t&gt;\" on=\"True\" l=\"[1, &#39;x&#39;]\">|<ya=\"1\">|<z>"
        );
        for refused in ["{{ {'a b': 1}|xmlattr }}", "{{ none|max }}", "{{ {1: 2}|xmlattr }}"] {
            assert!(render(refused, json!([])).is_err(), "{refused}");
        }
    }

    #[test]
    fn loop_controls_and_pycompat_methods() {
        let t = "{% for m in messages %}{% if loop.index0 == 1 %}{% continue %}{% endif %}{% if loop.index0 > 2 %}{% break %}{% endif %}{{ m.content.strip().upper() }}{% for k, v in m.items() %}{{ k }}{% endfor %};{% endfor %}";
        let msgs = json!([{"content": " a "}, {"content": "b"}, {"content": "c"}, {"content": "d"}]);
        assert_eq!(render(t, msgs).unwrap().text, "Acontent;Ccontent;");
    }

    #[test]
    fn raise_exception_is_a_400_on_messages() {
        let err = render("{{ raise_exception('roles must alternate') }}", json!([])).unwrap_err();
        assert_eq!(err, ApiError::invalid("messages", "roles must alternate"));
    }

    #[test]
    fn what_the_template_reads() {
        let t = ChatTemplate::new("{% if tools %}T{% endif %}{% for m in messages %}{{ m.role }}{% endfor %}", "test")
            .unwrap();
        assert!(t.reads("tools") && t.reads("messages") && !t.reads("documents"));

        // Message keys count as read when the render looks them up, whatever the text names
        // elsewhere (a tool's `.name` is not the message's).
        let messages = json!([
            {"role": "user", "content": "a", "name": "ann", "weight": 1, "extra": null},
            {"role": "tool", "content": "b", "name": "fn", "tool_call_id": "c1", "annotations": []},
        ]);
        let unread = |tmpl: &str| render(tmpl, messages.clone()).unwrap().unread_keys;
        let keys = |list: &[(usize, &str)]| list.iter().map(|&(i, k)| (i, k.to_string())).collect::<Vec<_>>();
        let by_role = "{% for m in messages %}{{ m.role }}{% if m.role == 'tool' %}{{ m.name }}{% endif %}\
                       {{ m['content'] }}{% endfor %}{% for t in tools or [] %}{{ t.function.name }}{% endfor %}";
        assert_eq!(unread(by_role), keys(&[(0, "name"), (0, "weight"), (1, "tool_call_id")]));
        let by_get = "{% for m in messages %}{{ m.get('content') }}{{ m.role }}{{ m.weight is defined }}\
                      {{ 'tool_call_id' in m }}{{ m|length }}{% if m %}{% endif %}{% endfor %}";
        assert_eq!(unread(by_get), keys(&[(0, "name"), (1, "name")]));
        assert_eq!(unread("{% for m in messages %}{{ m|tojson }}{% endfor %}"), keys(&[]));
        // a null value is no key at all, as transformers renders it
        let t = "{% for m in messages %}{% if m.tool_calls is defined %}{{ m.tool_calls|length }}{% endif %}\
                 {{ m.extra is defined }}{% endfor %}";
        let calls_null = json!([{"role": "assistant", "content": "a", "tool_calls": null, "extra": null}]);
        assert_eq!(render(t, calls_null).unwrap().text, "False");
        assert_eq!(unread("{% for m in messages %}{% for k, v in m.items() %}{% endfor %}{% endfor %}"), keys(&[]));
        // a message the template never reaches has every key unread (null ones and empty lists aside)
        let last = "{{ messages[-1].content }}{{ messages[-1].role }}";
        assert_eq!(
            unread(last),
            keys(&[(0, "role"), (0, "content"), (0, "name"), (0, "weight"), (1, "name"), (1, "tool_call_id")])
        );
    }

    #[test]
    fn broken_templates_and_fuel() {
        assert!(ChatTemplate::new("{% for %}", "test").is_err());
        let err = render("{{ messages.nope() }}", json!([])).unwrap_err();
        assert_eq!(err.code(), "template_error");
        assert_eq!(err.param(), Some("messages"));
        let err =
            render("{% for i in range(10000) %}{% for j in range(10000) %}{{ j }}{% endfor %}{% endfor %}", json!([]))
                .unwrap_err();
        assert_eq!(err.code(), "template_error");
        assert!(err.message().contains("fuel"), "{err}");
    }

    #[test]
    fn kwargs_reach_the_template_and_unused_ones_are_reported() {
        let t = ChatTemplate::new("{{ greeting }} {{ bos_token }}", "test").unwrap();
        let msgs = json!([]);
        let kwargs = json!({"greeting": "hi", "bos_token": "<B>", "extra": 1});
        let mut input = RenderInput {
            messages: &msgs,
            tools: None,
            documents: None,
            add_generation_prompt: false,
            continue_final_message: false,
            kwargs: kwargs.as_object(),
            special_tokens: &tokens(&[("bos_token", "<s>")]),
            fuel: None,
            special_texts: None,
        };
        let out = t.render(&input).unwrap();
        assert_eq!(out.text, "hi <B>");
        assert_eq!(out.unused_kwargs, vec!["extra".to_string()]);
        let bad = json!({"messages": []});
        input.kwargs = bad.as_object();
        assert_eq!(t.render(&input).unwrap_err().param(), Some("chat_template_kwargs.messages"));
    }

    #[test]
    fn continue_final_message_cuts_after_the_final_text() {
        let tmpl = "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>\n{% endfor %}";
        let t = ChatTemplate::new(tmpl, "test").unwrap();
        let msgs = json!([{"role": "user", "content": "q"}, {"role": "assistant", "content": "partial ans "}]);
        let out = t
            .render(&RenderInput {
                messages: &msgs,
                tools: None,
                documents: None,
                add_generation_prompt: false,
                continue_final_message: true,
                kwargs: None,
                special_tokens: &BTreeMap::new(),
                fuel: None,
                special_texts: None,
            })
            .unwrap();
        // trim ate the message's trailing space and the tag's: cut, then rstrip, as transformers.
        assert_eq!(out.text, "<user>q</user>\n<assistant>partial ans");
        let empty = json!([]);
        let err = t
            .render(&RenderInput {
                messages: &empty,
                tools: None,
                documents: None,
                add_generation_prompt: false,
                continue_final_message: true,
                kwargs: None,
                special_tokens: &BTreeMap::new(),
                fuel: None,
                special_texts: None,
            })
            .unwrap_err();
        assert_eq!(err.param(), Some("messages"));
    }

    #[test]
    fn resolution_order_and_named_templates() {
        let named = json!([{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]);
        let set = TemplateSet::resolve(TemplateSources {
            tokenizer_config: Some(named.clone()),
            gguf: Some("G".into()),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(set.select(false).unwrap().origin(), "tokenizer_config.json");
        assert_eq!(set.select(true).unwrap().origin(), "tokenizer_config.json:tool_use");
        // a processor-style repo's chat_template.json is named as the file it came from
        let set = TemplateSet::resolve(TemplateSources {
            tokenizer_config: Some(named),
            tokenizer_config_file: Some("chat_template.json".into()),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(set.select(true).unwrap().origin(), "chat_template.json:tool_use");
        // transformers' saved layout: chat_template.jinja, and the named ones beside it
        let folder_named = [("tool_use".to_string(), "T".to_string())].into_iter().collect();
        let set = TemplateSet::resolve(TemplateSources {
            folder_jinja: Some("F".into()),
            folder_named,
            tokenizer_config: Some(json!("X")),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(set.select(false).unwrap().origin(), "chat_template.jinja");
        assert_eq!(set.select(true).unwrap().origin(), "additional_chat_templates/tool_use.jinja");
        assert_eq!(set.names(), ["default", "tool_use"]);

        let set = TemplateSet::resolve(TemplateSources { gguf: Some("G".into()), ..Default::default() }).unwrap();
        assert_eq!(set.select(true).unwrap().origin(), "gguf");
        let set = TemplateSet::resolve(TemplateSources {
            cli: Some("C".into()),
            folder_jinja: Some("F".into()),
            gguf: Some("G".into()),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(set.select(false).unwrap().origin(), "--chat-template");
        let set = TemplateSet::resolve(TemplateSources {
            folder_jinja: Some("F".into()),
            gguf: Some("G".into()),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(set.select(false).unwrap().origin(), "chat_template.jinja");
        assert!(TemplateSet::resolve(TemplateSources::default()).unwrap().is_empty());
    }

    #[test]
    fn generation_tags_become_with_blocks_and_nothing_else_changes() {
        let src = "{% generation %}a{%- endgeneration -%}{%+ generation +%}{{ 'generation' }}{% endgeneration %}\
                   {% if x %}{# {% generation %} #}{% endif %}{% raw_generation %}{{ '{% generation %}' }}\
                   {% raw %}{% generation %}{% endraw %}{# a stray {% #}{% generation %}{% endgeneration %}\
                   {% set s = \"%}{% generation %}\" %}{{ é }}";
        assert_eq!(
            expand_generation_tags(src),
            "{% with %}a{%- endwith -%}{%+ with +%}{{ 'generation' }}{% endwith %}\
             {% if x %}{# {% generation %} #}{% endif %}{% raw_generation %}{{ '{% generation %}' }}\
             {% raw %}{% generation %}{% endraw %}{# a stray {% #}{% with %}{% endwith %}\
             {% set s = \"%}{% generation %}\" %}{{ é }}"
        );
        assert!(matches!(expand_generation_tags("{{ x }}"), std::borrow::Cow::Borrowed(_)));
    }

    #[test]
    fn strftime_now_passes_unknown_directives_through() {
        let out = render("{{ strftime_now('%Y %Q %') | length }}", json!([{"role": "user", "content": "hi"}]));
        assert_eq!(out.unwrap().text, "9");
    }

    #[test]
    fn python_methods_that_fail_in_python_fail_here() {
        for tmpl in ["{{ 'abc'.index('z') }}", "{{ [1].index(2) }}", "{{ 'a'.partition('') }}"] {
            assert!(render(tmpl, json!([])).is_err(), "{tmpl}");
        }
        assert_eq!(render("{{ 'a.b.c'.rsplit('.', 1) | join('|') }}", json!([])).unwrap().text, "a.b|c");
    }

    #[test]
    fn a_loop_control_in_a_generation_block_is_a_template_error_not_a_panic() {
        // (minijinja panics on `break` inside `with` inside a loop; A68-2)
        let tmpl = "{% for m in messages %}{% generation %}{{ m.content }}{% break %}{% endgeneration %}{% endfor %}";
        let msgs = json!([{"role": "user", "content": "hi"}, {"role": "user", "content": "yo"}]);
        let err = render(tmpl, msgs.clone()).unwrap_err();
        assert_eq!(err.code(), "template_error");
        assert_eq!(render("{% for m in messages %}{{ m.content }}{% endfor %}", msgs).unwrap().text, "hiyo");
    }

    #[test]
    fn lists_a_template_makes_print_as_python() {
        // slices and `+` are lazy sequences in minijinja; Python prints them as lists (A68-1)
        let tmpl = "{% set ns = namespace(l=['b']) %}{% set ns.l = ns.l + ['a', 1e20] %}{{ ns.l }} \
                    {{ messages[1:] | map(attribute='content') | list }} {{ [1, 2][:1] | string }}";
        let msgs = json!([{"role": "user", "content": "hi"}, {"role": "user", "content": "yo"}]);
        assert_eq!(render(tmpl, msgs).unwrap().text, "['b', 'a', 1e+20] ['yo'] [1]");
    }

    #[test]
    fn hash_is_sha256_prefix() {
        let t = ChatTemplate::new("abc", "test").unwrap();
        // sha256("abc") = ba7816bf8f01cfea...
        assert_eq!(t.hash(), "sha256:ba7816bf8f01cfea");
    }
}
