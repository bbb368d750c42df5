//! Helpers shared by the core's unit tests.

use crate::cache::{Cache, Insert};
use crate::config::Config;
use crate::ids::NodeId;

/// Tokens `1..=n`.
pub(crate) fn seq(n: u32) -> Vec<u32> {
    (1..=n).collect()
}

/// The counter or gauge `name` of `c.stats()` (a missing one fails the test).
pub(crate) fn stat(c: &Cache, name: &str) -> u64 {
    c.stats()
        .into_iter()
        .find(|&(k, _)| k == name)
        .map_or_else(|| panic!("no stat {name}"), |(_, v)| v)
}

/// Caches `toks` through the low-level API: the reusable prefix from a match, fresh
/// pages for the rest (each with its SWA page when the model has SWA layers).
pub(crate) fn cached(c: &mut Cache, toks: &[u32]) -> Insert {
    let (owned_from, kv) = prefix_and_fresh(c, toks);
    c.insert(None, toks, &kv, owned_from).unwrap()
}

/// The slots to cache `toks` with: the reusable prefix a match finds, then fresh pages;
/// and where the fresh ones start.
pub(crate) fn prefix_and_fresh(c: &mut Cache, toks: &[u32]) -> (usize, Vec<i64>) {
    let m = c.match_prefix(None, toks);
    let rest = toks.len() - m.device_len;
    let ps = c.page_size();
    let got = c.alloc_kv(rest.div_ceil(ps) * ps).unwrap().unwrap();
    let mut kv = m.kv_indices.clone();
    kv.extend_from_slice(&got[..rest]);
    (m.device_len, kv)
}

/// Caches `toks` in `ns` with fresh slots and, in a hybrid cache, a state at the end;
/// returns its end node.
pub(crate) fn put(c: &mut Cache, ns: Option<&str>, toks: &[u32]) -> NodeId {
    let m = c.match_prefix(ns, toks);
    let rest = toks.len() - m.device_len;
    let ps = c.page_size();
    let mut kv = m.kv_indices.clone();
    kv.extend(c.alloc_kv(rest.div_ceil(ps) * ps).unwrap().unwrap()[..rest].iter());
    let state = if c.is_hybrid() {
        c.alloc_mamba().unwrap().map(i64::from)
    } else {
        None
    };
    c.insert_with_state(ns, toks, &kv, m.device_len, state)
        .unwrap()
        .node
}

/// A cache of pages of 1 token under `policy`, with `kv` KV slots and `states` state
/// slots (none: full attention only).
pub(crate) fn policy_cache(policy: &str, kv: usize, states: usize) -> Cache {
    Cache::new(Config {
        mamba_slots: states,
        eviction_policy: policy.parse().unwrap(),
        ..Config::kv(kv, 1)
    })
    .unwrap()
}

/// Caches `toks` with fresh slots (without a match: an insert is no hit), and a state at
/// the end in a hybrid cache.
pub(crate) fn fresh(c: &mut Cache, toks: &[u32]) {
    let kv = c.alloc_kv(toks.len()).unwrap().unwrap();
    let state = if c.is_hybrid() {
        Some(i64::from(c.alloc_mamba().unwrap().unwrap()))
    } else {
        None
    };
    c.insert_with_state(None, toks, &kv, 0, state).unwrap();
}
