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

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::config::PoolOwner;
use crate::error::{Error, Result};

/// Where a page is. Exactly one state per page at every moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum PageState {
    /// On the free list (engine-owned pools: queued to go back to the engine).
    Free,
    /// Held by a live [`Pages`] value (a request, a guard, an operation in progress).
    Owned,
    /// Handed to a caller as raw indices; the caller gives it back by `free` or `insert`
    /// (engine-owned pools: the engine's, which every page is at first).
    Caller,
    /// Published into the radix tree.
    Tree,
    /// Given back by its owner while a transfer may still read or write it (the page is
    /// pinned): it returns to the free list when the last pin goes.
    Draining,
}

/// Page counts per state, as reported by [`Pool::counts`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolCounts {
    /// Pages on the free list.
    pub free: usize,
    /// Pages held by live [`Pages`] values.
    pub owned: usize,
    /// Pages held by callers as raw indices.
    pub caller: usize,
    /// Pages owned by the tree.
    pub tree: usize,
    /// Pages given back while pinned by a transfer, free once it ends.
    pub draining: usize,
}

/// The first illegal page transition seen by the pools that share it (those of one
/// cache). Recording never blocks for long and never panics: it may run in a `Drop`.
#[derive(Default)]
pub(crate) struct Fault {
    /// Set once something is recorded: checking costs one atomic load.
    set: AtomicBool,
    why: Mutex<Option<String>>,
}

impl Fault {
    /// Records `why`, unless an earlier fault was recorded (the first one is kept).
    fn record(&self, why: String) {
        let mut first = self.why.lock();
        if first.is_none() {
            *first = Some(why);
        }
        self.set.store(true, Ordering::Release);
    }

    /// Whether a fault was recorded (one atomic load: checked after every call).
    #[inline]
    pub(crate) fn is_set(&self) -> bool {
        self.set.load(Ordering::Acquire)
    }

    /// The first fault recorded, if any.
    fn get(&self) -> Option<String> {
        if !self.set.load(Ordering::Acquire) {
            return None;
        }
        self.why.lock().clone()
    }
}

impl PoolCounts {
    fn slot(&mut self, state: PageState) -> &mut usize {
        match state {
            PageState::Free => &mut self.free,
            PageState::Owned => &mut self.owned,
            PageState::Caller => &mut self.caller,
            PageState::Tree => &mut self.tree,
            PageState::Draining => &mut self.draining,
        }
    }
}

/// The books of a pool. They cover only the pages handed out at least once (`state` and
/// `pins` have one entry per such page): the pages from there on have never been used
/// and are in the pool's first state (free; the engine's when the engine owns the
/// slots), so a pool costs memory in proportion to its high-water mark, not to its size
/// (a pool of 2**32 - 1 slots is made at once and costs nothing until used).
struct PoolInner {
    /// The state of a page never used ([`PageState::Free`], or [`PageState::Caller`]
    /// when the engine owns the slots).
    untouched: PageState,
    /// Pages given back, handed out again first (a stack: O(1) per page).
    free: Vec<u32>,
    /// Per page handed out at least once (`state.len()` pages): its state.
    state: Vec<PageState>,
    /// Per such page, the transfers that may read or write it. A pinned page never
    /// reaches the free list: freeing it only marks it `Draining`.
    pins: Vec<u32>,
    counts: PoolCounts,
    /// The SWA pages paired with this pool's pages (a KV pool of a model with SWA
    /// layers), or `None`.
    companion: Option<Companion>,
}

/// A second pool whose pages are paired with the first's: the sliding-window attention
/// KV of a model with SWA layers. A KV page holds at most one SWA page (its tokens' SWA
/// KV); the SWA page follows its KV page wherever it goes (a request, the tree, a
/// caller) and is freed at the latest with it, or earlier by [`Pool::detach_companion`]
/// (its tokens left every window). So every SWA page is free or paired with exactly one
/// KV page that is not free: nothing else can be written down.
struct Companion {
    /// The argument that configured it (`"swa_slots"`, `"host_swa_slots"`), for audit.
    name: &'static str,
    /// Free SWA pages (a stack).
    free: Vec<u32>,
    /// Per KV page, its SWA page or [`NO_PAGE`].
    of: Vec<u32>,
    /// SWA pages in all.
    pages: usize,
}

/// No companion page.
const NO_PAGE: u32 = u32::MAX;

impl Companion {
    /// Frees KV page `p`'s SWA page, if it has one; true when it had.
    fn detach(&mut self, p: u32) -> bool {
        match self.of.get_mut(p as usize) {
            Some(c) if *c != NO_PAGE => {
                self.free.push(std::mem::replace(c, NO_PAGE));
                true
            }
            _ => false,
        }
    }

    /// Whether KV page `p` has an SWA page.
    fn attached(&self, p: u32) -> bool {
        self.of.get(p as usize).is_some_and(|&c| c != NO_PAGE)
    }
}

