//! Unit tests of the Mamba component, transfer batches and requests.

use super::util::{prefix_and_fresh, stat};
use crate::cache::*;
use crate::error::Error;
use crate::handle::HybridCache;
use crate::ids::{BatchId, RequestId};
use crate::pool::{PageState, PoolCounts};

fn hybrid(kv: usize, ps: usize, states: usize) -> Cache {
    Cache::new(Config {
        mamba_slots: states,
        ..Config::kv(kv, ps)
    })
    .unwrap()
}

/// Caches `toks` with a state at its end through the low-level API.
fn cached_with_state(c: &mut Cache, toks: &[u32]) -> Insert {
    let (owned_from, kv) = prefix_and_fresh(c, toks);
    let state = c.alloc_mamba().unwrap().unwrap();
    c.insert_with_state(None, toks, &kv, owned_from, Some(i64::from(state)))
        .unwrap()
}

fn full(c: &Cache) -> bool {
    c.kv_counts().free == c.kv_pool().capacity_pages()
        && c.mamba_counts().free == c.mamba_pool().capacity_pages()
}

#[test]
fn match_is_cut_at_the_deepest_state_and_kv_len_keeps_the_branch_point() {
    let mut c = hybrid(64, 1, 4);
    let a = cached_with_state(&mut c, &[1, 2, 3]);
    // Extend the path without a state: [1,2,3] -> [4,5] (tombstone end).
    let m = c.match_prefix(None, &[1, 2, 3, 4, 5]);
    let got = c.alloc_kv(2).unwrap().unwrap();
    let mut kv = m.kv_indices.clone();
    kv.extend_from_slice(&got);
    c.insert(None, &[1, 2, 3, 4, 5], &kv, 3).unwrap();
    let m = c.match_prefix(None, &[1, 2, 3, 4, 5, 6]);
    assert_eq!((m.device_len, m.kv_len), (3, 5));
    assert_eq!(m.node, a.node);
    assert_eq!(m.kv_indices.len(), 3);
    assert!(m.mamba_slot.is_some());
    assert_eq!(c.stats.state_hits, 2);
    // Nothing with a state on the path: nothing usable.
    assert_eq!(c.match_prefix(None, &[9, 9]).device_len, 0);
    c.audit().unwrap();
}

#[test]
fn a_split_keeps_the_state_with_the_lower_node() {
    let mut c = hybrid(64, 1, 4);
    let a = cached_with_state(&mut c, &[1, 2, 3, 4]);
    let m = c.match_prefix(None, &[1, 2, 7]);
    // The split made [1,2] | [3,4]; the upper node has no state, so nothing is usable.
    assert_eq!((m.device_len, m.kv_len), (0, 2));
    let m = c.match_prefix(None, &[1, 2, 3, 4]);
    assert_eq!(
        m.node, a.node,
        "the lower node keeps its identity and its state"
    );
    assert_eq!(m.device_len, 4);
    c.audit().unwrap();
}

#[test]
fn a_split_of_a_node_whose_state_is_being_backed_up_protects_only_the_lower_part() {
    // A write-back eviction backup takes no lock: when its eviction is called off, the
    // node is unlocked, not evicting, and its state is still in flight. (The machines
    // reach this through a long history; the mark is set here as `emit_backup` sets it.)
    let mut c = hybrid(64, 1, 4);
    let a = cached_with_state(&mut c, &[1, 2, 3, 4]);
    let i = c.tree.resolve(a.node).unwrap();
    c.edit(i, |n| n.mamba.backup_pending = true);
    c.refresh(i);
    assert!(
        !c.tree.node(i).kv.state.in_lru(),
        "no candidate while its state is in flight"
    );
    assert_eq!((c.sizes.evictable_tokens, c.sizes.protected_tokens), (0, 4));
    // The split leaves the state (and its mark) with the lower part.
    c.match_prefix(None, &[1, 2, 7]);
    assert_eq!((c.sizes.evictable_tokens, c.sizes.protected_tokens), (2, 2));
    c.audit().unwrap();
    c.edit(i, |n| n.mamba.backup_pending = false);
    c.refresh(i);
    assert!(c.tree.node(i).kv.state.in_lru());
    c.audit().unwrap();
}

