//! Unit tests of the sliding-window attention component: the match cut, tombstones,
//! window locks, the SWA pool's accounting, and the failure classes of other systems.

use super::util::{cached, prefix_and_fresh, seq, stat};
use crate::cache::*;
use crate::config::EvictionPolicies;
use crate::error::Error;
use crate::ids::NodeId;

fn swa(kv: usize, ps: usize, swa_slots: usize, window: usize) -> Cache {
    Cache::new(Config {
        swa_slots,
        swa_window: window,
        ..Config::kv(kv, ps)
    })
    .unwrap()
}

/// Turns every internal node with live SWA into a tombstone, deleting no leaf: the
/// leaves are locked meanwhile.
fn tombstone_internal(c: &mut Cache, leaves: &[NodeId]) {
    let locks: Vec<_> = leaves.iter().map(|&n| c.lock(n).unwrap()).collect();
    c.evict_swa(usize::MAX);
    for l in locks {
        c.unlock(l).unwrap();
    }
}

#[test]
fn a_match_needs_the_window_live_at_the_cut() {
    // Window 3 in pages of 2: the last 4 tokens (2 pages) before the cut must be live.
    let mut c = swa(64, 2, 32, 3);
    cached(&mut c, &seq(8));
    let leaf = cached(&mut c, &seq(12)).node;
    tombstone_internal(&mut c, &[leaf]);
    assert_eq!(stat(&c, "swa_tombstones"), 1);
    c.audit().unwrap();
    // The leaf's 4 live tokens make the window: the whole path is usable.
    let m = c.match_prefix(None, &seq(12));
    assert_eq!((m.device_len, m.kv_len), (12, 12));
    assert_eq!(m.kv_indices.len(), 12);
    // Cut at the tombstone, or 2 tokens into the leaf: the window is not live there.
    assert_eq!(c.match_prefix(None, &seq(8)).device_len, 0);
    let m = c.match_prefix(None, &seq(10));
    assert_eq!((m.device_len, m.kv_len), (0, 10));
    c.audit().unwrap();
}

#[test]
fn a_tombstone_inside_a_branch_does_not_make_the_branch_unmatchable() {
    // Failure class: one tombstone on a branch's path, outside the window, must not make
    // the whole branch unmatchable: only the window at the cut counts.
    let mut c = swa(64, 1, 64, 4);
    cached(&mut c, &seq(4));
    cached(&mut c, &seq(8));
    let leaf = cached(&mut c, &seq(12)).node;
    // Only the middle node loses its SWA (the first is locked by a lock ending at it).
    let first = c.match_prefix(None, &seq(4)).node;
    let keep = c.lock(first).unwrap();
    tombstone_internal(&mut c, &[leaf]);
    assert_eq!(stat(&c, "swa_tombstones"), 1);
    assert_eq!(c.match_prefix(None, &seq(12)).device_len, 12);
    assert_eq!(c.match_prefix(None, &seq(4)).device_len, 4);
    assert_eq!(
        c.match_prefix(None, &seq(8)).device_len,
        4,
        "cut back past the tombstone"
    );
    c.unlock(keep).unwrap();
    c.audit().unwrap();
}

#[test]
fn pages_larger_than_the_window_need_the_last_page_live_and_leave_no_tombstone_leaf() {
    // Failure class: with pages larger than the window, a leaf whose only page lost its
    // SWA would be an all-tombstone leaf nothing can match; it goes with its KV.
    let mut c = swa(64, 4, 32, 2);
    cached(&mut c, &seq(8));
    let leaf = cached(&mut c, &seq(12)).node;
    tombstone_internal(&mut c, &[leaf]);
    assert_eq!(c.match_prefix(None, &seq(12)).device_len, 12);
    assert_eq!(c.match_prefix(None, &seq(8)).device_len, 0);
    // Evicting the leaf's SWA deletes it, and its tombstone parent (left a dead leaf).
    c.evict_swa(usize::MAX);
    c.audit().unwrap();
    assert_eq!(stat(&c, "nodes"), 0);
    assert_eq!(c.kv_counts().free, c.kv_pool().capacity_pages());
    assert_eq!(stat(&c, "swa_free_slots"), 32);
}

