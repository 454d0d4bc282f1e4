//! The routes answered without generating: `/tokenize`, `/detokenize` and the two render
//! routes. Their bodies are JSON built here.
//!
//! Unknown fields (and message keys the template never reads) follow the generation routes'
//! rule: reported, or a 400 under `strict_fields`. They are reported in the
//! `llmserve-ignored-fields` header, as on the generation routes, and in the body as
//! `ignored_fields` (the render routes always, tokenize/detokenize when there are any).
//! `chat_template_kwargs` keys the template never reads are named in
//! `llmserve-unused-template-kwargs` (tokenize's `messages` form and chat render), and chat
//! render also sends the generation's `llmserve-chat-template`.

use std::collections::BTreeMap;

use serde::de::IgnoredAny;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::chat::{check_tool_turns, generation_flags, refuse_request_template, render};
use super::chat::{check_unused_kwargs, unknown_part_keys, unread_message_keys, unused_kwarg_fields};
use super::chat::{validate_documents, validate_messages, validate_tools, ChatRender};
use super::common::{check_token_id, from_value, header_list, ignored_header, parse_body, set_keys, settle_ignored};
use super::{Handled, Prepared};
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
    /// Refused when set, as on the chat route.
    chat_template: Option<Value>,
    /// Adds `token_strs` (the vocabulary pieces of the ids) to the response, as vLLM does.
    return_token_strs: Option<bool>,
    #[allow(dead_code)] // type-checked here; the template gets it from the body as sent
    documents: Option<Vec<Value>>,
    #[serde(flatten)]
    extra: BTreeMap<String, IgnoredAny>,
}

#[derive(Deserialize, Debug)]
struct DetokenizeBody {
    model: Option<String>,
    tokens: Vec<u32>,
    skip_special_tokens: Option<bool>,
    #[serde(flatten)]
    extra: BTreeMap<String, IgnoredAny>,
}

/// Tokenize fields that only shape a `messages` render.
const CHAT_ONLY: [&str; 5] =
    ["add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools", "documents"];

fn to_body(v: &Value) -> Vec<u8> {
    serde_json::to_vec(v).expect("JSON values serialize")
}

/// A tokenize/detokenize answer: `ignored_fields` in the body and the header when some were
/// ignored.
fn with_ignored(mut body: Value, ignored: Vec<String>) -> Handled {
    let headers = ignored_header(&ignored).into_iter().collect();
    if !ignored.is_empty() {
        body["ignored_fields"] = json!(ignored);
    }
    Handled { body: to_body(&body), headers }
}

/// A render answer: its body, and the headers the same request would earn when generating
/// (but no `x-request-id`: nothing is generated, no response is named).
fn rendered(body: &Value, prepared: &Prepared) -> Handled {
    let headers = prepared.headers.iter().filter(|(name, _)| name != "x-request-id").cloned().collect();
    Handled { body: to_body(body), headers }
}

