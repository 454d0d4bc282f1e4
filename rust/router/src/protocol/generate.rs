//! `POST /inference/v1/generate`: vLLM's tokens-in, tokens-out route, as reinforcement-learning
//! trainers and disaggregated front ends call it. The body holds a prompt of token ids and a
//! vLLM `SamplingParams` object; the answer holds each choice's token ids (and logprobs, named
//! `token_id:<id>`), never text.
//!
//! As [`super::messages`] does, the request is translated into the request it means, here a
//! completion of a token-id prompt, which [`super::completion`] validates; its errors and
//! ignored fields are named back in this route's terms (`prompt` is `token_ids`, a sampling
//! field `x` is `sampling_params.x`). The answer is built by
//! [`crate::response::ResponseBuilder`] (`crate::response::generate`).
//!
//! The translation:
//! - `token_ids` -> `prompt` (one prompt of ids); `model` (optional here: the first served name
//!   when left out) -> `model`; `stream`, `stream_options`, `priority`, `cache_salt` and
//!   `request_id` as they are.
//! - `sampling_params`'s fields that completions read (`n`, `temperature`, `top_p`, `top_k`,
//!   `min_p`, the penalties, `seed`, `stop`, `stop_token_ids`, `ignore_eos`, `max_tokens`,
//!   `min_tokens`, `logprobs`, `prompt_logprobs`, `logit_bias`, `allowed_token_ids`,
//!   `bad_words`, `structured_outputs`, `truncate_prompt_tokens`, `repetition_detection`,
//!   `skip_special_tokens` (stop strings match the text it shapes), `logits_processors`
//!   (refused there)) -> the completion's own.
//!
//! Decisions:
//! - Every sampled token is returned and has its logprobs, the token that ended the choice
//!   included (an eos, a stop token, the last token of a stop string), as vLLM returns them:
//!   the completion runs with `include_stop_str_in_output`. So `sampling_params`'s
//!   `include_stop_str_in_output`, `detokenize`, `spaces_between_special_tokens`,
//!   `output_kind` and `flat_logprobs`, which shape text or vLLM's internal outputs, have no
//!   effect here and are reported (at a value other than vLLM's default, for the last three and
//!   `detokenize`); so are `skip_clone`, `extra_args` and `skip_reading_prefix_cache: true`
//!   (this server's prefix cache is read by every request), a non-null `kv_transfer_params`
//!   (no KV transfer connector), and any other key.
//! - `features` (multimodal inputs) is a 400 `unsupported_parameter`: the models served here
//!   read text.
//! - Completion fields that are not vLLM sampling fields (`echo`, `suffix`, `best_of`,
//!   `response_format`, `use_beam_search`, ...) are not read from `sampling_params` (they are
//!   reported): this route takes what vLLM's `SamplingParams` holds.

use serde_json::{json, Map, Value};

use super::chat::missing;
use super::common::{as_object, invalid_type, kind_of, parse_body, rename_error, rename_quoted, set, settle_ignored};
use super::{completion, Checked, Endpoint};
use crate::error::ApiError;
use crate::router::Router;

/// `sampling_params` fields that the completion reads as its own.
const PASSED: [&str; 24] = [
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "max_tokens",
    "min_tokens",
    "logprobs",
    "prompt_logprobs",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "structured_outputs",
    "truncate_prompt_tokens",
    "repetition_detection",
    "skip_special_tokens",
    "logits_processors",
];

/// `sampling_params` fields that shape only text or vLLM's own outputs, with the value at which
/// they ask for nothing (None: any value asks for something this route does not do).
const TEXT_ONLY: [(&str, Option<Value>); 4] = [
    ("include_stop_str_in_output", None),
    ("detokenize", Some(Value::Bool(true))),
    ("spaces_between_special_tokens", Some(Value::Bool(true))),
    ("flat_logprobs", Some(Value::Bool(false))),
];

/// The top-level fields the completion reads as they are.
const TOP: [&str; 5] = ["stream", "stream_options", "priority", "cache_salt", "request_id"];

/// A completion field's path in this route's terms.
fn rename(path: &str) -> String {
    // (`prompt` and its elements, not `prompt_logprobs`)
    if let Some(rest) = path.strip_prefix("prompt").filter(|r| r.is_empty() || r.starts_with(['.', '['])) {
        return format!("token_ids{rest}");
    }
    let head = path.split(['.', '[']).next().unwrap_or(path);
    if TOP.contains(&head) || head == "model" || head == super::common::BODY_PARAM {
        path.to_string()
    } else {
        format!("sampling_params.{path}")
    }
}

/// A backquoted name in a completion's message, when it is one of its fields.
fn rename_known(quoted: &str) -> Option<String> {
    let head = quoted.split(['.', '[']).next().unwrap_or(quoted);
    (head == "prompt" || PASSED.contains(&head) || TOP.contains(&head)).then(|| rename(quoted))
}

