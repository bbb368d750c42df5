//! State-machine test of [`radixcache_core::Cache`] with a Mamba state pool: the
//! request-level API, transfer batches and the low-level calls, interleaved.
//!
//! Proptest generates random sequences of `admit`, `extend` (from the admitted prompt or
//! random tokens), `checkpoint`, `finish`, `abort` (also as a dropped handle), calls on
//! finished or aborted requests, `take_batches`, `start` / `complete` / `fail` (also of
//! unknown or acknowledged batch ids), `match_prefix`, `insert_with_state` (with a held
//! state slot, none, or a bad one), `alloc_kv` / `free_kv`, `alloc_mamba` / `free_mamba`
//! (good and bad), `lock` / `unlock` (also stale nodes, receipts dropped unreleased and
//! receipts of another cache) and `evict`,
//! over page sizes 1, 2 and 4, 16..64 KV slots and 2..6 state slots (so that state and KV
//! pressure are high), two namespaces, a small alphabet and shared "system prompts".
//!
//! A reference model holds the tree's content (every cached page-prefix with its slots,
//! every state with its slot), the live requests (tokens, reused prefix, own KV pages,
//! own state slot, pending admission copy, receipt), the batches in flight (what they
//! copy, what they pin), the caller's slots and lock receipts. It predicts, independently
//! of the cache:
//!
//! * every `Match` exactly (`kv_len`: the page-aligned KV match; `device_len`: the
//!   deepest node end on it with a state; its slots and state);
//! * every `insert_with_state` exactly (`prefix_len`, new pages, freed duplicates and
//!   tail, where the state lands or that it is freed, `mamba_existed`), and that a bad
//!   state slot fails with `mamba_slot` and changes nothing (the KV claim is undone);
//! * request views after every step (`prefix_len`, `len`, `branch_len`, the node, the
//!   state slot, `copy_pending`, `request_tokens`, every entry of `request_kv_indices`);
//! * what `checkpoint` and `finish` publish (pages the tree lacks, duplicates freed, the
//!   lock moved to the end node or released, the state donated or freed), which
//!   checkpoint emits a copy, and which finish loses its turn's end state
//!   (`finish_states_lost`: an unaligned length, no state at its last whole page and no
//!   checkpoint copy on its way there);
//! * every batch `take_batches` returns (ids in order, kind `cow`, one device-to-device
//!   Mamba copy from the matched state / the request's slot to the new slot), and what
//!   `complete` and `fail` do (a checkpoint state published on its node if that node is
//!   still there without a state; a failed admission copy resets the request);
//! * whether `admit`, `extend`, `alloc_kv`, `alloc_mamba` and a checkpoint's state copy
//!   succeed, that they evict nothing when the pool has room, that what they hand out
//!   was free or just evicted, and that a refusal leaves no evictable state behind;
//! * every failing call (`Error::Request`, `InvalidArgument`, `Lock`, `StaleNode`) and
//!   that it changes nothing (snapshot, pool counts, stats, request views).
//!
//! After every step: `audit()` passes; the tree read back from `snapshot()` equals the
//! model (pages, slots, states) with the model's lock and state-lock counts; sizes and
//! free counts are exact; the state of every KV page and every state slot in its pool
//! (free, owned by a request or a batch, held by the caller, the tree's, or draining
//! because a batch in flight pins it) is exactly what the model says, so the counts add
//! up to the capacity; `live_requests`, `batches_in_flight` and `live_locks` agree.
//!
//! Each case runs under one eviction policy (`eviction_policy=` one name for both
//! components). The state order of "lru", "lfu" and "priority" is modelled: a state is
//! used when it is placed and when a match reuses it (only that state, not the others
//! on the path), and counts the matches that used it. Every eviction of states alone
//! (`evict(0, m)`, and the state slot of `alloc_mamba`, `admit`, `checkpoint` and of an
//! `extend` that needs no KV eviction) must take exactly the predicted states; under
//! "state-value" (values the model does not compute; `audit()` checks every key) as
//! many unlocked, unpinned states as predicted. The KV order is not modelled: any eviction is read back and checked for legality: nothing
//! locked goes, whole nodes go (or the lower part of a node the same call split), KV is
//! taken with its extensions, a node's state goes with its KV, a removed state whose node
//! stays leaves a locked or internal node (tombstone), removing a leaf never leaves its
//! parent as an unlocked leaf without a state, and `evict` reports what went.
//!
//! Each case ends with a teardown (complete every batch, finish or abort every request,
//! release every receipt and slot, evict everything) after which both pools are
//! entirely free. 256 cases of 1..=200 operations (~25,000 steps). Failures are saved
//! to `proptest-regressions/hybrid_machine.txt` and replayed first.

// clippy.toml allows unwrap/expect in `#[test]` functions only; in this test crate the
// model's helpers fail the test the same way.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use common::{
    add_lock, arg_of, assert_locks, assert_pool_sums, assert_sizes, batch_id, cached_len,
    cached_slots, evicted_pages, extensions, foreign_receipt, i64_of, key, ns_of, page_of,
    page_slots, proptest_config, remember, some_held_slots, tail, take_allocated, tok_spec_of,
    tree_pages, valid_insert_args, Key, Ns, OwnedFrom, Pages, Rng, TokSpec, SYSTEM,
};
use proptest::prelude::*;
use radixcache_core::{
    BatchId, BatchKind, Cache, Config, Error, EvictionPolicies, EvictionPolicy, LockReceipt, Match,
    NodeId, NodeInfo, PageState, PoolCounts, PoolKind, RequestId, RequestView, SlotCopy, Tier,
    TransferBatch,
};
/// Longest a request grows (prompt and generated tokens).
const MAX_REQUEST: usize = 24;
/// Live requests at most: an admit beyond this finishes one instead.
const MAX_LIVE: usize = 4;

// ---------------------------------------------------------------------------------------
// Operations

/// A state slot the caller does not hold, by its pool state.
#[derive(Debug, Clone, Copy)]
enum BadState {
    Free,
    Tree,
    Owned,
    Draining,
    OutOfRange,
    Negative,
}

#[derive(Debug, Clone, Copy)]
enum StateArg {
    None,
    Held,
    Bad(BadState),
}

/// A KV slot the caller does not hold, by its pool state.
#[derive(Debug, Clone, Copy)]
enum BadKv {
    Free,
    Tree,
    Owned,
    OutOfRange,
    Negative,
}

#[derive(Debug, Clone)]
enum Op {
    Admit {
        ns: bool,
        toks: TokSpec,
        take: bool,
    },
    /// `at_branch`: a prompt chunk stops at the branch point and is checkpointed there.
    Extend {
        pick: usize,
        from_prompt: bool,
        at_branch: bool,
        n: usize,
        tail: Vec<u32>,
    },
    /// A decode step: one token each for the requests `picks` select (`fault` 1: one of
    /// them twice, 2: one token short; both refused with nothing changed).
    ExtendBatch {
        picks: Vec<usize>,
        seed: u32,
        fault: u8,
    },
    Checkpoint {
        pick: usize,
        take: bool,
    },
    Finish {
        pick: usize,
    },
    /// `dropped`: as a handle dropped while live would (the same call).
    Abort {
        pick: usize,
        dropped: bool,
    },
    Stale {
        pick: usize,
        call: u8,
    },
    Take,
    Ack {
        pick: usize,
        start: bool,
        fail: bool,
    },
    BadAck {
        pick: usize,
        call: u8,
        unknown: bool,
    },
    Match {
        ns: bool,
        toks: TokSpec,
    },
    Insert {
        ns: bool,
        toks: TokSpec,
        owned: OwnedFrom,
        state: StateArg,
        seed: u64,
    },
    AllocKv {
        pages: usize,
        extra: usize,
    },
    FreeKv {
        bad: Option<BadKv>,
        seed: u64,
    },
    AllocMamba,
    FreeMamba {
        bad: Option<BadState>,
        seed: u64,
    },
    Lock {
        ns: bool,
        toks: TokSpec,
        recent: Option<usize>,
    },
    Unlock {
        pick: usize,
    },
    DropReceipt {
        pick: usize,
    },
    UnlockForeign,
    Evict {
        kv: usize,
        mamba: usize,
    },
    /// `expect` with these prompts, soonest first (none: the marks are cleared).
    Expect {
        prompts: Vec<(bool, TokSpec)>,
    },
}

/// `base`: 0: none, 1..=4: a system prompt, 5..=6: an earlier sequence, 7..=8: where a
/// cached state is (else an earlier sequence).
fn tok_spec() -> impl Strategy<Value = TokSpec> {
    tok_spec_of(
        prop_oneof![2 => Just(0u8), 4 => 1u8..=4, 2 => 5u8..=6, 3 => 7u8..=8],
        0.3,
        tail(),
    )
}

/// Prompts for `admit`: mostly a system prompt or an earlier sequence, often exactly
/// (so that a cached state at its end is reused), else with a short continuation.
fn prompt_spec() -> impl Strategy<Value = TokSpec> {
    tok_spec_of(
        prop_oneof![1 => Just(0u8), 3 => 1u8..=4, 2 => 5u8..=6, 6 => 7u8..=8],
        0.15,
        prop_oneof![
            2 => Just(Vec::new()),
            3 => prop::collection::vec(0u32..4, 1..8),
        ],
    )
}

/// The named namespace less often than the default one, so that prefixes are shared.
fn ns() -> impl Strategy<Value = bool> {
    prop::bool::weighted(0.25)
}

fn bad_state() -> impl Strategy<Value = BadState> {
    prop_oneof![
        Just(BadState::Free),
        Just(BadState::Tree),
        Just(BadState::Owned),
        Just(BadState::Draining),
        Just(BadState::OutOfRange),
        Just(BadState::Negative),
    ]
}

fn bad_kv() -> impl Strategy<Value = BadKv> {
    prop_oneof![
        Just(BadKv::Free),
        Just(BadKv::Tree),
        Just(BadKv::Owned),
        Just(BadKv::OutOfRange),
        Just(BadKv::Negative),
    ]
}

fn owned_from() -> impl Strategy<Value = OwnedFrom> {
    prop_oneof![
        3 => Just(OwnedFrom::Full),
        1 => Just(OwnedFrom::Zero),
        1 => Just(OwnedFrom::Mid),
    ]
}

