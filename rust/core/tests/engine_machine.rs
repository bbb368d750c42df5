//! State-machine test of [`radixcache_core::Cache`] with engine-owned pools
//! (`pools="engine"`), the engine-mode variants of `machine.rs` (KV only) and
//! `hybrid_machine.rs` (with Mamba states).
//!
//! A model engine allocator holds the free slots (every slot at first), model requests
//! hold what it handed out, and the cache holds the rest in its tree or in its "to free"
//! queue. Proptest generates random sequences of:
//!
//! * engine allocations (pages and state slots move from the model engine to the
//!   requests), and requests giving slots back to the engine without the cache;
//! * inserts of a request's slots: after a match, optionally under a lock of the match
//!   (`owned_from` = the matched length), or all fresh (`owned_from` = 0: the matched
//!   pages are duplicates), with or without a state slot (replaced when the node has
//!   one, queued at an unaligned end). When the engine is short it evicts first, as
//!   an engine's `evict_for_alloc` does, and takes the returned slots;
//! * inserts that must be refused (a slot in the tree, queued, out of range, listed
//!   twice; a state slot in the tree, queued, out of range): `InvalidArgument` naming the
//!   argument, and nothing changes;
//! * matches, locks and unlocks, evictions (KV and states), `take_freed`.
//!
//! After every step: `audit()` passes, and conservation holds on each pool: model
//! engine ∪ requests ∪ tree ∪ queue is every slot, the four disjoint; the tree is read
//! back from `snapshot()` and the queue is the model's (what inserts gave up), equal to
//! the pool's own count and to the `stats()` gauges. Every slot `evict` or `take_freed`
//! hands back is checked to have been the tree's (evict: exactly the pages that left
//! the tree) or the queue's (`take_freed`: exactly the queue), listed once, and goes back
//! to the model engine, which must not hold it already: each slot is handed back
//! exactly once.

// clippy.toml allows unwrap/expect in `#[test]` functions only; in this test crate the
// model's helpers fail the test the same way.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::{BTreeSet, HashMap};

use common::{
    arg_of, assert_pool_sums, eviction_policies, i64_of, ns_of, proptest_config, remember, tail,
    tok_spec_of, Rng, TokSpec, SYSTEM,
};
use proptest::prelude::*;
use radixcache_core::{Cache, Config, EvictionPolicies, LockReceipt, PoolOwner};

#[derive(Debug, Clone, Copy)]
enum Bad {
    KvInTree,
    KvQueued,
    KvOutOfRange,
    KvTwice,
    StateInTree,
    StateQueued,
    StateOutOfRange,
}

#[derive(Debug, Clone)]
enum Op {
    EngineAlloc {
        pages: usize,
        state: bool,
    },
    EngineFree {
        seed: u64,
    },
    Insert {
        ns: bool,
        toks: TokSpec,
        fresh: bool,
        lock: bool,
        state: bool,
        seed: u64,
    },
    BadInsert {
        ns: bool,
        toks: TokSpec,
        bad: Bad,
        seed: u64,
    },
    Match {
        ns: bool,
        toks: TokSpec,
    },
    Lock {
        ns: bool,
        toks: TokSpec,
    },
    Unlock {
        pick: usize,
    },
    Evict {
        kv: usize,
        states: usize,
    },
    TakeFreed,
}

fn tok_spec() -> impl Strategy<Value = TokSpec> {
    tok_spec_of(
        prop_oneof![2 => Just(0u8), 4 => 1u8..=4, 4 => 5u8..=6],
        0.3,
        tail(),
    )
}

