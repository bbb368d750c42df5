"""radixcache.events: page hashes, the SGLang and vLLM wire formats, publisher, subscriber.

Expected hashes are computed here with hashlib, written independently of the module.
Sockets are real ZMQ sockets on loopback (free ports chosen by ZMQ), payloads real
msgpack. SGLang's own decoder (its msgspec structs from the installed wheel) must decode
every batch we send in SGLang's format; the test is skipped only when SGLang is not
installed (CI installs it).
"""

from __future__ import annotations

import atexit
import hashlib
import importlib
import importlib.util
import re
import struct
import subprocess
import sys
import threading
import time
import types
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

msgpack = pytest.importorskip("msgpack", reason='needs msgpack: pip install "radixcache[events]"')
zmq = pytest.importorskip("zmq", reason='needs pyzmq: pip install "radixcache[events]"')

from radixcache import events as ev  # noqa: E402
from radixcache.events import codec as ev_codec  # noqa: E402
from radixcache.events import publisher as ev_publisher  # noqa: E402

LOOPBACK = "tcp://127.0.0.1:*"
PAGE = 4


@dataclass(frozen=True)
class Event:
    """The core's event shape (the attributes of ``HybridCache.take_events()``'s items)."""

    kind: str
    medium: str = "GPU"
    namespace: str | None = None
    hashes: tuple[bytes, ...] = ()
    parent_hash: bytes | None = None
    token_ids: tuple[int, ...] = ()
    block_size: int = PAGE


# ----------------------------------------------------------------------------- expectations


def chain(tokens: list[int], page: int, seed: bytes | None = None) -> list[bytes]:
    """sha256 chain over full pages, tokens as u32 little-endian (written for the test)."""
    out = []
    prior = seed
    for start in range(0, len(tokens) // page * page, page):
        data = b"".join(struct.pack("<I", t) for t in tokens[start : start + page])
        prior = hashlib.sha256((prior or b"") + data).digest()
        out.append(prior)
    return out


def sglang_int(digest: bytes) -> int:
    """SGLang's event hash: the hex digest's first 16 digits as a signed 64-bit integer."""
    value = int(digest.hex()[:16], 16)
    return value - (1 << 64) if value >= 1 << 63 else value


def vllm_int(digest: bytes) -> int:
    """vLLM's integer block hash: the digest's low 64 bits, unsigned."""
    return int(digest.hex()[-16:], 16)


WIRE = {"sglang": sglang_int, "vllm": vllm_int}


def stored(tokens: list[int], medium: str = "GPU", namespace: str | None = None) -> Event:
    hashes = chain(tokens, PAGE)
    return Event("stored", medium, namespace, tuple(hashes), None, tuple(tokens), PAGE)


def removed(tokens: list[int], medium: str = "GPU") -> Event:
    return Event("removed", medium, None, tuple(chain(tokens, PAGE)))


def state(kind: str, tokens: list[int], medium: str = "GPU") -> Event:
    """A state event for the prefix `tokens` (the page at its end)."""
    return Event(kind, medium, None, (chain(tokens, PAGE)[-1],))


def model(batches: list[list[Event]], fmt: str) -> dict[str, tuple[frozenset[int], frozenset[int]]]:
    """What the index must hold after `batches`: per medium, (pages, states), as wire ints."""
    pages: dict[str, set[int]] = {}
    states: dict[str, set[int]] = {}
    for batch in batches:
        for e in batch:
            keys = {WIRE[fmt](h) for h in e.hashes}
            if e.kind == "cleared":
                pages, states = {}, {}
            elif e.kind == "stored":
                pages.setdefault(e.medium, set()).update(keys)
            elif e.kind == "removed":
                pages.setdefault(e.medium, set()).difference_update(keys)
            elif e.kind == "state_stored":
                states.setdefault(e.medium, set()).update(keys)
            else:
                states.setdefault(e.medium, set()).difference_update(keys)
    media = {m for m, s in pages.items() if s} | {m for m, s in states.items() if s}
    return {m: (frozenset(pages.get(m, ())), frozenset(states.get(m, ()))) for m in sorted(media)}


A = list(range(100, 116))  # 4 pages
B = [*A[:8], *range(200, 208)]  # shares 2 pages with A
C = list(range(300, 312))  # 3 pages

#: A run of batches touching every kind and tier: stores, a demotion to the host, an L3
#: copy, states on and off, removals, a clear, and a namespace.
BATCHES: list[list[Event]] = [
    [stored(A), state("state_stored", A[:8]), state("state_stored", A)],
    [stored(B)],
    [stored(A, "CPU_PINNED"), state("state_stored", A, "CPU_PINNED"), removed(A[8:])],
    [state("state_removed", A), stored(C, "EXTERNAL", namespace="lora-x")],
    [removed(B), state("state_stored", C, "EXTERNAL")],
    [Event("cleared")],
    [stored(C), state("state_stored", C[:4]), stored(A, "CPU_PINNED", namespace="salt")],
]


# ----------------------------------------------------------------------------- page hashes


def test_page_hashes_are_the_sha256_chain_of_full_pages() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 2**32 - 1, 0, 9]
    assert ev.page_hashes(tokens, 4) == chain(tokens, 4)
    assert len(ev.page_hashes(tokens, 4)) == 2  # the partial third page is not hashed
    assert ev.page_hashes(tokens, 1) == chain(tokens, 1)
    assert ev.page_hashes([], 4) == []
    assert ev.page_hashes(iter(tokens), 4) == chain(tokens, 4)
    first = hashlib.sha256(struct.pack("<4I", 1, 2, 3, 4)).digest()
    assert ev.page_hashes(tokens[:4], 4) == [first]


def test_page_hashes_start_from_the_seed() -> None:
    seed = hashlib.sha256(b"some namespace").digest()
    tokens = list(range(40, 52))
    got = ev.page_hashes(tokens, 4, seed=seed)
    assert got == chain(tokens, 4, seed)
    assert got[0] == hashlib.sha256(seed + struct.pack("<4I", 40, 41, 42, 43)).digest()
    assert got != ev.page_hashes(tokens, 4)


def test_page_hashes_refuse_bad_input_naming_it() -> None:
    with pytest.raises(ValueError, match=r"tokens\[1\] = -1 is outside the u32 range"):
        ev.page_hashes([5, -1], 1)
    with pytest.raises(ValueError, match=r"tokens\[2\] = 4294967296"):
        ev.page_hashes([0, 1, 2**32], 1)
    with pytest.raises(TypeError, match="tokens must be integers"):
        ev.page_hashes([1.5], 1)  # type: ignore[list-item]
    for bad in (0, -4, 2.0, True):
        with pytest.raises(ValueError, match="page_size must be a positive integer"):
            ev.page_hashes([1, 2], bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="seed must be None or 32 bytes"):
        ev.page_hashes([1], 1, seed=b"short")


def test_sglang_namespace_seed_matches_sglang_storage_seed() -> None:
    def expected(*parts: str | None) -> bytes:
        data = b"sglang-cache-namespace-v1"
        for part in parts:
            if part is None:
                data += b"\x00"
            else:
                raw = part.encode()
                data += b"\x01" + struct.pack("<Q", len(raw)) + raw
        return hashlib.sha256(data).digest()

    assert ev.sglang_namespace_seed(None, None) is None
    for extra_key, salt in [
        ("a", None),
        (None, "s"),
        ("a", "bc"),
        ("ab", "c"),
        ("", None),
        ("é", ""),
    ]:
        assert ev.sglang_namespace_seed(extra_key, salt) == expected(extra_key, salt)
    assert ev.sglang_namespace_seed("a", "bc") != ev.sglang_namespace_seed("ab", "c")
    assert ev.sglang_namespace_seed("", None) != ev.sglang_namespace_seed(None, "")
    with pytest.raises(TypeError, match="cache_salt must be a str or None"):
        ev.sglang_namespace_seed("a", 3)  # type: ignore[arg-type]


def test_wire_hash_follows_each_engines_integer_rule() -> None:
    for tokens in ([1, 2, 3, 4], [2**31, 2**31 + 1, 7, 8], [9] * 4):
        digest = chain(tokens, 4)[0]
        assert ev.wire_hash(digest) == sglang_int(digest)
        assert ev.wire_hash(digest, "vllm") == vllm_int(digest)
    negative = bytes([0xFF] * 8 + [0] * 24)
    assert ev.wire_hash(negative) == -1
    with pytest.raises(ValueError, match="page_hash must be 32 bytes"):
        ev.wire_hash(b"\x00" * 31)
    with pytest.raises(ValueError, match="format must be one of sglang, vllm"):
        ev.wire_hash(negative, "trtllm")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- wire format


