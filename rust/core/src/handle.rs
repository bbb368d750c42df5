//! [`HybridCache`]: the shareable handle over the core, and [`Lock`], the owned receipt.
//!
//! The handle puts the single-threaded [`Cache`] behind a mutex so that receipts (and,
//! later, requests and load-back guards) can own what they took and give it back when
//! dropped, from any thread. Rule that keeps this deadlock-free: nothing that owns a
//! receipt is dropped while the cache mutex is held, and the mutex is never held while
//! calling into user code (in Python: while creating Python objects).

use std::fmt;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::cache::{BatchId, Cache, LoadTarget, LockId, RequestId, TransferBatch};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::tree::NodeId;

/// A cache that can be shared between owners. Cloning shares the same cache.
#[derive(Clone)]
pub struct HybridCache {
    core: Arc<Mutex<Cache>>,
}

impl fmt::Debug for HybridCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.core.lock().summary())
    }
}

impl HybridCache {
    /// A cache with the given configuration (errors name the bad argument).
    pub fn new(config: Config) -> Result<HybridCache> {
        Ok(HybridCache {
            core: Arc::new(Mutex::new(Cache::new(config)?)),
        })
    }

    /// Runs `f` with exclusive access to the core. `f` must not drop a [`Lock`] of this
    /// cache (it would wait on the mutex `f` holds).
    pub fn with<R>(&self, f: impl FnOnce(&mut Cache) -> R) -> R {
        f(&mut self.core.lock())
    }

    /// True when both handles share one cache.
    pub fn same_cache(&self, other: &HybridCache) -> bool {
        Arc::ptr_eq(&self.core, &other.core)
    }

    /// Locks the path from `node` to its root; the lock is released when the returned
    /// receipt is released or dropped.
    pub fn lock(&self, node: NodeId) -> Result<Lock> {
        let id = self.core.lock().lock(node)?;
        Ok(Lock {
            core: Arc::clone(&self.core),
            id: Some(id),
            node,
        })
    }

    /// Admits a request (see [`Cache::admit`]); the returned handle aborts the request if
    /// it is dropped while the request is live. `None`: no state slot for its copy.
    pub fn admit(&self, namespace: Option<&str>, tokens: &[u32]) -> Option<Request> {
        let id = self.core.lock().admit(namespace, tokens)?;
        Some(Request {
            core: Arc::clone(&self.core),
            id,
        })
    }

    /// The request's id in this cache, or an error for a request of another cache.
    pub fn request_id(&self, request: &Request) -> Result<RequestId> {
        if Arc::ptr_eq(&self.core, &request.core) {
            Ok(request.id)
        } else {
            Err(Error::Request(format!(
                "request {} belongs to another cache",
                request.id
            )))
        }
    }

    /// Starts a load-back of the host-only part of the path to `node`, for `request`
    /// when given (see [`Cache::load_back`]). `Ok(None)`: called off, nothing taken.
    /// The returned guard owns everything the load took until [`LoadBack::commit`];
    /// dropping it uncommitted gives it all back.
    pub fn load_back(
        &self,
        node: NodeId,
        mem_quota: Option<usize>,
        request: Option<&Request>,
    ) -> Result<Option<LoadBack>> {
        let request = request.map(|r| self.request_id(r)).transpose()?;
        self.guard(LoadTarget::Node(node), mem_quota, request)
    }

    /// Starts a load-back of what `request`'s admission found on the host tier.
    pub fn load_back_request(
        &self,
        request: &Request,
        mem_quota: Option<usize>,
    ) -> Result<Option<LoadBack>> {
        let id = self.request_id(request)?;
        self.guard(LoadTarget::Request(id), mem_quota, None)
    }

    fn guard(
        &self,
        target: LoadTarget,
        mem_quota: Option<usize>,
        request: Option<RequestId>,
    ) -> Result<Option<LoadBack>> {
        let mut core = self.core.lock();
        let Some(id) = core.load_back(target, mem_quota, request)? else {
            return Ok(None);
        };
        let batch = core.load_batch(id)?;
        let kv_tokens = core.load_kv_tokens(id)?;
        drop(core);
        Ok(Some(LoadBack {
            core: Arc::clone(&self.core),
            id,
            batch,
            kv_tokens,
            live: true,
        }))
    }

