//! The full-attention component: a KV entry per token, every token attending to all
//! before it. Its data is the tree's pages themselves (`Node.kv`, device and host), which
//! the shared machinery handles for every model (the path lock, `publish`, eviction of
//! leaves, backups and load-backs of pages), so its hooks have nothing of their own to do.

use crate::error::Result;

use super::{Cache, Component, Model, Parts};

/// Full-attention KV: the tree's pages themselves.
pub(crate) struct FullAttention;

impl Component for FullAttention {
    type Walk = ();

    /// Every model has it.
    #[inline]
    fn active(_: Model) -> bool {
        true
    }

    #[inline]
    fn cut(_: &Cache, (): &mut (), _: u32, _: usize, on_device: bool) -> bool {
        on_device
    }

    #[inline]
    fn cut_any_tier(_: &Cache, (): &mut (), _: u32, _: usize) -> bool {
        true
    }

    /// A split's upper part takes the node's first pages and their tier.
    fn cut_inside(
        _: &Cache,
        (): &mut (),
        _: u32,
        _: usize,
        _: usize,
        on_device: bool,
    ) -> (bool, bool) {
        (on_device, true)
    }

    /// The path lock is the shared part of every lock ([`Cache::lock_index`]).
    #[inline]
    fn lock(_: &mut Parts, _: u32, _: bool) -> bool {
        false
    }

    #[inline]
    fn release(_: &mut Parts, _: u32, _: bool) {}

    /// A split shares the KV pages between the parts ([`crate::tree::Tree::split`]).
    #[inline]
    fn split(_: &mut Parts, _: u32, _: u32) {}

    /// Pages, path locks and the eviction sets are checked for every node (`audit.rs`).
    fn audit(_: &Cache) -> Result<()> {
        Ok(())
    }
}
