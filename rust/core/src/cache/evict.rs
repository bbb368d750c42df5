//! Device eviction (LRU leaves, states, tombstones), demotion to the host tier instead
//! of deletion, and host eviction.

use crate::error::Result;
use crate::tree::{StateMark, NONE};

use super::eviction::HOT;
use super::{Cache, Evicted};

impl Cache {
    /// Evicts at least `kv_tokens` device KV tokens and `mamba_states` device states (or
    /// everything evictable), least recently used first. Locked nodes are never touched.
    ///
    /// KV: unlocked device leaves; a parent left as an unlocked leaf joins the
    /// candidates in the same pass; a leaf's state goes with its KV. Mamba: unlocked
    /// states by last use; an internal node's (or a KV-locked leaf's) state is dropped
    /// and the node kept as a tombstone, an unlocked leaf is deleted with its KV. A leaf
    /// left without a state can never be matched again and is deleted too. O(log n) per
    /// evicted node.
    ///
    /// When the engine owns the slots, every slot the eviction freed is the engine's on
    /// return, listed in `Evicted::kv_indices` and `Evicted::mamba_slots` (a slot a
    /// transfer pins would join the queue when it drains instead); otherwise the freed
    /// slots went to the cache's free lists and both lists are empty.
    pub fn evict(&mut self, kv_tokens: usize, mamba_states: usize) -> Evicted {
        self.reap();
        // What the tree gives up joins the free lists (the queues) behind these marks.
        let marks = (self.pools.kv.queued_len(), self.pools.mamba.queued_len());
        let mut out = Evicted::default();
        while out.kv_tokens < kv_tokens {
            let Some(i) = self.lru.pop_kv(&mut self.tree) else {
                break;
            };
            self.remove_leaf(i, &mut out);
        }
        while out.mamba_states < mamba_states {
            let Some(i) = self.lru.pop_state(&mut self.tree) else {
                break;
            };
            self.evict_state_of(i, &mut out);
        }
        self.stats.evict_calls += 1;
        self.count_evicted(&out);
        if self.engine_owned() {
            let kv = self.pools.kv.take_queued(marks.0);
            let states = self.pools.mamba.take_queued(marks.1);
            self.expand_into(&kv, &mut out.kv_indices);
            out.mamba_slots = states.iter().map(|&s| i64::from(s)).collect();
            self.count_returned(out.kv_indices.len(), out.mamba_slots.len());
        }
        out
    }

    /// Hands every slot queued to go back to the engine to it: `(kv slots, state
    /// slots)`, each slot of each queued page once, in the order they were queued. A
    /// second call returns what was queued since. Without engine-owned pools nothing is
    /// ever queued (what the tree gives up goes to the cache's free lists) and both are
    /// empty.
    pub fn take_freed(&mut self) -> (Vec<i64>, Vec<i64>) {
        self.reap();
        if !self.engine_owned() {
            return (Vec::new(), Vec::new());
        }
        let pages = self.pools.kv.take_queued(0);
        let states = self.pools.mamba.take_queued(0);
        let mut kv = Vec::new();
        self.expand_into(&pages, &mut kv);
        let states: Vec<i64> = states.iter().map(|&s| i64::from(s)).collect();
        self.count_returned(kv.len(), states.len());
        (kv, states)
    }

    /// Adds slots handed back to the engine to the counters.
    fn count_returned(&mut self, kv: usize, states: usize) {
        self.stats.kv_slots_returned += kv as u64;
        self.stats.mamba_slots_returned += states as u64;
    }

    /// Adds what an eviction took to the counters.
    pub(crate) fn count_evicted(&mut self, out: &Evicted) {
        self.stats.evicted_kv_tokens += out.kv_tokens as u64;
        self.stats.evicted_mamba_states += out.mamba_states as u64;
    }

    /// Evicts node `i`'s (unlocked) state: an unlocked leaf goes with its KV, any other
    /// node stays as a tombstone.
    pub(crate) fn evict_state_of(&mut self, i: u32, out: &mut Evicted) {
        if self.tree.node(i).mamba.last_access & HOT != 0 {
            self.stats.evicted_used_states += 1;
        }
        self.lru.unlist_state(&mut self.tree, i);
        if self.tree.node(i).kv.state.in_lru() {
            self.lru.unlist_kv(&mut self.tree, i);
            self.remove_leaf(i, out);
        } else {
            self.drop_state(i, out);
            self.stats.tombstones += 1;
            self.refresh(i);
        }
    }

