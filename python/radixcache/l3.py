"""The L3 tier: host pages shared between caches through a store (Redis, files, ...).

The core decides what goes to the store and what comes back (docs/design.md, "The L3
tier"); this module moves the bytes, as `TransferEngine` does between the device and the
host, and holds no cache logic:

* ``l3_put`` batches (emitted when a backup lands, taken with ``cache.take_batches()``
  like any batch): the host slots of each object are gathered into one row of bytes and
  written to the store once (``exists``, then ``put`` of what is missing).
* `L3Tier.fetch`: for a prompt whose end neither the device nor the host tier holds, it
  asks the store for the leading run of pages that exist (and, for a hybrid model, the
  deepest of them with a state at its end), has the cache take host slots for them
  (``cache.l3_fetch``), reads the objects into those slots and acknowledges: the pages
  join the cache as host-only nodes, which the next admission loads back like any host
  hit. A missing, failed, timed-out or corrupt object is a miss for it and every page
  after it; a corrupt object is deleted by the store client. An object found missing
  or corrupt is reported ``gone`` to ``complete_l3``, which counts it and, with events
  on, announces it removed from ``EXTERNAL``.

Each object is named by the page hash the core gives it (its ``keys``), prefixed by a
name of the storage layout (``key_prefix``: dtypes, shapes and page size, so that caches
of another layout never read these bytes), KV pages as ``{prefix}{hex}`` and states as
``{prefix}{hex}.s``. A circuit breaker (`radixcache.Breaker`) stops asking the store
after 3 errors in a row, for 2 seconds, then lets one call through; serving goes on
from the device and host tiers meanwhile.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np
import numpy.typing as npt

from ._core import Breaker, HybridCache, L3Error, ObjectStore, TransferBatch
from .storage import Pool, Storage

__all__ = [
    "L3Counters",
    "L3Fetch",
    "L3Tier",
    "ObjectStoreLike",
    "layout_prefix",
    "open_store",
]


class ObjectStoreLike(Protocol):
    """What `L3Tier` needs of a store client (`radixcache.ObjectStore` is one)."""

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key holds an object."""
        ...

    def put(
        self, keys: Sequence[bytes], hashes: Sequence[bytes], data: npt.NDArray[np.uint8]
    ) -> list[bool]:
        """Store row ``i`` of `data` under ``keys[i]`` as page ``hashes[i]``, write-once."""
        ...

    def get_into(
        self, keys: Sequence[bytes], hashes: Sequence[bytes], out: npt.NDArray[np.uint8]
    ) -> Sequence[str]:
        """Read ``keys`` into the rows of `out`: ``"ok"``, ``"missing"`` or ``"corrupt"``."""
        ...


def open_store(url: str) -> ObjectStoreLike:
    """Open the L3 store `url` names, by its scheme.

    ``mooncake://MASTER_HOST:PORT?...``: a `radixcache.mooncake.MooncakeStore` (Mooncake
    Store; the query parameters are `radixcache.mooncake.parse_mooncake_url`'s); any
    other URL (``redis://``, ``redis+cluster://``, ``file://``): a
    `radixcache.ObjectStore`. Neither connects here: a store that is down opens and
    fails its calls with `L3Error`.

    Raises:
        ValueError: a bad URL (the message names the part).
    """
    if url.startswith("mooncake://"):
        from .mooncake import MooncakeStore

        return MooncakeStore(url)
    return ObjectStore(url)


@dataclass
class L3Counters:
    """What an `L3Tier` did (its report keys, see `L3Tier.report`)."""

    lookups: int = 0
    lookups_skipped: int = 0
    fetches: int = 0
    fetched_pages: int = 0
    landed_pages: int = 0
    missed_pages: int = 0
    corrupt_objects: int = 0
    missing_objects: int = 0
    puts: int = 0
    stored_objects: int = 0
    present_objects: int = 0
    bytes_fetched: int = 0
    bytes_stored: int = 0
    fetch_seconds: float = 0.0
    put_seconds: float = 0.0
    errors: int = 0
    skipped_open: int = 0
    fetches_cancelled: int = 0


