//! State-machine test of [`radixcache_core::Cache`] (KV component, device tier only).
//!
//! Proptest generates random sequences of `match_prefix`, `insert` (valid and invalid),
//! `alloc_kv`, `free_kv`, `lock`, `unlock`, `evict` and `reset` over small token alphabets, a few
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
//! * namespaces: a named one has a root only while it caches something or a lock holds
//!   its root; reads of one without answer the shared empty root;
//! * lock receipts: `lock` / `unlock`, a receipt dropped unreleased (released by the
//!   cache's next call), a receipt of another cache refused, `lock` of an evicted node;
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

mod common;

use std::collections::{BTreeSet, HashMap, HashSet};

use common::{
    add_lock, arg_of, assert_locks, assert_pool_sums, assert_sizes, cached_len, cached_slots,
    caller_slots, evicted_pages, eviction_policies, foreign_receipt, i64_of, key, ns_of, page_of,
    page_slots, proptest_config, remember, some_held_slots, tail, take_allocated, tok_spec_of,
    tree_pages, valid_insert_args, Key, Ns, OwnedFrom, Pages, Rng, TokSpec, SYSTEM,
};
use proptest::prelude::*;
use radixcache_core::{
    Cache, Config, Error, EvictionPolicies, LockReceipt, Match, NodeId, NodeInfo, PoolCounts,
};

// ---------------------------------------------------------------------------------------
// Operations

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
    DropReceipt {
        pick: usize,
    },
    UnlockForeign,
    LockStale {
        pick: usize,
    },
    Evict {
        n: usize,
    },
    Reset,
}

/// `base`: 0: none, 1..=4: a system prompt, 5..=6: an earlier inserted sequence.
fn tok_spec() -> impl Strategy<Value = TokSpec> {
    tok_spec_of(
        prop_oneof![2 => Just(0u8), 4 => 1u8..=4, 4 => 5u8..=6],
        0.3,
        tail(),
    )
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
        2 => any::<usize>().prop_map(|pick| Op::DropReceipt { pick }),
        1 => Just(Op::UnlockForeign),
        3 => any::<usize>().prop_map(|pick| Op::LockStale { pick }),
        6 => prop_oneof![3 => 0usize..8, 1 => 0usize..72].prop_map(|n| Op::Evict { n }),
        1 => Just(Op::Reset),
    ]
}

fn config() -> impl Strategy<Value = (usize, usize)> {
    (prop_oneof![Just(1usize), Just(2), Just(4)], 16usize..=64)
        .prop_map(|(ps, slots)| (ps, slots / ps * ps))
}

// ---------------------------------------------------------------------------------------
// Helpers

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

// ---------------------------------------------------------------------------------------
// The reference model

struct LiveLock {
    receipt: LockReceipt,
    ns: Ns,
    prefix: Vec<u32>,
    node: NodeId,
}

struct Model {
    ps: usize,
    /// Slots in the pool.
    capacity: usize,
    /// Every cached page-prefix and the slots of its last page.
    cached: Pages,
    /// Pages the caller holds (from `alloc_kv`).
    held: BTreeSet<i64>,
    locks: Vec<LiveLock>,
    /// Live node handles by the prefix they end at (roots at the empty prefix).
    nodes: HashMap<Key, NodeId>,
    dead: Vec<NodeId>,
    dead_set: HashSet<NodeId>,
    /// The shared empty root, once a read of a namespace without a root returned it.
    empty_root: Option<NodeId>,
    history: Vec<Vec<u32>>,
}

impl Model {
    fn pages(&self) -> usize {
        self.capacity / self.ps
    }

    fn resolve(&self, t: &TokSpec) -> Vec<u32> {
        t.tokens(match t.base {
            1..=4 => SYSTEM[usize::from(t.base) - 1].to_vec(),
            5 | 6 if !self.history.is_empty() => self.history[t.hist % self.history.len()].clone(),
            _ => Vec::new(),
        })
    }

    /// Whether namespace `ns` has a root: the default one always, a named one while it
    /// caches something or a lock holds its root.
    fn has_root(&self, ns: &Ns) -> bool {
        ns.is_none()
            || self.cached.keys().any(|k| &k.0 == ns)
            || self
                .locks
                .iter()
                .any(|l| &l.ns == ns && Some(l.node) != self.empty_root)
    }

    /// Roots of namespaces left holding nothing are dropped: their handles go stale.
    fn forget_dropped_roots(&mut self) {
        let gone: Vec<Key> = self
            .nodes
            .keys()
            .filter(|k| k.1.is_empty() && !self.has_root(&k.0))
            .cloned()
            .collect();
        for k in gone {
            if let Some(id) = self.nodes.remove(&k) {
                self.dead.push(id);
                self.dead_set.insert(id);
            }
        }
    }

