//! `POST /v1/completions`: the completion-only fields and the four prompt shapes (a string,
//! a list of strings, token ids, a list of token-id lists), each tokenized and checked
//! against the context budget; with a `suffix`, laid out for fill-in-the-middle
//! ([`crate::fim`]).

use std::collections::BTreeMap;

use serde::de::IgnoredAny;
use serde::Deserialize;
use serde_json::Value;

use super::budget::{check_context, settle_budget};
use super::common::{
    check_token_id, from_value, ignored_header, invalid_type, kind_of, new_id, parse_body, settle_ignored,
    truncate_prompt, unix_now, unknown_keys, unsupported, vllm_unsupported, CommonFields, MAX_N,
};
use super::{BestOf, Checked, Endpoint, Prepared, SamplingParams};
use crate::error::ApiError;
use crate::fim::Fim;
use crate::router::Router;
use crate::tokenizer::Tokenizer;

#[derive(Deserialize, Debug)]
pub struct CompletionFields {
    pub prompt: Value,
    pub logprobs: Option<u32>,
    pub echo: Option<bool>,
    pub suffix: Option<Value>,
    pub best_of: Option<u32>,
    #[serde(flatten)]
    pub extra: BTreeMap<String, IgnoredAny>,
}

/// `best_of` (OpenAI's legacy field): the [`BestOf`] plan when it asks for more choices than
/// `n` (then `params.n` becomes `best_of`, and the sampled tokens' logprobs are computed).
/// Equal to `n`, it asks for nothing more. Greedy candidates are all the same: they are
/// computed once (greedy `n` fans one sequence out), yet counted in `usage` as OpenAI bills
/// them. Below `n`, above the most choices, or streamed, it is a 400: the best are known only
/// once all have ended, as OpenAI refuses to stream them.
fn best_of(best_of: Option<u32>, params: &mut SamplingParams, stream: bool) -> Result<Option<BestOf>, ApiError> {
    let n = params.n;
    match best_of {
        None => Ok(None),
        Some(b) if b < n || b > MAX_N => Err(ApiError::invalid(
            "best_of",
            format!("`best_of` must be between `n` ({n}) and {MAX_N}, got {b}: it is how many choices the best `n` are picked from."),
        )),
        // (vLLM's beam search keeps `n` beams and returns them all)
        Some(b) if b != n && params.beam_search.is_some() => Err(super::common::beam_conflict("best_of", "`best_of` above `n`")),
        Some(b) if b == n => Ok(None),
        Some(b) if stream => Err(ApiError::invalid(
            "best_of",
            format!("`best_of` above `n` cannot be streamed (got best_of={b}, n={n}): the best are known only once all have ended."),
        )),
        Some(b) => {
            let plan = BestOf { n, logprobs: params.logprobs.is_some() };
            params.n = b;
            // (greedy candidates tie whatever their logprobs: none are computed to rank them)
            if params.temperature != 0.0 {
                params.logprobs = params.logprobs.or(Some(0));
            }
            Ok(Some(plan))
        }
    }
}

/// One prompt as sent.
#[derive(Debug, PartialEq)]
pub(crate) enum PromptIn {
    Text(String),
    Ids(Vec<u32>),
}

