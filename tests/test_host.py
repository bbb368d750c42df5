"""The host tier and load-back of docs/contract.md: backups (write-through and write-back),
demotion, host eviction, and `load_back` with its guard (commit, complete, fail, every
way of calling it off), and every error path leaving the cache exactly as it was."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

import radixcache as rc

from conftest import cached, fingerprint, held_apart

# ---------------------------------------------------------------------------- helpers

#: stats() gauges of the host tier (fingerprint() covers the device ones).
HOST_GAUGES = (
    "host_kv_cached_tokens",
    "host_kv_free_slots",
    "host_mamba_cached_states",
    "host_mamba_free_slots",
    "load_backs_pending",
)

#: Counters this file follows.
COUNTERS = (
    "host_hit_tokens",
    "backups",
    "backups_done",
    "backups_failed",
    "backups_skipped",
    "demotions",
    "host_evictions",
    "load_backs",
    "load_backs_committed",
    "load_backs_called_off",
    "load_backs_called_off_nothing",
    "load_backs_called_off_busy",
    "load_backs_called_off_quota",
    "load_backs_called_off_room",
    "load_backs_called_off_state",
    "load_backs_called_off_released",
    "load_backs_failed",
)


def host_cache(
    *,
    kv_slots: int = 16,
    mamba_slots: int = 4,
    host_kv_slots: int = 32,
    host_mamba_slots: int = 4,
    write_policy: str = "write_through",
    write_through_threshold: int | None = None,
) -> rc.HybridCache:
    """A hybrid cache (KV + Mamba states) with a host tier for both."""
    return rc.HybridCache(
        kv_slots=kv_slots,
        mamba_slots=mamba_slots,
        host_kv_slots=host_kv_slots,
        host_mamba_slots=host_mamba_slots,
        write_policy=write_policy,
        write_through_threshold=write_through_threshold,
    )


def snapshot(cache: rc.HybridCache) -> tuple[object, ...]:
    """fingerprint() plus the host tier's gauges; audits the cache."""
    stats = cache.stats()
    return (fingerprint(cache), tuple(stats[k] for k in HOST_GAUGES))


def pools(cache: rc.HybridCache) -> tuple[int, int, int, int]:
    """Free slots of every pool: device KV, device states, host KV, host states."""
    s = cache.stats()
    return (
        cache.available_kv(),
        cache.available_mamba(),
        s["host_kv_free_slots"],
        s["host_mamba_free_slots"],
    )


def counters(cache: rc.HybridCache) -> dict[str, int]:
    s = cache.stats()
    return {k: s[k] for k in COUNTERS}


def moved(before: dict[str, int], cache: rc.HybridCache) -> dict[str, int]:
    """The counters that changed since `before`, by how much."""
    after = counters(cache)
    return {k: after[k] - before[k] for k in COUNTERS if after[k] != before[k]}


def run(cache: rc.HybridCache, batch: rc.TransferBatch) -> None:
    """What a transfer engine does with a batch that succeeds."""
    cache.start(batch.id)
    cache.complete(batch.id)


def one_batch(cache: rc.HybridCache, kind: str) -> rc.TransferBatch:
    batches = cache.take_batches()
    assert [b.kind for b in batches] == [kind], batches
    return batches[0]


def backed_up(cache: rc.HybridCache, tokens: list[int]) -> rc.Insert:
    """Cache `tokens` with a state at their end (write-through) and run their backup."""
    slot = cache.alloc_mamba()
    assert slot is not None
    ins = cached(cache, tokens, mamba_slot=slot)
    assert not ins.mamba_existed
    run(cache, one_batch(cache, "backup"))
    return ins


def demote(cache: rc.HybridCache, kv_tokens: int) -> None:
    """Evict exactly `kv_tokens` device tokens (backed-up leaves go to the host)."""
    assert cache.evict(kv_tokens=kv_tokens).kv_tokens == kv_tokens


def demoted(cache: rc.HybridCache, tokens: list[int]) -> rc.Node:
    """Cache `tokens` with a state, back them up and demote them; returns the host node.
    `tokens` must end the only evictable device leaf."""
    backed_up(cache, tokens)
    demote(cache, len(tokens))
    m = cache.match_prefix(tokens)
    assert m.host_len > 0
    return m.host_node


def admitted(cache: rc.HybridCache, tokens: list[int]) -> rc.Request:
    """Admit `tokens` and acknowledge the admission copy if there is one."""
    r = cache.admit(tokens)
    assert r is not None
    for b in cache.take_batches():
        assert b.kind == "cow"
        run(cache, b)
    assert r.copy_pending is None
    return r


def demoted_request() -> tuple[rc.HybridCache, rc.Request]:
    """[1, 2, 3, 4] (with its state) only on the host, and a request admitted for
    [1, 2, 3, 4, 5]: nothing on the device, four tokens to load, no state slot."""
    c = host_cache()
    demoted(c, [1, 2, 3, 4])
    r = admitted(c, [1, 2, 3, 4, 5])
    assert (r.prefix_len, r.host_len, r.mamba_slot) == (0, 4, None)
    return c, r


def split_request(mamba_slots: int = 4) -> tuple[rc.HybridCache, rc.Request]:
    """[1, 2] on the device with its state, its child [3, 4] (with a state) only on the
    host, and a request admitted for [1, 2, 3, 4, 5]: it reuses [1, 2] and already holds
    a state slot (its admission copy ran); two tokens to load."""
    c = host_cache(mamba_slots=mamba_slots)
    backed_up(c, [1, 2])
    backed_up(c, [1, 2, 3, 4])
    demote(c, 2)  # the leaf [3, 4] goes to the host, [1, 2] stays
    m = c.match_prefix([1, 2, 3, 4])
    assert (m.device_len, m.host_len) == (2, 2)
    r = admitted(c, [1, 2, 3, 4, 5])
    assert (r.prefix_len, r.host_len) == (2, 2)
    assert r.mamba_slot is not None
    assert r.mamba_slot != m.mamba_slot
    return c, r


class EngineError(RuntimeError):
    pass


def broken_engine(batch: rc.TransferBatch) -> None:
    """Stands in for `engine.run` when the engine refuses the batch before starting it."""
    raise EngineError(f"cannot run batch {batch.id}")


def serve_load(lb: rc.LoadBack, engine: Callable[[rc.TransferBatch], None]) -> None:
    """The documented use of a guard, with `engine` standing in for `engine.run`."""
    with lb:
        engine(lb.batch)
        lb.commit()


def mamba_dsts(batch: rc.TransferBatch) -> list[list[int]]:
    return [[int(x) for x in cp.dst] for cp in batch.copies if cp.pool == "mamba"]


# ------------------------------------------------ the seed bug: the request's state slot


