//! The SWA component's checks (`audit()`): the requests' windows, the window locks, the
//! eviction queue and the tombstones against what the rest of the cache says.

use std::cmp::Reverse;

use crate::cache::eviction::Key;
use crate::cache::Cache;
use crate::error::{Error, Result};
use crate::tree::NONE;

impl Cache {
    /// Checks the SWA component: every request's window has its SWA pages, the window
    /// locks each node holds are exactly those of the live receipts, every candidate is
    /// queued, once, at or before its place under the SWA policy, and no unlocked leaf ends in a dead page (a tombstone is never a leaf, on
    /// the device or, by its host SWA pages, on the host). The pairings themselves (every
    /// SWA page free or with exactly one KV page that is not free, device and host) are
    /// the pools' audit.
    pub(crate) fn audit_swa(&self) -> Result<()> {
        if !self.has_swa() {
            return Ok(());
        }
        let nodes = &self.tree.nodes;
        let mut want: Vec<Vec<u32>> = vec![Vec::new(); nodes.len()];
        for held in self.locks.held() {
            let mut left = self.swa.need;
            let mut cur = held.node;
            while left > 0 && cur != NONE && !nodes[cur as usize].is_root() {
                want[cur as usize].push(crate::pool::index_u32(left));
                left = left.saturating_sub(nodes[cur as usize].key.len());
                cur = nodes[cur as usize].parent;
            }
        }
        for r in self.requests.iter() {
            let (start, pages) = self.window_of(r);
            if let Some(k) = pages.iter().position(Option::is_none) {
                return Err(Error::Invariant(format!(
                    "request at node {}: page {k} of its window (from token {start}) has no \
                     SWA KV",
                    self.tree.id(r.node)
                )));
            }
        }
        // Each live node's queue entries (of its generation): at most one, and one
        // exactly when it is marked queued, keyed at most its key now.
        let mut entries: Vec<Option<Key>> = vec![None; nodes.len()];
        for Reverse((key, i, generation)) in &self.swa.queue {
            let n = &nodes[*i as usize];
            if !n.live || n.generation != *generation {
                continue;
            }
            let id = self.tree.id(*i);
            if entries[*i as usize].replace(*key).is_some() {
                return Err(Error::Invariant(format!(
                    "node {id}: queued twice for SWA eviction"
                )));
            }
            if !n.swa.queued {
                return Err(Error::Invariant(format!(
                    "node {id}: in the SWA eviction queue, not marked queued"
                )));
            }
            let now = self.lru.swa_key(n);
            if *key > now {
                return Err(Error::Invariant(format!(
                    "node {id}: SWA eviction queue key {key:?} past the SWA policy's key \
                     {now:?} (keys only grow)"
                )));
            }
        }
        for (i, n) in nodes.iter().enumerate() {
            let index = crate::pool::index_u32(i);
            if n.live && n.swa.queued && entries[i].is_none() {
                return Err(Error::Invariant(format!(
                    "node {}: marked queued, not in the SWA eviction queue",
                    self.tree.id(index)
                )));
            }
            let mut have = n.swa.locks.clone();
            have.sort_unstable();
            want[i].sort_unstable();
            if have != want[i] {
                return Err(Error::Invariant(format!(
                    "node {i}: window locks {have:?}, the live receipts make {:?}",
                    want[i]
                )));
            }
            if !n.live || n.is_root() {
                continue;
            }
            let live = self.swa_tail(index) > 0;
            if live && n.swa.locks.is_empty() && !n.swa.queued {
                return Err(Error::Invariant(format!(
                    "node {}: live SWA, no window lock, not in the SWA eviction queue",
                    self.tree.id(index)
                )));
            }
            if n.children.is_empty() && n.kv.lock == 0 && self.swa_host_dead_end(index) {
                return Err(Error::Invariant(format!(
                    "node {}: an unlocked host-only leaf whose last host page has no host \
                     SWA page (a host tombstone leaf)",
                    self.tree.id(index)
                )));
            }
            // A leaf being evicted is exempt: it goes when its backup ends.
            if n.kv.device.is_some()
                && n.children.is_empty()
                && n.kv.lock == 0
                && !live
                && !n.kv.state.evicting()
            {
                return Err(Error::Invariant(format!(
                    "node {}: an unlocked leaf whose last page has no SWA KV (a tombstone \
                     leaf)",
                    self.tree.id(index)
                )));
            }
        }
        Ok(())
    }
}
