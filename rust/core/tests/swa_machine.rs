//! State-machine test of [`radixcache_core::Cache`] with sliding-window attention (SWA)
//! layers, alone or beside Mamba layers (`swa_slots`, `swa_window`, `mamba_slots`).
//!
//! Proptest generates random sequences of `admit` (shared "system prompts" plus a tail
//! over a small alphabet), `extend` and `extend_batch` (prefill chunks and decode
//! steps), `checkpoint`, `finish`, `abort`, `match_prefix` (each preceded by a
//! `peek_prefix` that must answer the same lengths), low-level inserts (`alloc_kv`
//! then `insert`), `lock` / `unlock` / dropped receipts, `evict`, `evict_swa`, and the
//! transfer batches a Mamba model or a host tier emits (completed, failed, abandoned,
//! or left in flight across steps), `reset` (after ending what holds the tree, or as
//! things are: refused then, changing nothing), over page sizes 1, 2 and 4, windows of 1 to 6
//! tokens (pages larger than the window included) and SWA pools small enough that SWA
//! eviction runs all the time, under every eviction policy of each component (SWA:
//! "lru", "lfu" or "priority"; admissions carry priorities 0 to 2). Half the cases draw a host tier (`host_kv_slots`,
//! `host_swa_slots` at most that, each write policy): backups, demotion, `evict_host`
//! and load-backs of what a match found on the host (released, committed, dropped, or
//! started and released).
//!
//! No reference model of the tree: the SWA component's invariants are checked after
//! every step, by `audit()` (every SWA page free or paired with exactly one KV page that
//! is not free; every request's window live; the window locks each node holds are
//! exactly those of the live receipts; every unlocked node with live SWA queued for
//! eviction, once, under a key at most the SWA policy's key now; no unlocked leaf
//! ending in a dead page) and here:
//!
//! * the SWA pool's gauges add up to its capacity, and SWA pages held by requests are
//!   at most what their windows (and pages being filled) need;
//! * each live request's `request_swa_indices` covers at least its last W tokens, one
//!   slot per token, none missing, no slot twice;
//! * a match never reports more than its KV match, its slots are one per token;
//! * the host SWA pool's gauges add up to its capacity; every `"swa"` copy runs
//!   beside a `"kv"` copy in the same batch, device to host in a backup and host to
//!   device in a load-back, one destination per source, no destination twice, each
//!   slot inside its tier's SWA pool;
//! * no fault is ever recorded (a window lock released twice would be one);
//! * the teardown (batches completed, requests finished, receipts released, everything
//!   evicted, on both tiers) leaves every KV and SWA slot free.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::proptest_config;
use proptest::prelude::*;
use radixcache_core::{
    BatchId, Cache, Config, EvictionPolicies, EvictionPolicy, LoadTarget, LockReceipt, PoolKind,
    RequestId, Tier, TransferBatch, WritePolicy,
};

