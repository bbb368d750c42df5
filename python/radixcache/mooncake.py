"""`MooncakeStore`: the L3 tier on Mooncake Store, as SGLang's HiCache uses it.

Mooncake Store (``pip install "radixcache[mooncake]"``, the non-CUDA wheel
``mooncake-transfer-engine-non-cuda``) is a distributed object store: a master
(``mooncake_master``, which also serves the transfer engine's metadata over HTTP) keeps
the index of objects, and the memory that holds them is contributed by clients, the
standalone store daemons (``mooncake_client --global_segment_size=...``) or the caches'
own clients (``segment=`` below). Bytes move between a client's registered memory and
a segment over the transfer engine (TCP here; RDMA where there is a NIC), zero-copy:
``batch_put_from`` reads from, and ``batch_get_into`` writes into, registered memory.

`MooncakeStore` is an `radixcache.l3.ObjectStoreLike` (``exists``, ``put``,
``get_into``, plus ``delete``), so `radixcache.l3.L3Tier` takes it as it takes
`radixcache.ObjectStore`, and stores the same bytes: every object framed by
`radixcache._core.frame_encode` (the Rust store's framing: magic, format version,
kind, payload length, page hash, identity digest, checksum) and verified by
`radixcache._core.frame_decode` on the way back; a corrupt object is reported
``"corrupt"`` and removed, an intact one of another kind or identity ``"foreign"`` and
removed. Puts are
write-once (``exists`` first, then ``put`` of what is missing).

Memory: one staging buffer per store, allocated and registered with Mooncake once
(``buffer=``, 128 MiB by default, touched only as far as a batch fills it) and reused
by every call, batches larger than it split into several round trips. `L3Tier` hands
over arrays it gathers from the host pools (``data``/``out``), not the pools
themselves, so the objects are framed into, and verified out of, the staging buffer:
registering the host pools instead would save that copy but not the framing pass, and
would tie the store to one `Storage`.

Errors: a store call that fails, or does not answer within ``timeout_ms`` (Mooncake's
RPC timeout), raises `radixcache.L3Error`, so the tier's circuit breaker counts it.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TypedDict, TypeVar
from urllib.parse import parse_qsl, urlsplit

import numpy as np
import numpy.typing as npt

from ._core import FRAME_HEADER_LEN, L3Error, frame_decode, frame_encode

__all__ = [
    "LocalMooncake",
    "MooncakeConfig",
    "MooncakeStore",
    "mooncake_binary",
    "parse_mooncake_url",
]

#: Mooncake's error codes (``mooncake-store/include/types.h``) that this client reads.
_NOT_FOUND = -704  # OBJECT_NOT_FOUND
_ALREADY_EXISTS = -705  # OBJECT_ALREADY_EXISTS
_INVALID_PARAMS = -600  # a get's buffer is smaller than the object
_NO_SPACE = (-10, -200)  # BUFFER_OVERFLOW, NO_AVAILABLE_HANDLE: the segments are full
#: A get of an object that is there but not readable (being written, or its replica
#: gone): a miss, not an error.
_NOT_READY = (-703, -710, -712)

_T = TypeVar("_T")

_UNITS = {"": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


def _size(name: str, value: str) -> int:
    """Return `value` in bytes: an integer, then optionally ``KiB``, ``MiB`` or ``GiB``."""
    m = re.fullmatch(r"(\d+)\s*([a-zA-Z]*)", value.strip())
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{name}: {value!r} is not a size (an integer, then KiB, MiB or GiB)")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


@dataclass(frozen=True)
class MooncakeConfig:
    """What a ``mooncake://`` URL says (`parse_mooncake_url`)."""

    master: str
    metadata: str
    host: str | None
    segment: int
    buffer: int
    protocol: str
    device: str
    timeout_ms: int


