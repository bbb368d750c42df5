"""Bandwidth of Mamba state copies: device <-> pinned host and device -> device.

What is measured: copies of whole Mamba state slots (every layer's conv and SSM row) of a
``radixcache.Storage`` (``for_model``, no KV pool), for two model shapes:

- ``small``: 18 layers, SSM 2x16x16 float32, conv 288x3 bfloat16 (67,968 B per slot);
- ``large``: 36 layers, SSM 32x128x128 float32, conv 8192x3 bfloat16 (77,266,944 B per
  slot, about 77 MB over all layers).

Directions: ``d2h`` (device pool to host pool), ``h2d`` (host pool to device pool), ``d2d``
(device pool to other slots of the same pool). Slots per copy: 1, 8, 64. Slot sets:
``contiguous`` (source slots k..k+n-1 to destination slots m..m+n-1) and ``scattered``
(distinct random slots, fixed seed). Paths on a GPU (``--device cuda``):

- ``kernel``: one ``radixcache._kernels.launch_copy_slots`` launch for every (slot,
  buffer); its index arrays are uploaded before the timing (an engine uploads 16 bytes
  per slot with each batch; not timed here);
- ``dma``: ``radixcache._kernels.dma_copy_slots``, one ``cudaMemcpyAsync`` per run of
  consecutive slots and buffer (its Python-side work is timed);
- ``memcpy each``: the baseline, one ``cudaMemcpyAsync`` per (slot, buffer) whatever the
  contiguity, addresses computed before the timing: what an engine without batching does.

A buffer is one array of one layer, so a slot is ``2 * layers`` rows. The peak of a
direction is one large ``cudaMemcpyAsync`` (1 GiB, or the largest pool if smaller) between
buffers of the same kinds (device memory, pinned host memory). Every timing is the median
of ``--repeat`` runs, after one warm-up run (which also compiles the kernel): on one
non-blocking stream, record an event, enqueue the copy, record an event, synchronize,
``cupy.cuda.get_elapsed_time``. The span includes the host-side enqueueing when the GPU
waits for it (a loop of 2,304 ``cudaMemcpyAsync`` calls costs what it costs).

``--device cpu`` runs the same table on NumPy storage, both tiers ordinary memory, with the
CPU engine's copy (``dst[:, d] = src[:, s]`` for each array of the pool, path ``numpy``)
timed with ``time.perf_counter``; the peak is one ``numpy.copyto`` of the same byte count.
GPU-only columns show ``-`` and the goals are ``n/a (no GPU)``.

Correctness: once per row of the table (after the warm-up), random bytes are written to a
sample of the source rows (first, middle and last slot of the batch; first, middle and last
layer; both arrays), their complement to the matching destination rows; the path copies,
and the destination rows are compared with numpy. A mismatch (or an exception) prints
``FAIL`` in the ``check`` column, no timing for that row, and makes the exit status 1.

Output (stdout; progress goes to stderr): a header line, the peak line, one line per shape,
the table (columns: shape, dir, set, n, path, calls = CUDA API calls per copy: kernel
launches or memcpy calls, MB/copy = n x bytes per slot / 1e6, ms/copy = median time of one
copy, GB/s = bytes moved / seconds / 1e9, %peak = GB/s / the direction's peak, check = ok or
FAIL), then the goal lines:

(a) large contiguous state copies >= 90% of peak: for large, contiguous, 64 slots, the best
    of kernel and dma, per direction;
(b) 64 scattered small states in one launch >= 3x faster than 64 separate
    cudaMemcpyAsync: small, scattered, 64 slots, memcpy-each time / kernel time, per
    direction.

Usage::

    python benches/copy_bandwidth.py [--device cuda|cpu] [--repeat N] [--quick] [--json]
                                     [--plot PATH] [--check]

``--quick``: large gets 1 and 8 slots only (goal (a) is then not measured), 3 repeats unless
``--repeat`` is given. ``--json``: one JSON object instead of the text. ``--plot PATH``: a
PNG of GB/s (needs matplotlib). ``--check``: also exit 1 when a goal fails. Exit status: 0,
1 on a check failure (or a failed goal with ``--check``), 2 on a usage problem (no GPU with
``--device cuda``, ``--plot`` without matplotlib).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

import radixcache as rc
from radixcache import _kernels
from radixcache.storage import Pool

DIRECTIONS = ("d2h", "h2d", "d2d")
SETS = ("contiguous", "scattered")
GPU_PATHS = ("kernel", "dma", "memcpy each")
CPU_PATHS = ("numpy",)
#: Slots each pool has beyond what the largest copy needs.
SLACK = 4
PEAK_MAX_BYTES = 1 << 30
SEED = 20240607
PEAK_GOAL = 0.9
SPEEDUP_GOAL = 3.0
GOAL_A = "large contiguous state copies >= 90% of peak"
GOAL_B = "64 scattered small states in one launch >= 3x faster than 64 separate cudaMemcpyAsync"
QUICK_REPEAT = 3
FULL_REPEAT = 20

CopyFn = Callable[[], object]
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Shape:
    """A model's Mamba state: per-layer SSM and conv shapes, and the batch sizes run."""

    name: str
    layers: int
    ssm_shape: tuple[int, ...]
    conv_shape: tuple[int, ...]
    ns: tuple[int, ...]
    quick_ns: tuple[int, ...]

    @property
    def bytes_per_slot(self) -> int:
        """Bytes of one slot over every layer (SSM float32, conv bfloat16)."""
        return self.layers * (math.prod(self.ssm_shape) * 4 + math.prod(self.conv_shape) * 2)

    def describe(self) -> str:
        """One line: the shape, bytes per slot and buffers."""
        ssm = "x".join(map(str, self.ssm_shape))
        conv = "x".join(map(str, self.conv_shape))
        return (
            f"{self.name}: {self.layers} layers, ssm {ssm} float32, conv {conv} bfloat16:"
            f" {self.bytes_per_slot} B per slot, {2 * self.layers} buffers"
        )


