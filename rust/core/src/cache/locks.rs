//! Path locks and their receipts.
//!
//! A lock protects the path from a node to its root from eviction (the KV lock count of
//! every node on it) and, when the node has a state, that state (a single-node count).
//! It is held by a [`LockReceipt`], an owned value: [`Cache::unlock`] consumes it, and
//! one dropped instead is released by the cache's next call (see `returns.rs`), so no
//! code path can leave a lock behind. [`Locks`] owns the table of live receipts.

use std::fmt;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::ids::{CacheId, LockId, NodeId};
use crate::slab::Slab;
use crate::tree::NONE;

use super::returns::{Returned, Returns};
#[cfg(debug_assertions)]
use super::sizes::Sizes;
use super::Cache;

/// What a live receipt locked.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Held {
    /// Arena index of the node the receipt locked (its path to the root is locked).
    pub node: u32,
    /// Whether the receipt also holds the node's state (single-node lock).
    pub mamba: bool,
}

/// The live receipts of a cache.
#[derive(Default)]
pub(crate) struct Locks {
    table: Slab<Held>,
}

impl Locks {
    /// Live receipts.
    pub fn live(&self) -> usize {
        self.table.len()
    }

    /// What each live receipt locked (audit).
    pub fn held(&self) -> impl Iterator<Item = Held> + '_ {
        self.table.iter().map(|(_, h)| *h)
    }
}

/// A lock receipt: the only way to release a lock. [`Cache::unlock`] consumes it; one
/// that is dropped instead is released by the cache's next call.
#[must_use = "a dropped receipt is released (at the cache's next call)"]
#[clippy::has_significant_drop]
pub struct LockReceipt {
    id: LockId,
    /// Where the drop leaves the id; `None` once given back.
    returns: Option<Arc<Returns>>,
}

impl fmt::Debug for LockReceipt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("LockReceipt").field(&self.id).finish()
    }
}

impl LockReceipt {
    /// The receipt's id.
    pub fn id(&self) -> LockId {
        self.id
    }

    /// Ends the receipt without releasing anything (the caller releases `id`).
    fn defuse(mut self) -> LockId {
        self.returns = None;
        self.id
    }
}

impl Drop for LockReceipt {
    fn drop(&mut self) {
        if let Some(returns) = self.returns.take() {
            returns.put(Returned::Lock(self.id));
        }
    }
}

impl Cache {
    /// Locks the path from `node` to its root against eviction, and the node's state if
    /// it has one (single-node lock); returns the receipt.
    pub fn lock(&mut self, node: NodeId) -> Result<LockReceipt> {
        self.reap();
        let i = self.tree.resolve(node)?;
        Ok(self.lock_index(i))
    }

    pub(crate) fn lock_index(&mut self, i: u32) -> LockReceipt {
        self.lock_with(i, true)
    }

    /// A request's lock after its admission (a checkpoint's, a load's). The request
    /// reads only its own state, never the node's: while the cache knows a waiting
    /// queue (whose marks keep what waiting requests need) the lock holds the path
    /// alone; without one, the node's state too (its prefix's next users are likeliest
    /// to want it, and nothing else tells eviction so).
    pub(crate) fn request_lock(&mut self, i: u32) -> LockReceipt {
        let state = !self.lru.expecting();
        self.lock_with(i, state)
    }

    fn lock_with(&mut self, i: u32, state: bool) -> LockReceipt {
        let mut cur = i;
        while cur != NONE {
            let first = self.count_kv_lock(cur, true);
            let parent = self.tree.node(cur).parent;
            if first && parent != NONE {
                // Wanted again: a node being evicted stays (with ancestors waiting on it).
                self.cancel_eviction(cur);
                self.refresh(cur);
            }
            cur = parent;
        }
        let mamba = self.lock_components(i, state);
        let slot = self.locks.table.insert(Held { node: i, mamba });
        self.stats.locks += 1;
        LockReceipt {
            id: LockId {
                cache: self.id(),
                slot,
            },
            returns: Some(Arc::clone(&self.returns)),
        }
    }

