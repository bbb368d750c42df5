"""Type stubs of the compiled core ``radixcache._core`` (checked by ``mypy.stubtest``)."""

from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import Final, Literal, TypeAlias, final

import numpy as np
import numpy.typing as npt

__version__: Final[str]
#: CUDA sources of the copy kernels (kernels/*.cu), by kernel name.
KERNEL_SOURCES: Final[dict[str, str]]
#: Whether token lists are read through the fast path: on CPython 3.9-3.14, an exact
#: list's items and ints below 2**30 are read from the interpreter's memory layout, after
#: an import-time self-test against the C API (``RADIXCACHE_INT_FAST_PATH=0`` turns it
#: off). Results and errors are the same either way; only the speed differs.
_int_fast_path: Final[bool]

def chain_hashes(tokens: _Tokens, page_size: int, prior: bytes | None = None) -> list[bytes]:
    """Hash the whole pages of ``tokens`` into a SHA-256 chain (no cache needed).

    Each page's hash is ``sha256(prior || the page's tokens as uint32 little-endian)``,
    the previous page's hash being the next prior; the first page is chained from
    ``prior`` (None: no prior, SGLang HiCache's chain without a namespace). An unaligned
    tail is not hashed. ``tokens`` in any form the cache's calls accept.

    Raises:
        ValueError: ``page_size`` below 1, ``prior`` not 32 bytes (names them).
        TypeError: ``prior`` not bytes or None.
    """

#: The length of the header that frames every L3 object (``frame_encode``).
FRAME_HEADER_LEN: Final[int]

def frame_encode(
    hashes: Sequence[bytes],
    data: npt.NDArray[np.uint8],
    out: npt.NDArray[np.uint8],
    *,
    kind: Literal["kv", "mamba"],
    identity: bytes,
) -> None:
    """Frame row ``i`` of ``data`` as the L3 object of page ``hashes[i]`` into ``out``.

    The bytes ``ObjectStore.put`` stores (a ``FRAME_HEADER_LEN``-byte header: magic,
    format version, ``kind``, payload length, the page hash, the 32-byte ``identity``
    digest and a checksum of all of it; then the payload), for store clients written in
    Python. ``data`` is ``uint8 [n, size]``, ``out`` ``uint8 [n, FRAME_HEADER_LEN +
    size]``, both C-contiguous; runs with the GIL released.

    Raises:
        ValueError: a hash or ``identity`` not 32 bytes, an unknown ``kind``, or arrays
            of the wrong shape (names them).
        TypeError: an argument of the wrong type (names it).
    """

def frame_decode(
    hashes: Sequence[bytes],
    objects: npt.NDArray[np.uint8],
    lengths: Sequence[int],
    out: npt.NDArray[np.uint8],
    *,
    kind: Literal["kv", "mamba"],
    identity: bytes,
) -> list[Literal["ok", "foreign", "corrupt"]]:
    """Verify and unframe the objects ``frame_encode`` made.

    Row ``i`` of ``objects`` (``uint8 [n, FRAME_HEADER_LEN + size]``) holds an object of
    ``lengths[i]`` bytes read from a store for page ``hashes[i]``; each is checked (size,
    magic, version, kind, identity, hash, length, checksum) and its payload copied into
    row ``i`` of ``out`` (``uint8 [n, size]``). Per row: ``"ok"`` (verified and copied),
    ``"foreign"`` (an intact object of another ``kind`` or ``identity``) or
    ``"corrupt"``; a row of ``out`` is written only for ``"ok"``. Runs with the GIL
    released.

    Raises:
        ValueError: a hash or ``identity`` not 32 bytes, an unknown ``kind``, a length
            outside ``0..=FRAME_HEADER_LEN + size``, or arrays of the wrong shape (names
            them).
        TypeError: an argument of the wrong type (names it).
    """

def _small_int_read(obj: int) -> tuple[int | None, int] | None:
    """For tests of the fast path: what it reads of an exact int ``obj``.

    Returns ``(value, bytes read)`` (``value`` None where it declines a larger int), or
    None while the fast path is off. The bytes read never exceed ``sys.getsizeof(obj)``.
    """

#: Finalisers. ``Request``, ``Lock``, ``LoadBack`` and ``TransferBatch`` give back what
#: they own when collected and say so with a ``ResourceWarning``. That may happen while an
#: exception is being raised (leaving a ``for`` loop or ``with`` block drops what it
#: held): the exception arrives unchanged. A warning turned into an error cannot be
#: raised from a finaliser; it goes to ``sys.unraisablehook`` ("Exception ignored in:
#: <class ...>"). While the interpreter exits nothing is emitted, and everything is
#: still given back.
__all__ = [
    "FRAME_HEADER_LEN",
    "Breaker",
    "CacheError",
    "Copy",
    "Evicted",
    "HybridCache",
    "Insert",
    "InvariantError",
    "KvEvent",
    "L3Error",
    "LoadBack",
    "Lock",
    "LockError",
    "Match",
    "Node",
    "ObjectStore",
    "Request",
    "StaleNodeError",
    "TransferBatch",
    "__version__",
    "chain_hashes",
    "frame_decode",
    "frame_encode",
]

#: A token sequence, ids in [0, 2**32): a list or tuple (the fast path: exact ints, or
#: objects with ``__index__`` such as numpy integer scalars), a 1-D numpy array of any
#: integer dtype, byte order and stride (read without Python work per element; ``uint32``
#: is copied as is), or another sequence (``range``, ``array.array``, a class with
#: ``__getitem__``), read element by element. Refused with ``TypeError``: ``bool``
#: elements and ``bool`` arrays, masked arrays (pass ``.filled()``/``.compressed()``),
#: str/bytes/bytearray, and what is not a sequence (sets, dicts and their views,
#: iterators, generators): their order is meaningless or they can be read only once.
_Tokens: TypeAlias = Sequence[int] | npt.NDArray[np.integer]
#: Slot indices: the same forms as ``_Tokens``, values in the 64-bit range (``int64``
#: arrays are copied as is).
_Indices: TypeAlias = Sequence[int] | npt.NDArray[np.integer]
#: Eviction policy names, as ``HybridCache.eviction_policy`` reports them, and the
#: spellings the constructor accepts.
_EvictionPolicyName: TypeAlias = Literal["lru", "lfu", "priority", "state-value"]
_EvictionPolicy: TypeAlias = Literal["lru", "lfu", "priority", "state-value", "state_value"]

class CacheError(Exception):
    """Root of the errors radixcache raises (argument errors stay ValueError/TypeError).

    Raised as such for request misuse (a finished, aborted or foreign request; a
    checkpoint/finish while the request's admission copy is unacknowledged; a batch
    started twice), and when the cache is broken: an internal error (a panic, which is a
    bug in radixcache) interrupted a change, so the cache refuses every call from then
    on, saying so. Build a new cache; dropping the old one's handles is safe.
    """

class InvariantError(CacheError):
    """audit() found a broken invariant."""

class StaleNodeError(CacheError):
    """A Node handle whose node no longer exists (evicted, or from another cache)."""

class LockError(CacheError):
    """A lock receipt released twice, or given to a cache it does not belong to."""

class L3Error(CacheError):
    """An L3 object store failed or timed out (the message says which).

    A call that raised may have taken partial effect (some keys of a ``put`` stored):
    every operation is idempotent, so retrying is safe.
    """

    #: Why, in words: ``"connection refused"``, ``"unreachable"``, ``"authentication
    #: failed"``, ``"bad database"``, ``"timeout"``, ``"protocol error"``, ``"server
    #: error"``, ``"cluster error"``, ``"connection closed"``, ``"i/o error"``,
    #: ``"injected failure"`` (``ObjectStore.faulty``), or a store client's own
    #: (``radixcache.mooncake``; ``"breaker open"`` from ``radixcache.l3.L3Tier``).
    cause: str

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
    @property
    def last_hash(self) -> bytes | None:
        """The SHA-256 of the last matched page, counting host data (``page_hashes``).

        The page ending at ``device_len + host_len``, the end of ``host_node``.
        ``HybridCache.chain_hashes(rest, parent_hash=last_hash)`` hashes the rest of the
        prompt from there (the L3 lookup). None when nothing matched or without page
        hashes. Read from the node: a match hashes nothing.
        """

