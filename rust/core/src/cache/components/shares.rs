//! The components' shares: what a request, an insert, a backup and a load-back hold or
//! carry of each component beyond the KV pages, and the plain answers of the hooks. Plain
//! data: the components (`full.rs`, `mamba.rs`, `swa.rs`) fill and read it; a leaf that names nothing of
//! the cache's behaviour.

use crate::ids::NodeId;
use crate::pool::Pages;

use crate::cache::copies::{CopySlots, PoolKind, SlotCopy, Tier};
use crate::cache::results::CallOff;

/// What a component's `backup` hook did.
#[derive(Clone, Copy, Default)]
pub(crate) struct BackupOutcome {
    /// Data of the node joins the batch.
    pub copied: bool,
    /// Data of the node lacks a host copy and host room could not be had.
    pub short: bool,
}

impl BackupOutcome {
    /// What two components did together.
    pub(super) fn or(self, other: BackupOutcome) -> BackupOutcome {
        BackupOutcome {
            copied: self.copied || other.copied,
            short: self.short || other.short,
        }
    }
}

/// What a backup takes beyond the KV's host pages, with its copies (device slots, host
/// slots), per component. The host slots it holds go back to their pools as it drops.
#[derive(Default)]
pub(crate) struct BackupExtras {
    pub held: BackupExtraSlots,
    /// Mamba: the state copies.
    pub(super) state_copy: CopySlots,
    /// SWA: the copies into the host SWA pages paired with the new host KV pages.
    pub(super) swa_copy: CopySlots,
}

impl BackupExtras {
    /// What the batch holds until it ends, and its copies by pool (those with no slot
    /// left out).
    pub fn into_parts(
        self,
    ) -> (
        BackupExtraSlots,
        impl Iterator<Item = (PoolKind, CopySlots)>,
    ) {
        let copies = [
            (PoolKind::Mamba, self.state_copy),
            (PoolKind::Swa, self.swa_copy),
        ]
        .into_iter()
        .filter(|(_, (src, _))| !src.is_empty());
        (self.held, copies)
    }
}

/// What a load-back loads beyond the KV pages of the host-only nodes, per component:
/// planned (the `load_plan` hooks), then taken, with its copies (host to device).
#[derive(Default)]
pub(crate) struct LoadExtras {
    /// Mamba: the target's host state, when it has no device state.
    pub(super) restore_from: Option<u32>,
    /// Mamba: the load is for a request, which gets a copy of the state too.
    pub(super) for_request: bool,
    /// SWA: the host pages read, in path order.
    pub(super) host_pages: Vec<u32>,
    /// SWA: the target's window is not live counting host-only nodes.
    pub(super) window_dead: bool,
    /// SWA: the copies of the window's SWA pages.
    pub(super) swa_copy: CopySlots,
    pub held: LoadExtraSlots,
}

impl LoadExtras {
    /// Whether it loads node data (a state) of its own.
    pub fn loads_data(&self) -> bool {
        self.restore_from.is_some()
    }

    /// Why the load is called off before anything is taken, if a component refuses it.
    pub fn refused(&self) -> Option<CallOff> {
        self.window_dead.then_some(CallOff::Swa)
    }

    /// What it wants of the components' own pools.
    pub fn wants(&self) -> NeededSlots {
        NeededSlots {
            states: if self.restore_from.is_some() {
                1 + usize::from(self.for_request)
            } else {
                0
            },
        }
    }

    /// Adds its copies to `copies` (after the KV's).
    pub fn copies(&mut self, copies: &mut Vec<SlotCopy>) {
        let (src, dst) = std::mem::take(&mut self.swa_copy);
        if !src.is_empty() {
            copies.push(SlotCopy {
                pool: PoolKind::Swa,
                src_tier: Tier::Host,
                dst_tier: Tier::Device,
                src,
                dst,
            });
        }
        if let Some(h) = self.restore_from {
            let held = &self.held;
            for s in held.restore.iter().chain(&held.request.state) {
                copies.push(SlotCopy {
                    pool: PoolKind::Mamba,
                    src_tier: Tier::Host,
                    dst_tier: Tier::Device,
                    src: vec![i64::from(h)],
                    dst: vec![i64::from(s.pages()[0])],
                });
            }
        }
    }
}

