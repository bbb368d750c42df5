//! The "lru" policy: least recently used first. Its keys are the access times alone,
//! so the order is exactly the recency order; states go in two segments, unused ones
//! first ([`HOT`]), and [`Hot`] counts the used ones against the cap it protects.
//!
//! Its KV key is also the one the KV and SWA sets fall back to under "state-value",
//! which configuration refuses for them (it values states only).

use super::keys::Key;
use crate::tree::{MambaNode, Node};

/// Set in a state's `last_access` once a match has used the state (the time is in the
/// bits below). Under "lru", states are evicted in two segments: unused states first (a
/// finished request's end state, which often nobody resumes), then used ones (a shared
/// prompt's branch point), each least recently used first; so a stream of one-off
/// states cannot flush the states many requests reuse. While more than the protected
/// cap of used states are candidates, the oldest used one goes first instead, so that
/// used states nobody needs any more still age out. The bit orders used states after
/// unused ones.
pub(crate) const HOT: u64 = 1 << 62;

/// The KV, host and SWA key of node `n`: (last access, 0).
#[inline]
pub(super) fn node_key(n: &Node) -> Key {
    (n.last_access, 0)
}

/// The state key of a state `m`: (last use, with [`HOT`] once used; 0).
#[inline]
pub(super) fn state_key(m: &MambaNode) -> Key {
    (m.last_access, 0)
}

/// The used states among the state candidates (keys with [`HOT`]; counted under "lru"
/// only), and how many of them are protected.
#[derive(Default)]
pub(super) struct Hot {
    /// Entries of the state set for used states.
    count: usize,
    /// How many used states are protected (see [`HOT`]).
    cap: usize,
}

impl Hot {
    /// None counted yet, up to `cap` protected.
    pub(super) fn new(cap: usize) -> Hot {
        Hot { count: 0, cap }
    }

    /// A state listed under a key whose first word is `key` joined the state set.
    #[inline]
    pub(super) fn joined(&mut self, key: u64) {
        if key & HOT != 0 {
            self.count += 1;
        }
    }

    /// A state listed under a key whose first word is `key` left the state set.
    #[inline]
    pub(super) fn left(&mut self, key: u64) {
        if key & HOT != 0 {
            self.count -= 1;
        }
    }

    /// Whether more used states than the cap are candidates: the oldest used one goes
    /// first.
    #[inline]
    pub(super) fn over_cap(&self) -> bool {
        self.count > self.cap
    }

    /// Used states counted among the candidates.
    pub(super) fn count(&self) -> usize {
        self.count
    }
}
