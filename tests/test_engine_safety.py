"""TransferEngine under misuse and real use, on CPU: a batch of another cache is refused
untouched; copies are checked before any is enqueued; no slot is freed while a queued
copy may still write it (an asynchronous stand-in engine plays the GPU stream); any
exception is described; a batch acknowledged elsewhere leaves the others alone; threads
share one engine; a released load-back's started batch counts as draining."""

from __future__ import annotations

import gc
import sys
import threading
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any, TypeVar

import numpy as np
import pytest

import radixcache as rc
from radixcache import engine as engine_mod

PS = 2


def cache(**kw: Any) -> rc.HybridCache:
    args: dict[str, Any] = {
        "kv_slots": 32,
        "page_size": PS,
        "mamba_slots": 6,
        "host_kv_slots": 32,
        "host_mamba_slots": 4,
    }
    args.update(kw)
    return rc.HybridCache(**args)


def storage(c: rc.HybridCache) -> rc.Storage:
    return rc.Storage.for_cache(
        c, layers=2, kv_heads=1, head_dim=4, conv_shape=(3,), ssm_shape=(2, 2)
    )


def fill(c: rc.HybridCache, tokens: list[int]) -> None:
    slots = c.alloc_kv(len(tokens))
    assert slots is not None
    c.insert(tokens, slots, mamba_slot=c.alloc_mamba())


def settled(c: rc.HybridCache) -> None:
    c.audit()
    assert c.pending_batches() == []
    st = c.stats()
    assert st["batches_in_flight"] == st["batches_draining"] == 0
    assert st["kv_draining_slots"] == st["mamba_draining_slots"] == 0


# ------------------------------------------------------- a batch of another cache


@pytest.mark.parametrize("how", ["run", "submit"])
def test_a_batch_of_another_cache_is_refused_and_left_to_its_owner(how: str) -> None:
    mine, theirs = cache(), cache()
    e = rc.TransferEngine(mine, storage(mine))
    fill(theirs, [1, 2, 3, 4])
    (b,) = theirs.take_batches()
    with pytest.raises(ValueError, match=r"^batch: \d+ is not in flight in this engine's cache"):
        getattr(e, how)(b)
    # Untouched: not started, not failed; no copy landed in this engine's storage.
    assert b.outcome is None
    assert theirs.pending_batches() == [(b.id, "backup", False)]
    assert e.stats()["batches_refused"] == 1
    assert e.stats()["copies"] == 0
    # Its owner still runs it.
    assert rc.TransferEngine(theirs, storage(theirs)).run(b)
    settled(theirs)
    settled(mine)


def test_owned_by_tells_batches_apart_with_or_without_the_bindings_answer() -> None:
    mine, theirs = cache(), cache()
    fill(mine, [1, 2])
    fill(theirs, [1, 2])
    (b_mine,) = mine.take_batches()
    (b_theirs,) = theirs.take_batches()
    assert engine_mod._owned_by(b_mine, mine)
    assert not engine_mod._owned_by(b_theirs, mine)
    # The fallback (no belongs_to): by id among the cache's pending batches; ids carry
    # their cache's id, so one of another cache never matches.
    assert engine_mod._owned_by(SimpleNamespace(id=b_mine.id), mine)  # type: ignore[arg-type]
    assert not engine_mod._owned_by(SimpleNamespace(id=b_theirs.id), mine)  # type: ignore[arg-type]
    b_mine.complete()
    b_theirs.complete()
    assert not engine_mod._owned_by(SimpleNamespace(id=b_mine.id), mine)  # type: ignore[arg-type]


def test_a_batch_that_ended_is_refused_before_start() -> None:
    c = cache()
    e = rc.TransferEngine(c, storage(c))
    fill(c, [1, 2])
    (b,) = c.take_batches()
    c.fail(b.id)  # ended by id
    with pytest.raises(ValueError, match=r"^batch(_id)?: "):
        e.run(b)
    assert e.stats()["batches_failed"] == 0
    with pytest.raises(TypeError, match=r"^batch: expected a TransferBatch, got int"):
        e.submit(b.id)  # type: ignore[arg-type]
    settled(c)


