//! Coverage-guided fuzzing of `radixcache_core::Cache`: arbitrary sequences of the core's
//! operations and arguments, valid and not, with `audit()` after every step and a
//! no-leak check at the end.
//!
//! The input is a small configuration (page size 1/2/4, 4..=64 device KV slots, 0..=6
//! state slots, an optional host tier, a write policy and an eviction policy per
//! component) and up to `MAX_OPS` operations; inserts and admissions carry priorities.
//! Arguments are drawn from small alphabets (tokens 0..4, a few shared system prompts,
//! earlier sequences, live requests' prompts) so that prefixes collide and nodes split,
//! and from the harness's own bookkeeping (slots it holds, node ids it saw, receipts,
//! requests, batch ids, load records), often corrupted: garbage or duplicate slots, a
//! wrong `owned_from`, stale or forged ids, another cache's ids.
//!
//! What counts as a finding (a panic):
//!
//! * any panic inside the core (including its `debug_assert!`s: build with `-a`);
//! * `Error::Invariant` from anything but `audit()`, or `Error::Broken`;
//! * `audit()` failing after any operation;
//! * the caller-held slots in the pools differing from the harness's books (a failed call
//!   must change nothing; a successful `insert`/`free_kv`/`free_mamba` consumes exactly
//!   the slots it was given, and only slots the caller held);
//! * a call the API documents as valid failing (unlocking a live receipt, freeing held
//!   slots, `alloc_kv` of whole pages), or one it must refuse succeeding (another cache's
//!   ids);
//! * at the end, once everything is given back: a pool with owned, caller or draining
//!   pages, or free + tree != capacity; after evicting everything, device pages left in
//!   the tree.
//!
//! An input whose first byte is `engine::ENGINE_MODE` runs the rest with engine-owned
//! pools instead (module `engine`, which lists its own findings).
//!
//! The harness is deterministic: the same input always makes the same calls.

#![no_main]

mod engine;

use std::collections::{BTreeSet, HashSet};

use arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use radixcache_core::{
    BatchId, Cache, Config, Error, EvictionPolicies, EvictionPolicy, LoadRecord, LoadTarget,
    LockReceipt, NodeId, Pool, RequestId, WritePolicy,
};

/// Operations run per input at most.
const MAX_OPS: usize = 300;
/// Longest token sequence.
const MAX_TOKENS: usize = 40;
/// Remembered node ids / sequences / acknowledged batch ids (rings).
const MAX_NODES: usize = 16;
const MAX_HISTORY: usize = 8;
const MAX_GONE: usize = 8;
/// Receipts and load records the harness holds at most (beyond: the oldest is given back).
const MAX_RECEIPTS: usize = 8;
const MAX_LOADS: usize = 6;

/// Shared prefixes: the first two share four tokens, the first and the last three (a
/// divergence inside a page of 2 or 4), the third shares nothing.
const SYSTEM: [&[u32]; 4] = [
    &[0, 1, 2, 3, 0, 1, 2, 3],
    &[0, 1, 2, 3, 3, 3, 2, 2],
    &[2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0],
    &[0, 1, 2, 0, 1, 2, 0, 1],
];

// ---------------------------------------------------------------------------------------
// Input

#[derive(Arbitrary, Debug)]
struct Input {
    cfg: Cfg,
    ops: Vec<Op>,
}

#[derive(Arbitrary, Debug)]
struct Cfg {
    page: u8,
    kv: u8,
    mamba: u8,
    host: u8,
    host_mamba: u8,
    policy: u8,
    threshold: u8,
    /// The eviction policy of each component (KV and SWA: lru, lfu, priority; states:
    /// any); bit 7: page hashes, bits 7 and 6: KV events too.
    eviction: u8,
    /// Odd without a host tier: SWA layers (pool size and window drawn from the rest).
    swa: u8,
    /// 0: batches run only when the ops say so; 1: an engine runs (completes) every batch
    /// after every op, as a scheduler would; 2: the same, failing some; 3: it starts every
    /// batch after every op and completes them after every fourth.
    engine: u8,
}

/// Tokens: a base (none, a system prompt, an earlier sequence, a request's prompt, where a
/// node with KV on the host only ends), cut somewhere (one time in four), then a tail over
/// the alphabet 0..4 (rarely a huge token).
#[derive(Arbitrary, Debug)]
struct Toks {
    base: u8,
    cut: u8,
    tail: Vec<u8>,
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum Ack {
    Start,
    Complete,
    Fail,
    /// Its owner lets go of it before it ended (`Cache::abandon`).
    Abandon,
}

#[derive(Debug)]
enum Target {
    /// A remembered node id (perhaps stale).
    Node(u8),
    /// A node with KV on the host only (from the snapshot), or one of its host-only
    /// ancestors (`up`), so that load-backs overlap.
    HostOnly { ns: u8, k: u8, up: u8 },
    /// The `host_node` of a fresh match (what a scheduler would load).
    HostOf { ns: u8, toks: Toks },
    /// `LoadTarget::Request` of a request, live or not.
    Request(u8),
    /// A node of another cache.
    Foreign,
}

/// How an insert's arguments are spoiled (`None` three times: most inserts are valid).
#[derive(Arbitrary, Debug, Clone, Copy)]
enum Corrupt {
    None,
    None2,
    None3,
    /// The second page's slots name the first page again.
    DupPage,
    /// One slot out of range.
    OutOfRange(u8, u8),
    /// One slot moved by one.
    Shift(u8),
    /// One caller page replaced by a page of the tree.
    TreeSlot(u8),
    /// One caller page replaced by an arbitrary page (free, the tree's, a request's...).
    Unowned(u8, u8),
    /// One slot too many or too few.
    Length(bool),
    /// `owned_from` moved.
    OwnedFrom(i8),
    /// `kv_indices[..owned_from]` not the tree's slots.
    Prefix(u8),
}

#[derive(Debug)]
enum Op {
    Match {
        ns: u8,
        toks: Toks,
    },
    Insert {
        ns: u8,
        toks: Toks,
        owned: u8,
        fresh: bool,
        state: u8,
        bad: Corrupt,
        seed: u8,
    },
    AllocKv {
        n: u8,
    },
    FreeKv {
        how: u8,
        seed: u8,
    },
    AllocMamba,
    FreeMamba {
        how: u8,
        pick: u8,
    },
    Lock {
        node: u8,
    },
    Unlock {
        pick: u8,
    },
    DropReceipt {
        pick: u8,
        reap: bool,
    },
    Evict {
        kv: u8,
        mamba: u8,
    },
    EvictHost {
        kv: u8,
        mamba: u8,
    },
    Admit {
        ns: u8,
        toks: Toks,
        priority: i8,
    },
    Extend {
        req: u8,
        n: u8,
        tail: Vec<u8>,
    },
    /// A decode step over the requests `reqs` picks (repeats included: refused).
    ExtendBatch {
        reqs: Vec<u8>,
        short: bool,
    },
    Checkpoint {
        req: u8,
    },
    Finish {
        req: u8,
    },
    Abort {
        req: u8,
    },
    Take,
    /// What an engine does each step: takes the batches and runs every batch in flight
    /// (load-backs' too): completes them, fails some, or only starts them.
    Engine {
        mode: u8,
        mask: u8,
    },
    Batch {
        which: u8,
        pick: u8,
        act: Ack,
    },
    LoadBack {
        target: Target,
        quota: Option<u8>,
        req: Option<u8>,
        /// What happens to the record at once: kept, committed, or its batch started.
        then: u8,
    },
    Commit {
        pick: u8,
    },
    Cancel {
        pick: u8,
    },
    DropLoad {
        pick: u8,
        reap: bool,
    },
    Reap,
    Report {
        node: u8,
        req: u8,
    },
    Foreign {
        what: u8,
    },
}

impl<'a> Arbitrary<'a> for Target {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        // Mostly what a scheduler loads: a match's host part, or a request's.
        Ok(match u8::arbitrary(u)? % 8 {
            0 | 1 => Target::HostOf {
                ns: u.arbitrary()?,
                toks: u.arbitrary()?,
            },
            2 | 3 => Target::HostOnly {
                ns: u.arbitrary()?,
                k: u.arbitrary()?,
                up: u.arbitrary()?,
            },
            4 | 5 => Target::Request(u.arbitrary()?),
            6 => Target::Node(u.arbitrary()?),
            _ => Target::Foreign,
        })
    }
}

