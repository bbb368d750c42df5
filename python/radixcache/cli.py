"""The ``radixcache`` command: ``replay`` a workload end to end, write a ``workload``.

radixcache replay [--workload mixed|gsp|multiturn|PATH] [--requests N] [--seed S]
[--kv-slots N] [--mamba-slots N] [--host-kv-slots N]
[--host-mamba-slots N] [--page-size P] [--write-policy ...]
[--inject-failures RATE] [--json] [--plot PATH]
radixcache workload NAME --out PATH [--requests N] [--seed S]
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from . import __version__
from .serving import harness as _replay
from .serving import workloads as _workloads
from .serving.scheduler import StepSample

POLICIES = ("write_through", "write_through_selective", "write_back")


def _nonneg(v: str) -> int:
    n = int(v)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
    return n


def _positive(v: str) -> int:
    n = int(v)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _rate(v: str) -> float:
    r = float(v)
    if not 0.0 <= r <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {r}")
    return r


def _pool_flags(p: argparse.ArgumentParser, d: _replay.ReplayConfig) -> None:
    """Add the workload, cache and scheduler flags that replay and bench share."""
    p.add_argument(
        "--workload",
        default="mixed",
        help="mixed (default), gsp, multiturn, or a JSONL file",
    )
    p.add_argument("--requests", type=_positive, help="serve only the first N requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-slots", type=_positive, default=d.kv_slots)
    p.add_argument("--mamba-slots", type=_nonneg, default=d.mamba_slots)
    p.add_argument("--host-kv-slots", type=_nonneg, default=d.host_kv_slots)
    p.add_argument("--host-mamba-slots", type=_nonneg, default=d.host_mamba_slots)
    p.add_argument("--page-size", type=_positive, default=d.page_size)
    p.add_argument("--write-policy", choices=POLICIES, default=d.write_policy)
    p.add_argument(
        "--write-through-threshold",
        type=_positive,
        default=d.write_through_threshold,
        help="hits before a backup under write_through_selective",
    )
    p.add_argument("--max-running", type=_positive, default=d.max_running)
    p.add_argument("--chunk-size", type=_positive, default=d.chunk_size)
    p.add_argument(
        "--no-branch-checkpoints",
        action="store_true",
        help="do not checkpoint states at branch points (to see what they are worth)",
    )


def _parser() -> argparse.ArgumentParser:
    d = _replay.ReplayConfig()
    ap = argparse.ArgumentParser(
        prog="radixcache",
        description="Prefix-cache manager for hybrid LLMs: replay workloads end to end.",
    )
    ap.add_argument("--version", action="version", version=f"radixcache {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)

    r = sub.add_parser(
        "replay",
        help="serve a workload through the scheduler and the checksum model, and report",
        description=(
            "Serve a workload through radixcache's continuous-batching scheduler, with a "
            "stand-in model whose outputs change if any cache slot is wrong, and report "
            "hit rates, host-tier traffic, evictions, throughput, oracle mismatches "
            "(must be 0) and the audit (must pass). Exits 1 if either fails or a pool "
            "is not full after the cache is cleared."
        ),
    )
    _pool_flags(r, d)
    r.add_argument(
        "--inject-failures",
        type=_rate,
        default=0.0,
        metavar="RATE",
        help="refuse or fail this fraction of transfer batches, at random points",
    )
    r.add_argument(
        "--no-attention-only",
        action="store_true",
        help="skip the attention-only replay that the hit-rate ratio compares with",
    )
    r.add_argument("--json", action="store_true", help="print the report as one JSON object")
    r.add_argument("--plot", metavar="PATH", help="write hit rate and pool occupancy (PNG)")
    r.add_argument("--quiet", action="store_true", help="no progress bar")

    b = sub.add_parser(
        "bench",
        help="time the cache operations of a replay (no model, no copies)",
        description=(
            "Serve a workload through the same scheduler as replay, with no model and no "
            "copies (every batch completes at once), and time every call it makes on the "
            "cache: per-operation p50/p99, microseconds per request, nanoseconds per "
            "prompt token, hit rate, memory."
        ),
    )
    _pool_flags(b, d)
    b.add_argument("--numpy", action="store_true", help="tokens as NumPy arrays, not lists")
    b.add_argument("--json", action="store_true", help="print the result as one JSON object")
    b.add_argument("--quiet", action="store_true", help="no progress bar")

    w = sub.add_parser("workload", help="write a built-in workload as JSONL")
    w.add_argument("name", choices=sorted(_workloads.WORKLOADS))
    w.add_argument("--out", required=True, help="the JSONL file to write")
    w.add_argument("--requests", type=_positive)
    w.add_argument("--seed", type=int, default=0)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = _parser().parse_args(argv)
    if args.command == "workload":
        return _workload(args)
    if args.command == "bench":
        return _bench_cmd(args)
    return _replay_cmd(args)


def _workload(args: argparse.Namespace) -> int:
    jobs = _workloads.WORKLOADS[args.name](args.requests, args.seed)
    n = _workloads.save_jsonl(jobs, args.out)
    s = _workloads.stats(jobs)
    print(
        f"wrote {n} requests ({s['prompt_tokens']} prompt tokens, "
        f"{s['output_tokens']} output tokens) to {args.out}",
        file=sys.stderr,
    )
    return 0


def _setup(
    args: argparse.Namespace, err: Any, **extra: Any
) -> tuple[list[_workloads.Job], _replay.ReplayConfig] | None:
    """Load the workload and build the config; None (after saying why) if bad."""
    if args.mamba_slots == 0 and args.host_mamba_slots:
        args.host_mamba_slots = 0  # an attention-only model has no states to back up
    try:
        jobs = _workloads.load(args.workload, args.requests, args.seed)
        config = _replay.ReplayConfig(
            kv_slots=args.kv_slots,
            mamba_slots=args.mamba_slots,
            host_kv_slots=args.host_kv_slots,
            host_mamba_slots=args.host_mamba_slots if args.host_kv_slots else 0,
            page_size=args.page_size,
            write_policy=args.write_policy,
            write_through_threshold=args.write_through_threshold,
            seed=args.seed,
            max_running=args.max_running,
            chunk_size=args.chunk_size,
            branch_checkpoints=not args.no_branch_checkpoints,
            **extra,
        )
        config.cache()  # the cache's own checks, before any work
    except (ValueError, OSError) as e:
        err.print(f"[red]error:[/red] {e}")
        return None
    return jobs, config


def _progress(err: Any, quiet: bool) -> Any:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    return Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        disable=quiet,
        transient=True,
    )


def _replay_cmd(args: argparse.Namespace) -> int:
    from rich.console import Console

    err = Console(stderr=True)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            err.print(
                "[red]--plot needs matplotlib:[/red] pip install 'radixcache[plot]' "
                "(or pip install matplotlib)"
            )
            return 2
    setup = _setup(
        args,
        err,
        inject_failures=args.inject_failures,
        timeline=10 if args.plot else 0,
        attention_only=not args.no_attention_only,
    )
    if setup is None:
        return 2
    jobs, config = setup
    with _progress(err, args.quiet) as bar:
        task = bar.add_task(f"replay {args.workload}", total=len(jobs))
        report, timeline = _replay.replay(
            jobs, config, progress=lambda done: bar.update(task, completed=done)
        )
    report["workload"] = args.workload
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_report(Console(), report)
    if args.plot:
        _plot(timeline, args.plot, args.workload)
        err.print(f"wrote {args.plot}")
    ok = report["mismatches"] == 0 and report["audit"] == "pass" and report["pools_full_at_end"]
    return 0 if ok else 1


def _bench_cmd(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from .serving.bench import bench

    err = Console(stderr=True)
    setup = _setup(args, err)
    if setup is None:
        return 2
    jobs, config = setup
    with _progress(err, args.quiet) as bar:
        task = bar.add_task(f"bench {args.workload}", total=len(jobs))
        r = bench(
            jobs,
            config,
            numpy_tokens=args.numpy,
            progress=lambda done: bar.update(task, completed=done),
        )
    r["workload"] = args.workload
    status = 0 if r["pools_full_at_end"] else 1  # a leak fails the run
    if args.json:
        print(json.dumps(r, indent=2))
        return status
    out = Console()
    head = Table(title=f"radixcache bench: {args.workload}", show_header=False, box=None)
    head.add_column(style="bold")
    head.add_column(justify="right")
    head.add_column(style="dim")
    head.add_row("requests", str(r["requests"]), f"{r['prompt_tokens']} prompt tokens")
    head.add_row("tokens passed as", r["tokens"])
    head.add_row("hit rate", f"{100 * r['hit_rate']:.1f}%", "state-valid device hits")
    head.add_row(
        "cache time per request",
        f"{r['us_per_request']:.1f} us",
        f"median; p99 {r['p99_us']:.1f} us, mean {r['mean_us_per_request']:.1f} us",
    )
    head.add_row("per prompt token", f"{r['ns_per_prompt_token']:.1f} ns")
    head.add_row(
        "cache time in all",
        f"{r['cache_seconds']:.3f} s",
        f"of {r['wall_seconds']:.3f} s (the rest is the scheduler)",
    )
    head.add_row(
        "memory", f"{r['rss_growth_mb']:.1f} MB", f"process peak {r['peak_rss_mb']:.0f} MB"
    )
    head.add_row("pools full at end", str(r["pools_full_at_end"]), "after clearing: no leak")
    out.print(head)
    out.print(ops_table(r["ops"], "per operation"))
    return status


def ops_table(ops: dict[str, dict[str, Any]], title: str, limit: int | None = None) -> Any:
    """Return a rich table of per-operation figures (``bench``'s ``ops``), `limit` rows."""
    from rich.table import Table

    table = Table(title=title)
    for col in ("operation", "calls", "p50 us", "p99 us", "share"):
        table.add_column(col, justify="left" if col == "operation" else "right")
    for name, o in list(ops.items())[:limit]:
        table.add_row(
            name,
            str(o["calls"]),
            f"{o['p50_us']:.2f}",
            f"{o['p99_us']:.2f}",
            f"{100 * o['share']:.1f}%",
        )
    return table


def _print_report(console: Any, r: dict[str, Any]) -> None:
    from rich.table import Table

    t = Table(title=f"radixcache replay: {r['workload']}", show_header=False, box=None)
    t.add_column(style="bold")
    t.add_column(justify="right")
    t.add_column(style="dim")

    def row(name: str, value: Any, note: str = "") -> None:
        t.add_row(name, str(value), note)

    def pct(x: float) -> str:
        return f"{100 * x:.1f}%"

    row("requests", r["requests"], f"{r['retractions']} retractions, {r['rejected']} rejected")
    row("prompt tokens", r["prompt_tokens"])
    row("output tokens", r["output_tokens"])
    row("device hit tokens", r["device_hit_tokens"], pct(r["device_hit_rate"]))
    row("host hit tokens", r["host_hit_tokens"], pct(r["host_hit_rate"]) + " loaded back")
    row(
        "attention-only hit rate",
        pct(r["attention_only_hit_rate"]),
        f"hybrid/attention {r['hit_rate_ratio']:.3f}",
    )
    row("copy-on-write copies", r["cow_copies"], f"{r['checkpoints']} checkpoints")
    row("backups", r["backups"], f"{r['backups_failed']} failed")
    row("demotions", r["demotions"])
    reasons = ", ".join(f"{k} {v}" for k, v in r["load_backs_called_off_by_reason"].items() if v)
    row("load-backs committed", r["load_backs_committed"], f"{r['loaded_tokens']} tokens")
    row("load-backs called off", r["load_backs_called_off"], reasons)
    row("load-backs failed", r["load_backs_failed"], "after commit: recomputed")
    row(
        "evicted",
        f"{r['evicted_kv_tokens']} KV",
        f"{r['evicted_mamba_states']} states ({r['evicted_used_states']} used by a match)",
    )
    row("host evicted", f"{r['host_evicted_tokens']} KV")
    inj = r["injected_failures"]
    if any(inj.values()):
        row("injected failures", sum(inj.values()), ", ".join(f"{k} {v}" for k, v in inj.items()))
    row(
        "throughput",
        f"{r['requests_per_second']:.1f} req/s",
        f"{r['tokens_per_second']:.0f} tokens/s, {r['seconds']:.1f} s (incl. the model)",
    )
    good = "[green]{}[/green]", "[red]{}[/red]"
    row(
        "oracle mismatches",
        (good[0] if r["mismatches"] == 0 else good[1]).format(r["mismatches"]),
        f"of {r['samples_checked']} samples",
    )
    row("audit", (good[0] if r["audit"] == "pass" else good[1]).format(r["audit"]))
    full = r["pools_full_at_end"]
    row("pools full at end", (good[0] if full else good[1]).format(full), "after clearing")
    console.print(t)


def _plot(timeline: list[StepSample], path: str, title: str) -> None:
    # Older matplotlib releases (the last ones for Python 3.9) warn about their own
    # dependencies while importing: not the user's concern.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    x = [s.finished for s in timeline]
    dev = [s.device_hit_tokens / s.prompt_tokens if s.prompt_tokens else 0 for s in timeline]
    host = [
        (s.device_hit_tokens + s.host_hit_tokens) / s.prompt_tokens if s.prompt_tokens else 0
        for s in timeline
    ]
    a.plot(x, dev, label="device hits")
    a.plot(x, host, label="device + host hits")
    a.set_ylabel("hit rate (cumulative)")
    a.set_ylim(0, 1)
    a.legend(loc="lower right")
    a.set_title(f"radixcache replay: {title}")
    b.plot(x, [s.kv_used for s in timeline], label="device KV")
    b.plot(x, [s.mamba_used for s in timeline], label="device states")
    b.plot(x, [s.host_kv_used for s in timeline], label="host KV")
    b.set_ylabel("pool occupancy")
    b.set_ylim(0, 1.05)
    b.set_xlabel("requests finished")
    b.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
