//! The Mamba component: one recurrent state per sequence, kept at most once per node and
//! tier, at the node's end (`Node.mamba`). A match may end only at a node with a device
//! state; a lock holds the node's state (a single-node count); a split leaves it with the
//! lower part. Here are its hooks and its own operations: allocating state slots
//! (evicting a state first when short), placing a state on a node, evicting and freeing
//! one, and the map of which node holds each device state slot. The state eviction set
//! and its policies are the eviction module's (`eviction/`).

use crate::error::{Error, Result};
use crate::ids::RequestId;
use crate::pool::Pages;
use crate::tree::{Announced, Node, StateMark, NONE};

use super::shares::{
    BackupExtraSlots, BackupExtras, BackupOutcome, LoadExtras, NeededSlots, RequestShare,
    TakenSlots,
};
use super::{Component, ComponentKind, Model};
use crate::cache::copies::{PoolKind, SlotCopy, Tier};
use crate::cache::eviction::HOT;
use crate::cache::request::{Cow, RequestState};
use crate::cache::results::{CallOff, Found};
use crate::cache::{Cache, Evicted, Parts, Payload, View};

/// A device-to-device copy of one state slot.
fn state_copy(src: u32, dst: u32) -> SlotCopy {
    SlotCopy {
        pool: PoolKind::Mamba,
        src_tier: Tier::Device,
        dst_tier: Tier::Device,
        src: vec![i64::from(src)],
        dst: vec![i64::from(dst)],
    }
}

/// Mamba states: at most one per node and tier, at the node's end.
pub(crate) struct MambaStates;

impl Component for MambaStates {
    type Walk = ();

    #[inline]
    fn active(model: Model) -> bool {
        model.has(ComponentKind::Mamba)
    }

    #[inline]
    fn cut(c: &Cache, (): &mut (), i: u32, _: usize, on_device: bool) -> bool {
        on_device && c.tree.node(i).mamba.device.is_some()
    }

    #[inline]
    fn cut_any_tier(c: &Cache, (): &mut (), i: u32, _: usize) -> bool {
        let m = &c.tree.node(i).mamba;
        m.device.is_some() || m.host.is_some()
    }

    /// A split leaves the state with the lower part: no state ends inside a node.
    fn cut_inside(_: &Cache, (): &mut (), _: u32, _: usize, _: usize, _: bool) -> (bool, bool) {
        (false, false)
    }

    /// Holds the node's state (a single-node lock), when the lock asks for it and the
    /// node has one.
    #[inline]
    fn lock(p: &mut Parts, i: u32, state: bool) -> bool {
        let has = state && p.tree.node(i).mamba.device.is_some();
        if has {
            p.edit(i, |n| n.mamba.lock += 1);
            p.refresh(i);
        }
        has
    }

    #[inline]
    fn release(p: &mut Parts, i: u32, took: bool) {
        if took {
            // A locked state is never evicted: it is still there.
            p.edit(i, |n| n.mamba.lock -= 1);
        }
    }

    /// The state stays with the lower part, which keeps the node's end.
    #[inline]
    fn split(_: &mut Parts, _: u32, _: u32) {}

    /// State placement and locks are checked per node (`audit.rs`, invariant 3).
    fn audit(_: &Cache) -> Result<()> {
        Ok(())
    }

    /// The request gets its own state slot with a copy of the matched state (our lock
    /// holds the source, so eviction for the copy cannot take it); refused when no
    /// slot can be had.
    #[inline]
    fn admit(
        c: &mut Cache,
        m: &Found,
        share: &mut RequestShare,
        copies: &mut Vec<SlotCopy>,
    ) -> bool {
        let Some(src) = m.mamba_slot else {
            return true;
        };
        let Some(dst) = c.alloc_state() else {
            return false;
        };
        copies.push(state_copy(src, dst.pages()[0]));
        share.state = Some(dst);
        true
    }

    /// A request without a state slot needs one.
    #[inline]
    fn slots_needed(r: &RequestState, needed: &mut NeededSlots) {
        needed.states += usize::from(r.held.state.is_none());
    }

    #[inline]
    fn slots_available(v: &View, needed: NeededSlots) -> bool {
        needed.states == 0 || v.states_available(needed.states)
    }

