from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import warnings
from collections.abc import Iterator, Sized
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from hypothesis import strategies as st

import radixcache as rc

#: Gauges of stats() that describe what the cache holds (not counters of what happened).
GAUGES = (
    "nodes",
    "namespaces",
    "live_locks",
    "live_requests",
    "batches_in_flight",
    "kv_caller_slots",
    "kv_request_slots",
    "mamba_cached_states",
    "mamba_evictable_states",
    "mamba_protected_states",
    "mamba_free_slots",
    "mamba_caller_slots",
    "mamba_request_slots",
    "mamba_draining_slots",
    "kv_draining_slots",
    "kv_evicting_tokens",
    "host_kv_draining_slots",
    "host_mamba_draining_slots",
)

#: Each pool's gauges: what its slots are doing, and the name of the cached figure.
POOLS = (
    ("kv", "cached_tokens"),
    ("mamba", "cached_states"),
    ("host_kv", "cached_tokens"),
    ("host_mamba", "cached_states"),
    ("swa", "cached_tokens"),
    ("host_swa", "cached_tokens"),
)


def assert_pool_sums(cache: rc.HybridCache) -> None:
    """For every pool, free + cached + caller + request + draining == capacity (host
    pools have no caller or request slots): the gauges account for every slot, also
    while copies run."""
    s = cache.stats()
    for pool, cached_name in POOLS:
        parts = ("free_slots", cached_name, "caller_slots", "request_slots", "draining_slots")
        total = sum(s.get(f"{pool}_{p}", 0) for p in parts)
        assert total == s[f"{pool}_capacity_slots"], (pool, s)


def fingerprint(cache: rc.HybridCache) -> tuple[object, ...]:
    """Everything observable about a cache's contents, to check that a failed call
    changed nothing. Reading it changes nothing either (no match, no LRU refresh)."""
    cache.audit()
    stats = cache.stats()
    return (
        cache.evictable_size(),
        cache.protected_size(),
        cache.total_size(),
        cache.available_kv(),
        cache.available_mamba(),
        tuple(stats[k] for k in GAUGES),
        cache.pretty(max_nodes=10_000, max_tokens=10_000),
    )


