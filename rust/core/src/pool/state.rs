//! The vocabulary of a pool's books: the [`PageState`] every page is in, and the
//! [`PoolCounts`] of pages per state that [`Pool::counts`](super::Pool::counts) reports
//! and `audit()` recomputes.

/// Where a page is. Exactly one state per page at every moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum PageState {
    /// On the free list (engine-owned pools: queued to go back to the engine).
    Free,
    /// Held by a live [`Pages`](super::Pages) value (a request, a guard, an operation in
    /// progress).
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

/// Page counts per state, as reported by [`Pool::counts`](super::Pool::counts).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolCounts {
    /// Pages on the free list.
    pub free: usize,
    /// Pages held by live [`Pages`](super::Pages) values.
    pub owned: usize,
    /// Pages held by callers as raw indices.
    pub caller: usize,
    /// Pages owned by the tree.
    pub tree: usize,
    /// Pages given back while pinned by a transfer, free once it ends.
    pub draining: usize,
}

impl PoolCounts {
    pub(super) fn slot(&mut self, state: PageState) -> &mut usize {
        match state {
            PageState::Free => &mut self.free,
            PageState::Owned => &mut self.owned,
            PageState::Caller => &mut self.caller,
            PageState::Tree => &mut self.tree,
            PageState::Draining => &mut self.draining,
        }
    }
}
