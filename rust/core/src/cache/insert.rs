//! `insert` and the one step every publication into the tree goes through (`publish`):
//! an insert's pages, a request's checkpoint and finish; plus placing device pages on a
//! host-only node and a state on a node.

use crate::error::{Error, Result};
use crate::pool::{as_i64, page_of_slot, Pages};
use crate::tree::Probe;

use super::components::shares::RequestShare;
use super::{Cache, Insert};

/// What [`Cache::publish`] did.
pub(crate) struct Published {
    pub insert: Insert,
    /// The node where the cached part ends.
    pub end: u32,
    /// Tokens now cached for the sequence (the aligned length, or less when a load in
    /// flight stopped the insert).
    pub cached: usize,
    /// The caller's pages for tokens `cached..aligned` that were not cached.
    pub unpublished: Pages,
}

impl Cache {
    /// Caches `tokens` whose slots are `kv_indices` (one per token).
    ///
    /// `kv_indices[..owned_from]` must be the tree's own slots for that prefix (from an
    /// earlier match) and are left alone; the caller hands over `kv_indices[owned_from..]`
    /// and must hold them. Slots of tokens the tree already caches, and the slots of an
    /// unaligned tail, are freed by the cache: the caller never frees after an insert.
    /// Any bad argument fails the call and changes nothing.
    pub fn insert(
        &mut self,
        namespace: Option<&str>,
        tokens: &[u32],
        kv_indices: &[i64],
        owned_from: usize,
    ) -> Result<Insert> {
        self.insert_with_state(namespace, tokens, kv_indices, owned_from, None)
    }

    /// [`Cache::insert_with_priority`] with priority 0.
    pub fn insert_with_state(
        &mut self,
        namespace: Option<&str>,
        tokens: &[u32],
        kv_indices: &[i64],
        owned_from: usize,
        mamba_slot: Option<i64>,
    ) -> Result<Insert> {
        self.insert_with_priority(namespace, tokens, kv_indices, owned_from, mamba_slot, 0)
    }

    /// [`Cache::insert`] that also hands over the Mamba state slot `mamba_slot` (from
    /// `alloc_mamba`), taken at the end of `tokens`. It lands on the node where the insert
    /// ends; if that node has a state already the slot is freed and
    /// `Insert::mamba_existed` is true. A state cannot sit anywhere but at a node's end,
    /// so with an unaligned tail, or with no whole page, the slot is freed too.
    /// Every node the insert passes or adds takes `priority` when it is higher than the
    /// node's (the "priority" eviction policy keeps higher priorities longer).
    pub fn insert_with_priority(
        &mut self,
        namespace: Option<&str>,
        tokens: &[u32],
        kv_indices: &[i64],
        owned_from: usize,
        mamba_slot: Option<i64>,
        priority: i64,
    ) -> Result<Insert> {
        let ps = self.config.page_size;
        if kv_indices.len() != tokens.len() {
            return Err(Error::arg(
                "kv_indices",
                format!(
                    "has {} entries for {} tokens",
                    kv_indices.len(),
                    tokens.len()
                ),
            ));
        }
        if owned_from > tokens.len() {
            return Err(Error::arg(
                "owned_from",
                format!("{owned_from} is past the end of {} tokens", tokens.len()),
            ));
        }
        if !owned_from.is_multiple_of(ps) {
            return Err(Error::arg(
                "owned_from",
                format!("{owned_from} is not a multiple of page_size {ps}"),
            ));
        }
        let state_page = match mamba_slot {
            None => None,
            Some(s) if !self.is_hybrid() => {
                return Err(Error::arg(
                    "mamba_slot",
                    format!("this cache has no Mamba state pool (mamba_slots=0), got {s}"),
                ))
            }
            Some(s) => Some(self.state_slot_arg(s, "mamba_slot")?),
        };
        let owned_pages = self.pages_of(&kv_indices[owned_from..], owned_from)?;
        // An unseen namespace gets its root only once the call cannot fail (a failed
        // insert changes nothing); until then it matches nothing.
        self.reap();
        let existing_root = self.roots.get(namespace);
        let aligned = self.aligned(tokens.len());
        let mut probe = std::mem::take(&mut self.probe);
        if let Some(root) = existing_root {
            self.tree.probe(root, &tokens[..aligned], &mut probe);
        } else {
            probe.path.clear();
            probe.matched = 0;
        }
        let checked = self.check_owned_prefix(&probe, kv_indices, owned_from);
        let claimed = checked.and_then(|()| {
            let kv = self.pools.kv.claim_caller(&owned_pages, "kv_indices")?;
            let Some(p) = state_page else {
                return Ok((kv, None));
            };
            match self.pools.mamba.claim_caller(&[p], "mamba_slot") {
                Ok(state) => Ok((kv, Some(state))),
                Err(e) => {
                    // Back to the caller, as if the KV claim had not happened.
                    let _ = kv.into_caller();
                    Err(e)
                }
            }
        });
        let (owned, state) = match claimed {
            Ok(c) => c,
            Err(e) => {
                self.probe = probe;
                return Err(e);
            }
        };
        // From here on nothing can fail. A namespace gets a root only for a page to cache.
        let root = match existing_root {
            Some(root) => root,
            None if aligned == 0 => self.roots.empty(),
            None => self.root(namespace),
        };
        let out = self.publish(root, &probe, tokens, owned_from, owned, state, priority);
        self.probe = probe;
        drop(out.unpublished);
        self.maybe_backup(out.end);
        Ok(out.insert)
    }

