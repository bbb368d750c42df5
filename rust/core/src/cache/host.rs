//! The host tier: backups (device to host), demotion instead of deletion, host eviction.
//!
//! A backup is a `backup` batch of device-to-host copies for nodes on one path, ancestors
//! first. Until it is acknowledged the nodes are device-locked by the batch's receipt
//! and marked `backup_pending`; the host pages it writes are owned by the batch and
//! become the nodes' host copies only at `complete` (a failed backup leaves the nodes
//! not backed up). Under write-through a node is backed up once its insert count reaches
//! the threshold; under write-back only a node being evicted is, and its device pages
//! are freed when the backup completes.

use crate::config::WritePolicy;
use crate::pool::Pages;
use crate::tree::NodeId;

use super::batch::{Action, BatchKind, Copy, PoolKind, Tier};
use super::{Cache, Evicted, LockId};

/// Pages for page offsets along a root-to-node path, handed out node by node. Offsets
/// are ascending and unique; `pages[k]` is the page for `offsets[k]`.
pub(crate) struct PathPages {
    pub pages: Pages,
    pub offsets: Vec<usize>,
}

impl PathPages {
    /// The pages for offsets `start..end`, when this holds every one of them.
    pub fn take(&mut self, start: usize, end: usize) -> Option<Pages> {
        let lo = self.offsets.partition_point(|&o| o < start);
        let hi = self.offsets.partition_point(|&o| o < end);
        if hi - lo != end - start || start == end {
            return None;
        }
        let mut mid = self.pages.split_off(lo);
        let rest = mid.split_off(hi - lo);
        self.pages.append(rest);
        self.offsets.drain(lo..hi);
        Some(mid)
    }
}

/// What a backup batch carries until it is acknowledged.
pub(crate) struct Backup {
    /// Locks the path to `end` (every backed-up node) on the device.
    pub lock: LockId,
    /// The deepest node of the batch (split-stable: a split keeps the lower identity).
    pub end: NodeId,
    /// Host pages for the KV of the nodes backed up, by page offset along the path.
    pub kv: PathPages,
    /// Host state slots, per node.
    pub states: Vec<(NodeId, Pages)>,
    /// The node being evicted under write-back: demoted when the backup completes,
    /// removed when it fails.
    pub demote: Option<NodeId>,
}

impl Cache {
    /// True when the cache has a host tier for KV.
    pub(crate) fn has_host_tier(&self) -> bool {
        self.config.host_kv_slots > 0
    }

    /// Nodes from the root (excluded) to `i`, in order.
    pub(crate) fn path_to(&self, i: u32) -> Vec<u32> {
        let mut path = Vec::new();
        let mut cur = i;
        while !self.tree.node(cur).is_root() {
            path.push(cur);
            cur = self.tree.node(cur).parent;
        }
        path.reverse();
        path
    }

    /// Write-through: after an insert ended at `end`, backs up the deepest node on its
    /// path whose insert count reached the threshold, with its unbacked ancestors.
    pub(crate) fn maybe_backup(&mut self, end: u32) {
        let threshold = match self.config.write_policy {
            _ if !self.has_host_tier() => return,
            WritePolicy::WriteBack => return,
            WritePolicy::WriteThrough => 1,
            WritePolicy::WriteThroughSelective => u64::from(self.config.write_through_threshold),
        };
        let mut path = self.path_to(end);
        while let Some(&last) = path.last() {
            if self.tree.node(last).hits >= threshold {
                self.backup_path(&path);
                return;
            }
            path.pop();
        }
    }

    /// Host pages, evicting host-only leaves first when short; `None` when even
    /// evicting every unlocked host-only node would not do, and then nothing is evicted.
    fn alloc_host_pages(&mut self, n: usize) -> Option<Pages> {
        let free = self.host_kv_pool.free_pages();
        if free < n {
            if free + self.host_evictable / self.config.page_size < n {
                return None;
            }
            self.evict_host(n, 0);
        }
        self.host_kv_pool.try_alloc(n)
    }