fn state_arg() -> impl Strategy<Value = StateArg> {
    prop_oneof![
        2 => Just(StateArg::None),
        5 => Just(StateArg::Held),
        2 => bad_state().prop_map(StateArg::Bad),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        14 => (ns(), prompt_spec(), prop::bool::weighted(0.75))
            .prop_map(|(ns, toks, take)| Op::Admit { ns, toks, take }),
        22 => (
            any::<usize>(),
            prop::bool::weighted(0.75),
            prop::bool::weighted(0.7),
            0usize..=6,
            prop::collection::vec(0u32..4, 0..=6)
        )
            .prop_map(|(pick, from_prompt, at_branch, n, tail)| Op::Extend {
                pick,
                from_prompt,
                at_branch,
                n,
                tail
            }),
        8 => (
            prop::collection::vec(any::<usize>(), 1..=4),
            any::<u32>(),
            prop_oneof![8 => Just(0u8), 1 => Just(1u8), 1 => Just(2u8)]
        )
            .prop_map(|(picks, seed, fault)| Op::ExtendBatch { picks, seed, fault }),
        6 => (any::<usize>(), any::<bool>()).prop_map(|(pick, take)| Op::Checkpoint { pick, take }),
        7 => any::<usize>().prop_map(|pick| Op::Finish { pick }),
        4 => (any::<usize>(), any::<bool>()).prop_map(|(pick, dropped)| Op::Abort { pick, dropped }),
        2 => (any::<usize>(), 0u8..7).prop_map(|(pick, call)| Op::Stale { pick, call }),
        3 => Just(Op::Take),
        12 => (any::<usize>(), any::<bool>(), prop::bool::weighted(0.25))
            .prop_map(|(pick, start, fail)| Op::Ack { pick, start, fail }),
        2 => (any::<usize>(), 0u8..3, any::<bool>())
            .prop_map(|(pick, call, unknown)| Op::BadAck { pick, call, unknown }),
        4 => (ns(), tok_spec()).prop_map(|(ns, toks)| Op::Match { ns, toks }),
        7 => (ns(), tok_spec(), owned_from(), state_arg(), any::<u64>()).prop_map(
            |(ns, toks, owned, state, seed)| Op::Insert {
                ns,
                toks,
                owned,
                state,
                seed
            }
        ),
        3 => (0usize..5, prop_oneof![5 => Just(0usize), 1 => 1usize..4])
            .prop_map(|(pages, extra)| Op::AllocKv { pages, extra }),
        3 => (prop::option::weighted(0.3, bad_kv()), any::<u64>())
            .prop_map(|(bad, seed)| Op::FreeKv { bad, seed }),
        3 => Just(Op::AllocMamba),
        3 => (prop::option::weighted(0.4, bad_state()), any::<u64>())
            .prop_map(|(bad, seed)| Op::FreeMamba { bad, seed }),
        3 => (ns(), tok_spec(), prop::option::weighted(0.3, any::<usize>()))
            .prop_map(|(ns, toks, recent)| Op::Lock { ns, toks, recent }),
        3 => any::<usize>().prop_map(|pick| Op::Unlock { pick }),
        1 => any::<usize>().prop_map(|pick| Op::DropReceipt { pick }),
        1 => Just(Op::UnlockForeign),
        3 => (
            prop_oneof![3 => 0usize..8, 1 => 0usize..72],
            prop_oneof![2 => Just(0usize), 2 => 1usize..3, 1 => 3usize..8]
        )
            .prop_map(|(kv, mamba)| Op::Evict { kv, mamba }),
        3 => prop::collection::vec((ns(), prompt_spec()), 0..=4)
            .prop_map(|prompts| Op::Expect { prompts }),
    ]
}

/// (page size, KV slots, state slots).
fn config() -> impl Strategy<Value = (usize, usize, usize)> {
    (
        prop_oneof![Just(1usize), Just(2), Just(4)],
        16usize..=64,
        2usize..=6,
    )
        .prop_map(|(ps, slots, mamba)| (ps, slots / ps * ps, mamba))
}

/// The states an eviction must take: exactly `keys`, or (under state-value, whose
/// values the model does not compute) as many of the `candidates`.
struct Victims {
    keys: BTreeSet<Key>,
    candidates: BTreeSet<Key>,
    exact: bool,
    policy: EvictionPolicy,
}

impl Victims {
    /// No state eviction.
    fn none() -> Victims {
        Victims {
            keys: BTreeSet::new(),
            candidates: BTreeSet::new(),
            exact: true,
            policy: EvictionPolicy::Lru,
        }
    }

    fn check(&self, removed: &BTreeSet<Key>, call: &str) {
        if self.exact {
            assert_eq!(removed, &self.keys, "{call} evicted ({})", self.policy);
        } else {
            assert_eq!(
                removed.len(),
                self.keys.len(),
                "{call} evicted ({})",
                self.policy
            );
            assert!(
                removed.is_subset(&self.candidates),
                "{call} evicted a state that was no candidate ({})",
                self.policy
            );
        }
    }
}

// ---------------------------------------------------------------------------------------
// Helpers

fn u32_of(x: usize) -> u32 {
    u32::try_from(x).unwrap()
}

fn usize_of(x: u32) -> usize {
    usize::try_from(x).unwrap()
}

fn is_request_err<T: std::fmt::Debug>(r: &Result<T, Error>) -> bool {
    matches!(r, Err(Error::Request(_)))
}

fn tally(states: &[PageState]) -> PoolCounts {
    let mut c = PoolCounts::default();
    for s in states {
        match s {
            PageState::Free => c.free += 1,
            PageState::Owned => c.owned += 1,
            PageState::Caller => c.caller += 1,
            PageState::Tree => c.tree += 1,
            PageState::Draining => c.draining += 1,
        }
    }
    c
}

fn stat(cache: &Cache, name: &str) -> u64 {
    cache
        .stats()
        .into_iter()
        .find(|&(k, _)| k == name)
        .map(|(_, v)| v)
        .unwrap()
}

/// Whether a page-prefix or node end extending `k` by one page is in `pages`.
fn has_child(pages: &Pages, k: &Key, ps: usize) -> bool {
    extensions(pages, k).any(|e| e.1.len() == k.1.len() + ps)
}

/// The tree's content: what the model predicts and `snapshot()` is compared with.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Content {
    /// Every cached page-prefix and the slots of its last page.
    pages: Pages,
    /// Every node end with a device state, and its slot.
    states: BTreeMap<Key, u32>,
}

/// The tree as read back from `snapshot()`.
#[derive(Default)]
struct Read {
    content: Content,
    /// Lock count per page-prefix (its node's).
    kv_lock: HashMap<Key, u32>,
    /// State lock count per state.
    mamba_lock: HashMap<Key, u32>,
    /// Every live node (roots too) and where it ends.
    ids: HashMap<NodeId, Key>,
    /// Where the non-root nodes end.
    ends: HashSet<Key>,
}

fn read(cache: &Cache, ps: usize) -> Read {
    let snapshot = cache.snapshot();
    let (pages, kv_lock) = tree_pages(&snapshot, ps);
    let mut r = Read {
        content: Content {
            pages,
            states: BTreeMap::new(),
        },
        kv_lock,
        ..Read::default()
    };
    for n in snapshot {
        let end: Key = (n.namespace.clone(), n.prefix.clone());
        r.ids.insert(n.id, end.clone());
        if n.prefix.is_empty() {
            assert_eq!(n.mamba_slot, None, "a root has a state");
            continue;
        }
        if let Some(s) = n.mamba_slot {
            r.content.states.insert(end.clone(), s);
            r.mamba_lock.insert(end.clone(), n.mamba_lock);
        } else {
            assert_eq!(n.mamba_lock, 0, "node {} has a state lock, no state", n.id);
        }
        r.ends.insert(end);
    }
    r
}

/// Everything a call that fails must leave as it was.
#[derive(Debug, PartialEq, Eq)]
struct Frozen {
    snapshot: Vec<NodeInfo>,
    kv: PoolCounts,
    mamba: PoolCounts,
    stats: Vec<(&'static str, u64)>,
    requests: Vec<(RequestView, Vec<u32>, Vec<i64>)>,
}

/// What an eviction removed (read back).
#[derive(Default)]
struct Removed {
    /// KV pages (page numbers).
    pages: Vec<i64>,
    /// State slots.
    states: Vec<u32>,
    /// Where those states were.
    state_keys: BTreeSet<Key>,
}

impl Removed {
    fn is_empty(&self) -> bool {
        self.pages.is_empty() && self.states.is_empty()
    }
}

// ---------------------------------------------------------------------------------------
// The reference model

struct Req {
    id: RequestId,
    ns: Ns,
    /// The tokens it was admitted for (`extend` feeds the rest of them).
    prompt: Vec<u32>,
    tokens: Vec<u32>,
    prefix_len: usize,
    branch_len: usize,
    /// KV pages for `tokens[prefix_len..]`.
    own: Vec<i64>,
    mamba: Option<u32>,
    /// Slots a failed copy took from it (API: held until the request ends).
    retired_kv: Vec<i64>,
    retired_mamba: Vec<u32>,
    cow: Option<BatchId>,
    /// The receipt on `tokens[..prefix_len]`, if any, and whether it holds that state.
    lock: Option<bool>,
    /// What a reader that kept its reads has: the epoch, the slots and the tokens.
    read: (Option<u64>, Vec<i64>, Vec<u32>),
}

#[derive(Debug, Clone, Copy)]
enum BatchFor {
    Admit(RequestId),
    Checkpoint(NodeId),
}

struct Pending {
    what: BatchFor,
    src: u32,
    dst: u32,
    taken: bool,
}

struct Receipt {
    held: LockReceipt,
    key: Key,
    mamba: bool,
    node: NodeId,
}

struct Model {
    ps: usize,
    kv_pages: usize,
    mamba_cap: usize,
    content: Content,
    held_kv: BTreeSet<i64>,
    held_mamba: BTreeSet<u32>,
    reqs: Vec<Req>,
    dead_reqs: Vec<RequestId>,
    batches: BTreeMap<BatchId, Pending>,
    acked: Vec<BatchId>,
    next_batch: u64,
    receipts: Vec<Receipt>,
    recent_nodes: Vec<NodeId>,
    history: Vec<Vec<u32>>,
    /// When each state was last used (placed, or reused by a match), and whether a
    /// match has used it since it was placed: the Mamba eviction order.
    used: HashMap<Key, (u64, bool)>,
    /// Matches that used each state since it was placed.
    hits: HashMap<Key, u64>,
    clock: u64,
    /// The policy of both components (string form: KV keeps "lru" under state-value).
    policy: EvictionPolicy,
    /// `expect` marked nodes: eviction passes over them and a checkpoint may be let go
    /// by, which the model does not compute (the order is the unit tests'), so it checks
    /// only that victims are candidates.
    expecting: bool,
    /// Finishes that lost their turn's end state (`stats()["finish_states_lost"]`).
    states_lost: u64,
}

impl Model {
    fn resolve(&self, ns: &Ns, t: &TokSpec) -> Vec<u32> {
        let states: Vec<&Key> = self.content.states.keys().filter(|k| k.0 == *ns).collect();
        t.tokens(match t.base {
            1..=4 => SYSTEM[usize::from(t.base) - 1].to_vec(),
            7 | 8 if !states.is_empty() => states[t.hist % states.len()].1.clone(),
            5..=8 if !self.history.is_empty() => self.history[t.hist % self.history.len()].clone(),
            _ => Vec::new(),
        })
    }

