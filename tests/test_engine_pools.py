"""Engine-owned pools (``pools="engine"``): the engine's allocators own every device
slot; insert claims the slots it is passed, what the tree gives up goes back to the
engine exactly once (evict returns it, take_freed hands back the queue), and the calls
that allocate from the cache's own pools are refused."""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import radixcache as rc

from conftest import assert_pool_sums, examples, fingerprint

pytestmark = pytest.mark.slow


def engine(kv_slots: int = 32, page_size: int = 1, mamba_slots: int = 0) -> rc.HybridCache:
    return rc.HybridCache(
        kv_slots=kv_slots, page_size=page_size, mamba_slots=mamba_slots, pools="engine"
    )


def test_the_mode_is_a_constructor_argument_and_a_property() -> None:
    assert rc.HybridCache(kv_slots=8).pools == "cache"
    assert rc.HybridCache(kv_slots=8, pools="cache").pools == "cache"
    assert engine().pools == "engine"


def test_an_unknown_mode_is_refused_naming_the_argument() -> None:
    want = r'^pools: unknown owner "sglang"; expected "cache" or "engine"'
    with pytest.raises(ValueError, match=want):
        rc.HybridCache(kv_slots=8, pools="sglang")


@pytest.mark.parametrize("pools", [1, None, b"engine"])
def test_a_mode_that_is_not_a_str_is_refused_naming_the_argument(pools: object) -> None:
    with pytest.raises(TypeError, match=r'^pools: expected "cache" or "engine", got '):
        rc.HybridCache(kv_slots=8, pools=pools)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "arg"),
    [
        ({"host_kv_slots": 8}, "host_kv_slots"),
        ({"mamba_slots": 2, "host_kv_slots": 8, "host_mamba_slots": 2}, "host_kv_slots"),
        ({"mamba_slots": 2, "host_mamba_slots": 2}, "host_mamba_slots"),
    ],
)
def test_a_host_tier_is_refused_naming_the_argument(kwargs: dict[str, int], arg: str) -> None:
    with pytest.raises(ValueError, match=rf'^{arg}: .*pools="engine", which has no host tier'):
        rc.HybridCache(kv_slots=8, pools="engine", **kwargs)


def test_every_slot_starts_with_the_engine() -> None:
    c = engine(kv_slots=16, page_size=4, mamba_slots=3)
    s = c.stats()
    assert (s["kv_engine_slots"], s["kv_queued_slots"]) == (16, 0)
    assert (s["mamba_engine_slots"], s["mamba_queued_slots"]) == (3, 0)
    assert s["kv_caller_slots"] == 16, "the engine's slots keep the caller gauge"
    assert (c.available_kv(), c.available_mamba()) == (0, 0)
    assert_pool_sums(c)
    c.audit()


def test_insert_claims_slots_and_queues_duplicates_and_the_unaligned_tail() -> None:
    c = engine(kv_slots=32, page_size=2)
    ins = c.insert([1, 2, 3, 4, 5], np.arange(5))
    assert ins.prefix_len == 0
    m = c.match_prefix([1, 2, 3, 4, 5])
    assert m.kv_indices.tolist() == [0, 1, 2, 3]
    assert c.available_kv() == 2, "the tail's page is queued"
    again = c.insert([1, 2, 3, 4], [8, 9, 10, 11])
    assert again.prefix_len == 4
    assert c.stats()["kv_queued_slots"] == 6
    c.audit()
    kv, states = c.take_freed()
    assert (kv.dtype, states.dtype) == (np.int64, np.int64)
    assert kv.tolist() == [4, 5, 8, 9, 10, 11]
    assert states.tolist() == []
    kv, states = c.take_freed()
    assert (kv.tolist(), states.tolist()) == ([], []), "each slot is handed back once"
    s = c.stats()
    assert (s["kv_slots_returned"], s["kv_engine_slots"], s["kv_queued_slots"]) == (6, 28, 0)
    assert_pool_sums(c)
    c.audit()


def test_insert_after_match_and_lock_hands_over_only_from_owned_from() -> None:
    c = engine(kv_slots=16)
    c.insert([1, 2], [0, 1])
    m = c.match_prefix([1, 2, 3])
    with c.lock(m.node):
        kv = np.concatenate([m.kv_indices, [7]])
        assert c.insert([1, 2, 3], kv, owned_from=m.device_len).prefix_len == 2
    assert c.match_prefix([1, 2, 3]).kv_indices.tolist() == [0, 1, 7]
    kv, states = c.take_freed()
    assert (kv.size, states.size) == (0, 0)
    c.audit()


