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
    /// `alloc_kv` calls that returned `None` even after eviction.
    pub alloc_failures: u64,
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
        ]
    }
}