    fn take_slots(c: &mut Cache, needed: NeededSlots, taken: &mut TakenSlots) -> bool {
        for _ in 0..needed.states {
            match c.take_state() {
                StateRoom::Now(s) if taken.state.is_none() => taken.state = Some(s),
                StateRoom::Now(s) => taken.more_states.push(s),
                StateRoom::Coming => taken.coming = true,
                StateRoom::No => return false,
            }
        }
        true
    }

    /// The request gets a state slot when it has none.
    #[inline]
    fn give_slots(taken: &mut TakenSlots, r: &mut RequestState) {
        if taken.state.is_some() && r.held.state.is_none() {
            if let Some(s) = taken.more_states.pop().or_else(|| taken.state.take()) {
                r.held.state = Some(s);
            }
        }
    }

    /// The tree gets a copy of the request's state at `end` (a `cow` batch), when the
    /// request ends there and `end` has none; counted as skipped when it cannot.
    fn checkpoint(c: &mut Cache, id: RequestId, end: u32, at_end: bool) {
        let Some(src) = c.request_ref(id).ok().and_then(|r| r.held.state_slot()) else {
            return;
        };
        if !at_end {
            c.stats.checkpoint_states_skipped += 1;
        } else if c.tree.node(end).mamba.device.is_none() {
            // With a waiting queue told of (`Cache::expect`): a state no waiting request
            // needs sooner than the one it would displace is let go by, unless the host
            // tier keeps states (placed, it is backed up there and can be loaded back).
            let depth = c.request_ref(id).map_or(0, |r| r.tokens.len());
            let rank = c.lru.rank_of(&c.tree, end, depth);
            let bypass = c.pools.host_mamba.capacity_pages() == 0
                && c.pools.mamba.free_pages() == 0
                && c.lru.bypasses(&c.tree, rank);
            if bypass {
                c.stats.checkpoint_states_bypassed += 1;
            } else if let Some(dst) = c.alloc_state() {
                c.lru.mark(&mut c.tree, end, rank);
                let dst_slot = dst.pages()[0];
                let node = c.tree.id(end);
                c.emit(
                    vec![state_copy(src, dst_slot)],
                    Payload::Cow(Cow::Checkpoint { node, dst }),
                );
            } else {
                c.stats.checkpoint_states_skipped += 1;
            }
        }
    }

    /// The state slot is retired (a copy may still write it).
    #[inline]
    fn restart(r: &mut RequestState) {
        r.retired.states.extend(r.held.state.take());
    }

    /// The state lands on the node when the sequence ends there and the node has none.
    #[inline]
    fn keep_on_node(p: &mut Parts, i: u32, at_end: bool, share: &mut RequestShare) -> bool {
        let Some(state) = share.state.take() else {
            return false;
        };
        if !at_end {
            // Taken at the sequence's end, which is no node's end.
            return false;
        }
        if p.tree.node(i).mamba.device.is_some() {
            return true;
        }
        p.set_state(i, state);
        // A waiting request told of (`Cache::expect`) may resume from it: marked at once,
        // as a checkpoint's state is.
        if p.lru.expecting() {
            let rank = p.lru.rank_of(p.tree, i, p.tree.depth(i));
            p.lru.mark(p.tree, i, rank);
        }
        false
    }

    /// A leaf without a state on any tier could not end a match on the host.
    #[inline]
    fn backup_useless(v: &View, i: u32) -> bool {
        let m = &v.tree.node(i).mamba;
        m.device.is_none() && m.host.is_none()
    }

    /// The node's device state, when it has no host copy and none is on its way, and
    /// its KV is there too (a state is useless on the host without it).
    fn backup(
        c: &mut Cache,
        i: u32,
        kv_there: bool,
        copies: &mut BackupExtras,
        count_short: bool,
    ) -> BackupOutcome {
        let m = &c.tree.node(i).mamba;
        let Some(slot) = m.device else {
            return BackupOutcome::default();
        };
        if m.host.is_some() || m.backup_pending || !kv_there {
            return BackupOutcome::default();
        }
        if let Some(h) = c.alloc_host_state() {
            copies.state_copy.0.push(i64::from(slot));
            copies.state_copy.1.push(i64::from(h.pages()[0]));
            copies.held.states.push((c.tree.id(i), h));
            BackupOutcome {
                copied: true,
                short: false,
            }
        } else {
            if count_short {
                c.stats.backup_states_skipped += 1;
            }
            BackupOutcome {
                copied: false,
                short: true,
            }
        }
    }

