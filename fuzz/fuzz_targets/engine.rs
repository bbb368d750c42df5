//! The `ops` target with engine-owned pools (`pools="engine"`; inputs whose first byte
//! is [`ENGINE_MODE`]): the same operations, read as an engine such as SGLang makes
//! them. A model engine allocator holds the free slots (every slot at first), the
//! harness's requests hold what it handed out (`AllocKv`/`AllocMamba` take from it,
//! `FreeKv`/`FreeMamba` give back to it), inserts hand over a request's slots (often
//! spoiled: a slot of the tree, of the queue, out of range, listed twice), evictions
//! hand slots back to the model engine, `Take` is `take_freed`, a `reset` queues every
//! slot the tree held (refused while a receipt holds it), and every call that
//! allocates from the cache's pools must be refused with `Error::EngineOwned`.
//!
//! What counts as a finding, besides a panic in the core and `audit()` failing after
//! any operation: conservation broken on a pool (model engine, requests, tree and queue
//! not every slot once, or the pool's counts disagreeing); `evict` returning anything
//! but exactly the pages and states that left the tree, or `take_freed` anything but
//! exactly the queue, or a slot the engine holds already (each slot is handed back
//! exactly once); a refused insert that changed something; a valid one refused; at the
//! end, once everything is evicted and taken, a slot that is not the engine's.

use std::collections::BTreeSet;

use radixcache_core::{Cache, Config, Error, LockReceipt, NodeId, PoolOwner, RequestId};

use super::{as_i64, ns_of, tok, Cfg, Corrupt, Op, Toks, MAX_HISTORY, MAX_NODES, SYSTEM};

/// The first input byte that selects engine-owned pools (any other: the cache's own).
pub const ENGINE_MODE: u8 = 0xE7;

/// Where the slots of one pool are, by the harness (pages for KV, slots for states).
#[derive(Default)]
struct Books {
    engine: BTreeSet<u32>,
    held: BTreeSet<u32>,
    queue: BTreeSet<u32>,
}

impl Books {
    fn new(n: usize) -> Books {
        Books {
            engine: (0..u32::try_from(n).unwrap_or(u32::MAX)).collect(),
            ..Books::default()
        }
    }

    /// Up to `n` slots from the engine to the requests (the lowest first).
    fn alloc(&mut self, n: usize) {
        for _ in 0..n {
            let Some(p) = self.engine.pop_first() else {
                return;
            };
            self.held.insert(p);
        }
    }

    /// Slots the cache handed back: none may be the engine's already.
    fn hand_back(&mut self, slots: &[u32], what: &str) {
        for &p in slots {
            assert!(
                !self.held.contains(&p) && !self.queue.contains(&p) && self.engine.insert(p),
                "{what} handed back slot {p}, which is not the tree's"
            );
        }
    }
}

/// The harness.
pub struct E {
    c: Cache,
    ps: usize,
    kv_pages: usize,
    states: usize,
    kv: Books,
    mamba: Books,
    nodes: Vec<NodeId>,
    receipts: Vec<LockReceipt>,
    history: Vec<Vec<u32>>,
    /// A cache that owns its pools, and a live request of it: the request calls must be
    /// refused before they look at the id.
    other: Cache,
    other_req: RequestId,
}

/// The device part of a cache-mode configuration: engine-owned pools have no host tier.
fn engine_config(cfg: &Cfg) -> Config {
    let base = super::config_of(cfg);
    Config {
        kv_slots: base.kv_slots,
        page_size: base.page_size,
        mamba_slots: base.mamba_slots,
        pools: PoolOwner::Engine,
        eviction_policy: base.eviction_policy,
        ..Config::default()
    }
}

/// A call that must be refused because the engine owns the slots.
#[track_caller]
fn engine_owned<T: std::fmt::Debug>(r: Result<T, Error>) {
    assert!(
        matches!(r, Err(Error::EngineOwned(_))),
        "expected the engine-owned refusal, got {r:?}"
    );
}

