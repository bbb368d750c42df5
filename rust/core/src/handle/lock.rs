//! [`Lock`]: an owned lock on the path from a node to its root, handed out by
//! [`HybridCache::lock`] (or [`HybridCache::own_lock`], for a receipt the core gave
//! through [`Cache::lock`](crate::Cache::lock)). While it lives the path is protected
//! from eviction; released ([`Lock::release`], [`HybridCache::unlock`]) or dropped, it
//! gives the lock back to the cache, and the path can be evicted again.

use std::fmt;

use crate::cache::LockReceipt;
use crate::error::{Error, Result};
use crate::ids::NodeId;

use super::hybrid::HybridCache;

impl HybridCache {
    /// Locks the path from `node` to its root; the lock is released when the returned
    /// handle is released or dropped.
    pub fn lock(&self, node: NodeId) -> Result<Lock> {
        let receipt = self.call(|c| c.lock(node))?;
        Ok(self.own_lock(receipt, node))
    }

    /// The handle that shares `receipt` (from [`Cache::lock`] on this cache's core, for
    /// `node`): it releases the lock when released or dropped.
    ///
    /// [`Cache::lock`]: crate::Cache::lock
    pub fn own_lock(&self, receipt: LockReceipt, node: NodeId) -> Lock {
        Lock {
            cache: self.clone(),
            receipt: Some(receipt),
            node,
        }
    }

    /// Releases the lock in `slot` and empties it. An empty slot (released already)
    /// or a lock of another cache raises [`Error::Lock`]; the lock then stays where it
    /// was.
    pub fn unlock(&self, slot: &mut Option<Lock>) -> Result<()> {
        match slot {
            None => Err(Error::Lock("this lock was already released".to_owned())),
            Some(lock) if !lock.cache.same_cache(self) => {
                Err(Error::Lock("this lock belongs to another cache".to_owned()))
            }
            Some(_) => slot.take().map_or(Ok(()), Lock::release),
        }
    }
}

/// An owned lock: the path from `node` to the root stays protected from eviction until
/// it is released, explicitly or by dropping it.
///
/// # Examples
///
/// ```
/// use radixcache_core::{Config, HybridCache};
///
/// let cache = HybridCache::new(Config::kv(16, 1))?;
/// let node = cache.call(|c| {
///     let slots = c.alloc_kv(3)?.expect("16 slots are free");
///     Ok(c.insert(None, &[1, 2, 3], &slots, 0)?.node)
/// })?;
/// let sizes = |cache: &HybridCache| cache.with(|c| (c.protected_size(), c.evictable_size()));
///
/// let lock = cache.lock(node)?;
/// assert_eq!(lock.node(), node);
/// // Locked, the three tokens cannot be evicted.
/// assert_eq!(sizes(&cache)?, (3, 0));
/// assert_eq!(cache.with(|c| c.evict(3, 0).kv_tokens)?, 0);
///
/// // Dropped (or released), the lock gives the path back to eviction.
/// drop(lock);
/// assert_eq!(sizes(&cache)?, (0, 3));
/// # Ok::<(), radixcache_core::Error>(())
/// ```
#[must_use = "dropping a Lock releases it at once"]
#[clippy::has_significant_drop]
pub struct Lock {
    cache: HybridCache,
    /// `None` once released.
    receipt: Option<LockReceipt>,
    node: NodeId,
}

impl fmt::Debug for Lock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lock")
            .field("node", &self.node)
            .field("receipt", &self.receipt)
            .finish_non_exhaustive()
    }
}

impl Lock {
    /// The node whose path is locked (as it was when locked; a split above it keeps the
    /// handle valid).
    pub fn node(&self) -> NodeId {
        self.node
    }

    /// Releases the lock.
    pub fn release(mut self) -> Result<()> {
        match self.receipt.take() {
            Some(receipt) => self.cache.call(|c| c.unlock(receipt)),
            None => Ok(()),
        }
    }
}

impl Drop for Lock {
    fn drop(&mut self) {
        if let Some(receipt) = self.receipt.take() {
            // Cannot fail: the receipt is of this cache and live.
            self.cache.core.lock().settle(|c| {
                let _ = c.unlock(receipt);
            });
        }
    }
}
