"""Storage: the arrays that hold KV entries, SWA KV and Mamba states, per tier and pool.

The core hands out slot indices; a `Storage` owns (or wraps) the memory they index:

* KV, per tier: ``k`` and ``v`` of shape ``[layers, slots, heads, head_dim]``.
* Sliding-window attention (SWA) KV, per tier: ``k`` and ``v`` of the SWA layers,
  ``[swa_layers, swa_slots, heads, head_dim]``, indexed by SWA slot (the cache's
  ``Request.swa_indices``; copies of pool ``"swa"``).
* Mamba, per tier: ``conv`` of shape ``[layers, slots, *conv_shape]`` and ``ssm`` of shape
  ``[layers, slots, *ssm_shape]``, each with its own dtype (SSM in float32, conv in
  bfloat16 by default, as real models keep them).

The slot axis is axis 1 of every array; what follows it (one slot's row in one layer)
must be contiguous. The engine moves rows, never reads values, so the arrays may hold
any numeric dtype. NumPy and CuPy have no bfloat16: such arrays are allocated as
``uint16`` (the same bytes; torch bfloat16 tensors are taken as ``uint16`` too); a torch
engine views them back with ``tensor.view(torch.bfloat16)``.

A `Storage` checks at construction everything that would otherwise serve wrong bytes in
silence: the arrays are writable, numeric, non-empty, with contiguous rows that do not
overlap one another; the tiers of one pool agree, array by array, in dtype, layer count
and row shape (a copy between tiers moves bytes, never converts); and no two arrays
(of one pool, of two tiers, of two pools) share a byte of memory.

Device arrays are CuPy arrays on a GPU, NumPy arrays on a CPU-only machine (where the
"device" tier is ordinary memory and the engine copies with NumPy). Host arrays are
pinned, mapped memory on a GPU machine (the copy kernels read and write them directly)
and plain NumPy otherwise. Arrays an engine already owns (NumPy, CuPy, or torch tensors,
taken through DLPack without a copy) are wrapped with `Storage(...)`.
"""

from __future__ import annotations

import importlib
import itertools
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ._core import HybridCache
from ._kernels import _cupy

__all__ = ["Pool", "Storage"]

TIERS: tuple[Literal["device", "host"], ...] = ("device", "host")
#: The pools a `Storage` may hold (a `Copy`'s ``pool``).
POOLS = ("kv", "mamba", "swa")


@dataclass(frozen=True)
class Pool:
    """One pool on one tier: arrays with the slot index on axis 1.

    Attributes:
        arrays: The arrays (``(k, v)`` or ``(conv, ssm)``), each ``[layers, slots, ...]``.
        slots: Slots in the pool.
        on_gpu: Whether the arrays are CuPy arrays (GPU memory).
        pinned: NumPy arrays in pinned host memory (mapped: the copy kernels reach them).
    """

    arrays: tuple[Any, ...]
    slots: int
    on_gpu: bool
    pinned: bool = False

    @property
    def buffers(self) -> list[tuple[int, int, int]]:
        """Every (layer, array) buffer as ``(address, slot stride, row bytes)``."""
        return [
            (_address(a) + layer * a.strides[0], a.strides[1], _row_bytes(a))
            for a in self.arrays
            for layer in range(a.shape[0])
        ]

    @property
    def bytes_per_slot(self) -> int:
        """Bytes one slot holds over every layer and array."""
        return sum(a.shape[0] * _row_bytes(a) for a in self.arrays)


def _row_bytes(a: Any) -> int:
    return int(math.prod(a.shape[2:])) * int(a.itemsize)


def _address(a: Any) -> int:
    if isinstance(a, np.ndarray):
        return int(a.ctypes.data)
    return int(a.data.ptr)


def _library(a: Any) -> str:
    """Return the top-level package of `a`'s type (``"torch"``, ``"cupy"``, ...)."""
    return type(a).__module__.split(".")[0]


