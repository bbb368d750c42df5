//! Allocation: device KV pages (evicting first when short, or refusing having evicted
//! nothing), state slots for a caller (`alloc_mamba`, through the Mamba component's
//! `alloc_state` in `components/mamba.rs`), host pages for backups, and giving back
//! what a caller holds.

use crate::error::{Error, Result};
use crate::pool::{as_i64, page_of_slot, Pages};

use super::Cache;

impl Cache {
    /// `n` device KV slots (whole pages) as raw indices the caller now holds, evicting
    /// first when the pool is short; `None` when it cannot, having taken nothing and
    /// evicted nothing.
    pub fn alloc_kv(&mut self, n: usize) -> Result<Option<Vec<i64>>> {
        self.cache_owned("alloc_kv")?;
        self.reap();
        let ps = self.config.page_size;
        if !n.is_multiple_of(ps) {
            return Err(Error::arg(
                "n",
                format!("{n} is not a multiple of page_size {ps}"),
            ));
        }
        self.stats.alloc_calls += 1;
        if !self.kv_available(n / ps) {
            self.stats.alloc_failures += 1;
            return Ok(None);
        }
        // Room for the answer first (fallibly): an absurd `n` the pool could grant is an
        // error, not an abort, and takes nothing.
        let mut out = Vec::new();
        out.try_reserve_exact(n).map_err(|_| Error::OutOfMemory {
            arg: "n",
            reason: format!("cannot hold {n} slot indices"),
        })?;
        let Some(owned) = self.alloc_pages(n / ps) else {
            return Ok(None);
        };
        self.expand_into(&owned.into_caller(), &mut out);
        Ok(Some(out))
    }

    /// `pages` device KV pages as an owned value, evicting LRU leaves first when short.
    /// `None` when even evicting everything evictable would not do, and then nothing is
    /// evicted: every unlocked node is reclaimable (locks cover whole paths, so an
    /// unlocked node has no locked descendant), so the check is exact.
    ///
    /// Under write-back the room an eviction makes arrives when its backups land: the
    /// call then returns `None` having started, in this one round, every backup the room
    /// needs (room already on its way from earlier evictions is not evicted again).
    #[inline]
    pub(crate) fn alloc_pages(&mut self, pages: usize) -> Option<Pages> {
        self.alloc_pages_with(pages, true)
    }

    /// [`Cache::alloc_pages`] without SWA pages: for a load-back, which gives SWA pages
    /// only to the pages whose SWA KV it copies (a page with an SWA page it never wrote
    /// would count as live).
    #[inline]
    pub(crate) fn alloc_bare_pages(&mut self, pages: usize) -> Option<Pages> {
        self.alloc_pages_with(pages, false)
    }

    /// [`Cache::alloc_pages`], whose pages get their SWA pages only when `swa` says so
    /// (one body for both, so that neither pays a call into the other).
    fn alloc_pages_with(&mut self, pages: usize, swa: bool) -> Option<Pages> {
        let ps = self.config.page_size;
        let (free, need) = (self.pools.kv.free_pages() * ps, pages * ps);
        if free < need {
            if !self.kv_available(pages) {
                self.stats.alloc_failures += 1;
                return None;
            }
            let coming = free + self.sizes.evicting_tokens;
            if coming < need {
                self.evict(need - coming, 0);
            }
        }
        let Some(got) = self.pools.kv.try_alloc(pages) else {
            self.stats.alloc_failures += 1;
            return None;
        };
        // With SWA layers every new page comes with its SWA page (freed early once its
        // tokens leave the window); without one the pages go back.
        if swa && self.has_swa() && !self.swa_attach(got.pages()) {
            return None;
        }
        Some(got)
    }

    /// One device state slot the caller now holds, evicting the least recently used
    /// unlocked state first when the pool is empty; `None` when none can be had.
    pub fn alloc_mamba(&mut self) -> Result<Option<u32>> {
        self.cache_owned("alloc_mamba")?;
        self.reap();
        Ok(self
            .alloc_state()
            .and_then(|s| s.into_caller().first().copied()))
    }

    /// Whether `pages` KV pages can be had now, by allocation or eviction (exact: every
    /// unlocked node is reclaimable), counting the room evictions already on their way
    /// will make (write-back: once their backups land).
    pub(crate) fn kv_available(&self, pages: usize) -> bool {
        let ps = self.config.page_size;
        let s = &self.sizes;
        self.pools.kv.free_pages() * ps + s.evictable_tokens + s.evicting_tokens >= pages * ps
    }

    /// Gives back a state slot the caller holds (from `alloc_mamba`). A slot that is
    /// free, owned by the cache or out of range fails, and nothing changes.
    pub fn free_mamba(&mut self, slot: i64) -> Result<()> {
        self.cache_owned("free_mamba")?;
        let p = self.state_slot_arg(slot, "slot")?;
        self.pools.mamba.free_caller(&[p], "slot").map(|_| ())
    }

    /// Gives back slots the caller holds (from `alloc_kv`). The pages containing them
    /// are freed; a page named more than once is freed once. A slot that is free,
    /// owned by the cache or out of range fails the call, which then changes nothing.
    pub fn free_kv(&mut self, indices: &[i64]) -> Result<usize> {
        self.cache_owned("free_kv")?;
        let ps = self.config.page_size;
        let capacity = as_i64(self.config.kv_slots);
        let mut pages = Vec::with_capacity(indices.len());
        for &s in indices {
            if !(0..capacity).contains(&s) {
                return Err(Error::arg(
                    "indices",
                    format!("slot {s} is out of range [0, {capacity})"),
                ));
            }
            let p = page_of_slot(s, ps);
            if pages.last() != Some(&p) {
                pages.push(p);
            }
        }
        let freed = self.pools.kv.free_caller(&pages, "indices")?;
        Ok(freed * self.config.page_size)
    }

    /// Host pages, evicting host-only leaves first when short; `None` when even
    /// evicting every unlocked host-only node would not do, and then nothing is evicted.
    ///
    /// Under `l3_write="host_eviction"` the pages an eviction frees may first be written
    /// to the L3 tier: they drain until that put ends, and count as room on its way
    /// (as write-back's device eviction counts the room its backups will make,
    /// docs/contract.md rule 11): the call then returns `None` having started, in this
    /// one round, every put the room needs, and a call after the engine ran them finds
    /// the room free.
    pub(crate) fn alloc_host_pages(&mut self, n: usize) -> Option<Pages> {
        let free = self.pools.host_kv.free_pages();
        if free < n {
            let coming = self.host_draining()[0];
            if free + coming + self.sizes.host_evictable / self.config.page_size < n {
                return None;
            }
            self.make_host_room(n, 0);
        }
        let got = self.pools.host_kv.try_alloc(n);
        if got.is_none() {
            self.stats.host_alloc_waits += 1;
        }
        got
    }
}
