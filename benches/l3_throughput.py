"""L3 store throughput: ``ObjectStore.put``/``get_into`` against ``redis-benchmark``.

What is measured, on a ``redis-server`` this script starts on a free loopback port (no
persistence, in a temporary directory, killed at the end), for each value size (a page
of KV: 64 KiB, 256 KiB and 1 MiB by default):

- ``ours put``: ``radixcache.ObjectStore(url).put(keys, hashes, data, ...)`` of batches of
  ``--batch`` pages (a C-contiguous ``[batch, size]`` uint8 array), fresh keys for every
  batch (puts are write-once), until ``--mib`` MiB were put;
- ``ours get``: ``get_into`` of one stored batch into a ``[batch, size]`` array, again
  and again until ``--mib`` MiB were fetched (every outcome must be ``"ok"`` and the rows
  must equal what was put, checked once);
- ``redis-benchmark``: ``redis-benchmark -c 1 -P BATCH -d SIZE -n N`` with N requests
  of ``--mib`` MiB in all: one connection pipelining as many commands as our batch has
  keys, which is what one ``ObjectStore`` call does. ``-t set -r 1000000000`` for SET:
  random keys, so that (as our write-once puts) nearly every SET makes a new key (the
  same key overwritten again and again runs about twice as fast, its memory recycled);
  ``-t get`` for GET, after one SET of the key it reads.

GB/s counts payload bytes (1e9 bytes a second): ours moves a 56-byte frame header more
per object, and verifies a checksum of every object it fetches. Each figure is the best
of ``--repeat`` runs, ours and redis-benchmark's taking turns (on a shared machine the
best run is the one least disturbed by others, for both sides alike). ``ratio`` is ours
over redis-benchmark's (the issue's goal: at least 0.7 for ``get``).

Usage::

    python benches/l3_throughput.py [--sizes 65536,262144,1048576] [--batch 64]
                                    [--mib 128] [--repeat 3] [--json]

Needs ``redis-server`` and ``redis-benchmark`` on PATH. Output: a table (or, with
``--json``, one JSON object); exit status 1 when a fetched row was wrong.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np

from radixcache import ObjectStore

MIB = 1 << 20
#: The frame fields of the objects measured: KV pages of one identity (any 32 bytes).
LABEL: dict[str, Any] = {"kind": "kv", "identity": bytes(32)}


def free_port() -> int:
    """Return a TCP port free on loopback now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Server:
    """A redis-server on loopback in a temporary directory (a context manager)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.dir = tempfile.TemporaryDirectory(prefix="l3-bench-")
        self.proc = subprocess.Popen(
            [
                *("redis-server", "--bind", "127.0.0.1", "--port", str(self.port)),
                *("--save", "", "--appendonly", "no", "--dir", self.dir.name),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while not self.listening():
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError("redis-server did not start")
            time.sleep(0.02)

    def listening(self) -> bool:
        """Whether the server accepts connections."""
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
        except OSError:
            return False
        return True

    def flush(self) -> None:
        """Drop every key (so that memory stays bounded between measurements)."""
        subprocess.run(
            ["redis-cli", "-p", str(self.port), "flushall"], check=True, capture_output=True
        )

    def close(self) -> None:
        """Kill the server and remove its directory."""
        self.proc.kill()
        self.proc.wait()
        self.dir.cleanup()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class Row:
    """One value size: GB/s of ours and of the store's own client (the peer), and ratios."""

    size: int
    batch: int
    ours_put: float
    ours_get: float
    peer_put: float
    peer_get: float
    put_ratio: float
    get_ratio: float
    rows_ok: bool


#: Measures one side at (size, batch, bytes in all): GB/s of put and get (and, for ours,
#: whether the fetched rows were right).
Measure = Callable[[int, int, int], tuple[float, ...]]


def best_rows(
    sizes: list[int],
    batch: int,
    total: int,
    repeat: int,
    ours: Measure,
    peer: Measure,
    between: Callable[[], None],
) -> list[Row]:
    """One row per value size, each figure the best of `repeat` runs of each side.

    The sides take turns (on a shared machine the best run is the one least disturbed by
    others, for both alike); `between` empties the store after each measurement.
    """
    rows = []
    for size in sizes:
        print(f"size {size}...", file=sys.stderr)
        row = Row(size, batch, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, rows_ok=True)
        for _ in range(repeat):
            put, get, right = ours(size, batch, total)
            between()
            peer_put, peer_get = peer(size, batch, total)
            between()
            row.ours_put, row.ours_get = max(row.ours_put, put), max(row.ours_get, get)
            row.peer_put, row.peer_get = max(row.peer_put, peer_put), max(row.peer_get, peer_get)
            row.rows_ok = row.rows_ok and bool(right)
        row.put_ratio, row.get_ratio = row.ours_put / row.peer_put, row.ours_get / row.peer_get
        rows.append(row)
    return rows


def table(rows: list[Row], legend: str, peer: tuple[str, str]) -> str:
    """Format the rows as a text table; `peer` names the peer's put and get columns."""
    wp, wg = (max(8, len(name)) for name in peer)
    head = (
        f"{'size':>9} {'batch':>5} | {'ours put':>8} {peer[0]:>{wp}} {'ratio':>5} | "
        f"{'ours get':>8} {peer[1]:>{wg}} {'ratio':>5} | rows"
    )
    lines = [legend, head]
    lines.extend(
        f"{r.size:>9} {r.batch:>5} | {r.ours_put:>8.2f} {r.peer_put:>{wp}.2f} "
        f"{r.put_ratio:>5.2f} | {r.ours_get:>8.2f} {r.peer_get:>{wg}.2f} "
        f"{r.get_ratio:>5.2f} | {'ok' if r.rows_ok else 'WRONG'}"
        for r in rows
    )
    return "\n".join(lines)


