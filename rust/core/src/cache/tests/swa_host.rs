//! Unit tests of the SWA component with the host tier: backups copy the SWA pages the
//! device pages have (and the full KV of those without), a write-back eviction keeps a
//! tombstone's full KV, load-backs restore the window and give every SWA page back when
//! released or failed, host eviction frees host SWA pages with their host pages.

use super::util::{cached, seq, stat};
use crate::cache::*;
use crate::config::WritePolicy;
use crate::error::Error;
use crate::ids::NodeId;

/// Window 2 in pages of 1, 64 slots everywhere (`host_swa`: host SWA slots).
fn swa_host(policy: WritePolicy, host_swa: usize) -> Cache {
    swa_host_kv(policy, host_swa, 64)
}

/// [`swa_host`] with `kv` device KV slots.
fn swa_host_kv(policy: WritePolicy, host_swa: usize, kv: usize) -> Cache {
    Cache::new(Config {
        host_kv_slots: 64,
        host_swa_slots: host_swa,
        write_policy: policy,
        swa_slots: 64,
        swa_window: 2,
        ..Config::kv(kv, 1)
    })
    .unwrap()
}

fn copy_of(b: &TransferBatch, pool: PoolKind) -> Option<&SlotCopy> {
    b.copies.iter().find(|c| c.pool == pool)
}

/// Runs every emitted batch to completion, auditing after each.
fn run_all(c: &mut Cache) -> Vec<TransferBatch> {
    let batches = c.take_batches();
    for b in &batches {
        c.start(b.id).unwrap();
        c.complete(b.id).unwrap();
        c.audit().unwrap();
    }
    batches
}

/// The host SWA pool adds up: free + cached + draining = capacity.
fn host_swa_adds_up(c: &Cache) {
    assert_eq!(
        stat(c, "host_swa_free_slots")
            + stat(c, "host_swa_cached_tokens")
            + stat(c, "host_swa_draining_slots"),
        stat(c, "host_swa_capacity_slots")
    );
}

/// `[1..4]` (a) and `[1..8]` (b below it), a an SWA tombstone (b locked meanwhile).
fn tombstone_above_leaf(c: &mut Cache) -> (NodeId, NodeId) {
    let a = cached(c, &seq(4)).node;
    let b = cached(c, &seq(8)).node;
    let keep = c.lock(b).unwrap();
    c.evict_swa(usize::MAX);
    c.unlock(keep).unwrap();
    assert_eq!(stat(c, "swa_tombstones"), 1);
    c.audit().unwrap();
    (a, b)
}

/// Write-back: `tombstone_above_leaf`, then both evicted (backed up and demoted).
fn both_on_host(host_swa: usize) -> (Cache, NodeId, NodeId) {
    on_host_with(swa_host(WritePolicy::WriteBack, host_swa))
}

fn on_host_with(mut c: Cache) -> (Cache, NodeId, NodeId) {
    let (a, b) = tombstone_above_leaf(&mut c);
    assert_eq!(c.evict(usize::MAX, 0).kv_tokens, 8);
    c.audit().unwrap();
    let batches = run_all(&mut c);
    assert_eq!(batches.len(), 2);
    assert_eq!(stat(&c, "demotions"), 2);
    (c, a, b)
}

