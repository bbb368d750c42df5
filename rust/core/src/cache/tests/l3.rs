//! Unit tests of the L3 tier: what a landed backup offers, what a fetch takes and where
//! its pages land, partial and failed fetches, and the arguments refused.

use crate::cache::*;
use crate::config::Config;
use crate::error::Error;
use crate::hashes::{chain, namespace_seed};
use crate::ids::NodeId;
use crate::pool::PoolCounts;

/// A cache with pages of 2 tokens, a host tier and the L3 tier; with states (`hybrid`).
fn l3_cache(hybrid: bool) -> Cache {
    Cache::new(Config {
        kv_slots: 32,
        page_size: 2,
        mamba_slots: if hybrid { 4 } else { 0 },
        host_kv_slots: 64,
        host_mamba_slots: if hybrid { 4 } else { 0 },
        page_hashes: true,
        l3: true,
        ..Config::default()
    })
    .unwrap()
}

/// Caches `toks` in the default namespace (with a state at its end on a hybrid cache).
fn cached(c: &mut Cache, toks: &[u32]) -> NodeId {
    let m = c.match_prefix(None, toks);
    let rest = toks.len() - m.device_len;
    let mut kv = m.kv_indices.clone();
    kv.extend(c.alloc_kv(rest).unwrap().unwrap());
    let s = if c.is_hybrid() {
        c.alloc_mamba().unwrap().map(i64::from)
    } else {
        None
    };
    c.insert_with_state(None, toks, &kv, m.device_len, s)
        .unwrap()
        .node
}

/// Takes the batches and completes every one of `kind`; returns them.
fn complete_kind(c: &mut Cache, kind: BatchKind) -> Vec<TransferBatch> {
    let mut out = Vec::new();
    for b in c.take_batches() {
        c.start(b.id).unwrap();
        if b.kind == kind {
            c.complete(b.id).unwrap();
            out.push(b);
        } else {
            c.complete(b.id).unwrap();
        }
    }
    out
}

fn counts(c: &Cache) -> [PoolCounts; 4] {
    [
        c.kv_pool().counts(),
        c.mamba_pool().counts(),
        c.host_kv_pool().counts(),
        c.host_mamba_pool().counts(),
    ]
}

fn toks() -> Vec<u32> {
    (1..=8).collect()
}

#[test]
fn a_landed_backup_offers_its_pages_and_state_named_by_their_hashes() {
    let mut c = l3_cache(true);
    cached(&mut c, &toks());
    let backups = complete_kind(&mut c, BatchKind::Backup);
    assert_eq!(backups.len(), 1);
    let puts = c.take_batches();
    assert_eq!(puts.len(), 1, "one l3_put after the backup landed");
    let put = &puts[0];
    assert_eq!(put.kind, BatchKind::L3Put);
    let hashes = chain(namespace_seed(None, None).as_ref(), &toks(), 2);
    let mut keys = hashes.clone();
    keys.push(hashes[3]);
    assert_eq!(
        put.keys, keys,
        "four pages, then the state named by the last page"
    );
    assert_eq!(put.copies.len(), 2);
    let kv = &put.copies[0];
    assert_eq!(
        (kv.pool, kv.src_tier, kv.dst_tier),
        (PoolKind::Kv, Tier::Host, Tier::External)
    );
    assert_eq!(
        kv.dst,
        (0..8).collect::<Vec<i64>>(),
        "objects' slots in order"
    );
    assert_eq!(kv.src.len(), 8);
    let st = &put.copies[1];
    assert_eq!((st.pool, &st.dst[..]), (PoolKind::Mamba, &[0][..]));
    // While in flight the host pages are pinned: evicting from the host frees none.
    c.start(put.id).unwrap();
    c.complete(put.id).unwrap();
    assert_eq!(c.stats.l3_puts_done, 1);
    assert_eq!(c.stats.l3_put_pages, 4);
    assert_eq!(c.stats.l3_put_states, 1);
    c.audit().unwrap();
    // Written once: a longer prompt's backup offers only its new page.
    let mut longer = toks();
    longer.extend([9, 10]);
    cached(&mut c, &longer);
    complete_kind(&mut c, BatchKind::Backup);
    let puts = c.take_batches();
    assert_eq!(puts.len(), 1);
    let want = chain(Some(&hashes[3]), &[9, 10], 2);
    assert_eq!(
        puts[0].keys[..1],
        want[..],
        "only the new page (and its state)"
    );
    assert_eq!(puts[0].keys.len(), 2);
    c.start(puts[0].id).unwrap();
    c.complete(puts[0].id).unwrap();
    c.audit().unwrap();
}

