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

Exit status: 0 done; 1 the run failed (an oracle mismatch, a failed audit, a pool not
full once the cache is cleared, a request rejected) or an output could not be written;
2 a bad flag or input; 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import math
import os
import re
import signal
import sys
import threading
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NoReturn

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from . import L3Error, __version__
from .glossary import markdown
from .l3 import open_store, redact
from .serving import bench as _bench
from .serving import harness as _replay
from .serving import workloads as _workloads
from .serving.model import MODELS
from .serving.scheduler import SCHEDULE_POLICIES, StepSample

POLICIES = ("write_through", "write_through_selective", "write_back")
#: The ``--eviction-policy`` names (the cache's ``eviction_policy``).
EVICTION_POLICIES = ("lru", "lfu", "priority", "state-value")

#: The largest KV pool (device or host, in tokens) and page the CLI accepts. The
#: replay's storage takes 32 bytes per slot and tier: 512 MiB per pool at this size.
MAX_KV_SLOTS = 1 << 24
#: The largest state pool (device or host) the CLI accepts.
MAX_MAMBA_SLOTS = 1 << 16
#: The most requests ``--requests`` asks for (a built-in workload is made in memory).
MAX_REQUESTS = 100_000
#: The largest ``--max-running``.
MAX_RUNNING = 4096
#: Seeds are in ``[0, MAX_SEED]``.
MAX_SEED = (1 << 63) - 1
#: ``--window`` of the SWA models: smaller than the built-in workloads' shared prefixes
#: (``gsp``'s 2,048-token system prompts, ``mixed``'s of 512-2,048, ``multiturn``'s
#: histories of 576-2,880 tokens), so that the window matters there; Gemma 3's window.
DEFAULT_WINDOW = 1024
#: ``--swa-slots`` by default: this share of ``--kv-slots``, in whole pages.
SWA_SHARE = 4
#: The forms of an ``--l3`` URL, as ``--help`` lists them (`radixcache.l3.open_store`'s,
#: with the Mooncake URL's parameters; docs/design.md, "The L3 store" and its "Mooncake
#: Store", says what each part means).
L3_URLS = (
    "redis://[[USER]:PASSWORD@]HOST:PORT[/DB]",
    "redis+cluster://HOST:PORT[,HOST:PORT...]",
    "file:///ABSOLUTE/DIR",
    "mooncake://MASTER_HOST:PORT[?metadata=URL&host=ADDR&segment=SIZE&buffer=SIZE"
    "&protocol=tcp&device=NAMES&timeout_ms=N]",
)


class InputError(Exception):
    """A bad flag or input: the command ends with this one-line message and status 2."""


class OutputError(Exception):
    """An output could not be written: the command ends with this message and status 1."""


@dataclass(frozen=True)
class Flag:
    """One option: how it is parsed and checked, its default and its meaning (``--help``).

    Attributes:
        name: The option (``--kv-slots``).
        help: What it does.
        kind: ``int``, ``rate`` (a float in [0, 1]), ``seconds`` (a float in
            (0, `hi`]), ``choice``, ``text`` (a string) or ``switch`` (present or not).
        metavar: What the value is, as ``--help`` names it (``TOKENS``, ``URL``, ``K/N``);
            an ``int``, ``rate`` or ``seconds`` without one is ``N``, ``RATE``,
            ``SECONDS``; a ``text`` must have one.
        default: The value when the option is not given.
        lo, hi: The range of an ``int``; `hi` bounds ``seconds`` too.
        choices: The values of a ``choice``.
        shown: The default as ``--help`` states it (default: `default`).
        required: The option must be given (it has no default).
    """

    name: str
    help: str
    kind: str = "int"
    metavar: str = ""
    default: Any = None
    lo: int = 0
    hi: int = 0
    choices: tuple[str, ...] = ()
    shown: str | None = None
    required: bool = False

    @property
    def dest(self) -> str:
        """The attribute of the parsed arguments."""
        return self.name[2:].replace("-", "_")

    def help_text(self) -> str:
        """Return the help line: the meaning, then the default."""
        if self.required:
            return f"{self.help} (required)".replace("%", "%%")
        shown = self.shown
        if shown is None:
            shown = "off" if self.kind == "switch" else str(self.default)
        return f"{self.help} (default: {shown})".replace("%", "%%")

    def parse(self, text: str) -> Any:
        """Parse and check the option's value (argparse names the flag on an error)."""
        if self.kind == "int":
            try:
                value = int(text)
            except ValueError:
                value = None
            if value is None or not self.lo <= value <= self.hi:
                raise argparse.ArgumentTypeError(
                    f"must be an integer in [{self.lo}, {self.hi}], got {_short(text)}"
                )
            return value
        if self.kind == "rate":
            try:
                rate = float(text)
            except ValueError:
                rate = float("nan")
            if not 0.0 <= rate <= 1.0:  # NaN too
                raise argparse.ArgumentTypeError(f"must be in [0, 1], got {_short(text)}")
            return rate
        if self.kind == "seconds":
            try:
                seconds = float(text)
            except ValueError:
                seconds = float("nan")
            if not 0.0 < seconds <= self.hi:  # NaN too
                raise argparse.ArgumentTypeError(
                    f"must be a number of seconds in (0, {self.hi}], got {_short(text)}"
                )
            return seconds
        if not text:
            raise argparse.ArgumentTypeError("must not be empty")
        return text


def _short(value: object) -> str:
    r = repr(value)
    return r if len(r) <= 40 else r[:37] + "..."


_D = _replay.ReplayConfig()

