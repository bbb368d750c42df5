"""radixcache.sglang: the backend SGLang 0.5.23 builds for ``--radix-cache-backend radixcache``.

SGLang's registry builds it by name after loading the plugins (as its scheduler process
does), over SGLang's own pools and allocators on the CPU: attention only (FULL) and
FULL+Mamba, page sizes 1 and 16, Mamba strategies no_buffer and extra_buffer. Requests
are SGLang's ``Req`` objects driven through SGLang's own functions (``init_next_round_input``,
``alloc_for_extend``, ``checkpoint_kv_cache``, ``release_kv_cache``). After every step:
SGLang's pool invariant (allocator available + evictable + protected == size, KV and
Mamba, with what live requests hold) and ``audit()``. Every refusal names its flag.

Needs torch and the pinned SGLang (skipped without them); SGLang's heavy optional
packages are placeholders (benches/_sglang_shim.py).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import warnings
from array import array
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed", allow_module_level=True)

ROOT = Path(__file__).resolve().parent.parent


def _load_shim() -> Any:
    spec = importlib.util.spec_from_file_location(
        "_sglang_shim", ROOT / "benches" / "_sglang_shim.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not in sys.modules: benches/vs_sglang.py loads its own
    return module


with warnings.catch_warnings():  # SGLang's import chain warns about this CPU machine
    warnings.simplefilter("ignore")
    _load_shim().install()  # before SGLang's first import
    pytest.importorskip("sglang.srt.mem_cache.registry")
    from sglang.kernels.ops.attention.fla.chunk_delta_h import (
        CHUNK_SIZE as FLA_CHUNK_SIZE,
    )
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
    from sglang.srt.disaggregation.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVEventBatch,
    )
    from sglang.srt.environ import envs
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req, ScheduleBatch
    from sglang.srt.managers.scheduler_components.pool_stats_observer import (
        kv_mamba_slots,
        kv_private_tokens,
    )
    from sglang.srt.mem_cache.allocation import alloc_for_extend
    from sglang.srt.mem_cache.allocator import (
        PagedTokenToKVPoolAllocator,
        TokenToKVPoolAllocator,
    )
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache
    from sglang.srt.mem_cache.memory_pool import (
        HybridLinearKVPool,
        HybridReqToTokenPool,
        MHATokenToKVPool,
        ReqToTokenPool,
    )
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.registry import (
        TreeCacheBuildContext,
        create_tree_cache,
        default_radix_cache_factory,
        registered_radix_cache_backends,
    )
    from sglang.srt.plugins import load_plugins
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import (
        ServerArgs,
        set_global_server_args_for_scheduler,
    )
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    load_plugins()  # as SGLang's processes do: registers "radixcache"

import radixcache as rc  # noqa: E402
from radixcache.sglang import BACKEND_NAME, register  # noqa: E402
from radixcache.sglang.backend import RadixCacheBackend, create_backend  # noqa: E402

torch.set_num_threads(1)

#: Small shapes, as SGLang's own unit tests build them.
LAYERS = 8
FULL_LAYERS = (3, 7)
KV_SLOTS = 512
MAMBA_SLOTS = 16
ROWS = 8
CHUNK = 64  # SGLang's FLA chunk: where extra_buffer tracks states

CONFIGS = [
    pytest.param((False, 1, "no_buffer"), id="full-page1"),
    pytest.param((False, 16, "no_buffer"), id="full-page16"),
    pytest.param((True, 1, "no_buffer"), id="mamba-page1-no_buffer"),
    pytest.param((True, 1, "extra_buffer"), id="mamba-page1-extra_buffer"),
    pytest.param((True, 16, "extra_buffer"), id="mamba-page16-extra_buffer"),
    # Overlap scheduling (SGLang's default) gives extra_buffer two tracking slots.
    pytest.param((True, 16, "extra_buffer+overlap"), id="mamba-page16-extra_buffer-overlap"),
]


@dataclasses.dataclass
class Env:
    """One backend built by SGLang's registry, with SGLang's pools and allocators."""

    tree: RadixCacheBackend
    hybrid: bool
    page_size: int
    extra_buffer: bool
    rows: Any
    allocator: Any
    params: Any
    ctx: Any
    live: list[Any] = dataclasses.field(default_factory=list)

    def check(self) -> None:
        """SGLang's pool invariant for KV and Mamba (live requests included) and audit()."""
        tree = self.tree
        if not isinstance(tree, RadixCacheBackend):
            return  # SGLang's own cache, for comparison: its checks are its own
        held_kv = sum(
            kv_private_tokens(req.kv, self.page_size) for req in self.live if req.kv.holds_kv
        )
        kv = (
            self.allocator.available_size()
            + tree.full_evictable_size()
            + tree.full_protected_size()
            + held_kv
        )
        assert kv == self.allocator.size, (kv, self.allocator.size, tree.cache.stats())
        if self.hybrid:
            mamba = self.rows.mamba_allocator
            held = sum(kv_mamba_slots(req.kv) for req in self.live)
            total = (
                mamba.available_size()
                + tree.mamba_evictable_size()
                + tree.mamba_protected_size()
                + held
            )
            assert total == mamba.size, (total, mamba.size, tree.cache.stats())
        tree.sanity_check()
        stats = tree.cache.stats()
        assert stats["kv_queued_slots"] == 0
        assert stats["mamba_queued_slots"] == 0

    def drained(self) -> None:
        """Nothing runs: evict everything; every slot is back in SGLang's allocators."""
        assert not self.live
        self.tree.evict(EvictParams(num_tokens=KV_SLOTS, mamba_num=MAMBA_SLOTS))
        assert self.allocator.available_size() == self.allocator.size
        assert self.tree.protected_size() == 0
        if self.hybrid:
            assert self.rows.mamba_allocator.available_size() == MAMBA_SLOTS
        assert self.rows.available_size() == ROWS
        self.check()


