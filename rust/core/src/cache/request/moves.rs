//! A request's moves to and from a load-back's target: a committed load grows the
//! request's prefix to the target (and gives it what the load brought), a failed one
//! puts the request back as it was; the request remembers the load in flight.

use crate::ids::{BatchId, RequestId};

use super::SavedRequest;
use crate::cache::components::shares::RequestShare;
use crate::cache::locks::LockReceipt;
use crate::cache::Cache;

impl Cache {
    /// The request's prefix grows to node `j` (its lock moves there) and it gets what
    /// the load brought it (`fresh`: a state slot). Returns what it was, to restore on
    /// failure. `None` (nothing changed) when the request is gone.
    pub(crate) fn move_request_to(
        &mut self,
        r: RequestId,
        j: u32,
        fresh: RequestShare,
    ) -> Option<SavedRequest> {
        self.request_ref(r).ok()?;
        let new_lock = self.request_lock(j);
        let tokens = self.path_tokens(j);
        let rs = self.request_mut(r).ok()?;
        let saved = SavedRequest {
            prefix_len: rs.prefix_len,
            host_len: rs.host_len,
            host_node: rs.host_node,
            node: rs.node,
            lock: rs.lock.replace(new_lock),
            replaced: rs.held.swap_in(fresh),
        };
        rs.prefix_len = tokens.len();
        rs.tokens = tokens;
        rs.epoch += 1;
        rs.node = j;
        rs.host_len = 0;
        rs.host_node = None;
        Some(saved)
    }

    /// A committed load of request `r` failed: the request goes back to what it was
    /// before the load (`saved`), keeping what the load gave it until it ends. Returns
    /// the load's lock on the request, to be released.
    pub(crate) fn restore_request(
        &mut self,
        r: RequestId,
        saved: SavedRequest,
    ) -> Option<LockReceipt> {
        let empty = self.pools.kv.empty();
        let Ok(rs) = self.request_mut(r) else {
            return saved.release();
        };
        let lock = std::mem::replace(&mut rs.lock, saved.lock);
        rs.node = saved.node;
        rs.prefix_len = saved.prefix_len;
        rs.host_len = saved.host_len;
        rs.host_node = saved.host_node;
        rs.tokens.truncate(saved.prefix_len);
        rs.epoch += 1;
        let kv = std::mem::replace(&mut rs.kv, empty);
        let fresh = rs.held.swap_back(saved.replaced);
        rs.retired.keep(kv, fresh.state);
        lock
    }

    /// Request `r` has load-back `id` pending.
    pub(crate) fn set_request_load(&mut self, r: RequestId, id: BatchId) {
        if let Ok(rs) = self.request_mut(r) {
            rs.load = Some(id);
        }
    }

    /// Load-back `id` of request `r` ended or was called off.
    pub(crate) fn clear_request_load(&mut self, r: RequestId, id: BatchId) {
        if let Ok(rs) = self.request_mut(r) {
            if rs.load == Some(id) {
                rs.load = None;
            }
        }
    }
}