/// The pages of page-structured slots.
fn pages_of(slots: &[i64], ps: usize) -> Vec<u32> {
    assert!(
        slots.len().is_multiple_of(ps),
        "slots of part of a page: {slots:?}"
    );
    slots
        .chunks(ps)
        .map(|c| {
            let first = u32::try_from(c[0]).unwrap_or(u32::MAX);
            assert!(
                first as usize % ps == 0 && c.iter().zip(c[0]..).all(|(&a, b)| a == b),
                "not whole pages: {slots:?}"
            );
            first / u32::try_from(ps).unwrap_or(1)
        })
        .collect()
}

/// Slots for positions `from..len`, one page of `pages` per `ps` positions.
fn slots_for(pages: &[u32], from: usize, len: usize, ps: usize) -> Vec<i64> {
    let mut out = Vec::with_capacity(len - from);
    for (c, &p) in pages.iter().enumerate() {
        let base = i64::from(p) * as_i64(ps);
        let n = ps.min(len - (from + c * ps));
        out.extend((base..).take(n));
    }
    out
}

impl E {
    /// The harness, or `None` for a configuration the cache refuses.
    pub fn new(cfg: &Cfg) -> Option<E> {
        let c = Cache::new(engine_config(cfg)).ok()?;
        let (ps, kv_pages, states) = (
            c.page_size(),
            c.kv_pool().capacity_pages(),
            c.mamba_pool().capacity_pages(),
        );
        let mut other = Cache::new(Config::kv(4, 1)).ok()?;
        let other_req = other.admit(None, &[1]).ok()??;
        Some(E {
            c,
            ps,
            kv_pages,
            states,
            kv: Books::new(kv_pages),
            mamba: Books::new(states),
            nodes: Vec::new(),
            receipts: Vec::new(),
            history: Vec::new(),
            other,
            other_req,
        })
    }

    fn resolve(&self, t: &Toks) -> Vec<u32> {
        let k = usize::from(t.base / 16);
        let mut toks: Vec<u32> = match t.base % 16 {
            1..=4 => SYSTEM[usize::from(t.base % 16) - 1].to_vec(),
            5..=10 if !self.history.is_empty() => self.history[k % self.history.len()].clone(),
            _ => Vec::new(),
        };
        if t.cut.is_multiple_of(4) {
            toks.truncate(usize::from(t.cut / 4) % (toks.len() + 1));
        }
        toks.extend(t.tail.iter().map(|&b| tok(b)));
        toks.truncate(super::MAX_TOKENS);
        toks
    }

    fn remember(&mut self, toks: &[u32], node: NodeId) {
        super::push_ring(&mut self.history, toks.to_vec(), MAX_HISTORY);
        super::push_ring(&mut self.nodes, node, MAX_NODES);
    }

    /// The tree's KV pages and state slots, read back from `snapshot()`.
    fn tree(&self) -> (BTreeSet<u32>, BTreeSet<u32>) {
        let mut kv = BTreeSet::new();
        let mut states = BTreeSet::new();
        for n in self.c.snapshot() {
            for p in pages_of(n.kv_indices.as_deref().unwrap_or_default(), self.ps) {
                assert!(kv.insert(p), "page {p} twice in the tree");
            }
            if let Some(s) = n.mamba_slot {
                assert!(states.insert(s), "state {s} twice in the tree");
            }
        }
        (kv, states)
    }

    /// `audit()` of the cache.
    pub fn audit(&self) -> Result<(), Error> {
        self.c.audit()
    }

