//! A test-only component that holds nothing and checks that the shared machinery calls
//! its hooks in balance: every lock it is told of is released exactly once (at each
//! `audit()`, the locks it counts per node are the live receipts'), and every split it
//! is told of is a real one (the new upper part is the lower part's parent). It is also
//! the proof that a component is one file plus one line in [`super::components!`]'s
//! list: `cache/tests/components.rs` switches it on beside the others and runs random
//! operations under `audit()`.
//!
//! It is off unless switched on for the current thread ([`Balanced::switch_on`]), so the
//! rest of the tests run without it.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;

use crate::error::{Error, Result};

use super::{Component, Model};
use crate::cache::{Cache, Parts};

thread_local! {
    /// Whether the component is part of every model on this thread.
    static ON: Cell<bool> = const { Cell::new(false) };
    /// What its hooks were told on this thread.
    static BOOKS: RefCell<Books> = RefCell::default();
}

/// What the hooks were told.
#[derive(Default)]
struct Books {
    /// Locks taken and not yet released, by the node they end at.
    locks: BTreeMap<u32, usize>,
    /// Splits seen.
    splits: usize,
    /// The first unbalanced call, if any.
    wrong: Option<String>,
}

/// The test component.
pub(crate) struct Balanced;

/// Keeps [`Balanced`] switched on for the current thread until it drops.
#[must_use = "the component is switched off again when this drops"]
pub(crate) struct SwitchedOn(());

impl Drop for SwitchedOn {
    fn drop(&mut self) {
        ON.with(|on| on.set(false));
    }
}

impl Balanced {
    /// Switches the component on for caches on the current thread, with empty books
    /// (make the cache after: a cache's existing locks were never told to it).
    pub(crate) fn switch_on() -> SwitchedOn {
        BOOKS.with(|b| *b.borrow_mut() = Books::default());
        ON.with(|on| on.set(true));
        SwitchedOn(())
    }

    /// Splits seen since it was switched on.
    pub(crate) fn splits() -> usize {
        BOOKS.with(|b| b.borrow().splits)
    }

    /// Records the first unbalanced call.
    fn wrong(what: String) {
        BOOKS.with(|b| {
            b.borrow_mut().wrong.get_or_insert(what);
        });
    }
}

impl Component for Balanced {
    type Walk = ();

    fn active(_: Model) -> bool {
        ON.with(Cell::get)
    }

    fn cut(_: &Cache, (): &mut (), _: u32, _: usize, _: bool) -> bool {
        true
    }

    fn cut_any_tier(_: &Cache, (): &mut (), _: u32, _: usize) -> bool {
        true
    }

    fn cut_inside(_: &Cache, (): &mut (), _: u32, _: usize, _: usize, _: bool) -> (bool, bool) {
        (true, true)
    }

    fn lock(_: &mut Parts, i: u32, _: bool) -> bool {
        BOOKS.with(|b| *b.borrow_mut().locks.entry(i).or_default() += 1);
        false
    }

    fn release(_: &mut Parts, i: u32, _: bool) {
        let known = BOOKS.with(|b| {
            let mut b = b.borrow_mut();
            let Some(n) = b.locks.get_mut(&i) else {
                return false;
            };
            *n -= 1;
            if *n == 0 {
                b.locks.remove(&i);
            }
            true
        });
        if !known {
            Balanced::wrong(format!(
                "a lock ending at node {i} released but never taken"
            ));
        }
    }

    fn split(p: &mut Parts, upper: u32, lower: u32) {
        BOOKS.with(|b| b.borrow_mut().splits += 1);
        if p.tree.node(lower).parent != upper {
            Balanced::wrong(format!("split of {lower}: {upper} is not its upper part"));
        }
    }

    fn audit(c: &Cache) -> Result<()> {
        let mut live: BTreeMap<u32, usize> = BTreeMap::new();
        for held in c.locks().held() {
            *live.entry(held.node).or_default() += 1;
        }
        BOOKS.with(|b| {
            let b = b.borrow();
            if let Some(what) = &b.wrong {
                return Err(Error::Invariant(format!("balanced component: {what}")));
            }
            if b.locks != live {
                return Err(Error::Invariant(format!(
                    "balanced component: locks told {:?}, live receipts {live:?}",
                    b.locks
                )));
            }
            Ok(())
        })
    }
}
