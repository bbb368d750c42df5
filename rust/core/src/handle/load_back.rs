//! [`LoadBack`]: the guard of a load-back in progress, handed out by
//! [`HybridCache::load_back`] and [`HybridCache::load_back_request`] (or
//! [`HybridCache::own_load`], for a record the core gave). It owns everything the load
//! took: the lock on the path, the device slots the host-only part is copied into, the
//! slot restoring the state. [`LoadBack::commit`] publishes them; dropped uncommitted,
//! the guard calls the load off and every slot goes back to the pools (at once if its
//! batch never started, else when the batch is acknowledged).

use std::fmt;

use crate::cache::{LoadRecord, LoadTarget, TransferBatch};
use crate::error::Result;
use crate::ids::{BatchId, NodeId, RequestId};

use super::batch::Batch;
use super::hybrid::HybridCache;
use super::request::Request;

impl HybridCache {
    /// Starts a load-back of the host-only part of the path to `node`, for `request`
    /// when given (see [`Cache::load_back`]). `Ok(None)`: called off, nothing taken.
    /// The returned guard owns everything the load took until [`LoadBack::commit`];
    /// dropping it uncommitted gives it all back.
    ///
    /// [`Cache::load_back`]: crate::Cache::load_back
    pub fn load_back(
        &self,
        node: NodeId,
        mem_quota: Option<usize>,
        request: Option<&Request>,
    ) -> Result<Option<LoadBack>> {
        let request = request
            .map(|r| self.request_id(r, "load_back"))
            .transpose()?;
        self.guard(LoadTarget::Node(node), mem_quota, request)
    }

    /// Starts a load-back of what `request`'s admission found on the host tier.
    pub fn load_back_request(
        &self,
        request: &Request,
        mem_quota: Option<usize>,
    ) -> Result<Option<LoadBack>> {
        let id = self.request_id(request, "load_back")?;
        self.guard(LoadTarget::Request(id), mem_quota, None)
    }

    fn guard(
        &self,
        target: LoadTarget,
        mem_quota: Option<usize>,
        request: Option<RequestId>,
    ) -> Result<Option<LoadBack>> {
        let record = self.call(|c| c.load_back(target, mem_quota, request))?;
        Ok(record.map(|record| self.own_load(record)))
    }

    /// The guard that shares `record` (from [`Cache::load_back`] on this cache's core):
    /// dropped uncommitted, it calls the load off.
    ///
    /// [`Cache::load_back`]: crate::Cache::load_back
    pub fn own_load(&self, record: LoadRecord) -> LoadBack {
        LoadBack {
            cache: self.clone(),
            id: record.id(),
            batch: record.batch().clone(),
            kv_tokens: record.kv_tokens(),
            record: Some(record),
        }
    }
}

/// A load-back in progress: owns (through its [`LoadRecord`]) the lock on the path being
/// loaded, the device KV slots for the host-only nodes, the slot restoring the node's
/// state and the request's fresh state slot. [`LoadBack::commit`] publishes them;
/// dropping the guard uncommitted (early return, error, panic) releases the lock and
/// returns every slot, at once if its batch was never started, else when the batch is
/// acknowledged.
///
/// # Examples
///
/// ```
/// use radixcache_core::{Config, HybridCache};
///
/// // 16 device KV slots, and a host tier of 16 that backs up every insert.
/// let cache = HybridCache::new(Config { host_kv_slots: 16, ..Config::kv(16, 1) })?;
/// // [1, 2, 3, 4] cached, backed up, then evicted from the device: on the host only.
/// let node = cache.call(|c| {
///     let slots = c.alloc_kv(4)?.expect("16 slots are free");
///     let node = c.insert(None, &[1, 2, 3, 4], &slots, 0)?.node;
///     for backup in c.take_batches() {
///         c.complete(backup.id)?;
///     }
///     c.evict(4, 0);
///     Ok(node)
/// })?;
/// let device_free = |cache: &HybridCache| cache.with(|c| c.available_kv());
/// assert_eq!(device_free(&cache)?, 16);
///
/// let load = cache.load_back(node, None, None)?.expect("the host holds the path");
/// assert_eq!(load.kv_tokens(), 4);
/// assert_eq!(device_free(&cache)?, 12);
/// // Dropped uncommitted (its copies never ran), the guard gives its slots back.
/// drop(load);
/// assert_eq!(device_free(&cache)?, 16);
///
/// // Committed, with its host-to-device copies (`load.batch()`) acknowledged, the
/// // path is on the device again.
/// let load = cache.load_back(node, None, None)?.expect("the host holds the path");
/// let id = load.id();
/// load.commit()?;
/// cache.call(|c| c.complete(id))?;
/// assert_eq!(cache.with(|c| c.match_prefix(None, &[1, 2, 3, 4]).device_len)?, 4);
/// # Ok::<(), radixcache_core::Error>(())
/// ```
#[must_use = "dropping a LoadBack uncommitted calls the load off"]
#[clippy::has_significant_drop]
pub struct LoadBack {
    cache: HybridCache,
    id: BatchId,
    batch: TransferBatch,
    kv_tokens: usize,
    /// `None` once committed or released.
    record: Option<LoadRecord>,
}

impl fmt::Debug for LoadBack {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoadBack")
            .field("record", &self.record)
            .finish_non_exhaustive()
    }
}

impl LoadBack {
    /// The batch id (acknowledge it with `complete` / `fail`).
    pub fn id(&self) -> BatchId {
        self.id
    }

    /// The copies to run (host to device), before or after commit.
    pub fn batch(&self) -> &TransferBatch {
        &self.batch
    }

    /// KV tokens this load moves.
    pub fn kv_tokens(&self) -> usize {
        self.kv_tokens
    }

    /// A handle on the batch that does not own it (the guard owns it until commit, then
    /// the cache, acknowledged by id): dropping the handle does nothing.
    pub fn batch_handle(&self) -> Batch {
        self.cache.batch_handle(self.batch.clone(), false)
    }

    /// Publishes the load (see [`Cache::commit_load`]). On error (the copies failed,
    /// or the request extended since) the load is called off: everything goes back.
    ///
    /// [`Cache::commit_load`]: crate::Cache::commit_load
    pub fn commit(mut self) -> Result<()> {
        let Some(record) = self.record.take() else {
            return Ok(());
        };
        self.cache.call(|c| c.commit_load(record))
    }
}

impl Drop for LoadBack {
    fn drop(&mut self) {
        if let Some(record) = self.record.take() {
            self.cache.core.lock().settle(|c| c.cancel_load(record));
        }
    }
}