    /// Conservation on both pools: engine, requests, tree and queue hold every slot once,
    /// and the pools count them so.
    pub fn check(&self) {
        let (kv, states) = self.tree();
        for (name, books, tree, all, counts) in [
            (
                "kv",
                &self.kv,
                &kv,
                self.kv_pages,
                self.c.kv_pool().counts(),
            ),
            (
                "mamba",
                &self.mamba,
                &states,
                self.states,
                self.c.mamba_pool().counts(),
            ),
        ] {
            let parts = [&books.engine, &books.held, tree, &books.queue];
            let total: usize = parts.iter().map(|p| p.len()).sum();
            let union: BTreeSet<u32> = parts.iter().flat_map(|p| p.iter().copied()).collect();
            assert!(
                total == all && union.len() == all,
                "{name}: engine {} + requests {} + tree {} + queue {} is not every slot once \
                 ({all})",
                books.engine.len(),
                books.held.len(),
                tree.len(),
                books.queue.len()
            );
            assert_eq!(
                (
                    counts.caller,
                    counts.tree,
                    counts.free,
                    counts.owned,
                    counts.draining
                ),
                (
                    books.engine.len() + books.held.len(),
                    tree.len(),
                    books.queue.len(),
                    0,
                    0
                ),
                "{name}: the pool's counts differ from the books"
            );
        }
    }

    /// `evict`, checked: it returns exactly what left the tree, each slot once, and the
    /// engine takes it.
    fn evict(&mut self, kv_tokens: usize, states: usize) {
        let (kv_before, states_before) = self.tree();
        let out = self.c.evict(kv_tokens, states);
        let (kv_after, states_after) = self.tree();
        let pages = pages_of(&out.kv_indices, self.ps);
        let left: Vec<u32> = kv_before.difference(&kv_after).copied().collect();
        let mut sorted = pages.clone();
        sorted.sort_unstable();
        assert_eq!(
            sorted, left,
            "evict returned other pages than those that left the tree"
        );
        assert_eq!(out.kv_tokens, out.kv_indices.len());
        let mut got: Vec<u32> = out
            .mamba_slots
            .iter()
            .map(|&s| u32::try_from(s).unwrap_or(u32::MAX))
            .collect();
        got.sort_unstable();
        let left: Vec<u32> = states_before.difference(&states_after).copied().collect();
        assert_eq!(
            got, left,
            "evict returned other states than those that left the tree"
        );
        assert_eq!(out.mamba_states, got.len());
        self.kv.hand_back(&pages, "evict");
        self.mamba.hand_back(&got, "evict");
    }

    /// `reset`: refused with `Busy`, the tree unchanged, while a receipt holds it; else
    /// every page and state the tree held joins the queue (`take_freed` hands them back).
    fn reset(&mut self) {
        self.c.reap();
        let locked = self
            .c
            .stats()
            .into_iter()
            .any(|(k, v)| k == "live_locks" && v > 0);
        let (kv, states) = self.tree();
        match self.c.reset() {
            Ok(()) => {
                assert!(!locked, "a reset went through with a live lock");
                assert_eq!(self.tree(), (BTreeSet::new(), BTreeSet::new()));
                self.kv.queue.extend(kv);
                self.mamba.queue.extend(states);
            }
            Err(Error::Busy(_)) => {
                assert!(locked, "a reset refused an idle cache");
                assert_eq!(
                    self.tree(),
                    (kv, states),
                    "a refused reset changed the tree"
                );
            }
            Err(e) => panic!("reset: {e:?}"),
        }
    }

    fn take_freed(&mut self) {
        let (kv, states) = self.c.take_freed();
        let pages = pages_of(&kv, self.ps);
        let states: Vec<u32> = states
            .iter()
            .map(|&s| u32::try_from(s).unwrap_or(u32::MAX))
            .collect();
        for (name, got, books) in [("kv", &pages, &self.kv), ("mamba", &states, &self.mamba)] {
            let set: BTreeSet<u32> = got.iter().copied().collect();
            assert!(
                set.len() == got.len() && set == books.queue,
                "{name}: take_freed returned {got:?}, the queue is {:?}",
                books.queue
            );
        }
        self.kv.queue.clear();
        self.mamba.queue.clear();
        self.kv.hand_back(&pages, "take_freed");
        self.mamba.hand_back(&states, "take_freed");
    }