SHAPES = (
    Shape("small", 18, (2, 16, 16), (288, 3), (1, 8, 64), (1, 8, 64)),
    Shape("large", 36, (32, 128, 128), (8192, 3), (1, 8, 64), (1, 8)),
)


@dataclass
class Row:
    """One measured configuration: a path copying n slots of a shape in a direction."""

    shape: str
    direction: str
    slot_set: str
    n: int
    path: str
    calls: int | None  # CUDA API calls per copy (None on CPU)
    bytes: int
    ms: float | None  # None when the check failed
    gbps: float | None
    peak_fraction: float | None
    check: str  # "ok" or "FAIL"
    check_detail: str = ""


@dataclass
class Goal:
    """A goal evaluated on one direction of this run's numbers."""

    goal: str  # "a" or "b"
    text: str
    direction: str
    status: str  # "PASS", "FAIL" or "n/a"
    value: float | None  # fraction of peak (a) or speedup (b)
    detail: str


class Backend(Protocol):
    """Where the storage lives and how its copies run and are timed."""

    name: str
    paths: tuple[str, ...]

    def describe(self) -> dict[str, Any]:
        """Versions and device name for the header."""
        ...

    def storage(self, shape: Shape, device_slots: int, host_slots: int) -> rc.Storage:
        """Allocate a shape's Mamba pools on both tiers, every byte touched."""
        ...

    def prepare(self, src: Pool, dst: Pool) -> Any:
        """Return what the copies of one direction share (buffer lists, device metadata)."""
        ...

    def copy_fn(self, path: str, prep: Any, src_idx: IntArray, dst_idx: IntArray) -> CopyFn:
        """Return a function that enqueues one copy and returns its calls (or None)."""
        ...

    def finish(self) -> None:
        """Wait for the enqueued copies."""
        ...

    def settle(self) -> None:
        """Wait for everything on the device (after writing stamps)."""
        ...

    def write_row(self, arr: Any, layer: int, slot: int, data: npt.NDArray[np.uint8]) -> None:
        """Write the bytes of one slot's row in one layer."""
        ...

    def read_row(self, arr: Any, layer: int, slot: int) -> npt.NDArray[np.uint8]:
        """Read the bytes of one slot's row in one layer."""
        ...

    def time_ms(self, fn: CopyFn, repeat: int) -> float:
        """Return the median time of `fn` in ms over `repeat` runs."""
        ...

    def peaks(self, nbytes: int, repeat: int) -> dict[str, float]:
        """Return the median ms of one `nbytes` copy per direction."""
        ...

    def release(self) -> None:
        """Return freed memory to the system."""
        ...


