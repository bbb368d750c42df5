//! Token and state tallies of the tree (`evictable_size()`, `protected_size()`, the host
//! figures of `stats()`), kept as the sum of every node's [`Sizes::of`].
//!
//! One formula says what a node contributes; the cache keeps the tallies right by taking
//! a node's contribution out before it changes the node and putting it back after
//! ([`super::Cache::edit`]). `audit()` sums the same contributions over the tree from
//! scratch and compares.

use std::ops::{AddAssign, SubAssign};

use crate::tree::{Node, StateMark};

/// Tallies over nodes (or one node's contribution to them).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Sizes {
    /// Device KV tokens of unlocked nodes, neither being evicted nor backed up (KV or
    /// state) already.
    pub evictable_tokens: usize,
    /// Device KV tokens of locked nodes, and of nodes being evicted or backed up (held
    /// for their backups: data in flight counts as protected).
    pub protected_tokens: usize,
    /// Device states no receipt holds and no transfer pins.
    pub evictable_states: usize,
    /// Device states a receipt holds or a transfer pins (in flight counts as protected).
    pub protected_states: usize,
    /// Host KV tokens.
    pub host_tokens: usize,
    /// Host KV tokens of unlocked host-only nodes: what host eviction can reclaim (an
    /// unlocked host-only node has only unlocked host-only nodes below it).
    pub host_evictable: usize,
    /// Device KV tokens of nodes an eviction chose (write-back), freed once their
    /// backups land: room on its way (part of `protected_tokens`).
    pub evicting_tokens: usize,
}

impl Sizes {
    /// What node `n` contributes (nothing for a root).
    pub fn of(n: &Node) -> Sizes {
        let mut s = Sizes::default();
        if n.is_root() {
            return s;
        }
        let len = n.key.len();
        let locked = n.kv.lock > 0;
        if n.kv.device.is_some() {
            if locked
                || n.kv.state.evicting()
                || n.kv.state.backup_pending()
                || n.mamba.backup_pending
            {
                s.protected_tokens = len;
            } else {
                s.evictable_tokens = len;
            }
            if n.kv.state.evicting() {
                s.evicting_tokens = len;
            }
        }
        if n.kv.host.is_some() {
            s.host_tokens = len;
            if n.kv.device.is_none() && !locked {
                s.host_evictable = len;
            }
        }
        if n.mamba.device.is_some() {
            if n.mamba.lock > 0 || n.mamba.mark == StateMark::Pinned {
                s.protected_states = 1;
            } else {
                s.evictable_states = 1;
            }
        }
        s
    }

    /// Moves node `n`'s contribution as its KV lock count goes from 0 to 1 (`locked`) or
    /// from 1 to 0, everything else unchanged: what [`Sizes::of`] gives after the change
    /// less what it gave before, without computing either (a path's lock pays this per
    /// node). Debug builds check it against [`Sizes::of`] (`Cache::count_kv_lock`).
    #[inline]
    pub fn lock_changed(&mut self, n: &Node, locked: bool) {
        if n.is_root() {
            return;
        }
        let len = n.key.len();
        let (from, to) = if locked {
            (&mut self.evictable_tokens, &mut self.protected_tokens)
        } else {
            (&mut self.protected_tokens, &mut self.evictable_tokens)
        };
        if n.kv.device.is_some()
            && !(n.kv.state.evicting() || n.kv.state.backup_pending() || n.mamba.backup_pending)
        {
            *from -= len;
            *to += len;
        }
        if n.kv.host.is_some() && n.kv.device.is_none() {
            if locked {
                self.host_evictable -= len;
            } else {
                self.host_evictable += len;
            }
        }
    }

    /// Device KV tokens in the tree.
    pub fn device_tokens(&self) -> usize {
        self.evictable_tokens + self.protected_tokens
    }

    /// Device states in the tree.
    pub fn device_states(&self) -> usize {
        self.evictable_states + self.protected_states
    }
}

impl AddAssign for Sizes {
    fn add_assign(&mut self, o: Sizes) {
        self.evictable_tokens += o.evictable_tokens;
        self.protected_tokens += o.protected_tokens;
        self.evictable_states += o.evictable_states;
        self.protected_states += o.protected_states;
        self.host_tokens += o.host_tokens;
        self.host_evictable += o.host_evictable;
        self.evicting_tokens += o.evicting_tokens;
    }
}

impl SubAssign for Sizes {
    fn sub_assign(&mut self, o: Sizes) {
        self.evictable_tokens -= o.evictable_tokens;
        self.protected_tokens -= o.protected_tokens;
        self.evictable_states -= o.evictable_states;
        self.protected_states -= o.protected_states;
        self.host_tokens -= o.host_tokens;
        self.host_evictable -= o.host_evictable;
        self.evicting_tokens -= o.evicting_tokens;
    }
}