def test_load_back_abort_frees_unpublished_mamba_slot() -> None:
    c, r = demoted_request()
    before = snapshot(c)
    free = pools(c)
    stats = c.stats()
    ctr = counters(c)
    assert c.load_back(r, mem_quota=3) is None  # four tokens to load
    assert r.mamba_slot is None
    assert r.load_pending is None
    assert (r.prefix_len, r.host_len) == (0, 4)
    assert c.available_mamba() == free[1] == 4
    after = c.stats()
    for key in ("mamba_free_slots", "mamba_request_slots", "mamba_caller_slots"):
        assert after[key] == stats[key], key
    assert after["mamba_draining_slots"] == 0
    assert pools(c) == free
    assert snapshot(c) == before
    assert moved(ctr, c) == {"load_backs_called_off": 1, "load_backs_called_off_quota": 1}
    assert c.take_batches() == []
    c.audit()
    # The request is unharmed: a load within quota goes through.
    lb = c.load_back(r, mem_quota=4)
    assert lb is not None
    lb.release()
    c.abort(r)
    assert pools(c) == (16, 4, 28, 3)
    c.audit()


def test_load_back_load_failure_frees_unpublished_mamba_slot() -> None:
    c, r = demoted_request()
    free = pools(c)
    before = snapshot(c)
    ctr = counters(c)
    lb = c.load_back(r)
    assert lb is not None
    assert r.mamba_slot is None, "the fresh slot is the guard's until commit"
    assert r.load_pending == lb.batch.id
    assert c.available_mamba() == free[1] - 2
    assert c.available_kv() == free[0] - 4
    with pytest.raises(EngineError):
        serve_load(lb, broken_engine)
    assert not lb.held
    assert not lb.committed
    assert r.mamba_slot is None
    assert r.load_pending is None
    assert (r.prefix_len, r.host_len) == (0, 4)
    assert pools(c) == free
    assert c.available_kv() == free[0]
    assert c.available_mamba() == free[1]
    s = c.stats()
    assert (s["host_kv_free_slots"], s["host_mamba_free_slots"]) == (free[2], free[3])
    assert s["mamba_draining_slots"] == 0
    assert snapshot(c) == before
    assert moved(ctr, c) == {
        "load_backs": 1,
        "load_backs_called_off": 1,
        "load_backs_called_off_released": 1,
    }
    c.audit()
    # The batch is gone with the guard: nothing to acknowledge.
    with pytest.raises(ValueError, match="batch_id"):
        c.complete(lb.batch.id)
    c.abort(r)
    c.audit()


@pytest.mark.parametrize("how", ["quota", "exception", "release", "garbage"])
def test_load_back_abort_keeps_preexisting_mamba_slot(how: str) -> None:
    c, r = split_request()
    slot = r.mamba_slot
    assert slot is not None
    before = snapshot(c)
    free = pools(c)
    if how == "quota":
        # Two tokens over a quota of one; the request's lock already protects [1, 2].
        assert c.load_back(r, mem_quota=1) is None
    else:
        lb = c.load_back(r)
        assert lb is not None
        assert r.mamba_slot == slot, "the old slot stays until the load completes"
        assert c.available_mamba() == free[1] - 2
        (fresh,) = mamba_dsts(lb.batch)[1]
        assert fresh != slot
        if how == "exception":
            with pytest.raises(EngineError):
                serve_load(lb, broken_engine)
        elif how == "release":
            lb.release()
        else:
            holder = [lb]
            del lb
            with pytest.warns(ResourceWarning, match="garbage-collected uncommitted"):
                holder.clear()  # the last reference goes: the guard is collected
    assert r.mamba_slot == slot
    assert r.load_pending is None
    assert (r.prefix_len, r.host_len) == (2, 2)
    assert pools(c) == free
    assert snapshot(c) == before
    # The request still owns the slot: the caller cannot free it ...
    with pytest.raises(ValueError, match="slot"):
        c.free_mamba(slot)
    assert snapshot(c) == before
    # ... and aborting the request returns it.
    c.abort(r)
    assert c.available_mamba() == free[1] + 1
    c.audit()


# ------------------------------------------------------------------ load-back succeeds


def test_load_back_success_uses_two_state_slots_and_copies_host_state_into_request_slot() -> None:
    c = host_cache()
    slot = c.alloc_mamba()
    assert slot is not None
    cached(c, [1, 2, 3, 4], mamba_slot=slot)
    backup = one_batch(c, "backup")
    run(c, backup)
    kv_backup = [cp for cp in backup.copies if cp.pool == "kv"]
    st_backup = [cp for cp in backup.copies if cp.pool == "mamba"]
    assert len(kv_backup) == len(st_backup) == 1
    host_kv = [int(x) for x in kv_backup[0].dst]
    (host_state,) = (int(x) for x in st_backup[0].dst)
    demote(c, 4)
    r = admitted(c, [1, 2, 3, 4, 5])
    free = pools(c)
    lb = c.load_back(r)
    assert lb is not None
    assert c.available_mamba() == free[1] - 2
    assert c.available_kv() == free[0] - 4
    assert pools(c)[2:] == free[2:], "the host copies are read, not moved"
    assert c.take_batches() == [], "a load's batch is reached only through its guard"
    assert lb.kv_tokens == 4
    assert (lb.held, lb.committed) == (True, False)
    b = lb.batch
    assert b.kind == "load_back"
    assert [(cp.pool, cp.src_tier, cp.dst_tier) for cp in b.copies] == [
        ("kv", "host", "device"),
        ("mamba", "host", "device"),
        ("mamba", "host", "device"),
    ]
    kv = b.copies[0]
    assert [int(x) for x in kv.src] == host_kv, "the host copy, in token order"
    assert len(set(int(x) for x in kv.dst)) == 4
    for cp in b.copies[1:]:
        assert [int(x) for x in cp.src] == [host_state]
    [restore], [mine] = mamba_dsts(b)
    assert restore != mine
    c.start(b.id)
    lb.commit()
    assert (lb.held, lb.committed) == (False, True)
    assert r.mamba_slot == mine, "the request runs from its own copy"
    c.complete(b.id)
    m = c.match_prefix([1, 2, 3, 4])
    assert m.mamba_slot == restore, "the tree's state is restored in the other slot"
    np.testing.assert_array_equal(m.kv_indices, kv.dst)  # dst[i] holds token i
    np.testing.assert_array_equal(r.kv_indices, m.kv_indices)
    assert c.available_mamba() == free[1] - 2
    c.audit()
    c.finish(r)
    c.audit()


