//! The request-level API a serving scheduler uses: the request table, `admit`, `extend`,
//! `abort` and the views of a request (`checkpoint` and `finish` are in
//! `request/checkpoint.rs`, a request's moves to and from a load's target in
//! `request/moves.rs`).
//!
//! A request owns what it holds: a lock receipt on the cached prefix it reuses, owned
//! KV pages for every token it added, and its own Mamba state slot. All of it lives in
//! the cache's request table (so `audit()` sees it), and every way out publishes or
//! returns it: `finish` caches everything and donates the state, `abort` gives
//! everything back, and a dropped handle aborts.

use crate::error::{Error, Result};
use crate::ids::{BatchId, NodeId, RequestId};
use crate::pool::Pages;
use crate::slab::Slab;

use super::components::shares::{NeededSlots, RequestShare, SwappedOut};
use super::locks::LockReceipt;
use super::{Cache, Payload};

mod checkpoint;
mod moves;

/// A request as it was before a committed load changed it: restored if the load fails,
/// released when it completes.
pub(crate) struct SavedRequest {
    prefix_len: usize,
    host_len: usize,
    host_node: Option<NodeId>,
    node: u32,
    lock: Option<LockReceipt>,
    /// What the load replaced of what the request holds (its earlier state slot).
    replaced: SwappedOut,
}

impl SavedRequest {
    /// The request's earlier state slot, kept until the load ends.
    pub fn state(&self) -> Option<&Pages> {
        self.replaced.state()
    }

    /// The load landed: what the request had before goes (its lock is returned, to be
    /// released).
    pub fn release(self) -> Option<LockReceipt> {
        drop(self.replaced);
        self.lock
    }
}

/// What a copy-on-write batch carries until it is acknowledged.
pub(crate) enum Cow {
    /// A request's own state slot receives a copy of a cached node's state (admission).
    /// On failure the request drops back to `prefix_len == 0` and recomputes.
    Admit { request: RequestId },
    /// `dst` receives a copy of a request's state; on success it is published on `node`
    /// (if that node still exists and has no state), on failure it is freed.
    Checkpoint { node: NodeId, dst: Pages },
}

impl Cow {
    /// The state slot the batch owns until it ends (a checkpoint's destination).
    pub fn owned(&self) -> Option<&Pages> {
        match self {
            Cow::Admit { .. } => None,
            Cow::Checkpoint { dst, .. } => Some(dst),
        }
    }
}

pub(crate) struct RequestState {
    pub namespace: Option<String>,
    /// Every token the request holds KV for: the reused prefix, then what it extended.
    pub tokens: Vec<u32>,
    /// Tokens covered by the tree path to `node` (page-aligned, locked by `lock`).
    pub prefix_len: usize,
    pub node: u32,
    pub lock: Option<LockReceipt>,
    /// Pages for `tokens[prefix_len..]`, in order.
    pub kv: Pages,
    /// What it holds of each component beyond its KV pages and lock (its state slot, its
    /// window's progress).
    pub held: RequestShare,
    pub branch_len: usize,
    pub host_len: usize,
    /// The admission copy-on-write, until it is acknowledged.
    pub cow: Option<BatchId>,
    /// The last node of the match counting host data, when it is deeper than `node`:
    /// what `load_back(request)` loads.
    pub host_node: Option<NodeId>,
    /// The admission match on any tier (`Match.kv_len` tokens) is `tokens[..admitted_from]`
    /// then `admitted_tail`: a load-back for the request may only load a prefix of it
    /// (docs/contract.md rule 9). Only the tokens past the device match are copied a second time.
    pub admitted_from: usize,
    pub admitted_tail: Vec<u32>,
    /// A load-back for this request: its guard is outstanding, or it was committed and
    /// its copies are not acknowledged yet.
    pub load: Option<BatchId>,
    /// An owned handle ([`crate::Request`]) aborts the request when dropped.
    pub handle: bool,
    /// Bumped whenever the request's tokens or slots change other than by growing at
    /// the end (a checkpoint, a load-back, a failed copy): readers that keep what they
    /// read know when to read it all again ([`Cache::request_slots_from`]).
    pub epoch: u64,
    /// Slots a failed copy took from the request (the KV it had extended, a state slot
    /// the copy was filling): a forward pass the engine already queued may still write
    /// them, so they stay the request's until it ends, and only then are freed.
    pub retired: Retired,
    /// The request's priority: what it caches takes it.
    pub priority: i64,
}

