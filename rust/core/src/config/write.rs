//! When pages are written to the tiers below the device: [`WritePolicy`] (device to
//! host, `write_policy=`) and [`L3Write`] (host to the L3 store, `l3_write=`).

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// When device data is backed up to the host tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WritePolicy {
    /// Back up on insert (threshold 1).
    #[default]
    WriteThrough,
    /// Back up a node once it was hit `write_through_threshold` times.
    WriteThroughSelective,
    /// Back up only the node being evicted, just before eviction.
    WriteBack,
}

impl WritePolicy {
    /// The name used in the Python API.
    pub fn as_str(self) -> &'static str {
        match self {
            WritePolicy::WriteThrough => "write_through",
            WritePolicy::WriteThroughSelective => "write_through_selective",
            WritePolicy::WriteBack => "write_back",
        }
    }
}

impl fmt::Display for WritePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for WritePolicy {
    type Err = Error;

    fn from_str(s: &str) -> Result<WritePolicy> {
        match s {
            "write_through" => Ok(WritePolicy::WriteThrough),
            "write_through_selective" => Ok(WritePolicy::WriteThroughSelective),
            "write_back" => Ok(WritePolicy::WriteBack),
            other => Err(Error::arg(
                "write_policy",
                format!(
                    "unknown policy {other:?}; expected \"write_through\", \
                     \"write_through_selective\" or \"write_back\""
                ),
            )),
        }
    }
}

/// When host pages are written to the L3 tier (`Config::l3_write`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum L3Write {
    /// As soon as a backup puts them on the host: every cache of a fleet finds them in
    /// the store at once (what a fleet behind a round-robin router needs).
    #[default]
    Backup,
    /// Only when host eviction deletes them (pages fetched from the store, or written
    /// already, are not written again): the store gets what this cache gives up, and
    /// nothing it still holds.
    HostEviction,
}

impl L3Write {
    /// The name used in the Python API (`l3_write=`).
    pub fn as_str(self) -> &'static str {
        match self {
            L3Write::Backup => "backup",
            L3Write::HostEviction => "host_eviction",
        }
    }
}

impl fmt::Display for L3Write {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for L3Write {
    type Err = Error;

    fn from_str(s: &str) -> Result<L3Write> {
        match s {
            "backup" => Ok(L3Write::Backup),
            "host_eviction" => Ok(L3Write::HostEviction),
            other => Err(Error::arg(
                "l3_write",
                format!("unknown setting {other:?}; expected \"backup\" or \"host_eviction\""),
            )),
        }
    }
}
