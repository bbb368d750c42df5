//! `audit()`: recomputes, from the tree, the requests and the batches alone, everything
//! the cache keeps incrementally, and compares. The invariants are those of
//! ARCHITECTURE.md §5 that apply to the components present: slot conservation per pool
//! (1), tree shape (2), Mamba placement (3), locks and sizes (4), eviction sets (5).

use std::collections::{BTreeSet, HashSet};

use crate::cache::batch::Action;
use crate::cache::Cache;
use crate::error::{Error, Result};
use crate::pool::{PageState, Pool, PoolCounts};
use crate::tree::{Tree, NONE};

fn broken<T>(msg: String) -> Result<T> {
    Err(Error::Invariant(msg))
}

/// What the walk over the tree adds up.
#[derive(Default)]
struct Sums {
    evictable: usize,
    protected: usize,
    evictable_states: usize,
    protected_states: usize,
    kv_candidates: BTreeSet<(u64, u32)>,
    mamba_candidates: BTreeSet<(u64, u32)>,
    reached: usize,
}

pub(crate) fn audit(c: &Cache) -> Result<()> {
    let tree = &c.tree;
    let kv_counts = c.kv_pool.audit()?;
    let mamba_counts = c.mamba_pool.audit()?;
    let kv_states = c.kv_pool.snapshot_states();
    let mamba_states = c.mamba_pool.snapshot_states();
    let mut kv_seen = vec![false; kv_states.len()];
    let mut mamba_seen = vec![false; mamba_states.len()];
    let (expected_lock, expected_mamba_lock) = expected_locks(c)?;

    let mut sums = Sums::default();
    let mut tree_pages = 0usize;
    let mut tree_states = 0usize;
    let roots: Vec<u32> = std::iter::once(c.default_root)
        .chain(c.named_roots.values().copied())
        .collect();
    for root in roots {
        let r = tree.node(root);
        if !r.live || !r.is_root() || !r.key.is_empty() || r.mamba.device.is_some() {
            return broken(format!(
                "root slot {root} is not a live, empty, stateless root"
            ));
        }
        for i in tree.preorder(root) {
            sums.reached += 1;
            check_node(tree, i, tree.page_size)?;
            let n = tree.node(i);
            let id = tree.id(i);
            if n.kv.lock != expected_lock[i as usize] {
                return broken(format!(
                    "node {id} has lock count {}, but {} live receipts cover it",
                    n.kv.lock, expected_lock[i as usize]
                ));
            }
            if n.mamba.lock != expected_mamba_lock[i as usize] {
                return broken(format!(
                    "node {id} has state lock count {}, but {} receipts hold its state",
                    n.mamba.lock, expected_mamba_lock[i as usize]
                ));
            }
            if let Some(pages) = &n.kv.device {
                for &p in pages {
                    claim(&kv_states, &mut kv_seen, p, "kv page", &id.to_string())?;
                }
                tree_pages += pages.len();
            }
            if let Some(slot) = n.mamba.device {
                claim(
                    &mamba_states,
                    &mut mamba_seen,
                    slot,
                    "state slot",
                    &id.to_string(),
                )?;
                tree_states += 1;
                // 3. A state sits at the end of a node that has device KV.
                if n.kv.device.is_none() || n.is_root() {
                    return broken(format!("node {id} has a state but no device KV"));
                }
            } else if n.mamba.lock > 0 {
                return broken(format!("node {id} has a state lock but no state"));
            }
            add_sizes(c, i, &mut sums);
            if n.kv.in_lru != sums.kv_candidates.contains(&(n.last_access, i))
                || n.mamba.in_lru != sums.mamba_candidates.contains(&(n.mamba.last_access, i))
            {
                return broken(format!(
                    "node {id}: eviction-set flags (kv {}, mamba {}) disagree with what it is",
                    n.kv.in_lru, n.mamba.in_lru
                ));
            }
        }
    }
    if sums.reached != tree.live_nodes {
        return broken(format!(
            "{} live nodes, but {} are reachable from the roots",
            tree.live_nodes, sums.reached
        ));
    }
    // 1. Conservation: the tree's pages are exactly those marked the tree's, and the
    //    owned ones are exactly those requests and batches hold.
    let (kv_owned, mamba_owned) = owned_by_requests_and_batches(c)?;
    conserve("kv_slots", kv_counts, tree_pages, kv_owned)?;
    conserve("mamba_slots", mamba_counts, tree_states, mamba_owned)?;
    check_pins(c, &c.mamba_pool, mamba_states.len())?;
    check_sums(c, &sums)
}

/// 4 and 5: sizes and eviction sets equal what the walk added up.
fn check_sums(c: &Cache, sums: &Sums) -> Result<()> {
    // 4. Sizes equal the sums over nodes.
    if (sums.evictable, sums.protected) != (c.evictable_tokens, c.protected_tokens) {
        return broken(format!(
            "evictable/protected sizes are {}/{}, the nodes sum to {}/{}",
            c.evictable_tokens, c.protected_tokens, sums.evictable, sums.protected
        ));
    }
    if (sums.evictable_states, sums.protected_states) != (c.evictable_states, c.protected_states) {
        return broken(format!(
            "evictable/protected states are {}/{}, the nodes sum to {}/{}",
            c.evictable_states, c.protected_states, sums.evictable_states, sums.protected_states
        ));
    }
    // 5. The eviction sets are exactly the candidates.
    if sums.kv_candidates != c.kv_lru {
        return broken(format!(
            "the kv eviction set has {} entries, {} nodes are candidates",
            c.kv_lru.len(),
            sums.kv_candidates.len()
        ));
    }
    if sums.mamba_candidates != c.mamba_lru {
        return broken(format!(
            "the mamba eviction set has {} entries, {} nodes are candidates",
            c.mamba_lru.len(),
            sums.mamba_candidates.len()
        ));
    }
    Ok(())
}

