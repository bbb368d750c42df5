"""``radixcache replay``: serve a workload through the scheduler and the checksum model, and report.

One server (`radixcache.serving.harness.replay`), or several behind a round-robin router
sharing an ``--l3`` store (``--servers``); ``--shard K/N`` serves one router's share.
The ``--l3`` store is opened and checked before the run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from collections.abc import Iterator
from typing import Any

from rich.console import Console

from .. import L3Error
from ..l3 import open_store, redact
from ..serving import harness as _replay
from .checks import _setup
from .flags import InputError, OutputError, _short, _value
from .interrupts import _Interrupts
from .report import _emit, _fleet_table, _plot, _progress, _render, _report_table, _verdict


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
