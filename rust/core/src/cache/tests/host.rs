//! Unit tests of the host tier: backups, demotion, host eviction, host-aware matching,
//! and load-backs committed, called off, released and failed.

#![allow(clippy::many_single_char_names)]

use crate::cache::*;
use crate::config::{Config, WritePolicy};
use crate::ids::NodeId;
use crate::pool::PoolCounts;

fn hybrid(policy: WritePolicy) -> Cache {
    Cache::new(Config {
        kv_slots: 16,
        page_size: 1,
        mamba_slots: 4,
        host_kv_slots: 32,
        host_mamba_slots: 4,
        write_policy: policy,
        write_through_threshold: None,
        ..Config::default()
    })
    .unwrap()
}

/// Caches `toks` with fresh slots and a state at its end; returns the end node.
fn cached(c: &mut Cache, toks: &[u32]) -> NodeId {
    let m = c.match_prefix(None, toks);
    let rest = toks.len() - m.device_len;
    let mut kv = m.kv_indices.clone();
    kv.extend(c.alloc_kv(rest).unwrap().unwrap());
    let s = c.alloc_mamba().unwrap().map(i64::from);
    c.insert_with_state(None, toks, &kv, m.device_len, s)
        .unwrap()
        .node
}

/// Runs every emitted batch to completion.
fn run_all(c: &mut Cache) {
    for b in c.take_batches() {
        c.start(b.id).unwrap();
        c.complete(b.id).unwrap();
    }
}

fn counts(c: &Cache) -> [PoolCounts; 4] {
    [
        c.kv_pool().counts(),
        c.mamba_pool().counts(),
        c.host_kv_pool().counts(),
        c.host_mamba_pool().counts(),
    ]
}

/// A cache with [1,2,3,4] backed up and demoted to the host (state included).
fn demoted() -> (Cache, NodeId) {
    let mut c = hybrid(WritePolicy::WriteThrough);
    let node = cached(&mut c, &[1, 2, 3, 4]);
    let batches = c.take_batches();
    assert_eq!(batches.len(), 1);
    assert_eq!(batches[0].kind, BatchKind::Backup);
    c.complete(batches[0].id).unwrap();
    assert_eq!(c.evict(4, 0).kv_tokens, 4);
    c.audit().unwrap();
    (c, node)
}

#[test]
fn write_through_backs_up_on_insert_and_eviction_demotes() {
    let (mut c, node) = demoted();
    let m = c.match_prefix(None, &[1, 2, 3, 4, 5]);
    assert_eq!((m.device_len, m.host_len), (0, 4));
    assert_eq!(m.host_node, node);
    assert_eq!(c.kv_pool().counts().tree, 0);
    assert_eq!(c.host_kv_pool().counts().tree, 4);
    assert_eq!(c.stats.demotions, 1);
    c.audit().unwrap();
}

#[test]
fn load_back_for_a_request_uses_two_state_slots_and_publishes_on_complete() {
    let (mut c, node) = demoted();
    let r = c.admit(None, &[1, 2, 3, 4, 5]).unwrap().unwrap();
    assert_eq!(c.request(r).unwrap().host_len, 4);
    let free_states = c.available_mamba();
    let rec = c
        .load_back(LoadTarget::Request(r), None, None)
        .unwrap()
        .unwrap();
    let id = rec.id();
    assert_eq!(c.available_mamba(), free_states - 2);
    let b = rec.batch().clone();
    assert_eq!(b.kind, BatchKind::LoadBack);
    assert_eq!(b.copies.len(), 3, "kv, restore, request copy");
    assert!(
        c.take_batches().is_empty(),
        "a load's batch is reached through its guard"
    );
    c.audit().unwrap();
    c.start(id).unwrap();
    c.commit_load(rec).unwrap();
    let v = c.request(r).unwrap();
    assert_eq!(v.prefix_len, 4);
    assert_eq!(v.node, node);
    assert_eq!(
        v.mamba_slot,
        Some(u32::try_from(b.copies[2].dst[0]).unwrap())
    );
    // Not visible until complete.
    assert_eq!(c.match_prefix(None, &[1, 2, 3, 4]).device_len, 0);
    assert!(c.finish(r).is_err());
    c.audit().unwrap();
    c.complete(id).unwrap();
    let m = c.match_prefix(None, &[1, 2, 3, 4]);
    assert_eq!((m.device_len, m.host_len), (4, 0));
    assert_eq!(
        m.mamba_slot,
        Some(u32::try_from(b.copies[1].dst[0]).unwrap())
    );
    c.audit().unwrap();
    c.finish(r).unwrap();
    c.audit().unwrap();
}

