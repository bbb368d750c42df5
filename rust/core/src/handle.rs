//! [`HybridCache`]: the shareable handle over the core, and the owned handles it gives
//! ([`Lock`], [`Request`], [`LoadBack`], [`Batch`]).
//!
//! The handle puts the single-threaded [`Cache`] behind a mutex so that owned handles
//! can give back what they hold when dropped, from any thread. The core's own owned
//! values (lock receipts, load-back records) do the ownership; the handles only share
//! them and, when dropped, hand them back at once rather than at the cache's next call.
//! Rules that keep this deadlock-free: nothing that owns a receipt is dropped while the
//! cache mutex is held by the same thread, and the mutex is never held while calling
//! into user code (in Python: while creating Python objects).
//!
//! Every call runs through [`HybridCache::with`]: a panic inside the core (a bug) is
//! caught there, and the cache is marked broken, since the change it interrupted may be
//! half done; so is an illegal page transition the pools refused (also a bug, see
//! [`crate::Pool::fault`]). Every later call then fails with [`Error::Broken`]; dropping handles stays
//! safe (they give back nothing to a broken cache).

use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::cache::{Abandoned, Cache, LoadRecord, LoadTarget, LockReceipt, TransferBatch};
use crate::config::{Config, PoolOwner};
use crate::error::{Error, Result};
use crate::ids::{BatchId, NodeId, RequestId};

/// The cache and whether a panic left it broken.
struct Shared {
    cache: Cache,
    /// Why the cache is broken (a panic interrupted a change), if it is.
    broken: Option<String>,
}

impl Shared {
    /// Runs `f` on the cache unless it is broken; a panic in `f` breaks it, and so does
    /// an illegal page transition (recorded by the pools, during `f` or since the last
    /// call: a [`crate::Pages`] value may drop anywhere). The pools refuse such a
    /// transition, so their books hold; what `f` returned is dropped, since it may
    /// describe a change half done, and every later call fails.
    fn enter<R>(&mut self, f: impl FnOnce(&mut Cache) -> R) -> Result<R> {
        if let Some(why) = &self.broken {
            return Err(Error::Broken(why.clone()));
        }
        let cache = &mut self.cache;
        let out = catch_unwind(AssertUnwindSafe(|| {
            cache.reap();
            f(cache)
        }));
        match out {
            Ok(r) if !self.cache.faulted() => Ok(r),
            Ok(_) => Err(self.break_on_fault()),
            Err(payload) => Err(self.break_on_panic(payload.as_ref())),
        }
    }

    #[cold]
    fn break_on_fault(&mut self) -> Error {
        let why = self.cache.fault().unwrap_or_default();
        self.broken = Some(why.clone());
        Error::Broken(why)
    }

    #[cold]
    fn break_on_panic(&mut self, payload: &(dyn std::any::Any + Send)) -> Error {
        let why = match payload.downcast_ref::<&str>() {
            Some(s) => (*s).to_owned(),
            None => payload
                .downcast_ref::<String>()
                .cloned()
                .unwrap_or_else(|| "a panic".to_owned()),
        };
        self.broken = Some(why.clone());
        Error::Broken(why)
    }

    /// Runs `f` for a handle being dropped: nothing when the cache is broken (what the
    /// handle held then stays where it is: the cache is not used again).
    fn settle(&mut self, f: impl FnOnce(&mut Cache)) {
        let _ = self.enter(f);
    }
}

/// A cache that can be shared between owners. Cloning shares the same cache.
#[derive(Clone)]
pub struct HybridCache {
    core: Arc<Mutex<Shared>>,
    /// The engine owns the slots (`pools="engine"`): no request can exist.
    engine_owned: bool,
}

impl fmt::Debug for HybridCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.with(|c| c.summary()) {
            Ok(s) => f.write_str(&s),
            Err(e) => write!(f, "HybridCache({e})"),
        }
    }
}

impl HybridCache {
    /// A cache with the given configuration (errors name the bad argument).
    pub fn new(config: Config) -> Result<HybridCache> {
        let engine_owned = config.pools == PoolOwner::Engine;
        Ok(HybridCache {
            core: Arc::new(Mutex::new(Shared {
                cache: Cache::new(config)?,
                broken: None,
            })),
            engine_owned,
        })
    }

