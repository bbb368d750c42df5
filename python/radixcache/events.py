"""KV events for cache-aware routers: page hashes, wire encoders, a publisher and a subscriber.

A router that knows which prompt prefixes each worker holds can send a returning
conversation to the worker that has its cache. SGLang and vLLM tell routers through *KV
events*: batches of "these pages were stored / removed / everything was cleared",
msgpack-encoded and published on a ZMQ PUB socket with a sequence number, with a ROUTER
socket that replays recent batches to a subscriber that joined late or lost some.
This module speaks both wire formats (``format="sglang"``, SGLang 0.5.23's, or
``format="vllm"``) so that existing routers index a radixcache worker unchanged, and adds
what neither engine publishes: where a hybrid model's recurrent (Mamba) state exists, the
only places a hybrid prefix hit is usable (docs/events.md, "State availability").

- `page_hashes` and `sglang_namespace_seed`: the page hash chain (SGLang HiCache's), pure
  Python, so that a router computes a prompt's hashes itself.
- `encode_batch` / `decode_batch`: one batch of events to and from the wire bytes.
- `KvEventPublisher`: the PUB socket, sequence numbers, the replay buffer and socket.
- `RouterIndex` and `KvEventSubscriber`: the reference consumer: per tier, which pages
  are present and which carry a state; `RouterIndex.usable_prefix` answers how much of a
  prompt a worker would reuse.

The publisher and the subscriber need the optional dependencies pyzmq and msgpack
(``pip install "radixcache[events]"``); they are imported only when used, so importing
this module (and `radixcache`) needs neither.
"""

from __future__ import annotations

import hashlib
import logging
import sys
import threading
import time
from array import array
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    import zmq

__all__ = [
    "KINDS",
    "MEDIA",
    "STATE_HASHES_KEY",
    "STATE_KEY",
    "CacheEvent",
    "DecodedBatch",
    "DecodedEvent",
    "EventDecodeError",
    "Format",
    "KvEventPublisher",
    "KvEventSubscriber",
    "RouterIndex",
    "SequenceGap",
    "decode_batch",
    "encode_batch",
    "page_hashes",
    "sglang_namespace_seed",
    "wire_hash",
]

logger = logging.getLogger(__name__)

#: The wire formats: SGLang 0.5.23's and vLLM's (docs/events.md, "Formats").
Format = Literal["sglang", "vllm"]
FORMATS: tuple[str, ...] = ("sglang", "vllm")

#: The kinds of event the cache emits, in `CacheEvent.kind`.
KINDS: tuple[str, ...] = ("stored", "removed", "cleared", "state_stored", "state_removed")

#: The cache's tiers, in `CacheEvent.medium`: the device tier, the host tier, the L3 store.
MEDIA: tuple[str, ...] = ("GPU", "CPU_PINNED", "EXTERNAL")

#: Length of a page hash (sha256).
HASH_LEN = 32

#: Keys that a state event adds to its carrier (a ``BlockRemoved`` of no blocks, which every
#: SGLang or vLLM consumer decodes and applies as a no-op): ``"stored"`` or ``"removed"``,
#: and the wire hashes of the pages at whose end the state became available or unavailable.
STATE_KEY = "radixcache_state"
STATE_HASHES_KEY = "radixcache_state_hashes"

#: The replay socket's end-of-replay marker, as SGLang and vLLM send it: sequence -1.
_END_SEQ = (-1).to_bytes(8, "big", signed=True)

#: Tier names on the wire per format, and back. vLLM names the host tier ``CPU`` and an
#: external store ``STORAGE``; SGLang uses radixcache's names.
_MEDIUM_OUT: dict[str, dict[str, str]] = {
    "sglang": {"GPU": "GPU", "CPU_PINNED": "CPU_PINNED", "EXTERNAL": "EXTERNAL"},
    "vllm": {"GPU": "GPU", "CPU_PINNED": "CPU", "EXTERNAL": "STORAGE"},
}
_MEDIUM_IN: dict[str, dict[str, str]] = {
    fmt: {wire: ours for ours, wire in table.items()} for fmt, table in _MEDIUM_OUT.items()
}

_U32_MAX = 0xFFFF_FFFF
_U64_MASK = (1 << 64) - 1
_MISSING = 'radixcache.events needs {} for this: pip install "radixcache[events]"'


