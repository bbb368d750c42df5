"""Storage refuses, at construction and naming the argument, every layout that would let
the engine serve a slot whose bytes are not its prefix's: tiers that disagree, memory
shared between arrays, read-only or non-numeric arrays, overlapping rows, bad counts."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import radixcache as rc


def kv_pair(layers: int = 2, slots: int = 8, row: tuple[int, ...] = (2, 4)) -> tuple[Any, Any]:
    shape = (layers, slots, *row)
    return np.zeros(shape, dtype=np.float16), np.zeros(shape, dtype=np.float16)


def small_cache() -> rc.HybridCache:
    return rc.HybridCache(
        kv_slots=8, page_size=2, mamba_slots=2, host_kv_slots=8, host_mamba_slots=2
    )


# ------------------------------------------------------------- tiers of one pool agree


def test_a_host_tier_of_another_dtype_is_refused_not_cast() -> None:
    k, v = kv_pair()
    with pytest.raises(
        ValueError, match=r"^kv\['host'\]\[0\]: dtype float32 differs from the device tier's"
    ):
        rc.Storage(kv={"device": (k, v), "host": (k.astype(np.float32), v.copy())})
    conv = np.zeros((2, 2, 3), dtype=np.uint16)
    ssm = np.zeros((2, 2, 4), dtype=np.float32)
    with pytest.raises(ValueError, match=r"^mamba\['host'\]\[1\]: dtype float16 differs"):
        rc.Storage(mamba={"device": (conv, ssm), "host": (conv.copy(), ssm.astype(np.float16))})


def test_a_host_tier_of_another_row_layout_or_layer_count_is_refused() -> None:
    k, v = kv_pair(row=(2, 4))
    transposed = np.zeros((2, 8, 4, 2), dtype=np.float16)  # the same bytes per row
    with pytest.raises(ValueError, match=r"^kv\['host'\]\[0\]: 2 layers of rows \(4, 2\)"):
        rc.Storage(kv={"device": (k, v), "host": (transposed, v.copy())})
    # One layer on the host would broadcast into every device layer on a load-back.
    one_layer = np.zeros((1, 8, 2, 4), dtype=np.float16)
    with pytest.raises(ValueError, match=r"^kv\['host'\]\[1\]: 1 layers of rows \(2, 4\)"):
        rc.Storage(kv={"device": (k, v), "host": (k.copy(), one_layer)})


def test_tiers_that_agree_may_differ_in_slot_count() -> None:
    k, v = kv_pair(slots=8)
    hk, hv = kv_pair(slots=32)
    s = rc.Storage(kv={"device": (k, v), "host": (hk, hv)})
    assert (s.pool("kv", "device").slots, s.pool("kv", "host").slots) == (8, 32)


# ------------------------------------------------------------- no memory shared


def test_k_given_as_v_is_refused() -> None:
    k, _ = kv_pair()
    with pytest.raises(
        ValueError, match=r"^kv\['device'\]\[1\]: shares memory with kv\['device'\]\[0\]"
    ):
        rc.Storage(kv={"device": (k, k)})


def test_the_same_arrays_for_two_tiers_are_refused() -> None:
    k, v = kv_pair()
    with pytest.raises(
        ValueError, match=r"^kv\['host'\]\[0\]: shares memory with kv\['device'\]\[0\]"
    ):
        rc.Storage(kv={"device": (k, v), "host": (k, v)})


def test_overlapping_views_for_two_tiers_are_refused() -> None:
    big = np.zeros((2, 16, 2, 4), dtype=np.float16)
    v = np.zeros((2, 8, 2, 4), dtype=np.float16)
    # Host slot 0 is device slot 7: a load-back would write a cached device row.
    with pytest.raises(
        ValueError, match=r"^kv\['host'\]\[0\]: shares memory with kv\['device'\]\[0\]"
    ):
        rc.Storage(kv={"device": (big[:, :8], v), "host": (big[:, 7:15], v.copy())})


def test_one_array_for_two_pools_is_refused() -> None:
    k, v = kv_pair()
    ssm = np.zeros((2, 2, 4), dtype=np.float32)
    with pytest.raises(
        ValueError, match=r"^mamba\['device'\]\[0\]: shares memory with kv\['device'\]\[0\]"
    ):
        rc.Storage(kv={"device": (k, v)}, mamba={"device": (k[:, :2], ssm)})


def test_interleaved_views_of_one_fused_tensor_share_no_byte_and_are_accepted() -> None:
    """A fused ``[layers, slots, 2, heads, dim]`` KV tensor split into K and V: the
    views' spans interleave, their bytes do not; copies keep K and V apart."""
    c = small_cache()
    fused = np.zeros((2, 8, 2, 2, 4), dtype=np.float16)
    host = np.zeros((2, 8, 2, 2, 4), dtype=np.float16)
    conv = np.zeros((1, 2, 3), dtype=np.uint16)
    ssm = np.zeros((1, 2, 4), dtype=np.float32)
    s = rc.Storage(
        kv={"device": (fused[:, :, 0], fused[:, :, 1]), "host": (host[:, :, 0], host[:, :, 1])},
        mamba={"device": (conv, ssm), "host": (conv.copy(), ssm.copy())},
    )
    e = rc.TransferEngine(c, s)
    fused[:, :, 0] = 1.0
    fused[:, :, 1] = 2.0
    slots = c.alloc_kv(4)
    assert slots is not None
    c.insert([1, 2, 3, 4], slots, mamba_slot=c.alloc_mamba())
    assert e.run_pending() == 1
    hk, hv = s.kv["host"]
    assert bool((hk[:, :4] == 1.0).all())
    assert bool((hv[:, :4] == 2.0).all())


