//! Stored chat completions (`store: true` on `/v1/chat/completions`, OpenAI's): each kept
//! completion, its request's messages and its `metadata`, for `GET /v1/chat/completions`
//! (a list, filtered by `model` and `metadata`), `GET`/`POST`/`DELETE
//! /v1/chat/completions/{id}` and `GET /v1/chat/completions/{id}/messages`.
//!
//! Kept in this process's memory as JSON text within `--responses-store-mib` (counted apart
//! from the stored responses and the conversations), the oldest forgotten first; one larger
//! than the whole bound is not kept. A completion streamed is kept as the same request's
//! non-streamed body (without vLLM's `token_ids`, which the stream carried).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use serde_json::{json, Map, Value};

use crate::error::ApiError;

/// One kept completion.
#[derive(Debug)]
pub struct StoredChat {
    /// The completion object as the client got it (non-streamed), JSON text.
    body: Vec<u8>,
    /// Its request's messages as OpenAI lists them (each with an `id`), a JSON array.
    messages: Vec<u8>,
    model: String,
    metadata: Map<String, Value>,
    /// Its `created` (lists are ordered by it, as OpenAI's).
    created: u64,
    /// When it was kept, in the store's count (the order of those created in one second).
    seq: u64,
}

impl StoredChat {
    fn bytes(&self) -> usize {
        let metadata: usize = self.metadata.iter().map(|(k, v)| k.len() + v.as_str().map_or(0, str::len)).sum();
        self.body.len() + self.messages.len() + self.model.len() + metadata + 128
    }

    /// The completion object, with its `metadata`.
    fn object(&self) -> Value {
        let mut body: Value = serde_json::from_slice(&self.body).unwrap_or_default();
        body["metadata"] = Value::Object(self.metadata.clone());
        body
    }
}

/// What a request with `store: true` keeps once its completion is done.
#[derive(Debug)]
pub struct Keep {
    store: Arc<ChatStore>,
    messages: Vec<u8>,
    model: String,
    metadata: Map<String, Value>,
}

impl Keep {
    /// `messages`: the request's, as sent; `id`: the completion's (each message's id is it and
    /// the message's place).
    pub fn new(store: Arc<ChatStore>, id: &str, messages: &[Value], model: &str, metadata: Map<String, Value>) -> Self {
        let listed: Vec<Value> = messages.iter().enumerate().map(|(i, m)| listed(id, i, m)).collect();
        let messages = serde_json::to_vec(&listed).expect("JSON values serialize");
        Self { store, messages, model: model.to_string(), metadata }
    }

    /// Keeps the completion `body` (a non-streamed body's JSON, `created` then) under `id`.
    pub fn put(&self, id: &str, body: Vec<u8>, created: u64) {
        let stored = StoredChat {
            body,
            messages: self.messages.clone(),
            model: self.model.clone(),
            metadata: self.metadata.clone(),
            created,
            seq: 0,
        };
        self.store.put(id, stored);
    }
}

impl PartialEq for Keep {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.store, &other.store)
            && (&self.messages, &self.model, &self.metadata) == (&other.messages, &other.model, &other.metadata)
    }
}

/// A request message as a stored completion lists it: with an `id`, its text `content` (a list
/// of parts joined, the parts kept as `content_parts`), its other keys as sent.
fn listed(id: &str, i: usize, message: &Value) -> Value {
    let mut out = message.as_object().cloned().unwrap_or_default();
    if let Some(Value::Array(parts)) = out.get("content").cloned() {
        let text: String = parts.iter().filter_map(|p| p["text"].as_str()).collect();
        out.insert("content".into(), json!(text));
        out.insert("content_parts".into(), Value::Array(parts));
    } else {
        out.entry("content_parts").or_insert(Value::Null);
    }
    out.insert("id".into(), json!(format!("{id}-{i}")));
    Value::Object(out)
}

/// How many removed completions keep their place in the list (for a cursor naming one).
const GONE_KEPT: usize = 4096;

#[derive(Default)]
pub struct Inner {
    map: HashMap<String, (Arc<StoredChat>, usize)>,
    /// Ids, oldest first.
    order: VecDeque<String>,
    bytes: usize,
    /// Completions kept so far (each one's `seq`).
    kept: u64,
    /// The places (`created`, `seq`) of the newest removed completions, oldest first: a client
    /// paging through a list while it deletes or edits what it lists (`for c in list():
    /// delete(c.id)`) names one as the next page's `after`.
    gone: VecDeque<(String, (u64, u64))>,
}

