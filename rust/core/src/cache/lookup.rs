//! `match_prefix` and the walks over paths: the longest cached prefix, the slots and
//! tokens of a path, splits.

use crate::tree::{Probe, NONE};

use super::components::cut::Cut;
use super::components::mamba;
use super::eviction::{Waiting, WAITING_TAIL};
use super::results::Found;
use super::sizes::Sizes;
use super::{Cache, Match, Peek, View};

impl Cache {
    /// Longest cached prefix of `tokens` in `namespace`. Splits the last node when the
    /// KV match ends inside it and refreshes the LRU position of every node on the path,
    /// ancestors older than descendants. With Mamba layers the usable match is cut back
    /// to the deepest node that has a state (`kv_len` keeps the full KV match, the branch
    /// point), and only that state's LRU position is refreshed.
    pub fn match_prefix(&mut self, namespace: Option<&str>, tokens: &[u32]) -> Match {
        let mut kv_indices = Vec::new();
        let f = self.find(namespace, tokens, Some(&mut kv_indices), None);
        Match {
            device_len: f.device_len,
            kv_indices,
            host_len: f.host_len,
            node: self.tree.id(f.end),
            host_node: self.tree.id(f.host_end),
            mamba_slot: f.mamba_slot,
            kv_len: f.kv_len,
            last_hash: self.last_hash(f.host_end),
        }
    }

    /// The lengths [`Cache::match_prefix`] would answer for `tokens` in `namespace`,
    /// with none of its effects: no node is split, refreshed or counted, no statistic
    /// moves, so no eviction order changes (a scheduler ranks waiting requests by it).
    pub fn peek_prefix(&self, namespace: Option<&str>, tokens: &[u32]) -> Peek {
        self.peek_walk(namespace, tokens).0
    }

    /// Tells eviction which requests a scheduler will admit next, soonest first
    /// (`prompts[0]` first; each with its namespace): the node where each one's match
    /// would end now ([`Cache::peek_prefix`]'s device cut: for a model with states, the
    /// state it would resume from) is given out by KV and state eviction only when no
    /// other candidate is left, the one needed latest first: Belady's rule over the
    /// waiting queue. Replaces the last call's marks (an empty list clears them). A
    /// prompt with nothing cached marks nothing. Up to 1,024 tokens of each
    /// prompt past its cached KV are kept, so that a state placed later on its path is
    /// ranked for it. While the list is not empty, requests whose admission copies
    /// landed let the states they matched go (their paths stay locked; see
    /// `Cache::release_matched_states`). Nothing else changes: no node is split,
    /// refreshed or counted. The marks are a hint: a scheduler calls this again
    /// as its queue and the tree change (a mark left on a node that no waiting request
    /// needs any more only delays that node's eviction). Returns how many nodes are
    /// marked.
    pub fn expect(&mut self, prompts: &[(Option<&str>, &[u32])]) -> usize {
        self.stats.expect_calls += 1;
        let waiting = prompts
            .iter()
            .map(|&(namespace, tokens)| {
                let mut w = self.peek_walk(namespace, tokens).1;
                let tail = &tokens[w.depth.min(tokens.len())..];
                w.next = tail[..tail.len().min(WAITING_TAIL)].to_vec();
                w
            })
            .collect();
        let marked = self.lru.expect(&mut self.tree, waiting);
        if self.lru.expecting() {
            self.release_matched_states();
        }
        marked
    }