class CacheEvent(Protocol):
    """One event from ``HybridCache.take_events()`` (the attributes this module reads).

    ``kind``: one of `KINDS`. ``medium``: one of `MEDIA` (ignored by ``"cleared"``, which
    clears every tier). ``namespace``: the cache's namespace (a LoRA adapter or cache-salt
    name), None for the default one. ``hashes``: 32-byte page hashes, parents first; for
    ``"state_stored"``/``"state_removed"`` exactly one: the page at whose end the state
    became available/unavailable. ``parent_hash``: the hash of the page before
    ``hashes[0]`` (None for a namespace's first page). ``token_ids``: ``"stored"`` only,
    the pages' tokens (``len(hashes) * block_size`` of them). ``block_size``: the page size.
    """

    @property
    def kind(self) -> str:
        """See the class docstring."""

    @property
    def medium(self) -> str:
        """See the class docstring."""

    @property
    def namespace(self) -> str | None:
        """See the class docstring."""

    @property
    def hashes(self) -> Sequence[bytes]:
        """See the class docstring."""

    @property
    def parent_hash(self) -> bytes | None:
        """See the class docstring."""

    @property
    def token_ids(self) -> Sequence[int]:
        """See the class docstring."""

    @property
    def block_size(self) -> int:
        """See the class docstring."""


class EventDecodeError(ValueError):
    """A payload or frame that is not an event batch of the expected format.

    ``seq``: the sequence number of the batch, where known (a `KvEventSubscriber` sets it
    on the errors it records; `decode_batch` alone does not know it: None).
    """

    def __init__(self, message: str, seq: int | None = None) -> None:
        super().__init__(message)
        self.seq = seq


class SequenceGap(RuntimeError):
    """Batches were lost: the index can no longer equal the publisher's cache.

    ``expected`` is the sequence number the index needed next, ``received`` the one that
    came. A subscriber with a replay socket fills gaps itself; this is raised when the
    replay buffer no longer holds the missing batches (or there is no replay socket). A
    router then drops the worker's index and rebuilds it (a new subscriber).
    """

    def __init__(self, expected: int, received: int) -> None:
        self.expected = expected
        self.received = received
        super().__init__(
            f"sequence gap: expected batch {expected}, received {received} "
            f"({received - expected} lost)"
        )


# --------------------------------------------------------------------------- page hashes


def page_hashes(tokens: Iterable[int], page_size: int, seed: bytes | None = None) -> list[bytes]:
    """Return the chained sha256 hash of every full page of `tokens`.

    ``H_0 = sha256(seed || page_0)``, ``H_i = sha256(H_{i-1} || page_i)``, each page's
    tokens as unsigned 32-bit little-endian integers; without a seed the first page is
    hashed alone. This is SGLang HiCache's page hash chain; a leftover partial page is not
    hashed. `seed` is a namespace's seed (32 bytes, e.g. `sglang_namespace_seed`).

    Raises ValueError naming `page_size`, `seed` or `tokens` (a token outside
    ``0..2**32-1``), TypeError naming `tokens` for a non-integer token.
    """
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
    if seed is not None and (not isinstance(seed, bytes) or len(seed) != HASH_LEN):
        raise ValueError(f"seed must be None or {HASH_LEN} bytes, got {seed!r}")
    words = _u32_tokens(tokens)
    if sys.byteorder != "little":
        words.byteswap()
    raw = words.tobytes()
    stride = page_size * 4
    out: list[bytes] = []
    prior = seed
    for start in range(0, len(raw) - stride + 1, stride):
        digest = hashlib.sha256()
        if prior is not None:
            digest.update(prior)
        digest.update(raw[start : start + stride])
        prior = digest.digest()
        out.append(prior)
    return out


def _u32_tokens(tokens: Iterable[int]) -> array[int]:
    """`tokens` as an ``array('I')`` (4-byte items), with an error naming the bad token."""
    items = tokens if isinstance(tokens, Sequence) else list(tokens)
    try:
        return array("I", items)
    except TypeError as exc:
        raise TypeError(f"tokens must be integers: {exc}") from None
    except OverflowError:
        i, bad = next((i, int(t)) for i, t in enumerate(items) if not 0 <= int(t) <= _U32_MAX)
        raise ValueError(f"tokens[{i}] = {bad} is outside the u32 range 0..{_U32_MAX}") from None


