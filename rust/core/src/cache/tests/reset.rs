//! Unit tests of [`Cache::reset`]: it empties both tiers and every namespace, returns
//! every slot, keeps the counters, announces one `Cleared`, writes nothing to the L3
//! tier, and refuses, changing nothing, while anything holds the tree.

#![allow(clippy::many_single_char_names)]

use super::util::{put, stat};
use crate::cache::*;
use crate::config::{Config, L3Write, PoolOwner, WritePolicy};
use crate::error::Error;
use crate::ids::NodeId;

/// A hybrid cache with a write-through host tier, page hashes and events.
fn cache() -> Cache {
    Cache::new(Config {
        kv_slots: 32,
        page_size: 2,
        mamba_slots: 6,
        host_kv_slots: 64,
        host_mamba_slots: 6,
        write_policy: WritePolicy::WriteThrough,
        write_through_threshold: None,
        page_hashes: true,
        events: true,
        ..Config::default()
    })
    .unwrap()
}

fn run_all(c: &mut Cache) {
    for b in c.take_batches() {
        c.start(b.id).unwrap();
        c.complete(b.id).unwrap();
    }
}

/// Every pool's slots are free (a cache that owns its pools).
fn assert_pools_full(c: &Cache) {
    for (free, capacity) in [
        ("kv_free_slots", "kv_capacity_slots"),
        ("mamba_free_slots", "mamba_capacity_slots"),
        ("host_kv_free_slots", "host_kv_capacity_slots"),
        ("host_mamba_free_slots", "host_mamba_capacity_slots"),
    ] {
        assert_eq!(stat(c, free), stat(c, capacity), "{free}");
    }
}

/// A cache holding device nodes, host-only nodes (demoted) and a named namespace.
fn filled() -> (Cache, Vec<NodeId>) {
    let mut c = cache();
    let a = put(&mut c, None, &[1, 2, 3, 4]);
    let b = put(&mut c, None, &[1, 2, 3, 4, 5, 6, 7, 8]);
    let d = put(&mut c, Some("tenant"), &[9, 9, 9, 9]);
    run_all(&mut c);
    // Demote the default namespace's leaf: a host-only node under a device one.
    let e = put(&mut c, None, &[20, 21, 22, 23, 24, 25]);
    run_all(&mut c);
    assert!(c.evict(32, 0).kv_tokens > 0);
    run_all(&mut c);
    assert!(stat(&c, "host_kv_cached_tokens") > 0);
    assert!(c.match_prefix(None, &[20, 21, 22, 23, 24, 25]).host_len > 0);
    c.audit().unwrap();
    (c, vec![a, b, d, e])
}

#[test]
fn reset_empties_both_tiers_and_every_namespace_and_returns_every_slot() {
    let (mut c, nodes) = filled();
    let evicted = stat(&c, "evicted_nodes");
    let host_evictions = stat(&c, "host_evictions");
    let inserts = stat(&c, "insert_calls");
    c.reset().unwrap();
    c.audit().unwrap();
    assert_eq!(stat(&c, "nodes"), 0);
    assert_eq!(stat(&c, "namespaces"), 1, "the named namespace's root went");
    assert_pools_full(&c);
    for toks in [&[1, 2, 3, 4, 5, 6, 7, 8][..], &[20, 21, 22, 23, 24, 25]] {
        let m = c.match_prefix(None, toks);
        assert_eq!((m.device_len, m.host_len), (0, 0));
    }
    assert_eq!(c.match_prefix(Some("tenant"), &[9, 9, 9, 9]).device_len, 0);
    for n in nodes {
        assert_eq!(c.lock(n).unwrap_err(), Error::StaleNode(n));
    }
    // A reset is not an eviction; the other counters keep counting.
    assert_eq!(stat(&c, "evicted_nodes"), evicted);
    assert_eq!(stat(&c, "host_evictions"), host_evictions);
    assert_eq!(stat(&c, "insert_calls"), inserts);
    assert_eq!(stat(&c, "resets"), 1);
    assert!(c.take_batches().is_empty(), "a reset emits no batch");
    // The cache serves again.
    put(&mut c, None, &[1, 2, 3, 4]);
    run_all(&mut c);
    assert_eq!(c.match_prefix(None, &[1, 2, 3, 4]).device_len, 4);
    c.audit().unwrap();
    c.reset().unwrap();
    assert_eq!(stat(&c, "resets"), 2);
    assert_pools_full(&c);
    c.audit().unwrap();
}

