"""What the publisher and the subscriber share of ZMQ: opening a socket, the replay's frames.

The replay protocol (SGLang's and vLLM's): a request ``[b"", start]``, answered with
``[b"", topic, seq, payload]`` per batch and the end marker ``[b"", b"", -1, b""]``.
pyzmq is imported when a socket is opened.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .codec import EventDecodeError

if TYPE_CHECKING:
    import zmq

#: The logger of the KV events (``radixcache.events``, as docs/events.md names it).
logger = logging.getLogger("radixcache.events")

#: The replay socket's end-of-replay marker, as SGLang and vLLM send it: sequence -1.
_END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _open(sock: zmq.Socket[bytes], address: str, name: str, *, bind: bool) -> None:
    import zmq

    if not isinstance(address, str):
        raise TypeError(f"{name} must be a str, got {type(address).__name__}")
    try:
        if bind:
            sock.bind(address)
        else:
            sock.connect(address)
    except zmq.ZMQError as exc:
        verb = "bind" if bind else "connect to"
        raise ValueError(f"{name}: cannot {verb} {address!r}: {exc}") from exc


def _last_endpoint(sock: zmq.Socket[bytes], asked: str) -> str:
    import zmq

    bound = sock.getsockopt(zmq.LAST_ENDPOINT)
    return bound.decode() if isinstance(bound, bytes) and bound else asked


def _replay_frames(frames: list[bytes]) -> tuple[int, bytes]:
    """Return ``(seq, payload)`` of a replay answer (seq -1: the end marker).

    ``[b"", topic, seq, payload]`` (SGLang 0.5.23, current vLLM) or ``[b"", seq, payload]``
    (older vLLM). Raises `EventDecodeError` for another shape or a negative sequence
    number other than the end marker's.
    """
    if frames and frames[0] == b"":
        frames = frames[1:]
    if len(frames) == 3:
        frames = frames[1:]
    if len(frames) != 2 or len(frames[0]) != 8:
        raise EventDecodeError(
            f"replay message: expected [topic, seq, payload], got {len(frames)} frames"
        )
    seq = int.from_bytes(frames[0], "big", signed=True)
    if seq < -1:
        raise EventDecodeError(f"replay message: sequence number {seq} is negative")
    return seq, frames[1]
