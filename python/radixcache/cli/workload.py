"""``radixcache workload``: write a built-in workload as JSONL, one request a line."""

from __future__ import annotations

import argparse
import sys

from ..serving import workloads as _workloads
from .checks import _check_out
from .flags import OutputError, _value


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
