"""The L3 tier on Mooncake Store (`radixcache.mooncake`): the framing bindings it shares
with the Rust stores, its URL, and, against a real ``mooncake_master`` and store daemon
started on loopback (`LocalMooncake`), write-once puts, verified gets, corrupt objects
removed, batches larger than the staging buffer, a master that is down, and fleet
replays through ``--l3 mooncake://``.

The tests that need Mooncake skip when the ``mooncake`` package (the extra ``mooncake``)
or its programs are missing, unless ``RADIXCACHE_REQUIRE_MOONCAKE=1`` (``.ci/mooncake``),
which makes that a failure."""

from __future__ import annotations

import hashlib
import importlib.util
import ipaddress
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from radixcache import L3Error, ObjectStore
from radixcache._core import FRAME_HEADER_LEN, frame_decode, frame_encode
from radixcache.l3 import L3Tier, open_store
from radixcache.mooncake import (
    LocalMooncake,
    MooncakeStore,
    mooncake_binary,
    parse_mooncake_url,
)
from radixcache.serving import workloads
from radixcache.serving.harness import ReplayConfig, replay_fleet

#: The frame fields of the objects of these tests: KV pages of one identity.
LABEL: dict[str, Any] = {"kind": "kv", "identity": hashlib.sha256(b"test-model").digest()}


def _hashes(keys: list[bytes]) -> list[bytes]:
    return [hashlib.sha256(k).digest() for k in keys]


def _data(n: int, size: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, size), dtype=np.uint8)


# ---------------------------------------------------------------------- the framing


def test_frame_encode_writes_the_bytes_the_rust_stores_write(tmp_path: Path) -> None:
    keys = [b"k0", b"k1", b"k2"]
    hashes, data = _hashes(keys), _data(3, 300)
    store = ObjectStore(f"file://{tmp_path}")
    assert store.put(keys, hashes, data, **LABEL) == [True] * 3
    out = np.zeros((3, FRAME_HEADER_LEN + 300), dtype=np.uint8)
    frame_encode(hashes, data, out, **LABEL)
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert len(files) == 3
    stored = {f.read_bytes() for f in files}
    assert {bytes(row) for row in out} == stored
    assert bytes(out[0, :4]) == b"RCL3"


def test_frame_decode_verifies_and_copies_only_good_objects() -> None:
    keys = [b"a", b"b", b"c", b"d", b"e", b"f"]
    hashes, data = _hashes(keys), _data(6, 100)
    objects = np.zeros((6, FRAME_HEADER_LEN + 100), dtype=np.uint8)
    frame_encode(hashes, data, objects, **LABEL)
    objects[1, FRAME_HEADER_LEN + 7] ^= 1  # a payload bit
    objects[2, 0] = ord("X")  # the magic
    objects[3, 4] = 9  # the version
    lengths = [objects.shape[1]] * 6
    lengths[4] = 20  # truncated
    wrong = list(hashes)
    wrong[5] = hashes[0]  # another page's object
    out = np.full((6, 100), 0xAA, dtype=np.uint8)
    verdicts = frame_decode(wrong, objects, lengths, out, **LABEL)
    assert verdicts == ["ok"] + ["corrupt"] * 5
    np.testing.assert_array_equal(out[0], data[0])
    assert (out[1:] == 0xAA).all()
    # A shorter object than the row holds is caught by its length.
    verdicts = frame_decode(hashes[:1], objects[:1], [objects.shape[1] - 1], out[:1], **LABEL)
    assert verdicts == ["corrupt"]


def test_frame_decode_calls_another_models_or_kinds_objects_foreign() -> None:
    hashes, data = _hashes([b"a", b"b"]), _data(2, 100)
    objects = np.zeros((2, FRAME_HEADER_LEN + 100), dtype=np.uint8)
    frame_encode(hashes, data, objects, **LABEL)
    lengths = [objects.shape[1]] * 2
    out = np.full((2, 100), 0xAA, dtype=np.uint8)
    other_model = {"kind": "kv", "identity": hashlib.sha256(b"other-model").digest()}
    assert frame_decode(hashes, objects, lengths, out, **other_model) == ["foreign"] * 2
    assert (
        frame_decode(hashes, objects, lengths, out, kind="mamba", identity=LABEL["identity"])
        == ["foreign"] * 2
    )
    assert (out == 0xAA).all()


