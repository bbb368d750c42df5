"""The serving package: the checksum model, the scheduler, the workloads and the replay.

The replays run the scheduler end to end on real (NumPy) storage through the transfer
engine; the oracle (every sample the model takes against the reference computed without
a cache) must report zero mismatches, the audit must pass and every pool must be full
once the cache is cleared. Deliberately broken engines must be caught by the oracle.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import radixcache as rc
import radixcache.serving as sv
from radixcache import cli
from radixcache.serving.flops import ModelShape, compute_saved_ratio
from radixcache.serving.offline import Event, bound, simulate
from radixcache.serving.workloads import Job

# ---------------------------------------------------------------------------- the model


def model_for(cache: rc.HybridCache) -> tuple[sv.ChecksumModel, rc.Storage]:
    storage = sv.ChecksumModel.storage_for(cache)
    return sv.ChecksumModel(cache, storage), storage


def serve_alone(
    model: sv.ChecksumModel, prompt: list[int], output: list[int], *, slots: np.ndarray
) -> list[int]:
    """Feed `prompt` then `output[:-1]` into fixed slots (no cache logic); the samples."""
    got: list[int] = []
    seq = prompt + output[:-1]
    n = len(prompt)
    model.forward(0, prompt, slots[:n], 0, read=slots[:n], on_sample=got.append)
    for i in range(n, len(seq)):
        model.forward(i, seq[i : i + 1], slots[i : i + 1], 0, read=slots[: i + 1],
                      on_sample=got.append)  # fmt: skip
    model.stream.synchronize()
    return got


def test_the_model_served_without_reuse_gives_the_reference_samples() -> None:
    cache = rc.HybridCache(kv_slots=64, mamba_slots=2)
    model, _ = model_for(cache)
    prompt, output = [5, 9, 2, 7, 7, 1], [3, 3, 8, 0]
    got = serve_alone(model, prompt, output, slots=np.arange(20, 40))
    assert got == model.ref.samples(prompt, len(output), output)
    assert len(set(got)) > 1  # the samples depend on the sequence


def test_the_reference_decodes_its_own_samples_when_no_output_is_given() -> None:
    ref = sv.Reference()
    own = ref.samples([1, 2, 3], 5)
    assert ref.samples([1, 2, 3], 5, own) == own
    assert ref.samples([1, 2, 3], 0) == []


@pytest.mark.parametrize(
    ("array", "layer"),
    [("k", 0), ("k", 1), ("v", 0), ("v", 1), ("conv", 0), ("conv", 1), ("ssm", 0), ("ssm", 1)],
)
def test_one_wrong_layer_of_any_array_changes_the_sample(array: str, layer: int) -> None:
    """A half-copied slot (one layer of K, V, conv or SSM stale) is visible to the oracle."""
    cache = rc.HybridCache(kv_slots=64, mamba_slots=2)
    model, _ = model_for(cache)
    prompt = [4, 8, 15, 16, 23, 42]
    slots = np.arange(10, 16)
    model.forward(0, prompt[:5], slots[:5], 0)
    model.stream.synchronize()
    buf = getattr(model, array)
    buf[layer, 12 if array in ("k", "v") else 0] ^= np.uint64(1)
    got: list[int] = []
    model.forward(5, prompt[5:], slots[5:], 0, read=slots, on_sample=got.append)
    model.stream.synchronize()
    assert got != model.ref.samples(prompt, 1)


def test_a_misrouted_kv_slot_changes_the_sample() -> None:
    cache = rc.HybridCache(kv_slots=64, mamba_slots=2)
    model, _ = model_for(cache)
    prompt = [1, 2, 3, 4]
    slots = np.array([3, 4, 5, 6])
    model.forward(0, prompt, slots, 0)
    model.stream.synchronize()
    got: list[int] = []
    # Read the same bytes in another order: the sample must see it.
    model.forward(4, [9], [7], 0, read=[4, 3, 5, 6, 7], on_sample=got.append)
    model.stream.synchronize()
    assert got != model.ref.samples([*prompt, 9], 1)


def test_compute_runs_only_when_waited_for_and_in_order() -> None:
    stream = sv.ComputeStream()
    ran: list[int] = []
    stream.launch(lambda: ran.append(1))
    first = stream.record()
    stream.launch(lambda: ran.append(2))
    assert ran == []
    assert not first.done
    first.synchronize()
    assert ran == [1]
    assert first.done
    stream.synchronize()
    assert ran == [1, 2]


def test_the_cpu_engine_waits_for_the_compute_event_before_a_copy() -> None:
    """A device-to-host copy after a compute step reads what that step wrote."""
    cache = rc.HybridCache(kv_slots=16, mamba_slots=2, host_kv_slots=16, host_mamba_slots=2)
    model, storage = model_for(cache)
    engine = rc.TransferEngine(cache, storage)
    slots = cache.alloc_kv(4)
    state = cache.alloc_mamba()
    assert slots is not None
    assert state is not None
    model.forward(0, [1, 2, 3, 4], slots, state)  # queued, not run
    engine.after_compute(model.stream.record())
    cache.insert([1, 2, 3, 4], slots, mamba_slot=state)
    assert engine.run_pending() == 1  # the backup: it must wait for the forward
    host_k = storage.kv["host"][0].reshape(2, -1).view(np.uint64)
    h = model.ref.kv_hash(np.array([1, 2, 3, 4], dtype=np.uint64), 0)
    assert (host_k[0, :4] == h ^ model.ref.salt_k[0]).all()


@pytest.mark.parametrize(
    "shapes",
    [
        {"head_dim": 2, "conv_shape": (1,), "ssm_shape": (1,), "dtype": "int64"},
        {"head_dim": 1, "conv_shape": (1,), "ssm_shape": (1,), "dtype": "float16"},
        {"head_dim": 1, "conv_shape": (3,), "ssm_shape": (1,), "dtype": "int64"},
    ],
)
def test_the_model_refuses_storage_it_cannot_read(shapes: dict[str, Any]) -> None:
    cache = rc.HybridCache(kv_slots=16, mamba_slots=2)
    bad = rc.Storage.for_cache(cache, layers=2, kv_heads=1, ssm_dtype="int64", **shapes)
    with pytest.raises(ValueError, match=r"^storage: the checksum model needs NumPy arrays"):
        sv.ChecksumModel(cache, bad)
    assert sv.ChecksumModel(cache, sv.ChecksumModel.storage_for(cache)).hybrid


# ---------------------------------------------------------------------------- workloads


def test_gsp_has_the_bench_serving_shape() -> None:
    jobs = sv.gsp()
    assert len(jobs) == 64 * 16
    assert {len(j.prompt) for j in jobs} == {2048 + 128}
    assert {len(j.output) for j in jobs} == {256}
    systems = {j.prompt[:2048].tobytes() for j in jobs}
    assert len(systems) == 64
    # Shuffled: the first 16 are not one group.
    assert len({j.prompt[:2048].tobytes() for j in jobs[:16]}) > 1
    small = sv.gsp(40)
    assert len(small) == 40
    assert len({j.prompt[:2048].tobytes() for j in small}) <= 3
    big = sv.gsp(2000)  # more requests than the default groups hold: more groups
    assert len(big) == 2000
    assert len({j.prompt[:2048].tobytes() for j in big}) == 125


def test_multiturn_rounds_extend_the_previous_prompt_and_output() -> None:
    jobs = sv.multiturn()
    assert len(jobs) == 256 * 5
    first = jobs[:256]
    assert {len(j.prompt) for j in first} == {512}
    by_prefix = {j.prompt.tobytes(): j for j in first}
    nxt = jobs[256]
    prev = by_prefix[nxt.prompt[:512].tobytes()]
    assert (nxt.prompt[: 512 + 64] == np.concatenate([prev.prompt, prev.output])).all()
    assert len(nxt.prompt) == 512 + 64 + 512
    assert len(sv.multiturn(12)) == 12


def test_mixed_is_seeded_and_has_every_kind_of_request() -> None:
    a, b = sv.mixed(300, seed=3), sv.mixed(300, seed=3)
    assert all((x.prompt == y.prompt).all() and (x.output == y.output).all() for x, y in zip(a, b))
    other = sv.mixed(300, seed=4)
    assert any(x.prompt.tobytes() != y.prompt.tobytes() for x, y in zip(a, other))
    lengths = [len(j.prompt) for j in a]
    assert min(lengths) < 600
    assert max(lengths) > 4000  # a long document after a shared instruction
    assert {j.namespace for j in a} == {None, "lora-1"}
    assert len(sv.mixed()) == 1200


def test_jsonl_round_trip(tmp_path: Path) -> None:
    jobs = sv.mixed(30)
    path = tmp_path / "w.jsonl"
    assert sv.save_jsonl(jobs, path) == 30
    back = sv.load_jsonl(path)
    assert len(back) == 30
    for x, y in zip(jobs, back):
        assert (x.prompt == y.prompt).all()
        assert (x.output == y.output).all()
        assert x.namespace == y.namespace
        assert x.priority == y.priority
    assert {j.priority for j in back} == {0, 1, 2}
    assert len(sv.load(str(path), requests=7)) == 7


def test_a_job_without_output_decodes_the_models_own_samples(tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": [1, 2, 3], "output_len": 4}\n\n')
    (job,) = sv.load_jsonl(path)
    assert list(job.output) == sv.Reference().samples([1, 2, 3], 4)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "line 1: not JSON"),
        ('{"output_len": 3}', "line 1: a job is an object with a 'prompt'"),
        ("[1, 2]", "line 1: a job is an object with a 'prompt'"),
        ('{"prompt": 3, "output_len": 1}', "line 1: prompt: must be a list of token ids, got 3"),
        ('{"prompt": [1, "a"]}', "line 1: prompt[1]: 'a' is not a token id"),
        ('{"prompt": [1, -1], "output_len": 1}', "line 1: prompt[1]: -1 is not a token id"),
        ('{"prompt": [4294967296], "output_len": 1}', "line 1: prompt[0]: 4294967296 is not a"),
        ('{"prompt": [1], "output": [true]}', "line 1: output[0]: True is not a token id"),
        ('{"prompt": [1], "output": [2], "output_len": 3}', "line 1: output_len: 3 differs"),
        (
            '{"prompt": [1], "output_len": -1}',
            "line 1: output_len: must be an integer in [1, 65536]",
        ),
        ('{"prompt": [1]}', "line 1: a job has an 'output_len' or an 'output'"),
        ('{"prompt": [1], "output_len": 1, "namespace": 3}', "line 1: namespace: must be a"),
        ('{"prompt": [1], "output_len": 1, "priority": 1.5}', "line 1: priority: must be an"),
        ('{"prompt": [1], "output_len": 1, "priority": true}', "line 1: priority: must be an"),
        (
            '{"prompt": [1], "output_len": 1, "priority": 9223372036854775808}',
            "line 1: priority: must be an integer in [-2**63, 2**63), got 9223372036854775808",
        ),
    ],
)
def test_a_bad_jsonl_line_is_named(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "w.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        sv.load_jsonl(path)


def test_a_priority_in_a_file_is_read_and_defaults_to_0(tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    lo = -(2**63)
    path.write_text(
        f'{{"prompt": [1], "output_len": 1, "priority": {lo}}}\n'
        '{"prompt": [1], "output_len": 1}\n'
    )
    assert [j.priority for j in sv.load_jsonl(path)] == [lo, 0]


def test_built_in_workloads_give_a_priority_per_tenant_or_kind_of_request() -> None:
    gsp = sv.gsp()
    by_group: dict[bytes, set[int]] = {}
    for j in gsp:
        by_group.setdefault(j.prompt[:2048].tobytes(), set()).add(j.priority)
    assert all(len(p) == 1 for p in by_group.values())  # one tier per group
    assert sorted(p for (p,) in by_group.values()) == [0] * 32 + [1] * 32
    # The priorities draw nothing from the seeded streams: the tokens are as they were
    # before requests had one (the first tokens of each workload, pinned).
    assert gsp[0].prompt[:3].tolist() == [14934, 4869, 6912]
    assert sv.multiturn()[0].prompt[:3].tolist() == [24822, 257, 9883]
    assert sv.mixed(1)[0].prompt[:3].tolist() == [20382, 16356, 8633]
    mt = sv.multiturn(512)
    assert {j.priority for j in mt} == {0, 1}
    first = {j.prompt[:512].tobytes(): j.priority for j in mt[:256]}
    assert all(first[j.prompt[:512].tobytes()] == j.priority for j in mt[256:])
    kinds = {j.priority for j in sv.mixed(300)}
    assert kinds == {0, 1, 2}


def test_the_scheduler_admits_each_request_with_its_priority() -> None:
    seen: list[int] = []

    class Spy:
        def __init__(self, cache: rc.HybridCache) -> None:
            self._cache = cache

        def __getattr__(self, name: str) -> Any:
            return getattr(self._cache, name)

        def admit(self, tokens: Any, *, namespace: str | None, priority: int) -> Any:
            seen.append(priority)
            return self._cache.admit(tokens, namespace=namespace, priority=priority)

    cache = Spy(rc.HybridCache(kv_slots=1024, mamba_slots=8))
    sched = sv.Scheduler(cache, sv.InstantEngine(cache))  # type: ignore[arg-type]
    jobs = [dataclasses.replace(j, priority=p) for j, p in zip(jobs_of([1, 2], [3, 4]), (5, -2))]
    sched.add(jobs)
    sched.run()
    assert seen == [5, -2]


def test_an_unknown_workload_is_named() -> None:
    with pytest.raises(ValueError, match=r"^workload: 'nope' is neither a built-in workload"):
        sv.load("nope")


# ---------------------------------------------------------------------------- scheduler


def small(**kw: Any) -> sv.ReplayConfig:
    """Pools small enough that a few hundred mixed requests evict, demote and load back."""
    base: dict[str, Any] = {
        "kv_slots": 8192,
        "mamba_slots": 24,
        "host_kv_slots": 32768,
        "host_mamba_slots": 96,
        "attention_only": False,
        "max_running": 8,
    }
    base.update(kw)
    return sv.ReplayConfig(**base)


def ok(report: dict[str, Any]) -> None:
    assert report["mismatches"] == 0, report
    assert report["audit"] == "pass", report
    assert report["pools_full_at_end"], report
    # Every output token was checked (more when a retracted request was served again).
    assert report["samples_checked"] >= report["output_tokens"]


MIXED = sv.mixed(160, seed=1)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("inject", [0.0, 0.2])
def test_replay_without_a_host_tier_is_exact(page_size: int, inject: float) -> None:
    r, _ = sv.replay(MIXED, small(page_size=page_size, host_kv_slots=0, inject_failures=inject))
    ok(r)
    assert r["device_hit_tokens"] > 0
    assert r["cow_copies"] > 0
    assert r["evicted_kv_tokens"] > 0
    assert r["host_hit_tokens"] == r["backups"] == 0


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("inject", [0.0, 0.2])
def test_replay_with_a_host_tier_is_exact(page_size: int, policy: str, inject: float) -> None:
    cfg = small(page_size=page_size, write_policy=policy, inject_failures=inject)
    r, _ = sv.replay(MIXED, cfg)
    ok(r)
    assert r["requests"] == len(MIXED)
    assert r["demotions"] > 0
    assert r["load_backs_committed"] > 0
    assert r["host_hit_tokens"] > 0
    if inject:
        assert sum(r["injected_failures"].values()) > 0
        assert r["batches_failed"] > 0


@pytest.mark.slow
def test_injected_failures_call_off_and_fail_load_backs_without_a_mismatch() -> None:
    r, _ = sv.replay(sv.mixed(300, seed=2), small(inject_failures=0.4))
    ok(r)
    assert r["load_backs_called_off"] > 0
    assert r["load_backs_failed"] > 0
    inj = r["injected_failures"]
    assert inj["refused"] > 0
    assert inj["refused"] == r["batches_refused"] + r["load_backs_refused"]
    assert r["load_backs_refused"] > 0
    assert inj["copy_failed"] > 0


def test_an_attention_only_replay_is_exact() -> None:
    r, _ = sv.replay(MIXED, small(mamba_slots=0, host_mamba_slots=0))
    ok(r)
    assert r["cow_copies"] == 0
    assert r["hit_rate_ratio"] == 1.0


@pytest.mark.slow
def test_the_hit_rate_ratio_compares_with_the_same_replay_without_states() -> None:
    jobs = sv.gsp(96)
    cfg = sv.ReplayConfig(kv_slots=65536, mamba_slots=64, host_kv_slots=0)
    r, _ = sv.replay(jobs, cfg)
    ok(r)
    attention = sv.attention_only_hit_rate(jobs, cfg)
    assert r["attention_only_hit_rate"] == attention
    assert r["hit_rate_ratio"] == pytest.approx(r["device_hit_rate"] / attention)
    # Branch-point checkpoints: the system prompts' states are found by later requests.
    assert r["hit_rate_ratio"] > 0.9


def jobs_of(*prompts: list[int], out: int = 3) -> list[Job]:
    rng = np.random.default_rng(0)
    return [
        Job(np.array(p, dtype=np.uint32), rng.integers(0, 100, out).astype(np.uint32))
        for p in prompts
    ]


@pytest.mark.parametrize("branch", [True, False])
def test_a_chunk_stops_at_the_branch_point_and_the_state_there_is_reused(branch: bool) -> None:
    system = list(range(100, 164))
    jobs = jobs_of(system + [1] * 40, system + [2] * 40, system + [3] * 40)
    cache = rc.HybridCache(kv_slots=1024, mamba_slots=8)
    model, storage = model_for(cache)
    engine = rc.TransferEngine(cache, storage)
    sched = sv.Scheduler(cache, engine, model, max_running=1, branch_checkpoints=branch)
    hits: list[tuple[int, int]] = []
    real_admit = cache.admit

    class Spy:
        def __getattr__(self, name: str) -> Any:
            return getattr(cache, name)

        def admit(self, tokens: Any, *, namespace: str | None = None, priority: int = 0) -> Any:
            req = real_admit(tokens, namespace=namespace, priority=priority)
            if req is not None:
                hits.append((req.prefix_len, req.branch_len))
            return req

    sched.cache = Spy()  # type: ignore[assignment]
    sched.add(jobs)
    sched.run()
    # The first request cannot know the branch point; the second finds the KV of the
    # system prompt but no state there (kv_len = 64), cuts its prefill at 64 and
    # checkpoints; the third reuses the state at the branch point. Without branch
    # checkpoints nobody stops there, and the third request recomputes the prefix.
    assert hits == ([(0, 0), (0, 64), (64, 64)] if branch else [(0, 0), (0, 64), (0, 64)])
    assert model.mismatches == 0
    assert model.samples == 9
    cache.audit()


def test_memory_pressure_retracts_the_newest_request_and_serves_it_later() -> None:
    jobs = jobs_of(*[[i] * 300 for i in range(1, 7)], out=40)
    cfg = small(kv_slots=1024, mamba_slots=8, host_kv_slots=0, max_running=6)
    r, _ = sv.replay(jobs, cfg)
    ok(r)
    assert r["retractions"] > 0
    assert r["requests"] == 6
    assert r["samples_checked"] > r["output_tokens"]  # retracted work was checked too


def test_running_requests_are_capped_by_the_state_slots() -> None:
    """More running requests than state slots could only retract one another."""
    cfg = small(kv_slots=8192, mamba_slots=6, host_kv_slots=0, max_running=32)
    cache = cfg.cache()
    model, storage = model_for(cache)
    sched = cfg.scheduler(cache, rc.TransferEngine(cache, storage), model)
    sched.add(jobs_of(*[[i] * 50 for i in range(1, 13)], out=20))
    most = 0
    while sched.waiting or sched.running:
        sched.step()
        most = max(most, len(sched.running))
    sched.drain()
    assert most == 4  # 6 slots, two kept for a load-back's second slot and forks
    assert sched.counters.retractions == 0
    assert sched.counters.finished == 12
    assert model.mismatches == 0


def test_write_back_makes_the_room_an_extend_asks_for_in_one_round_with_states_too() -> None:
    """Shared prompts and long chats on a write-back hybrid cache short of state slots.

    An ``extend`` refused is retried after running every batch the cache emitted; it used
    to be refused again now and then (the state slot it needed came with a backup, and
    the KV evictions it also needed were started only by the retry), then served after
    a second round.
    """
    cfg = sv.ReplayConfig(
        kv_slots=40_000,
        mamba_slots=32,
        host_kv_slots=200_000,
        host_mamba_slots=256,
        write_policy="write_back",
    )
    cache = cfg.cache()
    sched = cfg.scheduler(cache, sv.InstantEngine(cache), None)
    sched.add(sv.mixed(500))
    c = sched.run()
    assert c.finished == 500
    assert cache.stats()["backups_done"] > 0  # write-back did evict through backups
    assert c.extend_second_rounds == 0
    cache.audit()


def test_a_request_is_not_turned_away_for_slots_retracted_load_backs_still_hold() -> None:
    """Retracted requests' load-backs hold their slots until their copies end.

    On `gsp` with 8 state slots, a request left alone once found every state slot held
    by such copies and was rejected as too big for the pool; it must wait for them.
    """
    cfg = sv.ReplayConfig(kv_slots=16384, mamba_slots=8)
    cache = cfg.cache()
    model, storage = model_for(cache)
    sched = cfg.scheduler(cache, rc.TransferEngine(cache, storage), model)
    sched.add(sv.gsp(32))
    c = sched.run()
    sched.drain()
    assert c.copy_waits > 0  # the case arose
    assert (c.rejected, c.finished) == (0, 32)
    assert model.mismatches == 0
    cache.audit()


class StillCopying(sv.InstantEngine):
    """An engine whose copies are still running at every poll (a GPU's, behind the
    compute); `synchronize` waits for them."""

    def poll(self) -> list[rc.TransferBatch]:
        return []

    def synchronize(self) -> list[rc.TransferBatch]:
        return super().poll()


def run_all(c: rc.HybridCache) -> None:
    """Run every batch the cache emitted (backups, here) to completion."""
    for b in c.take_batches():
        b.start()
        b.complete()


def host_only_prefix(mamba_slots: int) -> rc.HybridCache:
    """A cache whose [1, 2, 3, 4] (with its state) is on the host tier only."""
    c = rc.HybridCache(kv_slots=64, mamba_slots=mamba_slots, host_kv_slots=64, host_mamba_slots=4)
    c.insert([1, 2, 3, 4], c.alloc_kv(4), mamba_slot=c.alloc_mamba())
    run_all(c)
    c.evict(kv_tokens=4)
    return c


def test_an_admission_with_nothing_running_waits_for_the_copies_in_flight() -> None:
    # The prompt matches a state a caller's lock keeps (no eviction frees its copy's
    # slot), and the other two state slots are held by the load-back of a request aborted
    # since: the admission must wait for that copy rather than turn its request away.
    c = host_only_prefix(mamba_slots=3)
    shared = c.insert([9] * 8, c.alloc_kv(8), mamba_slot=c.alloc_mamba())
    run_all(c)
    engine = StillCopying(c)
    r = c.admit([1, 2, 3, 4, 5])
    assert r is not None
    lb = c.load_back(r)
    assert lb is not None
    engine.submit(lb.batch)
    lb.commit()
    c.abort(r)
    assert (c.available_mamba(), c.stats()["mamba_draining_slots"]) == (0, 2)
    with c.lock(shared.node):
        sched = sv.Scheduler(c, engine, max_running=1)
        sched.add(jobs_of([9] * 8 + [5]))
        counters = sched.run()
        sched.drain()
    assert (counters.copy_waits, counters.rejected, counters.finished) == (1, 0, 1)
    assert counters.served[0][1] == 8  # it reused the locked state
    c.audit()


def test_a_request_short_of_a_state_slot_waits_for_a_load_back_rather_than_retract() -> None:
    # Two caller-locked states and a load-back (its two state slots in flight) fill the
    # four slots; the second request's first chunk needs a state slot. The load-back's
    # end gives one back (its restored state is the tree's, unlocked): waiting for it
    # must come before retracting the loading request, whose prefill would be redone.
    c = host_only_prefix(mamba_slots=4)
    pinned = [c.insert([k] * 4, c.alloc_kv(4), mamba_slot=c.alloc_mamba()) for k in (8, 9)]
    run_all(c)
    with c.lock(pinned[0].node), c.lock(pinned[1].node):
        sched = sv.Scheduler(c, StillCopying(c), max_running=2)
        sched.add(jobs_of([1, 2, 3, 4, 5], [20, 21, 22]))
        counters = sched.run()
        sched.drain()
    assert (counters.retractions, counters.copy_waits) == (0, 1)
    assert (counters.rejected, counters.finished) == (0, 2)
    assert sorted(counters.served) == [(3, 0, 0), (5, 0, 4)]  # the first loaded 4, once
    c.audit()


def test_the_next_turn_resumes_from_the_last_whole_page_of_an_unaligned_turn() -> None:
    # The first turn feeds 300 prompt tokens and 21 of its 22 output tokens: 321, pages of
    # 16. `finish` places no state at 321; the scheduler checkpoints at 320, and the next
    # turn (the whole first turn, then 50 new tokens) resumes there, its samples checked.
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, 1000, 300).astype(np.uint32)
    output = rng.integers(0, 1000, 22).astype(np.uint32)
    second = np.concatenate([prompt, output, rng.integers(0, 1000, 50).astype(np.uint32)])
    jobs = [Job(prompt, output), Job(second, rng.integers(0, 1000, 10).astype(np.uint32))]
    cache = rc.HybridCache(kv_slots=2048, page_size=16, mamba_slots=8)
    model, storage = model_for(cache)
    sched = sv.Scheduler(cache, rc.TransferEngine(cache, storage), model, max_running=1)
    sched.add(jobs)
    counters = sched.run()
    assert [hit for _, hit, _ in counters.served] == [0, 320]
    assert (model.mismatches, model.samples) == (0, 32)
    assert cache.stats()["finish_states_lost"] == 0
    cache.audit()


class SlowCopies(rc.TransferEngine):
    """A CPU engine whose submitted copies are still running at every poll (a GPU's,
    behind the compute); `synchronize` waits for them."""

    waiting = False

    def poll(self) -> list[rc.TransferBatch]:
        return super().poll() if self.waiting else []

    def synchronize(self) -> list[rc.TransferBatch]:
        self.waiting = True
        try:
            return super().synchronize()
        finally:
            self.waiting = False


def test_a_turns_end_state_waits_for_the_state_slots_copies_in_flight_hold() -> None:
    # Three state slots: a load-back of a request aborted since holds two until its
    # copies end, and the running request the third. At its last whole page (12 of the
    # 13 tokens it feeds, pages of 4) its checkpoint finds no slot: the scheduler waits
    # for the copies and checkpoints again, so the next turn resumes from 12.
    c = rc.HybridCache(
        kv_slots=128, page_size=4, mamba_slots=3, host_kv_slots=128, host_mamba_slots=4
    )
    c.insert([1, 2, 3, 4], c.alloc_kv(4), mamba_slot=c.alloc_mamba())
    run_all(c)
    c.evict(kv_tokens=4)  # [1, 2, 3, 4] and its state are on the host only
    model, storage = model_for(c)
    engine = SlowCopies(c, storage)
    r = c.admit([1, 2, 3, 4, 5])
    assert r is not None
    lb = c.load_back(r)
    assert lb is not None
    engine.submit(lb.batch)
    lb.commit()
    c.abort(r)
    assert (c.available_mamba(), c.stats()["mamba_draining_slots"]) == (1, 2)
    first = Job(np.arange(50, 60, dtype=np.uint32), np.arange(80, 84, dtype=np.uint32))
    second = Job(np.concatenate([first.prompt, first.output, [70, 71]]).astype(np.uint32),
                 np.array([90, 91], dtype=np.uint32))  # fmt: skip
    sched = sv.Scheduler(c, engine, model, max_running=1)
    sched.add([first, second])
    counters = sched.run()
    assert (counters.end_state_waits, counters.copy_waits) == (1, 1)
    assert [hit for _, hit, _ in counters.served] == [0, 12]
    assert (model.mismatches, model.samples) == (0, 6)
    assert c.stats()["finish_states_lost"] == 0
    c.audit()


def test_short_of_state_slots_every_turn_keeps_its_end_state() -> None:
    # 16 state slots and the host tier: at their last whole page, turns often find every
    # slot held by running requests, load-backs in flight and states the step's backups
    # read. The scheduler runs those batches, waits for those copies and checkpoints
    # again, so that no turn loses its end state (41 of these 64 did before), and the
    # next turns resume from them, their samples checked.
    cfg = sv.ReplayConfig(mamba_slots=16, attention_only=False)
    cache = cfg.cache()
    model, storage = model_for(cache)
    sched = cfg.scheduler(cache, rc.TransferEngine(cache, storage), model)
    sched.add(sv.load("multiturn", 64))
    counters = sched.run()
    assert counters.end_state_waits > 0  # the case arose
    assert cache.stats()["finish_states_lost"] == 0
    assert counters.finished == 64
    assert model.mismatches == 0
    cache.audit()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("workload", "requests", "states", "oracle"),
    [("gsp", 256, 16, False), ("multiturn", 300, 16, False), ("mixed", 150, 32, True)],
)
def test_every_prompt_token_is_a_hit_or_computed(
    workload: str, requests: int, states: int, oracle: bool
) -> None:
    # With the host tier most of these load-backs restore a state alone, its node's KV
    # still on the device (on `gsp` every one: 0 tokens copied). The device KV such a
    # load makes usable is not recomputed: it counts as restored hits, and in compute
    # saved. Without retractions or failed copies, the hits and the prompt tokens
    # computed add up to the prompts.
    cfg = sv.ReplayConfig(mamba_slots=states, oracle=oracle, attention_only=False)
    r, _ = sv.replay(sv.load(workload, requests), cfg)
    assert (r["audit"], r["pools_full_at_end"], r["mismatches"]) == ("pass", True, 0)
    assert r["samples_checked"] == (r["output_tokens"] if oracle else 0)
    assert (r["retractions"], r["batches_failed"]) == (0, 0)
    assert r["restored_hit_tokens"] > 0  # state-only load-backs arose
    assert r["host_hit_tokens"] == r["loaded_tokens"]  # the KV copied back
    hits = r["device_hit_tokens"] + r["host_hit_tokens"] + r["restored_hit_tokens"]
    assert r["prefill_tokens"] + hits == r["prompt_tokens"]
    if oracle:
        return
    # Compute saved sums each request's reused prefix (`served`): the restored tokens are
    # in it, beside the device hits and the tokens loaded back.
    cache = cfg.cache()
    sched = cfg.scheduler(cache, sv.InstantEngine(cache), None)
    sched.add(sv.load(workload, requests))
    c = sched.run()
    assert c.restored_hit_tokens > 0
    assert sum(d for _, d, _ in c.served) == c.device_hit_tokens
    assert sum(load for _, _, load in c.served) == c.host_hit_tokens + c.restored_hit_tokens
    assert c.prefill_tokens + sum(d + load for _, d, load in c.served) == c.prompt_tokens


def test_a_request_too_big_for_the_pool_is_rejected_and_the_rest_served() -> None:
    jobs = jobs_of([1] * 100, [2] * 5000, [3] * 100)
    cfg = small(kv_slots=1024, mamba_slots=8, host_kv_slots=0)
    r, _ = sv.replay(jobs, cfg)
    ok(r)
    assert (r["rejected"], r["requests"]) == (1, 2)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"max_running": 0}, "max_running"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"step_tokens": -1}, "step_tokens"),
        ({"load_back_quota": -1}, "load_back_quota"),
    ],
)
def test_bad_scheduler_arguments_are_named(kwargs: dict[str, int], name: str) -> None:
    cache = rc.HybridCache(kv_slots=64)
    with pytest.raises(ValueError, match=f"^{name}: "):
        sv.Scheduler(cache, sv.InstantEngine(cache), **kwargs)


def test_a_bad_failure_rate_is_named() -> None:
    cache = rc.HybridCache(kv_slots=64)
    storage = sv.ChecksumModel.storage_for(cache)
    with pytest.raises(ValueError, match=r"^rate: must be in \[0, 1\]"):
        sv.FaultyEngine(cache, storage, 1.5)


@pytest.mark.slow
def test_without_a_model_the_scheduler_makes_the_same_cache_calls() -> None:
    cfg = small(host_kv_slots=0)
    counts = []
    for with_model in (True, False):
        cache = cfg.cache()
        if with_model:
            model, storage = model_for(cache)
            sched = cfg.scheduler(cache, rc.TransferEngine(cache, storage), model)
        else:
            sched = cfg.scheduler(cache, sv.InstantEngine(cache), None)
        sched.add(MIXED)
        c = sched.run()
        s = cache.stats()
        counts.append((c.device_hit_tokens, s["admits"], s["extends"], s["checkpoints"]))
        assert sv.clear(cache, sched.engine)
    assert counts[0] == counts[1]


# ------------------------------------------------------------ broken engines are caught


class SkipCow(rc.TransferEngine):
    """Skips the copy-on-write copies (the request computes from an unfilled slot)."""

    def copy_batch(self, batch: rc.TransferBatch) -> None:
        if batch.kind != "cow":
            super().copy_batch(batch)


class SkipLoadBackState(rc.TransferEngine):
    """Copies a load-back's KV but not its state: the seed's bug class."""

    def copy_batch(self, batch: rc.TransferBatch) -> None:
        for c in batch.copies:
            if not (batch.kind == "load_back" and c.pool == "mamba"):
                self._copy(c)


class LoadsBeforeCompute(rc.TransferEngine):
    """Runs host-to-device copies without waiting for the compute reading their slots."""

    def submit(self, batch: rc.TransferBatch) -> None:
        after, self._after = self._after, None
        try:
            super().submit(batch)
        finally:
            self._after = after


class SkipsAnArray(rc.TransferEngine):
    """Copies only the first array of each pool (K, conv): V and SSM are never copied."""

    def copy_batch(self, batch: rc.TransferBatch) -> None:
        for cp in batch.copies:
            src = self.storage.pool(cp.pool, cp.src_tier).arrays[0]
            dst = self.storage.pool(cp.pool, cp.dst_tier).arrays[0]
            dst[:, cp.dst] = src[:, cp.src]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("engine", "policy"),
    [
        (SkipCow, "write_through"),
        (SkipLoadBackState, "write_through"),
        (LoadsBeforeCompute, "write_through_selective"),
        (LoadsBeforeCompute, "write_back"),
        (SkipsAnArray, "write_through"),
    ],
)
def test_the_oracle_catches_a_broken_engine(engine: type, policy: str) -> None:
    cfg = small(write_policy=policy, page_size=16)
    cache = cfg.cache()
    model, storage = model_for(cache)
    # 300 requests: enough load-backs under every policy that one lands on slots a
    # queued step still reads (with 200, write-back's 17 happen not to). The replay
    # stops at the first mismatch: that is all this test needs to see.
    sched = cfg.scheduler(cache, engine(cache, storage), model)
    sched.add(sv.mixed(300))
    while (sched.waiting or sched.running) and model.mismatches == 0:
        sched.step()
    assert model.mismatches > 0
    sched.stop()
    cache.audit()
    assert cache.stats()["kv_request_slots"] == 0
    # The same replay with the real engine is exact.
    assert real_engine_mismatches(policy) == 0


@functools.cache
def real_engine_mismatches(policy: str) -> int:
    """Mismatches of the broken-engine test's replay with the real engine (one run per policy)."""
    cfg = small(write_policy=policy, page_size=16)
    cache = cfg.cache()
    model, storage = model_for(cache)
    sched = cfg.scheduler(cache, rc.TransferEngine(cache, storage), model)
    sched.add(sv.mixed(300))
    sched.run()
    return model.mismatches


