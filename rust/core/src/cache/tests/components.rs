//! The components: a model's set of them, the match cut where all accept, and the
//! component property test: random operations (insert, match, lock and unlock,
//! eviction, requests admitted, extended, checkpointed, finished and aborted, their
//! copies landing or failing) on caches with and without Mamba and SWA layers, with the
//! test-only component of `components/balanced.rs` switched on beside the model's own,
//! and `audit()` after every step: a fourth component, added as one file and one line
//! of the components' list, is asked at every hook and finds every lock released once
//! and every split real.

use proptest::prelude::*;

use crate::cache::components::balanced::Balanced;
use crate::cache::{Cache, ComponentKind, LockReceipt, Model};
use crate::config::Config;
use crate::ids::RequestId;

/// One step of the property test.
#[derive(Debug, Clone)]
enum Op {
    /// Caches `tokens` (the reusable prefix a match finds, fresh slots for the rest, a
    /// state at the end in a hybrid cache).
    Insert(Vec<u32>),
    /// `match_prefix` of `tokens`.
    Match(Vec<u32>),
    /// Locks the node a match of `tokens` ends at.
    Lock(Vec<u32>),
    /// Unlocks the `k`-th live receipt (modulo their number).
    Unlock(usize),
    /// Evicts KV tokens and states.
    Evict(usize, usize),
    /// Admits a request for `tokens`.
    Admit(Vec<u32>),
    /// Extends the `k`-th request by `n` tokens.
    Extend(usize, u32),
    /// Checkpoints the `k`-th request.
    Checkpoint(usize),
    /// Finishes the `k`-th request.
    Finish(usize),
    /// Aborts the `k`-th request.
    Abort(usize),
    /// Runs the batches emitted so far: every copy lands, or every one fails.
    Batches(bool),
}

/// Token sequences over a small alphabet, so that prefixes are shared and nodes split.
fn tokens() -> impl Strategy<Value = Vec<u32>> {
    prop::collection::vec(1..4u32, 1..20)
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => tokens().prop_map(Op::Insert),
        2 => tokens().prop_map(Op::Match),
        2 => tokens().prop_map(Op::Lock),
        2 => any::<usize>().prop_map(Op::Unlock),
        1 => (0..40usize, 0..4usize).prop_map(|(kv, s)| Op::Evict(kv, s)),
        2 => tokens().prop_map(Op::Admit),
        2 => (any::<usize>(), 1..9u32).prop_map(|(k, n)| Op::Extend(k, n)),
        1 => any::<usize>().prop_map(Op::Checkpoint),
        2 => any::<usize>().prop_map(Op::Finish),
        1 => any::<usize>().prop_map(Op::Abort),
        2 => any::<bool>().prop_map(Op::Batches),
    ]
}

fn config(mamba: usize, swa: usize) -> Config {
    Config {
        kv_slots: 64,
        page_size: 4,
        mamba_slots: mamba,
        swa_slots: swa,
        swa_window: if swa > 0 { 8 } else { 0 },
        ..Config::default()
    }
}

#[test]
fn a_model_is_the_set_of_configured_components_full_attention_first() {
    let names = |mamba, swa| {
        let c = Cache::new(config(mamba, swa)).unwrap();
        c.components()
            .into_iter()
            .map(ComponentKind::name)
            .collect::<Vec<_>>()
    };
    assert_eq!(names(0, 0), ["full"]);
    assert_eq!(names(4, 0), ["full", "mamba"]);
    assert_eq!(names(0, 32), ["full", "swa"]);
    assert_eq!(names(4, 32), ["full", "mamba", "swa"]);
    assert!(Model::default().has(ComponentKind::Full));
    assert!(!Model::default().has(ComponentKind::Swa));
}

#[test]
fn a_match_is_cut_where_every_component_accepts() {
    // Mamba + SWA: KV and window reach 16 tokens, the only state sits at 8; the match
    // ends there.
    let mut c = Cache::new(config(4, 32)).unwrap();
    let tokens: Vec<u32> = (1..=16).collect();
    let slots = c.alloc_kv(16).unwrap().unwrap();
    c.insert(None, &tokens, &slots, 0).unwrap();
    let state = c.alloc_mamba().unwrap().unwrap();
    c.insert_with_state(None, &tokens[..8], &slots[..8], 8, Some(i64::from(state)))
        .unwrap();
    c.audit().unwrap();
    let m = c.match_prefix(None, &tokens);
    assert_eq!(m.kv_len, 16, "the KV match reaches the end");
    assert_eq!(m.device_len, 8, "cut at the only node end with a state");
    c.audit().unwrap();
}

/// A cache of `page_size`, with Mamba layers (`mamba`) and SWA layers (`swa`), small
/// enough that eviction runs.
fn cache(page_size: usize, mamba: bool, swa: bool) -> Cache {
    Cache::new(Config {
        mamba_slots: if mamba { 6 } else { 0 },
        swa_slots: if swa { 48 } else { 0 },
        swa_window: if swa { 4 } else { 0 },
        ..Config::kv(64, page_size)
    })
    .unwrap()
}

