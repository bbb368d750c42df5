"""ObjectStore: the L3 tier's stores through the binding.

The file store runs everywhere; the Redis ones start their own ``redis-server`` on a
free loopback port in a temporary directory, and are skipped when it is not on PATH
(unless ``RADIXCACHE_REQUIRE_REDIS=1``, as in CI, which makes that a failure).
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import radixcache as rc
from radixcache import Breaker, L3Error, ObjectStore

from conftest import RedisServer

SIZE = 4096
#: The frame fields every object of these tests carries: a KV page of one identity.
LABEL: dict[str, Any] = {"kind": "kv", "identity": bytes(range(32))}


@pytest.fixture(params=["file", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    """Each backend, empty."""
    if request.param == "file":
        return ObjectStore(f"file://{tmp_path / 'store'}")
    server: RedisServer = request.getfixturevalue("redis_server")
    return ObjectStore(server.url)


def batch(n: int, tag: str = "p") -> tuple[list[bytes], list[bytes], np.ndarray]:
    """Keys, page hashes and pages (one row each)."""
    keys = [f"{tag}:{i}".encode() for i in range(n)]
    hashes = [bytes([i]) * 32 for i in range(n)]
    rng = np.random.default_rng(n)
    data = rng.integers(0, 256, size=(n, SIZE), dtype=np.uint8)
    return keys, hashes, data


def test_exported() -> None:
    assert rc.ObjectStore is rc._core.ObjectStore
    assert issubclass(rc.L3Error, rc.CacheError)
    assert "ObjectStore" in rc.__all__
    assert "L3Error" in rc.__all__
    assert rc.Breaker is rc._core.Breaker
    assert "Breaker" in rc.__all__


def test_put_get_into_round_trip(store: ObjectStore) -> None:
    keys, hashes, data = batch(16)
    data.flags.writeable = False  # put only reads
    assert store.exists(keys) == [False] * 16
    assert store.put(keys, hashes, data, **LABEL) == [True] * 16
    assert store.exists(keys) == [True] * 16
    out = np.zeros_like(data)
    assert store.get_into(keys, hashes, out, **LABEL) == ["ok"] * 16
    assert np.array_equal(out, data)


def test_put_is_write_once(store: ObjectStore) -> None:
    keys, hashes, data = batch(4)
    assert store.put(keys, hashes, data, **LABEL) == [True] * 4
    assert store.put(keys, hashes, np.full_like(data, 7), **LABEL) == [False] * 4
    out = np.zeros_like(data)
    assert store.get_into(keys, hashes, out, **LABEL) == ["ok"] * 4
    assert np.array_equal(out, data)


def test_missing_rows_are_left_untouched(store: ObjectStore) -> None:
    keys, hashes, data = batch(4)
    store.put(keys[:2], hashes[:2], data[:2], **LABEL)
    out = np.full_like(data, 0xAB)
    assert store.get_into(keys, hashes, out, **LABEL) == ["ok", "ok", "missing", "missing"]
    assert np.array_equal(out[:2], data[:2])
    assert (out[2:] == 0xAB).all()


def test_delete(store: ObjectStore) -> None:
    keys, hashes, data = batch(4)
    store.put(keys, hashes, data, **LABEL)
    store.delete(keys[:3])
    assert store.exists(keys) == [False, False, False, True]
    store.delete(keys[:3])  # absent keys: no error
    store.delete([])


def test_empty_batches(store: ObjectStore) -> None:
    empty = np.zeros((0, SIZE), dtype=np.uint8)
    assert store.exists([]) == []
    assert store.put([], [], empty, **LABEL) == []
    assert store.get_into([], [], empty, **LABEL) == []


def test_a_page_of_another_hash_or_size_is_corrupt_and_deleted(store: ObjectStore) -> None:
    keys, hashes, data = batch(3)
    store.put(keys, hashes, data, **LABEL)
    out = np.zeros_like(data)
    # Asked as another page: the hash does not match.
    wrong = [hashes[1], hashes[0], hashes[2]]
    assert store.get_into(keys, wrong, out, **LABEL) == ["corrupt", "corrupt", "ok"]
    assert (out[:2] == 0).all()
    assert store.exists(keys) == [False, False, True]
    # Asked with another page size: the length does not match.
    small = np.zeros((1, SIZE // 2), dtype=np.uint8)
    assert store.get_into(keys[2:], hashes[2:], small, **LABEL) == ["corrupt"]
    assert store.exists(keys) == [False, False, False]


def test_flipped_bytes_are_corrupt_and_deleted(tmp_path: Path) -> None:
    url = f"file://{tmp_path}"
    keys, hashes, data = batch(1)
    ObjectStore(url).put(keys, hashes, data, **LABEL)
    # Flip a payload byte in the stored file itself.
    (path,) = [p for p in tmp_path.rglob("k*") if p.is_file()]
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    out = np.zeros_like(data)
    store = ObjectStore(url)
    assert store.get_into(keys, hashes, out, **LABEL) == ["corrupt"]
    assert (out == 0).all()
    assert not path.exists()


def test_faulty_corrupt_is_never_ok_with_wrong_bytes(tmp_path: Path) -> None:
    url = f"file://{tmp_path}"
    keys, hashes, data = batch(32)
    ObjectStore(url).put(keys, hashes, data, **LABEL)
    faulty = ObjectStore.faulty(url, seed=3, corrupt=0.5, lose=0.2)
    out = np.zeros_like(data)
    got = faulty.get_into(keys, hashes, out, **LABEL)
    assert {"ok", "missing", "corrupt"} <= set(got)
    there = ObjectStore(url).exists(keys)
    for i, outcome in enumerate(got):
        if outcome == "ok":
            assert np.array_equal(out[i], data[i])
        else:
            assert (out[i] == 0).all()
        # Corrupt objects were deleted; lost ones are still stored.
        assert there[i] == (outcome != "corrupt")


def test_faulty_failures_and_timeouts_raise_l3error(tmp_path: Path) -> None:
    url = f"file://{tmp_path}"
    keys, hashes, data = batch(2)
    failing = ObjectStore.faulty(url, seed=1, fail=1.0)
    with pytest.raises(L3Error, match="put failed: injected failure"):
        failing.put(keys, hashes, data, **LABEL)
    timing_out = ObjectStore.faulty(url, seed=1, timeout=1.0)
    with pytest.raises(L3Error, match="exists timed out"):
        timing_out.exists(keys)
    with pytest.raises(L3Error, match="get timed out"):
        timing_out.get_into(keys, hashes, np.zeros_like(data), **LABEL)
    with pytest.raises(L3Error, match="delete timed out"):
        timing_out.delete(keys)


def test_faulty_is_deterministic_by_seed(tmp_path: Path) -> None:
    url = f"file://{tmp_path}"
    keys, hashes, data = batch(8)
    ObjectStore(url).put(keys, hashes, data, **LABEL)

    def trace(seed: int) -> list[object]:
        s = ObjectStore.faulty(url, seed=seed, fail=0.2, timeout=0.2, lose=0.2)
        return [attempt(s) for _ in range(30)]

    def attempt(s: ObjectStore) -> object:
        try:
            return s.get_into(keys, hashes, np.zeros_like(data), **LABEL)
        except L3Error as e:
            return str(e)

    assert trace(5) == trace(5)
    assert trace(5) != trace(6)


def test_repr(tmp_path: Path) -> None:
    url = f"file://{tmp_path}"
    assert repr(ObjectStore(url, timeout_ms=50)) == f"ObjectStore({url!r}, timeout_ms=50)"
    s = ObjectStore.faulty(url, seed=2, lose=0.5)
    assert repr(s) == (
        f"ObjectStore.faulty({url!r}, seed=2, fail=0.0, timeout=0.0, lose=0.5, corrupt=0.0,"
        " timeout_ms=200)"
    )
    assert s.url == url
    assert s.timeout_ms == 200


# ------------------------------------------------------------------ argument errors


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("localhost:6379", "url: .*no scheme"),
        ("mooncake://h:1", 'url: .*scheme "mooncake"'),
        ("redis://localhost", 'url: .*"localhost" is not HOST:PORT'),
        ("redis://h:99999", 'url: .*port "99999"'),
        ("redis+cluster://a:1,b", 'url: .*"b" is not HOST:PORT'),
        ("file://relative", "url: .*not absolute"),
    ],
)
def test_bad_url(url: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ObjectStore(url)


def _cause(store: ObjectStore) -> tuple[str, str]:
    """What `check` raises: the error's cause and message."""
    with pytest.raises(L3Error) as e:
        store.check()
    return e.value.cause, str(e.value)


