//! vLLM's scoring routes for an embedding model: `POST /score` (`/v1/score`) scores text pairs,
//! `POST /rerank` (`/v1/rerank`, `/v2/rerank`, Jina's and Cohere's shape) ranks documents by
//! their relevance to a query. A score is the cosine similarity of the two texts' embeddings,
//! made as `/v1/embeddings` makes them (the server's pooling), which is what vLLM computes for
//! an embedding model (cross-encoder models, which read both texts at once, are not served).
//!
//! Each distinct text runs once: a `/score` whose `text_1` is one text scores it against every
//! `text_2` from one embedding (vLLM embeds it once per pair), and `usage` counts the tokens
//! that ran.
//!
//! Fields: `/score` takes `text_1` and `text_2` (a string or an array of strings each; one
//! `text_1` against many `text_2`, or two arrays of one length, scored pair by pair), or the
//! same pair under newer vLLM's names, `queries` and `documents` (or `items`), or `data_1` and
//! `data_2`; `/rerank` takes `query` (a string) and `documents` (strings, or `{"text": ...}`
//! objects as Cohere's v1 API sends them), `top_n` (the best n; 0 or absent: all) and
//! `return_documents` (Jina's and Cohere's; default true, as vLLM always returns them). Both
//! take vLLM's `truncate_prompt_tokens`, `priority`, `request_id` and `cache_salt`. vLLM's
//! cross-encoder switches (`use_activation`, `activation`, `softmax`) change nothing in a
//! cosine and are reported, as unknown fields are.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::de::IgnoredAny;
use serde::Deserialize;
use serde_json::{Map, Value};

use super::chat::missing;
use super::common::{from_value, invalid_type, kind_of, parse_body, set_keys, settle_ignored};
use super::completion::PromptIn;
use super::embeddings::{embedder, inputs_prepared, EmbeddingPlan, Inputs, Pooling, MAX_INPUTS};
use super::{Checked, Endpoint};
use crate::error::ApiError;
use crate::router::Router;

/// What a scoring request answers with, beyond the embeddings of its inputs.
#[derive(Clone, Debug, PartialEq)]
pub enum Scoring {
    /// `/score`: one score per pair of inputs (their indices), in order.
    Pairs(Vec<(usize, usize)>),
    /// `/rerank`: input 0 is the query, input `1 + i` document `i`; the documents ranked by
    /// score, best first, the first `top_n` of them, each with its text when `documents` holds
    /// them.
    Rerank { top_n: usize, documents: Option<Vec<String>> },
}

#[derive(Deserialize, Debug)]
struct ScoreFields {
    model: String,
    text_1: Value,
    text_2: Value,
    truncate_prompt_tokens: Option<i64>,
    priority: Option<i32>,
    request_id: Option<String>,
    cache_salt: Option<String>,
    user: Option<String>,
    #[serde(flatten)]
    extra: BTreeMap<String, IgnoredAny>,
}

#[derive(Deserialize, Debug)]
struct RerankFields {
    model: String,
    query: Value,
    documents: Value,
    top_n: Option<i64>,
    return_documents: Option<bool>,
    truncate_prompt_tokens: Option<i64>,
    priority: Option<i32>,
    request_id: Option<String>,
    cache_salt: Option<String>,
    user: Option<String>,
    #[serde(flatten)]
    extra: BTreeMap<String, IgnoredAny>,
}

/// The names `/score`'s pair goes by: vLLM's first ones, then its newer ones.
const PAIR_NAMES: [(&str, &[&str]); 3] =
    [("text_1", &["text_2"]), ("queries", &["documents", "items"]), ("data_1", &["data_2"])];

