"""Per-call cost of the radixcache Python API, measured from Python.

What is timed (``time.perf_counter_ns`` around one call, or around a small loop of identical
calls when nothing has to happen between them; the tables give the median and p90):

- ``match_prefix`` of a fully cached prompt (a hit) and of a prompt sharing no token with
  the cache (a miss);
- ``admit`` of a prompt whose first half is cached with a state (so the admission locks
  the prefix and emits a copy-on-write batch);
- ``extend`` with the uncached half of that prompt, and a 1-token decode ``extend``;
- ``checkpoint`` and ``finish`` of such a request (cached half plus extended half);
- the getters ``req.kv_indices``, ``req.tokens``, ``req.prefix_len`` and ``req.mamba_slot``:
  reads of an unchanged request, and the decode pattern a scheduler runs every step
  (``extend(req, [t])``, then read; only the read is timed);
- ``list.copy()`` of the cached prompt: it only touches each element once, the least any
  reader of a list pays per token. Where reading the tokens is most of a call, the
  list/int64 ratio is bounded below by this floor (an int64 array is 8 contiguous bytes
  per token, a list a pointer and a 32-byte int object each), so the goals also compare
  list input with the int64 call plus the floor.

Every call that takes tokens is measured with a Python list of ints (what serving engines
hold), an int64 and a uint32 numpy array. The cells a goal compares (list and arrays of one
call; a getter at every length) are sampled in turn, so that load on a shared machine hits
them alike. Each length gets its own caches (``HybridCache(page_size=1, mamba_slots=64)``),
sized so that nothing is evicted; what a repetition needs around the timed call (building
a request, running the batches the cache emits, aborting, evicting the leaf a finish or
checkpoint cached) is done untimed, so every timed call does the same work. A decode
request is rebuilt after growing by 1/8 of its length (1/10 for getters). A call timed
singly (not in a loop) includes one timer read (the "timer floor" in the header); nothing
is subtracted. The goals at the end are evaluated on this run's numbers; the absolute one
depends on how busy the machine is (the load average is printed before and after).

Run it by hand at full size (20-60 s; ``--check`` exits 1 when a goal fails)::

    python benches/py_calls.py [--json] [--plot PATH] [--check]

and in CI at tiny size (seconds; every code path, goals not evaluated)::

    python benches/py_calls.py --tiny
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from operator import attrgetter
from typing import Any

import numpy as np

import radixcache as rc

VOCAB = 32_000
MAMBA_SLOTS = 64
DECODE_TOKEN = 7
INPUTS = ("list", "int64", "uint32")
TOKEN_OPS = ("match_prefix hit", "match_prefix miss", "admit", "extend rest", "extend decode")
REQUEST_OPS = ("checkpoint", "finish")
GETTERS = ("kv_indices", "tokens", "prefix_len", "mamba_slot")
PATTERNS = ("unchanged", "decode")
LOOP_NS = 20_000  # a loop of identical calls lasts about this long (timer cost amortised)
MAX_LOOP = 1_000
MAX_SAMPLES = 50_000
LIST_RATIO_GOAL = 1.5
#: `list.copy()` of the token list: it only touches each element (one reference count
#: each), which is the least any reader of a list pays per token.
LIST_FLOOR = "list.copy"
#: List input against its floor: the int64 call plus touching each element.
LIST_FLOOR_GOAL = 1.2
#: Calls whose cost is mostly reading the tokens, where the floor decides.
FLOOR_OPS = ("match_prefix hit", "match_prefix miss", "admit")
FLAT_GOAL = 2.0
MATCH_4K_GOAL_US = {"int64": 5.0, "list": 15.0}

ns = time.perf_counter_ns


@dataclass(frozen=True)
class Size:
    """How much a run measures."""

    name: str
    lengths: tuple[int, ...]  # prompt lengths of the token and request calls
    getter_lengths: tuple[int, ...]  # request lengths of the getters
    budget_s: float  # wall time per cell, untimed setup included
    min_samples: int


FULL = Size("full", (128, 1024, 4096, 32768), (100, 1_000, 10_000, 100_000), 0.2, 15)
TINY = Size("tiny", (16, 64), (10, 100), 0.002, 3)


@dataclass(frozen=True)
class Cell:
    """One measured cell: an operation at one length with one input kind or pattern."""

    op: str
    length: int  # prompt length, or request length for decode and getters
    tokens: int  # tokens passed to the call (0: the call takes none)
    variant: str  # list/int64/uint32, unchanged/decode for getters, "-" otherwise
    median_us: float
    p90_us: float
    samples: int
    calls_per_sample: int


@dataclass(frozen=True)
class Goal:
    """A target evaluated on this run's numbers."""

    what: str
    value: float
    limit: float
    unit: str

    @property
    def passed(self) -> bool:
        """Whether the measured value is within the limit."""
        return self.value <= self.limit


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(f"benchmark setup broken: {what}")