def test_check_says_why_a_store_cannot_be_used(tmp_path: Path) -> None:
    from conftest import _need_redis, free_port

    _need_redis("redis-server")
    cause, message = _cause(ObjectStore(f"redis://127.0.0.1:{free_port()}"))
    assert cause == "connection refused"
    assert "connection refused" in message
    server = RedisServer(tmp_path, password="sesame")
    try:
        host = f"127.0.0.1:{server.port}"
        for url in (f"redis://{host}", f"redis://:wrong@{host}", f"redis://nobody:sesame@{host}"):
            cause, message = _cause(ObjectStore(url))
            assert cause == "authentication failed", (url, message)
        assert _cause(ObjectStore(f"redis://:sesame@{host}/99"))[0] == "bad database"
        ObjectStore(f"redis://:sesame@{host}/3").check()  # usable: no error
    finally:
        server.stop()
    ObjectStore(f"file://{tmp_path / 'store'}").check()


def test_a_store_error_carries_its_cause_on_every_call(tmp_path: Path) -> None:
    from conftest import free_port

    store = ObjectStore(f"redis://127.0.0.1:{free_port()}")
    for call in (
        lambda: store.exists([b"k"]),
        lambda: store.put([b"k"], [bytes(32)], np.zeros((1, 8), np.uint8), **LABEL),
        lambda: store.get_into([b"k"], [bytes(32)], np.zeros((1, 8), np.uint8), **LABEL),
        lambda: store.delete([b"k"]),
    ):
        with pytest.raises(L3Error) as e:
            call()
        assert e.value.cause == "connection refused"
    faulty = ObjectStore.faulty(f"file://{tmp_path}", seed=0, fail=1.0)
    with pytest.raises(L3Error) as e:
        faulty.exists([b"k"])
    assert e.value.cause == "injected failure"


