//! Responses items shared between the stores (`response_store`, `conversation_store`).
//!
//! A conversation of N turns is N responses, each of which answered every item before it.
//! Copying that history into every stored response keeps about N²/2 items; here each item's
//! JSON text is kept once ([`Item`]) and each response's history is a [`Log`]: its own new
//! items after the log it continued, which it shares rather than copies. A store counts what
//! it holds with [`Holdings`], each log and item once however many of its responses share
//! it, so its bound measures the memory it really keeps.

use std::collections::HashMap;
use std::sync::Arc;

use serde_json::Value;

/// Bytes counted per item, per log and per item a log lists, beside their JSON text.
const ITEM_OVERHEAD: usize = 64;
const LOG_OVERHEAD: usize = 64;
const POINTER: usize = std::mem::size_of::<usize>();

/// One item, as JSON text, with its id (empty when it has none).
#[derive(Debug)]
pub struct Item {
    id: String,
    json: Box<[u8]>,
}

impl Item {
    pub fn new(item: &Value) -> Arc<Self> {
        let id = item["id"].as_str().unwrap_or_default().to_string();
        Arc::new(Self { id, json: serde_json::to_vec(item).expect("JSON values serialize").into_boxed_slice() })
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    /// The memory it holds, its entry in a store's index by id included.
    pub fn bytes(&self) -> usize {
        self.json.len() + 2 * self.id.len() + ITEM_OVERHEAD
    }

    pub fn value(&self) -> Value {
        serde_json::from_slice(&self.json).unwrap_or_default()
    }
}

/// An immutable list of items: the log it extends (`parent`), then its own items.
#[derive(Debug, Default)]
pub struct Log {
    parent: Option<Arc<Log>>,
    items: Vec<Arc<Item>>,
    len: usize,
}

impl Log {
    /// The empty log.
    pub fn empty() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// A log of `items`.
    pub fn of(items: Vec<Arc<Item>>) -> Arc<Self> {
        Self::extend(&Self::empty(), items)
    }

    /// `parent`'s items, then `items`: `parent` itself when there are none.
    pub fn extend(parent: &Arc<Self>, items: Vec<Arc<Item>>) -> Arc<Self> {
        if items.is_empty() {
            return parent.clone();
        }
        // (an empty parent is not kept: it would only lengthen the walks)
        let len = parent.len + items.len();
        let parent = (parent.len > 0).then(|| parent.clone());
        Arc::new(Self { parent, items, len })
    }

    /// How many items it lists, its parent's included.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Its items, oldest first.
    pub fn items(&self) -> Vec<Arc<Item>> {
        let mut chain = Vec::new();
        let mut at = Some(self);
        while let Some(log) = at {
            chain.push(log);
            at = log.parent.as_deref();
        }
        chain.iter().rev().flat_map(|log| log.items.iter().cloned()).collect()
    }

    /// Its items as JSON values, oldest first.
    pub fn values(&self) -> Vec<Value> {
        self.items().iter().map(|i| i.value()).collect()
    }

    /// The memory this log itself holds (not its items' nor its parent's).
    fn own_bytes(&self) -> usize {
        LOG_OVERHEAD + POINTER * self.items.len()
    }

