//! The cache: namespaces of radix trees over one set of pools.
//!
//! [`Cache`] is the single-threaded core (`&mut self` methods, owned lock receipts);
//! [`crate::HybridCache`] shares it between owners. Every node carries KV data (device
//! and host pages, a path lock count) and Mamba data (at most one state per tier, a
//! single-node lock count). The cache is split by responsibility, each part owning the
//! fields it changes (docs/design.md has the map):
//!
//! | file | owns | does |
//! |---|---|---|
//! | `copies.rs` | — (a leaf: names nothing of the cache) | the copy vocabulary: `SlotCopy`, `PoolKind`, `Tier`, `TransferBatch`, `BatchKind`, `Abandoned`, a batch's `Pins` |
//! | `results.rs` | — (a leaf) | the plain answers: `Match`, `Peek`, `Insert`, `Evicted`, `NodeInfo`, what a match found (`Found`), why a load-back was called off (`CallOff`) |
//! | `components/mod.rs` | the model | the `Component` trait, the list of components and the one macro that dispatches every hook over it: locks, splits, a request's share (admit, extend, checkpoint, finish), what a node keeps, backup and load-back copies, eviction of a node's data, audit |
//! | `components/cut.rs` | — | the match walk (`Cut`): every component of the model asked at each node of a matched path |
//! | `components/shares.rs` | — (a leaf) | what a request, an insert, a backup and a load-back hold or carry per component beyond the KV |
//! | `components/full.rs` | — | full attention (the tree's pages: the shared machinery's) |
//! | `components/mamba.rs` | the state-slot map | the Mamba component: its hooks; allocating, placing, evicting and freeing states |
//! | `components/swa.rs` | the window, the SWA eviction queue, dead leaves held during a device eviction | the sliding-window component: match cut (device and host), window locks, SWA backup copies, a request's window; its eviction in `components/swa/evict.rs` (tombstones, the queue), its `audit()` checks in `components/swa/audit.rs` |
//! | `mod.rs` | config, pools, the tree | construction, [`Cache::edit`] (every change to a node's data goes through it, as [`Parts::edit`]); what a component hook receives: [`Parts`], disjoint borrows of the fields a hook changes (nodes, pools, tallies, eviction sets, the components' books, stats), and [`View`], its read-only twin (the table in `components/mod.rs` says which hook gets which); the composition root: a batch's `Payload` names each client of the batches and `Cache::settle` hands it back |
//! | `namespaces.rs` | the roots | one tree per namespace |
//! | `sizes.rs` | evictable/protected/host tallies | what a node contributes |
//! | `eviction/` | the eviction sets, the clock, the marks of `expect` | which nodes eviction may take, in each policy's order (one file per policy), passing over what waiting requests need (`lookahead.rs`) |
//! | `locks.rs` | live receipts | path locks, owned [`LockReceipt`]s |
//! | `returns.rs` | the drop box | settles receipts and load records dropped unreleased |
//! | `lookup.rs` | (the probe scratch) | `match_prefix`, path walks, splits |
//! | `insert.rs` | — | `insert`, `publish`, placing pages on nodes |
//! | `hashing.rs` | — | page hashes of new nodes, `node_hashes`, `chain_hashes` |
//! | `events.rs` | the KV event queue | events for routers, emitted from `edit` |
//! | `evict.rs` | — | device eviction, demotion, host eviction, `take_freed` |
//! | `alloc.rs` | — | KV and host page allocation, evicting first when short (state slots: `components/mamba.rs`) |
//! | `batch.rs` | batches in flight | emit, pins, `start`/`complete`/`fail`, the books of batches in flight (names no client: an ended batch's payload goes to `Cache::settle`) |
//! | `host.rs` | — | backups to the host tier |
//! | `l3.rs` | — | pages put to and fetched from the L3 tier |
//! | `load.rs` | load-back records | `load_back`, commit, cancel, settle (through `request.rs` for the request) |
//! | `request.rs` | the request table | `admit`, `extend`, `abort`, the views of a request; `checkpoint` and `finish` in `request/checkpoint.rs`; moving a request to a load's target and back in `request/moves.rs` |
//! | `report.rs` | — | `stats`, `snapshot`, `pretty` |

