//! [`Pages`], the owned value every allocation returns, and [`PageRun`], owned pages
//! handed out in runs. The pool hands them out ([`Pool::try_alloc`], [`Pool::empty`],
//! [`Pool::claim_caller`]); each ends in exactly one way: published into the tree
//! ([`Pages::into_tree`]), handed to a caller as raw page numbers
//! ([`Pages::into_caller`]), or dropped, which returns its pages to the pool.

use std::fmt;

use crate::error::{Error, Result};

use super::fault::Illegal;
use super::index::index_u32;
use super::state::PageState;
use super::Pool;

impl Pool {
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
}

/// Pages owned by a value: published into the tree, handed to a caller, or returned to
/// the pool when dropped.
#[must_use = "dropping Pages returns them to the pool at once"]
#[clippy::has_significant_drop]
pub struct Pages {
    pub(super) pool: Pool,
    pub(super) pages: Vec<u32>,
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