    fn remember_node(&mut self, id: NodeId) {
        self.recent_nodes.push(id);
        if self.recent_nodes.len() > 8 {
            self.recent_nodes.remove(0);
        }
    }

    /// The longest page-aligned prefix of `toks` whose every page-prefix is cached.
    fn kv_match(&self, ns: &Ns, toks: &[u32]) -> usize {
        cached_len(&self.content.pages, ns, toks, self.ps)
    }

    /// (`device_len`, `kv_len`, state at `device_len`) of a match.
    fn predict_match(&self, ns: &Ns, toks: &[u32]) -> (usize, usize, Option<u32>) {
        let kv_len = self.kv_match(ns, toks);
        let mut dl = kv_len;
        while dl > 0 {
            if let Some(&s) = self.content.states.get(&key(ns, toks, dl)) {
                return (dl, kv_len, Some(s));
            }
            dl -= self.ps;
        }
        (0, kv_len, None)
    }

    fn slots(&self, ns: &Ns, toks: &[u32], len: usize) -> Vec<i64> {
        cached_slots(&self.content.pages, ns, toks, len, self.ps)
    }

    /// Live receipts (the test's and the requests') per page-prefix, and state locks.
    fn locks(&self) -> (HashMap<Key, u32>, HashMap<Key, u32>) {
        let mut kv = HashMap::new();
        let mut mamba = HashMap::new();
        let mut add = |k: &Key, m: bool| {
            add_lock(&mut kv, &k.0, &k.1, self.ps);
            if m {
                *mamba.entry(k.clone()).or_insert(0) += 1;
            }
        };
        for l in &self.receipts {
            add(&l.key, l.mamba);
        }
        for q in &self.reqs {
            if let Some(m) = q.lock {
                add(&key(&q.ns, &q.tokens, q.prefix_len), m);
            }
        }
        (kv, mamba)
    }

    /// Every state slot a batch in flight pins (its source and destination).
    fn pinned(&self) -> HashSet<u32> {
        self.batches.values().flat_map(|b| [b.src, b.dst]).collect()
    }

    /// The expected state of every KV page.
    fn kv_expect(&self) -> Vec<PageState> {
        let mut v = vec![PageState::Free; self.kv_pages];
        let mut put = |p: i64, st: PageState| {
            let p = usize::try_from(p).unwrap();
            assert_eq!(
                v[p],
                PageState::Free,
                "kv page {p} is {:?} and {st:?}",
                v[p]
            );
            v[p] = st;
        };
        for &p in &self.held_kv {
            put(p, PageState::Caller);
        }
        for q in &self.reqs {
            for &p in q.own.iter().chain(&q.retired_kv) {
                put(p, PageState::Owned);
            }
        }
        for s in self.content.pages.values() {
            put(page_of(s, self.ps), PageState::Tree);
        }
        v
    }

    /// The expected state of every state slot.
    fn mamba_expect(&self) -> Vec<PageState> {
        let mut v = vec![PageState::Free; self.mamba_cap];
        let mut put = |s: u32, st: PageState| {
            let s = usize_of(s);
            assert_eq!(
                v[s],
                PageState::Free,
                "state slot {s} is {:?} and {st:?}",
                v[s]
            );
            v[s] = st;
        };
        for &s in &self.held_mamba {
            put(s, PageState::Caller);
        }
        for q in &self.reqs {
            for &s in q.mamba.iter().chain(&q.retired_mamba) {
                put(s, PageState::Owned);
            }
        }
        for b in self.batches.values() {
            if let BatchFor::Checkpoint(_) = b.what {
                put(b.dst, PageState::Owned);
            }
        }
        for &s in self.content.states.values() {
            put(s, PageState::Tree);
        }
        for s in self.pinned() {
            if v[usize_of(s)] == PageState::Free {
                v[usize_of(s)] = PageState::Draining;
            }
        }
        v
    }

    fn free_kv(&self) -> BTreeSet<i64> {
        (0..)
            .zip(self.kv_expect())
            .filter(|(_, s)| *s == PageState::Free)
            .map(|(p, _)| p)
            .collect()
    }

    fn slots_in(&self, want: PageState) -> Vec<u32> {
        (0..)
            .zip(self.mamba_expect())
            .filter(|(_, s)| *s == want)
            .map(|(p, _)| p)
            .collect()
    }

    fn unlocked_pages(&self) -> usize {
        let (kv, _) = self.locks();
        self.content
            .pages
            .keys()
            .filter(|k| !kv.contains_key(*k))
            .count()
    }

    /// Whether one state slot can be had now, evicting if need be: a free one, or an
    /// unlocked tree state that no batch pins (evicting a pinned one only drains it).
    /// `also_locked`: a state the call itself holds meanwhile.
    fn obtainable(&self, also_locked: Option<&Key>) -> bool {
        if !self.slots_in(PageState::Free).is_empty() {
            return true;
        }
        let (_, ml) = self.locks();
        let pinned = self.pinned();
        self.content
            .states
            .iter()
            .any(|(k, s)| !ml.contains_key(k) && Some(k) != also_locked && !pinned.contains(s))
    }

    /// A state is used: placed on a node (`hit == false`), or reused by a match.
    fn use_state(&mut self, k: &Key, hit: bool) {
        assert!(self.content.states.contains_key(k));
        self.clock += 1;
        self.used.insert(k.clone(), (self.clock, hit));
        *self.hits.entry(k.clone()).or_default() += u64::from(hit);
    }

    fn place_state(&mut self, k: &Key, slot: u32) {
        assert!(self.content.states.insert(k.clone(), slot).is_none());
        self.hits.insert(k.clone(), 0);
        self.use_state(k, false);
    }

    /// The states a state eviction takes, in the policy's order among the unlocked ones
    /// that no batch pins (evicting a pinned one would only leave its slot draining;
    /// `also_locked`: a state the call holds meanwhile): `Some(m)`: `m` of them
    /// (`evict(0, m)`); `None`: an allocation's eviction when no slot is free, which
    /// takes one, and nothing when there is none.
    fn state_victims(&self, also_locked: Option<&Key>, count: Option<usize>) -> Victims {
        let (_, ml) = self.locks();
        let pinned = self.pinned();
        // "lru": unused states first, then used ones, each oldest first; but the oldest
        // used one first while more used states than the protected cap are candidates.
        // "lfu": fewest matches first; "priority" (every priority is 0 here): unused
        // first, then used, each oldest first.
        let mut used: Vec<((u64, u64), &Key)> = vec![];
        let mut unused: Vec<((u64, u64), &Key)> = vec![];
        for (k, s) in &self.content.states {
            if ml.contains_key(k) || Some(k) == also_locked || pinned.contains(s) {
                continue;
            }
            let (time, hit) = self.used[k];
            let rank = match self.policy {
                EvictionPolicy::Lfu => self.hits[k],
                _ => 0,
            };
            let uncapped = self.policy != EvictionPolicy::Lru;
            if hit && !uncapped {
                &mut used
            } else {
                &mut unused
            }
            .push(((rank, u64::from(hit) << 62 | time), k));
        }
        let candidates: BTreeSet<Key> = used
            .iter()
            .chain(&unused)
            .map(|(_, k)| (*k).clone())
            .collect();
        used.sort_unstable_by(|a, b| b.cmp(a));
        unused.sort_unstable_by(|a, b| b.cmp(a));
        let n = match count {
            Some(m) => m.min(used.len() + unused.len()),
            None if !self.slots_in(PageState::Free).is_empty() => 0,
            None => 1.min(used.len() + unused.len()),
        };
        let cap = self.mamba_cap * 3 / 4;
        let mut keys = BTreeSet::new();
        for _ in 0..n {
            let next = if used.len() > cap || unused.is_empty() {
                used.pop()
            } else {
                unused.pop()
            };
            keys.extend(next.map(|(_, k)| k.clone()));
        }
        Victims {
            keys,
            candidates,
            exact: self.policy != EvictionPolicy::StateValue && !self.expecting,
            policy: self.policy,
        }
    }

    fn req_index(&self, id: RequestId) -> Option<usize> {
        self.reqs.iter().position(|q| q.id == id)
    }

    /// `cache_request` on request `i`: caches its whole pages the tree lacks (the others
    /// are duplicates, freed), and its reused prefix becomes every whole page. Returns
    /// the aligned length and where it ends.
    fn publish_request(&mut self, i: usize) -> (usize, Key) {
        let ps = self.ps;
        let q = &self.reqs[i];
        let aligned = q.tokens.len() / ps * ps;
        let give = (aligned - q.prefix_len) / ps;
        let mut new = Vec::new();
        for c in 0..give {
            let pos = q.prefix_len + c * ps;
            let k = key(&q.ns, &q.tokens, pos + ps);
            if !self.content.pages.contains_key(&k) {
                new.push((k, page_slots(q.own[c], ps)));
            }
        }
        let end = key(&q.ns, &q.tokens, aligned);
        self.content.pages.extend(new);
        let q = &mut self.reqs[i];
        q.own.drain(..give);
        q.prefix_len = aligned;
        (aligned, end)
    }
}

// ---------------------------------------------------------------------------------------
// The machine

struct Machine {
    cache: Cache,
    m: Model,
    /// A router's index rebuilt from the cache's KV events alone.
    events: common::EventIndex,
    /// The tree as read at the end of the last step.
    read: Read,
}

impl Machine {
    fn new(ps: usize, kv_slots: usize, mamba_slots: usize, policy: EvictionPolicy) -> Machine {
        Machine {
            cache: Cache::new(Config {
                kv_slots,
                page_size: ps,
                mamba_slots,
                eviction_policy: EvictionPolicies::uniform(policy),
                page_hashes: true,
                events: true,
                ..Config::default()
            })
            .unwrap(),
            events: common::EventIndex::default(),
            m: Model {
                ps,
                kv_pages: kv_slots / ps,
                mamba_cap: mamba_slots,
                content: Content::default(),
                held_kv: BTreeSet::new(),
                held_mamba: BTreeSet::new(),
                reqs: Vec::new(),
                dead_reqs: Vec::new(),
                batches: BTreeMap::new(),
                acked: Vec::new(),
                next_batch: 0,
                receipts: Vec::new(),
                recent_nodes: Vec::new(),
                history: Vec::new(),
                used: HashMap::new(),
                hits: HashMap::new(),
                clock: 0,
                policy,
                expecting: false,
                states_lost: 0,
            },
            read: Read::default(),
        }
    }