impl Inner {
    /// Forgets the oldest completions but `keep` until `extra` more bytes fit in `capacity`.
    fn make_room(&mut self, capacity: usize, extra: usize, keep: &str) {
        while self.bytes + extra > capacity {
            let Some(oldest) = self.order.iter().find(|k| *k != keep).cloned() else { break };
            self.remove(&oldest);
        }
    }

    fn remove(&mut self, id: &str) -> bool {
        let Some((gone, size)) = self.map.remove(id) else { return false };
        self.bytes -= size;
        self.order.retain(|k| k != id);
        if self.gone.len() == GONE_KEPT {
            self.gone.pop_front();
        }
        self.gone.push_back((id.to_string(), (gone.created, gone.seq)));
        true
    }

    /// The place in the list of completion `id`, kept or recently removed.
    fn place(&self, id: &str) -> Option<(u64, u64)> {
        let kept = self.map.get(id).map(|(s, _)| (s.created, s.seq));
        kept.or_else(|| self.gone.iter().rev().find(|(g, _)| g == id).map(|(_, place)| *place))
    }
}

/// The kept completions, up to `capacity` bytes (0: none are kept).
pub type ChatStore = crate::bounded::Bounded<Inner>;

fn not_found(id: &str) -> ApiError {
    ApiError::NotFound {
        message: format!(
            "No stored chat completion with id {id:?}: it was not stored (`store: true`), was deleted, or was \
             forgotten to keep this server's store within its bound (--responses-store-mib)."
        ),
    }
}

impl ChatStore {
    /// Keeps `stored` under `id` (replacing one of that id), forgetting the oldest past the
    /// bound; one larger than the whole bound is not kept (and the id then names nothing).
    pub fn put(&self, id: &str, mut stored: StoredChat) {
        let size = stored.bytes();
        let mut inner = self.lock();
        inner.remove(id);
        inner.kept += 1;
        stored.seq = inner.kept;
        if size > self.capacity {
            return;
        }
        inner.make_room(self.capacity, size, id);
        inner.bytes += size;
        inner.order.push_back(id.to_string());
        inner.map.insert(id.to_string(), (Arc::new(stored), size));
    }

    fn get(&self, id: &str) -> Result<Arc<StoredChat>, ApiError> {
        self.lock().map.get(id).map(|(s, _)| s.clone()).ok_or_else(|| not_found(id))
    }

    /// `GET /v1/chat/completions/{id}`: the completion, with its `metadata`.
    pub fn object(&self, id: &str) -> Result<Value, ApiError> {
        Ok(self.get(id)?.object())
    }

    /// `POST /v1/chat/completions/{id}`: replaces its `metadata` (in place, keeping its age,
    /// and forgetting the oldest others should it grow past the bound); the completion.
    pub fn update(&self, id: &str, metadata: Map<String, Value>) -> Result<Value, ApiError> {
        let new = {
            let mut inner = self.lock();
            let (entry, size) = inner.map.get_mut(id).ok_or_else(|| not_found(id))?;
            let new = Arc::new(StoredChat {
                body: entry.body.clone(),
                messages: entry.messages.clone(),
                model: entry.model.clone(),
                metadata,
                created: entry.created,
                seq: entry.seq,
            });
            let (before, after) = (*size, new.bytes());
            (*entry, *size) = (new.clone(), after);
            inner.bytes = inner.bytes + after - before;
            inner.make_room(self.capacity, 0, id);
            new
        };
        Ok(new.object())
    }

    /// `DELETE /v1/chat/completions/{id}`.
    pub fn delete(&self, id: &str) -> Result<Value, ApiError> {
        if !self.lock().remove(id) {
            return Err(not_found(id));
        }
        Ok(json!({"id": id, "object": "chat.completion.deleted", "deleted": true}))
    }

