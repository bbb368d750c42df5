"""The command line ends every bad input with one line, never a traceback.

A bad flag, flag combination, output path or workload line is refused before any work
(the run is replaced by a tripwire here): exit status 2 and one line on stderr naming
the flag, or the file and line. An output that cannot be written exits 1 with one line;
a run that rejects a request exits 1; Ctrl-C prints "interrupted" and exits 130.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import radixcache.serving.bench as bench_module
from radixcache import ObjectStore, cli
from radixcache.cli import checks as cli_checks
from radixcache.cli import flags as cli_flags
from radixcache.cli import report as cli_report
from radixcache.serving import harness
from radixcache.serving.workloads import Job

from conftest import RedisServer, _need_redis, assert_child_ok, free_port, run_child

SMALL = ["--requests", "5", "--kv-slots", "8192", "--quiet"]


@pytest.fixture
def no_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any replay, bench or workload write fail the test: refusals come first."""

    def tripwire(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the command ran before refusing its input")

    monkeypatch.setattr(harness, "replay", tripwire)
    monkeypatch.setattr(bench_module, "bench", tripwire)
    monkeypatch.setattr(cli_checks._workloads, "save_jsonl", tripwire)


def one_line(err: str) -> str:
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def refused(capsys: pytest.CaptureFixture[str], argv: list[str], *names: str) -> str:
    """Run `argv`: exit 2, nothing on stdout, one line on stderr holding every name."""
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    line = one_line(err)
    assert line.startswith(f"radixcache {argv[0]}: error: "), line
    for name in names:
        assert name in line, (name, line)
    return line


# ---------------------------------------------------------------- workload file lines

GOOD = '{"prompt": [1, 2, 3], "output_len": 2}'


@pytest.mark.parametrize(
    ("line", "names"),
    [
        pytest.param(
            '{"prompt": [1, 2], "output_len": 2, "namespace": "\\ud800"}',
            ["namespace", "surrogate"],
            id="surrogate-namespace",
        ),
        pytest.param(
            '{"prompt": [1, 2], "output_len": 0}',
            ["output_len", "[1, 65536]", "got 0"],
            id="output_len-0",
        ),
        pytest.param(
            '{"prompt": [1, 2], "output": []}',
            ["output: must hold at least one token id"],
            id="output-empty",
        ),
        pytest.param(
            '{"prompt": [1, 100000000000000000000000], "output_len": 1}',
            ["prompt[1]", "token id"],
            id="token-1e23",
        ),
        pytest.param(
            '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}",
            ["not JSON (nested too deeply)"],
            id="deeply-nested",
        ),
        pytest.param(
            # "not JSON" where Python limits the digits of an int, else not a token id.
            '{"prompt": [' + "9" * 5000 + '], "output_len": 1}',
            [],
            id="5000-digits",
        ),
        pytest.param(
            '{"prompt": [1, 2], "output_len": 1000000000000}',
            ["output_len", "got 1000000000000"],
            id="output_len-1e12",
        ),
        pytest.param(
            '{"prompt": [], "output_len": 2}',
            ["prompt: must hold at least one token id"],
            id="prompt-empty",
        ),
        pytest.param(
            '{"prompt": [1, 2], "output_len": 2, "namspace": "a"}',
            ["unknown field 'namspace'"],
            id="unknown-field",
        ),
        pytest.param(
            '{"prompt": [1, 2], "output_len": 1.0}', ["output_len", "got 1.0"], id="float-len"
        ),
        pytest.param(
            '{"prompt": [1, 2], "output_len": true}', ["output_len", "got True"], id="bool-len"
        ),
        pytest.param(
            '{"prompt": [1, 2], "output": [3], "output_len": 2}',
            ["output_len: 2 differs"],
            id="len-differs",
        ),
        pytest.param(
            '{"prompt": [1, 2], "output_len": 1, "namespace": 7}',
            ["namespace: must be a string"],
            id="namespace-int",
        ),
        pytest.param(
            '{"prompt": [1, 2], "output_len": 1, "priority": "high"}',
            ["priority: must be an integer", "got 'high'"],
            id="priority-str",
        ),
        pytest.param("[1, 2]", ["a job is an object with a 'prompt'"], id="not-an-object"),
        pytest.param(
            # json.loads would keep the last one: the line means one of two jobs.
            '{"prompt": [1, 2], "output_len": 1, "prompt": [3]}',
            ["key 'prompt' appears twice"],
            id="duplicated-key",
        ),
        pytest.param("{nope", ["not JSON"], id="not-json"),
    ],
)
@pytest.mark.parametrize("command", ["replay", "bench"])
def test_a_bad_workload_line_is_named_with_its_file_and_line(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    no_run: None,
    command: str,
    line: str,
    names: list[str],
) -> None:
    path = tmp_path / "w.jsonl"
    path.write_text(f"{GOOD}\n\n{line}\n{GOOD}\n")
    msg = refused(capsys, [command, "--workload", str(path)], f"--workload {path}: line 3: ")
    for name in names:
        assert name in msg, (name, msg)


def test_a_line_that_is_not_utf8_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_run: None
) -> None:
    path = tmp_path / "w.jsonl"
    path.write_bytes(GOOD.encode() + b"\n\xff\xfe\n")
    refused(capsys, ["replay", "--workload", str(path)], "line 2: not UTF-8")


@pytest.mark.parametrize("content", ["", "\n  \n\n"])
def test_an_empty_workload_file_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_run: None, content: str
) -> None:
    path = tmp_path / "w.jsonl"
    path.write_text(content)
    refused(capsys, ["replay", "--workload", str(path)], f"--workload {path}: no jobs")


