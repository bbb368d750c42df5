//! Caching what a request holds: `checkpoint` (chunked prefill) and `finish`, the
//! insert both share, and the end of a copy-on-write batch (an admission's copy of the
//! matched state, or a checkpoint's copy of the request's state to the tree).

use crate::error::Result;
use crate::ids::{BatchId, LockId, RequestId};

use super::{Cow, RequestState};
use crate::cache::components::mamba;
use crate::cache::components::shares::RequestShare;
use crate::cache::locks::LockReceipt;
use crate::cache::{Cache, Payload};

impl Cache {
    /// Caches what the request holds so far (chunked prefill): inserts its whole pages,
    /// moves its lock to the new end node, and (with Mamba layers, at a page-aligned
    /// length) gives the tree a copy of the request's state through a `cow` batch. The
    /// unaligned tail stays with the request. Re-read the request's `kv_indices`
    /// afterwards: tokens another request cached meanwhile now use the cache's slots.
    pub fn checkpoint(&mut self, id: RequestId) -> Result<()> {
        self.cache_owned("checkpoint")?;
        self.refuse_while_copying(id, "checkpoint")?;
        let (end, cached) = self.cache_request(id, false)?;
        self.maybe_backup(end);
        let r = self.request_ref(id)?;
        let at_end = r.tokens.len() == cached && !self.tree.node(end).is_root();
        // The tree's copy of what the request holds (its state).
        self.checkpoint_components(id, end, at_end);
        self.stats.checkpoints += 1;
        Ok(())
    }

    /// Caches every whole page the request holds, donates its state slot to the end node
    /// (freed instead when the node has one, or when the request's length is not
    /// page-aligned), releases its lock and frees the rest. The request holds nothing
    /// afterwards.
    ///
    /// At an unaligned length the state (of every token) ends at no node's end and is
    /// freed: to keep the turn's end state, the engine checkpoints the request when its
    /// length is page-aligned for the last time (docs/contract.md rule 2). A finish whose
    /// last whole page ends with no state on any tier, and no checkpoint copy on its way
    /// there, counts `finish_states_lost`.
    pub fn finish(&mut self, id: RequestId) -> Result<()> {
        self.cache_owned("finish")?;
        self.refuse_while_copying(id, "finish")?;
        let (end, cached) = self.cache_request(id, true)?;
        let mut r = self.take_request(id)?;
        let at_end = r.tokens.len() == cached && !self.tree.node(end).is_root();
        if self.end_state_lost(&r, end, cached) {
            self.stats.finish_states_lost += 1;
        }
        // The end node keeps what it can use of what the request holds (its state).
        self.keep_on_node_components(end, at_end, &mut r.held);
        drop(r);
        self.maybe_backup(end);
        self.stats.finishes += 1;
        Ok(())
    }

    /// Whether finishing request `r`, cached up to node `end` (`cached` tokens), loses
    /// its turn's end state: it holds a state, its length is not page-aligned, its whole
    /// pages were all cached (no load in flight stopped the insert short of them) and
    /// there is at least one, and `end` has no state on any tier and no checkpoint copy
    /// on its way (a checkpoint at its last whole page would have kept one there).
    fn end_state_lost(&self, r: &RequestState, end: u32, cached: usize) -> bool {
        let ps = self.page_size();
        let len = r.tokens.len();
        if r.held.state.is_none() || len.is_multiple_of(ps) || cached != len / ps * ps {
            return false;
        }
        let n = self.tree.node(end);
        if n.is_root() || mamba::has_state_any_tier(n) {
            return false;
        }
        let node = self.tree.id(end);
        !self
            .batches
            .payloads()
            .any(|p| matches!(p, Payload::Cow(Cow::Checkpoint { node: to, .. }) if *to == node))
    }

    /// Inserts the request's whole pages; the lock moves to the end node (unless the
    /// request is finishing). Returns the end node and the length now cached (the
    /// aligned length, or less when a load in flight stopped the insert: the pages past
    /// it stay the request's).
    fn cache_request(&mut self, id: RequestId, finishing: bool) -> Result<(u32, usize)> {
        let ps = self.page_size();
        // Pages out of the window are published as SWA tombstones.
        self.request_ref(id)?;
        self.before_growth_components(id);
        let r = self.request_mut(id)?;
        let tokens = std::mem::take(&mut r.tokens);
        let aligned = tokens.len() / ps * ps;
        let prefix_len = r.prefix_len;
        let give = (aligned - prefix_len) / ps;
        let rest = r.kv.split_off(give);
        let given = std::mem::replace(&mut r.kv, rest);
        let namespace = r.namespace.clone();
        let priority = r.priority;
        let root = self.root(namespace.as_deref());
        let mut probe = std::mem::take(&mut self.probe);
        self.tree.probe(root, &tokens[..aligned], &mut probe);
        // The request's prefix is locked, so the probe passes it: the pages given cover
        // exactly tokens[prefix_len..aligned].
        let published = self.publish(
            root,
            &probe,
            &tokens[..aligned],
            prefix_len,
            given,
            None,
            priority,
        );
        self.probe = probe;
        let (end, cached) = (published.end, published.cached);
        if let Ok(r) = self.request_mut(id) {
            // Slots of pages another request cached meanwhile are now the tree's.
            r.epoch += 1;
        }
        let new_lock = if finishing {
            None
        } else {
            Some(self.request_lock(end))
        };
        let empty = self.pools.kv.empty();
        let r = self.request_mut(id)?;
        r.tokens = tokens;
        let old = if finishing {
            drop(published.unpublished);
            None
        } else {
            r.node = end;
            r.prefix_len = cached;
            let mut kv = published.unpublished;
            kv.append(std::mem::replace(&mut r.kv, empty));
            r.kv = kv;
            std::mem::replace(&mut r.lock, new_lock)
        };
        if let Some(old) = old {
            let _ = self.unlock(old);
        }
        Ok((end, cached))
    }

