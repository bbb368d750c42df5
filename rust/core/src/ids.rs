//! Identifiers the core hands out: caches, nodes, requests and batches.
//!
//! A leaf module: it imports nothing from the crate, so every other module can use the
//! ids without importing the module that issues them. Every id names the cache that
//! issued it, so one cache never takes another's id for one of its own; ids of objects
//! that live in reused slots (nodes, requests) carry a 64-bit generation, so a stale
//! handle cannot alias a new object in practice (2^64 reuses of one slot).

use std::fmt;
use std::sync::atomic::{AtomicU32, Ordering};

/// Identifies one cache within the process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CacheId(u32);

/// Cache ids: 1, 2, ... in the order caches are made.
static NEXT_CACHE_ID: AtomicU32 = AtomicU32::new(1);

impl CacheId {
    /// A fresh id, never handed out before in this process (until 2^32 caches).
    pub(crate) fn fresh() -> CacheId {
        CacheId(NEXT_CACHE_ID.fetch_add(1, Ordering::Relaxed))
    }

    /// The id as a number.
    pub fn get(self) -> u32 {
        self.0
    }
}

impl fmt::Display for CacheId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A slot of an arena whose entries are reused: the index and the generation of the
/// entry that lived there when the id was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct Slot {
    pub index: u32,
    pub generation: u64,
}

/// A node handle: arena index plus the generation of the node that lived there when
/// the handle was made, plus the cache it came from. A handle whose node is gone (or
/// that belongs to another cache) is rejected as stale and never touches another node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId {
    pub(crate) cache: CacheId,
    pub(crate) slot: Slot,
}

impl NodeId {
    /// Arena index (stable for the node's lifetime; reused after it is gone).
    pub fn index(self) -> u32 {
        self.slot.index
    }

    /// Generation of the arena slot when the handle was made.
    pub fn generation(self) -> u64 {
        self.slot.generation
    }

    /// The cache the node belongs to.
    pub fn cache(self) -> CacheId {
        self.cache
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}.{}", self.slot.index, self.slot.generation)
    }
}

/// Identifies a request of one cache; stale once the request is finished or aborted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RequestId {
    pub(crate) cache: CacheId,
    pub(crate) slot: Slot,
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}.{}", self.slot.index, self.slot.generation)
    }
}

/// Identifies a lock receipt of one cache (see [`crate::LockReceipt`], the owned value).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LockId {
    pub(crate) cache: CacheId,
    pub(crate) slot: Slot,
}

impl fmt::Display for LockId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}.{}", self.slot.index, self.slot.generation)
    }
}

/// Identifies a transfer batch: the cache that emitted it and its sequence number there
/// (never reused within a cache). Crosses into Python as one integer,
/// `cache << 64 | seq` ([`BatchId::to_u128`]), so a batch id of one cache is never
/// taken for a batch of another.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BatchId {
    cache: CacheId,
    seq: u64,
}

impl BatchId {
    pub(crate) fn new(cache: CacheId, seq: u64) -> BatchId {
        BatchId { cache, seq }
    }

    /// The id as one number: the cache id in the high 64 bits, the sequence number in
    /// the low ones.
    pub fn to_u128(self) -> u128 {
        (u128::from(self.cache.0) << 64) | u128::from(self.seq)
    }

    /// The id a number made by [`BatchId::to_u128`] stands for; `None` when no cache
    /// could have issued it (the cache part does not fit).
    pub fn from_u128(v: u128) -> Option<BatchId> {
        let cache = u32::try_from(v >> 64).ok()?;
        // The low 64 bits, by construction.
        let seq = u64::try_from(v & u128::from(u64::MAX)).ok()?;
        Some(BatchId {
            cache: CacheId(cache),
            seq,
        })
    }

    /// The cache that emitted the batch.
    pub fn cache(self) -> CacheId {
        self.cache
    }

    /// Its sequence number in that cache (0, 1, ... in emission order).
    pub fn seq(self) -> u64 {
        self.seq
    }
}

impl fmt::Display for BatchId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.to_u128())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_ids_round_trip_through_one_number_and_keep_their_cache() {
        let a = BatchId::new(CacheId(3), 0x11);
        let b = BatchId::new(CacheId(4), 0x11);
        assert_ne!(a.to_u128(), b.to_u128());
        assert_eq!(BatchId::from_u128(a.to_u128()), Some(a));
        assert_eq!(a.to_u128(), (3u128 << 64) | 0x11);
        assert_eq!(BatchId::from_u128(u128::MAX), None);
        assert_eq!(a.to_string(), a.to_u128().to_string());
    }

    #[test]
    fn cache_ids_are_fresh() {
        assert_ne!(CacheId::fresh(), CacheId::fresh());
    }
}
