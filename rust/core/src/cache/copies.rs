//! The copy vocabulary: what a transfer batch is made of (copies between pool slots,
//! on which tier, of which pool) and the plain answers about batches. A leaf: it names
//! nothing of the cache, so every part that emits, runs or checks copies can use it.

use crate::ids::BatchId;

/// Why a batch exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchKind {
    /// Copy-on-write of a Mamba state (device to device).
    Cow,
    /// Device to host backup.
    Backup,
    /// Host to device load.
    LoadBack,
    /// Host pages written to the L3 tier (`l3.rs`).
    L3Put,
    /// Pages fetched from the L3 tier into host pages (`l3.rs`).
    L3Get,
}

impl BatchKind {
    /// The name used in the Python API.
    pub fn as_str(self) -> &'static str {
        match self {
            BatchKind::Cow => "cow",
            BatchKind::Backup => "backup",
            BatchKind::LoadBack => "load_back",
            BatchKind::L3Put => "l3_put",
            BatchKind::L3Get => "l3_get",
        }
    }
}

/// Which pool a copy moves slots of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolKind {
    /// The attention KV pool (token slots).
    Kv,
    /// The Mamba state pool (one slot per state).
    Mamba,
    /// The sliding-window attention KV pool (token slots, paired page by page with the
    /// KV pool's: a copy of SWA slots comes with the copy of their KV pages' slots).
    Swa,
}

impl PoolKind {
    /// The name used in the Python API.
    pub fn as_str(self) -> &'static str {
        match self {
            PoolKind::Kv => "kv",
            PoolKind::Mamba => "mamba",
            PoolKind::Swa => "swa",
        }
    }
}

/// Which memory a slot index refers to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    /// GPU memory.
    Device,
    /// Host (pinned CPU) memory.
    Host,
    /// The L3 tier's store: a slot is a position in the batch's objects (object `k` of
    /// a KV copy is slots `k * page_size..(k + 1) * page_size`, of a state copy slot
    /// `k`), each object named by the batch's `keys`.
    External,
}

impl Tier {
    /// The name used in the Python API.
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Device => "device",
            Tier::Host => "host",
            Tier::External => "external",
        }
    }
}

/// One copy: slot `src[i]` of `src_tier` to slot `dst[i]` of `dst_tier`, in `pool`
/// (Python: `Copy`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotCopy {
    /// The pool whose slots move.
    pub pool: PoolKind,
    /// Where the data is read.
    pub src_tier: Tier,
    /// Where the data is written.
    pub dst_tier: Tier,
    /// Source slots.
    pub src: Vec<i64>,
    /// Destination slots, one per source slot.
    pub dst: Vec<i64>,
}

/// A batch of copies for the engine to run, then `complete` or `fail`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferBatch {
    /// The id to acknowledge.
    pub id: BatchId,
    /// Why it exists.
    pub kind: BatchKind,
    /// The copies, in the order they may run.
    pub copies: Vec<SlotCopy>,
    /// For a batch with an [`Tier::External`] side (`l3_put`, `l3_get`): the page hash
    /// naming each object, those of the KV copy's pages first, then those of the state
    /// copy's states (a state is named by the hash of the page it ends). Empty otherwise.
    pub keys: Vec<crate::hashes::PageHash>,
}

/// What `Cache::abandon` did with a batch whose owner let go of it before it ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Abandoned {
    /// Nothing: the batch had ended, was abandoned already, or is still owned by its
    /// load-back guard.
    Nothing,
    /// Never started: failed, and every slot it held is back.
    Failed,
    /// Started: its copies may still run, so it stays in flight, holding everything
    /// it holds, until it is acknowledged by id; either acknowledgement then fails it.
    Draining,
}

/// Pages of one pool and tier that a batch reads or writes.
pub(crate) struct Pins {
    pub pool: PoolKind,
    pub tier: Tier,
    pub pages: Vec<u32>,
}

/// The slots of one copy: sources, destinations.
pub(crate) type CopySlots = (Vec<i64>, Vec<i64>);