impl PoolInner {
    /// Page `p` reached the free list: its SWA page goes too. Inlined, like
    /// [`PoolInner::free_one`]: it runs once per page freed.
    #[inline]
    fn freed(&mut self, p: u32) {
        self.free.push(p);
        if let Some(c) = self.companion.as_mut() {
            c.detach(p);
        }
    }

    /// Pages handed out at least once (the first never-used page).
    fn used(&self) -> usize {
        self.state.len()
    }

    /// The state of page `p` of a pool of `pages` pages (`None` when out of range).
    fn get(&self, p: u32, pages: usize) -> Option<PageState> {
        let i = p as usize;
        match self.state.get(i) {
            Some(&s) => Some(s),
            None if i < pages => Some(self.untouched),
            None => None,
        }
    }

    /// Extends the books to cover page `p` (in range, checked by the caller): the pages
    /// added are in their first state. False when memory for them cannot be had.
    fn cover(&mut self, p: u32) -> bool {
        let need = (p as usize + 1).saturating_sub(self.state.len());
        if need == 0 {
            return true;
        }
        if self.state.try_reserve(need).is_err() || self.pins.try_reserve(need).is_err() {
            return false;
        }
        let len = p as usize + 1;
        self.state.resize(len, self.untouched);
        self.pins.resize(len, 0);
        true
    }

    /// Moves page `page` (in state `from`, checked by the caller) to `to`.
    fn set(&mut self, page: u32, from: PageState, to: PageState) {
        if let Some(s) = self.state.get_mut(page as usize) {
            *s = to;
            *self.counts.slot(from) -= 1;
            *self.counts.slot(to) += 1;
        }
    }

    /// Moves pages that are all in state `from` to `to`, updating the counts once. A page
    /// in another state (or out of the books, or listed twice) is an illegal transition:
    /// then nothing moves, and the error describes the page.
    fn move_all(&mut self, pages: &[u32], from: PageState, to: PageState) -> Checked {
        for (k, &p) in pages.iter().enumerate() {
            match self.state.get_mut(p as usize) {
                Some(s) if *s == from => *s = to,
                found => {
                    let found = found.map(|s| *s);
                    for &q in &pages[..k] {
                        if let Some(s) = self.state.get_mut(q as usize) {
                            *s = from;
                        }
                    }
                    return Err(Illegal::State {
                        page: p,
                        found,
                        from,
                        to,
                    });
                }
            }
        }
        *self.counts.slot(from) -= pages.len();
        *self.counts.slot(to) += pages.len();
        Ok(())
    }

    /// Frees pages that are all in state `from` (pinned ones start draining instead). A
    /// page in another state (or listed twice) is an illegal transition: it is left as
    /// it is, the others are freed, and the error describes the first such page.
    fn free_all(&mut self, pages: &[u32], from: PageState) -> Checked {
        let mut illegal = Ok(());
        // `free_one` page by page, with the counts updated once (a hot path: every page
        // an eviction or a dropped `Pages` gives back passes here).
        let (mut freed, mut draining) = (0, 0);
        for &p in pages {
            let i = p as usize;
            match self.state.get_mut(i) {
                Some(s) if *s == from => {
                    if self.pins.get(i).is_some_and(|&pins| pins > 0) {
                        *s = PageState::Draining;
                        draining += 1;
                    } else {
                        *s = PageState::Free;
                        freed += 1;
                        self.freed(p);
                    }
                }
                found => {
                    if illegal.is_ok() {
                        illegal = Err(Illegal::State {
                            page: p,
                            found: found.map(|s| *s),
                            from,
                            to: PageState::Free,
                        });
                    }
                }
            }
        }
        *self.counts.slot(from) -= freed + draining;
        self.counts.free += freed;
        self.counts.draining += draining;
        illegal
    }

    /// Frees page `p` (in state `from`), or marks it draining while a transfer still pins
    /// it.
    #[inline]
    fn free_one(&mut self, p: u32, from: PageState) {
        if self.pins.get(p as usize).is_some_and(|&pins| pins > 0) {
            self.set(p, from, PageState::Draining);
        } else {
            self.set(p, from, PageState::Free);
            self.freed(p);
        }
    }
}

/// Whether a change was legal (`Err`: not made, and why).
type Checked = std::result::Result<(), Illegal>;

/// A change of a page that the books do not allow (a bug of radixcache).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Illegal {
    /// Page `page` was to move from `from` to `to` but is in state `found` (`None`: it
    /// is out of the books).
    State {
        page: u32,
        found: Option<PageState>,
        from: PageState,
        to: PageState,
    },
    /// A transfer pinned page `page`, which is free (or out of the books).
    PinFree { page: u32 },
    /// A transfer unpinned page `page`, which no transfer pins (an unpin twice).
    Unpin { page: u32 },
    /// Pages of another pool were appended to pages of this one.
    ForeignPages { page: u32 },
}

