"""The request level of docs/contract.md (admit, extend, checkpoint, finish, abort), transfer
batches, the Mamba state pool and state eviction: every path, and every error path
leaving the cache exactly as it was."""

from __future__ import annotations

import gc
import re

import numpy as np
import pytest

import radixcache as rc

from conftest import cached, fingerprint, held_apart

# ---------------------------------------------------------------------------- helpers


def hybrid(kv_slots: int = 64, page_size: int = 1, mamba_slots: int = 4) -> rc.HybridCache:
    return rc.HybridCache(kv_slots=kv_slots, page_size=page_size, mamba_slots=mamba_slots)


def with_state(
    cache: rc.HybridCache, tokens: list[int], namespace: str | None = None
) -> tuple[rc.Insert, int]:
    """Cache `tokens` with a Mamba state at their end (low-level API); returns the slot."""
    slot = cache.alloc_mamba()
    assert slot is not None
    ins = cached(cache, tokens, namespace=namespace, mamba_slot=slot)
    assert not ins.mamba_existed
    return ins, slot


def tree_states(cache: rc.HybridCache) -> list[int]:
    """Device state slots the tree holds, read off `pretty()` (which changes nothing)."""
    return sorted(
        int(s) for s in re.findall(r"state@(\d+)", cache.pretty(max_nodes=10_000, max_tokens=0))
    )


def gauge(cache: rc.HybridCache, key: str) -> int:
    return cache.stats()[key]


def one_batch(cache: rc.HybridCache) -> rc.TransferBatch:
    batches = cache.take_batches()
    assert len(batches) == 1, batches
    return batches[0]


def admitted(cache: rc.HybridCache, tokens: list[int], **kwargs: object) -> rc.Request:
    r = cache.admit(tokens, **kwargs)  # type: ignore[arg-type]
    assert r is not None
    return r


def served(cache: rc.HybridCache, tokens: list[int]) -> rc.Request:
    """Admit `tokens`, acknowledge the admission copy, extend the rest of the prompt."""
    r = admitted(cache, tokens)
    for b in cache.take_batches():
        cache.complete(b.id)
    assert r.copy_pending is None
    got = cache.extend(r, tokens[r.prefix_len :])
    assert got is not None
    return r


def full(cache: rc.HybridCache) -> bool:
    return cache.available_kv() == cache.kv_slots and cache.available_mamba() == cache.mamba_slots


# ------------------------------------------------------------------------------ admit


def test_admit_with_no_match_takes_no_state_and_emits_nothing() -> None:
    c = hybrid()
    r = admitted(c, [1, 2, 3])
    assert r.live
    assert (r.prefix_len, r.host_len, r.branch_len) == (0, 0, 0)
    assert r.tokens.dtype == np.int64
    assert r.tokens.shape == (0,)
    assert r.kv_indices.dtype == np.int64
    assert r.kv_indices.shape == (0,)
    assert r.mamba_slot is None
    assert r.copy_pending is None
    assert "root" in repr(r.node)
    assert repr(r) == "<Request 0 tokens, prefix_len=0, mamba_slot=None>"
    assert c.take_batches() == []
    assert c.available_mamba() == 4
    s = c.stats()
    assert (s["admits"], s["live_requests"], s["live_locks"], s["cow_copies"]) == (1, 1, 1, 0)
    c.abort(r)
    assert full(c)
    c.audit()


def test_cow_batch_copies_from_node_slot_to_request_slot() -> None:
    c = hybrid()
    ins, node_slot = with_state(c, [1, 2, 3])
    m = c.match_prefix([1, 2, 3])
    assert m.mamba_slot == node_slot
    free = c.available_mamba()
    r = admitted(c, [1, 2, 3, 4])
    assert r.mamba_slot is not None
    assert r.mamba_slot != node_slot
    assert c.available_mamba() == free - 1
    assert (r.prefix_len, r.branch_len) == (3, 3)
    np.testing.assert_array_equal(r.tokens, [1, 2, 3])
    np.testing.assert_array_equal(r.kv_indices, m.kv_indices)
    assert r.node == ins.node
    b = one_batch(c)
    assert isinstance(b, rc.TransferBatch)
    assert b.kind == "cow"
    assert r.copy_pending == b.id
    assert len(b.copies) == 1
    cp = b.copies[0]
    assert isinstance(cp, rc.Copy)
    assert (cp.pool, cp.src_tier, cp.dst_tier) == ("mamba", "device", "device")
    assert cp.src.dtype == np.int64
    assert cp.dst.dtype == np.int64
    assert list(cp.src) == [node_slot]
    assert list(cp.dst) == [r.mamba_slot]
    assert "cow" in repr(b)
    assert "mamba" in repr(cp)
    assert c.take_batches() == [], "a batch is taken once"
    s = c.stats()
    assert (s["cow_copies"], s["batches_in_flight"], s["state_hits"]) == (1, 1, 2)
    # The request's lock protects the prefix and the node's state.
    assert (c.protected_size(), s["mamba_protected_states"]) == (3, 1)
    c.audit()
    c.complete(b.id)
    assert r.copy_pending is None
    s = c.stats()
    assert (s["batches_in_flight"], s["batches_completed"]) == (0, 1)
    c.abort(r)
    assert c.available_mamba() == free
    c.audit()


def test_admit_in_a_namespace_sees_only_its_tree() -> None:
    c = hybrid()
    with_state(c, [1, 2], namespace="a")
    r = admitted(c, [1, 2, 3])
    assert (r.prefix_len, r.mamba_slot) == (0, None)
    assert c.take_batches() == []
    ra = admitted(c, [1, 2, 3], namespace="a")
    assert ra.prefix_len == 2
    cow = one_batch(c)
    assert cow.kind == "cow"
    cow.complete()
    c.abort(r)
    c.abort(ra)
    c.audit()


def test_admit_refused_when_the_state_pool_is_exhausted_by_locked_states() -> None:
    c = hybrid(mamba_slots=2)
    with_state(c, [1, 2])
    first = admitted(c, [1, 2, 3])  # takes the second slot; locks the cached state
    one_batch(c).complete()
    assert c.available_mamba() == 0
    before = fingerprint(c)
    stats = c.stats()
    assert c.admit([1, 2, 3]) is None
    assert c.admit([1, 2, 9, 9]) is None
    assert fingerprint(c) == before
    assert c.take_batches() == []
    after = c.stats()
    assert after["admits_refused"] == stats["admits_refused"] + 2
    assert after["admits"] == stats["admits"]
    assert after["live_locks"] == 1
    # A request that needs no copy is admitted all the same.
    other = admitted(c, [7, 7])
    c.abort(other)
    c.abort(first)
    c.audit()


def test_admit_refused_when_the_other_slots_are_held_by_the_caller() -> None:
    c = hybrid(mamba_slots=2)
    with_state(c, [1, 2])
    held = c.alloc_mamba()
    assert held is not None
    before = fingerprint(c)
    assert c.admit([1, 2]) is None
    assert fingerprint(c) == before
    c.free_mamba(held)
    r = admitted(c, [1, 2])
    assert r.copy_pending is not None
    c.fail(r.copy_pending)
    c.abort(r)
    c.audit()


def test_admit_evicts_an_unlocked_state_for_its_copy() -> None:
    c = hybrid(mamba_slots=2)
    with_state(c, [5, 6])
    with_state(c, [1, 2])
    assert c.available_mamba() == 0
    r = admitted(c, [1, 2, 3])
    assert r.prefix_len == 2
    s = c.stats()
    assert s["evicted_mamba_states"] == 1
    # [5, 6] was an unlocked leaf: it went with its KV.
    assert c.match_prefix([5, 6]).kv_len == 0
    assert c.total_size() == 2
    one_batch(c).complete()
    c.abort(r)
    c.audit()


