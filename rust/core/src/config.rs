//! Cache configuration and its validation.

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

/// The order in which one component's eviction candidates go (docs/design.md,
/// "Eviction policies").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EvictionPolicy {
    /// Least recently used first (states: unused before used, see docs/design.md).
    #[default]
    Lru,
    /// Least often matched first, ties least recently used.
    Lfu,
    /// Lowest request priority first, ties least recently used.
    Priority,
    /// States only: unused before used, each least compute saved per byte first, aged
    /// (GreedyDual-Size).
    StateValue,
}

impl EvictionPolicy {
    /// Every policy, in the order the names are listed.
    pub const ALL: [EvictionPolicy; 4] = [
        EvictionPolicy::Lru,
        EvictionPolicy::Lfu,
        EvictionPolicy::Priority,
        EvictionPolicy::StateValue,
    ];

    /// The name used in the Python API.
    pub fn as_str(self) -> &'static str {
        match self {
            EvictionPolicy::Lru => "lru",
            EvictionPolicy::Lfu => "lfu",
            EvictionPolicy::Priority => "priority",
            EvictionPolicy::StateValue => "state-value",
        }
    }
}

impl fmt::Display for EvictionPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for EvictionPolicy {
    type Err = Error;

    fn from_str(s: &str) -> Result<EvictionPolicy> {
        match s {
            "lru" => Ok(EvictionPolicy::Lru),
            "lfu" => Ok(EvictionPolicy::Lfu),
            "priority" => Ok(EvictionPolicy::Priority),
            "state-value" | "state_value" => Ok(EvictionPolicy::StateValue),
            other => Err(Error::arg(
                "eviction_policy",
                format!(
                    "unknown policy {other:?}; expected \"lru\", \"lfu\", \"priority\" or \
                     \"state-value\""
                ),
            )),
        }
    }
}

/// The eviction policy of each component (`eviction_policy=`). The host tier's sets
/// follow the KV policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EvictionPolicies {
    /// Device KV leaves and host-tier leaves.
    pub kv: EvictionPolicy,
    /// Device Mamba states.
    pub mamba: EvictionPolicy,
    /// Device SWA pages (the SWA eviction queue, `Cache::evict_swa`).
    pub swa: EvictionPolicy,
}

impl EvictionPolicies {
    /// The components, by the names of the per-component form.
    pub const COMPONENTS: [&'static str; 3] = ["kv", "mamba", "swa"];

    /// `policy` for every component it applies to: "state-value" is for Mamba states
    /// only, so KV and SWA keep LRU under it.
    pub fn uniform(policy: EvictionPolicy) -> EvictionPolicies {
        let others = if policy == EvictionPolicy::StateValue {
            EvictionPolicy::Lru
        } else {
            policy
        };
        EvictionPolicies {
            kv: others,
            mamba: policy,
            swa: others,
        }
    }

    /// The per-component form: `(component, policy name)` pairs; components not named
    /// keep LRU. An unknown component or policy, or a policy that does not apply to
    /// the component, is refused naming `eviction_policy`.
    pub fn from_components<'a>(
        pairs: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<EvictionPolicies> {
        let mut out = EvictionPolicies::default();
        for (component, name) in pairs {
            let policy = name.parse()?;
            match component {
                "kv" => out.kv = policy,
                "mamba" => out.mamba = policy,
                "swa" => out.swa = policy,
                other => {
                    return Err(Error::arg(
                        "eviction_policy",
                        format!(
                            "unknown component {other:?}; expected \"kv\", \"mamba\" or \"swa\""
                        ),
                    ))
                }
            }
        }
        out.validate()?;
        Ok(out)
    }

    /// Checks that each component's policy applies to it: "state-value" values Mamba
    /// states only. For SWA it is refused rather than approximated: a cut at a node
    /// needs the SWA KV of the last W tokens, which may lie in the nodes above, so what
    /// one node's SWA pages save depends on its ancestors' and descendants' pages and
    /// changes, up or down, whenever any of them is evicted or revived (docs/design.md,
    /// "Eviction policies").
    pub fn validate(self) -> Result<()> {
        for (component, policy) in [("kv", self.kv), ("swa", self.swa)] {
            if policy == EvictionPolicy::StateValue {
                return Err(Error::arg(
                    "eviction_policy",
                    format!(
                        "\"state-value\" applies to Mamba states only; for {component:?} \
                         choose \"lru\", \"lfu\" or \"priority\""
                    ),
                ));
            }
        }
        Ok(())
    }
}

impl FromStr for EvictionPolicies {
    type Err = Error;

