//! The eviction sets and the logical clock: which nodes eviction may take, in the order
//! each component's [`EvictionPolicy`] gives.
//!
//! [`Lru`] owns the four sets and each node's membership marks (the `Listed` and
//! `HostListed` states of [`KvState`], the `Listed` mark of [`StateMark`]); everyone else
//! asks it to [`Lru::refresh`] a node after changing what the node is, and it decides.
//! It lists only nodes that are out of flight (`Idle`), and leaves the others as they
//! are. An entry is `(key, node index)` and the first entry goes first ([`LruSet`]). The
//! key is what the policy computes from the node ([`Lru::kv_key`], [`Lru::state_key`]);
//! it is kept on the node while the node is listed, and everything a key is computed
//! from changes through here, which lists the node again under its new key. Each
//! policy's keys and its own rules are in the file named for it:
//!
//! | policy | file | KV, host and SWA key | state key |
//! |---|---|---|---|
//! | lru | `lru.rs` | (last access, 0) | (last use, [`HOT`] once used; 0) |
//! | lfu | `lfu.rs` | (matches, last access) | (matches of the state, last use) |
//! | priority | `priority.rs` | (priority, last access) | (the node's priority, last use) |
//! | state-value | `state_value.rs` | (not for KV or SWA) | (used?, aging level at last use + value; last use); superseded: (0, last use) |
//!
//! This file is the mechanism the policies share: the sets, the clock, listing and
//! unlisting ([`Lru::refresh`], `unlist_*`) and taking the next candidate (`pop_*`),
//! dispatching on the policy with a `match`. `lookahead.rs` holds the marks of
//! [`Lru::expect`] (what the waiting queue needs next), which every policy's order
//! passes over; `keys.rs` the key and set types.
//!
//! The SWA queue (`components/swa/evict.rs`) is not one of these sets: it keys its entries with
//! [`Lru::swa_key`] and, since those keys only grow, lets an entry lag behind its node
//! and puts it back in line when it comes up.

mod keys;
mod lfu;
mod lookahead;
mod lru;
pub(crate) mod on_node;
mod priority;
pub(crate) mod state_value;

use crate::config::{EvictionPolicies, EvictionPolicy};
use crate::tree::{KvState, Node, StateMark, Tree};

pub(crate) use keys::{Key, LruSet};
use lookahead::Lookahead;
pub(crate) use lookahead::{Waiting, WAITING_TAIL};
pub(crate) use lru::HOT;

/// The eviction candidates of each component, in each component's policy order.
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
    /// The used states among the entries of `mamba`, and how many are protected
    /// ("lru" only).
    hot: lru::Hot,
    policy: EvictionPolicies,
    /// The state-value aging levels.
    aging: state_value::Aging,
    /// The waiting requests [`Lru::expect`] was told of and the nodes it marked.
    lookahead: Lookahead,
}

