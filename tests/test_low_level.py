"""The low-level KV API of docs/contract.md: every call, and every error path leaving the cache
exactly as it was."""

from __future__ import annotations

import gc
import inspect
import pydoc
import re

import numpy as np
import pytest

import radixcache as rc

from conftest import cached, fingerprint

# --------------------------------------------------------------------------- construction


def test_defaults_and_repr() -> None:
    c = rc.HybridCache(kv_slots=64)
    assert c.page_size == 1
    assert c.kv_slots == 64
    assert c.available_kv() == 64
    assert c.available_mamba() == 0
    assert c.mamba_slots == 0
    assert "kv_slots=64" in repr(c)
    assert str(c).startswith("HybridCache(")
    c.audit()


@pytest.mark.parametrize(
    ("kwargs", "arg"),
    [
        ({"kv_slots": 10, "page_size": 4}, "kv_slots"),
        ({"kv_slots": 0}, "kv_slots"),
        ({"kv_slots": -8}, "kv_slots"),
        ({"page_size": 0}, "page_size"),
        ({"page_size": -1}, "page_size"),
        ({"write_policy": "lru"}, "write_policy"),
        ({"write_through_threshold": 0}, "write_through_threshold"),
        ({"write_through_threshold": -3}, "write_through_threshold"),
        # A threshold the policy would ignore; a policy with no host tier to back up to.
        ({"write_through_threshold": 3, "host_kv_slots": 8}, "write_through_threshold"),
        ({"write_policy": "write_back"}, "write_policy"),
        ({"write_policy": "write_through_selective"}, "write_policy"),
        ({"host_kv_slots": 6, "page_size": 4}, "host_kv_slots"),
        ({"host_kv_slots": -4}, "host_kv_slots"),
        ({"host_mamba_slots": 2, "host_kv_slots": 64}, "host_mamba_slots"),
        ({"host_mamba_slots": 2, "mamba_slots": 2}, "host_mamba_slots"),
        ({"mamba_slots": -1}, "mamba_slots"),
    ],
)
def test_bad_configuration_names_the_argument(kwargs: dict[str, object], arg: str) -> None:
    with pytest.raises(ValueError, match=rf"^{arg}:"):
        rc.HybridCache(**kwargs)  # type: ignore[arg-type]