    /// `GET /v1/chat/completions`: a page of the kept completions of `model` (all when None)
    /// whose metadata holds every pair of `metadata`, oldest first with `order` "asc"
    /// (OpenAI's default here). `after` may name a completion the list no longer shows (deleted,
    /// or its metadata edited out of the filter, while its client paged): the page starts after
    /// its place.
    pub fn list(
        &self,
        model: Option<&str>,
        metadata: &[(String, String)],
        order: &str,
        limit: Option<&str>,
        after: Option<&str>,
    ) -> Result<Value, ApiError> {
        let (mut matching, after) = {
            let inner = self.lock();
            let matching: Vec<((u64, u64), Arc<StoredChat>)> = inner
                .order
                .iter()
                .filter_map(|id| inner.map.get(id).map(|(s, _)| ((s.created, s.seq), s.clone())))
                .filter(|(_, s)| model.is_none_or(|m| s.model == m))
                .filter(|(_, s)| metadata.iter().all(|(k, v)| s.metadata.get(k).and_then(Value::as_str) == Some(v)))
                .collect();
            let after = match after {
                None => None,
                Some(id) => Some(inner.place(id).ok_or_else(|| {
                    ApiError::invalid("after", format!("No stored chat completion with id {id:?} to list after."))
                })?),
            };
            (matching, after)
        };
        // (by `created`, as OpenAI's; those created in one second as they were kept)
        matching.sort_by_key(|(place, _)| *place);
        // (each paged as its index: only the page's completions are read back from their JSON)
        let places = matching.iter().enumerate().map(|(i, (place, _))| (*place, json!(i))).collect();
        let (page, has_more) = crate::response_store::page_by_place(places, order, limit, after)?;
        let data = page.iter().filter_map(|i| Some(matching[i.as_u64()? as usize].1.object())).collect();
        Ok(crate::response_store::list_body(data, has_more))
    }

    /// `GET /v1/chat/completions/{id}/messages`: a page of its request's messages.
    pub fn messages(&self, id: &str, order: &str, limit: Option<&str>, after: Option<&str>) -> Result<Value, ApiError> {
        let stored = self.get(id)?;
        let messages: Vec<Value> = serde_json::from_slice(&stored.messages).unwrap_or_default();
        let (page, has_more) = crate::response_store::page_of(messages, order, limit, after)?;
        Ok(crate::response_store::list_body(page, has_more))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(id: &str) -> Vec<u8> {
        serde_json::to_vec(&json!({"id": id, "object": "chat.completion", "choices": []})).unwrap()
    }

    fn keep(store: &Arc<ChatStore>, id: &str, model: &str, tag: &str) {
        let metadata: Map<String, Value> = [("tag".to_string(), json!(tag))].into_iter().collect();
        let messages =
            [json!({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]})];
        Keep::new(store.clone(), id, &messages, model, metadata).put(id, body(id), 0);
    }

    #[test]
    fn completions_are_listed_filtered_and_edited() {
        let store = Arc::new(ChatStore::new(1 << 20));
        keep(&store, "c1", "m", "x");
        keep(&store, "c2", "other", "x");
        keep(&store, "c3", "m", "y");
        let ids = |v: Value| -> Vec<String> {
            v["data"].as_array().unwrap().iter().map(|i| i["id"].as_str().unwrap().to_string()).collect()
        };
        assert_eq!(ids(store.list(None, &[], "asc", None, None).unwrap()), ["c1", "c2", "c3"]);
        assert_eq!(ids(store.list(Some("m"), &[], "desc", None, None).unwrap()), ["c3", "c1"]);
        let tagged = [("tag".to_string(), "x".to_string())];
        assert_eq!(ids(store.list(None, &tagged, "asc", Some("1"), Some("c1")).unwrap()), ["c2"]);
        assert_eq!(store.object("c1").unwrap()["metadata"], json!({"tag": "x"}));
        let messages = store.messages("c1", "asc", None, None).unwrap();
        assert_eq!(messages["data"][0]["id"], "c1-0");
        assert_eq!(messages["data"][0]["content"], "ab");
        assert_eq!(messages["data"][0]["content_parts"][1]["text"], "b");
        let edited: Map<String, Value> = [("tag".to_string(), json!("z"))].into_iter().collect();
        assert_eq!(store.update("c1", edited).unwrap()["metadata"], json!({"tag": "z"}));
        assert_eq!(ids(store.list(None, &tagged, "asc", None, None).unwrap()), ["c2"]);
        assert_eq!(store.delete("c2").unwrap()["deleted"], true);
        assert_eq!(store.object("c2").unwrap_err().status(), 404);
        assert_eq!(store.delete("c2").unwrap_err().status(), 404);
        assert_eq!(store.list(None, &[], "up", None, None).unwrap_err().param(), Some("order"));
    }

