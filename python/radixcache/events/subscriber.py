"""The reference subscriber: a router's `RouterIndex` kept up to date from a worker's events."""

from __future__ import annotations

import hashlib
import time
from collections import deque
from typing import TYPE_CHECKING

from .chain import Format, _check_format
from .codec import _MISSING, EventDecodeError, decode_batch
from .index import RouterIndex, SequenceGap
from .transport import _open, _replay_frames, logger

if TYPE_CHECKING:
    import zmq

#: Digests of replayed batches a subscriber keeps at most (16 bytes each); only those whose
#: live copy has not passed yet are kept, so this bounds a router that never polls.
_REPLAYED_KEPT = 16_384


def _digest(payload: bytes) -> bytes:
    """Return what a subscriber keeps of a batch to know it again (the same bytes)."""
    return hashlib.blake2b(payload, digest_size=16).digest()


class _PublisherRestarted(Exception):
    """A replay showed that the publisher is not the one the index follows (the reason)."""


class KvEventSubscriber:
    """A reference router-side consumer: SUB socket, replay on join and on gaps, an index.

    Connects a SUB socket to `endpoint` (subscribed to `topic`) and, with
    `replay_endpoint`, a DEALER socket to the publisher's replay socket. `catch_up` asks
    for every batch from ``index.next_seq`` on (a late joiner calls it once after
    construction: the SUB socket is subscribed first, so nothing falls between); `poll`
    applies live batches in order, skipping any already applied (by sequence number) and
    filling a gap from the replay socket. A gap the replay buffer cannot fill raises
    `SequenceGap`. Not thread-safe: one thread per subscriber.

    A message that cannot be decoded never stops the subscriber (docs/events.md,
    "Batches that cannot be decoded"): it is logged (a warning on ``radixcache.events``),
    counted in `decode_errors`, kept as `last_decode_error` (with ``seq`` where known)
    and skipped. A batch whose payload cannot be decoded is lost, and the index starts
    over, empty, at the batch after it (``index.reset(seq + 1)``): it under-claims the
    worker's cache until the pages are stored again, and never claims a page that the
    lost batch removed; its number joins `skipped_seqs`. A message whose frames carry no
    readable sequence number is dropped without touching the index, and the gap it
    leaves is met like any other: live, the replay socket fills it; in a replay,
    `catch_up` raises `SequenceGap` and `resync` starts the index over after it.

    A publisher that restarts (its worker restarted: numbers from 0 again, an empty cache)
    never leaves the index stuck on batches it takes for duplicates (docs/events.md, "A
    publisher that restarts"). The subscriber knows it by a live batch numbered at or
    below the previous live one (one publisher's stream only goes up), by a live batch
    that is not byte for byte the one a replay brought under its number, or, in
    `catch_up` (and so on every gap), by the publisher no longer holding, byte for byte,
    the last batch the index applied. It then counts it in `publisher_restarts`, logs a
    warning and starts the index over: from everything the new publisher buffers
    (`resync`), or, without a replay socket, empty at the batch that showed it.
    """

    #: How many of the latest skipped sequence numbers `skipped_seqs` keeps.
    SKIPPED_KEPT = 64

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        format: Format = "sglang",
        index: RouterIndex | None = None,
    ) -> None:
        """Connect (ZMQ connects lazily: the publisher may start later)."""
        _check_format(format)
        if not isinstance(topic, str):
            raise TypeError(f"topic must be a str, got {type(topic).__name__}")
        if index is not None and index.format != format:
            raise ValueError(f"index: its format is {index.format!r}, not {format!r}")
        try:
            import zmq
        except ImportError as exc:
            raise ImportError(_MISSING.format("pyzmq")) from exc
        self.format: Format = format
        self.index = index if index is not None else RouterIndex(format)
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        #: Batches applied from the live socket, from replays, and live ones skipped as
        #: already applied (a replay had brought them).
        self.live_batches = 0
        self.replayed_batches = 0
        self.duplicates = 0
        #: Messages skipped because they could not be decoded (a batch met again in a
        #: later replay is skipped again but counted once), and the latest one's error.
        self.decode_errors = 0
        self.last_decode_error: EventDecodeError | None = None
        self._skipped: deque[int] = deque(maxlen=self.SKIPPED_KEPT)
        #: Times the publisher was found restarted (the index started over each time).
        self.publisher_restarts = 0
        # The number of the last live message; the (seq, digest) of the last batch applied
        # or skipped (checked against the publisher by `catch_up`); the digests of
        # replayed batches whose live copy may still come (a duplicate is the same bytes).
        self._last_live: int | None = None
        self._anchor: tuple[int, bytes] | None = None
        self._replayed: dict[int, bytes] = {}
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
            _open(self._sub, endpoint, "endpoint", bind=False)
            if replay_endpoint is not None:
                self._replay = self._dealer(replay_endpoint)
        except BaseException:
            self._close_sockets()
            raise

    @property
    def skipped_seqs(self) -> tuple[int, ...]:
        """The sequence numbers of the latest batches skipped as undecodable, oldest first.

        At most `SKIPPED_KEPT` of them; each batch once; since the publisher's last
        restart (the numbers start again with it).
        """
        return tuple(self._skipped)

    def _dealer(self, endpoint: str) -> zmq.Socket[bytes]:
        import zmq

        sock = self._ctx.socket(zmq.DEALER)
        try:
            _open(sock, endpoint, "replay_endpoint", bind=False)
        except BaseException:
            sock.close(linger=0)
            raise
        return sock

    def catch_up(self, timeout: float = 5.0) -> int:
        """Replay every buffered batch from ``index.next_seq`` on; return how many applied.

        The request starts one batch earlier, at the last batch the index applied, when
        the subscriber has it: a publisher that answers without that batch, byte for
        byte, has restarted, and the index starts over from what it buffers (counted in
        `publisher_restarts`, as `resync`). When that batch has left the publisher's
        buffer there is nothing to compare: the replay goes on unchecked.

        A replayed batch that cannot be decoded is skipped (see the class docstring).
        Raises `SequenceGap` when the oldest batch the publisher still holds is past the
        one needed (nothing past the gap is applied), TimeoutError when the end marker
        does not come within `timeout` seconds, RuntimeError without a replay endpoint.
        """
        start = self.index.next_seq
        anchor = self._anchor
        if anchor is None or anchor[0] != start - 1:
            anchor = None  # nothing applied yet, or the router reset the index
        try:
            return self._replay_from(start if anchor is None else anchor[0], timeout, anchor)
        except _PublisherRestarted as restart:
            return self._restarted(str(restart), f"catch_up from {self.replay_endpoint}", timeout)

    def resync(self, timeout: float = 5.0) -> int:
        """Rebuild the index from every batch the publisher still buffers, after a gap.

        Clears the index and applies the buffered batches from the oldest on (the index
        continues from there). Pages and states stored before the oldest buffered batch
        are unknown to it: the index may under-report a worker's cache, never over-report
        it. A batch that cannot be decoded, or a message of the replay that cannot be read,
        makes the index start over after it, as in `poll`: a resync never fails on what it
        reads. Returns how many batches were applied; raises TimeoutError and RuntimeError
        as `catch_up`.
        """
        self.index.reset()
        self._replayed.clear()
        return self._replay_from(0, timeout, None, resync=True)

    def _replay_from(
        self,
        start: int,
        timeout: float,
        anchor: tuple[int, bytes] | None,
        *,
        resync: bool = False,
    ) -> int:
        """Ask for the batches from `start` on and apply them; return how many applied.

        `anchor`: ``(seq, digest)`` of the last batch applied, with ``start == seq``: the
        answer must bring that batch, the same bytes, else `_PublisherRestarted`.
        """
        caller = "resync" if resync else "catch_up"
        endpoint = self.replay_endpoint
        if self._replay is None or endpoint is None:
            raise RuntimeError(f"{caller}: this subscriber has no replay_endpoint")
        where = f"{caller} from {endpoint}"
        sock = self._replay
        first = True
        applied = 0
        try:
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = time.monotonic() + timeout
            while True:
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0 or not sock.poll(left_ms):
                    raise TimeoutError(
                        f"{caller}: no end of replay from {endpoint} within {timeout} s"
                    )
                try:
                    seq, payload = _replay_frames(sock.recv_multipart())
                except EventDecodeError as exc:
                    self._skip(exc, None, where)
                    continue
                if anchor is not None and (seq == -1 or seq >= anchor[0]):
                    if seq == -1:
                        raise _PublisherRestarted(
                            f"it holds no batch from {anchor[0]} on, the last one applied"
                        )
                    if seq == anchor[0] and _digest(payload) != anchor[1]:
                        raise _PublisherRestarted(
                            f"its batch {seq} is not the batch {seq} the index applied"
                        )
                    # Checked; or gone from its buffer, and nothing to check it against.
                    verified, anchor = seq == anchor[0], None
                    if verified:
                        continue
                if seq == -1:
                    return applied
                if resync and (first or seq > self.index.next_seq):
                    # The oldest batch buffered, or the first after a message that could
                    # not be read: the index starts there.
                    self.index.reset(seq)
                first = False
                if seq < self.index.next_seq:
                    continue
                if seq > self.index.next_seq:
                    raise SequenceGap(self.index.next_seq, seq)
                if self._apply(seq, payload, where, replayed=True):
                    applied += 1
                    self.replayed_batches += 1
        except BaseException:
            # The rest of this answer must not be read as the next request's: a new socket.
            sock.close(linger=0)
            self._replay = None
            self._replay = self._dealer(endpoint)
            raise

    def _restarted(self, reason: str, where: str, timeout: float, seq: int | None = None) -> int:
        """Count, log and recover from a restart of the publisher: start the index over.

        From everything the publisher buffers (`resync`; returns how many applied), or,
        without a replay socket, empty at live batch `seq`, the one that showed it.
        """
        self.publisher_restarts += 1
        self._skipped.clear()  # its numbers name the old publisher's batches
        self._replayed.clear()
        self._anchor = None
        if self._replay is None and seq is not None:
            logger.warning(
                "kv events: %s: the publisher restarted (%s); the index starts over, "
                "empty, at batch %d",
                where,
                reason,
                seq,
            )
            self.index.reset(seq)
            return 0
        logger.warning(
            "kv events: %s: the publisher restarted (%s); the index starts over from "
            "every batch it buffers",
            where,
            reason,
        )
        return self.resync(timeout)

    def poll(self, timeout: float = 0.0) -> int:
        """Apply the live batches that arrived (waiting up to `timeout` s for the first).

        Returns how many batches were applied (replayed ones included). A message that
        cannot be decoded is skipped; a batch that shows that the publisher restarted
        starts the index over from the new publisher's batches (see the class
        docstring). Raises `SequenceGap` for a gap that cannot be filled (call `resync`),
        TimeoutError when the replay socket does not answer.
        """
        applied = 0
        wait_ms = max(0, int(timeout * 1000))
        while self._sub.poll(wait_ms):
            wait_ms = 0
            frames = self._sub.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                error = EventDecodeError(
                    "live message: expected [topic, seq (8 bytes), payload], "
                    f"got {len(frames)} frames"
                    + (f" (seq of {len(frames[1])} bytes)" if len(frames) == 3 else "")
                )
                self._skip(error, None, f"live from {self.endpoint}")
                continue
            seq = int.from_bytes(frames[1], "big")
            restart = self._restart_shown(seq, frames[2])
            self._last_live = seq
            if restart is not None:
                applied += self._restarted(restart, f"live from {self.endpoint}", 5.0, seq)
            self._forget_replayed(seq)
            if seq > self.index.next_seq:
                if self._replay is None:
                    raise SequenceGap(self.index.next_seq, seq)
                applied += self.catch_up()
            if seq < self.index.next_seq:
                self.duplicates += 1
                continue
            if seq > self.index.next_seq:  # the replay does not hold it
                raise SequenceGap(self.index.next_seq, seq)
            if self._apply(seq, frames[2], f"live from {self.endpoint}"):
                applied += 1
                self.live_batches += 1
        return applied

    def _restart_shown(self, seq: int, payload: bytes) -> str | None:
        """Why live batch `seq` shows that the publisher restarted; None if it does not."""
        last = self._last_live
        if last is not None and seq <= last:
            return f"live batch {seq} came after live batch {last}"
        if seq < self.index.next_seq:
            replayed = self._replayed.get(seq)
            if replayed is not None and replayed != _digest(payload):
                return f"live batch {seq} is not the batch {seq} a replay brought"
        return None

    def _forget_replayed(self, seq: int) -> None:
        """Drop the digests of replayed batches up to `seq`: no live copy of them can come."""
        replayed = self._replayed
        while replayed:
            oldest = next(iter(replayed))
            if oldest > seq:
                return
            del replayed[oldest]

    def _apply(self, seq: int, payload: bytes, where: str, *, replayed: bool = False) -> bool:
        """Decode and apply batch `seq` (the index's next); skip it if it cannot be decoded.

        Returns whether it was applied. Either way it becomes the anchor `catch_up`
        checks; a `replayed` one's digest is kept until its live copy has passed.
        """
        digest = _digest(payload)
        self._anchor = (seq, digest)
        if replayed:
            self._replayed[seq] = digest
            if len(self._replayed) > _REPLAYED_KEPT:
                del self._replayed[next(iter(self._replayed))]
        try:
            batch = decode_batch(payload, format=self.format)
        except EventDecodeError as exc:
            self._skip(exc, seq, where)
            # Its events are lost: what it removed may still be in the index. Start over
            # after it: the index under-claims from here on, never over-claims.
            self.index.reset(seq + 1)
            return False
        return self.index.apply(seq, batch)

    def _skip(self, exc: EventDecodeError, seq: int | None, where: str) -> None:
        """Record and log a message skipped as undecodable (batch `seq`, where known)."""
        if seq is not None and seq in self._skipped:
            return  # met again in a replay: skipped again, counted once
        name = "a message" if seq is None else f"batch {seq}"
        error = EventDecodeError(f"{where}: {name} cannot be decoded: {exc}", seq)
        error.__cause__ = exc
        self.decode_errors += 1
        self.last_decode_error = error
        if seq is None:
            logger.warning("kv events: %s; skipped", error)
        else:
            self._skipped.append(seq)
            logger.warning(
                "kv events: %s; skipped: the index starts over, empty, at batch %d", error, seq + 1
            )

    def close(self) -> None:
        """Close the sockets (idempotent)."""
        self._close_sockets()

    def _close_sockets(self) -> None:
        if self._ctx.closed:
            return
        self._sub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> KvEventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