def test_wrong_configuration_type_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"^kv_slots: expected an integer, got str$"):
        rc.HybridCache(kv_slots="64")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^page_size: expected an integer, got float$"):
        rc.HybridCache(page_size=1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^mamba_slots: \d+ is out of the 64-bit range$"):
        rc.HybridCache(mamba_slots=2**70)


@pytest.mark.parametrize(
    ("call", "exc", "arg"),
    [
        (lambda c: c.alloc_kv("4"), TypeError, "n"),
        (lambda c: c.alloc_kv(None), TypeError, "n"),
        (lambda c: c.evict(kv_tokens=1.5), TypeError, "kv_tokens"),
        (lambda c: c.evict(mamba_states="1"), TypeError, "mamba_states"),
        (lambda c: c.insert([1], [0], owned_from=0.0), TypeError, "owned_from"),
        (lambda c: c.insert([1], [0], mamba_slot="0"), TypeError, "mamba_slot"),
        (lambda c: c.free_mamba("0"), TypeError, "slot"),
        (lambda c: c.start("0"), TypeError, "batch_id"),
        (lambda c: c.complete(None), TypeError, "batch_id"),
        (lambda c: c.fail(2**70), ValueError, "batch_id"),
        (lambda c: c.alloc_kv(2**70), ValueError, "n"),
    ],
)
def test_integer_arguments_name_themselves_when_wrong(
    cache: rc.HybridCache, call: object, exc: type[Exception], arg: str
) -> None:
    """On every Python version (pyo3 names arguments only in 3.11+ exception notes)."""
    before = fingerprint(cache)
    with pytest.raises(exc, match=rf"^{arg}: "):
        call(cache)  # type: ignore[operator]
    assert fingerprint(cache) == before


def test_all_write_policies_are_accepted_with_a_host_tier() -> None:
    for p in ("write_through", "write_through_selective", "write_back"):
        c = rc.HybridCache(kv_slots=8, host_kv_slots=8, write_policy=p)
        assert c.write_policy == p
        c.audit()
    c = rc.HybridCache(
        kv_slots=8,
        host_kv_slots=8,
        write_policy="write_through_selective",
        write_through_threshold=3,
    )
    assert c.write_through_threshold == 3
    assert rc.HybridCache(kv_slots=8).write_through_threshold is None


#: The constructor's parameters and their defaults.
CONSTRUCTOR = [
    ("kv_slots", 8192),
    ("page_size", 1),
    ("mamba_slots", 0),
    ("host_kv_slots", 0),
    ("host_mamba_slots", 0),
    ("write_policy", "write_through"),
    ("write_through_threshold", None),
    ("pools", "cache"),
    ("eviction_policy", "lru"),
    ("swa_slots", 0),
    ("swa_window", 0),
    ("host_swa_slots", 0),
    ("page_hashes", False),
    ("hash_seed", None),
    ("events", False),
    ("l3", False),
    ("l3_write", None),
]


def test_the_constructor_signature_is_known_at_runtime() -> None:
    # inspect.signature and help() see the arguments on every Python version (3.9 drops
    # a class's text signature made through the stable ABI), not only type checkers.
    params = inspect.signature(rc.HybridCache).parameters.values()
    assert [(p.name, p.default) for p in params] == CONSTRUCTOR
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params)
    text = pydoc.render_doc(rc.HybridCache, renderer=pydoc.plaintext)
    signature = ",".join(f"{name}={default!r}" for name, default in CONSTRUCTOR)
    # Python 3.13 breaks a long signature into lines.
    assert f"HybridCache({signature})" in re.sub(r"[\s|]", "", text)
    for name, _ in CONSTRUCTOR:
        assert f"  {name}: " in text, f"help() does not explain {name}"
    # The defaults it shows are the constructor's ("lru" applies to every component).
    c = rc.HybridCache()
    # page_hashes names the method that lists a node's hashes, not a property.
    plain = [
        (name, default)
        for name, default in CONSTRUCTOR
        if name not in ("eviction_policy", "page_hashes")
    ]
    assert [(name, getattr(c, name)) for name, _ in plain] == plain
    assert c.eviction_policy == {"kv": "lru", "mamba": "lru"}


def test_exception_hierarchy() -> None:
    for e in (rc.InvariantError, rc.StaleNodeError, rc.LockError):
        assert issubclass(e, rc.CacheError)
    assert issubclass(rc.CacheError, Exception)


# ------------------------------------------------------------------------------ match


def test_match_on_empty_cache(cache: rc.HybridCache) -> None:
    m = cache.match_prefix([1, 2, 3])
    assert m.device_len == 0
    assert m.kv_indices.dtype == np.int64
    assert m.kv_indices.shape == (0,)
    assert (m.host_len, m.kv_len, m.mamba_slot) == (0, 0, None)
    assert m.host_node == m.node
    assert "root" in repr(m.node)


def test_match_returns_the_slots_of_the_longest_prefix(cache: rc.HybridCache) -> None:
    ins = cached(cache, [1, 2, 3, 4, 5])
    assert ins.prefix_len == 0
    full = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert full.device_len == 5
    assert full.kv_len == 5
    part = cache.match_prefix([1, 2, 3, 9])
    assert part.device_len == 3
    np.testing.assert_array_equal(part.kv_indices, full.kv_indices[:3])
    assert cache.match_prefix([9]).device_len == 0


def test_match_splits_so_its_node_ends_at_the_match(cache: rc.HybridCache) -> None:
    cached(cache, [1, 2, 3, 4, 5])
    m = cache.match_prefix([1, 2, 3, 9])
    with cache.lock(m.node):
        assert cache.protected_size() == 3
        assert cache.evictable_size() == 2
    assert cache.stats()["splits"] == 1
    cache.audit()


