"""A workload replayed through a tree cache in SGLang's own scheduler code, on the CPU.

`replay_sglang` serves a list of jobs through a tree cache that SGLang 0.5.23's registry
builds (its own ``UnifiedRadixCache`` on either tree core, or any ``--radix-cache-backend``
by name: benches/sglang_backend.py proves radixcache's backend this way), driving it with
SGLang's own request object (``Req``) and the calls its scheduler makes, in a simplified
continuous-batching loop, and times the cache operations only. benches/vs_sglang.py and
benches/sglang_backend.py run it. Importing it imports SGLang (an ``ImportError`` says
SGLang is not installed), after `_sglang_shim` has registered its placeholders for the
heavy packages SGLang's import chain reaches.

The pools are built as SGLang's ``kv_cache_configurator`` builds them for a one-device
server and as SGLang's unit tests build their fixtures: a ``ReqToTokenPool`` and an
``MHATokenToKVPool`` (attention only), or a ``HybridReqToTokenPool`` with a small Mamba2
state shape and a ``HybridLinearKVPool`` (hybrid); a ``TokenToKVPoolAllocator`` at page
size 1, a ``PagedTokenToKVPoolAllocator`` above. The tree cache is built as the
scheduler's cache builder builds it: the plugins of the entry-point group
``sglang.srt.plugins`` loaded first, then the registry's ``create_tree_cache`` with a
``TreeCacheBuildContext`` (no tensor-parallel worker, no model config), which reads the
published server arguments: ``radix_cache_backend`` set to the backend's name, or unset for
SGLang's default chain, where ``CacheInitParams(tree_core_backend=...)`` picks the tree
core (the Python ``UnifiedTreeCore`` or the bundled Rust one). The server arguments are
published as the unit tests do (``ServerArgs(model_path="dummy", ...)``, attention
backend ``torch_native``, so every ``req_to_token`` write takes SGLang's torch path, no
Triton kernel).

With ``verify=True`` the replay also runs the checksum model over SGLang's real KV and
Mamba pool tensors and SGLang's pool invariant checks after every step
(benches/_sglang_proof.py), outside the timed calls; with ``retract_every=N`` it retracts
a decoding request every N decode steps (below).

The loop (deterministic; the radixcache side runs the same one), each step:

1. **Admit** waiting jobs in order while fewer than ``max_running`` requests run (hybrid:
   also fewer than ``mamba_slots - 2``). For each, as the scheduler and its
   ``PrefillAdder`` do: ``req.init_next_round_input(tree_cache)`` (the match; on a hybrid
   tree it also takes a Mamba slot for the copy-on-write of the matched state), a
   temporary ``tree_cache.lock`` of the matched node while memory is checked, then the
   request's own lock and the temporary one's unlock. The memory check is the adder's
   (``PrefillBudget``): the request needs ``prompt - prefix + max_new + page_size``
   tokens, which must be fewer than the allocator's ``available_size()`` plus the tree's
   evictable tokens (``full_evictable_size()`` on a hybrid tree) minus what the running
   requests will still allocate (their prompt tokens not yet allocated and their output
   not yet produced: the adder's reservation with ``new_token_ratio`` 1, as for
   fixed-length requests) and minus what was admitted before it in this step. A request
   that does not fit is unlocked, its copy-on-write Mamba slot freed (as the scheduler
   does), and admission stops for this step; if nothing runs and it does not fit, it
   never will: `RuntimeError`.
2. **Prefill**: each prefilling request (those admitted in earlier steps first) extends
   one chunk of at most ``chunk_size`` prompt tokens (a cut chunk ends on a page
   boundary, as the adder cuts it). The chunks form one prefill batch, as the
   scheduler's: one ``ScheduleBatch`` of them all and one ``alloc_for_extend(batch)``
   (what ``ScheduleBatch.prepare_for_extend`` calls: request rows and Mamba state slots,
   KV slots for the whole batch with evict-to-free, the ``req_to_token`` writes, the KV
   lengths), then the deferred Mamba copy-on-write or clear the model runner does for the
   batch before the forward (``copy_mamba_state`` / ``clear_slots``). Then, for each
   request in the batch: a chunk that does not end the prompt is
   followed by ``checkpoint_kv_cache`` (the scheduler's ``stash_chunked_request``); the
   last one produces the first output token, and, as
   ``process_batch_result_prefill`` does, the request is then checkpointed
   (``checkpoint_kv_cache``) or, when finished, released.
3. **Decode**: every request whose prefill ended in an earlier step feeds one token:
   one ``ScheduleBatch`` of them all and one ``alloc_for_decode(batch, 1)`` (one KV
   allocation for the whole batch, evict-to-free when short, the row writes, the KV
   lengths), then the next output token is appended and ``req.update_finish_state()``
   run. A request that has produced all its output is finished (``FINISH_LENGTH``) and
   released with ``release_kv_cache(req, tree_cache, checkpoint=True)``, which inserts
   it into the tree, unlocks it and frees its request row. With ``retract_every`` N,
   every N-th decode step first retracts one request (if more than one decodes): the
   one SGLang's ``retract_decode`` gives up first (its retraction order), through
   SGLang's ``release_req`` (``release_kv_cache(..., checkpoint=False)``, an eviction for
   the requests left, ``reset_for_retract``); it goes back to the head of the queue and
   is later matched and prefilled again, its prompt and its output so far.

Hybrid caches run SGLang's Mamba radix-cache strategy ``extra_buffer``: what SGLang's
``auto`` strategy resolves to for models that support it whenever overlap scheduling
is on (the default) or the page size is above 1 (``no_buffer`` only supports page
size 1). Each request then tracks its state in a ping-pong buffer of Mamba slots: on a
prefill chunk at its last ``mamba_checkpoint_grid`` multiple past the prefix (or at the
match's branching point when it falls in the chunk: SGLang's own branch-point
checkpoint), and on decode every ``mamba_track_grid`` tokens; a checkpoint donates the
tracked state to the tree and the finish inserts up to the last tracked length. The
bookkeeping is SGLang's: ``ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend``
and ``set_mamba_track_indices_from_reqs`` when a batch is prepared, and the result
processor's ``_mamba_prefix_cache_update`` after a decode step. ``mamba_strategy=
"no_buffer"`` (page size 1 only) runs the other strategy: one state slot per request,
forked into the tree at every checkpoint and donated at the finish. The ping-pong buffer
has one slot (``enable_overlap_schedule=False`` for the pool), as this loop does not
overlap scheduling with compute. Both simplifications favour SGLang's hit rate: its
default (overlap on) gives the buffer two slots, a third state slot per running request
(gsp, 256 slots: 0.331 instead of 0.383), and its scheduler shares one ``chunk_size``
budget per prefill batch and does not decode in a step that prefills (0.374).

Timed (``time.perf_counter_ns`` around each call; Python's garbage collector is off during
the replay): the match, lock and unlock, the rejected admission's Mamba free,
``alloc_for_extend`` and ``alloc_for_decode`` (request rows, Mamba slots, KV allocation
with eviction, ``req_to_token`` writes), ``checkpoint_kv_cache``, ``release_kv_cache``
and a retraction's ``release_req``. Each call is charged to its request; a batch's
allocation (prefill or decode) is split evenly over the requests of its batch. Each timed
call is also split (`Meter`, benches/_sglang_meter.py) into the allocator's part and the
rest. The
allocator's part: every call into SGLang's KV slot allocator, Mamba slot allocator and
request-row pool (``write``: the ``req_to_token`` page-table writes), wherever it is made
(a free inside an insert or an eviction included), and the whole of ``alloc_for_extend``
/ ``alloc_for_decode`` except the tree eviction they trigger. ``per_request_alloc_ns`` is
that part, per request. The instrumentation's own cost is measured and taken out of the
time; what of it falls inside an allocator call stays with the allocator's part. The Mamba state's
copy-on-write and clear (a real copy of a small state on this CPU, a kernel launch on a
GPU) are timed and reported but charged to no request: they move data, and the
radixcache side moves none. Not timed: building ``Req`` objects and batches (and the
tensors of lengths and indices a scheduler already holds), the memory check's reads of
the pool sizes, the finish check, SGLang's Mamba tracking bookkeeping, this loop's own
bookkeeping and the progress callback.
"""

