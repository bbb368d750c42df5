"""Sliding-window attention (SWA) end to end: Storage, the engine, the checksum model, replay.

The checksum model's SWA layers read only the last W tokens: a corrupted in-window SWA
slot changes the sample, an out-of-window one cannot. Replays of the SWA models must
give the reference's samples (0 mismatches) on every workload, with injected failures.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import radixcache as rc
import radixcache.serving as sv
from radixcache.serving.harness import SWA_COUNTERS

# ---------------------------------------------------------------------------- Storage


def swa_cache(**kw: Any) -> rc.HybridCache:
    base: dict[str, Any] = {"kv_slots": 64, "page_size": 2, "swa_slots": 16, "swa_window": 4}
    base.update(kw)
    return rc.HybridCache(**base)


def test_storage_sizes_the_swa_pool_from_the_cache() -> None:
    s = rc.Storage.for_cache(swa_cache(), layers=3, swa_layers=2, kv_heads=2, head_dim=4)
    k, v = s.swa["device"]
    assert k.shape == v.shape == (2, 16, 2, 4)
    assert s.pool("swa", "device").slots == 16
    assert not s.has("swa", "host")
    assert "swa[device]: 16 slots" in repr(s)
    # Without SWA layers, no SWA pool.
    plain = rc.Storage.for_cache(rc.HybridCache(kv_slots=8), layers=1)
    assert plain.swa == {}


def two(shape: tuple[int, ...], dtype: str = "float16") -> tuple[np.ndarray, np.ndarray]:
    return np.zeros(shape, dtype=dtype), np.zeros(shape, dtype=dtype)


def test_storage_checks_the_swa_arrays_as_it_checks_kv() -> None:
    kv = {"device": two((2, 8, 1, 4))}
    with pytest.raises(ValueError, match=r"^swa: unknown tier 'disk'"):
        rc.Storage(kv=kv, swa={"disk": two((2, 8, 1, 4))})
    with pytest.raises(ValueError, match=r"^swa\['device'\]: expected two arrays"):
        rc.Storage(kv=kv, swa={"device": (np.zeros((2, 8, 1, 4)),)})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match=r"^swa: expected a mapping"):
        rc.Storage(kv=kv, swa=[two((2, 8, 1, 4))])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^swa\['host'\]\[0\]: dtype float32 differs"):
        rc.Storage(swa={"device": two((2, 8, 1, 4)), "host": two((2, 8, 1, 4), "float32")})
    host = (np.zeros((2, 8, 1, 4), dtype="float16"), np.zeros((3, 8, 1, 4), dtype="float16"))
    with pytest.raises(ValueError, match=r"^swa\['host'\]\[1\]: 3 layers of rows"):
        rc.Storage(swa={"device": two((2, 8, 1, 4)), "host": host})
    with pytest.raises(ValueError, match=r"^swa\['device'\]: the arrays disagree on the slot"):
        rc.Storage(swa={"device": (np.zeros((2, 8, 1, 4)), np.zeros((2, 6, 1, 4)))})
    shared = np.zeros((2, 8, 1, 4), dtype="float16")
    with pytest.raises(ValueError, match=r"^swa\['device'\]\[0\]: shares memory with kv"):
        rc.Storage(
            kv={"device": (shared, np.zeros_like(shared))},
            swa={"device": (shared[:], np.zeros_like(shared))},
        )
    with pytest.raises(ValueError, match=r"^swa_slots: expected a count >= 0"):
        rc.Storage.for_model(kv_slots=8, swa_slots=-1, layers=1)
    with pytest.raises(ValueError, match=r"^swa_layers: expected a count >= 1"):
        rc.Storage.for_model(kv_slots=8, swa_slots=8, layers=1, swa_layers=0)
    with pytest.raises(ValueError, match=r"^swa_slots: taken from the cache"):
        rc.Storage.for_cache(swa_cache(), layers=1, swa_slots=8)


def test_storage_without_the_caches_swa_pool_is_refused_naming_swa_slots() -> None:
    cache = swa_cache()
    no_swa = rc.Storage.for_model(kv_slots=64, layers=1)
    with pytest.raises(ValueError, match=r"^swa_slots: the cache has 16, the storage has no swa"):
        rc.TransferEngine(cache, no_swa)
    small = rc.Storage.for_model(kv_slots=64, swa_slots=8, layers=1)
    with pytest.raises(ValueError, match=r"^swa_slots: the cache has 16, the storage swa"):
        rc.TransferEngine(cache, small)


# ---------------------------------------------------------------------------- the engine


def copy(src_tier: str, dst_tier: str, src: list[int], dst: list[int]) -> SimpleNamespace:
    return SimpleNamespace(
        pool="swa", src_tier=src_tier, dst_tier=dst_tier, src=np.array(src), dst=np.array(dst)
    )


def test_the_cpu_engine_copies_swa_rows_between_tiers() -> None:
    cache = swa_cache()
    s = rc.Storage.for_model(
        kv_slots=64, swa_slots=16, host_swa_slots=8, layers=2, head_dim=2, dtype="int64"
    )
    e = rc.TransferEngine(cache, s)
    (dk, dv), (hk, hv) = s.swa["device"], s.swa["host"]
    dk[...] = np.arange(dk.size).reshape(dk.shape)
    dv[...] = -np.arange(dv.size).reshape(dv.shape)
    e.copy_batch(SimpleNamespace(copies=[copy("device", "host", [5, 0, 9], [1, 7, 2])]))  # type: ignore[arg-type]
    assert (hk[:, [1, 7, 2]] == dk[:, [5, 0, 9]]).all()
    assert (hv[:, [1, 7, 2]] == dv[:, [5, 0, 9]]).all()
    assert not hk[:, [0, 3, 4, 5, 6]].any()
    e.copy_batch(SimpleNamespace(copies=[copy("host", "device", [7], [3])]))  # type: ignore[arg-type]
    assert (dk[:, 3] == dk[:, 0]).all()
    assert (dv[:, 3] == dv[:, 0]).all()
    assert e.stats()["slots_copied"] == 4
    with pytest.raises(IndexError, match=r"^dst: slot out of range for the swa pool on the host"):
        e.copy_batch(SimpleNamespace(copies=[copy("device", "host", [0], [8])]))  # type: ignore[arg-type]


def test_the_cpu_engine_runs_the_swa_copies_of_a_backup() -> None:
    cache = swa_cache(host_kv_slots=64, host_swa_slots=32)
    s = rc.Storage.for_cache(cache, layers=2, head_dim=1, dtype="int64")
    assert s.pool("swa", "host").slots == 32
    e = rc.TransferEngine(cache, s)
    (dk, dv), (hk, hv) = s.swa["device"], s.swa["host"]
    dk[...] = np.arange(dk.size).reshape(dk.shape) + 1
    dv[...] = -dk
    slots = cache.alloc_kv(8)
    assert slots is not None
    cache.insert(list(range(1, 9)), slots)  # write-through: a backup, SWA pages with it
    batches = cache.take_batches()
    swa = [c for b in batches for c in b.copies if c.pool == "swa"]
    assert swa
    assert sum(e.run(b) for b in batches) == len(batches)
    for c in swa:
        assert (c.src_tier, c.dst_tier) == ("device", "host")
        assert (hk[:, c.dst] == dk[:, c.src]).all()
        assert (hv[:, c.dst] == dv[:, c.src]).all()
    missing = rc.Storage.for_model(kv_slots=64, swa_slots=16, host_kv_slots=64, layers=1)
    with pytest.raises(ValueError, match=r"^host_swa_slots: the cache has 32, the storage has"):
        rc.TransferEngine(cache, missing)


def test_swa_kv_survives_a_backup_and_a_load_back_through_the_cpu_engine() -> None:
    cache = swa_cache(host_kv_slots=64, host_swa_slots=32)
    s = rc.Storage.for_cache(cache, layers=2, swa_layers=3, kv_heads=2, head_dim=4, dtype="int64")
    e = rc.TransferEngine(cache, s)
    dk, dv = s.swa["device"]
    dk[...] = np.arange(dk.size).reshape(dk.shape) + 1
    dv[...] = -dk
    original = dk.copy(), dv.copy()
    slots = cache.alloc_kv(8)
    assert slots is not None
    cache.insert(list(range(1, 9)), slots)
    backed_up: dict[int, int] = {}  # host SWA slot -> the device slot it came from
    for b in cache.take_batches():
        backed_up.update(
            (int(h), int(d)) for c in b.copies if c.pool == "swa" for d, h in zip(c.src, c.dst)
        )
        assert e.run(b)
    assert backed_up
    cache.evict(kv_tokens=64)
    assert e.run_pending() == 0
    dk[...], dv[...] = 0, 0  # the device slots are reused meanwhile
    r = cache.admit(list(range(1, 11)))
    assert r is not None
    assert r.host_len == 8
    lb = cache.load_back(r)
    assert lb is not None
    with lb:
        swa = [c for c in lb.batch.copies if c.pool == "swa"]
        assert swa
        assert e.run(lb.batch)
        lb.commit()
    for c in swa:
        assert (c.src_tier, c.dst_tier) == ("host", "device")
        for h, d in zip(c.src, c.dst):
            assert (dk[:, d] == original[0][:, backed_up[int(h)]]).all()
            assert (dv[:, d] == original[1][:, backed_up[int(h)]]).all()
    cache.abort(r)
    cache.audit()


# ---------------------------------------------------------------------------- the model


def swa_model(window: int = 4, mamba: int = 0) -> tuple[sv.ChecksumModel, rc.HybridCache]:
    cache = rc.HybridCache(kv_slots=64, mamba_slots=mamba, swa_slots=32, swa_window=window)
    return sv.ChecksumModel(cache, sv.ChecksumModel.storage_for(cache)), cache


@pytest.mark.parametrize("mamba", [0, 2])
def test_the_swa_model_served_without_reuse_gives_the_reference_samples(mamba: int) -> None:
    """Decoding past the window: the reference slides its window as the model does."""
    model, _ = swa_model(window=3, mamba=mamba)
    assert sv.model_name(model.cache) == ("swa-hybrid" if mamba else "swa")
    prompt, output = [5, 9, 2, 7, 7, 1], [3, 3, 8, 0, 4]
    seq = prompt + output[:-1]
    kv, swa = np.arange(20, 40), np.arange(30, 10, -1)
    state = 0 if mamba else None
    got: list[int] = []
    n = len(prompt)
    model.forward(0, prompt, kv[:n], state, read=kv[:n], on_sample=got.append, swa=(swa[:n], 0))
    for i in range(n, len(seq)):
        model.forward(i, seq[i : i + 1], kv[i : i + 1], state, read=kv[: i + 1],
                      on_sample=got.append, swa=(swa[i - 2 : i + 1], i - 2))  # fmt: skip
    model.stream.synchronize()
    assert got == model.ref.samples(prompt, len(output), output)
    # The SWA layers count: without them the samples differ.
    assert got != sv.Reference(mamba_layers=2 if mamba else 0).samples(prompt, len(output), output)


PROMPT = [4, 8, 15, 16, 23, 42, 7, 9]
#: The reference's sample after `PROMPT`, with two SWA layers of window 4.
CLEAN = sv.Reference(mamba_layers=0, swa_layers=2, window=4).samples(PROMPT, 1)[0]


def sample_after(corrupt: tuple[str, int, int] | None) -> int:
    """Feed 7 tokens, corrupt one SWA row, then feed the 8th and sample (window 4)."""
    model, _ = swa_model(window=4)
    prompt = PROMPT
    kv, swa = np.arange(8), np.arange(10, 18)
    model.forward(0, prompt[:7], kv[:7], None, swa=(swa[:7], 0))
    model.stream.synchronize()
    if corrupt is not None:
        array, layer, position = corrupt
        getattr(model, array)[layer, swa[position]] ^= np.uint64(1)
    got: list[int] = []
    model.forward(7, prompt[7:], kv[7:], None, read=kv, on_sample=got.append, swa=(swa, 0))
    model.stream.synchronize()
    return got[0]


@pytest.mark.parametrize("array", ["swa_k", "swa_v"])
@pytest.mark.parametrize("layer", [0, 1])
def test_a_corrupted_in_window_swa_slot_changes_the_sample(array: str, layer: int) -> None:
    assert sample_after(None) == CLEAN
    for position in (4, 5, 6):  # the window of position 7 is 4..7
        assert sample_after((array, layer, position)) != CLEAN


@pytest.mark.parametrize("array", ["swa_k", "swa_v"])
def test_an_out_of_window_swa_slot_does_not_matter(array: str) -> None:
    for position in (0, 1, 2, 3):
        assert sample_after((array, 1, position)) == CLEAN


def test_the_model_refuses_swa_slots_that_do_not_cover_the_window() -> None:
    model, _ = swa_model(window=4)
    with pytest.raises(ValueError, match=r"^swa: \(swa_indices, swa_start\) is given exactly"):
        model.forward(0, [1, 2], np.arange(2), None)
    with pytest.raises(ValueError, match=r"^swa: slots of tokens 3..6 do not cover"):
        model.forward(5, [1], np.array([5]), None, read=np.arange(6), swa=([1, 2, 3], 3))
    plain = rc.HybridCache(kv_slots=16)
    attention = sv.ChecksumModel(plain, sv.ChecksumModel.storage_for(plain))
    with pytest.raises(ValueError, match=r"^swa: \(swa_indices, swa_start\) is given exactly"):
        attention.forward(0, [1], np.array([0]), None, swa=([0], 0))
    with pytest.raises(ValueError, match=r"^window: 4 with 0 swa_layers"):
        sv.Reference(window=4)


# ---------------------------------------------------------------------------- replay


def swa_config(model: str, **kw: Any) -> sv.ReplayConfig:
    base: dict[str, Any] = {
        "kv_slots": 8192,
        "mamba_slots": 24 if model == "swa-hybrid" else 0,
        "host_kv_slots": 0,
        "host_mamba_slots": 0,
        "swa_slots": 2048,
        "swa_window": 256,
        "max_running": 8,
        "chunk_size": 512,
    }
    base.update(kw)
    return sv.ReplayConfig(**base)


def ok(r: dict[str, Any]) -> None:
    assert r["mismatches"] == 0, r
    assert r["audit"] == "pass", r
    assert r["pools_full_at_end"], r
    assert r["rejected"] == 0, r
    assert r["samples_checked"] >= r["output_tokens"]


#: Small runs of the three workloads: prompts of several windows, shared prefixes.
WORKLOADS = {
    "gsp": sv.gsp(32, seed=3, prompts_per_group=8, system_len=640, question_len=64, output_len=24),
    "multiturn": sv.multiturn(30, seed=3, request_len=192, output_len=16),
    "mixed": sv.mixed(40, seed=3),
}


def check_swa_report(r: dict[str, Any], model: str) -> None:
    ok(r)
    assert r["model"] == model
    assert r["swa_window"] == 256
    assert r["swa_window_freed_pages"] > 0  # the windows moved on
    assert r["full_attention_hit_rate"] is not None
    assert r["swa_vs_full_hit_ratio"] == pytest.approx(
        r["device_hit_rate"] / r["full_attention_hit_rate"]
    )
    if model == "swa":  # its full-attention model is the attention-only one
        assert r["full_attention_hit_rate"] == r["attention_only_hit_rate"]


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
@pytest.mark.parametrize("model", ["swa", "swa-hybrid"])
def test_swa_replays_without_a_host_tier_give_the_reference_samples(
    workload: str, model: str
) -> None:
    r, _ = sv.replay(WORKLOADS[workload], swa_config(model, inject_failures=0.2))
    check_swa_report(r, model)
    if model == "swa-hybrid":  # copy-on-write batches (an swa model has none to fail)
        assert sum(r["injected_failures"].values()) > 0


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("workload", sorted(WORKLOADS))
@pytest.mark.parametrize("model", ["swa", "swa-hybrid"])
def test_swa_replays_with_a_host_tier_give_the_reference_samples(
    model: str, workload: str, policy: str
) -> None:
    cfg = swa_config(
        model,
        host_kv_slots=16384,
        host_swa_slots=4096,
        host_mamba_slots=48 if model == "swa-hybrid" else 0,
        write_policy=policy,
        inject_failures=0.2,
    )
    r, _ = sv.replay(WORKLOADS[workload], cfg)
    check_swa_report(r, model)
    assert r["swa_backed_up_pages"] > 0  # SWA KV went to the host ...
    if workload == "mixed" and policy != "write_back":
        assert r["swa_loaded_pages"] > 0  # ... and came back


def test_the_swa_comparison_is_the_same_model_with_full_attention() -> None:
    jobs = WORKLOADS["gsp"]
    cfg = swa_config("swa-hybrid")
    r, _ = sv.replay(jobs, cfg)
    ok(r)
    hybrid, _ = sv.replay(jobs, swa_config("swa-hybrid", swa_slots=0, swa_window=0))
    assert hybrid["model"] == "hybrid"
    assert r["full_attention_hit_rate"] == hybrid["device_hit_rate"]
    assert r["attention_only_hit_rate"] == hybrid["attention_only_hit_rate"]
    assert hybrid["full_attention_hit_rate"] is None
    assert hybrid["swa_vs_full_hit_ratio"] is None
    assert all(hybrid[k] == 0 for k in SWA_COUNTERS)
    skipped, _ = sv.replay(jobs, swa_config("swa-hybrid", attention_only=False))
    assert skipped["full_attention_hit_rate"] is None
    assert skipped["swa_vs_full_hit_ratio"] is None
