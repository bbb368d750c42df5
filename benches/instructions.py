"""Instructions per call of the core's operations, a base revision against the working tree.

A like-for-like measure for a change that must not slow anything down, which load on a
shared machine does not disturb: each scenario repeats one identical step through the
public Python API (only calls that revision 33fe0e9 already had, so that old bases run it
too), under ``valgrind --tool=callgrind`` for each side, and the table gives the inclusive
instructions per call of the core's functions that step runs (callgrind's counts of the
side's ``_core`` extension, divided by the number of calls), base against head, with the
ratio. Every iteration of a scenario does the same work, so a figure does not depend on
how many iterations ran; a function a scenario's setup also calls (a few times, the same on
both sides) is read in the scenario where the loop calls it, and nowhere else.

The scenarios (``--list`` prints them with the functions each reads):

- ``admit``, ``extend``, ``decode``, ``checkpoint``, ``finish``: py_calls' request shapes
  at 128 tokens on ``HybridCache(page_size=1, mamba_slots=64)``: admit a prompt whose
  first half is cached with a state (then run its copy-on-write and abort); extend it by
  the uncached half; one-token decode steps; checkpoint or finish the extended request,
  then evict the leaf it cached (``evict`` is read there). ``refresh`` (the eviction sets'
  upkeep) is read per call and, as ``refresh/admit`` and ``refresh/finish``, all its
  calls per step: a change may make its calls fewer or cheaper.
- ``alloc``: ``alloc_kv`` of 128 slots when the pool is short, so that it evicts the leaf
  cached last, which ``insert`` puts back (the same leaf every time).
- ``match/LEN``, ``match_p16/LEN``, ``match_miss/LEN``, ``insert/LEN``, ``insert_p16/LEN``
  at 512, 2,048 and 8,192 tokens: the criterion ``radix`` shapes (``benches/benches/
  radix.rs``) on a smaller tree: a cached system prompt and conversations that grew turn by
  turn (a node per turn, branches); a match of a cached history and a new message (round
  robin over four), a miss, and an insert of the system prompt with ``LEN`` new tokens
  (untimed match, lock, ``alloc_kv`` before it, unlock after; the pool never runs short).

Run it from the working tree with the dev venv (maturin, numpy) and valgrind installed::

    python benches/instructions.py BASE [--only admit,extend] [--iterations N] [--json]

It builds the base's wheel and the working tree's (``maturin build --release``, the same
Cargo profile) the way ``benches/compare.py`` does, under ``target/compare-bench`` (shared
with it, so either reuses the other's builds), then runs every scenario under callgrind,
a process per scenario and side (about 9 minutes on a loaded 2-core machine once built).
``--sites BASE_DIR HEAD_DIR`` measures two directories where radixcache is installed
already, and builds nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parent))

import compare

T = TypeVar("T")

SEED = 20
VOCAB = 32_000
REQUEST_TOKENS = 128
MAMBA_SLOTS = 64
SHAPE_LENS = (512, 2048, 8192)
SYSTEM_TOKENS = 512
QUERIES = 4
#: Default iterations of a scenario's loop.
ITERATIONS = {"request": 300, "shape": 60}


def _core(name: str) -> str:
    """Return the pattern of the core's `Cache` method ``name`` (``impl Cache`` in any module)."""
    return rf"radixcache_core::cache::((\w+::)+<impl radixcache_core::cache::Cache>|Cache)::{name}"


#: What the tables show: a name, and the pattern of the core function it reads (the
#: demangled name without its hash; alternatives where a revision named it otherwise).
FUNCTIONS = {
    "admit": _core("(admit|admit_with_priority)"),
    "extend": _core("extend"),
    "checkpoint": _core("checkpoint"),
    "finish": _core("finish"),
    "publish": _core("publish"),
    "abort": _core("abort"),
    "evict": _core("evict"),
    "alloc_pages": _core("(alloc_pages|alloc_pages_with)"),
    "alloc_kv": _core("alloc_kv"),
    "match_prefix": _core("match_prefix"),
    "insert": _core("(insert|insert_with_state|insert_with_priority)"),
    "unlock": _core("unlock"),
    "refresh": _core("refresh"),
}

#: Scenario -> the functions it reads (the ones its loop calls the same way every time;
#: ``NAME/OP``: all of NAME per call of OP, see `per_call`).
READS = {
    "admit": ("admit", "refresh", "refresh/admit"),
    "extend": ("extend", "alloc_pages"),
    "decode": ("extend",),
    "checkpoint": ("checkpoint",),
    "finish": ("finish", "publish", "evict", "refresh/finish"),
    "alloc": ("alloc_kv", "alloc_pages", "evict"),
    **{
        f"{shape}/{n}": ("match_prefix",)
        for shape in ("match", "match_p16", "match_miss")
        for n in SHAPE_LENS
    },
    **{f"{shape}/{n}": ("insert",) for shape in ("insert", "insert_p16") for n in SHAPE_LENS},
}