/// KV pages and state slots a request holds but no longer uses ([`RequestState::retired`]).
#[derive(Default)]
pub(crate) struct Retired {
    pub kv: Vec<Pages>,
    pub states: Vec<Pages>,
}

impl Retired {
    /// Keeps `kv` (when it holds any page) and `state` until the request ends.
    pub fn keep(&mut self, kv: Pages, state: Option<Pages>) {
        if !kv.pages().is_empty() {
            self.kv.push(kv);
        }
        self.states.extend(state);
    }

    /// KV pages and state slots held.
    pub fn counts(&self) -> (usize, usize) {
        (
            self.kv.iter().map(|p| p.pages().len()).sum(),
            self.states.iter().map(|p| p.pages().len()).sum(),
        )
    }
}

impl RequestState {
    /// Whether the admitted sequence holds `key` at position `at`.
    pub fn admitted_is(&self, at: usize, key: &[u32]) -> bool {
        let end = at + key.len();
        if end > self.admitted_from + self.admitted_tail.len() {
            return false;
        }
        // The part below `admitted_from` is in `tokens`, the rest in the tail.
        let split = self.admitted_from.clamp(at, end) - at;
        let (head, tail) = key.split_at(split);
        let from_tail = at.max(self.admitted_from) - self.admitted_from;
        (head.is_empty() || self.tokens.get(at..at + split) == Some(head))
            && self.admitted_tail[from_tail..from_tail + tail.len()] == *tail
    }
}

/// The request table.
#[derive(Default)]
pub(crate) struct Requests {
    table: Slab<RequestState>,
}

impl Requests {
    pub fn live(&self) -> usize {
        self.table.len()
    }

    pub fn iter(&self) -> impl Iterator<Item = &RequestState> {
        self.table.iter().map(|(_, r)| r)
    }
}

/// What a request holds, as seen from outside.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestView {
    /// Tokens reusable from the cache (the locked prefix).
    pub prefix_len: usize,
    /// Further tokens loadable from the host tier at admission.
    pub host_len: usize,
    /// `Match::kv_len` at admission: checkpoint here during prefill.
    pub branch_len: usize,
    /// Every token the request holds KV for.
    pub len: usize,
    /// The request's own state slot.
    pub mamba_slot: Option<u32>,
    /// The end node of the locked prefix.
    pub node: NodeId,
    /// The admission copy-on-write batch, until acknowledged.
    pub copy_pending: Option<BatchId>,
    /// A load-back for the request, from `load_back` until its copies are acknowledged.
    pub load_pending: Option<BatchId>,
}

impl Cache {
    #[inline]
    pub(crate) fn request_ref(&self, id: RequestId) -> Result<&RequestState> {
        (id.cache == self.id())
            .then(|| self.requests.table.get(id.slot))
            .flatten()
            .ok_or_else(|| stale_request(id))
    }

    #[inline]
    pub(crate) fn request_mut(&mut self, id: RequestId) -> Result<&mut RequestState> {
        (id.cache == self.id())
            .then(|| self.requests.table.get_mut(id.slot))
            .flatten()
            .ok_or_else(|| stale_request(id))
    }

    /// Whether `id` is a live request of this cache.
    pub fn request_live(&self, id: RequestId) -> bool {
        // Not through `request_ref`: its error for a dead request formats a message, and
        // every dropped request handle asks this (about a thousand instructions each).
        id.cache == self.id() && self.requests.table.get(id.slot).is_some()
    }

    /// Admits a request for `tokens`: matches, locks the reused prefix, and (with Mamba
    /// layers) gives the request its own state slot with a copy of the cached state
    /// (a `cow` batch). `None`, having taken nothing, when no state slot can be had
    /// even after eviction. The request then holds only the reused prefix; `extend`
    /// adds the rest. Refused when the engine owns the slots ([`Error::EngineOwned`]).
    pub fn admit(&mut self, namespace: Option<&str>, tokens: &[u32]) -> Result<Option<RequestId>> {
        self.admit_with_priority(namespace, tokens, 0)
    }

