//! The lookahead marks: what the waiting queue will need next. `Cache::expect` tells
//! the eviction sets of the requests a scheduler will admit next ([`Waiting`], soonest
//! first); [`Lookahead`] marks the node where each one's match ends with its rank
//! (`Node::expected`, 1 + its place in the queue), and eviction passes over marked
//! nodes while any other is a candidate, taking of them the one needed latest first
//! ([`unexpected`]: Belady's rule over the waiting queue). A state placed later that a
//! waiting request would resume from gets its rank too ([`Lookahead::rank_of`]).

use crate::tree::{Tree, NONE};

/// A request a scheduler will admit soon (`Cache::expect`): where its match ends
/// now, and its prompt's cached KV.
#[derive(Debug, Clone)]
pub(crate) struct Waiting {
    /// The node its match ends at (the device cut), and how deep (0: nothing cached).
    pub cut: u32,
    pub cut_depth: usize,
    /// The last node its KV walk reached (the match may end inside it), the node's
    /// generation then, and how deep the walk got.
    pub last: u32,
    pub generation: u64,
    pub depth: usize,
    /// The prompt's next tokens past the walk (at most [`WAITING_TAIL`]): a state placed
    /// that deep later, on a path that goes on as the prompt does, serves it too.
    pub next: Vec<u32>,
}

/// How many of a waiting prompt's tokens past its cached KV [`Cache::expect`] keeps: a
/// running request whose prompt this one extends (a conversation's next turn, while
/// the turn before decodes) places its end state up to its output's length deeper
/// than the KV the walk saw.
///
/// [`Cache::expect`]: crate::cache::Cache::expect
pub(crate) const WAITING_TAIL: usize = 1024;

/// The waiting requests the sets were last told of, the nodes marked for them, and
/// how often eviction had to take a marked one.
#[derive(Default)]
pub(super) struct Lookahead {
    /// The nodes [`Lookahead::expect`] marked (`Node::expected`), as they were then:
    /// some may have been freed since, their index even reused by an unmarked node.
    expected: Vec<u32>,
    /// The requests [`Lookahead::expect`] was told of, soonest first.
    waiting: Vec<Waiting>,
    /// Evictions that took a marked node for want of an unmarked candidate.
    taken: u64,
}

impl Lookahead {
    /// Marks the node where the match of each of `waiting` (soonest first) ends,
    /// clearing the marks of the last call; a node named twice keeps its sooner rank.
    /// Returns how many nodes are marked.
    pub(super) fn expect(&mut self, tree: &mut Tree, waiting: Vec<Waiting>) -> usize {
        for i in self.expected.drain(..) {
            tree.node_mut(i).expected = 0;
        }
        self.waiting = waiting;
        for (rank, w) in self.waiting.iter().enumerate() {
            if w.cut_depth > 0 {
                let rank = u32::try_from(rank + 1).unwrap_or(u32::MAX);
                mark(tree, &mut self.expected, w.cut, rank);
            }
        }
        self.expected.len()
    }

    /// The rank (1 + position) of the soonest waiting request that a state at the end
    /// of node `i`, `depth` tokens deep, would serve: its prompt's cached KV passes
    /// through the whole node and no deeper state was on its path when it was told of.
    /// 0 when none would.
    pub(super) fn rank_of(&self, tree: &Tree, i: u32, depth: usize) -> u32 {
        let serves = |w: &Waiting| {
            if w.cut_depth >= depth || !tree.is_current(w.last, w.generation) {
                return false;
            }
            if w.depth < depth {
                return goes_on(tree, w, i, depth);
            }
            let mut cur = w.last;
            while cur != NONE && cur != i {
                cur = tree.node(cur).parent;
            }
            cur == i
        };
        self.waiting
            .iter()
            .position(serves)
            .map_or(0, |r| u32::try_from(r + 1).unwrap_or(u32::MAX))
    }

    /// Marks node `i` with `rank` unless `rank` is 0 (no waiting request needs it).
    pub(super) fn mark(&mut self, tree: &mut Tree, i: u32, rank: u32) {
        if rank > 0 {
            mark(tree, &mut self.expected, i, rank);
        }
    }

    /// Whether any node is marked: eviction looks at marks only then.
    #[inline]
    pub(super) fn any_marked(&self) -> bool {
        !self.expected.is_empty()
    }

    /// Counts an eviction that took a marked node (`marked`, as [`unexpected`] says).
    #[inline]
    pub(super) fn took(&mut self, marked: bool) {
        self.taken += u64::from(marked);
    }

    /// Whether the last call of [`Lookahead::expect`] was told of waiting requests.
    pub(super) fn expecting(&self) -> bool {
        !self.waiting.is_empty()
    }

    /// The nodes marked now.
    pub(super) fn expected(&self) -> impl Iterator<Item = u32> + '_ {
        self.expected.iter().copied()
    }

    /// Evictions that took a marked node for want of an unmarked candidate.
    pub(super) fn taken(&self) -> u64 {
        self.taken
    }
}

/// Whether node `i`, `depth` tokens deep (past `w`'s walk), lies on `w`'s prompt: the
/// walk covered its last node whole, `i` descends from it, and the keys between are the
/// prompt's next tokens.
fn goes_on(tree: &Tree, w: &Waiting, i: u32, depth: usize) -> bool {
    let past = depth - w.depth;
    if past > w.next.len() || w.last == NONE {
        return false;
    }
    // The path from `w.last` down to `i`, walked up from `i`: each node's key must be
    // the prompt's tokens at the node's place.
    let mut end = past;
    let mut cur = i;
    while cur != w.last {
        if cur == NONE {
            return false;
        }
        let n = tree.node(cur);
        let Some(start) = end.checked_sub(n.key.len()) else {
            return false; // the node starts above the walk's end: the walk ended inside it
        };
        if n.key[..] != w.next[start..end] {
            return false;
        }
        end = start;
        cur = n.parent;
    }
    end == 0
}

/// Marks node `i` with `rank` unless it has a sooner one, listing it in `expected`.
fn mark(tree: &mut Tree, expected: &mut Vec<u32>, i: u32, rank: u32) {
    let n = tree.node_mut(i);
    if n.expected == 0 {
        n.expected = rank;
        expected.push(i);
    } else {
        n.expected = n.expected.min(rank);
    }
}

/// The first entry of `entries` (in eviction order) whose node is not marked, else the
/// marked one needed latest (and `true`: a marked node taken). `entries` holds at most
/// as many marked nodes as [`Lookahead::expect`] marked, so the walk is that long at
/// most.
pub(super) fn unexpected(
    tree: &Tree,
    entries: impl Iterator<Item = (u64, u64, u32)>,
) -> Option<((u64, u64, u32), bool)> {
    let mut latest: Option<(u32, (u64, u64, u32))> = None;
    for entry in entries {
        let rank = tree.node(entry.2).expected;
        if rank == 0 {
            return Some((entry, false));
        }
        if latest.is_none_or(|(r, _)| rank > r) {
            latest = Some((rank, entry));
        }
    }
    latest.map(|(_, entry)| (entry, true))
}