    /// One host state slot; when none is free, evicts the least recently used unlocked
    /// host-only leaf that holds one (and nothing when there is none).
    fn alloc_host_state(&mut self) -> Option<Pages> {
        if self.host_mamba_pool.free_pages() == 0 {
            let victim = self
                .host_lru
                .iter()
                .map(|&(_, i)| i)
                .find(|&i| self.tree.node(i).mamba.host.is_some())?;
            self.delete_host_leaf(victim);
        }
        self.host_mamba_pool.try_alloc(1)
    }

    /// Backs up the nodes of `path` (root first) that have device data without a host
    /// copy: their KV, and their state when they have one. Host room is made by host
    /// eviction; when it cannot be, the chain stops there. Emits one batch.
    fn backup_path(&mut self, path: &[u32]) {
        let ps = self.config.page_size;
        let mut host_kv = self.host_kv_pool.empty();
        let mut offsets = Vec::new();
        let (mut kv_src, mut kv_dst) = (Vec::new(), Vec::new());
        let (mut st_src, mut st_dst) = (Vec::new(), Vec::new());
        let mut states = Vec::new();
        let mut marked = Vec::new();
        let mut offset = 0;
        for (k, &i) in path.iter().enumerate() {
            let n = self.tree.node(i);
            let np = n.key.len() / ps;
            if n.kv.device.is_some() && !n.kv.loading {
                let mut in_batch = false;
                if n.kv.host.is_none() && !n.kv.backup_pending {
                    let Some(h) = self.alloc_host_pages(np) else {
                        let skipped = path[k..]
                            .iter()
                            .filter(|&&q| self.tree.node(q).kv.host.is_none())
                            .count();
                        self.stats.backups_skipped += skipped as u64;
                        break;
                    };
                    if let Some(pages) = &self.tree.node(i).kv.device {
                        self.expand_into(pages, &mut kv_src);
                    }
                    self.expand_into(h.pages(), &mut kv_dst);
                    offsets.extend(offset..offset + np);
                    host_kv.append(h);
                    in_batch = true;
                }
                let n = self.tree.node(i);
                if let Some(slot) = n.mamba.device {
                    let kv_there = in_batch || n.kv.host.is_some();
                    if n.mamba.host.is_none() && !n.mamba.backup_pending && kv_there {
                        if let Some(h) = self.alloc_host_state() {
                            st_src.push(i64::from(slot));
                            st_dst.push(i64::from(h.pages()[0]));
                            states.push((self.tree.id(i), h));
                            in_batch = true;
                        } else {
                            self.stats.backup_states_skipped += 1;
                        }
                    }
                }
                if in_batch {
                    marked.push(i);
                }
            }
            offset += np;
        }
        let Some(&end) = marked.last() else {
            return;
        };
        self.stats.backup_tokens += kv_src.len() as u64;
        let kv = PathPages {
            pages: host_kv,
            offsets,
        };
        self.emit_backup(
            end,
            &marked,
            kv,
            states,
            (kv_src, kv_dst),
            (st_src, st_dst),
            None,
        );
    }

    /// Emits a backup batch for `marked` nodes (the deepest is `end`).
    #[allow(clippy::too_many_arguments)]
    fn emit_backup(
        &mut self,
        end: u32,
        marked: &[u32],
        kv: PathPages,
        states: Vec<(NodeId, Pages)>,
        kv_copy: (Vec<i64>, Vec<i64>),
        state_copy: (Vec<i64>, Vec<i64>),
        demote: Option<NodeId>,
    ) {
        for &i in marked {
            let n = self.tree.node_mut(i);
            n.kv.backup_pending = n.kv.host.is_none();
        }
        for (id, _) in &states {
            if let Ok(i) = self.tree.resolve(*id) {
                self.tree.node_mut(i).mamba.backup_pending = true;
            }
        }
        let lock = self.lock_index(end);
        let mut copies = Vec::new();
        for (pool, (src, dst)) in [(PoolKind::Kv, kv_copy), (PoolKind::Mamba, state_copy)] {
            if !src.is_empty() {
                copies.push(Copy {
                    pool,
                    src_tier: Tier::Device,
                    dst_tier: Tier::Host,
                    src,
                    dst,
                });
            }
        }
        let backup = Backup {
            lock,
            end: self.tree.id(end),
            kv,
            states,
            demote,
        };
        self.emit(BatchKind::Backup, copies, Action::Backup(backup), true);
    }

