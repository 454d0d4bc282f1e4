//! What chat and completions share: reading the body, serde errors as `ApiError`s with
//! field paths, the sampling/stopping fields and their defaults, and ignored-field reporting.

use std::borrow::Cow;
use std::collections::BTreeMap;

use serde::de::{DeserializeOwned, IgnoredAny};
use serde::Deserialize;
use serde_json::{Map, Value};

use super::{BeamSearch, SamplingParams};
use crate::error::ApiError;
use crate::repetition::RepetitionDetection;
use crate::router::RouterConfig;
use crate::tokenizer::Tokenizer;

/// Largest `n` accepted: more choices than this per prompt is almost surely a mistake and
/// would let one request occupy the whole batch.
pub const MAX_N: u32 = 128;

/// The `param` of errors about the body as a whole (malformed JSON, not an object): the
/// contract sets `param` on every 400 of that table row, and no field path names the body.
pub const BODY_PARAM: &str = "body";

/// The body without a leading UTF-8 byte order mark, which RFC 8259 (8.1) lets a parser
/// ignore, and Python's `json.loads` (vLLM's parser) does: files written by some Windows
/// tools and sent as they are begin with one.
pub fn without_bom(body: &[u8]) -> &[u8] {
    body.strip_prefix(b"\xef\xbb\xbf").unwrap_or(body)
}

/// Parses the raw body: malformed JSON is `invalid_json`, anything but an object is
/// `invalid_type`; both name `param` "body".
pub fn parse_body(body: &[u8]) -> Result<Value, ApiError> {
    let value: Value = serde_json::from_slice(without_bom(body)).map_err(|e| {
        // serde_json names a lone UTF-16 surrogate (`"\ud800"` with no partner) by what it
        // found after it; say what is wrong instead.
        let msg = e.to_string();
        // (serde_json's depth limit: valid JSON, but more than this server reads)
        let message = if msg.starts_with("recursion limit exceeded") {
            format!("The request body nests JSON 128 levels deep or more, which this server does not read ({msg}).")
        } else if msg.contains("hex escape") || msg.contains("surrogate") {
            format!(
                "The request body is not valid JSON: a \\u escape is not a character (a lone UTF-16 surrogate, \
                 \\ud800-\\udfff, has no text) ({msg})."
            )
        } else {
            format!("The request body is not valid JSON: {msg}.")
        };
        ApiError::with_code("invalid_json", Some(BODY_PARAM.into()), message)
    })?;
    if !value.is_object() {
        return Err(ApiError::with_code(
            "invalid_type",
            Some(BODY_PARAM.into()),
            format!("The request body must be a JSON object, not {}.", kind_of(&value)),
        ));
    }
    Ok(value)
}

/// Fills a typed struct from the body, turning serde's error into a 400 whose `param` is the
/// field path: `missing_required_parameter`, `invalid_type` or `invalid_value`.
pub fn from_value<T: DeserializeOwned>(value: &Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let path = if path == "." { String::new() } else { path };
        let inner = e.inner().to_string();
        if let Some(field) = inner.strip_prefix("missing field `").and_then(|s| s.strip_suffix('`')) {
            let param = join_path(&path, field);
            return ApiError::with_code(
                "missing_required_parameter",
                Some(param.clone()),
                format!("Missing required parameter: `{param}`."),
            );
        }
        let param = if path.is_empty() { None } else { Some(path) };
        let name = param.as_deref().unwrap_or("the request body");
        if let Some((code, what)) = integer_out_of_range(&inner, param.as_deref()) {
            return ApiError::with_code(code, param.clone(), format!("`{name}` must be {what}."));
        }
        let code = if inner.starts_with("invalid type") { "invalid_type" } else { "invalid_value" };
        let what = if code == "invalid_type" { "Invalid type" } else { "Invalid value" };
        ApiError::with_code(code, param.clone(), format!("{what} for `{name}`: {}.", plain_serde(&inner)))
    })
}

/// An integer field sent a whole number it cannot take: one it cannot hold (`1e30`, or
/// `10**30`, which JSON parsing turns into a float): "an integer that fits in 32 bits, got
/// 1e30"; or one written as a decimal (`2.0`), which OpenAI rejects too: "an integer,
/// not a decimal number, got 2.0" (a type error, as a fraction is). Returns the error code
/// and what the field must be.
fn integer_out_of_range(inner: &str, param: Option<&str>) -> Option<(&'static str, String)> {
    const RANGES: [(&str, &str, f64, f64); 4] = [
        ("u32", "between 0 and 4294967295", 0.0, 4294967295.0),
        ("u64", "between 0 and 18446744073709551615", 0.0, 18446744073709551615.0),
        ("i32", "between -2147483648 and 2147483647", -2147483648.0, 2147483647.0),
        ("i64", "between -9223372036854775808 and 9223372036854775807", -9223372036854775808.0, 9223372036854775807.0),
    ];
    let (head, (ty, range, lo, hi)) =
        RANGES.iter().find_map(|r| inner.strip_suffix(&format!("`, expected {}", r.0)).map(|h| (h, r)))?;
    // A 64-bit field's bounds round to +-2^63 or 2^64 as floats: an integer just past one
    // (-2^63 - 1, which JSON parsing turns into a float) lands on it, so there a float on a
    // nonzero bound is out of range, not a decimal number.
    let inside = |x: f64| if ty.ends_with("64") { x < *hi && (x > *lo || x == 0.0) } else { x >= *lo && x <= *hi };
    let (whole, got) = if let Some(f) = head.strip_prefix("invalid type: floating point `") {
        let x = f.parse::<f64>().ok().filter(|x| x.is_finite() && x.fract() == 0.0);
        if x.is_some_and(inside) {
            return Some(("invalid_type", format!("an integer, not a decimal number, got {f}")));
        }
        (x.is_some(), f)
    } else if let Some(i) = head.strip_prefix("invalid value: integer `") {
        (true, i)
    } else {
        return None;
    };
    // An unsigned field: its own bounds (max_tokens >= 1, n <= 128, ...) are checked later,
    // so name only what is certain, the side the value is out of, or the field's own lower
    // bound where it starts above 0 (`n: -1` is not told 0 would do).
    if range.starts_with("between 0 and ") && whole {
        let bits = if *hi > f64::from(u32::MAX) { 64 } else { 32 };
        let what = if got.starts_with('-') {
            match param {
                Some("n") => format!("between 1 and {MAX_N}"),
                // (the one route where 0 also does, completions with `echo`, says so when 0
                // is sent: `CommonFields::resolve`)
                Some("max_tokens" | "max_completion_tokens") => "at least 1".to_string(),
                _ => "a non-negative integer".to_string(),
            }
        } else {
            format!("an integer that fits in {bits} bits")
        };
        return Some(("invalid_value", format!("{what}, got {got}")));
    }
    whole.then(|| ("invalid_value", format!("an integer {range}, got {got}")))
}

