//! Stored Responses (`store`, OpenAI's default): each response a `/v1/responses` request
//! produced, kept in memory so that a later request can continue it (`previous_response_id`)
//! and `GET /v1/responses/{id}` can read it back.
//!
//! What is kept: the response object as sent, as JSON text, and the conversation it answered
//! as Responses items (the items of the responses it continued, then its own input;
//! `instructions` are not carried over, as in OpenAI's). The conversation is a [`Log`] that
//! shares the items of the one it continued rather than copying them, so a chain of N
//! responses keeps N responses' items, not N²/2. The bytes counted against the bound
//! (`--responses-store-mib`) are the memory held, each shared item once. Past the bound the
//! oldest responses are forgotten first (the items a newer one still lists stay with it); one
//! larger than the whole bound is not kept. It lives as long as the process: one server's
//! responses are not known to another replica.
//!
//! Every item a stored response holds (its conversation's and its output's, each with an
//! `id`) can be sent again by reference (`{"type": "item_reference", "id"}`): the store
//! indexes the ids and reads the item back.
//!
//! A background response (`background: true`) is stored as it starts, `queued`, and its
//! entry follows it ([`BackgroundRun`]): `in_progress` at its first output, then its final
//! object; `cancelled` by `POST /v1/responses/{id}/cancel`; `failed` if it ends any other way.
//! A running one is never forgotten to make room (the store may pass its bound by them until
//! they end).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use serde_json::{json, Value};

use crate::error::ApiError;
use crate::item_log::{Holdings, Item, Log};

/// Bytes counted per response beside its JSON text (its id, twice, and bookkeeping).
const RESPONSE_OVERHEAD: usize = 128;

/// One stored response.
#[derive(Debug)]
pub struct Stored {
    /// The response object, as the client got it (the final one, when streamed), as JSON text
    /// (a tree of values would take several times its size).
    body: Vec<u8>,
    /// The conversation it answered: input items, each with an `id`.
    input: Arc<Log>,
    /// `input`, then its output items: what a response continuing it answers first.
    answered: Arc<Log>,
    run: Run,
}

/// Where a background response (`background: true`) stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Run {
    /// Not a background response: stored once it was done.
    Foreground,
    /// Still generating: its body is the `queued` or `in_progress` object. The number tells
    /// this run from a later one under the same id.
    Running(u64),
    /// It ran in the background and has ended (completed, incomplete, cancelled or failed).
    Ended,
}

impl Stored {
    /// The response `body` to the conversation `input`; `output`: its output items.
    pub fn new(body: &Value, input: Arc<Log>, output: Vec<Arc<Item>>) -> Self {
        let answered = Log::extend(&input, output);
        Self { body: serde_json::to_vec(body).expect("JSON values serialize"), input, answered, run: Run::Foreground }
    }

    /// Whether it ran in the background (`background: true`), running or ended.
    pub fn background(&self) -> bool {
        self.run != Run::Foreground
    }

    /// Whether it is a background response still generating.
    pub fn running(&self) -> bool {
        matches!(self.run, Run::Running(_))
    }

    /// The conversation it answered, then its output items: the log a continuation extends.
    pub fn answered(&self) -> &Arc<Log> {
        &self.answered
    }

    /// The memory its body holds.
    fn bytes(&self) -> usize {
        self.body.len() + RESPONSE_OVERHEAD
    }

    /// The memory it holds stored alone.
    fn bytes_alone(&self) -> usize {
        self.bytes() + self.answered.bytes()
    }
}

#[derive(Default)]
pub struct Inner {
    map: HashMap<String, Arc<Stored>>,
    /// Ids, oldest first.
    order: VecDeque<String>,
    /// The stored responses' items.
    held: Holdings,
    /// The stored responses' bodies' bytes.
    bytes: usize,
}

impl Inner {
    /// Forgets the response `id`, and the items only it held; whether it was kept.
    fn remove(&mut self, id: &str) -> bool {
        let Some(stored) = self.map.remove(id) else { return false };
        self.bytes -= stored.bytes();
        self.held.release(&stored.answered);
        true
    }