/// `{prompt}` or `{messages, ...}` -> `{"tokens", "count", "max_model_len"}`.
pub(crate) fn tokenize(router: &Router, body: &[u8]) -> Result<Handled, ApiError> {
    let value = parse_body(body)?;
    let req: TokenizeBody = from_value(&value)?;
    if let Some(m) = &req.model {
        router.check_model(m)?;
    }
    refuse_request_template(req.chat_template.as_ref())?;
    let mut ignored: Vec<String> = set_keys(&req.extra, &value).cloned().collect();
    let (tokens, unused_kwargs, template_header) = match (&req.prompt, &req.messages) {
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
        (Some(prompt), None) => {
            // The chat-only fields do nothing to a prompt: reported, as any inert field.
            ignored.extend(
                CHAT_ONLY.iter().filter(|f| value.get(**f).is_some_and(|v| !v.is_null())).map(|f| f.to_string()),
            );
            (router.tokenizer.encode(prompt, req.add_special_tokens.unwrap_or(true)), Vec::new(), None)
        }
        (None, Some(messages)) => {
            validate_messages(messages)?;
            check_tool_turns(&value["messages"])?;
            validate_documents(req.documents.as_deref().unwrap_or_default())?;
            if let Some(tools) = &req.tools {
                validate_tools(tools)?;
            }
            let template = router.templates.select(req.tools.is_some());
            ignored.extend(unknown_part_keys(messages));
            // Rendered for the count alone: what the template never reads is reported, as
            // on the chat route.
            for (field, sent) in
                [("tools", req.tools.is_some()), ("documents", value.get("documents").is_some_and(|d| !d.is_null()))]
            {
                if sent && !template.is_some_and(|t| t.reads(field)) {
                    ignored.push(field.into());
                }
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
            let (rendered, used) = render(router, &input)?;
            ignored.extend(unread_message_keys(&rendered, &value["messages"]));
            // The template writes BOS itself; adding special tokens again would double it.
            let add_special_tokens = req.add_special_tokens.unwrap_or(false);
            (
                router.tokenizer.encode_with_text_spans(&rendered.text, &rendered.text_spans, add_special_tokens),
                rendered.unused_kwargs,
                Some(super::chat::template_header(used)),
            )
        }
    };
    check_unused_kwargs(&unused_kwargs, router.config.strict_fields)?;
    ignored.extend(unused_kwarg_fields(&unused_kwargs));
    let ignored = settle_ignored(ignored, router.config.strict_fields)?;
    let mut out = json!({
        "tokens": tokens,
        "count": tokens.len(),
        "max_model_len": router.config.max_model_len,
    });
    if req.return_token_strs == Some(true) {
        let strs: Vec<String> = tokens.iter().map(|&id| router.tokenizer.id_to_token(id).unwrap_or_default()).collect();
        out["token_strs"] = json!(strs);
    }
    let mut handled = with_ignored(out, ignored);
    // (as on chat: the template the messages rendered through, and the keys it never read)
    handled.headers.extend(template_header);
    if !unused_kwargs.is_empty() {
        handled.headers.push(("llmserve-unused-template-kwargs".into(), header_list(&unused_kwargs)));
    }
    Ok(handled)
}

/// `{tokens}` -> `{"prompt": text}` (special tokens kept unless `skip_special_tokens`: this
/// shows what the ids are).
pub(crate) fn detokenize(router: &Router, body: &[u8]) -> Result<Handled, ApiError> {
    let value = parse_body(body)?;
    let req: DetokenizeBody = from_value(&value)?;
    let ignored = settle_ignored(set_keys(&req.extra, &value).cloned().collect(), router.config.strict_fields)?;
    if let Some(m) = &req.model {
        router.check_model(m)?;
    }
    let vocab_size = router.tokenizer.vocab_size();
    for (i, &id) in req.tokens.iter().enumerate() {
        check_token_id(&format!("tokens[{i}]"), id as u64, vocab_size)?;
    }
    let text = router.tokenizer.decode(&req.tokens, req.skip_special_tokens.unwrap_or(false));
    Ok(with_ignored(json!({ "prompt": text }), ignored))
}

/// A chat request, validated as for generation -> what it renders to.
pub(crate) fn chat_render(router: &Router, body: &[u8]) -> Result<Handled, ApiError> {
    let checked = super::chat::prepare(router, body, None)?;
    let p = &checked.prepared;
    let (origin, hash) = checked.template.clone().unwrap_or_default();
    Ok(rendered(
        &json!({
        "prompt": p.prompt_texts[0],
        "prompt_token_ids": p.prompts[0],
        "template": {"origin": origin, "hash": hash},
        "tool_call_format": p.tools.as_ref().map(|t| t.format.name()),
        "reasoning_parser": p.reasoning.map(|r| r.parser.name()),
        "grammar": p.grammar.as_ref().map(|g| g.key()),
        "unused_template_kwargs": checked.unused_kwargs,
        "ignored_fields": checked.ignored,
        }),
        p,
    ))
}

/// A completions request, validated as for generation -> each prompt's text and ids.
pub(crate) fn completion_render(router: &Router, body: &[u8]) -> Result<Handled, ApiError> {
    let checked = super::completion::prepare(router, body, None)?;
    let p = &checked.prepared;
    let prompts: Vec<Value> = p
        .prompt_texts
        .iter()
        .zip(&p.prompts)
        .map(|(text, ids)| json!({"prompt": text, "prompt_token_ids": ids}))
        .collect();
    Ok(rendered(&json!({ "prompts": prompts, "ignored_fields": checked.ignored }), p))
}