from __future__ import annotations

import gc
import importlib
import time
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

try:
    from ._sglang_meter import Clock, Meter  # type: ignore[attr-defined]
    from ._sglang_proof import Checksums, Invariants, prefix_values  # type: ignore[attr-defined]
except ImportError:  # run as a script from benches/
    from _sglang_meter import Clock, Meter  # type: ignore[no-redef]
    from _sglang_proof import Checksums, Invariants, prefix_values  # type: ignore[no-redef]

__all__ = ["DATA_OPS", "match_prefix_ns", "replay_sglang"]

Job = tuple[Sequence[int], Sequence[int], "str | None"]

#: Layers of the hybrid model whose state the Mamba pool holds (SGLang's unit-test
#: fixture: 24 layers, every fourth one full attention), and its Mamba2 state shape.
_NUM_LAYERS = 24
_FULL_ATTENTION_LAYERS = (3, 7, 11, 15, 19, 23)
_MAMBA2_SHAPE = dict(
    tp_world_size=1,
    intermediate_size=256,
    n_groups=1,
    num_heads=2,
    head_dim=16,
    state_size=16,
    conv_kernel=4,
)
#: KV pool geometry: one head of one element, which the checksum model (`_Checksums`)
#: writes; the pool is float32, which holds its values (below 2**24) exactly, as is the
#: Mamba pool's temporal state (``SGLANG_MAMBA_SSM_DTYPE``).
_KV_HEADS = 1
_KV_HEAD_DIM = 1


#: The tree cores of SGLang's own ``UnifiedRadixCache`` (its default chain builds it);
#: any other backend name is a ``--radix-cache-backend`` name.
SGLANG_CORES = ("python", "rust")

_OPS = (
    "match",
    "lock",
    "unlock",
    "mamba_free",
    "alloc_extend",
    "mamba_state_copy",
    "mamba_state_clear",
    "checkpoint",
    "alloc_decode",
    "release",
    "retract",
)
#: Data movement (a real copy of the state on this CPU): recorded, but charged to no
#: request, because the radixcache side makes no copies either (its batches complete at
#: once, untimed).
DATA_OPS = ("mamba_state_copy", "mamba_state_clear")