def test_sglang_batch_layout() -> None:
    a = chain(A, PAGE)
    batch = [
        Event("stored", "GPU", None, tuple(a[:2]), None, tuple(A[:8]), PAGE),
        Event("stored", "CPU_PINNED", "lora-x", tuple(a[2:]), a[1], tuple(A[8:]), PAGE),
        Event("removed", "EXTERNAL", None, (a[0],)),
        Event("state_stored", "GPU", None, (a[1],)),
        Event("cleared"),
    ]
    got = msgpack.unpackb(ev.encode_batch(batch, ts=12.5, dp_rank=3))
    s = sglang_int
    assert got == [
        12.5,
        [
            {
                "type": "BlockStored",
                "block_hashes": [s(a[0]), s(a[1])],
                "parent_block_hash": None,
                "token_ids": A[:8],
                "block_size": PAGE,
                "lora_id": None,
                "medium": "GPU",
            },
            {
                "type": "BlockStored",
                "block_hashes": [s(a[2]), s(a[3])],
                "parent_block_hash": s(a[1]),
                "token_ids": A[8:],
                "block_size": PAGE,
                "lora_id": None,
                "medium": "CPU_PINNED",
                "lora_name": "lora-x",
            },
            {"type": "BlockRemoved", "block_hashes": [s(a[0])], "medium": "EXTERNAL"},
            {
                "type": "BlockRemoved",
                "block_hashes": [],
                "medium": "GPU",
                "radixcache_state": "stored",
                "radixcache_state_hashes": [s(a[1])],
            },
            {"type": "AllBlocksCleared"},
        ],
        3,
    ]
    # Map keys in the structs' field order (the tag first), as msgspec writes them.
    assert list(got[1][1]) == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ]


def test_vllm_batch_layout() -> None:
    a = chain(A, PAGE)
    batch = [
        Event("stored", "CPU_PINNED", None, tuple(a[:2]), None, tuple(A[:8]), PAGE),
        Event("removed", "EXTERNAL", None, (a[0],)),
        Event("state_removed", "GPU", None, (a[1],)),
    ]
    got = msgpack.unpackb(ev.encode_batch(batch, format="vllm", ts=1.0, dp_rank=0))
    v = vllm_int
    assert got == [
        1.0,
        [
            {
                "type": "BlockStored",
                "block_hashes": [v(a[0]), v(a[1])],
                "parent_block_hash": None,
                "token_ids": A[:8],
                "block_size": PAGE,
                "lora_id": None,
                "medium": "CPU",
                "lora_name": None,
            },
            {"type": "BlockRemoved", "block_hashes": [v(a[0])], "medium": "STORAGE"},
            {
                "type": "BlockRemoved",
                "block_hashes": [],
                "medium": "GPU",
                "radixcache_state": "removed",
                "radixcache_state_hashes": [v(a[1])],
            },
        ],
        0,
    ]


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
def test_encode_decode_round_trip(fmt: str) -> None:
    for batch in BATCHES:
        decoded = ev.decode_batch(ev.encode_batch(batch, format=fmt, ts=5.0, dp_rank=2), format=fmt)  # type: ignore[arg-type]
        assert decoded.ts == 5.0
        assert decoded.dp_rank == 2
        assert len(decoded.events) == len(batch)
        for got, sent in zip(decoded.events, batch):
            assert got.kind == sent.kind
            if sent.kind == "cleared":
                continue
            assert got.medium == sent.medium
            assert got.hashes == tuple(WIRE[fmt](h) for h in sent.hashes)
            if sent.kind == "stored":
                assert got.namespace == sent.namespace
                assert got.token_ids == sent.token_ids
                assert got.block_size == sent.block_size
                parent = None if sent.parent_hash is None else WIRE[fmt](sent.parent_hash)
                assert got.parent_hash == parent


def test_decode_reads_older_vllm_layouts_and_byte_hashes() -> None:
    a = chain(A, PAGE)
    # Events as tagged arrays, the batch without a rank, hashes as bytes.
    old = msgpack.packb(
        [
            2.0,
            [
                ["BlockStored", [a[0]], None, A[:4], PAGE, None, "CPU"],
                ["BlockRemoved", [a[0]], None],
                ["AllBlocksCleared"],
            ],
        ],
        use_bin_type=True,
    )
    got = ev.decode_batch(old, format="vllm")
    assert got.dp_rank is None
    assert [e.kind for e in got.events] == ["stored", "removed", "cleared"]
    assert got.events[0].hashes == (vllm_int(a[0]),)
    assert got.events[0].medium == "CPU_PINNED"
    assert got.events[1].medium == "GPU"  # no medium: the device
    # The batch as a map.
    as_map = msgpack.packb({"ts": 3.0, "events": [], "data_parallel_rank": 1})
    assert ev.decode_batch(as_map, format="vllm") == ev.DecodedBatch(3.0, 1, ())


def test_decode_refuses_malformed_payloads_naming_the_part() -> None:
    cases: list[tuple[Any, str]] = [
        ([1.0], r"a batch is an array \[ts, events, dp_rank\]"),
        (["x", []], "ts must be a number"),
        ([1.0, {}], "events must be an array"),
        ([1.0, [], "r"], "dp_rank must be an integer or nil"),
        ([1.0, [{"type": "Gone"}]], r"events\[0\]: unknown event type 'Gone'"),
        ([1.0, [["Gone"]]], r"events\[0\]: unknown event type 'Gone'"),
        ([1.0, [7]], r"events\[0\]: an event is a map"),
        ([1.0, [{"type": "BlockRemoved", "block_hashes": 3}]], r"block_hashes must be an array"),
        ([1.0, [{"type": "BlockRemoved", "block_hashes": ["x"]}]], r"block_hashes\[0\] must be"),
        (
            [1.0, [{"type": "BlockRemoved", "block_hashes": [], "medium": 1}]],
            "medium must be a string",
        ),
        (
            [1.0, [{"type": "BlockRemoved", "block_hashes": [], "radixcache_state": "maybe"}]],
            "radixcache_state must be 'stored' or 'removed'",
        ),
        (
            [1.0, [{"type": "BlockStored", "block_hashes": [1], "block_size": 0}]],
            "block_size must be a positive integer",
        ),
        (
            [
                1.0,
                [{"type": "BlockStored", "block_hashes": [1], "block_size": 1, "token_ids": ["a"]}],
            ],
            "token_ids must be an array of integers",
        ),
        (
            [1.0, [{"type": "BlockStored", "block_hashes": [1], "block_size": 1, "lora_name": 5}]],
            "lora_name must be a string or nil",
        ),
    ]
    for obj, message in cases:
        with pytest.raises(ev.EventDecodeError, match=message):
            ev.decode_batch(msgpack.packb(obj))
    with pytest.raises(ev.EventDecodeError, match="payload is not msgpack"):
        ev.decode_batch(b"\xc1")
    with pytest.raises(ValueError, match="format must be one of"):
        ev.decode_batch(msgpack.packb([1.0, []]), format="json")  # type: ignore[arg-type]


def test_encode_refuses_bad_events_naming_them() -> None:
    a = chain(A, PAGE)
    cases: list[tuple[Event, type[Exception], str]] = [
        (Event("moved", hashes=(a[0],)), ValueError, r"events\[0\]\.kind must be one of stored"),
        (
            Event("removed", "XPU", hashes=(a[0],)),
            ValueError,
            r"events\[0\]\.medium must be one of GPU",
        ),
        (Event("removed"), ValueError, r"events\[0\]\.hashes is empty"),
        (
            Event("removed", hashes=(a[0][:31],)),
            ValueError,
            r"events\[0\]\.hashes\[0\] must be 32 bytes",
        ),
        (Event("removed", hashes=("ab",)), TypeError, r"events\[0\]\.hashes\[0\] must be bytes"),  # type: ignore[arg-type]
        (Event("state_stored", hashes=(a[0], a[1])), ValueError, "names exactly one page"),
        (
            Event("stored", hashes=(a[0],), token_ids=(1, 2, 3)),
            ValueError,
            "token_ids has 3 tokens, expected 4",
        ),
        (
            Event("stored", hashes=(a[0],), block_size=0),
            ValueError,
            r"block_size must be a positive",
        ),
        (
            Event("stored", hashes=(a[1],), parent_hash=b"x", token_ids=tuple(A[4:8])),
            ValueError,
            r"parent_hash must be 32 bytes",
        ),
        (
            Event("stored", namespace=7, hashes=(a[0],), token_ids=tuple(A[:4])),  # type: ignore[arg-type]
            TypeError,
            "namespace must be a str or None",
        ),
    ]
    for event, error, message in cases:
        with pytest.raises(error, match=message):
            ev.encode_batch([event])
    with pytest.raises(ValueError, match=r"events\[1\]\.medium"):
        ev.encode_batch([stored(A), Event("removed", "HBM", hashes=(a[0],))])
    with pytest.raises(TypeError, match="dp_rank must be an int or None"):
        ev.encode_batch([], dp_rank="0")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="format must be one of"):
        ev.encode_batch([], format="sglang2")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- the index