#[derive(Debug, Clone)]
enum Op {
    Admit {
        system: u8,
        tail: Vec<u8>,
    },
    Extend {
        req: u8,
        n: u8,
    },
    Decode {
        token: u8,
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
    Match {
        system: u8,
        tail: Vec<u8>,
    },
    Insert {
        system: u8,
        tail: Vec<u8>,
    },
    Lock {
        system: u8,
        tail: Vec<u8>,
    },
    Unlock {
        k: u8,
    },
    DropReceipt {
        k: u8,
    },
    Evict {
        tokens: u8,
    },
    EvictSwa {
        pages: u8,
    },
    EvictHost {
        tokens: u8,
    },
    LoadBack {
        pick: u8,
        how: u8,
    },
    Batches {
        how: u8,
    },
    /// `reset`, after ending everything that holds the tree (`drain`) or as things are.
    Reset {
        drain: bool,
    },
}

fn tail() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(0u8..4, 0..12)
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (any::<u8>(), tail()).prop_map(|(system, tail)| Op::Admit { system, tail }),
        5 => (any::<u8>(), 1u8..12).prop_map(|(req, n)| Op::Extend { req, n }),
        3 => any::<u8>().prop_map(|token| Op::Decode { token }),
        2 => any::<u8>().prop_map(|req| Op::Checkpoint { req }),
        3 => any::<u8>().prop_map(|req| Op::Finish { req }),
        1 => any::<u8>().prop_map(|req| Op::Abort { req }),
        3 => (any::<u8>(), tail()).prop_map(|(system, tail)| Op::Match { system, tail }),
        2 => (any::<u8>(), tail()).prop_map(|(system, tail)| Op::Insert { system, tail }),
        1 => (any::<u8>(), tail()).prop_map(|(system, tail)| Op::Lock { system, tail }),
        1 => any::<u8>().prop_map(|k| Op::Unlock { k }),
        1 => any::<u8>().prop_map(|k| Op::DropReceipt { k }),
        2 => any::<u8>().prop_map(|tokens| Op::Evict { tokens }),
        2 => any::<u8>().prop_map(|pages| Op::EvictSwa { pages }),
        1 => any::<u8>().prop_map(|tokens| Op::EvictHost { tokens }),
        3 => (any::<u8>(), any::<u8>()).prop_map(|(pick, how)| Op::LoadBack { pick, how }),
        3 => any::<u8>().prop_map(|how| Op::Batches { how }),
        1 => any::<bool>().prop_map(|drain| Op::Reset { drain }),
    ]
}

/// The host tier: `(host_kv_slots, host_swa_slots, write_policy)`, in pages (scaled by
/// the page size); no host tier half the time.
fn host() -> impl Strategy<Value = (usize, usize, WritePolicy)> {
    prop_oneof![
        Just((0, 0, WritePolicy::WriteThrough)),
        (1usize..16, any::<u8>(), 0u8..3).prop_map(|(kv, swa, policy)| {
            let policy = match policy {
                0 => WritePolicy::WriteThrough,
                1 => WritePolicy::WriteThroughSelective,
                _ => WritePolicy::WriteBack,
            };
            (kv, 1 + usize::from(swa) % kv, policy)
        }),
    ]
}

/// The eviction policy of each component: KV and states as every machine draws them,
/// SWA any policy that applies to it.
fn policies() -> impl Strategy<Value = EvictionPolicies> {
    (
        common::eviction_policies(),
        prop::sample::select(vec![
            EvictionPolicy::Lru,
            EvictionPolicy::Lfu,
            EvictionPolicy::Priority,
        ]),
    )
        .prop_map(|(p, swa)| EvictionPolicies { swa, ..p })
}

/// The configuration drawn: page size, KV, SWA and Mamba pools, window, host tier,
/// eviction policies.
fn config() -> impl Strategy<Value = Config> {
    (
        prop::sample::select(vec![1usize, 2, 4]),
        4usize..24,
        2usize..10,
        1usize..=6,
        prop::sample::select(vec![0usize, 0, 3, 6]),
        host(),
        policies(),
    )
        .prop_map(
            |(ps, kv_pages, swa_pages, window, mamba, host, eviction_policy)| {
                let (host_kv, host_swa, write_policy) = host;
                Config {
                    eviction_policy,
                    swa_slots: swa_pages * ps,
                    swa_window: window,
                    mamba_slots: mamba,
                    host_kv_slots: host_kv * ps,
                    host_swa_slots: host_swa * ps,
                    host_mamba_slots: if host_kv > 0 { mamba } else { 0 },
                    write_policy,
                    ..Config::kv(kv_pages * ps, ps)
                }
            },
        )
}

const SYSTEMS: [&[u32]; 3] = [&[], &[7, 7, 7, 7, 7, 7], &[8, 9, 8, 9, 8, 9, 8, 9]];