#[test]
fn a_failed_put_is_offered_again_with_the_next_backup_on_its_path() {
    let mut c = l3_cache(false);
    cached(&mut c, &toks());
    complete_kind(&mut c, BatchKind::Backup);
    let put = c.take_batches().pop().unwrap();
    c.start(put.id).unwrap();
    c.fail(put.id).unwrap();
    assert_eq!(c.stats.l3_puts_failed, 1);
    let mut longer = toks();
    longer.extend([9, 10]);
    cached(&mut c, &longer);
    complete_kind(&mut c, BatchKind::Backup);
    let put = c.take_batches().pop().unwrap();
    assert_eq!(
        put.keys.len(),
        5,
        "the four pages not written yet, and the new one"
    );
    c.audit().unwrap();
}

#[test]
fn host_pages_a_put_reads_drain_instead_of_being_reused() {
    let mut c = l3_cache(false);
    cached(&mut c, &toks());
    complete_kind(&mut c, BatchKind::Backup);
    let put = c.take_batches().pop().unwrap();
    c.start(put.id).unwrap();
    assert_eq!(c.evict(8, 0).kv_tokens, 8, "demoted to the host");
    c.evict_host(8, 0).unwrap();
    assert_eq!(c.host_kv_pool().counts().draining, 4, "pinned by the put");
    c.audit().unwrap();
    c.complete(put.id).unwrap();
    assert_eq!(c.host_kv_pool().counts().draining, 0);
    assert_eq!(c.host_kv_pool().counts().free, 32);
    c.audit().unwrap();
}

/// A put from cache `a` of `toks()`, then a fetch of it into a fresh cache: the batch.
fn fetched(hybrid: bool) -> (Cache, TransferBatch, TransferBatch) {
    let mut a = l3_cache(hybrid);
    cached(&mut a, &toks());
    complete_kind(&mut a, BatchKind::Backup);
    let put = a.take_batches().pop().unwrap();
    let mut b = l3_cache(hybrid);
    let get = b.l3_fetch(None, &toks(), 4).unwrap().unwrap();
    (b, put, get)
}

#[test]
fn a_fetch_takes_host_slots_under_the_put_keys_and_lands_as_host_only_nodes() {
    let (mut b, put, get) = fetched(true);
    assert_eq!(get.kind, BatchKind::L3Get);
    assert_eq!(get.keys, put.keys, "the same objects, by the same names");
    let kv = &get.copies[0];
    assert_eq!((kv.src_tier, kv.dst_tier), (Tier::External, Tier::Host));
    assert_eq!(kv.src, (0..8).collect::<Vec<i64>>());
    assert_eq!(get.copies[1].pool, PoolKind::Mamba);
    let before = b.match_prefix(None, &toks());
    assert_eq!(
        (before.device_len, before.host_len),
        (0, 0),
        "invisible until it lands"
    );
    b.audit().unwrap();
    b.start(get.id).unwrap();
    b.complete(get.id).unwrap();
    let m = b.match_prefix(None, &toks());
    assert_eq!(
        (m.device_len, m.host_len),
        (0, 8),
        "a host hit, state included"
    );
    assert_eq!(b.stats.l3_landed_pages, 4);
    assert_eq!(b.node_hashes(m.host_node).unwrap(), &put.keys[..4]);
    b.audit().unwrap();
    // It loads back like any host hit.
    let lb = b
        .load_back(LoadTarget::Node(m.host_node), None, None)
        .unwrap();
    assert!(lb.is_some());
    b.audit().unwrap();
}

