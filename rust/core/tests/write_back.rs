//! Write-back makes room in one round (docs/contract.md rule 11): whatever `alloc_kv(n)` a
//! write-through cache grants at once, the same cache under write-back grants after one
//! round of the backups its first `alloc_kv(n)` started, however long the chains of
//! nodes that must go (a parent is chosen in the same pass as the children it waits for).
//!
//! Proptest builds twin caches, write-through and write-back, with the same random
//! inserts (shared prefixes, so chains and branches form), matches and locks, then asks
//! both for the same number of slots.
//!
//! The second property drives a hybrid write-back cache (Mamba states on both tiers, a
//! host state pool that fills up) through the request API the way a scheduler does:
//! shared prompts and long chats admitted (copy-on-write of the cached state),
//! extended, checkpointed, finished, aborted, decode steps, low-level inserts with and
//! without states, state evictions that leave tombstones. Every `extend` or decode step
//! refused is retried after one round of the batches the cache emitted; refused again,
//! it must stay refused after a second round: one round is always enough.
//!
//! Cases: `PROPTEST_CASES` when set (60,000 for the long run), else a count that keeps CI
//! fast.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{assert_pool_sums, proptest_config};
use proptest::prelude::*;
use radixcache_core::{Cache, Config, RequestId, WritePolicy};

/// `default` cases, or `PROPTEST_CASES` when set.
fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[derive(Debug, Clone)]
enum Op {
    /// Cache `base` tokens of one of a few prefixes, then `tail`.
    Insert {
        base: u8,
        cut: usize,
        tail: Vec<u32>,
        state: bool,
    },
    /// Touch a prefix (LRU order).
    Match { base: u8, cut: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..4, 0usize..24, prop::collection::vec(0u32..3, 0..10), any::<bool>())
            .prop_map(|(base, cut, tail, state)| Op::Insert { base, cut, tail, state }),
        1 => (0u8..4, 0usize..24).prop_map(|(base, cut)| Op::Match { base, cut }),
    ]
}

const BASES: [&[u32]; 4] = [
    &[1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5],
    &[1, 1, 1, 1, 2, 2, 2, 2, 9, 9, 9, 9, 8, 8, 8, 8],
    &[7, 7, 7, 7, 6, 6, 6, 6, 5, 5, 5, 5],
    &[1, 1, 1, 1, 7, 7],
];

fn tokens(base: u8, cut: usize, tail: &[u32]) -> Vec<u32> {
    let b = BASES[usize::from(base)];
    let mut t = b[..cut.min(b.len())].to_vec();
    t.extend_from_slice(tail);
    t
}

fn run_batches(c: &mut Cache) {
    loop {
        let batches = c.take_batches();
        if batches.is_empty() {
            return;
        }
        // Acknowledged last to first: a parent's backup may land before its children's.
        for b in batches.iter().rev() {
            c.start(b.id).unwrap();
            c.complete(b.id).unwrap();
        }
    }
}

fn apply(c: &mut Cache, op: &Op) {
    match op {
        Op::Insert {
            base,
            cut,
            tail,
            state,
        } => {
            let toks = tokens(*base, *cut, tail);
            let ps = c.page_size();
            let m = c.match_prefix(None, &toks);
            // Held while allocating, as a scheduler does, so eviction cannot take it.
            let lock = c.lock(m.node).unwrap();
            let rest = toks.len() - m.device_len;
            let Some(fresh) = c.alloc_kv(rest.div_ceil(ps) * ps).unwrap() else {
                c.unlock(lock).unwrap();
                return;
            };
            let mut kv = m.kv_indices.clone();
            kv.extend_from_slice(&fresh[..rest]);
            let slot = if *state && c.is_hybrid() {
                c.alloc_mamba().unwrap().map(i64::from)
            } else {
                None
            };
            c.insert_with_state(None, &toks, &kv, m.device_len, slot)
                .unwrap();
            c.unlock(lock).unwrap();
        }
        Op::Match { base, cut } => {
            c.match_prefix(None, &tokens(*base, *cut, &[]));
        }
    }
}