def sglang_namespace_seed(extra_key: str | None, cache_salt: str | None) -> bytes | None:
    r"""Return the seed SGLang's storage chains start from for (`extra_key`, `cache_salt`).

    None when both are None (the chain is unseeded). Otherwise the 32-byte sha256 of the
    tag ``b"sglang-cache-namespace-v1"`` followed, for each of the two parts in turn, by
    ``b"\x00"`` when it is None, else ``b"\x01"``, its UTF-8 length as 8 little-endian
    bytes, and its UTF-8 bytes (SGLang 0.5.23's ``storage_namespace_seed``, as bytes).
    """
    if extra_key is None and cache_salt is None:
        return None
    digest = hashlib.sha256(b"sglang-cache-namespace-v1")
    for name, part in (("extra_key", extra_key), ("cache_salt", cache_salt)):
        if part is None:
            digest.update(b"\x00")
            continue
        if not isinstance(part, str):
            raise TypeError(f"{name} must be a str or None, got {type(part).__name__}")
        encoded = part.encode("utf-8")
        digest.update(b"\x01" + len(encoded).to_bytes(8, "little") + encoded)
    return digest.digest()


def wire_hash(page_hash: bytes, format: Format = "sglang") -> int:
    """Return the 64-bit integer that stands for `page_hash` in `format`'s events.

    SGLang: the first 8 bytes as a signed big-endian integer (the first 16 hex digits of
    the digest, as SGLang's ``hash_str_to_int64``). vLLM: the low 64 bits of the digest as
    a big-endian unsigned integer (vLLM's integer block hashes, its default).
    """
    _check_format(format)
    if not isinstance(page_hash, bytes) or len(page_hash) != HASH_LEN:
        raise ValueError(f"page_hash must be {HASH_LEN} bytes, got {page_hash!r}")
    return _wire(page_hash, format)


def _wire(page_hash: bytes, format: str) -> int:
    if format == "sglang":
        return int.from_bytes(page_hash[:8], "big", signed=True)
    return int.from_bytes(page_hash, "big") & _U64_MASK


def _check_format(format: object) -> None:
    if format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")


# --------------------------------------------------------------------------- encoding


def encode_batch(
    events: Iterable[CacheEvent],
    *,
    format: Format = "sglang",
    ts: float | None = None,
    dp_rank: int | None = 0,
) -> bytes:
    """Encode `events` (oldest first) as one msgpack event batch in `format`.

    The batch is the array ``[ts, events, dp_rank]`` (SGLang's ``KVEventBatch`` with
    ``attn_dp_rank``, vLLM's with ``data_parallel_rank``); each event a map tagged by
    ``"type"`` (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``) with the fields in
    the engine's order, so the engine's own decoder reads it. State events travel as a
    ``BlockRemoved`` of no blocks carrying `STATE_KEY` and `STATE_HASHES_KEY`. `ts`
    defaults to ``time.time()``.

    Raises ValueError (TypeError for a wrong type) naming the event, e.g.
    ``events[2].medium``.
    """
    _check_format(format)
    if dp_rank is not None and (isinstance(dp_rank, bool) or not isinstance(dp_rank, int)):
        raise TypeError(f"dp_rank must be an int or None, got {dp_rank!r}")
    wire = [_wire_event(event, i, format) for i, event in enumerate(events)]
    stamp = time.time() if ts is None else float(ts)
    return _packb([stamp, wire, dp_rank])


def _packb(obj: object) -> bytes:
    try:
        import msgpack
    except ImportError as exc:
        raise ImportError(_MISSING.format("msgpack")) from exc
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


def _wire_event(event: CacheEvent, i: int, format: str) -> dict[str, Any]:
    where = f"events[{i}]"
    kind = event.kind
    if kind == "cleared":
        return {"type": "AllBlocksCleared"}
    if kind not in KINDS:
        raise ValueError(f"{where}.kind must be one of {', '.join(KINDS)}, got {kind!r}")
    medium = event.medium
    if medium not in MEDIA:
        raise ValueError(f"{where}.medium must be one of {', '.join(MEDIA)}, got {medium!r}")
    wire_medium = _MEDIUM_OUT[format][medium]
    hashes = [_event_hash(h, f"{where}.hashes[{j}]", format) for j, h in enumerate(event.hashes)]
    if not hashes:
        raise ValueError(f"{where}.hashes is empty: a {kind!r} event names at least one page")
    if kind == "removed":
        return {"type": "BlockRemoved", "block_hashes": hashes, "medium": wire_medium}
    if kind in ("state_stored", "state_removed"):
        if len(hashes) != 1:
            raise ValueError(
                f"{where}.hashes has {len(hashes)} hashes: a {kind!r} event names exactly one "
                "page (the one at whose end the state is)"
            )
        return {
            "type": "BlockRemoved",
            "block_hashes": [],
            "medium": wire_medium,
            STATE_KEY: "stored" if kind == "state_stored" else "removed",
            STATE_HASHES_KEY: hashes,
        }
    return _wire_stored(event, where, format, hashes, wire_medium)


