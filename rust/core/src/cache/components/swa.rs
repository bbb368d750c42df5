//! The sliding-window attention (SWA) component: what it keeps per node, how it cuts a
//! match, how it is evicted and locked, and what `audit()` checks for it.
//!
//! An SWA layer attends to the last `swa_window` tokens only, so a cached prefix is
//! usable for it when the SWA KV of the last W tokens before the cut is still there.
//! The SWA pages are paired with the KV pages by the KV pool (`pool/companion.rs`: a KV page holds
//! at most one SWA page, which goes wherever the KV page goes and is freed with it at the
//! latest), so the tree stores no SWA slot: a node's SWA is live on the pages that have
//! their pair. A node none of whose pages has one is a *tombstone* for this component:
//! its full KV stays, usable by deeper matches that have their own window.
//!
//! - **Match**: the cut must end `need` live SWA tokens (W rounded up to whole pages:
//!   with pages larger than the window, the last page must be live), counted back over
//!   node boundaries; a prefix shorter than that needs all its tokens live; the empty
//!   prefix is always usable.
//! - **Eviction**: its own queue, in the SWA policy's order (`eviction_policy`'s
//!   `"swa"`: least recently used, least often matched or lowest priority node first;
//!   [`super::eviction::Lru::swa_key`]), of the nodes with live SWA that no window lock covers. An internal node loses its SWA pages and stays as a
//!   tombstone; a leaf goes whole (with its KV: a tombstone is never a leaf). A leaf
//!   deleted by any eviction takes its parent along when that leaves the parent an
//!   unlocked leaf whose last page is not live (`evict.rs`).
//! - **Locks**: a receipt's window covers only the last W tokens of its path: each node
//!   it touches holds one entry (the window tokens in and above it), so a split hands
//!   the upper part exactly the entries that reach into it, and the release removes
//!   exactly what the lock added, once.
//! - **Audit**: the pairing (pool), the lock entries against the live receipts, the
//!   eviction queue's membership, and that no unlocked leaf ends in a dead page.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::error::Result;
use crate::ids::{NodeId, RequestId};
use crate::pool::Pages;
use crate::tree::NONE;

use super::shares::{BackupExtras, LoadExtras};
use super::{Component, ComponentKind, Model};
use crate::cache::copies::{PoolKind, Tier};
use crate::cache::eviction::Key;
use crate::cache::request::RequestState;
use crate::cache::results::CallOff;
use crate::cache::{Cache, Parts, Pools, View};
use crate::tree::Tree;

mod audit;
mod evict;

/// An SWA eviction queue entry: `(key, node index, node generation)`.
type QueueEntry = (Key, u32, u64);

/// The SWA component's own state: the window and the eviction queue.
#[derive(Default)]
pub(crate) struct Swa {
    /// Tokens a match must end with live SWA KV: the window rounded up to whole pages
    /// (0: no SWA layers).
    need: usize,
    /// Set while a device eviction removes a leaf: device leaves that host eviction
    /// leaves ending in a dead SWA page meanwhile wait in `dead` until it is done.
    holding: bool,
    /// Those leaves.
    dead: Vec<NodeId>,
    /// Eviction candidates, lowest key first: `(key, node, generation)`, the key the SWA
    /// policy gave the node when it was queued. Keys only grow while a node lives, so an
    /// entry is at or before its node's place: one whose node's key grew since is pushed
    /// again under the new key when it comes up; one whose node is gone, locked or dead
    /// is dropped.
    queue: BinaryHeap<Reverse<QueueEntry>>,
}

impl Swa {
    /// The component for a window of `window` tokens in pages of `page_size` (`window`
    /// 0: none).
    pub fn new(window: usize, page_size: usize) -> Swa {
        Swa {
            need: window.div_ceil(page_size) * page_size,
            holding: false,
            dead: Vec::new(),
            queue: BinaryHeap::new(),
        }
    }

    /// Tokens a match must end with live SWA KV (0: no SWA layers).
    #[inline]
    pub fn need(&self) -> usize {
        self.need
    }
}