fn tokens(system: u8, tail: &[u8]) -> Vec<u32> {
    let mut t = SYSTEMS[usize::from(system) % SYSTEMS.len()].to_vec();
    t.extend(tail.iter().map(|&b| u32::from(b)));
    t
}

fn stat(c: &Cache, name: &str) -> u64 {
    c.stats()
        .into_iter()
        .find(|(k, _)| *k == name)
        .map_or_else(|| panic!("no stat {name}"), |(_, v)| v)
}

struct Machine {
    c: Cache,
    /// A router's index rebuilt from the cache's KV events alone.
    events: common::EventIndex,
    window: usize,
    /// Batches taken (started or not) and not acknowledged yet, with whether started.
    flight: Vec<(BatchId, bool)>,
    /// Live requests, each with the prompt it still has to extend by.
    reqs: Vec<(RequestId, Vec<u32>)>,
    receipts: Vec<LockReceipt>,
    /// Sequences cached (inserted, finished), for load-backs to find on the host.
    cached: Vec<Vec<u32>>,
}

impl Machine {
    fn new(config: &Config) -> Self {
        let window = config.swa_window;
        let c = Cache::new(Config {
            page_hashes: true,
            events: true,
            ..config.clone()
        })
        .unwrap();
        Machine {
            c,
            events: common::EventIndex::default(),
            window,
            flight: Vec::new(),
            reqs: Vec::new(),
            receipts: Vec::new(),
            cached: Vec::new(),
        }
    }

    fn pick(&self, k: u8) -> Option<usize> {
        (!self.reqs.is_empty()).then(|| usize::from(k) % self.reqs.len())
    }

    fn step(&mut self, op: &Op) {
        match op {
            Op::Admit { system, tail } => {
                let t = tokens(*system, tail);
                // Priorities 0 to 2 (for the "priority" policy), from the byte that
                // picks the system prompt.
                let priority = i64::from(*system / 86);
                if let Some(id) = self.c.admit_with_priority(None, &t, priority).unwrap() {
                    let prefix = self.c.request(id).unwrap().prefix_len;
                    self.reqs.push((id, t[prefix..].to_vec()));
                }
            }
            Op::Extend { req, n } => self.extend(*req, usize::from(*n)),
            Op::Decode { token } => {
                let ids: Vec<RequestId> = self.reqs.iter().map(|r| r.0).collect();
                if !ids.is_empty() {
                    let toks = vec![u32::from(*token % 4); ids.len()];
                    if let Some(slots) = self.c.extend_batch(&ids, &toks).unwrap() {
                        assert_eq!(slots.len(), ids.len());
                    }
                }
            }
            Op::Checkpoint { req } => {
                if let Some(k) = self.pick(*req) {
                    // Refused while the admission copy is in flight (a Mamba model).
                    let _ = self.c.checkpoint(self.reqs[k].0);
                }
            }
            Op::Finish { req } => {
                if let Some(k) = self.pick(*req) {
                    let id = self.reqs[k].0;
                    let tokens = self.c.request_tokens(id).unwrap();
                    if self.c.finish(id).is_ok() {
                        self.reqs.swap_remove(k);
                        self.cached.push(tokens);
                    }
                }
            }
            Op::Abort { req } => {
                if let Some(k) = self.pick(*req) {
                    self.c.abort(self.reqs[k].0).unwrap();
                    self.reqs.swap_remove(k);
                }
            }
            Op::Match { system, tail } => {
                let t = tokens(*system, tail);
                let p = self.c.peek_prefix(None, &t);
                let m = self.c.match_prefix(None, &t);
                assert_eq!(
                    (p.device_len, p.host_len, p.kv_len),
                    (m.device_len, m.host_len, m.kv_len),
                    "a peek answers what the match does"
                );
                assert!(m.device_len <= m.kv_len, "{m:?}");
                assert_eq!(m.kv_indices.len(), m.device_len);
            }
            Op::Insert { system, tail } => self.insert(&tokens(*system, tail)),
            Op::Lock { system, tail } => {
                let t = tokens(*system, tail);
                let m = self.c.match_prefix(None, &t);
                self.receipts.push(self.c.lock(m.node).unwrap());
            }
            Op::Unlock { k } => {
                if !self.receipts.is_empty() {
                    let r = self
                        .receipts
                        .swap_remove(usize::from(*k) % self.receipts.len());
                    self.c.unlock(r).unwrap();
                }
            }
            Op::DropReceipt { k } => {
                if !self.receipts.is_empty() {
                    let r = self
                        .receipts
                        .swap_remove(usize::from(*k) % self.receipts.len());
                    drop(r);
                }
            }
            Op::Evict { tokens } => {
                self.c
                    .evict(usize::from(*tokens % 32), usize::from(*tokens / 32));
            }
            Op::EvictSwa { pages } => {
                let n = if *pages == 255 {
                    usize::MAX
                } else {
                    usize::from(*pages % 8)
                };
                self.c.evict_swa(n);
            }
            Op::EvictHost { tokens } => {
                if self.c.config().host_kv_slots > 0 {
                    self.c.evict_host(usize::from(*tokens % 16), 0).unwrap();
                }
            }
            Op::LoadBack { pick, how } => {
                if !self.cached.is_empty() {
                    let t = self.cached[usize::from(*pick) % self.cached.len()].clone();
                    self.load_back(&t, *how);
                }
            }
            Op::Batches { how } => self.settle_batches(*how),
            Op::Reset { drain } => self.reset(*drain),
        }
    }

