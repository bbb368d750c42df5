//! What the cache's calls answer.

use crate::ids::NodeId;

/// The answer of [`super::Cache::match_prefix`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Match {
    /// Tokens reusable from device memory now (a multiple of the page size).
    pub device_len: usize,
    /// Device slots of the first `device_len` tokens.
    pub kv_indices: Vec<i64>,
    /// Further tokens present only on the host tier.
    pub host_len: usize,
    /// The last device node of the match (a root when nothing matched).
    pub node: NodeId,
    /// The last node counting host data (`node` when `host_len == 0`).
    pub host_node: NodeId,
    /// Device state slot at `device_len`, if the model has Mamba layers.
    pub mamba_slot: Option<u32>,
    /// The deepest page-aligned KV match on any tier, ignoring states (the branch point).
    pub kv_len: usize,
    /// With page hashes: the hash of the last page of the match counting host data
    /// (the page ending at `device_len + host_len`, the end of `host_node`), from which
    /// [`super::Cache::chain_hashes`] hashes the rest of a prompt; `None` when nothing
    /// matched or page hashes are off. Read from the node: a match hashes nothing.
    pub last_hash: Option<crate::hashes::PageHash>,
}

/// The answer of [`super::Cache::peek_prefix`]: the lengths a [`Match`] would have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peek {
    /// As [`Match::device_len`].
    pub device_len: usize,
    /// As [`Match::host_len`].
    pub host_len: usize,
    /// As [`Match::kv_len`].
    pub kv_len: usize,
    /// The hash of the page ending at `kv_len` (`None` when nothing matched or without
    /// page hashes): where the chain of the tokens past the cached KV continues from.
    pub kv_hash: Option<crate::hashes::PageHash>,
}

/// The answer of [`super::Cache::insert`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Insert {
    /// Tokens that were already cached (their passed slots were freed, except the
    /// caller's own prefix below `owned_from`).
    pub prefix_len: usize,
    /// The node where the insert ended (a root when no whole page was given).
    pub node: NodeId,
    /// Whether that node already had a Mamba state (always false without Mamba layers).
    pub mamba_existed: bool,
}

/// What [`super::Cache::evict`] actually evicted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Evicted {
    /// Device KV tokens freed.
    pub kv_tokens: usize,
    /// Device Mamba states freed.
    pub mamba_states: usize,
    /// When the engine owns the slots: every slot of every KV page the eviction freed,
    /// the engine's on return (empty otherwise: the pages went to the cache's free list).
    pub kv_indices: Vec<i64>,
    /// When the engine owns the slots: the state slots the eviction freed, the engine's
    /// on return (empty otherwise).
    pub mamba_slots: Vec<i64>,
}

/// One node as seen by [`super::Cache::snapshot`] (tests, tools and pretty printing).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeInfo {
    /// The node's handle.
    pub id: NodeId,
    /// Its namespace (`None` for the default one).
    pub namespace: Option<String>,
    /// Every token from the root to the end of this node.
    pub prefix: Vec<u32>,
    /// Tokens of this node alone (the tail of `prefix`).
    pub key_len: usize,
    /// Device slots of this node's tokens, if it has device KV.
    pub kv_indices: Option<Vec<i64>>,
    /// Live receipts covering the node.
    pub lock: u32,
    /// Logical time of the last access.
    pub last_access: u64,
    /// Device Mamba state slot at the node's end, if any.
    pub mamba_slot: Option<u32>,
    /// Receipts holding that state.
    pub mamba_lock: u32,
    /// Host-tier slots of this node's tokens, if it is backed up.
    pub host_kv_indices: Option<Vec<i64>>,
    /// Host-tier state slot, if its state is backed up.
    pub host_mamba_slot: Option<u32>,
    /// Its device data arrived by a load-back whose copies are not acknowledged yet.
    pub loading: bool,
}

/// What a match found, without the slots (see `Cache::find`).
pub(crate) struct Found {
    /// Tokens reusable from device memory now.
    pub device_len: usize,
    /// Further tokens present only on the host tier.
    pub host_len: usize,
    /// The last device node of the match.
    pub end: u32,
    /// The last node counting host data.
    pub host_end: u32,
    /// Device state slot at `device_len`.
    pub mamba_slot: Option<u32>,
    /// The deepest page-aligned KV match on any tier (the branch point).
    pub kv_len: usize,
}

/// Why a load-back was called off: `load_back` returned `None`, or the guard was
/// released uncommitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallOff {
    /// No KV token and no state to load.
    Nothing,
    /// Part of the path is being loaded by a committed load-back still in flight.
    Busy,
    /// More KV tokens than `mem_quota` plus what the lock newly protected.
    Quota,
    /// No room for the KV pages even after eviction.
    Room,
    /// No state slot even after eviction.
    State,
    /// SWA: the target's window is not live (counting host-only nodes by their host SWA
    /// pages), or no device SWA pages for it even after SWA eviction.
    Swa,
    /// The guard was released (or dropped) without `commit`.
    Released,
}

impl CallOff {
    /// The name used in stats (`load_backs_called_off_<name>`).
    pub fn as_str(self) -> &'static str {
        match self {
            CallOff::Nothing => "nothing",
            CallOff::Busy => "busy",
            CallOff::Quota => "quota",
            CallOff::Room => "room",
            CallOff::State => "state",
            CallOff::Swa => "swa",
            CallOff::Released => "released",
        }
    }
}