    /// The memory it holds with its items and parents, counting an item it lists twice once:
    /// what a store that shares nothing with it would hold.
    pub fn bytes(&self) -> usize {
        let mut seen = std::collections::HashSet::new();
        let mut total = 0;
        let mut at = Some(self);
        while let Some(log) = at {
            total += log.own_bytes();
            total += log.items.iter().filter(|i| seen.insert(Arc::as_ptr(i))).map(|i| i.bytes()).sum::<usize>();
            at = log.parent.as_deref();
        }
        total
    }
}

impl Drop for Log {
    // (iteratively: a long conversation's chain would overflow the stack dropped recursively)
    fn drop(&mut self) {
        let mut parent = self.parent.take();
        while let Some(log) = parent {
            parent = match Arc::try_unwrap(log) {
                Ok(mut log) => log.parent.take(),
                Err(_) => None,
            };
        }
    }
}

/// The logs and items a store holds, each counted once, with an index of the items by id.
#[derive(Default)]
pub struct Holdings {
    /// Each log held (by address), with how many holders it has: the store's own references
    /// and the logs held that extend it.
    logs: HashMap<usize, (Arc<Log>, usize)>,
    /// Each item held, with how many held logs list it.
    items: HashMap<usize, (Arc<Item>, usize)>,
    /// Item id -> the items held with that id, the first held first.
    by_id: HashMap<String, Vec<Arc<Item>>>,
    bytes: usize,
}

impl Holdings {
    /// The memory held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Holds `log` once more (its parents and items with it, when it is new).
    pub fn hold(&mut self, log: &Arc<Log>) {
        let mut at = Some(log.clone());
        while let Some(log) = at {
            let key = Arc::as_ptr(&log) as usize;
            if let Some((_, refs)) = self.logs.get_mut(&key) {
                *refs += 1;
                return;
            }
            self.bytes += log.own_bytes();
            for item in &log.items {
                self.hold_item(item);
            }
            at = log.parent.clone();
            self.logs.insert(key, (log, 1));
        }
    }

    /// Lets go of one hold on `log` (held before): the logs and items no longer held are
    /// forgotten.
    pub fn release(&mut self, log: &Arc<Log>) {
        let mut key = Arc::as_ptr(log) as usize;
        loop {
            let Some((_, refs)) = self.logs.get_mut(&key) else { return };
            *refs -= 1;
            if *refs > 0 {
                return;
            }
            let (log, _) = self.logs.remove(&key).expect("just found");
            self.bytes -= log.own_bytes();
            for item in &log.items {
                self.release_item(item);
            }
            match &log.parent {
                Some(parent) => key = Arc::as_ptr(parent) as usize,
                None => return,
            }
        }
    }

    fn hold_item(&mut self, item: &Arc<Item>) {
        let key = Arc::as_ptr(item) as usize;
        let entry = self.items.entry(key).or_insert_with(|| (item.clone(), 0));
        entry.1 += 1;
        if entry.1 == 1 {
            self.bytes += item.bytes();
            if !item.id.is_empty() {
                self.by_id.entry(item.id.clone()).or_default().push(item.clone());
            }
        }
    }

    fn release_item(&mut self, item: &Arc<Item>) {
        let key = Arc::as_ptr(item) as usize;
        let Some(entry) = self.items.get_mut(&key) else { return };
        entry.1 -= 1;
        if entry.1 > 0 {
            return;
        }
        self.items.remove(&key);
        self.bytes -= item.bytes();
        if !item.id.is_empty() {
            if let Some(same) = self.by_id.get_mut(&item.id) {
                same.retain(|i| !Arc::ptr_eq(i, item));
                if same.is_empty() {
                    self.by_id.remove(&item.id);
                }
            }
        }
    }

    /// The item held with id `id` (the last held, should several share it).
    pub fn find(&self, id: &str) -> Option<Arc<Item>> {
        self.by_id.get(id)?.last().cloned()
    }

