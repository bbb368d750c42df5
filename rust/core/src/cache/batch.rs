//! Transfer batches: the data movement the core needs, emitted for an engine to run.
//!
//! The core never touches tensor memory. When it needs bytes moved (a copy-on-write of a
//! Mamba state, a backup to the host tier, a load back from it) it emits a batch of
//! copies between pool slots and keeps, until the engine says `complete` or `fail`,
//! everything the batch needs: every slot a batch reads or writes is pinned in its pool
//! from emission on, so that whoever gives such a slot back meanwhile only marks it
//! draining, and no copy ever reads a reused slot or writes one handed to someone else.
//!
//! This module keeps the books of batches in flight and names none of their clients:
//! each batch carries an opaque [`Payload`] of its kind (defined with its routing in the
//! composition root, `mod.rs`), and when the batch ends [`Cache::settle`] hands the
//! payload back to the module that emitted it, with whether the copies landed. The copy
//! vocabulary lives in `copies.rs`.

use std::collections::{BTreeMap, BTreeSet};

use crate::error::{Error, Result};
use crate::ids::BatchId;

use super::copies::{Abandoned, BatchKind, Pins, PoolKind, SlotCopy, Tier, TransferBatch};
use super::{Cache, Payload};

struct Pending {
    batch: TransferBatch,
    started: bool,
    /// Its owner let go of it after it was started: it ends failed, whichever way it
    /// is acknowledged.
    abandoned: bool,
    /// Every page the batch's copies read or write, pinned in its pool until the batch
    /// is acknowledged.
    pins: Vec<Pins>,
    payload: Payload,
}

/// Batches emitted and not yet acknowledged.
#[derive(Default)]
pub(crate) struct Batches {
    next: u64,
    pending: BTreeMap<BatchId, Pending>,
    /// Emitted, not yet taken by `take_batches`.
    outbox: Vec<BatchId>,
}

impl Batches {
    /// Batches not yet acknowledged.
    pub fn len(&self) -> usize {
        self.pending.len()
    }

    /// Whether batch `id` is in flight.
    pub fn contains(&self, id: BatchId) -> bool {
        self.pending.contains_key(&id)
    }

    /// The pins of every batch in flight (for `audit()`).
    pub fn pins(&self) -> impl Iterator<Item = &Pins> {
        self.pending.values().flat_map(|p| &p.pins)
    }

    /// The payloads of the batches in flight, oldest first.
    pub fn payloads(&self) -> impl Iterator<Item = &Payload> {
        self.pending.values().map(|p| &p.payload)
    }

    /// The oldest batch in flight whose payload satisfies `pred`.
    pub fn find(&self, mut pred: impl FnMut(&Payload) -> bool) -> Option<BatchId> {
        self.pending
            .iter()
            .find_map(|(&id, p)| pred(&p.payload).then_some(id))
    }

    /// The payload of batch `id`, if it is in flight.
    pub fn payload_mut(&mut self, id: BatchId) -> Option<&mut Payload> {
        self.pending.get_mut(&id).map(|p| &mut p.payload)
    }
}

impl Cache {
    /// Emits a batch of the payload's kind, queued for `take_batches`: pins every page
    /// its copies read or write.
    pub(crate) fn emit(&mut self, copies: Vec<SlotCopy>, payload: Payload) -> BatchId {
        self.emit_keyed(copies, Vec::new(), payload)
    }

    /// [`Cache::emit`] of a batch whose objects in the L3 tier are named by `keys`.
    pub(crate) fn emit_keyed(
        &mut self,
        copies: Vec<SlotCopy>,
        keys: Vec<crate::hashes::PageHash>,
        payload: Payload,
    ) -> BatchId {
        let id = self.record(copies, keys, payload).id;
        self.batches.outbox.push(id);
        id
    }

    /// Emits a batch that is not queued (a load-back's, reached through its guard), and
    /// returns it.
    pub(crate) fn emit_held(&mut self, copies: Vec<SlotCopy>, payload: Payload) -> TransferBatch {
        self.emit_held_keyed(copies, Vec::new(), payload)
    }

    /// [`Cache::emit_held`] of a batch whose objects in the L3 tier are named by `keys`.
    pub(crate) fn emit_held_keyed(
        &mut self,
        copies: Vec<SlotCopy>,
        keys: Vec<crate::hashes::PageHash>,
        payload: Payload,
    ) -> TransferBatch {
        self.record(copies, keys, payload).clone()
    }

