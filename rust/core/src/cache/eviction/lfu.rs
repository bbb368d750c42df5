//! The "lfu" policy: least often matched first, ties least recently used. A node
//! counts the matches that used it (`Node::matches`), a state the matches that used
//! the state (`MambaNode::hits`); both only grow while the node lives.

use super::keys::Key;
use crate::tree::{MambaNode, Node};

/// The KV, host and SWA key of node `n`: (matches, last access).
#[inline]
pub(super) fn node_key(n: &Node) -> Key {
    (n.matches, n.last_access)
}

/// The state key of a state `m`: (matches of the state, last use).
#[inline]
pub(super) fn state_key(m: &MambaNode) -> Key {
    (m.hits, m.last_access)
}
