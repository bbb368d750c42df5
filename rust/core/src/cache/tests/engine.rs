//! Unit tests of engine-owned pools (`pools="engine"`): every slot starts with the
//! engine, `insert` claims the slots it is passed, what the tree gives up is queued and
//! handed back once by `take_freed`, `evict` returns what it frees, and the calls that
//! allocate from the cache's pools are refused.

use super::util::stat;
use crate::cache::*;
use crate::config::{Config, PoolOwner};
use crate::error::Error;
use crate::pool::PageState;

fn engine(kv_slots: usize, page_size: usize, mamba_slots: usize) -> Cache {
    Cache::new(Config {
        mamba_slots,
        pools: PoolOwner::Engine,
        ..Config::kv(kv_slots, page_size)
    })
    .unwrap()
}

fn slots(range: std::ops::Range<i64>) -> Vec<i64> {
    range.collect()
}

#[test]
fn every_slot_starts_with_the_engine_and_nothing_is_queued() {
    let c = engine(16, 4, 3);
    assert!(c.engine_owned());
    assert_eq!(c.kv_pool().counts().caller, 4);
    assert_eq!(c.mamba_pool().counts().caller, 3);
    assert_eq!((c.available_kv(), c.available_mamba()), (0, 0));
    assert_eq!(stat(&c, "kv_engine_slots"), 16);
    assert_eq!(
        stat(&c, "kv_caller_slots"),
        16,
        "the engine's slots are the caller's"
    );
    assert_eq!(stat(&c, "mamba_engine_slots"), 3);
    assert_eq!(stat(&c, "kv_queued_slots"), 0);
    assert_eq!(stat(&c, "kv_free_slots"), 0);
    c.audit().unwrap();
}

#[test]
fn insert_claims_the_engines_slots_and_queues_duplicates_and_the_unaligned_tail() {
    let mut c = engine(32, 2, 0);
    let ins = c.insert(None, &[1, 2, 3, 4, 5], &slots(0..5), 0).unwrap();
    assert_eq!(ins.prefix_len, 0);
    // Pages 0 and 1 are the tree's; the tail's page 2 (slots 4, 5) is queued.
    assert_eq!(c.kv_pool().state(0), Some(PageState::Tree));
    assert_eq!(c.kv_pool().state(2), Some(PageState::Free));
    assert_eq!(stat(&c, "kv_queued_slots"), 2);
    assert_eq!(c.available_kv(), 2, "available: the queued slots");
    c.audit().unwrap();
    // The same tokens again in fresh slots: both pages are duplicates, queued.
    let again = c.insert(None, &[1, 2, 3, 4], &slots(8..12), 0).unwrap();
    assert_eq!(again.prefix_len, 4);
    c.audit().unwrap();
    let (kv, states) = c.take_freed();
    assert_eq!(
        kv,
        vec![4, 5, 8, 9, 10, 11],
        "every slot of every queued page"
    );
    assert!(states.is_empty());
    assert_eq!(
        c.take_freed(),
        (vec![], vec![]),
        "each slot is handed back once"
    );
    assert_eq!(stat(&c, "kv_slots_returned"), 6);
    assert_eq!(stat(&c, "kv_engine_slots"), 28);
    // Handed back, the slots are the engine's again: an insert may claim them.
    c.insert(None, &[7, 7], &[4, 5], 0).unwrap();
    assert_eq!(c.match_prefix(None, &[7, 7]).kv_indices, vec![4, 5]);
    c.audit().unwrap();
}