def cached(
    cache: rc.HybridCache,
    tokens: list[int],
    namespace: str | None = None,
    mamba_slot: int | None = None,
) -> rc.Insert:
    """Cache `tokens` the way a serving engine does: match, allocate the rest, insert
    (handing over `mamba_slot`, the state at the end of `tokens`, when given)."""
    m = cache.match_prefix(tokens, namespace=namespace)
    ps = cache.page_size
    rest = len(tokens) - m.device_len
    n = -(-rest // ps) * ps
    slots = cache.alloc_kv(n)
    assert slots is not None
    # Slots past the last token share the tail page; handing over the tail slots hands
    # over that page, which the insert then frees.
    kv = np.concatenate([m.kv_indices, slots[:rest]])
    return cache.insert(
        tokens, kv, namespace=namespace, owned_from=m.device_len, mamba_slot=mamba_slot
    )


@pytest.fixture
def cache() -> rc.HybridCache:
    return rc.HybridCache(kv_slots=64)


def held_apart(cache: rc.HybridCache, kv: list[int], state: int | None) -> None:
    """Takes every free KV slot and state slot and checks none is in `kv` or `state`,
    then gives them back."""
    got = cache.alloc_kv(cache.available_kv())
    assert got is not None
    assert not set(got.tolist()) & set(kv), "a slot handed to a live request was reused"
    states = []
    while (s := cache.alloc_mamba()) is not None:
        states.append(s)
    assert state not in states, "a state slot handed to a live request was reused"
    cache.free_kv(got)
    for s in states:
        cache.free_mamba(s)


class Index:
    """A user integer: only `__index__`."""

    def __init__(self, v: int) -> None:
        self.v = v

    def __index__(self) -> int:
        return self.v


def run_child(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Runs `code` in a fresh interpreter (radixcache and numpy imported as rc, np), with
    `env` added to the environment: for inputs that once crashed the process, so that a
    regression fails a test instead of killing the test run."""
    src = "import sys\nimport numpy as np\nimport radixcache as rc\n" + textwrap.dedent(code)
    return subprocess.run(
        [sys.executable, "-c", src],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, **(env or {})},
    )


def assert_child_ok(child: subprocess.CompletedProcess[str]) -> None:
    assert child.returncode == 0, f"child died ({child.returncode}):\n{child.stderr}"
    assert "panicked" not in child.stderr
    assert "PanicException" not in child.stderr


def cuda() -> tuple[Any, str]:
    """CuPy and an empty string when a CUDA device is usable, else None and why not (the
    reason the GPU tests give when they skip)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            cupy = importlib.import_module("cupy")
        except ImportError as e:
            return None, f"CuPy is not installed ({e})"
        try:
            n = cupy.cuda.runtime.getDeviceCount()
        except Exception as e:
            return None, f"no usable CUDA device ({type(e).__name__}: {e})"
    return (cupy, "") if n else (None, "no CUDA device")


#: Tests that run one end-to-end scenario over a grid of configurations (page sizes,
#: write policies, failure rates, broken engines). They drive the same compiled core and
#: the same pure-Python scheduler on every interpreter.
#: The eviction policies a property machine runs under, one drawn per run: each name for
#: every component, and mixes per component.
EVICTION_POLICIES = st.sampled_from(
    [
        "lru",
        "lfu",
        "priority",
        "state-value",
        {"kv": "lfu", "mamba": "state-value"},
        {"kv": "priority", "mamba": "lfu"},
    ]
)


def priority_of(tokens: Sized) -> int:
    """A priority hint from -1 to 1, varied with the tokens (the machines' requests and
    inserts carry one, so that the "priority" policy sees ties and differences)."""
    return len(tokens) % 3 - 1


def examples(n: int) -> int:
    """Hypothesis examples for a property test that asks for ``n``.

    ``n`` itself, except with ``RADIXCACHE_TEST_GRIDS=first`` (CI's wheel runs on the
    CPythons other than the one that runs the whole suite): a quarter of it there, at
    least ten, enough to exercise the binding on that interpreter while the full count
    runs once.
    """
    if os.environ.get("RADIXCACHE_TEST_GRIDS") == "first":
        return max(10, n // 4)
    return n


CONFIGURATION_GRIDS = frozenset(
    {
        "test_replay_without_a_host_tier_is_exact",
        "test_replay_with_a_host_tier_is_exact",
        "test_the_oracle_catches_a_broken_engine",
        "test_host_machine",
    }
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With ``RADIXCACHE_TEST_GRIDS=first``, run only the first cell of each grid.

    CI sets it for the wheel's runs on the CPythons other than the one that runs the
    whole suite: every other test still runs there, and each grid shows that its
    scenario works on that interpreter, while the grid in full runs once.
    """
    if os.environ.get("RADIXCACHE_TEST_GRIDS") != "first":
        return
    seen: set[str] = set()
    keep: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        name = getattr(item, "originalname", item.name)
        if name in CONFIGURATION_GRIDS:
            if name in seen:
                dropped.append(item)
                continue
            seen.add(name)
        keep.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def load_bench_script(name: str) -> ModuleType:
    """Import ``benches/<name>.py`` (not a package) as module ``name``."""
    path = Path(__file__).resolve().parent.parent / "benches" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while being made
    spec.loader.exec_module(module)
    return module


class EventIndex:
    """A router's index rebuilt only from a cache's KV events: per medium and namespace,
    the page hashes present and the node ends with a state. ``check`` takes the events,
    applies them (a page stored twice, or removed while absent, fails) and compares the
    index with what the cache holds (``_event_contents()``, computed from the nodes)."""

    def __init__(self) -> None:
        self.pages: set[tuple[str, str | None, bytes]] = set()
        self.states: set[tuple[str, str | None, bytes]] = set()

    def check(self, cache: rc.HybridCache) -> None:
        for e in cache.take_events():
            if e.kind == "cleared":
                self.pages.clear()
                self.states.clear()
                continue
            keys = {(e.medium, e.namespace, h) for h in e.hashes}
            assert len(keys) == len(e.hashes), e
            target = self.states if e.kind.startswith("state_") else self.pages
            if e.kind in ("stored", "state_stored"):
                assert not keys & target, f"stored twice: {e!r}"
                target |= keys
            else:
                assert keys <= target, f"removed while absent: {e!r}"
                target -= keys
            if e.kind == "stored":
                assert len(e.token_ids) == len(e.hashes) * e.block_size, e
        pages, states = cache._event_contents()
        assert len(set(pages)) == len(pages)
        assert len(set(states)) == len(states)
        assert self.pages == set(pages), "pages: events and cache disagree"
        assert self.states == set(states), "states: events and cache disagree"


# ---------------------------------------------------------------------- redis-server
# The L3 tests start a real redis-server on a free loopback port; they skip without one
# unless RADIXCACHE_REQUIRE_REDIS=1 (CI), which makes its absence a failure.


def free_port() -> int:
    """Return a loopback port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


#: A Redis Cluster node also listens on its port + 10000 (the cluster bus).
CLUSTER_BUS_OFFSET = 10_000


def free_cluster_port() -> int:
    """Return a loopback port free now whose cluster-bus port is a free port too."""
    while True:
        port = free_port()
        bus = port + CLUSTER_BUS_OFFSET
        if bus > 65_535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", bus))
            except OSError:
                continue
        return port


class RedisServer:
    """A redis-server on loopback in ``dir``; ``stop()`` kills it, ``start()`` again.

    ``cluster``: a node with cluster mode on (`redis_cluster` joins three of them).
    ``password``: the server asks for it (``requirepass``); ``url`` leaves it out.
    """

    def __init__(self, dir: Path, *, cluster: bool = False, password: str | None = None) -> None:
        self.dir = dir
        self.port = free_cluster_port() if cluster else free_port()
        self.cluster = cluster
        self.password = password
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                *("redis-server", "--bind", "127.0.0.1", "--port", str(self.port)),
                *("--save", "", "--appendonly", "no", "--dir", str(self.dir)),
                *(
                    ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf")
                    if self.cluster
                    else ()
                ),
                *(("--requirepass", self.password) if self.password else ()),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while not self.listening():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()  # nothing left running for the collector to warn about
                raise AssertionError(f"redis-server did not start on port {self.port}")
            time.sleep(0.02)

    def listening(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
        except OSError:
            return False
        return True

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def _need_redis(*programs: str) -> None:
    """Skip (fail with RADIXCACHE_REQUIRE_REDIS=1) without one of `programs` on PATH."""
    for program in programs:
        if shutil.which(program) is None:
            if os.environ.get("RADIXCACHE_REQUIRE_REDIS") == "1":
                pytest.fail(f"{program} is not on PATH and RADIXCACHE_REQUIRE_REDIS=1")
            pytest.skip(f"{program} is not on PATH")


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    _need_redis("redis-server")
    server = RedisServer(tmp_path)
    yield server
    server.stop()


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[str]:
    """A three-node Redis Cluster on loopback (every slot served); its store URL."""
    _need_redis("redis-server", "redis-cli")
    nodes = []
    try:
        for i in range(3):
            (tmp_path / f"node{i}").mkdir()
            nodes.append(RedisServer(tmp_path / f"node{i}", cluster=True))
        addrs = [f"127.0.0.1:{n.port}" for n in nodes]
        subprocess.run(
            ["redis-cli", "--cluster", "create", *addrs, "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        deadline = time.monotonic() + 20
        while not all(_cluster_ok(n.port) for n in nodes):
            assert time.monotonic() < deadline, "the Redis Cluster did not come up"
            time.sleep(0.1)
        yield "redis+cluster://" + ",".join(addrs)
    finally:
        for n in nodes:
            n.stop()


def _cluster_ok(port: int) -> bool:
    info = subprocess.run(
        ["redis-cli", "-p", str(port), "cluster", "info"], capture_output=True, text=True
    ).stdout
    return "cluster_state:ok" in info
