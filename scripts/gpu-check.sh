#!/usr/bin/env bash
# GPU check: the GPU tests and the copy-bandwidth benchmark, on a CUDA machine that has
# Python with CuPy and numpy (and pytest), but no Rust toolchain and no network.
#
# Usage: scripts/gpu-check.sh [WHEEL]
#   WHEEL  an abi3 radixcache wheel built elsewhere (`maturin build --release` writes it to
#          target/wheels/) and carried here. It is installed with --no-deps into a temporary
#          directory put first on PYTHONPATH, so the machine's Python is left as it is.
#          Without WHEEL the installed (or editable) radixcache is used.
# Environment:
#   PYTHON          the interpreter (default python3)
#   GPU_CHECK_ARGS  extra arguments for benches/copy_bandwidth.py, e.g. "--quick" or
#                   "--json --check"; they come after the defaults (--repeat 10) and so
#                   override them
#
# Steps: one line naming Python, CuPy, the CUDA runtime and driver and the GPU;
# `pytest -q -m gpu tests/gpu`; `benches/copy_bandwidth.py --device cuda --repeat 10`.
# Exits 1 when the tests or the benchmark failed (a failed correctness check of a copy is a
# benchmark failure; a missed performance goal is not, unless GPU_CHECK_ARGS has --check),
# or when pytest is missing (the benchmark still runs); 2 on a usage or install problem.
#
# Without a GPU (CuPy missing, or no CUDA device) it says so and runs the CPU side instead,
# `benches/copy_bandwidth.py --device cpu --quick` (under a minute), exiting with its status:
# 0 when it works.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
py=${PYTHON:-python3}
step() { printf '\n==> gpu-check: %s (%ss)\n' "$*" "$SECONDS"; }
read -r -a extra <<<"${GPU_CHECK_ARGS:-}"

if [[ $# -gt 1 || ${1:-} == -* ]]; then
  echo "usage: scripts/gpu-check.sh [WHEEL]" >&2
  exit 2
fi

if [[ $# -eq 1 ]]; then
  wheel=$1
  if [[ ! -f $wheel ]]; then
    echo "gpu-check: no such wheel: $wheel" >&2
    exit 2
  fi
  target=$(mktemp -d "${TMPDIR:-/tmp}/radixcache-wheel.XXXXXX")
  trap 'rm -rf "$target"' EXIT
  step "install $wheel into $target (first on PYTHONPATH)"
  if "$py" -m pip --version >/dev/null 2>&1; then
    "$py" -m pip install -q --no-index --no-deps --force-reinstall --target "$target" "$wheel" ||
      { echo "gpu-check: pip could not install $wheel" >&2; exit 2; }
  else
    # No pip: a wheel is a zip archive whose root goes onto sys.path.
    echo "gpu-check: pip is missing; unpacking the wheel with zipfile"
    "$py" -m zipfile -e "$wheel" "$target" ||
      { echo "gpu-check: could not unpack $wheel" >&2; exit 2; }
  fi
  export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"
fi

if ! "$py" -c 'import radixcache' >/dev/null 2>&1; then
  "$py" -c 'import radixcache' || true
  echo "gpu-check: radixcache does not import with $py: pass a wheel (scripts/gpu-check.sh" \
    "WHEEL) or install it" >&2
  exit 2
fi

# One line about the machine, or the reason there is no usable GPU (exit status 1).
if probe=$(
  "$py" - <<'EOF'
import platform
import sys

import radixcache

where = f"radixcache {radixcache.__version__} from {radixcache.__file__}"
try:
    import cupy
except Exception as e:
    print(f"no GPU: CuPy does not import ({type(e).__name__}: {e}); {where}")
    sys.exit(1)
try:
    count = cupy.cuda.runtime.getDeviceCount()
except Exception as e:
    print(f"no GPU: no usable CUDA device ({type(e).__name__}: {e}); {where}")
    sys.exit(1)
if count == 0:
    print(f"no GPU: CuPy sees no CUDA device; {where}")
    sys.exit(1)
rt = cupy.cuda.runtime
name = rt.getDeviceProperties(0)["name"]
name = name.decode() if isinstance(name, bytes) else str(name)


def version(v):
    return f"{v // 1000}.{v % 1000 // 10}"


print(
    f"python {platform.python_version()}, cupy {cupy.__version__}, CUDA runtime"
    f" {version(rt.runtimeGetVersion())}, driver {version(rt.driverGetVersion())},"
    f" GPU 0 of {count}: {name}; {where}"
)
EOF
); then
  echo "gpu-check: $probe"
else
  echo "gpu-check: $probe"
  echo "gpu-check: no GPU here, so no GPU tests; running the CPU side of the benchmark" \
    "(--device cpu --quick)"
  status=0
  "$py" benches/copy_bandwidth.py --device cpu --quick ${extra[@]+"${extra[@]}"} || status=$?
  exit "$status"
fi

failed=()
step "GPU tests: pytest -q -m gpu tests/gpu"
if "$py" -c 'import pytest' >/dev/null 2>&1; then
  # In one process: pyproject.toml's addopts spread the tests over every core with
  # pytest-xdist, which a GPU machine's Python may lack (then its -n must not reach pytest).
  if "$py" -c 'import xdist' >/dev/null 2>&1; then one=(-n 0); else one=(-o "addopts=-ra --strict-markers"); fi
  "$py" -m pytest -q -p no:cacheprovider "${one[@]}" -m gpu tests/gpu || failed+=("GPU tests (exit $?)")
else
  failed+=("GPU tests (pytest is missing)")
  cat <<EOF
gpu-check: pytest is not installed for $py, so the GPU tests did not run. To carry it:
  on a machine with network:  python3 -m pip download -d pytest-wheels pytest
  here, with pytest-wheels/ copied over:
    python3 -m pip install --no-index --find-links pytest-wheels --target /tmp/pytest pytest
    PYTHONPATH=/tmp/pytest scripts/gpu-check.sh [WHEEL]
gpu-check: going on with the benchmark; the exit status will be non-zero.
EOF
fi

step "copy bandwidth: benches/copy_bandwidth.py --device cuda --repeat 10 ${extra[*]:-}"
"$py" benches/copy_bandwidth.py --device cuda --repeat 10 ${extra[@]+"${extra[@]}"} ||
  failed+=("benchmark (exit $?)")

step "done"
if [[ ${#failed[@]} -gt 0 ]]; then
  printf 'gpu-check: FAILED: %s\n' "${failed[@]}"
  exit 1
fi
echo "gpu-check: OK"
