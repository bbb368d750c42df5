"""Compile every ``kernels/*.cu`` to PTX with NVRTC, without a GPU.

NVRTC is a library that compiles CUDA C++ to PTX on the CPU; no driver or device is
needed. It comes from PyPI: ``pip install nvidia-cuda-nvrtc-cu12``. The kernels are
compiled the way ``radixcache._kernels`` compiles them at run time through CuPy
(``--std=c++14``, no headers), for each architecture in ``ARCHES``, and each file's PTX
must define the ``extern "C"`` entry named after the file's stem.

Usage: ``python scripts/nvrtc_check.py`` (exit status 1 on any failure). Importable:
``compile_ptx`` and ``find_nvrtc`` are used by ``tests/test_kernels.py``.
"""

from __future__ import annotations

import ctypes
import importlib.util
import re
import sys
from pathlib import Path
from typing import Any

#: Architectures checked by ``main``: Ampere (A100) and Hopper (H100/H200).
ARCHES = ("compute_80", "compute_90")

#: The repository's kernel sources.
KERNELS_DIR = Path(__file__).resolve().parents[1] / "kernels"

#: Library file names of NVRTC, most specific first (Linux, then Windows).
_LIB_GLOBS = ("libnvrtc.so.*", "libnvrtc.so", "nvrtc64_*.dll")


class NvrtcError(RuntimeError):
    """An NVRTC call failed; for a failed compilation the message holds the log."""


def _candidate_dirs() -> list[Path]:
    """Directories where a pip-installed NVRTC may keep its library, in search order."""
    roots: list[Path] = []
    spec = importlib.util.find_spec("nvidia")
    if spec is not None and spec.submodule_search_locations is not None:
        roots.extend(Path(p) for p in spec.submodule_search_locations)
    roots.extend(Path(p) / "nvidia" for p in sys.path if p)
    dirs: list[Path] = []
    for root in roots:
        for sub in ("cuda_nvrtc/lib", "cuda_nvrtc/bin", "cu13/lib", "cu13/bin"):
            d = root / sub
            if d not in dirs:
                dirs.append(d)
    return dirs


def find_nvrtc() -> Path | None:
    """Return the path of the NVRTC shared library installed from PyPI, or None.

    Looks in the ``nvidia`` namespace package (``nvidia-cuda-nvrtc-cu12``) found by
    ``importlib.util.find_spec``, then under ``nvidia/`` in every ``sys.path`` entry.

    Returns:
        The library's path, or None when NVRTC is not installed.
    """
    for d in _candidate_dirs():
        if not d.is_dir():
            continue
        for pattern in _LIB_GLOBS:
            hits = sorted(p for p in d.glob(pattern) if p.is_file())
            if hits:
                return hits[0]
    return None


def _builtins_beside(path: Path) -> list[Path]:
    """Return the NVRTC builtins libraries in the directory of the library at ``path``.

    Only those of the same major version as ``path`` (``libnvrtc.so.13`` loads
    ``libnvrtc-builtins.so.13.*``); the ``.alt`` variants are left alone.
    """
    major = path.name.rpartition(".so.")[2].split(".")[0]
    if not major.isdigit():
        return []
    return sorted(p for p in path.parent.glob(f"libnvrtc-builtins.so.{major}.*") if p.is_file())


_lib: ctypes.CDLL | None = None


def _load() -> ctypes.CDLL:
    """Load NVRTC once and declare the signatures of the functions used here."""
    global _lib
    if _lib is not None:
        return _lib
    path = find_nvrtc()
    if path is None:
        raise NvrtcError(
            "NVRTC library not found; install it with `pip install nvidia-cuda-nvrtc-cu12`"
        )
    # NVRTC opens its builtins library (``libnvrtc-builtins.so.X.Y``) by name when it
    # compiles. Some wheels (torch's CUDA 13 ones, under ``nvidia/cu13/lib``) carry no
    # search path that leads there, so load the builtins found beside the library first:
    # the dynamic loader then resolves NVRTC's request to the copy already loaded.
    for builtins in _builtins_beside(path):
        ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(str(path))
    prog_p = ctypes.POINTER(ctypes.c_void_p)
    strs = ctypes.POINTER(ctypes.c_char_p)
    size_p = ctypes.POINTER(ctypes.c_size_t)
    signatures: dict[str, list[Any]] = {
        "nvrtcCreateProgram": [prog_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int, strs, strs],
        "nvrtcCompileProgram": [ctypes.c_void_p, ctypes.c_int, strs],
        "nvrtcGetProgramLogSize": [ctypes.c_void_p, size_p],
        "nvrtcGetProgramLog": [ctypes.c_void_p, ctypes.c_char_p],
        "nvrtcGetPTXSize": [ctypes.c_void_p, size_p],
        "nvrtcGetPTX": [ctypes.c_void_p, ctypes.c_char_p],
        "nvrtcDestroyProgram": [prog_p],
        "nvrtcVersion": [ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)],
    }
    for fname, argtypes in signatures.items():
        fn = getattr(lib, fname)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
    lib.nvrtcGetErrorString.argtypes = [ctypes.c_int]
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    _lib = lib
    return lib


