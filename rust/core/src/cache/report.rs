//! What the cache reports: sizes, `stats()`, `snapshot()`, and text for people.

use std::collections::HashMap;
use std::fmt::Write as _;

use crate::error::Result;
use crate::ids::NodeId;
use crate::pool::{as_i64, PageState, PoolCounts};
use crate::tree::NONE;

use super::request::SavedRequest;
use super::{Cache, NodeInfo, Payload};

/// Who holds pages as owned values (what a pool counts as `owned`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Holder {
    /// A request, or a load-back record not committed yet (its guard's).
    Request,
    /// A transfer in flight: a batch's destinations (checkpoint copy, backup), or what a
    /// committed load-back keeps until its copies end.
    InFlight,
}

/// The pools in the order of the per-pool figures: device KV, device states, host KV,
/// host states.
pub(crate) const POOLS: [&str; 4] = ["kv", "mamba", "host_kv", "host_mamba"];

impl Cache {
    /// Calls `f(pool, holder, pages)` for every run of pages held as an owned value (by
    /// requests, load-back records and batches); `pool` indexes [`POOLS`]. `stats()`
    /// sums them per holder; `audit()` checks that each page is held once and that they
    /// are exactly the pools' owned pages.
    pub(crate) fn holdings(&self, mut f: impl FnMut(usize, Holder, &[u32])) {
        for r in self.requests.iter() {
            f(0, Holder::Request, r.kv.pages());
            if let Some(s) = &r.held.state {
                f(1, Holder::Request, s.pages());
            }
            for p in &r.retired.kv {
                f(0, Holder::Request, p.pages());
            }
            for s in &r.retired.states {
                f(1, Holder::Request, s.pages());
            }
        }
        for (_, load) in self.loads.iter() {
            let holder = if load.committed {
                Holder::InFlight
            } else {
                Holder::Request
            };
            f(0, holder, load.kv.pages());
            load.held.owned(|pool, pages| f(pool, holder, pages));
            if let Some(s) = load.saved.as_ref().and_then(SavedRequest::state) {
                f(1, Holder::InFlight, s.pages());
            }
        }
        for p in self.batches.payloads() {
            match p {
                Payload::Cow(cow) => {
                    if let Some(dst) = cow.owned() {
                        f(1, Holder::InFlight, dst.pages());
                    }
                }
                Payload::Backup(b) => b.owned(|pool, pages| f(pool, Holder::InFlight, pages)),
                Payload::L3Get(g) => g.owned(|pool, pages| f(pool, Holder::InFlight, pages)),
                Payload::LoadBack | Payload::L3Put(_) => {}
            }
        }
    }

    /// Slots of each pool by where they are: `[free, cached, caller, request,
    /// draining]`, summing to the capacity. Cached: in the tree. Caller: raw indices from
    /// `alloc_kv`/`alloc_mamba`. Request: held by requests and uncommitted load-backs.
    /// Draining: held by transfers in flight, or given back while a transfer pins them
    /// (free once it ends).
    pub(crate) fn pool_slots(&self) -> [[u64; 5]; 4] {
        let mut in_flight = [0usize; 4];
        self.holdings(|k, holder, pages| {
            if holder == Holder::InFlight {
                in_flight[k] += pages.len();
            }
        });
        let pools = [
            &self.pools.kv,
            &self.pools.mamba,
            &self.pools.host_kv,
            &self.pools.host_mamba,
        ];
        let mut out = [[0u64; 5]; 4];
        for (k, pool) in pools.into_iter().enumerate() {
            let c = pool.counts();
            let per = pool.page_size() as u64;
            let slots = |n: usize| n as u64 * per;
            out[k] = [
                slots(c.free),
                slots(c.tree),
                slots(c.caller),
                slots(c.owned - in_flight[k]),
                slots(c.draining + in_flight[k]),
            ];
        }
        out
    }

    /// Device KV tokens in the tree that eviction may take (unlocked).
    pub fn evictable_size(&self) -> usize {
        self.sizes.evictable_tokens
    }

    /// Device KV tokens in the tree protected by locks.
    pub fn protected_size(&self) -> usize {
        self.sizes.protected_tokens
    }

