//! State-machine test of [`radixcache_core::Cache`] (KV component, device tier only).
//!
//! Proptest generates random sequences of `match_prefix`, `insert` (valid and invalid),
//! `alloc_kv`, `free_kv`, `lock`, `unlock` and `evict` over small token alphabets, a few
//! shared "system prompt" prefixes, two namespaces, page sizes 1, 2 and 4 and pools of
//! 16..64 slots (so splits, evictions and allocation failures are frequent). A naive
//! reference model (a map from every cached page-prefix to its slots, the caller-held
//! pages and the live lock receipts) predicts, independently of the cache:
//!
//! * every `Match` exactly (`device_len`, `kv_indices`, `kv_len`, `host_len == 0`,
//!   no Mamba slot, and the same `node` handle for the same live prefix);
//! * every `Insert` exactly (`prefix_len`, which page-prefixes become cached with which
//!   slots, which caller pages are freed as duplicates or unaligned tail), and that every
//!   bad insert fails with `InvalidArgument` naming the right argument and changes
//!   nothing (snapshot, sizes and pool counts compared before/after);
//! * `alloc_kv` success/failure exactly (`None` iff free + evictable < n), page-structured
//!   results taken only from free or evicted pages, no eviction when the pool has room;
//! * `free_kv` results, and that bad slots fail and change nothing;
//! * lock receipts: `lock` / `unlock` / double `unlock` / `lock` of an evicted node;
//! * eviction legality after `alloc_kv` and `evict` (read back from `snapshot()`): only
//!   unlocked page-prefixes are removed, the removed set is closed under extension,
//!   whole nodes go, remaining slots are unchanged, `evict` frees what it reports (at
//!   least `min(n, evictable)`, and everything evictable when it reports less than `n`),
//!   and no more is evicted than needed (without its largest evicted node, an eviction
//!   freed less than it had to). LRU *order* is not modelled.
//!
//! Each case runs 1..=240 operations (about 120 on average; 256 cases: ~30,000 steps).
//! Failures are saved to `proptest-regressions/machine.txt` and replayed first.
//!
//! After every step `audit()` must pass, the model must equal the tree read back from
//! `snapshot()` (page-prefixes, slots and per-node lock counts), and `evictable_size`,
//! `protected_size`, `total_size`, `available_kv` and `kv_counts` must match the model
//! exactly.

// clippy.toml allows unwrap/expect in `#[test]` functions only; in this test crate the
// model's helpers fail the test the same way.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;
use radixcache_core::{Cache, Config, Error, LockId, Match, NodeId, NodeInfo, PoolCounts};

type Ns = Option<String>;
/// A cached page-prefix: namespace and every token from the root to the end of the page.
type Key = (Ns, Vec<u32>);

/// Fixed prefixes shared between sequences: the first two share four tokens, the first
/// and the last three (a divergence inside a page of 2 or 4), the third shares nothing.
const SYSTEM: [&[u32]; 4] = [
    &[0, 1, 2, 3, 0, 1, 2, 3],
    &[0, 1, 2, 3, 3, 3, 2, 2],
    &[2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0],
    &[0, 1, 2, 0, 1, 2, 0, 1],
];
const MAX_TOKENS: usize = 40;

// ---------------------------------------------------------------------------------------
// Operations

#[derive(Debug, Clone)]
struct TokSpec {
    /// 0: none, 1..=4: a system prompt, 5..=6: an earlier inserted sequence.
    base: u8,
    hist: usize,
    cut: Option<usize>,
    tail: Vec<u32>,
}

#[derive(Debug, Clone, Copy)]
enum OwnedFrom {
    /// `device_len` of the fresh match.
    Full,
    /// 0: every matched page passed again as caller slots (duplicates).
    Zero,
    /// A random page boundary up to `device_len`.
    Mid,
}

#[derive(Debug, Clone, Copy)]
enum BadSlot {
    Free,
    Tree,
    OutOfRange,
    Negative,
}

#[derive(Debug, Clone, Copy)]
enum InsertKind {
    Valid(OwnedFrom),
    WrongLen,
    Unaligned,
    PastCached,
    PrefixNotTree,
    NotHeld(BadSlot),
    /// `owned_from == 0` while the tree's own slots are passed for the matched prefix.
    TreeSlotsAsOwned,
    Duplicate,
    NotPageStructured,
}

#[derive(Debug, Clone)]
enum Op {
    Match {
        ns: bool,
        toks: TokSpec,
    },
    Insert {
        ns: bool,
        toks: TokSpec,
        kind: InsertKind,
        /// Whether an invalid insert that does not need one is preceded by a match.
        pre_match: bool,
        seed: u64,
    },
    Alloc {
        pages: usize,
        /// Added to `pages * page_size`: a non-zero remainder is an invalid `n`.
        extra: usize,
    },
    Free {
        bad: Option<BadSlot>,
        seed: u64,
    },
    Lock {
        ns: bool,
        toks: TokSpec,
    },
    Unlock {
        pick: usize,
    },
    UnlockReleased {
        pick: usize,
    },
    LockStale {
        pick: usize,
    },
    Evict {
        n: usize,
    },
}