/// Sliding-window attention.
pub(crate) struct SlidingWindow;

impl Component for SlidingWindow {
    /// The live SWA tokens ending at the current node: on the device, and counting
    /// host-only nodes by their host SWA pages.
    type Walk = (usize, usize);

    #[inline]
    fn active(model: Model) -> bool {
        model.has(ComponentKind::Swa)
    }

    #[inline]
    fn cut(c: &Cache, walk: &mut (usize, usize), i: u32, depth: usize, on_device: bool) -> bool {
        walk.0 = if on_device { c.swa_run(i, walk.0) } else { 0 };
        // A prefix shorter than the window needs all its tokens live.
        walk.0 >= c.swa.need() || walk.0 == depth
    }

    #[inline]
    fn cut_any_tier(c: &Cache, walk: &mut (usize, usize), i: u32, depth: usize) -> bool {
        walk.1 = c.swa_run_any(i, walk.1);
        walk.1 >= c.swa.need() || walk.1 == depth
    }

    fn cut_inside(
        c: &Cache,
        walk: &mut (usize, usize),
        i: u32,
        len: usize,
        depth: usize,
        on_device: bool,
    ) -> (bool, bool) {
        let need = c.swa.need();
        let device = if on_device {
            c.swa_run_inside(i, len, walk.0, false)
        } else {
            0
        };
        let any = c.swa_run_inside(i, len, walk.1, true);
        (
            device >= need || device == depth,
            any >= need || any == depth,
        )
    }

    fn lock(p: &mut Parts, i: u32, _: bool) -> bool {
        p.swa_lock(i);
        false
    }

    fn release(p: &mut Parts, i: u32, _: bool) {
        p.swa_unlock(i);
    }

    fn split(p: &mut Parts, upper: u32, lower: u32) {
        p.swa_split(upper, lower);
    }

    fn audit(c: &Cache) -> Result<()> {
        c.audit_swa()
    }

    /// The request's own pages whose tokens left the window give back their SWA pages.
    fn before_growth(c: &mut Cache, id: RequestId) {
        c.slide_window(id);
    }

    /// The window starts over with the tokens it recomputes.
    fn restart(r: &mut RequestState) {
        r.held.swa_freed_to = 0;
    }

    /// Dead window pages of the node revive from the duplicate's SWA pages.
    fn passed_duplicate(p: &mut Parts, i: u32, dup: &[u32]) {
        p.swa_revive(i, dup);
    }

    /// A leaf ending in a dead SWA page would be a host tombstone leaf.
    fn backup_useless(v: &View, i: u32) -> bool {
        v.swa_dead_end(i)
    }

    /// The host SWA pages of the device pages that have an SWA page (all or nothing).
    fn backup_paired_pages(p: &mut Parts, i: u32, host: &[u32], copies: &mut BackupExtras) -> bool {
        p.swa_backup(i, host, &mut copies.swa_copy)
    }

    /// A node ending in a dead SWA page (a tombstone, or one whose tail went) ends no
    /// match.
    fn live_end(v: &View, i: u32) -> bool {
        !v.swa_dead_end(i)
    }

    /// A match needs a live window at its end: the last host page has its host SWA
    /// page, or the node has children.
    fn useful_on_host(v: &View, i: u32) -> bool {
        let n = v.tree.node(i);
        !n.children.is_empty()
            || n.kv
                .host
                .as_deref()
                .is_none_or(|host| v.pools.host_kv.companion_tail(host) > 0)
    }

    /// The window at the target must be live counting host-only nodes; the host pages
    /// read are kept for [`Component::load_paired_pages`].
    fn load_plan(v: &View, j: u32, _: bool, plan: &mut LoadExtras) -> Result<()> {
        plan.window_dead = !v.swa_window_live_any(j);
        for i in v.path_to(j) {
            let n = v.tree.node(i);
            if let (None, Some(host)) = (&n.kv.device, &n.kv.host) {
                plan.host_pages.extend_from_slice(host);
            }
        }
        Ok(())
    }

