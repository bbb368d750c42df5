"""How scripts/nvrtc_check.py loads NVRTC: the builtins library beside the one it found.

NVRTC opens ``libnvrtc-builtins.so.X.Y`` by name when it compiles. The wheels that torch's
CUDA 13 builds pull in keep NVRTC under ``nvidia/cu13/lib``; without the builtins loaded
from that same directory first, compiling fails there with "libnvrtc-builtins ... not
found". Each NVRTC found on this machine (cu12's and cu13's, when installed) is tried in a
child interpreter, so that one library loaded cannot hide another's fault.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _load_nvrtc_check() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("nvrtc_check", REPO / "scripts/nvrtc_check.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


nvrtc_check = _load_nvrtc_check()


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