    /// Releases the receipt in `slot` and empties it. An empty slot (released already)
    /// or a receipt of another cache raises [`Error::Lock`]; the receipt then stays
    /// where it was.
    pub fn unlock(&self, slot: &mut Option<Lock>) -> Result<()> {
        match slot {
            None => Err(Error::Lock("this lock was already released".to_owned())),
            Some(lock) if !Arc::ptr_eq(&lock.core, &self.core) => {
                Err(Error::Lock("this lock belongs to another cache".to_owned()))
            }
            Some(_) => slot.take().map_or(Ok(()), Lock::release),
        }
    }
}

/// A load-back in progress: owns the lock on the path being loaded, the device KV
/// slots for the host-only nodes, the slot restoring the node's state and the
/// request's fresh state slot. [`LoadBack::commit`] publishes them; dropping the guard
/// uncommitted (early return, error, panic) releases the lock and returns every slot,
/// at once if its batch was never started, else when the batch is acknowledged.
#[must_use = "dropping a LoadBack uncommitted calls the load off"]
#[clippy::has_significant_drop]
pub struct LoadBack {
    core: Arc<Mutex<Cache>>,
    id: BatchId,
    batch: TransferBatch,
    kv_tokens: usize,
    live: bool,
}

impl fmt::Debug for LoadBack {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoadBack")
            .field("id", &self.id)
            .field("kv_tokens", &self.kv_tokens)
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

    /// Publishes the load (see [`Cache::commit_load`]). On error (the copies failed,
    /// or the request extended since) the guard is dropped, which releases everything.
    pub fn commit(mut self) -> Result<()> {
        let out = self.core.lock().commit_load(self.id);
        if out.is_ok() {
            self.live = false;
        }
        out
    }
}

impl Drop for LoadBack {
    fn drop(&mut self) {
        if self.live {
            let _ = self.core.lock().cancel_load(self.id);
        }
    }
}

/// An owned lock receipt: the path from `node` to the root stays protected from
/// eviction until it is released, explicitly or by dropping it.
#[must_use = "dropping a Lock releases it at once"]
#[clippy::has_significant_drop]
pub struct Lock {
    core: Arc<Mutex<Cache>>,
    id: Option<LockId>,
    node: NodeId,
}

impl fmt::Debug for Lock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lock")
            .field("node", &self.node)
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl Lock {
    /// The node whose path is locked (as it was when locked; a split above it keeps the
    /// handle valid).
    pub fn node(&self) -> NodeId {
        self.node
    }

    /// Releases the lock.
    pub fn release(mut self) -> Result<()> {
        match self.id.take() {
            Some(id) => self.core.lock().unlock(id),
            None => Ok(()),
        }
    }
}

impl Drop for Lock {
    fn drop(&mut self) {
        if let Some(id) = self.id.take() {
            // Cannot fail: this receipt is live (only `release` or this drop ends it).
            let _ = self.core.lock().unlock(id);
        }
    }
}

/// An owned request handle: while its request is live, dropping the handle aborts it
/// (everything it holds goes back). Finish or abort it through the cache.
#[must_use = "dropping a Request aborts it"]
#[clippy::has_significant_drop]
pub struct Request {
    core: Arc<Mutex<Cache>>,
    id: RequestId,
}

impl fmt::Debug for Request {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Request")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl Request {
    /// The request's id (stale once it is finished or aborted).
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// Whether the request still holds anything.
    pub fn is_live(&self) -> bool {
        self.core.lock().request_live(self.id)
    }

    /// Runs `f` with read access to the request's cache.
    pub fn with<R>(&self, f: impl FnOnce(&Cache) -> R) -> R {
        f(&self.core.lock())
    }