@final
class KvEvent:
    """One KV event (docs/design.md, "KV events (core)").

    Oldest first from ``HybridCache.take_events()``.

    ``"stored"``: one node's pages became available on ``medium`` (``hashes``, one per
    page, chained from ``parent_hash``, the page before them, None at the first page of a
    chain; ``token_ids``: every token of the pages, in pages of ``block_size``).
    ``"removed"``: those pages are gone from ``medium``. ``"state_stored"`` /
    ``"state_removed"``: a Mamba state for the prefix ending with page ``hashes[0]``
    (a node's last page) became available on, or left, ``medium``: a router predicts a
    hybrid model's *usable* hit as the deepest stored page that has a state.
    ``"cleared"``: everything is gone: ``HybridCache.reset()`` emptied the cache.

    Emitted where the tree changes, per tier: pages published (an insert, a request's
    pages), device pages freed (eviction, demotion; under write-back when the eviction
    settles), a backup landing (``"CPU_PINNED"``), a host eviction, a load-back's copies
    landing (``"GPU"``). Never for pages in flight: a committed load-back still landing,
    or one that failed, emits nothing. Splits emit nothing. SWA pages are not announced.
    """

    @property
    def kind(self) -> Literal["stored", "removed", "cleared", "state_stored", "state_removed"]:
        """What happened."""
    @property
    def medium(self) -> Literal["GPU", "CPU_PINNED", "EXTERNAL", ""]:
        """Where: device memory, the host tier, or an external store (L3).

        ``""`` for ``"cleared"`` (every medium).
        """
    @property
    def namespace(self) -> str | None:
        """The namespace (None: the default one)."""
    @property
    def hashes(self) -> list[bytes]:
        """The pages' SHA-256 hashes (a state kind: the one hash of its last page)."""
    @property
    def parent_hash(self) -> bytes | None:
        """``"stored"``: the hash of the page before the first.

        None: the first page of its chain, or another kind.
        """
    @property
    def token_ids(self) -> list[int]:
        """``"stored"``: the pages' tokens; empty for the other kinds."""
    @property
    def block_size(self) -> int:
        """Tokens per page (the cache's ``page_size``)."""

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
    """What ``HybridCache.evict`` actually evicted, and with ``pools="engine"`` the slots."""

    @property
    def kv_tokens(self) -> int:
        """Device KV tokens freed."""
    @property
    def mamba_states(self) -> int:
        """Device Mamba states freed."""
    @property
    def kv_indices(self) -> npt.NDArray[np.int64]:
        """``pools="engine"``: every slot of every KV page freed, the engine's now.

        Empty with ``pools="cache"`` (the pages went to the cache's free list) and from
        ``evict_host``.
        """
    @property
    def mamba_slots(self) -> npt.NDArray[np.int64]:
        """``pools="engine"``: the state slots freed, the engine's now (else empty)."""

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
class Request:
    """A request admitted by ``HybridCache.admit``; it owns its slots.

    Every way out returns or publishes them: ``finish`` caches everything and donates
    the state, ``abort`` gives everything back, and a request garbage-collected while
    live is aborted with a ``ResourceWarning``. After finish/abort every property and
    call raises ``CacheError`` (``live`` is False).
    """

    @property
    def tokens(self) -> npt.NDArray[np.int64]:
        """Every token the request holds KV for: the reused prefix, then what was extended.

        Like ``kv_indices``: a read-only snapshot, costing what the request gained since
        the last read.
        """
    @property
    def prefix_len(self) -> int:
        """Tokens reusable on the device now (the locked cached prefix)."""
    @property
    def host_len(self) -> int:
        """Further tokens loadable from the host tier (0 without a host tier)."""
    @property
    def branch_len(self) -> int:
        """``Match.kv_len`` at admission: checkpoint here during prefill."""
    @property
    def swa_indices(self) -> npt.NDArray[np.int64]:
        """SWA layers: the SWA KV slot of each token from ``swa_start`` on.

        An int64 array aligned with ``tokens[swa_start:]``: what the SWA layers read and
        write. Empty without SWA layers. Re-read it after every ``extend``: the pages
        whose tokens left the window are given back.
        """
    @property
    def swa_start(self) -> int:
        """SWA layers: the first token ``swa_indices`` covers.

        At most the last ``swa_window`` tokens before the last ``extend`` (what its
        forward pass reads). The request's length without SWA layers.
        """
    @property
    def kv_indices(self) -> npt.NDArray[np.int64]:
        """Device KV slots of every token the request holds, in order.

        A read-only array that never changes once returned: a snapshot of the request
        when it was read. Reading costs what the request gained since the last read (the
        new slots are appended to a buffer the snapshots share), not its length, so a
        scheduler can read it every decode step; reading an unchanged request returns
        the same array. Re-read it after ``checkpoint``: tokens another request cached
        meanwhile then use the cache's slots.
        """
    @property
    def mamba_slot(self) -> int | None:
        """The request's own state slot, or None."""
    @property
    def node(self) -> Node:
        """The end node of the locked prefix."""
    @property
    def copy_pending(self) -> int | None:
        """Id of the admission copy-on-write batch until it is acknowledged, else None."""
    @property
    def load_pending(self) -> int | None:
        """Batch id of this request's load-back while one is pending, else None.

        Set from ``load_back`` until its copies are acknowledged (or its guard is
        released). Meanwhile the request may be aborted or extended but not finished or
        checkpointed.
        """
    @property
    def live(self) -> bool:
        """True until the request is finished or aborted (False once the cache broke)."""

@final
class LoadBack:
    """A load-back in progress: a guard that owns everything the load took.

    It holds the lock on the path being loaded (host copies and device ancestors), the
    device KV slots for the host-only nodes, the slot that restores the node's Mamba
    state and, for a request, the request's fresh state slot. ``commit()`` publishes
    them; leaving the ``with`` block uncommitted (including by an exception),
    ``release()``, or garbage collection (with a ``ResourceWarning``) gives every slot
    back and leaves the request exactly as it was: its earlier state slot, if any, is
    kept. If the batch was ``start``-ed, its destination slots return only at
    ``complete``/``fail``, so a copy still running never writes a slot someone else
    holds.

    Typical use::

        lb = cache.load_back(req, mem_quota=4096)
        if lb is not None:
            with lb:
                engine.run(lb.batch)   # start, copy, complete (may raise)
                lb.commit()
    """

    @property
    def batch(self) -> TransferBatch:
        """The host-to-device copies (kind ``"load_back"``).

        Acknowledge them with ``complete(batch.id)`` or ``fail(batch.id)``, before or
        after ``commit()``.
        """
    @property
    def kv_tokens(self) -> int:
        """KV tokens this load moves to the device."""
    @property
    def committed(self) -> bool:
        """True once ``commit()`` succeeded."""
    @property
    def held(self) -> bool:
        """True while the guard holds what it took (neither committed nor released)."""
    def commit(self) -> None:
        """Publish the load.

        The nodes get their device slots and the restored state (matchable once the
        batch is also completed), and the request's prefix grows to the loaded node with
        the fresh state slot as its own (its earlier slot is released when the copies
        land). ``fail`` on the batch after commit turns the load into a miss: the nodes
        go back to host-only and the request to what it was.

        Raises:
            CacheError: the batch failed already, the request extended since
                ``load_back``, or another load-back committed first is still landing on
                the same path (the guard is then released: a miss); or the guard was
                committed or released already.
        """
    def release(self) -> None:
        """Call the load off and give back everything it took (no-op once committed)."""
    def __enter__(self) -> LoadBack: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]: ...