impl Illegal {
    fn describe(self, pool: &str) -> String {
        match self {
            Illegal::State {
                page,
                found: Some(found),
                from,
                to,
            } => format!(
                "illegal page transition in {pool}: page {page} is {found:?}, not {from:?}, \
                 so it cannot become {to:?}"
            ),
            Illegal::State {
                page,
                found: None,
                from,
                to,
            } => format!(
                "illegal page transition in {pool}: page {page} ({from:?} to {to:?}) was \
                 never handed out"
            ),
            Illegal::PinFree { page } => {
                format!("illegal page transition in {pool}: page {page} is pinned but free")
            }
            Illegal::Unpin { page } => format!(
                "illegal page transition in {pool}: page {page} is unpinned more often than \
                 it was pinned"
            ),
            Illegal::ForeignPages { page } => format!(
                "illegal page transition in {pool}: page {page} of another pool was added to \
                 its pages"
            ),
        }
    }
}

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

    /// Pairs this pool's pages with an SWA pool of `slots` slots (a multiple of the page
    /// size, checked by the configuration, and configured by argument `name`), every SWA
    /// page free.
    pub(crate) fn with_companion(self, name: &'static str, slots: usize) -> Pool {
        let pages = slots / self.shared.page_size;
        self.shared.inner.lock().companion = Some(Companion {
            name,
            free: (0..index_u32(pages)).rev().collect(),
            of: vec![NO_PAGE; self.shared.pages],
            pages,
        });
        self
    }

    /// Gives every page of `pages` that has none an SWA page; all or nothing: false (and
    /// nothing given) when there are not enough free SWA pages, or no SWA pool.
    pub(crate) fn attach_companion(&self, pages: &[u32]) -> bool {
        let mut inner = self.shared.inner.lock();
        let Some(c) = inner.companion.as_mut() else {
            return false;
        };
        let missing = pages.iter().filter(|&&p| !c.attached(p)).count();
        if missing > c.free.len() {
            return false;
        }
        for &p in pages {
            if let (Some(slot), true) = (c.of.get(p as usize).copied(), !c.attached(p)) {
                debug_assert_eq!(slot, NO_PAGE);
                if let Some(s) = c.free.pop() {
                    c.of[p as usize] = s;
                }
            }
        }
        true
    }

    /// Moves the SWA page of each `from[k]` that has one onto `to[k]` when that has none
    /// (the same tokens: the SWA KV goes with its slot, never to another slot); returns
    /// the pages moved.
    pub(crate) fn move_companions(&self, from: &[u32], to: &[u32]) -> usize {
        let mut inner = self.shared.inner.lock();
        let Some(c) = inner.companion.as_mut() else {
            return 0;
        };
        let mut moved = 0;
        for (&f, &t) in from.iter().zip(to) {
            if c.attached(f) && !c.attached(t) {
                let slot = std::mem::replace(&mut c.of[f as usize], NO_PAGE);
                c.of[t as usize] = slot;
                moved += 1;
            }
        }
        moved
    }

    /// Frees the SWA pages of `pages` (their tokens left every window); returns how many
    /// there were.
    pub(crate) fn detach_companion(&self, pages: &[u32]) -> usize {
        let mut inner = self.shared.inner.lock();
        let Some(c) = inner.companion.as_mut() else {
            return 0;
        };
        pages.iter().filter(|&&p| c.detach(p)).count()
    }

    /// How many of the last pages of `pages` have an SWA page, stopping at the first
    /// (from the end) without one.
    pub(crate) fn companion_tail(&self, pages: &[u32]) -> usize {
        let inner = self.shared.inner.lock();
        let Some(c) = inner.companion.as_ref() else {
            return 0;
        };
        pages.iter().rev().take_while(|&&p| c.attached(p)).count()
    }

    /// The SWA page of each of `pages` (`None` where it has none).
    pub(crate) fn companions(&self, pages: &[u32]) -> Vec<Option<u32>> {
        let inner = self.shared.inner.lock();
        pages
            .iter()
            .map(|&p| {
                inner
                    .companion
                    .as_ref()
                    .and_then(|c| c.of.get(p as usize).copied())
                    .filter(|&s| s != NO_PAGE)
            })
            .collect()
    }

    /// Free SWA pages (0 without an SWA pool).
    pub(crate) fn companion_free(&self) -> usize {
        self.shared
            .inner
            .lock()
            .companion
            .as_ref()
            .map_or(0, |c| c.free.len())
    }

    /// SWA pages paired with a page in each state: `[owned, caller, tree, draining]`
    /// (audit and stats).
    pub(crate) fn companion_counts(&self) -> [usize; 4] {
        let inner = self.shared.inner.lock();
        let mut out = [0; 4];
        let Some(c) = inner.companion.as_ref() else {
            return out;
        };
        for (p, &s) in c.of.iter().enumerate() {
            if s == NO_PAGE {
                continue;
            }
            let k = match inner.state.get(p).copied().unwrap_or(inner.untouched) {
                PageState::Owned => 0,
                PageState::Caller => 1,
                PageState::Tree => 2,
                PageState::Draining => 3,
                PageState::Free => continue,
            };
            out[k] += 1;
        }
        out
    }

    /// Checks the SWA pairing: every SWA page is free (once) or paired with exactly one
    /// page that is not free, and a free page has no SWA page.
    fn audit_companion(inner: &PoolInner) -> Result<()> {
        let Some(c) = inner.companion.as_ref() else {
            return Ok(());
        };
        let name = c.name;
        let mut seen = vec![false; c.pages];
        for (p, &s) in c.of.iter().enumerate() {
            if s == NO_PAGE {
                continue;
            }
            let state = inner.state.get(p).copied().unwrap_or(inner.untouched);
            if state == PageState::Free {
                return Err(Error::Invariant(format!(
                    "{name}: SWA page {s} is paired with free KV page {p}"
                )));
            }
            match seen.get_mut(s as usize) {
                Some(k) if !*k => *k = true,
                _ => {
                    return Err(Error::Invariant(format!(
                        "{name}: SWA page {s} (of KV page {p}) is out of range or paired twice"
                    )))
                }
            }
        }
        for &s in &c.free {
            match seen.get_mut(s as usize) {
                Some(k) if !*k => *k = true,
                _ => {
                    return Err(Error::Invariant(format!(
                        "{name}: free SWA page {s} is out of range, paired or listed twice"
                    )))
                }
            }
        }
        if let Some(lost) = seen.iter().position(|&k| !k) {
            return Err(Error::Invariant(format!(
                "{name}: SWA page {lost} is neither free nor paired with a KV page"
            )));
        }
        Ok(())
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

    /// `n` pages, or `None` (and nothing taken) when fewer than `n` are free. Pages given
    /// back are handed out first (the most recent first), then never-used ones in
    /// ascending order.
    pub fn try_alloc(&self, n: usize) -> Option<Pages> {
        let mut inner = self.shared.inner.lock();
        if inner.counts.free < n {
            return None;
        }
        let reused = n.min(inner.free.len());
        let fresh = n - reused;
        let used = inner.used();
        // The books grow for the never-used pages; memory that cannot be had (only for
        // absurd sizes) is no room, and nothing is taken.
        let mut pages = Vec::new();
        if pages.try_reserve_exact(n).is_err()
            || inner.state.try_reserve(fresh).is_err()
            || inner.pins.try_reserve(fresh).is_err()
        {
            return None;
        }
        let at = inner.free.len() - reused;
        pages.extend(inner.free.drain(at..).rev());
        pages.extend((used..used + fresh).map(index_u32));
        inner.state.resize(used + fresh, PageState::Free);
        inner.pins.resize(used + fresh, 0);
        let moved = inner.move_all(&pages, PageState::Free, PageState::Owned);
        drop(inner);
        if moved.is_err() {
            // The free list held a page that is not free: none of it is handed out.
            self.illegal(moved);
            return None;
        }
        Some(Pages {
            pool: self.clone(),
            pages,
        })
    }

    /// An empty owned value of this pool (to extend later).
    pub fn empty(&self) -> Pages {
        Pages {
            pool: self.clone(),
            pages: Vec::new(),
        }
    }

    /// Takes back pages a caller holds as raw indices, as an owned value. Every page must
    /// be held by the caller and listed once; otherwise nothing changes and the error
    /// names `arg`.
    pub fn claim_caller(&self, pages: &[u32], arg: &'static str) -> Result<Pages> {
        let mut inner = self.shared.inner.lock();
        for (i, &p) in pages.iter().enumerate() {
            let state = inner.get(p, self.shared.pages);
            if state != Some(PageState::Caller) {
                // Roll back what this call already claimed, so nothing changes.
                for &q in &pages[..i] {
                    inner.state[q as usize] = PageState::Caller;
                }
                // A page this call claimed already is a duplicate, not someone else's.
                let state = if pages[..i].contains(&p) {
                    Some(PageState::Caller)
                } else {
                    state
                };
                return Err(Error::arg(arg, self.describe(p, state)));
            }
            if !inner.cover(p) {
                for &q in &pages[..i] {
                    inner.state[q as usize] = PageState::Caller;
                }
                return Err(Error::OutOfMemory {
                    arg,
                    reason: format!(
                        "cannot extend the books of {} to page {p}",
                        self.shared.name
                    ),
                });
            }
            // Marked at once, so that a second mention of the page is caught.
            inner.state[p as usize] = PageState::Owned;
        }
        inner.counts.caller -= pages.len();
        inner.counts.owned += pages.len();
        drop(inner);
        Ok(Pages {
            pool: self.clone(),
            pages: pages.to_vec(),
        })
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
        Pool::audit_companion(&inner)?;
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

/// Pages owned by a value: published into the tree, handed to a caller, or returned to
/// the pool when dropped.
#[must_use = "dropping Pages returns them to the pool at once"]
#[clippy::has_significant_drop]
pub struct Pages {
    pool: Pool,
    pages: Vec<u32>,
}

impl fmt::Debug for Pages {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pages")
            .field("pool", &self.pool.shared.name)
            .field("pages", &self.pages)
            .finish()
    }
}

impl Pages {
    /// The page numbers held.
    pub fn pages(&self) -> &[u32] {
        &self.pages
    }

    /// Number of pages held.
    pub fn len(&self) -> usize {
        self.pages.len()
    }

    /// True when no page is held.
    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }

    /// The pool the pages belong to.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// Moves the pages of `other` (same pool) into `self`. Pages of another pool are an
    /// illegal transition: they stay with `other`, which gives them back to their pool
    /// as it drops.
    pub fn append(&mut self, mut other: Pages) {
        if !self.pool.same_pool(&other.pool) {
            if let Some(&page) = other.pages.first() {
                self.pool.illegal(Err(Illegal::ForeignPages { page }));
            }
            return;
        }
        self.pages.append(&mut other.pages);
    }

    /// Splits off the pages from `at` on into a second owned value.
    pub fn split_off(&mut self, at: usize) -> Pages {
        Pages {
            pool: self.pool.clone(),
            pages: self.pages.split_off(at),
        }
    }

    /// Hands the pages to a caller as raw page numbers; the caller now owns them by
    /// contract and gives them back through the pool's `free_caller` or an insert.
    pub fn into_caller(mut self) -> Vec<u32> {
        let pages = std::mem::take(&mut self.pages);
        self.pool
            .transition(&pages, PageState::Owned, PageState::Caller);
        pages
    }

    /// Publishes the pages into the tree, which owns them from now on.
    pub(crate) fn into_tree(mut self) -> Vec<u32> {
        let pages = std::mem::take(&mut self.pages);
        self.pool
            .transition(&pages, PageState::Owned, PageState::Tree);
        pages
    }
}

