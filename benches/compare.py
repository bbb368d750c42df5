"""The criterion and py_calls figures of a base revision and of the working tree, side by side.

For a change that must not slow anything down (a refactor): builds the base revision (a
``git archive`` of it, in its own directory with its own cargo target directory) and the
working tree, then measures both, interleaved, and prints one table: operation, base,
head, head/base, and whether every operation stays within the limit (5% slower by default).

What runs, for each side:

- the criterion benches of ``benches/`` (``radix`` and ``scale``), each side built from its
  own sources (``cargo bench --no-run``: the benches follow the core's API) and run as
  executables, each run with its own ``CRITERION_HOME`` so that no run compares itself
  with another; the figure of an operation is criterion's median time per iteration;
- ``benches/py_calls.py --json`` of the working tree, against each side's extension: each
  side's wheel (``maturin build --release``) is installed into a directory of its own that
  goes first on ``PYTHONPATH``, so the same script measures both bindings; the figure of a
  cell is its median, plus the single-thread ``match_prefix`` of its threads section.

Interleaving: every round runs each criterion bench and then py_calls once per side, the
two sides back to back, base first in even rounds and head first in odd ones, so that load
on a shared machine hits both alike. Over the rounds each side keeps its fastest figure per
operation (load only ever adds time); ``spread`` is the larger of the two sides'
slowest/fastest - 1 across rounds, the noise a ratio should be read against.

Run it from the working tree to measure, with the Python environment that has maturin and
numpy (the dev venv)::

    python benches/compare.py BASE [--rounds N] [--quick] [--json] [--check]

``--quick``: one round (unless ``--rounds`` says otherwise), criterion's ``--quick`` (two
samples per bench), the scale bench on trees of at most 100k tokens, py_calls at ``--tiny``
size (minutes once built; a smoke test, not a measurement). Builds, criterion's output and
logs go to ``target/compare-bench`` (``--out``); the base's sources and build are kept there
and reused by a later run against the same revision.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH_CRATE = "radixcache-benches"
#: The scale bench's size cap in quick mode (tokens), unless RADIXCACHE_SCALE_MAX is set.
QUICK_SCALE_MAX = "100000"


@dataclass
class Side:
    """One of the two builds compared."""

    name: str  # "base" or "head"
    src: Path
    target: Path | None  # its CARGO_TARGET_DIR; None: the environment's (the tree's own)
    benches: dict[str, Path] = field(default_factory=dict)  # bench name -> executable
    site: Path | None = None  # where its wheel is installed
    #: operation -> its figure in ns, one per round
    figures: dict[str, list[float]] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        """Return the environment of this side's builds."""
        env = dict(os.environ)
        if self.target is not None:
            env["CARGO_TARGET_DIR"] = str(self.target)
        return env

    def record(self, op: str, ns: float) -> None:
        """Add one round's figure of ``op``."""
        self.figures.setdefault(op, []).append(ns)


class Failed(Exception):
    """A build or a run failed; the message says which and where its log is."""


