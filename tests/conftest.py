from __future__ import annotations

import numpy as np
import pytest

import radixcache as rc


def fingerprint(cache: rc.HybridCache) -> tuple[object, ...]:
    """Everything observable about a cache's contents, to check that a failed call
    changed nothing. Reading it changes nothing either (no match, no LRU refresh)."""
    cache.audit()
    return (
        cache.evictable_size(),
        cache.protected_size(),
        cache.total_size(),
        cache.available_kv(),
        cache.pretty(max_nodes=10_000, max_tokens=10_000),
    )


def cached(cache: rc.HybridCache, tokens: list[int], namespace: str | None = None) -> rc.Insert:
    """Cache `tokens` the way a serving engine does: match, allocate the rest, insert."""
    m = cache.match_prefix(tokens, namespace=namespace)
    ps = cache.page_size
    rest = len(tokens) - m.device_len
    n = -(-rest // ps) * ps
    slots = cache.alloc_kv(n)
    assert slots is not None
    # Slots past the last token share the tail page; handing over the tail slots hands
    # over that page, which the insert then frees.
    kv = np.concatenate([m.kv_indices, slots[:rest]])
    return cache.insert(tokens, kv, namespace=namespace, owned_from=m.device_len)


@pytest.fixture
def cache() -> rc.HybridCache:
    return rc.HybridCache(kv_slots=64)
