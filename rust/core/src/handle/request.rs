//! [`Request`]: the owned handle of a request, handed out by [`HybridCache::admit`] and
//! [`HybridCache::admit_with_priority`] (or [`HybridCache::own_request`], for a request
//! the core admitted). While the request is live it holds its locked prefix, its own KV
//! slots and its state slot; dropped while the request is live, the handle aborts it and
//! every slot goes back to the pools. Finish or abort it through the cache.

use std::fmt;

use crate::error::{Error, Result};
use crate::ids::RequestId;

use super::hybrid::HybridCache;

impl HybridCache {
    /// Admits a request (see [`Cache::admit`]); the returned handle aborts the request if
    /// it is dropped while the request is live. `None`: no state slot for its copy.
    ///
    /// [`Cache::admit`]: crate::Cache::admit
    pub fn admit(&self, namespace: Option<&str>, tokens: &[u32]) -> Result<Option<Request>> {
        self.admit_with_priority(namespace, tokens, 0)
    }

    /// [`HybridCache::admit`] for a request of `priority` (see
    /// [`Cache::admit_with_priority`]).
    ///
    /// [`Cache::admit_with_priority`]: crate::Cache::admit_with_priority
    pub fn admit_with_priority(
        &self,
        namespace: Option<&str>,
        tokens: &[u32],
        priority: i64,
    ) -> Result<Option<Request>> {
        let id = self.call(|c| c.admit_with_priority(namespace, tokens, priority))?;
        id.map(|id| self.own_request(id)).transpose()
    }

    /// The handle that owns request `id` (from [`Cache::admit`] on this cache's core):
    /// dropped while the request is live, it aborts it. A request has at most one such
    /// handle: one that is not live, or is owned already, raises [`Error::Request`].
    ///
    /// [`Cache::admit`]: crate::Cache::admit
    pub fn own_request(&self, id: RequestId) -> Result<Request> {
        self.call(|c| c.own_request(id))?;
        Ok(self.request_handle(id))
    }

    /// The handle of request `id`, which [`Cache::own_request`] marked as owned within
    /// the same call on the core (so that admitting and owning take the cache once).
    ///
    /// [`Cache::own_request`]: crate::Cache::own_request
    pub fn request_handle(&self, id: RequestId) -> Request {
        Request {
            cache: self.clone(),
            id,
        }
    }

    /// The request's id in this cache for `call` (the request call it is for), or an
    /// error for a request of another cache. With engine-owned pools no request can be
    /// this cache's: `call` is refused ([`Error::EngineOwned`]).
    pub fn request_id(&self, request: &Request, call: &'static str) -> Result<RequestId> {
        if self.engine_owned {
            return Err(Error::EngineOwned(call));
        }
        if self.same_cache(&request.cache) {
            Ok(request.id)
        } else {
            Err(Error::Request(format!(
                "request {} belongs to another cache",
                request.id
            )))
        }
    }
}

/// An owned request handle: while its request is live, dropping the handle aborts it
/// (everything it holds goes back). Finish or abort it through the cache.
///
/// # Examples
///
/// ```
/// use radixcache_core::{Config, HybridCache};
///
/// let cache = HybridCache::new(Config::kv(16, 1))?;
/// let request = cache.admit(None, &[1, 2, 3])?.expect("no state slot to wait for");
/// let id = request.id();
/// // The request's own KV slots, one per token.
/// let slots = cache.call(|c| c.extend(id, &[1, 2, 3]))?.expect("16 slots are free");
/// assert_eq!(slots.len(), 3);
/// assert!(request.is_live());
/// assert_eq!(cache.with(|c| c.available_kv())?, 13);
///
/// // Dropped while live, the handle aborts the request: its slots go back.
/// drop(request);
/// assert_eq!(cache.with(|c| (c.request_live(id), c.available_kv()))?, (false, 16));
/// # Ok::<(), radixcache_core::Error>(())
/// ```
#[must_use = "dropping a Request aborts it"]
#[clippy::has_significant_drop]
pub struct Request {
    cache: HybridCache,
    id: RequestId,
}

impl fmt::Debug for Request {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Request")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl Request {
    /// The request's id (stale once it is finished or aborted).
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// Whether the request still holds anything (false too when the cache is broken).
    pub fn is_live(&self) -> bool {
        self.cache
            .with(|c| c.request_live(self.id))
            .unwrap_or(false)
    }

    /// A handle to the request's cache.
    pub fn cache(&self) -> &HybridCache {
        &self.cache
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        let id = self.id;
        self.cache.core.lock().settle(|c| {
            if c.request_live(id) {
                c.drop_request(id);
            }
        });
    }
}
