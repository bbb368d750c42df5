//! `load_back`: host-to-device loads of cached prefixes, owned by a guard until committed.
//!
//! A load-back takes, in this order and all at once: a lock on the path to the target
//! node (it holds the host copies being read against host eviction and the device
//! ancestors against device eviction), device KV pages for the host-only nodes, a
//! device state slot that restores the target's state in the tree and, for a request,
//! a fresh state slot of the request's own. Everything it took lives in `Cache::loads`
//! under its batch id until one of two things happens:
//!
//! * `commit_load` publishes it: the pages go into the nodes (their `KvState` is
//!   `Loading`, so `match_prefix` does not see them until the copies are
//!   acknowledged), the request's
//!   prefix grows to the target, and the batch is in flight; `complete` makes the data
//!   visible, `fail` turns the load into a miss (nodes host-only again, the request as
//!   before the load).
//! * `cancel_load` (the guard dropped uncommitted) releases the lock and drops every
//!   slot: at once when the batch was never started, otherwise they drain until the
//!   batch is acknowledged. The request never saw any of it.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::ids::{BatchId, NodeId, RequestId};

use super::request::SavedRequest;
use crate::pool::Pages;

use super::components::mamba;
use super::components::shares::{LoadExtraSlots, LoadExtras};
use super::copies::{PoolKind, SlotCopy, Tier, TransferBatch};
use super::locks::LockReceipt;
use super::results::CallOff;
use super::returns::{Returned, Returns};
use super::{Cache, Payload};

/// What to load back: the path to a node, or what a request's admission found on the
/// host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadTarget {
    /// Load the host-only part of the path to this node.
    Node(NodeId),
    /// Load what the request's admission match found on the host (`host_len` tokens).
    Request(RequestId),
}

/// Where a load-back's batch stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CopyOutcome {
    Pending,
    Completed,
    Failed,
}

/// Everything a load-back holds.
pub(crate) struct Load {
    target: NodeId,
    request: Option<RequestId>,
    lock: Option<LockReceipt>,
    /// Page offset, along the path to the target, of the first page `kv` is for.
    start: usize,
    /// Device pages for the host-only nodes, in path order (moved into the nodes at
    /// commit).
    pub kv: Pages,
    /// What it holds for the other components: a state slot restoring the target's
    /// state in the tree, the request's fresh one (moved into the request at commit).
    pub held: LoadExtraSlots,
    kv_tokens: usize,
    pub copies: CopyOutcome,
    /// Set at commit.
    pub committed: bool,
    /// The request as it was before the commit, when there is one.
    pub saved: Option<SavedRequest>,
}

/// Load-backs by batch id: uncommitted ones (their [`LoadRecord`] is outstanding), and
/// committed ones whose copies are in flight.
#[derive(Default)]
pub(crate) struct Loads {
    table: BTreeMap<BatchId, Load>,
}

impl Loads {
    /// Load-backs pending.
    pub fn len(&self) -> usize {
        self.table.len()
    }

    /// Every pending load-back with its batch id (audit).
    pub fn iter(&self) -> impl Iterator<Item = (&BatchId, &Load)> {
        self.table.iter()
    }

    /// Whether load-back `id` is pending.
    pub fn contains(&self, id: BatchId) -> bool {
        self.table.contains_key(&id)
    }

    /// Whether pending load-back `id` is committed (`None`: not pending).
    pub fn committed(&self, id: BatchId) -> Option<bool> {
        self.table.get(&id).map(|l| l.committed)
    }
}

/// An uncommitted load-back, owned by whoever called [`Cache::load_back`]: it names
/// everything the load took (kept in the cache). [`Cache::commit_load`] publishes it,
/// [`Cache::cancel_load`] calls it off; dropped instead, it is called off by the cache's
/// next call.
#[must_use = "a dropped load-back record is called off (at the cache's next call)"]
#[clippy::has_significant_drop]
pub struct LoadRecord {
    id: BatchId,
    batch: TransferBatch,
    kv_tokens: usize,
    /// Where the drop leaves the id; `None` once committed or cancelled.
    returns: Option<Arc<Returns>>,
}

impl fmt::Debug for LoadRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoadRecord")
            .field("id", &self.id)
            .field("kv_tokens", &self.kv_tokens)
            .finish_non_exhaustive()
    }
}

impl LoadRecord {
    /// The batch id (acknowledge it with `complete` / `fail`).
    pub fn id(&self) -> BatchId {
        self.id
    }

