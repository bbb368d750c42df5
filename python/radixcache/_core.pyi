"""Type stubs of the compiled core ``radixcache._core`` (checked by ``mypy.stubtest``)."""

from collections.abc import Sequence
from types import TracebackType
from typing import Final, Literal, TypeAlias, final

import numpy as np
import numpy.typing as npt

__version__: Final[str]
__all__ = [
    "CacheError",
    "Evicted",
    "HybridCache",
    "Insert",
    "InvariantError",
    "Lock",
    "LockError",
    "Match",
    "Node",
    "StaleNodeError",
    "__version__",
]

#: A token sequence: a list/tuple of ints or a 1-D integer numpy array; ids in [0, 2**32).
_Tokens: TypeAlias = Sequence[int] | npt.NDArray[np.integer]
#: Slot indices: a list/tuple of ints or a 1-D integer numpy array.
_Indices: TypeAlias = Sequence[int] | npt.NDArray[np.integer]

class CacheError(Exception):
    """Root of the errors radixcache raises (argument errors stay ValueError/TypeError)."""

class InvariantError(CacheError):
    """audit() found a broken invariant."""

class StaleNodeError(CacheError):
    """A Node handle whose node no longer exists (evicted, or from another cache)."""

class LockError(CacheError):
    """A lock receipt released twice, or given to a cache it does not belong to."""

@final
class Node:
    """Opaque handle to a tree node: hashable, equal for the same live node.

    Using a handle after its node was evicted raises ``StaleNodeError``.
    """

    def __eq__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class Match:
    """The answer of ``HybridCache.match_prefix``."""

    @property
    def device_len(self) -> int:
        """Tokens reusable from device memory now (a multiple of the page size)."""
    @property
    def kv_indices(self) -> npt.NDArray[np.int64]:
        """Device KV slots of the first ``device_len`` tokens (int64)."""
    @property
    def host_len(self) -> int:
        """Further tokens present only on the host tier (0 without a host tier)."""
    @property
    def node(self) -> Node:
        """The last device node of the match (a root when nothing matched)."""
    @property
    def host_node(self) -> Node:
        """The last node counting host data (``node`` when ``host_len == 0``)."""
    @property
    def mamba_slot(self) -> int | None:
        """Device state slot at ``device_len`` (None without Mamba layers)."""
    @property
    def kv_len(self) -> int:
        """Deepest page-aligned KV match on any tier, ignoring states (the branch point)."""

@final
class Insert:
    """The answer of ``HybridCache.insert``."""

    @property
    def prefix_len(self) -> int:
        """Tokens that were already cached (their passed slots were freed)."""
    @property
    def node(self) -> Node:
        """The node where the insert ended."""
    @property
    def mamba_existed(self) -> bool:
        """The node already had a Mamba state; the passed ``mamba_slot`` was freed."""

@final
class Evicted:
    """What ``HybridCache.evict`` actually evicted."""

    @property
    def kv_tokens(self) -> int:
        """Device KV tokens freed."""
    @property
    def mamba_states(self) -> int:
        """Device Mamba states freed."""

@final
class Lock:
    """A lock receipt, and a context manager that releases it on exit.

    Release it exactly once, with ``cache.unlock(lock)`` or by leaving its ``with``
    block. A receipt garbage-collected while held is released and emits a
    ``ResourceWarning``.
    """

    @property
    def node(self) -> Node:
        """The node whose path to the root is locked."""
    @property
    def held(self) -> bool:
        """True until the lock is released."""
    def __enter__(self) -> Lock: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]: ...