fn tok_spec() -> impl Strategy<Value = TokSpec> {
    let base = prop_oneof![2 => Just(0u8), 4 => 1u8..=4, 4 => 5u8..=6];
    let tail = prop_oneof![
        3 => prop::collection::vec(0u32..4, 0..8),
        1 => prop::collection::vec(0u32..4, 0..24),
    ];
    (
        base,
        any::<usize>(),
        prop::option::weighted(0.3, 0usize..MAX_TOKENS),
        tail,
    )
        .prop_map(|(base, hist, cut, tail)| TokSpec {
            base,
            hist,
            cut,
            tail,
        })
}

/// The named namespace less often than the default one, so that prefixes are shared.
fn ns() -> impl Strategy<Value = bool> {
    prop::bool::weighted(0.3)
}

fn bad_slot() -> impl Strategy<Value = BadSlot> {
    prop_oneof![
        Just(BadSlot::Free),
        Just(BadSlot::Tree),
        Just(BadSlot::OutOfRange),
        Just(BadSlot::Negative),
    ]
}

fn insert_kind() -> impl Strategy<Value = InsertKind> {
    prop_oneof![
        10 => Just(InsertKind::Valid(OwnedFrom::Full)),
        3 => Just(InsertKind::Valid(OwnedFrom::Zero)),
        3 => Just(InsertKind::Valid(OwnedFrom::Mid)),
        1 => Just(InsertKind::WrongLen),
        1 => Just(InsertKind::Unaligned),
        1 => Just(InsertKind::PastCached),
        1 => Just(InsertKind::PrefixNotTree),
        2 => bad_slot().prop_map(InsertKind::NotHeld),
        1 => Just(InsertKind::TreeSlotsAsOwned),
        1 => Just(InsertKind::Duplicate),
        1 => Just(InsertKind::NotPageStructured),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        12 => (ns(), tok_spec()).prop_map(|(ns, toks)| Op::Match { ns, toks }),
        30 => (ns(), tok_spec(), insert_kind(), any::<bool>(), any::<u64>()).prop_map(
            |(ns, toks, kind, pre_match, seed)| Op::Insert {
                ns,
                toks,
                kind,
                pre_match,
                seed,
            }
        ),
        8 => (0usize..7, prop_oneof![4 => Just(0usize), 1 => 1usize..4])
            .prop_map(|(pages, extra)| Op::Alloc { pages, extra }),
        8 => (prop::option::weighted(0.4, bad_slot()), any::<u64>())
            .prop_map(|(bad, seed)| Op::Free { bad, seed }),
        10 => (ns(), tok_spec()).prop_map(|(ns, toks)| Op::Lock { ns, toks }),
        8 => any::<usize>().prop_map(|pick| Op::Unlock { pick }),
        2 => any::<usize>().prop_map(|pick| Op::UnlockReleased { pick }),
        3 => any::<usize>().prop_map(|pick| Op::LockStale { pick }),
        6 => prop_oneof![3 => 0usize..8, 1 => 0usize..72].prop_map(|n| Op::Evict { n }),
    ]
}

fn config() -> impl Strategy<Value = (usize, usize)> {
    (prop_oneof![Just(1usize), Just(2), Just(4)], 16usize..=64)
        .prop_map(|(ps, slots)| (ps, slots / ps * ps))
}

// ---------------------------------------------------------------------------------------
// Helpers

/// `SplitMix64`, for choices made at run time from state the strategy cannot see.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    fn below(&mut self, n: usize) -> usize {
        usize::try_from(self.next() % u64::try_from(n).unwrap()).unwrap()
    }

    fn coin(&mut self) -> bool {
        self.next() & 1 == 1
    }
}

fn i64_of(x: usize) -> i64 {
    i64::try_from(x).unwrap()
}

/// The first `len` slots of `page`.
fn page_slots(page: i64, ps: usize, len: usize) -> Vec<i64> {
    let base = page * i64_of(ps);
    (base..base + i64_of(len)).collect()
}

/// Slots for positions `from..len` given one page per chunk of `ps` positions.
fn caller_slots(pages: &[i64], from: usize, len: usize, ps: usize) -> Vec<i64> {
    let mut out = Vec::with_capacity(len - from);
    for (c, &p) in pages.iter().enumerate() {
        let pos = from + c * ps;
        out.extend(page_slots(p, ps, ps.min(len - pos)));
    }
    assert_eq!(out.len(), len - from);
    out
}

fn ns_of(flag: bool) -> Ns {
    flag.then(|| "a".to_owned())
}

/// Everything an operation that fails must leave as it was.
#[derive(Debug, PartialEq, Eq)]
struct Frozen {
    snapshot: Vec<NodeInfo>,
    available: usize,
    evictable: usize,
    protected: usize,
    counts: PoolCounts,
}