    /// [`Cache::admit`] for a request of `priority`: the nodes its match uses take it
    /// when it is higher, and so do those its `checkpoint` and `finish` insert (the
    /// "priority" eviction policy keeps higher priorities longer).
    pub fn admit_with_priority(
        &mut self,
        namespace: Option<&str>,
        tokens: &[u32],
        priority: i64,
    ) -> Result<Option<RequestId>> {
        self.cache_owned("admit")?;
        // The request will cache into its namespace: it gets a root now (dropped again
        // with the admission's lock if the admission is refused).
        self.root(namespace);
        let m = self.find(namespace, tokens, None, Some(priority));
        let node = m.end;
        let lock = self.lock_index(node);
        // What the request holds of each component (its state slot, with its copy).
        let mut held = RequestShare::default();
        let mut copies = Vec::new();
        if !self.admit_components(&m, &mut held, &mut copies) {
            let _ = self.unlock(lock);
            self.stats.admits_refused += 1;
            return Ok(None);
        }
        let r = RequestState {
            namespace: namespace.map(str::to_owned),
            tokens: tokens[..m.device_len].to_vec(),
            prefix_len: m.device_len,
            node,
            lock: Some(lock),
            kv: self.pools.kv.empty(),
            held,
            branch_len: m.kv_len,
            host_len: m.host_len,
            cow: None,
            host_node: (m.host_len > 0).then(|| self.tree.id(m.host_end)),
            admitted_from: m.device_len,
            admitted_tail: tokens[m.device_len..m.kv_len.max(m.device_len)].to_vec(),
            load: None,
            handle: false,
            epoch: 0,
            retired: Retired::default(),
            priority,
        };
        let id = RequestId {
            cache: self.id(),
            slot: self.requests.table.insert(r),
        };
        if !copies.is_empty() {
            let batch = self.emit(copies, Payload::Cow(Cow::Admit { request: id }));
            if let Ok(r) = self.request_mut(id) {
                r.cow = Some(batch);
            }
        }
        self.stats.admits += 1;
        Ok(Some(id))
    }

    /// Gives the request one KV slot for each of `tokens` (filling its last partial page
    /// first), plus a state slot if it has none. Returns the new tokens' slots, or
    /// `None` (nothing taken) when they cannot be had even after eviction.
    pub fn extend(&mut self, id: RequestId, tokens: &[u32]) -> Result<Option<Vec<i64>>> {
        self.cache_owned("extend")?;
        let ps = self.page_size();
        // A stale `id` is refused by the lookup below; advancing passes over it.
        self.before_growth_components(id);
        let r = self.request_ref(id)?;
        let own = r.tokens.len() - r.prefix_len;
        let need = (own + tokens.len()).div_ceil(ps) - r.kv.len();
        // What the request wants of the components' own pools (a state slot).
        let wants = self.slots_needed(r);
        // Both checked before anything is evicted, so a refusal costs the cache nothing
        // (under write-back, an eviction that did run may have started backups:
        // docs/contract.md rule 11).
        // The state first: evicting one never lowers free + evictable KV, so the KV
        // allocation that follows succeeds.
        if !self.kv_available(need) || !self.slots_available(wants) {
            self.stats.extends_refused += 1;
            return Ok(None);
        }
        // Under write-back the state slot may be on its way (its eviction started a
        // backup): the KV is asked for all the same, so that its evictions start their
        // backups in the same round (docs/contract.md rule 11: one round is always enough), and then
        // everything taken goes back.
        let mut taken = None;
        if wants.any() {
            let Some(t) = self.take_slots(wants) else {
                self.stats.extends_refused += 1;
                return Ok(None);
            };
            taken = Some(t);
        }
        let pages = if need > 0 {
            let Some(p) = self.alloc_pages(need) else {
                // `taken` goes back to the pools as it drops.
                self.stats.extends_refused += 1;
                return Ok(None);
            };
            p
        } else {
            self.pools.kv.empty()
        };
        if taken.as_ref().is_some_and(|t| t.coming) {
            // `pages` go back to the pool as they drop.
            self.stats.extends_refused += 1;
            return Ok(None);
        }
        let model = self.model();
        let r = self.request_mut(id)?;
        r.kv.append(pages);
        if let Some(t) = &mut taken {
            model.give_slots(t, r);
        }
        let start = r.tokens.len() - r.prefix_len;
        r.tokens.extend_from_slice(tokens);
        let slots = (start..start + tokens.len())
            .map(|q| {
                i64::from(r.kv.pages()[q / ps]) * crate::pool::as_i64(ps)
                    + crate::pool::as_i64(q % ps)
            })
            .collect();
        self.stats.extends += 1;
        Ok(Some(slots))
    }

