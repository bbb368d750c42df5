"""The scheduler's admission order (``schedule_policy``): FCFS, and LPM with its bounds."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import radixcache as rc
import radixcache.serving as sv
from radixcache.serving.workloads import Job

RNG = np.random.default_rng(7)


def job(prompt: Any, out: int = 8) -> Job:
    return Job(np.asarray(prompt, dtype=np.uint32), RNG.integers(0, 100, out).astype(np.uint32))


def fresh(n: int, start: int) -> np.ndarray:
    """`n` tokens no other test prompt has."""
    return np.arange(start, start + n, dtype=np.uint32)


def turn(previous: Job, new: int, start: int) -> Job:
    """The conversation's next turn: `previous`'s prompt and output, then `new` tokens."""
    return job(np.concatenate([previous.prompt, previous.output, fresh(new, start)]))


def hybrid() -> rc.HybridCache:
    return rc.HybridCache(kv_slots=8192, mamba_slots=16, page_size=4)


def serve(cache: rc.HybridCache, jobs: list[Job], **kw: Any) -> list[int]:
    """Serve `jobs` on `cache` (one request at a time unless `kw` says otherwise).

    Returns:
        The jobs' indices in their order of admission.
    """
    kw.setdefault("max_running", 1)
    sched = sv.Scheduler(cache, sv.InstantEngine(cache), **kw)
    sched.add(jobs)
    c = sched.run()
    assert c.finished == len(jobs)
    cache.audit()
    return [i for i, _, _ in c.admissions]


@pytest.mark.parametrize(
    ("kw", "order"),
    [
        ({}, [0, 1, 2, 3]),
        ({"schedule_policy": "lpm"}, [2, 0, 1, 3]),
        ({"schedule_policy": "lpm", "schedule_window": 2}, [0, 2, 1, 3]),
        ({"schedule_policy": "lpm", "schedule_window": 1}, [0, 1, 2, 3]),
    ],
)
def test_lpm_admits_the_longest_usable_cached_prefix_first(
    kw: dict[str, Any], order: list[int]
) -> None:
    cache = hybrid()
    long, short = job(fresh(256, 1000)), job(fresh(64, 5000))
    serve(cache, [long, short])  # each cached with its state at its last whole page
    unrelated = job(fresh(100, 9000))
    # 200 tokens of `long`'s KV, but no state there: a hybrid model reuses nothing.
    kv_only = job(np.concatenate([long.prompt[:200], fresh(40, 12000)]))
    resumes = turn(short, 40, 13000)  # reuses `short` up to its state
    last = job(fresh(50, 14000))
    jobs = [unrelated, kv_only, resumes, last]
    device, _, kv_len = cache.peek_prefix(kv_only.prompt[:-1])
    assert (device, kv_len) == (0, 200)
    assert 0 < cache.peek_prefix(resumes.prompt[:-1])[0] < 200
    assert serve(cache, jobs, **kw) == order


@pytest.mark.parametrize("most", [0, 2, 10])
def test_a_waiting_request_is_overtaken_at_most_max_overtakes_times(most: int) -> None:
    cache = hybrid()
    first = job(fresh(64, 1000))
    serve(cache, [first])
    jobs = [job(fresh(80, 9000))] + [turn(first, 16, 20_000 + 100 * i) for i in range(5)]
    sched = sv.Scheduler(
        cache, sv.InstantEngine(cache), max_running=1, schedule_policy="lpm", max_overtakes=most
    )
    sched.add(jobs)
    c = sched.run()
    order = [i for i, _, _ in c.admissions]
    overtaken = {i: o for i, _, o in c.admissions}
    # The resumed turns go first, until the unrelated request has been overtaken enough.
    assert order.index(0) == min(most, 5)
    assert overtaken[0] == min(most, 5)
    assert max(overtaken.values()) <= most
    assert sorted(order[: order.index(0)]) == order[: order.index(0)]


def test_lpm_keeps_each_conversations_turns_in_arrival_order() -> None:
    """A later turn matches no more than the turn before it until that one ran."""
    jobs = sv.multiturn(clients=8, rounds=4, request_len=64, output_len=8)
    before: dict[int, int] = {}  # a turn's index: the previous turn's
    for i, j in enumerate(jobs):
        for k in range(i):
            seq = np.concatenate([jobs[k].prompt, jobs[k].output])
            if len(seq) < len(j.prompt) and np.array_equal(j.prompt[: len(seq)], seq):
                before[i] = k
    assert len(before) == 8 * 3
    cache = hybrid()
    order = serve(cache, jobs, max_running=4, schedule_policy="lpm")
    assert order != sorted(order)  # lpm did reorder
    at = {i: pos for pos, i in enumerate(order)}
    for later, earlier in before.items():
        assert at[earlier] < at[later]


def test_each_admission_records_its_wait_in_steps_and_nothing_overtakes_under_fcfs() -> None:
    cache = hybrid()
    sched = sv.Scheduler(cache, sv.InstantEngine(cache), max_running=1)
    sched.add([job(fresh(40, 1000 * (i + 1))) for i in range(3)])
    c = sched.run()
    waits = [w for _, w, _ in c.admissions]
    # The first is admitted in the first step after its arrival, the others later.
    assert 0 == waits[0] < waits[1] < waits[2]
    assert all(o == 0 for _, _, o in c.admissions)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"schedule_policy": "sjf"}, "schedule_policy: must be one of fcfs, lpm, got 'sjf'"),
        ({"schedule_window": 0}, "schedule_window: must be >= 1, got 0"),
        ({"max_overtakes": -1}, "max_overtakes: must be >= 0, got -1"),
    ],
)
def test_bad_schedule_arguments_are_named(kwargs: dict[str, Any], message: str) -> None:
    cache = rc.HybridCache(kv_slots=64)
    with pytest.raises(ValueError, match="^" + message):
        sv.Scheduler(cache, sv.InstantEngine(cache), **kwargs)


def test_the_replay_reports_the_order_and_what_it_cost() -> None:
    jobs = sv.gsp(48)
    base = {"kv_slots": 65_536, "mamba_slots": 8, "host_kv_slots": 0, "oracle": False}
    fcfs, _ = sv.replay(jobs, sv.ReplayConfig(**base))
    lpm, _ = sv.replay(jobs, sv.ReplayConfig(**base, schedule_policy="lpm", max_overtakes=6))
    assert (fcfs["schedule_policy"], fcfs["schedule_window"]) == ("fcfs", None)
    assert fcfs["overtaken"] == {"mean": 0.0, "p99": 0.0, "max": 0.0}
    assert (lpm["schedule_policy"], lpm["schedule_window"], lpm["max_overtakes"]) == (
        "lpm",
        128,
        6,
    )
    assert 0 < lpm["overtaken"]["max"] <= 6
    for r in (fcfs, lpm):
        wait = r["queue_wait_steps"]
        assert 0 <= wait["mean"] <= wait["p99"] <= wait["max"] < r["steps"]
    # Grouping the requests of a system prompt keeps its state in the few slots.
    assert lpm["device_hit_rate"] > fcfs["device_hit_rate"]