    /// A target without a device state gets its host state back (and so does the
    /// request); a request cannot run from a node with a state on no tier.
    fn load_plan(v: &View, j: u32, for_request: bool, plan: &mut LoadExtras) -> Result<()> {
        let n = v.tree.node(j);
        if n.mamba.device.is_none() && !n.is_root() {
            plan.restore_from = n.mamba.host;
            plan.for_request = for_request;
            if plan.restore_from.is_none() && for_request {
                return Err(Error::arg(
                    "node",
                    "has no Mamba state on any tier, so a request cannot run from it",
                ));
            }
        }
        Ok(())
    }

    /// A node ends a match only with a device state.
    #[inline]
    fn live_end(v: &View, i: u32) -> bool {
        v.tree.node(i).mamba.device.is_some()
    }

    /// A match needs a state on its path: a host state, or children.
    #[inline]
    fn useful_on_host(v: &View, i: u32) -> bool {
        let n = v.tree.node(i);
        n.mamba.host.is_some() || !n.children.is_empty()
    }

    /// The device state is freed.
    #[inline]
    fn drop_device(p: &mut Parts, i: u32, out: &mut Evicted) {
        p.drop_state(i, out);
    }

    /// The host state is freed.
    #[inline]
    fn drop_host(p: &mut Parts, i: u32) {
        if p.tree.node(i).mamba.host.is_none() {
            return;
        }
        if let Some(slot) = p.edit(i, |n| n.mamba.host.take()) {
            p.pools.host_mamba.release_tree(&[slot]);
        }
    }

    /// A slot restoring the target's state, then the request's own.
    fn load_take(c: &mut Cache, plan: &mut LoadExtras) -> std::result::Result<(), CallOff> {
        if plan.restore_from.is_some() {
            plan.held.restore = Some(c.alloc_state().ok_or(CallOff::State)?);
            if plan.for_request {
                plan.held.request.state = Some(c.alloc_state().ok_or(CallOff::State)?);
            }
        }
        Ok(())
    }

    fn backup_started(p: &mut Parts, held: &BackupExtraSlots) {
        for (id, _) in &held.states {
            if let Ok(i) = p.tree.resolve(*id) {
                p.edit(i, |n| n.mamba.backup_pending = true);
                p.refresh(i);
            }
        }
    }

    /// A node whose KV has its host copy gets the host state.
    fn backup_settled(p: &mut Parts, held: &mut BackupExtraSlots, publish: bool) {
        for (id, h) in std::mem::take(&mut held.states) {
            let Ok(i) = p.tree.resolve(id) else {
                drop(h);
                continue;
            };
            p.edit(i, |n| n.mamba.backup_pending = false);
            let n = p.tree.node(i);
            if publish && n.kv.host.is_some() && n.mamba.host.is_none() {
                p.edit(i, |n| n.mamba.host = h.into_tree().first().copied());
            } else {
                drop(h);
            }
            p.refresh(i);
        }
    }
}

/// A device state slot asked for: had now, on its way (it is freed when the backups of
/// the eviction that made it land), or not to be had.
pub(crate) enum StateRoom {
    Now(Pages),
    Coming,
    No,
}

impl Cache {
    /// One device state slot as an owned value (see [`Cache::alloc_mamba`]). When the
    /// pool is empty it evicts the least recently used state that no transfer pins (a
    /// pinned one would only drain); when there is none it evicts nothing.
    pub(crate) fn alloc_state(&mut self) -> Option<Pages> {
        match self.take_state() {
            StateRoom::Now(s) => Some(s),
            StateRoom::Coming | StateRoom::No => None,
        }
    }

