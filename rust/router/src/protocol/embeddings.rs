//! `POST /v1/embeddings`: OpenAI's fields (`input` in the four prompt shapes, `model`,
//! `encoding_format`, `dimensions`, `user`) and vLLM's (`truncate_prompt_tokens`,
//! `add_special_tokens`, `normalize`, `priority`, `request_id`, `cache_salt`), validated into a
//! [`Prepared`] request that runs each input's prompt and samples nothing.
//!
//! An embedding is the model's final (normed) hidden state pooled over the input: the last
//! token's ([`Pooling::Last`], what decoder embedding models are trained for) or the mean of
//! every token's ([`Pooling::Mean`]), as the server's [`EmbeddingConfig`] says; L2-normalized
//! unless the model or the request says otherwise. The engine runs the request as a
//! completion of `max_tokens: 0`, so it batches, queues and is cancelled like any other, and
//! the scheduler lists the positions to pool (`Plan::pool_indices`).
//!
//! Decisions: `dimensions` keeps the first k components (then normalizes), which is only
//! meaningful for a Matryoshka-trained model, so it is refused unless the model declares
//! itself one (its full size is always accepted); `encoding_format: "base64"` is the
//! little-endian f32 bytes the official SDK decodes (it asks for them by default); at most
//! [`MAX_INPUTS`] inputs per request, as OpenAI.

use std::collections::BTreeMap;

use serde::de::IgnoredAny;
use serde::Deserialize;

use super::common::{
    check_cache_salt, check_request_id, from_value, ignored_header, new_id, parse_body, set_keys, settle_ignored,
    truncate_prompt_tokens, unix_now, unsupported, vllm_unsupported,
};
use super::completion::{parse_prompts, tokenize_prompts, PromptIn};
use super::{Checked, Endpoint, Prepared, SamplingParams};
use crate::error::ApiError;
use crate::router::Router;

/// Most inputs one request may embed (OpenAI's limit).
pub const MAX_INPUTS: usize = 2048;

/// Which of an input's final hidden states make its embedding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Pooling {
    /// The last token's.
    #[default]
    Last,
    /// The mean over every token.
    Mean,
}

/// How this server's model embeds (`--pooling`, and the model's sentence-transformers files).
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct EmbeddingConfig {
    #[serde(default)]
    pub pooling: Pooling,
    /// L2-normalize by default (a request's `normalize` overrides it).
    #[serde(default = "yes")]
    pub normalize: bool,
    /// The hidden size: an embedding's length.
    pub hidden_size: u32,
    /// None: not Matryoshka-trained (`dimensions` below `hidden_size` is refused). Some(empty):
    /// any length; Some(list): the lengths it was trained for (config.json's
    /// `matryoshka_dimensions`).
    #[serde(default)]
    pub matryoshka: Option<Vec<u32>>,
}

fn yes() -> bool {
    true
}

/// What a request's embeddings are made of, beyond its prompts.
#[derive(Clone, Debug, PartialEq)]
pub struct EmbeddingPlan {
    pub pooling: Pooling,
    pub normalize: bool,
    /// Keep the first k components (`dimensions`); None: all.
    pub dimensions: Option<usize>,
    /// `encoding_format: "base64"`.
    pub base64: bool,
    /// `/score` and `/rerank`: the answer is scores of the embeddings, not the embeddings.
    pub scoring: Option<std::sync::Arc<super::score::Scoring>>,
}

#[derive(Deserialize, Debug)]
struct EmbeddingFields {
    model: String,
    input: serde_json::Value,
    encoding_format: Option<String>,
    dimensions: Option<i64>,
    user: Option<String>,
    truncate_prompt_tokens: Option<i64>,
    add_special_tokens: Option<bool>,
    normalize: Option<bool>,
    /// vLLM's newer name for `normalize` on embeddings (its pooler's activation).
    use_activation: Option<bool>,
    priority: Option<i32>,
    request_id: Option<String>,
    cache_salt: Option<String>,
    stream: Option<bool>,
    #[serde(flatten)]
    extra: BTreeMap<String, IgnoredAny>,
}