/// What a load-back holds beyond its KV pages until it ends.
#[derive(Default)]
pub(crate) struct LoadExtraSlots {
    /// Mamba: restores the target's state in the tree.
    pub(super) restore: Option<Pages>,
    /// What the request gets at commit (a fresh state slot).
    pub request: RequestShare,
    /// SWA: pages copied back (on the KV's last pages, which own them).
    pub(super) swa_pages: usize,
}

impl LoadExtraSlots {
    /// What the target node gets once the copies land.
    pub fn for_target(&mut self) -> RequestShare {
        RequestShare::state(self.restore.take())
    }

    /// SWA pages it copies back.
    pub fn swa_pages(&self) -> usize {
        self.swa_pages
    }

    /// Calls `f(pool, pages)` for the device slots held (`pool` as in `report::POOLS`).
    pub fn owned(&self, mut f: impl FnMut(usize, &[u32])) {
        for s in self.restore.iter().chain(&self.request.state) {
            f(1, s.pages());
        }
    }
}

/// The host slots a backup batch holds for the components beyond the KV's pages, until
/// it ends.
#[derive(Default)]
pub(crate) struct BackupExtraSlots {
    /// Mamba: host state slots, per node.
    pub(super) states: Vec<(NodeId, Pages)>,
}

impl BackupExtraSlots {
    /// Calls `f(pool, pages)` for the host slots held (`pool` as in `report::POOLS`).
    pub fn owned(&self, mut f: impl FnMut(usize, &[u32])) {
        for (_, s) in &self.states {
            f(3, s.pages());
        }
    }
}

/// What a request holds of each component beyond its KV pages and path lock (and what
/// an insert's caller hands over with its KV).
#[derive(Default)]
pub(crate) struct RequestShare {
    /// Mamba: the request's own state slot.
    pub state: Option<Pages>,
    /// SWA: the token position up to which the request's own pages gave back their SWA
    /// pages (their tokens left the window). Absolute, so that it survives a checkpoint
    /// moving `prefix_len` (chunked prefill): a page is never freed twice, nor kept.
    pub swa_freed_to: usize,
}

impl RequestShare {
    /// What an insert's caller hands over: a state slot.
    pub fn state(state: Option<Pages>) -> RequestShare {
        RequestShare {
            state,
            ..RequestShare::default()
        }
    }

    /// The request's own state slot.
    pub fn state_slot(&self) -> Option<u32> {
        self.state.as_ref().map(|s| s.pages()[0])
    }

    /// A committed load gives the request what it brought (`fresh`): returns what that
    /// replaced, kept until the load ends.
    pub fn swap_in(&mut self, fresh: RequestShare) -> SwappedOut {
        let swapped = fresh.state.is_some();
        SwappedOut {
            state: fresh.state.and_then(|s| self.state.replace(s)),
            swapped,
        }
    }

    /// The load failed: what it replaced comes back; returns what it had brought.
    pub fn swap_back(&mut self, replaced: SwappedOut) -> RequestShare {
        let fresh = if replaced.swapped {
            std::mem::replace(&mut self.state, replaced.state)
        } else {
            None
        };
        RequestShare::state(fresh)
    }
}

/// What a committed load replaced of what a request holds ([`RequestShare::swap_in`]).
pub(crate) struct SwappedOut {
    /// The request's earlier state slot, when the load gave it a fresh one (`swapped`).
    pub(super) state: Option<Pages>,
    pub(super) swapped: bool,
}

impl SwappedOut {
    /// The request's earlier state slot, kept until the load ends.
    pub fn state(&self) -> Option<&Pages> {
        self.state.as_ref()
    }
}

/// Slots of the components' own pools that requests need before they grow.
#[derive(Clone, Copy, Default)]
pub(crate) struct NeededSlots {
    pub(super) states: usize,
}

impl NeededSlots {
    /// Whether anything is wanted.
    #[inline]
    pub fn any(self) -> bool {
        self.states > 0
    }
}

impl std::ops::AddAssign for NeededSlots {
    #[inline]
    fn add_assign(&mut self, other: NeededSlots) {
        self.states += other.states;
    }
}

/// Slots taken for what requests need ([`NeededSlots`]); they go back to their pools as
/// this drops.
#[derive(Default)]
pub(crate) struct TakenSlots {
    /// State slots: the first apart (one request's extend allocates nothing more).
    pub(super) state: Option<Pages>,
    pub(super) more_states: Vec<Pages>,
    /// Some slot is on its way (a write-back eviction's backup frees it when it lands).
    pub coming: bool,
}