def test_admit_on_an_attention_only_cache_reuses_without_states() -> None:
    c = rc.HybridCache(kv_slots=64)
    cached(c, [1, 2, 3, 4])
    r = admitted(c, [1, 2, 3, 4, 5])
    assert (r.prefix_len, r.branch_len, r.mamba_slot) == (4, 4, None)
    assert c.take_batches() == []
    got = c.extend(r, [5])
    assert got is not None
    assert r.mamba_slot is None, "no state pool: extend takes no state"
    c.checkpoint(r)
    assert c.take_batches() == []
    c.finish(r)
    assert c.match_prefix([1, 2, 3, 4, 5]).device_len == 5
    assert c.available_mamba() == 0
    c.audit()


# ----------------------------------------------------------------------------- extend


def test_extend_fills_the_last_partial_page_first() -> None:
    c = hybrid(kv_slots=32, page_size=4, mamba_slots=2)
    r = admitted(c, [])
    a = c.extend(r, [1, 2, 3])
    assert a is not None
    assert a.dtype == np.int64
    assert len(a) == 3
    assert a[0] % 4 == 0
    assert list(a) == [a[0], a[0] + 1, a[0] + 2]
    assert c.available_kv() == 28
    b = c.extend(r, [4, 5])
    assert b is not None
    assert b[0] == a[2] + 1, "the partial page is filled first"
    assert b[1] % 4 == 0
    assert c.available_kv() == 24
    # Filling the rest of a partial page needs no new page.
    d = c.extend(r, [6, 7, 8])
    assert d is not None
    assert list(d) == [b[1] + 1, b[1] + 2, b[1] + 3]
    assert c.available_kv() == 24
    empty = c.extend(r, [])
    assert empty is not None
    assert empty.shape == (0,)
    np.testing.assert_array_equal(r.tokens, [1, 2, 3, 4, 5, 6, 7, 8])
    np.testing.assert_array_equal(r.kv_indices, np.concatenate([a, b, d]))
    s = c.stats()
    assert (s["extends"], s["kv_request_slots"]) == (4, 8)
    assert repr(r).startswith("<Request 8 tokens, prefix_len=0")
    c.abort(r)
    assert full(c)
    c.audit()


def test_extend_after_a_reused_prefix_continues_from_it() -> None:
    c = hybrid(kv_slots=32, page_size=4, mamba_slots=2)
    ins, _ = with_state(c, [1, 2, 3, 4])
    r = admitted(c, [1, 2, 3, 4, 5])
    one_batch(c).complete()
    got = c.extend(r, [5, 6])
    assert got is not None
    assert got[0] % 4 == 0
    np.testing.assert_array_equal(r.tokens, [1, 2, 3, 4, 5, 6])
    prefix = c.match_prefix([1, 2, 3, 4]).kv_indices
    np.testing.assert_array_equal(r.kv_indices, np.concatenate([prefix, got]))
    assert r.node == ins.node
    c.abort(r)
    c.audit()


def test_first_extend_allocates_the_state_slot() -> None:
    c = hybrid(mamba_slots=3)
    r = admitted(c, [1, 2, 3])
    assert r.mamba_slot is None
    assert c.extend(r, [1]) is not None
    slot = r.mamba_slot
    assert slot is not None
    assert c.available_mamba() == 2
    assert gauge(c, "mamba_request_slots") == 1
    assert c.extend(r, [2, 3]) is not None
    assert r.mamba_slot == slot, "one state slot per request"
    assert c.available_mamba() == 2
    # An empty extension still gives the request its state slot.
    r2 = admitted(c, [9])
    assert c.extend(r2, []) is not None
    assert r2.mamba_slot is not None
    assert r2.mamba_slot != slot
    c.abort(r)
    c.abort(r2)
    assert full(c)
    c.audit()


def test_extend_refused_when_kv_is_full_takes_nothing() -> None:
    c = hybrid(kv_slots=16, page_size=4, mamba_slots=4)
    r = admitted(c, [])
    assert c.extend(r, [1, 2, 3, 4, 5]) is not None  # two pages, one partial
    lk = c.lock(cached(c, [7, 7, 7, 7]).node)  # a cached page, locked: not evictable
    r2 = admitted(c, [])
    before = fingerprint(c)
    stats = c.stats()
    tokens, kv = r.tokens.copy(), r.kv_indices.copy()
    assert c.extend(r2, list(range(9))) is None  # needs 3 pages, 1 free
    assert c.extend(r, [6, 7, 8, 9, 10, 11, 12, 13]) is None  # needs 2 more, 1 free
    assert fingerprint(c) == before
    assert r2.mamba_slot is None, "a refused extension takes no state slot either"
    assert r2.tokens.shape == (0,)
    np.testing.assert_array_equal(r.tokens, tokens)
    np.testing.assert_array_equal(r.kv_indices, kv)
    after = c.stats()
    assert after["extends_refused"] == stats["extends_refused"] + 2
    assert after["extends"] == stats["extends"]
    # Filling the partial page needs no new page: granted even with the pool short.
    assert c.extend(r, [6, 7, 8]) is not None
    c.unlock(lk)
    c.abort(r)
    c.abort(r2)
    c.audit()


def test_extend_batch_gives_each_request_what_extend_would() -> None:
    batched, single = hybrid(page_size=4), hybrid(page_size=4)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8]]
    reqs_b = [served(batched, p) for p in prompts]
    reqs_s = [served(single, p) for p in prompts]
    for step in range(6):
        toks = [10 * step + i for i in range(len(prompts))]
        got = batched.extend_batch(reqs_b, toks if step % 2 else np.array(toks, np.uint32))
        assert got is not None
        assert got.dtype == np.int64
        want = [single.extend(r, [t]) for r, t in zip(reqs_s, toks)]
        np.testing.assert_array_equal(got, np.concatenate(want))  # type: ignore[arg-type]
    for rb, rs in zip(reqs_b, reqs_s):
        np.testing.assert_array_equal(rb.tokens, rs.tokens)
        np.testing.assert_array_equal(rb.kv_indices, rs.kv_indices)
        assert rb.mamba_slot == rs.mamba_slot
    assert batched.stats()["extends"] == single.stats()["extends"]
    assert batched.extend_batch([], []) is not None  # an empty step: nothing to give
    for c, reqs in ((batched, reqs_b), (single, reqs_s)):
        for r in reqs:
            c.finish(r)
        c.audit()
    assert fingerprint(batched) == fingerprint(single)


def test_extend_batch_gives_a_state_to_a_request_without_one() -> None:
    c = hybrid(page_size=1, mamba_slots=4)
    r = admitted(c, [1, 2])
    assert r.mamba_slot is None
    got = c.extend_batch([r], [1])
    assert got is not None
    assert r.mamba_slot is not None
    c.finish(r)
    c.audit()


def test_extend_batch_refused_takes_nothing_from_any_request() -> None:
    c = hybrid(kv_slots=8, page_size=4, mamba_slots=4)
    a, b = admitted(c, []), admitted(c, [])
    assert c.extend(a, [1, 2, 3, 4]) is not None  # a full page: the next token needs one
    assert c.extend(b, [5, 6, 7]) is not None  # room for one more in its page
    before = fingerprint(c)
    stats = c.stats()
    tokens = b.tokens.copy()
    assert c.extend_batch([b, a], [8, 5]) is None
    assert fingerprint(c) == before
    np.testing.assert_array_equal(b.tokens, tokens)
    after = c.stats()
    assert after["extends_refused"] == stats["extends_refused"] + 1
    assert after["extends"] == stats["extends"]
    assert c.extend_batch([b], [8]) is not None
    c.abort(a)
    c.abort(b)
    assert full(c)
    c.audit()


