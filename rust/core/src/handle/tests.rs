//! Unit tests of the handles: each gives back what it holds when dropped (a panic
//! inside its scope included), and a panic or an illegal page transition in the core
//! breaks the cache for good.

use super::*;
use crate::cache::{Abandoned, LoadTarget};
use crate::config::Config;
use crate::error::Error;
use crate::ids::NodeId;

fn cache() -> HybridCache {
    HybridCache::new(Config::kv(16, 1)).unwrap()
}

fn cached(c: &HybridCache, toks: &[u32]) -> NodeId {
    c.with(|core| {
        let slots = core.alloc_kv(toks.len()).unwrap().unwrap();
        core.insert(None, toks, &slots, 0).unwrap().node
    })
    .unwrap()
}

#[test]
fn dropping_a_lock_releases_it() {
    let c = cache();
    let node = cached(&c, &[1, 2, 3]);
    {
        let _l = c.lock(node).unwrap();
        assert_eq!(c.with(|core| core.protected_size()).unwrap(), 3);
    }
    assert_eq!(c.with(|core| core.protected_size()).unwrap(), 0);
    c.call(|core| core.audit()).unwrap();
}

#[test]
fn panic_inside_a_lock_scope_releases_it() {
    let c = cache();
    let node = cached(&c, &[1, 2]);
    let c2 = c.clone();
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
        let _l = c2.lock(node).unwrap();
        panic!("scheduler bug");
    }));
    assert!(r.is_err());
    assert_eq!(
        c.with(|core| (core.protected_size(), core.evictable_size()))
            .unwrap(),
        (0, 2)
    );
    c.call(|core| core.audit()).unwrap();
}

#[test]
fn an_illegal_page_transition_in_a_call_breaks_the_cache_and_every_later_call_says_so() {
    let c = cache();
    let node = cached(&c, &[1, 2]);
    // A double unpin, as a bug in the batch code would make it.
    let err = c
        .with(|core| {
            core.kv_pool().pin(&[0]);
            core.kv_pool().unpin(&[0]);
            core.kv_pool().unpin(&[0]);
        })
        .unwrap_err();
    assert!(
        matches!(&err, Error::Broken(why) if why.contains("unpinned more often")),
        "{err}"
    );
    assert!(c.broken().is_some());
    assert!(matches!(c.lock(node), Err(Error::Broken(_))));
    assert!(matches!(c.admit(None, &[1, 2, 3]), Err(Error::Broken(_))));
}

#[test]
fn an_illegal_page_transition_outside_any_call_breaks_the_cache_at_the_next_call() {
    let c = cache();
    let node = cached(&c, &[1, 2]);
    let pool = c.with(|core| core.kv_pool().clone()).unwrap();
    // Pages may be given back anywhere (a finaliser): a bug there is caught too.
    pool.release_tree(&[9]);
    assert!(c.broken().unwrap().contains("page 9 (Tree to Free)"));
    assert!(matches!(c.lock(node), Err(Error::Broken(_))));
    assert!(matches!(
        c.with(|core| core.available_kv()),
        Err(Error::Broken(_))
    ));
}

#[test]
fn a_panic_inside_the_core_breaks_the_cache_and_every_later_call_says_so() {
    let c = cache();
    let node = cached(&c, &[1, 2]);
    let lock = c.lock(node).unwrap();
    let request = c.admit(None, &[1, 2, 3]).unwrap().unwrap();
    let err = c
        .with(|core| {
            // A change interrupted half way, as a bug would.
            core.evict(1, 0);
            panic!("bug in the middle of a change")
        })
        .unwrap_err();
    assert!(matches!(&err, Error::Broken(why) if why.contains("bug in the middle")));
    assert!(c.broken().is_some());
    assert!(matches!(
        c.with(|core| core.available_kv()),
        Err(Error::Broken(_))
    ));
    assert!(matches!(c.lock(node), Err(Error::Broken(_))));
    assert!(matches!(c.admit(None, &[1]), Err(Error::Broken(_))));
    assert!(!request.is_live());
    // Dropping handles of a broken cache is safe and does nothing.
    drop(lock);
    drop(request);
    assert!(matches!(c.call(|core| core.audit()), Err(Error::Broken(_))));
}

/// A hybrid cache with a host tier holding [1, 2, 3, 4] (and its state) on the host
/// only; returns the cache and the node.
fn demoted() -> (HybridCache, NodeId) {
    let c = HybridCache::new(Config {
        mamba_slots: 4,
        host_kv_slots: 16,
        host_mamba_slots: 2,
        ..Config::kv(16, 1)
    })
    .unwrap();
    let node = c
        .with(|core| {
            let slots = core.alloc_kv(4).unwrap().unwrap();
            let state = core.alloc_mamba().unwrap().map(i64::from);
            let node = core
                .insert_with_state(None, &[1, 2, 3, 4], &slots, 0, state)
                .unwrap()
                .node;
            for b in core.take_batches() {
                core.complete(b.id).unwrap();
            }
            core.evict(4, 0);
            node
        })
        .unwrap();
    (c, node)
}