#: What the replay calls in SGLang, by module (``name as alias`` renames).
_IMPORTS = {
    "sglang.kernels.ops.attention.fla.chunk_delta_h": ("CHUNK_SIZE as FLA_CHUNK_SIZE",),
    "sglang.srt.configs.mamba_utils": ("Mamba2CacheParams", "Mamba2StateShape"),
    "sglang.srt.disaggregation.utils": ("DisaggregationMode",),
    "sglang.srt.environ": ("envs",),
    "sglang.srt.managers.schedule_batch": (
        "FINISH_LENGTH",
        "Req",
        "ScheduleBatch",
        "release_req",
        "set_mamba_track_indices_from_reqs",
    ),
    "sglang.srt.managers.scheduler_components.invariant_checker": ("SchedulerInvariantChecker",),
    "sglang.srt.managers.scheduler_components.pool_stats_observer": (
        "SchedulerPoolStatsObserver",
        "kv_mamba_slots",
    ),
    "sglang.srt.managers.scheduler_components.batch_result_processor": (
        "SchedulerBatchResultProcessor",
    ),
    "sglang.srt.mem_cache.allocation": ("alloc_for_decode", "alloc_for_extend"),
    "sglang.srt.mem_cache.allocator": ("PagedTokenToKVPoolAllocator", "TokenToKVPoolAllocator"),
    "sglang.srt.mem_cache.base_prefix_cache": ("EvictParams", "MatchPrefixParams"),
    "sglang.srt.mem_cache.radix_cache": ("RadixKey",),
    "sglang.srt.mem_cache.cache_init_params": ("CacheInitParams",),
    "sglang.srt.mem_cache.common": ("checkpoint_kv_cache", "release_kv_cache"),
    "sglang.srt.mem_cache.memory_pool": (
        "HybridLinearKVPool",
        "HybridReqToTokenPool",
        "MHATokenToKVPool",
        "ReqToTokenPool",
    ),
    "sglang.srt.mem_cache.registry": ("TreeCacheBuildContext", "create_tree_cache"),
    "sglang.srt.plugins": ("load_plugins",),
    "sglang.srt.runtime_context": ("mamba_track_grid",),
    "sglang.srt.sampling.sampling_params": ("SamplingParams",),
    "sglang.srt.server_args": ("ServerArgs", "set_global_server_args_for_scheduler"),
    "sglang.srt.speculative.spec_info": ("SpeculativeAlgorithm",),
}


def _load() -> SimpleNamespace:
    """Import what the replay uses from SGLang, the shim's placeholders first."""
    try:
        from . import _sglang_shim  # type: ignore[attr-defined]
    except ImportError:  # run as a script from benches/
        import _sglang_shim  # type: ignore[no-redef]

    _sglang_shim.install()
    import torch

    sg = SimpleNamespace(torch=torch)
    for module_name, names in _IMPORTS.items():
        module = importlib.import_module(module_name)
        for entry in names:
            name, _, alias = entry.partition(" as ")
            setattr(sg, alias or name, getattr(module, name))
    return sg


#: SGLang, imported with this module (an ImportError here means it is not installed).
_SG = _load()


@dataclass(eq=False)
class _Live:
    """A request being served."""

    req: Any
    output: Sequence[int]
    prompt_len: int
    ns: int = 0
    alloc_ns: int = 0  # of `ns`: the allocator's part (`Meter`)
    prefilled: int = 0  # prompt tokens with KV allocated
    decoding: bool = False  # its prefill ended in an earlier step
    kv_values: Any = None  # verify: what the model computes per position (`Checksums`)
    state_values: Any = None  # verify: the state after n tokens, per n


#: Methods of SGLang's KV slot allocator, Mamba slot allocator and request-row pool that the
#: meter counts as allocator work: slots and rows handed out and given back, their sizes
#: read, and the ``req_to_token`` page-table writes (``write``). The allocator's
#: ``evict_to_free_tokens`` is not among them: it runs the tree's eviction, which radixcache
#: does too.
_ALLOCATOR_METHODS = {
    "kv": (
        "alloc",
        "alloc_extend",
        "alloc_decode",
        "free",
        "free_segment",
        "free_segments",
        "free_full",
        "free_full_segment",
        "free_full_segments",
        "free_page_ids",
        "free_group_begin",
        "free_group_end",
        "merge_and_sort_free",
        "available_size",
        "get_extend_allocation_demand",
    ),
    "rows": (
        "alloc",
        "alloc_rows",
        "free",
        "free_rows",
        "write",
        "alloc_aux_to_lengths",
        "available_size",
        "free_mamba_cache",
        "donate_mamba_ping_pong_slot",
        "set_mamba_ping_pong_slot",
    ),
    "mamba": (
        "alloc",
        "free",
        "alloc_group_begin",
        "alloc_group_end",
        "available_size",
        "schedulable_available_size",
    ),
}
#: The tree's own eviction: kept in SGLang's allocator-free figure even when an allocation
#: (an allocator zone) triggers it.
_TREE_METHODS = ("evict", "evict_for_alloc")


