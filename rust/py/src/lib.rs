//! `radixcache._core`: the Python bindings of radixcache-core.
//!
//! This crate converts types and errors and holds no cache logic: every method takes
//! its arguments apart, calls the core once, and builds Python values from the plain
//! Rust result after the core's lock is released. Every lock follows the policy of
//! [`gil`]: never wait for a lock while holding the GIL, never create Python objects
//! while holding a lock.
//!
//! One module per Python class, in the order the module registers them: [`cache`]
//! (`HybridCache`), [`node`] (`Node`), [`results`] (`Match`, `Insert`, `Evicted`),
//! [`lock`] (`Lock`), [`request`] (`Request`), [`load_back`] (`LoadBack`), [`batch`]
//! (`Copy`, `TransferBatch`), [`l3`] (`ObjectStore` and `Breaker`, the L3 tier's stores) and
//! [`errors`] (the exceptions). What they share:
//! [`convert`] reads arguments, [`gil`] holds the lock policy, [`grown`] the arrays a
//! request hands out, [`layout`] the token lists read in place.

use pyo3::prelude::*;
use pyo3::types::PyDict;

mod batch;
mod cache;
mod convert;
mod errors;
mod events;
mod gil;
mod grown;
mod hashing;
mod l3;
mod layout;
mod load_back;
mod lock;
mod node;
mod request;
mod results;
use batch::{PyCopy, PyTransferBatch};
use cache::{constructor_signature, PyHybridCache};
use errors::{CacheError, InvariantError, L3Error, LockError, StaleNodeError};
use l3::{PyBreaker, PyObjectStore};
use layout::_small_int_read;
use load_back::PyLoadBack;
use lock::PyLock;
use node::PyNode;
use request::PyRequest;
use results::{PyEvicted, PyInsert, PyMatch};

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
    m.add_class::<PyObjectStore>()?;
    m.add_class::<events::PyKvEvent>()?;
    m.add_class::<PyBreaker>()?;
    m.add("CacheError", py.get_type::<CacheError>())?;
    m.add("InvariantError", py.get_type::<InvariantError>())?;
    m.add("StaleNodeError", py.get_type::<StaleNodeError>())?;
    m.add("LockError", py.get_type::<LockError>())?;
    m.add("L3Error", py.get_type::<L3Error>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // The CUDA sources the engine compiles with CuPy: one source of truth, in the wheel
    // (set, not added: for radixcache._kernels, not part of `__all__`).
    let kernels = PyDict::new(py);
    kernels.set_item("copy_slots", include_str!("../../../kernels/copy_slots.cu"))?;
    m.setattr("KERNEL_SOURCES", kernels)?;
    // Private (not in `__all__`): set, not added.
    m.setattr("_int_fast_path", layout::init(py)?)?;
    m.setattr("_small_int_read", wrap_pyfunction!(_small_int_read, m)?)?;
    m.add_function(wrap_pyfunction!(hashing::chain_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(l3::frame_encode, m)?)?;
    m.add_function(wrap_pyfunction!(l3::frame_decode, m)?)?;
    m.add("FRAME_HEADER_LEN", radixcache_l3::frame::HEADER_LEN)?;
    constructor_signature(m)?;
    Ok(())
}
