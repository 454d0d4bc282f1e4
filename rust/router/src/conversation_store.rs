//! Conversations (`/v1/conversations`): OpenAI's durable conversation objects, each a list of
//! Responses items that a response continues (`conversation` on `/v1/responses`) and then
//! grows by its input and output items.
//!
//! Kept in this process's memory as JSON text, within the same bound as the stored responses
//! (`--responses-store-mib`, counted separately): past it, the conversations used least
//! recently are forgotten first. A change that would make one conversation larger than the
//! whole bound is refused (and a response's items that would, forget it: a later request
//! then gets a 404 that says why, rather than a conversation silently missing turns).
//!
//! As OpenAI's: an item id is in a conversation at most once (a duplicate is a 400 naming
//! it), and while a response runs on a conversation ([`Lease`]) no other response may start
//! on it, nor may items be added or deleted (400 `conversation_locked`): a second response
//! would answer from a history the first is about to extend.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use serde_json::{json, Map, Value};

use crate::error::ApiError;
use crate::item_log::{Item, Log};

/// Bytes counted per conversation beside its items' JSON text (its id, bookkeeping).
const CONVERSATION_OVERHEAD: usize = 256;

struct Conversation {
    created_at: u64,
    metadata: Map<String, Value>,
    /// Its items, oldest first (shared with the stored responses that answered them).
    items: Arc<Log>,
    /// When it was last read or changed (the store's clock): the least recent go first.
    used: u64,
    /// A response is running on it (a [`Lease`] is held).
    busy: bool,
    /// Its newest deleted items, oldest first, each with the id of the item before it when it
    /// was deleted (None: it was the first), so a client paging through the items while it
    /// deletes them can name one as the next page's `after`.
    gone: VecDeque<(String, Option<String>)>,
}

impl Conversation {
    fn bytes(&self) -> usize {
        let metadata: usize = self.metadata.iter().map(|(k, v)| k.len() + v.as_str().map_or(0, str::len)).sum();
        CONVERSATION_OVERHEAD + metadata + self.items.bytes()
    }

    fn object(&self, id: &str) -> Value {
        json!({"id": id, "object": "conversation", "created_at": self.created_at, "metadata": self.metadata})
    }

    /// Its item with id `item` (the last, should an id be there twice).
    fn find(&self, item: &str) -> Option<Arc<Item>> {
        self.items.items().into_iter().rev().find(|e| e.id() == item)
    }

    /// The place among `items` (its ids, oldest first) of item `item`: (i, 0) for the item at i,
    /// (i, 1) for a deleted one that came after the item at i and before the next ((-1, 1):
    /// before the first), None for an id it never held (or forgot).
    fn place(&self, ids: &[&str], item: &str) -> Option<(i64, u8)> {
        if let Some(i) = ids.iter().rposition(|id| *id == item) {
            return Some((i as i64, 0));
        }
        // (the item before a deleted one may have been deleted too: follow them back to one
        // still held, or to the start; each step goes to an earlier item, and an id deleted,
        // added again and deleted again cannot loop it past one step per deletion kept)
        let mut at = self.gone.iter().rposition(|(g, _)| g == item)?;
        for _ in 0..self.gone.len() {
            let Some(before) = &self.gone[at].1 else { break };
            if let Some(i) = ids.iter().rposition(|id| id == before) {
                return Some((i as i64, 1));
            }
            match self.gone.iter().rposition(|(g, _)| g == before) {
                Some(earlier) => at = earlier,
                None => break,
            }
        }
        Some((-1, 1))
    }
}

/// How many deleted items a conversation remembers the places of.
const GONE_KEPT: usize = 1024;

#[derive(Default)]
pub struct Inner {
    map: HashMap<String, Conversation>,
    bytes: usize,
    clock: u64,
}

impl Inner {
    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// The conversation `id`, marked used, or a 404.
    fn get(&mut self, id: &str) -> Result<&mut Conversation, ApiError> {
        let now = self.tick();
        let conversation = self.map.get_mut(id).ok_or_else(|| not_found(id))?;
        conversation.used = now;
        Ok(conversation)
    }

    /// `get`, or a 400 while a response runs on it.
    fn get_free(&mut self, id: &str) -> Result<&mut Conversation, ApiError> {
        let conversation = self.get(id)?;
        if conversation.busy {
            return Err(locked(id));
        }
        Ok(conversation)
    }

