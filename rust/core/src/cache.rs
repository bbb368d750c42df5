//! The cache: namespaces of radix trees over one set of pools, with the KV component's
//! match, insert, locks and LRU eviction.
//!
//! [`Cache`] is the single-threaded core (`&mut self` methods, lock receipts as plain
//! [`LockId`]s). [`crate::HybridCache`] wraps it for sharing and gives owned receipts.
//!
//! Components: every node carries KV data (device pages, a path lock count) and Mamba
//! data (at most one device state slot, a single-node lock count). Each component has
//! its own eviction set; evicting a leaf's KV cascades to its state, evicting an
//! internal node's state leaves a tombstone. Transfer batches (`batch`) and the
//! request-level API (`request`) live in submodules.

pub(crate) mod batch;
pub(crate) mod host;
#[cfg(test)]
mod host_tests;
#[cfg(test)]
mod hybrid_tests;
pub(crate) mod load;
pub(crate) mod request;

pub use batch::{BatchId, BatchKind, Copy, PoolKind, Tier, TransferBatch};
pub use load::{CallOff, LoadTarget};
pub use request::{RequestId, RequestView};

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::pool::{as_i64, page_of_slot, page_u32, Pages, Pool, PoolCounts};
use crate::stats::Stats;
use crate::tree::{NodeId, Probe, Tree, NONE};

/// A lock receipt: the only way to release a lock. Releasing it twice fails loudly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LockId {
    index: u32,
    generation: u32,
}

impl std::fmt::Display for LockId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "#{}.{}", self.index, self.generation)
    }
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct LockSlot {
    generation: u32,
    /// Arena index of the node the receipt locked (its path to the root is locked).
    pub(crate) node: Option<u32>,
    /// Whether the receipt also holds the node's Mamba state (single-node lock).
    pub(crate) mamba: bool,
}

/// The answer of [`Cache::match_prefix`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Match {
    /// Tokens reusable from device memory now (a multiple of the page size).
    pub device_len: usize,
    /// Device slots of the first `device_len` tokens.
    pub kv_indices: Vec<i64>,
    /// Further tokens present only on the host tier.
    pub host_len: usize,
    /// The last device node of the match (a root when nothing matched).
    pub node: NodeId,
    /// The last node counting host data (`node` when `host_len == 0`).
    pub host_node: NodeId,
    /// Device state slot at `device_len`, if the model has Mamba layers.
    pub mamba_slot: Option<u32>,
    /// The deepest page-aligned KV match on any tier, ignoring states (the branch point).
    pub kv_len: usize,
}

/// The answer of [`Cache::insert`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Insert {
    /// Tokens that were already cached (their passed slots were freed, except the
    /// caller's own prefix below `owned_from`).
    pub prefix_len: usize,
    /// The node where the insert ended (a root when no whole page was given).
    pub node: NodeId,
    /// Whether that node already had a Mamba state (always false without Mamba layers).
    pub mamba_existed: bool,
}

/// What [`Cache::publish`] did.
pub(crate) struct Published {
    pub insert: Insert,
    /// The node where the cached part ends.
    pub end: u32,
    /// Tokens now cached for the sequence (the aligned length, or less when a load in
    /// flight stopped the insert).
    pub cached: usize,
    /// The caller's pages for tokens `cached..aligned` that were not cached.
    pub unpublished: Pages,
}

/// What [`Cache::evict`] actually evicted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Evicted {
    /// Device KV tokens freed.
    pub kv_tokens: usize,
    /// Device Mamba states freed.
    pub mamba_states: usize,
}

/// One node as seen by [`Cache::snapshot`] (tests, tools and pretty printing).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeInfo {
    /// The node's handle.
    pub id: NodeId,
    /// Its namespace (`None` for the default one).
    pub namespace: Option<String>,
    /// Every token from the root to the end of this node.
    pub prefix: Vec<u32>,
    /// Tokens of this node alone (the tail of `prefix`).
    pub key_len: usize,
    /// Device slots of this node's tokens, if it has device KV.
    pub kv_indices: Option<Vec<i64>>,
    /// Live receipts covering the node.
    pub lock: u32,
    /// Logical time of the last access.
    pub last_access: u64,
    /// Device Mamba state slot at the node's end, if any.
    pub mamba_slot: Option<u32>,
    /// Receipts holding that state.
    pub mamba_lock: u32,
    /// Host-tier slots of this node's tokens, if it is backed up.
    pub host_kv_indices: Option<Vec<i64>>,
    /// Host-tier state slot, if its state is backed up.
    pub host_mamba_slot: Option<u32>,
    /// Its device data arrived by a load-back whose copies are not acknowledged yet.
    pub loading: bool,
}

