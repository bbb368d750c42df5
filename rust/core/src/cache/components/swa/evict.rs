//! The SWA component's eviction: its own queue of nodes with live SWA pages, in the SWA
//! policy's order (`evict_swa`), and the device leaves left ending in a dead SWA page,
//! deleted at once or held until the device eviction in progress is done.

use std::cmp::Reverse;

use crate::cache::{Cache, Evicted, Parts};

impl Cache {
    /// Device node `i` was left a leaf ending in a dead SWA page: deleted now, or held
    /// until the device eviction in progress is done (it may be that very node's).
    pub(crate) fn swa_dead_leaf(&mut self, i: u32) {
        if self.swa.holding {
            self.swa.dead.push(self.tree.id(i));
        } else {
            self.drop_dead_leaf(i);
        }
    }

    /// Starts holding dead leaves back; true when this call started it (and must drop
    /// them with [`Cache::swa_drop_held_dead_leaves`]).
    pub(crate) fn swa_hold_dead_leaves(&mut self) -> bool {
        !std::mem::replace(&mut self.swa.holding, true)
    }

    /// Stops holding dead leaves back and deletes those that still are.
    pub(crate) fn swa_drop_held_dead_leaves(&mut self) {
        self.swa.holding = false;
        for id in std::mem::take(&mut self.swa.dead) {
            if let Ok(i) = self.tree.resolve(id) {
                if self.swa_dead_end(i) {
                    self.drop_dead_leaf(i);
                }
            }
        }
    }

    /// Queues node `i` for SWA eviction when it is a candidate ([`Parts::swa_enqueue`]).
    pub(crate) fn swa_enqueue(&mut self, i: u32) {
        self.parts().swa_enqueue(i);
    }

    /// Gives each of `pages` (device KV pages, held) its SWA page, evicting SWA first
    /// when short; false (nothing given) when that cannot make room.
    pub(crate) fn swa_attach(&mut self, pages: &[u32]) -> bool {
        loop {
            if self.pools.kv.attach_companion(pages) {
                return true;
            }
            let short = pages.len().saturating_sub(self.pools.kv.companion_free());
            if self.evict_swa(short.max(1)) == 0 {
                self.stats.swa_alloc_failures += 1;
                return false;
            }
        }
    }

    /// Frees at least `pages` SWA pages (or all it can), in the SWA policy's order
    /// (least recently used node first under "lru"): an internal node becomes a tombstone, a leaf is deleted whole. Returns the
    /// SWA pages freed.
    pub fn evict_swa(&mut self, pages: usize) -> usize {
        let before = self.pools.kv.companion_free();
        let mut out = Evicted::default();
        // Nodes whose pages a transfer reads or writes now (a backup, a load): their SWA
        // pages stay until it ends, and they stay queued.
        let mut in_flight = Vec::new();
        while self.pools.kv.companion_free() < before.saturating_add(pages) {
            let Some(Reverse(entry)) = self.swa.queue.pop() else {
                break;
            };
            let (key, i, generation) = entry;
            let n = self.tree.node(i);
            if !n.live || n.generation != generation || !n.swa.queued {
                continue;
            }
            if n.kv.state.backup_pending() || n.kv.state.loading() {
                in_flight.push(Reverse(entry));
                continue;
            }
            self.tree.node_mut(i).swa.queued = false;
            let n = self.tree.node(i);
            if !n.swa.locks.is_empty() || self.swa_tail(i) == 0 {
                // Locked (its release queues it again) or dead: no candidate.
                continue;
            }
            if self.lru.swa_key(n) > key {
                // Used (or its priority raised) since it was queued: back in line at its
                // newer place.
                self.swa_enqueue(i);
                continue;
            }
            if n.children.is_empty() {
                // A leaf loses its KV with its SWA (a tombstone is never a leaf). It has
                // no window lock, so no KV lock either (a lock's window covers its node).
                if n.kv.state.in_lru() {
                    self.lru.unlist_kv(&mut self.tree, i);
                    self.remove_leaf(i, &mut out);
                    // Under write-back it stays until its backup lands (its SWA pages
                    // with it): a candidate still, in flight.
                    if self.tree.node(i).live && self.tree.node(i).generation == generation {
                        self.swa_enqueue(i);
                    }
                } else {
                    // Out of the KV eviction set for now (its state locked or being
                    // backed up): it stays queued.
                    self.tree.node_mut(i).swa.queued = true;
                    in_flight.push(Reverse((key, i, generation)));
                }
            } else if let Some(pages) = self.tree.node(i).kv.device.clone() {
                self.pools.kv.detach_companion(&pages);
                self.stats.swa_tombstones += 1;
            }
        }
        self.swa.queue.extend(in_flight);
        self.count_evicted(&out);
        let freed = self.pools.kv.companion_free().saturating_sub(before);
        self.stats.swa_evicted_pages += freed as u64;
        freed
    }
}

impl Parts<'_> {
    /// Queues node `i` for SWA eviction when it is a candidate (live SWA, no window lock)
    /// and not queued yet.
    pub(crate) fn swa_enqueue(&mut self, i: u32) {
        if !self.has_swa() {
            return;
        }
        let n = self.tree.node(i);
        if !n.live || n.is_root() || n.swa.queued || !n.swa.locks.is_empty() {
            return;
        }
        if self.swa_tail(i) == 0 {
            return;
        }
        let entry = (self.lru.swa_key(n), i, n.generation);
        self.tree.node_mut(i).swa.queued = true;
        self.swa.queue.push(Reverse(entry));
    }
}
