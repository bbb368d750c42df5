//! The radix tree: a node arena with generation-checked ids, children keyed by their
//! first page, page-aligned keys, prefix walks over slices, and splits.
//!
//! The tree knows nothing about eviction policy or pools; it stores, per node, the data
//! of each component ([`KvNode`] for the attention KV cache) and the bookkeeping the
//! components need (last access, hit count, how many children hold device KV). The
//! eviction policies' data on a state (`cache/eviction/on_node.rs`) and the node's key in
//! the KV eviction set ride along, changed only by `cache/eviction/`.

use hashbrown::HashTable;

use crate::cache::eviction::on_node::StatePolicy;
use crate::error::{Error, Result};
use crate::hashes::PageHash;
use crate::ids::{CacheId, NodeId, Slot};

/// Index value meaning "no node" (the parent of a root).
pub(crate) const NONE: u32 = u32::MAX;

/// Where a node's KV stands: in which eviction set, or which transfer or eviction it is
/// part of. One value, so that no invalid mix can be written down: a node in an eviction
/// set has nothing in flight, a node being loaded is neither backed up nor evicted, a node
/// in the host set has no device KV to back up, load or evict.
///
/// | state | device KV | host KV | lock | set by |
/// |---|---|---|---|---|
/// | `Idle` | any | any | any | not a candidate, nothing in flight |
/// | `Listed` | yes | any | 0 | `eviction/` (an unlocked device leaf, or leaf to be) |
/// | `HostListed` | no | yes | 0 | `eviction/` (an unlocked host-only leaf) |
/// | `Loading` | yes | yes | > 0 | `load.rs` (a committed load's copies in flight) |
/// | `BackingUp` | yes | no | any | `host.rs` (a backup of its KV in flight) |
/// | `Evicting` | yes | any | 0 | `evict.rs` (chosen by a write-back eviction; `backup`: its backup is in flight) |
///
/// A node can only enter an in-flight state (`Loading`, `BackingUp`, `Evicting`) out of
/// the eviction sets ([`crate::cache::Cache`]'s `mark_kv` unlists it first), and
/// `eviction/` lists only `Idle` nodes.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KvState {
    /// Neither an eviction candidate nor part of a transfer or eviction.
    #[default]
    Idle,
    /// In the KV eviction set.
    Listed,
    /// In the host eviction set.
    HostListed,
    /// The device pages arrived by a committed load-back whose copies are not
    /// acknowledged yet: present (and protected) but not matchable, and nothing is
    /// cached below the node until the copies land or fail.
    Loading,
    /// A backup of this node's KV to the host tier is in flight.
    BackingUp,
    /// Chosen by an eviction (write-back): its device KV is freed once its backup, if
    /// any (`backup`), has landed and its device children are gone. Unlocked and out of
    /// the eviction set meanwhile; a lock or a new device child calls it off.
    Evicting {
        /// Its backup is in flight.
        backup: bool,
    },
}

impl KvState {
    /// In the KV eviction set.
    #[inline]
    pub fn in_lru(self) -> bool {
        self == KvState::Listed
    }

    /// In the host eviction set.
    #[inline]
    pub fn in_host_lru(self) -> bool {
        self == KvState::HostListed
    }

    /// A committed load's copies are in flight.
    #[inline]
    pub fn loading(self) -> bool {
        self == KvState::Loading
    }

    /// A backup of the node's KV is in flight.
    #[inline]
    pub fn backup_pending(self) -> bool {
        matches!(
            self,
            KvState::BackingUp | KvState::Evicting { backup: true }
        )
    }

    /// Chosen by a write-back eviction.
    #[inline]
    pub fn evicting(self) -> bool {
        matches!(self, KvState::Evicting { .. })
    }

    /// In an eviction set (not in flight).
    #[inline]
    pub fn listed(self) -> bool {
        matches!(self, KvState::Listed | KvState::HostListed)
    }

    /// This state with a backup of the node's KV started (`on`) or ended. Starting one
    /// takes a listed node out of its set; a loading node is never backed up.
    pub fn with_backup(self, on: bool) -> KvState {
        match (self, on) {
            (KvState::Evicting { .. }, backup) => KvState::Evicting { backup },
            (KvState::Loading, _) => {
                debug_assert!(!on, "a loading node is never backed up");
                self
            }
            (_, true) => KvState::BackingUp,
            (KvState::BackingUp, false) => KvState::Idle,
            (other, false) => other,
        }
    }