def test_extend_batch_errors_name_the_argument_and_change_nothing() -> None:
    c, other = hybrid(), hybrid()
    a, b = served(c, [1, 2]), served(c, [3, 4])
    foreign = admitted(other, [1])
    before = fingerprint(c)
    stats = c.stats()
    with pytest.raises(ValueError, match=r"^tokens: 1 tokens for 2 requests"):
        c.extend_batch([a, b], [1])
    with pytest.raises(ValueError, match=r"^requests: request .* appears twice"):
        c.extend_batch([a, b, a], [1, 2, 3])
    with pytest.raises(ValueError, match=r"^tokens: token id"):
        c.extend_batch([a, b], [1, -1])
    with pytest.raises(TypeError, match=r"^requests: expected Request items, got str"):
        c.extend_batch([a, "b"], [1, 2])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"^requests: expected a sequence"):
        c.extend_batch(None, [1])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^tokens:"):
        c.extend_batch([a], [1.5])
    with pytest.raises(rc.CacheError, match="belongs to another cache"):
        c.extend_batch([a, foreign], [1, 2])
    assert fingerprint(c) == before
    assert c.stats() == stats
    ended = served(c, [5])
    c.finish(ended)
    before = fingerprint(c)
    stats = c.stats()
    with pytest.raises(rc.CacheError):
        c.extend_batch([a, ended], [1, 2])
    assert fingerprint(c) == before
    assert c.stats() == stats
    assert a.live
    assert b.live
    for r in (a, b):
        c.abort(r)
    other.abort(foreign)
    c.audit()


def test_extend_evicts_unlocked_cache_when_short() -> None:
    c = hybrid(kv_slots=16, page_size=4, mamba_slots=4)
    cached(c, list(range(12)))
    r = admitted(c, [100])
    got = c.extend(r, [100, 101, 102, 103, 104, 105])
    assert got is not None
    assert gauge(c, "evicted_kv_tokens") >= 4
    c.abort(r)
    c.audit()


def test_extend_refused_when_the_state_pool_is_full_takes_nothing() -> None:
    c = hybrid(kv_slots=16, page_size=4, mamba_slots=1)
    held = c.alloc_mamba()
    assert held is not None
    r = admitted(c, [1])
    before = fingerprint(c)
    assert c.extend(r, [1, 2, 3, 4, 5]) is None
    assert fingerprint(c) == before, "the KV pages taken for it went back"
    assert (r.mamba_slot, len(r.tokens)) == (None, 0)
    assert gauge(c, "extends_refused") == 1
    c.free_mamba(held)
    assert c.extend(r, [1, 2, 3, 4, 5]) is not None
    assert r.mamba_slot == held
    c.abort(r)
    assert full(c)
    c.audit()


def test_extend_refused_on_state_after_kv_eviction_evicts_nothing() -> None:
    """The KV the extension needs is only to be had by evicting; the state slot cannot be
    had at all. The extension is refused and, like alloc_kv, evicts nothing: the KV a
    finished request cached (stateless, as it ended off a page boundary; still the branch
    point later requests checkpoint at) stays."""
    c = hybrid(kv_slots=12, page_size=4, mamba_slots=1)
    c.finish(served(c, list(range(1, 10))))  # caches 8 tokens without a state; 1 page free
    held = c.alloc_mamba()  # the only state slot
    assert held is not None
    r = admitted(c, [9])
    before = fingerprint(c)
    got = c.extend(r, [9] * 8)  # 2 pages: 1 free + 1 by eviction; no state slot at all
    after = fingerprint(c)
    kv_len = c.match_prefix(list(range(1, 10))).kv_len
    c.free_mamba(held)  # clean up first, so that a failure here leaves nothing live
    c.abort(r)
    c.audit()
    assert got is None
    assert kv_len == 8, "the cached prefix was evicted for an extension that was refused"
    assert after == before


# ------------------------------------------------------------------------- checkpoint


def test_checkpoint_caches_kv_moves_the_lock_and_publishes_the_state_on_complete() -> None:
    c = hybrid(kv_slots=64, page_size=4, mamba_slots=4)
    toks = list(range(1, 13))
    r = admitted(c, toks)
    assert c.extend(r, toks[:8]) is not None
    kv = r.kv_indices.copy()
    slot = r.mamba_slot
    c.checkpoint(r)
    assert (c.total_size(), c.protected_size(), c.evictable_size()) == (8, 8, 0)
    assert r.prefix_len == 8
    np.testing.assert_array_equal(r.tokens, toks[:8])
    np.testing.assert_array_equal(r.kv_indices, kv)
    assert r.mamba_slot == slot, "the request keeps its own state"
    s = c.stats()
    assert (s["kv_request_slots"], s["live_locks"], s["checkpoints"]) == (0, 1, 1)
    b = one_batch(c)
    assert b.kind == "cow"
    assert r.copy_pending is None, "copy_pending is about the admission copy only"
    (cp,) = b.copies
    assert (cp.pool, cp.src_tier, cp.dst_tier) == ("mamba", "device", "device")
    assert list(cp.src) == [slot]
    dst = int(cp.dst[0])
    assert dst != slot
    assert c.available_mamba() == 2
    # Two-phase publish: the KV is cached, the state is not visible until complete.
    m = c.match_prefix(toks[:8])
    assert (m.device_len, m.kv_len, m.mamba_slot) == (0, 8, None)
    c.audit()
    c.complete(b.id)
    m = c.match_prefix(toks[:8])
    assert (m.device_len, m.mamba_slot) == (8, dst)
    np.testing.assert_array_equal(m.kv_indices, kv)
    assert m.node == r.node
    assert tree_states(c) == [dst]
    # A second chunk: the lock moves to the new end, the first node stays protected as
    # its ancestor; one receipt all along.
    first_node = r.node
    assert c.extend(r, toks[8:]) is not None
    c.checkpoint(r)
    assert r.node != first_node
    assert (c.total_size(), c.protected_size()) == (12, 12)
    assert gauge(c, "live_locks") == 1
    assert "depth=12" in repr(r.node)
    one_batch(c).complete()
    c.finish(r)
    assert (c.protected_size(), c.evictable_size()) == (0, 12)
    assert gauge(c, "live_locks") == 0
    c.audit()


def test_checkpoint_moves_the_lock_off_the_admission_node_and_its_state() -> None:
    c = hybrid(kv_slots=64, page_size=1, mamba_slots=4)
    ins, node_slot = with_state(c, [1, 2, 3, 4])
    r = admitted(c, [1, 2, 3, 4, 5, 6])
    one_batch(c).complete()
    assert r.node == ins.node
    assert gauge(c, "mamba_protected_states") == 1
    assert c.extend(r, [5, 6]) is not None
    c.checkpoint(r)
    one_batch(c).complete()
    assert r.node != ins.node
    # The admission node's state is no longer locked: evicting a state takes it (the
    # least recently used one, once a match has used the checkpoint's state as well),
    # tombstoning the node, which stays as a locked ancestor.
    s = c.stats()
    assert (s["mamba_protected_states"], s["mamba_evictable_states"]) == (0, 2)
    assert c.match_prefix([1, 2, 3, 4, 5, 6]).device_len == 6
    ev = c.evict(mamba_states=1)
    assert (ev.kv_tokens, ev.mamba_states) == (0, 1)
    assert node_slot not in tree_states(c)
    assert c.match_prefix([1, 2, 3, 4]).device_len == 0
    assert c.match_prefix([1, 2, 3, 4, 5, 6]).device_len == 6
    c.finish(r)
    c.audit()