#[test]
fn slots_extended_before_a_failed_admission_copy_are_not_reused_until_the_request_ends() {
    let mut c = hybrid(16, 1, 4);
    cached_with_state(&mut c, &[1, 2, 3, 4]);
    let r = c.admit(None, &[1, 2, 3, 4, 5, 6]).unwrap().unwrap();
    let slot = c.request(r).unwrap().mamba_slot.unwrap();
    // The engine queued a forward pass on these before the copy's outcome was known.
    let extended = c.extend(r, &[5, 6]).unwrap().unwrap();
    let [cow] = c.take_batches().try_into().unwrap();
    c.start(cow.id).unwrap();
    c.fail(cow.id).unwrap();
    let v = c.request(r).unwrap();
    assert_eq!((v.prefix_len, v.len, v.mamba_slot), (0, 0, None));
    let report: std::collections::HashMap<_, _> = c.stats().into_iter().collect();
    assert_eq!(
        (report["kv_retired_slots"], report["mamba_retired_slots"]),
        (2, 1)
    );
    c.audit().unwrap();
    // Everything else can be had; those slots cannot.
    let kv = c.alloc_kv(c.available_kv()).unwrap().unwrap();
    assert!(kv.iter().all(|s| !extended.contains(s)));
    let mut others = Vec::new();
    while let Some(s) = c.alloc_mamba().unwrap() {
        others.push(s);
    }
    assert!(!others.contains(&slot));
    c.free_kv(&kv).unwrap();
    for s in others {
        c.free_mamba(i64::from(s)).unwrap();
    }
    // Once the request ends they are free.
    c.abort(r).unwrap();
    let report: std::collections::HashMap<_, _> = c.stats().into_iter().collect();
    assert_eq!(
        (report["kv_retired_slots"], report["mamba_retired_slots"]),
        (0, 0)
    );
    assert_eq!(c.kv_counts().owned + c.mamba_counts().owned, 0);
    c.audit().unwrap();
}

#[test]
fn insert_places_the_state_or_frees_it() {
    let mut c = hybrid(64, 2, 4);
    let ins = cached_with_state(&mut c, &[1, 2, 3, 4]);
    assert!(!ins.mamba_existed);
    assert_eq!(c.evictable_states(), 1);
    // A second state for the same node: freed, and said so.
    let before = c.mamba_counts();
    let ins = cached_with_state(&mut c, &[1, 2, 3, 4]);
    assert!(ins.mamba_existed);
    assert_eq!(c.mamba_counts(), before);
    // An unaligned tail: the state matches no node's end and is freed.
    let s = c.alloc_mamba().unwrap().unwrap();
    let got = c.alloc_kv(4).unwrap().unwrap();
    let before_free = c.available_mamba();
    c.insert_with_state(None, &[5, 6, 7], &got[..3], 0, Some(i64::from(s)))
        .unwrap();
    assert_eq!(c.available_mamba(), before_free + 1);
    assert_eq!(c.match_prefix(None, &[5, 6]).device_len, 0);
    c.audit().unwrap();
}

#[test]
fn a_bad_state_slot_fails_the_insert_and_changes_nothing() {
    let mut c = hybrid(64, 1, 4);
    let held = c.alloc_kv(2).unwrap().unwrap();
    let before = (c.snapshot(), c.kv_counts(), c.mamba_counts());
    for (slot, what) in [
        (9, "out of range"),
        (0, "not allocated"),
        (-1, "out of range"),
    ] {
        let err = c
            .insert_with_state(None, &[1, 2], &held, 0, Some(slot))
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::InvalidArgument {
                    arg: "mamba_slot",
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains(what), "{err}");
        assert_eq!((c.snapshot(), c.kv_counts(), c.mamba_counts()), before);
    }
    let mut plain = Cache::new(Config::kv(8, 1)).unwrap();
    let held = plain.alloc_kv(1).unwrap().unwrap();
    assert!(plain
        .insert_with_state(None, &[1], &held, 0, Some(0))
        .is_err());
    c.audit().unwrap();
}

#[test]
fn a_state_no_match_used_is_evicted_before_an_older_one_that_a_match_used() {
    let mut c = hybrid(64, 1, 4);
    cached_with_state(&mut c, &[1, 1]);
    assert_eq!(c.match_prefix(None, &[1, 1, 9]).device_len, 2);
    cached_with_state(&mut c, &[2, 2]);
    cached_with_state(&mut c, &[3, 3]);
    // [1, 1]'s state is the least recently touched, but a request reused it; nobody
    // reused [2, 2]'s or [3, 3]'s (like a finished request's end state).
    assert_eq!(c.evict(0, 1).mamba_states, 1);
    assert_eq!(c.stats.evicted_used_states, 0);
    assert_eq!(
        c.match_prefix(None, &[2, 2]).device_len,
        0,
        "the oldest unused state"
    );
    assert_eq!(c.match_prefix(None, &[1, 1]).device_len, 2);
    assert_eq!(c.match_prefix(None, &[3, 3]).device_len, 2);
    c.audit().unwrap();
}

#[test]
fn used_states_beyond_three_quarters_of_the_pool_age_out_before_unused_ones() {
    // 8 slots: up to 6 used states are protected.
    let mut c = hybrid(64, 1, 8);
    let seqs: Vec<Vec<u32>> = (1..=8).map(|t| vec![t, t]).collect();
    for s in &seqs {
        cached_with_state(&mut c, s);
    }
    // Used, in this order: [1, 1] .. [7, 7] (7, one over the cap); unused: [8, 8].
    for s in &seqs[..7] {
        assert_eq!(c.match_prefix(None, s).device_len, 2);
    }
    // Over the cap: the oldest used state goes, not the unused one.
    assert_eq!(c.evict(0, 1).mamba_states, 1);
    assert_eq!(c.stats.evicted_used_states, 1);
    assert_eq!(c.match_prefix(None, &seqs[0]).device_len, 0);
    for s in &seqs[1..] {
        assert_eq!(c.match_prefix(None, s).device_len, 2);
    }
    c.audit().unwrap();
}

