//! What an eviction set holds: a node's key (the words its policy computes) and the
//! sets of `(key, node index)` entries. A leaf: the policy files and `lookahead.rs`
//! name these without importing the sets' mechanism (`mod.rs`).

use std::collections::BTreeSet;

/// A node's place in an eviction set: compared first, then the second word.
pub(crate) type Key = (u64, u64);

/// Eviction candidates by `(key, node index)`: the first goes first.
pub(crate) type LruSet = BTreeSet<(u64, u64, u32)>;