#[test]
fn insert_after_match_and_lock_claims_only_from_owned_from() {
    let mut c = engine(16, 1, 0);
    c.insert(None, &[1, 2], &[0, 1], 0).unwrap();
    let m = c.match_prefix(None, &[1, 2, 3, 4]);
    let lock = c.lock(m.node).unwrap();
    let mut kv = m.kv_indices.clone();
    kv.extend([5, 6]);
    let ins = c.insert(None, &[1, 2, 3, 4], &kv, 2).unwrap();
    assert_eq!(ins.prefix_len, 2);
    assert_eq!(
        c.match_prefix(None, &[1, 2, 3, 4]).kv_indices,
        vec![0, 1, 5, 6]
    );
    assert_eq!(c.take_freed(), (vec![], vec![]), "nothing given up");
    // The prefix must be the tree's slots for it, as in cache mode.
    let err = c.insert(None, &[1, 2, 9], &[0, 7, 8], 2).unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidArgument {
                arg: "kv_indices",
                ..
            }
        ),
        "{err}"
    );
    c.unlock(lock).unwrap();
    c.audit().unwrap();
}

#[test]
fn insert_refuses_slots_that_are_not_the_engines_and_changes_nothing() {
    let mut c = engine(8, 1, 2);
    c.insert(None, &[1, 2, 3], &[0, 1, 2], 0).unwrap();
    c.insert(None, &[1, 2], &[3, 4], 0).unwrap(); // 3 and 4 queued.
    let cases: [(&[i64], Option<i64>, &str, &str); 6] = [
        (&[0], None, "kv_indices", "in the cache's tree"),
        (&[3], None, "kv_indices", "queued to go back to the engine"),
        (&[8], None, "kv_indices", "out of range"),
        (&[5, 5], None, "kv_indices", "listed twice"),
        (&[5], Some(2), "mamba_slot", "out of range"),
        (&[-1], None, "kv_indices", "out of range"),
    ];
    for (kv, state, arg, why) in cases {
        let before = (c.snapshot(), c.stats(), c.kv_pool().counts());
        let toks: Vec<u32> = (10..).take(kv.len()).collect();
        let err = c.insert_with_state(None, &toks, kv, 0, state).unwrap_err();
        assert!(
            matches!(&err, Error::InvalidArgument { arg: a, reason } if *a == arg
                && reason.contains(why)),
            "{kv:?}: {err}"
        );
        assert_eq!((c.snapshot(), c.stats(), c.kv_pool().counts()), before);
        c.audit().unwrap();
    }
}

#[test]
fn a_refused_state_slot_gives_the_kv_slots_back_to_the_engine() {
    let mut c = engine(8, 1, 2);
    c.insert_with_state(None, &[1], &[0], 0, Some(0)).unwrap();
    let before = (c.kv_pool().counts(), c.mamba_pool().counts());
    // State slot 0 is the tree's: the KV slot claimed first goes back to the engine.
    let err = c
        .insert_with_state(None, &[2], &[1], 0, Some(0))
        .unwrap_err();
    assert!(
        matches!(&err, Error::InvalidArgument { arg: "mamba_slot", reason }
            if reason.contains("in the cache's tree")),
        "{err}"
    );
    assert_eq!((c.kv_pool().counts(), c.mamba_pool().counts()), before);
    assert_eq!(c.kv_pool().state(1), Some(PageState::Caller));
    c.audit().unwrap();
}

#[test]
fn a_state_the_tree_does_not_keep_is_queued() {
    let mut c = engine(16, 2, 4);
    let first = c
        .insert_with_state(None, &[1, 2], &[0, 1], 0, Some(0))
        .unwrap();
    assert!(!first.mamba_existed);
    // The node has a state already: the new one is queued.
    let m = c.match_prefix(None, &[1, 2]);
    let replaced = c
        .insert_with_state(None, &[1, 2], &m.kv_indices, 2, Some(1))
        .unwrap();
    assert!(replaced.mamba_existed);
    // An unaligned end is no node's end: the state is queued, with the tail's page.
    c.insert_with_state(None, &[5, 6, 7], &[2, 3, 4], 0, Some(2))
        .unwrap();
    assert_eq!(stat(&c, "mamba_queued_slots"), 2);
    c.audit().unwrap();
    assert_eq!(c.take_freed(), (vec![4, 5], vec![1, 2]));
    assert_eq!(stat(&c, "mamba_slots_returned"), 2);
    assert_eq!(stat(&c, "mamba_engine_slots"), 3);
    c.audit().unwrap();
}

