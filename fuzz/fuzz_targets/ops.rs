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
//! wrong `owned_from`, stale or forged ids, another cache's ids. One `Reap` in four is
//! a `reset` instead: it must be refused (`Busy`) exactly while something holds the
//! tree, and leave no tree page behind when it goes through.
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
//! With the L3 tier (`Cfg::threshold` bits 7 and 6; bit 5: written on host eviction;
//! bits 4 and 3: the store's faults) the harness models memory: the value of every host
//! KV slot and host state slot (what a landed backup wrote there, read from the tree's
//! device slots when the batch was taken, or what a landed fetch read from the store;
//! a failed backup poisons its slots), and a store of objects keyed by page hash. An
//! `l3_put` runs when it is acknowledged as done: it reads the host slots it names
//! (pinned since it was emitted, so they still hold what the put was emitted for; a
//! store call may fail and then the batch fails); `L3Fetch` asks the store for the
//! leading pages past what the cache holds (as an engine does), calls `l3_fetch`, reads
//! the objects into the host slots of the batch (an object may be lost, or come back
//! corrupt: caught by its checksum, a miss) and ends it (`complete`, `complete_l3_gone`
//! of what came back whole or less with the objects found missing or corrupt, `fail`,
//! `abandon`, or later, by `L3Ack`). Findings besides the above: a host slot of the tree
//! that does not hold its tokens' data, a put that writes an object other bytes than its
//! page's.
//!
//! An input whose first byte is `engine::ENGINE_MODE` runs the rest with engine-owned
//! pools instead (module `engine`, which lists its own findings).
//!
//! The harness is deterministic: the same input always makes the same calls.

#![no_main]

mod engine;

use std::collections::{BTreeSet, HashMap, HashSet};

use arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use radixcache_core::{
    Abandoned, BatchId, BatchKind, Cache, Config, Error, EvictionPolicies, EvictionPolicy, L3Write,
    LoadRecord, LoadTarget, LockReceipt, NodeId, PageHash, Pool, PoolKind, RequestId, Tier,
    TransferBatch, WritePolicy,
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
/// Fetches held to be acknowledged later at most.
const MAX_GETS: usize = 4;
/// What a failed copy leaves in a host slot.
const POISON: u64 = u64::MAX;

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
    /// Bits 0-2: the selective policy's threshold; bits 7 and 6 both: the L3 tier (page
    /// hashes on, no SWA layers); bit 5: written on host eviction; bits 4-3: the store's
    /// faults (none, failed calls, lost and corrupt objects, all three).
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
    /// `reset`: refused (`Busy`, nothing changed) while anything holds the tree, else
    /// the tree is emptied.
    Reset,
    Report {
        node: u8,
        req: u8,
    },
    Foreign {
        what: u8,
    },
    /// Fetches what the store holds of the tokens past what the cache holds; `end` says
    /// how the batch ends (and, one time in eight, how many pages are asked for).
    L3Fetch {
        ns: u8,
        toks: Toks,
        end: u8,
    },
    /// Acknowledges a fetch held for later (`fail`: failed).
    L3Ack {
        pick: u8,
        fail: bool,
    },
    /// Tells eviction which prompts come next (`expect`; none: the marks are cleared).
    Expect {
        prompts: Vec<(u8, Toks)>,
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
    L3Fetch,
    L3Ack,
    Expect,
}

const WEIGHTS: [(Kind, u8); 30] = [
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
    (Kind::L3Fetch, 4),
    (Kind::L3Ack, 1),
    (Kind::Expect, 2),
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
            // One reap in four is a reset instead (the same kind, so that the committed
            // corpus keeps decoding to the operations it was found with).
            Kind::Reap if u8::arbitrary(u)? % 4 == 0 => Op::Reset,
            Kind::Reap => Op::Reap,
            Kind::Report => Op::Report {
                node: u.arbitrary()?,
                req: u.arbitrary()?,
            },
            Kind::Foreign => Op::Foreign {
                what: u.arbitrary()?,
            },
            Kind::L3Fetch => Op::L3Fetch {
                ns: u.arbitrary()?,
                toks: u.arbitrary()?,
                end: u.arbitrary()?,
            },
            Kind::L3Ack => Op::L3Ack {
                pick: u.arbitrary()?,
                fail: u.arbitrary()?,
            },
            Kind::Expect => Op::Expect {
                prompts: u.arbitrary()?,
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
    // The L3 tier (a quarter of the configurations with a host tier): it needs page
    // hashes, no SWA layers and, hybrid, a host state slot.
    let l3 = host_kv_slots > 0 && c.threshold & 0xc0 == 0xc0;
    // SWA layers half the time: windows of 1 to 4 tokens against pages of 1 to 4 (a
    // page larger than the window included), pools of up to 32 slots (0 is refused by
    // `Config::validate`: that path runs too); with a host tier, a host SWA pool of one
    // page up to the host KV pool (more, one time in eight: refused too).
    let (swa_slots, swa_window) = if c.swa % 2 == 1 && !l3 {
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
    let host_mamba_slots = if l3 && mamba_slots > 0 {
        host_mamba_slots.max(1)
    } else {
        host_mamba_slots
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
        page_hashes: c.eviction & 0x80 != 0 || l3,
        events: c.eviction & 0xc0 == 0xc0,
        l3,
        l3_write: if l3 && c.threshold & 0x20 != 0 {
            L3Write::HostEviction
        } else {
            L3Write::Backup
        },
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
// The memory model (with the L3 tier)

fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

/// A running hash of a namespace and the first `len` tokens of `t`.
fn prefix_value(ns: Option<&str>, t: &[u32], len: usize) -> u64 {
    let mut h = ns.map_or(0x6c33, |n| {
        n.bytes().fold(0x6e73, |a, b| mix(a ^ u64::from(b)))
    });
    for &x in &t[..len] {
        h = mix(h ^ mix(u64::from(x).wrapping_add(0x9e37_79b9_7f4a_7c15)));
    }
    h
}

/// The KV of token `p` of `t` (in namespace `ns`).
fn kv_value(ns: Option<&str>, t: &[u32], p: usize) -> u64 {
    prefix_value(ns, t, p + 1)
}

/// The state after the first `len` tokens of `t`.
fn state_value(ns: Option<&str>, t: &[u32], len: usize) -> u64 {
    mix(prefix_value(ns, t, len) ^ 0x5374_6174_6500_0000)
}

/// What a batch taken from the cache writes when it lands.
enum Effect {
    /// A backup: `(state pool, host slot, value)` (`None`: unknown, as the tree no
    /// longer held its source when it was taken); failed, the slots are poisoned.
    Backup(Vec<(bool, usize, Option<u64>)>),
    /// An `l3_put`: `(state, key, host slots)` per object, read when it runs.
    Put(Vec<(bool, PageHash, Vec<usize>)>),
}

/// A fetch held to be acknowledged later: its id, the pages and state that landed.
struct Get {
    id: BatchId,
    pages: usize,
    state: bool,
    whole: bool,
    /// The objects the store did not hold (missing, or corrupt and deleted).
    gone: Vec<usize>,
}

/// What an object must hold, and the namespace and tokens of the page it ends.
type Named = (Vec<u64>, Option<String>, Vec<u32>);

/// Host memory, the shared store and what the taken batches will write.
#[derive(Default)]
struct Mem {
    host_kv: Vec<Option<u64>>,
    host_state: Vec<Option<u64>>,
    effects: HashMap<BatchId, Effect>,
    /// Batches abandoned after they started: either acknowledgement fails them.
    abandoned: HashSet<BatchId>,
    /// The store: objects by (state, page hash).
    store: HashMap<(bool, PageHash), Vec<u64>>,
    /// What each object must hold, from the pages the tree was seen to hold, and the
    /// namespace and tokens it ends.
    names: HashMap<(bool, PageHash), Named>,
    /// Prompts whose last page a put wrote (namespace, tokens): what fetches ask for.
    stored: Vec<(Option<String>, Vec<u32>)>,
    rng: u64,
    /// Per mille: a store call fails; an object is lost; an object comes back corrupt.
    fail: u64,
    lose: u64,
    corrupt: u64,
}

impl Mem {
    fn draw(&mut self, per_mille: u64) -> bool {
        if per_mille == 0 {
            return false;
        }
        self.rng = mix(self.rng.wrapping_add(0x9e37_79b9));
        self.rng % 1000 < per_mille
    }

    fn slot(v: &mut Vec<Option<u64>>, s: usize) -> &mut Option<u64> {
        if v.len() <= s {
            v.resize(s + 1, None);
        }
        &mut v[s]
    }

    /// A taken batch ended (`landed`: its copies count).
    fn land(&mut self, effect: Effect, landed: bool) {
        match effect {
            Effect::Backup(writes) => {
                for (state, s, v) in writes {
                    let mem = if state {
                        &mut self.host_state
                    } else {
                        &mut self.host_kv
                    };
                    *Self::slot(mem, s) = if landed { v } else { Some(POISON) };
                }
            }
            Effect::Put(objects) if landed => {
                for (state, key, slots) in objects {
                    let mem = if state {
                        &self.host_state
                    } else {
                        &self.host_kv
                    };
                    let values: Vec<u64> = slots
                        .iter()
                        .map(|&s| {
                            mem.get(s).copied().flatten().unwrap_or_else(|| {
                                panic!("a put read host slot {s}, never written")
                            })
                        })
                        .collect();
                    if let Some((want, ns, toks)) = self.names.get(&(state, key)) {
                        assert_eq!(
                            &values, want,
                            "a put wrote other bytes for its page (state {state})"
                        );
                        if !state {
                            push_ring(&mut self.stored, (ns.clone(), toks.clone()), MAX_HISTORY);
                        }
                    }
                    // Write-once: what the store has stays.
                    self.store.entry((state, key)).or_insert(values);
                }
            }
            Effect::Put(_) => {}
        }
    }

    /// Reads object `key` into host `slots` as a store client does; whether it came back
    /// whole (a lost one is missing; a corrupt one fails its checksum and is deleted).
    fn read(&mut self, state: bool, key: PageHash, slots: &[i64]) -> bool {
        if self.draw(self.lose) {
            self.store.remove(&(state, key));
        }
        let Some(values) = self.store.get(&(state, key)).cloned() else {
            return false;
        };
        if self.draw(self.corrupt) {
            self.store.remove(&(state, key));
            return false;
        }
        assert_eq!(values.len(), slots.len(), "object size");
        for (&s, v) in slots.iter().zip(values) {
            let s = usize::try_from(s).unwrap_or(usize::MAX);
            let mem = if state {
                &mut self.host_state
            } else {
                &mut self.host_kv
            };
            *Self::slot(mem, s) = Some(v);
        }
        true
    }
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
    /// With the L3 tier: the memory model, and the fetches held.
    mem: Option<Mem>,
    gets: Vec<Get>,
}

fn push_ring<T>(v: &mut Vec<T>, x: T, cap: usize) {
    if v.len() >= cap {
        v.remove(0);
    }
    v.push(x);
}

impl H {
    fn new(c: Cache, engine: u8, faults: u8) -> H {
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
        let mem = c.config().l3.then(|| {
            let level = faults % 4;
            let rate = |on: bool| if on { 150 } else { 0 };
            Mem {
                rng: u64::from(faults),
                fail: rate(level & 1 != 0),
                lose: rate(level & 2 != 0),
                corrupt: rate(level & 2 != 0),
                ..Mem::default()
            }
        });
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
            mem,
            gets: Vec::new(),
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

    /// `reset`: refused with `Busy` (and nothing changed: the books are checked after
    /// every step) while a request, receipt, batch or load-back holds the tree; else no
    /// pool keeps a tree page or state and the caller keeps what it held.
    fn do_reset(&mut self) {
        let stat = |c: &Cache, name: &str| {
            c.stats()
                .into_iter()
                .find(|&(k, _)| k == name)
                .map_or(0, |(_, v)| v)
        };
        self.c.reap();
        let busy = [
            "live_requests",
            "live_locks",
            "batches_in_flight",
            "load_backs_pending",
        ]
        .iter()
        .any(|k| stat(&self.c, k) > 0);
        match self.c.reset() {
            Ok(()) => {
                assert!(!busy, "a reset went through while the cache was in use");
                for pool in [
                    self.c.kv_pool(),
                    self.c.mamba_pool(),
                    self.c.host_kv_pool(),
                    self.c.host_mamba_pool(),
                ] {
                    assert_eq!(pool.counts().tree, 0, "a tree page after a reset");
                }
                assert_eq!(stat(&self.c, "nodes"), 0);
            }
            Err(Error::Busy(_)) => assert!(busy, "a reset refused an idle cache"),
            Err(e) => panic!("reset: {e:?}"),
        }
    }

    fn do_take(&mut self) {
        let batches = self.c.take_batches();
        if self.mem.is_some() && !batches.is_empty() {
            self.observe();
            let device = self.device_values();
            for b in &batches {
                if let Some(e) = self.effect_of(b, &device) {
                    if let Some(mem) = self.mem.as_mut() {
                        mem.effects.insert(b.id, e);
                    }
                }
            }
        }
        for b in batches {
            for copy in &b.copies {
                assert_eq!(copy.src.len(), copy.dst.len(), "batch {b:?}");
            }
            // Pending (a forged id may have started it before it was taken).
            assert!(self.c.started(b.id).is_some(), "taken batch {b:?}");
            self.inflight.push(b.id);
        }
    }

    /// The memory model: what each object of the pages the tree holds must contain
    /// (by page hash), recorded while the tree holds them.
    fn observe(&mut self) {
        let Some(mem) = self.mem.as_mut() else {
            return;
        };
        let ps = self.ps;
        for n in self.c.snapshot() {
            let ns = n.namespace.as_deref();
            let hashes = self.c.chain_hashes(ns, None, &n.prefix);
            let first = (n.prefix.len() - n.key_len) / ps;
            for (k, &h) in hashes.iter().enumerate().skip(first) {
                let end = (k + 1) * ps;
                let name = || (n.namespace.clone(), n.prefix[..end].to_vec());
                mem.names.entry((false, h)).or_insert_with(|| {
                    let kv = (end - ps..end)
                        .map(|p| kv_value(ns, &n.prefix, p))
                        .collect();
                    let (ns, toks) = name();
                    (kv, ns, toks)
                });
                mem.names.entry((true, h)).or_insert_with(|| {
                    let (ns, toks) = name();
                    (vec![state_value(ns.as_deref(), &toks, end)], ns, toks)
                });
            }
        }
    }

    /// What the tree says each device KV slot and device state slot holds: `(state,
    /// slot)` to value.
    fn device_values(&self) -> HashMap<(bool, i64), u64> {
        let mut out = HashMap::new();
        for n in self.c.snapshot() {
            if n.loading {
                continue;
            }
            let ns = n.namespace.as_deref();
            let start = n.prefix.len() - n.key_len;
            for (k, &s) in n.kv_indices.iter().flatten().enumerate() {
                out.insert((false, s), kv_value(ns, &n.prefix, start + k));
            }
            if let Some(s) = n.mamba_slot {
                out.insert(
                    (true, i64::from(s)),
                    state_value(ns, &n.prefix, n.prefix.len()),
                );
            }
        }
        out
    }

    /// What a taken batch writes to host memory or the store when it lands.
    fn effect_of(&self, b: &TransferBatch, device: &HashMap<(bool, i64), u64>) -> Option<Effect> {
        let idx = |s: i64| usize::try_from(s).unwrap_or(usize::MAX);
        match b.kind {
            BatchKind::Backup => {
                let mut writes = Vec::new();
                for c in &b.copies {
                    let state = match c.pool {
                        PoolKind::Kv => false,
                        PoolKind::Mamba => true,
                        PoolKind::Swa => continue,
                    };
                    assert_eq!(
                        (c.src_tier, c.dst_tier),
                        (Tier::Device, Tier::Host),
                        "{b:?}"
                    );
                    // A slot the tree no longer holds (its node was deleted while the
                    // backup was in flight: the slot drains) has no known value: the
                    // backup's host copy must then never be published.
                    for (&src, &dst) in c.src.iter().zip(&c.dst) {
                        writes.push((state, idx(dst), device.get(&(state, src)).copied()));
                    }
                }
                Some(Effect::Backup(writes))
            }
            BatchKind::L3Put => {
                let mut keys = b.keys.iter();
                let mut objects = Vec::new();
                for c in &b.copies {
                    assert_eq!(
                        (c.src_tier, c.dst_tier),
                        (Tier::Host, Tier::External),
                        "{b:?}"
                    );
                    let (state, per) = match c.pool {
                        PoolKind::Kv => (false, self.ps),
                        _ => (true, 1),
                    };
                    for chunk in c.src.chunks(per) {
                        let key = *keys
                            .next()
                            .unwrap_or_else(|| panic!("a put without keys: {b:?}"));
                        objects.push((state, key, chunk.iter().map(|&s| idx(s)).collect()));
                    }
                }
                assert!(
                    keys.next().is_none(),
                    "a put with more keys than objects: {b:?}"
                );
                Some(Effect::Put(objects))
            }
            _ => None,
        }
    }

    /// Acknowledges batch `id` as done (`complete`) or failed, as an engine does: what a
    /// taken batch writes lands in the memory model, and an `l3_put` runs against the
    /// store (failing when a store call fails).
    fn ack(&mut self, id: BatchId, complete: bool) -> Result<(), Error> {
        if self.mem.is_some() {
            let known = self
                .mem
                .as_ref()
                .is_some_and(|m| m.effects.contains_key(&id));
            if !known && self.c.started(id).is_some() {
                // Emitted and not taken yet: the engine takes it first.
                self.do_take();
            }
        }
        let mut complete = complete;
        if let Some(mem) = self.mem.as_mut() {
            if complete
                && matches!(mem.effects.get(&id), Some(Effect::Put(_)))
                && mem.draw(mem.fail)
            {
                complete = false;
            }
        }
        let r = if complete {
            self.c.complete(id)
        } else {
            self.c.fail(id)
        };
        if r.is_ok() {
            if let Some(mem) = self.mem.as_mut() {
                let abandoned = mem.abandoned.remove(&id);
                if let Some(e) = mem.effects.remove(&id) {
                    mem.land(e, complete && !abandoned);
                }
            }
        }
        r
    }

    /// The owner lets go of batch `id` (`abandon`): failed at once, or draining (then
    /// either acknowledgement fails it).
    fn abandon(&mut self, id: BatchId) {
        if self.mem.is_some() && self.c.started(id).is_some() {
            self.do_take();
        }
        match self.c.abandon(id) {
            Abandoned::Failed => {
                if let Some(mem) = self.mem.as_mut() {
                    if let Some(e) = mem.effects.remove(&id) {
                        mem.land(e, false);
                    }
                }
            }
            Abandoned::Draining => {
                if let Some(mem) = self.mem.as_mut() {
                    mem.abandoned.insert(id);
                }
            }
            Abandoned::Nothing => {}
        }
    }

    /// The memory model: every host slot of the tree holds its tokens' data.
    fn check_mem(&self) {
        let Some(mem) = &self.mem else {
            return;
        };
        for n in self.c.snapshot() {
            let ns = n.namespace.as_deref();
            let start = n.prefix.len() - n.key_len;
            for (k, &s) in n.host_kv_indices.iter().flatten().enumerate() {
                let got = mem
                    .host_kv
                    .get(usize::try_from(s).unwrap_or(usize::MAX))
                    .copied()
                    .flatten();
                assert_eq!(
                    got,
                    Some(kv_value(ns, &n.prefix, start + k)),
                    "host KV slot {s} of {:?} (token {}) holds other data",
                    n.prefix,
                    start + k
                );
            }
            if let Some(s) = n.host_mamba_slot {
                let got = mem.host_state.get(s as usize).copied().flatten();
                assert_eq!(
                    got,
                    Some(state_value(ns, &n.prefix, n.prefix.len())),
                    "host state slot {s} of {:?} holds another state",
                    n.prefix
                );
            }
        }
    }

    /// Fetches from the store what it holds of the tokens past what the cache holds, as
    /// an engine does, reads the objects into the batch's host slots and ends it as
    /// `end` says.
    fn do_l3_fetch(&mut self, ns: u8, toks: &Toks, end: u8) {
        // Half the time a prompt whose pages a put wrote (and a tail), else any.
        let stored = self.mem.as_ref().and_then(|m| {
            (end & 0x40 != 0 && !m.stored.is_empty())
                .then(|| m.stored[usize::from(toks.cut) % m.stored.len()].clone())
        });
        let (name, t) = match stored {
            Some((name, mut t)) => {
                t.extend(toks.tail.iter().map(|&b| tok(b)));
                t.truncate(MAX_TOKENS);
                (name, t)
            }
            None => (ns_of(ns).map(str::to_owned), self.resolve(ns, toks)),
        };
        let name = name.as_deref();
        let Some(mem) = self.mem.as_ref() else {
            let r = self.c.l3_fetch(name, &t, 1);
            assert!(
                matches!(r, Err(Error::InvalidArgument { arg: "l3", .. })),
                "l3_fetch without an L3 tier: {r:?}"
            );
            return;
        };
        let ps = self.ps;
        let hybrid = self.c.is_hybrid();
        let have = (self.c.peek_prefix(name, &t).kv_len / ps).min(t.len() / ps);
        let hashes = self.c.chain_hashes(name, None, &t);
        let run = hashes[have..]
            .iter()
            .take_while(|&&h| mem.store.contains_key(&(false, h)))
            .count();
        let run = if hybrid {
            (1..=run)
                .rev()
                .find(|&k| mem.store.contains_key(&(true, hashes[have + k - 1])))
                .unwrap_or(0)
        } else {
            run
        };
        // One time in eight any number of pages (past the tokens: refused).
        let pages = if end % 8 == 7 {
            usize::from(end / 8) % (t.len() / ps + 2)
        } else {
            have + run
        };
        let Some(Some(b)) = allowed(self.c.l3_fetch(name, &t, pages)) else {
            return;
        };
        self.remember(&t);
        assert_eq!(b.kind, BatchKind::L3Get, "{b:?}");
        let total = b.copies[0].dst.len() / ps;
        assert!(total > 0 && total <= pages, "{b:?}");
        assert_eq!(b.keys.len(), total + usize::from(hybrid), "{b:?}");
        assert_eq!(b.keys[..total], hashes[pages - total..pages], "fetch keys");
        let mode = (end / 8) % 8;
        if mode == 0 {
            assert_eq!(
                self.c.abandon(b.id),
                Abandoned::Failed,
                "an unstarted fetch"
            );
            return;
        }
        if let Err(e) = self.c.start(b.id) {
            panic!("start of a fetch failed: {e:?}");
        }
        let Some(mem) = self.mem.as_mut() else {
            return;
        };
        // Every slot it writes is poisoned first: only what lands may be placed.
        for (k, copy) in b.copies.iter().enumerate() {
            for &s in &copy.dst {
                let s = usize::try_from(s).unwrap_or(usize::MAX);
                let slots = if k == 0 {
                    &mut mem.host_kv
                } else {
                    &mut mem.host_state
                };
                *Mem::slot(slots, s) = Some(POISON);
            }
        }
        let failed = mem.draw(mem.fail);
        let mut landed = 0;
        let mut gone = Vec::new();
        if !failed {
            for (k, chunk) in b.copies[0].dst.chunks(ps).enumerate() {
                if !mem.read(false, b.keys[k], chunk) {
                    gone.push(k);
                    break;
                }
                landed += 1;
            }
        }
        let state = hybrid && landed == total && {
            let ok = mem.read(true, b.keys[total], &b.copies[1].dst);
            if !ok {
                gone.push(total);
            }
            ok
        };
        let whole = landed == total && (state || !hybrid);
        let mut get = Get {
            id: b.id,
            pages: landed,
            state,
            whole,
            gone,
        };
        if end & 0x80 != 0 && landed > 0 {
            // Claims less than landed: the rest is a miss.
            get.pages = landed - 1;
            get.state = false;
            get.whole = false;
        }
        match mode {
            1 => self.ack_get(&get, true),
            2 | 3 => self.ack_get(&get, failed),
            4 => {
                // Let go of after it started: draining, and failed whenever it ends.
                assert_eq!(self.c.abandon(b.id), Abandoned::Draining);
                self.keep_get(get);
            }
            _ => self.keep_get(get),
        }
    }

    fn keep_get(&mut self, g: Get) {
        if self.gets.len() >= MAX_GETS {
            let old = self.gets.remove(0);
            self.ack_get(&old, false);
        }
        self.gets.push(g);
    }

    /// Acknowledges a fetch: what landed, or failed.
    fn ack_get(&mut self, g: &Get, fail: bool) {
        let r = if fail {
            self.c.fail(g.id)
        } else if g.whole {
            self.c.complete(g.id)
        } else {
            self.c.complete_l3_gone(g.id, g.pages, g.state, &g.gone)
        };
        if let Err(e) = r {
            panic!("acknowledging fetch {} in flight failed: {e:?}", g.id);
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
                    allowed(self.ack(id, true));
                }
                2 if mask & (1 << (i % 8)) != 0 => {
                    allowed(self.ack(id, false));
                }
                2 => {
                    allowed(self.ack(id, true));
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
                // A fetch held for later is the harness's to end (its reads are done).
                if self.gets.iter().any(|g| g.id == id) {
                    return;
                }
                allowed(match act {
                    Ack::Start => self.c.start(id),
                    Ack::Complete => self.ack(id, true),
                    Ack::Fail => self.ack(id, false),
                    Ack::Abandon => {
                        self.abandon(id);
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
            Op::Reset => self.do_reset(),
            Op::Report { node, req } => self.do_report(*node, *req),
            Op::Foreign { what } => self.do_foreign(*what),
            Op::L3Fetch { ns, toks, end } => self.do_l3_fetch(*ns, toks, *end),
            Op::L3Ack { pick, fail } => {
                if !self.gets.is_empty() {
                    let g = self.gets.swap_remove(usize::from(*pick) % self.gets.len());
                    self.ack_get(&g, *fail);
                }
            }
            Op::Expect { prompts } => {
                let prompts: Vec<(u8, Vec<u32>)> = prompts
                    .iter()
                    .map(|(ns, toks)| (*ns, self.resolve(*ns, toks)))
                    .collect();
                let items: Vec<(Option<&str>, &[u32])> = prompts
                    .iter()
                    .map(|(ns, toks)| (ns_of(*ns), toks.as_slice()))
                    .collect();
                let marked = self.c.expect(&items);
                assert!(
                    marked <= items.len(),
                    "{marked} marked for {} prompts",
                    items.len()
                );
            }
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
                    if let Err(e) = self.ack(id, true) {
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
        for g in std::mem::take(&mut self.gets) {
            self.ack_get(&g, false);
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
    let mut h = H::new(cache, input.cfg.engine, input.cfg.threshold >> 3);
    h.c.audit().unwrap();
    for (i, op) in input.ops.iter().take(MAX_OPS).enumerate() {
        h.step(i, op);
        if let Err(e) = h.c.audit() {
            panic!("audit after op {i} ({op:?}): {e}");
        }
        h.check_books();
        h.observe();
        h.check_mem();
    }
    h.teardown();
    h.check_mem();
}
