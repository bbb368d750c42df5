//! Slot pools and the owned [`Pages`] value.
//!
//! A pool hands out slots in whole pages (`page_size` consecutive slots starting at a
//! multiple of `page_size`; Mamba state pools use `page_size == 1`). Every page is, at
//! every moment, in exactly one [`PageState`]; the pool keeps a per-page state byte and
//! counts per state, which is what `audit()` checks slot conservation against.
//!
//! Allocation returns [`Pages`], an owned value that is neither `Copy` nor `Clone`. It
//! ends in exactly one of three ways: published into the tree (the tree then owns the
//! pages and frees them on eviction), handed to a caller as raw indices (the caller then
//! owns them by contract and gives them back with `free_kv` or `insert`), or dropped,
//! which returns the pages to the free list. Nothing is "allocated, then hopefully
//! freed later".
//!
//! A pool whose slots the engine owns (`pools="engine"`) starts with every page in the
//! `Caller` state (the engine's), and its free list is the "to free" queue: pages the
//! tree gave up, waiting to go back to the engine ([`Pool::take_queued`]). Nothing is
//! allocated from such a pool.
//!
//! Every change of a page's state or pins is checked, in release builds too: a change
//! the books do not allow (a page moved from a state it is not in, freed twice, unpinned
//! more often than pinned, a page of another pool) can only come from a bug, and it is
//! not made. It is recorded as the pool's [`Pool::fault`] instead (shared by the pools of
//! one cache), and the cache reports itself broken from then on ([`Error::Broken`]):
//! loudly, rather than serving a slot that the books no longer describe.
//!
//! The parts, from the bottom up: [`state`] (page states and counts), [`fault`] (illegal
//! transitions and where they are recorded), [`books`] (the per-page states and pins,
//! the free list, the SWA pairing, each move checked), this file ([`Pool`]: the books
//! behind the pool's lock, pages given back by raw index, pins, the audit),
//! [`companion`] (the SWA pairing's operations), [`pages`] (the owned [`Pages`] value:
//! how the pool hands it out, and its every exit) and [`index`] (index conversions the
//! crate shares).

mod books;
mod companion;
mod fault;
mod index;
mod pages;
mod state;
#[cfg(test)]
mod tests;

use std::fmt;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::config::PoolOwner;
use crate::error::{Error, Result};

use books::PoolInner;
pub(crate) use fault::Fault;
use fault::{Checked, Illegal};
pub(crate) use index::{as_i64, index_u32, page_of_slot};
pub(crate) use pages::PageRun;
pub use pages::Pages;
pub use state::{PageState, PoolCounts};

struct PoolShared {
    name: &'static str,
    page_size: usize,
    pages: usize,
    /// The engine owns the slots (see the module's documentation).
    engine: bool,
    inner: Mutex<PoolInner>,
    /// Where an illegal transition is recorded (shared by the pools of one cache).
    fault: Arc<Fault>,
}

/// A pool of slots allocated in pages. Cloning the handle shares the pool.
///
/// The pool has its own small lock, separate from the cache's, so that a [`Pages`]
/// value can be dropped anywhere (another thread, a Python finaliser) and still find its
/// way home. Pool methods never drop a [`Pages`] while holding that lock.
#[derive(Clone)]
pub struct Pool {
    shared: Arc<PoolShared>,
}

impl fmt::Debug for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = self.counts();
        f.debug_struct("Pool")
            .field("name", &self.shared.name)
            .field("page_size", &self.shared.page_size)
            .field("pages", &self.shared.pages)
            .field("counts", &c)
            .finish()
    }
}

impl Pool {
    /// A pool of `slots` slots in pages of `page_size`. `name` is the argument that
    /// configured it, used in error messages (`"kv_slots"`, `"mamba_slots"`, ...).
    pub fn new(name: &'static str, slots: usize, page_size: usize) -> Result<Pool> {
        Pool::with_fault(name, slots, page_size, Arc::default(), PoolOwner::Cache)
    }

