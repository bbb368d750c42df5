//! The object-store interface every backend implements, its error, and its options.

use std::fmt;
use std::time::Duration;

use thiserror::Error;

/// Why a store call failed, in a few stable words: what a report or a command line prints
/// (`StoreError::cause`). The error's message says it too, with the details.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Cause {
    /// Nothing listens at the store's address.
    ConnectionRefused,
    /// The address could not be reached (no such host, no route to it).
    Unreachable,
    /// The store refused the credentials, or wants some that were not given (`WRONGPASS`,
    /// `NOAUTH`, a password sent to a server that has none).
    AuthFailed,
    /// The database the URL names cannot be selected (`SELECT` failed: out of range).
    BadDatabase,
    /// The store did not answer within the call's deadline.
    Timeout,
    /// The store's reply broke the protocol (a malformed or oversized reply, an answer
    /// that does not fit the command); the connection is dropped.
    Protocol,
    /// The store answered with an error of its own.
    Server,
    /// A Redis Cluster could not route a key (slots not served, the cluster down,
    /// redirects that do not settle).
    Cluster,
    /// The store closed the connection.
    Closed,
    /// Another input/output error (the file store's file system, a socket error).
    Io,
    /// A fault injected on purpose ([`crate::Faulty`]).
    Injected,
    /// The call's arguments were refused before the store was called.
    BadArgument,
}

impl Cause {
    /// The cause in words: `"connection refused"`, `"unreachable"`, `"authentication
    /// failed"`, `"bad database"`, `"timeout"`, `"protocol error"`, `"server error"`,
    /// `"cluster error"`, `"connection closed"`, `"i/o error"`, `"injected failure"` or
    /// `"bad argument"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Cause::ConnectionRefused => "connection refused",
            Cause::Unreachable => "unreachable",
            Cause::AuthFailed => "authentication failed",
            Cause::BadDatabase => "bad database",
            Cause::Timeout => "timeout",
            Cause::Protocol => "protocol error",
            Cause::Server => "server error",
            Cause::Cluster => "cluster error",
            Cause::Closed => "connection closed",
            Cause::Io => "i/o error",
            Cause::Injected => "injected failure",
            Cause::BadArgument => "bad argument",
        }
    }
}