#[test]
fn kv_eviction_of_a_leaf_takes_a_tombstone_parent_along() {
    let mut c = swa(64, 1, 64, 2);
    cached(&mut c, &seq(4));
    let leaf = cached(&mut c, &seq(6)).node;
    tombstone_internal(&mut c, &[leaf]);
    let out = c.evict(2, 0);
    assert_eq!(out.kv_tokens, 6, "the tombstone parent went with the leaf");
    assert_eq!(stat(&c, "nodes"), 0);
    c.audit().unwrap();
}

#[test]
fn a_window_lock_covers_only_the_window() {
    let mut c = swa(64, 1, 64, 4);
    cached(&mut c, &seq(8));
    let leaf = cached(&mut c, &seq(12)).node;
    let lock = c.lock(leaf).unwrap();
    // The first node is locked for its KV, not its SWA: it becomes a tombstone.
    assert_eq!(c.evict_swa(usize::MAX), 8);
    c.audit().unwrap();
    assert_eq!(c.match_prefix(None, &seq(12)).device_len, 12);
    c.unlock(lock).unwrap();
    // Unlocked, the leaf goes whole and its tombstone parent with it.
    assert_eq!(c.evict_swa(usize::MAX), 4);
    assert_eq!(stat(&c, "nodes"), 0);
    c.audit().unwrap();
}

#[test]
fn a_window_reaching_above_its_node_locks_the_ancestors_in_it() {
    let mut c = swa(64, 1, 64, 6);
    cached(&mut c, &seq(8));
    let leaf = cached(&mut c, &seq(12)).node;
    let lock = c.lock(leaf).unwrap();
    // The window (6 tokens) covers the leaf and 2 tokens of its parent: nothing goes.
    assert_eq!(c.evict_swa(usize::MAX), 0);
    c.unlock(lock).unwrap();
    c.audit().unwrap();
}

#[test]
fn a_window_lock_is_released_exactly_once_across_splits() {
    // Failure class: a window lock released twice (or not at all) after the locked
    // path was split under it.
    let mut c = swa(64, 1, 64, 4);
    let node = cached(&mut c, &seq(12)).node;
    let lock = c.lock(node).unwrap();
    let id = lock.id();
    // Splits inside the window and above it: the upper parts take what reaches them.
    assert_eq!(c.match_prefix(None, &seq(10)).device_len, 10);
    assert_eq!(c.match_prefix(None, &seq(5)).device_len, 5);
    c.audit().unwrap();
    c.unlock(lock).unwrap();
    c.audit().unwrap();
    assert!(matches!(c.release(id), Err(Error::Lock(_))));
    c.audit().unwrap();
    assert_eq!(c.fault(), None);
    // Nothing is left locked: everything can go.
    assert_eq!(c.evict_swa(usize::MAX), 12);
    c.audit().unwrap();
}

#[test]
fn a_short_swa_pool_evicts_swa_first_and_refuses_when_nothing_can_go() {
    let mut c = swa(64, 1, 8, 2);
    cached(&mut c, &seq(4));
    let leaf = cached(&mut c, &seq(8)).node;
    assert_eq!(stat(&c, "swa_free_slots"), 0);
    let lock = c.lock(leaf).unwrap();
    // The KV pool has room; the SWA pages come from the unlocked first node.
    let got = c.alloc_kv(4).unwrap().unwrap();
    assert_eq!(stat(&c, "swa_tombstones"), 1);
    assert_eq!(stat(&c, "swa_caller_slots"), 4);
    c.audit().unwrap();
    // Nothing left to evict: refused, having taken nothing.
    assert_eq!(c.alloc_kv(4).unwrap(), None);
    assert_eq!(stat(&c, "swa_alloc_failures"), 1);
    assert_eq!(c.kv_counts().caller, 4);
    c.free_kv(&got).unwrap();
    assert_eq!(
        stat(&c, "swa_free_slots"),
        4,
        "freed KV takes its SWA pages along"
    );
    c.unlock(lock).unwrap();
    c.audit().unwrap();
}