#[test]
fn a_partial_fetch_lands_its_leading_pages_and_gives_the_rest_back() {
    let (mut b, _, get) = fetched(false);
    b.start(get.id).unwrap();
    b.complete_l3(get.id, 2, false).unwrap();
    let m = b.match_prefix(None, &toks());
    assert_eq!(m.host_len, 4, "two pages of two tokens");
    assert_eq!(b.host_kv_pool().counts().tree, 2);
    assert_eq!(b.host_kv_pool().counts().owned, 0);
    b.audit().unwrap();
}

/// An events-on cache `b` with an `l3_get` of `toks()` (4 pages, a state when `hybrid`)
/// in flight, in namespace `ns`: its batch, started.
fn fetching_with_events(hybrid: bool, ns: Option<&str>) -> (Cache, TransferBatch) {
    let mut b = Cache::new(Config {
        events: true,
        ..l3_cache(hybrid).config.clone()
    })
    .unwrap();
    let get = b.l3_fetch(ns, &toks(), 4).unwrap().unwrap();
    b.start(get.id).unwrap();
    b.take_events().unwrap();
    (b, get)
}

#[test]
fn objects_the_store_lacks_are_announced_removed_from_external_in_their_namespace() {
    let (mut b, get) = fetching_with_events(true, Some("tenant"));
    // Pages 0 and 1 landed, page 2 was missing, page 3 was not read; the state was
    // corrupt (index 4, after the pages).
    b.complete_l3_gone(get.id, 2, false, &[2, 4, 2]).unwrap();
    let tenant = Some("tenant".to_owned());
    assert_eq!(
        b.take_events().unwrap(),
        vec![
            KvEvent::Removed {
                medium: Medium::External,
                namespace: tenant.clone(),
                hashes: vec![get.keys[2]],
            },
            KvEvent::StateRemoved {
                medium: Medium::External,
                namespace: tenant,
                hash: get.keys[3],
            },
        ],
        "one removal per object, duplicates once; nothing of a hybrid fetch lands \
         without its state"
    );
    assert_eq!(b.stats.l3_gone_objects, 2);
    assert_eq!(counts(&b), counts(&l3_cache(true)), "every slot back");
    b.audit().unwrap();
}

#[test]
fn gone_objects_are_counted_without_events_and_beside_landed_pages() {
    let (mut b, _, get) = fetched(false);
    b.start(get.id).unwrap();
    b.complete_l3_gone(get.id, 3, false, &[3]).unwrap();
    assert_eq!(b.stats.l3_gone_objects, 1);
    assert_eq!(
        b.match_prefix(None, &toks()).host_len,
        6,
        "three pages landed"
    );
    assert_eq!(b.event_counts(), (0, 0), "events off");
    b.audit().unwrap();
}

#[test]
fn gone_naming_no_object_or_a_landed_one_is_refused_and_changes_nothing() {
    for (hybrid, pages, state, gone) in [
        (false, 0, false, vec![4]), // four objects: 0..4
        (true, 0, false, vec![5]),  // four pages and the state: 0..5
        (false, 2, false, vec![1]), // page 1 landed
        (true, 4, true, vec![4]),   // the state landed
        (true, 4, false, vec![0, 9]),
    ] {
        let (mut b, get) = fetching_with_events(hybrid, None);
        let before = (counts(&b), b.stats.clone());
        let err = b.complete_l3_gone(get.id, pages, state, &gone).unwrap_err();
        assert!(
            matches!(err, Error::InvalidArgument { arg: "gone", .. }),
            "{err}"
        );
        assert_eq!((counts(&b), b.stats.clone()), before);
        assert!(b.take_events().unwrap().is_empty());
        b.audit().unwrap();
        // Still in flight: a right acknowledgement ends it.
        b.complete_l3_gone(get.id, 0, false, &[0]).unwrap();
        assert_eq!(b.stats.l3_gone_objects, 1);
        b.audit().unwrap();
    }
}