    /// Frees node `i`'s device state (evictable: unlocked). A locked state is never
    /// freed: that would be a bug, which breaks the cache (see [`Cache::fault`]).
    pub(crate) fn drop_state(&mut self, i: u32, out: &mut Evicted) {
        if self.tree.node(i).mamba.lock != 0 {
            self.pools.mamba.record_fault(format!(
                "illegal state transition: the locked state of node {} was to be freed",
                self.tree.id(i)
            ));
            return;
        }
        self.lru.unlist_state(&mut self.tree, i);
        if let Some(slot) = self.edit(i, |n| {
            n.mamba.mark = StateMark::Idle;
            n.mamba.device.take()
        }) {
            self.place_state(slot, NONE);
            self.pools.mamba.release_tree(&[slot]);
            out.mamba_states += 1;
            self.lru.ancestor_state_changed(&mut self.tree, i);
        }
    }

    /// Evicts a KV candidate (out of the KV set already): an unlocked device leaf, or a
    /// leaf to be (every device child is being evicted).
    ///
    /// A leaf with a useful host copy is demoted (kept with its host data only). Under
    /// write-back, one without is backed up and marked *evicting*: it is demoted when
    /// the backup lands, and its parent, if that leaves it a leaf to be, becomes a
    /// candidate in the same pass, so one round of backups makes all the room the
    /// eviction counted (docs/contract.md rule 11). A leaf to be is marked evicting too (backed up
    /// first if it needs it) and goes once its children have. Anything else is deleted
    /// with what is below it. Ancestors left as childless stateless unlocked leaves of a
    /// hybrid tree (unmatchable dead weight) go too. What is marked evicting counts as
    /// evicted now.
    pub(crate) fn remove_leaf(&mut self, i: u32, out: &mut Evicted) {
        // Host room made meanwhile (a write-back backup) may leave device leaves ending
        // in a dead SWA page: they go once this removal is done.
        let outer = self.swa_hold_dead_leaves();
        self.remove_leaf_now(i, out);
        if outer {
            self.swa_drop_held_dead_leaves();
        }
    }

    /// [`Cache::remove_leaf`] itself.
    fn remove_leaf_now(&mut self, mut i: u32, out: &mut Evicted) {
        loop {
            let n = self.tree.node(i);
            let (len, has_state, waits) =
                (n.key.len(), n.mamba.device.is_some(), n.device_children > 0);
            let useful = self.useful_on_host(i);
            if useful && !waits {
                self.demote(i, out);
                return;
            }
            if useful || self.backup_for_eviction(i) {
                self.set_evicting(i, true);
                out.kv_tokens += len;
                out.mamba_states += usize::from(has_state);
                return;
            }
            let parent = self.delete_subtree(i, out);
            let p = self.tree.node(parent);
            // A leaf no match can end at: stateless (hybrid), or a dead SWA end.
            let dead = !self.live_end_components(parent);
            if dead && p.kv.state.in_lru() && p.children.is_empty() {
                self.lru.unlist_kv(&mut self.tree, parent);
                i = parent;
            } else {
                self.drop_root_if_empty(parent);
                return;
            }
        }
    }

    /// Deletes node `i` when it is an unlocked leaf in the KV eviction set (one left
    /// ending in a dead SWA page when its last lock went: no match can end there).
    pub(crate) fn drop_dead_leaf(&mut self, i: u32) {
        let n = self.tree.node(i);
        if n.is_root() || !n.children.is_empty() || !n.kv.state.in_lru() {
            return;
        }
        self.lru.unlist_kv(&mut self.tree, i);
        let mut out = Evicted::default();
        self.remove_leaf(i, &mut out);
        self.count_evicted(&out);
    }

    /// Whether node `i` is worth keeping as host-only: it has a host KV copy and every
    /// component finds it useful there (Mamba: a host state or children, as a match
    /// needs a state on its path; SWA: its last host page has its host SWA page or it
    /// has children, as a match needs a live window at its end).
    fn useful_on_host(&self, i: u32) -> bool {
        self.tree.node(i).kv.host.is_some() && self.useful_on_host_components(i)
    }

    /// Marks node `i` as being evicted or not, keeping its parent's count of evicting
    /// children (what makes it a leaf to be) and both nodes' candidacy right.
    fn set_evicting(&mut self, i: u32, on: bool) {
        if self.tree.node(i).kv.state.evicting() == on {
            return;
        }
        self.mark_kv(i, |s| s.with_evicting(on));
        let parent = self.tree.node(i).parent;
        if self.tree.node(i).kv.device.is_some() {
            let p = self.tree.node_mut(parent);
            if on {
                p.evicting_children += 1;
            } else {
                p.evicting_children -= 1;
            }
        }
        self.refresh(i);
        self.refresh(parent);
    }

