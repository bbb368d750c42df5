"""A continuous-batching scheduler that drives the cache the way a serving engine does.

Each step acknowledges the load-backs the engine finished, admits waiting requests in
the order of the schedule policy (``"fcfs"``, or ``"lpm"``: the longest cached prefix
first among a window of waiting requests, each overtaken a bounded number of times),
schedules a decode token for every decoding request and a prefill chunk for the others
(waiting for the copies in flight, then retracting the newest request, when memory runs
out), hands the step's compute to the engine, and checkpoints and finishes requests in
the cache. It can tell eviction the waiting queue (``lookahead``) and fetch from an L3
tier in the background (``l3_prefetch``).

It uses only the public request API, `Storage` and the engine interface (``run``,
``submit``, ``poll``, ``after_compute``); without a model it makes exactly the same
cache calls (for hit rates and for timing the cache alone). What each step does and
why, and the measurements behind the defaults: docs/serving.md, "The scheduler
(`serving/scheduler.py`)", "Cache-aware admission (`--schedule-policy lpm`)", "Eviction
told the waiting queue (`--lookahead`)" and, for ``l3_prefetch``, "A fleet behind a
router: the L3 tier".
"""

from __future__ import annotations

import itertools
import random
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import numpy as np

from .._core import HybridCache, Request, TransferBatch
from ..engine import TransferEngine
from ..l3 import L3Fetch, L3Tier
from ..storage import Storage
from .model import ChecksumModel, ComputeEvent
from .offline import StateTrace
from .workloads import Job

__all__ = [
    "SCHEDULE_POLICIES",
    "FaultyEngine",
    "InstantEngine",
    "Refused",
    "Scheduler",
    "StepSample",
]

#: The admission orders of `Scheduler` (``schedule_policy``; docs/serving.md, "Cache-aware
#: admission").
SCHEDULE_POLICIES = ("fcfs", "lpm")
#: A ``schedule_policy`` name.
SchedulePolicy = Literal["fcfs", "lpm"]


class Refused(RuntimeError):
    """The engine refused a batch before starting it (a full copy queue, a lost device)."""


class CopyFailed(RuntimeError):
    """An injected failure of a batch's copies (a CUDA error, a lost host page)."""


class InstantEngine:
    """An engine with no storage: every batch completes at once (cache operations only).

    It has the `TransferEngine` interface the scheduler uses, for replays without a model
    (the attention-only comparison, ``radixcache bench``).
    """

    def __init__(self, cache: HybridCache) -> None:
        self.cache = cache
        self._in_flight: list[TransferBatch] = []
        self.batches = 0

    def run(self, batch: TransferBatch) -> bool:
        """Start and complete `batch`."""
        batch.start()
        batch.complete()
        self.batches += 1
        return True

    def submit(self, batch: TransferBatch) -> None:
        """Start `batch`; the next `poll` completes it."""
        batch.start()
        self._in_flight.append(batch)

    def poll(self) -> list[TransferBatch]:
        """Complete every submitted batch."""
        done, self._in_flight = self._in_flight, []
        for b in done:
            b.complete()
            self.batches += 1
        return done

    def synchronize(self) -> list[TransferBatch]:
        """Complete every submitted batch (as `poll`)."""
        return self.poll()

    def after_compute(self, event: Any) -> None:
        """Nothing to order: there is no compute."""


