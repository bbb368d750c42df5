//! `radixcache._core`: the Python bindings of radixcache-core.
//!
//! This crate converts types and errors and holds no cache logic: every method takes
//! its arguments apart, calls the core once, and builds Python values from the plain
//! Rust result after the core's lock is released. Every lock follows the policy of
//! [`gil`]: never wait for a lock while holding the GIL, never create Python objects
//! while holding a lock.

use std::ffi::CString;
use std::mem::ManuallyDrop;

use numpy::PyArray1;
use parking_lot::Mutex;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyMemoryError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use radixcache_core as core;

mod convert;
mod gil;
mod grown;
mod layout;
use convert::{indices_arg, tokens_arg, BatchArg, Int};
use gil::{run, settle, warn_from_finalizer};
use grown::GrownArray;

create_exception!(
    _core,
    CacheError,
    PyException,
    "Root of the errors radixcache raises (argument errors stay ValueError/TypeError)."
);
create_exception!(
    _core,
    InvariantError,
    CacheError,
    "audit() found a broken invariant."
);
create_exception!(
    _core,
    StaleNodeError,
    CacheError,
    "A Node handle whose node no longer exists (evicted, or from another cache)."
);
create_exception!(
    _core,
    LockError,
    CacheError,
    "A lock receipt released twice, or given to a cache it does not belong to."
);

/// Maps every core error to its Python exception. Exhaustive on purpose: a new core
/// variant does not compile until it is mapped here.
#[allow(clippy::needless_pass_by_value)] // by value so that it reads `.map_err(err)`
fn err(e: core::Error) -> PyErr {
    let msg = e.to_string();
    match e {
        core::Error::InvalidArgument { .. } => PyValueError::new_err(msg),
        core::Error::StaleNode(_) => StaleNodeError::new_err(msg),
        core::Error::Lock(_) => LockError::new_err(msg),
        core::Error::Request(_) | core::Error::Broken(_) | core::Error::EngineOwned(_) => {
            CacheError::new_err(msg)
        }
        core::Error::Invariant(_) => InvariantError::new_err(msg),
        core::Error::OutOfMemory { .. } => PyMemoryError::new_err(msg),
    }
}

/// Slot indices handed to Python (an int64 array).
type Slots = Py<PyArray1<i64>>;

/// The `pools` argument: "cache" or "engine" (errors name the argument).
fn pools_arg(v: &Bound<'_, PyAny>) -> PyResult<core::PoolOwner> {
    let s: String = v.extract().map_err(|_| {
        PyTypeError::new_err(format!(
            "pools: expected \"cache\" or \"engine\", got {}",
            v.get_type()
                .name()
                .map_or_else(|_| "?".into(), |n| n.to_string())
        ))
    })?;
    s.parse().map_err(err)
}

/// `eviction_policy=`: one policy name for every component it applies to, or a dict
/// per component (`{"kv": ..., "mamba": ...}`); the core checks the names.
fn eviction_policy_arg(v: &Bound<'_, PyAny>) -> PyResult<core::EvictionPolicies> {
    let type_name = |v: &Bound<'_, PyAny>| {
        v.get_type()
            .name()
            .map_or_else(|_| "?".into(), |n| n.to_string())
    };
    if let Ok(name) = v.extract::<String>() {
        return name.parse().map_err(err);
    }
    let Ok(dict) = v.cast::<PyDict>() else {
        return Err(PyTypeError::new_err(format!(
            "eviction_policy: expected a policy name or a dict per component, got {}",
            type_name(v)
        )));
    };
    let mut pairs = Vec::with_capacity(dict.len());
    for (component, name) in dict.iter() {
        let (Ok(component), Ok(name)) = (component.extract::<String>(), name.extract::<String>())
        else {
            return Err(PyTypeError::new_err(format!(
                "eviction_policy: expected str keys and str policy names, got {}: {}",
                type_name(&component),
                type_name(&name)
            )));
        };
        pairs.push((component, name));
    }
    core::EvictionPolicies::from_components(pairs.iter().map(|(c, n)| (c.as_str(), n.as_str())))
        .map_err(err)
}

fn array(py: Python<'_>, v: Vec<i64>) -> Py<PyArray1<i64>> {
    PyArray1::from_vec(py, v).unbind()
}

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
///     priority first, see insert and admit) or "state-value" (states only: the
///     state that saves the least compute first, aged; KV keeps "lru"). A name
///     applies to every component; a dict sets each: {"kv": ..., "mamba": ...}
///     (missing: "lru"). The host tier follows the KV policy.
///   swa_slots: device slots of the sliding-window attention KV pool (a multiple of
///     page_size; 0, the default: no SWA layers). Every KV page handed out comes with
///     an SWA page that follows it; a request gives back those whose tokens left the
///     window (Request.swa_indices); a match is cut where the last swa_window tokens
///     still have their SWA KV; evict_swa() makes SWA tombstones. Not with a host tier
///     or pools="engine" yet.
///   swa_window: the tokens each SWA layer attends to (>= 1 with swa_slots, else 0).
///   pools: who owns the device slots. "cache" (the default): the cache's own pools
///     (alloc_kv, alloc_mamba, requests). "engine": the engine's allocators own every
///     slot; insert claims the slots it is passed, what the tree gives up is queued
///     for take_freed() (evict returns what it frees directly); no host tier, and the
///     calls that allocate from the cache's pools raise CacheError.
#[allow(clippy::doc_markdown)] // the Python docstring: `help()` shows it as written
#[pyclass(frozen, module = "radixcache._core", name = "HybridCache")]
struct PyHybridCache {
    inner: core::HybridCache,
    /// The configuration (immutable: read without taking the cache).
    config: core::Config,
}