    /// The copies to run (host to device), before or after commit.
    pub fn batch(&self) -> &TransferBatch {
        &self.batch
    }

    /// KV tokens this load moves.
    pub fn kv_tokens(&self) -> usize {
        self.kv_tokens
    }

    /// Ends the record without calling anything off (the caller settles `id`).
    fn defuse(mut self) -> BatchId {
        self.returns = None;
        self.id
    }
}

impl Drop for LoadRecord {
    fn drop(&mut self) {
        if let Some(returns) = self.returns.take() {
            returns.put(Returned::Load(self.id));
        }
    }
}

/// What `load_back` found to do.
struct Plan {
    /// Page offset of the first host-only node, and the host slots to read.
    start: usize,
    host_slots: Vec<i64>,
    pages: usize,
    busy: bool,
    /// What the other components load (a state; SWA's window).
    share: LoadExtras,
}

impl Plan {
    /// Why the load is called off before anything is taken, if it is: part of the path
    /// is being loaded, there is nothing to load, or a component refuses (SWA: no live
    /// window at the target).
    fn refused(&self) -> Option<CallOff> {
        if self.busy {
            Some(CallOff::Busy)
        } else if self.pages == 0 && !self.share.loads_data() {
            Some(CallOff::Nothing)
        } else {
            self.share.refused()
        }
    }
}

impl Cache {
    /// Starts a load-back of the host-only part of the path to `target` (for
    /// `request`, when given). Returns the record that owns it until it is committed or
    /// called off, or `None` having taken nothing when there is nothing to load, the load exceeds
    /// `mem_quota` plus the tokens its own lock newly protected, or the device cannot
    /// make room for the KV pages or the state slots.
    ///
    /// Errors (nothing taken): a stale node; a request that is not live, is still
    /// copying its admission state, has a load-back of its own pending, has extended
    /// past its reused prefix, or was not admitted through `target`; a request given
    /// with a hybrid target that has no state on any tier.
    pub fn load_back(
        &mut self,
        target: LoadTarget,
        mem_quota: Option<usize>,
        request: Option<RequestId>,
    ) -> Result<Option<LoadRecord>> {
        self.cache_owned("load_back")?;
        self.reap();
        let (node, request) = match target {
            LoadTarget::Node(n) => (Some(self.tree.resolve(n)?), request),
            LoadTarget::Request(r) => {
                if request.is_some() {
                    return Err(Error::arg(
                        "request",
                        "the target is a request already; pass request= only with a node",
                    ));
                }
                let host_node = self.request_ref(r)?.host_node;
                (host_node.and_then(|n| self.tree.resolve(n).ok()), Some(r))
            }
        };
        if let Some(r) = request {
            self.check_load_request(r, node)?;
        }
        let Some(j) = node else {
            return Ok(self.called_off(CallOff::Nothing));
        };
        if let Some(r) = request {
            // Above the request's own node there is nothing to load for it (a state on
            // the host only there would move the request back to a shorter prefix).
            let at = self.request_ref(r)?.node;
            if j != at && self.is_ancestor_or_self(j, at) {
                return Ok(self.called_off(CallOff::Nothing));
            }
        }
        let mut plan = self.load_plan(j, request.is_some())?;
        if let Some(why) = plan.refused() {
            return Ok(self.called_off(why));
        }
        let ps = self.page_size();
        let protected = self.sizes.protected_tokens;
        let lock = self.lock_index(j);
        let newly = self.sizes.protected_tokens - protected;
        let kv_tokens = plan.pages * ps;
        if mem_quota.is_some_and(|q| kv_tokens > q.saturating_add(newly)) {
            let _ = self.unlock(lock);
            return Ok(self.called_off(CallOff::Quota));
        }
        // Both checked before anything is evicted; states first (evicting one never
        // lowers free + evictable KV).
        if !self.slots_available(plan.share.wants()) {
            let _ = self.unlock(lock);
            return Ok(self.called_off(CallOff::State));
        }
        if !self.kv_available(plan.pages) {
            let _ = self.unlock(lock);
            return Ok(self.called_off(CallOff::Room));
        }
        let kv = match self.take_load_slots(plan.pages, &mut plan.share) {
            Ok(kv) => kv,
            Err(why) => {
                let _ = self.unlock(lock);
                return Ok(self.called_off(why));
            }
        };
        let start = plan.start;
        let (copies, held) = self.load_copies(plan, &kv);
        let batch = self.emit_held(copies, Payload::LoadBack);
        let id = batch.id;
        if let Some(r) = request {
            self.set_request_load(r, id);
        }
        self.loads.table.insert(
            id,
            Load {
                target: self.tree.id(j),
                request,
                lock: Some(lock),
                start,
                kv,
                held,
                kv_tokens,
                copies: CopyOutcome::Pending,
                committed: false,
                saved: None,
            },
        );
        self.stats.load_backs += 1;
        Ok(Some(LoadRecord {
            id,
            batch,
            kv_tokens,
            returns: Some(Arc::clone(&self.returns)),
        }))
    }

