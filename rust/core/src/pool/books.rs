//! The books of a pool ([`PoolInner`]): the state and pins of every page used, the
//! free list, the counts per state, and the pairing of SWA pages with the pool's pages
//! ([`Companion`]). Every move of a page between states is one method here, checked
//! against the state the page is in.

use crate::error::{Error, Result};

use super::fault::{Checked, Illegal};
use super::state::{PageState, PoolCounts};

/// The books of a pool. They cover only the pages handed out at least once (`state` and
/// `pins` have one entry per such page): the pages from there on have never been used
/// and are in the pool's first state (free; the engine's when the engine owns the
/// slots), so a pool costs memory in proportion to its high-water mark, not to its size
/// (a pool of 2**32 - 1 slots is made at once and costs nothing until used).
pub(super) struct PoolInner {
    /// The state of a page never used ([`PageState::Free`], or [`PageState::Caller`]
    /// when the engine owns the slots).
    pub(super) untouched: PageState,
    /// Pages given back, handed out again first (a stack: O(1) per page).
    pub(super) free: Vec<u32>,
    /// Per page handed out at least once (`state.len()` pages): its state.
    pub(super) state: Vec<PageState>,
    /// Per such page, the transfers that may read or write it. A pinned page never
    /// reaches the free list: freeing it only marks it `Draining`.
    pub(super) pins: Vec<u32>,
    pub(super) counts: PoolCounts,
    /// The SWA pages paired with this pool's pages (a KV pool of a model with SWA
    /// layers), or `None`.
    pub(super) companion: Option<Companion>,
}

/// A second pool whose pages are paired with the first's: the sliding-window attention
/// KV of a model with SWA layers. A KV page holds at most one SWA page (its tokens' SWA
/// KV); the SWA page follows its KV page wherever it goes (a request, the tree, a
/// caller) and is freed at the latest with it, or earlier by [`Pool::detach_companion`]
/// (its tokens left every window). So every SWA page is free or paired with exactly one
/// KV page that is not free: nothing else can be written down.
///
/// [`Pool::detach_companion`]: super::Pool::detach_companion
pub(super) struct Companion {
    /// The argument that configured it (`"swa_slots"`, `"host_swa_slots"`), for audit.
    pub(super) name: &'static str,
    /// Free SWA pages (a stack).
    pub(super) free: Vec<u32>,
    /// Per KV page, its SWA page or [`NO_PAGE`].
    pub(super) of: Vec<u32>,
    /// SWA pages in all.
    pub(super) pages: usize,
}

/// No companion page.
pub(super) const NO_PAGE: u32 = u32::MAX;

impl Companion {
    /// Frees KV page `p`'s SWA page, if it has one; true when it had.
    pub(super) fn detach(&mut self, p: u32) -> bool {
        match self.of.get_mut(p as usize) {
            Some(c) if *c != NO_PAGE => {
                self.free.push(std::mem::replace(c, NO_PAGE));
                true
            }
            _ => false,
        }
    }

    /// Whether KV page `p` has an SWA page.
    pub(super) fn attached(&self, p: u32) -> bool {
        self.of.get(p as usize).is_some_and(|&c| c != NO_PAGE)
    }
}

impl PoolInner {
    /// Page `p` reached the free list: its SWA page goes too. Inlined, like
    /// [`PoolInner::free_one`]: it runs once per page freed.
    #[inline]
    pub(super) fn freed(&mut self, p: u32) {
        self.free.push(p);
        if let Some(c) = self.companion.as_mut() {
            c.detach(p);
        }
    }

    /// Pages handed out at least once (the first never-used page).
    pub(super) fn used(&self) -> usize {
        self.state.len()
    }

    /// The state of page `p` of a pool of `pages` pages (`None` when out of range).
    pub(super) fn get(&self, p: u32, pages: usize) -> Option<PageState> {
        let i = p as usize;
        match self.state.get(i) {
            Some(&s) => Some(s),
            None if i < pages => Some(self.untouched),
            None => None,
        }
    }

    /// Extends the books to cover page `p` (in range, checked by the caller): the pages
    /// added are in their first state. False when memory for them cannot be had.
    pub(super) fn cover(&mut self, p: u32) -> bool {
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
    pub(super) fn set(&mut self, page: u32, from: PageState, to: PageState) {
        if let Some(s) = self.state.get_mut(page as usize) {
            *s = to;
            *self.counts.slot(from) -= 1;
            *self.counts.slot(to) += 1;
        }
    }

    /// Moves pages that are all in state `from` to `to`, updating the counts once. A page
    /// in another state (or out of the books, or listed twice) is an illegal transition:
    /// then nothing moves, and the error describes the page.
    pub(super) fn move_all(&mut self, pages: &[u32], from: PageState, to: PageState) -> Checked {
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
    pub(super) fn free_all(&mut self, pages: &[u32], from: PageState) -> Checked {
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
    pub(super) fn free_one(&mut self, p: u32, from: PageState) {
        if self.pins.get(p as usize).is_some_and(|&pins| pins > 0) {
            self.set(p, from, PageState::Draining);
        } else {
            self.set(p, from, PageState::Free);
            self.freed(p);
        }
    }

    /// Checks the SWA pairing: every SWA page is free (once) or paired with exactly one
    /// page that is not free, and a free page has no SWA page.
    pub(super) fn audit_companion(&self) -> Result<()> {
        let Some(c) = self.companion.as_ref() else {
            return Ok(());
        };
        let name = c.name;
        let mut seen = vec![false; c.pages];
        for (p, &s) in c.of.iter().enumerate() {
            if s == NO_PAGE {
                continue;
            }
            let state = self.state.get(p).copied().unwrap_or(self.untouched);
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
}