#[test]
fn fail_after_commit_turns_the_load_into_a_miss() {
    let (mut c, _) = demoted();
    let r = c.admit(None, &[1, 2, 3, 4]).unwrap().unwrap();
    let before = counts(&c);
    let rec = c
        .load_back(LoadTarget::Request(r), None, None)
        .unwrap()
        .unwrap();
    let id = rec.id();
    c.commit_load(rec).unwrap();
    c.start(id).unwrap();
    c.fail(id).unwrap();
    let v = c.request(r).unwrap();
    assert_eq!(
        (v.prefix_len, v.mamba_slot, v.load_pending),
        (0, None, None)
    );
    // The fresh state slot the load was filling stays the request's (a forward pass may
    // have been queued on it) until the request ends.
    let mut held = before;
    held[1].free -= 1;
    held[1].owned += 1;
    assert_eq!(counts(&c), held);
    assert_eq!(c.match_prefix(None, &[1, 2, 3, 4]).host_len, 4);
    c.audit().unwrap();
    c.abort(r).unwrap();
    assert_eq!(c.mamba_pool().counts().owned, 0);
    c.audit().unwrap();
}

#[test]
fn cancel_before_start_frees_at_once_and_after_start_drains() {
    let (mut c, node) = demoted();
    let before = counts(&c);
    let rec = c
        .load_back(LoadTarget::Node(node), None, None)
        .unwrap()
        .unwrap();
    c.cancel_load(rec);
    assert_eq!(counts(&c), before);
    c.audit().unwrap();
    let rec = c
        .load_back(LoadTarget::Node(node), None, None)
        .unwrap()
        .unwrap();
    let id = rec.id();
    c.start(id).unwrap();
    assert_eq!(c.draining_batches(), 0);
    c.cancel_load(rec);
    assert_eq!(c.kv_pool().counts().draining, 4);
    assert_eq!(c.mamba_pool().counts().draining, 1);
    // Called off while its copies may run: the batch drains, and is counted so.
    assert_eq!(c.draining_batches(), 1);
    c.audit().unwrap();
    c.complete(id).unwrap();
    assert_eq!(c.draining_batches(), 0);
    assert_eq!(counts(&c), before);
    c.audit().unwrap();
}

#[test]
fn write_back_backs_up_at_eviction_and_frees_at_completion() {
    let mut c = hybrid(WritePolicy::WriteBack);
    cached(&mut c, &[1, 2, 3, 4]);
    assert!(c.take_batches().is_empty(), "no insert-time backups");
    assert_eq!(c.evict(4, 0).kv_tokens, 4);
    assert_eq!(
        c.kv_pool().counts().tree,
        4,
        "freed only when the backup lands"
    );
    let b = c.take_batches();
    assert_eq!(b.len(), 1);
    c.audit().unwrap();
    c.complete(b[0].id).unwrap();
    assert_eq!(c.kv_pool().counts().tree, 0);
    assert_eq!(c.match_prefix(None, &[1, 2, 3, 4]).host_len, 4);
    c.audit().unwrap();
}

#[test]
fn insert_revives_a_host_only_node() {
    let (mut c, node) = demoted();
    let kv = c.alloc_kv(4).unwrap().unwrap();
    let ins = c.insert(None, &[1, 2, 3, 4], &kv, 0).unwrap();
    assert_eq!(ins.node, node);
    assert_eq!(c.kv_pool().counts().tree, 4);
    run_all(&mut c);
    c.audit().unwrap();
}

#[test]
fn a_request_admitted_through_a_split_host_only_path_can_load_it() {
    // [1, 2, 3, 4] host-only, then split by a match of [1, 2]: the admitted sequence
    // spans two nodes, neither of which the request holds on the device.
    let (mut c, _) = demoted();
    c.match_prefix(None, &[1, 2]);
    let r = c.admit(None, &[1, 2, 3, 4, 9]).unwrap().unwrap();
    assert_eq!(c.request(r).unwrap().host_len, 4);
    let rec = c
        .load_back(LoadTarget::Request(r), None, None)
        .unwrap()
        .unwrap();
    assert_eq!(rec.kv_tokens(), 4);
    c.commit_load(rec).unwrap();
    assert_eq!(c.request(r).unwrap().prefix_len, 4);
    c.audit().unwrap();
}

#[test]
fn a_host_state_slot_comes_from_the_oldest_host_leaf_holding_one() {
    // One host state slot. [1, 2] is demoted with its state; [1, 2, 3, 4] below it is
    // host-only too but has no state on the host (the slot was taken): the next backup
    // of a state takes the slot from the oldest host leaf that holds one, never from a
    // leaf whose eviction would free none.
    let mut c = Cache::new(Config {
        kv_slots: 16,
        page_size: 1,
        mamba_slots: 4,
        host_kv_slots: 32,
        host_mamba_slots: 1,
        ..Config::default()
    })
    .unwrap();
    cached(&mut c, &[1, 2]);
    run_all(&mut c);
    c.evict(16, 0);
    assert_eq!(c.match_prefix(None, &[1, 2]).host_len, 2);
    let [_, _, host, host_states] = c.lru.sets();
    assert_eq!((host.len(), host_states.len()), (1, 1));
    cached(&mut c, &[7, 8]);
    run_all(&mut c);
    let m = c.match_prefix(None, &[7, 8]);
    assert_eq!(m.device_len, 2);
    assert_eq!(
        c.match_prefix(None, &[1, 2]).host_len,
        0,
        "evicted for its state slot"
    );
    c.audit().unwrap();
}

