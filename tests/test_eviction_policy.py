"""The ``eviction_policy=`` argument, the ``eviction_policy`` property and ``priority=``:
every form accepted, every error path, and the order each policy gives through the
Python API."""

from __future__ import annotations

import pytest

import radixcache as rc


def test_the_default_is_lru_for_every_component() -> None:
    assert rc.HybridCache().eviction_policy == {"kv": "lru", "mamba": "lru"}


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("lru", {"kv": "lru", "mamba": "lru"}),
        ("lfu", {"kv": "lfu", "mamba": "lfu"}),
        ("priority", {"kv": "priority", "mamba": "priority"}),
        # States only: KV keeps lru.
        ("state-value", {"kv": "lru", "mamba": "state-value"}),
        ("state_value", {"kv": "lru", "mamba": "state-value"}),
        ({"mamba": "state_value"}, {"kv": "lru", "mamba": "state-value"}),
        ({"kv": "priority"}, {"kv": "priority", "mamba": "lru"}),
        ({}, {"kv": "lru", "mamba": "lru"}),
        ({"kv": "lfu", "mamba": "priority"}, {"kv": "lfu", "mamba": "priority"}),
    ],
)
def test_the_property_reports_each_components_canonical_name(
    given: str | dict[str, str], expected: dict[str, str]
) -> None:
    c = rc.HybridCache(kv_slots=16, mamba_slots=2, eviction_policy=given)
    assert c.eviction_policy == expected
    # A new dict each time: changing it changes nothing.
    c.eviction_policy["kv"] = "lfu"
    assert c.eviction_policy == expected


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("lfu", {"kv": "lfu", "mamba": "lfu", "swa": "lfu"}),
        ("priority", {"kv": "priority", "mamba": "priority", "swa": "priority"}),
        # State-value values Mamba states only: KV and SWA keep lru.
        ("state-value", {"kv": "lru", "mamba": "state-value", "swa": "lru"}),
        ({"swa": "lfu"}, {"kv": "lru", "mamba": "lru", "swa": "lfu"}),
        ({"kv": "priority", "swa": "lru"}, {"kv": "priority", "mamba": "lru", "swa": "lru"}),
    ],
)
def test_a_model_with_swa_layers_reports_the_swa_policy(
    given: str | dict[str, str], expected: dict[str, str]
) -> None:
    c = rc.HybridCache(kv_slots=16, mamba_slots=2, swa_slots=8, swa_window=2, eviction_policy=given)
    assert c.eviction_policy == expected


def test_a_model_without_swa_layers_reports_no_swa_policy() -> None:
    # Accepted (as "mamba" is without Mamba layers), with nothing to order.
    c = rc.HybridCache(kv_slots=16, eviction_policy={"swa": "lfu"})
    assert c.eviction_policy == {"kv": "lru", "mamba": "lru"}


@pytest.mark.parametrize(
    ("given", "match"),
    [
        ("mru", r"eviction_policy: unknown policy \"mru\".*\"lfu\".*\"priority\".*\"state-value\""),
        ("LRU", r"eviction_policy: unknown policy"),
        ({"kv": "fifo"}, r"eviction_policy: unknown policy \"fifo\""),
        ({"full": "lru"}, r"eviction_policy: unknown component \"full\".*\"swa\""),
        ({"kv": "state-value"}, r"eviction_policy: \"state-value\" applies to Mamba states only"),
        ({"swa": "state-value"}, r"eviction_policy: \"state-value\".*for \"swa\""),
        ({"swa": "mru"}, r"eviction_policy: unknown policy \"mru\""),
        ({"kv": "state_value", "mamba": "lru"}, r"eviction_policy: \"state-value\""),
    ],
)
def test_a_bad_policy_is_a_value_error_naming_the_argument(
    given: str | dict[str, str], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        rc.HybridCache(eviction_policy=given)


@pytest.mark.parametrize("given", [3, None, ["lru"], {1: "lru"}, {"kv": 1}, {"kv": None}, b"lru"])
def test_a_policy_of_a_bad_type_is_a_type_error_naming_the_argument(given: object) -> None:
    with pytest.raises(TypeError, match="eviction_policy"):
        rc.HybridCache(eviction_policy=given)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["1", 1.0, True, None, [1]])
