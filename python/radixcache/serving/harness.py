"""`replay`: serve a workload end to end and report what the cache did, checked by the oracle."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Union

from .._core import HybridCache, InvariantError
from ..engine import TransferEngine
from ..l3 import L3Tier, open_store
from .flops import ModelShape, compute_saved_ratio
from .model import ChecksumModel, model_name
from .offline import Event, StateTrace, bound
from .scheduler import (
    Counters,
    FaultyEngine,
    InstantEngine,
    SchedulePolicy,
    Scheduler,
    StepSample,
)
from .workloads import Job

__all__ = [
    "ReplayConfig",
    "Server",
    "attention_only",
    "attention_only_hit_rate",
    "clear",
    "compute_saved",
    "deal",
    "full_attention",
    "l3_report",
    "replay",
    "replay_fleet",
    "without",
]

#: An eviction policy name the cache takes (``"state_value"`` is ``"state-value"``).
PolicyName = Literal["lru", "lfu", "priority", "state-value", "state_value"]
#: ``eviction_policy``: one name, or one per component (``{"kv": ..., "mamba": ...,
#: "swa": ...}``).
EvictionPolicy = Union[PolicyName, dict[str, PolicyName]]

CALLED_OFF = ("nothing", "busy", "quota", "room", "state", "released", "swa")


@dataclass
class ReplayConfig:
    """The cache, scheduler and fault settings of a replay (the CLI's flags).

    The defaults size the pools as a deployment would, scaled down to the built-in
    workloads: one Mamba state costs about as much memory as 1,024 KV tokens, and the
    device gives both the same memory (256 states beside 262,144 KV tokens); the host
    tier is four times the device. `write_through_threshold` is given to the cache only
    when set (None: the cache's default, 2, under ``write_through_selective``; the cache
    refuses a threshold with any other policy). `eviction_policy` is the cache's
    (``"lru"``, ``"lfu"``, ``"priority"``, ``"state-value"`` or a dict per component;
    the replay's default is ``"state-value"``, which measures best on its workloads,
    while the cache's own default is ``"lru"``); the attention-only comparison uses it
    too. `shape` is the model whose prefill
    compute ``compute_saved_ratio`` counts (`radixcache.serving.flops`);
    `offline_bound` records the state uses and reports the offline bound
    (`radixcache.serving.offline`). `schedule_policy`, `schedule_window` and
    `max_overtakes` are the scheduler's admission order (`Scheduler`; the comparison
    replays use it too); `lookahead` the waiting requests it tells eviction of
    (`HybridCache.expect`; 0: none; the comparison replays too). `oracle=False`
    replays without the checksum model and its storage, every batch completing at
    once: the scheduler makes the same cache calls, so the hit rates are the same,
    several times faster, but no sample is checked (``samples_checked`` and
    ``mismatches`` are 0) and no failure is injected.

    The model's layers follow the pools (`radixcache.serving.model.MODELS`): Mamba layers
    with ``mamba_slots > 0``, sliding-window attention (SWA) layers of window
    `swa_window` tokens with ``swa_slots > 0`` (both or neither; `swa_layers` of them),
    whose host tier is `host_swa_slots` (with a host tier; dropped without one).

    `l3` is the URL of an L3 store (``redis://HOST:PORT``, ``redis+cluster://...``,
    ``file:///DIR``, ``mooncake://HOST:PORT?...``; `radixcache.l3.open_store`) shared
    with other caches: the cache writes its host pages there and fetches what a prompt's
    admission finds there beyond both tiers (`radixcache.l3.L3Tier`, skipping an uncached
    part under `l3_min_tokens`).
    It needs the oracle (the bytes are the checksum model's). `l3_write` says when host
    pages are written there: ``"backup"`` (as soon as they are backed up) or
    ``"host_eviction"`` (only when host eviction deletes them); only with `l3`.
    `l3_prefetch` fetches in the background while the request waits in the queue
    (`Scheduler`, "L3 prefetch"), calling off a fetch after `l3_prefetch_timeout`
    seconds; only with `l3`. The tier names its objects by the model (`l3_model`: the
    checksum model's seed) and by `tp_rank` of `tp_size`: a server that is rank
    ``tp_rank`` of a tensor-parallel group holds other heads, so its checksum model's
    bytes are another function of the seed (``seed ^ (tp_rank << 32)``; rank 0 is the
    seed's own), and its objects other keys. `events`
    turns the cache's KV events on (with page hashes), for a caller that takes them
    (`radixcache.events`).
    """

    kv_slots: int = 262_144
    mamba_slots: int = 256
    host_kv_slots: int = 1_048_576
    host_mamba_slots: int = 1024
    page_size: int = 16
    write_policy: str = "write_through"
    write_through_threshold: int | None = None
    inject_failures: float = 0.0
    seed: int = 0
    max_running: int = 32
    chunk_size: int = 2048
    step_tokens: int = 8192
    load_back_quota: int | None = None
    layers: int = 2
    mamba_layers: int = 2
    timeline: int = 0
    attention_only: bool = True
    branch_checkpoints: bool = True
    eviction_policy: EvictionPolicy = "state-value"
    shape: ModelShape = field(default_factory=ModelShape)
    offline_bound: bool = False
    oracle: bool = True
    swa_slots: int = 0
    swa_window: int = 0
    host_swa_slots: int = 0
    swa_layers: int = 2
    schedule_policy: SchedulePolicy = "fcfs"
    schedule_window: int = 128
    max_overtakes: int = 128
    lookahead: int = 0
    l3: str | None = None
    l3_min_tokens: int = 64
    l3_write: Literal["backup", "host_eviction"] = "backup"
    l3_prefetch: bool = False
    l3_prefetch_timeout: float = 1.0
    tp_rank: int = 0
    tp_size: int = 1
    events: bool = False

    @property
    def l3_model(self) -> str:
        """The model identity the L3 tier names objects by (`radixcache.l3.L3Identity`).

        The checksum model's bytes are a function of its seed (its "weights"): replays
        with another `seed` are another model, whose pages are never read as this one's.
        """
        return f"radixcache-checksum-model seed={self.seed}"

    def model_shape(self) -> ModelShape:
        """Return the shape whose compute ``compute_saved_ratio`` counts for this model.

        `shape`; with SWA layers (``swa_slots > 0``) and none in `shape`, the same share
        of its attention layers as SWA layers of `swa_window` positions as the checksum
        model has (`swa_layers` of ``layers + swa_layers``: half by default, as gpt-oss
        alternates them). The attention-only replay counts with `shape` itself.
        """
        if not self.swa_slots or self.shape.swa_layers:
            return self.shape
        share = self.swa_layers / (self.layers + self.swa_layers)
        return self.shape.with_swa(self.swa_window, share)

    def cache(self, *, hybrid: bool = True, swa: bool = True, l3: bool = True) -> HybridCache:
        """Make a cache with these settings.

        `hybrid=False`: the same without states; `swa=False`: the same with the SWA
        layers as full attention (no SWA pool: every token's KV stays); `l3=False`:
        without the L3 tier even when `l3` is set.
        """
        host = self.host_kv_slots
        return HybridCache(
            kv_slots=self.kv_slots,
            page_size=self.page_size,
            mamba_slots=self.mamba_slots if hybrid else 0,
            host_kv_slots=host,
            host_mamba_slots=self.host_mamba_slots if (hybrid and host and self.mamba_slots) else 0,
            write_policy=self.write_policy,
            write_through_threshold=self.write_through_threshold,
            eviction_policy=self.eviction_policy,
            swa_slots=self.swa_slots if swa else 0,
            swa_window=self.swa_window if swa else 0,
            host_swa_slots=self.host_swa_slots if (swa and host and self.swa_slots) else 0,
            page_hashes=self.events or (l3 and self.l3 is not None),
            events=self.events,
            l3=l3 and self.l3 is not None,
            l3_write=self.l3_write if (l3 and self.l3 is not None) else None,
        )

    def scheduler(
        self,
        cache: HybridCache,
        engine: TransferEngine | InstantEngine,
        model: Any,
        *,
        kind: type[Scheduler] = Scheduler,
        **overrides: Any,
    ) -> Scheduler:
        """Make the scheduler (or a subclass, `kind`) with these settings.

        `overrides` replace or add `Scheduler` keyword arguments.
        """
        kwargs: dict[str, Any] = {
            "max_running": self.max_running,
            "chunk_size": self.chunk_size,
            "step_tokens": self.step_tokens,
            "load_back_quota": self.load_back_quota,
            "timeline": self.timeline,
            "branch_checkpoints": self.branch_checkpoints,
            "schedule_policy": self.schedule_policy,
            "schedule_window": self.schedule_window,
            "max_overtakes": self.max_overtakes,
            "lookahead": self.lookahead,
            "l3_prefetch": self.l3_prefetch,
            "l3_prefetch_timeout": self.l3_prefetch_timeout,
        }
        kwargs.update(overrides)
        return kind(cache, engine, model, **kwargs)


def clear(cache: HybridCache, engine: TransferEngine | InstantEngine) -> bool:
    """Evict everything from both tiers (running the backups write-back asks for first).

    Returns:
        Whether every pool is then back to full: nothing was leaked.
    """

    def run_batches() -> None:
        if isinstance(engine, TransferEngine):
            engine.run_pending()
        else:
            for b in cache.take_batches():
                engine.run(b)

    while True:
        ev = cache.evict(kv_tokens=cache.kv_slots, mamba_states=cache.mamba_slots)
        run_batches()
        if ev.kv_tokens == 0 and ev.mamba_states == 0:
            break
    cache.evict_host(kv_tokens=cache.host_kv_slots, mamba_states=cache.host_mamba_slots)
    # Under l3_write="host_eviction" that emitted the l3_puts of what the store lacked:
    # their host slots drain until they have run.
    run_batches()
    s = cache.stats()
    return (
        cache.available_kv() == cache.kv_slots
        and cache.available_mamba() == cache.mamba_slots
        and s["host_kv_free_slots"] == cache.host_kv_slots
        and s["host_mamba_free_slots"] == cache.host_mamba_slots
        and s["swa_free_slots"] == cache.swa_slots
        and s["host_swa_free_slots"] == cache.host_swa_slots
    )


def _rate(c: Counters) -> float:
    """`c`'s device hit rate: device hit tokens over prompt tokens."""
    return c.device_hit_tokens / c.prompt_tokens if c.prompt_tokens else 0.0


def without(jobs: Sequence[Job], config: ReplayConfig, *, states: bool, swa: bool) -> Counters:
    """Replay `jobs` on `config`'s pools without some layers (no model, no faults).

    The comparison replays: same pools, same scheduler, every batch completing at once.
    `states=False` drops the Mamba layers, `swa=False` makes the SWA layers full
    attention (see `ReplayConfig.cache`). Returns its counters.
    """
    cache = config.cache(hybrid=states, swa=swa, l3=False)
    sched = config.scheduler(cache, InstantEngine(cache), None)
    sched.add(jobs)
    return sched.run()


def attention_only(jobs: Sequence[Job], config: ReplayConfig) -> Counters:
    """Replay `jobs` with full attention only (no states, no SWA); its counters."""
    return without(jobs, config, states=False, swa=False)


def full_attention(jobs: Sequence[Job], config: ReplayConfig) -> Counters:
    """Replay `jobs` with the SWA layers as full attention, states kept; its counters."""
    return without(jobs, config, states=True, swa=False)


def attention_only_hit_rate(jobs: Sequence[Job], config: ReplayConfig) -> float:
    """Replay `jobs` with full attention only (no model, no faults); its device hit rate."""
    return _rate(attention_only(jobs, config))


def compute_saved(c: Counters, shape: ModelShape) -> float:
    """`c`'s compute saved: the tokens reused from the device or through a load-back.

    A load-back's are those it loaded from the host and the device KV whose state it
    restored.
    """
    return compute_saved_ratio(((p, d + h) for p, d, h in c.served), shape)


class Server:
    """One serving machine of a replay: its cache, storage, engine, model and scheduler.

    With ``config.l3`` it has an L3 tier on its own client of the store; the store
    is shared with every other server opened on the same URL.
    """

    def __init__(self, config: ReplayConfig, *, seed_offset: int = 0) -> None:
        if config.l3 is None and config.l3_write != "backup":
            raise ValueError(
                f"l3_write: {config.l3_write!r} given without an L3 store; pass l3 (its URL)"
            )
        if config.l3 is None and config.l3_prefetch:
            raise ValueError("l3_prefetch: given without an L3 store; pass l3 (its URL)")
        self.config = config
        self.cache = cache = config.cache()
        self.model: ChecksumModel | None = None
        self.l3: L3Tier | None = None
        self.engine: FaultyEngine | InstantEngine
        if config.oracle:
            storage = ChecksumModel.storage_for(
                cache,
                layers=config.layers,
                mamba_layers=config.mamba_layers,
                swa_layers=config.swa_layers,
            )
            if config.l3 is not None:
                store = open_store(config.l3)
                self.l3 = L3Tier(
                    cache,
                    storage,
                    store,
                    model=config.l3_model,
                    tp_rank=config.tp_rank,
                    tp_size=config.tp_size,
                    min_tokens=config.l3_min_tokens,
                )
            self.engine = FaultyEngine(
                cache,
                storage,
                config.inject_failures,
                seed=config.seed + 1 + seed_offset,
                l3=self.l3,
            )
            self.model = ChecksumModel(cache, storage, seed=config.seed ^ (config.tp_rank << 32))
        elif config.l3 is not None:
            raise ValueError(
                "l3: the L3 tier moves the checksum model's bytes; it needs oracle=True"
            )
        else:
            self.engine = InstantEngine(cache)
        trace = StateTrace(cache) if config.offline_bound and cache.mamba_slots else None
        self.sched = config.scheduler(cache, self.engine, self.model, trace=trace, l3=self.l3)


def _sampling(
    server: Server, out: list[dict[str, Any]], progress: Callable[[int], None] | None
) -> Callable[[int], None]:
    """Wrap `progress` to record the L3 tier's state at most every 0.2 s into `out`.

    Each sample: ``time`` (Unix seconds), ``finished``, ``l3_hit_tokens``,
    ``l3_errors`` and ``l3_breaker``, so that a run whose store went away and came
    back shows when hits stopped and resumed.
    """
    last = [0.0]

    def sample(done: int) -> None:
        now = time.time()
        if now - last[0] >= 0.2 and server.l3 is not None:
            last[0] = now
            out.append(
                {
                    "time": now,
                    "finished": done,
                    "l3_hit_tokens": server.sched.counters.l3_hit_tokens,
                    "l3_errors": server.l3.counters.errors,
                    "l3_breaker": server.l3.breaker.state,
                }
            )
        if progress is not None:
            progress(done)

    return sample


def l3_report(tier: L3Tier | None, c: Counters) -> dict[str, Any]:
    """Return the L3 tier's keys of the report (zeros and None without one).

    ``l3_hit_tokens``: tokens loaded back that an L3 fetch had just brought to the
    host tier; ``hit_rate``: device, host and L3 hit tokens over prompt tokens;
    ``l3_eviction_puts``: puts host eviction emitted (``l3_write="host_eviction"``).
    """
    p = c.prompt_tokens
    out: dict[str, Any] = {
        "l3_hit_tokens": c.l3_hit_tokens,
        "l3_hit_rate": c.l3_hit_tokens / p if p else 0.0,
        "hit_rate": (c.device_hit_tokens + c.host_hit_tokens + c.l3_hit_tokens) / p if p else 0.0,
        "l3_prefetches": c.l3_prefetches,
        "l3_prefetch_timeouts": c.l3_prefetch_timeouts,
        "l3_prefetch_wait_steps": c.l3_prefetch_wait_steps,
    }
    if tier is None:
        out.update(dict.fromkeys(L3_KEYS))
    else:
        out.update(tier.report())
        out["l3_eviction_puts"] = tier.cache.stats()["l3_eviction_puts"]
    return out


#: The L3 tier's report keys (`L3Tier.report`), None without an L3 tier.
L3_KEYS = (
    "l3_lookups",
    "l3_fetches",
    "l3_fetches_cancelled",
    "l3_landed_pages",
    "l3_missed_pages",
    "l3_corrupt_objects",
    "l3_missing_objects",
    "l3_foreign_objects",
    "l3_stored_objects",
    "l3_bytes_fetched",
    "l3_bytes_stored",
    "l3_fetch_gbps",
    "l3_put_gbps",
    "l3_errors",
    "l3_error_causes",
    "l3_first_error",
    "l3_breaker",
    "l3_breaker_trips",
    "l3_eviction_puts",
)


def replay(
    jobs: Sequence[Job],
    config: ReplayConfig | None = None,
    *,
    progress: Callable[[int], None] | None = None,
    events: list[Event] | None = None,
) -> tuple[dict[str, Any], list[StepSample]]:
    """Serve `jobs` through the scheduler, the checksum model and a `TransferEngine`.

    `events`, when given with ``config.offline_bound``, receives the recorded state
    uses and offers (to simulate other rules on them: `radixcache.serving.offline`).

    Returns:
        The report (the ``replay --json`` keys of docs/contract.md and more) and the timeline.
    """
    config = config or ReplayConfig()
    server = Server(config)
    cache, engine, model, sched = server.cache, server.engine, server.model, server.sched
    trace = sched.trace
    sched.add(jobs)
    l3_timeline: list[dict[str, Any]] = []
    if server.l3 is not None:
        progress = _sampling(server, l3_timeline, progress)
    start = time.perf_counter()
    c = sched.run(progress)
    seconds = time.perf_counter() - start
    try:
        cache.audit()
        audit = "pass"
    except InvariantError as e:
        audit = str(e)
    s = cache.stats()
    leftover = len(cache.pending_batches())
    if isinstance(engine, FaultyEngine):
        engine.rate = 0.0  # clearing is not under test: no faults injected into its backups
    full = clear(cache, engine) and leftover == 0
    try:
        cache.audit()
    except InvariantError as e:
        audit = audit if audit != "pass" else f"after clearing: {e}"
    attn: Counters | None = None
    if not cache.mamba_slots and not cache.swa_slots:  # itself the attention-only one
        attn = c
    elif config.attention_only:
        attn = attention_only(jobs, config)
    # An SWA model against itself with full attention: for "swa" that is attention-only.
    full_attn: Counters | None = None
    if cache.swa_slots and config.attention_only:
        full_attn = full_attention(jobs, config) if cache.mamba_slots else attn
    shapes = (config.model_shape(), config.shape)
    out = report(c, s, engine, model, seconds, audit, full, attn, shapes)
    out.update(l3_report(server.l3, c))
    out["l3_timeline"] = l3_timeline if server.l3 is not None else None
    out["eviction_policy"] = cache.eviction_policy
    out.update(schedule_report(config, c))
    out.update(swa_report(cache, s, c, full_attn))
    out.update(offline_report(trace, c, out["attention_only_hit_rate"]))
    if trace is not None and events is not None:
        events.extend(trace.events)
    return out, c.timeline


def deal(jobs: Sequence[Job], servers: int, k: int) -> list[Job]:
    """Return the jobs a round-robin router sends to server `k` of `servers`."""
    return list(jobs[k::servers])


def _run_fleet(scheds: Sequence[Scheduler], progress: Callable[[int], None] | None) -> None:
    """Step every scheduler in turn until all are done, as machines running side by side.

    Raises:
        RuntimeError: No request of any server made progress in 1000 rounds (a bug).
    """
    idle = 0

    def mark() -> tuple[int, ...]:
        return tuple(
            x
            for s in scheds
            for x in (s.counters.finished, s.counters.rejected, s.counters.forwards)
        )

    while any(s.waiting or s.running for s in scheds):
        before = mark()
        for s in scheds:
            if s.waiting or s.running:
                s.step()
        idle = idle + 1 if mark() == before else 0
        if idle > 1000:
            raise RuntimeError("no progress in 1000 rounds of the fleet")
        if progress is not None:
            progress(sum(s.counters.finished + s.counters.rejected for s in scheds))
    for s in scheds:
        s.drain()


def _fleet_rate(jobs: Sequence[Job], config: ReplayConfig, servers: int) -> float:
    """Return the hit rate of `servers` caches behind a round-robin router (no model)."""
    scheds = []
    for k in range(servers):
        cache = config.cache(l3=False)
        sched = config.scheduler(cache, InstantEngine(cache), None)
        sched.add(deal(jobs, servers, k))
        scheds.append(sched)
    _run_fleet(scheds, None)
    hit = sum(s.counters.device_hit_tokens + s.counters.host_hit_tokens for s in scheds)
    prompt = sum(s.counters.prompt_tokens for s in scheds)
    return hit / prompt if prompt else 0.0


#: Counters of `L3Tier.report` a fleet's report sums over its servers.
_L3_SUMS = (
    "l3_lookups",
    "l3_fetches",
    "l3_fetches_cancelled",
    "l3_landed_pages",
    "l3_missed_pages",
    "l3_corrupt_objects",
    "l3_missing_objects",
    "l3_foreign_objects",
    "l3_stored_objects",
    "l3_bytes_fetched",
    "l3_bytes_stored",
    "l3_errors",
    "l3_breaker_trips",
    "l3_prefetches",
    "l3_prefetch_timeouts",
    "l3_prefetch_wait_steps",
    "l3_eviction_puts",
)


def replay_fleet(
    jobs: Sequence[Job],
    config: ReplayConfig,
    servers: int,
    *,
    progress: Callable[[int], None] | None = None,
    compare: bool = True,
) -> dict[str, Any]:
    """Serve `jobs` with `servers` machines behind a round-robin router.

    Each server has its own cache, pools, tiers, engine and checksum model, as a
    machine would; job ``i`` goes to server ``i % servers``, and the servers take
    scheduling steps in turn (in one process), so a server finds in the L3 store
    (``config.l3``, shared) what the others put there meanwhile. `compare` also replays
    (without a model) one server serving every job with the same pools, and the fleet
    without the L3 tier.

    Returns:
        The report: the fleet's totals (``hit_rate`` is device, host and L3 hit tokens
        over prompt tokens), ``per_server`` (each server's own), the comparisons
        (``single_server_hit_rate``, ``fleet_without_l3_hit_rate``,
        ``fleet_vs_single_ratio``) and the L3 tier's figures summed over the servers
        (``l3_breaker``: each server's breaker state).

    Raises:
        ValueError: `servers` is not at least 1.
    """
    if servers < 1:
        raise ValueError(f"servers: must be at least 1, got {servers}")
    fleet = [Server(config, seed_offset=k) for k in range(servers)]
    for k, server in enumerate(fleet):
        server.sched.add(deal(jobs, servers, k))
    start = time.perf_counter()
    _run_fleet([f.sched for f in fleet], progress)
    seconds = time.perf_counter() - start
    per_server = []
    for server in fleet:
        c, cache = server.sched.counters, server.cache
        try:
            cache.audit()
            audit = "pass"
        except InvariantError as e:
            audit = str(e)
        leftover = len(cache.pending_batches())
        if isinstance(server.engine, FaultyEngine):
            server.engine.rate = 0.0
        full = clear(cache, server.engine) and leftover == 0
        one = l3_report(server.l3, c)
        one.update(
            {
                "requests": c.finished,
                "prompt_tokens": c.prompt_tokens,
                "device_hit_tokens": c.device_hit_tokens,
                "host_hit_tokens": c.host_hit_tokens,
                "samples_checked": server.model.samples if server.model else 0,
                "mismatches": server.model.mismatches if server.model else 0,
                "audit": audit,
                "pools_full_at_end": full,
            }
        )
        per_server.append(one)
    total = {
        k: sum(s[k] for s in per_server)
        for k in (
            "requests",
            "prompt_tokens",
            "device_hit_tokens",
            "host_hit_tokens",
            "l3_hit_tokens",
            "samples_checked",
            "mismatches",
        )
    }
    p = total["prompt_tokens"]
    hits = total["device_hit_tokens"] + total["host_hit_tokens"] + total["l3_hit_tokens"]
    out: dict[str, Any] = {"servers": servers, **total}
    out["hit_rate"] = hits / p if p else 0.0
    out["device_hit_rate"] = total["device_hit_tokens"] / p if p else 0.0
    out["host_hit_rate"] = total["host_hit_tokens"] / p if p else 0.0
    out["l3_hit_rate"] = total["l3_hit_tokens"] / p if p else 0.0
    out["audit"] = next((s["audit"] for s in per_server if s["audit"] != "pass"), "pass")
    out["pools_full_at_end"] = all(s["pools_full_at_end"] for s in per_server)
    out["seconds"] = seconds
    if config.l3 is not None:
        for key in _L3_SUMS:
            out[key] = sum(s[key] for s in per_server)
        fetched = sum(f.l3.counters.fetch_seconds for f in fleet if f.l3)
        stored = sum(f.l3.counters.put_seconds for f in fleet if f.l3)
        out["l3_fetch_gbps"] = out["l3_bytes_fetched"] / fetched / 1e9 if fetched else 0.0
        out["l3_put_gbps"] = out["l3_bytes_stored"] / stored / 1e9 if stored else 0.0
        out["l3_breaker"] = [s["l3_breaker"] for s in per_server]
        causes: dict[str, int] = {}
        for s in per_server:
            for cause, n in s["l3_error_causes"].items():
                causes[cause] = causes.get(cause, 0) + n
        out["l3_error_causes"] = causes
        out["l3_first_error"] = next(
            (s["l3_first_error"] for s in per_server if s["l3_first_error"]), None
        )
    else:
        out.update(dict.fromkeys(L3_KEYS))
    single = without_l3 = None
    if compare:
        single = _fleet_rate(jobs, config, 1)
        without_l3 = _fleet_rate(jobs, config, servers)
    out["single_server_hit_rate"] = single
    out["fleet_without_l3_hit_rate"] = without_l3
    out["fleet_vs_single_ratio"] = out["hit_rate"] / single if single else None
    out["per_server"] = per_server
    return out


def _spread(values: Sequence[int]) -> dict[str, float]:
    """`values`' mean, 99th percentile (nearest rank) and maximum (0 each when empty)."""
    if not values:
        return {"mean": 0.0, "p99": 0.0, "max": 0.0}
    ordered = sorted(values)
    p99 = ordered[max(0, -(-99 * len(ordered) // 100) - 1)]
    return {"mean": sum(ordered) / len(ordered), "p99": float(p99), "max": float(ordered[-1])}


def schedule_report(config: ReplayConfig, c: Counters) -> dict[str, Any]:
    """Return the admission order's keys of the report: the policy and what it cost.

    ``queue_cuts``: prefill cuts placed where a waiting request leaves a prompt (with
    ``lookahead``); ``queue_wait_steps``: the scheduler steps each request waited from
    its arrival to its first admission; ``overtaken``: how many requests that arrived
    after it were admitted before it; each as ``{"mean", "p99", "max"}`` over the
    admitted requests.
    """
    return {
        "schedule_policy": config.schedule_policy,
        "schedule_window": config.schedule_window if config.schedule_policy == "lpm" else None,
        "max_overtakes": config.max_overtakes if config.schedule_policy == "lpm" else None,
        "lookahead": config.lookahead,
        "queue_cuts": c.queue_cuts,
        "queue_wait_steps": _spread([w for _, w, _ in c.admissions]),
        "overtaken": _spread([o for _, _, o in c.admissions]),
    }


#: The SWA counters of ``cache.stats()`` the report carries (0 without SWA layers).
SWA_COUNTERS = (
    "swa_tombstones",
    "swa_evicted_pages",
    "swa_window_freed_pages",
    "swa_revived_pages",
    "swa_alloc_failures",
    "swa_backed_up_pages",
    "swa_backup_skipped_pages",
    "swa_loaded_pages",
)


def swa_report(
    cache: HybridCache, s: dict[str, int], c: Counters, full_attention: Counters | None
) -> dict[str, Any]:
    """Return the model's keys of the report: its kind, its window and the SWA figures.

    ``full_attention_hit_rate`` is the device hit rate of the same model with its SWA
    layers as full attention (`full_attention`), ``swa_vs_full_hit_ratio`` the replay's
    over it; both None without SWA layers, when that replay was skipped, or (the ratio)
    when it hit nothing. `s` is the cache's ``stats()`` at the end of the run.
    """
    full = None if full_attention is None else _rate(full_attention)
    out: dict[str, Any] = {
        "model": model_name(cache),
        "swa_window": cache.swa_window,
        "full_attention_hit_rate": full,
        "swa_vs_full_hit_ratio": _rate(c) / full if full else None,
    }
    out.update({k: s[k] for k in SWA_COUNTERS})
    return out


def offline_report(
    trace: StateTrace | None, c: Counters, attention_only: float | None
) -> dict[str, Any]:
    """Return the offline bound's keys of the report (None each without a trace).

    Hit rates are in tokens over the prompt tokens, as ``device_hit_rate``; request hit
    rates are the shares of requests that hit a state (``request_hit_rate`` is the
    replay's own, measured).
    """
    keys = (
        "offline_bound_hit_rate",
        "offline_bound_ratio",
        "offline_lru_hit_rate",
        "offline_possible_hit_rate",
        "offline_bound_request_hit_rate",
        "offline_lru_request_hit_rate",
        "offline_possible_request_hit_rate",
    )
    if trace is None:
        return dict.fromkeys(keys)
    return offline_keys(trace.events, trace.cache.mamba_slots, c.prompt_tokens, attention_only)


def offline_keys(
    events: Sequence[Event], mamba_slots: int, prompt_tokens: int, attention_only: float | None
) -> dict[str, Any]:
    """Return the offline bound's report keys from recorded `events` (see `offline_report`)."""
    b = bound(events, mamba_slots * 3 // 4)
    p, n = prompt_tokens, b.requests
    rate = b.belady_tokens / p if p else 0.0
    return {
        "offline_bound_hit_rate": rate,
        "offline_bound_ratio": rate / attention_only if attention_only else None,
        "offline_lru_hit_rate": b.lru_tokens / p if p else 0.0,
        "offline_possible_hit_rate": b.possible_tokens / p if p else 0.0,
        "offline_bound_request_hit_rate": b.belady_requests / n if n else 0.0,
        "offline_lru_request_hit_rate": b.lru_requests / n if n else 0.0,
        "offline_possible_request_hit_rate": b.possible_requests / n if n else 0.0,
    }


def report(
    c: Counters,
    s: dict[str, int],
    engine: FaultyEngine | InstantEngine,
    model: ChecksumModel | None,
    seconds: float,
    audit: str,
    full: bool,
    attention_only: Counters | None,
    shapes: tuple[ModelShape, ModelShape],
) -> dict[str, Any]:
    """Gather the replay's report into a flat dict (the documented keys first).

    `attention_only` is the attention-only replay's counters, or None when it was not
    run: ``attention_only_hit_rate``, ``attention_only_compute_saved_ratio`` and
    ``hit_rate_ratio`` are then None, as is the ratio when the attention-only rate is 0.
    `shapes`: the model's and the attention-only model's, for the compute saved.
    """
    shape, attention_shape = shapes
    rate = _rate(c)
    attn = attn_saved = None
    if attention_only is not None:
        attn = _rate(attention_only)
        attn_saved = compute_saved(attention_only, attention_shape)
    failed, injected = 0, {}
    if isinstance(engine, FaultyEngine):
        failed, injected = engine.stats()["batches_failed"], dict(engine.injected)
    out: dict[str, Any] = {
        "requests": c.finished,
        "prompt_tokens": c.prompt_tokens,
        "output_tokens": c.output_tokens,
        "prefill_tokens": c.prefill_tokens,
        "device_hit_tokens": c.device_hit_tokens,
        "host_hit_tokens": c.host_hit_tokens,
        "restored_hit_tokens": c.restored_hit_tokens,
        "device_hit_rate": rate,
        "host_hit_rate": c.host_hit_tokens / c.prompt_tokens if c.prompt_tokens else 0.0,
        "attention_only_hit_rate": attn,
        "hit_rate_ratio": (rate / attn) if attn else None,
        "compute_saved_ratio": compute_saved(c, shape),
        "attention_only_compute_saved_ratio": attn_saved,
        "request_hit_rate": sum(1 for _, d, _ in c.served if d) / len(c.served)
        if c.served
        else 0.0,
        "cow_copies": s["cow_copies"],
        "checkpoints": s["checkpoints"],
        "finish_states_lost": s["finish_states_lost"],
        "backups": s["backups_done"],
        "backups_failed": s["backups_failed"],
        "demotions": s["demotions"],
        "load_backs_committed": s["load_backs_committed"],
        "load_backs_called_off": s["load_backs_called_off"],
        "load_backs_called_off_by_reason": {r: s[f"load_backs_called_off_{r}"] for r in CALLED_OFF},
        "load_backs_failed": s["load_backs_failed"],
        "loaded_tokens": s["loaded_tokens"],
        "evicted_kv_tokens": s["evicted_kv_tokens"],
        "evicted_mamba_states": s["evicted_mamba_states"],
        "evicted_used_states": s["evicted_used_states"],
        "host_evicted_tokens": s["host_evicted_tokens"],
        "retractions": c.retractions,
        "extend_second_rounds": c.extend_second_rounds,
        "rejected": c.rejected,
        "batches_failed": failed,
        "batches_refused": c.batches_refused,
        "load_backs_refused": c.load_backs_refused,
        "injected_failures": injected,
        "samples_checked": model.samples if model is not None else 0,
        "mismatches": model.mismatches if model is not None else 0,
        "audit": audit,
        "pools_full_at_end": full,
        "steps": c.steps,
        "seconds": seconds,
        "requests_per_second": c.finished / seconds if seconds else 0.0,
        "tokens_per_second": (c.prompt_tokens + c.output_tokens) / seconds if seconds else 0.0,
    }
    return out