#[test]
fn a_hybrid_fetch_without_its_state_lands_nothing() {
    let (mut b, _, get) = fetched(true);
    b.start(get.id).unwrap();
    b.complete_l3(get.id, 4, false).unwrap();
    let m = b.match_prefix(None, &toks());
    assert_eq!(m.host_len, 0);
    assert_eq!(b.stats.l3_fetches_failed, 1);
    assert_eq!(counts(&b), counts(&l3_cache(true)), "every slot back");
    b.audit().unwrap();
}

#[test]
fn a_failed_or_abandoned_fetch_gives_everything_back_and_drops_a_new_root() {
    for abandon in [false, true] {
        let mut a = l3_cache(false);
        cached(&mut a, &toks());
        let mut b = l3_cache(false);
        let get = b.l3_fetch(Some("tenant"), &toks(), 4).unwrap().unwrap();
        assert_eq!(b.roots.named(), 1, "the fetch holds the namespace's root");
        b.audit().unwrap();
        if abandon {
            assert_eq!(b.abandon(get.id), Abandoned::Failed);
        } else {
            b.start(get.id).unwrap();
            b.fail(get.id).unwrap();
        }
        assert_eq!(b.roots.named(), 0, "nothing landed: the root goes");
        assert_eq!(counts(&b), counts(&l3_cache(false)));
        b.audit().unwrap();
    }
}

#[test]
fn pages_the_tree_gained_meanwhile_are_not_placed_twice() {
    let (mut b, _, get) = fetched(false);
    // The first three pages are computed and cached while the fetch is in flight.
    cached(&mut b, &toks()[..6]);
    b.start(get.id).unwrap();
    b.complete(get.id).unwrap();
    let m = b.match_prefix(None, &toks());
    assert_eq!(
        (m.device_len, m.host_len),
        (6, 2),
        "only the last page was placed"
    );
    assert_eq!(
        b.host_kv_pool().counts().tree,
        1,
        "its last page (the insert's backup waits)"
    );
    assert_eq!(
        b.host_kv_pool().counts().owned,
        3,
        "the backup's pages, not the fetch's"
    );
    b.audit().unwrap();
}

#[test]
fn a_fetch_with_nothing_to_take_takes_nothing() {
    let mut c = l3_cache(false);
    cached(&mut c, &toks());
    assert!(c.l3_fetch(None, &toks(), 0).unwrap().is_none());
    assert!(
        c.l3_fetch(None, &toks(), 4).unwrap().is_none(),
        "all four pages held"
    );
    let before = counts(&c);
    let err = c
        .l3_fetch(None, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 6)
        .unwrap_err();
    assert!(
        matches!(err, Error::InvalidArgument { arg: "pages", .. }),
        "{err}"
    );
    assert_eq!(counts(&c), before);
    c.audit().unwrap();
}

#[test]
fn complete_l3_refuses_a_batch_of_another_kind_and_changes_nothing() {
    let mut c = l3_cache(false);
    cached(&mut c, &toks());
    let backup = c.take_batches().pop().unwrap();
    c.start(backup.id).unwrap();
    let err = c.complete_l3(backup.id, 1, false).unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidArgument {
                arg: "batch_id",
                ..
            }
        ),
        "{err}"
    );
    assert!(c.batches().contains(backup.id), "still in flight");
    c.complete(backup.id).unwrap();
    c.audit().unwrap();
}

