"""Slot copies between GPU memory and pinned host memory: CUDA kernels through CuPy.

A *buffer* is one array whose axis 0 is the slot index (one layer's K cache
``[slots, heads, head_dim]``, one layer's conv state ``[slots, *conv_shape]``); a *pool*
is a list of buffers on one tier. A copy moves, for every buffer ``b`` and every pair
``i``, the ``row_bytes[b]`` bytes at ``src_base[b] + src_idx[i] * src_stride[b]`` to
``dst_base[b] + dst_idx[i] * dst_stride[b]``. Host buffers are pinned memory, mapped into
the device's address space (UVA), so one address names a host row on both sides.

Two ways to run a copy, picked by ``choose_path``:

* ``launch_copy_slots``: the ``copy_slots`` kernel (``kernels/copy_slots.cu``), one launch
  for all pairs and buffers, whatever their sizes and alignment;
* ``dma_copy_slots``: ``cudaMemcpyAsync`` calls, one per run of consecutive slots and
  buffer, served by the copy engines.

Neither validates slot indices against the buffers' sizes: the caller owns that. Source
and destination rows must not overlap. CuPy is imported only when a GPU function is
called, so this module imports (and its pure helpers run) without CuPy.
"""

from __future__ import annotations

import importlib
import re
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from radixcache import _core

__all__ = [
    "CHUNK_BYTES",
    "DMA_MIN_BYTES_PER_COPY",
    "MAX_GRID_X",
    "MAX_GRID_Y",
    "THREADS_PER_BLOCK",
    "choose_path",
    "contiguous_runs",
    "copy_slots_kernel",
    "dma_copy_slots",
    "grid_dims",
    "kernel_source",
    "launch_copy_slots",
]

# --- Launch parameters: the one place where they are chosen, and why. -------------------
#
# THREADS_PER_BLOCK = 256: 8 warps. A thread moves 16 bytes (int4) per access, so a block
#   moves 4 KiB per access wave; the kernel issues 4 such loads per thread before storing
#   (16 KiB in flight per block), which hides HBM latency and the longer latency of mapped
#   host memory over PCIe/C2C. 256 threads also let 8 blocks share an SM (2048 threads),
#   so rows of different sizes from different blocks interleave on every SM. A small row
#   (e.g. one token's 2 KiB K row) leaves threads idle; it still costs one block, not one
#   launch.
# CHUNK_BYTES = 64 KiB: the part of a row that one block copies per grid-y step (4 steps
#   of 16 KiB). A 2 MiB SSM state row spreads over 32 blocks, so a few large rows still
#   fill the GPU; rows up to 64 KiB (KV rows, conv states) are one chunk for one block.
#   A multiple of 16, so every chunk keeps the row's 16-byte alignment.
# MAX_GRID_X = 65535: one block per row up to 64 Ki rows; beyond, blocks loop over rows
#   (grid-stride). 64 Ki blocks is far more than an H100/H200 holds at once (132 SMs x 8),
#   so a larger grid would only add block scheduling.
# MAX_GRID_Y = 65535: the hardware limit of gridDim.y; grid-stride covers longer rows.
# DMA_MIN_BYTES_PER_COPY = 1 MiB: see choose_path.
THREADS_PER_BLOCK = 256
CHUNK_BYTES = 64 << 10
MAX_GRID_X = 65535
MAX_GRID_Y = 65535
DMA_MIN_BYTES_PER_COPY = 1 << 20

#: Where ``kernel_source`` reads a kernel when the extension does not embed it (a source
#: checkout: ``<repo>/kernels``).
KERNELS_DIR = Path(__file__).resolve().parents[2] / "kernels"

_INT32_MAX = (1 << 31) - 1
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")

_kernels: dict[int, Any] = {}
_kernels_lock = threading.Lock()


def _cupy() -> Any:
    """Import CuPy on first use, with an explanation when it is missing."""
    try:
        return importlib.import_module("cupy")
    except ImportError as e:
        raise ImportError(
            "radixcache's GPU copies need CuPy (e.g. `pip install cupy-cuda12x`)"
        ) from e