    /// A reset empties both tiers (every KV and SWA slot free) when nothing holds the
    /// tree, else fails naming what does and changes nothing.
    fn reset(&mut self, drain: bool) {
        if drain {
            self.end_everything();
        }
        self.events.check(&mut self.c); // takes the events, releasing dropped receipts
        let before = (self.c.stats(), self.c.pretty(10_000, 1));
        if let Err(e) = self.c.reset() {
            assert!(!drain, "a drained cache refused a reset: {e}");
            assert!(
                e.to_string().starts_with("reset: the cache is in use: "),
                "{e}"
            );
            assert_eq!((self.c.stats(), self.c.pretty(10_000, 1)), before);
            return;
        }
        assert_eq!(stat(&self.c, "nodes"), 0);
        for pool in ["kv", "swa", "host_kv", "host_swa", "mamba", "host_mamba"] {
            assert_eq!(
                stat(&self.c, &format!("{pool}_free_slots")),
                stat(&self.c, &format!("{pool}_capacity_slots")),
                "{pool} after a reset"
            );
        }
    }

    /// Loads back what a match of `t` (a sequence cached earlier) found on the host
    /// (with `how`'s top bit, after evicting what it can, backups landed), then (by
    /// `how`) releases the
    /// guard, commits it (its batch started or not, acknowledged by a later step),
    /// drops it, or starts its batch and releases it (draining until acknowledged).
    fn load_back(&mut self, t: &[u32], how: u8) {
        if self.c.config().host_kv_slots == 0 {
            return;
        }
        if how & 0x80 != 0 {
            // Half the time everything evictable goes to the host first (backups
            // landed), so that there is something to load.
            self.settle_batches(0);
            self.c.evict(usize::MAX, 0);
            self.settle_batches(0);
        }
        let m = self.c.match_prefix(None, t);
        if m.host_len == 0 {
            return;
        }
        let Some(rec) = self
            .c
            .load_back(LoadTarget::Node(m.host_node), None, None)
            .unwrap()
        else {
            return;
        };
        let id = rec.id();
        self.check_copies(rec.batch());
        match how % 5 {
            0 => self.c.cancel_load(rec),
            1 | 2 => {
                let started = how % 5 == 2;
                if started {
                    self.c.start(id).unwrap();
                }
                // Refused when another load landing on the path was committed first.
                if self.c.commit_load(rec).is_ok() || started {
                    self.flight.push((id, started));
                }
            }
            3 => {
                // Called off by the cache's next call (here, at once: the check after
                // the step counts the SWA pages requests hold).
                drop(rec);
                self.c.reap();
            }
            _ => {
                self.c.start(id).unwrap();
                self.c.cancel_load(rec);
                self.flight.push((id, true));
            }
        }
    }