    /// [`Cache::peek_prefix`], and where the walk ended for [`Cache::expect`].
    fn peek_walk(&self, namespace: Option<&str>, tokens: &[u32]) -> (Peek, Waiting) {
        let root = self.roots.read(namespace);
        let key = &tokens[..self.aligned(tokens.len())];
        let mut probe = Probe::default();
        self.tree.probe(root, key, &mut probe);
        // The walk of `find`, the last node taken as the upper part of its split.
        let mut cut = Cut::new(self.model());
        let (mut valid, mut any) = (0, 0);
        let mut end = root;
        let mut on_device = true;
        let mut depth = 0;
        for &(i, n) in &probe.path {
            depth += n;
            let nd = self.tree.node(i);
            on_device = on_device && !nd.kv.state.loading() && nd.kv.device.is_some();
            let (here, anywhere) = if n < nd.key.len() {
                cut.cut_inside(self, i, n, depth, on_device)
            } else {
                (
                    cut.step(self, i, depth, on_device),
                    cut.cut_any_tier(self, i, depth),
                )
            };
            if here {
                (valid, end) = (depth, i);
            }
            if anywhere {
                any = depth;
            }
        }
        // The last page matched ends the last path entry's matched part (whole pages).
        let kv_hash = probe.path.last().and_then(|&(i, n)| {
            let pages = n / self.config.page_size;
            self.tree.node(i).hashes.get(pages.checked_sub(1)?).copied()
        });
        let last = probe.path.last().map_or(root, |&(i, _)| i);
        let waiting = Waiting {
            cut: end,
            cut_depth: valid,
            last,
            generation: self.tree.node(last).generation,
            depth: probe.matched,
            next: Vec::new(),
        };
        let peek = Peek {
            device_len: valid,
            host_len: any.saturating_sub(valid),
            kv_len: probe.matched,
            kv_hash,
        };
        (peek, waiting)
    }

    /// [`Cache::match_prefix`], filling `slots` (when given) with the device slots of the
    /// match. Callers that do not return the slots pass `None` and build nothing. Every
    /// node up to the cut counts a match, and with a `priority` (an admission, which
    /// locks the path to the cut and the state there right after) is raised to it.
    pub(crate) fn find(
        &mut self,
        namespace: Option<&str>,
        tokens: &[u32],
        mut slots: Option<&mut Vec<i64>>,
        priority: Option<i64>,
    ) -> Found {
        self.reap();
        let root = self.roots.read(namespace);
        let key = &tokens[..self.aligned(tokens.len())];
        let mut probe = std::mem::take(&mut self.probe);
        self.tree.probe(root, key, &mut probe);
        // Every component of the model says where a match may end.
        let mut cut = Cut::new(self.model());
        if let Some(out) = slots.as_deref_mut() {
            out.clear();
            out.reserve(probe.matched);
        }
        // (node, length) of the deepest node valid for every component: on the device,
        // and on any tier. KV on the device is prefix-closed, and data a load-back has
        // not landed yet does not count as the device's.
        let mut valid = (root, 0);
        let mut any = (root, 0);
        let mut on_device = true;
        let mut depth = 0;
        // Path entries past the cut (`valid`) are not used by the match.
        let mut used = 0;
        // Full attention alone cuts at the last node on the device, known as the walk
        // goes: each node is refreshed as it is reached (what the second pass below does
        // for a model whose cut is known only at the end), saving a pass.
        let full_only = self.model().full_only();
        for (k, entry) in probe.path.iter_mut().enumerate() {
            let (i, n) = *entry;
            let node = if n < self.tree.node(i).key.len() {
                self.split(i, n)
            } else {
                i
            };
            entry.0 = node;
            depth += n;
            let nd = self.tree.node(node);
            on_device = on_device && !nd.kv.state.loading() && nd.kv.device.is_some();
            if let (true, Some(pages), Some(out)) =
                (on_device, nd.kv.device.as_deref(), slots.as_deref_mut())
            {
                self.expand_into(pages, out);
            }
            if full_only {
                if on_device {
                    valid = (node, depth);
                }
                any = (node, depth);
                self.refresh_matched(node, on_device, priority);
                continue;
            }
            if cut.step(self, node, depth, on_device) {
                valid = (node, depth);
                used = k + 1;
            }
            if cut.cut_any_tier(self, node, depth) {
                any = (node, depth);
            }
        }
        if !full_only {
            self.refresh_path(&probe.path, used, priority);
        }
        let kv_len = probe.matched;
        self.probe = probe;
        let (end, device_len) = valid;
        if let Some(out) = slots {
            out.truncate(device_len);
        }
        let (host_end, host_len) = if any.1 > device_len {
            (any.0, any.1 - device_len)
        } else {
            (end, 0)
        };
        let mamba_slot = mamba::device_state(self.tree.node(end));
        if mamba_slot.is_some() {
            if priority.is_some() {
                self.lru.stamp_state(&mut self.tree, end, true);
            } else {
                self.touch_state(end, true);
            }
            self.stats.state_hits += 1;
        }
        self.stats.match_calls += 1;
        self.stats.match_tokens += key.len() as u64;
        self.stats.hit_tokens += device_len as u64;
        self.stats.host_hit_tokens += host_len as u64;
        Found {
            device_len,
            host_len,
            end,
            host_end,
            mamba_slot,
            kv_len,
        }
    }