mod alloc;
pub(crate) mod batch;
pub(crate) mod components;
pub(crate) mod copies;
mod events;
mod evict;
pub(crate) mod eviction;
mod hashing;
pub(crate) mod host;
mod insert;
pub(crate) mod l3;
pub(crate) mod load;
pub(crate) mod locks;
mod lookup;
mod namespaces;
pub(crate) mod report;
pub(crate) mod request;
mod reset;
mod results;
pub(crate) mod returns;
pub(crate) mod sizes;
#[cfg(test)]
mod tests;

use std::sync::Arc;

pub use components::{ComponentKind, Model};
pub use copies::{Abandoned, BatchKind, PoolKind, SlotCopy, Tier, TransferBatch};
pub use events::{EventContents, KvEvent, Medium};
pub use load::{LoadRecord, LoadTarget};
pub use locks::LockReceipt;
pub use request::{Grown, RequestView};
pub use results::{CallOff, Evicted, Insert, Match, NodeInfo, Peek};

use crate::config::Config;
use crate::error::Result;
use crate::ids::BatchId;
use crate::pool::{as_i64, Fault, Pool};
use crate::stats::Stats;
use crate::tree::{KvState, Node, Probe, Tree};

/// The four pools: device and host, KV and states.
pub(crate) struct Pools {
    /// Device KV pool (its pages paired with the device SWA pages, with SWA layers).
    pub kv: Pool,
    /// Device state pool (`page_size` 1; no pages for an attention-only model).
    pub mamba: Pool,
    /// Host-tier KV pool (no pages without a host tier; its pages paired with the host
    /// SWA pages, with SWA layers).
    pub host_kv: Pool,
    /// Host-tier state pool.
    pub host_mamba: Pool,
}

impl Pools {
    /// The pool a copy's slots index; `None` for the SWA pages, which are no pool of
    /// their own but the companions of a KV pool's pages (held by those pages' pins: a
    /// batch copying SWA pages copies their KV pages too).
    pub fn of(&self, pool: PoolKind, tier: Tier) -> Option<&Pool> {
        match (pool, tier) {
            (PoolKind::Kv, Tier::Device) => Some(&self.kv),
            (PoolKind::Kv, Tier::Host) => Some(&self.host_kv),
            (PoolKind::Mamba, Tier::Device) => Some(&self.mamba),
            (PoolKind::Mamba, Tier::Host) => Some(&self.host_mamba),
            (PoolKind::Swa, _) | (_, Tier::External) => None,
        }
    }
}

/// What a batch carries for the module that owns its kind, handed back to that module
/// when the batch ends (`complete` or `fail`, [`Cache::settle`]): `batch.rs` only keeps
/// it. Defined here, in the composition root, the one place that names every client of
/// the batches.
pub(crate) enum Payload {
    /// A copy-on-write of a state (`request.rs`).
    Cow(request::Cow),
    /// Device to host copies of the nodes on a path (`host.rs`).
    Backup(host::Backup),
    /// Host to device copies of a load-back: what it carries lives in `Cache::loads`
    /// under the batch's id (`load.rs`; gone when its guard was dropped uncommitted).
    LoadBack,
    /// Host pages written to the L3 tier (`l3.rs`).
    L3Put(l3::Put),
    /// Pages fetched from the L3 tier (`l3.rs`).
    L3Get(l3::Get),
}

impl Payload {
    /// The kind of batch that carries it.
    pub fn kind(&self) -> BatchKind {
        match self {
            Payload::Cow(_) => BatchKind::Cow,
            Payload::Backup(_) => BatchKind::Backup,
            Payload::LoadBack => BatchKind::LoadBack,
            Payload::L3Put(_) => BatchKind::L3Put,
            Payload::L3Get(_) => BatchKind::L3Get,
        }
    }
}

