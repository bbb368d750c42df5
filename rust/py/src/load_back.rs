//! `LoadBack`: a load from the host tier, which owns what it took until committed.

use parking_lot::Mutex;
use pyo3::prelude::*;
use radixcache_core as core;

use crate::batch::{copies, PyTransferBatch};
use crate::errors::{err, CacheError};
use crate::gil::{self, settle, warn_from_finalizer};

/// A load-back in progress (from `HybridCache.load_back`): it owns every slot and lock
/// the load took until `commit()`. Leaving its `with` block uncommitted, `release()`,
/// or garbage collection (which warns) gives everything back.
#[pyclass(frozen, module = "radixcache._core", name = "LoadBack")]
pub(crate) struct PyLoadBack {
    guard: Mutex<Option<core::LoadBack>>,
    batch: Py<PyTransferBatch>,
    id: u128,
    kv_tokens: usize,
    committed: std::sync::atomic::AtomicBool,
    cache: core::HybridCache,
}

impl PyLoadBack {
    pub(crate) fn new(
        py: Python<'_>,
        cache: &core::HybridCache,
        guard: core::LoadBack,
    ) -> PyResult<Self> {
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
