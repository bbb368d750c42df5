"""The slot copies on a GPU: `copy_slots` (through `launch_copy_slots` and raw launches of
any grid) and the DMA path, device to device, pinned host to device and device to pinned
host, checked byte for byte against numpy fancy indexing, untouched bytes included.
Skipped without CuPy or without a CUDA device."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from radixcache._kernels import (
    CHUNK_BYTES,
    THREADS_PER_BLOCK,
    choose_path,
    contiguous_runs,
    copy_slots_kernel,
    dma_copy_slots,
    launch_copy_slots,
)

from conftest import cuda

cp, _why_not = cuda()

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cp is None, reason=_why_not or "no GPU")]

# ---------------------------------------------------------------------------- buffers


@dataclass(frozen=True)
class Buf:
    """One buffer of a pool on each side: row size, strides, and byte offsets of the
    buffer's start from an allocation (an offset makes every row misaligned)."""

    row_bytes: int
    src_stride: int
    dst_stride: int
    src_offset: int = 0
    dst_offset: int = 0


#: Every copy width of the kernel and the DMA path's packed and strided cases.
BUFS = [
    Buf(4096, 4096, 4096),  # packed, 16-byte path (KV row of one token in one layer)
    Buf(200, 208, 200),  # not a multiple of 16: 4-byte path; src padded, dst packed
    Buf(1001, 1003, 1001),  # odd size and stride: byte path, misaligned rows
    Buf(3 * CHUNK_BYTES + 48, 3 * CHUNK_BYTES + 48, 3 * CHUNK_BYTES + 64),  # 4 chunks
    Buf(64, 64, 64, src_offset=1),  # aligned size, misaligned source base: byte path
    Buf(96, 96, 96, dst_offset=4),  # 4-aligned destination base only: 4-byte path
    Buf(0, 16, 16),  # nothing to copy
]

N_SRC, N_DST = 64, 48
#: Scattered pairs, runs of consecutive pairs (coalesced by the DMA path), the first and
#: last slots. Destination slots are distinct (a copy to one slot twice is undefined).
SRC_IDX = [5, 6, 7, 8, 40, 3, 63, 0, 1, 2, 33, 20]
DST_IDX = [10, 11, 12, 13, 0, 47, 20, 30, 31, 32, 5, 6]


class Region:
    """Bytes on the device or in pinned (mapped) host memory, with their address."""

    def __init__(self, where: str, nbytes: int, fill: np.ndarray) -> None:
        self.where = where
        if where == "device":
            self.array = cp.asarray(fill)
            self.ptr = int(self.array.data.ptr)
        else:
            # cudaHostAlloc memory is mapped under UVA: its host pointer is valid on the GPU.
            self.mem = cp.cuda.alloc_pinned_memory(nbytes)
            self.array = np.frombuffer(self.mem, dtype=np.uint8, count=nbytes)
            self.array[:] = fill
            self.ptr = int(self.mem.ptr)

    def read(self) -> np.ndarray:
        out: np.ndarray = cp.asnumpy(self.array) if self.where == "device" else self.array.copy()
        return out


@dataclass
class Batch:
    """A pool on each side, its fill, and the expected destination bytes."""

    src: list[Region]
    dst: list[Region]
    expected: list[np.ndarray]
    bufs: list[Buf]
    src_idx: list[int]
    dst_idx: list[int]

    @property
    def src_base(self) -> list[int]:
        return [r.ptr + b.src_offset for r, b in zip(self.src, self.bufs)]

    @property
    def dst_base(self) -> list[int]:
        return [r.ptr + b.dst_offset for r, b in zip(self.dst, self.bufs)]

    def device_args(self) -> dict[str, Any]:
        def u64(v: list[int]) -> Any:
            return cp.asarray(np.array(v, dtype=np.uint64))

        def i64(v: list[int]) -> Any:
            return cp.asarray(np.array(v, dtype=np.int64))

        return {
            "src_base": u64(self.src_base),
            "dst_base": u64(self.dst_base),
            "src_stride": i64([b.src_stride for b in self.bufs]),
            "dst_stride": i64([b.dst_stride for b in self.bufs]),
            "row_bytes": i64([b.row_bytes for b in self.bufs]),
            "src_idx": i64(self.src_idx),
            "dst_idx": i64(self.dst_idx),
        }

    def check(self) -> None:
        for b, region, exp in zip(self.bufs, self.dst, self.expected):
            np.testing.assert_array_equal(region.read(), exp, err_msg=str(b))


def make_batch(
    src_where: str,
    dst_where: str,
    *,
    bufs: list[Buf] = BUFS,
    n_src: int = N_SRC,
    n_dst: int = N_DST,
    src_idx: list[int] = SRC_IDX,
    dst_idx: list[int] = DST_IDX,
    seed: int = 0,
) -> Batch:
    rng = np.random.default_rng(seed)
    src, dst, expected = [], [], []
    for b in bufs:
        src_len = b.src_offset + n_src * b.src_stride + 16
        dst_len = b.dst_offset + n_dst * b.dst_stride + 16
        src_fill = rng.integers(0, 256, src_len, dtype=np.uint8)
        dst_fill = rng.integers(0, 256, dst_len, dtype=np.uint8)
        # The reference: numpy fancy indexing over [slots, stride] views of the bytes.
        exp = dst_fill.copy()
        s_view = src_fill[b.src_offset : b.src_offset + n_src * b.src_stride]
        d_view = exp[b.dst_offset : b.dst_offset + n_dst * b.dst_stride]
        d_rows = d_view.reshape(n_dst, b.dst_stride)
        d_rows[dst_idx, : b.row_bytes] = s_view.reshape(n_src, b.src_stride)[src_idx, : b.row_bytes]
        src.append(Region(src_where, src_len, src_fill))
        dst.append(Region(dst_where, dst_len, dst_fill))
        expected.append(exp)
    cp.cuda.Device().synchronize()
    return Batch(src, dst, expected, list(bufs), list(src_idx), list(dst_idx))