def test_commit_then_complete_publishes_the_prefix() -> None:
    c, r = demoted_request()
    ctr = counters(c)
    lb = c.load_back(r)
    assert lb is not None
    c.start(lb.batch.id)
    lb.commit()
    # The request's prefix grows at commit ...
    assert (r.prefix_len, r.host_len) == (4, 0)
    np.testing.assert_array_equal(r.tokens, [1, 2, 3, 4])
    assert r.load_pending == lb.batch.id
    # ... the tree's only when the copies are acknowledged too.
    m = c.match_prefix([1, 2, 3, 4, 5])
    assert (m.device_len, m.host_len) == (0, 4)
    assert c.protected_size() == 4, "data in flight counts as protected"
    c.audit()
    c.complete(lb.batch.id)
    assert r.load_pending is None
    m = c.match_prefix([1, 2, 3, 4, 5])
    assert (m.device_len, m.host_len) == (4, 0)
    assert m.node == r.node
    np.testing.assert_array_equal(m.kv_indices, r.kv_indices)
    assert moved(ctr, c) == {
        "load_backs": 1,
        "load_backs_committed": 1,
        "host_hit_tokens": 4,  # the first match above still found them on the host
    }
    c.audit()
    # The loaded prefix serves the request like any device prefix.
    assert c.extend(r, [5]) is not None
    c.finish(r)
    m = c.match_prefix([1, 2, 3, 4, 5])
    assert (m.device_len, m.host_len) == (5, 0)
    c.audit()


def test_complete_before_commit_publishes_at_commit() -> None:
    c, r = demoted_request()
    lb = c.load_back(r)
    assert lb is not None
    run(c, lb.batch)
    assert lb.held
    assert (r.prefix_len, r.mamba_slot) == (0, None)
    m = c.match_prefix([1, 2, 3, 4])
    assert (m.device_len, m.host_len) == (0, 4), "not visible before commit"
    lb.commit()
    assert (r.prefix_len, r.host_len, r.load_pending) == (4, 0, None)
    assert r.mamba_slot == mamba_dsts(lb.batch)[1][0]
    m = c.match_prefix([1, 2, 3, 4])
    assert (m.device_len, m.host_len) == (4, 0)
    assert m.mamba_slot == mamba_dsts(lb.batch)[0][0]
    c.audit()
    c.finish(r)
    c.audit()


def test_load_back_replaces_a_preexisting_slot_only_when_the_copies_land() -> None:
    c, r = split_request()
    old = r.mamba_slot
    assert old is not None
    free = pools(c)
    lb = c.load_back(r)
    assert lb is not None
    [restore], [fresh] = mamba_dsts(lb.batch)
    assert old not in (restore, fresh), "a slot the request holds is never a destination"
    c.start(lb.batch.id)
    lb.commit()
    assert r.mamba_slot == fresh
    assert (r.prefix_len, r.host_len) == (4, 0)
    # The old slot is released only at complete.
    assert c.available_mamba() == free[1] - 2
    with pytest.raises(ValueError, match="slot"):
        c.free_mamba(old)
    c.complete(lb.batch.id)
    assert c.available_mamba() == free[1] - 1
    m = c.match_prefix([1, 2, 3, 4])
    assert (m.device_len, m.host_len, m.mamba_slot) == (4, 0, restore)
    c.audit()
    c.abort(r)
    assert c.available_mamba() == free[1]
    c.audit()


def test_load_back_of_a_node_without_request_takes_one_state_slot() -> None:
    c = host_cache()
    node = demoted(c, [1, 2, 3, 4])
    free = pools(c)
    lb = c.load_back(node)
    assert lb is not None
    assert c.available_mamba() == free[1] - 1
    assert [cp.pool for cp in lb.batch.copies] == ["kv", "mamba"]
    with lb:
        run(c, lb.batch)
        lb.commit()
    m = c.match_prefix([1, 2, 3, 4])
    assert (m.device_len, m.host_len, m.node) == (4, 0, node)
    assert m.mamba_slot == mamba_dsts(lb.batch)[0][0]
    # Nothing is locked any more: the loaded node is evictable (and demotes again).
    assert (c.evictable_size(), c.protected_size()) == (4, 0)
    demote(c, 4)
    assert pools(c) == free
    c.audit()


# -------------------------------------------------------------------- load-back called off


def test_load_back_called_off_when_the_device_has_no_room() -> None:
    c, r = demoted_request()
    # Fill the device with locked data: 14 of 16 slots, nothing evictable.
    ins = cached(c, list(range(100, 114)), mamba_slot=c.alloc_mamba())
    run(c, one_batch(c, "backup"))
    lock = c.lock(ins.node)
    assert (c.available_kv(), c.evictable_size()) == (2, 0)
    before = snapshot(c)
    ctr = counters(c)
    assert c.load_back(r) is None
    assert c.load_back(r, mem_quota=100) is None
    assert (r.mamba_slot, r.load_pending, r.prefix_len) == (None, None, 0)
    assert snapshot(c) == before
    assert moved(ctr, c) == {"load_backs_called_off": 2, "load_backs_called_off_room": 2}
    assert c.take_batches() == []
    # With room it goes through.
    c.unlock(lock)
    lb = c.load_back(r)
    assert lb is not None
    assert c.match_prefix(list(range(100, 114))).host_len == 14, "room made by demotion"
    lb.release()
    c.abort(r)
    c.audit()


def test_load_back_called_off_when_no_state_slot_can_be_had() -> None:
    c, r = demoted_request()
    held = [c.alloc_mamba() for _ in range(3)]  # one free state slot is left
    assert c.available_mamba() == 1
    before = snapshot(c)
    ctr = counters(c)
    assert c.load_back(r) is None, "a request's load needs two state slots"
    assert r.mamba_slot is None
    assert snapshot(c) == before
    assert moved(ctr, c) == {"load_backs_called_off": 1, "load_backs_called_off_state": 1}
    # A load without a request needs only the restoring slot.
    lb = c.load_back(c.match_prefix([1, 2, 3, 4]).host_node)
    assert lb is not None
    assert c.available_mamba() == 0
    lb.release()
    assert snapshot(c) == before
    for s in held:
        assert s is not None
        c.free_mamba(s)
    c.abort(r)
    c.audit()