    /// [`Pool::new`] recording illegal transitions in `fault` (the cache's pools share
    /// one, so that checking it once covers them all), its pages first `owner`'s (every
    /// page free, or every page the engine's).
    pub(crate) fn with_fault(
        name: &'static str,
        slots: usize,
        page_size: usize,
        fault: Arc<Fault>,
        owner: PoolOwner,
    ) -> Result<Pool> {
        if page_size == 0 {
            return Err(Error::arg("page_size", "must be at least 1"));
        }
        if !slots.is_multiple_of(page_size) {
            return Err(Error::arg(
                name,
                format!("{slots} is not a multiple of page_size {page_size}"),
            ));
        }
        if u32::try_from(slots).is_err() {
            return Err(Error::arg(name, format!("{slots} exceeds 2**32 - 1 slots")));
        }
        let pages = slots / page_size;
        let mut counts = PoolCounts::default();
        let untouched = match owner {
            PoolOwner::Cache => PageState::Free,
            PoolOwner::Engine => PageState::Caller,
        };
        *counts.slot(untouched) = pages;
        let inner = PoolInner {
            untouched,
            free: Vec::new(),
            state: Vec::new(),
            pins: Vec::new(),
            counts,
            companion: None,
        };
        Ok(Pool {
            shared: Arc::new(PoolShared {
                name,
                page_size,
                pages,
                engine: owner == PoolOwner::Engine,
                inner: Mutex::new(inner),
                fault,
            }),
        })
    }

    /// Slots per page.
    pub fn page_size(&self) -> usize {
        self.shared.page_size
    }

    /// Pages in the pool.
    pub fn capacity_pages(&self) -> usize {
        self.shared.pages
    }

    /// Whether the engine owns the slots (every page starts as the engine's, the free
    /// list is the queue of pages to hand back to it).
    pub fn engine_owned(&self) -> bool {
        self.shared.engine
    }

    /// Pages on the free list now (engine-owned pools: queued for the engine).
    pub fn free_pages(&self) -> usize {
        self.shared.inner.lock().counts.free
    }

    /// Page counts per state.
    pub fn counts(&self) -> PoolCounts {
        self.shared.inner.lock().counts
    }

    /// The state of one page (`None` when out of range).
    pub fn state(&self, page: u32) -> Option<PageState> {
        self.shared.inner.lock().get(page, self.shared.pages)
    }

    /// The first illegal page transition seen by this pool (or by another pool of its
    /// cache), if any: a bug of radixcache, which leaves the cache unusable.
    pub fn fault(&self) -> Option<String> {
        self.shared.fault.get()
    }

    /// Records an illegal change the cache found itself (of a node's state, say): the
    /// cache is then broken as for an illegal page transition.
    pub(crate) fn record_fault(&self, why: String) {
        self.shared.fault.record(why);
    }

    /// Records an illegal transition (see the module's documentation).
    fn illegal(&self, outcome: Checked) {
        if let Err(illegal) = outcome {
            self.shared.fault.record(illegal.describe(self.shared.name));
        }
    }

    /// True when both handles share one pool.
    pub fn same_pool(&self, other: &Pool) -> bool {
        Arc::ptr_eq(&self.shared, &other.shared)
    }

    /// Gives pages a caller holds as raw indices back to the free list. A page listed
    /// several times is freed once. Any page not held by the caller (free, owned by the
    /// tree, out of range) fails the whole call, which then changes nothing.
    pub fn free_caller(&self, pages: &[u32], arg: &'static str) -> Result<usize> {
        let mut inner = self.shared.inner.lock();
        for &p in pages {
            let state = inner.get(p, self.shared.pages);
            if state != Some(PageState::Caller) {
                return Err(Error::arg(arg, self.describe(p, state)));
            }
        }
        let mut freed = 0;
        for &p in pages {
            // A page listed twice is no longer the caller's by its second mention.
            if inner.get(p, self.shared.pages) == Some(PageState::Caller) {
                inner.free_one(p, PageState::Caller);
                freed += 1;
            }
        }
        Ok(freed)
    }

