//! Errors of the core. One enum: every public operation returns [`Error`].
//!
//! Messages are lower-case and carry the numbers involved. The Python binding maps
//! every variant by an exhaustive `match` (no catch-all arm), so adding a variant
//! here is a compile error there until it is mapped.

use crate::ids::NodeId;

/// Everything a cache operation can fail with. A failed operation changes nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// An argument is malformed or inconsistent with the cache (Python: `ValueError`).
    #[error("{arg}: {reason}")]
    InvalidArgument {
        /// The name of the argument, as in the Python signature.
        arg: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A node handle refers to a node that no longer exists (Python: `StaleNodeError`).
    #[error("node {0} no longer exists (it was evicted or the handle is from another cache)")]
    StaleNode(NodeId),
    /// A lock receipt was released twice or given to a cache it does not belong to
    /// (Python: `LockError`).
    #[error("{0}")]
    Lock(String),
    /// A request handle that is finished, aborted or from another cache, or a request
    /// call that its state does not allow (Python: `CacheError`).
    #[error("{0}")]
    Request(String),
    /// `audit()` found a broken invariant (Python: `InvariantError`).
    #[error("invariant broken: {0}")]
    Invariant(String),
    /// A panic or an illegal page transition (a bug in radixcache) interrupted a change,
    /// which may be half done: the cache refuses every call from then on (Python:
    /// `CacheError`).
    #[error(
        "the cache is broken: an internal error ({0}) interrupted a change, so it can no \
         longer be used; build a new cache (and please report the error)"
    )]
    Broken(String),
    /// A call that allocates from the cache's own pools or gives slots back to them, on a
    /// cache whose slots the engine owns (`pools="engine"`; Python: `CacheError`). The
    /// field names the call.
    #[error(
        "{0} is not available with pools=\"engine\": the engine's allocators own the \
         slots (insert claims them; evict and take_freed hand them back)"
    )]
    EngineOwned(&'static str),
    /// A call that needs the cache idle found it in use; the message names what is
    /// outstanding (Python: `CacheError`).
    #[error("{0}")]
    Busy(String),
    /// Memory for an argument could not be had (Python: `MemoryError`).
    #[error("{arg}: {reason}")]
    OutOfMemory {
        /// The name of the argument, as in the Python signature.
        arg: &'static str,
        /// What could not be allocated.
        reason: String,
    },
}

impl Error {
    /// Shorthand for [`Error::InvalidArgument`].
    pub(crate) fn arg(arg: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidArgument {
            arg,
            reason: reason.into(),
        }
    }
}

/// Result alias of the core.
pub type Result<T> = std::result::Result<T, Error>;
