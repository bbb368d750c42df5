//! The L3 tier: pages of the host tier written to, and fetched from, a store that many
//! caches share (Redis, Mooncake Store, files), addressed by page hash.
//!
//! The store is a hint, never the cache's own memory: the core keeps no book of what it
//! holds, only, per node, whether its pages were written once already (`KvNode::l3`,
//! so that they are not offered again). The core does no I/O either: it emits batches,
//! as for the other tiers, that an engine runs against the store, and acknowledges.
//!
//! * **Put** (`l3_put` batches, host to store): when a backup lands, the nodes that got
//!   host copies are offered to the store, their KV pages one object per page (keyed by
//!   the page's hash) and the state at a node's end (keyed by the hash of the node's last
//!   page). The batch pins the host pages it reads (host eviction meanwhile leaves them
//!   draining) and holds nothing else. It may fail: nothing changes but that the nodes
//!   are offered again with their next backup. Under [`L3Write::HostEviction`] nothing
//!   is offered then: host eviction writes what it deletes (and the store lacks) just
//!   before it frees it, and those pages drain under the put, counted as host room on
//!   its way until it ends (`Cache::host_draining`, docs/design.md "The L3 tier").
//! * **Get** (`l3_get` batches, store to host): [`Cache::l3_fetch`] takes, all at once,
//!   a lock on the node where the cached prefix ends (it keeps the path from eviction),
//!   host pages for the pages to fetch and, with Mamba states, a host state slot for the
//!   state at their end, and emits the batch. When its copies land ([`Cache::complete`],
//!   or [`Cache::complete_l3`] for a leading part of them) the pages join the tree as
//!   host-only nodes below the locked node, as a demotion leaves them: the next match
//!   finds them on the host and a load-back brings them to the device. Whatever did not
//!   land is a miss, and every slot the batch took and did not place goes back. A hybrid
//!   prefix is only fetched up to a state, and lands only with it.

use crate::config::L3Write;
use crate::error::{Error, Result};
use crate::hashes::{chain, PageHash};
use crate::ids::NodeId;
use crate::pool::{as_i64, Pages};
use crate::tree::{KvState, NONE};

use super::components::mamba;
use super::copies::{PoolKind, SlotCopy, Tier, TransferBatch};
use super::events::{KvEvent, Medium};
use super::locks::LockReceipt;
use super::{Cache, Payload};

/// What an `l3_put` batch carries: the nodes whose data it writes (split-stable ids: a
/// split keeps the lower identity), marked as written when the batch lands.
#[derive(Default)]
pub(crate) struct Put {
    /// Nodes whose KV pages it writes.
    kv_nodes: Vec<NodeId>,
    /// Nodes whose state (at their end) it writes.
    state_nodes: Vec<NodeId>,
    /// With events on, what landing announces on the `EXTERNAL` medium.
    events: Vec<KvEvent>,
    /// Host pages and host state slots it reads that host eviction freed (they drain
    /// until it ends): `[kv pages, states]`, zero for a put a backup offered.
    frees: [usize; 2],
}

impl Put {
    /// What of the host tier it keeps draining (`[kv pages, states]`; for `audit()`).
    pub fn frees(&self) -> [usize; 2] {
        self.frees
    }
}

/// What an `l3_get` batch carries until it ends.
pub(crate) struct Get {
    /// Locks the path to `parent` (where the fetched pages continue the prefix).
    lock: Option<LockReceipt>,
    /// The node the fetched pages continue.
    parent: NodeId,
    /// The fetched pages' tokens.
    tokens: Vec<u32>,
    /// Their hashes (one per page).
    hashes: Vec<PageHash>,
    /// Host pages the objects are written into, one per page.
    kv: Pages,
    /// The host state slot for the state at the end of the pages, with Mamba states.
    state: Option<Pages>,
}

impl Get {
    /// Calls `f(pool, pages)` for the host pages the batch owns until it ends (2: host
    /// KV, 3: host states, as in `report::POOLS`).
    pub fn owned(&self, mut f: impl FnMut(usize, &[u32])) {
        f(2, self.kv.pages());
        if let Some(s) = &self.state {
            f(3, s.pages());
        }
    }
}

impl Cache {
    /// Whether pages go to the L3 tier.
    pub(crate) fn has_l3(&self) -> bool {
        self.config.l3
    }

