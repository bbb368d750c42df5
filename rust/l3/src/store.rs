//! The object-store interface every backend implements, its error, and its options.

use std::fmt;
use std::time::Duration;

use thiserror::Error;

/// Why a store call failed. A failed call may have taken partial effect (some keys of a
/// `put` stored): every operation is idempotent, so the caller may simply retry.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum StoreError {
    /// The store did not answer within the configured timeout.
    #[error("{op} timed out: {detail}")]
    Timeout {
        /// The operation (`exists`, `put`, `get`, `delete`, `connect`).
        op: &'static str,
        /// What the client said.
        detail: String,
    },
    /// The store could not be reached or answered with an error.
    #[error("{op} failed: {detail}")]
    Failed {
        /// The operation.
        op: &'static str,
        /// What the client or the store said.
        detail: String,
    },
    /// The call's arguments are inconsistent (the store was not called).
    #[error("{what}: {len} given for {keys} keys")]
    Mismatch {
        /// The argument.
        what: &'static str,
        /// Its length.
        len: usize,
        /// The number of keys.
        keys: usize,
    },
    /// A key the backend cannot store (the file backend's name limit).
    #[error("key {index} is {len} bytes, over the backend's limit of {max}")]
    KeyTooLong {
        /// The key's position in the batch.
        index: usize,
        /// Its length.
        len: usize,
        /// The backend's limit.
        max: usize,
    },
}

impl StoreError {
    /// Whether this is a timeout.
    pub fn is_timeout(&self) -> bool {
        matches!(self, StoreError::Timeout { .. })
    }

    /// Checks that an argument has one entry per key.
    pub(crate) fn check_len(what: &'static str, len: usize, keys: usize) -> Result<(), Self> {
        if len == keys {
            Ok(())
        } else {
            Err(StoreError::Mismatch { what, len, keys })
        }
    }
}

/// How long a store waits before a call fails: a dead store fails fast instead of
/// holding a serving thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    /// Connecting (and reconnecting).
    pub connect_timeout: Duration,
    /// Each read or write on a connection.
    pub io_timeout: Duration,
}

impl Options {
    /// The default for both timeouts.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(200);

    /// Both timeouts set to `timeout`.
    pub fn with_timeout(timeout: Duration) -> Self {
        Options {
            connect_timeout: timeout,
            io_timeout: timeout,
        }
    }
}

impl Default for Options {
    fn default() -> Self {
        Options::with_timeout(Options::DEFAULT_TIMEOUT)
    }
}

/// An object given in two parts, stored as their concatenation (a frame's header and
/// its payload, written without first copying them together).
pub type Parts<'a> = [&'a [u8]; 2];

/// A store of immutable objects under byte-string keys, called in batches.
///
/// Writes are write-once: `put` never replaces an existing object (so concurrent
/// writers of the same page cannot interleave, and a reader never sees a half-replaced
/// value). Every call is one round trip (pipelined) per node, whatever the batch size.
pub trait ObjectStore: Send + Sync + fmt::Debug {
    /// Whether each key holds an object.
    fn exists(&self, keys: &[&[u8]]) -> Result<Vec<bool>, StoreError>;

    /// Stores `values[i]` under `keys[i]` where the key holds nothing yet; returns, per
    /// key, whether this call stored it (false: it existed and was left alone).
    fn put(&self, keys: &[&[u8]], values: &[&[u8]]) -> Result<Vec<bool>, StoreError>;

    /// The object under each key, `None` where there is none.
    fn get(&self, keys: &[&[u8]]) -> Result<Vec<Option<Vec<u8>>>, StoreError>;

    /// Removes the objects under `keys` (absent ones are no error).
    fn delete(&self, keys: &[&[u8]]) -> Result<(), StoreError>;

    /// [`ObjectStore::put`] of objects given in two parts each: `values[i][0]` followed
    /// by `values[i][1]`. The default joins the parts and calls `put`; a backend that
    /// can write parts one after the other overrides it to save that copy.
    fn put_parts(&self, keys: &[&[u8]], values: &[Parts<'_>]) -> Result<Vec<bool>, StoreError> {
        let joined: Vec<Vec<u8>> = values.iter().map(|p| p.concat()).collect();
        let refs: Vec<&[u8]> = joined.iter().map(Vec::as_slice).collect();
        self.put(keys, &refs)
    }

    /// [`ObjectStore::get`] without handing out the objects: calls `visit(i, object)`
    /// for each key in order, the object borrowed for the call only, so that a store
    /// can read every object into one buffer it reuses (no allocation, and no page
    /// faults, per object). After an error, `visit` may have seen some of the keys.
    fn get_each(
        &self,
        keys: &[&[u8]],
        visit: &mut dyn FnMut(usize, Option<&[u8]>),
    ) -> Result<(), StoreError> {
        for (i, object) in self.get(keys)?.iter().enumerate() {
            visit(i, object.as_deref());
        }
        Ok(())
    }
}

/// Forwards the trait to a store behind a pointer.
macro_rules! forward {
    ($($ty:ty),*) => {$(
        impl<S: ObjectStore + ?Sized> ObjectStore for $ty {
            fn exists(&self, keys: &[&[u8]]) -> Result<Vec<bool>, StoreError> {
                (**self).exists(keys)
            }

            fn put(&self, keys: &[&[u8]], values: &[&[u8]]) -> Result<Vec<bool>, StoreError> {
                (**self).put(keys, values)
            }

            fn get(&self, keys: &[&[u8]]) -> Result<Vec<Option<Vec<u8>>>, StoreError> {
                (**self).get(keys)
            }

            fn delete(&self, keys: &[&[u8]]) -> Result<(), StoreError> {
                (**self).delete(keys)
            }

            fn get_each(
                &self,
                keys: &[&[u8]],
                visit: &mut dyn FnMut(usize, Option<&[u8]>),
            ) -> Result<(), StoreError> {
                (**self).get_each(keys, visit)
            }

            fn put_parts(
                &self,
                keys: &[&[u8]],
                values: &[Parts<'_>],
            ) -> Result<Vec<bool>, StoreError> {
                (**self).put_parts(keys, values)
            }
        }
    )*};
}

// A boxed store (what [`crate::open()`] returns) and a borrowed one are stores, so that
// [`crate::Faulty`] wraps either.
forward!(Box<S>, &S);
