"""Page hashes (docs/design.md, "Page hashes"): the chain every cached page carries,
its namespace seeds, `Match.last_hash`, `HybridCache.page_hashes`, the `chain_hashes`
helpers, and the errors of the new arguments. Expected digests are computed here with
`hashlib` from the definition, independently of the core."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest

import radixcache as rc
from radixcache import _core

from conftest import cached, fingerprint


def by_hand(tokens: list[int], page_size: int, prior: bytes | None = None) -> list[bytes]:
    """sha256(prior || page tokens as uint32 little-endian), page after page."""
    out = []
    for start in range(0, len(tokens) - len(tokens) % page_size, page_size):
        page = struct.pack(f"<{page_size}I", *tokens[start : start + page_size])
        digest = hashlib.sha256((prior or b"") + page).digest()
        out.append(digest)
        prior = digest
    return out


def sglang_seed(name: str) -> bytes:
    """SGLang's storage_namespace_seed(extra_key=name, cache_salt=None), written out."""
    encoded = name.encode()
    data = (
        b"sglang-cache-namespace-v1"
        + b"\x01"
        + len(encoded).to_bytes(8, "little")
        + encoded
        + b"\x00"
    )
    return hashlib.sha256(data).digest()


def seeded(seed: bytes, name: str) -> bytes:
    """A named namespace's seed derived from a hash_seed."""
    encoded = name.encode()
    data = b"radixcache-namespace-v1" + seed + len(encoded).to_bytes(8, "little") + encoded
    return hashlib.sha256(data).digest()


# ------------------------------------------------------------------ the pure helper


def test_chain_hashes_is_sha256_of_the_prior_and_the_pages_tokens() -> None:
    tokens = [1, 2, 3, 2**32 - 1, 7]
    assert _core.chain_hashes(tokens, 2) == by_hand(tokens, 2)
    assert len(_core.chain_hashes(tokens, 2)) == 2, "the unaligned tail is not hashed"
    prior = bytes(range(32))
    assert _core.chain_hashes(tokens, 1, prior) == by_hand(tokens, 1, prior)
    assert _core.chain_hashes([], 4) == []


def test_chain_hashes_takes_numpy_tokens_of_any_integer_dtype() -> None:
    tokens = list(range(40))
    want = by_hand(tokens, 16)
    for dtype in (np.int64, np.uint32, np.int32, np.uint16):
        assert _core.chain_hashes(np.array(tokens, dtype=dtype), 16) == want


def test_a_chain_continues_from_any_page_hash() -> None:
    tokens = list(range(64))
    whole = _core.chain_hashes(tokens, 16)
    assert _core.chain_hashes(tokens[32:], 16, whole[1]) == whole[2:]


@pytest.mark.parametrize(
    ("kwargs", "exc", "arg"),
    [
        ({"page_size": 0}, ValueError, "page_size"),
        ({"page_size": 2, "prior": b"short"}, ValueError, "prior"),
        ({"page_size": 2, "prior": "x" * 32}, TypeError, "prior"),
        ({"page_size": 2, "prior": bytearray(32)}, TypeError, "prior"),
    ],
)
def test_chain_hashes_errors_name_the_argument(
    kwargs: dict[str, object], exc: type[Exception], arg: str
) -> None:
    with pytest.raises(exc, match=arg):
        _core.chain_hashes([1, 2], **kwargs)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="tokens"):
        _core.chain_hashes({1, 2}, 2)  # type: ignore[arg-type]


# ------------------------------------------------------------------ nodes and matches


def test_every_cached_page_carries_its_chain_and_a_split_keeps_it() -> None:
    c = rc.HybridCache(kv_slots=64, page_size=2, page_hashes=True)
    a = cached(c, list(range(1, 9))).node
    assert c.page_hashes(a) == by_hand(list(range(1, 9)), 2)
    # A branch after two pages splits the node there.
    b = cached(c, [1, 2, 3, 4, 9, 9]).node
    m = c.match_prefix([1, 2, 3, 4])
    assert c.page_hashes(m.node) == by_hand([1, 2, 3, 4], 2)
    assert c.page_hashes(a) == by_hand(list(range(1, 9)), 2)[2:]
    assert c.page_hashes(b) == by_hand([1, 2, 3, 4, 9, 9], 2)[2:]
    c.audit()


def test_match_last_hash_is_the_last_matched_pages_and_chains_the_rest() -> None:
    c = rc.HybridCache(kv_slots=64, page_size=2, page_hashes=True)
    cached(c, list(range(1, 9)))
    prompt = [1, 2, 3, 4, 5, 6, 70, 71, 72]
    m = c.match_prefix(prompt)
    assert m.device_len == 6
    assert m.last_hash == by_hand(prompt, 2)[2]
    assert c.chain_hashes(prompt[6:], parent_hash=m.last_hash) == by_hand(prompt, 2)[3:]
    assert c.match_prefix([5, 5]).last_hash is None, "nothing matched"
    c.audit()