    /// Forgets the least recently used conversations but `keep` and those a response runs on
    /// (its turn would be lost with it) until `extra` more bytes fit within `capacity`.
    fn make_room(&mut self, capacity: usize, extra: usize, keep: &str) {
        while self.bytes + extra > capacity {
            let free = self.map.iter().filter(|(k, c)| *k != keep && !c.busy);
            let oldest = free.min_by_key(|(_, c)| c.used).map(|(k, _)| k.clone());
            let Some(oldest) = oldest else { break };
            let gone = self.map.remove(&oldest).expect("just found");
            self.bytes -= gone.bytes();
        }
    }
}

fn not_found(id: &str) -> ApiError {
    ApiError::NotFound {
        message: format!(
            "Conversation with id {id:?} not found: it was never created, was deleted, or was forgotten to keep \
             this server's store within its bound (--responses-store-mib)."
        ),
    }
}

fn locked(id: &str) -> ApiError {
    ApiError::with_code(
        "conversation_locked",
        Some("conversation".into()),
        format!(
            "Another response is in progress on conversation {id:?}: wait for it to finish before starting \
             another or changing its items."
        ),
    )
}

/// The first of `items` whose id is already in `held` or repeats an earlier one of them: a
/// 400 naming it at `{param}[i].id`.
fn check_unique(held: &Log, items: &[Arc<Item>], param: &str) -> Result<(), ApiError> {
    let held = held.items();
    let mut seen: HashSet<&str> = held.iter().map(|e| e.id()).collect();
    for (i, item) in items.iter().enumerate() {
        let id = item.id();
        if !id.is_empty() && !seen.insert(id) {
            return Err(ApiError::invalid(
                format!("{param}[{i}].id"),
                format!("Duplicate item found with id {id:?}: an item is in a conversation once."),
            ));
        }
    }
    Ok(())
}

fn too_large(param: &str) -> ApiError {
    ApiError::invalid(
        param,
        "These items would make the conversation larger than this server keeps (--responses-store-mib): start a \
         new conversation, or raise the bound.",
    )
}

/// The conversations kept, up to `capacity` bytes (0: none are).
pub type ConversationStore = crate::bounded::Bounded<Inner>;

impl ConversationStore {
    /// A new conversation of `items` (each listed, with its `id`): its object.
    pub fn create(&self, metadata: Map<String, Value>, items: &[Value]) -> Result<Value, ApiError> {
        let id = crate::protocol::common::new_id("conv").replacen('-', "_", 1);
        let items: Vec<Arc<Item>> = items.iter().map(Item::new).collect();
        check_unique(&Log::empty(), &items, "items")?;
        let mut inner = self.lock();
        let used = inner.tick();
        let created_at = crate::protocol::common::unix_now();
        let conversation =
            Conversation { created_at, metadata, items: Log::of(items), used, busy: false, gone: VecDeque::new() };
        let size = conversation.bytes();
        if size > self.capacity {
            return Err(too_large("items"));
        }
        inner.make_room(self.capacity, size, &id);
        inner.bytes += size;
        let object = conversation.object(&id);
        inner.map.insert(id, conversation);
        Ok(object)
    }

    /// The conversation object, or a 404.
    pub fn object(&self, id: &str) -> Result<Value, ApiError> {
        Ok(self.lock().get(id)?.object(id))
    }

    /// Replaces its `metadata`: its object.
    pub fn update(&self, id: &str, metadata: Map<String, Value>) -> Result<Value, ApiError> {
        let mut inner = self.lock();
        let conversation = inner.get(id)?;
        let before = conversation.bytes();
        conversation.metadata = metadata;
        let after = conversation.bytes();
        let object = conversation.object(id);
        inner.bytes = inner.bytes + after - before;
        inner.make_room(self.capacity, 0, id);
        Ok(object)
    }

    /// Forgets it, its items with it: the deleted object, or a 404.
    pub fn delete(&self, id: &str) -> Result<Value, ApiError> {
        let mut inner = self.lock();
        let gone = inner.map.remove(id).ok_or_else(|| not_found(id))?;
        inner.bytes -= gone.bytes();
        Ok(json!({"id": id, "object": "conversation.deleted", "deleted": true}))
    }

    /// Adds `items` (each listed, with its `id`) at its end: a 400 while a response runs on
    /// it, or when an id is there already (at `{param}[i].id`). Unchanged when they would
    /// make it larger than the whole bound (a 400 on `param`), and with `or_forget`, forgotten
    /// then.
    pub fn append(&self, id: &str, items: &[Value], param: &str, or_forget: bool) -> Result<(), ApiError> {
        self.append_as(id, items.iter().map(Item::new).collect(), param, or_forget, false)
    }