    /// [`Cache::alloc_state`], telling apart a slot that is on its way: under write-back
    /// the state evicted for it may sit on a leaf that is backed up first, and its slot
    /// is freed when that backup lands (in the round this call started).
    pub(crate) fn take_state(&mut self) -> StateRoom {
        if self.pools.mamba.free_pages() == 0 {
            let Some(victim) = self.lru.pop_state(&mut self.tree) else {
                self.stats.mamba_alloc_failures += 1;
                return StateRoom::No;
            };
            let mut out = Evicted::default();
            self.evict_state_of(victim, &mut out);
            self.count_evicted(&out);
            if self.pools.mamba.free_pages() == 0 && out.mamba_states > 0 {
                self.stats.mamba_alloc_failures += 1;
                return StateRoom::Coming;
            }
        }
        if let Some(s) = self.pools.mamba.try_alloc(1) {
            StateRoom::Now(s)
        } else {
            self.stats.mamba_alloc_failures += 1;
            StateRoom::No
        }
    }

    /// One host state slot; when none is free, evicts the least recently used unlocked
    /// host-only leaf that holds one (and nothing when there is none, or when a slot
    /// is on its way: one an eviction put still reads, see [`Cache::alloc_host_pages`]).
    pub(crate) fn alloc_host_state(&mut self) -> Option<Pages> {
        if self.pools.host_mamba.free_pages() == 0 {
            if self.host_draining()[1] > 0 {
                self.stats.host_alloc_waits += 1;
                return None;
            }
            let victim = self.lru.first_host_state()?;
            self.delete_host_leaf(victim);
        }
        let got = self.pools.host_mamba.try_alloc(1);
        if got.is_none() {
            self.stats.host_alloc_waits += 1;
        }
        got
    }

    /// Publishes a state slot on node `i` ([`Parts::set_state`]; the unit tests' way in).
    #[cfg(test)]
    pub(crate) fn set_state(&mut self, i: u32, state: Pages) {
        self.parts().set_state(i, state);
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

    /// Frees node `i`'s device state ([`Parts::drop_state`]).
    pub(crate) fn drop_state(&mut self, i: u32, out: &mut Evicted) {
        self.parts().drop_state(i, out);
    }

    /// After device state slots were pinned or unpinned: the nodes holding them become
    /// eviction candidates, or stop being ones, accordingly.
    #[inline]
    pub(crate) fn refresh_pinned(&mut self, slots: &[u32]) {
        for &slot in slots {
            let i = self.state_nodes.get(slot as usize).copied().unwrap_or(NONE);
            if i != NONE {
                let pinned = self.pools.mamba.pins(slot) > 0;
                self.parts().mark_pinned(i, pinned);
                self.refresh(i);
            }
        }
    }

    /// The state's share of a lock ending at node `i` only (the path stays locked).
    pub(crate) fn release_state_lock(&mut self, i: u32) {
        MambaStates::release(&mut self.parts(), i, true);
    }
}

impl Parts<'_> {
    /// Publishes a state slot on node `i` (which has device KV and no state). Anything
    /// else would be a bug, which breaks the cache (see [`Cache::fault`]); the slot then
    /// goes back to the pool.
    #[inline]
    pub(crate) fn set_state(&mut self, i: u32, state: Pages) {
        let n = self.tree.node(i);
        if n.mamba.device.is_some() || n.kv.device.is_none() || state.len() != 1 {
            self.pools.mamba.record_fault(format!(
                "illegal state transition: {} state slots for node {}, which has a state: {}, \
                 device KV: {}",
                state.len(),
                self.tree.id(i),
                n.mamba.device.is_some(),
                n.kv.device.is_some()
            ));
            return;
        }
        let slot = state.into_tree();
        for &s in &slot {
            // Marked pinned or not first, so that the tallies count it right at once.
            self.place_state(s, i);
        }
        self.edit(i, |n| {
            n.mamba.device = slot.first().copied();
            n.mamba.hits = 0;
        });
        self.stats.states_cached += 1;
        self.lru.touch_state(self.tree, i, false);
        self.refresh(i);
        self.lru.state_placed(self.tree, i);
    }