/// Operation kinds, each listed as many times as its weight: the calls that build and
/// move state (insert, match, requests, eviction, load-backs, the engine) come often,
/// pure misuse less, so that the chains the host tier needs (insert, back up, evict,
/// match on the host, load back, commit, complete) are short in expectation.
#[derive(Clone, Copy)]
enum Kind {
    Match,
    Insert,
    AllocKv,
    FreeKv,
    AllocMamba,
    FreeMamba,
    Lock,
    Unlock,
    DropReceipt,
    Evict,
    EvictHost,
    Admit,
    Extend,
    ExtendBatch,
    Checkpoint,
    Finish,
    Abort,
    Take,
    Engine,
    Batch,
    LoadBack,
    Commit,
    Cancel,
    DropLoad,
    Reap,
    Report,
    Foreign,
}

const WEIGHTS: [(Kind, u8); 27] = [
    (Kind::Match, 5),
    (Kind::Insert, 10),
    (Kind::AllocKv, 2),
    (Kind::FreeKv, 2),
    (Kind::AllocMamba, 1),
    (Kind::FreeMamba, 1),
    (Kind::Lock, 2),
    (Kind::Unlock, 2),
    (Kind::DropReceipt, 1),
    (Kind::Evict, 5),
    (Kind::EvictHost, 1),
    (Kind::Admit, 5),
    (Kind::Extend, 5),
    (Kind::Checkpoint, 2),
    (Kind::Finish, 3),
    (Kind::Abort, 1),
    (Kind::Take, 1),
    (Kind::Engine, 3),
    (Kind::Batch, 3),
    (Kind::LoadBack, 6),
    (Kind::Commit, 3),
    (Kind::Cancel, 1),
    (Kind::DropLoad, 1),
    (Kind::Reap, 1),
    (Kind::Report, 1),
    (Kind::Foreign, 1),
    (Kind::ExtendBatch, 3),
];

fn kind_of(k: u8) -> Kind {
    let total: u32 = WEIGHTS.iter().map(|&(_, w)| u32::from(w)).sum();
    let mut x = u32::from(k) % total;
    for &(kind, w) in &WEIGHTS {
        if x < u32::from(w) {
            return kind;
        }
        x -= u32::from(w);
    }
    Kind::Reap
}

impl<'a> Arbitrary<'a> for Op {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        Ok(match kind_of(u.arbitrary()?) {
            Kind::Match => Op::Match {
                ns: u.arbitrary()?,
                toks: u.arbitrary()?,
            },
            Kind::Insert => Op::Insert {
                ns: u.arbitrary()?,
                toks: u.arbitrary()?,
                owned: u.arbitrary()?,
                // Mostly with fresh slots: the harness rarely holds enough otherwise.
                fresh: u8::arbitrary(u)? % 4 != 0,
                state: u.arbitrary()?,
                bad: u.arbitrary()?,
                seed: u.arbitrary()?,
            },
            Kind::AllocKv => Op::AllocKv { n: u.arbitrary()? },
            Kind::FreeKv => Op::FreeKv {
                how: u.arbitrary()?,
                seed: u.arbitrary()?,
            },
            Kind::AllocMamba => Op::AllocMamba,
            Kind::FreeMamba => Op::FreeMamba {
                how: u.arbitrary()?,
                pick: u.arbitrary()?,
            },
            Kind::Lock => Op::Lock {
                node: u.arbitrary()?,
            },
            Kind::Unlock => Op::Unlock {
                pick: u.arbitrary()?,
            },
            Kind::DropReceipt => Op::DropReceipt {
                pick: u.arbitrary()?,
                reap: u.arbitrary()?,
            },
            Kind::Evict => Op::Evict {
                kv: u.arbitrary()?,
                mamba: u.arbitrary()?,
            },
            Kind::EvictHost => Op::EvictHost {
                kv: u.arbitrary()?,
                mamba: u.arbitrary()?,
            },
            Kind::Admit => Op::Admit {
                ns: u.arbitrary()?,
                toks: u.arbitrary()?,
                priority: u.arbitrary()?,
            },
            Kind::Extend => Op::Extend {
                req: u.arbitrary()?,
                n: u.arbitrary()?,
                tail: u.arbitrary()?,
            },
            Kind::ExtendBatch => Op::ExtendBatch {
                reqs: u.arbitrary()?,
                short: u8::arbitrary(u)? % 8 == 0,
            },
            Kind::Checkpoint => Op::Checkpoint {
                req: u.arbitrary()?,
            },
            Kind::Finish => Op::Finish {
                req: u.arbitrary()?,
            },
            Kind::Abort => Op::Abort {
                req: u.arbitrary()?,
            },
            Kind::Take => Op::Take,
            Kind::Engine => Op::Engine {
                mode: u.arbitrary()?,
                mask: u.arbitrary()?,
            },
            Kind::Batch => Op::Batch {
                which: u.arbitrary()?,
                pick: u.arbitrary()?,
                act: u.arbitrary()?,
            },
            Kind::LoadBack => Op::LoadBack {
                target: u.arbitrary()?,
                quota: u.arbitrary()?,
                req: u.arbitrary()?,
                then: u.arbitrary()?,
            },
            Kind::Commit => Op::Commit {
                pick: u.arbitrary()?,
            },
            Kind::Cancel => Op::Cancel {
                pick: u.arbitrary()?,
            },
            Kind::DropLoad => Op::DropLoad {
                pick: u.arbitrary()?,
                reap: u.arbitrary()?,
            },
            Kind::Reap => Op::Reap,
            Kind::Report => Op::Report {
                node: u.arbitrary()?,
                req: u.arbitrary()?,
            },
            Kind::Foreign => Op::Foreign {
                what: u.arbitrary()?,
            },
        })
    }
}