@final
class Copy:
    """One copy of a batch: ``src[i]`` of ``src_tier`` to ``dst[i]`` of ``dst_tier``."""

    @property
    def pool(self) -> Literal["kv", "mamba", "swa"]:
        """The pool whose slots move.

        ``"kv"`` and ``"swa"`` (sliding-window attention KV) index token slots,
        ``"mamba"`` state slots. An ``"swa"`` copy moves the SWA KV of pages whose full
        KV the same batch copies (``"kv"``), slot by slot: device SWA slots are
        ``0..swa_slots``, host SWA slots ``0..host_swa_slots``.
        """
    @property
    def src_tier(self) -> Literal["device", "host", "external"]:
        """Where the data is read."""
    @property
    def dst_tier(self) -> Literal["device", "host", "external"]:
        """Where the data is written."""
    @property
    def src(self) -> npt.NDArray[np.int64]:
        """Source slots (read-only: the cache publishes what it listed)."""
    @property
    def dst(self) -> npt.NDArray[np.int64]:
        """Destination slots, one per source slot (read-only)."""

@final
class TransferBatch:
    """Data movement the cache needs, owned by this object until it ends.

    ``start()``, run the copies, then ``complete()`` or ``fail(reason)`` (or the same by
    id through the cache). Every slot a batch reads or writes stays held until then: a
    source is never freed and a destination never handed out while the copy may run.

    As a context manager, leaving the ``with`` block before the batch ended (by an
    exception or not) fails it: leaving says its copies no longer run. Collected before
    it ended, the batch is abandoned, with a ``ResourceWarning``: one never started is
    failed at once; a started one may still have copies running, so it stays in flight,
    holding its slots and listed by ``pending_batches()``, until it is acknowledged by
    id, which fails it either way. A ``LoadBack``'s batch (``lb.batch``) is owned by
    its guard until ``commit()``, then by the cache (acknowledge it through this object
    or by id); collecting it does nothing.

    A batch names slots of the cache that issued it: run it only on that cache's
    storage (``belongs_to``).
    """

    @property
    def id(self) -> int:
        """The id to acknowledge.

        It names the cache too (its high bits): another cache refuses it.
        """
    @property
    def kind(self) -> Literal["cow", "backup", "load_back", "l3_put", "l3_get"]:
        """Why the batch exists."""
    @property
    def copies(self) -> list[Copy]:
        """The copies, in the order they may run."""
    @property
    def outcome(self) -> Literal["completed", "failed", "abandoned"] | None:
        """How the batch ended through this object (``None``: it did not)."""
    @property
    def reason(self) -> str | None:
        """The reason it failed through this object, else ``None``."""
    def start(self) -> None:
        """Tell the cache the engine is about to run the copies.

        Raises:
            CacheError: the batch was started already.
            ValueError: the batch ended already (``batch_id``).
        """
    def complete(self) -> None:
        """Acknowledge the copies as done: publishes what the batch carried.

        See ``HybridCache.complete``.

        Raises:
            ValueError: the batch ended already (``batch_id``).
        """
    @property
    def keys(self) -> list[bytes]:
        """The page hash naming each object in the L3 tier (``"l3_put"``, ``"l3_get"``).

        Those of the KV copy's pages first (one per page), then those of the state
        copy's states (a state is named by the hash of the page it ends); empty for the
        other kinds. The slots of the ``"external"`` side of a copy are positions in
        those objects: object ``k`` of a KV copy is slots ``k * page_size`` to
        ``(k + 1) * page_size - 1``, of a state copy slot ``k``.
        """
    def complete_l3(self, pages: int, *, state: bool = False, gone: _Indices | None = None) -> None:
        """Acknowledge an ``"l3_get"`` batch whose first ``pages`` pages landed.

        ``state``: the state at their end landed too (a hybrid fetch lands only whole,
        with its state; anything less is a miss). The pages that did not land are a
        miss, and every slot the batch took and did not place goes back.

        ``gone``: indices into ``keys`` of the objects the store did not hold (missing,
        or corrupt and deleted; the state's index is the number of pages). Counted in
        ``stats()["l3_gone_objects"]``; with events on, each is announced as removed
        from ``"EXTERNAL"`` (a ``removed`` for pages, a ``state_removed`` for the
        state), in the fetch's namespace, so that a router's index forgets it.

        Raises:
            ValueError: the batch is not an ``"l3_get"`` batch, or ended already
                (``batch_id``); ``pages`` is negative; a ``gone`` index is negative,
                past ``keys`` or names an object reported landed (``gone``). Nothing
                changes then, and the batch stays in flight.
            TypeError: ``gone`` is not a sequence of ints.
        """
    def fail(self, reason: str | None = None) -> None:
        """Acknowledge the copies as failed: a failed copy is a miss, never a hit.

        See ``HybridCache.fail``; ``reason`` is kept in ``reason``.

        Raises:
            ValueError: the batch ended already (``batch_id``).
        """
    def belongs_to(self, cache: HybridCache) -> bool:
        """Tell whether ``cache`` issued this batch (its slots are that cache's).

        Raises:
            TypeError: ``cache`` is not a ``HybridCache``.
        """
    def __enter__(self) -> TransferBatch: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        """Fail the batch if it is still in flight; never swallows the exception."""

