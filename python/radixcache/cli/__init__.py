"""The ``radixcache`` command: ``replay`` or ``bench`` a workload, write a ``workload``.

radixcache replay [--workload mixed|gsp|multiturn|PATH] [--requests N] [--seed S]
[--model hybrid|attention|swa|swa-hybrid] [--window W] [--swa-slots N] [--host-swa-slots N]
[--kv-slots N] [--mamba-slots N] [--host-kv-slots N] [--host-mamba-slots N]
[--page-size P] [--write-policy ...] [--write-through-threshold T]
[--eviction-policy lru|lfu|priority|state-value] [--max-running N]
[--schedule-policy fcfs|lpm] [--schedule-window N] [--max-overtakes N] [--chunk-size N]
[--no-branch-checkpoints] [--inject-failures RATE] [--offline-bound]
[--no-attention-only] [--json] [--plot PATH] [--quiet]
radixcache bench [the workload, cache and scheduler flags] [--numpy] [--json] [--quiet]
radixcache workload NAME --out FILE [--requests N] [--seed S]
radixcache glossary

The reports' terms are explained once, in `radixcache.glossary` (``radixcache glossary``
prints it; docs/glossary.md is its output).

Everything is checked before any work starts, in one place: every flag's type and range
(`FLAGS`), the flags together (the cache's own checks, reported with the flags' names;
a flag given where it has no effect is refused), the output paths (``--out``,
``--plot``), every line of a workload file (`radixcache.serving.workloads.parse_line`)
and whether each request fits the device pool alone. A bad one ends the command with one
line on stderr, ``radixcache CMD: error: ...``, naming the flag, or the file and line.

The package, one module a part: `radixcache.cli.flags` (the flag tables and the
errors), `radixcache.cli.checks` (every check made before the work),
`radixcache.cli.report` (the tables printed, the ``--plot`` figure),
`radixcache.cli.interrupts` (Ctrl-C between two scheduler steps), and one module per
command: `radixcache.cli.replay`, `radixcache.cli.bench`, `radixcache.cli.workload`,
`radixcache.cli.glossary`. This module builds the command line from them and runs it.

Exit status: 0 done; 1 the run failed (an oracle mismatch, a failed audit, a pool not
full once the cache is cleared, a request rejected) or an output could not be written;
2 a bad flag or input; 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .. import __version__
from ..serving import workloads as _workloads
from .bench import _bench_cmd
from .checks import kv_needed, swa_needed
from .flags import (
    BENCH_FLAGS,
    DEFAULT_WINDOW,
    EVICTION_POLICIES,
    FLAGS,
    L3_URLS,
    MAX_KV_SLOTS,
    MAX_MAMBA_SLOTS,
    MAX_REQUESTS,
    MAX_RUNNING,
    MAX_SEED,
    POLICIES,
    POOL_FLAGS,
    REPLAY_FLAGS,
    SWA_SHARE,
    WORKLOAD_FLAGS,
    Flag,
    InputError,
    OutputError,
    _add,
    _Parser,
)
from .glossary import _glossary_cmd
from .replay import _replay_cmd
from .report import ops_table, plot_formats
from .workload import _workload_cmd

__all__ = [
    "BENCH_FLAGS",
    "DEFAULT_WINDOW",
    "EVICTION_POLICIES",
    "FLAGS",
    "L3_URLS",
    "MAX_KV_SLOTS",
    "MAX_MAMBA_SLOTS",
    "MAX_REQUESTS",
    "MAX_RUNNING",
    "MAX_SEED",
    "POLICIES",
    "POOL_FLAGS",
    "REPLAY_FLAGS",
    "SWA_SHARE",
    "WORKLOAD_FLAGS",
    "Flag",
    "InputError",
    "OutputError",
    "kv_needed",
    "main",
    "ops_table",
    "plot_formats",
    "swa_needed",
]


def _parser() -> argparse.ArgumentParser:
    ap = _Parser(
        prog="radixcache",
        description="Prefix-cache manager for hybrid LLMs: replay workloads end to end.",
        epilog="Exit status: 0 done; 1 the run failed or an output could not be written; "
        "2 a bad flag or input; 130 interrupted. The reports' terms: radixcache glossary.",
    )
    ap.add_argument("--version", action="version", version=f"radixcache {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    r = sub.add_parser(
        "replay",
        help="serve a workload through the scheduler and the checksum model, and report",
        description=(
            "Serve a workload through radixcache's continuous-batching scheduler, with a "
            "stand-in model whose outputs change if any cache slot is wrong, and report "
            "hit rates, host-tier traffic, evictions, throughput, oracle mismatches "
            "(must be 0) and the audit (must pass). Exits 1 if either fails, a pool is "
            "not full after the cache is cleared, or a request was rejected; 2 on a bad "
            "flag or input (checked before the run); 130 when interrupted."
        ),
        epilog=_GLOSSARY_HINT,
    )
    _add(r, FLAGS["replay"])

    b = sub.add_parser(
        "bench",
        help="time the cache operations of a replay (no model, no copies)",
        description=(
            "Serve a workload through the same scheduler as replay, with no model and no "
            "copies (every batch completes at once), and time every call it makes on the "
            "cache: per-operation p50/p99, microseconds per request, nanoseconds per "
            "prompt token, hit rate, memory. Exits 1 if a pool is not full after the "
            "cache is cleared or a request was rejected; 2 on a bad flag or input."
        ),
        epilog=_GLOSSARY_HINT,
    )
    _add(b, FLAGS["bench"])

    w = sub.add_parser(
        "workload",
        help="write a built-in workload as JSONL",
        description="Write a built-in workload as JSONL, one request a line.",
    )
    w.add_argument(
        "name",
        choices=sorted(_workloads.WORKLOADS),
        help=f"the built-in workload: {', '.join(sorted(_workloads.WORKLOADS))} (required)",
    )
    _add(w, FLAGS["workload"])

    sub.add_parser(
        "glossary",
        help="explain the terms of the reports",
        description="Print what each row and note of the replay's and bench's reports "
        "means (Markdown; docs/glossary.md holds the same text).",
    )
    return ap


_GLOSSARY_HINT = "What each row of the report means: radixcache glossary (docs/glossary.md)."


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (see the module docstring)."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _main(argv: Sequence[str] | None) -> int:
    try:
        args, extra = _parser().parse_known_args(argv)
    except SystemExit as e:  # --help, --version
        return e.code if isinstance(e.code, int) else 0
    except InputError as e:
        print(e, file=sys.stderr)
        return 2
    prog = f"radixcache {args.command}"
    if extra:  # named by the subcommand they were given to
        print(
            f"{prog}: error: unrecognized arguments: {' '.join(extra)} (see {prog} --help)",
            file=sys.stderr,
        )
        return 2
    run = {
        "workload": _workload_cmd,
        "bench": _bench_cmd,
        "replay": _replay_cmd,
        "glossary": _glossary_cmd,
    }
    try:
        return run[args.command](args)
    except InputError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except OutputError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
