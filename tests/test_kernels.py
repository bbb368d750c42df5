"""The slot-copy kernels without a GPU: `contiguous_runs`, `choose_path`, the launch grid,
the launcher's argument checks, the DMA path's address arithmetic (memcpy emulated on host
memory), `kernel_source`, and every `kernels/*.cu` compiled to PTX with NVRTC from PyPI.
The GPU runs are in tests/gpu/test_kernels_gpu.py."""

from __future__ import annotations

import ctypes
import importlib.util
import subprocess
import sys
import textwrap
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from radixcache import _core, _kernels
from radixcache._kernels import (
    CHUNK_BYTES,
    DMA_MIN_BYTES_PER_COPY,
    MAX_GRID_X,
    MAX_GRID_Y,
    choose_path,
    contiguous_runs,
    dma_copy_slots,
    grid_dims,
    kernel_source,
    launch_copy_slots,
)

REPO = Path(__file__).resolve().parents[1]
KERNEL_FILES = sorted((REPO / "kernels").glob("*.cu"))
ARCHES = ("compute_80", "compute_90")


def _load_nvrtc_check() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("nvrtc_check", REPO / "scripts/nvrtc_check.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


nvrtc_check = _load_nvrtc_check()

# ---------------------------------------------------------------------------- contiguous_runs


def test_contiguous_runs_of_no_pairs_is_empty() -> None:
    assert contiguous_runs([], []) == []


def test_contiguous_runs_merges_pairs_where_both_sides_step_by_one() -> None:
    assert contiguous_runs([4, 5, 6, 7], [20, 21, 22, 23]) == [(4, 20, 4)]


def test_contiguous_runs_splits_where_only_the_source_is_consecutive() -> None:
    assert contiguous_runs([1, 2, 3], [10, 11, 30]) == [(1, 10, 2), (3, 30, 1)]


def test_contiguous_runs_splits_where_only_the_destination_is_consecutive() -> None:
    assert contiguous_runs([1, 2, 9], [10, 11, 12]) == [(1, 10, 2), (9, 12, 1)]


def test_contiguous_runs_does_not_merge_descending_or_repeated_slots() -> None:
    assert contiguous_runs([5, 4, 4], [5, 4, 4]) == [(5, 5, 1), (4, 4, 1), (4, 4, 1)]


def test_contiguous_runs_keeps_pair_order_and_does_not_sort() -> None:
    # The same slots out of order: sorting would give one run, but pair order is kept.
    assert contiguous_runs([2, 0, 1], [2, 0, 1]) == [(2, 2, 1), (0, 0, 2)]


def test_contiguous_runs_accepts_numpy_arrays_and_returns_python_ints() -> None:
    runs = contiguous_runs(np.array([3, 4, 8], dtype=np.int32), np.arange(3, dtype=np.uint64))
    assert runs == [(3, 0, 2), (8, 2, 1)]
    assert all(type(v) is int for run in runs for v in run)


def test_contiguous_runs_rejects_index_lists_of_different_lengths() -> None:
    with pytest.raises(ValueError, match="one length"):
        contiguous_runs([1, 2], [1])


@given(st.lists(st.tuples(st.integers(0, 12), st.integers(0, 12)), max_size=40))
def test_contiguous_runs_expand_back_to_the_pairs_and_are_maximal(
    pairs: list[tuple[int, int]],
) -> None:
    src = [s for s, _ in pairs]
    dst = [d for _, d in pairs]
    runs = contiguous_runs(src, dst)
    expanded = [(s + k, d + k) for s, d, n in runs for k in range(n)]
    assert expanded == pairs
    assert all(n >= 1 for _, _, n in runs)
    for (s0, d0, n0), (s1, d1, _) in zip(runs, runs[1:]):
        assert (s1, d1) != (s0 + n0, d0 + n0), "two adjacent runs could have been one"


# ---------------------------------------------------------------------------- choose_path


def test_choose_path_takes_dma_from_one_mebibyte_per_memcpy() -> None:
    # 256 consecutive slots of 4 KiB rows: one memcpy of exactly 1 MiB per buffer.
    assert choose_path(4096, 256, 1) == "dma"
    assert choose_path(4096, 255, 1) == "kernel"
    assert choose_path(DMA_MIN_BYTES_PER_COPY, 1, 1) == "dma"
    assert choose_path(DMA_MIN_BYTES_PER_COPY - 1, 1, 1) == "kernel"


def test_choose_path_sends_many_small_scattered_rows_to_the_kernel() -> None:
    # 10k scattered token rows of 2 KiB: 20 MiB in all, but 10k memcpys of 2 KiB each.
    assert choose_path(2048, 10_000, 10_000) == "kernel"
    # The same rows in a few long runs are large memcpys.
    assert choose_path(2048, 10_000, 4) == "dma"


def test_choose_path_sends_large_rows_to_dma_even_when_scattered() -> None:
    # SSM states of 2 MiB per slot: every memcpy is large whatever the order.
    assert choose_path(2 << 20, 7, 7) == "dma"


def test_choose_path_of_an_empty_batch_is_the_kernel() -> None:
    assert choose_path(4096, 0, 0) == "kernel"


@pytest.mark.parametrize(
    ("row_bytes", "n_pairs", "n_runs"),
    [(-1, 1, 1), (1, -1, 1), (1, 1, -1), (1, 4, 0), (1, 4, 5)],
)
def test_choose_path_rejects_impossible_counts(row_bytes: int, n_pairs: int, n_runs: int) -> None:
    with pytest.raises(ValueError, match=r"n_runs|>= 0"):
        choose_path(row_bytes, n_pairs, n_runs)


# ---------------------------------------------------------------------------- launch grid


def test_chunk_size_keeps_the_kernels_16_byte_alignment() -> None:
    assert CHUNK_BYTES > 0
    assert CHUNK_BYTES % 16 == 0


def test_grid_gives_one_block_per_row_and_one_chunk_to_small_rows() -> None:
    assert grid_dims(10, 2048) == (10, 1)
    assert grid_dims(10, CHUNK_BYTES) == (10, 1)
    assert grid_dims(10, CHUNK_BYTES + 1) == (10, 2)


def test_grid_spreads_a_two_mebibyte_row_over_32_blocks() -> None:
    assert grid_dims(1, 2 << 20) == (1, 32)


def test_grid_is_capped_and_never_empty() -> None:
    assert grid_dims(10**9, 10**12) == (MAX_GRID_X, MAX_GRID_Y)
    assert grid_dims(0, 0) == (1, 1)


# ---------------------------------------------------------------------------- launcher checks


@pytest.fixture
def no_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make `import cupy` fail, as on a machine without it."""
    monkeypatch.setitem(sys.modules, "cupy", None)


def _launch_args(n_buf: int = 2, n_pairs: int = 3) -> dict[str, Any]:
    return {
        "src_base": np.zeros(n_buf, dtype=np.uint64),
        "dst_base": np.zeros(n_buf, dtype=np.uint64),
        "src_stride": np.zeros(n_buf, dtype=np.int64),
        "dst_stride": np.zeros(n_buf, dtype=np.int64),
        "row_bytes": np.zeros(n_buf, dtype=np.int64),
        "src_idx": np.zeros(n_pairs, dtype=np.int64),
        "dst_idx": np.zeros(n_pairs, dtype=np.int64),
    }


@pytest.mark.usefixtures("no_cupy")
@pytest.mark.parametrize(("n_buf", "n_pairs"), [(0, 3), (2, 0), (0, 0)])
def test_launch_of_nothing_returns_without_cupy(n_buf: int, n_pairs: int) -> None:
    launch_copy_slots(**_launch_args(n_buf, n_pairs), stream=None)


@pytest.mark.parametrize(
    ("name", "bad"),
    [
        ("src_base", np.zeros(2, dtype=np.int64)),  # addresses are uint64
        ("row_bytes", np.zeros(2, dtype=np.int32)),  # int32 would be read as int64 pairs
        ("dst_stride", np.zeros(3, dtype=np.int64)),  # one per buffer
        ("dst_idx", np.zeros(2, dtype=np.int64)),  # one per pair
        ("src_idx", np.zeros((3, 1), dtype=np.int64)),  # 1-D
        ("dst_idx", np.zeros(6, dtype=np.int64)[::2]),  # contiguous
    ],
)
def test_launch_rejects_arrays_the_kernel_would_misread(name: str, bad: Any) -> None:
    args = _launch_args()
    args[name] = bad
    with pytest.raises(ValueError, match=name):
        launch_copy_slots(**args, stream=None)


@pytest.mark.usefixtures("no_cupy")
def test_gpu_calls_without_cupy_say_that_cupy_is_needed() -> None:
    with pytest.raises(ImportError, match="CuPy"):
        dma_copy_slots([0], [0], [16], [16], [16], [0], [0], stream=None)


def test_module_imports_without_importing_cupy() -> None:
    code = "import sys, radixcache._kernels; assert 'cupy' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------- DMA path

#: Buffers of the DMA tests: (row_bytes, src_stride, dst_stride). Packed rows coalesce,
#: padded or differently strided rows are copied one by one, empty rows not at all.
DMA_BUFFERS = [(64, 64, 64), (24, 32, 24), (40, 40, 48), (0, 16, 16)]


class _MemcpyRecorder:
    """Stands in for `cupy.cuda.runtime`: runs each memcpy at once on host memory."""

    memcpyDefault = 4  # CUDA's name

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int, int, int]] = []

    def memcpyAsync(self, dst: int, src: int, size: int, kind: int, stream: int) -> None:
        self.calls.append((dst, src, size, kind, stream))
        ctypes.memmove(dst, src, size)


def test_dma_copies_the_reference_rows_and_coalesces_packed_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runtime = _MemcpyRecorder()
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime))
    monkeypatch.setattr(_kernels, "_cupy", lambda: fake)
    rng = np.random.default_rng(0)
    n_src, n_dst = 12, 10
    src_idx = [3, 4, 5, 9, 0, 1, 7]
    dst_idx = [0, 1, 2, 5, 8, 9, 3]
    srcs = [rng.integers(0, 256, n_src * ss, dtype=np.uint8) for _, ss, _ in DMA_BUFFERS]
    dsts = [rng.integers(0, 256, n_dst * ds, dtype=np.uint8) for _, _, ds in DMA_BUFFERS]
    expected = [d.copy() for d in dsts]
    for (row, ss, ds), src, exp in zip(DMA_BUFFERS, srcs, expected):
        exp.reshape(n_dst, ds)[dst_idx, :row] = src.reshape(n_src, ss)[src_idx, :row]

    calls = dma_copy_slots(
        [a.ctypes.data for a in srcs],
        [a.ctypes.data for a in dsts],
        [ss for _, ss, _ in DMA_BUFFERS],
        [ds for _, _, ds in DMA_BUFFERS],
        [row for row, _, _ in DMA_BUFFERS],
        src_idx,
        dst_idx,
        stream=types.SimpleNamespace(ptr=1234),
    )

    for got, exp in zip(dsts, expected):
        np.testing.assert_array_equal(got, exp)
    n_runs = len(contiguous_runs(src_idx, dst_idx))
    assert n_runs == 4
    assert calls == len(runtime.calls) == n_runs + 2 * len(src_idx)
    assert {(kind, stream) for _, _, _, kind, stream in runtime.calls} == {(4, 1234)}


def test_dma_of_nothing_issues_no_memcpy() -> None:
    assert dma_copy_slots([], [], [], [], [], [1], [2], stream=None) == 0
    assert dma_copy_slots([0], [0], [16], [16], [16], [], [], stream=None) == 0


def test_dma_rejects_lists_of_different_lengths() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        dma_copy_slots([0, 0], [0], [16], [16], [16], [1], [2], stream=None)
    with pytest.raises(ValueError, match="dst_idx"):
        dma_copy_slots([0], [0], [16], [16], [16], [1, 2], [2], stream=None)


# ---------------------------------------------------------------------------- kernel_source


def test_kernel_source_returns_the_kernel_file() -> None:
    """From the extension's KERNEL_SOURCES when it has them, else from the checkout."""
    on_disk = (REPO / "kernels" / "copy_slots.cu").read_text(encoding="utf-8")
    assert kernel_source("copy_slots") == on_disk


def test_embedded_kernel_sources_match_the_files() -> None:
    embedded = getattr(_core, "KERNEL_SOURCES", None)
    if embedded is None:
        pytest.skip("radixcache._core has no KERNEL_SOURCES (sources not embedded yet)")
    assert isinstance(embedded, dict)
    assert sorted(embedded) == sorted(p.stem for p in KERNEL_FILES)
    for path in KERNEL_FILES:
        assert embedded[path.stem] == path.read_text(encoding="utf-8"), path.name


def test_kernel_source_falls_back_to_the_kernels_directory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_kernels, "_core", types.SimpleNamespace())
    monkeypatch.setattr(_kernels, "KERNELS_DIR", REPO / "kernels")
    on_disk = (REPO / "kernels" / "copy_slots.cu").read_text(encoding="utf-8")
    assert kernel_source("copy_slots") == on_disk


