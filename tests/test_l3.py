"""The L3 tier from Python: `L3Tier` writing a cache's host pages to a store and another
cache fetching them, byte for byte; a partial, failed or corrupt fetch; the breaker; the
replay's ``--l3``, ``--servers`` and ``--shard``; and every argument refused."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from radixcache import Breaker, HybridCache, ObjectStore, Storage
from radixcache.engine import TransferEngine
from radixcache.l3 import L3Identity, L3Tier
from radixcache.serving import workloads
from radixcache.serving.harness import ReplayConfig, Server, clear, deal, replay, replay_fleet

from conftest import RedisServer
from l3_common import MODEL, Gated, L3Cache

PS = 4


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"file://{tmp_path / 'store'}"


TOKENS = list(range(100, 124))  # six pages


def written(url: str, *, hybrid: bool, seed: int) -> L3Cache:
    """A cache that computed `TOKENS` (random data from `seed`) and wrote them to `url`."""
    a = L3Cache(ObjectStore(url), hybrid=hybrid)
    a.compute(TOKENS, np.random.default_rng(seed))
    a.settle()
    return a


@pytest.mark.parametrize("hybrid", [False, True])
def test_a_prefix_one_cache_wrote_is_fetched_by_another_byte_for_byte(
    url: str, hybrid: bool
) -> None:
    rng = np.random.default_rng(0)
    a, b = L3Cache(ObjectStore(url), hybrid=hybrid), L3Cache(ObjectStore(url), hybrid=hybrid)
    wrote = a.compute(TOKENS, rng)
    a.settle()
    assert a.cache.stats()["l3_puts_done"] == 1
    assert a.tier.counters.stored_objects == 6 + hybrid
    assert b.tier.lookup(TOKENS) == 6
    assert b.tier.fetch(TOKENS) == len(TOKENS)
    assert b.cache.stats()["l3_landed_pages"] == 6
    got = b.loaded(TOKENS)
    for name, want in wrote.items():
        np.testing.assert_array_equal(got[name], want, err_msg=name)
    b.cache.audit()
    # Pages that came from the store are not offered to it again.
    b.settle()
    assert b.cache.stats()["l3_puts"] == 0
    # Written once: a third cache computing the same prompt writes nothing new.
    c = L3Cache(ObjectStore(url), hybrid=hybrid)
    c.compute(TOKENS, rng)
    c.settle()
    assert c.tier.counters.stored_objects == 0
    assert c.tier.counters.present_objects == 6 + hybrid


@pytest.mark.parametrize("l3_write", ["backup", "host_eviction"])
def test_a_reset_cache_fetches_back_what_it_wrote_and_writes_nothing_on_reset(
    url: str, l3_write: str
) -> None:
    rng = np.random.default_rng(3)
    a = L3Cache(ObjectStore(url), hybrid=True, l3_write=l3_write)
    wrote = a.compute(TOKENS, rng)
    a.settle()
    if l3_write == "host_eviction":
        a.cache.evict(kv_tokens=10**6, mamba_states=10**6)
        a.settle()
        a.cache.evict_host(kv_tokens=10**6, mamba_states=10**6)  # written now
        a.settle()
        wrote_before = a.tier.counters.stored_objects
        a.compute(list(range(300, 308)), rng)  # on the host only, never evicted from it
        a.settle()
    stored = a.tier.counters.stored_objects
    assert stored >= 6 + 1
    a.cache.reset()
    assert a.cache.take_batches() == []
    assert a.tier.counters.stored_objects == stored
    if l3_write == "host_eviction":
        assert stored == wrote_before, "the reset wrote nothing of what it dropped"
    assert a.tier.lookup(TOKENS) == 6
    assert a.tier.fetch(TOKENS) == len(TOKENS)
    got = a.loaded(TOKENS)
    for name, want in wrote.items():
        np.testing.assert_array_equal(got[name], want, err_msg=name)
    a.cache.audit()


@pytest.mark.parametrize("hybrid", [False, True])
def test_under_host_eviction_pages_go_to_the_store_only_when_evicted_from_the_host(
    url: str, hybrid: bool
) -> None:
    rng = np.random.default_rng(1)
    a = L3Cache(ObjectStore(url), hybrid=hybrid, l3_write="host_eviction")
    b = L3Cache(ObjectStore(url), hybrid=hybrid)
    assert a.cache.l3_write == "host_eviction"
    wrote = a.compute(TOKENS, rng)
    a.settle()
    assert a.cache.stats()["l3_puts"] == 0
    assert b.tier.lookup(TOKENS) == 0, "nothing in the store yet"
    a.cache.evict(kv_tokens=a.cache.kv_slots, mamba_states=a.cache.mamba_slots)
    a.engine.run_pending()
    assert a.cache.match_prefix(TOKENS).host_len == len(TOKENS), "demoted to the host"
    assert a.cache.stats()["l3_puts"] == 0
    a.cache.evict_host(kv_tokens=a.cache.host_kv_slots, mamba_states=4)
    s = a.cache.stats()
    assert (s["l3_eviction_puts"], s["host_kv_draining_slots"]) == (1, len(TOKENS))
    a.cache.audit()
    a.engine.run_pending()
    s = a.cache.stats()
    assert (s["l3_puts_done"], s["host_kv_draining_slots"]) == (1, 0)
    assert s["host_kv_free_slots"] == a.cache.host_kv_slots
    assert a.tier.counters.stored_objects == 6 + hybrid
    # What the first cache gave up, the second fetches byte for byte.
    assert b.tier.fetch(TOKENS) == len(TOKENS)
    got = b.loaded(TOKENS)
    for name, want in wrote.items():
        np.testing.assert_array_equal(got[name], want, err_msg=name)
    b.cache.audit()


def test_l3_write_is_refused_without_l3_or_by_another_name() -> None:
    with pytest.raises(ValueError, match=r"^l3_write: .*without an L3 tier"):
        HybridCache(kv_slots=64, host_kv_slots=128, page_hashes=True, l3_write="backup")
    with pytest.raises(ValueError, match=r'^l3_write: unknown setting "eviction"'):
        HybridCache(
            kv_slots=64,
            host_kv_slots=128,
            page_hashes=True,
            l3=True,
            l3_write="eviction",  # type: ignore[arg-type]
        )
    assert HybridCache(kv_slots=64, host_kv_slots=128, page_hashes=True, l3=True).l3_write == (
        "backup"
    )
    assert HybridCache(kv_slots=64).l3_write is None
    with pytest.raises(ValueError, match=r"^l3_write: 'host_eviction' given without an L3"):
        replay([], ReplayConfig(l3_write="host_eviction"))


def test_a_fetch_continues_what_the_cache_holds_and_skips_a_short_rest(url: str) -> None:
    rng = np.random.default_rng(1)
    a, b = L3Cache(ObjectStore(url), hybrid=False), L3Cache(ObjectStore(url), hybrid=False)
    a.compute(TOKENS, rng)
    a.settle()
    b.compute(TOKENS[:8], rng)  # b holds two pages of its own
    assert b.tier.lookup(TOKENS) == 6
    assert b.tier.fetch(TOKENS) == 16, "the four pages b lacks"
    assert b.cache.match_prefix(TOKENS).host_len == 16
    b.tier.min_tokens = 1000
    assert b.tier.lookup(list(range(100, 200))) == 0
    assert b.tier.counters.lookups_skipped == 1
    b.cache.audit()


def test_a_hybrid_fetch_goes_only_as_far_as_a_stored_state(url: str) -> None:
    rng = np.random.default_rng(2)
    a, b = L3Cache(ObjectStore(url), hybrid=True), L3Cache(ObjectStore(url), hybrid=True)
    a.compute(TOKENS[:8], rng)  # a state after two pages
    a.settle()
    a.compute(TOKENS, rng)  # and after six
    a.settle()
    store = ObjectStore(url)
    last = a.cache.chain_hashes(TOKENS)[-1]
    state_key = a.tier.identity.key("mamba", last)
    store.delete([state_key])
    assert b.tier.lookup(TOKENS) == 2, "the deepest page with a state"
    assert b.tier.fetch(TOKENS) == 8
    b.cache.audit()


@pytest.mark.parametrize("hybrid", [False, True])
def test_lost_and_corrupt_objects_are_misses_never_wrong_bytes(url: str, hybrid: bool) -> None:
    rng = np.random.default_rng(3)
    a = L3Cache(ObjectStore(url), hybrid=hybrid)
    a.compute(TOKENS, rng)
    a.settle()
    for fault in ("lose", "corrupt"):
        b = L3Cache(ObjectStore.faulty(url, seed=7, **{fault: 1.0}), hybrid=hybrid)
        assert b.tier.fetch(TOKENS) == 0
        assert b.cache.match_prefix(TOKENS).host_len == 0
        assert b.cache.stats()["l3_fetches_failed"] == 1
        stats = b.cache.stats()
        assert stats["host_kv_free_slots"] == b.cache.host_kv_slots, "every host slot back"
        b.cache.audit()
        if fault == "corrupt":
            assert b.tier.counters.corrupt_objects >= 1
    # The corrupt first page was deleted: the store's leading run now starts missing.
    c = L3Cache(ObjectStore(url), hybrid=hybrid)
    assert c.tier.lookup(TOKENS) == 0


@pytest.mark.parametrize("fault", ["lose", "corrupt"])
def test_an_object_the_store_lost_or_held_corrupt_is_announced_gone_from_external(
    url: str, fault: str
) -> None:
    a = written(url, hybrid=False, seed=3)
    hashes = a.cache.chain_hashes(TOKENS)
    b = L3Cache(ObjectStore.faulty(url, seed=7, **{fault: 1.0}), hybrid=False, events=True)
    b.cache.take_events()
    assert b.tier.fetch(TOKENS) == 0
    # One batch get read all six objects, and every one was lost (or corrupt, then
    # deleted): all six are announced gone, in one removal.
    gone = [(e.kind, e.medium, e.namespace, e.hashes) for e in b.cache.take_events()]
    assert gone == [("removed", "EXTERNAL", None, hashes)]
    assert b.cache.stats()["l3_gone_objects"] == 6
    key = "l3_corrupt_objects" if fault == "corrupt" else "l3_missing_objects"
    assert b.tier.report()[key] == 6
    b.cache.audit()


def test_a_state_the_store_lost_is_announced_gone_and_its_pages_stay_announced(
    url: str,
) -> None:
    a = written(url, hybrid=True, seed=3)
    last = a.cache.chain_hashes(TOKENS)[-1]
    b = L3Cache(ObjectStore(url), hybrid=True, events=True)
    batch = b.cache.l3_fetch(TOKENS, 6)
    assert batch is not None
    b.cache.take_events()
    ObjectStore(url).delete([b.tier.identity.key("mamba", last)])
    assert b.tier.read(batch) == 0, "a hybrid prefix lands only with its state"
    events = [(e.kind, e.medium, e.hashes) for e in b.cache.take_events()]
    assert events == [("state_removed", "EXTERNAL", [last])]
    assert b.cache.stats()["l3_gone_objects"] == 1
    assert b.tier.report()["l3_missing_objects"] == 1
    b.cache.audit()


def test_complete_l3_refuses_a_bad_gone_naming_it_and_changes_nothing(url: str) -> None:
    written(url, hybrid=True, seed=3)
    b = L3Cache(ObjectStore(url), hybrid=True, events=True)
    batch = b.cache.l3_fetch(TOKENS, 6)
    assert batch is not None
    batch.start()
    b.cache.take_events()
    before = b.cache.stats()
    for pages, state, gone, why in [
        (0, False, [-1], r"^gone: index -1 is negative"),
        (0, False, [7], r"^gone: index 7 is past the batch's 7 objects"),
        (2, False, [1], r"^gone: page 1 is reported landed"),
        (6, True, [6], r"^gone: the state .* is reported landed"),
    ]:
        with pytest.raises(ValueError, match=why):
            batch.complete_l3(pages, state=state, gone=gone)
    with pytest.raises(TypeError, match=r"^gone"):
        batch.complete_l3(0, gone={1})  # type: ignore[arg-type]
    assert b.cache.stats() == before
    assert b.cache.take_events() == []
    assert batch.outcome is None, "still in flight"
    batch.complete_l3(0, gone=np.array([6, 0, 6]))
    assert b.cache.stats()["l3_gone_objects"] == 2
    b.cache.audit()


def test_a_partial_fetch_lands_the_pages_that_came_back(url: str) -> None:
    rng = np.random.default_rng(4)
    a, b = L3Cache(ObjectStore(url), hybrid=False), L3Cache(ObjectStore(url), hybrid=False)
    a.compute(TOKENS, rng)
    a.settle()
    hashes = a.cache.chain_hashes(TOKENS)
    ObjectStore(url).delete([a.tier.identity.key("kv", hashes[3])])
    assert b.tier.lookup(TOKENS) == 3
    batch = b.cache.l3_fetch(TOKENS, 6)
    assert batch is not None
    assert batch.kind == "l3_get"
    assert b.tier.read(batch) == 3, "pages 0-2 landed, 3 missing, 4-5 not used"
    assert b.cache.match_prefix(TOKENS).host_len == 12
    assert b.tier.counters.missed_pages == 3
    assert b.cache.stats()["l3_gone_objects"] == 1, "page 3 only: 4 and 5 are still there"
    b.cache.audit()


def test_a_store_that_is_down_opens_the_breaker_and_serving_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    down = ObjectStore("redis://127.0.0.1:1", timeout_ms=50)
    a = L3Cache(down, hybrid=False, breaker=Breaker(threshold=2, cooldown_ms=300))
    rng = np.random.default_rng(5)
    with caplog.at_level(logging.WARNING, logger="radixcache.l3"):
        for n in range(3):
            a.compute([7, n, 7, n, *TOKENS[: 4 * (n + 1)]], rng)
            a.settle()
    assert a.tier.breaker.state == "open"
    assert a.tier.breaker.trips == 1
    assert a.tier.counters.errors == 2, "after two errors in a row no call goes out"
    assert a.tier.counters.skipped_open >= 1
    assert a.cache.stats()["l3_puts_failed"] == 3
    assert a.tier.fetch([9, 9, 9, 9, *TOKENS]) == 0
    report = a.tier.report()
    assert report["l3_breaker"] == "open"
    # Why, counted by cause, the first message kept; logged once for the outage, and the
    # breaker's trip.
    assert report["l3_error_causes"] == {"connection refused": 2}
    assert "connection refused" in report["l3_first_error"]
    logged = [r.getMessage() for r in caplog.records if r.name == "radixcache.l3"]
    assert len(logged) == 2, logged
    assert logged[0].startswith("L3 store redis://127.0.0.1:1: connection refused (")
    assert "circuit breaker open after 2 errors in a row" in logged[1]
    caplog.clear()
    time.sleep(0.35)
    a.tier.store = ObjectStore(f"file://{tmp_path / 'back'}")
    with caplog.at_level(logging.WARNING, logger="radixcache.l3"):
        a.compute([8, 8, 8, 8, *TOKENS], rng)
        a.settle()
    assert a.tier.breaker.state == "closed", "the probe succeeded"
    assert a.tier.counters.stored_objects > 0
    assert [r.getMessage() for r in caplog.records] == [
        f"L3 store file://{tmp_path / 'back'} answers again"
    ]
    a.cache.audit()


def test_layouts_that_differ_name_objects_differently(url: str) -> None:
    a = L3Cache(ObjectStore(url), hybrid=False)
    other = HybridCache(kv_slots=64, page_size=8, host_kv_slots=128, page_hashes=True, l3=True)
    storage = Storage.for_cache(other, layers=2, kv_heads=2, head_dim=4, dtype="float32")
    theirs = L3Identity.of(storage, 8, model=MODEL)
    assert a.tier.identity.digest != theirs.digest
    page = bytes(32)
    assert a.tier.identity.key("kv", page) != theirs.key("kv", page)
    assert a.tier.identity.key("kv", page).startswith(b"rc2:")


def test_bad_arguments_are_refused_naming_them(url: str) -> None:
    store = ObjectStore(url)
    plain = HybridCache(kv_slots=64, page_size=PS, host_kv_slots=128)
    storage = Storage.for_cache(plain, layers=1, kv_heads=1, head_dim=1)
    with pytest.raises(ValueError, match=r"^cache: .*l3=True"):
        L3Tier(plain, storage, store, model=MODEL)
    a = L3Cache(store, hybrid=False)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=r"^min_tokens"):
            L3Tier(a.cache, a.storage, store, model=MODEL, min_tokens=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^l3: needs"):
        HybridCache(kv_slots=64, page_size=PS, host_kv_slots=128, l3=True)
    with pytest.raises(ValueError, match=r"^l3: needs a host tier"):
        HybridCache(kv_slots=64, page_size=PS, page_hashes=True, l3=True)
    with pytest.raises(ValueError, match=r"^l3"):
        plain.l3_fetch(TOKENS, 1)
    with pytest.raises(ValueError, match=r"^pages"):
        a.cache.l3_fetch(TOKENS, 7)
    a.compute(TOKENS[:8], np.random.default_rng(6))
    batch = a.cache.take_batches()[0]
    with pytest.raises(ValueError, match=r"^batch: expected an l3_put"):
        a.tier.write(batch)
    with pytest.raises(ValueError, match=r"^batch: expected an l3_put"):
        a.tier.start_write(batch)
    with pytest.raises(ValueError, match=r"^batch: expected an l3_get"):
        a.tier.read(batch)
    with pytest.raises(ValueError, match=r"batch_id"):
        batch.complete_l3(1)
    batch.start()
    batch.complete()
    a.cache.audit()


def test_an_engine_without_an_l3_tier_fails_l3_puts_and_nothing_leaks(url: str) -> None:
    a = L3Cache(ObjectStore(url), hybrid=False)
    engine = TransferEngine(a.cache, a.storage)
    a.compute(TOKENS, np.random.default_rng(7))
    engine.run_pending()  # the backup
    puts = a.cache.take_batches()
    assert [b.kind for b in puts] == ["l3_put"]
    assert not engine.run(puts[0])
    assert puts[0].outcome == "failed"
    assert "no L3 tier" in (engine.last_error or "")
    a.cache.audit()


def test_a_fetch_left_before_it_ended_gives_its_slots_back(url: str) -> None:
    a, b = L3Cache(ObjectStore(url), hybrid=True), L3Cache(ObjectStore(url), hybrid=True)
    a.compute(TOKENS, np.random.default_rng(8))
    a.settle()
    for started in (False, True):
        batch = b.cache.l3_fetch(TOKENS, 6)
        assert batch is not None
        assert b.cache.stats()["host_kv_free_slots"] < b.cache.host_kv_slots
        if started:
            batch.start()
        with batch:  # left without an ending: failed
            pass
        assert batch.outcome == "failed"
        assert b.cache.stats()["host_kv_free_slots"] == b.cache.host_kv_slots
        assert b.cache.match_prefix(TOKENS).host_len == 0
        b.cache.audit()


# ---------------------------------------------------------------------- the replay


@pytest.mark.parametrize("hybrid", [False, True])
def test_a_background_fetch_lands_what_a_blocking_one_does_while_the_cache_serves(
    url: str, hybrid: bool
) -> None:
    rng = np.random.default_rng(11)
    a = L3Cache(ObjectStore(url), hybrid=hybrid)
    wrote = a.compute(TOKENS, rng)
    a.settle()
    gated = Gated(ObjectStore(url))
    b = L3Cache(gated, hybrid=hybrid)
    fetch = b.tier.start_fetch(TOKENS)
    assert fetch is not None
    while fetch.batch is None:  # the lookup answers; the poll then starts the read
        assert not b.tier.poll(fetch, timeout=0.01)
    assert gated.reading.wait(10)
    # The read is in flight on the worker thread: the cache serves other prompts.
    assert b.tier.poll(fetch) is False
    other = [7, 7, 7, 7, *range(200, 212)]
    b.compute(other, rng)
    b.settle()
    assert b.cache.match_prefix(other).device_len == len(other)
    b.cache.audit()
    gated.gate.set()
    assert b.tier.poll(fetch, timeout=10)
    assert (fetch.done, fetch.tokens_landed, fetch.cancelled) == (True, len(TOKENS), False)
    got = b.loaded(TOKENS)
    for name, want in wrote.items():
        np.testing.assert_array_equal(got[name], want, err_msg=name)
    assert b.tier.report()["l3_fetches"] == 1
    b.tier.close()
    b.cache.audit()


def test_a_background_fetch_with_nothing_to_ask_or_find_ends_with_nothing(url: str) -> None:
    b = L3Cache(ObjectStore(url), hybrid=False)
    b.tier.min_tokens = 64
    assert b.tier.start_fetch(TOKENS) is None, "24 uncached tokens: under min_tokens"
    b.tier.min_tokens = 0
    fetch = b.tier.start_fetch(TOKENS)
    assert fetch is not None
    assert b.tier.poll(fetch, timeout=10)
    assert (fetch.tokens_landed, b.tier.report()["l3_fetches"]) == (0, 0)
    b.tier.close()
    assert b.cache.stats()["host_kv_free_slots"] == b.cache.host_kv_slots


def test_a_background_fetch_called_off_gives_every_slot_back_once_its_read_ended(
    url: str,
) -> None:
    written(url, hybrid=True, seed=12)
    gated = Gated(ObjectStore(url))
    b = L3Cache(gated, hybrid=True)
    full = b.cache.stats()
    # Called off during its lookup: nothing was taken.
    early = b.tier.start_fetch(TOKENS)
    assert early is not None
    b.tier.cancel(early)
    assert (early.done, early.cancelled, early.tokens_landed) == (True, True, 0)
    # Called off during its read: the host slots it writes stay taken until it ended.
    fetch = b.tier.start_fetch(TOKENS)
    assert fetch is not None
    while fetch.batch is None:
        b.tier.poll(fetch, timeout=0.01)
    assert gated.reading.wait(10)
    b.tier.cancel(fetch)
    assert (fetch.done, fetch.tokens_landed) == (True, 0)
    taken = b.cache.stats()
    assert taken["host_kv_free_slots"] == full["host_kv_free_slots"] - len(TOKENS)
    assert b.tier.poll(fetch), "done for the caller"
    assert fetch.batch.outcome is None, "its read still writes the host slots"
    b.cache.audit()
    gated.gate.set()
    b.tier.close()
    assert fetch.batch.outcome == "failed"
    after = b.cache.stats()
    assert after["host_kv_free_slots"] == full["host_kv_free_slots"]
    assert after["host_mamba_free_slots"] == full["host_mamba_free_slots"]
    assert b.cache.match_prefix(TOKENS).host_len == 0, "nothing landed"
    assert b.tier.report()["l3_fetches_cancelled"] == 2
    b.cache.audit()


def test_close_ends_the_fetches_left_in_flight_and_the_tier_works_after(url: str) -> None:
    written(url, hybrid=True, seed=17)
    b = L3Cache(ObjectStore(url), hybrid=True)
    fetch = b.tier.start_fetch(TOKENS)
    assert fetch is not None
    b.tier.close()  # never polled: close takes it through its lookup and its read
    assert (fetch.done, fetch.tokens_landed) == (True, len(TOKENS))
    assert fetch.batch is not None
    assert fetch.batch.outcome == "completed"
    assert b.cache.match_prefix(TOKENS).host_len == len(TOKENS)
    c = L3Cache(ObjectStore(url), hybrid=True)
    c.tier.close()  # nothing in flight: nothing to do
    again = c.tier.start_fetch(TOKENS)
    assert again is not None
    assert c.tier.poll(again, timeout=None)
    assert again.tokens_landed == len(TOKENS)
    c.tier.close()
    b.cache.audit()
    c.cache.audit()


def test_a_read_that_raises_fails_its_batch_and_the_error_reaches_the_caller(url: str) -> None:
    written(url, hybrid=False, seed=13)
    gated = Gated(ObjectStore(url))
    b = L3Cache(gated, hybrid=False)

    def broken(keys: Any, hashes: Any, out: Any, **label: Any) -> Any:
        raise RuntimeError("a store client bug")

    gated.get_into = broken  # type: ignore[method-assign]
    fetch = b.tier.start_fetch(TOKENS)
    assert fetch is not None

    def drive() -> None:
        while not b.tier.poll(fetch, timeout=0.05):
            pass

    with pytest.raises(RuntimeError, match="a store client bug"):
        drive()
    assert fetch.done
    assert fetch.tokens_landed == 0
    assert fetch.batch is not None
    assert fetch.batch.outcome == "failed"
    assert b.cache.stats()["host_kv_free_slots"] == b.cache.host_kv_slots
    b.tier.close()
    b.cache.audit()


def test_a_background_fetch_from_a_store_that_is_down_is_a_miss() -> None:
    down = ObjectStore("redis://127.0.0.1:1", timeout_ms=50)
    b = L3Cache(down, hybrid=False)
    fetch = b.tier.start_fetch(TOKENS)
    assert fetch is not None
    assert b.tier.poll(fetch, timeout=10)
    assert fetch.tokens_landed == 0
    assert b.tier.report()["l3_errors"] == 1
    b.tier.close()
    b.cache.audit()


@pytest.mark.parametrize("hybrid", [False, True])
def test_a_submitted_put_is_written_in_the_background_and_pins_its_host_slots(
    url: str, hybrid: bool
) -> None:
    gated = Gated(ObjectStore(url), puts=True)
    a = L3Cache(gated, hybrid=hybrid)
    wrote = a.compute(TOKENS, np.random.default_rng(14))
    a.engine.run_pending()  # the backup; its landing emits the put
    (put,) = a.cache.take_batches()
    assert put.kind == "l3_put"
    a.engine.submit(put)
    assert gated.writing.wait(10), "the write runs on the worker thread"
    assert a.engine.poll() == []
    assert a.engine.in_flight == 1
    # Host eviction while it writes: the host slots it reads drain, none is reused.
    a.cache.evict(kv_tokens=len(TOKENS), mamba_states=1)
    a.cache.evict_host(kv_tokens=len(TOKENS), mamba_states=1)
    stats = a.cache.stats()
    assert stats["host_kv_draining_slots"] == len(TOKENS)
    a.cache.audit()
    gated.gate.set()
    assert a.engine.synchronize() == [put]
    assert put.outcome == "completed"
    assert a.cache.stats()["host_kv_free_slots"] == a.cache.host_kv_slots, "drained"
    assert a.tier.counters.stored_objects == 6 + hybrid
    b = L3Cache(ObjectStore(url), hybrid=hybrid)
    assert b.tier.fetch(TOKENS) == len(TOKENS)
    got = b.loaded(TOKENS)
    for name, want in wrote.items():
        np.testing.assert_array_equal(got[name], want, err_msg=name)
    a.tier.close()
    a.cache.audit()


def test_a_submitted_put_whose_write_fails_fails_and_is_offered_again(tmp_path: Path) -> None:
    a = L3Cache(ObjectStore("redis://127.0.0.1:1", timeout_ms=50), hybrid=False)
    a.compute(TOKENS, np.random.default_rng(15))
    a.engine.run_pending()
    (put,) = a.cache.take_batches()
    a.engine.submit(put)
    assert a.engine.synchronize() == []
    assert put.outcome == "failed"
    assert (put.reason or "").startswith(
        "L3Error: exists failed: connection refused: connecting to 127.0.0.1:1"
    )
    assert a.cache.stats()["l3_puts_failed"] == 1
    # The store is back (another one): the next backup on the path offers them again.
    a.tier.store = ObjectStore(f"file://{tmp_path / 'back'}")
    a.compute([*TOKENS, 1, 2, 3, 4], np.random.default_rng(16))
    a.engine.run_pending()
    for b in a.cache.take_batches():
        a.engine.submit(b)
    a.engine.synchronize()
    assert a.tier.counters.stored_objects == 7, "the six pages again, and the new one"
    a.tier.close()
    a.cache.audit()


@pytest.mark.slow
def test_a_fleet_prefetching_in_the_background_serves_every_sample_right(url: str) -> None:
    jobs = workloads.WORKLOADS["multiturn"](240, 0)
    r = replay_fleet(jobs, _config(url, l3_prefetch=True), 2, compare=False)
    assert (r["mismatches"], r["audit"], r["pools_full_at_end"]) == (0, "pass", True)
    assert r["samples_checked"] > 0
    assert r["l3_prefetches"] > 0
    assert r["l3_hit_tokens"] > 0


def test_prefetches_past_their_timeout_are_called_off_and_nothing_leaks(url: str) -> None:
    jobs = workloads.WORKLOADS["multiturn"](60, 0)
    # The first server fills the store; the second fetches through a gate that opens
    # only after a few of its fetches were called off.
    first, _ = replay(jobs, _config(url))
    assert first["l3_stored_objects"] > 0
    server = Server(_config(url, l3_prefetch=True, l3_prefetch_timeout=0.01))
    assert server.l3 is not None
    gated = Gated(server.l3.store)
    server.l3.store = gated
    server.sched.add(jobs)
    sched = server.sched
    while sched.counters.l3_prefetch_timeouts < 3 and (sched.waiting or sched.running):
        sched.step()
    gated.gate.set()
    sched.run()
    c = sched.counters
    assert c.l3_prefetch_timeouts >= 3
    assert (c.finished, server.model.mismatches if server.model else -1) == (60, 0)
    assert server.l3.report()["l3_fetches_cancelled"] >= 3
    server.cache.audit()
    assert clear(server.cache, server.engine)
    assert not server.cache.pending_batches()


def test_prefetch_settings_are_refused_without_a_store_or_out_of_range() -> None:
    with pytest.raises(ValueError, match=r"^l3_prefetch: given without an L3 store"):
        Server(ReplayConfig(l3_prefetch=True))
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"^l3_prefetch_timeout: must be a number"):
            ReplayConfig().scheduler(
                HybridCache(kv_slots=64, page_size=PS), None, None, l3_prefetch_timeout=bad
            )


def _config(url: str | None, **kw: Any) -> ReplayConfig:
    return ReplayConfig(l3=url, attention_only=False, **kw)


def test_a_replay_with_l3_checks_every_sample(url: str) -> None:
    jobs = workloads.WORKLOADS["multiturn"](120, 0)
    r, _ = replay(jobs, _config(url))
    assert (r["mismatches"], r["audit"], r["pools_full_at_end"]) == (0, "pass", True)
    assert r["l3_stored_objects"] > 0
    assert r["l3_breaker"] == "closed"
    assert r["hit_rate"] == pytest.approx(
        (r["device_hit_tokens"] + r["host_hit_tokens"] + r["l3_hit_tokens"]) / r["prompt_tokens"]
    )


@pytest.mark.slow
def test_a_fleet_with_l3_reaches_most_of_one_servers_hit_rate(url: str) -> None:
    jobs = workloads.WORKLOADS["multiturn"](240, 0)
    r = replay_fleet(jobs, _config(url), 2)
    assert (r["mismatches"], r["audit"], r["pools_full_at_end"]) == (0, "pass", True)
    assert (r["requests"], len(r["per_server"])) == (240, 2)
    assert r["l3_hit_tokens"] > 0
    assert r["fleet_vs_single_ratio"] >= 0.9
    assert r["fleet_without_l3_hit_rate"] < r["hit_rate"]


def _evicting(url: str) -> ReplayConfig:
    """Small pools writing to `url` on host eviction: the host tier evicts while serving."""
    return _config(
        url,
        l3_write="host_eviction",
        kv_slots=8192,
        mamba_slots=64,
        host_kv_slots=16384,
        host_mamba_slots=64,
    )


@pytest.mark.slow
def test_a_fleet_writing_on_host_eviction_hits_what_the_other_server_evicted(url: str) -> None:
    jobs = workloads.WORKLOADS["multiturn"](240, 0)
    r = replay_fleet(jobs, _evicting(url), 2, compare=False)
    assert (r["mismatches"], r["audit"], r["pools_full_at_end"]) == (0, "pass", True)
    assert r["samples_checked"] > 0
    for one in r["per_server"]:
        assert one["l3_eviction_puts"] > 0
    assert r["l3_eviction_puts"] == sum(one["l3_eviction_puts"] for one in r["per_server"])
    # Only host eviction writes: every L3 hit is of pages one server evicted.
    assert r["l3_hit_tokens"] > 0


def test_a_server_hits_what_another_wrote_when_it_cleared_its_host_tier(url: str) -> None:
    # Large pools: nothing is evicted while serving, so the store is filled only when
    # the first server's pools are cleared at the end (host eviction of everything).
    jobs = workloads.WORKLOADS["multiturn"](40, 0)
    config = _config(url, l3_write="host_eviction")
    first, _ = replay(jobs, config)
    assert (first["mismatches"], first["pools_full_at_end"]) == (0, True)
    assert (first["l3_hit_tokens"], first["l3_eviction_puts"] > 0) == (0, True)
    second, _ = replay(jobs, config)
    assert (second["mismatches"], second["audit"], second["pools_full_at_end"]) == (
        0,
        "pass",
        True,
    )
    assert second["l3_hit_tokens"] > 0


def test_two_shards_split_the_workload_as_a_router_would() -> None:
    jobs = list(range(7))
    assert deal(jobs, 2, 0) == [0, 2, 4, 6]  # type: ignore[arg-type]
    assert deal(jobs, 2, 1) == [1, 3, 5]  # type: ignore[arg-type]


def test_l3_needs_the_oracle(url: str) -> None:
    with pytest.raises(ValueError, match=r"^l3: .*oracle"):
        replay(workloads.WORKLOADS["multiturn"](4, 0), _config(url, oracle=False))


def test_cli_refuses_bad_l3_flags_naming_them(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    from radixcache.cli import main

    for argv, match in (
        (["--shard", "2/2"], "--shard: expected K/N"),
        (["--shard", "x"], "--shard: expected K/N"),
        (["--shard", "0/2", "--servers", "2"], "--shard: one process serves one shard"),
        (["--l3", "ftp://nowhere"], "--l3: "),
        (["--l3-write", "host_eviction"], "--l3-write: only with --l3"),
        (["--l3", url, "--l3-write", "evict"], "--l3-write"),
        (["--l3-prefetch"], "--l3-prefetch: only with --l3"),
        (["--l3", url, "--l3-prefetch-timeout", "3"], "--l3-prefetch-timeout: only with"),
        (["--l3", url, "--l3-prefetch", "--l3-prefetch-timeout", "0"], "--l3-prefetch-timeout"),
        (["--l3", url, "--l3-prefetch", "--l3-prefetch-timeout", "nan"], "(0, 3600]"),
    ):
        assert main(["replay", "--requests", "4", *argv]) == 2, argv
        assert match in capsys.readouterr().err


@pytest.mark.slow
def test_cli_serves_a_shard_and_a_fleet(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from radixcache.cli import main

    base = ["replay", "--workload", "multiturn", "--requests", "40", "--quiet", "--json"]
    assert main([*base, "--l3", url, "--shard", "1/2"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["shard"], r["requests"], r["mismatches"]) == ("1/2", 20, 0)
    assert main([*base, "--l3", url, "--servers", "2", "--no-attention-only"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["servers"], r["requests"], r["mismatches"]) == (2, 40, 0)
    assert r["single_server_hit_rate"] is None
    small = ["--kv-slots", "8192", "--mamba-slots", "64", "--host-kv-slots", "16384"]
    small += ["--host-mamba-slots", "64", "--requests", "120"]
    argv = [*base, *small, "--l3", url, "--l3-write", "host_eviction", "--servers", "2"]
    assert main([*argv, "--no-attention-only"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["mismatches"], r["audit"]) == (0, "pass")
    assert r["l3_eviction_puts"] > 0


@pytest.mark.slow
def test_a_fleet_over_redis_serves_every_sample_right(redis_server: RedisServer) -> None:
    jobs = workloads.WORKLOADS["gsp"](96, 0)
    r = replay_fleet(jobs, _config(redis_server.url), 2, compare=False)
    assert (r["mismatches"], r["audit"], r["pools_full_at_end"]) == (0, "pass", True)
    assert r["l3_stored_objects"] > 0
    assert r["l3_breaker"] == ["closed", "closed"]


@pytest.mark.slow
def test_a_fleet_over_a_redis_cluster_serves_every_sample_right(redis_cluster: str) -> None:
    jobs = workloads.WORKLOADS["multiturn"](96, 0)
    r = replay_fleet(jobs, _config(redis_cluster), 2, compare=False)
    assert (r["mismatches"], r["audit"], r["pools_full_at_end"]) == (0, "pass", True)
    assert r["l3_stored_objects"] > 0
    assert r["l3_hit_tokens"] > 0, "one server fetched what the other wrote"
    assert r["l3_breaker"] == ["closed", "closed"]


@pytest.mark.slow
def test_two_shard_processes_share_a_redis_that_dies_and_comes_back() -> None:
    # Three copies of multiturn, so that both processes run well past the restart.
    if shutil.which("redis-server") is None:
        if os.environ.get("RADIXCACHE_REQUIRE_REDIS") == "1":
            pytest.fail("redis-server is not on PATH and RADIXCACHE_REQUIRE_REDIS=1")
        pytest.skip("redis-server is not on PATH")
    script = Path(__file__).parent.parent / "scripts" / "l3_shards.py"
    # Two copies of the workload (the script's default is three) still run well past
    # the restart, at about half the time.
    run = subprocess.run(
        [sys.executable, str(script), "--json", "--copies", "2"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    r = json.loads(run.stdout)
    assert r["killed"]
    for shard in r["shards"]:
        assert (shard["mismatches"], shard["audit"]) == (0, "pass")
        assert shard["l3_hit_tokens"] > 0
    assert any(s["l3_breaker_trips"] for s in r["shards"])
    assert any(s["hits"]["after"] for s in r["shards"]), "hits resumed after the restart"