#[test]
fn an_eviction_called_off_while_its_backup_flies_protects_the_path_until_it_lands() {
    let mut c = Cache::new(Config {
        host_kv_slots: 32,
        write_policy: WritePolicy::WriteBack,
        ..Config::kv(16, 1)
    })
    .unwrap();
    let insert = |c: &mut Cache, toks: &[u32]| {
        let m = c.match_prefix(None, toks);
        let mut kv = m.kv_indices.clone();
        kv.extend(c.alloc_kv(toks.len() - m.device_len).unwrap().unwrap());
        c.insert(None, toks, &kv, m.device_len).unwrap().node
    };
    insert(&mut c, &[1, 2]);
    insert(&mut c, &[1, 2, 3, 4]);
    // Write-back: evicting the leaf [3, 4] backs it up first; it is demoted on landing.
    c.evict(2, 0);
    let backups = c.take_batches();
    assert_eq!(backups.len(), 1);
    // A device child below it calls the eviction off; its backup still flies.
    insert(&mut c, &[1, 2, 3, 4, 5, 6]);
    assert_eq!(
        c.stats()
            .iter()
            .find(|s| s.0 == "kv_evicting_tokens")
            .map(|s| s.1),
        Some(0)
    );
    // [1, 2] cannot be evicted before that backup lands, so it is not counted as room.
    assert_eq!((c.evictable_size(), c.protected_size()), (2, 4));
    assert_eq!(c.evict(16, 0).kv_tokens, 2, "only the new leaf [5, 6] goes");
    assert_eq!(c.evictable_size(), 0);
    c.audit().unwrap();
    c.complete(backups[0].id).unwrap();
    run_all(&mut c);
    // Landed: [3, 4] keeps its host copy and, like [1, 2], is evictable again.
    assert_eq!((c.evictable_size(), c.protected_size()), (4, 0));
    c.audit().unwrap();
}

#[test]
fn evict_host_takes_host_only_leaves_oldest_first_and_can_clear_the_tier() {
    let mut c = hybrid(WritePolicy::WriteThrough);
    cached(&mut c, &[1, 2]);
    run_all(&mut c);
    cached(&mut c, &[1, 2, 3, 4]);
    run_all(&mut c);
    cached(&mut c, &[7, 8, 9]);
    run_all(&mut c);
    // Device data keeps its host copy: nothing is host-only yet.
    assert_eq!(c.evict_host(100, 100).unwrap(), Evicted::default());
    assert_eq!(c.evict(100, 100).kv_tokens, 7);
    run_all(&mut c);
    // Host-only now. [1, 2] is an inner node: it goes after its child [3, 4].
    let first = c.evict_host(2, 0).unwrap();
    assert_eq!(
        (first.kv_tokens, first.mamba_states),
        (2, 1),
        "[3, 4], the oldest leaf"
    );
    assert_eq!(c.match_prefix(None, &[1, 2, 3, 4]).host_len, 2);
    let rest = c.evict_host(100, 100).unwrap();
    assert_eq!((rest.kv_tokens, rest.mamba_states), (5, 2));
    assert_eq!(
        c.host_kv_pool().counts().free,
        c.host_kv_pool().capacity_pages()
    );
    assert_eq!(
        c.host_mamba_pool().counts().free,
        c.host_mamba_pool().capacity_pages()
    );
    assert_eq!(c.stats.host_evicted_tokens, 7);
    c.audit().unwrap();
}

#[test]
fn state_value_counts_a_state_a_load_back_restores_for_a_request_as_used() {
    // [1, 2, 3, 4]'s state comes back from the host for a request; then a longer state
    // that no match has used is cached beside it, and one state is evicted. lru takes
    // the older unused state, the restored one (a placement, to lru); state-value counts
    // the restored state as used (a host hit used it) and evicts the unused one, though
    // it saves more compute.
    for (policy, restored_kept) in [("lru", false), ("state-value", true)] {
        let mut c = Cache::new(Config {
            eviction_policy: policy.parse().unwrap(),
            ..hybrid(WritePolicy::WriteThrough).config().clone()
        })
        .unwrap();
        let node = cached(&mut c, &[1, 2, 3, 4]);
        run_all(&mut c);
        assert_eq!(c.evict(4, 0).kv_tokens, 4);
        let r = c.admit(None, &[1, 2, 3, 4, 5]).unwrap().unwrap();
        let rec = c
            .load_back(LoadTarget::Request(r), None, None)
            .unwrap()
            .unwrap();
        let id = rec.id();
        c.start(id).unwrap();
        c.commit_load(rec).unwrap();
        c.complete(id).unwrap();
        c.abort(r).unwrap();
        c.audit().unwrap();
        let unused = cached(&mut c, &[7; 8]);
        run_all(&mut c);
        c.audit().unwrap();
        assert_eq!(c.evict(0, 1).mamba_states, 1, "{policy}");
        c.audit().unwrap();
        let has_state = |c: &Cache, n: NodeId| {
            let i = c.tree.resolve(n).unwrap();
            c.tree.node(i).mamba.device.is_some()
        };
        assert_eq!(has_state(&c, node), restored_kept, "{policy}");
        assert_eq!(has_state(&c, unused), !restored_kept, "{policy}");
    }
}