fn twins(ps: usize, kv: usize, host: usize, states: usize) -> [Cache; 2] {
    [WritePolicy::WriteThrough, WritePolicy::WriteBack].map(|write_policy| {
        Cache::new(Config {
            kv_slots: kv,
            page_size: ps,
            mamba_slots: states,
            host_kv_slots: host,
            host_mamba_slots: if states > 0 { states } else { 0 },
            write_policy,
            write_through_threshold: None,
            ..Config::default()
        })
        .unwrap()
    })
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases(512),
        ..proptest_config("proptest-regressions/write_back.txt")
    })]

    #[test]
    fn one_round_of_backups_makes_the_room_write_through_has_at_once(
        ps in prop_oneof![Just(1usize), Just(2), Just(4)],
        kv_pages in 6usize..24,
        host_pages in 4usize..48,
        states in prop_oneof![Just(0usize), 2usize..6],
        ops in prop::collection::vec(op(), 1..40),
        ask in 1usize..24,
    ) {
        let [mut wt, mut wb] = twins(ps, kv_pages * ps, host_pages * ps, states);
        for op in &ops {
            for c in [&mut wt, &mut wb] {
                apply(c, op);
                run_batches(c);
            }
        }
        let n = ask.min(kv_pages) * ps;
        // Write-through grants at once; write-back at once or after one round.
        if wt.alloc_kv(n).unwrap().is_some() && wb.alloc_kv(n).unwrap().is_none() {
            wb.audit().unwrap();
            run_batches(&mut wb);
            wb.audit().unwrap();
            prop_assert!(
                wb.alloc_kv(n).unwrap().is_some(),
                "write-back could not make {n} slots in one round: {wb:?}"
            );
        }
        for c in [&wt, &wb] {
            c.audit().unwrap();
            assert_pool_sums(c);
        }
    }
}

/// The case the issue reproduced: a chain of nodes none of which is on the host.
#[test]
fn a_chain_of_nodes_is_evicted_in_one_round() {
    let [_, mut c] = twins(1, 12, 32, 0);
    for len in [4, 8, 12] {
        apply(
            &mut c,
            &Op::Insert {
                base: 0,
                cut: len,
                tail: Vec::new(),
                state: false,
            },
        );
    }
    assert_eq!(c.total_size(), 12);
    assert_eq!(
        c.alloc_kv(12).unwrap(),
        None,
        "the room arrives with the backups"
    );
    let batches = c.take_batches();
    assert_eq!(
        batches.len(),
        3,
        "every node of the chain is backed up at once"
    );
    c.audit().unwrap();
    for b in batches.iter().rev() {
        c.complete(b.id).unwrap();
        c.audit().unwrap();
        assert_pool_sums(&c);
    }
    assert_eq!(c.alloc_kv(12).unwrap().map(|s| s.len()), Some(12));
    assert_eq!(
        c.match_prefix(None, BASES[0]).host_len,
        12,
        "demoted, not lost"
    );
    c.audit().unwrap();
}

// ---------------------------------------------------------------------------------------
// Hybrid caches through the request API

/// What the hybrid property does to the cache.
#[derive(Debug, Clone)]
enum Step {
    /// Admits a prompt (one of the shared prompts, or an earlier request's whole
    /// sequence: the next turn of a chat), cut at `cut`, plus `tail`; extends it by
    /// what the cache did not have.
    Admit {
        from: Source,
        cut: usize,
        tail: Vec<u32>,
    },
    /// Extends live request `which` by `tail` (a prefill chunk or a long answer).
    Extend { which: usize, tail: Vec<u32> },
    /// One decode token for every live request, in one call.
    Decode { token: u32 },
    /// Caches what live request `which` holds so far (a state at a whole page).
    Checkpoint { which: usize },
    /// Finishes live request `which` (its sequence becomes a chat's history).
    Finish { which: usize },
    /// Aborts live request `which`.
    Abort { which: usize },
    /// Caches tokens through the low-level API, with a state or without (see [`Op`]).
    Insert(Op),
    /// Evicts device states: internal nodes keep their KV as tombstones.
    EvictStates { n: usize },
}

/// Where an admitted prompt starts.
#[derive(Debug, Clone, Copy)]
enum Source {
    Base(u8),
    History(usize),
}

fn step() -> impl Strategy<Value = Step> {
    let tail = |max| prop::collection::vec(0u32..3, 0..max);
    let source = prop_oneof![
        (0u8..4).prop_map(Source::Base),
        (0usize..8).prop_map(Source::History),
    ];
    prop_oneof![
        4 => (source, 0usize..48, tail(12))
            .prop_map(|(from, cut, tail)| Step::Admit { from, cut, tail }),
        4 => (0usize..8, tail(14)).prop_map(|(which, tail)| Step::Extend { which, tail }),
        2 => (0u32..3).prop_map(|token| Step::Decode { token }),
        2 => (0usize..8).prop_map(|which| Step::Checkpoint { which }),
        3 => (0usize..8).prop_map(|which| Step::Finish { which }),
        1 => (0usize..8).prop_map(|which| Step::Abort { which }),
        2 => op().prop_map(Step::Insert),
        2 => (1usize..3).prop_map(|n| Step::EvictStates { n }),
    ]
}

/// A hybrid cache and the requests live in it.
struct Served {
    cache: Cache,
    live: Vec<(RequestId, Vec<u32>)>,
    /// Whole sequences of finished requests (the history of chats).
    history: Vec<Vec<u32>>,
}

