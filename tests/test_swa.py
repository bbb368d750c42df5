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