    /// The memory held.
    fn total(&self) -> usize {
        self.bytes + self.held.bytes()
    }

    /// `remove`, and `id`'s place in the order with it.
    fn forget(&mut self, id: &str) -> bool {
        let kept = self.remove(id);
        if kept {
            self.order.retain(|k| k != id);
        }
        kept
    }

    /// Keeps `stored` under `id` (replacing any), then forgets the oldest responses that are
    /// not running until the store is within `capacity`.
    fn insert(&mut self, id: &str, stored: Stored, capacity: usize) {
        self.forget(id);
        // (held first: the items it shares with the oldest are not counted twice meanwhile;
        // and as it alone fits, the loop stops before it unless running ones fill the store)
        self.bytes += stored.bytes();
        self.held.hold(&stored.answered);
        self.map.insert(id.to_string(), Arc::new(stored));
        self.order.push_back(id.to_string());
        let mut at = 0;
        while self.total() > capacity && at < self.order.len() {
            if self.map.get(&self.order[at]).is_some_and(|s| s.running()) {
                at += 1;
                continue;
            }
            let oldest = self.order.remove(at).expect("in range");
            self.remove(&oldest);
        }
    }

    /// The run of the response `id`, if it is stored.
    fn run(&self, id: &str) -> Option<Run> {
        self.map.get(id).map(|s| s.run)
    }

    /// Rewrites the body of the stored response `id` (which must be stored) with `edit`, and
    /// sets its run to `run`; returns the new body.
    fn edit(&mut self, id: &str, run: Run, edit: impl FnOnce(&mut Value)) -> Vec<u8> {
        let old = self.map.get(id).expect("edited responses are stored");
        let mut body: Value = serde_json::from_slice(&old.body).expect("stored bodies are JSON");
        edit(&mut body);
        let body = serde_json::to_vec(&body).expect("JSON values serialize");
        self.set_body(id, body.clone(), run);
        body
    }

    /// Replaces the body of the stored response `id` (which must be stored) and sets its run.
    fn set_body(&mut self, id: &str, body: Vec<u8>, run: Run) {
        let old = self.map.get(id).expect("edited responses are stored");
        self.bytes = self.bytes - old.body.len() + body.len();
        let new = Stored { body, input: old.input.clone(), answered: old.answered.clone(), run };
        self.map.insert(id.to_string(), Arc::new(new));
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
        if stored.bytes_alone() > self.capacity {
            return;
        }
        self.lock().insert(id, stored, self.capacity);
    }

    /// Keeps a background response as it starts: `body` (its `queued` object) answering
    /// `input`. It stays until it ends, whatever the bound; the returned run follows it.
    /// One whose conversation alone is larger than the whole bound is a 400: it could not be
    /// kept to be read back.
    pub fn begin(self: &Arc<Self>, id: &str, body: &Value, input: Arc<Log>) -> Result<BackgroundRun, ApiError> {
        static RUNS: AtomicU64 = AtomicU64::new(1);
        let mut stored = Stored::new(body, input, Vec::new());
        if stored.bytes_alone() > self.capacity {
            return Err(ApiError::invalid(
                "background",
                format!(
                    "This background response's conversation ({} bytes) is larger than the whole response store \
                     (--responses-store-mib), so it could not be kept to be read back: send it without `background`.",
                    stored.bytes_alone()
                ),
            ));
        }
        let run = RUNS.fetch_add(1, Ordering::Relaxed);
        stored.run = Run::Running(run);
        self.lock().insert(id, stored, self.capacity);
        Ok(BackgroundRun { store: self.clone(), id: id.to_string(), run, started: AtomicBool::new(false) })
    }