def build(
    hybrid: bool, page_size: int, strategy: str, *, kv_slots: int = KV_SLOTS, **server: Any
) -> Env:
    """Build the backend as ``--radix-cache-backend radixcache`` does, through the registry."""
    strategy, _, overlap = strategy.partition("+")
    extra_buffer = hybrid and strategy == "extra_buffer"
    args = ServerArgs(
        model_path="dummy",
        page_size=page_size,
        attention_backend="torch_native",
        device="cpu",
        disable_overlap_schedule=True,
        mamba_radix_cache_strategy=strategy,
        radix_cache_backend=BACKEND_NAME,
        **server,
    )
    args._mamba_cache_chunk_size = max(FLA_CHUNK_SIZE, page_size)
    set_global_server_args_for_scheduler(args)
    if hybrid:
        with envs.SGLANG_MAMBA_SSM_DTYPE.override("bfloat16"):
            shape = Mamba2StateShape.create(
                tp_world_size=1,
                intermediate_size=32,
                n_groups=1,
                num_heads=2,
                head_dim=16,
                state_size=4,
                conv_kernel=4,
            )
            layers = [i for i in range(LAYERS) if i not in FULL_LAYERS]
            cache_params = Mamba2CacheParams(shape=shape, layers=layers)
        rows = HybridReqToTokenPool(
            size=ROWS,
            mamba_size=MAMBA_SLOTS,
            mamba_spec_state_size=ROWS,
            max_context_len=1024,
            device="cpu",
            enable_memory_saver=False,
            cache_params=cache_params,
            mamba_layer_ids=layers,
            enable_mamba_extra_buffer=extra_buffer,
            speculative_num_draft_tokens=None,
            enable_overlap_schedule=bool(overlap),
        )
        kv_pool = HybridLinearKVPool(
            size=kv_slots,
            dtype=torch.bfloat16,
            page_size=page_size,
            head_num=1,
            head_dim=1,
            full_attention_layer_ids=list(FULL_LAYERS),
            device="cpu",
            enable_memory_saver=False,
            mamba_pool=rows.mamba_pool,
        )
    else:
        rows = ReqToTokenPool(
            size=ROWS, max_context_len=1024, device="cpu", enable_memory_saver=False
        )
        kv_pool = MHATokenToKVPool(
            size=kv_slots,
            page_size=page_size,
            dtype=torch.bfloat16,
            head_num=1,
            head_dim=1,
            layer_num=len(FULL_LAYERS),
            device="cpu",
            enable_memory_saver=False,
        )
    if page_size == 1:
        allocator = TokenToKVPoolAllocator(
            size=kv_slots, dtype=torch.bfloat16, device="cpu", kvcache=kv_pool, need_sort=False
        )
    else:
        allocator = PagedTokenToKVPoolAllocator(
            size=kv_slots,
            page_size=page_size,
            dtype=torch.bfloat16,
            device="cpu",
            kvcache=kv_pool,
            need_sort=False,
        )
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=rows,
        token_to_kv_pool_allocator=allocator,
        page_size=page_size,
        enable_mamba_extra_buffer=extra_buffer,
    )
    ctx = TreeCacheBuildContext(
        server_args=args,
        params=params,
        is_hybrid_swa=False,
        is_hybrid_ssm=hybrid,
        enable_hierarchical_cache=False,
        disable_radix_cache=False,
        tp_worker=None,
        model_config=None,
        tp_size=1,
        tp_rank=0,
        tp_group=None,
    )
    tree = create_tree_cache(ctx)
    return Env(tree, hybrid, page_size, extra_buffer, rows, allocator, params, ctx)