#[test]
fn a_backup_copies_the_swa_pages_the_device_pages_have_only() {
    // Selective write-through backs up both nodes at the second insert; the tombstone
    // goes without SWA copies, the live node with one SWA slot per token.
    let mut c = swa_host(WritePolicy::WriteThroughSelective, 64);
    // One insert of [1..8], split at 4 by a match: both parts counted once.
    let b = cached(&mut c, &seq(8)).node;
    c.match_prefix(None, &seq(4));
    let keep = c.lock(b).unwrap();
    c.evict_swa(usize::MAX);
    c.unlock(keep).unwrap();
    assert_eq!(stat(&c, "swa_tombstones"), 1);
    assert!(c.take_batches().is_empty());
    c.audit().unwrap();
    cached(&mut c, &seq(8));
    let batches = c.take_batches();
    assert_eq!(batches.len(), 1);
    let b = &batches[0];
    let kv = copy_of(b, PoolKind::Kv).unwrap();
    let swa = copy_of(b, PoolKind::Swa).unwrap();
    assert_eq!(kv.src.len(), 8, "the tombstone's full KV is backed up too");
    assert_eq!((swa.src_tier, swa.dst_tier), (Tier::Device, Tier::Host));
    assert_eq!(swa.src.len(), 4, "only the live node's SWA pages");
    assert_eq!(swa.src.len(), swa.dst.len());
    assert!(swa.dst.iter().all(|&s| (0..64).contains(&s)));
    assert_eq!(stat(&c, "swa_backed_up_pages"), 4);
    c.audit().unwrap();
    host_swa_adds_up(&c);
    assert_eq!(
        stat(&c, "host_swa_draining_slots"),
        4,
        "the batch owns them"
    );
    c.start(b.id).unwrap();
    c.complete(b.id).unwrap();
    c.audit().unwrap();
    assert_eq!(stat(&c, "host_swa_cached_tokens"), 4);
    host_swa_adds_up(&c);
}

#[test]
fn a_failed_backup_gives_its_host_swa_pages_back() {
    let mut c = swa_host(WritePolicy::WriteThrough, 64);
    cached(&mut c, &seq(4));
    let b = c.take_batches().remove(0);
    assert_eq!(copy_of(&b, PoolKind::Swa).unwrap().src.len(), 4);
    c.start(b.id).unwrap();
    c.fail(b.id).unwrap();
    c.audit().unwrap();
    assert_eq!(stat(&c, "host_swa_free_slots"), 64);
    host_swa_adds_up(&c);
}

#[test]
fn write_back_evicts_an_swa_tombstone_with_its_full_kv_to_the_host() {
    // Failure class: out-of-window pages dropped instead of backed up under write-back.
    // The tombstone's KV must reach the host, so that a deeper match whose own window
    // is live can load it back.
    let (mut c, a, b) = both_on_host(64);
    assert_eq!(
        stat(&c, "host_kv_cached_tokens"),
        8,
        "the tombstone's KV too"
    );
    assert_eq!(stat(&c, "host_swa_cached_tokens"), 4, "the leaf's SWA only");
    assert_eq!(stat(&c, "kv_cached_tokens"), 0);
    host_swa_adds_up(&c);
    let m = c.match_prefix(None, &seq(8));
    assert_eq!((m.device_len, m.host_len, m.host_node), (0, 8, b));
    // The tombstone's own end has no window on any tier: no match ends there.
    let m = c.match_prefix(None, &seq(4));
    assert_eq!((m.device_len, m.host_len), (0, 0));
    // Loading b brings back a's KV and b's window.
    let rec = c
        .load_back(LoadTarget::Node(b), None, None)
        .unwrap()
        .unwrap();
    let batch = rec.batch().clone();
    let kv = copy_of(&batch, PoolKind::Kv).unwrap();
    let swa = copy_of(&batch, PoolKind::Swa).unwrap();
    assert_eq!(kv.src.len(), 8);
    assert_eq!((swa.src_tier, swa.dst_tier), (Tier::Host, Tier::Device));
    assert_eq!(swa.src.len(), 2, "the window's pages");
    c.audit().unwrap();
    c.commit_load(rec).unwrap();
    c.start(batch.id).unwrap();
    c.complete(batch.id).unwrap();
    c.audit().unwrap();
    assert_eq!(stat(&c, "swa_loaded_pages"), 2);
    let m = c.match_prefix(None, &seq(8));
    assert_eq!(m.device_len, 8);
    assert_eq!(m.node, b);
    let _ = a;
    c.audit().unwrap();
}

#[test]
fn a_load_back_to_a_node_without_a_live_window_is_called_off() {
    let (mut c, a, _) = both_on_host(64);
    let before = stat(&c, "swa_free_slots");
    assert!(c
        .load_back(LoadTarget::Node(a), None, None)
        .unwrap()
        .is_none());
    assert_eq!(stat(&c, "load_backs_called_off_swa"), 1);
    assert_eq!(stat(&c, "swa_free_slots"), before);
    c.audit().unwrap();
}

