//! Components: the kinds of layers a model is made of, and the interface through which
//! the cache's shared machinery (the match walk, locks, splits, `audit()`) reaches each.
//!
//! A model is a set of components ([`Model`]): full attention always, Mamba states and
//! sliding-window attention (SWA) when configured. Each is a [`Component`]:
//!
//! | component | keeps per node | a match may end at a node when | evicted | a lock holds | between tiers |
//! |---|---|---|---|---|---|
//! | [`FullAttention`] | KV pages (`Node.kv`), device and host | its KV is on the device (prefix-closed) | leaves only, its own order (`lru.rs`) | the path to the root | pages, both ways |
//! | [`MambaStates`] | at most one state per tier (`Node.mamba`) | it has a device state | any unlocked state (`lru.rs`) | the node's state | states, both ways |
//! | [`SlidingWindow`] | an SWA page paired with each KV page it keeps (`pool.rs`) | the last `swa_window` tokens are live | tombstones in the middle, leaves whole (`swa.rs`) | the window's nodes | the paired pages |
//!
//! The match walk ([`Cut`]) asks every component of the model whether the match may end
//! at each node of the path and cuts at the deepest node all accept; a lock, its release
//! and a split call each component's hook; `audit()` runs each component's own checks.
//!
//! The shared modules reach a component's data only through the hooks (dispatched here,
//! `Cache::*_components`): a request's share ([`Held`]: admission, growth, checkpoint,
//! finish, a failed admission copy, a load's swap), what an insert or a landed copy
//! publishes on a node ([`Component::donate`]), what a backup copies to the host
//! ([`BackupShare`]) and a load-back back to the device ([`LoadShare`]), and what
//! eviction frees on a node. Every hook has a default that does nothing, so a
//! component implements only what it keeps; dispatch is static (a flag test per
//! component of the model), so a model without a component pays one predictable branch
//! for it. A new kind of layer is one more implementation, one more field of [`Model`]
//! and of the per-component structs here, and one more line per dispatcher.

use crate::config::Config;
use crate::error::{Error, Result};
use crate::ids::RequestId;
use crate::pool::Pages;

use super::alloc::StateRoom;
use super::copies::{PoolKind, SlotCopy, Tier};
use super::request::{Cow, RequestState};
use super::results::{CallOff, Found};
use super::shares::{Backed, BackupHeld, BackupShare, Held, LoadShare, Taken, Wants};
use super::{Cache, Evicted, Payload};

/// The kinds of layers a model may have.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ComponentKind {
    /// Full attention: a KV entry per token, every token attends to all before it.
    Full,
    /// Mamba / linear attention: one recurrent state per sequence.
    Mamba,
    /// Sliding-window attention: each token attends to the last `swa_window` tokens.
    Swa,
}

impl ComponentKind {
    /// The name users see (`HybridCache.components`).
    pub fn name(self) -> &'static str {
        match self {
            ComponentKind::Full => "full",
            ComponentKind::Mamba => "mamba",
            ComponentKind::Swa => "swa",
        }
    }
}

/// The components a model is made of (full attention always).
#[derive(Clone, Copy, Debug, Default)]
pub struct Model {
    mamba: bool,
    swa: bool,
}

impl Model {
    /// The model a configuration describes: Mamba layers with `mamba_slots`, SWA layers
    /// with `swa_slots`.
    pub fn of(config: &Config) -> Model {
        Model {
            mamba: config.mamba_slots > 0,
            swa: config.has_swa(),
        }
    }

    /// Whether the model has component `C`.
    #[inline]
    fn with<C: Component>(self) -> bool {
        self.has(C::KIND)
    }

    /// Whether the model is full attention alone (no Mamba, no SWA layers).
    #[inline]
    pub fn full_only(self) -> bool {
        !self.mamba && !self.swa
    }

    /// Whether the model has component `kind`.
    #[inline]
    pub fn has(self, kind: ComponentKind) -> bool {
        match kind {
            ComponentKind::Full => true,
            ComponentKind::Mamba => self.mamba,
            ComponentKind::Swa => self.swa,
        }
    }

    /// Every component's share of request `r` dropping back to nothing reused.
    pub(crate) fn restart(self, r: &mut RequestState) {
        FullAttention::restart(r);
        if self.with::<MambaStates>() {
            MambaStates::restart(r);
        }
        if self.with::<SlidingWindow>() {
            SlidingWindow::restart(r);
        }
    }

    /// The model's components, full attention first.
    pub fn components(self) -> Vec<ComponentKind> {
        [
            ComponentKind::Full,
            ComponentKind::Mamba,
            ComponentKind::Swa,
        ]
        .into_iter()
        .filter(|&k| self.has(k))
        .collect()
    }
}

/// What a component provides to the cache's shared machinery.
pub(crate) trait Component {
    /// Which component this is.
    const KIND: ComponentKind;
    /// What a match walk carries from one node of the path to the next.
    type Walk: Default;

    /// Takes node `i`, the next node of a matched path (whole, `depth` tokens from the
    /// root at its end; `on_device`: it and every node above have their KV on the
    /// device and landed) and says whether a match may end at its end.
    fn cut(c: &Cache, walk: &mut Self::Walk, i: u32, depth: usize, on_device: bool) -> bool;

