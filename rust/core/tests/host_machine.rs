//! State-machine test of the host tier of [`radixcache_core::Cache`], with a data oracle.
//!
//! Two entry points: an attention-only cache (`mamba_slots = 0`) and a hybrid one (state
//! pools on both tiers), each over the three write policies and page sizes 1, 2 and 4,
//! with small pools (16..=48 device KV slots, 16..=64 host KV slots, 2..=6 state slots
//! per tier) and a small alphabet with shared prefixes, so that eviction, demotion, host
//! eviction and load-backs happen all the time.
//!
//! Proptest generates random sequences of the request-level calls (`admit`, `extend`,
//! `checkpoint`, `finish`, `abort`), the low-level ones (`match_prefix`, each preceded by a
//! `peek_prefix` that must answer the same lengths, `insert_with_state`
//! with `alloc_kv` / `alloc_mamba` slots, `free_kv`, `free_mamba`, `lock` / `unlock` of
//! device or host nodes, `evict`), `take_batches` with `start` / `complete` / `fail` of
//! taken batches in random order, and `load_back` (of a request, or of a match's
//! `host_node` with or without a request, or of a remembered, possibly stale, node; with
//! no quota or a small one) whose guards are then, at random later steps, started,
//! committed, called off (`cancel_load`), completed or failed, in any order, legal or
//! not. Calls the API refuses (finishing a request whose load is pending, committing
//! twice, acknowledging a batch twice, ...) must fail with the documented error and
//! leave the cache exactly as it was (snapshot, the four pools, request views, stats).
//!
//! The oracle simulates memory: one value per slot of each pool and tier. The test
//! "computes" what a model would: a caller's KV slots before `insert`, a request's new
//! slots and its state after `extend` (the forward pass); KV of token `p` of a sequence
//! is a hash of its first `p + 1` tokens, the state after `L` tokens another hash of
//! them. The engine it plays applies a batch's copies when the batch completes (reading
//! the sources as they were at `start`, which must not have changed since), writes
//! poison into the destinations of a failed batch, and runs whatever reads or writes a
//! request's state slot before a forward pass writes it (stream order). After every
//! step:
//!
//! * `audit()` passes;
//! * every node of `snapshot()` holds the right data wherever the cache claims data:
//!   device KV (unless a load is still landing), device state, host KV, host state;
//! * every live request's tokens are what the test fed it, and its KV slots (and its
//!   state, unless a copy into it is pending) hold the right data;
//! * load guards and batches are where the test thinks (`load_committed`, `started`);
//! * the caller slots in the pools are exactly the test's.
//!
//! Every `match_prefix` result is checked the same way (slots and state). No slot the
//! cache hands out (`alloc_kv`, `extend`, `alloc_mamba`, a load's destinations) may be one
//! that a batch in flight reads or writes.
//!
//! A call that takes nothing for itself (a refused `extend`, a called-off `load_back`)
//! must leave the cache as it was too, except that under write-back the eviction it
//! tried may have started backups (docs/contract.md rule 11).
//!
//! Each case ends by acknowledging every batch, calling off every uncommitted load,
//! aborting every request and giving back every slot: the pools must then hold nothing
//! but free and cached pages; evicting everything afterwards must empty the device.
//! 2 × 48 cases of 1..=400 operations (~19,000 steps per run, a few seconds in a debug
//! build). Failures are saved to `proptest-regressions/host_machine.txt` and replayed
//! first. The bugs the machine found are pinned by the small tests at the end.

// clippy.toml allows unwrap/expect in `#[test]` functions only; in this test crate the
// machine's helpers fail the test the same way.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::{BTreeMap, BTreeSet};

use common::{
    assert_pool_sums, caller_slots, eviction_policies, i64_of, ns_of, proptest_config, remember,
    tail, tok_spec_of, Ns, OwnedFrom, Rng, TokSpec, SYSTEM,
};
use proptest::prelude::*;
use radixcache_core::{
    Abandoned, BatchId, BatchKind, Cache, Config, Error, LoadRecord, LoadTarget, LockReceipt,
    Match, NodeId, NodeInfo, PoolCounts, PoolKind, RequestId, RequestView, Tier, TransferBatch,
    WritePolicy,
};

/// Longest a request or an inserted sequence grows.
const MAX_REQUEST: usize = 24;
/// Live requests at most: an admit beyond this finishes one instead.
const MAX_LIVE: usize = 4;
/// Outstanding load guards at most: a load-back beyond this acts on a guard instead.
const MAX_GUARDS: usize = 3;
/// Test-held lock receipts at most.
const MAX_RECEIPTS: usize = 3;
/// Marks a value written into the destination of a failed copy.
const POISON: u64 = 0xbad0_0000_0000_0000;

// ---------------------------------------------------------------------------------------
// Data: what a slot should hold

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// `h[k]`: a hash of the first `k` tokens of `toks` in namespace `ns`. KV of token `p`
/// is `h[p + 1]`; the state after `L` tokens is `state_of(&h, L)`.
fn chain(ns: &Ns, toks: &[u32]) -> Vec<u64> {
    let mut cur = mix(if ns.is_some() {
        0x6e73_0001
    } else {
        0x6e73_0000
    });
    let mut h = Vec::with_capacity(toks.len() + 1);
    h.push(cur);
    for &t in toks {
        cur = mix(cur ^ mix(u64::from(t).wrapping_add(0x9e37_79b9_7f4a_7c15)));
        h.push(cur);
    }
    h
}

fn state_of(h: &[u64], len: usize) -> u64 {
    mix(h[len] ^ 0x5374_6174_6500_0000)
}

fn idx(slot: i64) -> usize {
    usize::try_from(slot).unwrap()
}

fn u32_of(x: usize) -> u32 {
    u32::try_from(x).unwrap()
}

/// Simulated memory: what each slot of each pool and tier holds (`None`: never written).
struct Store {
    dev_kv: Vec<Option<u64>>,
    host_kv: Vec<Option<u64>>,
    dev_state: Vec<Option<u64>>,
    host_state: Vec<Option<u64>>,
}

impl Store {
    fn mem(&self, pool: PoolKind, tier: Tier) -> &Vec<Option<u64>> {
        match (pool, tier) {
            (PoolKind::Kv, Tier::Device) => &self.dev_kv,
            (PoolKind::Kv, Tier::Host) => &self.host_kv,
            (PoolKind::Mamba, Tier::Device) => &self.dev_state,
            (PoolKind::Mamba, Tier::Host) => &self.host_state,
            (PoolKind::Swa, _) => panic!("this machine draws no SWA layers"),
            (_, Tier::External) => panic!("this machine has no L3 tier"),
        }
    }

    fn mem_mut(&mut self, pool: PoolKind, tier: Tier) -> &mut Vec<Option<u64>> {
        match (pool, tier) {
            (PoolKind::Kv, Tier::Device) => &mut self.dev_kv,
            (PoolKind::Kv, Tier::Host) => &mut self.host_kv,
            (PoolKind::Mamba, Tier::Device) => &mut self.dev_state,
            (PoolKind::Mamba, Tier::Host) => &mut self.host_state,
            (PoolKind::Swa, _) => panic!("this machine draws no SWA layers"),
            (_, Tier::External) => panic!("this machine has no L3 tier"),
        }
    }

    fn get(&self, pool: PoolKind, tier: Tier, slot: i64) -> Option<u64> {
        self.mem(pool, tier)[idx(slot)]
    }

    fn set(&mut self, pool: PoolKind, tier: Tier, slot: i64, v: Option<u64>) {
        self.mem_mut(pool, tier)[idx(slot)] = v;
    }

    /// Checks that `slot` holds `want`; `what` says whose data it is.
    fn expect(&self, pool: PoolKind, tier: Tier, slot: i64, want: u64, what: &dyn Fn() -> String) {
        let got = self.get(pool, tier, slot);
        assert!(
            got == Some(want),
            "DATA MISMATCH: {} {} slot {slot} holds {} but {} (expected {want:#x})",
            tier.as_str(),
            pool.as_str(),
            got.map_or("nothing".to_owned(), |v| if v & POISON == POISON {
                format!("poison {v:#x} (a failed copy)")
            } else {
                format!("{v:#x}")
            }),
            what()
        );
    }
}

// ---------------------------------------------------------------------------------------
// Operations

#[derive(Debug, Clone, Copy)]
enum AckAct {
    Start,
    Complete,
    Fail,
    /// The engine lets go of the batch before it ended ([`Cache::abandon`]).
    Abandon,
}

#[derive(Debug, Clone, Copy)]
enum GuardAct {
    Start,
    Commit,
    Cancel,
    Complete,
    Fail,
}

/// What `load_back(node)` loads.
#[derive(Debug, Clone, Copy)]
enum Target {
    /// The end of a node with KV on the host only (else `Spec`).
    HostOnly,
    /// The prompt of the request picked.
    Prompt,
    /// The tokens of the op's token spec.
    Spec,
    /// A remembered node handle, perhaps stale.
    Recent,
}

#[derive(Debug, Clone)]
enum Op {
    Admit {
        ns: bool,
        toks: TokSpec,
    },
    Extend {
        pick: usize,
        from_prompt: bool,
        n: usize,
        tail: Vec<u32>,
    },
    Checkpoint {
        pick: usize,
    },
    Finish {
        pick: usize,
    },
    Abort {
        pick: usize,
    },
    Match {
        ns: bool,
        toks: TokSpec,
    },
    Insert {
        ns: bool,
        toks: TokSpec,
        owned: OwnedFrom,
        state: bool,
        seed: u64,
    },
    AllocKv {
        pages: usize,
    },
    FreeKv {
        seed: u64,
    },
    AllocMamba,
    FreeMamba {
        pick: usize,
    },
    Lock {
        ns: bool,
        toks: TokSpec,
        host: bool,
    },
    Unlock {
        pick: usize,
    },
    Evict {
        kv: usize,
        mamba: usize,
    },
    Take,
    Ack {
        pick: usize,
        act: AckAct,
    },
    /// `start`, `complete` or `fail` of a batch acknowledged already.
    BadAck {
        pick: usize,
        call: u8,
    },
    LoadRequest {
        pick: usize,
        quota: Option<usize>,
    },
    /// Load the `host_node` of a match, or a remembered node handle (`Target::Recent`),
    /// for request `pick` when `with`.
    LoadNode {
        pick: usize,
        target: Target,
        with: bool,
        ns: bool,
        toks: TokSpec,
        quota: Option<usize>,
    },
    Guard {
        pick: usize,
        act: GuardAct,
    },
}