#[pymethods]
impl PyHybridCache {
    #[new]
    #[allow(clippy::too_many_arguments)] // one per argument of the Python constructor
    #[pyo3(signature = (kv_slots=Int::Value(8192), page_size=Int::Value(1),
                        mamba_slots=Int::Value(0), host_kv_slots=Int::Value(0),
                        host_mamba_slots=Int::Value(0), write_policy="write_through",
                        write_through_threshold=None, pools=core::PoolOwner::Cache,
                        eviction_policy=core::EvictionPolicies::default(),
                        swa_slots=Int::Value(0), swa_window=Int::Value(0)),
           text_signature = "(kv_slots=8192, page_size=1, mamba_slots=0, host_kv_slots=0, host_mamba_slots=0, write_policy='write_through', write_through_threshold=None, pools='cache', eviction_policy='lru', swa_slots=0, swa_window=0)")]
    fn new(
        kv_slots: Int,
        page_size: Int,
        mamba_slots: Int,
        host_kv_slots: Int,
        host_mamba_slots: Int,
        write_policy: &str,
        write_through_threshold: Option<Int>,
        #[pyo3(from_py_with = pools_arg)] pools: core::PoolOwner,
        #[pyo3(from_py_with = eviction_policy_arg)] eviction_policy: core::EvictionPolicies,
        swa_slots: Int,
        swa_window: Int,
    ) -> PyResult<Self> {
        let threshold = write_through_threshold
            .map(|t| {
                let t = t.get("write_through_threshold")?;
                u32::try_from(t).map_err(|_| {
                    PyValueError::new_err(format!(
                        "write_through_threshold: must be in [1, 2**32), got {t}"
                    ))
                })
            })
            .transpose()?;
        let config = core::Config {
            kv_slots: kv_slots.count("kv_slots")?,
            page_size: page_size.count("page_size")?,
            mamba_slots: mamba_slots.count("mamba_slots")?,
            host_kv_slots: host_kv_slots.count("host_kv_slots")?,
            host_mamba_slots: host_mamba_slots.count("host_mamba_slots")?,
            write_policy: write_policy.parse().map_err(err)?,
            write_through_threshold: threshold,
            pools,
            eviction_policy,
            swa_slots: swa_slots.count("swa_slots")?,
            swa_window: swa_window.count("swa_window")?,
        };
        Ok(PyHybridCache {
            inner: core::HybridCache::new(config.clone()).map_err(err)?,
            config,
        })
    }

    /// Tokens per page.
    #[getter]
    fn page_size(&self) -> usize {
        self.config.page_size
    }

    /// Device KV token slots.
    #[getter]
    fn kv_slots(&self) -> usize {
        self.config.kv_slots
    }

    /// Device Mamba state slots (0 for an attention-only model).
    #[getter]
    fn mamba_slots(&self) -> usize {
        self.config.mamba_slots
    }

    /// Device slots of the sliding-window attention KV pool (0: no SWA layers).
    #[getter]
    fn swa_slots(&self) -> usize {
        self.config.swa_slots
    }

    /// The SWA layers' window in tokens (0: no SWA layers).
    #[getter]
    fn swa_window(&self) -> usize {
        self.config.swa_window
    }

    /// Host-tier KV token slots (0: no host tier).
    #[getter]
    fn host_kv_slots(&self) -> usize {
        self.config.host_kv_slots
    }

    /// Host-tier Mamba state slots.
    #[getter]
    fn host_mamba_slots(&self) -> usize {
        self.config.host_mamba_slots
    }

    /// When device data is backed up to the host tier.
    #[getter]
    fn write_policy(&self) -> &'static str {
        self.config.write_policy.as_str()
    }

    /// The eviction policy of each component: {"kv": name, "mamba": name}.
    #[getter]
    fn eviction_policy<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        let p = self.config.eviction_policy;
        d.set_item("kv", p.kv.as_str())?;
        d.set_item("mamba", p.mamba.as_str())?;
        Ok(d)
    }

    /// Who owns the device slots: "cache" (its own pools) or "engine".
    #[getter]
    fn pools(&self) -> &'static str {
        self.config.pools.as_str()
    }

    /// Inserts before a selective backup (None unless the policy is selective).
    #[getter]
    fn write_through_threshold(&self) -> Option<u32> {
        (self.config.write_policy == core::WritePolicy::WriteThroughSelective).then(|| {
            self.config
                .write_through_threshold
                .unwrap_or(core::Config::DEFAULT_WRITE_THROUGH_THRESHOLD)
        })
    }

    /// Load the host-only part of a cached prefix back to the device. `target`: a
    /// `Node` (e.g. `Match.host_node`, optionally with the `request` admitted through
    /// it) or a `Request` (what its admission found on the host). Returns a `LoadBack`
    /// guard, or None having taken nothing.
    #[pyo3(signature = (target, *, mem_quota=None, request=None))]
    fn load_back(
        &self,
        py: Python<'_>,
        target: &Bound<'_, PyAny>,
        mem_quota: Option<Int>,
        request: Option<&Bound<'_, PyRequest>>,
    ) -> PyResult<Option<PyLoadBack>> {
        let quota = mem_quota.map(|q| q.count("mem_quota")).transpose()?;
        let (target, request) = if let Ok(node) = target.cast::<PyNode>() {
            let req = request
                .map(|r| self.request_id(r, "load_back"))
                .transpose()?;
            (core::LoadTarget::Node(node.get().id), req)
        } else if let Ok(req) = target.cast::<PyRequest>() {
            if request.is_some() {
                return Err(PyValueError::new_err(
                    "request: the target is a Request already; pass request= only with a Node",
                ));
            }
            (
                core::LoadTarget::Request(self.request_id(req, "load_back")?),
                None,
            )
        } else {
            return Err(PyTypeError::new_err(format!(
                "target: expected a Node or a Request, got {}",
                target.get_type().name()?
            )));
        };
        let record = run(py, &self.inner, 0, |c| c.load_back(target, quota, request))?;
        record
            .map(|r| PyLoadBack::new(py, &self.inner, self.inner.own_load(r)))
            .transpose()
    }

    /// Longest cached prefix of `tokens` (whole pages); refreshes LRU on the path.
    #[pyo3(signature = (tokens, *, namespace=None))]
    fn match_prefix(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        namespace: Option<&str>,
    ) -> PyResult<PyMatch> {
        let tokens = tokens_arg(tokens, "tokens")?;
        let m = run(py, &self.inner, tokens.len(), |c| {
            Ok(c.match_prefix(namespace, &tokens))
        })?;
        Ok(PyMatch {
            device_len: m.device_len,
            kv_indices: array(py, m.kv_indices),
            host_len: m.host_len,
            node: self.node(py, m.node)?,
            host_node: self.node(py, m.host_node)?,
            mamba_slot: m.mamba_slot,
            kv_len: m.kv_len,
        })
    }

    /// Cache `tokens` with their KV slots; takes ownership of `kv_indices[owned_from:]`.
    #[pyo3(signature = (tokens, kv_indices, *, namespace=None, owned_from=Int::Value(0),
                        mamba_slot=None, priority=Int::Value(0)),
           text_signature = "($self, tokens, kv_indices, *, namespace=None, owned_from=0, mamba_slot=None, priority=0)")]
    #[allow(clippy::too_many_arguments)] // one per argument of the Python method
    fn insert(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        kv_indices: &Bound<'_, PyAny>,
        namespace: Option<&str>,
        owned_from: Int,
        mamba_slot: Option<Int>,
        priority: Int,
    ) -> PyResult<PyInsert> {
        let tokens = tokens_arg(tokens, "tokens")?;
        let kv = indices_arg(kv_indices, "kv_indices")?;
        let owned_from = owned_from.count("owned_from")?;
        let mamba_slot = mamba_slot.map(|s| s.get("mamba_slot")).transpose()?;
        let priority = priority.get("priority")?;
        let r = run(py, &self.inner, tokens.len(), |c| {
            c.insert_with_priority(namespace, &tokens, &kv, owned_from, mamba_slot, priority)
        })?;
        Ok(PyInsert {
            prefix_len: r.prefix_len,
            node: self.node(py, r.node)?,
            mamba_existed: r.mamba_existed,
        })
    }

    /// Protect the path from `node` to the root from eviction; returns the receipt.
    fn lock(&self, py: Python<'_>, node: &Bound<'_, PyNode>) -> PyResult<PyLock> {
        let id = node.get().id;
        let receipt = run(py, &self.inner, 0, |c| c.lock(id))?;
        Ok(PyLock {
            node: node.clone().unbind(),
            slot: Mutex::new(Some(self.inner.own_lock(receipt, id))),
            cache: self.inner.clone(),
        })
    }

    /// Release a receipt (exactly once; `LockError` otherwise).
    fn unlock(&self, py: Python<'_>, lock: &Bound<'_, PyLock>) -> PyResult<()> {
        let mut slot = gil::lock(py, &lock.get().slot);
        let slot = &mut *slot;
        settle(py, &self.inner, || self.inner.unlock(slot)).map_err(err)
    }

    /// Evict at least that much (or all that is evictable), LRU leaves first. With
    /// pools="engine" the freed slots are the engine's on return (`Evicted.kv_indices`,
    /// `Evicted.mamba_slots`).
    #[pyo3(signature = (*, kv_tokens=Int::Value(0), mamba_states=Int::Value(0)),
           text_signature = "($self, *, kv_tokens=0, mamba_states=0)")]
    fn evict(&self, py: Python<'_>, kv_tokens: Int, mamba_states: Int) -> PyResult<PyEvicted> {
        let kv_tokens = kv_tokens.count("kv_tokens")?;
        let mamba_states = mamba_states.count("mamba_states")?;
        let e = run(py, &self.inner, 0, |c| Ok(c.evict(kv_tokens, mamba_states)))?;
        Ok(PyEvicted::new(py, e))
    }

    /// SWA: free at least `pages` SWA pages (or all that can go), least recently used
    /// node first: an internal node keeps its full KV as an SWA tombstone, a leaf goes
    /// whole. Returns the SWA pages freed (0 without SWA layers).
    #[pyo3(signature = (*, pages=Int::Value(0)), text_signature = "($self, *, pages=0)")]
    fn evict_swa(&self, py: Python<'_>, pages: Int) -> PyResult<usize> {
        let pages = pages.count("pages")?;
        run(py, &self.inner, 0, |c| Ok(c.evict_swa(pages)))
    }

    /// pools="engine": hand every slot queued to go back to the engine to it, as
    /// `(kv slots, state slots)`; each slot is returned once. Empty with pools="cache".
    fn take_freed(&self, py: Python<'_>) -> PyResult<(Slots, Slots)> {
        let (kv, states) = run(py, &self.inner, 0, |c| Ok(c.take_freed()))?;
        Ok((array(py, kv), array(py, states)))
    }

    /// The device slots the tree holds, as `(kv slots, state slots)`, ascending.
    fn tree_slots(&self, py: Python<'_>) -> PyResult<(Slots, Slots)> {
        let (kv, states) = run(py, &self.inner, 0, |c| Ok(c.tree_slots()))?;
        Ok((array(py, kv), array(py, states)))
    }

    /// Evict host-only data: at least that much (or all that is evictable), LRU first.
    #[pyo3(signature = (*, kv_tokens=Int::Value(0), mamba_states=Int::Value(0)),
           text_signature = "($self, *, kv_tokens=0, mamba_states=0)")]
    fn evict_host(&self, py: Python<'_>, kv_tokens: Int, mamba_states: Int) -> PyResult<PyEvicted> {
        let kv_tokens = kv_tokens.count("kv_tokens")?;
        let mamba_states = mamba_states.count("mamba_states")?;
        let e = run(py, &self.inner, 0, |c| {
            c.evict_host(kv_tokens, mamba_states)
        })?;
        Ok(PyEvicted::new(py, e))
    }

    /// `n` device KV slots (whole pages), evicting first when short; None if impossible.
    fn alloc_kv(&self, py: Python<'_>, n: Int) -> PyResult<Option<Py<PyArray1<i64>>>> {
        let n = n.count("n")?;
        let r = run(py, &self.inner, 0, |c| c.alloc_kv(n))?;
        Ok(r.map(|v| array(py, v)))
    }

    /// Give back slots the caller holds; a bad slot fails the call, which frees nothing.
    fn free_kv(&self, py: Python<'_>, indices: &Bound<'_, PyAny>) -> PyResult<()> {
        let idx = indices_arg(indices, "indices")?;
        run(py, &self.inner, idx.len(), |c| c.free_kv(&idx)).map(|_| ())
    }

    /// One device state slot, evicting the least recently used state first when short.
    fn alloc_mamba(&self, py: Python<'_>) -> PyResult<Option<u32>> {
        run(py, &self.inner, 0, core::Cache::alloc_mamba)
    }

    /// Give back a state slot the caller holds.
    fn free_mamba(&self, py: Python<'_>, slot: Int) -> PyResult<()> {
        let slot = slot.get("slot")?;
        run(py, &self.inner, 0, |c| c.free_mamba(slot))
    }

    /// Admit a request: match, lock the reused prefix, copy-on-write its state.
    #[pyo3(signature = (tokens, *, namespace=None, priority=Int::Value(0)),
           text_signature = "($self, tokens, *, namespace=None, priority=0)")]
    fn admit(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        namespace: Option<&str>,
        priority: Int,
    ) -> PyResult<Option<PyRequest>> {
        let tokens = tokens_arg(tokens, "tokens")?;
        let priority = priority.get("priority")?;
        let id = run(py, &self.inner, tokens.len(), |c| {
            let id = c.admit_with_priority(namespace, &tokens, priority)?;
            if let Some(id) = id {
                c.own_request(id)?;
            }
            Ok(id)
        })?;
        Ok(id.map(|id| PyRequest::new(self.inner.request_handle(id))))
    }

    /// One KV slot per token (and a state slot if the request has none); None if full.
    fn extend(
        &self,
        py: Python<'_>,
        request: &Bound<'_, PyRequest>,
        tokens: &Bound<'_, PyAny>,
    ) -> PyResult<Option<Py<PyArray1<i64>>>> {
        let tokens = tokens_arg(tokens, "tokens")?;
        let id = self.request_id(request, "extend")?;
        let r = run(py, &self.inner, tokens.len(), |c| c.extend(id, &tokens))?;
        Ok(r.map(|v| array(py, v)))
    }

    /// A decode step: one token for each request, one KV slot each; None if full.
    fn extend_batch(
        &self,
        py: Python<'_>,
        requests: &Bound<'_, PyAny>,
        tokens: &Bound<'_, PyAny>,
    ) -> PyResult<Option<Py<PyArray1<i64>>>> {
        let ids = requests
            .try_iter()
            .map_err(|_| PyTypeError::new_err("requests: expected a sequence of Request"))?
            .map(|item| {
                let item = item?;
                let req = item.cast::<PyRequest>().map_err(|_| {
                    PyTypeError::new_err(format!(
                        "requests: expected Request items, got {}",
                        item.get_type()
                            .name()
                            .map_or_else(|_| "?".into(), |n| n.to_string())
                    ))
                })?;
                self.request_id(req, "extend_batch")
            })
            .collect::<PyResult<Vec<_>>>()?;
        let tokens = tokens_arg(tokens, "tokens")?;
        let r = run(py, &self.inner, tokens.len(), |c| {
            c.extend_batch(&ids, &tokens)
        })?;
        Ok(r.map(|v| array(py, v)))
    }

    /// Cache what the request holds so far; forks its state for the tree.
    fn checkpoint(&self, py: Python<'_>, request: &Bound<'_, PyRequest>) -> PyResult<()> {
        let id = self.request_id(request, "checkpoint")?;
        run(py, &self.inner, 0, |c| c.checkpoint(id))
    }

    /// Cache every token fed, donate the state, unlock: the request holds nothing after.
    fn finish(&self, py: Python<'_>, request: &Bound<'_, PyRequest>) -> PyResult<()> {
        let id = self.request_id(request, "finish")?;
        run(py, &self.inner, 0, |c| c.finish(id))
    }

    /// Give back everything the request holds and cache nothing.
    fn abort(&self, py: Python<'_>, request: &Bound<'_, PyRequest>) -> PyResult<()> {
        let id = self.request_id(request, "abort")?;
        run(py, &self.inner, 0, |c| c.abort(id))
    }

    /// The data movement the cache needs (copy-on-write, backups) since the last call,
    /// each batch owned by its object until it ends.
    fn take_batches(&self, py: Python<'_>) -> PyResult<Vec<PyTransferBatch>> {
        let batches = run(py, &self.inner, 0, |c| Ok(c.take_batches()))?;
        // The Python side of every batch first, then the handles, which own the batches:
        // a failure (MemoryError) before gives back what the handles own at once.
        let copies = batches
            .iter()
            .map(|b| copies(py, b))
            .collect::<PyResult<Vec<_>>>();
        let handles = self.inner.own_batches(batches);
        match copies {
            Ok(copies) => Ok(handles
                .into_iter()
                .zip(copies)
                .map(|(handle, copies)| PyTransferBatch::new(&self.inner, handle, copies))
                .collect()),
            Err(e) => {
                settle(py, &self.inner, move || drop(handles));
                Err(e)
            }
        }
    }

    /// Batches handed out and not acknowledged: `(id, kind, started)`, oldest first.
    fn pending_batches(&self, py: Python<'_>) -> PyResult<Vec<(u128, &'static str, bool)>> {
        let pending = run(py, &self.inner, 0, |c| Ok(c.pending_batches()))?;
        Ok(pending
            .into_iter()
            .map(|(id, kind, started)| (id.to_u128(), kind.as_str(), started))
            .collect())
    }

    /// The engine is about to run a batch's copies.
    fn start(&self, py: Python<'_>, batch_id: BatchArg) -> PyResult<()> {
        let id = batch_id.get()?;
        run(py, &self.inner, 0, |c| c.start(id))
    }

    /// A batch's copies are done: releases what it held.
    fn complete(&self, py: Python<'_>, batch_id: BatchArg) -> PyResult<()> {
        let id = batch_id.get()?;
        run(py, &self.inner, 0, |c| c.complete(id))
    }

    /// A batch's copies failed: undoes what it would have published.
    fn fail(&self, py: Python<'_>, batch_id: BatchArg) -> PyResult<()> {
        let id = batch_id.get()?;
        run(py, &self.inner, 0, |c| c.fail(id))
    }

    /// Device KV tokens in the tree that eviction may take.
    fn evictable_size(&self, py: Python<'_>) -> PyResult<usize> {
        run(py, &self.inner, 0, |c| Ok(c.evictable_size()))
    }

    /// Device KV tokens in the tree protected by locks.
    fn protected_size(&self, py: Python<'_>) -> PyResult<usize> {
        run(py, &self.inner, 0, |c| Ok(c.protected_size()))
    }

    /// Device KV tokens in the tree.
    fn total_size(&self, py: Python<'_>) -> PyResult<usize> {
        run(py, &self.inner, 0, |c| Ok(c.total_size()))
    }

    /// Free device KV slots.
    fn available_kv(&self, py: Python<'_>) -> PyResult<usize> {
        run(py, &self.inner, 0, |c| Ok(c.available_kv()))
    }

    /// Free device Mamba state slots.
    fn available_mamba(&self, py: Python<'_>) -> PyResult<usize> {
        run(py, &self.inner, 0, |c| Ok(c.available_mamba()))
    }

    /// Counters and gauges as a dict of ints.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let entries = run(py, &self.inner, 0, |c| Ok(c.stats()))?;
        let d = PyDict::new(py);
        for (k, v) in entries {
            d.set_item(k, v)?;
        }
        Ok(d)
    }

    /// Check every invariant; raises `InvariantError` naming the first broken one.
    fn audit(&self, py: Python<'_>) -> PyResult<()> {
        run(py, &self.inner, 0, |c| c.audit())
    }

    /// Return the tree as indented text, one line per node.
    #[pyo3(signature = (max_nodes=Int::Value(200), max_tokens=Int::Value(8)),
           text_signature = "($self, max_nodes=200, max_tokens=8)")]
    fn pretty(&self, py: Python<'_>, max_nodes: Int, max_tokens: Int) -> PyResult<String> {
        let max_nodes = max_nodes.count("max_nodes")?;
        let max_tokens = max_tokens.count("max_tokens")?;
        run(py, &self.inner, 0, |c| Ok(c.pretty(max_nodes, max_tokens)))
    }

    /// Simulates a bug: a panic inside the core in the middle of a change. The cache is
    /// then broken and every later call raises `CacheError`. For tests of that path.
    fn _panic_for_tests(&self, py: Python<'_>) -> PyResult<()> {
        run(py, &self.inner, 0, |c| {
            c.evict(usize::MAX, usize::MAX);
            panic!("deliberate panic for tests")
        })
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        run(py, &self.inner, 0, |c| Ok(c.summary()))
            .unwrap_or_else(|e| format!("<HybridCache ({e})>"))
    }

    fn __str__(&self, py: Python<'_>) -> PyResult<String> {
        self.pretty(py, Int::Value(200), Int::Value(8))
    }
}