# ---------------------------------------------------------------------- driving SGLang's code


def new_req(env: Env, prompt: list[int], max_new: int = 1, **keys: Any) -> Any:
    sampling = SamplingParams(max_new_tokens=max_new)
    sampling.normalize(None)
    req = Req(
        rid=str(id(prompt)),
        origin_input_text="",
        origin_input_ids=array("q", prompt),
        sampling_params=sampling,
        **keys,
    )
    req.refresh_fill_ids()
    return req


def admit(env: Env, req: Any) -> Any:
    """The match and lock SGLang's scheduler and prefill adder make."""
    req.init_next_round_input(env.tree)
    req.lock = env.tree.lock(req.last_node)
    env.live.append(req)
    env.check()
    return req


def _batch(env: Env, reqs: list[Any]) -> Any:
    return ScheduleBatch(
        reqs=reqs,
        req_to_token_pool=env.rows,
        token_to_kv_pool_allocator=env.allocator,
        tree_cache=env.tree,
        model_config=SimpleNamespace(is_encoder_decoder=False, hf_text_config=SimpleNamespace()),
        device="cpu",
        spec_algorithm=SpeculativeAlgorithm.NONE,
    )


def prefill(env: Env, reqs: list[Any], chunk: int | None = None) -> None:
    """One prefill batch: a chunk of each request, then the checkpoint of unfinished ones."""
    ps = env.page_size
    for req in reqs:
        end = len(req.origin_input_ids)
        if chunk is not None and end - req.prefix_len > chunk:
            end = req.prefix_len + chunk // ps * ps
        req.extend_end = end
    batch = _batch(env, reqs)
    batch.prefix_lens = [req.prefix_len for req in reqs]
    batch.extend_lens = [req.extend_end - req.prefix_len for req in reqs]
    batch.seq_lens = torch.tensor([req.extend_end for req in reqs], dtype=torch.int64)
    batch.seq_lens_cpu = batch.seq_lens
    batch.extend_num_tokens = sum(batch.extend_lens)
    alloc_for_extend(batch)
    if env.extra_buffer:
        for req in reqs:
            batch._mamba_radix_cache_v2_req_prepare_for_extend(req)
    if env.hybrid:
        batch._collect_deferred_mamba_cow_and_clear(reqs)
    env.check()
    for req in reqs:
        if req.extend_end == len(req.origin_input_ids):
            req.output_ids.append(7)
            req.update_finish_state()
            if req.finished():
                finish(env, req)
                continue
        checkpoint_kv_cache(req, env.tree)
        env.check()