impl Pages {
    /// The pages as a run handed out front to back (see [`PageRun`]).
    pub(crate) fn into_run(mut self) -> PageRun {
        PageRun {
            pool: self.pool.clone(),
            pages: std::mem::take(&mut self.pages),
            next: 0,
        }
    }
}

/// Owned pages handed out front to back, in runs: [`PageRun::take`] moves the next
/// pages into a [`Pages`] of their own in time proportional to the run taken (a walk
/// down a path hands each node its pages without moving the rest each time). The pages
/// not handed out return to the pool when the run drops.
#[must_use = "dropping a PageRun returns the pages not yet taken to the pool"]
#[clippy::has_significant_drop]
pub(crate) struct PageRun {
    pool: Pool,
    pages: Vec<u32>,
    /// Pages before this index were handed out.
    next: usize,
}

impl PageRun {
    /// The page numbers not handed out yet.
    pub fn pages(&self) -> &[u32] {
        &self.pages[self.next..]
    }

    /// The next `n` pages (or as many as are left).
    pub fn take(&mut self, n: usize) -> Pages {
        let end = self.next.saturating_add(n).min(self.pages.len());
        let pages = self.pages[self.next..end].to_vec();
        self.next = end;
        Pages {
            pool: self.pool.clone(),
            pages,
        }
    }
}