    /// Write-back: backs up an unlocked device leaf being evicted (what it lacks on the
    /// host: its KV, its state), to be demoted when the copy completes. False, having
    /// taken nothing, when there is no host room or the copy would leave a hybrid leaf
    /// without a state on the host (useless there).
    pub(crate) fn backup_for_eviction(&mut self, i: u32) -> bool {
        if !self.has_host_tier() || self.config.write_policy != WritePolicy::WriteBack {
            return false;
        }
        let ps = self.config.page_size;
        let n = self.tree.node(i);
        let np = n.key.len() / ps;
        let needs_state = self.is_hybrid() && n.children.is_empty() && n.mamba.host.is_none();
        if needs_state && n.mamba.device.is_none() {
            return false;
        }
        let host_kv = if n.kv.host.is_none() {
            let Some(h) = self.alloc_host_pages(np) else {
                self.stats.backups_skipped += 1;
                return false;
            };
            Some(h)
        } else {
            None
        };
        let device_state = self.tree.node(i).mamba.device;
        let state = match device_state {
            Some(_) if self.tree.node(i).mamba.host.is_none() => self.alloc_host_state(),
            _ => None,
        };
        if needs_state && state.is_none() {
            self.stats.backups_skipped += 1;
            return false;
        }
        if host_kv.is_none() && state.is_none() {
            return false;
        }
        let mut kv_copy = (Vec::new(), Vec::new());
        let mut offsets = Vec::new();
        let mut kv_pages = self.host_kv_pool.empty();
        if let Some(h) = host_kv {
            if let Some(pages) = &self.tree.node(i).kv.device {
                self.expand_into(pages, &mut kv_copy.0);
            }
            self.expand_into(h.pages(), &mut kv_copy.1);
            // Offsets along the path: this node's pages come after all its ancestors'.
            let mut before = 0;
            let mut cur = self.tree.node(i).parent;
            while !self.tree.node(cur).is_root() {
                before += self.tree.node(cur).key.len() / ps;
                cur = self.tree.node(cur).parent;
            }
            offsets.extend(before..before + np);
            kv_pages = h;
        }
        let mut state_copy = (Vec::new(), Vec::new());
        let mut states = Vec::new();
        if let (Some(h), Some(slot)) = (state, device_state) {
            state_copy.0.push(i64::from(slot));
            state_copy.1.push(i64::from(h.pages()[0]));
            states.push((self.tree.id(i), h));
        }
        self.stats.backup_tokens += kv_copy.0.len() as u64;
        let kv = PathPages {
            pages: kv_pages,
            offsets,
        };
        let id = self.tree.id(i);
        self.emit_backup(i, &[i], kv, states, kv_copy, state_copy, Some(id));
        true
    }

    /// Walks the path to the backup's end and hands each node the host pages the batch
    /// wrote for it (`publish`), or just clears the in-flight marks.
    fn settle_backup(&mut self, b: &mut Backup, publish: bool) {
        let ps = self.config.page_size;
        if let Ok(end) = self.tree.resolve(b.end) {
            let mut offset = 0;
            for i in self.path_to(end) {
                let len = self.tree.node(i).key.len();
                let np = len / ps;
                if let Some(pages) = b.kv.take(offset, offset + np) {
                    let n = self.tree.node_mut(i);
                    n.kv.backup_pending = false;
                    if publish && n.kv.host.is_none() {
                        n.kv.host = Some(pages.into_tree());
                        self.host_tokens += len;
                    } else {
                        drop(pages);
                    }
                }
                offset += np;
            }
        }
        for (id, h) in std::mem::take(&mut b.states) {
            let Ok(i) = self.tree.resolve(id) else {
                drop(h);
                continue;
            };
            let n = self.tree.node_mut(i);
            n.mamba.backup_pending = false;
            if publish && n.kv.host.is_some() && n.mamba.host.is_none() {
                n.mamba.host = h.into_tree().first().copied();
            } else {
                drop(h);
            }
        }
    }

    /// A backup landed: the nodes get their host copies; a write-back eviction demotes.
    pub(crate) fn backup_done(&mut self, mut b: Backup) {
        self.settle_backup(&mut b, true);
        let _ = self.unlock(b.lock);
        self.stats.backups_done += 1;
        self.finish_eviction(b.demote, true);
    }