    /// A state slot argument: in range of the Mamba pool.
    pub(crate) fn state_slot_arg(&self, s: i64, arg: &'static str) -> Result<u32> {
        u32::try_from(s)
            .ok()
            .filter(|&p| (p as usize) < self.config.mamba_slots)
            .ok_or_else(|| {
                Error::arg(
                    arg,
                    format!("slot {s} is out of range [0, {})", self.config.mamba_slots),
                )
            })
    }

    /// The part of an insert that cannot fail: splits along the probed path, frees the
    /// duplicate and tail pages of `owned` (pages for tokens from `owned_from` on),
    /// revives host-only nodes on the path with the caller's pages, adds the new leaf
    /// and places `state`. A node whose load-back is in flight stops the insert there:
    /// nothing is cached at or below it, and the caller's pages from there to the
    /// aligned end come back as `unpublished`. The nodes passed take `priority` when it
    /// is higher, the new leaf takes it.
    #[allow(clippy::too_many_arguments)] // the insert's parts, each used once
    pub(crate) fn publish(
        &mut self,
        root: u32,
        probe: &Probe,
        tokens: &[u32],
        owned_from: usize,
        owned: Pages,
        state: Option<Pages>,
        priority: i64,
    ) -> Published {
        let ps = self.config.page_size;
        let aligned = self.aligned(tokens.len());
        let mut end = root;
        let mut pos = 0;
        // Token position of the first page not handed out; pages go front to back.
        let mut owned_pos = owned_from;
        let mut owned = owned.into_run();
        let mut blocked = false;
        let mut duplicates = 0;
        for &(i, n) in &probe.path {
            if self.tree.node(i).kv.state.loading() {
                blocked = true;
                break;
            }
            let node = if n < self.tree.node(i).key.len() {
                self.split(i, n)
            } else {
                i
            };
            let next = pos + n;
            if next > owned_pos {
                let here = owned.take((next - owned_pos) / ps);
                if self.tree.node(node).kv.device.is_none() {
                    // A host-only node: the caller's fresh slots become its device copy
                    // (the whole node is past `owned_from`: the owned prefix is on the
                    // device).
                    self.revive(node, here);
                } else {
                    duplicates += next - owned_pos;
                    self.passed_duplicate_components(node, here.pages());
                    drop(here);
                }
                owned_pos = next;
            }
            self.tree.node_mut(node).hits += 1;
            self.raise_priority(node, priority);
            self.touch(node, false);
            end = node;
            pos = next;
        }
        let mut unpublished = self.pools.kv.empty();
        let cached = if blocked {
            unpublished = owned.take((aligned - owned_pos.max(pos)) / ps);
            // The unaligned tail.
            drop(owned);
            pos
        } else {
            if aligned > pos {
                let leaf_pages = owned.take((aligned - pos) / ps);
                end = self.add_leaf(end, tokens[pos..aligned].to_vec(), leaf_pages, priority);
                self.tree.node_mut(end).hits = 1;
                self.stats.inserted_tokens += (aligned - pos) as u64;
            }
            // The unaligned tail.
            drop(owned);
            aligned
        };
        // What the caller hands over beside its KV (a state, taken at tokens.len()).
        let at_end = end != root && cached == tokens.len();
        let mamba_existed =
            self.keep_on_node_components(end, at_end, &mut RequestShare::state(state));
        self.stats.insert_calls += 1;
        self.stats.duplicate_tokens += duplicates as u64;
        Published {
            insert: Insert {
                prefix_len: probe.matched.min(pos),
                node: self.tree.id(end),
                mamba_existed,
            },
            end,
            cached,
            unpublished,
        }
    }

    /// Gives host-only node `i` device pages (an insert passing through it).
    fn revive(&mut self, i: u32, pages: Pages) {
        let len = self.tree.node(i).key.len();
        self.give_device_pages(i, pages);
        self.stats.revived_tokens += len as u64;
    }