#[test]
fn a_released_load_back_gives_every_swa_page_back() {
    let (mut c, _, b) = both_on_host(64);
    let rec = c
        .load_back(LoadTarget::Node(b), None, None)
        .unwrap()
        .unwrap();
    assert_eq!(
        stat(&c, "swa_request_slots"),
        2,
        "the guard holds the window's pages"
    );
    c.audit().unwrap();
    c.cancel_load(rec);
    c.audit().unwrap();
    assert_eq!(stat(&c, "swa_free_slots"), 64);
    assert_eq!(stat(&c, "kv_free_slots"), 64);
}

#[test]
fn a_load_back_failed_after_commit_is_a_miss_and_gives_every_swa_page_back() {
    let (mut c, _, b) = both_on_host(64);
    let rec = c
        .load_back(LoadTarget::Node(b), None, None)
        .unwrap()
        .unwrap();
    let id = rec.id();
    c.start(id).unwrap();
    c.commit_load(rec).unwrap();
    // In flight: the SWA pages drain with their KV pages.
    assert_eq!(c.match_prefix(None, &seq(8)).device_len, 0);
    c.audit().unwrap();
    c.fail(id).unwrap();
    c.audit().unwrap();
    assert_eq!(stat(&c, "swa_free_slots"), 64);
    let m = c.match_prefix(None, &seq(8));
    assert_eq!((m.device_len, m.host_len, m.host_node), (0, 8, b));
}

#[test]
fn a_load_back_short_of_device_swa_pages_is_called_off_having_taken_nothing() {
    // Twice the KV pages: the caller holds every SWA page, so no SWA eviction can make
    // room, while the KV has room.
    let (mut c, _, b) = on_host_with(swa_host_kv(WritePolicy::WriteBack, 64, 128));
    let held = c.alloc_kv(64).unwrap().unwrap();
    assert_eq!(stat(&c, "swa_free_slots"), 0);
    let before = (stat(&c, "kv_free_slots"), stat(&c, "swa_free_slots"));
    assert!(c
        .load_back(LoadTarget::Node(b), None, None)
        .unwrap()
        .is_none());
    assert_eq!(stat(&c, "load_backs_called_off_swa"), 1);
    assert_eq!(
        (stat(&c, "kv_free_slots"), stat(&c, "swa_free_slots")),
        before
    );
    c.audit().unwrap();
    c.free_kv(&held).unwrap();
    c.audit().unwrap();
}

#[test]
fn host_eviction_frees_host_swa_pages_and_leaves_no_host_tombstone_leaf() {
    let (mut c, _, _) = both_on_host(64);
    // Evicting the live leaf leaves the tombstone a host-only leaf without a window: it
    // goes too.
    let out = c.evict_host(1, 0).unwrap();
    assert_eq!(out.kv_tokens, 8);
    assert_eq!(stat(&c, "nodes"), 0);
    assert_eq!(stat(&c, "host_swa_free_slots"), 64);
    c.audit().unwrap();
}

#[test]
fn a_leaf_short_of_host_swa_pages_is_not_backed_up_under_write_back() {
    // Two host SWA pages cannot hold the leaf's four: its backup would leave a host
    // tombstone leaf, so it is deleted instead; nothing leaks.
    let mut c = swa_host(WritePolicy::WriteBack, 2);
    cached(&mut c, &seq(4));
    assert_eq!(c.evict(usize::MAX, 0).kv_tokens, 4);
    assert!(c.take_batches().is_empty());
    assert_eq!(stat(&c, "swa_backup_skipped_pages"), 4);
    assert_eq!(stat(&c, "nodes"), 0);
    assert_eq!(stat(&c, "host_swa_free_slots"), 2);
    c.audit().unwrap();
}

#[test]
fn host_swa_slots_is_a_property_of_the_config() {
    let c = swa_host(WritePolicy::WriteThrough, 8);
    assert_eq!(c.config().host_swa_slots, 8);
    assert_eq!(stat(&c, "host_swa_capacity_slots"), 8);
    let e = Cache::new(Config {
        host_swa_slots: 0,
        ..c.config().clone()
    });
    assert!(matches!(
        e,
        Err(Error::InvalidArgument {
            arg: "host_swa_slots",
            ..
        })
    ));
}