#[test]
fn an_insert_of_the_same_tokens_revives_a_tombstone() {
    let mut c = swa(64, 1, 64, 4);
    cached(&mut c, &seq(8));
    let leaf = cached(&mut c, &seq(12)).node;
    tombstone_internal(&mut c, &[leaf]);
    assert_eq!(c.match_prefix(None, &seq(8)).device_len, 0);
    // The match gives nothing for the tombstone; the insert's fresh pages revive it.
    cached(&mut c, &seq(8));
    assert_eq!(stat(&c, "swa_revived_pages"), 8);
    assert_eq!(c.match_prefix(None, &seq(8)).device_len, 8);
    c.audit().unwrap();
}

#[test]
fn a_revived_tombstone_takes_the_inserts_own_swa_slots_in_order() {
    // The SWA slots hold the KV the insert's tokens wrote: reviving with any other
    // slots (fresh ones, or the insert's in another order) serves another sequence's.
    let mut c = swa(64, 2, 64, 4);
    cached(&mut c, &seq(8));
    let leaf = cached(&mut c, &seq(12)).node;
    tombstone_internal(&mut c, &[leaf]);
    let fresh = c.alloc_kv(8).unwrap().unwrap();
    let pages: Vec<u32> = fresh
        .iter()
        .step_by(2)
        .map(|&s| u32::try_from(s / 2).unwrap())
        .collect();
    let theirs = c.pools.kv.companions(&pages);
    assert!(theirs.iter().all(Option::is_some));
    c.insert(None, &seq(8), &fresh, 0).unwrap();
    assert_eq!(stat(&c, "swa_revived_pages"), 4);
    let m = c.match_prefix(None, &seq(8));
    assert_eq!(m.device_len, 8);
    let tree: Vec<u32> = m
        .kv_indices
        .iter()
        .step_by(2)
        .map(|&s| u32::try_from(s / 2).unwrap())
        .collect();
    assert_eq!(c.pools.kv.companions(&tree), theirs);
    c.audit().unwrap();
}

#[test]
fn the_swa_pool_adds_up() {
    let mut c = swa(64, 2, 16, 3);
    cached(&mut c, &seq(6));
    let held = c.alloc_kv(4).unwrap().unwrap();
    let sum = stat(&c, "swa_free_slots")
        + stat(&c, "swa_cached_tokens")
        + stat(&c, "swa_caller_slots")
        + stat(&c, "swa_request_slots")
        + stat(&c, "swa_draining_slots");
    assert_eq!(sum, stat(&c, "swa_capacity_slots"));
    assert_eq!(
        (stat(&c, "swa_cached_tokens"), stat(&c, "swa_caller_slots")),
        (6, 4)
    );
    c.free_kv(&held).unwrap();
    c.audit().unwrap();
}