/// `base`: 0: none, 1..=4: a system prompt, 5..=6: an earlier sequence, 7..=8: a live
/// request's prompt, 9..=10: where a node with KV on the host only ends (else an
/// earlier sequence).
fn tok_spec() -> impl Strategy<Value = TokSpec> {
    tok_spec_of(
        prop_oneof![1 => Just(0u8), 3 => 1u8..=4, 3 => 5u8..=6, 2 => 7u8..=8, 4 => 9u8..=10],
        0.3,
        tail(),
    )
}

/// Prompts for `admit`: mostly a system prompt or an earlier sequence, often exactly.
fn prompt_spec() -> impl Strategy<Value = TokSpec> {
    tok_spec_of(
        prop_oneof![1 => Just(0u8), 3 => 1u8..=4, 4 => 5u8..=6, 1 => 7u8..=8, 3 => 9u8..=10],
        0.15,
        prop_oneof![
            2 => Just(Vec::new()),
            3 => prop::collection::vec(0u32..4, 1..8),
        ],
    )
}

fn ns() -> impl Strategy<Value = bool> {
    prop::bool::weighted(0.15)
}

fn quota() -> impl Strategy<Value = Option<usize>> {
    prop::option::weighted(0.3, 0usize..16)
}

fn owned_from() -> impl Strategy<Value = OwnedFrom> {
    prop_oneof![
        3 => Just(OwnedFrom::Full),
        1 => Just(OwnedFrom::Zero),
        1 => Just(OwnedFrom::Mid),
    ]
}

fn ack_act() -> impl Strategy<Value = AckAct> {
    prop_oneof![
        2 => Just(AckAct::Start),
        6 => Just(AckAct::Complete),
        1 => Just(AckAct::Fail),
        1 => Just(AckAct::Abandon),
    ]
}

fn guard_act() -> impl Strategy<Value = GuardAct> {
    prop_oneof![
        3 => Just(GuardAct::Start),
        5 => Just(GuardAct::Commit),
        2 => Just(GuardAct::Cancel),
        5 => Just(GuardAct::Complete),
        1 => Just(GuardAct::Fail),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        10 => (ns(), prompt_spec()).prop_map(|(ns, toks)| Op::Admit { ns, toks }),
        14 => (
            any::<usize>(),
            prop::bool::weighted(0.8),
            0usize..=6,
            prop::collection::vec(0u32..4, 0..=6)
        )
            .prop_map(|(pick, from_prompt, n, tail)| Op::Extend {
                pick,
                from_prompt,
                n,
                tail
            }),
        4 => any::<usize>().prop_map(|pick| Op::Checkpoint { pick }),
        7 => any::<usize>().prop_map(|pick| Op::Finish { pick }),
        3 => any::<usize>().prop_map(|pick| Op::Abort { pick }),
        3 => (ns(), tok_spec()).prop_map(|(ns, toks)| Op::Match { ns, toks }),
        7 => (ns(), tok_spec(), owned_from(), prop::bool::weighted(0.8), any::<u64>()).prop_map(
            |(ns, toks, owned, state, seed)| Op::Insert {
                ns,
                toks,
                owned,
                state,
                seed
            }
        ),
        2 => (1usize..4).prop_map(|pages| Op::AllocKv { pages }),
        2 => any::<u64>().prop_map(|seed| Op::FreeKv { seed }),
        1 => Just(Op::AllocMamba),
        1 => any::<usize>().prop_map(|pick| Op::FreeMamba { pick }),
        2 => (ns(), tok_spec(), any::<bool>()).prop_map(|(ns, toks, host)| Op::Lock { ns, toks, host }),
        2 => any::<usize>().prop_map(|pick| Op::Unlock { pick }),
        5 => (
            prop_oneof![1 => 0usize..8, 1 => 8usize..64],
            prop_oneof![2 => Just(0usize), 2 => 1usize..3]
        )
            .prop_map(|(kv, mamba)| Op::Evict { kv, mamba }),
        4 => Just(Op::Take),
        9 => (any::<usize>(), ack_act()).prop_map(|(pick, act)| Op::Ack { pick, act }),
        1 => (any::<usize>(), 0u8..3).prop_map(|(pick, call)| Op::BadAck { pick, call }),
        6 => (any::<usize>(), quota()).prop_map(|(pick, quota)| Op::LoadRequest { pick, quota }),
        8 => (
            any::<usize>(),
            target(),
            prop::bool::weighted(0.6),
            ns(),
            tok_spec(),
            quota()
        )
            .prop_map(|(pick, target, with, ns, toks, quota)| Op::LoadNode {
                pick,
                target,
                with,
                ns,
                toks,
                quota
            }),
        14 => (any::<usize>(), guard_act()).prop_map(|(pick, act)| Op::Guard { pick, act }),
    ]
}

fn target() -> impl Strategy<Value = Target> {
    prop_oneof![
        6 => Just(Target::HostOnly),
        2 => Just(Target::Prompt),
        2 => Just(Target::Spec),
        1 => Just(Target::Recent),
    ]
}

fn policy() -> impl Strategy<Value = WritePolicy> {
    prop_oneof![
        Just(WritePolicy::WriteThrough),
        Just(WritePolicy::WriteThroughSelective),
        Just(WritePolicy::WriteBack),
    ]
}

fn page_size() -> impl Strategy<Value = usize> {
    prop_oneof![Just(1usize), Just(2), Just(4)]
}

/// An attention-only cache with a host tier.
fn kv_config() -> impl Strategy<Value = Config> {
    (
        page_size(),
        16usize..=48,
        16usize..=64,
        policy(),
        1u32..=3,
        eviction_policies(),
    )
        .prop_map(
            |(ps, kv, host, write_policy, threshold, eviction_policy)| Config {
                kv_slots: kv / ps * ps,
                page_size: ps,
                mamba_slots: 0,
                host_kv_slots: host / ps * ps,
                host_mamba_slots: 0,
                write_policy,
                write_through_threshold: (write_policy == WritePolicy::WriteThroughSelective)
                    .then_some(threshold),
                eviction_policy,
                ..Config::default()
            },
        )
}

/// A hybrid cache with a host tier for KV and states.
fn hybrid_config() -> impl Strategy<Value = Config> {
    (kv_config(), 2usize..=6, 2usize..=6).prop_map(|(c, mamba, host_mamba)| Config {
        mamba_slots: mamba,
        host_mamba_slots: host_mamba,
        ..c
    })
}

// ---------------------------------------------------------------------------------------
// The machine

struct Req {
    id: RequestId,
    ns: Ns,
    /// The tokens it was admitted for (`extend` feeds the rest of them).
    prompt: Vec<u32>,
    /// Every token the request holds KV for, as the test fed it.
    tokens: Vec<u32>,
    /// Where its admission match ended counting host data (what loading it loads).
    host_end: usize,
    /// Checkpointed since the last `take_batches`: an untaken copy may read its state.
    checkpointed: bool,
}

/// A batch in flight that the test knows: taken, or a load guard's.
struct Flight {
    batch: TransferBatch,
    /// The sources' contents when the engine started the copies.
    read: Option<Vec<Vec<Option<u64>>>>,
    /// Abandoned after it was started: its copies may still write until the engine
    /// acknowledges it, which fails it either way.
    draining: bool,
}

/// Where a load guard's entry in the cache's load table stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Uncommitted; copies pending or completed.
    Open,
    /// Uncommitted; its copies failed (commit must fail).
    Failed,
    /// Committed, copies in flight.
    Committed,
    /// Out of the table (settled or called off).
    Gone,
}

struct Guard {
    id: BatchId,
    /// The record that owns the load until it is committed or called off.
    record: Option<LoadRecord>,
    /// Namespace and tokens of the node it loads.
    target: (Ns, Vec<u32>),
    request: Option<RequestId>,
    /// The request's tokens at `load_back` (what a failed committed load restores).
    before: Vec<u32>,
    phase: Phase,
    /// Its batch is pending in the cache (not acknowledged, not withdrawn).
    batch_live: bool,
}