    /// A backup failed: the nodes stay not backed up; a write-back eviction removes the
    /// node instead of demoting it.
    pub(crate) fn backup_failed(&mut self, mut b: Backup) {
        self.settle_backup(&mut b, false);
        let _ = self.unlock(b.lock);
        self.stats.backups_failed += 1;
        self.finish_eviction(b.demote, false);
    }

    /// The end of a write-back eviction: the node, if nothing locked it meanwhile, is
    /// demoted (backed up) or removed (backup failed).
    fn finish_eviction(&mut self, demote: Option<NodeId>, backed_up: bool) {
        let Some(i) = demote.and_then(|id| self.tree.resolve(id).ok()) else {
            return;
        };
        let n = self.tree.node(i);
        if !n.kv.in_lru {
            return;
        }
        self.kv_lru.remove(&(n.last_access, i));
        self.tree.node_mut(i).kv.in_lru = false;
        let mut out = Evicted::default();
        if backed_up {
            self.remove_leaf(i, &mut out);
        } else {
            let parent = self.delete_subtree(i, &mut out);
            self.refresh_candidate(parent);
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
        let n = self.tree.node_mut(i);
        let (len, parent, locked) = (n.key.len(), n.parent, n.kv.lock > 0);
        let Some(pages) = n.kv.device.take() else {
            return 0;
        };
        self.kv_pool.release_tree(&pages);
        if locked {
            self.protected_tokens -= len;
        } else {
            self.evictable_tokens -= len;
            self.host_evictable += len;
        }
        self.tree.node_mut(parent).device_children -= 1;
        self.refresh_candidate(i);
        self.refresh_candidate(parent);
        len
    }

    /// Frees a node's host copies (KV and state).
    fn drop_host(&mut self, i: u32) {
        let n = self.tree.node_mut(i);
        if n.kv.in_host_lru {
            n.kv.in_host_lru = false;
            let key = (n.last_access, i);
            self.host_lru.remove(&key);
        }
        let n = self.tree.node_mut(i);
        let len = n.key.len();
        let host_only_unlocked = n.kv.device.is_none() && n.kv.lock == 0;
        if let Some(pages) = n.kv.host.take() {
            self.host_kv_pool.release_tree(&pages);
            self.host_tokens -= len;
            if host_only_unlocked {
                self.host_evictable -= len;
            }
        }
        if let Some(slot) = self.tree.node_mut(i).mamba.host.take() {
            self.host_mamba_pool.release_tree(&[slot]);
        }
    }

    /// Deletes an unlocked device leaf together with the host-only nodes below it (an
    /// unlocked node has no locked descendant); returns its parent.
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
        let n = self.tree.node_mut(i);
        let len = n.key.len();
        let parent = n.parent;
        let pages = n.kv.device.take().unwrap_or_default();
        self.kv_pool.release_tree(&pages);
        self.evictable_tokens -= len;
        out.kv_tokens += len;
        self.tree.unlink_child(parent, i);
        self.tree.free_node(i);
        self.tree.node_mut(parent).device_children -= 1;
        self.refresh_candidate(parent);
        self.stats.evicted_nodes += 1;
        parent
    }

    /// Host eviction: deletes unlocked host-only leaves, least recently used first,
    /// until `kv_pages` host pages and `states` host state slots are free (or there is
    /// nothing left to evict).
    pub(crate) fn evict_host(&mut self, kv_pages: usize, states: usize) {
        while self.host_kv_pool.free_pages() < kv_pages
            || self.host_mamba_pool.free_pages() < states
        {
            let Some(&(_, i)) = self.host_lru.first() else {
                return;
            };
            self.delete_host_leaf(i);
        }
    }

    /// Deletes an unlocked host-only leaf.
    fn delete_host_leaf(&mut self, i: u32) {
        let len = self.tree.node(i).key.len();
        self.drop_host(i);
        let parent = self.tree.node(i).parent;
        self.tree.unlink_child(parent, i);
        self.tree.free_node(i);
        self.refresh_candidate(parent);
        self.stats.host_evictions += 1;
        self.stats.host_evicted_tokens += len as u64;
    }
}