def _wire_stored(
    event: CacheEvent,
    where: str,
    format: str,
    hashes: list[int],
    wire_medium: str,
) -> dict[str, Any]:
    block_size = event.block_size
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"{where}.block_size must be a positive integer, got {block_size!r}")
    tokens = [int(t) for t in event.token_ids]
    if len(tokens) != len(hashes) * block_size:
        raise ValueError(
            f"{where}.token_ids has {len(tokens)} tokens, expected {len(hashes) * block_size} "
            f"({len(hashes)} pages of {block_size})"
        )
    parent = event.parent_hash
    wire_parent = None if parent is None else _event_hash(parent, f"{where}.parent_hash", format)
    namespace = event.namespace
    if namespace is not None and not isinstance(namespace, str):
        raise TypeError(f"{where}.namespace must be a str or None, got {namespace!r}")
    out: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": wire_parent,
        "token_ids": tokens,
        "block_size": block_size,
        "lora_id": None,
        "medium": wire_medium,
    }
    # SGLang omits None-valued optional fields; vLLM's lora_name has no default.
    if format == "vllm" or namespace is not None:
        out["lora_name"] = namespace
    return out


def _event_hash(value: object, where: str, format: str) -> int:
    if not isinstance(value, bytes):
        raise TypeError(f"{where} must be bytes, got {type(value).__name__}")
    if len(value) != HASH_LEN:
        raise ValueError(f"{where} must be {HASH_LEN} bytes (a sha256 page hash), got {len(value)}")
    return _wire(value, format)


# --------------------------------------------------------------------------- decoding


@dataclass(frozen=True)
class DecodedEvent:
    """One event as a router sees it: `CacheEvent`'s attributes, hashes as wire integers.

    ``medium`` uses radixcache's names (``GPU``, ``CPU_PINNED``, ``EXTERNAL``) whatever the
    format; a name radixcache does not use (SGLang's ``DISK``) is kept as sent, and an
    event without one is ``GPU`` (both engines' default). ``block_size`` is 0 and
    ``token_ids`` empty except for ``"stored"``.
    """

    kind: str
    medium: str
    namespace: str | None
    hashes: tuple[int, ...]
    parent_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int


@dataclass(frozen=True)
class DecodedBatch:
    """One decoded batch: its timestamp, data-parallel rank (None if absent), events."""

    ts: float
    dp_rank: int | None
    events: tuple[DecodedEvent, ...]


def decode_batch(payload: bytes, *, format: Format = "sglang") -> DecodedBatch:
    """Decode one batch published in `format` (by radixcache, SGLang or vLLM).

    Reads the current layout (batch array, events as tagged maps) and, for older vLLM
    publishers, events as tagged arrays and the batch as a map. Byte-string block hashes
    (vLLM with integer hashes turned off) become integers by `format`'s rule, as
    `wire_hash`. Raises `EventDecodeError` naming what is malformed.
    """
    _check_format(format)
    try:
        import msgpack
    except ImportError as exc:
        raise ImportError(_MISSING.format("msgpack")) from exc
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise EventDecodeError(f"payload is not msgpack: {exc}") from exc
    if isinstance(obj, dict):
        obj = [obj.get("ts"), obj.get("events"), obj.get("data_parallel_rank")]
    if not isinstance(obj, list) or len(obj) < 2:
        raise EventDecodeError(f"payload: a batch is an array [ts, events, dp_rank], got {obj!r}")
    ts, events = obj[0], obj[1]
    dp_rank = obj[2] if len(obj) > 2 else None
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise EventDecodeError(f"payload: ts must be a number, got {ts!r}")
    if not isinstance(events, list):
        raise EventDecodeError(f"payload: events must be an array, got {events!r}")
    if dp_rank is not None and not isinstance(dp_rank, int):
        raise EventDecodeError(f"payload: dp_rank must be an integer or nil, got {dp_rank!r}")
    out: list[DecodedEvent] = []
    for i, raw in enumerate(events):
        out.extend(_decode_event(raw, f"payload: events[{i}]", format))
    return DecodedBatch(float(ts), dp_rank, tuple(out))


