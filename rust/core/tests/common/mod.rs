//! Scaffolding shared by the state-machine tests `machine.rs` (KV only),
//! `hybrid_machine.rs` (Mamba states, requests and batches), `host_machine.rs` (the host
//! tier) and `engine_machine.rs` (engine-owned pools): token specs and their
//! strategies, the proptest setup, a small RNG, slot and key helpers, reading the tree's
//! pages back from `snapshot()`, and the checks both models make of locks, sizes,
//! allocations and evictions.
//!
//! What differs between the machines on purpose (the weights of their strategies,
//! the bad slots they try, what a failing call must leave as it was) stays in each.

// Each test crate compiles this module and uses only part of it.
#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;
use radixcache_core::{
    Cache, Error, EvictionPolicies, EvictionPolicy, KvEvent, Medium, NodeInfo, PageHash,
};

pub type Ns = Option<String>;
/// A cached page-prefix or node end: namespace and every token from the root.
pub type Key = (Ns, Vec<u32>);
/// Every cached page-prefix and the slots of its last page.
pub type Pages = BTreeMap<Key, Vec<i64>>;

/// Fixed prefixes shared between sequences: the first two share four tokens, the first
/// and the last three (a divergence inside a page of 2 or 4), the third shares nothing.
pub const SYSTEM: [&[u32]; 4] = [
    &[0, 1, 2, 3, 0, 1, 2, 3],
    &[0, 1, 2, 3, 3, 3, 2, 2],
    &[2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0],
    &[0, 1, 2, 0, 1, 2, 0, 1],
];
pub const MAX_TOKENS: usize = 40;
/// Earlier sequences a token spec may start from.
const HISTORY: usize = 16;

/// 256 cases, failures saved to `file` and replayed first.
pub fn proptest_config(file: &'static str) -> ProptestConfig {
    ProptestConfig {
        cases: 256,
        // Relative to the package root, where `cargo test` runs: the default
        // (`SourceParallel`) finds no lib.rs above tests/ and would write beside this file.
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(file))),
        ..ProptestConfig::default()
    }
}

/// Any eviction policy per component (`eviction_policy=`): KV any policy but
/// "state-value" (for states only), states any.
pub fn eviction_policies() -> impl Strategy<Value = EvictionPolicies> {
    let kv = [
        EvictionPolicy::Lru,
        EvictionPolicy::Lfu,
        EvictionPolicy::Priority,
    ];
    (
        prop::sample::select(kv.to_vec()),
        prop::sample::select(EvictionPolicy::ALL.to_vec()),
    )
        .prop_map(|(kv, mamba)| EvictionPolicies {
            kv,
            mamba,
            ..EvictionPolicies::default()
        })
}

// ---------------------------------------------------------------------------------------
// Token specs

#[derive(Debug, Clone)]
pub struct TokSpec {
    /// 0: none, 1..=4: a system prompt, 5..=6: an earlier sequence; in the hybrid
    /// machine also 7..=8: where a cached state is (else an earlier sequence).
    pub base: u8,
    pub hist: usize,
    pub cut: Option<usize>,
    pub tail: Vec<u32>,
}

impl TokSpec {
    /// The tokens, given what `base` resolved to: cut at `cut` if any, then `tail`, at
    /// most `MAX_TOKENS`.
    pub fn tokens(&self, mut base: Vec<u32>) -> Vec<u32> {
        if let Some(c) = self.cut {
            base.truncate(c % (base.len() + 1));
        }
        base.extend_from_slice(&self.tail);
        base.truncate(MAX_TOKENS);
        base
    }
}

/// A token spec: `base` from `base`, a cut with probability `cut`, `tail` from `tail`.
pub fn tok_spec_of(
    base: impl Strategy<Value = u8>,
    cut: f64,
    tail: impl Strategy<Value = Vec<u32>>,
) -> impl Strategy<Value = TokSpec> {
    (
        base,
        any::<usize>(),
        prop::option::weighted(cut, 0usize..MAX_TOKENS),
        tail,
    )
        .prop_map(|(base, hist, cut, tail)| TokSpec {
            base,
            hist,
            cut,
            tail,
        })
}