#[test]
fn state_eviction_tombstones_internal_nodes_and_deletes_leaves() {
    let mut c = hybrid(64, 1, 4);
    let upper = cached_with_state(&mut c, &[1, 2]);
    cached_with_state(&mut c, &[1, 2, 3, 4]);
    // Refresh the leaf's state, so the upper (internal) state is the oldest.
    c.match_prefix(None, &[1, 2, 3, 4]);
    let ev = c.evict(0, 1);
    assert_eq!((ev.kv_tokens, ev.mamba_states), (0, 1));
    assert_eq!(c.stats.tombstones, 1);
    assert!(
        c.tree.resolve(upper.node).is_ok(),
        "the internal node stays"
    );
    assert_eq!(c.match_prefix(None, &[1, 2]).device_len, 0);
    // The leaf's state goes with the leaf, and the tombstone left as a stateless leaf
    // is pruned with it.
    let ev = c.evict(0, 1);
    assert_eq!((ev.kv_tokens, ev.mamba_states), (4, 1));
    assert_eq!(c.total_size(), 0);
    assert!(full(&c));
    c.audit().unwrap();
}

#[test]
fn kv_eviction_of_a_leaf_takes_its_state() {
    let mut c = hybrid(64, 1, 4);
    cached_with_state(&mut c, &[1, 2]);
    let ev = c.evict(1, 0);
    assert_eq!((ev.kv_tokens, ev.mamba_states), (2, 1));
    assert!(full(&c));
    c.audit().unwrap();
}

#[test]
fn state_of_a_kv_locked_leaf_is_tombstoned_and_the_node_kept() {
    // docs/contract.md rule 12. A receipt taken while the leaf had no state locks its KV only; the
    // state placed afterwards is unlocked and evictable.
    let mut c = hybrid(64, 1, 4);
    let got = c.alloc_kv(2).unwrap().unwrap();
    let ins = c.insert(None, &[1, 2], &got, 0).unwrap();
    let lock = c.lock(ins.node).unwrap();
    let s = c.alloc_mamba().unwrap().unwrap();
    let again = c.alloc_kv(2).unwrap().unwrap();
    c.insert_with_state(None, &[1, 2], &again, 0, Some(i64::from(s)))
        .unwrap();
    assert_eq!(c.evictable_states(), 1, "the state is not locked");
    let ev = c.evict(0, 1);
    assert_eq!((ev.kv_tokens, ev.mamba_states), (0, 1));
    assert!(c.tree.resolve(ins.node).is_ok(), "the KV-locked node stays");
    c.unlock(lock).unwrap();
    c.audit().unwrap();
}

#[test]
fn cow_batch_copies_from_the_node_slot_to_the_request_slot() {
    let mut c = hybrid(64, 1, 4);
    cached_with_state(&mut c, &[1, 2, 3]);
    let node_slot = c.match_prefix(None, &[1, 2, 3]).mamba_slot.unwrap();
    let id = c.admit(None, &[1, 2, 3, 4]).unwrap().unwrap();
    let view = c.request(id).unwrap();
    let batches = c.take_batches();
    assert_eq!(batches.len(), 1);
    let b = &batches[0];
    assert_eq!(b.kind, BatchKind::Cow);
    assert_eq!(view.copy_pending, Some(b.id));
    assert_eq!(
        b.copies,
        vec![SlotCopy {
            pool: PoolKind::Mamba,
            src_tier: Tier::Device,
            dst_tier: Tier::Device,
            src: vec![i64::from(node_slot)],
            dst: vec![i64::from(view.mamba_slot.unwrap())],
        }]
    );
    assert_ne!(Some(node_slot), view.mamba_slot);
    assert!(c.take_batches().is_empty(), "a batch is taken once");
    c.complete(b.id).unwrap();
    assert_eq!(c.request(id).unwrap().copy_pending, None);
    c.abort(id).unwrap();
    c.audit().unwrap();
}

#[test]
fn without_a_queue_the_request_keeps_its_matched_state_locked() {
    let mut c = hybrid(64, 1, 4);
    cached_with_state(&mut c, &[1, 2, 3]);
    c.admit(None, &[1, 2, 3, 4]).unwrap().unwrap();
    let b = c.take_batches();
    c.complete(b[0].id).unwrap();
    // No waiting queue told of: the prefix's next users are likeliest to want it.
    assert_eq!((c.protected_states(), c.evictable_states()), (1, 0));
    assert_eq!(c.evict(0, 1).mamba_states, 0);
    c.audit().unwrap();
}