    /// Live receipts covering each page-prefix.
    fn lock_counts(&self) -> HashMap<Key, u32> {
        let mut out = HashMap::new();
        for l in &self.locks {
            add_lock(&mut out, &l.ns, &l.prefix, self.ps);
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

    fn tree_page_set(&self) -> BTreeSet<i64> {
        self.cached.values().map(|s| page_of(s, self.ps)).collect()
    }

    fn free_page_set(&self) -> BTreeSet<i64> {
        let tree = self.tree_page_set();
        (0..i64_of(self.pages()))
            .filter(|p| !tree.contains(p) && !self.held.contains(p))
            .collect()
    }

    /// The longest page-aligned prefix of `toks` whose every page-prefix is cached.
    fn device_len(&self, ns: &Ns, toks: &[u32]) -> usize {
        cached_len(&self.cached, ns, toks, self.ps)
    }

    /// Remembers the handle of the node ending at `prefix`; the same live prefix must
    /// always give the same handle, and a handle of an evicted node never comes back.
    fn record_node(&mut self, ns: &Ns, prefix: &[u32], id: NodeId) {
        assert!(
            !self.dead_set.contains(&id),
            "evicted node {id} handed out again"
        );
        if prefix.is_empty() && !self.has_root(ns) {
            // A namespace that holds nothing has no root: reads answer the shared empty
            // root, the same node for every such namespace.
            if let Some(e) = self.empty_root {
                assert_eq!(e, id, "the empty root changed");
            } else {
                assert!(
                    !self.nodes.values().any(|&n| n == id),
                    "{id} is a real node"
                );
                self.empty_root = Some(id);
            }
            return;
        }
        match self.nodes.get(&(ns.clone(), prefix.to_vec())) {
            Some(&old) => assert_eq!(old, id, "node handle for {ns:?} {prefix:?} changed"),
            None => {
                self.nodes.insert((ns.clone(), prefix.to_vec()), id);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// The machine

struct Machine {
    cache: Cache,
    m: Model,
    /// A router's index rebuilt from the cache's KV events alone.
    events: common::EventIndex,
}

impl Machine {
    fn new(ps: usize, slots: usize, eviction_policy: EvictionPolicies) -> Machine {
        Machine {
            cache: Cache::new(Config {
                eviction_policy,
                page_hashes: true,
                events: true,
                ..Config::kv(slots, ps)
            })
            .unwrap(),
            m: Model {
                ps,
                capacity: slots,
                cached: Pages::new(),
                held: BTreeSet::new(),
                locks: Vec::new(),
                nodes: HashMap::new(),
                dead: Vec::new(),
                dead_set: HashSet::new(),
                empty_root: None,
                history: Vec::new(),
            },
            events: common::EventIndex::default(),
        }
    }

    /// After every step: audit, the index rebuilt from the events == the tree, model ==
    /// tree, sizes exact.
    fn check(&mut self) {
        self.cache.audit().unwrap();
        self.events.check(&mut self.cache);
        assert_pool_sums(&self.cache);
        let ps = self.m.ps;
        let (tree, tree_locks) = tree_pages(&self.cache.snapshot(), ps);
        assert_eq!(tree, self.m.cached, "model and tree disagree");
        let counts = self.m.lock_counts();
        assert_locks("lock count", &tree_locks, &counts, &self.m.cached);
        let protected = self
            .m
            .cached
            .keys()
            .filter(|k| counts.contains_key(*k))
            .count();
        assert_sizes(&self.cache, ps, self.m.cached.len(), protected);
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
            assert_eq!(self.cache.lock_node(&l.receipt), Ok(l.node));
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
                .filter(|j| !after.contains_key(&key(&n.namespace, &n.prefix, start + j * ps)))
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
        let counts = self.m.lock_counts();
        let removed: Vec<Key> = evicted_pages(&self.m.cached, &after, &counts)
            .into_iter()
            .cloned()
            .collect();
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
        self.m.forget_dropped_roots();
        removed
    }

    fn do_match(&mut self, ns: &Ns, toks: &[u32]) -> Match {
        let len = self.m.device_len(ns, toks);
        let kv = cached_slots(&self.m.cached, ns, toks, len, self.m.ps);
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
        if !n.is_multiple_of(ps) {
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
            .map(|(k, s)| (k.clone(), page_of(s, ps)))
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
        let evicted: Vec<i64> = removed.iter().map(|k| tree_before[k]).collect();
        let Some(slots) = r else {
            self.check();
            return None;
        };
        assert!(removed.len() + free_before.len() >= pages);
        assert_eq!(slots.len(), n);
        take_allocated(&slots, ps, &free_before, &evicted, &mut self.m.held);
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

    /// A reset empties the tree when no lock is live (every cached page free, every
    /// node handle but the default root's stale), else fails with `Busy` and changes
    /// nothing.
    fn do_reset(&mut self) {
        if self.m.locks.is_empty() {
            self.cache.reset().unwrap();
            let gone: Vec<Key> = self
                .m
                .nodes
                .keys()
                .filter(|k| !k.1.is_empty())
                .cloned()
                .collect();
            for k in gone {
                if let Some(id) = self.m.nodes.remove(&k) {
                    self.m.dead.push(id);
                    self.m.dead_set.insert(id);
                }
            }
            self.m.cached.clear();
            self.m.forget_dropped_roots();
        } else {
            self.cache.take_events().unwrap(); // the next call releases dropped receipts: this one
            let before = frozen(&self.cache);
            assert!(matches!(self.cache.reset(), Err(Error::Busy(_))));
            assert_eq!(
                frozen(&self.cache),
                before,
                "a refused reset changed something"
            );
        }
        self.check();
    }

    fn do_free(&mut self, bad: Option<BadSlot>, rng: &mut Rng) {
        let ps = self.m.ps;
        let (pages, mut slots) = some_held_slots(&self.m.held, ps, rng);
        let bad_slot = bad.and_then(|b| self.bad_slot(b, rng));
        if let Some(s) = bad_slot {
            let at = rng.below(slots.len() + 1);
            slots.insert(at, s);
        } else {
            // Pages need not be listed in order.
            rng.shuffle(&mut slots);
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
            let (owned_from, pages, kv) =
                valid_insert_args(choice, &mut toks, &tree_kv, &self.m.held, ps, &mut rng);
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
                let k = key(ns, toks, pos + ps);
                assert!(self.m.cached.insert(k, page_slots(p, ps)).is_none());
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
        remember(&mut self.m.history, toks);
        self.check();
    }

    /// Valid-looking caller slots for positions `from..len` (held pages where there are
    /// enough, else any in-range pages: for inserts that must fail before the claim).
    fn any_caller_slots(&self, from: usize, len: usize, rng: &mut Rng) -> Vec<i64> {
        let ps = self.m.ps;
        let k = (len - from).div_ceil(ps);
        let pages = if k <= self.m.held.len() {
            rng.distinct(&self.m.held, k)
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
            (k <= held).then(|| rng.distinct(&self.m.held, k))
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
                    if o.is_multiple_of(ps) {
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
                kv.extend(page_slots(extra, ps));
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
                kv[c * ps..(c + 1) * ps].copy_from_slice(&page_slots(new, ps));
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
        let receipt = self.cache.lock(m.node).unwrap();
        assert!(
            self.m.locks.iter().all(|l| l.receipt.id() != receipt.id()),
            "receipt {} handed out twice",
            receipt.id()
        );
        self.m.locks.push(LiveLock {
            receipt,
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
        self.cache.unlock(l.receipt).unwrap();
        self.check();
    }

    /// A receipt dropped instead of released: the cache's next call releases it.
    fn do_drop_receipt(&mut self, pick: usize) {
        if self.m.locks.is_empty() {
            return self.do_evict(pick % 8);
        }
        let l = self.m.locks.swap_remove(pick % self.m.locks.len());
        drop(l.receipt);
        self.cache.reap();
        self.check();
    }

    /// A receipt of another cache is refused and changes nothing here.
    fn do_unlock_foreign(&mut self) {
        let (mut other, foreign) = foreign_receipt();
        let before = frozen(&self.cache);
        assert!(matches!(self.cache.unlock(foreign), Err(Error::Lock(_))));
        assert_eq!(
            frozen(&self.cache),
            before,
            "a foreign unlock changed something"
        );
        // The refused receipt was released in its own cache.
        other.reap();
        assert_eq!(other.protected_size(), 0);
        other.audit().unwrap();
        self.check();
    }

    fn do_lock_stale(&mut self, pick: usize) {
        if self.m.dead.is_empty() {
            return self.do_evict(pick % 8);
        }
        let id = self.m.dead[pick % self.m.dead.len()];
        let before = frozen(&self.cache);
        assert_eq!(self.cache.lock(id).err(), Some(Error::StaleNode(id)));
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
            Op::DropReceipt { pick } => self.do_drop_receipt(*pick),
            Op::UnlockForeign => self.do_unlock_foreign(),
            Op::LockStale { pick } => self.do_lock_stale(*pick),
            Op::Evict { n } => self.do_evict(*n),
            Op::Reset => self.do_reset(),
        }
        self.m.forget_dropped_roots();
    }
}

proptest! {
    #![proptest_config(proptest_config("proptest-regressions/machine.txt"))]

    #[test]
    fn cache_matches_the_reference_model(
        (ps, slots) in config(),
        policy in eviction_policies(),
        ops in prop::collection::vec(op(), 1..=240),
    ) {
        let mut machine = Machine::new(ps, slots, policy);
        machine.check();
        for op in &ops {
            machine.step(op);
        }
    }
}