    #[test]
    fn the_oldest_go_first_past_the_bound() {
        let one = StoredChat {
            body: body("c0"),
            messages: b"[]".to_vec(),
            model: "m".into(),
            metadata: Map::new(),
            created: 0,
            seq: 0,
        };
        let store = Arc::new(ChatStore::new(2 * one.bytes() + one.bytes() / 2));
        for id in ["c1", "c2", "c3"] {
            Keep::new(store.clone(), id, &[], "m", Map::new()).put(id, body(id), 0);
        }
        assert_eq!(store.object("c1").unwrap_err().status(), 404);
        assert!(store.object("c2").is_ok() && store.object("c3").is_ok());
        // metadata that grows one past the bound forgets the oldest other
        let big: Map<String, Value> = [("k".to_string(), json!("v".repeat(200)))].into_iter().collect();
        store.update("c3", big).unwrap();
        assert!(store.object("c2").is_err() && store.object("c3").is_ok());
        assert!(store.lock().bytes <= store.capacity);
        // an id reused by a completion too large to keep names nothing (not the older one)
        let huge = StoredChat {
            body: vec![b' '; 4096],
            messages: vec![],
            model: "m".into(),
            metadata: Map::new(),
            created: 0,
            seq: 0,
        };
        store.put("c3", huge);
        assert_eq!(store.object("c3").unwrap_err().status(), 404);
    }

    #[test]
    fn a_page_follows_one_whose_completions_were_deleted_or_edited_out_of_the_filter() {
        let store = Arc::new(ChatStore::new(1 << 20));
        for i in 0..7 {
            keep(&store, &format!("c{i}"), "m", "pending");
        }
        let ids = |v: &Value| -> Vec<String> {
            v["data"].as_array().unwrap().iter().map(|i| i["id"].as_str().unwrap().to_string()).collect()
        };
        let pending = [("tag".to_string(), "pending".to_string())];
        // a client that marks each listed completion done while it pages through the pending ones
        for order in ["asc", "desc"] {
            let mut seen = Vec::new();
            let mut after: Option<String> = None;
            loop {
                let page = store.list(None, &pending, order, Some("3"), after.as_deref()).unwrap();
                for id in ids(&page) {
                    let done: Map<String, Value> = [("tag".to_string(), json!(order))].into_iter().collect();
                    store.update(&id, done).unwrap();
                    seen.push(id);
                }
                after = page["last_id"].as_str().map(str::to_string);
                if page["has_more"] == false {
                    break;
                }
            }
            assert_eq!(seen.len(), 7, "{order}: {seen:?}");
            for (i, c) in
                store.list(None, &[], "asc", None, None).unwrap()["data"].as_array().unwrap().iter().enumerate()
            {
                assert_eq!(c["metadata"]["tag"], if order == "asc" { "asc" } else { "desc" }, "c{i}");
            }
            let again: Map<String, Value> = [("tag".to_string(), json!("pending"))].into_iter().collect();
            (0..7).for_each(|i| drop(store.update(&format!("c{i}"), again.clone()).unwrap()));
        }
        // and one that deletes each listed completion: newest first, then the rest oldest first
        let first = store.list(None, &[], "desc", Some("3"), None).unwrap();
        assert_eq!(ids(&first), ["c6", "c5", "c4"]);
        ids(&first).iter().for_each(|id| drop(store.delete(id).unwrap()));
        let next = store.list(None, &[], "desc", Some("3"), Some("c4")).unwrap();
        assert_eq!(ids(&next), ["c3", "c2", "c1"]);
        assert_eq!(next["has_more"], true);
        store.delete("c0").unwrap();
        assert_eq!(ids(&store.list(None, &[], "asc", None, Some("c0")).unwrap()), ["c1", "c2", "c3"]);
        // a cursor the store never held is still a 400
        assert_eq!(store.list(None, &[], "asc", None, Some("nope")).unwrap_err().param(), Some("after"));
    }

    #[test]
    fn lists_are_ordered_by_created() {
        let store = Arc::new(ChatStore::new(1 << 20));
        for (id, created) in [("late", 9), ("early", 3), ("mid", 5)] {
            Keep::new(store.clone(), id, &[], "m", Map::new()).put(id, body(id), created);
        }
        let page = store.list(None, &[], "asc", None, None).unwrap();
        let ids: Vec<&str> = page["data"].as_array().unwrap().iter().map(|c| c["id"].as_str().unwrap()).collect();
        assert_eq!(ids, ["early", "mid", "late"]);
    }
}