    /// Pages on the free list now, in the order they joined it (the queue of an
    /// engine-owned pool; [`Pool::take_queued`] takes them from a position on).
    pub(crate) fn queued_len(&self) -> usize {
        self.shared.inner.lock().free.len()
    }

    /// Hands the pages that joined the free list from position `from` on (see
    /// [`Pool::queued_len`]) to the caller: each leaves the list once, in the order it
    /// joined, and is the caller's (the engine's) from then on.
    pub(crate) fn take_queued(&self, from: usize) -> Vec<u32> {
        let mut inner = self.shared.inner.lock();
        let from = from.min(inner.free.len());
        let pages: Vec<u32> = inner.free.drain(from..).collect();
        let moved = inner.move_all(&pages, PageState::Free, PageState::Caller);
        if moved.is_err() {
            // The list held a page that is not free: none of it is handed out.
            inner.free.extend_from_slice(&pages);
            drop(inner);
            self.illegal(moved);
            return Vec::new();
        }
        pages
    }

    /// Lists the last queued page a second time (what a bug would do; audit tests).
    #[cfg(test)]
    pub(crate) fn corrupt_queue_for_tests(&self) {
        let mut inner = self.shared.inner.lock();
        if let Some(&p) = inner.free.last() {
            inner.free.push(p);
        }
    }

    /// Frees pages the tree owned (eviction). Crate-internal: the tree is the only owner
    /// that frees by raw index, and `audit()` checks it never frees what it does not own.
    pub(crate) fn release_tree(&self, pages: &[u32]) {
        let freed = self.shared.inner.lock().free_all(pages, PageState::Tree);
        self.illegal(freed);
    }

    /// Pins pages for a transfer that may read or write them: until [`Pool::unpin`], none
    /// of them can reach the free list, whoever gives them back meanwhile. A free page
    /// is an illegal transition: it is not pinned.
    pub(crate) fn pin(&self, pages: &[u32]) {
        let mut inner = self.shared.inner.lock();
        let mut illegal = Ok(());
        for &p in pages {
            let i = p as usize;
            let held = inner.state.get(i).is_some_and(|&s| s != PageState::Free);
            match inner.pins.get_mut(i) {
                Some(pins) if held => *pins = pins.saturating_add(1),
                _ => illegal = illegal.and(Err(Illegal::PinFree { page: p })),
            }
        }
        drop(inner);
        self.illegal(illegal);
    }

    /// Drops a transfer's pins; a page that was given back meanwhile becomes free now. A
    /// page no transfer pins is an illegal transition (an unpin twice): it is left as it
    /// is.
    pub(crate) fn unpin(&self, pages: &[u32]) {
        let mut inner = self.shared.inner.lock();
        let mut illegal = Ok(());
        for &p in pages {
            let Some(pins) = inner.pins.get_mut(p as usize).filter(|pins| **pins > 0) else {
                illegal = illegal.and(Err(Illegal::Unpin { page: p }));
                continue;
            };
            *pins -= 1;
            if *pins == 0 && inner.state.get(p as usize) == Some(&PageState::Draining) {
                inner.set(p, PageState::Draining, PageState::Free);
                inner.freed(p);
            }
        }
        drop(inner);
        self.illegal(illegal);
    }

    /// Pins on every page (audit).
    pub(crate) fn all_pins(&self) -> Vec<u32> {
        let mut pins = self.shared.inner.lock().pins.clone();
        pins.resize(self.shared.pages, 0);
        pins
    }

    /// Pins on one page (audit and tests).
    pub(crate) fn pins(&self, page: u32) -> u32 {
        self.shared
            .inner
            .lock()
            .pins
            .get(page as usize)
            .copied()
            .unwrap_or(0)
    }

