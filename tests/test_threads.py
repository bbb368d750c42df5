"""Several Python threads sharing one cache: long inputs release the GIL inside the
core, handles are collected on other threads; nothing deadlocks, nothing leaks."""

from __future__ import annotations

import threading

import numpy as np

import radixcache as rc

SYSTEM = list(range(100_000, 105_000))  # 5000 tokens: above the GIL-release threshold


def test_threads_share_a_cache_without_deadlock_or_leak() -> None:
    cache = rc.HybridCache(kv_slots=200_000, page_size=16, mamba_slots=16)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(30):
                prompt = SYSTEM + [int(t) for t in rng.integers(0, 50_000, size=200)]
                req = cache.admit(prompt)
                if req is None:
                    continue
                for b in cache.take_batches():  # any thread may acknowledge any batch
                    cache.complete(b.id)
                while req.copy_pending is not None:  # another thread took our batch
                    for b in cache.take_batches():
                        cache.complete(b.id)
                if cache.extend(req, prompt[req.prefix_len :]) is None:
                    cache.abort(req)
                    continue
                lk = cache.lock(cache.match_prefix(prompt[:4096]).node)
                cache.unlock(lk)
                cache.finish(req)
        except BaseException as e:  # reported below, on the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "a worker hung (deadlock?)"
    assert errors == []
    for b in cache.take_batches():
        cache.complete(b.id)
    cache.audit()
    s = cache.stats()
    assert s["finishes"] > 0
    assert s["live_requests"] == 0
    assert s["batches_in_flight"] == 0
    cache.evict(kv_tokens=200_000, mamba_states=16)
    assert cache.available_kv() == 200_000
    assert cache.available_mamba() == 16