    /// Counts one lock more (`up`) or one less on node `i`'s KV; returns whether the count
    /// went from or to zero (the first lock, the last release). The sizes count a node
    /// only as locked or not, so only such a change moves its tallies
    /// ([`Sizes::lock_changed`](super::sizes::Sizes::lock_changed), which debug builds
    /// check against [`Sizes::of`](super::sizes::Sizes::of)).
    #[inline]
    fn count_kv_lock(&mut self, i: u32, up: bool) -> bool {
        let n = self.tree.node_mut(i);
        let edge = n.kv.lock == u32::from(!up);
        #[cfg(debug_assertions)]
        let (before, tallies) = (Sizes::of(n), self.sizes);
        if up {
            n.kv.lock += 1;
        } else {
            n.kv.lock -= 1;
        }
        if edge {
            self.sizes.lock_changed(n, up);
        }
        #[cfg(debug_assertions)]
        {
            let mut expected = tallies;
            expected -= before;
            expected += Sizes::of(n);
            debug_assert_eq!(
                self.sizes, expected,
                "lock_changed disagrees with Sizes::of"
            );
        }
        edge
    }

    /// Releases a receipt. A receipt of another cache raises [`Error::Lock`] (it is then
    /// released in its own cache, as if dropped).
    pub fn unlock(&mut self, receipt: LockReceipt) -> Result<()> {
        self.reap();
        if receipt.id.cache != self.id() {
            return Err(Error::Lock(format!(
                "lock receipt {} belongs to another cache",
                receipt.id
            )));
        }
        self.release(receipt.defuse())
    }

    /// Releases the lock `id` names. One that is not live raises [`Error::Lock`] and
    /// changes nothing.
    pub(crate) fn release(&mut self, id: LockId) -> Result<()> {
        let held = (id.cache == self.id())
            .then(|| self.locks.table.remove(id.slot))
            .flatten()
            .ok_or_else(|| {
                Error::Lock(format!(
                    "lock receipt {id} was already released or does not belong to this cache"
                ))
            })?;
        let node = held.node;
        self.release_components(node, held.mamba);
        let mut cur = node;
        while cur != NONE {
            let last = self.count_kv_lock(cur, false);
            let parent = self.tree.node(cur).parent;
            // A root is in no eviction set.
            if parent != NONE && (cur == node || last) {
                self.refresh(cur);
            }
            if parent == NONE && last {
                self.drop_root_if_empty(cur);
            }
            cur = parent;
        }
        if self.swa_dead_end(node) {
            self.drop_dead_leaf(node);
        }
        self.stats.unlocks += 1;
        Ok(())
    }

    /// Gives back the state share of the live lock `id` (its path stays locked): its
    /// holder no longer reads the node's state (a request's admission copy landed).
    pub(crate) fn release_state_share(&mut self, id: LockId) {
        if id.cache != self.id() {
            return;
        }
        let Some(held) = self.locks.table.get_mut(id.slot) else {
            return;
        };
        if !std::mem::take(&mut held.mamba) {
            return;
        }
        let node = held.node;
        self.release_state_lock(node);
        self.refresh(node);
    }

    /// The node a live receipt locks.
    pub fn lock_node(&self, receipt: &LockReceipt) -> Result<NodeId> {
        self.locked_node(receipt.id)
            .map(|i| self.tree.id(i))
            .ok_or_else(|| Error::Lock(format!("lock receipt {} is not live here", receipt.id)))
    }

    /// The node the live receipt `id` locks.
    pub(crate) fn locked_node(&self, id: LockId) -> Option<u32> {
        if id.cache != self.id() {
            return None;
        }
        self.locks.table.get(id.slot).map(|h| h.node)
    }

    /// The id of this cache.
    pub fn id(&self) -> CacheId {
        self.tree.cache_id
    }
}