#[test]
fn with_a_queue_a_landed_admission_copy_frees_the_nodes_state_from_the_lock() {
    let mut c = hybrid(64, 1, 4);
    let a = cached_with_state(&mut c, &[1, 2, 3]);
    c.expect(&[(None, &[9, 9])]);
    let id = c.admit(None, &[1, 2, 3, 4]).unwrap().unwrap();
    let b = c.take_batches();
    // While its copy runs, the request's lock holds the state it reads.
    assert_eq!((c.protected_states(), c.evictable_states()), (1, 0));
    c.complete(b[0].id).unwrap();
    // Landed: the request has its own copy; the path stays locked, the state does not.
    assert_eq!((c.protected_states(), c.evictable_states()), (0, 1));
    assert_eq!(c.evict(0, 1).mamba_states, 1, "eviction may take it");
    assert_eq!(
        c.match_prefix(None, &[1, 2, 3]).kv_len,
        3,
        "its KV stays locked"
    );
    assert_eq!(
        c.match_prefix(None, &[1, 2, 3]).device_len,
        0,
        "a tombstone now"
    );
    assert_eq!(
        c.request(id).unwrap().prefix_len,
        3,
        "the request keeps its prefix"
    );
    c.audit().unwrap();
    // Its release gives back the path alone; finishing caches what it fed.
    c.extend(id, &[4]).unwrap().unwrap();
    c.finish(id).unwrap();
    assert_eq!(c.protected_size(), 0, "nothing locked once it finished");
    assert_ne!(c.match_prefix(None, &[1, 2, 3, 4]).node, a.node);
    c.audit().unwrap();
}

#[test]
fn a_queue_told_of_later_frees_the_states_landed_requests_matched() {
    let mut c = hybrid(64, 1, 6);
    cached_with_state(&mut c, &[1, 2, 3]);
    cached_with_state(&mut c, &[5, 6, 7]);
    let landed = c.admit(None, &[1, 2, 3, 4]).unwrap().unwrap();
    let b = c.take_batches();
    c.complete(b[0].id).unwrap();
    c.admit(None, &[5, 6, 7, 8]).unwrap().unwrap();
    let copying = c.take_batches();
    assert_eq!(c.protected_states(), 2);
    // The first one's copy landed: its share goes; the second's copy still reads its own.
    c.expect(&[(None, &[9, 9])]);
    assert_eq!((c.protected_states(), c.evictable_states()), (1, 1));
    c.complete(copying[0].id).unwrap();
    assert_eq!((c.protected_states(), c.evictable_states()), (0, 2));
    // A checkpoint's lock holds the path alone too.
    c.extend(landed, &[4]).unwrap().unwrap();
    c.checkpoint(landed).unwrap();
    assert_eq!(c.protected_states(), 0);
    c.audit().unwrap();
}

#[test]
fn admit_without_a_free_state_slot_takes_nothing() {
    let mut c = hybrid(64, 1, 1);
    cached_with_state(&mut c, &[1, 2]);
    // The only state slot is the cached one; the admission locks it, so it cannot be
    // evicted for the copy: refused, and everything is as before.
    let before = (c.snapshot(), c.kv_counts(), c.mamba_counts());
    assert_eq!(c.admit(None, &[1, 2, 3]).unwrap(), None);
    let after = (c.snapshot(), c.kv_counts(), c.mamba_counts());
    assert_eq!(before.1, after.1);
    assert_eq!(before.2, after.2);
    assert_eq!(c.stats.admits_refused, 1);
    assert_eq!(c.locks.live(), 0);
    c.audit().unwrap();
}

#[test]
fn request_lifecycle_caches_everything_and_donates_the_state() {
    let mut c = hybrid(64, 2, 4);
    let id = c.admit(None, &[1, 2, 3, 4]).unwrap().unwrap();
    assert!(c.take_batches().is_empty(), "nothing cached: no copy");
    let slots = c.extend(id, &[1, 2, 3]).unwrap().unwrap();
    assert_eq!(slots.len(), 3);
    let more = c.extend(id, &[4]).unwrap().unwrap();
    assert_eq!(
        more[0],
        slots[2] + 1,
        "the last partial page is filled first"
    );
    let state = c.request(id).unwrap().mamba_slot.unwrap();
    c.finish(id).unwrap();
    let m = c.match_prefix(None, &[1, 2, 3, 4]);
    assert_eq!((m.device_len, m.mamba_slot), (4, Some(state)));
    assert!(matches!(c.extend(id, &[5]), Err(Error::Request(_))));
    assert!(matches!(c.finish(id), Err(Error::Request(_))));
    assert_eq!(c.requests.live(), 0);
    c.audit().unwrap();
}

