"""benches/l3_throughput.py runs end to end on a tiny configuration."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from conftest import load_bench_script

bench = load_bench_script("l3_throughput")


def need_redis_tools() -> None:
    missing = [t for t in ("redis-server", "redis-benchmark", "redis-cli") if not shutil.which(t)]
    if missing:
        if os.environ.get("RADIXCACHE_REQUIRE_REDIS") == "1":
            pytest.fail(f"{missing} not on PATH and RADIXCACHE_REQUIRE_REDIS=1")
        pytest.skip(f"{missing} not on PATH")


def test_tiny_run_reports_both_sides(capsys: pytest.CaptureFixture[str]) -> None:
    need_redis_tools()
    assert (
        bench.main(
            ["--sizes", "4096,8192", "--batch", "4", "--mib", "1", "--repeat", "2", "--json"]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["peer"] == ["bench set", "bench get"]
    rows = out["rows"]
    assert [r["size"] for r in rows] == [4096, 8192]
    for r in rows:
        assert r["rows_ok"] is True
        for key in ("ours_put", "ours_get", "peer_put", "peer_get"):
            assert r[key] > 0
        assert r["get_ratio"] == pytest.approx(r["ours_get"] / r["peer_get"])
        assert r["put_ratio"] == pytest.approx(r["ours_put"] / r["peer_put"])


def test_table_has_one_line_per_size() -> None:
    row = bench.Row(
        size=65536,
        batch=64,
        ours_put=1.0,
        ours_get=2.0,
        peer_put=2.0,
        peer_get=2.5,
        put_ratio=0.5,
        get_ratio=0.8,
        rows_ok=True,
    )
    lines = bench.table([row], bench.LEGEND, bench.PEER).splitlines()
    assert len(lines) == 3
    assert lines[1] == (
        "     size batch | ours put bench set ratio | ours get bench get ratio | rows"
    )
    assert " ".join(lines[2].split()) == "65536 64 | 1.00 2.00 0.50 | 2.00 2.50 0.80 | ok"


@pytest.mark.parametrize(
    "args",
    [["--batch", "0"], ["--mib", "0"], ["--sizes", "0"], ["--repeat", "0"], ["--sizes", "1,x"]],
)
def test_bad_arguments(args: list[str]) -> None:
    need_redis_tools()
    with pytest.raises(SystemExit) as e:
        bench.main(args)
    assert e.value.code == 2
