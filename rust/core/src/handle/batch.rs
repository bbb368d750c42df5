//! [`Batch`]: the owned handle of a transfer batch (the copies a backup, a
//! copy-on-write or a load-back needs the engine to run), handed out by
//! [`HybridCache::take_batches`] (or [`HybridCache::own_batches`], for batches the core
//! gave), and [`Outcome`], how it ended. The handle owns the batch until it ends; dropped
//! before that, it abandons it: a batch never started fails at once and gives back the
//! slots it held, a started one stays in flight until it is acknowledged by id. A
//! load-back's batch is owned by its [`LoadBack`](super::LoadBack): the handle
//! [`LoadBack::batch_handle`](super::LoadBack::batch_handle) gives does not own it.

use std::fmt;

use parking_lot::Mutex;

use crate::cache::{Abandoned, Cache, TransferBatch};
use crate::error::Result;
use crate::ids::BatchId;

use super::hybrid::HybridCache;

impl HybridCache {
    /// The batches the cache emitted since the last call (copy-on-write, backups), each
    /// owned by its handle until it ends: see [`Batch`].
    pub fn take_batches(&self) -> Result<Vec<Batch>> {
        Ok(self.own_batches(self.with(Cache::take_batches)?))
    }

    /// The handles that own `batches` (from [`Cache::take_batches`] on this cache's
    /// core): each, dropped before its batch ended, abandons it ([`Cache::abandon`]).
    pub fn own_batches(&self, batches: Vec<TransferBatch>) -> Vec<Batch> {
        batches
            .into_iter()
            .map(|b| self.batch_handle(b, true))
            .collect()
    }

    /// A handle on `batch`; `owns`: whether dropping it abandons the batch.
    pub(super) fn batch_handle(&self, batch: TransferBatch, owns: bool) -> Batch {
        Batch {
            cache: self.clone(),
            copies: batch,
            state: Mutex::new(BatchState {
                owns,
                outcome: None,
            }),
        }
    }
}

/// How a [`Batch`] ended, as far as its handle knows (an acknowledgement by id through
/// the cache does not reach the handle).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// [`Batch::complete`] succeeded.
    Completed,
    /// [`Batch::fail`] or [`Batch::close`] failed it, for this reason.
    Failed(String),
    /// The handle let go of it before it ended ([`Batch::abandon`], or dropped).
    Abandoned(Abandoned),
}

struct BatchState {
    /// Whether dropping the handle abandons the batch.
    owns: bool,
    outcome: Option<Outcome>,
}

/// A transfer batch handed out by the cache, owned by this handle until it ends: run its
/// copies between [`Batch::start`] and [`Batch::complete`] (or [`Batch::fail`]).
/// Dropped before it ended, it is abandoned: failed if never started; if started, it
/// stays in flight, holding its slots, until it is acknowledged by id (which fails it),
/// since its copies may still run (see [`Cache::abandon`]). Its methods take `&self`, so
/// that it can be shared.
///
/// # Examples
///
/// ```
/// use radixcache_core::{BatchKind, Config, HybridCache, Outcome};
///
/// // 16 device KV slots, and a host tier of 16 that backs up every insert.
/// let cache = HybridCache::new(Config { host_kv_slots: 16, ..Config::kv(16, 1) })?;
/// let insert = |tokens: &[u32]| {
///     cache.call(|c| {
///         let slots = c.alloc_kv(tokens.len())?.expect("slots are free");
///         c.insert(None, tokens, &slots, 0).map(drop)
///     })
/// };
/// let host_free = |cache: &HybridCache| cache.with(|c| c.host_kv_pool().counts().free);
///
/// insert(&[1, 2, 3, 4])?;
/// let backup = cache.take_batches()?.pop().expect("the insert backs up its pages");
/// assert_eq!(backup.batch().kind, BatchKind::Backup);
/// // Until it ends, the batch holds the host pages its copies write.
/// assert_eq!(host_free(&cache)?, 12);
/// // Dropped before it started, it is abandoned: it fails, and gives them back.
/// drop(backup);
/// assert_eq!(host_free(&cache)?, 16);
///
/// insert(&[5, 6])?;
/// let backup = cache.take_batches()?.pop().expect("the insert backs up its pages");
/// backup.start()?;
/// // ... the engine runs `backup.batch().copies` here ...
/// backup.complete()?;
/// assert_eq!(backup.outcome(), Some(Outcome::Completed));
/// // Ended, it is not abandoned when dropped: the host keeps the backup.
/// drop(backup);
/// assert_eq!(host_free(&cache)?, 14);
/// assert!(cache.with(|c| c.pending_batches())?.is_empty());
/// # Ok::<(), radixcache_core::Error>(())
/// ```
#[must_use = "dropping a Batch before it ended fails it"]
#[clippy::has_significant_drop]
pub struct Batch {
    cache: HybridCache,
    copies: TransferBatch,
    state: Mutex<BatchState>,
}

