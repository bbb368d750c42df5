//! radixcache-core: a prefix-cache manager for hybrid LLMs, with no Python in it.
//!
//! * [`Pool`] hands out slots in pages as owned [`Pages`] values that are published
//!   into the tree, handed to a caller, or returned to the pool when dropped.
//! * [`Cache`] is the radix tree over those pools: `match_prefix`, `insert` (taking
//!   ownership of the caller's slots), path locks with receipts, LRU eviction of
//!   unlocked leaves, and `audit()` of every invariant.
//! * [`HybridCache`] shares a [`Cache`] and hands out owned [`Lock`] receipts that
//!   release when dropped.
//!
//! See `ARCHITECTURE.md` and `API.md` in the design folder for the contract.

mod audit;
mod cache;
mod config;
mod error;
mod handle;
mod pool;
mod stats;
mod tree;

pub use cache::{
    BatchId, BatchKind, Cache, CallOff, Copy, Evicted, Insert, LoadTarget, LockId, Match, NodeInfo,
    PoolKind, RequestId, RequestView, Tier, TransferBatch,
};
pub use config::{Config, WritePolicy};
pub use error::{Error, Result};
pub use handle::{HybridCache, LoadBack, Lock, Request};
pub use pool::{PageState, Pages, Pool, PoolCounts};
pub use tree::NodeId;
