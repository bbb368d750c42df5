"""benches/sglang_backend.py: radixcache's SGLang backend proved inside SGLang's own code.

Each workload runs a few dozen requests through SGLang 0.5.23's scheduler code on the CPU
(benches/_sglang_side.py) with the backend built by SGLang's registry from its name, side
by side with SGLang's ``UnifiedRadixCache`` on its Rust and Python tree cores: the checks
the command makes (no leak, 0 byte mismatches, SGLang's pool invariant after every step,
attention-only hit tokens equal, hybrid hit tokens at least SGLang's) must all pass, with
chunked prefill, retraction and the Mamba copy-on-write exercised. Then the checks
themselves are shown to fail on a cache that serves a prefix from the wrong slots, on a
copy-on-write that did not happen and on a cache that keeps a slot it does not account
for. The figures of bigger runs are in docs/sglang.md.

Needs torch and SGLang 0.5.23 (CI installs them); skipped where they are missing.
"""

from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path
from typing import Any

import pytest

from conftest import load_bench_script

pytest.importorskip("torch")
if importlib.util.find_spec("sglang") is None:  # imported below, behind the shim
    pytest.skip("needs SGLang 0.5.23 (pip install 'radixcache[sglang]')", allow_module_level=True)

ROOT = Path(__file__).resolve().parent.parent
BACKEND_CLASS = "radixcache.sglang.backend.RadixCacheBackend"


proof = load_bench_script("sglang_backend")
with warnings.catch_warnings():  # SGLang's import chain warns about this CPU
    warnings.simplefilter("ignore")
    assert proof.vs_sglang.import_sglang() is None
    import _sglang_side
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool
    from sglang.srt.mem_cache.registry import (
        create_unified_radix_cache,
        get_radix_cache_factory,
        register_radix_cache_backend,
    )
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    status = proof.main([*args, "--json", "--quiet"])
    return status, json.loads(capsys.readouterr().out)


#: Small pools and chunks, so that eviction, chunked prefill and retraction all happen.
SMALL = ("--kv-slots", "16384", "--mamba-slots", "48", "--chunk-size", "256", "--max-running", "8")


def side_by_side(
    capsys: pytest.CaptureFixture[str], workload: str, requests: int, retract_every: int
) -> dict[tuple[str, str], dict[str, Any]]:
    """Run the command on one workload; return its results by (config, system)."""
    args = ["--workloads", workload, "--requests", str(requests), *SMALL]
    status, report = run(capsys, *args, "--retract-every", str(retract_every))
    (w,) = report["workloads"]
    failed = [k for k in w["checks"] if not k["ok"]]
    assert status == 0, failed
    assert not failed
    systems = {(r["config"], r["system"]): r for r in w["results"]}
    names = ("radixcache", "sglang-rust", "sglang-python")
    assert set(systems) == {(c, s) for c in ("attention", "hybrid") for s in names}
    for (config, _), r in systems.items():
        assert r["requests"] == requests
        assert r["ops"]["checkpoint"]["calls"] > 0
        v = r["verify"]
        assert v["kv_mismatches"] == v["state_mismatches"] == v["invariant_breaks"] == 0
        assert v["kv_tokens_checked"] > 0
        assert v["invariant_steps"] > requests
        if config == "hybrid":
            assert v["states_checked"] > 0
        assert r["leaks"]["clean"]
    assert systems[("attention", "radixcache")]["tree_core"] == BACKEND_CLASS, "built by name"
    assert systems[("hybrid", "sglang-rust")]["tree_core"].endswith("RustUnifiedTreeCore")
    assert "ratio" in systems[("hybrid", "sglang-rust")]
    return systems


@pytest.mark.parametrize(("workload", "requests"), [("gsp", 24), ("multiturn", 48), ("mixed", 48)])
def test_radixcache_in_sglangs_path_equals_sglangs_hits_and_passes_every_check(
    capsys: pytest.CaptureFixture[str], workload: str, requests: int
) -> None:
    systems = side_by_side(capsys, workload, requests, retract_every=0)
    for core in ("sglang-rust", "sglang-python"):
        key = "device_hit_tokens"
        assert systems[("attention", "radixcache")][key] == systems[("attention", core)][key]
        assert systems[("hybrid", "radixcache")][key] >= systems[("hybrid", core)][key]


def test_under_retraction_every_check_passes_too(capsys: pytest.CaptureFixture[str]) -> None:
    systems = side_by_side(capsys, "multiturn", 48, retract_every=16)
    for r in systems.values():
        assert r["retractions"] > 0
    for core in ("sglang-rust", "sglang-python"):
        key = "device_hit_tokens"
        mine, theirs = systems[("attention", "radixcache")][key], systems[("attention", core)][key]
        assert abs(mine - theirs) <= 0.01 * theirs
        key = "first_admission_hit_tokens"
        assert systems[("hybrid", "radixcache")][key] >= systems[("hybrid", core)][key]


