"""What ``replay`` and ``bench`` check before any work: the flags, the outputs, the workload.

`_setup` runs the checks in order: the flags together (`_config`: the layers of
``--model``, the admission order, the cache's own checks with the flags' names), the
``--plot`` path, the workload (`_jobs`: every line of a file), and whether each request fits
the device pools alone (`_check_fits`, with `kv_needed` and `swa_needed`). Each raises
`InputError` naming the flag, or the file and line.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..serving import harness as _replay
from ..serving import workloads as _workloads
from .flags import _D, DEFAULT_WINDOW, SWA_SHARE, InputError, _short, _value
from .report import _import_matplotlib, plot_formats


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