    /// [`Cache::refresh_matched`] for each node of `path`, the first `used` hit (the
    /// models whose cut is known only once the whole path was walked).
    #[inline(never)]
    fn refresh_path(&mut self, path: &[(u32, usize)], used: usize, priority: Option<i64>) {
        for (k, &(node, _)) in path.iter().enumerate() {
            self.refresh_matched(node, k < used, priority);
        }
    }

    /// Refreshes node `node` of a matched path (ancestors first, so older than their
    /// descendants); one the match uses (`hit`) counts a hit and takes an admission's
    /// `priority`. An admission locks what it uses right after: those nodes (and the
    /// state at the cut) leave the eviction sets there, so their entries are not moved
    /// here first.
    // Always inlined: the walk of a full-attention model calls it per node, and out of
    // line it costs a match more than the pass it saves (benches/instructions.py).
    #[allow(clippy::inline_always)]
    #[inline(always)]
    fn refresh_matched(&mut self, node: u32, hit: bool, priority: Option<i64>) {
        if let (true, Some(p)) = (hit, priority) {
            self.raise_priority(node, p);
        }
        if hit && priority.is_some() {
            self.lru.stamp(&mut self.tree, node, hit);
        } else {
            self.touch(node, hit);
        }
    }

    /// Device slots of the `len` tokens from the root to the end of node `end`.
    pub(crate) fn path_slots(&self, end: u32, len: usize) -> Vec<i64> {
        let mut out = Vec::with_capacity(len);
        for i in self.path_to(end) {
            if let Some(pages) = &self.tree.node(i).kv.device {
                self.expand_into(pages, &mut out);
            }
        }
        debug_assert_eq!(out.len(), len);
        out
    }

    /// Nodes from the root (excluded) to `i`, in order ([`View::path_to`]).
    #[inline]
    pub(crate) fn path_to(&self, i: u32) -> Vec<u32> {
        self.view().path_to(i)
    }

    /// Every token from the root to the end of node `i`.
    pub(crate) fn path_tokens(&self, i: u32) -> Vec<u32> {
        let mut tokens = Vec::new();
        for j in self.path_to(i) {
            tokens.extend_from_slice(&self.tree.node(j).key);
        }
        tokens
    }

    /// Whether node `a` is node `b` or one of its ancestors.
    pub(crate) fn is_ancestor_or_self(&self, a: u32, b: u32) -> bool {
        let mut cur = b;
        loop {
            if cur == a {
                return true;
            }
            let n = self.tree.node(cur);
            if n.is_root() {
                return false;
            }
            cur = n.parent;
        }
    }

    /// Splits node `i` after `at` tokens; returns the new upper node. The upper part
    /// takes the node's KV marks but not its state's (the state stays with the lower
    /// part), so the tallies are taken out for the node and put back for both parts.
    pub(crate) fn split(&mut self, i: u32, at: usize) -> u32 {
        self.stats.splits += 1;
        self.sizes -= Sizes::of(self.tree.node(i));
        let u = self.tree.split(i, at);
        self.sizes += Sizes::of(self.tree.node(u));
        self.sizes += Sizes::of(self.tree.node(i));
        self.split_components(u, i);
        u
    }
}

impl View<'_> {
    /// Nodes from the root (excluded) to `i`, in order.
    pub(crate) fn path_to(&self, i: u32) -> Vec<u32> {
        let mut path = Vec::new();
        let mut cur = i;
        while cur != NONE && !self.tree.node(cur).is_root() {
            path.push(cur);
            cur = self.tree.node(cur).parent;
        }
        path.reverse();
        path
    }
}

#[cfg(test)]
mod tests {
    use crate::cache::tests::util::{fresh as put, seq, stat};
    use crate::cache::Cache;
    use crate::config::Config;