fn join_path(parent: &str, field: &str) -> String {
    if parent.is_empty() {
        field.to_string()
    } else {
        format!("{parent}.{field}")
    }
}

/// Serde names Rust types ("expected u32"); clients think in JSON.
fn plain_serde(msg: &str) -> String {
    const NAMES: [(&str, &str); 10] = [
        ("expected u32", "expected a non-negative integer that fits in 32 bits"),
        ("expected u64", "expected a non-negative integer"),
        ("expected i32", "expected an integer that fits in 32 bits"),
        ("expected i64", "expected an integer"),
        ("expected f64", "expected a number"),
        ("expected f32", "expected a number"),
        ("expected a sequence", "expected an array"),
        ("expected a map", "expected an object"),
        ("expected struct StreamOptions", "expected an object"),
        ("expected a boolean", "expected a boolean (true or false)"),
    ];
    for (rust, json) in NAMES {
        if let Some(head) = msg.strip_suffix(rust) {
            return format!("{head}{json}");
        }
    }
    msg.to_string()
}

/// A short JSON type name for messages.
pub fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// OpenAI's `metadata` (chat's and Responses'): string values, at most 16 pairs, keys up to 64
/// characters and values up to 512, as OpenAI refuses others (though it does nothing here).
pub fn check_metadata(m: &Map<String, Value>) -> Result<(), ApiError> {
    if let Some((k, v)) = m.iter().find(|(_, v)| !v.is_string()) {
        return Err(invalid_type(
            format!("metadata.{k}"),
            format!("Metadata values must be strings, not {}.", kind_of(v)),
        ));
    }
    if m.len() > 16 {
        return Err(ApiError::invalid("metadata", format!("`metadata` holds at most 16 pairs, got {}.", m.len())));
    }
    let long = |s: &str, most: usize| s.chars().count() > most;
    if let Some((k, _)) = m.iter().find(|(k, v)| long(k, 64) || v.as_str().is_some_and(|v| long(v, 512))) {
        return Err(ApiError::invalid(
            format!("metadata.{k}"),
            "Metadata keys are at most 64 characters and values at most 512.",
        ));
    }
    Ok(())
}

pub fn invalid_type(param: impl Into<String>, message: impl Into<String>) -> ApiError {
    ApiError::with_code("invalid_type", Some(param.into()), message)
}

/// `v` as an object, or `invalid_type` at `param`: "{what} must be an object, not a string."
/// The value of `key` unless it is absent or null.
pub(crate) fn set<'a>(obj: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

pub fn as_object<'a>(v: &'a Value, param: impl Into<String>, what: &str) -> Result<&'a Map<String, Value>, ApiError> {
    v.as_object().ok_or_else(|| invalid_type(param, format!("{what} must be an object, not {}.", kind_of(v))))
}

pub fn unsupported(param: impl Into<String>, message: impl Into<String>) -> ApiError {
    ApiError::with_code("unsupported_parameter", Some(param.into()), message)
}

#[derive(Deserialize, Debug, Default)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
    pub continuous_usage_stats: Option<bool>,
    #[serde(flatten)]
    pub extra: BTreeMap<String, Value>,
}

impl StreamOptions {
    /// Keys that ask for something this server does not do: unknown ones that are set, and
    /// OpenAI's `include_obfuscation` unless false (streams are never obfuscated, so false
    /// is what every stream gets).
    fn ignored(&self) -> impl Iterator<Item = String> + '_ {
        self.extra
            .iter()
            .filter(|(k, v)| {
                let asks_nothing = v.is_null() || (k.as_str() == "include_obfuscation" && **v == Value::Bool(false));
                !asks_nothing
            })
            .map(|(k, _)| format!("stream_options.{k}"))
    }
}

/// The fields chat and completions share (OpenAI's and the top-level extensions).
/// `extra` collects the keys this struct does not know; a key is unknown to the request
/// when neither this struct nor the endpoint's own struct knows it.
#[derive(Deserialize, Debug)]
pub struct CommonFields {
    pub model: String,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub max_tokens: Option<u32>,
    pub max_completion_tokens: Option<u32>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub n: Option<u32>,
    pub seed: Option<Value>,
    pub stop: Option<Value>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub min_tokens: Option<u32>,
    pub ignore_eos: Option<bool>,
    pub include_stop_str_in_output: Option<bool>,
    pub skip_special_tokens: Option<bool>,
    pub logit_bias: Option<BTreeMap<String, f64>>,
    /// vLLM's: words whose tokens are never generated in that order.
    pub bad_words: Option<Value>,
    /// vLLM's: `{max_pattern_size, min_pattern_size, min_count}`
    pub repetition_detection: Option<Value>,
    /// vLLM's: the only tokens that may be generated.
    pub allowed_token_ids: Option<Vec<u32>>,
    /// vLLM's: beam search over `n` beams instead of sampling.
    pub use_beam_search: Option<bool>,
    /// vLLM's: the exponent of the length a beam's cumulative logprob is divided by when the
    /// beams are ranked (beam search only).
    pub length_penalty: Option<f64>,
    pub response_format: Option<Value>,
    /// vLLM's `structured_outputs`, and the `guided_*` fields it replaced (constrained.rs).
    pub structured_outputs: Option<Value>,
    pub guided_json: Option<Value>,
    pub guided_regex: Option<Value>,
    pub guided_choice: Option<Value>,
    pub guided_grammar: Option<Value>,
    pub guided_decoding_backend: Option<Value>,
    pub guided_whitespace_pattern: Option<Value>,
    pub priority: Option<i32>,
    pub request_id: Option<String>,
    pub cache_salt: Option<String>,
    pub user: Option<String>,
    /// vLLM's: the tokenizer's special tokens on the prompt (completions default true, chat
    /// false: the template writes them).
    pub add_special_tokens: Option<bool>,
    /// vLLM's: keep only the prompt's last k tokens (-1: `max_model_len`).
    pub truncate_prompt_tokens: Option<i64>,
    /// vLLM's: the prompt's token ids and each choice's sampled ids in the response.
    pub return_token_ids: Option<bool>,
    /// vLLM's: logprobs name tokens `token_id:<id>` instead of their text.
    pub return_tokens_as_token_ids: Option<bool>,
    /// vLLM's: each prompt token's logprob and this many alternatives.
    pub prompt_logprobs: Option<i64>,
    // Accepted without effect; reported in `llmserve-ignored-fields`.
    pub store: Option<bool>,
    pub metadata: Option<Map<String, Value>>,
    pub service_tier: Option<String>,
    #[serde(flatten)]
    pub extra: BTreeMap<String, IgnoredAny>,
}