def test_a_state_the_tree_does_not_keep_is_queued() -> None:
    c = engine(kv_slots=16, page_size=2, mamba_slots=4)
    assert not c.insert([1, 2], [0, 1], mamba_slot=0).mamba_existed
    m = c.match_prefix([1, 2])
    assert c.insert([1, 2], m.kv_indices, owned_from=2, mamba_slot=1).mamba_existed
    c.insert([5, 6, 7], [2, 3, 4], mamba_slot=2)  # unaligned end: no node ends there
    assert c.available_mamba() == 2
    kv, states = c.take_freed()
    assert (kv.tolist(), states.tolist()) == ([4, 5], [1, 2])
    assert c.stats()["mamba_slots_returned"] == 2
    c.audit()


def test_evict_returns_the_slots_it_freed_and_leaves_the_queue_to_take_freed() -> None:
    c = engine(kv_slots=16, page_size=2, mamba_slots=4)
    c.insert([1, 2], [0, 1], mamba_slot=0)
    c.insert([1, 2, 3, 4], [0, 1, 2, 3], owned_from=2, mamba_slot=1)
    c.insert([1, 2], [6, 7])  # duplicates: queued
    ev = c.evict(kv_tokens=16)
    assert (ev.kv_tokens, ev.mamba_states) == (4, 2)
    assert (ev.kv_indices.dtype, ev.mamba_slots.dtype) == (np.int64, np.int64)
    assert sorted(ev.kv_indices.tolist()) == [0, 1, 2, 3]
    assert sorted(ev.mamba_slots.tolist()) == [0, 1]
    assert c.stats()["kv_queued_slots"] == 2
    kv, _ = c.take_freed()
    assert kv.tolist() == [6, 7]
    s = c.stats()
    assert (s["kv_slots_returned"], s["mamba_slots_returned"]) == (6, 2)
    assert (s["kv_engine_slots"], s["mamba_engine_slots"]) == (16, 4)
    # The returned slots are the engine's: an insert may claim them again.
    c.insert([9, 9], ev.kv_indices[:2], mamba_slot=int(ev.mamba_slots[0]))
    assert_pool_sums(c)
    c.audit()


def test_tree_slots_lists_the_trees_slots_for_an_engines_census() -> None:
    c = engine(kv_slots=16, page_size=2, mamba_slots=4)
    kv, states = c.tree_slots()
    assert (kv.dtype, states.dtype, kv.size, states.size) == (np.int64, np.int64, 0, 0)
    c.insert([1, 2, 3, 4], [4, 5, 0, 1], mamba_slot=3)
    c.insert([1, 2, 9], [6, 7, 8])  # [6, 7] duplicates, [8] an unaligned tail: queued
    kv, states = c.tree_slots()
    assert (kv.tolist(), states.tolist()) == ([0, 1, 4, 5], [3])
    # The census: every slot is the engine's, the tree's or queued, once.
    queued = c.stats()["kv_queued_slots"]
    assert queued == 4
    taken, _ = c.take_freed()
    assert sorted(set(kv.tolist()) | set(taken.tolist())) == [0, 1, 4, 5, 6, 7, 8, 9]
    # A state at [1, 2] too, so that the node stays when its child is evicted.
    c.insert([1, 2], [4, 5], owned_from=2, mamba_slot=1)
    assert c.tree_slots()[1].tolist() == [1, 3]
    c.evict(kv_tokens=2)
    assert c.tree_slots()[0].tolist() == [4, 5]
    assert c.tree_slots()[1].tolist() == [1]
    own = rc.HybridCache(kv_slots=8)
    slots = own.alloc_kv(2)
    assert slots is not None
    own.insert([1, 2], slots)
    assert own.tree_slots()[0].tolist() == sorted(slots.tolist())


def test_a_cache_that_owns_its_pools_returns_and_queues_no_slots() -> None:
    c = rc.HybridCache(kv_slots=16)
    slots = c.alloc_kv(2)
    assert slots is not None
    c.insert([1, 2], slots)
    ev = c.evict(kv_tokens=2)
    assert ev.kv_tokens == 2
    assert (ev.kv_indices.size, ev.mamba_slots.size) == (0, 0)
    kv, states = c.take_freed()
    assert (kv.dtype, states.dtype, kv.size, states.size) == (np.int64, np.int64, 0, 0)
    s = c.stats()
    assert all(
        s[k] == 0
        for k in ("kv_engine_slots", "kv_queued_slots", "kv_slots_returned", "mamba_slots_returned")
    )