#[test]
fn the_l3_tier_is_refused_where_it_cannot_work_naming_l3() {
    let base = Config {
        kv_slots: 32,
        page_size: 2,
        host_kv_slots: 64,
        page_hashes: true,
        l3: true,
        ..Config::default()
    };
    let refused = [
        Config {
            host_kv_slots: 0,
            ..base.clone()
        },
        Config {
            mamba_slots: 4,
            ..base.clone()
        },
        Config {
            page_hashes: false,
            ..base.clone()
        },
        Config {
            swa_slots: 32,
            swa_window: 4,
            host_swa_slots: 32,
            ..base.clone()
        },
    ];
    for config in refused {
        let err = config.validate().unwrap_err();
        assert!(
            matches!(err, Error::InvalidArgument { arg: "l3", .. }),
            "{err}"
        );
    }
    assert_eq!(base.validate(), Ok(()));
    let mut c = Cache::new(Config { l3: false, ..base }).unwrap();
    let err = c.l3_fetch(None, &toks(), 1).unwrap_err();
    assert!(
        matches!(err, Error::InvalidArgument { arg: "l3", .. }),
        "{err}"
    );
}

#[test]
fn a_landed_put_announces_its_pages_and_state_on_the_external_medium() {
    use crate::cache::{KvEvent, Medium};
    let mut c = Cache::new(Config {
        events: true,
        ..l3_cache(true).config().clone()
    })
    .unwrap();
    cached(&mut c, &toks());
    complete_kind(&mut c, BatchKind::Backup);
    let put = c.take_batches().pop().unwrap();
    let external = |events: &[KvEvent]| {
        events
            .iter()
            .filter(|e| {
                matches!(
                    e,
                    KvEvent::Stored {
                        medium: Medium::External,
                        ..
                    } | KvEvent::StateStored {
                        medium: Medium::External,
                        ..
                    }
                )
            })
            .cloned()
            .collect::<Vec<_>>()
    };
    assert!(
        external(&c.take_events().unwrap()).is_empty(),
        "nothing before it lands"
    );
    c.start(put.id).unwrap();
    c.complete(put.id).unwrap();
    let hashes = chain(None, &toks(), 2);
    assert_eq!(
        external(&c.take_events().unwrap()),
        vec![
            KvEvent::Stored {
                medium: Medium::External,
                namespace: None,
                hashes: hashes.clone(),
                parent_hash: None,
                token_ids: toks(),
                block_size: 2,
            },
            KvEvent::StateStored {
                medium: Medium::External,
                namespace: None,
                hash: hashes[3],
            },
        ]
    );
    // A failed put announces nothing.
    let mut longer = toks();
    longer.extend([9, 10]);
    cached(&mut c, &longer);
    complete_kind(&mut c, BatchKind::Backup);
    let put = c.take_batches().pop().unwrap();
    c.start(put.id).unwrap();
    c.fail(put.id).unwrap();
    assert!(external(&c.take_events().unwrap()).is_empty());
    c.audit().unwrap();
}

/// A cache like [`l3_cache`] whose pages go to L3 only on host eviction, with
/// `host_kv_slots` host slots and `host_states` host state slots (hybrid when > 0).
fn evicting_cache(host_kv_slots: usize, host_states: usize) -> Cache {
    Cache::new(Config {
        kv_slots: 32,
        page_size: 2,
        mamba_slots: if host_states > 0 { 4 } else { 0 },
        host_kv_slots,
        host_mamba_slots: host_states,
        page_hashes: true,
        l3: true,
        l3_write: crate::config::L3Write::HostEviction,
        ..Config::default()
    })
    .unwrap()
}

/// Caches `toks`, lands its backup and demotes it: a host-only node. Returns the host
/// slots its backup wrote.
fn host_only(c: &mut Cache, toks: &[u32]) -> Vec<i64> {
    cached(c, toks);
    let backups = complete_kind(c, BatchKind::Backup);
    c.evict(toks.len(), 0);
    assert_eq!(c.match_prefix(None, toks).host_len, toks.len(), "demoted");
    backups[0].copies[0].dst.clone()
}