def test_with_a_queue_told_of_the_matched_state_is_locked_only_while_its_copy_runs() -> None:
    c = hybrid(kv_slots=64, page_size=1, mamba_slots=4)
    _, node_slot = with_state(c, [1, 2, 3, 4])
    r = admitted(c, [1, 2, 3, 4, 5, 6])
    b = one_batch(c)
    b.complete()
    assert gauge(c, "mamba_protected_states") == 1  # no queue: its next users may come
    c.expect([[9, 9]])
    # A queue told of: its marks keep what waiting requests need, so the request (which
    # has its own copy) lets the node's state go; its path stays locked.
    s = c.stats()
    assert (s["mamba_protected_states"], s["mamba_evictable_states"]) == (0, 1)
    assert c.protected_size() == 4
    ev = c.evict(mamba_states=1)
    assert (ev.kv_tokens, ev.mamba_states) == (0, 1)
    assert node_slot not in tree_states(c)
    m = c.match_prefix([1, 2, 3, 4])
    assert (m.device_len, m.kv_len) == (0, 4)  # a tombstone, its KV kept
    assert r.prefix_len == 4
    assert r.mamba_slot is not None
    # A request admitted while the queue is known lets go as soon as its copy lands.
    with_state(c, [7, 7, 7])
    r2 = admitted(c, [7, 7, 7, 8])
    copy = one_batch(c)
    assert gauge(c, "mamba_protected_states") == 1  # its copy reads it
    copy.complete()
    assert gauge(c, "mamba_protected_states") == 0
    assert c.extend(r, [5, 6]) is not None
    c.finish(r)
    c.abort(r2)
    assert c.match_prefix([1, 2, 3, 4, 5, 6, 7]).device_len == 6  # its own state, donated
    assert c.protected_size() == 0
    c.audit()


def test_a_turn_finished_at_an_unaligned_length_keeps_its_end_state_only_if_checkpointed() -> None:
    c = hybrid(kv_slots=128, page_size=4, mamba_slots=4)
    turn = list(range(1, 11))  # 10 tokens: the state of all 10 ends at no node's end
    c.finish(served(c, turn))
    assert gauge(c, "finish_states_lost") == 1
    assert c.match_prefix([*turn, 11, 12]).device_len == 0, "the next turn starts over"
    # Checkpointed at 8, its last aligned length, the state there stays (docs/contract.md
    # rule 2), and the next turn resumes from it.
    turn = list(range(21, 31))
    r = served(c, turn[:8])
    c.checkpoint(r)
    one_batch(c).complete()
    assert c.extend(r, turn[8:]) is not None
    c.finish(r)
    assert gauge(c, "finish_states_lost") == 1
    assert c.match_prefix([*turn, 31, 32]).device_len == 8
    c.audit()


def test_checkpoint_leaves_the_unaligned_tail_and_skips_the_state_copy() -> None:
    c = hybrid(kv_slots=64, page_size=4, mamba_slots=4)
    toks = list(range(1, 11))
    r = admitted(c, toks)
    assert c.extend(r, toks) is not None
    kv = r.kv_indices.copy()
    c.checkpoint(r)
    assert c.take_batches() == [], "10 tokens is no node's end: no state copy"
    assert (c.total_size(), r.prefix_len, len(r.tokens)) == (8, 8, 10)
    np.testing.assert_array_equal(r.kv_indices, kv)
    s = c.stats()
    assert (s["kv_request_slots"], s["checkpoint_states_skipped"], s["cow_copies"]) == (4, 1, 0)
    assert c.match_prefix(toks).device_len == 0, "no state anywhere on the path"
    # The tail stays usable: extending fills its partial page.
    got = c.extend(r, [11, 12])
    assert got is not None
    assert list(got) == [kv[9] + 1, kv[9] + 2]
    c.checkpoint(r)
    b = one_batch(c)
    assert (c.total_size(), r.prefix_len, gauge(c, "kv_request_slots")) == (12, 12, 0)
    slot = r.mamba_slot
    c.complete(b.id)
    assert tree_states(c) == [int(b.copies[0].dst[0])]
    c.finish(r)  # the node has the copy now: the request's own state is freed
    assert c.available_mamba() == 3
    assert slot not in tree_states(c)
    c.audit()


def test_failed_checkpoint_copy_publishes_nothing_and_frees_its_slot() -> None:
    c = hybrid(kv_slots=64, page_size=4, mamba_slots=4)
    toks = list(range(1, 9))
    r = admitted(c, toks)
    assert c.extend(r, toks) is not None
    c.checkpoint(r)
    b = one_batch(c)
    assert c.available_mamba() == 2
    c.start(b.id)
    c.fail(b.id)
    assert c.available_mamba() == 3
    assert c.match_prefix(toks).device_len == 0
    assert tree_states(c) == []
    s = c.stats()
    assert (s["batches_failed"], s["batches_in_flight"], s["states_cached"]) == (1, 0, 0)
    # The request still has its state and donates it at finish.
    slot = r.mamba_slot
    c.finish(r)
    m = c.match_prefix(toks)
    assert (m.device_len, m.mamba_slot) == (8, slot)
    c.audit()


def test_checkpoint_copy_completed_after_finish_donated_is_freed() -> None:
    c = hybrid(kv_slots=64, page_size=1, mamba_slots=4)
    r = admitted(c, [1, 2, 3])
    assert c.extend(r, [1, 2, 3]) is not None
    slot = r.mamba_slot
    c.checkpoint(r)
    b = one_batch(c)
    c.finish(r)  # a pending checkpoint copy does not hold up finish
    assert tree_states(c) == [slot]
    free = c.available_mamba()
    assert free == 2
    c.complete(b.id)
    assert c.available_mamba() == 3, "the node has the donated state: the copy is freed"
    assert tree_states(c) == [slot]
    c.audit()


def test_checkpoint_with_nothing_new_on_a_state_node_emits_nothing() -> None:
    c = hybrid()
    with_state(c, [1, 2])
    r = admitted(c, [1, 2])
    one_batch(c).complete()
    before = c.total_size()
    c.checkpoint(r)
    assert c.take_batches() == []
    assert (r.prefix_len, c.total_size(), gauge(c, "live_locks")) == (2, before, 1)
    # And with nothing at all (prefix 0): nothing cached, nothing copied.
    r2 = admitted(c, [5])
    c.checkpoint(r2)
    assert c.take_batches() == []
    assert r2.prefix_len == 0
    c.abort(r)
    c.abort(r2)
    c.audit()


def test_checkpoint_over_tokens_cached_meanwhile_switches_to_the_caches_slots() -> None:
    c = hybrid(kv_slots=64, page_size=2, mamba_slots=4)
    toks = [1, 2, 3, 4, 5]
    r1 = served(c, toks[:4])
    r2 = served(c, np.array(toks, dtype=np.int32))  # type: ignore[arg-type]
    own = r2.kv_indices.copy()
    c.finish(r1)  # caches [1, 2, 3, 4] with r1's state
    tree = c.match_prefix(toks[:4]).kv_indices
    assert not set(tree) & set(own)
    free = c.available_kv()
    c.checkpoint(r2)
    assert c.take_batches() == [], "the node has a state already: no copy"
    assert c.available_kv() == free + 4, "r2's duplicate pages went back"
    np.testing.assert_array_equal(r2.kv_indices, np.concatenate([tree, own[4:]]))
    assert (r2.prefix_len, len(r2.tokens)) == (4, 5)
    assert r2.node == c.match_prefix(toks[:4]).node
    c.finish(r2)
    c.audit()


def test_a_checkpoint_copy_outlives_its_request() -> None:
    c = hybrid(mamba_slots=2)
    r = served(c, [1, 2, 3])
    src = r.mamba_slot
    c.checkpoint(r)
    b = one_batch(c)
    assert c.available_mamba() == 0
    c.abort(r)  # the copy may still read the request's state: it drains
    s = c.stats()
    # In flight: the request's state (given back, draining) and the copy's destination.
    assert (s["mamba_draining_slots"], s["mamba_request_slots"]) == (2, 0)
    assert c.alloc_mamba() is None
    c.audit()
    c.complete(b.id)  # the cached node is still there: the copy is published
    assert c.match_prefix([1, 2, 3]).mamba_slot == int(b.copies[0].dst[0])
    assert src != int(b.copies[0].dst[0])
    assert c.available_mamba() == 1
    assert gauge(c, "mamba_draining_slots") == 0
    c.audit()