    /// This state with the node chosen by an eviction (`on`) or the eviction called
    /// off (a backup in flight goes on).
    pub fn with_evicting(self, on: bool) -> KvState {
        match (self, on) {
            (KvState::Evicting { .. }, true) => self,
            (KvState::Evicting { backup: true }, false) => KvState::BackingUp,
            (KvState::Evicting { backup: false }, false) => KvState::Idle,
            (KvState::BackingUp, true) => KvState::Evicting { backup: true },
            (_, true) => {
                debug_assert!(!self.loading(), "a loading node is never evicted");
                KvState::Evicting { backup: false }
            }
            (other, false) => other,
        }
    }

    /// This state with a committed load's copies in flight (`on`) or ended.
    pub fn with_loading(self, on: bool) -> KvState {
        match (self, on) {
            (_, true) => {
                debug_assert!(
                    matches!(self, KvState::Idle | KvState::HostListed | KvState::Loading),
                    "only a node out of transfers and evictions is loaded"
                );
                KvState::Loading
            }
            (KvState::Loading, false) => KvState::Idle,
            (other, false) => other,
        }
    }

    /// What a node split off above this one starts as: the same transfer or eviction
    /// (it is part of what was being loaded, backed up or evicted), in no set.
    pub fn for_upper(self) -> KvState {
        if self.listed() {
            KvState::Idle
        } else {
            self
        }
    }
}

/// Per-node data of the KV component.
#[derive(Debug, Default)]
pub(crate) struct KvNode {
    /// Device pages holding this node's tokens (`key.len() / page_size` of them), or
    /// `None` when the node has no device KV (a host-only node).
    pub device: Option<Vec<u32>>,
    /// Host-tier pages holding a backup of this node's tokens, or `None`.
    pub host: Option<Vec<u32>>,
    /// Number of live lock receipts whose path covers this node. On a host-only node a
    /// lock also keeps the host copy from host eviction (a load-back reads it).
    pub lock: u32,
    /// Eviction-set membership, or the transfer or eviction the node is part of.
    pub state: KvState,
    /// Its pages (and the state at its end, if any) were written to the L3 tier once, or
    /// came from there: not offered again (`cache::l3`). A hint; the store may lose them.
    pub l3: bool,
}

/// Where a node's device state stands for eviction: listed, pinned by a transfer, or
/// neither. A pinned state is never an eviction candidate (evicting it would only leave
/// its slot draining), so the two cannot be written down together.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StateMark {
    /// No device state, or one that is not a candidate (locked) and not pinned.
    #[default]
    Idle,
    /// In the state eviction set (`eviction/`: a device state, unlocked, not pinned).
    Listed,
    /// A transfer pins the device state's slot (kept by the cache from the pool's pins).
    Pinned,
}

/// Per-node data of the Mamba component: at most one state, for the prefix that ends
/// exactly at this node's end.
#[derive(Debug, Default)]
pub(crate) struct MambaNode {
    /// Device state slot, or `None` (a tombstone for this component).
    pub device: Option<u32>,
    /// Host-tier state slot (a backup), or `None`.
    pub host: Option<u32>,
    /// A backup of this state to the host tier is in flight. Kept apart from `mark`:
    /// the batch pins the state from its emission to its end, but the mark is set just
    /// before the pins and cleared just after them, so it meets every mark.
    pub backup_pending: bool,
    /// Single-node lock count (receipts that copy or use this state).
    pub lock: u32,
    /// Eviction-set membership of the device state, or its pin.
    pub mark: StateMark,
    /// Logical time the state was last used by a match (only the state actually used
    /// is refreshed, never every state on the path).
    pub last_access: u64,
    /// Matches that used this state since it was cached.
    pub hits: u64,
    /// The eviction policies' data on this state: its key in the state eviction set and
    /// the state-value policy's marks, changed only by `cache/eviction/`.
    pub policy: StatePolicy,
    /// The host state was written to the L3 tier once, or came from there (`cache::l3`).
    pub l3: bool,
}

/// Per-node data of the sliding-window attention (SWA) component. The SWA pages
/// themselves are paired with the node's KV pages by the KV pool (a page's SWA KV goes
/// where its KV goes): a node's SWA is live on a suffix of its pages, and a node none of
/// whose pages has one is a tombstone for this component (its full KV stays).
#[derive(Debug, Default)]
pub(crate) struct SwaNode {
    /// One entry per live lock receipt whose window covers part of this node: how many
    /// tokens of that window lie in this node and above it (`> 0`). A split hands the
    /// upper part the entries that reach above the lower part, less the lower part's
    /// length, so a receipt's window stays exactly the nodes it covers.
    pub locks: Vec<u32>,
    /// In the SWA eviction queue (`cache::components::swa`).
    pub queued: bool,
}

