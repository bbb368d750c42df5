//! Emptying the cache: [`Cache::reset`], what a serving engine's "flush cache" calls
//! between workloads (a new model revision, a benchmark's cold start, a privacy
//! purge).

use crate::error::{Error, Result};

use super::{Cache, Evicted};

impl Cache {
    /// Drops every cached node of every namespace, on both tiers, when nothing holds
    /// the tree: no live request, no live lock, no batch in flight (taken or not) and
    /// no pending load-back; else [`Error::Busy`] naming what is outstanding, and
    /// nothing changes.
    ///
    /// Device slots go back to the pools (`pools="engine"`: queued for `take_freed`),
    /// host slots to the host pools. The L3 store keeps its objects: nothing is written
    /// to it (`l3_write="host_eviction"` included), as the data is being discarded.
    /// Counters keep counting (a reset is not an eviction: no eviction counter moves)
    /// and `resets` counts the call. Node handles from before are stale. With events
    /// on, events still queued stay queued, and one `Cleared` follows them instead of
    /// a removal per page.
    pub fn reset(&mut self) -> Result<()> {
        self.reap();
        let busy = [
            (self.requests.live(), "live requests (finish or abort them)"),
            (self.locks.live(), "live locks (release them)"),
            (
                self.batches.len(),
                "batches in flight (run them, or fail or abandon them)",
            ),
            (
                self.loads.len(),
                "pending load-backs (commit or release them, and end their batches)",
            ),
        ];
        let outstanding: Vec<String> = busy
            .iter()
            .filter(|(n, _)| *n > 0)
            .map(|(n, what)| format!("{n} {what}"))
            .collect();
        if !outstanding.is_empty() {
            return Err(Error::Busy(format!(
                "reset: the cache is in use: {}",
                outstanding.join(", ")
            )));
        }
        let counters = self.stats.clone();
        let queued = self.events.pending();
        let roots: Vec<u32> = self.roots.all().into_iter().map(|(_, r)| r).collect();
        for root in roots {
            self.reset_root(root);
        }
        self.stats = counters;
        self.stats.resets += 1;
        self.events.truncate(queued);
        if self.config.events {
            self.events.push_cleared();
        }
        Ok(())
    }

    /// Deletes everything below `root` (nothing in it is locked or in flight), then
    /// the root itself if it is a named namespace's.
    fn reset_root(&mut self, root: u32) {
        let below = self.tree.preorder(root);
        for &d in below[1..].iter().rev() {
            self.delete_node(d, &mut Evicted::default(), false);
        }
        let r = self.tree.node_mut(root);
        r.device_children = 0;
        r.evicting_children = 0;
        self.refresh(root);
        self.drop_root_if_empty(root);
    }
}
