"""Hypothesis state machine: random match/insert/lock/unlock/evict/alloc/free sequences
against the naive model in model.py, with audit() and exact sizes after every step."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import radixcache as rc

from conftest import (
    EVICTION_POLICIES,
    EventIndex,
    assert_pool_sums,
    examples,
    fingerprint,
    priority_of,
)
from model import Key, Model

pytestmark = pytest.mark.slow

SYSTEM = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]]
NAMESPACES = st.sampled_from([None, "a"])


@st.composite
def token_lists(draw: st.DrawFn) -> list[int]:
    head = draw(st.sampled_from([[], *SYSTEM]))
    tail = draw(st.lists(st.integers(0, 3), max_size=10))
    return head[: draw(st.integers(0, len(head)))] + tail


class CacheMachine(RuleBasedStateMachine):
    cache: rc.HybridCache
    model: Model

    def __init__(self) -> None:
        super().__init__()
        self.held_locks: list[tuple[rc.Lock, int]] = []
        self.released_locks: list[rc.Lock] = []
        self.next_receipt = 0

    @initialize(
        page_size=st.sampled_from([1, 2, 4]), pages=st.integers(4, 16), policy=EVICTION_POLICIES
    )
    def build(self, page_size: int, pages: int, policy: str | dict[str, str]) -> None:
        self.cache = rc.HybridCache(
            kv_slots=page_size * pages,
            page_size=page_size,
            eviction_policy=policy,
            page_hashes=True,
            events=True,
        )
        self.events = EventIndex()
        self.model = Model(kv_slots=page_size * pages, page_size=page_size)

    # ------------------------------------------------------------------ helpers

    def sync(self) -> list[Key]:
        """Ask the cache which model prefixes survive, check legality, adopt it."""
        still = {
            (ns, p)
            for (ns, p) in self.model.pages
            if self.cache.match_prefix(list(p), namespace=ns).device_len == len(p)  # type: ignore[arg-type]
        }
        return self.model.sync_after_eviction(still)

    def alloc_pages(self, n_pages: int) -> np.ndarray | None:
        ps = self.model.page_size
        evictable_before = self.model.evictable()
        free_before = self.model.available()
        got = self.cache.alloc_kv(n_pages * ps)
        self.sync()
        if got is None:
            assert free_before + evictable_before < n_pages * ps
            return None
        assert len(got) == n_pages * ps
        pages = {int(s) // ps for s in got}
        assert len(pages) == n_pages
        assert not pages & self.model.caller
        assert not pages & set(self.model.pages.values())
        self.model.caller |= pages
        return got

    # -------------------------------------------------------------------- rules

    @rule(ns=NAMESPACES, tokens=token_lists())
    def match(self, ns: str | None, tokens: list[int]) -> None:
        m = self.cache.match_prefix(tokens, namespace=ns)
        want_len, want_slots = self.model.match(ns, tokens)
        assert m.device_len == want_len
        assert list(m.kv_indices) == want_slots
        assert (m.kv_len, m.host_len, m.mamba_slot) == (want_len, 0, None)

    @rule(ns=NAMESPACES, tokens=token_lists(), reuse=st.booleans())
    def insert(self, ns: str | None, tokens: list[int], reuse: bool) -> None:
        """A serving engine's insert: reuse the matched prefix (or not), hand over the rest."""
        ps = self.model.page_size
        m = self.cache.match_prefix(tokens, namespace=ns)
        owned_from = m.device_len if reuse else 0
        rest = len(tokens) - owned_from
        got = self.alloc_pages(-(-rest // ps))
        if got is None:
            return
        # the allocation may have evicted part of the matched prefix: match again
        m = self.cache.match_prefix(tokens, namespace=ns)
        if reuse and m.device_len < owned_from:
            self.cache.free_kv(got)
            self.model.caller -= {int(s) // ps for s in got}
            return
        kv = [*map(int, m.kv_indices[:owned_from]), *map(int, got[:rest])]
        handed_unused = {int(s) // ps for s in got[rest:]} - {x // ps for x in kv[owned_from:]}
        if handed_unused:  # whole pages past the tail: give them back ourselves
            self.cache.free_kv(sorted(p * ps for p in handed_unused))
            self.model.caller -= handed_unused
        available = self.model.available()
        prefix_len, freed = self.model.insert(ns, tokens, kv, owned_from)
        ins = self.cache.insert(
            tokens, kv, namespace=ns, owned_from=owned_from, priority=priority_of(tokens)
        )
        assert ins.prefix_len == prefix_len
        assert self.cache.available_kv() == available + len(freed) * ps

    @rule(
        ns=NAMESPACES,
        tokens=token_lists(),
        flaw=st.sampled_from(
            ["length", "unaligned", "past_end", "not_cached", "foreign_prefix", "free_slot", "dup"]
        ),
    )
    def bad_insert(self, ns: str | None, tokens: list[int], flaw: str) -> None:
        """Every malformed insert raises ValueError and changes nothing."""
        ps = self.model.page_size
        m = self.cache.match_prefix(tokens, namespace=ns)
        owned = [int(s) for s in m.kv_indices]
        free_page = next(
            (
                p
                for p in range(self.model.kv_slots // ps)
                if p not in self.model.caller and p not in self.model.pages.values()
            ),
            None,
        )
        toks, kv, owned_from = list(tokens), list(owned), len(owned)
        if flaw == "length":
            kv = [*owned, *([0] * (len(toks) - len(owned) + 1))]
        elif flaw == "unaligned" and ps > 1:
            owned_from = 1
            toks, kv = [*toks, 0], [*kv, 0]
        elif flaw == "past_end":
            owned_from = len(toks) + ps
        elif flaw == "not_cached":
            toks = [*toks[: len(owned)], *([9] * ps)]
            kv = [*owned, *range(ps)]
            owned_from = len(toks)
        elif flaw == "foreign_prefix" and owned:
            kv = [*owned[:-1], (owned[-1] + 1) % self.model.kv_slots]
        elif flaw == "free_slot" and free_page is not None:
            toks = [*toks[: len(owned)], *([0] * ps)]
            kv = [*owned, *range(free_page * ps, free_page * ps + ps)]
        elif flaw == "dup" and self.model.caller:
            page = next(iter(self.model.caller))
            toks = [*toks[: len(owned)], *([0] * 2 * ps)]
            kv = [*owned, *range(page * ps, page * ps + ps), *range(page * ps, page * ps + ps)]
        else:
            return
        before = fingerprint(self.cache)
        try:
            self.cache.insert(toks, kv, namespace=ns, owned_from=owned_from)
        except ValueError:
            pass
        else:
            raise AssertionError(f"insert with flaw {flaw!r} was accepted")
        assert fingerprint(self.cache) == before

    @rule(ns=NAMESPACES, tokens=token_lists())
    def lock(self, ns: str | None, tokens: list[int]) -> None:
        m = self.cache.match_prefix(tokens, namespace=ns)
        lk = self.cache.lock(m.node)
        rid = self.next_receipt
        self.next_receipt += 1
        self.model.locks[rid] = (ns, tuple(tokens[: m.device_len]))
        self.held_locks.append((lk, rid))

    @precondition(lambda self: bool(self.held_locks))
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.held_locks) - 1))
        lk, rid = self.held_locks.pop(i)
        if data.draw(st.booleans()):
            self.cache.unlock(lk)
        else:
            with lk:
                pass
        del self.model.locks[rid]
        self.released_locks.append(lk)

    @precondition(lambda self: bool(self.released_locks))
    @rule()
    def unlock_twice(self) -> None:
        before = fingerprint(self.cache)
        try:
            self.cache.unlock(self.released_locks[-1])
        except rc.LockError:
            pass
        else:
            raise AssertionError("a second unlock was accepted")
        assert fingerprint(self.cache) == before

    @rule(n=st.integers(0, 40))
    def evict(self, n: int) -> None:
        evictable = self.model.evictable()
        ev = self.cache.evict(kv_tokens=n)
        gone = self.sync()
        assert ev.kv_tokens == len(gone) * self.model.page_size
        assert ev.kv_tokens >= min(n, evictable)
        if ev.kv_tokens < n:
            assert self.cache.evictable_size() == 0

    @rule(n_pages=st.integers(0, 6))
    def alloc(self, n_pages: int) -> None:
        self.alloc_pages(n_pages)

    @precondition(lambda self: bool(self.model.caller))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        ps = self.model.page_size
        pages = data.draw(st.sets(st.sampled_from(sorted(self.model.caller)), min_size=1))
        self.cache.free_kv([p * ps + o for p in sorted(pages) for o in range(ps)])
        self.model.caller -= pages

    @rule(data=st.data())
    def bad_free(self, data: st.DataObject) -> None:
        ps = self.model.page_size
        candidates = [p for p in range(self.model.kv_slots // ps) if p not in self.model.caller] + [
            self.model.kv_slots // ps
        ]
        page = data.draw(st.sampled_from(candidates))
        before = fingerprint(self.cache)
        try:
            self.cache.free_kv([page * ps])
        except ValueError:
            pass
        else:
            raise AssertionError(f"freeing page {page}, not held by the caller, was accepted")
        assert fingerprint(self.cache) == before

    # -------------------------------------------------------------- invariants

    @invariant()
    def audit_and_sizes(self) -> None:
        if not hasattr(self, "cache"):
            return
        self.cache.audit()
        self.events.check(self.cache)
        assert_pool_sums(self.cache)
        assert self.cache.evictable_size() == self.model.evictable()
        assert self.cache.protected_size() == self.model.protected()
        assert self.cache.total_size() == self.model.total()
        assert self.cache.available_kv() == self.model.available()

    def teardown(self) -> None:
        if not hasattr(self, "cache"):
            return
        for lk, _ in self.held_locks:
            self.cache.unlock(lk)
        self.cache.evict(kv_tokens=self.model.kv_slots)
        held = sorted(p * self.model.page_size for p in self.model.caller)
        self.cache.free_kv(held)
        # after everything is released and evicted, every slot is free again
        assert self.cache.available_kv() == self.model.kv_slots
        self.cache.audit()


CacheMachine.TestCase.settings = settings(
    max_examples=examples(150),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCacheMachine = CacheMachine.TestCase