#[test]
fn under_host_eviction_a_landed_backup_offers_nothing() {
    let mut c = evicting_cache(64, 4);
    cached(&mut c, &toks());
    assert_eq!(complete_kind(&mut c, BatchKind::Backup).len(), 1);
    assert!(c.take_batches().is_empty(), "no l3_put after the backup");
    assert_eq!(c.stats.l3_puts, 0);
    c.audit().unwrap();
}

#[test]
fn host_eviction_writes_what_it_deletes_and_its_pages_drain_until_the_put_ends() {
    let mut c = evicting_cache(64, 4);
    let host_slots = host_only(&mut c, &toks());
    assert!(c.take_batches().is_empty());
    let out = c.evict_host(8, 1).unwrap();
    assert_eq!((out.kv_tokens, out.mamba_states), (8, 1));
    let puts = c.take_batches();
    assert_eq!(puts.len(), 1, "one l3_put of what the eviction deleted");
    let put = &puts[0];
    assert_eq!(put.kind, BatchKind::L3Put);
    let hashes = chain(namespace_seed(None, None).as_ref(), &toks(), 2);
    let mut keys = hashes.clone();
    keys.push(hashes[3]);
    assert_eq!(put.keys, keys, "its four pages, then its state");
    assert_eq!(
        put.copies[0].src, host_slots,
        "read from the deleted host slots"
    );
    assert_eq!(c.stats.l3_eviction_puts, 1);
    // The node is gone; its slots drain, pinned by the put, and are room on its way.
    assert_eq!(c.match_prefix(None, &toks()).host_len, 0);
    assert_eq!(c.host_kv_pool().counts().draining, 4);
    assert_eq!(c.host_mamba_pool().counts().draining, 1);
    assert_eq!(c.host_draining(), [4, 1]);
    c.audit().unwrap();
    c.start(put.id).unwrap();
    c.complete(put.id).unwrap();
    assert_eq!(c.stats.l3_puts_done, 1);
    assert_eq!(c.host_draining(), [0, 0]);
    assert_eq!(c.host_kv_pool().counts().free, 32);
    assert_eq!(c.host_mamba_pool().counts().free, 4);
    c.audit().unwrap();
}

#[test]
fn a_failed_eviction_put_frees_its_pages_and_leaves_nothing_behind() {
    let mut c = evicting_cache(64, 4);
    host_only(&mut c, &toks());
    c.evict_host(8, 1).unwrap();
    let put = c.take_batches().pop().unwrap();
    c.start(put.id).unwrap();
    c.fail(put.id).unwrap();
    assert_eq!(c.stats.l3_puts_failed, 1);
    assert_eq!(c.host_draining(), [0, 0]);
    assert_eq!(c.host_kv_pool().counts().free, 32);
    assert_eq!(c.host_mamba_pool().counts().free, 4);
    assert_eq!(
        c.match_prefix(None, &toks()).host_len,
        0,
        "a miss, never a retry"
    );
    assert!(c.take_batches().is_empty());
    c.audit().unwrap();
    // Abandoned before it started: the same.
    host_only(&mut c, &toks());
    c.evict_host(8, 1).unwrap();
    let put = c.take_batches().pop().unwrap();
    assert_eq!(c.abandon(put.id), Abandoned::Failed);
    assert_eq!(c.host_draining(), [0, 0]);
    assert_eq!(c.host_kv_pool().counts().free, 32);
    c.audit().unwrap();
}

#[test]
fn pages_fetched_from_the_store_are_not_written_back_on_eviction() {
    let mut c = evicting_cache(64, 0);
    let get = c.l3_fetch(None, &toks(), 4).unwrap().unwrap();
    c.start(get.id).unwrap();
    c.complete(get.id).unwrap();
    assert_eq!(c.match_prefix(None, &toks()).host_len, 8);
    c.evict_host(8, 0).unwrap();
    assert!(c.take_batches().is_empty(), "the store has them");
    assert_eq!(c.host_kv_pool().counts().free, 32, "freed at once");
    assert_eq!(c.host_draining(), [0, 0]);
    c.audit().unwrap();
}