impl PyHybridCache {
    fn node(&self, py: Python<'_>, id: core::NodeId) -> PyResult<Py<PyNode>> {
        Py::new(
            py,
            PyNode {
                id,
                cache: self.inner.clone(),
            },
        )
    }

    /// The id of `request` in this cache for request call `call` (`CacheError` for
    /// another cache's request, and for every request with pools="engine").
    fn request_id(
        &self,
        request: &Bound<'_, PyRequest>,
        call: &'static str,
    ) -> PyResult<core::RequestId> {
        self.inner
            .request_id(&request.get().inner, call)
            .map_err(err)
    }
}

/// An opaque handle to a tree node: hashable, equal for the same live node.
#[pyclass(frozen, module = "radixcache._core", name = "Node")]
struct PyNode {
    id: core::NodeId,
    cache: core::HybridCache,
}

#[pymethods]
impl PyNode {
    fn __repr__(&self, py: Python<'_>) -> String {
        let id = self.id;
        match run(py, &self.cache, 0, |c| c.describe(id)) {
            Ok(s) => format!("<Node {s}>"),
            Err(_) => format!("<Node {id} (gone)>"),
        }
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other
            .cast::<PyNode>()
            .is_ok_and(|o| o.get().id == self.id && o.get().cache.same_cache(&self.cache))
    }