def test_load_back_quota_counts_the_tokens_its_own_lock_protects() -> None:
    c = host_cache()
    backed_up(c, [1, 2, 3, 4])
    backed_up(c, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    demote(c, 6)  # the leaf [5..10] goes to the host; [1..4] stays, unlocked
    m = c.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert (m.device_len, m.host_len) == (4, 6)
    assert (c.evictable_size(), c.protected_size()) == (4, 0)
    target = m.host_node
    before = snapshot(c)
    # Six tokens to load; the load's own lock newly protects the four of [1..4].
    ctr = counters(c)
    assert c.load_back(target, mem_quota=1) is None  # 6 > 1 + 4
    assert snapshot(c) == before
    assert moved(ctr, c) == {"load_backs_called_off": 1, "load_backs_called_off_quota": 1}
    lb = c.load_back(target, mem_quota=2)  # 6 <= 2 + 4
    assert lb is not None
    assert lb.kv_tokens == 6
    assert c.protected_size() == 4, "the guard's lock holds the ancestor"
    lb.release()
    assert snapshot(c) == before
    # With the ancestor locked elsewhere, the load's lock protects nothing new.
    with c.lock(m.node):
        before = snapshot(c)
        ctr = counters(c)
        assert c.load_back(target, mem_quota=5) is None  # 6 > 5 + 0
        assert snapshot(c) == before
        assert moved(ctr, c) == {"load_backs_called_off": 1, "load_backs_called_off_quota": 1}
        lb = c.load_back(target, mem_quota=6)
        assert lb is not None
        lb.release()
    assert (c.evictable_size(), c.protected_size()) == (4, 0)
    c.audit()


def test_load_back_with_nothing_to_load_returns_none() -> None:
    c = host_cache()
    ins = backed_up(c, [1, 2, 3, 4])
    r = admitted(c, [1, 2, 3, 4, 5])  # everything is on the device
    assert (r.prefix_len, r.host_len) == (4, 0)
    fresh = admitted(c, [9, 9])  # nothing cached at all
    before = snapshot(c)
    ctr = counters(c)
    assert c.load_back(r) is None
    assert c.load_back(fresh) is None
    assert c.load_back(ins.node) is None
    assert c.load_back(ins.node, request=r) is None
    assert snapshot(c) == before
    assert moved(ctr, c) == {"load_backs_called_off": 4, "load_backs_called_off_nothing": 4}
    c.abort(r)
    c.abort(fresh)
    c.audit()


def test_guard_collected_uncommitted_releases_and_warns() -> None:
    c, r = demoted_request()
    before = snapshot(c)
    free = pools(c)
    holder = [c.load_back(r)]
    assert holder[0] is not None
    assert c.available_mamba() == free[1] - 2
    with pytest.warns(ResourceWarning, match="garbage-collected uncommitted"):
        holder.clear()  # the last reference goes: the guard is collected
    assert pools(c) == free
    assert (r.mamba_slot, r.load_pending) == (None, None)
    assert snapshot(c) == before
    assert c.stats()["load_backs_called_off_released"] == 1
    c.abort(r)
    c.audit()


@pytest.mark.parametrize("ack", ["complete", "fail"])
def test_started_then_dropped_load_quarantines_its_slots_until_acknowledged(ack: str) -> None:
    c, r = demoted_request()
    before = snapshot(c)
    free = pools(c)
    lb = c.load_back(r)
    assert lb is not None
    c.start(lb.batch.id)
    taken = (c.available_kv(), c.available_mamba())
    assert taken == (free[0] - 4, free[1] - 2)
    lb.release()
    assert not lb.held
    # The request is as it was, but the destinations are not free: a copy may write them.
    assert (r.mamba_slot, r.load_pending, r.prefix_len, r.host_len) == (None, None, 0, 4)
    assert (c.available_kv(), c.available_mamba()) == taken
    s = c.stats()
    assert s["mamba_draining_slots"] == 2
    assert s["live_locks"] == 1, "only the request's lock is left"
    c.audit()
    # Nothing can hand the slots out meanwhile.
    got = [c.alloc_mamba() for _ in range(3)]
    assert got[2] is None
    quarantined = {slot for dst in mamba_dsts(lb.batch) for slot in dst}
    assert not {g for g in got if g is not None} & quarantined
    for g in got[:2]:
        assert g is not None
        c.free_mamba(g)
    getattr(c, ack)(lb.batch.id)
    assert pools(c) == free
    assert c.stats()["mamba_draining_slots"] == 0
    assert snapshot(c) == before
    assert c.match_prefix([1, 2, 3, 4]).host_len == 4, "a released load published nothing"
    c.abort(r)
    c.audit()


# ----------------------------------------------------------------- commit, fail, commit


def test_fail_after_commit_turns_the_load_into_a_miss() -> None:
    # A fifth state slot: the failed load's fresh slot stays the request's until it ends,
    # and the second load needs two.
    c, r = split_request(mamba_slots=5)
    old = r.mamba_slot
    old_kv = r.kv_indices.copy()
    free = pools(c)
    tree = c.pretty(max_nodes=100).splitlines()[1:]
    ctr = counters(c)
    lb = c.load_back(r)
    assert lb is not None
    c.start(lb.batch.id)
    lb.commit()
    assert (r.prefix_len, r.host_len) == (4, 0)
    assert r.mamba_slot != old
    c.fail(lb.batch.id)
    assert r.prefix_len == 2, "the request drops back to its prefix before the load"
    assert r.mamba_slot == old
    assert r.load_pending is None
    np.testing.assert_array_equal(r.tokens, [1, 2])
    np.testing.assert_array_equal(r.kv_indices, old_kv)
    m = c.match_prefix([1, 2, 3, 4])
    assert (m.device_len, m.host_len) == (2, 2)
    # The fresh state slot the load was filling stays the request's until it ends (a
    # forward pass may have been queued on it): one state slot fewer is free.
    assert pools(c) == (free[0], free[1] - 1, free[2], free[3])
    assert c.stats()["mamba_retired_slots"] == 1
    assert c.pretty(max_nodes=100).splitlines()[1:] == tree, "the tree is as it was"
    assert moved(ctr, c) == {
        "load_backs": 1,
        "load_backs_committed": 1,
        "load_backs_failed": 1,
        "host_hit_tokens": 2,
    }
    # The failed load is a miss, not a loss: the host copy can be loaded again.
    lb = c.load_back(m.host_node, request=r)
    assert lb is not None
    with lb:
        run(c, lb.batch)
        lb.commit()
    assert r.prefix_len == 4
    c.finish(r)
    assert c.stats()["mamba_retired_slots"] == 0
    assert c.match_prefix([1, 2, 3, 4]).device_len == 4
    c.audit()


def test_pending_batches_lists_a_load_backs_batch_until_it_ends() -> None:
    c, r = split_request()
    lb = c.load_back(r)
    assert lb is not None
    assert c.pending_batches() == [(lb.batch.id, "load_back", False)]
    c.start(lb.batch.id)
    lb.commit()
    assert c.pending_batches() == [(lb.batch.id, "load_back", True)]
    c.complete(lb.batch.id)
    assert c.pending_batches() == []
    c.abort(r)
    c.audit()


def test_slots_extended_before_a_failed_load_are_not_reused_until_the_request_ends() -> None:
    c, r = split_request()
    lb = c.load_back(r)
    assert lb is not None
    c.start(lb.batch.id)
    lb.commit()
    fresh = r.mamba_slot
    # Extending while the committed load is in flight is allowed (stream order).
    extended = c.extend(r, [5])
    assert extended is not None
    assert fresh is not None
    c.fail(lb.batch.id)
    assert r.prefix_len == 2
    assert r.mamba_slot != fresh
    s = c.stats()
    assert (s["kv_retired_slots"], s["mamba_retired_slots"]) == (1, 1)
    held_apart(c, extended.tolist(), fresh)
    c.audit()
    c.abort(r)
    s = c.stats()
    assert (s["kv_retired_slots"], s["mamba_retired_slots"]) == (0, 0)
    assert s["kv_request_slots"] + s["mamba_request_slots"] == 0
    c.audit()


def test_fail_after_commit_restores_the_requests_host_len() -> None:
    """`fail` after commit puts "the request back to what it was" (LoadBack.commit):
    that includes what its admission found on the host, so `load_back(request)` can
    retry."""
    # A fifth state slot: the failed load's fresh slot stays the request's until it ends,
    # and the retry needs two.
    c, r = split_request(mamba_slots=5)
    lb = c.load_back(r)
    assert lb is not None
    c.start(lb.batch.id)
    lb.commit()
    assert r.host_len == 0
    c.fail(lb.batch.id)
    assert c.match_prefix([1, 2, 3, 4]).host_len == 2
    try:
        assert (r.prefix_len, r.host_len) == (2, 2)
        retry = c.load_back(r)
        assert retry is not None
        assert retry.kv_tokens == 2
        retry.release()
    finally:
        c.abort(r)
    c.audit()


def test_commit_after_fail_raises_and_releases() -> None:
    c, r = demoted_request()
    before = snapshot(c)
    free = pools(c)
    lb = c.load_back(r)
    assert lb is not None
    c.start(lb.batch.id)
    c.fail(lb.batch.id)
    with pytest.raises(rc.CacheError, match="failed"):
        lb.commit()
    assert not lb.committed
    assert not lb.held
    assert (r.prefix_len, r.mamba_slot, r.load_pending) == (0, None, None)
    assert pools(c) == free
    assert snapshot(c) == before
    assert c.match_prefix([1, 2, 3, 4]).host_len == 4
    c.abort(r)
    c.audit()


def test_commit_twice_raises() -> None:
    c, r = demoted_request()
    lb = c.load_back(r)
    assert lb is not None
    lb.commit()
    before = snapshot(c)
    with pytest.raises(rc.CacheError, match="committed already"):
        lb.commit()
    assert lb.committed
    assert snapshot(c) == before
    run(c, lb.batch)
    with pytest.raises(rc.CacheError, match="committed already"):
        lb.commit()
    assert r.prefix_len == 4
    c.finish(r)
    c.audit()


def test_commit_after_release_raises() -> None:
    c, r = demoted_request()
    lb = c.load_back(r)
    assert lb is not None
    lb.release()
    lb.release()  # a no-op
    before = snapshot(c)
    with pytest.raises(rc.CacheError, match="released already"):
        lb.commit()
    assert snapshot(c) == before
    c.abort(r)
    c.audit()


def test_abort_while_a_committed_load_is_in_flight() -> None:
    c, r = demoted_request()
    free = pools(c)
    lb = c.load_back(r)
    assert lb is not None
    c.start(lb.batch.id)
    lb.commit()
    c.abort(r)
    assert not r.live
    # In flight: the request's copy (given back, draining) and the restore slot (landing).
    assert c.stats()["mamba_draining_slots"] == 2
    assert pools(c) == (free[0] - 4, free[1] - 2, free[2], free[3])
    c.audit()
    c.complete(lb.batch.id)
    # The loaded node is published; the request's copy went back.
    m = c.match_prefix([1, 2, 3, 4])
    assert (m.device_len, m.host_len) == (4, 0)
    assert pools(c) == (free[0] - 4, free[1] - 1, free[2], free[3])
    c.audit()


# ------------------------------------------------------------------------- host eviction


def test_evict_host_takes_only_host_only_data_and_clears_the_tier() -> None:
    c = host_cache()
    demoted(c, [1, 2, 3, 4])
    backed_up(c, [7, 8])
    # [7, 8] is on the device too: its host copy stays.
    ev = c.evict_host(kv_tokens=100, mamba_states=100)
    assert (ev.kv_tokens, ev.mamba_states) == (4, 1)
    assert c.match_prefix([1, 2, 3, 4]).host_len == 0
    assert c.stats()["host_kv_cached_tokens"] == 2
    # evict, then evict_host: every pool is full again.
    demote(c, 2)
    assert c.evict_host(kv_tokens=1).kv_tokens == 2
    assert pools(c) == (16, 4, 32, 4)
    c.audit()


@pytest.mark.parametrize("kwargs", [{"kv_tokens": -1}, {"mamba_states": -2}])
def test_evict_host_refuses_negative_amounts(kwargs: dict[str, int]) -> None:
    c = host_cache()
    arg = next(iter(kwargs))
    with pytest.raises(ValueError, match=f"^{arg}: must be >= 0"):
        c.evict_host(**kwargs)


# ------------------------------------------------------------------------------ backups


def test_write_through_backs_up_on_insert_and_eviction_demotes() -> None:
    c = host_cache()
    ctr = counters(c)
    slot = c.alloc_mamba()
    cached(c, [1, 2, 3, 4], mamba_slot=slot)
    b = one_batch(c, "backup")
    assert [(cp.pool, cp.src_tier, cp.dst_tier) for cp in b.copies] == [
        ("kv", "device", "host"),
        ("mamba", "device", "host"),
    ]
    assert [int(x) for x in b.copies[1].src] == [slot]
    # Until the copy is acknowledged the node is locked on the device.
    assert (c.evictable_size(), c.protected_size()) == (0, 4)
    assert c.evict(kv_tokens=4).kv_tokens == 0
    run(c, b)
    assert (c.evictable_size(), c.protected_size()) == (4, 0)
    s = c.stats()
    assert (s["host_kv_cached_tokens"], s["host_mamba_cached_states"]) == (4, 1)
    demote(c, 4)
    assert pools(c) == (16, 4, 28, 3)
    m = c.match_prefix([1, 2, 3, 4, 5])
    assert (m.device_len, m.host_len, m.kv_len, m.mamba_slot) == (0, 4, 4, None)
    assert m.node != m.host_node
    assert moved(ctr, c) == {
        "backups": 1,
        "backups_done": 1,
        "demotions": 1,
        "host_hit_tokens": 4,
    }
    c.audit()


def test_write_back_demotion_frees_device_slots_when_the_backup_completes() -> None:
    c = host_cache(write_policy="write_back")
    slot = c.alloc_mamba()
    cached(c, [1, 2, 3, 4], mamba_slot=slot)
    assert c.take_batches() == [], "write-back emits no insert-time backup"
    ctr = counters(c)
    assert c.evict(kv_tokens=4).kv_tokens == 4
    assert (c.available_kv(), c.available_mamba()) == (12, 3), "freed only at complete"
    b = one_batch(c, "backup")
    assert [(cp.pool, cp.src_tier, cp.dst_tier) for cp in b.copies] == [
        ("kv", "device", "host"),
        ("mamba", "device", "host"),
    ]
    c.start(b.id)
    assert (c.available_kv(), c.available_mamba()) == (12, 3)
    assert c.match_prefix([1, 2, 3, 4]).host_len == 0, "not on the host before complete"
    c.audit()
    c.complete(b.id)
    assert pools(c) == (16, 4, 28, 3)
    m = c.match_prefix([1, 2, 3, 4])
    assert (m.device_len, m.host_len) == (0, 4)
    assert moved(ctr, c) == {
        "backups": 1,
        "backups_done": 1,
        "demotions": 1,
        "host_hit_tokens": 4,
    }
    c.audit()


def test_write_back_alloc_kv_returns_none_until_the_backup_completes() -> None:
    c = host_cache(kv_slots=4, write_policy="write_back")
    slot = c.alloc_mamba()
    cached(c, [1, 2, 3, 4], mamba_slot=slot)
    assert c.alloc_kv(4) is None, "eviction emitted a backup; the slots are not free yet"
    run(c, one_batch(c, "backup"))
    got = c.alloc_kv(4)
    assert got is not None
    assert c.match_prefix([1, 2, 3, 4]).host_len == 4
    c.free_kv(got)
    c.audit()


def test_failed_write_back_backup_removes_the_node() -> None:
    c = host_cache(write_policy="write_back")
    slot = c.alloc_mamba()
    ins = cached(c, [1, 2, 3, 4], mamba_slot=slot)
    ctr = counters(c)
    assert c.evict(kv_tokens=4).kv_tokens == 4
    b = one_batch(c, "backup")
    c.start(b.id)
    c.fail(b.id)
    assert pools(c) == (16, 4, 32, 4)
    m = c.match_prefix([1, 2, 3, 4])
    assert (m.device_len, m.host_len, m.kv_len) == (0, 0, 0)
    assert c.stats()["nodes"] == 0
    assert moved(ctr, c) == {"backups": 1, "backups_failed": 1}
    with pytest.raises(rc.StaleNodeError):
        c.lock(ins.node)
    c.audit()


def test_failed_write_through_backup_leaves_the_node_not_backed_up() -> None:
    c = host_cache()
    cached(c, [1, 2, 3, 4], mamba_slot=c.alloc_mamba())
    b = one_batch(c, "backup")
    c.start(b.id)
    c.fail(b.id)
    assert pools(c) == (12, 3, 32, 4)
    assert c.stats()["backups_failed"] == 1
    # Not on the host: eviction deletes it instead of demoting it.
    assert c.evict(kv_tokens=4).kv_tokens == 4
    assert c.match_prefix([1, 2, 3, 4]).kv_len == 0
    assert c.stats()["demotions"] == 0
    c.audit()


def test_backup_lists_ancestors_before_descendants() -> None:
    c = host_cache()
    cached(c, [1, 2, 3, 4], mamba_slot=c.alloc_mamba())
    first = one_batch(c, "backup")
    c.fail(first.id)  # [1..4] stays not backed up
    cached(c, [1, 2, 3, 4, 5, 6, 7, 8], mamba_slot=c.alloc_mamba())
    b = one_batch(c, "backup")
    ancestor = [int(x) for x in c.match_prefix([1, 2, 3, 4]).kv_indices]
    path = [int(x) for x in c.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).kv_indices]
    assert path[:4] == ancestor
    kv = [cp for cp in b.copies if cp.pool == "kv"]
    assert len(kv) == 1
    assert [int(x) for x in kv[0].src] == path, "ancestor's slots first, in path order"
    states = [cp for cp in b.copies if cp.pool == "mamba"]
    assert len(states) == 1
    assert [int(x) for x in states[0].src] == [
        c.match_prefix([1, 2, 3, 4]).mamba_slot,
        c.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).mamba_slot,
    ]
    run(c, b)
    demote(c, 8)
    m = c.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    assert (m.device_len, m.host_len) == (0, 8)
    assert c.match_prefix([1, 2, 3, 4]).host_len == 4
    c.audit()


