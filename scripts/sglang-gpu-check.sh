#!/usr/bin/env bash
# SGLang on a GPU: its real server on --radix-cache-backend radixcache against its default
# tree cache, on bench_serving's generated-shared-prefix workload.
#
# Usage: scripts/sglang-gpu-check.sh [WHEEL]
#   WHEEL  a radixcache wheel built elsewhere (`maturin build --release`), installed with
#          --no-deps into a temporary directory put first on PYTHONPATH (its entry point
#          registers the backend there; the machine's Python is left as it is). Without
#          WHEEL the installed radixcache (`pip install "radixcache[sglang]"`) is used.
# Needs: a CUDA machine whose Python has sglang 0.5.23 with its GPU dependencies, curl,
# and the models below (a local path or a name in the Hugging Face cache; the machine
# needs no network when they are there).
# Environment:
#   PYTHON            the interpreter (default python3)
#   HYBRID_MODEL      a small FULL+MAMBA model (default tiiuae/Falcon-H1-0.5B-Instruct)
#   ATTENTION_MODEL   a small attention-only model (default Qwen/Qwen2.5-0.5B-Instruct)
#   MODELS            which to run: "hybrid attention" (default), "hybrid" or "attention"
#   PORT              the server's port (default 30123)
#   HF_HUB_OFFLINE=1  on a machine without network, so that the models and tokenizers
#                     come from the Hugging Face cache without trying the hub
#   OUT               where logs and results go (default target/sglang-gpu-check)
#   GSP_ARGS          bench_serving's workload (default: 16 groups of 32 prompts, a
#                     2,048-token shared system prompt, 256-token questions, 64 output
#                     tokens, at most 32 requests in flight)
#   SERVER_ARGS       more server flags, for both runs (default --mem-fraction-static 0.6
#                     --enable-deterministic-inference, so that greedy outputs do not
#                     depend on how requests were batched; drop that flag where the
#                     model's attention backend does not support it)
#
# For each model: the server starts on SGLang's default cache, then on radixcache (its log
# must say the registry built RadixCacheBackend); each serves the same generated requests
# greedily (temperature 0, the same seed); the results (bench_serving's JSONL, with
# --output-details and --cache-report) are compared: outputs identical request by request,
# the cache hit rate (radixcache's at least the default's on the hybrid model; within 2%
# on the attention-only one, where both caches keep the same prefixes), mean TTFT and
# output throughput side by side. Exits 1 when an output differs or a hit-rate check
# fails, 2 on a usage or setup problem (no GPU, no sglang, a server that did not start).
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
py=${PYTHON:-python3}
port=${PORT:-30123}
out=${OUT:-target/sglang-gpu-check}
hybrid_model=${HYBRID_MODEL:-tiiuae/Falcon-H1-0.5B-Instruct}
attention_model=${ATTENTION_MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
read -r -a models <<<"${MODELS:-hybrid attention}"
read -r -a gsp <<<"${GSP_ARGS:---gsp-num-groups 16 --gsp-prompts-per-group 32 --gsp-system-prompt-len 2048 --gsp-question-len 256 --gsp-output-len 64 --max-concurrency 32}"
read -r -a server_args <<<"${SERVER_ARGS:---mem-fraction-static 0.6 --enable-deterministic-inference}"
step() { printf '\n==> sglang-gpu-check: %s (%ss)\n' "$*" "$SECONDS"; }
fail() { echo "sglang-gpu-check: $*" >&2; exit 2; }

if [[ $# -gt 1 || ${1:-} == -* ]]; then
  echo "usage: scripts/sglang-gpu-check.sh [WHEEL]" >&2
  exit 2
fi
mkdir -p "$out"
site= server_pid=
stop_server() {
  if [[ -n $server_pid ]]; then
    kill "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
    server_pid=
  fi
}
trap 'stop_server; if [[ -n $site ]]; then rm -rf "$site"; fi' EXIT
if [[ $# -eq 1 ]]; then
  [[ -f $1 ]] || fail "no such wheel: $1"
  site=$(mktemp -d)
  "$py" -m pip install -q --no-deps --target "$site" "$1"
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi

step "environment"
"$py" - <<'EOF' || exit 2
import sys
try:
    import torch
    import sglang
except ImportError as e:
    sys.exit(f"sglang-gpu-check: {e}: this needs sglang 0.5.23 with its GPU dependencies")
if not torch.cuda.is_available():
    sys.exit("sglang-gpu-check: no CUDA device")
from importlib.metadata import entry_points, version

names = [ep.name for ep in entry_points(group="sglang.srt.plugins")]
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, sglang {version('sglang')}, "
      f"radixcache {version('radixcache')}, GPU {torch.cuda.get_device_name(0)}; "
      f"sglang.srt.plugins entry points: {names}")
if version("sglang") != "0.5.23":
    sys.exit("sglang-gpu-check: radixcache's backend is written against sglang 0.5.23")
EOF

# run NAME MODEL CACHE: one server, one benchmark; the results in $out/NAME-CACHE.jsonl
run() {
  local name=$1 model=$2 cache=$3 flags=()
  local log="$out/$name-$cache.server.log" result="$out/$name-$cache.jsonl"
  if [[ $cache == radixcache ]]; then flags=(--radix-cache-backend radixcache); fi
  step "$name model ($model) on the $cache cache: server"
  rm -f "$result"
  "$py" -m sglang.launch_server --model-path "$model" --port "$port" --random-seed 0 \
    "${server_args[@]}" "${flags[@]}" >"$log" 2>&1 &
  server_pid=$!
  local waited=0
  until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
    if ! kill -0 "$server_pid" 2>/dev/null; then
      tail -n 30 "$log" >&2
      fail "the server exited (log: $log)"
    fi
    waited=$((waited + 5))
    if ((waited > 900)); then fail "the server did not start in 15 minutes ($log)"; fi
    sleep 5
  done
  if [[ $cache == radixcache ]] && ! grep -q "source=registered('radixcache') impl=RadixCacheBackend" "$log"; then
    stop_server
    fail "the server did not build radixcache's backend (log: $log)"
  fi
  step "$name model on the $cache cache: bench_serving, generated-shared-prefix"
  "$py" -m sglang.benchmark.serving --backend sglang --host 127.0.0.1 --port "$port" \
    --model "$model" --dataset-name generated-shared-prefix "${gsp[@]}" --seed 0 \
    --temperature 0 --cache-report --output-details --disable-tqdm --output-file "$result"
  stop_server
}

status=0
for name in "${models[@]}"; do
  case $name in
    hybrid) model=$hybrid_model ;;
    attention) model=$attention_model ;;
    *) fail "MODELS: 'hybrid' and/or 'attention', got '$name'" ;;
  esac
  run "$name" "$model" default
  run "$name" "$model" radixcache
  step "$name model: radixcache against SGLang's default"
  "$py" - "$name" "$out/$name-default.jsonl" "$out/$name-radixcache.jsonl" <<'EOF' || status=1
import json
import sys

name, paths = sys.argv[1], sys.argv[2:]
default, ours = ([json.loads(line) for line in open(p)][-1] for p in paths)
a, b = default["generated_texts"], ours["generated_texts"]
differ = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
rows = [("completed", "completed", "{}"),
        ("hit rate %", None, "{:.2f}"),
        ("mean TTFT ms", "mean_ttft_ms", "{:.1f}"),
        ("p99 TTFT ms", "p99_ttft_ms", "{:.1f}"),
        ("output tok/s", "output_throughput", "{:.1f}"),
        ("total tok/s", "total_throughput", "{:.1f}")]
print(f"{'':16}{'default':>14}{'radixcache':>14}")
for label, key, fmt in rows:
    vals = [r["cache_report"]["cache_hit_rate_pct"] if key is None else r[key]
            for r in (default, ours)]
    print(f"{label:16}" + "".join(f"{fmt.format(v):>14}" for v in vals))
hit_d, hit_r = (r["cache_report"]["cache_hit_rate_pct"] for r in (default, ours))
ok = True
if len(a) != len(b) or differ:
    print(f"FAIL outputs: {len(differ)} of {len(a)} differ (first: request {differ[:1]})")
    ok = False
else:
    print(f"ok   outputs: all {len(a)} identical (greedy)")
if name == "hybrid" and hit_r < hit_d:
    print(f"FAIL hit rate: radixcache {hit_r:.2f}% below the default's {hit_d:.2f}%")
    ok = False
elif name == "attention" and abs(hit_r - hit_d) > 0.02 * max(hit_d, 1e-9):
    print(f"FAIL hit rate: radixcache {hit_r:.2f}% vs the default's {hit_d:.2f}% (> 2% apart)")
    ok = False
else:
    print(f"ok   hit rate: radixcache {hit_r:.2f}%, default {hit_d:.2f}%")
sys.exit(0 if ok else 1)
EOF
done
step "done (results in $out)"
exit "$status"