/// Marks page `p` as seen for a holder, which must be its only holder and the pool must
/// say the tree holds it.
fn claim(states: &[PageState], seen: &mut [bool], p: u32, what: &str, holder: &str) -> Result<()> {
    match states.get(p as usize) {
        Some(PageState::Tree) if !seen[p as usize] => {
            seen[p as usize] = true;
            Ok(())
        }
        other => broken(format!(
            "node {holder} holds {what} {p} whose pool state is {other:?} (or another node holds it too)"
        )),
    }
}

fn add_sizes(c: &Cache, i: u32, sums: &mut Sums) {
    let n = c.tree.node(i);
    if n.is_root() {
        return;
    }
    if n.kv.device.is_some() {
        if n.kv.lock > 0 {
            sums.protected += n.key.len();
        } else {
            sums.evictable += n.key.len();
        }
        if n.kv.lock == 0 && n.mamba.lock == 0 && n.device_children == 0 {
            sums.kv_candidates.insert((n.last_access, i));
        }
    }
    if n.mamba.device.is_some() {
        if n.mamba.lock > 0 {
            sums.protected_states += 1;
        } else {
            sums.evictable_states += 1;
            sums.mamba_candidates.insert((n.mamba.last_access, i));
        }
    }
}

fn conserve(name: &str, counts: PoolCounts, in_tree: usize, owned: usize) -> Result<()> {
    if in_tree != counts.tree {
        return broken(format!(
            "{name}: the tree holds {in_tree} pages, the pool marks {} as the tree's",
            counts.tree
        ));
    }
    if owned != counts.owned {
        return broken(format!(
            "{name}: requests and batches hold {owned} pages, the pool marks {} as owned",
            counts.owned
        ));
    }
    Ok(())
}

/// Pages held by requests (KV and states) and by batches (states they will publish),
/// each held once.
fn owned_by_requests_and_batches(c: &Cache) -> Result<(usize, usize)> {
    let mut kv = 0;
    let mut mamba = 0;
    let mut seen = HashSet::new();
    let mut hold = |pool: &'static str, pages: &[u32]| -> Result<()> {
        for &p in pages {
            if !seen.insert((pool, p)) {
                return broken(format!("{pool} page {p} is held twice"));
            }
        }
        Ok(())
    };
    for r in c.requests.iter() {
        hold("kv", r.kv.pages())?;
        kv += r.kv.len();
        if let Some(s) = &r.mamba {
            hold("mamba", s.pages())?;
            mamba += 1;
        }
        // The request's prefix is locked by its receipt and ends at its node.
        let Some(lock) = r.lock else {
            if r.prefix_len != 0 {
                return broken(format!(
                    "a request reuses {} tokens without a lock",
                    r.prefix_len
                ));
            }
            continue;
        };
        if c.lock_node(lock).ok() != Some(c.tree.id(r.node)) {
            return broken("a request's receipt does not lock its node".to_owned());
        }
    }
    for p in c.batches.pending.values() {
        if let Action::CheckpointCow { dst, .. } = &p.action {
            hold("mamba", dst.pages())?;
            mamba += dst.len();
        }
    }
    Ok((kv, mamba))
}

/// Every pin on a slot belongs to a batch in flight.
fn check_pins(c: &Cache, pool: &Pool, slots: usize) -> Result<()> {
    let mut expected = vec![0u32; slots];
    for p in c.batches.pending.values() {
        for &s in &p.mamba_pins {
            expected[s as usize] += 1;
        }
    }
    for (s, &want) in expected.iter().enumerate() {
        let got = pool.pins(crate::pool::page_u32(s));
        if got != want {
            return broken(format!(
                "mamba slot {s} has {got} transfer pins, batches in flight account for {want}"
            ));
        }
    }
    Ok(())
}

/// 4. Expected lock counts: each live receipt covers its node's path to the root, and
///    its node's state when it holds it.
fn expected_locks(c: &Cache) -> Result<(Vec<u32>, Vec<u32>)> {
    let tree = &c.tree;
    let live: Vec<_> = c.locks.iter().filter(|l| l.node.is_some()).collect();
    if live.len() != c.live_locks {
        return broken(format!(
            "{} receipts live, tally says {}",
            live.len(),
            c.live_locks
        ));
    }
    let mut kv = vec![0u32; tree.nodes.len()];
    let mut mamba = vec![0u32; tree.nodes.len()];
    for l in live {
        let Some(i) = l.node else { continue };
        if !tree.node(i).live {
            return broken(format!("a live receipt points at dead node slot {i}"));
        }
        if l.mamba {
            mamba[i as usize] += 1;
        }
        let mut cur = i;
        while cur != NONE {
            kv[cur as usize] += 1;
            cur = tree.node(cur).parent;
        }
    }
    Ok((kv, mamba))
}

/// 2. Tree shape at one node.
fn check_node(tree: &Tree, i: u32, ps: usize) -> Result<()> {
    let n = tree.node(i);
    let id = tree.id(i);
    if !n.live {
        return broken(format!("dead node slot {i} is reachable"));
    }
    if !n.is_root() {
        if n.key.is_empty() || !n.key.len().is_multiple_of(ps) {
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
    let Some(pages) = &n.kv.device else {
        return broken(format!("node {id} has no kv on any tier"));
    };
    if pages.len() * ps != n.key.len() {
        return broken(format!(
            "node {id} has {} kv pages for {} tokens",
            pages.len(),
            n.key.len()
        ));
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