    /// The copies of a load: host KV to the new device pages, then the other
    /// components' (host SWA to their device SWA pages, the host state to the restoring
    /// slot and to the request's); and what the load holds for those components.
    fn load_copies(&self, mut plan: Plan, kv: &Pages) -> (Vec<SlotCopy>, LoadExtraSlots) {
        let mut copies = Vec::new();
        if plan.pages > 0 {
            let mut dst = Vec::with_capacity(plan.host_slots.len());
            self.expand_into(kv.pages(), &mut dst);
            copies.push(SlotCopy {
                pool: PoolKind::Kv,
                src_tier: Tier::Host,
                dst_tier: Tier::Device,
                src: plan.host_slots,
                dst,
            });
        }
        plan.share.copies(&mut copies);
        (copies, plan.share.held)
    }

    /// The components' device slots for node data (state slots), then KV pages
    /// (evicting; checked feasible before), then the data paired with them (the SWA
    /// pages of the window's, see [`Cache::load_swa`]), into `share` with the slots of
    /// their copies. What was taken goes back when a later step fails.
    fn take_load_slots(
        &mut self,
        pages: usize,
        share: &mut LoadExtras,
    ) -> std::result::Result<Pages, CallOff> {
        self.load_take_components(share)?;
        let kv = if pages > 0 {
            self.alloc_bare_pages(pages).ok_or(CallOff::Room)?
        } else {
            self.pools.kv.empty()
        };
        self.load_paired_pages_components(&kv, share)?;
        Ok(kv)
    }

    fn called_off(&mut self, why: CallOff) -> Option<LoadRecord> {
        self.stats.load_backs_called_off += 1;
        match why {
            CallOff::Nothing => self.stats.load_backs_called_off_nothing += 1,
            CallOff::Busy => self.stats.load_backs_called_off_busy += 1,
            CallOff::Quota => self.stats.load_backs_called_off_quota += 1,
            CallOff::Room => self.stats.load_backs_called_off_room += 1,
            CallOff::State => self.stats.load_backs_called_off_state += 1,
            CallOff::Swa => self.stats.load_backs_called_off_swa += 1,
            CallOff::Released => self.stats.load_backs_called_off_released += 1,
        }
        None
    }

    /// docs/contract.md rule 9, and no other copy of the request's pending.
    fn check_load_request(&self, r: RequestId, node: Option<u32>) -> Result<()> {
        self.refuse_while_copying(r, "load back for")?;
        let rs = self.request_ref(r)?;
        if rs.tokens.len() != rs.prefix_len {
            return Err(Error::arg(
                "request",
                format!(
                    "has extended past its reused prefix ({} tokens held, {} reused); \
                     load back before extending",
                    rs.tokens.len(),
                    rs.prefix_len
                ),
            ));
        }
        if let Some(j) = node {
            // The path to `j` must be a prefix of what the request was admitted for (as
            // far as the cache held it then); its locked node is on that path too, so
            // `j` is below it (or above, with nothing to load).
            let mut len = 0;
            let mut matches = true;
            for i in self.path_to(j) {
                let key = &self.tree.node(i).key;
                matches = matches && rs.admitted_is(len, key);
                len += key.len();
            }
            // And on the path through the request's own node (in its namespace, which
            // the tokens alone do not tell): at or below it, or above it (where there is
            // nothing to load for it; `load_back` calls that off).
            let on_path =
                self.is_ancestor_or_self(rs.node, j) || self.is_ancestor_or_self(j, rs.node);
            if !matches || !on_path {
                return Err(Error::arg(
                    "request",
                    "was not admitted for a sequence through this node",
                ));
            }
        }
        Ok(())
    }

