"""A store cannot hurt the process: hostile Redis replies through `ObjectStore`.

A fake Redis on loopback (`FakeRedis`, a socket thread) sends what a real server will not:
a bulk length of 9e18, a negative length, a line that never ends, a reply trickled a byte
every 0.1 s, ``-WRONGTYPE`` for one key of a batch. Each call ends in `L3Error` within its
deadline (the calls that once crashed the process run in a child interpreter), saying
why; the other keys of a batch are served; a trickling store opens the tier's breaker.
Against a real ``redis-server``: a list under a page's key is a corrupt object that
``L3Tier.fetch`` counts and deletes, landing the pages before it.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO, Union

import numpy as np
import pytest

from radixcache import Breaker, L3Error, ObjectStore

from conftest import RedisServer, assert_child_ok, run_child
from l3_common import L3Cache

#: What the fake does with a command: the bytes to send, or a function that sends them.
Answer = Union[bytes, Callable[[socket.socket], None]]

#: The frame fields of the objects these tests store: KV pages of one identity.
LABEL: dict[str, Any] = {"kind": "kv", "identity": bytes(32)}

WRONGTYPE = b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n"


def _bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


class FakeRedis:
    """A Redis on a loopback port: an in-memory store (`SET NX`, `GET`, `EXISTS`, `DEL`,
    `PING`, ``CLUSTER SLOTS`` naming itself for every slot) unless `answer` returns
    something for a command. Keys in `lists` hold a list: ``GET`` answers ``-WRONGTYPE``.
    ``close()`` stops it.
    """

    def __init__(self, answer: Callable[[list[bytes]], Answer | None] | None = None) -> None:
        self.answer = answer
        self.data: dict[bytes, bytes] = {}
        self.lists: set[bytes] = set()
        self.commands: list[list[bytes]] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.closed = threading.Event()
        self.connections: list[socket.socket] = []
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    @property
    def cluster_url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.port}"

    def close(self) -> None:
        """Stop: wake the accepting thread (a connection) and the serving ones (shutdown)."""
        self.closed.set()
        socket.create_connection(("127.0.0.1", self.port)).close()
        for con in self.connections:
            with contextlib.suppress(OSError):  # closed already
                con.shutdown(socket.SHUT_RDWR)
        for t in self.threads:
            t.join(10)
            assert not t.is_alive(), "a fake server's thread did not stop"
        self.listener.close()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                con, _ = self.listener.accept()
            except OSError:
                return
            if self.closed.is_set():
                con.close()
                return
            self.connections.append(con)
            t = threading.Thread(target=self._serve, args=(con,), daemon=True)
            self.threads.append(t)
            t.start()

    def _serve(self, con: socket.socket) -> None:
        with con, con.makefile("rb") as r:
            try:
                while not self.closed.is_set():
                    cmd = self._command(r)
                    if cmd is None:
                        return
                    self.commands.append(cmd)
                    answer = self.answer(cmd) if self.answer is not None else None
                    if answer is None:
                        con.sendall(self._normal(cmd))
                    elif isinstance(answer, bytes):
                        con.sendall(answer)
                    else:
                        answer(con)
            except OSError:
                return  # the client went

    @staticmethod
    def _command(r: BinaryIO) -> list[bytes] | None:
        """Read one command (an array of bulk strings); None when the client went."""
        head = r.readline()
        if not head.startswith(b"*"):
            return None
        args = []
        for _ in range(int(head[1:])):
            n = int(r.readline()[1:])
            args.append(r.read(n + 2)[:n])
        return args

    def _normal(self, cmd: list[bytes]) -> bytes:
        name, key = cmd[0].upper(), cmd[1] if len(cmd) > 1 else b""
        there = key in self.data or key in self.lists
        if name == b"PING":
            return b"+PONG\r\n"
        if name in (b"AUTH", b"SELECT", b"ASKING"):
            return b"+OK\r\n"
        if name == b"EXISTS":
            return b":%d\r\n" % there
        if name == b"SET":
            if there:
                return b"$-1\r\n"
            self.data[key] = cmd[2]
            return b"+OK\r\n"
        if name == b"GET":
            if key in self.lists:
                return WRONGTYPE
            return _bulk(self.data[key]) if key in self.data else b"$-1\r\n"
        if name == b"DEL":
            self.lists.discard(key)
            return b":%d\r\n" % (self.data.pop(key, None) is not None or there)
        if name == b"CLUSTER":
            host = _bulk(b"127.0.0.1")
            return b"*1\r\n*3\r\n:0\r\n:16383\r\n*3\r\n%s:%d\r\n$2\r\nid\r\n" % (host, self.port)
        return b"-ERR unknown command\r\n"


@pytest.fixture
def fakes() -> Iterator[Callable[..., FakeRedis]]:
    """Starts fake servers; closes them all at the end."""
    started: list[FakeRedis] = []

    def start(answer: Callable[[list[bytes]], Answer | None] | None = None) -> FakeRedis:
        started.append(FakeRedis(answer))
        return started[-1]

    yield start
    for f in started:
        f.close()


def data_commands(answer: Answer) -> Callable[[list[bytes]], Answer | None]:
    """`answer` to every command but ``CLUSTER`` (the topology stays sane)."""
    return lambda cmd: None if cmd[0] == b"CLUSTER" else answer


def trickle(con: socket.socket) -> None:
    """A byte every 0.1 s of a line that never ends (for 5 s at most)."""
    for _ in range(50):
        time.sleep(0.1)
        con.sendall(b"+")


def flood(con: socket.socket) -> None:
    """A line without an end, as fast as the client reads it (16 MiB at most)."""
    chunk = b"a" * 65536
    con.sendall(b"+")
    for _ in range(256):
        con.sendall(chunk)


def test_hostile_replies_end_in_l3error_within_the_deadline(
    fakes: Callable[..., FakeRedis],
) -> None:
    cases: dict[str, tuple[str, str]] = {}  # name: (url, what the message must say)
    huge = fakes(data_commands(b"$9000000000000000000\r\n"))
    cases["huge bulk length"] = (huge.url, "protocol error: .*over the limit of 536870912")
    negative = fakes(data_commands(b"$-2\r\n"))
    cases["negative length"] = (negative.url, "protocol error: .*negative length -2")
    endless = fakes(data_commands(flood))
    cases["endless line"] = (endless.url, "protocol error: .*longer than 65536 bytes")
    slow = fakes(data_commands(trickle))
    cases["trickle"] = (slow.url, "timed out: .*the call's deadline passed")
    cases["trickle, cluster"] = (slow.cluster_url, "timed out: .*the call's deadline passed")
    # The calls run in a child: before these were bounded, the first aborted the process
    # and the third filled its memory.
    child = run_child(
        f"""
        import json, time
        out = {{}}
        for name, url in {json.dumps({k: v[0] for k, v in cases.items()})}.items():
            store = rc.ObjectStore(url, timeout_ms=200)
            t = time.monotonic()
            try:
                store.exists([b"k"])
                out[name] = ("no error", 0.0)
            except rc.L3Error as e:
                out[name] = (str(e), time.monotonic() - t)
        print(json.dumps(out))
        """
    )
    assert_child_ok(child)
    got = json.loads(child.stdout)
    for name, (_, pattern) in cases.items():
        message, took = got[name]
        assert re.search(pattern, message), f"{name}: {message}"
        # Within the deadline: 200 ms, plus 200 ms for connecting.
        assert took < 1.5, f"{name}: {took:.2f} s"


def test_a_key_of_another_type_is_corrupt_and_deleted_and_the_rest_served(
    fakes: Callable[..., FakeRedis],
) -> None:
    fake = fakes()
    for url in (fake.url, fake.cluster_url):
        store = ObjectStore(url, timeout_ms=500)
        keys = [f"{url}:{i}".encode() for i in range(3)]
        hashes = [bytes([i + 1]) * 32 for i in range(3)]
        data = np.arange(3 * 64, dtype=np.uint8).reshape(3, 64)
        assert store.put(keys, hashes, data, **LABEL) == [True] * 3
        # Key 1 now holds a list.
        del fake.data[keys[1]]
        fake.lists.add(keys[1])
        out = np.zeros_like(data)
        assert store.get_into(keys, hashes, out, **LABEL) == ["ok", "corrupt", "ok"]
        assert np.array_equal(out[[0, 2]], data[[0, 2]])
        assert not out[1].any()
        assert fake.commands[-1] == [b"DEL", keys[1]]
        assert store.exists(keys) == [True, False, True]


def test_a_failed_call_says_why(fakes: Callable[..., FakeRedis]) -> None:
    refused = socket.create_server(("127.0.0.1", 0))
    port = refused.getsockname()[1]
    refused.close()
    with pytest.raises(L3Error, match=r"^exists failed: connection refused: connecting to "):
        ObjectStore(f"redis://127.0.0.1:{port}").exists([b"k"])
    wrongpass = fakes(
        lambda cmd: b"-WRONGPASS invalid username-password pair\r\n" if cmd[0] == b"AUTH" else None
    )
    with pytest.raises(L3Error, match=r"^exists failed: authentication failed: .*WRONGPASS"):
        ObjectStore(f"redis://:nope@127.0.0.1:{wrongpass.port}").exists([b"k"])
    bad_db = fakes(
        lambda cmd: b"-ERR DB index is out of range\r\n" if cmd[0] == b"SELECT" else None
    )
    with pytest.raises(L3Error, match=r"^exists failed: bad database: .*out of range"):
        ObjectStore(f"{bad_db.url}/99").exists([b"k"])


def _redis(port: int, *args: bytes) -> bytes:
    """One command to the Redis at `port`; its reply's first line."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"*%d\r\n" % len(args) + b"".join(_bulk(a) for a in args))
        return s.makefile("rb").readline().rstrip()