#[test]
fn checkpoint_publishes_the_state_copy_only_when_the_batch_completes() {
    let mut c = hybrid(64, 1, 4);
    let id = c.admit(None, &[1, 2, 3]).unwrap().unwrap();
    c.extend(id, &[1, 2, 3]).unwrap().unwrap();
    c.checkpoint(id).unwrap();
    let view = c.request(id).unwrap();
    assert_eq!(view.prefix_len, 3);
    let b = c.take_batches();
    assert_eq!(b.len(), 1);
    assert_eq!(
        b[0].copies[0].src,
        vec![i64::from(view.mamba_slot.unwrap())]
    );
    // Not visible before completion (two-phase publish).
    assert_eq!(c.match_prefix(None, &[1, 2, 3]).device_len, 0);
    c.audit().unwrap();
    c.complete(b[0].id).unwrap();
    let m = c.match_prefix(None, &[1, 2, 3]);
    assert_eq!(m.device_len, 3);
    assert_eq!(m.mamba_slot.map(i64::from), Some(b[0].copies[0].dst[0]));
    // A failed checkpoint copy publishes nothing and frees its slot.
    c.extend(id, &[4]).unwrap().unwrap();
    c.checkpoint(id).unwrap();
    let b = c.take_batches();
    let free = c.available_mamba();
    c.fail(b[0].id).unwrap();
    assert_eq!(c.available_mamba(), free + 1);
    assert_eq!(c.match_prefix(None, &[1, 2, 3, 4]).device_len, 3);
    c.finish(id).unwrap();
    c.audit().unwrap();
}

/// A request admitted for `toks` (its admission copy completed), extended by the rest of
/// them (holding its own state).
fn fed(c: &mut Cache, toks: &[u32]) -> RequestId {
    let id = c.admit(None, toks).unwrap().unwrap();
    for b in c.take_batches() {
        c.complete(b.id).unwrap();
    }
    let from = c.request(id).unwrap().prefix_len;
    c.extend(id, &toks[from..]).unwrap().unwrap();
    id
}

#[test]
fn a_finish_at_an_unaligned_length_loses_the_end_state_unless_a_checkpoint_kept_it() {
    let mut c = hybrid(64, 4, 6);
    // 10 tokens, pages of 4: the state of all 10 ends at no node's end, and nothing sits
    // at 8, so the next turn resumes from nothing.
    let turn: Vec<u32> = (1..=10).collect();
    let id = fed(&mut c, &turn);
    c.finish(id).unwrap();
    assert_eq!(stat(&c, "finish_states_lost"), 1);
    let next: Vec<u32> = (1..=14).collect();
    assert_eq!(c.match_prefix(None, &next).device_len, 0);
    // Checkpointed when its length was aligned for the last time (8), the state of 8
    // tokens stays: not lost, and the next turn resumes from 8.
    let turn: Vec<u32> = (21..=30).collect();
    let id = fed(&mut c, &turn[..8]);
    c.checkpoint(id).unwrap();
    let b = c.take_batches();
    assert_eq!(b.len(), 1);
    c.complete(b[0].id).unwrap();
    c.extend(id, &turn[8..]).unwrap().unwrap();
    c.finish(id).unwrap();
    assert_eq!(stat(&c, "finish_states_lost"), 1);
    let next: Vec<u32> = (21..=34).collect();
    assert_eq!(c.match_prefix(None, &next).device_len, 8);
    // Its checkpoint copy still on its way at the finish: not lost either, and the state
    // lands once the copy completes.
    let turn: Vec<u32> = (41..=50).collect();
    let id = fed(&mut c, &turn[..8]);
    c.checkpoint(id).unwrap();
    let b = c.take_batches();
    c.extend(id, &turn[8..]).unwrap().unwrap();
    c.finish(id).unwrap();
    assert_eq!(stat(&c, "finish_states_lost"), 1);
    c.complete(b[0].id).unwrap();
    let next: Vec<u32> = (41..=54).collect();
    assert_eq!(c.match_prefix(None, &next).device_len, 8);
    // Nothing is lost at an aligned length (the state is donated), nor shorter than a
    // page (no page to keep it at), nor where the last whole page has a state already.
    for toks in [
        &[61, 62, 63, 64][..],
        &[71, 72, 73],
        &[21, 22, 23, 24, 25, 26, 27, 28, 9],
    ] {
        let id = fed(&mut c, toks);
        c.finish(id).unwrap();
        assert_eq!(stat(&c, "finish_states_lost"), 1, "{toks:?}");
    }
    assert_eq!(stat(&c, "finishes"), 6);
    c.audit().unwrap();
}

#[test]
fn a_failed_admission_copy_drops_the_request_back_to_nothing() {
    let mut c = hybrid(64, 1, 4);
    cached_with_state(&mut c, &[1, 2, 3]);
    let id = c.admit(None, &[1, 2, 3, 4]).unwrap().unwrap();
    c.extend(id, &[4]).unwrap().unwrap();
    assert!(matches!(c.checkpoint(id), Err(Error::Request(_))));
    assert!(matches!(c.finish(id), Err(Error::Request(_))));
    let b = c.take_batches();
    c.fail(b[0].id).unwrap();
    let v = c.request(id).unwrap();
    assert_eq!((v.prefix_len, v.len, v.mamba_slot), (0, 0, None));
    assert_eq!(
        c.locks.live(),
        1,
        "the request holds its namespace's root only"
    );
    assert_eq!(c.protected_size(), 0);
    // The request recomputes from scratch.
    c.extend(id, &[1, 2, 3, 4]).unwrap().unwrap();
    c.finish(id).unwrap();
    assert!(matches!(
        c.complete(b[0].id),
        Err(Error::InvalidArgument {
            arg: "batch_id",
            ..
        })
    ));
    c.audit().unwrap();
}