def test_the_table_and_one_plot_per_workload(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "proof.png"
    args = ["--workloads", "mixed,multiturn", "--requests", "12", "--configs", "attention"]
    status = proof.main([*args, "--systems", "backend,sglang-rust", "--quiet", "--plot", str(png)])
    out = capsys.readouterr().out
    assert status == 0
    assert "mixed: 12 requests" in out
    assert "multiturn: 12 requests" in out
    assert "RustUnifiedTreeCore" in out
    for name in ("proof_mixed.png", "proof_multiturn.png"):
        assert (tmp_path / name).stat().st_size > 1000


def test_an_unregistered_backend_name_exits_2_naming_the_registered_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status = proof.main(["--backend", "no-such-cache", "--requests", "4", "--quiet"])
    err = capsys.readouterr().err
    assert status == 2
    assert "'no-such-cache'" in err
    assert "radixcache" in err, "the registered names are listed"


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--retract-every", "-1"], "--retract-every"),
        (["--workloads", ","], "--workloads"),
        (["--workloads", "no-such-workload"], "no-such-workload"),
    ],
)
def test_bad_arguments_exit_2_naming_them(
    capsys: pytest.CaptureFixture[str], args: list[str], named: str
) -> None:
    assert proof.main([*args, "--quiet"]) == 2
    assert named in capsys.readouterr().err


# ------------------------------------------------------------------ the checks can fail


class WrongSlots(UnifiedRadixCache):  # type: ignore[misc]
    """Serves every matched prefix from the right slots in the wrong order."""

    def prefix_device_indices(self, req: Any) -> Any:
        return super().prefix_device_indices(req).flip(0)


class StolenPage(UnifiedRadixCache):  # type: ignore[misc]
    """Holds a KV page of the allocator's that it accounts for nowhere."""

    def __init__(self, params: Any) -> None:
        super().__init__(params)
        self.stolen = params.token_to_kv_pool_allocator.alloc(params.page_size)


def register(name: str, cls: type) -> str:
    if get_radix_cache_factory(name) is None:
        register_radix_cache_backend(
            name, lambda ctx: create_unified_radix_cache(ctx, cache_class=cls)
        )
    return name


def replay(backend: str, hybrid: bool, jobs: list[Any] | None = None) -> dict[str, Any]:
    prefix = list(range(1, 97))
    jobs = jobs or [([*prefix, 200 + i, 300 + i], [7, 8, 9], None) for i in range(6)]
    return _sglang_side.replay_sglang(
        jobs,
        hybrid=hybrid,
        backend=backend,
        kv_slots=2048,
        mamba_slots=16,
        page_size=16,
        max_running=2,
        chunk_size=64,
        verify=True,
    )


def test_a_prefix_served_from_the_wrong_slots_is_a_byte_mismatch() -> None:
    v = replay(register("proof-wrong-slots", WrongSlots), hybrid=False)["verify"]
    assert v["kv_mismatches"] > 0
    assert "prefix read by a prefill chunk" in v["mismatch_examples"][0]
    assert replay("rust", hybrid=False)["verify"]["kv_mismatches"] == 0


def test_a_copy_on_write_that_did_not_happen_is_a_state_mismatch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(HybridReqToTokenPool, "copy_mamba_state", lambda *a: None)
    v = replay("rust", hybrid=True)["verify"]
    assert v["state_mismatches"] > 0
    assert "state a chunk starts from" in v["mismatch_examples"][0]


def test_a_slot_the_cache_does_not_account_for_breaks_the_invariant_and_leaks() -> None:
    r = replay(register("proof-stolen-page", StolenPage), hybrid=True)
    assert r["verify"]["invariant_breaks"] == r["verify"]["invariant_steps"]
    assert "[full]" in r["verify"]["invariant_examples"][0]
    assert not r["leaks"]["clean"]
    assert r["leaks"]["kv_available"] == r["leaks"]["kv_total"] - 16


def test_a_retracted_request_is_prefilled_again_and_its_bytes_hold() -> None:
    jobs = [([*range(1, 97), 200 + i], list(range(500, 540)), None) for i in range(4)]
    r = _sglang_side.replay_sglang(
        jobs,
        hybrid=True,
        backend="python",
        kv_slots=2048,
        mamba_slots=16,
        page_size=16,
        max_running=4,
        chunk_size=64,
        verify=True,
        retract_every=5,
    )
    assert r["retractions"] > 0
    assert r["requests"] == 4
    v = r["verify"]
    assert v["kv_mismatches"] == v["state_mismatches"] == v["invariant_breaks"] == 0
    assert r["leaks"]["clean"]
    # Prefilled again: its prompt and the output so far count as prompt tokens twice.
    assert r["prompt_tokens"] > sum(len(p) for p, _, _ in jobs)