fn pool_counts(c: &HybridCache) -> Vec<crate::PoolCounts> {
    c.with(|core| {
        vec![
            core.kv_counts(),
            core.mamba_counts(),
            core.host_kv_pool().counts(),
            core.host_mamba_pool().counts(),
        ]
    })
    .unwrap()
}

#[test]
fn panic_inside_a_load_back_scope_gives_back_every_slot() {
    let (c, node) = demoted();
    let request = c.admit(None, &[1, 2, 3, 4]).unwrap().unwrap();
    let before = pool_counts(&c);
    let (c2, r2) = (c.clone(), &request);
    let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
        let lb = c2.load_back(node, None, Some(r2)).unwrap().unwrap();
        assert_eq!(lb.kv_tokens(), 4);
        panic!("engine failed mid-copy");
    }));
    assert!(out.is_err());
    assert_eq!(pool_counts(&c), before, "the guard's slots went back");
    let id = request.id();
    let view = c.call(|core| core.request(id)).unwrap();
    assert_eq!(
        (view.prefix_len, view.mamba_slot, view.load_pending),
        (0, None, None)
    );
    c.call(|core| core.audit()).unwrap();
}

#[test]
fn committed_guard_publishes_and_a_dropped_one_does_not() {
    let (c, node) = demoted();
    let request = c.admit(None, &[1, 2, 3, 4]).unwrap().unwrap();
    drop(c.load_back_request(&request, None).unwrap().unwrap());
    let id = request.id();
    assert_eq!(c.call(|core| core.request(id)).unwrap().prefix_len, 0);
    let lb = c.load_back_request(&request, None).unwrap().unwrap();
    let batch = lb.id();
    assert_eq!(lb.batch().copies.len(), 3);
    lb.commit().unwrap();
    c.call(|core| core.complete(batch)).unwrap();
    let view = c.call(|core| core.request(id)).unwrap();
    assert_eq!((view.prefix_len, view.node), (4, node));
    c.call(|core| core.audit()).unwrap();
}

#[test]
fn second_unlock_and_foreign_unlock_fail() {
    let c = cache();
    let other = cache();
    let node = cached(&c, &[4, 5]);
    let mut slot = Some(c.lock(node).unwrap());
    let err = other.unlock(&mut slot).unwrap_err();
    assert!(matches!(err, Error::Lock(_)));
    assert!(slot.is_some(), "a foreign unlock leaves the receipt alone");
    c.unlock(&mut slot).unwrap();
    assert!(matches!(c.unlock(&mut slot), Err(Error::Lock(_))));
    c.call(|core| core.audit()).unwrap();
}

#[test]
fn a_core_receipt_or_load_record_dropped_unreleased_is_settled_by_the_next_call() {
    let (c, node) = demoted();
    let before = pool_counts(&c);
    c.with(|core| {
        let receipt = core.lock(node).unwrap();
        let record = core
            .load_back(LoadTarget::Node(node), None, None)
            .unwrap()
            .unwrap();
        // Both dropped, as a `?` in the wrong place would.
        drop((receipt, record));
    })
    .unwrap();
    assert_eq!(pool_counts(&c), before, "the next call settled both");
    let stats = c.with(|core| core.stats()).unwrap();
    let get = |k| stats.iter().find(|(n, _)| *n == k).map(|&(_, v)| v);
    assert_eq!(get("live_locks"), Some(0));
    assert_eq!(get("load_backs_called_off_released"), Some(1));
    c.call(|core| core.audit()).unwrap();
}

/// A hybrid cache with a write-through host tier; [1, 2, 3, 4] is cached with its
/// state and its backup batch is the one returned.
fn backed_up() -> (HybridCache, Batch) {
    let c = HybridCache::new(Config {
        mamba_slots: 4,
        host_kv_slots: 16,
        host_mamba_slots: 4,
        write_policy: crate::WritePolicy::WriteThrough,
        ..Config::kv(16, 1)
    })
    .unwrap();
    c.with(|core| {
        let slots = core.alloc_kv(4).unwrap().unwrap();
        let state = core.alloc_mamba().unwrap().map(i64::from);
        core.insert_with_state(None, &[1, 2, 3, 4], &slots, 0, state)
            .unwrap();
    })
    .unwrap();
    let mut batches = c.take_batches().unwrap();
    assert_eq!(batches.len(), 1);
    let b = batches.remove(0);
    assert_eq!(b.batch().kind, crate::BatchKind::Backup);
    (c, b)
}