    /// `POST /v1/responses/{id}/cancel`: a running background response is marked
    /// `cancelled` (its generation is the caller's to stop); one that has ended is returned as
    /// it is. A 404 for an unknown id, a 400 for a response that did not run in the background.
    pub fn cancel(&self, id: &str) -> Result<Vec<u8>, ApiError> {
        let mut inner = self.lock();
        match inner.run(id) {
            None => Err(not_found(id)),
            Some(Run::Foreground) => Err(ApiError::invalid(
                "response_id",
                format!(
                    "Only background responses can be cancelled: response {id:?} was not created with \
                     `background: true`: it ran to its end in the request that created it."
                ),
            )),
            // Its output so far stays, the item it was writing `incomplete`; a response that
            // continues it answers that output too, as the client saw it.
            Some(Run::Running(_)) => {
                let old = inner.map[id].clone();
                let mut body: Value = serde_json::from_slice(&old.body).expect("stored bodies are JSON");
                body["status"] = json!("cancelled");
                let output = body["output"].as_array_mut().map(std::mem::take).unwrap_or_default();
                let output: Vec<Value> = output
                    .into_iter()
                    .map(|mut item| {
                        if item["status"] == "in_progress" {
                            item["status"] = json!("incomplete");
                        }
                        item
                    })
                    .collect();
                let items = output.iter().map(Item::new).collect();
                body["output"] = Value::Array(output);
                let mut stored = Stored::new(&body, old.input.clone(), items);
                stored.run = Run::Ended;
                inner.insert(id, stored, self.capacity);
                Ok(serde_json::to_vec(&body).expect("JSON values serialize"))
            }
            Some(Run::Ended) => Ok(inner.map[id].body.clone()),
        }
    }

    /// The item with id `item` held by a stored response (one of its conversation's items,
    /// or one of its output items).
    pub fn item(&self, item: &str) -> Option<Arc<Item>> {
        self.lock().held.find(item)
    }

    /// The memory held, in bytes: what the bound (`--responses-store-mib`) counts.
    pub fn held(&self) -> usize {
        self.lock().total()
    }

    /// The response stored under `id`, or a 404.
    pub fn get(&self, id: &str) -> Result<Arc<Stored>, ApiError> {
        self.lock().map.get(id).cloned().ok_or_else(|| not_found(id))
    }

    /// Forgets `id`: the `DELETE /v1/responses/{id}` body, or a 404.
    pub fn delete(&self, id: &str) -> Result<Vec<u8>, ApiError> {
        let mut inner = self.lock();
        if !inner.forget(id) {
            return Err(not_found(id));
        }
        Ok(serde_json::to_vec(&json!({"id": id, "object": "response", "deleted": true})).expect("JSON serializes"))
    }

    /// The `GET /v1/responses/{id}` body.
    pub fn body(&self, id: &str) -> Result<Vec<u8>, ApiError> {
        Ok(self.get(id)?.body.clone())
    }

    /// The items of the conversation the response `id` answered, oldest first (the
    /// `GET /v1/responses/{id}/input_items` route pages them with [`page_of`]).
    pub fn input_values(&self, id: &str) -> Result<Vec<Value>, ApiError> {
        Ok(self.get(id)?.input.values())
    }
}

/// A background response's hold on its entry in the store, from its request's `prepare` until
/// its generation ends; the entry changes only while it is this run's (not cancelled, deleted
/// or replaced meanwhile). Dropped before its response was done, it leaves the entry `failed`
/// (the request was dropped after the engine took it: a shutdown, an engine failure) or
/// removes it (the engine never took it: the request was refused after `prepare`).
#[derive(Debug)]
pub struct BackgroundRun {
    store: Arc<ResponseStore>,
    id: String,
    run: u64,
    /// Whether the engine took the request.
    started: AtomicBool,
}

impl BackgroundRun {
    /// The engine took the request.
    pub fn start(&self) {
        self.started.store(true, Ordering::Relaxed);
    }