#: The workload, cache and scheduler flags of ``replay`` and ``bench``.
POOL_FLAGS = (
    Flag(
        "--workload",
        "a built-in workload (mixed, gsp, multiturn) or a JSONL file, one request a line "
        "(docs/serving.md)",
        kind="text",
        metavar="NAME|FILE",
        default="mixed",
    ),
    Flag(
        "--requests",
        f"serve only the first N requests (at most {MAX_REQUESTS})",
        metavar="N",
        lo=1,
        hi=MAX_REQUESTS,
        shown="all of them",
    ),
    Flag(
        "--seed",
        "seeds the built-in workloads (and in replay the model's hashes and the injected failures)",
        metavar="SEED",
        default=0,
        hi=MAX_SEED,
    ),
    Flag(
        "--model",
        "the model's layers: hybrid (full attention + Mamba), attention (full attention "
        "only), swa (sliding-window + full attention), swa-hybrid (sliding-window + full "
        "attention + Mamba)",
        kind="choice",
        default="hybrid",
        choices=MODELS,
    ),
    Flag(
        "--window",
        "the sliding window of the SWA layers, in tokens; only with --model swa or swa-hybrid",
        metavar="TOKENS",
        lo=1,
        hi=MAX_KV_SLOTS,
        shown=f"{DEFAULT_WINDOW} with an SWA model",
    ),
    Flag(
        "--swa-slots",
        "device SWA KV pool, in tokens: a multiple of --page-size, enough for one request's "
        "window and prefill chunk; only with --model swa or swa-hybrid",
        metavar="TOKENS",
        lo=1,
        hi=MAX_KV_SLOTS,
        shown=f"1/{SWA_SHARE} of --kv-slots in whole pages, with an SWA model",
    ),
    Flag(
        "--kv-slots",
        f"device KV pool, in tokens: a multiple of --page-size (at most {MAX_KV_SLOTS})",
        metavar="TOKENS",
        default=_D.kv_slots,
        lo=1,
        hi=MAX_KV_SLOTS,
    ),
    Flag(
        "--mamba-slots",
        "device Mamba state slots (0 with --model hybrid: an attention-only model); only "
        "with --model hybrid or swa-hybrid",
        metavar="STATES",
        hi=MAX_MAMBA_SLOTS,
        shown=f"{_D.mamba_slots}; 0 with --model attention or swa",
    ),
    Flag(
        "--host-kv-slots",
        "host-tier KV pool, in tokens: a multiple of --page-size (0: no host tier)",
        metavar="TOKENS",
        default=_D.host_kv_slots,
        hi=MAX_KV_SLOTS,
    ),
    Flag(
        "--host-mamba-slots",
        "host-tier state slots",
        metavar="STATES",
        hi=MAX_MAMBA_SLOTS,
        shown=f"{_D.host_mamba_slots}; 0 with --mamba-slots 0 or --host-kv-slots 0",
    ),
    Flag(
        "--host-swa-slots",
        "host-tier SWA KV pool, in tokens: a multiple of --page-size, at most "
        "--host-kv-slots; only with --model swa or swa-hybrid and a host tier",
        metavar="TOKENS",
        hi=MAX_KV_SLOTS,
        shown="--swa-slots scaled as --host-kv-slots is to --kv-slots, in whole pages; 0 "
        "without a host tier",
    ),
    Flag(
        "--page-size",
        "tokens per page",
        metavar="TOKENS",
        default=_D.page_size,
        lo=1,
        hi=MAX_KV_SLOTS,
    ),
    Flag(
        "--write-policy",
        "when KV is copied to the host tier: write_through (when it is cached), "
        "write_through_selective (after --write-through-threshold hits), write_back "
        "(when it is evicted); the last two need a host tier",
        kind="choice",
        default=_D.write_policy,
        choices=POLICIES,
    ),
    Flag(
        "--write-through-threshold",
        "hits before a backup; only with --write-policy write_through_selective",
        metavar="HITS",
        lo=1,
        hi=(1 << 32) - 1,
        shown="2",
    ),
    Flag(
        "--eviction-policy",
        "which cached KV and states go first when memory is short: lru (least recently "
        "used), lfu (least often matched), priority (lowest request priority, from the "
        "workload), state-value (states: least compute saved per slot; KV and SWA: lru); "
        "one name for every component it applies to",
        kind="choice",
        default=_D.eviction_policy,
        choices=EVICTION_POLICIES,
    ),
    Flag(
        "--max-running",
        "requests served at once",
        metavar="REQUESTS",
        default=_D.max_running,
        lo=1,
        hi=MAX_RUNNING,
    ),
    Flag(
        "--schedule-policy",
        "the admission order: fcfs (first come, first served) or lpm (longest cached "
        "prefix first, among --schedule-window waiting requests; one overtaken "
        "--max-overtakes times goes next)",
        kind="choice",
        default=_D.schedule_policy,
        choices=SCHEDULE_POLICIES,
    ),
    Flag(
        "--schedule-window",
        "waiting requests lpm ranks at each admission; only with --schedule-policy lpm",
        metavar="REQUESTS",
        lo=1,
        hi=MAX_REQUESTS,
        shown=str(_D.schedule_window),
    ),
    Flag(
        "--max-overtakes",
        "fairness of lpm: a waiting request overtaken this many times goes next; only "
        "with --schedule-policy lpm",
        metavar="TIMES",
        hi=MAX_REQUESTS,
        shown=str(_D.max_overtakes),
    ),
    Flag(
        "--lookahead",
        "tell eviction the next N waiting requests (HybridCache.expect): the nodes they "
        "will resume from go last, the one needed latest first; a prefill also stops "
        "and keeps a state where one of them leaves its prompt (0: off)",
        metavar="REQUESTS",
        default=_D.lookahead,
        hi=MAX_REQUESTS,
    ),
    Flag(
        "--chunk-size",
        "most prefill tokens a request feeds in one step",
        metavar="TOKENS",
        default=_D.chunk_size,
        lo=1,
        hi=MAX_KV_SLOTS,
    ),
    Flag(
        "--no-branch-checkpoints",
        "do not checkpoint states at branch points (to see what they are worth)",
        kind="switch",
    ),
)