def test_index_after_a_run_equals_the_model() -> None:
    for fmt in ("sglang", "vllm"):
        index = ev.RouterIndex(fmt)  # type: ignore[arg-type]
        for seq, batch in enumerate(BATCHES):
            payload = ev.encode_batch(batch, format=fmt)  # type: ignore[arg-type]
            assert index.apply(seq, ev.decode_batch(payload, format=fmt))  # type: ignore[arg-type]
            assert index.snapshot() == model(BATCHES[: seq + 1], fmt)
        assert index.next_seq == len(BATCHES)


#: Page hashes for random runs: few, so that events hit the same pages often.
POOL = [hashlib.sha256(bytes([i])).digest() for i in range(12)]


@st.composite
def events_strategy(draw: st.DrawFn) -> Event:
    kind = draw(st.sampled_from(ev.KINDS))
    medium = draw(st.sampled_from(ev.MEDIA))
    if kind == "cleared":
        return Event("cleared")
    if kind.startswith("state_"):
        return Event(kind, medium, None, (draw(st.sampled_from(POOL)),))
    hashes = tuple(draw(st.lists(st.sampled_from(POOL), min_size=1, max_size=4)))
    if kind == "removed":
        return Event("removed", medium, None, hashes)
    size = draw(st.integers(1, 3))
    tokens = draw(
        st.lists(
            st.integers(0, 2**32 - 1), min_size=size * len(hashes), max_size=size * len(hashes)
        )
    )
    namespace = draw(st.sampled_from([None, "a", "b"]))
    parent = draw(st.sampled_from([None, *POOL]))
    return Event("stored", medium, namespace, hashes, parent, tuple(tokens), size)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.lists(events_strategy(), max_size=6), max_size=8),
    st.sampled_from(["sglang", "vllm"]),
)
def test_index_equals_the_model_after_every_batch(batches: list[list[Event]], fmt: str) -> None:
    index = ev.RouterIndex(fmt)  # type: ignore[arg-type]
    for seq, batch in enumerate(batches):
        decoded = ev.decode_batch(ev.encode_batch(batch, format=fmt), format=fmt)  # type: ignore[arg-type]
        assert [e.kind for e in decoded.events] == [e.kind for e in batch]
        assert index.apply(seq, decoded)
        assert index.snapshot() == model(batches[: seq + 1], fmt)


def test_index_skips_repeats_and_detects_gaps() -> None:
    index = ev.RouterIndex()
    first = ev.decode_batch(ev.encode_batch([stored(A)]))
    second = ev.decode_batch(ev.encode_batch([removed(A)]))
    assert index.apply(0, first)
    assert not index.apply(0, second)  # a repeat: ignored, nothing changes
    assert index.pages("GPU") == {sglang_int(h) for h in chain(A, PAGE)}
    with pytest.raises(ev.SequenceGap, match="expected batch 1, received 3 \\(2 lost\\)") as info:
        index.apply(3, second)
    assert (info.value.expected, info.value.received) == (1, 3)
    assert index.next_seq == 1
    assert len(index.pages("GPU")) == 4  # the gap applied nothing


def test_usable_prefix_needs_the_run_and_a_state_at_its_end() -> None:
    index = ev.RouterIndex()
    a = chain(A, PAGE)
    batch = [stored(A), state("state_stored", A[:8]), stored(A[:4], "CPU_PINNED")]
    batch += [state("state_stored", A[:12], "CPU_PINNED")]
    index.apply_events(ev.decode_batch(ev.encode_batch(batch)).events)
    assert index.usable_prefix(a) == (4, 3)  # a state on the host tier counts for "any tier"
    assert index.usable_prefix(a, "GPU") == (4, 2)
    assert index.usable_prefix(a, "CPU_PINNED") == (1, 0)  # the state's page is not there
    assert index.usable_prefix([sglang_int(h) for h in a], "GPU") == (4, 2)
    assert index.usable_prefix(chain(B, PAGE), "GPU") == (2, 2)
    assert index.usable_prefix(chain(C, PAGE)) == (0, 0)
    assert index.usable_prefix([], "EXTERNAL") == (0, 0)
    with pytest.raises(ValueError, match=r"hashes\[1\] must be a 32-byte page hash"):
        index.usable_prefix([a[0], b"short"])
    vllm_index = ev.RouterIndex("vllm")
    vllm_index.apply_events(
        ev.decode_batch(ev.encode_batch(batch, format="vllm"), format="vllm").events
    )
    assert vllm_index.usable_prefix(a, "GPU") == (4, 2)


def test_index_reset_forgets_and_moves_on() -> None:
    index = ev.RouterIndex()
    index.apply(0, ev.decode_batch(ev.encode_batch([stored(A), state("state_stored", A)])))
    index.reset(7)
    assert index.snapshot() == {}
    assert index.next_seq == 7
    assert index.apply(7, ev.decode_batch(ev.encode_batch([stored(C)])))
    assert index.snapshot() == model([[stored(C)]], "sglang")
    with pytest.raises(ValueError, match="next_seq must be an integer >= 0"):
        index.reset(-1)


def test_index_refuses_unknown_kinds_and_formats() -> None:
    with pytest.raises(ValueError, match="format must be one of"):
        ev.RouterIndex("tgi")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="events: unknown kind 'moved'"):
        ev.RouterIndex().apply_events([ev.DecodedEvent("moved", "GPU", None, (), None, (), 0)])


# ----------------------------------------------------------------------------- sockets


def drain(sub: ev.KvEventSubscriber, upto: int, timeout: float = 20.0) -> None:
    """Poll until the index has applied every batch below `upto`; catch up when stuck
    (a batch sent before the subscription reached the publisher never arrives live)."""
    deadline = time.monotonic() + timeout
    while sub.index.next_seq < upto:
        assert time.monotonic() < deadline, f"index at {sub.index.next_seq}, wanted {upto}"
        if not sub.poll(0.2) and sub.index.next_seq < upto:
            sub.catch_up()


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
def test_round_trip_through_zmq(fmt: str) -> None:
    with (
        ev.KvEventPublisher(LOOPBACK, LOOPBACK, topic="kv", format=fmt, dp_rank=1) as pub,
        ev.KvEventSubscriber(pub.endpoint, pub.replay_endpoint, topic="kv", format=fmt) as sub,
    ):
        assert pub.endpoint.startswith("tcp://127.0.0.1:")
        assert not pub.endpoint.endswith("*")
        # Clears until one arrives live: the subscription has reached the publisher.
        warm_up: list[list[Event]] = []
        deadline = time.monotonic() + 20
        while sub.live_batches == 0:
            assert time.monotonic() < deadline
            warm_up.append([Event("cleared")])
            pub.publish(warm_up[-1])
            sub.poll(0.05)
        sent = len(warm_up)
        for _ in range(4):  # the run several times over
            for batch in BATCHES:
                assert pub.publish(batch) == sent
                sent += 1
        assert pub.publish([]) is None  # nothing to say: nothing sent
        assert pub.next_seq == sent
        drain(sub, sent)
        assert sub.index.snapshot() == model(warm_up + BATCHES * 4, fmt)
        assert sub.live_batches + sub.replayed_batches == sent