class Fixture:
    """A cache for a group of cells, with the untimed steps a repetition needs."""

    def __init__(self, tokens: int) -> None:
        # ``tokens``: at least the most KV the cells hold at once (verify() checks)
        self.cache = rc.HybridCache(kv_slots=tokens + 4096, page_size=1, mamba_slots=MAMBA_SLOTS)
        self.forgotten = 0

    def drain(self) -> None:
        """Run (acknowledge) every batch the cache emitted."""
        for batch in self.cache.take_batches():
            self.cache.complete(batch.id)

    def admitted(self, prompt: np.ndarray) -> rc.Request:
        """Admit ``prompt`` and run its copy-on-write."""
        req = self.cache.admit(prompt)
        if req is None:
            raise RuntimeError("benchmark setup broken: admit refused")
        self.drain()
        return req

    def request(self, prompt: np.ndarray) -> rc.Request:
        """Admit ``prompt``, run its copy-on-write and extend it with the uncached rest."""
        req = self.admitted(prompt)
        _expect(self.cache.extend(req, prompt[req.prefix_len :]) is not None, "extend refused")
        return req

    def cache_prompt(self, prompt: np.ndarray) -> None:
        """Cache ``prompt`` with a state at its end."""
        self.cache.finish(self.request(prompt))
        self.drain()

    def forget(self, tokens: int) -> None:
        """Evict the leaf of ``tokens`` tokens that a finish or checkpoint just cached."""
        got = self.cache.evict(kv_tokens=tokens).kv_tokens
        _expect(got == tokens, f"evicted {got} tokens, not the {tokens} of the leaf")
        self.forgotten += got

    def verify(self) -> None:
        """Check that the cache evicted nothing by itself (it is large enough)."""
        evicted = self.cache.stats()["evicted_kv_tokens"]
        _expect(evicted == self.forgotten, "the cache evicted during a measurement")


class Growing:
    """A request that grows one token per step and is rebuilt after ``steps`` steps."""

    def __init__(self, fixture: Fixture, prompt: np.ndarray, steps: int) -> None:
        self.fixture = fixture
        self.prompt = prompt
        self.steps = steps
        self.left = 0
        self.req: rc.Request | None = None

    def next(self) -> rc.Request:
        """Return the request, ready for one more token (rebuilt once it grew enough)."""
        if self.req is None or self.left == 0:
            self.close()
            self.req = self.fixture.request(self.prompt)
            self.left = self.steps
        self.left -= 1
        return self.req

    def close(self) -> None:
        """Abort the live request, if any."""
        if self.req is not None:
            self.fixture.cache.abort(self.req)
            self.req = None


def inputs(tokens: np.ndarray) -> dict[str, Any]:
    """Return the same tokens as a list of ints, an int64 and a uint32 array."""
    return {
        "list": tokens.tolist(),
        "int64": tokens.astype(np.int64),
        "uint32": tokens.astype(np.uint32),
    }


@dataclass(frozen=True)
class Timed:
    """A cell to measure: ``sample()`` runs ``calls`` timed calls and returns their ns."""

    op: str
    variant: str
    length: int
    tokens: int
    sample: Callable[[], int]
    calls: int = 1