#[test]
fn evict_returns_the_slots_it_freed_to_the_engine_and_leaves_the_queue_alone() {
    let mut c = engine(16, 2, 4);
    c.insert_with_state(None, &[1, 2], &[0, 1], 0, Some(0))
        .unwrap();
    c.insert_with_state(None, &[1, 2, 3, 4], &[0, 1, 2, 3], 2, Some(1))
        .unwrap();
    c.insert(None, &[1, 2], &[6, 7], 0).unwrap(); // Duplicates: slots 6, 7 queued.
    let out = c.evict(16, 0);
    assert_eq!((out.kv_tokens, out.mamba_states), (4, 2));
    let mut kv = out.kv_indices.clone();
    kv.sort_unstable();
    assert_eq!(kv, vec![0, 1, 2, 3]);
    let mut states = out.mamba_slots.clone();
    states.sort_unstable();
    assert_eq!(states, vec![0, 1]);
    for s in 0..4 {
        assert_eq!(
            c.kv_pool().state(s / 2),
            Some(PageState::Caller),
            "slot {s}"
        );
    }
    assert_eq!(stat(&c, "kv_queued_slots"), 2, "the queue is take_freed's");
    assert_eq!(stat(&c, "kv_slots_returned"), 4);
    assert_eq!(stat(&c, "mamba_slots_returned"), 2);
    c.audit().unwrap();
    assert_eq!(c.take_freed(), (vec![6, 7], vec![]));
    // A state evicted alone (its node kept as a tombstone) is returned too.
    c.insert_with_state(None, &[1, 2], &[0, 1], 0, Some(3))
        .unwrap();
    c.insert_with_state(None, &[1, 2, 3, 4], &[0, 1, 2, 3], 2, Some(2))
        .unwrap();
    let m = c.match_prefix(None, &[1, 2, 3, 4]);
    let lock = c.lock(m.node).unwrap();
    let out = c.evict(0, 4);
    assert_eq!((out.kv_tokens, out.kv_indices.len()), (0, 0));
    assert_eq!(out.mamba_slots, vec![3], "the locked leaf's state stays");
    c.unlock(lock).unwrap();
    c.audit().unwrap();
}

#[test]
fn calls_that_allocate_from_the_cache_pools_are_refused_naming_the_mode() {
    let mut c = engine(16, 1, 2);
    c.insert(None, &[1, 2], &[0, 1], 0).unwrap();
    let node = c.match_prefix(None, &[1, 2]).node;
    let before = (c.snapshot(), c.kv_pool().counts(), c.mamba_pool().counts());
    let refused = |e: Error, call: &str| {
        assert!(
            matches!(e, Error::EngineOwned(c) if c == call),
            "{call}: {e}"
        );
        assert!(e.to_string().contains("pools=\"engine\""), "{e}");
        assert!(e.to_string().starts_with(call), "{e}");
    };
    refused(c.alloc_kv(1).unwrap_err(), "alloc_kv");
    refused(c.free_kv(&[0]).unwrap_err(), "free_kv");
    refused(c.alloc_mamba().unwrap_err(), "alloc_mamba");
    refused(c.free_mamba(0).unwrap_err(), "free_mamba");
    refused(c.admit(None, &[1, 2]).unwrap_err(), "admit");
    refused(c.evict_host(1, 1).unwrap_err(), "evict_host");
    // A request id from a cache that owns its pools: refused before it is looked at.
    let mut other = Cache::new(Config {
        mamba_slots: 2,
        ..Config::kv(16, 1)
    })
    .unwrap();
    let id = other.admit(None, &[1]).unwrap().unwrap();
    refused(c.extend(id, &[3]).unwrap_err(), "extend");
    refused(c.extend_batch(&[id], &[3]).unwrap_err(), "extend_batch");
    refused(c.checkpoint(id).unwrap_err(), "checkpoint");
    refused(c.finish(id).unwrap_err(), "finish");
    refused(c.abort(id).unwrap_err(), "abort");
    refused(
        c.load_back(LoadTarget::Node(node), None, None).unwrap_err(),
        "load_back",
    );
    assert_eq!(
        (c.snapshot(), c.kv_pool().counts(), c.mamba_pool().counts()),
        before
    );
    c.audit().unwrap();
}

