//! The drop box: owned values the cache hands out (lock receipts, load-back records) that
//! were dropped instead of being given back.
//!
//! Such a value cannot reach the cache when it drops (it has no `&mut Cache`), so its
//! drop leaves its id here, and the cache settles it at its next call ([`Cache::reap`]):
//! the lock is released, the load-back called off. A forgotten release is therefore late,
//! never lost. The shared handle ([`crate::HybridCache`]) releases what its own owned
//! handles hold at once and reaps before every call, so through it nothing is late.

use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;

use crate::ids::{BatchId, LockId};

use super::Cache;

/// What a dropped value leaves behind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Returned {
    /// A lock receipt dropped without `unlock`.
    Lock(LockId),
    /// A load-back record dropped without `commit_load` or `cancel_load`.
    Load(BatchId),
}

/// Ids of dropped values, waiting for the cache.
#[derive(Default)]
pub(crate) struct Returns {
    /// Set when something is waiting: a call checks this and nothing else when empty.
    waiting: AtomicBool,
    items: Mutex<Vec<Returned>>,
}

impl Returns {
    /// Leaves `item` for the cache (from a `Drop`: never blocks for long, never panics).
    pub fn put(&self, item: Returned) {
        self.items.lock().push(item);
        self.waiting.store(true, Ordering::Release);
    }

    fn take(&self) -> Vec<Returned> {
        if !self.waiting.swap(false, Ordering::Acquire) {
            return Vec::new();
        }
        std::mem::take(&mut *self.items.lock())
    }
}

impl Cache {
    /// Settles what was dropped since the last call: releases dropped receipts, calls
    /// off dropped load-back records.
    pub fn reap(&mut self) {
        for item in self.returns.take() {
            match item {
                // A receipt in the box is live: releasing it cannot fail.
                Returned::Lock(id) => {
                    let _ = self.release(id);
                }
                Returned::Load(id) => self.drop_load(id),
            }
        }
    }
}