    fn frozen(&self) -> Frozen {
        Frozen {
            snapshot: self.cache.snapshot(),
            kv: self.cache.kv_counts(),
            mamba: self.cache.mamba_counts(),
            stats: self.cache.stats(),
            requests: self
                .m
                .reqs
                .iter()
                .map(|q| {
                    (
                        self.cache.request(q.id).unwrap(),
                        self.cache.request_tokens(q.id).unwrap(),
                        self.cache.request_kv_indices(q.id).unwrap(),
                    )
                })
                .collect(),
        }
    }

    /// After every step: audit, model == tree, locks, sizes, every slot's pool state,
    /// request views, gauges.
    #[allow(clippy::too_many_lines)]
    fn check(&mut self) {
        self.cache.audit().unwrap();
        self.events.check(&mut self.cache);
        assert_pool_sums(&self.cache);
        let retired = self.m.reqs.iter().fold((0, 0), |(k, s), q| {
            (k + q.retired_kv.len(), s + q.retired_mamba.len())
        });
        // Handed out and not ended: the taken batches of the model (all `cow`).
        let listed: Vec<(BatchId, bool)> = self
            .cache
            .pending_batches()
            .into_iter()
            .map(|(id, kind, started)| {
                assert_eq!(kind, BatchKind::Cow);
                (id, started)
            })
            .collect();
        let taken: Vec<(BatchId, bool)> = self
            .m
            .batches
            .iter()
            .filter(|(_, b)| b.taken)
            .map(|(&id, _)| (id, self.cache.started(id) == Some(true)))
            .collect();
        assert_eq!(listed, taken, "pending_batches");
        let stats: HashMap<&str, u64> = self.cache.stats().into_iter().collect();
        assert_eq!(
            (stats["kv_retired_slots"], stats["mamba_retired_slots"]),
            ((retired.0 * self.m.ps) as u64, retired.1 as u64),
            "retired slots"
        );
        let ps = self.m.ps;
        let r = read(&self.cache, ps);
        assert_eq!(
            r.content.pages, self.m.content.pages,
            "model and tree pages disagree"
        );
        assert_eq!(
            r.content.states, self.m.content.states,
            "model and tree states disagree"
        );
        assert!(
            self.m.used.len() == r.content.states.len()
                && r.content.states.keys().all(|k| self.m.used.contains_key(k)),
            "the model's LRU times lost track of the states"
        );
        let (kvl, ml) = self.m.locks();
        assert_locks("lock count", &r.kv_lock, &kvl, &r.content.pages);
        assert_locks("state lock", &r.mamba_lock, &ml, &r.content.states);
        let protected = r
            .content
            .pages
            .keys()
            .filter(|k| kvl.contains_key(*k))
            .count();
        assert_sizes(&self.cache, ps, r.content.pages.len(), protected);
        // Protected: held by a receipt, or pinned by a batch (in flight).
        let pinned = self.m.pinned();
        let pstates = r
            .content
            .states
            .iter()
            .filter(|(k, s)| ml.contains_key(*k) || pinned.contains(s))
            .count();
        assert_eq!(self.cache.protected_states(), pstates, "protected_states");
        assert_eq!(
            self.cache.evictable_states(),
            r.content.states.len() - pstates,
            "evictable_states"
        );

        // Every slot of both pools, and conservation.
        let kv = self.m.kv_expect();
        for (p, want) in (0..).zip(&kv) {
            assert_eq!(self.cache.kv_pool().state(p), Some(*want), "kv page {p}");
        }
        let kc = tally(&kv);
        assert_eq!(self.cache.kv_counts(), kc, "kv_counts");
        assert_eq!(
            kc.free + kc.owned + kc.caller + kc.tree + kc.draining,
            self.m.kv_pages
        );
        assert_eq!(kc.draining, 0, "a KV page is draining");
        assert_eq!(self.cache.available_kv(), kc.free * ps, "available_kv");
        let st = self.m.mamba_expect();
        for (s, want) in (0..).zip(&st) {
            assert_eq!(
                self.cache.mamba_pool().state(s),
                Some(*want),
                "state slot {s}"
            );
        }
        let mc = tally(&st);
        assert_eq!(self.cache.mamba_counts(), mc, "mamba_counts");
        assert_eq!(
            mc.free + mc.owned + mc.caller + mc.tree + mc.draining,
            self.m.mamba_cap
        );
        assert_eq!(self.cache.available_mamba(), mc.free, "available_mamba");

        // Requests.
        for q in &self.m.reqs {
            let v = self.cache.request(q.id).unwrap();
            assert_eq!(
                v,
                RequestView {
                    prefix_len: q.prefix_len,
                    host_len: 0,
                    branch_len: q.branch_len,
                    len: q.tokens.len(),
                    mamba_slot: q.mamba,
                    node: v.node,
                    copy_pending: q.cow,
                    load_pending: None,
                },
                "request {}",
                q.id
            );
            assert!(q.prefix_len % ps == 0 && q.prefix_len <= q.tokens.len());
            assert!(q.lock.is_some() || q.prefix_len == 0);
            assert_eq!(
                r.ids.get(&v.node),
                Some(&key(&q.ns, &q.tokens, q.prefix_len)),
                "request {}'s node",
                q.id
            );
            assert_eq!(self.cache.request_tokens(q.id).unwrap(), q.tokens);
            assert_eq!(
                q.own.len(),
                (q.tokens.len() - q.prefix_len).div_ceil(ps),
                "request {}'s pages",
                q.id
            );
            let mut want = self.m.slots(&q.ns, &q.tokens, q.prefix_len);
            for &p in &q.own {
                want.extend(page_slots(p, ps));
            }
            want.truncate(q.tokens.len());
            assert_eq!(
                self.cache.request_kv_indices(q.id).unwrap(),
                want,
                "request {}'s kv_indices",
                q.id
            );
        }
        self.check_incremental_reads();
        for &id in &self.m.dead_reqs {
            assert!(!self.cache.request_live(id));
        }
        let locks = self.m.receipts.len() + self.m.reqs.iter().filter(|q| q.lock.is_some()).count();
        assert_eq!(
            stat(&self.cache, "live_requests"),
            self.m.reqs.len() as u64,
            "live_requests"
        );
        assert_eq!(
            stat(&self.cache, "batches_in_flight"),
            self.m.batches.len() as u64,
            "batches_in_flight"
        );
        assert_eq!(stat(&self.cache, "live_locks"), locks as u64, "live_locks");
        for l in &self.m.receipts {
            assert_eq!(self.cache.lock_node(&l.held), Ok(l.node));
            if l.key.1.is_empty() && !r.ids.contains_key(&l.node) {
                continue; // held on the shared empty root
            }
            assert_eq!(
                r.ids.get(&l.node),
                Some(&l.key),
                "receipt {}'s node",
                l.held.id()
            );
        }
        for id in self.m.batches.keys() {
            assert!(
                self.cache.started(*id).is_some(),
                "batch {id} is not in flight"
            );
        }
        self.read = r;
    }

    /// Reads the tree back after a call that may evict, checks that the eviction was
    /// legal and moves the model to it. `hold`: locks (and whether they hold the
    /// state) the call itself held meanwhile; `split`: whether the call may have split
    /// a node before evicting (a match or a publish).
    fn absorb(&mut self, hold: &[(Key, bool)], split: bool) -> Removed {
        let ps = self.m.ps;
        let after = read(&self.cache, ps);
        for (k, s) in &after.content.states {
            assert_eq!(
                self.m.content.states.get(k),
                Some(s),
                "state at {k:?} appeared or moved"
            );
        }
        let (mut kvl, mut ml) = self.m.locks();
        for (k, m) in hold {
            add_lock(&mut kvl, &k.0, &k.1, ps);
            if *m {
                *ml.entry(k.clone()).or_insert(0) += 1;
            }
        }
        let before = &self.m.content;
        let gone = evicted_pages(&before.pages, &after.content.pages, &kvl);
        for &k in &gone {
            assert!(
                !after.content.states.contains_key(k),
                "the state at {k:?} outlived its KV"
            );
            let parent = key(&k.0, &k.1, k.1.len() - ps);
            if !parent.1.is_empty() && after.content.pages.contains_key(&parent) {
                assert!(
                    split || self.read.ends.contains(&parent),
                    "eviction took part of a node: {k:?} but not {parent:?}"
                );
                assert!(
                    after.content.states.contains_key(&parent)
                        || kvl.contains_key(&parent)
                        || has_child(&after.content.pages, &parent, ps),
                    "evicting {k:?} left {parent:?} an unlocked leaf without a state"
                );
            }
        }
        let mut removed = Removed {
            pages: gone
                .iter()
                .map(|k| page_of(&before.pages[*k], ps))
                .collect(),
            states: Vec::new(),
            state_keys: BTreeSet::new(),
        };
        for (k, &s) in &before.states {
            if after.content.states.contains_key(k) {
                continue;
            }
            assert!(!ml.contains_key(k), "evicted the locked state at {k:?}");
            if after.content.pages.contains_key(k) {
                assert!(
                    kvl.contains_key(k) || has_child(&after.content.pages, k, ps),
                    "tombstoned the state of an unlocked leaf {k:?} instead of removing it"
                );
            }
            removed.states.push(s);
            removed.state_keys.insert(k.clone());
        }
        for k in &removed.state_keys {
            self.m.used.remove(k);
            self.m.hits.remove(k);
        }
        self.m.content = after.content;
        self.read.ends = after.ends;
        removed
    }