# ------------------------------------------------------- an asynchronous stand-in


class Stream:
    """A GPU stream stand-in: enqueued work runs later, in order, only when something
    waits for it (an event's ``done``, ``synchronize``)."""

    def __init__(self) -> None:
        self.queue: list[tuple[Any, Callable[[], None]]] = []
        self.enqueued = 0
        self.ran = 0
        self.lost = False  # a lost device: waiting raises

    def enqueue(self, copy: Any, work: Callable[[], None]) -> None:
        self.queue.append((copy, work))
        self.enqueued += 1

    def run_until(self, mark: int) -> None:
        if self.lost:
            raise RuntimeError("CUDA error: device lost")
        while self.ran < mark:
            _, work = self.queue.pop(0)
            work()
            self.ran += 1

    def synchronize(self) -> None:
        self.run_until(self.enqueued)

    def pending_dst(self, pool: str, tier: str) -> set[int]:
        """Slots that work still queued will write in `pool` on `tier`."""
        return {
            int(s) for c, _ in self.queue if (c.pool, c.dst_tier) == (pool, tier) for s in c.dst
        }


class Event:
    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.mark = stream.enqueued

    @property
    def done(self) -> bool:
        self.stream.run_until(self.mark)
        return True


class AsyncEngine(rc.TransferEngine):
    """Copies are queued on a `Stream` and run later, in order, as on a GPU; the copy
    numbered `fail_at` (from 0, over the engine's life) raises instead of enqueuing."""

    def __init__(self, c: rc.HybridCache, s: rc.Storage, fail_at: int | None = None) -> None:
        super().__init__(c, s)
        self.stream = Stream()
        self.fail_at = fail_at

    def _enqueue(self, c: Any) -> None:
        if self.stream.enqueued == self.fail_at:
            raise RuntimeError("CUDA error: launch failed")
        run_later = super()._enqueue  # the CPU copy, run when the stream gets to it
        self.stream.enqueue(c, lambda: run_later(c))

    def _wait_copies(self) -> None:
        self.stream.synchronize()

    def _record(self) -> Any:
        return Event(self.stream)

    def _passed(self, event: Any) -> bool:
        return bool(event.done)


def loaded_request(c: rc.HybridCache) -> rc.Request:
    """A request whose admission found its prefix on the host only."""
    e = rc.TransferEngine(c, storage(c))
    fill(c, [1, 2, 3, 4, 5, 6])
    e.run_pending()
    c.evict(kv_tokens=c.kv_slots, mamba_states=c.mamba_slots)
    e.run_pending()
    r = c.admit([1, 2, 3, 4, 5, 6, 7])
    assert r is not None
    assert r.host_len == 6
    return r


def grab_everything(c: rc.HybridCache) -> tuple[set[int], set[int]]:
    """What a second request gets: every free device KV slot and state slot."""
    kv = c.alloc_kv(c.available_kv())
    states = set()
    while (m := c.alloc_mamba()) is not None:
        states.add(m)
    return ({int(s) for s in kv} if kv is not None else set()), states


WAYS = ["run", "submit", "with batch: copy_batch"]


@pytest.mark.parametrize("way", WAYS)
def test_a_copy_failing_after_others_were_enqueued_frees_no_slot_they_still_write(
    way: str,
) -> None:
    """A load-back's KV copy is queued, then its state copy fails. The batch fails, its
    device slots go back to the cache and on to another request: only once the queued
    copy ran, else that copy would write a slot the other request owns."""
    c = cache()
    r = loaded_request(c)
    e = AsyncEngine(c, storage(c), fail_at=1)
    lb = c.load_back(r)
    assert lb is not None
    b = lb.batch
    assert [cp.pool for cp in b.copies][:2] == ["kv", "mamba"]
    with lb:
        if way == "run":
            assert e.run(b) is False
        elif way == "submit":
            e.submit(b)
        else:
            with pytest.raises(RuntimeError, match="launch failed"), b:  # noqa: PT012
                b.start()
                e.copy_batch(b)
        assert b.outcome == "failed"
    # The guard released: the load's slots are free, and a second request takes them.
    kv, states = grab_everything(c)
    assert kv & e.stream.pending_dst("kv", "device") == set(), "a queued copy writes a slot in use"
    assert states & e.stream.pending_dst("mamba", "device") == set()
    assert e.stream.queue == []
    c.abort(r)
    c.free_kv(sorted(kv))
    for s in states:
        c.free_mamba(s)
    settled(c)


