"""The SWA models' checked replays of docs/serving.md: every workload and write policy.

For each model (``swa``, ``swa-hybrid``), workload (``gsp``, ``multiturn``, ``mixed``)
and write policy, it runs

    radixcache replay --model MODEL --workload W --write-policy P --inject-failures 0.2
        --requests N --json --quiet [EXTRA...]

(the command line itself, one process per cell, ``--jobs`` at once), keeps each report
as JSON in ``--results`` (a rerun skips what is there), and prints a markdown table:
mismatches, audit, pools full, hit rate, the hit rate with the SWA layers as full
attention and the ratio of the two. It exits 1 unless every cell has 0 mismatches, a
passing audit, every pool full once the cache is cleared and no request rejected.

    python scripts/swa_replays.py --requests 300 --results swa/ --jobs 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

MODELS = ("swa", "swa-hybrid")
WORKLOADS = ("gsp", "multiturn", "mixed")
POLICIES = ("write_through", "write_through_selective", "write_back")


def command(model: str, workload: str, policy: str, args: argparse.Namespace) -> list[str]:
    """Return the replay's command line for one cell."""
    cmd = ["radixcache", "replay", "--model", model, "--workload", workload]
    cmd += ["--write-policy", policy, "--inject-failures", str(args.inject_failures)]
    if args.requests:
        cmd += ["--requests", str(args.requests)]
    return [*cmd, *args.extra, "--json", "--quiet"]


def run(cell: tuple[str, str, str], args: argparse.Namespace) -> dict[str, Any]:
    """Run one cell (or read its kept report)."""
    path = Path(args.results) / f"{'-'.join(cell)}.json"
    if path.exists():
        return dict(json.loads(path.read_text()))
    done = subprocess.run(command(*cell, args), capture_output=True, text=True, check=False)
    if not done.stdout.strip():
        raise SystemExit(f"{' '.join(command(*cell, args))}: {done.stderr.strip()}")
    report = dict(json.loads(done.stdout))
    path.write_text(json.dumps(report, indent=2))
    return report


def good(r: dict[str, Any]) -> bool:
    """Whether a cell passed: no mismatch, audit, pools full, nothing rejected."""
    return (
        r["mismatches"] == 0
        and r["audit"] == "pass"
        and r["pools_full_at_end"]
        and not r["rejected"]
    )


def main() -> int:
    """Run every cell, print the table; 1 unless every cell passed."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=0, help="requests per replay (0: all)")
    ap.add_argument("--inject-failures", type=float, default=0.2)
    ap.add_argument("--results", default="swa-replays", help="directory of the JSON reports")
    ap.add_argument("--jobs", type=int, default=1, help="replays at once")
    ap.add_argument("extra", nargs="*", help="more replay flags (after --)")
    args = ap.parse_args()
    Path(args.results).mkdir(parents=True, exist_ok=True)
    cells = [(m, w, p) for m in MODELS for w in WORKLOADS for p in POLICIES]
    with ThreadPoolExecutor(args.jobs) as pool:
        reports = list(pool.map(lambda c: run(c, args), cells))
    print(
        "| model | workload | write policy | mismatches | samples | audit | pools full "
        "| hit rate | full-attention hit rate | swa/full |"
    )
    print("|---|---|---|---:|---:|---|---|---:|---:|---:|")
    for (m, w, p), r in zip(cells, reports):
        ratio = r["swa_vs_full_hit_ratio"]
        full = r["full_attention_hit_rate"]
        print(
            f"| {m} | {w} | {p} | {r['mismatches']} | {r['samples_checked']} | {r['audit']} "
            f"| {r['pools_full_at_end']} | {r['device_hit_rate']:.3f} "
            f"| {'n/a' if full is None else f'{full:.3f}'} "
            f"| {'n/a' if ratio is None else f'{ratio:.3f}'} |"
        )
    return 0 if all(good(r) for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