    /// The window's loaded pages get device SWA pages with the copies of their host
    /// SWA pages.
    fn load_paired_pages(
        c: &mut Cache,
        kv: &Pages,
        plan: &mut LoadExtras,
    ) -> std::result::Result<(), CallOff> {
        let host = std::mem::take(&mut plan.host_pages);
        plan.swa_copy = c.load_swa(&host, kv).ok_or(CallOff::Swa)?;
        plan.held.swa_pages = plan.swa_copy.0.len() / c.page_size();
        Ok(())
    }
}

impl Cache {
    /// True when the model has SWA layers.
    #[inline]
    pub fn has_swa(&self) -> bool {
        self.swa.need > 0
    }

    /// Tokens at the end of node `i` whose SWA KV is live (its trailing pages that have
    /// their SWA page).
    #[inline]
    pub(crate) fn swa_tail(&self, i: u32) -> usize {
        live_tail(&self.tree, &self.pools, self.config.page_size, i)
    }

    /// Whether node `i` ends in a dead SWA page (a tombstone, or a node whose tail went):
    /// no match can be cut at its end.
    #[inline]
    pub(crate) fn swa_dead_end(&self, i: u32) -> bool {
        self.view().swa_dead_end(i)
    }

    /// The live SWA tokens ending at node `i`'s end, given `run` ending at its start.
    #[inline]
    pub(crate) fn swa_run(&self, i: u32, run: usize) -> usize {
        let len = self.tree.node(i).key.len();
        let tail = self.swa_tail(i);
        if tail == len {
            run + len
        } else {
            tail
        }
    }

    /// Tokens at the end of node `i` whose SWA KV is there where the node's KV is read
    /// from: on the device when it has device KV, else on the host (its host pages that
    /// have their host SWA page). What a match through host-only nodes counts.
    #[inline]
    pub(crate) fn swa_tail_any(&self, i: u32) -> usize {
        tail_any(&self.tree, &self.pools, self.config.page_size, i)
    }

    /// [`Cache::swa_run`] counting host-only nodes by their host SWA pages
    /// ([`Cache::swa_tail_any`]).
    #[inline]
    pub(crate) fn swa_run_any(&self, i: u32, run: usize) -> usize {
        run_any(&self.tree, &self.pools, self.config.page_size, i, run)
    }

    /// [`Cache::swa_run`] (with `any`, [`Cache::swa_run_any`]) for the first `len` tokens
    /// of node `i` (whole pages): what the upper part of a split there would give.
    pub(crate) fn swa_run_inside(&self, i: u32, len: usize, run: usize, any: bool) -> usize {
        let n = self.tree.node(i);
        let ps = self.config.page_size;
        let k = len / ps;
        let pages = match (n.kv.device.as_deref(), n.kv.host.as_deref()) {
            (Some(pages), _) => self.pools.kv.companion_tail(&pages[..k]),
            (None, Some(host)) if any => self.pools.host_kv.companion_tail(&host[..k]),
            _ => 0,
        };
        let tail = pages * ps;
        if tail == len {
            run + len
        } else {
            tail
        }
    }

    /// Whether host-only node `i` ends in a host page without its host SWA page: as a
    /// leaf no match could end there (a host tombstone leaf), so it is not kept.
    pub(crate) fn swa_host_dead_end(&self, i: u32) -> bool {
        let n = self.tree.node(i);
        self.has_swa() && !n.is_root() && n.kv.device.is_none() && self.swa_tail_any(i) == 0
    }