    /// What loading the path to `j` takes.
    fn load_plan(&self, j: u32, for_request: bool) -> Result<Plan> {
        let ps = self.page_size();
        let mut plan = Plan {
            start: 0,
            host_slots: Vec::new(),
            pages: 0,
            busy: false,
            share: LoadExtras::default(),
        };
        let mut offset = 0;
        let mut first = None;
        for i in self.path_to(j) {
            let n = self.tree.node(i);
            plan.busy |= n.kv.state.loading();
            if n.kv.device.is_none() {
                first.get_or_insert(offset);
                if let Some(host) = &n.kv.host {
                    self.expand_into(host, &mut plan.host_slots);
                    plan.pages += host.len();
                }
            }
            offset += n.key.len() / ps;
        }
        plan.start = first.unwrap_or(offset);
        // What the other components load (the target's state; SWA's window).
        plan.share = self.load_plan_components(j, for_request)?;
        Ok(plan)
    }

    fn load_ref(&self, id: BatchId) -> Result<&Load> {
        self.loads.table.get(&id).ok_or_else(|| {
            Error::Request(format!(
                "load-back {id} is not pending in this cache (released, acknowledged, or \
                 from another cache)"
            ))
        })
    }

    /// Whether the load-back was committed (`Error::Request` once it is no longer
    /// pending: acknowledged, or called off).
    pub fn load_committed(&self, id: BatchId) -> Result<bool> {
        Ok(self.load_ref(id)?.committed)
    }

    /// Publishes a load-back: its pages go into the nodes, the restored state to the
    /// target (once the copies land) and, for a request, the prefix grows to the target
    /// and the fresh state slot becomes the request's. The loaded data is visible to
    /// `match_prefix` once the batch is also completed (in either order).
    ///
    /// Fails with `Error::Request` when the batch failed already, when its request
    /// extended since, or when another committed load-back is still landing on the path
    /// (an overlapping load that was committed first); the load is then called off (a
    /// miss), as if the record had been given to [`Cache::cancel_load`].
    pub fn commit_load(&mut self, record: LoadRecord) -> Result<()> {
        self.reap();
        match self.check_commit(record.id) {
            Ok(j) => {
                let id = record.defuse();
                self.publish_load(id, j);
                Ok(())
            }
            Err(e) => {
                self.cancel_load(record);
                Err(e)
            }
        }
    }

    /// Why load-back `id` cannot be committed now, if it cannot; else its target node.
    fn check_commit(&self, id: BatchId) -> Result<u32> {
        let load = self.load_ref(id)?;
        if load.committed {
            return Err(Error::Request(format!(
                "load-back {id} is committed already"
            )));
        }
        if load.copies == CopyOutcome::Failed {
            return Err(Error::Request(format!(
                "load-back {id} cannot be committed: its copies failed (a failed load is a \
                 miss); release it"
            )));
        }
        if let Some(rs) = load.request.and_then(|r| self.request_ref(r).ok()) {
            if rs.tokens.len() != rs.prefix_len {
                return Err(Error::Request(format!(
                    "load-back {id} cannot be committed: its request extended since \
                     load_back; release it"
                )));
            }
        }
        // The target is locked by the load: it is live.
        let target = self.tree.resolve(load.target)?;
        // Another committed load-back still landing on the path: publishing below its
        // nodes, or settling them as landed, would expose slots its copies still write.
        if self
            .path_to(target)
            .iter()
            .any(|&i| self.tree.node(i).kv.state.loading())
        {
            return Err(Error::Request(format!(
                "load-back {id} cannot be committed: another load-back is still landing on \
                 its path; release it"
            )));
        }
        Ok(target)
    }

    /// The commit itself (checked: cannot fail).
    fn publish_load(&mut self, id: BatchId, j: u32) {
        let Some(mut load) = self.loads.table.remove(&id) else {
            return;
        };
        let done = load.copies == CopyOutcome::Completed;
        self.publish_loaded(&mut load, j, !done);
        let fresh = std::mem::take(&mut load.held.request);
        let request = load.request.filter(|&r| self.request_live(r));
        let saved = if let Some(r) = request {
            self.move_request_to(r, j, fresh)
        } else {
            drop(fresh);
            None
        };
        self.stats.load_backs_committed += 1;
        self.stats.loaded_tokens += load.kv_tokens as u64;
        self.stats.swa_loaded_pages += load.held.swa_pages() as u64;
        if done {
            self.settle_load(id, load, j, saved, true);
        } else {
            load.committed = true;
            load.saved = saved;
            self.loads.table.insert(id, load);
        }
    }