    /// Whether a load-back could make a match end at node `i` (its data is on some
    /// tier); called once per node after [`Component::cut`], with the same walk.
    fn anywhere(c: &Cache, walk: &mut Self::Walk, i: u32, depth: usize) -> bool;

    /// [`Component::cut`] and [`Component::anywhere`] for a match ending `len` tokens
    /// into node `i` (`0 < len < key.len()`, whole pages; `depth` tokens from the root
    /// there): what the upper part of a split there would answer, without the split
    /// ([`Cache::peek_prefix`]). Called for the last node of a path only.
    fn inside(
        c: &Cache,
        walk: &mut Self::Walk,
        i: u32,
        len: usize,
        depth: usize,
        on_device: bool,
    ) -> (bool, bool);

    /// A lock of the path ending at node `i` was taken: takes this component's share.
    /// Returns whether it took something the receipt must give back.
    fn lock(c: &mut Cache, i: u32) -> bool;

    /// The lock ending at node `i` is released; `took` is what [`Component::lock`] said.
    fn release(c: &mut Cache, i: u32, took: bool);

    /// Node `lower` was split: `upper` is its new upper part.
    fn split(c: &mut Cache, upper: u32, lower: u32);

    /// Checks what this component keeps (beyond the checks every pool and node gets).
    fn audit(c: &Cache) -> Result<()>;

    // Requests. What a request holds of a component is its part of [`Held`].

    /// Admission of a request whose match is `m`: takes what the request will hold of
    /// this component into `held`, adding the copies that fill it to `copies` (the
    /// admission's copy-on-write batch). False refuses the admission; what was taken
    /// goes back as `held` drops.
    #[inline]
    fn admit(_: &mut Cache, _: &Found, _: &mut Held, _: &mut Vec<SlotCopy>) -> bool {
        true
    }

    /// Request `id` is about to grow or to be cached (a stale `id`: nothing to do; the
    /// caller refuses it after).
    #[inline]
    fn advance(_: &mut Cache, _: RequestId) {}

    /// Slots of this component's own pool that request `r` needs before it grows.
    #[inline]
    fn wants(_: &RequestState) -> usize {
        0
    }

    /// Whether `n` slots of this component's own pool can be had now.
    #[inline]
    fn available(_: &Cache, _: usize) -> bool {
        true
    }

    /// One slot of this component's own pool, evicting for it when short.
    #[inline]
    fn take(_: &mut Cache) -> StateRoom {
        StateRoom::No
    }

    /// Request `r` receives `slot` (one it [`Component::wants`]).
    #[inline]
    fn give(_: &mut RequestState, _: Pages) {}

    /// A checkpoint cached request `id` up to node `end` (`at_end`: its tokens end at
    /// `end`'s end).
    #[inline]
    fn checkpoint(_: &mut Cache, _: RequestId, _: u32, _: bool) {}

    /// Request `r` drops back to nothing reused (its admission copy failed): what it
    /// holds of this component is retired or starts over.
    #[inline]
    fn restart(_: &mut RequestState) {}

    // Node data.

    /// A sequence ending at node `i` is cached with `held` (what a request or an
    /// insert's caller hands over; `at_end`: the sequence ends at `i`'s end, which has
    /// device KV): the node keeps what it can use, the rest goes back as `held` drops.
    /// True when the node had its own already.
    #[inline]
    fn donate(_: &mut Cache, _: u32, _: bool, _: &mut Held) -> bool {
        false
    }

    /// An insert passed node `i`, which has device KV, with its own copy of it (`dup`,
    /// freed afterwards).
    #[inline]
    fn duplicate(_: &mut Cache, _: u32, _: &[u32]) {}

    // The host tier.

    /// Whether leaf `i`, being evicted, would be of no use on the host (no match could
    /// end there), so that a write-back eviction does not back it up.
    #[inline]
    fn backup_useless(_: &Cache, _: u32) -> bool {
        false
    }

    /// A backup gives node `i`'s device KV the new host pages `host`: takes the host
    /// data paired with them, adding its copies to `share`. False (having taken
    /// nothing) when short of room: the KV is then backed up without it.
    #[inline]
    fn backup_pages(_: &mut Cache, _: u32, _: &[u32], _: &mut BackupShare) -> bool {
        true
    }

    /// A backup of node `i` (`kv_there`: its KV is on the host or in the batch): takes
    /// host room for this component's node data that lacks a host copy, adding its
    /// copies to `share`. `count_short`: a shortage is counted in the stats.
    #[inline]
    fn backup(_: &mut Cache, _: u32, _: bool, _: &mut BackupShare, _: bool) -> Backed {
        Backed::default()
    }

    /// A backup batch holding `held` was emitted: its nodes' data is marked in flight.
    #[inline]
    fn backup_started(_: &mut Cache, _: &BackupHeld) {}

    /// A backup batch holding `held` ended: with `publish`, the nodes get their host
    /// copies; the in-flight marks go.
    #[inline]
    fn backup_settled(_: &mut Cache, _: &mut BackupHeld, _: bool) {}

    /// Plans a load-back of the path to node `j` (for a request: `for_request`): what
    /// this component loads, into `share`. An error refuses it (nothing taken).
    #[inline]
    fn load_plan(_: &Cache, _: u32, _: bool, _: &mut LoadShare) -> Result<()> {
        Ok(())
    }