def test_page_alignment_of_matches_and_inserts() -> None:
    c = rc.HybridCache(kv_slots=32, page_size=4)
    ins = cached(c, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    # 10 tokens: two whole pages cached, the tail page freed by the insert.
    assert c.total_size() == 8
    assert c.available_kv() == 24
    assert ins.prefix_len == 0
    # A mismatch inside page 2 matches one page only.
    m = c.match_prefix([1, 2, 3, 4, 5, 6, 0, 8])
    assert m.device_len == 4
    assert list(m.kv_indices) == [0, 1, 2, 3]
    # Tokens past the last whole page are ignored.
    assert c.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9]).device_len == 8
    assert c.match_prefix([1, 2, 3]).device_len == 0
    c.audit()


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint32, np.uint64, np.int16, np.uint8])
def test_tokens_as_numpy_arrays_of_any_integer_dtype(cache: rc.HybridCache, dtype: type) -> None:
    cached(cache, [1, 2, 3])
    assert cache.match_prefix(np.array([1, 2, 3, 4], dtype=dtype)).device_len == 3
    # non-contiguous views are read correctly too
    assert cache.match_prefix(np.array([1, 0, 2, 0, 3, 0], dtype=dtype)[::2]).device_len == 3
    assert cache.match_prefix((1, 2)).device_len == 2


NOT_A_SEQUENCE = "expected a sequence of integers (list, tuple or 1-D integer array), got"
BAD_TOKENS = [
    ([1, -1], ValueError, "tokens: token id -1 at position 1 is out of range"),
    ([2**32], ValueError, "tokens: token id 4294967296"),
    ([2**70], ValueError, "tokens: token id 1180591620717411303424 at position 0 is out of range"),
    (np.array([1, -5]), ValueError, "tokens: token id -5"),
    (np.array([2**40], dtype=np.uint64), ValueError, "tokens: token id"),
    (np.array([[1, 2], [3, 4]]), ValueError, "tokens: expected a 1-D sequence"),
    (np.array([1.0, 2.0]), TypeError, "tokens: expected integers, got an array of dtype"),
    ([1, 2.5], TypeError, "tokens: expected integers, got float at position 1"),
    (["a"], TypeError, "tokens: expected integers, got str"),
    ("abc", TypeError, f"tokens: {NOT_A_SEQUENCE} str"),
    (b"abc", TypeError, f"tokens: {NOT_A_SEQUENCE} bytes"),
    (None, TypeError, f"tokens: {NOT_A_SEQUENCE} NoneType"),
    (5, TypeError, f"tokens: {NOT_A_SEQUENCE} int"),
]


@pytest.mark.parametrize(("tokens", "exc", "msg"), BAD_TOKENS)
def test_bad_tokens_name_the_argument_and_change_nothing(
    cache: rc.HybridCache, tokens: object, exc: type[Exception], msg: str
) -> None:
    cached(cache, [1, 2, 3])
    before = fingerprint(cache)
    stats = cache.stats()
    with pytest.raises(exc, match=re.escape(msg)):
        cache.match_prefix(tokens)  # type: ignore[arg-type]
    with pytest.raises(exc, match=re.escape(msg)):
        cache.insert(tokens, [0, 1, 2])  # type: ignore[arg-type]
    assert fingerprint(cache) == before
    assert cache.stats() == stats


def test_namespaces_are_separate_trees(cache: rc.HybridCache) -> None:
    cached(cache, [1, 2, 3], namespace="lora-a")
    assert cache.match_prefix([1, 2, 3]).device_len == 0
    assert cache.match_prefix([1, 2, 3], namespace="lora-b").device_len == 0
    assert cache.match_prefix([1, 2, 3], namespace="lora-a").device_len == 3
    cached(cache, [1, 2, 3])
    assert cache.total_size() == 6
    # "lora-b" was only read: a miss, with no tree of its own.
    assert cache.stats()["namespaces"] == 2
    cache.audit()


def test_long_inputs_release_the_gil_and_still_work() -> None:
    c = rc.HybridCache(kv_slots=20_000)
    toks = np.arange(10_000, dtype=np.int64)
    cached(c, list(toks))
    m = c.match_prefix(toks)
    assert m.device_len == 10_000
    np.testing.assert_array_equal(m.kv_indices, np.arange(10_000))
    c.audit()


# ----------------------------------------------------------------------------- insert