    /// Calls off the eviction of node `i` and of the ancestors waiting for it (a lock
    /// wants it, or it gains a device child that is not being evicted). A backup of it
    /// in flight still lands: the node then keeps its host copy.
    pub(crate) fn cancel_eviction(&mut self, mut i: u32) {
        while self.tree.node(i).kv.state.evicting() {
            self.set_evicting(i, false);
            self.lock_for_backup(i);
            i = self.tree.node(i).parent;
        }
    }

    /// Finishes the eviction of node `i` if it is ready (no backup in flight, no device
    /// child left): demoted when it has a useful host copy, deleted (with what is below
    /// it) when its backup failed; then the same for the ancestor that waited for it.
    /// The room was counted when the eviction chose the node.
    pub(crate) fn settle_eviction(&mut self, mut i: u32) {
        loop {
            let n = self.tree.node(i);
            if !n.kv.state.evicting()
                || n.kv.state.backup_pending()
                || n.mamba.backup_pending
                || n.device_children > 0
            {
                return;
            }
            let parent = n.parent;
            self.set_evicting(i, false);
            let mut uncounted = Evicted::default();
            if self.useful_on_host(i) {
                self.demote(i, &mut uncounted);
            } else {
                self.delete_subtree(i, &mut uncounted);
                // A parent left a leaf ending in a dead SWA page goes too.
                if self.swa_dead_end(parent) {
                    self.drop_dead_leaf(parent);
                    if !self.tree.node(parent).live {
                        return;
                    }
                }
                self.drop_root_if_empty(parent);
            }
            i = parent;
        }
    }

    /// Demotes an unlocked device leaf that has a host copy: frees its device KV and
    /// state, keeps the node with its host data.
    pub(crate) fn demote(&mut self, i: u32, out: &mut Evicted) {
        self.drop_device_components(i, out);
        out.kv_tokens += self.take_device_pages(i);
        self.stats.demotions += 1;
    }

    /// Frees node `i`'s device KV (it has no device child and keeps its host copy),
    /// keeping the sizes and eviction sets right; returns its tokens.
    pub(crate) fn take_device_pages(&mut self, i: u32) -> usize {
        let Some(pages) = self.edit(i, |n| n.kv.device.take()) else {
            return 0;
        };
        self.pools.kv.release_tree(&pages);
        let n = self.tree.node(i);
        let (len, parent) = (n.key.len(), n.parent);
        self.tree.node_mut(parent).device_children -= 1;
        self.refresh(i);
        self.refresh(parent);
        len
    }

    /// Frees a node's host copies (KV and the other components' data); under
    /// `l3_write="host_eviction"` what of them the L3 tier lacks is written first (the
    /// put's pages drain until it ends).
    fn drop_host(&mut self, i: u32) {
        self.lru.unlist_host(&mut self.tree, i);
        self.l3_write_evicted(i);
        self.discard_host(i);
    }

    /// Frees a node's host copies (out of the host sets), writing nothing anywhere.
    fn discard_host(&mut self, i: u32) {
        self.lru.unlist_host(&mut self.tree, i);
        if let Some(pages) = self.edit(i, |n| n.kv.host.take()) {
            self.pools.host_kv.release_tree(&pages);
        }
        self.drop_host_components(i);
    }

    /// Frees all node `d` holds, on both tiers, and the node itself (its children gone
    /// already, nothing of it locked or in flight); the device data it frees counts in
    /// `out`. A host copy the L3 tier lacks is written first under
    /// `l3_write="host_eviction"` when `write_l3` (an eviction), never otherwise.
    pub(crate) fn delete_node(&mut self, d: u32, out: &mut Evicted, write_l3: bool) {
        self.drop_device_components(d, out);
        if let Some(pages) = self.edit(d, |n| n.kv.device.take()) {
            self.pools.kv.release_tree(&pages);
        }
        self.lru.unlist_kv(&mut self.tree, d);
        if write_l3 {
            self.drop_host(d);
        } else {
            self.discard_host(d);
        }
        let parent = self.tree.node(d).parent;
        self.tree.unlink_child(parent, d);
        self.tree.free_node(d);
    }