/// `header_id`: the request's `X-Request-Id`, which names it when the body's `request_id`
/// does not.
pub(crate) fn prepare(router: &Router, body: &[u8], header_id: Option<&str>) -> Result<Checked, ApiError> {
    let value = parse_body(body)?;
    if value.get("input").is_none() && value.get("messages").is_some() {
        return Err(unsupported(
            "messages",
            "Embedding a conversation (`messages`, vLLM's chat-form embeddings) is not supported: send its text \
             as `input`.",
        ));
    }
    let f: EmbeddingFields = from_value(&value)?;
    let lora = router.check_model(&f.model)?;
    let embed = embedder(router, &f.model)?;
    // (vLLM's embedding defaults, which ask for what every answer here is: float32 values, in
    // this machine's byte order when base64; its other fields as on completions)
    let neutral = |key: &str| match key {
        "embed_dtype" => value[key] == "float32",
        "endianness" => value[key] == "native" || value[key] == "little",
        _ => false,
    };
    check_encoding(&value)?;
    let unknown = set_keys(&f.extra, &value).filter(|k| !neutral(k)).cloned().collect();
    let mut ignored = vllm_unsupported(unknown, &value)?;
    if f.stream == Some(true) {
        // (nothing to stream: one answer holds every vector; `false` asks for nothing)
        ignored.push("stream".into());
    }
    let ignored = settle_ignored(ignored, router.config.strict_fields)?;

    let base64 = match f.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::invalid(
                "encoding_format",
                format!("`encoding_format` must be \"float\" or \"base64\", got {other:?}."),
            ))
        }
    };
    let dimensions = check_dimensions(f.dimensions, embed)?;
    let inputs = parse_prompts(&f.input, router.tokenizer.vocab_size(), "input")?;
    if inputs.len() > MAX_INPUTS {
        return Err(ApiError::invalid(
            "input",
            format!("At most {MAX_INPUTS} inputs may be embedded in one request, got {}.", inputs.len()),
        ));
    }
    let plan = EmbeddingPlan {
        pooling: embed.pooling,
        normalize: match (f.normalize, f.use_activation) {
            (Some(a), Some(b)) if a != b => {
                return Err(ApiError::invalid(
                    "use_activation",
                    "`use_activation` (vLLM's newer name for `normalize`) and `normalize` disagree: send one.",
                ))
            }
            (normalize, use_activation) => normalize.or(use_activation).unwrap_or(embed.normalize),
        },
        dimensions,
        base64,
        scoring: None,
    };
    let inputs = Inputs {
        texts: inputs,
        add_special_tokens: f.add_special_tokens.unwrap_or(true),
        truncate_prompt_tokens: f.truncate_prompt_tokens,
        priority: f.priority,
        request_id: f.request_id,
        cache_salt: f.cache_salt,
        user: f.user,
    };
    inputs_prepared(router, Endpoint::Embeddings, "embd", f.model, lora, inputs, plan, ignored, header_id)
}

/// vLLM's `embed_dtype` and `endianness`, which say how base64 vectors are encoded: a value
/// vLLM does not know is 400 `invalid_value`; one it knows but this server does not encode
/// (float16, bfloat16, fp8, big-endian) is 400 `unsupported_parameter` beside base64, where a
/// client would decode what it asked for from what it did not get (beside floats they encode
/// nothing, and are reported as ignored).
fn check_encoding(value: &serde_json::Value) -> Result<(), ApiError> {
    let base64 = value.get("encoding_format").and_then(serde_json::Value::as_str) == Some("base64");
    for (key, known, served) in [
        ("embed_dtype", &["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"][..], &["float32"][..]),
        ("endianness", &["native", "little", "big"][..], &["native", "little"][..]),
    ] {
        let Some(v) = value.get(key).filter(|v| !v.is_null()) else { continue };
        let Some(text) = v.as_str().filter(|t| known.contains(t)) else {
            return Err(ApiError::invalid(key, format!("`{key}` must be one of {}, got {v}.", known.join(", "))));
        };
        if base64 && !served.contains(&text) {
            return Err(unsupported(
                key,
                format!("`{key}` {text:?} is not supported: base64 embeddings are little-endian float32 here."),
            ));
        }
    }
    Ok(())
}

/// How the server's model embeds, or the 400 `model` of a model that does not.
pub(crate) fn embedder<'a>(router: &'a Router, model: &str) -> Result<&'a EmbeddingConfig, ApiError> {
    router.config.embeddings.as_ref().ok_or_else(|| {
        unsupported(
            "model",
            format!(
                "The model `{model}` does not serve embeddings: its sentence-transformers files describe a pooling \
                 this server cannot make (the server's log says which); started with `--pooling last` or \
                 `--pooling mean`, it serves its hidden states pooled so."
            ),
        )
    })
}

/// The texts (or token ids) a request embeds, each with the `param` that names it, and the
/// fields every embedding-made request takes.
pub(crate) struct Inputs {
    pub texts: Vec<(PromptIn, String)>,
    pub add_special_tokens: bool,
    pub truncate_prompt_tokens: Option<i64>,
    pub priority: Option<i32>,
    pub request_id: Option<String>,
    pub cache_salt: Option<String>,
    pub user: Option<String>,
}