def test_topics_filter() -> None:
    with ev.KvEventPublisher(LOOPBACK, LOOPBACK, topic="worker-1") as pub:
        other = ev.KvEventSubscriber(pub.endpoint, topic="worker-2")
        mine = ev.KvEventSubscriber(pub.endpoint, pub.replay_endpoint, topic="worker-1")
        with other, mine:
            deadline = time.monotonic() + 20
            while mine.live_batches == 0:  # until the subscription is through
                assert time.monotonic() < deadline
                pub.publish([Event("cleared")])
                mine.poll(0.1)
            assert other.poll(0.3) == 0
            assert other.index.next_seq == 0
            assert mine.index.next_seq == pub.next_seq


def test_late_subscriber_catches_up_through_replay() -> None:
    with ev.KvEventPublisher(LOOPBACK, LOOPBACK) as pub:
        for batch in BATCHES:
            pub.publish(batch)
        with ev.KvEventSubscriber(pub.endpoint, pub.replay_endpoint) as sub:
            assert sub.catch_up() == len(BATCHES)
            assert sub.index.snapshot() == model(BATCHES, "sglang")
            assert sub.catch_up() == 0  # nothing new; nothing applied twice
            # Wait for live delivery, then a batch that arrives both ways counts once.
            extra = [state("state_removed", C[:4])]
            deadline = time.monotonic() + 20
            while sub.live_batches == 0:
                assert time.monotonic() < deadline
                pub.publish(extra)
                sub.poll(0.1)
            pub.publish(extra)
            sub.catch_up()
            before = sub.duplicates
            deadline = time.monotonic() + 20
            while sub.duplicates == before:
                assert time.monotonic() < deadline
                sub.poll(0.1)
            assert sub.index.next_seq == pub.next_seq
            expected = BATCHES + [extra] * (pub.next_seq - len(BATCHES))
            assert sub.index.snapshot() == model(expected, "sglang")
            assert sub.publisher_restarts == 0, "a duplicate is not a restart"


def test_gap_past_the_replay_buffer_is_detected() -> None:
    with ev.KvEventPublisher(LOOPBACK, LOOPBACK, buffer_steps=2) as pub:
        for batch in BATCHES[:5]:
            pub.publish(batch)
        with ev.KvEventSubscriber(pub.endpoint, pub.replay_endpoint) as sub:
            with pytest.raises(ev.SequenceGap) as info:
                sub.catch_up()
            assert (info.value.expected, info.value.received) == (0, 3)
            assert sub.index.next_seq == 0
            # Start over from what the publisher still holds: the index knows less than
            # the worker holds (batches 0-2 are gone), never more.
            assert sub.resync() == 2
            assert sub.index.next_seq == 5
            partial, truth = sub.index.snapshot(), model(BATCHES[:5], "sglang")
            assert partial == model(BATCHES[3:5], "sglang")
            for medium, (pages, states) in partial.items():
                assert pages <= truth.get(medium, (frozenset(), frozenset()))[0]
                assert states <= truth.get(medium, (frozenset(), frozenset()))[1]
            pub.publish(BATCHES[5])
            drain(sub, 6)
            assert sub.index.snapshot() == model(BATCHES[:6], "sglang")


def test_gap_without_replay_is_detected_live() -> None:
    with ev.KvEventPublisher(LOOPBACK, None) as pub:
        assert pub.replay_endpoint is None
        pub.publish([stored(A)])
        with ev.KvEventSubscriber(pub.endpoint) as sub:
            deadline = time.monotonic() + 20
            gap: ev.SequenceGap | None = None
            while gap is None:
                assert time.monotonic() < deadline
                pub.publish([removed(A)])
                try:
                    sub.poll(0.1)
                except ev.SequenceGap as exc:
                    gap = exc
            assert gap.expected == 0
            assert gap.received >= 1
            # Without replay a router starts over after the batch that showed the gap.
            sub.index.reset(gap.received + 1)
            pub.publish([stored(C)])
            while sub.index.next_seq < pub.next_seq:
                assert time.monotonic() < deadline
                sub.poll(0.1)
            assert sub.index.pages("GPU") == {sglang_int(h) for h in chain(C, PAGE)}
            with pytest.raises(RuntimeError, match="no replay_endpoint"):
                sub.catch_up()


def test_replay_socket_speaks_the_engines_protocol() -> None:
    with ev.KvEventPublisher(LOOPBACK, LOOPBACK, topic="t") as pub:
        payloads = [ev.encode_batch(b) for b in BATCHES[:4]]
        for batch in BATCHES[:4]:
            pub.publish(batch)
        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(pub.replay_endpoint)
        try:
            dealer.send_multipart([b"", (2).to_bytes(8, "big")])
            answers = [dealer.recv_multipart() for _ in range(3)]
            assert [a[:3] for a in answers[:2]] == [
                [b"", b"t", (2).to_bytes(8, "big")],
                [b"", b"t", (3).to_bytes(8, "big")],
            ]
            # The stored payloads are the batches as sent (timestamps aside).
            for answer, payload in zip(answers, payloads[2:]):
                assert msgpack.unpackb(answer[3])[1:] == msgpack.unpackb(payload)[1:]
            assert answers[2] == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
            dealer.send_multipart([b"", b"\x00\x01"])  # a malformed start: just the end
            assert dealer.recv_multipart() == [b"", b"", b"\xff" * 8, b""]
            dealer.send_multipart([b"junk"])  # not a request: ignored, the socket lives on
            dealer.send_multipart([b"", (9).to_bytes(8, "big")])
            assert dealer.recv_multipart() == [b"", b"", b"\xff" * 8, b""]
        finally:
            dealer.close(linger=0)
            ctx.term()


def test_publish_from_many_threads_keeps_one_sequence() -> None:
    with ev.KvEventPublisher(LOOPBACK, LOOPBACK) as pub:
        seqs: list[int] = []
        lock = threading.Lock()

        def worker(base: int) -> None:
            for i in range(25):
                seq = pub.publish([stored([base, i, 0, 0])])
                assert seq is not None
                with lock:
                    seqs.append(seq)

        threads = [threading.Thread(target=worker, args=(1000 + t,)) for t in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sorted(seqs) == list(range(100))
        with ev.KvEventSubscriber(pub.endpoint, pub.replay_endpoint) as sub:
            assert sub.catch_up() == 100
            expected = {
                sglang_int(chain([1000 + t, i, 0, 0], PAGE)[0]) for t in range(4) for i in range(25)
            }
            assert sub.index.pages("GPU") == expected


def test_publisher_refuses_bad_arguments_naming_them() -> None:
    with pytest.raises(ValueError, match="buffer_steps must be an integer >= 1"):
        ev.KvEventPublisher(LOOPBACK, None, buffer_steps=0)
    with pytest.raises(ValueError, match="dp_rank must be an integer >= 0"):
        ev.KvEventPublisher(LOOPBACK, None, dp_rank=-1)
    with pytest.raises(ValueError, match="format must be one of"):
        ev.KvEventPublisher(LOOPBACK, None, format="msgspec")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="topic must be a str"):
        ev.KvEventPublisher(LOOPBACK, None, topic=b"kv")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="endpoint: cannot bind 'nowhere'"):
        ev.KvEventPublisher("nowhere", None)
    with ev.KvEventPublisher(LOOPBACK, None) as pub:
        with pytest.raises(ValueError, match="replay_endpoint: cannot bind"):
            ev.KvEventPublisher(LOOPBACK, pub.endpoint)  # the port is taken
        with pytest.raises(ValueError, match=r"events\[0\]\.kind"):
            pub.publish([Event("moved", hashes=(chain(A, PAGE)[0],))])
        assert pub.next_seq == 0  # a refused batch uses no number
    with pytest.raises(RuntimeError, match="the publisher is closed"):
        pub.publish([stored(A)])
    pub.close()  # again: nothing happens


def test_subscriber_refuses_bad_arguments_and_times_out() -> None:
    with pytest.raises(ValueError, match="index: its format is 'vllm', not 'sglang'"):
        ev.KvEventSubscriber("tcp://127.0.0.1:1", index=ev.RouterIndex("vllm"))
    with pytest.raises(ValueError, match="endpoint: cannot connect to 'nowhere'"):
        ev.KvEventSubscriber("nowhere")
    # A replay endpoint where nothing answers.
    with ev.KvEventPublisher(LOOPBACK, None) as pub:
        ctx = zmq.Context()
        silent = ctx.socket(zmq.ROUTER)
        silent.bind(LOOPBACK)
        try:
            address = silent.getsockopt(zmq.LAST_ENDPOINT).decode()
            sub = ev.KvEventSubscriber(pub.endpoint, address)
            with sub, pytest.raises(TimeoutError, match="no end of replay"):
                sub.catch_up(timeout=0.2)
        finally:
            silent.close(linger=0)
            ctx.term()


