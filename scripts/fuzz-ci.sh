#!/usr/bin/env bash
# Fuzz CI: about a minute of coverage-guided fuzzing (cargo-fuzz + libFuzzer, fuzz/), each
# target starting from its committed corpus: three quarters of it for radixcache-core (the
# `ops` target, fuzz/corpus/ops), a quarter for what an L3 store sends back (the `store`
# target: RESP replies and frames, fuzz/corpus/store).
#
# Exits non-zero on a finding: a panic in the core, the RESP reader, the frame reader or in
# a harness's checks (an audit() failure, a leak, a call that broke the API's contract,
# memory that follows an announced length), a timeout or an out-of-memory. The input that
# found it is saved under fuzz/artifacts/<target>/; replay it with
#   cargo +nightly fuzz run -s none -a <target> fuzz/artifacts/<target>/<file>
#
# Needs the nightly toolchain (cargo-fuzz builds with -Z flags); installs cargo-fuzz if missing.
# FUZZ_SECONDS sets the fuzzing time of both targets together (default 60).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never
seconds=${FUZZ_SECONDS:-60}
step() { printf '\n==> fuzz-ci: %s (%ss)\n' "$*" "$SECONDS"; }

if ! cargo +nightly --version >/dev/null 2>&1; then
  echo "fuzz-ci: the nightly toolchain is missing (rustup toolchain install nightly)" >&2
  exit 2
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
  step "install cargo-fuzz"
  cargo install cargo-fuzz --locked
fi

# libFuzzer writes what it finds into the first corpus directory: a scratch one per target,
# so that the committed corpora (read as seeds) stay as they are.
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

# -s none: neither crate has unsafe code, and without AddressSanitizer the targets run about
# three times as fast. -a: debug_assert!s and overflow checks are on.
# -timeout: one input runs in milliseconds; 10 s means a hang. -rss_limit_mb: the store
# target's reader must allocate with what arrives, never with a length a reply announces.
step "build the ops and store targets"
cargo +nightly fuzz build -s none -a
store_seconds=$((seconds / 4 > 0 ? seconds / 4 : 1))
ops_seconds=$((seconds - store_seconds > 0 ? seconds - store_seconds : 1))
for run in "ops:$ops_seconds" "store:$store_seconds"; do
  target=${run%%:*}
  secs=${run#*:}
  step "fuzz $target for ${secs}s from fuzz/corpus/$target"
  mkdir -p "$scratch/$target"
  cargo +nightly fuzz run -s none -a "$target" "$scratch/$target" "fuzz/corpus/$target" -- \
    -max_total_time="$secs" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1
done
step "done"