def test_insert_frees_duplicates_and_keeps_the_callers_prefix(cache: rc.HybridCache) -> None:
    cached(cache, [1, 2, 3, 4])
    assert cache.available_kv() == 60
    # A second request computed [1, 2, 3, 4, 5, 6] itself (no reuse): 6 fresh slots.
    slots = cache.alloc_kv(6)
    assert slots is not None
    ins = cache.insert([1, 2, 3, 4, 5, 6], slots)
    assert ins.prefix_len == 4
    # The 4 duplicates went back to the pool; the caller never frees after an insert.
    assert cache.available_kv() == 58
    assert cache.total_size() == 6
    # With owned_from the caller's reused prefix is left alone.
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    more = cache.alloc_kv(2)
    assert more is not None
    ins = cache.insert(
        [1, 2, 3, 4, 5, 6, 7, 8], np.concatenate([m.kv_indices, more]), owned_from=m.device_len
    )
    assert ins.prefix_len == 6
    assert cache.available_kv() == 56
    assert cache.total_size() == 8
    np.testing.assert_array_equal(
        cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).kv_indices,
        np.concatenate([m.kv_indices, more]),
    )
    cache.audit()


def test_insert_of_a_cached_prefix_ends_at_a_node(cache: rc.HybridCache) -> None:
    cached(cache, [1, 2, 3, 4])
    slots = cache.alloc_kv(2)
    assert slots is not None
    ins = cache.insert([1, 2], slots)
    assert ins.prefix_len == 2
    with cache.lock(ins.node):
        assert cache.protected_size() == 2
    assert cache.available_kv() == 60


def test_insert_with_less_than_a_page_caches_nothing_and_frees_the_page() -> None:
    c = rc.HybridCache(kv_slots=16, page_size=4)
    slots = c.alloc_kv(4)
    assert slots is not None
    ins = c.insert([7, 8], slots[:2])
    assert ins.prefix_len == 0
    assert "root" in repr(ins.node)
    assert c.available_kv() == 16
    c.audit()


def test_insert_accepts_numpy_int32_indices(cache: rc.HybridCache) -> None:
    slots = cache.alloc_kv(3)
    assert slots is not None
    cache.insert(np.array([4, 5, 6], dtype=np.uint32), slots.astype(np.int32))
    assert cache.match_prefix([4, 5, 6]).device_len == 3


def _bad_inserts(c: rc.HybridCache) -> list[tuple[dict[str, object], str, str]]:
    """(insert kwargs, argument named, message fragment) for each refused insert."""
    cached(c, [1, 2, 3, 4])
    held = c.alloc_kv(4)
    assert held is not None
    m = c.match_prefix([1, 2, 3, 4, 5, 6])
    tree = list(m.kv_indices)
    h = list(held)
    free_slot = 63
    return [
        ({"tokens": [5, 6, 7], "kv_indices": h[:2]}, "kv_indices", "has 2 entries for 3 tokens"),
        ({"tokens": [5, 6], "kv_indices": h[:2], "owned_from": 3}, "owned_from", "past the end"),
        ({"tokens": [5, 6], "kv_indices": h[:2], "owned_from": -1}, "owned_from", ">= 0"),
        (
            {"tokens": [9, 9, 9, 9, 9], "kv_indices": tree + h[:1], "owned_from": 4},
            "owned_from",
            "are not cached",
        ),
        (
            {"tokens": [1, 2, 3, 4, 5], "kv_indices": [*h[:4], h[3]], "owned_from": 4},
            "kv_indices",
            "not the cache's slots",
        ),
        ({"tokens": [5, 6], "kv_indices": [h[0], free_slot]}, "kv_indices", "not allocated"),
        ({"tokens": [5, 6], "kv_indices": [h[0], tree[0]]}, "kv_indices", "owned by the cache"),
        ({"tokens": [5, 6], "kv_indices": [h[0], h[0]]}, "kv_indices", "listed twice"),
        ({"tokens": [5, 6], "kv_indices": [h[0], 64]}, "kv_indices", "out of range"),
        ({"tokens": [5, 6], "kv_indices": [h[0], -1]}, "kv_indices", "out of range"),
        ({"tokens": [5, 6], "kv_indices": h[:2], "mamba_slot": 0}, "mamba_slot", "no Mamba"),
        ({"tokens": [5, 6], "kv_indices": np.array([h[:2]])}, "kv_indices", "1-D"),
    ]