fn config_of(c: &Cfg) -> Config {
    let ps = [1usize, 2, 4][usize::from(c.page % 3)];
    let kv_slots = (4 + usize::from(c.kv % 61)) / ps * ps;
    // Attention-only half the time: a hybrid cache matches only up to a state.
    let mamba_slots = if c.mamba.is_multiple_of(2) {
        0
    } else {
        usize::from((c.mamba / 2) % 7)
    };
    let host_kv_slots = if c.host.is_multiple_of(2) {
        0
    } else {
        usize::from((c.host / 2) % 65) / ps * ps
    };
    let host_mamba_slots = if mamba_slots > 0 && host_kv_slots > 0 {
        usize::from(c.host_mamba % 7)
    } else {
        0
    };
    let write_policy = if host_kv_slots == 0 {
        WritePolicy::WriteThrough
    } else {
        [
            WritePolicy::WriteThrough,
            WritePolicy::WriteThroughSelective,
            WritePolicy::WriteBack,
        ][usize::from(c.policy % 3)]
    };
    // 0 is refused by `Config::validate` (one selective config in eight): that path runs
    // too, and the input ends there.
    let write_through_threshold = (write_policy == WritePolicy::WriteThroughSelective
        && c.threshold % 2 == 1)
        .then_some(u32::from((c.threshold / 2) % 4));
    // SWA layers half the time: windows of 1 to 4 tokens against pages of 1 to 4 (a
    // page larger than the window included), pools of up to 32 slots (0 is refused by
    // `Config::validate`: that path runs too); with a host tier, a host SWA pool of one
    // page up to the host KV pool (more, one time in eight: refused too).
    let (swa_slots, swa_window) = if c.swa % 2 == 1 {
        (
            usize::from(c.swa / 2 % 33) / ps * ps,
            1 + usize::from(c.swa / 66 % 4),
        )
    } else {
        (0, 0)
    };
    let host_swa_slots = if swa_slots > 0 && host_kv_slots > 0 {
        let pages = host_kv_slots / ps;
        let drawn =
            1 + usize::from(c.host_mamba / 8) % (pages + usize::from(c.host_mamba % 8 == 0));
        drawn * ps
    } else {
        0
    };
    Config {
        kv_slots,
        page_size: ps,
        mamba_slots,
        host_kv_slots,
        host_mamba_slots,
        write_policy,
        write_through_threshold,
        eviction_policy: EvictionPolicies {
            kv: [
                EvictionPolicy::Lru,
                EvictionPolicy::Lfu,
                EvictionPolicy::Priority,
            ][usize::from(c.eviction % 3)],
            mamba: EvictionPolicy::ALL[usize::from(c.eviction / 3 % 4)],
            swa: [
                EvictionPolicy::Lru,
                EvictionPolicy::Lfu,
                EvictionPolicy::Priority,
            ][usize::from(c.eviction / 12 % 3)],
        },
        swa_slots,
        swa_window,
        host_swa_slots,
        // The high bits of `eviction` (its policies use the value below 36): page hashes
        // and KV events, which audit() checks (chains, what was announced).
        page_hashes: c.eviction & 0x80 != 0,
        events: c.eviction & 0xc0 == 0xc0,
        ..Config::default()
    }
}

fn ns_of(ns: u8) -> Option<&'static str> {
    match ns % 4 {
        0 | 1 => None,
        2 => Some("a"),
        // The empty name is a namespace of its own, not the default one.
        _ => Some(""),
    }
}

fn tok(b: u8) -> u32 {
    if b >= 0xfc {
        u32::MAX - u32::from(b & 3)
    } else {
        u32::from(b % 4)
    }
}

fn as_i64(x: usize) -> i64 {
    i64::try_from(x).unwrap_or(i64::MAX)
}

// ---------------------------------------------------------------------------------------
// Checks

/// The value of a call that may fail, but only the way the API refuses misuse.
#[track_caller]
fn allowed<T>(r: Result<T, Error>) -> Option<T> {
    match r {
        Ok(v) => Some(v),
        Err(e @ (Error::Invariant(_) | Error::Broken(_))) => {
            panic!("a call failed with {e:?} (only audit() may report Invariant)")
        }
        Err(_) => None,
    }
}

/// A call the API must refuse (another cache's ids).
#[track_caller]
fn refused<T: std::fmt::Debug>(r: Result<T, Error>) {
    match r {
        Err(Error::Invariant(_) | Error::Broken(_)) | Ok(_) => {
            panic!("expected a refusal, got {r:?}")
        }
        Err(_) => {}
    }
}

fn check_empty(name: &str, pool: &Pool) {
    let c = pool.counts();
    assert!(
        c.owned == 0
            && c.caller == 0
            && c.draining == 0
            && c.free + c.tree == pool.capacity_pages(),
        "leak in {name}: {c:?} of {} pages",
        pool.capacity_pages()
    );
}

// ---------------------------------------------------------------------------------------
// The harness

struct Req {
    id: RequestId,
    /// The tokens it was admitted for (`extend` feeds the rest of them).
    prompt: Vec<u32>,
}

struct H {
    c: Cache,
    /// `Cfg::engine`, and the salt of which batches the engine fails.
    engine: u8,
    ps: usize,
    kv_pages: usize,
    /// Device KV pages and state slots the harness holds (from `alloc_kv` / `alloc_mamba`).
    held_kv: BTreeSet<u32>,
    held_mamba: BTreeSet<u32>,
    nodes: Vec<NodeId>,
    receipts: Vec<LockReceipt>,
    reqs: Vec<Req>,
    /// Batch ids that may be in flight (taken, or of a load-back), and some that are not.
    inflight: Vec<BatchId>,
    gone: Vec<BatchId>,
    loads: Vec<LoadRecord>,
    history: Vec<Vec<u32>>,
    /// Slots of the last match (tree slots, perhaps freed or reused since).
    last_slots: Vec<i64>,
    last_state: Option<u32>,
    /// Another cache, for ids that are not this cache's.
    other: Cache,
    other_node: NodeId,
}

fn push_ring<T>(v: &mut Vec<T>, x: T, cap: usize) {
    if v.len() >= cap {
        v.remove(0);
    }
    v.push(x);
}

impl H {
    fn new(c: Cache, engine: u8) -> H {
        let ps = c.page_size();
        let kv_pages = c.kv_pool().capacity_pages();
        let mut other = Cache::new(Config {
            kv_slots: 8,
            page_size: 1,
            mamba_slots: 2,
            ..Config::default()
        })
        .unwrap();
        let other_node = other.match_prefix(None, &[]).node;
        H {
            c,
            engine,
            ps,
            kv_pages,
            held_kv: BTreeSet::new(),
            held_mamba: BTreeSet::new(),
            nodes: Vec::new(),
            receipts: Vec::new(),
            reqs: Vec::new(),
            inflight: Vec::new(),
            gone: Vec::new(),
            loads: Vec::new(),
            history: Vec::new(),
            last_slots: Vec::new(),
            last_state: None,
            other,
            other_node,
        }
    }