    /// Frees node `i`'s device state (evictable: unlocked). A locked state is never
    /// freed: that would be a bug, which breaks the cache (see [`Cache::fault`]).
    // Always inlined, as `Parts::edit` is (eviction calls it per state).
    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub(crate) fn drop_state(&mut self, i: u32, out: &mut Evicted) {
        if self.tree.node(i).mamba.lock != 0 {
            self.pools.mamba.record_fault(format!(
                "illegal state transition: the locked state of node {} was to be freed",
                self.tree.id(i)
            ));
            return;
        }
        self.lru.unlist_state(self.tree, i);
        if let Some(slot) = self.edit(i, |n| {
            n.mamba.mark = StateMark::Idle;
            n.mamba.device.take()
        }) {
            self.place_state(slot, NONE);
            self.pools.mamba.release_tree(&[slot]);
            out.mamba_states += 1;
            self.lru.ancestor_state_changed(self.tree, i);
        }
    }

    /// Records that device state `slot` now sits on node `node` (`NONE`: left the tree),
    /// with whether a transfer pins it.
    #[inline]
    pub(crate) fn place_state(&mut self, slot: u32, node: u32) {
        let i = slot as usize;
        if i >= self.state_nodes.len() {
            self.state_nodes.resize(i + 1, NONE);
        }
        self.state_nodes[i] = node;
        if node != NONE {
            let pinned = self.pools.mamba.pins(slot) > 0;
            self.mark_pinned(node, pinned);
        }
    }

    /// Marks node `i`'s device state pinned by a transfer or not: a pinned state leaves
    /// the state eviction set first; an unpinned one is listed again by the next
    /// [`Parts::refresh`].
    // Always inlined, as `Parts::edit` is (the batches' pin changes call it per slot).
    #[allow(clippy::inline_always)]
    #[inline(always)]
    fn mark_pinned(&mut self, i: u32, pinned: bool) {
        let mark = self.tree.node(i).mamba.mark;
        if pinned && mark != StateMark::Pinned {
            self.lru.unlist_state(self.tree, i);
            self.edit(i, |n| n.mamba.mark = StateMark::Pinned);
        } else if !pinned && mark == StateMark::Pinned {
            self.edit(i, |n| n.mamba.mark = StateMark::Idle);
        }
    }
}

// The node's Mamba fields (`Node.mamba`), for the shared modules that need a fact of
// them: read and written here only (and by the sizes, eviction, report and audit
// modules).

/// Node `n`'s device state slot.
#[inline]
pub(crate) fn device_state(n: &Node) -> Option<u32> {
    n.mamba.device
}

/// Whether node `n` has a host state.
#[inline]
pub(crate) fn has_host_state(n: &Node) -> bool {
    n.mamba.host.is_some()
}

/// Whether node `n` has a state on some tier.
#[inline]
pub(crate) fn has_state_any_tier(n: &Node) -> bool {
    n.mamba.device.is_some() || n.mamba.host.is_some()
}

/// Whether a backup of node `n`'s state is in flight.
#[inline]
pub(crate) fn backup_pending(n: &Node) -> bool {
    n.mamba.backup_pending
}

/// Node `n`'s host state slot when the L3 tier does not hold that state yet.
#[inline]
pub(crate) fn host_state_not_in_l3(n: &Node) -> Option<u32> {
    n.mamba.host.filter(|_| !n.mamba.l3)
}

/// An `l3_put` wrote node `n`'s host state to the L3 tier.
#[inline]
pub(crate) fn mark_state_in_l3(n: &mut Node) {
    n.mamba.l3 = true;
}

/// A new host-only node fetched from the L3 tier gets `slot`, the host state fetched
/// with it (which the L3 tier holds), if any.
#[inline]
pub(crate) fn set_host_state_from_l3(n: &mut Node, slot: Option<u32>) {
    n.mamba.host = slot;
    n.mamba.l3 = slot.is_some();
}

/// What a router may be told of node `n` now ([`Announced::of`] with its states).
#[inline]
pub(crate) fn announced(n: &Node) -> Announced {
    Announced::of(n, n.mamba.device.is_some(), n.mamba.host.is_some())
}

impl View<'_> {
    /// Whether `n` state slots can be had now: free, or held by states that can be
    /// reclaimed (unlocked, unpinned: the state eviction set).
    pub(crate) fn states_available(&self, n: usize) -> bool {
        self.pools.mamba.free_pages() + self.lru.state_count() >= n
    }
}
