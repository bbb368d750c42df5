//! Cache configuration and its validation: [`Config`], the sizes and policies of a
//! cache, and [`Config::validate`], which names the first bad argument. The policy
//! types its fields take live beside it: [`write`] ([`WritePolicy`], [`L3Write`]),
//! [`owner`] ([`PoolOwner`]) and [`eviction`] ([`EvictionPolicy`], [`EvictionPolicies`]).

mod eviction;
mod owner;
#[cfg(test)]
mod tests;
mod write;

use crate::error::{Error, Result};

pub use eviction::{EvictionPolicies, EvictionPolicy};
pub use owner::PoolOwner;
pub use write::{L3Write, WritePolicy};

/// Sizes and policies of a cache. Field names match the Python constructor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Device KV token slots (a multiple of `page_size`).
    pub kv_slots: usize,
    /// Tokens per page; keys are matched and inserted in whole pages.
    pub page_size: usize,
    /// Device Mamba state slots; 0 for an attention-only model.
    pub mamba_slots: usize,
    /// Host-tier KV token slots; 0 for no host tier.
    pub host_kv_slots: usize,
    /// Host-tier Mamba state slots.
    pub host_mamba_slots: usize,
    /// When to back up to the host tier (with no host tier, only the default
    /// [`WritePolicy::WriteThrough`] is accepted: there is nothing to back up to).
    pub write_policy: WritePolicy,
    /// Inserts before a selective backup; only with
    /// [`WritePolicy::WriteThroughSelective`] (`None`: the default, 2).
    pub write_through_threshold: Option<u32>,
    /// Who owns the device slots ([`PoolOwner::Engine`]: the engine's allocators).
    pub pools: PoolOwner,
    /// The eviction order of each component.
    pub eviction_policy: EvictionPolicies,
    /// Device slots of the sliding-window attention (SWA) KV pool, in pages of
    /// `page_size` like the KV pool; 0 for a model without SWA layers.
    pub swa_slots: usize,
    /// The SWA layers' window: each token attends to the last `swa_window` tokens (0
    /// exactly when `swa_slots` is 0).
    pub swa_window: usize,
    /// Host-tier SWA slots, in pages of `page_size`, paired with the host KV pages as
    /// the device SWA pages are with the device KV pages: required (at least one page,
    /// at most `host_kv_slots`) with SWA layers and a host tier, 0 otherwise.
    pub host_swa_slots: usize,
    /// Whether every cached page carries its chained SHA-256 (docs/design.md, "Page
    /// hashes"): computed once when the page is published, never on the lookup path.
    /// Off by default, at no cost.
    pub page_hashes: bool,
    /// The default namespace's seed (the prior of its first page), from which named
    /// namespaces' seeds are derived too; `None`: `SGLang` `HiCache`'s seeds (no prior in
    /// the default namespace). Only with `page_hashes`.
    pub hash_seed: Option<[u8; 32]>,
    /// Whether the cache queues KV events for routers (docs/design.md, "KV events
    /// (core)"), drained by `Cache::take_events`. Needs `page_hashes` (events name
    /// pages by their hashes): refused without it rather than turning it on behind the
    /// caller's back.
    pub events: bool,
    /// Whether host pages go to the L3 tier (a store shared by many caches), once
    /// backed up or on host eviction (`l3_write`), and can be fetched from it (`cache::l3`): needs a host tier (with host state
    /// slots for a hybrid model), page hashes, and no SWA layers.
    pub l3: bool,
    /// When host pages go to the L3 tier: once backed up (the default) or only when
    /// host eviction deletes them. Only with `l3` ([`L3Write::Backup`] otherwise).
    pub l3_write: L3Write,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            kv_slots: 8192,
            page_size: 1,
            mamba_slots: 0,
            host_kv_slots: 0,
            host_mamba_slots: 0,
            write_policy: WritePolicy::WriteThrough,
            write_through_threshold: None,
            pools: PoolOwner::Cache,
            eviction_policy: EvictionPolicies::default(),
            swa_slots: 0,
            swa_window: 0,
            host_swa_slots: 0,
            page_hashes: false,
            hash_seed: None,
            events: false,
            l3: false,
            l3_write: L3Write::Backup,
        }
    }
}