    /// Takes the device slots the planned load-back needs for this component's node
    /// data (before its KV pages), into `share`; what it took goes back as `share`
    /// drops.
    #[inline]
    fn load_take(_: &mut Cache, _: &mut LoadShare) -> std::result::Result<(), CallOff> {
        Ok(())
    }

    /// The load-back's device KV pages `kv` were taken: takes the device data paired
    /// with them, into `share`.
    #[inline]
    fn load_pages(_: &mut Cache, _: &Pages, _: &mut LoadShare) -> std::result::Result<(), CallOff> {
        Ok(())
    }

    // Eviction.

    /// Whether a match could end at node `i`'s end on the device as far as this
    /// component goes (a childless node at whose end none can is dead weight).
    #[inline]
    fn live_end(_: &Cache, _: u32) -> bool {
        true
    }

    /// Whether node `i`, which has a host KV copy, is worth keeping host-only as far as
    /// this component goes (a match could end there once loaded back, or below it).
    #[inline]
    fn useful_on_host(_: &Cache, _: u32) -> bool {
        true
    }

    /// Node `i` (unlocked) loses its device data of this component, counted in `out`
    /// (it is demoted or deleted). The KV's paired pages go with the KV.
    #[inline]
    fn drop_device(_: &mut Cache, _: u32, _: &mut Evicted) {}

    /// Node `i` loses its host data of this component (its host KV goes too).
    #[inline]
    fn drop_host(_: &mut Cache, _: u32) {}
}

impl Taken {
    /// Request `r` receives what it wants of the slots.
    #[inline]
    pub fn give(&mut self, r: &mut RequestState) {
        if self.state.is_some() && MambaStates::wants(r) > 0 {
            if let Some(s) = self.more_states.pop().or_else(|| self.state.take()) {
                MambaStates::give(r, s);
            }
        }
    }
}

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

/// Full-attention KV: the tree's pages themselves.
pub(crate) struct FullAttention;

impl Component for FullAttention {
    const KIND: ComponentKind = ComponentKind::Full;
    type Walk = ();

    #[inline]
    fn cut(_: &Cache, (): &mut (), _: u32, _: usize, on_device: bool) -> bool {
        on_device
    }

    #[inline]
    fn anywhere(_: &Cache, (): &mut (), _: u32, _: usize) -> bool {
        true
    }

    /// A split's upper part takes the node's first pages and their tier.
    fn inside(_: &Cache, (): &mut (), _: u32, _: usize, _: usize, on_device: bool) -> (bool, bool) {
        (on_device, true)
    }

    /// The path lock is the shared part of every lock ([`Cache::lock_index`]).
    #[inline]
    fn lock(_: &mut Cache, _: u32) -> bool {
        false
    }

    #[inline]
    fn release(_: &mut Cache, _: u32, _: bool) {}

    /// A split shares the KV pages between the parts ([`crate::tree::Tree::split`]).
    #[inline]
    fn split(_: &mut Cache, _: u32, _: u32) {}

    /// Pages, path locks and the eviction sets are checked for every node (`audit.rs`).
    fn audit(_: &Cache) -> Result<()> {
        Ok(())
    }
}

/// Mamba states: at most one per node and tier, at the node's end.
pub(crate) struct MambaStates;

impl Component for MambaStates {
    const KIND: ComponentKind = ComponentKind::Mamba;
    type Walk = ();

    #[inline]
    fn cut(c: &Cache, (): &mut (), i: u32, _: usize, on_device: bool) -> bool {
        on_device && c.tree.node(i).mamba.device.is_some()
    }

    #[inline]
    fn anywhere(c: &Cache, (): &mut (), i: u32, _: usize) -> bool {
        let m = &c.tree.node(i).mamba;
        m.device.is_some() || m.host.is_some()
    }

    /// A split leaves the state with the lower part: no state ends inside a node.
    fn inside(_: &Cache, (): &mut (), _: u32, _: usize, _: usize, _: bool) -> (bool, bool) {
        (false, false)
    }

    /// Holds the node's state (a single-node lock), when it has one.
    #[inline]
    fn lock(c: &mut Cache, i: u32) -> bool {
        let has = c.tree.node(i).mamba.device.is_some();
        if has {
            c.edit(i, |n| n.mamba.lock += 1);
            c.refresh(i);
        }
        has
    }

    #[inline]
    fn release(c: &mut Cache, i: u32, took: bool) {
        if took {
            // A locked state is never evicted: it is still there.
            c.edit(i, |n| n.mamba.lock -= 1);
        }
    }

    /// The state stays with the lower part, which keeps the node's end.
    #[inline]
    fn split(_: &mut Cache, _: u32, _: u32) {}

    /// State placement and locks are checked per node (`audit.rs`, invariant 3).
    fn audit(_: &Cache) -> Result<()> {
        Ok(())
    }

    /// The request gets its own state slot with a copy of the matched state (our lock
    /// holds the source, so eviction for the copy cannot take it); refused when no
    /// slot can be had.
    #[inline]
    fn admit(c: &mut Cache, m: &Found, held: &mut Held, copies: &mut Vec<SlotCopy>) -> bool {
        let Some(src) = m.mamba_slot else {
            return true;
        };
        let Some(dst) = c.alloc_state() else {
            return false;
        };
        copies.push(state_copy(src, dst.pages()[0]));
        held.state = Some(dst);
        true
    }

