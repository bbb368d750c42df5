//! The eviction sets and the logical clock: which nodes eviction may take, oldest first.
//!
//! [`Lru`] owns the three sets and each node's membership marks (`kv.in_lru`,
//! `mamba.in_lru`, `kv.in_host_lru`); everyone else asks it to [`Lru::refresh`] a node
//! after changing what the node is, and it decides. Keys are `(last access, index)`, so
//! the first entry is the least recently used.

use std::collections::BTreeSet;

use crate::tree::Tree;

/// Eviction candidates by `(last access, node index)`: the first is the oldest.
pub(crate) type LruSet = BTreeSet<(u64, u32)>;

/// The eviction candidates of each component, by last access.
#[derive(Default)]
pub(crate) struct Lru {
    /// Unlocked device leaves whose state (if any) is unlocked too.
    kv: LruSet,
    /// Unlocked device states that no transfer pins (evicting a pinned one would only
    /// leave its slot draining).
    mamba: LruSet,
    /// Unlocked host-only leaves.
    host: LruSet,
    /// Those of `host` that hold a host state (where a host state slot can be had).
    host_states: LruSet,
    clock: u64,
}

impl Lru {
    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Marks node `i` as accessed now, keeping its place in the sets right.
    pub fn touch(&mut self, tree: &mut Tree, i: u32) {
        let now = self.tick();
        let n = tree.node_mut(i);
        let old = std::mem::replace(&mut n.last_access, now);
        if n.kv.in_lru {
            self.kv.remove(&(old, i));
            self.kv.insert((now, i));
        }
        if n.kv.in_host_lru {
            self.host.remove(&(old, i));
            self.host.insert((now, i));
            if n.mamba.host.is_some() {
                self.host_states.remove(&(old, i));
                self.host_states.insert((now, i));
            }
        }
    }

    /// Marks node `i`'s state as used now (only the state a match actually uses).
    pub fn touch_state(&mut self, tree: &mut Tree, i: u32) {
        let now = self.tick();
        let n = tree.node_mut(i);
        let old = std::mem::replace(&mut n.mamba.last_access, now);
        if n.mamba.in_lru {
            self.mamba.remove(&(old, i));
            self.mamba.insert((now, i));
        }
    }

    /// Puts node `i` in or out of each set according to what it is now.
    ///
    /// KV: an unlocked device leaf (or a leaf to be: every device child is being
    /// evicted) whose state (if any) is unlocked too, since evicting the leaf's KV takes
    /// its state with it, and that is neither being evicted nor backed up (KV or state)
    /// already. Mamba: a device state, unlocked, that no transfer pins. Host: an unlocked host-only leaf (and, in the host-state set, one
    /// holding a host state).
    pub fn refresh(&mut self, tree: &mut Tree, i: u32) {
        let n = tree.node(i);
        let host = !n.is_root()
            && n.kv.device.is_none()
            && n.kv.host.is_some()
            && n.kv.lock == 0
            && n.children.is_empty();
        let kv = !n.is_root()
            && n.kv.device.is_some()
            && n.kv.lock == 0
            && n.mamba.lock == 0
            && !n.kv.evicting
            && !n.kv.backup_pending
            && !n.mamba.backup_pending
            && n.device_children == n.evicting_children;
        let mamba = n.mamba.device.is_some() && n.mamba.lock == 0 && !n.mamba.pinned;
        let host_state = host && n.mamba.host.is_some();
        let (key, state_key) = ((n.last_access, i), (n.mamba.last_access, i));
        set_membership(&mut self.kv, key, n.kv.in_lru, kv);
        set_membership(&mut self.mamba, state_key, n.mamba.in_lru, mamba);
        let host_state_was = n.kv.in_host_lru && self.host_states.contains(&key);
        set_membership(&mut self.host, key, n.kv.in_host_lru, host);
        set_membership(&mut self.host_states, key, host_state_was, host_state);
        let n = tree.node_mut(i);
        n.kv.in_lru = kv;
        n.mamba.in_lru = mamba;
        n.kv.in_host_lru = host;
    }

    /// Takes node `i` out of the KV set (it is being evicted).
    pub fn unlist_kv(&mut self, tree: &mut Tree, i: u32) {
        let n = tree.node_mut(i);
        if std::mem::take(&mut n.kv.in_lru) {
            self.kv.remove(&(n.last_access, i));
        }
    }

    /// Takes node `i` out of the state set (its state is being evicted).
    pub fn unlist_state(&mut self, tree: &mut Tree, i: u32) {
        let n = tree.node_mut(i);
        if std::mem::take(&mut n.mamba.in_lru) {
            self.mamba.remove(&(n.mamba.last_access, i));
        }
    }

    /// Takes node `i` out of the host set (its host copy is being dropped).
    pub fn unlist_host(&mut self, tree: &mut Tree, i: u32) {
        let n = tree.node_mut(i);
        if std::mem::take(&mut n.kv.in_host_lru) {
            self.host.remove(&(n.last_access, i));
            self.host_states.remove(&(n.last_access, i));
        }
    }

    /// The least recently used KV candidate, taken out of the set.
    pub fn pop_kv(&mut self, tree: &mut Tree) -> Option<u32> {
        let (_, i) = self.kv.pop_first()?;
        tree.node_mut(i).kv.in_lru = false;
        Some(i)
    }

    /// The least recently used state candidate, taken out of the set.
    pub fn pop_state(&mut self, tree: &mut Tree) -> Option<u32> {
        let (_, i) = self.mamba.pop_first()?;
        tree.node_mut(i).mamba.in_lru = false;
        Some(i)
    }

    /// The least recently used host candidate (left in the set).
    pub fn first_host(&self) -> Option<u32> {
        self.host.first().map(|&(_, i)| i)
    }

    /// The least recently used state candidate (left in the set).
    pub fn first_state(&self) -> Option<u32> {
        self.mamba.first().map(|&(_, i)| i)
    }

    /// State candidates.
    pub fn state_count(&self) -> usize {
        self.mamba.len()
    }

    /// The least recently used host candidate that holds a host state (left in the set).
    pub fn first_host_state(&self) -> Option<u32> {
        self.host_states.first().map(|&(_, i)| i)
    }

    /// The sets, for `audit()`: KV, states, host, host with a state.
    pub fn sets(&self) -> [&LruSet; 4] {
        [&self.kv, &self.mamba, &self.host, &self.host_states]
    }

    /// Drops the oldest KV candidate without updating its node (audit tests corrupt
    /// the books this way).
    #[cfg(test)]
    pub fn corrupt_kv(&mut self) {
        self.kv.pop_first();
    }
}

/// Adds or removes `key` when membership changes from `was` to `now`.
fn set_membership(set: &mut LruSet, key: (u64, u32), was: bool, now: bool) {
    if now && !was {
        set.insert(key);
    } else if was && !now {
        set.remove(&key);
    }
}