def _adopt(a: Any, name: str, pinned: bool) -> tuple[Any, bool]:
    """Take `a` as a NumPy or CuPy array sharing its memory, and say if it is pinned.

    Torch tensors are taken through DLPack (no copy); bfloat16 ones as ``uint16``, as
    `Storage.for_model` allocates bfloat16.
    """
    if _library(a) == "torch":
        torch = importlib.import_module("torch")  # optional: only for torch tensors

        pinned = a.device.type == "cpu" and bool(a.is_pinned())
        bf16 = a.dtype == torch.bfloat16
        if bf16:
            a = a.view(torch.int16)  # DLPack consumers here have no bfloat16
        if a.device.type == "cuda":
            cupy = _cupy()
            taken = cupy.from_dlpack(a)
            return (taken.view(cupy.uint16) if bf16 else taken), False
        if a.device.type != "cpu":
            raise ValueError(f"{name}: a torch tensor on {a.device} (cpu or cuda expected)")
        host = np.from_dlpack(a)
        return (host.view(np.uint16) if bf16 else host), pinned
    if isinstance(a, np.ndarray):
        return a, pinned
    if _library(a) == "cupy":
        return a, False
    raise TypeError(f"{name}: expected a numpy array, a cupy array or a torch tensor, got {a!r}")


#: Dtype kinds the engine moves: signed and unsigned integers, floats, complex numbers.
_NUMERIC_KINDS = "iufc"


def _check_array(a: Any, name: str) -> None:
    """Refuse an array the engine cannot copy rows of, byte for byte, naming `name`."""
    if a.dtype.kind not in _NUMERIC_KINDS:
        raise TypeError(f"{name}: expected a numeric dtype, got {a.dtype}")
    if isinstance(a, np.ndarray) and not a.flags.writeable:
        raise ValueError(f"{name}: the array is read-only (copies write every tier)")
    if a.ndim < 2:
        raise ValueError(f"{name}: expected [layers, slots, ...], got shape {tuple(a.shape)}")
    if 0 in a.shape:
        raise ValueError(f"{name}: every dimension must be >= 1, got shape {tuple(a.shape)}")
    row = _row_bytes(a)
    expect = int(a.itemsize)
    for dim, stride in zip(reversed(a.shape[2:]), reversed(a.strides[2:])):
        if dim > 1 and stride != expect:
            raise ValueError(f"{name}: one slot's row in a layer must be contiguous")
        expect *= dim
    if a.shape[1] > 1 and abs(a.strides[1]) < row:
        raise ValueError(f"{name}: slots overlap (slot stride {a.strides[1]} < row {row} B)")
    if _rows_alias(a):
        raise ValueError(
            f"{name}: rows of different layers overlap (layer stride {a.strides[0]},"
            f" slot stride {a.strides[1]}, row {row} B)"
        )


def _rows_alias(a: Any) -> bool:
    """Whether two distinct ``(layer, slot)`` rows of `a` share a byte.

    Rows of one layer are known apart (slot stride >= row). Row ``(l, i)`` starts at
    ``l * s0 + i * s1``; rows ``dl`` layers and ``di`` slots apart overlap when
    ``|dl * s0 + di * s1| < row``, which for each ``dl`` at most two ``di`` can meet.
    """
    layers, slots = int(a.shape[0]), int(a.shape[1])
    s0, s1 = int(a.strides[0]), int(a.strides[1])
    row = _row_bytes(a)
    for dl in range(1, layers):
        x = dl * s0
        if slots == 1 or s1 == 0:
            candidates = [0]
        else:
            q = -x // s1
            candidates = [q, q + 1]
        if any(abs(di) < slots and abs(x + di * s1) < row for di in candidates):
            return True
    return False


def _extent(a: Any) -> tuple[int, int]:
    """Return the bytes `a` spans, ``[low, high)``, from its data pointer and strides."""
    low = high = _address(a)
    for dim, stride in zip(a.shape, a.strides):
        reach = (int(dim) - 1) * int(stride)
        if reach < 0:
            low += reach
        else:
            high += reach
    return low, high + int(a.itemsize)


