#!/usr/bin/env bash
# Fuzz CI: about a minute of coverage-guided fuzzing of radixcache-core (the `ops` target in
# fuzz/, cargo-fuzz + libFuzzer), starting from the committed corpus fuzz/corpus/ops.
#
# Exits non-zero on a finding: a panic in the core or in the harness's checks (an audit()
# failure, a leak, a call that broke the API's contract), a timeout or an out-of-memory. The
# input that found it is saved under fuzz/artifacts/ops/; replay it with
#   cargo +nightly fuzz run -s none -a ops fuzz/artifacts/ops/<file>
#
# Needs the nightly toolchain (cargo-fuzz builds with -Z flags); installs cargo-fuzz if missing.
# FUZZ_SECONDS sets the fuzzing time (default 60).
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

# libFuzzer writes what it finds into the first corpus directory: a scratch one, so that the
# committed corpus (read as a seed) stays as it is.
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

# -s none: the core has no unsafe code, and without AddressSanitizer the target runs about
# three times as fast. -a: the core's debug_assert!s and overflow checks are on.
# -timeout: one input runs in milliseconds; 10 s means a hang.
step "build the ops target"
cargo +nightly fuzz build -s none -a ops
step "fuzz for ${seconds}s from fuzz/corpus/ops"
cargo +nightly fuzz run -s none -a ops "$scratch" fuzz/corpus/ops -- \
  -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1
step "done"
