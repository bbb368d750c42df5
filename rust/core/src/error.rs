//! Errors of the core. One enum: every public operation returns [`Error`].
//!
//! Messages are lower-case and carry the numbers involved. The Python binding maps
//! every variant by an exhaustive `match` (no catch-all arm), so adding a variant
//! here is a compile error there until it is mapped.

use crate::tree::NodeId;

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