    /// A batch's copies: every `"swa"` copy beside a `"kv"` copy, in the direction its
    /// kind moves, one destination per source, none twice, inside the tier's SWA pool.
    fn check_copies(&self, b: &TransferBatch) {
        let config = self.c.config();
        for copy in b.copies.iter().filter(|c| c.pool == PoolKind::Swa) {
            assert!(
                b.copies.iter().any(|c| c.pool == PoolKind::Kv),
                "an SWA copy without its KV: {b:?}"
            );
            assert_eq!(copy.src.len(), copy.dst.len(), "{b:?}");
            let mut dst = copy.dst.clone();
            dst.sort_unstable();
            dst.dedup();
            assert_eq!(
                dst.len(),
                copy.dst.len(),
                "an SWA slot written twice: {b:?}"
            );
            for (tier, slots) in [(copy.src_tier, &copy.src), (copy.dst_tier, &copy.dst)] {
                let cap = match tier {
                    Tier::Device => config.swa_slots,
                    Tier::Host => config.host_swa_slots,
                    Tier::External => panic!("an SWA copy with the L3 tier: {b:?}"),
                };
                let cap = i64::try_from(cap).unwrap();
                assert!(slots.iter().all(|s| (0..cap).contains(s)), "{b:?}");
            }
            assert_ne!(copy.src_tier, copy.dst_tier, "{b:?}");
        }
    }

    /// Extends a request by `n` tokens: the rest of its prompt first.
    fn extend(&mut self, req: u8, n: usize) {
        let Some(k) = self.pick(req) else {
            return;
        };
        let (id, rest) = &mut self.reqs[k];
        let mut chunk: Vec<u32> = rest.iter().copied().take(n).collect();
        while chunk.len() < n {
            chunk.push(u32::try_from(n % 4).unwrap());
        }
        if let Some(slots) = self.c.extend(*id, &chunk).unwrap() {
            assert_eq!(slots.len(), chunk.len());
            let used = chunk.len().min(rest.len());
            rest.drain(..used);
        }
    }

    /// Caches `t` through the low-level API, the match locked while allocating (so
    /// that eviction cannot take it).
    fn insert(&mut self, t: &[u32]) {
        self.cached.push(t.to_vec());
        let m = self.c.match_prefix(None, t);
        let ps = self.c.page_size();
        let rest = t.len() - m.device_len;
        let guard = self.c.lock(m.node).unwrap();
        if let Some(got) = self.c.alloc_kv(rest.div_ceil(ps) * ps).unwrap() {
            let mut kv = m.kv_indices.clone();
            kv.extend_from_slice(&got[..rest]);
            self.c.insert(None, t, &kv, m.device_len).unwrap();
        }
        self.c.unlock(guard).unwrap();
    }

    /// Acknowledges the batches in flight and those emitted since: `how` % 8 is 0 to 3
    /// complete, 4 fail, 5 abandon (a started one is then acknowledged, and fails), 6
    /// and 7 start them and leave them in flight (acknowledged by a later step).
    fn settle_batches(&mut self, how: u8) {
        for b in self.c.take_batches() {
            self.check_copies(&b);
            self.flight.push((b.id, false));
        }
        let how = how % 8;
        for (id, started) in std::mem::take(&mut self.flight) {
            match how {
                0..=3 => self.c.complete(id).unwrap(),
                4 => self.c.fail(id).unwrap(),
                5 => {
                    if !started {
                        self.c.start(id).unwrap();
                    }
                    let _ = self.c.abandon(id);
                    // A started batch drains until acknowledged.
                    let _ = self.c.complete(id);
                }
                _ => {
                    if !started {
                        self.c.start(id).unwrap();
                    }
                    self.flight.push((id, true));
                }
            }
        }
    }