    fn describe(&self, page: u32, state: Option<PageState>) -> String {
        let ps = self.shared.page_size;
        let what = if ps == 1 {
            format!("slot {page}")
        } else {
            format!(
                "page {page} (slots {}..{})",
                page as usize * ps,
                (page as usize + 1) * ps
            )
        };
        let engine = self.shared.engine;
        match state {
            None => format!(
                "{what} is out of range for a pool of {} slots",
                self.shared.pages * ps
            ),
            Some(PageState::Free) if engine => format!(
                "{what} is queued to go back to the engine (take_freed hands it back), so \
                 it is not the engine's"
            ),
            Some(PageState::Tree) if engine => {
                format!("{what} is in the cache's tree, not the engine's")
            }
            Some(PageState::Free) => format!("{what} is not allocated (double free?)"),
            Some(PageState::Tree) => format!("{what} is owned by the cache, not by the caller"),
            Some(PageState::Owned) => format!("{what} is held by a request or transfer"),
            Some(PageState::Caller) => format!("{what} is listed twice"),
            Some(PageState::Draining) => format!("{what} is not allocated (it is being freed)"),
        }
    }

    /// Checks the pool's own bookkeeping: no illegal transition was recorded, the free
    /// list holds exactly the free pages that were used before, once each (the others
    /// were never used), and the counts match the states.
    pub(crate) fn audit(&self) -> Result<PoolCounts> {
        if let Some(why) = self.fault() {
            return Err(Error::Invariant(why));
        }
        let inner = self.shared.inner.lock();
        let name = self.shared.name;
        let mut counts = PoolCounts::default();
        for &s in &inner.state {
            *counts.slot(s) += 1;
        }
        let never_used = self.shared.pages - inner.used();
        *counts.slot(inner.untouched) += never_used;
        if inner.pins.len() != inner.used() {
            return Err(Error::Invariant(format!(
                "{name}: {} pages have pin counts, {} were used",
                inner.pins.len(),
                inner.used()
            )));
        }
        if counts != inner.counts {
            return Err(Error::Invariant(format!(
                "{name}: state counts {counts:?} differ from the pool's tally {:?}",
                inner.counts
            )));
        }
        let never_used_free = if inner.untouched == PageState::Free {
            never_used
        } else {
            0
        };
        if inner.free.len() + never_used_free != counts.free {
            return Err(Error::Invariant(format!(
                "{name}: free list has {} pages and {never_used_free} free ones were never \
                 used, {} pages are free",
                inner.free.len(),
                counts.free
            )));
        }
        for (p, (&s, &pins)) in inner.state.iter().zip(&inner.pins).enumerate() {
            if (s == PageState::Draining && pins == 0) || (s == PageState::Free && pins > 0) {
                return Err(Error::Invariant(format!(
                    "{name}: page {p} is {s:?} with {pins} transfer pins"
                )));
            }
        }
        let mut seen = vec![false; inner.state.len()];
        for &p in &inner.free {
            let i = p as usize;
            if inner.state.get(i) != Some(&PageState::Free) || seen[i] {
                return Err(Error::Invariant(format!(
                    "{name}: page {p} on the free list is not free or is listed twice"
                )));
            }
            seen[i] = true;
        }
        inner.audit_companion()?;
        Ok(counts)
    }

    /// The pages in state `state`, ascending. Pages never used are in the pool's first
    /// state and are left out: ask only for a state that a page reaches by a change.
    pub(crate) fn pages_in(&self, state: PageState) -> Vec<u32> {
        let inner = self.shared.inner.lock();
        (0..inner.used())
            .filter(|&i| inner.state[i] == state)
            .map(index_u32)
            .collect()
    }

    /// The state of every page (audit).
    pub(crate) fn snapshot_states(&self) -> Vec<PageState> {
        let inner = self.shared.inner.lock();
        let mut states = inner.state.clone();
        states.resize(self.shared.pages, inner.untouched);
        states
    }

    /// Moves pages from `from` to `to` (none of them, the fault recorded, when one is not
    /// in `from`).
    fn transition(&self, pages: &[u32], from: PageState, to: PageState) {
        let moved = self.shared.inner.lock().move_all(pages, from, to);
        self.illegal(moved);
    }

    /// Frees pages that are all in state `from`, recording an illegal transition.
    fn free_all(&self, pages: &[u32], from: PageState) {
        let freed = self.shared.inner.lock().free_all(pages, from);
        self.illegal(freed);
    }
}