#[test]
fn host_room_on_its_way_is_neither_made_twice_nor_waited_for_in_a_loop() {
    // Four host pages, held by two host-only prompts of two pages each.
    let mut c = evicting_cache(8, 0);
    host_only(&mut c, &[1, 2, 3, 4]);
    host_only(&mut c, &[5, 6, 7, 8]);
    assert_eq!(c.host_kv_pool().counts().free, 0);
    let other = [20, 21, 22, 23];
    // A fetch needs two host pages: the oldest prompt is deleted and written first;
    // its pages drain, so this round takes nothing.
    assert!(c.l3_fetch(None, &other, 2).unwrap().is_none());
    assert_eq!(c.stats.host_alloc_waits, 1);
    let puts = c.take_batches();
    assert_eq!(puts.len(), 1);
    assert_eq!(c.match_prefix(None, &[1, 2, 3, 4]).host_len, 0);
    assert_eq!(
        c.match_prefix(None, &[5, 6, 7, 8]).host_len,
        4,
        "not over-evicted"
    );
    // Asked again before the put ended: the room is on its way, nothing more goes.
    assert!(c.l3_fetch(None, &other, 2).unwrap().is_none());
    assert_eq!(c.stats.host_alloc_waits, 2);
    assert!(c.take_batches().is_empty());
    assert_eq!(c.match_prefix(None, &[5, 6, 7, 8]).host_len, 4);
    c.audit().unwrap();
    // The engine ran the put: the next round finds the room.
    c.start(puts[0].id).unwrap();
    c.complete(puts[0].id).unwrap();
    let get = c.l3_fetch(None, &other, 2).unwrap().unwrap();
    assert_eq!(c.match_prefix(None, &[5, 6, 7, 8]).host_len, 4);
    c.start(get.id).unwrap();
    c.complete(get.id).unwrap();
    assert_eq!(c.match_prefix(None, &other).host_len, 4);
    c.audit().unwrap();
}

#[test]
fn a_host_state_slot_on_its_way_is_waited_for_not_evicted_for_again() {
    // One host state slot, held by a host-only hybrid prompt.
    let mut c = evicting_cache(64, 1);
    host_only(&mut c, &[1, 2, 3, 4]);
    assert_eq!(c.host_mamba_pool().counts().free, 0);
    let other = [20, 21, 22, 23];
    assert!(c.l3_fetch(None, &other, 2).unwrap().is_none());
    let puts = c.take_batches();
    assert_eq!(puts.len(), 1, "the prompt and its state written first");
    assert_eq!(c.host_draining(), [2, 1]);
    let waits = c.stats.host_alloc_waits;
    assert!(c.l3_fetch(None, &other, 2).unwrap().is_none());
    assert_eq!(c.stats.host_alloc_waits, waits + 1);
    assert!(c.take_batches().is_empty());
    c.audit().unwrap();
    c.start(puts[0].id).unwrap();
    c.complete(puts[0].id).unwrap();
    let get = c.l3_fetch(None, &other, 2).unwrap().unwrap();
    c.start(get.id).unwrap();
    c.complete_l3(get.id, 2, true).unwrap();
    assert_eq!(c.match_prefix(None, &other).host_len, 4);
    c.audit().unwrap();
}

#[test]
fn l3_write_is_refused_without_an_l3_tier_or_with_an_unknown_name() {
    use crate::config::L3Write;
    let err = Config {
        l3_write: L3Write::HostEviction,
        ..Config::kv(16, 1)
    }
    .validate()
    .unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidArgument {
                arg: "l3_write",
                ..
            }
        ),
        "{err}"
    );
    for w in [L3Write::Backup, L3Write::HostEviction] {
        assert_eq!(w.as_str().parse::<L3Write>(), Ok(w));
    }
    let err = "eviction".parse::<L3Write>().unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidArgument {
                arg: "l3_write",
                ..
            }
        ),
        "{err}"
    );
}