/// What a run holds between steps.
struct Run {
    c: Cache,
    receipts: Vec<LockReceipt>,
    requests: Vec<RequestId>,
}

impl Run {
    /// The `k`-th live request (modulo their number), if any.
    fn request(&self, k: usize) -> Option<RequestId> {
        (!self.requests.is_empty()).then(|| self.requests[k % self.requests.len()])
    }

    /// Caches `toks`, cut to whole pages; nothing when the slots cannot be had.
    fn insert(&mut self, toks: &[u32]) {
        let c = &mut self.c;
        let ps = c.page_size();
        let toks = &toks[..toks.len() / ps * ps];
        if toks.is_empty() {
            return;
        }
        let m = c.match_prefix(None, toks);
        let rest = toks.len() - m.device_len;
        let Some(fresh) = c.alloc_kv(rest).unwrap() else {
            return;
        };
        let mut kv = m.kv_indices.clone();
        kv.extend_from_slice(&fresh);
        let state = if c.is_hybrid() {
            c.alloc_mamba().unwrap().map(i64::from)
        } else {
            None
        };
        c.insert_with_state(None, toks, &kv, m.device_len, state)
            .unwrap();
    }

    /// Runs one step; a call the cache refuses (a request still copying, say) is fine.
    fn step(&mut self, op: &Op) {
        match op {
            Op::Insert(toks) => self.insert(toks),
            Op::Match(toks) => {
                self.c.match_prefix(None, toks);
            }
            Op::Lock(toks) => {
                let node = self.c.match_prefix(None, toks).node;
                self.receipts.push(self.c.lock(node).unwrap());
            }
            Op::Unlock(k) => {
                if !self.receipts.is_empty() {
                    let r = self.receipts.swap_remove(k % self.receipts.len());
                    self.c.unlock(r).unwrap();
                }
            }
            Op::Evict(kv, states) => {
                self.c.evict(*kv, *states);
            }
            Op::Admit(toks) => {
                if let Some(id) = self.c.admit(None, toks).unwrap() {
                    self.requests.push(id);
                }
            }
            Op::Extend(k, n) => {
                if let Some(id) = self.request(*k) {
                    let _ = self.c.extend(id, &(1..=*n).collect::<Vec<_>>());
                }
            }
            Op::Checkpoint(k) => {
                if let Some(id) = self.request(*k) {
                    let _ = self.c.checkpoint(id);
                }
            }
            Op::Finish(k) | Op::Abort(k) => {
                if let Some(id) = self.request(*k) {
                    let ended = if matches!(op, Op::Finish(_)) {
                        self.c.finish(id)
                    } else {
                        self.c.abort(id)
                    };
                    if ended.is_ok() {
                        self.requests.retain(|&r| r != id);
                    }
                }
            }
            Op::Batches(landed) => self.run_batches(*landed),
        }
    }

    /// Ends every batch emitted so far.
    fn run_batches(&mut self, landed: bool) {
        for b in self.c.take_batches() {
            if landed {
                self.c.complete(b.id).unwrap();
            } else {
                self.c.fail(b.id).unwrap();
            }
        }
    }

    /// Lets go of everything: the batches land, the requests end, the locks go.
    fn wind_down(&mut self) {
        self.run_batches(true);
        for id in std::mem::take(&mut self.requests) {
            self.c.abort(id).unwrap();
        }
        self.run_batches(true);
        for r in std::mem::take(&mut self.receipts) {
            self.c.unlock(r).unwrap();
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn every_component_is_asked_in_balance_under_random_operations(
        page_size in prop_oneof![Just(1usize), Just(2usize)],
        mamba in any::<bool>(),
        swa in any::<bool>(),
        ops in prop::collection::vec(op(), 1..60),
    ) {
        let _on = Balanced::switch_on();
        let mut run = Run {
            c: cache(page_size, mamba, swa),
            receipts: Vec::new(),
            requests: Vec::new(),
        };
        for (n, op) in ops.iter().enumerate() {
            run.step(op);
            if let Err(e) = run.c.audit() {
                return Err(TestCaseError::fail(format!("step {n} ({op:?}): {e}")));
            }
        }
        run.wind_down();
        prop_assert!(run.c.audit().is_ok(), "{:?}", run.c.audit());
    }
}

#[test]
fn the_test_component_sees_every_split_and_every_release() {
    let _on = Balanced::switch_on();
    let mut run = Run {
        c: cache(1, true, false),
        receipts: Vec::new(),
        requests: Vec::new(),
    };
    run.insert(&[1, 2, 3, 4]);
    run.step(&Op::Lock(vec![1, 2, 3, 4]));
    run.insert(&[1, 2, 5]);
    assert_eq!(Balanced::splits(), 1, "the insert split the locked node");
    run.c.audit().unwrap();
    run.wind_down();
    run.c.audit().unwrap();
}