    /// `append`, by the response holding the conversation when `held`.
    fn append_as(
        &self,
        id: &str,
        items: Vec<Arc<Item>>,
        param: &str,
        or_forget: bool,
        held: bool,
    ) -> Result<(), ApiError> {
        let mut inner = self.lock();
        let conversation = if held { inner.get(id)? } else { inner.get_free(id)? };
        check_unique(&conversation.items, &items, param)?;
        let before = conversation.bytes();
        let grown = Log::extend(&conversation.items, items);
        let extra = grown.bytes() - conversation.items.bytes();
        if before + extra > self.capacity {
            if or_forget {
                inner.map.remove(id);
                inner.bytes -= before;
            }
            return Err(too_large(param));
        }
        inner.make_room(self.capacity, extra, id);
        inner.get(id)?.items = grown;
        inner.bytes += extra;
        Ok(())
    }

    /// All its items, oldest first.
    pub fn items(&self, id: &str) -> Result<Vec<Value>, ApiError> {
        let log = self.lock().get(id)?.items.clone();
        // (parsed outside the lock)
        Ok(log.values())
    }

    /// All its items, oldest first, each with its place, and the place of item `after` (one
    /// it holds, or one deleted since a client listed it; a 400 for any other id), for a page.
    #[allow(clippy::type_complexity)]
    pub fn listing(
        &self,
        id: &str,
        after: Option<&str>,
    ) -> Result<(Vec<((i64, u8), Value)>, Option<(i64, u8)>), ApiError> {
        let (log, after) = {
            let mut inner = self.lock();
            let conversation = inner.get(id)?;
            let items = conversation.items.items();
            let ids: Vec<&str> = items.iter().map(|e| e.id()).collect();
            let after = match after {
                None => None,
                Some(item) => Some(conversation.place(&ids, item).ok_or_else(|| {
                    ApiError::invalid(
                        "after",
                        format!("No item with id {item:?} in conversation {id:?} to list after."),
                    )
                })?),
            };
            (conversation.items.clone(), after)
        };
        // (parsed outside the lock)
        Ok((log.values().into_iter().enumerate().map(|(i, v)| ((i as i64, 0), v)).collect(), after))
    }

    /// Its item with id `item` (the last, should an id be there twice), or a 404.
    pub fn item(&self, id: &str, item: &str) -> Result<Value, ApiError> {
        let found = self.lock().get(id)?.find(item);
        found.map(|e| e.value()).ok_or_else(|| item_not_found(id, item))
    }

    /// Removes its item with id `item`: its object, a 404, or a 400 while a response runs on
    /// it.
    pub fn delete_item(&self, id: &str, item: &str) -> Result<Value, ApiError> {
        let mut inner = self.lock();
        let conversation = inner.get_free(id)?;
        let before = conversation.bytes();
        let items = conversation.items.items();
        let kept: Vec<Arc<Item>> = items.iter().filter(|e| e.id() != item).cloned().collect();
        if kept.len() == items.len() {
            return Err(item_not_found(id, item));
        }
        let at = items.iter().position(|e| e.id() == item).expect("just found");
        if conversation.gone.len() == GONE_KEPT {
            conversation.gone.pop_front();
        }
        let previous = at.checked_sub(1).map(|i| items[i].id().to_string());
        conversation.gone.push_back((item.to_string(), previous));
        // (a new log: the stored responses that answered the item keep the old one)
        conversation.items = Log::of(kept);
        let after = conversation.bytes();
        let object = conversation.object(id);
        inner.bytes = inner.bytes + after - before;
        Ok(object)
    }

    /// Holds conversation `id` for a response about to run on it, which `items` (listed, with
    /// their ids) will join: a 404, a 400 `conversation_locked` while another response runs on
    /// it, or a 400 at `input[i].id` for an item already in it. The conversation's items go
    /// with the lease, as the response reads them, and as the log a stored response extends.
    pub fn acquire(self: &Arc<Self>, id: &str, items: &[Arc<Item>]) -> Result<(Lease, Vec<Value>, Arc<Log>), ApiError> {
        let log = {
            let mut inner = self.lock();
            let conversation = inner.get_free(id)?;
            check_unique(&conversation.items, items, "input")?;
            conversation.busy = true;
            conversation.items.clone()
        };
        let lease = Lease { store: self.clone(), id: id.to_string(), held: AtomicBool::new(true) };
        let values = log.values();
        Ok((lease, values, log))
    }