def replay_server() -> tuple[Any, Any, str]:
    """A test-only replay socket (a ZMQ ROUTER) that answers what a test scripts: what a
    real publisher never sends. Returns (context, socket, address)."""
    ctx = zmq.Context()
    server = ctx.socket(zmq.ROUTER)
    server.setsockopt(zmq.RCVTIMEO, 20_000)  # a broken subscriber fails the test, not hangs it
    server.bind(LOOPBACK)
    return ctx, server, server.getsockopt(zmq.LAST_ENDPOINT).decode()


def seq_frame(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


END = [b"", seq_frame(-1), b""]


def test_unreadable_replay_messages_are_skipped_and_resync_starts_after_them() -> None:
    """Issue 33, item 9, in the replay: a message that is not a replay answer, a batch that
    cannot be decoded and a negative sequence number are skipped and counted; a gap they
    leave in a catch-up raises SequenceGap (the router resyncs), and a resync starts the
    index over after the hole, so that nothing a lost batch removed is claimed."""
    ctx, server, address = replay_server()
    a, c = ev.encode_batch([stored(A)]), ev.encode_batch([stored(C)])
    bad = BAD_PAYLOADS["unknown event type"]
    # The history: 0 undecodable, 1 stores A, 2 (unreadable in the replays), 3 stores C.
    answers = [
        # catch_up from 0
        [
            [b"not a replay message"],
            [b"t", seq_frame(0), bad],
            [b"t", seq_frame(1), a],
            [b"t", seq_frame(-5), b""],
        ],
        # catch_up from 1 (the last batch applied, checked): batch 2 unreadable, so 3
        # shows a gap
        [[b"t", seq_frame(1), a], [b"t", b"\x00\x02", b"?"], [b"t", seq_frame(3), c]],
        # resync, from 0
        [
            [b"t", seq_frame(0), bad],
            [b"t", seq_frame(1), a],
            [b"t", b"\x02"],
            [b"t", seq_frame(3), c],
        ],
    ]
    starts = []

    def serve() -> None:
        for answer in answers:
            client, _, start = server.recv_multipart()
            starts.append(int.from_bytes(start, "big"))
            for frames in [*answer, END]:
                server.send_multipart([client, b"", *frames])

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        with ev.KvEventSubscriber("tcp://127.0.0.1:1", address) as sub:
            assert sub.catch_up() == 1
            assert sub.index.next_seq == 2
            assert sub.index.pages("GPU") == {sglang_int(h) for h in chain(A, PAGE)}
            assert (sub.decode_errors, sub.skipped_seqs) == (3, (0,))
            error = sub.last_decode_error
            assert error is not None
            assert error.seq is None
            assert "sequence number -5 is negative" in str(error)
            with pytest.raises(ev.SequenceGap) as gap:
                sub.catch_up()
            assert (gap.value.expected, gap.value.received) == (2, 3)
            assert sub.decode_errors == 4
            assert sub.resync() == 2  # A, then C after the hole
            assert sub.index.next_seq == 4
            # A is forgotten: batch 2 is lost, and might have removed it.
            assert sub.index.snapshot() == model([[stored(C)]], "sglang")
            assert (sub.decode_errors, sub.skipped_seqs) == (5, (0,)), "batch 0 counted once"
            assert sub.replayed_batches == 3
    finally:
        thread.join()
        server.close(linger=0)
        ctx.term()
    assert starts == [0, 1, 0]


def test_a_replay_cut_short_leaves_no_leftovers() -> None:
    """After a replay that timed out, the rest of its answer is not read as the next one's
    (a new socket)."""
    ctx, server, address = replay_server()
    a, c = ev.encode_batch([stored(A)]), ev.encode_batch([stored(C)])

    def serve() -> None:
        client, _, _ = server.recv_multipart()
        server.send_multipart([client, b"", b"t", seq_frame(0), a])  # no end in time
        again, _, start = server.recv_multipart()
        assert start == seq_frame(0)  # from the last batch applied, to check it
        server.send_multipart([client, b"", *END])  # the first answer's end, late
        server.send_multipart([again, b"", b"t", seq_frame(0), a])
        server.send_multipart([again, b"", b"t", seq_frame(1), c])
        server.send_multipart([again, b"", *END])

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        with ev.KvEventSubscriber("tcp://127.0.0.1:1", address) as sub:
            with pytest.raises(TimeoutError, match="no end of replay"):
                sub.catch_up(timeout=0.3)
            assert sub.index.next_seq == 1  # batch 0 was applied before the timeout
            assert sub.catch_up() == 1
            assert sub.index.next_seq == 2
    finally:
        thread.join()
        server.close(linger=0)
        ctx.term()


def test_catch_up_reads_older_vllm_replay_answers() -> None:
    """Older vLLM answers replay without the topic frame: [b"", seq, payload]."""
    ctx = zmq.Context()
    server = ctx.socket(zmq.ROUTER)
    server.setsockopt(zmq.RCVTIMEO, 20_000)
    server.bind(LOOPBACK)
    payload = ev.encode_batch([stored(A)], format="vllm")

    def serve() -> None:
        client, _, start = server.recv_multipart()
        assert start == (0).to_bytes(8, "big")
        server.send_multipart([client, b"", (0).to_bytes(8, "big"), payload])
        server.send_multipart([client, b"", b"\xff" * 8, b""])

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        address = server.getsockopt(zmq.LAST_ENDPOINT).decode()
        with ev.KvEventSubscriber("tcp://127.0.0.1:1", address, format="vllm") as sub:
            assert sub.catch_up() == 1
            assert sub.index.pages("GPU") == {vllm_int(h) for h in chain(A, PAGE)}
    finally:
        thread.join()
        server.close(linger=0)
        ctx.term()


def test_a_live_message_without_a_sequence_number_is_skipped_and_counted() -> None:
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(LOOPBACK)
    try:
        with ev.KvEventSubscriber(pub.getsockopt(zmq.LAST_ENDPOINT).decode()) as sub:
            deadline = time.monotonic() + 20
            while sub.decode_errors == 0:  # until the subscription is through
                assert time.monotonic() < deadline
                pub.send_multipart([b"", b"short", b"payload"])
                sub.poll(0.1)
            error = sub.last_decode_error
            assert error is not None
            assert error.seq is None
            assert "a message cannot be decoded: live message: expected [topic, seq (8 bytes)" in (
                str(error)
            )
            assert "got 3 frames (seq of 5 bytes)" in str(error)
            errors = sub.decode_errors
            pub.send_multipart([b"", seq_frame(0)])  # two frames
            pub.send_multipart([b"", seq_frame(0), ev.encode_batch([stored(A)])])
            while sub.index.next_seq == 0:
                assert time.monotonic() < deadline
                sub.poll(0.1)
            assert sub.decode_errors == errors + 1
            assert sub.skipped_seqs == (), "no batch was lost"
            assert sub.index.pages("GPU") == {sglang_int(h) for h in chain(A, PAGE)}
    finally:
        pub.close(linger=0)
        ctx.term()


# ----------------------------------------------------------------------------- undecodable


#: Hand-made payloads a subscriber cannot decode (issue 33, item 9).
BAD_PAYLOADS: dict[str, bytes] = {
    "unknown event type": msgpack.packb(
        [1.0, [{"type": "BlockMoved", "block_hashes": [1], "medium": "GPU"}], 0]
    ),
    "truncated msgpack": ev.encode_batch([stored(A)])[:-5],
    "wrong field types": msgpack.packb(
        [1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": "abcd", "block_size": 4}]]
    ),
    "bad hash": msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [b"short"]}], 0]),
    "not a batch": msgpack.packb("hello"),
}
BAD = pytest.mark.parametrize("bad", list(BAD_PAYLOADS.values()), ids=list(BAD_PAYLOADS))


def test_the_bad_payloads_are_refused_by_decode_batch() -> None:
    for name, payload in BAD_PAYLOADS.items():
        with pytest.raises(ev.EventDecodeError) as info:
            ev.decode_batch(payload)
        assert info.value.seq is None, name