    /// SWA: gives the loaded device pages `kv` (one per host page of `host`, in path
    /// order) that fall in the target's window the device SWA pages of their host SWA
    /// pages, evicting device SWA when short, and returns the copies' `(host slots,
    /// device slots)`. The pages hold them: dropping `kv` (a release, a failure) frees
    /// them, a commit publishes them with the KV. `None`, having given none, when the
    /// device cannot make room. Pages older than the window load without their SWA KV
    /// (SWA tombstones on the device; their host copy keeps it).
    pub(crate) fn load_swa(&mut self, host: &[u32], kv: &Pages) -> Option<(Vec<i64>, Vec<i64>)> {
        let mut copy = (Vec::new(), Vec::new());
        if !self.has_swa() || host.is_empty() {
            return Some(copy);
        }
        let window = self.swa.need() / self.page_size();
        let from = host.len().saturating_sub(window);
        let (src, dst): (Vec<u32>, Vec<u32>) = self
            .pools
            .host_kv
            .companions(&host[from..])
            .iter()
            .zip(&kv.pages()[from..])
            .filter_map(|(s, &d)| s.map(|s| (s, d)))
            .unzip();
        if dst.is_empty() {
            return Some(copy);
        }
        if !self.swa_attach(&dst) {
            return None;
        }
        self.parts()
            .swa_copy_into(&src, Tier::Device, &dst, &mut copy);
        Some(copy)
    }
}

// The window of a request's own pages.
impl Cache {
    /// SWA: gives back the SWA pages of the request's own pages whose tokens all left
    /// the window (every page ending at or before `len - W`, `len` the request's
    /// tokens): the next token attends to the last W tokens only. The window before the
    /// request's last whole page stays too (one page more when pages are larger than
    /// the window), so that what `checkpoint` and `finish` cache ends in a live window
    /// and can be matched (no tombstone leaf).
    pub(crate) fn slide_window(&mut self, id: RequestId) {
        let w = self.config.swa_window;
        if w == 0 {
            return;
        }
        let ps = self.config.page_size;
        let need = self.swa.need();
        let Ok(r) = self.request_ref(id) else {
            return;
        };
        let len = r.tokens.len();
        let cut = (len.saturating_sub(w) / ps * ps).min((len / ps * ps).saturating_sub(need));
        let from = r.held.swa_freed_to.max(r.prefix_len);
        if cut <= from {
            return;
        }
        let pages = &r.kv.pages()[(from - r.prefix_len) / ps..(cut - r.prefix_len) / ps];
        let freed = self.pools.kv.detach_companion(pages);
        self.stats.swa_window_freed_pages += freed as u64;
        if let Ok(r) = self.request_mut(id) {
            r.held.swa_freed_to = cut;
        }
    }

    /// SWA: the window of request `id`: `(start, slots)`, the SWA slot of each of its
    /// tokens from `start` to its end. `start` is the first token whose SWA KV the
    /// request still holds (its own pages, or the locked prefix's window): at most the
    /// last `swa_window` tokens before its last `extend` (what the forward pass of the
    /// tokens that extend added reads), aligned to `tokens[start:]`. Without SWA layers
    /// `(len, [])`.
    pub fn request_swa_indices(&self, id: RequestId) -> Result<(usize, Vec<i64>)> {
        let r = self.request_ref(id)?;
        let (start, pages) = self.window_of(r);
        let ps = self.config.page_size;
        let slots = (start..r.tokens.len())
            .map(|q| {
                // Every token of the window has its SWA page (`audit()` checks it).
                let page = pages.get(q / ps - start / ps).copied().flatten();
                page.map_or(-1, |p| {
                    i64::from(p) * crate::pool::as_i64(ps) + crate::pool::as_i64(q % ps)
                })
            })
            .collect();
        Ok((start, slots))
    }

    /// SWA: where request `r`'s window starts, and the SWA page of each page from there
    /// to its end (`None`: none, a bug).
    pub(crate) fn window_of(&self, r: &RequestState) -> (usize, Vec<Option<u32>>) {
        let w = self.config.swa_window;
        let len = r.tokens.len();
        if w == 0 {
            return (len, Vec::new());
        }
        let ps = self.config.page_size;
        let start = r.held.swa_freed_to.max(r.prefix_len.saturating_sub(w));
        // Pages of the path to the request's node, then its own.
        let mut pages: Vec<u32> = Vec::new();
        for i in self.path_to(r.node) {
            if let Some(p) = &self.tree.node(i).kv.device {
                pages.extend_from_slice(p);
            }
        }
        pages.truncate(r.prefix_len / ps);
        pages.extend_from_slice(r.kv.pages());
        let last = len.div_ceil(ps).min(pages.len());
        let first = (start / ps).min(last);
        (start, self.pools.kv.companions(&pages[first..last]))
    }
}

