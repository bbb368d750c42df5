//! `Request`: a request admitted by the cache, which owns its slots until it ends.

use std::mem::ManuallyDrop;

use numpy::PyArray1;
use parking_lot::Mutex;
use pyo3::prelude::*;
use radixcache_core as core;

use crate::gil::{run, settle, warn_from_finalizer};
use crate::grown::{self, GrownArray};
use crate::node::PyNode;
use crate::results::array;

/// A request admitted by `HybridCache.admit`: it owns its slots until finished or
/// aborted; one collected while live is aborted and warns.
#[pyclass(frozen, module = "radixcache._core", name = "Request")]
pub(crate) struct PyRequest {
    /// Dropped by `Drop for PyRequest` only, by the GIL policy (see [`gil`](crate::gil)).
    pub(crate) inner: ManuallyDrop<core::Request>,
    /// The last reads of `tokens` and `kv_indices`, grown read after read.
    tokens: Mutex<GrownArray>,
    kv_indices: Mutex<GrownArray>,
}

impl PyRequest {
    pub(crate) fn new(inner: core::Request) -> PyRequest {
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
    fn swa_indices(&self, py: Python<'_>) -> PyResult<Py<PyArray1<i64>>> {
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