# ----------------------------------------------------------------------------- finish


def test_finish_caches_everything_and_donates_the_state() -> None:
    c = hybrid(kv_slots=64, page_size=1, mamba_slots=4)
    toks = list(range(1, 9))
    r = served(c, toks)
    slot = r.mamba_slot
    kv = r.kv_indices.copy()
    c.finish(r)
    assert not r.live
    assert c.available_mamba() == 3, "the slot moved to the tree, not to the free list"
    m = c.match_prefix(toks)
    assert (m.device_len, m.mamba_slot) == (8, slot)
    np.testing.assert_array_equal(m.kv_indices, kv)
    s = c.stats()
    assert (s["finishes"], s["live_requests"], s["live_locks"]) == (1, 0, 0)
    assert (s["kv_request_slots"], s["mamba_request_slots"], s["mamba_cached_states"]) == (0, 0, 1)
    assert (c.evictable_size(), c.protected_size()) == (8, 0)
    c.audit()


def test_finish_after_a_reused_prefix_extends_the_path() -> None:
    c = hybrid()
    _, node_slot = with_state(c, [1, 2, 3])
    r = served(c, [1, 2, 3, 4, 5])
    slot = r.mamba_slot
    c.finish(r)
    assert tree_states(c) == sorted([node_slot, slot])
    assert c.match_prefix([1, 2, 3, 4, 5]).mamba_slot == slot
    assert c.match_prefix([1, 2, 3, 4]).mamba_slot == node_slot
    assert c.total_size() == 5
    c.audit()


def test_finish_frees_the_state_when_the_node_has_one() -> None:
    c = hybrid(kv_slots=64, page_size=1, mamba_slots=4)
    toks = [1, 2, 3, 4]
    r1 = served(c, toks)
    r2 = served(c, toks)  # computed the same tokens itself (admitted before r1 finished)
    s1 = r1.mamba_slot
    c.finish(r1)
    assert c.available_mamba() == 2  # r1's state went to the tree, r2 holds its own
    assert c.available_kv() == 64 - 8
    c.finish(r2)
    assert c.available_mamba() == 3, "r2's state was freed"
    assert c.available_kv() == 64 - 4, "r2's duplicate KV was freed"
    assert tree_states(c) == [s1]
    assert gauge(c, "duplicate_tokens") == 4
    c.audit()


def test_finish_frees_the_state_and_the_tail_when_unaligned() -> None:
    c = hybrid(kv_slots=64, page_size=4, mamba_slots=4)
    toks = list(range(1, 11))
    r = served(c, toks)
    c.finish(r)
    assert c.total_size() == 8
    assert c.available_kv() == 56
    assert c.available_mamba() == 4
    assert tree_states(c) == []
    m = c.match_prefix(toks)
    assert (m.device_len, m.kv_len) == (0, 8)
    c.audit()


# ------------------------------------------------------------------------------ abort


def test_abort_gives_everything_back_and_caches_nothing() -> None:
    c = hybrid()
    with_state(c, [1, 2, 3])
    before = fingerprint(c)
    r = served(c, [1, 2, 3, 4, 5, 6])
    c.checkpoint(r)
    one_batch(c).complete()
    assert c.extend(r, [7, 8]) is not None
    c.abort(r)
    assert not r.live
    s = c.stats()
    assert (s["aborts"], s["live_requests"], s["live_locks"]) == (1, 0, 0)
    assert (s["kv_request_slots"], s["mamba_request_slots"]) == (0, 0)
    # What the checkpoint cached stays cached; nothing else does.
    assert c.total_size() == 6
    assert c.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).device_len == 6
    # Evicting the checkpointed leaf (state and all) leaves the cache as it was.
    assert c.evict(kv_tokens=1).kv_tokens == 3
    assert fingerprint(c) == before


def test_abort_right_after_admit_restores_the_cache() -> None:
    c = hybrid()
    with_state(c, [1, 2, 3])
    c.match_prefix([1, 2, 3])
    before = fingerprint(c)
    r = admitted(c, [1, 2, 3, 4])
    b = one_batch(c)
    c.complete(b.id)
    assert c.extend(r, [4]) is not None
    c.abort(r)
    assert fingerprint(c) == before
    c.audit()


def test_abort_while_the_admission_copy_is_pending_drains_the_slot() -> None:
    c = hybrid(mamba_slots=2)
    _, src = with_state(c, [1, 2])
    r = admitted(c, [1, 2])
    b = one_batch(c)
    dst = r.mamba_slot
    c.abort(r)  # allowed (docs/contract.md rule 7): the copy may still write dst
    s = c.stats()
    assert (s["mamba_draining_slots"], s["mamba_free_slots"]) == (1, 0)
    # The source state is unlocked now: evicting it must not free it while the copy
    # may still read it.
    ev = c.evict(kv_tokens=10**6, mamba_states=10**6)
    assert (ev.kv_tokens, ev.mamba_states) == (2, 1)
    s = c.stats()
    assert (s["mamba_draining_slots"], s["mamba_free_slots"]) == (2, 0)
    assert c.alloc_mamba() is None, "a slot a copy may touch is never handed out"
    c.audit()
    c.complete(b.id)
    assert sorted([src, dst]) == [0, 1]
    assert gauge(c, "mamba_draining_slots") == 0
    assert full(c)
    c.audit()


# ------------------------------------------------------------------ garbage collection


def test_live_request_collected_warns_and_gives_everything_back() -> None:
    c = hybrid()
    with_state(c, [1, 2])
    c.match_prefix([1, 2])
    before = fingerprint(c)
    holder = [admitted(c, [1, 2, 3])]
    one_batch(c).complete()
    assert c.extend(holder[0], [3, 4]) is not None
    with pytest.warns(ResourceWarning, match="garbage-collected while live"):
        holder.clear()  # the last reference goes: the request is collected
    assert fingerprint(c) == before
    s = c.stats()
    assert (s["requests_dropped"], s["aborts"], s["live_requests"]) == (1, 1, 0)
    c.audit()


def test_live_request_with_a_pending_copy_collected_drains_until_the_copy_ends() -> None:
    c = hybrid(mamba_slots=2)
    with_state(c, [1, 2])
    holder = [admitted(c, [1, 2])]
    b = one_batch(c)
    with pytest.warns(ResourceWarning, match="garbage-collected while live"):
        holder.clear()
    assert gauge(c, "mamba_draining_slots") == 1
    c.audit()
    c.complete(b.id)
    assert c.available_mamba() == 1
    c.audit()


def test_finished_or_aborted_request_collects_silently() -> None:
    c = hybrid()
    r = served(c, [1, 2])
    c.finish(r)
    r2 = admitted(c, [3])
    c.abort(r2)
    del r, r2
    gc.collect()  # filterwarnings=error: a warning here would fail the test
    assert gauge(c, "requests_dropped") == 0


# ------------------------------------------------------------------------ misuse errors


PROPERTIES = [
    "tokens",
    "prefix_len",
    "host_len",
    "branch_len",
    "kv_indices",
    "mamba_slot",
    "node",
    "copy_pending",
]


