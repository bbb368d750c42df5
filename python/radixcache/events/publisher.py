"""The publisher: the cache's events on a ZMQ PUB socket, with a replay socket, as SGLang does."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

from .chain import Format, _check_format
from .codec import _MISSING, CacheEvent, encode_batch
from .transport import _END_SEQ, _last_endpoint, _open, logger

if TYPE_CHECKING:
    import zmq

_POLL_MS = 50
_CLOSE_LINGER_MS = 200


class KvEventPublisher:
    """Publish the cache's events as SGLang (or vLLM) does: ZMQ PUB plus a replay socket.

    Each `publish` sends one batch as the multipart message ``[topic, seq, payload]``
    (``seq`` 8 bytes big-endian, from 0, +1 per batch) and keeps it in a replay buffer of
    the last `buffer_steps` batches. The ROUTER socket on `replay_endpoint` (None: no
    replay) answers a request ``[b"", start]`` (``start`` 8 bytes big-endian) with
    ``[b"", topic, seq, payload]`` for every buffered batch from ``start`` on, then the end
    marker ``[b"", b"", -1, b""]`` (-1 as 8 signed bytes): SGLang's and vLLM's protocol.
    A background thread serves replays.

    The PUB socket binds `endpoint` (``bind=False``: connects to it, e.g. to a forwarder);
    ``tcp://HOST:*`` binds a free port (`endpoint` then reports it). Thread safety:
    `publish` may be called from any thread (a lock orders batches), but the events of a
    cache must be published in the order ``take_events()`` returned them, so take and
    publish from one thread (the scheduler's, after each step).
    """

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = "tcp://*:5558",
        *,
        topic: str = "",
        format: Format = "sglang",
        buffer_steps: int = 10_000,
        dp_rank: int = 0,
        hwm: int = 100_000,
        bind: bool = True,
    ) -> None:
        """Open the sockets (binding now: a busy port raises here) and start the replay thread.

        Raises ValueError naming the argument for a bad value or an endpoint ZMQ refuses,
        ImportError when pyzmq or msgpack is not installed.
        """
        _check_format(format)
        if not isinstance(topic, str):
            raise TypeError(f"topic must be a str, got {type(topic).__name__}")
        for name, value, low in (
            ("buffer_steps", buffer_steps, 1),
            ("dp_rank", dp_rank, 0),
            ("hwm", hwm, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        try:
            import msgpack  # noqa: F401  (checked now rather than at the first publish)
        except ImportError as exc:
            raise ImportError(_MISSING.format("msgpack")) from exc
        try:
            import zmq
        except ImportError as exc:
            raise ImportError(_MISSING.format("pyzmq")) from exc
        self.format: Format = format
        self.topic = topic
        self.dp_rank = dp_rank
        self._topic = topic.encode("utf-8")
        self._lock = threading.Lock()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._closed = False
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            _open(self._pub, endpoint, "endpoint", bind=bind)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                _open(self._replay, replay_endpoint, "replay_endpoint", bind=True)
        except BaseException:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)
            self._ctx.term()
            raise
        self._endpoint = _last_endpoint(self._pub, endpoint)
        self._replay_endpoint = (
            None
            if self._replay is None or replay_endpoint is None
            else _last_endpoint(self._replay, replay_endpoint)
        )
        self._thread: threading.Thread | None = None
        if self._replay is not None:
            self._thread = threading.Thread(
                target=self._serve_replay,
                args=(self._replay,),
                name="radixcache-kv-replay",
                daemon=True,
            )
            self._thread.start()

    @property
    def endpoint(self) -> str:
        """The PUB socket's address (the bound port when `endpoint` asked for any)."""
        return self._endpoint

    @property
    def replay_endpoint(self) -> str | None:
        """The replay socket's bound address, None without one."""
        return self._replay_endpoint

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch will carry."""
        return self._seq

    def publish(self, events: Iterable[CacheEvent]) -> int | None:
        """Send `events` (oldest first) as one batch; return its sequence number.

        An empty list sends nothing and returns None. Invalid events raise (see
        `encode_batch`) before anything is sent or a number used. RuntimeError once closed.
        """
        items = list(events)
        with self._lock:
            if self._closed:
                raise RuntimeError("publish: the publisher is closed")
            if not items:
                return None
            payload = encode_batch(items, format=self.format, dp_rank=self.dp_rank)
            seq = self._seq
            self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload])
            self._buffer.append((seq, payload))
            self._seq = seq + 1
        return seq

    def close(self) -> None:
        """Stop the replay thread and close the sockets (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join()  # it closes the replay socket
        # Unsent messages get a moment to leave (a subscriber mid-read keeps its batches).
        self._pub.close(linger=_CLOSE_LINGER_MS)
        self._ctx.term()

    def __enter__(self) -> KvEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _serve_replay(self, sock: zmq.Socket[bytes]) -> None:
        """Answer replay requests until `close` (the thread owns `sock`)."""
        try:
            while not self._stop.is_set():
                if sock.poll(_POLL_MS):
                    self._answer(sock, sock.recv_multipart())
        finally:
            sock.close(linger=0)

    def _answer(self, sock: zmq.Socket[bytes], frames: list[bytes]) -> None:
        if len(frames) != 3 or frames[1] != b"":
            logger.warning("kv events replay: ignored a request of %d frames", len(frames))
            return
        client, _, start_bytes = frames
        if len(start_bytes) == 8:
            start = int.from_bytes(start_bytes, "big")
            with self._lock:
                batches = [(seq, payload) for seq, payload in self._buffer if seq >= start]
            for seq, payload in batches:
                sock.send_multipart([client, b"", self._topic, seq.to_bytes(8, "big"), payload])
        else:
            logger.warning("kv events replay: the start is %d bytes, not 8", len(start_bytes))
        sock.send_multipart([client, b"", b"", _END_SEQ, b""])