    /// Books a new batch in flight, pinning every page its copies read or write.
    fn record(
        &mut self,
        copies: Vec<SlotCopy>,
        keys: Vec<crate::hashes::PageHash>,
        payload: Payload,
    ) -> &TransferBatch {
        let kind = payload.kind();
        let id = BatchId::new(self.id(), self.batches.next);
        self.batches.next += 1;
        let ps = self.page_size();
        let mut pins: Vec<Pins> = Vec::new();
        for c in &copies {
            for (tier, slots) in [(c.src_tier, &c.src), (c.dst_tier, &c.dst)] {
                let Some(pool) = self.pools.of(c.pool, tier) else {
                    continue;
                };
                let page_size = if c.pool == PoolKind::Kv { ps } else { 1 };
                let mut pages: Vec<u32> = slots
                    .iter()
                    .map(|&s| crate::pool::page_of_slot(s, page_size))
                    .collect();
                pages.dedup();
                pool.pin(&pages);
                if (c.pool, tier) == (PoolKind::Mamba, Tier::Device) {
                    self.refresh_pinned(&pages);
                }
                pins.push(Pins {
                    pool: c.pool,
                    tier,
                    pages,
                });
            }
        }
        match kind {
            BatchKind::Cow => self.stats.cow_copies += 1,
            BatchKind::Backup => self.stats.backups += 1,
            BatchKind::LoadBack | BatchKind::L3Get => {}
            BatchKind::L3Put => self.stats.l3_puts += 1,
        }
        let pending = self.batches.pending.entry(id).or_insert(Pending {
            batch: TransferBatch {
                id,
                kind,
                copies,
                keys,
            },
            started: false,
            abandoned: false,
            pins,
            payload,
        });
        &pending.batch
    }

    /// Withdraws batch `id` if it was never started (a load-back called off before its
    /// copies could run): its pins go, so what it held is free at once.
    pub(crate) fn withdraw_unstarted(&mut self, id: BatchId) {
        if self.batches.pending.get(&id).is_none_or(|p| p.started) {
            return;
        }
        if let Some(p) = self.batches.pending.remove(&id) {
            self.unpin_all(&p.pins);
        }
    }

    /// Drops a finished batch's pins: a page given back meanwhile becomes free now.
    fn unpin_all(&mut self, pins: &[Pins]) {
        for p in pins {
            if let Some(pool) = self.pools.of(p.pool, p.tier) {
                pool.unpin(&p.pages);
            }
            if (p.pool, p.tier) == (PoolKind::Mamba, Tier::Device) {
                self.refresh_pinned(&p.pages);
            }
        }
    }

    /// The batches emitted since the last call, for the engine to run and acknowledge.
    pub fn take_batches(&mut self) -> Vec<TransferBatch> {
        let ids = std::mem::take(&mut self.batches.outbox);
        ids.iter()
            .filter_map(|id| self.batches.pending.get(id).map(|p| p.batch.clone()))
            .collect()
    }

    /// Batches handed out and not yet acknowledged, oldest first: `(id, kind, started)`.
    /// Handed out means taken with [`Cache::take_batches`] or held by a load-back record;
    /// what still waits for `take_batches` is not listed. An engine that restarts ends
    /// each by id (a started one only once its copies can no longer run).
    pub fn pending_batches(&self) -> Vec<(BatchId, BatchKind, bool)> {
        let waiting: BTreeSet<&BatchId> = self.batches.outbox.iter().collect();
        self.batches
            .pending
            .iter()
            .filter(|(id, _)| !waiting.contains(id))
            .map(|(&id, p)| (id, p.batch.kind, p.started))
            .collect()
    }

    fn pending_mut(&mut self, id: BatchId) -> Result<&mut Pending> {
        self.check_batch_id(id)?;
        self.batches
            .pending
            .get_mut(&id)
            .ok_or_else(|| no_batch(id))
    }

    /// A batch id of another cache is refused as such (never taken for one of ours).
    fn check_batch_id(&self, id: BatchId) -> Result<()> {
        if id.cache() == self.id() {
            Ok(())
        } else {
            Err(Error::arg(
                "batch_id",
                format!("no batch {id} in flight here: that id was issued by another cache"),
            ))
        }
    }

    /// The engine is about to run the batch's copies. Starting a batch twice raises
    /// [`Error::Request`] and changes nothing.
    pub fn start(&mut self, id: BatchId) -> Result<()> {
        self.reap();
        let p = self.pending_mut(id)?;
        if p.started {
            return Err(Error::Request(format!("batch {id} was started already")));
        }
        p.started = true;
        Ok(())
    }

    /// Whether a batch in flight was started.
    pub fn started(&self, id: BatchId) -> Option<bool> {
        self.batches.pending.get(&id).map(|p| p.started)
    }

    /// Removes an acknowledged batch from the books and drops its pins.
    fn end_batch(&mut self, id: BatchId) -> Result<Pending> {
        self.reap();
        self.check_batch_id(id)?;
        let p = self
            .batches
            .pending
            .remove(&id)
            .ok_or_else(|| no_batch(id))?;
        self.batches.outbox.retain(|&b| b != id);
        self.unpin_all(&p.pins);
        Ok(p)
    }

    /// The batch's copies are done: the module that owns the batch's kind publishes
    /// what it carried, and its pins are dropped (an abandoned batch fails instead: its
    /// owner no longer vouches for the copies).
    pub fn complete(&mut self, id: BatchId) -> Result<()> {
        let p = self.end_batch(id)?;
        if p.abandoned {
            self.settle(id, p.payload, false);
            return Ok(());
        }
        self.settle(id, p.payload, true);
        Ok(())
    }

