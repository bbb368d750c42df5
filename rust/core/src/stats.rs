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
    /// Engine-owned pools: KV slots handed back to the engine (by `evict` and
    /// `take_freed`).
    pub kv_slots_returned: u64,
    /// Engine-owned pools: state slots handed back to the engine.
    pub mamba_slots_returned: u64,
    /// States that state eviction took although a match had used them (the protected
    /// segment): high next to `state_hits` means the state pool is too small for what
    /// requests share.
    pub evicted_used_states: u64,
    /// States evicted from nodes that stayed in the tree (tombstones).
    pub tombstones: u64,
    /// SWA: nodes whose SWA pages eviction freed, keeping them as tombstones.
    pub swa_tombstones: u64,
    /// SWA: pages eviction freed (tombstones and deleted leaves).
    pub swa_evicted_pages: u64,
    /// SWA: page allocations refused for want of SWA pages even after eviction.
    pub swa_alloc_failures: u64,
    /// SWA: request pages whose SWA pages were given back as their tokens left the
    /// window.
    pub swa_window_freed_pages: u64,
    /// SWA: tombstone pages given back their SWA KV by an insert of the same tokens.
    pub swa_revived_pages: u64,
    /// SWA pages whose SWA KV a backup copies to the host (with their KV pages).
    pub swa_backed_up_pages: u64,
    /// SWA pages a backup left behind for want of host SWA pages (their KV went alone).
    pub swa_backup_skipped_pages: u64,
    /// SWA pages a load-back copies from the host to the device.
    pub swa_loaded_pages: u64,
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
    /// Finishes at a length that is not page-aligned, of a request holding a state, whose
    /// last whole page ends where the tree has no state on any tier and no checkpoint
    /// copy on its way: the turn's end state is lost, and a next turn resumes from an
    /// earlier state (docs/contract.md rule 2).
    pub finish_states_lost: u64,
    pub aborts: u64,
    /// Requests released because their handle was dropped while still holding slots.
    pub requests_dropped: u64,
    /// Copy-on-write batches emitted (admission and checkpoint).
    pub cow_copies: u64,
    pub batches_completed: u64,
    pub batches_failed: u64,
    /// Batches whose owner let go of them before they ended (failed, or draining).
    pub batches_abandoned: u64,
    /// Tokens matches found only on the host tier (`Match.host_len`).
    pub host_hit_tokens: u64,
    /// Host-only tokens an insert gave device slots again.
    pub revived_tokens: u64,
    /// Backup batches emitted.
    pub backups: u64,
    /// Backup batches completed.
    pub backups_done: u64,
    /// Backup batches failed (the nodes stay not backed up).
    pub backups_failed: u64,
    /// KV tokens copied to the host by backups.
    pub backup_tokens: u64,
    /// Nodes a backup left out for lack of host room after host eviction.
    pub backups_skipped: u64,
    /// States a backup left out for lack of a host state slot.
    pub backup_states_skipped: u64,
    /// `l3_put` batches emitted, completed and failed.
    pub l3_puts: u64,
    pub l3_puts_done: u64,
    pub l3_puts_failed: u64,
    /// KV pages and states offered to the L3 tier by `l3_put` batches.
    pub l3_put_pages: u64,
    pub l3_put_states: u64,
    /// `l3_fetch` calls that emitted an `l3_get` batch, and the pages they asked for.
    pub l3_fetches: u64,
    pub l3_fetch_pages: u64,
    /// `l3_fetch` calls that took nothing (nothing to fetch, a load in the way, no room).
    pub l3_fetches_called_off: u64,
    /// `l3_get` batches that landed nothing (failed, or a hybrid fetch without all of it).
    pub l3_fetches_failed: u64,
    /// Fetched pages that landed (placed in the tree, or found there already).
    pub l3_landed_pages: u64,
    /// Objects of `l3_get` batches that the store no longer held (missing, or corrupt
    /// and deleted), as `complete_l3`'s `gone` reported them.
    pub l3_gone_objects: u64,
    /// `l3_put` batches host eviction emitted (`l3_write="host_eviction"`) to write what
    /// it deleted and the store lacked; their host pages drain until the put ends.
    pub l3_eviction_puts: u64,
    /// Host allocations refused while the room they need drains: host pages that
    /// `l3_put` batches still read (free once the puts end).
    pub host_alloc_waits: u64,
    /// Device evictions that kept the node with its host copy.
    pub demotions: u64,
    /// Host-only nodes deleted to make host room (or with their device parent).
    pub host_evictions: u64,
    /// Host KV tokens freed by those deletions.
    pub host_evicted_tokens: u64,
    /// Load-back guards handed out.
    pub load_backs: u64,
    /// Load-backs committed.
    pub load_backs_committed: u64,
    /// Load-backs called off: returned None, or released uncommitted.
    pub load_backs_called_off: u64,
    /// ... because there was nothing to load.
    pub load_backs_called_off_nothing: u64,
    /// ... because part of the path was being loaded already.
    pub load_backs_called_off_busy: u64,
    /// ... because the KV tokens exceeded `mem_quota`.
    pub load_backs_called_off_quota: u64,
    /// ... because the device had no room for the KV even after eviction.
    pub load_backs_called_off_room: u64,
    /// ... because no state slot could be had even after eviction.
    pub load_backs_called_off_state: u64,
    /// ... because the target's window was not live on any tier, or the device had no
    /// room for its SWA pages even after SWA eviction.
    pub load_backs_called_off_swa: u64,
    /// ... because the guard was released without commit.
    pub load_backs_called_off_released: u64,
    /// Load-back batches that failed (before or after commit).
    pub load_backs_failed: u64,
    /// KV tokens moved to the device by committed load-backs.
    pub loaded_tokens: u64,
    /// `reset` calls that emptied the cache.
    pub resets: u64,
    /// `expect` calls (a scheduler telling eviction what it admits next).
    pub expect_calls: u64,
    /// Checkpoints that placed no state because every state eviction could take was
    /// needed by a waiting request sooner than the new one (`expect`).
    pub checkpoint_states_bypassed: u64,
}