def test_a_directory_or_a_missing_workload_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_run: None
) -> None:
    refused(capsys, ["replay", "--workload", str(tmp_path)], "is a directory")
    refused(capsys, ["bench", "--workload", "nope"], "--workload 'nope': neither a built-in")


def test_a_request_no_pool_can_hold_names_its_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_run: None
) -> None:
    path = tmp_path / "w.jsonl"
    path.write_text(f"{GOOD}\n" + json.dumps({"prompt": list(range(40)), "output_len": 10}))
    msg = refused(
        capsys, ["replay", "--workload", str(path), "--kv-slots", "32"], "line 2: needs 64 KV"
    )
    assert "more than --kv-slots 32" in msg


@pytest.mark.parametrize("command", ["replay", "bench"])
def test_a_device_pool_too_small_for_any_request_is_refused(
    capsys: pytest.CaptureFixture[str], no_run: None, command: str
) -> None:
    refused(capsys, [command, "--kv-slots", "16"], "request 1: needs", "--kv-slots 16")


# ---------------------------------------------------------------- the L3 store


@pytest.mark.parametrize(
    ("url", "names"),
    [
        # A file store's directory that cannot be made: it exists as a file, or in /proc.
        ("file:///dev/null", ["--l3: open failed: ", "/dev/null: File exists"]),
        ("file:///proc/self/nope", ["--l3: open failed: ", "/proc/self/nope: No such file"]),
        ("localhost:6379", ["--l3: ", "no scheme", "redis://", "file:///", "mooncake://"]),
        ("http://localhost:6379", ["--l3: ", "scheme 'http' is not one of them", "mooncake://"]),
        ("redis://localhost", ["--l3: ", "is not HOST:PORT"]),
    ],
)
def test_an_l3_store_that_cannot_be_opened_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], no_run: None, url: str, names: list[str]
) -> None:
    refused(capsys, ["replay", "--l3", url], *names)


def test_mooncake_without_its_package_is_one_line_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], no_run: None
) -> None:
    # Not installed here (None in sys.modules: the import fails as if it were absent).
    monkeypatch.setitem(sys.modules, "mooncake", None)
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    refused(
        capsys,
        ["replay", "--l3", "mooncake://127.0.0.1:1"],
        "--l3: ",
        "mooncake package is not installed",
        "pip install 'radixcache[mooncake]'",
    )