/// Everything a refused call must leave as it was.
#[derive(Debug, PartialEq, Eq)]
struct Frozen {
    snapshot: Vec<NodeInfo>,
    counts: [PoolCounts; 4],
    requests: Vec<(RequestView, Vec<u32>, Vec<i64>)>,
    stats: Vec<(&'static str, u64)>,
}

impl Frozen {
    /// What a call that took nothing for itself must leave as it was. Under write-back
    /// the eviction it tried may have started backups (docs/contract.md rule 11: the evicted slots
    /// are free only once those complete), so only the requests are compared then.
    fn after_refusal(mut self, write_back: bool) -> Frozen {
        self.stats.clear();
        if write_back {
            self.snapshot.clear();
            self.counts = [PoolCounts::default(); 4];
        }
        self
    }
}

struct Machine {
    cache: Cache,
    /// A router's index rebuilt from the cache's KV events alone.
    events: common::EventIndex,
    ps: usize,
    hybrid: bool,
    store: Store,
    reqs: Vec<Req>,
    flights: BTreeMap<BatchId, Flight>,
    guards: Vec<Guard>,
    acked: Vec<BatchId>,
    /// Caller-held KV pages and state slots.
    held_kv: BTreeSet<i64>,
    held_mamba: BTreeSet<u32>,
    receipts: Vec<LockReceipt>,
    /// Recent node handles (some may be stale by now).
    nodes: Vec<NodeId>,
    history: Vec<Vec<u32>>,
    poisoned: u64,
    rng: Rng,
}

fn counts(cache: &Cache) -> [PoolCounts; 4] {
    [
        cache.kv_counts(),
        cache.mamba_counts(),
        cache.host_kv_pool().counts(),
        cache.host_mamba_pool().counts(),
    ]
}

fn page_of_slot(slot: i64, ps: usize) -> i64 {
    slot / i64_of(ps)
}

impl Machine {
    fn new(config: &Config, seed: u64) -> Machine {
        let cache = Cache::new(Config {
            page_hashes: true,
            events: true,
            ..config.clone()
        })
        .unwrap();
        Machine {
            events: common::EventIndex::default(),
            ps: config.page_size,
            hybrid: config.mamba_slots > 0,
            store: Store {
                dev_kv: vec![None; config.kv_slots],
                host_kv: vec![None; config.host_kv_slots],
                dev_state: vec![None; config.mamba_slots],
                host_state: vec![None; config.host_mamba_slots],
            },
            cache,
            reqs: Vec::new(),
            flights: BTreeMap::new(),
            guards: Vec::new(),
            acked: Vec::new(),
            held_kv: BTreeSet::new(),
            held_mamba: BTreeSet::new(),
            receipts: Vec::new(),
            nodes: Vec::new(),
            history: Vec::new(),
            poisoned: 0,
            rng: Rng(seed),
        }
    }

    /// The tokens of a spec in namespace `ns` (see `tok_spec`).
    fn resolve(&self, ns: &Ns, t: &TokSpec) -> Vec<u32> {
        let host_only = if matches!(t.base, 9 | 10) {
            self.host_only(ns)
        } else {
            Vec::new()
        };
        let mut toks = t.tokens(match t.base {
            1..=4 => SYSTEM[usize::from(t.base) - 1].to_vec(),
            7 | 8 if !self.reqs.is_empty() => self.reqs[t.hist % self.reqs.len()].prompt.clone(),
            9 | 10 if !host_only.is_empty() => host_only[t.hist % host_only.len()].clone(),
            5..=10 if !self.history.is_empty() => self.history[t.hist % self.history.len()].clone(),
            _ => Vec::new(),
        });
        toks.truncate(MAX_REQUEST);
        toks
    }

    /// Where the nodes of `ns` with KV on the host only end (in a hybrid cache, those
    /// with a state on the host, when there are any): what a load-back can bring back.
    fn host_only(&self, ns: &Ns) -> Vec<Vec<u32>> {
        let mut all = Vec::new();
        let mut with_state = Vec::new();
        for n in self.cache.snapshot() {
            if n.namespace == *ns && n.kv_indices.is_none() && n.host_kv_indices.is_some() {
                if n.host_mamba_slot.is_some() {
                    with_state.push(n.prefix.clone());
                }
                all.push(n.prefix);
            }
        }
        if self.hybrid && !with_state.is_empty() {
            with_state
        } else {
            all
        }
    }

    fn remember_node(&mut self, id: NodeId) {
        self.nodes.push(id);
        if self.nodes.len() > 8 {
            self.nodes.remove(0);
        }
    }

    fn frozen(&self) -> Frozen {
        Frozen {
            snapshot: self.cache.snapshot(),
            counts: counts(&self.cache),
            requests: self
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
            stats: self.cache.stats(),
        }
    }

    fn write_back(&self) -> bool {
        self.cache.config().write_policy == WritePolicy::WriteBack
    }

    fn guard_of(&self, id: BatchId) -> Option<&Guard> {
        self.guards.iter().find(|g| g.id == id)
    }

    /// Whether a committed load-back is still landing on the path to `target`.
    fn landing_on(&self, target: &(Ns, Vec<u32>)) -> bool {
        self.cache
            .snapshot()
            .iter()
            .any(|n| n.loading && n.namespace == target.0 && target.1.starts_with(&n.prefix))
    }

    /// The request's load, when it is committed and its copies have not landed.
    fn landing(&self, r: RequestId) -> bool {
        self.guards
            .iter()
            .any(|g| g.request == Some(r) && g.phase == Phase::Committed)
    }

    // -----------------------------------------------------------------------------------
    // Checks

    /// Everything that must hold after every step (the index rebuilt from the events
    /// equals the tree's contents, per tier, with states, among them).
    fn check(&mut self) {
        self.cache.audit().unwrap();
        self.events.check(&mut self.cache);
        assert_pool_sums(&self.cache);
        // Handed out and not ended: exactly the batches the test holds (taken, and load
        // guards' batches), with their kinds and whether they were started.
        let listed: Vec<(BatchId, BatchKind, bool)> = self.cache.pending_batches();
        let held: Vec<(BatchId, BatchKind, bool)> = self
            .flights
            .iter()
            .map(|(&id, f)| (id, f.batch.kind, f.read.is_some()))
            .collect();
        assert_eq!(listed, held, "pending_batches");
        self.check_tree();
        self.check_requests();
        let [kv, mamba, ..] = counts(&self.cache);
        assert_eq!(kv.caller, self.held_kv.len(), "caller KV pages");
        assert_eq!(mamba.caller, self.held_mamba.len(), "caller state slots");
        for g in &self.guards {
            let committed = self.cache.load_committed(g.id);
            match g.phase {
                Phase::Open | Phase::Failed => assert_eq!(committed, Ok(false), "load {}", g.id),
                Phase::Committed => assert_eq!(committed, Ok(true), "load {}", g.id),
                Phase::Gone => assert!(committed.is_err(), "load {} still pending", g.id),
            }
            assert_eq!(
                self.cache.started(g.id).is_some(),
                g.batch_live,
                "load {} batch in flight",
                g.id
            );
        }
        for (id, f) in &self.flights {
            assert_eq!(
                self.cache.started(*id),
                Some(f.read.is_some()),
                "batch {id} started"
            );
        }
    }

    /// Every node holds the right data wherever the cache says it has data.
    fn check_tree(&self) {
        for n in self.cache.snapshot() {
            if n.prefix.is_empty() {
                continue;
            }
            let h = chain(&n.namespace, &n.prefix);
            let start = n.prefix.len() - n.key_len;
            let what = |tier: &str, p: usize| {
                let id = n.id;
                let prefix = n.prefix.clone();
                let ns = n.namespace.clone();
                let tier = tier.to_owned();
                move || {
                    format!("node {id} {ns:?} {prefix:?} claims it as its {tier} of position {p}")
                }
            };
            if let Some(kv) = n.kv_indices.as_ref().filter(|_| !n.loading) {
                for (k, &s) in kv.iter().enumerate() {
                    let w = what("device KV", start + k);
                    self.store
                        .expect(PoolKind::Kv, Tier::Device, s, h[start + k + 1], &w);
                }
            }
            if let Some(hk) = &n.host_kv_indices {
                for (k, &s) in hk.iter().enumerate() {
                    let w = what("host KV", start + k);
                    self.store
                        .expect(PoolKind::Kv, Tier::Host, s, h[start + k + 1], &w);
                }
            }
            let end = n.prefix.len();
            if let Some(s) = n.mamba_slot {
                assert!(!n.loading, "node {} has a state while loading", n.id);
                let w = what("device state", end);
                self.store.expect(
                    PoolKind::Mamba,
                    Tier::Device,
                    i64::from(s),
                    state_of(&h, end),
                    &w,
                );
            }
            if let Some(s) = n.host_mamba_slot {
                let w = what("host state", end);
                self.store.expect(
                    PoolKind::Mamba,
                    Tier::Host,
                    i64::from(s),
                    state_of(&h, end),
                    &w,
                );
            }
        }
    }

    /// Every live request holds what the test fed it, with the right data.
    fn check_requests(&self) {
        for q in &self.reqs {
            let v = self.cache.request(q.id).unwrap();
            let toks = self.cache.request_tokens(q.id).unwrap();
            assert_eq!(toks, q.tokens, "request {} tokens", q.id);
            assert_eq!(v.len, toks.len(), "request {} len", q.id);
            assert!(v.prefix_len <= v.len && v.prefix_len.is_multiple_of(self.ps));
            let load = self
                .guards
                .iter()
                .find(|g| g.request == Some(q.id) && g.phase != Phase::Gone)
                .map(|g| g.id);
            assert_eq!(v.load_pending, load, "request {} load_pending", q.id);
            if self.hybrid && v.prefix_len > 0 {
                assert!(
                    v.mamba_slot.is_some(),
                    "request {} reuses without a state",
                    q.id
                );
            }
            if !self.hybrid {
                assert_eq!((v.mamba_slot, v.copy_pending), (None, None));
            }
            if self.landing(q.id) {
                continue;
            }
            let kv = self.cache.request_kv_indices(q.id).unwrap();
            assert_eq!(kv.len(), toks.len(), "request {} kv_indices", q.id);
            let h = chain(&q.ns, &toks);
            for (p, &s) in kv.iter().enumerate() {
                let w = || format!("request {} holds it for token {p} of {toks:?}", q.id);
                self.store
                    .expect(PoolKind::Kv, Tier::Device, s, h[p + 1], &w);
            }
            if let (Some(s), None) = (v.mamba_slot, v.copy_pending) {
                let w = || format!("it is request {}'s state after {toks:?}", q.id);
                self.store.expect(
                    PoolKind::Mamba,
                    Tier::Device,
                    i64::from(s),
                    state_of(&h, toks.len()),
                    &w,
                );
            }
        }
    }