    /// An insert of a request's slots (spoiled as `bad` says): valid ones succeed and
    /// move the slots to the tree or the queue; refused ones change nothing.
    #[allow(clippy::too_many_arguments)]
    fn insert(
        &mut self,
        ns: u8,
        toks: &Toks,
        owned: u8,
        fresh: bool,
        state: u8,
        bad: Corrupt,
        seed: u8,
    ) {
        let ns = ns_of(ns);
        let t = self.resolve(toks);
        let ps = self.ps;
        let m = self.c.match_prefix(ns, &t);
        let mut owned_from = if fresh { 0 } else { m.device_len };
        if owned % 3 == 2 {
            owned_from = usize::from(seed) % (m.device_len / ps + 1) * ps;
        }
        let need = (t.len() - owned_from).div_ceil(ps);
        if self.kv.held.len() < need {
            self.kv.alloc(need - self.kv.held.len());
        }
        if self.kv.held.len() < need {
            // Short: evict for the next insert (not this one: its match may go).
            let short = need - self.kv.held.len();
            return self.evict(short * ps, 0);
        }
        let mut pages: Vec<u32> = self.kv.held.iter().copied().take(need).collect();
        let (tree_kv, tree_states) = self.tree();
        let pick = |set: &BTreeSet<u32>, k: u8| -> Option<u32> {
            (!set.is_empty()).then(|| *set.iter().nth(usize::from(k) % set.len()).unwrap_or(&0))
        };
        let mut kv_out_of_range = None;
        let mut valid = true;
        match bad {
            Corrupt::DupPage if pages.len() > 1 => {
                pages[1] = pages[0];
                valid = false;
            }
            Corrupt::TreeSlot(k) if !pages.is_empty() => {
                if let Some(p) = pick(&tree_kv, k) {
                    let at = usize::from(k) % pages.len();
                    pages[at] = p;
                    valid = false;
                }
            }
            Corrupt::Unowned(k, at) if !pages.is_empty() => {
                // A queued page, or (when none is) one the engine holds: the first is not
                // the engine's, the second is and may be claimed.
                let at = usize::from(at) % pages.len();
                if let Some(p) = pick(&self.kv.queue, k) {
                    pages[at] = p;
                    valid = false;
                } else if let Some(p) = pick(&self.kv.engine, k) {
                    pages[at] = p;
                }
            }
            Corrupt::OutOfRange(at, k) if !pages.is_empty() => {
                kv_out_of_range = Some((usize::from(at) % pages.len(), k));
                valid = false;
            }
            _ => {}
        }
        let mut kv = m.kv_indices[..owned_from].to_vec();
        kv.extend(slots_for(&pages, owned_from, t.len(), ps));
        if let Some((at, k)) = kv_out_of_range {
            let pos = (owned_from + at * ps).min(kv.len().saturating_sub(1));
            kv[pos] = if k % 2 == 0 {
                -1
            } else {
                as_i64(self.kv_pages * ps) + i64::from(k)
            };
        }
        let slot = match state % 4 {
            _ if self.states == 0 => None,
            1 => {
                if self.mamba.held.is_empty() {
                    self.mamba.alloc(1);
                }
                self.mamba.held.first().copied()
            }
            2 => {
                // The tree's state or a queued one: not the engine's.
                let s = pick(&tree_states, seed).or_else(|| pick(&self.mamba.queue, seed));
                valid &= s.is_none();
                s
            }
            3 => {
                valid = false;
                Some(u32::try_from(self.states).unwrap_or(u32::MAX) + u32::from(seed % 3))
            }
            _ => None,
        };
        let before = (
            self.c.snapshot(),
            self.c.kv_pool().counts(),
            self.c.mamba_pool().counts(),
        );
        let r = self
            .c
            .insert_with_state(ns, &t, &kv, owned_from, slot.map(i64::from));
        match r {
            Ok(ins) => {
                assert!(valid, "a spoiled insert succeeded: {ins:?}");
                let (kv_after, states_after) = self.tree();
                assert!(tree_kv.is_subset(&kv_after) && tree_states.is_subset(&states_after));
                for p in pages {
                    assert!(
                        self.kv.held.remove(&p) || self.kv.engine.remove(&p),
                        "insert claimed page {p}, which was not the engine's"
                    );
                    if !kv_after.contains(&p) {
                        assert!(self.kv.queue.insert(p), "page {p} queued twice");
                    }
                }
                if let Some(s) = slot {
                    assert!(self.mamba.held.remove(&s));
                    if !states_after.contains(&s) {
                        assert!(self.mamba.queue.insert(s), "state {s} queued twice");
                    }
                }
                self.remember(&t, ins.node);
            }
            Err(e) => {
                assert!(
                    !valid && matches!(e, Error::InvalidArgument { .. }),
                    "insert failed with {e:?} (valid: {valid})"
                );
                let after = (
                    self.c.snapshot(),
                    self.c.kv_pool().counts(),
                    self.c.mamba_pool().counts(),
                );
                assert!(after == before, "a refused insert changed something: {e}");
            }
        }
    }

