//! radixcache-core: a prefix-cache manager for hybrid LLMs, with no Python in it.
//!
//! * [`Pool`] hands out slots in pages as owned [`Pages`] values that are published
//!   into the tree, handed to a caller, or returned to the pool when dropped.
//! * [`Cache`] is the radix tree over those pools: `match_prefix`, `insert` (taking
//!   ownership of the caller's slots), path locks held by owned [`LockReceipt`]s, LRU
//!   eviction, the host tier, load-backs owned by [`LoadRecord`]s, the request API, and
//!   `audit()` of every invariant.
//! * With `page_hashes`, every cached page carries a chained SHA-256 ([`hashes`],
//!   interoperable with `SGLang` `HiCache`'s), and with `events` the cache queues
//!   [`KvEvent`]s for cache-aware routers ([`Cache::take_events`]).
//! * [`HybridCache`] shares a [`Cache`] between owners and gives owned handles
//!   ([`Lock`], [`Request`], [`LoadBack`]) that give back what they hold when dropped.
//!
//! The contract (every promise, numbered rules and invariants) is docs/contract.md in
//! the repository.

mod audit;
mod cache;
mod config;
mod error;
mod handle;
pub mod hashes;
mod ids;
mod pool;
mod slab;
mod stats;
mod tree;

pub use cache::{
    Abandoned, BatchKind, Cache, CallOff, ComponentKind, EventContents, Evicted, Grown, Insert,
    KvEvent, LoadRecord, LoadTarget, LockReceipt, Match, Medium, Model, NodeInfo, Peek, PoolKind,
    RequestView, SlotCopy, Tier, TransferBatch,
};
pub use config::{Config, EvictionPolicies, EvictionPolicy, L3Write, PoolOwner, WritePolicy};
pub use error::{Error, Result};
pub use handle::{Batch, HybridCache, LoadBack, Lock, Outcome, Request};
pub use hashes::PageHash;
pub use ids::{BatchId, CacheId, LockId, NodeId, RequestId};
pub use pool::{PageState, Pages, Pool, PoolCounts};