@pytest.mark.parametrize("case", range(12))
def test_bad_insert_names_the_argument_and_changes_nothing(case: int) -> None:
    c = rc.HybridCache(kv_slots=64)
    kwargs, arg, msg = _bad_inserts(c)[case]
    before = fingerprint(c)
    with pytest.raises(ValueError, match=rf"^{arg}:.*{re.escape(msg)}"):
        c.insert(**kwargs)  # type: ignore[arg-type]
    assert fingerprint(c) == before


def test_insert_refuses_slots_that_are_not_whole_pages() -> None:
    c = rc.HybridCache(kv_slots=16, page_size=2)
    held = c.alloc_kv(4)
    assert held is not None
    before = fingerprint(c)
    for kv in ([held[1], held[0]], [held[0], held[2]], [held[1], held[2]]):
        with pytest.raises(ValueError, match=r"^kv_indices: slots for tokens 0\.\.2 are not one"):
            c.insert([1, 2], kv)
    with pytest.raises(ValueError, match=r"^owned_from: 1 is not a multiple of page_size 2"):
        c.insert([1, 2], held[:2], owned_from=1)
    assert fingerprint(c) == before


# ------------------------------------------------------------------------------- locks


def test_lock_moves_sizes_and_protects_from_eviction(cache: rc.HybridCache) -> None:
    ins = cached(cache, [1, 2, 3])
    cached(cache, [7, 8])
    lock = cache.lock(ins.node)
    assert lock.held
    assert lock.node == ins.node
    assert (cache.protected_size(), cache.evictable_size(), cache.total_size()) == (3, 2, 5)
    ev = cache.evict(kv_tokens=100)
    assert ev.kv_tokens == 2
    assert cache.match_prefix([1, 2, 3]).device_len == 3
    cache.unlock(lock)
    assert not lock.held
    assert (cache.protected_size(), cache.evictable_size()) == (0, 3)
    cache.audit()


def test_nested_locks_release_on_the_last_unlock(cache: rc.HybridCache) -> None:
    ins = cached(cache, [1, 2, 3])
    a = cache.lock(ins.node)
    b = cache.lock(ins.node)
    cache.unlock(a)
    assert cache.protected_size() == 3
    cache.unlock(b)
    assert cache.protected_size() == 0
    cache.audit()


def test_lock_as_context_manager(cache: rc.HybridCache) -> None:
    ins = cached(cache, [1, 2, 3])
    with cache.lock(ins.node) as lk:
        assert isinstance(lk, rc.Lock)
        assert cache.protected_size() == 3
    assert cache.protected_size() == 0
    # leaving the block released it: an explicit unlock now is a second release
    with pytest.raises(rc.LockError, match="already released"):
        cache.unlock(lk)
    # an unlock inside the block is fine; the exit does not release twice
    with cache.lock(ins.node) as lk2:
        cache.unlock(lk2)
    assert cache.protected_size() == 0
    # the block releases on an exception too, and does not swallow it
    with pytest.raises(KeyError), cache.lock(ins.node):
        raise KeyError("x")
    assert cache.protected_size() == 0
    cache.audit()


def test_second_unlock_raises_lock_error_and_changes_nothing(cache: rc.HybridCache) -> None:
    ins = cached(cache, [1, 2, 3])
    keep = cache.lock(ins.node)
    lk = cache.lock(ins.node)
    cache.unlock(lk)
    before = fingerprint(cache)
    with pytest.raises(rc.LockError):
        cache.unlock(lk)
    assert fingerprint(cache) == before
    assert cache.protected_size() == 3
    cache.unlock(keep)


def test_foreign_receipt_raises_lock_error(cache: rc.HybridCache) -> None:
    other = rc.HybridCache(kv_slots=64)
    ins = cached(cache, [1, 2, 3])
    lk = cache.lock(ins.node)
    with pytest.raises(rc.LockError, match="another cache"):
        other.unlock(lk)
    assert lk.held
    cache.unlock(lk)