/// The single-threaded cache core.
///
/// Its fields are private to this module and its parts (the files of `cache/`), each part
/// changing only what it owns (the table above); `audit()` reads them through the
/// read-only views below.
pub struct Cache {
    config: Config,
    /// The components the model is made of.
    model: components::Model,
    tree: Tree,
    pools: Pools,
    roots: namespaces::Namespaces,
    sizes: sizes::Sizes,
    lru: eviction::Lru,
    swa: components::swa::Swa,
    locks: locks::Locks,
    returns: Arc<returns::Returns>,
    requests: request::Requests,
    batches: batch::Batches,
    loads: load::Loads,
    stats: Stats,
    /// Where the pools record an illegal page transition (shared by the four).
    fault: Arc<Fault>,
    /// The node holding each device state slot (`NONE`, or past the end: not in the
    /// tree). Grows with the slots used, like the pools' books.
    state_nodes: Vec<u32>,
    /// Scratch space of walks (kept to avoid an allocation per call).
    probe: Probe,
    /// KV events not yet taken (with `config.events`).
    events: events::Events,
    /// Host pages and host state slots freed by host eviction that its `l3_put`
    /// batches still read (`l3_write="host_eviction"`): room on its way, free once
    /// they end (`[kv pages, states]`).
    host_draining: [usize; 2],
}

/// The parts of the cache that a component hook works on: the nodes, the pools, the
/// tallies, the eviction sets, the components' own books and the stats, borrowed apart
/// from the rest ([`Cache::parts`]), so that a hook given them reaches no request, lock
/// receipt, batch or load-back, and cannot evict (the table in `components/mod.rs`
/// says which hooks get them). Changes to a node go through [`Parts::edit`], which does
/// what [`Cache::edit`] does (the same body, `edit_node`, and the same events).
pub(crate) struct Parts<'a> {
    config: &'a Config,
    tree: &'a mut Tree,
    pools: &'a mut Pools,
    roots: &'a namespaces::Namespaces,
    sizes: &'a mut sizes::Sizes,
    lru: &'a mut eviction::Lru,
    swa: &'a mut components::swa::Swa,
    stats: &'a mut Stats,
    state_nodes: &'a mut Vec<u32>,
    events: &'a mut events::Events,
}

/// What a component hook that only reads works on: the nodes, the pools, the eviction
/// sets and the components' own books, borrowed from the cache ([`Cache::view`]); the
/// read-only twin of [`Parts`].
pub(crate) struct View<'a> {
    config: &'a Config,
    tree: &'a Tree,
    pools: &'a Pools,
    lru: &'a eviction::Lru,
    swa: &'a components::swa::Swa,
}

impl Parts<'_> {
    /// [`Cache::expand_into`].
    #[inline]
    pub(crate) fn expand_into(&self, pages: &[u32], out: &mut Vec<i64>) {
        expand_into(self.config.page_size, pages, out);
    }

    /// Changes node `i` with `f`, keeping the size tallies right: the node's
    /// contribution is taken out before and put back after; with events on, the node's
    /// KV events follow (`events.rs`).
    // Always inlined: out of line, the hook calling it must lay its `Parts` out in
    // memory and every access goes through it (benches/instructions.py: admit +3%).
    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub(crate) fn edit<R>(&mut self, i: u32, f: impl FnOnce(&mut Node) -> R) -> R {
        let out = edit_node(self.tree, self.sizes, i, f);
        if self.config.events {
            self.events
                .announce(self.tree, self.roots, self.config.page_size, i);
        }
        out
    }

    /// Puts node `i` in or out of the eviction sets according to what it is now.
    #[inline]
    pub(crate) fn refresh(&mut self, i: u32) {
        self.lru.refresh(self.tree, i);
    }
}

impl std::fmt::Debug for Cache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.summary())
    }
}