    /// After a backup landed: offers the store what the nodes of `nodes` have on the
    /// host and have not written there yet: their KV pages, and the state at a node's
    /// end. Emits one `l3_put` batch, or nothing. Only under [`L3Write::Backup`]
    /// (under [`L3Write::HostEviction`] host eviction writes them instead).
    pub(crate) fn l3_offer(&mut self, nodes: &[u32]) {
        if self.has_l3() && self.config.l3_write == L3Write::Backup {
            self.l3_put(nodes, false);
        }
    }

    /// Host eviction is about to free node `i`'s host copies: under
    /// [`L3Write::HostEviction`], what of them the store lacks is written first. The
    /// put pins those host pages, so that they drain, unchanged, until it ends: room on
    /// its way, counted in `host_draining` until then.
    pub(crate) fn l3_write_evicted(&mut self, i: u32) {
        if self.has_l3() && self.config.l3_write == L3Write::HostEviction {
            self.l3_put(&[i], true);
        }
    }

    /// Host pages and host state slots that eviction puts in flight still read: freed
    /// when they end (`[kv pages, states]`).
    pub(crate) fn host_draining(&self) -> [usize; 2] {
        self.host_draining
    }

    /// Emits one `l3_put` batch of what the nodes of `nodes` have on the host and have
    /// not written yet, or nothing; `evicted`: their host copies are being freed (the
    /// put's pages are counted as draining until it ends).
    fn l3_put(&mut self, nodes: &[u32], evicted: bool) {
        let ps = self.config.page_size;
        let (mut kv_src, mut kv_dst) = (Vec::new(), Vec::new());
        let (mut st_src, mut st_dst) = (Vec::new(), Vec::new());
        let mut keys: Vec<PageHash> = Vec::new();
        let mut state_keys: Vec<PageHash> = Vec::new();
        let mut put = Put::default();
        for &i in nodes {
            let n = self.tree.node(i);
            let Some(host) = n.kv.host.as_deref() else {
                continue;
            };
            if n.hashes.len() != host.len() {
                continue;
            }
            if !n.kv.l3 {
                let start = kv_dst.len();
                self.expand_into(host, &mut kv_src);
                kv_dst.extend(as_i64(start)..as_i64(start + host.len() * ps));
                keys.extend_from_slice(&n.hashes);
                put.kv_nodes.push(self.tree.id(i));
                put.events.extend(self.external_event(i, true));
            }
            if let (Some(slot), Some(&last)) = (mamba::host_state_not_in_l3(n), n.hashes.last()) {
                st_src.push(i64::from(slot));
                st_dst.push(as_i64(st_dst.len()));
                state_keys.push(last);
                put.state_nodes.push(self.tree.id(i));
                put.events.extend(self.external_event(i, false));
            }
        }
        if keys.is_empty() && state_keys.is_empty() {
            return;
        }
        self.stats.l3_put_pages += keys.len() as u64;
        self.stats.l3_put_states += state_keys.len() as u64;
        if evicted {
            put.frees = [keys.len(), state_keys.len()];
            self.host_draining[0] += keys.len();
            self.host_draining[1] += state_keys.len();
            self.stats.l3_eviction_puts += 1;
        }
        let mut copies = Vec::new();
        for (pool, src, dst) in [
            (PoolKind::Kv, kv_src, kv_dst),
            (PoolKind::Mamba, st_src, st_dst),
        ] {
            if !src.is_empty() {
                copies.push(SlotCopy {
                    pool,
                    src_tier: Tier::Host,
                    dst_tier: Tier::External,
                    src,
                    dst,
                });
            }
        }
        keys.extend(state_keys);
        self.emit_keyed(copies, keys, Payload::L3Put(put));
    }

    /// An `l3_put` batch ended: landed, what it wrote is not offered again. Either way
    /// the host pages an eviction put read are free now (unless another batch reads
    /// them too).
    pub(crate) fn l3_put_ended(&mut self, put: Put, landed: bool) {
        self.host_draining[0] -= put.frees[0];
        self.host_draining[1] -= put.frees[1];
        if !landed {
            self.stats.l3_puts_failed += 1;
            return;
        }
        self.stats.l3_puts_done += 1;
        self.push_events(put.events);
        for id in put.kv_nodes {
            if let Ok(i) = self.tree.resolve(id) {
                self.edit(i, |n| n.kv.l3 = true);
            }
        }
        for id in put.state_nodes {
            if let Ok(i) = self.tree.resolve(id) {
                self.edit(i, mamba::mark_state_in_l3);
            }
        }
    }

