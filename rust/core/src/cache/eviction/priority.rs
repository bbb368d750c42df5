//! The "priority" policy: lowest request priority first, ties least recently used. A
//! node's priority is the highest of the requests that inserted or were admitted
//! through it, and only rises (`Lru::raise_priority`, which moves the node's state too
//! only under this policy); a state is keyed by its node's priority.

use super::keys::Key;
use crate::tree::Node;

/// The KV, host and SWA key of node `n`: (priority, last access).
#[inline]
pub(super) fn node_key(n: &Node) -> Key {
    (ordered(n.priority), n.last_access)
}

/// The state key of node `n`'s state: (the node's priority, last use).
#[inline]
pub(super) fn state_key(n: &Node) -> Key {
    (ordered(n.priority), n.mamba.last_access)
}

/// A priority as a key word: lower priorities first.
fn ordered(priority: i64) -> u64 {
    priority.cast_unsigned() ^ (1 << 63)
}