def test_unusable_directory_raises_l3error(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(L3Error, match="open failed"):
        ObjectStore(f"file://{tmp_path / 'file' / 'sub'}")


@pytest.mark.parametrize("timeout_ms", [0, -5, 86_400_001, 2**63])
def test_bad_timeout(tmp_path: Path, timeout_ms: int) -> None:
    want = r"^timeout_ms: (must be in 1\.\.=86400000 \(a day\), got|.* out of the 64-bit range)"
    with pytest.raises(ValueError, match=want):
        ObjectStore(f"file://{tmp_path}", timeout_ms=timeout_ms)
    with pytest.raises(ValueError, match=want):
        ObjectStore.faulty(f"file://{tmp_path}", seed=0, timeout_ms=timeout_ms)


@pytest.mark.parametrize("timeout_ms", [True, 1.5, "200", None])
def test_a_timeout_that_is_not_an_int_is_a_type_error(tmp_path: Path, timeout_ms: Any) -> None:
    with pytest.raises(TypeError, match=r"^timeout_ms: expected an integer"):
        ObjectStore(f"file://{tmp_path}", timeout_ms=timeout_ms)
    with pytest.raises(TypeError, match=r"^timeout_ms: expected an integer"):
        ObjectStore.faulty(f"file://{tmp_path}", seed=0, timeout_ms=timeout_ms)


@pytest.mark.parametrize(
    ("url", "error", "message"),
    [
        ("redis://127.0.0.1:1\x00", ValueError, r"^url: holds a NUL character"),
        ("file:///tmp/\ud800", ValueError, r"^url: not valid Unicode"),
        (b"redis://127.0.0.1:1", TypeError, r"^url: expected a str, got bytes"),
        (None, TypeError, r"^url: expected a str, got NoneType"),
    ],
)
def test_a_url_that_is_not_text_is_refused_naming_it(url: Any, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        ObjectStore(url)
    with pytest.raises(error, match=message):
        ObjectStore.faulty(url, seed=0)


@pytest.mark.parametrize("rate", ["fail", "timeout", "lose", "corrupt"])
@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan")])
def test_bad_rates(tmp_path: Path, rate: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"{rate}: {rate} rate"):
        ObjectStore.faulty(f"file://{tmp_path}", seed=0, **{rate: value})  # type: ignore[arg-type]


def test_bad_seed(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^seed: must be >= 0"):
        ObjectStore.faulty(f"file://{tmp_path}", seed=-1)
    with pytest.raises(TypeError, match=r"^seed: expected an integer"):
        ObjectStore.faulty(f"file://{tmp_path}", seed=1.5)  # type: ignore[arg-type]


def test_bad_keys(tmp_path: Path) -> None:
    s = ObjectStore(f"file://{tmp_path}")
    with pytest.raises(TypeError, match="keys: expected a list of bytes, got int"):
        s.exists(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="keys: expected a list of bytes, got bytes"):
        s.exists(b"abc")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="keys: expected a list of bytes, got str"):
        s.delete("abc")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"keys\[1\]: expected bytes, got str"):
        s.exists([b"a", "b"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="keys: key 0 is 200 bytes, over the backend's limit"):
        s.exists([b"k" * 200])
    # Tuples work as lists do.
    assert s.exists((b"a", b"b")) == [False, False]


def test_bad_hashes(tmp_path: Path) -> None:
    s = ObjectStore(f"file://{tmp_path}")
    keys, hashes, data = batch(2)
    with pytest.raises(ValueError, match="hashes: 1 given for 2 keys"):
        s.put(keys, hashes[:1], data, **LABEL)
    with pytest.raises(ValueError, match=r"hashes\[1\]: expected 32 bytes, got 31"):
        s.put(keys, [hashes[0], hashes[1][:31]], data, **LABEL)
    with pytest.raises(TypeError, match=r"hashes\[0\]: expected bytes, got int"):
        s.get_into(keys, [1, 2], data, **LABEL)  # type: ignore[list-item]


def test_bad_data(tmp_path: Path) -> None:
    s = ObjectStore(f"file://{tmp_path}")
    keys, hashes, data = batch(2)
    with pytest.raises(TypeError, match="data: expected a 2-D numpy uint8 array, got list"):
        s.put(keys, hashes, [[1, 2]], **LABEL)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"data: expected .*, got a 2-D array of int64"):
        s.put(keys, hashes, data.astype(np.int64), **LABEL)
    with pytest.raises(TypeError, match=r"data: expected .*, got a 1-D array of uint8"):
        s.put(keys, hashes, data[0], **LABEL)
    with pytest.raises(ValueError, match="data: 1 rows for 2 keys"):
        s.put(keys, hashes, data[:1], **LABEL)
    with pytest.raises(ValueError, match="data: must be C-contiguous"):
        s.put(keys, hashes, np.asfortranarray(data), **LABEL)
    with pytest.raises(ValueError, match="data: rows of 0 bytes"):
        s.put(keys, hashes, np.zeros((2, 0), dtype=np.uint8), **LABEL)
    # Nothing was stored by the refused calls.
    assert s.exists(keys) == [False, False]


def test_bad_out(tmp_path: Path) -> None:
    s = ObjectStore(f"file://{tmp_path}")
    keys, hashes, data = batch(2)
    s.put(keys, hashes, data, **LABEL)
    read_only = np.zeros_like(data)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="out: must be a writable array"):
        s.get_into(keys, hashes, read_only, **LABEL)
    with pytest.raises(ValueError, match="out: must be C-contiguous"):
        s.get_into(keys, hashes, np.zeros((4, SIZE), dtype=np.uint8)[::2], **LABEL)
    with pytest.raises(ValueError, match="out: 3 rows for 2 keys"):
        s.get_into(keys, hashes, np.zeros((3, SIZE), dtype=np.uint8), **LABEL)
    with pytest.raises(TypeError, match="out: expected a 2-D numpy uint8 array"):
        s.get_into(keys, hashes, bytearray(2 * SIZE), **LABEL)  # type: ignore[arg-type]