def layout_prefix(storage: Storage, page_size: int) -> bytes:
    """Return the key prefix naming `storage`'s host layout (``rc1-<digest>:``).

    The digest covers the page size and, per pool, each host array's dtype, layer
    count and row shape: two caches share objects only when their bytes mean the same.
    """
    h = hashlib.sha256(f"page_size={page_size}".encode())
    for name in ("kv", "mamba"):
        if not storage.has(name, "host"):
            continue
        for a in storage.pool(name, "host").arrays:
            h.update(f"|{name}:{a.dtype.str}:{a.shape[0]}:{tuple(a.shape[2:])}".encode())
    return f"rc1-{h.hexdigest()[:16]}:".encode()


def _gather(pool: Pool, slots: np.ndarray, per: int) -> np.ndarray:
    """Rows of `pool`'s `slots`, `per` slots an object: ``uint8 [objects, bytes]``."""
    n = len(slots) // per
    parts = []
    for a in pool.arrays:
        x = np.asarray(a)[:, slots].reshape(a.shape[0], n, per, -1)
        parts.append(np.ascontiguousarray(x.transpose(1, 0, 2, 3)).view(np.uint8).reshape(n, -1))
    return np.ascontiguousarray(np.concatenate(parts, axis=1))


def _scatter(pool: Pool, slots: np.ndarray, per: int, data: np.ndarray) -> None:
    """Write `data` (as `_gather` makes it) into `pool`'s `slots`."""
    n = len(slots) // per
    offset = 0
    for a in pool.arrays:
        arr = np.asarray(a)
        row = int(np.prod(a.shape[2:], dtype=np.int64)) * arr.dtype.itemsize
        width = a.shape[0] * per * row
        chunk = np.ascontiguousarray(data[:, offset : offset + width])
        x = np.moveaxis(chunk.view(arr.dtype).reshape(n, a.shape[0], per, *a.shape[2:]), 0, 1)
        arr[:, slots] = x.reshape(a.shape[0], n * per, *a.shape[2:])
        offset += width


@dataclass(eq=False)
class L3Fetch:
    """A fetch `L3Tier.start_fetch` started: drive it with `L3Tier.poll`.

    Attributes:
        tokens: The prompt's tokens.
        namespace: Its namespace.
        done: It ended (landed, missed, failed or cancelled).
        tokens_landed: Once done, the tokens that landed on the host tier (whole pages
            past what the cache held; 0 for a miss or a cancelled fetch).
        cancelled: `L3Tier.cancel` called it off.
    """

    tokens: np.ndarray
    namespace: str | None
    future: Future[Any] | None
    have: int  # whole pages the cache held when it started
    batch: TransferBatch | None = None
    started: float = 0.0  # when the read started (perf_counter)
    done: bool = False
    tokens_landed: int = 0
    cancelled: bool = False


def _wait(future: Future[Any], timeout: float | None) -> bool:
    """Wait up to `timeout` seconds (None: for ever) for `future`; whether it is done."""
    if timeout is not None and timeout <= 0:
        return future.done()
    concurrent.futures.wait([future], timeout=timeout)
    return future.done()