@pytest.fixture
def password_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server asking for the password ``sesame``."""
    _need_redis("redis-server")
    server = RedisServer(tmp_path, password="sesame")
    yield server
    server.stop()


def test_an_l3_store_that_cannot_be_used_at_the_start_is_one_line_naming_why(
    capsys: pytest.CaptureFixture[str], no_run: None, password_redis: RedisServer
) -> None:
    host = f"127.0.0.1:{password_redis.port}"
    refused(capsys, ["replay", "--l3", f"redis://127.0.0.1:{free_port()}"], "connection refused")
    refused(capsys, ["replay", "--l3", f"redis://{host}"], "authentication failed", "NOAUTH")
    msg = refused(
        capsys, ["replay", "--l3", f"redis://:wrong@{host}"], "authentication failed", ":***@"
    )
    assert "wrong" not in msg  # the password is never printed
    refused(capsys, ["replay", "--l3", f"redis://:sesame@{host}/99"], "bad database")


def test_l3_errors_during_a_replay_are_printed_when_they_happen_and_counted_by_cause(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # The store answers the check, then every call of the run fails (as a store that
    # went away after the start would).
    url = f"file://{tmp_path / 'store'}"
    failing = ObjectStore.faulty(url, seed=0, fail=1.0)
    monkeypatch.setattr(harness, "open_store", lambda u: failing)
    argv = ["replay", "--workload", "multiturn", "--requests", "24", "--l3", url, "--quiet"]
    assert cli.main([*argv, "--json"]) == 0
    out, err = capsys.readouterr()
    r = json.loads(out)
    assert r["l3_errors"] > 0
    assert r["l3_error_causes"] == {"injected failure": r["l3_errors"]}
    assert "injected failure" in r["l3_first_error"]
    assert r["mismatches"] == 0
    lines = err.splitlines()
    assert lines[0].startswith(f"radixcache: L3 store {url}: injected failure (")
    assert any("circuit breaker open after 3 errors in a row" in line for line in lines)
    monkeypatch.setenv("COLUMNS", "400")
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.strip().startswith("L3 errors"))
    assert "breaker open" in row or "breaker half_open" in row
    assert f"{r['l3_errors']} injected failure" in row


# ---------------------------------------------------------------- flags


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--seed", "-1"], ["argument --seed", "got '-1'"]),
        (["--seed", "x"], ["argument --seed"]),
        (["--requests", "0"], ["argument --requests"]),
        (["--requests", "100001"], ["argument --requests", "[1, 100000]"]),
        (["--kv-slots", "1e3"], ["argument --kv-slots"]),
        (["--kv-slots", str(2**24 + 16)], ["argument --kv-slots"]),
        (["--kv-slots", "9" * 5000], ["argument --kv-slots", "..."]),
        (["--kv-slots", "100"], ["--kv-slots: 100 is not a multiple of --page-size 16"]),
        (["--mamba-slots", "-1"], ["argument --mamba-slots"]),
        (["--page-size", "0"], ["argument --page-size"]),
        (["--max-running", "0"], ["argument --max-running"]),
        (["--chunk-size", "0"], ["argument --chunk-size"]),
        (["--schedule-policy", "sjf"], ["argument --schedule-policy", "invalid choice: 'sjf'"]),
        (["--schedule-policy", "lpm", "--schedule-window", "0"], ["argument --schedule-window"]),
        (["--schedule-policy", "lpm", "--max-overtakes", "-1"], ["argument --max-overtakes"]),
        (["--schedule-window", "64"], ["--schedule-window: 64 given with --schedule-policy fcfs"]),
        (["--max-overtakes", "4"], ["--max-overtakes: 4 given with --schedule-policy fcfs"]),
        (["--write-policy", "sometimes"], ["argument --write-policy", "invalid choice"]),
        (
            ["--eviction-policy", "fifo"],
            ["argument --eviction-policy", "invalid choice: 'fifo'", "state-value"],
        ),
        (["--eviction-policy", ""], ["argument --eviction-policy", "invalid choice"]),
        (["--write-through-threshold", "3"], ["--write-through-threshold: 3 given with"]),
        (
            ["--write-policy", "write_back", "--write-through-threshold", "3"],
            ["--write-through-threshold"],
        ),
        (
            ["--write-policy", "write_through_selective", "--write-through-threshold", "0"],
            ["argument --write-through-threshold"],
        ),
        (["--host-kv-slots", "0", "--write-policy", "write_back"], ["--write-policy"]),
        (["--mamba-slots", "0", "--host-mamba-slots", "4"], ["--host-mamba-slots: 4 given"]),
        (["--host-kv-slots", "0", "--host-mamba-slots", "4"], ["--host-mamba-slots", "host"]),
        (["--workload", ""], ["argument --workload", "must not be empty"]),
        (["--bogus"], ["unrecognized arguments: --bogus"]),
        (["--model", "gpt"], ["argument --model", "invalid choice: 'gpt'", "swa-hybrid"]),
        (["--window", "64"], ["--window: 64 given with --model hybrid"]),
        (["--model", "attention", "--swa-slots", "64"], ["--swa-slots: 64 given with --model"]),
        (["--model", "swa", "--window", "0"], ["argument --window"]),
        (["--model", "swa", "--swa-slots", "100"], ["--swa-slots: 100 is not a multiple of"]),
        (["--model", "attention", "--mamba-slots", "8"], ["--mamba-slots: 8 given with --model"]),
        (["--model", "swa", "--mamba-slots", "8"], ["--mamba-slots: 8 given with --model swa"]),
        (["--model", "swa-hybrid", "--mamba-slots", "0"], ["--mamba-slots: 0 with --model swa-"]),
        (["--host-swa-slots", "64"], ["--host-swa-slots: 64 given with no sliding-window"]),
        (
            ["--model", "swa", "--host-kv-slots", "0", "--host-swa-slots", "64"],
            ["--host-swa-slots: 64 given with --host-kv-slots 0"],
        ),
        (
            ["--model", "swa", "--host-kv-slots", "1024", "--host-swa-slots", "2048"],
            ["--host-swa-slots"],
        ),
    ],
)
@pytest.mark.parametrize("command", ["replay", "bench"])
def test_a_bad_flag_is_named(
    capsys: pytest.CaptureFixture[str],
    no_run: None,
    command: str,
    argv: list[str],
    names: list[str],
) -> None:
    refused(capsys, [command, *argv], *names)


@pytest.mark.parametrize("rate", ["2", "-0.1", "nan", "x"])
def test_a_bad_failure_rate_is_named(
    capsys: pytest.CaptureFixture[str], no_run: None, rate: str
) -> None:
    refused(capsys, ["replay", "--inject-failures", rate], "argument --inject-failures")


def test_no_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "required: COMMAND" in one_line(capsys.readouterr().err)


def test_version_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("radixcache ")


# ---------------------------------------------------------------- output paths


@pytest.mark.parametrize(
    ("name", "names"),
    [
        ("missing/r.png", ["no directory"]),
        ("r.nope", ["'.nope' is not an image format", "png"]),
        ("r", ["no extension names an image format"]),
        ("r.pgf", ["'.pgf' is not an image format"]),
        (".", ["no extension"]),
        ("adir.png", ["is a directory"]),
    ],
)
def test_a_plot_that_cannot_be_written_is_refused_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_run: None, name: str, names: list[str]
) -> None:
    pytest.importorskip("matplotlib")
    (tmp_path / "adir.png").mkdir()
    refused(capsys, ["replay", "--plot", str(tmp_path / name)], "--plot", *names)


def test_plot_without_matplotlib_says_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], no_run: None
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    refused(capsys, ["replay", "--plot", "x.png"], "pip install 'radixcache[plot]'")


@pytest.mark.parametrize(
    ("name", "names"),
    [("missing/w.jsonl", ["no directory"]), (".", ["is a directory"])],
)
def test_a_workload_out_that_cannot_be_written_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_run: None, name: str, names: list[str]
) -> None:
    refused(capsys, ["workload", "gsp", "--out", str(tmp_path / name)], "--out", *names)


def test_an_output_in_a_directory_that_cannot_be_written_is_refused(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    no_run: None,
) -> None:
    # As root every directory is writable: stand in for one that is not.
    monkeypatch.setattr(cli_checks.os, "access", lambda path, mode: False)
    out = str(tmp_path / "w.jsonl")
    refused(capsys, ["workload", "gsp", "--out", out], f"--out {out}: not writable")


def test_a_workload_file_that_cannot_be_read_is_named(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    no_run: None,
) -> None:
    path = tmp_path / "w.jsonl"
    path.write_text(GOOD)

    def unreadable(*args: Any) -> Any:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(cli_checks._workloads, "load_jsonl", unreadable)
    refused(
        capsys,
        ["replay", "--workload", str(path)],
        f"--workload {path}: cannot read it (Permission denied)",
    )


@pytest.mark.parametrize("error", [KeyboardInterrupt, OSError(28, "No space left on device")])
def test_an_interrupted_or_failed_workload_out_leaves_the_old_file_and_no_other(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    error: BaseException,
) -> None:
    """`workload --out F` renames a whole file into place: F is never a part that bench
    would take as a shorter workload."""
    out = tmp_path / "w.jsonl"
    out.write_text(GOOD + "\n")
    written = []
    to_json = Job.to_json

    def cut_short(job: Job) -> str:
        if len(written) == 3:  # some lines are out: the cut is mid-file
            raise error
        written.append(job)
        return to_json(job)

    monkeypatch.setattr(Job, "to_json", cut_short)
    status = cli.main(["workload", "gsp", "--requests", "8", "--out", str(out)])
    err = capsys.readouterr().err
    if error is KeyboardInterrupt:
        assert (status, err) == (130, "interrupted\n")
    else:
        assert status == 1
        assert one_line(err).endswith("cannot write it (No space left on device)")
    assert out.read_text() == GOOD + "\n"
    assert [p.name for p in tmp_path.iterdir()] == ["w.jsonl"]  # no temporary file left


def test_a_workload_out_replaces_a_links_target_and_keeps_its_permissions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "data").mkdir()
    target = tmp_path / "data" / "w.jsonl"
    target.write_text("old\n")
    target.chmod(0o640)
    link = tmp_path / "w.jsonl"
    link.symlink_to(target)
    assert cli.main(["workload", "gsp", "--requests", "2", "--out", str(link)]) == 0
    capsys.readouterr()
    assert link.is_symlink()
    assert len(target.read_text().splitlines()) == 2
    assert target.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["w.jsonl"]


def test_workload_needs_out(capsys: pytest.CaptureFixture[str], no_run: None) -> None:
    refused(capsys, ["workload", "gsp"], "required: --out")


def test_workload_flags_are_checked(capsys: pytest.CaptureFixture[str], no_run: None) -> None:
    refused(capsys, ["workload", "gsp", "--out", "w", "--seed", "-1"], "argument --seed")
    refused(capsys, ["workload", "nope", "--out", "w"], "argument name", "invalid choice")


full = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")


@full
def test_a_workload_out_on_a_full_disk_exits_1_with_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["workload", "gsp", "--requests", "3", "--out", "/dev/full"]) == 1
    line = one_line(capsys.readouterr().err)
    assert line == "radixcache workload: error: --out /dev/full: cannot write it " + (
        "(No space left on device)"
    )


@full
def test_a_plot_on_a_full_disk_exits_1_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "r.png"
    png.symlink_to("/dev/full")
    assert cli.main(["replay", *SMALL, "--json", "--plot", str(png)]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out)["mismatches"] == 0  # the report came first
    assert one_line(err).startswith(f"radixcache replay: error: --plot {png}: cannot write it")


@full
@pytest.mark.parametrize(
    "argv", [["replay", "--json"], ["replay"], ["bench"]], ids=["json", "table", "bench"]
)
def test_a_report_to_a_full_disk_exits_1_with_one_line(argv: list[str]) -> None:
    with open("/dev/full", "w") as stdout:
        child = subprocess.run(
            [sys.executable, "-m", "radixcache.cli", *argv, *SMALL],
            stdout=stdout,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
            check=False,
        )
    assert child.returncode == 1
    assert one_line(child.stderr) == (
        f"radixcache {argv[0]}: error: cannot write to stdout (No space left on device)"
    )


# ---------------------------------------------------------------- the run


def test_without_the_attention_only_replay_its_figures_are_null(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["replay", *SMALL, "--no-attention-only"]
    assert cli.main([*argv, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["attention_only_hit_rate"] is None
    assert r["hit_rate_ratio"] is None
    assert cli.main(argv) == 0
    row = next(x for x in capsys.readouterr().out.splitlines() if "attention-only" in x)
    assert row.split()[4:] == ["n/a", "not", "run"]


@pytest.mark.parametrize("policy", ["lru", "lfu", "priority", "state-value"])
def test_each_eviction_policy_runs_and_is_reported(
    capsys: pytest.CaptureFixture[str], policy: str
) -> None:
    argv = ["replay", *SMALL, "--mamba-slots", "8", "--eviction-policy", policy]
    assert cli.main([*argv, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    kv = "lru" if policy == "state-value" else policy
    assert r["eviction_policy"] == {"kv": kv, "mamba": policy}
    assert 0.0 <= r["compute_saved_ratio"] <= 1.0
    assert cli.main(["bench", *SMALL, "--eviction-policy", policy, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["eviction_policy"] == r["eviction_policy"]


@pytest.mark.parametrize(
    ("policy", "model", "value", "note"),
    [
        ({"kv": "lru", "mamba": "lru"}, "hybrid", "lru", ""),
        ({"kv": "lru", "mamba": "state-value"}, "hybrid", "state-value", "states; KV lru"),
        (
            {"kv": "lru", "mamba": "state-value", "swa": "lru"},
            "swa-hybrid",
            "state-value",
            "states; KV lru, SWA lru",
        ),
        ({"kv": "lfu", "mamba": "lfu", "swa": "lfu"}, "swa-hybrid", "lfu", ""),
        (
            {"kv": "lfu", "mamba": "lfu", "swa": "priority"},
            "swa-hybrid",
            "lfu",
            "states; SWA priority",
        ),
        # No states: the states' policy (the replay's default) is not shown.
        ({"kv": "lru", "mamba": "state-value", "swa": "lru"}, "swa", "lru", ""),
        ({"kv": "lru", "mamba": "state-value", "swa": "lfu"}, "swa", "lru", "KV; SWA lfu"),
        ({"kv": "lru", "mamba": "state-value"}, "attention", "lru", ""),
    ],
)
def test_the_report_names_each_components_policy_where_it_differs(
    policy: dict[str, str], model: str, value: str, note: str
) -> None:
    assert cli_report._policy_text(policy, model) == (value, note)


def test_the_schedule_policy_runs_and_is_reported(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--workload", "gsp", "--requests", "24", "--kv-slots", "16384", "--quiet"]
    argv += ["--mamba-slots", "8", "--schedule-policy", "lpm", "--schedule-window", "16"]
    argv += ["--max-overtakes", "3"]
    assert cli.main(["replay", *argv, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["schedule_policy"], r["schedule_window"], r["max_overtakes"]) == ("lpm", 16, 3)
    assert r["overtaken"]["max"] <= 3
    assert r["mismatches"] == 0
    assert cli.main(["replay", *argv]) == 0
    text = capsys.readouterr().out
    for row in ("schedule policy", "window 16", "queue wait", "overtaken"):
        assert row in text, row
    assert cli.main(["bench", *argv, "--json"]) == 0
    b = json.loads(capsys.readouterr().out)
    assert b["schedule_policy"] == "lpm"
    assert b["ops"]["peek_prefix"]["calls"] > 0  # the ranking's cache calls are timed


@pytest.mark.slow
def test_lookahead_runs_is_reported_and_its_calls_are_timed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # one line per row: the notes are searched
    argv = ["--workload", "gsp", "--requests", "48", "--kv-slots", "16384", "--quiet"]
    argv += ["--mamba-slots", "8", "--lookahead", "16"]
    assert cli.main(["replay", *argv, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["lookahead"], r["mismatches"], r["audit"]) == (16, 0, "pass")
    assert r["queue_cuts"] > 0  # gsp's questions leave their group's prompt
    assert cli.main(["replay", *argv]) == 0
    text = capsys.readouterr().out
    assert "lookahead 16" in text
    assert re.search(rf"queue cuts +{r['queue_cuts']} ", text)
    # The prompt tokens the model computed, beside the prompt tokens.
    assert 0 < r["prefill_tokens"] < r["prompt_tokens"]
    assert re.search(rf"prompt tokens +{r['prompt_tokens']} +{r['prefill_tokens']} computed", text)
    assert cli.main(["bench", *argv, "--json"]) == 0
    b = json.loads(capsys.readouterr().out)
    assert b["ops"]["expect"]["calls"] > 0
    assert cli.main(["replay", *argv[:-1], "-1"]) == 2
    assert "--lookahead" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("model", ["swa", "swa-hybrid"])
def test_an_swa_model_runs_and_reports_its_hit_rate_against_full_attention(
    capsys: pytest.CaptureFixture[str], model: str
) -> None:
    argv = ["replay", "--workload", "gsp", "--requests", "24", "--kv-slots", "16384", "--quiet"]
    argv += ["--model", model, "--window", "512", "--swa-slots", "4096", "--mamba-slots"]
    argv += ["16" if model == "swa-hybrid" else "0"]
    assert cli.main([*argv, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["model"], r["swa_window"], r["mismatches"]) == (model, 512, 0)
    # The replay's default: state-value for states, KV and SWA on lru.
    assert r["eviction_policy"] == {"kv": "lru", "mamba": "state-value", "swa": "lru"}
    assert r["swa_vs_full_hit_ratio"] == pytest.approx(
        r["device_hit_rate"] / r["full_attention_hit_rate"]
    )
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    rows = ("window 512 tokens", "full-attention device hit rate", f"{model}/full", "SWA pages")
    for row in rows:
        assert row in text, row
    policy = next(x for x in text.splitlines() if "eviction policy" in x)
    # A model without states shows no states' policy.
    assert ("states" in policy) == (model == "swa-hybrid"), policy
    assert cli.main(["bench", *argv[1:], "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == model


@pytest.mark.parametrize("command", ["replay", "bench"])
def test_an_swa_pool_smaller_than_the_window_is_refused_with_the_smallest_that_works(
    capsys: pytest.CaptureFixture[str], no_run: None, command: str
) -> None:
    # It used to start, reject every request and exit 1.
    argv = [command, "--model", "swa", "--swa-slots", "512", "--requests", "5"]
    line = refused(capsys, argv, "--swa-slots 512", "--window 1024", "--chunk-size 2048")
    assert "request 1 needs at least 2048 SWA slots" in line
    assert "the smallest pool for every request is --swa-slots 2048" in line
    # The default pool (a quarter of --kv-slots) is named as the default.
    argv = [command, "--model", "swa", "--kv-slots", "4096", "--requests", "5"]
    refused(capsys, argv, "--swa-slots 1024 (the default, 1/4 of --kv-slots)")


def test_the_smallest_swa_pool_named_serves_the_workload_and_a_page_less_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["replay", "--model", "swa", "--requests", "5", "--quiet", "--no-attention-only"]
    assert cli.main([*argv, "--swa-slots", "2032"]) == 2
    assert "--swa-slots 2048" in one_line(capsys.readouterr().err)
    assert cli.main([*argv, "--swa-slots", "2048", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["rejected"], r["mismatches"]) == (0, 0)


@pytest.mark.parametrize(
    ("window", "chunk", "prompt", "output", "need"),
    [
        (1024, 2048, 3000, 16, 2048),  # the first chunk, whole
        (1024, 2048, 5000, 16, 3072),  # a chunk after the window: window + chunk
        (1024, 512, 2000, 16, 1536),
        (1024, 2048, 2000, 2000, 2064),  # decode: the prompt's window stays locked
        (40, 2048, 2000, 500, 2048),  # pages of 64, larger than the window
    ],
)
def test_swa_needed_is_what_one_request_alone_needs(
    window: int, chunk: int, prompt: int, output: int, need: int
) -> None:
    """The bound against the scheduler itself: `need` serves the request, a page less not."""
    page = 64 if window < 64 else 16
    assert cli.swa_needed(prompt, prompt + output - 1, window, chunk, page) == need
    rng = np.random.default_rng(0)
    job = Job(rng.integers(0, 1000, prompt, dtype=np.uint32), np.ones(output, dtype=np.uint32))
    for swa_slots, rejected in ((need, 0), (need - page, 1)):
        config = harness.ReplayConfig(
            kv_slots=8192,
            mamba_slots=0,
            host_kv_slots=0,
            host_mamba_slots=0,
            page_size=page,
            swa_slots=swa_slots,
            swa_window=window,
            host_swa_slots=0,
            chunk_size=chunk,
            oracle=False,
            attention_only=False,
        )
        assert harness.replay([job], config)[0]["rejected"] == rejected, swa_slots


def test_the_swa_defaults_scale_with_the_kv_pools() -> None:
    args = cli._parser().parse_args(["replay", "--model", "swa", "--kv-slots", "1600"])
    config = cli_checks._config(args)
    assert (config.swa_window, config.swa_slots) == (cli.DEFAULT_WINDOW, 400)
    assert config.host_swa_slots == 400 * cli_flags._D.host_kv_slots // 1600
    assert config.mamba_slots == 0
    plain = cli_checks._config(cli._parser().parse_args(["replay"]))
    assert (plain.swa_slots, plain.swa_window, plain.host_swa_slots) == (0, 0, 0)
    assert plain.mamba_slots == cli_flags._D.mamba_slots


def test_the_report_names_the_states_policy_and_kvs_where_they_differ() -> None:
    assert cli_report._policy_text({"kv": "lfu", "mamba": "lfu"}, "hybrid") == ("lfu", "")
    assert cli_report._policy_text({"kv": "lru", "mamba": "state-value"}, "hybrid") == (
        "state-value",
        "states; KV lru",
    )


@pytest.mark.slow
def test_the_offline_bound_is_reported_when_asked(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["replay", "--workload", "gsp", "--requests", "48", "--kv-slots", "65536", "--quiet"]
    assert cli.main([*argv, "--mamba-slots", "16", "--offline-bound", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["offline_possible_hit_rate"] >= r["offline_bound_hit_rate"] >= r["device_hit_rate"]
    assert r["offline_bound_ratio"] == pytest.approx(
        r["offline_bound_hit_rate"] / r["attention_only_hit_rate"]
    )
    assert cli.main([*argv, "--mamba-slots", "16", "--offline-bound"]) == 0
    text = capsys.readouterr().out
    for row in ("eviction policy", "compute saved", "offline bound", "LRU model"):
        assert row in text, row
    assert cli.main([*argv, "--json"]) == 0  # not asked: null
    assert json.loads(capsys.readouterr().out)["offline_bound_hit_rate"] is None


def test_a_threshold_runs_under_the_selective_policy(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["replay", *SMALL, "--write-policy", "write_through_selective"]
    assert cli.main([*argv, "--write-through-threshold", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["mismatches"] == 0


@pytest.mark.parametrize("command", ["replay", "bench"])
def test_a_request_rejected_during_the_run_fails_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """The safety net behind the check that every request fits: a rejection exits 1."""
    monkeypatch.setattr(cli_checks, "_check_fits", lambda *args: None)
    argv = [command, "--requests", "3", "--kv-slots", "2048", "--quiet", "--json"]
    assert cli.main(argv) == 1
    out, err = capsys.readouterr()
    assert json.loads(out)["rejected"] > 0
    assert re.fullmatch(rf"radixcache {command}: failed: .*\d+ requests rejected .*", one_line(err))


def test_the_progress_bar_shows_an_eta() -> None:
    from rich.console import Console
    from rich.progress import TimeRemainingColumn

    bar = cli_report._progress(Console(stderr=True), quiet=False)
    assert any(isinstance(c, TimeRemainingColumn) for c in bar.columns)


@pytest.mark.parametrize("command", ["replay", "bench", "workload"])
def test_help_gives_every_flags_default_and_meaning(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # one line per option
    assert cli.main([command, "--help"]) == 0
    text = capsys.readouterr().out
    usage = text.split("\n\n")[0]
    given = set(re.findall(r"--[a-z0-9-]+", usage))
    assert given == {f.name for f in cli.FLAGS[command]}, "every flag is in the table"
    if command != "workload":  # the epilog: where the report's terms are explained
        text, epilog = text.rstrip("\n").rsplit("\n\n", 1)
        assert "radixcache glossary" in epilog
    # One entry per option (its help may start on the next line), whitespace joined.
    entries = [" ".join(e.split()) for e in re.split(r"\n  (?=-)", text)]
    for f in cli.FLAGS[command]:
        entry = next(e for e in entries if e.startswith(f.name + " "))
        assert re.fullmatch(r"--\S+( \S+)? \w{3,}.*\((default: .+|required)\)", entry), entry
    assert "(default: 262144)" in text or command == "workload"


def test_help_says_what_each_value_is_and_lists_the_l3_urls(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", "400")
    assert cli.main(["replay", "--help"]) == 0
    text = capsys.readouterr().out
    for shown in ("--l3 URL", "--shard K/N", "--plot FILE", "--workload NAME|FILE"):
        assert shown in text, shown
    assert "--kv-slots TOKENS" in text
    assert "PATH" not in text  # what every string flag was, a URL and K/N included
    flat = " ".join(text.split())
    for url in cli.L3_URLS:
        assert url in flat, url
    # The forms the store's URL parser lists, the Mooncake one with its parameters.
    from radixcache.l3 import _FORMS

    assert [u.split("[?")[0] for u in cli.L3_URLS] == [u.split("[?")[0] for u in _FORMS]
    assert "radixcache glossary" in flat
    assert cli.main(["workload", "--help"]) == 0
    assert "--out FILE" in capsys.readouterr().out
    assert cli.main(["--help"]) == 0
    assert "radixcache glossary" in " ".join(capsys.readouterr().out.split())


def test_the_glossary_command_prints_docs_glossary_md(capsys: pytest.CaptureFixture[str]) -> None:
    """One text for the wheel and the repository."""
    assert cli.main(["glossary"]) == 0
    doc = Path(__file__).parents[1] / "docs" / "glossary.md"
    assert capsys.readouterr().out == doc.read_text(), (
        "docs/glossary.md is stale: python -m radixcache.glossary > docs/glossary.md"
    )


def labels(table: Any) -> list[str]:
    """The first column of a rich table: the rows' names."""
    return [str(cell) for cell in table.columns[0]._cells]