class FaultyEngine(TransferEngine):
    """A `TransferEngine` that refuses or fails batches at random, where real ones can.

    With probability `rate`, a batch meets one of these, chosen at random:

    * refused before it starts (``run``/``submit`` raise `Refused`; the caller fails or
      drops it);
    * its copies fail after it started (before a load-back's commit: the guard is
      dropped, called off);
    * (submitted batches) its copies fail after the caller went on — after a load-back's
      commit: the request's prefix drops back and it recomputes;
    * (submitted batches) it is acknowledged out of order, after a later batch.

    Args:
        cache, storage: As for `TransferEngine`.
        rate: Probability that a batch meets a failure.
        seed: Seeds the choices.
    """

    def __init__(
        self,
        cache: HybridCache,
        storage: Storage,
        rate: float,
        seed: int = 0,
        *,
        l3: L3Tier | None = None,
    ) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate: must be in [0, 1], got {rate}")
        super().__init__(cache, storage, l3=l3)
        self.rate = rate
        self.rng = random.Random(seed)
        self.injected = dict.fromkeys(("refused", "copy_failed", "failed_late", "reordered"), 0)
        self._fail_copies: set[int] = set()
        self._fail_after_commit: set[int] = set()

    def _inject(self, batch: TransferBatch, points: Sequence[str]) -> str | None:
        """Draw a failure point for `batch`: raise a refusal, or mark its copies to fail."""
        if self.rate == 0.0 or self.rng.random() >= self.rate:
            return None
        point = self.rng.choice(points)
        self.injected[point] += 1
        if point == "refused":
            raise Refused(f"batch {batch.id} ({batch.kind}) refused")
        if point == "copy_failed":
            self._fail_copies.add(batch.id)
        return point

    def run(self, batch: TransferBatch) -> bool:
        """As `TransferEngine.run`, with injected refusals and copy failures."""
        self._inject(batch, ("refused", "copy_failed"))
        return super().run(batch)

    def submit(self, batch: TransferBatch) -> None:
        """As `TransferEngine.submit`, with every kind of injected failure."""
        point = self._inject(batch, ("refused", "copy_failed", "failed_late", "reordered"))
        super().submit(batch)
        if point == "failed_late":
            self._fail_after_commit.add(batch.id)
        elif point == "reordered" and len(self._in_flight) > 1:
            self._in_flight.insert(0, self._in_flight.pop())

    def copy_batch(self, batch: TransferBatch) -> None:
        """Fail the copies of a batch drawn for it; run the others."""
        if batch.id in self._fail_copies:
            self._fail_copies.discard(batch.id)
            raise CopyFailed(f"injected failure of batch {batch.id} ({batch.kind})")
        super().copy_batch(batch)

    def poll(self) -> list[TransferBatch]:
        """As `TransferEngine.poll`; a batch drawn to fail late fails here."""
        late = self._fail_after_commit
        ended: list[TransferBatch] = []
        keep = []
        for f in self._in_flight:
            if f.batch.id in late:
                late.discard(f.batch.id)
                self._fail(f.batch, CopyFailed(f"injected late failure of batch {f.batch.id}"))
                ended.append(f.batch)
            else:
                keep.append(f)
        self._in_flight = keep
        return ended + super().poll()


@dataclass
class StepSample:
    """The scheduler's state after one step (for plots)."""

    step: int
    finished: int
    prompt_tokens: int
    device_hit_tokens: int
    host_hit_tokens: int
    kv_used: float
    mamba_used: float
    host_kv_used: float


@dataclass(eq=False)
class _Live:
    """A request being served."""

    index: int
    job: Job
    seq: Any  # every token it feeds: the prompt, then the output but its last token
    req: Request
    expected: list[int] | None
    #: Where the last whole page of `seq` ends: the request checkpoints its state there,
    #: because the state ``finish`` donates must sit at a page boundary (a conversation's
    #: next turn resumes from it).
    last_page: int = 0
    fed: int = 0
    loading: int | None = None  # id of its committed, unacknowledged load-back batch
    device_hit: int = 0
    host_hit: int = 0
    #: Device KV tokens its load-back made usable by restoring the state at their end.
    restored_hit: int = 0
    #: Tokens an L3 fetch landed on the host tier for it at its admission.
    l3_landed: int = 0
    #: Where waiting requests leave its prompt (page-aligned, past its match), known
    #: from the queue at its admission: its prefill stops and checkpoints there too.
    cuts: tuple[int, ...] = ()


@dataclass
class Counters:
    """What a replay counts beyond the cache's own `stats()`."""

    finished: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    device_hit_tokens: int = 0
    #: Tokens loaded back from the host tier that were there before the admission.
    host_hit_tokens: int = 0
    #: Device KV tokens a load-back made usable without copying them: it restored the
    #: state at their end from the host (their node's device state had been evicted).
    restored_hit_tokens: int = 0
    #: Tokens loaded back that an L3 fetch had just brought to the host tier.
    l3_hit_tokens: int = 0
    retractions: int = 0
    #: ``extend`` calls refused after one round of the batches the cache emitted that a
    #: second round served: one round is always enough (docs/contract.md rule 11), so
    #: anything but 0 is a bug of the cache.
    extend_second_rounds: int = 0
    rejected: int = 0
    #: Prefill cuts placed where a waiting request leaves a prompt (``lookahead``).
    queue_cuts: int = 0
    #: Times a request short of memory waited for the copies in flight before any
    #: retraction (or, alone, before its rejection), or short of a state slot for its
    #: end state (`end_state_waits`): load-backs hold their slots until their copies end.
    copy_waits: int = 0
    #: Checkpoints at a request's last whole page that found no state slot and were made
    #: again after the step's batches ran or copies in flight ended (`Scheduler._checkpoint`).
    end_state_waits: int = 0
    load_backs_refused: int = 0
    batches_refused: int = 0
    steps: int = 0
    forwards: int = 0
    #: Prompt tokens the model computed, a retracted request's recomputed ones included:
    #: with no retraction and no failed copy, ``prompt_tokens`` minus the hits.
    prefill_tokens: int = 0
    timeline: list[StepSample] = field(default_factory=list)
    #: ``(prompt_len, device_hit, load_hit)`` of each finished request, in order;
    #: ``load_hit``: the tokens its load-back made reusable (loaded back, L3's included,
    #: or restored: `restored_hit_tokens`).
    served: list[tuple[int, int, int]] = field(default_factory=list)
    #: ``(index, waited, overtaken)`` of each request's first admission, in order: the
    #: steps from its arrival to that admission, and how many requests that arrived
    #: after it were admitted before it.
    admissions: list[tuple[int, int, int]] = field(default_factory=list)
    #: L3 prefetches started (``l3_prefetch``), those still running after
    #: ``l3_prefetch_timeout`` seconds (called off), and the steps requests waited for
    #: them.
    l3_prefetches: int = 0
    l3_prefetch_timeouts: int = 0
    l3_prefetch_wait_steps: int = 0


