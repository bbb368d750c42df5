//! Unit tests of the KV component: LRU eviction, splits under locks, inserts, audit.

use crate::cache::*;
use crate::config::Config;
use crate::error::Error;

fn namespaces(c: &Cache) -> u64 {
    c.stats()
        .into_iter()
        .find(|&(k, _)| k == "namespaces")
        .map(|(_, v)| v)
        .unwrap()
}

#[test]
fn failed_insert_into_an_unseen_namespace_creates_no_root() {
    let mut c = Cache::new(Config::kv(16, 1)).unwrap();
    let slots = c.alloc_kv(2).unwrap().unwrap();
    let before = c.snapshot();
    // The same caller slot twice: refused when the pages are claimed.
    let err = c
        .insert(Some("a"), &[0, 0], &[slots[0], slots[0]], 0)
        .unwrap_err();
    assert!(matches!(
        err,
        Error::InvalidArgument {
            arg: "kv_indices",
            ..
        }
    ));
    assert_eq!(c.snapshot(), before, "a failed insert changed the tree");
    assert_eq!(namespaces(&c), 1);
    c.audit().unwrap();
    // A good insert still makes the namespace.
    let ins = c.insert(Some("a"), &[0, 1], &slots, 0).unwrap();
    assert_eq!(ins.prefix_len, 0);
    assert_eq!(namespaces(&c), 2);
    assert_eq!(c.match_prefix(Some("a"), &[0, 1]).kv_indices, slots);
    c.audit().unwrap();
}

fn cached(c: &mut Cache, toks: &[u32]) -> Insert {
    let m = c.match_prefix(None, toks);
    let ps = c.page_size();
    let rest = toks.len() - m.device_len;
    let got = c.alloc_kv(rest.div_ceil(ps) * ps).unwrap().unwrap();
    let mut kv = m.kv_indices.clone();
    kv.extend_from_slice(&got[..rest]);
    c.insert(None, toks, &kv, m.device_len).unwrap()
}

#[test]
fn lru_evicts_the_oldest_leaf_and_match_refreshes() {
    let mut c = Cache::new(Config::kv(16, 1)).unwrap();
    cached(&mut c, &[1, 1]);
    cached(&mut c, &[2, 2]);
    cached(&mut c, &[3, 3]);
    c.match_prefix(None, &[1, 1]);
    assert_eq!(c.evict(1, 0).kv_tokens, 2);
    assert_eq!(c.match_prefix(None, &[2, 2]).device_len, 0);
    assert_eq!(c.match_prefix(None, &[3, 3]).device_len, 2);
    assert_eq!(c.match_prefix(None, &[1, 1]).device_len, 2);
    // [3, 3] is now the oldest
    assert_eq!(c.evict(1, 0).kv_tokens, 2);
    assert_eq!(c.match_prefix(None, &[3, 3]).device_len, 0);
    c.audit().unwrap();
}

#[test]
fn a_parent_left_as_a_leaf_goes_in_the_same_pass_before_younger_leaves() {
    let mut c = Cache::new(Config::kv(32, 1)).unwrap();
    cached(&mut c, &[1, 2, 3]);
    cached(&mut c, &[1, 2, 4]); // splits: [1,2] -> {[3], [4]}
    cached(&mut c, &[9, 9]); // youngest
                             // Evicting 4 tokens takes [3], [4] and then their parent [1, 2] (older than
                             // [9, 9]), never the younger unrelated leaf.
    assert_eq!(c.evict(4, 0).kv_tokens, 4);
    assert_eq!(c.match_prefix(None, &[9, 9]).device_len, 2);
    assert_eq!(c.match_prefix(None, &[1, 2]).device_len, 0);
    c.audit().unwrap();
}

#[test]
fn alloc_that_cannot_succeed_evicts_nothing() {
    let mut c = Cache::new(Config::kv(8, 1)).unwrap();
    let ins = cached(&mut c, &[1, 2, 3, 4]);
    let lock = c.lock(ins.node).unwrap();
    cached(&mut c, &[5, 6]);
    // 2 free + 2 evictable < 6
    assert_eq!(c.alloc_kv(6).unwrap(), None);
    assert_eq!(
        c.match_prefix(None, &[5, 6]).device_len,
        2,
        "nothing was evicted"
    );
    // 2 free + 2 evictable == 4: evicts and succeeds
    assert_eq!(c.alloc_kv(4).unwrap().map(|v| v.len()), Some(4));
    c.unlock(lock).unwrap();
    c.audit().unwrap();
}

