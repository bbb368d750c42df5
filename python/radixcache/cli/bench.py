"""``radixcache bench``: time every cache call of a replay with no model and no copies."""

from __future__ import annotations

import argparse
import json

from rich.console import Console

from ..serving import bench as _bench
from .checks import _setup
from .flags import _value
from .interrupts import _Interrupts
from .report import _bench_table, _emit, _progress, _render, _verdict, ops_table


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