@pytest.mark.parametrize(
    ("kv", "mamba_slot", "arg", "why"),
    [
        ([0], None, "kv_indices", "in the cache's tree"),
        ([3], None, "kv_indices", "queued to go back to the engine"),
        ([8], None, "kv_indices", "out of range"),
        ([-1], None, "kv_indices", "out of range"),
        ([5, 5], None, "kv_indices", "listed twice"),
        ([5], 0, "mamba_slot", "in the cache's tree"),
        ([5], 1, "mamba_slot", "queued to go back to the engine"),
        ([5], 2, "mamba_slot", "out of range"),
    ],
)
def test_insert_refuses_a_slot_that_is_not_the_engines_and_changes_nothing(
    kv: list[int], mamba_slot: int | None, arg: str, why: str
) -> None:
    c = engine(kv_slots=8, mamba_slots=2)
    c.insert([1, 2, 3], [0, 1, 2], mamba_slot=0)
    c.insert([1, 2, 3], [3, 4, 6], mamba_slot=1)  # 3, 4, 6 and state 1 queued
    before = fingerprint(c)
    tokens = list(range(10, 10 + len(kv)))
    with pytest.raises(ValueError, match=rf"^{arg}: .*{why}"):
        c.insert(tokens, kv, mamba_slot=mamba_slot)
    assert fingerprint(c) == before
    assert c.stats()["kv_engine_slots"] == 2, "slots 5 and 7 stay the engine's"


REFUSED: list[tuple[str, Callable[[rc.HybridCache, rc.Request, rc.Node], object]]] = [
    ("alloc_kv", lambda c, r, n: c.alloc_kv(1)),
    ("free_kv", lambda c, r, n: c.free_kv([5])),
    ("alloc_mamba", lambda c, r, n: c.alloc_mamba()),
    ("free_mamba", lambda c, r, n: c.free_mamba(1)),
    ("admit", lambda c, r, n: c.admit([1, 2])),
    ("extend", lambda c, r, n: c.extend(r, [3])),
    ("extend_batch", lambda c, r, n: c.extend_batch([r], [3])),
    ("extend_batch", lambda c, r, n: c.extend_batch([], [])),
    ("checkpoint", lambda c, r, n: c.checkpoint(r)),
    ("finish", lambda c, r, n: c.finish(r)),
    ("abort", lambda c, r, n: c.abort(r)),
    ("load_back", lambda c, r, n: c.load_back(n)),
    ("load_back", lambda c, r, n: c.load_back(r)),
    ("load_back", lambda c, r, n: c.load_back(n, request=r)),
    ("evict_host", lambda c, r, n: c.evict_host(kv_tokens=1)),
]


@pytest.mark.parametrize(("call", "do"), REFUSED)
def test_calls_that_use_the_cache_pools_raise_cache_error_naming_the_mode(
    call: str, do: Callable[[rc.HybridCache, rc.Request, rc.Node], object]
) -> None:
    c = engine(kv_slots=16, mamba_slots=2)
    c.insert([1, 2], [0, 1], mamba_slot=0)
    # No request can be an engine-owned cache's: the refusal comes before the request
    # (here another cache's) is looked at.
    other = rc.HybridCache(kv_slots=16, mamba_slots=2)
    request = other.admit([1])
    assert request is not None
    node = c.match_prefix([1, 2]).node
    before = fingerprint(c)
    with pytest.raises(rc.CacheError, match=rf'^{call} is not available with pools="engine"'):
        do(c, request, node)
    assert fingerprint(c) == before
    other.abort(request)


def test_evict_and_take_freed_on_an_empty_cache_return_nothing() -> None:
    c = engine(kv_slots=8, mamba_slots=2)
    ev = c.evict(kv_tokens=8, mamba_states=2)
    assert (ev.kv_tokens, ev.mamba_states, ev.kv_indices.size, ev.mamba_slots.size) == (0, 0, 0, 0)
    kv, states = c.take_freed()
    assert (kv.size, states.size) == (0, 0)
    c.audit()


def test_evicted_repr_shows_the_slots() -> None:
    c = engine(kv_slots=8)
    c.insert([1, 2], [3, 4])
    assert repr(c.evict(kv_tokens=2)) == (
        "Evicted(kv_tokens=2, mamba_states=0, kv_indices=array([3, 4]), "
        "mamba_slots=array([], dtype=int64))"
    )