    /// A copy-on-write batch ended (`landed`: its copies are done).
    pub(crate) fn cow_ended(&mut self, batch: BatchId, cow: Cow, landed: bool) {
        match cow {
            Cow::Admit { request } if landed => self.admit_copy_done(request, batch),
            Cow::Admit { request } => self.admit_copy_failed(request, batch),
            Cow::Checkpoint { node, dst } if landed => {
                let live = self.tree.resolve(node).ok().filter(|&i| {
                    let n = self.tree.node(i);
                    n.kv.device.is_some() && !n.kv.state.loading()
                });
                let mut held = RequestShare::state(Some(dst));
                if let Some(i) = live {
                    if !self.keep_on_node_components(i, true, &mut held) {
                        self.maybe_backup(i);
                    }
                }
            }
            Cow::Checkpoint { dst, .. } => drop(dst),
        }
    }

    /// The admission copy landed: the request's state is good, and its own. While the
    /// cache knows a waiting queue ([`Cache::expect`]), the node's state leaves the
    /// request's lock (the path stays locked): the request never reads it again, and the
    /// marks keep what waiting requests need, so eviction may take it like any unlocked
    /// state. Without a queue the lock keeps it until the request's next checkpoint:
    /// the requests that share its prefix are the likeliest next users of that state,
    /// and nothing else tells eviction so.
    fn admit_copy_done(&mut self, id: RequestId, batch: BatchId) {
        let Ok(r) = self.request_mut(id) else {
            return;
        };
        if r.cow != Some(batch) {
            return;
        }
        r.cow = None;
        let lock = r.lock.as_ref().map(LockReceipt::id);
        if let Some(lock) = lock.filter(|_| self.lru.expecting()) {
            self.release_state_share(lock);
        }
    }

    /// A waiting queue was told of: every request whose admission copy landed lets the
    /// state it matched go (see `admit_copy_done`).
    pub(crate) fn release_matched_states(&mut self) {
        let landed: Vec<LockId> = self
            .requests
            .iter()
            .filter(|r| r.cow.is_none())
            .filter_map(|r| r.lock.as_ref().map(LockReceipt::id))
            .collect();
        for lock in landed {
            self.release_state_share(lock);
        }
    }

    /// The admission copy failed: the request's state is garbage, so the request drops
    /// back to nothing reused (`prefix_len == 0`, no tokens, no slots) and recomputes.
    fn admit_copy_failed(&mut self, id: RequestId, batch: BatchId) {
        let model = self.model();
        let empty = self.pools.kv.empty();
        let Ok(r) = self.request_mut(id) else {
            return;
        };
        if r.cow != Some(batch) {
            return;
        }
        r.cow = None;
        r.epoch += 1;
        // The admitted sequence stays what it was (docs/contract.md rule 9 still refers to
        // it): its head moves from the tokens, which the request no longer holds, to the tail.
        let mut admitted = std::mem::take(&mut r.tokens);
        admitted.truncate(r.admitted_from);
        admitted.append(&mut r.admitted_tail);
        r.admitted_tail = admitted;
        r.admitted_from = 0;
        r.prefix_len = 0;
        r.branch_len = 0;
        r.host_len = 0;
        r.host_node = None;
        let kv = std::mem::replace(&mut r.kv, empty);
        r.retired.keep(kv, None);
        // Its pages are retired: what it holds of each component is too (its state
        // slot), or starts over (its window, with the tokens it recomputes).
        model.restart(r);
        let namespace = r.namespace.clone();
        // The request now holds its namespace's root (locked, so that it stays).
        let root = self.root(namespace.as_deref());
        let root_lock = self.request_lock(root);
        if let Ok(r) = self.request_mut(id) {
            r.node = root;
            if let Some(old) = r.lock.replace(root_lock) {
                let _ = self.unlock(old);
            }
        }
    }
}
