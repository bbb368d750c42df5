"""Prove a ``--radix-cache-backend`` inside SGLang 0.5.23's own code paths, on the CPU.

Each run replays workloads (``gsp``, ``multiturn``, ``mixed`` or JSONL files) through
benches/_sglang_side.py: SGLang's real ``Req`` objects and ``init_next_round_input``, the
prefill adder's memory check, ``alloc_for_extend`` / ``alloc_for_decode`` per batch,
chunked-prefill checkpoints, ``release_kv_cache(..., checkpoint=True)`` and retraction
through SGLang's ``release_req``, with the tree cache built by SGLang's registry:

- **the backend** (default ``radixcache``): from its name, exactly as
  ``--radix-cache-backend NAME`` builds it (the ``sglang.srt.plugins`` entry points are
  loaded first, as the scheduler process loads them);
- **sglang-rust** and **sglang-python**: SGLang's default chain (its
  ``UnifiedRadixCache``) on its bundled Rust tree core and on its Python one;

on the same requests, for an attention-only model and a FULL+MAMBA one. Every replay runs
the checksum model over SGLang's real KV and Mamba pool tensors and SGLang's own pool
invariant checks after every step (benches/_sglang_proof.py). The checks, per workload:

- no leak: every KV slot, state slot and request row back in SGLang's allocators at the
  end (and SGLang's idle checks pass), on every system;
- 0 byte mismatches (KV and states) and 0 breaks of the pool invariant, on every system;
- attention-only: the backend's hit tokens equal each SGLang core's; with retraction,
  within 1% of them (a retraction evicts a number of tokens at once; from there the two
  caches' least-recently-used orders, whose recency stamps and eviction units differ, can
  keep slightly different prefixes; docs/sglang.md);
- FULL+MAMBA: the backend's hit tokens at least each SGLang core's, counted at each
  request's first admission: a retracted request is prefilled again with its output so
  far, and how much that is (and so its hits) depends on when it was retracted, which the
  hits before it shift (both totals are reported);
- the Rust core is the one that ran (the tree cores are printed).

It also prints the cache time per request inside SGLang's path (the backend's own work
and everything it calls, conversions included; SGLang's allocator calls shown apart) and
its ratio to SGLang's Rust and Python cores: reported, not a check (a timing depends on
the machine). Exit status: 0 when every check passes, 1 when one fails, 2 for a bad
argument, a missing SGLang install or a backend name nothing registered.

Usage::

    python benches/sglang_backend.py [--workloads gsp,multiturn,mixed] [--requests 300]
        [--backend radixcache] [--systems backend,sglang-rust,sglang-python]
        [--configs attention,hybrid] [--retract-every 64] [--json] [--plot PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import vs_sglang  # noqa: E402  (benches/ is not a package)

SYSTEMS = ("backend", "sglang-rust", "sglang-python")
CONFIGS = vs_sglang.CONFIGS
WORKLOADS = ("gsp", "multiturn", "mixed")
#: The cache-time ratio to SGLang's Rust core the backend aims for (reported).
GOAL = 3.0
#: With retraction, attention-only hit tokens agree within this (relative; module docstring).
RETRACTED_AGREEMENT = 0.01


def parser() -> argparse.ArgumentParser:
    """Return the command line's parser."""
    ap = argparse.ArgumentParser(
        prog="sglang_backend.py",
        description=(
            "Drive a --radix-cache-backend through SGLang 0.5.23's scheduler code on the "
            "CPU, side by side with SGLang's UnifiedRadixCache, and check it."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument(
        "--workloads",
        type=lambda v: [w.strip() for w in v.split(",") if w.strip()],
        default=list(WORKLOADS),
        help="comma-separated: gsp, multiturn, mixed or JSONL files",
    )
    ap.add_argument(
        "--requests", type=vs_sglang._positive, default=300, help="requests per workload"
    )
    ap.add_argument("--seed", type=int, default=0, help="the workloads' random seed")
    ap.add_argument("--backend", default="radixcache", help="a --radix-cache-backend name")
    ap.add_argument(
        "--systems",
        type=vs_sglang._choices(SYSTEMS),
        default=list(SYSTEMS),
        help="comma-separated: the backend, SGLang's cache on its Rust or Python tree core",
    )
    ap.add_argument(
        "--configs",
        type=vs_sglang._choices(CONFIGS),
        default=list(CONFIGS),
        help="comma-separated models: attention-only, FULL+MAMBA",
    )
    ap.add_argument(
        "--kv-slots", type=vs_sglang._positive, default=65_536, help="SGLang's KV pool, tokens"
    )
    ap.add_argument(
        "--mamba-slots", type=vs_sglang._positive, default=128, help="SGLang's Mamba pool, states"
    )
    ap.add_argument("--page-size", type=vs_sglang._positive, default=16, help="tokens per page")
    ap.add_argument(
        "--max-running", type=vs_sglang._positive, default=16, help="requests running at most"
    )
    ap.add_argument(
        "--chunk-size", type=vs_sglang._positive, default=512, help="chunked prefill, tokens"
    )
    ap.add_argument(
        "--retract-every",
        type=int,
        default=64,
        help="retract one decoding request every N decode steps (0: never)",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument(
        "--plot",
        metavar="PATH",
        help="per-request cache time as CDFs, one PNG per workload (PATH's stem + workload)",
    )
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    return ap


# ------------------------------------------------------------------------------ checks


def checks(
    results: list[dict[str, Any]], backend: str, retraction: bool = False
) -> list[dict[str, Any]]:
    """Return the checks of one workload's results (module docstring)."""
    out: list[dict[str, Any]] = []
    for r in results:
        where = f"{r['system']} ({r['config']})"
        out.append(
            {
                "check": f"no leak: {where}",
                "value": vs_sglang.leak_summary(r["leaks"]),
                "ok": bool(r["clean"]),
            }
        )
        v = r["verify"]
        bad = v["kv_mismatches"] + v["state_mismatches"]
        out.append(
            {
                "check": f"0 byte mismatches: {where}",
                "value": (
                    f"{v['kv_mismatches']}/{v['kv_tokens_checked']} KV, "
                    f"{v['state_mismatches']}/{v['states_checked']} states"
                    + (f"; {v['mismatch_examples'][0]}" if v["mismatch_examples"] else "")
                ),
                "ok": bad == 0,
            }
        )
        out.append(
            {
                "check": f"SGLang's pool invariant after every step: {where}",
                "value": f"{v['invariant_breaks']} breaks in {v['invariant_steps']} steps"
                + (f"; {v['invariant_examples'][0]}" if v["invariant_examples"] else ""),
                "ok": v["invariant_breaks"] == 0,
            }
        )
        if r["system"] == "sglang-rust":
            out.append(
                {
                    "check": f"SGLang's Rust tree core ran ({r['config']})",
                    "value": r["tree_core"],
                    "ok": r["tree_core"].endswith("RustUnifiedTreeCore"),
                }
            )
    ours = {r["config"]: r for r in results if r["system"] == backend}
    for r in results:
        base = ours.get(r["config"])
        if base is None or not r["system"].startswith("sglang"):
            continue
        if r["config"] == "attention":
            a, b = base["device_hit_tokens"], r["device_hit_tokens"]
            relation = f"within {RETRACTED_AGREEMENT:.0%} of" if retraction else "equal to"
            out.append(
                {
                    "check": f"attention-only hit tokens {relation} SGLang's: "
                    f"{backend} vs {r['system']}",
                    "value": f"{a} vs {b}",
                    "ok": abs(a - b) <= RETRACTED_AGREEMENT * b if retraction else a == b,
                }
            )
        else:
            a, b = base["first_admission_hit_tokens"], r["first_admission_hit_tokens"]
            out.append(
                {
                    "check": "hybrid hit tokens at least SGLang's (first admissions): "
                    f"{backend} vs {r['system']}",
                    "value": f"{a} vs {b} ({a / b:.3f}x)" if b else f"{a} vs {b}",
                    "ok": a >= b,
                }
            )
    return out


def add_ratios(results: list[dict[str, Any]], backend: str) -> None:
    """Each SGLang core's mean cache time per request over the backend's, same config.

    ``ratio``: the tree's own work (SGLang's allocator calls left out on both sides);
    ``ratio_with_allocator``: everything inside SGLang's path.
    """
    ours = {r["config"]: r for r in results if r["system"] == backend}
    for r in results:
        base = ours.get(r["config"])
        if base is None or not r["system"].startswith("sglang"):
            continue
        mine, theirs = base["without_allocator"], r["without_allocator"]
        r["ratio"] = theirs["mean_us_per_request"] / mine["mean_us_per_request"]
        r["ratio_with_allocator"] = r["mean_us_per_request"] / base["mean_us_per_request"]


# ------------------------------------------------------------------------------ output


def print_tables(report: dict[str, Any]) -> None:
    """Print each workload's results and checks."""
    from rich.console import Console
    from rich.table import Table

    out = Console(width=max(Console().width, 132))
    for w in report["workloads"]:
        t = Table(
            title=(
                f"{w['workload']}: {w['requests']} requests, {w['prompt_tokens']} prompt "
                f"tokens; KV {report['kv_slots']}, states {report['mamba_slots']}, page "
                f"{report['page_size']}, retraction every {report['retract_every']} decode "
                "steps"
            )
        )
        cols = (
            "config",
            "system",
            "hit tokens",
            "first admissions",
            "hit rate",
            "retracted",
            "mean us/req",
            "p50 us",
            "p99 us",
            "ratio",
            "with allocator: mean us",
            "ratio",
        )
        for col in cols:
            t.add_column(col, justify="left" if col in ("config", "system") else "right")
        for r in w["results"]:
            tree = r["without_allocator"]
            t.add_row(
                r["config"],
                r["system"],
                str(r["device_hit_tokens"]),
                str(r["first_admission_hit_tokens"]),
                f"{100 * r['hit_rate']:.1f}%",
                str(r["retractions"]),
                f"{tree['mean_us_per_request']:.1f}",
                f"{tree['us_per_request']:.1f}",
                f"{tree['p99_us']:.1f}",
                f"{r['ratio']:.1f}x" if "ratio" in r else "",
                f"{r['mean_us_per_request']:.1f}",
                f"{r['ratio_with_allocator']:.1f}x" if "ratio" in r else "",
            )
        out.print(t)
        c = Table(title=f"{w['workload']}: checks")
        for col in ("check", "value", "result"):
            c.add_column(col)
        for k in w["checks"]:
            c.add_row(k["check"], str(k["value"]), "[green]pass" if k["ok"] else "[red]FAIL")
        out.print(c)
    out.print(
        "mean us/req, p50, p99: cache time per request inside SGLang's path (match, lock, "
        "checkpoint, release, retraction, the eviction inside allocations), SGLang's "
        "allocator calls and req_to_token writes left out; ratio: SGLang's over the "
        f"backend's (goal: {GOAL:.0f}x against the Rust core). with allocator: the same "
        "with every allocator call."
    )
    cores = sorted({r["tree_core"] for w in report["workloads"] for r in w["results"]})
    out.print("tree caches that ran: " + ", ".join(cores))


def plot_path(path: str, workload: str, several: bool) -> str:
    """Return the PNG path of one workload's plot."""
    if not several:
        return path
    p = Path(path)
    return str(p.with_name(f"{p.stem}_{Path(workload).stem}{p.suffix or '.png'}"))


# ------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    """Run the proof; return the exit status (0: every check passed)."""
    args = parser().parse_args(argv)
    from rich.console import Console

    from radixcache.serving import workloads

    err = Console(stderr=True)
    if args.retract_every < 0:
        err.print(f"[red]error:[/red] --retract-every: must be >= 0, got {args.retract_every}")
        return 2
    if not args.workloads:
        err.print("[red]error:[/red] --workloads: name at least one workload")
        return 2
    if args.plot:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            err.print("[red]error:[/red] --plot needs matplotlib (pip install matplotlib)")
            return 2
    try:
        loaded = [(w, workloads.load(w, args.requests, args.seed)) for w in args.workloads]
    except (ValueError, OSError) as e:
        err.print(f"[red]error:[/red] {e}")
        return 2
    why = vs_sglang.import_sglang()
    if why is not None:
        err.print(f"[red]error:[/red] SGLang's caches cannot be imported: {why}")
        return 2
    if "backend" in args.systems:
        why = backend_missing(args.backend)
        if why is not None:
            err.print(f"[red]error:[/red] {why}")
            return 2
    names = {"backend": args.backend, "sglang-rust": "rust", "sglang-python": "python"}
    report: dict[str, Any] = {
        "backend": args.backend,
        "kv_slots": args.kv_slots,
        "mamba_slots": args.mamba_slots,
        "page_size": args.page_size,
        "max_running": args.max_running,
        "chunk_size": args.chunk_size,
        "retract_every": args.retract_every,
        "workloads": [],
    }
    with vs_sglang.progress_bar(err, quiet=args.quiet) as bar:

        def track(label: str, total: int) -> Callable[[int], None]:
            task = bar.add_task(label, total=total)
            return lambda done: bar.update(task, completed=done)

        for name, jobs in loaded:
            results = []
            for config in args.configs:
                for system in args.systems:
                    r = vs_sglang.run_sglang(
                        jobs,
                        args,
                        config == "hybrid",
                        names[system],
                        track(f"{name}, {config}: {names[system]}", len(jobs)),
                        verify=True,
                        retract_every=args.retract_every,
                    )
                    r["config"] = config
                    results.append(r)
            add_ratios(results, args.backend)
            report["workloads"].append(
                {
                    "workload": name,
                    "requests": len(jobs),
                    "prompt_tokens": int(sum(len(j.prompt) for j in jobs)),
                    "results": results,
                    "checks": checks(results, args.backend, args.retract_every > 0),
                }
            )
    if args.plot:
        several = len(report["workloads"]) > 1
        for w in report["workloads"]:
            vs_sglang.plot(
                {"workload": w["workload"], "results": w["results"]},
                plot_path(args.plot, w["workload"], several),
            )
    ok = all(k["ok"] for w in report["workloads"] for k in w["checks"])
    if args.json:
        for w in report["workloads"]:
            for r in w["results"]:
                r.pop("per_request_us", None)
                r.pop("per_request_us_without_allocator", None)
        print(json.dumps(report, indent=2))
    else:
        print_tables(report)
    return 0 if ok else 1


def backend_missing(name: str) -> str | None:
    """Return None when `name` is a registered backend once the plugins load, else why."""
    from sglang.srt.mem_cache.registry import registered_radix_cache_backends
    from sglang.srt.plugins import load_plugins

    load_plugins()
    known = registered_radix_cache_backends()
    if name in known:
        return None
    hint = " (pip install 'radixcache[sglang]')" if name == "radixcache" else ""
    return (
        f"--backend {name!r}: no radix-cache backend of that name is registered{hint}; "
        f"registered: {', '.join(known) or 'none'}"
    )


if __name__ == "__main__":
    sys.exit(main())
