//! `HybridCache`: the cache itself. This file holds the class and what it keeps, so that
//! the other classes can name it without importing its methods (which import them):
//! [`methods`] holds the methods, one per core call, and the constructor's signature.

use pyo3::prelude::*;
use radixcache_core as core;

mod methods;

pub(crate) use methods::constructor_signature;

/// A prefix cache for hybrid LLMs: radix tree, slot pools, locks and eviction.
///
/// Args (by position or keyword):
///   kv_slots: device KV token slots, a multiple of page_size (default 8192).
///   page_size: tokens per page; keys are matched and inserted in whole pages
///     (default 1).
///   mamba_slots: device Mamba state slots; 0 for an attention-only model (default 0).
///   host_kv_slots: host-tier KV token slots, a multiple of page_size; 0 for no host
///     tier (default 0).
///   host_mamba_slots: host-tier Mamba state slots (default 0).
///   write_policy: when device data is backed up to the host: "write_through" (on
///     insert, the default), "write_through_selective" (once a node was inserted
///     write_through_threshold times) or "write_back" (only a node being evicted).
///   write_through_threshold: inserts before a selective backup (>= 1; None: 2). Only
///     with "write_through_selective": the other policies refuse it.
///   eviction_policy: the order in which eviction takes candidates: "lru" (the
///     default), "lfu" (least often matched first), "priority" (lowest request
///     priority first, see insert and admit) or "state-value" (Mamba states only:
///     the state that saves the least compute first, aged, and before all a used
///     state the next state cached on its path supersedes; KV and SWA keep "lru").
///     A name applies to every component it applies to; a dict sets each:
///     {"kv": ..., "mamba": ..., "swa": ...} (missing: "lru"). The host tier follows
///     the KV policy.
///   swa_slots: device slots of the sliding-window attention KV pool (a multiple of
///     page_size; 0, the default: no SWA layers). Every KV page handed out comes with
///     an SWA page that follows it; a request gives back those whose tokens left the
///     window (Request.swa_indices); a match is cut where the last swa_window tokens
///     still have their SWA KV; evict_swa() makes SWA tombstones. Not with
///     pools="engine" yet.
///   swa_window: the tokens each SWA layer attends to (>= 1 with swa_slots, else 0).
///   host_swa_slots: host-tier SWA slots (a multiple of page_size, at least one page
///     and at most host_kv_slots), required with swa_slots and a host tier, else 0.
///     A host KV page holds at most one host SWA page: backups copy the SWA pages of
///     the device pages that have one, load-backs copy them back.
///   pools: who owns the device slots. "cache" (the default): the cache's own pools
///     (alloc_kv, alloc_mamba, requests). "engine": the engine's allocators own every
///     slot; insert claims the slots it is passed, what the tree gives up is queued
///     for take_freed() (evict returns what it frees directly); no host tier, and the
///     calls that allocate from the cache's pools raise CacheError.
///   page_hashes: every cached page carries a chained SHA-256 (sha256(previous page's
///     hash + the page's tokens as uint32 little-endian)), computed once when cached,
///     never by a match; page_hashes(node), Match.last_hash, chain_hashes(). Default
///     False: no cost.
///   hash_seed: 32 bytes seeding the chains (the default namespace's prior; named
///     namespaces' seeds derive from it), or None (the default): SGLang HiCache's
///     chains. Only with page_hashes=True.
///   events: queue KV events for cache-aware routers (take_events(), KvEvent): pages
///     and states stored on or removed from "GPU" and "CPU_PINNED". Needs
///     page_hashes=True.
///   l3: share host pages with other caches through an L3 store, by page hash:
///     "l3_put" batches write what a landed backup put on the host, l3_fetch() takes
///     host slots for what the store holds beyond both tiers ("l3_get" batches;
///     radixcache.l3.L3Tier runs both). Needs a host tier (with host state slots on a
///     hybrid model), page_hashes=True and no SWA layers.
///   l3_write: when host pages go to the L3 store: "backup" (the default: once a
///     backup lands, so that every cache of a fleet finds them at once) or
///     "host_eviction" (only when host eviction deletes them; their host slots drain
///     until the put ends, and an allocation that needs them waits a round). Only with
///     l3=True.
#[allow(clippy::doc_markdown)] // the Python docstring: `help()` shows it as written
#[pyclass(frozen, module = "radixcache._core", name = "HybridCache")]
pub(crate) struct PyHybridCache {
    pub(crate) inner: core::HybridCache,
    /// The configuration (immutable: read without taking the cache).
    config: core::Config,
}