def test_foreign_node_is_stale(cache: rc.HybridCache) -> None:
    other = rc.HybridCache(kv_slots=64)
    ins = cached(cache, [1, 2, 3])
    with pytest.raises(rc.StaleNodeError):
        other.lock(ins.node)


def test_lock_collected_while_held_releases_and_warns(cache: rc.HybridCache) -> None:
    ins = cached(cache, [1, 2, 3])
    held = [cache.lock(ins.node)]
    assert cache.protected_size() == 3
    with pytest.warns(ResourceWarning, match="garbage-collected while held"):
        held.clear()  # the last reference goes: the receipt is collected
    assert cache.protected_size() == 0
    cache.audit()


def test_released_lock_collects_silently(cache: rc.HybridCache) -> None:
    ins = cached(cache, [1, 2, 3])
    lk = cache.lock(ins.node)
    cache.unlock(lk)
    del lk
    gc.collect()  # filterwarnings=error: a warning here would fail the test


def test_stale_node_after_eviction(cache: rc.HybridCache) -> None:
    ins = cached(cache, [1, 2, 3])
    node = ins.node
    cache.evict(kv_tokens=3)
    assert "(gone)" in repr(node)
    before = fingerprint(cache)
    with pytest.raises(rc.StaleNodeError, match="no longer exists"):
        cache.lock(node)
    # the arena slot gets reused: the old handle still never reaches the new node
    new = cached(cache, [4, 5]).node
    assert new != node
    with pytest.raises(rc.StaleNodeError):
        cache.lock(node)
    assert fingerprint(cache) != before  # (the insert above changed it, not the error)


def test_node_handles_are_hashable_and_equal_for_the_same_node(cache: rc.HybridCache) -> None:
    ins = cached(cache, [1, 2, 3])
    a = cache.match_prefix([1, 2, 3]).node
    b = cache.match_prefix([1, 2, 3, 4]).node
    assert a == b == ins.node
    assert hash(a) == hash(b)
    assert len({a, b, ins.node}) == 1
    assert a != cache.match_prefix([1]).node
    assert a != "node"
    assert "depth=3" in repr(a)


# ---------------------------------------------------------------------------- eviction


def test_evict_takes_least_recently_used_leaves_first(cache: rc.HybridCache) -> None:
    cached(cache, [1, 1])
    cached(cache, [2, 2])
    cached(cache, [3, 3])
    cache.match_prefix([1, 1])  # refresh: now [2, 2] is the oldest
    ev = cache.evict(kv_tokens=1)
    assert ev.kv_tokens == 2  # whole node
    assert cache.match_prefix([2, 2]).device_len == 0
    assert cache.match_prefix([1, 1]).device_len == 2
    assert cache.match_prefix([3, 3]).device_len == 2
    cache.audit()


def test_parent_left_as_a_leaf_is_evicted_in_the_same_pass(cache: rc.HybridCache) -> None:
    cached(cache, [1, 2, 3, 4])
    cached(cache, [1, 2, 5, 6])  # splits: [1,2] -> {[3,4], [5,6]}
    assert cache.stats()["nodes"] == 3
    ev = cache.evict(kv_tokens=6)
    assert ev.kv_tokens == 6
    assert cache.total_size() == 0
    assert cache.available_kv() == 64
    assert cache.stats()["evicted_nodes"] == 3
    cache.audit()


def test_evict_more_than_evictable_takes_what_it_can(cache: rc.HybridCache) -> None:
    cached(cache, [1, 2])
    lk = cache.lock(cached(cache, [3, 4]).node)
    ev = cache.evict(kv_tokens=1000, mamba_states=5)
    assert (ev.kv_tokens, ev.mamba_states) == (2, 0)
    assert cache.evictable_size() == 0
    assert repr(ev) == (
        "Evicted(kv_tokens=2, mamba_states=0, kv_indices=array([], dtype=int64), "
        "mamba_slots=array([], dtype=int64))"
    )
    cache.unlock(lk)