REPLAY_FLAGS = (
    Flag(
        "--inject-failures",
        "refuse or fail this fraction of transfer batches, at random points",
        kind="rate",
        default=_D.inject_failures,
    ),
    Flag(
        "--offline-bound",
        "record the state uses and report the offline bound: the hit rate the best "
        "eviction order would get from the tree's state slots (docs/serving.md)",
        kind="switch",
    ),
    Flag(
        "--no-attention-only",
        "skip the attention-only replay that the hit-rate ratio compares with (both "
        "are then reported as null)",
        kind="switch",
    ),
    Flag(
        "--l3",
        "an L3 store shared with other caches (host pages are written there and fetched "
        "from there), one of: " + ", ".join(L3_URLS),
        kind="text",
        metavar="URL",
        shown="none",
    ),
    Flag(
        "--l3-write",
        "when host pages go to the --l3 store: backup (as soon as they are backed up to "
        "the host; what a fleet behind a round-robin router needs) or host_eviction (only "
        "when host eviction deletes them); only with --l3",
        kind="choice",
        default="backup",
        choices=("backup", "host_eviction"),
    ),
    Flag(
        "--l3-prefetch",
        "fetch from the --l3 store in the background while the request waits in the "
        "queue (others are admitted meanwhile) instead of waiting at its admission",
        kind="switch",
    ),
    Flag(
        "--l3-prefetch-timeout",
        "seconds a background fetch may take before it is called off and its request "
        "admitted without it; only with --l3-prefetch",
        kind="seconds",
        metavar="SECONDS",
        default=_D.l3_prefetch_timeout,
        hi=3600,
    ),
    Flag(
        "--servers",
        "serve with N caches (own pools, tiers and engine each) behind a round-robin "
        "router, sharing the --l3 store; reports the fleet and compares it with one server",
        metavar="N",
        default=1,
        lo=1,
        hi=64,
    ),
    Flag(
        "--shard",
        "serve only requests K, K+N, K+2N, ... (K/N): one of N processes splitting the "
        "workload as a round-robin router would",
        kind="text",
        metavar="K/N",
        shown="all requests",
    ),
    Flag("--json", "print the report as one JSON object", kind="switch"),
    Flag(
        "--plot",
        "write hit rates and pool occupancy to this image; the extension names the "
        "format (png, svg, pdf, ...); needs matplotlib",
        kind="text",
        metavar="FILE",
        shown="no plot",
    ),
    Flag("--quiet", "no progress bar", kind="switch"),
)

BENCH_FLAGS = (
    Flag("--numpy", "hand tokens to the cache as NumPy arrays, not lists", kind="switch"),
    Flag("--json", "print the result as one JSON object", kind="switch"),
    Flag("--quiet", "no progress bar", kind="switch"),
)

WORKLOAD_FLAGS = (
    Flag(
        "--out",
        "the JSONL file to write (written whole, then renamed into place: an interrupted "
        "command leaves the file as it was)",
        kind="text",
        metavar="FILE",
        required=True,
    ),
    Flag(
        "--requests",
        f"the first N requests of the workload (at most {MAX_REQUESTS})",
        metavar="N",
        lo=1,
        hi=MAX_REQUESTS,
        shown="all of them",
    ),
    Flag("--seed", "seeds the workload", metavar="SEED", default=0, hi=MAX_SEED),
)

FLAGS = {"replay": POOL_FLAGS + REPLAY_FLAGS, "bench": POOL_FLAGS + BENCH_FLAGS}
FLAGS["workload"] = WORKLOAD_FLAGS


class _Parser(argparse.ArgumentParser):
    """Reports a usage error as one line (the flag named), not the usage and a line."""

    def error(self, message: str) -> NoReturn:
        raise InputError(f"{self.prog}: error: {message} (see {self.prog} --help)")


def _add(p: argparse.ArgumentParser, flags: Sequence[Flag]) -> None:
    for f in flags:
        if f.kind == "switch":
            p.add_argument(f.name, action="store_true", help=f.help_text())
        elif f.kind == "choice":
            p.add_argument(f.name, choices=f.choices, help=f.help_text())
        else:
            metavar = f.metavar or {"int": "N", "rate": "RATE", "seconds": "SECONDS"}[f.kind]
            p.add_argument(
                f.name, type=f.parse, metavar=metavar, required=f.required, help=f.help_text()
            )
        # The default is resolved by _value: None tells "not given" from "given".


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


def _value(args: argparse.Namespace, name: str) -> Any:
    """Return the value of flag `name`: as given, else its default."""
    f = next(f for f in FLAGS[args.command] if f.name == name)
    v = getattr(args, f.dest)
    return f.default if v is None else v


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


# ---------------------------------------------------------------------- the checks


def _check_out(flag: str, path: str) -> None:
    """Refuse an output path that cannot be written (before any work)."""
    p = Path(path)
    if p.is_dir():
        raise InputError(f"{flag} {path}: is a directory")
    parent = p.parent
    if not parent.is_dir():
        raise InputError(f"{flag} {path}: no directory {str(parent)!r}")
    if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise InputError(f"{flag} {path}: not writable")