#: Anything msgpack encodes, as payloads are made of.
MSGPACK_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=6)
    | st.binary(max_size=40),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=6) | st.integers(0, 9), inner, max_size=4)
    ),
    max_leaves=12,
)
#: Every field a stored event may carry, hybrid state fields included.
EVENT_FIELDS = [*ev_codec._ARRAY_FIELDS["BlockStored"], ev.STATE_KEY, ev.STATE_HASHES_KEY]
EVENT_LIKE = (
    st.fixed_dictionaries(
        {"type": st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other"])},
        optional=dict.fromkeys(EVENT_FIELDS, MSGPACK_VALUES),
    )
    | st.lists(MSGPACK_VALUES, max_size=8).map(lambda rest: ["BlockStored", *rest])
    | MSGPACK_VALUES
)
BATCH_LIKE = st.one_of(
    st.tuples(MSGPACK_VALUES, st.lists(EVENT_LIKE, max_size=4), MSGPACK_VALUES).map(list),
    MSGPACK_VALUES,
)


def decode_or_refuse(payload: bytes) -> None:
    """`decode_batch` decodes `payload` or raises EventDecodeError, nothing else; what it
    decodes, an index applies."""
    for fmt in ("sglang", "vllm"):
        try:
            batch = ev.decode_batch(payload, format=fmt)  # type: ignore[arg-type]
        except ev.EventDecodeError:
            continue
        ev.RouterIndex(fmt).apply(0, batch)  # type: ignore[arg-type]


@settings(max_examples=100, deadline=None)
@given(BATCH_LIKE)
def test_decode_refuses_any_malformed_batch_with_event_decode_error(obj: Any) -> None:
    """The subscriber skips what raises EventDecodeError: any other error would stop it."""
    decode_or_refuse(msgpack.packb(obj, use_bin_type=True))


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(BATCHES), st.integers(0, 10_000), st.integers(0, 255), st.binary())
def test_decode_refuses_damaged_bytes_with_event_decode_error(
    batch: list[Event], at: int, byte: int, tail: bytes
) -> None:
    good = ev.encode_batch(batch)
    at %= len(good)
    decode_or_refuse(good[:at])
    decode_or_refuse(good[:at] + bytes([byte]) + good[at + 1 :])
    decode_or_refuse(tail)


def publish_payload(pub: ev.KvEventPublisher, payload: bytes, monkeypatch: Any) -> int:
    """Publish `payload` as is through the real publisher (sequence number, socket, replay
    buffer), its encoder swapped for this one call: what a buggy or newer publisher sends."""
    with monkeypatch.context() as patch:
        patch.setattr(ev_publisher, "encode_batch", lambda events, **kwargs: payload)
        seq = pub.publish([Event("cleared")])
    assert seq is not None
    return seq


def until_live(pub: ev.KvEventPublisher, sub: ev.KvEventSubscriber) -> None:
    """Publish clears until one arrives live: the subscription has reached the publisher."""
    deadline = time.monotonic() + 20
    while sub.live_batches == 0:
        assert time.monotonic() < deadline
        pub.publish([Event("cleared")])
        sub.poll(0.05)