/// The prompt field's shapes (`field`: "prompt", or embeddings' "input"), each prompt with
/// the `param` path that names it.
pub(crate) fn parse_prompts(v: &Value, vocab_size: usize, field: &str) -> Result<Vec<(PromptIn, String)>, ApiError> {
    let shape_err = |p: String| {
        invalid_type(
            p,
            format!(
                "`{field}` must be a string, an array of strings, an array of token ids, or an array of \
                 token-id arrays."
            ),
        )
    };
    let noun = if field == "prompt" { "Prompts" } else { "Inputs" };
    let empty = |p: String| ApiError::invalid(p, format!("{noun} must not be empty."));
    let ids = |items: &[Value], p: &str| -> Result<Vec<u32>, ApiError> {
        items
            .iter()
            .enumerate()
            .map(|(j, t)| {
                let pj = format!("{p}[{j}]");
                // A whole number too big for 64 bits arrives as a float (`2**64`): a range
                // error, as for any integer field; `5.0` is a type error (OpenAI's rule).
                let huge = t.as_f64().filter(|f| t.is_f64() && f.fract() == 0.0 && f.abs() >= 2f64.powi(63));
                match (t.as_u64(), huge) {
                    (Some(id), _) => check_token_id(&pj, id, vocab_size),
                    (None, Some(f)) if f > 0.0 => Err(ApiError::invalid(
                        pj,
                        format!("Token id {t} is out of range: the vocabulary has {vocab_size} tokens."),
                    )),
                    (None, _) if t.is_i64() || huge.is_some() => {
                        Err(ApiError::invalid(pj, "Token ids must not be negative."))
                    }
                    (None, _) => Err(invalid_type(pj, format!("Token ids must be integers, not {}.", kind_of(t)))),
                }
            })
            .collect()
    };
    match v {
        Value::String(s) if s.is_empty() => Err(empty(field.into())),
        Value::String(s) => Ok(vec![(PromptIn::Text(s.clone()), field.into())]),
        Value::Array(items) if items.is_empty() => Err(empty(field.into())),
        // A flat list of numbers is one token-id prompt.
        Value::Array(items) if items[0].is_number() => Ok(vec![(PromptIn::Ids(ids(items, field)?), field.into())]),
        Value::Array(items) => items
            .iter()
            .enumerate()
            .map(|(i, item)| {
                let p = format!("{field}[{i}]");
                // OpenAI's shapes are a list of strings or a list of token-id lists, not a mix.
                if (item.is_string() || item.is_array()) && item.is_string() != items[0].is_string() {
                    return Err(invalid_type(p, format!("`{field}` must not mix strings and token-id arrays.")));
                }
                match item {
                    Value::String(s) if s.is_empty() => Err(empty(p)),
                    Value::String(s) => Ok((PromptIn::Text(s.clone()), p)),
                    Value::Array(inner) if inner.is_empty() => Err(empty(p)),
                    Value::Array(inner) => Ok((PromptIn::Ids(ids(inner, &p)?), p)),
                    _ => Err(shape_err(p)),
                }
            })
            .collect(),
        _ => Err(shape_err(field.into())),
    }
}

/// Token ids and text of each prompt. Strings get the tokenizer's special tokens (its
/// post-processor, e.g. BOS) unless `add_special_tokens` is false, as a raw completion
/// prompt does in `transformers`. `truncate`: keep only each prompt's last tokens (its text
/// is then what they spell); a text keeps the special tokens around it, which count among
/// them, as a tokenizer's left truncation does (vLLM's), and its text is what its own kept
/// tokens spell.
pub(crate) fn tokenize_prompts(
    tokenizer: &Tokenizer,
    prompts: Vec<(PromptIn, String)>,
    add_special_tokens: bool,
    truncate: Option<usize>,
) -> Result<Vec<(Vec<u32>, String, String)>, ApiError> {
    prompts
        .into_iter()
        .map(|(p, param)| {
            let (mut ids, text) = match p {
                PromptIn::Text(text) => {
                    let mut ids = tokenizer.encode(&text, add_special_tokens);
                    if ids.is_empty() {
                        return Err(ApiError::invalid(param, "The prompt tokenizes to no tokens."));
                    }
                    if let Some(k) = truncate.filter(|&k| add_special_tokens && ids.len() > k) {
                        ids = truncate_inside_specials(ids, &tokenizer.encode(&text, false), k);
                        // (the specials the tokenizer added are not the prompt's text, as
                        // they are not in an echo of the whole prompt)
                        let text = tokenizer.decode(&ids, true);
                        return Ok((ids, text, param));
                    }
                    (ids, text)
                }
                PromptIn::Ids(ids) => {
                    let text = tokenizer.decode(&ids, false);
                    (ids, text)
                }
            };
            let text = if truncate_prompt(&mut ids, truncate) { tokenizer.decode(&ids, false) } else { text };
            Ok((ids, text, param))
        })
        .collect()
}

