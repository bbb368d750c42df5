"""How ``benches/_sglang_side.py`` times SGLang's calls and splits out its allocator's part.

No SGLang here (the tests use this module without it). `Meter` wraps methods so that each
call opens a *zone*: ``"alloc"`` for SGLang's allocators and page table, ``"tree"`` for the
tree's eviction. Time is charged to the innermost open zone, so a free that an eviction
makes inside an allocation counts as allocator time and the eviction around it does not.
`Clock` times the calls the scheduler makes, charges each to the requests it serves (split
evenly for a batch's call), and records the allocator's part of each.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

__all__ = ["Clock", "Meter"]


class Charged(Protocol):
    """A request the clock charges: its cache time and the allocator's part of it (ns)."""

    ns: int
    alloc_ns: int


class Meter:
    """Splits time into the allocator zones' and the rest.

    Each wrapper costs time of its own: `calibrate` measures it on a wrapped no-op
    (`wrap_ns` per call). `Clock` charges a timed call its time less ``wrap_ns`` per wrapped
    call made inside it, and takes as the allocator's part the allocator zones' time less
    ``wrap_ns`` per wrapped call made inside an allocator zone. The part of a wrapper's cost
    inside the zone it opens stays with the allocator: if anything, the allocator's part is
    overstated and the time without it understated.

    Args:
        clock: Nanoseconds now (`time.perf_counter_ns`; the tests pass a fake).
    """

    def __init__(self, clock: Callable[[], int] = time.perf_counter_ns) -> None:
        self.clock = clock
        self.zones: list[str] = []
        self.mark = 0
        self.alloc_ns = 0  # time spent in allocator zones so far
        self.calls = 0  # wrapped calls made
        self.nested = 0  # wrapped calls made inside an allocator zone
        self.wrap_ns = 0.0

    def _enter(self, kind: str) -> None:
        now = self.clock()
        if self.zones and self.zones[-1] == "alloc":
            self.alloc_ns += now - self.mark
            self.nested += 1
        self.calls += 1
        self.zones.append(kind)
        self.mark = now

    def _leave(self) -> None:
        now = self.clock()
        if self.zones.pop() == "alloc":
            self.alloc_ns += now - self.mark
        self.mark = now

    def wrap(self, fn: Callable[..., Any], kind: str) -> Callable[..., Any]:
        """Return `fn` opening a zone of `kind` (``"alloc"`` or ``"tree"``) while it runs."""
        if kind not in ("alloc", "tree"):
            raise ValueError(f"kind: 'alloc' or 'tree', got {kind!r}")
        enter, leave = self._enter, self._leave

        def zoned(*args: Any, **kwargs: Any) -> Any:
            enter(kind)
            try:
                return fn(*args, **kwargs)
            finally:
                leave()

        return zoned

    def instrument(self, obj: Any, names: Sequence[str], kind: str) -> list[str]:
        """Wrap each method of `names` that `obj` has, on the instance; return those wrapped."""
        wrapped = []
        for name in names:
            fn = getattr(obj, name, None)
            if callable(fn):
                setattr(obj, name, self.wrap(fn, kind))
                wrapped.append(name)
        return wrapped

    def calibrate(self, calls: int = 20_000, rounds: int = 5) -> None:
        """Measure what a wrapper costs (`wrap_ns`) on a wrapped no-op.

        The difference of the best of `rounds` medians of `calls` calls, wrapped and not;
        the counters are reset afterwards.
        """

        def noop() -> None:
            return None

        zoned = self.wrap(noop, "alloc")
        clock = self.clock
        best_plain = best_zoned = float("inf")
        for _ in range(rounds):
            plain, wrapped = [], []
            for _ in range(calls):
                start = clock()
                noop()
                plain.append(clock() - start)
            for _ in range(calls):
                start = clock()
                zoned()
                wrapped.append(clock() - start)
            plain.sort()
            wrapped.sort()
            best_plain = min(best_plain, plain[calls // 2])
            best_zoned = min(best_zoned, wrapped[calls // 2])
        self.alloc_ns = self.calls = self.nested = 0
        self.wrap_ns = max(0.0, best_zoned - best_plain)


@dataclass
class Clock:
    """Per-call times (ns) by operation, charged to the requests they serve.

    Args:
        meter: The meter whose zones split each call.
        ops: The operations, each with an empty list.
        uncharged: Operations timed and recorded but charged to no request.
    """

    meter: Meter
    ops: dict[str, list[int]]
    uncharged: tuple[str, ...] = ()
    #: Of each call in `ops`, the allocator's part (ns, instrumentation removed).
    alloc_ops: dict[str, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.alloc_ops = {op: [] for op in self.ops}

    def time(
        self, op: str, lives: Sequence[Charged], fn: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Any:
        """Call ``fn(*args, **kwargs)`` timed and charge it to `lives`, split evenly."""
        meter = self.meter
        alloc0, calls0, nested0 = meter.alloc_ns, meter.calls, meter.nested
        start = meter.clock()
        out = fn(*args, **kwargs)
        raw = meter.clock() - start
        ns = max(0, round(raw - (meter.calls - calls0) * meter.wrap_ns))
        nested = (meter.nested - nested0) * meter.wrap_ns
        alloc = min(ns, max(0, round(meter.alloc_ns - alloc0 - nested)))
        self.ops[op].append(ns)
        self.alloc_ops[op].append(alloc)
        if op not in self.uncharged and lives:
            ns_share, ns_rest = divmod(ns, len(lives))
            alloc_share, alloc_rest = divmod(alloc, len(lives))
            for i, live in enumerate(lives):
                live.ns += ns_share + (1 if i < ns_rest else 0)
                live.alloc_ns += alloc_share + (1 if i < alloc_rest else 0)
        return out