    fn __hash__(&self) -> u64 {
        (u64::from(self.id.index()) << 32) ^ self.id.generation()
    }
}

/// The answer of `match_prefix`.
#[pyclass(frozen, module = "radixcache._core", name = "Match", get_all)]
struct PyMatch {
    device_len: usize,
    kv_indices: Py<PyArray1<i64>>,
    host_len: usize,
    node: Py<PyNode>,
    host_node: Py<PyNode>,
    mamba_slot: Option<u32>,
    kv_len: usize,
}

#[pymethods]
impl PyMatch {
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "Match(device_len={}, host_len={}, kv_len={}, mamba_slot={}, node={}, kv_indices={})",
            self.device_len,
            self.host_len,
            self.kv_len,
            self.mamba_slot.map_or("None".to_owned(), |s| s.to_string()),
            self.node.get().__repr__(py),
            self.kv_indices.bind(py).repr()?
        ))
    }
}

/// The answer of `insert`.
#[pyclass(frozen, module = "radixcache._core", name = "Insert", get_all)]
struct PyInsert {
    prefix_len: usize,
    node: Py<PyNode>,
    mamba_existed: bool,
}

#[pymethods]
impl PyInsert {
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "Insert(prefix_len={}, mamba_existed={}, node={})",
            self.prefix_len,
            if self.mamba_existed { "True" } else { "False" },
            self.node.get().__repr__(py)
        )
    }
}

