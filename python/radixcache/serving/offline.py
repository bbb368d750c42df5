"""The offline bound: the best any state eviction order could do on a replay's state uses.

During a replay, `StateTrace` records, in order:

* a **use** at each admission: the states the run had put in the tree (at any time
  before) on the admitted tokens' path, as deep as their KV was cached then (the
  admission's ``branch_len``), in the request's namespace, deepest first, each with the
  tokens it would give; none when no such state was ever made (the first request of a
  group, or one admitted before its sharer's checkpoint landed);
* an **offer** each time the scheduler puts a state in the tree (``checkpoint`` or
  ``finish`` at a page-aligned length): a chance to keep that state;
* with each, the **capacity** the tree has then: the device state slots less those
  requests and the caller hold (a running request's state is not the tree's).

`simulate` then replays that sequence on a set of at most ``capacity`` states with an
eviction rule. A use hits the deepest of its states in the set, and gives that state's
tokens. A use whose deepest state is not in the set recomputes up to it, so that state
is offered again with the request's next offer, once its prefill has passed it (the
recorded offers are what the real run made, and the real run offers nothing after a
hit). ``"belady"`` keeps, at each offer and
when the capacity drops, the states some use needs soonest, and lets one needed later
than all of them go by (Belady's MIN with bypass); ``"lru"`` is the cache's own
``"lru"`` order for states (two segments, docs/design.md): compare it with the real
cache under ``"lru"`` to see how close the model is.

Belady's rule here is a far-sighted reference, not a proven ceiling: the tests check
that it hits at least what the ``"lru"`` order does and never more than an exhaustive
search over what to keep, and short sequences exist where the search keeps one more use
(keeping the state needed soonest can cost one a later use needs). With several states
on a path (a chat's turns over a shared system prompt) a use is a hit on the deepest
one kept, and "needed" means on the path of a later use.

Other limits: the sequence is the real run's (another policy changes when requests run,
hence when states are offered, how many slots running requests hold and which KV is
cached); only the last admission of a request counts (one retracted is admitted again).
"""

from __future__ import annotations

import bisect
import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from .._core import HybridCache

__all__ = ["Bound", "Event", "StateTrace", "bound", "simulate"]


class Event(NamedTuple):
    """One recorded event (see the module docstring).

    Attributes:
        kind: ``"use"`` or ``"offer"``.
        states: The states on the path, deepest first (a use; empty: none), or the one
            offered. States are numbered in the order they were first offered.
        tokens: Each state's tokens (its prefix length).
        capacity: The state slots the tree had.
        request: The request (its index in the workload).
        step: The scheduler step.
    """

    kind: str
    states: tuple[int, ...]
    tokens: tuple[int, ...]
    capacity: int
    request: int
    step: int