    /// Applies `edit` to the entry, and sets its run to `run`, if the entry is still this
    /// run's; returns the new body.
    fn edit(&self, run: Run, edit: impl FnOnce(&mut Value)) -> Option<Vec<u8>> {
        let mut inner = self.store.lock();
        (inner.run(&self.id) == Some(Run::Running(self.run))).then(|| inner.edit(&self.id, run, edit))
    }

    /// Its first output came: the entry is `in_progress`.
    pub fn progress(&self) {
        self.edit(Run::Running(self.run), |body| body["status"] = json!("in_progress"));
    }

    /// Its object with the output so far (`GET` shows it while it runs; a cancel keeps the
    /// output). Written whole: nothing is read back.
    pub fn snapshot(&self, object: &Value) {
        let body = serde_json::to_vec(object).expect("JSON values serialize");
        let mut inner = self.store.lock();
        if inner.run(&self.id) == Some(Run::Running(self.run)) {
            inner.set_body(&self.id, body, Run::Running(self.run));
        }
    }

    /// It is done: `stored` (its final object and output) replaces the entry. One larger
    /// than the whole bound is forgotten, as `put` would not keep it.
    pub fn finish(&self, mut stored: Stored) {
        let mut inner = self.store.lock();
        if inner.run(&self.id) != Some(Run::Running(self.run)) {
            return;
        }
        if stored.bytes_alone() > self.store.capacity {
            inner.forget(&self.id);
            return;
        }
        stored.run = Run::Ended;
        inner.insert(&self.id, stored, self.store.capacity);
    }

    /// It failed: the entry becomes `failed` with `error` (OpenAI's `{code, message}`).
    pub fn fail(&self, error: Value) -> Option<Vec<u8>> {
        self.edit(Run::Ended, |body| {
            body["status"] = json!("failed");
            body["error"] = error;
        })
    }
}