def _row_view(arr: Any, layer: int, slot: int) -> Any:
    return arr[layer, slot].reshape(-1).view(np.uint8)


class CpuBackend:
    """NumPy storage on both tiers, copied the way the CPU engine copies."""

    name = "cpu"
    paths: tuple[str, ...] = CPU_PATHS

    def describe(self) -> dict[str, Any]:
        """Versions for the header."""
        return {"device_name": f"{platform.machine()}, {os.cpu_count()} CPUs"}

    def storage(self, shape: Shape, device_slots: int, host_slots: int) -> rc.Storage:
        """Allocate NumPy pools and write every byte (no untouched zero pages)."""
        storage = _for_model(shape, device_slots, host_slots, "cpu")
        for tier in ("device", "host"):
            for a in storage.pool("mamba", tier).arrays:
                a.fill(1)
        return storage

    def prepare(self, src: Pool, dst: Pool) -> Any:
        """Return the pools' arrays, paired."""
        return list(zip(src.arrays, dst.arrays))

    def copy_fn(self, path: str, prep: Any, src_idx: IntArray, dst_idx: IntArray) -> CopyFn:
        """Return the CPU engine's copy: ``d[:, dst] = s[:, src]`` per array."""
        pairs: list[tuple[Any, Any]] = prep

        def copy() -> None:
            for s_arr, d_arr in pairs:
                d_arr[:, dst_idx] = s_arr[:, src_idx]

        return copy

    def finish(self) -> None:
        """Nothing to wait for."""

    def settle(self) -> None:
        """Nothing to wait for."""

    def write_row(self, arr: Any, layer: int, slot: int, data: npt.NDArray[np.uint8]) -> None:
        """Write one row's bytes."""
        _row_view(arr, layer, slot)[...] = data

    def read_row(self, arr: Any, layer: int, slot: int) -> npt.NDArray[np.uint8]:
        """Copy one row's bytes out."""
        return np.array(_row_view(arr, layer, slot), copy=True)

    def time_ms(self, fn: CopyFn, repeat: int) -> float:
        """Median wall time of `fn` in ms (``time.perf_counter``)."""
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def peaks(self, nbytes: int, repeat: int) -> dict[str, float]:
        """One ``numpy.copyto`` of `nbytes` per direction (all ordinary memory)."""
        src = np.ones(nbytes, dtype=np.uint8)
        dst = np.ones(nbytes, dtype=np.uint8)
        fn = functools.partial(np.copyto, dst, src)
        out = {}
        for d in DIRECTIONS:
            fn()
            out[d] = self.time_ms(fn, repeat)
        return out

    def release(self) -> None:
        """Nothing pooled."""