    /// Runs `f` with exclusive access to the core, after settling what was dropped since
    /// the last call. `f` must not drop a handle of this cache (it would wait on the
    /// mutex `f` holds). A panic in `f` marks the cache broken and returns
    /// [`Error::Broken`], as does every call after it.
    pub fn with<R>(&self, f: impl FnOnce(&mut Cache) -> R) -> Result<R> {
        self.core.lock().enter(f)
    }

    /// [`HybridCache::with`] for a call that can fail itself.
    pub fn call<R>(&self, f: impl FnOnce(&mut Cache) -> Result<R>) -> Result<R> {
        self.with(f)?
    }

    /// [`HybridCache::with`] when no other thread holds the cache; otherwise, without
    /// waiting, `Err(f)`: the caller may then wait in a way of its own (the Python
    /// binding releases the GIL first).
    pub fn with_uncontended<R, F: FnOnce(&mut Cache) -> R>(
        &self,
        f: F,
    ) -> std::result::Result<Result<R>, F> {
        match self.core.try_lock() {
            Some(mut core) => Ok(core.enter(f)),
            None => Err(f),
        }
    }

    /// Why the cache is broken, if a panic or an illegal page transition broke it (the
    /// latter is reported from the next call on).
    pub fn broken(&self) -> Option<String> {
        let core = self.core.lock();
        core.broken.clone().or_else(|| core.cache.fault())
    }

    /// True when both handles share one cache.
    pub fn same_cache(&self, other: &HybridCache) -> bool {
        Arc::ptr_eq(&self.core, &other.core)
    }

    /// Locks the path from `node` to its root; the lock is released when the returned
    /// handle is released or dropped.
    pub fn lock(&self, node: NodeId) -> Result<Lock> {
        let receipt = self.call(|c| c.lock(node))?;
        Ok(self.own_lock(receipt, node))
    }

    /// The handle that shares `receipt` (from [`Cache::lock`] on this cache's core, for
    /// `node`): it releases the lock when released or dropped.
    pub fn own_lock(&self, receipt: LockReceipt, node: NodeId) -> Lock {
        Lock {
            cache: self.clone(),
            receipt: Some(receipt),
            node,
        }
    }

    /// Admits a request (see [`Cache::admit`]); the returned handle aborts the request if
    /// it is dropped while the request is live. `None`: no state slot for its copy.
    pub fn admit(&self, namespace: Option<&str>, tokens: &[u32]) -> Result<Option<Request>> {
        self.admit_with_priority(namespace, tokens, 0)
    }

    /// [`HybridCache::admit`] for a request of `priority` (see
    /// [`Cache::admit_with_priority`]).
    pub fn admit_with_priority(
        &self,
        namespace: Option<&str>,
        tokens: &[u32],
        priority: i64,
    ) -> Result<Option<Request>> {
        let id = self.call(|c| c.admit_with_priority(namespace, tokens, priority))?;
        id.map(|id| self.own_request(id)).transpose()
    }

    /// The handle that owns request `id` (from [`Cache::admit`] on this cache's core):
    /// dropped while the request is live, it aborts it. A request has at most one such
    /// handle: one that is not live, or is owned already, raises [`Error::Request`].
    pub fn own_request(&self, id: RequestId) -> Result<Request> {
        self.call(|c| c.own_request(id))?;
        Ok(self.request_handle(id))
    }

    /// The handle of request `id`, which [`Cache::own_request`] marked as owned within
    /// the same call on the core (so that admitting and owning take the cache once).
    pub fn request_handle(&self, id: RequestId) -> Request {
        Request {
            cache: self.clone(),
            id,
        }
    }

