"""L3 throughput on Mooncake Store: `MooncakeStore.put`/``get_into`` against Mooncake's own.

What is measured, on a Mooncake Store this script starts on loopback
(`radixcache.mooncake.LocalMooncake`: ``mooncake_master`` and one store daemon holding
``--segment-mib`` MiB, over TCP; killed at the end), for each value size (a page of KV:
64 KiB, 256 KiB and 1 MiB by default):

- ``ours put``: ``MooncakeStore(url).put(keys, hashes, data)`` of batches of ``--batch``
  pages (a ``[batch, size]`` uint8 array), fresh keys for every batch (puts are
  write-once: each call asks which keys exist, frames the rows into its registered
  staging buffer and puts them), until ``--mib`` MiB were put;
- ``ours get``: ``get_into`` of one stored batch into a ``[batch, size]`` array, again
  and again until ``--mib`` MiB were fetched (every outcome must be ``"ok"`` and the rows
  must equal what was put, checked once): a get into the staging buffer, then each
  object verified and its payload copied out;
- ``mooncake put``/``get``: Mooncake's own client (``MooncakeDistributedStore``, set up
  as ours is) doing the same with ``batch_put_from``/``batch_get_into`` straight from
  and into a registered buffer of ``batch`` values: no existence check, no framing, no
  verification, no copy; what the store itself does with these sizes.

GB/s counts payload bytes (1e9 bytes a second): ours moves a 56-byte frame header more
per object. Each figure is the best of ``--repeat`` runs, the two sides taking turns;
the store is emptied between measurements. ``ratio`` is ours over Mooncake's (the
issue's goal: at least 0.7 for ``get``).

Usage::

    python benches/l3_mooncake_throughput.py [--sizes 65536,262144,1048576] [--batch 64]
                                             [--mib 128] [--repeat 3] [--json]

Needs the ``mooncake`` package (``pip install "radixcache[mooncake]"``). Output: a
table (or, with ``--json``, one JSON object); exit status 1 when a fetched row was
wrong.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np
from l3_throughput import MIB, Row, arguments, best_rows, measure_store, report, sizes_of

from radixcache.mooncake import LocalMooncake, MooncakeStore


def measure_ours(url: str, size: int, batch: int, total: int) -> tuple[float, float, bool]:
    """GB/s of put and of get_into, and whether the fetched rows were right.

    The same loop as benches/l3_throughput.py's, on a `MooncakeStore`.
    """
    store = MooncakeStore(url)
    try:
        return measure_store(store, size, batch, total)
    finally:
        store.close()


def measure_mooncake(client: Any, size: int, batch: int, total: int) -> tuple[float, float]:
    """GB/s of Mooncake's own batch_put_from and batch_get_into with ``size``-byte values."""
    buf = np.random.default_rng(size).integers(0, 256, size=batch * size, dtype=np.uint8)
    assert client.register_buffer(buf.ctypes.data, buf.nbytes) == 0
    ptrs = [buf.ctypes.data + i * size for i in range(batch)]
    sizes = [size] * batch
    rounds = max(1, total // (batch * size))

    def keys(r: int) -> list[str]:
        return [f"own:{size}:{r}:{i}" for i in range(batch)]

    try:
        client.batch_put_from(keys(-1), ptrs, sizes)  # warm-up
        t = time.perf_counter()
        for r in range(rounds):
            codes = client.batch_put_from(keys(r), ptrs, sizes)
            assert all(c == 0 for c in codes), f"put failed: {set(codes)}"
        put_gbs = rounds * batch * size / (time.perf_counter() - t) / 1e9
        t = time.perf_counter()
        for _ in range(rounds):
            got = client.batch_get_into(keys(0), ptrs, sizes)
            assert got == sizes, f"get failed: {set(got)}"
        get_gbs = rounds * batch * size / (time.perf_counter() - t) / 1e9
    finally:
        client.unregister_buffer(buf.ctypes.data)
    return put_gbs, get_gbs


LEGEND = "GB/s of payload (1e9 B/s, best run); mc = Mooncake's batch_put_from/batch_get_into"


def run(sizes: list[int], batch: int, mib: int, repeat: int, segment_mib: int) -> list[Row]:
    """One row per value size, each figure the best of ``repeat`` runs."""
    from mooncake.store import MooncakeDistributedStore

    with LocalMooncake(segment=segment_mib * MIB) as m:
        client = MooncakeDistributedStore()
        master = f"127.0.0.1:{m.rpc_port}"
        assert client.setup("127.0.0.1", m.metadata, 0, 0, "tcp", "", master) == 0
        try:
            return best_rows(
                sizes,
                batch,
                mib * MIB,
                repeat,
                lambda size, batch, total: measure_ours(m.url, size, batch, total),
                lambda size, batch, total: measure_mooncake(client, size, batch, total),
                lambda: client.remove_all(True),
            )
        finally:
            client.close()


def main(argv: list[str] | None = None) -> int:
    """Run the measurements and print them; 1 when a fetched row was wrong."""
    p = arguments(__doc__.splitlines()[0], "keys per call")
    p.add_argument("--segment-mib", type=int, default=1024, help="the store daemon's memory")
    args = p.parse_args(argv)
    sizes = sizes_of(p, args, args.segment_mib)
    rows = run(sizes, args.batch, args.mib, args.repeat, args.segment_mib)
    return report(rows, args, LEGEND, ("mc put", "mc get"))


if __name__ == "__main__":
    sys.exit(main())