@pytest.mark.parametrize("holder", ["lock", "load_back"])
def test_host_eviction_never_takes_a_host_locked_node(holder: str) -> None:
    c = host_cache(host_kv_slots=8)
    a = demoted(c, [1, 2, 3, 4])
    demoted(c, [5, 6, 7, 8])
    assert c.stats()["host_kv_free_slots"] == 0
    c.match_prefix([5, 6, 7, 8])  # [1..4] is now the least recently used host leaf
    guard: rc.Lock | rc.LoadBack | None = c.lock(a) if holder == "lock" else c.load_back(a)
    assert guard is not None
    ctr = counters(c)
    backed_up(c, [9, 10, 11, 12])  # needs 4 host slots: evicts a host-only leaf
    assert moved(ctr, c) == {"backups": 1, "backups_done": 1, "host_evictions": 1}
    assert c.match_prefix([1, 2, 3, 4]).host_len == 4, "the locked node survives"
    assert c.match_prefix([5, 6, 7, 8]).kv_len == 0, "the unlocked one went"
    c.audit()
    # Everything on the host that could go is locked or on the device: a backup that
    # finds no room is skipped, never served by the locked node.
    demote(c, 4)  # [9..12] to the host
    c.match_prefix([1, 2, 3, 4])
    lock_c = c.lock(c.match_prefix([9, 10, 11, 12]).host_node)
    ctr = counters(c)
    cached(c, [13, 14, 15, 16], mamba_slot=c.alloc_mamba())
    assert c.take_batches() == []
    assert moved(ctr, c) == {"backups_skipped": 1}
    assert c.match_prefix([1, 2, 3, 4]).host_len == 4
    c.audit()
    # Control: once released, [1..4] is the LRU host leaf and goes first.
    c.unlock(lock_c)
    if isinstance(guard, rc.Lock):
        c.unlock(guard)
    else:
        guard.release()
    c.match_prefix([9, 10, 11, 12])
    ctr = counters(c)
    backed_up(c, [17, 18, 19, 20])
    assert moved(ctr, c)["host_evictions"] == 1
    assert c.match_prefix([1, 2, 3, 4]).kv_len == 0
    assert c.match_prefix([9, 10, 11, 12]).host_len == 4
    c.audit()