impl Parts<'_> {
    /// True when the model has SWA layers.
    #[inline]
    fn has_swa(&self) -> bool {
        self.swa.need > 0
    }

    /// Backup of node `i`: gives host pages `host` (new, one per device page of the
    /// node) the host SWA pages of the device pages that have an SWA page, and appends
    /// the SWA copies (device slots to host slots) to `copy`. All or nothing: false,
    /// having given none, when the host SWA pages are short (the KV is then backed up
    /// without its SWA KV).
    pub(crate) fn swa_backup(
        &mut self,
        i: u32,
        host: &[u32],
        copy: &mut (Vec<i64>, Vec<i64>),
    ) -> bool {
        if !self.has_swa() || self.config.host_kv_slots == 0 {
            return true;
        }
        let device = self.tree.node(i).kv.device.as_deref().unwrap_or_default();
        let (src, dst): (Vec<u32>, Vec<u32>) = self
            .pools
            .kv
            .companions(device)
            .iter()
            .zip(host)
            .filter_map(|(s, &h)| s.map(|s| (s, h)))
            .unzip();
        if dst.is_empty() {
            return true;
        }
        if !self.pools.host_kv.attach_companion(&dst) {
            self.stats.swa_backup_skipped_pages += dst.len() as u64;
            return false;
        }
        let pages = self.swa_copy_into(&src, Tier::Host, &dst, copy);
        self.stats.swa_backed_up_pages += pages as u64;
        true
    }

    /// Adds to `copy` the SWA slots of a copy from SWA pages `src` to the SWA pages the
    /// KV pages `dst` (of `tier`, given theirs already) hold; returns the pages copied.
    pub(crate) fn swa_copy_into(
        &self,
        src: &[u32],
        tier: Tier,
        dst: &[u32],
        copy: &mut (Vec<i64>, Vec<i64>),
    ) -> usize {
        // SWA pages have no L3 copies (the L3 tier refuses SWA models).
        let Some(pool) = self.pools.of(PoolKind::Kv, tier) else {
            return 0;
        };
        let dst: Vec<u32> = pool.companions(dst).into_iter().flatten().collect();
        self.expand_into(src, &mut copy.0);
        self.expand_into(&dst, &mut copy.1);
        dst.len()
    }

    /// [`Cache::swa_tail`].
    #[inline]
    pub(crate) fn swa_tail(&self, i: u32) -> usize {
        live_tail(self.tree, self.pools, self.config.page_size, i)
    }

    /// Adds a window lock ending at node `i`: an entry on every node the last `need`
    /// tokens of its path touch.
    pub(crate) fn swa_lock(&mut self, i: u32) {
        let mut left = self.swa.need;
        let mut cur = i;
        while left > 0 && cur != NONE && !self.tree.node(cur).is_root() {
            let n = self.tree.node_mut(cur);
            n.swa.locks.push(crate::pool::index_u32(left));
            left = left.saturating_sub(n.key.len());
            cur = n.parent;
        }
    }

    /// Removes the window lock ending at node `i` (exactly the entries
    /// [`Parts::swa_lock`] added, splits since included); a node left without a window
    /// lock becomes an eviction candidate again. An entry that is not there is a bug,
    /// which breaks the cache (see [`Cache::fault`]).
    pub(crate) fn swa_unlock(&mut self, i: u32) {
        let mut left = self.swa.need;
        let mut cur = i;
        while left > 0 && cur != NONE && !self.tree.node(cur).is_root() {
            let want = crate::pool::index_u32(left);
            let n = self.tree.node_mut(cur);
            if let Some(k) = n.swa.locks.iter().position(|&e| e == want) {
                n.swa.locks.swap_remove(k);
            } else {
                let id = self.tree.id(cur);
                self.pools.kv.record_fault(format!(
                    "illegal SWA unlock: node {id} holds no window lock of {want} tokens"
                ));
                return;
            }
            let (len, parent) = (n.key.len(), n.parent);
            self.swa_enqueue(cur);
            left = left.saturating_sub(len);
            cur = parent;
        }
    }

    /// After node `lower` was split, its new upper part `upper` takes the window locks
    /// that reach above `lower` (less `lower`'s length), and is queued if it can be
    /// evicted.
    pub(crate) fn swa_split(&mut self, upper: u32, lower: u32) {
        if !self.has_swa() {
            return;
        }
        let l = self.tree.node(lower);
        let len = crate::pool::index_u32(l.key.len());
        let reach: Vec<u32> = l
            .swa
            .locks
            .iter()
            .filter(|&&e| e > len)
            .map(|&e| e - len)
            .collect();
        self.tree.node_mut(upper).swa.locks = reach;
        self.swa_enqueue(upper);
    }

    /// Moves the SWA pages of a caller's duplicate pages `dup` onto node `i`'s last
    /// pages that have none (a tombstone revived by an insert of the same tokens): each
    /// SWA page goes to the node's page of the same tokens, so its slot keeps the KV its
    /// tokens wrote (a fresh page would hold another sequence's).
    pub(crate) fn swa_revive(&mut self, i: u32, dup: &[u32]) {
        let Some(pages) = self.tree.node(i).kv.device.as_deref() else {
            return;
        };
        // The duplicates are the node's last pages, aligned from the end.
        let n = dup.len().min(pages.len());
        let moved = self
            .pools
            .kv
            .move_companions(&dup[dup.len() - n..], &pages[pages.len() - n..]);
        if moved > 0 {
            self.stats.swa_revived_pages += moved as u64;
            self.swa_enqueue(i);
        }
    }
}