#[test]
fn swa_arguments_are_validated_by_name() {
    let arg_of = |c: Config| match Cache::new(c) {
        Err(Error::InvalidArgument { arg, .. }) => arg,
        other => panic!("expected an argument error, got {other:?}"),
    };
    let base = Config::kv(64, 2);
    let with = |swa_slots, swa_window| Config {
        swa_slots,
        swa_window,
        ..base.clone()
    };
    assert_eq!(arg_of(with(0, 4)), "swa_window");
    assert_eq!(arg_of(with(8, 0)), "swa_window");
    assert_eq!(arg_of(with(7, 4)), "swa_slots");
    // A host tier needs a host SWA pool: at least one page, whole pages, at most the
    // host KV pool; without SWA layers or a host tier it must be 0.
    let host = |host_swa_slots| Config {
        host_kv_slots: 64,
        host_swa_slots,
        ..with(8, 4)
    };
    for bad in [0, 3, 66] {
        assert_eq!(arg_of(host(bad)), "host_swa_slots", "host_swa_slots={bad}");
    }
    assert!(Cache::new(host(64)).is_ok());
    assert!(Cache::new(host(2)).is_ok());
    assert_eq!(
        arg_of(Config {
            host_swa_slots: 8,
            ..with(8, 4)
        }),
        "host_swa_slots"
    );
    assert_eq!(
        arg_of(Config {
            host_kv_slots: 64,
            host_swa_slots: 8,
            ..base.clone()
        }),
        "host_swa_slots"
    );
    assert_eq!(
        arg_of(Config {
            pools: crate::config::PoolOwner::Engine,
            ..with(8, 4)
        }),
        "swa_slots"
    );
    assert!(Cache::new(with(8, 4)).unwrap().has_swa());
    assert!(!Cache::new(base).unwrap().has_swa());
}

fn request_swa_slots(c: &Cache) -> u64 {
    stat(c, "swa_request_slots")
}

#[test]
fn a_request_gives_back_the_swa_pages_that_leave_its_window() {
    let mut c = swa(64, 2, 64, 4);
    let r = c.admit(None, &[]).unwrap().unwrap();
    c.extend(r, &seq(6)).unwrap().unwrap();
    assert_eq!(request_swa_slots(&c), 6);
    // At 6 tokens the window is tokens 2..6: page 0 goes before the next pages come.
    c.extend(r, &seq(4)).unwrap().unwrap();
    assert_eq!(stat(&c, "swa_window_freed_pages"), 1);
    assert_eq!(request_swa_slots(&c), 8);
    let (start, slots) = c.request_swa_indices(r).unwrap();
    assert_eq!((start, slots.len()), (2, 8));
    assert!(slots.iter().all(|&s| s >= 0));
    c.audit().unwrap();
    c.abort(r).unwrap();
    assert_eq!(stat(&c, "swa_free_slots"), 64);
    c.audit().unwrap();
}

#[test]
fn the_freed_window_survives_chunks_and_checkpoints() {
    // Failure class: the evicted-window length lost between chunks (a page freed twice,
    // or kept). Prefill in chunks of 8 with a checkpoint after each.
    let mut c = swa(128, 2, 64, 4);
    let r = c.admit(None, &[]).unwrap().unwrap();
    let toks = seq(24);
    for (k, chunk) in toks.chunks(8).enumerate() {
        c.extend(r, chunk).unwrap().unwrap();
        c.checkpoint(r).unwrap();
        c.audit().unwrap();
        // The chunk's own pages ending at or before len - 4 gave their SWA pages back,
        // once: 2 pages a chunk (what an earlier checkpoint cached is the tree's now).
        let len = 8 * (k + 1);
        assert_eq!(
            stat(&c, "swa_window_freed_pages"),
            2 * (k as u64 + 1),
            "after chunk {k}"
        );
        let (start, slots) = c.request_swa_indices(r).unwrap();
        assert!(start <= len - 4 && slots.iter().all(|&s| s >= 0));
    }
    c.finish(r).unwrap();
    assert_eq!(c.fault(), None);
    c.audit().unwrap();
    // Each chunk's last window is live, its first half a tombstone: cuts at the chunk
    // ends match, one inside a tombstone falls back to the chunk end before it.
    assert_eq!(stat(&c, "swa_cached_tokens"), 12);
    assert_eq!(c.match_prefix(None, &toks).device_len, 24);
    assert_eq!(c.match_prefix(None, &toks[..16]).device_len, 16);
    assert_eq!(c.match_prefix(None, &toks[..12]).device_len, 8);
    c.audit().unwrap();
}