    /// Deletes an unlocked device node together with what is below it: host-only nodes
    /// and nodes being evicted (an unlocked node has no locked descendant; their room was
    /// counted when the eviction chose them). Returns its parent (the caller drops it if
    /// it is a root left empty).
    pub(crate) fn delete_subtree(&mut self, i: u32, out: &mut Evicted) -> u32 {
        let below = self.tree.preorder(i);
        let mut counted = Evicted::default();
        for &d in below[1..].iter().rev() {
            let len = self.tree.node(d).key.len();
            self.delete_node(d, &mut counted, true);
            self.stats.host_evictions += 1;
            self.stats.host_evicted_tokens += len as u64;
        }
        self.set_evicting(i, false);
        self.lru.unlist_kv(&mut self.tree, i);
        self.drop_device_components(i, out);
        self.drop_host(i);
        let pages = self.edit(i, |n| n.kv.device.take()).unwrap_or_default();
        self.pools.kv.release_tree(&pages);
        let n = self.tree.node(i);
        let (len, parent) = (n.key.len(), n.parent);
        out.kv_tokens += len;
        self.tree.unlink_child(parent, i);
        self.tree.free_node(i);
        self.tree.node_mut(parent).device_children -= 1;
        self.refresh(parent);
        self.stats.evicted_nodes += 1;
        parent
    }

    /// Evicts at least `kv_tokens` host KV tokens and `mamba_states` host states (or
    /// everything evictable there): unlocked host-only leaves, least recently used
    /// first; a parent left as a host-only leaf joins the candidates. Nodes with device
    /// data keep their host copies (evict them from the device first, which demotes
    /// them). Returns what was taken from the host tier. With SWA layers a device parent
    /// left a leaf ending in a dead SWA page is deleted too (docs/contract.md rule 15).
    /// Refused when the engine owns the slots ([`crate::Error::EngineOwned`]: there is
    /// no host tier).
    pub fn evict_host(&mut self, kv_tokens: usize, mamba_states: usize) -> Result<Evicted> {
        self.cache_owned("evict_host")?;
        self.reap();
        let mut out = Evicted::default();
        while out.kv_tokens < kv_tokens || out.mamba_states < mamba_states {
            let Some(i) = self.lru.first_host() else {
                break;
            };
            let (len, states) = self.delete_host_leaf(i);
            out.kv_tokens += len;
            out.mamba_states += states;
        }
        Ok(out)
    }

    /// Host eviction: deletes unlocked host-only leaves, least recently used first,
    /// until `kv_pages` host pages and `states` host state slots are free or on their
    /// way (draining under the L3 tier's eviction puts, free once they end), or there
    /// is nothing left to evict. Each round deletes a node, so it ends; room on its way
    /// is never made twice.
    pub(crate) fn make_host_room(&mut self, kv_pages: usize, states: usize) {
        loop {
            let [coming_kv, coming_states] = self.host_draining();
            if self.pools.host_kv.free_pages() + coming_kv >= kv_pages
                && self.pools.host_mamba.free_pages() + coming_states >= states
            {
                return;
            }
            let Some(i) = self.lru.first_host() else {
                return;
            };
            self.delete_host_leaf(i);
        }
    }

    /// Deletes an unlocked host-only leaf, and the parent that leaves an unlocked
    /// host-only leaf ending in a host page without its host SWA page (no match could
    /// end there), or an unlocked device leaf ending in a dead SWA page (evicted as
    /// such); returns the host tokens and host states deleted.
    pub(crate) fn delete_host_leaf(&mut self, mut i: u32) -> (usize, usize) {
        let (mut tokens, mut states) = (0, 0);
        loop {
            let len = self.tree.node(i).key.len();
            states += usize::from(self.tree.node(i).mamba.host.is_some());
            self.drop_host(i);
            let parent = self.tree.node(i).parent;
            self.tree.unlink_child(parent, i);
            self.tree.free_node(i);
            self.refresh(parent);
            self.stats.host_evictions += 1;
            self.stats.host_evicted_tokens += len as u64;
            tokens += len;
            let p = self.tree.node(parent);
            if p.children.is_empty() && p.kv.lock == 0 && self.swa_host_dead_end(parent) {
                i = parent;
            } else {
                // A device parent left a leaf ending in a dead SWA page goes too (after
                // the device eviction that made this host room, if one did).
                if self.swa_dead_end(parent) {
                    self.swa_dead_leaf(parent);
                    if !self.tree.node(parent).live {
                        return (tokens, states);
                    }
                }
                self.drop_root_if_empty(parent);
                return (tokens, states);
            }
        }
    }
}