def arguments(description: str, batch_help: str) -> argparse.ArgumentParser:
    """Return the parser of the arguments both throughput benches take."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--sizes", default="65536,262144,1048576", help="value sizes, bytes")
    p.add_argument("--batch", type=int, default=64, help=batch_help)
    p.add_argument("--mib", type=int, default=128, help="MiB moved per measurement")
    p.add_argument("--repeat", type=int, default=3, help="runs per figure (the best counts)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    return p


def sizes_of(p: argparse.ArgumentParser, args: argparse.Namespace, *more: int) -> list[int]:
    """Return the value sizes; a usage error (exit 2) when a number given is not positive."""
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        p.error(f"--sizes: not a list of integers: {args.sizes!r}")
    if min(args.batch, args.mib, args.repeat, *more, *sizes) < 1:
        p.error("--sizes, --batch, --mib and --repeat (and any other count) must be positive")
    return sizes


def report(rows: list[Row], args: argparse.Namespace, legend: str, peer: tuple[str, str]) -> int:
    """Print the rows (a table, or one JSON object); 1 when a fetched row was wrong.

    `peer` names the peer's put and get (the table's columns, the JSON's ``peer``).
    """
    if args.json:
        print(json.dumps({"peer": list(peer), "rows": [asdict(r) for r in rows]}))
    else:
        print(table(rows, legend, peer))
    return 0 if all(r.rows_ok for r in rows) else 1


def measure_ours(url: str, size: int, batch: int, total: int) -> tuple[float, float, bool]:
    """GB/s of put and of get_into, and whether the fetched rows were right."""
    return measure_store(ObjectStore(url, timeout_ms=5000), size, batch, total)


def measure_store(store: Any, size: int, batch: int, total: int) -> tuple[float, float, bool]:
    """GB/s of `store`'s put and get_into, and whether the fetched rows were right.

    `store` has an ObjectStore's interface (as `L3Tier` calls it): fresh keys for every
    put batch (puts are write-once), one stored batch fetched again and again.
    """
    rng = np.random.default_rng(size)
    data = rng.integers(0, 256, size=(batch, size), dtype=np.uint8)
    hashes = [i.to_bytes(32, "little") for i in range(batch)]
    rounds = max(1, total // (batch * size))

    def keys(r: int) -> list[bytes]:
        return [f"ours:{size}:{r}:{i}".encode() for i in range(batch)]

    store.put(keys(-1), hashes, data, **LABEL)  # warm-up (connects)
    t = time.perf_counter()
    for r in range(rounds):
        stored = store.put(keys(r), hashes, data, **LABEL)
        assert all(stored), "the store refused a put (full?)"
    put_gbs = rounds * batch * size / (time.perf_counter() - t) / 1e9

    out = np.zeros_like(data)
    got = store.get_into(keys(0), hashes, out, **LABEL)
    rows_ok = list(got) == ["ok"] * batch and np.array_equal(out, data)
    t = time.perf_counter()
    for _ in range(rounds):
        store.get_into(keys(0), hashes, out, **LABEL)
    get_gbs = rounds * batch * size / (time.perf_counter() - t) / 1e9
    return put_gbs, get_gbs, rows_ok


def measure_redis_benchmark(port: int, size: int, batch: int, total: int) -> tuple[float, float]:
    """GB/s of redis-benchmark's SET and GET with ``size``-byte values."""
    n = max(batch, total // size)

    def rps(test: str, n: int, *extra: str) -> float:
        out = subprocess.run(
            [
                *("redis-benchmark", "-h", "127.0.0.1", "-p", str(port), "-c", "1"),
                *("-P", str(batch), "-d", str(size), "-n", str(n), "-t", test, "--csv"),
                *extra,
            ],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        rows = {row["test"]: float(row["rps"]) for row in csv.DictReader(io.StringIO(out))}
        return rows[test.upper()]

    set_rps = rps("set", n, "-r", "1000000000")
    rps("set", batch)  # the key the GETs read
    get_rps = rps("get", n)
    return set_rps * size / 1e9, get_rps * size / 1e9


LEGEND = "GB/s of payload (1e9 B/s, best run); bench = redis-benchmark -c 1 -P batch"
PEER = ("bench set", "bench get")


def run(sizes: list[int], batch: int, mib: int, repeat: int) -> list[Row]:
    """One row per value size, each figure the best of ``repeat`` runs."""
    with Server() as server:
        url = f"redis://127.0.0.1:{server.port}"
        return best_rows(
            sizes,
            batch,
            mib * MIB,
            repeat,
            lambda size, batch, total: measure_ours(url, size, batch, total),
            lambda size, batch, total: measure_redis_benchmark(server.port, size, batch, total),
            server.flush,
        )


def main(argv: list[str] | None = None) -> int:
    """Run the measurements and print them; 1 when a fetched row was wrong."""
    p = arguments(__doc__.splitlines()[0], "keys per call (and -P)")
    args = p.parse_args(argv)
    for tool in ("redis-server", "redis-benchmark", "redis-cli"):
        if shutil.which(tool) is None:
            p.error(f"{tool} is not on PATH")
    sizes = sizes_of(p, args)
    return report(run(sizes, args.batch, args.mib, args.repeat), args, LEGEND, PEER)


if __name__ == "__main__":
    sys.exit(main())