/// The resolved common part of a generation request.
pub struct Common {
    pub model: String,
    pub params: SamplingParams,
    /// Which field `max_tokens` came from ("max_tokens" / "max_completion_tokens"), when the
    /// request set it: the context check names it.
    pub max_tokens_param: Option<&'static str>,
    pub stream: bool,
    pub include_usage: bool,
    pub continuous_usage_stats: bool,
    pub priority: i32,
    pub request_id: Option<String>,
    pub cache_salt: Option<String>,
    pub user: Option<String>,
    /// `add_special_tokens` as sent (the default differs per endpoint).
    pub add_special_tokens: Option<bool>,
    /// How many of a prompt's last tokens to keep, if it is to be cut.
    pub truncate_prompt_tokens: Option<usize>,
    pub return_token_ids: bool,
    pub tokens_as_ids: bool,
    /// vLLM's `prompt_logprobs`: alternatives per prompt token, when sent.
    pub prompt_logprobs: Option<u32>,
    /// Inert fields that were sent (store, metadata, service_tier, stream_options.*).
    pub inert: Vec<String>,
    /// What `response_format` (or `structured_outputs`, or a `guided_*` field) constrains the
    /// output to (None: free text), and the param path of the source (for compile errors).
    pub constraint: Option<(crate::structured::GrammarSource, &'static str)>,
}

fn ranged(param: &str, v: Option<f64>, lo: f64, hi: f64) -> Result<Option<f32>, ApiError> {
    match v {
        None => Ok(None),
        Some(x) if x >= lo && x <= hi => Ok(Some(x as f32)),
        Some(x) => Err(ApiError::invalid(param, format!("`{param}` must be between {lo} and {hi}, got {x}."))),
    }
}

impl CommonFields {
    /// Validates and resolves defaults. `logprobs` is left None: its shape differs per
    /// endpoint.
    /// `echo`: the route's `echo` (None where it has none). With `echo`, `max_tokens: 0` is
    /// allowed: completions then return the prompt alone, as vLLM does for prompt scoring.
    pub fn resolve(self, config: &RouterConfig, tokenizer: &Tokenizer, echo: Option<bool>) -> Result<Common, ApiError> {
        let prompt_only_ok = echo == Some(true);
        let vocab_size = tokenizer.vocab_size();
        let d = &config.generation_defaults;
        let stream = self.stream.unwrap_or(false);
        let mut inert = Vec::new();
        let beam_search = beam_search(&self, vocab_size, &mut inert)?;
        let (include_usage, continuous_usage_stats) = match self.stream_options {
            None => (stream && config.force_include_usage, false),
            Some(_) if !stream => {
                return Err(ApiError::invalid(
                    "stream_options",
                    "`stream_options` is only allowed when `stream` is true.",
                ))
            }
            Some(o) => {
                inert.extend(o.ignored());
                let usage = o.include_usage.unwrap_or(false) || config.force_include_usage;
                (usage, o.continuous_usage_stats.unwrap_or(false))
            }
        };

        // NOTE: OpenAI deprecated max_tokens for max_completion_tokens; the newer one wins.
        let (max_tokens, max_tokens_param) = match (self.max_completion_tokens, self.max_tokens) {
            (Some(m), _) => (Some(m), Some("max_completion_tokens")),
            (None, Some(m)) => (Some(m), Some("max_tokens")),
            (None, None) => (None, None),
        };
        // (the same value in both, as clients that send both for old and new servers do,
        // loses nothing)
        if matches!((self.max_completion_tokens, self.max_tokens), (Some(c), Some(m)) if c != m) {
            inert.push("max_tokens".into());
        }
        // (each sent is checked, the one the other overrides too, as a negative one is)
        for (p, sent) in [("max_completion_tokens", self.max_completion_tokens), ("max_tokens", self.max_tokens)] {
            if sent == Some(0) && !prompt_only_ok {
                let unless = if echo.is_some() { " (0 with `echo`: the prompt alone)" } else { "" };
                return Err(ApiError::invalid(p, format!("`{p}` must be at least 1{unless}, got 0.")));
            }
        }
        let min_tokens = self.min_tokens.unwrap_or(0);
        if let (Some(m), Some(p)) = (max_tokens, max_tokens_param) {
            if min_tokens > m {
                return Err(ApiError::invalid(
                    "min_tokens",
                    format!("`min_tokens` ({min_tokens}) must not exceed `{p}` ({m})."),
                ));
            }
        }
        let max_tokens = max_tokens.or(d.max_tokens.filter(|&m| m > 0));

        let n = self.n.unwrap_or(1);
        if n == 0 || n > MAX_N {
            return Err(ApiError::invalid("n", format!("`n` must be between 1 and {MAX_N}, got {n}.")));
        }

        let temperature = ranged("temperature", self.temperature, 0.0, 2.0)?;
        let top_p = ranged("top_p", self.top_p, 0.0, 1.0)?;
        let min_p = ranged("min_p", self.min_p, 0.0, 1.0)?;
        let presence_penalty = ranged("presence_penalty", self.presence_penalty, -2.0, 2.0)?;
        let frequency_penalty = ranged("frequency_penalty", self.frequency_penalty, -2.0, 2.0)?;
        let repetition_penalty = match self.repetition_penalty {
            None => None,
            // NOTE: applied in float32: outside its normal range the value rounds to 0 or
            // infinity, and the penalty would divide by zero.
            Some(x) if x > 0.0 && (x as f32).is_normal() => Some(x as f32),
            Some(x) => {
                return Err(ApiError::invalid(
                    "repetition_penalty",
                    format!(
                        "`repetition_penalty` must be greater than 0, between {:e} and {:e} (it is applied \
                         in float32), got {x}.",
                        f32::MIN_POSITIVE,
                        f32::MAX
                    ),
                ))
            }
        };
        let top_k = match self.top_k {
            None => None,
            Some(-1) | Some(0) => Some(0),
            Some(k) if k > 0 && k <= i32::MAX as i64 => Some(k as i32),
            Some(k) => {
                return Err(ApiError::invalid(
                    "top_k",
                    format!("`top_k` must be -1 (off) or a non-negative 32-bit integer, got {k}."),
                ))
            }
        };

        let seed = match self.seed {
            None | Some(Value::Null) => None,
            // Accepted: -2^63 ..= 2^64 - 1 (a negative seed keeps its bits).
            Some(Value::Number(num)) => match (num.as_u64(), num.as_i64(), num.as_f64()) {
                (Some(u), _, _) => Some(u),
                (None, Some(i), _) => Some(i as u64),
                // A whole number written as a decimal (2.0) is a type error, as for every
                // integer field. JSON integers past 64 bits parse as floats too (-2^63 - 1
                // rounds to -2^63, which an integer literal would have parsed as): out of range.
                (None, None, Some(x)) if x.fract() == 0.0 && x > -(2f64.powi(63)) && x < 2f64.powi(64) => {
                    return Err(invalid_type(
                        "seed",
                        format!("`seed` must be an integer, not a decimal number, got {num}."),
                    ))
                }
                (None, None, Some(x)) if x.is_finite() && x.fract() == 0.0 => {
                    return Err(ApiError::invalid(
                        "seed",
                        // (not echoed: read as a double, it is no longer the integer sent)
                        "`seed` must fit in 64 bits: an integer between -9223372036854775808 and \
                         18446744073709551615; this one is past them."
                            .to_string(),
                    ));
                }
                _ => return Err(invalid_type("seed", format!("`seed` must be an integer, got {num}."))),
            },
            Some(other) => {
                return Err(invalid_type("seed", format!("`seed` must be an integer, not {}.", kind_of(&other))))
            }
        };

        let stop = parse_stop(self.stop.as_ref())?;
        let stop_token_ids = self.stop_token_ids.unwrap_or_default();
        for (i, &id) in stop_token_ids.iter().enumerate() {
            check_token_id(&format!("stop_token_ids[{i}]"), id as u64, vocab_size)?;
        }
        let stop_token_ids = first_of_each(stop_token_ids);
        let logit_bias = parse_logit_bias(self.logit_bias.unwrap_or_default(), vocab_size)?;
        let bad_words = bad_words(self.bad_words.as_ref(), tokenizer)?;
        let repetition = RepetitionDetection::parse(self.repetition_detection.as_ref(), &mut inert)?;
        if repetition.is_some() && beam_search.is_some() {
            return Err(unsupported(
                "repetition_detection",
                "`use_beam_search` cannot be combined with `repetition_detection`: beams are ranked to the \
                 end, and one cut short by a repetition could not be ranked with the others.",
            ));
        }
        let allowed_token_ids = match self.allowed_token_ids {
            None => None,
            // (vLLM refuses an empty list too: nothing could be generated)
            Some(ids) if ids.is_empty() => {
                return Err(ApiError::invalid(
                    "allowed_token_ids",
                    "`allowed_token_ids` must list at least one token (leave it out to allow them all).",
                ))
            }
            Some(mut ids) => {
                for (i, &id) in ids.iter().enumerate() {
                    check_token_id(&format!("allowed_token_ids[{i}]"), u64::from(id), vocab_size)?;
                }
                ids.sort_unstable();
                ids.dedup();
                Some(ids)
            }
        };
        let response_format = super::constrained::response_format_source(self.response_format.as_ref(), &mut inert)?;
        inert.extend(super::constrained::response_format_unknown_keys(self.response_format.as_ref()));
        let guided = super::constrained::Guided {
            structured_outputs: self.structured_outputs.as_ref(),
            json: self.guided_json.as_ref(),
            regex: self.guided_regex.as_ref(),
            choice: self.guided_choice.as_ref(),
            grammar: self.guided_grammar.as_ref(),
        };
        let structured = guided.source(&mut inert)?;
        for (key, v) in [
            ("guided_decoding_backend", &self.guided_decoding_backend),
            ("guided_whitespace_pattern", &self.guided_whitespace_pattern),
        ] {
            if let Some(v) = v.as_ref().filter(|v| !v.is_null()) {
                // (vLLM's schema: a string, or its 400)
                if let Some(err) = misshapen(key, &Shape::One(STRING), v) {
                    return Err(err);
                }
                inert.push(key.into());
            }
        }
        let constraint = match (response_format, structured) {
            (Some(_), Some((_, param))) => {
                return Err(ApiError::invalid(
                    param,
                    format!(
                        "`{}` and a constraining `response_format` cannot both be sent: the output follows one \
                         grammar.",
                        param.split('.').next().unwrap_or(param)
                    ),
                ))
            }
            (rf, so) => rf.or(so),
        };

        if let Some(id) = &self.request_id {
            check_request_id(id)?;
        }
        let truncate_prompt_tokens = truncate_prompt_tokens(self.truncate_prompt_tokens, config.max_model_len)?;
        // NOTE: vLLM refuses them on streams too (they would come before any token), but for
        // k = 0, which it takes and shows nowhere: reported here.
        let prompt_logprobs = match self.prompt_logprobs {
            None => None,
            Some(0) if stream => {
                inert.push("prompt_logprobs".into());
                None
            }
            Some(_) if stream => {
                return Err(ApiError::invalid(
                    "prompt_logprobs",
                    "`prompt_logprobs` are not available when `stream` is true.",
                ))
            }
            Some(k) if k >= 0 && k <= i64::from(config.max_logprobs) => Some(k as u32),
            Some(k) => {
                return Err(ApiError::invalid(
                    "prompt_logprobs",
                    format!("`prompt_logprobs` must be between 0 and {}, got {k}.", config.max_logprobs),
                ))
            }
        };
        check_cache_salt(self.cache_salt.as_deref())?;
        // NOTE: `store: false` asks for what every request gets (nothing is stored).
        if self.store == Some(true) {
            inert.push("store".into());
        }
        if let Some(m) = &self.metadata {
            check_metadata(m)?;
            inert.push("metadata".into());
        }
        // NOTE: "auto" (OpenAI's default) and "default" ask for the one tier there is.
        if self.service_tier.as_deref().is_some_and(|t| !matches!(t, "auto" | "default")) {
            inert.push("service_tier".into());
        }

        let params = SamplingParams {
            n,
            temperature: temperature.or(d.temperature).unwrap_or(1.0),
            top_p: top_p.or(d.top_p).unwrap_or(1.0),
            top_k: top_k.or(d.top_k.map(|k| k.max(0))).unwrap_or(0),
            min_p: min_p.or(d.min_p).unwrap_or(0.0),
            presence_penalty: presence_penalty.unwrap_or(0.0),
            frequency_penalty: frequency_penalty.unwrap_or(0.0),
            repetition_penalty: repetition_penalty.or(d.repetition_penalty).unwrap_or(1.0),
            seed,
            max_tokens,
            min_tokens,
            stop,
            stop_token_ids,
            ignore_eos: self.ignore_eos.unwrap_or(false),
            include_stop_str_in_output: self.include_stop_str_in_output.unwrap_or(false),
            skip_special_tokens: self.skip_special_tokens.unwrap_or(true),
            logit_bias,
            bad_words,
            allowed_token_ids,
            beam_search,
            logprobs: None,
            repetition,
        };
        check_allowed_tokens(&params, &config.eos_token_ids)?;
        Ok(Common {
            model: self.model,
            params,
            max_tokens_param,
            stream,
            include_usage,
            continuous_usage_stats,
            priority: self.priority.unwrap_or(0),
            request_id: self.request_id,
            cache_salt: self.cache_salt,
            add_special_tokens: self.add_special_tokens,
            truncate_prompt_tokens,
            return_token_ids: self.return_token_ids.unwrap_or(false),
            tokens_as_ids: self.return_tokens_as_token_ids.unwrap_or(config.return_tokens_as_token_ids),
            prompt_logprobs,
            user: self.user,
            inert,
            constraint,
        })
    }
}

pub fn check_token_id(param: &str, id: u64, vocab_size: usize) -> Result<u32, ApiError> {
    if id < vocab_size as u64 {
        Ok(id as u32)
    } else {
        Err(ApiError::invalid(param, format!("Token id {id} is out of range: the vocabulary has {vocab_size} tokens.")))
    }
}

/// Longest `request_id` accepted: it names the response in its body and its `x-request-id`
/// header.
const MAX_REQUEST_ID_LEN: usize = 256;

/// A `request_id` must be something a response header can carry as it is: 1 to
/// MAX_REQUEST_ID_LEN printable ASCII characters, the last not a space (a CR/LF could
/// otherwise forge headers, other characters have no header encoding, and HTTP strips or
/// refuses trailing whitespace in a header value).
pub(crate) fn check_request_id(id: &str) -> Result<(), ApiError> {
    if id.is_empty()
        || id.len() > MAX_REQUEST_ID_LEN
        || id.ends_with(' ')
        || !id.bytes().all(|b| (0x20..0x7f).contains(&b))
    {
        return Err(ApiError::invalid(
            "request_id",
            format!(
                "`request_id` must be 1 to {MAX_REQUEST_ID_LEN} printable ASCII characters, not ending in a space."
            ),
        ));
    }
    Ok(())
}

/// vLLM's `truncate_prompt_tokens`: how many of a prompt's last tokens to keep (-1: the
/// context length), checked against the context length.
pub(crate) fn truncate_prompt_tokens(value: Option<i64>, max_model_len: u32) -> Result<Option<usize>, ApiError> {
    match value {
        None => Ok(None),
        Some(-1) => Ok(Some(max_model_len as usize)),
        Some(k) if k >= 1 && k <= i64::from(max_model_len) => Ok(Some(k as usize)),
        Some(k) => Err(ApiError::invalid(
            "truncate_prompt_tokens",
            format!(
                "`truncate_prompt_tokens` must be between 1 and the context length ({max_model_len}), or -1 for \
                 the context length, got {k}."
            ),
        )),
    }
}

/// `cache_salt`, when sent, must name a namespace: the empty string is refused.
pub(crate) fn check_cache_salt(salt: Option<&str>) -> Result<(), ApiError> {
    if salt == Some("") {
        return Err(ApiError::invalid("cache_salt", "`cache_salt` must not be empty."));
    }
    Ok(())
}

/// `items` with each value once, where it first came (the rest in their order). For the lists
/// every prompt's sequences hold and check at every step (stop strings and ids, bad words): a
/// client's million copies of one would be a million checks a token.
fn first_of_each<T: std::hash::Hash + Eq + Clone>(mut items: Vec<T>) -> Vec<T> {
    let mut seen = std::collections::HashSet::new();
    items.retain(|item| seen.insert(item.clone()));
    items
}

/// `stop`: a string or an array of non-empty strings (more than OpenAI's 4 is an extension).
fn parse_stop(v: Option<&Value>) -> Result<Vec<String>, ApiError> {
    let empty = |p: String| ApiError::invalid(p, "Stop strings must not be empty.");
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) if s.is_empty() => Err(empty("stop".into())),
        Some(Value::String(s)) => Ok(vec![s.clone()]),
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, item)| match item {
                Value::String(s) if s.is_empty() => Err(empty(format!("stop[{i}]"))),
                Value::String(s) => Ok(s.clone()),
                other => Err(invalid_type(
                    format!("stop[{i}]"),
                    format!("Stop strings must be strings, not {}.", kind_of(other)),
                )),
            })
            .collect::<Result<Vec<String>, ApiError>>()
            .map(first_of_each),
        Some(other) => Err(invalid_type(
            "stop",
            format!("`stop` must be a string or an array of strings, not {}.", kind_of(other)),
        )),
    }
}