def log(msg: str) -> None:
    """Print progress on stderr."""
    print(f"compare: {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], cwd: Path, env: dict[str, str], out: Path) -> str:
    """Run ``cmd``; return its stdout (also written to ``out``), stderr going to ``out.err``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".err"), "w") as err:
        proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
    out.write_text(proc.stdout)
    if proc.returncode != 0:
        tail = out.with_suffix(".err").read_text().splitlines()[-15:]
        raise Failed(
            f"{shlex.join(cmd)} (in {cwd}) exited {proc.returncode}; logs {out}, "
            f"{out.with_suffix('.err')}:\n" + "\n".join(tail)
        )
    return proc.stdout


def git(*args: str) -> str:
    """Run a git command in the working tree; return its stdout, stripped."""
    return subprocess.run(
        ["git", *args], cwd=ROOT, check=True, stdout=subprocess.PIPE, text=True
    ).stdout.strip()


def base_side(rev: str, out: Path) -> Side:
    """Export the base revision's sources under ``out`` (once per commit)."""
    try:
        sha = git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    except subprocess.CalledProcessError:
        raise Failed(f"base: {rev!r} is not a commit of this repository") from None
    root = out / f"base-{sha[:12]}"
    src = root / "src"
    if not (src / ".exported").exists():
        shutil.rmtree(src, ignore_errors=True)
        src.mkdir(parents=True)
        with subprocess.Popen(["git", "archive", sha], cwd=ROOT, stdout=subprocess.PIPE) as archive:
            subprocess.run(["tar", "-x", "-C", str(src)], stdin=archive.stdout, check=True)
        if archive.returncode != 0:
            raise Failed(f"git archive {sha} failed")
        (src / ".exported").write_text(sha + "\n")
    return Side("base", src, root / "target")


def build(side: Side, out: Path, criterion: bool, py_calls: bool) -> None:
    """Build the side's bench executables and install its wheel."""
    logs = out / "logs" / f"build-{side.name}"
    if criterion:
        log(f"{side.name}: cargo bench --no-run ({side.src})")
        stdout = run(
            ["cargo", "bench", "-p", BENCH_CRATE, "--locked", "--no-run", "--message-format=json"],
            side.src,
            side.env(),
            logs / "cargo-bench.json",
        )
        for line in stdout.splitlines():
            msg = json.loads(line) if line.startswith("{") else {}
            target = msg.get("target", {})
            artifact = msg.get("reason") == "compiler-artifact" and msg.get("executable")
            if artifact and "bench" in target.get("kind", []):
                side.benches[target["name"]] = Path(msg["executable"])
        if not side.benches:
            raise Failed(f"{side.name}: cargo built no bench executable")
    if py_calls:
        log(f"{side.name}: maturin build --release ({side.src})")
        wheels = out / f"{side.name}-wheel"
        shutil.rmtree(wheels, ignore_errors=True)
        run(
            [sys.executable, "-m", "maturin", "build", "--release", "--out", str(wheels)],
            side.src,
            side.env(),
            logs / "maturin.log",
        )
        (wheel,) = wheels.glob("*.whl")
        side.site = out / f"{side.name}-site"
        shutil.rmtree(side.site, ignore_errors=True)
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps"]
        run(
            [*pip, "--target", str(side.site), str(wheel)],
            side.src,
            dict(os.environ),
            logs / "pip.log",
        )
        where = run(
            [sys.executable, "-c", "import radixcache; print(radixcache.__file__)"],
            ROOT,
            python_env(side),
            logs / "import.log",
        ).strip()
        if not Path(where).resolve().is_relative_to(side.site.resolve()):
            raise Failed(f"{side.name}: radixcache imported from {where}, not from {side.site}")


def python_env(side: Side) -> dict[str, str]:
    """Return an environment in which Python imports the side's radixcache first."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(side.site), env.get("PYTHONPATH", "")) if p)
    return env


def criterion_figures(home: Path) -> dict[str, float]:
    """Median ns per iteration of every bench a criterion run wrote under ``home``."""
    figures = {}
    for meta in sorted(home.rglob("new/benchmark.json")):
        full_id = json.loads(meta.read_text())["full_id"]
        estimates = json.loads((meta.parent / "estimates.json").read_text())
        figures[full_id] = float(estimates["median"]["point_estimate"])
    return figures


def py_calls_figures(report: dict[str, Any]) -> dict[str, float]:
    """Read the ns figures of a ``py_calls.py --json`` report: each cell's median."""
    figures = {}
    for c in report["cells"]:
        variant = "" if c["variant"] == "-" else f" [{c['variant']}]"
        figures[f"py_calls {c['op']}{variant} @{c['length']}"] = c["median_us"] * 1000.0
    figures["py_calls threads: match_prefix 128 alone"] = (
        report["threads"]["match_prefix_128_us"] * 1000.0
    )
    return figures


def measure(sides: tuple[Side, Side], args: argparse.Namespace, out: Path) -> None:
    """Run every round, the two sides back to back for each bench."""
    crit_args = ["--bench", "--noplot", *(["--quick"] if args.quick else [])]
    crit_args += shlex.split(args.criterion_args)
    env_extra = {}
    if args.quick and "RADIXCACHE_SCALE_MAX" not in os.environ:
        env_extra["RADIXCACHE_SCALE_MAX"] = QUICK_SCALE_MAX
    for r in range(args.rounds):
        order = sides if r % 2 == 0 else sides[::-1]
        names = sorted(set(sides[0].benches) & set(sides[1].benches))
        for bench in names:
            for side in order:
                log(f"round {r + 1}/{args.rounds}: {side.name} criterion {bench}")
                home = out / "criterion" / f"r{r}" / side.name / bench
                shutil.rmtree(home, ignore_errors=True)
                env = {**side.env(), **env_extra, "CRITERION_HOME": str(home)}
                run([str(side.benches[bench]), *crit_args], side.src, env, home / "stdout.txt")
                for op, ns in criterion_figures(home).items():
                    side.record(op, ns)
        if not args.no_py_calls:
            for side in order:
                log(f"round {r + 1}/{args.rounds}: {side.name} py_calls")
                cmd = [sys.executable, str(ROOT / "benches" / "py_calls.py"), "--json"]
                cmd += ["--tiny"] if args.quick else []
                stdout = run(cmd, ROOT, python_env(side), out / "py_calls" / f"r{r}-{side.name}")
                for op, ns in py_calls_figures(json.loads(stdout)).items():
                    side.record(op, ns)


@dataclass(frozen=True)
class Row:
    """One operation, both sides."""

    op: str
    base_ns: float | None
    head_ns: float | None
    spread: float | None  # the larger side's slowest/fastest - 1 across rounds

    @property
    def ratio(self) -> float | None:
        """Return head / base, where both sides measured the operation."""
        if self.base_ns is None or self.head_ns is None:
            return None
        return self.head_ns / self.base_ns


def rows(base: Side, head: Side) -> list[Row]:
    """List every operation either side measured, in the order first measured."""
    ops = list(dict.fromkeys([*base.figures, *head.figures]))
    out = []
    for op in ops:
        b, h = base.figures.get(op), head.figures.get(op)
        spreads = [max(f) / min(f) - 1 for f in (b, h) if f and len(f) > 1]
        out.append(
            Row(op, min(b) if b else None, min(h) if h else None, max(spreads, default=None))
        )
    return out


def fmt_ns(ns: float | None) -> str:
    """Format a time with its unit."""
    if ns is None:
        return "-"
    for unit, scale in (("ms", 1e6), ("µs", 1e3)):
        if ns >= scale:
            return f"{ns / scale:.3g} {unit}" if ns < 100 * scale else f"{ns / scale:.0f} {unit}"
    return f"{ns:.3g} ns"


def within(table: list[Row], limit: float) -> bool:
    """Tell whether no operation both sides measured is slower than ``limit`` (head/base)."""
    return all(r.ratio is None or r.ratio <= limit for r in table)


def as_json(table: list[Row], limit: float) -> dict[str, Any]:
    """Return the table and its verdict as ``--json`` prints them."""
    rows = [{**asdict(r), "ratio": r.ratio} for r in table]
    return {"limit": limit, "passed": within(table, limit), "rows": rows}


def report(table: list[Row], limit: float, header: str) -> bool:
    """Print the table and the verdict; return whether every operation is within ``limit``."""
    print(header)
    width = max(len(r.op) for r in table)
    print(f"{'operation':<{width}}  {'base':>10}  {'head':>10}  {'head/base':>9}  {'spread':>6}")
    for r in table:
        ratio = "-" if r.ratio is None else f"{r.ratio:.3f}"
        spread = "-" if r.spread is None else f"{r.spread:.0%}"
        flag = "  SLOWER" if r.ratio is not None and r.ratio > limit else ""
        print(
            f"{r.op:<{width}}  {fmt_ns(r.base_ns):>10}  {fmt_ns(r.head_ns):>10}  "
            f"{ratio:>9}  {spread:>6}{flag}"
        )
    both = [r for r in table if r.ratio is not None]
    slower = [r for r in both if r.ratio is not None and r.ratio > limit]
    one_side = [r.op for r in table if r.ratio is None]
    if one_side:
        print(f"\nmeasured on one side only: {', '.join(one_side)}")
    worst = max(both, key=lambda r: r.ratio or 0.0, default=None)
    verdict = "PASS" if not slower else "FAIL"
    worst_text = "" if worst is None else f"; worst {worst.op} at {worst.ratio:.3f}"
    print(
        f"\ngoal: no operation more than {limit - 1:.0%} slower than the base: {verdict} "
        f"({len(slower)} of {len(both)} over {limit:.2f}{worst_text})"
    )
    return not slower


def main(argv: list[str] | None = None) -> int:
    """Build, measure and report; returns the exit status."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("base", help="the base revision (a commit, branch or tag)")
    ap.add_argument("--rounds", type=int, help="rounds of every bench (default 3; quick: 1)")
    ap.add_argument("--quick", action="store_true", help="short runs: a smoke test")
    ap.add_argument("--limit", type=float, default=1.05, help="head/base goal (default 1.05)")
    ap.add_argument("--criterion-args", default="", help="more arguments for every bench run")
    ap.add_argument("--no-criterion", action="store_true", help="skip the criterion benches")
    ap.add_argument("--no-py-calls", action="store_true", help="skip benches/py_calls.py")
    ap.add_argument("--out", type=Path, default=ROOT / "target" / "compare-bench")
    ap.add_argument("--json", action="store_true", help="print one JSON object, no table")
    ap.add_argument("--check", action="store_true", help="exit 1 if the goal fails")
    args = ap.parse_args(argv)
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    if args.rounds < 1:
        ap.error("--rounds: must be at least 1")
    if args.no_criterion and args.no_py_calls:
        ap.error("nothing to measure: --no-criterion and --no-py-calls")

    start = time.perf_counter()
    out = args.out.resolve()
    try:
        base = base_side(args.base, out)
        head = Side("head", ROOT, None)
        for side in (base, head):
            build(side, out, not args.no_criterion, not args.no_py_calls)
        measure((base, head), args, out)
    except Failed as e:
        print(f"compare: {e}", file=sys.stderr)
        return 2

    dirty = " with uncommitted changes" if git("status", "--porcelain") else ""
    base_sha = (base.src / ".exported").read_text().strip()
    head_sha = git("rev-parse", "HEAD")
    table = rows(base, head)
    header = (
        f"base {base_sha[:12]} ({args.base}) against head {head_sha[:12]}{dirty}; "
        f"{args.rounds} round(s){', quick' if args.quick else ''}, each side's fastest; "
        f"load average {os.getloadavg()[0]:.1f} ({os.cpu_count()} CPUs) at the end, "
        f"{time.perf_counter() - start:.0f} s\n"
    )
    if args.json:
        run_info = {"base": base_sha, "head": head_sha, "head_dirty": bool(dirty)}
        run_info |= {"rounds": args.rounds, "quick": args.quick}
        print(json.dumps({**run_info, **as_json(table, args.limit)}, indent=1))
    else:
        report(table, args.limit, header)
    return 1 if args.check and not within(table, args.limit) else 0


if __name__ == "__main__":
    raise SystemExit(main())
