//! `audit()`: recomputes, from the tree, the requests, the load-backs and the batches
//! alone, everything the cache keeps incrementally, and compares. The invariants are
//! those of docs/contract.md, "Invariants": slot conservation per pool, device and host
//! (1), tree shape (2), Mamba placement on each tier (3), locks and sizes (4), eviction
//! sets, host included (5), host data and in-flight marks (6).

use std::collections::HashSet;

use crate::cache::components::mamba;
use crate::cache::eviction::{LruSet, HOT};
use crate::cache::load::CopyOutcome;
use crate::cache::report::POOLS;
use crate::cache::sizes::Sizes;
use crate::cache::{Cache, Payload, PoolKind, Tier};
use crate::config::EvictionPolicy;
use crate::error::{Error, Result};
use crate::pool::{PageState, PoolCounts};
use crate::tree::{Announced, StateMark, Tree, NONE};

impl Cache {
    /// Checks every invariant of docs/contract.md that applies (slot conservation,
    /// tree shape, lock counts and sizes, eviction candidates, host data, transfers in
    /// flight). Raises [`Error::Invariant`] naming the first broken one.
    pub fn audit(&self) -> Result<()> {
        audit(self)
    }
}

fn broken<T>(msg: String) -> Result<T> {
    Err(Error::Invariant(msg))
}

/// What the walk over the tree adds up.
#[derive(Default)]
struct Sums {
    sizes: Sizes,
    kv_candidates: LruSet,
    mamba_candidates: LruSet,
    host_candidates: LruSet,
    host_state_candidates: LruSet,
    reached: usize,
}

fn audit(c: &Cache) -> Result<()> {
    let tree = c.tree();
    let pools = [
        &c.pools().kv,
        &c.pools().mamba,
        &c.pools().host_kv,
        &c.pools().host_mamba,
    ];
    let mut counts = Vec::new();
    let mut states = Vec::new();
    for pool in pools {
        counts.push(pool.audit()?);
        states.push(pool.snapshot_states());
    }
    let mut seen: Vec<Vec<bool>> = states.iter().map(|s| vec![false; s.len()]).collect();
    let mut in_tree = [0usize; 4];
    let (expected_lock, expected_mamba_lock) = expected_locks(c)?;
    c.audit_components()?;

    let mut sums = Sums::default();
    let mut states_placed = 0;
    for root in check_roots(c)? {
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
            let holder = id.to_string();
            let state_pages = |slot: Option<u32>| slot.map(|s| vec![s]);
            let held = [
                (0, "kv page", n.kv.device.clone()),
                (1, "state slot", state_pages(n.mamba.device)),
                (2, "host kv page", n.kv.host.clone()),
                (3, "host state slot", state_pages(n.mamba.host)),
            ];
            for (k, what, pages) in held {
                for &p in pages.iter().flatten() {
                    claim(&states[k], &mut seen[k], p, what, &holder)?;
                    in_tree[k] += 1;
                }
            }
            check_states(c, i)?;
            states_placed += usize::from(n.mamba.device.is_some());
            check_marks(c, i)?;
            add_sizes(c, i, &mut sums);
            let (key, state_key) = (c.lru().kv_key(n), c.lru().state_key(tree, i));
            if n.kv.state.in_lru() != sums.kv_candidates.contains(&(key.0, key.1, i))
                || (n.mamba.mark == StateMark::Listed)
                    != sums
                        .mamba_candidates
                        .contains(&(state_key.0, state_key.1, i))
                || n.kv.state.in_host_lru() != sums.host_candidates.contains(&(key.0, key.1, i))
            {
                return broken(format!(
                    "node {id}: eviction-set flags (kv {}, mamba {}, host {}) disagree with \
                     what it is",
                    n.kv.state.in_lru(),
                    n.mamba.mark == StateMark::Listed,
                    n.kv.state.in_host_lru()
                ));
            }
        }
    }
    let mapped = c.state_nodes().iter().filter(|&&i| i != NONE).count();
    if mapped != states_placed {
        return broken(format!(
            "{mapped} state slots are mapped to nodes, {states_placed} nodes hold one"
        ));
    }
    if sums.reached != tree.live_nodes {
        return broken(format!(
            "{} live nodes, but {} are reachable from the roots",
            tree.live_nodes, sums.reached
        ));
    }
    // 1. Conservation: the tree's pages are exactly those marked the tree's, and the
    //    owned ones are exactly those requests and batches hold.
    let owned = owned_by_requests_and_batches(c)?;
    let names = [
        "kv_slots",
        "mamba_slots",
        "host_kv_slots",
        "host_mamba_slots",
    ];
    for k in 0..4 {
        conserve(names[k], counts[k], in_tree[k], owned[k])?;
    }
    let checks = [check_pins, check_loads];
    checks.iter().try_for_each(|check| check(c))?;
    check_sums(c, &sums)?;
    let checks = [check_hashes, check_expected, check_announced];
    checks.iter().try_for_each(|check| check(c))
}