def _check(lib: ctypes.CDLL, status: int, what: str) -> None:
    """Raise NvrtcError when an NVRTC call returned an error status."""
    if status != 0:
        msg = lib.nvrtcGetErrorString(status)
        text = msg.decode() if isinstance(msg, bytes) else str(status)
        raise NvrtcError(f"{what} failed: {text}")


def nvrtc_version() -> tuple[int, int]:
    """Return NVRTC's (major, minor) version."""
    lib = _load()
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(lib, lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


def compile_program(source: str, name: str, arch: str = "compute_90") -> tuple[str, str]:
    """Compile CUDA C++ source to PTX and return the PTX and the compiler log.

    Args:
        source: The CUDA C++ source.
        name: The program's file name, used in diagnostics (e.g. ``copy_slots.cu``).
        arch: The virtual architecture, e.g. ``compute_90``.

    Returns:
        ``(ptx, log)``; the log holds warnings, if any (empty when there are none).

    Raises:
        NvrtcError: NVRTC is missing, or the compilation failed (the log is in the message).
    """
    lib = _load()
    prog = ctypes.c_void_p()
    _check(
        lib,
        lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None),
        "nvrtcCreateProgram",
    )
    try:
        opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++14"]
        c_opts = (ctypes.c_char_p * len(opts))(*opts)
        status = lib.nvrtcCompileProgram(prog, len(opts), c_opts)
        log_size = ctypes.c_size_t()
        _check(lib, lib.nvrtcGetProgramLogSize(prog, ctypes.byref(log_size)), "log size")
        log_buf = ctypes.create_string_buffer(max(log_size.value, 1))
        _check(lib, lib.nvrtcGetProgramLog(prog, log_buf), "nvrtcGetProgramLog")
        log = log_buf.value.decode(errors="replace").strip()
        if status != 0:
            raise NvrtcError(f"compiling {name} for {arch} failed:\n{log}")
        ptx_size = ctypes.c_size_t()
        _check(lib, lib.nvrtcGetPTXSize(prog, ctypes.byref(ptx_size)), "nvrtcGetPTXSize")
        ptx_buf = ctypes.create_string_buffer(ptx_size.value)
        _check(lib, lib.nvrtcGetPTX(prog, ptx_buf), "nvrtcGetPTX")
        return ptx_buf.value.decode(), log
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def compile_ptx(source: str, name: str, arch: str = "compute_90") -> str:
    """Compile CUDA C++ source to PTX.

    Args:
        source: The CUDA C++ source.
        name: The program's file name, used in diagnostics (e.g. ``copy_slots.cu``).
        arch: The virtual architecture, e.g. ``compute_90``.

    Returns:
        The PTX text.

    Raises:
        NvrtcError: NVRTC is missing, or the compilation failed (the log is in the message).
    """
    return compile_program(source, name, arch)[0]


def has_entry(ptx: str, kernel: str) -> bool:
    """Whether the PTX defines the kernel entry ``kernel`` (an unmangled, extern "C" name)."""
    return re.search(rf"\.entry\s+{re.escape(kernel)}\s*\(", ptx) is not None


def main() -> int:
    """Compile every ``kernels/*.cu`` for every architecture in ``ARCHES``; print one line each.

    Returns:
        0 when every file compiled without warnings and defines its entry, else 1.
    """
    if find_nvrtc() is None:
        print("NVRTC not found: pip install nvidia-cuda-nvrtc-cu12", file=sys.stderr)
        return 1
    major, minor = nvrtc_version()
    print(f"NVRTC {major}.{minor}")
    sources = sorted(KERNELS_DIR.glob("*.cu"))
    if not sources:
        print(f"no kernels in {KERNELS_DIR}", file=sys.stderr)
        return 1
    failed = False
    for path in sources:
        rel = f"{KERNELS_DIR.name}/{path.name}"
        source = path.read_text(encoding="utf-8")
        for arch in ARCHES:
            try:
                ptx, log = compile_program(source, path.name, arch)
            except NvrtcError as e:
                print(f"{rel} {arch}: FAILED\n{e}")
                failed = True
                continue
            if log:
                print(f"{rel} {arch}: FAILED (warnings)\n{log}")
                failed = True
            elif not has_entry(ptx, path.stem):
                print(f"{rel} {arch}: FAILED (no `.entry {path.stem}` in the PTX)")
                failed = True
            else:
                print(f"{rel} {arch}: ok, PTX {len(ptx)} bytes, .entry {path.stem}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