    /// One of the calls that allocate from the cache's pools: refused, nothing changed.
    fn refused_call(&mut self, which: u8) {
        let before = (
            self.c.snapshot(),
            self.c.kv_pool().counts(),
            self.c.mamba_pool().counts(),
        );
        let id = self.other_req;
        let node = self.nodes.last().copied();
        match which % 12 {
            0 => engine_owned(self.c.alloc_kv(self.ps)),
            1 => engine_owned(self.c.free_kv(&[0])),
            2 => engine_owned(self.c.alloc_mamba()),
            3 => engine_owned(self.c.free_mamba(0)),
            4 => engine_owned(self.c.admit(None, &[1, 2])),
            5 => engine_owned(self.c.extend(id, &[1])),
            6 => engine_owned(self.c.extend_batch(&[id], &[1])),
            7 => engine_owned(self.c.checkpoint(id)),
            8 => engine_owned(self.c.finish(id)),
            9 => engine_owned(self.c.abort(id)),
            10 => {
                if let Some(n) = node {
                    engine_owned(self.c.load_back(
                        radixcache_core::LoadTarget::Node(n),
                        None,
                        None,
                    ));
                }
            }
            _ => engine_owned(self.c.evict_host(1, 1)),
        }
        let after = (
            self.c.snapshot(),
            self.c.kv_pool().counts(),
            self.c.mamba_pool().counts(),
        );
        assert!(after == before, "a refused call changed something");
    }