    fn check_match(&mut self, ns: &Ns, toks: &[u32], m: &Match) {
        assert_eq!(m.kv_indices.len(), m.device_len);
        assert_eq!(m.device_len % self.ps, 0);
        assert!(m.device_len + m.host_len <= m.kv_len && m.kv_len <= toks.len());
        if m.host_len == 0 {
            assert_eq!(m.host_node, m.node);
        }
        let h = chain(ns, toks);
        for (p, &s) in m.kv_indices.iter().enumerate() {
            let w = || format!("match_prefix returned it for token {p} of {toks:?}");
            self.store
                .expect(PoolKind::Kv, Tier::Device, s, h[p + 1], &w);
        }
        if self.hybrid {
            assert_eq!(m.mamba_slot.is_some(), m.device_len > 0, "{m:?}");
        }
        if let Some(s) = m.mamba_slot {
            let w = || format!("match_prefix returned it as the state after {toks:?}");
            self.store.expect(
                PoolKind::Mamba,
                Tier::Device,
                i64::from(s),
                state_of(&h, m.device_len),
                &w,
            );
        }
        self.remember_node(m.node);
        self.remember_node(m.host_node);
    }

    /// A slot the cache just handed out must be one no known batch in flight touches.
    fn assert_untouched(&self, pool: PoolKind, slot: i64, what: &str) {
        let ps = if pool == PoolKind::Kv { self.ps } else { 1 };
        let page = page_of_slot(slot, ps);
        for (id, f) in &self.flights {
            for c in f.batch.copies.iter().filter(|c| c.pool == pool) {
                for (tier, slots) in [(c.src_tier, &c.src), (c.dst_tier, &c.dst)] {
                    assert!(
                        tier != Tier::Device || slots.iter().all(|&s| page_of_slot(s, ps) != page),
                        "{what} handed out device {} slot {slot}, which batch {id} ({}) in \
                         flight copies",
                        pool.as_str(),
                        f.batch.kind.as_str()
                    );
                }
            }
        }
    }

    // -----------------------------------------------------------------------------------
    // The engine

    fn do_take(&mut self) {
        for b in self.cache.take_batches() {
            assert_ne!(
                b.kind,
                BatchKind::LoadBack,
                "take_batches returned a load's batch"
            );
            assert!(
                !self.acked.contains(&b.id),
                "batch {} acknowledged already",
                b.id
            );
            for c in &b.copies {
                assert_eq!(c.src.len(), c.dst.len());
                let want = match b.kind {
                    BatchKind::Cow => (PoolKind::Mamba, Tier::Device, Tier::Device),
                    _ => (c.pool, Tier::Device, Tier::Host),
                };
                assert_eq!((c.pool, c.src_tier, c.dst_tier), want, "batch {b:?}");
            }
            let id = b.id;
            let old = self.flights.insert(
                id,
                Flight {
                    batch: b,
                    read: None,
                    draining: false,
                },
            );
            assert!(old.is_none(), "batch {id} taken twice");
        }
        for q in &mut self.reqs {
            q.checkpointed = false;
        }
    }

    /// The engine starts a batch: its copies may read their sources from now on.
    fn start(&mut self, id: BatchId) {
        if self.flights[&id].read.is_some() {
            // Started already: refused, and nothing changes.
            let before = self.frozen();
            let r = self.cache.start(id);
            assert!(matches!(r, Err(Error::Request(_))), "second start: {r:?}");
            assert_eq!(self.frozen(), before, "a second start changed the cache");
            return;
        }
        self.cache.start(id).unwrap();
        let f = &self.flights[&id];
        if f.read.is_none() {
            let read = f
                .batch
                .copies
                .iter()
                .map(|c| {
                    c.src
                        .iter()
                        .map(|&s| self.store.get(c.pool, c.src_tier, s))
                        .collect()
                })
                .collect();
            self.flights.get_mut(&id).unwrap().read = Some(read);
        }
    }

    /// Runs a batch to its end (starting it first if need be): its copies land
    /// (`complete`) or leave poison (`fail`).
    fn end_batch(&mut self, id: BatchId, ok: bool) {
        if self.flights[&id].draining {
            // Abandoned: either acknowledgement fails it; its copies may have written
            // the destinations until now.
            let cow_of = self.cow_of(id);
            self.poison_destinations(id);
            self.flights.remove(&id);
            if ok {
                self.cache.complete(id).unwrap();
            } else {
                self.cache.fail(id).unwrap();
            }
            self.push_acked(id);
            self.settle_failure_model(id, cow_of);
            return;
        }
        if self.flights[&id].read.is_none() {
            self.start(id);
        }
        let cow_of = self.cow_of(id);
        if ok {
            let f = self.flights.remove(&id).unwrap();
            let read = f.read.unwrap();
            for (c, vals) in f.batch.copies.iter().zip(&read) {
                for (&s, &v) in c.src.iter().zip(vals) {
                    assert_eq!(
                        self.store.get(c.pool, c.src_tier, s),
                        v,
                        "batch {id} ({}): {} {} slot {s} changed while the copy could read it",
                        f.batch.kind.as_str(),
                        c.src_tier.as_str(),
                        c.pool.as_str()
                    );
                }
            }
            for (c, vals) in f.batch.copies.iter().zip(&read) {
                for (&d, &v) in c.dst.iter().zip(vals) {
                    self.store.set(c.pool, c.dst_tier, d, v);
                }
            }
            self.cache.complete(id).unwrap();
        } else {
            self.poison_destinations(id);
            self.flights.remove(&id);
            self.cache.fail(id).unwrap();
        }
        self.push_acked(id);
        if ok {
            self.settle_guard(id, true);
        } else {
            self.settle_failure_model(id, cow_of);
        }
    }

    /// The model's side of a failed batch `id` (`cow_of`: the request whose admission
    /// copy it was).
    fn settle_failure_model(&mut self, id: BatchId, cow_of: Option<usize>) {
        if let Some(i) = cow_of {
            // A failed admission copy: the request starts over from nothing.
            self.reqs[i].tokens.clear();
        }
        self.settle_guard(id, false);
    }

    fn settle_guard(&mut self, id: BatchId, ok: bool) {
        if let Some(g) = self.guards.iter_mut().find(|g| g.id == id) {
            g.batch_live = false;
            match g.phase {
                Phase::Committed => {
                    g.phase = Phase::Gone;
                    if !ok {
                        if let Some(q) = self.reqs.iter_mut().find(|q| Some(q.id) == g.request) {
                            q.tokens.clone_from(&g.before);
                        }
                    }
                }
                Phase::Open if !ok => g.phase = Phase::Failed,
                _ => {}
            }
        }
        self.guards
            .retain(|g| g.phase != Phase::Gone || g.batch_live);
    }

    /// Before a forward pass of request `i`: the engine runs, in stream order, the copy
    /// into its state (admission) and a committed load of it (in a hybrid cache).
    fn before_forward(&mut self, i: usize) {
        let id = self.reqs[i].id;
        let v = self.cache.request(id).unwrap();
        if let Some(b) = v.copy_pending {
            if !self.flights.contains_key(&b) {
                self.do_take();
            }
            let ok = self.rng.below(6) != 0;
            self.end_batch(b, ok);
        }
        if let Some(b) = v.load_pending {
            // Without states the forward pass writes only fresh KV slots: it may run
            // while the load lands (and the request falls back if the load fails).
            let landing = self
                .guard_of(b)
                .is_some_and(|g| g.phase == Phase::Committed);
            if landing && (self.hybrid || self.rng.coin()) {
                let ok = self.rng.below(6) != 0;
                self.end_batch(b, ok);
            }
        }
    }

    /// Before the forward pass writes request `i`'s state slot `slot`: every copy that
    /// reads it runs first (a checkpoint's copy of the state).
    fn before_state_write(&mut self, i: usize, slot: u32) {
        if self.reqs[i].checkpointed {
            self.do_take();
        }
        let s = i64::from(slot);
        let mut readers = Vec::new();
        for (id, f) in &self.flights {
            for c in f.batch.copies.iter().filter(|c| c.pool == PoolKind::Mamba) {
                assert!(
                    c.dst_tier != Tier::Device || !c.dst.contains(&s),
                    "batch {id} in flight writes request {}'s state slot {slot}",
                    self.reqs[i].id
                );
                if c.src_tier == Tier::Device && c.src.contains(&s) {
                    readers.push(*id);
                }
            }
        }
        for id in readers {
            let ok = self.rng.below(6) != 0;
            self.end_batch(id, ok);
        }
    }

    // -----------------------------------------------------------------------------------
    // Requests

    /// Admits a request for a prompt chosen at run time (when an op needs a request and
    /// there is none): a host-only node's end, an earlier sequence or a system prompt,
    /// with a short continuation.
    fn admit_any(&mut self) {
        let mut prompt = match self.rng.below(3) {
            0 => {
                let ends = self.host_only(&None);
                self.rng
                    .pick(&(0..ends.len()).collect::<Vec<_>>())
                    .map(|k| ends[k].clone())
            }
            1 if !self.history.is_empty() => {
                Some(self.history[self.rng.below(self.history.len())].clone())
            }
            _ => None,
        }
        .unwrap_or_else(|| SYSTEM[self.rng.below(SYSTEM.len())].to_vec());
        for _ in 0..self.rng.below(4) {
            prompt.push(u32_of(self.rng.below(4)));
        }
        prompt.truncate(MAX_REQUEST);
        self.do_admit(&None, &prompt);
    }

    fn do_admit(&mut self, ns: &Ns, prompt: &[u32]) {
        if self.reqs.len() >= MAX_LIVE {
            let pick = self.rng.below(self.reqs.len());
            return self.do_finish(pick);
        }
        let Some(id) = self.cache.admit(ns.as_deref(), prompt).unwrap() else {
            assert!(self.hybrid, "an attention-only admit was refused");
            return self.check();
        };
        let v = self.cache.request(id).unwrap();
        let tokens = self.cache.request_tokens(id).unwrap();
        assert_eq!(tokens, prompt[..v.prefix_len], "admitted tokens");
        assert_eq!(v.len, v.prefix_len);
        if self.hybrid {
            assert_eq!(v.copy_pending.is_some(), v.prefix_len > 0, "{v:?}");
        }
        self.remember_node(v.node);
        self.reqs.push(Req {
            id,
            ns: ns.clone(),
            prompt: prompt.to_vec(),
            tokens,
            host_end: v.prefix_len + v.host_len,
            checkpointed: false,
        });
        self.check();
    }