/// `expect`'s marks: every node marked is one the eviction sets know as marked.
fn check_expected(c: &Cache) -> Result<()> {
    let listed: std::collections::HashSet<u32> = c.lru().expected().collect();
    for root in check_roots(c)? {
        for i in c.tree().preorder(root) {
            let rank = c.tree().node(i).expected;
            if rank != 0 && !listed.contains(&i) {
                return broken(format!(
                    "node {} is marked expected (rank {rank}), but `expect` did not mark it",
                    c.tree().id(i)
                ));
            }
        }
    }
    Ok(())
}

/// KV events: with them on, what was announced of every node is what it holds (every
/// change was announced); with them off, nothing was.
fn check_announced(c: &Cache) -> Result<()> {
    let tree = c.tree();
    for (_, root) in c.roots().all() {
        for i in tree.preorder(root).into_iter().skip(1) {
            let n = tree.node(i);
            let want = if c.config().events {
                mamba::announced(n)
            } else {
                Announced::default()
            };
            if n.announced != want {
                return broken(format!(
                    "node {}: events announced {:?}, it holds {want:?}",
                    tree.id(i),
                    n.announced
                ));
            }
        }
    }
    Ok(())
}

/// Page hashes: with them on, every root holds its namespace's seed and every node one
/// hash per page, the chain from its parent's last hash (recomputed); with them off, no
/// node holds any.
fn check_hashes(c: &Cache) -> Result<()> {
    let tree = c.tree();
    let on = c.config().page_hashes;
    for (ns, root) in c.roots().all() {
        if tree.node(root).hashes != c.root_hashes(ns) {
            return broken(format!(
                "the root of namespace {ns:?} does not hold the namespace's seed"
            ));
        }
        for i in tree.preorder(root).into_iter().skip(1) {
            let n = tree.node(i);
            let want = if on {
                let prior = tree.node(n.parent).hashes.last();
                crate::hashes::chain(prior, &n.key, tree.page_size)
            } else {
                Vec::new()
            };
            if n.hashes != want {
                return broken(format!(
                    "node {} holds {} page hashes that are not the chain from its parent \
                     ({} pages)",
                    tree.id(i),
                    n.hashes.len(),
                    n.key.len() / tree.page_size
                ));
            }
        }
    }
    Ok(())
}

/// 3. A state sits at the end of a node that has KV on the same tier; the node holding a
///    device state is the one the state's slot maps to, and it knows whether a transfer
///    pins the slot.
fn check_states(c: &Cache, i: u32) -> Result<()> {
    let n = c.tree().node(i);
    let id = c.tree().id(i);
    if n.mamba.device.is_some() && (n.kv.device.is_none() || n.is_root()) {
        return broken(format!("node {id} has a state but no device KV"));
    }
    if n.mamba.host.is_some() && n.kv.host.is_none() {
        return broken(format!("node {id} has a host state but no host KV"));
    }
    if n.mamba.device.is_none() && n.mamba.lock > 0 {
        return broken(format!("node {id} has a state lock but no state"));
    }
    if let Some(s) = n.mamba.device {
        if c.state_nodes().get(s as usize) != Some(&i) {
            return broken(format!("state slot {s} of node {id} is not mapped to it"));
        }
    }
    let pinned = n.mamba.device.is_some_and(|s| c.pools().mamba.pins(s) > 0);
    if (n.mamba.mark == StateMark::Pinned) != pinned {
        return broken(format!(
            "node {id} marks its state {:?}, the pool says pinned {pinned}",
            n.mamba.mark
        ));
    }
    Ok(())
}