# ------------------------------------------------------------------ load_back errors


def test_load_back_rejects_a_bad_target_type() -> None:
    c, r = demoted_request()
    before = snapshot(c)
    for bad in (42, "node", None, [1, 2, 3, 4]):
        with pytest.raises(TypeError, match=r"^target: expected a Node or a Request"):
            c.load_back(bad)  # type: ignore[arg-type]
    assert snapshot(c) == before
    c.abort(r)
    c.audit()


def test_load_back_rejects_a_negative_quota() -> None:
    c, r = demoted_request()
    before = snapshot(c)
    ctr = counters(c)
    with pytest.raises(ValueError, match=r"^mem_quota:"):
        c.load_back(r, mem_quota=-1)
    with pytest.raises(ValueError, match=r"^mem_quota:"):
        c.load_back(c.match_prefix([1, 2, 3, 4]).host_node, mem_quota=-5, request=r)
    with pytest.raises(TypeError, match=r"^mem_quota:"):
        c.load_back(r, mem_quota=1.5)  # type: ignore[arg-type]
    assert snapshot(c) == before
    assert moved(ctr, c) == {"host_hit_tokens": 4}  # the match above
    assert r.load_pending is None
    c.abort(r)
    c.audit()


def test_load_back_rejects_request_keyword_with_a_request_target() -> None:
    c, r = demoted_request()
    before = snapshot(c)
    with pytest.raises(ValueError, match=r"^request:"):
        c.load_back(r, request=r)
    assert snapshot(c) == before
    c.abort(r)
    c.audit()