def parse_mooncake_url(url: str) -> MooncakeConfig:
    """Parse ``mooncake://MASTER_HOST:PORT[?key=value&...]``.

    Query parameters (all optional):

    * ``metadata``: the transfer engine's metadata server (``http://HOST:PORT/metadata``;
      default: the HTTP metadata server built into ``mooncake_master``
      (``--enable_http_metadata_server``) on the master's host, port 8080); every client
      and store daemon of one store must use the same one.
    * ``host``: this client's address as the other nodes reach it (default: the local
      address of the route to the master).
    * ``segment``: bytes of memory this client contributes to the store (default 0: the
      memory is the standalone store daemons'; a cache that contributes a segment takes
      its objects with it when it exits).
    * ``buffer``: the registered staging buffer (default 128MiB; a batch larger than it is
      split into several round trips, an object larger than it grows it).
    * ``protocol``: the transfer engine's (default ``tcp``; ``rdma`` with ``device``).
    * ``device``: the RDMA device names (default none).
    * ``timeout_ms``: Mooncake's RPC timeout, per call (default 1000).

    Sizes are integers of bytes, optionally followed by ``KiB``, ``MiB`` or ``GiB``.

    Raises:
        ValueError: not a ``mooncake://`` URL, a bad host or port, an unknown query
            parameter or a bad value (the message names it).
    """
    parts = urlsplit(url)
    if parts.scheme != "mooncake":
        raise ValueError(f"url: expected mooncake://HOST:PORT, got {url!r}")
    if parts.path not in ("", "/") or parts.fragment:
        raise ValueError(f"url: {url!r} has a path or fragment; mooncake://HOST:PORT?...")
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        raise ValueError(f"url: {url!r}: the port is not a number in 1..=65535") from None
    if not host or not port:
        raise ValueError(f"url: {url!r} is not mooncake://HOST:PORT (the master's)")
    query: dict[str, str] = {}
    for key, value in parse_qsl(parts.query, keep_blank_values=True, strict_parsing=False):
        if key in query:
            raise ValueError(f"url: query parameter {key!r} given twice")
        query[key] = value
    known = {"metadata", "host", "segment", "buffer", "protocol", "device", "timeout_ms"}
    unknown = sorted(set(query) - known)
    if unknown:
        raise ValueError(
            f"url: unknown query parameter {unknown[0]!r} (known: {', '.join(sorted(known))})"
        )
    netloc_host = f"[{host}]" if ":" in host else host
    metadata = query.get("metadata", f"http://{netloc_host}:8080/metadata")
    if not metadata:
        raise ValueError("metadata: must not be empty")
    segment = _size("segment", query.get("segment", "0"))
    buffer = _size("buffer", query.get("buffer", "128MiB"))
    if buffer < FRAME_HEADER_LEN + 1:
        raise ValueError(f"buffer: must be at least {FRAME_HEADER_LEN + 1} bytes, got {buffer}")
    timeout = query.get("timeout_ms", "1000")
    if not timeout.isdigit() or int(timeout) < 1:
        raise ValueError(f"timeout_ms: must be an integer >= 1, got {timeout!r}")
    protocol = query.get("protocol", "tcp")
    if protocol not in ("tcp", "rdma"):
        raise ValueError(f"protocol: must be tcp or rdma, got {protocol!r}")
    local = query.get("host")
    if local is not None and not local:
        raise ValueError("host: must not be empty")
    return MooncakeConfig(
        master=f"{netloc_host}:{port}",
        metadata=metadata,
        host=local,
        segment=segment,
        buffer=buffer,
        protocol=protocol,
        device=query.get("device", ""),
        timeout_ms=int(timeout),
    )


def _route_to(host: str, port: int) -> str:
    """Return the local address of the route to ``host`` (no packet is sent).

    A loopback `host` is its own answer; without a route, the machine's host name.
    """
    try:
        if ipaddress.ip_address(host).is_loopback:
            return host
    except ValueError:
        pass
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return str(s.getsockname()[0])
    except OSError:  # no route (or no such name): the machine's name, as SGLang's default
        return socket.gethostname()


def _error(message: str, cause: str = "server error") -> L3Error:
    """Return an `L3Error` with its ``cause`` (`radixcache.L3Error.cause`)."""
    e = L3Error(message)
    e.cause = cause
    return e


class _Label(TypedDict):
    """The frame fields of a call's objects (`frame_encode`/`frame_decode` keywords)."""

    kind: Literal["kv", "mamba"]
    identity: bytes