@pytest.mark.parametrize("kwargs", [{"kv_tokens": -1}, {"mamba_states": -2}])
def test_negative_eviction_amounts_are_refused(
    cache: rc.HybridCache, kwargs: dict[str, int]
) -> None:
    arg = next(iter(kwargs))
    with pytest.raises(ValueError, match=f"^{arg}: must be >= 0"):
        cache.evict(**kwargs)


# --------------------------------------------------------------------------- allocation


def test_alloc_hands_out_whole_pages() -> None:
    c = rc.HybridCache(kv_slots=32, page_size=4)
    a = c.alloc_kv(8)
    assert a is not None
    assert a.dtype == np.int64
    assert len(a) == 8
    for page in a.reshape(-1, 4):
        assert page[0] % 4 == 0
        assert list(page) == list(range(page[0], page[0] + 4))
    assert c.available_kv() == 24
    empty = c.alloc_kv(0)
    assert empty is not None
    assert len(empty) == 0
    c.free_kv(a)
    assert c.available_kv() == 32
    c.audit()


def test_alloc_evicts_first_when_short(cache: rc.HybridCache) -> None:
    cached(cache, list(range(40)))
    assert cache.available_kv() == 24
    got = cache.alloc_kv(30)
    assert got is not None
    assert cache.stats()["evicted_kv_tokens"] == 40
    assert cache.available_kv() == 64 - 30
    cache.audit()


def test_alloc_returns_none_and_takes_nothing_when_it_cannot(cache: rc.HybridCache) -> None:
    lk = cache.lock(cached(cache, list(range(40))).node)
    before = fingerprint(cache)
    assert cache.alloc_kv(32) is None
    assert fingerprint(cache) == before
    assert cache.stats()["alloc_failures"] == 1
    cache.unlock(lk)


@pytest.mark.parametrize(("n", "msg"), [(3, "not a multiple of page_size 2"), (-2, "must be >= 0")])
def test_bad_alloc_sizes_are_refused(n: int, msg: str) -> None:
    c = rc.HybridCache(kv_slots=16, page_size=2)
    with pytest.raises(ValueError, match=f"^n: .*{msg}"):
        c.alloc_kv(n)
    assert c.available_kv() == 16


def test_free_errors_change_nothing(cache: rc.HybridCache) -> None:
    held = cache.alloc_kv(4)
    assert held is not None
    cached(cache, [1, 2])
    tree_slot = int(cache.match_prefix([1]).kv_indices[0])
    cache.free_kv(held[:2])
    before = fingerprint(cache)
    for bad, msg in [
        (held[:1], "not allocated"),  # double free
        ([tree_slot], "owned by the cache"),
        ([64], "out of range"),
        ([-1], "out of range"),
        ([int(held[2]), int(held[0])], "not allocated"),  # one good, one bad: neither freed
    ]:
        with pytest.raises(ValueError, match=f"^indices: .*{msg}"):
            cache.free_kv(bad)
        assert fingerprint(cache) == before
    with pytest.raises(TypeError, match=r"^indices: expected integers"):
        cache.free_kv([1.5])
    cache.free_kv(held[2:])
    assert cache.available_kv() == 62


# ------------------------------------------------------------------------- stats, audit


def test_stats_count_what_happened(cache: rc.HybridCache) -> None:
    cached(cache, [1, 2, 3, 4])
    cache.match_prefix([1, 2, 9])
    cache.evict(kv_tokens=100)
    s = cache.stats()
    assert s["insert_calls"] == 1
    assert s["inserted_tokens"] == 4
    assert s["match_calls"] == 2  # one inside `cached`
    assert s["hit_tokens"] == 2
    assert s["evicted_kv_tokens"] == 4
    assert s["kv_free_slots"] == 64
    assert s["kv_capacity_slots"] == 64
    assert all(isinstance(v, int) for v in s.values())


def test_pretty_prints_the_tree_and_truncates(cache: rc.HybridCache) -> None:
    cached(cache, [1, 2, 3, 4])
    cached(cache, [1, 2, 5, 6])
    text = cache.pretty()
    assert text.count("└") == 3
    assert "[1, 2]" in text
    assert cache.pretty(max_nodes=1).endswith("...")
    assert str(cache) == text