    fn release(&self, id: &str) {
        if let Some(conversation) = self.lock().map.get_mut(id) {
            conversation.busy = false;
        }
    }

    /// The item with id `item` in any conversation (the most recently used holding it), for
    /// an `item_reference`.
    pub fn find(&self, item: &str) -> Option<Arc<Item>> {
        let inner = self.lock();
        let holders = inner.map.values().filter_map(|c| Some((c.used, c.find(item)?)));
        holders.max_by_key(|(used, _)| *used).map(|(_, e)| e)
    }
}

/// A response's hold on its conversation ([`ConversationStore::acquire`]): released once its
/// items have joined the conversation, or when dropped (a response that did not finish).
pub struct Lease {
    store: Arc<ConversationStore>,
    id: String,
    held: AtomicBool,
}

impl Lease {
    /// The conversation held.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Adds the finished response's `items` to the conversation (forgetting it when they
    /// would make it larger than the store's bound, so that its next use says so), then
    /// releases it.
    pub fn finish(&self, items: Vec<Arc<Item>>) {
        // (a conversation deleted meanwhile takes nothing)
        let _ = self.store.append_as(&self.id, items, "conversation", true, true);
        self.release();
    }

    /// Lets other responses run on the conversation again (once; later calls do nothing).
    pub fn release(&self) {
        if self.held.swap(false, Ordering::AcqRel) {
            self.store.release(&self.id);
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.release();
    }
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease").field("id", &self.id).finish_non_exhaustive()
    }
}

