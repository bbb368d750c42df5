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

Each object is named by the page hash the core gives it (its ``keys``) and by the
tier's `L3Identity`: the model (an identity the caller gives: a name and revision, or a
digest), the tensor- and pipeline-parallel rank and size, the page size and the host
layout (each host array's dtype, layers and row shape). The key is
``rc2:{identity}:{kind}:{page hash}`` (``kind`` ``kv`` for a KV page, ``mamba`` for a
state), and every object's frame records the kind and the whole identity digest, checked
on read: an object of another model, rank, layout or kind is never served, even under
the right key (it is counted ``foreign`` and deleted). docs/design.md, "The L3 key
scheme", gives the scheme so that another implementation can read and write it.

A circuit breaker (`radixcache.Breaker`) stops asking the store after 3 errors in a row,
for 2 seconds, then lets one call through; serving goes on from the device and host
tiers meanwhile. Errors are counted by cause (`L3Counters.error_causes`), and the first
error of an outage and each trip of the breaker are logged on the ``radixcache.l3``
logger (`logging`), so that an operator sees why the store is not used.

An `L3Tier` belongs to one cache: it refuses a batch or a fetch of another cache or
tier, and a `TransferEngine` refuses a tier of another cache or storage. It may be
used from several threads at once. A tier dropped without `L3Tier.close` ends its
fetches as `close` would, once their reads have finished, giving back the host slots
they hold (with a ``ResourceWarning``).
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import importlib.util
import json
import logging
import threading
import time
import warnings
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Protocol

import numpy as np
import numpy.typing as npt

from ._core import Breaker, HybridCache, L3Error, ObjectStore, TransferBatch
from .storage import Pool, Storage

__all__ = [
    "L3Counters",
    "L3Fetch",
    "L3Identity",
    "L3Tier",
    "ObjectStoreLike",
    "open_store",
    "redact",
]

logger = logging.getLogger("radixcache.l3")

#: The kinds of objects: a KV page, or the Mamba state at a page's end (a copy's pool).
Kind = Literal["kv", "mamba"]


class ObjectStoreLike(Protocol):
    """What `L3Tier` needs of a store client (`radixcache.ObjectStore` is one)."""

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key holds an object."""
        ...

    def put(
        self,
        keys: Sequence[bytes],
        hashes: Sequence[bytes],
        data: npt.NDArray[np.uint8],
        *,
        kind: Kind,
        identity: bytes,
    ) -> list[bool]:
        """Store row ``i`` of `data` under ``keys[i]`` as page ``hashes[i]``, write-once.

        Each object's frame records `kind` and `identity` (the 32-byte digest).
        """
        ...

    def get_into(
        self,
        keys: Sequence[bytes],
        hashes: Sequence[bytes],
        out: npt.NDArray[np.uint8],
        *,
        kind: Kind,
        identity: bytes,
    ) -> Sequence[str]:
        """Read ``keys`` into the rows of `out`, each checked as page ``hashes[i]``'s.

        Per key ``"ok"``, ``"missing"``, ``"foreign"`` (an intact object of another kind
        or identity) or ``"corrupt"``; the last two are deleted.
        """
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
        TypeError: `url` is not a str.
        ImportError: a ``mooncake://`` URL without Mooncake Store's client (the message
            says how to install it).
        L3Error: the store could not be set up (a ``file://`` directory that cannot be
            made).
    """
    if not isinstance(url, str):
        raise TypeError(f"url: expected a str, got {type(url).__name__}")
    scheme, sep, _ = url.partition("://")
    if not sep or scheme not in _SCHEMES:
        what = "no scheme" if not sep else f"scheme {scheme!r} is not one of them"
        raise ValueError(f"url: bad store url {url!r}: {what} (expected {', '.join(_FORMS)})")
    if scheme == "mooncake":
        from .mooncake import MooncakeStore, parse_mooncake_url

        parse_mooncake_url(url)  # a bad URL is refused first, package or not
        # The client is imported when it first connects: check for it now, so that a
        # missing package is an error here, not one in the middle of serving.
        if importlib.util.find_spec("mooncake") is None:
            raise ImportError(
                f"url: {url!r} needs Mooncake Store's client, and the mooncake package is "
                "not installed: pip install 'radixcache[mooncake]'"
            )
        return MooncakeStore(url)
    return ObjectStore(url)


def redact(url: str) -> str:
    """Return `url` with its password, if it has one, written as ``***`` (for messages)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    authority, slash, path = rest.partition("/")
    cred, at, hosts = authority.rpartition("@")
    if not at or ":" not in cred:
        return url
    user = cred.split(":", 1)[0]
    return f"{scheme}://{user}:***@{hosts}{slash}{path}"


#: The schemes `open_store` knows, and the URL form of each.
_SCHEMES = ("redis", "redis+cluster", "file", "mooncake")
_FORMS = (
    "redis://[[USER]:PASSWORD@]HOST:PORT[/DB]",
    "redis+cluster://HOST:PORT[,HOST:PORT...]",
    "file:///ABSOLUTE/DIR",
    "mooncake://MASTER_HOST:PORT[?...]",
)


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
    foreign_objects: int = 0
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
    #: Failed store calls per cause (``"connection refused"``, ``"timeout"``, ...).
    error_causes: dict[str, int] = field(default_factory=dict)
    #: The first failed call's error message (None: no error yet).
    first_error: str | None = None


def _index(value: object, name: str, least: int) -> int:
    """`value` as an int >= `least` (not a bool), else an error naming `name`."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < least:
        raise ValueError(f"{name}: must be >= {least}, got {value}")
    return int(value)


@dataclass(frozen=True)
class L3Identity:
    """What the bytes of a tier's objects mean, besides their page: part of every key.

    Two tiers share an object only when their identities are equal: the same model, the
    same tensor- and pipeline-parallel rank and size (so the same layers and heads), the
    same page size and host layout (dtypes, layers, row shapes). `text` is its canonical
    form and `digest` the SHA-256 of it, which every object's frame records;
    docs/design.md, "The L3 key scheme".

    Attributes:
        model: The model: a name and revision (``"org/name@rev"``), or a digest the
            caller computes over its weights. Required: it is what keeps another
            model's bytes from being served.
        page_size: Tokens per page.
        layout: Per host array (KV pool's K and V, then the Mamba pool's conv and SSM):
            ``(pool, dtype, layers, row shape)``.
        tp_rank, tp_size: The tensor-parallel rank and world size.
        pp_rank, pp_size: The pipeline-parallel rank and world size.
    """

    model: str
    page_size: int
    layout: tuple[tuple[str, str, int, tuple[int, ...]], ...]
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.model, str):
            raise TypeError(f"model: expected a str, got {type(self.model).__name__}")
        if not self.model.strip():
            raise ValueError("model: must name the model (a name and revision, or a digest)")
        _index(self.page_size, "page_size", 1)
        for rank, size in (("tp_rank", "tp_size"), ("pp_rank", "pp_size")):
            n = _index(getattr(self, size), size, 1)
            r = _index(getattr(self, rank), rank, 0)
            if r >= n:
                raise ValueError(f"{rank}: must be below {size} ({n}), got {r}")

    @classmethod
    def of(
        cls,
        storage: Storage,
        page_size: int,
        *,
        model: str,
        tp_rank: int = 0,
        tp_size: int = 1,
        pp_rank: int = 0,
        pp_size: int = 1,
    ) -> L3Identity:
        """Return the identity of `storage`'s host tier for `model` at these ranks."""
        layout = tuple(
            (name, a.dtype.str, int(a.shape[0]), tuple(int(d) for d in a.shape[2:]))
            for name in ("kv", "mamba")
            if storage.has(name, "host")
            for a in storage.pool(name, "host").arrays
        )
        return cls(model, page_size, layout, tp_rank, tp_size, pp_rank, pp_size)

    @functools.cached_property
    def text(self) -> str:
        """The canonical form: JSON, keys sorted, no spaces, ASCII only."""
        return json.dumps(
            {
                "format": "radixcache-l3/2",
                "model": self.model,
                "tp": [self.tp_rank, self.tp_size],
                "pp": [self.pp_rank, self.pp_size],
                "page_size": self.page_size,
                "layout": [[p, d, n, list(row)] for p, d, n, row in self.layout],
            },
            sort_keys=True,
            separators=(",", ":"),
            ensure_ascii=True,
        )

    @functools.cached_property
    def digest(self) -> bytes:
        """The SHA-256 of `text` (32 bytes): what each object's frame records."""
        return hashlib.sha256(self.text.encode("ascii")).digest()

    def key(self, kind: Kind, page_hash: bytes) -> bytes:
        """Return the key of the object of `kind` for the page whose hash is `page_hash`."""
        return b"rc2:%s:%s:%s" % (
            self.digest[:16].hex().encode(),
            kind.encode(),
            page_hash.hex().encode(),
        )


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
    owner: object = field(default=None, repr=False)  # the tier's token: whose fetch it is
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