impl Drop for BackgroundRun {
    fn drop(&mut self) {
        if self.started.load(Ordering::Relaxed) {
            self.fail(json!({
                "code": "server_error",
                "message": "The response ended before it was done: the server stopped its generation \
                            (a shutdown or an engine failure).",
            }));
            return;
        }
        let mut inner = self.store.lock();
        if inner.run(&self.id) == Some(Run::Running(self.run)) {
            inner.forget(&self.id);
        }
    }
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

/// A page of `items` (each with an `id`), as OpenAI's list routes answer: `order` "desc"
/// (newest first) or "asc", at most `limit` (the query's text, an integer 1..=100; 20 when not
/// given) after the item with id `after`; and whether more come after them.
pub(crate) fn page_of(
    mut items: Vec<Value>,
    order: &str,
    limit: Option<&str>,
    after: Option<&str>,
) -> Result<(Vec<Value>, bool), ApiError> {
    let limit = limit_of(limit)?;
    if descending(order)? {
        items.reverse();
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
    Ok(take_page(items, start, limit))
}

/// `page_of` for a list that changes between a client's pages (items deleted, or no longer
/// matching its filter): `items` sorted by their places, oldest first, and `after` the place of
/// the item the cursor names, which need not be among them, so a page follows the one before it
/// wherever that one's last item has gone.
pub(crate) fn page_by_place<K: Ord>(
    mut items: Vec<(K, Value)>,
    order: &str,
    limit: Option<&str>,
    after: Option<K>,
) -> Result<(Vec<Value>, bool), ApiError> {
    let limit = limit_of(limit)?;
    let start = if descending(order)? {
        items.reverse();
        after.map_or(0, |after| items.partition_point(|(k, _)| *k >= after))
    } else {
        after.map_or(0, |after| items.partition_point(|(k, _)| *k <= after))
    };
    Ok(take_page(items.into_iter().map(|(_, v)| v).collect(), start, limit))
}

/// The query's `limit`: an integer 1..=100, 20 when not given.
fn limit_of(limit: Option<&str>) -> Result<usize, ApiError> {
    match limit.map(str::parse::<usize>) {
        None => Ok(20),
        Some(Ok(n)) if (1..=100).contains(&n) => Ok(n),
        _ => Err(ApiError::invalid(
            "limit",
            format!("`limit` must be an integer between 1 and 100, got {:?}.", limit.unwrap_or_default()),
        )),
    }
}

/// Whether `order` is "desc" (else "asc").
fn descending(order: &str) -> Result<bool, ApiError> {
    match order {
        "desc" => Ok(true),
        "asc" => Ok(false),
        other => Err(ApiError::invalid("order", format!("`order` must be \"asc\" or \"desc\", not {other:?}."))),
    }
}

fn take_page(items: Vec<Value>, start: usize, limit: usize) -> (Vec<Value>, bool) {
    let total = items.len();
    let page: Vec<Value> = items.into_iter().skip(start).take(limit).collect();
    let has_more = start + page.len() < total;
    (page, has_more)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `page_of`'s page as the route's body.
    fn page(items: Vec<Value>, order: &str, limit: Option<&str>, after: Option<&str>) -> Result<Vec<u8>, ApiError> {
        let (page, has_more) = page_of(items, order, limit, after)?;
        Ok(serde_json::to_vec(&list_body(page, has_more)).expect("JSON serializes"))
    }

    fn log(items: &[Value]) -> Arc<Log> {
        Log::of(items.iter().map(Item::new).collect())
    }

    /// The response `body` to `input`, its output items made from the body.
    fn answer(body: &Value, input: Arc<Log>) -> Stored {
        let output = body["output"].as_array().map_or_else(Vec::new, |o| o.iter().map(Item::new).collect());
        Stored::new(body, input, output)
    }

    fn stored(text: &str) -> Stored {
        answer(&json!({"output": [text]}), log(&[json!({"id": "msg_1", "content": text})]))
    }

    fn item(id: &str, text: &str) -> Value {
        json!({"id": id, "type": "message", "role": "user", "content": text})
    }

    #[test]
    fn the_oldest_go_first_past_the_bound() {
        let one = stored("aaaa").bytes_alone();
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
        assert_eq!(store.lock().total(), 2 * one);
    }

    #[test]
    fn running_background_responses_are_not_forgotten_to_make_room() {
        let one = stored("aaaa").bytes_alone();
        let store = Arc::new(ResponseStore::new(2 * one));
        let queued = json!({"output": ["aaaa"], "status": "queued"});
        let run = store.begin("bg", &queued, log(&[json!({"id": "msg_1", "content": "aaaa"})])).unwrap();
        run.start();
        store.put("a", stored("aaaa"));
        store.put("b", stored("bbbb"));
        // the running one is the oldest, yet the store forgets the next oldest
        assert!(store.get("bg").unwrap().running() && store.get("a").is_err() && store.get("b").is_ok());
        // ended, it is stored as of its end, and goes in its turn like any other
        run.finish(answer(&json!({"output": ["aaaa"], "status": "completed"}), log(&[])));
        assert!(!store.get("bg").unwrap().running() && store.get("bg").unwrap().background());
        store.put("c", stored("cccc"));
        assert!(store.get("bg").is_ok() && store.get("b").is_err() && store.get("c").is_ok());
        store.put("d", stored("dddd"));
        assert!(store.get("bg").is_err() && store.get("c").is_ok() && store.get("d").is_ok());
        // one larger than the whole store is refused as it starts
        let big = json!({"output": ["x".repeat(4 * one)]});
        assert_eq!(store.begin("big", &big, log(&[])).unwrap_err().param(), Some("background"));
        // held bytes follow the edits of a running body
        let run = store.begin("bg2", &queued, log(&[])).unwrap();
        run.progress();
        let inner = store.lock();
        assert_eq!(inner.bytes, inner.map.values().map(|s| s.bytes()).sum::<usize>());
        drop(inner);
        drop(run);
        assert!(store.get("bg2").is_err());
    }

    #[test]
    fn items_are_found_by_id_while_a_response_holds_them() {
        let store = ResponseStore::new(1 << 20);
        let output = json!({"output": [{"id": "msg_out", "type": "message", "role": "assistant"}]});
        store.put("r1", answer(&output, log(&[item("msg_a", "first")])));
        assert_eq!(store.item("msg_a").unwrap().value()["content"], "first");
        assert_eq!(store.item("msg_out").unwrap().value()["role"], "assistant");
        assert_eq!(store.item("msg_nope").map(|i| i.value()), None);
        // a continuation holds the same items: the newest holder answers, and the item
        // outlives the response that first held it
        store.put("r2", answer(&json!({"output": []}), log(&[item("msg_a", "first"), item("msg_a", "first")])));
        store.delete("r1").unwrap();
        assert_eq!(store.item("msg_a").unwrap().value()["content"], "first");
        assert_eq!(store.item("msg_out").map(|i| i.value()), None);
        store.delete("r2").unwrap();
        assert_eq!(store.item("msg_a").map(|i| i.value()), None);
        assert_eq!(store.lock().total(), 0);
        // forgotten past the bound, or replaced under the same id
        let one = answer(&json!({"output": []}), log(&[item("msg_b", "b")])).bytes_alone();
        let small = ResponseStore::new(one);
        small.put("r", answer(&json!({"output": []}), log(&[item("msg_b", "b")])));
        small.put("r", answer(&json!({"output": []}), log(&[item("msg_c", "c")])));
        assert_eq!((small.item("msg_b").map(|i| i.value()), small.item("msg_c").is_some()), (None, true));
        small.put("s", answer(&json!({"output": []}), log(&[item("msg_d", "d")])));
        assert_eq!((small.item("msg_c").map(|i| i.value()), small.item("msg_d").is_some()), (None, true));
        assert!(small.lock().held.counts() == (1, 1));
    }

    /// A chain of responses, each continuing the last (`previous_response_id`), as
    /// `prepare` and `keep` store it.
    fn chain(store: &ResponseStore, turns: usize, text: &str) {
        let mut previous = Log::empty();
        for t in 0..turns {
            let input = Log::extend(&previous, vec![Item::new(&item(&format!("msg_in{t}"), text))]);
            let output = json!({"output": [{"id": format!("msg_out{t}"), "type": "message", "content": text}]});
            let stored = answer(&output, input);
            previous = stored.answered().clone();
            store.put(&format!("resp_{t}"), stored);
        }
    }

    #[test]
    fn a_chain_of_responses_keeps_each_item_once() {
        let turns = 200;
        let text = "x".repeat(500);
        let store = ResponseStore::new(1 << 30);
        chain(&store, turns, &text);
        // every response lists its whole conversation...
        let last: Value =
            serde_json::from_slice(&page(store.input_values("resp_199").unwrap(), "asc", Some("100"), None).unwrap())
                .unwrap();
        assert_eq!(last["data"][0]["id"], "msg_in0");
        assert_eq!(last["data"][1]["id"], "msg_out0");
        assert_eq!(store.get("resp_199").unwrap().input.len(), 2 * turns - 1);
        let first: Value =
            serde_json::from_slice(&page(store.input_values("resp_0").unwrap(), "asc", None, None).unwrap()).unwrap();
        assert_eq!(first["data"].as_array().unwrap().len(), 1);
        // ...while the store holds each of its 2 x 200 items once: linear, not N²/2
        let held = store.lock().total();
        assert!(held < 2 * turns * (text.len() + 300) + turns * 1000, "{held}");
        assert_eq!(store.lock().held.counts().1, 2 * turns);
        // the oldest forgotten, their items stay while a newer response lists them
        store.delete("resp_0").unwrap();
        assert_eq!(store.item("msg_in0").unwrap().value()["id"], "msg_in0");
        for t in 1..turns {
            store.delete(&format!("resp_{t}")).unwrap();
        }
        let inner = store.lock();
        assert_eq!((inner.total(), inner.held.counts()), (0, (0, 0)));
        drop(inner);
        // past the bound the oldest go, and what is held stays within it; a response whose
        // conversation alone is larger than the bound is not kept
        let bound = held / 3;
        let small = ResponseStore::new(bound);
        chain(&small, turns, &text);
        let kept = small.lock().map.len();
        let total = small.lock().total();
        assert!(total <= bound && kept > 0, "{kept}");
        let newest = small.lock().order.back().cloned().unwrap();
        assert!(small.get(&newest).unwrap().input.len() > 2 * 20 && small.get("resp_199").is_err(), "{newest}");
    }

    #[test]
    fn responses_on_a_conversation_share_its_items() {
        use crate::conversation_store::ConversationStore;
        let conversations = Arc::new(ConversationStore::new(1 << 30));
        let store = ResponseStore::new(1 << 30);
        let conv = conversations.create(serde_json::Map::new(), &[]).unwrap();
        let conv = conv["id"].as_str().unwrap();
        let (turns, text) = (100, "y".repeat(500));
        for t in 0..turns {
            // as `prepare` and `keep` run a response on it
            let input = vec![Item::new(&item(&format!("msg_in{t}"), &text))];
            let (lease, values, log) = conversations.acquire(conv, &input).unwrap();
            assert_eq!(values.len(), 2 * t);
            let output = vec![Item::new(&item(&format!("msg_out{t}"), &text))];
            let answered = Log::extend(&log, input.clone());
            store.put(&format!("resp_{t}"), Stored::new(&json!({"output": []}), answered, output.clone()));
            lease.finish(input.into_iter().chain(output).collect());
        }
        assert_eq!(conversations.items(conv).unwrap().len(), 2 * turns);
        assert_eq!(store.get("resp_99").unwrap().input.len(), 2 * turns - 1);
        // each item is held once by the response store (and once by the conversation store)
        let held = store.lock().total();
        assert!(held < 2 * turns * (text.len() + 300) + turns * 1000, "{held}");
        assert_eq!(store.lock().held.counts().1, 2 * turns);
        // deleting an item from the conversation leaves the responses that answered it whole
        conversations.delete_item(conv, "msg_in0").unwrap();
        assert_eq!(conversations.items(conv).unwrap().len(), 2 * turns - 1);
        assert_eq!(store.get("resp_99").unwrap().input.values()[0]["id"], "msg_in0");
        assert_eq!(store.item("msg_in0").unwrap().value()["id"], "msg_in0");
    }

    #[test]
    fn input_items_page_through_the_conversation() {
        let store = ResponseStore::new(1 << 20);
        let input: Vec<Value> =
            (0..5).map(|i| json!({"id": format!("msg_{i}"), "role": "user", "content": "x"})).collect();
        store.put("r", answer(&json!({}), log(&input)));
        let listed = |order: &str, limit: &str, after: Option<&str>| -> Value {
            serde_json::from_slice(&page(store.input_values("r").unwrap(), order, Some(limit), after).unwrap()).unwrap()
        };
        let ids = |v: &Value| v["data"].as_array().unwrap().iter().map(|i| i["id"].clone()).collect::<Vec<_>>();
        let first = listed("desc", "2", None);
        assert_eq!(ids(&first), [json!("msg_4"), json!("msg_3")]);
        assert_eq!((first["has_more"].clone(), first["last_id"].clone()), (json!(true), json!("msg_3")));
        let last = listed("desc", "2", Some("msg_1"));
        assert_eq!((ids(&last), last["has_more"].clone()), (vec![json!("msg_0")], json!(false)));
        assert_eq!(ids(&listed("asc", "20", None)).len(), 5);
        assert_eq!(page(store.input_values("r").unwrap(), "up", None, None).unwrap_err().param(), Some("order"));
        for bad in ["0", "101", "-1", "99999999999999999999", "2.0", "x"] {
            assert_eq!(
                page(store.input_values("r").unwrap(), "asc", Some(bad), None).unwrap_err().param(),
                Some("limit"),
                "{bad}"
            );
        }
    }
}