def finish(env: Env, req: Any) -> None:
    release_kv_cache(req, env.tree, checkpoint=True)
    env.live.remove(req)
    env.check()


def serve(env: Env, prompt: list[int], chunk: int | None = None, **keys: Any) -> int:
    """Serve one request alone (max 1 new token); returns its reused prefix length."""
    req = admit(env, new_req(env, prompt, **keys))
    hit = req.prefix_len
    while req in env.live:
        prefill(env, [req], chunk)
    return hit


def prompt(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 50000 + 1 for i in range(n)]


@pytest.fixture(scope="module", params=CONFIGS)
def env_factory(request: pytest.FixtureRequest) -> Any:
    hybrid, page_size, strategy = request.param
    return lambda **server: build(hybrid, page_size, strategy, **server)


@pytest.fixture
def env(env_factory: Any) -> Env:
    return env_factory()


# ---------------------------------------------------------------------- construction


def test_plugins_register_the_backend_name(monkeypatch: pytest.MonkeyPatch) -> None:
    assert BACKEND_NAME in registered_radix_cache_backends()
    register()  # idempotent: the name is ours already
    assert registered_radix_cache_backends().count(BACKEND_NAME) == 1
    from sglang.srt.mem_cache import registry

    monkeypatch.setitem(registry._RADIX_CACHE_REGISTRY, BACKEND_NAME, lambda ctx: None)
    with pytest.raises(ValueError, match="already registered"):
        register()  # someone else's factory under the name


def test_registry_builds_the_backend_by_name(env: Env) -> None:
    tree = env.tree
    assert isinstance(tree, RadixCacheBackend)
    assert tree.supports_mamba() is env.hybrid
    assert tree.cache.pools == "engine"
    assert tree.page_size == env.page_size
    env.check()


def _refused(env: Env, flag: str, *, ctx: dict[str, Any] | None = None, **params: Any) -> None:
    context = dataclasses.replace(
        env.ctx, params=dataclasses.replace(env.params, **params), **(ctx or {})
    )
    with pytest.raises(ValueError, match=flag):
        create_backend(context)


@pytest.mark.parametrize(
    ("flag", "ctx", "params"),
    [
        ("SWA", {"is_hybrid_swa": True}, {}),
        ("--enable-hierarchical-cache", {"enable_hierarchical_cache": True}, {}),
        ("--disable-radix-cache", {}, {"disable": True}),
        ("--speculative-algorithm EAGLE", {}, {"is_eagle": True}),
        ("--enable-session-radix-cache", {}, {"enable_session_radix_cache": True}),
        ("--radix-eviction-policy lfu", {}, {"eviction_policy": "lfu"}),
    ],
)
def test_unsupported_settings_are_refused_naming_the_flag(
    flag: str, ctx: dict[str, Any], params: dict[str, Any]
) -> None:
    env = build(False, 1, "no_buffer")
    _refused(env, flag, ctx=ctx, **params)


def test_streaming_sessions_are_refused_naming_the_flag() -> None:
    env = build(False, 1, "no_buffer")
    ctx = dataclasses.replace(env.ctx, server_args=SimpleNamespace(enable_streaming_session=True))
    with pytest.raises(ValueError, match="--enable-streaming-session"):
        create_backend(ctx)


def test_kv_sharding_is_refused_naming_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.mem_cache.allocator import page_interleave

    env = build(False, 1, "no_buffer")
    monkeypatch.setattr(page_interleave, "page_interleave_shard_size", lambda allocator: 2)
    with pytest.raises(ValueError, match="--enable-kv-cache-sharding"):
        create_backend(env.ctx)