def replay_sglang(
    jobs: Sequence[Job],
    *,
    hybrid: bool,
    backend: str,
    kv_slots: int,
    mamba_slots: int,
    page_size: int,
    max_running: int,
    chunk_size: int,
    progress: Callable[[int], None] | None = None,
    mamba_strategy: str = "extra_buffer",
    verify: bool = False,
    retract_every: int = 0,
) -> dict[str, Any]:
    """Serve `jobs` through a tree cache SGLang's registry builds, and time its operations.

    Args:
        jobs: ``(prompt, output, namespace)`` in arrival order; the namespace (or None)
            becomes the request's ``extra_key``.
        hybrid: Full attention plus Mamba (else attention only).
        backend: ``"python"`` or ``"rust"``: SGLang's default chain (its
            ``UnifiedRadixCache``) on that tree core; any other name is a
            ``--radix-cache-backend`` name, built by the registry's factory for it (the
            ``sglang.srt.plugins`` entry points are loaded first).
        kv_slots: KV token slots.
        mamba_slots: Mamba state slots (hybrid only).
        page_size: Tokens per page (1 or a power of two, e.g. 16).
        max_running: Most requests served at once.
        chunk_size: Most prompt tokens one request prefills in one step.
        progress: Called once per step with the number of finished requests (untimed).
        mamba_strategy: SGLang's Mamba radix-cache strategy, ``"extra_buffer"`` (what
            ``auto`` resolves to by default) or ``"no_buffer"`` (page size 1 only).
        verify: Run the checksum model and SGLang's pool invariants after every step
            (benches/_sglang_proof.py; untimed).
        retract_every: Every this many decode steps (0: never), retract one decoding
            request, the one SGLang's ``retract_decode`` gives up first, through SGLang's
            ``release_req``; it goes back to the head of the queue and is prefilled
            again (prompt and output so far).

    Returns:
        ``system``, ``tree_core`` (the class that ran), ``mamba_strategy`` (hybrid),
        ``requests``, ``prompt_tokens``, ``device_hit_tokens`` (``first_admission_hit_tokens``:
        those of requests not retracted before), ``hit_rate``,
        ``per_request_ns`` (in finish order), ``per_request_alloc_ns`` (the allocator's
        part of it: `Meter`), ``ops`` (ns per call, by operation), ``alloc_ops`` (the
        allocator's part of each call), ``instrumentation`` (wrapped calls and what a
        wrapper costs), ``seconds`` (the replay's wall time, untimed work included),
        ``retractions``, ``leaks`` and, with `verify`, ``verify`` (`Checksums` and
        `Invariants` results).

    Raises:
        ValueError: A bad argument.
        RuntimeError: The Rust tree core was asked for but the Python one ran; or a
            request can never fit in the KV pool.
    """
    if not backend.strip():
        raise ValueError("backend: 'python', 'rust' or a registered backend name, got ''")
    if retract_every < 0:
        raise ValueError(f"retract_every: must be >= 0, got {retract_every}")
    if mamba_strategy not in ("extra_buffer", "no_buffer"):
        raise ValueError(f"mamba_strategy: 'extra_buffer' or 'no_buffer', got {mamba_strategy!r}")
    if hybrid and mamba_strategy == "no_buffer" and page_size != 1:
        raise ValueError("mamba_strategy 'no_buffer' supports page_size 1 only (as SGLang)")
    for name, value in (
        ("kv_slots", kv_slots),
        ("page_size", page_size),
        ("max_running", max_running),
        ("chunk_size", chunk_size),
    ):
        if value < 1:
            raise ValueError(f"{name}: must be >= 1, got {value}")
    if chunk_size < page_size:
        raise ValueError(f"chunk_size ({chunk_size}) must be at least page_size ({page_size})")
    if kv_slots % page_size:
        raise ValueError(f"kv_slots ({kv_slots}) must be a multiple of page_size ({page_size})")
    if hybrid and mamba_slots < 4:
        raise ValueError(f"mamba_slots: must be >= 4 for a hybrid cache, got {mamba_slots}")
    _SG.torch.set_num_threads(1)
    replay = _Replay(
        _SG,
        jobs,
        hybrid=hybrid,
        backend=backend,
        kv_slots=kv_slots,
        mamba_slots=mamba_slots,
        page_size=page_size,
        max_running=max_running,
        chunk_size=chunk_size,
        extra_buffer=hybrid and mamba_strategy == "extra_buffer",
        verify=verify,
        retract_every=retract_every,
    )
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        replay.run(progress)
        seconds = time.perf_counter() - start
    finally:
        gc.enable()
    result = replay.result()
    result["seconds"] = seconds
    if hybrid:
        result["mamba_strategy"] = mamba_strategy
    return result


def match_prefix_ns(
    tokens: Sequence[int], *, backend: str, page_size: int, repeats: int
) -> list[int]:
    """Cache `tokens` (a one-request replay) and time ``match_prefix`` of them from Python.

    Each call passes the tokens as SGLang's ``Req`` holds them (an ``array("q")``, built
    once, untimed: SGLang's tree compares keys of that type only) in a ``RadixKey`` built
    inside the timed region, as ``match_kv_cache`` does. Returns the ns of each of
    `repeats` calls.
    """
    job: Job = ([*tokens, 0], [0], None)
    tokens = array("q", tokens)
    slots = (len(tokens) + 2 * page_size) // page_size * page_size + page_size
    replay = _Replay(
        _SG,
        [job],
        hybrid=False,
        backend=backend,
        kv_slots=slots,
        mamba_slots=0,
        page_size=page_size,
        max_running=1,
        chunk_size=len(tokens) + page_size,
        extra_buffer=False,
    )
    replay.run(None)
    tree, key, params = replay.tree, _SG.RadixKey, _SG.MatchPrefixParams
    if tree.match_prefix(params(key=key(tokens))).device_prefix_len != len(tokens):
        raise RuntimeError("the cached prefix does not match whole")
    out = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        tree.match_prefix(params(key=key(tokens)))
        out.append(time.perf_counter_ns() - start)
    return out