    /// A handle to the request's cache.
    pub fn cache(&self) -> HybridCache {
        HybridCache {
            core: Arc::clone(&self.core),
        }
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        let mut core = self.core.lock();
        if core.request_live(self.id) {
            core.drop_request(self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache() -> HybridCache {
        HybridCache::new(Config::kv(16, 1)).unwrap()
    }

    fn cached(c: &HybridCache, toks: &[u32]) -> NodeId {
        c.with(|core| {
            let slots = core.alloc_kv(toks.len()).unwrap().unwrap();
            core.insert(None, toks, &slots, 0).unwrap().node
        })
    }

    #[test]
    fn dropping_a_lock_releases_it() {
        let c = cache();
        let node = cached(&c, &[1, 2, 3]);
        {
            let _l = c.lock(node).unwrap();
            assert_eq!(c.with(|core| core.protected_size()), 3);
        }
        assert_eq!(c.with(|core| core.protected_size()), 0);
        c.with(|core| core.audit()).unwrap();
    }

    #[test]
    fn panic_inside_a_lock_scope_releases_it() {
        let c = cache();
        let node = cached(&c, &[1, 2]);
        let c2 = c.clone();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            let _l = c2.lock(node).unwrap();
            panic!("scheduler bug");
        }));
        assert!(r.is_err());
        assert_eq!(
            c.with(|core| (core.protected_size(), core.evictable_size())),
            (0, 2)
        );
        c.with(|core| core.audit()).unwrap();
    }

    /// A hybrid cache with a host tier holding [1, 2, 3, 4] (and its state) on the host
    /// only; returns the cache and the node.
    fn demoted() -> (HybridCache, NodeId) {
        let c = HybridCache::new(Config {
            mamba_slots: 4,
            host_kv_slots: 16,
            host_mamba_slots: 2,
            ..Config::kv(16, 1)
        })
        .unwrap();
        let node = c.with(|core| {
            let slots = core.alloc_kv(4).unwrap().unwrap();
            let state = core.alloc_mamba().map(i64::from);
            let node = core
                .insert_with_state(None, &[1, 2, 3, 4], &slots, 0, state)
                .unwrap()
                .node;
            for b in core.take_batches() {
                core.complete(b.id).unwrap();
            }
            core.evict(4, 0);
            node
        });
        (c, node)
    }

    fn pool_counts(c: &HybridCache) -> Vec<crate::PoolCounts> {
        c.with(|core| {
            vec![
                core.kv_counts(),
                core.mamba_counts(),
                core.host_kv_pool().counts(),
                core.host_mamba_pool().counts(),
            ]
        })
    }

    #[test]
    fn panic_inside_a_load_back_scope_gives_back_every_slot() {
        let (c, node) = demoted();
        let request = c.admit(None, &[1, 2, 3, 4]).unwrap();
        let before = pool_counts(&c);
        let (c2, r2) = (c.clone(), &request);
        let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            let lb = c2.load_back(node, None, Some(r2)).unwrap().unwrap();
            assert_eq!(lb.kv_tokens(), 4);
            panic!("engine failed mid-copy");
        }));
        assert!(out.is_err());
        assert_eq!(pool_counts(&c), before, "the guard's slots went back");
        let id = request.id();
        let view = c.with(|core| core.request(id)).unwrap();
        assert_eq!(
            (view.prefix_len, view.mamba_slot, view.load_pending),
            (0, None, None)
        );
        c.with(|core| core.audit()).unwrap();
    }

    #[test]
    fn committed_guard_publishes_and_a_dropped_one_does_not() {
        let (c, node) = demoted();
        let request = c.admit(None, &[1, 2, 3, 4]).unwrap();
        drop(c.load_back_request(&request, None).unwrap().unwrap());
        assert_eq!(
            c.with(|core| core.request(request.id()))
                .unwrap()
                .prefix_len,
            0
        );
        let lb = c.load_back_request(&request, None).unwrap().unwrap();
        let id = lb.id();
        assert_eq!(lb.batch().copies.len(), 3);
        lb.commit().unwrap();
        c.with(|core| core.complete(id)).unwrap();
        let view = c.with(|core| core.request(request.id())).unwrap();
        assert_eq!((view.prefix_len, view.node), (4, node));
        c.with(|core| core.audit()).unwrap();
    }

    #[test]
    fn second_unlock_and_foreign_unlock_fail() {
        let c = cache();
        let other = cache();
        let node = cached(&c, &[4, 5]);
        let mut slot = Some(c.lock(node).unwrap());
        let err = other.unlock(&mut slot).unwrap_err();
        assert!(matches!(err, Error::Lock(_)));
        assert!(slot.is_some(), "a foreign unlock leaves the receipt alone");
        c.unlock(&mut slot).unwrap();
        assert!(matches!(c.unlock(&mut slot), Err(Error::Lock(_))));
        c.with(|core| core.audit()).unwrap();
    }
}