impl Config {
    /// The selective policy's threshold when none is given.
    pub const DEFAULT_WRITE_THROUGH_THRESHOLD: u32 = 2;

    /// Inserts before a backup: 1 under write-through, the threshold (given or default)
    /// under write-through-selective; `None` when inserts never back up (no host tier,
    /// or write-back).
    pub fn backup_threshold(&self) -> Option<u32> {
        match self.write_policy {
            _ if self.host_kv_slots == 0 => None,
            WritePolicy::WriteBack => None,
            WritePolicy::WriteThrough => Some(1),
            WritePolicy::WriteThroughSelective => Some(
                self.write_through_threshold
                    .unwrap_or(Config::DEFAULT_WRITE_THROUGH_THRESHOLD),
            ),
        }
    }

    /// An attention-only configuration with `kv_slots` slots and pages of `page_size`.
    pub fn kv(kv_slots: usize, page_size: usize) -> Config {
        Config {
            kv_slots,
            page_size,
            ..Config::default()
        }
    }

    /// Checks every field; the error names the first bad one.
    pub fn validate(&self) -> Result<()> {
        self.eviction_policy.validate()?;
        if self.page_size == 0 {
            return Err(Error::arg("page_size", "must be at least 1"));
        }
        for (name, slots) in [
            ("kv_slots", self.kv_slots),
            ("host_kv_slots", self.host_kv_slots),
        ] {
            if slots % self.page_size != 0 {
                return Err(Error::arg(
                    name,
                    format!("{slots} is not a multiple of page_size {}", self.page_size),
                ));
            }
        }
        if self.kv_slots == 0 {
            return Err(Error::arg("kv_slots", "must be at least one page"));
        }
        if self.pools == PoolOwner::Engine {
            for (name, slots) in [
                ("host_kv_slots", self.host_kv_slots),
                ("host_mamba_slots", self.host_mamba_slots),
            ] {
                if slots > 0 {
                    return Err(Error::arg(
                        name,
                        format!(
                            "{slots} requested with pools=\"engine\", which has no host tier; \
                             pass 0"
                        ),
                    ));
                }
            }
        }
        if let Some(t) = self.write_through_threshold {
            if t == 0 {
                return Err(Error::arg("write_through_threshold", "must be at least 1"));
            }
            if self.write_policy != WritePolicy::WriteThroughSelective {
                return Err(Error::arg(
                    "write_through_threshold",
                    format!(
                        "{t} given with write_policy=\"{}\"; the threshold only applies to \
                         \"write_through_selective\"",
                        self.write_policy
                    ),
                ));
            }
        }
        if self.host_kv_slots == 0 && self.write_policy != WritePolicy::WriteThrough {
            return Err(Error::arg(
                "write_policy",
                format!(
                    "\"{}\" needs a host tier (host_kv_slots > 0): without one nothing is \
                     backed up",
                    self.write_policy
                ),
            ));
        }
        if self.host_mamba_slots > 0 && self.mamba_slots == 0 {
            return Err(Error::arg(
                "host_mamba_slots",
                format!(
                    "{} requested for a model without Mamba layers (mamba_slots=0); pass 0",
                    self.host_mamba_slots
                ),
            ));
        }
        self.validate_swa()?;
        if self.events && !self.page_hashes {
            return Err(Error::arg(
                "events",
                "needs page_hashes=True: events name pages by their hashes",
            ));
        }
        if self.hash_seed.is_some() && !self.page_hashes {
            return Err(Error::arg(
                "hash_seed",
                "given with page_hashes=False: nothing is hashed; pass page_hashes=True or no \
                 seed",
            ));
        }
        if self.host_mamba_slots > 0 && self.host_kv_slots == 0 {
            return Err(Error::arg(
                "host_mamba_slots",
                format!(
                    "{} requested without a host KV tier (host_kv_slots=0): a host state \
                     needs its tokens' KV on the host too",
                    self.host_mamba_slots
                ),
            ));
        }
        self.validate_l3()
    }