    /// A request without a state slot wants one.
    #[inline]
    fn wants(r: &RequestState) -> usize {
        usize::from(r.held.state.is_none())
    }

    #[inline]
    fn available(c: &Cache, n: usize) -> bool {
        c.states_available(n)
    }

    #[inline]
    fn take(c: &mut Cache) -> StateRoom {
        c.take_state()
    }

    #[inline]
    fn give(r: &mut RequestState, slot: Pages) {
        r.held.state = Some(slot);
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
    fn donate(c: &mut Cache, i: u32, at_end: bool, held: &mut Held) -> bool {
        let Some(state) = held.state.take() else {
            return false;
        };
        if !at_end {
            // Taken at the sequence's end, which is no node's end.
            return false;
        }
        if c.tree.node(i).mamba.device.is_some() {
            return true;
        }
        c.set_state(i, state);
        // A waiting request told of (`Cache::expect`) may resume from it: marked at once,
        // as a checkpoint's state is.
        if c.lru.expecting() {
            let rank = c.lru.rank_of(&c.tree, i, c.tree.depth(i));
            c.lru.mark(&mut c.tree, i, rank);
        }
        false
    }

    /// A leaf without a state on any tier could not end a match on the host.
    #[inline]
    fn backup_useless(c: &Cache, i: u32) -> bool {
        let m = &c.tree.node(i).mamba;
        m.device.is_none() && m.host.is_none()
    }

    /// The node's device state, when it has no host copy and none is on its way, and
    /// its KV is there too (a state is useless on the host without it).
    fn backup(
        c: &mut Cache,
        i: u32,
        kv_there: bool,
        share: &mut BackupShare,
        count_short: bool,
    ) -> Backed {
        let m = &c.tree.node(i).mamba;
        let Some(slot) = m.device else {
            return Backed::default();
        };
        if m.host.is_some() || m.backup_pending || !kv_there {
            return Backed::default();
        }
        if let Some(h) = c.alloc_host_state() {
            share.state_copy.0.push(i64::from(slot));
            share.state_copy.1.push(i64::from(h.pages()[0]));
            share.held.states.push((c.tree.id(i), h));
            Backed {
                copied: true,
                short: false,
            }
        } else {
            if count_short {
                c.stats.backup_states_skipped += 1;
            }
            Backed {
                copied: false,
                short: true,
            }
        }
    }

    /// A target without a device state gets its host state back (and so does the
    /// request); a request cannot run from a node with a state on no tier.
    fn load_plan(c: &Cache, j: u32, for_request: bool, share: &mut LoadShare) -> Result<()> {
        let n = c.tree.node(j);
        if n.mamba.device.is_none() && !n.is_root() {
            share.restore_from = n.mamba.host;
            share.for_request = for_request;
            if share.restore_from.is_none() && for_request {
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
    fn live_end(c: &Cache, i: u32) -> bool {
        c.tree.node(i).mamba.device.is_some()
    }

    /// A match needs a state on its path: a host state, or children.
    #[inline]
    fn useful_on_host(c: &Cache, i: u32) -> bool {
        let n = c.tree.node(i);
        n.mamba.host.is_some() || !n.children.is_empty()
    }

    /// The device state is freed.
    #[inline]
    fn drop_device(c: &mut Cache, i: u32, out: &mut Evicted) {
        c.drop_state(i, out);
    }

    /// The host state is freed.
    #[inline]
    fn drop_host(c: &mut Cache, i: u32) {
        if c.tree.node(i).mamba.host.is_none() {
            return;
        }
        if let Some(slot) = c.edit(i, |n| n.mamba.host.take()) {
            c.pools.host_mamba.release_tree(&[slot]);
        }
    }

    /// A slot restoring the target's state, then the request's own.
    fn load_take(c: &mut Cache, share: &mut LoadShare) -> std::result::Result<(), CallOff> {
        if share.restore_from.is_some() {
            share.held.restore = Some(c.alloc_state().ok_or(CallOff::State)?);
            if share.for_request {
                share.held.request.state = Some(c.alloc_state().ok_or(CallOff::State)?);
            }
        }
        Ok(())
    }

    fn backup_started(c: &mut Cache, held: &BackupHeld) {
        for (id, _) in &held.states {
            if let Ok(i) = c.tree.resolve(*id) {
                c.edit(i, |n| n.mamba.backup_pending = true);
                c.refresh(i);
            }
        }
    }

    /// A node whose KV has its host copy gets the host state.
    fn backup_settled(c: &mut Cache, held: &mut BackupHeld, publish: bool) {
        for (id, h) in std::mem::take(&mut held.states) {
            let Ok(i) = c.tree.resolve(id) else {
                drop(h);
                continue;
            };
            c.edit(i, |n| n.mamba.backup_pending = false);
            let n = c.tree.node(i);
            if publish && n.kv.host.is_some() && n.mamba.host.is_none() {
                c.edit(i, |n| n.mamba.host = h.into_tree().first().copied());
            } else {
                drop(h);
            }
            c.refresh(i);
        }
    }
}

/// Sliding-window attention (`swa.rs`).
pub(crate) struct SlidingWindow;

impl Component for SlidingWindow {
    const KIND: ComponentKind = ComponentKind::Swa;
    /// The live SWA tokens ending at the current node: on the device, and counting
    /// host-only nodes by their host SWA pages.
    type Walk = (usize, usize);

    #[inline]
    fn cut(c: &Cache, walk: &mut (usize, usize), i: u32, depth: usize, on_device: bool) -> bool {
        walk.0 = if on_device { c.swa_run(i, walk.0) } else { 0 };
        // A prefix shorter than the window needs all its tokens live.
        walk.0 >= c.swa.need() || walk.0 == depth
    }

    #[inline]
    fn anywhere(c: &Cache, walk: &mut (usize, usize), i: u32, depth: usize) -> bool {
        walk.1 = c.swa_run_any(i, walk.1);
        walk.1 >= c.swa.need() || walk.1 == depth
    }

    fn inside(
        c: &Cache,
        walk: &mut (usize, usize),
        i: u32,
        len: usize,
        depth: usize,
        on_device: bool,
    ) -> (bool, bool) {
        let need = c.swa.need();
        let device = if on_device {
            c.swa_run_inside(i, len, walk.0, false)
        } else {
            0
        };
        let any = c.swa_run_inside(i, len, walk.1, true);
        (
            device >= need || device == depth,
            any >= need || any == depth,
        )
    }

    fn lock(c: &mut Cache, i: u32) -> bool {
        c.swa_lock(i);
        false
    }

    fn release(c: &mut Cache, i: u32, _: bool) {
        c.swa_unlock(i);
    }

    fn split(c: &mut Cache, upper: u32, lower: u32) {
        c.swa_split(upper, lower);
    }

    fn audit(c: &Cache) -> Result<()> {
        c.audit_swa()
    }

    /// The request's own pages whose tokens left the window give back their SWA pages.
    fn advance(c: &mut Cache, id: RequestId) {
        c.slide_window(id);
    }

    /// The window starts over with the tokens it recomputes.
    fn restart(r: &mut RequestState) {
        r.held.swa_freed_to = 0;
    }

    /// Dead window pages of the node revive from the duplicate's SWA pages.
    fn duplicate(c: &mut Cache, i: u32, dup: &[u32]) {
        c.swa_revive(i, dup);
    }

    /// A leaf ending in a dead SWA page would be a host tombstone leaf.
    fn backup_useless(c: &Cache, i: u32) -> bool {
        c.swa_dead_end(i)
    }

    /// The host SWA pages of the device pages that have an SWA page (all or nothing).
    fn backup_pages(c: &mut Cache, i: u32, host: &[u32], share: &mut BackupShare) -> bool {
        c.swa_backup(i, host, &mut share.swa_copy)
    }

    /// A node ending in a dead SWA page (a tombstone, or one whose tail went) ends no
    /// match.
    fn live_end(c: &Cache, i: u32) -> bool {
        !c.swa_dead_end(i)
    }

    /// A match needs a live window at its end: the last host page has its host SWA
    /// page, or the node has children.
    fn useful_on_host(c: &Cache, i: u32) -> bool {
        let n = c.tree.node(i);
        !n.children.is_empty()
            || n.kv
                .host
                .as_deref()
                .is_none_or(|host| c.pools.host_kv.companion_tail(host) > 0)
    }

    /// The window at the target must be live counting host-only nodes; the host pages
    /// read are kept for [`Component::load_pages`].
    fn load_plan(c: &Cache, j: u32, _: bool, share: &mut LoadShare) -> Result<()> {
        share.window_dead = !c.swa_window_live_any(j);
        for i in c.path_to(j) {
            let n = c.tree.node(i);
            if let (None, Some(host)) = (&n.kv.device, &n.kv.host) {
                share.host_pages.extend_from_slice(host);
            }
        }
        Ok(())
    }

    /// The window's loaded pages get device SWA pages with the copies of their host
    /// SWA pages.
    fn load_pages(
        c: &mut Cache,
        kv: &Pages,
        share: &mut LoadShare,
    ) -> std::result::Result<(), CallOff> {
        let host = std::mem::take(&mut share.host_pages);
        share.swa_copy = c.load_swa(&host, kv).ok_or(CallOff::Swa)?;
        share.held.swa_pages = share.swa_copy.0.len() / c.page_size();
        Ok(())
    }
}

/// A match walk over the model's components: cut where all of them accept.
#[derive(Default)]
pub(crate) struct Cut {
    model: Model,
    swa: <SlidingWindow as Component>::Walk,
}

impl Cut {
    /// A walk for `model`, from the root.
    pub fn new(model: Model) -> Cut {
        Cut {
            model,
            ..Cut::default()
        }
    }

    /// Takes the path's next node (see [`Component::cut`]); true when every component
    /// accepts a match ending there.
    #[inline]
    pub fn step(&mut self, c: &Cache, i: u32, depth: usize, on_device: bool) -> bool {
        // Every component sees every node (a walk keeps its own state), so no `&&`
        // short-circuit before the stateful ones.
        let swa = !self.model.with::<SlidingWindow>()
            || SlidingWindow::cut(c, &mut self.swa, i, depth, on_device);
        let full = FullAttention::cut(c, &mut (), i, depth, on_device);
        let mamba =
            !self.model.with::<MambaStates>() || MambaStates::cut(c, &mut (), i, depth, on_device);
        full && mamba && swa
    }

    /// Whether a load-back could end a match at node `i` for every component (called
    /// once per node, after [`Cut::step`]).
    #[inline]
    pub fn anywhere(&mut self, c: &Cache, i: u32, depth: usize) -> bool {
        let swa = !self.model.with::<SlidingWindow>()
            || SlidingWindow::anywhere(c, &mut self.swa, i, depth);
        let full = FullAttention::anywhere(c, &mut (), i, depth);
        let mamba =
            !self.model.with::<MambaStates>() || MambaStates::anywhere(c, &mut (), i, depth);
        full && mamba && swa
    }

    /// [`Cut::step`] and [`Cut::anywhere`] for a path's last node, matched `len` tokens
    /// into (see [`Component::inside`]).
    pub fn inside(
        &mut self,
        c: &Cache,
        i: u32,
        len: usize,
        depth: usize,
        on_device: bool,
    ) -> (bool, bool) {
        let swa = if self.model.with::<SlidingWindow>() {
            SlidingWindow::inside(c, &mut self.swa, i, len, depth, on_device)
        } else {
            (true, true)
        };
        let full = FullAttention::inside(c, &mut (), i, len, depth, on_device);
        let mamba = if self.model.with::<MambaStates>() {
            MambaStates::inside(c, &mut (), i, len, depth, on_device)
        } else {
            (true, true)
        };
        (full.0 && mamba.0 && swa.0, full.1 && mamba.1 && swa.1)
    }
}

impl Cache {
    /// The components of the cache's model, full attention first.
    pub fn components(&self) -> Vec<ComponentKind> {
        self.model.components()
    }

    /// The model the cache serves.
    #[inline]
    pub(crate) fn model(&self) -> Model {
        self.model
    }

    /// Every component's share of a lock ending at node `i` (the node's state only with
    /// `state`); returns what the receipt must give back (the state lock).
    pub(crate) fn lock_components(&mut self, i: u32, state: bool) -> bool {
        let model = self.model;
        FullAttention::lock(self, i);
        let mamba = state && model.with::<MambaStates>() && MambaStates::lock(self, i);
        if model.with::<SlidingWindow>() {
            SlidingWindow::lock(self, i);
        }
        mamba
    }

    /// Every component's share of releasing the lock ending at node `i`.
    pub(crate) fn release_components(&mut self, i: u32, mamba: bool) {
        let model = self.model;
        if model.with::<SlidingWindow>() {
            SlidingWindow::release(self, i, false);
        }
        if model.with::<MambaStates>() {
            MambaStates::release(self, i, mamba);
        }
        FullAttention::release(self, i, false);
    }

    /// The state's share of a lock ending at node `i` only (the path stays locked).
    pub(crate) fn release_state_lock(&mut self, i: u32) {
        MambaStates::release(self, i, true);
    }

    /// Every component's share of splitting node `lower` (its new upper part `upper`).
    pub(crate) fn split_components(&mut self, upper: u32, lower: u32) {
        let model = self.model;
        FullAttention::split(self, upper, lower);
        if model.with::<MambaStates>() {
            MambaStates::split(self, upper, lower);
        }
        if model.with::<SlidingWindow>() {
            SlidingWindow::split(self, upper, lower);
        }
    }

    /// Every component's share of admitting a request for match `m`, into `held`; false
    /// refuses it. `copies`: the admission's copy-on-write batch.
    #[inline]
    pub(crate) fn admit_components(
        &mut self,
        m: &Found,
        held: &mut Held,
        copies: &mut Vec<SlotCopy>,
    ) -> bool {
        let model = self.model;
        FullAttention::admit(self, m, held, copies)
            && (!model.with::<MambaStates>() || MambaStates::admit(self, m, held, copies))
            && (!model.with::<SlidingWindow>() || SlidingWindow::admit(self, m, held, copies))
    }

    /// Every component's share of request `id` growing or being cached.
    #[inline]
    pub(crate) fn advance_components(&mut self, id: RequestId) {
        let model = self.model;
        FullAttention::advance(self, id);
        if model.with::<MambaStates>() {
            MambaStates::advance(self, id);
        }
        if model.with::<SlidingWindow>() {
            SlidingWindow::advance(self, id);
        }
    }

    /// What request `r` wants of the components' own pools before it grows.
    #[inline]
    pub(crate) fn wants(&self, r: &RequestState) -> Wants {
        Wants {
            states: if self.model.with::<MambaStates>() {
                MambaStates::wants(r)
            } else {
                0
            },
        }
    }

    /// Whether what `w` wants can be had now.
    #[inline]
    pub(crate) fn wants_available(&self, w: Wants) -> bool {
        w.states == 0 || MambaStates::available(self, w.states)
    }

    /// Takes what `w` wants; `None` (what was taken goes back) when some slot cannot be
    /// had.
    #[inline]
    pub(crate) fn take_wants(&mut self, w: Wants) -> Option<Taken> {
        if w.states == 0 {
            return Some(Taken::default());
        }
        self.take_wanted(w)
    }

    /// [`Cache::take_wants`] when something is wanted (kept out of line, so that the
    /// common case, nothing wanted, inlines to a test).
    #[inline(never)]
    fn take_wanted(&mut self, w: Wants) -> Option<Taken> {
        let mut taken = Taken::default();
        for _ in 0..w.states {
            match MambaStates::take(self) {
                StateRoom::Now(s) if taken.state.is_none() => taken.state = Some(s),
                StateRoom::Now(s) => taken.more_states.push(s),
                StateRoom::Coming => taken.coming = true,
                StateRoom::No => return None,
            }
        }
        Some(taken)
    }

    /// Every component's share of a checkpoint that cached request `id` up to `end`.
    pub(crate) fn checkpoint_components(&mut self, id: RequestId, end: u32, at_end: bool) {
        let model = self.model;
        FullAttention::checkpoint(self, id, end, at_end);
        if model.with::<MambaStates>() {
            MambaStates::checkpoint(self, id, end, at_end);
        }
        if model.with::<SlidingWindow>() {
            SlidingWindow::checkpoint(self, id, end, at_end);
        }
    }

    /// Every component's share of caching a sequence ending at node `i` with `held`
    /// (see [`Component::donate`]); true when some component's node had its own already.
    #[inline]
    pub(crate) fn donate_components(&mut self, i: u32, at_end: bool, held: &mut Held) -> bool {
        let model = self.model;
        let mut had = FullAttention::donate(self, i, at_end, held);
        if model.with::<MambaStates>() {
            had |= MambaStates::donate(self, i, at_end, held);
        }
        if model.with::<SlidingWindow>() {
            had |= SlidingWindow::donate(self, i, at_end, held);
        }
        had
    }

    /// Every component's share of an insert passing node `i` with a duplicate `dup` of
    /// its device KV.
    #[inline]
    pub(crate) fn duplicate_components(&mut self, i: u32, dup: &[u32]) {
        let model = self.model;
        FullAttention::duplicate(self, i, dup);
        if model.with::<MambaStates>() {
            MambaStates::duplicate(self, i, dup);
        }
        if model.with::<SlidingWindow>() {
            SlidingWindow::duplicate(self, i, dup);
        }
    }

    /// Whether some component finds leaf `i` of no use on the host
    /// ([`Component::backup_useless`]).
    pub(crate) fn backup_useless_components(&self, i: u32) -> bool {
        let model = self.model;
        FullAttention::backup_useless(self, i)
            || (model.with::<MambaStates>() && MambaStates::backup_useless(self, i))
            || (model.with::<SlidingWindow>() && SlidingWindow::backup_useless(self, i))
    }

    /// Every component's share of node `i`'s KV getting host pages `host` in a backup
    /// ([`Component::backup_pages`]); false when some component was short.
    pub(crate) fn backup_pages_components(
        &mut self,
        i: u32,
        host: &[u32],
        share: &mut BackupShare,
    ) -> bool {
        let model = self.model;
        let mut ok = FullAttention::backup_pages(self, i, host, share);
        if model.with::<MambaStates>() {
            ok &= MambaStates::backup_pages(self, i, host, share);
        }
        if model.with::<SlidingWindow>() {
            ok &= SlidingWindow::backup_pages(self, i, host, share);
        }
        ok
    }

    /// Every component's share of backing up node `i` ([`Component::backup`]).
    pub(crate) fn backup_components(
        &mut self,
        i: u32,
        kv_there: bool,
        share: &mut BackupShare,
        count_short: bool,
    ) -> Backed {
        let model = self.model;
        let mut out = FullAttention::backup(self, i, kv_there, share, count_short);
        if model.with::<MambaStates>() {
            out = out.or(MambaStates::backup(self, i, kv_there, share, count_short));
        }
        if model.with::<SlidingWindow>() {
            out = out.or(SlidingWindow::backup(self, i, kv_there, share, count_short));
        }
        out
    }

    /// Every component's share of emitting a backup batch that holds `held`.
    pub(crate) fn backup_started_components(&mut self, held: &BackupHeld) {
        let model = self.model;
        FullAttention::backup_started(self, held);
        if model.with::<MambaStates>() {
            MambaStates::backup_started(self, held);
        }
        if model.with::<SlidingWindow>() {
            SlidingWindow::backup_started(self, held);
        }
    }

    /// Every component's share of a backup batch that holds `held` ending.
    pub(crate) fn backup_settled_components(&mut self, held: &mut BackupHeld, publish: bool) {
        let model = self.model;
        FullAttention::backup_settled(self, held, publish);
        if model.with::<MambaStates>() {
            MambaStates::backup_settled(self, held, publish);
        }
        if model.with::<SlidingWindow>() {
            SlidingWindow::backup_settled(self, held, publish);
        }
    }

    /// Every component's share of planning a load-back to node `j`
    /// ([`Component::load_plan`]).
    pub(crate) fn load_plan_components(&self, j: u32, for_request: bool) -> Result<LoadShare> {
        let model = self.model;
        let mut share = LoadShare::default();
        FullAttention::load_plan(self, j, for_request, &mut share)?;
        if model.with::<MambaStates>() {
            MambaStates::load_plan(self, j, for_request, &mut share)?;
        }
        if model.with::<SlidingWindow>() {
            SlidingWindow::load_plan(self, j, for_request, &mut share)?;
        }
        Ok(share)
    }

    /// Every component's share of taking a load-back's device slots
    /// ([`Component::load_take`]).
    pub(crate) fn load_take_components(
        &mut self,
        share: &mut LoadShare,
    ) -> std::result::Result<(), CallOff> {
        let model = self.model;
        FullAttention::load_take(self, share)?;
        if model.with::<MambaStates>() {
            MambaStates::load_take(self, share)?;
        }
        if model.with::<SlidingWindow>() {
            SlidingWindow::load_take(self, share)?;
        }
        Ok(())
    }

    /// Every component's share of a load-back's KV pages `kv` ([`Component::load_pages`]).
    pub(crate) fn load_pages_components(
        &mut self,
        kv: &Pages,
        share: &mut LoadShare,
    ) -> std::result::Result<(), CallOff> {
        let model = self.model;
        FullAttention::load_pages(self, kv, share)?;
        if model.with::<MambaStates>() {
            MambaStates::load_pages(self, kv, share)?;
        }
        if model.with::<SlidingWindow>() {
            SlidingWindow::load_pages(self, kv, share)?;
        }
        Ok(())
    }

    /// Whether a match could end at node `i`'s end on the device for every component
    /// ([`Component::live_end`]).
    #[inline]
    pub(crate) fn live_end_components(&self, i: u32) -> bool {
        let model = self.model;
        FullAttention::live_end(self, i)
            && (!model.with::<MambaStates>() || MambaStates::live_end(self, i))
            && (!model.with::<SlidingWindow>() || SlidingWindow::live_end(self, i))
    }

    /// Whether node `i`, which has a host KV copy, is worth keeping host-only for every
    /// component ([`Component::useful_on_host`]).
    #[inline]
    pub(crate) fn useful_on_host_components(&self, i: u32) -> bool {
        let model = self.model;
        FullAttention::useful_on_host(self, i)
            && (!model.with::<MambaStates>() || MambaStates::useful_on_host(self, i))
            && (!model.with::<SlidingWindow>() || SlidingWindow::useful_on_host(self, i))
    }

    /// Every component's device data on node `i` goes ([`Component::drop_device`]).
    #[inline]
    pub(crate) fn drop_device_components(&mut self, i: u32, out: &mut Evicted) {
        let model = self.model;
        FullAttention::drop_device(self, i, out);
        if model.with::<MambaStates>() {
            MambaStates::drop_device(self, i, out);
        }
        if model.with::<SlidingWindow>() {
            SlidingWindow::drop_device(self, i, out);
        }
    }

    /// Every component's host data on node `i` goes ([`Component::drop_host`]).
    #[inline]
    pub(crate) fn drop_host_components(&mut self, i: u32) {
        let model = self.model;
        FullAttention::drop_host(self, i);
        if model.with::<MambaStates>() {
            MambaStates::drop_host(self, i);
        }
        if model.with::<SlidingWindow>() {
            SlidingWindow::drop_host(self, i);
        }
    }

    /// Every component's own checks (`audit()`).
    pub(crate) fn audit_components(&self) -> Result<()> {
        FullAttention::audit(self)?;
        if self.model.with::<MambaStates>() {
            MambaStates::audit(self)?;
        }
        if self.model.with::<SlidingWindow>() {
            SlidingWindow::audit(self)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{ComponentKind, Model};
    use crate::cache::Cache;
    use crate::config::Config;

    fn config(mamba: usize, swa: usize) -> Config {
        Config {
            kv_slots: 64,
            page_size: 4,
            mamba_slots: mamba,
            swa_slots: swa,
            swa_window: if swa > 0 { 8 } else { 0 },
            ..Config::default()
        }
    }

    #[test]
    fn a_model_is_the_set_of_configured_components_full_attention_first() {
        let names = |mamba, swa| {
            let c = Cache::new(config(mamba, swa)).unwrap();
            c.components()
                .into_iter()
                .map(ComponentKind::name)
                .collect::<Vec<_>>()
        };
        assert_eq!(names(0, 0), ["full"]);
        assert_eq!(names(4, 0), ["full", "mamba"]);
        assert_eq!(names(0, 32), ["full", "swa"]);
        assert_eq!(names(4, 32), ["full", "mamba", "swa"]);
        assert!(Model::default().has(ComponentKind::Full));
        assert!(!Model::default().has(ComponentKind::Swa));
    }

    #[test]
    fn a_match_is_cut_where_every_component_accepts() {
        // Mamba + SWA: KV and window reach 16 tokens, the only state sits at 8; the match
        // ends there.
        let mut c = Cache::new(config(4, 32)).unwrap();
        let tokens: Vec<u32> = (1..=16).collect();
        let slots = c.alloc_kv(16).unwrap().unwrap();
        c.insert(None, &tokens, &slots, 0).unwrap();
        let state = c.alloc_mamba().unwrap().unwrap();
        c.insert_with_state(None, &tokens[..8], &slots[..8], 8, Some(i64::from(state)))
            .unwrap();
        c.audit().unwrap();
        let m = c.match_prefix(None, &tokens);
        assert_eq!(m.kv_len, 16, "the KV match reaches the end");
        assert_eq!(m.device_len, 8, "cut at the only node end with a state");
        c.audit().unwrap();
    }
}