    /// Fetches from the L3 tier what the tree lacks of the first `pages` whole pages of
    /// `tokens` in `namespace` (the pages past what it holds on either tier), with
    /// Mamba states the state at their end too (a hybrid prefix is useless without it):
    /// the caller found them in the store by their hashes ([`Cache::chain_hashes`]). Takes a lock on the node where the cached prefix
    /// ends, host pages and a host state slot, and emits an `l3_get` batch (copies from
    /// the store into those host slots; its `keys` are the pages' hashes, then the
    /// state's), which it returns. `None`, having taken nothing, when there is
    /// nothing to fetch (the tree holds that much KV already), the prefix ends in a page a
    /// load-back is bringing to the device, or there is no host room even after host
    /// eviction. The batch is not queued for `take_batches`: the caller runs it and
    /// ends it (`complete`, `complete_l3` or `fail`).
    pub fn l3_fetch(
        &mut self,
        namespace: Option<&str>,
        tokens: &[u32],
        pages: usize,
    ) -> Result<Option<TransferBatch>> {
        self.reap();
        if !self.has_l3() {
            return Err(Error::arg(
                "l3",
                "this cache has no L3 tier: construct it with l3=True",
            ));
        }
        let ps = self.config.page_size;
        let state = self.is_hybrid();
        let aligned = self.aligned(tokens.len());
        // A namespace this cache has nothing of gets its root (held by the fetch's lock;
        // dropped again if nothing lands).
        let root = self.root(namespace);
        let mut probe = std::mem::take(&mut self.probe);
        self.tree.probe(root, &tokens[..aligned], &mut probe);
        let matched = probe.matched;
        let last = probe.path.last().copied();
        let busy = probe
            .path
            .iter()
            .any(|&(i, _)| self.tree.node(i).kv.state.loading());
        self.probe = probe;
        if pages * ps > aligned {
            self.drop_root_if_empty(root);
            return Err(Error::arg(
                "pages",
                format!(
                    "{pages} pages of {ps} tokens go past the {aligned} whole-page tokens \
                     given"
                ),
            ));
        }
        if pages * ps <= matched || busy {
            self.drop_root_if_empty(root);
            self.stats.l3_fetches_called_off += 1;
            return Ok(None);
        }
        // The node where the cached prefix ends: a partly matched node is split there.
        let parent = match last {
            None => root,
            Some((i, n)) if n < self.tree.node(i).key.len() => self.split(i, n),
            Some((i, _)) => i,
        };
        let fetched = tokens[matched..pages * ps].to_vec();
        let pages = fetched.len() / ps;
        let lock = self.lock_index(parent);
        let kv = self.alloc_host_pages(pages);
        let st = if state { self.alloc_host_state() } else { None };
        let (Some(kv), true) = (kv, !state || st.is_some()) else {
            let _ = self.unlock(lock);
            self.drop_root_if_empty(parent);
            self.stats.l3_fetches_called_off += 1;
            return Ok(None);
        };
        let prior = self.tree.node(parent).hashes.last().copied();
        let hashes = chain(prior.as_ref(), &fetched, ps);
        let mut dst = Vec::with_capacity(fetched.len());
        self.expand_into(kv.pages(), &mut dst);
        let mut copies = vec![SlotCopy {
            pool: PoolKind::Kv,
            src_tier: Tier::External,
            dst_tier: Tier::Host,
            src: (0..as_i64(fetched.len())).collect(),
            dst,
        }];
        let mut keys = hashes.clone();
        if let (Some(s), Some(&h)) = (&st, hashes.last()) {
            copies.push(SlotCopy {
                pool: PoolKind::Mamba,
                src_tier: Tier::External,
                dst_tier: Tier::Host,
                src: vec![0],
                dst: s.pages().iter().map(|&p| i64::from(p)).collect(),
            });
            keys.push(h);
        }
        self.stats.l3_fetches += 1;
        self.stats.l3_fetch_pages += pages as u64;
        let get = Get {
            lock: Some(lock),
            parent: self.tree.id(parent),
            tokens: fetched,
            hashes,
            kv,
            state: st,
        };
        Ok(Some(self.emit_held_keyed(
            copies,
            keys,
            Payload::L3Get(get),
        )))
    }

