"""KV events from the core, seen from Python (docs/design.md, "KV events (core)"):
`take_events()` and the shape of `KvEvent` the events publisher reads, per tier and
kind, the counters, and the `events=` argument's errors. Hashes are computed here with `hashlib`."""

from __future__ import annotations

import hashlib
import struct

import pytest

import radixcache as rc

from conftest import EventIndex, cached


def chain(tokens: list[int], page_size: int) -> list[bytes]:
    out: list[bytes] = []
    prior = b""
    for start in range(0, len(tokens) - len(tokens) % page_size, page_size):
        page = struct.pack(f"<{page_size}I", *tokens[start : start + page_size])
        prior = hashlib.sha256(prior + page).digest()
        out.append(prior)
    return out


def run_all(c: rc.HybridCache) -> None:
    for b in c.take_batches():
        b.start()
        b.complete()


def evented(**kwargs: object) -> rc.HybridCache:
    return rc.HybridCache(kv_slots=64, page_size=2, page_hashes=True, events=True, **kwargs)  # type: ignore[arg-type]


def test_an_insert_is_one_stored_event_with_the_publishers_fields() -> None:
    c = evented()
    cached(c, [1, 2, 3, 4, 5])
    (e,) = c.take_events()
    assert e.kind == "stored"
    assert e.medium == "GPU"
    assert e.namespace is None
    assert e.hashes == chain([1, 2, 3, 4], 2)
    assert e.parent_hash is None
    assert e.token_ids == [1, 2, 3, 4]
    assert e.block_size == 2
    assert "stored" in repr(e)
    assert "GPU" in repr(e)
    with pytest.raises(AttributeError):
        e.kind = "removed"  # type: ignore[misc]
    assert c.take_events() == []


def test_a_branch_names_its_parent_and_its_namespace() -> None:
    c = evented()
    cached(c, [1, 2, 3, 4], namespace="lora")
    cached(c, [1, 2, 7, 7], namespace="lora")
    first, second = c.take_events()
    assert (first.namespace, second.namespace) == ("lora", "lora")
    assert second.parent_hash == first.hashes[0]
    assert second.token_ids == [7, 7]


def test_eviction_is_a_removed_event_without_tokens() -> None:
    c = evented()
    cached(c, [1, 2, 3, 4])
    stored = c.take_events()[0]
    c.evict(kv_tokens=4)
    (e,) = c.take_events()
    assert (e.kind, e.medium, e.hashes) == ("removed", "GPU", stored.hashes)
    assert (e.token_ids, e.parent_hash) == ([], None)


def test_the_host_tier_is_announced_as_cpu_pinned_once_a_backup_lands() -> None:
    c = evented(host_kv_slots=64)
    index = EventIndex()
    cached(c, [1, 2, 3, 4])
    index.check(c)
    batches = c.take_batches()
    assert c.take_events() == [], "a backup in flight is not announced"
    for b in batches:
        b.start()
        b.complete()
    (e,) = c.take_events()
    assert (e.kind, e.medium) == ("stored", "CPU_PINNED")
    c.evict(kv_tokens=4)
    c.evict_host(kv_tokens=4)
    kinds = [(e.kind, e.medium) for e in c.take_events()]
    assert kinds == [("removed", "GPU"), ("removed", "CPU_PINNED")]


def test_states_are_announced_with_their_nodes_last_page() -> None:
    c = evented(mamba_slots=4)
    slot = c.alloc_mamba()
    assert slot is not None
    cached(c, [1, 2, 3, 4], mamba_slot=slot)
    stored, state = c.take_events()
    assert stored.kind == "stored"
    assert (state.kind, state.medium) == ("state_stored", "GPU")
    assert state.hashes == [stored.hashes[-1]]
    assert state.token_ids == []
    c.evict(kv_tokens=4)
    kinds = [e.kind for e in c.take_events()]
    assert kinds == ["state_removed", "removed"]


def test_a_load_back_is_announced_when_its_copies_land() -> None:
    c = evented(host_kv_slots=64)
    index = EventIndex()
    cached(c, [1, 2, 3, 4])
    run_all(c)
    c.evict(kv_tokens=4)
    index.check(c)
    m = c.match_prefix([1, 2, 3, 4])
    guard = c.load_back(m.host_node)
    assert guard is not None
    guard.batch.start()
    guard.commit()
    index.check(c)
    assert not [p for p in index.pages if p[0] == "GPU"], "loading: not announced"
    guard.batch.complete()
    index.check(c)
    assert {h for (m_, _, h) in index.pages if m_ == "GPU"} == set(chain([1, 2, 3, 4], 2))


def test_the_counters_follow_the_queue() -> None:
    c = evented()
    cached(c, [1, 2])
    cached(c, [3, 4])
    s = c.stats()
    assert (s["events_emitted"], s["events_pending"]) == (2, 2)
    c.take_events()
    s = c.stats()
    assert (s["events_emitted"], s["events_pending"]) == (2, 0)


@pytest.mark.parametrize("page_hashes", [False, True])
def test_take_events_without_events_says_how_to_turn_them_on(page_hashes: bool) -> None:
    """An empty list would leave a subscriber waiting for ever (issue 33, item 12)."""
    c = rc.HybridCache(kv_slots=64, page_size=2, page_hashes=page_hashes)
    cached(c, [1, 2])
    before = c.stats()
    assert (before["events_emitted"], before["events_pending"]) == (0, 0)
    with pytest.raises(
        ValueError,
        match=r"^events: take_events: the cache was built with events=False, so it queues no "
        r"KV events; build it with page_hashes=True, events=True",
    ):
        c.take_events()
    assert c.stats() == before, "a refused call changes nothing"
    c.audit()


def test_events_without_page_hashes_are_refused_naming_events() -> None:
    with pytest.raises(ValueError, match="events"):
        rc.HybridCache(kv_slots=64, events=True)


def test_the_l3_tier_announces_external_pages_through_the_cache() -> None:
    c = evented()
    hashes = chain([1, 2, 3, 4], 2)
    c.note_external_stored(hashes, [1, 2, 3, 4], namespace="t", parent_hash=None)
    c.note_external_removed(hashes[:1], namespace="t")
    stored, removed = c.take_events()
    assert (stored.kind, stored.medium, stored.namespace) == ("stored", "EXTERNAL", "t")
    assert (stored.hashes, stored.token_ids, stored.block_size) == (hashes, [1, 2, 3, 4], 2)
    assert (removed.kind, removed.medium, removed.hashes) == ("removed", "EXTERNAL", hashes[:1])


def test_external_notes_refuse_bad_arguments_naming_them() -> None:
    c = evented()
    with pytest.raises(ValueError, match="token_ids"):
        c.note_external_stored([bytes(32)], [1])
    with pytest.raises(ValueError, match=r"hashes\[1\]"):
        c.note_external_removed([bytes(32), b"x"])
    with pytest.raises(TypeError, match="hashes"):
        c.note_external_removed(bytes(32))  # type: ignore[arg-type]
    off = rc.HybridCache(kv_slots=64, page_size=2, page_hashes=True)
    with pytest.raises(ValueError, match="events"):
        off.note_external_removed([bytes(32)])
    assert c.take_events() == []