/// `logit_bias`: canonical decimal token ids below the vocabulary size -> bias in [-100, 100].
fn parse_logit_bias(map: BTreeMap<String, f64>, vocab_size: usize) -> Result<Vec<(u32, f32)>, ApiError> {
    let mut out = Vec::with_capacity(map.len());
    for (key, bias) in map {
        let param = format!("logit_bias.{key}");
        // Canonical form only, so "01" and "1" cannot name one token twice.
        let id = key.parse::<u64>().ok().filter(|id| id.to_string() == key).ok_or_else(|| {
            ApiError::invalid(param.clone(), format!("`logit_bias` keys must be token ids, got {key:?}."))
        })?;
        let id = check_token_id(&param, id, vocab_size)?;
        if !(-100.0..=100.0).contains(&bias) {
            return Err(ApiError::invalid(
                param,
                format!("Logit bias values must be between -100 and 100, got {bias}."),
            ));
        }
        out.push((id, bias as f32));
    }
    out.sort_by_key(|&(id, _)| id);
    Ok(out)
}

/// The keys of `extra` (a struct's unknown keys) that `body` sets. OpenAI reads an explicit
/// `null` as "not set": a client that serializes every optional field sends nulls that ask
/// for nothing, so they are not reported.
pub fn set_keys<'a>(extra: &'a BTreeMap<String, IgnoredAny>, body: &'a Value) -> impl Iterator<Item = &'a String> {
    extra.keys().filter(move |k| body.get(k.as_str()).is_some_and(|v| !v.is_null()))
}