    fn do_extend(&mut self, pick: usize, from_prompt: bool, count: usize, tail: &[u32]) {
        if self.reqs.is_empty() {
            return self.admit_any();
        }
        let i = pick % self.reqs.len();
        self.before_forward(i);
        let q = &self.reqs[i];
        let cur = q.tokens.clone();
        if cur.len() >= MAX_REQUEST {
            return self.do_finish(i);
        }
        let mut add: Vec<u32> =
            if from_prompt && q.prompt.len() > cur.len() && q.prompt.starts_with(&cur) {
                let rest = &q.prompt[cur.len()..];
                let take = if count == 0 {
                    rest.len()
                } else {
                    count.min(rest.len())
                };
                rest[..take].to_vec()
            } else if tail.is_empty() {
                vec![u32_of(count % 4)]
            } else {
                tail.to_vec()
            };
        add.truncate(MAX_REQUEST - cur.len());
        let (id, ns) = (q.id, q.ns.clone());
        let wb = self.write_back();
        let before = self.frozen().after_refusal(wb);
        let Some(slots) = self.cache.extend(id, &add).unwrap() else {
            assert_eq!(
                self.frozen().after_refusal(wb),
                before,
                "a refused extend changed the cache"
            );
            return self.check();
        };
        assert_eq!(slots.len(), add.len());
        let mut all = cur;
        let from = all.len();
        all.extend_from_slice(&add);
        let h = chain(&ns, &all);
        for (k, &slot) in slots.iter().enumerate() {
            self.assert_untouched(PoolKind::Kv, slot, "extend");
            self.store.dev_kv[idx(slot)] = Some(h[from + k + 1]);
        }
        let len = all.len();
        self.reqs[i].tokens = all;
        let view = self.cache.request(id).unwrap();
        assert_eq!(view.mamba_slot.is_some(), self.hybrid, "{view:?}");
        if let Some(slot) = view.mamba_slot {
            self.before_state_write(i, slot);
            self.store.dev_state[usize::try_from(slot).unwrap()] = Some(state_of(&h, len));
        }
        self.check();
    }

    /// A request call that its pending copy or load must refuse, changing nothing.
    fn refused(&mut self, id: RequestId, finish: bool) {
        let before = self.frozen();
        let r = if finish {
            self.cache.finish(id)
        } else {
            self.cache.checkpoint(id)
        };
        assert!(
            matches!(r, Err(Error::Request(_))),
            "{r:?} with a copy or load pending"
        );
        assert_eq!(self.frozen(), before, "a refused call changed the cache");
        self.check();
    }

    fn pending(&self, id: RequestId) -> bool {
        let v = self.cache.request(id).unwrap();
        v.copy_pending.is_some() || v.load_pending.is_some()
    }

    fn do_checkpoint(&mut self, pick: usize) {
        if self.reqs.is_empty() {
            return self.admit_any();
        }
        let i = pick % self.reqs.len();
        let id = self.reqs[i].id;
        if self.pending(id) {
            return self.refused(id, false);
        }
        self.cache.checkpoint(id).unwrap();
        self.reqs[i].checkpointed = true;
        self.check();
    }

    fn do_finish(&mut self, pick: usize) {
        if self.reqs.is_empty() {
            return self.admit_any();
        }
        let i = pick % self.reqs.len();
        let id = self.reqs[i].id;
        if self.pending(id) {
            return self.refused(id, true);
        }
        self.cache.finish(id).unwrap();
        let q = self.reqs.remove(i);
        assert!(!self.cache.request_live(id));
        remember(&mut self.history, &q.tokens);
        self.check();
    }

    fn do_abort(&mut self, pick: usize) {
        if self.reqs.is_empty() {
            return self.admit_any();
        }
        let q = self.reqs.remove(pick % self.reqs.len());
        self.cache.abort(q.id).unwrap();
        self.check();
    }

    // -----------------------------------------------------------------------------------
    // Low level

    fn do_match(&mut self, ns: &Ns, toks: &[u32]) {
        let p = self.cache.peek_prefix(ns.as_deref(), toks);
        let m = self.cache.match_prefix(ns.as_deref(), toks);
        assert_eq!(
            (p.device_len, p.host_len, p.kv_len),
            (m.device_len, m.host_len, m.kv_len),
            "a peek answers what the match does: {toks:?}"
        );
        let chain = self
            .cache
            .chain_hashes(ns.as_deref(), None, &toks[..p.kv_len]);
        assert_eq!(
            p.kv_hash,
            chain.last().copied(),
            "a peek's hash is the last of the chain of the KV it found"
        );
        self.check_match(ns, toks, &m);
        self.check();
    }

    fn take_kv(&mut self, slots: &[i64], what: &str) {
        for chunk in slots.chunks(self.ps) {
            let p = page_of_slot(chunk[0], self.ps);
            assert_eq!(
                chunk.to_vec(),
                common::page_slots(p, self.ps),
                "{what}: {slots:?}"
            );
            self.assert_untouched(PoolKind::Kv, chunk[0], what);
            assert!(self.held_kv.insert(p), "{what}: page {p} handed out twice");
        }
    }

    fn take_state(&mut self, s: u32, what: &str) {
        self.assert_untouched(PoolKind::Mamba, i64::from(s), what);
        assert!(
            self.held_mamba.insert(s),
            "{what}: slot {s} handed out twice"
        );
    }

    fn do_insert(&mut self, ns: &Ns, mut toks: Vec<u32>, owned: OwnedFrom, state: bool, seed: u64) {
        let ps = self.ps;
        let mut rng = Rng(seed);
        // Slots first: allocating may evict what a match would return.
        let need = toks.len().div_ceil(ps);
        if self.held_kv.len() < need {
            let more = (need - self.held_kv.len()) * ps;
            if let Some(slots) = self.cache.alloc_kv(more).unwrap() {
                self.take_kv(&slots, "alloc_kv");
            }
        }
        toks.truncate(self.held_kv.len() * ps);
        if toks.is_empty() {
            return self.check();
        }
        let mut st = None;
        if state && self.hybrid {
            st = self.held_mamba.iter().next().copied();
            if st.is_none() {
                st = self.cache.alloc_mamba().unwrap();
                if let Some(s) = st {
                    self.take_state(s, "alloc_mamba");
                }
            }
        }
        let m = self.cache.match_prefix(ns.as_deref(), &toks);
        self.check_match(ns, &toks, &m);
        let owned_from = match owned {
            OwnedFrom::Full => m.device_len,
            OwnedFrom::Zero => 0,
            OwnedFrom::Mid => rng.below(m.device_len / ps + 1) * ps,
        };
        let len = toks.len();
        let pages = rng.distinct(&self.held_kv, (len - owned_from).div_ceil(ps));
        let mut kv = m.kv_indices[..owned_from].to_vec();
        kv.extend(caller_slots(&pages, owned_from, len, ps));
        let h = chain(ns, &toks);
        for (p, &s) in kv.iter().enumerate().skip(owned_from) {
            self.store.dev_kv[idx(s)] = Some(h[p + 1]);
        }
        if let Some(s) = st {
            self.store.dev_state[usize::try_from(s).unwrap()] = Some(state_of(&h, len));
        }
        let ins = match st {
            Some(s) => self.cache.insert_with_state(
                ns.as_deref(),
                &toks,
                &kv,
                owned_from,
                Some(i64::from(s)),
            ),
            None => self.cache.insert(ns.as_deref(), &toks, &kv, owned_from),
        }
        .unwrap();
        for p in &pages {
            self.held_kv.remove(p);
        }
        if let Some(s) = st {
            self.held_mamba.remove(&s);
        }
        self.remember_node(ins.node);
        remember(&mut self.history, &toks);
        self.check();
    }

    fn do_alloc_kv(&mut self, pages: usize) {
        if let Some(slots) = self.cache.alloc_kv(pages * self.ps).unwrap() {
            assert_eq!(slots.len(), pages * self.ps);
            self.take_kv(&slots, "alloc_kv");
        }
        self.check();
    }

    fn do_free_kv(&mut self, seed: u64) {
        let mut rng = Rng(seed);
        let k = rng.below(self.held_kv.len() + 1);
        let pages = rng.distinct(&self.held_kv, k);
        let slots: Vec<i64> = pages
            .iter()
            .flat_map(|&p| common::page_slots(p, self.ps))
            .collect();
        assert_eq!(self.cache.free_kv(&slots).unwrap(), slots.len());
        for p in &pages {
            self.held_kv.remove(p);
        }
        self.check();
    }

    fn do_alloc_mamba(&mut self) {
        if self.hybrid && self.held_mamba.len() < 2 {
            if let Some(s) = self.cache.alloc_mamba().unwrap() {
                self.take_state(s, "alloc_mamba");
            }
        }
        self.check();
    }

    fn do_free_mamba(&mut self, pick: usize) {
        let held: Vec<u32> = self.held_mamba.iter().copied().collect();
        if let Some(&s) = held.get(pick % held.len().max(1)) {
            self.cache.free_mamba(i64::from(s)).unwrap();
            self.held_mamba.remove(&s);
        }
        self.check();
    }

    fn do_lock(&mut self, ns: &Ns, toks: &[u32], host: bool) {
        if self.receipts.len() >= MAX_RECEIPTS {
            return self.do_unlock(0);
        }
        let m = self.cache.match_prefix(ns.as_deref(), toks);
        self.check_match(ns, toks, &m);
        let node = if host { m.host_node } else { m.node };
        self.receipts.push(self.cache.lock(node).unwrap());
        self.check();
    }

