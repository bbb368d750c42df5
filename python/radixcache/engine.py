"""TransferEngine: runs the cache's transfer batches on a `Storage`.

The core decides what to copy; the engine moves the bytes and acknowledges each batch.
It always starts a batch before any of its copies is enqueued, so a batch whose owner
lets go of it while its copies may run stays in flight (holding its slots) instead of
freeing them. Any exception in a copy (a bad index, a CUDA error, an injected fault)
fails the batch, with the cause kept in `stats()`: a failed copy is a miss, never a
hit, and nothing is left half published.

On a CPU-only machine (NumPy storage) every copy is synchronous NumPy indexing. With
GPU storage, copies run on the engine's copy stream: one ``copy_slots`` kernel launch
per copy of a batch (all layers and arrays of the pool at once, host memory read and
written through its mapped pointer) or, for large contiguous slot runs, batched
``cudaMemcpyAsync`` calls (the DMA path). Ordering with compute, both ways: give the
engine the event (or stream) that ends the compute step with `after_compute`; every copy
enqueued afterwards waits for it, so a device-to-host copy never reads a slot before
the compute writing it finished, and a host-to-device copy never overwrites a slot that
compute still reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _kernels
from ._core import Copy, HybridCache, TransferBatch
from .storage import Pool, Storage

__all__ = ["TransferEngine"]


@dataclass
class _InFlight:
    batch: TransferBatch
    event: Any  # cupy.cuda.Event recorded after the batch's copies (None on CPU)


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
    #: The same per-buffer lists on the device, for the kernel (made on first use).
    device: tuple[Any, ...] | None = None


class TransferEngine:
    """Runs `cache`'s transfer batches on `storage`.

    Args:
        cache: The cache whose batches this engine runs.
        storage: The memory behind the cache's slots (checked against the cache).
        stream: On a GPU, the copy stream (default: a new non-blocking stream).

    Raises:
        ValueError: The storage does not fit the cache (naming the cache's argument).
    """

    def __init__(self, cache: HybridCache, storage: Storage, *, stream: Any = None) -> None:
        storage.check(cache)
        self.cache = cache
        self.storage = storage
        self.on_gpu = storage.on_gpu
        self._stream = stream
        self._after: Any = None
        self._in_flight: list[_InFlight] = []
        self._plans: dict[tuple[int, int], _Plan] = {}
        self._stats: dict[str, int] = dict.fromkeys(
            (
                "batches_run",
                "batches_submitted",
                "batches_completed",
                "batches_failed",
                "copies",
                "slots_copied",
                "bytes_copied",
                "kernel_launches",
                "dma_copies",
                "dma_memcpys",
            ),
            0,
        )
        self.last_error: str | None = None

    # ------------------------------------------------------------------ public API

    def run(self, batch: TransferBatch) -> bool:
        """Start `batch`, run its copies and wait for them, then complete it.

        A copy that raises fails the batch instead (the cause goes to `last_error`).

        Returns:
            True when the batch completed, False when it failed.

        Raises:
            CacheError, ValueError: `batch` cannot be started (it was started or ended
                already).
        """
        batch.start()
        self._stats["batches_run"] += 1
        try:
            self._wait_for_compute()
            self.copy_batch(batch)
            if self.on_gpu:
                self._copy_stream().synchronize()
        except Exception as e:
            self._fail(batch, e)
            return False
        batch.complete()
        self._stats["batches_completed"] += 1
        return True

    def submit(self, batch: TransferBatch) -> None:
        """Start `batch` and enqueue its copies; `poll()` or `synchronize()` ends it.

        The engine keeps the batch object until then. On CPU the copies run at once.

        Raises:
            CacheError, ValueError: `batch` cannot be started.
        """
        batch.start()
        self._stats["batches_submitted"] += 1
        try:
            self._wait_for_compute()
            self.copy_batch(batch)
            event = self._record() if self.on_gpu else None
        except Exception as e:
            self._fail(batch, e)
            return
        self._in_flight.append(_InFlight(batch, event))

    def poll(self) -> list[TransferBatch]:
        """Complete every submitted batch whose copies finished; fail broken ones.

        Returns:
            The batches ended by this call, in submission order.
        """
        ended: list[TransferBatch] = []
        keep: list[_InFlight] = []
        for f in self._in_flight:
            try:
                done = f.event is None or bool(f.event.done)
            except Exception as e:
                self._fail(f.batch, e)
                ended.append(f.batch)
                continue
            if not done:
                keep.append(f)
                continue
            f.batch.complete()
            self._stats["batches_completed"] += 1
            ended.append(f.batch)
        self._in_flight = keep
        return ended

    def synchronize(self) -> list[TransferBatch]:
        """Wait for every submitted batch, then end them all (see `poll`)."""
        if self.on_gpu and self._in_flight:
            try:
                self._copy_stream().synchronize()
            except Exception as e:
                for f in self._in_flight:
                    self._fail(f.batch, e)
                ended = [f.batch for f in self._in_flight]
                self._in_flight = []
                return ended
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
        return len(self._in_flight)

    def stats(self) -> dict[str, int]:
        """Return the counters.

        Batches run, submitted, completed and failed; copies, slots and bytes copied; on
        a GPU, kernel launches and DMA copies (with their memcpy calls).
        """
        return dict(self._stats)

    def __repr__(self) -> str:
        where = "cuda" if self.on_gpu else "cpu"
        s = self._stats
        return (
            f"<TransferEngine {where} completed={s['batches_completed']} "
            f"failed={s['batches_failed']} in_flight={len(self._in_flight)}>"
        )

    # ------------------------------------------------------------------ copies

    def _fail(self, batch: TransferBatch, e: BaseException) -> None:
        reason = f"{type(e).__name__}: {e}"
        self.last_error = f"batch {batch.id} ({batch.kind}): {reason}"
        self._stats["batches_failed"] += 1
        batch.fail(reason)

    def copy_batch(self, batch: TransferBatch) -> None:
        """Enqueue (on CPU: run) the copies of a started batch, without ending it.

        `run` and `submit` call it between `start` and `complete`; a subclass may wrap it
        (to inject faults, or to time copies). An exception from it fails the batch.
        """
        for c in batch.copies:
            self._copy(c)

    def _copy(self, c: Copy) -> None:
        src_pool = self.storage.pool(c.pool, c.src_tier)
        dst_pool = self.storage.pool(c.pool, c.dst_tier)
        src = np.asarray(c.src, dtype=np.int64)
        dst = np.asarray(c.dst, dtype=np.int64)
        _check_slots("src", src, src_pool, c.pool, c.src_tier)
        _check_slots("dst", dst, dst_pool, c.pool, c.dst_tier)
        if self.on_gpu:
            self._gpu_copy(self._plan(c, src_pool, dst_pool), src, dst)
        else:
            for s_arr, d_arr in zip(src_pool.arrays, dst_pool.arrays):
                d_arr[:, dst] = s_arr[:, src]
        self._stats["copies"] += 1
        self._stats["slots_copied"] += len(src)
        self._stats["bytes_copied"] += len(src) * src_pool.bytes_per_slot

    def _plan(self, c: Copy, src_pool: Pool, dst_pool: Pool) -> _Plan:
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
            self._stats["dma_copies"] += 1
            self._stats["dma_memcpys"] += _kernels.dma_copy_slots(
                plan.src_base,
                plan.dst_base,
                plan.src_stride,
                plan.dst_stride,
                plan.rows,
                src.tolist(),
                dst.tolist(),
                stream=stream,
            )
            return
        cupy = _kernels._cupy()
        if plan.device is None:
            plan.device = (
                cupy.asarray(plan.src_base, dtype=cupy.uint64),
                cupy.asarray(plan.dst_base, dtype=cupy.uint64),
                cupy.asarray(plan.src_stride, dtype=cupy.int64),
                cupy.asarray(plan.dst_stride, dtype=cupy.int64),
                cupy.asarray(plan.rows, dtype=cupy.int64),
            )
        with stream:
            src_d = cupy.asarray(src)
            dst_d = cupy.asarray(dst)
        src_base, dst_base, src_stride, dst_stride, row_bytes = plan.device
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
        self._stats["kernel_launches"] += 1

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
        if self._stream is None:
            self._stream = _kernels._cupy().cuda.Stream(non_blocking=True)
        return self._stream

    def _record(self) -> Any:
        return self._copy_stream().record()


def _reachable(pool: Pool, tier: str) -> bool:
    """Whether the copy kernel may touch the pool: GPU memory, or pinned mapped host."""
    return pool.on_gpu or (tier == "host" and pool.pinned)


def _check_slots(which: str, idx: np.ndarray, pool: Pool, name: str, tier: str) -> None:
    if len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= pool.slots):
        raise IndexError(
            f"{which}: slot out of range for the {name} pool on the {tier} ({pool.slots} slots)"
        )