    pub fn step(&mut self, op: &Op) {
        match op {
            Op::Match { ns, toks } => {
                let t = self.resolve(toks);
                let m = self.c.match_prefix(ns_of(*ns), &t);
                let (kv, states) = self.tree();
                assert!(pages_of(&m.kv_indices, self.ps)
                    .iter()
                    .all(|p| kv.contains(p)));
                assert!(m.mamba_slot.is_none_or(|s| states.contains(&s)));
                self.remember(&t, m.node);
            }
            Op::Insert {
                ns,
                toks,
                owned,
                fresh,
                state,
                bad,
                seed,
            } => {
                self.insert(*ns, toks, *owned, *fresh, *state, *bad, *seed);
            }
            Op::AllocKv { n } => self.kv.alloc(usize::from(*n % 8)),
            Op::FreeKv { how, .. } => {
                for _ in 0..usize::from(*how % 4) {
                    if let Some(p) = self.kv.held.pop_last() {
                        self.kv.engine.insert(p);
                    }
                }
            }
            Op::AllocMamba => self.mamba.alloc(1),
            Op::FreeMamba { .. } => {
                if let Some(s) = self.mamba.held.pop_first() {
                    self.mamba.engine.insert(s);
                }
            }
            Op::Lock { node } => {
                if !self.nodes.is_empty() {
                    let id = self.nodes[usize::from(*node) % self.nodes.len()];
                    match self.c.lock(id) {
                        Ok(r) => super::push_ring(&mut self.receipts, r, super::MAX_RECEIPTS),
                        Err(e) => assert!(matches!(e, Error::StaleNode(_)), "lock: {e:?}"),
                    }
                }
            }
            Op::Unlock { pick } => {
                if !self.receipts.is_empty() {
                    let r = self
                        .receipts
                        .remove(usize::from(*pick) % self.receipts.len());
                    self.c
                        .unlock(r)
                        .unwrap_or_else(|e| panic!("unlock of a live receipt: {e}"));
                }
            }
            Op::DropReceipt { pick, reap } => {
                if !self.receipts.is_empty() {
                    drop(
                        self.receipts
                            .remove(usize::from(*pick) % self.receipts.len()),
                    );
                    if *reap {
                        self.c.reap();
                    }
                }
            }
            Op::Evict { kv, mamba } => self.evict(usize::from(*kv), usize::from(*mamba)),
            Op::Take | Op::Batch { .. } | Op::Commit { .. } => self.take_freed(),
            Op::Engine { mode, .. } | Op::Foreign { what: mode } => self.refused_call(*mode),
            Op::EvictHost { .. } => self.refused_call(11),
            Op::Admit { .. } => self.refused_call(4),
            Op::Extend { .. } | Op::ExtendBatch { .. } => self.refused_call(5),
            Op::Checkpoint { .. } | Op::Finish { .. } | Op::Abort { .. } => self.refused_call(7),
            Op::LoadBack { .. } | Op::Cancel { .. } | Op::DropLoad { .. } => self.refused_call(10),
            Op::Reap => self.c.reap(),
            Op::Reset => self.reset(),
            Op::Report { .. } => {
                let _ = (self.c.stats(), self.c.pretty(64, 8));
            }
            // No host tier, so no L3 tier: a fetch is refused naming `l3`.
            Op::L3Fetch { .. } | Op::L3Ack { .. } => {
                let r = self.c.l3_fetch(None, &[1, 2], 1);
                assert!(
                    matches!(
                        r,
                        Err(radixcache_core::Error::InvalidArgument { arg: "l3", .. })
                    ),
                    "l3_fetch without an L3 tier: {r:?}"
                );
            }
            // Engine-owned pools: the marks order what `evict` hands back.
            Op::Expect { prompts } => {
                let prompts: Vec<(u8, Vec<u32>)> = prompts
                    .iter()
                    .map(|(ns, toks)| (*ns, self.resolve(toks)))
                    .collect();
                let items: Vec<(Option<&str>, &[u32])> = prompts
                    .iter()
                    .map(|(ns, toks)| (ns_of(*ns), toks.as_slice()))
                    .collect();
                assert!(self.c.expect(&items) <= items.len());
            }
        }
    }

    /// Unlocks everything, evicts everything and takes the queue: every slot must be
    /// the engine's or a request's again, and nothing left in the tree.
    pub fn teardown(mut self) {
        for r in std::mem::take(&mut self.receipts) {
            self.c
                .unlock(r)
                .unwrap_or_else(|e| panic!("unlock at the end: {e}"));
        }
        self.evict(usize::MAX, usize::MAX);
        self.take_freed();
        self.c
            .audit()
            .unwrap_or_else(|e| panic!("audit at the end: {e}"));
        self.check();
        let (kv, states) = (self.c.kv_pool().counts(), self.c.mamba_pool().counts());
        assert!(
            kv.caller == self.kv_pages && states.caller == self.states,
            "a slot is not the engine's after evicting and taking everything: {kv:?} {states:?}"
        );
        self.other
            .abort(self.other_req)
            .unwrap_or_else(|e| panic!("abort: {e}"));
    }
}