    fn do_unlock(&mut self, pick: usize) {
        if !self.receipts.is_empty() {
            let l = self.receipts.remove(pick % self.receipts.len());
            self.cache.unlock(l).unwrap();
        }
        self.check();
    }

    fn do_evict(&mut self, kv: usize, mamba: usize) {
        self.cache.evict(kv, mamba);
        self.check();
    }

    // -----------------------------------------------------------------------------------
    // Batches

    /// Batches taken and not acknowledged (loads' batches excluded).
    fn taken(&self) -> Vec<BatchId> {
        self.flights
            .keys()
            .copied()
            .filter(|&id| self.guard_of(id).is_none())
            .collect()
    }

    fn do_ack(&mut self, pick: usize, act: AckAct) {
        let mut taken = self.taken();
        if taken.is_empty() {
            self.do_take();
            taken = self.taken();
            if taken.is_empty() {
                return self.check();
            }
        }
        let id = taken[pick % taken.len()];
        match act {
            AckAct::Start => self.start(id),
            AckAct::Complete => self.end_batch(id, true),
            AckAct::Fail => self.end_batch(id, false),
            AckAct::Abandon => self.abandon(id),
        }
        self.check();
    }

    /// The engine lets go of batch `id`: never started, it fails; started, it stays in
    /// flight as it is (its copies may still write its destinations) until it is
    /// acknowledged, which fails it.
    fn abandon(&mut self, id: BatchId) {
        let started = self.flights[&id].read.is_some();
        let draining = self.flights[&id].draining;
        let cow_of = self.cow_of(id);
        let r = self.cache.abandon(id);
        let want = match (draining, started) {
            (true, _) => Abandoned::Nothing,
            (false, false) => Abandoned::Failed,
            (false, true) => Abandoned::Draining,
        };
        assert_eq!(r, want, "abandon batch {id}");
        if draining {
            return;
        }
        if started {
            if let Some(f) = self.flights.get_mut(&id) {
                f.draining = true;
            }
            return;
        }
        self.poison_destinations(id);
        self.flights.remove(&id);
        self.push_acked(id);
        self.settle_failure_model(id, cow_of);
    }

    /// Remembers an acknowledged batch for the calls that must refuse it (the last 8).
    fn push_acked(&mut self, id: BatchId) {
        self.acked.push(id);
        if self.acked.len() > 8 {
            self.acked.remove(0);
        }
    }

    /// The request whose admission copy batch `id` is, if any.
    fn cow_of(&self, id: BatchId) -> Option<usize> {
        self.reqs
            .iter()
            .position(|q| self.cache.request(q.id).unwrap().copy_pending == Some(id))
    }

    /// Writes poison into every destination of batch `id` (a copy that failed or may
    /// still run leaves its destinations in an unknown state).
    fn poison_destinations(&mut self, id: BatchId) {
        for c in &self.flights[&id].batch.copies {
            for &d in &c.dst {
                self.poisoned += 1;
                self.store
                    .set(c.pool, c.dst_tier, d, Some(POISON | self.poisoned));
            }
        }
    }

    fn do_bad_ack(&mut self, pick: usize, call: u8) {
        if self.acked.is_empty() {
            return self.do_take();
        }
        let id = self.acked[pick % self.acked.len()];
        let before = self.frozen();
        let r = match call {
            0 => self.cache.start(id),
            1 => self.cache.complete(id),
            _ => self.cache.fail(id),
        };
        assert!(
            matches!(
                r,
                Err(Error::InvalidArgument {
                    arg: "batch_id",
                    ..
                })
            ),
            "call {call} on acknowledged batch {id}: {r:?}"
        );
        assert_eq!(
            self.frozen(),
            before,
            "a refused acknowledgement changed the cache"
        );
        self.check();
    }

    // -----------------------------------------------------------------------------------
    // Load-backs

    fn do_load_request(&mut self, pick: usize, quota: Option<usize>) {
        if self.guards.len() >= MAX_GUARDS {
            return self.do_guard(pick, GuardAct::Complete);
        }
        if self.reqs.is_empty() {
            return self.admit_any();
        }
        // Mostly a request that has something to load and may load it.
        let ready: Vec<RequestId> = self
            .reqs
            .iter()
            .map(|q| q.id)
            .filter(|&r| {
                let v = self.cache.request(r).unwrap();
                v.host_len > 0 && v.len == v.prefix_len && v.load_pending.is_none()
            })
            .collect();
        let id = if !pick.is_multiple_of(4) && !ready.is_empty() {
            ready[pick % ready.len()]
        } else {
            self.reqs[pick % self.reqs.len()].id
        };
        let view = self.cache.request(id).unwrap();
        let q = self.reqs.iter().find(|q| q.id == id).unwrap();
        let target = (q.ns.clone(), q.prompt[..q.host_end].to_vec());
        let before = self.frozen();
        let r = self.cache.load_back(LoadTarget::Request(id), quota, None);
        self.on_load(r, target, Some((id, view)), before);
    }

    fn do_load_node(&mut self, op: &Op) {
        let Op::LoadNode {
            pick,
            target,
            with,
            ns,
            toks,
            quota,
        } = op
        else {
            unreachable!()
        };
        let pick = *pick;
        if self.guards.len() >= MAX_GUARDS {
            return self.do_guard(pick, GuardAct::Commit);
        }
        let any_req = (!self.reqs.is_empty()).then(|| self.reqs[pick % self.reqs.len()].id);
        let mut request = any_req.filter(|_| *with);
        let (ns, toks) = match (target, any_req) {
            (Target::Prompt, Some(r)) => {
                let q = self.reqs.iter().find(|q| q.id == r).unwrap();
                (q.ns.clone(), q.prompt.clone())
            }
            (Target::HostOnly, _) => {
                let ns = ns_of(*ns);
                let ends = self.host_only(&ns);
                if ends.is_empty() {
                    let t = self.resolve(&ns, toks);
                    (ns, t)
                } else {
                    let end = ends[pick % ends.len()].clone();
                    if *with {
                        // Mostly a request the node may be loaded for: through it, and
                        // not extended.
                        let fits: Vec<RequestId> = self
                            .reqs
                            .iter()
                            .filter(|q| {
                                q.ns == ns
                                    && q.prompt.starts_with(&end)
                                    && end.starts_with(&q.tokens)
                            })
                            .map(|q| q.id)
                            .filter(|&r| {
                                let v = self.cache.request(r).unwrap();
                                v.len == v.prefix_len
                            })
                            .collect();
                        if !pick.is_multiple_of(5) && !fits.is_empty() {
                            request = Some(fits[pick % fits.len()]);
                        }
                    }
                    (ns, end)
                }
            }
            _ => (ns_of(*ns), self.resolve(&ns_of(*ns), toks)),
        };
        let node = match target {
            Target::Recent if !self.nodes.is_empty() => self.nodes[pick % self.nodes.len()],
            _ => {
                let m = self.cache.match_prefix(ns.as_deref(), &toks);
                self.check_match(&ns, &toks, &m);
                m.host_node
            }
        };
        let stale = self.cache.describe(node).is_err();
        let target = self
            .cache
            .snapshot()
            .into_iter()
            .find(|n| n.id == node)
            .map(|n| (n.namespace, n.prefix))
            .unwrap_or_default();
        let view = request.map(|r| (r, self.cache.request(r).unwrap()));
        let before = self.frozen();
        let r = self
            .cache
            .load_back(LoadTarget::Node(node), *quota, request);
        if stale {
            assert!(matches!(r, Err(Error::StaleNode(_))), "{r:?}");
            assert_eq!(
                self.frozen(),
                before,
                "a refused load_back changed the cache"
            );
            return self.check();
        }
        self.on_load(r, target, view, before);
    }

    /// What `load_back` answered, given the request it was for (and its view before).
    fn on_load(
        &mut self,
        r: Result<Option<LoadRecord>, Error>,
        target: (Ns, Vec<u32>),
        request: Option<(RequestId, RequestView)>,
        before: Frozen,
    ) {
        let busy = request
            .as_ref()
            .is_some_and(|(_, v)| v.copy_pending.is_some() || v.load_pending.is_some());
        let extended = request.as_ref().is_some_and(|(_, v)| v.len != v.prefix_len);
        match r {
            Err(e) => {
                match &e {
                    Error::Request(_) => assert!(busy, "{e}"),
                    Error::InvalidArgument {
                        arg: "request" | "node",
                        ..
                    } => assert!(!busy && request.is_some(), "{e}"),
                    other => panic!("load_back failed: {other}"),
                }
                if extended && !busy {
                    assert!(
                        matches!(e, Error::InvalidArgument { arg: "request", .. }),
                        "{e}"
                    );
                }
                assert_eq!(
                    self.frozen(),
                    before,
                    "a refused load_back changed the cache"
                );
            }
            Ok(None) => {
                assert!(
                    !busy && !extended,
                    "load_back of a busy or extended request"
                );
                let wb = self.write_back();
                assert_eq!(
                    self.frozen().after_refusal(wb),
                    before.after_refusal(wb),
                    "a called-off load_back changed the cache"
                );
            }
            Ok(Some(record)) => {
                assert!(
                    !busy && !extended,
                    "load_back of a busy or extended request"
                );
                self.register_load(record, target, request.map(|(r, _)| r));
            }
        }
        self.check();
    }