def _label(kind: object, identity: object) -> _Label:
    """`kind` and `identity` checked, naming them (before the store is called)."""
    if kind not in ("kv", "mamba"):
        raise ValueError(f"kind: expected 'kv' or 'mamba', got {kind!r}")
    if not isinstance(identity, bytes):
        raise TypeError(f"identity: expected 32 bytes, got {type(identity).__name__}")
    if len(identity) != 32:
        raise ValueError(f"identity: expected 32 bytes, got {len(identity)}")
    return {"kind": "kv" if kind == "kv" else "mamba", "identity": identity}


def _keys(keys: Sequence[bytes]) -> list[str]:
    """Mooncake's keys are strings: ours are ASCII (a layout prefix and a hex hash)."""
    if isinstance(keys, (bytes, str)):
        raise TypeError(f"keys: expected a list of bytes, got {type(keys).__name__}")
    out = []
    for i, k in enumerate(keys):
        if not isinstance(k, bytes):
            raise TypeError(f"keys[{i}]: expected bytes, got {type(k).__name__}")
        try:
            out.append(k.decode("ascii"))
        except UnicodeDecodeError:
            raise ValueError(f"keys[{i}]: must be ASCII for Mooncake, got {k!r}") from None
    return out


def _exist(store: Any, names: list[str]) -> list[bool]:
    """Ask `store` which of `names` hold an object.

    Raises:
        L3Error: the store answered -1 for one (it failed, or timed out).
    """
    codes = store.batch_is_exist(names)
    bad = [c for c in codes if c not in (0, 1)]
    if bad or len(codes) != len(names):
        raise _error(f"mooncake: exists of {len(names)} keys failed: error {bad[:1] or codes}")
    return [c == 1 for c in codes]


def _remove(store: Any, names: list[str]) -> None:
    """Remove `names` from `store` (forced: a lease a reader holds does not keep it).

    Raises:
        L3Error: a removal failed (other than for an absent key).
    """
    for name, rc in zip(names, store.batch_remove(names, True), strict=True):
        if rc not in (0, _NOT_FOUND):
            raise _error(f"mooncake: remove of {name!r} failed: error {rc}")


def _rows(arr: Any, name: str, n: int) -> npt.NDArray[np.uint8]:
    """`arr` as a C-contiguous 2-D uint8 array of `n` non-empty rows."""
    if not isinstance(arr, np.ndarray) or arr.dtype != np.uint8 or arr.ndim != 2:
        raise TypeError(f"{name}: expected a 2-D numpy uint8 array, got {type(arr).__name__}")
    if arr.shape[0] != n:
        raise ValueError(f"{name}: {arr.shape[0]} rows for {n} keys")
    if arr.shape[1] == 0:
        raise ValueError(f"{name}: rows of 0 bytes")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name}: must be C-contiguous")
    return arr