@BAD
def test_a_live_batch_that_cannot_be_decoded_is_skipped_and_the_index_starts_over_after_it(
    bad: bytes, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 33, item 9: it made every later poll() and resync() raise, for good."""
    with (
        ev.KvEventPublisher(LOOPBACK, LOOPBACK) as pub,
        ev.KvEventSubscriber(pub.endpoint, pub.replay_endpoint) as sub,
    ):
        until_live(pub, sub)
        pub.publish([stored(A), state("state_stored", A)])
        lost = publish_payload(pub, bad, monkeypatch)  # as if it had removed A
        pub.publish([stored(C)])
        drain(sub, pub.next_seq)
        assert sub.decode_errors == 1
        assert sub.skipped_seqs == (lost,)
        error = sub.last_decode_error
        assert error is not None
        assert error.seq == lost
        assert f"batch {lost} cannot be decoded: payload" in str(error)
        assert isinstance(error.__cause__, ev.EventDecodeError)
        assert f"the index starts over, empty, at batch {lost + 1}" in caplog.text
        # A is forgotten (the lost batch may have removed it): the index under-claims the
        # worker's cache, and never claims a page it no longer holds.
        after = [[stored(C)]]
        assert sub.index.snapshot() == model(after, "sglang")
        # Later batches apply; poll, catch_up and resync go on.
        after.append([stored(B), removed(C)])
        pub.publish(after[-1])
        drain(sub, pub.next_seq)
        assert sub.index.snapshot() == model(after, "sglang")
        assert sub.catch_up() == 0
        assert sub.resync() == pub.next_seq - 1, "every buffered batch but the lost one"
        assert sub.index.next_seq == pub.next_seq
        assert sub.index.snapshot() == model(after, "sglang")
        assert (sub.decode_errors, sub.skipped_seqs) == (1, (lost,)), "met again, counted once"


@BAD
def test_the_replay_skips_a_batch_that_cannot_be_decoded(
    bad: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A late joiner's catch-up and a resync read undecodable batches, the oldest buffered
    and the newest among them, and still end with the batches after the last one."""
    with ev.KvEventPublisher(LOOPBACK, LOOPBACK, buffer_steps=5) as pub:
        pub.publish([stored(B)])  # 0: out of the buffer by the time the subscriber joins
        publish_payload(pub, bad, monkeypatch)  # 1: the oldest buffered
        pub.publish([stored(A)])  # 2
        publish_payload(pub, bad, monkeypatch)  # 3
        pub.publish([stored(C), state("state_stored", C)])  # 4
        pub.publish([removed(C[:4])])  # 5
        after = [[stored(C), state("state_stored", C)], [removed(C[:4])]]
        with ev.KvEventSubscriber(pub.endpoint, pub.replay_endpoint) as sub:
            with pytest.raises(ev.SequenceGap):
                sub.catch_up()  # batch 0 is gone
            assert sub.resync() == 3  # A, C, the removal
            assert sub.index.next_seq == 6
            assert sub.index.snapshot() == model(after, "sglang")
            assert (sub.decode_errors, sub.skipped_seqs) == (2, (1, 3))
            assert sub.resync() == 3
            assert sub.index.snapshot() == model(after, "sglang")
            assert sub.decode_errors == 2
            after.append([stored(A)])
            pub.publish(after[-1])
            drain(sub, pub.next_seq)
            assert sub.index.snapshot() == model(after, "sglang")
        with ev.KvEventSubscriber(pub.endpoint, pub.replay_endpoint) as late:
            late.index.reset(2)  # a joiner that needs batches from 2 on: one is undecodable
            assert late.catch_up() == 4
            assert late.index.snapshot() == model(after, "sglang")
            assert late.skipped_seqs == (3,)


# ----------------------------------------------------------------------------- restarts


def restarted(pub: ev.KvEventPublisher, **kwargs: Any) -> ev.KvEventPublisher:
    """Close `pub` and bind a new publisher on its endpoints (PUB and replay): its worker
    restarted, and numbers its batches from 0 again."""
    pub.close()
    return ev.KvEventPublisher(pub.endpoint, pub.replay_endpoint, **kwargs)


#: What the restarted worker publishes, over and over: other pages than the old worker's.
NEW_BATCHES: list[list[Event]] = [
    [stored(B), state("state_stored", B)],
    [removed(B[8:]), stored(C)],
    [stored([*B[:8], 7, 7, 7, 7]), state("state_removed", B)],
]


def publish_until_restart_seen(
    pub: ev.KvEventPublisher, sub: ev.KvEventSubscriber, sent: list[list[Event]]
) -> None:
    """Publish NEW_BATCHES in turn (appending them to `sent`) and poll, until the
    subscriber has found that the publisher restarted: the batches published before its
    SUB socket reconnected never reach it live."""
    deadline = time.monotonic() + 20
    while sub.publisher_restarts == 0:
        assert time.monotonic() < deadline, "the restart was never noticed"
        sent.append(NEW_BATCHES[len(sent) % len(NEW_BATCHES)])
        pub.publish(sent[-1])
        sub.poll(0.05)


def test_a_restarted_publisher_seen_live_starts_the_index_over_from_its_batches(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 33, item 9: a worker restarted (numbers from 0 again) and the subscriber took
    every batch after for a duplicate, until the router called resync() on its own. It
    now starts over from the new publisher's batches, and still ignores a batch it gets
    twice."""
    old = ev.KvEventPublisher(LOOPBACK, LOOPBACK)
    with ev.KvEventSubscriber(old.endpoint, old.replay_endpoint) as sub:
        until_live(old, sub)
        for batch in BATCHES * 10:
            old.publish(batch)
        drain(sub, old.next_seq)
        assert sub.index.snapshot() == model(BATCHES, "sglang")
        with restarted(old) as new:
            sent: list[list[Event]] = []
            publish_until_restart_seen(new, sub, sent)
            # Its first batch to arrive is numbered below the old publisher's last one.
            assert re.search(
                r"the publisher restarted \(live batch \d+ came after live", caplog.text
            )
            assert "the index starts over from every batch it buffers" in caplog.text
            drain(sub, new.next_seq)
            assert sub.publisher_restarts == 1
            assert sub.index.snapshot() == model(sent, "sglang"), "nothing of the old worker"
            # A batch that comes both ways (replay, then live) is a duplicate, no restart.
            sent.append([removed(C), state("state_stored", B[:8])])
            new.publish(sent[-1])
            assert sub.catch_up() == 1
            before = sub.duplicates
            deadline = time.monotonic() + 20
            while sub.duplicates == before:
                assert time.monotonic() < deadline
                sub.poll(0.05)
            assert sub.publisher_restarts == 1
            assert sub.index.next_seq == new.next_seq
            assert sub.index.snapshot() == model(sent, "sglang")


def test_a_subscriber_that_only_replayed_knows_the_new_publishers_batches_by_their_bytes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A late joiner applied everything from the replay and nothing live yet: the new
    publisher's batches come under numbers it already holds, and differ from the bytes
    the replay brought under them."""
    old = ev.KvEventPublisher(LOOPBACK, LOOPBACK)
    for batch in BATCHES * 8:
        old.publish(batch)
    with ev.KvEventSubscriber(old.endpoint, old.replay_endpoint) as sub:
        assert sub.catch_up() == len(BATCHES) * 8
        with restarted(old) as new:
            sent: list[list[Event]] = []
            publish_until_restart_seen(new, sub, sent)
            assert new.next_seq < len(BATCHES) * 8, "seen below the index's next batch"
            assert "is not the batch" in caplog.text
            assert "a replay brought" in caplog.text
            drain(sub, new.next_seq)
            assert sub.index.snapshot() == model(sent, "sglang")
            assert sub.publisher_restarts == 1


def test_catch_up_checks_the_last_batch_applied_against_the_publisher() -> None:
    """A catch-up asks from the last batch the index applied and compares it: a new
    publisher holds no such batch, or another one under its number; the same publisher
    holds it byte for byte; one whose buffer no longer holds it cannot be checked."""
    old = ev.KvEventPublisher(LOOPBACK, LOOPBACK)
    for batch in BATCHES[:5]:
        old.publish(batch)
    with ev.KvEventSubscriber(old.endpoint, old.replay_endpoint) as sub:
        assert sub.catch_up() == 5
        # Restarted with fewer batches: nothing from batch 4 on.
        new = restarted(old)
        new.publish([stored(C)])
        new.publish([stored(B)])
        assert sub.catch_up() == 2
        assert sub.publisher_restarts == 1
        assert sub.index.snapshot() == model([[stored(C)], [stored(B)]], "sglang")
        # Restarted with more: its batch 1 is another one. Its buffer has lost batch 0,
        # so the index starts at batch 1 (it under-claims the worker's cache).
        newer = restarted(new, buffer_steps=3)
        with newer:
            for batch in BATCHES[:4]:
                newer.publish(batch)
            assert sub.catch_up() == 3
            assert sub.publisher_restarts == 2
            assert sub.index.snapshot() == model(BATCHES[1:4], "sglang")
            # The same publisher: checked, and the catch-up goes on.
            newer.publish(BATCHES[4])
            assert sub.catch_up() == 1
            assert sub.index.snapshot() == model(BATCHES[1:5], "sglang")
            # The last batch applied has left the buffer: a gap, not a restart.
            for batch in BATCHES[:4]:
                newer.publish(batch)
            with pytest.raises(ev.SequenceGap):
                sub.catch_up()
            assert sub.publisher_restarts == 2


def test_without_a_replay_socket_a_restart_starts_the_index_at_the_batch_that_shows_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    old = ev.KvEventPublisher(LOOPBACK, None)
    with ev.KvEventSubscriber(old.endpoint) as sub:
        deadline = time.monotonic() + 20
        while sub.live_batches == 0:  # until the subscription is through
            assert time.monotonic() < deadline
            old.publish([Event("cleared")])
            try:
                sub.poll(0.05)
            except ev.SequenceGap as gap:  # the clears sent before it
                sub.index.reset(gap.received + 1)
        for batch in BATCHES * 4:
            old.publish(batch)
        while sub.index.next_seq < old.next_seq:
            assert time.monotonic() < deadline
            sub.poll(0.05)
        with restarted(old) as new:
            sent: list[list[Event]] = []
            publish_until_restart_seen(new, sub, sent)
            found = re.search(r"starts over, empty, at batch (\d+)", caplog.text)
            assert found is not None
            first = int(found.group(1))
            while sub.index.next_seq < new.next_seq:
                assert time.monotonic() < deadline
                sub.poll(0.05)
            # Batches the new publisher sent before the subscriber reconnected are lost:
            # the index under-claims, and holds nothing of the old worker.
            assert sub.index.snapshot() == model(sent[first:], "sglang")
            assert sub.publisher_restarts == 1


DOCS_EVENTS = Path(__file__).resolve().parent.parent / "docs" / "events.md"


def doc_example(heading: str) -> str:
    """The first python block of the section `heading` of docs/events.md."""
    text = DOCS_EVENTS.read_text(encoding="utf-8")
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"^```python\n(.*?)^```", section, re.M | re.S)
    assert match is not None, f"docs/events.md, {heading}: no python block"
    return match.group(1)


def test_the_publishing_example_of_docs_events_md_runs_as_written() -> None:
    """Issue 33, item 12: it built a cache without events, whose subscribers waited for ever."""
    done = subprocess.run(
        [sys.executable, "-X", "dev", "-W", "error", "-c", doc_example("Publishing")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    lines = done.stdout.splitlines()
    assert [line.split(" on ")[0] for line in lines] == ["batch 0", "batch 1"], done.stdout
    assert all(" on tcp://127.0.0.1:" in line for line in lines), done.stdout


def test_importing_radixcache_needs_neither_zmq_nor_msgpack() -> None:
    code = (
        "import sys, radixcache, radixcache.events as e\n"
        "assert e.page_hashes([1, 2], 2)\n"
        "assert not {'zmq', 'msgpack'} & set(sys.modules), sorted(sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_missing_dependency_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "zmq", None)
    with pytest.raises(
        ImportError, match=r'needs pyzmq for this: pip install "radixcache\[events\]"'
    ):
        ev.KvEventPublisher(LOOPBACK, None)
    with pytest.raises(ImportError, match="needs pyzmq"):
        ev.KvEventSubscriber("tcp://127.0.0.1:1")
    monkeypatch.setitem(sys.modules, "msgpack", None)
    with pytest.raises(ImportError, match="needs msgpack"):
        ev.encode_batch([stored(A)])
    with pytest.raises(ImportError, match="needs msgpack"):
        ev.decode_batch(b"\x90")


# ----------------------------------------------------------------------------- SGLang's decoder


def sglang_kv_events() -> types.ModuleType:
    """SGLang 0.5.23's ``sglang.srt.disaggregation.kv_events`` from the installed wheel.

    Imported as SGLang's own processes do where that works (CI: torch installed, SGLang's
    heavy optional packages placeholders, as tests/test_sglang_backend.py sets up). Without
    torch, SGLang's import chain cannot run; then the same file of the installed wheel is
    executed on its own, with the two SGLang helpers it imports (used by its publisher
    setup, not by the structs) standing in for the duration.
    """
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("SGLang is not installed (CI installs sglang==0.5.23 --no-deps)")
    pytest.importorskip("msgspec", reason="SGLang's event structs need msgspec")
    pytest.importorskip("pydantic", reason="SGLang's kv_events module needs pydantic")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return importlib.import_module("sglang.srt.disaggregation.kv_events")
        except Exception:  # SGLang's import chain needs what this machine lacks
            pass
    spec = importlib.util.find_spec("sglang")
    assert spec is not None
    assert spec.submodule_search_locations is not None
    root = next(iter(spec.submodule_search_locations))
    path = f"{root}/srt/disaggregation/kv_events.py"
    stand_ins = {}
    for name, attrs in {
        "sglang.srt.runtime_context": ("get_parallel",),
        "sglang.srt.utils.network": ("NetworkAddress",),
    }.items():
        module = types.ModuleType(name)
        for attr in attrs:
            setattr(module, attr, _not_for_structs)
        stand_ins[name] = module
    saved = {name: sys.modules.get(name) for name in stand_ins}
    sys.modules.update(stand_ins)
    try:
        loaded = importlib.util.spec_from_file_location("_sglang_kv_events", path)
        assert loaded is not None
        assert loaded.loader is not None
        module = importlib.util.module_from_spec(loaded)
        loaded.loader.exec_module(module)
    finally:
        for name, old in saved.items():
            if old is None:
                del sys.modules[name]
            else:
                sys.modules[name] = old
    return module


def _not_for_structs(*args: object, **kwargs: object) -> None:
    raise AssertionError("an SGLang helper the event structs do not use was called")


@pytest.fixture(scope="module")
def sgl() -> types.ModuleType:
    return sglang_kv_events()


def test_sglangs_decoder_reads_every_batch(sgl: types.ModuleType) -> None:
    import msgspec

    decoder = msgspec.msgpack.Decoder(sgl.KVEventBatch)
    for batch in BATCHES:
        got = decoder.decode(ev.encode_batch(batch, ts=7.0, dp_rank=1))
        assert got.ts == 7.0
        assert got.attn_dp_rank == 1
        assert len(got.events) == len(batch)
        for wire, sent in zip(got.events, batch):
            keys = [sglang_int(h) for h in sent.hashes]
            if sent.kind == "cleared":
                assert isinstance(wire, sgl.AllBlocksCleared)
            elif sent.kind == "stored":
                assert isinstance(wire, sgl.BlockStored)
                assert wire.block_hashes == keys
                assert wire.token_ids == list(sent.token_ids)
                assert wire.block_size == sent.block_size
                assert wire.medium == sent.medium
                assert wire.lora_name == sent.namespace
                assert wire.lora_id is None
            elif sent.kind == "removed":
                assert isinstance(wire, sgl.BlockRemoved)
                assert (wire.block_hashes, wire.medium) == (keys, sent.medium)
            else:  # a state event: a removal of no blocks to SGLang, a no-op for its routers
                assert isinstance(wire, sgl.BlockRemoved)
                assert (wire.block_hashes, wire.medium) == ([], sent.medium)


def test_sglangs_decoder_refuses_a_new_event_type(sgl: types.ModuleType) -> None:
    """Why state events ride on a known type: SGLang's decoder drops a whole batch with an
    unknown one, while it ignores unknown keys of a known one."""
    import msgspec

    decoder = msgspec.msgpack.Decoder(sgl.KVEventBatch)
    new_type = msgpack.packb([1.0, [{"type": "StateStored", "block_hashes": [1]}], 0])
    with pytest.raises(msgspec.ValidationError):
        decoder.decode(new_type)
    extra_key = msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [], "x": 1}], 0])
    assert decoder.decode(extra_key).events == [sgl.BlockRemoved(block_hashes=[])]