/// `ids` (a text with its special tokens) cut to `k` tokens by dropping the start of the
/// text's own tokens (`plain`), keeping the specials the post-processor put around them (BOS,
/// ...); plainly its last `k` when they do not surround `plain` or leave it no room.
fn truncate_inside_specials(ids: Vec<u32>, plain: &[u32], k: usize) -> Vec<u32> {
    let found = (!plain.is_empty() && plain.len() <= ids.len())
        .then(|| ids.windows(plain.len()).position(|w| w == plain))
        .flatten();
    match found {
        Some(before) if ids.len() - plain.len() < k => {
            let (keep, end) = (k - (ids.len() - plain.len()), before + plain.len());
            [&ids[..before], &plain[plain.len() - keep..], &ids[end..]].concat()
        }
        _ => ids[ids.len().saturating_sub(k)..].to_vec(),
    }
}

/// The FIM tokens a request with a `suffix` is laid out with, or why it cannot be.
fn fim_tokens(router: &Router, echo: bool, truncate: Option<usize>) -> Result<&Fim, ApiError> {
    let Some(fim) = router.fim() else {
        let why = if router.config.fim {
            "its vocabulary has no fill-in-the-middle tokens"
        } else {
            "this server was started with --no-fim"
        };
        return Err(unsupported(
            "suffix",
            format!("`suffix` (fill-in-the-middle) is not supported for this model: {why}."),
        ));
    };
    if echo {
        // (the model reads the prompt, then the suffix, then writes the middle: there is no
        // text that both prepends the prompt and places the suffix)
        return Err(ApiError::invalid("echo", "`echo` cannot be combined with `suffix`."));
    }
    if truncate.is_some() {
        return Err(ApiError::invalid(
            "truncate_prompt_tokens",
            "`truncate_prompt_tokens` cannot be combined with `suffix`: the prompt and the suffix are laid out \
             around the model's fill-in-the-middle tokens, which a cut could drop.",
        ));
    }
    Ok(fim)
}

/// Each prompt laid out around `suffix` with the FIM tokens ([`Fim::layout`]), with its text
/// as sent (where the completion's `text_offset`s count from). A text keeps the special
/// tokens the tokenizer puts before it (BOS) in front of the layout.
fn fim_prompts(
    tokenizer: &Tokenizer,
    fim: &Fim,
    prompts: Vec<(PromptIn, String)>,
    suffix: &str,
    add_special_tokens: bool,
) -> Result<Vec<(Vec<u32>, String, String)>, ApiError> {
    let suffix_ids = tokenizer.encode(suffix, false);
    prompts
        .into_iter()
        .map(|(p, param)| {
            let (lead, ids, text) = match p {
                PromptIn::Text(text) => {
                    let plain = tokenizer.encode(&text, false);
                    let full = if add_special_tokens { tokenizer.encode(&text, true) } else { plain.clone() };
                    let before = full.windows(plain.len().max(1)).position(|w| w == plain).unwrap_or(0);
                    (full[..before].to_vec(), plain, text)
                }
                PromptIn::Ids(ids) => {
                    let text = tokenizer.decode(&ids, false);
                    (Vec::new(), ids, text)
                }
            };
            Ok((fim.layout(&lead, &ids, &suffix_ids), text, param))
        })
        .collect()
}