class CudaBackend:
    """CuPy device pools and pinned mapped host pools; one non-blocking stream."""

    name = "cuda"
    paths: tuple[str, ...] = GPU_PATHS

    def __init__(self) -> None:
        self.cp: Any = _kernels._cupy()
        count = int(self.cp.cuda.runtime.getDeviceCount())  # raises without a driver
        if count == 0:
            raise RuntimeError("no CUDA device")
        self.cp.cuda.Device(0).use()
        self.rt: Any = self.cp.cuda.runtime
        self.stream: Any = self.cp.cuda.Stream(non_blocking=True)
        self.start: Any = self.cp.cuda.Event()
        self.end: Any = self.cp.cuda.Event()

    def describe(self) -> dict[str, Any]:
        """GPU name, CUDA runtime and driver versions, CuPy version."""
        name = self.rt.getDeviceProperties(0)["name"]
        if isinstance(name, bytes):
            name = name.decode()
        return {
            "device_name": str(name),
            "cuda_runtime": _cuda_version(int(self.rt.runtimeGetVersion())),
            "cuda_driver": _cuda_version(int(self.rt.driverGetVersion())),
            "cupy": str(self.cp.__version__),
        }

    def storage(self, shape: Shape, device_slots: int, host_slots: int) -> rc.Storage:
        """Allocate CuPy device pools and pinned (zeroed, so touched) host pools."""
        return _for_model(shape, device_slots, host_slots, "cuda")

    def prepare(self, src: Pool, dst: Pool) -> Any:
        """Buffer lists for the DMA paths and their CuPy arrays for the kernel."""
        cp = self.cp
        sb, db = src.buffers, dst.buffers
        lists = (
            [b[0] for b in sb],
            [b[0] for b in db],
            [b[1] for b in sb],
            [b[1] for b in db],
            [b[2] for b in sb],
        )
        dev = (
            cp.asarray(lists[0], dtype=cp.uint64),
            cp.asarray(lists[1], dtype=cp.uint64),
            cp.asarray(lists[2], dtype=cp.int64),
            cp.asarray(lists[3], dtype=cp.int64),
            cp.asarray(lists[4], dtype=cp.int64),
        )
        self.settle()
        return lists, dev, max(lists[4])

    def copy_fn(self, path: str, prep: Any, src_idx: IntArray, dst_idx: IntArray) -> CopyFn:
        """One copy on the benchmark's stream by `path`; returns its CUDA calls."""
        lists, (sb_d, db_d, ss_d, ds_d, rows_d), max_row = prep
        src_base, dst_base, src_stride, dst_stride, row_bytes = lists
        stream = self.stream
        if path == "kernel":
            src_d = self.cp.asarray(src_idx)
            dst_d = self.cp.asarray(dst_idx)
            self.settle()

            def kernel() -> int:
                _kernels.launch_copy_slots(
                    sb_d,
                    db_d,
                    ss_d,
                    ds_d,
                    rows_d,
                    src_d,
                    dst_d,
                    stream=stream,
                    max_row_bytes=int(max_row),
                )
                return 1

            return kernel
        src_list, dst_list = src_idx.tolist(), dst_idx.tolist()
        if path == "dma":
            return functools.partial(
                _kernels.dma_copy_slots,
                src_base,
                dst_base,
                src_stride,
                dst_stride,
                row_bytes,
                src_list,
                dst_list,
                stream=stream,
            )
        if path != "memcpy each":
            raise ValueError(f"unknown path {path!r}")
        copies = [
            (d_base + d * d_stride, s_base + s * s_stride, nbytes)
            for s, d in zip(src_list, dst_list)
            for s_base, d_base, s_stride, d_stride, nbytes in zip(
                src_base, dst_base, src_stride, dst_stride, row_bytes
            )
        ]
        memcpy, kind, stream_ptr = self.rt.memcpyAsync, self.rt.memcpyDefault, int(stream.ptr)

        def each() -> int:
            for dst, src, nbytes in copies:
                memcpy(dst, src, nbytes, kind, stream_ptr)
            return len(copies)

        return each

    def finish(self) -> None:
        """Wait for the benchmark's stream."""
        self.stream.synchronize()

    def settle(self) -> None:
        """Wait for the whole device (CuPy's writes run on the legacy default stream)."""
        self.rt.deviceSynchronize()

    def write_row(self, arr: Any, layer: int, slot: int, data: npt.NDArray[np.uint8]) -> None:
        """Write one row's bytes (device rows through CuPy)."""
        view = _row_view(arr, layer, slot)
        view[...] = data if isinstance(arr, np.ndarray) else self.cp.asarray(data)

    def read_row(self, arr: Any, layer: int, slot: int) -> npt.NDArray[np.uint8]:
        """Copy one row's bytes to a NumPy array."""
        view = _row_view(arr, layer, slot)
        if isinstance(arr, np.ndarray):
            return np.array(view, copy=True)
        out: npt.NDArray[np.uint8] = self.cp.asnumpy(view)
        return out

    def time_ms(self, fn: CopyFn, repeat: int) -> float:
        """Median ms between CUDA events recorded around `fn` on the stream."""
        times = []
        for _ in range(repeat):
            self.start.record(self.stream)
            fn()
            self.end.record(self.stream)
            self.end.synchronize()
            times.append(float(self.cp.cuda.get_elapsed_time(self.start, self.end)))
        return statistics.median(times)

    def peaks(self, nbytes: int, repeat: int) -> dict[str, float]:
        """One `nbytes` ``cudaMemcpyAsync`` per direction, device and pinned buffers."""
        cp = self.cp
        a = cp.ones(nbytes, dtype=cp.uint8)
        b = cp.ones(nbytes, dtype=cp.uint8)
        pinned = cp.cuda.alloc_pinned_memory(nbytes)
        np.frombuffer(pinned, dtype=np.uint8, count=nbytes).fill(1)
        self.settle()
        ends = {
            "d2h": (int(a.data.ptr), int(pinned.ptr)),
            "h2d": (int(pinned.ptr), int(a.data.ptr)),
            "d2d": (int(a.data.ptr), int(b.data.ptr)),
        }
        out = {}
        for d in DIRECTIONS:
            src, dst = ends[d]
            fn = functools.partial(
                self.rt.memcpyAsync, dst, src, nbytes, self.rt.memcpyDefault, int(self.stream.ptr)
            )
            fn()
            self.finish()
            out[d] = self.time_ms(fn, repeat)
        del a, b, pinned
        self.release()
        return out

    def release(self) -> None:
        """Free CuPy's cached device and pinned blocks."""
        self.settle()
        self.cp.get_default_memory_pool().free_all_blocks()
        self.cp.get_default_pinned_memory_pool().free_all_blocks()


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def _for_model(shape: Shape, device_slots: int, host_slots: int, device: str) -> rc.Storage:
    return rc.Storage.for_model(
        kv_slots=0,
        mamba_slots=device_slots,
        host_mamba_slots=host_slots,
        layers=shape.layers,
        mamba_layers=shape.layers,
        conv_shape=shape.conv_shape,
        ssm_shape=shape.ssm_shape,
        conv_dtype="bfloat16",
        ssm_dtype="float32",
        device="cuda" if device == "cuda" else "cpu",
    )