    fn register_load(
        &mut self,
        record: LoadRecord,
        target: (Ns, Vec<u32>),
        request: Option<RequestId>,
    ) {
        let id = record.id();
        let batch = record.batch().clone();
        assert_eq!((batch.id, batch.kind), (id, BatchKind::LoadBack));
        assert!(!self.flights.contains_key(&id) && !self.acked.contains(&id));
        let mut kv_tokens = 0;
        let mut states = 0;
        for c in &batch.copies {
            assert_eq!(
                (c.src_tier, c.dst_tier),
                (Tier::Host, Tier::Device),
                "{batch:?}"
            );
            assert_eq!(c.src.len(), c.dst.len());
            for &d in &c.dst {
                self.assert_untouched(c.pool, d, "load_back");
            }
            match c.pool {
                PoolKind::Kv => kv_tokens += c.src.len(),
                PoolKind::Mamba => states += c.src.len(),
                PoolKind::Swa => panic!("this machine draws no SWA layers: {batch:?}"),
            }
        }
        assert_eq!(record.kv_tokens(), kv_tokens);
        assert!(kv_tokens > 0 || states > 0, "an empty load: {batch:?}");
        if self.hybrid && states > 0 {
            assert_eq!(states, if request.is_some() { 2 } else { 1 }, "{batch:?}");
        }
        let before = request
            .and_then(|r| self.reqs.iter().find(|q| q.id == r))
            .map(|q| q.tokens.clone())
            .unwrap_or_default();
        self.flights.insert(
            id,
            Flight {
                batch,
                read: None,
                draining: false,
            },
        );
        self.guards.push(Guard {
            id,
            record: Some(record),
            target,
            request,
            before,
            phase: Phase::Open,
            batch_live: true,
        });
    }

    /// The guard is dropped uncommitted (or released explicitly).
    fn cancel(&mut self, gi: usize) {
        let Some(record) = self.guards[gi].record.take() else {
            return;
        };
        self.cache.cancel_load(record);
        self.cancelled(gi);
    }

    /// Bookkeeping after guard `gi`'s load was called off.
    fn cancelled(&mut self, gi: usize) {
        let id = self.guards[gi].id;
        let started = self.flights.get(&id).is_some_and(|f| f.read.is_some());
        let g = &mut self.guards[gi];
        g.phase = Phase::Gone;
        if g.batch_live && !started {
            // Never started: the batch is withdrawn and its slots free at once.
            g.batch_live = false;
            self.flights.remove(&id);
        }
        self.guards
            .retain(|g| g.phase != Phase::Gone || g.batch_live);
    }

    fn do_guard(&mut self, pick: usize, act: GuardAct) {
        if self.guards.is_empty() {
            return self.do_load_request(pick, None);
        }
        let gi = pick % self.guards.len();
        let (id, phase, batch_live, request) = {
            let g = &self.guards[gi];
            (g.id, g.phase, g.batch_live, g.request)
        };
        let before = self.frozen();
        match act {
            GuardAct::Start | GuardAct::Complete | GuardAct::Fail if !batch_live => {
                let r = match act {
                    GuardAct::Start => self.cache.start(id),
                    GuardAct::Complete => self.cache.complete(id),
                    _ => self.cache.fail(id),
                };
                assert!(
                    matches!(
                        r,
                        Err(Error::InvalidArgument {
                            arg: "batch_id",
                            ..
                        })
                    ),
                    "{act:?} of load {id} whose batch is over: {r:?}"
                );
                assert_eq!(self.frozen(), before, "a refused {act:?} changed the cache");
            }
            GuardAct::Start => self.start(id),
            GuardAct::Complete => self.end_batch(id, true),
            GuardAct::Fail => self.end_batch(id, false),
            GuardAct::Commit => {
                let extended = request
                    .filter(|&r| self.cache.request_live(r))
                    .is_some_and(|r| {
                        let v = self.cache.request(r).unwrap();
                        v.len != v.prefix_len
                    });
                let busy = self.landing_on(&self.guards[gi].target);
                // A committed or released load has no record: nothing to commit.
                if let Some(record) = self.guards[gi].record.take() {
                    let r = self.cache.commit_load(record);
                    if phase != Phase::Open || extended || busy {
                        assert!(
                            matches!(r, Err(Error::Request(_))),
                            "commit of load {id} ({phase:?}, extended {extended}, busy {busy}): \
                             {r:?}"
                        );
                        // A refused commit calls the load off.
                        self.cancelled(gi);
                    } else {
                        r.unwrap();
                        self.committed(gi);
                    }
                }
            }
            GuardAct::Cancel => self.cancel(gi),
        }
        self.check();
    }

    /// Bookkeeping after a successful commit of guard `gi`.
    fn committed(&mut self, gi: usize) {
        let g = &mut self.guards[gi];
        g.phase = if g.batch_live {
            Phase::Committed
        } else {
            Phase::Gone
        };
        if let Some(q) = self.reqs.iter_mut().find(|q| Some(q.id) == g.request) {
            let now = self.cache.request_tokens(q.id).unwrap();
            assert!(
                now.starts_with(&q.tokens),
                "a load moved request {} from {:?} to {now:?}",
                q.id,
                q.tokens
            );
            let v = self.cache.request(q.id).unwrap();
            assert_eq!(v.prefix_len, now.len(), "{v:?}");
            q.tokens = now;
        }
        self.guards
            .retain(|g| g.phase != Phase::Gone || g.batch_live);
    }

    // -----------------------------------------------------------------------------------

    fn step(&mut self, op: &Op) {
        match op {
            Op::Admit { ns, toks } => {
                let t = self.resolve(&ns_of(*ns), toks);
                self.do_admit(&ns_of(*ns), &t);
            }
            Op::Extend {
                pick,
                from_prompt,
                n,
                tail,
            } => self.do_extend(*pick, *from_prompt, *n, tail),
            Op::Checkpoint { pick } => self.do_checkpoint(*pick),
            Op::Finish { pick } => self.do_finish(*pick),
            Op::Abort { pick } => self.do_abort(*pick),
            Op::Match { ns, toks } => {
                let t = self.resolve(&ns_of(*ns), toks);
                self.do_match(&ns_of(*ns), &t);
            }
            Op::Insert {
                ns,
                toks,
                owned,
                state,
                seed,
            } => {
                let t = self.resolve(&ns_of(*ns), toks);
                self.do_insert(&ns_of(*ns), t, *owned, *state, *seed);
            }
            Op::AllocKv { pages } => self.do_alloc_kv(*pages),
            Op::FreeKv { seed } => self.do_free_kv(*seed),
            Op::AllocMamba => self.do_alloc_mamba(),
            Op::FreeMamba { pick } => self.do_free_mamba(*pick),
            Op::Lock { ns, toks, host } => {
                let t = self.resolve(&ns_of(*ns), toks);
                self.do_lock(&ns_of(*ns), &t, *host);
            }
            Op::Unlock { pick } => self.do_unlock(*pick),
            Op::Evict { kv, mamba } => self.do_evict(*kv, *mamba),
            Op::Take => {
                self.do_take();
                self.check();
            }
            Op::Ack { pick, act } => self.do_ack(*pick, *act),
            Op::BadAck { pick, call } => self.do_bad_ack(*pick, *call),
            Op::LoadRequest { pick, quota } => self.do_load_request(*pick, *quota),
            Op::LoadNode { .. } => self.do_load_node(op),
            Op::Guard { pick, act } => self.do_guard(*pick, *act),
        }
    }

    /// Acknowledges every batch, calls off every uncommitted load, aborts every request
    /// and gives back every slot and receipt: nothing may be left but free and cached
    /// pages. Then evicting everything must empty the device pools.
    fn teardown(&mut self) {
        for round in 0.. {
            assert!(round < 64, "batches keep coming");
            self.do_take();
            if self.flights.is_empty() && self.guards.is_empty() {
                break;
            }
            let ids: Vec<BatchId> = self.flights.keys().copied().collect();
            for id in ids {
                if self.flights.contains_key(&id) {
                    self.end_batch(id, true);
                }
            }
            while let Some(gi) = self
                .guards
                .iter()
                .position(|g| matches!(g.phase, Phase::Open | Phase::Failed))
            {
                self.cancel(gi);
            }
            self.check();
        }
        while !self.reqs.is_empty() {
            self.do_abort(0);
        }
        while !self.receipts.is_empty() {
            self.do_unlock(0);
        }
        let held: Vec<i64> = self
            .held_kv
            .iter()
            .flat_map(|&p| common::page_slots(p, self.ps))
            .collect();
        assert_eq!(self.cache.free_kv(&held).unwrap(), held.len());
        self.held_kv.clear();
        for s in std::mem::take(&mut self.held_mamba) {
            self.cache.free_mamba(i64::from(s)).unwrap();
        }
        self.check();
        let config = self.cache.config().clone();
        let caps = [
            config.kv_slots / self.ps,
            config.mamba_slots,
            config.host_kv_slots / self.ps,
            config.host_mamba_slots,
        ];
        for (c, cap) in counts(&self.cache).iter().zip(caps) {
            assert_eq!((c.owned, c.caller, c.draining), (0, 0, 0), "leak: {c:?}");
            assert_eq!(c.free + c.tree, cap, "leak: {c:?}");
        }
        for round in 0.. {
            assert!(round < 64, "eviction keeps emitting batches");
            self.cache.evict(usize::MAX, usize::MAX);
            self.do_take();
            if self.flights.is_empty() {
                break;
            }
            let ids: Vec<BatchId> = self.flights.keys().copied().collect();
            for id in ids {
                self.end_batch(id, true);
            }
            self.check();
        }
        self.check();
        assert_eq!(self.cache.total_size(), 0);
        let [kv, mamba, ..] = counts(&self.cache);
        assert_eq!(
            kv.free, caps[0],
            "device KV after evicting everything: {kv:?}"
        );
        assert_eq!(
            mamba.free, caps[1],
            "device states after evicting everything: {mamba:?}"
        );
    }
}

fn run(config: &Config, seed: u64, ops: &[Op]) {
    let mut machine = Machine::new(config, seed);
    machine.check();
    for op in ops {
        machine.step(op);
    }
    machine.teardown();
}

/// 48 cases per entry point (~19,000 steps in all); `PROPTEST_CASES` sets another
/// number, for a longer soak.
fn cases() -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(48);
    ProptestConfig {
        cases,
        ..proptest_config("proptest-regressions/host_machine.txt")
    }
}