# --- the scenarios (run in the child, under callgrind) ---------------------------------


def _scenario(name: str, iterations: int) -> None:
    """Run scenario ``name`` for ``iterations`` iterations."""
    import numpy as np

    import radixcache as rc

    rng = np.random.default_rng(SEED)

    def fresh(n: int) -> Any:
        return rng.integers(1, VOCAB, size=n, dtype=np.int64)

    def drain(cache: Any) -> None:
        for batch in cache.take_batches():
            cache.complete(batch.id)

    def check(ok: bool, what: str) -> None:
        if not ok:
            raise RuntimeError(f"scenario {name}: {what}")

    def some(value: T | None, what: str) -> T:
        if value is None:
            raise RuntimeError(f"scenario {name}: {what}")
        return value

    kind, _, arg = name.partition("/")
    if kind in ("admit", "extend", "decode", "checkpoint", "finish"):
        n = REQUEST_TOKENS
        cache = rc.HybridCache(kv_slots=4 * n + 4096, page_size=1, mamba_slots=MAMBA_SLOTS)
        prompt = fresh(n)
        half = n // 2

        def request(tokens: Any) -> Any:
            req = some(cache.admit(tokens), "admit refused")
            drain(cache)
            check(cache.extend(req, tokens[req.prefix_len :]) is not None, "extend refused")
            return req

        cache.finish(request(prompt[:half]))  # the cached half, with a state
        drain(cache)
        rest = prompt[half:]
        token = np.array([7], dtype=np.int64)
        for _ in range(iterations):
            if kind == "admit":
                req = some(cache.admit(prompt), "admit refused")
                check(req.prefix_len == half, "admit missed the prefix")
                drain(cache)
                cache.abort(req)
            elif kind == "extend":
                req = some(cache.admit(prompt), "admit refused")
                drain(cache)
                check(cache.extend(req, rest) is not None, "extend refused")
                cache.abort(req)
            elif kind == "decode":
                req = request(prompt)
                for _ in range(8):
                    check(cache.extend(req, token) is not None, "extend refused")
                cache.abort(req)
            else:
                req = request(prompt)
                getattr(cache, kind)(req)
                drain(cache)
                if req.live:
                    cache.abort(req)
                got = cache.evict(kv_tokens=n - half).kv_tokens
                check(got == n - half, f"evicted {got} tokens, not the leaf's {n - half}")
    elif kind == "alloc":
        n = REQUEST_TOKENS
        cache = rc.HybridCache(kv_slots=n, page_size=1)
        leaf = fresh(n)
        cache.insert(leaf, some(cache.alloc_kv(n), "alloc_kv refused"))  # the pool is full now
        for _ in range(iterations):
            cache.insert(leaf, some(cache.alloc_kv(n), "alloc_kv refused"))
    else:
        _shape(kind, int(arg), iterations, fresh, check)


