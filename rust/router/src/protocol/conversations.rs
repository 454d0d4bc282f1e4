//! `/v1/conversations`: OpenAI's Conversations API, over [`crate::conversation_store`].
//!
//! ```text
//! POST   /v1/conversations                      {items?, metadata?} -> conversation
//! GET    /v1/conversations/{id}                                     -> conversation
//! POST   /v1/conversations/{id}                 {metadata}          -> conversation
//! DELETE /v1/conversations/{id}                                     -> conversation.deleted
//! POST   /v1/conversations/{id}/items           {items}             -> list of the items added
//! GET    /v1/conversations/{id}/items           ?order&limit&after  -> a page of its items
//! GET    /v1/conversations/{id}/items/{item}                        -> the item
//! DELETE /v1/conversations/{id}/items/{item}                        -> conversation
//! ```
//!
//! Items are checked as `/v1/responses` checks its input items (an `item_reference` is the
//! stored item it names) and kept as the Responses routes list them: with an `id` and a
//! `status`, a message's content as typed parts. At most 20 are added at a time, as OpenAI's.
//! A response continues a conversation with `conversation` (see [`super::responses`]).
//!
//! Decisions: `include: message.output_text.logprobs` lists the logprobs an item's response
//! made (without it they are left out, as OpenAI's); its other values ask for fields of
//! built-in tool calls this server never makes and are reported, as are query keys these
//! routes do not read. A deleted conversation's items go with it (OpenAI keeps them).

use serde_json::{json, Map, Value};

use super::common::{as_object, check_metadata, ignored_header, invalid_type, kind_of, parse_body, settle_ignored};
use super::{responses, Handled};
use crate::error::ApiError;
use crate::router::Router;

/// The most items one request adds, as OpenAI's.
const MAX_ITEMS: usize = 20;

