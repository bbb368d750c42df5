//! `Lock`: a lock receipt, released once.

use parking_lot::Mutex;
use pyo3::prelude::*;
use radixcache_core as core;

use crate::errors::err;
use crate::gil::{self, settle, warn_from_finalizer};
use crate::node::PyNode;

/// A lock receipt. Release it once with `cache.unlock(lock)` or by leaving its `with`
/// block; a receipt collected while still held is released and warns.
#[pyclass(frozen, module = "radixcache._core", name = "Lock")]
pub(crate) struct PyLock {
    pub(crate) node: Py<PyNode>,
    pub(crate) slot: Mutex<Option<core::Lock>>,
    pub(crate) cache: core::HybridCache,
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
