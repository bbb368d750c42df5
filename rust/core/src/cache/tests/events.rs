//! Unit tests of the KV events: one per point where the tree changes (publish, device
//! eviction and demotion, a backup landing or failing, host eviction, a load-back
//! landing or failing, write-back settling, states on both tiers, external notes), each
//! also checking that an index rebuilt from the events equals the cache's contents.

#![allow(clippy::many_single_char_names)]

use std::collections::BTreeSet;

use super::util::put;
use crate::cache::*;
use crate::config::{Config, WritePolicy};
use crate::error::Error;
use crate::hashes::{self, PageHash};

/// A router's index: `(medium, namespace, hash)` of the pages and of the states.
#[derive(Default)]
struct Index {
    pages: BTreeSet<(Medium, Option<String>, PageHash)>,
    states: BTreeSet<(Medium, Option<String>, PageHash)>,
}

impl Index {
    /// Applies `events`; a page stored twice or removed while absent fails.
    fn apply(&mut self, events: &[KvEvent]) {
        for e in events {
            match e {
                KvEvent::Stored {
                    medium,
                    namespace,
                    hashes,
                    ..
                } => {
                    for h in hashes {
                        assert!(self.pages.insert((*medium, namespace.clone(), *h)), "{e:?}");
                    }
                }
                KvEvent::Removed {
                    medium,
                    namespace,
                    hashes,
                } => {
                    for h in hashes {
                        assert!(
                            self.pages.remove(&(*medium, namespace.clone(), *h)),
                            "{e:?}"
                        );
                    }
                }
                KvEvent::Cleared => {
                    self.pages.clear();
                    self.states.clear();
                }
                KvEvent::StateStored {
                    medium,
                    namespace,
                    hash,
                } => assert!(self.states.insert((*medium, namespace.clone(), *hash))),
                KvEvent::StateRemoved {
                    medium,
                    namespace,
                    hash,
                } => assert!(self.states.remove(&(*medium, namespace.clone(), *hash))),
            }
        }
    }

    /// Takes the cache's events, applies them, and checks the index against the cache;
    /// returns the events.
    fn sync(&mut self, c: &mut Cache) -> Vec<KvEvent> {
        let events = c.take_events().unwrap();
        self.apply(&events);
        let want = c.event_contents();
        assert_eq!(self.pages.iter().cloned().collect::<Vec<_>>(), want.pages);
        assert_eq!(self.states.iter().cloned().collect::<Vec<_>>(), want.states);
        c.audit().unwrap();
        events
    }
}

fn config(ps: usize) -> Config {
    Config {
        page_hashes: true,
        events: true,
        ..Config::kv(64, ps)
    }
}

fn host(policy: WritePolicy, mamba: bool) -> Cache {
    Cache::new(Config {
        host_kv_slots: 64,
        write_policy: policy,
        mamba_slots: if mamba { 4 } else { 0 },
        host_mamba_slots: if mamba { 4 } else { 0 },
        ..config(2)
    })
    .unwrap()
}

fn chain(toks: &[u32]) -> Vec<PageHash> {
    hashes::chain(None, toks, 2)
}

fn run_all(c: &mut Cache) {
    for b in c.take_batches() {
        c.start(b.id).unwrap();
        c.complete(b.id).unwrap();
    }
}

#[test]
fn an_insert_stores_its_new_pages_on_the_device_and_a_split_emits_nothing() {
    let mut c = Cache::new(config(2)).unwrap();
    let mut ix = Index::default();
    put(&mut c, None, &[1, 2, 3, 4]);
    let all = chain(&[1, 2, 3, 4]);
    assert_eq!(
        ix.sync(&mut c),
        vec![KvEvent::Stored {
            medium: Medium::Device,
            namespace: None,
            hashes: all.clone(),
            parent_hash: None,
            token_ids: vec![1, 2, 3, 4],
            block_size: 2,
        }]
    );
    // A branch splits [1, 2, 3, 4]: only the new pages are announced.
    put(&mut c, None, &[1, 2, 5, 6]);
    assert_eq!(
        ix.sync(&mut c),
        vec![KvEvent::Stored {
            medium: Medium::Device,
            namespace: None,
            hashes: chain(&[1, 2, 5, 6])[1..].to_vec(),
            parent_hash: Some(all[0]),
            token_ids: vec![5, 6],
            block_size: 2,
        }]
    );
    // Cached again: nothing new.
    put(&mut c, None, &[1, 2, 3, 4]);
    assert!(ix.sync(&mut c).is_empty());
    assert_eq!(stat(&c, "events_emitted"), 2);
    assert_eq!(stat(&c, "events_pending"), 0);
}