    /// The request's id in this cache for `call` (the request call it is for), or an
    /// error for a request of another cache. With engine-owned pools no request can be
    /// this cache's: `call` is refused ([`Error::EngineOwned`]).
    pub fn request_id(&self, request: &Request, call: &'static str) -> Result<RequestId> {
        if self.engine_owned {
            return Err(Error::EngineOwned(call));
        }
        if self.same_cache(&request.cache) {
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
    pub fn own_load(&self, record: LoadRecord) -> LoadBack {
        LoadBack {
            cache: self.clone(),
            id: record.id(),
            batch: record.batch().clone(),
            kv_tokens: record.kv_tokens(),
            record: Some(record),
        }
    }

    /// The batches the cache emitted since the last call (copy-on-write, backups), each
    /// owned by its handle until it ends: see [`Batch`].
    pub fn take_batches(&self) -> Result<Vec<Batch>> {
        Ok(self.own_batches(self.with(Cache::take_batches)?))
    }

    /// The handles that own `batches` (from [`Cache::take_batches`] on this cache's
    /// core): each, dropped before its batch ended, abandons it ([`Cache::abandon`]).
    pub fn own_batches(&self, batches: Vec<TransferBatch>) -> Vec<Batch> {
        batches
            .into_iter()
            .map(|b| self.batch_handle(b, true))
            .collect()
    }

    /// A handle on `batch`; `owns`: whether dropping it abandons the batch.
    fn batch_handle(&self, batch: TransferBatch, owns: bool) -> Batch {
        Batch {
            cache: self.clone(),
            copies: batch,
            state: Mutex::new(BatchState {
                owns,
                outcome: None,
            }),
        }
    }

    /// Releases the lock in `slot` and empties it. An empty slot (released already)
    /// or a lock of another cache raises [`Error::Lock`]; the lock then stays where it
    /// was.
    pub fn unlock(&self, slot: &mut Option<Lock>) -> Result<()> {
        match slot {
            None => Err(Error::Lock("this lock was already released".to_owned())),
            Some(lock) if !lock.cache.same_cache(self) => {
                Err(Error::Lock("this lock belongs to another cache".to_owned()))
            }
            Some(_) => slot.take().map_or(Ok(()), Lock::release),
        }
    }
}

/// A load-back in progress: owns (through its [`LoadRecord`]) the lock on the path being
/// loaded, the device KV slots for the host-only nodes, the slot restoring the node's
/// state and the request's fresh state slot. [`LoadBack::commit`] publishes them;
/// dropping the guard uncommitted (early return, error, panic) releases the lock and
/// returns every slot, at once if its batch was never started, else when the batch is
/// acknowledged.
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

/// How a [`Batch`] ended, as far as its handle knows (an acknowledgement by id through
/// the cache does not reach the handle).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// [`Batch::complete`] succeeded.
    Completed,
    /// [`Batch::fail`] or [`Batch::close`] failed it, for this reason.
    Failed(String),
    /// The handle let go of it before it ended ([`Batch::abandon`], or dropped).
    Abandoned(Abandoned),
}

struct BatchState {
    /// Whether dropping the handle abandons the batch.
    owns: bool,
    outcome: Option<Outcome>,
}

/// A transfer batch handed out by the cache, owned by this handle until it ends: run its
/// copies between [`Batch::start`] and [`Batch::complete`] (or [`Batch::fail`]).
/// Dropped before it ended, it is abandoned: failed if never started; if started, it
/// stays in flight, holding its slots, until it is acknowledged by id (which fails it),
/// since its copies may still run (see [`Cache::abandon`]). Its methods take `&self`, so
/// that it can be shared.
#[must_use = "dropping a Batch before it ended fails it"]
#[clippy::has_significant_drop]
pub struct Batch {
    cache: HybridCache,
    copies: TransferBatch,
    state: Mutex<BatchState>,
}

impl fmt::Debug for Batch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Batch")
            .field("id", &self.copies.id)
            .field("kind", &self.copies.kind)
            .field("outcome", &self.state.lock().outcome)
            .finish_non_exhaustive()
    }
}

impl Batch {
    /// The batch id.
    pub fn id(&self) -> BatchId {
        self.copies.id
    }

    /// What to copy.
    pub fn batch(&self) -> &TransferBatch {
        &self.copies
    }

    /// How the batch ended through this handle, if it did.
    pub fn outcome(&self) -> Option<Outcome> {
        self.state.lock().outcome.clone()
    }