impl Served {
    /// Runs `call` (an `extend` or a decode step); refused, retries it after one round
    /// of batches and, refused again, checks that a second round would not help either.
    /// Returns whether it was granted.
    fn one_round(
        &mut self,
        what: &str,
        mut call: impl FnMut(&mut Cache) -> Option<Vec<i64>>,
    ) -> Result<bool, TestCaseError> {
        if call(&mut self.cache).is_some() {
            return Ok(true);
        }
        run_batches(&mut self.cache);
        if call(&mut self.cache).is_some() {
            return Ok(true);
        }
        self.cache.audit().unwrap();
        let emitted = self.cache.take_batches();
        let second = !emitted.is_empty();
        for b in emitted.iter().rev() {
            self.cache.start(b.id).unwrap();
            self.cache.complete(b.id).unwrap();
        }
        run_batches(&mut self.cache);
        let granted = call(&mut self.cache).is_some();
        prop_assert!(
            !granted && !second,
            "{what} was refused after one round, but a second round of {} batches made \
             the room (granted after it: {granted}): {:?}",
            emitted.len(),
            self.cache
        );
        Ok(false)
    }

    fn extend(&mut self, k: usize, tail: &[u32]) -> Result<(), TestCaseError> {
        let (id, _) = self.live[k];
        if tail.is_empty() {
            return Ok(());
        }
        if self.one_round("extend", |c| c.extend(id, tail).unwrap())? {
            self.live[k].1.extend_from_slice(tail);
        } else {
            // Retracted, as a scheduler does when memory runs out.
            self.cache.abort(id).unwrap();
            self.live.remove(k);
        }
        Ok(())
    }

    fn apply(&mut self, step: &Step) -> Result<(), TestCaseError> {
        let n = self.live.len();
        match step {
            Step::Admit { from, cut, tail } => {
                let mut toks = match *from {
                    Source::Base(b) => BASES[usize::from(b)].to_vec(),
                    Source::History(h) if !self.history.is_empty() => {
                        self.history[h % self.history.len()].clone()
                    }
                    Source::History(_) => Vec::new(),
                };
                toks.truncate(*cut);
                toks.extend_from_slice(tail);
                toks.truncate(48);
                if toks.is_empty() || self.live.len() >= 6 {
                    return Ok(());
                }
                let Some(id) = self.cache.admit(None, &toks).unwrap() else {
                    return Ok(());
                };
                // The state copy runs before the request computes anything.
                run_batches(&mut self.cache);
                let cached = self.cache.request(id).unwrap().prefix_len;
                self.live.push((id, toks[..cached].to_vec()));
                self.extend(self.live.len() - 1, &toks[cached..])?;
            }
            Step::Extend { which, tail } if n > 0 => self.extend(which % n, tail)?,
            Step::Decode { token } if n > 0 => {
                let ids: Vec<_> = self.live.iter().map(|(id, _)| *id).collect();
                let toks = vec![*token; ids.len()];
                if self.one_round("decode step", |c| c.extend_batch(&ids, &toks).unwrap())? {
                    for (_, seq) in &mut self.live {
                        seq.push(*token);
                    }
                } else {
                    // One by one, retracting from the newest, as the scheduler does.
                    for k in (0..n).rev() {
                        if k < self.live.len() {
                            self.extend(k, &[*token])?;
                        }
                    }
                }
            }
            Step::Checkpoint { which } if n > 0 => {
                let (id, _) = self.live[which % n];
                self.cache.checkpoint(id).unwrap();
            }
            Step::Finish { which } if n > 0 => {
                let (id, seq) = self.live.remove(which % n);
                self.cache.finish(id).unwrap();
                self.history.push(seq);
            }
            Step::Abort { which } if n > 0 => {
                let (id, _) = self.live.remove(which % n);
                self.cache.abort(id).unwrap();
            }
            Step::Insert(op) => apply(&mut self.cache, op),
            Step::EvictStates { n } => {
                self.cache.evict(0, *n);
            }
            _ => {}
        }
        run_batches(&mut self.cache);
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases(256),
        ..proptest_config("proptest-regressions/write_back.txt")
    })]

    #[test]
    fn one_round_of_backups_makes_the_room_a_hybrid_request_asks_for(
        ps in prop_oneof![Just(1usize), Just(2), Just(4)],
        kv_pages in 6usize..24,
        host_pages in 4usize..48,
        states in 2usize..7,
        host_states in 1usize..6,
        steps in prop::collection::vec(step(), 1..60),
    ) {
        let cache = Cache::new(Config {
            kv_slots: kv_pages * ps,
            page_size: ps,
            mamba_slots: states,
            host_kv_slots: host_pages * ps,
            host_mamba_slots: host_states,
            write_policy: WritePolicy::WriteBack,
            write_through_threshold: None,
            ..Config::default()
        })
        .unwrap();
        let mut served = Served { cache, live: Vec::new(), history: Vec::new() };
        for step in &steps {
            served.apply(step)?;
            served.cache.audit().unwrap();
        }
        for (id, _) in std::mem::take(&mut served.live) {
            served.cache.finish(id).unwrap();
        }
        run_batches(&mut served.cache);
        served.cache.audit().unwrap();
        assert_pool_sums(&served.cache);
    }
}
