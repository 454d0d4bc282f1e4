//! The stored chat completions' routes (OpenAI's; `store: true` keeps them,
//! [`crate::chat_store`]):
//!
//! ```text
//! GET    /v1/chat/completions                 ?model&metadata[k]=v&order&limit&after -> a page of completions
//! GET    /v1/chat/completions/{id}                                                   -> the completion
//! POST   /v1/chat/completions/{id}            {metadata}                             -> the completion
//! DELETE /v1/chat/completions/{id}                                                   -> chat.completion.deleted
//! GET    /v1/chat/completions/{id}/messages   ?order&limit&after                     -> a page of its messages
//! ```
//!
//! `order` is "asc" (oldest first) by default on both lists, as OpenAI's. Query keys these
//! routes do not read are reported in `llmserve-ignored-fields`, as are a body's.

use serde_json::{Map, Value};

use super::common::{as_object, check_metadata, ignored_header, parse_body, settle_ignored};
use super::Handled;
use crate::error::ApiError;
use crate::router::Router;

/// Which route a request is for: the path's id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target<'a> {
    /// `/v1/chat/completions`
    All,
    /// `/v1/chat/completions/{id}`
    One(&'a str),
    /// `/v1/chat/completions/{id}/messages`
    Messages(&'a str),
}

impl Target<'_> {
    fn is_one(&self) -> bool {
        matches!(self, Self::One(_))
    }
}

/// Answers `method` on `target`, with the query's pairs (as sent) and the body.
pub fn handle(
    router: &Router,
    method: &str,
    target: Target<'_>,
    query: &[(String, String)],
    body: &[u8],
) -> Result<Handled, ApiError> {
    let store = router.chat_store();
    if !store.enabled() {
        return Err(ApiError::NotFound {
            message: "Chat completions are not stored on this server (--responses-store-mib 0).".into(),
        });
    }
    let mut ignored = Vec::new();
    let mut known: Map<String, Value> = Map::new();
    let mut metadata = Vec::new();
    let readable: &[&str] = match target {
        Target::All if method == "GET" => &["model", "order", "limit", "after"],
        Target::Messages(_) => &["order", "limit", "after"],
        _ => &[],
    };
    for (k, v) in query {
        let meta = k.strip_prefix("metadata[").and_then(|k| k.strip_suffix(']'));
        match meta {
            Some(key) if target == Target::All => metadata.push((key.to_string(), v.clone())),
            _ if readable.contains(&k.as_str()) => {
                known.insert(k.clone(), Value::String(v.clone()));
            }
            _ => ignored.push(k.clone()),
        }
    }
    let text = |k: &str| known.get(k).and_then(Value::as_str);
    // an update's metadata, read (and what else its body holds reported) before anything changes
    let mut update = None;
    if (method, target.is_one()) == ("POST", true) {
        let value = parse_body(body)?;
        let obj = value.as_object().expect("parse_body checks");
        update = Some(match obj.get("metadata") {
            None => return Err(super::chat::missing("metadata".into())),
            Some(Value::Null) => Map::new(),
            Some(m) => {
                let m = as_object(m, "metadata", "`metadata`")?;
                check_metadata(m)?;
                m.clone()
            }
        });
        ignored.extend(obj.keys().filter(|k| *k != "metadata").cloned());
    }
    // (under --strict-fields, a request that would be refused changes nothing)
    let ignored = settle_ignored(ignored, router.config.strict_fields)?;
    let object = match (method, target) {
        ("GET", Target::All) => {
            store.list(text("model"), &metadata, text("order").unwrap_or("asc"), text("limit"), text("after"))?
        }
        ("GET", Target::One(id)) => store.object(id)?,
        ("POST", Target::One(id)) => store.update(id, update.unwrap_or_default())?,
        ("DELETE", Target::One(id)) => store.delete(id)?,
        ("GET", Target::Messages(id)) => {
            store.messages(id, text("order").unwrap_or("asc"), text("limit"), text("after"))?
        }
        (other, _) => {
            return Err(ApiError::with_code(
                "method_not_allowed",
                None,
                format!("{other} is not allowed on this stored chat completions route."),
            ))
        }
    };
    let body = serde_json::to_vec(&object).expect("JSON values serialize");
    Ok(Handled { body, headers: ignored_header(&ignored).into_iter().collect() })
}