def test_load_back_rejects_a_request_that_extended_past_its_prefix() -> None:
    c, r = demoted_request()
    assert c.extend(r, [1]) is not None
    node = c.match_prefix([1, 2, 3, 4]).host_node
    before = snapshot(c)
    with pytest.raises(ValueError, match=r"^request:.*extended"):
        c.load_back(r)
    with pytest.raises(ValueError, match=r"^request:.*extended"):
        c.load_back(node, request=r)
    assert snapshot(c) == before
    assert r.load_pending is None
    c.abort(r)
    c.audit()


def test_load_back_rejects_a_request_not_admitted_through_the_node() -> None:
    c = host_cache()
    a = demoted(c, [1, 2, 3, 4])
    backed_up(c, [7, 7])
    r = admitted(c, [7, 7, 7])  # reuses the device node [7, 7]
    assert r.prefix_len == 2
    before = snapshot(c)
    with pytest.raises(ValueError, match=r"^request:.*not admitted"):
        c.load_back(a, request=r)
    assert snapshot(c) == before
    assert r.load_pending is None
    c.abort(r)
    c.audit()


@pytest.mark.parametrize(
    ("prompt", "reused"),
    [
        ([7, 8, 9], 0),  # nothing reused: the request sits at the root
        ([1, 2, 5, 6, 7], 2),  # reuses [1, 2], then leaves for a sibling of [3, 4]
    ],
)
def test_load_back_rejects_a_request_admitted_for_another_sequence(
    prompt: list[int], reused: int
) -> None:
    """Rule 9: the request must have been admitted for a sequence through the node;
    sharing an ancestor (the root at least) with it is not enough."""
    c = host_cache()
    backed_up(c, [1, 2])
    backed_up(c, [1, 2, 3, 4])
    demote(c, 2)
    node = c.match_prefix([1, 2, 3, 4]).host_node
    r = admitted(c, prompt)
    assert r.prefix_len == reused
    before = snapshot(c)
    accepted: list[rc.LoadBack | None] = []
    try:
        with pytest.raises(ValueError, match=r"^request:"):
            accepted.append(c.load_back(node, request=r))
        assert snapshot(c) == before
        assert r.prefix_len == reused
    finally:
        # Wrongly accepted, a commit would give the request [1, 2, 3, 4] as its prefix,
        # which is not its prompt's: call it off and leave the cache clean.
        for lb in accepted:
            if lb is not None:
                lb.release()
        c.abort(r)
    c.audit()