    /// A cache of pages of 4 tokens: full attention, with Mamba states (`mamba`) and SWA
    /// layers of a window of 8 (`swa`), under `policy`.
    fn cache(mamba: bool, swa: bool, policy: &str) -> Cache {
        Cache::new(Config {
            mamba_slots: if mamba { 8 } else { 0 },
            swa_slots: if swa { 64 } else { 0 },
            swa_window: if swa { 8 } else { 0 },
            eviction_policy: policy.parse().unwrap(),
            ..Config::kv(128, 4)
        })
        .unwrap()
    }

    /// `a`, then `b` after it.
    fn join(a: &[u32], b: &[u32]) -> Vec<u32> {
        [a, b].concat()
    }

    #[test]
    fn a_peek_answers_the_lengths_of_the_match_for_every_model_inside_a_node_too() {
        // [1..8] -> {[9..16] (a state at 16) -> [17..24], [50..57]}, and [200..223]
        // cached by a request (with SWA layers its first pages left the window): queries
        // end at node ends, inside nodes (a match would split them), past the tree and
        // off it.
        let branch: Vec<u32> = (50..=57).collect();
        let long: Vec<u32> = (200..224).collect();
        let queries = [
            seq(4),
            join(&seq(6), &[99]),
            join(&seq(12), &[99, 99, 99, 99]),
            seq(16),
            join(&seq(20), &[99, 99, 99, 99]),
            seq(24),
            join(&join(&seq(8), &branch[..4]), &[99, 99, 99, 99]),
            join(&seq(8), &branch),
            vec![7, 7, 7, 7],
            join(&long[..12], &[99, 99, 99, 99]),
            join(&long[..20], &[99, 99, 99, 99]),
            long.clone(),
        ];
        for (mamba, swa) in [(false, false), (true, false), (false, true), (true, true)] {
            for tombstones in [false, true] {
                for q in &queries {
                    let mut c = cache(mamba, swa, "lru");
                    put(&mut c, &seq(16));
                    put(&mut c, &seq(24));
                    put(&mut c, &join(&seq(8), &branch));
                    let r = c.admit(None, &[]).unwrap().unwrap();
                    c.extend(r, &long).unwrap().unwrap();
                    c.finish(r).unwrap();
                    if tombstones && swa {
                        c.evict_swa(3);
                    }
                    c.audit().unwrap();
                    let nodes = c.snapshot().len();
                    let p = c.peek_prefix(None, q);
                    assert_eq!(c.snapshot().len(), nodes, "a peek splits nothing");
                    let m = c.match_prefix(None, q);
                    let what = format!("mamba {mamba} swa {swa} tombstones {tombstones} {q:?}");
                    assert_eq!(
                        (p.device_len, p.host_len, p.kv_len),
                        (m.device_len, m.host_len, m.kv_len),
                        "{what}"
                    );
                    c.audit().unwrap();
                }
            }
        }
    }

    #[test]
    fn a_peek_counts_no_hit_and_moves_no_node_in_any_eviction_order() {
        for policy in ["lru", "lfu", "priority", "state-value"] {
            let mamba = policy == "state-value";
            let mut c = cache(mamba || policy == "lfu", false, policy);
            // [1..4] is the older node and the one no match used: it goes first unless
            // the peeks below counted as uses or refreshed it.
            put(&mut c, &seq(4));
            let other = [9, 9, 9, 9];
            put(&mut c, &other);
            let stats = c.stats();
            for _ in 0..3 {
                assert_eq!(c.peek_prefix(None, &seq(6)).device_len, 4);
            }
            assert_eq!(c.stats(), stats, "{policy}: a peek moves no statistic");
            assert_eq!(stat(&c, "match_calls"), 0);
            c.audit().unwrap();
            let evicted = if c.is_hybrid() {
                c.evict(0, 1).mamba_states
            } else {
                c.evict(4, 0).kv_tokens / 4
            };
            assert_eq!(evicted, 1, "{policy}");
            assert_eq!(c.peek_prefix(None, &seq(4)).device_len, 0, "{policy}");
            assert_eq!(c.peek_prefix(None, &other).device_len, 4, "{policy}");
            c.audit().unwrap();
        }
    }
}
