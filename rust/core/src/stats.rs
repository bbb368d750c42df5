//! Counters users watch. Gauges (sizes, pool counts) are added by the cache when
//! reporting, so they are always computed from the live state.

/// Monotonic counters since the cache was built.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Stats {
    pub match_calls: u64,
    /// Page-aligned tokens asked for by matches.
    pub match_tokens: u64,
    /// Tokens matches found on the device.
    pub hit_tokens: u64,
    pub insert_calls: u64,
    /// Tokens that became newly cached.
    pub inserted_tokens: u64,
    /// Tokens passed to inserts that were cached already (their slots were freed).
    pub duplicate_tokens: u64,
    pub splits: u64,
    pub locks: u64,
    pub unlocks: u64,
    pub evict_calls: u64,
    pub evicted_kv_tokens: u64,
    pub evicted_nodes: u64,
    pub alloc_calls: u64,
    /// KV allocations (`alloc_kv`, `extend`) that failed even after eviction.
    pub alloc_failures: u64,
    /// Matches whose answer ended at a node with a device state.
    pub state_hits: u64,
    /// States published into the tree (inserts, finished requests, checkpoint copies).
    pub states_cached: u64,
    pub evicted_mamba_states: u64,
    /// States evicted from nodes that stayed in the tree (tombstones).
    pub tombstones: u64,
    /// State allocations that failed even after eviction.
    pub mamba_alloc_failures: u64,
    pub admits: u64,
    /// Admissions refused: no state slot for the copy-on-write even after eviction.
    pub admits_refused: u64,
    pub extends: u64,
    /// Extensions refused: no KV or state slot even after eviction.
    pub extends_refused: u64,
    pub checkpoints: u64,
    /// Checkpoints that cached KV but could not copy the state (no slot, or the
    /// request's length is not page-aligned).
    pub checkpoint_states_skipped: u64,
    pub finishes: u64,
    pub aborts: u64,
    /// Requests released because their handle was dropped while still holding slots.
    pub requests_dropped: u64,
    /// Copy-on-write batches emitted (admission and checkpoint).
    pub cow_copies: u64,
    pub batches_completed: u64,
    pub batches_failed: u64,
}

impl Stats {
    pub fn entries(&self) -> Vec<(&'static str, u64)> {
        vec![
            ("match_calls", self.match_calls),
            ("match_tokens", self.match_tokens),
            ("hit_tokens", self.hit_tokens),
            ("insert_calls", self.insert_calls),
            ("inserted_tokens", self.inserted_tokens),
            ("duplicate_tokens", self.duplicate_tokens),
            ("splits", self.splits),
            ("locks", self.locks),
            ("unlocks", self.unlocks),
            ("evict_calls", self.evict_calls),
            ("evicted_kv_tokens", self.evicted_kv_tokens),
            ("evicted_nodes", self.evicted_nodes),
            ("alloc_calls", self.alloc_calls),
            ("alloc_failures", self.alloc_failures),
            ("state_hits", self.state_hits),
            ("states_cached", self.states_cached),
            ("evicted_mamba_states", self.evicted_mamba_states),
            ("tombstones", self.tombstones),
            ("mamba_alloc_failures", self.mamba_alloc_failures),
            ("admits", self.admits),
            ("admits_refused", self.admits_refused),
            ("extends", self.extends),
            ("extends_refused", self.extends_refused),
            ("checkpoints", self.checkpoints),
            ("checkpoint_states_skipped", self.checkpoint_states_skipped),
            ("finishes", self.finishes),
            ("aborts", self.aborts),
            ("requests_dropped", self.requests_dropped),
            ("cow_copies", self.cow_copies),
            ("batches_completed", self.batches_completed),
            ("batches_failed", self.batches_failed),
        ]
    }
}