    /// Device KV tokens in the tree.
    pub fn total_size(&self) -> usize {
        self.sizes.device_tokens()
    }

    /// Free device KV slots.
    pub fn available_kv(&self) -> usize {
        self.pools.kv.free_pages() * self.config.page_size
    }

    /// Free device Mamba state slots.
    pub fn available_mamba(&self) -> usize {
        self.pools.mamba.free_pages()
    }

    /// Device states in the tree that eviction may take (unlocked).
    pub fn evictable_states(&self) -> usize {
        self.sizes.evictable_states
    }

    /// Device states in the tree protected by locks.
    pub fn protected_states(&self) -> usize {
        self.sizes.protected_states
    }

    /// Counters and gauges, in a fixed order.
    pub fn stats(&self) -> Vec<(&'static str, u64)> {
        let [kv, mamba, host_kv, host_mamba] = self.pool_slots();
        // Part of the request slots: what failed copies took from live requests.
        let retired = self.requests.iter().fold((0, 0), |(k, s), r| {
            let (rk, rs) = r.retired.counts();
            (k + rk, s + rs)
        });
        // Engine-owned pools: the caller's slots are the engine's, the free ones queued
        // to go back to it (0 when the cache owns its pools).
        let engine_owned = self.engine_owned();
        let engine = |slots: u64| if engine_owned { slots } else { 0 };
        let ps = self.config.page_size;
        let swa = self.pools.kv.companion_counts();
        let swa_slots = |pages: usize| (pages * ps) as u64;
        let swa_free = swa_slots(self.pools.kv.companion_free());
        let host_swa = self.pools.host_kv.companion_counts();
        let host_swa_free = swa_slots(self.pools.host_kv.companion_free());
        let mut out = self.stats.entries();
        out.extend([
            (
                "nodes",
                (self.tree.live_nodes - self.roots.named() - 2) as u64,
            ),
            ("namespaces", self.roots.named() as u64 + 1),
            ("live_locks", self.locks.live() as u64),
            ("live_requests", self.requests.live() as u64),
            ("batches_in_flight", self.batches.len() as u64),
            ("batches_draining", self.draining_batches() as u64),
            ("events_emitted", self.event_counts().0),
            ("events_pending", self.event_counts().1 as u64),
            ("load_backs_pending", self.loads.len() as u64),
            // What `expect` marked and is still in the tree, and the evictions that had
            // to take such a node.
            (
                "expected_nodes",
                self.lru
                    .expected()
                    .filter(|&i| self.tree.node(i).expected != 0)
                    .count() as u64,
            ),
            ("expected_evictions", self.lru.expected_taken()),
            // Each pool: free + cached + caller + request + draining = capacity.
            ("kv_free_slots", kv[0]),
            ("kv_cached_tokens", kv[1]),
            ("kv_caller_slots", kv[2]),
            ("kv_request_slots", kv[3]),
            ("kv_draining_slots", kv[4]),
            (
                "kv_retired_slots",
                (retired.0 * self.config.page_size) as u64,
            ),
            ("kv_engine_slots", engine(kv[2])),
            ("kv_queued_slots", engine(kv[0])),
            ("kv_capacity_slots", self.config.kv_slots as u64),
            ("kv_evictable_tokens", self.sizes.evictable_tokens as u64),
            ("kv_protected_tokens", self.sizes.protected_tokens as u64),
            ("kv_evicting_tokens", self.sizes.evicting_tokens as u64),
            ("mamba_free_slots", mamba[0]),
            ("mamba_cached_states", mamba[1]),
            ("mamba_caller_slots", mamba[2]),
            ("mamba_request_slots", mamba[3]),
            ("mamba_draining_slots", mamba[4]),
            ("mamba_retired_slots", retired.1 as u64),
            ("mamba_engine_slots", engine(mamba[2])),
            ("mamba_queued_slots", engine(mamba[0])),
            ("mamba_capacity_slots", self.config.mamba_slots as u64),
            ("mamba_evictable_states", self.sizes.evictable_states as u64),
            ("mamba_protected_states", self.sizes.protected_states as u64),
            // SWA pages, each free or with the KV page it belongs to:
            // free + cached + caller + request + draining = capacity.
            ("swa_free_slots", swa_free),
            ("swa_cached_tokens", swa_slots(swa[2])),
            ("swa_caller_slots", swa_slots(swa[1])),
            ("swa_request_slots", swa_slots(swa[0])),
            ("swa_draining_slots", swa_slots(swa[3])),
            ("swa_capacity_slots", self.config.swa_slots as u64),
            ("host_kv_free_slots", host_kv[0]),
            ("host_kv_cached_tokens", host_kv[1]),
            ("host_kv_draining_slots", host_kv[4]),
            ("host_kv_capacity_slots", self.config.host_kv_slots as u64),
            ("host_kv_evictable_tokens", self.sizes.host_evictable as u64),
            // Host SWA pages, each free or with the host KV page it belongs to (the
            // tree's, or a transfer's: a backup's in flight counts as draining, as for
            // host KV): free + cached + draining = capacity.
            ("host_swa_free_slots", host_swa_free),
            ("host_swa_cached_tokens", swa_slots(host_swa[2])),
            (
                "host_swa_draining_slots",
                swa_slots(host_swa[0] + host_swa[3]),
            ),
            ("host_swa_capacity_slots", self.config.host_swa_slots as u64),
            ("host_mamba_free_slots", host_mamba[0]),
            ("host_mamba_cached_states", host_mamba[1]),
            ("host_mamba_draining_slots", host_mamba[4]),
            (
                "host_mamba_capacity_slots",
                self.config.host_mamba_slots as u64,
            ),
        ]);
        out
    }

