"""`HybridCache.reset()` (docs/contract.md rule 19): it empties both tiers and every
namespace, gives every slot back, keeps the counters, announces one "cleared" event
and writes nothing to the L3 tier; while anything holds the tree it raises
`CacheError` naming what, and changes nothing."""

from __future__ import annotations

import numpy as np
import pytest

import radixcache as rc
from radixcache.events import RouterIndex, decode_batch, encode_batch

from conftest import EventIndex, cached, fingerprint


def host_cache(**kwargs: object) -> rc.HybridCache:
    """A hybrid cache with a write-through host tier, page hashes and events."""
    args: dict[str, object] = dict(
        kv_slots=32,
        page_size=2,
        mamba_slots=4,
        host_kv_slots=64,
        host_mamba_slots=4,
        write_policy="write_through",
        page_hashes=True,
        events=True,
    )
    args.update(kwargs)
    return rc.HybridCache(**args)  # type: ignore[arg-type]


def run_all(c: rc.HybridCache) -> None:
    for _ in range(4):
        for b in c.take_batches():
            c.start(b.id)
            c.complete(b.id)


def put(c: rc.HybridCache, tokens: list[int], namespace: str | None = None) -> rc.Node:
    """Cache `tokens` with a state at their end."""
    state = c.alloc_mamba() if c.mamba_slots else None
    return cached(c, tokens, namespace=namespace, mamba_slot=state).node


def filled() -> tuple[rc.HybridCache, list[rc.Node]]:
    """Device nodes, a host-only node and a named namespace, every batch landed."""
    c = host_cache()
    nodes = [put(c, [1, 2, 3, 4]), put(c, [1, 2, 3, 4, 5, 6]), put(c, [9, 9, 9, 9], "tenant")]
    run_all(c)
    nodes.append(put(c, [20, 21, 22, 23]))
    run_all(c)
    c.evict(kv_tokens=32, mamba_states=4)
    run_all(c)
    assert c.match_prefix([20, 21, 22, 23]).host_len > 0
    return c, nodes


def assert_empty_and_full(c: rc.HybridCache) -> None:
    s = c.stats()
    assert s["nodes"] == 0
    assert s["namespaces"] == 1
    for pool in ("kv", "mamba", "host_kv", "host_mamba"):
        assert s[f"{pool}_free_slots"] == s[f"{pool}_capacity_slots"], pool
    c.audit()


def test_reset_empties_both_tiers_and_every_namespace() -> None:
    c, _nodes = filled()
    counters = {k: c.stats()[k] for k in ("evicted_nodes", "host_evictions", "insert_calls")}
    c.reset()
    assert_empty_and_full(c)
    for tokens, ns in (([1, 2, 3, 4, 5, 6], None), ([20, 21, 22, 23], None), ([9] * 4, "tenant")):
        m = c.match_prefix(tokens, namespace=ns)
        assert (m.device_len, m.host_len, m.kv_len) == (0, 0, 0)
    # A reset is not an eviction; `resets` counts it.
    s = c.stats()
    assert {k: s[k] for k in counters} == counters
    assert s["resets"] == 1
    assert c.take_batches() == []


def test_node_handles_from_before_a_reset_are_stale() -> None:
    c, nodes = filled()
    c.reset()
    for node in nodes:
        with pytest.raises(rc.StaleNodeError):
            c.lock(node)
        with pytest.raises(rc.StaleNodeError):
            c.load_back(node)


def test_the_cache_serves_again_after_a_reset() -> None:
    c, _ = filled()
    c.reset()
    put(c, [1, 2, 3, 4])
    run_all(c)
    m = c.match_prefix([1, 2, 3, 4, 7, 7])
    assert m.device_len == 4
    assert m.mamba_slot is not None
    c.reset()
    assert c.stats()["resets"] == 2
    assert_empty_and_full(c)


def refused(c: rc.HybridCache, what: str) -> None:
    """`reset()` raises CacheError naming `what` and changes nothing."""
    before = fingerprint(c)
    c.take_events()
    with pytest.raises(rc.CacheError, match=rf"^reset: the cache is in use: .*{what}"):
        c.reset()
    assert fingerprint(c) == before
    assert c.take_events() == []