def test_our_bytes_are_sglangs_bytes(sgl: types.ModuleType) -> None:
    import msgspec

    a = chain(A, PAGE)
    ours = [
        Event("stored", "GPU", None, tuple(a[:2]), None, tuple(A[:8]), PAGE),
        Event("stored", "CPU_PINNED", "adapter", tuple(a[2:]), a[1], tuple(A[8:]), PAGE),
        Event("removed", "EXTERNAL", None, tuple(a)),
        Event("cleared"),
    ]
    s = sglang_int
    theirs = sgl.KVEventBatch(
        ts=1234.5,
        events=[
            sgl.BlockStored(
                block_hashes=[s(a[0]), s(a[1])],
                parent_block_hash=None,
                token_ids=A[:8],
                block_size=PAGE,
                lora_id=None,
                medium=sgl.StorageMedium.GPU,
            ),
            sgl.BlockStored(
                block_hashes=[s(a[2]), s(a[3])],
                parent_block_hash=s(a[1]),
                token_ids=A[8:],
                block_size=PAGE,
                lora_id=None,
                medium=sgl.StorageMedium.CPU,
                lora_name="adapter",
            ),
            sgl.BlockRemoved(block_hashes=[s(h) for h in a], medium=sgl.StorageMedium.EXTERNAL),
            sgl.AllBlocksCleared(),
        ],
        attn_dp_rank=0,
    )
    assert ev.encode_batch(ours, ts=1234.5, dp_rank=0) == msgspec.msgpack.encode(theirs)


def free_ports(ports: list[int]) -> None:
    """Wait until `ports` can be bound (a closed socket releases its port in ZMQ's own
    thread, a moment later)."""
    deadline = time.monotonic() + 20
    for port in ports:
        while True:
            ctx = zmq.Context()
            probe = ctx.socket(zmq.PUB)
            try:
                probe.bind(f"tcp://127.0.0.1:{port}")
                break
            except zmq.ZMQError:
                assert time.monotonic() < deadline, f"port {port} stays taken"
                time.sleep(0.05)
            finally:
                probe.close(linger=0)
                ctx.term()


def test_our_subscriber_reads_sglangs_publisher(sgl: types.ModuleType) -> None:
    """SGLang's own ZmqEventPublisher (live and replay) into our subscriber and index, and
    its restart (a new ZmqEventPublisher on the same ports, numbering from 0 again)."""
    ctx = zmq.Context()
    ports = []
    for _ in range(2):  # two free ports, released for SGLang's publisher to bind
        probe = ctx.socket(zmq.PUB)
        probe.bind(LOOPBACK)
        ports.append(int(probe.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1]))
        probe.close(linger=0)
    ctx.term()

    def publisher() -> Any:
        return sgl.ZmqEventPublisher(
            attn_dp_rank=0,
            endpoint=f"tcp://127.0.0.1:{ports[0]}",
            replay_endpoint=f"tcp://127.0.0.1:{ports[1]}",
            topic="kv",
            bind=True,
        )

    pub = publisher()
    a = chain(A, PAGE)
    s = sglang_int
    batches = [
        [
            sgl.BlockStored(
                block_hashes=[s(h) for h in a],
                parent_block_hash=None,
                token_ids=A,
                block_size=PAGE,
                lora_id=None,
                medium=sgl.StorageMedium.GPU,
            )
        ],
        [sgl.BlockRemoved(block_hashes=[s(a[3])], medium=sgl.StorageMedium.GPU)],
        [
            sgl.BlockStored(
                block_hashes=[s(a[0])],
                parent_block_hash=None,
                token_ids=A[:4],
                block_size=PAGE,
                lora_id=None,
                medium=sgl.StorageMedium.CPU,
            )
        ],
    ]
    try:
        for events in batches:
            pub.publish(sgl.KVEventBatch(ts=time.time(), events=events))
        time.sleep(0.3)  # SGLang publishes from its own thread
        with ev.KvEventSubscriber(
            f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}", topic="kv"
        ) as sub:
            assert sub.catch_up() == 3
            assert sub.index.snapshot() == {
                "CPU_PINNED": (frozenset({s(a[0])}), frozenset()),
                "GPU": (frozenset(s(h) for h in a[:3]), frozenset()),
            }
            pub.shutdown()
            atexit.unregister(pub.shutdown)
            free_ports(ports)
            pub = publisher()  # the worker restarted: batch 0 again, an empty cache
            c = chain(C, PAGE)
            stored_c = sgl.BlockStored(
                block_hashes=[s(h) for h in c],
                parent_block_hash=None,
                token_ids=C,
                block_size=PAGE,
                lora_id=None,
                medium=sgl.StorageMedium.GPU,
            )
            pub.publish(sgl.KVEventBatch(ts=time.time(), events=[stored_c]))
            sub.catch_up()  # it holds no batch 2, the last one applied
            assert sub.publisher_restarts == 1
            deadline = time.monotonic() + 20
            while sub.index.next_seq == 0:  # SGLang publishes from its own thread
                assert time.monotonic() < deadline
                time.sleep(0.05)
                sub.catch_up()
            assert sub.index.snapshot() == {"GPU": (frozenset(s(h) for h in c), frozenset())}
            assert sub.publisher_restarts == 1
    finally:
        pub.shutdown()
        atexit.unregister(pub.shutdown)  # shut down already