/// What `evict` actually evicted; with pools="engine", the slots it handed back.
#[pyclass(frozen, module = "radixcache._core", name = "Evicted", get_all)]
struct PyEvicted {
    kv_tokens: usize,
    mamba_states: usize,
    kv_indices: Py<PyArray1<i64>>,
    mamba_slots: Py<PyArray1<i64>>,
}

impl PyEvicted {
    fn new(py: Python<'_>, e: core::Evicted) -> PyEvicted {
        PyEvicted {
            kv_tokens: e.kv_tokens,
            mamba_states: e.mamba_states,
            kv_indices: array(py, e.kv_indices),
            mamba_slots: array(py, e.mamba_slots),
        }
    }
}

#[pymethods]
impl PyEvicted {
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "Evicted(kv_tokens={}, mamba_states={}, kv_indices={}, mamba_slots={})",
            self.kv_tokens,
            self.mamba_states,
            self.kv_indices.bind(py).repr()?,
            self.mamba_slots.bind(py).repr()?
        ))
    }
}

/// A lock receipt. Release it once with `cache.unlock(lock)` or by leaving its `with`
/// block; a receipt collected while still held is released and warns.
#[pyclass(frozen, module = "radixcache._core", name = "Lock")]
struct PyLock {
    node: Py<PyNode>,
    slot: Mutex<Option<core::Lock>>,
    cache: core::HybridCache,
}

#[pymethods]
impl PyLock {
    /// The node whose path to the root is locked.
    #[getter]
    fn node(&self, py: Python<'_>) -> Py<PyNode> {
        self.node.clone_ref(py)
    }

    /// True while the lock is held.
    #[getter]
    fn held(&self, py: Python<'_>) -> bool {
        gil::lock(py, &self.slot).is_some()
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<bool> {
        let mut slot = gil::lock(py, &self.slot);
        if slot.is_some() {
            let slot = &mut *slot;
            settle(py, &self.cache, || self.cache.unlock(slot)).map_err(err)?;
        }
        Ok(false)
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "<Lock {} on {}>",
            if self.held(py) { "held" } else { "released" },
            self.node.get().__repr__(py)
        )
    }
}

impl Drop for PyLock {
    fn drop(&mut self) {
        if let Some(lock) = self.slot.get_mut().take() {
            let node = lock.node();
            Python::attach(|py| {
                // Release first (the receipt's drop), then warn: the warning must not be
                // able to stop the release.
                settle(py, &self.cache, move || drop(lock));
                warn_from_finalizer(
                    py,
                    py.get_type::<PyLock>().as_any(),
                    &format!("Lock on node {node} was garbage-collected while held; released it"),
                );
            });
        }
    }
}