def test_kernel_source_prefers_the_embedded_source(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_core = types.SimpleNamespace(KERNEL_SOURCES={"copy_slots": "// embedded"})
    monkeypatch.setattr(_kernels, "_core", fake_core)
    assert kernel_source("copy_slots") == "// embedded"


def test_kernel_source_of_a_missing_kernel_names_both_places(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(_kernels, "_core", types.SimpleNamespace(KERNEL_SOURCES={}))
    monkeypatch.setattr(_kernels, "KERNELS_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match=r"KERNEL_SOURCES.*no_such_kernel\.cu"):
        kernel_source("no_such_kernel")


@pytest.mark.parametrize("name", ["", "../copy_slots", "copy_slots.cu", "a/b"])
def test_kernel_source_rejects_names_that_are_not_identifiers(name: str) -> None:
    with pytest.raises(ValueError, match="identifier"):
        kernel_source(name)


def test_kernels_dir_is_the_checkouts_kernels_directory() -> None:
    module_path = Path(_kernels.__file__).resolve()
    if REPO / "python" not in module_path.parents:
        pytest.skip(f"radixcache is imported from {module_path}, not from this checkout")
    assert _kernels.KERNELS_DIR == REPO / "kernels"


# ---------------------------------------------------------------------------- NVRTC

#: The PTX parameter types of `copy_slots`, in order: what `launch_copy_slots` passes
#: (five arrays, int32 n_buf, two arrays, int32 n_pairs, int64 chunk_bytes).
COPY_SLOTS_PARAMS = ["u64"] * 5 + ["u32"] + ["u64"] * 2 + ["u32", "u64"]


def _require_nvrtc() -> None:
    if nvrtc_check.find_nvrtc() is None:
        pytest.skip("NVRTC is not installed (pip install nvidia-cuda-nvrtc-cu12)")


def test_there_are_kernels_to_compile() -> None:
    assert [p.name for p in KERNEL_FILES] == ["copy_slots.cu"]


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("path", KERNEL_FILES, ids=lambda p: p.name)
def test_kernel_compiles_with_nvrtc_without_warnings(path: Path, arch: str) -> None:
    _require_nvrtc()
    ptx, log = nvrtc_check.compile_program(path.read_text(encoding="utf-8"), path.name, arch)
    assert log == ""
    assert nvrtc_check.has_entry(ptx, path.stem), f"no `.entry {path.stem}` in the PTX"
    assert f".target sm_{arch.removeprefix('compute_')}" in ptx


@pytest.mark.parametrize("arch", ARCHES)
def test_copy_slots_entry_is_unmangled_with_the_launchers_parameters(arch: str) -> None:
    _require_nvrtc()
    ptx = nvrtc_check.compile_ptx(kernel_source("copy_slots"), "copy_slots.cu", arch)
    assert ".entry copy_slots(" in ptx
    header = ptx.split(".entry copy_slots(", 1)[1].split(")", 1)[0]
    params = [line.split()[1].lstrip(".") for line in header.splitlines() if ".param" in line]
    assert params == COPY_SLOTS_PARAMS


def test_nvrtc_reports_compile_errors_with_the_log() -> None:
    _require_nvrtc()
    with pytest.raises(nvrtc_check.NvrtcError, match=r"broken\.cu.*error"):
        nvrtc_check.compile_ptx('extern "C" __global__ void f() { int x = ; }', "broken.cu")


# NVRTC opens ``libnvrtc-builtins.so.X.Y`` by name when it compiles. The wheels that
# torch's CUDA 13 builds pull in keep NVRTC under ``nvidia/cu13/lib``; nvrtc_check loads
# the builtins from the directory of the library it found first. Each NVRTC found on this
# machine (cu12's and cu13's, when installed) is tried in a child interpreter, so that one
# library loaded cannot hide another's fault.
def _installed_nvrtcs() -> list[Path]:
    found = []
    for d in nvrtc_check._candidate_dirs():
        if d.is_dir():
            found.extend(sorted(p for p in d.glob("libnvrtc.so.*") if p.is_file()))
    return found


def test_builtins_beside_picks_the_same_major_version_only(tmp_path: Path) -> None:
    for name in (
        "libnvrtc.so.13",
        "libnvrtc-builtins.so.13.0",
        "libnvrtc-builtins.so.12.9",
        "libnvrtc-builtins.alt.so.13.0",
    ):
        (tmp_path / name).write_bytes(b"")
    beside = nvrtc_check._builtins_beside(tmp_path / "libnvrtc.so.13")
    assert [p.name for p in beside] == ["libnvrtc-builtins.so.13.0"]


def test_builtins_beside_an_unversioned_library_is_nothing(tmp_path: Path) -> None:
    (tmp_path / "libnvrtc-builtins.so.13.0").write_bytes(b"")
    assert nvrtc_check._builtins_beside(tmp_path / "libnvrtc.so") == []


_CHILD = textwrap.dedent(
    """
    import importlib.util, sys
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("nvrtc_check", sys.argv[1])
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    lib = Path(sys.argv[2])
    m.find_nvrtc = lambda: lib
    m._load()
    maps = Path("/proc/self/maps").read_text()
    loaded = {line.split()[-1] for line in maps.splitlines() if "libnvrtc-builtins" in line}
    print("BUILTINS", sorted(loaded))
    ptx = m.compile_ptx(Path(sys.argv[3]).read_text(), "copy_slots.cu", "compute_90")
    print("ENTRY", m.has_entry(ptx, "copy_slots"))
    """
)


@pytest.mark.parametrize("lib", _installed_nvrtcs(), ids=lambda p: p.parent.parent.name)
def test_each_installed_nvrtc_loads_its_own_builtins_and_compiles(lib: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            _CHILD,
            str(REPO / "scripts/nvrtc_check.py"),
            str(lib),
            str(REPO / "kernels/copy_slots.cu"),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    builtins = next(line for line in result.stdout.splitlines() if line.startswith("BUILTINS"))
    # Loaded before any compilation, and from the directory of the library found.
    assert str(lib.parent) in builtins, builtins
    assert "ENTRY True" in result.stdout


def test_nvrtc_check_script_passes() -> None:
    _require_nvrtc()
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts/nvrtc_check.py")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for arch in ARCHES:
        assert f"kernels/copy_slots.cu {arch}: ok" in result.stdout