class _Replay:
    """One replay: the cache, the pools and the loop's state."""

    def __init__(
        self,
        sg: SimpleNamespace,
        jobs: Sequence[Job],
        *,
        hybrid: bool,
        backend: str,
        kv_slots: int,
        mamba_slots: int,
        page_size: int,
        max_running: int,
        chunk_size: int,
        extra_buffer: bool,
        verify: bool = False,
        retract_every: int = 0,
    ) -> None:
        self.sg = sg
        self.jobs = jobs
        self.hybrid = hybrid
        self.kv_slots = kv_slots
        self.mamba_slots = mamba_slots if hybrid else 0
        self.page_size = page_size
        self.chunk_size = chunk_size
        self.limit = min(max_running, mamba_slots - 2) if hybrid else max_running
        if hybrid:
            # A running request holds its state slot, its tracking slot (extra_buffer)
            # and, through its lock, the tree's state at its matched node.
            held = 3 if extra_buffer else 2
            if self.limit * held > mamba_slots:
                raise ValueError(
                    f"mamba_slots ({mamba_slots}) cannot hold {self.limit} running requests "
                    f"({held} state slots each with mamba_strategy "
                    f"{'extra_buffer' if extra_buffer else 'no_buffer'})"
                )
        self.meter = Meter()
        self.clock = Clock(self.meter, {op: [] for op in _OPS}, DATA_OPS)
        self.waiting: deque[int] = deque(range(len(jobs)))
        self.tried: dict[int, _Live] = {}  # waiting jobs that did not fit (retried)
        self.running: list[_Live] = []
        self.per_request_ns: list[int] = []
        self.per_request_alloc_ns: list[int] = []
        self.prompt_tokens = 0
        self.device_hit_tokens = 0
        self.first_hit_tokens = 0  # of requests on their first admission (not retracted)
        self.finished = 0
        self.retract_every = retract_every
        self.backend = backend
        self.decode_steps = 0
        self.retractions = 0
        self.extra_buffer = extra_buffer
        self._build(backend, max_running, extra_buffer)
        self.checksums: Checksums | None = None
        self.invariants: Invariants | None = None
        if verify:
            kv_layer = _FULL_ATTENTION_LAYERS[0] if hybrid else 0
            self.checksums = Checksums(
                sg.torch,
                self.allocator.get_kvcache().get_key_buffer(kv_layer),
                self.req_to_token_pool,
                hybrid,
            )
            self.invariants = Invariants(
                sg,
                self.tree,
                self.allocator,
                self.req_to_token_pool,
                hybrid=hybrid,
                page_size=page_size,
                kv_slots=kv_slots,
            )
            self.track_grid = sg.mamba_track_grid(page_size)

    # ------------------------------------------------------------------ setup

    def _build(self, backend: str, max_running: int, extra_buffer: bool) -> None:
        sg, torch, ps = self.sg, self.sg.torch, self.page_size
        max_len = max((len(p) + len(o) for p, o, _ in self.jobs), default=1)
        server_args = sg.ServerArgs(
            model_path="dummy",
            page_size=ps,
            attention_backend="torch_native",
            device="cpu",
            max_running_requests=max_running,
            chunked_prefill_size=self.chunk_size,
            disable_overlap_schedule=True,
            mamba_radix_cache_strategy="extra_buffer" if extra_buffer else "no_buffer",
            radix_cache_backend=None if backend in SGLANG_CORES else backend,
        )
        # The Mamba component reads mamba_cache_chunk_size, whose property would load
        # the model's config; SGLang's unit tests set the value for a dummy model.
        server_args._mamba_cache_chunk_size = max(sg.FLA_CHUNK_SIZE, ps)
        sg.set_global_server_args_for_scheduler(server_args)

        rows = max_running + 2
        context = max_len + 2 * ps
        if self.hybrid:
            with sg.envs.SGLANG_MAMBA_SSM_DTYPE.override("float32"):
                shape = sg.Mamba2StateShape.create(**_MAMBA2_SHAPE)
                mamba_layers = [i for i in range(_NUM_LAYERS) if i not in _FULL_ATTENTION_LAYERS]
                params = sg.Mamba2CacheParams(shape=shape, layers=mamba_layers)
            self.req_to_token_pool = sg.HybridReqToTokenPool(
                size=rows,
                mamba_size=self.mamba_slots,
                mamba_spec_state_size=rows,
                max_context_len=context,
                device="cpu",
                enable_memory_saver=False,
                cache_params=params,
                mamba_layer_ids=mamba_layers,
                enable_mamba_extra_buffer=extra_buffer,
                speculative_num_draft_tokens=None,
                enable_overlap_schedule=False,
            )
            kv_pool = sg.HybridLinearKVPool(
                size=self.kv_slots,
                dtype=torch.float32,
                page_size=ps,
                head_num=_KV_HEADS,
                head_dim=_KV_HEAD_DIM,
                full_attention_layer_ids=list(_FULL_ATTENTION_LAYERS),
                device="cpu",
                enable_memory_saver=False,
                mamba_pool=self.req_to_token_pool.mamba_pool,
            )
        else:
            self.req_to_token_pool = sg.ReqToTokenPool(
                size=rows, max_context_len=context, device="cpu", enable_memory_saver=False
            )
            kv_pool = sg.MHATokenToKVPool(
                size=self.kv_slots,
                page_size=ps,
                dtype=torch.float32,
                head_num=_KV_HEADS,
                head_dim=_KV_HEAD_DIM,
                layer_num=len(_FULL_ATTENTION_LAYERS),
                device="cpu",
                enable_memory_saver=False,
            )
        if ps == 1:
            self.allocator = sg.TokenToKVPoolAllocator(
                size=self.kv_slots,
                dtype=torch.float32,
                device="cpu",
                kvcache=kv_pool,
                need_sort=False,
            )
        else:
            self.allocator = sg.PagedTokenToKVPoolAllocator(
                size=self.kv_slots,
                page_size=ps,
                dtype=torch.float32,
                device="cpu",
                kvcache=kv_pool,
                need_sort=False,
            )
        sglang_own = backend in SGLANG_CORES
        params = sg.CacheInitParams(
            disable=False,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.allocator,
            page_size=ps,
            chunked_prefill_size=self.chunk_size,
            enable_mamba_extra_buffer=extra_buffer,
            tree_core_backend=backend if sglang_own else None,
        )
        # As the scheduler's cache builder: the registry picks the factory from the
        # published server arguments (``--radix-cache-backend``), with the plugins loaded
        # first, as ``run_scheduler_process`` loads them; no tensor-parallel worker.
        sg.load_plugins()
        context = sg.TreeCacheBuildContext(
            server_args=server_args,
            params=params,
            is_hybrid_swa=False,
            is_hybrid_ssm=self.hybrid,
            enable_hierarchical_cache=False,
            disable_radix_cache=False,
            tp_worker=None,
            model_config=None,
            tp_size=1,
            tp_rank=0,
            tp_group=None,
        )
        if sglang_own:
            with sg.envs.SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND.override(backend):
                self.tree = sg.create_tree_cache(context)
            core = type(self.tree.tree_core)
        else:
            self.tree = sg.create_tree_cache(context)
            core = type(self.tree)
        self.tree_core = f"{core.__module__}.{core.__qualname__}"
        if backend == "rust" and not self.tree_core.endswith("RustUnifiedTreeCore"):
            raise RuntimeError(f"asked for SGLang's Rust tree core, but {self.tree_core} ran")
        self.result_side = None
        if extra_buffer:
            # The scheduler's result processor, for its Mamba tracking update only:
            # that reads the tree cache, none of the collaborators left out here.
            self.result_side = sg.SchedulerBatchResultProcessor(
                is_generation=True,
                disaggregation_mode=sg.DisaggregationMode.NULL,
                enable_overlap=False,
                enable_overlap_mlx=False,
                model_config=None,
                token_to_kv_pool_allocator=self.allocator,
                tree_cache=self.tree,
                hisparse_coordinator=None,
                req_to_token_pool=self.req_to_token_pool,
                decode_offload_manager=None,
                metrics_collector=None,
                metrics_reporter=None,
                draft_worker=None,
                model_worker=None,
                logprob_result_processor=None,
                output_streamer=None,
                beam_coordinator=None,
                abort_request=None,
            )
        # The one field of the model config the allocation path reads (decode writes
        # the encoder offset for encoder-decoder models), and the Mamba tracking's
        # chunk size (SGLang's default when the config names none).
        self.model_config = SimpleNamespace(
            is_encoder_decoder=False, hf_text_config=SimpleNamespace()
        )
        # The allocator's calls and the page-table writes, apart from the tree's work.
        meter = self.meter
        meter.instrument(self.allocator, _ALLOCATOR_METHODS["kv"], "alloc")
        meter.instrument(self.req_to_token_pool, _ALLOCATOR_METHODS["rows"], "alloc")
        if self.hybrid:
            mamba = self.req_to_token_pool.mamba_allocator
            meter.instrument(mamba, _ALLOCATOR_METHODS["mamba"], "alloc")
        meter.instrument(self.tree, _TREE_METHODS, "tree")
        self.alloc_for_extend = meter.wrap(sg.alloc_for_extend, "alloc")
        self.alloc_for_decode = meter.wrap(sg.alloc_for_decode, "alloc")
        meter.calibrate()

    def _batch(self, reqs: list[Any]) -> Any:
        sg = self.sg
        return sg.ScheduleBatch(
            reqs=reqs,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.allocator,
            tree_cache=self.tree,
            model_config=self.model_config,
            device="cpu",
            spec_algorithm=sg.SpeculativeAlgorithm.NONE,
        )

    # ------------------------------------------------------------------ the loop

    def run(self, progress: Callable[[int], None] | None) -> None:
        while self.waiting or self.running:
            self.step()
            if self.invariants is not None:
                self.invariants.check([live.req for live in self.running])
            if progress is not None:
                progress(self.finished)

    def step(self) -> None:
        admitted = self._admit()
        prefilling = [r for r in self.running if not r.decoding and r not in admitted]
        if prefilling or admitted:
            self._prefill(prefilling + admitted)
        decoding = [r for r in self.running if r.decoding]
        if decoding:
            self._decode(decoding)
        for live in self.running:
            if not live.decoding and live.prefilled == live.prompt_len:
                live.decoding = True

    def _reserved(self) -> int:
        """KV tokens the running requests will still allocate (prompt, then output)."""
        return sum(
            (r.prompt_len - r.prefilled) + (len(r.output) - len(r.req.output_ids))
            for r in self.running
        )

    def _admit(self) -> list[_Live]:
        sg, tree, clock = self.sg, self.tree, self.clock
        admitted: list[_Live] = []
        reserved = self._reserved()
        while self.waiting and len(self.running) < self.limit:
            index = self.waiting[0]
            prompt, output, namespace = self.jobs[index]
            live = self.tried.get(index)
            if live is None:
                sampling = sg.SamplingParams(max_new_tokens=len(output))
                sampling.normalize(None)  # as the tokenizer manager does (no stop strings)
                req = sg.Req(
                    rid=str(index),
                    origin_input_text="",
                    origin_input_ids=array("q", prompt),
                    sampling_params=sampling,
                    extra_key=namespace,
                )
                req.refresh_fill_ids()  # the fill ids a scheduler's request already holds
                live = _Live(req, output, len(prompt))
                if self.checksums is not None:
                    kv, states = prefix_values([*prompt, *output], namespace)
                    live.kv_values = self.sg.torch.tensor(kv, dtype=self.sg.torch.float32)
                    live.state_values = states
            req = live.req
            clock.time("match", [live], req.init_next_round_input, tree)
            probe = clock.time("lock", [live], tree.lock, req.last_node)
            # A retracted request prefills its prompt and its output so far again.
            still = len(output) - len(req.output_ids)
            need = live.prompt_len - req.prefix_len + still + self.page_size
            evictable = tree.full_evictable_size() if self.hybrid else tree.evictable_size()
            room = self.allocator.available_size() + evictable - reserved
            if need >= room:
                clock.time("unlock", [live], tree.unlock, probe)
                if req.kv.holds_mamba:
                    clock.time(
                        "mamba_free",
                        [live],
                        self.req_to_token_pool.mamba_allocator.free,
                        req.kv.mamba_pool_idx.unsqueeze(-1),
                    )
                    req.kv.mamba_pool_idx = None
                req.kv.mamba_cow_src_index = None
                req.kv.mamba_needs_clear = False
                if not self.running:
                    raise RuntimeError(
                        f"request {index} needs {need} KV tokens; the empty pool has {room}"
                    )
                self.tried[index] = live  # its time so far stays charged to it
                break
            req.lock = clock.time("lock", [live], tree.lock, req.last_node)
            clock.time("unlock", [live], tree.unlock, probe)
            reserved += need
            self.waiting.popleft()
            self.tried.pop(index, None)
            self.prompt_tokens += live.prompt_len
            self.device_hit_tokens += req.prefix_len
            if not req.retraction_count:
                self.first_hit_tokens += req.prefix_len
            live.prefilled = req.prefix_len
            self.running.append(live)
            admitted.append(live)
        return admitted

    def _prefill(self, lives: list[_Live]) -> None:
        """One prefill batch: a chunk of each request, allocated in one call, as SGLang does.

        The scheduler's ``ScheduleBatch.prepare_for_extend`` calls ``alloc_for_extend`` once
        for the whole batch; its time is split evenly over the batch's requests.
        """
        sg, torch, ps = self.sg, self.sg.torch, self.page_size
        reqs = [live.req for live in lives]
        for live, req in zip(lives, reqs):
            start, end = req.prefix_len, live.prompt_len
            if end - start > self.chunk_size:  # the adder's cut: a whole number of pages
                end = (start + self.chunk_size // ps * ps) // ps * ps
            req.extend_end = end
        batch = self._batch(reqs)
        batch.prefix_lens = [req.prefix_len for req in reqs]
        batch.extend_lens = [req.extend_end - req.prefix_len for req in reqs]
        batch.seq_lens = torch.tensor([req.extend_end for req in reqs], dtype=torch.int64)
        batch.seq_lens_cpu = batch.seq_lens
        batch.extend_num_tokens = sum(batch.extend_lens)
        self.clock.time("alloc_extend", lives, self.alloc_for_extend, batch)
        tracks = []
        if self.result_side is not None:
            tracks = [batch._mamba_radix_cache_v2_req_prepare_for_extend(req) for req in reqs]
        if self.hybrid:
            self._mamba_state_init(lives, batch)
        if self.checksums is not None:
            self._forward_extend(lives, tracks)
        for live, req in zip(lives, reqs):
            live.prefilled = req.extend_end
            if live.prefilled < live.prompt_len:
                self.clock.time("checkpoint", [live], sg.checkpoint_kv_cache, req, self.tree)
                continue
            req.output_ids.append(live.output[len(req.output_ids)])
            req.update_finish_state()
            if req.finished():
                self._finish(live)
            else:
                self.clock.time("checkpoint", [live], sg.checkpoint_kv_cache, req, self.tree)

    def _forward_extend(self, lives: list[_Live], tracks: list[Any]) -> None:
        """Run the checksum model's prefill forward over the batch.

        It checks what each chunk reads (its prefix's KV, its starting state) and writes
        what it computes (its tokens' KV, the request's state, the tracked state).
        """
        sums = self.checksums
        assert sums is not None
        mapping = None
        if tracks:
            mapping = self.req_to_token_pool.req_index_to_mamba_ping_pong_track_buffer_mapping
        slots, starts, rids, ends, tracked, track_values = [], [], [], [], [], []
        for i, live in enumerate(lives):
            req, start, end = live.req, live.req.prefix_len, live.req.extend_end
            sums.check_kv(req, live.kv_values, start, "prefix read by a prefill chunk")
            sums.write_kv(req, live.kv_values, start, end)
            if not self.hybrid:
                continue
            slots.append(int(req.kv.mamba_pool_idx))
            starts.append(live.state_values[start])
            ends.append(live.state_values[end])
            rids.append(req.rid)
            if mapping is not None and tracks[i].track_mask:
                tracked.append(int(mapping[req.kv.req_pool_idx, tracks[i].track_position]))
                track_values.append(live.state_values[req.kv.mamba_last_track_seqlen])
        if slots:
            sums.check_states(slots, starts, rids, "state a chunk starts from")
            sums.write_states(slots, ends)
            sums.write_states(tracked, track_values)

    def _forward_decode(self, decoding: list[_Live], batch: Any) -> None:
        """Run the checksum model's decode forward (one token per request)."""
        sums = self.checksums
        assert sums is not None
        rows, positions, values = [], [], []
        for live in decoding:
            req = live.req
            pos = len(req.origin_input_ids) + len(req.output_ids) - 1  # the token fed
            rows.append(req.kv.req_pool_idx)
            positions.append(pos)
            values.append(float(live.kv_values[pos]))
        sums.write_kv_at(rows, positions, values)
        if not self.hybrid:
            return
        slots = [int(live.req.kv.mamba_pool_idx) for live in decoding]
        reads = [live.state_values[p] for live, p in zip(decoding, positions)]
        sums.check_states(slots, reads, [live.req.rid for live in decoding], "state a decode reads")
        writes = [live.state_values[p + 1] for live, p in zip(decoding, positions)]
        sums.write_states(slots, writes)
        if self.extra_buffer:
            tracks = batch.mamba_track_indices.tolist()
            due = [
                i
                for i, p in enumerate(positions)
                if (p + 1) % self.track_grid == 0 and tracks[i] >= 0
            ]
            sums.write_states([tracks[i] for i in due], [writes[i] for i in due])

    def _retract(self, decoding: list[_Live]) -> None:
        """Retract the request SGLang's ``retract_decode`` gives up first, as it does."""
        sg = self.sg
        order = sg.ScheduleBatch._get_decode_retraction_order([live.req for live in decoding])
        live = decoding.pop(order[-1])
        req = live.req
        if self.checksums is not None:
            self.checksums.check_kv(req, live.kv_values, req.kv.kv_committed_len, "retraction")
        self.clock.time(
            "retract",
            [live],
            sg.release_req,
            req=req,
            remaing_req_count=len(decoding),
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.allocator,
            tree_cache=self.tree,
            hisparse_coordinator=None,
        )
        self.running.remove(live)
        live.decoding = False
        live.prefilled = 0
        live.prompt_len = len(req.origin_input_ids) + len(req.output_ids)
        self.waiting.appendleft(int(req.rid))
        self.tried[int(req.rid)] = live
        self.retractions += 1

    def _mamba_state_init(self, lives: list[_Live], batch: Any) -> None:
        """Copy the matched states into the requests' slots, or clear fresh slots.

        SGLang's model runner does this for the whole batch before the prefill's forward.
        """
        pool = self.req_to_token_pool
        reqs = [live.req for live in lives]
        if not any(r.kv.mamba_cow_src_index is not None or r.kv.mamba_needs_clear for r in reqs):
            return
        batch._collect_deferred_mamba_cow_and_clear(reqs)
        if batch.mamba_cow_src_indices is not None:
            self.clock.time(
                "mamba_state_copy",
                lives,
                pool.copy_mamba_state,
                pool.translate_mamba_indices(batch.mamba_cow_src_indices),
                pool.translate_mamba_indices(batch.mamba_cow_dst_indices),
            )
        if batch.mamba_clear_indices is not None:
            self.clock.time(
                "mamba_state_clear",
                lives,
                pool.mamba_pool.clear_slots,
                pool.translate_mamba_indices(batch.mamba_clear_indices),
            )

    def _decode(self, decoding: list[_Live]) -> None:
        sg, torch = self.sg, self.sg.torch
        self.decode_steps += 1
        retract = self.retract_every and self.decode_steps % self.retract_every == 0
        if retract and len(decoding) > 1:
            self._retract(decoding)
        reqs = [r.req for r in decoding]
        batch = self._batch(reqs)
        indices = [r.kv.req_pool_idx for r in reqs]
        lens = [r.kv.kv_committed_len for r in reqs]
        batch.req_pool_indices = torch.tensor(indices, dtype=torch.int64)
        batch.req_pool_indices_cpu = batch.req_pool_indices
        batch.seq_lens = torch.tensor(lens, dtype=torch.int64)
        batch.seq_lens_cpu = batch.seq_lens
        self.clock.time("alloc_decode", decoding, self.alloc_for_decode, batch, 1)
        for req in reqs:
            req.decode_batch_idx += 1
        if self.result_side is not None:
            sg.set_mamba_track_indices_from_reqs(batch)
            batch.mamba_decode_batch_idx_cpu = [req.decode_batch_idx for req in reqs]
        if self.checksums is not None:
            self._forward_decode(decoding, batch)
        for i, live in enumerate(decoding):
            req = live.req
            req.output_ids.append(live.output[len(req.output_ids)])
            req.update_finish_state()
            if self.result_side is not None:
                self.result_side._mamba_prefix_cache_update(req, batch, None, i)
            if req.finished():
                self._finish(live)

    def _finish(self, live: _Live) -> None:
        req = live.req
        if len(req.output_ids) != len(live.output) or not isinstance(
            req.finished_reason, self.sg.FINISH_LENGTH
        ):
            raise RuntimeError(
                f"request {req.rid} finished after {len(req.output_ids)} of "
                f"{len(live.output)} tokens ({req.finished_reason})"
            )
        if self.checksums is not None:
            self.checksums.check_kv(req, live.kv_values, req.kv.kv_committed_len, "release")
        release = self.sg.release_kv_cache
        self.clock.time("release", [live], release, req, self.tree, checkpoint=True)
        self.running.remove(live)
        self.per_request_ns.append(live.ns)
        self.per_request_alloc_ns.append(live.alloc_ns)
        self.finished += 1

    # ------------------------------------------------------------------ results

    def result(self) -> dict[str, Any]:
        per = self.per_request_ns
        if self.backend in SGLANG_CORES:
            rust = self.tree_core.endswith("RustUnifiedTreeCore")
            system = "sglang-rust" if rust else "sglang-python"
        else:
            system = self.backend
        out = {
            "system": system,
            "tree_core": self.tree_core,
            "requests": self.finished,
            "prompt_tokens": self.prompt_tokens,
            "device_hit_tokens": self.device_hit_tokens,
            "first_admission_hit_tokens": self.first_hit_tokens,
            "hit_rate": self.device_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "per_request_ns": per,
            "per_request_alloc_ns": self.per_request_alloc_ns,
            "ops": self.clock.ops,
            "alloc_ops": self.clock.alloc_ops,
            "instrumentation": {"wrapped_calls": self.meter.calls, "wrap_ns": self.meter.wrap_ns},
            "retractions": self.retractions,
        }
        if self.checksums is not None and self.invariants is not None:
            self.invariants.check([])  # nothing runs: SGLang's idle checks
            out["verify"] = {**self.checksums.result(), **self.invariants.result()}
        out["leaks"] = self.leaks()
        return out

    def leaks(self) -> dict[str, Any]:
        """Evict everything evictable (nothing runs) and count what did not come back."""
        sg, tree = self.sg, self.tree
        tree.evict(sg.EvictParams(num_tokens=self.kv_slots, mamba_num=self.mamba_slots))
        out: dict[str, Any] = {
            "kv_available": self.allocator.available_size(),
            "kv_total": self.kv_slots,
            "tree_protected": tree.protected_size(),
            "tree_evictable": tree.evictable_size(),
            "req_rows_available": self.req_to_token_pool.available_size(),
            "req_rows_total": self.req_to_token_pool.size,
        }
        clean = (
            out["kv_available"] == out["kv_total"]
            and out["tree_protected"] == 0
            and out["tree_evictable"] == 0
            and out["req_rows_available"] == out["req_rows_total"]
        )
        if self.hybrid:
            out["mamba_available"] = self.req_to_token_pool.mamba_allocator.available_size()
            out["mamba_total"] = self.mamba_slots
            out["mamba_protected"] = tree.mamba_protected_size()
            clean = (
                clean
                and out["mamba_available"] == out["mamba_total"]
                and out["mamba_protected"] == 0
            )
        out["clean"] = clean
        return out