    /// The engine is about to run the copies (see [`Cache::start`]).
    pub fn start(&self) -> Result<()> {
        let id = self.copies.id;
        self.cache.call(|c| c.start(id))
    }

    /// The copies are done (see [`Cache::complete`]).
    pub fn complete(&self) -> Result<()> {
        let id = self.copies.id;
        self.cache.call(|c| c.complete(id))?;
        self.ended(Outcome::Completed);
        Ok(())
    }

    /// An `l3_get` batch's copies landed for its first `pages` pages and (`state`) the
    /// state at their end (see [`Cache::complete_l3`]).
    pub fn complete_l3(&self, pages: usize, state: bool) -> Result<()> {
        self.complete_l3_gone(pages, state, &[])
    }

    /// [`Batch::complete_l3`], with `gone` the objects the store no longer held (see
    /// [`Cache::complete_l3_gone`]).
    pub fn complete_l3_gone(&self, pages: usize, state: bool, gone: &[usize]) -> Result<()> {
        let id = self.copies.id;
        self.cache
            .call(|c| c.complete_l3_gone(id, pages, state, gone))?;
        self.ended(Outcome::Completed);
        Ok(())
    }

    /// The copies failed (see [`Cache::fail`]); `reason` is kept in [`Batch::outcome`].
    pub fn fail(&self, reason: &str) -> Result<()> {
        let id = self.copies.id;
        self.cache.call(|c| c.fail(id))?;
        self.ended(Outcome::Failed(reason.to_owned()));
        Ok(())
    }

    /// Fails the batch if it is still in flight, for a caller whose copies can no longer
    /// run (a `with` block left, an exception caught). Returns whether it failed it.
    pub fn close(&self, reason: &str) -> Result<bool> {
        let id = self.copies.id;
        let failed = self.cache.call(|c| {
            c.started(id)
                .is_some()
                .then(|| c.fail(id))
                .transpose()
                .map(|f| f.is_some())
        })?;
        if failed {
            self.ended(Outcome::Failed(reason.to_owned()));
        } else {
            self.state.lock().owns = false;
        }
        Ok(failed)
    }

    /// Lets go of the batch (what dropping the handle does): see [`Cache::abandon`].
    /// Nothing happens when the handle does not own the batch, or the cache is broken.
    pub fn abandon(&self) -> Abandoned {
        if !std::mem::replace(&mut self.state.lock().owns, false) {
            return Abandoned::Nothing;
        }
        let id = self.copies.id;
        let what = self
            .cache
            .with(|c| c.abandon(id))
            .unwrap_or(Abandoned::Nothing);
        if what != Abandoned::Nothing {
            self.state.lock().outcome = Some(Outcome::Abandoned(what));
        }
        what
    }

    fn ended(&self, outcome: Outcome) {
        let mut st = self.state.lock();
        st.owns = false;
        st.outcome = Some(outcome);
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        self.abandon();
    }
}

/// An owned lock: the path from `node` to the root stays protected from eviction until
/// it is released, explicitly or by dropping it.
#[must_use = "dropping a Lock releases it at once"]
#[clippy::has_significant_drop]
pub struct Lock {
    cache: HybridCache,
    /// `None` once released.
    receipt: Option<LockReceipt>,
    node: NodeId,
}

impl fmt::Debug for Lock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lock")
            .field("node", &self.node)
            .field("receipt", &self.receipt)
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
        match self.receipt.take() {
            Some(receipt) => self.cache.call(|c| c.unlock(receipt)),
            None => Ok(()),
        }
    }
}

impl Drop for Lock {
    fn drop(&mut self) {
        if let Some(receipt) = self.receipt.take() {
            // Cannot fail: the receipt is of this cache and live.
            self.cache.core.lock().settle(|c| {
                let _ = c.unlock(receipt);
            });
        }
    }
}

/// An owned request handle: while its request is live, dropping the handle aborts it
/// (everything it holds goes back). Finish or abort it through the cache.
#[must_use = "dropping a Request aborts it"]
#[clippy::has_significant_drop]
pub struct Request {
    cache: HybridCache,
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