def test_load_back_rejects_a_request_on_a_stateless_hybrid_target() -> None:
    c = host_cache()
    backed_up(c, [1, 2, 3, 4, 5, 6, 7, 8])
    # Splitting at [1..4] makes a node without a state of its own.
    ins = cached(c, [1, 2, 3, 4])
    assert ins.prefix_len == 4
    split = ins.node
    c.take_batches()
    demote(c, 8)
    r = admitted(c, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert (r.prefix_len, r.host_len) == (0, 8)
    before = snapshot(c)
    with pytest.raises(ValueError, match="Mamba state"):
        c.load_back(split, request=r)
    assert snapshot(c) == before
    # Without a request it loads the KV alone.
    lb = c.load_back(split)
    assert lb is not None
    assert [cp.pool for cp in lb.batch.copies] == ["kv"]
    lb.release()
    c.abort(r)
    c.audit()


def test_load_back_of_a_stale_node_raises() -> None:
    c = host_cache()
    ins = cached(c, [7, 7], mamba_slot=c.alloc_mamba())
    one_batch(c, "backup").fail()
    assert c.evict(kv_tokens=2).kv_tokens == 2  # not backed up: deleted
    other = host_cache()
    foreign = demoted(other, [1, 2, 3, 4])
    demoted(c, [1, 2, 3, 4])
    before = snapshot(c)
    with pytest.raises(rc.StaleNodeError):
        c.load_back(ins.node)
    with pytest.raises(rc.StaleNodeError):
        c.load_back(foreign)
    assert snapshot(c) == before
    c.audit()


@pytest.mark.parametrize("end", ["finish", "abort"])
def test_load_back_of_an_ended_request_raises(end: str) -> None:
    c, r = demoted_request()
    node = c.match_prefix([1, 2, 3, 4]).host_node
    getattr(c, end)(r)
    before = snapshot(c)
    with pytest.raises(rc.CacheError):
        c.load_back(r)
    with pytest.raises(rc.CacheError):
        c.load_back(node, request=r)
    assert snapshot(c) == before
    c.audit()


def test_load_back_while_the_admission_copy_is_pending_raises() -> None:
    c, first = split_request()
    r = c.admit([1, 2, 3, 4, 6])
    assert r is not None
    assert r.host_len == 2
    (cow,) = c.take_batches()
    assert r.copy_pending == cow.id
    before = snapshot(c)
    with pytest.raises(rc.CacheError, match="not acknowledged"):
        c.load_back(r)
    assert snapshot(c) == before
    assert r.load_pending is None
    c.complete(cow.id)
    c.abort(first)  # its state slot makes room for the load's two
    lb = c.load_back(r)  # allowed once the copy is acknowledged
    assert lb is not None
    lb.release()
    c.abort(r)
    c.audit()


def test_second_load_back_while_one_is_pending_raises() -> None:
    c, r = demoted_request()
    node = c.match_prefix([1, 2, 3, 4]).host_node
    lb = c.load_back(r)
    assert lb is not None
    before = snapshot(c)
    with pytest.raises(rc.CacheError):
        c.load_back(r)
    with pytest.raises(rc.CacheError):
        c.load_back(node, request=r)
    assert snapshot(c) == before
    assert r.load_pending == lb.batch.id
    # Committed but unacknowledged is still pending.
    lb.commit()
    before = snapshot(c)
    with pytest.raises(rc.CacheError):
        c.load_back(r)
    assert snapshot(c) == before
    run(c, lb.batch)
    assert r.load_pending is None
    c.finish(r)
    c.audit()


@pytest.mark.parametrize("stage", ["held", "committed"])
@pytest.mark.parametrize("call", ["finish", "checkpoint"])
def test_finish_or_checkpoint_while_a_load_is_pending_raises(stage: str, call: str) -> None:
    c, r = demoted_request()
    lb = c.load_back(r)
    assert lb is not None
    if stage == "committed":
        c.start(lb.batch.id)
        lb.commit()
    before = snapshot(c)
    prefix = r.prefix_len
    with pytest.raises(rc.CacheError):
        getattr(c, call)(r)
    assert snapshot(c) == before
    assert r.live
    assert r.prefix_len == prefix
    assert r.load_pending == lb.batch.id
    if stage == "committed":
        c.complete(lb.batch.id)
    else:
        lb.release()
    getattr(c, call)(r)  # allowed once the load is settled
    if call == "checkpoint":
        for b in c.take_batches():
            run(c, b)
        c.abort(r)
    c.audit()


# --------------------------------------------------------------------------------- stats


def test_host_stats_exist_and_move() -> None:
    c = host_cache(host_kv_slots=8)
    s = c.stats()
    assert all(s[k] == 0 for k in COUNTERS), {k: s[k] for k in COUNTERS}
    assert [s[k] for k in HOST_GAUGES] == [0, 8, 0, 4, 0]

    ctr = counters(c)
    backed_up(c, [1, 2, 3, 4])
    demote(c, 4)
    assert moved(ctr, c) == {"backups": 1, "backups_done": 1, "demotions": 1}

    ctr = counters(c)
    assert c.match_prefix([1, 2, 3, 4, 5]).host_len == 4
    assert moved(ctr, c) == {"host_hit_tokens": 4}

    ctr = counters(c)
    cached(c, [5, 6, 7, 8], mamba_slot=c.alloc_mamba())
    one_batch(c, "backup").fail()
    assert moved(ctr, c) == {"backups": 1, "backups_failed": 1}

    ctr = counters(c)
    assert c.evict(kv_tokens=4).kv_tokens == 4  # [5..8] is not backed up: deleted
    demoted(c, [9, 10, 11, 12])  # its match finds 4 tokens on the host
    assert moved(ctr, c) == {
        "backups": 1,
        "backups_done": 1,
        "demotions": 1,
        "host_hit_tokens": 4,
    }
    assert c.stats()["host_kv_free_slots"] == 0

    ctr = counters(c)
    c.match_prefix([9, 10, 11, 12])  # [1..4] is the LRU host leaf
    backed_up(c, [13, 14, 15, 16])
    assert moved(ctr, c) == {
        "backups": 1,
        "backups_done": 1,
        "host_evictions": 1,
        "host_hit_tokens": 4,
    }
    assert c.match_prefix([1, 2, 3, 4]).kv_len == 0

    r = admitted(c, [9, 10, 11, 12, 1])
    ctr = counters(c)
    assert c.load_back(r, mem_quota=0) is None
    assert moved(ctr, c) == {"load_backs_called_off": 1, "load_backs_called_off_quota": 1}

    ctr = counters(c)
    lb = c.load_back(r)
    assert lb is not None
    assert c.stats()["load_backs_pending"] == 1
    c.start(lb.batch.id)
    lb.commit()
    c.fail(lb.batch.id)
    assert moved(ctr, c) == {"load_backs": 1, "load_backs_committed": 1, "load_backs_failed": 1}
    assert c.stats()["load_backs_pending"] == 0

    node = c.match_prefix([9, 10, 11, 12]).host_node
    ctr = counters(c)
    lb = c.load_back(node, request=r)
    assert lb is not None
    with lb:
        run(c, lb.batch)
        lb.commit()
    assert moved(ctr, c) == {"load_backs": 1, "load_backs_committed": 1}
    s = c.stats()
    assert [s[k] for k in HOST_GAUGES] == [8, 0, 2, 2, 0]
    c.finish(r)
    c.audit()


# ------------------------------------------------------------ what a batch hands out


Batches = tuple[rc.HybridCache, list[rc.TransferBatch], rc.LoadBack, list[rc.Request]]


def batches_of_every_kind() -> Batches:
    """A backup batch, a copy-on-write batch and a load-back's batch of one cache, the
    load-back and the requests they are for."""
    c = host_cache(kv_slots=32, mamba_slots=8)
    slot = c.alloc_mamba()
    assert slot is not None
    cached(c, [1, 2, 3, 4], mamba_slot=slot)
    backup = one_batch(c, "backup")
    run(c, backup)
    demote(c, 4)
    r = c.admit([1, 2, 3, 4, 5])
    assert r is not None
    lb = c.load_back(r)
    assert lb is not None
    backed_up(c, [9, 8])
    r2 = c.admit([9, 8, 7])
    assert r2 is not None
    cow = one_batch(c, "cow")
    slot = c.alloc_mamba()
    assert slot is not None
    cached(c, [6, 6], mamba_slot=slot)
    return c, [one_batch(c, "backup"), cow, lb.batch], lb, [r, r2]


def end_all(c: rc.HybridCache, batches: list[rc.TransferBatch], lb: rc.LoadBack,
            requests: list[rc.Request]) -> None:  # fmt: skip
    for b in batches:
        run(c, b)
    lb.commit()
    for r in requests:
        c.abort(r)
    c.audit()


def test_copy_slot_arrays_are_read_only() -> None:
    # The arrays say which slots the cache will publish: editing one in place would
    # redirect the engine's copy and publish a slot that was never filled.
    c, batches, lb, requests = batches_of_every_kind()
    for b in batches:
        assert b.copies
        for cp in b.copies:
            for arr in (cp.src, cp.dst):
                before = arr.copy()
                assert not arr.flags.writeable
                with pytest.raises(ValueError, match="read-only"):
                    arr[0] = arr[0] + 1
                with pytest.raises(ValueError, match="WRITEABLE"):
                    arr.setflags(write=True)
                np.testing.assert_array_equal(arr, before)
            assert cp.src is cp.src  # the same array each time, read-only for everyone
    end_all(c, batches, lb, requests)


def test_a_batch_tells_whether_a_cache_issued_it() -> None:
    c, batches, lb, requests = batches_of_every_kind()
    twin = host_cache(kv_slots=32, mamba_slots=8)
    for b in batches:
        assert b.belongs_to(c)
        assert not b.belongs_to(twin)
    assert twin.take_batches() == []
    with pytest.raises(TypeError, match=r"^cache: expected a HybridCache, got int$"):
        batches[0].belongs_to(3)
    with pytest.raises(TypeError, match=r"^cache: expected a HybridCache, got TransferBatch$"):
        batches[0].belongs_to(batches[1])
    end_all(c, batches, lb, requests)
