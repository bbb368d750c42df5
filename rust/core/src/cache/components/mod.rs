//! Components: the kinds of layers a model is made of, and the interface through which
//! the cache's shared machinery (the match walk, locks, splits, requests, the host tier,
//! eviction, `audit()`) reaches each.
//!
//! A model is a set of components ([`Model`]): full attention always, Mamba states and
//! sliding-window attention (SWA) when configured. Each is a [`Component`], in a file of
//! its own:
//!
//! | component | keeps per node | a match may end at a node when | evicted | a lock holds | between tiers |
//! |---|---|---|---|---|---|
//! | `full.rs` | KV pages (`Node.kv`), device and host | its KV is on the device (prefix-closed) | leaves only, its own order (`eviction/`) | the path to the root | pages, both ways |
//! | `mamba.rs` | at most one state per tier (`Node.mamba`) | it has a device state | any unlocked state (`eviction/`) | the node's state | states, both ways |
//! | `swa.rs` | an SWA page paired with each KV page it keeps (`pool/companion.rs`) | the last `swa_window` tokens are live | tombstones in the middle, leaves whole | the window's nodes | the paired pages |
//!
//! The match walk ([`Cut`](cut::Cut), in `cut.rs`) asks every component of the model
//! whether the match may end at each node of the path and cuts at the deepest node all
//! accept; a lock, its release and a split call each component's hook; `audit()` runs
//! each component's own checks.
//!
//! The shared modules reach a component's data only through the hooks, dispatched here
//! (`Cache::*_components`) by one macro over the list of components ([`components!`]):
//! a request's share ([`RequestShare`]: admission, growth, checkpoint, finish, a failed
//! admission copy, a load's swap), what an insert or a landed copy keeps on a node
//! ([`Component::keep_on_node`]), what a backup copies to the host ([`BackupExtras`]) and
//! a load-back back to the device ([`LoadExtras`]), and what eviction frees on a node
//! (`shares.rs` holds these structs). Dispatch is static (a flag test per component of
//! the model, every hook `#[inline]` where it is small), so a model without a component
//! pays one predictable branch for it. A new kind of layer is one new file implementing
//! [`Component`] (declared with its `mod` line above the list) and one line in
//! [`components!`]'s list.
//!
//! A hook receives the least of the cache its work needs, so that a component reaches
//! another's data only where that is the point:
//!
//! | a hook receives | hooks | why |
//! |---|---|---|
//! | [`Parts`] (`&mut`): the nodes (through [`Parts::edit`]), pools, tallies, eviction sets, the components' books, the stats | `lock`, `release`, `split`, `keep_on_node`, `passed_duplicate`, `backup_paired_pages`, `backup_started`, `backup_settled`, `drop_device`, `drop_host` | they change their node data, pools, eviction sets and stats only |
//! | [`View`] (`&`): the same, read-only | `slots_available`, `backup_useless`, `load_plan`, `live_end`, `useful_on_host` | they read those only |
//! | `&Cache` | `cut`, `cut_any_tier`, `cut_inside` | the match walk, the hottest path: the cache it already holds, with nothing built per node (they read the tree, and SWA's the pools' pairings and the window) |
//! | `&Cache` | `audit` | it checks the component against the lock receipts and the request table |
//! | `&mut Cache` | `admit`, `take_slots`, `load_take` | taking a slot may evict (`alloc_state`, `take_state`) |
//! | `&mut Cache` | `backup` | taking a host state slot may evict a host leaf (`alloc_host_state`) |
//! | `&mut Cache` | `load_paired_pages` | taking device SWA pages may evict SWA (`load_swa`) |
//! | `&mut Cache` | `before_growth`, `checkpoint` | they read the request table (`slide_window`), and a checkpoint emits a copy-on-write batch and may evict |
//! | the request alone | `slots_needed`, `give_slots`, `restart` | they change what the request holds |

#[cfg(test)]
pub(crate) mod balanced;
mod full;
pub(crate) mod mamba;
pub(crate) mod shares;
pub(crate) mod swa;

use crate::config::Config;
use crate::error::Result;
use crate::ids::RequestId;
use crate::pool::Pages;

use super::copies::SlotCopy;
use super::request::RequestState;
use super::results::{CallOff, Found};
use super::{Cache, Evicted, Parts, View};
use shares::{
    BackupExtraSlots, BackupExtras, BackupOutcome, LoadExtras, NeededSlots, RequestShare,
    TakenSlots,
};