@pytest.mark.parametrize("ending", ["finish", "abort"])
def test_finished_request_refuses_every_method_and_property(ending: str) -> None:
    c = hybrid()
    with_state(c, [1, 2])
    r = served(c, [1, 2, 3])
    getattr(c, ending)(r)
    assert not r.live
    assert repr(r) == "<Request (finished)>"
    before = fingerprint(c)
    stats = c.stats()
    for call in (
        lambda: c.extend(r, [4]),
        lambda: c.checkpoint(r),
        lambda: c.finish(r),
        lambda: c.abort(r),
    ):
        with pytest.raises(rc.CacheError, match="is not live in this cache"):
            call()
    for prop in PROPERTIES:
        with pytest.raises(rc.CacheError, match="is not live in this cache"):
            getattr(r, prop)
    assert not r.live
    assert fingerprint(c) == before
    assert c.stats() == stats
    # A new request may reuse the slab slot: the old handle still never reaches it.
    fresh = admitted(c, [9])
    with pytest.raises(rc.CacheError):
        c.extend(r, [1])
    assert fresh.live
    c.abort(fresh)
    c.audit()


def test_request_of_another_cache_is_refused_and_both_caches_unchanged() -> None:
    a, b = hybrid(), hybrid()
    r = served(a, [1, 2, 3])
    rb = admitted(b, [1])
    before_a, before_b = fingerprint(a), fingerprint(b)
    for call in (
        lambda: b.extend(r, [4]),
        lambda: b.checkpoint(r),
        lambda: b.finish(r),
        lambda: b.abort(r),
    ):
        with pytest.raises(rc.CacheError, match="belongs to another cache"):
            call()
    assert (fingerprint(a), fingerprint(b)) == (before_a, before_b)
    assert r.live
    assert rb.live
    a.finish(r)
    b.abort(rb)
    a.audit()
    b.audit()


def test_wrong_types_raise_type_error_and_change_nothing() -> None:
    c = hybrid()
    with_state(c, [1, 2])
    r = served(c, [1, 2, 3])
    lone = c.take_batches()
    assert lone == []
    before = fingerprint(c)
    stats = c.stats()
    cases: list[tuple[object, str | None]] = [
        (lambda: c.extend("request", [1]), "Request"),  # type: ignore[arg-type]
        (lambda: c.extend(None, [1]), "Request"),  # type: ignore[arg-type]
        (lambda: c.checkpoint(1), "Request"),  # type: ignore[arg-type]
        (lambda: c.finish(object()), "Request"),  # type: ignore[arg-type]
        (lambda: c.abort([r]), "Request"),  # type: ignore[arg-type]
        (lambda: c.extend(r, "abc"), "^tokens:"),  # type: ignore[arg-type]
        (lambda: c.extend(r, [1.5]), "^tokens:"),
        (lambda: c.extend(r, None), "^tokens:"),  # type: ignore[arg-type]
        (lambda: c.admit("abc"), "^tokens:"),  # type: ignore[arg-type]
        (lambda: c.admit([1, 2.5]), "^tokens:"),
        (lambda: c.admit(np.array([1.0])), "^tokens:"),
        (lambda: c.admit([1], namespace=3), None),  # type: ignore[arg-type]
        (lambda: c.start("0"), None),  # type: ignore[arg-type]
        (lambda: c.complete(None), None),  # type: ignore[arg-type]
        (lambda: c.fail(1.0), None),  # type: ignore[arg-type]
        (lambda: c.free_mamba("0"), None),  # type: ignore[arg-type]
        (lambda: c.insert([5], [0], mamba_slot="0"), None),  # type: ignore[arg-type]
    ]
    for call, msg in cases:
        with pytest.raises(TypeError, match=msg):
            call()  # type: ignore[operator]
    for call in (lambda: c.extend(r, [-1]), lambda: c.admit([2**32])):
        with pytest.raises(ValueError, match=r"^tokens: token id"):
            call()
    assert fingerprint(c) == before
    assert c.stats() == stats
    assert r.live
    c.abort(r)


def test_checkpoint_and_finish_refused_while_the_admission_copy_is_pending() -> None:
    c = hybrid()
    with_state(c, [1, 2, 3])
    r = admitted(c, [1, 2, 3, 4])
    b = one_batch(c)
    assert c.extend(r, [4]) is not None  # extending is allowed meanwhile
    before = fingerprint(c)
    stats = c.stats()
    view = (r.tokens.copy(), r.kv_indices.copy(), r.mamba_slot, r.prefix_len)
    for op in (c.checkpoint, c.finish):
        with pytest.raises(rc.CacheError, match=rf"batch {b.id}\) is not acknowledged"):
            op(r)
    assert fingerprint(c) == before
    assert c.stats() == stats
    np.testing.assert_array_equal(r.tokens, view[0])
    np.testing.assert_array_equal(r.kv_indices, view[1])
    assert (r.mamba_slot, r.prefix_len, r.copy_pending) == (view[2], view[3], b.id)
    c.complete(b.id)
    c.checkpoint(r)
    one_batch(c).complete()
    c.finish(r)
    assert c.match_prefix([1, 2, 3, 4]).device_len == 4
    c.audit()


@pytest.mark.parametrize("extended", [False, True])
def test_failed_admission_copy_drops_the_request_back_to_nothing(extended: bool) -> None:
    c = hybrid(kv_slots=64, page_size=1, mamba_slots=3)
    _, node_slot = with_state(c, [1, 2, 3])
    r = admitted(c, [1, 2, 3, 4, 5])
    b = one_batch(c)
    if extended:
        assert c.extend(r, [4, 5]) is not None
    c.start(b.id)
    c.fail(b.id)
    # Rule 10: the copied state is garbage; the request recomputes from scratch.
    assert (r.prefix_len, r.branch_len, r.host_len) == (0, 0, 0)
    assert r.tokens.shape == (0,)
    assert r.kv_indices.shape == (0,)
    assert (r.mamba_slot, r.copy_pending) == (None, None)
    assert "root" in repr(r.node)
    assert r.live
    s = c.stats()
    # It uses nothing but its namespace's root (a lock that protects no token); the
    # slots the failed copy took from it (its state slot, what it extended) stay its own
    # until it ends, since a forward pass may have been queued on them.
    retired = (2 if extended else 0, 1)
    assert (s["kv_retired_slots"], s["mamba_retired_slots"]) == retired
    assert (s["kv_request_slots"], s["mamba_request_slots"]) == retired
    assert (s["live_locks"], s["batches_failed"], s["mamba_draining_slots"]) == (1, 1, 0)
    assert (c.protected_size(), c.available_mamba()) == (0, 1)
    assert tree_states(c) == [node_slot], "the cached state itself is untouched"
    for op in (c.complete, c.fail, c.start):
        with pytest.raises(ValueError, match=rf"^batch_id: no batch {b.id} in flight"):
            op(b.id)
    got = c.extend(r, [1, 2, 3, 4, 5])
    assert got is not None
    assert r.mamba_slot is not None
    c.finish(r)
    assert c.match_prefix([1, 2, 3, 4, 5]).device_len == 5
    s = c.stats()
    assert (s["kv_retired_slots"], s["mamba_retired_slots"]) == (0, 0)
    assert s["kv_request_slots"] + s["mamba_request_slots"] == 0
    c.audit()


def test_slots_extended_before_a_failed_admission_copy_are_not_reused_until_the_request_ends() -> (
    None
):
    c = hybrid(kv_slots=16, page_size=1, mamba_slots=3)
    with_state(c, [1, 2, 3])
    r = admitted(c, [1, 2, 3, 4, 5])
    b = one_batch(c)
    state = r.mamba_slot
    # The scheduler queued a forward pass on these before the copy's outcome was known.
    extended = c.extend(r, [4, 5])
    assert extended is not None
    assert state is not None
    c.start(b.id)
    c.fail(b.id)
    s = c.stats()
    assert (s["kv_retired_slots"], s["mamba_retired_slots"]) == (2, 1)
    held_apart(c, extended.tolist(), state)
    c.audit()
    c.abort(r)
    s = c.stats()
    assert (s["kv_retired_slots"], s["mamba_retired_slots"]) == (0, 0)
    assert (s["kv_request_slots"], s["mamba_request_slots"]) == (0, 0)
    assert c.available_kv() == 16 - c.total_size()
    c.audit()


