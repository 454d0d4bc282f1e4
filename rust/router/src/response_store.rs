//! Stored Responses (`store`, OpenAI's default): each response a `/v1/responses` request
//! produced, kept in memory so that a later request can continue it (`previous_response_id`)
//! and `GET /v1/responses/{id}` can read it back.
//!
//! What is kept: the response object as sent, and the conversation it answered as Responses
//! items (the items of the responses it continued, then its own input; `instructions` are
//! not carried over, as in OpenAI's), both as JSON text: the bytes counted against the bound
//! (`--responses-store-mib`) are the memory held. Past the bound the oldest responses are
//! forgotten first; one larger than the whole bound is not kept. It lives as long as the
//! process: one server's responses are not known to another replica.
//!
//! Every item a stored response holds (its conversation's and its output's, each with an
//! `id`) can be sent again by reference (`{"type": "item_reference", "id"}`): the store
//! indexes the ids and reads the item back from the newest response that holds it.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use serde_json::{json, Value};

use crate::error::ApiError;

/// One stored response, as JSON text (a tree of values would take several times its size).
#[derive(Debug)]
pub struct Stored {
    /// The response object, as the client got it (the final one, when streamed).
    body: Vec<u8>,
    /// The conversation it answered: a JSON array of input items (each with an `id`).
    input: Vec<u8>,
    /// The ids of its items, input and output, each once.
    item_ids: Vec<String>,
}

impl Stored {
    pub fn new(body: &Value, input: &[Value]) -> Self {
        let output = body["output"].as_array().map(Vec::as_slice).unwrap_or_default();
        let mut item_ids: Vec<String> =
            input.iter().chain(output).filter_map(|i| i["id"].as_str()).map(str::to_string).collect();
        item_ids.sort_unstable();
        item_ids.dedup();
        let body = serde_json::to_vec(body).expect("JSON values serialize");
        Self { body, input: serde_json::to_vec(input).expect("JSON values serialize"), item_ids }
    }

    /// The memory it holds, its entries in the item index included.
    fn bytes(&self) -> usize {
        self.body.len() + self.input.len() + self.item_ids.iter().map(|i| 2 * i.len() + 48).sum::<usize>()
    }

    /// The conversation it answered, as input items.
    pub fn input(&self) -> Vec<Value> {
        serde_json::from_slice(&self.input).unwrap_or_default()
    }

    /// The response's output items.
    pub fn output(&self) -> Vec<Value> {
        let body: Value = serde_json::from_slice(&self.body).unwrap_or_default();
        body["output"].as_array().cloned().unwrap_or_default()
    }
}

#[derive(Default)]
pub struct Inner {
    map: HashMap<String, (Arc<Stored>, usize)>,
    /// Ids, oldest first.
    order: VecDeque<String>,
    /// Item id -> the ids of the responses that hold the item, oldest first.
    items: HashMap<String, Vec<String>>,
    bytes: usize,
}

impl Inner {
    /// Forgets the response `id` and its entries in the item index; its size, if it was kept.
    fn remove(&mut self, id: &str) -> Option<usize> {
        let (stored, size) = self.map.remove(id)?;
        self.bytes -= size;
        for item in &stored.item_ids {
            if let Some(holders) = self.items.get_mut(item) {
                holders.retain(|r| r != id);
                if holders.is_empty() {
                    self.items.remove(item);
                }
            }
        }
        Some(size)
    }
}

/// The responses kept, up to `capacity` bytes (0: none are kept).
pub type ResponseStore = crate::bounded::Bounded<Inner>;

fn not_found(id: &str) -> ApiError {
    ApiError::NotFound { message: format!("No response with id {id:?}: it was never stored, was deleted, or was forgotten to keep the store within its bound.") }
}

impl ResponseStore {
    /// Keeps `stored` under `id`, forgetting the oldest responses past the bound. One larger
    /// than the whole bound is not kept.
    pub fn put(&self, id: &str, stored: Stored) {
        let size = stored.bytes();
        if size > self.capacity {
            return;
        }
        let mut inner = self.lock();
        if inner.remove(id).is_some() {
            inner.order.retain(|k| k != id);
        }
        while inner.bytes + size > self.capacity {
            let Some(oldest) = inner.order.pop_front() else { break };
            inner.remove(&oldest);
        }
        inner.bytes += size;
        inner.order.push_back(id.to_string());
        for item in &stored.item_ids {
            inner.items.entry(item.clone()).or_default().push(id.to_string());
        }
        inner.map.insert(id.to_string(), (Arc::new(stored), size));
    }

