//! The host tier: backups (device to host), demotion instead of deletion, host eviction.
//!
//! A backup is a `backup` batch of device-to-host copies for nodes on one path, ancestors
//! first. Until it is acknowledged the nodes are device-locked by the batch's receipt
//! and marked `BackingUp` (their `KvState`; what other components back up is marked by
//! their `Component::backup_started`, a state's `backup_pending`);
//! the host pages it writes are owned by the batch and become the nodes' host copies
//! only at `complete` (a failed backup leaves the nodes not backed up). Under write-through a node is backed up once its insert count reaches
//! the threshold; under write-back only a node being evicted is, and its device pages
//! are freed when the backup completes.

use crate::config::WritePolicy;
use crate::ids::NodeId;
use crate::pool::{PageRun, Pages};

use super::components::shares::{BackupExtraSlots, BackupExtras};
use super::copies::{PoolKind, SlotCopy, Tier};
use super::locks::LockReceipt;
use super::{Cache, Payload};

/// Pages for page offsets along a root-to-node path, handed out node by node as a walk
/// goes down the path. Offsets are ascending and unique; the `k`-th page is for
/// `offsets[k]`.
pub(crate) struct PathPages {
    pages: PageRun,
    offsets: Vec<usize>,
    /// Offsets before this index were handed out or passed.
    next: usize,
}

impl PathPages {
    pub fn new(pages: Pages, offsets: Vec<usize>) -> PathPages {
        debug_assert_eq!(pages.len(), offsets.len());
        PathPages {
            pages: pages.into_run(),
            offsets,
            next: 0,
        }
    }

    /// The pages for offsets `start..end`, when this holds every one of them. Calls go
    /// down the path (`start` never decreases): pages of offsets passed over belong to
    /// no node any more and are dropped.
    pub fn take(&mut self, start: usize, end: usize) -> Option<Pages> {
        let rest = &self.offsets[self.next..];
        let lo = self.next + rest.partition_point(|&o| o < start);
        drop(self.pages.take(lo - self.next));
        let hi = lo + self.offsets[lo..].partition_point(|&o| o < end);
        self.next = hi;
        let here = self.pages.take(hi - lo);
        (start < end && hi - lo == end - start).then_some(here)
    }

    /// The pages not handed out yet.
    pub fn pages(&self) -> &[u32] {
        self.pages.pages()
    }
}

/// What a backup batch carries until it is acknowledged.
pub(crate) struct Backup {
    /// Locks the path to `end` (every backed-up node) on the device; `None` for the
    /// backup of a node being evicted (it is out of the eviction set meanwhile, and a
    /// lock would keep its ancestors from being evicted in the same round).
    pub lock: Option<LockReceipt>,
    /// The deepest node of the batch (split-stable: a split keeps the lower identity).
    pub end: NodeId,
    /// Host pages for the KV of the nodes backed up, by page offset along the path.
    pub kv: PathPages,
    /// What the components other than full attention back up (host state slots).
    pub held: BackupExtraSlots,
    /// The node being evicted under write-back: demoted when the backup completes,
    /// removed when it fails.
    pub demote: Option<NodeId>,
}

impl Backup {
    /// Calls `f(pool, pages)` for the host pages the batch owns until it ends (`pool`:
    /// 2 for host KV, 3 for host states, as in `report::POOLS`).
    pub fn owned(&self, mut f: impl FnMut(usize, &[u32])) {
        f(2, self.kv.pages());
        self.held.owned(f);
    }
}

