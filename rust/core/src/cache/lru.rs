//! The eviction sets and the logical clock: which nodes eviction may take, in the order
//! each component's [`EvictionPolicy`] gives.
//!
//! [`Lru`] owns the four sets and each node's membership marks (the `Listed` and
//! `HostListed` states of [`KvState`], the `Listed` mark of [`StateMark`]); everyone else
//! asks it to [`Lru::refresh`] a node after changing what the node is, and it decides.
//! It lists only nodes that are out of flight (`Idle`), and leaves the others as they
//! are. An entry is `(key, node index)` and the first entry goes first. The key is what
//! the policy computes from the node ([`Lru::kv_key`], [`Lru::state_key`]); it is kept
//! on the node while the node is listed, and everything a key is computed from changes
//! through here, which lists the node again under its new key:
//!
//! | policy | KV, host and SWA key | state key |
//! |---|---|---|
//! | lru | (last access, 0) | (last use, [`HOT`] once used; 0) |
//! | lfu | (matches, last access) | (matches of the state, last use) |
//! | priority | (priority, last access) | (the node's priority, last use) |
//! | state-value | (not for KV or SWA) | (used?, aging level at last use + value; last use); superseded: (0, last use) |
//!
//! The SWA queue (`swa.rs`) is not one of these sets: it keys its entries with
//! [`Lru::swa_key`] and, since those keys only grow, lets an entry lag behind its node
//! and puts it back in line when it comes up.
//!
//! Under "lru" the keys are the access times alone, so the order is exactly the
//! recency order. The state-value policy is GreedyDual-Size in two segments: a state's
//! value is the compute it saves ([`state_cost`]) per slot (every state takes one); its
//! matches count only in its segment (used or not); the key adds the aging level `L` of
//! its segment (states no match has used, then used ones) at the state's last use, and
//! each segment's `L` rises to the key of each of its states the policy evicts, so
//! states nobody uses age out behind the ones in use. A used state that the next state
//! on its path supersedes ([`Lru::state_placed`]: a conversation's previous turn) goes
//! before all of them, and the new state counts as used in its place; so does a state
//! a load-back restores for a request ([`Lru::state_restored`]) (docs/design.md,
//! "Eviction policies").

use std::collections::BTreeSet;

use crate::config::{EvictionPolicies, EvictionPolicy};
use crate::tree::{KvState, Node, StateMark, Succession, Tree, NONE};

/// A node's place in an eviction set: compared first, then the second word.
pub(crate) type Key = (u64, u64);

/// Eviction candidates by `(key, node index)`: the first goes first.
pub(crate) type LruSet = BTreeSet<(u64, u64, u32)>;

/// Set in a state's `last_access` once a match has used the state (the time is in the
/// bits below). Under "lru", states are evicted in two segments: unused states first (a
/// finished request's end state, which often nobody resumes), then used ones (a shared
/// prompt's branch point), each least recently used first; so a stream of one-off
/// states cannot flush the states many requests reuse. While more than the protected
/// cap of used states are candidates, the oldest used one goes first instead, so that
/// used states nobody needs any more still age out. The bit orders used states after
/// unused ones.
pub(crate) const HOT: u64 = 1 << 62;

/// Set in a state-value key once a match has used the state: used states go after
/// unused ones, each segment in value order with its own aging level.
const USED: u64 = 1 << 63;

/// Depth (tokens) at which a token's attention costs as much again as the rest of its
/// layers' work: the weight of a token at depth `d` is `1 + d / DEPTH_SCALE`. With a
/// model width `w`, attention at depth `d` costs about `4 d w` FLOPs a layer and the
/// projections and MLP `24 w^2`, so the two are equal at `d = 6 w` per attention
/// layer; hybrids have one attention layer in two to eight, and `w` is 2,048 to 8,192:
/// 2^16 is in that range, and measured best on the replay's workloads (docs/design.md).
pub(crate) const DEPTH_SCALE: u64 = 1 << 16;

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
    /// Entries of `mamba` for used states (keys with [`HOT`]; "lru" only).
    hot: usize,
    /// How many used states are protected (see [`HOT`]).
    hot_cap: usize,
    policy: EvictionPolicies,
    /// The state-value aging levels `L` of unused and used states: the highest key of a
    /// state of each segment the policy evicted.
    level: [u64; 2],
    /// The nodes [`Lru::expect`] marked (`Node::expected`), as they were then: some may
    /// have been freed since, their index even reused by an unmarked node.
    expected: Vec<u32>,
    /// The requests [`Lru::expect`] was told of, soonest first.
    waiting: Vec<Waiting>,
    /// Evictions that took a marked node for want of an unmarked candidate.
    expected_taken: u64,
}