    /// The item with id `item`, as the newest stored response that holds it lists it (one of
    /// its conversation's items, or one of its output items).
    pub fn item(&self, item: &str) -> Option<Value> {
        let stored = {
            let inner = self.lock();
            let newest = inner.items.get(item)?.last()?;
            inner.map.get(newest)?.0.clone()
        };
        // (parsed outside the lock)
        stored.input().into_iter().chain(stored.output()).find(|i| i["id"] == item)
    }

    /// The response stored under `id`, or a 404.
    pub fn get(&self, id: &str) -> Result<Arc<Stored>, ApiError> {
        self.lock().map.get(id).map(|(s, _)| s.clone()).ok_or_else(|| not_found(id))
    }

    /// Forgets `id`: the `DELETE /v1/responses/{id}` body, or a 404.
    pub fn delete(&self, id: &str) -> Result<Vec<u8>, ApiError> {
        let mut inner = self.lock();
        inner.remove(id).ok_or_else(|| not_found(id))?;
        inner.order.retain(|k| k != id);
        Ok(serde_json::to_vec(&json!({"id": id, "object": "response", "deleted": true})).expect("JSON serializes"))
    }

    /// The `GET /v1/responses/{id}` body.
    pub fn body(&self, id: &str) -> Result<Vec<u8>, ApiError> {
        Ok(self.get(id)?.body.clone())
    }

    /// The `GET /v1/responses/{id}/input_items` body: a page of the conversation's items,
    /// `order` "desc" (newest first, OpenAI's default) or "asc", at most `limit` (the query's
    /// text, an integer 1..=100; 20 when not given) after the item with id `after`.
    pub fn input_items(
        &self,
        id: &str,
        order: &str,
        limit: Option<&str>,
        after: Option<&str>,
    ) -> Result<Vec<u8>, ApiError> {
        let stored = self.get(id)?;
        page(stored.input(), order, limit, after)
    }
}

/// A page of `items` (each with an `id`), as OpenAI's list routes answer: `order` "desc"
/// (newest first) or "asc", at most `limit` (the query's text, an integer 1..=100; 20 when not
/// given) after the item with id `after`.
pub(crate) fn page(
    items: Vec<Value>,
    order: &str,
    limit: Option<&str>,
    after: Option<&str>,
) -> Result<Vec<u8>, ApiError> {
    let (page, has_more) = page_of(items, order, limit, after)?;
    Ok(serde_json::to_vec(&list_body(page, has_more)).expect("JSON serializes"))
}

/// OpenAI's list object of `data` (each with an `id`).
pub(crate) fn list_body(data: Vec<Value>, has_more: bool) -> Value {
    json!({
        "object": "list",
        "first_id": data.first().map(|i| i["id"].clone()),
        "last_id": data.last().map(|i| i["id"].clone()),
        "has_more": has_more,
        "data": data,
    })
}