    /// A reader that keeps what it read and asks only for what is new
    /// (`request_slots_from`, `request_tokens_from`) ends up with the full answer; while
    /// the epoch is unchanged it is given only the tail.
    fn check_incremental_reads(&mut self) {
        for q in &mut self.m.reqs {
            let (epoch, slots, toks) = &mut q.read;
            let g = self
                .cache
                .request_slots_from(q.id, *epoch, slots.len())
                .unwrap();
            let t = self
                .cache
                .request_tokens_from(q.id, *epoch, toks.len())
                .unwrap();
            assert_eq!((g.epoch, t.epoch), (t.epoch, g.epoch));
            if *epoch == Some(g.epoch) {
                assert_eq!(
                    (g.start, t.start),
                    (slots.len(), toks.len()),
                    "only the tail"
                );
            }
            slots.truncate(g.start);
            slots.extend(g.items);
            toks.truncate(t.start);
            toks.extend(t.items);
            *epoch = Some(g.epoch);
            assert_eq!(
                *toks, q.tokens,
                "request {}'s tokens, read as they grew",
                q.id
            );
            assert_eq!(
                *slots,
                self.cache.request_kv_indices(q.id).unwrap(),
                "request {}'s kv_indices, read as they grew",
                q.id
            );
        }
    }

    // ----- low level ---------------------------------------------------------------

    fn do_match(&mut self, ns: &Ns, toks: &[u32]) -> Match {
        let (dl, kl, slot) = self.m.predict_match(ns, toks);
        let kv = self.m.slots(ns, toks, dl);
        let r = self.cache.match_prefix(ns.as_deref(), toks);
        assert_eq!(
            (r.device_len, r.kv_len, r.mamba_slot),
            (dl, kl, slot),
            "match of {ns:?} {toks:?}"
        );
        assert_eq!(r.kv_indices, kv, "kv_indices of {ns:?} {toks:?}");
        assert_eq!(r.host_len, 0);
        assert_eq!(r.host_node, r.node);
        if slot.is_some() {
            self.m.use_state(&key(ns, toks, dl), true);
        }
        self.check();
        let root_of_ns = (ns.clone(), Vec::new());
        if self.read.ids.values().any(|k| *k == root_of_ns) {
            assert_eq!(
                self.read.ids.get(&r.node),
                Some(&key(ns, toks, dl)),
                "match node"
            );
        } else {
            // A namespace that holds nothing has no root: the shared empty root answers.
            assert_eq!(dl, 0);
            assert!(!self.read.ids.contains_key(&r.node), "{:?}", r.node);
            assert!(self.cache.describe(r.node).unwrap().ends_with("root"));
        }
        self.m.remember_node(r.node);
        r
    }

    fn do_alloc_kv(&mut self, n: usize) {
        let ps = self.m.ps;
        if !n.is_multiple_of(ps) {
            let before = self.frozen();
            assert_eq!(arg_of(self.cache.alloc_kv(n)), "n");
            assert_eq!(self.frozen(), before, "a bad alloc_kv changed something");
            return self.check();
        }
        let pages = n / ps;
        let free = self.m.free_kv();
        let evictable = self.m.unlocked_pages();
        let r = self.cache.alloc_kv(n).unwrap();
        let removed = self.absorb(&[], false);
        assert_eq!(
            r.is_some(),
            free.len() + evictable >= pages,
            "alloc_kv({n}) with {} free and {evictable} evictable pages",
            free.len()
        );
        if free.len() >= pages || r.is_none() {
            assert!(removed.is_empty(), "alloc_kv({n}) evicted needlessly");
        }
        if let Some(slots) = r {
            assert_eq!(slots.len(), n);
            take_allocated(&slots, ps, &free, &removed.pages, &mut self.m.held_kv);
        }
        self.check();
    }

    /// A slot of a KV page in `want` state (or out of range when there is none).
    fn bad_kv_slot(&self, kind: BadKv, rng: &mut Rng) -> i64 {
        let ps = self.m.ps;
        let oor = i64_of(self.m.kv_pages * ps + rng.below(2 * ps + 1));
        let want = match kind {
            BadKv::Free => PageState::Free,
            BadKv::Tree => PageState::Tree,
            BadKv::Owned => PageState::Owned,
            BadKv::OutOfRange => return oor,
            BadKv::Negative => return -1 - i64_of(rng.below(ps + 1)),
        };
        let pages: Vec<i64> = (0..)
            .zip(self.m.kv_expect())
            .filter(|(_, s)| *s == want)
            .map(|(p, _)| p)
            .collect();
        rng.pick(&pages)
            .map_or(oor, |p| p * i64_of(ps) + i64_of(rng.below(ps)))
    }

    fn do_free_kv(&mut self, bad: Option<BadKv>, rng: &mut Rng) {
        let ps = self.m.ps;
        let (pages, mut slots) = some_held_slots(&self.m.held_kv, ps, rng);
        rng.shuffle(&mut slots);
        if let Some(kind) = bad {
            let s = self.bad_kv_slot(kind, rng);
            let at = rng.below(slots.len() + 1);
            slots.insert(at, s);
            let before = self.frozen();
            assert_eq!(arg_of(self.cache.free_kv(&slots)), "indices", "{kind:?}");
            assert_eq!(self.frozen(), before, "a bad free_kv changed something");
        } else {
            assert_eq!(self.cache.free_kv(&slots).unwrap(), pages.len() * ps);
            for p in pages {
                self.m.held_kv.remove(&p);
            }
        }
        self.check();
    }

    fn do_alloc_mamba(&mut self) {
        let ok = self.m.obtainable(None);
        let free = self.m.slots_in(PageState::Free);
        let pinned = self.m.pinned();
        let victims = self.m.state_victims(None, None);
        let r = self.cache.alloc_mamba().unwrap();
        let removed = self.absorb(&[], false);
        victims.check(&removed.state_keys, "alloc_mamba");
        assert_eq!(r.is_some(), ok, "alloc_mamba");
        if !free.is_empty() {
            assert!(removed.is_empty(), "alloc_mamba evicted with a free slot");
        }
        match r {
            None => assert!(removed.is_empty(), "a refused alloc_mamba evicted"),
            Some(s) => {
                assert!(
                    free.contains(&s) || (removed.states.contains(&s) && !pinned.contains(&s)),
                    "alloc_mamba returned slot {s}, neither free nor evicted"
                );
                assert!(self.m.held_mamba.insert(s));
            }
        }
        self.check();
    }

    /// A state slot in the given pool state (out of range when there is none).
    fn bad_state_slot(&self, kind: BadState, rng: &mut Rng) -> i64 {
        let oor = i64_of(self.m.mamba_cap + rng.below(3));
        let want = match kind {
            BadState::Free => PageState::Free,
            BadState::Tree => PageState::Tree,
            BadState::Owned => PageState::Owned,
            BadState::Draining => PageState::Draining,
            BadState::OutOfRange => return oor,
            BadState::Negative => return -1 - i64_of(rng.below(3)),
        };
        rng.pick(&self.m.slots_in(want)).map_or(oor, i64::from)
    }

    fn do_free_mamba(&mut self, bad: Option<BadState>, rng: &mut Rng) {
        if let Some(kind) = bad {
            let s = self.bad_state_slot(kind, rng);
            let before = self.frozen();
            assert_eq!(arg_of(self.cache.free_mamba(s)), "slot", "{kind:?} {s}");
            assert_eq!(self.frozen(), before, "a bad free_mamba changed something");
        } else {
            let held: Vec<u32> = self.m.held_mamba.iter().copied().collect();
            let Some(s) = rng.pick(&held) else {
                return self.do_alloc_mamba();
            };
            self.cache.free_mamba(i64::from(s)).unwrap();
            self.m.held_mamba.remove(&s);
        }
        self.check();
    }

    /// Makes sure the caller holds enough pages for an insert of `len` tokens.
    fn ensure_held(&mut self, len: usize) {
        let want = len.div_ceil(self.m.ps);
        if self.m.held_kv.len() < want {
            self.do_alloc_kv((want - self.m.held_kv.len()) * self.m.ps);
        }
    }

    fn do_insert(
        &mut self,
        ns: &Ns,
        mut toks: Vec<u32>,
        owned: OwnedFrom,
        arg: StateArg,
        seed: u64,
    ) {
        let mut rng = Rng(seed);
        let ps = self.m.ps;
        // Everything that may evict comes before the match whose slots are passed.
        self.ensure_held(toks.len());
        if matches!(arg, StateArg::Held) && self.m.held_mamba.is_empty() {
            self.do_alloc_mamba();
        }
        let m = self.do_match(ns, &toks);
        let (owned_from, pages, kv) = valid_insert_args(
            owned,
            &mut toks,
            &m.kv_indices,
            &self.m.held_kv,
            ps,
            &mut rng,
        );
        let len = toks.len();
        let slot = match arg {
            StateArg::None => None,
            StateArg::Held => {
                let held: Vec<u32> = self.m.held_mamba.iter().copied().collect();
                rng.pick(&held).map(i64::from)
            }
            StateArg::Bad(kind) => {
                let s = self.bad_state_slot(kind, &mut rng);
                let before = self.frozen();
                let r =
                    self.cache
                        .insert_with_state(ns.as_deref(), &toks, &kv, owned_from, Some(s));
                assert_eq!(arg_of(r), "mamba_slot", "{kind:?} {s}");
                assert_eq!(self.frozen(), before, "a bad insert changed something");
                return self.check();
            }
        };
        // The prediction.
        let matched = self.m.kv_match(ns, &toks);
        let aligned = len / ps * ps;
        for (c, &p) in pages.iter().enumerate() {
            let pos = owned_from + c * ps;
            assert!(self.m.held_kv.remove(&p));
            if pos >= matched && pos + ps <= aligned {
                self.m
                    .content
                    .pages
                    .insert(key(ns, &toks, pos + ps), page_slots(p, ps));
            }
        }
        let end = key(ns, &toks, aligned);
        let mut existed = false;
        if let Some(s) = slot {
            let s = u32::try_from(s).unwrap();
            assert!(self.m.held_mamba.remove(&s));
            if aligned > 0 && aligned == len {
                if self.m.content.states.contains_key(&end) {
                    existed = true;
                } else {
                    self.m.place_state(&end, s);
                }
            }
        }
        let r = self
            .cache
            .insert_with_state(ns.as_deref(), &toks, &kv, owned_from, slot)
            .unwrap();
        assert_eq!(
            (r.prefix_len, r.mamba_existed),
            (matched, existed),
            "insert_with_state({ns:?}, {toks:?}, {kv:?}, {owned_from}, {slot:?})"
        );
        self.check();
        if end.1.is_empty() && !self.read.ids.values().any(|k| *k == end) {
            // Nothing cached in a namespace that holds nothing: the shared empty root.
            assert!(self.cache.describe(r.node).unwrap().ends_with("root"));
        } else {
            assert_eq!(self.read.ids.get(&r.node), Some(&end), "insert node");
        }
        self.m.remember_node(r.node);
        remember(&mut self.m.history, &toks);
    }