impl Lru {
    /// Empty sets ordered by `policy`; under "lru" up to `hot_cap` used states
    /// protected.
    pub fn new(hot_cap: usize, policy: EvictionPolicies) -> Lru {
        Lru {
            hot_cap,
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

    /// The key of node `n` in the SWA eviction queue under the SWA policy (`swa.rs`):
    /// the KV keys, from the same node fields.
    pub fn swa_key(&self, n: &Node) -> Key {
        node_key(self.policy.swa, n)
    }

    /// The key of node `i`'s device state in the state set under the state policy.
    pub fn state_key(&self, tree: &Tree, i: u32) -> Key {
        let n = tree.node(i);
        let m = &n.mamba;
        match self.policy.mamba {
            EvictionPolicy::Lru => (m.last_access, 0),
            EvictionPolicy::Lfu => (m.hits, m.last_access),
            EvictionPolicy::Priority => (ordered(n.priority), m.last_access),
            EvictionPolicy::StateValue if m.succession == Succession::Superseded => {
                (0, m.last_access)
            }
            EvictionPolicy::StateValue => {
                let aged = m.aged.saturating_add(state_cost(tree, i)).min(USED - 1);
                let used = m.hits > 0 || m.resumed;
                (aged | if used { USED } else { 0 }, m.last_access)
            }
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
            if m.succession == Succession::Superseded {
                m.succession = Succession::Continued;
            }
        } else {
            m.succession = Succession::Fresh;
            m.resumed = false;
        }
        m.aged = self.level[usize::from(m.hits > 0)];
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
        let mut stack: Vec<u32> = tree.node(i).children.iter().map(|&(_, c)| c).collect();
        while let Some(c) = stack.pop() {
            let n = tree.node(c);
            // Device KV is prefix-closed and a state needs its node's device KV: no
            // device state lies at or below a node without device KV.
            if n.kv.device.is_none() {
                continue;
            }
            if n.mamba.device.is_some() {
                self.rekey_state(tree, c);
            } else {
                stack.extend(n.children.iter().map(|&(_, g)| g));
            }
        }
    }

    /// After node `i` gained its device state: the states below it move (see
    /// [`Lru::ancestor_state_changed`]). Under state-value, the nearest state above it is
    /// superseded when `i` is the first state placed below it, a match has used it, and
    /// nothing branches off between the two: no other child on the way, and no lock
    /// that stops on the way (a request that resumed from there and has not cached its
    /// own branch yet). It then serves only a request that leaves the path between the
    /// two, and goes first; `i`, the path's new end, counts as used in its place (a
    /// conversation's next turn resumes from its newest end, docs/design.md).
    pub fn state_placed(&mut self, tree: &mut Tree, i: u32) {
        self.ancestor_state_changed(tree, i);
        if self.policy.mamba != EvictionPolicy::StateValue {
            return;
        }
        let (mut below, mut cur) = (i, tree.node(i).parent);
        let mut branch = false;
        while cur != NONE {
            let n = tree.node(cur);
            branch |= n.children.len() != 1 || n.kv.lock != tree.node(below).kv.lock;
            if n.mamba.device.is_some() {
                let supersede = n.mamba.succession == Succession::Fresh && n.mamba.hits > 0;
                if supersede && !branch {
                    tree.node_mut(cur).mamba.succession = Succession::Superseded;
                    self.rekey_state(tree, cur);
                    let m = &mut tree.node_mut(i).mamba;
                    m.resumed = true;
                    m.aged = self.level[1];
                    self.rekey_state(tree, i);
                } else if n.mamba.succession == Succession::Fresh {
                    tree.node_mut(cur).mamba.succession = Succession::Continued;
                }
                return;
            }
            (below, cur) = (cur, n.parent);
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
        let m = &mut tree.node_mut(i).mamba;
        m.resumed = true;
        m.aged = self.level[1];
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
        let (old, new) = (n.mamba.lru_key, self.state_key(tree, i));
        tree.node_mut(i).mamba.lru_key = new;
        self.remove_state((old.0, old.1, i));
        self.add_state((new.0, new.1, i));
    }

    /// Whether a state set entry counts as a used state (see [`HOT`]).
    fn is_hot(&self, entry: (u64, u64, u32)) -> bool {
        self.policy.mamba == EvictionPolicy::Lru && entry.0 & HOT != 0
    }

    fn add_state(&mut self, entry: (u64, u64, u32)) {
        if self.mamba.insert(entry) && self.is_hot(entry) {
            self.hot += 1;
        }
    }

    fn remove_state(&mut self, entry: (u64, u64, u32)) {
        if self.mamba.remove(&entry) && self.is_hot(entry) {
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
            m.lru_key = key;
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
            let key = n.mamba.lru_key;
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
        let entry = if self.expected.is_empty() {
            self.kv.first().copied()
        } else {
            let (entry, taken) = unexpected(tree, self.kv.iter().copied())?;
            self.expected_taken += u64::from(taken);
            Some(entry)
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
        for i in self.expected.drain(..) {
            tree.node_mut(i).expected = 0;
        }
        self.waiting = waiting;
        for (rank, w) in self.waiting.iter().enumerate() {
            if w.cut_depth > 0 {
                let rank = u32::try_from(rank + 1).unwrap_or(u32::MAX);
                mark(tree, &mut self.expected, w.cut, rank);
            }
        }
        self.expected.len()
    }

    /// The rank (1 + position) of the soonest waiting request ([`Lru::expect`]) that a
    /// state at the end of node `i`, `depth` tokens deep, would serve: its prompt's
    /// cached KV passes through the whole node and no deeper state was on its path
    /// when it was told of. 0 when none would.
    pub fn rank_of(&self, tree: &Tree, i: u32, depth: usize) -> u32 {
        let serves = |w: &Waiting| {
            if w.cut_depth >= depth || !tree.is_current(w.last, w.generation) {
                return false;
            }
            if w.depth < depth {
                return goes_on(tree, w, i, depth);
            }
            let mut cur = w.last;
            while cur != NONE && cur != i {
                cur = tree.node(cur).parent;
            }
            cur == i
        };
        self.waiting
            .iter()
            .position(serves)
            .map_or(0, |r| u32::try_from(r + 1).unwrap_or(u32::MAX))
    }

    /// Whether a new state of rank `rank` ([`Lru::rank_of`]; 0: no waiting request
    /// needs it) should not take a slot from the state eviction would give out next:
    /// that one is marked and needed sooner (Belady's rule lets the new one go by).
    pub fn bypasses(&self, tree: &Tree, rank: u32) -> bool {
        if self.expected.is_empty() {
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
        if rank > 0 {
            mark(tree, &mut self.expected, i, rank);
        }
    }

    /// Whether [`Lru::expect`] was told of waiting requests (its last call's).
    pub fn expecting(&self) -> bool {
        !self.waiting.is_empty()
    }

    /// The nodes marked now: for `stats()` and `audit()`.
    pub fn expected(&self) -> impl Iterator<Item = u32> + '_ {
        self.expected.iter().copied()
    }

    /// Evictions that took a marked node for want of an unmarked candidate.
    pub fn expected_taken(&self) -> u64 {
        self.expected_taken
    }

    /// The next state to evict (see [`HOT`]), taken out of the set. Under state-value
    /// the aging level rises to its key.
    pub fn pop_state(&mut self, tree: &mut Tree) -> Option<u32> {
        let entry = self.state_victim(tree)?;
        self.remove_state(entry);
        if self.policy.mamba == EvictionPolicy::StateValue {
            let segment = usize::from(entry.0 & USED != 0);
            self.level[segment] = self.level[segment].max(entry.0 & !USED);
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
        self.expected_taken += u64::from(taken);
        Some(entry)
    }

    /// [`Lru::state_victim`], and whether it is marked.
    fn next_state(&self, tree: &Tree) -> Option<((u64, u64, u32), bool)> {
        let hot_first = self.policy.mamba == EvictionPolicy::Lru && self.hot > self.hot_cap;
        if self.expected.is_empty() {
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
        unexpected(tree, self.mamba.iter().copied())
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
        self.hot
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
        EvictionPolicy::Lru | EvictionPolicy::StateValue => (n.last_access, 0),
        EvictionPolicy::Lfu => (n.matches, n.last_access),
        EvictionPolicy::Priority => (ordered(n.priority), n.last_access),
    }
}

/// A request a scheduler will admit soon (`Cache::expect`): where its match ends
/// now, and its prompt's cached KV.
#[derive(Debug, Clone)]
pub(crate) struct Waiting {
    /// The node its match ends at (the device cut), and how deep (0: nothing cached).
    pub cut: u32,
    pub cut_depth: usize,
    /// The last node its KV walk reached (the match may end inside it), the node's
    /// generation then, and how deep the walk got.
    pub last: u32,
    pub generation: u64,
    pub depth: usize,
    /// The prompt's next tokens past the walk (at most [`WAITING_TAIL`]): a state placed
    /// that deep later, on a path that goes on as the prompt does, serves it too.
    pub next: Vec<u32>,
}

/// How many of a waiting prompt's tokens past its cached KV [`Cache::expect`] keeps: a
/// running request whose prompt this one extends (a conversation's next turn, while
/// the turn before decodes) places its end state up to its output's length deeper
/// than the KV the walk saw.
///
/// [`Cache::expect`]: super::Cache::expect
pub(crate) const WAITING_TAIL: usize = 1024;

/// Whether node `i`, `depth` tokens deep (past `w`'s walk), lies on `w`'s prompt: the
/// walk covered its last node whole, `i` descends from it, and the keys between are the
/// prompt's next tokens.
fn goes_on(tree: &Tree, w: &Waiting, i: u32, depth: usize) -> bool {
    let past = depth - w.depth;
    if past > w.next.len() || w.last == NONE {
        return false;
    }
    // The path from `w.last` down to `i`, walked up from `i`: each node's key must be
    // the prompt's tokens at the node's place.
    let mut end = past;
    let mut cur = i;
    while cur != w.last {
        if cur == NONE {
            return false;
        }
        let n = tree.node(cur);
        let Some(start) = end.checked_sub(n.key.len()) else {
            return false; // the node starts above the walk's end: the walk ended inside it
        };
        if n.key[..] != w.next[start..end] {
            return false;
        }
        end = start;
        cur = n.parent;
    }
    end == 0
}

/// Marks node `i` with `rank` unless it has a sooner one, listing it in `expected`.
fn mark(tree: &mut Tree, expected: &mut Vec<u32>, i: u32, rank: u32) {
    let n = tree.node_mut(i);
    if n.expected == 0 {
        n.expected = rank;
        expected.push(i);
    } else {
        n.expected = n.expected.min(rank);
    }
}

/// The first entry of `entries` (in eviction order) whose node is not marked
/// ([`Lru::expect`]), else the marked one needed latest (and `true`: a marked node
/// taken). `entries` holds at most as many marked nodes as [`Lru::expect`] marked, so
/// the walk is that long at most.
fn unexpected(
    tree: &Tree,
    entries: impl Iterator<Item = (u64, u64, u32)>,
) -> Option<((u64, u64, u32), bool)> {
    let mut latest: Option<(u32, (u64, u64, u32))> = None;
    for entry in entries {
        let rank = tree.node(entry.2).expected;
        if rank == 0 {
            return Some((entry, false));
        }
        if latest.is_none_or(|(r, _)| rank > r) {
            latest = Some((rank, entry));
        }
    }
    latest.map(|(_, entry)| (entry, true))
}

/// A priority as a key word: lower priorities first.
fn ordered(priority: i64) -> u64 {
    priority.cast_unsigned() ^ (1 << 63)
}

/// The compute node `i`'s state saves, in units of `1 / DEPTH_SCALE` of a token at
/// depth 0: the tokens from the nearest device state above it (or the root) to its
/// end, each weighted `1 + depth / DEPTH_SCALE` (attention reads every token before
/// it; the other layers cost the same at any depth).
pub(crate) fn state_cost(tree: &Tree, i: u32) -> u64 {
    let n = tree.node(i);
    let mut between = n.key.len() as u64;
    let mut depth = between;
    let mut below_state = true;
    let mut cur = n.parent;
    while cur != NONE {
        let a = tree.node(cur);
        below_state = below_state && a.mamba.device.is_none();
        if below_state {
            between += a.key.len() as u64;
        }
        depth += a.key.len() as u64;
        cur = a.parent;
    }
    // Sum over depths d in [depth - between, depth) of (DEPTH_SCALE + d); the product
    // below is even (its factors have opposite parities).
    let first = depth - between;
    let spread = between.saturating_mul((first + depth).saturating_sub(1)) / 2;
    between.saturating_mul(DEPTH_SCALE).saturating_add(spread)
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