def test_mamba_refusals_name_their_flags() -> None:
    env = build(True, 1, "extra_buffer")
    _refused(env, "extra_buffer_lazy", enable_mamba_extra_buffer_lazy=True)
    _refused(env, "no_buffer with --page-size 16", enable_mamba_extra_buffer=False, page_size=16)
    env.rows.mamba_ckpt_pool = object()
    _refused(env, "--enable-int8-mamba-checkpoint")
    env.rows.mamba_ckpt_pool = None
    env.rows.mamba_pool.replayssm_write_pos = torch.zeros(1)
    _refused(env, "--enable-linear-replayssm")
    env.rows.mamba_pool.replayssm_write_pos = None
    _refused(
        env,
        "HybridReqToTokenPool",
        req_to_token_pool=ReqToTokenPool(
            size=ROWS, max_context_len=64, device="cpu", enable_memory_saver=False
        ),
    )


# ---------------------------------------------------------------------- requests through SGLang


def test_a_repeated_prompt_hits_and_every_slot_comes_back(env: Env) -> None:
    p = prompt(200)
    assert serve(env, p, chunk=128) == 0
    hit = serve(env, p)
    if not env.hybrid:
        assert hit == (len(p) - 1) // env.page_size * env.page_size
    elif env.extra_buffer:
        assert hit > 0
        assert hit % CHUNK == 0
    else:
        assert hit == 128  # the chunk's checkpoint (its copied state)
    env.drained()


def test_concurrent_requests_with_one_prompt_share_the_tree_slots(env: Env) -> None:
    p = prompt(160, seed=3)
    a = admit(env, new_req(env, p))
    b = admit(env, new_req(env, p))
    prefill(env, [a, b], chunk=128)  # b's pages duplicate a's: b adopts the tree's
    ra = env.rows.req_to_token[a.kv.req_pool_idx, : a.kv.cache_protected_len]
    rb = env.rows.req_to_token[b.kv.req_pool_idx, : b.kv.cache_protected_len]
    n = min(len(ra), len(rb))
    assert n > 0
    assert torch.equal(ra[:n], rb[:n])
    while env.live:
        prefill(env, list(env.live))
    env.drained()


def test_namespaces_come_from_extra_key_and_cache_salt(env: Env) -> None:
    p = prompt(150, seed=5)
    serve(env, p, chunk=64, extra_key="lora-a")
    assert serve(env, p, chunk=64, extra_key="lora-a") > 0
    assert serve(env, p, chunk=64) == 0
    assert serve(env, p, chunk=64, extra_key="lora-a", cache_salt="tenant") == 0
    assert serve(env, p, chunk=64, extra_key="lora-a", cache_salt="tenant") > 0
    env.drained()


def test_eviction_for_allocation_returns_what_it_freed(env: Env) -> None:
    for seed in range(3):
        serve(env, prompt(150, seed=10 + seed))
    before = env.allocator.available_size()
    evictable = env.tree.evictable_size()
    assert evictable > 0
    result = env.tree.evict_for_alloc(EvictParams(num_tokens=1))
    assert result.num_tokens_evicted > 0
    assert env.allocator.available_size() - before == result.num_tokens_evicted
    assert env.tree.evictable_size() == evictable - result.num_tokens_evicted
    env.check()
    env.drained()


def test_a_released_unfinished_request_frees_its_state_slots(env: Env) -> None:
    req = admit(env, new_req(env, prompt(100, seed=20)))
    prefill(env, [req], chunk=64)
    release_kv_cache(req, env.tree, checkpoint=False)  # retraction: nothing cached
    env.live.remove(req)
    env.check()
    assert not req.kv.holds_mamba
    env.drained()


def test_a_double_unlock_fails_loudly_and_the_cache_stays_consistent(env: Env) -> None:
    serve(env, prompt(90, seed=30))
    match = env.tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", prompt(90, seed=30)))))
    lock = env.tree.lock(match.last_device_node)
    env.tree.unlock(lock)
    with pytest.raises(rc.LockError):
        env.tree.unlock(lock)
    env.check()
    env.drained()