def test_frame_bindings_refuse_bad_arguments_naming_them() -> None:
    h = _hashes([b"x"])
    data, objects = _data(1, 8), np.zeros((1, FRAME_HEADER_LEN + 8), dtype=np.uint8)
    width = FRAME_HEADER_LEN + 8
    with pytest.raises(ValueError, match=rf"^out: rows of {width - 1} bytes, expected {width}"):
        frame_encode(h, data, np.zeros((1, width - 1), dtype=np.uint8), **LABEL)
    with pytest.raises(ValueError, match=r"^hashes\[0\]: expected 32 bytes, got 3"):
        frame_encode([b"abc"], data, objects, **LABEL)
    with pytest.raises(TypeError, match=r"^data: expected a 2-D numpy uint8 array"):
        frame_encode(h, data.astype(np.int16), objects, **LABEL)
    with pytest.raises(ValueError, match=r"^data: 1 rows for 2 keys"):
        frame_encode(h * 2, data, objects, **LABEL)
    with pytest.raises(ValueError, match=r"^kind: expected 'kv' or 'mamba', got \"swa\""):
        frame_encode(h, data, objects, kind="swa", identity=LABEL["identity"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^identity: expected 32 bytes, got 31"):
        frame_encode(h, data, objects, kind="kv", identity=bytes(31))
    with pytest.raises(TypeError, match=r"^identity: expected 32 bytes, got str"):
        frame_decode(h, objects, [width], data, kind="kv", identity="x" * 32)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=rf"^lengths\[0\]: must be in 0..={width}, got {width + 1}"
    ):
        frame_decode(h, objects, [width + 1], data, **LABEL)
    with pytest.raises(ValueError, match=rf"^lengths\[0\]: must be in 0..={width}, got -1"):
        frame_decode(h, objects, [-1], data, **LABEL)
    with pytest.raises(ValueError, match=r"^hashes: 2 given for 1 keys"):
        frame_decode(h * 2, objects, [width], data, **LABEL)
    with pytest.raises(ValueError, match=rf"^objects: rows of {width} bytes, expected {width + 1}"):
        frame_decode(h, objects, [width], np.zeros((1, 9), dtype=np.uint8), **LABEL)


# ---------------------------------------------------------------------- the URL


def test_a_mooncake_url_names_the_master_and_its_defaults() -> None:
    c = parse_mooncake_url("mooncake://10.0.0.5:50051")
    assert (c.master, c.metadata, c.host) == (
        "10.0.0.5:50051",
        "http://10.0.0.5:8080/metadata",
        None,
    )
    assert (c.segment, c.buffer, c.protocol, c.device, c.timeout_ms) == (
        0,
        128 << 20,
        "tcp",
        "",
        1000,
    )
    c = parse_mooncake_url(
        "mooncake://m:1?metadata=http://md:9/metadata&host=10.1.1.1&segment=2GiB"
        "&buffer=512KiB&protocol=rdma&device=mlx5_0&timeout_ms=250"
    )
    assert (c.metadata, c.host, c.segment, c.buffer) == (
        "http://md:9/metadata",
        "10.1.1.1",
        2 << 30,
        512 << 10,
    )
    assert (c.protocol, c.device, c.timeout_ms) == ("rdma", "mlx5_0", 250)
    assert parse_mooncake_url("mooncake://[::1]:7").master == "[::1]:7"


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("redis://h:1", r"^url: expected mooncake://HOST:PORT"),
        ("mooncake://h", r"^url: .* is not mooncake://HOST:PORT"),
        ("mooncake://h:x", r"^url: .*the port is not a number"),
        ("mooncake://h:1/db", r"^url: .* has a path"),
        ("mooncake://h:1?size=3", r"^url: unknown query parameter 'size'"),
        ("mooncake://h:1?host=a&host=b", r"^url: query parameter 'host' given twice"),
        ("mooncake://h:1?segment=3TB", r"^segment: '3TB' is not a size"),
        ("mooncake://h:1?buffer=10", r"^buffer: must be at least 89 bytes, got 10"),
        ("mooncake://h:1?timeout_ms=0", r"^timeout_ms: must be an integer >= 1"),
        ("mooncake://h:1?protocol=udp", r"^protocol: must be tcp or rdma"),
        ("mooncake://h:1?metadata=", r"^metadata: must not be empty"),
        ("mooncake://h:1?host=", r"^host: must not be empty"),
    ],
)
def test_bad_mooncake_urls_are_refused_naming_the_part(url: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_mooncake_url(url)
    if url.startswith("mooncake://"):
        with pytest.raises(ValueError, match=match):
            open_store(url)


def test_open_store_picks_the_backend_by_scheme(tmp_path: Path) -> None:
    assert isinstance(open_store(f"file://{tmp_path}"), ObjectStore)
    assert isinstance(open_store("redis://127.0.0.1:1"), ObjectStore)
    forms = r"redis://.*, redis\+cluster://.*, file:///ABSOLUTE/DIR, mooncake://MASTER_HOST:PORT"
    with pytest.raises(ValueError, match=rf"^url: bad store url 'ftp://nowhere': scheme .*{forms}"):
        open_store("ftp://nowhere")
    with pytest.raises(
        ValueError, match=rf"^url: bad store url 'localhost:6379': no scheme .*{forms}"
    ):
        open_store("localhost:6379")
    with pytest.raises(TypeError, match=r"^url: expected a str, got bytes"):
        open_store(b"redis://127.0.0.1:1")  # type: ignore[arg-type]


def test_a_mooncake_url_opens_a_mooncake_store() -> None:
    need_mooncake()
    assert isinstance(open_store("mooncake://127.0.0.1:1"), MooncakeStore)


def test_a_mooncake_url_without_the_package_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "mooncake", None)
    with pytest.raises(
        ImportError,
        match=r"mooncake package is not installed: pip install 'radixcache\[mooncake\]'",
    ):
        open_store("mooncake://127.0.0.1:1")
    # A bad URL is said first, package or not.
    with pytest.raises(ValueError, match=r"^url: unknown query parameter 'nope'"):
        open_store("mooncake://h:1?nope=1")