DIRECTIONS = [("device", "device"), ("host", "device"), ("device", "host")]

# ---------------------------------------------------------------------------- the kernel


@pytest.mark.parametrize(("src_where", "dst_where"), DIRECTIONS)
def test_kernel_copies_exactly_the_reference_rows(src_where: str, dst_where: str) -> None:
    batch = make_batch(src_where, dst_where)
    stream = cp.cuda.Stream()
    launch_copy_slots(**batch.device_args(), stream=stream)
    stream.synchronize()
    batch.check()


def test_kernel_with_known_max_row_bytes_gives_the_same_bytes() -> None:
    batch = make_batch("device", "device", seed=1)
    stream = cp.cuda.Stream()
    max_row = max(b.row_bytes for b in batch.bufs)
    launch_copy_slots(**batch.device_args(), stream=stream, max_row_bytes=max_row)
    stream.synchronize()
    batch.check()


@pytest.mark.parametrize("grid", [(1, 1), (3, 2), (7, 1), (1, 3), (500, 9)])
@pytest.mark.parametrize("block", [32, THREADS_PER_BLOCK, 96])
def test_kernel_copies_everything_whatever_the_grid(grid: tuple[int, int], block: int) -> None:
    batch = make_batch("device", "device", seed=2)
    args = batch.device_args()
    stream = cp.cuda.Stream()
    kernel = copy_slots_kernel(cp.cuda.Device().id)
    kernel(
        (*grid, 1),
        (block, 1, 1),
        (
            args["src_base"],
            args["dst_base"],
            args["src_stride"],
            args["dst_stride"],
            args["row_bytes"],
            np.int32(len(batch.bufs)),
            args["src_idx"],
            args["dst_idx"],
            np.int32(len(batch.src_idx)),
            np.int64(CHUNK_BYTES),
        ),
        stream=stream,
    )
    stream.synchronize()
    batch.check()


def test_kernel_strides_over_more_rows_than_the_grid_has_blocks() -> None:
    # 70k pairs x 1 buffer: more rows than MAX_GRID_X blocks.
    n = 70_000
    perm = np.random.default_rng(3).permutation(n).tolist()
    batch = make_batch(
        "device",
        "device",
        bufs=[Buf(16, 16, 16)],
        n_src=n,
        n_dst=n,
        src_idx=list(range(n)),
        dst_idx=perm,
        seed=3,
    )
    stream = cp.cuda.Stream()
    launch_copy_slots(**batch.device_args(), stream=stream)
    stream.synchronize()
    batch.check()


# ---------------------------------------------------------------------------- the DMA path


@pytest.mark.parametrize(("src_where", "dst_where"), DIRECTIONS)
def test_dma_copies_exactly_the_reference_rows(src_where: str, dst_where: str) -> None:
    batch = make_batch(src_where, dst_where, seed=4)
    stream = cp.cuda.Stream()
    calls = dma_copy_slots(
        batch.src_base,
        batch.dst_base,
        [b.src_stride for b in batch.bufs],
        [b.dst_stride for b in batch.bufs],
        [b.row_bytes for b in batch.bufs],
        batch.src_idx,
        batch.dst_idx,
        stream=stream,
    )
    stream.synchronize()
    batch.check()
    n_runs = len(contiguous_runs(batch.src_idx, batch.dst_idx))
    packed = sum(
        1 for b in batch.bufs if b.row_bytes and b.src_stride == b.dst_stride == b.row_bytes
    )
    strided = sum(1 for b in batch.bufs if b.row_bytes) - packed
    assert calls == packed * n_runs + strided * len(batch.src_idx)


def test_both_paths_agree_on_a_batch_that_choose_path_sends_to_dma() -> None:
    # 512 consecutive 4 KiB rows: 2 MiB per memcpy.
    n = 512
    bufs = [Buf(4096, 4096, 4096)] * 2
    idx = list(range(n))
    assert choose_path(4096, n, len(contiguous_runs(idx, idx))) == "dma"
    for use_dma in (True, False):
        batch = make_batch(
            "host", "device", bufs=bufs, n_src=n, n_dst=n, src_idx=idx, dst_idx=idx, seed=5
        )
        stream = cp.cuda.Stream()
        if use_dma:
            dma_copy_slots(
                batch.src_base,
                batch.dst_base,
                [4096] * 2,
                [4096] * 2,
                [4096] * 2,
                idx,
                idx,
                stream=stream,
            )
        else:
            launch_copy_slots(**batch.device_args(), stream=stream)
        stream.synchronize()
        batch.check()