def test_every_copy_is_checked_before_any_is_enqueued() -> None:
    c = cache()
    e = AsyncEngine(c, storage(c))
    good = SimpleNamespace(pool="kv", src_tier="device", dst_tier="host", src=[0, 1], dst=[2, 3])
    out_of_range = SimpleNamespace(
        pool="mamba", src_tier="device", dst_tier="host", src=[0], dst=[99]
    )
    uneven = SimpleNamespace(pool="kv", src_tier="device", dst_tier="host", src=[0, 1], dst=[2])
    no_tier = SimpleNamespace(pool="kv", src_tier="disk", dst_tier="host", src=[0], dst=[1])
    same_slot = SimpleNamespace(
        pool="mamba", src_tier="device", dst_tier="device", src=[1], dst=[1]
    )
    for bad, error, match in [
        (out_of_range, IndexError, r"^dst: slot out of range for the mamba pool on the host"),
        (uneven, ValueError, r"^copy: src and dst must list as many slots"),
        (no_tier, ValueError, r"^pool: this storage has no kv pool on the disk"),
        (same_slot, ValueError, r"^copy: reads and writes one slot of the mamba pool"),
    ]:
        with pytest.raises(error, match=match):
            e.copy_batch(SimpleNamespace(copies=[good, bad]))  # type: ignore[arg-type]
        assert e.stream.enqueued == 0, "a copy was enqueued before a later one was checked"


def test_a_device_lost_while_waiting_holds_the_batch_until_acknowledged_by_id() -> None:
    c = cache()
    r = loaded_request(c)
    e = AsyncEngine(c, storage(c), fail_at=1)
    e.stream.lost = True
    lb = c.load_back(r)
    assert lb is not None
    b = lb.batch
    assert e.run(b) is False
    # Its copies may run or not: nothing is freed, the batch stays started in flight.
    assert b.outcome is None
    assert e.held == [b]
    assert e.stats()["batches_held"] == 1
    assert e.last_error is not None
    assert "held" in e.last_error
    assert "device lost" in e.last_error
    assert c.pending_batches() == [(b.id, "load_back", True)]
    lb.release()
    assert c.stats()["batches_draining"] == 1
    c.fail(b.id)  # after a device reset: the copies can no longer run
    assert e.held == []
    c.abort(r)
    settled(c)


E = TypeVar("E", bound=AsyncEngine)


def two_submitted(kind: type[E]) -> tuple[rc.HybridCache, E, rc.TransferBatch, rc.TransferBatch]:
    """A cache, an asynchronous engine of `kind`, and two backups submitted, none run yet."""
    c = cache()
    e = kind(c, storage(c))
    fill(c, [1, 2])
    fill(c, [3, 4])
    b1, b2 = c.take_batches()
    e.submit(b1)
    e.submit(b2)
    return c, e, b1, b2


def test_submitted_batches_end_when_the_stream_passes_their_event() -> None:
    c, e, b1, b2 = two_submitted(AsyncEngine)
    assert e.in_flight == 2
    assert len(e.stream.queue) == 4  # nothing ran yet
    assert e.poll() == [b1, b2]
    assert (b1.outcome, b2.outcome) == ("completed", "completed")
    settled(c)


# ------------------------------------------------------- any exception is described


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("str() of this exception raises")


class Raising(rc.TransferEngine):
    def __init__(self, c: rc.HybridCache, s: rc.Storage, error: BaseException) -> None:
        super().__init__(c, s)
        self.error = error

    def copy_batch(self, batch: rc.TransferBatch) -> None:
        raise self.error