/// Which of the routes a request is for: the path's ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target<'a> {
    /// `/v1/conversations`
    All,
    /// `/v1/conversations/{id}`
    One(&'a str),
    /// `/v1/conversations/{id}/items`
    Items(&'a str),
    /// `/v1/conversations/{id}/items/{item}`
    Item(&'a str, &'a str),
}

/// Answers `method` on `target`, with the query's pairs (as sent, repeated keys included) and
/// the body.
pub fn handle(
    router: &Router,
    method: &str,
    target: Target<'_>,
    query: &[(String, String)],
    body: &[u8],
) -> Result<Handled, ApiError> {
    let store = router.conversations();
    if !store.enabled() {
        return Err(ApiError::NotFound {
            message: "Conversations are not kept on this server (--responses-store-mib 0): send the whole \
                      conversation in each request's `input`."
                .into(),
        });
    }
    let mut ignored = Vec::new();
    let logprobs = includes_logprobs(query, &mut ignored);
    let mut read = |keys: &[&str]| query_keys(query, keys, &mut ignored);
    let object = match (method, target) {
        ("POST", Target::All) => {
            read(&[]);
            // (every field is optional: no body is an empty conversation)
            let value = if body.trim_ascii().is_empty() { json!({}) } else { parse_body(body)? };
            let obj = value.as_object().expect("parse_body checks");
            let items = match obj.get("items") {
                None | Some(Value::Null) => Vec::new(),
                Some(items) => checked_items(router, items, &mut ignored)?,
            };
            let metadata = metadata(obj.get("metadata"))?;
            ignored.extend(super::chat::unknown_keys_in(obj, &["items", "metadata"], "").into_iter().map(top));
            let ignored = settle_ignored(ignored, router.config.strict_fields)?;
            return answer(&store.create(metadata, &items)?, &ignored);
        }
        ("GET", Target::One(id)) => {
            read(&[]);
            store.object(id)?
        }
        ("POST", Target::One(id)) => {
            read(&[]);
            let value = parse_body(body)?;
            let obj = value.as_object().expect("parse_body checks");
            if !obj.contains_key("metadata") {
                return Err(super::chat::missing("metadata".into()));
            }
            let metadata = metadata(obj.get("metadata"))?;
            ignored.extend(super::chat::unknown_keys_in(obj, &["metadata"], "").into_iter().map(top));
            let ignored = settle_ignored(ignored, router.config.strict_fields)?;
            return answer(&store.update(id, metadata)?, &ignored);
        }
        ("DELETE", Target::One(id)) => {
            read(&[]);
            // (under --strict-fields, a request that would be refused changes nothing)
            let ignored = settle_ignored(ignored, router.config.strict_fields)?;
            return answer(&store.delete(id)?, &ignored);
        }
        ("POST", Target::Items(id)) => {
            read(&[]);
            store.object(id)?; // (an unknown conversation is a 404 before the body's errors)
            let value = parse_body(body)?;
            let obj = value.as_object().expect("parse_body checks");
            let items = match obj.get("items") {
                None | Some(Value::Null) => return Err(super::chat::missing("items".into())),
                Some(Value::Array(list)) if list.is_empty() => {
                    return Err(ApiError::invalid("items", "`items` must not be an empty list."))
                }
                Some(items) => checked_items(router, items, &mut ignored)?,
            };
            ignored.extend(super::chat::unknown_keys_in(obj, &["items"], "").into_iter().map(top));
            let ignored = settle_ignored(ignored, router.config.strict_fields)?;
            store.append(id, &items, "items", false)?;
            return answer(&crate::response_store::list_body(shown(items, logprobs), false), &ignored);
        }
        ("GET", Target::Items(id)) => {
            let q = read(&["order", "limit", "after"]);
            let text = |k: &str| q.get(k).and_then(Value::as_str);
            let ignored = settle_ignored(ignored, router.config.strict_fields)?;
            let (items, after) = store.listing(id, text("after"))?;
            let (places, values): (Vec<_>, Vec<_>) = items.into_iter().unzip();
            let items = places.into_iter().zip(shown(values, logprobs)).collect();
            let (page, has_more) =
                crate::response_store::page_by_place(items, text("order").unwrap_or("desc"), text("limit"), after)?;
            let body = serde_json::to_vec(&crate::response_store::list_body(page, has_more)).expect("JSON serializes");
            return Ok(Handled { body, headers: ignored_header(&ignored).into_iter().collect() });
        }
        ("GET", Target::Item(id, item)) => {
            read(&[]);
            shown(vec![store.item(id, item)?], logprobs).remove(0)
        }
        ("DELETE", Target::Item(id, item)) => {
            read(&[]);
            let ignored = settle_ignored(ignored, router.config.strict_fields)?;
            return answer(&store.delete_item(id, item)?, &ignored);
        }
        (other, _) => {
            return Err(ApiError::with_code(
                "method_not_allowed",
                None,
                format!("{other} is not allowed on this conversations route."),
            ))
        }
    };
    let ignored = settle_ignored(ignored, router.config.strict_fields)?;
    answer(&object, &ignored)
}

/// Whether a query's `include` asks for output logprobs, which items keep when their response
/// made them; any other value names fields of built-in tool calls, which never occur here, and
/// is reported as `include`.
pub(crate) fn includes_logprobs(query: &[(String, String)], ignored: &mut Vec<String>) -> bool {
    let includes: Vec<&str> =
        query.iter().filter(|(k, _)| k.strip_suffix("[]").unwrap_or(k) == "include").map(|(_, v)| v.as_str()).collect();
    if includes.iter().any(|v| *v != responses::LOGPROBS_INCLUDE) {
        ignored.push("include".to_string());
    }
    includes.contains(&responses::LOGPROBS_INCLUDE)
}

/// The query's values of `keys` (the last of a repeated one); keys neither there nor `include`
/// are reported.
pub(crate) fn query_keys(query: &[(String, String)], keys: &[&str], ignored: &mut Vec<String>) -> Map<String, Value> {
    let mut known = Map::new();
    for (k, v) in query {
        let key = k.strip_suffix("[]").unwrap_or(k);
        if key == "include" {
            continue;
        } else if keys.contains(&key) {
            known.insert(key.to_string(), Value::String(v.clone()));
        } else {
            ignored.push(key.to_string());
        }
    }
    known
}

/// `items` as listed: their output text's `logprobs` only when `include` asks for them.
pub(crate) fn shown(mut items: Vec<Value>, logprobs: bool) -> Vec<Value> {
    if !logprobs {
        for part in items.iter_mut().filter_map(|i| i.get_mut("content")?.as_array_mut()).flatten() {
            if let Some(part) = part.as_object_mut() {
                part.remove("logprobs");
            }
        }
    }
    items
}

/// A top-level key as `unknown_keys_in` with an empty prefix names it (`.key`).
fn top(path: String) -> String {
    path.trim_start_matches('.').to_string()
}

pub(crate) fn answer(object: &Value, ignored: &[String]) -> Result<Handled, ApiError> {
    let body = serde_json::to_vec(object).expect("JSON values serialize");
    Ok(Handled { body, headers: ignored_header(ignored).into_iter().collect() })
}

/// `metadata`: an object of OpenAI's limits (absent or null: none).
fn metadata(value: Option<&Value>) -> Result<Map<String, Value>, ApiError> {
    match value {
        None | Some(Value::Null) => Ok(Map::new()),
        Some(v) => {
            let m = as_object(v, "metadata", "`metadata`")?;
            check_metadata(m)?;
            Ok(m.clone())
        }
    }
}

/// `items` checked and listed, at most [`MAX_ITEMS`].
fn checked_items(router: &Router, items: &Value, ignored: &mut Vec<String>) -> Result<Vec<Value>, ApiError> {
    let Value::Array(list) = items else {
        return Err(invalid_type("items", format!("`items` must be a list of items, not {}.", kind_of(items))));
    };
    if list.len() > MAX_ITEMS {
        return Err(ApiError::invalid(
            "items",
            format!("At most {MAX_ITEMS} items can be added at a time, got {}.", list.len()),
        ));
    }
    responses::conversation_items(router, items, ignored)
}