# ------------------------------------------------------------------------- redis


def test_redis_down_raises_l3error_quickly_and_recovers(redis_server: RedisServer) -> None:
    s = ObjectStore(redis_server.url, timeout_ms=200)
    keys, hashes, data = batch(4)
    assert s.put(keys, hashes, data, **LABEL) == [True] * 4
    redis_server.stop()
    t = time.monotonic()
    with pytest.raises(L3Error, match="get failed"):
        s.get_into(keys, hashes, np.zeros_like(data), **LABEL)
    assert time.monotonic() - t < 1.0
    redis_server.start()
    # Reconnected; the data went with the process (no persistence).
    assert s.exists(keys) == [False] * 4
    assert s.put(keys, hashes, data, **LABEL) == [True] * 4


def test_redis_stopped_server_times_out(redis_server: RedisServer) -> None:
    s = ObjectStore(redis_server.url, timeout_ms=200)
    keys, hashes, data = batch(2)
    s.put(keys, hashes, data, **LABEL)
    assert redis_server.proc is not None
    redis_server.proc.send_signal(signal.SIGSTOP)
    try:
        t = time.monotonic()
        with pytest.raises(L3Error, match="get timed out"):
            s.get_into(keys, hashes, np.zeros_like(data), **LABEL)
        assert time.monotonic() - t < 1.0
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)
    out = np.zeros_like(data)
    assert s.get_into(keys, hashes, out, **LABEL) == ["ok", "ok"]
    assert np.array_equal(out, data)