impl Stats {
    // A flat table, one entry per counter.
    #[allow(clippy::too_many_lines)]
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
            ("kv_slots_returned", self.kv_slots_returned),
            ("mamba_slots_returned", self.mamba_slots_returned),
            ("evicted_used_states", self.evicted_used_states),
            ("tombstones", self.tombstones),
            ("swa_tombstones", self.swa_tombstones),
            ("swa_evicted_pages", self.swa_evicted_pages),
            ("swa_alloc_failures", self.swa_alloc_failures),
            ("swa_revived_pages", self.swa_revived_pages),
            ("swa_backed_up_pages", self.swa_backed_up_pages),
            ("swa_backup_skipped_pages", self.swa_backup_skipped_pages),
            ("swa_loaded_pages", self.swa_loaded_pages),
            ("swa_window_freed_pages", self.swa_window_freed_pages),
            ("mamba_alloc_failures", self.mamba_alloc_failures),
            ("admits", self.admits),
            ("admits_refused", self.admits_refused),
            ("extends", self.extends),
            ("extends_refused", self.extends_refused),
            ("checkpoints", self.checkpoints),
            ("checkpoint_states_skipped", self.checkpoint_states_skipped),
            ("finishes", self.finishes),
            ("finish_states_lost", self.finish_states_lost),
            ("aborts", self.aborts),
            ("requests_dropped", self.requests_dropped),
            ("cow_copies", self.cow_copies),
            ("batches_completed", self.batches_completed),
            ("batches_failed", self.batches_failed),
            ("batches_abandoned", self.batches_abandoned),
            ("host_hit_tokens", self.host_hit_tokens),
            ("revived_tokens", self.revived_tokens),
            ("backups", self.backups),
            ("backups_done", self.backups_done),
            ("backups_failed", self.backups_failed),
            ("backup_tokens", self.backup_tokens),
            ("backups_skipped", self.backups_skipped),
            ("backup_states_skipped", self.backup_states_skipped),
            ("demotions", self.demotions),
            ("l3_puts", self.l3_puts),
            ("l3_puts_done", self.l3_puts_done),
            ("l3_puts_failed", self.l3_puts_failed),
            ("l3_put_pages", self.l3_put_pages),
            ("l3_put_states", self.l3_put_states),
            ("l3_fetches", self.l3_fetches),
            ("l3_fetch_pages", self.l3_fetch_pages),
            ("l3_fetches_called_off", self.l3_fetches_called_off),
            ("l3_fetches_failed", self.l3_fetches_failed),
            ("l3_landed_pages", self.l3_landed_pages),
            ("l3_gone_objects", self.l3_gone_objects),
            ("l3_eviction_puts", self.l3_eviction_puts),
            ("host_alloc_waits", self.host_alloc_waits),
            ("host_evictions", self.host_evictions),
            ("host_evicted_tokens", self.host_evicted_tokens),
            ("load_backs", self.load_backs),
            ("load_backs_committed", self.load_backs_committed),
            ("load_backs_called_off", self.load_backs_called_off),
            (
                "load_backs_called_off_nothing",
                self.load_backs_called_off_nothing,
            ),
            (
                "load_backs_called_off_busy",
                self.load_backs_called_off_busy,
            ),
            (
                "load_backs_called_off_quota",
                self.load_backs_called_off_quota,
            ),
            (
                "load_backs_called_off_room",
                self.load_backs_called_off_room,
            ),
            (
                "load_backs_called_off_state",
                self.load_backs_called_off_state,
            ),
            ("load_backs_called_off_swa", self.load_backs_called_off_swa),
            (
                "load_backs_called_off_released",
                self.load_backs_called_off_released,
            ),
            ("load_backs_failed", self.load_backs_failed),
            ("loaded_tokens", self.loaded_tokens),
            ("resets", self.resets),
            ("expect_calls", self.expect_calls),
            (
                "checkpoint_states_bypassed",
                self.checkpoint_states_bypassed,
            ),
        ]
    }
}
