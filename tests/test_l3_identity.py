"""The L3 tier never serves another model's, rank's, layout's or kind's bytes.

Every key names the tier's identity (model, tensor/pipeline rank and size, page size,
host layout) and the object's kind, and every frame records both; a read checks them,
so an object that reaches a reader under its key anyway (a store shared with an
implementation that keys by page hash alone) is a miss, counted as foreign, and deleted.
The checksum model is the oracle: a replay whose samples depend on every byte it reads
counts a mismatch for any wrong byte served.

Also: a tier, a batch, a fetch and an engine belong to one cache (cross-use is refused,
naming the argument), a tier dropped while its reads run gives back what its fetches
hold, and one tier may be driven from several threads.
"""

from __future__ import annotations

import gc
import hashlib
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from radixcache import HybridCache, ObjectStore, Storage
from radixcache.engine import TransferEngine
from radixcache.l3 import L3Identity, L3Tier
from radixcache.serving import harness, workloads
from radixcache.serving.harness import ReplayConfig, replay

from l3_common import MODEL, Gated, L3Cache, PageHashKeys

TOKENS = list(range(100, 124))  # six pages of 4


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"file://{tmp_path / 'store'}"


def _writer_then_reader(
    url: str, first: ReplayConfig, second: ReplayConfig
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Replay `first` (its pools cleared into the store at the end), then `second`."""
    jobs = workloads.WORKLOADS["multiturn"](16, 0)
    a, _ = replay(jobs, first)
    assert (a["mismatches"], a["pools_full_at_end"]) == (0, True)
    assert a["l3_eviction_puts"] > 0
    b, _ = replay(jobs, second)
    assert (b["mismatches"], b["audit"], b["pools_full_at_end"]) == (0, "pass", True)
    assert b["samples_checked"] > 0
    return a, b


def _config(url: str, **kw: Any) -> ReplayConfig:
    # Large pools: the store is filled only when the first replay's pools are cleared.
    return ReplayConfig(l3=url, attention_only=False, l3_write="host_eviction", **kw)


def test_another_model_sharing_the_store_never_reads_this_ones_pages(url: str) -> None:
    _, b = _writer_then_reader(url, _config(url, seed=0), _config(url, seed=1))
    # Other keys: nothing of the first model is even looked at.
    assert (b["l3_hit_tokens"], b["l3_foreign_objects"]) == (0, 0)
    # The same model again hits what the first wrote.
    _, c = _writer_then_reader(url, _config(url, seed=0), _config(url, seed=0))
    assert c["l3_hit_tokens"] > 0


def test_another_models_object_under_this_ones_key_is_a_counted_miss(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Keys by page alone: the second model finds the first's objects under its keys, and
    # only the frame's identity keeps their bytes out (the oracle would count them).
    monkeypatch.setattr(harness, "open_store", lambda u: PageHashKeys(ObjectStore(u)))
    _, b = _writer_then_reader(url, _config(url, seed=0), _config(url, seed=1))
    assert b["l3_foreign_objects"] > 0
    assert b["l3_hit_tokens"] == 0


def test_another_tensor_parallel_rank_never_reads_this_ones_heads(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    rank0 = _config(url, tp_rank=0, tp_size=2)
    rank1 = _config(url, tp_rank=1, tp_size=2)
    _, b = _writer_then_reader(url, rank0, rank1)
    assert (b["l3_hit_tokens"], b["l3_foreign_objects"]) == (0, 0)
    # Rank 1 of another server hits what rank 1 wrote, exactly.
    _, c = _writer_then_reader(url, rank1, rank1)
    assert c["l3_hit_tokens"] > 0
    # Under page-only keys rank 0's objects reach rank 1's reads: foreign, never served.
    monkeypatch.setattr(harness, "open_store", lambda u: PageHashKeys(ObjectStore(u)))
    other = url + "-page-keys"
    _, d = _writer_then_reader(
        other, _config(other, tp_rank=0, tp_size=2), _config(other, tp_rank=1, tp_size=2)
    )
    assert (d["l3_foreign_objects"] > 0, d["l3_hit_tokens"]) == (True, 0)


def test_a_kv_page_under_a_states_key_is_foreign_even_when_the_sizes_agree(url: str) -> None:
    # A KV page of 4 tokens x 1 layer x 1 head of 2 floats, K and V: 64 bytes; a state of
    # 1 layer, conv (8,) and ssm (8,) floats: 64 bytes. The sizes agree.
    caches = []
    for _ in range(2):
        cache = HybridCache(
            kv_slots=64,
            page_size=4,
            mamba_slots=4,
            host_kv_slots=128,
            host_mamba_slots=4,
            page_hashes=True,
            l3=True,
        )
        storage = Storage.for_cache(
            cache,
            layers=1,
            mamba_layers=1,
            kv_heads=1,
            head_dim=2,
            conv_shape=(8,),
            ssm_shape=(8,),
            dtype="float32",
            device="cpu",
        )
        assert storage.kv_bytes_per_token * 4 == storage.bytes_per_state == 64
        tier = L3Tier(cache, storage, ObjectStore(url), model=MODEL, min_tokens=0)
        caches.append((cache, storage, tier))
    cache, storage, tier = caches[1]
    hashes = cache.chain_hashes(TOKENS)
    # Every page stored as it should be; the state at the end written as a KV page.
    kv_keys = [tier.identity.key("kv", h) for h in hashes]
    rows = np.arange(6 * 64, dtype=np.uint8).reshape(6, 64)
    store = ObjectStore(url)
    label = {"identity": tier.identity.digest}
    assert store.put(kv_keys, hashes, rows, kind="kv", **label) == [True] * 6
    state_key = tier.identity.key("mamba", hashes[-1])
    assert store.put([state_key], hashes[-1:], rows[:1], kind="kv", **label) == [True]
    assert tier.fetch(TOKENS) == 0  # a hybrid prefix lands only with its state
    assert tier.counters.foreign_objects == 1
    assert store.exists([state_key]) == [False]  # deleted
    m = cache.match_prefix(TOKENS)
    assert (m.device_len, m.host_len) == (0, 0)
    assert cache.stats()["l3_gone_objects"] == 1
    cache.audit()


def test_the_identity_names_every_field_that_changes_what_the_bytes_mean(url: str) -> None:
    a = L3Cache(ObjectStore(url), hybrid=True)
    base = L3Identity.of(a.storage, 4, model=MODEL)
    assert base == a.tier.identity
    others = [
        L3Identity.of(a.storage, 4, model=MODEL + "-rev2"),
        L3Identity.of(a.storage, 4, model=MODEL, tp_rank=1, tp_size=2),
        L3Identity.of(a.storage, 4, model=MODEL, tp_rank=0, tp_size=2),
        L3Identity.of(a.storage, 4, model=MODEL, pp_rank=1, pp_size=2),
        L3Identity.of(a.storage, 8, model=MODEL),
        L3Identity.of(L3Cache(ObjectStore(url), hybrid=True, small=True).storage, 4, model=MODEL),
    ]
    digests = {base.digest, *(o.digest for o in others)}
    assert len(digests) == 1 + len(others)
    page = hashlib.sha256(b"page").digest()
    assert len({base.key("kv", page), base.key("mamba", page)}) == 2
    key = base.key("kv", page)
    assert key == b"rc2:" + base.digest[:16].hex().encode() + b":kv:" + page.hex().encode()
    assert len(key) <= 127  # the file store's limit
    assert base.text.startswith('{"format":"radixcache-l3/2"')


@pytest.mark.parametrize(
    ("kw", "error", "message"),
    [
        ({"model": ""}, ValueError, r"^model: must name the model"),
        ({"model": "  "}, ValueError, r"^model: must name the model"),
        ({"model": None}, TypeError, r"^model: expected a str, got NoneType"),
        ({"model": MODEL, "tp_rank": 2, "tp_size": 2}, ValueError, r"^tp_rank: must be below"),
        ({"model": MODEL, "tp_size": 0}, ValueError, r"^tp_size: must be >= 1"),
        ({"model": MODEL, "pp_rank": -1}, ValueError, r"^pp_rank: must be >= 0"),
        ({"model": MODEL, "tp_rank": True}, TypeError, r"^tp_rank: expected an int, got bool"),
        ({"model": MODEL, "pp_size": 1.0}, TypeError, r"^pp_size: expected an int, got float"),
    ],
)
def test_a_bad_identity_is_refused_naming_its_argument(
    url: str, kw: dict[str, Any], error: type, message: str
) -> None:
    a = L3Cache(ObjectStore(url), hybrid=False)
    with pytest.raises(error, match=message):
        L3Tier(a.cache, a.storage, ObjectStore(url), **kw)


# ---------------------------------------------------------------------- one cache each


def test_an_engine_refuses_a_tier_of_another_cache_or_storage(url: str) -> None:
    a = L3Cache(ObjectStore(url), hybrid=False)
    b = L3Cache(ObjectStore(url), hybrid=False)
    with pytest.raises(ValueError, match=r"^l3: a tier of another cache"):
        TransferEngine(a.cache, a.storage, l3=b.tier)
    other = Storage.for_cache(a.cache, layers=2, kv_heads=2, head_dim=4, dtype="float32")
    with pytest.raises(ValueError, match=r"^l3: a tier of another storage"):
        TransferEngine(a.cache, other, l3=a.tier)
    with pytest.raises(TypeError, match=r"^l3: expected an L3Tier, got ObjectStore"):
        TransferEngine(a.cache, a.storage, l3=ObjectStore(url))  # type: ignore[arg-type]


def test_a_tier_refuses_a_storage_that_does_not_fit_its_cache(url: str) -> None:
    a = L3Cache(ObjectStore(url), hybrid=False)
    small = HybridCache(kv_slots=64, page_size=4, host_kv_slots=64, page_hashes=True, l3=True)
    storage = Storage.for_cache(small, layers=2, kv_heads=2, head_dim=4, dtype="float32")
    with pytest.raises(ValueError, match=r"^host_kv_slots: the cache has 128"):
        L3Tier(a.cache, storage, ObjectStore(url), model=MODEL)
    with pytest.raises(TypeError, match=r"^storage: expected a Storage"):
        L3Tier(a.cache, a.storage.kv, ObjectStore(url), model=MODEL)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^store: a str has no exists, put, get_into"):
        L3Tier(a.cache, a.storage, url, model=MODEL)  # type: ignore[arg-type]


def test_a_tier_refuses_another_caches_batch_untouched(url: str) -> None:
    rng = np.random.default_rng(0)
    a = L3Cache(ObjectStore(url), hybrid=True)
    b = L3Cache(ObjectStore(url), hybrid=True)
    wrote = a.compute(TOKENS, rng)
    a.settle()
    batch = b.cache.l3_fetch(TOKENS, 6)
    assert batch is not None
    with pytest.raises(ValueError, match=r"^batch: a batch of another cache"):
        a.tier.read(batch)
    assert batch.outcome is None
    assert [s for i, _, s in b.cache.pending_batches() if i == batch.id] == [False]  # not started
    assert b.tier.read(batch) == 6  # its own tier runs it
    got = b.loaded(TOKENS)
    for name, want in wrote.items():
        np.testing.assert_array_equal(got[name], want, err_msg=name)
    puts = [x for x in a.cache.take_batches() if x.kind == "l3_put"]
    for x in puts:
        with pytest.raises(ValueError, match=r"^batch: a batch of another cache"):
            b.tier.write(x)
        x.fail()
    with pytest.raises(TypeError, match=r"^batch: expected a TransferBatch"):
        a.tier.read("batch")  # type: ignore[arg-type]
    a.cache.audit()
    b.cache.audit()


def test_a_tier_refuses_another_tiers_fetch(url: str) -> None:
    rng = np.random.default_rng(0)
    a = L3Cache(ObjectStore(url), hybrid=False)
    b = L3Cache(ObjectStore(url), hybrid=False)
    a.compute(TOKENS, rng)
    a.settle()
    fetch = b.tier.start_fetch(TOKENS)
    assert fetch is not None
    with pytest.raises(ValueError, match=r"^fetch: started by another L3Tier"):
        a.tier.poll(fetch)
    with pytest.raises(ValueError, match=r"^fetch: started by another L3Tier"):
        a.tier.cancel(fetch)
    assert b.tier.poll(fetch, None)
    assert fetch.tokens_landed == len(TOKENS)
    b.tier.close()
    b.cache.audit()


# ---------------------------------------------------------------------- owned to the end


def _open_and_collect(gated: Gated, gone: weakref.ref[L3Tier], deadline: float) -> None:
    """Let the read end, then wait until nothing holds the tier any more."""
    gated.gate.set()
    while gone() is not None:
        gc.collect()
        time.sleep(0.01)
        assert time.monotonic() < deadline


def test_a_tier_dropped_while_its_read_runs_gives_its_host_slots_back(url: str) -> None:
    rng = np.random.default_rng(0)
    a = L3Cache(ObjectStore(url), hybrid=True)
    a.compute(TOKENS, rng)
    a.settle()
    b = L3Cache(ObjectStore(url), hybrid=True)
    gated = Gated(ObjectStore(url))
    tier = L3Tier(b.cache, b.storage, gated, model=MODEL, min_tokens=0)
    fetch = tier.start_fetch(TOKENS)
    assert fetch is not None
    deadline = time.monotonic() + 10
    while not gated.reading.is_set():  # the lookup answers, the read starts and waits
        tier.poll(fetch, 0.01)
        assert time.monotonic() < deadline
    stats = b.cache.stats()
    assert stats["host_kv_free_slots"] < stats["host_kv_capacity_slots"]
    gone = weakref.ref(tier)
    del tier, fetch
    with pytest.warns(ResourceWarning, match=r"L3Tier was dropped with 1 fetch"):
        _open_and_collect(gated, gone, deadline)
    stats = b.cache.stats()
    assert stats["host_kv_free_slots"] == stats["host_kv_capacity_slots"]
    assert stats["host_mamba_free_slots"] == stats["host_mamba_capacity_slots"]
    assert b.cache.pending_batches() == []
    b.cache.reset()  # nothing in flight holds it up
    b.cache.audit()


def test_a_tier_dropped_with_nothing_in_flight_says_nothing(url: str) -> None:
    a = L3Cache(ObjectStore(url), hybrid=False)
    tier = L3Tier(a.cache, a.storage, ObjectStore(url), model=MODEL)
    gone = weakref.ref(tier)
    del tier
    gc.collect()
    assert gone() is None  # and no ResourceWarning (an error under this suite's filters)


def test_one_tier_driven_from_six_threads(url: str) -> None:
    rng = np.random.default_rng(0)
    a = L3Cache(ObjectStore(url), hybrid=False, kv_slots=512, host_kv=1024)
    prompts = [[p * 1000 + t for t in range(24)] for p in range(12)]
    for p in prompts:
        a.compute(p, rng)
    a.settle()
    b = L3Cache(ObjectStore(url), hybrid=False, kv_slots=512, host_kv=1024)
    errors: list[BaseException] = []
    landed: list[int] = []
    lock = threading.Lock()

    def drive(k: int) -> None:
        try:
            for round_ in range(6):
                fetch = b.tier.start_fetch(prompts[(k + round_ * 6) % len(prompts)])
                if fetch is None:
                    continue
                if (k + round_) % 3 == 0:
                    b.tier.cancel(fetch)
                while not b.tier.poll(fetch, 0.001):
                    pass
                with lock:
                    landed.append(fetch.tokens_landed)
        except BaseException as e:
            with lock:
                errors.append(e)

    threads = [threading.Thread(target=drive, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert any(n > 0 for n in landed)
    b.tier.close()
    assert b.cache.pending_batches() == []
    stats = b.cache.stats()
    assert stats["host_kv_draining_slots"] == 0
    b.cache.audit()