    /// How many logs and items are held.
    pub fn counts(&self) -> (usize, usize) {
        (self.logs.len(), self.items.len())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use serde_json::json;

    use super::*;

    fn item(id: &str) -> Arc<Item> {
        Item::new(&json!({"id": id, "type": "message", "content": id}))
    }

    fn ids(log: &Log) -> Vec<String> {
        log.items().iter().map(|i| i.id().to_string()).collect()
    }

    #[test]
    fn a_log_lists_its_parents_items_then_its_own() {
        let a = Log::of(vec![item("a"), item("b")]);
        let b = Log::extend(&a, vec![item("c")]);
        let c = Log::extend(&b, vec![item("d")]);
        assert_eq!((ids(&c), c.len()), (vec!["a", "b", "c", "d"].into_iter().map(String::from).collect(), 4));
        assert!(Arc::ptr_eq(&Log::extend(&c, Vec::new()), &c));
        assert_eq!(Log::of(Vec::new()).len(), 0);
        assert_eq!(c.values()[2]["content"], "c");
        // a chain too long to drop recursively
        let mut long = Log::empty();
        for _ in 0..200_000 {
            long = Log::extend(&long, vec![item("x")]);
        }
        assert_eq!(long.len(), 200_000);
        drop(long);
    }

    /// What `Holdings` should count for `held` (each log held once per entry): every log they
    /// reach through their parents once, and every item those list once.
    fn naive_bytes(held: &[Arc<Log>]) -> (usize, HashSet<String>) {
        let (mut logs, mut items, mut ids) = (HashSet::new(), HashSet::new(), HashSet::new());
        let mut total = 0;
        for log in held {
            let mut at = Some(log.as_ref());
            while let Some(l) = at {
                if logs.insert(l as *const Log) {
                    total += l.own_bytes();
                    for i in &l.items {
                        if items.insert(Arc::as_ptr(i)) {
                            total += i.bytes();
                            ids.insert(i.id().to_string());
                        }
                    }
                }
                at = l.parent.as_deref();
            }
        }
        (total, ids)
    }

    proptest::proptest! {
        /// Logs extending each other (sharing items too), held and released in any order:
        /// the bytes and the index are those of what the held logs reach.
        #[test]
        fn holdings_match_what_the_held_logs_reach(
            ops in proptest::collection::vec((0u8..3, 0usize..64, 0usize..3, 0usize..64), 1..80),
        ) {
            let mut logs = vec![Log::empty()];
            let mut items: Vec<Arc<Item>> = Vec::new();
            let mut held: Vec<Arc<Log>> = Vec::new();
            let mut holdings = Holdings::default();
            for (kind, a, n, b) in ops {
                match kind {
                    0 => {
                        // a new log: after any log, with new items and perhaps one already made
                        let mut new: Vec<Arc<Item>> =
                            (0..n).map(|k| item(&format!("i{}", items.len() + k))).collect();
                        items.extend(new.iter().cloned());
                        if !items.is_empty() && b % 2 == 0 {
                            new.push(items[b % items.len()].clone());
                        }
                        logs.push(Log::extend(&logs[a % logs.len()], new));
                    }
                    1 => {
                        let log = logs[a % logs.len()].clone();
                        holdings.hold(&log);
                        held.push(log);
                    }
                    _ if !held.is_empty() => {
                        let log = held.swap_remove(a % held.len());
                        holdings.release(&log);
                    }
                    _ => {}
                }
                let (bytes, ids) = naive_bytes(&held);
                proptest::prop_assert_eq!(holdings.bytes(), bytes);
                for i in &items {
                    proptest::prop_assert_eq!(holdings.find(i.id()).is_some(), ids.contains(i.id()));
                }
            }
        }
    }

    #[test]
    fn holdings_count_what_is_shared_once() {
        let shared = item("s");
        let base = Log::of(vec![shared.clone(), item("t")]);
        let one = Log::extend(&base, vec![item("u")]);
        let two = Log::extend(&base, vec![shared.clone()]);
        let mut held = Holdings::default();
        held.hold(&one);
        let after_one = held.bytes();
        assert_eq!(after_one, one.bytes());
        held.hold(&two);
        // `two` adds its own log only: its parent and its item are held already
        assert_eq!(held.bytes(), after_one + two.own_bytes());
        assert_eq!(held.counts(), (3, 3));
        assert!(Arc::ptr_eq(&held.find("s").unwrap(), &shared));
        held.release(&one);
        assert!(held.find("u").is_none() && held.find("t").is_some());
        held.hold(&two);
        held.release(&two);
        assert!(held.find("t").is_some());
        held.release(&two);
        assert_eq!((held.bytes(), held.counts(), held.find("s").is_none()), (0, (0, 0), true));
        // releasing what is not held changes nothing
        held.release(&base);
        assert_eq!(held.bytes(), 0);
    }
}