#: Positional field names of the array-encoded events of older vLLM releases.
_ARRAY_FIELDS = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def _decode_event(raw: object, where: str, format: str) -> list[DecodedEvent]:
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        fields = _ARRAY_FIELDS.get(raw[0])
        if fields is None:
            raise EventDecodeError(f"{where}: unknown event type {raw[0]!r}")
        raw = {"type": raw[0], **dict(zip(fields, raw[1:]))}
    if not isinstance(raw, dict):
        raise EventDecodeError(f"{where}: an event is a map tagged by 'type', got {raw!r}")
    tag = raw.get("type")
    if tag == "AllBlocksCleared":
        return [DecodedEvent("cleared", "GPU", None, (), None, (), 0)]
    if tag not in ("BlockStored", "BlockRemoved"):
        raise EventDecodeError(f"{where}: unknown event type {tag!r}")
    medium = raw.get("medium")
    if medium is None:
        medium = "GPU"
    elif not isinstance(medium, str):
        raise EventDecodeError(f"{where}.medium must be a string, got {medium!r}")
    medium = _MEDIUM_IN[format].get(medium, medium)
    hashes = _decode_hashes(raw.get("block_hashes"), f"{where}.block_hashes", format)
    if tag == "BlockStored":
        return [_decode_stored(raw, where, format, medium, hashes)]
    out = [DecodedEvent("removed", medium, None, hashes, None, (), 0)] if hashes else []
    state = raw.get(STATE_KEY)
    if state is not None:
        if state not in ("stored", "removed"):
            raise EventDecodeError(f"{where}.{STATE_KEY} must be 'stored' or 'removed'")
        state_hashes = _decode_hashes(
            raw.get(STATE_HASHES_KEY), f"{where}.{STATE_HASHES_KEY}", format
        )
        out.append(DecodedEvent(f"state_{state}", medium, None, state_hashes, None, (), 0))
    return out


def _decode_stored(
    raw: dict[str, Any],
    where: str,
    format: str,
    medium: str,
    hashes: tuple[int, ...],
) -> DecodedEvent:
    block_size = raw.get("block_size")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise EventDecodeError(f"{where}.block_size must be a positive integer, got {block_size!r}")
    tokens = raw.get("token_ids", [])
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise EventDecodeError(f"{where}.token_ids must be an array of integers")
    parent = raw.get("parent_block_hash")
    wire_parent = (
        None if parent is None else _decode_hash(parent, f"{where}.parent_block_hash", format)
    )
    namespace = raw.get("lora_name")
    if namespace is not None and not isinstance(namespace, str):
        raise EventDecodeError(f"{where}.lora_name must be a string or nil, got {namespace!r}")
    return DecodedEvent("stored", medium, namespace, hashes, wire_parent, tuple(tokens), block_size)