class L3Tier:
    """Runs a cache's L3 batches against `store` and fetches prompts' pages from it.

    Args:
        cache: A cache made with ``l3=True`` (and ``page_hashes=True``).
        storage: Its `Storage` (the host arrays are read and written).
        store: The store client (`radixcache.ObjectStore`, or anything with its
            ``exists``/``put``/``get_into``).
        min_tokens: A prompt whose uncached part is shorter is not looked up.
        breaker: The circuit breaker (`radixcache.Breaker`; by default one that opens
            after 3 errors in a row, for 2 seconds).
        key_prefix: Prepended to every object's key (`layout_prefix` by default).
    """

    def __init__(
        self,
        cache: HybridCache,
        storage: Storage,
        store: ObjectStoreLike,
        *,
        min_tokens: int = 64,
        breaker: Breaker | None = None,
        key_prefix: bytes | None = None,
    ) -> None:
        if not cache.l3:
            raise ValueError("cache: made without an L3 tier; pass l3=True")
        if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
            raise ValueError(f"min_tokens: must be an int >= 0, got {min_tokens!r}")
        self.cache = cache
        self.storage = storage
        self.store = store
        self.min_tokens = min_tokens
        self.breaker = breaker or Breaker(threshold=3, cooldown_ms=2000)
        self.prefix = layout_prefix(storage, cache.page_size) if key_prefix is None else key_prefix
        self.counters = L3Counters()
        self.hybrid = cache.mamba_slots > 0
        # One worker thread for fetches, one for puts: a fetch never queues behind the
        # write-through of everything backed up.
        self._workers: dict[str, ThreadPoolExecutor] = {}
        self._live: set[L3Fetch] = set()  # fetches started and not yet ended
        self._counting = threading.Lock()  # `_call` may run on the worker threads

    # ------------------------------------------------------------------ keys

    def _keys(self, hashes: Sequence[bytes], state: bool = False) -> list[bytes]:
        tail = b".s" if state else b""
        return [self.prefix + h.hex().encode() + tail for h in hashes]

    def _call(self, f: Any, *args: Any) -> Any:
        """Call the store through the breaker.

        Raises:
            L3Error: the breaker is open (the call was not made), or the call failed.
        """
        if not self.breaker.allow():
            with self._counting:
                self.counters.skipped_open += 1
            raise L3Error("the L3 store's circuit breaker is open")
        try:
            out = f(*args)
        except L3Error:
            with self._counting:
                self.counters.errors += 1
            self.breaker.failure()
            raise
        self.breaker.success()
        return out

    def _try(self, f: Any, *args: Any) -> Any:
        """`_call`, None instead of an `L3Error` (a miss)."""
        try:
            return self._call(f, *args)
        except L3Error:
            return None

    # ------------------------------------------------------------------ puts

    def _objects(
        self, batch: TransferBatch
    ) -> list[tuple[str, Pool, np.ndarray, int, list[bytes]]]:
        """Per copy: (pool, its host pool, host slots, slots per object, object hashes)."""
        out: list[tuple[str, Pool, np.ndarray, int, list[bytes]]] = []
        keys = batch.keys
        at = 0
        for c in batch.copies:
            per = self.cache.page_size if c.pool == "kv" else 1
            host = np.asarray(c.src if c.src_tier == "host" else c.dst, dtype=np.int64)
            n = len(host) // per
            out.append((c.pool, self.storage.pool(c.pool, "host"), host, per, keys[at : at + n]))
            at += n
        return out

    def write(self, batch: TransferBatch) -> None:
        """Write a started ``l3_put`` batch's objects the store lacks (without ending it).

        `TransferEngine` calls it for the ``l3_put`` batches it runs (on its worker
        thread for those it submits: `start_write`).

        Raises:
            ValueError: `batch` is not an ``l3_put`` batch.
            L3Error: a store call failed, or the breaker is open.
        """
        if batch.kind != "l3_put":
            raise ValueError(f"batch: expected an l3_put batch, got {batch.kind!r}")
        start = time.perf_counter()
        present = stored = nbytes = 0
        try:
            for pool, host, slots, per, hashes in self._objects(batch):
                keys = self._keys(hashes, pool == "mamba")
                there = self._call(self.store.exists, keys)
                todo = [k for k, p in enumerate(there) if not p]
                present += len(keys) - len(todo)
                if not todo:
                    continue
                rows = np.asarray(todo, dtype=np.int64)
                data = _gather(host, slots.reshape(-1, per)[rows].reshape(-1), per)
                done = self._call(
                    self.store.put, [keys[k] for k in todo], [hashes[k] for k in todo], data
                )
                stored += sum(1 for s in done if s)
                nbytes += int(data.nbytes)
        finally:
            with self._counting:
                c = self.counters
                c.present_objects += present
                c.stored_objects += stored
                c.bytes_stored += nbytes
                c.put_seconds += time.perf_counter() - start
        with self._counting:
            self.counters.puts += 1

    def start_write(
        self, batch: TransferBatch, *, via: Callable[[TransferBatch], None] | None = None
    ) -> Future[None]:
        """Write a started ``l3_put`` batch on the tier's put worker thread (as `write`).

        The batch pins the host slots it reads until it ends, so the caller goes on
        meanwhile; end it (``complete``, or ``fail`` if the Future raised) once the
        Future is done. `via` writes it instead of `write` (`TransferEngine.submit`
        passes its ``copy_batch``). Writes run one at a time on their own thread, beside
        the background fetches' (a fetch never waits behind a write).

        Raises:
            ValueError: `batch` is not an ``l3_put`` batch.
        """
        if batch.kind != "l3_put":
            raise ValueError(f"batch: expected an l3_put batch, got {batch.kind!r}")
        return self._pool("put").submit(via or self.write, batch)

    # ------------------------------------------------------------------ fetches

    def _plan(
        self, tokens: Sequence[int] | np.ndarray, namespace: str | None
    ) -> tuple[np.ndarray, int, list[bytes]] | None:
        """Return what a lookup asks the store about, or None when there is nothing to ask.

        That is the tokens, the whole pages the cache holds KV of, and the hashes of the
        uncached whole pages after them (chained from the cached KV's last page); None
        when the uncached part is under `min_tokens` (counted as skipped).
        """
        cache = self.cache
        ps = cache.page_size
        toks = np.asarray(tokens, dtype=np.int64)
        have, last = cache.peek_hash(toks, namespace=namespace)
        whole = len(toks) // ps * ps
        if whole - have < max(self.min_tokens, ps):
            self.counters.lookups_skipped += 1
            return None
        self.counters.lookups += 1
        hashes = cache.chain_hashes(toks[have:whole], namespace=namespace, parent_hash=last)
        return toks, have // ps, hashes

    def _probe(self, hashes: list[bytes]) -> int:
        """Return how many of `hashes`' pages to fetch (0: none, or a store call failed).

        The leading run the store has, for a hybrid model cut back to the deepest of them
        whose state it has. Store calls only: safe on `start_fetch`'s worker thread.
        """
        present = self._try(self.store.exists, self._keys(hashes))
        if not present:
            return 0
        run = next((k for k, p in enumerate(present) if not p), len(present))
        if not self.hybrid or run == 0:
            return run
        states = self._try(self.store.exists, self._keys(hashes[:run], True))
        if not states:
            return 0
        return max((k + 1 for k, s in enumerate(states) if s), default=0)

    def lookup(self, tokens: Sequence[int] | np.ndarray, *, namespace: str | None = None) -> int:
        """Return how many leading whole pages of `tokens` the cache and the store hold.

        The pages the cache holds KV of (on either tier), then the run of the following
        ones the store has; for a hybrid model cut back to the deepest of those whose
        state the store has too. 0 when there is nothing to fetch: the uncached part is
        under `min_tokens`, the store has none of it, or the breaker is open.
        """
        plan = self._plan(tokens, namespace)
        if plan is None:
            return 0
        _, have, hashes = plan
        run = self._probe(hashes)
        return have + run if run else 0

    def fetch(self, tokens: Sequence[int] | np.ndarray, *, namespace: str | None = None) -> int:
        """Fetch what the store has after the cached part of `tokens`; return its tokens.

        The pages land as host-only nodes (a load-back brings them to the device);
        0 when the store has none, the breaker is open or the cache took nothing.
        Blocks until the store answered; `start_fetch` does the same without blocking.
        """
        upto = self.lookup(tokens, namespace=namespace)
        if upto == 0:
            return 0
        batch = self.cache.l3_fetch(tokens, upto, namespace=namespace)
        if batch is None:
            return 0
        return self.read(batch) * self.cache.page_size

    def read(self, batch: TransferBatch) -> int:
        """Run an ``l3_get`` batch (from ``cache.l3_fetch``): read its objects, end it.

        Starts it, reads each object into its host slots (the rows that came back whole,
        in order), and acknowledges the leading run that landed (``complete_l3``), with
        the objects the store no longer held (missing, or corrupt and deleted) as
        ``gone``.

        Returns:
            The pages that landed and the cache can use (a hybrid fetch: all or none).

        Raises:
            ValueError: `batch` is not an ``l3_get`` batch (left untouched).
        """
        if batch.kind != "l3_get":
            raise ValueError(f"batch: expected an l3_get batch, got {batch.kind!r}")
        batch.start()
        start = time.perf_counter()
        got = self._read_objects(batch)
        return self._settle(batch, got, time.perf_counter() - start)

    def _read_objects(self, batch: TransferBatch) -> list[Sequence[str] | None]:
        """Read a started ``l3_get`` batch's objects into its host slots.

        The leading rows of each copy that came back whole are written. Returns what the
        store said of each object, per copy, up to the first copy that did not come back
        whole (None: its call failed). Writes only the host slots the batch owns: safe
        on `start_fetch`'s worker thread while the caller goes on with the cache.
        """
        out: list[Sequence[str] | None] = []
        for pool, host, slots, per, hashes in self._objects(batch):
            keys = self._keys(hashes, pool == "mamba")
            rows = np.empty((len(keys), per * host.bytes_per_slot), dtype=np.uint8)
            got = self._try(self.store.get_into, keys, hashes, rows)
            out.append(got)
            if got is None:
                break
            ok = next((k for k, g in enumerate(got) if g != "ok"), len(got))
            if ok:
                _scatter(host, slots[: ok * per], per, rows[:ok])
            if ok < len(keys):
                break
        return out

    def _settle(self, batch: TransferBatch, got: list[Sequence[str] | None], took: float) -> int:
        """Acknowledge a read ``l3_get`` batch from `_read_objects`' answers, and count it.

        Returns the pages that landed and the cache can use.
        """
        c = self.counters
        c.fetch_seconds += took
        landed, state = 0, False
        gone: list[int] = []
        first = 0  # the index in `batch.keys` of each copy's first object
        for (pool, host, _, per, hashes), results in zip(self._objects(batch), got):
            if results is None:
                break
            ok = next((k for k, g in enumerate(results) if g != "ok"), len(results))
            c.corrupt_objects += sum(1 for g in results if g == "corrupt")
            c.missing_objects += sum(1 for g in results if g == "missing")
            c.bytes_fetched += ok * per * host.bytes_per_slot
            gone.extend(first + k for k, g in enumerate(results) if g != "ok")
            first += len(hashes)
            if pool == "kv":
                landed = ok
            else:
                state = ok == len(results)
        total = len(batch.copies[0].dst) // self.cache.page_size if batch.copies else 0
        c.fetches += 1
        c.fetched_pages += total
        usable = landed if not self.hybrid else (landed if state and landed == total else 0)
        c.landed_pages += usable
        c.missed_pages += total - usable
        batch.complete_l3(landed, state=state, gone=gone)
        return usable

    # ------------------------------------------------------------------ asynchronous

    def start_fetch(
        self, tokens: Sequence[int] | np.ndarray, *, namespace: str | None = None
    ) -> L3Fetch | None:
        """Start what `fetch` does, without waiting for the store; None: nothing to ask.

        None when the uncached part is under `min_tokens`.

        The store calls (the lookup's ``exists``, then the batch get and the copy into
        the host slots) run on the tier's fetch worker thread, one at a time; every cache
        call runs in `poll`, on the caller's thread. Drive the fetch with `poll` until it
        returns True (its `tokens_landed` then tells what landed), or `cancel` it. The
        tier keeps every fetch it started until it ended, so that a fetch dropped early
        still gives its host slots back (`close` waits for them).
        """
        plan = self._plan(tokens, namespace)
        if plan is None:
            return None
        toks, have, hashes = plan
        f = L3Fetch(toks, namespace, self._pool("fetch").submit(self._probe, hashes), have)
        self._live.add(f)
        return f

    def poll(self, fetch: L3Fetch, timeout: float | None = 0.0) -> bool:
        """Advance `fetch` as far as the store's answers allow; whether it ended.

        Waits up to `timeout` seconds for the store (0: not at all; None: until the
        fetch ended). After the lookup
        it takes host slots for the pages to fetch (``l3_fetch``) and starts the read;
        after the read it acknowledges what landed, as `read` does. Also ends any fetch
        `cancel` left to drain whose read has finished.
        """
        self._reap()
        deadline = None if timeout is None else time.perf_counter() + max(timeout, 0.0)
        while not fetch.done:
            future = fetch.future
            left = None if deadline is None else deadline - time.perf_counter()
            if future is None or not _wait(future, left):
                break
            if fetch.batch is None:  # the lookup answered
                batch = None
                try:
                    run = future.result()
                    if run:
                        upto = fetch.have + run
                        batch = self.cache.l3_fetch(fetch.tokens, upto, namespace=fetch.namespace)
                finally:
                    if batch is None:
                        self._end(fetch, 0)
                if batch is None:
                    break
                batch.start()
                fetch.batch, fetch.started = batch, time.perf_counter()
                fetch.future = self._pool("fetch").submit(self._read_objects, batch)
            else:  # the read finished
                took = time.perf_counter() - fetch.started
                pages = 0
                try:
                    pages = self._settle(fetch.batch, future.result(), took)
                finally:
                    if fetch.batch.outcome is None:  # the read raised: nothing lands
                        fetch.batch.fail("the read raised")
                    self._end(fetch, pages * self.cache.page_size)
        return fetch.done

    def cancel(self, fetch: L3Fetch) -> None:
        """Call `fetch` off: it ends now with nothing landed.

        ``done`` is then True and ``tokens_landed`` 0. A read in flight keeps the host
        slots it writes until it finished; the next `poll` or `close` then fails its
        batch and they go back.
        """
        if fetch.done:
            return
        fetch.cancelled = True
        self.counters.fetches_cancelled += 1
        if fetch.batch is None:
            self._end(fetch, 0)  # the lookup's answer is ignored; nothing was taken
        else:
            fetch.done = True  # the tier ends the batch once the read finished
        self._reap()

    def close(self) -> None:
        """Wait for the fetches and writes in flight, end the fetches; stop the workers.

        A cancelled fetch's batch fails, the others end as `poll` would end them. The
        tier can be used again afterwards (the workers start again when needed).
        """
        for f in list(self._live):
            if f.cancelled:
                if f.future is not None:
                    _wait(f.future, None)
            else:
                self.poll(f, None)
        self._reap()
        for worker in self._workers.values():
            worker.shutdown(wait=True)
        self._workers.clear()

    def _pool(self, kind: str) -> ThreadPoolExecutor:
        worker = self._workers.get(kind)
        if worker is None:
            worker = ThreadPoolExecutor(1, thread_name_prefix=f"radixcache-l3-{kind}")
            self._workers[kind] = worker
        return worker

    def _end(self, fetch: L3Fetch, tokens: int) -> None:
        fetch.done, fetch.tokens_landed, fetch.future = True, tokens, None
        self._live.discard(fetch)

    def _reap(self) -> None:
        """Fail the batches of cancelled fetches whose read has finished."""
        for f in [f for f in self._live if f.cancelled]:
            if f.future is not None and not f.future.done():
                continue
            if f.batch is not None and f.batch.outcome is None:
                f.batch.fail("called off")
                self.counters.fetches += 1
            f.future = None
            self._live.discard(f)

    def report(self) -> dict[str, Any]:
        """Return the tier's figures: counters, GB/s of fetches and puts, the breaker."""
        c = self.counters
        return {
            "l3_lookups": c.lookups,
            "l3_fetches": c.fetches,
            "l3_fetches_cancelled": c.fetches_cancelled,
            "l3_landed_pages": c.landed_pages,
            "l3_missed_pages": c.missed_pages,
            "l3_corrupt_objects": c.corrupt_objects,
            "l3_missing_objects": c.missing_objects,
            "l3_stored_objects": c.stored_objects,
            "l3_bytes_fetched": c.bytes_fetched,
            "l3_bytes_stored": c.bytes_stored,
            "l3_fetch_gbps": _gbps(c.bytes_fetched, c.fetch_seconds),
            "l3_put_gbps": _gbps(c.bytes_stored, c.put_seconds),
            "l3_errors": c.errors,
            "l3_breaker": self.breaker.state,
            "l3_breaker_trips": self.breaker.trips,
        }


def _gbps(nbytes: int, seconds: float) -> float:
    """`nbytes` over `seconds`, in GB/s (0 for no time)."""
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0