def looped(
    op: str, variant: str, length: int, tokens: int, fn: Callable[[Any], object], arg: object
) -> Timed:
    """Return a cell timing a loop of calls ``fn(arg)``, its length calibrated to LOOP_NS."""

    def loop(k: int) -> int:
        start = ns()
        for _ in range(k):
            fn(arg)
        return ns() - start

    loop(1)  # warm-up before calibrating
    per_call = max(1, min(loop(1) for _ in range(5)))
    k = max(1, min(MAX_LOOP, LOOP_NS // per_call))
    return Timed(op, variant, length, tokens, functools.partial(loop, k), k)


def measure(cells: list[Timed], size: Size) -> list[list[float]]:
    """Per-call ns of each cell's samples, taken in turn until the budget is spent.

    A group is the cells a goal compares: the list, int64 and uint32 cells of one call, or
    one getter at every length (other cells are measured alone). Interleaving them exposes
    them alike to load changes on a shared machine, so their ratios hold when the absolute
    numbers move.
    """
    for cell in cells:
        cell.sample()  # warm-up
    gc.collect()
    gc.disable()
    try:
        times: list[list[float]] = [[] for _ in cells]
        deadline = time.perf_counter() + size.budget_s * len(cells)
        rounds = 0
        while rounds < size.min_samples or (
            rounds < MAX_SAMPLES and time.perf_counter() < deadline
        ):
            for cell, out in zip(cells, times):
                out.append(cell.sample() / cell.calls)
            rounds += 1
    finally:
        gc.enable()
    return times


class Bench:
    """Measures groups of cells and records them, with progress on stderr."""

    def __init__(self, size: Size) -> None:
        self.size = size
        self.cells: list[Cell] = []
        per_length = len(TOKEN_OPS) * len(INPUTS) + len(REQUEST_OPS)
        per_getter_length = len(GETTERS) * len(PATTERNS)
        self.total = len(size.lengths) * per_length + len(size.getter_lengths) * per_getter_length

    def run(self, group: list[Timed]) -> None:
        """Measure a group of cells together (interleaved) and record each."""
        for timed, times in zip(group, measure(group, self.size)):
            cell = Cell(
                op=timed.op,
                length=timed.length,
                tokens=timed.tokens,
                variant=timed.variant,
                median_us=float(np.median(times)) / 1e3,
                p90_us=float(np.percentile(times, 90)) / 1e3,
                samples=len(times),
                calls_per_sample=timed.calls,
            )
            self.cells.append(cell)
            print(
                f"[{len(self.cells):>3}/{self.total}] {cell.op:<18} {cell.length:>7} "
                f"{cell.variant:<9} {cell.median_us:10.2f} us  ({cell.samples} x {timed.calls})",
                file=sys.stderr,
            )


def admit_sample(fx: Fixture, tokens: Any, cached: int) -> Callable[[], int]:
    """Time ``admit``; abort the request untimed."""

    def sample() -> int:
        start = ns()
        req = fx.cache.admit(tokens)
        took = ns() - start
        if req is None or req.prefix_len != cached:
            raise RuntimeError("benchmark setup broken: admit did not reuse the cached prefix")
        fx.drain()
        fx.cache.abort(req)
        return took

    return sample


def extend_rest_sample(fx: Fixture, prompt: np.ndarray, rest: Any) -> Callable[[], int]:
    """Admit ``prompt`` untimed, time ``extend`` with its uncached ``rest``, abort untimed."""

    def sample() -> int:
        req = fx.admitted(prompt)
        start = ns()
        slots = fx.cache.extend(req, rest)
        took = ns() - start
        _expect(slots is not None, "extend refused")
        fx.cache.abort(req)
        return took

    return sample


def extend_decode_sample(fx: Fixture, growing: Growing, token: Any) -> Callable[[], int]:
    """Time a one-token ``extend`` of a growing request."""

    def sample() -> int:
        req = growing.next()
        start = ns()
        slots = fx.cache.extend(req, token)
        took = ns() - start
        _expect(slots is not None, "extend refused")
        return took

    return sample


def ending_sample(fx: Fixture, prompt: np.ndarray, op: str, cached: int) -> Callable[[], int]:
    """Build a request untimed, time ``checkpoint`` or ``finish``, undo untimed.

    Undoing means running the batches, aborting the request (after a checkpoint) and
    evicting the leaf the call cached, so the tree is back to the ``cached`` prefix.
    """
    call = getattr(fx.cache, op)

    def sample() -> int:
        req = fx.request(prompt)
        start = ns()
        call(req)
        took = ns() - start
        fx.drain()
        if req.live:
            fx.cache.abort(req)
        fx.forget(len(prompt) - cached)
        return took

    return sample


def read_after_extend_sample(fx: Fixture, growing: Growing, name: str) -> Callable[[], int]:
    """Extend a growing request by one token untimed, then time reading getter ``name``."""
    get = attrgetter(name)
    token = [DECODE_TOKEN]

    def sample() -> int:
        req = growing.next()
        _expect(fx.cache.extend(req, token) is not None, "extend refused")
        start = ns()
        get(req)
        return ns() - start

    return sample


def token_calls(bench: Bench, length: int, rng: np.random.Generator) -> None:
    """Match (hit, miss), admit, extend (rest, decode), checkpoint and finish at one length."""
    half = length // 2
    prompt = rng.integers(0, VOCAB, length)  # its first half is cached (with a state)
    full = rng.integers(0, VOCAB, length)  # cached entirely

    hits = Fixture(length)
    hits.cache_prompt(full)
    match = hits.cache.match_prefix
    for op, tokens, want in (("hit", full, length), ("miss", full + VOCAB, 0)):
        group = []
        for variant, x in inputs(tokens).items():
            _expect(match(x).device_len == want, f"match is not a {op}")
            group.append(looped(f"match_prefix {op}", variant, length, length, match, x))
        if op == "hit":
            # What any reader of the list pays at least: touching each element once.
            x = inputs(tokens)["list"]
            group.append(looped(LIST_FLOOR, "list", length, length, list.copy, x))
        bench.run(group)
    hits.verify()

    fx = Fixture(4 * length)  # the cached half and three decode requests of <= 1.125 * length
    fx.cache_prompt(prompt[:half])
    bench.run(
        [
            Timed("admit", v, length, length, admit_sample(fx, x, half))
            for v, x in inputs(prompt).items()
        ]
    )
    bench.run(
        [
            Timed("extend rest", v, length, length - half, extend_rest_sample(fx, prompt, x))
            for v, x in inputs(prompt[half:]).items()
        ]
    )
    growing = {v: Growing(fx, prompt, max(1, length // 8)) for v in INPUTS}
    bench.run(
        [
            Timed("extend decode", v, length, 1, extend_decode_sample(fx, growing[v], x))
            for v, x in inputs(np.array([DECODE_TOKEN])).items()
        ]
    )
    for g in growing.values():
        g.close()
    for op in REQUEST_OPS:
        bench.run([Timed(op, "-", length, 0, ending_sample(fx, prompt, op, half))])
    fx.verify()


def getter_calls(bench: Bench, lengths: tuple[int, ...], rng: np.random.Generator) -> None:
    """Read each getter of requests of each length: unchanged, and after each extend."""
    fxs = {n: Fixture(2 * n) for n in lengths}  # a request of up to 1.1 * n at a time
    prompts = {n: rng.integers(0, VOCAB, n) for n in lengths}
    reqs = {n: fxs[n].request(prompts[n]) for n in lengths}
    for n, req in reqs.items():
        _expect(len(req.kv_indices) == n and req.mamba_slot is not None, "request not built")
    for name in GETTERS:
        bench.run([looped(name, "unchanged", n, 0, attrgetter(name), reqs[n]) for n in lengths])
    for n, req in reqs.items():
        fxs[n].cache.abort(req)

    for name in GETTERS:
        growing = {n: Growing(fxs[n], prompts[n], max(1, n // 10)) for n in lengths}
        bench.run(
            [
                Timed(name, "decode", n, 0, read_after_extend_sample(fxs[n], growing[n], name))
                for n in lengths
            ]
        )
        for g in growing.values():
            g.close()
    for fx in fxs.values():
        fx.verify()


def medians(cells: list[Cell]) -> dict[tuple[str, int, str], float]:
    """Map (operation, length, variant) to the cell's median in us."""
    return {(c.op, c.length, c.variant): c.median_us for c in cells}


def evaluate(cells: list[Cell], size: Size) -> list[Goal]:
    """Evaluate the goals on this run's cells."""
    at = medians(cells)
    goals = [
        Goal(
            f"list <= {LIST_RATIO_GOAL}x int64: {op}, {length}",
            at[op, length, "list"] / at[op, length, "int64"],
            LIST_RATIO_GOAL,
            "x",
        )
        for op in TOKEN_OPS
        for length in size.lengths
    ]
    goals += [
        Goal(
            f"list <= {LIST_FLOOR_GOAL}x (int64 + list.copy): {op}, {length}",
            at[op, length, "list"] / (at[op, length, "int64"] + at[LIST_FLOOR, length, "list"]),
            LIST_FLOOR_GOAL,
            "x",
        )
        for op in FLOOR_OPS
        for length in size.lengths
    ]
    small, large = size.getter_lengths[0], size.getter_lengths[-1]
    goals += [
        Goal(
            f"flat getter: {name} {pattern}, {large} vs {small} tokens",
            at[name, large, pattern] / at[name, small, pattern],
            FLAT_GOAL,
            "x",
        )
        for name in GETTERS
        for pattern in PATTERNS
    ]
    goals += [
        Goal(
            f"match_prefix hit of 4096 cached tokens, {variant}",
            at["match_prefix hit", 4096, variant],
            limit,
            " us",
        )
        for variant, limit in MATCH_4K_GOAL_US.items()
    ]
    return goals


def timer_floor_ns() -> int:
    """Return the smallest difference of two back-to-back ``perf_counter_ns`` readings."""
    floor = sys.maxsize
    for _ in range(1000):
        start = ns()
        floor = min(floor, ns() - start)
    return floor


def load_average() -> float | None:
    """Return the 1-minute load average (other work on the machine skews the numbers)."""
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def context() -> dict[str, Any]:
    """Describe the machine and the versions measured."""
    return {
        "radixcache": rc.__version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "cpus": os.cpu_count(),
        "platform": f"{platform.system()} {platform.machine()}",
        "load_average_1m": load_average(),
        "timer_floor_ns": timer_floor_ns(),
    }


def decode_reads(cells: list[Cell], size: Size) -> dict[str, tuple[float, float]]:
    """Seconds spent reading each getter once per decode step over the getter lengths.

    Integrates the measured decode-pattern cost per read (linear between the measured
    lengths) from the smallest to the largest length; the second number assumes every read
    cost what it did at the smallest length (a flat getter).
    """
    at = medians(cells)
    xs = size.getter_lengths
    out = {}
    for name in GETTERS:
        ys = [at[name, x, "decode"] for x in xs]
        measured = sum((y0 + y1) / 2 * (x1 - x0) for x0, x1, y0, y1 in zip(xs, xs[1:], ys, ys[1:]))
        out[name] = (measured / 1e6, ys[0] * (xs[-1] - xs[0]) / 1e6)
    return out


def report(cells: list[Cell], goals: list[Goal] | None, seconds: float, size: Size) -> None:
    """Print the tables and the goals."""
    at = {(c.op, c.length, c.variant): c for c in cells}
    print("\ncalls with tokens: us per call, median (p90)")
    head = "".join(f"{v + ' us':>20}" for v in INPUTS)
    print(f"{'operation':<18} {'length':>7} {'tokens':>7}{head}  list/int64")
    for op in TOKEN_OPS:
        for length in size.lengths:
            row = [at[op, length, v] for v in INPUTS]
            vals = "".join(f"{f'{c.median_us:.2f} ({c.p90_us:.2f})':>20}" for c in row)
            ratio = row[0].median_us / row[1].median_us
            print(f"{op:<18} {length:>7} {row[0].tokens:>7}{vals}  {ratio:10.2f}")
    print("the list floor, list.copy() of the prompt (touches each element once): us")
    print("  " + "  ".join(f"{n}: {at[LIST_FLOOR, n, 'list'].median_us:.2f}" for n in size.lengths))

    print("\ncalls on a request (prompt half cached, half extended): us per call")
    print(f"{'operation':<18} {'length':>7} {'median':>10} {'p90':>10}")
    for op in REQUEST_OPS:
        for length in size.lengths:
            c = at[op, length, "-"]
            print(f"{op:<18} {length:>7} {c.median_us:10.2f} {c.p90_us:10.2f}")

    print("\nrequest getters: us per read, median (decode: read right after extend(req, [t]))")
    names = "".join(f"{n:>12}" for n in GETTERS)
    print(f"{'length':>7} {'unchanged:':<10}{names}  {'decode:':<8}{names}")
    for length in size.getter_lengths:
        cols = ["".join(f"{at[n, length, p].median_us:12.3f}" for n in GETTERS) for p in PATTERNS]
        print(f"{length:>7} {'':<10}{cols[0]}  {'':<8}{cols[1]}")
    small, large = size.getter_lengths[0], size.getter_lengths[-1]
    print(f"decoding from {small} to {large} tokens with one read per step costs, in reads:")
    for name, (measured, flat) in decode_reads(cells, size).items():
        ms, flat_ms = measured * 1e3, flat * 1e3
        print(f"  {name:<12} {ms:10.2f} ms  ({flat_ms:.2f} ms at the {small}-token cost)")

    print("\ngoals")
    if goals is None:
        print("goals not evaluated at tiny size")
    else:
        width = max(len(g.what) for g in goals)
        for g in goals:
            verdict = "PASS" if g.passed else "FAIL"
            print(
                f"{verdict}  {g.what:<{width}} {g.value:8.2f}{g.unit}  "
                f"(goal <= {g.limit:g}{g.unit})"
            )
        failed = sum(not g.passed for g in goals)
        print(f"{len(goals) - failed} of {len(goals)} goals pass")
    print(f"\n{len(cells)} cells measured in {seconds:.1f} s")


def plot(pyplot: Any, cells: list[Cell], path: str, ctx: dict[str, Any]) -> None:
    """Write a PNG of us per call against length (log-log), one panel per operation."""
    panels = [(op, [(v, op, v) for v in INPUTS]) for op in TOKEN_OPS]
    panels.append(("checkpoint / finish", [(op, op, "-") for op in REQUEST_OPS]))
    panels += [(f"getters, {p}", [(n, n, p) for n in GETTERS]) for p in PATTERNS]
    fig, axes = pyplot.subplots(2, 4, figsize=(19, 9), constrained_layout=True)
    for ax, (title, series) in zip(axes.flat, panels):
        for label, op, variant in series:
            points = [(c.length, c.median_us) for c in cells if (c.op, c.variant) == (op, variant)]
            ax.loglog(*zip(*points), marker="o", label=label)
        ax.set_title(title)
        ax.set_xlabel("tokens (prompt or request length)")
        ax.set_ylabel("us per call (median)")
        ax.grid(True, which="both", alpha=0.3)
        # Below the axes: inside, it covered the curves.
        ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2)
    fig.suptitle(
        f"radixcache {ctx['radixcache']} Python call cost (Python {ctx['python']}, "
        f"numpy {ctx['numpy']}, {ctx['cpus']} CPUs)"
    )
    fig.savefig(path, dpi=110, bbox_inches="tight")
    print(f"wrote {path}", file=sys.stderr)


def spin(stop: threading.Event, out: list[int]) -> None:
    """Count loop turns until `stop`: pure-Python work (a thread that needs the GIL)."""
    n = 0
    while not stop.is_set():
        n += 1
    out.append(n)


def hammer(cache: rc.HybridCache, tokens: Any, stop: threading.Event, out: list[int]) -> None:
    """Call `match_prefix(tokens)` until `stop`; record how many calls it made."""
    n = 0
    while not stop.is_set():
        cache.match_prefix(tokens)
        n += 1
    out.append(n)


def threads_section(size: Size) -> dict[str, float]:
    """Measure the GIL policy: a call alone, and threads sharing one cache.

    A call takes the cache without releasing the GIL when no other thread holds it, and
    releases the GIL before waiting when one does (or always, over 4,096 tokens). The
    figures to compare policies by: what a small call costs with no other thread (what
    releasing the GIL every time would add to each); while two threads share one cache,
    the calls they make and what a pure-Python thread beside them gets done; and the
    contended case: one thread making long calls (32k tokens, which run with the GIL
    released and so hold the cache while other threads run), one making short ones, and
    a pure-Python thread (a short call that waited for the cache holding the GIL would
    stop that thread for the length of a long call).
    """
    seconds = 0.05 if size.name == "tiny" else 1.0
    cache = rc.HybridCache(kv_slots=1 << 16)
    tokens = np.arange(128, dtype=np.int64)
    cache.insert(tokens, cache.alloc_kv(128))
    long_tokens = np.arange(32768, dtype=np.int64)

    def run(workers: list[Any], spinner: bool) -> tuple[list[float], float]:
        stop = threading.Event()
        calls: list[list[int]] = [[] for _ in workers]
        turns: list[int] = []
        threads = [
            threading.Thread(target=hammer, args=(cache, w, stop, out))
            for w, out in zip(workers, calls)
        ]
        if spinner:
            threads.append(threading.Thread(target=spin, args=(stop, turns)))
        for t in threads:
            t.start()
        time.sleep(seconds)
        stop.set()
        for t in threads:
            t.join()
        return [sum(c) / seconds for c in calls], sum(turns) / seconds

    def loop() -> float:
        start = ns()
        for _ in range(1000):
            cache.match_prefix(tokens)
        return (ns() - start) / 1000

    one_us = statistics.median(loop() for _ in range(20 if size.name == "tiny" else 200)) / 1000
    _, solo_turns = run([], True)
    alone_calls, _ = run([tokens, tokens], False)
    calls, turns = run([tokens, tokens], True)
    mixed_calls, mixed_turns = run([long_tokens, tokens], True)
    return {
        "match_prefix_128_us": one_us,
        "two_threads_calls_per_s": sum(alone_calls),
        "with_python_thread_calls_per_s": sum(calls),
        "python_thread_progress": turns / solo_turns if solo_turns else 0.0,
        "contended_long_calls_per_s": mixed_calls[0],
        "contended_short_calls_per_s": mixed_calls[1],
        "contended_python_thread_progress": mixed_turns / solo_turns if solo_turns else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit status."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tiny", action="store_true", help="small lengths, seconds (CI)")
    ap.add_argument("--json", action="store_true", help="print one JSON object, no tables")
    ap.add_argument("--plot", metavar="PATH", help="write a PNG (needs matplotlib)")
    ap.add_argument("--check", action="store_true", help="exit 1 if a goal fails")
    args = ap.parse_args(argv)

    pyplot = None
    if args.plot:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as pyplot
        except ImportError:
            print("--plot needs matplotlib: pip install matplotlib", file=sys.stderr)
            return 2

    size = TINY if args.tiny else FULL
    ctx = context()
    if not args.json:
        print(
            f"radixcache {ctx['radixcache']}, Python {ctx['python']}, numpy {ctx['numpy']}, "
            f"{ctx['cpus']} CPUs ({ctx['platform']}), load average {ctx['load_average_1m']}, "
            f"timer floor {ctx['timer_floor_ns']} ns, {size.name} size",
            flush=True,
        )

    start = time.perf_counter()
    bench = Bench(size)
    rng = np.random.default_rng(0)
    for length in size.lengths:
        token_calls(bench, length, rng)
    getter_calls(bench, size.getter_lengths, rng)
    threads = threads_section(size)
    seconds = time.perf_counter() - start
    ctx["load_average_1m_end"] = load_average()

    goals = None if args.tiny else evaluate(bench.cells, size)
    if args.json:
        out = {
            "context": ctx,
            "size": size.name,
            "seconds": round(seconds, 2),
            "cells": [asdict(c) for c in bench.cells],
            "decode_reads_s": {
                name: {"measured": measured, "flat": flat}
                for name, (measured, flat) in decode_reads(bench.cells, size).items()
            },
            "goals": None if goals is None else [{**asdict(g), "passed": g.passed} for g in goals],
            "threads": threads,
        }
        print(json.dumps(out, indent=1))
    else:
        report(bench.cells, goals, seconds, size)
        print(
            "\nthreads (GIL policy): match_prefix of 128 tokens "
            f"{threads['match_prefix_128_us']:.2f} us alone; two threads sharing a cache "
            f"make {threads['two_threads_calls_per_s']:,.0f} calls/s, "
            f"{threads['with_python_thread_calls_per_s']:,.0f} beside a pure-Python thread, "
            f"which gets {threads['python_thread_progress']:.0%} of what it does alone; "
            f"contended (a thread making 32k-token calls beside them): "
            f"{threads['contended_long_calls_per_s']:,.0f} long and "
            f"{threads['contended_short_calls_per_s']:,.0f} short calls/s, the pure-Python "
            f"thread gets {threads['contended_python_thread_progress']:.0%}"
        )
        print(f"load average at the end {ctx['load_average_1m_end']} ({ctx['cpus']} CPUs)")
    if pyplot is not None:
        plot(pyplot, bench.cells, args.plot, ctx)
    failed = goals is not None and not all(g.passed for g in goals)
    return 1 if args.check and failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
