"""`radixcache bench`: the cache operations of a replay, timed alone.

The scheduler serves the workload exactly as in ``radixcache replay`` but with no model
and no copies: every transfer batch is started and completed at once. Every call the
scheduler makes on the cache (and on its batches) goes through `TimedCache`, which times
it with ``time.perf_counter_ns`` and charges it to the request it concerns, so the
figures are the cache's own cost as a serving engine would pay it, Python call overhead
included. Tokens reach the cache as Python lists by default (as serving engines hold
them), or as NumPy arrays.
"""

from __future__ import annotations

import resource
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._core import HybridCache, Request, TransferBatch
from .harness import ReplayConfig, clear
from .model import model_name
from .scheduler import InstantEngine, Scheduler
from .workloads import Job

__all__ = ["TimedCache", "TimedEngine", "bench"]

_now = time.perf_counter_ns


class TimedCache:
    """A `HybridCache` whose calls are timed, per operation and per request.

    Every public method of the cache is reachable; the request-level calls, the batch
    calls and the size queries a scheduler makes are timed.
    """

    def __init__(self, cache: HybridCache) -> None:
        self._cache = cache
        self.ops: dict[str, list[int]] = defaultdict(list)
        #: Nanoseconds charged to each live request (by the request object's id).
        self._open: dict[int, int] = defaultdict(int)
        #: Nanoseconds of each finished request, and of requests aborted (retracted).
        self.finished: list[int] = []
        self.aborted_ns = 0
        self._current: int | None = None
        self._closing: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)

    def _charge(self, op: str, ns: int, req: object | None = None) -> None:
        self.ops[op].append(ns)
        key = self._current if req is None else id(req)
        if key is not None:
            self._open[key] += ns

    def admit(
        self, tokens: Any, *, namespace: str | None = None, priority: int = 0
    ) -> Request | None:
        """Time ``admit``."""
        t = _now()
        req = self._cache.admit(tokens, namespace=namespace, priority=priority)
        ns = _now() - t
        if req is None:
            self._charge("admit", ns, None)
        else:
            self._current = id(req)
            self._charge("admit", ns, req)
        return req

    def extend(self, req: Request, tokens: Any) -> Any:
        """Time ``extend``."""
        self._current = id(req)
        t = _now()
        out = self._cache.extend(req, tokens)
        self._charge("extend", _now() - t, req)
        return out

    def extend_batch(self, reqs: Sequence[Request], tokens: Any) -> Any:
        """Time ``extend_batch`` (a decode step), charged evenly to its requests."""
        t = _now()
        out = self._cache.extend_batch(reqs, tokens)
        ns = _now() - t
        self.ops["extend_batch"].append(ns)
        for req in reqs:
            self._open[id(req)] += ns // len(reqs)
        return out

    def checkpoint(self, req: Request) -> None:
        """Time ``checkpoint``."""
        self._current = id(req)
        t = _now()
        self._cache.checkpoint(req)
        self._charge("checkpoint", _now() - t, req)

    def finish(self, req: Request) -> None:
        """Time ``finish``; the request's account closes when its batches have run."""
        self._current = id(req)
        t = _now()
        self._cache.finish(req)
        self._charge("finish", _now() - t, req)
        self._closing.append(id(req))

    def abort(self, req: Request) -> None:
        """Time ``abort`` (a retraction): its time counts, in no finished request."""
        t = _now()
        self._cache.abort(req)
        self._charge("abort", _now() - t, req)
        self.aborted_ns += self._open.pop(id(req), 0)

    def load_back(self, target: Any, **kw: Any) -> Any:
        """Time ``load_back``."""
        self._current = id(target)
        t = _now()
        lb = self._cache.load_back(target, **kw)
        self._charge("load_back", _now() - t, target)
        return None if lb is None else _TimedLoadBack(lb, self, target)

    def take_batches(self) -> list[TransferBatch]:
        """Time ``take_batches``."""
        t = _now()
        out = self._cache.take_batches()
        self._charge("take_batches", _now() - t)
        return out

    def evict(self, **kw: int) -> Any:
        """Time ``evict``."""
        t = _now()
        out = self._cache.evict(**kw)
        self._charge("evict", _now() - t)
        return out

    def peek_prefix(self, tokens: Any, *, namespace: str | None = None) -> tuple[int, int, int]:
        """Time ``peek_prefix`` (the ``"lpm"`` ranking; charged to no request)."""
        t = _now()
        out = self._cache.peek_prefix(tokens, namespace=namespace)
        self.ops["peek_prefix"].append(_now() - t)
        return out

    def expect(self, prompts: Any, *, namespaces: Any = None) -> int:
        """Time ``expect`` (the ``lookahead``; charged to no request)."""
        t = _now()
        out = self._cache.expect(prompts, namespaces=namespaces)
        self.ops["expect"].append(_now() - t)
        return out

    def available_kv(self) -> int:
        """Time ``available_kv``."""
        t = _now()
        out = self._cache.available_kv()
        self._charge("sizes", _now() - t)
        return out

    def evictable_size(self) -> int:
        """Time ``evictable_size``."""
        t = _now()
        out = self._cache.evictable_size()
        self._charge("sizes", _now() - t)
        return out

    def close_finished(self) -> None:
        """Close the accounts of the requests finished since (after their batches ran)."""
        for key in self._closing:
            self.finished.append(self._open.pop(key, 0))
            if self._current == key:
                self._current = None
        self._closing.clear()