/// Unknown keys of a request (`body`): those that no struct of the endpoint knows, and that
/// are set.
pub fn unknown_keys<'a>(
    a: &'a BTreeMap<String, IgnoredAny>,
    b: &'a BTreeMap<String, IgnoredAny>,
    body: &'a Value,
) -> impl Iterator<Item = &'a String> {
    set_keys(a, body).filter(move |k| b.contains_key(*k))
}

/// Sorts the ignored fields, and with `strict_fields` turns the first into a 400.
pub fn settle_ignored(mut ignored: Vec<String>, strict: bool) -> Result<Vec<String>, ApiError> {
    ignored.sort();
    ignored.dedup();
    if strict {
        if let Some(first) = ignored.first() {
            return Err(unsupported(
                first.clone(),
                // NOTE: not "unsupported": a field may be honoured elsewhere and have no effect
                // on this request alone (`tools` that the template never shows and no call
                // format reads, `tools` under `tool_choice: "none"`).
                format!("`{first}` would have no effect on this request (strict field checking is on)."),
            ));
        }
    }
    Ok(ignored)
}

/// A prompt's token ids cut to their last `keep` (vLLM's `truncate_prompt_tokens`): whether
/// it was cut.
pub fn truncate_prompt(ids: &mut Vec<u32>, keep: Option<usize>) -> bool {
    match keep {
        Some(k) if ids.len() > k => {
            ids.drain(..ids.len() - k);
            true
        }
        _ => false,
    }
}