/// A request admitted by `HybridCache.admit`: it owns its slots until finished or
/// aborted; one collected while live is aborted and warns.
#[pyclass(frozen, module = "radixcache._core", name = "Request")]
struct PyRequest {
    /// Dropped by `Drop for PyRequest` only, by the GIL policy (see [`gil`]).
    inner: ManuallyDrop<core::Request>,
    /// The last reads of `tokens` and `kv_indices`, grown read after read.
    tokens: Mutex<GrownArray>,
    kv_indices: Mutex<GrownArray>,
}

impl PyRequest {
    fn new(inner: core::Request) -> PyRequest {
        PyRequest {
            inner: ManuallyDrop::new(inner),
            tokens: Mutex::default(),
            kv_indices: Mutex::default(),
        }
    }

    fn view(&self, py: Python<'_>) -> PyResult<core::RequestView> {
        let id = self.inner.id();
        run(py, self.inner.cache(), 0, |c| c.request(id))
    }

    /// One of the request's arrays, read incrementally: `fetch(cache, epoch, from)` is
    /// what the request gained since the last read (see [`grown::read`]).
    fn grown<T: Copy + Into<i64> + Send>(
        &self,
        py: Python<'_>,
        array: &Mutex<GrownArray>,
        fetch: impl Fn(&core::Cache, Option<u64>, usize) -> core::Result<core::Grown<T>> + Send + Sync,
    ) -> PyResult<Py<PyArray1<i64>>> {
        grown::read(py, array, |epoch, from| {
            run(py, self.inner.cache(), 0, |c| fetch(c, epoch, from))
        })
    }
}

#[pymethods]
impl PyRequest {
    /// Every token the request holds KV for: the reused prefix, then what was extended.
    #[getter]
    fn tokens(&self, py: Python<'_>) -> PyResult<Py<PyArray1<i64>>> {
        let id = self.inner.id();
        self.grown(py, &self.tokens, |c, epoch, from| {
            c.request_tokens_from(id, epoch, from)
        })
    }

    /// Tokens reusable on the device now (the locked cached prefix).
    #[getter]
    fn prefix_len(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.view(py)?.prefix_len)
    }

    /// Further tokens loadable from the host tier.
    #[getter]
    fn host_len(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.view(py)?.host_len)
    }

    /// `Match.kv_len` at admission: checkpoint here during prefill.
    #[getter]
    fn branch_len(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.view(py)?.branch_len)
    }

    /// Device KV slots of every token the request holds, in order.
    #[getter]
    fn kv_indices(&self, py: Python<'_>) -> PyResult<Py<PyArray1<i64>>> {
        let id = self.inner.id();
        self.grown(py, &self.kv_indices, |c, epoch, from| {
            c.request_slots_from(id, epoch, from)
        })
    }

    /// SWA: the SWA KV slot of each token from `swa_start` to the end (int64, aligned
    /// with `tokens[swa_start:]`): what the SWA layers read and write. Empty without
    /// SWA layers.
    #[getter]
    fn swa_indices(&self, py: Python<'_>) -> PyResult<Slots> {
        let id = self.inner.id();
        let (_, slots) = run(py, self.inner.cache(), 0, |c| c.request_swa_indices(id))?;
        Ok(array(py, slots))
    }

    /// SWA: the first token `swa_indices` covers: at most the last `swa_window` tokens
    /// before the last `extend` (what its forward pass reads). The request's length
    /// without SWA layers.
    #[getter]
    fn swa_start(&self, py: Python<'_>) -> PyResult<usize> {
        let id = self.inner.id();
        let (start, _) = run(py, self.inner.cache(), 0, |c| c.request_swa_indices(id))?;
        Ok(start)
    }

    /// The request's own state slot, or None.
    #[getter]
    fn mamba_slot(&self, py: Python<'_>) -> PyResult<Option<u32>> {
        Ok(self.view(py)?.mamba_slot)
    }

    /// The end node of the locked prefix.
    #[getter]
    fn node(&self, py: Python<'_>) -> PyResult<PyNode> {
        Ok(PyNode {
            id: self.view(py)?.node,
            cache: self.inner.cache().clone(),
        })
    }

    /// The admission copy-on-write batch id until it is acknowledged, else None.
    #[getter]
    fn copy_pending(&self, py: Python<'_>) -> PyResult<Option<u128>> {
        Ok(self.view(py)?.copy_pending.map(core::BatchId::to_u128))
    }

    /// The batch id of a load-back for this request, from `load_back` until its copies
    /// are acknowledged (or its guard released), else None.
    #[getter]
    fn load_pending(&self, py: Python<'_>) -> PyResult<Option<u128>> {
        Ok(self.view(py)?.load_pending.map(core::BatchId::to_u128))
    }

    /// True until the request is finished or aborted (False too once the cache broke).
    #[getter]
    fn live(&self, py: Python<'_>) -> bool {
        let id = self.inner.id();
        run(py, self.inner.cache(), 0, |c| Ok(c.request_live(id))).unwrap_or(false)
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        match self.view(py) {
            Ok(v) => format!(
                "<Request {} tokens, prefix_len={}, mamba_slot={}>",
                v.len,
                v.prefix_len,
                v.mamba_slot.map_or("None".to_owned(), |s| s.to_string())
            ),
            Err(_) => "<Request (finished)>".to_owned(),
        }
    }
}

impl Drop for PyRequest {
    fn drop(&mut self) {
        // SAFETY: `inner` is taken once, here, and not used after.
        let inner = unsafe { ManuallyDrop::take(&mut self.inner) };
        let (id, cache) = (inner.id(), inner.cache().clone());
        Python::attach(|py| {
            // The handle's drop aborts a live request.
            let live = settle(py, &cache, move || {
                let live = inner.is_live();
                drop(inner);
                live
            });
            if live {
                warn_from_finalizer(
                    py,
                    py.get_type::<PyRequest>().as_any(),
                    &format!("Request {id} was garbage-collected while live; aborted it"),
                );
            }
        });
    }
}

/// A load-back in progress (from `HybridCache.load_back`): it owns every slot and lock
/// the load took until `commit()`. Leaving its `with` block uncommitted, `release()`,
/// or garbage collection (which warns) gives everything back.
#[pyclass(frozen, module = "radixcache._core", name = "LoadBack")]
struct PyLoadBack {
    guard: Mutex<Option<core::LoadBack>>,
    batch: Py<PyTransferBatch>,
    id: u128,
    kv_tokens: usize,
    committed: std::sync::atomic::AtomicBool,
    cache: core::HybridCache,
}