    /// An `l3_get` batch ended with the first `pages` of its pages landed and (`state`)
    /// the state at their end; everything else is a miss. A hybrid fetch lands only
    /// whole, with its state. `gone`: the objects (indices into the batch's keys, checked
    /// by `complete_l3`) the store no longer holds, announced as removed from it.
    pub(crate) fn l3_get_ended(&mut self, mut get: Get, pages: usize, state: bool, gone: &[usize]) {
        self.l3_gone(&get, gone);
        let total = get.hashes.len();
        let pages = pages.min(total);
        let usable = if get.state.is_some() {
            if state && pages == total {
                total
            } else {
                0
            }
        } else {
            pages.min(total)
        };
        if usable == 0 {
            self.stats.l3_fetches_failed += 1;
        } else {
            self.stats.l3_landed_pages += usable as u64;
            self.l3_place(&mut get, usable);
        }
        if let Some(lock) = get.lock.take() {
            let _ = self.unlock(lock);
        }
        if let Ok(parent) = self.tree.resolve(get.parent) {
            self.drop_root_if_empty(parent);
        }
    }

    /// Counts the objects of `get` that the store no longer holds (`gone`, indices into
    /// its keys: its pages, then its state) and, with events on, announces them removed
    /// from the `EXTERNAL` medium, in their namespace (the fetch's lock keeps its node).
    fn l3_gone(&mut self, get: &Get, gone: &[usize]) {
        let mut gone = gone.to_vec();
        gone.sort_unstable();
        gone.dedup();
        self.stats.l3_gone_objects += gone.len() as u64;
        if !self.config.events || gone.is_empty() {
            return;
        }
        let Ok(parent) = self.tree.resolve(get.parent) else {
            return;
        };
        let namespace = self.namespace_of(parent);
        let total = get.hashes.len();
        let hashes: Vec<PageHash> = gone
            .iter()
            .filter_map(|&i| get.hashes.get(i).copied())
            .collect();
        if !hashes.is_empty() {
            self.push_events(vec![KvEvent::Removed {
                medium: Medium::External,
                namespace: namespace.clone(),
                hashes,
            }]);
        }
        if let (true, Some(&hash)) = (gone.contains(&total), get.hashes.last()) {
            self.push_events(vec![KvEvent::StateRemoved {
                medium: Medium::External,
                namespace,
                hash,
            }]);
        }
    }

    /// Places the first `pages` fetched pages below the fetch's node: pages the tree
    /// caches meanwhile are dropped, the rest becomes one host-only node (with the state
    /// at its end when the fetch has one and every page is placed).
    fn l3_place(&mut self, get: &mut Get, pages: usize) {
        let ps = self.config.page_size;
        let Ok(parent) = self.tree.resolve(get.parent) else {
            return;
        };
        let key_len = pages * ps;
        let mut probe = std::mem::take(&mut self.probe);
        self.tree.probe(parent, &get.tokens[..key_len], &mut probe);
        let matched = probe.matched;
        let last = probe.path.last().copied();
        let busy = probe
            .path
            .iter()
            .any(|&(i, _)| self.tree.node(i).kv.state.loading());
        self.probe = probe;
        if matched == key_len || busy {
            return;
        }
        let at = match last {
            None => parent,
            Some((i, n)) if n < self.tree.node(i).key.len() => self.split(i, n),
            Some((i, _)) => i,
        };
        let skip = matched / ps;
        let mut kv = std::mem::replace(&mut get.kv, self.pools.host_kv.empty());
        let rest = kv.split_off(skip);
        drop(kv);
        let mut rest = rest;
        let extra = rest.split_off(pages - skip);
        drop(extra);
        let state = (pages == get.hashes.len())
            .then(|| get.state.take())
            .flatten();
        let node = self
            .tree
            .alloc_node(at, get.tokens[matched..pages * ps].to_vec());
        self.tree.link_child(at, node);
        let hashes = get.hashes[skip..pages].to_vec();
        self.edit(node, |n| {
            n.kv.host = Some(rest.into_tree());
            n.kv.l3 = true;
            n.hashes = hashes;
            mamba::set_host_state_from_l3(n, state.and_then(|s| s.into_tree().first().copied()));
            n.kv.state = KvState::Idle;
        });
        debug_assert_ne!(at, NONE);
        self.refresh(node);
        self.refresh(at);
    }
}