    fn resolve(&self, ns: u8, t: &Toks) -> Vec<u32> {
        let k = usize::from(t.base / 16);
        let mut toks: Vec<u32> = match t.base % 16 {
            1..=4 => SYSTEM[usize::from(t.base % 16) - 1].to_vec(),
            5..=8 if !self.history.is_empty() => self.history[k % self.history.len()].clone(),
            9 | 10 if !self.reqs.is_empty() => self.reqs[k % self.reqs.len()].prompt.clone(),
            11..=13 => self.host_only(ns, k).unwrap_or_default(),
            _ => Vec::new(),
        };
        if t.cut.is_multiple_of(4) {
            toks.truncate(usize::from(t.cut / 4) % (toks.len() + 1));
        }
        toks.extend(t.tail.iter().map(|&b| tok(b)));
        toks.truncate(MAX_TOKENS);
        toks
    }

    /// The `k`-th node of namespace `ns` with KV on the host only (in a hybrid cache, one
    /// with a state on the host, when there is one): what a load-back brings back. With
    /// `up > 0`, one of its host-only ancestors when it has some.
    fn host_only_node(&self, ns: u8, k: usize, up: usize) -> Option<radixcache_core::NodeInfo> {
        if self.c.host_kv_pool().capacity_pages() == 0 {
            return None;
        }
        let ns = ns_of(ns);
        let mut all: Vec<radixcache_core::NodeInfo> = self
            .c
            .snapshot()
            .into_iter()
            .filter(|n| {
                n.namespace.as_deref() == ns
                    && n.kv_indices.is_none()
                    && n.host_kv_indices.is_some()
            })
            .collect();
        if self.c.is_hybrid() && all.iter().any(|n| n.host_mamba_slot.is_some()) {
            all.retain(|n| n.host_mamba_slot.is_some());
        }
        if all.is_empty() {
            return None;
        }
        let n = all.swap_remove(k % all.len());
        if up % 2 == 0 {
            return Some(n);
        }
        let above: Vec<&radixcache_core::NodeInfo> = all
            .iter()
            .filter(|a| a.prefix.len() < n.prefix.len() && n.prefix.starts_with(&a.prefix))
            .collect();
        if above.is_empty() {
            return Some(n);
        }
        Some(above[(up / 2) % above.len()].clone())
    }

    fn host_only(&self, ns: u8, k: usize) -> Option<Vec<u32>> {
        self.host_only_node(ns, k, 0).map(|n| n.prefix)
    }

    fn remember(&mut self, toks: &[u32]) {
        if !toks.is_empty() {
            push_ring(&mut self.history, toks.to_vec(), MAX_HISTORY);
        }
    }

    fn remember_node(&mut self, id: NodeId) {
        if self.nodes.last() != Some(&id) {
            push_ring(&mut self.nodes, id, MAX_NODES);
        }
    }

    fn node(&self, pick: u8) -> Option<NodeId> {
        (!self.nodes.is_empty()).then(|| self.nodes[usize::from(pick) % self.nodes.len()])
    }

    fn req(&self, pick: u8) -> Option<RequestId> {
        (!self.reqs.is_empty()).then(|| self.reqs[usize::from(pick) % self.reqs.len()].id)
    }

    fn page_of(&self, slot: i64) -> u32 {
        u32::try_from(slot / as_i64(self.ps)).unwrap_or(u32::MAX)
    }

    fn page_slots(&self, page: u32) -> impl Iterator<Item = i64> {
        let base = i64::from(page) * as_i64(self.ps);
        base..base + as_i64(self.ps)
    }

    /// The caller-held pages of the pools are the harness's.
    fn check_books(&self) {
        let kv = self.c.kv_pool().counts();
        let m = self.c.mamba_pool().counts();
        assert_eq!(kv.caller, self.held_kv.len(), "caller KV pages: {kv:?}");
        assert_eq!(m.caller, self.held_mamba.len(), "caller state slots: {m:?}");
    }

    /// Matches the tokens of `toks`; returns the match and the tokens.
    fn do_match(&mut self, ns: u8, toks: &Toks) -> (radixcache_core::Match, Vec<u32>) {
        let t = self.resolve(ns, toks);
        let m = self.c.match_prefix(ns_of(ns), &t);
        let aligned = t.len() / self.ps * self.ps;
        assert_eq!(m.kv_indices.len(), m.device_len, "match slots: {m:?}");
        assert!(
            m.device_len.is_multiple_of(self.ps)
                && m.device_len + m.host_len <= aligned
                && m.kv_len <= aligned,
            "match of {} tokens: {m:?}",
            t.len()
        );
        assert!(m.host_len > 0 || m.host_node == m.node, "match: {m:?}");
        self.remember_node(m.node);
        self.remember_node(m.host_node);
        self.last_slots.clone_from(&m.kv_indices);
        self.last_state = m.mamba_slot;
        self.remember(&t);
        (m, t)
    }

    fn alloc_kv(&mut self, n: usize) -> Option<Vec<i64>> {
        let r = self.c.alloc_kv(n);
        if !n.is_multiple_of(self.ps) {
            assert!(
                matches!(r, Err(Error::InvalidArgument { .. })),
                "alloc_kv({n}) with page size {}: {r:?}",
                self.ps
            );
            return None;
        }
        let slots = match r {
            Ok(s) => s?,
            Err(e) => panic!("alloc_kv({n}) of whole pages failed: {e:?}"),
        };
        assert_eq!(
            slots.len(),
            n,
            "alloc_kv({n}) returned {} slots",
            slots.len()
        );
        for chunk in slots.chunks(self.ps) {
            let p = self.page_of(chunk[0]);
            assert!(
                chunk.iter().copied().eq(self.page_slots(p)),
                "alloc_kv returned a broken page: {chunk:?}"
            );
            assert!(
                self.held_kv.insert(p),
                "alloc_kv returned page {p}, held already"
            );
        }
        Some(slots)
    }

    fn alloc_mamba(&mut self) -> Option<u32> {
        let s = self
            .c
            .alloc_mamba()
            .unwrap_or_else(|e| panic!("alloc_mamba on a cache that owns its pools: {e}"))?;
        assert!(
            self.held_mamba.insert(s),
            "alloc_mamba returned {s}, held already"
        );
        Some(s)
    }

    /// `k` distinct held pages, starting from the `seed`-th (in order, wrapping).
    fn some_held(&self, k: usize, seed: u8) -> Vec<u32> {
        let all: Vec<u32> = self.held_kv.iter().copied().collect();
        if all.is_empty() {
            return Vec::new();
        }
        let start = usize::from(seed) % all.len();
        all.iter()
            .cycle()
            .skip(start)
            .take(k.min(all.len()))
            .copied()
            .collect()
    }

