"""benches/compare.py: the figures it reads (criterion's files, py_calls' JSON), the table
and its verdict, and its clear failures (a build or run that fails, bad arguments).

The builds and the benches themselves take minutes: docs/benchmarks.md has the command.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import load_bench_script

ROOT = Path(__file__).resolve().parent.parent


compare = load_bench_script("compare")


def write_criterion(home: Path, full_id: str, median_ns: float) -> None:
    """One bench's files as criterion 0.5 writes them (the fields read)."""
    new = home.joinpath(*full_id.split("/"), "new")
    new.mkdir(parents=True)
    (new / "benchmark.json").write_text(json.dumps({"full_id": full_id}))
    estimate = {"point_estimate": median_ns}
    (new / "estimates.json").write_text(json.dumps({"median": estimate, "mean": {}}))


def side(name: str, figures: dict[str, list[float]]) -> object:
    s = compare.Side(name, ROOT, None)
    for op, values in figures.items():
        for v in values:
            s.record(op, v)
    return s


def test_criterion_figures_are_the_median_of_every_bench_under_its_home(tmp_path: Path) -> None:
    write_criterion(tmp_path, "radix/match/512", 640.0)
    write_criterion(tmp_path, "scale/evict/10000", 15_600.0)
    (tmp_path / "radix" / "report").mkdir()  # criterion's other output is ignored
    assert compare.criterion_figures(tmp_path) == {
        "radix/match/512": 640.0,
        "scale/evict/10000": 15_600.0,
    }


def test_py_calls_figures_read_a_real_tiny_report() -> None:
    # The real script's JSON, so that a change of its format fails here and not in a
    # comparison run at the end of a long build.
    out = subprocess.run(
        [sys.executable, str(ROOT / "benches" / "py_calls.py"), "--tiny", "--json"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    report = json.loads(out)
    figures = compare.py_calls_figures(report)
    assert len(figures) == len(report["cells"]) + 1
    cell = next(c for c in report["cells"] if c["op"] == "admit" and c["variant"] == "list")
    assert figures[f"py_calls admit [list] @{cell['length']}"] == cell["median_us"] * 1000.0
    checkpoint = next(c for c in report["cells"] if c["op"] == "checkpoint")
    assert f"py_calls checkpoint @{checkpoint['length']}" in figures
    assert figures["py_calls threads: match_prefix 128 alone"] == (
        report["threads"]["match_prefix_128_us"] * 1000.0
    )


def test_rows_keep_each_sides_fastest_round_and_the_larger_spread() -> None:
    base = side("base", {"a": [100.0, 120.0], "only base": [5.0]})
    head = side("head", {"a": [110.0, 104.0], "only head": [7.0, 7.0]})
    table = compare.rows(base, head)
    assert [r.op for r in table] == ["a", "only base", "only head"]
    a = table[0]
    assert (a.base_ns, a.head_ns) == (100.0, 104.0)
    assert a.ratio == pytest.approx(1.04)
    assert a.spread == pytest.approx(0.2)  # base's 120/100, larger than head's 110/104
    assert table[1].ratio is None
    assert table[1].spread is None  # one round: no spread
    assert table[2].ratio is None


def test_report_passes_at_the_limit_and_fails_above_it(capsys: pytest.CaptureFixture[str]) -> None:
    at_limit = compare.rows(side("base", {"op": [100.0]}), side("head", {"op": [105.0]}))
    assert compare.report(at_limit, 1.05, "header")
    assert "PASS (0 of 1 over 1.05" in capsys.readouterr().out

    over = compare.rows(
        side("base", {"fast": [100.0], "slow": [100.0], "gone": [1.0]}),
        side("head", {"fast": [90.0], "slow": [106.0]}),
    )
    assert not compare.report(over, 1.05, "header")
    out = capsys.readouterr().out
    assert "FAIL (1 of 2 over 1.05; worst slow at 1.060)" in out
    assert "measured on one side only: gone" in out
    slow_line = next(line for line in out.splitlines() if line.startswith("slow "))
    assert slow_line.endswith("SLOWER")


def test_json_has_every_row_with_its_ratio_and_the_verdict() -> None:
    table = compare.rows(
        side("base", {"op": [100.0, 110.0], "gone": [1.0]}),
        side("head", {"op": [106.0, 107.0]}),
    )
    out = json.loads(json.dumps(compare.as_json(table, 1.05)))
    assert out["limit"] == 1.05
    assert out["passed"] is False
    assert out["rows"][0] == {
        "op": "op",
        "base_ns": 100.0,
        "head_ns": 106.0,
        "spread": pytest.approx(0.1),
        "ratio": pytest.approx(1.06),
    }
    assert out["rows"][1]["ratio"] is None
    assert compare.as_json(table, 1.07)["passed"] is True


def test_times_are_printed_with_their_unit() -> None:
    assert compare.fmt_ns(None) == "-"
    assert compare.fmt_ns(640.0) == "640 ns"
    assert compare.fmt_ns(15_600.0) == "15.6 µs"
    assert compare.fmt_ns(147_000.0) == "147 µs"
    assert compare.fmt_ns(2_500_000.0) == "2.5 ms"


def test_a_failing_command_names_itself_and_its_logs(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "step.txt"
    cmd = [sys.executable, "-c", "import sys; print('out'); sys.exit('broken on purpose')"]
    with pytest.raises(compare.Failed, match=r"exited 1; logs .*step\.txt") as info:
        compare.run(cmd, tmp_path, {}, log)
    assert "broken on purpose" in str(info.value)
    assert log.read_text() == "out\n"


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_the_base_is_exported_once_per_commit(tmp_path: Path) -> None:
    base = compare.base_side("HEAD", tmp_path)
    sha = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()
    assert base.src == tmp_path / f"base-{sha[:12]}" / "src"
    assert base.target == tmp_path / f"base-{sha[:12]}" / "target"
    assert (base.src / ".exported").read_text() == sha + "\n"
    assert (base.src / "benches" / "compare.py").exists()
    marker = base.src / "left by the first export"
    marker.write_text("")
    compare.base_side(sha, tmp_path)  # the same commit: reused, not exported again
    assert marker.exists()


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_an_unknown_base_revision_exits_2_before_any_build(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert compare.main(["no-such-revision-anywhere", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "base: 'no-such-revision-anywhere' is not a commit of this repository" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["HEAD", "--rounds", "0"], "--rounds: must be at least 1"),
        (["HEAD", "--no-criterion", "--no-py-calls"], "nothing to measure"),
    ],
)
def test_bad_arguments_exit_2_naming_the_argument(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        compare.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err