#[test]
fn a_second_request_reuses_the_window_and_revives_what_it_recomputes() {
    let mut c = swa(128, 1, 64, 4);
    let toks = seq(12);
    let a = c.admit(None, &[]).unwrap().unwrap();
    c.extend(a, &toks).unwrap().unwrap();
    c.finish(a).unwrap();
    // The finished request's window (the last 4 tokens, and one page more) is cached.
    let b = c.admit(None, &toks).unwrap().unwrap();
    assert_eq!(c.request(b).unwrap().prefix_len, 12);
    let (start, slots) = c.request_swa_indices(b).unwrap();
    assert_eq!((start, slots.len()), (8, 4));
    c.abort(b).unwrap();
    // A shorter prompt cannot be cut inside the tombstones: it recomputes, and its
    // finish gives the tombstoned pages their SWA back.
    let d = c.admit(None, &toks[..8]).unwrap().unwrap();
    assert_eq!(c.request(d).unwrap().prefix_len, 0);
    c.extend(d, &toks[..8]).unwrap().unwrap();
    c.finish(d).unwrap();
    assert_eq!(c.match_prefix(None, &toks[..8]).device_len, 8);
    assert!(stat(&c, "swa_revived_pages") > 0);
    c.audit().unwrap();
}

#[test]
fn a_window_lock_moves_with_checkpoints_and_is_released_once() {
    let mut c = swa(128, 1, 64, 3);
    let r = c.admit(None, &[]).unwrap().unwrap();
    for chunk in seq(12).chunks(5) {
        c.extend(r, chunk).unwrap().unwrap();
        c.checkpoint(r).unwrap();
        c.audit().unwrap();
    }
    c.finish(r).unwrap();
    c.audit().unwrap();
    assert_eq!(stat(&c, "live_locks"), 0);
    // Nothing locked: SWA eviction can take every window.
    c.evict_swa(usize::MAX);
    assert_eq!(stat(&c, "nodes"), 0);
    c.audit().unwrap();
}

#[test]
fn a_prefix_shorter_than_the_window_matches_when_all_of_it_is_live() {
    let mut c = swa(64, 2, 64, 16);
    cached(&mut c, &seq(6));
    cached(&mut c, &seq(10));
    assert_eq!(c.match_prefix(None, &seq(6)).device_len, 6);
    assert_eq!(c.match_prefix(None, &seq(10)).device_len, 10);
    // One dead node on the way (the least recently used, the parent): the window, longer
    // than the path, is not all live.
    assert_eq!(c.evict_swa(1), 3);
    assert_eq!(stat(&c, "swa_tombstones"), 1);
    assert_eq!(c.match_prefix(None, &seq(10)).device_len, 0);
    c.audit().unwrap();
}

/// Caches `toks` with `priority` through the low-level API.
fn cached_with_priority(c: &mut Cache, toks: &[u32], priority: i64) {
    let (owned_from, kv) = prefix_and_fresh(c, toks);
    c.insert_with_priority(None, toks, &kv, owned_from, None, priority)
        .unwrap();
}

/// Whether `toks` still ends a node with device KV (read from the snapshot, which is
/// no match).
fn kept(c: &Cache, toks: &[u32]) -> bool {
    c.snapshot()
        .iter()
        .any(|n| n.prefix == toks && n.kv_indices.is_some())
}