/// Which names the pair was sent under, (first, second): one pair only (else 400 at the
/// second name sent), `text_1`/`text_2` when none is.
fn pair_names(obj: &Map<String, Value>) -> Result<(&'static str, &'static str), ApiError> {
    let sent = |k: &str| obj.get(k).is_some_and(|v| !v.is_null());
    let mut firsts = PAIR_NAMES.iter().filter(|(first, _)| sent(first));
    let Some(&(first, seconds)) = firsts.next() else { return Ok(("text_1", "text_2")) };
    if let Some((other, _)) = firsts.next() {
        return Err(ApiError::invalid(*other, format!("Send one pair of texts: `{first}` or `{other}`, not both.")));
    }
    let mut given = seconds.iter().filter(|k| sent(k));
    let second = given.next().copied().unwrap_or(seconds[0]);
    if let Some(other) = given.next() {
        return Err(ApiError::invalid(*other, format!("Send `{second}` or `{other}`, not both.")));
    }
    Ok((first, second))
}

/// `/score`.
pub(crate) fn prepare_score(router: &Router, body: &[u8], header_id: Option<&str>) -> Result<Checked, ApiError> {
    let mut value = parse_body(body)?;
    let obj = value.as_object_mut().expect("parse_body checks");
    let (name_1, name_2) = pair_names(obj)?;
    // (read as `text_1`/`text_2`; errors name the fields as sent)
    for (name, field) in [(name_1, "text_1"), (name_2, "text_2")] {
        match obj.remove(name) {
            Some(v) => {
                obj.insert(field.into(), v);
            }
            None if name != field => return Err(missing(name.into())),
            None => {}
        }
    }
    let f: ScoreFields = from_value(&value)?;
    let lora = router.check_model(&f.model)?;
    let pooling = embedder(router, &f.model)?.pooling;
    let ignored = settle_ignored(set_keys(&f.extra, &value).cloned().collect(), router.config.strict_fields)?;
    let first = texts(&f.text_1, name_1)?;
    let second = texts(&f.text_2, name_2)?;
    let pairs: Vec<(usize, usize)> = match (first.len(), second.len()) {
        (1, m) => (0..m).map(|j| (0, 1 + j)).collect(),
        (n, m) if n == m => (0..n).map(|i| (i, n + i)).collect(),
        (n, m) => {
            return Err(ApiError::invalid(
                name_2,
                format!(
                    "`{name_1}` holds {n} texts and `{name_2}` {m}: one `{name_1}` is scored against every \
                     `{name_2}`, several pair by pair, which needs as many of each."
                ),
            ))
        }
    };
    let inputs = Inputs {
        texts: first.into_iter().chain(second).collect(),
        add_special_tokens: true,
        truncate_prompt_tokens: f.truncate_prompt_tokens,
        priority: f.priority,
        request_id: f.request_id,
        cache_salt: f.cache_salt,
        user: f.user,
    };
    let plan = scoring_plan(pooling, Scoring::Pairs(pairs));
    inputs_prepared(router, Endpoint::Score, "score", f.model, lora, inputs, plan, ignored, header_id)
}

/// `/rerank`.
pub(crate) fn prepare_rerank(router: &Router, body: &[u8], header_id: Option<&str>) -> Result<Checked, ApiError> {
    let value = parse_body(body)?;
    let f: RerankFields = from_value(&value)?;
    let lora = router.check_model(&f.model)?;
    let pooling = embedder(router, &f.model)?.pooling;
    let mut ignored: Vec<String> = set_keys(&f.extra, &value).cloned().collect();
    let documents = documents(&f.documents, &mut ignored)?;
    let ignored = settle_ignored(ignored, router.config.strict_fields)?;
    let query = match &f.query {
        Value::String(s) if s.is_empty() => return Err(ApiError::invalid("query", "The query must not be empty.")),
        Value::String(s) => (PromptIn::Text(s.clone()), "query".to_string()),
        other => return Err(invalid_type("query", format!("`query` must be a string, not {}.", kind_of(other)))),
    };
    let top_n = match f.top_n {
        None => 0,
        Some(n) if n >= 0 => n as usize,
        Some(n) => {
            return Err(ApiError::invalid("top_n", format!("`top_n` must be 0 (every document) or more, got {n}.")))
        }
    };
    let shown = f.return_documents.unwrap_or(true).then(|| documents.iter().map(|(text, _)| text.clone()).collect());
    let scoring = Scoring::Rerank { top_n, documents: shown };
    let inputs = Inputs {
        texts: std::iter::once(query).chain(documents.into_iter().map(|(t, p)| (PromptIn::Text(t), p))).collect(),
        add_special_tokens: true,
        truncate_prompt_tokens: f.truncate_prompt_tokens,
        priority: f.priority,
        request_id: f.request_id,
        cache_salt: f.cache_salt,
        user: f.user,
    };
    let plan = scoring_plan(pooling, scoring);
    inputs_prepared(router, Endpoint::Rerank, "rerank", f.model, lora, inputs, plan, ignored, header_id)
}