/// `header_id`: the request's `X-Request-Id`, which names it when the body's `request_id`
/// does not.
pub(crate) fn prepare(router: &Router, body: &[u8], header_id: Option<&str>) -> Result<Checked, ApiError> {
    let value = parse_body(body)?;
    // NOTE: a prompt sent as embeddings (vLLM's `prompt_embeds`, which it too refuses unless
    // started with --enable-prompt-embeds) cannot be read: answering the text `prompt` instead,
    // or nothing, would answer another question than the one asked.
    if value.get("prompt_embeds").is_some_and(|v| !v.is_null() && v.as_array().is_none_or(|a| !a.is_empty())) {
        return Err(unsupported(
            "prompt_embeds",
            "`prompt_embeds` is not supported: send the prompt as text or token ids.",
        ));
    }
    let common: CommonFields = from_value(&value)?;
    let comp: CompletionFields = from_value(&value)?;
    let lora = router.check_model(&common.model)?;
    let config = &router.config;
    let vocab_size = router.tokenizer.vocab_size();

    let unknown = unknown_keys(&common.extra, &comp.extra, &value).cloned().collect();
    let mut ignored: Vec<String> = vllm_unsupported(unknown, &value)?;
    // NOTE: `echo` with `max_tokens: 0` returns the prompt alone (with its logprobs when
    // asked): how clients score a text's likelihood (vLLM and OpenAI's legacy API take it).
    let c = common.resolve(config, &router.tokenizer, Some(comp.echo == Some(true)))?;
    ignored.extend(c.inert.iter().cloned());
    if comp.logprobs.is_none() && super::common::asks_tokens_as_ids(&value) {
        // (it names the tokens of logprobs, and none are asked for)
        ignored.push("return_tokens_as_token_ids".into());
    }
    let ignored = settle_ignored(ignored, config.strict_fields)?;

    let fim = match comp.suffix.as_ref().filter(|s| !s.is_null()) {
        None => None,
        Some(Value::String(suffix)) => {
            Some((fim_tokens(router, comp.echo == Some(true), c.truncate_prompt_tokens)?, suffix))
        }
        Some(other) => {
            return Err(invalid_type("suffix", format!("`suffix` must be a string, not {}.", kind_of(other))))
        }
    };
    let mut params = c.params;
    if let Some(k) = comp.logprobs {
        if k > config.max_logprobs {
            return Err(ApiError::invalid(
                "logprobs",
                format!("`logprobs` must be between 0 and {}, got {k}.", config.max_logprobs),
            ));
        }
    }
    // NOTE: `echo` with `logprobs` returns the prompt tokens' logprobs too, as OpenAI does
    // (the first prompt token's is null): Core asks the scheduler for prompt logprob rows.
    params.logprobs = comp.logprobs;
    let best_of = best_of(comp.best_of, &mut params, c.stream)?;

    let grammar = super::constrained::compile(router, c.constraint, &params)?;
    let prompts = parse_prompts(&comp.prompt, vocab_size, "prompt")?;
    let add_special_tokens = c.add_special_tokens.unwrap_or(true);
    let prompts = match fim {
        None => tokenize_prompts(&router.tokenizer, prompts, add_special_tokens, c.truncate_prompt_tokens)?,
        Some((fim, suffix)) => {
            if !params.ignore_eos {
                let new: Vec<u32> = fim.ends.iter().filter(|t| !params.stop_token_ids.contains(t)).copied().collect();
                params.stop_token_ids.extend(new);
            }
            fim_prompts(&router.tokenizer, fim, prompts, suffix, add_special_tokens)?
        }
    };
    for (ids, _, param) in &prompts {
        check_context(ids.len(), params.max_tokens, c.max_tokens_param, config.max_model_len, param)?;
    }
    settle_budget(&mut params, c.max_tokens_param, prompts.iter().map(|p| p.0.len()), config.max_model_len)?;
    let (prompt_ids, prompt_texts): (Vec<_>, Vec<_>) = prompts.into_iter().map(|(ids, text, _)| (ids, text)).unzip();

    let prepared = Prepared {
        endpoint: Endpoint::Completion,
        id: c.request_id.as_deref().or(header_id).map_or_else(|| new_id("cmpl"), |id| format!("cmpl-{id}")),
        created: unix_now(),
        system_fingerprint: router.fingerprint(lora),
        model: c.model,
        prompts: prompt_ids,
        prompt_texts,
        params,
        stream: c.stream,
        include_usage: c.include_usage,
        continuous_usage_stats: c.continuous_usage_stats,
        echo: comp.echo.unwrap_or(false),
        return_token_ids: c.return_token_ids,
        tokens_as_ids: c.tokens_as_ids,
        prompt_logprobs_k: c.prompt_logprobs,
        priority: c.priority,
        cache_salt: c.cache_salt,
        lora,
        keep: None,
        user: c.user,
        headers: ignored_header(&ignored).into_iter().collect(),
        ignored: ignored.clone(),
        grammar,
        tools: None,
        reasoning: None,
        responses: None,
        embedding: None,
        best_of,
        echo_message: None,
        prediction: Vec::new(),
    };
    Ok(Checked { prepared, template: None, unused_kwargs: Vec::new(), ignored })
}