impl Cache {
    /// A cache with the given configuration (validated; errors name the argument).
    pub fn new(config: Config) -> Result<Cache> {
        config.validate()?;
        // One record of illegal page transitions for the four pools: checking it once
        // covers them all.
        let fault = Arc::<Fault>::default();
        let owner = config.pools;
        let pool =
            |name, slots, page_size| Pool::with_fault(name, slots, page_size, fault.clone(), owner);
        let pools = Pools {
            kv: {
                let kv = pool("kv_slots", config.kv_slots, config.page_size)?;
                if config.has_swa() {
                    kv.with_companion("swa_slots", config.swa_slots)
                } else {
                    kv
                }
            },
            mamba: pool("mamba_slots", config.mamba_slots, 1)?,
            host_kv: {
                let host = pool("host_kv_slots", config.host_kv_slots, config.page_size)?;
                if config.host_swa_slots > 0 {
                    host.with_companion("host_swa_slots", config.host_swa_slots)
                } else {
                    host
                }
            },
            host_mamba: pool("host_mamba_slots", config.host_mamba_slots, 1)?,
        };
        // Up to three quarters of the state slots keep states that matches used.
        let hot_cap = config.mamba_slots * 3 / 4;
        let policy = config.eviction_policy;
        let swa = components::swa::Swa::new(config.swa_window, config.page_size);
        let mut tree = Tree::new(config.page_size);
        let roots = namespaces::Namespaces::new(&mut tree);
        if config.page_hashes {
            let seed = crate::hashes::namespace_seed(config.hash_seed.as_ref(), None);
            tree.node_mut(roots.read(None)).hashes = seed.into_iter().collect();
        }
        Ok(Cache {
            model: components::Model::of(&config),
            config,
            tree,
            pools,
            roots,
            sizes: sizes::Sizes::default(),
            lru: eviction::Lru::new(hot_cap, policy),
            swa,
            locks: locks::Locks::default(),
            returns: Arc::default(),
            requests: request::Requests::default(),
            batches: batch::Batches::default(),
            loads: load::Loads::default(),
            stats: Stats::default(),
            fault,
            state_nodes: Vec::new(),
            probe: Probe::default(),
            events: events::Events::default(),
            host_draining: [0; 2],
        })
    }