def test_a_live_request_keeps_the_cache_from_resetting() -> None:
    c, _ = filled()
    r = c.admit([1, 2, 3, 4, 5, 6, 7, 8])
    assert r is not None
    run_all(c)
    refused(c, r"1 live requests \(finish or abort them\)")
    c.abort(r)
    c.reset()
    assert_empty_and_full(c)


def test_a_live_lock_keeps_the_cache_from_resetting() -> None:
    c, nodes = filled()
    lock = c.lock(nodes[1])
    refused(c, r"1 live locks \(release them\)")
    c.unlock(lock)
    c.reset()
    assert_empty_and_full(c)


def test_a_batch_in_flight_keeps_the_cache_from_resetting_taken_or_not() -> None:
    c, _ = filled()
    put(c, [30, 31, 32, 33])  # write-through: a backup batch, not taken yet
    refused(c, r"1 batches in flight")
    (batch,) = c.take_batches()
    c.start(batch.id)
    refused(c, r"1 batches in flight")
    c.fail(batch.id)
    c.reset()
    assert_empty_and_full(c)


def test_a_pending_load_back_keeps_the_cache_from_resetting() -> None:
    c, _ = filled()
    m = c.match_prefix([20, 21, 22, 23])
    lb = c.load_back(m.host_node)
    assert lb is not None
    refused(c, r"1 pending load-backs")
    lb.release()
    run_all(c)
    c.reset()
    assert_empty_and_full(c)


def test_everything_outstanding_is_named_at_once() -> None:
    c, nodes = filled()
    r = c.admit([1, 2, 3, 4, 5, 6, 7, 8])
    lock = c.lock(nodes[0])
    put(c, [50, 51, 52, 53])  # its backup: a batch not taken
    with pytest.raises(rc.CacheError) as e:
        c.reset()
    msg = str(e.value)
    assert "1 live requests" in msg
    assert "live locks" in msg
    assert "1 batches in flight" in msg
    assert r is not None
    c.abort(r)
    c.unlock(lock)
    run_all(c)
    c.reset()


def test_reset_announces_one_cleared_after_the_events_still_queued() -> None:
    c, _ = filled()
    index = EventIndex()
    index.check(c)
    put(c, [40, 41, 42, 43])
    run_all(c)
    queued = c.stats()["events_pending"]
    assert queued > 0
    c.reset()
    events = c.take_events()
    assert len(events) == queued + 1
    assert all(e.kind != "cleared" for e in events[:-1])
    cleared = events[-1]
    assert (cleared.kind, cleared.medium, cleared.hashes) == ("cleared", "", [])
    assert c.stats()["events_pending"] == 0
    # A router that applies them holds nothing of the cache afterwards, in either
    # wire format, and the next store is announced from there.
    for fmt in ("sglang", "vllm"):
        router = RouterIndex(format=fmt)
        assert router.apply(0, decode_batch(encode_batch(events, format=fmt), format=fmt))
        assert router.snapshot() == RouterIndex(format=fmt).snapshot()
    put(c, [1, 2, 3, 4])
    stored = c.take_events()
    assert stored[0].kind == "stored"
    assert stored[0].medium == "GPU"


def test_with_events_off_a_reset_queues_nothing() -> None:
    c = rc.HybridCache(kv_slots=16, page_size=1)
    cached(c, [1, 2, 3])
    c.reset()
    assert (c.stats()["events_emitted"], c.stats()["events_pending"]) == (0, 0)


def test_engine_pools_get_the_trees_slots_back_through_take_freed() -> None:
    c = rc.HybridCache(kv_slots=32, page_size=2, mamba_slots=4, pools="engine")
    c.insert([1, 2, 3, 4], np.array([4, 5, 6, 7]), mamba_slot=2)
    c.insert([1, 2, 9, 9], np.array([4, 5, 10, 11]), owned_from=2, mamba_slot=3)
    kv, states = c.take_freed()
    assert len(kv) == len(states) == 0
    c.reset()
    kv, states = c.take_freed()
    assert sorted(kv.tolist()) == [4, 5, 6, 7, 10, 11]
    assert sorted(states.tolist()) == [2, 3]
    assert c.stats()["kv_engine_slots"] == 32
    c.audit()


def test_reset_on_a_broken_cache_raises_cache_error() -> None:
    c = rc.HybridCache(kv_slots=16, page_size=1)
    with pytest.raises(rc.CacheError):
        c._panic_for_tests()
    with pytest.raises(rc.CacheError, match="broken"):
        c.reset()