    fn do_lock(&mut self, ns: &Ns, toks: &[u32], recent: Option<usize>) {
        let node = match recent {
            Some(i) if !self.m.recent_nodes.is_empty() => {
                self.m.recent_nodes[i % self.m.recent_nodes.len()]
            }
            _ => self.do_match(ns, toks).node,
        };
        // The shared empty root (the answer for a namespace that holds nothing) is no
        // node of the snapshot, but a live one: locking it protects nothing.
        let empty_root = !self.read.ids.contains_key(&node)
            && self.cache.describe(node).is_ok_and(|d| d.ends_with("root"));
        let known = self.read.ids.get(&node).cloned();
        if let Some(k) = known.or_else(|| empty_root.then(|| (ns.clone(), Vec::new()))) {
            let mamba = self.m.content.states.contains_key(&k);
            let receipt = self.cache.lock(node).unwrap();
            assert!(
                self.m.receipts.iter().all(|l| l.held.id() != receipt.id()),
                "receipt {} handed out twice",
                receipt.id()
            );
            self.m.receipts.push(Receipt {
                held: receipt,
                key: k,
                mamba,
                node,
            });
        } else {
            let before = self.frozen();
            assert_eq!(self.cache.lock(node).err(), Some(Error::StaleNode(node)));
            assert_eq!(self.frozen(), before, "a stale lock changed something");
        }
        self.check();
    }

    fn do_unlock(&mut self, pick: usize) {
        if self.m.receipts.is_empty() {
            return self.do_evict(pick % 8, pick % 3);
        }
        let l = self.m.receipts.swap_remove(pick % self.m.receipts.len());
        self.cache.unlock(l.held).unwrap();
        self.check();
    }

    /// A receipt dropped instead of released: the cache's next call releases it.
    fn do_drop_receipt(&mut self, pick: usize) {
        if self.m.receipts.is_empty() {
            return self.do_evict(pick % 8, pick % 3);
        }
        let l = self.m.receipts.swap_remove(pick % self.m.receipts.len());
        drop(l.held);
        self.cache.reap();
        self.check();
    }

    /// A receipt of another cache is refused and changes nothing here.
    fn do_unlock_foreign(&mut self) {
        let (_other, foreign) = foreign_receipt();
        let before = self.frozen();
        assert!(matches!(self.cache.unlock(foreign), Err(Error::Lock(_))));
        assert_eq!(self.frozen(), before, "a foreign unlock changed something");
        self.check();
    }

    fn do_evict(&mut self, kv: usize, mamba: usize) {
        let ps = self.m.ps;
        let evictable = self.m.unlocked_pages() * ps;
        let (_, ml) = self.m.locks();
        let pinned = self.m.pinned();
        let states = self
            .m
            .content
            .states
            .iter()
            .filter(|(k, s)| !ml.contains_key(*k) && !pinned.contains(s))
            .count();
        let victims = self.m.state_victims(None, Some(mamba));
        let r = self.cache.evict(kv, mamba);
        let removed = self.absorb(&[], false);
        if kv == 0 {
            victims.check(&removed.state_keys, &format!("evict(0, {mamba})"));
        }
        assert_eq!(
            r.kv_tokens,
            removed.pages.len() * ps,
            "evict reported {r:?}"
        );
        assert_eq!(r.mamba_states, removed.states.len(), "evict reported {r:?}");
        assert!(
            r.kv_tokens >= kv.min(evictable),
            "evict({kv}, {mamba}): {r:?}"
        );
        assert!(
            r.mamba_states >= mamba.min(states),
            "evict({kv}, {mamba}): {r:?}"
        );
        if r.kv_tokens < kv {
            assert_eq!(self.cache.evictable_size(), 0);
        }
        if r.mamba_states < mamba {
            // What is left unlocked is pinned by a batch (not evicted: it would drain).
            let (_, ml) = self.m.locks();
            let mut left = self
                .m
                .content
                .states
                .iter()
                .filter(|(k, _)| !ml.contains_key(*k));
            assert!(left.all(|(_, s)| pinned.contains(s)));
            assert_eq!(self.cache.evictable_states(), 0);
        }
        if kv == 0 && mamba == 0 {
            assert!(removed.is_empty());
        }
        self.check();
    }

    // ----- batches -----------------------------------------------------------------

    fn expected_batch(&self, id: BatchId) -> TransferBatch {
        let b = &self.m.batches[&id];
        TransferBatch {
            id,
            kind: BatchKind::Cow,
            copies: vec![SlotCopy {
                pool: PoolKind::Mamba,
                src_tier: Tier::Device,
                dst_tier: Tier::Device,
                src: vec![i64::from(b.src)],
                dst: vec![i64::from(b.dst)],
            }],
            keys: Vec::new(),
        }
    }

    fn do_take(&mut self) {
        let want: Vec<TransferBatch> = self
            .m
            .batches
            .iter()
            .filter(|(_, b)| !b.taken)
            .map(|(&id, _)| self.expected_batch(id))
            .collect();
        let got = self.cache.take_batches();
        assert_eq!(got, want, "take_batches");
        for b in self.m.batches.values_mut() {
            b.taken = true;
        }
        self.check();
    }

    fn do_ack(&mut self, pick: usize, start: bool, fail: bool) {
        if self.m.batches.is_empty() {
            return self.do_take();
        }
        // Mostly batches that were taken; untaken ones may be acknowledged too.
        let taken: Vec<BatchId> = self
            .m
            .batches
            .iter()
            .filter(|(_, b)| b.taken)
            .map(|(&id, _)| id)
            .collect();
        let all: Vec<BatchId> = self.m.batches.keys().copied().collect();
        let from = if taken.is_empty() || pick.is_multiple_of(5) {
            &all
        } else {
            &taken
        };
        let id = from[(pick / 5) % from.len()];
        if start {
            self.cache.start(id).unwrap();
            assert_eq!(self.cache.started(id), Some(true));
            self.check();
        }
        let b = self.m.batches.remove(&id).unwrap();
        match (b.what, fail) {
            (BatchFor::Admit(req), false) => {
                self.cache.complete(id).unwrap();
                if let Some(i) = self.m.req_index(req) {
                    let expecting = self.m.expecting;
                    let q = &mut self.m.reqs[i];
                    if q.cow == Some(id) {
                        q.cow = None;
                        // Its own copy landed: with a queue told of, the node's state
                        // leaves its lock.
                        if let Some(m) = q.lock.as_mut().filter(|_| expecting) {
                            *m = false;
                        }
                    }
                }
            }
            (BatchFor::Admit(req), true) => {
                self.cache.fail(id).unwrap();
                if let Some(i) = self.m.req_index(req) {
                    let q = &mut self.m.reqs[i];
                    if q.cow == Some(id) {
                        // docs/contract.md rule 10: back to nothing reused.
                        q.cow = None;
                        q.tokens.clear();
                        q.prefix_len = 0;
                        q.branch_len = 0;
                        // Its slots stay its own until it ends: a forward pass may
                        // have been queued on them.
                        q.retired_kv.append(&mut q.own);
                        q.retired_mamba.extend(q.mamba.take());
                        // It holds its namespace's root now (no state there).
                        q.lock = Some(false);
                    }
                }
            }
            (BatchFor::Checkpoint(node), false) => {
                self.cache.complete(id).unwrap();
                if let Some(k) = self.read.ids.get(&node) {
                    if !self.m.content.states.contains_key(k) {
                        self.m.place_state(k, b.dst);
                    }
                }
            }
            (BatchFor::Checkpoint(_), true) => self.cache.fail(id).unwrap(),
        }
        assert_eq!(self.cache.started(id), None);
        self.m.acked.push(id);
        self.check();
        if let (BatchFor::Admit(req), true) = (b.what, fail) {
            if self.cache.request_live(req) {
                let v = self.cache.request(req).unwrap();
                assert_eq!((v.prefix_len, v.len, v.mamba_slot), (0, 0, None));
            }
        }
    }

    fn do_bad_ack(&mut self, pick: usize, call: u8, unknown: bool) {
        let id = if unknown || self.m.acked.is_empty() {
            batch_id(&self.cache, self.m.next_batch + (pick % 3) as u64)
        } else {
            self.m.acked[pick % self.m.acked.len()]
        };
        let before = self.frozen();
        let r = match call {
            0 => self.cache.start(id),
            1 => self.cache.complete(id),
            _ => self.cache.fail(id),
        };
        assert_eq!(arg_of(r), "batch_id");
        assert_eq!(
            self.frozen(),
            before,
            "a bad acknowledgement changed something"
        );
        self.check();
    }

    // ----- requests ----------------------------------------------------------------

    fn do_admit(&mut self, ns: &Ns, toks: &[u32], take: bool) {
        if self.m.reqs.len() >= MAX_LIVE {
            return self.do_finish(toks.len());
        }
        let (dl, kl, src) = self.m.predict_match(ns, toks);
        let k = key(ns, toks, dl);
        let ok = src.is_none() || self.m.obtainable(Some(&k));
        let free = self.m.slots_in(PageState::Free);
        let pinned = self.m.pinned();
        let next = batch_id(&self.cache, self.m.next_batch);
        let victims = if src.is_some() {
            self.m.state_victims(Some(&k), None)
        } else {
            Victims::none()
        };
        let got = self.cache.admit(ns.as_deref(), toks).unwrap();
        let removed = self.absorb(&[(k.clone(), src.is_some())], true);
        victims.check(&removed.state_keys, "admit");
        if src.is_some() {
            // The match reused it (it was locked meanwhile: no eviction took it).
            self.m.use_state(&k, true);
        }
        assert_eq!(got.is_some(), ok, "admit({ns:?}, {toks:?})");
        if src.is_none() || !free.is_empty() {
            assert!(removed.is_empty(), "admit evicted needlessly");
        }
        let Some(id) = got else {
            // Refused only when no unlocked, unpinned state could be evicted; and then
            // nothing was.
            assert!(removed.is_empty(), "a refused admit evicted");
            return self.check();
        };
        assert!(
            self.m.req_index(id).is_none() && !self.m.dead_reqs.contains(&id),
            "request id {id} reused"
        );
        let v = self.cache.request(id).unwrap();
        let mut q = Req {
            id,
            ns: ns.clone(),
            prompt: toks.to_vec(),
            tokens: toks[..dl].to_vec(),
            prefix_len: dl,
            branch_len: kl,
            own: Vec::new(),
            mamba: v.mamba_slot,
            retired_kv: Vec::new(),
            retired_mamba: Vec::new(),
            cow: None,
            lock: Some(src.is_some()),
            read: (None, Vec::new(), Vec::new()),
        };
        if let Some(src) = src {
            let dst = v
                .mamba_slot
                .expect("a request reusing a state has its own slot");
            assert!(
                free.contains(&dst) || (removed.states.contains(&dst) && !pinned.contains(&dst)),
                "admission slot {dst} was neither free nor evicted"
            );
            q.cow = Some(next);
            self.m.batches.insert(
                next,
                Pending {
                    what: BatchFor::Admit(id),
                    src,
                    dst,
                    taken: false,
                },
            );
            self.m.next_batch += 1;
        }
        self.m.reqs.push(q);
        self.check();
        if take {
            self.do_take();
        }
    }

