//! [`HybridCache`]: the shareable handle over the core, made by [`HybridCache::new`] from
//! a [`Config`]; cloning it shares the same cache, and the cache goes when the last clone
//! does.
//!
//! The handle puts the single-threaded [`Cache`] behind a mutex so that the owned handles
//! it gives ([`Lock`](super::Lock), [`Request`](super::Request),
//! [`LoadBack`](super::LoadBack), [`Batch`](super::Batch), each in a file of its own
//! beside this one, with the methods that hand it out) can give back what they hold when
//! dropped, from any thread. The core's own owned values (lock receipts, load-back
//! records) do the ownership; the handles only share them and, when dropped, hand them
//! back at once rather than at the cache's next call. Rules that keep this
//! deadlock-free: nothing that owns a receipt is dropped while the cache mutex is held by
//! the same thread, and the mutex is never held while calling into user code (in Python:
//! while creating Python objects).
//!
//! Every call runs through [`HybridCache::with`]: a panic inside the core (a bug) is
//! caught there, and the cache is marked broken, since the change it interrupted may be
//! half done; so is an illegal page transition the pools refused (also a bug, see
//! [`crate::Pool::fault`]). Every later call then fails with [`Error::Broken`]; dropping handles stays
//! safe (they give back nothing to a broken cache).

use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::cache::Cache;
use crate::config::{Config, PoolOwner};
use crate::error::{Error, Result};

/// The cache and whether a panic left it broken.
pub(super) struct Shared {
    cache: Cache,
    /// Why the cache is broken (a panic interrupted a change), if it is.
    broken: Option<String>,
}

impl Shared {
    /// Runs `f` on the cache unless it is broken; a panic in `f` breaks it, and so does
    /// an illegal page transition (recorded by the pools, during `f` or since the last
    /// call: a [`crate::Pages`] value may drop anywhere). The pools refuse such a
    /// transition, so their books hold; what `f` returned is dropped, since it may
    /// describe a change half done, and every later call fails.
    fn enter<R>(&mut self, f: impl FnOnce(&mut Cache) -> R) -> Result<R> {
        if let Some(why) = &self.broken {
            return Err(Error::Broken(why.clone()));
        }
        let cache = &mut self.cache;
        let out = catch_unwind(AssertUnwindSafe(|| {
            cache.reap();
            f(cache)
        }));
        match out {
            Ok(r) if !self.cache.faulted() => Ok(r),
            Ok(_) => Err(self.break_on_fault()),
            Err(payload) => Err(self.break_on_panic(payload.as_ref())),
        }
    }

    #[cold]
    fn break_on_fault(&mut self) -> Error {
        let why = self.cache.fault().unwrap_or_default();
        self.broken = Some(why.clone());
        Error::Broken(why)
    }

    #[cold]
    fn break_on_panic(&mut self, payload: &(dyn std::any::Any + Send)) -> Error {
        let why = match payload.downcast_ref::<&str>() {
            Some(s) => (*s).to_owned(),
            None => payload
                .downcast_ref::<String>()
                .cloned()
                .unwrap_or_else(|| "a panic".to_owned()),
        };
        self.broken = Some(why.clone());
        Error::Broken(why)
    }

    /// Runs `f` for a handle being dropped: nothing when the cache is broken (what the
    /// handle held then stays where it is: the cache is not used again).
    pub(super) fn settle(&mut self, f: impl FnOnce(&mut Cache)) {
        let _ = self.enter(f);
    }
}

/// A cache that can be shared between owners. Cloning shares the same cache.
///
/// # Examples
///
/// A cache of 16 KV slots in pages of one token, shared by two owners: what one caches,
/// the other finds.
///
/// ```
/// use radixcache_core::{Config, HybridCache};
///
/// let cache = HybridCache::new(Config::kv(16, 1))?;
/// let other = cache.clone();
/// assert!(other.same_cache(&cache));
///
/// // Three slots from the pool, published into the tree under tokens [1, 2, 3].
/// let node = cache.call(|c| {
///     let slots = c.alloc_kv(3)?.expect("16 slots are free");
///     Ok(c.insert(None, &[1, 2, 3], &slots, 0)?.node)
/// })?;
/// let found = other.with(|c| c.match_prefix(None, &[1, 2, 3, 4]))?;
/// assert_eq!((found.device_len, found.node), (3, node));
///
/// // Dropping a clone gives nothing back: the cache goes with its last clone.
/// drop(cache);
/// assert_eq!(other.with(|c| (c.evictable_size(), c.available_kv()))?, (3, 13));
/// # Ok::<(), radixcache_core::Error>(())
/// ```
#[derive(Clone)]
pub struct HybridCache {
    pub(super) core: Arc<Mutex<Shared>>,
    /// The engine owns the slots (`pools="engine"`): no request can exist.
    pub(super) engine_owned: bool,
}

impl fmt::Debug for HybridCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.with(|c| c.summary()) {
            Ok(s) => f.write_str(&s),
            Err(e) => write!(f, "HybridCache({e})"),
        }
    }
}

impl HybridCache {
    /// A cache with the given configuration (errors name the bad argument).
    pub fn new(config: Config) -> Result<HybridCache> {
        let engine_owned = config.pools == PoolOwner::Engine;
        Ok(HybridCache {
            core: Arc::new(Mutex::new(Shared {
                cache: Cache::new(config)?,
                broken: None,
            })),
            engine_owned,
        })
    }

    /// Runs `f` with exclusive access to the core, after settling what was dropped since
    /// the last call. `f` must not drop a handle of this cache (it would wait on the
    /// mutex `f` holds). A panic in `f` marks the cache broken and returns
    /// [`Error::Broken`], as does every call after it.
    pub fn with<R>(&self, f: impl FnOnce(&mut Cache) -> R) -> Result<R> {
        self.core.lock().enter(f)
    }

    /// [`HybridCache::with`] for a call that can fail itself.
    pub fn call<R>(&self, f: impl FnOnce(&mut Cache) -> Result<R>) -> Result<R> {
        self.with(f)?
    }

    /// [`HybridCache::with`] when no other thread holds the cache; otherwise, without
    /// waiting, `Err(f)`: the caller may then wait in a way of its own (the Python
    /// binding releases the GIL first).
    pub fn with_uncontended<R, F: FnOnce(&mut Cache) -> R>(
        &self,
        f: F,
    ) -> std::result::Result<Result<R>, F> {
        match self.core.try_lock() {
            Some(mut core) => Ok(core.enter(f)),
            None => Err(f),
        }
    }

    /// Why the cache is broken, if a panic or an illegal page transition broke it (the
    /// latter is reported from the next call on).
    pub fn broken(&self) -> Option<String> {
        let core = self.core.lock();
        core.broken.clone().or_else(|| core.cache.fault())
    }

    /// True when both handles share one cache.
    pub fn same_cache(&self, other: &HybridCache) -> bool {
        Arc::ptr_eq(&self.core, &other.core)
    }
}