def kernel_source(name: str) -> str:
    """Return the CUDA source of ``kernels/<name>.cu``.

    The source embedded in the extension (``radixcache._core.KERNEL_SOURCES``) is used
    when present; otherwise the file is read from the source checkout's ``kernels/``.

    Args:
        name: The kernel's name, which is also its file's stem (e.g. ``"copy_slots"``).

    Returns:
        The source text.

    Raises:
        ValueError: ``name`` is not an identifier.
        FileNotFoundError: The source is neither embedded nor on disk.
    """
    if not _NAME_RE.match(name):
        raise ValueError(f"kernel name must be an identifier, got {name!r}")
    embedded = getattr(_core, "KERNEL_SOURCES", None)
    if isinstance(embedded, dict):
        source = embedded.get(name)
        if isinstance(source, str):
            return source
    path = KERNELS_DIR / f"{name}.cu"
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        embedded_names = sorted(embedded) if isinstance(embedded, dict) else None
        raise FileNotFoundError(
            f"CUDA source of kernel {name!r} not found: not in radixcache._core.KERNEL_SOURCES"
            f" (embedded: {embedded_names}) and no file {path}"
        ) from None


def copy_slots_kernel(device_id: int) -> Any:
    """Return the ``copy_slots`` kernel compiled for a device (compiled once per device).

    Args:
        device_id: The CUDA device ordinal.

    Returns:
        The ``cupy.RawKernel``, loaded on that device.

    Raises:
        ImportError: CuPy is not installed.
    """
    with _kernels_lock:
        kernel = _kernels.get(device_id)
        if kernel is None:
            cupy = _cupy()
            with cupy.cuda.Device(device_id):
                module = cupy.RawModule(
                    code=kernel_source("copy_slots"),
                    options=("--std=c++14",),
                    name_expressions=None,
                )
                # get_function compiles and loads the module on the current device.
                kernel = module.get_function("copy_slots")
            _kernels[device_id] = kernel
        return kernel