#[test]
fn events_wait_in_the_queue_oldest_first() {
    let mut c = Cache::new(config(2)).unwrap();
    put(&mut c, None, &[1, 2]);
    put(&mut c, None, &[3, 4]);
    assert_eq!(stat(&c, "events_pending"), 2);
    let events = c.take_events().unwrap();
    let first = |e: &KvEvent| match e {
        KvEvent::Stored { token_ids, .. } => token_ids[0],
        _ => 0,
    };
    assert_eq!(events.iter().map(first).collect::<Vec<_>>(), vec![1, 3]);
    assert!(c.take_events().unwrap().is_empty());
    assert_eq!(stat(&c, "events_pending"), 0);
}

#[test]
fn a_named_namespace_is_named_in_its_events() {
    let mut c = Cache::new(config(2)).unwrap();
    let mut ix = Index::default();
    put(&mut c, Some("lora"), &[1, 2]);
    let seed = hashes::namespace_seed(None, Some("lora"));
    match &ix.sync(&mut c)[..] {
        [KvEvent::Stored {
            namespace, hashes, ..
        }] => {
            assert_eq!(namespace.as_deref(), Some("lora"));
            assert_eq!(hashes, &hashes::chain(seed.as_ref(), &[1, 2], 2));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_device_eviction_removes_the_pages() {
    let mut c = Cache::new(config(2)).unwrap();
    let mut ix = Index::default();
    put(&mut c, None, &[1, 2, 3, 4]);
    ix.sync(&mut c);
    c.evict(4, 0);
    assert_eq!(
        ix.sync(&mut c),
        vec![KvEvent::Removed {
            medium: Medium::Device,
            namespace: None,
            hashes: chain(&[1, 2, 3, 4]),
        }]
    );
}

#[test]
fn a_backup_is_announced_on_the_host_when_it_lands_and_never_when_it_fails() {
    let mut c = host(WritePolicy::WriteThrough, false);
    let mut ix = Index::default();
    put(&mut c, None, &[1, 2, 3, 4]);
    ix.sync(&mut c);
    let b = c.take_batches();
    c.start(b[0].id).unwrap();
    assert!(
        ix.sync(&mut c).is_empty(),
        "in flight: nothing on the host yet"
    );
    c.complete(b[0].id).unwrap();
    assert_eq!(
        ix.sync(&mut c),
        vec![KvEvent::Stored {
            medium: Medium::Host,
            namespace: None,
            hashes: chain(&[1, 2, 3, 4]),
            parent_hash: None,
            token_ids: vec![1, 2, 3, 4],
            block_size: 2,
        }]
    );
    put(&mut c, None, &[5, 6]);
    ix.sync(&mut c);
    let b = c.take_batches();
    c.fail(b[0].id).unwrap();
    assert!(
        ix.sync(&mut c).is_empty(),
        "a failed backup announces nothing"
    );
}

#[test]
fn demotion_removes_the_device_copy_and_host_eviction_the_host_copy() {
    let mut c = host(WritePolicy::WriteThrough, false);
    let mut ix = Index::default();
    put(&mut c, None, &[1, 2, 3, 4]);
    run_all(&mut c);
    ix.sync(&mut c);
    c.evict(4, 0);
    let all = chain(&[1, 2, 3, 4]);
    assert_eq!(
        ix.sync(&mut c),
        vec![KvEvent::Removed {
            medium: Medium::Device,
            namespace: None,
            hashes: all.clone(),
        }]
    );
    c.evict_host(4, 0).unwrap();
    assert_eq!(
        ix.sync(&mut c),
        vec![KvEvent::Removed {
            medium: Medium::Host,
            namespace: None,
            hashes: all,
        }]
    );
}

#[test]
fn a_load_back_is_announced_when_its_copies_land_not_at_commit() {
    let mut c = host(WritePolicy::WriteThrough, false);
    let mut ix = Index::default();
    let node = put(&mut c, None, &[1, 2, 3, 4]);
    run_all(&mut c);
    c.evict(4, 0);
    ix.sync(&mut c);
    let rec = c
        .load_back(LoadTarget::Node(node), None, None)
        .unwrap()
        .unwrap();
    let id = rec.id();
    c.start(id).unwrap();
    c.commit_load(rec).unwrap();
    assert!(ix.sync(&mut c).is_empty(), "loading: not announced");
    c.complete(id).unwrap();
    assert_eq!(
        ix.sync(&mut c),
        vec![KvEvent::Stored {
            medium: Medium::Device,
            namespace: None,
            hashes: chain(&[1, 2, 3, 4]),
            parent_hash: None,
            token_ids: vec![1, 2, 3, 4],
            block_size: 2,
        }]
    );
}

#[test]
fn a_load_back_whose_copies_landed_before_commit_is_announced_at_commit() {
    let mut c = host(WritePolicy::WriteThrough, false);
    let mut ix = Index::default();
    let node = put(&mut c, None, &[1, 2]);
    run_all(&mut c);
    c.evict(2, 0);
    ix.sync(&mut c);
    let rec = c
        .load_back(LoadTarget::Node(node), None, None)
        .unwrap()
        .unwrap();
    let id = rec.id();
    c.start(id).unwrap();
    c.complete(id).unwrap();
    assert!(
        ix.sync(&mut c).is_empty(),
        "not committed: nothing published"
    );
    c.commit_load(rec).unwrap();
    assert_eq!(ix.sync(&mut c).len(), 1);
}

#[test]
fn a_failed_load_back_announces_nothing() {
    let mut c = host(WritePolicy::WriteThrough, false);
    let mut ix = Index::default();
    let node = put(&mut c, None, &[1, 2, 3, 4]);
    run_all(&mut c);
    c.evict(4, 0);
    ix.sync(&mut c);
    let rec = c
        .load_back(LoadTarget::Node(node), None, None)
        .unwrap()
        .unwrap();
    let id = rec.id();
    c.start(id).unwrap();
    c.commit_load(rec).unwrap();
    c.fail(id).unwrap();
    assert!(ix.sync(&mut c).is_empty());
    assert_eq!(c.match_prefix(None, &[1, 2, 3, 4]).host_len, 4);
}

#[test]
fn write_back_removes_the_device_pages_when_the_eviction_settles() {
    let mut c = host(WritePolicy::WriteBack, false);
    let mut ix = Index::default();
    put(&mut c, None, &[1, 2, 3, 4]);
    ix.sync(&mut c);
    assert_eq!(c.evict(4, 0).kv_tokens, 4);
    assert!(ix.sync(&mut c).is_empty(), "chosen, not settled");
    let b = c.take_batches();
    c.start(b[0].id).unwrap();
    c.complete(b[0].id).unwrap();
    let all = chain(&[1, 2, 3, 4]);
    assert_eq!(
        ix.sync(&mut c),
        vec![
            KvEvent::Stored {
                medium: Medium::Host,
                namespace: None,
                hashes: all.clone(),
                parent_hash: None,
                token_ids: vec![1, 2, 3, 4],
                block_size: 2,
            },
            KvEvent::Removed {
                medium: Medium::Device,
                namespace: None,
                hashes: all,
            },
        ]
    );
}

#[test]
fn states_are_announced_per_tier_at_their_nodes_last_page() {
    let mut c = host(WritePolicy::WriteThrough, true);
    let mut ix = Index::default();
    put(&mut c, None, &[1, 2, 3, 4]);
    let last = chain(&[1, 2, 3, 4])[1];
    let events = ix.sync(&mut c);
    assert_eq!(events.len(), 2);
    assert!(matches!(
        events[0],
        KvEvent::Stored {
            medium: Medium::Device,
            ..
        }
    ));
    assert_eq!(
        events[1],
        KvEvent::StateStored {
            medium: Medium::Device,
            namespace: None,
            hash: last,
        }
    );
    run_all(&mut c);
    let events = ix.sync(&mut c);
    assert!(events.contains(&KvEvent::StateStored {
        medium: Medium::Host,
        namespace: None,
        hash: last,
    }));
    // A tombstone: the state goes, the pages stay (they have a child).
    put(&mut c, None, &[1, 2, 3, 4, 5, 6]);
    ix.sync(&mut c);
    let m = c.match_prefix(None, &[1, 2, 3, 4]);
    let i = c.tree.resolve(m.node).unwrap();
    let mut out = Evicted::default();
    c.evict_state_of(i, &mut out);
    assert_eq!(
        ix.sync(&mut c),
        vec![KvEvent::StateRemoved {
            medium: Medium::Device,
            namespace: None,
            hash: last,
        }]
    );
}

#[test]
fn external_notes_are_queued_as_they_are_given() {
    let mut c = Cache::new(config(2)).unwrap();
    let h = chain(&[1, 2]);
    c.note_external_stored(Some("t"), h.clone(), None, vec![1, 2])
        .unwrap();
    c.note_external_removed(Some("t"), h.clone()).unwrap();
    assert_eq!(
        c.take_events().unwrap(),
        vec![
            KvEvent::Stored {
                medium: Medium::External,
                namespace: Some("t".to_owned()),
                hashes: h.clone(),
                parent_hash: None,
                token_ids: vec![1, 2],
                block_size: 2,
            },
            KvEvent::Removed {
                medium: Medium::External,
                namespace: Some("t".to_owned()),
                hashes: h.clone(),
            },
        ]
    );
    assert!(matches!(
        c.note_external_stored(None, h.clone(), None, vec![1]),
        Err(Error::InvalidArgument {
            arg: "token_ids",
            ..
        })
    ));
    let mut off = Cache::new(Config {
        page_hashes: true,
        ..Config::kv(64, 2)
    })
    .unwrap();
    assert!(matches!(
        off.note_external_removed(None, h),
        Err(Error::InvalidArgument { arg: "events", .. })
    ));
}

#[test]
fn with_events_off_nothing_is_queued_and_take_events_says_how_to_turn_them_on() {
    for page_hashes in [false, true] {
        let mut c = Cache::new(Config {
            page_hashes,
            ..Config::kv(64, 2)
        })
        .unwrap();
        put(&mut c, None, &[1, 2]);
        c.evict(2, 0);
        assert_eq!(stat(&c, "events_emitted"), 0);
        assert_eq!(stat(&c, "events_pending"), 0);
        let before = c.stats();
        match c.take_events() {
            Err(Error::InvalidArgument {
                arg: "events",
                reason,
            }) => assert!(
                reason.starts_with("take_events: the cache was built with events=False")
                    && reason.contains("page_hashes=True, events=True"),
                "{reason}"
            ),
            other => panic!("expected a refusal naming events, got {other:?}"),
        }
        assert_eq!(c.stats(), before, "a refused take_events changes nothing");
        c.audit().unwrap();
    }
}

#[test]
fn audit_catches_an_unannounced_change() {
    let mut c = Cache::new(config(2)).unwrap();
    let node = put(&mut c, None, &[1, 2]);
    let i = c.tree.resolve(node).unwrap();
    c.tree.node_mut(i).announced.device = false;
    let err = c.audit().unwrap_err();
    assert!(err.to_string().contains("events announced"), "{err}");
}

use super::util::stat;
