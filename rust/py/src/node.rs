//! `Node`: an opaque handle to a tree node.

use pyo3::prelude::*;
use radixcache_core as core;

use crate::gil::run;

/// An opaque handle to a tree node: hashable, equal for the same live node.
#[pyclass(frozen, module = "radixcache._core", name = "Node")]
pub(crate) struct PyNode {
    pub(crate) id: core::NodeId,
    pub(crate) cache: core::HybridCache,
}

#[pymethods]
impl PyNode {
    pub(crate) fn __repr__(&self, py: Python<'_>) -> String {
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