impl Drop for PageRun {
    fn drop(&mut self) {
        if self.next < self.pages.len() {
            self.pool
                .free_all(&self.pages[self.next..], PageState::Owned);
        }
        self.pages.clear();
    }
}

impl Drop for Pages {
    fn drop(&mut self) {
        if self.pages.is_empty() {
            return;
        }
        self.pool.free_all(&self.pages, PageState::Owned);
        self.pages.clear();
    }
}

/// A count or index as `i64` (slot indices cross into Python as int64).
pub(crate) fn as_i64(x: usize) -> i64 {
    i64::try_from(x).unwrap_or(i64::MAX)
}

/// The page of a slot index already checked to be in range.
pub(crate) fn page_of_slot(slot: i64, page_size: usize) -> u32 {
    index_u32(usize::try_from(slot).unwrap_or(usize::MAX) / page_size)
}

/// Converts an index that is known to fit in 32 bits (pools are capped at `u32::MAX`
/// slots; arenas and tables hold fewer entries than that).
pub(crate) fn index_u32(i: usize) -> u32 {
    u32::try_from(i).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(slots: usize, ps: usize) -> Pool {
        Pool::new("kv_slots", slots, ps).unwrap()
    }

    #[test]
    fn rejects_bad_configuration() {
        assert!(matches!(
            Pool::new("kv_slots", 10, 4),
            Err(Error::InvalidArgument {
                arg: "kv_slots",
                ..
            })
        ));
        assert!(matches!(
            Pool::new("kv_slots", 8, 0),
            Err(Error::InvalidArgument {
                arg: "page_size",
                ..
            })
        ));
    }

    #[test]
    fn a_pool_costs_memory_for_the_pages_it_used_not_for_its_size() {
        // 2**32 - 1 slots would need 36 GiB of books up front; none is allocated.
        let p = pool(u32::MAX as usize, 1);
        assert_eq!(p.free_pages(), u32::MAX as usize);
        let a = p.try_alloc(3).unwrap();
        assert_eq!(a.pages(), &[0, 1, 2]);
        assert_eq!(p.shared.inner.lock().state.len(), 3);
        assert_eq!(p.state(u32::MAX - 1), Some(PageState::Free));
        assert_eq!(p.state(u32::MAX), None);
        drop(a);
        // Given back pages are handed out again first, most recent first.
        let b = p.try_alloc(4).unwrap();
        assert_eq!(b.pages(), &[2, 1, 0, 3]);
        drop(b);
        assert_eq!(p.counts().free, u32::MAX as usize);
    }

    #[test]
    fn alloc_hands_out_ascending_pages_and_drop_returns_them() {
        let p = pool(16, 4);
        let a = p.try_alloc(3).unwrap();
        assert_eq!(a.pages(), &[0, 1, 2]);
        assert_eq!(p.free_pages(), 1);
        assert!(p.try_alloc(2).is_none(), "not enough pages: nothing taken");
        assert_eq!(p.free_pages(), 1);
        drop(a);
        assert_eq!(p.free_pages(), 4);
        assert_eq!(p.audit().unwrap().free, 4);
    }

    #[test]
    fn accounting_free_plus_held_equals_capacity() {
        let p = pool(32, 1);
        let a = p.try_alloc(5).unwrap();
        let b = p.try_alloc(7).unwrap().into_caller();
        let c = p.counts();
        assert_eq!(c.free + c.owned + c.caller + c.tree, 32);
        assert_eq!((c.owned, c.caller), (5, 7));
        drop(a);
        p.free_caller(&b, "indices").unwrap();
        assert_eq!(p.counts().free, 32);
    }

    #[test]
    fn double_free_and_foreign_free_change_nothing() {
        let p = pool(8, 1);
        let held = p.try_alloc(2).unwrap().into_caller();
        p.free_caller(&held, "indices").unwrap();
        let before = p.counts();
        let err = p.free_caller(&held, "indices").unwrap_err();
        assert!(err.to_string().contains("not allocated"), "{err}");
        assert_eq!(p.counts(), before);
        let out = p.free_caller(&[99], "indices").unwrap_err();
        assert!(out.to_string().contains("out of range"), "{out}");
        // A call naming one good and one bad page frees neither.
        let good = p.try_alloc(1).unwrap().into_caller();
        let before = p.counts();
        assert!(p.free_caller(&[good[0], 7], "indices").is_err());
        assert_eq!(p.counts(), before);
        p.audit().unwrap();
    }

    #[test]
    fn claim_rolls_back_on_error() {
        let p = pool(8, 1);
        let held = p.try_alloc(3).unwrap().into_caller();
        let before = p.counts();
        let err = p
            .claim_caller(&[held[0], held[1], held[0]], "kv_indices")
            .unwrap_err();
        assert!(err.to_string().contains("listed twice"), "{err}");
        assert_eq!(p.counts(), before);
        let claimed = p.claim_caller(&held, "kv_indices").unwrap();
        assert_eq!(p.counts().owned, 3);
        drop(claimed);
        assert_eq!(p.counts().free, 8);
    }

    #[test]
    fn panic_inside_a_scope_returns_pages() {
        let p = pool(8, 1);
        let p2 = p.clone();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            let _held = p2.try_alloc(4).unwrap();
            panic!("boom");
        }));
        assert!(r.is_err());
        assert_eq!(p.free_pages(), 8);
        p.audit().unwrap();
    }

    #[test]
    fn a_run_hands_out_pages_front_to_back_and_returns_the_rest_when_dropped() {
        let p = pool(8, 1);
        let mut run = p.try_alloc(6).unwrap().into_run();
        let a = run.take(2);
        let b = run.take(1);
        assert_eq!(
            (a.pages(), b.pages(), run.pages()),
            (&[0, 1][..], &[2][..], &[3, 4, 5][..])
        );
        drop(run);
        assert_eq!(p.counts().owned, 3, "the three pages not taken went back");
        let mut run = p.try_alloc(5).unwrap().into_run();
        let c = run.take(10);
        assert_eq!((c.len(), run.pages().len()), (5, 0), "as many as are left");
        drop((a, b, c, run));
        assert_eq!(p.counts().free, 8);
        p.audit().unwrap();
    }

    /// The fault a pool recorded, after checking that audit reports it too.
    fn fault_of(p: &Pool) -> String {
        let why = p.fault().expect("an illegal transition is recorded");
        assert!(
            matches!(p.audit(), Err(Error::Invariant(w)) if w == why),
            "audit reports the fault"
        );
        why
    }

    /// Pages `pages` of `p`, as a value the pool never handed out (what a bug would hold).
    fn forged(p: &Pool, pages: &[u32]) -> Pages {
        Pages {
            pool: p.clone(),
            pages: pages.to_vec(),
        }
    }

    #[test]
    fn publishing_pages_that_are_not_owned_moves_nothing_and_records_the_fault() {
        let p = pool(8, 1);
        let held = p.try_alloc(2).unwrap();
        let caller = p.try_alloc(1).unwrap().into_caller();
        let before = p.counts();
        // An owned page, then the caller's: the first is moved back, nothing changes.
        let pages = forged(&p, &[held.pages()[0], caller[0]]).into_tree();
        assert_eq!(pages.len(), 2);
        assert_eq!(p.counts(), before);
        assert_eq!(p.state(held.pages()[0]), Some(PageState::Owned));
        assert!(fault_of(&p).contains("page 2 is Caller, not Owned"));
        // A page never handed out, and a page listed twice.
        let q = pool(8, 1);
        let _ = forged(&q, &[7]).into_caller();
        assert!(fault_of(&q).contains("page 7 (Owned to Caller) was never handed out"));
        let r = pool(8, 1);
        let one = r.try_alloc(1).unwrap();
        let before = r.counts();
        let _ = forged(&r, &[one.pages()[0], one.pages()[0]]).into_tree();
        assert_eq!(r.counts(), before);
        assert_eq!(
            r.state(0),
            Some(PageState::Owned),
            "the first mention moved back"
        );
        assert!(fault_of(&r).contains("page 0 is Tree, not Owned"));
        drop(one);
        assert_eq!(r.counts().free, 8);
        drop(held);
    }

    #[test]
    fn freeing_pages_in_another_state_frees_only_the_legal_ones_and_records_the_fault() {
        let p = pool(8, 1);
        let tree = p.try_alloc(2).unwrap().into_tree();
        let owned = p.try_alloc(1).unwrap();
        // The tree gives back its pages and, by mistake, a page a request holds.
        p.release_tree(&[tree[0], owned.pages()[0], tree[1]]);
        let counts = p.counts();
        assert_eq!((counts.free, counts.owned, counts.tree), (7, 1, 0));
        assert!(fault_of(&p).contains("page 2 is Owned, not Tree"));
        // A double free leaves the free list as it was (each page on it once).
        let twice = pool(8, 1);
        let freed = twice.try_alloc(1).unwrap().into_tree();
        twice.release_tree(&freed);
        twice.release_tree(&freed);
        assert_eq!(twice.shared.inner.lock().free, vec![0]);
        assert!(fault_of(&twice).contains("page 0 is Free, not Tree"));
        // Owned pages listed twice, dropped: the page is freed once.
        let listed = pool(8, 1);
        let page = listed.try_alloc(1).unwrap().into_caller()[0];
        drop(listed.claim_caller(&[page], "indices").map(|mut a| {
            a.pages.push(page);
            a
        }));
        assert_eq!(listed.shared.inner.lock().free, vec![0]);
        assert!(fault_of(&listed).contains("page 0 is Free, not Owned"));
        // Out of the books.
        let out = pool(8, 1);
        out.release_tree(&[99]);
        assert!(fault_of(&out).contains("page 99 (Tree to Free) was never handed out"));
        drop(owned);
    }

    #[test]
    fn pinning_a_free_page_pins_nothing_and_records_the_fault() {
        let p = pool(8, 1);
        let tree = p.try_alloc(1).unwrap().into_tree();
        p.release_tree(&tree);
        p.pin(&[0, 5]);
        assert_eq!((p.pins(0), p.pins(5)), (0, 0));
        assert!(fault_of(&p).contains("page 0 is pinned but free"));
    }

    #[test]
    fn an_unpin_without_a_pin_changes_nothing_and_records_the_fault() {
        let p = pool(8, 1);
        let tree = p.try_alloc(1).unwrap().into_tree();
        p.pin(&tree);
        p.release_tree(&tree);
        assert_eq!(p.state(0), Some(PageState::Draining));
        p.unpin(&tree);
        assert_eq!(p.state(0), Some(PageState::Free));
        assert!(p.fault().is_none(), "one pin, one unpin: legal");
        // The double unpin: before, `saturating_sub` let it pass in release builds.
        p.unpin(&tree);
        assert_eq!((p.state(0), p.pins(0)), (Some(PageState::Free), 0));
        assert_eq!(p.shared.inner.lock().free, vec![0], "freed once");
        assert!(fault_of(&p).contains("page 0 is unpinned more often than it was pinned"));
        // A page never handed out.
        let q = pool(8, 1);
        q.unpin(&[3]);
        assert!(fault_of(&q).contains("page 3 is unpinned"));
    }

    #[test]
    fn appending_pages_of_another_pool_records_the_fault_and_leaves_them_to_their_pool() {
        let p = pool(8, 1);
        let other = pool(8, 1);
        let mut a = p.try_alloc(1).unwrap();
        a.append(other.try_alloc(2).unwrap());
        assert_eq!(a.pages(), &[0]);
        assert_eq!(other.counts().free, 8, "the other pool's pages went home");
        assert!(fault_of(&p).contains("page 0 of another pool"));
        drop(a);
        assert_eq!(p.counts().free, 8);
    }

    #[test]
    fn a_free_list_holding_a_page_in_use_hands_out_nothing_and_records_the_fault() {
        let p = pool(8, 1);
        let held = p.try_alloc(1).unwrap();
        p.shared.inner.lock().free.push(held.pages()[0]);
        assert!(p.try_alloc(1).is_none());
        assert_eq!(p.counts().owned, 1);
        assert!(p.fault().unwrap().contains("page 0 is Owned, not Free"));
        std::mem::forget(held);
    }

    #[test]
    fn the_pools_of_a_cache_share_one_fault_record_and_the_first_fault_is_kept() {
        let fault = Arc::<Fault>::default();
        let kv = Pool::with_fault("kv_slots", 8, 1, fault.clone(), PoolOwner::Cache).unwrap();
        let states = Pool::with_fault("mamba_slots", 8, 1, fault, PoolOwner::Cache).unwrap();
        states.unpin(&[1]);
        kv.unpin(&[2]);
        let why = kv.fault().unwrap();
        assert!(
            why.contains("illegal page transition in mamba_slots: page 1"),
            "{why}"
        );
        assert_eq!(states.fault(), Some(why));
    }

    fn engine_pool(slots: usize, ps: usize) -> Pool {
        Pool::with_fault("kv_slots", slots, ps, Arc::default(), PoolOwner::Engine).unwrap()
    }

    #[test]
    fn an_engine_owned_pool_starts_as_the_engines_and_keeps_books_only_for_pages_claimed() {
        let p = engine_pool(u32::MAX as usize, 1);
        assert!(p.engine_owned());
        assert_eq!(p.counts().caller, u32::MAX as usize);
        assert_eq!(p.state(7), Some(PageState::Caller));
        // Claiming page 5 covers the books up to it; the pages below stay the engine's.
        let claimed = p.claim_caller(&[5], "kv_indices").unwrap();
        assert_eq!(p.shared.inner.lock().state.len(), 6);
        assert_eq!(
            (p.state(4), p.state(5)),
            (Some(PageState::Caller), Some(PageState::Owned))
        );
        assert!(
            p.try_alloc(1).is_none(),
            "nothing is free to allocate: the queue is empty"
        );
        drop(claimed);
        assert_eq!(
            p.state(5),
            Some(PageState::Free),
            "dropped: queued for the engine"
        );
        assert_eq!((p.counts().free, p.queued_len()), (1, 1));
        p.audit().unwrap();
    }

    #[test]
    fn take_queued_hands_the_queue_from_a_mark_back_to_the_engine_once() {
        let p = engine_pool(16, 4);
        let tree = p
            .claim_caller(&[0, 1, 2], "kv_indices")
            .unwrap()
            .into_tree();
        p.release_tree(&tree[..1]);
        let mark = p.queued_len();
        p.release_tree(&tree[1..]);
        assert_eq!(
            p.take_queued(mark),
            vec![1, 2],
            "only what joined after the mark"
        );
        assert_eq!(p.take_queued(0), vec![0]);
        assert!(p.take_queued(0).is_empty());
        assert_eq!(p.counts().caller, 4);
        p.audit().unwrap();
    }

    #[test]
    fn a_pinned_page_the_tree_gives_up_joins_the_queue_when_its_last_pin_goes() {
        let p = engine_pool(8, 1);
        let tree = p.claim_caller(&[3], "kv_indices").unwrap().into_tree();
        p.pin(&tree);
        p.release_tree(&tree);
        assert_eq!(p.state(3), Some(PageState::Draining));
        assert!(p.take_queued(0).is_empty(), "not queued while pinned");
        p.unpin(&tree);
        assert_eq!(p.take_queued(0), vec![3]);
        assert_eq!(p.state(3), Some(PageState::Caller));
        p.audit().unwrap();
    }

    #[test]
    fn claiming_a_queued_or_tree_page_of_an_engine_pool_says_whose_it_is() {
        let p = engine_pool(16, 4);
        let tree = p.claim_caller(&[0, 1], "kv_indices").unwrap().into_tree();
        p.release_tree(&tree[1..]);
        let before = p.counts();
        let queued = p.claim_caller(&[2, 1], "kv_indices").unwrap_err();
        assert!(
            queued
                .to_string()
                .contains("page 1 (slots 4..8) is queued to go back to the engine"),
            "{queued}"
        );
        let in_tree = p.claim_caller(&[0], "kv_indices").unwrap_err();
        assert!(
            in_tree.to_string().contains("in the cache's tree"),
            "{in_tree}"
        );
        assert_eq!(p.counts(), before);
        assert_eq!(
            p.state(2),
            Some(PageState::Caller),
            "the claim was rolled back"
        );
        p.audit().unwrap();
    }

    #[test]
    fn a_queue_holding_a_page_in_use_hands_back_nothing_and_records_the_fault() {
        let p = engine_pool(8, 1);
        let held = p.claim_caller(&[2], "kv_indices").unwrap();
        p.shared.inner.lock().free.push(2);
        assert!(p.take_queued(0).is_empty());
        assert_eq!(p.state(2), Some(PageState::Owned));
        assert!(p.fault().unwrap().contains("page 2 is Owned, not Free"));
        std::mem::forget(held);
    }

    #[test]
    fn split_and_append_keep_ownership_exact() {
        let p = pool(8, 1);
        let mut a = p.try_alloc(6).unwrap();
        let b = a.split_off(2);
        assert_eq!((a.len(), b.len()), (2, 4));
        drop(b);
        assert_eq!(p.free_pages(), 6);
        let c = p.try_alloc(1).unwrap();
        a.append(c);
        assert_eq!(a.len(), 3);
        let tree = a.into_tree();
        assert_eq!(p.counts().tree, 3);
        p.release_tree(&tree);
        assert_eq!(p.free_pages(), 8);
    }
}