class _TimedLoadBack:
    """A load-back guard whose commit is timed (the batch is timed by the engine)."""

    def __init__(self, lb: Any, timed: TimedCache, req: object) -> None:
        self._lb, self._timed, self._req = lb, timed, req

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lb, name)

    def __enter__(self) -> _TimedLoadBack:
        self._lb.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        t = _now()
        out = self._lb.__exit__(*exc)
        self._timed._charge("load_back_exit", _now() - t, self._req)
        return out

    def commit(self) -> None:
        """Time ``commit``."""
        t = _now()
        self._lb.commit()
        self._timed._charge("commit", _now() - t, self._req)


class TimedEngine:
    """Starts and completes every batch at once, timing the two calls (no copies)."""

    def __init__(self, timed: TimedCache) -> None:
        self.timed = timed
        self._in_flight: list[TransferBatch] = []

    def _ack(self, batch: TransferBatch) -> None:
        t = _now()
        batch.start()
        batch.complete()
        self.timed._charge("batch", _now() - t)

    def run(self, batch: TransferBatch) -> bool:
        """Start and complete `batch`."""
        self._ack(batch)
        return True

    def submit(self, batch: TransferBatch) -> None:
        """Start and complete `batch`; the next `poll` reports it.

        A load-back's batch thus completes before its commit: either order is allowed.
        """
        self._ack(batch)
        self._in_flight.append(batch)

    def poll(self) -> list[TransferBatch]:
        """Return the batches submitted since the last poll (all complete)."""
        done, self._in_flight = self._in_flight, []
        return done

    def synchronize(self) -> list[TransferBatch]:
        """Return what `poll` returns."""
        return self.poll()

    def after_compute(self, event: Any) -> None:
        """There is no compute."""


class _BenchScheduler(Scheduler):
    """Closes each finished request's account once the batches it emitted have run."""

    def _run_batches(self) -> int:
        ran = super()._run_batches()
        assert isinstance(self.cache, TimedCache)
        self.cache.close_finished()
        return ran


def _rss_kb() -> int:
    """Return the process's resident memory now (0 where /proc is missing)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _peak_rss_kb() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak // 1024 if sys.platform == "darwin" else peak


def _pct(values: Sequence[int], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else 0.0


def bench(
    jobs: Sequence[Job],
    config: ReplayConfig | None = None,
    *,
    numpy_tokens: bool = False,
    progress: Any = None,
    samples: bool = False,
) -> dict[str, Any]:
    """Replay `jobs` through the scheduler with no model and no copies, timing the cache.

    Returns:
        ``ns_per_prompt_token``, ``us_per_request`` (median over finished requests),
        ``p99_us``, ``mean_us_per_request``, ``hit_rate``, ``model`` (the layers the
        pools serve: `radixcache.serving.model.MODELS`), ``eviction_policy`` (the
        cache's, per component), ``schedule_policy`` (the admission order),
        per-operation ``ops`` (calls,
        p50/p99 in µs, share of the total), ``peak_rss_mb`` and ``rss_growth_mb`` (the
        process, before and after the cache was built), ``pools_full_at_end`` (the cache,
        emptied after the replay, had every slot back: nothing leaked), ``retractions``,
        ``rejected`` (requests too big for the pools even alone) and the workload's
        counts. With `samples`, also ``per_request_us``: each finished request's cache
        time, in finishing order.
    """
    config = config or ReplayConfig()
    base_kb = _rss_kb()
    cache = config.cache()
    timed = TimedCache(cache)
    sched = config.scheduler(
        timed,  # type: ignore[arg-type]
        TimedEngine(timed),  # type: ignore[arg-type]
        None,
        kind=_BenchScheduler,
        timeline=0,  # a timeline sample reads pool sizes, which would be timed
        token_lists=not numpy_tokens,
    )
    sched.add(jobs)
    wall = _now()
    c = sched.run(progress)
    wall = _now() - wall
    total = sum(sum(v) for v in timed.ops.values())
    per_request = timed.finished
    ops = {
        name: {
            "calls": len(v),
            "p50_us": _pct(v, 50) / 1e3,
            "p99_us": _pct(v, 99) / 1e3,
            "share": sum(v) / total if total else 0.0,
        }
        for name, v in sorted(timed.ops.items(), key=lambda kv: -sum(kv[1]))
    }
    cache.audit()
    growth_kb = max(0, _rss_kb() - base_kb)
    full = clear(cache, InstantEngine(cache))
    out: dict[str, Any] = {
        "requests": c.finished,
        "prompt_tokens": c.prompt_tokens,
        "output_tokens": c.output_tokens,
        "tokens": "numpy" if numpy_tokens else "list",
        "model": model_name(cache),
        "eviction_policy": cache.eviction_policy,
        "schedule_policy": config.schedule_policy,
        "hit_rate": c.device_hit_tokens / c.prompt_tokens if c.prompt_tokens else 0.0,
        "host_hit_rate": c.host_hit_tokens / c.prompt_tokens if c.prompt_tokens else 0.0,
        "cache_seconds": total / 1e9,
        "wall_seconds": wall / 1e9,
        "ns_per_prompt_token": total / c.prompt_tokens if c.prompt_tokens else 0.0,
        "us_per_request": _pct(per_request, 50) / 1e3,
        "p99_us": _pct(per_request, 99) / 1e3,
        "mean_us_per_request": total / c.finished / 1e3 if c.finished else 0.0,
        "retractions": c.retractions,
        "rejected": c.rejected,
        "retracted_us": timed.aborted_ns / 1e3,
        "ops": ops,
        "pools_full_at_end": full,
        "peak_rss_mb": _peak_rss_kb() / 1024,
        "rss_growth_mb": growth_kb / 1024,
    }
    if samples:
        out["per_request_us"] = [ns / 1e3 for ns in per_request]
    return out
