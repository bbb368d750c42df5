"""benches/vs_sglang.py: the radixcache side, the report and its checks, the ratios, the
clear exits when SGLang is missing or an argument is bad, and the meter that splits
SGLang's allocator time out (benches/_sglang_meter.py, on a fake clock).

The SGLang side needs the environment benches/setup-sglang.sh makes (torch 2.13 and the
pinned SGLang wheel): the tests of it run there only. The figures it produces are in
docs/benchmarks.md.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from conftest import load_bench_script

ROOT = Path(__file__).resolve().parent.parent


vs = load_bench_script("vs_sglang")
meter = load_bench_script("_sglang_meter")


def row(system: str, config: str, hit: float, us: float, clean: bool = True) -> dict[str, Any]:
    r: dict[str, Any] = {
        "system": system,
        "config": config,
        "hit_rate": hit,
        "us_per_request": us,
        "mean_us_per_request": 2 * us,
        "ns_per_computed_token": 10 * us / (1 - hit),
        "clean": clean,
    }
    if system.startswith("sglang"):
        r["leaks"] = {
            "kv_available": 64,
            "kv_total": 64,
            "req_rows_available": 3,
            "req_rows_total": 3,
            "tree_protected": 0,
            "clean": clean,
        }
        r["without_allocator"] = {
            "us_per_request": us / 2,
            "mean_us_per_request": us,
            "ns_per_computed_token": 5 * us / (1 - hit),
        }
    else:
        r["leaks"] = {"pools_full_at_end": clean}
    return r


def test_radixcache_side_reports_the_contracts_keys(capsys: pytest.CaptureFixture[str]) -> None:
    status = vs.main(["--systems", "radixcache", "--requests", "40", "--json", "--quiet"])
    report = json.loads(capsys.readouterr().out)
    assert status == 0
    assert report["requests"] == 40
    configs = [(r["config"], r["system"]) for r in report["results"]]
    assert configs == [
        ("attention", "radixcache"),
        ("hybrid", "radixcache"),
        ("hybrid", "radixcache-no-branch-checkpoints"),
    ]
    for r in report["results"]:
        for key in ("ns_per_prompt_token", "us_per_request", "p99_us", "hit_rate"):
            assert r[key] > 0, (r["system"], key)
        computed = r["prompt_tokens"] - round(r["hit_rate"] * r["prompt_tokens"])
        assert r["computed_tokens"] == computed
        assert r["ns_per_computed_token"] == pytest.approx(
            r["ns_per_prompt_token"] * r["prompt_tokens"] / computed
        )
        assert r["clean"] is True
        assert "per_request_us" not in r, "--json leaves the samples out"
    hybrid, plain = report["results"][1], report["results"][2]
    assert hybrid["hit_rate"] > plain["hit_rate"], "branch-point checkpoints add hits"
    assert [m["tokens_as"] for m in report["match_prefix_4k"]] == ["list", "numpy int64"]
    assert all(m["us"] > 0 for m in report["match_prefix_4k"])
    assert all(k["ok"] for k in report["checks"])


def test_the_table_and_the_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "cdf.png"
    args = ["--systems", "radixcache", "--configs", "attention", "--requests", "20"]
    status = vs.main([*args, "--quiet", "--plot", str(png)])
    out = capsys.readouterr().out
    assert status == 0
    assert "mixed: 20 requests" in out
    assert "match_prefix of a cached 4,096-token prefix" in out
    assert png.stat().st_size > 1000


def test_missing_sglang_exits_2_and_names_the_setup(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real(name, *a)
    )
    # Another test module of the session may have set SGLang up already.
    monkeypatch.delitem(sys.modules, "_sglang_shim", raising=False)
    status = vs.main(["--systems", "radixcache,sglang-rust", "--requests", "5", "--quiet"])
    assert status == 2
    err = capsys.readouterr().err
    assert "sglang is not installed" in err
    assert "setup-sglang.sh" in err
    assert "_sglang_shim" not in sys.modules, "nothing of SGLang's was set up"


def test_plot_without_matplotlib_exits_2_saying_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else real(name, *a),
    )
    assert vs.main(["--systems", "radixcache", "--plot", "x.png", "--quiet"]) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--systems", "radixcache,vllm"], "--systems"),
        (["--configs", ""], "--configs"),
        (["--requests", "0"], "--requests"),
        (["--page-size", "-16"], "--page-size"),
    ],
)
def test_bad_arguments_exit_2_naming_them(
    argv: list[str], names: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        vs.main(argv)
    assert e.value.code == 2
    assert names in capsys.readouterr().err


def test_an_unknown_workload_exits_2_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert vs.main(["--workload", "no-such-workload", "--systems", "radixcache"]) == 2
    assert "no-such-workload" in capsys.readouterr().err


def test_ratios_compare_each_sglang_core_with_radixcache_in_the_same_config() -> None:
    results = [
        row("radixcache", "attention", 0.60, 10.0),
        row("sglang-python", "attention", 0.60, 250.0),
        row("sglang-rust", "attention", 0.60, 120.0),
        row("radixcache", "hybrid", 0.55, 20.0),
        row("radixcache-no-branch-checkpoints", "hybrid", 0.30, 18.0),
        row("sglang-rust", "hybrid", 0.40, 300.0),
    ]
    vs.add_ratios(results)
    got = {(r["system"], r["config"]): r.get("ratio_to_radixcache") for r in results}
    assert got == {
        ("radixcache", "attention"): None,
        ("sglang-python", "attention"): 25.0,
        ("sglang-rust", "attention"): 12.0,
        ("radixcache", "hybrid"): None,
        ("radixcache-no-branch-checkpoints", "hybrid"): None,
        ("sglang-rust", "hybrid"): 15.0,
    }
    assert results[2]["ratio_to_radixcache_mean"] == 12.0
    # SGLang's tree alone (its allocator left out) against radixcache's whole time.
    assert results[2]["ratio_to_radixcache_without_allocator"] == 6.0
    assert results[2]["ratio_to_radixcache_without_allocator_mean"] == 6.0
    assert results[2]["ratio_per_computed_token_without_allocator"] == 6.0
    # Per computed token, a lower hit rate costs SGLang more: 0.40 against 0.55.
    hybrid = results[5]["ratio_per_computed_token_without_allocator"]
    assert hybrid == pytest.approx((5 * 300 / 0.6) / (10 * 20 / 0.45))


def test_a_repeated_run_keeps_the_least_total_sglangs_tree_alone() -> None:
    ours = {"system": "radixcache", "cache_seconds": 2.0}
    assert vs.lead_total(ours) == 2.0
    theirs = {"cache_seconds": 9.0, "without_allocator": {"cache_seconds": 3.0}}
    assert vs.lead_total(theirs) == 3.0


def test_checks_fail_on_a_leak_and_on_attention_hit_rates_apart_by_more_than_2_percent() -> None:
    agree = [row("radixcache", "attention", 0.600, 1), row("sglang-rust", "attention", 0.595, 1)]
    assert all(k["ok"] for k in vs.checks(agree))
    apart = [row("radixcache", "attention", 0.600, 1), row("sglang-rust", "attention", 0.580, 1)]
    failed = [k["check"] for k in vs.checks(apart) if not k["ok"]]
    assert failed == ["attention-only hit rates agree within 2%: radixcache vs sglang-rust"]
    # Hybrid hit rates may differ (the doc explains why): no check compares them.
    hybrid = [row("radixcache", "hybrid", 0.60, 1), row("sglang-rust", "hybrid", 0.30, 1)]
    assert all(k["ok"] for k in vs.checks(hybrid))
    leaky = [
        row("radixcache", "attention", 0.6, 1),
        row("sglang-python", "attention", 0.6, 1, False),
    ]
    failed = [k for k in vs.checks(leaky) if not k["ok"]]
    assert [k["check"] for k in failed] == ["no leaked slot: sglang-python (attention)"]
    assert failed[0]["value"] == "KV 64/64, rows 3/3, protected 0"


# ------------------------------------------------------------------ the meter, on a fake clock


class FakeClock:
    """A clock that moves only when told (`tick`), plus `per_read` ns at every reading."""

    def __init__(self, per_read: int = 0) -> None:
        self.now = 0
        self.per_read = per_read

    def __call__(self) -> int:
        self.now += self.per_read
        return self.now

    def tick(self, ns: int) -> None:
        self.now += ns


class Live:
    def __init__(self) -> None:
        self.ns = 0
        self.alloc_ns = 0


class Allocator:
    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock

    def alloc(self, n: int) -> list[int]:
        self.clock.tick(7)
        return list(range(n))

    def free(self, slots: list[int]) -> None:
        self.clock.tick(3)

    def evict_to_free_tokens(self, tree: Any, n: int) -> None:
        tree.evict_for_alloc(n)  # the tree's eviction, through the allocator


class Tree:
    def __init__(self, clock: FakeClock, allocator: Allocator) -> None:
        self.clock = clock
        self.allocator = allocator

    def evict_for_alloc(self, n: int) -> None:
        self.clock.tick(100)  # walking the tree
        self.allocator.free([0] * n)  # giving the evicted slots back

    def release(self) -> None:
        self.clock.tick(50)  # the insert
        self.allocator.free([1])  # duplicates freed


def metered(per_read: int = 0) -> tuple[Any, Any, FakeClock, Allocator, Tree]:
    clock = FakeClock(per_read)
    m = meter.Meter(clock)
    allocator = Allocator(clock)
    tree = Tree(clock, allocator)
    wrapped = m.instrument(allocator, ("alloc", "free", "alloc_extend"), "alloc")
    assert wrapped == ["alloc", "free"], "methods the object lacks are left alone"
    assert m.instrument(tree, ("evict", "evict_for_alloc"), "tree") == ["evict_for_alloc"]
    c = meter.Clock(m, {"alloc_extend": [], "release": [], "copy": []}, ("copy",))
    return m, c, clock, allocator, tree


def test_the_meter_charges_eviction_inside_an_allocation_to_the_tree() -> None:
    m, c, clock, allocator, tree = metered()

    def alloc_for_extend() -> None:  # as SGLang's: glue, eviction, allocation, glue
        clock.tick(10)
        allocator.evict_to_free_tokens(tree, 2)
        allocator.alloc(4)
        clock.tick(5)

    lives = [Live(), Live(), Live()]
    c.time("alloc_extend", lives, m.wrap(alloc_for_extend, "alloc"))
    assert c.ops["alloc_extend"] == [10 + 100 + 3 + 7 + 5]
    assert c.alloc_ops["alloc_extend"] == [10 + 3 + 7 + 5], "the eviction's walk is the tree's"
    # A batch's call is split evenly over its requests, the remainder to the first ones.
    assert [x.ns for x in lives] == [42, 42, 41]
    assert [x.alloc_ns for x in lives] == [9, 8, 8]

    one = Live()
    c.time("release", [one], tree.release)
    assert (one.ns, one.alloc_ns) == (53, 3), "a free inside an insert is the allocator's"


def test_data_movement_is_recorded_but_charged_to_no_request() -> None:
    _, c, clock, _, _ = metered()
    live = Live()
    c.time("copy", [live], clock.tick, 500)
    assert c.ops["copy"] == [500]
    assert (live.ns, live.alloc_ns) == (0, 0)


def test_the_instrumentations_own_cost_is_taken_out() -> None:
    m, c, _, allocator, _ = metered(per_read=1)  # every clock reading costs 1 ns
    m.calibrate(calls=10, rounds=2)
    assert m.wrap_ns == 2, "a wrapped call reads the clock twice more than a plain one"
    assert (m.calls, m.nested, m.alloc_ns) == (0, 0, 0), "calibration leaves no trace"

    def alloc_twice() -> None:
        allocator.alloc(1)
        allocator.alloc(1)

    live = Live()
    c.time("alloc_extend", [live], m.wrap(alloc_twice, "alloc"))
    # Real work 14; the clock's own readings add 1 (as in any timing) and each of the three
    # wrappers 2, taken out; the outer wrapper's reading inside its zone stays allocator's.
    assert c.ops["alloc_extend"] == [15]
    assert c.alloc_ops["alloc_extend"] == [15]
    assert live.ns - live.alloc_ns == 0


def test_the_meter_refuses_an_unknown_zone() -> None:
    with pytest.raises(ValueError, match="kind"):
        meter.Meter().wrap(print, "kv")


# ------------------------------------------------------------------ the SGLang side itself


def test_sglang_allocates_each_prefill_batch_in_one_call() -> None:
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("needs SGLang: benches/setup-sglang.sh")
    with warnings.catch_warnings():  # SGLang's import chain warns about this CPU
        warnings.simplefilter("ignore")
        assert vs.import_sglang() is None
        import _sglang_side

    # Four requests admitted in one step, each prompt one chunk: one prefill batch.
    jobs = [([1 + i] * 40 + list(range(100, 140)), [7, 8, 9], None) for i in range(4)]
    r = _sglang_side.replay_sglang(
        jobs,
        hybrid=False,
        backend="python",
        kv_slots=4096,
        mamba_slots=0,
        page_size=16,
        max_running=8,
        chunk_size=128,
    )
    assert r["requests"] == 4
    assert len(r["ops"]["alloc_extend"]) == 1, "SGLang's scheduler allocates per batch"
    assert len(r["ops"]["alloc_decode"]) == 2
    assert r["leaks"]["clean"]
    # The allocation call is the allocator's (but for the wrappers' own cost, measured and
    # taken out); the match is the tree's alone.
    assert r["alloc_ops"]["alloc_extend"] == pytest.approx(r["ops"]["alloc_extend"], rel=0.01)
    assert r["alloc_ops"]["match"] == [0, 0, 0, 0]
    assert all(0 < a < n for a, n in zip(r["per_request_alloc_ns"], r["per_request_ns"]))
