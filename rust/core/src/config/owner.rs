//! [`PoolOwner`]: who owns the device slots (`pools=`), the cache's own pools or the
//! engine's allocators.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// Who owns the device slots: the cache's own allocator, or the engine's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PoolOwner {
    /// The cache's pools hand out slots (`alloc_kv`, `alloc_mamba`, requests) and take
    /// them back.
    #[default]
    Cache,
    /// The engine's allocators own every device slot: each starts with the engine,
    /// `insert` claims the slots it is passed, and what the tree gives up is queued for
    /// [`crate::Cache::take_freed`] or returned by [`crate::Cache::evict`]. No host
    /// tier, and the calls that allocate from the cache's pools are refused.
    Engine,
}

impl PoolOwner {
    /// The name used in the Python API (`pools=`).
    pub fn as_str(self) -> &'static str {
        match self {
            PoolOwner::Cache => "cache",
            PoolOwner::Engine => "engine",
        }
    }
}

impl fmt::Display for PoolOwner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for PoolOwner {
    type Err = Error;

    fn from_str(s: &str) -> Result<PoolOwner> {
        match s {
            "cache" => Ok(PoolOwner::Cache),
            "engine" => Ok(PoolOwner::Engine),
            other => Err(Error::arg(
                "pools",
                format!("unknown owner {other:?}; expected \"cache\" or \"engine\""),
            )),
        }
    }
}
