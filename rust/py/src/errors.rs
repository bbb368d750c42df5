//! The exceptions of `radixcache._core`, and the one mapping from the core's errors to
//! them.

use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyMemoryError, PyValueError};
use pyo3::prelude::*;
use radixcache_core as core;
use radixcache_l3 as l3;

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

create_exception!(
    _core,
    L3Error,
    CacheError,
    "An L3 object store failed or timed out (the message says which)."
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
        core::Error::Request(_)
        | core::Error::Broken(_)
        | core::Error::EngineOwned(_)
        | core::Error::Busy(_) => CacheError::new_err(msg),
        core::Error::Invariant(_) => InvariantError::new_err(msg),
        core::Error::OutOfMemory { .. } => PyMemoryError::new_err(msg),
    }
}

/// Maps a store error: inconsistent arguments are the caller's (`ValueError`), the rest
/// the store's (`L3Error`, whose `cause` attribute says why in words: `"connection
/// refused"`, `"timeout"`, ...). Exhaustive, as [`err`].
#[allow(clippy::needless_pass_by_value)] // by value so that it reads `.map_err(l3_err)`
pub(crate) fn l3_err(e: l3::StoreError) -> PyErr {
    let msg = e.to_string();
    match e {
        // The binding checks lengths itself, so a mismatch names its argument already.
        l3::StoreError::Mismatch { .. } => PyValueError::new_err(msg),
        l3::StoreError::KeyTooLong { .. } => PyValueError::new_err(format!("keys: {msg}")),
        l3::StoreError::Timeout { .. } | l3::StoreError::Failed { .. } => {
            let cause = e.cause().as_str();
            Python::attach(|py| {
                let err = L3Error::new_err(msg);
                // Setting an attribute on a fresh exception cannot fail but for memory;
                // the error is raised either way, with or without its cause.
                let _ = err.value(py).setattr("cause", cause);
                err
            })
        }
    }
}

/// Maps an error of opening a store: a bad URL is the caller's (`ValueError`).
#[allow(clippy::needless_pass_by_value)] // by value so that it reads `.map_err(open_err)`
pub(crate) fn open_err(e: l3::OpenError) -> PyErr {
    match e {
        l3::OpenError::Url { .. } => PyValueError::new_err(format!("url: {e}")),
        l3::OpenError::Store(e) => l3_err(e),
    }
}
