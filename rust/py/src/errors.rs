//! The exceptions of `radixcache._core`, and the one mapping from the core's errors to
//! them.

use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyMemoryError, PyValueError};
use pyo3::prelude::*;
use radixcache_core as core;

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
pub(crate) fn err(e: core::Error) -> PyErr {
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