def test_a_priority_of_a_bad_type_is_a_type_error_naming_it(bad: object) -> None:
    c = rc.HybridCache(kv_slots=16, mamba_slots=2, eviction_policy="priority")
    slots = c.alloc_kv(4)
    with pytest.raises(TypeError, match="priority"):
        c.insert([1, 2, 3, 4], slots, priority=bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="priority"):
        c.admit([1, 2], priority=bad)  # type: ignore[arg-type]
    # Nothing was taken: the slots are still the caller's, no request was admitted.
    assert c.stats()["live_requests"] == 0
    c.free_kv(slots)
    c.audit()
    assert c.available_kv() == 16


def test_a_priority_out_of_the_64_bit_range_is_a_value_error_naming_it() -> None:
    c = rc.HybridCache(kv_slots=16)
    slots = c.alloc_kv(2)
    with pytest.raises(ValueError, match="priority"):
        c.insert([1, 2], slots, priority=2**64)
    with pytest.raises(ValueError, match="priority"):
        c.admit([1], priority=-(2**70))
    c.free_kv(slots)
    c.audit()


def cache_kv(c: rc.HybridCache, tokens: list[int], priority: int = 0) -> None:
    """Caches ``tokens`` with fresh slots and no match (an insert is never a hit)."""
    c.insert(tokens, c.alloc_kv(len(tokens)), priority=priority)


def test_lfu_keeps_the_node_a_match_used_over_a_more_recent_one() -> None:
    c = rc.HybridCache(kv_slots=16, eviction_policy="lfu")
    cache_kv(c, [1, 1])
    assert c.match_prefix([1, 1, 5]).device_len == 2
    for _ in range(3):
        cache_kv(c, [2, 2])
    assert c.evict(kv_tokens=2).kv_tokens == 2
    assert c.match_prefix([2, 2]).device_len == 0
    assert c.match_prefix([1, 1]).device_len == 2
    c.audit()


@pytest.mark.parametrize("policy", ["lru", "lfu", "priority", "state-value"])
def test_a_peek_counts_no_use_and_moves_nothing_in_the_order(policy: str) -> None:
    c = rc.HybridCache(kv_slots=16, mamba_slots=4, eviction_policy=policy)
    for t in (1, 2):  # [1, 1] goes first: older, and no match used it
        c.insert([t, t], c.alloc_kv(2), mamba_slot=c.alloc_mamba())
    stats = c.stats()
    for _ in range(3):
        assert c.peek_prefix([1, 1, 5]) == (2, 0, 2)
    assert c.stats() == stats
    assert c.evict(mamba_states=1).mamba_states == 1
    assert (c.peek_prefix([1, 1])[0], c.peek_prefix([2, 2])[0]) == (0, 2)
    c.audit()


def test_priority_keeps_what_a_high_priority_request_cached() -> None:
    c = rc.HybridCache(kv_slots=64, mamba_slots=4, eviction_policy="priority")
    req = c.admit([7, 7, 7], priority=5)
    assert req is not None
    c.extend(req, [7, 7, 7])
    c.finish(req)
    for t in (1, 2):
        c.insert([t, t], c.alloc_kv(2), mamba_slot=c.alloc_mamba())
    c.audit()
    # The request's state (priority 5) stays; the two of priority 0 go.
    assert c.evict(mamba_states=2).mamba_states == 2
    assert [c.match_prefix(t).device_len for t in ([1, 1], [2, 2], [7, 7, 7])] == [0, 0, 3]
    c.audit()


def test_each_swa_policy_chooses_which_window_evict_swa_takes() -> None:
    # [1, 1] cached first with priority 5 and matched once; [2, 2] cached last with
    # priority 0, never matched. The first leaf evict_swa takes goes whole.
    for policy, goes in (("lru", [1, 1]), ("lfu", [2, 2]), ("priority", [2, 2])):
        c = rc.HybridCache(kv_slots=16, swa_slots=8, swa_window=2, eviction_policy={"swa": policy})
        cache_kv(c, [1, 1], priority=5)
        assert c.match_prefix([1, 1, 5]).device_len == 2
        cache_kv(c, [2, 2])
        assert c.evict_swa(pages=1) == 2
        c.audit()
        stays = [2, 2] if goes == [1, 1] else [1, 1]
        assert c.match_prefix(goes).device_len == 0, policy
        assert c.match_prefix(stays).device_len == 2, policy