/// Whether a field's value asks for nothing.
type NoOp = fn(&Value) -> bool;

/// vLLM's request fields that llmserve does not implement, with the value at which each asks
/// for nothing beyond what every request gets here. Sent at that value (`use_beam_search:
/// false`, as some clients send vLLM's whole default set) they are dropped silently, as
/// `store: false` is; sent otherwise they change vLLM's output, so they are refused rather
/// than reported, as `best_of` is.
const VLLM_UNSUPPORTED: [(&str, NoOp, &str); 2] = [
    ("logits_processors", |v| v.as_array().is_some_and(Vec::is_empty), "custom logits processors are not supported"),
    (
        "truncation_side",
        |v| v == "left",
        "`truncate_prompt_tokens` keeps a prompt's last tokens (`\"left\"`, vLLM's default); cutting off its end \
         is not supported",
    ),
];

/// vLLM's fields at their default values, which clients that send vLLM's whole default set
/// send, and which ask for nothing this server does not do anyway: text as the tokenizer
/// decodes it (vLLM's default; its fast detokenizer decodes so too), no offsets, no
/// multimodal inputs to return, no expert routing, no watermark. They pass without a word,
/// also under `--strict-fields`; other values stay reported.
const VLLM_NO_OPS: [(&str, AsksNothing); 5] = [
    ("spaces_between_special_tokens", |v| *v == Value::Bool(true)),
    ("return_token_offsets", |v| *v == Value::Bool(false)),
    ("return_mm_kwargs", Value::is_boolean),
    ("routed_experts_prompt_start", |v| *v == serde_json::json!(0)),
    ("watermarking", |v| *v == Value::Bool(false)),
];

