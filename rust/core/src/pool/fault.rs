//! Illegal page transitions: what a change the books do not allow is ([`Illegal`]),
//! and where the first one is recorded ([`Fault`], shared by the pools of one cache) so
//! that the cache reports itself broken instead of serving slots the books no longer
//! describe.

use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;

use super::state::PageState;

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
    pub(super) fn record(&self, why: String) {
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
    pub(super) fn get(&self) -> Option<String> {
        if !self.set.load(Ordering::Acquire) {
            return None;
        }
        self.why.lock().clone()
    }
}

/// Whether a change was legal (`Err`: not made, and why).
pub(super) type Checked = std::result::Result<(), Illegal>;

/// A change of a page that the books do not allow (a bug of radixcache).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Illegal {
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
    pub(super) fn describe(self, pool: &str) -> String {
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
