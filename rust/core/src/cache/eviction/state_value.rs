//! The "state-value" policy (states only; configuration refuses it for KV and SWA):
//! GreedyDual-Size in two segments. A state's value is the compute it saves
//! ([`state_cost`]) per slot (every state takes one); its matches count only in its
//! segment (used or not); the key adds the aging level `L` of its segment (states no
//! match has used, then used ones) at the state's last use, and each segment's `L`
//! rises to the key of each of its states the policy evicts ([`Aging`]), so states
//! nobody uses age out behind the ones in use.
//!
//! A used state that the next state on its path supersedes ([`supersede`]: a
//! conversation's previous turn) goes before all of them, and the new state counts as
//! used in its place; so does a state a load-back restores for a request
//! (`Lru::state_restored`) (docs/design.md, "Eviction policies"). A state's value
//! depends on the nearest state above it, so the states below one that comes or goes
//! move ([`states_below`]).

use super::keys::Key;
use super::on_node::Succession;
use crate::tree::{MambaNode, Tree, NONE};

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

/// The state key of node `i`'s state: (used?, aging level at last use + value; last
/// use); superseded: (0, last use).
#[inline]
pub(super) fn state_key(tree: &Tree, i: u32) -> Key {
    let m = &tree.node(i).mamba;
    if m.policy.succession == Succession::Superseded {
        return (0, m.last_access);
    }
    let aged = m
        .policy
        .aged
        .saturating_add(state_cost(tree, i))
        .min(USED - 1);
    let used = m.hits > 0 || m.policy.resumed;
    (aged | if used { USED } else { 0 }, m.last_access)
}

/// The aging levels `L` of unused and used states: the highest key of a state of each
/// segment the policy evicted.
#[derive(Default)]
pub(super) struct Aging {
    level: [u64; 2],
}

impl Aging {
    /// State `m` was just stamped (its matches counted): used by a match (`hit`; a
    /// superseded state is kept again), or just placed (unused, and nothing below it
    /// yet). It takes its segment's level.
    #[inline]
    pub(super) fn stamped(&self, m: &mut MambaNode, hit: bool) {
        if hit {
            if m.policy.succession == Succession::Superseded {
                m.policy.succession = Succession::Continued;
            }
        } else {
            m.policy.succession = Succession::Fresh;
            m.policy.resumed = false;
        }
        m.policy.aged = self.level[usize::from(m.hits > 0)];
    }

    /// State `m` counts as used (it superseded the one above it, or a load-back
    /// restored it for a request), at the used level.
    #[inline]
    pub(super) fn resumed(&self, m: &mut MambaNode) {
        m.policy.resumed = true;
        m.policy.aged = self.level[1];
    }

    /// The policy evicted a state listed under a key whose first word is `key`: its
    /// segment's level rises to it.
    #[inline]
    pub(super) fn evicted(&mut self, key: u64) {
        let segment = usize::from(key & USED != 0);
        self.level[segment] = self.level[segment].max(key & !USED);
    }
}

/// Hands `each` the device states below node `i` down to the next state on each
/// branch: those whose nearest state above is at `i` (their value changes when `i`
/// gains or loses its state).
#[inline]
pub(super) fn states_below(tree: &mut Tree, i: u32, mut each: impl FnMut(&mut Tree, u32)) {
    let mut stack: Vec<u32> = tree.node(i).children.iter().map(|&(_, c)| c).collect();
    while let Some(c) = stack.pop() {
        let n = tree.node(c);
        // Device KV is prefix-closed and a state needs its node's device KV: no
        // device state lies at or below a node without device KV.
        if n.kv.device.is_none() {
            continue;
        }
        if n.mamba.device.is_some() {
            each(tree, c);
        } else {
            stack.extend(n.children.iter().map(|&(_, g)| g));
        }
    }
}

/// After node `i` gained its device state: the nearest state above it is superseded
/// when `i` is the first state placed below it, a match has used it, and nothing
/// branches off between the two: no other child on the way, and no lock that stops on
/// the way (a request that resumed from there and has not cached its own branch yet).
/// It then serves only a request that leaves the path between the two, and goes first;
/// `i`, the path's new end, counts as used in its place (a conversation's next turn
/// resumes from its newest end, docs/design.md). Returns the superseded state's node
/// (its key and `i`'s change); a state above that is not superseded is continued.
pub(super) fn supersede(tree: &mut Tree, i: u32, aging: &Aging) -> Option<u32> {
    let (mut below, mut cur) = (i, tree.node(i).parent);
    let mut branch = false;
    while cur != NONE {
        let n = tree.node(cur);
        branch |= n.children.len() != 1 || n.kv.lock != tree.node(below).kv.lock;
        if n.mamba.device.is_some() {
            let fresh = n.mamba.policy.succession == Succession::Fresh;
            if fresh && n.mamba.hits > 0 && !branch {
                tree.node_mut(cur).mamba.policy.succession = Succession::Superseded;
                aging.resumed(&mut tree.node_mut(i).mamba);
                return Some(cur);
            }
            if fresh {
                tree.node_mut(cur).mamba.policy.succession = Succession::Continued;
            }
            return None;
        }
        (below, cur) = (cur, n.parent);
    }
    None
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