/// What KV events have announced of a node (`cache::events`): per tier, whether its
/// pages are there and whether its state is. Kept equal to [`Announced::of`] the node
/// by `Cache::edit`, which emits an event for each difference.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
#[allow(clippy::struct_excessive_bools)] // four independent facts, compared as one value
pub(crate) struct Announced {
    /// Device KV, landed (not a committed load-back's pages in flight).
    pub device: bool,
    /// Host KV (a backup's pages only once it landed).
    pub host: bool,
    /// A device state, landed.
    pub device_state: bool,
    /// A host state.
    pub host_state: bool,
}

impl Announced {
    /// What a router may be told of node `n` now, which has a device state (`device_state`)
    /// and a host state (`host_state`) or not: data that is there and not in flight
    /// towards it. (The Mamba component says what states the node has:
    /// `components::mamba::announced`.)
    pub fn of(n: &Node, device_state: bool, host_state: bool) -> Announced {
        let landed = !n.kv.state.loading();
        Announced {
            device: landed && n.kv.device.is_some(),
            host: n.kv.host.is_some(),
            device_state: landed && device_state,
            host_state,
        }
    }
}

/// One node of the tree.
pub(crate) struct Node {
    pub generation: u64,
    pub live: bool,
    pub parent: u32,
    /// Tokens of this node (a non-empty multiple of the page size, except for roots).
    pub key: Vec<u32>,
    /// Children keyed by a hash of their first page; entries carry the hash so that the
    /// table can grow without reading the arena, and lookups compare the real page.
    pub children: HashTable<(u64, u32)>,
    /// Children that hold device KV: a node with none is a device leaf.
    pub device_children: u32,
    /// Those of them being evicted: a node all of whose device children are is a leaf
    /// to be, and an eviction can choose it in the same pass.
    pub evicting_children: u32,
    pub kv: KvNode,
    pub mamba: MambaNode,
    pub swa: SwaNode,
    /// With page hashes: one chained hash per page of `key`, the first chained from the
    /// parent's last (`crate::hashes`); a root holds its namespace's seed (none without
    /// one). Empty with page hashes off.
    pub hashes: Vec<PageHash>,
    /// What KV events have announced of the node (all false with events off).
    pub announced: Announced,
    /// Logical time of the last access (larger is more recent).
    pub last_access: u64,
    /// Inserts through this node (write-through-selective backs a node up after enough).
    pub hits: u64,
    /// Matches that used this node (on the matched path up to the cut).
    pub matches: u64,
    /// The highest priority of the inserts and admissions through this node.
    pub priority: i64,
    /// The node's key in the KV or host eviction set, while it is in one.
    pub lru_key: (u64, u64),
    /// A waiting request's match ends here: 1 + the rank of the soonest such request
    /// (`Cache::expect`); 0 when none does. Eviction passes over marked nodes.
    pub expected: u32,
}

impl Node {
    fn vacant(generation: u64) -> Node {
        Node {
            generation,
            live: false,
            parent: NONE,
            key: Vec::new(),
            children: HashTable::new(),
            device_children: 0,
            evicting_children: 0,
            kv: KvNode::default(),
            mamba: MambaNode::default(),
            swa: SwaNode::default(),
            hashes: Vec::new(),
            announced: Announced::default(),
            last_access: 0,
            hits: 0,
            matches: 0,
            priority: 0,
            lru_key: (0, 0),
            expected: 0,
        }
    }

    pub fn is_root(&self) -> bool {
        self.parent == NONE
    }
}

/// How far a walk got: the nodes passed, each with how many of its tokens matched.
/// Every entry but possibly the last matched its whole key.
#[derive(Debug, Default)]
pub(crate) struct Probe {
    pub path: Vec<(u32, usize)>,
    /// Tokens matched (a multiple of the page size).
    pub matched: usize,
}

/// The node arena and the walks over it.
pub(crate) struct Tree {
    pub cache_id: CacheId,
    pub page_size: usize,
    pub nodes: Vec<Node>,
    free: Vec<u32>,
    pub live_nodes: usize,
}

impl Tree {
    pub fn new(page_size: usize) -> Tree {
        Tree {
            cache_id: CacheId::fresh(),
            page_size,
            nodes: Vec::new(),
            free: Vec::new(),
            live_nodes: 0,
        }
    }

