//! The in-memory stores' shared frame (`response_store`, `conversation_store`, `chat_store`): a
//! store's state behind one lock, kept within `capacity` bytes of JSON text
//! (`--responses-store-mib`; 0: the store keeps nothing).

use std::sync::{Mutex, MutexGuard};

pub struct Bounded<I> {
    pub(crate) capacity: usize,
    inner: Mutex<I>,
}

impl<I: Default> Bounded<I> {
    pub fn new(capacity: usize) -> Self {
        Self { capacity, inner: Mutex::new(I::default()) }
    }
}

impl<I> Bounded<I> {
    /// Whether the store keeps anything at all.
    pub fn enabled(&self) -> bool {
        self.capacity > 0
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, I> {
        // (a panic while holding the lock leaves consistent data: each store's every change is
        // one insert, remove or edit followed by its byte count)
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl<I> std::fmt::Debug for Bounded<I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bounded").field("capacity", &self.capacity).finish_non_exhaustive()
    }
}