#[test]
fn split_under_a_lock_stays_balanced() {
    let mut c = Cache::new(Config::kv(16, 1)).unwrap();
    let ins = cached(&mut c, &[1, 2, 3, 4]);
    let lock = c.lock(ins.node).unwrap();
    // A match ending inside the locked node splits it.
    let m = c.match_prefix(None, &[1, 2, 9]);
    assert_eq!(m.device_len, 2);
    assert_eq!(c.protected_size(), 4);
    c.audit().unwrap();
    c.unlock(lock).unwrap();
    assert_eq!((c.protected_size(), c.evictable_size()), (0, 4));
    c.audit().unwrap();
}

#[test]
fn insert_frees_duplicates_and_the_unaligned_tail() {
    let mut c = Cache::new(Config::kv(32, 4)).unwrap();
    let a = c.alloc_kv(12).unwrap().unwrap();
    // 10 tokens: two whole pages cached, the third (tail) page freed.
    let ins = c
        .insert(None, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], &a[..10], 0)
        .unwrap();
    assert_eq!(ins.prefix_len, 0);
    assert_eq!((c.total_size(), c.available_kv()), (8, 24));
    // The same 8 tokens again with fresh slots: all duplicates, all freed.
    let b = c.alloc_kv(8).unwrap().unwrap();
    let ins = c.insert(None, &[1, 2, 3, 4, 5, 6, 7, 8], &b, 0).unwrap();
    assert_eq!(ins.prefix_len, 8);
    assert_eq!((c.total_size(), c.available_kv()), (8, 24));
    c.audit().unwrap();
}

#[test]
fn audit_catches_corrupted_books() {
    // Each corruption is one a bug could cause; audit must name it.
    type Corruption = (&'static str, fn(&mut Cache));
    let corruptions: [Corruption; 5] = [
        ("evictable/protected", |c| c.sizes.evictable_tokens += 1),
        ("eviction set", |c| c.lru.corrupt_kv()),
        ("lock count", |c| {
            let i = c.lru.sets()[0].first().map(|&(_, _, i)| i).unwrap();
            c.tree.node_mut(i).kv.lock += 1;
        }),
        ("pool marks", |c| {
            // a page marked as the tree's that no node holds: a leak
            let leaked = c.pools.kv.try_alloc(1).unwrap().into_tree();
            assert_eq!(leaked.len(), 1);
        }),
        ("device children", |c| {
            let root = c.roots.get(None).unwrap();
            c.tree.node_mut(root).device_children += 1;
        }),
    ];
    for (what, corrupt) in corruptions {
        let mut c = Cache::new(Config::kv(16, 1)).unwrap();
        cached(&mut c, &[1, 2, 3]);
        cached(&mut c, &[1, 2, 4]);
        c.audit().unwrap();
        corrupt(&mut c);
        let err = c.audit().unwrap_err();
        assert!(matches!(err, Error::Invariant(_)), "{what}: {err}");
        assert!(err.to_string().contains(what), "{what}: {err}");
    }
}

#[test]
fn audit_catches_a_backup_mark_on_a_node_backed_up_already() {
    // A node's KV is marked in flight to the host tier while the node holds its host
    // copy already (the mark would keep it protected for good).
    let config = Config {
        host_kv_slots: 16,
        ..Config::kv(16, 1)
    };
    let mut c = Cache::new(config).unwrap();
    cached(&mut c, &[1, 2, 3]);
    cached(&mut c, &[1, 2, 4]);
    c.audit().unwrap();
    let root = c.roots.get(None).unwrap();
    let &(_, inner) = c.tree.node(root).children.iter().next().unwrap();
    let host = c.pools.host_kv.try_alloc(2).unwrap().into_tree();
    let n = c.tree.node_mut(inner);
    n.kv.state = KvState::BackingUp;
    n.kv.host = Some(host);
    let err = c.audit().unwrap_err();
    assert!(err.to_string().contains("being backed up"), "{err}");
}