#[test]
fn each_swa_policy_evicts_in_its_own_order() {
    // Two leaves on separate branches: [1, 1] cached first (priority 5) and matched
    // once after being queued, [2, 2] cached last (priority 0) and never matched. The
    // first SWA eviction takes a whole leaf: under "lru" the older [1, 1], under "lfu"
    // the unmatched [2, 2], under "priority" the lower [2, 2]. A plain name sets SWA,
    // a dict sets it alone, "state-value" leaves it on "lru".
    for (policy, first_goes) in [
        ("lru", &[1, 1]),
        ("lfu", &[2, 2]),
        ("priority", &[2, 2]),
        ("state-value", &[1, 1]),
    ] {
        for dict in [false, true] {
            if dict && policy == "state-value" {
                continue;
            }
            let eviction_policy = if dict {
                EvictionPolicies::from_components([("swa", policy)]).unwrap()
            } else {
                policy.parse().unwrap()
            };
            let mut c = Cache::new(Config {
                swa_slots: 16,
                swa_window: 2,
                eviction_policy,
                ..Config::kv(32, 1)
            })
            .unwrap();
            cached_with_priority(&mut c, &[1, 1], 5);
            assert_eq!(c.match_prefix(None, &[1, 1, 7]).device_len, 2);
            cached_with_priority(&mut c, &[2, 2], 0);
            c.audit().unwrap();
            assert_eq!(c.evict_swa(1), 2, "{policy}: one leaf, whole");
            c.audit().unwrap();
            let other: &[u32] = if first_goes == &[1, 1] {
                &[2, 2]
            } else {
                &[1, 1]
            };
            assert!(!kept(&c, first_goes), "{policy} (dict: {dict})");
            assert!(kept(&c, other), "{policy} (dict: {dict})");
        }
    }
}

#[test]
fn swa_eviction_turns_the_lowest_keyed_internal_node_into_a_tombstone() {
    // Internal nodes [1, 1] (matched, then older) and [2, 2] (newer, never matched),
    // their leaves locked: "lru" makes [1, 1] a tombstone, "lfu" [2, 2].
    for (policy, goes, stays) in [("lru", [1, 1], [2, 2]), ("lfu", [2, 2], [1, 1])] {
        let mut c = Cache::new(Config {
            swa_slots: 32,
            swa_window: 2,
            eviction_policy: policy.parse().unwrap(),
            ..Config::kv(64, 1)
        })
        .unwrap();
        cached(&mut c, &[1, 1]);
        let a = cached(&mut c, &[1, 1, 3, 3]).node;
        assert_eq!(c.match_prefix(None, &[1, 1, 9]).device_len, 2);
        cached(&mut c, &[2, 2]);
        let b = cached(&mut c, &[2, 2, 4, 4]).node;
        let locks = [c.lock(a).unwrap(), c.lock(b).unwrap()];
        assert_eq!(c.evict_swa(1), 2, "{policy}");
        assert_eq!(stat(&c, "swa_tombstones"), 1, "{policy}");
        c.audit().unwrap();
        assert_eq!(c.match_prefix(None, &goes).device_len, 0, "{policy}");
        assert_eq!(c.match_prefix(None, &stays).device_len, 2, "{policy}");
        for l in locks {
            c.unlock(l).unwrap();
        }
        c.audit().unwrap();
    }
}

#[test]
fn audit_checks_the_swa_queue_against_the_policy_keys() {
    for policy in ["lru", "lfu", "priority"] {
        let fresh = || {
            let mut c = Cache::new(Config {
                swa_slots: 16,
                swa_window: 2,
                eviction_policy: policy.parse().unwrap(),
                ..Config::kv(32, 1)
            })
            .unwrap();
            let node = cached(&mut c, &[1, 1]).node;
            let i = c.tree.resolve(node).unwrap();
            c.touch(i, true);
            c.raise_priority(i, 3);
            c.audit().unwrap();
            (c, i)
        };
        // A key that went down: the queued entry is past the node's place.
        let (mut c, i) = fresh();
        let n = c.tree.node_mut(i);
        n.last_access = 0;
        n.matches = 0;
        n.priority = 0;
        let err = c.audit().unwrap_err();
        assert!(
            matches!(&err, Error::Invariant(m) if m.contains("keys only grow")),
            "{policy}: {err}"
        );
        // An entry for a node not marked queued.
        let (mut c, i) = fresh();
        c.tree.node_mut(i).swa.queued = false;
        let err = c.audit().unwrap_err();
        assert!(
            matches!(&err, Error::Invariant(m) if m.contains("not marked queued")),
            "{policy}: {err}"
        );
    }
}
