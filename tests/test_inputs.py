"""How arguments cross into the binding: token sequences, slot-index arrays and integer
arguments in every accepted form, and every refused one refused with an error that names
the argument and leaves the cache exactly as it was.

Inputs that used to abort the interpreter run in a child process, so that a regression
fails a test instead of killing pytest."""

from __future__ import annotations

import array
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import radixcache as rc

from conftest import Index, assert_child_ok, cached, examples, fingerprint, run_child

#: Every integer width, in both byte orders (1-byte dtypes have none: '|').
WIDTHS = ("i1", "u1", "i2", "u2", "i4", "u4", "i8", "u8")
DTYPES = [np.dtype(w).newbyteorder(o) for w in WIDTHS for o in "<>"]
NON_NATIVE = "<" if sys.byteorder == "big" else ">"

#: A cached sequence whose ids fit every dtype.
BASE = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9]

NOT_A_SEQUENCE = "expected a sequence of integers (list, tuple or 1-D integer array), got"


def strided(values: Sequence[int], dtype: np.dtype[Any], step: int) -> np.ndarray[Any, Any]:
    """A view with stride `step` elements (negative: walking backwards) holding `values`."""
    base = np.zeros(max(1, len(values) * abs(step)), dtype=dtype)
    view = base[::step][: len(values)]
    view[:] = values
    return view


