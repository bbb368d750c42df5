"""The admission orders of docs/serving.md ("Cache-aware admission"): FCFS against LPM.

For each workload, state pool size, eviction policy and schedule policy it runs the
replay of ``radixcache replay`` in process, as scripts/policy_sweep.py does
(``--host-kv-slots 0``, the default KV pool and scheduler, no checksum model:
``ReplayConfig(oracle=False)``) with the offline bound recorded, and the attention-only
replay once per workload, KV policy and schedule policy; LPM with ``--window`` and
``--max-overtakes``. ``--check`` replays the named cells again with the model and its
oracle, which must see 0 mismatches and the same hit rate. Reports are kept as JSON in
``--results`` (a rerun skips what is there); the markdown table goes to stdout (and
``--table``): per cell the hybrid/attention-only ratio (over the attention-only replay
of the same schedule policy, and over FCFS's), the offline bound of that run's order,
the scheduler steps, and the queue wait and overtakes (p99 / max).

    python scripts/schedule_sweep.py --results sched/ --check gsp:64:lru:lpm

Every cell must pass its audit, have every pool full once the cache is cleared and no
request rejected; the script exits 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, cast

import radixcache.serving as sv
from radixcache.serving.harness import PolicyName, attention_only
from radixcache.serving.scheduler import SCHEDULE_POLICIES, SchedulePolicy

WORKLOADS = ("gsp", "mixed", "multiturn")
STATES = (64, 256)
POLICIES = ("lru", "state-value")


def config(
    policy: str, states: int, schedule: str, window: int, overtakes: int, **kw: Any
) -> sv.ReplayConfig:
    """Return the replay settings: the defaults, no host tier, the admission order."""
    return sv.ReplayConfig(
        mamba_slots=states,
        host_kv_slots=0,
        eviction_policy=cast("PolicyName", policy),
        schedule_policy=cast("SchedulePolicy", schedule),
        schedule_window=window,
        max_overtakes=overtakes,
        **kw,
    )


def _task(
    key: tuple[str, ...], window: int, overtakes: int
) -> tuple[tuple[str, ...], dict[str, Any]]:
    kind, workload = key[0], key[1]
    jobs = sv.load(workload)
    if kind == "attention":
        kv, schedule = key[2], key[3]
        c = attention_only(jobs, config(kv, 0, schedule, window, overtakes))
        return key, {"hit_rate": c.device_hit_tokens / c.prompt_tokens, "steps": c.steps}
    states, policy, schedule = int(key[2]), key[3], key[4]
    checked = kind == "check"
    cfg = config(
        policy,
        states,
        schedule,
        window,
        overtakes,
        offline_bound=not checked,
        attention_only=False,
        oracle=checked,
    )
    report, _ = sv.replay(jobs, cfg)
    return key, report


def ok(r: dict[str, Any]) -> bool:
    """Return the replay's checks: no mismatch, audit pass, pools full, nothing rejected."""
    return bool(
        r["mismatches"] == 0
        and r["audit"] == "pass"
        and r["pools_full_at_end"]
        and not r["rejected"]
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sweep (see the module docstring); returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default="schedule-results", help="directory of per-cell JSON")
    ap.add_argument("--table", help="write the markdown table here too")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument("--states", nargs="+", type=int, default=list(STATES))
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--window", type=int, default=128, help="--schedule-window of lpm")
    ap.add_argument("--max-overtakes", type=int, default=128, help="--max-overtakes of lpm")
    ap.add_argument("--jobs", type=int, default=1, help="replays run at once")
    ap.add_argument(
        "--check",
        nargs="*",
        default=[],
        help="cells replayed again with the oracle, as WORKLOAD:STATES:POLICY:SCHEDULE",
    )
    a = ap.parse_args(argv)
    results = Path(a.results)
    results.mkdir(parents=True, exist_ok=True)
    scheds = SCHEDULE_POLICIES
    kvs = dict.fromkeys("lru" if p == "state-value" else p for p in a.policies)
    keys: list[tuple[str, ...]] = []
    for w in a.workloads:
        keys += [("attention", w, kv, s) for kv in kvs for s in scheds]
        keys += [("cell", w, str(m), p, s) for m in a.states for p in a.policies for s in scheds]
    keys += [("check", *c.split(":")) for c in a.check]
    path = {
        k: results
        / ("-".join(k) + (f"-w{a.window}-o{a.max_overtakes}" if "lpm" in k else "") + ".json")
        for k in keys
    }
    out = {k: json.loads(path[k].read_text()) for k in keys if path[k].exists()}
    todo = [k for k in keys if k not in out]
    with ProcessPoolExecutor(a.jobs) as pool:
        for key, r in pool.map(_task, todo, [a.window] * len(todo), [a.max_overtakes] * len(todo)):
            path[key].write_text(json.dumps(r))
            out[key] = r
            print(" ".join(key), file=sys.stderr)
    head = (
        "| workload | states | policy | order | hit rate | attention-only | ratio "
        "| ratio to FCFS attention | bound | steps | wait p99 / max | overtaken p99 / max "
        "| checks |"
    )
    lines = [head, "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    all_ok = True
    for w in a.workloads:
        for m in a.states:
            for p in a.policies:
                kv = "lru" if p == "state-value" else p
                for s in scheds:
                    r = out[("cell", w, str(m), p, s)]
                    attn = out[("attention", w, kv, s)]["hit_rate"]
                    fcfs_attn = out[("attention", w, kv, "fcfs")]["hit_rate"]
                    checked = out.get(("check", w, str(m), p, s))
                    good = ok(r) and (
                        checked is None
                        or (ok(checked) and checked["device_hit_tokens"] == r["device_hit_tokens"])
                    )
                    all_ok &= good
                    verdict = "FAIL" if not good else ("pass (oracle)" if checked else "pass")
                    wait, over = r["queue_wait_steps"], r["overtaken"]
                    row = [
                        w,
                        str(m),
                        p,
                        s,
                        f"{r['device_hit_rate']:.3f}",
                        f"{attn:.3f}",
                        f"{r['device_hit_rate'] / attn:.3f}",
                        f"{r['device_hit_rate'] / fcfs_attn:.3f}",
                        f"{r['offline_bound_hit_rate'] / attn:.3f}",
                        str(r["steps"]),
                        f"{wait['p99']:.0f} / {wait['max']:.0f}",
                        f"{over['p99']:.0f} / {over['max']:.0f}",
                        verdict,
                    ]
                    lines.append("| " + " | ".join(row) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.table:
        Path(a.table).write_text(text)
    return 0 if all_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
