"""Engine-owned pools (``pools="engine"``): the engine's allocators own every device
slot; insert claims the slots it is passed, what the tree gives up goes back to the
engine exactly once (evict returns it, take_freed hands back the queue), and the calls
that allocate from the cache's own pools are refused."""

from __future__ import annotations

from typing import Callable

import numpy as np
import pytest

import radixcache as rc

from conftest import assert_pool_sums, fingerprint


def engine(kv_slots: int = 32, page_size: int = 1, mamba_slots: int = 0) -> rc.HybridCache:
    return rc.HybridCache(
        kv_slots=kv_slots, page_size=page_size, mamba_slots=mamba_slots, pools="engine"
    )


def test_the_mode_is_a_constructor_argument_and_a_property() -> None:
    assert rc.HybridCache(kv_slots=8).pools == "cache"
    assert rc.HybridCache(kv_slots=8, pools="cache").pools == "cache"
    assert engine().pools == "engine"


def test_an_unknown_mode_is_refused_naming_the_argument() -> None:
    want = r'^pools: unknown owner "sglang"; expected "cache" or "engine"$'
    with pytest.raises(ValueError, match=want):
        rc.HybridCache(kv_slots=8, pools="sglang")


@pytest.mark.parametrize(
    ("kwargs", "arg"),
    [
        ({"host_kv_slots": 8}, "host_kv_slots"),
        ({"mamba_slots": 2, "host_kv_slots": 8, "host_mamba_slots": 2}, "host_kv_slots"),
        ({"mamba_slots": 2, "host_mamba_slots": 2}, "host_mamba_slots"),
    ],
)
def test_a_host_tier_is_refused_naming_the_argument(kwargs: dict[str, int], arg: str) -> None:
    with pytest.raises(ValueError, match=rf'^{arg}: .*pools="engine", which has no host tier'):
        rc.HybridCache(kv_slots=8, pools="engine", **kwargs)


def test_every_slot_starts_with_the_engine() -> None:
    c = engine(kv_slots=16, page_size=4, mamba_slots=3)
    s = c.stats()
    assert (s["kv_engine_slots"], s["kv_queued_slots"]) == (16, 0)
    assert (s["mamba_engine_slots"], s["mamba_queued_slots"]) == (3, 0)
    assert s["kv_caller_slots"] == 16, "the engine's slots keep the caller gauge"
    assert (c.available_kv(), c.available_mamba()) == (0, 0)
    assert_pool_sums(c)
    c.audit()


def test_insert_claims_slots_and_queues_duplicates_and_the_unaligned_tail() -> None:
    c = engine(kv_slots=32, page_size=2)
    ins = c.insert([1, 2, 3, 4, 5], np.arange(5))
    assert ins.prefix_len == 0
    m = c.match_prefix([1, 2, 3, 4, 5])
    assert m.kv_indices.tolist() == [0, 1, 2, 3]
    assert c.available_kv() == 2, "the tail's page is queued"
    again = c.insert([1, 2, 3, 4], [8, 9, 10, 11])
    assert again.prefix_len == 4
    assert c.stats()["kv_queued_slots"] == 6
    c.audit()
    kv, states = c.take_freed()
    assert (kv.dtype, states.dtype) == (np.int64, np.int64)
    assert kv.tolist() == [4, 5, 8, 9, 10, 11]
    assert states.tolist() == []
    kv, states = c.take_freed()
    assert (kv.tolist(), states.tolist()) == ([], []), "each slot is handed back once"
    s = c.stats()
    assert (s["kv_slots_returned"], s["kv_engine_slots"], s["kv_queued_slots"]) == (6, 28, 0)
    assert_pool_sums(c)
    c.audit()


def test_insert_after_match_and_lock_hands_over_only_from_owned_from() -> None:
    c = engine(kv_slots=16)
    c.insert([1, 2], [0, 1])
    m = c.match_prefix([1, 2, 3])
    with c.lock(m.node):
        kv = np.concatenate([m.kv_indices, [7]])
        assert c.insert([1, 2, 3], kv, owned_from=m.device_len).prefix_len == 2
    assert c.match_prefix([1, 2, 3]).kv_indices.tolist() == [0, 1, 7]
    kv, states = c.take_freed()
    assert (kv.size, states.size) == (0, 0)
    c.audit()


def test_a_state_the_tree_does_not_keep_is_queued() -> None:
    c = engine(kv_slots=16, page_size=2, mamba_slots=4)
    assert not c.insert([1, 2], [0, 1], mamba_slot=0).mamba_existed
    m = c.match_prefix([1, 2])
    assert c.insert([1, 2], m.kv_indices, owned_from=2, mamba_slot=1).mamba_existed
    c.insert([5, 6, 7], [2, 3, 4], mamba_slot=2)  # unaligned end: no node ends there
    assert c.available_mamba() == 2
    kv, states = c.take_freed()
    assert (kv.tolist(), states.tolist()) == ([4, 5], [1, 2])
    assert c.stats()["mamba_slots_returned"] == 2
    c.audit()