def test_reports_and_reset(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    serve(env, prompt(80, seed=40))
    text = env.tree.available_and_evictable_str()
    assert "Available tokens" in text
    assert ("mamba" in text) is env.hybrid
    env.tree.pretty_print()
    assert capsys.readouterr().out
    assert env.tree.take_events() == []
    kv, states = env.tree.total_size()
    assert kv == env.tree.evictable_size()
    assert states == env.tree.mamba_evictable_size()
    # The leak census of SGLang's invariant checker: the tree's slots, each once.
    cached = env.tree.all_values_flatten().tolist()
    assert len(cached) == len(set(cached)) == kv > 0
    assert env.tree.all_mamba_values_flatten().numel() == states
    env.tree.reset()
    assert env.tree.total_size() == (0, 0)
    assert env.tree.all_values_flatten().numel() == 0
    env.allocator.clear()
    env.rows.clear()
    env.check()


def test_a_branch_point_becomes_a_state_for_the_next_request() -> None:
    env = build(True, 16, "extra_buffer")
    shared = prompt(150, seed=50)
    serve(env, shared + prompt(50, seed=51))
    # The next request's match reports where the two prompts part, on the tracking grid.
    probe = env.tree.match_prefix(
        MatchPrefixParams(key=RadixKey(array("q", shared + prompt(50, seed=52))))
    )
    assert probe.device_prefix_len == 0
    assert probe.mamba_branching_seqlen == 128
    assert serve(env, shared + prompt(50, seed=52)) == 0  # it tracks its state there
    assert serve(env, shared + prompt(50, seed=53)) == 128  # a third one reuses it
    env.drained()


@pytest.mark.parametrize("strategy", ["no_buffer", "extra_buffer"])
def test_copy_on_write_without_a_free_state_slot_is_a_miss(strategy: str) -> None:
    env = build(True, 1, strategy)
    p = prompt(100, seed=60)
    serve(env, p)
    query = [*p, 1] if strategy == "no_buffer" else p  # the one state: at 100, or at 64
    assert env.tree.mamba_evictable_size() == 1
    mamba = env.rows.mamba_allocator
    held = mamba.alloc(mamba.available_size())
    req = new_req(env, query)
    req.init_next_round_input(env.tree)  # its only source is the state it would copy
    assert req.prefix_len == 0
    assert not req.kv.holds_mamba
    assert req.kv.mamba_cow_src_index is None
    assert env.tree.mamba_evictable_size() == 1
    mamba.free(held)
    req = admit(env, new_req(env, query))
    assert req.prefix_len > 0
    assert req.kv.mamba_cow_src_index is not None
    while req in env.live:
        prefill(env, [req])
    env.drained()


def test_lock_receipts_through_inc_and_dec_lock_ref(env: Env) -> None:
    p = prompt(96, seed=70)
    serve(env, p, chunk=64)
    match = env.tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", p))))
    assert match.device_prefix_len > 0
    protected = env.tree.protected_size()
    receipt = env.tree.inc_lock_ref(match.last_device_node)
    assert env.tree.protected_size() == protected + match.device_prefix_len
    env.tree.dec_lock_ref(match.last_device_node, receipt.to_dec_params())
    assert env.tree.protected_size() == protected
    with pytest.raises(ValueError, match="params"):
        env.tree.dec_lock_ref(match.last_device_node, receipt.to_dec_params())
    with pytest.raises(ValueError, match="params"):
        env.tree.dec_lock_ref(match.last_device_node)
    env.check()
    env.drained()


def test_prefix_indices_are_the_matched_ones_cut_to_prefix_len(env: Env) -> None:
    p = prompt(96, seed=80)
    serve(env, p, chunk=64)
    req = new_req(env, p)
    req.init_next_round_input(env.tree, cow_mamba=False)
    assert req.prefix_len > 0
    indices = env.tree.prefix_device_indices(req)
    assert len(indices) == req.prefix_len
    assert len(set(indices.tolist())) == req.prefix_len
    req.prefix_len += env.page_size
    with pytest.raises(ValueError, match="prefix_len"):
        env.tree.prefix_device_indices(req)
    env.drained()


def test_joint_reclaim_is_not_supported(env: Env) -> None:
    with pytest.raises(NotImplementedError, match="joint reclaim"):
        env.tree.evict_for_alloc(EvictParams(num_tokens=1), allocation_reclaim_satisfied=bool)


def test_waiting_order_groups_requests_by_matched_node(env: Env) -> None:
    a, b = prompt(64, seed=90), prompt(64, seed=91)
    serve(env, a + prompt(32, seed=92), chunk=64)
    serve(env, b + prompt(32, seed=93), chunk=64)
    tree = env.tree

    def node(tokens: list[int]) -> Any:
        return tree.match_prefix(
            MatchPrefixParams(key=RadixKey(array("q", tokens)))
        ).last_device_node

    handles = [node(b), node(a), node(a), tree.root_node, node(a)]
    assert tree.dfs_weight_order(handles) == [1, 2, 4, 0, 3]
    tree.touch_prefix(RadixKey(array("q", a)))  # recency only: nothing taken
    env.check()
    env.drained()


@pytest.mark.parametrize(
    ("previous", "cached"),
    [(128, 128), (None, 0)],
    ids=["earlier-state-fits", "no-state-fits"],
)
def test_a_finished_request_whose_last_state_overshot_gives_the_earlier_one(
    previous: int | None, cached: int
) -> None:
    env = build(True, 16, "extra_buffer+overlap")
    p = prompt(200, seed=110)
    req = admit(env, new_req(env, p, max_new=4))
    prefill(env, [req])  # caches 192 with its tracked state, keeps running
    assert req.kv.cache_protected_len == 192
    # The latest tracked state ran past what will be cached (as after a stop that lands
    # before the last committed token); the other tracking slot holds `previous`.
    req.kv.mamba_last_track_seqlen = 256
    req.kv.mamba_prev_track_seqlen = previous
    states = env.tree.mamba_evictable_size() + env.tree.mamba_protected_size()
    req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
    finish(env, req)
    assert env.tree.mamba_evictable_size() == states + (1 if cached else 0)
    probe = env.tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", p[:150]))))
    assert probe.device_prefix_len == cached
    env.drained()


# ---------------------------------------------------------------------- KV cache events


def events_env(
    hybrid: bool,
    page_size: int,
    strategy: str,
    *,
    own: bool,
    kv_slots: int = KV_SLOTS,
    **params: Any,
) -> Env:
    """A backend (or SGLang's own cache: `own`) built with ``--kv-events-config``."""
    env = build(hybrid, page_size, strategy, kv_slots=kv_slots)
    env.params = dataclasses.replace(env.params, enable_kv_cache_events=True, **params)
    env.ctx = dataclasses.replace(env.ctx, params=env.params)
    env.tree = default_radix_cache_factory(env.ctx) if own else create_backend(env.ctx)
    return env


def wire(events: list[Any]) -> bytes:
    """The bytes SGLang's publisher sends for `events` (one batch, a fixed timestamp)."""
    import msgspec

    return msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=events))