    /// Publishes `pages` as host-only node `i`'s device KV (its parent has device KV),
    /// keeping the sizes and eviction sets right.
    pub(crate) fn give_device_pages(&mut self, i: u32, pages: Pages) {
        self.edit(i, |n| n.kv.device = Some(pages.into_tree()));
        let parent = self.tree.node(i).parent;
        // A parent being evicted now has a device child that is not: it stays.
        self.cancel_eviction(parent);
        self.tree.node_mut(parent).device_children += 1;
        self.refresh(parent);
        self.refresh(i);
        self.swa_enqueue(i);
    }

    /// Validates the page structure of caller slots for positions starting at `start`
    /// (page-aligned): each page's slots are consecutive and start at a page boundary, in
    /// range. Returns the page numbers.
    fn pages_of(&self, slots: &[i64], start: usize) -> Result<Vec<u32>> {
        let ps = self.config.page_size;
        let capacity = as_i64(self.config.kv_slots);
        if ps == 1 {
            // Page = slot: one range check per token, no divisions.
            return slots
                .iter()
                .map(|&s| {
                    u32::try_from(s)
                        .ok()
                        .filter(|_| s < capacity)
                        .ok_or_else(|| {
                            Error::arg(
                                "kv_indices",
                                format!("slot {s} is out of range [0, {capacity})"),
                            )
                        })
                })
                .collect();
        }
        let mut pages = Vec::with_capacity(slots.len().div_ceil(ps));
        for (c, chunk) in slots.chunks(ps).enumerate() {
            let first = chunk[0];
            if !(0..capacity).contains(&first) {
                return Err(Error::arg(
                    "kv_indices",
                    format!("slot {first} is out of range [0, {capacity})"),
                ));
            }
            let ps_i = as_i64(ps);
            let pos = start + c * ps;
            if first % ps_i != 0 || chunk.iter().zip(first..).any(|(&s, want)| s != want) {
                return Err(Error::arg(
                    "kv_indices",
                    format!(
                        "slots for tokens {pos}..{} are not one page (page_size {ps}): {:?}",
                        pos + chunk.len(),
                        chunk
                    ),
                ));
            }
            pages.push(page_of_slot(first, ps));
        }
        Ok(pages)
    }

    /// Checks that `kv_indices[..owned_from]` are the tree's slots for that prefix.
    fn check_owned_prefix(
        &self,
        probe: &Probe,
        kv_indices: &[i64],
        owned_from: usize,
    ) -> Result<()> {
        if owned_from == 0 {
            return Ok(());
        }
        if probe.matched < owned_from {
            return Err(Error::arg(
                "owned_from",
                format!(
                    "the first {owned_from} tokens are not cached (only {} are): \
                     kv_indices[:owned_from] must come from a match of this prefix",
                    probe.matched
                ),
            ));
        }
        // Compared page by page against the caller's slots, without materialising the
        // tree's slots. Every page below `owned_from` has device KV (it matched).
        let ps = self.config.page_size;
        let mut pos = 0;
        for &(i, n) in &probe.path {
            let node = self.tree.node(i);
            let Some(pages) = node.kv.device.as_ref().filter(|_| !node.kv.state.loading()) else {
                break;
            };
            for &p in &pages[..n / ps] {
                if pos >= owned_from {
                    return Ok(());
                }
                let base = i64::from(p) * as_i64(ps);
                let theirs = &kv_indices[pos..pos + ps];
                if theirs.iter().zip(base..).any(|(&a, b)| a != b) {
                    return Err(Error::arg(
                        "kv_indices",
                        format!(
                            "kv_indices[:owned_from] are not the cache's slots for that prefix \
                             (first difference in tokens {pos}..{})",
                            pos + ps
                        ),
                    ));
                }
                pos += ps;
            }
        }
        if pos < owned_from {
            return Err(Error::arg(
                "owned_from",
                format!("only {pos} of the first {owned_from} tokens have device KV"),
            ));
        }
        Ok(())
    }

    /// Adds a device leaf under `parent` holding `pages`, with `priority`; returns it.
    fn add_leaf(&mut self, parent: u32, key: Vec<u32>, pages: Pages, priority: i64) -> u32 {
        let hashes = self.leaf_hashes(parent, &key);
        let leaf = self.tree.alloc_node(parent, key);
        self.tree.node_mut(leaf).hashes = hashes;
        self.tree.node_mut(leaf).priority = priority;
        self.edit(leaf, |n| n.kv.device = Some(pages.into_tree()));
        self.tree.link_child(parent, leaf);
        self.cancel_eviction(parent);
        self.tree.node_mut(parent).device_children += 1;
        self.touch(leaf, false);
        self.refresh(parent);
        self.refresh(leaf);
        self.swa_enqueue(leaf);
        leaf
    }
}