@final
class HybridCache:
    """A prefix cache for hybrid LLMs: radix tree, slot pools, locks and eviction.

    Args:
        kv_slots: device KV token slots (a multiple of ``page_size``).
        page_size: tokens per page; keys are matched and inserted in whole pages.
        mamba_slots: device Mamba state slots; 0 for an attention-only model. With
            states, matches are cut at the deepest node that has one.
        host_kv_slots: host-tier KV token slots (a multiple of ``page_size``); 0 for no
            host tier. Evicted nodes that were backed up are demoted to the host instead
            of deleted, and ``load_back`` brings them back.
        host_mamba_slots: host-tier Mamba state slots (needs ``mamba_slots`` and
            ``host_kv_slots``).
        write_policy: when device data is backed up to the host: ``"write_through"``
            (on insert), ``"write_through_selective"`` (once a node was inserted
            ``write_through_threshold`` times) or ``"write_back"`` (only a node being
            evicted; its device slots are freed when the backup completes). Without a
            host tier only the default ``"write_through"`` is accepted (there is nothing
            to back up to).
        write_through_threshold: inserts before a selective backup (>= 1; default 2).
            Only with ``"write_through_selective"``: the other policies refuse it.
        pools: who owns the device slots. ``"cache"`` (the default): the cache's own
            pools hand them out (``alloc_kv``, ``alloc_mamba``, requests). ``"engine"``:
            the engine's allocators own every slot, each starting as the engine's;
            ``insert`` claims the slots it is passed, and every slot the tree gives up
            goes back to the engine exactly once: ``evict`` returns the slots it freed
            (``Evicted.kv_indices``, ``Evicted.mamba_slots``), and the rest (pages of
            tokens cached already, an unaligned tail, a state the tree does not keep)
            is queued for ``take_freed()``. No host tier (``host_kv_slots`` and
            ``host_mamba_slots`` must be 0), and the calls that allocate from the
            cache's pools or give slots back to them raise ``CacheError``:
            ``alloc_kv``, ``free_kv``, ``alloc_mamba``, ``free_mamba``, ``admit``,
            ``extend``, ``extend_batch``, ``checkpoint``, ``finish``, ``abort``,
            ``load_back``, ``evict_host``.
        eviction_policy: the order in which eviction takes its candidates
            (docs/design.md, "Eviction policies"). ``"lru"`` (the default): least
            recently used first (states: those no match used before those one did).
            ``"lfu"``: least often matched first (a node counts the matches that use
            it, up to the cut; a state, the matches that use that state; inserts do
            not count), ties least recent first. ``"priority"``: lowest priority first
            (a node has the highest ``priority=`` of the ``insert`` and ``admit`` calls
            through it; a request's ``checkpoint`` and ``finish`` carry its own), ties
            least recent first. ``"state-value"`` (``"state_value"`` too; states only):
            states no match has used before used ones, each the state that saves the
            least compute first, weighted by depth, and aged so that states nobody uses
            go in time; a used state that the next state cached on its path
            supersedes (a conversation's previous turn) goes first. SWA (``"swa"``)
            takes ``"lru"``, ``"lfu"`` or ``"priority"`` with the KV meanings, over the
            nodes whose SWA pages ``evict_swa`` may take. A name applies to every
            component it applies to (``"state-value"``: KV and SWA keep ``"lru"``); a
            dict sets each, ``{"kv": ..., "mamba": ..., "swa": ...}``, missing ones
            ``"lru"``. The
            host tier follows the KV policy. An unknown name or component, or
            ``"state-value"`` for ``"kv"`` or ``"swa"``, raises ``ValueError`` naming
            ``eviction_policy``.
        swa_slots: device slots of the sliding-window attention (SWA) KV pool, a
            multiple of ``page_size``; 0 (the default) for a model without SWA layers.
            Every KV page the cache hands out (``alloc_kv``, ``extend``) comes with an
            SWA page, which follows it (a request, the tree, the caller) and is freed
            with it at the latest; a request gives back the SWA pages of its tokens
            that left the window early (``Request.swa_indices``). A match is cut where
            the last ``swa_window`` tokens (rounded up to whole pages) still have their
            SWA KV; ``evict_swa`` and allocations short of SWA pages turn the first
            nodes of the SWA eviction policy (least recently used under ``"lru"``) into
            SWA tombstones (their full KV stays) or delete leaves whole. Not with
            ``pools="engine"`` yet (``ValueError`` naming ``swa_slots``).
        swa_window: the tokens each SWA layer attends to (at least 1 with
            ``swa_slots``; 0 without: ``ValueError`` naming ``swa_window``).
        host_swa_slots: host-tier SWA slots, a multiple of ``page_size``: at least one
            page and at most ``host_kv_slots`` with ``swa_slots`` and a host tier, 0
            otherwise (``ValueError`` naming ``host_swa_slots``). A host KV page holds at
            most one host SWA page, as a device KV page does: a backup copies the SWA
            pages of the device pages that have one (``Copy.pool == "swa"``, device to
            host; a page without one is backed up without it), a load-back copies them
            back (host to device). A match through host-only nodes is cut by the same
            window rule, a host-only page counting as live when it has its host SWA
            page.
        page_hashes: every cached page carries a chained SHA-256 (docs/design.md, "Page
            hashes"): ``H_i = sha256(H_{i-1} || the page's tokens as uint32
            little-endian)``, the first page chained from its namespace's seed. Computed
            once when a page is cached (an insert, a request's pages), kept by splits and
            on the host tier, never computed by a match. Off by default, at no cost.
        hash_seed: 32 bytes, the default namespace's seed (the prior of its first
            page), from which named namespaces' seeds are derived too. None (the
            default): SGLang HiCache's chains: no prior in the default namespace, and a
            named namespace seeded as SGLang seeds an ``extra_key``. Only with
            ``page_hashes=True``; anything but None or 32 ``bytes`` raises
            (``TypeError``/``ValueError`` naming ``hash_seed``).
        events: queue KV events for cache-aware routers (``take_events()``,
            ``KvEvent``; ``stats()["events_emitted"]``, ``["events_pending"]``). Needs
            ``page_hashes=True`` (events name pages by their hashes): ``ValueError``
            naming ``events`` otherwise. The queue grows until taken.
        l3: share host pages with other caches through an L3 store, by page hash
            (docs/design.md, "The L3 tier"; ``radixcache.l3.L3Tier`` runs the
            ``"l3_put"`` and ``"l3_get"`` batches). Needs a host tier (with host state
            slots on a hybrid model), ``page_hashes=True`` and no SWA layers.
        l3_write: when host pages are written to the L3 store: ``"backup"`` (the
            default: as soon as a backup lands, so that every cache of a fleet finds them
            at once) or ``"host_eviction"`` (only when host eviction deletes them: the
            ``"l3_put"`` reads the deleted pages' host slots, which drain until it ends;
            a host allocation that needs them returns None having started, in one
            round, every put the room needs, as write-back's device eviction does).
            Only with ``l3=True``; ``ValueError`` naming ``l3_write`` otherwise, or for
            another name.

    Under write-back, an allocation that must evict nodes without a host copy starts,
    in one round, every backup that the room it asked for needs (a parent is chosen in
    the same pass as the children it waits for) and returns None: run
    ``take_batches()`` and retry once.

    Pools keep books only for the slots they have used, so a large ``kv_slots`` costs
    nothing until used. Threads may share a cache, and its objects: no call waits for a
    lock (the cache's, or a request's, receipt's or guard's) while holding the GIL. A
    call takes a free lock at once and releases the GIL while it waits for a held one
    (and always for inputs over 4,096 tokens); nothing holds a lock while it creates
    Python objects, so a garbage collection, its ``gc.callbacks`` and finalisers may use
    the cache from inside any call.

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
        write_through_threshold: int | None = None,
        pools: Literal["cache", "engine"] = "cache",
        eviction_policy: _EvictionPolicy | dict[str, _EvictionPolicy] = "lru",
        swa_slots: int = 0,
        swa_window: int = 0,
        host_swa_slots: int = 0,
        page_hashes: bool = False,
        hash_seed: bytes | None = None,
        events: bool = False,
        l3: bool = False,
        l3_write: Literal["backup", "host_eviction"] | None = None,
    ) -> HybridCache: ...
    @property
    def hash_seed(self) -> bytes | None:
        """The seed of the page-hash chains (None: SGLang HiCache's seeds)."""
    @property
    def events(self) -> bool:
        """Whether the cache queues KV events (``take_events()``)."""
    def take_events(self) -> list[KvEvent]:
        """Return the KV events emitted since the last call, oldest first.

        Raises:
            ValueError: naming ``events`` when the cache was built without them (it
                queues none, so a router fed from it would wait for ever): build it
                with ``page_hashes=True, events=True``.
        """
    def note_external_stored(
        self,
        hashes: Sequence[bytes],
        token_ids: _Tokens,
        *,
        namespace: str | None = None,
        parent_hash: bytes | None = None,
    ) -> None:
        """Announce pages written to an external store (the L3 tier).

        A ``"stored"`` event on ``"EXTERNAL"``. ``hashes``: one 32-byte hash per page of
        ``token_ids`` (pages of ``page_size``), chained from ``parent_hash``. The cache
        keeps no books of the external tier: what is announced is the caller's to get
        right.

        Raises:
            ValueError: events are off (names ``events``); ``token_ids`` is not one page
                per hash; a hash is not 32 bytes (names ``hashes[k]``).
            TypeError: ``hashes`` is not a list or tuple of bytes.
        """
    def note_external_removed(
        self, hashes: Sequence[bytes], *, namespace: str | None = None
    ) -> None:
        """Announce pages gone from the external store.

        A ``"removed"`` event on ``"EXTERNAL"``. Raises as ``note_external_stored``.
        """
    def _event_contents(
        self,
    ) -> tuple[list[tuple[str, str | None, bytes]], list[tuple[str, str | None, bytes]]]:
        """For tests: what the tree holds, as an index rebuilt from the events would.

        ``(pages, states)``, each a sorted list of ``(medium, namespace, hash)``: the
        hashes of the pages on each tier (``"GPU"``: landed device KV; ``"CPU_PINNED"``:
        host KV), and of the last pages of the nodes with a state there. Computed from
        the nodes, not from the events.
        """
    def page_hashes(self, node: Node) -> list[bytes]:
        """Return the SHA-256 of each page of ``node``, in order (a root has none).

        Raises:
            ValueError: the cache was built without ``page_hashes`` (names it).
            StaleNodeError: the node was evicted.
        """
    def chain_hashes(
        self,
        tokens: _Tokens,
        *,
        namespace: str | None = None,
        parent_hash: bytes | None = None,
    ) -> list[bytes]:
        """Hash the whole pages of ``tokens`` as this cache chains them.

        From ``parent_hash`` (the hash of the page just before ``tokens``, such as
        ``Match.last_hash``), or from ``namespace``'s seed when None (the tokens start
        at the root). An unaligned tail is not hashed. Works without ``page_hashes``
        too (it reads nothing from the tree).

        Raises:
            TypeError, ValueError: ``parent_hash`` not None or 32 bytes (names it).
        """
    @property
    def l3(self) -> bool:
        """Whether host pages go to, and come from, the L3 tier."""
    @property
    def l3_write(self) -> Literal["backup", "host_eviction"] | None:
        """When host pages go to the L3 tier: once backed up, or on host eviction.

        None without an L3 tier.
        """
    @property
    def page_size(self) -> int:
        """Tokens per page."""
    @property
    def kv_slots(self) -> int:
        """Device KV token slots."""
    @property
    def mamba_slots(self) -> int:
        """Device Mamba state slots."""
    @property
    def swa_slots(self) -> int:
        """Device slots of the sliding-window attention KV pool (0: no SWA layers)."""
    @property
    def swa_window(self) -> int:
        """The SWA layers' window in tokens (0: no SWA layers)."""
    @property
    def components(self) -> tuple[Literal["full", "mamba", "swa"], ...]:
        """The components of the model, full attention first.

        ``("full",)`` for attention only; ``"mamba"`` with ``mamba_slots``, ``"swa"`` with
        ``swa_slots``, in that order (docs/contract.md, rule 15).
        """
    @property
    def host_swa_slots(self) -> int:
        """Host-tier SWA slots (0: no SWA layers or no host tier)."""
    @property
    def host_kv_slots(self) -> int:
        """Host-tier KV token slots (0: no host tier)."""
    @property
    def host_mamba_slots(self) -> int:
        """Host-tier Mamba state slots."""
    @property
    def write_policy(self) -> Literal["write_through", "write_through_selective", "write_back"]:
        """When device data is backed up to the host tier."""
    @property
    def write_through_threshold(self) -> int | None:
        """Inserts before a selective backup (None unless the policy is selective)."""
    @property
    def eviction_policy(self) -> dict[str, _EvictionPolicyName]:
        """The eviction policy of each component.

        ``{"kv": name, "mamba": name}``, and ``"swa": name`` when the model has SWA
        layers.
        """
    @property
    def pools(self) -> Literal["cache", "engine"]:
        """Who owns the device slots: ``"cache"`` (its own pools) or ``"engine"``."""
    def load_back(
        self,
        target: Node | Request,
        *,
        mem_quota: int | None = None,
        request: Request | None = None,
    ) -> LoadBack | None:
        """Load the host-only part of a cached prefix back to the device.

        ``target`` is a ``Node`` (e.g. ``Match.host_node``; pass ``request=`` for the
        request admitted through it) or a ``Request`` (loads what its admission found
        on the host, ``host_len`` tokens). Returns a ``LoadBack`` guard owning what the
        load took, or None, having taken nothing, when there is nothing to load, part
        of the path is being loaded already, the KV tokens exceed ``mem_quota`` plus
        the tokens the load's own lock newly protected, or the device has no room for
        the KV or the state slots even after eviction, or (SWA layers) the target's
        window is not live on the host or the device has no SWA pages for it even after
        SWA eviction (``stats()`` counts each reason). For a hybrid model with a request
        it takes two state slots: one restores the node's state in the tree, one is the
        request's own copy. With SWA layers the pages of the target's window get device
        SWA pages and the batch copies their SWA KV too (``Copy.pool == "swa"``).

        Raises:
            StaleNodeError: the node no longer exists.
            ValueError: ``mem_quota`` < 0; the request has extended past its reused
                prefix, or ``target`` is not on the sequence it was admitted for (in its
                namespace, through its node); a request with a hybrid target that has no
                state on any tier; ``request=`` with a Request target.
            TypeError: ``target`` is neither a Node nor a Request.
            CacheError: the request is finished, its admission copy is pending, or it
                has a load-back pending already.
        """
    def l3_fetch(
        self, tokens: _Tokens, pages: int, *, namespace: str | None = None
    ) -> TransferBatch | None:
        """Fetch from the L3 tier what the cache lacks of the first ``pages`` pages of ``tokens``.

        ``pages``: how many leading whole pages of ``tokens`` the store holds (found by
        their hashes, ``chain_hashes``). The pages past those whose KV the cache holds
        (on either tier) are fetched, with the state at their end on a hybrid model.
        Takes, all at once, a lock on the node where the cached prefix ends (a new root
        for a namespace the cache holds nothing of), host KV pages and a host state
        slot (evicting from the host tier if short), and returns an ``"l3_get"`` batch
        (copies from ``"external"`` objects named by ``keys`` into those host slots)
        owned by the caller: run it and end it with ``complete``, ``complete_l3`` (part
        of it landed) or ``fail``; dropped or left before it ended, it fails. Once it
        lands, the pages are host-only nodes (pages the cache gained meanwhile are not
        placed twice) that a match finds on the host and ``load_back`` brings to the
        device. None, having taken nothing: nothing to fetch, part of the prefix is
        being loaded back, or no host room.

        Raises:
            ValueError: the cache has no L3 tier (``l3``), or ``pages`` goes past the
                whole pages of ``tokens`` (``pages``).
        """
    def match_prefix(self, tokens: _Tokens, *, namespace: str | None = None) -> Match:
        """Longest cached prefix of ``tokens``, rounded down to whole pages.

        Refreshes the LRU position of every node on the path. ``namespace`` selects a
        separate tree (LoRA adapter, cache salt); ``None`` is the default tree. A
        namespace has a tree only while it caches something (``insert`` and ``admit``
        make it; it goes with the last thing it held), so reads with ever new names cost
        no memory: a miss there answers one shared empty root.
        """
    def peek_prefix(self, tokens: _Tokens, *, namespace: str | None = None) -> tuple[int, int, int]:
        """``(device_len, host_len, kv_len)`` that ``match_prefix`` would answer now.

        Nothing changes: no node is split, refreshed or counted as matched, no
        statistic moves, so no eviction policy's order does (docs/contract.md rule 14).
        A scheduler ranks waiting requests by it (`radixcache.serving.Scheduler`'s
        ``schedule_policy="lpm"``).
        """
    def expect(
        self, prompts: Iterable[_Tokens], *, namespaces: Iterable[str | None] | None = None
    ) -> int:
        """Tell eviction which requests the scheduler admits next; returns the nodes marked.

        ``prompts``: the prompts of the waiting requests, soonest first (the tokens each
        would be admitted with); ``namespaces``: one namespace each (None: all in the
        default tree). The node where each one's match would end now (``peek_prefix``'s
        ``device_len``: with Mamba layers, the state it would resume from) is marked
        with its rank. KV and state eviction then take marked nodes only when no other
        candidate is left, the one needed latest first: Belady's rule over the waiting
        queue. A ``checkpoint`` whose state no waiting request needs sooner than every
        state it could displace is let go by (``checkpoint_states_bypassed``), as
        Belady's rule bypasses a newcomer needed later than everything kept.

        A state a checkpoint or a finish places is ranked for the waiting requests whose
        cached KV passes its node, or whose prompt goes on along its path (up to 1,024
        tokens past that KV are kept): a conversation's next turn, waiting while the
        turn before decodes.

        Each call replaces the last call's marks; ``expect([])`` clears them. The marks
        are a hint, never a lock: a marked node is still evicted when nothing else is
        left, and a mark left on a node that no waiting request needs any more only
        delays its eviction, so a scheduler calls again as its queue and the tree
        change (`radixcache.serving.Scheduler`'s ``lookahead``). While a queue is told
        of, a request's lock holds the state it matched only while its admission copy
        runs (one whose copy landed lets it go at this call), and its later locks hold
        the path alone. Nothing else changes: no node is split, refreshed or counted as
        matched, and no other counter moves (the state gauges only as those shares go;
        docs/contract.md rule 20).
        ``expected_nodes`` counts the marked nodes still cached, ``expected_evictions``
        the evictions that had to take one.

        Raises:
            TypeError: ``prompts`` is not an iterable (a list, a tuple, a 2-D array;
                not a string) of token sequences (naming the item), or ``namespaces`` not
                an iterable of str or None.
            ValueError: ``namespaces`` does not have one entry per prompt, or a token
                is out of range (naming the item).
        """
    def peek_hash(
        self, tokens: _Tokens, *, namespace: str | None = None
    ) -> tuple[int, bytes | None]:
        """``(kv_len, hash)``: where the KV ``match_prefix`` would find ends, and its hash.

        ``kv_len`` as ``peek_prefix``'s (whole pages, either tier, states ignored), and
        the hash of the page ending there: None when nothing matched or the cache has no
        page hashes. Nothing changes, as with ``peek_prefix``. The chain of the tokens
        past the cached KV continues from it:
        ``chain_hashes(tokens[kv_len:whole], namespace=, parent_hash=hash)`` (what the L3
        tier's lookup hashes, rather than the whole prompt).
        """
    def insert(
        self,
        tokens: _Tokens,
        kv_indices: _Indices,
        *,
        namespace: str | None = None,
        owned_from: int = 0,
        mamba_slot: int | None = None,
        priority: int = 0,
    ) -> Insert:
        """Cache ``tokens`` whose KV lives in ``kv_indices`` (one slot per token).

        ``kv_indices[:owned_from]`` must be the cache's own slots for that prefix (from
        an earlier match) and are left alone; the caller hands over the rest and must
        hold them (from ``alloc_kv``). Slots of tokens already cached, and of the
        unaligned tail past the last whole page, are freed by the cache: never free
        after an insert. ``mamba_slot`` (from ``alloc_mamba``), the state at the end of
        ``tokens``, is handed over too: it lands on the node where the insert ends, or
        is freed when that node has a state (``mamba_existed``) or when ``tokens`` has
        an unaligned tail (the state then matches no node's end). Bad arguments raise
        ``ValueError``/``TypeError`` naming the argument and change nothing.

        With ``pools="engine"`` the slots handed over (``kv_indices[owned_from:]``,
        ``mamba_slot``) come from the engine's allocators and must be the engine's: a
        slot in the tree, queued for ``take_freed``, out of range or listed twice
        raises ``ValueError`` naming the argument. What the cache does not keep is
        queued for ``take_freed()`` instead of freed.

        ``priority`` (an integer, default 0; higher is kept longer): under
        ``eviction_policy="priority"`` every node the insert passes or adds keeps the
        highest priority that went through it.
        """
    def lock(self, node: Node) -> Lock:
        """Protect the path from ``node`` to the root from eviction; returns the receipt.

        The node's Mamba state, if it has one, is locked too (a single-node lock).

        Raises:
            StaleNodeError: the node no longer exists.
        """
    def unlock(self, lock: Lock) -> None:
        """Release a receipt.

        Raises:
            LockError: released already, or the receipt belongs to another cache.
        """
    def evict_swa(self, *, pages: int = 0) -> int:
        """SWA layers: free at least ``pages`` SWA pages (or all that can go).

        In the SWA eviction policy's order (least recently used node first under
        ``"lru"``). An internal node keeps its full KV as an SWA
        tombstone; a leaf goes whole (a tombstone is never a leaf). Nodes whose window a
        lock or a request holds stay. Returns the SWA pages freed (0 without SWA
        layers).
        """
    def evict(self, *, kv_tokens: int = 0, mamba_states: int = 0) -> Evicted:
        """Evict at least that much (or all that is evictable), least recently used first.

        KV: unlocked leaves; a parent left as an unlocked leaf joins the candidates in
        the same pass; a leaf's state goes with its KV. Mamba: unlocked states by last
        use; an internal node's state (or a KV-locked leaf's) is dropped and the node
        kept as a tombstone, an unlocked leaf is deleted with its KV.

        With ``pools="engine"`` the slots freed are the engine's on return, listed in
        ``Evicted.kv_indices`` and ``Evicted.mamba_slots`` (not queued).
        """
    def take_freed(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """``pools="engine"``: hand the queued slots back, as ``(kv slots, state slots)``.

        Every slot of every queued KV page, and every queued state slot, is returned
        once and is the engine's from then on; a second call returns only what was
        queued since. With ``pools="cache"`` nothing is ever queued: two empty arrays.
        """
    def reset(self) -> None:
        """Empty the cache: every node of every namespace, on the device and host tiers.

        What a serving engine's "flush cache" calls between workloads. Only when nothing
        holds the tree: no live request, no live lock, no batch in flight (taken or not)
        and no pending load-back; otherwise ``CacheError`` naming each of them with its
        count, and nothing changes (run or fail the batches, end the requests, release
        the locks, then reset). Device slots go back to the pools (``pools="engine"``:
        queued for ``take_freed``), host slots to the host pools; nothing is written to
        the L3 tier (``l3_write="host_eviction"`` included) and its store keeps its
        objects, so later fetches find them. Counters keep counting (no eviction counter
        moves) and ``stats()["resets"]`` counts the call. Node handles from before the
        reset are stale (``StaleNodeError``). With ``events=True``, events still queued
        stay queued and one ``"cleared"`` event follows them (no removal per page).
        """
    def tree_slots(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Return the device slots the tree holds, as ``(kv slots, state slots)``, ascending.

        Every slot of every KV page in the tree and every state slot in it, on either
        kind of pools; slots queued for the engine, held by requests or by the caller
        are not listed. For an engine's census of its pools (a slot neither free in its
        allocator nor here nor held by a request has leaked); it costs a pass over the
        pages used, so it is not for every step.
        """
    def evict_host(self, *, kv_tokens: int = 0, mamba_states: int = 0) -> Evicted:
        """Evict host-only data: at least that much (or all that is evictable), LRU first.

        Takes unlocked host-only leaves (a parent left as one joins the candidates) and
        returns what left the host tier. Nodes with device data keep their host copies:
        ``evict`` them from the device first (which demotes them). ``evict`` then
        ``evict_host`` with each pool's size clears the cache. With SWA layers a
        host-only parent left a leaf without its host window goes too, and so does a
        device parent left a leaf ending in a page without SWA KV (an SWA tombstone,
        deleted from the device as ``evict`` would).

        Raises:
            CacheError: ``pools="engine"`` (no host tier).
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
    def alloc_mamba(self) -> int | None:
        """One device state slot, evicting the least recently used state first when short.

        Returns None, having taken nothing, when none can be had.
        """
    def free_mamba(self, slot: int) -> None:
        """Give back a state slot the caller holds.

        Raises:
            ValueError: the slot is free, owned by the cache, or out of range.
        """
    def admit(
        self, tokens: _Tokens, *, namespace: str | None = None, priority: int = 0
    ) -> Request | None:
        """Admit a request: match, lock the reused prefix, copy-on-write its state.

        With Mamba layers and a cached state, the request gets its own state slot and a
        ``"cow"`` batch copies the node's state into it. Returns None, having taken
        nothing, when no state slot can be had even after eviction. The request holds
        only the reused prefix; ``extend`` adds the rest. ``priority`` (an integer,
        default 0; higher is kept longer under ``eviction_policy="priority"``) raises
        the nodes the match uses to it, and what the request's ``checkpoint`` and
        ``finish`` cache takes it too.
        """
    def extend(self, request: Request, tokens: _Tokens) -> npt.NDArray[np.int64] | None:
        """One KV slot per token about to be fed (plus a state slot if it has none).

        The request's last partial page is filled first. Returns the new tokens'
        slots, or None (nothing taken) when they cannot be had even after eviction.
        """
    def extend_batch(
        self, requests: Sequence[Request], tokens: _Tokens
    ) -> npt.NDArray[np.int64] | None:
        """Extend each request by one token (``tokens[i]`` for ``requests[i]``): a decode step.

        Each request gets what ``extend(requests[i], [tokens[i]])`` would give it, in
        one call. All or nothing: returns one KV slot per request, in order, or None
        (nothing taken) when the whole step cannot be had even after eviction.

        Raises:
            ValueError: ``tokens`` is not one per request, or ``requests`` names a
                request twice.
            TypeError: ``requests`` holds something that is not a `Request`.
            CacheError: A request has ended or belongs to another cache.
        """
    def checkpoint(self, request: Request) -> None:
        """Cache what the request holds so far (chunked prefill).

        Inserts its whole pages, moves its lock to the new end node and, at a
        page-aligned length, emits a ``"cow"`` batch copying its state for the tree
        (published when the batch completes). The unaligned tail stays with the
        request.

        Raises:
            CacheError: the request is finished, or its admission copy or a load-back
                of it is pending.
        """
    def finish(self, request: Request) -> None:
        """Cache every token fed, donate the state slot, unlock; the request holds nothing.

        The state is freed instead when the end node has one already or the length is
        not page-aligned. To keep a turn's end state at an unaligned length,
        ``checkpoint`` the request when its length is page-aligned for the last time
        (docs/contract.md rule 2); a finish that lost it (no state where its last whole
        page ends, and no checkpoint copy on its way there) counts
        ``stats()["finish_states_lost"]``.

        Raises:
            CacheError: the request is finished, or its admission copy or a load-back
                of it is pending.
        """
    def abort(self, request: Request) -> None:
        """Give back everything the request holds and cache nothing.

        Raises:
            CacheError: the request is finished or aborted already.
        """
    def take_batches(self) -> list[TransferBatch]:
        """Batches the cache emitted since the last call (copy-on-write, backups).

        Each is owned by its object until it ends (see ``TransferBatch``). Run them
        before the next forward step of the requests involved: an admission
        copy fills the request's state slot, and a checkpoint copy reads the request's
        live state, which its next step overwrites.
        """
    def pending_batches(
        self,
    ) -> list[tuple[int, Literal["cow", "backup", "load_back", "l3_put", "l3_get"], bool]]:
        """Batches handed out and not yet acknowledged, as ``(id, kind, started)``.

        Oldest first. Handed out: taken with ``take_batches()`` or held by a ``LoadBack`` guard (its
        ``batch``); batches still waiting for ``take_batches()`` are not listed. An
        engine that restarts ends each one by id (``complete``/``fail``; a started one
        only once its copies can no longer run, since its slots drain until then). A
        started batch whose object was collected before it ended, or a started
        load-back's batch whose guard was released, is listed until it is acknowledged
        by id (``stats()["batches_draining"]`` counts these).
        """
    def start(self, batch_id: int) -> None:
        """Tell the cache the engine is about to run the batch's copies.

        Raises:
            ValueError: no such batch in flight (``batch_id``), or the id is another
                cache's.
            CacheError: the batch was started already.
        """
    def complete(self, batch_id: int) -> None:
        """Acknowledge a batch whose copies are done: publishes what it carried.

        Raises:
            ValueError: no such batch in flight (``batch_id``), or the id is another
                cache's.
        """
    def fail(self, batch_id: int) -> None:
        """Acknowledge a batch whose copies failed: a failed copy is a miss, never a hit.

        A failed admission copy drops its request back to ``prefix_len == 0`` with no
        tokens and no state slot, to recompute. A failed backup leaves its nodes not
        backed up (a write-back eviction then removes the node). A failed committed
        load-back puts the nodes back to host-only and the request back to its prefix
        before the load (tokens extended since are dropped).

        The slots a fail takes from a request (the KV it extended, the state slot the
        copy was filling) are retired, not freed: compute already queued on them may
        still write them, so they stay the request's until it ends (``finish`` or
        ``abort``) and are never handed out before. ``stats()`` counts them in
        ``kv_retired_slots`` and ``mamba_retired_slots`` (part of ``*_request_slots``).

        Raises:
            ValueError: no such batch in flight (``batch_id``), or the id is another
                cache's.
        """
    def evictable_size(self) -> int:
        """Device KV tokens in the tree that eviction may take."""
    def protected_size(self) -> int:
        """Device KV tokens in the tree protected by locks."""
    def total_size(self) -> int:
        """Device KV tokens in the tree."""
    def available_kv(self) -> int:
        """Free device KV slots (``pools="engine"``: slots queued for ``take_freed``)."""
    def available_mamba(self) -> int:
        """Free device Mamba state slots (0 without a Mamba pool; ``pools="engine"``: queued)."""
    def stats(self) -> dict[str, int]:
        """Counters and gauges, by name.

        Matches and hits (device and host), inserts, evictions, allocations, requests,
        copies, backups (done, skipped, failed), demotions, host evictions, load-backs
        (committed, called off per reason, failed) and pool levels. For each pool
        (``kv``, ``mamba``, ``host_kv``, ``host_mamba``) the gauges account for every
        slot, also while copies run: ``*_free_slots`` + ``*_cached_tokens`` (or
        ``_states``) + ``*_caller_slots`` + ``*_request_slots`` + ``*_draining_slots``
        = ``*_capacity_slots`` (host pools have no caller or request slots). Draining
        slots are held by transfers in flight or wait for one to end before they are
        free. ``kv_evicting_tokens``: device tokens an eviction chose under write-back,
        free once their backups land. ``kv_retired_slots`` / ``mamba_retired_slots``:
        request slots a failed copy took from live requests, free when they end.
        With SWA layers the ``swa_*`` gauges add up the same way, and with a host tier
        ``host_swa_free_slots`` + ``host_swa_cached_tokens`` +
        ``host_swa_draining_slots`` = ``host_swa_capacity_slots``; ``swa_backed_up_pages``,
        ``swa_backup_skipped_pages`` and ``swa_loaded_pages`` count the SWA pages backups
        copy, leave behind for want of host SWA pages, and load-backs copy back.

        With ``pools="engine"`` the free slots are those queued for ``take_freed`` and
        the caller slots are the engine's; ``kv_engine_slots``, ``kv_queued_slots``,
        ``mamba_engine_slots`` and ``mamba_queued_slots`` say so by name (0 with
        ``pools="cache"``), and ``kv_slots_returned`` / ``mamba_slots_returned`` count
        the slots handed back to the engine by ``evict`` and ``take_freed``.

        ``checkpoint_states_skipped`` counts checkpoints that placed no state (an
        unaligned length, or no slot); ``finish_states_lost`` counts finishes at an
        unaligned length that lost the turn's end state: the request held a state, and
        where its last whole page ends the tree has no state on either tier and no
        checkpoint copy is on its way (docs/contract.md rule 2 says how to keep it).

        ``events_emitted`` counts the KV events queued since the cache was built
        (``events=True``), ``events_pending`` those ``take_events()`` has not taken yet.
        ``resets`` counts the ``reset()`` calls that emptied the cache.

        ``expect_calls`` counts ``expect`` calls; ``expected_nodes`` is how many nodes
        the last one marked are still cached; ``expected_evictions`` counts evictions
        that took a marked node for want of any other; ``checkpoint_states_bypassed``
        counts checkpoints let go by because every state they could displace was
        expected sooner.
        """
    def audit(self) -> None:
        """Check every invariant; raises ``InvariantError`` naming the first broken one."""
    def pretty(self, max_nodes: int = 200, max_tokens: int = 8) -> str:
        """Return the tree as indented text (``str(cache)`` gives the same with the defaults).

        ``max_nodes`` and ``max_tokens`` are counts: a negative one raises ``ValueError``.
        """
    def _panic_for_tests(self) -> None:
        """For tests: a panic inside the core in the middle of a change, as a bug would.

        The cache is then broken: this and every later call raise ``CacheError``.
        """

#: What ``ObjectStore.get_into`` found for one key.
_Fetched: TypeAlias = Literal["ok", "missing", "foreign", "corrupt"]

@final
class ObjectStore:
    """An object store of the L3 tier, shared by every cache of a fleet.

    Opened from a URL: ``redis://HOST:PORT[/DB]`` (one Redis server),
    ``redis+cluster://HOST:PORT[,HOST:PORT...]`` (a Redis Cluster, discovered from any
    of the nodes listed) or ``file:///ABSOLUTE/DIR`` (one file per object, for one
    machine). Redis stores connect on first use, so a store that is down opens fine and
    its calls raise ``L3Error``; after an error the next call connects again.

    Keys are byte strings (at most 127 bytes for the file store). Every object is framed:
    a header holding a magic, a format version, the object's kind (``"kv"`` page or
    ``"mamba"`` state), the payload length, the 32-byte page hash the object is for, the
    32-byte identity digest of what its bytes mean (``radixcache.l3.L3Identity``) and a
    checksum of all of it, then the page's bytes; ``get_into`` verifies every field
    before a row counts as fetched. Puts are write-once: a key that holds an object keeps
    it. Each call is one batch (one pipelined round trip per Redis node) and runs with
    the GIL released.

    Raises (every method):
        ValueError: a bad argument (the message names it), including a URL that cannot
            be parsed and a key too long for the backend.
        TypeError: an argument of the wrong type (the message names it).
        L3Error: the store failed, or did not answer within ``timeout_ms``.
    """

    def __new__(cls, url: str, *, timeout_ms: int = 200) -> ObjectStore:
        """Open the store at ``url``.

        ``timeout_ms`` (1 to 86,400,000: a day) bounds each call, so a dead or slow
        store fails a call quickly instead of holding it.
        """
    @staticmethod
    def faulty(
        url: str,
        *,
        seed: int,
        fail: float = 0.0,
        timeout: float = 0.0,
        lose: float = 0.0,
        corrupt: float = 0.0,
        timeout_ms: int = 200,
    ) -> ObjectStore:
        """For tests: the store at ``url`` with faults drawn from ``seed``.

        Each call fails (``L3Error``) with probability ``fail`` or times out
        (``L3Error`` saying "timed out") with probability ``timeout``; half of those
        take effect before the error, as a reply lost on the way would. Of the objects a
        ``get_into`` finds, each is lost (reported ``"missing"`` although ``exists``
        says it is there) with probability ``lose``, or comes back with one byte flipped
        (so reported ``"corrupt"``, and deleted) with probability ``corrupt``. Rates are
        in 0..=1; the same seed and calls give the same faults.
        """
    @property
    def url(self) -> str:
        """The URL it was opened with."""
    @property
    def timeout_ms(self) -> int:
        """The timeout of each call, in milliseconds."""
    def check(self) -> None:
        """Check now that the store can be used; raise ``L3Error`` saying why not.

        Redis: connect, authenticate and select the database; a cluster: read its
        topology; files: the directory is there and writable. Calls connect on first use
        anyway: this is for refusing to start against a store that cannot be used.
        """
    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key holds an object."""
    def put(
        self,
        keys: Sequence[bytes],
        hashes: Sequence[bytes],
        data: npt.NDArray[np.uint8],
        *,
        kind: Literal["kv", "mamba"],
        identity: bytes,
    ) -> list[bool]:
        """Store row ``i`` of ``data`` as the page whose hash is ``hashes[i]``, under ``keys[i]``.

        ``data`` is a C-contiguous 2-D ``uint8`` array with one row per key (a page's
        bytes); ``hashes`` are 32 bytes each; every frame records ``kind`` and
        ``identity`` (32 bytes). Write-once: a key that holds an object is left alone.
        Returns, per key, whether this call stored it.
        """
    def get_into(
        self,
        keys: Sequence[bytes],
        hashes: Sequence[bytes],
        out: npt.NDArray[np.uint8],
        *,
        kind: Literal["kv", "mamba"],
        identity: bytes,
    ) -> list[_Fetched]:
        """Fetch ``keys`` into the rows of ``out``, verifying each as page ``hashes[i]``.

        ``out`` is a writable C-contiguous 2-D ``uint8`` array with one row per key, each
        the page's size. One outcome per key: ``"ok"`` (the row holds the page, every
        header field and the checksum verified), ``"missing"`` (no object),
        ``"foreign"`` (an intact object of another ``kind`` or ``identity``: another
        model, rank or layout; deleted) or ``"corrupt"`` (the object failed verification,
        including one of another page or size, or the store could not read it, as a
        Redis key holding a list; deleted). Rows not ``"ok"`` are
        left untouched. When it raises, any row may hold part of what was read: treat
        none of them as fetched.
        """
    def delete(self, keys: Sequence[bytes]) -> None:
        """Remove the objects under ``keys`` (absent ones are no error)."""

@final
class Breaker:
    """The L3 tier's circuit breaker, on the monotonic clock.

    Closed, calls go through; ``threshold`` consecutive failures open it. Open, ``allow()``
    refuses calls until ``cooldown_ms`` have passed since it opened; the first caller
    after that is let through as the probe and the state is ``"half_open"`` (others are
    still refused). The probe's ``success()`` closes it; its ``failure()`` opens it again
    for a new cooldown. So a dead store costs one timeout per cooldown, not one per call.
    Thread-safe.

    Raises:
        ValueError: ``threshold`` below 1 or ``cooldown_ms`` below 0.
    """

    def __new__(cls, *, threshold: int = 5, cooldown_ms: int = 1000) -> Breaker: ...
    def allow(self) -> bool:
        """Whether a call may go to the store now (see the class docs)."""
    def success(self) -> None:
        """Report that a call let through succeeded."""
    def failure(self) -> None:
        """Report that a call let through failed (an ``L3Error``)."""
    @property
    def state(self) -> Literal["closed", "open", "half_open"]:
        """The state (an open breaker whose cooldown passed stays "open" until asked)."""
    @property
    def errors(self) -> int:
        """Failures reported, in all."""
    @property
    def trips(self) -> int:
        """Times it opened."""
    @property
    def threshold(self) -> int:
        """Consecutive failures that open it."""
    @property
    def cooldown_ms(self) -> int:
        """How long it stays open before a probe, in milliseconds."""