class StateTrace:
    """Records a replay's state uses and offers (see the module docstring).

    Args:
        cache: The replay's cache (its page size, and the capacity at each event).
    """

    def __init__(self, cache: HybridCache) -> None:
        self.cache = cache
        self.page = cache.page_size
        self.events: list[Event] = []
        self._states: dict[tuple[str | None, bytes], int] = {}
        self._digests: dict[int, list[bytes]] = {}

    def capacity(self) -> int:
        """Return the state slots the tree may use now: the pool less what others hold."""
        s = self.cache.stats()
        return s["mamba_capacity_slots"] - s["mamba_request_slots"] - s["mamba_caller_slots"]

    def _pages(self, request: int, seq: Any) -> list[bytes]:
        """Return each whole-page prefix digest of `seq` (computed once per request)."""
        got = self._digests.get(request)
        if got is None:
            data = np.asarray(seq, dtype=np.uint32).tobytes()
            step = 4 * self.page
            h = hashlib.blake2b(digest_size=16)
            got = []
            for end in range(step, len(data) + 1, step):
                h.update(data[end - step : end])
                got.append(h.copy().digest())
            self._digests[request] = got
        return got

    def use(self, request: int, namespace: str | None, seq: Any, kv_len: int, step: int) -> None:
        """Record an admission of `request` whose KV is cached for ``seq[:kv_len]``.

        Only states up to `kv_len` count: a state is of use only with its prefix's KV.
        """
        pages = self._pages(request, seq)
        states, tokens = [], []
        for n in range(kv_len // self.page, 0, -1):
            found = self._states.get((namespace, pages[n - 1]))
            if found is not None:
                states.append(found)
                tokens.append(n * self.page)
        cap = self.capacity()
        self.events.append(Event("use", tuple(states), tuple(tokens), cap, request, step))

    def offer(self, request: int, namespace: str | None, seq: Any, length: int, step: int) -> None:
        """Record that `request` put its state at ``seq[:length]`` in the tree."""
        if length == 0 or length % self.page:
            return  # the cache keeps no state there
        key = (namespace, self._pages(request, seq)[length // self.page - 1])
        state = self._states.setdefault(key, len(self._states))
        self.events.append(Event("offer", (state,), (length,), self.capacity(), request, step))

    def done(self, request: int) -> None:
        """`request` finished: forget its digests."""
        self._digests.pop(request, None)


class _NextUse:
    """When each state is next on the path of a use, after a given event."""

    def __init__(self, events: Sequence[Event]) -> None:
        self._uses: dict[int, list[int]] = {}
        for i, e in enumerate(events):
            if e.kind == "use":
                for state in e.states:
                    self._uses.setdefault(state, []).append(i)

    def after(self, state: int, i: int) -> float:
        """Return the first use after event `i` with `state` on its path (inf: none)."""
        uses = self._uses.get(state, [])
        j = bisect.bisect_right(uses, i)
        return uses[j] if j < len(uses) else float("inf")


def simulate(events: Sequence[Event], rule: str, hot_cap: int = 0) -> list[int]:
    """Replay `events` on a set of states kept by `rule`; the tokens each use hit.

    Args:
        events: A `StateTrace`'s events.
        rule: ``"belady"`` (the offline bound) or ``"lru"``: the cache's ``"lru"``
            order for states, in two segments (docs/design.md): states no use hit since
            they were offered go first, then used ones, each least recently used
            first; while more than `hot_cap` used states are kept, the oldest used one
            goes first.
        hot_cap: The used states ``"lru"`` protects (the cache's: three quarters of
            its state slots).

    Returns:
        One entry per event: the tokens of the state a use hit (0 for a miss, and for
        offers).

    Raises:
        ValueError: An unknown `rule`.
    """
    if rule == "lru":
        return _lru(events, hot_cap)
    if rule != "belady":
        raise ValueError(f"rule: must be 'belady' or 'lru', got {rule!r}")
    hits = [0] * len(events)
    nxt = _NextUse(events)
    kept: dict[int, float] = {}  # state -> when a use next needs it
    pending: dict[int, int] = {}

    def offer(state: int, i: int, cap: int) -> None:
        if state in kept:
            kept[state] = nxt.after(state, i)
            return
        need = nxt.after(state, i)
        if need == float("inf"):
            return  # never needed again: bypass
        if len(kept) >= cap:
            latest = max(kept, key=kept.__getitem__) if kept else None
            if latest is None or kept[latest] <= need:
                return  # every kept state is needed sooner: bypass
            del kept[latest]
        kept[state] = need

    for i, e in enumerate(events):
        cap = max(e.capacity, 0)
        while len(kept) > cap:  # the capacity dropped: let the latest needed go
            del kept[max(kept, key=kept.__getitem__)]
        if e.kind == "offer":
            for state in _offered(e, pending):
                offer(state, i, cap)
            continue
        for state, tokens in zip(e.states, e.tokens):
            if state in kept:
                hits[i] = hits[i] or tokens
                kept[state] = nxt.after(state, i)
        _recompute(e, pending, kept)
    return hits


def _recompute(e: Event, pending: dict[int, int], kept: Any) -> None:
    """After use `e`: its deepest state, not kept, is offered with the request's next offer.

    The request recomputes up to it; the real run offered it only if the real cache
    missed it too, so it is offered again, when the request's prefill has passed it (at
    its next recorded offer), whatever the real run did.
    """
    if e.states and e.states[0] not in kept:
        pending[e.request] = e.states[0]
    else:
        pending.pop(e.request, None)


def _offered(e: Event, pending: dict[int, int]) -> list[int]:
    """Return the states offered at `e`: one recomputed before it (if any), its own."""
    first = pending.pop(e.request, None)
    return [e.states[0]] if first is None else [first, e.states[0]]


def _lru(events: Sequence[Event], hot_cap: int) -> list[int]:
    hits = [0] * len(events)
    cold: OrderedDict[int, None] = OrderedDict()  # unused states, oldest first
    hot: OrderedDict[int, None] = OrderedDict()  # used states, oldest first
    pending: dict[int, int] = {}
    # States offered in this step: their copies are in flight, so they cannot be
    # evicted yet (the cache publishes them when the step's batches have run).
    new: set[int] = set()
    step = 0

    def shrink(cap: int) -> bool:
        """Evict down to `cap` states; False when only new ones are left to evict."""
        while len(cold) + len(hot) > cap:
            old_cold = [s for s in cold if s not in new]
            if hot and (len(hot) > hot_cap or not old_cold):
                hot.popitem(last=False)
            elif old_cold:
                del cold[old_cold[0]]
            else:
                return False
        return True

    for i, e in enumerate(events):
        if e.step != step:
            step, new = e.step, set()
        cap = max(e.capacity, 0)
        shrink(cap)  # the capacity dropped
        if e.kind == "offer":
            for state in _offered(e, pending):
                # A new state needs a slot first: it displaces one.
                if state not in hot and state not in cold and cap and shrink(cap - 1):
                    cold[state] = None
                    new.add(state)
            continue
        for state, tokens in zip(e.states, e.tokens):
            if state in hot or state in cold:  # the deepest kept: the one used
                hits[i] = tokens
                cold.pop(state, None)
                hot[state] = None
                hot.move_to_end(state)
                break
        _recompute(e, pending, {**hot, **cold})
    return hits


@dataclass
class Bound:
    """What the model says about a replay's state uses (request shares and tokens).

    Only the last admission of each request counts (a retracted one is admitted again).

    Attributes:
        requests: Requests admitted.
        possible_requests, possible_tokens: Requests with a state to use, and its
            tokens summed: what unlimited state slots would give.
        belady_requests, belady_tokens: The same, for the uses Belady's rule hits.
        lru_requests, lru_tokens: The same, for the uses LRU hits in the model.
    """

    requests: int = 0
    possible_requests: int = 0
    possible_tokens: int = 0
    belady_requests: int = 0
    belady_tokens: int = 0
    lru_requests: int = 0
    lru_tokens: int = 0


def bound(events: Sequence[Event], hot_cap: int) -> Bound:
    """Simulate Belady's rule and LRU on `events` and sum the final admissions' hits.

    `hot_cap`: as for `simulate`.
    """
    belady, lru = simulate(events, "belady"), simulate(events, "lru", hot_cap)
    last: dict[int, int] = {}
    for i, e in enumerate(events):
        if e.kind == "use":
            last[e.request] = i
    b = Bound(requests=len(last))
    for i in last.values():
        e = events[i]
        if not e.states:
            continue
        b.possible_requests += 1
        b.possible_tokens += e.tokens[0]
        b.belady_requests += belady[i] > 0
        b.belady_tokens += belady[i]
        b.lru_requests += lru[i] > 0
        b.lru_tokens += lru[i]
    return b