def test_peek_hash_is_where_the_kv_match_ends_and_changes_nothing() -> None:
    c = rc.HybridCache(kv_slots=64, page_size=2, host_kv_slots=64, page_hashes=True)
    cached(c, list(range(1, 9)))
    for b in c.take_batches():
        b.start()
        b.complete()
    c.evict(kv_tokens=8)  # on the host only now: the peek counts either tier
    cached(c, [1, 2, 50, 51])
    before = fingerprint(c)
    prompt = [1, 2, 3, 4, 5, 70, 71]
    assert c.peek_hash(prompt) == (4, by_hand(prompt, 2)[1])
    assert c.peek_hash(np.array(prompt, dtype=np.uint32)) == (4, by_hand(prompt, 2)[1])
    assert fingerprint(c) == before, "a peek splits, refreshes and counts nothing"
    kv_len, last = c.peek_hash(list(range(1, 12)))
    assert (kv_len, last) == (8, by_hand(list(range(1, 9)), 2)[3])
    rest = list(range(1, 12))[kv_len:10]
    assert c.chain_hashes(rest, parent_hash=last) == by_hand(list(range(1, 12)), 2)[4:5]
    assert c.peek_hash([9, 9, 9]) == (0, None)
    assert c.peek_hash([1, 2, 50, 51], namespace="other") == (0, None)
    with pytest.raises(TypeError, match=r"^tokens"):
        c.peek_hash("abc")  # type: ignore[arg-type]
    plain = rc.HybridCache(kv_slots=64, page_size=2)
    cached(plain, [1, 2, 3, 4])
    assert plain.peek_hash([1, 2, 3, 4]) == (4, None)


def test_a_host_only_match_reports_its_last_hash() -> None:
    c = rc.HybridCache(kv_slots=64, page_size=2, host_kv_slots=64, page_hashes=True)
    node = cached(c, [1, 2, 3, 4]).node
    for b in c.take_batches():
        b.start()
        b.complete()
    c.evict(kv_tokens=4)
    m = c.match_prefix([1, 2, 3, 4])
    assert (m.device_len, m.host_len) == (0, 4)
    assert m.last_hash == by_hand([1, 2, 3, 4], 2)[1]
    assert c.page_hashes(node) == by_hand([1, 2, 3, 4], 2)
    c.audit()


def test_a_named_namespace_is_seeded_as_sglang_seeds_an_extra_key() -> None:
    c = rc.HybridCache(kv_slots=64, page_size=2, page_hashes=True)
    node = cached(c, [1, 2, 3, 4], namespace="lora-a").node
    want = by_hand([1, 2, 3, 4], 2, sglang_seed("lora-a"))
    assert c.page_hashes(node) == want
    assert c.chain_hashes([1, 2, 3, 4], namespace="lora-a") == want
    # The default namespace has no prior: SGLang's chain without a namespace.
    assert c.chain_hashes([1, 2, 3, 4]) == by_hand([1, 2, 3, 4], 2)
    c.audit()


def test_hash_seed_seeds_the_default_namespace_and_the_named_ones() -> None:
    seed = bytes(range(100, 132))
    c = rc.HybridCache(kv_slots=64, page_size=2, page_hashes=True, hash_seed=seed)
    a = cached(c, [1, 2, 3, 4]).node
    b = cached(c, [1, 2, 3, 4], namespace="t").node
    assert c.page_hashes(a) == by_hand([1, 2, 3, 4], 2, seed)
    assert c.page_hashes(b) == by_hand([1, 2, 3, 4], 2, seeded(seed, "t"))
    c.audit()


def test_without_page_hashes_there_are_none() -> None:
    c = rc.HybridCache(kv_slots=64, page_size=2)
    node = cached(c, [1, 2, 3, 4]).node
    with pytest.raises(ValueError, match="page_hashes"):
        c.page_hashes(node)
    assert c.match_prefix([1, 2, 3, 4]).last_hash is None
    # The helper reads no tree: it works all the same.
    assert c.chain_hashes([1, 2, 3, 4]) == by_hand([1, 2, 3, 4], 2)


def test_page_hashes_of_an_evicted_node_raise_stale_node() -> None:
    c = rc.HybridCache(kv_slots=64, page_size=2, page_hashes=True)
    node = cached(c, [1, 2]).node
    c.evict(kv_tokens=2)
    with pytest.raises(rc.StaleNodeError):
        c.page_hashes(node)


@pytest.mark.parametrize(
    ("kwargs", "exc"),
    [
        ({"page_hashes": True, "hash_seed": b"x" * 31}, ValueError),
        ({"page_hashes": True, "hash_seed": "x" * 32}, TypeError),
        ({"page_hashes": True, "hash_seed": 5}, TypeError),
        ({"hash_seed": b"x" * 32}, ValueError),
    ],
)
def test_a_bad_hash_seed_is_refused_naming_it(
    kwargs: dict[str, object], exc: type[Exception]
) -> None:
    with pytest.raises(exc, match="hash_seed"):
        rc.HybridCache(kv_slots=64, **kwargs)  # type: ignore[arg-type]


def test_a_bad_parent_hash_is_refused_naming_it() -> None:
    c = rc.HybridCache(kv_slots=64, page_hashes=True)
    with pytest.raises(ValueError, match="parent_hash"):
        c.chain_hashes([1], parent_hash=b"1")