impl Cache {
    /// Write-through: after an insert ended at `end`, backs up the deepest node on its
    /// path whose insert count reached the threshold, with its unbacked ancestors.
    pub(crate) fn maybe_backup(&mut self, end: u32) {
        let Some(threshold) = self.config().backup_threshold().map(u64::from) else {
            return;
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

    /// Backs up the nodes of `path` (root first) that have device data without a host
    /// copy: their KV, and their state when they have one. Host room is made by host
    /// eviction; when it cannot be, the chain stops there. Emits one batch.
    fn backup_path(&mut self, path: &[u32]) {
        let ps = self.config().page_size;
        let mut host_kv = self.pools.host_kv.empty();
        let mut offsets = Vec::new();
        let (mut kv_src, mut kv_dst) = (Vec::new(), Vec::new());
        let mut share = BackupExtras::default();
        let mut marked = Vec::new();
        let mut offset = 0;
        for (k, &i) in path.iter().enumerate() {
            let n = self.tree.node(i);
            let np = n.key.len() / ps;
            if n.kv.device.is_some() && !n.kv.state.loading() {
                let mut in_batch = false;
                if n.kv.host.is_none() && !n.kv.state.backup_pending() {
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
                    // Short of host SWA pages: the KV goes without its SWA KV.
                    self.backup_paired_pages_components(i, h.pages(), &mut share);
                    offsets.extend(offset..offset + np);
                    host_kv.append(h);
                    in_batch = true;
                }
                // The node's other data (its state), with its KV there.
                let kv_there = in_batch || self.tree.node(i).kv.host.is_some();
                in_batch |= self.backup_components(i, kv_there, &mut share, true).copied;
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
        let kv = PathPages::new(host_kv, offsets);
        self.emit_backup(end, &marked, kv, (kv_src, kv_dst), share, None);
    }

    /// Emits a backup batch for `marked` nodes (the deepest is `end`); `kv_copy` is the
    /// `(source, destination)` slots of the KV copy, `share` what the other components
    /// back up with their copies.
    fn emit_backup(
        &mut self,
        end: u32,
        marked: &[u32],
        kv: PathPages,
        kv_copy: (Vec<i64>, Vec<i64>),
        share: BackupExtras,
        demote: Option<NodeId>,
    ) {
        for &i in marked {
            if self.tree.node(i).kv.host.is_none() {
                self.mark_kv(i, |s| s.with_backup(true));
            }
        }
        let (held, others) = share.into_parts();
        self.backup_started_components(&held);
        let lock = demote.is_none().then(|| self.lock_index(end));
        let mut copies = Vec::new();
        let kv_copy = (!kv_copy.0.is_empty()).then_some((PoolKind::Kv, kv_copy));
        for (pool, (src, dst)) in kv_copy.into_iter().chain(others) {
            copies.push(SlotCopy {
                pool,
                src_tier: Tier::Device,
                dst_tier: Tier::Host,
                src,
                dst,
            });
        }
        let backup = Backup {
            lock,
            end: self.tree.id(end),
            kv,
            held,
            demote,
        };
        self.emit(copies, Payload::Backup(backup));
    }

    /// Write-back: backs up an unlocked device leaf being evicted (what it lacks on the
    /// host: its KV, its state), to be demoted when the copy completes. False, having
    /// taken nothing, when there is no host room or the copy would leave a hybrid leaf
    /// without a state on the host (useless there).
    pub(crate) fn backup_for_eviction(&mut self, i: u32) -> bool {
        if !self.has_host_tier() || self.config().write_policy != WritePolicy::WriteBack {
            return false;
        }
        let ps = self.config().page_size;
        let n = self.tree.node(i);
        let np = n.key.len() / ps;
        let leaf = n.children.is_empty();
        // A leaf no match could end at on the host (no state on any tier, a dead SWA
        // end): useless there.
        if leaf && self.backup_useless_components(i) {
            return false;
        }
        let host_kv = if self.tree.node(i).kv.host.is_none() {
            let Some(h) = self.alloc_host_pages(np) else {
                self.stats.backups_skipped += 1;
                return false;
            };
            Some(h)
        } else {
            None
        };
        // The node's other data (its state); a leaf must have it on the host.
        let mut share = BackupExtras::default();
        let backed = self.backup_components(i, true, &mut share, false);
        if leaf && backed.short {
            self.stats.backups_skipped += 1;
            return false;
        }
        if host_kv.is_none() && !backed.copied {
            return false;
        }
        let mut kv_copy = (Vec::new(), Vec::new());
        let mut offsets = Vec::new();
        let mut kv_pages = self.pools.host_kv.empty();
        if let Some(h) = host_kv {
            // A leaf backed up without its SWA KV could never be matched on the host
            // (a host tombstone leaf): it is not backed up. An internal node (an SWA
            // tombstone included) keeps its full KV for the deeper matches below it.
            if !self.backup_paired_pages_components(i, h.pages(), &mut share) && leaf {
                self.stats.backups_skipped += 1;
                return false;
            }
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
        self.stats.backup_tokens += kv_copy.0.len() as u64;
        let kv = PathPages::new(kv_pages, offsets);
        let id = self.tree.id(i);
        self.emit_backup(i, &[i], kv, kv_copy, share, Some(id));
        true
    }

    /// Walks the path to the backup's end and hands each node the host pages the batch
    /// wrote for it (`publish`), or just clears the in-flight marks.
    fn settle_backup(&mut self, b: &mut Backup, publish: bool) {
        let ps = self.config().page_size;
        if let Ok(end) = self.tree.resolve(b.end) {
            let mut offset = 0;
            for i in self.path_to(end) {
                let len = self.tree.node(i).key.len();
                let np = len / ps;
                if let Some(pages) = b.kv.take(offset, offset + np) {
                    self.mark_kv(i, |s| s.with_backup(false));
                    if publish && self.tree.node(i).kv.host.is_none() {
                        self.edit(i, |n| n.kv.host = Some(pages.into_tree()));
                    } else {
                        drop(pages);
                    }
                    self.refresh(i);
                }
                offset += np;
            }
        }
        self.backup_settled_components(&mut b.held, publish);
    }

    /// A backup batch ended. Landed: the nodes get their host copies; a write-back
    /// eviction demotes. Failed: the nodes stay not backed up; a write-back eviction
    /// removes the node instead of demoting it.
    pub(crate) fn backup_ended(&mut self, mut b: Backup, landed: bool) {
        if landed {
            self.stats.backups_done += 1;
        } else {
            self.stats.backups_failed += 1;
        }
        self.settle_backup(&mut b, landed);
        if landed {
            if let Ok(end) = self.tree.resolve(b.end) {
                let path = self.path_to(end);
                self.l3_offer(&path);
            }
        }
        if let Some(lock) = b.lock.take() {
            let _ = self.unlock(lock);
        }
        if let Some(i) = b.demote.and_then(|id| self.tree.resolve(id).ok()) {
            self.settle_eviction(i);
        }
    }

    /// Node `i`'s eviction was called off while its backup is in flight: the node stays
    /// out of reach until the backup lands, and so, until then, do its ancestors. The
    /// backup takes a lock on it (released when it ends), so that they count as
    /// protected rather than evictable: room the eviction cannot make is never counted.
    pub(crate) fn lock_for_backup(&mut self, i: u32) {
        let id = self.tree.id(i);
        let Some(batch) = self
            .batches
            .find(|p| matches!(p, Payload::Backup(b) if b.demote == Some(id) && b.lock.is_none()))
        else {
            return;
        };
        let lock = self.lock_index(i);
        match self.batches.payload_mut(batch) {
            Some(Payload::Backup(b)) => b.lock = Some(lock),
            _ => {
                let _ = self.unlock(lock);
            }
        }
    }
}