#[test]
fn a_state_freed_while_a_copy_reads_it_drains_until_the_copy_ends() {
    let mut c = hybrid(64, 1, 2);
    cached_with_state(&mut c, &[1, 2]);
    let src = c.match_prefix(None, &[1, 2]).mamba_slot.unwrap();
    let id = c.admit(None, &[1, 2]).unwrap().unwrap();
    let b = c.take_batches();
    // The request goes away before the copy ran: its lock on the source state goes,
    // and eviction takes the state; its slot must not come back while the copy may
    // still read it, nor the request's slot while it may still be written.
    c.abort(id).unwrap();
    c.evict(usize::MAX, usize::MAX);
    assert_eq!(c.mamba_pool().state(src), Some(PageState::Draining));
    assert_eq!(c.mamba_counts().draining, 2);
    assert_eq!(
        c.alloc_mamba().unwrap(),
        None,
        "nothing may be handed out yet"
    );
    c.audit().unwrap();
    c.complete(b[0].id).unwrap();
    assert_eq!(c.mamba_counts().draining, 0);
    assert!(full(&c));
    c.audit().unwrap();
}

#[test]
fn extend_that_cannot_get_slots_takes_nothing() {
    let mut c = hybrid(4, 1, 1);
    let a = c.admit(None, &[1]).unwrap().unwrap();
    c.extend(a, &[1, 2, 3]).unwrap().unwrap();
    let b = c.admit(None, &[7]).unwrap().unwrap();
    let before = (c.kv_counts(), c.mamba_counts());
    // One KV slot is free but no state slot can be had: refused, the KV slot returned.
    assert_eq!(c.extend(b, &[7]).unwrap(), None);
    assert_eq!((c.kv_counts(), c.mamba_counts()), before);
    assert_eq!(c.stats.extends_refused, 1);
    c.abort(a).unwrap();
    c.abort(b).unwrap();
    assert!(full(&c));
    c.audit().unwrap();
}

#[test]
fn extend_batch_gives_each_request_its_next_slot_as_extend_would() {
    let mut c = hybrid(64, 4, 4);
    let a = c.admit(None, &[1, 2, 3]).unwrap().unwrap();
    let b = c.admit(None, &[9]).unwrap().unwrap();
    let a_slots = c.extend(a, &[1, 2, 3]).unwrap().unwrap();
    c.extend(b, &[9, 8, 7, 6]).unwrap().unwrap();
    // `a` fills its last page; `b`'s page is full, so it gets a new one.
    let got = c.extend_batch(&[a, b], &[4, 5]).unwrap().unwrap();
    assert_eq!(got[0], a_slots[2] + 1);
    let b_kv = c.request_kv_indices(b).unwrap();
    assert_eq!(b_kv.len(), 5);
    assert_eq!(got[1], b_kv[4]);
    assert_eq!(got[1] % 4, 0, "a new page starts at its first slot");
    assert_eq!(c.request_tokens(a).unwrap(), vec![1, 2, 3, 4]);
    assert_eq!(c.request_tokens(b).unwrap(), vec![9, 8, 7, 6, 5]);
    // A request without a state gets one, as with `extend`.
    let d = c.admit(None, &[5]).unwrap().unwrap();
    assert_eq!(c.request(d).unwrap().mamba_slot, None);
    c.extend_batch(&[d], &[5]).unwrap().unwrap();
    assert!(c.request(d).unwrap().mamba_slot.is_some());
    assert_eq!(c.stats.extends, 5);
    for r in [a, b, d] {
        c.finish(r).unwrap();
    }
    c.audit().unwrap();
}

#[test]
fn extend_batch_gives_every_request_without_a_state_its_own_slot() {
    let mut c = hybrid(64, 4, 4);
    let ids: Vec<_> = (1..=3)
        .map(|t| c.admit(None, &[t]).unwrap().unwrap())
        .collect();
    c.extend_batch(&ids, &[1, 2, 3]).unwrap().unwrap();
    let mut slots: Vec<_> = ids
        .iter()
        .map(|&r| c.request(r).unwrap().mamba_slot.unwrap())
        .collect();
    slots.sort_unstable();
    slots.dedup();
    assert_eq!(slots.len(), 3, "three distinct state slots");
    assert_eq!(c.available_mamba(), 1);
    c.audit().unwrap();
    for r in ids {
        c.abort(r).unwrap();
    }
    assert_eq!(
        c.available_mamba(),
        4,
        "every slot returns with its request"
    );
    c.audit().unwrap();
}