#[test]
fn a_cache_that_owns_its_pools_queues_nothing_and_returns_no_slots() {
    let mut c = Cache::new(Config {
        mamba_slots: 2,
        ..Config::kv(16, 1)
    })
    .unwrap();
    assert!(!c.engine_owned());
    let kv = c.alloc_kv(3).unwrap().unwrap();
    c.insert(None, &[1, 2, 3], &kv, 0).unwrap();
    let out = c.evict(3, 0);
    assert_eq!(out.kv_tokens, 3);
    assert!(out.kv_indices.is_empty() && out.mamba_slots.is_empty());
    assert_eq!(c.take_freed(), (vec![], vec![]));
    for key in [
        "kv_engine_slots",
        "kv_queued_slots",
        "mamba_engine_slots",
        "mamba_queued_slots",
        "kv_slots_returned",
        "mamba_slots_returned",
    ] {
        assert_eq!(stat(&c, key), 0, "{key}");
    }
    assert_eq!(c.available_kv(), 16);
    c.audit().unwrap();
}

#[test]
fn audit_finds_a_slot_queued_twice() {
    let mut c = engine(8, 1, 0);
    c.insert(None, &[1, 2], &[0, 1], 0).unwrap();
    c.insert(None, &[1, 2], &[2, 3], 0).unwrap();
    c.audit().unwrap();
    c.kv_pool().corrupt_queue_for_tests();
    let err = c.audit().unwrap_err();
    assert!(
        matches!(&err, Error::Invariant(why) if why.contains("free list")),
        "{err}"
    );
}

#[test]
fn the_shared_handle_refuses_every_request_naming_the_call() {
    let h = crate::HybridCache::new(Config {
        pools: PoolOwner::Engine,
        ..Config::kv(8, 1)
    })
    .unwrap();
    let other = crate::HybridCache::new(Config::kv(8, 1)).unwrap();
    let r = other.admit(None, &[1]).unwrap().unwrap();
    assert!(matches!(
        h.request_id(&r, "extend"),
        Err(Error::EngineOwned("extend"))
    ));
    assert!(matches!(
        h.load_back_request(&r, None),
        Err(Error::EngineOwned("load_back"))
    ));
    assert!(matches!(
        h.load_back(
            other.with(|c| c.match_prefix(None, &[1]).node).unwrap(),
            None,
            Some(&r)
        ),
        Err(Error::EngineOwned("load_back"))
    ));
    assert!(matches!(
        h.admit(None, &[1]),
        Err(Error::EngineOwned("admit"))
    ));
    assert!(h.broken().is_none(), "a refusal does not break the cache");
}

#[test]
fn tree_slots_lists_what_the_tree_holds_and_nothing_queued_or_the_engines() {
    let mut c = engine(16, 2, 4);
    assert_eq!(c.tree_slots(), (vec![], vec![]));
    c.insert_with_state(None, &[1, 2, 3, 4], &[4, 5, 0, 1], 0, Some(3))
        .unwrap();
    c.insert(None, &[1, 2, 9], &[6, 7, 8], 0).unwrap(); // [6, 7] duplicates, [8] a tail.
    assert_eq!(c.tree_slots(), (vec![0, 1, 4, 5], vec![3]));
    // A state at [1, 2] too, so that the node stays when its child is evicted.
    c.insert_with_state(None, &[1, 2], &[4, 5], 2, Some(1))
        .unwrap();
    assert_eq!(c.tree_slots(), (vec![0, 1, 4, 5], vec![1, 3]));
    c.evict(2, 0);
    assert_eq!(c.tree_slots(), (vec![4, 5], vec![1]));
    c.audit().unwrap();
}