class _Call:
    """A ``get_into`` in flight, and whether its caller gave up on it.

    Once given up on, it must not write the caller's array; the decode holds `lock`.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.abandoned = False


class MooncakeStore:
    """An L3 object store on Mooncake Store, opened from a ``mooncake://`` URL.

    The URL is parsed when the store is made (`parse_mooncake_url` lists its query
    parameters); the client connects to the master on first use, so a master that is
    down makes the calls raise `L3Error` (each later call tries to connect again).
    Thread-safe: calls run one at a time on a worker thread of the store's (the one
    staging buffer), and each caller waits for its call at most three RPC timeouts
    (``3 * timeout_ms``) before it raises `L3Error`: Mooncake's client holds a call to a
    master that went away for about 4 s whatever its timeouts, and a serving thread
    must not. A call given up on finishes on the worker (a later call waits for it, or
    gives up too); a ``get_into`` given up on never writes the caller's ``out``.

    Mooncake reads its RPC timeouts from the process environment when a client connects
    (``MC_RPC_TIMEOUT_MS``, ``MC_RPC_CONNECT_TIMEOUT_MS``; ``MC_STORE_CLIENT_SETUP_RETRIES``
    is set to 1): the store sets them from ``timeout_ms`` just before, so two stores of
    one process with other timeouts each get their own.

    Raises:
        ValueError: a bad URL (the message names the part).
        ModuleNotFoundError: the ``mooncake`` package is not installed (on first use).
    """

    def __init__(self, url: str) -> None:
        self._config = parse_mooncake_url(url)
        self._url = url
        self._store: Any = None
        self._staging: npt.NDArray[np.uint8] | None = None
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="radixcache-mooncake")
        self._deadline_s = 3 * self._config.timeout_ms / 1000

    @property
    def url(self) -> str:
        """The URL it was opened with."""
        return self._url

    @property
    def timeout_ms(self) -> int:
        """Mooncake's RPC timeout of each call, in milliseconds."""
        return self._config.timeout_ms

    @property
    def config(self) -> MooncakeConfig:
        """What the URL says."""
        return self._config

    def __repr__(self) -> str:
        return f"MooncakeStore({self._url!r})"

    # ------------------------------------------------------------------ connection

    def connect(self) -> None:
        """Connect to the master now (calls do on first use).

        Raises:
            L3Error: the client could not be set up (master unreachable, bad metadata
                server) or its staging buffer not registered.
            ModuleNotFoundError: the ``mooncake`` package is not installed.
        """
        self._run(self._connected)

    def check(self) -> None:
        """Check now that the store can be used: connect (`connect`), as ``ObjectStore.check``.

        Raises:
            L3Error: the client could not be set up (its ``cause`` says why).
            ModuleNotFoundError: the ``mooncake`` package is not installed.
        """
        self.connect()

    def _run(self, job: Callable[..., _T], *args: Any) -> _T:
        """Run `job(*args)` on the worker; wait for it at most the call deadline.

        Raises:
            L3Error: what the job raised, or no answer within the deadline (a job not
                started yet is called off).
        """
        fut: Future[_T] = self._worker.submit(job, *args)
        try:
            return fut.result(timeout=self._deadline_s)
        except FutureTimeout:
            fut.cancel()
            raise _error(
                f"mooncake: no answer from master {self._config.master} within "
                f"{self._deadline_s * 1000:.0f} ms",
                "timeout",
            ) from None

    def _connected(self) -> Any:
        """Return the set-up client, connecting first if needed (on the worker)."""
        if self._store is not None:
            return self._store
        try:
            from mooncake.store import MooncakeDistributedStore
        except ModuleNotFoundError as e:
            raise ModuleNotFoundError(
                f'mooncake:// needs the mooncake package ({e}); pip install "radixcache[mooncake]"'
            ) from e
        c = self._config
        host, _, port = c.master.rpartition(":")
        local = c.host or _route_to(host.strip("[]"), int(port))
        os.environ["MC_RPC_TIMEOUT_MS"] = str(c.timeout_ms)
        os.environ["MC_RPC_CONNECT_TIMEOUT_MS"] = str(c.timeout_ms)
        os.environ["MC_STORE_CLIENT_SETUP_RETRIES"] = "1"
        store = MooncakeDistributedStore()
        rc = store.setup(local, c.metadata, c.segment, 0, c.protocol, c.device, c.master)
        if rc != 0:
            raise _error(
                f"mooncake: could not set up a client of master {c.master} "
                f"(metadata {c.metadata}, local host {local}): error {rc}",
                "unreachable",
            )
        self._store = store
        try:
            self._grow(c.buffer)
        except L3Error:
            self._store = None
            store.close()
            raise
        return store

    def _grow(self, size: int) -> npt.NDArray[np.uint8]:
        """Return a registered staging buffer of at least `size` bytes (on the worker)."""
        if self._staging is not None and self._staging.nbytes >= size:
            return self._staging
        if self._staging is not None:
            self._store.unregister_buffer(self._staging.ctypes.data)
            self._staging = None
        buf = np.empty(size, dtype=np.uint8)
        rc = self._store.register_buffer(buf.ctypes.data, buf.nbytes)
        if rc != 0:
            raise _error(f"mooncake: could not register a {size}-byte buffer: error {rc}")
        self._staging = buf
        return buf

    def close(self) -> None:
        """Disconnect (a later call connects again).

        Objects in a segment of this client (``segment=``) go with it. Waits for a call
        still running on the worker (one its caller gave up on) to end: no deadline.
        """
        self._worker.submit(self._close).result()

    def _close(self) -> None:
        if self._store is not None:
            if self._staging is not None:
                self._store.unregister_buffer(self._staging.ctypes.data)
                self._staging = None
            self._store.close()
            self._store = None

    def _chunks(self, n: int, width: int) -> list[tuple[int, int]]:
        """`(start, end)` runs of objects of `width` bytes that fit the staging buffer."""
        staging = self._grow(width)
        per = staging.nbytes // width
        return [(i, min(i + per, n)) for i in range(0, n, per)]

    # ------------------------------------------------------------------ the protocol

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key holds an object.

        Raises:
            L3Error: the store failed or timed out.
        """
        names = _keys(keys)
        if not names:
            return []
        return self._run(lambda: _exist(self._connected(), names))

    def put(
        self,
        keys: Sequence[bytes],
        hashes: Sequence[bytes],
        data: npt.NDArray[np.uint8],
        *,
        kind: Literal["kv", "mamba"],
        identity: bytes,
    ) -> list[bool]:
        """Store row ``i`` of `data` under ``keys[i]`` as page ``hashes[i]``, write-once.

        Each frame records `kind` and `identity` (`radixcache.l3.L3Identity.digest`).
        Per key, whether this call stored it (a key that holds an object keeps it).

        A put the store has no room for (every segment full) stores nothing and is no
        error: the tier is a hint.

        Raises:
            ValueError, TypeError: bad arguments (named).
            L3Error: the store failed or timed out.
        """
        names = _keys(keys)
        data = _rows(data, "data", len(names))
        if len(hashes) != len(names):
            raise ValueError(f"hashes: {len(hashes)} given for {len(names)} keys")
        label = _label(kind, identity)
        if not names:
            return []
        return self._run(self._put, names, hashes, data, label)

    def _put(
        self,
        names: list[str],
        hashes: Sequence[bytes],
        data: npt.NDArray[np.uint8],
        label: _Label,
    ) -> list[bool]:
        width = FRAME_HEADER_LEN + data.shape[1]
        store = self._connected()
        todo = [k for k, there in enumerate(_exist(store, names)) if not there]
        stored = [False] * len(names)
        for lo, hi in self._chunks(len(todo), width):
            rows = todo[lo:hi]
            staging = self._grow(width)
            objects = staging[: len(rows) * width].reshape(len(rows), width)
            # Rows lo..hi of `data` as they are when no key of them was present
            # (the usual case): no gather.
            run = rows == list(range(rows[0], rows[0] + len(rows)))
            payloads = data[rows[0] : rows[0] + len(rows)] if run else data[rows]
            frame_encode([hashes[k] for k in rows], payloads, objects, **label)
            base = objects.ctypes.data
            results = store.batch_put_from(
                [names[k] for k in rows],
                [base + j * width for j in range(len(rows))],
                [width] * len(rows),
            )
            for k, rc in zip(rows, results, strict=True):
                if rc == 0:
                    stored[k] = True
                elif rc != _ALREADY_EXISTS and rc not in _NO_SPACE:
                    raise _error(f"mooncake: put of {names[k]!r} failed: error {rc}")
        return stored

    def get_into(
        self,
        keys: Sequence[bytes],
        hashes: Sequence[bytes],
        out: npt.NDArray[np.uint8],
        *,
        kind: Literal["kv", "mamba"],
        identity: bytes,
    ) -> list[str]:
        """Read ``keys`` into the rows of `out`, each verified as page ``hashes[i]``'s.

        Per key ``"ok"`` (the row holds the page), ``"missing"``, ``"foreign"`` (an
        intact object of another `kind` or `identity`: removed) or ``"corrupt"`` (the
        object failed verification, or is larger than a page's, and was removed); rows
        not ``"ok"`` are left untouched.

        Raises:
            ValueError, TypeError: bad arguments (named).
            L3Error: the store failed or timed out (any row may then hold part of what
                was read).
        """
        names = _keys(keys)
        out = _rows(out, "out", len(names))
        if len(hashes) != len(names):
            raise ValueError(f"hashes: {len(hashes)} given for {len(names)} keys")
        label = _label(kind, identity)
        call = _Call()
        try:
            return self._run(self._get, names, hashes, out, label, call)
        except L3Error:
            with call.lock:  # waits for a decode into `out` under way; none starts after
                call.abandoned = True
            raise

    def _get(
        self,
        names: list[str],
        hashes: Sequence[bytes],
        out: npt.NDArray[np.uint8],
        label: _Label,
        call: _Call,
    ) -> list[str]:
        width = FRAME_HEADER_LEN + out.shape[1]
        result = ["missing"] * len(names)
        store = self._connected()
        corrupt: list[str] = []
        for lo, hi in self._chunks(len(names), width):
            staging = self._grow(width)
            objects = staging[: (hi - lo) * width].reshape(hi - lo, width)
            base = objects.ctypes.data
            sizes = store.batch_get_into(
                names[lo:hi],
                [base + j * width for j in range(hi - lo)],
                [width] * (hi - lo),
            )
            lengths = []
            for j, n in enumerate(sizes):
                if n >= 0:
                    lengths.append(min(n, width))
                    continue
                lengths.append(0)
                if n == _INVALID_PARAMS:
                    corrupt.append(names[lo + j])
                    result[lo + j] = "corrupt"
                elif n != _NOT_FOUND and n not in _NOT_READY:
                    raise _error(f"mooncake: get of {names[lo + j]!r} failed: error {n}")
            # Rows of missing objects (length 0) fail verification and stay as they
            # are; their verdicts are not read.
            with call.lock:
                if call.abandoned:
                    raise _error("mooncake: get given up on by its caller", "timeout")
                verdicts = frame_decode(list(hashes[lo:hi]), objects, lengths, out[lo:hi], **label)
            for j, verdict in enumerate(verdicts):
                if sizes[j] < 0:
                    continue
                result[lo + j] = verdict
                if verdict != "ok":
                    corrupt.append(names[lo + j])
        if corrupt:
            _remove(store, corrupt)
        return result

    def delete(self, keys: Sequence[bytes]) -> None:
        """Remove the objects under `keys` (absent ones are no error).

        Raises:
            L3Error: the store failed or timed out.
        """
        names = _keys(keys)
        if not names:
            return
        self._run(lambda: _remove(self._connected(), names))


# ---------------------------------------------------------------------- one machine


def mooncake_binary(name: str) -> str | None:
    """Return the path of Mooncake's `name` program (``mooncake_master``, ...).

    The one the ``mooncake`` package carries, else one on PATH; None when neither.
    """
    spec = importlib.util.find_spec("mooncake")
    if spec is not None and spec.submodule_search_locations:
        for d in spec.submodule_search_locations:
            p = Path(d) / name
            if p.is_file() and os.access(p, os.X_OK):
                return str(p)
    return shutil.which(name)


def _free_port() -> int:
    """Return a loopback TCP port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class LocalMooncake:
    """A Mooncake Store on this machine's loopback, for tests, benchmarks and trials.

    Starts ``mooncake_master`` (with its HTTP metadata server) and `daemons` standalone
    store daemons (``mooncake_client``) holding `segment` bytes each, on free loopback
    ports, logging into a temporary directory; `url` is the ``mooncake://`` URL of it.
    ``stop()`` (or leaving the ``with`` block) kills them; ``stop_master()`` and
    ``start_master()`` kill and restart the master alone (its index is lost with it).

    Raises:
        FileNotFoundError: ``mooncake_master`` or ``mooncake_client`` not found
            (`mooncake_binary`).
        RuntimeError: a program exited, or was not ready within `ready_s` seconds (the
            message holds the end of its log).
    """

    def __init__(
        self, *, segment: int = 512 << 20, daemons: int = 1, ready_s: float = 30.0
    ) -> None:
        master, client = mooncake_binary("mooncake_master"), mooncake_binary("mooncake_client")
        if master is None or client is None:
            raise FileNotFoundError(
                "mooncake_master/mooncake_client: not in the mooncake package nor on PATH "
                '(pip install "radixcache[mooncake]")'
            )
        self._bins = (master, client)
        self.segment = segment
        self.ready_s = ready_s
        self._dir = tempfile.TemporaryDirectory(prefix="radixcache-mooncake-")
        self.rpc_port = _free_port()
        self.metadata_port = _free_port()
        self.metrics_port = _free_port()
        self._master: subprocess.Popen[bytes] | None = None
        self._daemons: list[subprocess.Popen[bytes]] = []
        try:
            self.start_master()
            for k in range(daemons):
                self._daemons.append(self._spawn(f"daemon{k}", self._daemon_args()))
            self._wait(lambda: self.capacity() >= daemons * segment, "the daemons' segments")
        except BaseException:
            self.stop()
            raise

    @property
    def metadata(self) -> str:
        """The HTTP metadata server's URL (the master's)."""
        return f"http://127.0.0.1:{self.metadata_port}/metadata"

    @property
    def url(self) -> str:
        """The ``mooncake://`` URL of this store (`MooncakeStore`'s)."""
        return f"mooncake://127.0.0.1:{self.rpc_port}?metadata={self.metadata}&host=127.0.0.1"

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = open(Path(self._dir.name) / f"{name}.log", "ab")  # noqa: SIM115 (the child's)
        with log:
            return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)

    def _daemon_args(self) -> list[str]:
        return [
            self._bins[1],
            f"--master_server_address=127.0.0.1:{self.rpc_port}",
            f"--metadata_server={self.metadata}",
            "--host=127.0.0.1",
            f"--port={_free_port()}",
            f"--global_segment_size={self.segment}",
            "--protocol=tcp",
            "--logtostderr",
        ]

    def start_master(self) -> None:
        """Start the master (when it is not running) and wait until it serves."""
        if self._master is not None:
            return
        self._master = self._spawn(
            "master",
            [
                self._bins[0],
                "--rpc_address=127.0.0.1",
                f"--rpc_port={self.rpc_port}",
                "--enable_http_metadata_server=true",
                "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={self.metadata_port}",
                "--metrics_host=127.0.0.1",
                f"--metrics_port={self.metrics_port}",
                "--logtostderr",
            ],
        )
        self._wait(self._master_ready, "the master")

    def _master_ready(self) -> bool:
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.metrics_port}/health", timeout=0.5
            ) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def capacity(self) -> int:
        """Return the bytes of memory mounted in the store (0 when the master is down)."""
        m = re.search(r"^master_total_capacity_bytes (\d+)", self._metrics(), re.MULTILINE)
        return int(m.group(1)) if m else 0

    def keys(self) -> int:
        """Return how many objects the master indexes (-1 when it does not answer)."""
        m = re.search(r"^master_key_count (\d+)", self._metrics(), re.MULTILINE)
        return int(m.group(1)) if m else -1

    def _metrics(self) -> str:
        """Return the master's Prometheus metrics ("" when it does not answer)."""
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=0.5
            ) as r:
                return str(r.read().decode())
        except OSError:
            return ""

    def _wait(self, ready: Any, what: str) -> None:
        deadline = time.monotonic() + self.ready_s
        while not ready():
            for name, p in [("master", self._master), *(("daemon", d) for d in self._daemons)]:
                if p is not None and p.poll() is not None:
                    raise RuntimeError(f"mooncake: the {name} exited ({p.returncode}){self._log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"mooncake: {what} not ready in {self.ready_s} s{self._log()}")
            time.sleep(0.05)

    def _log(self) -> str:
        return "".join(
            f"\n{f.name}: " + f.read_text(errors="replace")[-800:]
            for f in sorted(Path(self._dir.name).glob("*.log"))
        )

    def stop_master(self) -> None:
        """Kill the master (the daemons keep running and mount again when it is back)."""
        if self._master is not None:
            self._master.kill()
            self._master.wait()
            self._master = None

    def stop(self) -> None:
        """Kill everything it started and remove its directory."""
        for p in self._daemons:
            p.kill()
            p.wait()
        self._daemons = []
        self.stop_master()
        self._dir.cleanup()

    def __enter__(self) -> LocalMooncake:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