class Scheduler:
    """Serves `Job`s through `cache`, `engine` and (optionally) the checksum model.

    Args:
        cache: The cache.
        engine: A `TransferEngine` (or `InstantEngine` without a model).
        model: The checksum model writing and reading the engine's storage; None for
            cache operations only.
        max_running: Requests served at once (prefilling or decoding).
        chunk_size: Most prefill tokens one request feeds in one step.
        step_tokens: Most tokens fed in one step, decode tokens included.
        load_back_quota: ``mem_quota`` of each load-back (default: a quarter of the
            device KV slots).
        timeline: Record a `StepSample` every this many steps (0: never).
        token_lists: Hand tokens to the cache as Python lists (as serving engines hold
            them) instead of NumPy arrays.
        branch_checkpoints: Cut prefill chunks at each request's ``branch_len`` and
            checkpoint its state there (False: only at chunk ends and the last whole
            page, to measure what branch-point checkpoints are worth).
        trace: Records each admission's state use and each state put in the tree,
            for the offline bound (`radixcache.serving.offline`); None: not recorded.
        schedule_policy: The admission order, ``"fcfs"`` or ``"lpm"`` (docs/serving.md,
            "Cache-aware admission").
        schedule_window: Waiting requests ``"lpm"`` ranks at each admission (the
            first ones in arrival order).
        max_overtakes: Under ``"lpm"``, a waiting request overtaken this many times
            goes next.
        l3: The L3 tier: before each admission, what the store holds of the prompt
            beyond both tiers is fetched to the host tier (`L3Tier.fetch`), and the
            admission loads it back like any host hit; None: no L3 tier.
        l3_prefetch: Fetch from the L3 tier in the background while the request waits
            (docs/serving.md, "A fleet behind a router: the L3 tier") instead of waiting
            at admission.
        l3_prefetch_timeout: Seconds a prefetch may run before it is called off.
        lookahead: Tell the cache the first this many waiting requests, in queue order,
            at each step after the queue changed (`HybridCache.expect`), and stop a
            prefill where one of them leaves its prompt (docs/serving.md, "Eviction told
            the waiting queue"); 0: never.

    Raises:
        ValueError: A bad argument (naming it).
    """

    def __init__(
        self,
        cache: HybridCache,
        engine: TransferEngine | InstantEngine,
        model: ChecksumModel | None = None,
        *,
        max_running: int = 32,
        chunk_size: int = 2048,
        step_tokens: int = 8192,
        load_back_quota: int | None = None,
        timeline: int = 0,
        token_lists: bool = False,
        branch_checkpoints: bool = True,
        trace: StateTrace | None = None,
        schedule_policy: SchedulePolicy = "fcfs",
        schedule_window: int = 128,
        max_overtakes: int = 128,
        l3: L3Tier | None = None,
        l3_prefetch: bool = False,
        l3_prefetch_timeout: float = 1.0,
        lookahead: int = 0,
    ) -> None:
        if lookahead < 0:
            raise ValueError(f"lookahead: must be >= 0, got {lookahead}")
        for name, value in (
            ("max_running", max_running),
            ("chunk_size", chunk_size),
            ("step_tokens", step_tokens),
            ("schedule_window", schedule_window),
        ):
            if value < 1:
                raise ValueError(f"{name}: must be >= 1, got {value}")
        if not 0.0 < l3_prefetch_timeout < float("inf"):  # NaN too
            raise ValueError(
                f"l3_prefetch_timeout: must be a number of seconds > 0, got {l3_prefetch_timeout}"
            )
        if max_overtakes < 0:
            raise ValueError(f"max_overtakes: must be >= 0, got {max_overtakes}")
        if schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(
                f"schedule_policy: must be one of {', '.join(SCHEDULE_POLICIES)}, "
                f"got {schedule_policy!r}"
            )
        if load_back_quota is not None and load_back_quota < 0:
            raise ValueError(f"load_back_quota: must be >= 0, got {load_back_quota}")
        self.cache = cache
        self.engine = engine
        self.model = model
        self.max_running = max_running
        self.chunk_size = chunk_size
        self.step_tokens = step_tokens
        self.quota = cache.kv_slots // 4 if load_back_quota is None else load_back_quota
        self.every = timeline
        self.counters = Counters()
        self.waiting: deque[tuple[int, Job]] = deque()
        self.running: list[_Live] = []
        self._loads: dict[int, _Live] = {}
        self._event: ComputeEvent | None = None
        self._hold = False  # set by a retraction, cleared when a request finishes
        self.token_lists = token_lists
        self.branch_checkpoints = branch_checkpoints
        self.trace = trace
        self.l3 = l3
        self.l3_prefetch = l3_prefetch and l3 is not None
        self.l3_prefetch_timeout = l3_prefetch_timeout
        # index: (fetch, the step and the time it started)
        self._fetching: dict[int, tuple[L3Fetch, int, float]] = {}
        self._landed: dict[int, int] = {}  # index: tokens its ended prefetch landed
        self._prepared: dict[int, tuple[Any, Any]] = {}
        self.schedule_policy = schedule_policy
        self.schedule_window = schedule_window
        self.max_overtakes = max_overtakes
        self._arrived: dict[int, int] = {}  # the step each waiting request arrived at
        self._overtaken: dict[int, int] = {}  # the waiting requests overtaken, how often
        self.lookahead = lookahead
        self._expecting = False  # the cache holds marks from `_expect`
        self._queue_moved = True  # the queue changed since `_expect` last ran

    # ------------------------------------------------------------------ driving

    def add(self, jobs: Sequence[Job]) -> None:
        """Queue `jobs`, arrived now (admitted in the order of `schedule_policy`)."""
        start = len(self.waiting) + self.counters.finished + self.counters.rejected
        self.waiting.extend((start + i, job) for i, job in enumerate(jobs))
        self._queue_moved = True
        # They can be admitted from the next step on: a wait counts the steps after it.
        self._arrived.update((start + i, self.counters.steps + 1) for i in range(len(jobs)))

    def run(self, progress: Callable[[int], None] | None = None) -> Counters:
        """Serve every queued job; `progress` gets the number finished after each step.

        Raises:
            RuntimeError: No request could make progress (a bug, reported loudly).
        """
        idle = 0
        while self.waiting or self.running:
            before = (self.counters.finished, self.counters.rejected, self.counters.forwards)
            self.step()
            after = (self.counters.finished, self.counters.rejected, self.counters.forwards)
            idle = idle + 1 if after == before else 0
            if idle > 1000:
                raise RuntimeError(
                    f"no progress in 1000 steps: {len(self.waiting)} waiting, "
                    f"{len(self.running)} running"
                )
            if progress is not None:
                progress(self.counters.finished + self.counters.rejected)
        self.drain()
        if self.l3_prefetch and self.l3 is not None:
            self.l3.close()  # its worker threads (made again when next needed)
        return self.counters

    def drain(self) -> None:
        """Wait for the compute and the copies still in flight, and end them."""
        if self.model is not None:
            self.model.stream.synchronize()
        self._end_loads(self.engine.synchronize())

    def stop(self) -> None:
        """Stop serving: end what is in flight, abort every running request, drop the queue.

        The running requests' slots go back to the cache and nothing of theirs is
        cached; the waiting jobs are dropped unserved.
        """
        self.drain()
        for live in list(self.running):
            self._drop(live)
        if self.l3 is not None:
            for fetch, _, _ in self._fetching.values():
                self.l3.cancel(fetch)
            self.l3.close()
        self._fetching.clear()
        self._landed.clear()
        self.waiting.clear()
        self._prepared.clear()
        self._arrived.clear()
        self._overtaken.clear()

    def step(self) -> None:
        """One scheduling step (docs/serving.md, "The scheduler")."""
        c = self.counters
        c.steps += 1
        self._end_loads(self.engine.poll())
        self._poll_fetches()
        self._admit()
        self._expect()
        checkpoints: list[_Live] = []
        finished: list[_Live] = []
        budget = self.step_tokens
        ready = [r for r in self.running if r.loading is None]
        decoding = [r for r in ready if r.fed >= len(r.job.prompt)][:budget]
        if decoding and self._decode(decoding, checkpoints, finished):
            budget -= len(decoding)
            ready = [r for r in ready if r.fed < len(r.job.prompt)]
        for live in sorted(ready, key=lambda r: r.fed < len(r.job.prompt)):
            if budget <= 0 or live not in self.running:
                continue
            prompt_len = len(live.job.prompt)
            end = live.fed + 1
            if live.fed < prompt_len:  # prefill: a chunk, cut at the branch point
                end = min(prompt_len, live.fed + self.chunk_size, live.fed + budget)
                branch = live.req.branch_len if self.branch_checkpoints else 0
                cuts = (branch, live.last_page, *live.cuts)
                for cut in cuts:
                    if live.fed < cut < end:
                        end = cut
            toks = live.seq[live.fed : end]
            slots = self._extend(live, toks)
            if slots is None:
                continue
            budget -= len(toks)
            self._fed(live, toks, slots, checkpoints, finished)
        if self.model is not None:
            event = self.model.stream.record()
            self.engine.after_compute(event)
        for live in checkpoints:
            if live in self.running:
                self._checkpoint(live)
                if self.trace is not None:
                    self.trace.offer(live.index, live.job.namespace, live.seq, live.fed, c.steps)
        for live in finished:
            if live in self.running:
                self._finish(live)
        self._run_batches()
        if self.model is not None:
            if self._event is not None:
                self._event.synchronize()  # the compute runs at most one step behind
            self._event = event
        if self.every and c.steps % self.every == 0:
            c.timeline.append(self.sample())

    def _checkpoint(self, live: _Live) -> None:
        """Checkpoint `live`; at its last whole page, keep its end state if it can be had.

        A conversation's next turn resumes from the state there (`finish`, at an
        unaligned length, places none). When the checkpoint finds no state slot, the
        batches this step emitted so far are run (a backup pins the states it reads
        until it ends) and the copies in flight waited for (a load-back holds two state
        slots until its copies end); if any ended, the checkpoint is made again. This
        step's compute is enqueued and its event handed to the engine already, so every
        copy waits for it, and the checkpoint's copy reads the state of exactly these
        tokens, before the next step's forward overwrites it.
        """
        cache = self.cache
        end = live.fed == live.last_page and cache.mamba_slots > 0
        skipped = cache.stats()["checkpoint_states_skipped"] if end else 0
        cache.checkpoint(live.req)
        if not end or cache.stats()["checkpoint_states_skipped"] == skipped:
            return
        ran = self._run_batches()
        if self._wait_copies() or ran:
            self.counters.end_state_waits += 1
            cache.checkpoint(live.req)

    def sample(self) -> StepSample:
        """Return the state now, as recorded in the timeline."""
        c, cache = self.counters, self.cache
        host = cache.host_kv_slots
        return StepSample(
            step=c.steps,
            finished=c.finished,
            prompt_tokens=c.prompt_tokens,
            device_hit_tokens=c.device_hit_tokens,
            host_hit_tokens=c.host_hit_tokens,
            kv_used=1 - cache.available_kv() / cache.kv_slots,
            mamba_used=(1 - cache.available_mamba() / cache.mamba_slots)
            if cache.mamba_slots
            else 0.0,
            host_kv_used=(cache.stats()["host_kv_cached_tokens"] / host) if host else 0.0,
        )

    # ------------------------------------------------------------------ admission

    def _reserved(self) -> int:
        """KV tokens the running requests will still take."""
        return sum(len(r.seq) - r.fed for r in self.running)

    def _admit(self) -> None:
        cache = self.cache
        if self._hold and self.running:
            return  # memory ran out: no admission until a request finished
        limit = self.max_running
        if cache.mamba_slots:
            # Every running request holds a state slot, and a load-back takes a second
            # one for the node: more requests than that could only retract each other.
            limit = min(limit, max(1, cache.mamba_slots - 2))
        # A request whose prefetch runs holds its place among the running ones: it is
        # admitted as soon as the fetch ends.
        while self.waiting and len(self.running) + len(self._fetching) < limit:
            pos = self._next()
            if pos < 0:  # every waiting request is prefetching
                if self.running or not self._wait_fetch():
                    return
                continue
            index, job = self.waiting[pos]
            need = len(job.prompt) + len(job.output)
            room = cache.available_kv() + cache.evictable_size() - self._reserved()
            if self.running and need > room:
                return
            tokens, seq = self._prepare(index, job)
            landed = 0
            if self.l3 is not None and not self.l3_prefetch:
                # What the store has beyond both tiers lands on the host first.
                landed = self.l3.fetch(tokens, namespace=job.namespace)
            elif self.l3 is not None and index not in self._landed:
                fetch = self.l3.start_fetch(tokens, namespace=job.namespace)
                self.counters.l3_prefetches += fetch is not None
                if fetch is not None and not self.l3.poll(fetch):
                    self._fetching[index] = (fetch, self.counters.steps, time.perf_counter())
                    continue  # it waits in the queue; the next request may go
                self._landed[index] = fetch.tokens_landed if fetch is not None else 0
            if self.l3_prefetch:
                landed = self._landed.get(index, 0)
            req = cache.admit(tokens, namespace=job.namespace, priority=job.priority)
            if req is None and not self.running:
                cache.evict(mamba_states=1)
                self._run_batches()  # under write-back, evicted slots free once backed up
                req = cache.admit(tokens, namespace=job.namespace, priority=job.priority)
                if req is None and self._wait_copies():
                    req = cache.admit(tokens, namespace=job.namespace, priority=job.priority)
            if req is None:
                if not self.running:
                    self._dequeue(pos, admitted=False)
                    self.counters.rejected += 1
                    continue
                return
            self._dequeue(pos, admitted=True)
            self._landed.pop(index, None)
            expected = None
            if self.model is not None:
                expected = self.model.ref.samples(job.prompt, len(job.output), job.output)
            ps = cache.page_size
            live = _Live(index, job, seq, req, expected, last_page=len(seq) // ps * ps)
            live.l3_landed = landed
            if self.lookahead and self.branch_checkpoints and cache.mamba_slots:
                live.cuts = self._queue_cuts(job, req.prefix_len)
                self.counters.queue_cuts += len(live.cuts)
            self.running.append(live)
            self._run_batches()  # the state's copy-on-write, before any compute reads it
            live.fed = live.device_hit = req.prefix_len  # a failed copy-on-write drops it
            if self.trace is not None:
                self.trace.use(index, job.namespace, seq, req.branch_len, self.counters.steps)
            if req.host_len > 0:
                self._load_back(live)

    def _queue_cuts(self, job: Job, start: int) -> tuple[int, ...]:
        """Return where the first ``lookahead`` waiting prompts leave `job`'s prompt.

        Each point is the longest common prefix with one waiting prompt of the same
        namespace, rounded down to a page, past `start` (what the request matched): a
        branch point the tree does not know yet (a waiting prompt this one holds: where it
        would resume). A waiting prompt that holds all of this one (a later turn) gives
        none: this request's end state serves it.
        """
        p, ps = job.prompt, self.cache.page_size
        cuts = set()
        for _, other in itertools.islice(self.waiting, self.lookahead):
            q = other.prompt
            if other.namespace != job.namespace or not len(q) or q[0] != p[0]:
                continue
            n = min(len(p), len(q))
            differ = np.flatnonzero(p[:n] != q[:n])
            if len(differ):
                cut = int(differ[0]) // ps * ps
            elif n < len(p):  # this prompt holds it: it resumes before its last token
                cut = (n - 1) // ps * ps
            else:
                continue  # it holds this whole prompt: this request's end state serves it
            if cut > start:
                cuts.add(cut)
        return tuple(sorted(cuts))

    def _expect(self) -> None:
        """Tell the cache which requests come next (``lookahead``).

        docs/serving.md, "Eviction told the waiting queue", says why. Only after the queue
        changed (an admission, a retraction) or a load-back ended: the states a checkpoint
        or a finish places are ranked by the cache itself.
        """
        if not self.lookahead or not self._queue_moved or not (self.waiting or self._expecting):
            return
        self._queue_moved = False
        head = list(itertools.islice(self.waiting, self.lookahead))
        # As NumPy arrays whatever `token_lists` says: a copy each, not an item each.
        prompts = [job.prompt[:-1] if len(job.output) else job.prompt for _, job in head]
        self.cache.expect(prompts, namespaces=[job.namespace for _, job in head])
        self._expecting = bool(head)

    def _next(self) -> int:
        """Return the position in `waiting` of the request to admit next.

        ``"fcfs"``: the first. ``"lpm"``: the first one overtaken `max_overtakes` times,
        else the one of the first `schedule_window` that reuses the most cached tokens
        (the first of those in a tie). Requests whose L3 prefetch is running are passed
        over (-1: every waiting request is).
        """
        if self.schedule_policy == "fcfs":
            waiting = enumerate(self.waiting)
            return next((pos for pos, (i, _) in waiting if i not in self._fetching), -1)
        window = [
            (pos, index, job)
            for pos, (index, job) in enumerate(
                itertools.islice(self.waiting, self.schedule_window + len(self._fetching))
            )
            if index not in self._fetching
        ][: self.schedule_window]
        for pos, index, _ in window:
            if self._overtaken.get(index, 0) >= self.max_overtakes:
                return pos
        best, most = -1, -1
        for pos, index, job in window:
            tokens, _ = self._prepare(index, job)
            device, host, _ = self.cache.peek_prefix(tokens, namespace=job.namespace)
            if device + host > most:
                best, most = pos, device + host
        return best

    def _poll_fetches(self) -> None:
        """Advance the L3 prefetches (without waiting); call off those past their time."""
        if not self._fetching or self.l3 is None:
            return
        for index, (fetch, step, started) in list(self._fetching.items()):
            if self.l3.poll(fetch):
                self._fetched(self.l3, index, fetch, step)
            elif time.perf_counter() - started >= self.l3_prefetch_timeout:
                self._fetched(self.l3, index, fetch, step, cancel=True)

    def _wait_fetch(self) -> bool:
        """Wait for the oldest prefetch, with nothing running; False when none is in flight.

        Waits until its timeout, then calls it off.
        """
        if not self._fetching or self.l3 is None:
            return False
        index = next(iter(self._fetching))
        fetch, step, started = self._fetching[index]
        left = self.l3_prefetch_timeout - (time.perf_counter() - started)
        done = self.l3.poll(fetch, max(left, 0.0))
        self._fetched(self.l3, index, fetch, step, cancel=not done)
        return True

    def _fetched(
        self, l3: L3Tier, index: int, fetch: L3Fetch, step: int, *, cancel: bool = False
    ) -> None:
        """Let an ended prefetch's request be admitted; `cancel`: call the fetch off first."""
        c = self.counters
        if cancel:
            l3.cancel(fetch)
            c.l3_prefetch_timeouts += 1
        del self._fetching[index]
        self._landed[index] = fetch.tokens_landed
        c.l3_prefetch_wait_steps += c.steps - step

    def _dequeue(self, pos: int, *, admitted: bool) -> None:
        """Take the request at `pos` out of `waiting`: `admitted`, or rejected.

        The ones before it are overtaken once more; its first admission is recorded (a
        retracted request queues again, without an arrival).
        """
        index, _ = self.waiting[pos]
        self._queue_moved = True
        for before, _ in itertools.islice(self.waiting, pos):
            self._overtaken[before] = self._overtaken.get(before, 0) + 1
        del self.waiting[pos]
        self._prepared.pop(index, None)
        overtaken = self._overtaken.pop(index, 0)
        arrived = self._arrived.pop(index, None)
        if admitted and arrived is not None:
            waited = self.counters.steps - arrived
            self.counters.admissions.append((index, waited, overtaken))

    def _prepare(self, index: int, job: Job) -> tuple[Any, Any]:
        """Return the tokens to admit with and every token the request feeds (cached)."""
        got = self._prepared.get(index)
        if got is None:
            # At least the last prompt token is always computed: it gives the first sample.
            tokens = job.prompt[:-1] if len(job.output) else job.prompt
            seq = np.concatenate([job.prompt, job.output[:-1]]) if len(job.output) else job.prompt
            if self.token_lists:
                tokens, seq = tokens.tolist(), seq.tolist()
            got = self._prepared[index] = (tokens, seq)
        return got

    def _load_back(self, live: _Live) -> None:
        cache, req = self.cache, live.req
        lb = cache.load_back(req, mem_quota=self.quota)
        if lb is None and cache.write_policy == "write_back":
            self._run_batches()  # room frees once the backups of evicted nodes complete
            lb = cache.load_back(req, mem_quota=self.quota)
        if lb is None:
            return
        with lb:  # left without commit: everything it took goes back
            try:
                self.engine.submit(lb.batch)
            except Refused:
                self.counters.load_backs_refused += 1
                return
            if lb.batch.outcome == "failed":
                return
            lb.commit()
            live.loading = lb.batch.id
            live.host_hit = lb.kv_tokens
            self._loads[lb.batch.id] = live

    def _end_loads(self, ended: list[TransferBatch]) -> None:
        for batch in ended:
            live = self._loads.pop(batch.id, None)
            self._queue_moved = True
            if live is None:
                continue  # its request was retracted meanwhile
            live.loading = None
            live.fed = live.req.prefix_len
            if batch.outcome == "failed":
                live.host_hit = 0  # its prefix dropped back: nothing reused through it
            # The device KV that the state it restored made usable (not copied).
            live.restored_hit = max(0, live.fed - live.device_hit - live.host_hit)

    # ------------------------------------------------------------------ compute

    def _decode(self, lives: list[_Live], checkpoints: list[_Live], finished: list[_Live]) -> bool:
        """Feed one decode token for each of `lives` in one ``extend_batch`` call.

        Returns False (nothing fed) when the pool cannot give the whole step: they then
        extend one by one, with retraction.
        """
        toks = [r.seq[r.fed] for r in lives]
        arg: Any = toks if self.token_lists else np.asarray(toks, dtype=np.uint32)
        slots = self.cache.extend_batch([r.req for r in lives], arg)
        if slots is None:
            return False
        for i, live in enumerate(lives):
            self._fed(
                live, live.seq[live.fed : live.fed + 1], slots[i : i + 1], checkpoints, finished
            )
        return True

    def _fed(
        self,
        live: _Live,
        toks: Any,
        slots: np.ndarray,
        checkpoints: list[_Live],
        finished: list[_Live],
    ) -> None:
        """Enqueue the forward of `toks` and note what the step must cache after it."""
        end = live.fed + len(toks)
        self._forward(live, toks, slots, end)
        live.fed = end
        prompt_len = len(live.job.prompt)
        if end == len(live.seq):
            finished.append(live)
        elif end < prompt_len or end == live.last_page:
            checkpoints.append(live)  # a prefill chunk, or the last whole page
        elif end == prompt_len and (not self.cache.mamba_slots or end % self.cache.page_size):
            # The whole prompt, so that requests admitted while this one decodes reuse
            # it (as SGLang does); in a hybrid cache only where that caches KV alone: a
            # state forked there would serve only the same prompt again, and would take
            # a slot from states that branch points share.
            checkpoints.append(live)

    def _extend(self, live: _Live, toks: np.ndarray) -> np.ndarray | None:
        """Slots for `toks`; retracts newer requests when memory runs out."""
        cache = self.cache
        slots = cache.extend(live.req, toks)
        if slots is None:
            self._run_batches()  # under write-back, slots free when backups complete
            slots = cache.extend(live.req, toks)
            if slots is None and self._run_batches():
                slots = cache.extend(live.req, toks)
                if slots is not None:
                    self.counters.extend_second_rounds += 1
        while slots is None:
            # The copies in flight hold slots until they end (a load-back's, a retracted
            # request's): waiting for them costs less than recomputing a victim.
            if self._wait_copies():
                slots = cache.extend(live.req, toks)
                continue
            victims = [r for r in self.running if r is not live]
            if not victims:
                # Alone and still too big for the pool: it can never be served.
                self._drop(live)
                self.counters.rejected += 1
                return None
            victim = victims[-1]
            self._drop(victim)
            self.waiting.appendleft((victim.index, victim.job))
            self.counters.retractions += 1
            self._hold = True
            self._run_batches()
            slots = cache.extend(live.req, toks)
        return slots

    def _wait_copies(self) -> bool:
        """Wait for the copies in flight and end them; returns whether any were.

        Load-backs hold their slots until their copies end (a retracted request's too):
        a request must not be turned away, nor another retracted, for memory that is
        only on its way back.
        """
        ended = self.engine.synchronize()
        self._end_loads(ended)
        self._run_batches()
        self.counters.copy_waits += bool(ended)
        return bool(ended)

    def _drop(self, live: _Live) -> None:
        self._queue_moved = True
        self.running.remove(live)
        if live.loading is not None:
            self._loads.pop(live.loading, None)
        self.cache.abort(live.req)

    def _forward(self, live: _Live, toks: np.ndarray, slots: np.ndarray, end: int) -> None:
        self.counters.forwards += 1
        prompt_len = len(live.job.prompt)
        self.counters.prefill_tokens += max(0, min(end, prompt_len) - (end - len(toks)))
        if self.model is None:
            return
        sample = end - prompt_len
        read = expect = None
        if sample >= 0:
            read = live.req.kv_indices
            assert live.expected is not None
            expect = live.expected[sample]
        req = live.req
        swa = (req.swa_indices, req.swa_start) if self.model.window else None
        self.model.forward(end - len(toks), toks, slots, req.mamba_slot, read, expect, swa=swa)

    def _finish(self, live: _Live) -> None:
        c = self.counters
        self._hold = False
        self.running.remove(live)
        self.cache.finish(live.req)
        if self.trace is not None:
            self.trace.offer(live.index, live.job.namespace, live.seq, len(live.seq), c.steps)
            self.trace.done(live.index)
        c.finished += 1
        c.prompt_tokens += len(live.job.prompt)
        c.output_tokens += len(live.job.output)
        c.device_hit_tokens += live.device_hit
        l3 = min(live.l3_landed, live.host_hit)  # the deepest part of what was loaded
        c.l3_hit_tokens += l3
        c.host_hit_tokens += live.host_hit - l3
        c.restored_hit_tokens += live.restored_hit
        loads = live.host_hit + live.restored_hit
        c.served.append((len(live.job.prompt), live.device_hit, loads))

    def _run_batches(self) -> int:
        """Run every batch the cache emitted; returns how many."""
        batches = self.cache.take_batches()
        for batch in batches:
            self._run(batch)
        return len(batches)

    def _run(self, batch: TransferBatch) -> None:
        try:
            if self.l3_prefetch and batch.kind == "l3_put":
                self.engine.submit(batch)  # written in the background; a later poll ends it
            else:
                self.engine.run(batch)
        except Refused as e:  # never started: the scheduler fails it (a miss)
            self.counters.batches_refused += 1
            batch.fail(str(e))