    /// The device slots the tree holds, as `(kv slots, state slots)`, ascending: every
    /// slot of every KV page in the tree, and every state slot in it. For an engine's
    /// census of its pools (which slots are neither free nor cached); costs a pass over
    /// the pages used.
    pub fn tree_slots(&self) -> (Vec<i64>, Vec<i64>) {
        let mut kv = Vec::new();
        self.expand_into(&self.pools.kv.pages_in(PageState::Tree), &mut kv);
        let states = self.pools.mamba.pages_in(PageState::Tree);
        (kv, states.into_iter().map(i64::from).collect())
    }

    /// Every live node (roots included), per namespace, parents before children.
    pub fn snapshot(&self) -> Vec<NodeInfo> {
        let mut out = Vec::new();
        for (ns, root) in self.roots.all() {
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
                    loading: n.kv.state.loading(),
                });
                prefix_at.insert(i, prefix);
            }
        }
        out
    }

    /// A short description of a node for handles' `repr`: its id, depth, the end of its
    /// key and its lock count. A stale handle gives `Error::StaleNode`.
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
        // With engine-owned pools the free slots are those queued for the engine.
        let (owner, free) = if self.engine_owned() {
            (", pools=\"engine\"", "queued")
        } else {
            ("", "free")
        };
        let states = if self.is_hybrid() {
            format!(
                ", mamba_slots={}, cached_states={}, {free}_mamba={}",
                self.config.mamba_slots,
                self.sizes.device_states(),
                self.available_mamba()
            )
        } else {
            String::new()
        };
        format!(
            "HybridCache(kv_slots={}, page_size={}{owner}, cached_tokens={}, evictable={}, \
             protected={}, {free}_kv={}, nodes={}{states})",
            self.config.kv_slots,
            self.config.page_size,
            self.total_size(),
            self.sizes.evictable_tokens,
            self.sizes.protected_tokens,
            self.available_kv(),
            self.tree.live_nodes - self.roots.named() - 2
        )
    }

    /// The tree as indented text: one line per node with its tokens (the first
    /// `max_tokens` of them), slots and lock count; at most `max_nodes` nodes.
    pub fn pretty(&self, max_nodes: usize, max_tokens: usize) -> String {
        let mut s = self.summary();
        let mut shown = 0;
        for (ns, root) in self.roots.all() {
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
                            let loading = if n.kv.state.loading() { " loading" } else { "" };
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

    /// Pool counts of the device KV pool (pages).
    pub fn kv_counts(&self) -> PoolCounts {
        self.pools.kv.counts()
    }

    /// Pool counts of the device Mamba pool (slots).
    pub fn mamba_counts(&self) -> PoolCounts {
        self.pools.mamba.counts()
    }
}