/// The completion request `obj` means, and the fields reported as having no effect.
fn translate(router: &Router, obj: &Map<String, Value>) -> Result<(Value, Vec<String>), ApiError> {
    let mut ignored = Vec::new();
    if set(obj, "features").is_some() {
        return Err(super::common::unsupported(
            "features",
            "`features` (multimodal inputs) is not supported: the models served here read text only.",
        ));
    }
    let token_ids = match set(obj, "token_ids").ok_or_else(|| missing("token_ids".into()))? {
        Value::Array(ids) if ids.is_empty() => {
            return Err(ApiError::invalid("token_ids", "`token_ids` must hold at least one token id."))
        }
        // (one prompt of ids: the completion would take strings and nested lists as prompts)
        Value::Array(ids) => {
            if let Some((i, v)) = ids.iter().enumerate().find(|(_, v)| !v.is_number()) {
                return Err(invalid_type(
                    format!("token_ids[{i}]"),
                    format!("`token_ids[{i}]` must be a token id (an integer), not {}.", kind_of(v)),
                ));
            }
            Value::Array(ids.clone())
        }
        other => {
            return Err(invalid_type(
                "token_ids",
                format!("`token_ids` must be an array of token ids, not {}.", kind_of(other)),
            ))
        }
    };
    let params = set(obj, "sampling_params").ok_or_else(|| missing("sampling_params".into()))?;
    let params = as_object(params, "sampling_params", "`sampling_params`")?;
    let model = match obj.get("model") {
        None | Some(Value::Null) => json!(router.config.served_model_names.first().cloned().unwrap_or_default()),
        Some(v) => v.clone(),
    };
    let mut out = Map::new();
    out.insert("model".into(), model);
    out.insert("prompt".into(), token_ids);
    for key in TOP {
        if let Some(v) = obj.get(key) {
            out.insert(key.into(), v.clone());
        }
    }
    for (key, v) in params {
        if PASSED.contains(&key.as_str()) {
            out.insert(key.clone(), v.clone());
            continue;
        }
        let inert = match TEXT_ONLY.iter().find(|(name, _)| name == key) {
            Some((_, default)) => !v.is_null() && default.as_ref() != Some(v),
            // (vLLM's own knobs: no effect at their defaults)
            None => match key.as_str() {
                "output_kind" | "skip_clone" | "extra_args" => !v.is_null(),
                "skip_reading_prefix_cache" => v.as_bool() == Some(true),
                _ => true,
            },
        };
        if inert {
            ignored.push(format!("sampling_params.{key}"));
        }
    }
    for (key, v) in obj {
        let known = TOP.contains(&key.as_str())
            || matches!(key.as_str(), "token_ids" | "sampling_params" | "model" | "features");
        if key == "kv_transfer_params" {
            if !v.is_null() {
                ignored.push(key.clone());
            }
        } else if !known {
            ignored.push(key.clone());
        }
    }
    // Every sampled token, the one that ended the choice included, is returned with its ids
    // and logprobs named by id.
    out.insert("include_stop_str_in_output".into(), json!(true));
    out.insert("return_token_ids".into(), json!(true));
    if out.get("logprobs").is_some_and(|k| !k.is_null()) {
        out.insert("return_tokens_as_token_ids".into(), json!(true));
    }
    Ok((Value::Object(out), ignored))
}

/// Validates a generate request and prepares the completion it means.
pub(crate) fn prepare(router: &Router, body: &[u8], header_id: Option<&str>) -> Result<Checked, ApiError> {
    let value = parse_body(body)?;
    let obj = value.as_object().expect("parse_body checks");
    let (completion, ignored) = translate(router, obj)?;
    // ours first: under strict field checking they are the 400
    let mut ignored = settle_ignored(ignored, router.config.strict_fields)?;
    let body = serde_json::to_vec(&completion).expect("values serialize");
    let mut checked = completion::prepare(router, &body, header_id)
        .map_err(|e| rename_error(e, rename, |m, _| rename_quoted(&m, rename_known)))?;
    ignored.extend(checked.ignored.iter().map(|p| rename(p)));
    checked.report(ignored);
    let prepared = &mut checked.prepared;
    prepared.endpoint = Endpoint::Generate;
    prepared.id = match prepared.id.strip_prefix("cmpl-") {
        Some(id) => format!("generate-tokens-{id}"),
        None => prepared.id.clone(),
    };
    Ok(checked)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_named_in_this_routes_terms() {
        assert_eq!(rename("prompt"), "token_ids");
        assert_eq!(rename("prompt[2]"), "token_ids[2]");
        assert_eq!(rename("temperature"), "sampling_params.temperature");
        assert_eq!(rename("prompt_logprobs"), "sampling_params.prompt_logprobs");
        assert_eq!(rename_known("prompt_logprobs"), Some("sampling_params.prompt_logprobs".into()));
        assert_eq!(rename("structured_outputs.json"), "sampling_params.structured_outputs.json");
        assert_eq!(rename("stream_options.include_usage"), "stream_options.include_usage");
        assert_eq!(rename("model"), "model");
        assert_eq!(rename_known("max_tokens"), Some("sampling_params.max_tokens".into()));
        assert_eq!(rename_known("2048"), None);
    }
}
