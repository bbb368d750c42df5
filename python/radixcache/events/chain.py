"""The page hash chain (SGLang HiCache's), and the 64-bit integers that stand for it on the wire.

Pure Python (`hashlib`), so that a router computes a prompt's page hashes itself and
compares them with the hashes a worker's events carry (`wire_hash`).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Iterable, Sequence
from typing import Literal

#: The wire formats: SGLang 0.5.23's and vLLM's (docs/events.md, "Formats").
Format = Literal["sglang", "vllm"]
FORMATS: tuple[str, ...] = ("sglang", "vllm")

#: Length of a page hash (sha256).
HASH_LEN = 32

_U32_MAX = 0xFFFF_FFFF
_U64_MASK = (1 << 64) - 1


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
