//! `HybridCache`'s methods, one per core call, and the constructor's signature for
//! interpreters that lose it (the class and what it keeps are in [`super`]).

use std::ffi::CString;

use numpy::PyArray1;
use parking_lot::Mutex;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict, PyList, PyString};
use radixcache_core as core;

use crate::batch::{copies, PyTransferBatch};
use crate::convert::{hash_list, hashes_arg, indices_arg, opt_hash_arg, tokens_arg, BatchArg, Int};
use crate::errors::err;
use crate::events::PyKvEvent;
use crate::gil::{self, run, settle};
use crate::load_back::PyLoadBack;
use crate::lock::PyLock;
use crate::node::PyNode;
use crate::request::PyRequest;
use crate::results::{array, PyEvicted, PyInsert, PyMatch};

use super::PyHybridCache;

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
/// per component (`{"kv": ..., "mamba": ..., "swa": ...}`); the core checks the names.
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

#[pymethods]
impl PyHybridCache {
    #[new]
    #[allow(clippy::too_many_arguments)] // one per argument of the Python constructor
    #[pyo3(signature = (kv_slots=Int::Value(8192), page_size=Int::Value(1),
                        mamba_slots=Int::Value(0), host_kv_slots=Int::Value(0),
                        host_mamba_slots=Int::Value(0), write_policy="write_through",
                        write_through_threshold=None, pools=core::PoolOwner::Cache,
                        eviction_policy=core::EvictionPolicies::default(),
                        swa_slots=Int::Value(0), swa_window=Int::Value(0),
                        host_swa_slots=Int::Value(0), page_hashes=false, hash_seed=None,
                        events=false, l3=false, l3_write=None),
           text_signature = "(kv_slots=8192, page_size=1, mamba_slots=0, host_kv_slots=0, host_mamba_slots=0, write_policy='write_through', write_through_threshold=None, pools='cache', eviction_policy='lru', swa_slots=0, swa_window=0, host_swa_slots=0, page_hashes=False, hash_seed=None, events=False, l3=False, l3_write=None)")]
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
        host_swa_slots: Int,
        page_hashes: bool,
        hash_seed: Option<&Bound<'_, PyAny>>,
        events: bool,
        l3: bool,
        l3_write: Option<&str>,
    ) -> PyResult<Self> {
        let l3_write = match l3_write {
            None => core::L3Write::default(),
            Some(w) => {
                let w: core::L3Write = w.parse().map_err(err)?;
                if !l3 {
                    return Err(err(core::Error::InvalidArgument {
                        arg: "l3_write",
                        reason: format!(
                            "\"{w}\" given without an L3 tier; pass l3=True or leave it out"
                        ),
                    }));
                }
                w
            }
        };
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
            host_swa_slots: host_swa_slots.count("host_swa_slots")?,
            page_hashes,
            hash_seed: opt_hash_arg(hash_seed, "hash_seed")?,
            events,
            l3,
            l3_write,
        };
        Ok(PyHybridCache {
            inner: core::HybridCache::new(config.clone()).map_err(err)?,
            config,
        })
    }

    /// Whether host pages go to, and come from, the L3 tier.
    #[getter]
    fn l3(&self) -> bool {
        self.config.l3
    }

    /// When host pages go to the L3 tier: "backup" or "host_eviction"; None without an
    /// L3 tier.
    #[allow(clippy::doc_markdown)] // the Python docstring: `help()` shows it as written
    #[getter]
    fn l3_write(&self) -> Option<&'static str> {
        self.config.l3.then(|| self.config.l3_write.as_str())
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

    /// The components of the model, full attention first: ("full",), ("full", "mamba"),
    /// ("full", "swa") or ("full", "mamba", "swa").
    #[getter]
    fn components<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyTuple>> {
        let names = core::Model::of(&self.config)
            .components()
            .into_iter()
            .map(core::ComponentKind::name);
        pyo3::types::PyTuple::new(py, names)
    }

    /// Host-tier SWA slots (0: no SWA layers or no host tier).
    #[getter]
    fn host_swa_slots(&self) -> usize {
        self.config.host_swa_slots
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

    /// The eviction policy of each component: {"kv": name, "mamba": name}, and
    /// "swa": name when the model has SWA layers.
    #[getter]
    fn eviction_policy<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        let p = self.config.eviction_policy;
        d.set_item("kv", p.kv.as_str())?;
        d.set_item("mamba", p.mamba.as_str())?;
        if self.config.has_swa() {
            d.set_item("swa", p.swa.as_str())?;
        }
        Ok(d)
    }

    /// Who owns the device slots: "cache" (its own pools) or "engine".
    #[getter]
    fn pools(&self) -> &'static str {
        self.config.pools.as_str()
    }

    /// The SHA-256 of each page of `node`, in order (a root: none). `ValueError`
    /// naming `page_hashes` when the cache was built without them.
    fn page_hashes<'py>(
        &self,
        py: Python<'py>,
        node: &Bound<'_, PyNode>,
    ) -> PyResult<Bound<'py, PyList>> {
        let id = node.get().id;
        let hashes = run(py, &self.inner, 0, |c| c.node_hashes(id).map(<[_]>::to_vec))?;
        hash_list(py, &hashes)
    }

    /// The KV events emitted since the last call, oldest first. `ValueError` naming
    /// `events` when the cache was built without them (`page_hashes=True, events=True`).
    fn take_events(&self, py: Python<'_>) -> PyResult<Vec<PyKvEvent>> {
        let events = run(py, &self.inner, 0, core::Cache::take_events)?;
        let ps = self.config.page_size;
        Ok(events.into_iter().map(|e| PyKvEvent::new(e, ps)).collect())
    }

    /// Announce pages written to the L3 tier (medium `"EXTERNAL"`): `hashes`, one per
    /// page of `token_ids`, chained from `parent_hash`. The cache keeps no books of the
    /// external tier; `ValueError` naming `events` when events are off.
    #[pyo3(signature = (hashes, token_ids, *, namespace=None, parent_hash=None))]
    fn note_external_stored(
        &self,
        py: Python<'_>,
        hashes: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
        namespace: Option<&str>,
        parent_hash: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let hashes = hashes_arg(hashes, "hashes")?;
        let tokens = tokens_arg(token_ids, "token_ids")?;
        let parent = opt_hash_arg(parent_hash, "parent_hash")?;
        run(py, &self.inner, 0, |c| {
            c.note_external_stored(namespace, hashes, parent, tokens)
        })
    }

    /// Announce pages gone from the L3 tier (medium `"EXTERNAL"`).
    #[pyo3(signature = (hashes, *, namespace=None))]
    fn note_external_removed(
        &self,
        py: Python<'_>,
        hashes: &Bound<'_, PyAny>,
        namespace: Option<&str>,
    ) -> PyResult<()> {
        let hashes = hashes_arg(hashes, "hashes")?;
        run(py, &self.inner, 0, |c| {
            c.note_external_removed(namespace, hashes)
        })
    }

    /// For tests: what the tree holds as a router's index of the events would, computed
    /// from the nodes: `(pages, states)`, each a sorted list of `(medium, namespace,
    /// hash)`.
    #[allow(clippy::type_complexity)] // the plain tuples the tests compare
    fn _event_contents<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<(
        Vec<(&'static str, Option<String>, Bound<'py, PyBytes>)>,
        Vec<(&'static str, Option<String>, Bound<'py, PyBytes>)>,
    )> {
        let contents = run(py, &self.inner, 0, |c| Ok(c.event_contents()))?;
        let entries = |v: Vec<(core::Medium, Option<String>, core::PageHash)>| {
            v.into_iter()
                .map(|(m, ns, h)| (m.as_str(), ns, PyBytes::new(py, &h)))
                .collect::<Vec<_>>()
        };
        Ok((entries(contents.pages), entries(contents.states)))
    }

    /// The hashes of the whole pages of `tokens` as this cache chains them in
    /// `namespace`: from `parent_hash` (the page before `tokens`, e.g.
    /// `Match.last_hash`), or from the namespace's seed when None.
    #[pyo3(signature = (tokens, *, namespace=None, parent_hash=None))]
    fn chain_hashes<'py>(
        &self,
        py: Python<'py>,
        tokens: &Bound<'_, PyAny>,
        namespace: Option<&str>,
        parent_hash: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Bound<'py, PyList>> {
        let tokens = tokens_arg(tokens, "tokens")?;
        let parent = opt_hash_arg(parent_hash, "parent_hash")?;
        let hashes = run(py, &self.inner, tokens.len(), |c| {
            Ok(c.chain_hashes(namespace, parent, &tokens))
        })?;
        hash_list(py, &hashes)
    }

    /// The seed of the page-hash chains (None: the seeds of `SGLang` `HiCache`).
    #[getter]
    fn hash_seed<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        self.config.hash_seed.map(|h| PyBytes::new(py, &h))
    }

    /// Whether the cache queues KV events (`take_events()`).
    #[getter]
    fn events(&self) -> bool {
        self.config.events
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

    #[allow(clippy::doc_markdown)] // the Python docstring
    /// Fetch from the L3 tier the `pages` whole pages of `tokens` that follow what the
    /// cache holds of it (on either tier), with the state at their end on a hybrid
    /// model: an "l3_get" TransferBatch the caller runs and ends, or None having taken
    /// nothing.
    #[pyo3(signature = (tokens, pages, *, namespace=None))]
    fn l3_fetch(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        pages: Int,
        namespace: Option<&str>,
    ) -> PyResult<Option<PyTransferBatch>> {
        let tokens = tokens_arg(tokens, "tokens")?;
        let pages = pages.count("pages")?;
        let batch = run(py, &self.inner, tokens.len(), |c| {
            c.l3_fetch(namespace, &tokens, pages)
        })?;
        let Some(batch) = batch else {
            return Ok(None);
        };
        // The Python side first, then the handle, which owns the batch: a failure
        // (MemoryError) before gives back what the handle owns at once.
        let copies = copies(py, &batch);
        let handles = self.inner.own_batches(vec![batch]);
        let copies = copies?;
        // One handle per batch given.
        Ok(handles
            .into_iter()
            .next()
            .map(|handle| PyTransferBatch::new(&self.inner, handle, copies)))
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
            last_hash: m.last_hash.map(|h| PyBytes::new(py, &h).unbind()),
        })
    }

    /// `(device_len, host_len, kv_len)` that `match_prefix` would answer, with none of
    /// its effects.
    #[pyo3(signature = (tokens, *, namespace=None))]
    fn peek_prefix(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        namespace: Option<&str>,
    ) -> PyResult<(usize, usize, usize)> {
        let tokens = tokens_arg(tokens, "tokens")?;
        let p = run(py, &self.inner, tokens.len(), |c| {
            Ok(c.peek_prefix(namespace, &tokens))
        })?;
        Ok((p.device_len, p.host_len, p.kv_len))
    }

    /// `(kv_len, hash)`: where the KV `match_prefix` would find ends (either tier) and
    /// the hash of the page ending there (None when nothing matched or without page
    /// hashes), with none of its effects.
    #[pyo3(signature = (tokens, *, namespace=None))]
    fn peek_hash(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        namespace: Option<&str>,
    ) -> PyResult<(usize, Option<Py<PyBytes>>)> {
        let tokens = tokens_arg(tokens, "tokens")?;
        let p = run(py, &self.inner, tokens.len(), |c| {
            Ok(c.peek_prefix(namespace, &tokens))
        })?;
        Ok((p.kv_len, p.kv_hash.map(|h| PyBytes::new(py, &h).unbind())))
    }

    /// Marks where the matches of the requests a scheduler admits next would end
    /// (`prompts`, soonest first; `namespaces`, one each, or None for the default
    /// namespace): eviction gives those nodes out last. Returns how many are marked.
    #[pyo3(signature = (prompts, *, namespaces=None))]
    fn expect<'py>(
        &self,
        py: Python<'py>,
        prompts: &Bound<'py, PyAny>,
        namespaces: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<usize> {
        let type_err = |arg: &str, what: &str, v: &Bound<'_, PyAny>| {
            PyTypeError::new_err(format!(
                "{arg}: expected {what}, got {}",
                v.get_type()
                    .name()
                    .map_or_else(|_| "?".into(), |n| n.to_string())
            ))
        };
        // Any iterable but a string (a list, a tuple, a 2-D array's rows), item by item.
        let items = |v: &Bound<'py, PyAny>| -> Option<Vec<Bound<'py, PyAny>>> {
            let text = v.is_instance_of::<PyString>()
                || v.is_instance_of::<PyBytes>()
                || v.is_instance_of::<PyByteArray>();
            if text {
                return None;
            }
            v.try_iter().ok()?.collect::<PyResult<Vec<_>>>().ok()
        };
        let prompts: Vec<Vec<u32>> = items(prompts)
            .ok_or_else(|| type_err("prompts", "an iterable of token sequences", prompts))?
            .iter()
            .enumerate()
            .map(|(k, p)| tokens_arg(p, &format!("prompts[{k}]")))
            .collect::<PyResult<_>>()?;
        let namespaces: Vec<Option<String>> = match namespaces {
            None => vec![None; prompts.len()],
            Some(v) => {
                let names = items(v)
                    .ok_or_else(|| type_err("namespaces", "an iterable of str or None", v))?
                    .into_iter()
                    .enumerate()
                    .map(|(k, n)| {
                        n.extract::<Option<String>>()
                            .map_err(|_| type_err(&format!("namespaces[{k}]"), "str or None", &n))
                    })
                    .collect::<PyResult<Vec<_>>>()?;
                if names.len() != prompts.len() {
                    return Err(PyValueError::new_err(format!(
                        "namespaces: {} given for {} prompts (one each)",
                        names.len(),
                        prompts.len()
                    )));
                }
                names
            }
        };
        let tokens = prompts.iter().map(Vec::len).sum();
        run(py, &self.inner, tokens, |c| {
            let items: Vec<(Option<&str>, &[u32])> = namespaces
                .iter()
                .map(Option::as_deref)
                .zip(prompts.iter().map(Vec::as_slice))
                .collect();
            Ok(c.expect(&items))
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

    /// SWA: free at least `pages` SWA pages (or all that can go), in the SWA eviction
    /// policy's order (least recently used node first under "lru"): an internal node keeps its full KV as an SWA tombstone, a leaf goes
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

    /// Empty the cache: every node of every namespace, on both tiers, when nothing holds
    /// the tree (no live request, lock, batch in flight or pending load-back; else
    /// `CacheError` naming what is outstanding, and nothing changes). Slots go back to
    /// the pools (pools="engine": queued for `take_freed`); the L3 store keeps its
    /// objects; counters keep counting (`resets` counts the call); old node handles are
    /// stale; with events on, one `"cleared"` event follows those still queued.
    fn reset(&self, py: Python<'_>) -> PyResult<()> {
        // A whole tree's worth of work: the GIL is released as for a long call.
        run(py, &self.inner, usize::MAX, core::Cache::reset)
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

/// `HybridCache`'s constructor signature, for `inspect.signature` and `help()` where the
/// class's `text_signature` does not reach them: CPython 3.9 strips it from a class made
/// through the stable ABI. Must read as the `text_signature` of `PyHybridCache::new`.
const HYBRID_CACHE_PARAMETERS: &str = "kv_slots=8192, page_size=1, mamba_slots=0, \
    host_kv_slots=0, host_mamba_slots=0, write_policy='write_through', \
    write_through_threshold=None, pools='cache', \
    eviction_policy='lru', swa_slots=0, swa_window=0, host_swa_slots=0, \
    page_hashes=False, hash_seed=None, events=False, l3=False, l3_write=None";

/// Gives `HybridCache` a `__signature__` when the interpreter lost its text signature.
pub(crate) fn constructor_signature(m: &Bound<'_, PyModule>) -> PyResult<()> {
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