# ---------------------------------------------------------------------------- batches


@pytest.mark.parametrize("op", ["start", "complete", "fail"])
def test_unknown_or_acknowledged_batch_ids_raise_value_error(op: str) -> None:
    c = hybrid()
    with_state(c, [1, 2])
    r = admitted(c, [1, 2])
    b = one_batch(c)
    c.complete(b.id)
    r2 = admitted(c, [1, 2])
    pending = one_batch(c)
    before = fingerprint(c)
    stats = c.stats()
    for bad in (b.id, 12345, 2**63):
        with pytest.raises(ValueError, match=rf"^batch_id: no batch {bad} in flight"):
            getattr(c, op)(bad)
    assert fingerprint(c) == before
    assert c.stats() == stats
    c.start(pending.id)
    c.complete(pending.id)
    c.abort(r)
    c.abort(r2)
    c.audit()


def test_batches_may_be_acknowledged_in_any_order_and_before_being_taken() -> None:
    c = hybrid(mamba_slots=6)
    with_state(c, [1, 2])
    rs = [admitted(c, [1, 2, i]) for i in range(3)]
    ids = [r.copy_pending for r in rs]
    assert None not in ids
    assert len(set(ids)) == 3
    c.fail(ids[1])  # not taken yet
    c.complete(ids[2])
    taken = c.take_batches()
    assert [b.id for b in taken] == [ids[0]], "acknowledged batches are no longer handed out"
    c.complete(ids[0])
    assert [r.prefix_len for r in rs] == [2, 0, 2]
    for r in rs:
        c.abort(r)
    assert gauge(c, "batches_in_flight") == 0
    c.audit()


def test_pending_batches_lists_what_was_handed_out_and_not_ended() -> None:
    c = hybrid(mamba_slots=6)
    with_state(c, [1, 2])
    rs = [admitted(c, [1, 2, i]) for i in range(3)]
    assert c.pending_batches() == [], "nothing handed out before take_batches"
    a, b, d = c.take_batches()
    assert c.pending_batches() == [(a.id, "cow", False), (b.id, "cow", False), (d.id, "cow", False)]
    c.start(b.id)
    c.complete(a.id)
    assert c.pending_batches() == [(b.id, "cow", True), (d.id, "cow", False)]
    # What an engine that restarts does: end everything outstanding by id.
    for bid, _, _ in c.pending_batches():
        c.fail(bid)
    assert c.pending_batches() == []
    assert [r.prefix_len for r in rs] == [2, 0, 0]
    for r in rs:
        c.abort(r)
    assert gauge(c, "batches_in_flight") == 0
    c.audit()


# ---------------------------------------------------------------------- state slots


def test_alloc_and_free_mamba() -> None:
    c = hybrid(mamba_slots=3)
    got = [c.alloc_mamba() for _ in range(3)]
    assert sorted(got) == [0, 1, 2]  # type: ignore[type-var]
    assert c.available_mamba() == 0
    assert gauge(c, "mamba_caller_slots") == 3
    assert c.alloc_mamba() is None
    assert gauge(c, "mamba_alloc_failures") == 1
    for s in got:
        assert s is not None
        c.free_mamba(s)
    assert c.available_mamba() == 3
    c.audit()
    plain = rc.HybridCache(kv_slots=8)
    assert plain.alloc_mamba() is None
    assert plain.available_mamba() == 0
    with pytest.raises(ValueError, match=r"^slot: slot 0 is out of range \[0, 0\)"):
        plain.free_mamba(0)


def test_alloc_mamba_evicts_the_least_recently_used_state() -> None:
    c = hybrid(mamba_slots=2)
    _, old = with_state(c, [1, 2])
    _, new = with_state(c, [3, 4])
    c.match_prefix([3, 4])
    s = c.alloc_mamba()
    assert s == old
    assert c.match_prefix([1, 2]).kv_len == 0, "the unlocked leaf went with its state"
    assert c.match_prefix([3, 4]).mamba_slot == new
    assert gauge(c, "evicted_mamba_states") == 1
    c.free_mamba(s)
    c.audit()


def test_alloc_mamba_refused_when_the_only_unlocked_state_is_pinned_evicts_nothing() -> None:
    c = hybrid(mamba_slots=2)
    _, src = with_state(c, [1, 2])
    r = admitted(c, [1, 2])
    b = one_batch(c)  # reads src, writes the request's slot
    c.abort(r)  # the request's slot drains; src is unlocked now, but a copy reads it
    before = fingerprint(c)
    assert c.alloc_mamba() is None
    assert fingerprint(c) == before, "evicting a pinned state would only drain it"
    assert tree_states(c) == [src]
    c.complete(b.id)
    got = c.alloc_mamba()
    assert got is not None
    assert got != src, "the free slot is used before any cached state is evicted"
    assert tree_states(c) == [src]
    c.free_mamba(got)
    c.audit()


def test_free_mamba_errors_name_the_slot_and_change_nothing() -> None:
    c = hybrid(mamba_slots=4)
    _, tree_slot = with_state(c, [1, 2])
    held = c.alloc_mamba()
    assert held is not None
    r = served(c, [7])
    req_slot = r.mamba_slot
    assert req_slot is not None
    c.free_mamba(held)
    before = fingerprint(c)
    for bad, msg in [
        (held, "is not allocated"),  # double free
        (tree_slot, "is owned by the cache"),
        (req_slot, "is held by a request"),
        (4, r"is out of range \[0, 4\)"),
        (-1, r"is out of range \[0, 4\)"),
        (2**40, "is out of range"),
    ]:
        with pytest.raises(ValueError, match=rf"^slot: slot {bad} {msg}"):
            c.free_mamba(bad)
        assert fingerprint(c) == before
    c.abort(r)
    c.audit()


# -------------------------------------------------------------- insert with a state


def test_insert_places_the_state_on_the_end_node() -> None:
    c = hybrid(mamba_slots=3)
    ins, s = with_state(c, [1, 2, 3])
    m = c.match_prefix([1, 2, 3, 4])
    assert (m.device_len, m.mamba_slot, m.node) == (3, s, ins.node)
    assert "state=" in repr(ins.node)
    assert "mamba_existed=False" in repr(ins)
    st = c.stats()
    assert (st["mamba_cached_states"], st["mamba_evictable_states"], st["states_cached"]) == (
        1,
        1,
        1,
    )
    assert c.available_mamba() == 2
    c.audit()


def test_insert_onto_a_node_with_a_state_frees_the_slot() -> None:
    c = hybrid(mamba_slots=3)
    _, s = with_state(c, [1, 2, 3])
    s2 = c.alloc_mamba()
    assert s2 is not None
    kv = c.alloc_kv(3)
    assert kv is not None
    ins = c.insert([1, 2, 3], kv, mamba_slot=s2)
    assert ins.mamba_existed
    assert ins.prefix_len == 3
    assert c.available_mamba() == 2
    assert c.available_kv() == 64 - 3
    assert tree_states(c) == [s]
    c.audit()


def test_insert_ending_inside_a_node_places_the_state_on_the_split() -> None:
    c = hybrid(mamba_slots=3)
    cached(c, [1, 2, 3, 4])
    s = c.alloc_mamba()
    kv = c.alloc_kv(2)
    assert kv is not None
    ins = c.insert([1, 2], kv, mamba_slot=s)
    assert (ins.prefix_len, ins.mamba_existed) == (2, False)
    m = c.match_prefix([1, 2, 3, 4])
    assert (m.device_len, m.kv_len, m.mamba_slot) == (2, 4, s)
    c.audit()


