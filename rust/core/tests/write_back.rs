//! Write-back makes room in one round (docs/contract.md rule 11): whatever `alloc_kv(n)` a
//! write-through cache grants at once, the same cache under write-back grants after one
//! round of the backups its first `alloc_kv(n)` started, however long the chains of
//! nodes that must go (a parent is chosen in the same pass as the children it waits for).
//!
//! Proptest builds twin caches, write-through and write-back, with the same random
//! inserts (shared prefixes, so chains and branches form), matches and locks, then asks
//! both for the same number of slots.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{assert_pool_sums, proptest_config};
use proptest::prelude::*;
use radixcache_core::{Cache, Config, WritePolicy};

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
                c.alloc_mamba().map(i64::from)
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
        })
        .unwrap()
    })
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 512,
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