proptest! {
    #![proptest_config(cases())]

    #[test]
    fn host_tier_keeps_data_right_attention_only(
        config in kv_config(),
        seed in any::<u64>(),
        ops in prop::collection::vec(op(), 1..=400),
    ) {
        run(&config, seed, &ops);
    }

    #[test]
    fn host_tier_keeps_data_right_hybrid(
        config in hybrid_config(),
        seed in any::<u64>(),
        ops in prop::collection::vec(op(), 1..=400),
    ) {
        run(&config, seed, &ops);
    }
}

// ---------------------------------------------------------------------------------------
// Regressions found by the machine, minimised by hand

/// Write-through, attention-only, page size 1: `[1, 2]` and `[1, 2, 3, 4]` cached,
/// backed up and demoted, so both nodes are host-only. Returns the cache and the nodes
/// `[1, 2]` and `[1, 2, 3, 4]`.
fn two_demoted_nodes() -> (Cache, NodeId, NodeId) {
    let mut c = Cache::new(Config {
        kv_slots: 16,
        page_size: 1,
        host_kv_slots: 16,
        ..Config::default()
    })
    .unwrap();
    let kv = c.alloc_kv(2).unwrap().unwrap();
    let upper = c.insert(None, &[1, 2], &kv, 0).unwrap().node;
    let kv = c.alloc_kv(2).unwrap().unwrap();
    let m = c.match_prefix(None, &[1, 2, 3, 4]);
    let mut all = m.kv_indices.clone();
    all.extend(&kv);
    let lower = c.insert(None, &[1, 2, 3, 4], &all, 2).unwrap().node;
    for b in c.take_batches() {
        c.complete(b.id).unwrap();
    }
    c.evict(usize::MAX, 0);
    let m = c.match_prefix(None, &[1, 2, 3, 4]);
    assert_eq!((m.device_len, m.host_len, m.host_node), (0, 4, lower));
    c.audit().unwrap();
    (c, upper, lower)
}

/// A load of `[1, 2, 3, 4]` must not publish `[3, 4]` below `[1, 2]` while another
/// load-back's copies into `[1, 2]` are still in flight.
#[test]
fn committing_a_load_below_a_node_another_load_is_landing_is_refused() {
    let (mut c, upper, lower) = two_demoted_nodes();
    let deep = c
        .load_back(LoadTarget::Node(lower), None, None)
        .unwrap()
        .unwrap();
    let shallow = c
        .load_back(LoadTarget::Node(upper), None, None)
        .unwrap()
        .unwrap();
    let (deep_id, shallow_id) = (deep.id(), shallow.id());
    c.commit_load(shallow).unwrap();
    c.start(deep_id).unwrap();
    c.complete(deep_id).unwrap();
    let r = c.commit_load(deep);
    c.audit().unwrap();
    assert!(matches!(r, Err(Error::Request(_))), "{r:?}");
    assert!(
        c.load_committed(deep_id).is_err(),
        "a refused commit calls it off"
    );
    c.start(shallow_id).unwrap();
    c.complete(shallow_id).unwrap();
    assert_eq!(c.match_prefix(None, &[1, 2, 3, 4]).device_len, 2);
    c.audit().unwrap();
}

/// The other order: once the deep load is committed, a load of `[1, 2]` that lands
/// first must not mark `[1, 2]` as landed while the deep load's copies into it run.
#[test]
fn committing_a_load_of_a_node_another_load_is_landing_is_refused() {
    let (mut c, upper, lower) = two_demoted_nodes();
    let deep = c
        .load_back(LoadTarget::Node(lower), None, None)
        .unwrap()
        .unwrap();
    let shallow = c
        .load_back(LoadTarget::Node(upper), None, None)
        .unwrap()
        .unwrap();
    let (deep_id, shallow_id) = (deep.id(), shallow.id());
    c.commit_load(deep).unwrap();
    c.start(shallow_id).unwrap();
    c.complete(shallow_id).unwrap();
    let r = c.commit_load(shallow);
    assert_eq!(
        c.match_prefix(None, &[1, 2, 3, 4]).device_len,
        0,
        "the deep load's copies have not landed: nothing of it may match"
    );
    assert!(matches!(r, Err(Error::Request(_))), "{r:?}");
    c.start(deep_id).unwrap();
    c.complete(deep_id).unwrap();
    assert_eq!(c.match_prefix(None, &[1, 2, 3, 4]).device_len, 4);
    c.audit().unwrap();
}

/// Hybrid, page size 1: `[1, 2]` keeps its KV on the device but its state only on the
/// host (evicted there after a backup); for a request reusing `[1, 2, 3]` there is
/// nothing to load at `[1, 2]`: loading the state there would move the request back to
/// a shorter prefix.
#[test]
fn loading_a_node_above_a_requests_prefix_for_it_loads_nothing() {
    let mut c = Cache::new(Config {
        kv_slots: 16,
        page_size: 1,
        mamba_slots: 4,
        host_kv_slots: 16,
        host_mamba_slots: 4,
        ..Config::default()
    })
    .unwrap();
    let kv = c.alloc_kv(2).unwrap().unwrap();
    let s = c.alloc_mamba().unwrap().map(i64::from);
    let upper = c.insert_with_state(None, &[1, 2], &kv, 0, s).unwrap().node;
    let m = c.match_prefix(None, &[1, 2, 3]);
    let mut kv = m.kv_indices.clone();
    kv.extend(c.alloc_kv(1).unwrap().unwrap());
    let s = c.alloc_mamba().unwrap().map(i64::from);
    c.insert_with_state(None, &[1, 2, 3], &kv, 2, s).unwrap();
    for b in c.take_batches() {
        c.complete(b.id).unwrap();
    }
    // Both states used by a match (protected), [1, 2]'s first: the least recently used.
    c.match_prefix(None, &[1, 2, 3]);
    // [1, 2]'s state goes: a tombstone now, backed up on the host.
    assert_eq!(c.evict(0, 1).mamba_states, 1);
    let r = c.admit(None, &[1, 2, 3, 5]).unwrap().unwrap();
    for b in c.take_batches() {
        c.complete(b.id).unwrap();
    }
    assert_eq!(c.request(r).unwrap().prefix_len, 3);
    c.audit().unwrap();
    let before = (c.snapshot(), c.request(r).unwrap());
    let out = c.load_back(LoadTarget::Node(upper), None, Some(r));
    assert!(matches!(out, Ok(None)), "{out:?}");
    assert_eq!((c.snapshot(), c.request(r).unwrap()), before);
    c.audit().unwrap();
}

/// Attention-only, page size 1: `[1, 2]` cached in the default namespace and, demoted to
/// the host, in namespace `"a"`. A request of the default namespace may not load the
/// node of namespace `"a"` for itself: it was not admitted through it (the tokens
/// agree, the tree does not).
#[test]
fn loading_a_node_of_another_namespace_for_a_request_is_refused() {
    let mut c = Cache::new(Config {
        kv_slots: 16,
        page_size: 1,
        host_kv_slots: 16,
        ..Config::default()
    })
    .unwrap();
    let kv = c.alloc_kv(2).unwrap().unwrap();
    c.insert(Some("a"), &[1, 2], &kv, 0).unwrap();
    for b in c.take_batches() {
        c.complete(b.id).unwrap();
    }
    assert_eq!(c.evict(2, 0).kv_tokens, 2);
    let kv = c.alloc_kv(2).unwrap().unwrap();
    c.insert(None, &[1, 2], &kv, 0).unwrap();
    for b in c.take_batches() {
        c.complete(b.id).unwrap();
    }
    let r = c.admit(None, &[1, 2, 3]).unwrap().unwrap();
    assert_eq!(c.request(r).unwrap().prefix_len, 2);
    let m = c.match_prefix(Some("a"), &[1, 2]);
    assert_eq!((m.device_len, m.host_len), (0, 2));
    c.audit().unwrap();
    let before = (c.snapshot(), c.request(r).unwrap());
    let out = c.load_back(LoadTarget::Node(m.host_node), None, Some(r));
    assert!(
        matches!(out, Err(Error::InvalidArgument { arg: "request", .. })),
        "{out:?}"
    );
    assert_eq!((c.snapshot(), c.request(r).unwrap()), before);
    c.finish(r).unwrap();
    c.audit().unwrap();
}

/// Attention-only, page size 1: a request admitted for `[1, 2, 3, 4]` (`[3, 4]` on the
/// host only) that went on with `[5, 6]` instead and checkpointed there holds
/// `[1, 2, 5, 6]`; loading its admission's host node for it would swap its tokens for
/// `[1, 2, 3, 4]`. Refused: the node is not on its path any more.
#[test]
fn loading_a_node_off_a_checkpointed_requests_path_is_refused() {
    let (mut c, _, lower) = two_demoted_nodes();
    let kv = c.alloc_kv(2).unwrap().unwrap();
    c.insert(None, &[1, 2], &kv, 0).unwrap();
    for b in c.take_batches() {
        c.complete(b.id).unwrap();
    }
    let r = c.admit(None, &[1, 2, 3, 4]).unwrap().unwrap();
    let v = c.request(r).unwrap();
    assert_eq!((v.prefix_len, v.host_len), (2, 2));
    c.extend(r, &[5, 6]).unwrap().unwrap();
    c.checkpoint(r).unwrap();
    assert_eq!(c.request(r).unwrap().prefix_len, 4);
    assert_eq!(c.request_tokens(r).unwrap(), [1, 2, 5, 6]);
    c.audit().unwrap();
    let before = (c.snapshot(), c.request(r).unwrap());
    for out in [
        c.load_back(LoadTarget::Request(r), None, None),
        c.load_back(LoadTarget::Node(lower), None, Some(r)),
    ] {
        assert!(
            matches!(out, Err(Error::InvalidArgument { arg: "request", .. })),
            "{out:?}"
        );
    }
    assert_eq!((c.snapshot(), c.request(r).unwrap()), before);
    c.finish(r).unwrap();
    for b in c.take_batches() {
        c.complete(b.id).unwrap();
    }
    c.audit().unwrap();
}