    pub fn id(&self, index: u32) -> NodeId {
        NodeId {
            cache: self.cache_id,
            slot: Slot {
                index,
                generation: self.nodes[index as usize].generation,
            },
        }
    }

    /// The arena index of a live node, or `StaleNode`.
    pub fn resolve(&self, id: NodeId) -> Result<u32> {
        let index = id.slot.index;
        match self.nodes.get(index as usize) {
            Some(n)
                if id.cache == self.cache_id && n.live && n.generation == id.slot.generation =>
            {
                Ok(index)
            }
            _ => Err(Error::StaleNode(id)),
        }
    }

    pub fn node(&self, i: u32) -> &Node {
        &self.nodes[i as usize]
    }

    /// Tokens from the root to the end of node `i`.
    pub fn depth(&self, i: u32) -> usize {
        let mut depth = 0;
        let mut cur = i;
        while cur != NONE {
            let n = &self.nodes[cur as usize];
            depth += n.key.len();
            cur = n.parent;
        }
        depth
    }

    /// Whether index `i` holds a live node of `generation` (the node seen then).
    pub fn is_current(&self, i: u32, generation: u64) -> bool {
        self.nodes
            .get(i as usize)
            .is_some_and(|n| n.live && n.generation == generation)
    }

    pub fn node_mut(&mut self, i: u32) -> &mut Node {
        &mut self.nodes[i as usize]
    }

    /// A new live node with the given key and parent (not yet linked as a child).
    pub fn alloc_node(&mut self, parent: u32, key: Vec<u32>) -> u32 {
        let i = if let Some(i) = self.free.pop() {
            i
        } else {
            let i = crate::pool::index_u32(self.nodes.len());
            self.nodes.push(Node::vacant(0));
            i
        };
        let n = &mut self.nodes[i as usize];
        n.live = true;
        n.parent = parent;
        n.key = key;
        self.live_nodes += 1;
        i
    }

    /// Retires a node: its handles go stale, its slot is reused later.
    pub fn free_node(&mut self, i: u32) {
        let n = &mut self.nodes[i as usize];
        let generation = n.generation.wrapping_add(1);
        *n = Node::vacant(generation);
        self.free.push(i);
        self.live_nodes -= 1;
    }