fn bad() -> impl Strategy<Value = Bad> {
    prop_oneof![
        Just(Bad::KvInTree),
        Just(Bad::KvQueued),
        Just(Bad::KvOutOfRange),
        Just(Bad::KvTwice),
        Just(Bad::StateInTree),
        Just(Bad::StateQueued),
        Just(Bad::StateOutOfRange),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let ns = || prop::bool::weighted(0.3);
    prop_oneof![
        3 => (0usize..6, any::<bool>()).prop_map(|(pages, state)| Op::EngineAlloc { pages, state }),
        1 => any::<u64>().prop_map(|seed| Op::EngineFree { seed }),
        10 => (ns(), tok_spec(), prop::bool::weighted(0.2), any::<bool>(), any::<bool>(), any::<u64>())
            .prop_map(|(ns, toks, fresh, lock, state, seed)| Op::Insert { ns, toks, fresh, lock, state, seed }),
        2 => (ns(), tok_spec(), bad(), any::<u64>())
            .prop_map(|(ns, toks, bad, seed)| Op::BadInsert { ns, toks, bad, seed }),
        3 => (ns(), tok_spec()).prop_map(|(ns, toks)| Op::Match { ns, toks }),
        2 => (ns(), tok_spec()).prop_map(|(ns, toks)| Op::Lock { ns, toks }),
        2 => any::<usize>().prop_map(|pick| Op::Unlock { pick }),
        3 => (0usize..24, 0usize..4).prop_map(|(kv, states)| Op::Evict { kv, states }),
        2 => Just(Op::TakeFreed),
    ]
}

/// Where each slot of one pool is, by the model (pages for KV, slots for states).
#[derive(Default)]
struct Books {
    /// Free in the model engine's allocator.
    engine: BTreeSet<i64>,
    /// Handed out by the engine to model requests, not given to the cache.
    held: BTreeSet<i64>,
    /// Queued by the cache to go back to the engine.
    queue: BTreeSet<i64>,
}

impl Books {
    fn new(n: usize) -> Books {
        Books {
            engine: (0..i64_of(n)).collect(),
            ..Books::default()
        }
    }

    /// Up to `n` pages from the engine to the requests, in a random order.
    fn alloc(&mut self, n: usize, rng: &mut Rng) -> usize {
        let k = n.min(self.engine.len());
        for p in rng.distinct(&self.engine, k) {
            self.engine.remove(&p);
            self.held.insert(p);
        }
        k
    }

    /// Slots the cache handed back: each must be where `from` says and not the engine's
    /// already (handed back exactly once).
    fn hand_back(&mut self, pages: &[i64], what: &str) {
        for &p in pages {
            assert!(self.engine.insert(p), "{what}: page {p} handed back twice");
        }
    }
}

struct Machine {
    cache: Cache,
    /// A router's index rebuilt from the cache's KV events alone.
    events: common::EventIndex,
    ps: usize,
    kv: Books,
    mamba: Books,
    kv_pages: usize,
    mamba_slots: usize,
    locks: Vec<LockReceipt>,
    history: Vec<Vec<u32>>,
}

/// The tree's KV pages and state slots, read back from `snapshot()`.
fn tree_of(c: &Cache) -> (BTreeSet<i64>, BTreeSet<i64>) {
    let ps = i64_of(c.page_size());
    let mut kv = BTreeSet::new();
    let mut states = BTreeSet::new();
    for n in c.snapshot() {
        for &s in n.kv_indices.iter().flatten() {
            assert!(
                s % ps != 0 || kv.insert(s / ps),
                "page {} twice in the tree",
                s / ps
            );
        }
        if let Some(s) = n.mamba_slot {
            assert!(states.insert(i64::from(s)), "state {s} twice in the tree");
        }
    }
    (kv, states)
}

fn stat(c: &Cache, key: &str) -> u64 {
    c.stats()
        .into_iter()
        .find(|&(k, _)| k == key)
        .map_or_else(|| panic!("no stat {key}"), |(_, v)| v)
}

fn u64_of(n: usize) -> u64 {
    u64::try_from(n).unwrap()
}

impl Machine {
    fn new(
        ps: usize,
        kv_pages: usize,
        mamba_slots: usize,
        eviction_policy: EvictionPolicies,
    ) -> Machine {
        let cache = Cache::new(Config {
            mamba_slots,
            eviction_policy,
            pools: PoolOwner::Engine,
            page_hashes: true,
            events: true,
            ..Config::kv(kv_pages * ps, ps)
        })
        .unwrap();
        Machine {
            cache,
            events: common::EventIndex::default(),
            ps,
            kv: Books::new(kv_pages),
            mamba: Books::new(mamba_slots),
            kv_pages,
            mamba_slots,
            locks: Vec::new(),
            history: Vec::new(),
        }
    }

    fn resolve(&self, t: &TokSpec) -> Vec<u32> {
        t.tokens(match t.base {
            1..=4 => SYSTEM[usize::from(t.base) - 1].to_vec(),
            5 | 6 if !self.history.is_empty() => self.history[t.hist % self.history.len()].clone(),
            _ => Vec::new(),
        })
    }

    /// `audit()`, then conservation on both pools against the tree read back and the
    /// cache's own gauges.
    fn check(&mut self) {
        self.cache.audit().unwrap();
        self.events.check(&mut self.cache);
        assert_pool_sums(&self.cache);
        let (tree_kv, tree_states) = tree_of(&self.cache);
        for (name, books, tree, all) in [
            ("kv", &self.kv, &tree_kv, self.kv_pages),
            ("mamba", &self.mamba, &tree_states, self.mamba_slots),
        ] {
            let parts = [&books.engine, &books.held, tree, &books.queue];
            let total: usize = parts.iter().map(|p| p.len()).sum();
            let union: BTreeSet<i64> = parts.iter().flat_map(|p| p.iter().copied()).collect();
            assert_eq!(
                total, all,
                "{name}: engine + requests + tree + queue != every slot"
            );
            assert_eq!(
                union,
                (0..i64_of(all)).collect(),
                "{name}: the parts overlap"
            );
        }
        let ps = u64_of(self.ps);
        let c = &self.cache;
        assert_eq!(stat(c, "kv_queued_slots"), u64_of(self.kv.queue.len()) * ps);
        assert_eq!(stat(c, "kv_free_slots"), u64_of(self.kv.queue.len()) * ps);
        assert_eq!(c.available_kv(), self.kv.queue.len() * self.ps);
        assert_eq!(
            stat(c, "kv_engine_slots"),
            u64_of(self.kv.engine.len() + self.kv.held.len()) * ps
        );
        assert_eq!(c.kv_pool().counts().tree, tree_kv.len());
        assert_eq!(
            stat(c, "mamba_queued_slots"),
            u64_of(self.mamba.queue.len())
        );
        assert_eq!(c.available_mamba(), self.mamba.queue.len());
        assert_eq!(
            stat(c, "mamba_engine_slots"),
            u64_of(self.mamba.engine.len() + self.mamba.held.len())
        );
        assert_eq!(c.mamba_pool().counts().tree, tree_states.len());
    }

    /// Evicts, checks that what it returned is exactly what left the tree (each slot
    /// once), and gives it to the model engine.
    fn evict(&mut self, kv_tokens: usize, states: usize) {
        let (kv_before, states_before) = tree_of(&self.cache);
        let out = self.cache.evict(kv_tokens, states);
        let (kv_after, states_after) = tree_of(&self.cache);
        let ps = i64_of(self.ps);
        assert_eq!(out.kv_indices.len() % self.ps, 0);
        let mut pages = Vec::new();
        for page in out.kv_indices.chunks(self.ps) {
            assert!(page
                .iter()
                .zip(page[0]..)
                .all(|(&a, b)| a == b && page[0] % ps == 0));
            pages.push(page[0] / ps);
        }
        let returned: BTreeSet<i64> = pages.iter().copied().collect();
        assert_eq!(
            returned.len(),
            pages.len(),
            "a page returned twice: {pages:?}"
        );
        assert_eq!(
            returned,
            kv_before.difference(&kv_after).copied().collect(),
            "evict returns exactly the pages that left the tree"
        );
        assert!(kv_after.is_subset(&kv_before));
        assert_eq!(
            out.kv_tokens,
            out.kv_indices.len(),
            "no write-back: freed at once"
        );
        let states: BTreeSet<i64> = out.mamba_slots.iter().copied().collect();
        assert_eq!(states.len(), out.mamba_slots.len());
        assert_eq!(
            states,
            states_before.difference(&states_after).copied().collect(),
            "evict returns exactly the states that left the tree"
        );
        assert_eq!(out.mamba_states, states.len());
        self.kv.hand_back(&pages, "evict");
        self.mamba.hand_back(&out.mamba_slots, "evict");
    }

    fn do_take_freed(&mut self) {
        let (kv, states) = self.cache.take_freed();
        let ps = i64_of(self.ps);
        let mut pages = Vec::new();
        for page in kv.chunks(self.ps) {
            assert!(page
                .iter()
                .zip(page[0]..)
                .all(|(&a, b)| a == b && page[0] % ps == 0));
            pages.push(page[0] / ps);
        }
        let got: BTreeSet<i64> = pages.iter().copied().collect();
        assert_eq!(got.len(), pages.len(), "a queued page handed back twice");
        assert_eq!(
            got, self.kv.queue,
            "take_freed hands back exactly the queue"
        );
        let got: BTreeSet<i64> = states.iter().copied().collect();
        assert_eq!(got.len(), states.len());
        assert_eq!(got, self.mamba.queue);
        self.kv.queue.clear();
        self.mamba.queue.clear();
        self.kv.hand_back(&pages, "take_freed");
        self.mamba.hand_back(&states, "take_freed");
        assert_eq!(
            self.cache.take_freed(),
            (vec![], vec![]),
            "handed back once"
        );
    }

    /// `n` pages for a request: what it holds, then the engine's, evicting for the rest
    /// (as `evict_for_alloc`). `None` when even that does not do.
    fn pages_for(&mut self, n: usize, rng: &mut Rng) -> Option<Vec<i64>> {
        if self.kv.held.len() + self.kv.engine.len() < n {
            let short = n - self.kv.held.len() - self.kv.engine.len();
            self.evict(short * self.ps, 0);
        }
        if self.kv.held.len() < n {
            let more = n - self.kv.held.len();
            self.kv.alloc(more, rng);
        }
        (self.kv.held.len() >= n).then(|| rng.distinct(&self.kv.held, n))
    }

    fn state_for(&mut self, rng: &mut Rng) -> Option<i64> {
        if self.mamba_slots == 0 {
            return None;
        }
        if self.mamba.held.is_empty() && self.mamba.engine.is_empty() {
            self.evict(0, 1);
        }
        if self.mamba.held.is_empty() {
            self.mamba.alloc(1, rng);
        }
        rng.pick(&self.mamba.held.iter().copied().collect::<Vec<_>>())
    }

    #[allow(clippy::fn_params_excessive_bools)]
    fn do_insert(
        &mut self,
        ns: bool,
        toks: &[u32],
        fresh: bool,
        lock: bool,
        state: bool,
        seed: u64,
    ) {
        let mut rng = Rng(seed);
        let ns = ns_of(ns);
        let ps = self.ps;
        let m = self.cache.match_prefix(ns.as_deref(), toks);
        // Locked, the matched prefix cannot be evicted to make room for the rest.
        let receipt = (lock && m.device_len > 0).then(|| self.cache.lock(m.node).unwrap());
        let want_from = if fresh { 0 } else { m.device_len };
        if self
            .pages_for((toks.len() - want_from).div_ceil(ps), &mut rng)
            .is_none()
        {
            return self.release(receipt);
        }
        let slot = if state {
            self.state_for(&mut rng)
        } else {
            None
        };
        // Unlocked, the evictions may have taken part of the match: match again.
        let m = self.cache.match_prefix(ns.as_deref(), toks);
        let owned_from = if fresh { 0 } else { m.device_len };
        let need = (toks.len() - owned_from).div_ceil(ps);
        if self.kv.held.len() < need {
            self.kv.alloc(need - self.kv.held.len(), &mut rng);
        }
        if self.kv.held.len() < need {
            return self.release(receipt);
        }
        let pages = rng.distinct(&self.kv.held, need);
        let mut kv = m.kv_indices[..owned_from].to_vec();
        kv.extend(slots_of(&pages, owned_from, toks.len(), ps));
        let (tree_kv, tree_states) = tree_of(&self.cache);
        let ins = self
            .cache
            .insert_with_state(ns.as_deref(), toks, &kv, owned_from, slot)
            .unwrap();
        let (kv_after, states_after) = tree_of(&self.cache);
        assert!(
            tree_kv.is_subset(&kv_after),
            "an insert removed pages from the tree"
        );
        assert!(tree_states.is_subset(&states_after));
        let passed: BTreeSet<i64> = pages.iter().copied().collect();
        assert!(
            kv_after.difference(&tree_kv).all(|p| passed.contains(p)),
            "only the passed pages join the tree"
        );
        for &p in &pages {
            assert!(self.kv.held.remove(&p));
            if !kv_after.contains(&p) {
                assert!(self.kv.queue.insert(p), "page {p} queued twice");
            }
        }
        // Every whole page of the sequence is cached now.
        let aligned = toks.len() / ps * ps;
        assert_eq!(self.cache.match_prefix(ns.as_deref(), toks).kv_len, aligned);
        if let Some(s) = slot {
            assert!(self.mamba.held.remove(&s));
            let kept = states_after.contains(&s);
            // A state sits only at a node's end: the end of a whole page, not the root.
            let fits = !toks.is_empty() && toks.len().is_multiple_of(ps);
            assert_eq!(kept, fits && !ins.mamba_existed, "{ins:?}");
            if !kept {
                assert!(self.mamba.queue.insert(s), "state {s} queued twice");
            }
        }
        remember(&mut self.history, toks);
        self.release(receipt);
    }

    fn release(&mut self, receipt: Option<LockReceipt>) {
        if let Some(r) = receipt {
            self.cache.unlock(r).unwrap();
        }
    }

    /// An insert with one slot that is not the engine's: refused, naming the argument,
    /// and nothing changes.
    fn do_bad_insert(&mut self, ns: bool, toks: &[u32], bad: Bad, seed: u64) {
        let mut rng = Rng(seed);
        let ps = self.ps;
        let (tree_kv, tree_states) = tree_of(&self.cache);
        let toks = if toks.len() < ps {
            vec![0; ps]
        } else {
            toks.to_vec()
        };
        let need = toks.len().div_ceil(ps);
        if self.kv.held.len() < need {
            self.kv.alloc(need - self.kv.held.len(), &mut rng);
        }
        if self.kv.held.len() < need {
            return;
        }
        let mut pages = rng.distinct(&self.kv.held, need);
        let pick =
            |set: &BTreeSet<i64>, rng: &mut Rng| rng.pick(&set.iter().copied().collect::<Vec<_>>());
        let mut state = None;
        let arg = match bad {
            Bad::KvInTree | Bad::KvQueued | Bad::KvOutOfRange | Bad::KvTwice => {
                let p = match bad {
                    Bad::KvInTree => pick(&tree_kv, &mut rng),
                    Bad::KvQueued => pick(&self.kv.queue, &mut rng),
                    Bad::KvOutOfRange => Some(i64_of(self.kv_pages)),
                    _ => (pages.len() > 1).then(|| pages[0]),
                };
                let Some(p) = p else { return };
                let at = rng.below(pages.len());
                if matches!(bad, Bad::KvTwice) && at == 0 {
                    pages[1] = p;
                } else {
                    pages[at] = p;
                }
                "kv_indices"
            }
            _ if self.mamba_slots == 0 => return,
            Bad::StateInTree | Bad::StateQueued | Bad::StateOutOfRange => {
                state = match bad {
                    Bad::StateInTree => pick(&tree_states, &mut rng),
                    Bad::StateQueued => pick(&self.mamba.queue, &mut rng),
                    _ => Some(i64_of(self.mamba_slots)),
                };
                if state.is_none() {
                    return;
                }
                "mamba_slot"
            }
        };
        let kv = slots_of(&pages, 0, toks.len(), ps);
        let before = (
            self.cache.snapshot(),
            self.cache.kv_pool().counts(),
            self.cache.mamba_pool().counts(),
        );
        let got = self
            .cache
            .insert_with_state(ns_of(ns).as_deref(), &toks, &kv, 0, state);
        assert_eq!(arg_of(got), arg);
        let after = (
            self.cache.snapshot(),
            self.cache.kv_pool().counts(),
            self.cache.mamba_pool().counts(),
        );
        assert_eq!(after, before, "a refused insert changed something");
    }

    fn step(&mut self, op: &Op) {
        match op {
            Op::EngineAlloc { pages, state } => {
                let mut rng = Rng(u64_of(*pages));
                self.kv.alloc(*pages, &mut rng);
                if *state {
                    self.mamba.alloc(1, &mut rng);
                }
            }
            Op::EngineFree { seed } => {
                let mut rng = Rng(*seed);
                for books in [&mut self.kv, &mut self.mamba] {
                    let k = rng.below(books.held.len() + 1);
                    for p in rng.distinct(&books.held, k) {
                        books.held.remove(&p);
                        books.engine.insert(p);
                    }
                }
            }
            Op::Insert {
                ns,
                toks,
                fresh,
                lock,
                state,
                seed,
            } => {
                let t = self.resolve(toks);
                self.do_insert(*ns, &t, *fresh, *lock, *state, *seed);
            }
            Op::BadInsert {
                ns,
                toks,
                bad,
                seed,
            } => {
                let t = self.resolve(toks);
                self.do_bad_insert(*ns, &t, *bad, *seed);
            }
            Op::Match { ns, toks } => {
                let t = self.resolve(toks);
                let m = self.cache.match_prefix(ns_of(*ns).as_deref(), &t);
                let (tree_kv, tree_states) = tree_of(&self.cache);
                let ps = i64_of(self.ps);
                assert!(m.kv_indices.iter().all(|s| tree_kv.contains(&(s / ps))));
                assert!(m
                    .mamba_slot
                    .is_none_or(|s| tree_states.contains(&i64::from(s))));
            }
            Op::Lock { ns, toks } => {
                let t = self.resolve(toks);
                let m = self.cache.match_prefix(ns_of(*ns).as_deref(), &t);
                self.locks.push(self.cache.lock(m.node).unwrap());
            }
            Op::Unlock { pick } => {
                if !self.locks.is_empty() {
                    let r = self.locks.swap_remove(pick % self.locks.len());
                    self.cache.unlock(r).unwrap();
                }
            }
            Op::Evict { kv, states } => self.evict(*kv, *states),
            Op::TakeFreed => self.do_take_freed(),
        }
        self.check();
    }

    /// Unlocks everything, evicts everything and takes the queue: every slot is the
    /// engine's or a request's again.
    fn drain(&mut self) {
        for r in std::mem::take(&mut self.locks) {
            self.cache.unlock(r).unwrap();
        }
        self.evict(usize::MAX, usize::MAX);
        self.do_take_freed();
        self.check();
        assert_eq!(self.kv.engine.len() + self.kv.held.len(), self.kv_pages);
        assert_eq!(
            self.mamba.engine.len() + self.mamba.held.len(),
            self.mamba_slots
        );
        let counts: HashMap<&str, u64> = self.cache.stats().into_iter().collect();
        assert_eq!(counts["kv_cached_tokens"], 0);
    }
}

/// Slots for positions `from..len`, one page per chunk of `ps` positions.
fn slots_of(pages: &[i64], from: usize, len: usize, ps: usize) -> Vec<i64> {
    common::caller_slots(pages, from, len, ps)
}

fn kv_config() -> impl Strategy<Value = (usize, usize)> {
    (prop_oneof![Just(1usize), Just(2), Just(4)], 4usize..=16)
}

proptest! {
    #![proptest_config(proptest_config("proptest-regressions/engine_machine.txt"))]

    #[test]
    fn engine_owned_kv_pools_conserve_every_slot(
        (ps, pages) in kv_config(),
        policy in eviction_policies(),
        ops in prop::collection::vec(op(), 1..=200),
    ) {
        let mut machine = Machine::new(ps, pages, 0, policy);
        machine.check();
        for op in &ops {
            machine.step(op);
        }
        machine.drain();
    }

    #[test]
    fn engine_owned_hybrid_pools_conserve_every_slot(
        (ps, pages) in kv_config(),
        states in 1usize..=8,
        policy in eviction_policies(),
        ops in prop::collection::vec(op(), 1..=200),
    ) {
        let mut machine = Machine::new(ps, pages, states, policy);
        machine.check();
        for op in &ops {
            machine.step(op);
        }
        machine.drain();
    }
}