/// `page`'s items, and whether more come after them.
pub(crate) fn page_of(
    mut items: Vec<Value>,
    order: &str,
    limit: Option<&str>,
    after: Option<&str>,
) -> Result<(Vec<Value>, bool), ApiError> {
    let limit = match limit.map(str::parse::<usize>) {
        None => 20,
        Some(Ok(n)) if (1..=100).contains(&n) => n,
        _ => {
            return Err(ApiError::invalid(
                "limit",
                format!("`limit` must be an integer between 1 and 100, got {:?}.", limit.unwrap_or_default()),
            ))
        }
    };
    match order {
        "desc" => items.reverse(),
        "asc" => {}
        other => {
            return Err(ApiError::invalid("order", format!("`order` must be \"asc\" or \"desc\", not {other:?}.")))
        }
    }
    let start = match after {
        None => 0,
        Some(after) => {
            // (the last holder of the id: an item referenced again appears twice in a
            // response's conversation, and a cursor at the first would page back forever)
            let at = items.iter().rposition(|i| i["id"] == after);
            at.ok_or_else(|| ApiError::invalid("after", format!("No item with id {after:?} in this list.")))? + 1
        }
    };
    let total = items.len();
    let page: Vec<Value> = items.into_iter().skip(start).take(limit).collect();
    let has_more = start + page.len() < total;
    Ok((page, has_more))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(text: &str) -> Stored {
        Stored::new(&json!({"output": [text]}), &[json!({"id": "msg_1", "content": text})])
    }

    #[test]
    fn the_oldest_go_first_past_the_bound() {
        let one = stored("aaaa").bytes();
        let store = ResponseStore::new(2 * one);
        store.put("a", stored("aaaa"));
        store.put("b", stored("bbbb"));
        assert!(store.get("a").is_ok() && store.get("b").is_ok());
        store.put("c", stored("cccc"));
        assert_eq!(store.get("a").unwrap_err().status(), 404);
        assert!(store.get("b").is_ok() && store.get("c").is_ok());
        // deleting frees its room
        store.delete("b").unwrap();
        store.put("d", stored("dddd"));
        assert!(store.get("c").is_ok() && store.get("d").is_ok());
        assert_eq!(store.delete("b").unwrap_err().status(), 404);
        // one larger than the bound is not kept, and forgets nothing
        store.put("big", stored(&"x".repeat(4 * one)));
        assert!(store.get("big").is_err() && store.get("c").is_ok());
    }

    #[test]
    fn items_are_found_by_id_while_a_response_holds_them() {
        let item = |id: &str, text: &str| json!({"id": id, "type": "message", "role": "user", "content": text});
        let store = ResponseStore::new(1 << 20);
        let output = json!({"output": [{"id": "msg_out", "type": "message", "role": "assistant"}]});
        store.put("r1", Stored::new(&output, &[item("msg_a", "first")]));
        assert_eq!(store.item("msg_a").unwrap()["content"], "first");
        assert_eq!(store.item("msg_out").unwrap()["role"], "assistant");
        assert_eq!(store.item("msg_nope"), None);
        // a continuation holds the same items: the newest holder answers, and the item
        // outlives the response that first held it
        store.put("r2", Stored::new(&json!({"output": []}), &[item("msg_a", "first"), item("msg_a", "first")]));
        store.delete("r1").unwrap();
        assert_eq!(store.item("msg_a").unwrap()["content"], "first");
        assert_eq!(store.item("msg_out"), None);
        store.delete("r2").unwrap();
        assert_eq!(store.item("msg_a"), None);
        // forgotten past the bound, or replaced under the same id
        let one = Stored::new(&json!({"output": []}), &[item("msg_b", "b")]).bytes();
        let small = ResponseStore::new(one);
        small.put("r", Stored::new(&json!({"output": []}), &[item("msg_b", "b")]));
        small.put("r", Stored::new(&json!({"output": []}), &[item("msg_c", "c")]));
        assert_eq!((small.item("msg_b"), small.item("msg_c").is_some()), (None, true));
        small.put("s", Stored::new(&json!({"output": []}), &[item("msg_d", "d")]));
        assert_eq!((small.item("msg_c"), small.item("msg_d").is_some()), (None, true));
        assert!(small.lock().items.len() == 1);
    }

    #[test]
    fn input_items_page_through_the_conversation() {
        let store = ResponseStore::new(1 << 20);
        let input: Vec<Value> =
            (0..5).map(|i| json!({"id": format!("msg_{i}"), "role": "user", "content": "x"})).collect();
        store.put("r", Stored::new(&json!({}), &input));
        let page = |order: &str, limit: &str, after: Option<&str>| -> Value {
            serde_json::from_slice(&store.input_items("r", order, Some(limit), after).unwrap()).unwrap()
        };
        let ids = |v: &Value| v["data"].as_array().unwrap().iter().map(|i| i["id"].clone()).collect::<Vec<_>>();
        let first = page("desc", "2", None);
        assert_eq!(ids(&first), [json!("msg_4"), json!("msg_3")]);
        assert_eq!((first["has_more"].clone(), first["last_id"].clone()), (json!(true), json!("msg_3")));
        let last = page("desc", "2", Some("msg_1"));
        assert_eq!((ids(&last), last["has_more"].clone()), (vec![json!("msg_0")], json!(false)));
        assert_eq!(ids(&page("asc", "20", None)).len(), 5);
        assert_eq!(store.input_items("r", "up", None, None).unwrap_err().param(), Some("order"));
        for bad in ["0", "101", "-1", "99999999999999999999", "2.0", "x"] {
            assert_eq!(store.input_items("r", "asc", Some(bad), None).unwrap_err().param(), Some("limit"), "{bad}");
        }
    }
}