    /// The L3 tier: written from the host tier, by page hash, without SWA layers.
    fn validate_l3(&self) -> Result<()> {
        if !self.l3 {
            if self.l3_write != L3Write::Backup {
                return Err(Error::arg(
                    "l3_write",
                    format!(
                        "\"{}\" given without an L3 tier; pass l3=True or leave it out",
                        self.l3_write
                    ),
                ));
            }
            return Ok(());
        }
        let missing = if self.host_kv_slots == 0 {
            Some("a host tier (host_kv_slots > 0): pages go to L3 from the host")
        } else if self.mamba_slots > 0 && self.host_mamba_slots == 0 {
            Some("host state slots (host_mamba_slots > 0): a hybrid prefix goes with its state")
        } else if self.swa_slots > 0 {
            Some("a model without SWA layers (the SWA component has no L3 copies yet)")
        } else if !self.page_hashes {
            Some("page hashes (page_hashes=True): objects are named by them")
        } else {
            None
        };
        match missing {
            Some(what) => Err(Error::arg("l3", format!("needs {what}"))),
            None => Ok(()),
        }
    }
}

impl Config {
    /// The SWA arguments: both given or neither, whole pages, not with engine-owned
    /// pools, and a host SWA pool exactly when there is a host tier.
    fn validate_swa(&self) -> Result<()> {
        self.validate_host_swa()?;
        if self.swa_slots == 0 {
            if self.swa_window > 0 {
                return Err(Error::arg(
                    "swa_window",
                    format!(
                        "{} given without an SWA pool (swa_slots=0); pass both or neither",
                        self.swa_window
                    ),
                ));
            }
            return Ok(());
        }
        if self.swa_window == 0 {
            return Err(Error::arg(
                "swa_window",
                format!(
                    "must be at least 1 with swa_slots={} (the tokens each SWA layer attends to)",
                    self.swa_slots
                ),
            ));
        }
        if !self.swa_slots.is_multiple_of(self.page_size) {
            return Err(Error::arg(
                "swa_slots",
                format!(
                    "{} is not a multiple of page_size {}",
                    self.swa_slots, self.page_size
                ),
            ));
        }
        if self.pools == PoolOwner::Engine {
            return Err(Error::arg(
                "swa_slots",
                format!(
                    "{} requested with pools=\"engine\": the SWA pool is the cache's only; \
                     pass pools=\"cache\"",
                    self.swa_slots
                ),
            ));
        }
        Ok(())
    }

    /// `host_swa_slots`: whole pages, at least one and at most `host_kv_slots` with SWA
    /// layers and a host tier, 0 otherwise.
    fn validate_host_swa(&self) -> Result<()> {
        let n = self.host_swa_slots;
        let name = "host_swa_slots";
        if self.swa_slots == 0 || self.host_kv_slots == 0 {
            if n > 0 {
                let why = if self.swa_slots == 0 {
                    "for a model without SWA layers (swa_slots=0)"
                } else {
                    "without a host KV tier (host_kv_slots=0)"
                };
                return Err(Error::arg(name, format!("{n} requested {why}; pass 0")));
            }
            return Ok(());
        }
        if n == 0 {
            return Err(Error::arg(
                name,
                format!(
                    "must be at least one page with swa_slots={} and host_kv_slots={} (the \
                     host tier backs up SWA pages too)",
                    self.swa_slots, self.host_kv_slots
                ),
            ));
        }
        if !n.is_multiple_of(self.page_size) {
            return Err(Error::arg(
                name,
                format!("{n} is not a multiple of page_size {}", self.page_size),
            ));
        }
        if n > self.host_kv_slots {
            return Err(Error::arg(
                name,
                format!(
                    "{n} exceeds host_kv_slots={} (a host SWA page pairs with a host KV page)",
                    self.host_kv_slots
                ),
            ));
        }
        Ok(())
    }

    /// Whether the model has SWA layers.
    pub fn has_swa(&self) -> bool {
        self.swa_slots > 0
    }
}
