"""The command line's flags: one table per command, each flag's type, range, default and help.

`Flag` says how an option is parsed and checked alone (argparse names it on an error);
`FLAGS` holds every command's options, which ``--help`` lists and `_add` gives a parser.
A default the flag takes from the replay comes from `radixcache.serving.harness.ReplayConfig`,
so that ``--help`` states the library's own. `InputError` and `OutputError` are the
command's two failures (status 2 and 1).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from ..serving import harness as _replay
from ..serving.model import MODELS
from ..serving.scheduler import SCHEDULE_POLICIES

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


def _value(args: argparse.Namespace, name: str) -> Any:
    """Return the value of flag `name`: as given, else its default."""
    f = next(f for f in FLAGS[args.command] if f.name == name)
    v = getattr(args, f.dest)
    return f.default if v is None else v