impl fmt::Debug for Batch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Batch")
            .field("id", &self.copies.id)
            .field("kind", &self.copies.kind)
            .field("outcome", &self.state.lock().outcome)
            .finish_non_exhaustive()
    }
}

impl Batch {
    /// The batch id.
    pub fn id(&self) -> BatchId {
        self.copies.id
    }

    /// What to copy.
    pub fn batch(&self) -> &TransferBatch {
        &self.copies
    }

    /// How the batch ended through this handle, if it did.
    pub fn outcome(&self) -> Option<Outcome> {
        self.state.lock().outcome.clone()
    }

    /// The engine is about to run the copies (see [`Cache::start`]).
    pub fn start(&self) -> Result<()> {
        let id = self.copies.id;
        self.cache.call(|c| c.start(id))
    }

    /// The copies are done (see [`Cache::complete`]).
    pub fn complete(&self) -> Result<()> {
        let id = self.copies.id;
        self.cache.call(|c| c.complete(id))?;
        self.ended(Outcome::Completed);
        Ok(())
    }

    /// An `l3_get` batch's copies landed for its first `pages` pages and (`state`) the
    /// state at their end (see [`Cache::complete_l3`]).
    pub fn complete_l3(&self, pages: usize, state: bool) -> Result<()> {
        self.complete_l3_gone(pages, state, &[])
    }

    /// [`Batch::complete_l3`], with `gone` the objects the store no longer held (see
    /// [`Cache::complete_l3_gone`]).
    pub fn complete_l3_gone(&self, pages: usize, state: bool, gone: &[usize]) -> Result<()> {
        let id = self.copies.id;
        self.cache
            .call(|c| c.complete_l3_gone(id, pages, state, gone))?;
        self.ended(Outcome::Completed);
        Ok(())
    }

    /// The copies failed (see [`Cache::fail`]); `reason` is kept in [`Batch::outcome`].
    pub fn fail(&self, reason: &str) -> Result<()> {
        let id = self.copies.id;
        self.cache.call(|c| c.fail(id))?;
        self.ended(Outcome::Failed(reason.to_owned()));
        Ok(())
    }

    /// Fails the batch if it is still in flight, for a caller whose copies can no longer
    /// run (a `with` block left, an exception caught). Returns whether it failed it.
    pub fn close(&self, reason: &str) -> Result<bool> {
        let id = self.copies.id;
        let failed = self.cache.call(|c| {
            c.started(id)
                .is_some()
                .then(|| c.fail(id))
                .transpose()
                .map(|f| f.is_some())
        })?;
        if failed {
            self.ended(Outcome::Failed(reason.to_owned()));
        } else {
            self.state.lock().owns = false;
        }
        Ok(failed)
    }

    /// Lets go of the batch (what dropping the handle does): see [`Cache::abandon`].
    /// Nothing happens when the handle does not own the batch, or the cache is broken.
    pub fn abandon(&self) -> Abandoned {
        if !std::mem::replace(&mut self.state.lock().owns, false) {
            return Abandoned::Nothing;
        }
        let id = self.copies.id;
        let what = self
            .cache
            .with(|c| c.abandon(id))
            .unwrap_or(Abandoned::Nothing);
        if what != Abandoned::Nothing {
            self.state.lock().outcome = Some(Outcome::Abandoned(what));
        }
        what
    }

    fn ended(&self, outcome: Outcome) {
        let mut st = self.state.lock();
        st.owns = false;
        st.outcome = Some(outcome);
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        self.abandon();
    }
}