/// Random tokens after the base: mostly a few, sometimes many.
pub fn tail() -> impl Strategy<Value = Vec<u32>> {
    prop_oneof![
        3 => prop::collection::vec(0u32..4, 0..8),
        1 => prop::collection::vec(0u32..4, 0..24),
    ]
}

/// Keeps `toks` among the last `HISTORY` sequences a token spec may start from.
pub fn remember(history: &mut Vec<Vec<u32>>, toks: &[u32]) {
    if !toks.is_empty() {
        history.push(toks.to_vec());
        if history.len() > HISTORY {
            history.remove(0);
        }
    }
}

pub fn ns_of(flag: bool) -> Ns {
    flag.then(|| "a".to_owned())
}

pub fn key(ns: &Ns, toks: &[u32], len: usize) -> Key {
    (ns.clone(), toks[..len].to_vec())
}

// ---------------------------------------------------------------------------------------
// Run-time choices

/// `SplitMix64`, for choices made at run time from state the strategy cannot see.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        usize::try_from(self.next() % u64::try_from(n).unwrap()).unwrap()
    }

    pub fn coin(&mut self) -> bool {
        self.next() & 1 == 1
    }

    pub fn pick<T: Copy>(&mut self, items: &[T]) -> Option<T> {
        (!items.is_empty()).then(|| items[self.below(items.len())])
    }

    /// `k` distinct pages of `held`, in random order (`k <= held.len()`).
    pub fn distinct(&mut self, held: &BTreeSet<i64>, k: usize) -> Vec<i64> {
        let mut all: Vec<i64> = held.iter().copied().collect();
        assert!(k <= all.len());
        for i in 0..k {
            let j = i + self.below(all.len() - i);
            all.swap(i, j);
        }
        all.truncate(k);
        all
    }

    pub fn shuffle(&mut self, items: &mut [i64]) {
        for i in (1..items.len()).rev() {
            items.swap(i, self.below(i + 1));
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub enum OwnedFrom {
    /// `device_len` of the fresh match.
    Full,
    /// 0: every matched page passed again as caller slots (duplicates).
    Zero,
    /// A random page boundary up to `device_len`.
    Mid,
}

/// The caller's side of a valid insert after a match whose slots are `tree_kv`:
/// `owned_from` as `choice` says, `toks` cut to what the held pages cover, and
/// (`owned_from`, distinct held pages for `owned_from..`, the whole `kv_indices`).
pub fn valid_insert_args(
    choice: OwnedFrom,
    toks: &mut Vec<u32>,
    tree_kv: &[i64],
    held: &BTreeSet<i64>,
    ps: usize,
    rng: &mut Rng,
) -> (usize, Vec<i64>, Vec<i64>) {
    let owned_from = match choice {
        OwnedFrom::Full => tree_kv.len(),
        OwnedFrom::Zero => 0,
        OwnedFrom::Mid => rng.below(tree_kv.len() / ps + 1) * ps,
    };
    if (toks.len() - owned_from).div_ceil(ps) > held.len() {
        toks.truncate(owned_from + held.len() * ps);
    }
    let len = toks.len();
    let pages = rng.distinct(held, (len - owned_from).div_ceil(ps));
    let mut kv = tree_kv[..owned_from].to_vec();
    kv.extend(caller_slots(&pages, owned_from, len, ps));
    (owned_from, pages, kv)
}

/// Some of the `held` pages and slots naming each of them (all of a page's slots, or
/// some of them, possibly repeated), page by page: for `free_kv`.
pub fn some_held_slots(held: &BTreeSet<i64>, ps: usize, rng: &mut Rng) -> (Vec<i64>, Vec<i64>) {
    let k = rng.below(held.len() + 1);
    let pages = rng.distinct(held, k);
    let mut slots = Vec::new();
    for &p in &pages {
        let all = page_slots(p, ps);
        if rng.coin() {
            slots.extend(all);
        } else {
            for _ in 0..=rng.below(ps + 1) {
                slots.push(all[rng.below(ps)]);
            }
        }
    }
    (pages, slots)
}

// ---------------------------------------------------------------------------------------
// Slots and pages

pub fn i64_of(x: usize) -> i64 {
    i64::try_from(x).unwrap()
}

/// The slots of `page`.
pub fn page_slots(page: i64, ps: usize) -> Vec<i64> {
    let base = page * i64_of(ps);
    (base..base + i64_of(ps)).collect()
}

/// The page of a page's slots.
pub fn page_of(slots: &[i64], ps: usize) -> i64 {
    slots[0] / i64_of(ps)
}

/// Slots for positions `from..len` given one page per chunk of `ps` positions.
pub fn caller_slots(pages: &[i64], from: usize, len: usize, ps: usize) -> Vec<i64> {
    let mut out = Vec::with_capacity(len - from);
    for (c, &p) in pages.iter().enumerate() {
        let pos = from + c * ps;
        out.extend(page_slots(p, ps).into_iter().take(ps.min(len - pos)));
    }
    assert_eq!(out.len(), len - from);
    out
}

/// The longest page-aligned prefix of `toks` whose every page-prefix is in `pages`.
pub fn cached_len(pages: &Pages, ns: &Ns, toks: &[u32], ps: usize) -> usize {
    let mut k = 0;
    while k + ps <= toks.len() && pages.contains_key(&key(ns, toks, k + ps)) {
        k += ps;
    }
    k
}

/// The slots of the first `len` (page-aligned, cached) tokens of `toks`.
pub fn cached_slots(pages: &Pages, ns: &Ns, toks: &[u32], len: usize, ps: usize) -> Vec<i64> {
    let mut out = Vec::with_capacity(len);
    for j in 1..=len / ps {
        out.extend_from_slice(&pages[&key(ns, toks, j * ps)]);
    }
    out
}

/// The page-prefixes in `pages` that extend `k` (`k` itself included).
pub fn extensions<'a, V>(pages: &'a BTreeMap<Key, V>, k: &'a Key) -> impl Iterator<Item = &'a Key> {
    pages
        .range(k.clone()..)
        .map(|(e, _)| e)
        .take_while(|e| e.0 == k.0 && e.1.starts_with(&k.1))
}

/// Counts a receipt on `prefix` on each of its page-prefixes.
pub fn add_lock(counts: &mut HashMap<Key, u32>, ns: &Ns, prefix: &[u32], ps: usize) {
    for j in 1..=prefix.len() / ps {
        *counts.entry(key(ns, prefix, j * ps)).or_insert(0) += 1;
    }
}

// ---------------------------------------------------------------------------------------
// Reading back and checking

pub fn arg_of<T: std::fmt::Debug>(r: Result<T, Error>) -> &'static str {
    match r {
        Err(Error::InvalidArgument { arg, .. }) => arg,
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

/// The page-prefixes held by the tree, from the snapshot, with each node's lock count.
pub fn tree_pages(snapshot: &[NodeInfo], ps: usize) -> (Pages, HashMap<Key, u32>) {
    let mut cached = BTreeMap::new();
    let mut locks = HashMap::new();
    for n in snapshot {
        let slots = n
            .kv_indices
            .as_ref()
            .expect("no host tier: every node has device KV");
        assert_eq!(slots.len(), n.key_len, "node {} slots vs key", n.id);
        if n.prefix.is_empty() {
            continue;
        }
        let start = n.prefix.len() - n.key_len;
        for j in 0..n.key_len / ps {
            let k = key(&n.namespace, &n.prefix, start + (j + 1) * ps);
            let page = slots[j * ps..(j + 1) * ps].to_vec();
            assert!(
                cached.insert(k.clone(), page).is_none(),
                "page-prefix {k:?} twice"
            );
            locks.insert(k, n.lock);
        }
    }
    (cached, locks)
}

/// Lock counts read back (`tree`, per key) against the model's (`model`): equal for
/// every key the tree has, and nothing the model locks is missing from `present`.
pub fn assert_locks<V>(
    what: &str,
    tree: &HashMap<Key, u32>,
    model: &HashMap<Key, u32>,
    present: &BTreeMap<Key, V>,
) {
    for (k, &l) in tree {
        assert_eq!(model.get(k).copied().unwrap_or(0), l, "{what} of {k:?}");
    }
    for k in model.keys() {
        assert!(present.contains_key(k), "{what}: locked {k:?} is gone");
    }
}

/// `protected_size`, `evictable_size` and `total_size` for `cached` page-prefixes,
/// `protected` of them locked.
pub fn assert_sizes(cache: &Cache, ps: usize, cached: usize, protected: usize) {
    assert_eq!(cache.protected_size(), protected * ps, "protected_size");
    assert_eq!(
        cache.evictable_size(),
        (cached - protected) * ps,
        "evictable_size"
    );
    assert_eq!(cache.total_size(), cached * ps, "total_size");
}

/// Checks the pages `alloc_kv` returned (`slots`): whole pages, each free before or
/// just evicted, none handed out twice or already held; they join `held`.
pub fn take_allocated(
    slots: &[i64],
    ps: usize,
    free: &BTreeSet<i64>,
    evicted: &[i64],
    held: &mut BTreeSet<i64>,
) {
    for chunk in slots.chunks(ps) {
        let p = page_of(chunk, ps);
        assert_eq!(chunk, page_slots(p, ps), "alloc_kv pages: {slots:?}");
        assert!(
            free.contains(&p) || evicted.contains(&p),
            "alloc_kv returned page {p}, neither free nor evicted"
        );
        assert!(held.insert(p), "page {p} handed out twice");
    }
}

/// Checks the pages an eviction left (`after`) against those before (`before`): none
/// appeared or moved, nothing locked (`locks`) went, and what went took its cached
/// extensions with it. Returns the page-prefixes that went.
pub fn evicted_pages<'a>(
    before: &'a Pages,
    after: &Pages,
    locks: &HashMap<Key, u32>,
) -> Vec<&'a Key> {
    for (k, s) in after {
        assert_eq!(before.get(k), Some(s), "{k:?} appeared or moved");
    }
    let gone: Vec<&Key> = before.keys().filter(|k| !after.contains_key(*k)).collect();
    let gone_set: HashSet<&Key> = gone.iter().copied().collect();
    for &k in &gone {
        assert!(!locks.contains_key(k), "evicted locked {k:?}");
        for ext in extensions(before, k) {
            assert!(
                gone_set.contains(ext),
                "evicted {k:?} but kept its extension {ext:?}"
            );
        }
    }
    gone
}

/// The id the cache gives its batch number `seq` (0, 1, ... in emission order).
pub fn batch_id(c: &Cache, seq: u64) -> radixcache_core::BatchId {
    radixcache_core::BatchId::from_u128((u128::from(c.id().get()) << 64) | u128::from(seq)).unwrap()
}

/// The pool gauges of `stats()` add up: for each pool, free + cached + caller + request +
/// draining slots are its capacity (host pools have no caller or request slots).
pub fn assert_pool_sums(c: &Cache) {
    let stats: HashMap<&str, u64> = c.stats().into_iter().collect();
    let get = |k: String| -> u64 {
        *stats
            .get(k.as_str())
            .unwrap_or_else(|| panic!("no gauge {k}"))
    };
    for (pool, cached) in [
        ("kv", "cached_tokens"),
        ("mamba", "cached_states"),
        ("host_kv", "cached_tokens"),
        ("host_mamba", "cached_states"),
    ] {
        let parts = [
            "free_slots",
            cached,
            "caller_slots",
            "request_slots",
            "draining_slots",
        ];
        let sum: u64 = parts
            .iter()
            .filter_map(|p| stats.get(format!("{pool}_{p}").as_str()))
            .sum();
        assert_eq!(
            sum,
            get(format!("{pool}_capacity_slots")),
            "{pool}: free + cached + caller + request + draining != capacity: {stats:?}"
        );
    }
}

/// A lock receipt of another cache (with that cache, which must outlive it).
pub fn foreign_receipt() -> (Cache, radixcache_core::LockReceipt) {
    let mut other = Cache::new(radixcache_core::Config::kv(4, 1)).unwrap();
    let slots = other.alloc_kv(1).unwrap().unwrap();
    let node = other.insert(None, &[1], &slots, 0).unwrap().node;
    let receipt = other.lock(node).unwrap();
    (other, receipt)
}

/// A router's index rebuilt only from the cache's KV events: per medium and namespace,
/// the page hashes present and the node ends with a state. [`EventIndex::check`] takes
/// the events, applies them (a page stored twice, or removed while absent, fails) and
/// compares the index with what the cache holds (`Cache::event_contents`).
#[derive(Default)]
pub struct EventIndex {
    pages: BTreeSet<(Medium, Ns, PageHash)>,
    states: BTreeSet<(Medium, Ns, PageHash)>,
}

impl EventIndex {
    /// Applies the events taken from `c` and checks the index against it.
    pub fn check(&mut self, c: &mut Cache) {
        for e in c.take_events().unwrap() {
            match &e {
                KvEvent::Stored {
                    medium,
                    namespace,
                    hashes,
                    token_ids,
                    block_size,
                    ..
                } => {
                    assert_eq!(token_ids.len(), hashes.len() * block_size, "{e:?}");
                    for h in hashes {
                        let fresh = self.pages.insert((*medium, namespace.clone(), *h));
                        assert!(fresh, "stored twice: {e:?}");
                    }
                }
                KvEvent::Removed {
                    medium,
                    namespace,
                    hashes,
                } => {
                    for h in hashes {
                        let was = self.pages.remove(&(*medium, namespace.clone(), *h));
                        assert!(was, "removed while absent: {e:?}");
                    }
                }
                KvEvent::Cleared => {
                    self.pages.clear();
                    self.states.clear();
                }
                KvEvent::StateStored {
                    medium,
                    namespace,
                    hash,
                } => {
                    let fresh = self.states.insert((*medium, namespace.clone(), *hash));
                    assert!(fresh, "state stored twice: {e:?}");
                }
                KvEvent::StateRemoved {
                    medium,
                    namespace,
                    hash,
                } => {
                    let was = self.states.remove(&(*medium, namespace.clone(), *hash));
                    assert!(was, "state removed while absent: {e:?}");
                }
            }
        }
        let want = c.event_contents();
        let pages: Vec<_> = self.pages.iter().cloned().collect();
        assert_eq!(pages, want.pages, "pages: events and cache disagree");
        let states: Vec<_> = self.states.iter().cloned().collect();
        assert_eq!(states, want.states, "states: events and cache disagree");
        // The same contents read back through the public snapshot, independently of
        // how the core decides what to announce: KV on each tier (device KV of a node a
        // load-back is still landing does not count), states at node ends.
        let (mut pages, mut states) = (BTreeSet::new(), BTreeSet::new());
        for n in c.snapshot() {
            if n.key_len == 0 {
                continue;
            }
            let hashes = c.node_hashes(n.id).unwrap();
            assert_eq!(hashes.len() * c.page_size(), n.key_len);
            let last = *hashes.last().unwrap();
            let ns = n.namespace.clone();
            let on_device = n.kv_indices.is_some() && !n.loading;
            for (medium, kv, state) in [
                (
                    Medium::Device,
                    on_device,
                    on_device && n.mamba_slot.is_some(),
                ),
                (
                    Medium::Host,
                    n.host_kv_indices.is_some(),
                    n.host_mamba_slot.is_some(),
                ),
            ] {
                if kv {
                    pages.extend(hashes.iter().map(|&h| (medium, ns.clone(), h)));
                }
                if state {
                    states.insert((medium, ns.clone(), last));
                }
            }
        }
        assert_eq!(self.pages, pages, "pages: events and snapshot disagree");
        assert_eq!(self.states, states, "states: events and snapshot disagree");
    }
}