def test_every_row_of_every_report_is_in_the_glossary(capsys: pytest.CaptureFixture[str]) -> None:
    from radixcache.glossary import terms

    known = terms()
    assert cli.main(["replay", *SMALL, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    # Every optional row on: L3, restored hits, the offline bound, SWA, injected failures.
    r |= {key: 0 for key, value in r.items() if key.startswith("l3_") and value is None}
    r |= {"l3_breaker": "closed", "l3_prefetches": 1, "restored_hit_tokens": 1}
    r |= {"l3_error_causes": {"timeout": 1}, "l3_first_error": "get timed out"}
    r |= {"offline_bound_hit_rate": 0.5, "offline_bound_ratio": 1.0, "lookahead": 4}
    r |= {"offline_lru_hit_rate": 0.4, "swa_window": 512, "full_attention_hit_rate": 0.5}
    r["injected_failures"] = dict.fromkeys(r["injected_failures"], 1)
    rows = labels(cli_report._report_table(r))
    assert len(rows) == 34, " | ".join(rows)
    assert cli.main(["replay", *SMALL, "--servers", "2", "--json"]) == 0
    fleet = json.loads(capsys.readouterr().out)
    fleet |= {"workload": "mixed", "l3_breaker": ["closed"], "l3_prefetches": 1}
    fleet |= dict.fromkeys(["l3_bytes_fetched", "l3_bytes_stored", "l3_fetch_gbps"], 0)
    fleet |= dict.fromkeys(["l3_prefetch_timeouts", "l3_prefetch_wait_steps"], 0)
    fleet |= dict.fromkeys(["l3_corrupt_objects", "l3_foreign_objects", "l3_errors"], 0)
    fleet |= {"l3_error_causes": {}}
    for one in fleet["per_server"]:
        one |= {"l3_breaker": "closed", "l3_errors": 0}
    rows += labels(cli_report._fleet_table(fleet))
    assert cli.main(["bench", *SMALL, "--json"]) == 0
    b = json.loads(capsys.readouterr().out)
    rows += [*labels(cli_report._bench_table(b)), "operation"]
    assert set(rows) <= set(known), set(rows) - set(known)
    # The terms the reports' notes use, and the figures they compare.
    for term in ("retractions", "computed", "overtaken", "checkpoints", "hit rate, all tiers"):
        assert term in known


def test_the_report_says_which_tier_each_hit_rate_counts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # one line per row
    assert cli.main(["replay", *SMALL, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    text = cli_report._render(cli_report._report_table(r | {"workload": "mixed"}))
    rows = {line.split("  ")[0].strip(): line for line in text.splitlines()[1:]}
    assert "on the device" in rows["device hit tokens"]
    assert "loaded back from the host" in rows["host hit tokens"]
    assert f"{100 * r['hit_rate']:.1f}%  device + host" in rows["hit rate, all tiers"]
    assert "hybrid/attention" in rows["attention-only device hit rate"]


def drawn(monkeypatch: pytest.MonkeyPatch, draw: Any) -> list[Any]:
    """The figures `draw()` saves (drawn, as saved)."""
    from matplotlib.figure import Figure

    figures: list[Any] = []

    def keep(fig: Any, *args: Any, **kwargs: Any) -> None:
        fig.canvas.draw()
        figures.append(fig)

    monkeypatch.setattr(Figure, "savefig", keep)
    draw()
    return figures


def test_the_plots_legends_stand_outside_the_axes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A legend inside the axes covered curves: the replay's --plot, the figures in docs/
    (benches/vs_sglang.py's, scripts/policy_sweep.py's)."""
    pytest.importorskip("matplotlib")
    import importlib.util

    from conftest import load_bench_script

    cli_report._import_matplotlib()
    config = harness.ReplayConfig(kv_slots=8192, timeline=1, attention_only=False)
    _, timeline = harness.replay(cli_checks._workloads.mixed(5), config)
    figures = drawn(
        monkeypatch, lambda: cli_report._plot(timeline, str(tmp_path / "r.png"), "mixed")
    )
    curves = {"per_request_us": [1.0, 2.0], "per_request_us_without_allocator": [1.0]}
    report = {"workload": "gsp", "results": [{"config": "hybrid", "system": "x", **curves}]}
    vs = load_bench_script("vs_sglang")
    figures += drawn(monkeypatch, lambda: vs.plot(report, str(tmp_path / "vs.png")))
    path = Path(__file__).parents[1] / "scripts" / "policy_sweep.py"
    spec = importlib.util.spec_from_file_location("policy_sweep", path)
    assert spec is not None
    assert spec.loader is not None
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    cell = {"device_hit_rate": 0.5, "offline_bound_hit_rate": 0.9}
    cells = {("cell", w, "16", "lru"): cell for w in ("gsp", "mixed")}
    cells |= {("attention", w, "lru"): {"hit_rate": 1.0} for w in ("gsp", "mixed")}
    args = (cells, ["gsp", "mixed"], [16], ["lru"], str(tmp_path / "sweep.png"))
    figures += drawn(monkeypatch, lambda: sweep.plot(*args))
    assert len(figures) == 3
    for fig in figures:
        legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
        assert legends
        for legend in legends:
            box = legend.get_window_extent()
            for ax in fig.axes:
                assert not box.overlaps(ax.get_window_extent()), fig.axes[0].get_title()


CHILD = """
import sys
from radixcache import cli
from radixcache.serving import harness

run = harness.replay


def replay(*args, **kwargs):
    print("run started", file=sys.stderr, flush=True)
    return run(*args, **kwargs)


harness.replay = replay
sys.exit(cli.main(["replay", "--quiet", "--no-attention-only"]))
"""


def test_ctrl_c_prints_interrupted_and_exits_130() -> None:
    """SIGINT once the run is under way: "interrupted", status 130, no traceback."""
    with subprocess.Popen(
        [sys.executable, "-c", CHILD],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        # A child started from a shell job may inherit SIGINT ignored: restore it.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    ) as child:
        watchdog = threading.Timer(300, child.kill)  # a hung child fails, never hangs
        watchdog.start()
        try:
            assert child.stderr is not None
            started = child.stderr.readline()
            assert started == b"run started\n", started + child.stderr.read()
            child.send_signal(signal.SIGINT)
            err = child.stderr.read().decode(errors="replace")
            child.wait()
        finally:
            watchdog.cancel()
    assert "Traceback" not in err
    assert err == "interrupted\n"
    assert child.returncode == 130


TRIP = """
import os, signal, sys
from importlib.metadata import entry_points

eps = entry_points()
eps = eps.select(group="console_scripts") if hasattr(eps, "select") else eps["console_scripts"]
(command,) = [ep for ep in eps if ep.name == "radixcache"]


class Trip:
    \"\"\"Ctrl-C the moment {target!r} starts to load.\"\"\"

    def find_spec(self, name, path=None, target=None):
        if name == {target!r}:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None


sys.meta_path.insert(0, Trip())
sys.argv = ["radixcache", "replay", "--requests", "3", "--kv-slots", "8192", "--quiet"]
sys.exit(command.load()())  # what the installed `radixcache` script does
"""


@pytest.mark.parametrize(
    "target",
    [
        "radixcache.cli",  # the command line itself
        "radixcache._core",  # the extension
        "numpy",  # turns an interrupt inside its import into an ImportError
        "radixcache.serving.harness",
        "rich.progress",  # loaded once the flags are checked
    ],
)
def test_ctrl_c_while_the_command_loads_prints_interrupted_and_exits_130(target: str) -> None:
    """The `radixcache` command, Ctrl-C while it imports: "interrupted", status 130.

    It used to print a traceback for the first tenths of a second, the imports of the
    package and the command line, before `main` could catch it.
    """
    child = subprocess.run(
        [sys.executable, "-c", TRIP.format(target=target)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=300,
        check=False,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert (child.returncode, child.stderr) == (130, "interrupted\n")


def test_import_radixcache_loads_nothing_until_a_name_is_used() -> None:
    """What makes the command's first moments Ctrl-C safe; the first use loads all that
    ``import radixcache`` used to (NumPy too: the extension must not be the first to
    import it, under its lock); ``rc._core`` still works, alone."""
    code = (
        "import sys, radixcache as rc\n"
        "before = sorted(m for m in sys.modules if m.startswith(('numpy', 'radixcache.')))\n"
        "rc._core._int_fast_path\n"
        "rc.HybridCache\n"
        "print(before, 'numpy' in sys.modules, sorted(set(rc.__all__) - set(vars(rc))))\n"
    )
    child = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert child.stdout == "[] True []\n"


LIBRARY_ONLY = """
for name in rc.__all__:
    getattr(rc, name)
import radixcache.events, radixcache.glossary, radixcache.l3
command = ("radixcache.cli", "radixcache.serving", "rich", "matplotlib")
loaded = [m for m in sys.modules if any(m == c or m.startswith(c + ".") for c in command)]
print(sorted(loaded))
"""


def test_the_library_loads_neither_the_command_nor_serving_nor_rich() -> None:
    """`radixcache.serving` (the replay harness), rich and matplotlib are the command's:
    ``import radixcache``, every public name and the library's other modules load none of
    them (they stay installed by default: the README's first command needs them)."""
    child = run_child(LIBRARY_ONLY)
    assert_child_ok(child)
    assert child.stdout == "[]\n", child.stdout


FIRST_AND_SECOND = """
import signal
from radixcache.cli import interrupts as cli_interrupts

# Python's own handler, as in a command run from a terminal (a process started in the
# background of a script inherits SIGINT ignored, and `_Interrupts` then stays out).
signal.signal(signal.SIGINT, signal.default_int_handler)


def raises(f):
    try:
        f()
    except KeyboardInterrupt:
        return True
    return False


def run():
    with cli_interrupts._Interrupts() as stop:
        signal.raise_signal(signal.SIGINT)
        assert stop.pending, "noted, not raised"
        assert raises(lambda: signal.raise_signal(signal.SIGINT)), "a second one: at once"
    # the run ends here: the first Ctrl-C is raised now


assert raises(run), "the first one, raised when the run ends"
assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
with cli_interrupts._Interrupts() as stop:
    signal.raise_signal(signal.SIGINT)
    assert raises(stop.check), "between two steps"
    stop.check()  # once only
print("ok")
"""


def test_a_first_ctrl_c_waits_for_the_step_and_a_second_is_at_once() -> None:
    """The run stops between scheduler steps, never inside a cache call; twice: at once.

    In a fresh interpreter with Python's own SIGINT handler: a test worker may have
    SIGINT ignored (started in the background of a script), and `_Interrupts` rightly
    leaves an ignored SIGINT alone.
    """
    child = run_child(FIRST_AND_SECOND)
    assert_child_ok(child)
    assert child.stdout == "ok\n", child.stderr