/// Every root: live, keyless and stateless; a named namespace's holds something; the
/// shared empty root has no child. Returns them all, the empty one last.
fn check_roots(c: &Cache) -> Result<Vec<u32>> {
    let empty = c.roots().empty();
    if !c.tree().node(empty).children.is_empty() {
        return broken("the empty root (answer of unknown namespaces) has children".to_owned());
    }
    let mut out = Vec::new();
    for (ns, root) in c.roots().all().into_iter().chain([(None, empty)]) {
        let r = c.tree().node(root);
        if !r.live || !r.is_root() || !r.key.is_empty() || r.mamba.device.is_some() {
            return broken(format!(
                "root slot {root} is not a live, empty, stateless root"
            ));
        }
        if let Some(ns) = ns {
            if r.children.is_empty() && r.kv.lock == 0 {
                return broken(format!("namespace {ns:?} holds nothing but keeps its root"));
            }
        }
        out.push(root);
    }
    Ok(out)
}

/// 4 and 5: sizes and eviction sets equal what the walk added up.
fn check_sums(c: &Cache, sums: &Sums) -> Result<()> {
    // 4. Sizes equal the sums over nodes.
    let (got, want) = (&c.sizes(), &sums.sizes);
    if (want.evictable_tokens, want.protected_tokens)
        != (got.evictable_tokens, got.protected_tokens)
    {
        return broken(format!(
            "evictable/protected sizes are {}/{}, the nodes sum to {}/{}",
            got.evictable_tokens,
            got.protected_tokens,
            want.evictable_tokens,
            want.protected_tokens
        ));
    }
    if want.evicting_tokens != got.evicting_tokens {
        return broken(format!(
            "evicting tokens are {}, the nodes being evicted sum to {}",
            got.evicting_tokens, want.evicting_tokens
        ));
    }
    if (want.evictable_states, want.protected_states)
        != (got.evictable_states, got.protected_states)
    {
        return broken(format!(
            "evictable/protected states are {}/{}, the nodes sum to {}/{}",
            got.evictable_states,
            got.protected_states,
            want.evictable_states,
            want.protected_states
        ));
    }
    if want.host_tokens != got.host_tokens {
        return broken(format!(
            "host kv tokens are {}, the nodes sum to {}",
            got.host_tokens, want.host_tokens
        ));
    }
    if want.host_evictable != got.host_evictable {
        return broken(format!(
            "host evictable tokens are {}, the unlocked host-only nodes sum to {}",
            got.host_evictable, want.host_evictable
        ));
    }
    // 5. The eviction sets are exactly the candidates, each listed under the key its
    //    policy computes from the node now.
    let [kv, mamba, host, host_states] = c.lru().sets();
    let used = if c.lru().policy().mamba == EvictionPolicy::Lru {
        mamba.iter().filter(|k| k.0 & HOT != 0).count()
    } else {
        0
    };
    if c.lru().hot() != used {
        return broken(format!(
            "{} used states counted, {used} in the state eviction set",
            c.lru().hot()
        ));
    }
    for (name, set, candidates) in [
        ("kv", kv, &sums.kv_candidates),
        ("mamba", mamba, &sums.mamba_candidates),
        ("host", host, &sums.host_candidates),
        ("host state", host_states, &sums.host_state_candidates),
    ] {
        if set != candidates {
            let stale = set.difference(candidates).next();
            return broken(format!(
                "the {name} eviction set has {} entries, {} nodes are candidates{}",
                set.len(),
                candidates.len(),
                stale.map_or_else(String::new, |&(a, b, i)| format!(
                    " (node {} is listed under ({a}, {b}), its key is now {:?})",
                    c.tree().id(i),
                    if name == "mamba" {
                        c.lru().state_key(c.tree(), i)
                    } else {
                        c.lru().kv_key(c.tree().node(i))
                    }
                ))
            ));
        }
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
    let n = c.tree().node(i);
    sums.sizes += Sizes::of(n);
    if n.is_root() {
        return;
    }
    let (major, minor) = c.lru().kv_key(n);
    let key = (major, minor, i);
    if n.kv.host.is_some() && n.kv.device.is_none() && n.kv.lock == 0 && n.children.is_empty() {
        sums.host_candidates.insert(key);
        if n.mamba.host.is_some() {
            sums.host_state_candidates.insert(key);
        }
    }
    if n.kv.device.is_some()
        && n.kv.lock == 0
        && n.mamba.lock == 0
        && !n.kv.state.evicting()
        && !n.kv.state.backup_pending()
        && !n.mamba.backup_pending
        && n.device_children == n.evicting_children
    {
        sums.kv_candidates.insert(key);
    }
    let unpinned = n.mamba.device.is_some_and(|s| c.pools().mamba.pins(s) == 0);
    if unpinned && n.mamba.lock == 0 {
        let (major, minor) = c.lru().state_key(c.tree(), i);
        sums.mamba_candidates.insert((major, minor, i));
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

/// Pages held (as owned values) by requests, load-backs and batches, per pool (device
/// KV, device states, host KV, host states), each held once.
fn owned_by_requests_and_batches(c: &Cache) -> Result<[usize; 4]> {
    let mut owned = [0usize; 4];
    let mut seen = HashSet::new();
    let mut twice = None;
    c.holdings(|k, _, pages| {
        for &p in pages {
            if !seen.insert((k, p)) {
                twice.get_or_insert((k, p));
            }
        }
        owned[k] += pages.len();
    });
    if let Some((k, p)) = twice {
        return broken(format!("page {p} of pool {} is held twice", POOLS[k]));
    }
    for r in c.requests().iter() {
        if let Some(id) = r.load {
            if !c.loads().contains(id) {
                return broken(format!("a request waits on load-back {id}, which is gone"));
            }
        }
        // The request's prefix is locked by its receipt and ends at its node.
        let Some(lock) = &r.lock else {
            return broken("a live request holds no lock".to_owned());
        };
        if c.locked_node(lock.id()) != Some(r.node) {
            return broken("a request's receipt does not lock its node".to_owned());
        }
    }
    Ok(owned)
}

/// Every pin on a page belongs to a batch in flight, and the host room on its way is
/// what the eviction puts in flight hold.
fn check_pins(c: &Cache) -> Result<()> {
    check_host_draining(c)?;
    for pool in [PoolKind::Kv, PoolKind::Mamba] {
        for tier in [Tier::Device, Tier::Host] {
            let Some(p) = c.pools().of(pool, tier) else {
                continue;
            };
            let mut expected = vec![0u32; p.capacity_pages()];
            for pins in c
                .batches()
                .pins()
                .filter(|x| x.pool == pool && x.tier == tier)
            {
                for &s in &pins.pages {
                    expected[s as usize] += 1;
                }
            }
            let got = p.all_pins();
            if let Some(s) = (0..expected.len()).find(|&s| got[s] != expected[s]) {
                return broken(format!(
                    "{} {} page {s} has {} transfer pins, batches in flight account for {}",
                    tier.as_str(),
                    pool.as_str(),
                    got[s],
                    expected[s]
                ));
            }
        }
    }
    Ok(())
}

/// The host room on its way (`l3_write="host_eviction"`) is what the eviction puts in
/// flight free when they end, and no more than the host pools hold draining.
fn check_host_draining(c: &Cache) -> Result<()> {
    let mut want = [0usize; 2];
    for p in c.batches().payloads() {
        if let Payload::L3Put(put) = p {
            let [kv, states] = put.frees();
            want[0] += kv;
            want[1] += states;
        }
    }
    let got = c.host_draining();
    if got != want {
        return broken(format!(
            "host room on its way is {got:?} (kv pages, states), the eviction puts in flight \
             free {want:?}"
        ));
    }
    let draining = [
        c.pools().host_kv.counts().draining,
        c.pools().host_mamba.counts().draining,
    ];
    if got[0] > draining[0] || got[1] > draining[1] {
        return broken(format!(
            "host room on its way is {got:?} (kv pages, states), but only {draining:?} drain"
        ));
    }
    Ok(())
}

/// Load-backs: an uncommitted one has its batch pending unless the copies ended; a
/// committed one is in flight. Their requests point back at them.
fn check_loads(c: &Cache) -> Result<()> {
    for (id, load) in c.loads().iter() {
        let pending = c.batches().contains(*id);
        let in_flight = load.committed || load.copies == CopyOutcome::Pending;
        if pending != in_flight {
            return broken(format!(
                "load-back {id}: batch pending {pending}, but the load says {in_flight}"
            ));
        }
    }
    Ok(())
}

/// 6. In-flight marks: a node being loaded has device KV and nothing cached below it
///    but nodes of the same load; a node being backed up is locked.
fn check_marks(c: &Cache, i: u32) -> Result<()> {
    let n = c.tree().node(i);
    let id = c.tree().id(i);
    if n.kv.state.loading() && (n.kv.device.is_none() || n.kv.lock == 0) {
        return broken(format!("node {id} is loading without device KV or a lock"));
    }
    // A node whose KV is in flight is in no eviction set by construction (`KvState`);
    // one whose state is backed up must not be a KV candidate either.
    if n.mamba.backup_pending && n.kv.state.in_lru() {
        return broken(format!(
            "node {id} is being backed up but is an eviction candidate"
        ));
    }
    if n.kv.state.backup_pending() && (n.kv.device.is_none() || n.kv.host.is_some()) {
        return broken(format!(
            "node {id} is being backed up without device KV or with a host copy already"
        ));
    }
    if n.kv.state.evicting() && (n.kv.device.is_none() || n.kv.lock > 0) {
        return broken(format!(
            "node {id} is being evicted without device KV or locked"
        ));
    }
    if !n.is_root() {
        let p = c.tree().node(n.parent);
        if p.kv.state.loading() && n.kv.device.is_some() && !n.kv.state.loading() {
            return broken(format!(
                "node {id} has device KV below a node whose load is in flight"
            ));
        }
    }
    Ok(())
}

/// 4. Expected lock counts: each live receipt covers its node's path to the root, and
///    its node's state when it holds it.
fn expected_locks(c: &Cache) -> Result<(Vec<u32>, Vec<u32>)> {
    let tree = c.tree();
    let mut kv = vec![0u32; tree.nodes.len()];
    let mut mamba = vec![0u32; tree.nodes.len()];
    for l in c.locks().held() {
        let i = l.node;
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
    if n.kv.device.is_none() && n.kv.host.is_none() {
        return broken(format!("node {id} has no kv on any tier"));
    }
    for pages in [&n.kv.device, &n.kv.host].into_iter().flatten() {
        if pages.len() * ps != n.key.len() {
            return broken(format!(
                "node {id} has {} kv pages for {} tokens",
                pages.len(),
                n.key.len()
            ));
        }
    }
    if !n.is_root() && n.kv.device.is_some() && tree.node(n.parent).kv.device.is_none() {
        return broken(format!(
            "node {id} has device KV but its parent has none (device KV is prefix-closed)"
        ));
    }
    let mut device_children = 0;
    let mut evicting_children = 0;
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
            evicting_children += u32::from(child.kv.state.evicting());
        }
    }
    if evicting_children != n.evicting_children {
        return broken(format!(
            "node {id} counts {} device children being evicted, has {evicting_children}",
            n.evicting_children
        ));
    }
    if n.kv.state.evicting() && n.device_children != n.evicting_children {
        return broken(format!(
            "node {id} is being evicted but has a device child that is not"
        ));
    }
    if device_children != n.device_children {
        return broken(format!(
            "node {id} counts {} device children, has {device_children}",
            n.device_children
        ));
    }
    Ok(())
}