    fn do_extend(
        &mut self,
        pick: usize,
        from_prompt: bool,
        at_branch: bool,
        chunk: usize,
        tail: &[u32],
    ) {
        if self.m.reqs.is_empty() {
            return self.do_take();
        }
        let ps = self.m.ps;
        let i = pick % self.m.reqs.len();
        let q = &self.m.reqs[i];
        let id = q.id;
        let len = q.tokens.len();
        let room = MAX_REQUEST - len.min(MAX_REQUEST);
        let prompt_chunk = from_prompt && len < q.prompt.len() && q.prompt.starts_with(&q.tokens);
        let toks: Vec<u32> = if prompt_chunk {
            let mut end = q.prompt.len().min(len + chunk);
            // A scheduler stops prefill at the branch point to checkpoint there.
            if at_branch && len < q.branch_len && q.branch_len < end {
                end = q.branch_len;
            }
            q.prompt[len..end].to_vec()
        } else {
            tail.to_vec()
        };
        let toks = toks[..toks.len().min(room)].to_vec();
        let own_len = len - q.prefix_len;
        let need = (own_len + toks.len()).div_ceil(ps) - q.own.len();
        let wants_state = q.mamba.is_none();
        let free = self.m.free_kv();
        let kv_ok = need == 0 || free.len() + self.m.unlocked_pages() >= need;
        let st_ok = !wants_state || self.m.obtainable(None);
        let free_m = self.m.slots_in(PageState::Free);
        let pinned = self.m.pinned();
        // Exact when no KV eviction comes first (its cascades follow the KV LRU).
        let victims = (need == 0 || free.len() >= need).then(|| {
            if wants_state {
                self.m.state_victims(None, None)
            } else {
                Victims::none()
            }
        });
        let r = self.cache.extend(id, &toks).unwrap();
        let removed = self.absorb(&[], false);
        if let Some(v) = victims {
            v.check(&removed.state_keys, "extend");
        }
        assert_eq!(r.is_some(), kv_ok && st_ok, "extend({id}, {toks:?})");
        if !(kv_ok && st_ok) || (free.len() >= need && (!wants_state || !free_m.is_empty())) {
            assert!(removed.is_empty(), "extend evicted needlessly");
        }
        let Some(slots) = r else {
            return self.check();
        };
        assert_eq!(slots.len(), toks.len());
        let q = &mut self.m.reqs[i];
        let old_pages = q.own.len();
        for (j, &slot) in slots.iter().enumerate() {
            let pos = own_len + j;
            if pos / ps == q.own.len() {
                let p = slot.div_euclid(i64_of(ps));
                assert!(
                    free.contains(&p) || removed.pages.contains(&p),
                    "extend gave page {p}, neither free nor evicted"
                );
                assert!(!q.own.contains(&p), "extend gave page {p} twice");
                q.own.push(p);
            }
            assert_eq!(
                slot,
                q.own[pos / ps] * i64_of(ps) + i64_of(pos % ps),
                "extend slots {slots:?} (the last partial page first)"
            );
        }
        assert_eq!(q.own.len() - old_pages, need);
        q.tokens.extend_from_slice(&toks);
        let branch = q.branch_len;
        let len = q.tokens.len();
        if wants_state {
            let state = self.given_state(id, &free_m, &removed, &pinned, "extend");
            self.m.reqs[i].mamba = Some(state);
        }
        self.check();
        if prompt_chunk && at_branch && len == branch && len > 0 && len > self.m.reqs[i].prefix_len
        {
            self.do_checkpoint(i, true);
        }
    }

    /// `extend_batch`: one token for each picked request, all or nothing, each as
    /// `extend` would give it (the last partial page first, a state if it has none).
    fn do_extend_batch(&mut self, picks: &[usize], seed: u32, fault: u8) {
        if self.m.reqs.is_empty() {
            return self.do_take();
        }
        let ps = self.m.ps;
        let mut idx: Vec<usize> = vec![];
        for p in picks {
            let i = p % self.m.reqs.len();
            if !idx.contains(&i) && self.m.reqs[i].tokens.len() < MAX_REQUEST {
                idx.push(i);
            }
        }
        if idx.is_empty() {
            return self.check();
        }
        let mut ids: Vec<RequestId> = idx.iter().map(|&i| self.m.reqs[i].id).collect();
        let mut toks: Vec<u32> = (0..ids.len()).map(|j| (seed >> j) % 4).collect();
        if fault > 0 {
            if fault == 1 {
                ids.push(ids[0]);
                toks.push(0);
            } else {
                toks.pop();
            }
            let before = self.frozen();
            let r = self.cache.extend_batch(&ids, &toks);
            assert!(
                matches!(r, Err(Error::InvalidArgument { .. })),
                "a malformed decode step was not refused: {r:?}"
            );
            assert_eq!(
                self.frozen(),
                before,
                "a refused decode step changed something"
            );
            return self.check();
        }
        let mut need = 0;
        let mut states = 0;
        for &i in &idx {
            let q = &self.m.reqs[i];
            need += (q.tokens.len() - q.prefix_len + 1).div_ceil(ps) - q.own.len();
            states += usize::from(q.mamba.is_none());
        }
        let free = self.m.free_kv();
        let free_m = self.m.slots_in(PageState::Free);
        let pinned = self.m.pinned();
        let kv_ok = need == 0 || free.len() + self.m.unlocked_pages() >= need;
        let st_ok = states == 0
            || free_m.len() + self.m.state_victims(None, Some(states)).keys.len() >= states;
        let r = self.cache.extend_batch(&ids, &toks).unwrap();
        let removed = self.absorb(&[], false);
        assert_eq!(
            r.is_some(),
            kv_ok && st_ok,
            "extend_batch({ids:?}, {toks:?})"
        );
        if r.is_none() || (free.len() >= need && free_m.len() >= states) {
            assert!(removed.is_empty(), "extend_batch evicted needlessly");
        }
        let Some(slots) = r else {
            return self.check();
        };
        assert_eq!(slots.len(), idx.len());
        let mut given: Vec<i64> = vec![];
        for ((&i, &slot), &tok) in idx.iter().zip(&slots).zip(&toks) {
            let q = &mut self.m.reqs[i];
            let pos = q.tokens.len() - q.prefix_len;
            if pos / ps == q.own.len() {
                let p = slot.div_euclid(i64_of(ps));
                assert!(
                    free.contains(&p) || removed.pages.contains(&p),
                    "extend_batch gave page {p}, neither free nor evicted"
                );
                assert!(!given.contains(&p), "extend_batch gave page {p} twice");
                given.push(p);
                q.own.push(p);
            }
            assert_eq!(
                slot,
                q.own[pos / ps] * i64_of(ps) + i64_of(pos % ps),
                "extend_batch slot {slot} (the last partial page first)"
            );
            q.tokens.push(tok);
            if q.mamba.is_none() {
                let id = q.id;
                let state = self.given_state(id, &free_m, &removed, &pinned, "extend_batch");
                self.m.reqs[i].mamba = Some(state);
            }
        }
        self.check();
    }

    /// The state slot `call` gave request `id`: one that was free, or evicted by the call
    /// (and not pinned by a batch).
    fn given_state(
        &self,
        id: RequestId,
        free: &[u32],
        removed: &Removed,
        pinned: &HashSet<u32>,
        call: &str,
    ) -> u32 {
        let state = self
            .cache
            .request(id)
            .unwrap()
            .mamba_slot
            .unwrap_or_else(|| panic!("{call} gives a state slot"));
        assert!(
            free.contains(&state) || (removed.states.contains(&state) && !pinned.contains(&state)),
            "{call} gave state slot {state}, neither free nor evicted"
        );
        state
    }

    /// The one state slot owned by neither a request nor a known batch: a new copy's.
    fn new_owned_state(&self) -> u32 {
        let known: HashSet<u32> = self
            .m
            .reqs
            .iter()
            .flat_map(|q| q.mamba.iter().chain(&q.retired_mamba).copied())
            .chain(self.m.batches.values().map(|b| b.dst))
            .collect();
        let found: Vec<u32> = (0..u32_of(self.m.mamba_cap))
            .filter(|&s| {
                self.cache.mamba_pool().state(s) == Some(PageState::Owned) && !known.contains(&s)
            })
            .collect();
        assert_eq!(found.len(), 1, "new owned state slots: {found:?}");
        found[0]
    }

    /// A call that a request's unacknowledged admission copy refuses: it must change
    /// nothing.
    fn refused_while_copying(&mut self, id: RequestId, finish: bool) {
        let before = self.frozen();
        let r = if finish {
            self.cache.finish(id)
        } else {
            self.cache.checkpoint(id)
        };
        assert!(is_request_err(&r), "{r:?} while the copy is pending");
        assert_eq!(self.frozen(), before, "a refused call changed something");
        self.check();
    }

    /// `expect`: marks no more nodes than prompts, changes nothing the model sees.
    fn do_expect(&mut self, prompts: &[(Ns, Vec<u32>)]) {
        let items: Vec<(Option<&str>, &[u32])> = prompts
            .iter()
            .map(|(ns, toks)| (ns.as_deref(), toks.as_slice()))
            .collect();
        let marked = self.cache.expect(&items);
        assert!(
            marked <= prompts.len(),
            "{marked} nodes marked for {prompts:?}"
        );
        assert_eq!(stat(&self.cache, "expected_nodes"), marked as u64);
        self.m.expecting = !prompts.is_empty();
        if self.m.expecting {
            // Requests whose admission copies landed let their matched states go.
            for q in self.m.reqs.iter_mut().filter(|q| q.cow.is_none()) {
                if let Some(m) = q.lock.as_mut() {
                    *m = false;
                }
            }
        }
        self.check();
    }