def test_an_exception_whose_str_raises_still_fails_the_batch() -> None:
    c = cache()
    e = Raising(c, storage(c), Unprintable())
    fill(c, [1, 2])
    (b,) = c.take_batches()
    assert e.run(b) is False
    assert b.outcome == "failed"
    assert b.reason is not None
    assert b.reason.startswith("Unprintable: ")
    assert e.last_error is not None
    assert "Unprintable" in e.last_error
    settled(c)


@pytest.mark.parametrize("how", ["run", "submit"])
def test_a_keyboard_interrupt_during_the_copies_fails_the_batch_then_propagates(how: str) -> None:
    c = cache()
    e = Raising(c, storage(c), KeyboardInterrupt())
    fill(c, [1, 2])
    (b,) = c.take_batches()
    with pytest.raises(KeyboardInterrupt):
        getattr(e, how)(b)
    assert b.outcome == "failed"
    assert b.reason == "KeyboardInterrupt"
    settled(c)


# ------------------------------------------------------- acknowledged elsewhere


@pytest.mark.parametrize("ack", ["complete", "fail"])
@pytest.mark.parametrize("end", ["poll", "synchronize"])
def test_a_batch_acknowledged_by_id_elsewhere_leaves_the_engines_other_batches_alone(
    ack: str, end: str
) -> None:
    c, e, b1, b2 = two_submitted(AsyncEngine)
    e.stream.synchronize()  # the copies ran; then a timeout acknowledges b1 by id
    getattr(c, ack)(b1.id)
    assert getattr(e, end)() == [b2]
    assert b2.outcome == "completed"
    assert e.in_flight == 0
    assert e.stats()["batches_ended_elsewhere"] == 1
    assert e.last_error is not None
    assert "acknowledged by id" in e.last_error
    assert e.poll() == []
    assert e.synchronize() == []
    settled(c)


def test_a_batch_acknowledged_by_id_while_run_copies_it_is_not_ended_twice() -> None:
    class AckedMeanwhile(rc.TransferEngine):
        def __init__(self, c: rc.HybridCache, s: rc.Storage, then_raise: bool) -> None:
            super().__init__(c, s)
            self.then_raise = then_raise

        def copy_batch(self, batch: rc.TransferBatch) -> None:
            self.cache.fail(batch.id)  # a timeout elsewhere
            if self.then_raise:
                raise RuntimeError("copy failed")

    for then_raise in (False, True):
        c = cache()
        e = AckedMeanwhile(c, storage(c), then_raise)
        fill(c, [1, 2])
        (b,) = c.take_batches()
        assert e.run(b) is False
        st = e.stats()
        assert (st["batches_ended_elsewhere"], st["batches_completed"]) == (1, 0)
        assert st["batches_failed"] == 0
        settled(c)


def test_an_event_that_cannot_be_queried_holds_its_batch_and_not_the_others() -> None:
    class BadEvent:
        @property
        def done(self) -> bool:
            raise RuntimeError("CUDA error: an illegal memory access")

    c, e, b1, b2 = two_submitted(AsyncEngine)
    e._in_flight[0].event = BadEvent()
    assert e.poll() == [b2]
    assert e.held == [b1]
    assert b1.outcome is None
    assert c.pending_batches() == [(b1.id, "backup", True)]
    assert e.in_flight == 0
    c.fail(b1.id)
    settled(c)


def test_a_wait_that_fails_in_synchronize_holds_every_batch_in_flight() -> None:
    c, e, b1, b2 = two_submitted(AsyncEngine)
    e.stream.lost = True
    assert e.synchronize() == []
    assert e.held == [b1, b2]
    assert (b1.outcome, b2.outcome) == (None, None)
    assert e.stats()["batches_held"] == 2
    assert e.in_flight == 0
    c.fail(b1.id)
    assert e.held == [b2]
    c.fail(b2.id)
    assert e.held == []
    settled(c)