impl fmt::Display for Cause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a store call failed. A failed call may have taken partial effect (some keys of a
/// `put` stored): every operation is idempotent, so the caller may simply retry.
///
/// [`StoreError::cause`] classifies it; the message names the operation, the cause, and
/// the details (the server's address, what it said).
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum StoreError {
    /// The store did not answer within the call's deadline ([`Options`]).
    #[error("{op} timed out: {detail}")]
    Timeout {
        /// The operation (`exists`, `put`, `get`, `delete`, `check`).
        op: &'static str,
        /// What the client said.
        detail: String,
    },
    /// The store could not be reached, refused the call, or answered with an error.
    #[error("{op} failed: {cause}{}{detail}", colon(.detail))]
    Failed {
        /// The operation (`exists`, `put`, `get`, `delete`, `check`, `open`).
        op: &'static str,
        /// Why, in words ([`Cause`]; never [`Cause::Timeout`]).
        cause: Cause,
        /// What the client or the store said (may be empty).
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

    /// Why the call failed, in a few stable words ([`Cause::as_str`]).
    pub fn cause(&self) -> Cause {
        match self {
            StoreError::Timeout { .. } => Cause::Timeout,
            StoreError::Failed { cause, .. } => *cause,
            StoreError::Mismatch { .. } | StoreError::KeyTooLong { .. } => Cause::BadArgument,
        }
    }

    /// A failure of `op` for `cause`.
    pub(crate) fn failed(op: &'static str, cause: Cause, detail: impl Into<String>) -> Self {
        StoreError::Failed {
            op,
            cause,
            detail: detail.into(),
        }
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

/// `": "` before a detail, nothing before none.
fn colon(detail: &str) -> &'static str {
    if detail.is_empty() {
        ""
    } else {
        ": "
    }
}

/// How long a store call may take and how large an object may be: a dead, slow or
/// hostile store fails a call instead of holding a serving thread or the process.
///
/// **One deadline a call.** A Redis call (every key of the batch, every node of a
/// cluster, redirects included) must end by `timeout` after it started, plus
/// `connect_timeout` when it had to connect, plus one second per `min_rate` bytes it
/// moved (sent and received): a store that trickles its reply fails at about `timeout`,
/// while a batch of hundreds of megabytes moving faster than `min_rate` is never cut.
/// Why a store could not be opened (`crate::open()`, and each backend's `new`).
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum OpenError {
    /// The URL is malformed; `reason` names the bad part.
    #[error("bad store url {url:?}: {reason}")]
    Url {
        /// The URL given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The store could not be set up (the file backend's directory).
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Connecting (with `AUTH` and `SELECT`) is bounded by `connect_timeout` as well.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    /// Connecting (and reconnecting): the TCP connection, `AUTH` and `SELECT`.
    pub connect_timeout: Duration,
    /// A call's deadline before its allowance for the bytes it moves.
    pub timeout: Duration,
    /// The slowest transfer a call is allowed, in bytes a second: every byte moved
    /// extends its deadline by `1 / min_rate` seconds (0: no extension).
    pub min_rate: u64,
    /// The largest object a store may hand back: a reply announcing a longer value is a
    /// protocol error before anything is allocated for it, and a file larger than this
    /// is an unreadable object, never read.
    pub max_object_size: usize,
}

impl Options {
    /// The default for both timeouts.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(200);
    /// The default `min_rate`: 100 MB/s, so a call's deadline grows 10 ms per MB moved.
    pub const DEFAULT_MIN_RATE: u64 = 100_000_000;
    /// The default `max_object_size`: 512 MiB, Redis's own limit on a string
    /// (`proto-max-bulk-len`).
    pub const DEFAULT_MAX_OBJECT_SIZE: usize = 512 << 20;

    /// Both timeouts set to `timeout`, the rest the defaults.
    pub fn with_timeout(timeout: Duration) -> Self {
        Options {
            connect_timeout: timeout,
            timeout,
            min_rate: Options::DEFAULT_MIN_RATE,
            max_object_size: Options::DEFAULT_MAX_OBJECT_SIZE,
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

/// What [`ObjectStore::get_each`] found under one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Object<'a> {
    /// No object.
    Missing,
    /// The object's bytes.
    Bytes(&'a [u8]),
    /// Something the store cannot hand back as an object's bytes, with the reason: a
    /// Redis key holding another type (a list, a hash), a file path that is a directory
    /// or cannot be read, a file larger than [`Options::max_object_size`]. A corrupt
    /// object: the caller deletes it ([`ObjectStore::delete`] removes it whatever it is).
    Unreadable(&'a str),
}

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

    /// The object under each key, `None` where there is none. A key the store cannot
    /// read an object from ([`Object::Unreadable`]) fails the call.
    fn get(&self, keys: &[&[u8]]) -> Result<Vec<Option<Vec<u8>>>, StoreError>;

    /// Removes whatever is under `keys` (absent ones are no error).
    fn delete(&self, keys: &[&[u8]]) -> Result<(), StoreError>;

    /// Checks that the store can be used now: connects (with `AUTH` and `SELECT`) and
    /// asks the server to answer; for a cluster, reads the topology and reaches every
    /// node that serves slots; for files, writes and removes a file in the directory.
    /// A caller that must not start against a store it cannot use calls this first.
    fn check(&self) -> Result<(), StoreError>;

    /// [`ObjectStore::put`] of objects given in two parts each: `values[i][0]` followed
    /// by `values[i][1]`. The default joins the parts and calls `put`; a backend that
    /// can write parts one after the other overrides it to save that copy.
    fn put_parts(&self, keys: &[&[u8]], values: &[Parts<'_>]) -> Result<Vec<bool>, StoreError> {
        let joined: Vec<Vec<u8>> = values.iter().map(|p| p.concat()).collect();
        let refs: Vec<&[u8]> = joined.iter().map(Vec::as_slice).collect();
        self.put(keys, &refs)
    }

    /// [`ObjectStore::get`] without handing out the objects: calls `visit(i, object)`
    /// once for each key (in an order the store chooses: a cluster answers node by
    /// node), the object borrowed for the call only, so that a store can read every
    /// object into one buffer it reuses (no allocation, and no page faults, per object).
    /// A key the store cannot read is [`Object::Unreadable`], and the rest of the batch
    /// is served. After an error, `visit` may have seen some of the keys.
    fn get_each(
        &self,
        keys: &[&[u8]],
        visit: &mut dyn FnMut(usize, Object<'_>),
    ) -> Result<(), StoreError> {
        for (i, object) in self.get(keys)?.iter().enumerate() {
            visit(
                i,
                match object {
                    Some(bytes) => Object::Bytes(bytes),
                    None => Object::Missing,
                },
            );
        }
        Ok(())
    }
}

/// [`ObjectStore::get`] from [`ObjectStore::get_each`]: the objects copied, an
/// unreadable one failing the call (`cause` names the store's kind of failure).
pub(crate) fn get_via_each(
    store: &dyn ObjectStore,
    keys: &[&[u8]],
    cause: Cause,
) -> Result<Vec<Option<Vec<u8>>>, StoreError> {
    let mut out = vec![None; keys.len()];
    let mut unreadable = None;
    store.get_each(keys, &mut |i, object| match object {
        Object::Missing => {}
        Object::Bytes(b) => out[i] = Some(b.to_vec()),
        Object::Unreadable(why) => {
            unreadable.get_or_insert_with(|| format!("key {i}: {why}"));
        }
    })?;
    match unreadable {
        None => Ok(out),
        Some(detail) => Err(StoreError::failed("get", cause, detail)),
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

            fn check(&self) -> Result<(), StoreError> {
                (**self).check()
            }

            fn get_each(
                &self,
                keys: &[&[u8]],
                visit: &mut dyn FnMut(usize, Object<'_>),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_message_says_the_cause() {
        let e = StoreError::failed("get", Cause::ConnectionRefused, "connecting to h:1: no");
        assert_eq!(
            e.to_string(),
            "get failed: connection refused: connecting to h:1: no"
        );
        assert_eq!(e.cause().as_str(), "connection refused");
        let e = StoreError::failed("put", Cause::Injected, "");
        assert_eq!(e.to_string(), "put failed: injected failure");
        let e = StoreError::Timeout {
            op: "exists",
            detail: "h:1: no answer".to_owned(),
        };
        assert_eq!(e.cause(), Cause::Timeout);
        assert_eq!(e.cause().to_string(), "timeout");
        let e = StoreError::Mismatch {
            what: "values",
            len: 1,
            keys: 2,
        };
        assert_eq!(e.cause().as_str(), "bad argument");
        let e = StoreError::KeyTooLong {
            index: 0,
            len: 200,
            max: 127,
        };
        assert_eq!(e.cause(), Cause::BadArgument);
    }

    #[test]
    fn every_cause_has_its_own_words() {
        let all = [
            Cause::ConnectionRefused,
            Cause::Unreachable,
            Cause::AuthFailed,
            Cause::BadDatabase,
            Cause::Timeout,
            Cause::Protocol,
            Cause::Server,
            Cause::Cluster,
            Cause::Closed,
            Cause::Io,
            Cause::Injected,
            Cause::BadArgument,
        ];
        let words: std::collections::HashSet<&str> = all.iter().map(|c| c.as_str()).collect();
        assert_eq!(words.len(), all.len());
    }

    #[test]
    fn with_timeout_sets_both_timeouts_and_the_defaults() {
        let o = Options::with_timeout(Duration::from_millis(50));
        assert_eq!(o.connect_timeout, Duration::from_millis(50));
        assert_eq!(o.timeout, Duration::from_millis(50));
        assert_eq!(o.min_rate, 100_000_000);
        assert_eq!(o.max_object_size, 512 << 20);
        assert_eq!(Options::default().timeout, Options::DEFAULT_TIMEOUT);
    }
}
