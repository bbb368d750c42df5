"""The wire codec: a batch of the cache's events to and from msgpack, as SGLang or vLLM sends it.

`encode_batch` writes the events (`CacheEvent`) of one batch in a format's layout, state
events in a carrier every SGLang or vLLM consumer applies as a no-op; `decode_batch`
reads a batch that radixcache, SGLang or vLLM published (`DecodedBatch`), or raises
`EventDecodeError` naming what is malformed. msgpack is imported when a batch is.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .chain import HASH_LEN, Format, _check_format, _wire

#: The kinds of event the cache emits, in `CacheEvent.kind`.
KINDS: tuple[str, ...] = ("stored", "removed", "cleared", "state_stored", "state_removed")

#: The cache's tiers, in `CacheEvent.medium`: the device tier, the host tier, the L3 store.
MEDIA: tuple[str, ...] = ("GPU", "CPU_PINNED", "EXTERNAL")

#: Keys that a state event adds to its carrier (a ``BlockRemoved`` of no blocks, which every
#: SGLang or vLLM consumer decodes and applies as a no-op): ``"stored"`` or ``"removed"``,
#: and the wire hashes of the pages at whose end the state became available or unavailable.
STATE_KEY = "radixcache_state"
STATE_HASHES_KEY = "radixcache_state_hashes"

#: Tier names on the wire per format, and back. vLLM names the host tier ``CPU`` and an
#: external store ``STORAGE``; SGLang uses radixcache's names.
_MEDIUM_OUT: dict[str, dict[str, str]] = {
    "sglang": {"GPU": "GPU", "CPU_PINNED": "CPU_PINNED", "EXTERNAL": "EXTERNAL"},
    "vllm": {"GPU": "GPU", "CPU_PINNED": "CPU", "EXTERNAL": "STORAGE"},
}
_MEDIUM_IN: dict[str, dict[str, str]] = {
    fmt: {wire: ours for ours, wire in table.items()} for fmt, table in _MEDIUM_OUT.items()
}

_MISSING = 'radixcache.events needs {} for this: pip install "radixcache[events]"'


class CacheEvent(Protocol):
    """One event from ``HybridCache.take_events()`` (the attributes the encoder reads).

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
