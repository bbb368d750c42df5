//! The shared handle over the core and the owned handles it gives, one per file:
//!
//! * [`hybrid`]: [`HybridCache`], the cache behind a mutex, shared by cloning; a panic
//!   in the core breaks it for good.
//! * [`lock`]: [`Lock`], a path protected from eviction until it is dropped.
//! * [`request`]: [`Request`], a request aborted if it is dropped while live.
//! * [`batch`]: [`Batch`], a transfer batch abandoned if it is dropped before it ended,
//!   and its [`Outcome`].
//! * [`load_back`]: [`LoadBack`], a load-back called off if it is dropped uncommitted.
//!
//! Each owned handle holds a [`HybridCache`] and, when dropped, gives back what it holds
//! at once (nothing to a broken cache); each file holds the methods of [`HybridCache`]
//! that hand its handle out.

mod batch;
mod hybrid;
mod load_back;
mod lock;
mod request;
#[cfg(test)]
mod tests;

pub use batch::{Batch, Outcome};
pub use hybrid::HybridCache;
pub use load_back::LoadBack;
pub use lock::Lock;
pub use request::Request;
