//! The SWA pages paired with a pool's pages (a KV pool of a model with SWA layers): the
//! pool's methods that pair them, move them with their tokens, free them and check them.
//! The pairing's books are [`Companion`], kept with the pool's own.

use super::books::{Companion, NO_PAGE};
use super::index::index_u32;
use super::state::PageState;
use super::Pool;

impl Pool {
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
}