class _Footprint:
    """The bytes one array's rows occupy, as a NumPy view that is never read.

    ``[layers, slots, row bytes]`` over `a`'s data pointer and strides, so that
    ``np.shares_memory`` decides exactly whether two arrays share a byte, for NumPy,
    CuPy (device pointers) and torch arrays alike, without touching their memory.
    """

    def __init__(self, a: Any) -> None:
        self.__array_interface__ = {
            "version": 3,
            "typestr": "|u1",
            "data": (_address(a), False),
            "shape": (int(a.shape[0]), int(a.shape[1]), _row_bytes(a)),
            "strides": (int(a.strides[0]), int(a.strides[1]), 1),
        }


#: Work bound for the exact overlap test; past it two arrays count as overlapping.
_OVERLAP_WORK = 1 << 20
#: ``np.shares_memory``, whose stubs admit only the two special ``max_work`` values.
_shares_memory: Any = np.shares_memory


def _overlap(a: Any, b: Any) -> bool:
    """Whether arrays `a` and `b` (each checked by `_check_array`) share a byte."""
    (a_low, a_high), (b_low, b_high) = _extent(a), _extent(b)
    if a_high <= b_low or b_high <= a_low:
        return False
    # Interleaved (one fused tensor split in two) or overlapping: decide exactly.
    try:
        return bool(
            _shares_memory(
                np.asarray(_Footprint(a)), np.asarray(_Footprint(b)), max_work=_OVERLAP_WORK
            )
        )
    except RuntimeError:  # numpy's TooHardError: past the work bound
        return True


def _pool(arrays: tuple[Any, ...], name: str, pinned: bool) -> Pool:
    taken = [_adopt(a, f"{name}[{i}]", pinned) for i, a in enumerate(arrays)]
    adopted = tuple(a for a, _ in taken)
    for i, a in enumerate(adopted):
        _check_array(a, f"{name}[{i}]")
    slots = {int(a.shape[1]) for a in adopted}
    if len(slots) != 1:
        raise ValueError(f"{name}: the arrays disagree on the slot count: {sorted(slots)}")
    kinds = {isinstance(a, np.ndarray) for a in adopted}
    if len(kinds) != 1:
        raise ValueError(f"{name}: mixes numpy and cupy arrays")
    return Pool(adopted, slots.pop(), on_gpu=not kinds.pop(), pinned=all(p for _, p in taken))