@pytest.mark.parametrize(
    "config",
    [
        pytest.param((False, 1, "no_buffer"), id="full-page1"),
        pytest.param((False, 16, "no_buffer"), id="full-page16"),
        pytest.param((True, 1, "no_buffer"), id="mamba-page1-no_buffer"),
        pytest.param((True, 16, "extra_buffer"), id="mamba-page16-extra_buffer"),
    ],
)
@pytest.mark.parametrize("dynamo", [False, True], ids=["sglang-format", "dynamo-format"])
def test_kv_events_are_the_bytes_sglangs_own_cache_publishes(
    config: tuple[bool, int, str], dynamo: bool
) -> None:
    hybrid, page_size, strategy = config
    # A hybrid model's eviction is radixcache's own (docs/sglang.md, "Where radixcache
    # differs"): its pool holds every step, so that only the final eviction removes.
    kv_slots = 8 * KV_SLOTS if hybrid else KV_SLOTS
    ours, theirs = (
        events_env(
            hybrid, page_size, strategy, own=own, kv_slots=kv_slots, dynamo_kv_event_format=dynamo
        )
        for own in (False, True)
    )
    # Both announce the empty tree they start with.
    assert ours.tree.take_events() == theirs.tree.take_events() == [AllBlocksCleared()]
    # A LoRA adapter the scheduler named: its requests' extra_key ends with its id.
    lora_id = "0123456789abcdef0123456789abcdef"
    adapter = SimpleNamespace(extra_key="adapter-" + lora_id, lora_id=lora_id)
    for env in (ours, theirs):
        env.params.kv_event_lora_names.register(adapter, "my-adapter")
    shared = prompt(100, seed=60)
    steps: list[tuple[list[int], dict[str, Any]]] = [
        (shared + prompt(40, seed=61), {}),
        (shared + prompt(70, seed=62), {}),  # a branch: the shared node splits
        (shared + prompt(40, seed=61) + prompt(33, seed=63), {}),  # a longer history
        (prompt(90, seed=64), {"extra_key": "lora-a"}),
        (prompt(90, seed=64) + prompt(40, seed=65), {"extra_key": "lora-a"}),
        (prompt(90, seed=64), {"cache_salt": "tenant"}),
        (prompt(90, seed=64) + prompt(20, seed=66), {"extra_key": "lora-a", "cache_salt": "t"}),
        (prompt(60, seed=67), {"extra_key": adapter.extra_key}),
    ]
    announced = 0
    for tokens, keys in steps:
        for env in (ours, theirs):
            serve(env, tokens, chunk=64, **keys)
        mine = ours.tree.take_events()
        assert wire(mine) == wire(theirs.tree.take_events()), keys
        announced += len(mine)
        if mine and keys.get("extra_key") == adapter.extra_key:
            assert {e.lora_name for e in mine if isinstance(e, BlockStored)} == {"my-adapter"}
    assert announced >= len(steps) - 2, "steps that cached pages announced nothing"
    # Evicting everything removes every page stored (the order of the leaves is each
    # cache's LRU order: compared as sets).
    removed = []
    for env in (ours, theirs):
        env.tree.evict(EvictParams(num_tokens=kv_slots, mamba_num=MAMBA_SLOTS))
        events = env.tree.take_events()
        assert all(isinstance(e, BlockRemoved) and e.medium == "GPU" for e in events)
        removed.append(sorted(h for e in events for h in e.block_hashes))
    assert removed[0] == removed[1]
    assert len(removed[0]) == len(set(removed[0])) > 0
    for env in (ours, theirs):
        env.tree.reset()
    assert ours.tree.take_events() == theirs.tree.take_events() == [AllBlocksCleared()]
    ours.check()