    #[allow(clippy::too_many_arguments)]
    fn do_insert(
        &mut self,
        ns: u8,
        toks: &Toks,
        owned: u8,
        fresh: bool,
        state: u8,
        bad: Corrupt,
        seed: u8,
    ) {
        let ps = self.ps;
        let (m, mut t) = self.do_match(ns, toks);
        let dl = m.device_len.min(t.len());
        let mut owned_from = match owned % 4 {
            0 | 1 => dl,
            2 => 0,
            _ => (usize::from(seed) % (dl / ps + 1)) * ps,
        };
        let need = (t.len() - owned_from).div_ceil(ps);
        // The usual pattern: lock the match, allocate, insert, unlock.
        let mut guard = None;
        if fresh {
            guard = allowed(self.c.lock(m.node));
            if self.held_kv.len() < need {
                self.alloc_kv((need - self.held_kv.len()) * ps);
            }
        }
        if need > self.held_kv.len() {
            t.truncate(owned_from + self.held_kv.len() * ps);
        }
        let pages = self.some_held((t.len() - owned_from).div_ceil(ps), seed);
        let mut kv: Vec<i64> = m.kv_indices[..owned_from].to_vec();
        for &p in &pages {
            kv.extend(self.page_slots(p));
        }
        kv.truncate(t.len());
        match bad {
            Corrupt::None | Corrupt::None2 | Corrupt::None3 => {}
            Corrupt::DupPage => {
                if kv.len() >= owned_from + 2 * ps {
                    let (a, b) = kv[owned_from..].split_at_mut(ps);
                    b[..ps].copy_from_slice(a);
                }
            }
            Corrupt::OutOfRange(at, v) => {
                if !kv.is_empty() {
                    let i = usize::from(at) % kv.len();
                    kv[i] = match v % 5 {
                        0 => -1,
                        1 => as_i64(self.kv_pages * ps),
                        2 => i64::MAX,
                        3 => i64::MIN,
                        _ => as_i64(self.kv_pages * ps) + i64::from(v),
                    };
                }
            }
            Corrupt::Shift(at) => {
                if !kv.is_empty() {
                    let i = usize::from(at) % kv.len();
                    kv[i] += 1;
                }
            }
            Corrupt::TreeSlot(at) => {
                if !m.kv_indices.is_empty() && kv.len() > owned_from {
                    let from = (usize::from(at) % (m.kv_indices.len() / ps)) * ps;
                    let to = owned_from + (usize::from(at) % (kv.len() - owned_from)) / ps * ps;
                    let n = ps.min(kv.len() - to);
                    kv[to..to + n].copy_from_slice(&m.kv_indices[from..from + n]);
                }
            }
            Corrupt::Unowned(at, page) => {
                if kv.len() > owned_from {
                    let to = owned_from + (usize::from(at) % (kv.len() - owned_from)) / ps * ps;
                    let p = u32::from(page) % u32::try_from(self.kv_pages).unwrap_or(1);
                    let n = ps.min(kv.len() - to);
                    let slots: Vec<i64> = self.page_slots(p).take(n).collect();
                    kv[to..to + n].copy_from_slice(&slots);
                }
            }
            Corrupt::Length(longer) => {
                if longer {
                    kv.push(0);
                } else {
                    kv.pop();
                }
            }
            Corrupt::OwnedFrom(d) => {
                owned_from = owned_from.saturating_add_signed(isize::from(d));
            }
            Corrupt::Prefix(at) => {
                if owned_from > 0 {
                    let i = usize::from(at) % owned_from;
                    kv[i] ^= 1;
                }
            }
        }
        let hybrid = self.c.is_hybrid();
        let mamba_slot: Option<i64> = match state % 6 {
            0 | 1 => None,
            2 | 3 if hybrid => self.alloc_mamba().map(i64::from),
            2 | 3 => None,
            4 => self
                .held_mamba
                .iter()
                .nth(usize::from(seed) % self.held_mamba.len().max(1))
                .map(|&s| i64::from(s)),
            _ => Some(match seed % 5 {
                0 => -1,
                1 => as_i64(self.c.config().mamba_slots),
                2 => i64::MAX,
                3 => m.mamba_slot.map_or(0, i64::from),
                _ => i64::from(seed % 8),
            }),
        };
        let r = match mamba_slot {
            None if seed.is_multiple_of(2) => self.c.insert(ns_of(ns), &t, &kv, owned_from),
            // A priority from -2 to 2.
            _ => self.c.insert_with_priority(
                ns_of(ns),
                &t,
                &kv,
                owned_from,
                mamba_slot,
                i64::from(seed / 8 % 5) - 2,
            ),
        };
        if let Some(ins) = allowed(r) {
            // Exactly the pages from `owned_from` on were the caller's, and now are not.
            let mut given: Vec<u32> = kv[owned_from..].iter().map(|&s| self.page_of(s)).collect();
            given.dedup();
            for p in given {
                assert!(
                    self.held_kv.remove(&p),
                    "insert took page {p}, which the caller did not hold (kv {kv:?}, owned_from {owned_from})"
                );
            }
            if let Some(s) = mamba_slot {
                let s = u32::try_from(s).unwrap_or(u32::MAX);
                assert!(
                    self.held_mamba.remove(&s),
                    "insert took state slot {s}, which the caller did not hold"
                );
            }
            assert!(ins.prefix_len <= t.len());
            self.remember_node(ins.node);
        }
        if let Some(g) = guard {
            if let Err(e) = self.c.unlock(g) {
                panic!("unlocking a live receipt failed: {e:?}");
            }
        }
    }

    fn do_free_kv(&mut self, how: u8, seed: u8) {
        let cap = as_i64(self.kv_pages * self.ps);
        let mut slots: Vec<i64> = Vec::new();
        match how % 8 {
            0..=3 => {
                let k = usize::from(seed) % (self.held_kv.len() + 1);
                for p in self.some_held(k, seed / 3) {
                    let all: Vec<i64> = self.page_slots(p).collect();
                    if how & 8 == 0 {
                        slots.extend(&all);
                    } else {
                        // Some of the page's slots, perhaps repeated.
                        for j in 0..=usize::from(seed) % (self.ps + 1) {
                            slots.push(all[(j + usize::from(how)) % self.ps]);
                        }
                    }
                }
                if how & 16 != 0 {
                    slots.reverse();
                }
            }
            4 => {
                slots.extend(
                    self.some_held(1, seed)
                        .iter()
                        .flat_map(|&p| self.page_slots(p)),
                );
                slots.push([-1, cap, i64::MIN, i64::MAX][usize::from(seed % 4)]);
            }
            5 => {
                let p = u32::from(seed) % u32::try_from(self.kv_pages).unwrap_or(1);
                slots.extend(self.page_slots(p));
            }
            6 if !self.last_slots.is_empty() => {
                slots.push(self.last_slots[usize::from(seed) % self.last_slots.len()]);
            }
            _ => {}
        }
        if let Some(n) = allowed(self.c.free_kv(&slots)) {
            let mut pages: Vec<u32> = slots.iter().map(|&s| self.page_of(s)).collect();
            pages.sort_unstable();
            pages.dedup();
            assert_eq!(n, pages.len() * self.ps, "free_kv({slots:?}) freed {n}");
            for p in pages {
                assert!(
                    self.held_kv.remove(&p),
                    "free_kv freed page {p}, which the caller did not hold"
                );
            }
        } else if how % 8 < 4 {
            panic!("free_kv of held slots {slots:?} failed");
        }
    }