/// Tokens at the end of node `i` of `tree` whose SWA KV is live (its trailing device
/// pages that have their SWA page in `pools`).
#[inline]
fn live_tail(tree: &Tree, pools: &Pools, page_size: usize, i: u32) -> usize {
    tree.node(i)
        .kv
        .device
        .as_deref()
        .map_or(0, |pages| pools.kv.companion_tail(pages) * page_size)
}

impl View<'_> {
    /// True when the model has SWA layers.
    #[inline]
    fn has_swa(&self) -> bool {
        self.swa.need > 0
    }

    /// [`Cache::swa_dead_end`].
    #[inline]
    pub(crate) fn swa_dead_end(&self, i: u32) -> bool {
        self.has_swa()
            && !self.tree.node(i).is_root()
            && live_tail(self.tree, self.pools, self.config.page_size, i) == 0
    }

    /// Whether the path to node `i` ends in a live window counting host-only nodes by
    /// their host SWA pages: what a load-back to `i` needs (always, without SWA layers).
    pub(crate) fn swa_window_live_any(&self, i: u32) -> bool {
        if !self.has_swa() {
            return true;
        }
        let (mut run, mut depth) = (0, 0);
        for j in self.path_to(i) {
            run = run_any(self.tree, self.pools, self.config.page_size, j, run);
            depth += self.tree.node(j).key.len();
        }
        run >= self.swa.need || run == depth
    }
}

/// Tokens at the end of node `i` of `tree` whose SWA KV is there where the node's KV is
/// read from: on the device when it has device KV, else on the host (its host pages
/// that have their host SWA page). What a match through host-only nodes counts.
#[inline]
fn tail_any(tree: &Tree, pools: &Pools, page_size: usize, i: u32) -> usize {
    let n = tree.node(i);
    match (&n.kv.device, &n.kv.host) {
        (Some(_), _) => live_tail(tree, pools, page_size, i),
        (None, Some(host)) => pools.host_kv.companion_tail(host) * page_size,
        (None, None) => 0,
    }
}

/// The live SWA tokens ending at node `i`'s end, given `run` ending at its start,
/// counting host-only nodes by their host SWA pages ([`tail_any`]).
fn run_any(tree: &Tree, pools: &Pools, page_size: usize, i: u32, run: usize) -> usize {
    let len = tree.node(i).key.len();
    let tail = tail_any(tree, pools, page_size, i);
    if tail == len {
        run + len
    } else {
        tail
    }
}