class Storage:
    """The memory behind a cache's slots.

    Args:
        kv: Per tier (``"device"``, ``"host"``), ``(k, v)``, each
            ``[layers, slots, heads, head_dim]``.
        mamba: Per tier, ``(conv, ssm)``: ``[layers, slots, *conv_shape]`` and
            ``[layers, slots, *ssm_shape]``.
        swa: Per tier, the SWA layers' ``(k, v)``, each
            ``[swa_layers, swa_slots, heads, head_dim]`` (checked as `kv` is).
        pinned_host: The NumPy host arrays are in pinned memory (torch tensors say so
            themselves). On a GPU the copy kernels then read and write them directly;
            otherwise host copies take the DMA path.

    Arrays may be NumPy or CuPy arrays or torch tensors (wrapped through DLPack, no
    copy). A tier the cache does not use may be left out.

    Every array must be writable, of a numeric dtype, with every dimension >= 1 and
    contiguous rows that do not overlap; the host tier's arrays must match the device
    tier's in dtype, layer count and row shape (array by array); and no two arrays may
    share memory (K is not V, no tier or pool is a view of another). A fused tensor
    split into interleaved views (``kv[:, :, 0]``, ``kv[:, :, 1]``) is accepted: the
    views share no byte.

    Raises:
        ValueError: A bad tier, shape, layout, tier mismatch or overlap (the message
            names the argument, e.g. ``kv['host'][1]`` or ``swa['device'][0]``).
        TypeError: An argument or array of an unsupported type or dtype.
    """

    def __init__(
        self,
        *,
        kv: Mapping[str, tuple[Any, Any]] | None = None,
        mamba: Mapping[str, tuple[Any, Any]] | None = None,
        swa: Mapping[str, tuple[Any, Any]] | None = None,
        pinned_host: bool = False,
    ) -> None:
        if not isinstance(pinned_host, bool):
            raise TypeError(f"pinned_host: expected a bool, got {pinned_host!r}")
        self._pools: dict[tuple[str, str], Pool] = {}
        for pool_name, per_tier in (("kv", kv), ("mamba", mamba), ("swa", swa)):
            if per_tier is None:
                continue
            if not isinstance(per_tier, Mapping):
                raise TypeError(
                    f"{pool_name}: expected a mapping of tier to two arrays, got"
                    f" {type(per_tier).__name__}"
                )
            for tier, arrays in per_tier.items():
                if tier not in TIERS:
                    raise ValueError(f"{pool_name}: unknown tier {tier!r} (device or host)")
                name = f"{pool_name}[{tier!r}]"
                if not isinstance(arrays, (tuple, list)) or len(arrays) != 2:
                    raise ValueError(f"{name}: expected two arrays")
                pinned = pinned_host and tier == "host"
                self._pools[pool_name, tier] = _pool(tuple(arrays), name, pinned)
        self._check_tiers_agree()
        self._check_disjoint()

    def _check_tiers_agree(self) -> None:
        """Each host array has its device twin's dtype, layer count and row shape."""
        for pool_name in POOLS:
            if not (self.has(pool_name, "device") and self.has(pool_name, "host")):
                continue
            device = self._pools[pool_name, "device"].arrays
            host = self._pools[pool_name, "host"].arrays
            for i, (d, h) in enumerate(zip(device, host)):
                name = f"{pool_name}['host'][{i}]"
                if h.dtype != d.dtype:
                    raise ValueError(
                        f"{name}: dtype {h.dtype} differs from the device tier's {d.dtype}"
                        " (copies move bytes, never convert)"
                    )
                if h.shape[0] != d.shape[0] or tuple(h.shape[2:]) != tuple(d.shape[2:]):
                    raise ValueError(
                        f"{name}: {h.shape[0]} layers of rows {tuple(h.shape[2:])}, the device"
                        f" tier has {d.shape[0]} of {tuple(d.shape[2:])}"
                    )

    def _check_disjoint(self) -> None:
        """No two arrays of any pools or tiers share a byte."""
        named = [
            (f"{pool_name}[{tier!r}][{i}]", a)
            for (pool_name, tier), p in self._pools.items()
            for i, a in enumerate(p.arrays)
        ]
        for (a_name, a), (b_name, b) in itertools.combinations(named, 2):
            if _overlap(a, b):
                raise ValueError(
                    f"{b_name}: shares memory with {a_name} (every array of every pool and"
                    " tier must be its own memory)"
                )

    @classmethod
    def for_model(
        cls,
        *,
        kv_slots: int,
        mamba_slots: int = 0,
        host_kv_slots: int = 0,
        host_mamba_slots: int = 0,
        swa_slots: int = 0,
        host_swa_slots: int = 0,
        layers: int,
        kv_heads: int = 8,
        head_dim: int = 128,
        mamba_layers: int | None = None,
        swa_layers: int | None = None,
        conv_shape: tuple[int, ...] = (),
        ssm_shape: tuple[int, ...] = (),
        dtype: str = "float16",
        conv_dtype: str | None = None,
        ssm_dtype: str = "float32",
        device: Literal["cpu", "cuda"] = "cpu",
    ) -> Storage:
        """Allocate zeroed storage for a model.

        Args:
            kv_slots: Device KV token slots.
            mamba_slots: Device state slots (0: no Mamba pool).
            host_kv_slots: Host KV token slots (0: no host tier for KV).
            host_mamba_slots: Host state slots.
            swa_slots: Device SWA KV slots (0: no SWA pool).
            host_swa_slots: Host SWA KV slots.
            layers: Attention layers.
            kv_heads: KV heads per attention layer.
            head_dim: Dimension of one head.
            mamba_layers: Mamba layers (default: ``layers``).
            swa_layers: SWA layers (default: ``layers``), with the KV's heads, head
                size and dtype.
            conv_shape: One layer's conv state for one sequence.
            ssm_shape: One layer's SSM state for one sequence.
            dtype: The KV dtype (``"bfloat16"`` is stored as ``uint16``).
            conv_dtype: The conv state dtype (default: ``dtype``).
            ssm_dtype: The SSM state dtype.
            device: ``"cuda"`` (CuPy device arrays, pinned mapped host arrays) or
                ``"cpu"`` (NumPy for both tiers).

        Raises:
            ValueError: A count that is not an int (a bool is not a count), a slot
                count < 0, a layer count, head count, head size or state dimension
                < 1, or an unknown dtype or device, naming it.
            MemoryError: An array that no address space holds (checked before anything
                is allocated), or one the allocator refuses, naming the argument that
                sizes it most (``head_dim: 1099511627776 makes kv['device'][0] ...``);
                what was allocated before it is freed.
        """
        slot_counts = {
            "kv_slots": kv_slots,
            "mamba_slots": mamba_slots,
            "host_kv_slots": host_kv_slots,
            "host_mamba_slots": host_mamba_slots,
            "swa_slots": swa_slots,
            "host_swa_slots": host_swa_slots,
        }
        for name, n in slot_counts.items():
            _count(n, name, 0)
        sizes = {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim}
        if mamba_layers is not None:
            sizes["mamba_layers"] = mamba_layers
        if swa_layers is not None:
            sizes["swa_layers"] = swa_layers
        for name, n in sizes.items():
            _count(n, name, 1)
        for name, shape in (("conv_shape", conv_shape), ("ssm_shape", ssm_shape)):
            if not isinstance(shape, tuple):
                raise ValueError(f"{name}: expected a tuple of sizes, got {shape!r}")
            for i, n in enumerate(shape):
                _count(n, f"{name}[{i}]", 1)
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device: expected 'cpu' or 'cuda', got {device!r}")
        kv_dt = _dtype(dtype, "dtype")
        conv_dt = _dtype(dtype if conv_dtype is None else conv_dtype, "conv_dtype")
        ssm_dt = _dtype(ssm_dtype, "ssm_dtype")
        # Every array, with the argument behind each dimension, checked before any is made.
        m_layers = ("layers", layers) if mamba_layers is None else ("mamba_layers", mamba_layers)
        s_layers = ("layers", layers) if swa_layers is None else ("swa_layers", swa_layers)
        heads = (("kv_heads", kv_heads), ("head_dim", head_dim))
        conv = tuple((f"conv_shape[{i}]", n) for i, n in enumerate(conv_shape))
        ssm = tuple((f"ssm_shape[{i}]", n) for i, n in enumerate(ssm_shape))
        plan: list[tuple[str, str, str, tuple[tuple[str, int], ...], np.dtype[Any]]] = []
        for tier, prefix in (("device", ""), ("host", "host_")):
            for pool, layer_dim, rows, dts in (
                ("kv", ("layers", layers), (heads, heads), (kv_dt, kv_dt)),
                ("swa", s_layers, (heads, heads), (kv_dt, kv_dt)),
                ("mamba", m_layers, (conv, ssm), (conv_dt, ssm_dt)),
            ):
                slots = f"{prefix}{pool}_slots"
                if slot_counts[slots]:
                    for i in (0, 1):
                        dims = (layer_dim, (slots, slot_counts[slots]), *rows[i])
                        plan.append((f"{pool}[{tier!r}][{i}]", pool, tier, dims, dts[i]))
        for name, _, _, dims, dt in plan:
            _check_size(name, dims, dt)
        alloc = _allocator(device)
        made: dict[tuple[str, str], list[Any]] = {}
        for name, pool, tier, dims, dt in plan:
            made.setdefault((pool, tier), []).append(_allocate(alloc, name, tier, dims, dt))
        per_pool: dict[str, dict[str, tuple[Any, Any]]] = {"kv": {}, "mamba": {}, "swa": {}}
        for (pool, tier), (a, b) in made.items():
            per_pool[pool][tier] = (a, b)
        return cls(**per_pool, pinned_host=device == "cuda")

    @classmethod
    def for_cache(cls, cache: HybridCache, **model: Any) -> Storage:
        """Allocate storage with `cache`'s slot counts (every pool it uses, both tiers).

        Args:
            cache: The cache whose ``kv_slots``, ``mamba_slots``, ``swa_slots``,
                ``host_kv_slots``, ``host_mamba_slots`` and ``host_swa_slots`` size the
                pools.
            **model: The model's shapes, dtypes and device, as for `for_model`.

        Raises:
            ValueError: As `for_model`; also when `model` gives a slot count.
            TypeError: `cache` is not a `HybridCache`.
        """
        _check_cache(cache)
        counts = (
            "kv_slots",
            "mamba_slots",
            "swa_slots",
            "host_kv_slots",
            "host_mamba_slots",
            "host_swa_slots",
        )
        given = sorted(set(counts) & set(model))
        if given:
            raise ValueError(f"{given[0]}: taken from the cache, not given")
        return cls.for_model(
            kv_slots=cache.kv_slots,
            mamba_slots=cache.mamba_slots,
            host_kv_slots=cache.host_kv_slots,
            host_mamba_slots=cache.host_mamba_slots,
            swa_slots=cache.swa_slots,
            host_swa_slots=cache.host_swa_slots,
            **model,
        )

    def pool(self, pool: str, tier: str) -> Pool:
        """Return the arrays of `pool` (``"kv"``, ``"mamba"``, ``"swa"``) on `tier`.

        Raises:
            ValueError: The storage has no such pool on that tier.
        """
        try:
            return self._pools[pool, tier]
        except KeyError:
            raise ValueError(f"pool: this storage has no {pool} pool on the {tier}") from None

    def has(self, pool: str, tier: str) -> bool:
        """Whether the storage holds `pool` on `tier`."""
        return (pool, tier) in self._pools

    @property
    def kv(self) -> dict[str, tuple[Any, Any]]:
        """``(k, v)`` per tier."""
        return {t: self._pools["kv", t].arrays for t in TIERS if ("kv", t) in self._pools}

    @property
    def mamba(self) -> dict[str, tuple[Any, Any]]:
        """``(conv, ssm)`` per tier."""
        return {t: self._pools["mamba", t].arrays for t in TIERS if ("mamba", t) in self._pools}

    @property
    def swa(self) -> dict[str, tuple[Any, Any]]:
        """The SWA layers' ``(k, v)`` per tier."""
        return {t: self._pools["swa", t].arrays for t in TIERS if ("swa", t) in self._pools}

    @property
    def on_gpu(self) -> bool:
        """Whether the device pools are GPU memory (the engine then copies with CUDA)."""
        return any(p.on_gpu for p in self._pools.values())

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of KV one token holds over every layer (K and V); 0 without KV."""
        return self._pools["kv", "device"].bytes_per_slot if self.has("kv", "device") else 0

    @property
    def bytes_per_state(self) -> int:
        """Bytes of one Mamba state slot over every layer (conv and SSM); 0 without."""
        return self._pools["mamba", "device"].bytes_per_slot if self.has("mamba", "device") else 0

    def check(self, cache: HybridCache) -> None:
        """Check that every pool the cache uses is here with at least its slot count.

        Raises:
            ValueError: A pool is missing or too small, naming the cache's argument.
            TypeError: `cache` is not a `HybridCache`.
        """
        _check_cache(cache)
        wants = (
            ("kv", "device", cache.kv_slots, "kv_slots"),
            ("kv", "host", cache.host_kv_slots, "host_kv_slots"),
            ("mamba", "device", cache.mamba_slots, "mamba_slots"),
            ("mamba", "host", cache.host_mamba_slots, "host_mamba_slots"),
            ("swa", "device", cache.swa_slots, "swa_slots"),
            ("swa", "host", cache.host_swa_slots, "host_swa_slots"),
        )
        for pool, tier, n, arg in wants:
            if n == 0:
                continue
            if not self.has(pool, tier):
                raise ValueError(f"{arg}: the cache has {n}, the storage has no {pool} on {tier}")
            have = self._pools[pool, tier].slots
            if have < n:
                raise ValueError(f"{arg}: the cache has {n}, the storage {pool}[{tier!r}] {have}")
        on_gpu = {p.on_gpu for (_, tier), p in self._pools.items() if tier == "device"}
        if len(on_gpu) > 1:
            raise ValueError("storage: mixes GPU (cupy) and CPU (numpy) device pools")
        if any(p.on_gpu for (_, tier), p in self._pools.items() if tier == "host"):
            raise ValueError("storage: host pools must be host memory (numpy or cpu torch)")

    def __repr__(self) -> str:
        parts = [
            f"{pool}[{tier}]: {p.slots} slots x {p.bytes_per_slot} B"
            for (pool, tier), p in self._pools.items()
        ]
        where = "cuda" if self.on_gpu else "cpu"
        return f"<Storage {where} {', '.join(parts)}>"


def _count(n: object, name: str, least: int) -> None:
    """Refuse `n` unless it is an int (not a bool) >= `least`, naming `name`."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < least:
        raise ValueError(f"{name}: expected a count >= {least}, got {n!r}")