/// The request that runs each of `inputs` as a prompt that samples nothing and answers as
/// `plan` says: `/v1/embeddings`, `/score`, `/rerank`. `id_prefix`: its id's ("embd-...").
#[allow(clippy::too_many_arguments)]
pub(crate) fn inputs_prepared(
    router: &Router,
    endpoint: Endpoint,
    id_prefix: &str,
    model: String,
    lora: u32,
    inputs: Inputs,
    plan: EmbeddingPlan,
    ignored: Vec<String>,
    header_id: Option<&str>,
) -> Result<Checked, ApiError> {
    let config = &router.config;
    if let Some(id) = &inputs.request_id {
        check_request_id(id)?;
    }
    check_cache_salt(inputs.cache_salt.as_deref())?;
    let max_model_len = config.max_model_len as usize;
    let truncate = truncate_prompt_tokens(inputs.truncate_prompt_tokens, config.max_model_len)?;
    let texts = tokenize_prompts(&router.tokenizer, inputs.texts, inputs.add_special_tokens, truncate)?;
    for (ids, _, param) in &texts {
        if ids.len() > max_model_len {
            return Err(ApiError::ContextLengthExceeded {
                message: format!(
                    "This model's maximum context length is {max_model_len} tokens, but the input `{param}` has \
                     {} tokens. Please shorten it, or set `truncate_prompt_tokens` to embed its last tokens.",
                    ids.len()
                ),
                param: Some(param.clone()),
                sizes: None,
            });
        }
    }
    let (prompts, prompt_texts): (Vec<_>, Vec<_>) = texts.into_iter().map(|(ids, text, _)| (ids, text)).unzip();
    let id = inputs.request_id.as_deref().or(header_id);
    let prepared = Prepared {
        endpoint,
        id: id.map_or_else(|| new_id(id_prefix), |id| format!("{id_prefix}-{id}")),
        created: unix_now(),
        system_fingerprint: router.fingerprint(lora),
        model,
        prompts,
        prompt_texts,
        params: prompt_only_params(),
        stream: false,
        include_usage: true,
        continuous_usage_stats: false,
        echo: false,
        return_token_ids: false,
        tokens_as_ids: false,
        prompt_logprobs_k: None,
        priority: inputs.priority.unwrap_or(0),
        cache_salt: inputs.cache_salt,
        lora,
        keep: None,
        user: inputs.user,
        headers: ignored_header(&ignored).into_iter().collect(),
        ignored: ignored.clone(),
        grammar: None,
        tools: None,
        reasoning: None,
        responses: None,
        embedding: Some(plan),
        best_of: None,
        echo_message: None,
        prediction: Vec::new(),
    };
    Ok(Checked { prepared, template: None, unused_kwargs: Vec::new(), ignored })
}

/// `dimensions`: None when it asks for the full size.
fn check_dimensions(dimensions: Option<i64>, embed: &EmbeddingConfig) -> Result<Option<usize>, ApiError> {
    let full = embed.hidden_size;
    let Some(d) = dimensions else { return Ok(None) };
    if d < 1 || d > i64::from(full) {
        return Err(ApiError::invalid(
            "dimensions",
            format!("`dimensions` must be between 1 and the model's embedding size ({full}), got {d}."),
        ));
    }
    let d = d as u32;
    if d == full {
        return Ok(None);
    }
    match &embed.matryoshka {
        None => Err(unsupported(
            "dimensions",
            format!(
                "This model was not trained for shortened embeddings (Matryoshka): `dimensions` must be its \
                 embedding size, {full}."
            ),
        )),
        Some(allowed) if !allowed.is_empty() && !allowed.contains(&d) => {
            // (the full size is always served; listed once, last, whether the model's list has it)
            let mut sizes: Vec<u32> = allowed.iter().copied().filter(|&a| a != full).collect();
            sizes.push(full);
            let sizes: Vec<String> = sizes.iter().map(u32::to_string).collect();
            Err(unsupported(
                "dimensions",
                format!("This model's embeddings can be shortened to {} dimensions, not {d}.", sizes.join(", ")),
            ))
        }
        Some(_) => Ok(Some(d as usize)),
    }
}

/// One greedy sequence per input that stops at its prompt (the scheduler's prompt scoring).
fn prompt_only_params() -> SamplingParams {
    SamplingParams {
        n: 1,
        temperature: 0.0,
        top_p: 1.0,
        top_k: 0,
        min_p: 0.0,
        presence_penalty: 0.0,
        frequency_penalty: 0.0,
        repetition_penalty: 1.0,
        seed: None,
        max_tokens: Some(0),
        min_tokens: 0,
        stop: Vec::new(),
        stop_token_ids: Vec::new(),
        ignore_eos: true,
        include_stop_str_in_output: false,
        skip_special_tokens: true,
        logit_bias: Vec::new(),
        bad_words: Vec::new(),
        allowed_token_ids: None,
        beam_search: None,
        logprobs: None,
        repetition: None,
    }
}
