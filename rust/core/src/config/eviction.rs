//! The eviction order of each component (`eviction_policy=`): [`EvictionPolicy`], one
//! component's order, and [`EvictionPolicies`], one per component with the rule of which
//! policy applies to which.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

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