def test_kv_events_of_a_hybrid_model_announce_its_kv_pages() -> None:
    env = events_env(True, 16, "extra_buffer", own=False)
    assert env.tree.take_events() == [AllBlocksCleared()]
    tokens = prompt(200, seed=70)
    serve(env, tokens, chunk=64)
    stored = env.tree.take_events()
    pages = [h for e in stored for h in e.block_hashes]
    cached = env.tree.cache.match_prefix(tokens).kv_len // 16
    assert len(pages) == len(set(pages)) == cached > 0
    env.drained()
    removed = [h for e in env.tree.take_events() for h in e.block_hashes]
    assert sorted(removed) == sorted(pages)


def test_a_reset_announces_the_old_trees_last_events_then_all_cleared() -> None:
    env = events_env(False, 1, "no_buffer", own=False)
    env.tree.take_events()
    serve(env, prompt(30, seed=80))
    env.tree.reset()
    events = env.tree.take_events()
    assert [type(e).__name__ for e in events] == ["BlockStored", "AllBlocksCleared"]
    assert env.tree.take_events() == []


def test_without_kv_events_the_tree_queues_none(env: Env) -> None:
    serve(env, prompt(40, seed=90))
    assert env.tree.take_events() == []
    assert not env.tree.cache.events
    env.drained()