/// The JSON kind a field must have, and its description.
type Kind = (fn(&Value) -> bool, &'static str);

const STRING: Kind = (Value::is_string, "a string");
const OBJECT: Kind = (Value::is_object, "an object");

/// What an inert field must be: one kind, or an array of items of one kind.
enum Shape {
    One(Kind),
    ArrayOf(Kind),
    Either(Kind, Kind),
}

/// OpenAI's request fields that llmserve accepts without acting on them (reported in
/// `llmserve-ignored-fields`), with the JSON shape OpenAI requires: a value of another kind
/// is a 400 there, so it is here too, though the field does nothing. Only the kind is
/// checked: the values (`reasoning_effort`'s levels, ...) grow with OpenAI's models, and a
/// value this server does not know is still only reported.
const OPENAI_INERT: [(&str, Shape); 12] = [
    ("reasoning_effort", Shape::One(STRING)),
    ("verbosity", Shape::One(STRING)),
    ("modalities", Shape::ArrayOf(STRING)),
    ("audio", Shape::One(OBJECT)),
    ("web_search_options", Shape::One(OBJECT)),
    ("prompt_cache_key", Shape::One(STRING)),
    ("prompt_cache_retention", Shape::One(STRING)),
    ("prompt_cache_options", Shape::One(OBJECT)),
    ("moderation", Shape::One(OBJECT)),
    ("safety_identifier", Shape::One(STRING)),
    ("functions", Shape::ArrayOf(OBJECT)),
    ("function_call", Shape::Either(STRING, OBJECT)),
];

const BOOLEAN: Kind = (Value::is_boolean, "a boolean");

/// vLLM's request fields that llmserve accepts without acting on them, with the JSON kind
/// vLLM's schema gives them: a value of another kind is vLLM's 400, so it is here too.
const VLLM_INERT: [(&str, Shape); 6] = [
    ("spaces_between_special_tokens", Shape::One(BOOLEAN)),
    ("return_token_offsets", Shape::One(BOOLEAN)),
    ("vllm_xargs", Shape::One(OBJECT)),
    ("kv_transfer_params", Shape::One(OBJECT)),
    ("mm_processor_kwargs", Shape::One(OBJECT)),
    ("media_io_kwargs", Shape::One(OBJECT)),
];

/// Whether a field's value asks for nothing.
pub(crate) type AsksNothing = fn(&Value) -> bool;

/// OpenAI's fields at the values that ask for what every request here gets (text out; the
/// SDK's default image handling, with no image read): they pass without a word, also under
/// `--strict-fields`. (A route that runs as chat, such as Responses, gets this too.)
const OPENAI_NO_OPS: [(&str, AsksNothing); 2] = [
    ("modalities", |v| *v == serde_json::json!(["text"])),
    ("image", |v| *v == serde_json::json!({"context_compression": "auto"})),
];

/// OpenAI's fields at values that ask for output this server never makes: answering them with
/// text alone would leave the client looking for what it asked for, so they are 400
/// `unsupported_parameter` rather than reported.
const OPENAI_REFUSED: [(&str, AsksNothing, &str); 2] = [
    (
        "modalities",
        |v| !v.as_array().is_some_and(|m| m.iter().any(|x| x == "audio")),
        "this server writes text only: audio output is not supported (send `[\"text\"]` or leave it out)",
    ),
    ("audio", |_| false, "this server writes text only: audio output is not supported"),
];

/// The 400 for `value` at `name` when it does not have `shape` (an array's first wrong item
/// is named: `modalities[1]`).
fn misshapen(name: &str, shape: &Shape, value: &Value) -> Option<ApiError> {
    let wrong = |param: String, what: &str, got: &Value| {
        let message = format!("Invalid type for `{param}`: expected {what}, got {}.", kind_of(got));
        invalid_type(param, message)
    };
    match shape {
        Shape::One((ok, what)) => (!ok(value)).then(|| wrong(name.into(), what, value)),
        Shape::Either((a, what_a), (b, what_b)) => {
            (!a(value) && !b(value)).then(|| wrong(name.into(), &format!("{what_a} or {what_b}"), value))
        }
        Shape::ArrayOf((ok, what)) => match value.as_array() {
            None => Some(wrong(name.into(), "an array", value)),
            Some(items) => items.iter().position(|v| !ok(v)).map(|i| wrong(format!("{name}[{i}]"), what, &items[i])),
        },
    }
}

/// Whether the request itself sends `return_tokens_as_token_ids: true` (which names the tokens
/// of logprobs: a request that asks for none is told it did nothing).
pub(crate) fn asks_tokens_as_ids(body: &Value) -> bool {
    body.get("return_tokens_as_token_ids") == Some(&Value::Bool(true))
}

/// Sorts a request's unknown keys (set ones, from [`unknown_keys`]): vLLM's fields of
/// [`VLLM_UNSUPPORTED`] are dropped at their no-op value and refused otherwise; the fields of
/// [`OPENAI_INERT`] and [`VLLM_INERT`] must have their shape; the rest stay to be reported.
pub fn vllm_unsupported(unknown: Vec<String>, body: &Value) -> Result<Vec<String>, ApiError> {
    let mut rest = Vec::with_capacity(unknown.len());
    for key in unknown {
        let value = &body[key.as_str()];
        if let Some((name, shape)) = OPENAI_INERT.iter().chain(&VLLM_INERT).find(|(name, _)| *name == key) {
            if let Some(err) = misshapen(name, shape, value) {
                return Err(err);
            }
        }
        if let Some((name, _, why)) = OPENAI_REFUSED.iter().find(|(name, ok, _)| *name == key && !ok(value)) {
            return Err(unsupported(*name, format!("`{name}` is not supported: {why}.")));
        }
        if OPENAI_NO_OPS.iter().chain(&VLLM_NO_OPS).any(|(name, asks_nothing)| *name == key && asks_nothing(value)) {
            continue;
        }
        match VLLM_UNSUPPORTED.iter().find(|(name, ..)| *name == key) {
            Some((_, no_op, _)) if no_op(value) => {}
            Some((name, _, why)) => {
                return Err(unsupported(*name, format!("`{name}` is not supported: {why}.")));
            }
            None => rest.push(key),
        }
    }
    Ok(rest)
}

/// `message` with each backquoted piece that `rename` knows (a field path of the request the
/// route translated into) written as `rename` gives it: the routes that run as chat requests
/// (Responses, Anthropic Messages) report chat's errors in their own terms.
pub(crate) fn rename_quoted(message: &str, rename: impl Fn(&str) -> Option<String>) -> String {
    let mut out = String::with_capacity(message.len());
    for (i, part) in message.split('`').enumerate() {
        if i > 0 {
            out.push('`');
        }
        // (odd pieces are quoted)
        match rename(part).filter(|_| i % 2 == 1) {
            Some(renamed) => out.push_str(&renamed),
            None => out.push_str(part),
        }
    }
    out
}

/// `err` (a translated request's 400) with its `param` renamed by `param` and its message by
/// `words` (which is given the original `param`); other errors as they are.
pub(crate) fn rename_error(
    err: ApiError,
    param: impl Fn(&str) -> String,
    words: impl Fn(String, Option<&str>) -> String,
) -> ApiError {
    match err {
        ApiError::InvalidRequest { message, param: p, code } => {
            ApiError::InvalidRequest { message: words(message, p.as_deref()), param: p.map(|p| param(&p)), code }
        }
        ApiError::ContextLengthExceeded { message, param: p, sizes } => ApiError::ContextLengthExceeded {
            message: words(message, p.as_deref()),
            param: p.map(|p| param(&p)),
            sizes,
        },
        other => other,
    }
}

/// The 400 for a field that beam search cannot honour (`what` it asks for).
pub(crate) fn beam_conflict(param: &str, what: &str) -> ApiError {
    unsupported(
        param,
        format!(
            "`use_beam_search` cannot be combined with {what}: beams are ranked by the model's own \
             logprobs."
        ),
    )
}

/// vLLM's beam search (`use_beam_search`, `length_penalty`), checked against the fields it
/// cannot honour: those that reshape the distribution beams are ranked by (biases, bans,
/// penalties) are a 400; those it has no use for (temperature, nucleus and top-k truncation,
/// the seed) are reported, as in vLLM, where they have no effect on the beams either.
/// `length_penalty` without beam search is reported too.
fn beam_search(f: &CommonFields, vocab_size: usize, inert: &mut Vec<String>) -> Result<Option<BeamSearch>, ApiError> {
    let length_penalty = match f.length_penalty {
        Some(x) if !x.is_finite() => {
            return Err(ApiError::invalid(
                "length_penalty",
                format!("`length_penalty` must be a finite number, got {x}."),
            ))
        }
        other => other,
    };
    if f.use_beam_search != Some(true) {
        if length_penalty.is_some_and(|x| x != 1.0) {
            inert.push("length_penalty".into());
        }
        return Ok(None);
    }
    // (each step ranks 2 * n candidates per beam; an `n` out of range is its own 400)
    let n = f.n.unwrap_or(1);
    if n <= MAX_N && 2 * n as usize > vocab_size {
        return Err(ApiError::invalid(
            "n",
            format!("Beam search over {n} beams ranks {} candidates per beam, more than the vocabulary's {vocab_size} tokens.", 2 * n),
        ));
    }
    let conflicts = [
        ("logit_bias", f.logit_bias.as_ref().is_some_and(|b| !b.is_empty()), "`logit_bias`"),
        // (a `bad_words` that is no array is its own 400, further on)
        ("bad_words", f.bad_words.as_ref().and_then(Value::as_array).is_some_and(|w| !w.is_empty()), "`bad_words`"),
        ("allowed_token_ids", f.allowed_token_ids.is_some(), "`allowed_token_ids`"),
        ("presence_penalty", f.presence_penalty.is_some_and(|x| x != 0.0), "a presence penalty"),
        ("frequency_penalty", f.frequency_penalty.is_some_and(|x| x != 0.0), "a frequency penalty"),
        ("repetition_penalty", f.repetition_penalty.is_some_and(|x| x != 1.0), "a repetition penalty"),
    ];
    if let Some((param, _, what)) = conflicts.iter().find(|(_, set, _)| *set) {
        return Err(beam_conflict(param, what));
    }
    // (the ranking reads the model's own logprobs, those temperature 1 samples from: 1, which
    // clients send as OpenAI's default, asks for nothing)
    let unused = [
        ("temperature", f.temperature.is_some_and(|t| t != 1.0)),
        ("top_p", f.top_p.is_some_and(|x| x != 1.0)),
        ("top_k", f.top_k.is_some_and(|k| k > 0)),
        ("min_p", f.min_p.is_some_and(|x| x != 0.0)),
        ("seed", f.seed.as_ref().is_some_and(|s| !s.is_null())),
    ];
    inert.extend(unused.iter().filter(|(_, set)| *set).map(|(k, _)| k.to_string()));
    Ok(Some(BeamSearch { length_penalty: length_penalty.unwrap_or(1.0) }))
}

/// A 400 for `allowed_token_ids` that the request's own bans leave nothing of (the sampler
/// would have no token to choose): a one-token `bad_words` entry bans its token always, and
/// before `min_tokens` the eos (unless `ignore_eos`) and `stop_token_ids` are banned.
fn check_allowed_tokens(p: &SamplingParams, eos: &[u32]) -> Result<(), ApiError> {
    let Some(allowed) = &p.allowed_token_ids else { return Ok(()) };
    let bad_word = |t: u32| p.bad_words.iter().any(|w| w.as_slice() == [t]);
    if allowed.iter().all(|&t| bad_word(t)) {
        return Err(ApiError::invalid(
            "allowed_token_ids",
            "Every token of `allowed_token_ids` is a word of `bad_words`: no token could be generated.",
        ));
    }
    let ends = |t: u32| p.stop_token_ids.contains(&t) || (!p.ignore_eos && eos.contains(&t));
    if p.min_tokens > 0 && allowed.iter().all(|&t| bad_word(t) || ends(t)) {
        return Err(ApiError::invalid(
            "min_tokens",
            "`min_tokens` bans the tokens that end the output (eos, `stop_token_ids`) until that many are \
             generated, and `allowed_token_ids` allows no other: no token could be generated.",
        ));
    }
    Ok(())
}

/// vLLM's `bad_words` as the token sequences to ban, as vLLM tokenizes them: each word
/// without its leading whitespace, and again after a space where that makes other tokens of
/// the same count (the word inside a text rather than at its start).
fn bad_words(words: Option<&Value>, tokenizer: &Tokenizer) -> Result<Vec<Vec<u32>>, ApiError> {
    let words = match words {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(words)) => words,
        Some(other) => {
            return Err(invalid_type(
                "bad_words",
                format!("`bad_words` must be an array of strings, not {}.", kind_of(other)),
            ))
        }
    };
    let mut out: Vec<Vec<u32>> = Vec::with_capacity(words.len() * 2);
    // (a word repeated is tokenized once)
    let mut words_seen = std::collections::HashSet::new();
    for (i, word) in words.iter().enumerate() {
        let Some(word) = word.as_str() else {
            return Err(invalid_type(
                format!("bad_words[{i}]"),
                format!("A bad word must be a string, not {}.", kind_of(word)),
            ));
        };
        let word = word.trim_start();
        if word.is_empty() {
            return Err(ApiError::invalid(format!("bad_words[{i}]"), "A bad word must hold some text."));
        }
        if !words_seen.insert(word) {
            continue;
        }
        let alone = tokenizer.encode(word, false);
        let inside = tokenizer.encode(&format!(" {word}"), false);
        let differs = inside.len() == alone.len() && inside.first() != alone.first();
        out.push(alone);
        if differs {
            out.push(inside);
        }
    }
    out.retain(|w| !w.is_empty());
    Ok(first_of_each(out))
}