    /// The batch's copies failed: the module that owns the batch's kind undoes what it
    /// would have published (a failed copy is a miss, never a hit), and its pins are
    /// dropped.
    pub fn fail(&mut self, id: BatchId) -> Result<()> {
        let p = self.end_batch(id)?;
        self.settle(id, p.payload, false);
        Ok(())
    }

    /// An `l3_get` batch's copies landed for its first `pages` pages and (`state`) the
    /// state at their end, not for the rest (a partial fetch: the rest is a miss).
    /// Refused, changing nothing, for a batch of another kind; an abandoned batch fails.
    /// [`Cache::complete_l3_gone`] also reports the objects the store no longer held.
    pub fn complete_l3(&mut self, id: BatchId, pages: usize, state: bool) -> Result<()> {
        self.complete_l3_gone(id, pages, state, &[])
    }

    /// [`Cache::complete_l3`], with `gone`: indices into the batch's `keys` of the
    /// objects the store did not hold (missing, or corrupt and deleted), counted in
    /// `l3_gone_objects`; with events on, each is announced as removed from the
    /// `EXTERNAL` medium (a page's `Removed`, the state's `StateRemoved`), so that a
    /// router's index of the store forgets it. Refused, changing nothing, for a batch of
    /// another kind, and for a `gone` index past the keys or naming an object reported
    /// landed; an abandoned batch fails.
    pub fn complete_l3_gone(
        &mut self,
        id: BatchId,
        pages: usize,
        state: bool,
        gone: &[usize],
    ) -> Result<()> {
        self.check_batch_id(id)?;
        match self.batches.pending.get(&id) {
            None => return Err(no_batch(id)),
            Some(p) if p.batch.kind != BatchKind::L3Get => {
                return Err(Error::arg(
                    "batch_id",
                    format!(
                        "batch {id} is a {} batch; only an l3_get batch lands in part",
                        p.batch.kind.as_str()
                    ),
                ))
            }
            Some(p) => check_gone(p.batch.keys.len(), &p.batch.copies, pages, state, gone)?,
        }
        let p = self.end_batch(id)?;
        let (pages, state) = if p.abandoned {
            (0, false)
        } else {
            (pages, state)
        };
        let landed = pages > 0;
        self.settle_part(p.payload, pages, state, gone);
        self.count_ended(landed);
        Ok(())
    }

    /// Counts an ended batch.
    pub(super) fn count_ended(&mut self, landed: bool) {
        if landed {
            self.stats.batches_completed += 1;
        } else {
            self.stats.batches_failed += 1;
        }
    }

    /// The owner of a batch let go of it before it ended (an exception, a forgotten
    /// batch). A batch never started fails at once. A started one may still have
    /// copies running, so it stays in flight, holding everything it holds, until the
    /// engine acknowledges it by id; either acknowledgement then fails it, and
    /// [`Cache::pending_batches`] lists it meanwhile. A load-back's batch is left alone
    /// while its guard is uncommitted (the guard owns it).
    pub fn abandon(&mut self, id: BatchId) -> Abandoned {
        self.reap();
        let owned_by_load = self.loads.committed(id) == Some(false);
        let Some(p) = self.batches.pending.get_mut(&id) else {
            return Abandoned::Nothing;
        };
        if p.abandoned || owned_by_load {
            return Abandoned::Nothing;
        }
        self.stats.batches_abandoned += 1;
        if p.started {
            p.abandoned = true;
            return Abandoned::Draining;
        }
        // Cannot fail: the batch is pending.
        let _ = self.fail(id);
        Abandoned::Failed
    }

    /// Batches let go of after they were started, still waiting to be acknowledged:
    /// abandoned ones, and load-backs whose guard was released (called off) while their
    /// copies may run.
    pub fn draining_batches(&self) -> usize {
        self.batches
            .pending
            .iter()
            .filter(|&(&id, p)| {
                p.abandoned
                    || (p.started
                        && p.batch.kind == BatchKind::LoadBack
                        && !self.loads.contains(id))
            })
            .count()
    }
}

fn no_batch(id: BatchId) -> Error {
    Error::arg(
        "batch_id",
        format!("no batch {id} in flight (unknown, or completed or failed already)"),
    )
}

/// Checks `complete_l3`'s `gone` against an `l3_get` batch of `keys` objects (its KV
/// pages, then the state when `copies` has a state copy) of which the first `pages`
/// pages and (`state`) the state landed: each index names an object, and not a landed one.
fn check_gone(
    keys: usize,
    copies: &[SlotCopy],
    pages: usize,
    state: bool,
    gone: &[usize],
) -> Result<()> {
    let kv_pages = keys - usize::from(copies.iter().any(|c| c.pool == PoolKind::Mamba));
    for &i in gone {
        let why = if i >= keys {
            format!("index {i} is past the batch's {keys} objects")
        } else if i < kv_pages && i < pages {
            format!("page {i} is reported landed (pages={pages})")
        } else if i == kv_pages && state {
            "the state (the last object) is reported landed (state=True)".to_owned()
        } else {
            continue;
        };
        return Err(Error::arg("gone", why));
    }
    Ok(())
}
