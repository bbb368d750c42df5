#!/usr/bin/env bash
# Makes a virtual environment in which benches/vs_sglang.py runs both sides: radixcache
# (built from this checkout) and SGLang 0.5.23's prefix caches on a CPU-only machine.
#
#   benches/setup-sglang.sh [VENV]      # default VENV: .venv-sglang
#   VENV/bin/python benches/vs_sglang.py --workload mixed
#   VENV/bin/python benches/sglang_backend.py          # the SGLang backend, proved in SGLang
#
# What it installs (the facts behind it: docs/benchmarks.md, "Side by side with SGLang"):
# - torch 2.13.0 from PyPI: SGLang's bundled Rust tree core links libtorch and loads only
#   with torch 2.11-2.13 (vs_sglang.py refuses to report a Rust run that fell back);
# - sglang 0.5.23 without its dependencies (the full set pulls in GPU-only packages);
# - the small pure-Python packages its import chain really uses; the heavy ones it reaches
#   but no cache path calls are placeholders registered by benches/_sglang_shim.py;
# - radixcache with the plot extra (vs_sglang.py --plot); its entry point registers the
#   SGLang backend `radixcache` (sglang_backend.py drives it by that name).
# PYTHON picks the interpreter (3.10 or newer; default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv-sglang}
python=${PYTHON:-python3}
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || {
  echo "setup-sglang: SGLang 0.5.23 needs Python 3.10 or newer ($python is older)" >&2
  exit 2
}
"$python" -m venv "$venv"
pip="$venv/bin/python -m pip"

# Every install after sglang's makes pip's resolver list each requirement of sglang that
# is missing or of another version (about 70 lines, under "ERROR: pip's dependency
# resolver does not currently take into account ..."): expected, since sglang is
# installed without its dependencies on purpose. Those lines are counted and dropped;
# every other line pip prints, and its exit status, pass through.
expected='^(sglang 0\.5\.23 requires |ERROR: pip.s dependency resolver does not currently take into account )'
pip_install() {
  local out status=0
  out=$($pip install -q "$@" 2>&1) || status=$?
  [ -z "$out" ] || grep -vE "$expected" <<<"$out" >&2 || true
  local n
  n=$(grep -cE '^sglang 0\.5\.23 requires ' <<<"$out" || true)
  if [ "$n" -gt 0 ]; then
    echo "setup-sglang: ($n notes of pip's resolver on sglang's own requirements dropped: expected)" >&2
  fi
  return "$status"
}

pip_install --upgrade pip
echo "setup-sglang: torch 2.13.0 (a CUDA build from PyPI, a few GB; it runs on the CPU)"
pip_install "torch==2.13.0"
echo "setup-sglang: sglang 0.5.23 (no dependencies) and what its import chain needs"
pip_install --no-deps "sglang==0.5.23"
pip_install psutil pybase64 msgspec dill orjson requests packaging pydantic IPython regex numpy
echo "setup-sglang: radixcache from this checkout"
pip_install ".[plot]"
"$venv/bin/python" benches/vs_sglang.py --requests 20 --quiet --json >/dev/null
echo "setup-sglang: ready: $venv/bin/python benches/vs_sglang.py --workload mixed"
