"""The list fast path: exact lists and small exact ints read from CPython's memory layout
(rust/py/src/layout.rs) must convert exactly as the C-API path does, refuse what it
refuses with the same errors, and be on wherever its self-test says the layout is known."""

from __future__ import annotations

import json
import os
import random
import sys
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import radixcache as rc
from radixcache import _core

from conftest import Index, assert_child_ok, run_child

#: Around every digit (2**30), 32-bit, 64-bit and sign boundary, and beyond 64 bits.
EDGES = [
    0, 1, 2, 5, 255, 256, 257, 2**15, 2**30 - 1, 2**30, 2**30 + 1, 2**31, 2**32 - 1,
    2**32, 2**60, 2**62, 2**63 - 1, 2**63, 2**64, 2**100,
]  # fmt: skip
EDGES += [-v for v in EDGES[1:]] + [-(2**63)]


def element(rng: random.Random) -> Any:
    roll = rng.random()
    if roll < 0.45:
        return rng.randrange(0, 2**30)
    if roll < 0.85:
        return rng.choice(EDGES)
    return rng.choice(
        [True, False, np.int64(7), np.uint32(2**32 - 1), np.int8(-3), Index(2**31), 3.0, None]
    )


def cases(n: int = 600) -> list[list[Any]]:
    """Deterministic lists: mostly valid token ids, some edge values, some non-ints."""
    rng = random.Random(20261201)
    out = []
    for _ in range(n):
        length = rng.choice([0, 1, 2, 3, 7, 40])
        valid = rng.random() < 0.4  # a third or so convert without error
        out.append([rng.randrange(0, 2**32) if valid else element(rng) for _ in range(length)])
    return out


def outcome(call: Any, arg: Any) -> list[Any]:
    try:
        return ["ok", call(arg)]
    except Exception as e:  # the outcome is what is compared
        return [type(e).__name__, str(e)]


def outcomes() -> list[list[Any]]:
    """What each case converts to, or the error it raises: as tokens (a list and a
    tuple) and as slot indices."""
    c = rc.HybridCache(kv_slots=64, page_size=1)

    def as_tokens(tokens: Any) -> list[int]:
        req = c.admit(tokens)
        assert req is not None
        try:
            c.extend(req, tokens)
            return [int(t) for t in req.tokens]
        finally:
            c.abort(req)

    result = []
    for case in cases():
        result.append(outcome(as_tokens, case))
        result.append(outcome(as_tokens, tuple(case)))
        result.append(outcome(c.free_kv, case))
    c.audit()
    return result


def test_fast_path_is_on_where_the_layout_is_known() -> None:
    # Never on a free-threaded build: another thread may change a list while it is read.
    known = (
        sys.implementation.name == "cpython"
        and (3, 9) <= sys.version_info[:2] <= (3, 14)
        and sys.int_info.bits_per_digit == 30
        and not sysconfig.get_config_var("Py_GIL_DISABLED")
        and os.environ.get("RADIXCACHE_INT_FAST_PATH", "").strip() != "0"
    )
    assert _core._int_fast_path is known


def zeros() -> list[int]:
    """Zeros made in different ways (before 3.12 a zero may have no digit at all)."""
    big = 1 << 100
    return [0, -0, int("0"), big - big, big * 0, big >> 200, int.from_bytes(b"", "big")]


def test_layout_reads_stay_inside_each_int() -> None:
    # An int of one digit is 28 bytes on 64-bit, less than its header and a digit rounded
    # up to a word; a zero before 3.12 may have no digit: the reads must stop at the
    # object's end, which sys.getsizeof gives.
    values = [*EDGES, *zeros(), 12345, -12345, 2**30 - 7]
    for v in values:
        read = _core._small_int_read(v)
        if not _core._int_fast_path:
            assert read is None
            continue
        assert read is not None
        value, size = read
        assert size <= sys.getsizeof(v), f"read {size} bytes of {v}, which has {sys.getsizeof(v)}"
        assert value == (v if abs(v) < 2**30 else None)
    with pytest.raises(TypeError, match=r"^obj: expected an exact int, got bool$"):
        _core._small_int_read(True)


def test_environment_switch_turns_the_fast_path_off() -> None:
    child = run_child("print(rc._core._int_fast_path)", env={"RADIXCACHE_INT_FAST_PATH": "0"})
    assert_child_ok(child)
    assert child.stdout.split() == ["False"]


def test_fast_path_converts_and_refuses_exactly_like_the_c_api() -> None:
    here = outcomes()
    # The cases exercise every branch: successes, range errors and type errors.
    kinds = {o[0] for o in here}
    assert {"ok", "ValueError", "TypeError"} <= kinds
    child = run_child(
        f"""
        import json
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from radixcache import _core
        assert not _core._int_fast_path
        from test_int_fast_path import outcomes
        print(json.dumps(outcomes()))
        """,
        env={"RADIXCACHE_INT_FAST_PATH": "0"},
    )
    assert_child_ok(child)
    there = json.loads(child.stdout)
    assert len(there) == len(here)
    for i, (a, b) in enumerate(zip(here, there)):
        assert a == b, f"case {i // 3} ({['list', 'tuple', 'indices'][i % 3]}): {a} != {b}"