def grid_dims(n_rows: int, max_row_bytes: int) -> tuple[int, int]:
    """Return the ``(x, y)`` grid of a ``copy_slots`` launch.

    Args:
        n_rows: Rows to copy, ``n_pairs * n_buf``.
        max_row_bytes: The largest ``row_bytes`` of the batch.

    Returns:
        ``(min(n_rows, MAX_GRID_X), min(chunks of the largest row, MAX_GRID_Y))``, each at
        least 1; the kernel's grid-stride loops cover what the caps leave out.
    """
    chunks = -(-max_row_bytes // CHUNK_BYTES)
    return max(1, min(n_rows, MAX_GRID_X)), max(1, min(chunks, MAX_GRID_Y))


def _check_array(name: str, a: Any, dtype: type[np.generic], size: int | None) -> int:
    """Check a launch argument's dtype, shape and layout; return its length."""
    if a.dtype != dtype or a.ndim != 1 or not a.flags.c_contiguous:
        raise ValueError(
            f"{name} must be a contiguous 1-D {np.dtype(dtype).name} array, got"
            f" {a.dtype} with shape {a.shape}"
        )
    n = int(a.size)
    if size is not None and n != size:
        raise ValueError(f"{name} has {n} entries, expected {size}")
    return n


def launch_copy_slots(
    src_base: Any,
    dst_base: Any,
    src_stride: Any,
    dst_stride: Any,
    row_bytes: Any,
    src_idx: Any,
    dst_idx: Any,
    *,
    stream: Any,
    max_row_bytes: int | None = None,
) -> None:
    """Enqueue one ``copy_slots`` launch copying every pair's row of every buffer.

    All arrays are 1-D contiguous CuPy arrays on one device; the copy runs on ``stream``
    (asynchronous: nothing is waited for, unless ``max_row_bytes`` is left out).

    Args:
        src_base: ``uint64[n_buf]``, each source buffer's address (device or mapped host).
        dst_base: ``uint64[n_buf]``, each destination buffer's address.
        src_stride: ``int64[n_buf]``, bytes between consecutive slots of a source buffer.
        dst_stride: ``int64[n_buf]``, the same for the destination buffers.
        row_bytes: ``int64[n_buf]``, bytes copied per slot of each buffer.
        src_idx: ``int64[n_pairs]``, the source slot of each pair.
        dst_idx: ``int64[n_pairs]``, the destination slot of each pair.
        stream: The ``cupy.cuda.Stream`` to launch on (a stream of the arrays' device).
        max_row_bytes: ``max(row_bytes)``, known to the caller from the pool's layout;
            when None it is read from the device, which waits for the device.

    Raises:
        ValueError: A dtype, shape or count is wrong.
        ImportError: CuPy is not installed.
    """
    n_buf = _check_array("src_base", src_base, np.uint64, None)
    _check_array("dst_base", dst_base, np.uint64, n_buf)
    _check_array("src_stride", src_stride, np.int64, n_buf)
    _check_array("dst_stride", dst_stride, np.int64, n_buf)
    _check_array("row_bytes", row_bytes, np.int64, n_buf)
    n_pairs = _check_array("src_idx", src_idx, np.int64, None)
    _check_array("dst_idx", dst_idx, np.int64, n_pairs)
    if n_buf > _INT32_MAX or n_pairs > _INT32_MAX:
        raise ValueError(f"n_buf ({n_buf}) and n_pairs ({n_pairs}) must fit in int32")
    if n_buf == 0 or n_pairs == 0:
        return
    device_id = int(src_idx.device.id)
    if max_row_bytes is None:
        max_row_bytes = int(row_bytes.max())
    if max_row_bytes <= 0:
        return
    grid = (*grid_dims(n_pairs * n_buf, max_row_bytes), 1)
    kernel = copy_slots_kernel(device_id)
    cupy = _cupy()
    with cupy.cuda.Device(device_id):
        kernel(
            grid,
            (THREADS_PER_BLOCK, 1, 1),
            (
                src_base,
                dst_base,
                src_stride,
                dst_stride,
                row_bytes,
                np.int32(n_buf),
                src_idx,
                dst_idx,
                np.int32(n_pairs),
                np.int64(CHUNK_BYTES),
            ),
            stream=stream,
        )


def contiguous_runs(
    src_idx: Sequence[int] | npt.NDArray[np.integer[Any]],
    dst_idx: Sequence[int] | npt.NDArray[np.integer[Any]],
) -> list[tuple[int, int, int]]:
    """Split pairs into maximal runs where both the source and the destination slot step by 1.

    Pairs are kept in order: pair ``i + 1`` joins pair ``i``'s run exactly when
    ``src_idx[i + 1] == src_idx[i] + 1`` and ``dst_idx[i + 1] == dst_idx[i] + 1``.

    Args:
        src_idx: The source slot of each pair.
        dst_idx: The destination slot of each pair (as many as ``src_idx``).

    Returns:
        ``(src_start, dst_start, length)`` per run, in pair order; lengths sum to the
        number of pairs.

    Raises:
        ValueError: The index lists differ in length or are not 1-D.
    """
    s = np.asarray(src_idx, dtype=np.int64)
    d = np.asarray(dst_idx, dtype=np.int64)
    if s.ndim != 1 or d.ndim != 1 or s.shape != d.shape:
        raise ValueError(f"src_idx and dst_idx must be 1-D of one length: {s.shape}, {d.shape}")
    n = int(s.size)
    if n == 0:
        return []
    joined = (np.diff(s) == 1) & (np.diff(d) == 1)
    starts = np.concatenate(([0], np.flatnonzero(~joined) + 1)).tolist()
    ends = [*starts[1:], n]
    src_list = s.tolist()
    dst_list = d.tolist()
    return [(src_list[a], dst_list[a], b - a) for a, b in zip(starts, ends)]


def dma_copy_slots(
    src_base: list[int],
    dst_base: list[int],
    src_stride: list[int],
    dst_stride: list[int],
    row_bytes: list[int],
    src_idx: Sequence[int],
    dst_idx: Sequence[int],
    *,
    stream: Any,
) -> int:
    """Enqueue the copy as ``cudaMemcpyAsync`` calls (the copy engines' path).

    A buffer whose rows are packed on both sides (``src_stride == dst_stride ==
    row_bytes``) gets one memcpy per run of consecutive pairs (``contiguous_runs``);
    any other buffer gets one memcpy per pair. Call with ``stream``'s device current.

    Args:
        src_base: Each source buffer's address (device or pinned host).
        dst_base: Each destination buffer's address.
        src_stride: Bytes between consecutive slots of each source buffer.
        dst_stride: Bytes between consecutive slots of each destination buffer.
        row_bytes: Bytes copied per slot of each buffer.
        src_idx: The source slot of each pair.
        dst_idx: The destination slot of each pair.
        stream: The ``cupy.cuda.Stream`` to enqueue on.

    Returns:
        The number of memcpy calls issued.

    Raises:
        ValueError: The per-buffer lists or the index lists differ in length, or a
            ``row_bytes`` is negative.
        ImportError: CuPy is not installed.
    """
    n_buf = len(src_base)
    if not n_buf == len(dst_base) == len(src_stride) == len(dst_stride) == len(row_bytes):
        raise ValueError("src_base, dst_base, src_stride, dst_stride, row_bytes differ in length")
    if len(src_idx) != len(dst_idx):
        raise ValueError(f"src_idx has {len(src_idx)} entries, dst_idx {len(dst_idx)}")
    if any(r < 0 for r in row_bytes):
        raise ValueError(f"row_bytes must be >= 0: {row_bytes}")
    if n_buf == 0 or len(src_idx) == 0:
        return 0
    runtime = _cupy().cuda.runtime
    kind = runtime.memcpyDefault
    stream_ptr = int(stream.ptr)
    runs: list[tuple[int, int, int]] | None = None
    calls = 0
    for b in range(n_buf):
        nbytes = row_bytes[b]
        if nbytes == 0:
            continue
        s_base, d_base = src_base[b], dst_base[b]
        s_stride, d_stride = src_stride[b], dst_stride[b]
        if s_stride == d_stride == nbytes:
            if runs is None:
                runs = contiguous_runs(src_idx, dst_idx)
            for s, d, length in runs:
                runtime.memcpyAsync(
                    d_base + d * nbytes, s_base + s * nbytes, length * nbytes, kind, stream_ptr
                )
            calls += len(runs)
        else:
            for s, d in zip(src_idx, dst_idx):
                runtime.memcpyAsync(
                    d_base + d * d_stride, s_base + s * s_stride, nbytes, kind, stream_ptr
                )
            calls += len(src_idx)
    return calls


def choose_path(row_bytes_per_slot: int, n_pairs: int, n_runs: int) -> Literal["dma", "kernel"]:
    """Pick the copy path for a batch: ``"dma"`` or ``"kernel"``.

    ``"dma"`` when the average memcpy of the DMA path would move at least
    ``DMA_MIN_BYTES_PER_COPY`` (1 MiB): ``row_bytes_per_slot * n_pairs / n_runs >= 1 MiB``.
    The copy engines reach their peak bandwidth on large contiguous transfers and leave the
    SMs to the model; but each memcpy has a fixed cost of a few microseconds, so many small
    scattered rows are cheaper as one kernel launch than as one memcpy each.

    Args:
        row_bytes_per_slot: Bytes one slot moves per memcpy, i.e. per buffer: the mean of
            the pool's ``row_bytes`` (the DMA path issues ``n_runs`` memcpys per buffer).
        n_pairs: Pairs in the batch.
        n_runs: Runs of consecutive pairs, ``len(contiguous_runs(src_idx, dst_idx))``; pass
            ``n_pairs`` for a pool whose rows are not packed (one memcpy per pair).

    Returns:
        ``"dma"`` or ``"kernel"``; ``"kernel"`` for an empty batch.

    Raises:
        ValueError: A count is negative, or ``n_runs`` is not between 1 and ``n_pairs``
            for a non-empty batch.
    """
    if row_bytes_per_slot < 0 or n_pairs < 0 or n_runs < 0:
        raise ValueError(f"counts must be >= 0: {row_bytes_per_slot}, {n_pairs}, {n_runs}")
    if n_pairs == 0:
        return "kernel"
    if not 1 <= n_runs <= n_pairs:
        raise ValueError(f"n_runs must be in 1..n_pairs ({n_pairs}), got {n_runs}")
    if row_bytes_per_slot * n_pairs >= n_runs * DMA_MIN_BYTES_PER_COPY:
        return "dma"
    return "kernel"