    fn check(&mut self) {
        self.events.check(&mut self.c);
        let c = &self.c;
        c.audit().unwrap();
        assert_eq!(c.fault(), None);
        let sum = stat(c, "swa_free_slots")
            + stat(c, "swa_cached_tokens")
            + stat(c, "swa_caller_slots")
            + stat(c, "swa_request_slots")
            + stat(c, "swa_draining_slots");
        assert_eq!(sum, stat(c, "swa_capacity_slots"));
        let host_sum = stat(c, "host_swa_free_slots")
            + stat(c, "host_swa_cached_tokens")
            + stat(c, "host_swa_draining_slots");
        assert_eq!(host_sum, stat(c, "host_swa_capacity_slots"));
        let ps = c.page_size();
        // What the requests hold: their windows, and at most a page more each.
        let mut held_bound: u64 = 0;
        for &(id, _) in &self.reqs {
            let len = c.request(id).unwrap().len;
            let (start, slots) = c.request_swa_indices(id).unwrap();
            assert!(
                start <= len.saturating_sub(self.window),
                "window from {start} of {len}"
            );
            assert_eq!(slots.len(), len - start);
            assert!(
                slots.iter().all(|&s| s >= 0),
                "a window slot is missing: {slots:?}"
            );
            let mut sorted = slots.clone();
            sorted.sort_unstable();
            sorted.dedup();
            assert_eq!(sorted.len(), slots.len(), "a window slot twice: {slots:?}");
            // The own pages after the freed window: the window, the current page and
            // the last extend's chunk (at most 11 tokens).
            held_bound += u64::try_from((self.window + 11).div_ceil(ps) * ps + 2 * ps).unwrap();
        }
        assert!(stat(c, "swa_request_slots") <= held_bound);
    }

    /// Ends every batch, request and receipt: nothing holds the tree afterwards.
    fn end_everything(&mut self) {
        self.settle_batches(0);
        for (id, _) in std::mem::take(&mut self.reqs) {
            if self.c.finish(id).is_err() {
                self.c.abort(id).unwrap();
            }
        }
        for r in std::mem::take(&mut self.receipts) {
            self.c.unlock(r).unwrap();
        }
        self.settle_batches(0);
    }

    fn teardown(mut self) {
        self.end_everything();
        // Write-back: the eviction's backups land, then what they demoted goes too.
        self.c.evict(usize::MAX, usize::MAX);
        self.settle_batches(0);
        self.c.evict(usize::MAX, usize::MAX);
        if self.c.config().host_kv_slots > 0 {
            self.c.evict_host(usize::MAX, usize::MAX).unwrap();
        }
        self.c.audit().unwrap();
        for pool in ["swa", "host_swa"] {
            assert_eq!(
                stat(&self.c, &format!("{pool}_free_slots")),
                stat(&self.c, &format!("{pool}_capacity_slots")),
                "{pool}"
            );
        }
        assert_eq!(self.c.kv_counts().free, self.c.kv_pool().capacity_pages());
        assert_eq!(
            self.c.host_kv_pool().counts().free,
            self.c.host_kv_pool().capacity_pages()
        );
    }
}

proptest! {
    #![proptest_config(proptest_config("proptest-regressions/swa_machine.txt"))]

    #[test]
    fn swa_cache_keeps_its_invariants(
        config in config(),
        ops in prop::collection::vec(op(), 1..=120),
    ) {
        let mut m = Machine::new(&config);
        m.check();
        for op in &ops {
            m.step(op);
            m.check();
        }
        m.teardown();
    }
}
