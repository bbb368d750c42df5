//! State-machine test of [`radixcache_core::Cache`] with sliding-window attention (SWA)
//! layers, alone or beside Mamba layers (`swa_slots`, `swa_window`, `mamba_slots`).
//!
//! Proptest generates random sequences of `admit` (shared "system prompts" plus a tail
//! over a small alphabet), `extend` and `extend_batch` (prefill chunks and decode
//! steps), `checkpoint`, `finish`, `abort`, `match_prefix`, low-level inserts (`alloc_kv`
//! then `insert`), `lock` / `unlock` / dropped receipts, `evict`, `evict_swa` and the
//! transfer batches a Mamba model emits (completed or failed), over page sizes 1, 2 and
//! 4, windows of 1 to 6 tokens (pages larger than the window included) and SWA pools
//! small enough that SWA eviction runs all the time.
//!
//! No reference model of the tree: the SWA component's invariants are checked after
//! every step, by `audit()` (every SWA page free or paired with exactly one KV page that
//! is not free; every request's window live; the window locks each node holds are
//! exactly those of the live receipts; every unlocked node with live SWA queued for
//! eviction; no unlocked leaf ending in a dead page) and here:
//!
//! * the SWA pool's gauges add up to its capacity, and SWA pages held by requests are
//!   at most what their windows (and pages being filled) need;
//! * each live request's `request_swa_indices` covers at least its last W tokens, one
//!   slot per token, none missing, no slot twice;
//! * a match never reports more than its KV match, its slots are one per token;
//! * no fault is ever recorded (a window lock released twice would be one);
//! * the teardown (batches completed, requests finished, receipts released, everything
//!   evicted) leaves every KV and SWA slot free.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::proptest_config;
use proptest::prelude::*;
use radixcache_core::{Cache, Config, LockReceipt, RequestId};

#[derive(Debug, Clone)]
enum Op {
    Admit { system: u8, tail: Vec<u8> },
    Extend { req: u8, n: u8 },
    Decode { token: u8 },
    Checkpoint { req: u8 },
    Finish { req: u8 },
    Abort { req: u8 },
    Match { system: u8, tail: Vec<u8> },
    Insert { system: u8, tail: Vec<u8> },
    Lock { system: u8, tail: Vec<u8> },
    Unlock { k: u8 },
    DropReceipt { k: u8 },
    Evict { tokens: u8 },
    EvictSwa { pages: u8 },
    Batches { fail: bool },
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
        1 => any::<u8>().prop_map(|tokens| Op::Evict { tokens }),
        2 => any::<u8>().prop_map(|pages| Op::EvictSwa { pages }),
        2 => any::<bool>().prop_map(|fail| Op::Batches { fail }),
    ]
}

/// `(page_size, kv_slots, swa_slots, window, mamba_slots)`.
fn config() -> impl Strategy<Value = (usize, usize, usize, usize, usize)> {
    (
        prop::sample::select(vec![1usize, 2, 4]),
        4usize..24,
        2usize..10,
        1usize..=6,
        prop::sample::select(vec![0usize, 0, 3, 6]),
    )
        .prop_map(|(ps, kv_pages, swa_pages, window, mamba)| {
            (ps, kv_pages * ps, swa_pages * ps, window, mamba)
        })
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
    window: usize,
    /// Live requests, each with the prompt it still has to extend by.
    reqs: Vec<(RequestId, Vec<u32>)>,
    receipts: Vec<LockReceipt>,
}

impl Machine {
    fn new(ps: usize, kv_slots: usize, swa_slots: usize, window: usize, mamba: usize) -> Self {
        let c = Cache::new(Config {
            swa_slots,
            swa_window: window,
            mamba_slots: mamba,
            ..Config::kv(kv_slots, ps)
        })
        .unwrap();
        Machine {
            c,
            window,
            reqs: Vec::new(),
            receipts: Vec::new(),
        }
    }

    fn pick(&self, k: u8) -> Option<usize> {
        (!self.reqs.is_empty()).then(|| usize::from(k) % self.reqs.len())
    }

    fn step(&mut self, op: &Op) {
        match op {
            Op::Admit { system, tail } => {
                let t = tokens(*system, tail);
                if let Some(id) = self.c.admit(None, &t).unwrap() {
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
                    if self.c.finish(self.reqs[k].0).is_ok() {
                        self.reqs.swap_remove(k);
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
                let m = self.c.match_prefix(None, &t);
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
                    .evict(usize::from(*tokens % 16), usize::from(*tokens / 16));
            }
            Op::EvictSwa { pages } => {
                let n = if *pages == 255 {
                    usize::MAX
                } else {
                    usize::from(*pages % 8)
                };
                self.c.evict_swa(n);
            }
            Op::Batches { fail } => self.settle_batches(*fail),
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

    fn settle_batches(&mut self, fail: bool) {
        for b in self.c.take_batches() {
            if fail {
                self.c.fail(b.id).unwrap();
            } else {
                self.c.complete(b.id).unwrap();
            }
        }
    }

    fn check(&self) {
        let c = &self.c;
        c.audit().unwrap();
        assert_eq!(c.fault(), None);
        let sum = stat(c, "swa_free_slots")
            + stat(c, "swa_cached_tokens")
            + stat(c, "swa_caller_slots")
            + stat(c, "swa_request_slots")
            + stat(c, "swa_draining_slots");
        assert_eq!(sum, stat(c, "swa_capacity_slots"));
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

    fn teardown(mut self) {
        self.settle_batches(false);
        for (id, _) in std::mem::take(&mut self.reqs) {
            if self.c.finish(id).is_err() {
                self.c.abort(id).unwrap();
            }
        }
        for r in std::mem::take(&mut self.receipts) {
            self.c.unlock(r).unwrap();
        }
        self.settle_batches(false);
        self.c.evict(usize::MAX, usize::MAX);
        self.c.audit().unwrap();
        assert_eq!(
            stat(&self.c, "swa_free_slots"),
            stat(&self.c, "swa_capacity_slots")
        );
        assert_eq!(self.c.kv_counts().free, self.c.kv_pool().capacity_pages());
    }
}

proptest! {
    #![proptest_config(proptest_config("proptest-regressions/swa_machine.txt"))]

    #[test]
    fn swa_cache_keeps_its_invariants(
        (ps, kv_slots, swa_slots, window, mamba) in config(),
        ops in prop::collection::vec(op(), 1..=120),
    ) {
        let mut m = Machine::new(ps, kv_slots, swa_slots, window, mamba);
        m.check();
        for op in &ops {
            m.step(op);
            m.check();
        }
        m.teardown();
    }
}