    /// One policy name for every component it applies to ([`EvictionPolicies::uniform`]).
    fn from_str(s: &str) -> Result<EvictionPolicies> {
        s.parse().map(EvictionPolicies::uniform)
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_names_policies() {
        for p in [
            WritePolicy::WriteThrough,
            WritePolicy::WriteThroughSelective,
            WritePolicy::WriteBack,
        ] {
            assert_eq!(p.as_str().parse::<WritePolicy>(), Ok(p));
        }
        let err = "lru".parse::<WritePolicy>().unwrap_err();
        assert!(matches!(
            err,
            Error::InvalidArgument {
                arg: "write_policy",
                ..
            }
        ));
    }

    #[test]
    fn a_hash_seed_without_page_hashes_is_refused_naming_hash_seed() {
        let c = Config {
            hash_seed: Some([1; 32]),
            ..Config::kv(16, 1)
        };
        assert!(matches!(
            c.validate(),
            Err(Error::InvalidArgument {
                arg: "hash_seed",
                ..
            })
        ));
        let c = Config {
            page_hashes: true,
            ..c
        };
        assert_eq!(c.validate(), Ok(()));
    }

    #[test]
    fn events_without_page_hashes_are_refused_naming_events() {
        let c = Config {
            events: true,
            ..Config::kv(16, 1)
        };
        assert!(matches!(
            c.validate(),
            Err(Error::InvalidArgument { arg: "events", .. })
        ));
        let c = Config {
            page_hashes: true,
            ..c
        };
        assert_eq!(c.validate(), Ok(()));
    }

    #[test]
    fn validation_names_the_argument() {
        let arg_of = |c: Config| match c.validate() {
            Err(Error::InvalidArgument { arg, .. }) => arg,
            other => panic!("expected an argument error, got {other:?}"),
        };
        assert_eq!(arg_of(Config::kv(10, 4)), "kv_slots");
        assert_eq!(arg_of(Config::kv(8, 0)), "page_size");
        assert_eq!(arg_of(Config::kv(0, 1)), "kv_slots");
        assert_eq!(
            arg_of(Config {
                write_through_threshold: Some(0),
                write_policy: WritePolicy::WriteThroughSelective,
                host_kv_slots: 8,
                ..Config::kv(8, 1)
            }),
            "write_through_threshold"
        );
        // A threshold the policy would ignore, and a policy with nothing to back up to.
        assert_eq!(
            arg_of(Config {
                write_through_threshold: Some(3),
                host_kv_slots: 8,
                ..Config::kv(8, 1)
            }),
            "write_through_threshold"
        );
        for p in [WritePolicy::WriteBack, WritePolicy::WriteThroughSelective] {
            assert_eq!(
                arg_of(Config {
                    write_policy: p,
                    ..Config::kv(8, 1)
                }),
                "write_policy"
            );
        }
        assert_eq!(
            arg_of(Config {
                host_kv_slots: 6,
                ..Config::kv(8, 4)
            }),
            "host_kv_slots"
        );
        assert_eq!(
            arg_of(Config {
                host_kv_slots: 8,
                host_mamba_slots: 2,
                ..Config::kv(8, 1)
            }),
            "host_mamba_slots"
        );
        assert_eq!(
            arg_of(Config {
                mamba_slots: 2,
                host_mamba_slots: 2,
                ..Config::kv(8, 1)
            }),
            "host_mamba_slots"
        );
        assert!(Config {
            mamba_slots: 2,
            host_kv_slots: 16,
            host_mamba_slots: 2,
            ..Config::kv(8, 1)
        }
        .validate()
        .is_ok());
        assert!(Config {
            mamba_slots: 4,
            ..Config::kv(8, 1)
        }
        .validate()
        .is_ok());
        assert!(Config::kv(64, 4).validate().is_ok());
    }

    #[test]
    fn engine_owned_pools_refuse_a_host_tier_naming_the_argument() {
        let engine = |c: Config| Config {
            pools: PoolOwner::Engine,
            ..c
        };
        for (config, arg) in [
            (
                engine(Config {
                    host_kv_slots: 8,
                    ..Config::kv(8, 1)
                }),
                "host_kv_slots",
            ),
            (
                engine(Config {
                    mamba_slots: 2,
                    host_kv_slots: 8,
                    host_mamba_slots: 2,
                    ..Config::kv(8, 1)
                }),
                "host_kv_slots",
            ),
        ] {
            let err = config.validate().unwrap_err();
            assert!(
                matches!(&err, Error::InvalidArgument { arg: a, reason } if *a == arg
                    && reason.contains("pools=\"engine\"")),
                "{err}"
            );
        }
        // Without a host KV tier a host state tier is refused as before, naming it.
        let err = engine(Config {
            mamba_slots: 2,
            host_mamba_slots: 2,
            ..Config::kv(8, 1)
        })
        .validate()
        .unwrap_err();
        assert!(
            matches!(&err, Error::InvalidArgument { arg: "host_mamba_slots", reason }
                if reason.contains("pools=\"engine\"")),
            "{err}"
        );
        assert!(engine(Config {
            mamba_slots: 4,
            ..Config::kv(8, 2)
        })
        .validate()
        .is_ok());
    }

    #[test]
    fn parses_and_names_eviction_policies() {
        for p in EvictionPolicy::ALL {
            assert_eq!(p.as_str().parse::<EvictionPolicy>(), Ok(p));
            assert_eq!(p.to_string(), p.as_str());
        }
        assert_eq!(
            "state_value".parse::<EvictionPolicy>(),
            Ok(EvictionPolicy::StateValue)
        );
        let err = "mru".parse::<EvictionPolicy>().unwrap_err();
        assert!(
            matches!(&err, Error::InvalidArgument { arg: "eviction_policy", reason }
                if reason.contains("\"lfu\"") && reason.contains("\"state-value\"")),
            "{err}"
        );
    }

    #[test]
    fn state_value_is_for_states_only() {
        let both = "state-value".parse::<EvictionPolicies>().unwrap();
        assert_eq!(both.kv, EvictionPolicy::Lru);
        assert_eq!(both.mamba, EvictionPolicy::StateValue);
        assert_eq!(both.swa, EvictionPolicy::Lru, "a plain name skips SWA too");
        assert_eq!(
            "lfu".parse::<EvictionPolicies>(),
            Ok(EvictionPolicies {
                kv: EvictionPolicy::Lfu,
                mamba: EvictionPolicy::Lfu,
                swa: EvictionPolicy::Lfu,
            })
        );
        let only_mamba = EvictionPolicies::from_components([("mamba", "priority")]).unwrap();
        assert_eq!(
            only_mamba.kv,
            EvictionPolicy::Lru,
            "a missing component keeps lru"
        );
        assert_eq!(only_mamba.mamba, EvictionPolicy::Priority);
        assert_eq!(only_mamba.swa, EvictionPolicy::Lru);
        let only_swa = EvictionPolicies::from_components([("swa", "lfu")]).unwrap();
        assert_eq!(
            (only_swa.kv, only_swa.mamba, only_swa.swa),
            (
                EvictionPolicy::Lru,
                EvictionPolicy::Lru,
                EvictionPolicy::Lfu
            )
        );
        for (bad, says) in [
            (vec![("kv", "state-value")], "for \"kv\""),
            (vec![("swa", "state-value")], "for \"swa\""),
            (vec![("full", "lru")], "\"swa\""),
            (vec![("kv", "fifo")], "\"priority\""),
        ] {
            let err = EvictionPolicies::from_components(bad).unwrap_err();
            assert!(
                matches!(
                    &err,
                    Error::InvalidArgument {
                        arg: "eviction_policy",
                        reason,
                    } if reason.contains(says)
                ),
                "{err}"
            );
        }
        for eviction_policy in [
            EvictionPolicies {
                kv: EvictionPolicy::StateValue,
                ..EvictionPolicies::default()
            },
            EvictionPolicies {
                swa: EvictionPolicy::StateValue,
                ..EvictionPolicies::default()
            },
        ] {
            let err = Config {
                eviction_policy,
                ..Config::kv(8, 1)
            }
            .validate()
            .unwrap_err();
            assert!(matches!(
                err,
                Error::InvalidArgument {
                    arg: "eviction_policy",
                    ..
                }
            ));
        }
    }

    #[test]
    fn parses_and_names_pool_owners() {
        for o in [PoolOwner::Cache, PoolOwner::Engine] {
            assert_eq!(o.as_str().parse::<PoolOwner>(), Ok(o));
            assert_eq!(o.to_string(), o.as_str());
        }
        let err = "sglang".parse::<PoolOwner>().unwrap_err();
        assert!(
            matches!(&err, Error::InvalidArgument { arg: "pools", reason } if reason.contains("\"engine\"")),
            "{err}"
        );
    }
}
