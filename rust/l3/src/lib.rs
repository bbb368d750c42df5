//! radixcache-l3: the L3 tier's object stores, shared by every machine of a fleet.
//!
//! A page the host tier holds can be put into a store under a key derived from its page
//! hash, and fetched back by any cache that computes the same hash. This crate is the
//! client layer; it knows nothing of the cache:
//!
//! - [`frame`]: every object is a header (magic, version, kind, length, page hash,
//!   identity digest, checksum) and the page's bytes; a fetched object is verified
//!   against the [`Label`] (kind and identity) and page hash its reader expects before it
//!   is used.
//! - [`ObjectStore`]: batch `exists`/`put`/`get`/`delete` on byte-string keys, puts
//!   write-once, and `check`; backends [`RedisStore`], [`RedisClusterStore`] (both over
//!   the crate's own RESP client, [`resp`]) and [`FileStore`], chosen by URL with
//!   [`open()`]; one deadline a call and the largest object in [`Options`]; a failure's
//!   [`Cause`] in a few stable words.
//! - [`pages`]: framing and verification around a store: [`put_pages`] and
//!   [`get_pages_into`] (which deletes corrupt and foreign objects).
//! - [`Faulty`]: a store wrapper that fails, times out, loses and corrupts on a seeded
//!   schedule, for tests.
//! - [`Breaker`]: the circuit breaker that turns the tier off after repeated errors.

pub mod breaker;
pub mod cluster;
mod deadline;
pub mod faulty;
pub mod file;
pub mod frame;
pub mod open;
pub mod pages;
pub mod redis_store;
pub mod resp;
pub mod store;

pub use breaker::{Breaker, BreakerState};
pub use cluster::RedisClusterStore;
pub use faulty::{FaultRates, Faulty, RateError};
pub use file::FileStore;
pub use frame::{Corrupt, Kind, Label};
pub use open::open;
pub use pages::{get_pages_into, put_pages, Fetched};
pub use redis_store::RedisStore;
pub use store::{Cause, Object, ObjectStore, OpenError, Options, Parts, StoreError};