def test_redis_corrupt_object_is_deleted(redis_server: RedisServer) -> None:
    s = ObjectStore(redis_server.url)
    keys, hashes, data = batch(2)
    s.put(keys, hashes, data, **LABEL)
    # Overwrite one object with garbage, as a foreign writer could.
    subprocess.run(
        ["redis-cli", "-p", str(redis_server.port), "set", keys[0].decode(), "garbage"],
        check=True,
        capture_output=True,
    )
    out = np.zeros_like(data)
    assert s.get_into(keys, hashes, out, **LABEL) == ["corrupt", "ok"]
    assert s.exists(keys) == [False, True]


def test_calls_release_the_gil(redis_server: RedisServer) -> None:
    """While one thread waits on a stopped server, another runs Python code."""
    s = ObjectStore(redis_server.url, timeout_ms=500)
    s.exists([b"warm"])  # connect first
    assert redis_server.proc is not None
    redis_server.proc.send_signal(signal.SIGSTOP)
    ticks = 0
    done = threading.Event()

    def wait() -> None:
        try:
            with pytest.raises(L3Error):
                s.exists([b"k"])
        finally:
            done.set()

    try:
        t = threading.Thread(target=wait)
        t.start()
        while not done.is_set():
            ticks += 1
            time.sleep(0.001)
        t.join()
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)
    assert ticks > 50


# ----------------------------------------------------------------------- breaker


def state(b: Breaker) -> str:
    """``b.state``, read afresh (mypy would narrow the property across calls)."""
    return b.state


def test_breaker_opens_after_threshold_consecutive_failures() -> None:
    b = Breaker(threshold=3, cooldown_ms=60_000)
    assert (state(b), b.errors, b.trips) == ("closed", 0, 0)
    b.failure()
    b.failure()
    b.success()  # resets the run
    b.failure()
    b.failure()
    assert state(b) == "closed"
    assert b.allow()
    b.failure()
    assert (state(b), b.errors, b.trips) == ("open", 5, 1)
    assert not b.allow()


def test_breaker_probes_after_the_cooldown() -> None:
    b = Breaker(threshold=1, cooldown_ms=50)
    b.failure()
    assert not b.allow()
    time.sleep(0.06)
    assert b.allow()
    assert state(b) == "half_open"
    assert not b.allow()  # one probe only
    b.failure()  # the probe failed: open again, a new cooldown
    assert (state(b), b.trips) == ("open", 2)
    assert not b.allow()
    time.sleep(0.06)
    assert b.allow()
    b.success()
    assert state(b) == "closed"
    assert b.allow()


def test_breaker_zero_cooldown_probes_at_once() -> None:
    b = Breaker(threshold=2, cooldown_ms=0)
    b.failure()
    b.failure()
    assert state(b) == "open"
    assert b.allow()
    assert state(b) == "half_open"


def test_breaker_repr_and_defaults() -> None:
    b = Breaker()
    assert (b.threshold, b.cooldown_ms) == (5, 1000)
    assert repr(b) == 'Breaker(state="closed", errors=0, trips=0, threshold=5, cooldown_ms=1000)'


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"threshold": 0}, "threshold: must be in 1..=4294967295, got 0"),
        ({"threshold": -1}, "threshold: must be in 1..=4294967295, got -1"),
        ({"threshold": 1 << 32}, "threshold: must be in 1..=4294967295, got 4294967296"),
        ({"cooldown_ms": -1}, "cooldown_ms: must be at least 0, got -1"),
    ],
)
def test_breaker_bad_arguments(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Breaker(**kwargs)


def test_breaker_with_a_dead_store(tmp_path: Path) -> None:
    """The pattern the L3 engine follows: ask, call, report."""
    store = ObjectStore.faulty(f"file://{tmp_path}", seed=0, fail=1.0)
    b = Breaker(threshold=3, cooldown_ms=60_000)
    calls = 0
    for _ in range(10):
        if not b.allow():
            continue
        calls += 1
        try:
            store.exists([b"k"])
        except L3Error:
            b.failure()
        else:
            b.success()
    assert (calls, state(b), b.errors, b.trips) == (3, "open", 3, 1)