# --------------------------------------------------------------------------- the CLI


API_KEYS = [
    "requests",
    "prompt_tokens",
    "output_tokens",
    "device_hit_tokens",
    "host_hit_tokens",
    "device_hit_rate",
    "attention_only_hit_rate",
    "hit_rate_ratio",
    "cow_copies",
    "backups",
    "demotions",
    "load_backs_committed",
    "load_backs_called_off",
    "load_backs_failed",
    "evicted_kv_tokens",
    "evicted_mamba_states",
    "retractions",
    "mismatches",
    "audit",
    "pools_full_at_end",
    "seconds",
]


def test_replay_json_has_the_api_keys(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["replay", "--requests", "80", "--kv-slots", "8192", "--mamba-slots", "24"]
    assert cli.main([*argv, "--host-kv-slots", "32768", "--json", "--quiet"]) == 0
    report = json.loads(capsys.readouterr().out)
    for key in API_KEYS:
        assert key in report, key
    assert report["requests"] == 80
    assert report["mismatches"] == 0
    assert report["audit"] == "pass"
    assert report["pools_full_at_end"] is True


def test_replay_prints_a_report_table(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["replay", "--requests", "40", "--kv-slots", "4096", "--quiet", "--workload", "gsp"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    for row in ("device hit tokens", "load-backs called off", "oracle mismatches", "audit"):
        assert row in out


def test_workload_then_replay_of_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "mt.jsonl"
    assert cli.main(["workload", "multiturn", "--out", str(path), "--requests", "30"]) == 0
    assert len(path.read_text().splitlines()) == 30
    argv = ["replay", "--workload", str(path), "--json", "--quiet", "--kv-slots", "4096"]
    assert cli.main([*argv, "--no-attention-only"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["requests"] == 30
    assert report["device_hit_tokens"] > 0  # later rounds resume earlier ones


def test_replay_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "r.png"
    argv = ["replay", "--requests", "40", "--kv-slots", "8192", "--quiet", "--json"]
    assert cli.main([*argv, "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_replay_exits_1_when_the_oracle_sees_a_mismatch(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sv.FaultyEngine, "copy_batch", SkipCow.copy_batch)
    argv = ["replay", "--requests", "80", "--kv-slots", "8192", "--mamba-slots", "24"]
    assert cli.main([*argv, "--json", "--quiet", "--no-attention-only"]) == 1
    assert json.loads(capsys.readouterr().out)["mismatches"] > 0


# ---------------------------------------------------------------------------- the bench


@pytest.mark.slow
def test_bench_makes_the_replays_cache_calls_and_times_every_one() -> None:
    from radixcache.serving.bench import bench

    cfg = small()
    r = bench(MIXED, cfg)
    replayed, _ = sv.replay(MIXED, cfg)
    # The same scheduler decisions: the same hits, device and host.
    assert r["hit_rate"] == replayed["device_hit_rate"]
    assert r["host_hit_rate"] == replayed["host_hit_rate"] > 0
    assert r["requests"] == len(MIXED)
    for op in ("admit", "extend", "checkpoint", "finish", "load_back", "commit", "batch"):
        assert r["ops"][op]["calls"] > 0, op
        assert 0 < r["ops"][op]["p50_us"] <= r["ops"][op]["p99_us"]
    assert r["ops"]["admit"]["calls"] == len(MIXED) + r["retractions"]
    # Decode steps go to the cache as one extend_batch each.
    assert r["ops"]["extend_batch"]["calls"] > 0
    assert r["pools_full_at_end"] is True
    assert "per_request_us" not in r
    assert sum(o["share"] for o in r["ops"].values()) == pytest.approx(1.0)
    assert r["ns_per_prompt_token"] == pytest.approx(r["cache_seconds"] * 1e9 / r["prompt_tokens"])
    assert 0 < r["us_per_request"] <= r["p99_us"]
    assert r["cache_seconds"] < r["wall_seconds"]


def test_bench_samples_are_each_finished_requests_cache_time() -> None:
    from radixcache.serving.bench import bench

    r = bench(MIXED, small(host_kv_slots=0), samples=True)
    per = r["per_request_us"]
    assert len(per) == r["requests"]
    assert min(per) > 0
    assert sorted(per)[len(per) // 2] == pytest.approx(r["us_per_request"], rel=0.2)
    assert sum(per) <= r["cache_seconds"] * 1e6


def test_the_prompt_is_cached_once_prefilled_for_requests_admitted_meanwhile() -> None:
    """A request admitted while another with the same prompt decodes reuses that prompt."""
    prompt = list(range(1, 161))
    jobs = jobs_of(prompt, prompt, out=30)
    cache = rc.HybridCache(kv_slots=1024, page_size=16)
    sched = sv.Scheduler(cache, sv.InstantEngine(cache), max_running=2)
    sched.add(jobs[:1])
    sched.step()  # the first request prefills its whole prompt, and decodes from here
    assert sched.running[0].fed == len(prompt)
    sched.add(jobs[1:])
    sched.step()
    second = sched.running[1]
    assert second.device_hit == 144, "the first request's prompt, less its last page"
    sched.run()
    cache.audit()


def test_bench_takes_lists_or_arrays_with_the_same_outcome() -> None:
    from radixcache.serving.bench import bench

    cfg = small(host_kv_slots=0)
    lists, arrays = bench(MIXED, cfg), bench(MIXED, cfg, numpy_tokens=True)
    assert (lists["tokens"], arrays["tokens"]) == ("list", "numpy")
    assert lists["hit_rate"] == arrays["hit_rate"]
    assert {k: v["calls"] for k, v in lists["ops"].items()} == {
        k: v["calls"] for k, v in arrays["ops"].items()
    }


def test_bench_command(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "--requests", "60", "--kv-slots", "8192", "--quiet"]
    assert cli.main([*argv, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    for key in ("ns_per_prompt_token", "us_per_request", "p99_us", "hit_rate", "ops"):
        assert key in r, key
    assert cli.main([*argv, "--numpy"]) == 0
    out = capsys.readouterr().out
    assert "per operation" in out
    assert "numpy" in out
    assert cli.main(["bench", "--workload", "nope"]) == 2
    assert cli.main([*argv, "--no-branch-checkpoints", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["ops"]["checkpoint"]["calls"] <= r["ops"]["checkpoint"]["calls"]


def test_bench_command_exits_1_when_a_pool_is_not_full_at_the_end(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A leak (a pool short once the cache is emptied) fails the run, as in replay."""
    import radixcache.serving.bench as bench_module

    monkeypatch.setattr(bench_module, "clear", lambda cache, engine: False)
    argv = ["bench", "--requests", "10", "--kv-slots", "8192", "--quiet"]
    assert cli.main([*argv, "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["pools_full_at_end"] is False
    assert cli.main(argv) == 1
    assert "pools full at end" in capsys.readouterr().out


def test_a_scheduler_that_cannot_progress_says_so() -> None:
    """A bug that stalls every request is reported, not looped on forever."""
    cache = rc.HybridCache(kv_slots=1024)
    sched = sv.Scheduler(cache, sv.InstantEngine(cache))
    sched.add(jobs_of([1, 2, 3]))
    sched._admit = lambda: None  # type: ignore[method-assign]  # nothing is ever admitted
    with pytest.raises(RuntimeError, match=r"^no progress in 1000 steps: 1 waiting, 0 running"):
        sched.run()


# ---------------------------------------------------------------- compute saved, bound


#: A one-layer attention model of width 1: a token at position p costs 8 + 4 (p + 1)
#: FLOPs (projections 2·1·3 + 2·1·1, scores and values 4 per position), so the first n
#: tokens cost 8 n + 2 n (n + 1).
TINY = ModelShape(
    attention_layers=1, mamba_layers=0, mlp_layers=0, hidden=1, heads=1, kv_heads=1, head_dim=1
)


def test_the_cost_model_adds_up_each_positions_flops() -> None:
    assert TINY.token_flops() == (8, 4)
    assert TINY.prefill_flops(64) == 8 * 64 + 2 * 64 * 65 == 8832
    shape = ModelShape()
    a, b = shape.token_flops()
    assert shape.prefill_flops(1000) == sum(a + b * (p + 1) for p in range(1000))
    assert 13e9 < a < 15e9  # an 8B-parameter model: about 2 FLOPs per parameter
    assert b == 4 * 4 * 32 * 128  # 4 attention layers, 32 heads of 128


def test_compute_saved_is_the_share_of_the_prefill_flops_hits_skip() -> None:
    assert compute_saved_ratio([], TINY) == 0.0
    assert compute_saved_ratio([(80, 0), (80, 0)], TINY) == 0.0
    assert compute_saved_ratio([(80, 80)], TINY) == 1.0
    # Deep tokens cost more than shallow ones: the first half saves less than half.
    assert compute_saved_ratio([(80, 40)], TINY) < 0.5
    constant = ModelShape(attention_layers=0)  # Mamba and MLP only: tokens cost the same
    assert compute_saved_ratio([(80, 40), (120, 0)], constant) == pytest.approx(40 / 200)


#: TINY's attention layer as an SWA layer of window 4: a token at position p costs
#: 8 + 4 min(p + 1, 4) FLOPs.
TINY_SWA = dataclasses.replace(TINY, attention_layers=0, swa_layers=1, swa_window=4)


def test_an_swa_layer_attends_to_its_window_only() -> None:
    assert TINY_SWA.token_flops() == (8, 0)
    assert TINY_SWA.swa_flops() == 4
    for n in (0, 1, 3, 4, 5, 64):
        assert TINY_SWA.prefill_flops(n) == sum(8 + 4 * min(p + 1, 4) for p in range(n)), n
    # Past the window every token costs the same (12): a hit on half of a prompt saves
    # about half (the first 3 tokens cost less), where full attention's deep tokens make
    # it about a quarter.
    assert TINY_SWA.prefill_flops(40) == 8 * 40 + 4 * (1 + 2 + 3 + 4 * 37) == 936
    assert TINY_SWA.prefill_flops(80) == 8 * 80 + 4 * (1 + 2 + 3 + 4 * 77) == 1896
    assert compute_saved_ratio([(80, 40)], TINY_SWA) == pytest.approx(936 / 1896)
    assert compute_saved_ratio([(80, 40)], TINY) == pytest.approx(3600 / 13600)
    # The default shape with half its attention layers as SWA layers of 1,024.
    shape = ModelShape().with_swa(1024, 0.5)
    assert (shape.attention_layers, shape.swa_layers, shape.swa_window) == (2, 2, 1024)
    a, b = shape.token_flops()
    s = shape.swa_flops()
    assert a == ModelShape().token_flops()[0], "SWA layers keep the projections"
    assert shape.prefill_flops(3000) == sum(
        a + b * (p + 1) + s * min(p + 1, 1024) for p in range(3000)
    )
    assert shape.prefill_flops(3000) < ModelShape().prefill_flops(3000)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"swa_layers": -1}, "swa_layers: must be at least 0"),
        ({"swa_window": -1}, "swa_window: must be at least 0"),
        ({"swa_layers": 2}, "swa_window: must be at least 1 with swa_layers=2"),
    ],
)
def test_a_bad_swa_shape_is_a_value_error_naming_the_field(
    kwargs: dict[str, int], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        ModelShape(**kwargs)


def test_with_swa_names_a_bad_share_or_window() -> None:
    for share in (-0.1, 1.5):
        with pytest.raises(ValueError, match="share: must be in"):
            ModelShape().with_swa(8, share)
    with pytest.raises(ValueError, match="swa_window"):
        ModelShape().with_swa(0, 0.5)
    assert ModelShape().with_swa(0, 0.0) == ModelShape(), "no layer moved, no window needed"


def test_the_replay_counts_an_swa_models_compute_with_its_swa_layers() -> None:
    plain = sv.ReplayConfig()
    assert plain.model_shape() == plain.shape
    swa = sv.ReplayConfig(swa_slots=4096, swa_window=512)
    assert swa.model_shape() == ModelShape().with_swa(512, 0.5)
    assert sv.ReplayConfig(
        swa_slots=4096, swa_window=512, layers=1, swa_layers=3
    ).model_shape() == (ModelShape().with_swa(512, 0.75))
    # A shape with SWA layers of its own is counted as given.
    own = ModelShape(swa_layers=1, swa_window=64)
    assert sv.ReplayConfig(swa_slots=4096, swa_window=512, shape=own).model_shape() == own


def three_sharing_a_system_prompt() -> list[Job]:
    """Three requests: a 64-token system prompt, a 16-token question, 3 output tokens."""
    system = list(range(100, 164))
    return jobs_of(*(system + list(range(200 + 16 * i, 216 + 16 * i)) for i in range(3)))


def test_compute_saved_and_the_offline_bound_on_a_case_worked_by_hand() -> None:
    """One request at a time: the first caches no state the second can use (it ends at
    its prompt's last page, past the branch); the second stops at the branch point (64)
    and checkpoints; the third reuses those 64 tokens. Every figure follows."""
    cfg = sv.ReplayConfig(kv_slots=1024, mamba_slots=8, host_kv_slots=0, max_running=1, shape=TINY)
    r, _ = sv.replay(three_sharing_a_system_prompt(), dataclasses.replace(cfg, offline_bound=True))
    ok(r)
    assert r["device_hit_tokens"] == 64
    assert r["compute_saved_ratio"] == pytest.approx(8832 / (3 * 13600))
    assert r["request_hit_rate"] == pytest.approx(1 / 3)
    # Attention only: the second and third reuse the 64 tokens.
    assert r["attention_only_compute_saved_ratio"] == pytest.approx(2 * 8832 / (3 * 13600))
    for key in ("offline_bound", "offline_lru", "offline_possible"):
        assert r[f"{key}_hit_rate"] == pytest.approx(64 / 240)
        assert r[f"{key}_request_hit_rate"] == pytest.approx(1 / 3)
    assert r["offline_bound_ratio"] == pytest.approx(0.5)
    plain, _ = sv.replay(three_sharing_a_system_prompt(), cfg)
    assert plain["offline_bound_hit_rate"] is None
    assert plain["offline_bound_ratio"] is None


def test_a_cold_cache_saves_no_compute() -> None:
    jobs = jobs_of(*([i] * 40 for i in range(1, 6)))
    r, _ = sv.replay(jobs, sv.ReplayConfig(kv_slots=1024, mamba_slots=8, host_kv_slots=0))
    ok(r)
    assert r["device_hit_tokens"] == 0
    assert r["compute_saved_ratio"] == 0.0
    assert r["attention_only_compute_saved_ratio"] == 0.0


def served(*steps: tuple[int, int]) -> list[Event]:
    """Each ``(state, capacity)``: a request (one per step) uses the state, then offers it
    (a miss recomputes it and checkpoints there)."""
    out = []
    for i, (state, cap) in enumerate(steps):
        out += [
            Event("use", (state,), (16,), cap, i, i),
            Event("offer", (state,), (16,), cap, i, i),
        ]
    return out


def hit_uses(hits: list[int]) -> list[int]:
    """The requests whose use hit, in `served` events."""
    return [i // 2 for i, h in enumerate(hits) if h]


def test_belady_keeps_what_is_needed_soonest_where_lru_keeps_nothing() -> None:
    """a b c a b c a b c with room for two: LRU always evicts the next one needed (no
    hit); Belady's rule keeps a and b and lets c go by (hits at 3, 4, 6, 7)."""
    events = served(*((s, 2) for s in [0, 1, 2] * 3))
    assert hit_uses(simulate(events, "belady")) == [3, 4, 6, 7]
    assert hit_uses(simulate(events, "lru", hot_cap=1)) == []
    b = bound(events, hot_cap=1)
    assert (b.requests, b.possible_requests, b.belady_requests, b.lru_requests) == (9, 9, 4, 0)
    assert b.belady_tokens == 4 * 16


def test_belady_lets_the_latest_needed_go_when_the_capacity_drops() -> None:
    # a, b kept; the room drops to one: b (needed later) goes, a is kept and hit.
    events = served((0, 2), (1, 2), (2, 1), (0, 1), (1, 1))
    assert hit_uses(simulate(events, "belady")) == [3]


def test_a_miss_is_offered_again_only_with_the_requests_next_offer() -> None:
    """A request that missed recomputes the state; until its prefill passes it (its next
    offer) a second request cannot use it."""
    events = [
        Event("use", (0,), (16,), 4, 0, 0),  # the real run hit it: it offers no state 0
        Event("use", (0,), (16,), 4, 1, 1),  # before request 0's prefill has passed it
        Event("offer", (7,), (32,), 4, 0, 2),  # request 0 checkpoints deeper
        Event("use", (0,), (16,), 4, 2, 3),
    ]
    for rule in ("belady", "lru"):
        assert simulate(events, rule, hot_cap=3) == [0, 0, 0, 16], rule


def test_lru_cannot_evict_a_state_offered_in_the_same_step() -> None:
    """Its copy is in flight: a second checkpoint in the step displaces an older state."""
    events = [
        Event("offer", (0,), (16,), 2, 0, 0),
        Event("use", (0,), (16,), 2, 1, 1),  # 0 is used: protected over unused states
        Event("offer", (1,), (32,), 2, 2, 2),
        Event("offer", (2,), (48,), 2, 3, 2),  # 1 is in flight: 0 goes
        Event("use", (0,), (16,), 2, 4, 3),
    ]
    assert simulate(events, "lru", hot_cap=2) == [0, 16, 0, 0, 0]


def test_a_use_hits_the_deepest_state_kept_on_its_path() -> None:
    offers = [Event("offer", (s,), (16 * (s + 1),), 4, 0, s) for s in range(3)]
    deep_first = Event("use", (2, 1, 0), (48, 32, 16), 4, 1, 3)
    assert simulate([*offers, deep_first], "belady")[-1] == 48
    assert simulate([*offers, deep_first], "lru", hot_cap=3)[-1] == 48
    # With room for one, each offer displaces the last: LRU has the deepest.
    one = [e._replace(capacity=1) for e in offers]
    assert simulate([*one, deep_first._replace(capacity=1)], "lru")[-1] == 48
    # Without the deepest, a shallower one serves.
    assert simulate([*offers[:2], deep_first], "belady")[-1] == 32
    with pytest.raises(ValueError, match=r"^rule: must be 'belady' or 'lru', got 'fifo'"):
        simulate(offers, "fifo")


def subsets(of: frozenset[int], most: int) -> list[frozenset[int]]:
    return [
        frozenset(c) for n in range(min(most, len(of)) + 1) for c in itertools.combinations(of, n)
    ]


def best_by_search(events: list[Event]) -> int:
    """The most uses any choice of what to keep hits (exhaustive; one state per use)."""
    best: dict[frozenset[int], int] = {frozenset(): 0}
    for e in events:
        nxt: dict[frozenset[int], int] = {}
        for kept, hits in best.items():
            for before in subsets(kept, e.capacity):  # evict anything, down to the room
                got = hits + (e.kind == "use" and e.states[0] in before)
                offered = before | {e.states[0]} if e.kind == "offer" else before
                for after in subsets(offered, e.capacity):  # keep an offered state or not
                    nxt[after] = max(nxt.get(after, -1), got)
        best = nxt
    return max(best.values())


def events_of(steps: list[tuple[str, int, int]]) -> list[Event]:
    events = []
    for i, (kind, state, cap) in enumerate(steps):
        if kind == "use":  # a use, then its request's checkpoint there
            events.append(Event("use", (state,), (16,), cap, i, i))
        events.append(Event("offer", (state,), (16,), cap, i, i))
    return events


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["use", "offer"]), st.integers(0, 3), st.integers(0, 3)),
        max_size=12,
    )
)
def test_belady_and_lru_never_beat_the_exhaustive_search(
    steps: list[tuple[str, int, int]],
) -> None:
    """Neither Belady's rule nor the cache's LRU order hits more than the best choice an
    exhaustive search finds: both keep only states they were offered, within the
    capacity. Belady's rule is not always that best: greedy keeping of the state needed
    soonest can lose one a later use needed (hypothesis found such sequences, with a fixed
    capacity too), and it can even hit fewer than LRU (`..._a_state_offered_again_...`
    below), so the offline bound is Belady's rule, not a proven ceiling."""
    events = events_of(steps)
    best = best_by_search(events)
    assert sum(1 for h in simulate(events, "belady") if h) <= best
    for hot_cap in range(4):
        assert sum(1 for h in simulate(events, "lru", hot_cap) if h) <= best


def test_belady_can_lose_to_lru_when_a_state_is_offered_again_before_its_use() -> None:
    """What hypothesis found: with room for one, Belady's rule keeps state 2 (needed
    first) over state 1, although 2 is offered again, with room for two, before its use:
    keeping 1 then would have hit both. LRU, which keeps the newest, happens to. The
    offline bound does not look past a state's next offer."""
    steps = [("use", 2, 1), ("use", 1, 1), ("offer", 2, 2), ("use", 2, 2), ("use", 1, 1)]
    events = events_of(steps)
    assert sum(1 for h in simulate(events, "belady") if h) == 1
    assert sum(1 for h in simulate(events, "lru", 0) if h) == 2
    assert best_by_search(events) == 2


@pytest.mark.slow
def test_on_gsp_the_bound_is_above_lru_and_its_lru_model_near_the_cache() -> None:
    jobs = sv.gsp(256)
    cfg = sv.ReplayConfig(
        kv_slots=65536, mamba_slots=24, host_kv_slots=0, max_running=8, eviction_policy="lru"
    )
    r, _ = sv.replay(jobs, dataclasses.replace(cfg, offline_bound=True, attention_only=False))
    ok(r)
    assert r["offline_possible_hit_rate"] >= r["offline_bound_hit_rate"]
    assert r["offline_bound_hit_rate"] >= r["offline_lru_hit_rate"]
    assert r["offline_bound_hit_rate"] >= r["device_hit_rate"]
    assert r["offline_lru_hit_rate"] == pytest.approx(r["device_hit_rate"], abs=0.05)


def test_a_replay_without_the_oracle_makes_the_same_cache_calls() -> None:
    """The sweep takes its figures without the model: the same hits, nothing sampled."""
    cfg = small(host_kv_slots=0, offline_bound=True)
    checked, _ = sv.replay(MIXED[:60], cfg)
    fast, _ = sv.replay(MIXED[:60], dataclasses.replace(cfg, oracle=False))
    ok(checked)
    assert fast["samples_checked"] == fast["mismatches"] == 0
    assert fast["audit"] == "pass"
    assert fast["pools_full_at_end"]
    for key in ("device_hit_tokens", "cow_copies", "evicted_mamba_states", "steps"):
        assert fast[key] == checked[key], key
    assert fast["offline_bound_hit_rate"] == checked["offline_bound_hit_rate"]