impl Lru {
    /// Empty sets ordered by `policy`; under "lru" up to `hot_cap` used states
    /// protected.
    pub fn new(hot_cap: usize, policy: EvictionPolicies) -> Lru {
        Lru {
            hot: lru::Hot::new(hot_cap),
            policy,
            ..Lru::default()
        }
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// The key of node `n` in the KV and host sets under the KV policy.
    pub fn kv_key(&self, n: &Node) -> Key {
        node_key(self.policy.kv, n)
    }

    /// The key of node `n` in the SWA eviction queue under the SWA policy (`components/swa/evict.rs`):
    /// the KV keys, from the same node fields.
    pub fn swa_key(&self, n: &Node) -> Key {
        node_key(self.policy.swa, n)
    }

    /// The key of node `i`'s device state in the state set under the state policy.
    pub fn state_key(&self, tree: &Tree, i: u32) -> Key {
        let n = tree.node(i);
        match self.policy.mamba {
            EvictionPolicy::Lru => lru::state_key(&n.mamba),
            EvictionPolicy::Lfu => lfu::state_key(&n.mamba),
            EvictionPolicy::Priority => priority::state_key(n),
            EvictionPolicy::StateValue => state_value::state_key(tree, i),
        }
    }

    /// Marks node `i` as accessed now, keeping its place in the sets right; `hit`: by a
    /// match that uses it (counted in its matches).
    pub fn touch(&mut self, tree: &mut Tree, i: u32, hit: bool) {
        self.stamp(tree, i, hit);
        self.rekey_kv(tree, i);
    }

    /// [`Lru::touch`] without moving the node's set entries: for a node that leaves its
    /// sets next (an admission locks the path it matched), whose entries would move only
    /// to leave. They keep the key they were listed with until then; a node listed again
    /// later joins under the key its new access gives.
    pub fn stamp(&mut self, tree: &mut Tree, i: u32, hit: bool) {
        let now = self.tick();
        let n = tree.node_mut(i);
        n.last_access = now;
        if hit {
            n.matches += 1;
        }
    }

    /// Marks node `i`'s state as accessed now: used by a match (`hit`, counted in the
    /// state's matches; a superseded state is kept again), or just placed (unused, and
    /// nothing below it yet).
    pub fn touch_state(&mut self, tree: &mut Tree, i: u32, hit: bool) {
        self.stamp_state(tree, i, hit);
        self.rekey_state(tree, i);
    }

    /// [`Lru::touch_state`] without moving the state's entry: for a state that leaves
    /// the state set next (an admission locks it), as [`Lru::stamp`].
    pub fn stamp_state(&mut self, tree: &mut Tree, i: u32, hit: bool) {
        let now = self.tick() | if hit { HOT } else { 0 };
        let m = &mut tree.node_mut(i).mamba;
        m.last_access = now;
        if hit {
            m.hits += 1;
        }
        self.aging.stamped(m, hit);
    }

    /// Raises node `i`'s priority to `priority` (a request inserted or was admitted
    /// through it), keeping its places in the sets right.
    pub fn raise_priority(&mut self, tree: &mut Tree, i: u32, priority: i64) {
        if tree.node(i).priority >= priority {
            return;
        }
        tree.node_mut(i).priority = priority;
        self.rekey_kv(tree, i);
        if self.policy.mamba == EvictionPolicy::Priority {
            self.rekey_state(tree, i);
        }
    }

    /// After node `i` gained or lost its device state: under state-value, the states
    /// below it whose nearest state above changed (down to the next state on each
    /// branch) save a different amount of compute, and move.
    pub fn ancestor_state_changed(&mut self, tree: &mut Tree, i: u32) {
        if self.policy.mamba != EvictionPolicy::StateValue {
            return;
        }
        state_value::states_below(tree, i, |tree, c| self.rekey_state(tree, c));
    }

    /// After node `i` gained its device state: the states below it move (see
    /// [`Lru::ancestor_state_changed`]). Under state-value, the nearest state above it
    /// may be superseded by `i`, which then counts as used in its place (see
    /// `state_value::supersede`); both move.
    #[inline]
    pub fn state_placed(&mut self, tree: &mut Tree, i: u32) {
        self.ancestor_state_changed(tree, i);
        if self.policy.mamba != EvictionPolicy::StateValue {
            return;
        }
        if let Some(above) = state_value::supersede(tree, i, &self.aging) {
            self.rekey_state(tree, above);
            self.rekey_state(tree, i);
        }
    }

    /// After a load-back for a request restored node `i`'s state from the host: under
    /// state-value the state counts as used (the match that found it on the host used
    /// it, and the request resumes from it), at the used level, as a state a match used
    /// on the device would.
    pub fn state_restored(&mut self, tree: &mut Tree, i: u32) {
        if self.policy.mamba != EvictionPolicy::StateValue {
            return;
        }
        self.aging.resumed(&mut tree.node_mut(i).mamba);
        self.rekey_state(tree, i);
    }

    /// Lists node `i` in the KV and host sets it is in under its current key.
    fn rekey_kv(&mut self, tree: &mut Tree, i: u32) {
        let n = tree.node(i);
        if !n.kv.state.listed() {
            return;
        }
        let (old, new) = (n.lru_key, self.kv_key(n));
        let (in_kv, in_host) = (n.kv.state.in_lru(), n.kv.state.in_host_lru());
        tree.node_mut(i).lru_key = new;
        let entry = |k: Key| (k.0, k.1, i);
        if in_kv {
            self.kv.remove(&entry(old));
            self.kv.insert(entry(new));
        }
        if in_host {
            self.host.remove(&entry(old));
            self.host.insert(entry(new));
            if self.host_states.remove(&entry(old)) {
                self.host_states.insert(entry(new));
            }
        }
    }

    /// Lists node `i`'s state in the state set (if it is in it) under its current key.
    fn rekey_state(&mut self, tree: &mut Tree, i: u32) {
        let n = tree.node(i);
        if n.mamba.mark != StateMark::Listed {
            return;
        }
        let (old, new) = (n.mamba.policy.lru_key, self.state_key(tree, i));
        tree.node_mut(i).mamba.policy.lru_key = new;
        self.remove_state((old.0, old.1, i));
        self.add_state((new.0, new.1, i));
    }

    /// Adds a state set entry, counting it when it is a used state (see [`HOT`]).
    fn add_state(&mut self, entry: (u64, u64, u32)) {
        if self.mamba.insert(entry) && self.policy.mamba == EvictionPolicy::Lru {
            self.hot.joined(entry.0);
        }
    }

    /// Removes a state set entry, and its count when it is a used state.
    fn remove_state(&mut self, entry: (u64, u64, u32)) {
        if self.mamba.remove(&entry) && self.policy.mamba == EvictionPolicy::Lru {
            self.hot.left(entry.0);
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
        let mamba =
            n.mamba.device.is_some() && n.mamba.lock == 0 && n.mamba.mark != StateMark::Pinned;
        let state_was = n.mamba.mark == StateMark::Listed;
        // The usual cases, first and cheapest: a locked node (a path's node locked or
        // unlocked, the end of a path whose state a lock takes) is no KV or host
        // candidate: it leaves the set it was listed in (on its first lock), and only
        // its state may move besides.
        if n.kv.lock > 0 {
            match n.kv.state {
                KvState::Listed => self.unlist_kv(tree, i),
                KvState::HostListed => self.unlist_host(tree, i),
                _ => {}
            }
            self.move_state(tree, i, state_was, mamba);
            return;
        }
        let host = !n.is_root()
            && n.kv.device.is_none()
            && n.kv.host.is_some()
            && n.kv.lock == 0
            && n.children.is_empty();
        let kv = !n.is_root()
            && n.kv.device.is_some()
            && n.kv.lock == 0
            && n.mamba.lock == 0
            && !n.kv.state.evicting()
            && !n.kv.state.backup_pending()
            && !n.mamba.backup_pending
            && n.device_children == n.evicting_children;
        let host_state = host && n.mamba.host.is_some();
        let (kv_was, host_was) = (n.kv.state.in_lru(), n.kv.state.in_host_lru());
        // Nothing changes (the usual case on a path: an inner node locked or unlocked).
        // A host-listed node is looked at in full: its host state may have come or gone.
        if kv == kv_was && host == host_was && mamba == state_was && !host_was {
            return;
        }
        // Entries leave under the key they were listed with, and join under the key
        // the policy gives now (the same while the node stays listed, so the key is
        // computed only for a node that joins a set).
        let old = (n.lru_key.0, n.lru_key.1, i);
        let joins = (kv && !kv_was) || (host && !host_was);
        let new = if joins {
            let key = self.kv_key(n);
            (key.0, key.1, i)
        } else {
            old
        };
        let host_state_was = host_was && self.host_states.contains(&old);
        set_membership(&mut self.kv, &old, &new, kv_was, kv);
        set_membership(&mut self.host, &old, &new, host_was, host);
        set_membership(
            &mut self.host_states,
            &old,
            &new,
            host_state_was,
            host_state,
        );
        let n = tree.node_mut(i);
        if joins {
            n.lru_key = (new.0, new.1);
        }
        // A node in flight is neither a KV nor a host candidate (see `KvState`): only
        // a node out of flight changes sets here.
        debug_assert!(!(kv || host) || n.kv.state == KvState::Idle || n.kv.state.listed());
        if n.kv.state == KvState::Idle || n.kv.state.listed() {
            n.kv.state = if kv {
                KvState::Listed
            } else if host {
                KvState::HostListed
            } else {
                KvState::Idle
            };
        }
        self.move_state(tree, i, state_was, mamba);
    }

    /// Node `i`'s state joins the state set (`now`, not `was`) under the key the policy
    /// gives, or leaves it (`was`, not `now`); a pinned state keeps its mark.
    #[inline]
    fn move_state(&mut self, tree: &mut Tree, i: u32, was: bool, now: bool) {
        if now && !was {
            let key = self.state_key(tree, i);
            let m = &mut tree.node_mut(i).mamba;
            m.policy.lru_key = key;
            m.mark = StateMark::Listed;
            self.add_state((key.0, key.1, i));
        } else if was && !now {
            self.unlist_state(tree, i);
        }
    }

    /// Takes node `i` out of the KV set (it is being evicted).
    pub fn unlist_kv(&mut self, tree: &mut Tree, i: u32) {
        let n = tree.node_mut(i);
        if n.kv.state.in_lru() {
            n.kv.state = KvState::Idle;
            self.kv.remove(&(n.lru_key.0, n.lru_key.1, i));
        }
    }

    /// Takes node `i` out of the state set (its state is being evicted).
    pub fn unlist_state(&mut self, tree: &mut Tree, i: u32) {
        let n = tree.node_mut(i);
        if n.mamba.mark == StateMark::Listed {
            n.mamba.mark = StateMark::Idle;
            let key = n.mamba.policy.lru_key;
            self.remove_state((key.0, key.1, i));
        }
    }

    /// Takes node `i` out of the host set (its host copy is being dropped).
    pub fn unlist_host(&mut self, tree: &mut Tree, i: u32) {
        let n = tree.node_mut(i);
        if n.kv.state.in_host_lru() {
            n.kv.state = KvState::Idle;
            let entry = (n.lru_key.0, n.lru_key.1, i);
            self.host.remove(&entry);
            self.host_states.remove(&entry);
        }
    }

    /// The first KV candidate, taken out of the set: the first in policy order whose
    /// node no waiting request's match ends at ([`Lru::expect`]), else the one needed
    /// latest.
    pub fn pop_kv(&mut self, tree: &mut Tree) -> Option<u32> {
        let entry = if self.lookahead.any_marked() {
            let (entry, taken) = lookahead::unexpected(tree, self.kv.iter().copied())?;
            self.lookahead.took(taken);
            Some(entry)
        } else {
            self.kv.first().copied()
        }?;
        self.kv.remove(&entry);
        tree.node_mut(entry.2).kv.state = KvState::Idle;
        Some(entry.2)
    }

    /// Marks the node where the match of each request a scheduler will admit next
    /// ends (`waiting`, soonest first), clearing the marks of the last call: the
    /// eviction sets give out marked nodes last, the one needed latest first (Belady's
    /// rule over the waiting queue, `Cache::expect`). A node named twice keeps its
    /// sooner rank. Returns how many nodes are marked.
    pub fn expect(&mut self, tree: &mut Tree, waiting: Vec<Waiting>) -> usize {
        self.lookahead.expect(tree, waiting)
    }

    /// The rank (1 + position) of the soonest waiting request ([`Lru::expect`]) that a
    /// state at the end of node `i`, `depth` tokens deep, would serve: its prompt's
    /// cached KV passes through the whole node and no deeper state was on its path
    /// when it was told of. 0 when none would.
    pub fn rank_of(&self, tree: &Tree, i: u32, depth: usize) -> u32 {
        self.lookahead.rank_of(tree, i, depth)
    }

    /// Whether a new state of rank `rank` ([`Lru::rank_of`]; 0: no waiting request
    /// needs it) should not take a slot from the state eviction would give out next:
    /// that one is marked and needed sooner (Belady's rule lets the new one go by).
    pub fn bypasses(&self, tree: &Tree, rank: u32) -> bool {
        if !self.lookahead.any_marked() {
            return false;
        }
        match self.next_state(tree) {
            Some((entry, true)) => rank == 0 || rank > tree.node(entry.2).expected,
            _ => false,
        }
    }

    /// Marks node `i` with `rank` (a new state placed there that a waiting request
    /// needs), as [`Lru::expect`] would have.
    pub fn mark(&mut self, tree: &mut Tree, i: u32, rank: u32) {
        self.lookahead.mark(tree, i, rank);
    }

    /// Whether [`Lru::expect`] was told of waiting requests (its last call's).
    pub fn expecting(&self) -> bool {
        self.lookahead.expecting()
    }

    /// The nodes marked now: for `stats()` and `audit()`.
    pub fn expected(&self) -> impl Iterator<Item = u32> + '_ {
        self.lookahead.expected()
    }

    /// Evictions that took a marked node for want of an unmarked candidate.
    pub fn expected_taken(&self) -> u64 {
        self.lookahead.taken()
    }

    /// The next state to evict (see [`HOT`]), taken out of the set. Under state-value
    /// the aging level rises to its key.
    pub fn pop_state(&mut self, tree: &mut Tree) -> Option<u32> {
        let entry = self.state_victim(tree)?;
        self.remove_state(entry);
        if self.policy.mamba == EvictionPolicy::StateValue {
            self.aging.evicted(entry.0);
        }
        tree.node_mut(entry.2).mamba.mark = StateMark::Idle;
        Some(entry.2)
    }

    /// The next state to evict: the first entry, except under "lru" (see [`HOT`]): the
    /// oldest used state while more than the cap are candidates, else the oldest unused
    /// one, else the oldest used one. Marked states ([`Lru::expect`]) are passed over
    /// while any other is a candidate; of them, the one needed latest goes first.
    fn state_victim(&mut self, tree: &Tree) -> Option<(u64, u64, u32)> {
        let (entry, taken) = self.next_state(tree)?;
        self.lookahead.took(taken);
        Some(entry)
    }

    /// [`Lru::state_victim`], and whether it is marked.
    fn next_state(&self, tree: &Tree) -> Option<((u64, u64, u32), bool)> {
        let hot_first = self.policy.mamba == EvictionPolicy::Lru && self.hot.over_cap();
        if !self.lookahead.any_marked() {
            let entry = if hot_first {
                self.mamba.range((HOT, 0, 0)..).next()
            } else {
                self.mamba.first()
            };
            return entry.map(|&e| (e, false));
        }
        if hot_first {
            let mut hot = self.mamba.range((HOT, 0, 0)..);
            if let Some(&entry) = hot.find(|e| tree.node(e.2).expected == 0) {
                return Some((entry, false));
            }
        }
        lookahead::unexpected(tree, self.mamba.iter().copied())
    }

    /// The first host candidate (left in the set).
    pub fn first_host(&self) -> Option<u32> {
        self.host.first().map(|&(_, _, i)| i)
    }

    /// State candidates.
    pub fn state_count(&self) -> usize {
        self.mamba.len()
    }

    /// The first host candidate that holds a host state (left in the set).
    pub fn first_host_state(&self) -> Option<u32> {
        self.host_states.first().map(|&(_, _, i)| i)
    }

    /// Used states counted among the candidates: for `audit()`.
    pub fn hot(&self) -> usize {
        self.hot.count()
    }

    /// The policies the sets follow.
    pub fn policy(&self) -> EvictionPolicies {
        self.policy
    }

    /// The sets, for `audit()`: KV, states, host, host with a state.
    pub fn sets(&self) -> [&LruSet; 4] {
        [&self.kv, &self.mamba, &self.host, &self.host_states]
    }

    /// Drops the first KV candidate without updating its node (audit tests corrupt the
    /// books this way).
    #[cfg(test)]
    pub fn corrupt_kv(&mut self) {
        self.kv.pop_first();
    }
}

/// A node's key under `policy` from its last access, matches and priority (the KV and
/// SWA keys). Every word only grows while the node lives (`touch`, `raise_priority`; a
/// split copies them), which the SWA queue relies on.
#[inline]
fn node_key(policy: EvictionPolicy, n: &Node) -> Key {
    match policy {
        // Configuration refuses state-value for KV and SWA (it values states only).
        EvictionPolicy::Lru | EvictionPolicy::StateValue => lru::node_key(n),
        EvictionPolicy::Lfu => lfu::node_key(n),
        EvictionPolicy::Priority => priority::node_key(n),
    }
}

/// Adds or removes the entry when membership changes from `was` (listed as `old`) to
/// `now` (listed as `new`).
fn set_membership(
    set: &mut LruSet,
    old: &(u64, u64, u32),
    new: &(u64, u64, u32),
    was: bool,
    now: bool,
) {
    if now && !was {
        set.insert(*new);
    } else if was && !now {
        set.remove(old);
    }
}
