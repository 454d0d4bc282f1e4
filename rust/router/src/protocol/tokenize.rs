//! The routes answered without generating: `/tokenize`, `/detokenize` and the two render
//! routes. Their bodies are JSON built here.
//!
//! NOTE: tokenize/detokenize have no header to report ignored fields in, so unknown fields
//! are a 400 there. The render routes report them in the body (`ignored_fields`).

use std::collections::BTreeMap;

use serde::de::IgnoredAny;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::chat::{generation_flags, render, validate_messages, validate_tools, ChatRender};
use super::common::{check_token_id, from_value, parse_body, unsupported};
use crate::error::ApiError;
use crate::router::Router;

#[derive(Deserialize, Debug)]
struct TokenizeBody {
    model: Option<String>,
    prompt: Option<String>,
    messages: Option<Vec<Value>>,
    add_special_tokens: Option<bool>,
    add_generation_prompt: Option<bool>,
    continue_final_message: Option<bool>,
    chat_template_kwargs: Option<Map<String, Value>>,
    tools: Option<Vec<Value>>,
    #[allow(dead_code)] // type-checked here; the template gets it from the body as sent
    documents: Option<Vec<Value>>,
    #[serde(flatten)]
    extra: BTreeMap<String, IgnoredAny>,
}

#[derive(Deserialize, Debug)]
struct DetokenizeBody {
    model: Option<String>,
    tokens: Vec<u32>,
    #[serde(flatten)]
    extra: BTreeMap<String, IgnoredAny>,
}

fn reject_unknown(extra: &BTreeMap<String, IgnoredAny>) -> Result<(), ApiError> {
    match extra.keys().next() {
        None => Ok(()),
        Some(k) => Err(unsupported(k.clone(), format!("Unknown field `{k}` for this route."))),
    }
}

fn to_body(v: &Value) -> Vec<u8> {
    serde_json::to_vec(v).expect("JSON values serialize")
}

/// `{prompt}` or `{messages, ...}` -> `{"tokens", "count", "max_model_len"}`.
pub(crate) fn tokenize(router: &Router, body: &[u8]) -> Result<Vec<u8>, ApiError> {
    let value = parse_body(body)?;
    let req: TokenizeBody = from_value(&value)?;
    reject_unknown(&req.extra)?;
    if let Some(m) = &req.model {
        router.check_model(m)?;
    }
    let tokens = match (&req.prompt, &req.messages) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid("messages", "Send either `prompt` or `messages`, not both."))
        }
        (None, None) => {
            return Err(ApiError::with_code(
                "missing_required_parameter",
                Some("prompt".into()),
                "Missing required parameter: `prompt` (or `messages`).",
            ))
        }
        (Some(prompt), None) => router.tokenizer.encode(prompt, req.add_special_tokens.unwrap_or(true)),
        (None, Some(messages)) => {
            validate_messages(messages)?;
            if let Some(tools) = &req.tools {
                validate_tools(tools)?;
            }
            let (add_generation_prompt, continue_final_message) =
                generation_flags(req.add_generation_prompt, req.continue_final_message)?;
            let input = ChatRender {
                messages: &value["messages"],
                tools: value.get("tools").filter(|t| !t.is_null()),
                documents: value.get("documents").filter(|d| !d.is_null()),
                add_generation_prompt,
                continue_final_message,
                kwargs: req.chat_template_kwargs.as_ref(),
            };
            let (rendered, _) = render(router, &input)?;
            // The template writes BOS itself; adding special tokens again would double it.
            router.tokenizer.encode(&rendered.text, req.add_special_tokens.unwrap_or(false))
        }
    };
    Ok(to_body(&json!({
        "tokens": tokens,
        "count": tokens.len(),
        "max_model_len": router.config.max_model_len,
    })))
}

/// `{tokens}` -> `{"prompt": text}` (special tokens kept: this shows what the ids are).
pub(crate) fn detokenize(router: &Router, body: &[u8]) -> Result<Vec<u8>, ApiError> {
    let value = parse_body(body)?;
    let req: DetokenizeBody = from_value(&value)?;
    reject_unknown(&req.extra)?;
    if let Some(m) = &req.model {
        router.check_model(m)?;
    }
    let vocab_size = router.tokenizer.vocab_size();
    for (i, &id) in req.tokens.iter().enumerate() {
        check_token_id(&format!("tokens[{i}]"), id as u64, vocab_size)?;
    }
    Ok(to_body(&json!({ "prompt": router.tokenizer.decode(&req.tokens, false) })))
}

/// A chat request, validated as for generation -> what it renders to.
pub(crate) fn chat_render(router: &Router, body: &[u8]) -> Result<Vec<u8>, ApiError> {
    let checked = super::chat::prepare(router, body)?;
    let p = &checked.prepared;
    let (origin, hash) = checked.template.clone().unwrap_or_default();
    Ok(to_body(&json!({
        "prompt": p.prompt_texts[0],
        "prompt_token_ids": p.prompts[0],
        "template": {"origin": origin, "hash": hash},
        "tool_call_format": p.tools.as_ref().map(|t| t.format.name()),
        "reasoning_parser": p.reasoning.map(|r| r.parser.name()),
        "grammar": p.grammar.as_ref().map(|g| g.key()),
        "unused_template_kwargs": checked.unused_kwargs,
        "ignored_fields": checked.ignored,
    })))
}

/// A completions request, validated as for generation -> each prompt's text and ids.
pub(crate) fn completion_render(router: &Router, body: &[u8]) -> Result<Vec<u8>, ApiError> {
    let checked = super::completion::prepare(router, body)?;
    let p = &checked.prepared;
    let prompts: Vec<Value> = p
        .prompt_texts
        .iter()
        .zip(&p.prompts)
        .map(|(text, ids)| json!({"prompt": text, "prompt_token_ids": ids}))
        .collect();
    Ok(to_body(&json!({ "prompts": prompts, "ignored_fields": checked.ignored })))
}
