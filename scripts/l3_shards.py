"""Two `radixcache replay --shard` processes sharing one Redis, which dies and comes back.

Starts a ``redis-server`` on a free loopback port (``--store mooncake``: a Mooncake
Store, `radixcache.mooncake.LocalMooncake`, whose master is what is killed and started
again, its index lost as Redis's data is; the store daemon stays and mounts its memory
again), then two processes at once:
``radixcache replay --shard 0/2 --l3 redis://...`` and ``--shard 1/2`` (each serves every
other request of the workload, as two machines behind a round-robin router would). Once
the store holds ``--kill-at`` objects (the shards are under way, however slow the
machine) it kills the server (SIGKILL: nothing is saved), and ``--down`` seconds later
starts a new, empty one on the same port. Each process keeps
serving from its device and host tiers while its breaker is open, and uses the store
again once it is back. Prints, per shard: the oracle's verdict, its L3 hit tokens before
the kill, during the outage and after the restart (from the report's ``l3_timeline``),
and its store errors and breaker trips. Exits 1 unless both shards saw 0 mismatches, an
audit pass, every pool full at the end and L3 hits; with a kill, also unless a breaker
opened and L3 hits grew again after the restart.

    python scripts/l3_shards.py [--workload multiturn] [--copies 3] [--requests N]
                                [--kill-at 20000] [--down 2] [--no-kill] [--json]
                                [--store redis|mooncake]

The workload is ``--copies`` copies of the built-in one (seeds 0, 1, ...: different
conversations) served back to back, so that the run lasts well past the restart.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def free_port() -> int:
    """Return a loopback port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _answers(port: int) -> bool:
    """Whether something accepts connections on loopback `port`."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def objects(port: int) -> int:
    """Return how many keys the redis-server on `port` holds (-1 when it does not answer)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as c:
            c.sendall(b"*1\r\n$6\r\nDBSIZE\r\n")
            reply = c.recv(64)
    except OSError:
        return -1
    return int(reply[1:].split(b"\r\n")[0]) if reply.startswith(b":") else -1


def start_redis(port: int, workdir: Path) -> subprocess.Popen[bytes]:
    """Start a redis-server without persistence on `port`; wait until it answers."""
    proc = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if _answers(port):
            return proc
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"redis-server did not start on port {port}")


def phases(
    timeline: list[dict[str, Any]], killed: float | None, back: float | None
) -> dict[str, int]:
    """Return the L3 hit tokens a shard gained before the kill, while down, and after."""

    def at(t: float | None) -> int:
        before = [s["l3_hit_tokens"] for s in timeline if t is None or s["time"] <= t]
        return before[-1] if before else 0

    total = timeline[-1]["l3_hit_tokens"] if timeline else 0
    if killed is None or back is None:
        return {"before": total, "down": 0, "after": 0}
    return {"before": at(killed), "down": at(back) - at(killed), "after": total - at(back)}