def test_evict_returns_the_slots_it_freed_and_leaves_the_queue_to_take_freed() -> None:
    c = engine(kv_slots=16, page_size=2, mamba_slots=4)
    c.insert([1, 2], [0, 1], mamba_slot=0)
    c.insert([1, 2, 3, 4], [0, 1, 2, 3], owned_from=2, mamba_slot=1)
    c.insert([1, 2], [6, 7])  # duplicates: queued
    ev = c.evict(kv_tokens=16)
    assert (ev.kv_tokens, ev.mamba_states) == (4, 2)
    assert (ev.kv_indices.dtype, ev.mamba_slots.dtype) == (np.int64, np.int64)
    assert sorted(ev.kv_indices.tolist()) == [0, 1, 2, 3]
    assert sorted(ev.mamba_slots.tolist()) == [0, 1]
    assert c.stats()["kv_queued_slots"] == 2
    kv, _ = c.take_freed()
    assert kv.tolist() == [6, 7]
    s = c.stats()
    assert (s["kv_slots_returned"], s["mamba_slots_returned"]) == (6, 2)
    assert (s["kv_engine_slots"], s["mamba_engine_slots"]) == (16, 4)
    # The returned slots are the engine's: an insert may claim them again.
    c.insert([9, 9], ev.kv_indices[:2], mamba_slot=int(ev.mamba_slots[0]))
    assert_pool_sums(c)
    c.audit()


def test_a_cache_that_owns_its_pools_returns_and_queues_no_slots() -> None:
    c = rc.HybridCache(kv_slots=16)
    slots = c.alloc_kv(2)
    assert slots is not None
    c.insert([1, 2], slots)
    ev = c.evict(kv_tokens=2)
    assert ev.kv_tokens == 2
    assert (ev.kv_indices.size, ev.mamba_slots.size) == (0, 0)
    kv, states = c.take_freed()
    assert (kv.dtype, states.dtype, kv.size, states.size) == (np.int64, np.int64, 0, 0)
    s = c.stats()
    assert all(
        s[k] == 0
        for k in ("kv_engine_slots", "kv_queued_slots", "kv_slots_returned", "mamba_slots_returned")
    )


@pytest.mark.parametrize(
    ("kv", "mamba_slot", "arg", "why"),
    [
        ([0], None, "kv_indices", "in the cache's tree"),
        ([3], None, "kv_indices", "queued to go back to the engine"),
        ([8], None, "kv_indices", "out of range"),
        ([-1], None, "kv_indices", "out of range"),
        ([5, 5], None, "kv_indices", "listed twice"),
        ([5], 0, "mamba_slot", "in the cache's tree"),
        ([5], 1, "mamba_slot", "queued to go back to the engine"),
        ([5], 2, "mamba_slot", "out of range"),
    ],
)
def test_insert_refuses_a_slot_that_is_not_the_engines_and_changes_nothing(
    kv: list[int], mamba_slot: int | None, arg: str, why: str
) -> None:
    c = engine(kv_slots=8, mamba_slots=2)
    c.insert([1, 2, 3], [0, 1, 2], mamba_slot=0)
    c.insert([1, 2, 3], [3, 4, 6], mamba_slot=1)  # 3, 4, 6 and state 1 queued
    before = fingerprint(c)
    tokens = list(range(10, 10 + len(kv)))
    with pytest.raises(ValueError, match=rf"^{arg}: .*{why}"):
        c.insert(tokens, kv, mamba_slot=mamba_slot)
    assert fingerprint(c) == before
    assert c.stats()["kv_engine_slots"] == 2, "slots 5 and 7 stay the engine's"


REFUSED: list[tuple[str, Callable[[rc.HybridCache, rc.Request, rc.Node], object]]] = [
    ("alloc_kv", lambda c, r, n: c.alloc_kv(1)),
    ("free_kv", lambda c, r, n: c.free_kv([5])),
    ("alloc_mamba", lambda c, r, n: c.alloc_mamba()),
    ("free_mamba", lambda c, r, n: c.free_mamba(1)),
    ("admit", lambda c, r, n: c.admit([1, 2])),
    ("extend", lambda c, r, n: c.extend(r, [3])),
    ("extend_batch", lambda c, r, n: c.extend_batch([r], [3])),
    ("extend_batch", lambda c, r, n: c.extend_batch([], [])),
    ("checkpoint", lambda c, r, n: c.checkpoint(r)),
    ("finish", lambda c, r, n: c.finish(r)),
    ("abort", lambda c, r, n: c.abort(r)),
    ("load_back", lambda c, r, n: c.load_back(n)),
    ("load_back", lambda c, r, n: c.load_back(r)),
    ("load_back", lambda c, r, n: c.load_back(n, request=r)),
    ("evict_host", lambda c, r, n: c.evict_host(kv_tokens=1)),
]


@pytest.mark.parametrize(("call", "do"), REFUSED)
def test_calls_that_use_the_cache_pools_raise_cache_error_naming_the_mode(
    call: str, do: Callable[[rc.HybridCache, rc.Request, rc.Node], object]
) -> None:
    c = engine(kv_slots=16, mamba_slots=2)
    c.insert([1, 2], [0, 1], mamba_slot=0)
    # No request can be an engine-owned cache's: the refusal comes before the request
    # (here another cache's) is looked at.
    other = rc.HybridCache(kv_slots=16, mamba_slots=2)
    request = other.admit([1])
    assert request is not None
    node = c.match_prefix([1, 2]).node
    before = fingerprint(c)
    with pytest.raises(rc.CacheError, match=rf'^{call} is not available with pools="engine"'):
        do(c, request, node)
    assert fingerprint(c) == before
    other.abort(request)
