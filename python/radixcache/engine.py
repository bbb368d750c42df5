"""TransferEngine: runs the cache's transfer batches on a `Storage`.

The core decides what to copy; the engine moves the bytes and acknowledges each batch.

What it promises, whatever goes wrong:

* **Only its own cache's batches.** A batch taken from another cache is refused before
  it starts (``ValueError`` naming ``batch``), and left as it was for its owner to run.
* **Checked before anything moves.** Every copy of a batch (its pools and tiers, index
  lengths and slot ranges) is checked before the first one is enqueued; a bad one fails
  the batch with nothing copied.
* **No slot freed under a queued copy.** A batch is started before any of its copies is
  enqueued, and once one is, no error frees its slots before the copy stream has passed
  it: the engine waits for the stream, then fails the batch (`copy_batch` does the same
  wait before it re-raises, so ``with batch: engine.copy_batch(batch)`` is safe). If even
  that wait fails (the device is lost), the batch is *held*: left started and in flight
  in the cache, its slots draining, until it is acknowledged by id (`held`).
* **Each batch ends once.** A failed copy is a miss, never a hit, and nothing is left
  half published; the cause goes to `last_error` (any exception, even one whose ``str()``
  raises). A submitted batch that was acknowledged by id through the cache meanwhile (a
  restart, a timeout) is dropped from the engine's books when it comes due; the others
  are not disturbed.
* **Thread-safe.** One engine may be shared by threads: its books (batches in flight,
  held batches, counters) are kept under a lock, which is never held while waiting for
  the device or running copies. A submitted batch is ended by exactly one `poll` or
  `synchronize` call, whichever thread makes it.

On a CPU-only machine (NumPy storage) every copy is synchronous NumPy indexing. With
GPU storage, copies run on the engine's copy stream: one ``copy_slots`` kernel launch
per copy of a batch (all layers and arrays of the pool at once, host memory read and
written through its mapped pointer) or, for large contiguous slot runs, batched
``cudaMemcpyAsync`` calls (the DMA path); everything a copy reads (its slot indices, the
pools' buffer tables) is uploaded on the copy stream itself. Ordering with compute, both
ways: give the engine the event (or stream) that ends the compute step with
`after_compute`; every copy enqueued afterwards waits for it, so a device-to-host copy
never reads a slot before the compute writing it finished, and a host-to-device copy
never overwrites a slot that compute still reads.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _kernels
from ._core import Copy, HybridCache, TransferBatch
from .storage import Pool, Storage

if TYPE_CHECKING:
    from .l3 import L3Tier

__all__ = ["TransferEngine"]


@dataclass(eq=False)
class _InFlight:
    batch: TransferBatch
    # Marks the batch's copies on the copy stream (None: they ran already); for an
    # l3_put, the Future of its write on the L3 tier's put worker thread.
    event: Any


@dataclass
class _Checked:
    """One copy of a batch, checked: its pools and its slot indices (copies, as checked)."""

    pool: str
    src_tier: str
    dst_tier: str
    src_pool: Pool
    dst_pool: Pool
    src: np.ndarray
    dst: np.ndarray


@dataclass
class _Plan:
    """How copies between two pools run on a GPU, worked out once per pair of pools."""

    src: Pool
    dst: Pool
    src_base: list[int]
    dst_base: list[int]
    src_stride: list[int]
    dst_stride: list[int]
    rows: list[int]
    #: Whether the kernel may touch both pools (else every copy takes the DMA path).
    reachable: bool
    #: The same per-buffer lists on the device, for the kernel (made on first use, on
    #: the copy stream that reads them).
    device: tuple[Any, ...] | None = None


_COUNTERS = (
    "batches_run",
    "batches_submitted",
    "batches_completed",
    "batches_failed",
    "batches_refused",
    "batches_ended_elsewhere",
    "batches_held",
    "copies",
    "slots_copied",
    "bytes_copied",
    "kernel_launches",
    "dma_copies",
    "dma_memcpys",
)


def _owned_by(batch: TransferBatch, cache: HybridCache) -> bool:
    """Whether `batch` is a batch of `cache` still in flight there.

    Asks the batch (``belongs_to``) where the binding can tell; otherwise looks its id up
    among the cache's pending batches. That is sound: a batch id carries the id of the
    cache that issued it, so no batch of another cache is ever listed.
    """
    belongs_to = getattr(batch, "belongs_to", None)
    if belongs_to is not None:
        return bool(belongs_to(cache))
    return any(bid == batch.id for bid, _kind, _started in cache.pending_batches())


def _describe(e: BaseException) -> str:
    """``"TypeName: message"`` for any exception, even one whose ``str()`` raises."""
    name = type(e).__name__
    try:
        text = str(e)
    except Exception:  # any exception object must be describable
        try:
            text = repr(e)
        except Exception:
            text = "<unprintable>"
    return f"{name}: {text}" if text else name


class TransferEngine:
    """Runs `cache`'s transfer batches on `storage` (thread-safe: see the module doc).

    Args:
        cache: The cache whose batches this engine runs.
        storage: The memory behind the cache's slots (checked against the cache).
        stream: On a GPU, the copy stream (default: a new non-blocking stream).
        l3: The L3 tier (`radixcache.l3.L3Tier`) that writes the ``l3_put`` batches
            this engine runs, a tier of this cache and storage; None: such a batch fails.

    Raises:
        TypeError: `cache` is not a `HybridCache`, `storage` not a `Storage`, or `l3`
            not an `L3Tier`.
        ValueError: The storage does not fit the cache (naming the cache's argument), or
            `l3` is another cache's or storage's tier.
    """

    def __init__(
        self, cache: HybridCache, storage: Storage, *, stream: Any = None, l3: L3Tier | None = None
    ) -> None:
        if not isinstance(cache, HybridCache):
            raise TypeError(f"cache: expected a HybridCache, got {type(cache).__name__}")
        if not isinstance(storage, Storage):
            raise TypeError(f"storage: expected a Storage, got {type(storage).__name__}")
        storage.check(cache)
        if l3 is not None:
            from .l3 import L3Tier

            if not isinstance(l3, L3Tier):
                raise TypeError(f"l3: expected an L3Tier, got {type(l3).__name__}")
            if l3.cache is not cache:
                raise ValueError("l3: a tier of another cache (its pages would be written from it)")
            if l3.storage is not storage:
                raise ValueError(
                    "l3: a tier of another storage (it would write bytes this engine never copied)"
                )
        self.cache = cache
        self.storage = storage
        self.l3 = l3
        self.on_gpu = storage.on_gpu
        self._stream = stream
        self._after: Any = None
        #: Guards the books below; never held while waiting for the device.
        self._lock = threading.Lock()
        self._in_flight: list[_InFlight] = []
        self._held: list[TransferBatch] = []
        self._plans: dict[tuple[int, int], _Plan] = {}
        self._stats: dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        #: Per thread: copies this thread enqueued so far (whether an error came after one).
        self._local = threading.local()
        self.last_error: str | None = None

    # ------------------------------------------------------------------ public API

    def run(self, batch: TransferBatch) -> bool:
        """Start `batch`, run its copies and wait for them, then complete it.

        A copy that raises fails the batch instead (the cause goes to `last_error`),
        once every copy of it already enqueued has run. Any other exception (a
        ``KeyboardInterrupt``) does the same, then propagates.

        Returns:
            True when the batch completed; False when it failed, was held (see `held`),
            or was acknowledged by id through the cache while its copies ran.

        Raises:
            ValueError: `batch` is not in flight in this engine's cache (taken from
                another cache, or ended already); it is left untouched.
            CacheError: `batch` was started already.
        """
        self._refuse_foreign(batch)
        batch.start()
        self._count("batches_run")
        mark = self._enqueued()
        try:
            self._wait_for_compute()
            self.copy_batch(batch)
            self._wait_copies()
        except BaseException as e:
            self._settle_failed(batch, e, self._enqueued() > mark)
            if not isinstance(e, Exception):
                raise
            return False
        return self._complete(batch)

    def submit(self, batch: TransferBatch) -> None:
        """Start `batch` and enqueue its copies; `poll()` or `synchronize()` ends it.

        The engine keeps the batch object until then. On CPU the copies run at once. A
        copy that raises fails the batch at once, waiting first for the copies of it
        already enqueued (as `run`).

        Raises:
            ValueError: `batch` is not in flight in this engine's cache; it is left
                untouched.
            CacheError: `batch` was started already.
        """
        self._refuse_foreign(batch)
        batch.start()
        self._count("batches_submitted")
        if batch.kind == "l3_put" and self.l3 is not None:
            # Written on the tier's put worker thread: the batch pins the host slots it
            # reads until it ends, so the caller goes on meanwhile.
            future = self.l3.start_write(batch, via=self.copy_batch)
            with self._lock:
                self._in_flight.append(_InFlight(batch, future))
            return
        mark = self._enqueued()
        try:
            self._wait_for_compute()
            self.copy_batch(batch)
            event = self._record()
        except BaseException as e:
            self._settle_failed(batch, e, self._enqueued() > mark)
            if not isinstance(e, Exception):
                raise
            return
        with self._lock:
            self._in_flight.append(_InFlight(batch, event))

    def poll(self) -> list[TransferBatch]:
        """Complete every submitted batch whose copies finished.

        A batch acknowledged by id through the cache meanwhile is dropped from the books
        (counted in ``batches_ended_elsewhere``). A batch whose event cannot be queried
        (a device error) is held (see `held`).

        Returns:
            The batches completed by this call, in submission order.

        Raises:
            CacheError: The cache refused to complete a batch still in flight there (a
                broken cache); every other batch due was ended first, and the refused
                one is held.
        """
        with self._lock:
            snapshot = list(self._in_flight)
        # Queried without the lock: an event query may take a while.
        passed = {id(f): self._query(f.event) for f in snapshot}
        due = [f for f in snapshot if passed[id(f)] is True]
        broken = {i: why for i, why in passed.items() if isinstance(why, str)}
        with self._lock:
            # Claim what is due and still in the books: another thread's poll may have
            # claimed it meanwhile, and each batch ends once.
            mine = {id(f) for f in due} | set(broken)
            claimed = [f for f in self._in_flight if id(f) in mine]
            self._in_flight = [f for f in self._in_flight if id(f) not in mine]
            for f in claimed:
                if id(f) in broken:
                    self._hold_locked(f.batch, broken[id(f)])
            due = [f for f in claimed if id(f) not in broken]
        outcomes = [(f.batch, self._end_due(f)) for f in due]
        errors = [e for _, e in outcomes if isinstance(e, Exception)]
        if errors:
            raise errors[0]  # once every batch due has ended
        return [b for b, done in outcomes if done is True]

    def synchronize(self) -> list[TransferBatch]:
        """Wait for every submitted batch, then end them all (see `poll`).

        If waiting fails (a device error), every batch in flight is held (see `held`):
        its copies may or may not have run.
        """
        with self._lock:
            waiting = bool(self._in_flight)
            writes = [f.event for f in self._in_flight if isinstance(f.event, Future)]
        wait(writes)
        if waiting:
            try:
                self._wait_copies()
            except Exception as e:  # a device error: hold the batches
                with self._lock:
                    for f in self._in_flight:
                        self._hold_locked(f.batch, f"waiting for its copies: {_describe(e)}")
                    self._in_flight = []
                return []
        return self.poll()

    def run_pending(self) -> int:
        """Take every batch the cache has queued and run each (`run`).

        Returns:
            How many batches completed.
        """
        return sum(self.run(b) for b in self.cache.take_batches())

    def after_compute(self, event: Any) -> None:
        """Make every copy enqueued from now on wait for `event` (a CuPy event or stream).

        Pass the event recorded after each compute step. On CPU, `event` is anything with
        a ``synchronize()`` method (called before each batch's copies), or None.
        """
        self._after = event

    @property
    def in_flight(self) -> int:
        """Submitted batches not yet ended."""
        with self._lock:
            return len(self._in_flight)

    @property
    def held(self) -> list[TransferBatch]:
        """Batches whose copies may still run and that the engine could not end.

        Their copies failed, or waiting for them failed (a lost device), after some were
        enqueued: the engine cannot tell whether they ran. They stay started and in
        flight in the cache (listed by ``pending_batches()``), their slots draining,
        until acknowledged by id (``cache.fail(batch.id)``, once the device is reset);
        then they leave this list.
        """
        pending = {bid for bid, _kind, _started in self.cache.pending_batches()}
        with self._lock:
            self._held = [b for b in self._held if b.id in pending]
            return list(self._held)

    def stats(self) -> dict[str, int]:
        """Return the counters.

        Batches run, submitted, completed and failed; refused (``batches_refused``: not
        in flight in this engine's cache, left untouched); ended elsewhere
        (``batches_ended_elsewhere``: acknowledged by id through the cache while the
        engine held them, then dropped from its books); held (``batches_held``: see
        `held`); copies, slots and bytes copied; on a GPU, kernel launches and DMA copies
        (with their memcpy calls).
        """
        with self._lock:
            return dict(self._stats)

    def __repr__(self) -> str:
        where = "cuda" if self.on_gpu else "cpu"
        with self._lock:
            s = self._stats
            return (
                f"<TransferEngine {where} completed={s['batches_completed']} "
                f"failed={s['batches_failed']} in_flight={len(self._in_flight)}"
                f"{f' held={len(self._held)}' if self._held else ''}>"
            )

    # ------------------------------------------------------------------ ending batches

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._stats[key] += n

    def _refuse_foreign(self, batch: TransferBatch) -> None:
        """Refuse, untouched, a batch that is not in flight in this engine's cache."""
        if not isinstance(batch, TransferBatch):
            raise TypeError(f"batch: expected a TransferBatch, got {type(batch).__name__}")
        if not _owned_by(batch, self.cache):
            self._count("batches_refused")
            raise ValueError(
                f"batch: {batch.id} is not in flight in this engine's cache (taken from"
                " another cache, or ended already); left untouched"
            )

    def _pending(self, batch: TransferBatch) -> bool:
        """Whether `batch` is still in flight in the cache (not acknowledged elsewhere)."""
        return any(bid == batch.id for bid, _kind, _started in self.cache.pending_batches())

    def _query(self, event: Any) -> bool | str:
        """Whether the stream passed `event`, or why that cannot be told (a device error)."""
        try:
            return self._passed(event)
        except Exception as e:  # a device error: the batch is held
            return f"waiting for its copies: {_describe(e)}"

    def _end_due(self, f: _InFlight) -> bool | Exception:
        """End a batch whose copies finished: failed if its write raised, else completed."""
        if isinstance(f.event, Future) and f.event.exception() is not None:
            error = f.event.exception()
            assert error is not None
            try:
                self._fail(f.batch, error)
            except Exception as e:  # the cache refused a batch in flight there
                with self._lock:
                    self._hold_locked(f.batch, f"failing it: {_describe(e)}")
                return e
            return False
        return self._complete_due(f.batch)

    def _complete_due(self, batch: TransferBatch) -> bool | Exception:
        """`_complete`, or the exception it raised (the batch is then held)."""
        try:
            return self._complete(batch)
        except Exception as e:  # the cache refused a batch in flight there
            with self._lock:
                self._hold_locked(batch, f"completing it: {_describe(e)}")
            return e

    def _complete(self, batch: TransferBatch) -> bool:
        """Complete `batch`; False (recorded) when it was acknowledged by id meanwhile.

        Raises:
            CacheError: The cache refused a batch still in flight there.
        """
        try:
            batch.complete()
        except Exception as e:
            if self._pending(batch):
                raise
            self._ended_elsewhere(batch, e)
            return False
        self._count("batches_completed")
        return True

    def _ended_elsewhere(self, batch: TransferBatch, e: BaseException) -> None:
        with self._lock:
            self._stats["batches_ended_elsewhere"] += 1
            self.last_error = (
                f"batch {batch.id} ({batch.kind}): acknowledged by id through the cache"
                f" before the engine ended it ({_describe(e)})"
            )

    def _settle_failed(self, batch: TransferBatch, e: BaseException, enqueued: bool) -> None:
        """Fail `batch` for `e`, once none of its enqueued copies can still run."""
        if enqueued:
            try:
                self._wait_copies()
            except Exception as w:  # the device is lost: hold the batch
                with self._lock:
                    self._hold_locked(
                        batch, f"{_describe(e)}; then waiting for its copies: {_describe(w)}"
                    )
                return
        self._fail(batch, e)

    def _fail(self, batch: TransferBatch, e: BaseException) -> None:
        """Fail `batch` for `e` (whose copies can no longer run); record the cause."""
        reason = _describe(e)
        try:
            batch.fail(reason)
        except Exception as why:
            if self._pending(batch):
                raise
            self._ended_elsewhere(batch, why)
            return
        with self._lock:
            self.last_error = f"batch {batch.id} ({batch.kind}): {reason}"
            self._stats["batches_failed"] += 1

    def _hold_locked(self, batch: TransferBatch, why: str) -> None:
        """Keep `batch` started and unended: its copies may still run (lock held)."""
        self._held.append(batch)
        self._stats["batches_held"] += 1
        self.last_error = f"batch {batch.id} ({batch.kind}) held, its copies may run: {why}"

    # ------------------------------------------------------------------ copies

    def copy_batch(self, batch: TransferBatch) -> None:
        """Enqueue (on CPU: run) the copies of a started batch, without ending it.

        Every copy is checked before the first is enqueued. If one raises after others
        were enqueued, the copy stream is waited for before the exception propagates, so
        the caller may fail the batch at once (``with batch:`` does).

        `run` and `submit` call it between `start` and `complete`; a subclass may wrap it
        (to inject faults, or to time copies). An exception from it fails the batch.

        An ``l3_put`` batch is written to the store by the engine's `l3` tier instead
        (the host arrays are read, the store is written): on the calling thread under
        `run`, on the tier's put worker thread under `submit` (`L3Tier.start_write`, which
        calls this method there).

        Raises:
            ValueError, IndexError: A copy names a pool or tier the storage lacks, slot
                lists of different lengths, or a slot out of range (nothing enqueued).
            L3Error: An ``l3_put`` batch's store call failed.
        """
        if getattr(batch, "kind", None) == "l3_put":
            if self.l3 is None:
                raise ValueError("batch: an l3_put batch, and this engine has no L3 tier (l3=)")
            self.l3.write(batch)
            return
        checked = [self._check(c) for c in batch.copies]
        mark = self._enqueued()
        try:
            for c in checked:
                self._mark_enqueued()
                self._enqueue(c)
        except BaseException:
            if self._enqueued() > mark:
                self._wait_copies()
            raise

    def _copy(self, c: Copy) -> None:
        """Check one copy, then enqueue it."""
        checked = self._check(c)
        self._mark_enqueued()
        self._enqueue(checked)

    def _check(self, c: Copy) -> _Checked:
        """Check one copy against the storage; the indices are copied as checked."""
        src_pool = self.storage.pool(c.pool, c.src_tier)
        dst_pool = self.storage.pool(c.pool, c.dst_tier)
        src = np.array(c.src, dtype=np.int64)
        dst = np.array(c.dst, dtype=np.int64)
        if src.ndim != 1 or src.shape != dst.shape:
            raise ValueError(
                f"copy: src and dst must list as many slots, got shapes {src.shape}, {dst.shape}"
            )
        _check_slots("src", src, src_pool, c.pool, c.src_tier)
        _check_slots("dst", dst, dst_pool, c.pool, c.dst_tier)
        if src_pool is dst_pool and np.intersect1d(src, dst).size:
            raise ValueError(f"copy: reads and writes one slot of the {c.pool} pool")
        return _Checked(c.pool, c.src_tier, c.dst_tier, src_pool, dst_pool, src, dst)

    def _enqueued(self) -> int:
        """Return how many copies this thread enqueued so far."""
        return int(getattr(self._local, "enqueued", 0))

    def _mark_enqueued(self) -> None:
        """Count a copy as enqueued (before it is: a partial enqueue counts)."""
        self._local.enqueued = self._enqueued() + 1

    def _enqueue(self, c: _Checked) -> None:
        """Enqueue one checked copy on the copy stream (on CPU: run it)."""
        if self.on_gpu:
            self._gpu_copy(self._plan(c), c.src, c.dst)
        else:
            for s_arr, d_arr in zip(c.src_pool.arrays, c.dst_pool.arrays):
                d_arr[:, c.dst] = s_arr[:, c.src]
        n = len(c.src)
        with self._lock:
            self._stats["copies"] += 1
            self._stats["slots_copied"] += n
            self._stats["bytes_copied"] += n * c.src_pool.bytes_per_slot

    def _wait_copies(self) -> None:
        """Block until every copy enqueued so far has run (on CPU they have)."""
        if self.on_gpu:
            self._copy_stream().synchronize()

    def _record(self) -> Any:
        """Return an event marking the copies enqueued so far (None: they ran already)."""
        return self._copy_stream().record() if self.on_gpu else None

    def _passed(self, event: Any) -> bool:
        """Whether the copy stream has passed `event` (from `_record`), or the write ended."""
        if isinstance(event, Future):
            return event.done()
        return event is None or bool(event.done)

    def _plan(self, c: _Checked) -> _Plan:
        src_pool, dst_pool = c.src_pool, c.dst_pool
        plan = self._plans.get((id(src_pool), id(dst_pool)))
        if plan is None:
            src_bufs, dst_bufs = src_pool.buffers, dst_pool.buffers
            plan = _Plan(
                src=src_pool,  # kept: the key's ids stay theirs while the plan lives
                dst=dst_pool,
                src_base=[b[0] for b in src_bufs],
                dst_base=[b[0] for b in dst_bufs],
                src_stride=[b[1] for b in src_bufs],
                dst_stride=[b[1] for b in dst_bufs],
                rows=[b[2] for b in src_bufs],
                reachable=_reachable(src_pool, c.src_tier) and _reachable(dst_pool, c.dst_tier),
            )
            self._plans[id(src_pool), id(dst_pool)] = plan
        return plan

    def _gpu_copy(self, plan: _Plan, src: np.ndarray, dst: np.ndarray) -> None:
        if not len(src) or not plan.rows:
            return
        stream = self._copy_stream()
        runs = _kernels.contiguous_runs(src, dst)
        mean_row = sum(plan.rows) // len(plan.rows)
        if not plan.reachable or _kernels.choose_path(mean_row, len(src), len(runs)) == "dma":
            self._count("dma_copies")
            self._count(
                "dma_memcpys",
                _kernels.dma_copy_slots(
                    plan.src_base,
                    plan.dst_base,
                    plan.src_stride,
                    plan.dst_stride,
                    plan.rows,
                    src.tolist(),
                    dst.tolist(),
                    stream=stream,
                ),
            )
            return
        cupy = _kernels._cupy()
        # Uploaded on the copy stream that reads them: stream order puts every upload
        # before the kernel, and the memory pool reuses their blocks on that stream only.
        with stream:
            device = plan.device
            if device is None:
                device = (
                    cupy.asarray(plan.src_base, dtype=cupy.uint64),
                    cupy.asarray(plan.dst_base, dtype=cupy.uint64),
                    cupy.asarray(plan.src_stride, dtype=cupy.int64),
                    cupy.asarray(plan.dst_stride, dtype=cupy.int64),
                    cupy.asarray(plan.rows, dtype=cupy.int64),
                )
                plan.device = device
            src_d = cupy.asarray(src)
            dst_d = cupy.asarray(dst)
        src_base, dst_base, src_stride, dst_stride, row_bytes = device
        _kernels.launch_copy_slots(
            src_base,
            dst_base,
            src_stride,
            dst_stride,
            row_bytes,
            src_d,
            dst_d,
            stream=stream,
            max_row_bytes=max(plan.rows),
        )
        self._count("kernel_launches")

    def _wait_for_compute(self) -> None:
        """Make the copy stream wait for the compute step given to `after_compute`.

        On CPU the wait is on the host: ``synchronize()`` on the event or stream (a
        CPU stand-in for a compute stream, such as the serving package's).
        """
        if self._after is None:
            return
        after = self._after
        if not self.on_gpu:
            after.synchronize()
            return
        if hasattr(after, "record"):  # a stream: wait for everything enqueued on it so far
            after = after.record()
        self._copy_stream().wait_event(after)

    def _copy_stream(self) -> Any:
        with self._lock:
            if self._stream is None:
                self._stream = _kernels._cupy().cuda.Stream(non_blocking=True)
            return self._stream


def _reachable(pool: Pool, tier: str) -> bool:
    """Whether the copy kernel may touch the pool: GPU memory, or pinned mapped host."""
    return pool.on_gpu or (tier == "host" and pool.pinned)


def _check_slots(which: str, idx: np.ndarray, pool: Pool, name: str, tier: str) -> None:
    if len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= pool.slots):
        raise IndexError(
            f"{which}: slot out of range for the {name} pool on the {tier} ({pool.slots} slots)"
        )