fn item_not_found(id: &str, item: &str) -> ApiError {
    ApiError::NotFound { message: format!("Item with id {item:?} not found in conversation {id:?}.") }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(id: &str, text: &str) -> Value {
        json!({"id": id, "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})
    }

    fn id_of(object: &Value) -> String {
        object["id"].as_str().unwrap().to_string()
    }

    #[test]
    fn a_page_follows_one_whose_items_were_deleted() {
        let store = ConversationStore::new(1 << 20);
        let items: Vec<Value> = (0..8).map(|i| item(&format!("msg_{i}"), "x")).collect();
        let page = |store: &ConversationStore, id: &str, order: &str, after: Option<&str>| -> (Vec<String>, bool) {
            let (items, after) = store.listing(id, after).unwrap();
            let (page, more) = crate::response_store::page_by_place(items, order, Some("3"), after).unwrap();
            (page.iter().map(|i| i["id"].as_str().unwrap().to_string()).collect(), more)
        };
        for order in ["asc", "desc"] {
            // a client deleting each item it lists sees every item once
            let id = id_of(&store.create(Map::new(), &items).unwrap());
            let (mut seen, mut after) = (Vec::new(), None::<String>);
            loop {
                let (ids, more) = page(&store, &id, order, after.as_deref());
                ids.iter().for_each(|i| drop(store.delete_item(&id, i).unwrap()));
                after = ids.last().cloned();
                seen.extend(ids);
                if !more {
                    break;
                }
            }
            let mut want: Vec<String> = (0..8).map(|i| format!("msg_{i}")).collect();
            if order == "desc" {
                want.reverse();
            }
            assert_eq!(seen, want);
        }
        // a deleted item whose predecessor went too: the page starts where they were
        let id = id_of(&store.create(Map::new(), &items).unwrap());
        for gone in ["msg_3", "msg_2", "msg_4"] {
            store.delete_item(&id, gone).unwrap();
        }
        assert_eq!(page(&store, &id, "asc", Some("msg_3")).0, ["msg_5", "msg_6", "msg_7"]);
        assert_eq!(page(&store, &id, "desc", Some("msg_3")).0, ["msg_1", "msg_0"]);
        assert_eq!(page(&store, &id, "desc", Some("msg_4")).0, ["msg_1", "msg_0"]);
        store.delete_item(&id, "msg_0").unwrap();
        assert_eq!(page(&store, &id, "asc", Some("msg_0")).0, ["msg_1", "msg_5", "msg_6"]);
        let err = store.listing(&id, Some("msg_9")).unwrap_err();
        assert_eq!((err.status(), err.param()), (400, Some("after")));
    }

    #[test]
    fn items_are_kept_in_order_and_edited_by_id() {
        let store = ConversationStore::new(1 << 20);
        let conv = store.create(Map::new(), &[item("msg_a", "a")]).unwrap();
        let id = id_of(&conv);
        assert!(id.starts_with("conv_") && conv["object"] == "conversation");
        store.append(&id, &[item("msg_b", "b"), item("msg_c", "c")], "items", false).unwrap();
        let ids = |store: &ConversationStore| -> Vec<Value> {
            store.items(&id).unwrap().iter().map(|i| i["id"].clone()).collect()
        };
        assert_eq!(ids(&store), [json!("msg_a"), json!("msg_b"), json!("msg_c")]);
        assert_eq!(store.item(&id, "msg_b").unwrap()["content"][0]["text"], "b");
        assert_eq!(store.find("msg_c").unwrap().value()["id"], "msg_c");
        assert_eq!(store.delete_item(&id, "msg_b").unwrap()["id"], json!(id));
        assert_eq!(ids(&store), [json!("msg_a"), json!("msg_c")]);
        assert_eq!(store.item(&id, "msg_b").unwrap_err().status(), 404);
        assert_eq!(store.delete_item(&id, "msg_b").unwrap_err().status(), 404);
        let metadata: Map<String, Value> = [("k".to_string(), json!("v"))].into_iter().collect();
        assert_eq!(store.update(&id, metadata).unwrap()["metadata"], json!({"k": "v"}));
        assert_eq!(store.object(&id).unwrap()["metadata"], json!({"k": "v"}));
        assert_eq!(store.delete(&id).unwrap()["deleted"], true);
        assert_eq!(store.object(&id).unwrap_err().status(), 404);
        assert_eq!(store.find("msg_c").map(|i| i.value()), None);
        assert_eq!(store.lock().bytes, 0);
    }

    /// The bytes a conversation of one item `item("m", "x")` counts.
    fn one_item_bytes() -> usize {
        let items = Log::of(vec![Item::new(&item("m", "x"))]);
        Conversation { created_at: 0, metadata: Map::new(), items, used: 0, busy: false, gone: VecDeque::new() }.bytes()
    }

    #[test]
    fn the_least_recently_used_go_first_past_the_bound() {
        let one = one_item_bytes();
        let store = ConversationStore::new(2 * one + one / 4);
        let a = id_of(&store.create(Map::new(), &[item("m", "x")]).unwrap());
        let b = id_of(&store.create(Map::new(), &[item("m", "x")]).unwrap());
        store.object(&a).unwrap(); // a is now the more recent
        let c = id_of(&store.create(Map::new(), &[item("m", "x")]).unwrap());
        assert_eq!(store.object(&b).unwrap_err().status(), 404);
        assert!(store.object(&a).is_ok() && store.object(&c).is_ok());
        // growing one makes room by forgetting another, never itself
        store.append(&c, &[item("n", "y")], "items", false).unwrap();
        assert_eq!(store.object(&a).unwrap_err().status(), 404);
        assert_eq!(store.items(&c).unwrap().len(), 2);
        // past the whole bound: refused and unchanged, or forgotten when asked
        let big = item("big", &"z".repeat(3 * one));
        assert_eq!(store.append(&c, std::slice::from_ref(&big), "items", false).unwrap_err().param(), Some("items"));
        assert_eq!(store.items(&c).unwrap().len(), 2);
        assert!(store.append(&c, std::slice::from_ref(&big), "conversation", true).is_err());
        assert_eq!(store.object(&c).unwrap_err().status(), 404);
        assert_eq!(store.create(Map::new(), &[big]).unwrap_err().param(), Some("items"));
        assert_eq!(store.lock().bytes, 0);
    }

    #[test]
    fn a_conversation_a_response_runs_on_is_not_forgotten() {
        let one = one_item_bytes();
        let store = Arc::new(ConversationStore::new(2 * one + one / 4));
        let a = id_of(&store.create(Map::new(), &[item("m", "x")]).unwrap());
        let b = id_of(&store.create(Map::new(), &[item("m", "x")]).unwrap());
        let (lease, _, _) = store.acquire(&a, &[]).unwrap();
        store.object(&b).unwrap(); // a is the least recently used, but held
        let c = id_of(&store.create(Map::new(), &[item("m", "x")]).unwrap());
        assert_eq!(store.object(&b).unwrap_err().status(), 404);
        assert!(store.object(&c).is_ok());
        // its turn joins it once done
        lease.finish(vec![Item::new(&item("n", "y"))]);
        assert_eq!(store.items(&a).unwrap().len(), 2);
    }
}
