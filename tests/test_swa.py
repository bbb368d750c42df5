"""Sliding-window attention through the Python API: ``swa_slots=``/``swa_window=``, the
request's window (``Request.swa_indices``, ``Request.swa_start``), ``evict_swa``, the SWA
gauges and counters, and every error path."""

from __future__ import annotations

import numpy as np
import pytest

import radixcache as rc

from conftest import assert_pool_sums


def swa_cache(window: int = 4, slots: int = 64, page_size: int = 1) -> rc.HybridCache:
    return rc.HybridCache(kv_slots=256, page_size=page_size, swa_slots=slots, swa_window=window)


def test_the_arguments_are_properties_and_default_to_no_swa() -> None:
    c = swa_cache(window=3, slots=32, page_size=2)
    assert (c.swa_slots, c.swa_window) == (32, 3)
    plain = rc.HybridCache(kv_slots=16)
    assert (plain.swa_slots, plain.swa_window) == (0, 0)
    s = plain.stats()
    assert s["swa_capacity_slots"] == 0
    assert s["swa_free_slots"] == 0
    assert plain.evict_swa(pages=4) == 0


@pytest.mark.parametrize(
    ("kwargs", "arg"),
    [
        ({"swa_window": 4}, "swa_window"),
        ({"swa_slots": 8}, "swa_window"),
        ({"swa_slots": 7, "swa_window": 4, "page_size": 2}, "swa_slots"),
        ({"swa_slots": 8, "swa_window": 4, "host_kv_slots": 16}, "host_swa_slots"),
        ({"swa_slots": 8, "swa_window": 4, "pools": "engine"}, "swa_slots"),
        ({"swa_slots": -1, "swa_window": 4}, "swa_slots"),
        ({"swa_slots": 8, "swa_window": -4}, "swa_window"),
    ],
)
def test_bad_swa_arguments_raise_value_error_naming_them(
    kwargs: dict[str, object], arg: str
) -> None:
    with pytest.raises(ValueError, match=arg):
        rc.HybridCache(kv_slots=16, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("arg", ["swa_slots", "swa_window"])
def test_a_swa_argument_that_is_not_an_integer_raises_type_error_naming_it(arg: str) -> None:
    kwargs: dict[str, object] = {"swa_slots": 8, "swa_window": 4, arg: "8"}
    with pytest.raises(TypeError, match=arg):
        rc.HybridCache(kv_slots=16, **kwargs)  # type: ignore[arg-type]


def test_evict_swa_names_a_bad_pages_argument() -> None:
    c = swa_cache()
    with pytest.raises(ValueError, match="pages"):
        c.evict_swa(pages=-1)
    with pytest.raises(TypeError, match="pages"):
        c.evict_swa(pages="1")  # type: ignore[arg-type]


def test_a_request_exposes_its_window_and_gives_back_what_leaves_it() -> None:
    c = swa_cache(window=4, slots=64, page_size=2)
    req = c.admit(list(range(1, 1)))
    c.extend(req, list(range(1, 7)))
    assert (req.swa_start, len(req.swa_indices)) == (0, 6)
    c.extend(req, list(range(7, 11)))
    # At 6 tokens the window began at token 2: page 0 went before the new pages came.
    assert req.swa_start == 2
    swa = req.swa_indices
    assert swa.dtype == np.int64
    assert len(swa) == len(req.tokens) - req.swa_start
    assert (swa >= 0).all()
    assert len(set(swa.tolist())) == len(swa)
    s = c.stats()
    assert s["swa_window_freed_pages"] == 1
    assert s["swa_request_slots"] == 8
    assert_pool_sums(c)
    c.finish(req)
    assert c.stats()["swa_request_slots"] == 0
    c.audit()


def test_a_request_without_swa_layers_has_an_empty_window() -> None:
    c = rc.HybridCache(kv_slots=16)
    req = c.admit([])
    c.extend(req, [1, 2, 3])
    assert req.swa_start == 3
    assert len(req.swa_indices) == 0
    c.abort(req)


def test_a_match_needs_the_window_live_and_swa_eviction_makes_tombstones() -> None:
    c = swa_cache(window=4)
    for tokens in (list(range(1, 9)), list(range(1, 13))):
        req = c.admit(tokens)
        c.extend(req, tokens[req.prefix_len :])
        c.finish(req)
    assert c.match_prefix(list(range(1, 13))).device_len == 12
    # Lock the leaf, evict every other window: the first node keeps its KV only.
    guard = c.lock(c.match_prefix(list(range(1, 13))).node)
    assert c.evict_swa(pages=1_000) > 0
    assert c.stats()["swa_tombstones"] >= 1
    assert c.match_prefix(list(range(1, 13))).device_len == 12
    assert c.match_prefix(list(range(1, 9))).device_len == 0
    c.unlock(guard)
    c.audit()
    # Nothing locked: the leaf goes whole, and its tombstone parent with it.
    c.evict_swa(pages=1_000)
    assert c.stats()["nodes"] == 0
    assert c.stats()["swa_free_slots"] == c.stats()["swa_capacity_slots"]
    c.audit()


def test_alloc_kv_hands_out_swa_pages_with_the_kv_and_free_kv_takes_them_back() -> None:
    c = swa_cache(window=2, slots=8)
    slots = c.alloc_kv(8)
    assert slots is not None
    assert c.stats()["swa_caller_slots"] == 8
    # The SWA pool is empty and nothing can be evicted: refused.
    assert c.alloc_kv(1) is None
    assert c.stats()["swa_alloc_failures"] == 1
    c.free_kv(slots)
    assert c.stats()["swa_free_slots"] == 8
    assert_pool_sums(c)
    c.audit()


# --- the host tier -------------------------------------------------------------------


def swa_host_cache(write_policy: str = "write_through", host_swa_slots: int = 64) -> rc.HybridCache:
    """Window 2 in pages of 1, 64 slots in every pool but host SWA."""
    return rc.HybridCache(
        kv_slots=64,
        host_kv_slots=64,
        write_policy=write_policy,
        swa_slots=64,
        swa_window=2,
        host_swa_slots=host_swa_slots,
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"swa_slots": 8, "swa_window": 4, "host_kv_slots": 16}, "at least one page"),
        (
            {"swa_slots": 8, "swa_window": 4, "host_kv_slots": 16, "host_swa_slots": 3},
            "multiple of page_size",
        ),
        (
            {"swa_slots": 8, "swa_window": 4, "host_kv_slots": 16, "host_swa_slots": 18},
            "exceeds host_kv_slots",
        ),
        ({"swa_slots": 8, "swa_window": 4, "host_swa_slots": 2}, "without a host KV tier"),
        ({"host_kv_slots": 16, "host_swa_slots": 2}, "without SWA layers"),
        (
            {"swa_slots": 8, "swa_window": 4, "host_kv_slots": 16, "host_swa_slots": -2},
            "host_swa_slots",
        ),
    ],
)
def test_bad_host_swa_slots_raise_value_error_naming_it(
    kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match="host_swa_slots") as e:
        rc.HybridCache(kv_slots=16, page_size=2, **kwargs)  # type: ignore[arg-type]
    assert message in str(e.value)