    fn do_free_mamba(&mut self, how: u8, pick: u8) {
        let slot = match how % 4 {
            0 | 1 => match self
                .held_mamba
                .iter()
                .nth(usize::from(pick) % self.held_mamba.len().max(1))
            {
                Some(&s) => i64::from(s),
                None => return,
            },
            2 => match pick % 4 {
                0 => -1,
                1 => as_i64(self.c.config().mamba_slots),
                2 => i64::MIN,
                _ => i64::from(pick % 8),
            },
            _ => match self.last_state {
                Some(s) => i64::from(s),
                None => return,
            },
        };
        let held = u32::try_from(slot).is_ok_and(|s| self.held_mamba.contains(&s));
        match self.c.free_mamba(slot) {
            Ok(()) => {
                assert!(held, "free_mamba({slot}) of a slot the caller did not hold");
                self.held_mamba
                    .remove(&u32::try_from(slot).unwrap_or(u32::MAX));
            }
            Err(e) => {
                assert!(!held, "free_mamba({slot}) of a held slot failed: {e:?}");
                allowed::<()>(Err(e));
            }
        }
    }

    fn keep_receipt(&mut self, r: LockReceipt) {
        if self.receipts.len() >= MAX_RECEIPTS {
            let old = self.receipts.remove(0);
            if let Err(e) = self.c.unlock(old) {
                panic!("unlocking a live receipt failed: {e:?}");
            }
        }
        self.receipts.push(r);
    }

    fn keep_load(&mut self, rec: LoadRecord) {
        if self.loads.len() >= MAX_LOADS {
            let old = self.loads.remove(0);
            self.c.cancel_load(old);
        }
        self.inflight.push(rec.id());
        self.loads.push(rec);
    }

    fn do_extend(&mut self, req: u8, n: u8, tail: &[u8]) {
        let Some(id) = self.req(req) else { return };
        let q = &self.reqs[usize::from(req) % self.reqs.len()];
        let mut toks: Vec<u32> = match self.c.request(id) {
            Ok(v) => q
                .prompt
                .iter()
                .skip(v.len)
                .take(usize::from(n % 8))
                .copied()
                .collect(),
            Err(_) => Vec::new(),
        };
        toks.extend(tail.iter().take(8).map(|&b| tok(b)));
        if let Some(Some(slots)) = allowed(self.c.extend(id, &toks)) {
            assert_eq!(slots.len(), toks.len(), "extend slots");
        }
    }

    fn do_extend_batch(&mut self, picks: &[u8], short: bool) {
        let ids: Vec<RequestId> = picks.iter().take(8).filter_map(|&p| self.req(p)).collect();
        let mut toks: Vec<u32> = picks.iter().take(ids.len()).map(|&b| tok(b)).collect();
        if short {
            toks.pop();
        }
        let distinct = ids.iter().collect::<HashSet<_>>().len() == ids.len();
        let r = self.c.extend_batch(&ids, &toks);
        if !distinct || short && !ids.is_empty() {
            // Refused as malformed, or first as naming a request that ended.
            assert!(
                matches!(r, Err(Error::InvalidArgument { .. } | Error::Request(_))),
                "a malformed decode step was not refused: {r:?}"
            );
        } else if let Some(Some(slots)) = allowed(r) {
            assert_eq!(slots.len(), ids.len(), "extend_batch slots");
        }
    }

    fn batch_id(&self, which: u8, pick: u8) -> BatchId {
        let cache = u128::from(self.c.id().get());
        let forged = |cache: u128| {
            BatchId::from_u128((cache << 64) | u128::from(pick)).unwrap_or_else(|| unreachable!())
        };
        match which % 8 {
            0..=4 if !self.inflight.is_empty() => {
                self.inflight[usize::from(pick) % self.inflight.len()]
            }
            5 if !self.gone.is_empty() => self.gone[usize::from(pick) % self.gone.len()],
            // Another cache's id space.
            7 => forged(cache + 1000),
            // Any sequence number of this cache: unknown, acknowledged, or a real one.
            _ => forged(cache),
        }
    }

    /// Moves ids that are no longer in flight out of `inflight`.
    fn settle_ids(&mut self) {
        let mut i = 0;
        while i < self.inflight.len() {
            let id = self.inflight[i];
            if self.c.started(id).is_none() {
                self.inflight.swap_remove(i);
                push_ring(&mut self.gone, id, MAX_GONE);
            } else {
                i += 1;
            }
        }
    }

    fn do_take(&mut self) {
        for b in self.c.take_batches() {
            for copy in &b.copies {
                assert_eq!(copy.src.len(), copy.dst.len(), "batch {b:?}");
            }
            // Pending (a forged id may have started it before it was taken).
            assert!(self.c.started(b.id).is_some(), "taken batch {b:?}");
            self.inflight.push(b.id);
        }
    }

    fn do_engine(&mut self, mode: u8, mask: u8) {
        self.do_take();
        for (i, id) in self.inflight.clone().into_iter().enumerate() {
            let Some(started) = self.c.started(id) else {
                continue;
            };
            if !started && mode % 4 != 2 {
                allowed(self.c.start(id));
            }
            match mode % 4 {
                0 | 1 => {
                    allowed(self.c.complete(id));
                }
                2 if mask & (1 << (i % 8)) != 0 => {
                    allowed(self.c.fail(id));
                }
                2 => {
                    allowed(self.c.complete(id));
                }
                _ => {}
            }
        }
    }

    fn do_load_back(&mut self, target: &Target, quota: Option<u8>, req: Option<u8>, then: u8) {
        let target = match target {
            Target::Node(p) => match self.node(*p) {
                Some(n) => LoadTarget::Node(n),
                None => return,
            },
            Target::HostOf { ns, toks } => LoadTarget::Node(self.do_match(*ns, toks).0.host_node),
            Target::HostOnly { ns, k, up } => {
                match self.host_only_node(*ns, usize::from(*k), usize::from(*up)) {
                    Some(n) => LoadTarget::Node(n.id),
                    None => return,
                }
            }
            Target::Request(p) => match self.req(*p) {
                Some(r) => LoadTarget::Request(r),
                None => return,
            },
            Target::Foreign => {
                refused(
                    self.c
                        .load_back(LoadTarget::Node(self.other_node), None, None),
                );
                return;
            }
        };
        let quota = quota.map(|q| {
            if q == 255 {
                usize::MAX
            } else {
                usize::from(q % 32)
            }
        });
        let request = req.and_then(|p| self.req(p));
        if let Some(Some(rec)) = allowed(self.c.load_back(target, quota, request)) {
            assert_eq!(self.c.started(rec.id()), Some(false), "load-back batch");
            assert_eq!(self.c.load_committed(rec.id()), Ok(false));
            match then % 5 {
                0 | 1 => self.keep_load(rec),
                2 => {
                    self.inflight.push(rec.id());
                    allowed(self.c.commit_load(rec));
                }
                3 => {
                    allowed(self.c.start(rec.id()));
                    self.keep_load(rec);
                }
                _ => {
                    // The copies land before the commit (which then publishes at once).
                    allowed(self.c.start(rec.id()));
                    allowed(self.c.complete(rec.id()));
                    self.keep_load(rec);
                }
            }
        }
    }