/// A fresh response id: `<prefix>-<uuid v4 as 32 hex chars>`.
pub fn new_id(prefix: &str) -> String {
    format!("{prefix}-{}", uuid::Uuid::new_v4().simple())
}

pub fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// Builds the `llmserve-ignored-fields` header, if any.
pub fn ignored_header(ignored: &[String]) -> Option<(String, String)> {
    (!ignored.is_empty()).then(|| ("llmserve-ignored-fields".to_string(), header_list(ignored)))
}

/// Most bytes of a header that lists request fields. Clients refuse large response headers
/// (Node's fetch takes 16 KiB of headers in all; nginx buffers 4 or 8 KiB by default), and a
/// request can name thousands of fields (a `name` on each of 900 messages).
pub const HEADER_LIST_BYTES: usize = 4096;
/// Most bytes of one item of such a list (a client's unknown key can be any length).
const HEADER_ITEM_BYTES: usize = 256;

/// The value of a header that lists request fields: the items joined by ", ", each as
/// [`header_text`] writes it and cut after HEADER_ITEM_BYTES ("..."); past HEADER_LIST_BYTES
/// the rest is counted instead of listed (", ... (12 more)"). A space at either end of an
/// item is written `\u0020` and an empty item `""`: HTTP trims a header value's ends (and
/// the HTTP layer refuses to send one that has blank ends), and a client splitting the list
/// would trim its items.
pub fn header_list(items: &[String]) -> String {
    let mut out = String::new();
    for (i, item) in items.iter().enumerate() {
        // (cut between characters, never inside an escape)
        let mut text = String::new();
        if item.is_empty() {
            text.push_str("\"\"");
        }
        let last = item.chars().count().saturating_sub(1);
        for (k, c) in item.chars().enumerate() {
            let before = text.len();
            if c == ' ' && (k == 0 || k == last) {
                text.push_str("\\u0020");
            } else {
                push_header_char(&mut text, c);
            }
            if text.len() > HEADER_ITEM_BYTES {
                text.truncate(before);
                text.push_str("...");
                break;
            }
        }
        let more = format!(", ... ({} more)", items.len() - i);
        if out.len() + 2 + text.len() + more.len() > HEADER_LIST_BYTES {
            out.push_str(if out.is_empty() { &more[2..] } else { &more });
            break;
        }
        if !out.is_empty() {
            out.push_str(", ");
        }
        out.push_str(&text);
    }
    out
}

/// `text` as a response header can carry it: printable ASCII as it is; a backslash and every
/// other character with JSON's escapes (`\\`, `\u6771`). A header holds visible ASCII
/// (other bytes reach clients as latin-1 at best, and the HTTP layer refuses characters
/// beyond it), and a CR or LF would end the header.
pub fn header_text(text: &str) -> Cow<'_, str> {
    if text.bytes().all(|b| (b' '..=b'~').contains(&b) && b != b'\\') {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        push_header_char(&mut out, c);
    }
    Cow::Owned(out)
}

/// One character as [`header_text`] writes it.
fn push_header_char(out: &mut String, c: char) {
    match c {
        '\\' => out.push_str("\\\\"),
        ' '..='~' => out.push(c),
        _ => {
            for unit in c.encode_utf16(&mut [0; 2]) {
                out.push_str(&format!("\\u{unit:04x}"));
            }
        }
    }
}