# ------------------------------------------------------------- each array on its own


def test_a_read_only_array_is_refused() -> None:
    k, v = kv_pair()
    v.setflags(write=False)
    with pytest.raises(ValueError, match=r"^kv\['device'\]\[1\]: the array is read-only"):
        rc.Storage(kv={"device": (k, v)})
    with pytest.raises(ValueError, match=r"^kv\['device'\]\[0\]: the array is read-only"):
        rc.Storage(kv={"device": (np.broadcast_to(k[:1], k.shape), k.copy())})


@pytest.mark.parametrize("dtype", [object, bool, "U4", "datetime64[s]"])
def test_an_array_of_a_non_numeric_dtype_is_refused(dtype: Any) -> None:
    k, v = kv_pair()
    with pytest.raises(TypeError, match=r"^kv\['device'\]\[0\]: expected a numeric dtype"):
        rc.Storage(kv={"device": (np.zeros(k.shape, dtype=dtype), v)})


def test_an_empty_array_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^kv\['device'\]\[0\]: every dimension must be >= 1"):
        rc.Storage(kv={"device": (np.zeros((2, 8, 0)), np.zeros((2, 8, 4)))})


def test_rows_of_different_layers_that_overlap_are_refused() -> None:
    base = np.zeros((2, 8, 4), dtype=np.float16)
    v = np.zeros((2, 8, 4), dtype=np.float16)
    # Layer 1 is layer 0 shifted by one slot: writing a slot of one writes the other.
    shifted = np.lib.stride_tricks.as_strided(base, shape=(2, 7, 4), strides=(8, 8, 2))
    with pytest.raises(ValueError, match=r"^kv\['device'\]\[0\]: rows of different layers"):
        rc.Storage(kv={"device": (shifted, v[:, :7])})
    same = np.lib.stride_tricks.as_strided(base, shape=(2, 8, 4), strides=(0, 8, 2))
    with pytest.raises(ValueError, match=r"^kv\['device'\]\[0\]: rows of different layers"):
        rc.Storage(kv={"device": (same, v)})


def test_a_pool_given_as_a_bad_type_is_refused_naming_it() -> None:
    k, v = kv_pair()
    with pytest.raises(TypeError, match=r"^kv: expected a mapping of tier to two arrays, got list"):
        rc.Storage(kv=[k, v])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^mamba\['host'\]: expected two arrays"):
        rc.Storage(mamba={"host": k})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match=r"^pinned_host: expected a bool"):
        rc.Storage(kv={"device": (k, v)}, pinned_host="yes")  # type: ignore[arg-type]


# ------------------------------------------------------------- counts, named