    /// A decode step: one token for each of `ids` (`tokens[i]` for `ids[i]`), as `extend`
    /// would give each, in one call. All or nothing: it returns one KV slot per request,
    /// in order, or `None` (nothing taken, nothing evicted) when the whole step cannot be
    /// had even after eviction. A request may appear once.
    pub fn extend_batch(&mut self, ids: &[RequestId], tokens: &[u32]) -> Result<Option<Vec<i64>>> {
        self.cache_owned("extend_batch")?;
        if ids.len() != tokens.len() {
            return Err(Error::arg(
                "tokens",
                format!(
                    "{} tokens for {} requests: a decode step takes one token per request",
                    tokens.len(),
                    ids.len()
                ),
            ));
        }
        let ps = self.page_size();
        // Pages each request needs (0 while its last page has room), and states wanted.
        let mut needs = Vec::with_capacity(ids.len());
        let mut wants = NeededSlots::default();
        for id in ids {
            self.request_ref(*id)?;
        }
        for id in ids {
            self.before_growth_components(*id);
            let r = self.request_ref(*id)?;
            let own = r.tokens.len() - r.prefix_len;
            needs.push((own + 1).div_ceil(ps) - r.kv.len());
            wants += self.slots_needed(r);
        }
        // Every id is this cache's (checked above), so the slot alone tells them apart.
        let mut slots_seen: Vec<_> = ids.iter().map(|id| id.slot).collect();
        slots_seen.sort_unstable();
        if let Some(w) = slots_seen.windows(2).find(|w| w[0] == w[1]) {
            let dup = RequestId {
                cache: self.id(),
                slot: w[0],
            };
            return Err(Error::arg(
                "requests",
                format!("request {dup} appears twice in one decode step"),
            ));
        }
        let need: usize = needs.iter().sum();
        // As in `extend`: both checked first, states before KV.
        if !self.kv_available(need) || !self.slots_available(wants) {
            self.stats.extends_refused += 1;
            return Ok(None);
        }
        // As in `extend`: every state slot and the KV are asked for in this one round,
        // even when some state slots are on their way (they come with its backups).
        let Some(mut taken) = self.take_slots(wants) else {
            // The states taken so far went back to the pool.
            self.stats.extends_refused += 1;
            return Ok(None);
        };
        let mut pages = if need > 0 {
            let Some(p) = self.alloc_pages(need) else {
                self.stats.extends_refused += 1;
                return Ok(None);
            };
            p
        } else {
            self.pools.kv.empty()
        }
        .into_run();
        if taken.coming {
            self.stats.extends_refused += 1;
            return Ok(None);
        }
        let model = self.model();
        let mut slots = Vec::with_capacity(ids.len());
        for ((id, &token), n) in ids.iter().zip(tokens).zip(needs) {
            let r = self.request_mut(*id)?;
            if n > 0 {
                r.kv.append(pages.take(n));
            }
            model.give_slots(&mut taken, r);
            let q = r.tokens.len() - r.prefix_len;
            r.tokens.push(token);
            let page = r.kv.pages()[q / ps];
            slots.push(i64::from(page) * crate::pool::as_i64(ps) + crate::pool::as_i64(q % ps));
        }
        self.stats.extends += ids.len() as u64;
        Ok(Some(slots))
    }

    /// Gives back everything the request holds and caches nothing.
    pub fn abort(&mut self, id: RequestId) -> Result<()> {
        self.cache_owned("abort")?;
        let r = self.take_request(id)?;
        // KV pages and the state slot return as `r` drops (a slot a copy may still
        // write drains until the copy is acknowledged).
        drop(r);
        self.stats.aborts += 1;
        Ok(())
    }

    /// Removes a request from the table and releases its lock; what it still owns
    /// returns to the pools when the returned state drops.
    fn take_request(&mut self, id: RequestId) -> Result<RequestState> {
        self.request_ref(id)?;
        let mut r = self
            .requests
            .table
            .remove(id.slot)
            .ok_or_else(|| stale_request(id))?;
        if let Some(lock) = r.lock.take() {
            // Cannot fail: the request's receipt is live until here.
            let _ = self.unlock(lock);
        }
        Ok(r)
    }

    /// Marks request `id` as owned by a handle ([`crate::HybridCache::request_handle`]);
    /// a request has at most one.
    pub fn own_request(&mut self, id: RequestId) -> Result<()> {
        let r = self.request_mut(id)?;
        if r.handle {
            return Err(Error::Request(format!(
                "request {id} is owned by a handle already"
            )));
        }
        r.handle = true;
        Ok(())
    }