    fn do_report(&mut self, node: u8, req: u8) {
        let _ = self.c.stats();
        let snap = self.c.snapshot();
        let _ = self.c.pretty(8, 8);
        let _ = self.c.summary();
        if let Some(n) = self.node(node) {
            let _ = allowed(self.c.describe(n));
        }
        let page = u32::from(node) % u32::try_from(self.kv_pages).unwrap_or(1);
        assert!(
            self.c.kv_pool().state(page).is_some(),
            "page {page} has no state"
        );
        if let Some(id) = self.req(req) {
            // Only marks it (`HybridCache` handles abort a marked request when dropped).
            let _ = allowed(self.c.own_request(id));
            if let (Some(toks), Some(kv)) = (
                allowed(self.c.request_tokens(id)),
                allowed(self.c.request_kv_indices(id)),
            ) {
                assert_eq!(toks.len(), kv.len(), "request tokens vs slots");
            }
        }
        let device: usize = snap
            .iter()
            .filter_map(|n| n.kv_indices.as_ref().map(Vec::len))
            .sum();
        assert_eq!(device, self.c.total_size(), "snapshot vs total_size");
        assert_eq!(
            self.c.evictable_size() + self.c.protected_size(),
            self.c.total_size(),
            "sizes"
        );
    }

    fn do_foreign(&mut self, what: u8) {
        match what % 4 {
            0 => refused(self.c.lock(self.other_node)),
            1 => {
                let Ok(r) = self.other.lock(self.other_node) else {
                    panic!("lock of the other cache's root failed")
                };
                refused(self.c.unlock(r));
                self.other.reap();
                self.other.audit().unwrap();
            }
            2 => {
                let Ok(Some(id)) = self.other.admit(None, &[1, 2]) else {
                    panic!("the other cache refused an admission")
                };
                refused(self.c.abort(id));
                refused(self.c.extend(id, &[1]));
                refused(self.c.checkpoint(id));
                refused(self.c.finish(id));
                refused(self.c.load_back(LoadTarget::Request(id), None, None));
                if let Some(n) = self.node(what / 4) {
                    refused(self.c.load_back(LoadTarget::Node(n), None, Some(id)));
                }
                self.other.abort(id).unwrap();
            }
            _ => refused(self.c.describe(self.other_node)),
        }
    }

    fn step(&mut self, i: usize, op: &Op) {
        match op {
            Op::Match { ns, toks } => {
                self.do_match(*ns, toks);
            }
            Op::Insert {
                ns,
                toks,
                owned,
                fresh,
                state,
                bad,
                seed,
            } => self.do_insert(*ns, toks, *owned, *fresh, *state, *bad, *seed),
            Op::AllocKv { n } => {
                let n = match *n {
                    0..=199 => usize::from(n % 9) * self.ps,
                    200..=249 => usize::from(n - 200),
                    250 => usize::MAX / self.ps * self.ps,
                    251 => usize::MAX,
                    _ => self.kv_pages * self.ps,
                };
                self.alloc_kv(n);
            }
            Op::FreeKv { how, seed } => self.do_free_kv(*how, *seed),
            Op::AllocMamba => {
                self.alloc_mamba();
            }
            Op::FreeMamba { how, pick } => self.do_free_mamba(*how, *pick),
            Op::Lock { node } => {
                if let Some(n) = self.node(*node) {
                    if let Some(r) = allowed(self.c.lock(n)) {
                        assert_eq!(self.c.lock_node(&r), Ok(n), "lock_node");
                        self.keep_receipt(r);
                    }
                }
            }
            Op::Unlock { pick } => {
                if !self.receipts.is_empty() {
                    let r = self
                        .receipts
                        .swap_remove(usize::from(*pick) % self.receipts.len());
                    if let Err(e) = self.c.unlock(r) {
                        panic!("unlocking a live receipt failed: {e:?}");
                    }
                }
            }
            Op::DropReceipt { pick, reap } => {
                if !self.receipts.is_empty() {
                    drop(
                        self.receipts
                            .swap_remove(usize::from(*pick) % self.receipts.len()),
                    );
                    if *reap {
                        self.c.reap();
                    }
                }
            }
            Op::Evict { kv, mamba } => {
                // With SWA layers, SWA eviction too (tombstones, whole leaves).
                if self.c.has_swa() {
                    let pages = if *kv == 255 {
                        usize::MAX
                    } else {
                        usize::from(kv % 9)
                    };
                    self.c.evict_swa(pages);
                }
                let kv = if *kv == 255 {
                    usize::MAX
                } else {
                    usize::from(kv % 70)
                };
                let mamba = if *mamba == 255 {
                    usize::MAX
                } else {
                    usize::from(mamba % 8)
                };
                self.c.evict(kv, mamba);
            }
            Op::EvictHost { kv, mamba } => {
                let device = (self.c.available_kv(), self.c.total_size());
                let ev = self
                    .c
                    .evict_host(usize::from(*kv), usize::from(*mamba))
                    .unwrap_or_else(|e| panic!("evict_host with a host tier: {e}"));
                let after = (self.c.available_kv(), self.c.total_size());
                if self.c.has_swa() {
                    // A device tombstone left a leaf (its host-only children gone) goes
                    // too: device room can only grow.
                    assert!(after.0 >= device.0 && after.1 <= device.1, "{after:?}");
                } else {
                    assert_eq!(after, device);
                }
                if ev.kv_tokens < usize::from(*kv) {
                    let left = self
                        .c
                        .stats()
                        .into_iter()
                        .find(|s| s.0 == "host_kv_evictable_tokens");
                    assert_eq!(left, Some(("host_kv_evictable_tokens", 0)), "{ev:?}");
                }
            }
            Op::Admit { ns, toks, priority } => {
                let t = self.resolve(*ns, toks);
                if let Some(id) = self
                    .c
                    .admit_with_priority(ns_of(*ns), &t, i64::from(*priority))
                    .unwrap_or_else(|e| panic!("admit on a cache that owns its pools: {e}"))
                {
                    if let Ok(v) = self.c.request(id) {
                        assert!(v.prefix_len <= t.len() && v.len == v.prefix_len, "{v:?}");
                        self.remember_node(v.node);
                    } else {
                        panic!("admitted request {id} is not live");
                    }
                    self.remember(&t);
                    self.reqs.push(Req { id, prompt: t });
                }
            }
            Op::Extend { req, n, tail } => self.do_extend(*req, *n, tail),
            Op::ExtendBatch { reqs, short } => self.do_extend_batch(reqs, *short),
            Op::Checkpoint { req } => {
                if let Some(id) = self.req(*req) {
                    if allowed(self.c.checkpoint(id)).is_some() {
                        if let Ok(v) = self.c.request(id) {
                            self.remember_node(v.node);
                        }
                    }
                }
            }
            Op::Finish { req } => {
                if let Some(id) = self.req(*req) {
                    if allowed(self.c.finish(id)).is_some() {
                        assert!(!self.c.request_live(id), "finished request still live");
                    }
                }
            }
            Op::Abort { req } => {
                if let Some(id) = self.req(*req) {
                    let live = self.c.request_live(id);
                    let r = self.c.abort(id);
                    assert_eq!(live, r.is_ok(), "abort of a request live={live}: {r:?}");
                    allowed(r);
                }
            }
            Op::Take => self.do_take(),
            Op::Engine { mode, mask } => self.do_engine(*mode, *mask),
            Op::Batch { which, pick, act } => {
                let id = self.batch_id(*which, *pick);
                allowed(match act {
                    Ack::Start => self.c.start(id),
                    Ack::Complete => self.c.complete(id),
                    Ack::Fail => self.c.fail(id),
                    Ack::Abandon => {
                        self.c.abandon(id);
                        Ok(())
                    }
                });
            }
            Op::LoadBack {
                target,
                quota,
                req,
                then,
            } => self.do_load_back(target, *quota, *req, *then),
            Op::Commit { pick } => {
                if !self.loads.is_empty() {
                    let rec = self
                        .loads
                        .swap_remove(usize::from(*pick) % self.loads.len());
                    allowed(self.c.commit_load(rec));
                }
            }
            Op::Cancel { pick } => {
                if !self.loads.is_empty() {
                    let rec = self
                        .loads
                        .swap_remove(usize::from(*pick) % self.loads.len());
                    self.c.cancel_load(rec);
                }
            }
            Op::DropLoad { pick, reap } => {
                if !self.loads.is_empty() {
                    drop(
                        self.loads
                            .swap_remove(usize::from(*pick) % self.loads.len()),
                    );
                    if *reap {
                        self.c.reap();
                    }
                }
            }
            Op::Reap => self.c.reap(),
            Op::Report { node, req } => self.do_report(*node, *req),
            Op::Foreign { what } => self.do_foreign(*what),
        }
        match self.engine % 4 {
            0 => {}
            1 => self.do_engine(0, 0),
            2 => self.do_engine(2, self.engine.rotate_left(3) ^ 0x35),
            _ if i % 4 == 3 => self.do_engine(0, 0),
            _ => self.do_engine(3, 0),
        }
        self.settle_ids();
    }