#[test]
fn reset_announces_one_cleared_after_the_events_still_queued() {
    let (mut c, _) = filled();
    c.take_events().unwrap();
    put(&mut c, None, &[30, 31, 32, 33]);
    let queued = c.take_events().unwrap();
    assert!(!queued.is_empty());
    put(&mut c, None, &[40, 41]);
    run_all(&mut c); // the backups land (announced on the host), so nothing is in flight
    let emitted = stat(&c, "events_emitted");
    let pending = stat(&c, "events_pending");
    c.reset().unwrap();
    assert_eq!(stat(&c, "events_emitted"), emitted + 1);
    assert_eq!(stat(&c, "events_pending"), pending + 1);
    let events = c.take_events().unwrap();
    assert_eq!(events.len() as u64, pending + 1);
    assert_eq!(events.last(), Some(&KvEvent::Cleared));
    assert!(
        events[..events.len() - 1]
            .iter()
            .all(|e| matches!(e, KvEvent::Stored { .. } | KvEvent::StateStored { .. })),
        "{events:?}"
    );
    // What follows the reset is announced from an empty index.
    put(&mut c, None, &[1, 2, 3, 4]);
    assert!(matches!(
        c.take_events().unwrap()[0],
        KvEvent::Stored { .. }
    ));
    c.audit().unwrap();
}

#[test]
fn with_events_off_a_reset_queues_nothing() {
    let mut c = Cache::new(Config::kv(16, 1)).unwrap();
    put(&mut c, None, &[1, 2, 3]);
    c.reset().unwrap();
    assert_eq!(stat(&c, "events_emitted"), 0);
    assert_eq!(stat(&c, "events_pending"), 0);
    c.audit().unwrap();
}

#[test]
fn reset_refuses_while_anything_holds_the_tree_and_changes_nothing() {
    let (mut c, nodes) = filled();
    c.take_events().unwrap();
    let refused = |c: &mut Cache, what: &str| {
        c.take_events().unwrap();
        let before = (c.stats(), c.pretty(1000, 100));
        match c.reset() {
            Err(Error::Busy(msg)) => assert!(msg.contains(what), "{msg}"),
            other => panic!("expected Busy naming {what}, got {other:?}"),
        }
        assert_eq!((c.stats(), c.pretty(1000, 100)), before);
        assert!(c.take_events().unwrap().is_empty());
        c.audit().unwrap();
    };
    // A live request.
    let r = c.admit(None, &[1, 2, 3, 4, 5, 6]).unwrap().unwrap();
    run_all(&mut c);
    refused(&mut c, "1 live requests");
    c.abort(r).unwrap();
    // A live lock.
    let receipt = c.lock(nodes[1]).unwrap();
    refused(&mut c, "1 live locks");
    c.unlock(receipt).unwrap();
    // A batch emitted and not taken, then taken and not ended.
    put(&mut c, None, &[50, 51, 52, 53]);
    refused(&mut c, "1 batches in flight");
    let batches = c.take_batches();
    refused(&mut c, "1 batches in flight");
    for b in batches {
        c.complete(b.id).unwrap();
    }
    // A load-back not yet committed (its batch and lock outstanding too).
    let host = c.match_prefix(None, &[20, 21, 22, 23, 24, 25]).host_node;
    let rec = c
        .load_back(LoadTarget::Node(host), None, None)
        .unwrap()
        .unwrap();
    refused(&mut c, "1 pending load-backs");
    c.cancel_load(rec);
    run_all(&mut c);
    c.reset().unwrap();
    assert_pools_full(&c);
    c.audit().unwrap();
}

#[test]
fn reset_queues_the_trees_slots_for_the_engine() {
    let mut c = Cache::new(Config {
        mamba_slots: 4,
        pools: PoolOwner::Engine,
        ..Config::kv(32, 2)
    })
    .unwrap();
    c.insert_with_state(None, &[1, 2, 3, 4], &[4, 5, 6, 7], 0, Some(2))
        .unwrap();
    c.insert_with_state(None, &[1, 2, 9, 9], &[4, 5, 10, 11], 2, Some(3))
        .unwrap();
    assert_eq!(c.take_freed(), (vec![], vec![]));
    c.reset().unwrap();
    let (mut kv, mut states) = c.take_freed();
    kv.sort_unstable();
    states.sort_unstable();
    assert_eq!(kv, vec![4, 5, 6, 7, 10, 11]);
    assert_eq!(states, vec![2, 3]);
    assert_eq!(stat(&c, "kv_engine_slots"), 32);
    c.audit().unwrap();
}

#[test]
fn reset_writes_nothing_to_the_l3_tier_even_when_host_eviction_would() {
    let mut c = Cache::new(Config {
        kv_slots: 32,
        page_size: 2,
        host_kv_slots: 64,
        write_policy: WritePolicy::WriteThrough,
        write_through_threshold: None,
        page_hashes: true,
        l3: true,
        l3_write: L3Write::HostEviction,
        ..Config::default()
    })
    .unwrap();
    put(&mut c, None, &[1, 2, 3, 4]);
    run_all(&mut c);
    assert!(c.evict(32, 0).kv_tokens > 0);
    assert_eq!(stat(&c, "host_kv_cached_tokens"), 4);
    c.reset().unwrap();
    assert!(c.take_batches().is_empty());
    assert_eq!(stat(&c, "l3_eviction_puts"), 0);
    assert_pools_full(&c);
    c.audit().unwrap();
}