    /// The configuration the cache was built with.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        self.config.page_size
    }

    /// The device KV pool.
    pub fn kv_pool(&self) -> &Pool {
        &self.pools.kv
    }

    /// The device Mamba state pool (empty for an attention-only model).
    pub fn mamba_pool(&self) -> &Pool {
        &self.pools.mamba
    }

    /// The host-tier KV pool (empty without a host tier).
    pub fn host_kv_pool(&self) -> &Pool {
        &self.pools.host_kv
    }

    /// The host-tier state pool.
    pub fn host_mamba_pool(&self) -> &Pool {
        &self.pools.host_mamba
    }

    /// The first illegal page transition the cache's pools saw (a bug of radixcache: the
    /// transition was not made), if any. [`crate::HybridCache`] then refuses every call
    /// with [`crate::Error::Broken`], and `audit()` fails.
    pub fn fault(&self) -> Option<String> {
        self.pools.kv.fault()
    }

    /// The tree (read-only: for `audit()`).
    pub(crate) fn tree(&self) -> &Tree {
        &self.tree
    }

    /// The pools (read-only: for `audit()`).
    pub(crate) fn pools(&self) -> &Pools {
        &self.pools
    }

    /// The roots (read-only: for `audit()`).
    pub(crate) fn roots(&self) -> &namespaces::Namespaces {
        &self.roots
    }

    /// The size tallies (read-only: for `audit()`).
    pub(crate) fn sizes(&self) -> &sizes::Sizes {
        &self.sizes
    }

    /// The eviction sets (read-only: for `audit()`).
    pub(crate) fn lru(&self) -> &eviction::Lru {
        &self.lru
    }

    /// The live lock receipts (read-only: for `audit()`).
    pub(crate) fn locks(&self) -> &locks::Locks {
        &self.locks
    }

    /// The request table (read-only: for `audit()`).
    pub(crate) fn requests(&self) -> &request::Requests {
        &self.requests
    }

    /// The batches in flight (read-only: for `audit()`).
    pub(crate) fn batches(&self) -> &batch::Batches {
        &self.batches
    }

    /// The load-back records (read-only: for `audit()`).
    pub(crate) fn loads(&self) -> &load::Loads {
        &self.loads
    }

    /// The node holding each device state slot (read-only: for `audit()`).
    pub(crate) fn state_nodes(&self) -> &[u32] {
        &self.state_nodes
    }

    /// Whether [`Cache::fault`] has anything to say (one atomic load).
    #[inline]
    pub(crate) fn faulted(&self) -> bool {
        self.fault.is_set()
    }

    /// True when the model has Mamba layers (`mamba_slots > 0`): matches are then cut
    /// at the deepest node with a state.
    pub fn is_hybrid(&self) -> bool {
        self.config.mamba_slots > 0
    }

    /// True when the engine's allocators own the device slots (`pools="engine"`).
    pub fn engine_owned(&self) -> bool {
        self.config.pools == crate::config::PoolOwner::Engine
    }

    /// Refuses `call` when the engine owns the slots: it would allocate from the cache's
    /// pools or give slots back to them ([`Error::EngineOwned`]).
    pub(crate) fn cache_owned(&self, call: &'static str) -> Result<()> {
        if self.engine_owned() {
            return Err(crate::error::Error::EngineOwned(call));
        }
        Ok(())
    }

    /// True when the cache has a host tier for KV.
    pub(crate) fn has_host_tier(&self) -> bool {
        self.config.host_kv_slots > 0
    }

    /// `n` rounded down to whole pages.
    pub(crate) fn aligned(&self, n: usize) -> usize {
        n / self.config.page_size * self.config.page_size
    }

    /// Changes node `i` with `f`, keeping the size tallies right: the node's
    /// contribution is taken out before and put back after. Every change to what a node
    /// holds or to its lock counts goes through here or through [`Parts::edit`]; with
    /// events on, so does every KV event (`events.rs`).
    pub(crate) fn edit<R>(&mut self, i: u32, f: impl FnOnce(&mut Node) -> R) -> R {
        let out = edit_node(&mut self.tree, &mut self.sizes, i, f);
        if self.config.events {
            self.events
                .announce(&mut self.tree, &self.roots, self.config.page_size, i);
        }
        out
    }

    /// What a read-only component hook reads (see [`View`]).
    #[inline]
    pub(crate) fn view(&self) -> View<'_> {
        View {
            config: &self.config,
            tree: &self.tree,
            pools: &self.pools,
            lru: &self.lru,
            swa: &self.swa,
        }
    }

    /// The parts of the cache a component hook works on (see [`Parts`]).
    #[inline]
    pub(crate) fn parts(&mut self) -> Parts<'_> {
        Parts {
            config: &self.config,
            tree: &mut self.tree,
            pools: &mut self.pools,
            roots: &self.roots,
            sizes: &mut self.sizes,
            lru: &mut self.lru,
            swa: &mut self.swa,
            stats: &mut self.stats,
            state_nodes: &mut self.state_nodes,
            events: &mut self.events,
        }
    }

    /// Moves node `i`'s KV state to `f` of it (a transfer or eviction starts or ends).
    /// A node entering one leaves its eviction set first (see [`KvState`]); one leaving
    /// it is listed again by the next [`Cache::refresh`].
    pub(crate) fn mark_kv(&mut self, i: u32, f: impl FnOnce(KvState) -> KvState) {
        let old = self.tree.node(i).kv.state;
        let new = f(old);
        if new == old {
            return;
        }
        match old {
            KvState::Listed => self.lru.unlist_kv(&mut self.tree, i),
            KvState::HostListed => self.lru.unlist_host(&mut self.tree, i),
            _ => {}
        }
        self.edit(i, |n| n.kv.state = new);
    }

    /// Puts node `i` in or out of the eviction sets according to what it is now.
    pub(crate) fn refresh(&mut self, i: u32) {
        self.lru.refresh(&mut self.tree, i);
    }

    /// Marks node `i` as accessed now; `hit`: used by a match (counted).
    pub(crate) fn touch(&mut self, i: u32, hit: bool) {
        self.lru.touch(&mut self.tree, i, hit);
    }

    /// Raises node `i`'s priority to at least `priority`.
    pub(crate) fn raise_priority(&mut self, i: u32, priority: i64) {
        self.lru.raise_priority(&mut self.tree, i, priority);
    }

    /// Marks node `i`'s state as accessed now: used by a match (`hit`), or just cached.
    pub(crate) fn touch_state(&mut self, i: u32, hit: bool) {
        self.lru.touch_state(&mut self.tree, i, hit);
    }

    /// Appends the slots of KV pages `pages` to `out`.
    #[inline]
    pub(crate) fn expand_into(&self, pages: &[u32], out: &mut Vec<i64>) {
        expand_into(self.config.page_size, pages, out);
    }

    /// Hands an ended batch's payload back to the module that owns it, with whether
    /// the copies landed.
    pub(crate) fn settle(&mut self, id: BatchId, payload: Payload, landed: bool) {
        match payload {
            Payload::Cow(cow) => self.cow_ended(id, cow, landed),
            Payload::Backup(b) => self.backup_ended(b, landed),
            Payload::LoadBack => self.load_ended(id, landed),
            Payload::L3Put(put) => self.l3_put_ended(put, landed),
            Payload::L3Get(get) => {
                let pages = if landed { usize::MAX } else { 0 };
                self.l3_get_ended(get, pages, landed, &[]);
            }
        }
        self.count_ended(landed);
    }

    /// Hands an `l3_get` batch's payload back to `l3.rs`, its first `pages` pages and
    /// (`state`) the state landed, the objects at `gone` missing from the store (a
    /// payload of another kind: nothing to do, `batch.rs` refused it before).
    pub(crate) fn settle_part(
        &mut self,
        payload: Payload,
        pages: usize,
        state: bool,
        gone: &[usize],
    ) {
        if let Payload::L3Get(get) = payload {
            self.l3_get_ended(get, pages, state, gone);
        }
    }
}

