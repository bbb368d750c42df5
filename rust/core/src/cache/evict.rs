//! Device eviction (LRU leaves, states, tombstones), demotion to the host tier instead
//! of deletion, and host eviction.

use crate::ids::NodeId;
use crate::tree::NONE;

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
    pub fn evict(&mut self, kv_tokens: usize, mamba_states: usize) -> Evicted {
        self.reap();
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
        self.count_evicted(out);
        out
    }

    /// Adds what an eviction took to the counters.
    pub(crate) fn count_evicted(&mut self, out: Evicted) {
        self.stats.evicted_kv_tokens += out.kv_tokens as u64;
        self.stats.evicted_mamba_states += out.mamba_states as u64;
    }

    /// Evicts node `i`'s (unlocked) state: an unlocked leaf goes with its KV, any other
    /// node stays as a tombstone.
    pub(crate) fn evict_state_of(&mut self, i: u32, out: &mut Evicted) {
        self.lru.unlist_state(&mut self.tree, i);
        if self.tree.node(i).kv.in_lru {
            self.lru.unlist_kv(&mut self.tree, i);
            self.remove_leaf(i, out);
        } else {
            self.drop_state(i, out);
            self.stats.tombstones += 1;
            self.refresh(i);
        }
    }

    /// Frees node `i`'s device state (evictable: unlocked).
    pub(crate) fn drop_state(&mut self, i: u32, out: &mut Evicted) {
        debug_assert_eq!(self.tree.node(i).mamba.lock, 0);
        self.lru.unlist_state(&mut self.tree, i);
        if let Some(slot) = self.edit(i, |n| n.mamba.device.take()) {
            self.place_state(slot, NONE);
            self.tree.node_mut(i).mamba.pinned = false;
            self.pools.mamba.release_tree(&[slot]);
            out.mamba_states += 1;
        }
    }

    /// Evicts an unlocked device leaf (out of the KV set already). A leaf with a
    /// useful host copy is demoted (kept with its host data only); under write-back one
    /// without is backed up first and demoted when the copy completes; any other is
    /// deleted with the host-only nodes below it. Ancestors left as childless stateless
    /// unlocked leaves of a hybrid tree (unmatchable dead weight) go too.
    pub(crate) fn remove_leaf(&mut self, mut i: u32, out: &mut Evicted) {
        let hybrid = self.is_hybrid();
        loop {
            let n = self.tree.node(i);
            let useful_on_host = n.kv.host.is_some()
                && (!hybrid || n.mamba.host.is_some() || !n.children.is_empty());
            if useful_on_host {
                self.demote(i, out);
                return;
            }
            let (len, has_state) = (n.key.len(), n.mamba.device.is_some());
            if self.backup_for_eviction(i) {
                // Counted as evicted now: its slots are free once the backup completes.
                out.kv_tokens += len;
                out.mamba_states += usize::from(has_state);
                return;
            }
            let parent = self.delete_subtree(i, out);
            let p = self.tree.node(parent);
            if hybrid && p.kv.in_lru && p.mamba.device.is_none() && p.children.is_empty() {
                self.lru.unlist_kv(&mut self.tree, parent);
                i = parent;
            } else {
                self.drop_root_if_empty(parent);
                return;
            }
        }
    }

    /// The end of a write-back eviction: the node, if nothing locked it meanwhile, is
    /// demoted (backed up) or removed (backup failed).
    pub(crate) fn finish_eviction(&mut self, demote: Option<NodeId>, backed_up: bool) {
        let Some(i) = demote.and_then(|id| self.tree.resolve(id).ok()) else {
            return;
        };
        if !self.tree.node(i).kv.in_lru {
            return;
        }
        self.lru.unlist_kv(&mut self.tree, i);
        let mut out = Evicted::default();
        if backed_up {
            self.remove_leaf(i, &mut out);
        } else {
            let parent = self.delete_subtree(i, &mut out);
            self.refresh(parent);
            self.drop_root_if_empty(parent);
        }
    }

    /// Demotes an unlocked device leaf that has a host copy: frees its device KV and
    /// state, keeps the node with its host data.
    pub(crate) fn demote(&mut self, i: u32, out: &mut Evicted) {
        self.drop_state(i, out);
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

    /// Frees a node's host copies (KV and state).
    fn drop_host(&mut self, i: u32) {
        self.lru.unlist_host(&mut self.tree, i);
        let (kv, state) = self.edit(i, |n| (n.kv.host.take(), n.mamba.host.take()));
        if let Some(pages) = kv {
            self.pools.host_kv.release_tree(&pages);
        }
        if let Some(slot) = state {
            self.pools.host_mamba.release_tree(&[slot]);
        }
    }

    /// Deletes an unlocked device leaf together with the host-only nodes below it (an
    /// unlocked node has no locked descendant); returns its parent (the caller drops it
    /// if it is a root left empty).
    pub(crate) fn delete_subtree(&mut self, i: u32, out: &mut Evicted) -> u32 {
        let below = self.tree.preorder(i);
        for &d in below[1..].iter().rev() {
            let len = self.tree.node(d).key.len();
            self.drop_host(d);
            let parent = self.tree.node(d).parent;
            self.tree.unlink_child(parent, d);
            self.tree.free_node(d);
            self.stats.host_evictions += 1;
            self.stats.host_evicted_tokens += len as u64;
        }
        self.drop_state(i, out);
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

    /// Host eviction: deletes unlocked host-only leaves, least recently used first,
    /// until `kv_pages` host pages and `states` host state slots are free (or there is
    /// nothing left to evict).
    pub(crate) fn evict_host(&mut self, kv_pages: usize, states: usize) {
        while self.pools.host_kv.free_pages() < kv_pages
            || self.pools.host_mamba.free_pages() < states
        {
            let Some(i) = self.lru.first_host() else {
                return;
            };
            self.delete_host_leaf(i);
        }
    }

    /// Deletes an unlocked host-only leaf.
    pub(crate) fn delete_host_leaf(&mut self, i: u32) {
        let len = self.tree.node(i).key.len();
        self.drop_host(i);
        let parent = self.tree.node(i).parent;
        self.tree.unlink_child(parent, i);
        self.tree.free_node(i);
        self.refresh(parent);
        self.drop_root_if_empty(parent);
        self.stats.host_evictions += 1;
        self.stats.host_evicted_tokens += len as u64;
    }
}