/// The inputs' embeddings as `/v1/embeddings` pools them, full length (a cosine needs no
/// normalizing).
fn scoring_plan(pooling: Pooling, scoring: Scoring) -> EmbeddingPlan {
    EmbeddingPlan { pooling, normalize: false, dimensions: None, base64: false, scoring: Some(Arc::new(scoring)) }
}

/// `text_1` / `text_2` (under the name `field` sent): a string or a non-empty array of strings,
/// none empty.
fn texts(v: &Value, field: &str) -> Result<Vec<(PromptIn, String)>, ApiError> {
    let one = |s: &str, param: String| {
        if s.is_empty() {
            Err(ApiError::invalid(param, "Texts to score must not be empty."))
        } else {
            Ok((PromptIn::Text(s.to_string()), param))
        }
    };
    match v {
        Value::String(s) => Ok(vec![one(s, field.to_string())?]),
        Value::Array(items) if items.is_empty() => {
            Err(ApiError::invalid(field, format!("`{field}` must hold at least one text.")))
        }
        Value::Array(items) if items.len() > MAX_INPUTS => Err(too_many(field, items.len())),
        Value::Array(items) => items
            .iter()
            .enumerate()
            .map(|(i, item)| match item {
                Value::String(s) => one(s, format!("{field}[{i}]")),
                other => Err(invalid_type(
                    format!("{field}[{i}]"),
                    format!("Texts to score must be strings, not {}.", kind_of(other)),
                )),
            })
            .collect(),
        other => Err(invalid_type(
            field,
            format!("`{field}` must be a string or an array of strings, not {}.", kind_of(other)),
        )),
    }
}

/// `documents`: a non-empty array of strings or `{"text": ...}` objects; (text, param) each.
/// An object's other keys (Cohere's `title`, ...) are neither ranked nor echoed: reported in
/// `ignored`.
fn documents(v: &Value, ignored: &mut Vec<String>) -> Result<Vec<(String, String)>, ApiError> {
    let Value::Array(items) = v else {
        return Err(invalid_type("documents", format!("`documents` must be an array of strings, not {}.", kind_of(v))));
    };
    if items.is_empty() {
        return Err(ApiError::invalid("documents", "`documents` must hold at least one document."));
    }
    if items.len() >= MAX_INPUTS {
        return Err(ApiError::invalid(
            "documents",
            format!(
                "At most {} documents may be ranked in one request (they and the query are at most {MAX_INPUTS} \
                 texts), got {}.",
                MAX_INPUTS - 1,
                items.len()
            ),
        ));
    }
    for (i, item) in items.iter().enumerate() {
        if let Value::Object(o) = item {
            ignored.extend(
                o.iter().filter(|(k, v)| *k != "text" && !v.is_null()).map(|(k, _)| format!("documents[{i}].{k}")),
            );
        }
    }
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            let param = format!("documents[{i}]");
            let text = match item {
                Value::String(s) => s,
                Value::Object(o) => match o.get("text") {
                    Some(Value::String(s)) => s,
                    _ => {
                        return Err(invalid_type(
                            format!("{param}.text"),
                            "A document object holds its text as a string under `text`.",
                        ))
                    }
                },
                other => {
                    return Err(invalid_type(
                        param,
                        format!("Documents must be strings or {{\"text\": ...}} objects, not {}.", kind_of(other)),
                    ))
                }
            };
            if text.is_empty() {
                return Err(ApiError::invalid(param, "Documents must not be empty."));
            }
            Ok((text.clone(), param))
        })
        .collect()
}

fn too_many(field: &str, got: usize) -> ApiError {
    ApiError::invalid(field, format!("At most {MAX_INPUTS} texts may be scored in `{field}`, got {got}."))
}