def test_the_local_host_defaults_to_the_address_of_the_route_to_the_master() -> None:
    from radixcache.mooncake import _route_to

    assert _route_to("127.0.0.1", 50051) == "127.0.0.1"
    assert _route_to("::1", 50051) == "::1"
    # TEST-NET-1: no packet is sent; the answer is a local, non-loopback address, or
    # the host name on a machine without a route.
    local = _route_to("192.0.2.1", 50051)
    if local != socket.gethostname():
        assert not ipaddress.ip_address(local).is_loopback
    assert _route_to("no-such-host.invalid", 1) == socket.gethostname()


def test_without_the_mooncake_package_the_first_call_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "mooncake", None)
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    store = MooncakeStore("mooncake://127.0.0.1:1")  # opens: nothing connects yet
    with pytest.raises(ModuleNotFoundError, match=r"radixcache\[mooncake\]"):
        store.exists([b"k"])


def test_the_cli_refuses_a_bad_mooncake_url(capsys: pytest.CaptureFixture[str]) -> None:
    from radixcache.cli import main

    assert main(["replay", "--requests", "4", "--l3", "mooncake://h:1?nope=1"]) == 2
    assert "--l3: url: unknown query parameter 'nope'" in capsys.readouterr().err


# ---------------------------------------------------------------------- a real store


def need_mooncake() -> None:
    """Skip (or fail, with ``RADIXCACHE_REQUIRE_MOONCAKE=1``) without Mooncake here."""
    missing = None
    if importlib.util.find_spec("mooncake") is None:
        missing = 'the mooncake package is not installed (pip install "radixcache[mooncake]")'
    elif mooncake_binary("mooncake_master") is None or mooncake_binary("mooncake_client") is None:
        missing = "the mooncake package carries no mooncake_master/mooncake_client"
    if missing is not None:
        if os.environ.get("RADIXCACHE_REQUIRE_MOONCAKE") == "1":
            pytest.fail(f"{missing}, and RADIXCACHE_REQUIRE_MOONCAKE=1")
        pytest.skip(missing)


@pytest.fixture(scope="module")
def mc() -> Iterator[LocalMooncake]:
    """A ``mooncake_master`` and one store daemon (256 MiB) on free loopback ports."""
    need_mooncake()
    with LocalMooncake(segment=256 << 20) as m:
        yield m