def unaligned(values: Sequence[int], dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
    """A read-only array whose data starts one byte past an aligned address."""
    raw = b"\0" + np.asarray(values, dtype=dtype).tobytes()
    return np.frombuffer(raw, dtype=dtype, offset=1)


def match_of(cache: rc.HybridCache, tokens: object) -> tuple[int, list[int], rc.Node, int]:
    m = cache.match_prefix(tokens)  # type: ignore[arg-type]
    return (m.device_len, m.kv_indices.tolist(), m.node, m.kv_len)


# ------------------------------------------------------------------- accepted forms


def test_lists_tuples_and_arrays_give_the_same_match(cache: rc.HybridCache) -> None:
    cached(cache, BASE)
    query = [*BASE[:9], 42]
    expected = match_of(cache, query)
    assert expected[0] == 9
    for form in (tuple(query), np.array(query), np.array(query, dtype=np.uint32)):
        assert match_of(cache, form) == expected


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("step", [1, 2, 3, -1, -2])
def test_big_endian_and_strided_arrays_of_every_width_match_lists(
    cache: rc.HybridCache, dtype: np.dtype[Any], step: int
) -> None:
    cached(cache, BASE)
    query = BASE[:7]
    expected = match_of(cache, query)
    assert expected[0] == 7
    assert match_of(cache, strided(query, dtype, step)) == expected
    assert match_of(cache, unaligned(query, dtype)) == expected


def test_a_zero_stride_array_is_read_as_repeats(cache: rc.HybridCache) -> None:
    cached(cache, [7, 7, 7, 7, 1])
    for dtype in DTYPES:
        rep = np.broadcast_to(np.array(7, dtype=dtype), (6,))
        assert rep.strides == (0,)
        assert match_of(cache, rep) == match_of(cache, [7] * 6)


def test_slot_arrays_of_every_width_and_byte_order_are_read_exactly(
    cache: rc.HybridCache,
) -> None:
    before = fingerprint(cache)
    for dtype in DTYPES:
        for layout in ("contiguous", "strided", "unaligned"):
            slots = cache.alloc_kv(3)
            assert slots is not None
            if layout == "contiguous":
                form = slots.astype(dtype)
            elif layout == "strided":
                form = strided(slots.tolist(), dtype, -2)
            else:
                form = unaligned(slots.tolist(), dtype)
            assert form.tolist() == slots.tolist()
            cache.free_kv(form)  # a misread slot would not be held: CacheError/ValueError
            assert fingerprint(cache) == before


def test_insert_takes_slots_from_lists_tuples_and_arrays_alike() -> None:
    results = []
    for form in (list, tuple, np.array, lambda s: np.array(s, dtype=">i8")):
        c = rc.HybridCache(kv_slots=16)
        slots = c.alloc_kv(4)
        assert slots is not None
        ins = c.insert(form(BASE[:4]), form(slots.tolist()))
        results.append((ins.prefix_len, c.match_prefix(BASE).kv_indices.tolist(), str(c)))
        c.audit()
    assert all(r == results[0] for r in results)


def test_numpy_scalars_and_index_objects_are_accepted_inside_sequences(
    cache: rc.HybridCache,
) -> None:
    cached(cache, BASE)
    mixed = [np.int64(3), np.uint8(1), Index(4), np.int32(1), 5]
    assert match_of(cache, mixed) == match_of(cache, BASE[:5])
    assert match_of(cache, tuple(mixed)) == match_of(cache, BASE[:5])


def test_numpy_scalars_and_index_objects_are_accepted_as_integer_arguments(
    cache: rc.HybridCache,
) -> None:
    a = cache.alloc_kv(np.int64(2))
    b = cache.alloc_kv(Index(2))
    c = cache.alloc_kv(np.array(2))  # a 0-d integer array is an integer (operator.index)
    assert a is not None
    assert b is not None
    assert c is not None
    assert len(a) == len(b) == len(c) == 2
    cache.pretty(max_nodes=np.uint16(3), max_tokens=Index(2))


class UserSequence:
    """A sequence by the old protocol: `__len__` and `__getitem__` to IndexError."""

    def __init__(self, items: Sequence[object]) -> None:
        self.items = list(items)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> object:
        return self.items[i]


def test_other_sequences_are_read_element_by_element(cache: rc.HybridCache) -> None:
    cached(cache, [0, 1, 2, 3, 4, 5, 6, 7])
    expected = match_of(cache, [0, 1, 2, 3, 4])
    for form in (
        range(5),
        array.array("q", range(5)),
        array.array("B", range(5)),
        UserSequence(range(5)),
        UserSequence([np.int8(0), 1, Index(2), 3, np.uint64(4)]),
        memoryview(array.array("l", range(5))),
    ):
        assert match_of(cache, form) == expected, type(form)


def test_empty_inputs_of_every_form_match_nothing(cache: rc.HybridCache) -> None:
    cached(cache, BASE)
    for form in ([], (), range(0), np.array([], dtype=np.int64), np.array([], dtype=">u2")):
        assert match_of(cache, form)[0] == 0


def test_ndarray_subclasses_other_than_masked_arrays_are_read(cache: rc.HybridCache) -> None:
    class Tagged(np.ndarray):  # type: ignore[type-arg]
        pass

    cached(cache, BASE)
    assert match_of(cache, np.array(BASE[:6]).view(Tagged)) == match_of(cache, BASE[:6])


@settings(max_examples=examples(150), deadline=None)
@given(
    data=st.data(),
    dtype=st.sampled_from(DTYPES),
    step=st.sampled_from([1, 2, 3, -1, -3]),
    prefix=st.integers(0, len(BASE)),
)
def test_property_every_form_of_a_token_sequence_matches_alike(
    data: st.DataObject, dtype: np.dtype[Any], step: int, prefix: int
) -> None:
    hi = min(int(np.iinfo(dtype).max), 2**32 - 1)
    tail = data.draw(st.lists(st.integers(0, hi), max_size=24), label="tail")
    tokens = BASE[:prefix] + tail
    c = rc.HybridCache(kv_slots=128)
    cached(c, BASE)
    cached(c, [*BASE[:4], 11, 12, 13])
    expected = match_of(c, tokens)
    before = fingerprint(c)
    forms: list[object] = [
        tuple(tokens),
        np.array(tokens, dtype=dtype),
        strided(tokens, dtype, step),
        unaligned(tokens, dtype),
        np.array(tokens, dtype=np.uint32),
    ]
    for form in forms:
        assert match_of(c, form) == expected
    assert fingerprint(c) == before


# ------------------------------------------------------------------- crashers (child)


def test_broadcast_array_of_2_40_tokens_raises_memory_error_naming_tokens() -> None:
    child = run_child(
        """
        c = rc.HybridCache(kv_slots=64)
        huge = np.broadcast_to(np.int64(1), (2**40,))
        for call in (lambda: c.match_prefix(huge), lambda: c.insert(huge, [0]),
                     lambda: c.insert([1], huge), lambda: c.free_kv(huge)):
            try:
                call()
            except MemoryError as e:
                print(e)
            else:
                print("no error")
        c.audit()
        print(c.available_kv())
        """
    )
    assert_child_ok(child)
    lines = child.stdout.splitlines()
    assert lines[0] == "tokens: cannot hold 1099511627776 tokens (4398046511104 bytes)"
    assert lines[1] == lines[0]
    assert lines[2] == "kv_indices: cannot hold 1099511627776 slots (8796093022208 bytes)"
    assert lines[3] == "indices: cannot hold 1099511627776 slots (8796093022208 bytes)"
    assert lines[4] == "64"


@pytest.mark.parametrize("length", ["2**40", "sys.maxsize", "2**70"])
def test_len_that_lies_is_not_trusted(length: str) -> None:
    child = run_child(
        f"""
        class Liar:
            def __init__(self, items):
                self.items = list(items)
            def __len__(self):
                return {length}
            def __getitem__(self, i):
                return self.items[i]  # IndexError past the end
        c = rc.HybridCache(kv_slots=64)
        s = c.alloc_kv(4)
        c.insert(Liar([0, 1, 2, 3]), Liar(s.tolist()))
        print(c.match_prefix(Liar([0, 1, 2, 3, 4])).device_len)
        c.free_kv(Liar(c.alloc_kv(2).tolist()))
        print(c.available_kv())
        c.audit()
        """
    )
    assert_child_ok(child)
    assert child.stdout.split() == ["4", "60"]


def test_index_that_mutates_the_list_being_read_does_not_crash() -> None:
    child = run_child(
        """
        c = rc.HybridCache(kv_slots=64)
        class Shrink:
            def __init__(self, victim):
                self.victim = victim
            def __index__(self):
                self.victim.clear()
                return 1
        class Grow:
            def __init__(self, victim):
                self.victim = victim
            def __index__(self):
                self.victim.extend(range(2, 100_000))
                return 1
        a = [0, None, 5, 6, 7]
        a[1] = Shrink(a)
        print(c.match_prefix(a).device_len)
        b = [0, None]
        b[1] = Grow(b)
        print(c.match_prefix(b).device_len)
        c.audit()
        print("ok")
        """
    )
    assert_child_ok(child)
    assert child.stdout.split() == ["0", "0", "ok"]


def test_a_list_grown_by_index_is_read_to_its_new_end(cache: rc.HybridCache) -> None:
    # The conversion reads runs of small ints in place with room reserved for the length
    # it saw; an `__index__` that appends must not cut the read short or overrun it.
    class Grow:
        def __init__(self, victim: list[Any]) -> None:
            self.victim = victim

        def __index__(self) -> int:
            self.victim.extend(range(2, 40))
            return 1

    grown: list[Any] = [0, None]
    grown[1] = Grow(grown)
    slots = cache.alloc_kv(40)
    cache.insert(grown, slots)
    assert cache.match_prefix(list(range(40))).device_len == 40
    assert cache.match_prefix(np.arange(40)).kv_indices.tolist() == slots.tolist()
    cache.audit()


# ------------------------------------------------------------------- clear errors


class Raises:
    """An `__index__` that raises `exc`."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __index__(self) -> int:
        raise self.exc


def test_index_that_raises_is_chained(cache: rc.HybridCache) -> None:
    cached(cache, BASE)
    before = fingerprint(cache)
    boom = RuntimeError("boom")
    with pytest.raises(ValueError, match=r"^n: could not convert the Raises to an integer") as e:
        cache.alloc_kv(Raises(boom))
    assert e.value.__cause__ is boom
    bad = TypeError("not today")
    with pytest.raises(TypeError, match=r"^n: expected an integer, got Raises") as t:
        cache.alloc_kv(Raises(bad))
    assert t.value.__cause__ is bad
    with pytest.raises(
        ValueError, match=r"^tokens: could not convert the Raises at position 2"
    ) as s:
        cache.match_prefix([1, 2, Raises(boom)])
    assert s.value.__cause__ is boom
    with pytest.raises(
        TypeError, match=r"^kv_indices: expected integers, got Raises at position 0"
    ):
        cache.insert([1], [Raises(bad)])
    assert fingerprint(cache) == before


def test_index_raising_a_base_exception_is_not_wrapped(cache: rc.HybridCache) -> None:
    class Stop(BaseException):
        pass

    stop = Stop()
    with pytest.raises(Stop) as e:
        cache.alloc_kv(Raises(stop))
    assert e.value is stop
    with pytest.raises(Stop):
        cache.match_prefix([Raises(Stop())])


def test_index_returning_a_non_int_is_chained(cache: rc.HybridCache) -> None:
    class Bad:
        def __index__(self) -> int:
            return "3"  # type: ignore[return-value]

    with pytest.raises(TypeError, match=r"^n: expected an integer, got Bad") as e:
        cache.alloc_kv(Bad())
    assert isinstance(e.value.__cause__, TypeError)


def test_one_element_array_as_an_integer_is_a_type_error(cache: rc.HybridCache) -> None:
    before = fingerprint(cache)
    with pytest.raises(TypeError, match=r"^n: expected an integer, got ndarray") as e:
        cache.alloc_kv(np.array([3]))  # type: ignore[arg-type]
    assert isinstance(e.value.__cause__, TypeError)
    with pytest.raises(TypeError, match=r"^kv_tokens: expected an integer, got ndarray"):
        cache.evict(kv_tokens=np.array([3]))  # type: ignore[arg-type]
    assert fingerprint(cache) == before


def test_pretty_takes_counts(cache: rc.HybridCache) -> None:
    cached(cache, BASE)
    with pytest.raises(ValueError, match=r"^max_nodes: must be >= 0, got -1$"):
        cache.pretty(max_nodes=-1)
    with pytest.raises(ValueError, match=r"^max_tokens: must be >= 0, got -5$"):
        cache.pretty(max_tokens=-5)
    with pytest.raises(TypeError, match=r"^max_nodes: expected an integer, got float$"):
        cache.pretty(max_nodes=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^max_tokens: \d+ is out of the 64-bit range$"):
        cache.pretty(max_tokens=2**64)
    assert cache.pretty() == cache.pretty(200, 8) == str(cache)
    assert cache.pretty(max_nodes=0) != cache.pretty()


def test_out_of_range_ints_name_the_argument_the_value_and_the_position(
    cache: rc.HybridCache,
) -> None:
    cached(cache, BASE)
    before = fingerprint(cache)
    cases: list[tuple[Callable[[], object], str]] = [
        (
            lambda: cache.match_prefix([1, -1]),
            "tokens: token id -1 at position 1 is out of range [0, 2**32)",
        ),
        (
            lambda: cache.peek_prefix([1, -1]),
            "tokens: token id -1 at position 1 is out of range [0, 2**32)",
        ),
        (
            lambda: cache.match_prefix((0, 2**32)),
            "tokens: token id 4294967296 at position 1 is out of range [0, 2**32)",
        ),
        (
            lambda: cache.match_prefix([0, 0, 2**64]),
            "tokens: token id 18446744073709551616 at position 2 is out of range [0, 2**32) "
            "(outside the 64-bit range)",
        ),
        (
            lambda: cache.match_prefix(range(-(2**70), 0, 2**69)),
            "tokens: token id -1180591620717411303424 at position 0 is out of range",
        ),
        (
            lambda: cache.match_prefix(np.array([5, 2**32], dtype=np.uint64)),
            "tokens: token id 4294967296 at position 1",
        ),
        (
            lambda: cache.match_prefix(np.array([0, -3], dtype=">i2")),
            "tokens: token id -3 at position 1",
        ),
        (
            # Native int64, contiguous: converted in one pass that writes each value
            # before the range check of the whole array is known.
            lambda: cache.match_prefix(np.array([*range(40), -1, 7], dtype=np.int64)),
            "tokens: token id -1 at position 40",
        ),
        (
            lambda: cache.free_kv([0, 2**63]),
            "indices: slot 9223372036854775808 at position 1 is out of range",
        ),
        (
            lambda: cache.free_kv(np.array([2**63], dtype=np.uint64)),
            "indices: slot 9223372036854775808 at position 0",
        ),
    ]
    for call, msg in cases:
        with pytest.raises(ValueError, match="^" + re.escape(msg)):
            call()
    assert fingerprint(cache) == before


def test_huge_ints_are_described_by_size_not_printed(cache: rc.HybridCache) -> None:
    huge = 2**100_000  # str() of it raises ValueError on Python 3.11+
    with pytest.raises(ValueError, match=r"^n: a 100001-bit integer is out of the 64-bit range$"):
        cache.alloc_kv(huge)
    with pytest.raises(
        ValueError,
        match=r"^tokens: token id at position 1 is out of range \[0, 2\*\*32\): got a 100001-bit",
    ):
        cache.match_prefix([1, huge])
    with pytest.raises(ValueError, match=r"^batch_id: no batch a 100001-bit integer in flight$"):
        cache.complete(huge)


# ----------------------------------------------------------- silently accepted nonsense

BOOL_ARGUMENTS: list[tuple[str, Callable[[rc.HybridCache], object]]] = [
    ("kv_slots", lambda c: rc.HybridCache(kv_slots=True)),
    ("page_size", lambda c: rc.HybridCache(page_size=True)),
    ("mamba_slots", lambda c: rc.HybridCache(mamba_slots=False)),
    ("host_kv_slots", lambda c: rc.HybridCache(host_kv_slots=False)),
    ("host_mamba_slots", lambda c: rc.HybridCache(host_mamba_slots=False)),
    ("write_through_threshold", lambda c: rc.HybridCache(write_through_threshold=True)),
    ("n", lambda c: c.alloc_kv(True)),
    ("n", lambda c: c.alloc_kv(np.True_)),
    ("kv_tokens", lambda c: c.evict(kv_tokens=True)),
    ("mamba_states", lambda c: c.evict(mamba_states=True)),
    ("slot", lambda c: c.free_mamba(False)),
    ("owned_from", lambda c: c.insert([1], [0], owned_from=False)),
    ("mamba_slot", lambda c: c.insert([1], [0], mamba_slot=False)),
    ("mem_quota", lambda c: c.load_back(c.match_prefix([1]).node, mem_quota=True)),
    ("batch_id", lambda c: c.start(False)),
    ("batch_id", lambda c: c.complete(True)),
    ("batch_id", lambda c: c.fail(True)),
    ("max_nodes", lambda c: c.pretty(max_nodes=True)),
    ("max_tokens", lambda c: c.pretty(max_tokens=False)),
]


@pytest.mark.parametrize(("arg", "call"), BOOL_ARGUMENTS, ids=[a for a, _ in BOOL_ARGUMENTS])
def test_bool_is_refused_as_a_size_and_as_a_token(
    cache: rc.HybridCache, arg: str, call: Callable[[rc.HybridCache], object]
) -> None:
    cached(cache, BASE)
    before = fingerprint(cache)
    with pytest.raises(TypeError, match=rf"^{arg}: expected an integer, got bool$"):
        call(cache)
    assert fingerprint(cache) == before


def test_bool_is_refused_inside_sequences_and_as_an_array_dtype(cache: rc.HybridCache) -> None:
    cached(cache, BASE)
    before = fingerprint(cache)
    cases: list[tuple[Callable[[], object], str]] = [
        (
            lambda: cache.match_prefix([3, True]),
            "tokens: expected integers, got bool at position 1",
        ),
        (lambda: cache.match_prefix((False,)), "tokens: expected integers, got bool at position 0"),
        (
            lambda: cache.match_prefix([3, np.True_]),
            "tokens: expected integers, got bool at position 1",
        ),
        (
            lambda: cache.match_prefix(UserSequence([True])),
            "tokens: expected integers, got bool at position 0",
        ),
        (
            lambda: cache.insert([1], [False]),
            "kv_indices: expected integers, got bool at position 0",
        ),
        (lambda: cache.free_kv([0, True]), "indices: expected integers, got bool at position 1"),
        (
            lambda: cache.match_prefix(np.array([True, False])),
            "tokens: expected integers, got an array of dtype bool",
        ),
        (
            lambda: cache.free_kv(np.array([True])),
            "indices: expected integers, got an array of dtype bool",
        ),
    ]
    for call, msg in cases:
        with pytest.raises(TypeError, match="^" + re.escape(msg)):
            call()
    assert fingerprint(cache) == before


def test_masked_array_is_refused(cache: rc.HybridCache) -> None:
    cached(cache, BASE)
    before = fingerprint(cache)
    masked = np.ma.masked_array(BASE[:4], mask=[0, 1, 0, 0])
    msg = re.escape(
        "got a masked array (its mask would be ignored); pass .filled(value) or .compressed()"
    )
    with pytest.raises(TypeError, match=r"^tokens: expected a plain integer array, " + msg):
        cache.match_prefix(masked)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^kv_indices: expected a plain integer array"):
        cache.insert([1], np.ma.masked_array([0]))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^tokens: expected a plain integer array"):
        cache.match_prefix(np.ma.masked_array(BASE[:4]))  # even with no element masked
    assert fingerprint(cache) == before
    # what the message suggests works
    assert cache.match_prefix(masked.compressed()).device_len == 1
    assert cache.match_prefix(masked.filled(1)).device_len == 4


def _generator() -> Iterator[int]:
    yield from BASE[:3]


REFUSED_CONTAINERS: list[tuple[str, Callable[[], object]]] = [
    ("set", lambda: set(BASE[:3])),
    ("frozenset", lambda: frozenset(BASE[:3])),
    ("dict", lambda: dict.fromkeys(BASE[:3])),
    ("dict_keys", lambda: dict.fromkeys(BASE[:3]).keys()),
    ("dict_values", lambda: {1: 3, 2: 1}.values()),
    ("dict_items", lambda: {3: 1}.items()),
    ("generator", _generator),
    ("list_iterator", lambda: iter(BASE[:3])),
    ("map", lambda: map(int, BASE[:3])),
    ("str", lambda: "abc"),
    ("bytes", lambda: b"\x03\x01"),
    ("bytearray", lambda: bytearray(b"\x03\x01")),
    ("NoneType", lambda: None),
    ("int", lambda: 3),
    ("int64", lambda: np.int64(3)),
]


@pytest.mark.parametrize(
    ("name", "make"), REFUSED_CONTAINERS, ids=[n for n, _ in REFUSED_CONTAINERS]
)
def test_set_and_dict_are_refused_as_token_sequences(
    cache: rc.HybridCache, name: str, make: Callable[[], object]
) -> None:
    cached(cache, BASE)
    before = fingerprint(cache)
    stats = cache.stats()
    with pytest.raises(TypeError, match="^" + re.escape(f"tokens: {NOT_A_SEQUENCE} {name}") + "$"):
        cache.match_prefix(make())  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match="^" + re.escape(f"kv_indices: {NOT_A_SEQUENCE} {name}") + "$"
    ):
        cache.insert([1, 2, 3], make())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="^" + re.escape(f"indices: {NOT_A_SEQUENCE} {name}") + "$"):
        cache.free_kv(make())  # type: ignore[arg-type]
    assert fingerprint(cache) == before
    assert cache.stats() == stats


def test_arrays_that_are_not_1_d_integer_arrays_are_refused(cache: rc.HybridCache) -> None:
    cached(cache, BASE)
    before = fingerprint(cache)
    cases: list[tuple[object, type[Exception], str]] = [
        (np.array(3), ValueError, "tokens: expected a 1-D sequence of integers, got a 0-D array"),
        (
            np.zeros((2, 2), dtype=np.int64),
            ValueError,
            "tokens: expected a 1-D sequence of integers, got a 2-D array",
        ),
        (np.array([1.0]), TypeError, "tokens: expected integers, got an array of dtype float64"),
        (
            np.array([1], dtype=object),
            TypeError,
            "tokens: expected integers, got an array of dtype object",
        ),
        (np.array(["a"]), TypeError, "tokens: expected integers, got an array of dtype <U1"),
        (
            np.array([1], dtype="M8[s]"),
            TypeError,
            "tokens: expected integers, got an array of dtype datetime64[s]",
        ),
        (
            np.array([1], dtype="m8[s]"),
            TypeError,
            "tokens: expected integers, got an array of dtype timedelta64[s]",
        ),
    ]
    for tokens, exc, msg in cases:
        with pytest.raises(exc, match="^" + re.escape(msg) + "$"):
            cache.match_prefix(tokens)  # type: ignore[arg-type]
    assert fingerprint(cache) == before
