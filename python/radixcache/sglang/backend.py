"""`RadixCacheBackend`: SGLang 0.5.23's ``BasePrefixCache`` over one radixcache tree.

SGLang's allocators own every slot (``token_to_kv_pool_allocator`` for KV, the Mamba
allocator of ``HybridReqToTokenPool`` for states). The backend keeps one
``HybridCache(pools="engine")``: the tree takes the slots SGLang passes to it at a
checkpoint and hands back every slot it gives up (evicted pages and states, duplicates,
replaced states) through ``take_freed()`` or ``Evicted``; the backend frees those into
SGLang's allocators before it returns, so between calls SGLang's pool invariant holds:
allocator available + tree evictable + tree protected (+ what requests hold) == size.

What SGLang calls, in which order, and who owns which slot at each step: docs/sglang.md.
"""

from __future__ import annotations

import logging
import math
import time
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    BasePrefixCache,
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    MatchPrefixParams,
    MatchResult,
    TreeLock,
)
from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

from radixcache import HybridCache, Lock, Node

if TYPE_CHECKING:
    from radixcache.sglang.events import SglangEvents

__all__ = ["RadixCacheBackend", "create_backend"]

logger = logging.getLogger(__name__)

#: Where the backend keeps, on a ``Req``, the KV indices of its last match (read by
#: ``prefix_device_indices`` until the allocation writes them into the request's row).
_PREFIX_ATTR = "_radixcache_prefix"

_Array = npt.NDArray[np.int64]
_Row = npt.NDArray[np.integer[Any]]


def _refuse(flag: str, why: str) -> ValueError:
    return ValueError(f"--radix-cache-backend radixcache does not support {flag}: {why}")


def create_backend(ctx: Any) -> RadixCacheBackend:
    """Build the backend from SGLang's ``TreeCacheBuildContext`` (the registry's factory).

    Refuses, before anything is built, what the backend does not support; each message
    names the flag to drop.

    Raises:
        ValueError: sliding-window (SWA) models, ``--enable-hierarchical-cache``,
            ``--enable-streaming-session``, or one of `RadixCacheBackend`'s refusals.
    """
    if ctx.is_hybrid_swa:
        raise _refuse(
            "sliding-window attention (SWA) models",
            "serve this model with SGLang's default cache (omit the flag), or with "
            "--disable-hybrid-swa-memory",
        )
    if ctx.enable_hierarchical_cache:
        raise _refuse("--enable-hierarchical-cache", "radixcache serves the device tier only")
    server_args = ctx.server_args
    if getattr(server_args, "enable_streaming_session", False):
        raise _refuse("--enable-streaming-session", "sessions keep rows outside the tree")
    return RadixCacheBackend(ctx.params, hybrid=bool(ctx.is_hybrid_ssm))


def _check_params(params: Any, hybrid: bool) -> None:
    """Raise `ValueError` naming the flag for what the backend does not support."""
    if params.disable:
        raise _refuse("--disable-radix-cache", "nothing would be cached; drop one of the two")
    if params.is_eagle:
        raise _refuse(
            "--speculative-algorithm EAGLE/EAGLE3",
            "their bigram keys are not radixcache keys",
        )
    if params.enable_session_radix_cache:
        raise _refuse("--enable-session-radix-cache", "sessions keep rows outside the tree")
    if params.eviction_policy.lower() != "lru":
        raise _refuse(
            f"--radix-eviction-policy {params.eviction_policy}",
            "radixcache evicts least recently used first (the default 'lru')",
        )
    from sglang.srt.mem_cache.allocator.page_interleave import page_interleave_shard_size

    if page_interleave_shard_size(params.token_to_kv_pool_allocator) > 1:
        raise _refuse("--enable-kv-cache-sharding", "radixcache keeps one slot space")
    if not hybrid:
        return
    pool = params.req_to_token_pool
    if not isinstance(pool, HybridReqToTokenPool):
        raise ValueError(
            "--radix-cache-backend radixcache: a Mamba model needs SGLang's "
            f"HybridReqToTokenPool, got {type(pool).__name__}"
        )
    if getattr(pool, "mamba_ckpt_pool", None) is not None:
        raise _refuse("--enable-int8-mamba-checkpoint", "cached states stay in the Mamba pool")
    if params.enable_mamba_extra_buffer_lazy:
        raise _refuse(
            "--mamba-radix-cache-strategy extra_buffer_lazy",
            "use extra_buffer or no_buffer",
        )
    if getattr(pool.mamba_pool, "replayssm_write_pos", None) is not None:
        raise _refuse("--enable-linear-replayssm", "its live state lags the sequence it summarises")
    if not params.enable_mamba_extra_buffer and params.page_size != 1:
        raise _refuse(
            f"--mamba-radix-cache-strategy no_buffer with --page-size {params.page_size}",
            "no_buffer keeps states at every length, which needs page size 1",
        )