    pub fn hash_page(page: &[u32]) -> u64 {
        // FxHash-style fold: fast, and collisions only cost a page comparison.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for &t in page {
            h = (h.rotate_left(5) ^ u64::from(t)).wrapping_mul(0x517c_c1b7_2722_0a95);
        }
        h
    }

    /// The child of `parent` whose key starts with `page`.
    pub fn child(&self, parent: u32, page: &[u32]) -> Option<u32> {
        let h = Tree::hash_page(page);
        let ps = self.page_size;
        self.nodes[parent as usize]
            .children
            .find(h, |&(ch, c)| {
                ch == h && self.nodes[c as usize].key[..ps] == *page
            })
            .map(|&(_, c)| c)
    }

    pub fn link_child(&mut self, parent: u32, child: u32) {
        let h = Tree::hash_page(&self.nodes[child as usize].key[..self.page_size]);
        self.nodes[parent as usize]
            .children
            .insert_unique(h, (h, child), |&(ch, _)| ch);
    }

    pub fn unlink_child(&mut self, parent: u32, child: u32) {
        let h = Tree::hash_page(&self.nodes[child as usize].key[..self.page_size]);
        if let Ok(entry) = self.nodes[parent as usize]
            .children
            .find_entry(h, |&(_, c)| c == child)
        {
            entry.remove();
        }
    }

    /// Walks from `root` along `key` (page-aligned) without changing anything.
    pub fn probe(&self, root: u32, key: &[u32], out: &mut Probe) {
        out.path.clear();
        out.matched = 0;
        let ps = self.page_size;
        let mut node = root;
        let mut pos = 0;
        while pos < key.len() {
            let Some(child) = self.child(node, &key[pos..pos + ps]) else {
                break;
            };
            let ckey = &self.nodes[child as usize].key;
            let n = common_prefix(ckey, &key[pos..]) / ps * ps;
            out.path.push((child, n));
            pos += n;
            if n < ckey.len() {
                break;
            }
            node = child;
        }
        out.matched = pos;
    }

    /// Splits node `i` after its first `at` tokens (`0 < at < key.len()`, page-aligned).
    /// The lower part keeps the node's identity (handles stay valid and still end where
    /// they did); a new upper node takes the first `at` tokens (device and host pages
    /// alike), the parent link, a copy of the KV lock count (so that receipts below it
    /// stay balanced) and the in-flight and eviction marks (it is part of what was being
    /// backed up or evicted, and its only child is the lower part), and copies of the
    /// access time, the insert and match counts and the priority (everything that went
    /// through the lower part went through it). The page hashes split with the pages
    /// (nothing is recomputed: a page's hash depends only on the pages before it). A Mamba state (and its single-node lock) stays with the lower node, which still ends where the
    /// state was taken; the upper node is a Mamba tombstone.
    pub fn split(&mut self, i: u32, at: usize) -> u32 {
        // The parent's child entry is keyed by the first page, which the upper node
        // will share: unlink by identity while the key is still whole.
        let parent = self.nodes[i as usize].parent;
        self.unlink_child(parent, i);
        let ps = self.page_size;
        let split_pages = |pages: &mut Vec<u32>| {
            let rest = pages.split_off(at / ps);
            std::mem::replace(pages, rest)
        };
        let (upper_key, upper_device, upper_host, upper_hashes, has_kv) = {
            let n = &mut self.nodes[i as usize];
            let rest = n.key.split_off(at);
            let upper_key = std::mem::replace(&mut n.key, rest);
            let upper_device = n.kv.device.as_mut().map(split_pages);
            let upper_host = n.kv.host.as_mut().map(split_pages);
            let upper_hashes = if n.hashes.is_empty() {
                Vec::new()
            } else {
                let rest = n.hashes.split_off(at / ps);
                std::mem::replace(&mut n.hashes, rest)
            };
            (
                upper_key,
                upper_device,
                upper_host,
                upper_hashes,
                n.kv.device.is_some(),
            )
        };
        let (lock, state, l3, announced) = {
            let n = &self.nodes[i as usize];
            (n.kv.lock, n.kv.state, n.kv.l3, n.announced)
        };
        let (last_access, hits, matches, priority) = {
            let n = &self.nodes[i as usize];
            (n.last_access, n.hits, n.matches, n.priority)
        };
        let u = self.alloc_node(parent, upper_key);
        {
            let un = &mut self.nodes[u as usize];
            un.kv.device = upper_device;
            un.kv.host = upper_host;
            un.hashes = upper_hashes;
            // Its pages are where the lower part's are; the state stays below.
            un.announced = Announced {
                device_state: false,
                host_state: false,
                ..announced
            };
            un.kv.lock = lock;
            un.kv.state = state.for_upper();
            un.kv.l3 = l3;
            un.last_access = last_access;
            un.hits = hits;
            un.matches = matches;
            un.priority = priority;
            un.device_children = u32::from(has_kv);
            un.evicting_children = u32::from(has_kv && state.evicting());
        }
        self.nodes[i as usize].parent = u;
        self.link_child(parent, u);
        self.link_child(u, i);
        u
    }

    /// Node indices of the subtree under `root`, parents before children.
    pub fn preorder(&self, root: u32) -> Vec<u32> {
        let mut out = Vec::new();
        let mut stack = vec![root];
        while let Some(i) = stack.pop() {
            out.push(i);
            let mut kids: Vec<u32> = self.nodes[i as usize]
                .children
                .iter()
                .map(|&(_, c)| c)
                .collect();
            // Deterministic order (by first token) for dumps and pretty printing.
            kids.sort_unstable_by(|a, b| {
                self.nodes[*b as usize]
                    .key
                    .cmp(&self.nodes[*a as usize].key)
            });
            stack.extend(kids);
        }
        out
    }
}

