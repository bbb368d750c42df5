//! Unit tests of the cache, by part: each file tests one responsibility of [`super::Cache`]
//! through its own methods (the property machines over the public API are in
//! `rust/core/tests/`).

mod basic;
mod components;
mod engine;
mod events;
mod expect;
mod host;
mod hybrid;
mod l3;
mod policy;
mod reset;
mod swa;
mod swa_host;
pub(crate) mod util;