def test_repr_names_the_mode_and_the_queued_slots() -> None:
    c = engine(kv_slots=8, page_size=2, mamba_slots=2)
    c.insert([1, 2, 3], [0, 1, 2], mamba_slot=0)
    assert repr(c) == (
        'HybridCache(kv_slots=8, page_size=2, pools="engine", cached_tokens=2, evictable=2, '
        "protected=0, queued_kv=2, nodes=1, mamba_slots=2, cached_states=0, queued_mamba=1)"
    )


# ----------------------------------------------------------------------- state machine

SYSTEM = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]]
NAMESPACES = st.sampled_from([None, "a"])
Key = tuple[Optional[str], tuple[int, ...]]


@st.composite
def token_lists(draw: st.DrawFn) -> list[int]:
    head = draw(st.sampled_from([[], *SYSTEM]))
    tail = draw(st.lists(st.integers(0, 3), max_size=10))
    return head[: draw(st.integers(0, len(head)))] + tail


class Books:
    """Where the slots of one pool are, by the model: pages (KV) or slots (states)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.engine: set[int] = set(range(n))
        self.held: set[int] = set()
        self.queue: set[int] = set()

    def alloc(self, k: int) -> None:
        for p in sorted(self.engine)[:k]:
            self.engine.remove(p)
            self.held.add(p)

    def hand_back(self, slots: list[int], what: str) -> None:
        assert len(set(slots)) == len(slots), f"{what} listed a slot twice: {slots}"
        for p in slots:
            assert p not in self.engine, f"{what} handed back {p} twice"
            assert p not in self.held, f"{what}: {p} was a request's, not the tree's"
            assert p not in self.queue, f"{what}: {p} was queued, not the tree's"
            self.engine.add(p)


class EngineMachine(RuleBasedStateMachine):
    """An engine that owns the slots: a model allocator, requests holding slots, and a
    model of the tree (page-prefix -> page, node end -> state). After every step:
    audit(), and engine + requests + tree + queue is every slot once, as the gauges say."""

    cache: rc.HybridCache

    @initialize(
        page_size=st.sampled_from([1, 2, 4]),
        pages=st.integers(4, 12),
        states=st.sampled_from([0, 0, 1, 2, 4]),
    )
    def build(self, page_size: int, pages: int, states: int) -> None:
        self.ps = page_size
        self.cache = engine(kv_slots=pages * page_size, page_size=page_size, mamba_slots=states)
        self.kv = Books(pages)
        self.mamba = Books(states)
        self.tree: dict[Key, int] = {}  # page-prefix -> its last page
        self.states: dict[Key, int] = {}  # node end -> state slot
        self.locks: list[rc.Lock] = []

    # ------------------------------------------------------------------ helpers

    def cached_len(self, ns: str | None, tokens: list[int]) -> int:
        k = 0
        while k + self.ps <= len(tokens) and (ns, tuple(tokens[: k + self.ps])) in self.tree:
            k += self.ps
        return k

    def slots_of(self, pages: list[int], start: int, end: int) -> list[int]:
        out: list[int] = []
        for i, p in enumerate(pages):
            n = min(self.ps, end - start - i * self.ps)
            out.extend(range(p * self.ps, p * self.ps + n))
        return out

    def evict(self, kv_tokens: int, mamba_states: int) -> None:
        ev = self.cache.evict(kv_tokens=kv_tokens, mamba_states=mamba_states)
        slots = ev.kv_indices.tolist()
        assert len(slots) == ev.kv_tokens, "engine-owned pools free at once"
        assert len(slots) % self.ps == 0
        pages = [s // self.ps for s in slots[:: self.ps]]
        assert slots == self.slots_of(pages, 0, len(slots)), "whole pages"
        by_page = {p: k for k, p in self.tree.items()}
        for p in pages:
            assert p in by_page, f"evict returned page {p}, which was not the tree's"
            del self.tree[by_page[p]]
        self.kv.hand_back(pages, "evict")
        states = ev.mamba_slots.tolist()
        assert len(states) == ev.mamba_states
        by_slot = {s: k for k, s in self.states.items()}
        for s in states:
            assert s in by_slot, f"evict returned state {s}, which was not the tree's"
            del self.states[by_slot[s]]
        self.mamba.hand_back(states, "evict")
        # A state sits on a node with device KV: its page-prefix is still cached.
        assert all(k in self.tree for k in self.states)

    def pages_for(self, n: int) -> list[int] | None:
        """`n` pages for a request: held ones, then the engine's, evicting for the rest."""
        short = n - len(self.kv.held) - len(self.kv.engine)
        if short > 0:
            self.evict(short * self.ps, 0)
        self.kv.alloc(n - len(self.kv.held))
        return sorted(self.kv.held)[:n] if len(self.kv.held) >= n else None

    # -------------------------------------------------------------------- rules

    @rule(n=st.integers(0, 6), state=st.booleans())
    def engine_alloc(self, n: int, state: bool) -> None:
        self.kv.alloc(n)
        if state:
            self.mamba.alloc(1)

    @rule()
    def engine_frees_what_requests_hold(self) -> None:
        for books in (self.kv, self.mamba):
            books.engine |= books.held
            books.held.clear()

    @rule(ns=NAMESPACES, tokens=token_lists())
    def match(self, ns: str | None, tokens: list[int]) -> None:
        m = self.cache.match_prefix(tokens, namespace=ns)
        kv_len = self.cached_len(ns, tokens)
        assert m.kv_len == kv_len
        ends = [p for p in range(self.ps, kv_len + 1, self.ps)]
        if self.mamba.n:
            ends = [p for p in ends if (ns, tuple(tokens[:p])) in self.states]
        want = ends[-1] if ends else 0
        assert m.device_len == want
        pages = [self.tree[(ns, tuple(tokens[:p]))] for p in range(self.ps, want + 1, self.ps)]
        assert m.kv_indices.tolist() == self.slots_of(pages, 0, want)
        if self.mamba.n and want:
            assert m.mamba_slot == self.states[(ns, tuple(tokens[:want]))]

    @rule(
        ns=NAMESPACES,
        tokens=token_lists(),
        fresh=st.booleans(),
        lock=st.booleans(),
        with_state=st.booleans(),
    )
    def insert(
        self, ns: str | None, tokens: list[int], fresh: bool, lock: bool, with_state: bool
    ) -> None:
        ps = self.ps
        m = self.cache.match_prefix(tokens, namespace=ns)
        lk = self.cache.lock(m.node) if lock and m.device_len else None
        want_from = 0 if fresh else m.device_len
        if self.pages_for(-(-(len(tokens) - want_from) // ps)) is None:
            if lk is not None:
                self.cache.unlock(lk)
            return
        state = None
        if with_state and self.mamba.n:
            if not self.mamba.held and not self.mamba.engine:
                self.evict(0, 1)
            self.mamba.alloc(1 - len(self.mamba.held))
            state = min(self.mamba.held) if self.mamba.held else None
        # Unlocked, those evictions may have taken part of the match: match again.
        m = self.cache.match_prefix(tokens, namespace=ns)
        owned_from = 0 if fresh else m.device_len
        pages = self.pages_for(-(-(len(tokens) - owned_from) // ps))
        if pages is None:
            if lk is not None:
                self.cache.unlock(lk)
            return
        kv = [*m.kv_indices[:owned_from].tolist(), *self.slots_of(pages, owned_from, len(tokens))]
        # The model's prediction: a page of a cached page-prefix is a duplicate, the
        # tail's page is queued, the rest join the tree.
        prefix_len = self.cached_len(ns, tokens)
        aligned = len(tokens) // ps * ps
        queued: list[int] = []
        for i, p in enumerate(pages):
            end = owned_from + (i + 1) * ps
            key = (ns, tuple(tokens[:end]))
            if end > aligned or key in self.tree:
                queued.append(p)
            else:
                self.tree[key] = p
        ins = self.cache.insert(tokens, kv, namespace=ns, owned_from=owned_from, mamba_slot=state)
        assert ins.prefix_len == prefix_len
        self.kv.held -= set(pages)
        self.kv.queue |= set(queued)
        if state is not None:
            self.mamba.held.remove(state)
            key = (ns, tuple(tokens))
            existed = key in self.states
            assert ins.mamba_existed == (existed and aligned == len(tokens) > 0)
            if aligned == len(tokens) > 0 and not existed:
                self.states[key] = state
            else:
                self.mamba.queue.add(state)
        if lk is not None:
            self.cache.unlock(lk)

    @rule(
        tokens=token_lists(),
        flaw=st.sampled_from(
            ["tree", "queued", "out_of_range", "twice", "state_tree", "state_queued", "state_range"]
        ),
        data=st.data(),
    )
    def bad_insert(self, tokens: list[int], flaw: str, data: st.DataObject) -> None:
        """A slot that is not the engine's: ValueError naming the argument, nothing changed."""
        ps = self.ps
        tokens = tokens if len(tokens) >= 2 * ps else [9] * (2 * ps)
        n = -(-len(tokens) // ps)
        self.kv.alloc(n - len(self.kv.held))
        if len(self.kv.held) < n:
            return
        pages = sorted(self.kv.held)[:n]
        state = None
        arg = "kv_indices"
        if flaw == "tree" and self.tree:
            pages[-1] = data.draw(st.sampled_from(sorted(self.tree.values())))
        elif flaw == "queued" and self.kv.queue:
            pages[0] = data.draw(st.sampled_from(sorted(self.kv.queue)))
        elif flaw == "out_of_range":
            pages[0] = self.kv.n
        elif flaw == "twice":
            pages[1] = pages[0]
        elif flaw == "state_tree" and self.states:
            state, arg = data.draw(st.sampled_from(sorted(self.states.values()))), "mamba_slot"
        elif flaw == "state_queued" and self.mamba.queue:
            state, arg = data.draw(st.sampled_from(sorted(self.mamba.queue))), "mamba_slot"
        elif flaw == "state_range" and self.mamba.n:
            state, arg = self.mamba.n, "mamba_slot"
        else:
            return
        before = fingerprint(self.cache)
        with pytest.raises(ValueError, match=rf"^{arg}: "):
            self.cache.insert(tokens, self.slots_of(pages, 0, len(tokens)), mamba_slot=state)
        assert fingerprint(self.cache) == before

    @rule(kv_tokens=st.integers(0, 24), mamba_states=st.integers(0, 3))
    def evict_some(self, kv_tokens: int, mamba_states: int) -> None:
        self.evict(kv_tokens, mamba_states)

    @rule()
    def take_freed(self) -> None:
        kv, states = self.cache.take_freed()
        slots = kv.tolist()
        pages = [s // self.ps for s in slots[:: self.ps]]
        assert slots == self.slots_of(pages, 0, len(slots))
        assert set(pages) == self.kv.queue
        assert set(states.tolist()) == self.mamba.queue
        self.kv.queue.clear()
        self.mamba.queue.clear()
        self.kv.hand_back(pages, "take_freed")
        self.mamba.hand_back(states.tolist(), "take_freed")

    @rule(ns=NAMESPACES, tokens=token_lists())
    def lock(self, ns: str | None, tokens: list[int]) -> None:
        self.locks.append(self.cache.lock(self.cache.match_prefix(tokens, namespace=ns).node))

    @precondition(lambda self: bool(self.locks))
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.locks) - 1))
        self.cache.unlock(self.locks.pop(i))

    @rule(which=st.sampled_from([name for name, _ in REFUSED[:5]]))
    def refused(self, which: str) -> None:
        before = fingerprint(self.cache)
        do = dict(REFUSED[:5])[which]
        with pytest.raises(rc.CacheError, match=rf"^{which} is not available"):
            do(self.cache, None, None)  # type: ignore[arg-type]
        assert fingerprint(self.cache) == before

    # --------------------------------------------------------------- invariants

    @invariant()
    def every_slot_is_in_one_place(self) -> None:
        self.cache.audit()
        assert_pool_sums(self.cache)
        s = self.cache.stats()
        for name, books, tree, per in (
            ("kv", self.kv, set(self.tree.values()), self.ps),
            ("mamba", self.mamba, set(self.states.values()), 1),
        ):
            parts = [books.engine, books.held, tree, books.queue]
            assert sum(map(len, parts)) == books.n, name
            assert set().union(*parts) == set(range(books.n)), name
            assert s[f"{name}_engine_slots"] == (len(books.engine) + len(books.held)) * per
            assert s[f"{name}_queued_slots"] == len(books.queue) * per
        assert s["kv_cached_tokens"] == len(self.tree) * self.ps
        assert s["mamba_cached_states"] == len(self.states)

    def teardown(self) -> None:
        if not hasattr(self, "cache"):
            return
        for lk in self.locks:
            self.cache.unlock(lk)
        self.locks.clear()
        self.evict(self.kv.n * self.ps, self.mamba.n)
        self.take_freed()
        assert not self.tree
        assert not self.states
        assert self.cache.stats()["kv_engine_slots"] == self.kv.n * self.ps
        self.cache.audit()


EngineMachine.TestCase.settings = settings(
    max_examples=examples(80),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestEngineMachine = EngineMachine.TestCase