def test_a_cache_refusing_a_batch_due_ends_the_others_then_raises() -> None:
    class Refusing(AsyncEngine):
        refuse = -1  # the id of the batch the cache refuses to complete

        def _complete(self, batch: rc.TransferBatch) -> bool:
            if batch.id == self.refuse:
                raise rc.CacheError("the cache is broken")
            return super()._complete(batch)

    c, e, b1, b2 = two_submitted(Refusing)
    e.refuse = b1.id
    with pytest.raises(rc.CacheError, match="broken"):
        e.poll()
    assert b2.outcome == "completed"
    assert e.held == [b1]
    assert e.in_flight == 0
    c.fail(b1.id)
    settled(c)


# ------------------------------------------------------- threads


@pytest.fixture
def fast_switching() -> Iterator[None]:
    """Switch threads as often as the interpreter can, to expose races."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def share_an_engine(threads: int, n: int) -> None:
    """`threads` threads submit `n` backups to one engine and poll it, all at once."""
    c = cache(kv_slots=2 * n, mamba_slots=0, host_kv_slots=2 * n, host_mamba_slots=0)
    e = rc.TransferEngine(c, rc.Storage.for_cache(c, layers=1, kv_heads=1, head_dim=2))
    for i in range(n):
        slots = c.alloc_kv(PS)
        assert slots is not None
        c.insert([i, i + n], slots)
    batches = c.take_batches()
    assert len(batches) == n
    todo = list(batches)
    take = threading.Lock()
    ended: list[int] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            while True:
                with take:
                    if not todo:
                        break
                    b = todo.pop()
                e.submit(b)
                ended.extend(x.id for x in e.poll())
            ended.extend(x.id for x in e.synchronize())
        except BaseException as ex:  # reported to the main thread
            errors.append(ex)

    workers = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(timeout=120)  # a watchdog: a hang fails instead of blocking the suite
    assert not any(t.is_alive() for t in workers), "a thread hung"
    assert errors == []
    ended.extend(x.id for x in e.synchronize())
    counts = Counter(ended)
    assert sorted(counts) == sorted(b.id for b in batches), "a submitted batch was lost"
    assert set(counts.values()) == {1}, "a batch ended twice"
    assert all(b.outcome == "completed" for b in batches)
    st = e.stats()
    assert (st["batches_submitted"], st["batches_completed"], st["copies"]) == (n, n, n)
    settled(c)


@pytest.mark.usefixtures("fast_switching")
def test_threads_sharing_an_engine_end_every_batch_exactly_once() -> None:
    for _ in range(2):
        share_an_engine(threads=8, n=1000)


# ------------------------------------------------------- a released load-back draining


def test_a_started_load_back_whose_guard_was_released_counts_as_draining() -> None:
    c = cache()
    r = loaded_request(c)
    lb = c.load_back(r)
    assert lb is not None
    b = lb.batch
    bid = b.id
    b.start()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        lb.release()
        del lb, b
        gc.collect()
    assert c.pending_batches() == [(bid, "load_back", True)]
    st = c.stats()
    assert st["batches_draining"] == 1
    assert st["kv_draining_slots"] > 0
    c.complete(bid)  # its copies are over
    assert c.stats()["batches_draining"] == 0
    c.abort(r)
    settled(c)


def test_the_stand_in_copies_only_when_its_stream_runs() -> None:
    """The stand-in's copies move real bytes, and only when its stream gets to them."""
    c = cache()
    s = storage(c)
    e = AsyncEngine(c, s)
    slots = c.alloc_kv(2)
    assert slots is not None
    s.kv["device"][0][:, slots] = np.float16(7.0)
    c.insert([1, 2], slots)
    (b,) = c.take_batches()
    e.submit(b)
    host_k = s.kv["host"][0]
    dst = [int(x) for x in b.copies[0].dst]
    assert not bool((host_k[:, dst] == 7.0).any()), "copied before the stream ran"
    assert e.synchronize() == [b]
    assert bool((host_k[:, dst] == 7.0).all())
    settled(c)
