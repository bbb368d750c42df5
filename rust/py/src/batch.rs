//! `TransferBatch` and its `Copy`s: the data movement the cache hands the engine.

use numpy::PyArray1;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use radixcache_core as core;

use crate::cache::PyHybridCache;
use crate::convert::{indices_arg, Int};
use crate::errors::err;
use crate::gil::{settle, warn_from_finalizer};
use crate::grown;

/// One copy of a transfer batch: `src[i]` of `src_tier` to `dst[i]` of `dst_tier`.
/// `src` and `dst` are read-only: they are what the cache will publish.
#[pyclass(frozen, module = "radixcache._core", name = "Copy", get_all)]
pub(crate) struct PyCopy {
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
pub(crate) fn copies(py: Python<'_>, batch: &core::TransferBatch) -> PyResult<Vec<Py<PyCopy>>> {
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
pub(crate) struct PyTransferBatch {
    #[pyo3(get)]
    id: u128,
    #[pyo3(get)]
    kind: &'static str,
    #[pyo3(get)]
    copies: Vec<Py<PyCopy>>,
    /// The page hashes naming the batch's objects in the L3 tier.
    keys: Vec<[u8; 32]>,
    inner: core::Batch,
    /// The cache that issued the batch.
    cache: core::HybridCache,
}

impl PyTransferBatch {
    /// The batch of `inner` (issued by `cache`), whose copies are `copies`.
    pub(crate) fn new(
        cache: &core::HybridCache,
        inner: core::Batch,
        copies: Vec<Py<PyCopy>>,
    ) -> Self {
        let b = inner.batch();
        PyTransferBatch {
            id: b.id.to_u128(),
            kind: b.kind.as_str(),
            copies,
            keys: b.keys.clone(),
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

    #[allow(clippy::doc_markdown)] // the Python docstring
    /// An "l3_get" batch's objects landed for its first `pages` pages and (`state`) the
    /// state at their end, not for the rest (a miss); `gone`: indices into `keys` of the
    /// objects the store did not hold (missing, or corrupt and deleted), announced as
    /// removed from "EXTERNAL" when the cache has events.
    #[pyo3(signature = (pages, *, state=false, gone=None))]
    fn complete_l3(
        &self,
        py: Python<'_>,
        pages: Int,
        state: bool,
        gone: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let pages = pages.count("pages")?;
        let gone = match gone {
            None => Vec::new(),
            Some(g) => indices_arg(g, "gone")?
                .into_iter()
                .map(|i| {
                    usize::try_from(i)
                        .map_err(|_| PyValueError::new_err(format!("gone: index {i} is negative")))
                })
                .collect::<PyResult<Vec<usize>>>()?,
        };
        settle(py, &self.cache, || {
            self.inner.complete_l3_gone(pages, state, &gone)
        })
        .map_err(err)
    }

    #[allow(clippy::doc_markdown)] // the Python docstring
    /// The page hash naming each object in the L3 tier ("l3_put", "l3_get"): those of
    /// the KV copy's pages, then those of the state copy's states; empty otherwise.
    #[getter]
    fn keys<'py>(&self, py: Python<'py>) -> Vec<Bound<'py, PyBytes>> {
        self.keys.iter().map(|k| PyBytes::new(py, k)).collect()
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