fn frozen(c: &Cache) -> Frozen {
    Frozen {
        snapshot: c.snapshot(),
        available: c.available_kv(),
        evictable: c.evictable_size(),
        protected: c.protected_size(),
        counts: c.kv_counts(),
    }
}

fn arg_of<T: std::fmt::Debug>(r: Result<T, Error>) -> &'static str {
    match r {
        Err(Error::InvalidArgument { arg, .. }) => arg,
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

/// The page-prefixes held by the tree, from the snapshot, with each node's lock count.
fn tree_pages(snapshot: &[NodeInfo], ps: usize) -> (BTreeMap<Key, Vec<i64>>, HashMap<Key, u32>) {
    let mut cached = BTreeMap::new();
    let mut locks = HashMap::new();
    for n in snapshot {
        let slots = n
            .kv_indices
            .as_ref()
            .expect("a KV-only cache has device KV everywhere");
        assert_eq!(slots.len(), n.key_len, "node {} slots vs key", n.id);
        if n.prefix.is_empty() {
            continue;
        }
        let start = n.prefix.len() - n.key_len;
        for j in 0..n.key_len / ps {
            let end = start + (j + 1) * ps;
            let key = (n.namespace.clone(), n.prefix[..end].to_vec());
            let page = slots[j * ps..(j + 1) * ps].to_vec();
            assert!(
                cached.insert(key.clone(), page).is_none(),
                "page-prefix twice"
            );
            locks.insert(key, n.lock);
        }
    }
    (cached, locks)
}

// ---------------------------------------------------------------------------------------
// The reference model

struct LiveLock {
    id: LockId,
    ns: Ns,
    prefix: Vec<u32>,
    node: NodeId,
}

struct Model {
    ps: usize,
    /// Slots in the pool.
    capacity: usize,
    /// Every cached page-prefix and the slots of its last page.
    cached: BTreeMap<Key, Vec<i64>>,
    /// Pages the caller holds (from `alloc_kv`).
    held: BTreeSet<i64>,
    locks: Vec<LiveLock>,
    released: Vec<LockId>,
    /// Live node handles by the prefix they end at (roots at the empty prefix).
    nodes: HashMap<Key, NodeId>,
    dead: Vec<NodeId>,
    dead_set: HashSet<NodeId>,
    history: Vec<Vec<u32>>,
}

impl Model {
    fn pages(&self) -> usize {
        self.capacity / self.ps
    }

    fn resolve(&self, t: &TokSpec) -> Vec<u32> {
        let mut v: Vec<u32> = match t.base {
            1..=4 => SYSTEM[usize::from(t.base) - 1].to_vec(),
            5 | 6 if !self.history.is_empty() => self.history[t.hist % self.history.len()].clone(),
            _ => Vec::new(),
        };
        if let Some(c) = t.cut {
            v.truncate(c % (v.len() + 1));
        }
        v.extend_from_slice(&t.tail);
        v.truncate(MAX_TOKENS);
        v
    }

    /// Live receipts covering each page-prefix.
    fn lock_counts(&self) -> HashMap<Key, u32> {
        let mut out = HashMap::new();
        for l in &self.locks {
            for j in 1..=l.prefix.len() / self.ps {
                *out.entry((l.ns.clone(), l.prefix[..j * self.ps].to_vec()))
                    .or_insert(0) += 1;
            }
        }
        out
    }

    fn unlocked(&self) -> Vec<Key> {
        let counts = self.lock_counts();
        self.cached
            .keys()
            .filter(|k| !counts.contains_key(*k))
            .cloned()
            .collect()
    }

    fn page_of(&self, slots: &[i64]) -> i64 {
        slots[0] / i64_of(self.ps)
    }

    fn tree_page_set(&self) -> BTreeSet<i64> {
        self.cached.values().map(|s| self.page_of(s)).collect()
    }

    fn free_page_set(&self) -> BTreeSet<i64> {
        let tree = self.tree_page_set();
        (0..i64_of(self.pages()))
            .filter(|p| !tree.contains(p) && !self.held.contains(p))
            .collect()
    }

    /// The longest page-aligned prefix of `toks` whose every page-prefix is cached.
    fn device_len(&self, ns: &Ns, toks: &[u32]) -> usize {
        let mut k = 0;
        while k + self.ps <= toks.len()
            && self
                .cached
                .contains_key(&(ns.clone(), toks[..k + self.ps].to_vec()))
        {
            k += self.ps;
        }
        k
    }

    fn slots(&self, ns: &Ns, toks: &[u32], len: usize) -> Vec<i64> {
        let mut out = Vec::with_capacity(len);
        for j in 1..=len / self.ps {
            out.extend_from_slice(&self.cached[&(ns.clone(), toks[..j * self.ps].to_vec())]);
        }
        out
    }

    /// Remembers the handle of the node ending at `prefix`; the same live prefix must
    /// always give the same handle, and a handle of an evicted node never comes back.
    fn record_node(&mut self, ns: &Ns, prefix: &[u32], id: NodeId) {
        assert!(
            !self.dead_set.contains(&id),
            "evicted node {id} handed out again"
        );
        match self.nodes.get(&(ns.clone(), prefix.to_vec())) {
            Some(&old) => assert_eq!(old, id, "node handle for {ns:?} {prefix:?} changed"),
            None => {
                self.nodes.insert((ns.clone(), prefix.to_vec()), id);
            }
        }
    }

    fn pick_held(&self, rng: &mut Rng, k: usize) -> Vec<i64> {
        let mut all: Vec<i64> = self.held.iter().copied().collect();
        assert!(k <= all.len());
        for i in 0..k {
            let j = i + rng.below(all.len() - i);
            all.swap(i, j);
        }
        all.truncate(k);
        all
    }
}

// ---------------------------------------------------------------------------------------
// The machine

struct Machine {
    cache: Cache,
    m: Model,
}

impl Machine {
    fn new(ps: usize, slots: usize) -> Machine {
        Machine {
            cache: Cache::new(Config::kv(slots, ps)).unwrap(),
            m: Model {
                ps,
                capacity: slots,
                cached: BTreeMap::new(),
                held: BTreeSet::new(),
                locks: Vec::new(),
                released: Vec::new(),
                nodes: HashMap::new(),
                dead: Vec::new(),
                dead_set: HashSet::new(),
                history: Vec::new(),
            },
        }
    }

    /// After every step: audit, model == tree, sizes exact.
    fn check(&self) {
        self.cache.audit().unwrap();
        let ps = self.m.ps;
        let (tree, tree_locks) = tree_pages(&self.cache.snapshot(), ps);
        assert_eq!(tree, self.m.cached, "model and tree disagree");
        let counts = self.m.lock_counts();
        for (k, &lock) in &tree_locks {
            assert_eq!(
                counts.get(k).copied().unwrap_or(0),
                lock,
                "lock count of {k:?}"
            );
        }
        for k in counts.keys() {
            assert!(self.m.cached.contains_key(k), "locked {k:?} is not cached");
        }
        let protected = self
            .m
            .cached
            .keys()
            .filter(|k| counts.contains_key(*k))
            .count();
        let evictable = self.m.cached.len() - protected;
        assert_eq!(
            self.cache.evictable_size(),
            evictable * ps,
            "evictable_size"
        );
        assert_eq!(
            self.cache.protected_size(),
            protected * ps,
            "protected_size"
        );
        assert_eq!(
            self.cache.total_size(),
            self.m.cached.len() * ps,
            "total_size"
        );
        let free = self.m.pages() - self.m.cached.len() - self.m.held.len();
        assert_eq!(self.cache.available_kv(), free * ps, "available_kv");
        assert_eq!(
            self.cache.kv_counts(),
            PoolCounts {
                free,
                owned: 0,
                caller: self.m.held.len(),
                tree: self.m.cached.len(),
                draining: 0,
            }
        );
        for l in &self.m.locks {
            assert_eq!(self.cache.lock_node(l.id), Ok(l.node));
        }
    }

    /// Reads the tree back after an operation that may evict, checks that the eviction
    /// was legal, and moves the model to it. Returns the evicted page-prefixes.
    ///
    /// `before` is the snapshot taken just before the operation and `target` the tokens
    /// it had to free: eviction takes whole nodes, one at a time, and stops as soon as it
    /// freed `target`, so without the last node it took it had freed less than `target`.
    fn sync_eviction(&mut self, before: &[NodeInfo], target: usize) -> Vec<Key> {
        let ps = self.m.ps;
        let (after, _) = tree_pages(&self.cache.snapshot(), ps);
        let mut largest = 0;
        for n in before.iter().filter(|n| !n.prefix.is_empty()) {
            let start = n.prefix.len() - n.key_len;
            let gone = (1..=n.key_len / ps)
                .filter(|j| {
                    let key = (n.namespace.clone(), n.prefix[..start + j * ps].to_vec());
                    !after.contains_key(&key)
                })
                .count();
            assert!(
                gone == 0 || gone * ps == n.key_len,
                "eviction took {gone} of the pages of node {}",
                n.id
            );
            if gone > 0 {
                largest = largest.max(n.key_len);
            }
        }
        for (k, slots) in &after {
            assert_eq!(
                self.m.cached.get(k),
                Some(slots),
                "{k:?} appeared or moved during eviction"
            );
        }
        let removed: Vec<Key> = self
            .m
            .cached
            .keys()
            .filter(|k| !after.contains_key(*k))
            .cloned()
            .collect();
        let counts = self.m.lock_counts();
        let removed_set: HashSet<&Key> = removed.iter().collect();
        for k in &removed {
            assert!(!counts.contains_key(k), "evicted locked {k:?}");
            for (ext, _) in self.m.cached.range(k.clone()..) {
                if ext.0 != k.0 || !ext.1.starts_with(&k.1) {
                    break;
                }
                assert!(
                    removed_set.contains(ext),
                    "evicted {k:?} but kept its extension {ext:?}"
                );
            }
        }
        for k in &removed {
            if let Some(id) = self.m.nodes.remove(k) {
                self.m.dead.push(id);
                self.m.dead_set.insert(id);
            }
        }
        let freed = removed.len() * ps;
        assert!(
            freed == 0 || freed - largest < target,
            "evicted {freed} tokens (largest node {largest}) to free {target}"
        );
        self.m.cached = after;
        removed
    }

    fn do_match(&mut self, ns: &Ns, toks: &[u32]) -> Match {
        let len = self.m.device_len(ns, toks);
        let kv = self.m.slots(ns, toks, len);
        let r = self.cache.match_prefix(ns.as_deref(), toks);
        assert_eq!(r.device_len, len, "device_len of {ns:?} {toks:?}");
        assert_eq!(r.kv_indices, kv, "kv_indices of {ns:?} {toks:?}");
        assert_eq!(r.kv_len, len);
        assert_eq!(r.host_len, 0);
        assert_eq!(r.host_node, r.node);
        assert_eq!(r.mamba_slot, None);
        self.m.record_node(ns, &toks[..len], r.node);
        self.check();
        r
    }

    fn do_alloc(&mut self, n: usize) -> Option<Vec<i64>> {
        let ps = self.m.ps;
        if n % ps != 0 {
            let before = frozen(&self.cache);
            assert_eq!(arg_of(self.cache.alloc_kv(n)), "n");
            assert_eq!(
                frozen(&self.cache),
                before,
                "a bad alloc_kv changed something"
            );
            self.check();
            return None;
        }
        let pages = n / ps;
        let free_before = self.m.free_page_set();
        let tree_before: HashMap<Key, i64> = self
            .m
            .cached
            .iter()
            .map(|(k, s)| (k.clone(), self.m.page_of(s)))
            .collect();
        let evictable = self.m.unlocked().len();
        let before = self.cache.snapshot();
        let r = self.cache.alloc_kv(n).unwrap();
        let short = pages.saturating_sub(free_before.len()) * ps;
        let removed = self.sync_eviction(&before, short);
        assert_eq!(
            r.is_some(),
            free_before.len() + evictable >= pages,
            "alloc_kv({n}) with {} free and {evictable} evictable pages",
            free_before.len()
        );
        if free_before.len() >= pages {
            assert!(
                removed.is_empty(),
                "alloc_kv evicted with enough free pages"
            );
        }
        let evicted_pages: BTreeSet<i64> = removed.iter().map(|k| tree_before[k]).collect();
        let Some(slots) = r else {
            self.check();
            return None;
        };
        assert!(removed.len() + free_before.len() >= pages);
        assert_eq!(slots.len(), n);
        let mut got = BTreeSet::new();
        for chunk in slots.chunks(ps) {
            let page = chunk[0] / i64_of(ps);
            assert_eq!(chunk, page_slots(page, ps, ps), "alloc_kv pages: {slots:?}");
            assert!(got.insert(page), "page {page} handed out twice");
            assert!(
                free_before.contains(&page) || evicted_pages.contains(&page),
                "alloc_kv returned page {page} that was neither free nor evicted"
            );
        }
        self.m.held.extend(got);
        self.check();
        Some(slots)
    }

    fn do_evict(&mut self, n: usize) {
        let evictable = self.m.unlocked().len() * self.m.ps;
        let before = self.cache.snapshot();
        let r = self.cache.evict(n, 0);
        let removed = self.sync_eviction(&before, n);
        assert_eq!(r.kv_tokens, removed.len() * self.m.ps, "evict reported");
        assert_eq!(r.mamba_states, 0);
        assert!(r.kv_tokens >= n.min(evictable), "evict({n}) freed {r:?}");
        if r.kv_tokens < n {
            assert_eq!(self.cache.evictable_size(), 0);
        }
        self.check();
    }

    fn do_free(&mut self, bad: Option<BadSlot>, rng: &mut Rng) {
        let ps = self.m.ps;
        let k = rng.below(self.m.held.len() + 1);
        let pages = self.m.pick_held(rng, k);
        let mut slots = Vec::new();
        for &p in &pages {
            let all = page_slots(p, ps, ps);
            if rng.coin() {
                slots.extend(all);
            } else {
                // Some of its slots, possibly repeated.
                for _ in 0..=rng.below(ps + 1) {
                    slots.push(all[rng.below(ps)]);
                }
            }
        }
        let bad_slot = bad.and_then(|b| self.bad_slot(b, rng));
        if let Some(s) = bad_slot {
            let at = rng.below(slots.len() + 1);
            slots.insert(at, s);
        } else {
            // Shuffle: pages need not be listed in order.
            for i in (1..slots.len()).rev() {
                slots.swap(i, rng.below(i + 1));
            }
        }
        if bad_slot.is_some() {
            let before = frozen(&self.cache);
            assert_eq!(arg_of(self.cache.free_kv(&slots)), "indices");
            assert_eq!(
                frozen(&self.cache),
                before,
                "a bad free_kv changed something"
            );
        } else {
            let freed = self.cache.free_kv(&slots).unwrap();
            assert_eq!(freed, pages.len() * ps, "free_kv({slots:?})");
            for p in pages {
                self.m.held.remove(&p);
            }
        }
        self.check();
    }

    /// A slot the caller does not hold, of the kind asked for (or out of range when the
    /// pool has no such page).
    fn bad_slot(&self, kind: BadSlot, rng: &mut Rng) -> Option<i64> {
        let ps = self.m.ps;
        let pick = |set: BTreeSet<i64>, rng: &mut Rng| {
            if set.is_empty() {
                None
            } else {
                let v: Vec<i64> = set.into_iter().collect();
                Some(v[rng.below(v.len())] * i64_of(ps) + i64_of(rng.below(ps)))
            }
        };
        let oor = i64_of(self.m.capacity + rng.below(2 * ps + 1));
        match kind {
            BadSlot::Free => pick(self.m.free_page_set(), rng).or(Some(oor)),
            BadSlot::Tree => pick(self.m.tree_page_set(), rng).or(Some(oor)),
            BadSlot::OutOfRange => Some(oor),
            BadSlot::Negative => Some(-1 - i64_of(rng.below(ps + 1))),
        }
    }

    /// Makes sure the caller holds enough pages for an insert of `len` tokens.
    fn ensure_held(&mut self, len: usize) {
        let want = len.div_ceil(self.m.ps);
        if self.m.held.len() < want {
            let n = (want - self.m.held.len()) * self.m.ps;
            self.do_alloc(n);
        }
    }

    fn do_insert(&mut self, ns: &Ns, mut toks: Vec<u32>, kind: InsertKind, pre: bool, seed: u64) {
        let mut rng = Rng(seed);
        let ps = self.m.ps;
        self.ensure_held(toks.len());
        let needs_match = matches!(
            kind,
            InsertKind::Valid(_)
                | InsertKind::PastCached
                | InsertKind::PrefixNotTree
                | InsertKind::TreeSlotsAsOwned
        );
        let m = (needs_match || pre).then(|| self.do_match(ns, &toks));
        let dl = m.as_ref().map_or(0, |m| m.device_len);
        let tree_kv = m.map(|m| m.kv_indices).unwrap_or_default();
        if let InsertKind::Valid(choice) = kind {
            let owned_from = match choice {
                OwnedFrom::Full => dl,
                OwnedFrom::Zero => 0,
                OwnedFrom::Mid => rng.below(dl / ps + 1) * ps,
            };
            let held = self.m.held.len();
            if (toks.len() - owned_from).div_ceil(ps) > held {
                toks.truncate(owned_from + held * ps);
            }
            let len = toks.len();
            let pages = self.m.pick_held(&mut rng, (len - owned_from).div_ceil(ps));
            let mut kv = tree_kv[..owned_from].to_vec();
            kv.extend(caller_slots(&pages, owned_from, len, ps));
            self.valid_insert(ns, &toks, &kv, owned_from, &pages);
        } else {
            let (toks, kv, owned_from, arg) = self
                .bad_insert(kind, &toks, dl, &tree_kv, &mut rng)
                .unwrap_or_else(|| self.wrong_len(&toks, dl, &tree_kv, &mut rng));
            let before = frozen(&self.cache);
            let r = self.cache.insert(ns.as_deref(), &toks, &kv, owned_from);
            assert_eq!(
                arg_of(r),
                arg,
                "{kind:?}: insert({ns:?}, {toks:?}, {kv:?}, {owned_from})"
            );
            assert_eq!(
                frozen(&self.cache),
                before,
                "a bad insert changed something"
            );
            self.check();
        }
    }

    fn valid_insert(
        &mut self,
        ns: &Ns,
        toks: &[u32],
        kv: &[i64],
        owned_from: usize,
        pages: &[i64],
    ) {
        let ps = self.m.ps;
        let len = toks.len();
        let aligned = len / ps * ps;
        let prefix_len = self.m.device_len(ns, toks);
        let avail = self.cache.available_kv();
        let r = self
            .cache
            .insert(ns.as_deref(), toks, kv, owned_from)
            .unwrap();
        assert_eq!(
            r.prefix_len, prefix_len,
            "insert({ns:?}, {toks:?}, {kv:?}, {owned_from})"
        );
        assert!(!r.mamba_existed);
        let mut freed = 0;
        for (c, &p) in pages.iter().enumerate() {
            let pos = owned_from + c * ps;
            assert!(self.m.held.remove(&p));
            if pos >= prefix_len && pos + ps <= aligned {
                let key = (ns.clone(), toks[..pos + ps].to_vec());
                assert!(self.m.cached.insert(key, page_slots(p, ps, ps)).is_none());
            } else {
                freed += 1;
            }
        }
        assert_eq!(
            self.cache.available_kv(),
            avail + freed * ps,
            "pages freed by insert"
        );
        self.m.record_node(ns, &toks[..aligned], r.node);
        if !toks.is_empty() {
            self.m.history.push(toks.to_vec());
            if self.m.history.len() > 16 {
                self.m.history.remove(0);
            }
        }
        self.check();
    }

    /// Valid-looking caller slots for positions `from..len` (held pages where there are
    /// enough, else any in-range pages: for inserts that must fail before the claim).
    fn any_caller_slots(&self, from: usize, len: usize, rng: &mut Rng) -> Vec<i64> {
        let ps = self.m.ps;
        let k = (len - from).div_ceil(ps);
        let pages = if k <= self.m.held.len() {
            self.m.pick_held(rng, k)
        } else {
            (0..k).map(|_| i64_of(rng.below(self.m.pages()))).collect()
        };
        caller_slots(&pages, from, len, ps)
    }

    /// Always possible: one slot too many or too few.
    fn wrong_len(
        &self,
        toks: &[u32],
        dl: usize,
        tree_kv: &[i64],
        rng: &mut Rng,
    ) -> (Vec<u32>, Vec<i64>, usize, &'static str) {
        let mut kv = tree_kv[..dl].to_vec();
        kv.extend(self.any_caller_slots(dl, toks.len(), rng));
        if kv.is_empty() || rng.coin() {
            kv.push(0);
        } else {
            kv.pop();
        }
        (toks.to_vec(), kv, dl, "kv_indices")
    }

    /// Arguments for a bad insert of `kind` and the argument its error must name, or
    /// `None` when the tokens and the state do not allow that kind.
    #[allow(clippy::too_many_lines)]
    fn bad_insert(
        &self,
        kind: InsertKind,
        toks: &[u32],
        dl: usize,
        tree_kv: &[i64],
        rng: &mut Rng,
    ) -> Option<(Vec<u32>, Vec<i64>, usize, &'static str)> {
        let ps = self.m.ps;
        let len = toks.len();
        let toks = toks.to_vec();
        let held = self.m.held.len();
        // Valid caller pages for `from..len` (held, distinct), if the caller has them.
        let held_pages = |from: usize, rng: &mut Rng| {
            let k = (len - from).div_ceil(ps);
            (k <= held).then(|| self.m.pick_held(rng, k))
        };
        match kind {
            InsertKind::Valid(_) => unreachable!(),
            InsertKind::WrongLen => None,
            InsertKind::Unaligned => {
                let mut kv = tree_kv[..dl].to_vec();
                kv.extend(self.any_caller_slots(dl, len, rng));
                let owned_from = if ps == 1 || len == 0 {
                    len + 1 + rng.below(ps)
                } else {
                    let mut o = 1 + rng.below(len);
                    if o % ps == 0 {
                        o -= 1;
                    }
                    o
                };
                Some((toks, kv, owned_from, "owned_from"))
            }
            InsertKind::PastCached => {
                let owned_from = dl + ps;
                if owned_from > len {
                    return None;
                }
                let mut kv = tree_kv[..dl].to_vec();
                let extra = i64_of(rng.below(self.m.pages()));
                kv.extend(page_slots(extra, ps, ps));
                kv.extend(self.any_caller_slots(owned_from, len, rng));
                Some((toks, kv, owned_from, "owned_from"))
            }
            InsertKind::PrefixNotTree => {
                if dl == 0 || self.m.pages() < 2 {
                    return None;
                }
                let mut kv = tree_kv[..dl].to_vec();
                let c = rng.below(dl / ps);
                let old = kv[c * ps] / i64_of(ps);
                let mut new = i64_of(rng.below(self.m.pages() - 1));
                if new >= old {
                    new += 1;
                }
                kv[c * ps..(c + 1) * ps].copy_from_slice(&page_slots(new, ps, ps));
                let pages = held_pages(dl, rng)?;
                kv.extend(caller_slots(&pages, dl, len, ps));
                Some((toks, kv, dl, "kv_indices"))
            }
            InsertKind::NotHeld(b) => {
                let from = dl;
                if len == from {
                    return None;
                }
                let mut pages = held_pages(from, rng)?;
                let c = rng.below(pages.len());
                let slot = self.bad_slot(b, rng)?;
                // A whole page of the bad kind (or out of range) for chunk `c`.
                pages[c] = slot.div_euclid(i64_of(ps));
                let mut kv = tree_kv[..from].to_vec();
                kv.extend(caller_slots(&pages, from, len, ps));
                Some((toks, kv, from, "kv_indices"))
            }
            InsertKind::TreeSlotsAsOwned => {
                if dl == 0 {
                    return None;
                }
                let mut kv = tree_kv[..dl].to_vec();
                let pages = held_pages(dl, rng)?;
                kv.extend(caller_slots(&pages, dl, len, ps));
                Some((toks, kv, 0, "kv_indices"))
            }
            InsertKind::Duplicate => {
                let from = dl;
                if len - from <= ps {
                    return None;
                }
                let mut pages = held_pages(from, rng)?;
                let a = rng.below(pages.len());
                let mut b = rng.below(pages.len() - 1);
                if b >= a {
                    b += 1;
                }
                pages[b] = pages[a];
                let mut kv = tree_kv[..from].to_vec();
                kv.extend(caller_slots(&pages, from, len, ps));
                Some((toks, kv, from, "kv_indices"))
            }
            InsertKind::NotPageStructured => {
                let from = dl;
                if ps == 1 || len - from < ps {
                    return None;
                }
                let pages = held_pages(from, rng)?;
                let mut kv = caller_slots(&pages, from, len, ps);
                let c = rng.below((len - from) / ps);
                let chunk = &mut kv[c * ps..(c + 1) * ps];
                match rng.below(3) {
                    0 => chunk.swap(0, 1 + rng.below(ps - 1)),
                    1 => chunk.iter_mut().for_each(|s| *s += 1),
                    _ => {
                        // Mix in a slot of another page.
                        let other = (chunk[0] / i64_of(ps) + 1) % i64_of(self.m.pages());
                        chunk[ps - 1] = other * i64_of(ps) + i64_of(ps - 1);
                    }
                }
                let mut all = tree_kv[..from].to_vec();
                all.extend(kv);
                Some((toks, all, from, "kv_indices"))
            }
        }
    }

    fn do_lock(&mut self, ns: &Ns, toks: &[u32]) {
        let m = self.do_match(ns, toks);
        let id = self.cache.lock(m.node).unwrap();
        assert!(
            self.m.locks.iter().all(|l| l.id != id),
            "receipt {id} handed out twice"
        );
        self.m.locks.push(LiveLock {
            id,
            ns: ns.clone(),
            prefix: toks[..m.device_len].to_vec(),
            node: m.node,
        });
        self.check();
    }

    fn do_unlock(&mut self, pick: usize) {
        if self.m.locks.is_empty() {
            return self.do_evict(pick % 8);
        }
        let l = self.m.locks.swap_remove(pick % self.m.locks.len());
        self.cache.unlock(l.id).unwrap();
        assert!(matches!(self.cache.lock_node(l.id), Err(Error::Lock(_))));
        self.m.released.push(l.id);
        self.check();
    }

    fn do_unlock_released(&mut self, pick: usize) {
        if self.m.released.is_empty() {
            return self.do_unlock(pick);
        }
        let id = self.m.released[pick % self.m.released.len()];
        let before = frozen(&self.cache);
        assert!(matches!(self.cache.unlock(id), Err(Error::Lock(_))));
        assert_eq!(
            frozen(&self.cache),
            before,
            "a second unlock changed something"
        );
        self.check();
    }

    fn do_lock_stale(&mut self, pick: usize) {
        if self.m.dead.is_empty() {
            return self.do_evict(pick % 8);
        }
        let id = self.m.dead[pick % self.m.dead.len()];
        let before = frozen(&self.cache);
        assert_eq!(self.cache.lock(id), Err(Error::StaleNode(id)));
        assert_eq!(
            frozen(&self.cache),
            before,
            "a stale lock changed something"
        );
        self.check();
    }

    fn step(&mut self, op: &Op) {
        match op {
            Op::Match { ns, toks } => {
                let t = self.m.resolve(toks);
                self.do_match(&ns_of(*ns), &t);
            }
            Op::Insert {
                ns,
                toks,
                kind,
                pre_match,
                seed,
            } => {
                let t = self.m.resolve(toks);
                self.do_insert(&ns_of(*ns), t, *kind, *pre_match, *seed);
            }
            Op::Alloc { pages, extra } => {
                let n = pages * self.m.ps + extra;
                self.do_alloc(n);
            }
            Op::Free { bad, seed } => self.do_free(*bad, &mut Rng(*seed)),
            Op::Lock { ns, toks } => {
                let t = self.m.resolve(toks);
                self.do_lock(&ns_of(*ns), &t);
            }
            Op::Unlock { pick } => self.do_unlock(*pick),
            Op::UnlockReleased { pick } => self.do_unlock_released(*pick),
            Op::LockStale { pick } => self.do_lock_stale(*pick),
            Op::Evict { n } => self.do_evict(*n),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 256,
        // Relative to the package root, where `cargo test` runs: the default
        // (`SourceParallel`) finds no lib.rs above tests/ and would write beside this file.
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(
            "proptest-regressions/machine.txt",
        ))),
        ..ProptestConfig::default()
    })]

    #[test]
    fn cache_matches_the_reference_model(
        (ps, slots) in config(),
        ops in prop::collection::vec(op(), 1..=240),
    ) {
        let mut machine = Machine::new(ps, slots);
        machine.check();
        for op in &ops {
            machine.step(op);
        }
    }
}