def _tokens(token_ids: Sequence[int], n: int) -> _Array:
    """Return the first `n` tokens as int64 (a copy: SGLang appends to its arrays)."""
    if isinstance(token_ids, array) and token_ids.typecode == "q":
        return np.frombuffer(token_ids, dtype=np.int64, count=n).copy()
    return np.asarray(token_ids[:n], dtype=np.int64)


class RadixCacheBackend(BasePrefixCache):  # type: ignore[misc]
    """SGLang's tree cache, backed by ``HybridCache(pools="engine")``.

    Built by SGLang's registry for ``--radix-cache-backend radixcache`` (see
    `create_backend`) from its ``CacheInitParams``: attention-only (FULL) or FULL+Mamba
    (``hybrid``), any page size, Mamba strategies ``no_buffer`` (page size 1) and
    ``extra_buffer``. Node handles are radixcache ``Node`` objects; lock receipts are
    radixcache ``Lock`` objects inside SGLang's ``TreeLock``.

    Attributes:
        cache: the ``HybridCache`` behind it (``audit()``, ``stats()``, ``pretty()``);
            a new one after `reset`.

    Args:
        params: SGLang's ``CacheInitParams`` (its pools and allocators).
        hybrid: the model has Mamba layers (``TreeCacheBuildContext.is_hybrid_ssm``).

    Raises:
        ValueError: a setting the backend does not support; the message names the flag.
    """

    cache: HybridCache

    def __init__(self, params: Any, *, hybrid: bool) -> None:
        _check_params(params, hybrid)
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        self.page_size: int = params.page_size
        self.disable = False
        self._hybrid = hybrid
        self._extra_buffer = bool(hybrid and params.enable_mamba_extra_buffer)
        self._kv_device = torch.device(self.token_to_kv_pool_allocator.device)
        self._kv_on_cpu = self._kv_device.type == "cpu"
        self._mamba_allocator: Any = None
        self._grid = 0
        if hybrid:
            from sglang.srt.runtime_context import mamba_cache_chunk_size

            self._mamba_allocator = self.req_to_token_pool.mamba_allocator
            # Every state slot id as a tensor: a copy-on-write source is a one-element
            # slice of it (SGLang only reads it), not a new tensor per match.
            self._mamba_ids = torch.arange(
                self._mamba_allocator.size + 1,
                dtype=torch.int64,
                device=self._mamba_allocator.device,
            )
            # A state SGLang tracks during prefill lies a whole number of Mamba chunks
            # past the request's prefix, on a page boundary.
            self._grid = math.lcm(mamba_cache_chunk_size(), self.page_size)
        self._receipts: dict[int, Lock] = {}
        # --kv-events-config: SGLang's events, from the core's (reset records the first
        # AllBlocksCleared, as SGLang's own cache does when it is built).
        self._events: SglangEvents | None = None
        if params.enable_kv_cache_events:
            from radixcache.sglang.events import SglangEvents

            self._events = SglangEvents(params, self.page_size)
        # SGLang's req_to_token table, and a numpy view of it when it is on the CPU.
        self._table: Any = None
        self._table_view: Any = None
        self._next_receipt = 0
        if params.enable_metrics:
            self.init_metrics_collector()
        self.reset()

    # ------------------------------------------------------------------ state

    def reset(self) -> None:
        """Drop the tree (SGLang clears its allocators right after, reclaiming its slots).

        With ``--kv-events-config``: the old tree's events still queued, then
        ``AllBlocksCleared``.
        """
        events = self._events
        if events is not None:
            if hasattr(self, "cache"):
                events.add(self.cache.take_events())
            events.cleared()
        # Slot 0 (KV: page 0) is SGLang's padding target: allocators hand out 1..size.
        kv_slots = self.token_to_kv_pool_allocator.size + self.page_size
        mamba_slots = self._mamba_allocator.size + 1 if self._hybrid else 0
        self.cache = HybridCache(
            kv_slots=kv_slots,
            page_size=self.page_size,
            mamba_slots=mamba_slots,
            pools="engine",
            page_hashes=events is not None,
            events=events is not None,
        )
        self._receipts.clear()

    @property
    def root_node(self) -> Node:
        """The default namespace's root handle."""
        return self.root_node_handle()

    def root_node_handle(self, extra_key: str | None = None) -> Node:
        """Return the root handle of `extra_key`'s namespace."""
        return self.cache.match_prefix((), namespace=self._namespace(extra_key, None)).node

    @staticmethod
    def _namespace(extra_key: str | None, cache_salt: str | None) -> str | None:
        """Return the namespace of (``extra_key``, ``cache_salt``); None for neither."""
        if extra_key is None and not cache_salt:
            return None
        return repr((extra_key, cache_salt or None))

    # ------------------------------------------------------------------ slots back to SGLang

    def _row(self, req_pool_idx: int, n: int) -> _Row:
        """Return the first `n` slots of a request's row (on the CPU a view of it)."""
        table = self.req_to_token_pool.req_to_token
        if table is not self._table:
            self._table = table
            self._table_view = table.numpy() if table.device.type == "cpu" else None
        if self._table_view is not None:
            return self._table_view[req_pool_idx, :n]  # type: ignore[no-any-return]
        return table[req_pool_idx, :n].cpu().numpy()  # type: ignore[no-any-return]

    def _kv_tensor(self, kv: _Array) -> torch.Tensor:
        tensor = torch.from_numpy(kv)
        return tensor if self._kv_on_cpu else tensor.to(self._kv_device, non_blocking=True)

    def _free_kv(self, kv: _Array) -> None:
        if kv.size:
            self.token_to_kv_pool_allocator.free(self._kv_tensor(kv))

    def _free_mamba(self, slots: _Array) -> None:
        if slots.size:
            self._mamba_allocator.free(torch.from_numpy(slots).to(self._mamba_allocator.device))

    def _drain(self) -> None:
        """Hand every slot the tree queued back to SGLang's allocators."""
        kv, mamba = self.cache.take_freed()
        self._free_kv(kv)
        self._free_mamba(mamba)

    # ------------------------------------------------------------------ match

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """Longest cached prefix of ``params.key`` (whole pages, in its namespace).

        With ``cow_mamba`` and a matched state, gives the request a state slot (evicting
        another state if needed, never the matched one) and records the copy-on-write
        source; the copy runs later on SGLang's forward stream. When no slot can be had
        the request is served without reuse (a miss), never a crash.
        ``mamba_branching_seqlen`` is the branch point (radixcache's ``Match.kv_len``)
        moved down to the deepest position SGLang can track a state at.
        """
        key = params.key
        tokens = _tokens(key.token_ids, len(key))
        namespace = self._namespace(key.extra_key, key.cache_salt)
        match = self.cache.match_prefix(tokens, namespace=namespace)
        length = match.device_len
        node = match.node
        kv = match.kv_indices
        branching = None
        if self._hybrid:
            branching = self._branch_point(length, match.kv_len)
            source = match.mamba_slot
            if (
                params.cow_mamba
                and source is not None
                and length > 0
                and not self._copy_on_write(params.req, node, source)
            ):
                length, kv, branching = 0, kv[:0], None
                node = self.cache.match_prefix((), namespace=namespace).node
        req = params.req
        if req is not None:
            setattr(req, _PREFIX_ATTR, self._kv_tensor(kv))
        return MatchResult(
            device_prefix_len=length,
            last_device_node=node,
            last_host_node=node,
            best_match_node=node,
            mamba_branching_seqlen=branching,
            full_kv_hit_length=match.kv_len,
        )

    def _branch_point(self, prefix_len: int, kv_len: int) -> int | None:
        """Return the deepest position <= `kv_len` whole tracking grids past `prefix_len`."""
        point = prefix_len + (kv_len - prefix_len) // self._grid * self._grid
        return point if point > prefix_len else None

    def _copy_on_write(self, req: Any, node: Node, source: int) -> bool:
        """Give `req` a state slot to copy `source` into; False if none can be had."""
        kv = req.kv
        if kv.mamba_pool_idx is None:
            slot = self._mamba_allocator.alloc(1)
            if slot is None:
                with self.cache.lock(node):  # the matched state is never the one evicted
                    self._evict(0, 1)
                slot = self._mamba_allocator.alloc(1)
            if slot is None:
                return False
            kv.mamba_pool_idx = slot[0]
        kv.mamba_cow_src_index = self._mamba_ids[source : source + 1]
        kv.mamba_needs_clear = False
        return True

    def touch_prefix(self, key: Any) -> None:
        """Refresh the recency of ``key``'s cached path (a match that takes nothing)."""
        tokens = _tokens(key.token_ids, len(key))
        self.cache.match_prefix(tokens, namespace=self._namespace(key.extra_key, key.cache_salt))

    def prefix_device_indices(self, req: Any) -> torch.Tensor:
        """KV indices of the request's matched prefix (its last match, cut to ``prefix_len``)."""
        indices: torch.Tensor = getattr(req, _PREFIX_ATTR)
        if len(indices) < req.prefix_len:
            raise ValueError(
                f"req: prefix_len {req.prefix_len} exceeds its match ({len(indices)} tokens)"
            )
        return indices[: req.prefix_len]

    # ------------------------------------------------------------------ locks

    def lock(self, node: Node) -> TreeLock:
        """Lock ``node``'s path (and its state) for one holder; ``unlock`` releases it."""
        return TreeLock(node, self.cache.lock(node))

    def unlock(self, lock: TreeLock | None) -> None:
        """Release a receipt from `lock` (``LockError`` when released twice)."""
        if lock is not None:
            self.cache.unlock(lock.receipt)

    def inc_lock_ref(self, node: Node) -> IncLockRefResult:
        """Lock ``node``; the result's ``node_id`` names the receipt ``dec_lock_ref`` takes."""
        receipt = self._next_receipt
        self._next_receipt += 1
        self._receipts[receipt] = self.cache.lock(node)
        return IncLockRefResult(node_id=receipt)

    def dec_lock_ref(self, node: Node, params: DecLockRefParams | None = None) -> DecLockRefResult:
        """Release the lock ``inc_lock_ref`` took (its receipt in ``params.node_id``)."""
        if params is None or params.node_id not in self._receipts:
            raise ValueError("params: not a receipt of this cache's inc_lock_ref")
        self.cache.unlock(self._receipts.pop(params.node_id))
        return DecLockRefResult()

    # ------------------------------------------------------------------ eviction

    def _evict(self, kv_tokens: int, mamba_states: int) -> EvictResult:
        start = time.perf_counter()
        evicted = self.cache.evict(kv_tokens=kv_tokens, mamba_states=mamba_states)
        self._free_kv(evicted.kv_indices)
        self._free_mamba(evicted.mamba_slots)
        self._drain()
        self.update_eviction_metrics(evicted.kv_tokens, start)
        return EvictResult(
            num_tokens_evicted=evicted.kv_tokens, mamba_num_evicted=evicted.mamba_states
        )

    def evict(self, params: EvictParams) -> EvictResult:
        """Evict at least ``num_tokens`` KV tokens and ``mamba_num`` states (or all there is).

        Everything evicted is back in SGLang's allocators on return, and the result
        counts exactly that.
        """
        return self._evict(max(params.num_tokens, 0), max(params.mamba_num, 0))

    def evict_for_alloc(
        self, params: EvictParams, *, allocation_reclaim_satisfied: Any = None
    ) -> EvictResult:
        """Evict the shortfalls in ``params`` (joint-reclaim quotas are not supported)."""
        if allocation_reclaim_satisfied is not None:
            raise NotImplementedError("radixcache does not support joint reclaim")
        return self.evict(params)

    # ------------------------------------------------------------------ checkpoint and release

    def checkpoint(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
        """Cache the request's first ``up_to`` tokens (whole pages) and adopt the tree's slots.

        A hybrid model caches what the Mamba strategy has a state for, with the state on
        the node where it was taken: KV past the last state would only move the next
        request's branch point (``mamba_branching_seqlen``) onto the end of this one,
        where SGLang would then take the one state of its prefill chunk instead of at
        the end of its own prompt (measured: fewer hits on multi-turn and shared-prefix
        workloads). Duplicate slots go back to the allocator and the request's row is
        rewritten with the tree's; the request's lock, ``cache_protected_len`` and
        ``last_node`` move to the deepest node inserted. A
        finished request gives the tree its state (no copy) and frees the state slots it
        still holds; an unfinished one gives a copy (no_buffer) or its tracked state
        (extra_buffer). Nothing here frees the request's own KV past the new protected
        length: ``release_kv_cache`` does.
        """
        kv = req.kv
        finished = req.finished()
        full = up_to // self.page_size * self.page_size
        tokens = _tokens(req.full_untruncated_fill_ids, full)
        indices = self._row(kv.req_pool_idx, full)
        namespace = self._namespace(req.extra_key, req.cache_salt)
        protected = kv.cache_protected_len
        deepest: tuple[int, Node] | None = None
        if self._hybrid:
            state_len, state_slot, keep = self._state_for(req, finished, full)
            if state_slot is not None:
                deepest = self._insert(
                    req, tokens[:state_len], indices, namespace, protected, state_slot
                )
            if finished:
                self._release_states(req, keep)
        elif full > protected:
            deepest = self._insert(req, tokens, indices, namespace, protected, None)
        self._drain()
        if deepest is not None and deepest[0] > protected:
            length, node = deepest
            new_lock = self.lock(node)
            self.unlock(req.lock)
            req.lock = new_lock
            kv.cache_protected_len = length
            kv.cache_inserted_len = max(kv.cache_inserted_len, length)
            req.last_node = node

    def _insert(
        self,
        req: Any,
        tokens: _Array,
        indices: _Row,
        namespace: str | None,
        protected: int,
        state_slot: int | None,
    ) -> tuple[int, Node]:
        """Insert `tokens` (whole pages) and point the request's row at the tree's slots.

        `indices` (the row's first tokens) is updated in place to the tree's slots too.
        """
        length = len(tokens)
        owned = min(protected, length)
        inserted = self.cache.insert(
            tokens,
            indices[:length],
            namespace=namespace,
            owned_from=owned,
            mamba_slot=state_slot,
        )
        if inserted.prefix_len > owned:
            # The tree held some of these pages already: its slots replace the request's
            # (which the insert queued for the allocator).
            tree = self.cache.match_prefix(tokens, namespace=namespace).kv_indices[owned:length]
            indices[owned:length] = tree
            self.req_to_token_pool.write(
                (req.kv.req_pool_idx, slice(owned, length)),
                self._kv_tensor(tree),
            )
        return length, inserted.node

    def _state_for(self, req: Any, finished: bool, full: int) -> tuple[int, int | None, int | None]:
        """``(length, slot, ping-pong index kept)`` of the state the tree gets, if any.

        The slot is the tree's from here on (or goes back to the allocator with the
        insert's duplicates).
        """
        kv = req.kv
        pool = self.req_to_token_pool
        if not self._extra_buffer:
            if full == 0 or kv.mamba_pool_idx is None:
                return 0, None, None
            if finished:
                slot = int(kv.mamba_pool_idx)
                kv.mamba_pool_idx = None
                return full, slot, None
            fork = self._alloc_state()
            if fork is None:
                return 0, None, None
            translate = pool.translate_mamba_indices
            pool.mamba_pool.copy_from(translate(kv.mamba_pool_idx.unsqueeze(0)), translate(fork))
            return full, int(fork[0]), None
        if finished:
            keep = pool.get_mamba_ping_pong_keep_idx(req)
            length = kv.mamba_last_track_seqlen or 0
            if length > full:
                # The latest tracked state ran past the key: the other buffer may hold
                # an earlier one that fits.
                previous = kv.mamba_prev_track_seqlen
                if pool.mamba_ping_pong_track_buffer_size != 2 or previous is None:
                    return 0, None, None
                length, keep = previous, pool.get_mamba_ping_pong_other_idx(keep)
                if length > full:
                    return 0, None, None
            if length == 0:
                return 0, None, None
            return length, int(kv.mamba_ping_pong_track_buffer[keep]), keep
        length = kv.mamba_last_track_seqlen
        if not length or length > full:
            return 0, None, None
        fresh = self._alloc_state()
        if fresh is None:
            return 0, None, None
        donated = pool.donate_mamba_ping_pong_slot(req, fresh)
        kv.mamba_last_track_seqlen = None
        kv.mamba_prev_track_seqlen = None
        return length, int(donated[0]), None

    def _alloc_state(self) -> torch.Tensor | None:
        slot = self._mamba_allocator.alloc(1)
        if slot is None:
            self._evict(0, 1)
            slot = self._mamba_allocator.alloc(1)
        return slot

    def _release_states(self, req: Any, keep: int | None) -> None:
        """Free the finished request's state slots, except ping-pong entry `keep` (the tree's)."""
        if req.kv.mamba_pool_idx is not None:
            self.req_to_token_pool.free_mamba_cache(req, mamba_ping_pong_track_buffer_to_keep=keep)

    def on_release(self, req: Any, *, checkpointed: bool) -> None:
        """Free the state slots of a request released without a checkpoint."""
        if self._hybrid and not checkpointed:
            self._release_states(req, None)

    # ------------------------------------------------------------------ sizes and reports

    def evictable_size(self) -> int:
        """Device KV tokens in the tree that eviction may take."""
        return self.cache.evictable_size()

    def protected_size(self) -> int:
        """Device KV tokens in the tree protected by locks."""
        return self.cache.protected_size()

    def full_evictable_size(self) -> int:
        """Return `evictable_size` (the FULL component's)."""
        return self.cache.evictable_size()

    def full_protected_size(self) -> int:
        """Return `protected_size` (the FULL component's)."""
        return self.cache.protected_size()

    def mamba_evictable_size(self) -> int:
        """States in the tree that eviction may take."""
        return self.cache.stats()["mamba_evictable_states"] if self._hybrid else 0

    def mamba_protected_size(self) -> int:
        """States in the tree protected by locks."""
        return self.cache.stats()["mamba_protected_states"] if self._hybrid else 0

    def total_size(self) -> tuple[int, int]:
        """``(KV tokens, states)`` in the tree, as SGLang's unified cache reports them."""
        states = self.cache.stats()["mamba_cached_states"] if self._hybrid else 0
        return self.cache.total_size(), states

    def all_values_flatten(self) -> torch.Tensor:
        """Every KV slot in the tree, ascending (SGLang's invariant checker's leak census)."""
        return torch.from_numpy(self.cache.tree_slots()[0])

    def all_mamba_values_flatten(self) -> torch.Tensor:
        """Every state slot in the tree, ascending (the same census, for the Mamba pool)."""
        return torch.from_numpy(self.cache.tree_slots()[1])

    def available_and_evictable_str(self) -> str:
        """Free and evictable KV tokens (and states), as SGLang logs them."""
        available = self.token_to_kv_pool_allocator.available_size()
        evictable = self.evictable_size()
        text = f"Available tokens: {available + evictable} ({available=} + {evictable=})\n"
        if self._hybrid:
            mamba_available = self._mamba_allocator.available_size()
            mamba_evictable = self.mamba_evictable_size()
            text += (
                f"Available mamba states: {mamba_available + mamba_evictable} "
                f"({mamba_available=} + {mamba_evictable=})\n"
            )
        return text

    def pretty_print(self) -> None:
        """Print the tree (SGLang calls this when an allocation fails)."""
        print(self.cache.pretty())

    def sanity_check(self) -> None:
        """Check every invariant of the tree (``InvariantError`` names a broken one)."""
        self.cache.audit()

    def take_events(self) -> list[Any]:
        """Return SGLang's KV cache events since the last call, oldest first.

        ``BlockStored``, ``BlockRemoved`` and ``AllBlocksCleared``, as SGLang's own cache
        records them (`radixcache.sglang.events`); none without ``--kv-events-config``.
        """
        events = self._events
        if events is None:
            return []
        events.add(self.cache.take_events())
        return events.take()

    def supports_mamba(self) -> bool:
        """Whether the tree caches Mamba states (a FULL+Mamba model)."""
        return self._hybrid

    def dfs_weight_order(self, node_handles: Sequence[Any]) -> list[int]:
        """Request indices grouped by matched node, larger groups first (stable).

        radixcache's handles do not expose children, so requests sharing a node stay
        together but groups are not ordered by subtree.
        """
        groups: dict[Any, list[int]] = {}
        for index, handle in enumerate(node_handles):
            groups.setdefault(handle, []).append(index)
        ordered = sorted(groups.values(), key=lambda group: -len(group))
        return [index for group in ordered for index in group]