/// The single-threaded cache core. Fields are crate-visible for `audit()`.
pub struct Cache {
    pub(crate) config: Config,
    pub(crate) tree: Tree,
    pub(crate) kv_pool: Pool,
    /// Device state pool (`page_size` 1; no pages for an attention-only model).
    pub(crate) mamba_pool: Pool,
    /// Host-tier KV pool (no pages without a host tier).
    pub(crate) host_kv_pool: Pool,
    /// Host-tier state pool.
    pub(crate) host_mamba_pool: Pool,
    /// Root of the default namespace.
    pub(crate) default_root: u32,
    /// Roots of named namespaces (looked up by `&str`, no allocation per call).
    pub(crate) named_roots: HashMap<String, u32>,
    /// KV eviction candidates: unlocked device leaves, by (last access, index).
    pub(crate) kv_lru: BTreeSet<(u64, u32)>,
    /// Mamba eviction candidates: unlocked device states, by (last use, index).
    pub(crate) mamba_lru: BTreeSet<(u64, u32)>,
    /// Host eviction candidates: unlocked host-only leaves, by (last access, index).
    pub(crate) host_lru: BTreeSet<(u64, u32)>,
    /// Host KV tokens in the tree.
    pub(crate) host_tokens: usize,
    /// Host KV tokens of unlocked host-only nodes: what host eviction can reclaim (an
    /// unlocked host-only node has only unlocked host-only nodes below it).
    pub(crate) host_evictable: usize,
    /// Load-backs by batch id: uncommitted guards, and committed loads in flight.
    pub(crate) loads: BTreeMap<BatchId, load::Load>,
    pub(crate) evictable_tokens: usize,
    pub(crate) protected_tokens: usize,
    pub(crate) evictable_states: usize,
    pub(crate) protected_states: usize,
    clock: u64,
    pub(crate) locks: Vec<LockSlot>,
    free_locks: Vec<u32>,
    pub(crate) live_locks: usize,
    pub(crate) requests: request::Requests,
    pub(crate) batches: batch::Batches,
    pub(crate) stats: Stats,
    probe: Probe,
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
        let kv_pool = Pool::new("kv_slots", config.kv_slots, config.page_size)?;
        let mamba_pool = Pool::new("mamba_slots", config.mamba_slots, 1)?;
        let host_kv_pool = Pool::new("host_kv_slots", config.host_kv_slots, config.page_size)?;
        let host_mamba_pool = Pool::new("host_mamba_slots", config.host_mamba_slots, 1)?;
        let tree = Tree::new(config.page_size);
        let mut cache = Cache {
            config,
            tree,
            kv_pool,
            mamba_pool,
            host_kv_pool,
            host_mamba_pool,
            host_lru: BTreeSet::new(),
            host_tokens: 0,
            host_evictable: 0,
            loads: BTreeMap::new(),
            default_root: NONE,
            named_roots: HashMap::new(),
            kv_lru: BTreeSet::new(),
            mamba_lru: BTreeSet::new(),
            evictable_tokens: 0,
            protected_tokens: 0,
            evictable_states: 0,
            protected_states: 0,
            clock: 0,
            locks: Vec::new(),
            free_locks: Vec::new(),
            live_locks: 0,
            requests: request::Requests::default(),
            batches: batch::Batches::default(),
            stats: Stats::default(),
            probe: Probe::default(),
        };
        cache.default_root = cache.new_root();
        Ok(cache)
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
        &self.kv_pool
    }

    /// The device Mamba state pool (empty for an attention-only model).
    pub fn mamba_pool(&self) -> &Pool {
        &self.mamba_pool
    }

    /// The host-tier KV pool (empty without a host tier).
    pub fn host_kv_pool(&self) -> &Pool {
        &self.host_kv_pool
    }

    /// The host-tier state pool.
    pub fn host_mamba_pool(&self) -> &Pool {
        &self.host_mamba_pool
    }

    /// True when the model has Mamba layers (`mamba_slots > 0`): matches are then cut
    /// at the deepest node with a state.
    pub fn is_hybrid(&self) -> bool {
        self.config.mamba_slots > 0
    }

    fn new_root(&mut self) -> u32 {
        let r = self.tree.alloc_node(NONE, Vec::new());
        self.tree.node_mut(r).kv.device = Some(Vec::new());
        r
    }

    /// The root of `namespace`, if it exists.
    fn existing_root(&self, namespace: Option<&str>) -> Option<u32> {
        match namespace {
            None => Some(self.default_root),
            Some(ns) => self.named_roots.get(ns).copied(),
        }
    }

    /// The root of `namespace`, made on first use.
    fn root(&mut self, namespace: Option<&str>) -> u32 {
        if let Some(r) = self.existing_root(namespace) {
            return r;
        }
        let r = self.new_root();
        self.named_roots
            .insert(namespace.unwrap_or_default().to_owned(), r);
        r
    }

    /// Every namespace with its root: the default one first, then by name.
    pub(crate) fn roots(&self) -> Vec<(Option<&str>, u32)> {
        let mut named: Vec<_> = self
            .named_roots
            .iter()
            .map(|(k, &r)| (Some(k.as_str()), r))
            .collect();
        named.sort_unstable();
        let mut out = vec![(None, self.default_root)];
        out.extend(named);
        out
    }

    fn aligned(&self, n: usize) -> usize {
        n / self.config.page_size * self.config.page_size
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Marks `i` as accessed now, keeping its place in the eviction set right.
    fn touch(&mut self, i: u32) {
        let now = self.tick();
        let n = self.tree.node_mut(i);
        let old = std::mem::replace(&mut n.last_access, now);
        if n.kv.in_lru {
            self.kv_lru.remove(&(old, i));
            self.kv_lru.insert((now, i));
        }
        if n.kv.in_host_lru {
            self.host_lru.remove(&(old, i));
            self.host_lru.insert((now, i));
        }
    }

    /// Marks `i`'s Mamba state as used now (only the state a match actually uses).
    fn touch_state(&mut self, i: u32) {
        let now = self.tick();
        let n = self.tree.node_mut(i);
        let old = std::mem::replace(&mut n.mamba.last_access, now);
        if n.mamba.in_lru {
            self.mamba_lru.remove(&(old, i));
            self.mamba_lru.insert((now, i));
        }
    }

    /// Puts `i` in or out of the eviction sets according to what it is now.
    ///
    /// KV: an unlocked device leaf whose state (if any) is unlocked too, since evicting
    /// the leaf's KV takes its state with it. Mamba: a device state, unlocked. Host: an
    /// unlocked host-only leaf.
    pub(crate) fn refresh_candidate(&mut self, i: u32) {
        let n = self.tree.node(i);
        let host = !n.is_root()
            && n.kv.device.is_none()
            && n.kv.host.is_some()
            && n.kv.lock == 0
            && n.children.is_empty();
        if host != n.kv.in_host_lru {
            let key = (n.last_access, i);
            if host {
                self.host_lru.insert(key);
            } else {
                self.host_lru.remove(&key);
            }
            self.tree.node_mut(i).kv.in_host_lru = host;
        }
        let n = self.tree.node(i);
        let kv = !n.is_root()
            && n.kv.device.is_some()
            && n.kv.lock == 0
            && n.mamba.lock == 0
            && n.device_children == 0;
        let mamba = n.mamba.device.is_some() && n.mamba.lock == 0;
        let (kv_key, mamba_key) = ((n.last_access, i), (n.mamba.last_access, i));
        let (kv_was, mamba_was) = (n.kv.in_lru, n.mamba.in_lru);
        if kv != kv_was {
            if kv {
                self.kv_lru.insert(kv_key);
            } else {
                self.kv_lru.remove(&kv_key);
            }
        }
        if mamba != mamba_was {
            if mamba {
                self.mamba_lru.insert(mamba_key);
            } else {
                self.mamba_lru.remove(&mamba_key);
            }
        }
        let n = self.tree.node_mut(i);
        n.kv.in_lru = kv;
        n.mamba.in_lru = mamba;
    }

    fn expand_into(&self, pages: &[u32], out: &mut Vec<i64>) {
        let ps = self.config.page_size;
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

    /// Longest cached prefix of `tokens` in `namespace`. Splits the last node when the
    /// KV match ends inside it and refreshes the LRU position of every node on the path,
    /// ancestors older than descendants. With Mamba layers the usable match is cut back
    /// to the deepest node that has a state (`kv_len` keeps the full KV match, the branch
    /// point), and only that state's LRU position is refreshed.
    pub fn match_prefix(&mut self, namespace: Option<&str>, tokens: &[u32]) -> Match {
        let root = self.root(namespace);
        let key = &tokens[..self.aligned(tokens.len())];
        let mut probe = std::mem::take(&mut self.probe);
        self.tree.probe(root, key, &mut probe);
        let hybrid = self.is_hybrid();
        let mut kv_indices = Vec::with_capacity(probe.matched);
        // (node, length) of the deepest node valid for every component: on the device,
        // and on any tier. KV on the device is prefix-closed, and data a load-back has
        // not landed yet does not count as the device's.
        let mut valid = (root, 0);
        let mut any = (root, 0);
        let mut on_device = true;
        let mut depth = 0;
        for &(i, n) in &probe.path {
            let node = if n < self.tree.node(i).key.len() {
                self.split(i, n)
            } else {
                i
            };
            depth += n;
            let nd = self.tree.node(node);
            on_device = on_device && !nd.kv.loading && nd.kv.device.is_some();
            if on_device {
                if let Some(pages) = &nd.kv.device {
                    self.expand_into(pages, &mut kv_indices);
                }
            }
            self.touch(node);
            let nd = self.tree.node(node);
            if on_device && (!hybrid || nd.mamba.device.is_some()) {
                valid = (node, depth);
            }
            let state_somewhere = nd.mamba.device.is_some() || nd.mamba.host.is_some();
            if !hybrid || state_somewhere {
                any = (node, depth);
            }
        }
        let kv_len = probe.matched;
        self.probe = probe;
        let (end, device_len) = valid;
        kv_indices.truncate(device_len);
        let (host_end, host_len) = if any.1 > device_len {
            (any.0, any.1 - device_len)
        } else {
            (end, 0)
        };
        let mamba_slot = self.tree.node(end).mamba.device;
        if mamba_slot.is_some() {
            self.touch_state(end);
            self.stats.state_hits += 1;
        }
        self.stats.match_calls += 1;
        self.stats.match_tokens += key.len() as u64;
        self.stats.hit_tokens += device_len as u64;
        self.stats.host_hit_tokens += host_len as u64;
        Match {
            device_len,
            kv_indices,
            host_len,
            node: self.tree.id(end),
            host_node: self.tree.id(host_end),
            mamba_slot,
            kv_len,
        }
    }

    /// Device slots of the `len` tokens from the root to the end of node `end`.
    pub(crate) fn path_slots(&self, end: u32, len: usize) -> Vec<i64> {
        let mut nodes = Vec::new();
        let mut cur = end;
        while cur != NONE && !self.tree.node(cur).is_root() {
            nodes.push(cur);
            cur = self.tree.node(cur).parent;
        }
        let mut out = Vec::with_capacity(len);
        for &i in nodes.iter().rev() {
            if let Some(pages) = &self.tree.node(i).kv.device {
                self.expand_into(pages, &mut out);
            }
        }
        debug_assert_eq!(out.len(), len);
        out
    }

    /// Splits node `i` after `at` tokens; returns the new upper node.
    fn split(&mut self, i: u32, at: usize) -> u32 {
        self.stats.splits += 1;
        self.tree.split(i, at)
    }

    /// Caches `tokens` whose slots are `kv_indices` (one per token).
    ///
    /// `kv_indices[..owned_from]` must be the tree's own slots for that prefix (from an
    /// earlier match) and are left alone; the caller hands over `kv_indices[owned_from..]`
    /// and must hold them. Slots of tokens the tree already caches, and the slots of an
    /// unaligned tail, are freed by the cache: the caller never frees after an insert.
    /// Any bad argument fails the call and changes nothing.
    pub fn insert(
        &mut self,
        namespace: Option<&str>,
        tokens: &[u32],
        kv_indices: &[i64],
        owned_from: usize,
    ) -> Result<Insert> {
        self.insert_with_state(namespace, tokens, kv_indices, owned_from, None)
    }

    /// [`Cache::insert`] that also hands over the Mamba state slot `mamba_slot` (from
    /// `alloc_mamba`), taken at the end of `tokens`. It lands on the node where the insert
    /// ends; if that node has a state already the slot is freed and
    /// `Insert::mamba_existed` is true. A state cannot sit anywhere but at a node's end,
    /// so with an unaligned tail, or with no whole page, the slot is freed too.
    pub fn insert_with_state(
        &mut self,
        namespace: Option<&str>,
        tokens: &[u32],
        kv_indices: &[i64],
        owned_from: usize,
        mamba_slot: Option<i64>,
    ) -> Result<Insert> {
        let ps = self.config.page_size;
        if kv_indices.len() != tokens.len() {
            return Err(Error::arg(
                "kv_indices",
                format!(
                    "has {} entries for {} tokens",
                    kv_indices.len(),
                    tokens.len()
                ),
            ));
        }
        if owned_from > tokens.len() {
            return Err(Error::arg(
                "owned_from",
                format!("{owned_from} is past the end of {} tokens", tokens.len()),
            ));
        }
        if !owned_from.is_multiple_of(ps) {
            return Err(Error::arg(
                "owned_from",
                format!("{owned_from} is not a multiple of page_size {ps}"),
            ));
        }
        let state_page = match mamba_slot {
            None => None,
            Some(s) if !self.is_hybrid() => {
                return Err(Error::arg(
                    "mamba_slot",
                    format!("this cache has no Mamba state pool (mamba_slots=0), got {s}"),
                ))
            }
            Some(s) => Some(self.state_slot_arg(s, "mamba_slot")?),
        };
        let owned_pages = self.pages_of(&kv_indices[owned_from..], owned_from)?;
        // An unseen namespace gets its root only once the call cannot fail (a failed
        // insert changes nothing); until then it matches nothing.
        let existing_root = self.existing_root(namespace);
        let aligned = self.aligned(tokens.len());
        let mut probe = std::mem::take(&mut self.probe);
        if let Some(root) = existing_root {
            self.tree.probe(root, &tokens[..aligned], &mut probe);
        } else {
            probe.path.clear();
            probe.matched = 0;
        }
        let checked = self.check_owned_prefix(&probe, kv_indices, owned_from);
        let claimed = checked.and_then(|()| {
            let kv = self.kv_pool.claim_caller(&owned_pages, "kv_indices")?;
            let Some(p) = state_page else {
                return Ok((kv, None));
            };
            match self.mamba_pool.claim_caller(&[p], "mamba_slot") {
                Ok(state) => Ok((kv, Some(state))),
                Err(e) => {
                    // Back to the caller, as if the KV claim had not happened.
                    let _ = kv.into_caller();
                    Err(e)
                }
            }
        });
        let (owned, state) = match claimed {
            Ok(c) => c,
            Err(e) => {
                self.probe = probe;
                return Err(e);
            }
        };
        // From here on nothing can fail.
        let root = match existing_root {
            Some(root) => root,
            None => self.root(namespace),
        };
        let out = self.publish(root, &probe, tokens, owned_from, owned, state);
        self.probe = probe;
        drop(out.unpublished);
        self.maybe_backup(out.end);
        Ok(out.insert)
    }

    /// A state slot argument: in range of the Mamba pool.
    fn state_slot_arg(&self, s: i64, arg: &'static str) -> Result<u32> {
        u32::try_from(s)
            .ok()
            .filter(|&p| (p as usize) < self.config.mamba_slots)
            .ok_or_else(|| {
                Error::arg(
                    arg,
                    format!("slot {s} is out of range [0, {})", self.config.mamba_slots),
                )
            })
    }

    /// The part of an insert that cannot fail: splits along the probed path, frees the
    /// duplicate and tail pages of `owned` (pages for tokens from `owned_from` on),
    /// revives host-only nodes on the path with the caller's pages, adds the new leaf
    /// and places `state`. A node whose load-back is in flight stops the insert there:
    /// nothing is cached at or below it, and the caller's pages from there to the
    /// aligned end come back as `unpublished`.
    pub(crate) fn publish(
        &mut self,
        root: u32,
        probe: &Probe,
        tokens: &[u32],
        owned_from: usize,
        mut owned: Pages,
        state: Option<Pages>,
    ) -> Published {
        let ps = self.config.page_size;
        let aligned = self.aligned(tokens.len());
        let mut end = root;
        let mut pos = 0;
        // Token position of `owned`'s first page; `owned` is consumed from the front.
        let mut owned_pos = owned_from;
        let mut blocked = false;
        let mut duplicates = 0;
        for &(i, n) in &probe.path {
            if self.tree.node(i).kv.loading {
                blocked = true;
                break;
            }
            let node = if n < self.tree.node(i).key.len() {
                self.split(i, n)
            } else {
                i
            };
            let next = pos + n;
            if next > owned_pos {
                let rest = owned.split_off(((next - owned_pos) / ps).min(owned.len()));
                let here = std::mem::replace(&mut owned, rest);
                if self.tree.node(node).kv.device.is_none() {
                    // A host-only node: the caller's fresh slots become its device copy
                    // (the whole node is past `owned_from`: the owned prefix is on the
                    // device).
                    self.revive(node, here);
                } else {
                    duplicates += next - owned_pos;
                    drop(here);
                }
                owned_pos = next;
            }
            self.tree.node_mut(node).hits += 1;
            self.touch(node);
            end = node;
            pos = next;
        }
        let mut unpublished = self.kv_pool.empty();
        let cached = if blocked {
            let keep = ((aligned - owned_pos.max(pos)) / ps).min(owned.len());
            let tail = owned.split_off(keep);
            drop(tail);
            unpublished = owned;
            pos
        } else {
            if aligned > pos {
                let rest = owned.split_off(((aligned - pos) / ps).min(owned.len()));
                let leaf_pages = std::mem::replace(&mut owned, rest);
                end = self.add_leaf(end, tokens[pos..aligned].to_vec(), leaf_pages);
                self.tree.node_mut(end).hits = 1;
                self.stats.inserted_tokens += (aligned - pos) as u64;
            }
            // The unaligned tail.
            drop(owned);
            aligned
        };
        let mut mamba_existed = false;
        if let Some(state) = state {
            if end == root || cached != tokens.len() {
                // The state was taken at tokens.len(), which is no node's end.
                drop(state);
            } else if self.tree.node(end).mamba.device.is_some() {
                mamba_existed = true;
                drop(state);
            } else {
                self.set_state(end, state);
            }
        }
        self.stats.insert_calls += 1;
        self.stats.duplicate_tokens += duplicates as u64;
        Published {
            insert: Insert {
                prefix_len: probe.matched.min(pos),
                node: self.tree.id(end),
                mamba_existed,
            },
            end,
            cached,
            unpublished,
        }
    }

    /// Gives host-only node `i` device pages (an insert passing through it).
    fn revive(&mut self, i: u32, pages: Pages) {
        let len = self.tree.node(i).key.len();
        self.give_device_pages(i, pages);
        self.stats.revived_tokens += len as u64;
    }

    /// Publishes `pages` as host-only node `i`'s device KV (its parent has device KV),
    /// keeping the sizes and eviction sets right.
    pub(crate) fn give_device_pages(&mut self, i: u32, pages: Pages) {
        let n = self.tree.node_mut(i);
        n.kv.device = Some(pages.into_tree());
        let (len, parent, locked) = (n.key.len(), n.parent, n.kv.lock > 0);
        if locked {
            self.protected_tokens += len;
        } else {
            self.evictable_tokens += len;
            self.host_evictable -= len;
        }
        self.tree.node_mut(parent).device_children += 1;
        self.refresh_candidate(parent);
        self.refresh_candidate(i);
    }

    /// Publishes a state slot on node `i` (which has device KV and no state).
    pub(crate) fn set_state(&mut self, i: u32, state: Pages) {
        let slot = state.into_tree();
        let n = self.tree.node_mut(i);
        debug_assert!(n.mamba.device.is_none() && n.kv.device.is_some() && slot.len() == 1);
        n.mamba.device = slot.first().copied();
        if n.mamba.lock == 0 {
            self.evictable_states += 1;
        } else {
            self.protected_states += 1;
        }
        self.stats.states_cached += 1;
        self.touch_state(i);
        self.refresh_candidate(i);
    }

    /// Validates the page structure of caller slots for positions starting at `start`
    /// (page-aligned): each page's slots are consecutive and start at a page boundary, in
    /// range. Returns the page numbers.
    fn pages_of(&self, slots: &[i64], start: usize) -> Result<Vec<u32>> {
        let ps = self.config.page_size;
        let capacity = as_i64(self.config.kv_slots);
        if ps == 1 {
            // Page = slot: one range check per token, no divisions.
            return slots
                .iter()
                .map(|&s| {
                    u32::try_from(s)
                        .ok()
                        .filter(|_| s < capacity)
                        .ok_or_else(|| {
                            Error::arg(
                                "kv_indices",
                                format!("slot {s} is out of range [0, {capacity})"),
                            )
                        })
                })
                .collect();
        }
        let mut pages = Vec::with_capacity(slots.len().div_ceil(ps));
        for (c, chunk) in slots.chunks(ps).enumerate() {
            let first = chunk[0];
            if !(0..capacity).contains(&first) {
                return Err(Error::arg(
                    "kv_indices",
                    format!("slot {first} is out of range [0, {capacity})"),
                ));
            }
            let ps_i = as_i64(ps);
            let pos = start + c * ps;
            if first % ps_i != 0 || chunk.iter().zip(first..).any(|(&s, want)| s != want) {
                return Err(Error::arg(
                    "kv_indices",
                    format!(
                        "slots for tokens {pos}..{} are not one page (page_size {ps}): {:?}",
                        pos + chunk.len(),
                        chunk
                    ),
                ));
            }
            pages.push(page_of_slot(first, ps));
        }
        Ok(pages)
    }

    /// Checks that `kv_indices[..owned_from]` are the tree's slots for that prefix.
    fn check_owned_prefix(
        &self,
        probe: &Probe,
        kv_indices: &[i64],
        owned_from: usize,
    ) -> Result<()> {
        if owned_from == 0 {
            return Ok(());
        }
        if probe.matched < owned_from {
            return Err(Error::arg(
                "owned_from",
                format!(
                    "the first {owned_from} tokens are not cached (only {} are): \
                     kv_indices[:owned_from] must come from a match of this prefix",
                    probe.matched
                ),
            ));
        }
        // Compared page by page against the caller's slots, without materialising the
        // tree's slots. Every page below `owned_from` has device KV (it matched).
        let ps = self.config.page_size;
        let mut pos = 0;
        for &(i, n) in &probe.path {
            let node = self.tree.node(i);
            let Some(pages) = node.kv.device.as_ref().filter(|_| !node.kv.loading) else {
                break;
            };
            for &p in &pages[..n / ps] {
                if pos >= owned_from {
                    return Ok(());
                }
                let base = i64::from(p) * as_i64(ps);
                let theirs = &kv_indices[pos..pos + ps];
                if theirs.iter().zip(base..).any(|(&a, b)| a != b) {
                    return Err(Error::arg(
                        "kv_indices",
                        format!(
                            "kv_indices[:owned_from] are not the cache's slots for that prefix \
                             (first difference in tokens {pos}..{})",
                            pos + ps
                        ),
                    ));
                }
                pos += ps;
            }
        }
        if pos < owned_from {
            return Err(Error::arg(
                "owned_from",
                format!("only {pos} of the first {owned_from} tokens have device KV"),
            ));
        }
        Ok(())
    }

    /// Adds a device leaf under `parent` holding `pages`; returns it.
    fn add_leaf(&mut self, parent: u32, key: Vec<u32>, pages: Pages) -> u32 {
        let len = key.len();
        let leaf = self.tree.alloc_node(parent, key);
        self.tree.node_mut(leaf).kv.device = Some(pages.into_tree());
        self.tree.link_child(parent, leaf);
        self.tree.node_mut(parent).device_children += 1;
        self.evictable_tokens += len;
        self.touch(leaf);
        self.refresh_candidate(parent);
        self.refresh_candidate(leaf);
        leaf
    }

    /// Locks the path from `node` to its root against eviction, and the node's Mamba
    /// state if it has one (single-node lock); returns the receipt.
    pub fn lock(&mut self, node: NodeId) -> Result<LockId> {
        let i = self.tree.resolve(node)?;
        Ok(self.lock_index(i))
    }

    pub(crate) fn lock_index(&mut self, i: u32) -> LockId {
        let mut cur = i;
        while cur != NONE {
            let n = self.tree.node_mut(cur);
            n.kv.lock += 1;
            let (first, len, parent, root) = (n.kv.lock == 1, n.key.len(), n.parent, n.is_root());
            if first && !root {
                if n.kv.device.is_some() {
                    self.evictable_tokens -= len;
                    self.protected_tokens += len;
                } else if n.kv.host.is_some() {
                    self.host_evictable -= len;
                }
                self.refresh_candidate(cur);
            }
            cur = parent;
        }
        let n = self.tree.node_mut(i);
        let mamba = n.mamba.device.is_some();
        if mamba {
            n.mamba.lock += 1;
            if n.mamba.lock == 1 {
                self.evictable_states -= 1;
                self.protected_states += 1;
            }
            self.refresh_candidate(i);
        }
        let index = if let Some(index) = self.free_locks.pop() {
            index
        } else {
            self.locks.push(LockSlot {
                generation: 0,
                node: None,
                mamba: false,
            });
            page_u32(self.locks.len() - 1)
        };
        let slot = &mut self.locks[index as usize];
        slot.node = Some(i);
        slot.mamba = mamba;
        self.live_locks += 1;
        self.stats.locks += 1;
        LockId {
            index,
            generation: slot.generation,
        }
    }

    /// Releases a receipt. A receipt released already (or never issued here) raises
    /// [`Error::Lock`] and changes nothing.
    pub fn unlock(&mut self, receipt: LockId) -> Result<()> {
        let (node, mamba) = match self.locks.get(receipt.index as usize) {
            Some(&LockSlot {
                generation,
                node: Some(i),
                mamba,
            }) if generation == receipt.generation => (i, mamba),
            _ => {
                return Err(Error::Lock(format!(
                    "lock receipt {receipt} was already released or does not belong to this cache"
                )))
            }
        };
        let slot = &mut self.locks[receipt.index as usize];
        slot.node = None;
        slot.mamba = false;
        slot.generation = slot.generation.wrapping_add(1);
        self.free_locks.push(receipt.index);
        self.live_locks -= 1;
        if mamba {
            // A locked state is never evicted: it is still there.
            let n = self.tree.node_mut(node);
            n.mamba.lock -= 1;
            if n.mamba.lock == 0 {
                self.protected_states -= 1;
                self.evictable_states += 1;
            }
        }
        let mut cur = node;
        while cur != NONE {
            let n = self.tree.node_mut(cur);
            n.kv.lock -= 1;
            let (last, len, parent, root) = (n.kv.lock == 0, n.key.len(), n.parent, n.is_root());
            if last && !root && n.kv.device.is_some() {
                self.protected_tokens -= len;
                self.evictable_tokens += len;
            } else if last && !root && n.kv.host.is_some() {
                self.host_evictable += len;
            }
            if cur == node || last {
                self.refresh_candidate(cur);
            }
            cur = parent;
        }
        self.stats.unlocks += 1;
        Ok(())
    }

    /// The node a live receipt locks.
    pub fn lock_node(&self, receipt: LockId) -> Result<NodeId> {
        match self.locks.get(receipt.index as usize) {
            Some(LockSlot {
                generation,
                node: Some(i),
                ..
            }) if *generation == receipt.generation => Ok(self.tree.id(*i)),
            _ => Err(Error::Lock(format!(
                "lock receipt {receipt} was already released"
            ))),
        }
    }

    /// Evicts at least `kv_tokens` device KV tokens and `mamba_states` device states (or
    /// everything evictable), least recently used first. Locked nodes are never touched.
    ///
    /// KV: unlocked device leaves; a parent left as an unlocked leaf joins the
    /// candidates in the same pass; a leaf's state goes with its KV. Mamba: unlocked
    /// states by last use; an internal node's (or a KV-locked leaf's) state is dropped
    /// and the node kept as a tombstone, an unlocked leaf is deleted with its KV. A leaf
    /// left without a state can never be matched again and is deleted too. O(log n) per
    /// evicted node.
    pub fn evict(&mut self, kv_tokens: usize, mamba_states: usize) -> Evicted {
        let mut out = Evicted::default();
        while out.kv_tokens < kv_tokens {
            let Some((_, i)) = self.kv_lru.pop_first() else {
                break;
            };
            self.tree.node_mut(i).kv.in_lru = false;
            self.remove_leaf(i, &mut out);
        }
        while out.mamba_states < mamba_states {
            let Some((_, i)) = self.mamba_lru.pop_first() else {
                break;
            };
            self.tree.node_mut(i).mamba.in_lru = false;
            self.evict_state_of(i, &mut out);
        }
        self.stats.evict_calls += 1;
        self.stats.evicted_kv_tokens += out.kv_tokens as u64;
        self.stats.evicted_mamba_states += out.mamba_states as u64;
        out
    }

    /// Evicts node `i`'s (unlocked) state: an unlocked leaf goes with its KV, any other
    /// node stays as a tombstone.
    fn evict_state_of(&mut self, i: u32, out: &mut Evicted) {
        let n = self.tree.node(i);
        if n.mamba.in_lru {
            self.mamba_lru.remove(&(n.mamba.last_access, i));
            self.tree.node_mut(i).mamba.in_lru = false;
        }
        let n = self.tree.node(i);
        if n.kv.in_lru {
            self.kv_lru.remove(&(n.last_access, i));
            self.tree.node_mut(i).kv.in_lru = false;
            self.remove_leaf(i, out);
        } else {
            self.drop_state(i, out);
            self.stats.tombstones += 1;
            self.refresh_candidate(i);
        }
    }

    /// Frees node `i`'s device state (evictable: unlocked).
    fn drop_state(&mut self, i: u32, out: &mut Evicted) {
        let n = self.tree.node_mut(i);
        debug_assert_eq!(n.mamba.lock, 0);
        if let Some(slot) = n.mamba.device.take() {
            if n.mamba.in_lru {
                self.mamba_lru.remove(&(n.mamba.last_access, i));
                n.mamba.in_lru = false;
            }
            self.mamba_pool.release_tree(&[slot]);
            self.evictable_states -= 1;
            out.mamba_states += 1;
        }
    }

    /// Evicts an unlocked device leaf (out of the KV set already). A leaf with a
    /// useful host copy is demoted (kept with its host data only); under write-back one
    /// without is backed up first and demoted when the copy completes; any other is
    /// deleted with the host-only nodes below it. Ancestors left as childless stateless
    /// unlocked leaves of a hybrid tree (unmatchable dead weight) go too.
    pub(crate) fn remove_leaf(&mut self, mut i: u32, out: &mut Evicted) {
        let hybrid = self.is_hybrid();
        loop {
            let n = self.tree.node(i);
            let useful_on_host = n.kv.host.is_some()
                && (!hybrid || n.mamba.host.is_some() || !n.children.is_empty());
            if useful_on_host {
                self.demote(i, out);
                return;
            }
            let (len, has_state) = (n.key.len(), n.mamba.device.is_some());
            if self.backup_for_eviction(i) {
                // Counted as evicted now: its slots are free once the backup completes.
                out.kv_tokens += len;
                out.mamba_states += usize::from(has_state);
                return;
            }
            let parent = self.delete_subtree(i, out);
            let p = self.tree.node(parent);
            if hybrid && p.kv.in_lru && p.mamba.device.is_none() && p.children.is_empty() {
                self.kv_lru.remove(&(p.last_access, parent));
                self.tree.node_mut(parent).kv.in_lru = false;
                i = parent;
            } else {
                return;
            }
        }
    }

    /// `n` device KV slots (whole pages) as raw indices the caller now holds, evicting
    /// first when the pool is short; `None` when it cannot, having taken nothing and
    /// evicted nothing.
    pub fn alloc_kv(&mut self, n: usize) -> Result<Option<Vec<i64>>> {
        let ps = self.config.page_size;
        if !n.is_multiple_of(ps) {
            return Err(Error::arg(
                "n",
                format!("{n} is not a multiple of page_size {ps}"),
            ));
        }
        self.stats.alloc_calls += 1;
        let Some(owned) = self.alloc_pages(n / ps) else {
            return Ok(None);
        };
        let mut out = Vec::with_capacity(n);
        self.expand_into(&owned.into_caller(), &mut out);
        Ok(Some(out))
    }

    /// `pages` device KV pages as an owned value, evicting LRU leaves first when short.
    /// `None` when even evicting everything evictable would not do, and then nothing is
    /// evicted: every unlocked node is reclaimable (locks cover whole paths, so an
    /// unlocked node has no locked descendant), so the check is exact.
    pub(crate) fn alloc_pages(&mut self, pages: usize) -> Option<Pages> {
        let ps = self.config.page_size;
        let free = self.kv_pool.free_pages();
        if free < pages {
            if free * ps + self.evictable_tokens < pages * ps {
                self.stats.alloc_failures += 1;
                return None;
            }
            self.evict((pages - free) * ps, 0);
        }
        let got = self.kv_pool.try_alloc(pages);
        if got.is_none() {
            self.stats.alloc_failures += 1;
        }
        got
    }

    /// One device state slot the caller now holds, evicting the least recently used
    /// unlocked state first when the pool is empty; `None` when none can be had.
    pub fn alloc_mamba(&mut self) -> Option<u32> {
        self.alloc_state()
            .and_then(|s| s.into_caller().first().copied())
    }

    /// One device state slot as an owned value (see [`Cache::alloc_mamba`]). When the
    /// pool is empty it evicts the least recently used state that no transfer pins (a
    /// pinned one would only drain); when there is none it evicts nothing.
    pub(crate) fn alloc_state(&mut self) -> Option<Pages> {
        if self.mamba_pool.free_pages() == 0 {
            let Some(victim) = self.reclaimable_state() else {
                self.stats.mamba_alloc_failures += 1;
                return None;
            };
            let mut out = Evicted::default();
            self.evict_state_of(victim, &mut out);
            self.stats.evicted_kv_tokens += out.kv_tokens as u64;
            self.stats.evicted_mamba_states += out.mamba_states as u64;
        }
        let got = self.mamba_pool.try_alloc(1);
        if got.is_none() {
            self.stats.mamba_alloc_failures += 1;
        }
        got
    }

    /// Unlocked states whose slot no transfer pins, least recently used first.
    fn reclaimable_states(&self) -> impl Iterator<Item = u32> + '_ {
        self.mamba_lru.iter().map(|&(_, i)| i).filter(|&i| {
            self.tree
                .node(i)
                .mamba
                .device
                .is_some_and(|s| self.mamba_pool.pins(s) == 0)
        })
    }

    /// The least recently used unlocked state whose slot no transfer pins.
    fn reclaimable_state(&self) -> Option<u32> {
        self.reclaimable_states().next()
    }

    /// Whether `n` state slots can be had now: free, or held by states that can be
    /// reclaimed.
    pub(crate) fn states_available(&self, n: usize) -> bool {
        let free = self.mamba_pool.free_pages();
        free >= n || free + self.reclaimable_states().take(n - free).count() >= n
    }

    /// Whether `pages` KV pages can be had now, by allocation or eviction (exact: every
    /// unlocked node is reclaimable).
    pub(crate) fn kv_available(&self, pages: usize) -> bool {
        let ps = self.config.page_size;
        self.kv_pool.free_pages() * ps + self.evictable_tokens >= pages * ps
    }

    /// Gives back a state slot the caller holds (from `alloc_mamba`). A slot that is
    /// free, owned by the cache or out of range fails, and nothing changes.
    pub fn free_mamba(&mut self, slot: i64) -> Result<()> {
        let p = self.state_slot_arg(slot, "slot")?;
        self.mamba_pool.free_caller(&[p], "slot").map(|_| ())
    }

    /// Gives back slots the caller holds (from `alloc_kv`). The pages containing them
    /// are freed; a page named more than once is freed once. A slot that is free,
    /// owned by the cache or out of range fails the call, which then changes nothing.
    pub fn free_kv(&mut self, indices: &[i64]) -> Result<usize> {
        let ps = self.config.page_size;
        let capacity = as_i64(self.config.kv_slots);
        let mut pages = Vec::with_capacity(indices.len());
        for &s in indices {
            if !(0..capacity).contains(&s) {
                return Err(Error::arg(
                    "indices",
                    format!("slot {s} is out of range [0, {capacity})"),
                ));
            }
            let p = page_of_slot(s, ps);
            if pages.last() != Some(&p) {
                pages.push(p);
            }
        }
        let freed = self.kv_pool.free_caller(&pages, "indices")?;
        Ok(freed * self.config.page_size)
    }

    /// Device KV tokens in the tree that eviction may take (unlocked).
    pub fn evictable_size(&self) -> usize {
        self.evictable_tokens
    }

    /// Device KV tokens in the tree protected by locks.
    pub fn protected_size(&self) -> usize {
        self.protected_tokens
    }

    /// Device KV tokens in the tree.
    pub fn total_size(&self) -> usize {
        self.evictable_tokens + self.protected_tokens
    }

    /// Free device KV slots.
    pub fn available_kv(&self) -> usize {
        self.kv_pool.free_pages() * self.config.page_size
    }

    /// Free device Mamba state slots.
    pub fn available_mamba(&self) -> usize {
        self.mamba_pool.free_pages()
    }

    /// Device states in the tree that eviction may take (unlocked).
    pub fn evictable_states(&self) -> usize {
        self.evictable_states
    }

    /// Device states in the tree protected by locks.
    pub fn protected_states(&self) -> usize {
        self.protected_states
    }

    /// Counters and gauges, in a fixed order.
    pub fn stats(&self) -> Vec<(&'static str, u64)> {
        let c = self.kv_pool.counts();
        let m = self.mamba_pool.counts();
        let h = self.host_kv_pool.counts();
        let ps = self.config.page_size as u64;
        let mut out = self.stats.entries();
        out.extend([
            (
                "nodes",
                (self.tree.live_nodes - self.named_roots.len() - 1) as u64,
            ),
            ("namespaces", self.named_roots.len() as u64 + 1),
            ("live_locks", self.live_locks as u64),
            ("live_requests", self.requests.live() as u64),
            ("batches_in_flight", self.batches.len() as u64),
            ("kv_cached_tokens", self.total_size() as u64),
            ("kv_evictable_tokens", self.evictable_tokens as u64),
            ("kv_protected_tokens", self.protected_tokens as u64),
            ("kv_free_slots", c.free as u64 * ps),
            ("kv_caller_slots", c.caller as u64 * ps),
            ("kv_request_slots", c.owned as u64 * ps),
            ("kv_capacity_slots", self.config.kv_slots as u64),
            (
                "mamba_cached_states",
                (self.evictable_states + self.protected_states) as u64,
            ),
            ("mamba_evictable_states", self.evictable_states as u64),
            ("mamba_protected_states", self.protected_states as u64),
            ("mamba_free_slots", m.free as u64),
            ("mamba_caller_slots", m.caller as u64),
            ("mamba_request_slots", m.owned as u64),
            ("mamba_draining_slots", m.draining as u64),
            ("mamba_capacity_slots", self.config.mamba_slots as u64),
            ("host_kv_cached_tokens", self.host_tokens as u64),
            ("host_kv_evictable_tokens", self.host_evictable as u64),
            ("host_kv_free_slots", h.free as u64 * ps),
            ("host_kv_capacity_slots", self.config.host_kv_slots as u64),
            (
                "host_mamba_cached_states",
                self.host_mamba_pool.counts().tree as u64,
            ),
            (
                "host_mamba_free_slots",
                self.host_mamba_pool.free_pages() as u64,
            ),
            (
                "host_mamba_capacity_slots",
                self.config.host_mamba_slots as u64,
            ),
            ("load_backs_pending", self.loads.len() as u64),
        ]);
        out
    }

    /// Every live node (roots included), per namespace, parents before children.
    pub fn snapshot(&self) -> Vec<NodeInfo> {
        let mut out = Vec::new();
        for (ns, root) in self.roots() {
            let mut prefix_at: HashMap<u32, Vec<u32>> = HashMap::new();
            for i in self.tree.preorder(root) {
                let n = self.tree.node(i);
                let mut prefix = if n.is_root() {
                    Vec::new()
                } else {
                    prefix_at.get(&n.parent).cloned().unwrap_or_default()
                };
                prefix.extend_from_slice(&n.key);
                let kv_indices = n.kv.device.as_ref().map(|pages| {
                    let mut v = Vec::new();
                    self.expand_into(pages, &mut v);
                    v
                });
                out.push(NodeInfo {
                    id: self.tree.id(i),
                    namespace: ns.map(str::to_owned),
                    prefix: prefix.clone(),
                    key_len: n.key.len(),
                    kv_indices,
                    lock: n.kv.lock,
                    last_access: n.last_access,
                    mamba_slot: n.mamba.device,
                    mamba_lock: n.mamba.lock,
                    host_kv_indices: n.kv.host.as_ref().map(|pages| {
                        let mut v = Vec::new();
                        self.expand_into(pages, &mut v);
                        v
                    }),
                    host_mamba_slot: n.mamba.host,
                    loading: n.kv.loading,
                });
                prefix_at.insert(i, prefix);
            }
        }
        out
    }

    /// A short description of a node for handles' `repr`: its id, depth, the end of its
    /// key and its lock count. A stale handle gives [`Error::StaleNode`].
    pub fn describe(&self, node: NodeId) -> Result<String> {
        let i = self.tree.resolve(node)?;
        let n = self.tree.node(i);
        if n.is_root() {
            return Ok(format!("{node} root"));
        }
        let mut depth = 0;
        let mut cur = i;
        while cur != NONE {
            depth += self.tree.node(cur).key.len();
            cur = self.tree.node(cur).parent;
        }
        let shown: Vec<String> = n
            .key
            .iter()
            .rev()
            .take(4)
            .rev()
            .map(u32::to_string)
            .collect();
        let more = if n.key.len() > 4 { "..., " } else { "" };
        let lock = if n.kv.lock > 0 {
            format!(" locked×{}", n.kv.lock)
        } else {
            String::new()
        };
        let state = n
            .mamba
            .device
            .map_or(String::new(), |s| format!(" state={s}"));
        Ok(format!(
            "{node} depth={depth} key=[{more}{}] ({} tokens){state}{lock}",
            shown.join(", "),
            n.key.len()
        ))
    }

    /// A one-line summary.
    pub fn summary(&self) -> String {
        let states = if self.is_hybrid() {
            format!(
                ", mamba_slots={}, cached_states={}, free_mamba={}",
                self.config.mamba_slots,
                self.evictable_states + self.protected_states,
                self.available_mamba()
            )
        } else {
            String::new()
        };
        format!(
            "HybridCache(kv_slots={}, page_size={}, cached_tokens={}, evictable={}, protected={}, \
             free_kv={}, nodes={}{states})",
            self.config.kv_slots,
            self.config.page_size,
            self.total_size(),
            self.evictable_tokens,
            self.protected_tokens,
            self.available_kv(),
            self.tree.live_nodes - self.named_roots.len() - 1
        )
    }

    /// The tree as indented text: one line per node with its tokens (the first
    /// `max_tokens` of them), slots and lock count; at most `max_nodes` nodes.
    pub fn pretty(&self, max_nodes: usize, max_tokens: usize) -> String {
        let mut s = self.summary();
        let mut shown = 0;
        for (ns, root) in self.roots() {
            let _ = write!(
                s,
                "\n{}",
                ns.map_or("<default>".to_owned(), |n| format!("namespace {n:?}"))
            );
            let mut stack = vec![(root, 0usize)];
            while let Some((i, depth)) = stack.pop() {
                let n = self.tree.node(i);
                if !n.is_root() {
                    if shown == max_nodes {
                        s.push_str("\n  ...");
                        return s;
                    }
                    shown += 1;
                    let toks: Vec<String> =
                        n.key.iter().take(max_tokens).map(u32::to_string).collect();
                    let more = if n.key.len() > max_tokens {
                        ", ..."
                    } else {
                        ""
                    };
                    let kv = match (&n.kv.device, &n.kv.host) {
                        (Some(p), _) if !p.is_empty() => {
                            let first = i64::from(p[0]) * as_i64(self.config.page_size);
                            let host = if n.kv.host.is_some() { " +host" } else { "" };
                            let loading = if n.kv.loading { " loading" } else { "" };
                            format!("kv@{first}..{host}{loading}")
                        }
                        (_, Some(_)) => "host only".to_owned(),
                        _ => "no device kv".to_owned(),
                    };
                    let lock = if n.kv.lock > 0 {
                        format!(" locked×{}", n.kv.lock)
                    } else {
                        String::new()
                    };
                    let state = match (n.mamba.device, n.mamba.host, self.is_hybrid()) {
                        (Some(slot), Some(_), _) => format!(", state@{slot} +host"),
                        (Some(slot), None, _) => format!(", state@{slot}"),
                        (None, Some(h), _) => format!(", host state@{h}"),
                        (None, None, true) => ", no state".to_owned(),
                        (None, None, false) => String::new(),
                    };
                    let _ = write!(
                        s,
                        "\n{}└ {} [{}{}] {} tokens, {kv}{state}{lock}",
                        "  ".repeat(depth),
                        self.tree.id(i),
                        toks.join(", "),
                        more,
                        n.key.len()
                    );
                }
                let mut kids: Vec<u32> = n.children.iter().map(|&(_, c)| c).collect();
                kids.sort_unstable_by(|a, b| self.tree.node(*b).key.cmp(&self.tree.node(*a).key));
                let d = if n.is_root() { 1 } else { depth + 1 };
                stack.extend(kids.into_iter().map(|c| (c, d)));
            }
        }
        s
    }

    /// Checks every invariant of ARCHITECTURE.md §5 that applies (slot conservation,
    /// tree shape, lock counts and sizes, eviction candidates). Raises
    /// [`Error::Invariant`] naming the first broken one.
    pub fn audit(&self) -> Result<()> {
        crate::audit::audit(self)
    }

    /// Pool counts of the device KV pool (pages).
    pub fn kv_counts(&self) -> PoolCounts {
        self.kv_pool.counts()
    }

    /// Pool counts of the device Mamba pool (slots).
    pub fn mamba_counts(&self) -> PoolCounts {
        self.mamba_pool.counts()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            ("evictable/protected", |c| c.evictable_tokens += 1),
            ("eviction set", |c| {
                c.kv_lru.pop_first();
            }),
            ("lock count", |c| {
                let i = c.kv_lru.first().map(|&(_, i)| i).unwrap();
                c.tree.node_mut(i).kv.lock += 1;
            }),
            ("pool marks", |c| {
                // a page marked as the tree's that no node holds: a leak
                let leaked = c.kv_pool.try_alloc(1).unwrap().into_tree();
                assert_eq!(leaked.len(), 1);
            }),
            ("device children", |c| {
                let root = c.default_root;
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
}