@pytest.mark.parametrize("tokens", [[1, 2, 3, 4, 5, 6], [1, 2]])
def test_insert_with_an_unaligned_end_frees_the_state(tokens: list[int]) -> None:
    c = hybrid(kv_slots=32, page_size=4, mamba_slots=2)
    s = c.alloc_mamba()
    kv = c.alloc_kv(8)
    assert kv is not None
    ins = c.insert(tokens, kv[: len(tokens)], mamba_slot=s)
    assert not ins.mamba_existed
    assert c.available_mamba() == 2
    assert tree_states(c) == []
    assert c.match_prefix(tokens).device_len == 0
    c.audit()


def test_bad_mamba_slot_fails_the_insert_and_changes_nothing() -> None:
    c = hybrid(mamba_slots=4)
    _, tree_slot = with_state(c, [9, 9])
    r = served(c, [7])
    req_slot = r.mamba_slot
    free_slot = next(s for s in range(4) if s not in (tree_slot, req_slot))
    kv = c.alloc_kv(2)
    assert kv is not None
    before = fingerprint(c)
    for bad, msg in [
        (4, "out of range"),
        (-1, "out of range"),
        (free_slot, "not allocated"),
        (tree_slot, "owned by the cache"),
        (req_slot, "held by a request"),
    ]:
        with pytest.raises(ValueError, match=rf"^mamba_slot: .*{msg}"):
            c.insert([1, 2], kv, mamba_slot=bad)
        assert fingerprint(c) == before
    c.free_kv(kv)  # still the caller's
    c.abort(r)
    c.audit()


# --------------------------------------------------------------------- state eviction


def test_evicting_an_internal_nodes_state_leaves_a_tombstone() -> None:
    c = hybrid()
    upper, s_up = with_state(c, [1, 2])
    _, s_low = with_state(c, [1, 2, 3, 4])
    c.match_prefix([1, 2, 3, 4])  # the leaf's state is the more recently used
    ev = c.evict(mamba_states=1)
    assert (ev.kv_tokens, ev.mamba_states) == (0, 1)
    assert gauge(c, "tombstones") == 1
    assert c.total_size() == 4
    assert "(gone)" not in repr(upper.node), "the node stays"
    assert tree_states(c) == [s_low]
    m = c.match_prefix([1, 2, 9])
    assert (m.device_len, m.kv_len) == (0, 2)
    assert c.match_prefix([1, 2, 3, 4]).device_len == 4
    assert s_up in (c.alloc_mamba(), c.alloc_mamba())
    c.audit()


def test_evicting_an_unlocked_leafs_state_deletes_the_leaf() -> None:
    c = hybrid()
    upper = cached(c, [1, 2])  # no state: unmatchable once it has no stateful child
    with_state(c, [1, 2, 3, 4])
    ev = c.evict(mamba_states=1)
    assert (ev.kv_tokens, ev.mamba_states) == (4, 1)
    assert "(gone)" in repr(upper.node), "the stateless parent left as a leaf is pruned"
    assert c.total_size() == 0
    assert gauge(c, "tombstones") == 0
    assert full(c)
    c.audit()


def test_kv_eviction_of_a_leaf_takes_its_state() -> None:
    c = hybrid()
    with_state(c, [1, 2])
    ev = c.evict(kv_tokens=1)
    assert (ev.kv_tokens, ev.mamba_states) == (2, 1)
    assert full(c)
    c.audit()


def test_state_of_a_kv_locked_leaf_is_tombstoned_and_the_node_kept() -> None:
    """Rule 12: a lock taken while the leaf had no state locks its KV only."""
    c = hybrid()
    ins = cached(c, [1, 2])
    lk = c.lock(ins.node)
    s = c.alloc_mamba()
    kv = c.alloc_kv(2)
    assert kv is not None
    assert not c.insert([1, 2], kv, mamba_slot=s).mamba_existed
    st = c.stats()
    assert (st["mamba_evictable_states"], st["mamba_protected_states"]) == (1, 0)
    ev = c.evict(mamba_states=1)
    assert (ev.kv_tokens, ev.mamba_states) == (0, 1)
    assert gauge(c, "tombstones") == 1
    assert "(gone)" not in repr(ins.node)
    assert (c.protected_size(), c.total_size()) == (2, 2)
    c.unlock(lk)
    assert c.evict(kv_tokens=2).kv_tokens == 2
    assert full(c)
    c.audit()


def test_state_of_a_kv_locked_leaf_via_a_checkpoint_is_tombstoned() -> None:
    """Rule 12 through the request API: the checkpoint moved the lock onto the leaf
    before its state was published."""
    c = hybrid()
    r = served(c, [1, 2, 3])
    c.checkpoint(r)
    one_batch(c).complete()
    assert gauge(c, "mamba_evictable_states") == 1
    ev = c.evict(kv_tokens=100, mamba_states=1)
    assert (ev.kv_tokens, ev.mamba_states) == (0, 1)
    assert c.match_prefix([1, 2, 3]).kv_len == 3
    assert c.protected_size() == 3
    c.finish(r)  # the tombstone gets the request's state
    assert c.match_prefix([1, 2, 3]).device_len == 3
    c.audit()


def test_a_locked_state_is_not_evicted() -> None:
    c = hybrid()
    ins, s = with_state(c, [1, 2])
    with c.lock(ins.node):
        ev = c.evict(kv_tokens=10, mamba_states=10)
        assert (ev.kv_tokens, ev.mamba_states) == (0, 0)
        assert tree_states(c) == [s]
    c.audit()


# ------------------------------------------------------------------- match with states


@pytest.mark.parametrize("page_size", [1, 2])
def test_match_is_cut_at_the_deepest_state_and_kv_len_is_deeper(page_size: int) -> None:
    c = hybrid(kv_slots=64, page_size=page_size)
    ins, s = with_state(c, [1, 2, 3, 4])
    cached(c, [1, 2, 3, 4, 5, 6, 7, 8])  # the path goes on without a state
    full_m = c.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    m = c.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9, 9])
    assert (m.device_len, m.kv_len, m.mamba_slot, m.node) == (4, 8, s, ins.node)
    assert m.host_node == m.node
    np.testing.assert_array_equal(m.kv_indices, full_m.kv_indices[:4])
    assert full_m.device_len == 4
    r = admitted(c, [1, 2, 3, 4, 5, 6, 7, 8, 9, 9])
    assert (r.prefix_len, r.branch_len) == (4, 8)
    np.testing.assert_array_equal(r.tokens, [1, 2, 3, 4])
    b = one_batch(c)
    assert list(b.copies[0].src) == [s]
    c.complete(b.id)
    # The scheduler's move: extend to the branch point, checkpoint there, go on.
    assert c.extend(r, [5, 6, 7, 8]) is not None
    c.checkpoint(r)
    one_batch(c).complete()
    m = c.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 1])
    assert (m.device_len, m.kv_len) == (8, 8)
    c.abort(r)
    # The deepest of several states wins; a state below the match is not used.
    with_state(c, [1, 2, 3, 4, 5, 6, 7, 8, 9, 9])
    assert c.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 1, 1]).device_len == 10
    assert c.match_prefix([1, 2, 3, 4, 5, 6, 9, 9]).device_len == 4
    c.audit()


def test_match_without_any_state_on_the_path_uses_nothing() -> None:
    c = hybrid()
    cached(c, [1, 2, 3])
    m = c.match_prefix([1, 2, 3])
    assert (m.device_len, m.kv_len, m.mamba_slot) == (0, 3, None)
    assert m.kv_indices.shape == (0,)
    assert "root" in repr(m.node)
    assert gauge(c, "state_hits") == 0
