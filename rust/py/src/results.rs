//! The plain answers of the cache's calls: `Match`, `Insert`, `Evicted`.

use numpy::PyArray1;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use radixcache_core as core;

use crate::node::PyNode;

pub(crate) fn array(py: Python<'_>, v: Vec<i64>) -> Py<PyArray1<i64>> {
    PyArray1::from_vec(py, v).unbind()
}

/// The answer of `match_prefix`.
#[pyclass(frozen, module = "radixcache._core", name = "Match", get_all)]
pub(crate) struct PyMatch {
    pub(crate) device_len: usize,
    pub(crate) kv_indices: Py<PyArray1<i64>>,
    pub(crate) host_len: usize,
    pub(crate) node: Py<PyNode>,
    pub(crate) host_node: Py<PyNode>,
    pub(crate) mamba_slot: Option<u32>,
    pub(crate) kv_len: usize,
    pub(crate) last_hash: Option<Py<PyBytes>>,
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
pub(crate) struct PyInsert {
    pub(crate) prefix_len: usize,
    pub(crate) node: Py<PyNode>,
    pub(crate) mamba_existed: bool,
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
pub(crate) struct PyEvicted {
    kv_tokens: usize,
    mamba_states: usize,
    kv_indices: Py<PyArray1<i64>>,
    mamba_slots: Py<PyArray1<i64>>,
}

impl PyEvicted {
    pub(crate) fn new(py: Python<'_>, e: core::Evicted) -> PyEvicted {
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