def test_host_swa_slots_that_is_not_an_integer_raises_type_error_naming_it() -> None:
    with pytest.raises(TypeError, match="host_swa_slots"):
        rc.HybridCache(
            kv_slots=16,
            host_kv_slots=16,
            swa_slots=8,
            swa_window=4,
            host_swa_slots="8",  # type: ignore[arg-type]
        )


def test_host_swa_slots_is_a_property_and_a_pool_that_adds_up() -> None:
    c = swa_host_cache(host_swa_slots=16)
    assert c.host_swa_slots == 16
    assert rc.HybridCache(kv_slots=16).host_swa_slots == 0
    s = c.stats()
    assert (s["host_swa_capacity_slots"], s["host_swa_free_slots"]) == (16, 16)
    assert_pool_sums(c)


def test_pools_engine_with_swa_is_still_refused_naming_swa_slots() -> None:
    with pytest.raises(ValueError, match="swa_slots"):
        rc.HybridCache(kv_slots=16, swa_slots=8, swa_window=4, pools="engine")


def cache_tokens(c: rc.HybridCache, tokens: list[int]) -> None:
    req = c.admit(tokens)
    c.extend(req, tokens[req.prefix_len :])
    c.finish(req)


def test_a_backup_batch_copies_the_swa_pages_device_to_host() -> None:
    c = swa_host_cache()
    cache_tokens(c, list(range(1, 9)))
    batches = c.take_batches()
    assert [b.kind for b in batches] == ["backup"]
    copies = {copy.pool: copy for copy in batches[0].copies}
    assert set(copies) == {"kv", "swa"}
    swa = copies["swa"]
    assert (swa.src_tier, swa.dst_tier) == ("device", "host")
    # The request gave back the SWA pages that left its window: only the live ones go.
    assert 2 <= len(swa.src) < len(copies["kv"].src)
    assert len(swa.src) == len(swa.dst) == c.stats()["swa_backed_up_pages"]
    assert c.stats()["host_swa_draining_slots"] == len(swa.dst)
    assert_pool_sums(c)
    batches[0].start()
    batches[0].complete()
    s = c.stats()
    assert s["host_swa_cached_tokens"] == len(swa.dst)
    assert_pool_sums(c)
    c.audit()


def test_a_load_back_copies_the_window_host_to_device_and_restores_the_match() -> None:
    c = swa_host_cache()
    tokens = list(range(1, 9))
    cache_tokens(c, tokens)
    for b in c.take_batches():
        b.start()
        b.complete()
    c.evict(kv_tokens=64)
    m = c.match_prefix(tokens)
    assert (m.device_len, m.host_len) == (0, 8)
    lb = c.load_back(m.host_node)
    assert lb is not None
    copies = {copy.pool: copy for copy in lb.batch.copies}
    assert set(copies) == {"kv", "swa"}
    swa = copies["swa"]
    assert (swa.src_tier, swa.dst_tier) == ("host", "device")
    assert len(swa.src) == len(swa.dst) == 2, "the window's pages"
    assert c.stats()["swa_request_slots"] == 2, "the guard holds them"
    assert_pool_sums(c)
    lb.commit()
    lb.batch.start()
    lb.batch.complete()
    assert c.match_prefix(tokens).device_len == 8
    s = c.stats()
    assert s["swa_loaded_pages"] == 2
    assert_pool_sums(c)
    c.audit()


def test_a_released_load_back_gives_its_swa_pages_back() -> None:
    c = swa_host_cache(write_policy="write_back")
    tokens = list(range(1, 9))
    cache_tokens(c, tokens)
    assert c.evict(kv_tokens=64).kv_tokens == 8
    for b in c.take_batches():
        b.start()
        b.complete()
    m = c.match_prefix(tokens)
    assert m.host_len == 8
    lb = c.load_back(m.host_node)
    assert lb is not None
    lb.release()
    s = c.stats()
    assert s["swa_free_slots"] == s["swa_capacity_slots"]
    assert s["host_swa_cached_tokens"] > 0
    assert_pool_sums(c)
    c.audit()