#[test]
fn extend_batch_is_all_or_nothing() {
    // Two pages: `a` holds one, `b` the other; both need a new page and none can be had.
    let mut c = hybrid(8, 4, 4);
    let a = c.admit(None, &[1]).unwrap().unwrap();
    c.extend(a, &[1, 2, 3, 4]).unwrap().unwrap();
    let b = c.admit(None, &[2]).unwrap().unwrap();
    c.extend(b, &[2, 3, 4]).unwrap().unwrap();
    let before = (
        c.kv_counts(),
        c.mamba_counts(),
        c.request_tokens(b).unwrap(),
    );
    // `b` alone would fit in its last page, `a` would not: nothing is given to either.
    assert_eq!(c.extend_batch(&[b, a], &[5, 5]).unwrap(), None);
    assert_eq!(
        (
            c.kv_counts(),
            c.mamba_counts(),
            c.request_tokens(b).unwrap()
        ),
        before
    );
    assert_eq!(c.stats.extends_refused, 1);
    c.extend_batch(&[b], &[5]).unwrap().unwrap();
    c.abort(a).unwrap();
    c.abort(b).unwrap();
    assert!(full(&c));
    c.audit().unwrap();
}

#[test]
fn a_malformed_extend_batch_is_refused_naming_the_argument() {
    let mut c = hybrid(64, 4, 4);
    let a = c.admit(None, &[1]).unwrap().unwrap();
    let b = c.admit(None, &[2]).unwrap().unwrap();
    let before = (c.kv_counts(), c.mamba_counts());
    let short = c.extend_batch(&[a, b], &[1]);
    assert!(
        matches!(short, Err(Error::InvalidArgument { arg: "tokens", .. })),
        "{short:?}"
    );
    let twice = c.extend_batch(&[a, b, a], &[1, 2, 3]);
    assert!(
        matches!(
            twice,
            Err(Error::InvalidArgument {
                arg: "requests",
                ..
            })
        ),
        "{twice:?}"
    );
    c.finish(b).unwrap();
    let stale = c.extend_batch(&[a, b], &[1, 2]);
    assert!(matches!(stale, Err(Error::Request(_))), "{stale:?}");
    assert_eq!((c.kv_counts(), c.mamba_counts()), before);
    assert_eq!(c.request_tokens(a).unwrap(), Vec::<u32>::new());
    c.abort(a).unwrap();
    c.audit().unwrap();
}

#[test]
fn a_dropped_request_handle_gives_everything_back() {
    let cache = HybridCache::new(Config {
        mamba_slots: 2,
        ..Config::kv(16, 1)
    })
    .unwrap();
    {
        let r = cache.admit(None, &[1, 2, 3]).unwrap().unwrap();
        cache
            .with(|c| c.extend(r.id(), &[1, 2, 3]).unwrap().unwrap())
            .unwrap();
        assert_eq!(cache.with(|c| c.mamba_counts().owned).unwrap(), 1);
    }
    cache
        .with(|c| {
            assert!(full(c));
            assert_eq!(c.stats.requests_dropped, 1);
            c.audit().unwrap();
        })
        .unwrap();
}

#[test]
fn a_panic_inside_a_request_scope_gives_everything_back() {
    let cache = HybridCache::new(Config {
        mamba_slots: 2,
        ..Config::kv(16, 1)
    })
    .unwrap();
    let inner = cache.clone();
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
        let r = inner.admit(None, &[1, 2]).unwrap().unwrap();
        inner
            .with(|c| c.extend(r.id(), &[1, 2]).unwrap().unwrap())
            .unwrap();
        panic!("the scheduler crashed mid-request");
    }));
    assert!(r.is_err());
    cache
        .with(|c| {
            assert!(full(c));
            assert_eq!(
                c.mamba_counts(),
                PoolCounts {
                    free: 2,
                    ..PoolCounts::default()
                }
            );
            c.audit().unwrap();
        })
        .unwrap();
}

#[test]
fn a_finished_request_handle_drops_silently() {
    let cache = HybridCache::new(Config {
        mamba_slots: 2,
        ..Config::kv(16, 1)
    })
    .unwrap();
    let r = cache.admit(None, &[1, 2]).unwrap().unwrap();
    let id = cache.request_id(&r, "extend").unwrap();
    cache
        .with(|c| c.extend(id, &[1, 2]).unwrap().unwrap())
        .unwrap();
    cache.with(|c| c.finish(id).unwrap()).unwrap();
    assert!(!r.is_live());
    drop(r);
    cache
        .with(|c| {
            assert_eq!(c.stats.requests_dropped, 0);
            assert_eq!(c.match_prefix(None, &[1, 2]).device_len, 2);
        })
        .unwrap();
    let other = HybridCache::new(Config::kv(8, 1)).unwrap();
    let foreign = other.admit(None, &[1]).unwrap().unwrap();
    assert!(matches!(
        cache.request_id(&foreign, "extend"),
        Err(Error::Request(_))
    ));
}