impl PyLoadBack {
    fn new(py: Python<'_>, cache: &core::HybridCache, guard: core::LoadBack) -> PyResult<Self> {
        let batch = copies(py, guard.batch()).and_then(|copies| {
            let handle = guard.batch_handle();
            Py::new(py, PyTransferBatch::new(cache, handle, copies))
        });
        let batch = match batch {
            Ok(batch) => batch,
            Err(e) => {
                settle(py, cache, move || drop(guard));
                return Err(e);
            }
        };
        Ok(PyLoadBack {
            id: guard.id().to_u128(),
            kv_tokens: guard.kv_tokens(),
            guard: Mutex::new(Some(guard)),
            batch,
            committed: std::sync::atomic::AtomicBool::new(false),
            cache: cache.clone(),
        })
    }

    /// Takes the guard out (None once committed or released).
    fn take(&self, py: Python<'_>) -> Option<core::LoadBack> {
        gil::lock(py, &self.guard).take()
    }

    fn is_committed(&self) -> bool {
        self.committed.load(std::sync::atomic::Ordering::Relaxed)
    }
}

#[pymethods]
impl PyLoadBack {
    /// The host-to-device copies to run; acknowledge them with `complete(batch.id)` or
    /// `fail(batch.id)`.
    #[getter]
    fn batch(&self, py: Python<'_>) -> Py<PyTransferBatch> {
        self.batch.clone_ref(py)
    }

    /// KV tokens this load moves to the device.
    #[getter]
    fn kv_tokens(&self) -> usize {
        self.kv_tokens
    }

    /// True once `commit()` succeeded.
    #[getter]
    fn committed(&self) -> bool {
        self.is_committed()
    }

    /// True while the guard still holds what it took (neither committed nor released).
    #[getter]
    fn held(&self, py: Python<'_>) -> bool {
        gil::lock(py, &self.guard).is_some()
    }

    /// Publish the load: the nodes get their device slots (matchable once the batch is
    /// also completed) and the request's prefix grows. Raises `CacheError` when the
    /// batch failed or the request extended since (the guard is then released), or
    /// when the guard was committed or released already.
    fn commit(&self, py: Python<'_>) -> PyResult<()> {
        let Some(guard) = self.take(py) else {
            let what = if self.is_committed() {
                "committed already"
            } else {
                "released already"
            };
            return Err(CacheError::new_err(format!(
                "load-back {} was {what}",
                self.id
            )));
        };
        settle(py, &self.cache, move || guard.commit()).map_err(err)?;
        self.committed
            .store(true, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// Call the load off: release its lock and give back every slot it took (at once,
    /// or when its batch is acknowledged if it was started). No-op after commit.
    fn release(&self, py: Python<'_>) {
        if let Some(guard) = self.take(py) {
            settle(py, &self.cache, move || drop(guard));
        }
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.release(py);
        false
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let state = if self.is_committed() {
            "committed"
        } else if self.held(py) {
            "held"
        } else {
            "released"
        };
        format!(
            "<LoadBack batch={} kv_tokens={} {state}>",
            self.id, self.kv_tokens
        )
    }
}

impl Drop for PyLoadBack {
    fn drop(&mut self) {
        if let Some(guard) = self.guard.get_mut().take() {
            let id = guard.id();
            Python::attach(|py| {
                settle(py, &self.cache, move || drop(guard));
                warn_from_finalizer(
                    py,
                    py.get_type::<PyLoadBack>().as_any(),
                    &format!(
                        "LoadBack {id} was garbage-collected uncommitted; released what it took"
                    ),
                );
            });
        }
    }
}

/// One copy of a transfer batch: `src[i]` of `src_tier` to `dst[i]` of `dst_tier`.
/// `src` and `dst` are read-only: they are what the cache will publish.
#[pyclass(frozen, module = "radixcache._core", name = "Copy", get_all)]
struct PyCopy {
    pool: &'static str,
    src_tier: &'static str,
    dst_tier: &'static str,
    src: Py<PyArray1<i64>>,
    dst: Py<PyArray1<i64>>,
}

#[pymethods]
impl PyCopy {
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "Copy({}, {}->{}, src={}, dst={})",
            self.pool,
            self.src_tier,
            self.dst_tier,
            self.src.bind(py).repr()?,
            self.dst.bind(py).repr()?
        ))
    }
}

/// The Python side of a batch's copies, their slot arrays read-only.
fn copies(py: Python<'_>, batch: &core::TransferBatch) -> PyResult<Vec<Py<PyCopy>>> {
    batch
        .copies
        .iter()
        .map(|c| {
            Py::new(
                py,
                PyCopy {
                    pool: c.pool.as_str(),
                    src_tier: c.src_tier.as_str(),
                    dst_tier: c.dst_tier.as_str(),
                    src: grown::read_only(py, &c.src)?,
                    dst: grown::read_only(py, &c.dst)?,
                },
            )
        })
        .collect()
}

/// Data movement the cache needs, owned by this object until it ends: `start()`, run
/// the copies, then `complete()` or `fail(reason)`. Leaving a `with` block before it
/// ended fails it; collected before it ended, it is abandoned (with a `ResourceWarning`).
#[pyclass(frozen, module = "radixcache._core", name = "TransferBatch")]
struct PyTransferBatch {
    #[pyo3(get)]
    id: u128,
    #[pyo3(get)]
    kind: &'static str,
    #[pyo3(get)]
    copies: Vec<Py<PyCopy>>,
    inner: core::Batch,
    /// The cache that issued the batch.
    cache: core::HybridCache,
}

impl PyTransferBatch {
    /// The batch of `inner` (issued by `cache`), whose copies are `copies`.
    fn new(cache: &core::HybridCache, inner: core::Batch, copies: Vec<Py<PyCopy>>) -> Self {
        let b = inner.batch();
        PyTransferBatch {
            id: b.id.to_u128(),
            kind: b.kind.as_str(),
            copies,
            inner,
            cache: cache.clone(),
        }
    }
}

#[pymethods]
impl PyTransferBatch {
    /// The engine is about to run the copies (once).
    fn start(&self, py: Python<'_>) -> PyResult<()> {
        settle(py, &self.cache, || self.inner.start()).map_err(err)
    }

    /// The copies are done: publishes what the batch carried, releases what it held.
    fn complete(&self, py: Python<'_>) -> PyResult<()> {
        settle(py, &self.cache, || self.inner.complete()).map_err(err)
    }