def _decode_hashes(value: object, where: str, format: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise EventDecodeError(f"{where} must be an array, got {value!r}")
    return tuple(_decode_hash(h, f"{where}[{i}]", format) for i, h in enumerate(value))


def _decode_hash(value: object, where: str, format: str) -> int:
    if isinstance(value, bool):
        raise EventDecodeError(f"{where} must be an integer or bytes, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, bytes) and len(value) >= 8:
        return _wire(value, format)
    raise EventDecodeError(f"{where} must be an integer or bytes, got {value!r}")


# --------------------------------------------------------------------------- the index


class RouterIndex:
    """A router's view of one worker's cache, rebuilt from its events alone.

    Per tier (``medium``), the set of page hashes present and the set of pages at whose
    end a recurrent state is available, as wire integers (`wire_hash`). Batches must be
    applied in sequence order starting at 0 (`apply`): a repeated batch is ignored, a
    missing one raises `SequenceGap`. One index per publisher (one worker or DP rank).

    A batch that `decode_batch` refuses is lost, and with it what it removed: do as the
    subscriber does, ``reset(seq + 1)`` (forget everything and go on after it), so that
    the index under-claims until the worker stores its pages again and never claims a
    page the lost batch removed (docs/events.md, "Batches that cannot be decoded").

    A publisher that restarts numbers its batches from 0 again: `apply` would take them all
    for repeats. Whoever feeds the index tells a restart from a repeat (as
    `KvEventSubscriber` does: docs/events.md, "A publisher that restarts") and calls
    `reset` first.
    """

    def __init__(self, format: Format = "sglang") -> None:
        """Start empty, expecting batch 0 of a publisher of `format`."""
        _check_format(format)
        self.format: Format = format
        self.next_seq = 0
        self._pages: dict[str, set[int]] = {}
        self._states: dict[str, set[int]] = {}

    def apply(self, seq: int, batch: DecodedBatch) -> bool:
        """Apply batch `seq`; False (and no change) if it was applied already.

        Raises `SequenceGap` when `seq` skips batches (nothing is applied).
        """
        if seq < self.next_seq:
            return False
        if seq > self.next_seq:
            raise SequenceGap(self.next_seq, seq)
        self.apply_events(batch.events)
        self.next_seq = seq + 1
        return True

    def apply_events(self, events: Iterable[DecodedEvent]) -> None:
        """Apply `events` in order, without sequence checks."""
        for event in events:
            if event.kind == "cleared":
                self._pages.clear()
                self._states.clear()
            elif event.kind == "stored":
                self._pages.setdefault(event.medium, set()).update(event.hashes)
            elif event.kind == "removed":
                self._pages.get(event.medium, set()).difference_update(event.hashes)
            elif event.kind == "state_stored":
                self._states.setdefault(event.medium, set()).update(event.hashes)
            elif event.kind == "state_removed":
                self._states.get(event.medium, set()).difference_update(event.hashes)
            else:
                raise ValueError(f"events: unknown kind {event.kind!r}")

    def reset(self, next_seq: int = 0) -> None:
        """Forget everything and expect batch `next_seq` next (a router starting over)."""
        if isinstance(next_seq, bool) or not isinstance(next_seq, int) or next_seq < 0:
            raise ValueError(f"next_seq must be an integer >= 0, got {next_seq!r}")
        self._pages.clear()
        self._states.clear()
        self.next_seq = next_seq

    def pages(self, medium: str) -> frozenset[int]:
        """Return the page hashes present on `medium`."""
        return frozenset(self._pages.get(medium, ()))

    def states(self, medium: str) -> frozenset[int]:
        """Return the page hashes at whose end a state is available on `medium`."""
        return frozenset(self._states.get(medium, ()))

    def snapshot(self) -> dict[str, tuple[frozenset[int], frozenset[int]]]:
        """``{medium: (pages, states)}`` for every tier that holds either."""
        media = {m for m, s in self._pages.items() if s} | {m for m, s in self._states.items() if s}
        return {m: (self.pages(m), self.states(m)) for m in sorted(media)}

    def usable_prefix(
        self, hashes: Sequence[bytes | int], medium: str | None = None
    ) -> tuple[int, int]:
        """Return ``(pages_matched, pages_usable)`` for a prompt's leading page hashes.

        `hashes`: the prompt's page hashes (32-byte, from `page_hashes`, or wire integers).
        ``pages_matched``: how many leading pages are present on `medium` (None: on any
        tier). ``pages_usable``: the longest matched run that ends at a page with a state
        on that medium (any tier for None): what a hybrid model can reuse. A model without
        recurrent layers emits no state events; its reuse is ``pages_matched``.
        """
        if medium is None:
            present: set[int] = set().union(*self._pages.values())
            stateful: set[int] = set().union(*self._states.values())
        else:
            present = self._pages.get(medium, set())
            stateful = self._states.get(medium, set())
        matched = usable = 0
        for i, value in enumerate(hashes):
            key = value if isinstance(value, int) else self._key(value, i)
            if key not in present:
                break
            matched = i + 1
            if key in stateful:
                usable = matched
        return matched, usable

    def _key(self, value: object, i: int) -> int:
        if not isinstance(value, bytes) or len(value) != HASH_LEN:
            raise ValueError(f"hashes[{i}] must be a {HASH_LEN}-byte page hash or an integer")
        return _wire(value, self.format)


# --------------------------------------------------------------------------- publisher


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


_POLL_MS = 50
_CLOSE_LINGER_MS = 200

#: Digests of replayed batches a subscriber keeps at most (16 bytes each); only those whose
#: live copy has not passed yet are kept, so this bounds a router that never polls.
_REPLAYED_KEPT = 16_384


def _digest(payload: bytes) -> bytes:
    """Return what a subscriber keeps of a batch to know it again (the same bytes)."""
    return hashlib.blake2b(payload, digest_size=16).digest()


class _PublisherRestarted(Exception):
    """A replay showed that the publisher is not the one the index follows (the reason)."""


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


# --------------------------------------------------------------------------- subscriber


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
    "Batches that cannot be decoded"): it is logged (a warning on this module's logger),
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