fn stat(c: &HybridCache, key: &str) -> u64 {
    let stats = c.with(|core| core.stats()).unwrap();
    stats.iter().find(|(n, _)| *n == key).map_or(0, |&(_, v)| v)
}

/// Nothing is pinned, draining or pending: every slot is free or held by the tree
/// or a request.
fn settled(c: &HybridCache) {
    for counts in pool_counts(c) {
        assert_eq!(counts.draining, 0, "{counts:?}");
    }
    assert!(c.with(|core| core.pending_batches()).unwrap().is_empty());
    assert_eq!(stat(c, "batches_in_flight"), 0);
    c.call(|core| core.audit()).unwrap();
}

#[test]
fn a_batch_dropped_before_it_started_fails_and_gives_everything_back() {
    let (c, b) = backed_up();
    assert_eq!(pool_counts(&c)[2].free, 12, "the backup holds 4 host pages");
    drop(b);
    assert_eq!(pool_counts(&c)[2].free, 16);
    assert_eq!(pool_counts(&c)[3].free, 4);
    assert_eq!(stat(&c, "batches_abandoned"), 1);
    assert_eq!(stat(&c, "backups_failed"), 1);
    settled(&c);
}

#[test]
fn a_panic_between_take_and_complete_gives_everything_back() {
    for started in [false, true] {
        let (c, b) = backed_up();
        let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let b = b;
            if started {
                b.start().unwrap();
                // What an engine does with a started batch it cannot finish.
                b.close("copy raised").unwrap();
            }
            panic!("engine bug");
        }));
        assert!(out.is_err());
        assert_eq!(pool_counts(&c)[2].free, 16);
        settled(&c);
    }
}

#[test]
fn a_started_batch_dropped_before_it_ended_stays_in_flight_until_acknowledged_then_fails() {
    let (c, b) = backed_up();
    let id = b.id();
    b.start().unwrap();
    assert_eq!(b.abandon(), Abandoned::Draining);
    assert_eq!(b.outcome(), Some(Outcome::Abandoned(Abandoned::Draining)));
    drop(b);
    // Still in flight as it was, holding the host pages its copies may still write,
    // and listed until the engine says the copies are over.
    assert_eq!(stat(&c, "backups_failed"), 0);
    assert_eq!(stat(&c, "batches_draining"), 1);
    assert_eq!(
        c.with(|core| core.pending_batches()).unwrap(),
        vec![(id, crate::BatchKind::Backup, true)]
    );
    assert_eq!(pool_counts(&c)[2].free, 12);
    c.call(|core| core.audit()).unwrap();
    // Either acknowledgement fails it: its owner no longer vouches for the copies.
    c.call(|core| core.complete(id)).unwrap();
    assert_eq!(pool_counts(&c)[2].free, 16);
    assert_eq!(
        (stat(&c, "backups_done"), stat(&c, "backups_failed")),
        (0, 1)
    );
    assert_eq!(stat(&c, "batches_completed"), 0);
    settled(&c);
}

#[test]
fn an_ended_batch_is_not_abandoned_by_its_drop() {
    let (c, b) = backed_up();
    b.start().unwrap();
    b.complete().unwrap();
    assert_eq!(b.outcome(), Some(Outcome::Completed));
    assert_eq!(b.abandon(), Abandoned::Nothing);
    drop(b);
    assert_eq!(stat(&c, "backups_done"), 1);
    assert_eq!(stat(&c, "batches_abandoned"), 0);
    settled(&c);
    // Acknowledged by id through the cache: the handle's drop finds nothing to do.
    let (c, b) = backed_up();
    let id = b.id();
    c.call(|core| core.fail(id)).unwrap();
    assert!(b.complete().is_err());
    assert!(!b.close("late").unwrap());
    drop(b);
    assert_eq!(stat(&c, "batches_abandoned"), 0);
    settled(&c);
}

#[test]
fn a_load_backs_batch_handle_does_not_own_the_batch() {
    let (c, node) = demoted();
    let request = c.admit(None, &[1, 2, 3, 4]).unwrap().unwrap();
    let lb = c.load_back_request(&request, None).unwrap().unwrap();
    let b = lb.batch_handle();
    let id = b.id();
    b.start().unwrap();
    assert_eq!(b.abandon(), Abandoned::Nothing);
    drop(b);
    lb.commit().unwrap();
    // Committed and in flight: acknowledged by id, it publishes.
    c.call(|core| core.complete(id)).unwrap();
    let rid = request.id();
    assert_eq!(c.call(|core| core.request(rid)).unwrap().prefix_len, 4);
    let m = c
        .with(|core| core.match_prefix(None, &[1, 2, 3, 4]))
        .unwrap();
    assert_eq!((m.device_len, m.node), (4, node));
    drop(request);
    settled(&c);
}