    /// [`Cache::abort`] for a handle dropped while its request was live.
    pub(crate) fn drop_request(&mut self, id: RequestId) {
        if self.abort(id).is_ok() {
            self.stats.requests_dropped += 1;
        }
    }

    pub(crate) fn refuse_while_copying(&self, id: RequestId, what: &str) -> Result<()> {
        let r = self.request_ref(id)?;
        if let Some(batch) = r.cow {
            return Err(Error::Request(format!(
                "cannot {what} request {id}: its state copy (batch {batch}) is not \
                 acknowledged yet; complete or fail it first"
            )));
        }
        if let Some(batch) = r.load {
            return Err(Error::Request(format!(
                "cannot {what} request {id}: its load-back (batch {batch}) is not \
                 committed and acknowledged yet; release it, or complete or fail it first"
            )));
        }
        Ok(())
    }

    /// What the request holds.
    pub fn request(&self, id: RequestId) -> Result<RequestView> {
        let r = self.request_ref(id)?;
        Ok(RequestView {
            prefix_len: r.prefix_len,
            host_len: r.host_len,
            branch_len: r.branch_len,
            len: r.tokens.len(),
            mamba_slot: r.held.state_slot(),
            node: self.tree.id(r.node),
            copy_pending: r.cow,
            load_pending: r.load,
        })
    }

    /// Every token the request holds KV for.
    pub fn request_tokens(&self, id: RequestId) -> Result<Vec<u32>> {
        Ok(self.request_ref(id)?.tokens.clone())
    }

    /// The device KV slot of every token the request holds, in order.
    pub fn request_kv_indices(&self, id: RequestId) -> Result<Vec<i64>> {
        Ok(self.request_slots_from(id, None, 0)?.items)
    }

    /// What a reader that kept the first `from` tokens of the request, read at `epoch`,
    /// lacks: the tokens from `from` on while the epoch is unchanged (what the request
    /// grew by since), or all of them (`start == 0`) when it changed or was not given.
    /// Costs time in proportion to what it returns.
    pub fn request_tokens_from(
        &self,
        id: RequestId,
        epoch: Option<u64>,
        from: usize,
    ) -> Result<Grown<u32>> {
        let r = self.request_ref(id)?;
        let start = unchanged(r, epoch, from).unwrap_or(0);
        Ok(Grown {
            epoch: r.epoch,
            start,
            items: r.tokens[start..].to_vec(),
        })
    }

    /// [`Cache::request_tokens_from`] for the request's device KV slots.
    pub fn request_slots_from(
        &self,
        id: RequestId,
        epoch: Option<u64>,
        from: usize,
    ) -> Result<Grown<i64>> {
        let r = self.request_ref(id)?;
        let len = r.tokens.len();
        let (ps, prefix) = (self.page_size(), r.prefix_len);
        // Slots past the reused prefix are the request's own pages, in order.
        let own_slot = |q: usize| {
            i64::from(r.kv.pages()[q / ps]) * crate::pool::as_i64(ps) + crate::pool::as_i64(q % ps)
        };
        let (start, items) = if let Some(f) = unchanged(r, epoch, from).filter(|&f| f >= prefix) {
            (f, (f - prefix..len - prefix).map(own_slot).collect())
        } else {
            let mut out = self.path_slots(r.node, prefix);
            out.extend((0..len - prefix).map(own_slot));
            (0, out)
        };
        Ok(Grown {
            epoch: r.epoch,
            start,
            items,
        })
    }
}

/// What a request grew by since a read ([`Cache::request_tokens_from`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grown<T> {
    /// The request's epoch now: keep it for the next read.
    pub epoch: u64,
    /// Where `items` start: the reader's `from`, or 0 when everything is returned.
    pub start: usize,
    /// The entries from `start` to the end.
    pub items: Vec<T>,
}

/// `from`, when a reader at `epoch` that kept `from` entries may keep them.
fn unchanged(r: &RequestState, epoch: Option<u64>, from: usize) -> Option<usize> {
    (epoch == Some(r.epoch) && from <= r.tokens.len()).then_some(from)
}

fn stale_request(id: RequestId) -> Error {
    Error::Request(format!(
        "request {id} is not live in this cache (finished, aborted, or from another cache)"
    ))
}