#[test]
fn batch_ids_are_checked() {
    let mut c = hybrid(16, 1, 2);
    let unknown = BatchId::new(c.id(), 7);
    for f in [Cache::start, Cache::complete, Cache::fail] {
        assert!(matches!(
            f(&mut c, unknown),
            Err(Error::InvalidArgument {
                arg: "batch_id",
                ..
            })
        ));
    }
    cached_with_state(&mut c, &[1]);
    let id = c.admit(None, &[1]).unwrap().unwrap();
    let b = c.take_batches();
    c.start(b[0].id).unwrap();
    assert_eq!(c.started(b[0].id), Some(true));
    c.complete(b[0].id).unwrap();
    assert!(c.fail(b[0].id).is_err(), "acknowledged once only");
    c.finish(id).unwrap();
    c.audit().unwrap();
}

#[test]
fn a_refused_extend_evicts_nothing() {
    // KV could be had by evicting the cached [1, 2], but no state slot can be had (the
    // only one is another request's): the refusal must not cost the cache [1, 2].
    let mut c = hybrid(4, 1, 1);
    let got = c.alloc_kv(2).unwrap().unwrap();
    c.insert(None, &[1, 2], &got, 0).unwrap();
    let a = c.admit(None, &[5]).unwrap().unwrap();
    c.extend(a, &[5, 6]).unwrap().unwrap();
    let b = c.admit(None, &[7]).unwrap().unwrap();
    assert_eq!(c.extend(b, &[7]).unwrap(), None);
    assert_eq!(c.stats.evicted_kv_tokens, 0);
    assert_eq!(c.match_prefix(None, &[1, 2]).kv_len, 2, "still cached");
    c.abort(a).unwrap();
    c.abort(b).unwrap();
    c.audit().unwrap();
}

#[test]
fn a_state_a_copy_reads_is_no_eviction_candidate_until_the_copy_ends() {
    let mut c = hybrid(64, 1, 3);
    cached_with_state(&mut c, &[1]);
    cached_with_state(&mut c, &[2]);
    // Admission of [1, 9] copies [1]'s state (its source is pinned by the cow batch);
    // the admission's own lock on [1] goes when the request is aborted.
    let r = c.admit(None, &[1, 9]).unwrap().unwrap();
    c.abort(r).unwrap();
    let b = c.take_batches();
    assert_eq!(c.lru.state_count(), 1, "only [2]'s state: [1]'s is pinned");
    // [1] is the least recently used state, but evicting it would only drain its slot.
    assert_eq!(c.evict(0, 1).mamba_states, 1);
    assert_eq!(
        c.match_prefix(None, &[1]).device_len,
        1,
        "[1] kept its state"
    );
    assert_eq!(c.match_prefix(None, &[2]).device_len, 0, "[2]'s went");
    c.audit().unwrap();
    c.complete(b[0].id).unwrap();
    assert_eq!(c.lru.state_count(), 1, "unpinned: a candidate again");
    c.audit().unwrap();
}

#[test]
fn freeing_a_locked_state_is_refused_and_breaks_the_cache() {
    let mut c = hybrid(64, 1, 4);
    let a = cached_with_state(&mut c, &[1, 2, 3]);
    let lock = c.lock(a.node).unwrap();
    let i = c.tree.resolve(a.node).unwrap();
    let mut out = Evicted::default();
    // What a bug in eviction would do: the state a request reads is freed.
    c.drop_state(i, &mut out);
    assert_eq!(out, Evicted::default());
    assert!(c.tree.node(i).mamba.device.is_some(), "the state stays");
    let why = c.fault().unwrap();
    assert!(why.contains("the locked state of node"), "{why}");
    assert!(matches!(c.audit(), Err(Error::Invariant(w)) if w == why));
    c.unlock(lock).unwrap();
}

#[test]
fn a_second_state_on_a_node_is_refused_and_breaks_the_cache() {
    let mut c = hybrid(64, 1, 4);
    let a = cached_with_state(&mut c, &[1, 2, 3]);
    let i = c.tree.resolve(a.node).unwrap();
    let before = c.tree.node(i).mamba.device;
    let state = c.pools.mamba.try_alloc(1).unwrap();
    c.set_state(i, state);
    assert_eq!(c.tree.node(i).mamba.device, before);
    assert_eq!(c.mamba_counts().owned, 0, "the slot went back to the pool");
    assert!(c.fault().unwrap().contains("which has a state: true"));
    // Through the shared handle, every later call is refused.
    let h = HybridCache::new(Config {
        mamba_slots: 4,
        ..Config::kv(64, 1)
    })
    .unwrap();
    let err = h
        .with(|core| {
            let a = cached_with_state(core, &[1, 2, 3]);
            let i = core.tree.resolve(a.node).unwrap();
            let state = core.pools.mamba.try_alloc(1).unwrap();
            core.set_state(i, state);
        })
        .unwrap_err();
    assert!(matches!(err, Error::Broken(_)));
    assert!(matches!(
        h.with(|core| core.total_size()),
        Err(Error::Broken(_))
    ));
}