def test_a_list_under_a_pages_key_is_a_corrupt_object_the_fetch_deletes(
    redis_server: RedisServer,
) -> None:
    tokens = list(range(100, 124))  # six pages of 4
    a = L3Cache(ObjectStore(redis_server.url), hybrid=False)
    b = L3Cache(ObjectStore(redis_server.url), hybrid=False)
    a.compute(tokens, np.random.default_rng(0))
    a.settle()
    key = a.tier.identity.key("kv", a.cache.chain_hashes(tokens)[3])
    assert _redis(redis_server.port, b"DEL", key) == b":1"
    assert _redis(redis_server.port, b"RPUSH", key, b"not a page") == b":1"
    assert b.tier.lookup(tokens) == 6, "the list is there"
    assert b.tier.fetch(tokens) == 12, "pages 0-2 landed, 3 was a list"
    assert b.tier.counters.corrupt_objects == 1
    assert b.tier.counters.errors == 0
    assert b.cache.stats()["l3_gone_objects"] == 1
    assert _redis(redis_server.port, b"EXISTS", key) == b":0", "deleted"
    b.cache.audit()


def test_a_trickling_store_opens_the_breaker_within_a_few_deadlines(
    fakes: Callable[..., FakeRedis],
) -> None:
    slow = fakes(data_commands(trickle))
    a = L3Cache(ObjectStore(slow.url, timeout_ms=100), hybrid=False)
    a.tier.breaker = Breaker(threshold=2, cooldown_ms=60_000)
    tokens = list(range(100, 124))
    t = time.monotonic()
    for _ in range(3):
        assert a.tier.lookup(tokens) == 0, "a failed lookup is a miss"
    took = time.monotonic() - t
    assert a.tier.breaker.state == "open"
    assert a.tier.counters.errors == 2
    assert a.tier.counters.skipped_open == 1
    # Two calls of about 100 ms (+100 ms for connecting), the third refused at once.
    assert took < 1.5, f"{took:.2f} s"
