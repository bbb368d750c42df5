//! `audit()`: recomputes, from the tree alone, everything the cache keeps incrementally
//! and compares. The invariants are those of ARCHITECTURE.md §5 that apply to the
//! components present (KV: items 1, 2, 4 and 5).

use std::collections::BTreeSet;

use crate::cache::Cache;
use crate::error::{Error, Result};
use crate::pool::PageState;
use crate::tree::{Tree, NONE};

fn broken(msg: String) -> Result<()> {
    Err(Error::Invariant(msg))
}

pub(crate) fn audit(cache: &Cache) -> Result<()> {
    let v = cache.parts();
    let tree = v.tree;
    let ps = v.page_size;

    // 1. Slot conservation: the pool's own books, then every tree page is marked Tree
    //    exactly once and the count of Tree pages equals the pages the tree holds.
    let counts = v.kv_pool.audit()?;
    let states = v.kv_pool.snapshot_states();
    let mut seen = vec![false; states.len()];
    let mut tree_pages = 0usize;

    let expected_lock = expected_locks(tree, &v.locks, v.live_locks)?;

    let mut evictable = 0usize;
    let mut protected = 0usize;
    let mut candidates = BTreeSet::new();
    let mut reached = 0usize;
    for &root in &v.roots {
        let r = tree.node(root);
        if !r.live || !r.is_root() || !r.key.is_empty() {
            return broken(format!("root slot {root} is not a live, empty-keyed root"));
        }
        for i in tree.preorder(root) {
            reached += 1;
            check_node(tree, i, ps)?;
            let n = tree.node(i);
            if n.kv.lock != expected_lock[i as usize] {
                return broken(format!(
                    "node {} has lock count {}, but {} live receipts cover it",
                    tree.id(i),
                    n.kv.lock,
                    expected_lock[i as usize]
                ));
            }
            if let Some(pages) = &n.kv.device {
                for &p in pages {
                    match states.get(p as usize) {
                        Some(PageState::Tree) if !seen[p as usize] => seen[p as usize] = true,
                        other => {
                            return broken(format!(
                                "node {} holds kv page {p} whose pool state is {other:?} \
                                 (or that another node holds too)",
                                tree.id(i)
                            ))
                        }
                    }
                }
                tree_pages += pages.len();
                if !n.is_root() {
                    if n.kv.lock > 0 {
                        protected += n.key.len();
                    } else {
                        evictable += n.key.len();
                    }
                    if n.kv.lock == 0 && n.device_children == 0 {
                        candidates.insert((n.last_access, i));
                    }
                }
            }
            if n.kv.in_lru != candidates.contains(&(n.last_access, i)) {
                return broken(format!(
                    "node {} in_lru flag is {} but it {} an eviction candidate",
                    tree.id(i),
                    n.kv.in_lru,
                    if n.kv.in_lru { "is not" } else { "is" }
                ));
            }
        }
    }
    if reached != tree.live_nodes {
        return broken(format!(
            "{} live nodes, but {reached} are reachable from the roots",
            tree.live_nodes
        ));
    }
    if tree_pages != counts.tree {
        return broken(format!(
            "the tree holds {tree_pages} kv pages, the pool marks {} as the tree's",
            counts.tree
        ));
    }
    // 4. Sizes equal the sums over nodes.
    if (evictable, protected) != (v.evictable_tokens, v.protected_tokens) {
        return broken(format!(
            "evictable/protected sizes are {}/{}, the nodes sum to {evictable}/{protected}",
            v.evictable_tokens, v.protected_tokens
        ));
    }
    // 5. The eviction set is exactly the unlocked device leaves.
    if candidates != *v.kv_lru {
        return broken(format!(
            "the kv eviction set has {} entries, {} nodes are candidates",
            v.kv_lru.len(),
            candidates.len()
        ));
    }
    Ok(())
}

/// 4. Expected lock counts: each live receipt covers its node's path to the root.
fn expected_locks(tree: &Tree, receipts: &[u32], live: usize) -> Result<Vec<u32>> {
    if receipts.len() != live {
        return Err(Error::Invariant(format!(
            "{} receipts live, tally says {live}",
            receipts.len()
        )));
    }
    let mut expected = vec![0u32; tree.nodes.len()];
    for &i in receipts {
        if !tree.node(i).live {
            return Err(Error::Invariant(format!(
                "a live receipt points at dead node slot {i}"
            )));
        }
        let mut cur = i;
        while cur != NONE {
            expected[cur as usize] += 1;
            cur = tree.node(cur).parent;
        }
    }
    Ok(expected)
}

/// 2. Tree shape at one node.
fn check_node(tree: &Tree, i: u32, ps: usize) -> Result<()> {
    let n = tree.node(i);
    let id = tree.id(i);
    if !n.live {
        return broken(format!("dead node slot {i} is reachable"));
    }
    if !n.is_root() {
        if n.key.is_empty() || n.key.len() % ps != 0 {
            return broken(format!(
                "node {id} key of {} tokens is empty or not page-aligned",
                n.key.len()
            ));
        }
        if tree.child(n.parent, &n.key[..ps]) != Some(i) {
            return broken(format!(
                "node {id} is not its parent's child for its first page"
            ));
        }
    }
    if let Some(pages) = &n.kv.device {
        if pages.len() * ps != n.key.len() {
            return broken(format!(
                "node {id} has {} kv pages for {} tokens",
                pages.len(),
                n.key.len()
            ));
        }
    } else {
        return broken(format!("node {id} has no kv on any tier"));
    }
    let mut device_children = 0;
    for &(h, c) in &n.children {
        let child = tree.node(c);
        if !child.live || child.parent != i {
            return broken(format!(
                "node {id} lists child slot {c} whose parent link differs"
            ));
        }
        if h != Tree::hash_page(&child.key[..ps]) {
            return broken(format!(
                "node {id} keys child {} by a stale hash",
                tree.id(c)
            ));
        }
        if child.kv.device.is_some() {
            device_children += 1;
        }
    }
    if device_children != n.device_children {
        return broken(format!(
            "node {id} counts {} device children, has {device_children}",
            n.device_children
        ));
    }
    Ok(())
}