    /// Acknowledges (starts, then completes) every batch in flight until none is left.
    fn drain_batches(&mut self) {
        for round in 0.. {
            assert!(round < 64, "batches keep coming");
            self.do_take();
            self.settle_ids();
            if self.inflight.is_empty() {
                return;
            }
            for id in std::mem::take(&mut self.inflight) {
                if self.c.started(id) == Some(false) {
                    if let Err(e) = self.c.start(id) {
                        panic!("start of pending batch {id} failed: {e:?}");
                    }
                }
                if self.c.started(id).is_some() {
                    if let Err(e) = self.c.complete(id) {
                        panic!("complete of pending batch {id} failed: {e:?}");
                    }
                }
                push_ring(&mut self.gone, id, MAX_GONE);
            }
            if let Err(e) = self.c.audit() {
                panic!("audit while draining batches: {e}");
            }
        }
    }

    /// Gives everything back and checks that nothing leaked.
    fn teardown(&mut self) {
        for rec in std::mem::take(&mut self.loads) {
            self.c.cancel_load(rec);
        }
        self.drain_batches();
        for r in std::mem::take(&mut self.receipts) {
            if let Err(e) = self.c.unlock(r) {
                panic!("unlocking a live receipt failed: {e:?}");
            }
        }
        for q in std::mem::take(&mut self.reqs) {
            if self.c.request_live(q.id) {
                if let Err(e) = self.c.abort(q.id) {
                    panic!("abort of live request {} failed: {e:?}", q.id);
                }
            }
        }
        let slots: Vec<i64> = self
            .held_kv
            .iter()
            .flat_map(|&p| self.page_slots(p))
            .collect();
        match self.c.free_kv(&slots) {
            Ok(n) => assert_eq!(n, slots.len(), "free_kv of every held slot"),
            Err(e) => panic!("free_kv of every held slot failed: {e:?}"),
        }
        self.held_kv.clear();
        for s in std::mem::take(&mut self.held_mamba) {
            if let Err(e) = self.c.free_mamba(i64::from(s)) {
                panic!("free_mamba({s}) of a held slot failed: {e:?}");
            }
        }
        // Aborting can end nothing that emits, but be sure.
        self.drain_batches();
        self.c.reap();
        if let Err(e) = self.c.audit() {
            panic!("audit after giving everything back: {e}");
        }
        self.check_leaks();
        // Evict everything (under write-back that emits backups: complete them and evict
        // again).
        for round in 0.. {
            assert!(round < 64, "eviction keeps emitting batches");
            self.c.evict(usize::MAX, usize::MAX);
            self.do_take();
            if self.inflight.is_empty() {
                break;
            }
            self.drain_batches();
        }
        if let Err(e) = self.c.audit() {
            panic!("audit after evicting everything: {e}");
        }
        self.check_leaks();
        let kv = self.c.kv_pool().counts();
        let m = self.c.mamba_pool().counts();
        assert!(
            kv.tree == 0 && m.tree == 0 && self.c.total_size() == 0,
            "device data left after evicting everything: kv {kv:?}, mamba {m:?}"
        );
        self.other.reap();
        self.other.audit().unwrap();
    }

    fn check_leaks(&self) {
        let stat = |name| {
            self.c
                .stats()
                .into_iter()
                .find(|&(k, _)| k == name)
                .map_or(0, |s| s.1)
        };
        assert_eq!(
            stat("swa_free_slots") + stat("swa_cached_tokens"),
            stat("swa_capacity_slots"),
            "SWA slots left held outside the tree"
        );
        assert_eq!(
            stat("host_swa_free_slots") + stat("host_swa_cached_tokens"),
            stat("host_swa_capacity_slots"),
            "host SWA slots left held outside the tree"
        );
        check_empty("kv", self.c.kv_pool());
        check_empty("mamba", self.c.mamba_pool());
        check_empty("host_kv", self.c.host_kv_pool());
        check_empty("host_mamba", self.c.host_mamba_pool());
    }
}

fuzz_target!(|data: &[u8]| {
    match data.split_first() {
        Some((&engine::ENGINE_MODE, rest)) => run_engine(rest),
        _ => run(data),
    }
});

/// Engine-owned pools (see the `engine` module).
fn run_engine(data: &[u8]) {
    let Ok(input) = Input::arbitrary_take_rest(Unstructured::new(data)) else {
        return;
    };
    let Some(mut e) = engine::E::new(&input.cfg) else {
        return;
    };
    e.check();
    for (i, op) in input.ops.iter().take(MAX_OPS).enumerate() {
        e.step(op);
        if let Err(err) = e.audit() {
            panic!("audit after op {i} ({op:?}): {err}");
        }
        e.check();
    }
    e.teardown();
}

/// The cache's own pools.
fn run(data: &[u8]) {
    let Ok(input) = Input::arbitrary_take_rest(Unstructured::new(data)) else {
        return;
    };
    let Ok(cache) = Cache::new(config_of(&input.cfg)) else {
        return;
    };
    let mut h = H::new(cache, input.cfg.engine);
    h.c.audit().unwrap();
    for (i, op) in input.ops.iter().take(MAX_OPS).enumerate() {
        h.step(i, op);
        if let Err(e) = h.c.audit() {
            panic!("audit after op {i} ({op:?}): {e}");
        }
        h.check_books();
    }
    h.teardown();
}