_run = iter(range(1_000_000))


def _fresh(n: int) -> list[bytes]:
    """`n` keys no other test uses (the store is shared by the module's tests)."""
    tag = f"t{os.getpid()}-{next(_run)}"
    return [f"{tag}-{i}".encode() for i in range(n)]


@pytest.fixture
def store(mc: LocalMooncake) -> Iterator[MooncakeStore]:
    s = MooncakeStore(mc.url)
    yield s
    s.close()


def test_a_put_is_fetched_byte_for_byte_and_written_once(store: MooncakeStore) -> None:
    keys = _fresh(5)
    hashes, data = _hashes(keys), _data(5, 4096)
    assert store.exists(keys) == [False] * 5
    assert store.put(keys[:2], hashes[:2], data[:2], **LABEL) == [True, True]
    assert store.put(keys, hashes, data, **LABEL) == [False, False, True, True, True]
    # Write-once: other bytes under a stored key do not replace it.
    assert store.put(keys[:1], hashes[:1], _data(1, 4096, seed=9), **LABEL) == [False]
    assert store.exists(keys) == [True] * 5
    out = np.zeros_like(data)
    assert store.get_into(keys, hashes, out, **LABEL) == ["ok"] * 5
    np.testing.assert_array_equal(out, data)


def test_a_missing_object_is_a_miss_and_its_row_untouched(store: MooncakeStore) -> None:
    keys = _fresh(3)
    hashes, data = _hashes(keys), _data(3, 512)
    store.put(keys[1:2], hashes[1:2], data[1:2], **LABEL)
    out = np.full((3, 512), 7, dtype=np.uint8)
    assert store.get_into(keys, hashes, out, **LABEL) == ["missing", "ok", "missing"]
    assert (out[0] == 7).all()
    assert (out[2] == 7).all()
    np.testing.assert_array_equal(out[1], data[1])


def test_corrupt_objects_are_reported_and_removed(store: MooncakeStore, mc: LocalMooncake) -> None:
    keys = _fresh(4)
    hashes, data = _hashes(keys), _data(4, 1000)
    assert store.put(keys, hashes, data, **LABEL) == [True] * 4
    # Another page's hash, a payload one byte short and one byte long of the object's.
    out = np.full((1, 1000), 5, dtype=np.uint8)
    assert store.get_into(keys[:1], hashes[1:2], out, **LABEL) == ["corrupt"]
    assert (out == 5).all()
    assert store.get_into(keys[1:2], hashes[1:2], np.zeros((1, 999), np.uint8), **LABEL) == [
        "corrupt"
    ]
    assert store.get_into(keys[2:3], hashes[2:3], np.zeros((1, 1001), np.uint8), **LABEL) == [
        "corrupt"
    ]
    assert store.exists(keys) == [False, False, False, True]
    # Bytes some other client wrote under a key (not framed) are corrupt too.
    from mooncake.store import MooncakeDistributedStore

    raw = MooncakeDistributedStore()
    assert raw.setup("127.0.0.1", mc.metadata, 0, 16 << 20, "tcp", "", _master(mc)) == 0
    (bad,) = _fresh(1)
    assert raw.put(bad.decode(), b"\x00" * (FRAME_HEADER_LEN + 1000)) == 0
    raw.close()
    out = np.zeros((1, 1000), dtype=np.uint8)
    assert store.get_into([bad], _hashes([bad]), out, **LABEL) == ["corrupt"]
    assert store.exists([bad]) == [False]


def _master(m: LocalMooncake) -> str:
    return f"127.0.0.1:{m.rpc_port}"


def test_batches_larger_than_the_staging_buffer_go_in_rounds(mc: LocalMooncake) -> None:
    # Room for two framed 1000-byte objects a round; an object larger than that grows it.
    s = MooncakeStore(mc.url + f"&buffer={2 * (FRAME_HEADER_LEN + 1000) + 10}")
    try:
        keys = _fresh(7)
        hashes, data = _hashes(keys), _data(7, 1000)
        assert s.put(keys, hashes, data, **LABEL) == [True] * 7
        out = np.zeros_like(data)
        assert s.get_into(keys, hashes, out, **LABEL) == ["ok"] * 7
        np.testing.assert_array_equal(out, data)
        big = _fresh(2)
        data = _data(2, 8000)
        assert s.put(big, _hashes(big), data, **LABEL) == [True, True]
        out = np.zeros_like(data)
        assert s.get_into(big, _hashes(big), out, **LABEL) == ["ok", "ok"]
        np.testing.assert_array_equal(out, data)
    finally:
        s.close()