/// Length of the common prefix of two token slices. Compares blocks of 16 tokens as
/// slices (a memcmp the compiler vectorises) and only looks token by token inside the
/// block where they differ.
pub(crate) fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    const BLOCK: usize = 16;
    let n = a.len().min(b.len());
    // Most walks match whole nodes: one comparison of the full overlap settles those.
    if a[..n] == b[..n] {
        return n;
    }
    let mut i = 0;
    while i + BLOCK <= n && a[i..i + BLOCK] == b[i..i + BLOCK] {
        i += BLOCK;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leaf(t: &mut Tree, parent: u32, key: &[u32]) -> u32 {
        let i = t.alloc_node(parent, key.to_vec());
        t.link_child(parent, i);
        i
    }

    #[test]
    fn common_prefix_handles_blocks_and_tails() {
        let a: Vec<u32> = (0..40).collect();
        let mut b = a.clone();
        assert_eq!(common_prefix(&a, &b), 40);
        b[17] = 99;
        assert_eq!(common_prefix(&a, &b), 17);
        assert_eq!(common_prefix(&a[..5], &b), 5);
        assert_eq!(common_prefix(&[], &b), 0);
    }

    #[test]
    fn probe_stops_inside_a_node_and_at_page_granularity() {
        let mut t = Tree::new(2);
        let root = t.alloc_node(NONE, Vec::new());
        let a = leaf(&mut t, root, &[1, 2, 3, 4, 5, 6]);
        let mut p = Probe::default();
        // Diverges inside page 2 (token 4 vs 9): matches one page only.
        t.probe(root, &[1, 2, 3, 9], &mut p);
        assert_eq!(p.matched, 2);
        assert_eq!(p.path, vec![(a, 2)]);
        t.probe(root, &[1, 2, 3, 4, 5, 6, 7, 8], &mut p);
        assert_eq!(p.matched, 6);
        t.probe(root, &[7, 7], &mut p);
        assert_eq!(p.matched, 0);
        assert!(p.path.is_empty());
    }

    #[test]
    fn children_sharing_a_first_token_are_told_apart_by_the_whole_page() {
        let mut t = Tree::new(2);
        let root = t.alloc_node(NONE, Vec::new());
        let a = leaf(&mut t, root, &[1, 2]);
        let b = leaf(&mut t, root, &[1, 3]);
        assert_eq!(t.child(root, &[1, 2]), Some(a));
        assert_eq!(t.child(root, &[1, 3]), Some(b));
        assert_eq!(t.child(root, &[1, 4]), None);
    }

    #[test]
    fn split_keeps_the_lower_identity_and_relinks() {
        let mut t = Tree::new(1);
        let root = t.alloc_node(NONE, Vec::new());
        let a = leaf(&mut t, root, &[1, 2, 3, 4]);
        t.node_mut(a).kv.device = Some(vec![10, 11, 12, 13]);
        t.node_mut(a).kv.lock = 2;
        let id_before = t.id(a);
        let u = t.split(a, 1);
        assert_eq!(t.resolve(id_before), Ok(a), "lower node keeps its handle");
        assert_eq!(t.node(u).key, vec![1]);
        assert_eq!(t.node(a).key, vec![2, 3, 4]);
        assert_eq!(t.node(u).kv.device.as_deref(), Some(&[10][..]));
        assert_eq!(t.node(a).kv.device.as_deref(), Some(&[11, 12, 13][..]));
        assert_eq!(
            t.node(u).kv.lock,
            2,
            "the upper node inherits the lock count"
        );
        assert_eq!(t.child(root, &[1]), Some(u));
        assert_eq!(t.child(u, &[2]), Some(a));
        assert_eq!(t.node(a).parent, u);
        assert_eq!(t.node(u).device_children, 1);
    }

    #[test]
    fn generations_do_not_wrap_at_32_bits() {
        // A slot reused 2^32 times: with 32-bit generations the handle of its first node
        // would alias the node living there now.
        let mut t = Tree::new(1);
        let root = t.alloc_node(NONE, Vec::new());
        let a = leaf(&mut t, root, &[5]);
        let first = t.id(a);
        t.node_mut(a).generation = u64::from(u32::MAX);
        t.unlink_child(root, a);
        t.free_node(a);
        let b = leaf(&mut t, root, &[6]);
        assert_eq!(b, a, "slot reused");
        assert_eq!(t.id(b).generation(), 1 << 32);
        assert!(
            t.resolve(first).is_err(),
            "the first handle (generation 0) is stale"
        );
    }

    #[test]
    fn freed_node_handles_go_stale_even_when_the_slot_is_reused() {
        let mut t = Tree::new(1);
        let root = t.alloc_node(NONE, Vec::new());
        let a = leaf(&mut t, root, &[5]);
        let old = t.id(a);
        t.unlink_child(root, a);
        t.free_node(a);
        assert_eq!(t.resolve(old), Err(Error::StaleNode(old)));
        let b = leaf(&mut t, root, &[6]);
        assert_eq!(b, a, "slot reused");
        assert_eq!(t.resolve(old), Err(Error::StaleNode(old)));
        let other = Tree::new(1);
        assert!(
            other.resolve(t.id(b)).is_err(),
            "handles of another cache are rejected"
        );
    }
}