    fn do_checkpoint(&mut self, pick: usize, take: bool) {
        if self.m.reqs.is_empty() {
            return self.do_take();
        }
        let i = pick % self.m.reqs.len();
        let id = self.m.reqs[i].id;
        if self.m.reqs[i].cow.is_some() {
            return self.refused_while_copying(id, false);
        }
        let (aligned, end) = self.m.publish_request(i);
        let has_state = self.m.content.states.contains_key(&end);
        let q = &mut self.m.reqs[i];
        // The request reads only its own state: with a queue told of, its new lock holds
        // the path alone; without one, the state there too.
        q.lock = Some(!self.m.expecting && aligned > 0 && has_state);
        let src = q.mamba;
        let emit = src.is_some() && q.tokens.len() == aligned && aligned > 0 && !has_state;
        let ok = emit && self.m.obtainable(None);
        let free = self.m.slots_in(PageState::Free);
        let pinned = self.m.pinned();
        let next = batch_id(&self.cache, self.m.next_batch);
        let victims = if emit {
            self.m.state_victims(None, None)
        } else {
            Victims::none()
        };
        let bypassed = stat(&self.cache, "checkpoint_states_bypassed");
        self.cache.checkpoint(id).unwrap();
        // Let go by: every state it could displace is expected sooner (`expect`).
        let bypassed = stat(&self.cache, "checkpoint_states_bypassed") > bypassed;
        assert!(!bypassed || (self.m.expecting && emit && free.is_empty()));
        let ok = ok && !bypassed;
        let removed = self.absorb(&[], true);
        if bypassed {
            assert!(removed.is_empty(), "a checkpoint let go by evicted");
        } else {
            victims.check(&removed.state_keys, "checkpoint");
        }
        if !emit || !free.is_empty() {
            assert!(removed.is_empty(), "checkpoint evicted needlessly");
        }
        if emit && !ok {
            assert!(
                removed.is_empty(),
                "a checkpoint without a state slot evicted"
            );
        }
        if let (true, Some(src)) = (ok, src) {
            let dst = self.new_owned_state();
            assert!(
                free.contains(&dst) || (removed.states.contains(&dst) && !pinned.contains(&dst)),
                "checkpoint copy slot {dst} was neither free nor evicted"
            );
            let node = self.cache.request(id).unwrap().node;
            self.m.batches.insert(
                next,
                Pending {
                    what: BatchFor::Checkpoint(node),
                    src,
                    dst,
                    taken: false,
                },
            );
            self.m.next_batch += 1;
        }
        self.check();
        if take {
            self.do_take();
        }
    }

    fn do_finish(&mut self, pick: usize) {
        if self.m.reqs.is_empty() {
            return self.do_take();
        }
        let i = pick % self.m.reqs.len();
        let id = self.m.reqs[i].id;
        if self.m.reqs[i].cow.is_some() {
            return self.refused_while_copying(id, true);
        }
        let (aligned, end) = self.m.publish_request(i);
        let q = self.m.reqs.remove(i);
        if let Some(s) = q.mamba {
            if q.tokens.len() == aligned && aligned > 0 && !self.m.content.states.contains_key(&end)
            {
                self.m.place_state(&end, s);
            }
        }
        // At an unaligned length the state is freed; the turn's end state is lost unless
        // its last whole page has a state, or a checkpoint copy on its way there.
        let copying = self.m.batches.values().any(|b| {
            matches!(b.what, BatchFor::Checkpoint(node) if self.read.ids.get(&node) == Some(&end))
        });
        if q.mamba.is_some()
            && q.tokens.len() != aligned
            && aligned > 0
            && !self.m.content.states.contains_key(&end)
            && !copying
        {
            self.m.states_lost += 1;
        }
        self.cache.finish(id).unwrap();
        assert_eq!(
            stat(&self.cache, "finish_states_lost"),
            self.m.states_lost,
            "finish_states_lost after finishing {} tokens",
            q.tokens.len()
        );
        self.m.dead_reqs.push(id);
        remember(&mut self.m.history, &q.tokens);
        self.check();
    }

    /// `dropped`: what a dropped handle does (abort if live), then a second drop of a
    /// handle to the same request, which must find it gone and change nothing.
    fn do_abort(&mut self, pick: usize, dropped: bool) {
        if self.m.reqs.is_empty() {
            return self.do_take();
        }
        let q = self.m.reqs.remove(pick % self.m.reqs.len());
        if dropped {
            assert!(self.cache.request_live(q.id));
        }
        self.cache.abort(q.id).unwrap();
        self.m.dead_reqs.push(q.id);
        self.check();
        if dropped {
            assert!(!self.cache.request_live(q.id));
            let before = self.frozen();
            assert!(is_request_err(&self.cache.abort(q.id)));
            assert_eq!(self.frozen(), before, "a second abort changed something");
        }
    }

    fn do_stale(&mut self, pick: usize, call: u8) {
        if self.m.dead_reqs.is_empty() {
            return self.do_take();
        }
        let id = self.m.dead_reqs[pick % self.m.dead_reqs.len()];
        let before = self.frozen();
        let stale = match call {
            0 => is_request_err(&self.cache.extend(id, &[1, 2])),
            1 => is_request_err(&self.cache.checkpoint(id)),
            2 => is_request_err(&self.cache.finish(id)),
            3 => is_request_err(&self.cache.abort(id)),
            4 => is_request_err(&self.cache.request(id)),
            5 => is_request_err(&self.cache.request_tokens(id)),
            _ => is_request_err(&self.cache.request_kv_indices(id)),
        };
        assert!(stale, "call {call} on finished request {id} did not fail");
        assert!(!self.cache.request_live(id));
        assert_eq!(
            self.frozen(),
            before,
            "a stale request call changed something"
        );
        self.check();
    }

    fn step(&mut self, op: &Op) {
        match op {
            Op::Admit { ns, toks, take } => {
                let t = self.m.resolve(&ns_of(*ns), toks);
                self.do_admit(&ns_of(*ns), &t, *take);
            }
            Op::Extend {
                pick,
                from_prompt,
                at_branch,
                n,
                tail,
            } => self.do_extend(*pick, *from_prompt, *at_branch, *n, tail),
            Op::ExtendBatch { picks, seed, fault } => self.do_extend_batch(picks, *seed, *fault),
            Op::Checkpoint { pick, take } => self.do_checkpoint(*pick, *take),
            Op::Finish { pick } => self.do_finish(*pick),
            // A dropped handle aborts through the same call.
            Op::Abort { pick, dropped } => self.do_abort(*pick, *dropped),
            Op::Stale { pick, call } => self.do_stale(*pick, *call),
            Op::Take => self.do_take(),
            Op::Ack { pick, start, fail } => self.do_ack(*pick, *start, *fail),
            Op::BadAck {
                pick,
                call,
                unknown,
            } => self.do_bad_ack(*pick, *call, *unknown),
            Op::Match { ns, toks } => {
                let t = self.m.resolve(&ns_of(*ns), toks);
                self.do_match(&ns_of(*ns), &t);
            }
            Op::Insert {
                ns,
                toks,
                owned,
                state,
                seed,
            } => {
                let t = self.m.resolve(&ns_of(*ns), toks);
                self.do_insert(&ns_of(*ns), t, *owned, *state, *seed);
            }
            Op::AllocKv { pages, extra } => self.do_alloc_kv(pages * self.m.ps + extra),
            Op::FreeKv { bad, seed } => self.do_free_kv(*bad, &mut Rng(*seed)),
            Op::AllocMamba => self.do_alloc_mamba(),
            Op::FreeMamba { bad, seed } => self.do_free_mamba(*bad, &mut Rng(*seed)),
            Op::Lock { ns, toks, recent } => {
                let t = self.m.resolve(&ns_of(*ns), toks);
                self.do_lock(&ns_of(*ns), &t, *recent);
            }
            Op::Unlock { pick } => self.do_unlock(*pick),
            Op::DropReceipt { pick } => self.do_drop_receipt(*pick),
            Op::UnlockForeign => self.do_unlock_foreign(),
            Op::Evict { kv, mamba } => self.do_evict(*kv, *mamba),
            Op::Expect { prompts } => {
                let prompts: Vec<(Ns, Vec<u32>)> = prompts
                    .iter()
                    .map(|(ns, toks)| (ns_of(*ns), self.m.resolve(&ns_of(*ns), toks)))
                    .collect();
                self.do_expect(&prompts);
            }
        }
    }

    /// Acknowledges every batch, ends every request, releases every receipt and slot
    /// and evicts everything: both pools must then be entirely free.
    fn teardown(&mut self) {
        let mut n = 0;
        while !self.m.batches.is_empty() {
            self.do_ack(5 * n, n % 2 == 0, false);
            n += 1;
        }
        while !self.m.reqs.is_empty() {
            if n % 3 == 0 {
                self.do_abort(n, n % 2 == 0);
            } else {
                self.do_finish(n);
            }
            n += 1;
        }
        assert!(self.m.batches.is_empty(), "finish emitted a batch");
        while !self.m.receipts.is_empty() {
            self.do_unlock(0);
        }
        let held: Vec<i64> = self
            .m
            .held_kv
            .iter()
            .flat_map(|&p| page_slots(p, self.m.ps))
            .collect();
        assert_eq!(self.cache.free_kv(&held).unwrap(), held.len());
        self.m.held_kv.clear();
        for s in std::mem::take(&mut self.m.held_mamba) {
            self.cache.free_mamba(i64::from(s)).unwrap();
        }
        self.check();
        self.do_evict(usize::MAX, usize::MAX);
        let kv = self.cache.kv_counts();
        let mamba = self.cache.mamba_counts();
        assert_eq!(kv.free, self.m.kv_pages, "kv pool after teardown: {kv:?}");
        assert_eq!(
            mamba.free, self.m.mamba_cap,
            "state pool after teardown: {mamba:?}"
        );
        assert_eq!((kv.draining, mamba.draining), (0, 0));
        assert_eq!(self.cache.total_size(), 0);
        assert_eq!(stat(&self.cache, "live_requests"), 0);
        assert_eq!(stat(&self.cache, "batches_in_flight"), 0);
        assert_eq!(stat(&self.cache, "live_locks"), 0);
        self.cache.audit().unwrap();
    }
}

proptest! {
    #![proptest_config(proptest_config("proptest-regressions/hybrid_machine.txt"))]

    #[test]
    fn hybrid_cache_matches_the_reference_model(
        (ps, kv_slots, mamba_slots) in config(),
        policy in prop::sample::select(EvictionPolicy::ALL.to_vec()),
        ops in prop::collection::vec(op(), 1..=200),
    ) {
        let mut machine = Machine::new(ps, kv_slots, mamba_slots, policy);
        machine.check();
        for op in &ops {
            machine.step(op);
        }
        machine.teardown();
    }
}