def test_delete_removes_and_ignores_absent_keys(store: MooncakeStore) -> None:
    keys = _fresh(2)
    store.put(keys, _hashes(keys), _data(2, 64), **LABEL)
    store.delete([*keys, b"never-stored"])
    assert store.exists(keys) == [False, False]


def test_bad_arguments_are_refused_naming_them(store: MooncakeStore) -> None:
    h = _hashes([b"x"])
    with pytest.raises(TypeError, match=r"^keys\[0\]: expected bytes, got str"):
        store.exists(["x"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"^keys: expected a list of bytes"):
        store.exists(b"x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^keys\[0\]: must be ASCII"):
        store.exists([b"\xff"])
    with pytest.raises(ValueError, match=r"^hashes: 2 given for 1 keys"):
        store.put([b"x"], h * 2, _data(1, 8), **LABEL)
    with pytest.raises(ValueError, match=r"^data: 1 rows for 2 keys"):
        store.put([b"x", b"y"], h * 2, _data(1, 8), **LABEL)
    with pytest.raises(TypeError, match=r"^out: expected a 2-D numpy uint8 array"):
        store.get_into([b"x"], h, np.zeros(8, np.uint8), **LABEL)
    with pytest.raises(ValueError, match=r"^out: must be C-contiguous"):
        store.get_into([b"x", b"y"], h * 2, np.zeros((8, 2), np.uint8).T, **LABEL)


@pytest.mark.slow
def test_a_master_that_is_down_fails_calls_with_l3error_and_a_new_one_serves() -> None:
    # A store of its own: the master is stopped and started again.
    need_mooncake()
    with LocalMooncake(segment=64 << 20) as m:
        s = MooncakeStore(m.url + "&timeout_ms=300")
        try:
            keys = _fresh(2)
            assert s.put(keys, _hashes(keys), _data(2, 100), **LABEL) == [True, True]
            m.stop_master()
            # Every call fails, each within about the deadline (3 x 300 ms), although
            # Mooncake's client holds a call to a vanished master for seconds.
            for _ in range(3):
                t = time.monotonic()
                with pytest.raises(L3Error, match=r"^mooncake: "):
                    s.put(_fresh(1), _hashes([b"z"]), _data(1, 100), **LABEL)
                with pytest.raises(L3Error, match=r"^mooncake: "):
                    s.get_into(keys, _hashes(keys), np.zeros((2, 100), np.uint8), **LABEL)
                assert time.monotonic() - t < 2 * 0.9 + 0.5
            # A new master (its index empty): the daemon mounts its segment again and
            # the same client serves again; what the old master indexed is a miss.
            m.start_master()
            _until(lambda: m.capacity() >= 64 << 20)
            _until(lambda: _answers(s))
            assert s.exists(keys) == [False, False]
            again = _fresh(1)
            assert s.put(again, _hashes(again), _data(1, 100), **LABEL) == [True]
            out = np.zeros((1, 100), np.uint8)
            assert s.get_into(again, _hashes(again), out, **LABEL) == ["ok"]
            np.testing.assert_array_equal(out, _data(1, 100))
            m.stop_master()
        finally:
            s.close()
        # No master at all: connecting fails with L3Error (a deadline long enough to
        # see Mooncake's own answer), and is tried again later.
        s = MooncakeStore(m.url + "&timeout_ms=3000")
        with pytest.raises(L3Error, match=r"^mooncake: could not set up a client of master"):
            s.exists([b"k"])
        m.start_master()
        _until(lambda: _answers(s))
        assert s.exists([b"k"]) == [False]
        s.close()


def _answers(s: MooncakeStore) -> bool:
    try:
        s.exists([b"probe"])
    except L3Error:
        return False
    return True


def _until(ready: Any, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not ready():
        assert time.monotonic() < deadline, "not ready in time"
        time.sleep(0.05)


@pytest.mark.slow
def test_a_call_given_up_on_does_not_write_the_callers_array(mc: LocalMooncake) -> None:
    s = MooncakeStore(mc.url)
    try:
        keys = _fresh(3)
        data = _data(3, 4096)
        assert s.put(keys, _hashes(keys), data, **LABEL) == [True] * 3
        # The worker is held by a job of the test's, so the get waits past its deadline.
        release = threading.Event()
        s._worker.submit(release.wait)
        out = np.zeros((3, 4096), np.uint8)
        t = time.monotonic()
        with pytest.raises(L3Error, match=r"no answer from master .* within 3000 ms"):
            s.get_into(keys, _hashes(keys), out, **LABEL)
        assert time.monotonic() - t < 4
        release.set()
        # The worker is free again; the given-up get was called off before it started.
        assert s.get_into(keys, _hashes(keys), np.zeros_like(out), **LABEL) == ["ok"] * 3
        assert not out.any()
    finally:
        release.set()
        s.close()


# ---------------------------------------------------------------------- the tier


def test_the_l3_tier_runs_on_mooncake_unchanged(mc: LocalMooncake) -> None:
    # Two caches, each with its own client: one computes, the other fetches it.
    from test_l3 import TOKENS

    from l3_common import L3Cache

    rng = np.random.default_rng(0)
    # A model of their own, so that other tests' objects are not found.
    model = _fresh(1)[0].decode()
    a = L3Cache(MooncakeStore(mc.url), hybrid=True, model=model)
    b = L3Cache(MooncakeStore(mc.url), hybrid=True, model=model)
    wrote = a.compute(TOKENS, rng)
    a.settle()
    assert a.tier.counters.stored_objects == 7
    assert b.tier.fetch(TOKENS) == len(TOKENS)
    got = b.loaded(TOKENS)
    for name, want in wrote.items():
        np.testing.assert_array_equal(got[name], want, err_msg=name)
    b.cache.audit()
    assert isinstance(a.tier, L3Tier)


def _fleet(url: str, workload: str, n: int) -> dict[str, Any]:
    jobs = workloads.WORKLOADS[workload](n, 0)
    return replay_fleet(jobs, ReplayConfig(l3=url, attention_only=False), 2)


@pytest.mark.slow
@pytest.mark.parametrize("workload", ["multiturn", "gsp"])
def test_a_fleet_over_mooncake_serves_every_sample_right(mc: LocalMooncake, workload: str) -> None:
    r = _fleet(mc.url, workload, 160)
    assert (r["mismatches"], r["audit"], r["pools_full_at_end"]) == (0, "pass", True)
    assert r["l3_hit_tokens"] > 0
    assert r["l3_errors"] == 0
    assert r["l3_breaker"] == ["closed", "closed"]
    assert r["fleet_without_l3_hit_rate"] < r["hit_rate"]


def test_the_cli_replays_a_fleet_on_mooncake(
    mc: LocalMooncake, capsys: pytest.CaptureFixture[str]
) -> None:
    from radixcache.cli import main

    argv = ["replay", "--workload", "multiturn", "--requests", "40", "--quiet", "--json"]
    assert main([*argv, "--l3", mc.url, "--servers", "2", "--no-attention-only"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["servers"], r["requests"], r["mismatches"]) == (2, 40, 0)
    assert r["l3_stored_objects"] > 0


@pytest.mark.slow
def test_two_shard_processes_share_a_mooncake_whose_master_dies_and_comes_back(
    mc: LocalMooncake,
) -> None:
    # The script starts a store of its own (`mc` only makes the test skip without one);
    # two copies of the workload still run well past the restart.
    script = Path(__file__).parent.parent / "scripts" / "l3_shards.py"
    run = subprocess.run(
        [sys.executable, str(script), "--store", "mooncake", "--json", "--copies", "2"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    r = json.loads(run.stdout)
    assert (r["store"], r["killed"]) == ("mooncake", True)
    for shard in r["shards"]:
        assert (shard["mismatches"], shard["audit"]) == (0, "pass")
        assert shard["l3_hit_tokens"] > 0
    assert any(s["l3_breaker_trips"] for s in r["shards"])
    assert any(s["hits"]["after"] for s in r["shards"]), "hits resumed after the restart"