def _import_matplotlib() -> Any:
    # Older matplotlib releases (the last ones for Python 3.9) warn about their own
    # dependencies while importing: not the user's concern. Ctrl-C is held off until
    # the import is done (then raised): inside it, C extensions turn it into an
    # ImportError, which would read as matplotlib missing.
    with _Interrupts(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    return plt


def plot_formats() -> list[str]:
    """Return the image formats ``--plot`` writes (matplotlib's but pgf: it needs LaTeX)."""
    from matplotlib.backend_bases import FigureCanvasBase

    return sorted(set(FigureCanvasBase.get_supported_filetypes()) - {"pgf"})


def _check_plot(path: str) -> None:
    try:
        _import_matplotlib()
    except ImportError:
        raise InputError(
            "--plot needs matplotlib: pip install 'radixcache[plot]' (or pip install matplotlib)"
        ) from None
    formats = plot_formats()
    ext = Path(path).suffix[1:].lower()
    if ext not in formats:
        got = f"'.{ext}' is not" if ext else "no extension names"
        raise InputError(f"--plot {path}: {got} an image format ({', '.join(formats)})")
    _check_out("--plot", path)


_DESTS = re.compile(
    r"\b(kv_slots|mamba_slots|host_kv_slots|host_mamba_slots|page_size|write_policy"
    r"|write_through_threshold|eviction_policy|max_running|chunk_size|inject_failures"
    r"|swa_slots|swa_window|host_swa_slots)\b"
)
#: The cache's arguments whose flag is not their name.
_RENAMED = {"swa_window": "window"}


def _flag_names(message: str) -> str:
    """`message` with the cache's argument names written as the CLI's flags."""
    return _DESTS.sub(
        lambda m: "--" + _RENAMED.get(m.group(1), m.group(1)).replace("_", "-"), message
    )


def _layers(args: argparse.Namespace) -> tuple[int, int, int]:
    """Return the state slots, SWA window and SWA slots of ``--model`` and its flags.

    Raises:
        InputError: A flag of layers the model does not have (``--window``,
            ``--swa-slots``, ``--mamba-slots`` but 0), or ``--mamba-slots 0`` with
            ``--model swa-hybrid``.
    """
    model = _value(args, "--model")
    states = model in ("hybrid", "swa-hybrid")
    swa = model in ("swa", "swa-hybrid")
    mamba = args.mamba_slots
    if mamba is None:
        mamba = _D.mamba_slots if states else 0
    elif mamba and not states:
        raise InputError(f"--mamba-slots: {mamba} given with --model {model} (no Mamba layers)")
    elif not mamba and model == "swa-hybrid":
        raise InputError("--mamba-slots: 0 with --model swa-hybrid (no states): use --model swa")
    for flag in ("--window", "--swa-slots"):
        given = getattr(args, flag[2:].replace("-", "_"))
        if given is not None and not swa:
            raise InputError(
                f"{flag}: {given} given with --model {model} (no sliding-window layers)"
            )
    if not swa:
        return mamba, 0, 0
    window = DEFAULT_WINDOW if args.window is None else args.window
    swa_slots = args.swa_slots
    if swa_slots is None:
        page = _value(args, "--page-size")
        swa_slots = max(page, _value(args, "--kv-slots") // SWA_SHARE // page * page)
    return mamba, window, swa_slots


def _schedule(args: argparse.Namespace) -> dict[str, Any]:
    """Return the admission order's settings (`radixcache.serving.Scheduler`).

    Raises:
        InputError: ``--schedule-window`` or ``--max-overtakes`` without
            ``--schedule-policy lpm``.
    """
    policy = _value(args, "--schedule-policy")
    out: dict[str, Any] = {"schedule_policy": policy, "lookahead": _value(args, "--lookahead")}
    for flag in ("--schedule-window", "--max-overtakes"):
        dest = flag[2:].replace("-", "_")
        given = getattr(args, dest)
        if given is not None and policy != "lpm":
            raise InputError(f"{flag}: {given} given with --schedule-policy {policy} (lpm only)")
        if given is not None:
            out[dest] = given
    return out


def _config(args: argparse.Namespace, **extra: Any) -> _replay.ReplayConfig:
    """Build the replay's settings from the flags; the cache checks them together."""
    mamba, window, swa_slots = _layers(args)
    host_kv = _value(args, "--host-kv-slots")
    host_mamba = args.host_mamba_slots
    if host_mamba is None:  # no states, or no host tier: no host states either
        host_mamba = _D.host_mamba_slots if mamba and host_kv else 0
    elif host_mamba and not (mamba and host_kv):
        # The replay would drop them (as the default does): given, they are refused.
        why = "--mamba-slots 0 (no states)" if not mamba else "--host-kv-slots 0 (no host tier)"
        raise InputError(f"--host-mamba-slots: {host_mamba} given with {why}; pass 0")
    host_swa = args.host_swa_slots
    if host_swa is None:  # the device's share of SWA, on the host tier too
        page = _value(args, "--page-size")
        kv = _value(args, "--kv-slots")
        host_swa = min(host_kv, swa_slots * host_kv // kv // page * page) if kv else 0
    elif host_swa and not (swa_slots and host_kv):
        why = "--host-kv-slots 0 (no host tier)" if swa_slots else "no sliding-window layers"
        raise InputError(f"--host-swa-slots: {host_swa} given with {why}; pass 0")
    config = _replay.ReplayConfig(
        kv_slots=_value(args, "--kv-slots"),
        **_schedule(args),
        mamba_slots=mamba,
        host_kv_slots=host_kv,
        host_mamba_slots=host_mamba,
        page_size=_value(args, "--page-size"),
        write_policy=_value(args, "--write-policy"),
        write_through_threshold=args.write_through_threshold,
        eviction_policy=_value(args, "--eviction-policy"),
        seed=_value(args, "--seed"),
        max_running=_value(args, "--max-running"),
        chunk_size=_value(args, "--chunk-size"),
        branch_checkpoints=not args.no_branch_checkpoints,
        swa_slots=swa_slots,
        swa_window=window,
        host_swa_slots=host_swa,
        **extra,
    )
    try:
        config.cache()  # the cache's own checks, before any work
    except ValueError as e:
        raise InputError(_flag_names(str(e))) from None
    return config


def _jobs(args: argparse.Namespace) -> list[_workloads.Job]:
    """Load the workload: a built-in one, or a JSONL file with every line checked."""
    name = _value(args, "--workload")
    requests, seed = args.requests, _value(args, "--seed")
    if name in _workloads.WORKLOADS:
        return _workloads.WORKLOADS[name](requests, seed)
    path = Path(name)
    if path.is_dir():
        raise InputError(f"--workload {name}: is a directory")
    if not path.is_file():
        raise InputError(
            f"--workload {_short(name)}: neither a built-in workload "
            f"({', '.join(_workloads.WORKLOADS)}) nor a file"
        )
    try:
        return _workloads.load_jsonl(path, requests)
    except ValueError as e:
        raise InputError(f"--workload {name}: {e}") from None
    except OSError as e:
        raise InputError(f"--workload {name}: cannot read it ({e.strerror})") from None


def kv_needed(job: _workloads.Job, page_size: int) -> int:
    """KV slots a request takes alone: everything it feeds, in whole pages."""
    fed = len(job.prompt) + len(job.output) - 1  # the last output token is not fed
    return -(-fed // page_size) * page_size


def swa_needed(prompt_len: int, fed: int, window: int, chunk: int, page_size: int) -> int:
    """SWA slots a request needs at least, alone in an empty cache (the replay's scheduler).

    The scheduler feeds the prompt in chunks of `chunk` tokens from 0 (cut at the last
    whole page of the `fed` tokens), checkpointing after each, then one token a step up
    to `fed`. At an extend of tokens ``[s, e)`` the request holds the SWA KV of its pages
    up to `e` from where its window at `s` starts: 0 while `s` is within the window in
    whole pages (``W``), else ``s``'s page start less ``W`` (docs/contract.md rule 15: a
    request gives back its pages before its last whole page's window). While it decodes,
    the window the prompt's last checkpoint locked (the ``W`` before the prompt's last
    whole page) stays too, until the checkpoint at the sequence's last whole page: with
    an output longer than the window that is about twice the window. The largest of
    these over the extends (a few of each kind: every kind repeats) is the answer. A
    lower bound: the tree may pin a few pages more.
    """
    ps = page_size

    def up(n: int) -> int:
        return -(-n // ps) * ps

    need_w = up(window)

    def held(s: int, e: int) -> int:
        return up(e) - (s // ps * ps - need_w if s >= need_w else 0)

    last_page = fed // ps * ps
    limit = last_page if 0 < last_page < prompt_len else prompt_len
    chunks = -(-limit // chunk)  # the chunks that start at a multiple of `chunk`

    def at(k: int) -> int:
        s = k * chunk
        return held(s, min(limit, s + chunk))

    after = -(-need_w // chunk)  # the first chunk that starts past the window
    period = min(ps // math.gcd(chunk, ps), 64)  # their starts' offsets in a page repeat
    ks = {0, min(after, chunks) - 1, chunks - 1, *range(after, min(after + period, chunks))}
    peak = max(at(k) for k in ks if 0 <= k < chunks)
    if limit < prompt_len:  # the prompt's tail after the cut
        peak = max(peak, held(limit, min(prompt_len, limit + chunk)))
    if fed > prompt_len:  # decode, one token a step; after `last_page`, its window alone
        peak = max(peak, need_w + ps if fed - 1 >= need_w else up(fed))
        c = prompt_len // ps * ps  # the prompt's last checkpoint
        s = (last_page if prompt_len < last_page else fed) - 1  # the last before it moves
        if s >= prompt_len:
            own_freed = max(0, s // ps * ps - need_w - c)
            peak = max(peak, up(s + 1) - max(0, c - need_w) - own_freed)
    return peak


def _check_fits(
    args: argparse.Namespace, jobs: Sequence[_workloads.Job], config: _replay.ReplayConfig
) -> None:
    """Refuse a workload with a request that a device pool cannot hold even alone.

    The KV pool must hold all a request feeds (`kv_needed`); with SWA layers, the SWA
    pool its window and a prefill chunk (`swa_needed`), and the message gives the
    smallest ``--swa-slots`` that holds every request of the workload so.
    """
    ps = config.page_size
    name = _value(args, "--workload")

    def where(i: int, job: _workloads.Job) -> str:
        return f"line {job.line}" if job.line is not None else f"request {i + 1}"

    for i, job in enumerate(jobs):
        need = kv_needed(job, ps)
        if need > config.kv_slots:
            raise InputError(
                f"--workload {name}: {where(i, job)}: needs {need} KV slots "
                f"(prompt {len(job.prompt)} + output {len(job.output)} tokens, in pages of "
                f"{ps}), more than --kv-slots {config.kv_slots}: it could never be served"
            )
    if not config.swa_slots:
        return
    chunk = min(config.chunk_size, config.step_tokens)
    slots, window = config.swa_slots, config.swa_window
    first: tuple[int, _workloads.Job, int] | None = None
    most = 0
    seen: dict[tuple[int, int], int] = {}
    for i, job in enumerate(jobs):
        fed = len(job.prompt) + len(job.output) - 1
        if -(-fed // ps) * ps <= slots:
            continue  # it never holds more than all its pages
        key = (len(job.prompt), fed)
        if key not in seen:
            seen[key] = swa_needed(len(job.prompt), fed, window, chunk, ps)
        need = seen[key]
        if need > slots:
            first = first or (i, job, need)
            most = max(most, need)
    if first is not None:
        i, job, need = first
        given = "" if args.swa_slots is not None else f" (the default, 1/{SWA_SHARE} of --kv-slots)"
        raise InputError(
            f"--swa-slots {slots}{given}: too small for --window {window}: "
            f"--workload {name}: {where(i, job)} needs at least {need} SWA slots alone (its "
            f"last --window {window} tokens and a --chunk-size {chunk} prefill chunk, in "
            f"pages of {ps}); the smallest pool for every request is --swa-slots {most} "
            "(or pass a smaller --chunk-size)"
        )


def _setup(
    args: argparse.Namespace, **extra: Any
) -> tuple[list[_workloads.Job], _replay.ReplayConfig]:
    """Check every flag and input of replay and bench; the workload and settings.

    Raises:
        InputError: The first bad flag or input, named.
    """
    config = _config(args, **extra)
    if getattr(args, "plot", None) is not None:
        _check_plot(args.plot)
    jobs = _jobs(args)
    _check_fits(args, jobs, config)
    return jobs, config


# ---------------------------------------------------------------------- the commands


def _emit(text: str) -> None:
    """Print `text` on stdout; OutputError when it cannot be written (a full disk)."""
    try:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    except OSError as e:
        # Nothing more can reach stdout: point it at /dev/null so that the interpreter's
        # own flush at exit does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise OutputError(f"cannot write to stdout ({e.strerror})") from None


def _glossary_cmd(args: argparse.Namespace) -> int:

    _emit(markdown().rstrip("\n"))
    return 0


def _workload_cmd(args: argparse.Namespace) -> int:
    out = args.out
    _check_out("--out", out)
    jobs = _workloads.WORKLOADS[args.name](args.requests, _value(args, "--seed"))
    try:
        n = _workloads.save_jsonl(jobs, out)
    except OSError as e:
        raise OutputError(f"--out {out}: cannot write it ({e.strerror})") from None
    s = _workloads.stats(jobs)
    print(
        f"wrote {n} requests ({s['prompt_tokens']} prompt tokens, "
        f"{s['output_tokens']} output tokens) to {out}",
        file=sys.stderr,
    )
    return 0


class _Interrupts:
    """Ctrl-C during a run stops it between two scheduler steps, not inside a cache call.

    The first SIGINT is noted, and raised as `KeyboardInterrupt` after the scheduler step
    under way (`between`), or when the run ends (its last phases, the audit, clearing
    the cache and the attention-only replay, take seconds); a second one is raised at
    once. SIGINT is left alone outside the main thread or when Python's own handler is
    not the one installed (it is ignored, or the caller has its own).
    """

    def __init__(self) -> None:
        self.pending = False
        self._previous: Any = None

    def __enter__(self) -> _Interrupts:
        if (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        ):
            self._previous = signal.signal(signal.SIGINT, self._note)
        return self

    def _note(self, signum: int, frame: Any) -> None:
        if self.pending:
            raise KeyboardInterrupt
        self.pending = True

    def check(self) -> None:
        """Raise `KeyboardInterrupt` if Ctrl-C was pressed."""
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt

    def between(self, bar: Any, task: Any) -> Callable[[int], None]:
        """Return the scheduler's progress callback: update the bar, then `check`."""

        def progress(done: int) -> None:
            bar.update(task, completed=done)
            self.check()

        return progress

    def __exit__(self, kind: object, value: object, tb: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        if kind is None:
            self.check()


def _progress(err: Any, quiet: bool) -> Any:

    return Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        "eta",
        TimeRemainingColumn(),
        console=err,
        disable=quiet,
        transient=True,
    )


def _causes(causes: dict[str, int]) -> str:
    """Return the L3 errors by cause, most first (``"3 connection refused, 1 timeout"``)."""
    if not causes:
        return "no errors"
    order = sorted(causes.items(), key=lambda kv: (-kv[1], kv[0]))
    return ", ".join(f"{n} {cause}" for cause, n in order)


def _failures(r: dict[str, Any]) -> list[str]:
    """Why a run failed (empty: it did not)."""
    why = []
    if r.get("mismatches", 0):
        why.append(f"{r['mismatches']} oracle mismatches")
    if r.get("audit", "pass") != "pass":
        why.append("the audit failed")
    if not r["pools_full_at_end"]:
        why.append("a pool is not full once the cache is cleared (a leak)")
    if r["rejected"]:
        why.append(f"{r['rejected']} requests rejected (no room even alone)")
    return why


def _verdict(prog: str, r: dict[str, Any]) -> int:
    why = _failures(r)
    if why:
        print(f"{prog}: failed: {'; '.join(why)}", file=sys.stderr)
    return 1 if why else 0


def _shard(text: str | None) -> tuple[int, int] | None:
    """Parse ``--shard K/N`` (0 <= K < N)."""
    if text is None:
        return None
    k, sep, n = text.partition("/")
    if not (sep and k.isdigit() and n.isdigit() and 0 <= int(k) < int(n)):
        raise InputError(f"--shard: expected K/N with 0 <= K < N, got {_short(text)}")
    return int(k), int(n)


def _open_l3(url: str) -> None:
    """Open the ``--l3`` store once before the run, as the replay will, and check it.

    The check (`radixcache.ObjectStore.check`) connects, authenticates and selects the
    database now: a store that cannot be reached or refuses the credentials ends the run
    before it starts, naming the cause.

    Raises:
        InputError: Opening it fails (`radixcache.l3.open_store`): a URL of no scheme,
            an unknown one (the message lists the forms) or a bad part (`ValueError`),
            a store that cannot be set up, such as a ``file://`` directory that cannot
            be made (`radixcache.L3Error`), or a missing package (`ImportError`:
            ``mooncake://`` without the ``mooncake`` extra); or the check fails
            (connection refused, authentication failed, bad database, timeout, ...).
    """
    try:
        store = open_store(url)
    except (ValueError, L3Error, ImportError) as e:
        raise InputError(f"--l3: {e}") from None
    try:
        check = getattr(store, "check", None)
        if check is not None:
            check()
    except L3Error as e:
        raise InputError(f"--l3 {redact(url)}: the store cannot be used: {e}") from None
    finally:
        close = getattr(store, "close", None)
        if close is not None:
            close()


def _replay_cmd(args: argparse.Namespace) -> int:

    err = Console(stderr=True)
    shard = _shard(args.shard)
    servers = _value(args, "--servers")
    if shard and servers > 1:
        raise InputError("--shard: one process serves one shard; not with --servers")
    if args.l3 is not None:
        _open_l3(args.l3)
    elif args.l3_write is not None:
        raise InputError("--l3-write: only with --l3 (there is no store to write to)")
    elif args.l3_prefetch:
        raise InputError("--l3-prefetch: only with --l3 (there is no store to fetch from)")
    if args.l3_prefetch_timeout is not None and not args.l3_prefetch:
        raise InputError("--l3-prefetch-timeout: only with --l3-prefetch")
    jobs, config = _setup(
        args,
        inject_failures=_value(args, "--inject-failures"),
        timeline=10 if args.plot else 0,
        attention_only=not args.no_attention_only,
        offline_bound=args.offline_bound,
        l3=args.l3,
        l3_write=_value(args, "--l3-write"),
        l3_prefetch=args.l3_prefetch,
        l3_prefetch_timeout=_value(args, "--l3-prefetch-timeout"),
    )
    workload = _value(args, "--workload")
    if shard:
        jobs = _replay.deal(jobs, shard[1], shard[0])
    with _store_log(err):
        return _serve(args, err, jobs, config, workload, shard, servers)


class _ConsoleLog(logging.Handler):
    """Writes log records on stderr's console, above a live progress bar."""

    def __init__(self, console: Any) -> None:
        super().__init__(logging.WARNING)
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        line = f"radixcache: {record.getMessage()}"
        self.console.print(line, markup=False, highlight=False, soft_wrap=True)


@contextlib.contextmanager
def _store_log(err: Any) -> Iterator[None]:
    """Print what the L3 tier logs on stderr while the replay runs, when it happens.

    That is an outage's first error of each cause, the breaker's trips, and the store
    answering again.
    """
    log = logging.getLogger("radixcache.l3")
    handler = _ConsoleLog(err)
    log.addHandler(handler)
    try:
        yield
    finally:
        log.removeHandler(handler)


def _serve(
    args: argparse.Namespace,
    err: Any,
    jobs: Any,
    config: Any,
    workload: str,
    shard: tuple[int, int] | None,
    servers: int,
) -> int:
    """Serve the replay (or the fleet) and report; the exit status."""
    if servers > 1:
        with _Interrupts() as stop, _progress(err, args.quiet) as bar:
            task = bar.add_task(f"replay {workload} on {servers} servers", total=len(jobs))
            fleet = _replay.replay_fleet(
                jobs,
                config,
                servers,
                progress=stop.between(bar, task),
                compare=not args.no_attention_only,
            )
        fleet["workload"] = workload
        fleet["rejected"] = 0
        _emit(json.dumps(fleet, indent=2) if args.json else _render(_fleet_table(fleet)))
        return _verdict("radixcache replay", fleet)
    with _Interrupts() as stop, _progress(err, args.quiet) as bar:
        task = bar.add_task(f"replay {workload}", total=len(jobs))
        report, timeline = _replay.replay(jobs, config, progress=stop.between(bar, task))
    report["workload"] = workload
    report["shard"] = None if shard is None else f"{shard[0]}/{shard[1]}"
    if args.json:
        _emit(json.dumps(report, indent=2))
    else:
        _emit(_render(_report_table(report)))
    status = _verdict("radixcache replay", report)
    if args.plot:
        try:
            _plot(timeline, args.plot, workload)
        except OSError as e:
            raise OutputError(f"--plot {args.plot}: cannot write it ({e.strerror})") from None
        print(f"wrote {args.plot}", file=sys.stderr)
    return status


def _bench_cmd(args: argparse.Namespace) -> int:

    err = Console(stderr=True)
    jobs, config = _setup(args)
    workload = _value(args, "--workload")
    with _Interrupts() as stop, _progress(err, args.quiet) as bar:
        task = bar.add_task(f"bench {workload}", total=len(jobs))
        r = _bench.bench(jobs, config, numpy_tokens=args.numpy, progress=stop.between(bar, task))
    r["workload"] = workload
    if args.json:
        _emit(json.dumps(r, indent=2))
        return _verdict("radixcache bench", r)
    _emit(_render(_bench_table(r), ops_table(r["ops"], "per operation")))
    return _verdict("radixcache bench", r)


def _bench_table(r: dict[str, Any]) -> Any:
    """Return bench's report (but the table of operations) as a rich table."""
    head = Table(
        title=f"radixcache bench: {escape(str(r['workload']))}", show_header=False, box=None
    )
    head.add_column(style="bold")
    head.add_column(justify="right")
    head.add_column(style="dim")
    head.add_row("requests", str(r["requests"]), f"{r['prompt_tokens']} prompt tokens")
    head.add_row("tokens passed as", r["tokens"])
    head.add_row("eviction policy", *_policy_text(r["eviction_policy"], r["model"]))
    head.add_row("model", r["model"])
    head.add_row(
        "device hit rate", f"{100 * r['hit_rate']:.1f}%", "device hit tokens / prompt tokens"
    )
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
    return head


def ops_table(ops: dict[str, dict[str, Any]], title: str, limit: int | None = None) -> Any:
    """Return a rich table of per-operation figures (``bench``'s ``ops``), `limit` rows."""
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


def _render(*tables: Any) -> str:
    """Render rich tables as stdout would show them (colour on a terminal only)."""
    stdout = Console()
    text = io.StringIO()
    console = Console(
        file=text,
        force_terminal=stdout.is_terminal,
        color_system=stdout.color_system,  # type: ignore[arg-type]
        width=stdout.width,
    )
    for t in tables:
        console.print(t)
    return text.getvalue().rstrip("\n")


def _report_table(r: dict[str, Any]) -> Any:
    """Return the replay's report as a rich table."""
    t = Table(title=f"radixcache replay: {escape(str(r['workload']))}", show_header=False, box=None)
    t.add_column(style="bold")
    t.add_column(justify="right")
    t.add_column(style="dim")

    def row(name: str, value: Any, note: str = "") -> None:
        t.add_row(name, str(value), note)

    def pct(x: float) -> str:
        return f"{100 * x:.1f}%"

    row("requests", r["requests"], f"{r['retractions']} retractions, {r['rejected']} rejected")
    row("prompt tokens", r["prompt_tokens"], f"{r['prefill_tokens']} computed")
    row("output tokens", r["output_tokens"])
    row("eviction policy", *_policy_text(r["eviction_policy"], r["model"]))
    wait, over = r["queue_wait_steps"], r["overtaken"]
    row(
        "schedule policy",
        r["schedule_policy"],
        f"{r['steps']} scheduler steps"
        + (
            ""
            if r["schedule_window"] is None
            else f"; window {r['schedule_window']}, at most {r['max_overtakes']} overtakes"
        )
        + (f"; lookahead {r['lookahead']}" if r["lookahead"] else ""),
    )
    if r["lookahead"]:
        row("queue cuts", r["queue_cuts"], "where waiting prompts branch off")
    row(
        "queue wait",
        f"{wait['mean']:.0f} steps",
        f"mean; p99 {wait['p99']:.0f}, max {wait['max']:.0f}; overtaken mean "
        f"{over['mean']:.1f}, p99 {over['p99']:.0f}, max {over['max']:.0f}",
    )
    model, swa = r["model"], r["swa_window"] > 0
    row("model", model, f"window {r['swa_window']} tokens" if swa else "")
    row(
        "device hit tokens",
        r["device_hit_tokens"],
        f"{pct(r['device_hit_rate'])} on the device",
    )
    row(
        "host hit tokens",
        r["host_hit_tokens"],
        f"{pct(r['host_hit_rate'])} loaded back from the host",
    )
    if r["restored_hit_tokens"]:
        restored = pct(r["restored_hit_tokens"] / r["prompt_tokens"])
        note = f"{restored} device KV, its state from the host"
        row("restored hit tokens", r["restored_hit_tokens"], note)
    if r["l3_breaker"] is not None:
        row(
            "L3 hit tokens",
            r["l3_hit_tokens"],
            f"{pct(r['l3_hit_rate'])} fetched from L3, then loaded back",
        )
    tiers = "device + host" + (" + L3" if r["l3_breaker"] is not None else "")
    row("hit rate, all tiers", pct(r["hit_rate"]), tiers)
    if r["l3_breaker"] is not None:
        row(
            "L3 store",
            f"{r['l3_bytes_fetched'] / 1e6:.1f} MB fetched",
            f"{r['l3_fetch_gbps']:.2f} GB/s; {r['l3_bytes_stored'] / 1e6:.1f} MB stored, "
            f"{r['l3_put_gbps']:.2f} GB/s; {r['l3_corrupt_objects']} corrupt, "
            f"{r['l3_foreign_objects']} foreign, {r['l3_missing_objects']} missing",
        )
        row(
            "L3 errors",
            r["l3_errors"],
            f"breaker {r['l3_breaker']}; {_causes(r['l3_error_causes'])}",
        )
        if r["l3_prefetches"]:
            row(
                "L3 prefetches",
                r["l3_prefetches"],
                f"in the background; {r['l3_prefetch_timeouts']} called off, "
                f"{r['l3_prefetch_wait_steps']} steps waited in all",
            )

    def compared(name: str, rate: float | None, ratio: float | None, label: str) -> None:
        # A comparison replay's hit rate and the ratio to it ("not run" when skipped).
        shown = "n/a" if ratio is None else f"{ratio:.3f}"
        row(
            name, "n/a" if rate is None else pct(rate), "not run" if rate is None else label + shown
        )

    compared(
        "attention-only device hit rate",
        r["attention_only_hit_rate"],
        r["hit_rate_ratio"],
        f"{model}/attention ",
    )
    if swa:
        compared(
            "full-attention device hit rate",
            r["full_attention_hit_rate"],
            r["swa_vs_full_hit_ratio"],
            f"SWA as full attention; {model}/full ",
        )
    attn_saved = r["attention_only_compute_saved_ratio"]
    row(
        "compute saved",
        pct(r["compute_saved_ratio"]),
        "prefill FLOPs, all tiers"
        + ("" if attn_saved is None else f"; attention-only {pct(attn_saved)}"),
    )
    bound = r["offline_bound_hit_rate"]
    if bound is not None:
        b_ratio = r["offline_bound_ratio"]
        row(
            "offline bound",
            pct(bound),
            "device; "
            + ("" if b_ratio is None else f"hybrid/attention {b_ratio:.3f}; ")
            + f"LRU model {pct(r['offline_lru_hit_rate'])}",
        )
    row("copy-on-write copies", r["cow_copies"], f"{r['checkpoints']} checkpoints")
    row("backups", r["backups"], f"{r['backups_failed']} failed")
    row("demotions", r["demotions"], "kept on the host")
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
    if swa:
        row(
            "SWA pages freed",
            f"{r['swa_window_freed_pages']} by windows",
            f"{r['swa_evicted_pages']} evicted, {r['swa_tombstones']} tombstones,"
            f" {r['swa_revived_pages']} revived",
        )
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
    audit = r["audit"]
    row("audit", (good[0] if audit == "pass" else good[1]).format(escape(audit)))
    full = r["pools_full_at_end"]
    row("pools full at end", (good[0] if full else good[1]).format(full), "after clearing")
    return t


def _fleet_table(r: dict[str, Any]) -> Any:
    """Return a fleet replay's report as a rich table."""
    title = f"radixcache replay: {escape(str(r['workload']))} on {r['servers']} servers"
    t = Table(title=title, show_header=False, box=None)
    t.add_column(style="bold")
    t.add_column(justify="right")
    t.add_column(style="dim")

    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{100 * x:.1f}%"

    t.add_row("requests", str(r["requests"]), f"{r['prompt_tokens']} prompt tokens")
    t.add_row(
        "fleet hit rate",
        pct(r["hit_rate"]),
        f"all tiers: device {pct(r['device_hit_rate'])}, host {pct(r['host_hit_rate'])}, "
        f"L3 {pct(r['l3_hit_rate'])}",
    )
    ratio = r["fleet_vs_single_ratio"]
    t.add_row(
        "one server, every request",
        pct(r["single_server_hit_rate"]),
        "all tiers, same pools; fleet/one " + ("n/a" if ratio is None else f"{ratio:.3f}"),
    )
    t.add_row(
        "fleet without L3", pct(r["fleet_without_l3_hit_rate"]), "all tiers, the same servers"
    )
    if r["l3_breaker"] is not None:
        t.add_row(
            "L3 store",
            f"{r['l3_bytes_fetched'] / 1e6:.1f} MB fetched",
            f"{r['l3_fetch_gbps']:.2f} GB/s; {r['l3_bytes_stored'] / 1e6:.1f} MB stored; "
            f"{r['l3_corrupt_objects']} corrupt, {r['l3_foreign_objects']} foreign",
        )
        breakers = ", ".join(f"{s['l3_breaker']} ({s['l3_errors']})" for s in r["per_server"])
        t.add_row(
            "L3 errors",
            str(r["l3_errors"]),
            f"breakers {breakers}; {_causes(r['l3_error_causes'])}",
        )
        if r["l3_prefetches"]:
            t.add_row(
                "L3 prefetches",
                str(r["l3_prefetches"]),
                f"{r['l3_prefetch_timeouts']} called off, "
                f"{r['l3_prefetch_wait_steps']} steps waited in all",
            )
    good = "[green]{}[/green]", "[red]{}[/red]"
    t.add_row(
        "oracle mismatches",
        (good[0] if r["mismatches"] == 0 else good[1]).format(r["mismatches"]),
        f"of {r['samples_checked']} samples",
    )
    t.add_row("audit", (good[0] if r["audit"] == "pass" else good[1]).format(escape(r["audit"])))
    full = r["pools_full_at_end"]
    t.add_row("pools full at end", (good[0] if full else good[1]).format(full), "every server")
    return t


def _policy_text(policy: dict[str, str], model: str) -> tuple[str, str]:
    """Return the eviction policy as a value and a note naming the others where they differ.

    The value is the states' policy in a model with states (``hybrid``, ``swa-hybrid``),
    else the KV's; a model without states has no states' policy to show.
    """
    states = model in ("hybrid", "swa-hybrid")
    first, first_name = ("mamba", "states") if states else ("kv", "KV")
    value = policy[first]
    others = [
        f"{name} {policy[key]}"
        for key, name in (("kv", "KV"), ("swa", "SWA"))
        if key != first and policy.get(key, value) != value
    ]
    return (value, f"{first_name}; " + ", ".join(others) if others else "")


def _plot(timeline: list[StepSample], path: str, title: str) -> None:
    plt = _import_matplotlib()
    fig = _figure(plt, timeline, title)
    try:
        fig.savefig(path, dpi=100, bbox_inches="tight")
    finally:
        plt.close(fig)


def _figure(plt: Any, timeline: list[StepSample], title: str) -> Any:
    """Return the ``--plot`` figure: hit rates and pool occupancy against requests finished.

    The legends stand to the right of the axes, so that they never cover a curve.
    """
    fig, (a, b) = plt.subplots(2, 1, figsize=(9, 6), sharex=True, layout="constrained")
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
    a.legend(loc="upper left", bbox_to_anchor=(1.01, 1))
    a.set_title(f"radixcache replay: {title}")
    b.plot(x, [s.kv_used for s in timeline], label="device KV")
    b.plot(x, [s.mamba_used for s in timeline], label="device states")
    b.plot(x, [s.host_kv_used for s in timeline], label="host KV")
    b.set_ylabel("pool occupancy")
    b.set_ylim(0, 1.05)
    b.set_xlabel("requests finished")
    b.legend(loc="upper left", bbox_to_anchor=(1.01, 1))
    return fig


if __name__ == "__main__":
    raise SystemExit(main())
