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

/// Set in a state's `last_access` once a match has used the state (the time is in the
/// bits below). States are evicted in two segments: unused states first (a finished
/// request's end state, which often nobody resumes), then used ones (a shared prompt's
/// branch point), each least recently used first; so a stream of one-off states cannot
/// flush the states many requests reuse. While more than the protected cap of used
/// states are candidates, the oldest used one goes first instead, so that used states
/// nobody needs any more still age out. The bit orders used states after unused ones.
pub(crate) const HOT: u64 = 1 << 62;

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
    /// Entries of `mamba` for used states (keys with [`HOT`]).
    hot: usize,
    /// How many used states are protected (see [`HOT`]).
    hot_cap: usize,
}

impl Lru {
    /// Empty sets; up to `hot_cap` used states protected.
    pub fn new(hot_cap: usize) -> Lru {
        Lru {
            hot_cap,
            ..Lru::default()
        }
    }

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

    /// Marks node `i`'s state as accessed now: used by a match (`hit`), or just cached
    /// (unused again).
    pub fn touch_state(&mut self, tree: &mut Tree, i: u32, hit: bool) {
        let now = self.tick() | if hit { HOT } else { 0 };
        let n = tree.node_mut(i);
        let old = std::mem::replace(&mut n.mamba.last_access, now);
        if n.mamba.in_lru {
            self.remove_state((old, i));
            self.add_state((now, i));
        }
    }

    fn add_state(&mut self, key: (u64, u32)) {
        if self.mamba.insert(key) && key.0 & HOT != 0 {
            self.hot += 1;
        }
    }

    fn remove_state(&mut self, key: (u64, u32)) {
        if self.mamba.remove(&key) && key.0 & HOT != 0 {
            self.hot -= 1;
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
        let state_was = n.mamba.in_lru;
        let host_state_was = n.kv.in_host_lru && self.host_states.contains(&key);
        set_membership(&mut self.host, key, n.kv.in_host_lru, host);
        set_membership(&mut self.host_states, key, host_state_was, host_state);
        let n = tree.node_mut(i);
        n.kv.in_lru = kv;
        n.mamba.in_lru = mamba;
        n.kv.in_host_lru = host;
        if mamba && !state_was {
            self.add_state(state_key);
        } else if state_was && !mamba {
            self.remove_state(state_key);
        }
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
            let key = (n.mamba.last_access, i);
            self.remove_state(key);
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

    /// The next state to evict (see [`HOT`]), taken out of the set.
    pub fn pop_state(&mut self, tree: &mut Tree) -> Option<u32> {
        let key = self.state_victim()?;
        self.remove_state(key);
        tree.node_mut(key.1).mamba.in_lru = false;
        Some(key.1)
    }

    /// The next state to evict (see [`HOT`]): the oldest used state while more than the
    /// cap are candidates, else the oldest unused one, else the oldest used one.
    fn state_victim(&self) -> Option<(u64, u32)> {
        if self.hot > self.hot_cap {
            return self.mamba.range((HOT, 0)..).next().copied();
        }
        self.mamba.first().copied()
    }

    /// The least recently used host candidate (left in the set).
    pub fn first_host(&self) -> Option<u32> {
        self.host.first().map(|&(_, i)| i)
    }

    /// The next state to evict (left in the set).
    pub fn first_state(&self) -> Option<u32> {
        self.state_victim().map(|(_, i)| i)
    }

    /// State candidates.
    pub fn state_count(&self) -> usize {
        self.mamba.len()
    }

    /// The least recently used host candidate that holds a host state (left in the set).
    pub fn first_host_state(&self) -> Option<u32> {
        self.host_states.first().map(|&(_, i)| i)
    }

    /// Used states counted among the candidates: for `audit()`.
    pub fn hot(&self) -> usize {
        self.hot
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