def _cause(e: L3Error) -> str:
    """Why a store call failed: the error's ``cause`` (``"timeout"``, ...) or ``"error"``."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, str) and cause else "error"


def _abandon(live: set[L3Fetch], workers: dict[str, ThreadPoolExecutor]) -> None:
    """End what a tier collected without `L3Tier.close` left in flight.

    It runs once the tier is gone, so no read of its fetches is under way any more (a
    read holds the tier until it finished): each fetch's batch fails, and the host slots
    it held go back, with a ``ResourceWarning`` naming how many.
    """
    ended = 0
    for f in list(live):
        batch, future = f.batch, f.future
        if batch is not None and batch.outcome is None and (future is None or future.done()):
            batch.fail("its L3 tier was dropped before the fetch ended")
            ended += 1
        f.done, f.future = True, None
    live.clear()
    for worker in workers.values():
        worker.shutdown(wait=False)
    workers.clear()
    if ended:
        warnings.warn(
            f"an L3Tier was dropped with {ended} fetch(es) in flight: their batches failed "
            "and their host slots are back; close() the tier to end its fetches as poll() "
            "would",
            ResourceWarning,
            stacklevel=2,
        )


class L3Tier:
    """Runs a cache's L3 batches against `store` and fetches prompts' pages from it.

    Thread-safe: fetches, polls, cancels and writes may come from several threads at once
    (the cache is thread-safe too). A tier collected without `close` fails the batches
    of its unfinished fetches once their reads are over, giving their host slots back
    (``ResourceWarning``).

    Args:
        cache: A cache made with ``l3=True`` (and ``page_hashes=True``).
        storage: Its `Storage` (the host arrays are read and written; checked against
            the cache as `TransferEngine` checks it).
        store: The store client (`radixcache.ObjectStore`, or anything with its
            ``exists``/``put``/``get_into``).
        model: What model the bytes are of: a name and revision, or a digest of its
            weights (`L3Identity.model`). Required: caches of other models never read
            these objects.
        tp_rank, tp_size: This cache's tensor-parallel rank and world size.
        pp_rank, pp_size: Its pipeline-parallel rank and world size.
        min_tokens: A prompt whose uncached part is shorter is not looked up.
        breaker: The circuit breaker (`radixcache.Breaker`; by default one that opens
            after 3 errors in a row, for 2 seconds).

    Raises:
        TypeError: an argument of the wrong type (named).
        ValueError: a cache without an L3 tier, a storage that does not fit it, or a
            bad count or rank (named).
    """

    def __init__(
        self,
        cache: HybridCache,
        storage: Storage,
        store: ObjectStoreLike,
        *,
        model: str,
        tp_rank: int = 0,
        tp_size: int = 1,
        pp_rank: int = 0,
        pp_size: int = 1,
        min_tokens: int = 64,
        breaker: Breaker | None = None,
    ) -> None:
        if not isinstance(cache, HybridCache):
            raise TypeError(f"cache: expected a HybridCache, got {type(cache).__name__}")
        if not cache.l3:
            raise ValueError("cache: made without an L3 tier; pass l3=True")
        if not isinstance(storage, Storage):
            raise TypeError(f"storage: expected a Storage, got {type(storage).__name__}")
        storage.check(cache)
        missing = [
            m for m in ("exists", "put", "get_into") if not callable(getattr(store, m, None))
        ]
        if missing:
            raise TypeError(
                f"store: a {type(store).__name__} has no {', '.join(missing)} (expected an "
                "ObjectStore, or an object with its exists, put and get_into)"
            )
        if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
            raise ValueError(f"min_tokens: must be an int >= 0, got {min_tokens!r}")
        if breaker is not None and not isinstance(breaker, Breaker):
            raise TypeError(f"breaker: expected a Breaker, got {type(breaker).__name__}")
        self.identity = L3Identity.of(
            storage,
            cache.page_size,
            model=model,
            tp_rank=tp_rank,
            tp_size=tp_size,
            pp_rank=pp_rank,
            pp_size=pp_size,
        )
        self.cache = cache
        self.storage = storage
        self.store = store
        self.min_tokens = min_tokens
        self.breaker = breaker or Breaker(threshold=3, cooldown_ms=2000)
        self.counters = L3Counters()
        self.hybrid = cache.mamba_slots > 0
        self._digest = self.identity.digest
        self._heads = {k: self.identity.key(k, b"") for k in ("kv", "mamba")}
        #: Guards the fetches, the counters and the workers; never held while waiting
        #: for the store.
        self._lock = threading.RLock()
        #: Carried by this tier's fetches: `poll` and `cancel` refuse any other.
        self._token = object()
        #: Causes logged since the store last answered (an outage is logged once a cause).
        self._logged: set[str] = set()
        # One worker thread for fetches, one for puts: a fetch never queues behind the
        # write-through of everything backed up.
        self._workers: dict[str, ThreadPoolExecutor] = {}
        self._live: set[L3Fetch] = set()  # fetches started and not yet ended
        weakref.finalize(self, _abandon, self._live, self._workers)

    # ------------------------------------------------------------------ keys

    def _keys(self, hashes: Sequence[bytes], kind: Kind) -> list[bytes]:
        head = self._heads[kind]
        return [head + h.hex().encode() for h in hashes]

    def _call(self, f: Any, *args: Any, **kwargs: Any) -> Any:
        """Call the store through the breaker; count and log a failure by its cause.

        Raises:
            L3Error: the breaker is open (the call was not made), or the call failed.
        """
        if not self.breaker.allow():
            with self._lock:
                self.counters.skipped_open += 1
            e = L3Error("the L3 store's circuit breaker is open")
            e.cause = "breaker open"
            raise e
        try:
            out = f(*args, **kwargs)
        except L3Error as e:
            self._failed(e)
            raise
        self.breaker.success()
        if self._logged:
            with self._lock:
                if self._logged:
                    self._logged.clear()
                    logger.warning("L3 store %s answers again", self._where())
        return out

    def _failed(self, e: L3Error) -> None:
        """Count a failed store call, tell the breaker, and log what an operator needs."""
        cause = _cause(e)
        trips = self.breaker.trips
        self.breaker.failure()
        with self._lock:
            c = self.counters
            c.errors += 1
            c.error_causes[cause] = c.error_causes.get(cause, 0) + 1
            if c.first_error is None:
                c.first_error = str(e)
            new = cause not in self._logged
            self._logged.add(cause)
        if new:
            logger.warning("L3 store %s: %s (%s)", self._where(), cause, e)
        if self.breaker.trips > trips:
            logger.warning(
                "L3 store %s: circuit breaker open after %d errors in a row: serving goes "
                "on without the store; one call goes through every %.1f s",
                self._where(),
                self.breaker.threshold,
                self.breaker.cooldown_ms / 1000,
            )

    def _where(self) -> str:
        """Return the store's name for messages (its URL where it has one)."""
        url = getattr(self.store, "url", None)
        return redact(url) if isinstance(url, str) else type(self.store).__name__

    def _try(self, f: Any, *args: Any, **kwargs: Any) -> Any:
        """`_call`, None instead of an `L3Error` (a miss)."""
        try:
            return self._call(f, *args, **kwargs)
        except L3Error:
            return None

    def _check_batch(self, batch: TransferBatch, kind: str) -> None:
        """Refuse, untouched, a batch that is not this cache's `kind` batch."""
        if not isinstance(batch, TransferBatch):
            raise TypeError(f"batch: expected a TransferBatch, got {type(batch).__name__}")
        if not batch.belongs_to(self.cache):
            raise ValueError("batch: a batch of another cache (this tier runs its own cache's)")
        if batch.kind != kind:
            raise ValueError(f"batch: expected an {kind} batch, got {batch.kind!r}")

    def _check_fetch(self, fetch: L3Fetch) -> None:
        """Refuse a fetch another tier started."""
        if not isinstance(fetch, L3Fetch):
            raise TypeError(f"fetch: expected an L3Fetch, got {type(fetch).__name__}")
        if fetch.owner is not self._token:
            raise ValueError("fetch: started by another L3Tier (each tier drives its own)")

    # ------------------------------------------------------------------ puts

    def _objects(
        self, batch: TransferBatch
    ) -> list[tuple[Kind, Pool, np.ndarray, int, list[bytes]]]:
        """Per copy: (pool, its host pool, host slots, slots per object, object hashes)."""
        out: list[tuple[Kind, Pool, np.ndarray, int, list[bytes]]] = []
        keys = batch.keys
        at = 0
        for c in batch.copies:
            kind: Kind = "kv" if c.pool == "kv" else "mamba"
            per = self.cache.page_size if kind == "kv" else 1
            host = np.asarray(c.src if c.src_tier == "host" else c.dst, dtype=np.int64)
            n = len(host) // per
            out.append((kind, self.storage.pool(kind, "host"), host, per, keys[at : at + n]))
            at += n
        return out

    def write(self, batch: TransferBatch) -> None:
        """Write a started ``l3_put`` batch's objects the store lacks (without ending it).

        `TransferEngine` calls it for the ``l3_put`` batches it runs (on its worker
        thread for those it submits: `start_write`).

        Raises:
            TypeError: `batch` is not a `TransferBatch`.
            ValueError: `batch` is not an ``l3_put`` batch of this tier's cache.
            L3Error: a store call failed, or the breaker is open.
        """
        self._check_batch(batch, "l3_put")
        start = time.perf_counter()
        present = stored = nbytes = 0
        try:
            for kind, host, slots, per, hashes in self._objects(batch):
                keys = self._keys(hashes, kind)
                there = self._call(self.store.exists, keys)
                todo = [k for k, p in enumerate(there) if not p]
                present += len(keys) - len(todo)
                if not todo:
                    continue
                rows = np.asarray(todo, dtype=np.int64)
                data = _gather(host, slots.reshape(-1, per)[rows].reshape(-1), per)
                done = self._call(
                    self.store.put,
                    [keys[k] for k in todo],
                    [hashes[k] for k in todo],
                    data,
                    kind=kind,
                    identity=self._digest,
                )
                stored += sum(1 for s in done if s)
                nbytes += int(data.nbytes)
        finally:
            with self._lock:
                c = self.counters
                c.present_objects += present
                c.stored_objects += stored
                c.bytes_stored += nbytes
                c.put_seconds += time.perf_counter() - start
        with self._lock:
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
            TypeError: `batch` is not a `TransferBatch`.
            ValueError: `batch` is not an ``l3_put`` batch of this tier's cache.
        """
        self._check_batch(batch, "l3_put")
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
            with self._lock:
                self.counters.lookups_skipped += 1
            return None
        with self._lock:
            self.counters.lookups += 1
        hashes = cache.chain_hashes(toks[have:whole], namespace=namespace, parent_hash=last)
        return toks, have // ps, hashes

    def _probe(self, hashes: list[bytes]) -> int:
        """Return how many of `hashes`' pages to fetch (0: none, or a store call failed).

        The leading run the store has, for a hybrid model cut back to the deepest of them
        whose state it has. Store calls only: safe on `start_fetch`'s worker thread.
        """
        present = self._try(self.store.exists, self._keys(hashes, "kv"))
        if not present:
            return 0
        run = next((k for k, p in enumerate(present) if not p), len(present))
        if not self.hybrid or run == 0:
            return run
        states = self._try(self.store.exists, self._keys(hashes[:run], "mamba"))
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
        the objects the store no longer held (missing, or corrupt or foreign and deleted)
        as ``gone``.

        Returns:
            The pages that landed and the cache can use (a hybrid fetch: all or none).

        Raises:
            TypeError: `batch` is not a `TransferBatch`.
            ValueError: `batch` is not an ``l3_get`` batch of this tier's cache (left
                untouched).
        """
        self._check_batch(batch, "l3_get")
        batch.start()
        start = time.perf_counter()
        try:
            got = self._read_objects(batch)
        except BaseException:
            batch.fail("the read raised")
            raise
        return self._settle(batch, got, time.perf_counter() - start)

    def _read_objects(self, batch: TransferBatch) -> list[Sequence[str] | None]:
        """Read a started ``l3_get`` batch's objects into its host slots.

        The leading rows of each copy that came back whole are written. Returns what the
        store said of each object, per copy, up to the first copy that did not come back
        whole (None: its call failed). Writes only the host slots the batch owns: safe
        on `start_fetch`'s worker thread while the caller goes on with the cache.
        """
        out: list[Sequence[str] | None] = []
        for kind, host, slots, per, hashes in self._objects(batch):
            keys = self._keys(hashes, kind)
            rows = np.empty((len(keys), per * host.bytes_per_slot), dtype=np.uint8)
            got = self._try(
                self.store.get_into, keys, hashes, rows, kind=kind, identity=self._digest
            )
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
        landed, state = 0, False
        gone: list[int] = []
        first = 0  # the index in `batch.keys` of each copy's first object
        counts = {"corrupt": 0, "missing": 0, "foreign": 0}
        nbytes = 0
        for (kind, host, _, per, hashes), results in zip(self._objects(batch), got):
            if results is None:
                break
            ok = next((k for k, g in enumerate(results) if g != "ok"), len(results))
            for g in results:
                if g in counts:
                    counts[g] += 1
            nbytes += ok * per * host.bytes_per_slot
            gone.extend(first + k for k, g in enumerate(results) if g != "ok")
            first += len(hashes)
            if kind == "kv":
                landed = ok
            else:
                state = ok == len(results)
        total = len(batch.copies[0].dst) // self.cache.page_size if batch.copies else 0
        usable = landed if not self.hybrid else (landed if state and landed == total else 0)
        with self._lock:
            c = self.counters
            c.fetch_seconds += took
            c.corrupt_objects += counts["corrupt"]
            c.missing_objects += counts["missing"]
            c.foreign_objects += counts["foreign"]
            c.bytes_fetched += nbytes
            c.fetches += 1
            c.fetched_pages += total
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
        with self._lock:
            f = L3Fetch(toks, namespace, None, have, owner=self._token)
            f.future = self._pool("fetch").submit(self._probe, hashes)
            self._live.add(f)
        return f

    def poll(self, fetch: L3Fetch, timeout: float | None = 0.0) -> bool:
        """Advance `fetch` as far as the store's answers allow; whether it ended.

        Waits up to `timeout` seconds for the store (0: not at all; None: until the
        fetch ended). After the lookup it takes host slots for the pages to fetch
        (``l3_fetch``) and starts the read; after the read it acknowledges what landed,
        as `read` does. Also ends any fetch `cancel` left to drain whose read has
        finished. Several threads may poll one fetch: one of them advances it.

        Raises:
            TypeError: `fetch` is not an `L3Fetch`.
            ValueError: `fetch` was started by another tier.
        """
        self._check_fetch(fetch)
        self._reap()
        deadline = None if timeout is None else time.perf_counter() + max(timeout, 0.0)
        while True:
            with self._lock:
                if fetch.done:
                    return True
                future = fetch.future
            left = None if deadline is None else deadline - time.perf_counter()
            if future is None or not _wait(future, left):
                with self._lock:
                    return fetch.done
            with self._lock:
                if not fetch.done and fetch.future is future:
                    self._advance(fetch, future)

    def _advance(self, fetch: L3Fetch, future: Future[Any]) -> None:
        """Take `fetch` past its finished `future` (under the tier's lock)."""
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
                return
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

    def cancel(self, fetch: L3Fetch) -> None:
        """Call `fetch` off: it ends now with nothing landed.

        ``done`` is then True and ``tokens_landed`` 0. A read in flight keeps the host
        slots it writes until it finished; the next `poll` or `close` then fails its
        batch and they go back.

        Raises:
            TypeError: `fetch` is not an `L3Fetch`.
            ValueError: `fetch` was started by another tier.
        """
        self._check_fetch(fetch)
        with self._lock:
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
        with self._lock:
            fetches = list(self._live)
        for f in fetches:
            if f.cancelled:
                future = f.future
                if future is not None:
                    _wait(future, None)
            else:
                self.poll(f, None)
        self._reap()
        with self._lock:
            workers = list(self._workers.values())
            self._workers.clear()
        for worker in workers:
            worker.shutdown(wait=True)

    def _pool(self, kind: str) -> ThreadPoolExecutor:
        with self._lock:
            worker = self._workers.get(kind)
            if worker is None:
                worker = ThreadPoolExecutor(1, thread_name_prefix=f"radixcache-l3-{kind}")
                self._workers[kind] = worker
            return worker

    def _end(self, fetch: L3Fetch, tokens: int) -> None:
        with self._lock:
            fetch.done, fetch.tokens_landed, fetch.future = True, tokens, None
            self._live.discard(fetch)

    def _reap(self) -> None:
        """Fail the batches of cancelled fetches whose read has finished."""
        with self._lock:
            for f in [f for f in self._live if f.cancelled]:
                if f.future is not None and not f.future.done():
                    continue
                if f.batch is not None and f.batch.outcome is None:
                    f.batch.fail("called off")
                    self.counters.fetches += 1
                f.future = None
                self._live.discard(f)

    def report(self) -> dict[str, Any]:
        """Return the tier's figures: counters, GB/s of fetches and puts, the breaker.

        ``l3_errors`` counts failed store calls, ``l3_error_causes`` splits them by
        cause (``{"connection refused": 3}``) and ``l3_first_error`` is the first one's
        message; ``l3_foreign_objects`` counts objects of another model, rank, layout or
        kind found under this tier's keys (a miss each, deleted).
        """
        with self._lock:
            c = self.counters
            return {
                "l3_lookups": c.lookups,
                "l3_fetches": c.fetches,
                "l3_fetches_cancelled": c.fetches_cancelled,
                "l3_landed_pages": c.landed_pages,
                "l3_missed_pages": c.missed_pages,
                "l3_corrupt_objects": c.corrupt_objects,
                "l3_missing_objects": c.missing_objects,
                "l3_foreign_objects": c.foreign_objects,
                "l3_stored_objects": c.stored_objects,
                "l3_bytes_fetched": c.bytes_fetched,
                "l3_bytes_stored": c.bytes_stored,
                "l3_fetch_gbps": _gbps(c.bytes_fetched, c.fetch_seconds),
                "l3_put_gbps": _gbps(c.bytes_stored, c.put_seconds),
                "l3_errors": c.errors,
                "l3_error_causes": dict(c.error_causes),
                "l3_first_error": c.first_error,
                "l3_breaker": self.breaker.state,
                "l3_breaker_trips": self.breaker.trips,
            }


def _gbps(nbytes: int, seconds: float) -> float:
    """`nbytes` over `seconds`, in GB/s (0 for no time)."""
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0