    /// Moves the load's pages into the host-only nodes on the path to `j` (a node an
    /// insert revived meanwhile keeps its own; the load's pages for it are dropped).
    fn publish_loaded(&mut self, load: &mut Load, j: u32, loading: bool) {
        let ps = self.page_size();
        let mut offset = 0;
        let mut pages = std::mem::replace(&mut load.kv, self.pools.kv.empty()).into_run();
        for i in self.path_to(j) {
            let n = self.tree.node(i);
            let np = n.key.len() / ps;
            let has_device = n.kv.device.is_some();
            offset += np;
            if offset <= load.start {
                continue;
            }
            let here = pages.take(np);
            if has_device || here.len() != np {
                drop(here);
                continue;
            }
            self.mark_kv(i, |s| s.with_loading(loading));
            self.give_device_pages(i, here);
        }
    }

    /// The end of a committed load: `ok` makes its data visible and lets go of what the
    /// request had before; otherwise the nodes go back to host-only and the request to
    /// what it was.
    fn settle_load(
        &mut self,
        id: BatchId,
        mut load: Load,
        j: u32,
        saved: Option<SavedRequest>,
        ok: bool,
    ) {
        let request = load
            .request
            .filter(|&r| self.request_ref(r).is_ok_and(|rs| rs.load == Some(id)));
        // Nodes marked loading by this load: the path's deepest ones, up from `j`.
        let mut cur = j;
        while self.tree.node(cur).kv.state.loading() {
            let parent = self.tree.node(cur).parent;
            if !ok {
                // Locked, no device child: nothing is cached below a load in flight.
                // Freed while still marked loading, so that no event ever announces
                // the pages of a failed load.
                self.take_device_pages(cur);
            }
            self.mark_kv(cur, |s| s.with_loading(false));
            self.refresh(cur);
            cur = parent;
        }
        // The target gets the node data restored for it (its state).
        let at_end = ok && self.tree.node(j).kv.device.is_some();
        let had_state = mamba::device_state(self.tree.node(j)).is_some();
        self.keep_on_node_components(j, at_end, &mut load.held.for_target());
        if request.is_some() && !had_state && mamba::device_state(self.tree.node(j)).is_some() {
            self.lru.state_restored(&mut self.tree, j);
        }
        let mut release = Vec::new();
        if let Some(saved) = saved {
            match request {
                Some(r) if !ok => release.extend(self.restore_request(r, saved)),
                _ => release.extend(saved.release()),
            }
        }
        if let Some(r) = request {
            self.clear_request_load(r, id);
        }
        release.extend(load.lock.take());
        for l in release {
            let _ = self.unlock(l);
        }
    }

    /// A load-back's batch ended (`ok`: its copies landed).
    pub(crate) fn load_ended(&mut self, id: BatchId, ok: bool) {
        self.end_copies(id, ok);
        if !ok {
            self.stats.load_backs_failed += 1;
        }
    }

    fn end_copies(&mut self, id: BatchId, ok: bool) {
        let Some(load) = self.loads.table.get_mut(&id) else {
            // Its guard was released while the copies ran: they only drained.
            return;
        };
        if !load.committed {
            load.copies = if ok {
                CopyOutcome::Completed
            } else {
                CopyOutcome::Failed
            };
            return;
        }
        let Some(mut load) = self.loads.table.remove(&id) else {
            return;
        };
        let saved = load.saved.take();
        match self.tree.resolve(load.target) {
            Ok(j) => self.settle_load(id, load, j, saved, ok),
            // The target is locked until here; never reached.
            Err(_) => drop((load, saved)),
        }
    }

    /// Calls off an uncommitted load-back: the lock goes, and every slot it took
    /// returns at once, or, when its batch was started and not yet acknowledged, drains
    /// until it is. The request never saw any of it.
    pub fn cancel_load(&mut self, record: LoadRecord) {
        let id = record.defuse();
        self.drop_load(id);
    }

    /// [`Cache::cancel_load`] by id (a dropped record, or a record being cancelled).
    /// Nothing happens for a load that is not pending or is committed.
    pub(crate) fn drop_load(&mut self, id: BatchId) {
        if self.loads.table.get(&id).is_none_or(|l| l.committed) {
            return;
        }
        let Some(mut load) = self.loads.table.remove(&id) else {
            return;
        };
        // Never started: the batch is withdrawn, so the slots are free at once.
        self.withdraw_unstarted(id);
        if let Some(r) = load.request {
            self.clear_request_load(r, id);
        }
        if let Some(lock) = load.lock.take() {
            let _ = self.unlock(lock);
        }
        if load.copies != CopyOutcome::Failed {
            self.called_off(CallOff::Released);
        }
        drop(load);
    }
}