    /// Whether the request still holds anything (false too when the cache is broken).
    pub fn is_live(&self) -> bool {
        self.cache
            .with(|c| c.request_live(self.id))
            .unwrap_or(false)
    }

    /// A handle to the request's cache.
    pub fn cache(&self) -> &HybridCache {
        &self.cache
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        let id = self.id;
        self.cache.core.lock().settle(|c| {
            if c.request_live(id) {
                c.drop_request(id);
            }
        });
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
        .unwrap()
    }

    #[test]
    fn dropping_a_lock_releases_it() {
        let c = cache();
        let node = cached(&c, &[1, 2, 3]);
        {
            let _l = c.lock(node).unwrap();
            assert_eq!(c.with(|core| core.protected_size()).unwrap(), 3);
        }
        assert_eq!(c.with(|core| core.protected_size()).unwrap(), 0);
        c.call(|core| core.audit()).unwrap();
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
            c.with(|core| (core.protected_size(), core.evictable_size()))
                .unwrap(),
            (0, 2)
        );
        c.call(|core| core.audit()).unwrap();
    }

    #[test]
    fn an_illegal_page_transition_in_a_call_breaks_the_cache_and_every_later_call_says_so() {
        let c = cache();
        let node = cached(&c, &[1, 2]);
        // A double unpin, as a bug in the batch code would make it.
        let err = c
            .with(|core| {
                core.kv_pool().pin(&[0]);
                core.kv_pool().unpin(&[0]);
                core.kv_pool().unpin(&[0]);
            })
            .unwrap_err();
        assert!(
            matches!(&err, Error::Broken(why) if why.contains("unpinned more often")),
            "{err}"
        );
        assert!(c.broken().is_some());
        assert!(matches!(c.lock(node), Err(Error::Broken(_))));
        assert!(matches!(c.admit(None, &[1, 2, 3]), Err(Error::Broken(_))));
    }

    #[test]
    fn an_illegal_page_transition_outside_any_call_breaks_the_cache_at_the_next_call() {
        let c = cache();
        let node = cached(&c, &[1, 2]);
        let pool = c.with(|core| core.kv_pool().clone()).unwrap();
        // Pages may be given back anywhere (a finaliser): a bug there is caught too.
        pool.release_tree(&[9]);
        assert!(c.broken().unwrap().contains("page 9 (Tree to Free)"));
        assert!(matches!(c.lock(node), Err(Error::Broken(_))));
        assert!(matches!(
            c.with(|core| core.available_kv()),
            Err(Error::Broken(_))
        ));
    }

    #[test]
    fn a_panic_inside_the_core_breaks_the_cache_and_every_later_call_says_so() {
        let c = cache();
        let node = cached(&c, &[1, 2]);
        let lock = c.lock(node).unwrap();
        let request = c.admit(None, &[1, 2, 3]).unwrap().unwrap();
        let err = c
            .with(|core| {
                // A change interrupted half way, as a bug would.
                core.evict(1, 0);
                panic!("bug in the middle of a change")
            })
            .unwrap_err();
        assert!(matches!(&err, Error::Broken(why) if why.contains("bug in the middle")));
        assert!(c.broken().is_some());
        assert!(matches!(
            c.with(|core| core.available_kv()),
            Err(Error::Broken(_))
        ));
        assert!(matches!(c.lock(node), Err(Error::Broken(_))));
        assert!(matches!(c.admit(None, &[1]), Err(Error::Broken(_))));
        assert!(!request.is_live());
        // Dropping handles of a broken cache is safe and does nothing.
        drop(lock);
        drop(request);
        assert!(matches!(c.call(|core| core.audit()), Err(Error::Broken(_))));
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
        let node = c
            .with(|core| {
                let slots = core.alloc_kv(4).unwrap().unwrap();
                let state = core.alloc_mamba().unwrap().map(i64::from);
                let node = core
                    .insert_with_state(None, &[1, 2, 3, 4], &slots, 0, state)
                    .unwrap()
                    .node;
                for b in core.take_batches() {
                    core.complete(b.id).unwrap();
                }
                core.evict(4, 0);
                node
            })
            .unwrap();
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
        .unwrap()
    }

    #[test]
    fn panic_inside_a_load_back_scope_gives_back_every_slot() {
        let (c, node) = demoted();
        let request = c.admit(None, &[1, 2, 3, 4]).unwrap().unwrap();
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
        let view = c.call(|core| core.request(id)).unwrap();
        assert_eq!(
            (view.prefix_len, view.mamba_slot, view.load_pending),
            (0, None, None)
        );
        c.call(|core| core.audit()).unwrap();
    }

    #[test]
    fn committed_guard_publishes_and_a_dropped_one_does_not() {
        let (c, node) = demoted();
        let request = c.admit(None, &[1, 2, 3, 4]).unwrap().unwrap();
        drop(c.load_back_request(&request, None).unwrap().unwrap());
        let id = request.id();
        assert_eq!(c.call(|core| core.request(id)).unwrap().prefix_len, 0);
        let lb = c.load_back_request(&request, None).unwrap().unwrap();
        let batch = lb.id();
        assert_eq!(lb.batch().copies.len(), 3);
        lb.commit().unwrap();
        c.call(|core| core.complete(batch)).unwrap();
        let view = c.call(|core| core.request(id)).unwrap();
        assert_eq!((view.prefix_len, view.node), (4, node));
        c.call(|core| core.audit()).unwrap();
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
        c.call(|core| core.audit()).unwrap();
    }

    #[test]
    fn a_core_receipt_or_load_record_dropped_unreleased_is_settled_by_the_next_call() {
        let (c, node) = demoted();
        let before = pool_counts(&c);
        c.with(|core| {
            let receipt = core.lock(node).unwrap();
            let record = core
                .load_back(LoadTarget::Node(node), None, None)
                .unwrap()
                .unwrap();
            // Both dropped, as a `?` in the wrong place would.
            drop((receipt, record));
        })
        .unwrap();
        assert_eq!(pool_counts(&c), before, "the next call settled both");
        let stats = c.with(|core| core.stats()).unwrap();
        let get = |k| stats.iter().find(|(n, _)| *n == k).map(|&(_, v)| v);
        assert_eq!(get("live_locks"), Some(0));
        assert_eq!(get("load_backs_called_off_released"), Some(1));
        c.call(|core| core.audit()).unwrap();
    }

    /// A hybrid cache with a write-through host tier; [1, 2, 3, 4] is cached with its
    /// state and its backup batch is the one returned.
    fn backed_up() -> (HybridCache, Batch) {
        let c = HybridCache::new(Config {
            mamba_slots: 4,
            host_kv_slots: 16,
            host_mamba_slots: 4,
            write_policy: crate::WritePolicy::WriteThrough,
            ..Config::kv(16, 1)
        })
        .unwrap();
        c.with(|core| {
            let slots = core.alloc_kv(4).unwrap().unwrap();
            let state = core.alloc_mamba().unwrap().map(i64::from);
            core.insert_with_state(None, &[1, 2, 3, 4], &slots, 0, state)
                .unwrap();
        })
        .unwrap();
        let mut batches = c.take_batches().unwrap();
        assert_eq!(batches.len(), 1);
        let b = batches.remove(0);
        assert_eq!(b.batch().kind, crate::BatchKind::Backup);
        (c, b)
    }

    fn stat(c: &HybridCache, key: &str) -> u64 {
        let stats = c.with(|core| core.stats()).unwrap();
        stats.iter().find(|(n, _)| *n == key).map_or(0, |&(_, v)| v)
    }

    /// Nothing is pinned, draining or pending: every slot is free or held by the tree
    /// or a request.
    fn settled(c: &HybridCache) {
        for counts in pool_counts(c) {
            assert_eq!(counts.draining, 0, "{counts:?}");
        }
        assert!(c.with(|core| core.pending_batches()).unwrap().is_empty());
        assert_eq!(stat(c, "batches_in_flight"), 0);
        c.call(|core| core.audit()).unwrap();
    }

    #[test]
    fn a_batch_dropped_before_it_started_fails_and_gives_everything_back() {
        let (c, b) = backed_up();
        assert_eq!(pool_counts(&c)[2].free, 12, "the backup holds 4 host pages");
        drop(b);
        assert_eq!(pool_counts(&c)[2].free, 16);
        assert_eq!(pool_counts(&c)[3].free, 4);
        assert_eq!(stat(&c, "batches_abandoned"), 1);
        assert_eq!(stat(&c, "backups_failed"), 1);
        settled(&c);
    }

    #[test]
    fn a_panic_between_take_and_complete_gives_everything_back() {
        for started in [false, true] {
            let (c, b) = backed_up();
            let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let b = b;
                if started {
                    b.start().unwrap();
                    // What an engine does with a started batch it cannot finish.
                    b.close("copy raised").unwrap();
                }
                panic!("engine bug");
            }));
            assert!(out.is_err());
            assert_eq!(pool_counts(&c)[2].free, 16);
            settled(&c);
        }
    }

    #[test]
    fn a_started_batch_dropped_before_it_ended_stays_in_flight_until_acknowledged_then_fails() {
        let (c, b) = backed_up();
        let id = b.id();
        b.start().unwrap();
        assert_eq!(b.abandon(), Abandoned::Draining);
        assert_eq!(b.outcome(), Some(Outcome::Abandoned(Abandoned::Draining)));
        drop(b);
        // Still in flight as it was, holding the host pages its copies may still write,
        // and listed until the engine says the copies are over.
        assert_eq!(stat(&c, "backups_failed"), 0);
        assert_eq!(stat(&c, "batches_draining"), 1);
        assert_eq!(
            c.with(|core| core.pending_batches()).unwrap(),
            vec![(id, crate::BatchKind::Backup, true)]
        );
        assert_eq!(pool_counts(&c)[2].free, 12);
        c.call(|core| core.audit()).unwrap();
        // Either acknowledgement fails it: its owner no longer vouches for the copies.
        c.call(|core| core.complete(id)).unwrap();
        assert_eq!(pool_counts(&c)[2].free, 16);
        assert_eq!(
            (stat(&c, "backups_done"), stat(&c, "backups_failed")),
            (0, 1)
        );
        assert_eq!(stat(&c, "batches_completed"), 0);
        settled(&c);
    }

    #[test]
    fn an_ended_batch_is_not_abandoned_by_its_drop() {
        let (c, b) = backed_up();
        b.start().unwrap();
        b.complete().unwrap();
        assert_eq!(b.outcome(), Some(Outcome::Completed));
        assert_eq!(b.abandon(), Abandoned::Nothing);
        drop(b);
        assert_eq!(stat(&c, "backups_done"), 1);
        assert_eq!(stat(&c, "batches_abandoned"), 0);
        settled(&c);
        // Acknowledged by id through the cache: the handle's drop finds nothing to do.
        let (c, b) = backed_up();
        let id = b.id();
        c.call(|core| core.fail(id)).unwrap();
        assert!(b.complete().is_err());
        assert!(!b.close("late").unwrap());
        drop(b);
        assert_eq!(stat(&c, "batches_abandoned"), 0);
        settled(&c);
    }

    #[test]
    fn a_load_backs_batch_handle_does_not_own_the_batch() {
        let (c, node) = demoted();
        let request = c.admit(None, &[1, 2, 3, 4]).unwrap().unwrap();
        let lb = c.load_back_request(&request, None).unwrap().unwrap();
        let b = lb.batch_handle();
        let id = b.id();
        b.start().unwrap();
        assert_eq!(b.abandon(), Abandoned::Nothing);
        drop(b);
        lb.commit().unwrap();
        // Committed and in flight: acknowledged by id, it publishes.
        c.call(|core| core.complete(id)).unwrap();
        let rid = request.id();
        assert_eq!(c.call(|core| core.request(rid)).unwrap().prefix_len, 4);
        let m = c
            .with(|core| core.match_prefix(None, &[1, 2, 3, 4]))
            .unwrap();
        assert_eq!((m.device_len, m.node), (4, node));
        drop(request);
        settled(&c);
    }
}