@pytest.mark.parametrize(
    ("arg", "value", "least"),
    [
        ("kv_heads", 0, 1),
        ("head_dim", 0, 1),
        ("layers", 0, 1),
        ("layers", True, 1),
        ("mamba_layers", -1, 1),
        ("mamba_layers", 0, 1),
        ("kv_slots", -1, 0),
        ("host_kv_slots", 2.0, 0),
        ("mamba_slots", False, 0),
    ],
)
def test_a_bad_count_is_refused_naming_it(arg: str, value: object, least: int) -> None:
    model: dict[str, Any] = {"kv_slots": 8, "layers": 2, "kv_heads": 2, "head_dim": 4}
    model[arg] = value
    with pytest.raises(ValueError, match=rf"^{arg}: expected a count >= {least}, got {value!r}"):
        rc.Storage.for_model(**model)


def test_a_bad_state_shape_or_dtype_is_refused_naming_it() -> None:
    base: dict[str, Any] = {"kv_slots": 8, "mamba_slots": 2, "layers": 2}
    with pytest.raises(ValueError, match=r"^conv_shape\[1\]: expected a count >= 1, got 0"):
        rc.Storage.for_model(**base, conv_shape=(3, 0))
    with pytest.raises(ValueError, match=r"^ssm_shape: expected a tuple of sizes"):
        rc.Storage.for_model(**base, ssm_shape=[4])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^conv_dtype: expected a numeric dtype"):
        rc.Storage.for_model(**base, conv_dtype="object")


def test_for_cache_and_the_engine_refuse_what_is_not_a_cache_or_a_storage() -> None:
    with pytest.raises(TypeError, match=r"^cache: expected a HybridCache, got object"):
        rc.Storage.for_cache(object(), layers=1)  # type: ignore[arg-type]
    c = small_cache()
    s = rc.Storage.for_cache(c, layers=1)
    with pytest.raises(TypeError, match=r"^storage: expected a Storage, got NoneType"):
        rc.TransferEngine(c, None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^cache: expected a HybridCache, got NoneType"):
        rc.TransferEngine(None, s)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^cache: expected a HybridCache, got str"):
        s.check("cache")  # type: ignore[arg-type]


# ------------------------------------------------------------- sizes, named


@pytest.mark.parametrize(
    ("model", "message"),
    [
        # More than an address space: refused before anything is allocated.
        ({"kv_slots": 2**62}, r"^kv_slots: 4611686018427387904 makes kv\['device'\]\[0\] .*EiB"),
        ({"kv_heads": 2**70}, r"^kv_heads: 1180591620717411303424 makes kv\['device'\]\[0\]"),
        (
            {"host_kv_slots": 2**62},
            r"^host_kv_slots: 4611686018427387904 makes kv\['host'\]\[0\]",
        ),
        # More than this machine has: the allocator's refusal, named.
        (
            {"head_dim": 2**40},
            r"^head_dim: 1099511627776 makes kv\['device'\]\[0\] 256 TiB \(shape \(2, 8, 8, "
            r"1099511627776\) of float16\), which cannot be allocated on the device$",
        ),
        (
            {"mamba_slots": 2, "ssm_shape": (4, 2**40)},
            r"^ssm_shape\[1\]: 1099511627776 makes mamba\['device'\]\[1\] 64 TiB",
        ),
    ],
)
def test_an_impossible_size_is_a_memory_error_naming_the_argument(
    model: dict[str, Any], message: str
) -> None:
    """NumPy's errors for these named no argument (a ValueError for 2**62 slots)."""
    with pytest.raises(MemoryError, match=message):
        rc.Storage.for_model(**{"kv_slots": 8, "layers": 2, **model})


@pytest.mark.parametrize("arg", ["dtype", "ssm_dtype"])
def test_a_dtype_of_none_is_refused_not_taken_as_float64(arg: str) -> None:
    with pytest.raises(ValueError, match=rf"^{arg}: expected a dtype name, got None"):
        rc.Storage.for_model(kv_slots=8, mamba_slots=2, layers=2, **{arg: None})
    with pytest.raises(ValueError, match=r"^dtype: unknown dtype 5"):
        rc.Storage.for_model(kv_slots=8, layers=2, dtype=5)  # type: ignore[arg-type]