def _shape(kind: str, n: int, iterations: int, fresh: Callable[[int], Any], check: Any) -> None:
    """Run the criterion ``radix`` shape ``kind`` at ``n`` tokens (match, match_miss, insert)."""
    import numpy as np

    import radixcache as rc

    page = 16 if kind.endswith("_p16") else 1
    inserting = kind.startswith("insert")
    room = 4 * QUERIES * n + SYSTEM_TOKENS + (iterations + 1) * n * inserting
    cache = rc.HybridCache(kv_slots=room + 8192, page_size=page)

    def cache_tokens(tokens: Any) -> None:
        m = cache.match_prefix(tokens)
        with cache.lock(m.node):
            slots = cache.alloc_kv(len(tokens) - m.device_len)
            check(slots is not None, "alloc_kv refused")
            cache.insert(tokens, np.concatenate([m.kv_indices, slots]), owned_from=m.device_len)

    system = fresh(SYSTEM_TOKENS)
    cache_tokens(system)
    queries = []
    h = n * 3 // 4  # the cached history of a query
    shared = min(SYSTEM_TOKENS, h // 4)  # of which the system prompt's
    for _ in range(QUERIES):
        # a conversation that grew in four turns (a node each), and a branch off its third
        history = np.concatenate([system[:shared], fresh(h - shared)])
        ends = [(shared + (h - shared) * turn // 4) // page * page for turn in (1, 2, 3, 4)]
        for end in ends:
            cache_tokens(history[:end])
        cache_tokens(np.concatenate([history[: ends[2]], fresh(n // 4)]))
        queries.append(np.concatenate([history, fresh(n - h)]))
    if kind.startswith("match"):
        miss = kind == "match_miss"
        for i in range(iterations):
            tokens = fresh(n) if miss else queries[i % QUERIES]
            got = cache.match_prefix(tokens).device_len
            check(got == (0 if miss else h), f"matched {got}")
    else:
        prompts = [np.concatenate([system, fresh(n)]) for _ in range(iterations)]
        for tokens in prompts:
            cache_tokens(tokens)


# --- reading callgrind's output ----------------------------------------------------------


@dataclass
class Cost:
    """Inclusive instructions and calls of one function."""

    instructions: int = 0
    calls: int = 0


def parse_callgrind(path: Path) -> dict[str, Cost]:
    """Inclusive instructions and calls of every function in a callgrind output file.

    Names lose their hash suffix (``::h0123...``); a function's recursive calls to itself
    are counted neither as calls nor twice in its cost.
    """
    names: dict[str, str] = {}
    costs: dict[str, Cost] = defaultdict(Cost)
    current = ""
    callee: str | None = None
    pending_calls = 0

    def name_of(spec: str) -> str:
        spec = spec.strip()
        m = re.match(r"\((\d+)\)(?: (.*))?$", spec)
        if m is None:
            return spec
        if m.group(2) is not None:
            names[m.group(1)] = re.sub(r"::h[0-9a-f]{16}$", "", m.group(2))
        return names[m.group(1)]

    with open(path) as f:
        for line in f:
            if line.startswith("fn="):
                current = name_of(line[3:])
            elif line.startswith("cfn="):
                callee = name_of(line[4:])
            elif line.startswith("calls="):
                pending_calls = int(line[6:].split()[0])
            elif line[:1].isdigit() or line[:1] in "+-*":
                fields = line.split()
                ir = int(fields[1]) if len(fields) > 1 else 0
                if pending_calls:
                    if callee != current and callee is not None:
                        costs[current].instructions += ir
                        costs[callee].calls += pending_calls
                    pending_calls = 0
                    callee = None
                else:
                    costs[current].instructions += ir
    return dict(costs)


def per_call(costs: dict[str, Cost], function: str) -> tuple[float, int] | None:
    """Instructions per call of ``function`` (a name of `FUNCTIONS`), and its calls.

    ``NAME/OP`` reads all of NAME's instructions per call of OP instead: for a helper
    whose calls differ in kind (``refresh/admit``: the eviction-set upkeep of a scenario
    step, per step).
    """
    name, _, per = function.partition("/")

    def total(pattern: str) -> Cost:
        found = [c for fn, c in costs.items() if re.fullmatch(pattern, fn)]
        return Cost(sum(c.instructions for c in found), sum(c.calls for c in found))

    cost = total(FUNCTIONS[name])
    calls = total(FUNCTIONS[per]).calls if per else cost.calls
    if not calls or not cost.calls:
        return None
    return cost.instructions / calls, calls


# --- the parent: run both sides, print the table ----------------------------------------


#: The marker a child calls after each scenario: callgrind dumps its counts there.
MARKER = "*Cache>::stats*"


def start(site: Path, scenarios: list[str], iterations: int | None, out: Path) -> Any:
    """Start the scenarios under callgrind against the radixcache installed in ``site``.

    The process runs them in turn, calling the marker after each: callgrind writes the
    counts of scenario ``i`` (with its setup) to ``out.{i+1}``.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH", "")) if p)
    # The same hashing every run: the interpreter's allocations (and so the allocator's
    # state the core's own allocations meet) repeat exactly.
    env["PYTHONHASHSEED"] = "0"
    cmd = [
        "valgrind",
        "--tool=callgrind",
        f"--callgrind-out-file={out}",
        f"--dump-after={MARKER}",
        sys.executable,
        __file__,
        "--run",
        ",".join(scenarios),
    ]
    if iterations is not None:
        cmd += ["--iterations", str(iterations)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: Any, site: Path, scenarios: list[str], out: Path) -> list[dict[str, Cost]]:
    """Wait for a child of `start`; return each scenario's counts."""
    _, stderr = proc.communicate()
    if proc.returncode != 0:
        tail = "\n".join(stderr.splitlines()[-15:])
        raise compare.Failed(
            f"the scenarios under callgrind ({site}) exited {proc.returncode}:\n{tail}"
        )
    return [parse_callgrind(Path(f"{out}.{i + 1}")) for i in range(len(scenarios))]


def table(rows: list[dict[str, Any]], limit: float) -> str:
    """Return the report: one line per scenario and function, and the verdict."""
    lines = [f"{'scenario':<18} {'function':<13} {'base':>12} {'head':>12} {'head/base':>10}"]
    worst: tuple[float, str] = (0.0, "")
    for r in rows:
        base, head = r["base"], r["head"]
        ratio = head / base if base and head else None
        cells = [f"{v:12,.0f}" if v else f"{'-':>12}" for v in (base, head)]
        flag = "  ABOVE" if ratio is not None and ratio > limit else ""
        shown = f"{ratio:10.3f}" if ratio is not None else f"{'-':>10}"
        lines.append(f"{r['scenario']:<18} {r['function']:<13} {cells[0]} {cells[1]} {shown}{flag}")
        if ratio is not None and ratio > worst[0]:
            worst = (ratio, f"{r['scenario']} {r['function']}")
    verdict = "PASS" if worst[0] <= limit else "FAIL"
    lines.append(f"\n{verdict}: worst {worst[1]} at {worst[0]:.3f} (limit {limit})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Build, measure and report; returns the exit status."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("base", nargs="?", help="the base revision (a commit, branch or tag)")
    ap.add_argument("--sites", nargs=2, type=Path, metavar=("BASE_DIR", "HEAD_DIR"))
    ap.add_argument("--only", help="comma-separated scenarios (default: all)")
    ap.add_argument("--iterations", type=int, help="iterations of each scenario's loop")
    ap.add_argument("--limit", type=float, default=1.05, help="head/base goal (default 1.05)")
    ap.add_argument("--out", type=Path, default=compare.ROOT / "target" / "compare-bench")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON, no table")
    ap.add_argument("--check", action="store_true", help="exit 1 if the goal fails")
    ap.add_argument("--list", action="store_true", help="list the scenarios and exit")
    ap.add_argument("--run", help=argparse.SUPPRESS)  # the child: one scenario
    args = ap.parse_args(argv)
    if args.list:
        for name, reads in READS.items():
            print(f"{name:<18} {', '.join(reads)}")
        return 0
    if args.run:
        import radixcache as rc

        for name in args.run.split(","):
            _scenario(name, args.iterations or ITERATIONS["shape" if "/" in name else "request"])
            rc.HybridCache(kv_slots=16).stats()  # the marker: callgrind dumps here
        return 0
    scenarios = list(READS) if args.only is None else args.only.split(",")
    for name in scenarios:
        if name not in READS:
            ap.error(f"--only: no scenario {name!r} (see --list)")
    if (args.base is None) == (args.sites is None):
        ap.error("give the base revision or --sites, one of them")
    began = time.perf_counter()
    out = args.out.resolve()
    try:
        if args.sites is not None:
            sites = tuple(p.resolve() for p in args.sites)
        else:
            base = compare.base_side(args.base, out)
            head = compare.Side("head", compare.ROOT, None)
            for built in (base, head):
                compare.build(built, out, criterion=False, py_calls=True)
            if base.site is None or head.site is None:
                raise compare.Failed("a side has no installed wheel")
            sites = (base.site, head.site)
        # A process per scenario and side, both sides at once: what the allocator meets
        # (and so what the core's allocations cost) depends on what ran before in the
        # process, so a scenario starts from the interpreter's start every time.
        rows = []
        for name in scenarios:
            compare.log(f"{name}: both sides under callgrind")
            with tempfile.TemporaryDirectory() as tmp:
                outs = [Path(tmp) / f"{side}.out" for side in ("base", "head")]
                procs = [start(site, [name], args.iterations, o) for site, o in zip(sites, outs)]
                figures = [finish(p, site, [name], o)[0] for p, site, o in zip(procs, sites, outs)]
            for function in READS[name]:
                row: dict[str, Any] = {"scenario": name, "function": function}
                for side, costs in zip(("base", "head"), figures):
                    value = per_call(costs, function)
                    row[side] = value[0] if value else None
                    row[f"{side}_calls"] = value[1] if value else 0
                rows.append(row)
    except compare.Failed as e:
        print(f"instructions: {e}", file=sys.stderr)
        return 2
    ratios = [r["head"] / r["base"] for r in rows if r["base"] and r["head"]]
    if args.json:
        print(json.dumps({"limit": args.limit, "rows": rows}, indent=1))
    else:
        print(table(rows, args.limit))
        print(f"{time.perf_counter() - began:.0f} s", file=sys.stderr)
    return 1 if args.check and any(r > args.limit for r in ratios) else 0


if __name__ == "__main__":
    raise SystemExit(main())