    /// The copies failed: undoes what the batch would have published.
    #[pyo3(signature = (reason=None))]
    fn fail(&self, py: Python<'_>, reason: Option<String>) -> PyResult<()> {
        let reason = reason.unwrap_or_else(|| "failed".to_owned());
        settle(py, &self.cache, || self.inner.fail(&reason)).map_err(err)
    }

    /// `None` until the batch ended through this object, then `"completed"`,
    /// `"failed"` or `"abandoned"`.
    #[getter]
    fn outcome(&self) -> Option<&'static str> {
        self.inner.outcome().map(|o| match o {
            core::Outcome::Completed => "completed",
            core::Outcome::Failed(_) => "failed",
            core::Outcome::Abandoned(_) => "abandoned",
        })
    }

    /// Why the batch failed (the `reason` given to `fail`), else `None`.
    #[getter]
    fn reason(&self) -> Option<String> {
        match self.inner.outcome() {
            Some(core::Outcome::Failed(why)) => Some(why),
            _ => None,
        }
    }

    /// Tell whether `cache` issued the batch: only that cache's storage holds the slots
    /// its copies name, and only that cache may acknowledge it.
    fn belongs_to(&self, cache: &Bound<'_, PyAny>) -> PyResult<bool> {
        let cache = cache.cast::<PyHybridCache>().map_err(|_| {
            PyTypeError::new_err(format!(
                "cache: expected a HybridCache, got {}",
                cache
                    .get_type()
                    .name()
                    .map_or_else(|_| "?".into(), |n| n.to_string())
            ))
        })?;
        Ok(self.cache.same_cache(&cache.get().inner))
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Fails the batch if it is still in flight (an exception inside the block, or a
    /// batch left unended): leaving the block says its copies no longer run.
    #[pyo3(signature = (*exc))]
    fn __exit__(&self, py: Python<'_>, exc: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<bool> {
        let reason = match exc.get_item(1) {
            Ok(e) if !e.is_none() => format!("{}: {e}", e.get_type().name()?),
            _ => "left its with block before it ended".to_owned(),
        };
        settle(py, &self.cache, || self.inner.close(&reason)).map_err(err)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        format!(
            "TransferBatch(id={}, kind={:?}, copies={}{})",
            self.id,
            self.kind,
            self.copies.len(),
            self.outcome().map(|o| format!(", {o}")).unwrap_or_default()
        )
    }
}

impl Drop for PyTransferBatch {
    fn drop(&mut self) {
        let (id, kind) = (self.id, self.kind);
        Python::attach(|py| {
            // The handle's own drop (right after this) finds nothing left to do.
            let inner = &self.inner;
            let what = match settle(py, &self.cache, || inner.abandon()) {
                core::Abandoned::Nothing => return,
                core::Abandoned::Failed => "failed it",
                core::Abandoned::Draining => {
                    "it was started, so it stays in flight until acknowledged by id, then fails"
                }
            };
            warn_from_finalizer(
                py,
                py.get_type::<PyTransferBatch>().as_any(),
                &format!(
                    "TransferBatch {id} ({kind}) was garbage-collected before it ended; {what}"
                ),
            );
        });
    }
}

/// `HybridCache`'s constructor signature, for `inspect.signature` and `help()` where the
/// class's `text_signature` does not reach them: CPython 3.9 strips it from a class made
/// through the stable ABI. Must read as the `text_signature` of `PyHybridCache::new`.
const HYBRID_CACHE_PARAMETERS: &str = "kv_slots=8192, page_size=1, mamba_slots=0, \
    host_kv_slots=0, host_mamba_slots=0, write_policy='write_through', \
    write_through_threshold=None, pools='cache'";

/// Gives `HybridCache` a `__signature__` when the interpreter lost its text signature.
fn constructor_signature(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let class = py.get_type::<PyHybridCache>();
    if class.getattr("__text_signature__")?.is_truthy()? {
        return Ok(());
    }
    let code = CString::new(format!("lambda {HYBRID_CACHE_PARAMETERS}: None"))?;
    let template = py.eval(&code, None, None)?;
    let signature = py
        .import("inspect")?
        .call_method1("signature", (template,))?;
    class.setattr("__signature__", signature)
}

/// For tests of the layout reads: `(value, bytes read)` of the fast path on `obj`, an
/// exact int (`value` None where the fast path declines it), or None when the layout
/// reads are off.
#[pyfunction]
fn _small_int_read(obj: &Bound<'_, PyAny>) -> PyResult<Option<(Option<i64>, usize)>> {
    if !obj.is_exact_instance_of::<pyo3::types::PyInt>() {
        return Err(PyTypeError::new_err(format!(
            "obj: expected an exact int, got {}",
            obj.get_type().name()?
        )));
    }
    // SAFETY: `obj` is a live exact int, and the layout is this interpreter's.
    Ok(layout::int_layout().map(|l| unsafe { layout::small_int_read(l, obj.as_ptr()) }))
}

/// The extension module. It needs the GIL: under a free-threaded build, importing it
/// turns the GIL on (the layout reads are off there in any case).
#[pymodule(gil_used = true)]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    gil::init(py)?;
    m.add_class::<PyHybridCache>()?;
    m.add_class::<PyNode>()?;
    m.add_class::<PyMatch>()?;
    m.add_class::<PyInsert>()?;
    m.add_class::<PyEvicted>()?;
    m.add_class::<PyLock>()?;
    m.add_class::<PyRequest>()?;
    m.add_class::<PyLoadBack>()?;
    m.add_class::<PyCopy>()?;
    m.add_class::<PyTransferBatch>()?;
    m.add("CacheError", py.get_type::<CacheError>())?;
    m.add("InvariantError", py.get_type::<InvariantError>())?;
    m.add("StaleNodeError", py.get_type::<StaleNodeError>())?;
    m.add("LockError", py.get_type::<LockError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // The CUDA sources the engine compiles with CuPy: one source of truth, in the wheel
    // (set, not added: for radixcache._kernels, not part of `__all__`).
    let kernels = PyDict::new(py);
    kernels.set_item("copy_slots", include_str!("../../../kernels/copy_slots.cu"))?;
    m.setattr("KERNEL_SOURCES", kernels)?;
    // Private (not in `__all__`): set, not added.
    m.setattr("_int_fast_path", layout::init(py)?)?;
    m.setattr("_small_int_read", wrap_pyfunction!(_small_int_read, m)?)?;
    constructor_signature(m)?;
    Ok(())
}