def _check_cache(cache: object) -> None:
    if not isinstance(cache, HybridCache):
        raise TypeError(f"cache: expected a HybridCache, got {type(cache).__name__}")


def _bytes(n: int) -> str:
    """Return `n` bytes in the largest binary unit that keeps it >= 1 (``256 TiB``)."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if size < 1024:
            return f"{size:.3g} {unit}"
        size /= 1024
    return f"{size:,.0f} EiB"


def _sizer(dims: tuple[tuple[str, int], ...]) -> tuple[str, int]:
    """Return the argument that sizes an array most (its largest dimension, the first)."""
    return max(dims, key=lambda d: int(d[1]))


def _check_size(name: str, dims: tuple[tuple[str, int], ...], dt: np.dtype[Any]) -> None:
    """Refuse an array larger than any address space holds, before allocating anything."""
    shape = tuple(int(n) for _, n in dims)
    nbytes = math.prod(shape) * dt.itemsize
    if nbytes > sys.maxsize:
        arg, n = _sizer(dims)
        raise MemoryError(
            f"{arg}: {n} makes {name} {_bytes(nbytes)} (shape {shape} of {dt}), more than"
            " an array can address"
        )


def _allocate(
    alloc: Any, name: str, tier: str, dims: tuple[tuple[str, int], ...], dt: np.dtype[Any]
) -> Any:
    """Allocate one array; a refusal is a `MemoryError` naming the argument that sizes it."""
    shape = tuple(int(n) for _, n in dims)
    try:
        return alloc(tier, shape, dt)
    except MemoryError:  # NumPy's, or CuPy's OutOfMemoryError
        arg, n = _sizer(dims)
        nbytes = math.prod(shape) * dt.itemsize
        raise MemoryError(
            f"{arg}: {n} makes {name} {_bytes(nbytes)} (shape {shape} of {dt}), which"
            f" cannot be allocated on the {tier}"
        ) from None


def _dtype(name: object, arg: str) -> np.dtype[Any]:
    if name == "bfloat16":
        return np.dtype(np.uint16)
    if name is None:  # NumPy would take it as float64
        raise ValueError(f"{arg}: expected a dtype name, got None")
    try:
        dt: np.dtype[Any] = np.dtype(name)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise ValueError(f"{arg}: unknown dtype {name!r}") from None
    if dt.kind not in _NUMERIC_KINDS:
        raise ValueError(f"{arg}: expected a numeric dtype, got {name!r}")
    return dt


def _allocator(device: str) -> Any:
    if device == "cpu":
        return lambda _tier, shape, dt: np.zeros(shape, dtype=dt)
    cupy = _cupy()

    def alloc(tier: str, shape: tuple[int, ...], dt: np.dtype[Any]) -> Any:
        if tier == "device":
            return cupy.zeros(shape, dtype=dt)
        # Pinned host memory: under unified addressing it is mapped, so the copy kernels
        # read and write it through its host pointer. The NumPy array keeps it alive.
        count = int(math.prod(shape))
        mem = cupy.cuda.alloc_pinned_memory(max(count * dt.itemsize, 1))
        host = np.frombuffer(mem, dtype=dt, count=count).reshape(shape)
        host[...] = 0
        return host

    return alloc