@final
class HybridCache:
    """A prefix cache for hybrid LLMs: radix tree, slot pools, locks and eviction.

    Args:
        kv_slots: device KV token slots (a multiple of ``page_size``).
        page_size: tokens per page; keys are matched and inserted in whole pages.
        mamba_slots: device Mamba state slots; must be 0 in this version.
        host_kv_slots: host-tier KV token slots; must be 0 in this version.
        host_mamba_slots: host-tier Mamba state slots; must be 0 in this version.
        write_policy: ``"write_through"``, ``"write_through_selective"`` or
            ``"write_back"``.
        write_through_threshold: hits before a selective backup (>= 1).

    Raises:
        ValueError: a bad argument (the message names it).
    """

    def __new__(
        cls,
        kv_slots: int = 8192,
        page_size: int = 1,
        mamba_slots: int = 0,
        host_kv_slots: int = 0,
        host_mamba_slots: int = 0,
        write_policy: str = "write_through",
        write_through_threshold: int = 2,
    ) -> HybridCache: ...
    @property
    def page_size(self) -> int:
        """Tokens per page."""
    @property
    def kv_slots(self) -> int:
        """Device KV token slots."""
    def match_prefix(self, tokens: _Tokens, *, namespace: str | None = None) -> Match:
        """Longest cached prefix of ``tokens``, rounded down to whole pages.

        Refreshes the LRU position of every node on the path. ``namespace`` selects a
        separate tree (LoRA adapter, cache salt); ``None`` is the default tree.
        """
    def insert(
        self,
        tokens: _Tokens,
        kv_indices: _Indices,
        *,
        namespace: str | None = None,
        owned_from: int = 0,
        mamba_slot: int | None = None,
    ) -> Insert:
        """Cache ``tokens`` whose KV lives in ``kv_indices`` (one slot per token).

        ``kv_indices[:owned_from]`` must be the cache's own slots for that prefix (from
        an earlier match) and are left alone; the caller hands over the rest and must
        hold them (from ``alloc_kv``). Slots of tokens already cached, and of the
        unaligned tail past the last whole page, are freed by the cache: never free
        after an insert. Bad arguments raise ``ValueError``/``TypeError`` naming the
        argument and change nothing.
        """
    def lock(self, node: Node) -> Lock:
        """Protect the path from ``node`` to the root from eviction; returns the receipt.

        Raises:
            StaleNodeError: the node no longer exists.
        """
    def unlock(self, lock: Lock) -> None:
        """Release a receipt.

        Raises:
            LockError: released already, or the receipt belongs to another cache.
        """
    def evict(self, *, kv_tokens: int = 0, mamba_states: int = 0) -> Evicted:
        """Evict at least that much (or all that is evictable), least recently used first.

        Only unlocked leaves are evicted; a parent left as an unlocked leaf joins the
        candidates in the same pass.
        """
    def alloc_kv(self, n: int) -> npt.NDArray[np.int64] | None:
        """``n`` device KV slots (a multiple of ``page_size``), evicting first when short.

        Returns None, having taken nothing, when they cannot be had. The caller holds
        the slots until it passes them to ``insert`` or ``free_kv``.
        """
    def free_kv(self, indices: _Indices) -> None:
        """Give back slots the caller holds (the pages containing them are freed).

        Raises:
            ValueError: a slot is free already, owned by the cache, or out of range;
                nothing is freed then.
        """
    def evictable_size(self) -> int:
        """Device KV tokens in the tree that eviction may take."""
    def protected_size(self) -> int:
        """Device KV tokens in the tree protected by locks."""
    def total_size(self) -> int:
        """Device KV tokens in the tree."""
    def available_kv(self) -> int:
        """Free device KV slots."""
    def available_mamba(self) -> int:
        """Free device Mamba state slots (0 without a Mamba pool)."""
    def stats(self) -> dict[str, int]:
        """Counters (matches, hits, inserts, evictions, allocations...) and gauges."""
    def audit(self) -> None:
        """Check every invariant; raises ``InvariantError`` naming the first broken one."""
    def pretty(self, max_nodes: int = 200, max_tokens: int = 8) -> str:
        """Return the tree as indented text (``str(cache)`` gives the same with the defaults)."""