def main(argv: list[str] | None = None) -> int:
    """Run the two shards against one store (see the module docstring); the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="multiturn")
    ap.add_argument(
        "--copies",
        type=int,
        default=3,
        help="serve this many copies of the workload (seeds 0, 1, ...), back to back, so "
        "that the run lasts well past the restart",
    )
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument(
        "--kill-at",
        type=int,
        default=20000,
        help="kill the store once it holds this many objects (the shards are well under way)",
    )
    ap.add_argument("--down", type=float, default=2.0)
    ap.add_argument("--no-kill", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--store", choices=("redis", "mooncake"), default="redis")
    args = ap.parse_args(argv)
    if args.store == "redis" and shutil.which("redis-server") is None:
        print(
            "l3_shards: redis-server is not on PATH (apt-get install redis-server)", file=sys.stderr
        )
        return 2
    radixcache = [
        sys.executable,
        "-c",
        "import sys; from radixcache.cli import main; sys.exit(main())",
    ]
    workdir = Path(tempfile.mkdtemp(prefix="l3-shards-"))
    port = free_port()
    if args.store == "mooncake":
        from radixcache.mooncake import LocalMooncake

        mooncake = LocalMooncake(segment=2 << 30)
        url = mooncake.url + "&timeout_ms=200"  # as the Redis store's default
        count = mooncake.keys
    else:
        redis = start_redis(port, workdir)
        url = f"redis://127.0.0.1:{port}"

        def count() -> int:
            return objects(port)

    workload = workdir / "workload.jsonl"
    with workload.open("wb") as out:
        for seed in range(args.copies):
            part = workdir / f"part{seed}.jsonl"
            cmd = ["workload", args.workload, "--out", str(part), "--seed", str(seed)]
            if args.requests:
                cmd += ["--requests", str(args.requests)]
            subprocess.run([*radixcache, *cmd], check=True, stderr=subprocess.DEVNULL)
            out.write(part.read_bytes())
    base = ["replay", "--workload", str(workload), "--l3", url, "--json", "--quiet"]
    outs = [open(workdir / f"shard{k}.json", "w+b") for k in range(2)]  # noqa: SIM115
    shards = [
        subprocess.Popen([*radixcache, *base, "--shard", f"{k}/2"], stdout=outs[k], env=os.environ)
        for k in range(2)
    ]
    killed = back = None
    try:
        if not args.no_kill:
            while all(p.poll() is None for p in shards) and count() < args.kill_at:
                time.sleep(0.05)
            if all(p.poll() is None for p in shards):
                if args.store == "mooncake":
                    mooncake.stop_master()  # SIGKILL
                else:
                    redis.send_signal(signal.SIGKILL)
                    redis.wait()
                killed = time.time()
                time.sleep(args.down)
                if args.store == "mooncake":
                    mooncake.start_master()
                else:
                    redis = start_redis(port, workdir)
                back = time.time()
        codes = [p.wait(timeout=1800) for p in shards]
    finally:
        for p in shards:
            if p.poll() is None:
                p.kill()
        if args.store == "mooncake":
            mooncake.stop()
        else:
            redis.kill()
            redis.wait()
    reports = []
    for f in outs:
        f.seek(0)
        text = f.read().decode()
        f.close()
        reports.append(json.loads(text) if text.strip() else {})
    shutil.rmtree(workdir, ignore_errors=True)
    why: list[str] = []
    rows = []
    for k, (code, r) in enumerate(zip(codes, reports)):
        if not r:
            why.append(f"shard {k}/2 printed no report (exit {code})")
            continue
        ph = phases(r["l3_timeline"] or [], killed, back)
        rows.append(
            {
                "shard": r["shard"],
                "exit": code,
                "requests": r["requests"],
                "mismatches": r["mismatches"],
                "audit": r["audit"],
                "pools_full_at_end": r["pools_full_at_end"],
                "l3_hit_tokens": r["l3_hit_tokens"],
                "hits": ph,
                "l3_errors": r["l3_errors"],
                "l3_breaker_trips": r["l3_breaker_trips"],
                "l3_breaker": r["l3_breaker"],
            }
        )
        if code != 0 or r["mismatches"] or r["audit"] != "pass" or not r["pools_full_at_end"]:
            why.append(f"shard {k}/2 failed its checks (exit {code})")
        if r["l3_hit_tokens"] == 0:
            why.append(f"shard {k}/2 had no L3 hit")
    if killed is not None and rows:
        if not any(row["l3_breaker_trips"] for row in rows):
            why.append("no breaker opened while the store was down")
        if not any(row["hits"]["after"] for row in rows):
            why.append("no L3 hit after the store came back")
    result = {
        "workload": args.workload,
        "store": args.store,
        "killed": killed is not None,
        "shards": rows,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for row in rows:
            h = row["hits"]
            print(
                f"shard {row['shard']}: exit {row['exit']}, {row['requests']} requests, "
                f"{row['mismatches']} mismatches, audit {row['audit']}; L3 hit tokens "
                f"{row['l3_hit_tokens']} (before the kill {h['before']}, while down "
                f"{h['down']}, after the restart {h['after']}); {row['l3_errors']} store "
                f"errors, {row['l3_breaker_trips']} breaker trips, breaker {row['l3_breaker']}"
            )
    for w in why:
        print(f"l3_shards: {w}", file=sys.stderr)
    return 1 if why else 0


if __name__ == "__main__":
    sys.exit(main())