/// The list of components, full attention first: `name: type` (`name` names the
/// component's walk in [`Cut`](cut::Cut)), each line under the attributes it needs.
/// Calls `$then!` with `{ $args }` and the list, so that every dispatcher and the match
/// walk are generated from this one list: a new component is one more line here.
macro_rules! components {
    ($then:ident ! { $($args:tt)* }) => {
        $then! { { $($args)* }
            full: full::FullAttention,
            mamba: mamba::MambaStates,
            swa: swa::SlidingWindow,
            #[cfg(test)] balanced: balanced::Balanced,
        }
    };
}

/// `each_component!(model, |C| { body })`: runs `body` once per component of the list
/// that is part of `model`, in the list's order, with `C` naming its type (a `?` or
/// `return` in `body` leaves the calling function).
macro_rules! each_component {
    ($($args:tt)*) => {
        components!(each_component_of! { $($args)* })
    };
}

/// The expansion of [`each_component!`] over the list.
macro_rules! each_component_of {
    ({ $model:expr, |$C:ident| $body:block } $( $(#[$a:meta])* $name:ident : $t:ty ,)*) => {{
        let model: Model = $model;
        $(
            $(#[$a])*
            {
                type $C = $t;
                if <$C as Component>::active(model) $body
            }
        )*
    }};
}

// Declared below the macros, which it uses.
pub(crate) mod cut;

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
        each_component!(self, |C| {
            C::restart(r);
        });
    }

    /// Request `r` receives from `taken` what it needs of each component's own slots.
    #[inline]
    pub(crate) fn give_slots(self, taken: &mut TakenSlots, r: &mut RequestState) {
        each_component!(self, |C| {
            C::give_slots(taken, r);
        });
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

/// What a component provides to the cache's shared machinery. Every hook but the match
/// walk's, the locks', `split` and `audit` has a default that does nothing, so a
/// component implements only what it keeps. Each hook receives [`Parts`], [`View`] or the
/// [`Cache`], as the module's table says.
pub(crate) trait Component {
    /// What a match walk carries from one node of the path to the next.
    type Walk: Default;

    /// Whether the component is part of `model` (dispatch asks it before every hook).
    fn active(model: Model) -> bool;

    /// Takes node `i`, the next node of a matched path (whole, `depth` tokens from the
    /// root at its end; `on_device`: it and every node above have their KV on the
    /// device and landed) and says whether a match may end at its end.
    fn cut(c: &Cache, walk: &mut Self::Walk, i: u32, depth: usize, on_device: bool) -> bool;

    /// Whether a load-back could make a match end at node `i` (its data is on some
    /// tier); called once per node after [`Component::cut`], with the same walk.
    fn cut_any_tier(c: &Cache, walk: &mut Self::Walk, i: u32, depth: usize) -> bool;

    /// [`Component::cut`] and [`Component::cut_any_tier`] for a match ending `len`
    /// tokens into node `i` (`0 < len < key.len()`, whole pages; `depth` tokens from the
    /// root there): what the upper part of a split there would answer, without the split
    /// ([`Cache::peek_prefix`]). Called for the last node of a path only.
    fn cut_inside(
        c: &Cache,
        walk: &mut Self::Walk,
        i: u32,
        len: usize,
        depth: usize,
        on_device: bool,
    ) -> (bool, bool);

    /// A lock of the path ending at node `i` was taken (`state`: it holds the node's
    /// state too): takes this component's share. Returns whether it took something the
    /// receipt must give back (told to [`Component::release`]).
    fn lock(p: &mut Parts, i: u32, state: bool) -> bool;

    /// The lock ending at node `i` is released; `took`: some component's
    /// [`Component::lock`] took something the receipt gives back.
    fn release(p: &mut Parts, i: u32, took: bool);

    /// Node `lower` was split: `upper` is its new upper part.
    fn split(p: &mut Parts, upper: u32, lower: u32);

    /// Checks what this component keeps (beyond the checks every pool and node gets).
    fn audit(c: &Cache) -> Result<()>;

    // Requests. What a request holds of a component is its part of [`RequestShare`].

    /// Admission of a request whose match is `m`: takes what the request will hold of
    /// this component into `share`, adding the copies that fill it to `copies` (the
    /// admission's copy-on-write batch). False refuses the admission; what was taken
    /// goes back as `share` drops.
    #[inline]
    fn admit(_: &mut Cache, _: &Found, _: &mut RequestShare, _: &mut Vec<SlotCopy>) -> bool {
        true
    }

    /// Request `id` is about to grow or to be cached (a stale `id`: nothing to do; the
    /// caller refuses it after).
    #[inline]
    fn before_growth(_: &mut Cache, _: RequestId) {}

    /// Adds to `needed` the slots of this component's own pool that request `r` needs
    /// before it grows.
    #[inline]
    fn slots_needed(_: &RequestState, _: &mut NeededSlots) {}

    /// Whether this component's part of `needed` can be had now.
    #[inline]
    fn slots_available(_: &View, _: NeededSlots) -> bool {
        true
    }

    /// Takes this component's part of `needed` into `taken`, evicting for it when
    /// short; false (what was taken goes back as `taken` drops) when some slot cannot
    /// be had.
    #[inline]
    fn take_slots(_: &mut Cache, _: NeededSlots, _: &mut TakenSlots) -> bool {
        true
    }

    /// Request `r` receives from `taken` what it needs of this component's slots.
    #[inline]
    fn give_slots(_: &mut TakenSlots, _: &mut RequestState) {}

    /// A checkpoint cached request `id` up to node `end` (`at_end`: its tokens end at
    /// `end`'s end).
    #[inline]
    fn checkpoint(_: &mut Cache, _: RequestId, _: u32, _: bool) {}

    /// Request `r` drops back to nothing reused (its admission copy failed): what it
    /// holds of this component is retired or starts over.
    #[inline]
    fn restart(_: &mut RequestState) {}

    // Node data.

    /// A sequence ending at node `i` is cached with `share` (what a request or an
    /// insert's caller hands over; `at_end`: the sequence ends at `i`'s end, which has
    /// device KV): the node keeps what it can use, the rest goes back as `share` drops.
    /// True when the node had its own already.
    #[inline]
    fn keep_on_node(_: &mut Parts, _: u32, _: bool, _: &mut RequestShare) -> bool {
        false
    }

    /// An insert passed node `i`, which has device KV, with its own copy of it (`dup`,
    /// freed afterwards).
    #[inline]
    fn passed_duplicate(_: &mut Parts, _: u32, _: &[u32]) {}

    // The host tier.

    /// Whether leaf `i`, being evicted, would be of no use on the host (no match could
    /// end there), so that a write-back eviction does not back it up.
    #[inline]
    fn backup_useless(_: &View, _: u32) -> bool {
        false
    }

    /// A backup gives node `i`'s device KV the new host pages `host`: takes the host
    /// data paired with them, adding its copies to `copies`. False (having taken
    /// nothing) when short of room: the KV is then backed up without it.
    #[inline]
    fn backup_paired_pages(_: &mut Parts, _: u32, _: &[u32], _: &mut BackupExtras) -> bool {
        true
    }

    /// A backup of node `i` (`kv_there`: its KV is on the host or in the batch): takes
    /// host room for this component's node data that lacks a host copy, adding its
    /// copies to `copies`. `count_short`: a shortage is counted in the stats.
    #[inline]
    fn backup(_: &mut Cache, _: u32, _: bool, _: &mut BackupExtras, _: bool) -> BackupOutcome {
        BackupOutcome::default()
    }

    /// A backup batch holding `held` was emitted: its nodes' data is marked in flight.
    #[inline]
    fn backup_started(_: &mut Parts, _: &BackupExtraSlots) {}

    /// A backup batch holding `held` ended: with `publish`, the nodes get their host
    /// copies; the in-flight marks go.
    #[inline]
    fn backup_settled(_: &mut Parts, _: &mut BackupExtraSlots, _: bool) {}

    /// Plans a load-back of the path to node `j` (for a request: `for_request`): what
    /// this component loads, into `plan`. An error refuses it (nothing taken).
    #[inline]
    fn load_plan(_: &View, _: u32, _: bool, _: &mut LoadExtras) -> Result<()> {
        Ok(())
    }

    /// Takes the device slots the planned load-back needs for this component's node
    /// data (before its KV pages), into `plan`; what it took goes back as `plan` drops.
    #[inline]
    fn load_take(_: &mut Cache, _: &mut LoadExtras) -> std::result::Result<(), CallOff> {
        Ok(())
    }

    /// The load-back's device KV pages `kv` were taken: takes the device data paired
    /// with them, into `plan`.
    #[inline]
    fn load_paired_pages(
        _: &mut Cache,
        _: &Pages,
        _: &mut LoadExtras,
    ) -> std::result::Result<(), CallOff> {
        Ok(())
    }

    // Eviction.

    /// Whether a match could end at node `i`'s end on the device as far as this
    /// component goes (a childless node at whose end none can is dead weight).
    #[inline]
    fn live_end(_: &View, _: u32) -> bool {
        true
    }

    /// Whether node `i`, which has a host KV copy, is worth keeping host-only as far as
    /// this component goes (a match could end there once loaded back, or below it).
    #[inline]
    fn useful_on_host(_: &View, _: u32) -> bool {
        true
    }

    /// Node `i` (unlocked) loses its device data of this component, counted in `out`
    /// (it is demoted or deleted). The KV's paired pages go with the KV.
    #[inline]
    fn drop_device(_: &mut Parts, _: u32, _: &mut Evicted) {}

    /// Node `i` loses its host data of this component (its host KV goes too).
    #[inline]
    fn drop_host(_: &mut Parts, _: u32) {}
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
        let mut took = false;
        each_component!(self.model, |C| {
            took |= C::lock(&mut self.parts(), i, state);
        });
        took
    }

    /// Every component's share of releasing the lock ending at node `i` (`took`: what
    /// [`Cache::lock_components`] said).
    pub(crate) fn release_components(&mut self, i: u32, took: bool) {
        each_component!(self.model, |C| {
            C::release(&mut self.parts(), i, took);
        });
    }

    /// Every component's share of splitting node `lower` (its new upper part `upper`).
    pub(crate) fn split_components(&mut self, upper: u32, lower: u32) {
        each_component!(self.model, |C| {
            C::split(&mut self.parts(), upper, lower);
        });
    }

    /// Every component's share of admitting a request for match `m`, into `share`;
    /// false refuses it. `copies`: the admission's copy-on-write batch.
    #[inline]
    pub(crate) fn admit_components(
        &mut self,
        m: &Found,
        share: &mut RequestShare,
        copies: &mut Vec<SlotCopy>,
    ) -> bool {
        let mut ok = true;
        each_component!(self.model, |C| {
            ok = ok && C::admit(self, m, share, copies);
        });
        ok
    }

    /// Every component's share of request `id` growing or being cached.
    #[inline]
    pub(crate) fn before_growth_components(&mut self, id: RequestId) {
        each_component!(self.model, |C| {
            C::before_growth(self, id);
        });
    }

    /// What request `r` needs of the components' own pools before it grows.
    #[inline]
    pub(crate) fn slots_needed(&self, r: &RequestState) -> NeededSlots {
        let mut needed = NeededSlots::default();
        each_component!(self.model, |C| {
            C::slots_needed(r, &mut needed);
        });
        needed
    }

    /// Whether what `needed` says can be had now.
    #[inline]
    pub(crate) fn slots_available(&self, needed: NeededSlots) -> bool {
        let mut ok = true;
        each_component!(self.model, |C| {
            ok = ok && C::slots_available(&self.view(), needed);
        });
        ok
    }

    /// Takes what `needed` says; `None` (what was taken goes back) when some slot
    /// cannot be had.
    #[inline]
    pub(crate) fn take_slots(&mut self, needed: NeededSlots) -> Option<TakenSlots> {
        if !needed.any() {
            return Some(TakenSlots::default());
        }
        self.take_needed(needed)
    }

    /// [`Cache::take_slots`] when something is needed (kept out of line, so that the
    /// common case, nothing needed, inlines to a test).
    #[inline(never)]
    fn take_needed(&mut self, needed: NeededSlots) -> Option<TakenSlots> {
        let mut taken = TakenSlots::default();
        each_component!(self.model, |C| {
            if !C::take_slots(self, needed, &mut taken) {
                return None;
            }
        });
        Some(taken)
    }

    /// Every component's share of a checkpoint that cached request `id` up to `end`.
    pub(crate) fn checkpoint_components(&mut self, id: RequestId, end: u32, at_end: bool) {
        each_component!(self.model, |C| {
            C::checkpoint(self, id, end, at_end);
        });
    }

    /// Every component's share of caching a sequence ending at node `i` with `share`
    /// (see [`Component::keep_on_node`]); true when some component's node had its own
    /// already.
    #[inline]
    pub(crate) fn keep_on_node_components(
        &mut self,
        i: u32,
        at_end: bool,
        share: &mut RequestShare,
    ) -> bool {
        let mut had = false;
        each_component!(self.model, |C| {
            had |= C::keep_on_node(&mut self.parts(), i, at_end, share);
        });
        had
    }

    /// Every component's share of an insert passing node `i` with a duplicate `dup` of
    /// its device KV.
    #[inline]
    pub(crate) fn passed_duplicate_components(&mut self, i: u32, dup: &[u32]) {
        each_component!(self.model, |C| {
            C::passed_duplicate(&mut self.parts(), i, dup);
        });
    }

    /// Whether some component finds leaf `i` of no use on the host
    /// ([`Component::backup_useless`]).
    pub(crate) fn backup_useless_components(&self, i: u32) -> bool {
        let mut useless = false;
        each_component!(self.model, |C| {
            useless = useless || C::backup_useless(&self.view(), i);
        });
        useless
    }

    /// Every component's share of node `i`'s KV getting host pages `host` in a backup
    /// ([`Component::backup_paired_pages`]); false when some component was short.
    pub(crate) fn backup_paired_pages_components(
        &mut self,
        i: u32,
        host: &[u32],
        copies: &mut BackupExtras,
    ) -> bool {
        let mut ok = true;
        each_component!(self.model, |C| {
            ok &= C::backup_paired_pages(&mut self.parts(), i, host, copies);
        });
        ok
    }

    /// Every component's share of backing up node `i` ([`Component::backup`]).
    pub(crate) fn backup_components(
        &mut self,
        i: u32,
        kv_there: bool,
        copies: &mut BackupExtras,
        count_short: bool,
    ) -> BackupOutcome {
        let mut out = BackupOutcome::default();
        each_component!(self.model, |C| {
            out = out.or(C::backup(self, i, kv_there, copies, count_short));
        });
        out
    }

    /// Every component's share of emitting a backup batch that holds `held`.
    pub(crate) fn backup_started_components(&mut self, held: &BackupExtraSlots) {
        each_component!(self.model, |C| {
            C::backup_started(&mut self.parts(), held);
        });
    }

    /// Every component's share of a backup batch that holds `held` ending.
    pub(crate) fn backup_settled_components(&mut self, held: &mut BackupExtraSlots, publish: bool) {
        each_component!(self.model, |C| {
            C::backup_settled(&mut self.parts(), held, publish);
        });
    }

    /// Every component's share of planning a load-back to node `j`
    /// ([`Component::load_plan`]).
    pub(crate) fn load_plan_components(&self, j: u32, for_request: bool) -> Result<LoadExtras> {
        let mut plan = LoadExtras::default();
        each_component!(self.model, |C| {
            C::load_plan(&self.view(), j, for_request, &mut plan)?;
        });
        Ok(plan)
    }

    /// Every component's share of taking a load-back's device slots
    /// ([`Component::load_take`]).
    pub(crate) fn load_take_components(
        &mut self,
        plan: &mut LoadExtras,
    ) -> std::result::Result<(), CallOff> {
        each_component!(self.model, |C| {
            C::load_take(self, plan)?;
        });
        Ok(())
    }

    /// Every component's share of a load-back's KV pages `kv`
    /// ([`Component::load_paired_pages`]).
    pub(crate) fn load_paired_pages_components(
        &mut self,
        kv: &Pages,
        plan: &mut LoadExtras,
    ) -> std::result::Result<(), CallOff> {
        each_component!(self.model, |C| {
            C::load_paired_pages(self, kv, plan)?;
        });
        Ok(())
    }

    /// Whether a match could end at node `i`'s end on the device for every component
    /// ([`Component::live_end`]).
    #[inline]
    pub(crate) fn live_end_components(&self, i: u32) -> bool {
        let mut ok = true;
        each_component!(self.model, |C| {
            ok = ok && C::live_end(&self.view(), i);
        });
        ok
    }

    /// Whether node `i`, which has a host KV copy, is worth keeping host-only for every
    /// component ([`Component::useful_on_host`]).
    #[inline]
    pub(crate) fn useful_on_host_components(&self, i: u32) -> bool {
        let mut ok = true;
        each_component!(self.model, |C| {
            ok = ok && C::useful_on_host(&self.view(), i);
        });
        ok
    }

    /// Every component's device data on node `i` goes ([`Component::drop_device`]).
    #[inline]
    pub(crate) fn drop_device_components(&mut self, i: u32, out: &mut Evicted) {
        each_component!(self.model, |C| {
            C::drop_device(&mut self.parts(), i, out);
        });
    }

    /// Every component's host data on node `i` goes ([`Component::drop_host`]).
    #[inline]
    pub(crate) fn drop_host_components(&mut self, i: u32) {
        each_component!(self.model, |C| {
            C::drop_host(&mut self.parts(), i);
        });
    }

    /// Every component's own checks (`audit()`).
    pub(crate) fn audit_components(&self) -> Result<()> {
        each_component!(self.model, |C| {
            C::audit(self)?;
        });
        Ok(())
    }
}