/// Appends the slots of KV pages `pages` (of `ps` tokens) to `out`.
fn expand_into(ps: usize, pages: &[u32], out: &mut Vec<i64>) {
    if ps == 1 {
        out.extend(pages.iter().map(|&p| i64::from(p)));
    } else {
        // Filled page by page in place: the inner loop over a fixed-size chunk
        // vectorises, where extending from a range per page does not.
        let start = out.len();
        out.resize(start + pages.len() * ps, 0);
        for (chunk, &p) in out[start..].chunks_exact_mut(ps).zip(pages) {
            let base = i64::from(p) * as_i64(ps);
            for (slot, offset) in chunk.iter_mut().zip(0..) {
                *slot = base + offset;
            }
        }
    }
}

/// Changes node `i` of `tree` with `f`, keeping the size tallies right: the node's
/// contribution is taken out of `tally` before and put back after. Always inlined: the
/// body of [`Cache::edit`] and [`Parts::edit`], not a call of its own.
#[allow(clippy::inline_always)]
#[inline(always)]
fn edit_node<R>(
    tree: &mut Tree,
    tally: &mut sizes::Sizes,
    i: u32,
    f: impl FnOnce(&mut Node) -> R,
) -> R {
    let n = tree.node_mut(i);
    *tally -= sizes::Sizes::of(n);
    let out = f(n);
    *tally += sizes::Sizes::of(n);
    out
}