def pool_slots(max_n: int) -> tuple[int, int]:
    """Device and host slots for batches of up to `max_n` slots.

    The device pool holds a d2d copy's sources and destinations (disjoint), the host pool
    one side of a copy.
    """
    return 2 * max_n + SLACK, max_n + SLACK


def slot_indices(
    direction: str, slot_set: str, n: int, max_n: int, device_slots: int, host_slots: int
) -> tuple[IntArray, IntArray]:
    """Source and destination slots of one configuration (deterministic)."""
    if slot_set == "contiguous":
        k = 1
        m = max_n + 3 if direction == "d2d" else 3
        return np.arange(k, k + n, dtype=np.int64), np.arange(m, m + n, dtype=np.int64)
    rng = np.random.default_rng([SEED, DIRECTIONS.index(direction), n])
    if direction == "d2d":
        perm = rng.permutation(device_slots).astype(np.int64)
        return perm[:n], perm[n : 2 * n]
    src_slots = device_slots if direction == "d2h" else host_slots
    dst_slots = host_slots if direction == "d2h" else device_slots
    src = rng.choice(src_slots, size=n, replace=False).astype(np.int64)
    dst = rng.choice(dst_slots, size=n, replace=False).astype(np.int64)
    return src, dst


def _sample(n: int) -> list[int]:
    return sorted({0, n // 2, n - 1})


def check_copy(
    backend: Backend,
    fn: CopyFn,
    src_pool: Pool,
    dst_pool: Pool,
    src_idx: IntArray,
    dst_idx: IntArray,
    rng: np.random.Generator,
) -> tuple[bool, str]:
    """Copy freshly stamped rows with `fn` and compare a sample; return (ok, detail)."""
    expected = []
    layers = src_pool.arrays[0].shape[0]
    for p in _sample(len(src_idx)):
        s, d = int(src_idx[p]), int(dst_idx[p])
        for a, (s_arr, d_arr) in enumerate(zip(src_pool.arrays, dst_pool.arrays)):
            for layer in _sample(layers):
                nbytes = math.prod(s_arr.shape[2:]) * s_arr.itemsize
                data = rng.integers(0, 256, size=nbytes, dtype=np.uint8)
                backend.write_row(s_arr, layer, s, data)
                backend.write_row(d_arr, layer, d, ~data)
                expected.append((a, layer, p, d, data))
    backend.settle()
    fn()
    backend.finish()
    bad = [
        f"array {a} layer {layer} pair {p}"
        for a, layer, p, d, data in expected
        if not np.array_equal(backend.read_row(dst_pool.arrays[a], layer, d), data)
    ]
    if bad:
        return False, f"{len(bad)} of {len(expected)} sampled rows differ ({bad[0]}, ...)"
    return True, f"{len(expected)} sampled rows equal"


def _progress(msg: str, t0: float) -> None:
    print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def measure_shape(
    backend: Backend,
    shape: Shape,
    ns: Sequence[int],
    repeat: int,
    peak_gbps: dict[str, float],
    t0: float,
) -> tuple[list[Row], str]:
    """Measure every direction, slot set, batch size and path of one shape."""
    max_n = max(ns)
    device_slots, host_slots = pool_slots(max_n)
    _progress(f"{shape.name}: allocating {device_slots} device + {host_slots} host slots", t0)
    storage = backend.storage(shape, device_slots, host_slots)
    pools = {t: storage.pool("mamba", t) for t in ("device", "host")}
    line = f"{shape.describe()}; pools: {device_slots} device + {host_slots} host slots"
    rng = np.random.default_rng(SEED)
    rows: list[Row] = []
    for direction in DIRECTIONS:
        src_pool = pools["host" if direction == "h2d" else "device"]
        dst_pool = pools["host" if direction == "d2h" else "device"]
        prep = backend.prepare(src_pool, dst_pool)
        for slot_set in SETS:
            for n in ns:
                src_idx, dst_idx = slot_indices(
                    direction, slot_set, n, max_n, device_slots, host_slots
                )
                nbytes = n * shape.bytes_per_slot
                _progress(f"{shape.name} {direction} {slot_set} n={n}", t0)
                for path in backend.paths:
                    calls: int | None = None
                    try:
                        fn = backend.copy_fn(path, prep, src_idx, dst_idx)
                        warm = fn()  # warm-up: also compiles the kernel
                        backend.finish()
                        if isinstance(warm, int):
                            calls = warm
                        ok, detail = check_copy(
                            backend, fn, src_pool, dst_pool, src_idx, dst_idx, rng
                        )
                        ms = backend.time_ms(fn, repeat) if ok else None
                    except Exception as e:
                        ok, detail, ms = False, f"{type(e).__name__}: {e}", None
                    if not ok:
                        print(
                            f"FAIL {shape.name} {direction} {slot_set} n={n} {path}: {detail}",
                            file=sys.stderr,
                            flush=True,
                        )
                    gbps = nbytes / (ms / 1e3) / 1e9 if ms else None
                    rows.append(
                        Row(
                            shape=shape.name,
                            direction=direction,
                            slot_set=slot_set,
                            n=n,
                            path=path,
                            calls=calls,
                            bytes=nbytes,
                            ms=ms,
                            gbps=gbps,
                            peak_fraction=gbps / peak_gbps[direction] if gbps else None,
                            check="ok" if ok else "FAIL",
                            check_detail=detail,
                        )
                    )
    return rows, line


def _find(rows: list[Row], **want: object) -> list[Row]:
    return [r for r in rows if all(getattr(r, k) == v for k, v in want.items())]


def evaluate(rows: list[Row], peak_gbps: dict[str, float], on_gpu: bool, quick: bool) -> list[Goal]:
    """Judge goals (a) and (b) per direction from the measured rows."""
    goals: list[Goal] = []
    for direction in DIRECTIONS:
        if not on_gpu:
            goals.append(Goal("a", GOAL_A, direction, "n/a", None, "no GPU"))
            continue
        cands = [
            r
            for r in _find(rows, shape="large", direction=direction, slot_set="contiguous", n=64)
            if r.path in ("kernel", "dma")
        ]
        timed = [r for r in cands if r.gbps is not None]
        if not cands:
            why = "--quick: large 64 slots not measured" if quick else "not measured"
            goals.append(Goal("a", GOAL_A, direction, "n/a", None, why))
        elif not timed:
            goals.append(Goal("a", GOAL_A, direction, "FAIL", None, "no path passed its check"))
        else:
            best = max(timed, key=lambda r: r.gbps or 0.0)
            frac = (best.gbps or 0.0) / peak_gbps[direction]
            goals.append(
                Goal(
                    "a",
                    GOAL_A,
                    direction,
                    "PASS" if frac >= PEAK_GOAL else "FAIL",
                    frac,
                    f"{frac:.1%} of peak ({best.path} {best.gbps:.2f} GB/s,"
                    f" peak {peak_gbps[direction]:.2f} GB/s)",
                )
            )
    for direction in DIRECTIONS:
        if not on_gpu:
            goals.append(Goal("b", GOAL_B, direction, "n/a", None, "no GPU"))
            continue
        cell = _find(rows, shape="small", direction=direction, slot_set="scattered", n=64)
        kernel = [r for r in cell if r.path == "kernel"]
        each = [r for r in cell if r.path == "memcpy each"]
        if not kernel or not each:
            goals.append(Goal("b", GOAL_B, direction, "n/a", None, "not measured"))
        elif kernel[0].ms is None or each[0].ms is None:
            goals.append(Goal("b", GOAL_B, direction, "FAIL", None, "a path failed its check"))
        else:
            speedup = each[0].ms / kernel[0].ms
            goals.append(
                Goal(
                    "b",
                    GOAL_B,
                    direction,
                    "PASS" if speedup >= SPEEDUP_GOAL else "FAIL",
                    speedup,
                    f"{speedup:.1f}x (kernel {kernel[0].ms:.4f} ms,"
                    f" memcpy each {each[0].ms:.4f} ms)",
                )
            )
    return goals


TABLE_HEADER = (
    f"{'shape':<6} {'dir':<4} {'set':<10} {'n':>3} {'path':<11} {'calls':>6} "
    f"{'MB/copy':>9} {'ms/copy':>10} {'GB/s':>9} {'%peak':>6}  check"
)


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def format_row(r: Row) -> str:
    """One table line."""
    calls = "-" if r.calls is None else str(r.calls)
    pct = "-" if r.peak_fraction is None else f"{r.peak_fraction:.1%}"
    return (
        f"{r.shape:<6} {r.direction:<4} {r.slot_set:<10} {r.n:>3} {r.path:<11} {calls:>6} "
        f"{r.bytes / 1e6:>9.3f} {_fmt(r.ms, '.4f'):>10} {_fmt(r.gbps, '.2f'):>9} {pct:>6}  "
        f"{r.check}"
    )


def format_goal(g: Goal) -> str:
    """One goal line."""
    if g.status == "n/a":
        return f"goal ({g.goal}) {g.text}, {g.direction}: n/a ({g.detail})"
    return f"goal ({g.goal}) {g.text}, {g.direction}: {g.status} {g.detail}"


def plot(pyplot: Any, rows: list[Row], peak_gbps: dict[str, float], path: str, title: str) -> None:
    """Write a PNG: GB/s per path, one panel per shape and direction, peak dashed."""
    shapes = list(dict.fromkeys(r.shape for r in rows))
    paths = list(dict.fromkeys(r.path for r in rows))
    fig, axes = pyplot.subplots(
        len(shapes),
        len(DIRECTIONS),
        figsize=(18, 4.5 * len(shapes)),
        squeeze=False,
        layout="constrained",
    )
    width = 0.8 / max(len(paths), 1)
    for i, shape in enumerate(shapes):
        for j, direction in enumerate(DIRECTIONS):
            ax = axes[i][j]
            mine = _find(rows, shape=shape, direction=direction)
            groups = list(dict.fromkeys((r.slot_set, r.n) for r in mine))
            for k, p in enumerate(paths):
                values = []
                for slot_set, n in groups:
                    hit = _find(mine, slot_set=slot_set, n=n, path=p)
                    values.append((hit[0].gbps or 0.0) if hit else 0.0)
                xs = [g + (k - (len(paths) - 1) / 2) * width for g in range(len(groups))]
                ax.bar(xs, values, width, label=p)
            ax.axhline(peak_gbps[direction], linestyle="--", color="black", label="peak")
            ax.set_xticks(range(len(groups)))
            ax.set_xticklabels([f"{s[:4]} {n}" for s, n in groups], fontsize="small")
            ax.set_yscale("log")
            ax.set_title(f"{shape} {direction}")
            ax.set_ylabel("GB/s (median)")
            ax.grid(True, axis="y", which="both", alpha=0.3)
            # Right of the axes: inside, it covered bars.
            ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.suptitle(title)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    print(f"wrote {path}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit status."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument(
        "--repeat",
        type=int,
        default=None,
        help=f"timed runs per cell (default {FULL_REPEAT}, {QUICK_REPEAT} with --quick)",
    )
    ap.add_argument("--quick", action="store_true", help="a tiny run: large only n=1,8")
    ap.add_argument("--json", action="store_true", help="print one JSON object, no table")
    ap.add_argument("--plot", metavar="PATH", help="write a PNG of GB/s (needs matplotlib)")
    ap.add_argument("--check", action="store_true", help="also exit 1 if a goal fails")
    args = ap.parse_args(argv)
    repeat = args.repeat or (QUICK_REPEAT if args.quick else FULL_REPEAT)
    if repeat < 1:
        ap.error("--repeat must be >= 1")

    pyplot: Any = None
    if args.plot:
        try:
            importlib.import_module("matplotlib").use("Agg")
            pyplot = importlib.import_module("matplotlib.pyplot")
        except ImportError:
            print("--plot needs matplotlib: pip install matplotlib", file=sys.stderr)
            return 2

    backend: Backend
    if args.device == "cuda":
        try:
            backend = CudaBackend()
        except Exception as e:
            print(
                f"--device cuda: no usable GPU ({type(e).__name__}: {e}); "
                "run with --device cpu for the CPU table",
                file=sys.stderr,
            )
            return 2
    else:
        backend = CpuBackend()

    t0 = time.perf_counter()
    plan = [(s, s.quick_ns if args.quick else s.ns) for s in SHAPES]
    ctx: dict[str, Any] = {
        "device": backend.name,
        **backend.describe(),
        "radixcache": rc.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "repeat": repeat,
        "quick": args.quick,
    }
    largest_pool = max(pool_slots(max(ns))[0] * s.bytes_per_slot for s, ns in plan)
    peak_bytes = min(PEAK_MAX_BYTES, largest_pool)
    _progress(f"peak: one {peak_bytes / 2**20:.0f} MiB copy per direction", t0)
    peak_ms = backend.peaks(peak_bytes, repeat)
    peak_gbps = {d: peak_bytes / (ms / 1e3) / 1e9 for d, ms in peak_ms.items()}

    rows: list[Row] = []
    shape_lines = []
    for shape, ns in plan:
        shape_rows, line = measure_shape(backend, shape, ns, repeat, peak_gbps, t0)
        backend.release()  # the shape's pools are unreferenced now
        rows += shape_rows
        shape_lines.append(line)
    goals = evaluate(rows, peak_gbps, backend.name == "cuda", args.quick)
    seconds = time.perf_counter() - t0
    failures = sum(r.check != "ok" for r in rows)

    peak_what = "cudaMemcpyAsync" if backend.name == "cuda" else "numpy.copyto"
    if args.json:
        out = {
            "context": ctx,
            "seconds": round(seconds, 2),
            "peak": {
                d: {
                    "bytes": peak_bytes,
                    "ms": peak_ms[d],
                    "gbps": peak_gbps[d],
                    "how": peak_what,
                }
                for d in DIRECTIONS
            },
            "shapes": shape_lines,
            "rows": [asdict(r) for r in rows],
            "goals": [asdict(g) for g in goals],
            "check_failures": failures,
        }
        print(json.dumps(out, indent=1))
    else:
        extra = "".join(
            f", {k} {ctx[k]}" for k in ("cuda_runtime", "cuda_driver", "cupy") if k in ctx
        )
        print(
            f"copy_bandwidth: device {ctx['device']} ({ctx['device_name']}{extra}), "
            f"radixcache {ctx['radixcache']}, numpy {ctx['numpy']}, Python {ctx['python']}; "
            f"repeat {repeat}, {'quick' if args.quick else 'full'}"
        )
        print(
            f"peak (one {peak_bytes / 2**20:.0f} MiB {peak_what}, median of {repeat}): "
            + ", ".join(f"{d} {peak_gbps[d]:.2f} GB/s" for d in DIRECTIONS)
        )
        for line in shape_lines:
            print(line)
        print()
        print(TABLE_HEADER)
        for r in rows:
            print(format_row(r))
        print()
        for g in goals:
            print(format_goal(g))
        print(f"\n{len(rows)} rows, {failures} check failures, {seconds:.1f} s")
    if pyplot is not None:
        title = (
            f"radixcache {ctx['radixcache']} Mamba state copies, {ctx['device']} "
            f"({ctx['device_name']})"
        )
        plot(pyplot, rows, peak_gbps, args.plot, title)
    goal_failed = any(g.status == "FAIL" for g in goals)
    return 1 if failures or (args.check and goal_failed) else 0


if __name__ == "__main__":
    raise SystemExit(main())
