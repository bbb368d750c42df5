"""Hypothesis state machine over the host tier and load-backs.

Two configurations, attention-only (a host KV tier) and hybrid (device and host Mamba
pools too), each under every write policy and page sizes 1 and 2, with small pools
(device KV 16-32 tokens, host KV 16-48, 2-5 states on each tier) and a small alphabet
with shared prefixes, so that eviction, demotion to the host, host eviction and
load-backs happen often.

Rules: admit, serve (admit, load back what the host has, run the forward, finish, as a
scheduler does), extend (the forward: it fills the slots it got), checkpoint, finish,
abort or drop a request; evict (alone, or under memory pressure with the engine running
the backups); take the batches the cache emits and start, complete or fail them in any
order; load back a request or a matched ``host_node`` (with or without ``request=``,
under a random ``mem_quota``), or two overlapping paths at once; and for each guard:
start its batch, commit, release, leave its ``with`` block by an exception (after a
commit or not), complete or fail its batch before or after the commit, or drop it
without a release (a ``ResourceWarning``). Documented misuse must raise and change
nothing.

After every step: ``audit()``, and a data oracle. The test keeps the contents of the four
pools (device and host, KV and states): a slot the forward computed holds the token
prefix it was computed for, a batch's copies move contents only when the test completes
the batch (a failed copy leaves garbage), and a freshly handed-out destination holds
garbage until its copy lands. Whatever the cache hands out for use (a match, a request's
KV and state, the sources of a copy) must hold exactly the right contents, and a copy's
sources must not change while it may run. At the end: nothing leaks.
"""

from __future__ import annotations

import gc
import re
import sys
import warnings
from dataclasses import dataclass
from typing import ClassVar, TypeVar

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import radixcache as rc

from conftest import (
    EVICTION_POLICIES,
    EventIndex,
    assert_pool_sums,
    examples,
    fingerprint,
    priority_of,
)

pytestmark = pytest.mark.slow

SYSTEM = [[5, 6, 7, 8, 9, 10], [5, 6, 11, 12]]
NAMESPACES = st.sampled_from([None, None, None, "a"])
POLICIES = ["write_through", "write_through_selective", "write_back"]
QUOTAS = st.sampled_from([None, None, None, 0, 2, 4, 6])
MAX_LIVE = 3
MAX_GUARDS = 3

#: What a slot holds: ("kv", ns, prefix) for the KV of the last token of prefix,
#: ("state", ns, prefix) for the state after prefix. A slot missing from a pool's
#: dict holds garbage.
Value = tuple[object, ...]
Pool = tuple[str, str]  # (pool, tier)
T = TypeVar("T")
POOLS: list[Pool] = [("kv", "device"), ("kv", "host"), ("mamba", "device"), ("mamba", "host")]


class Boom(Exception):
    """Raised inside a guard's ``with`` block (the engine failed)."""


def kv_value(ns: str | None, tokens: list[int], p: int) -> Value:
    return ("kv", ns, tuple(tokens[: p + 1]))


def state_value(ns: str | None, tokens: list[int]) -> Value:
    return ("state", ns, tuple(tokens))


#: stats() gauges of the host tier (fingerprint() covers the device ones).
HOST_GAUGES = (
    "host_kv_cached_tokens",
    "host_kv_free_slots",
    "host_mamba_cached_states",
    "host_mamba_free_slots",
    "load_backs_pending",
)


def snapshot(cache: rc.HybridCache) -> tuple[object, ...]:
    """fingerprint() plus the host tier's gauges (audits the cache; changes nothing)."""
    stats = cache.stats()
    return (fingerprint(cache), tuple(stats[k] for k in HOST_GAUGES))


def ints(a: np.ndarray) -> list[int]:
    return [int(x) for x in a]


@dataclass
class Move:
    """One copy of a batch."""

    pool: str
    src_tier: str
    dst_tier: str
    src: list[int]
    dst: list[int]


@dataclass
class Req:
    handle: rc.Request | None
    ns: str | None
    tokens: list[int]
    #: The path to the host_node its admission found (what load_back(request) loads), or
    #: None when there was none or a committed load cleared it.
    host_path: list[int] | None
    #: The admission match on any tier (tokens[:branch_len]): docs/contract.md rule 9's sequence.
    admitted: list[int]
    copy: int | None = None  # admission copy batch, until acknowledged
    load: Guard | None = None  # a load-back of it, until released or acknowledged

    @property
    def live(self) -> bool:
        return self.handle is not None


@dataclass
class Guard:
    lb: rc.LoadBack | None
    bid: int
    ns: str | None
    path: list[int]  # tokens of the path to the target node
    kv_tokens: int
    req: Req | None
    #: The request as it was at load_back: (tokens, mamba_slot, host_path).
    before: tuple[list[int], int | None, list[int] | None] = ([], None, None)
    req_slot: int | None = None  # the request's fresh state slot
    states: int = 0  # state slots it took (hybrid: restore, and the request's)
    state: str = "held"  # "held" | "committed" | "released"
    acked: str | None = None  # "complete" | "fail", once its batch is acknowledged


@dataclass
class Batch:
    bid: int
    kind: str
    moves: list[Move]
    #: Source contents when the batch was taken: a source is held by the batch, so
    #: nothing may change it until the batch is acknowledged.
    sources: list[list[Value | None]]
    started: bool = False
    #: Source contents read when the engine ran the copies early (a checkpoint copy
    #: runs before the request's next forward step overwrites its state).
    snap: list[list[Value | None]] | None = None
    guard: Guard | None = None
    #: The object that owns a taken batch (None for a load-back's: its guard owns it).
    obj: rc.TransferBatch | None = None


class HostMachine(RuleBasedStateMachine):
    """Requests, batches and load-backs over a cache with a host tier."""

    #: The configuration (a subclass per test case sets them).
    hybrid: ClassVar[bool] = False
    policy: ClassVar[str] = "write_through"
    ps: ClassVar[int] = 1

    def __init__(self) -> None:
        super().__init__()
        self.reqs: list[Req] = []
        self.pending: dict[int, Batch] = {}
        self.guards: list[Guard] = []
        self.seen: list[tuple[str | None, list[int]]] = []
        self.handles: list[tuple[rc.Node, str | None, list[int]]] = []
        self.mem: dict[Pool, dict[int, Value]] = {p: {} for p in POOLS}
        self.ids: set[int] = set()
        #: Admission copies not taken yet: batch id -> (namespace, the reused prefix).
        self.admissions: dict[int, tuple[str | None, list[int]]] = {}

    @initialize(
        kv_slots=st.sampled_from([16, 16, 20, 24, 32]),
        host_kv_slots=st.sampled_from([16, 16, 20, 24, 32, 48]),
        states=st.integers(2, 5),
        host_states=st.integers(2, 5),
        policy=EVICTION_POLICIES,
    )
    def build(
        self,
        kv_slots: int,
        host_kv_slots: int,
        states: int,
        host_states: int,
        policy: str | dict[str, str],
    ) -> None:
        """Small pools (multiples of both page sizes), so that everything overflows."""
        ps = self.ps
        self.kv_slots = kv_slots
        self.host_kv_slots = host_kv_slots
        self.states = states if self.hybrid else 0
        self.host_states = host_states if self.hybrid else 0
        self.cache = rc.HybridCache(
            kv_slots=self.kv_slots,
            page_size=ps,
            mamba_slots=self.states,
            host_kv_slots=self.host_kv_slots,
            host_mamba_slots=self.host_states,
            write_policy=self.policy,
            eviction_policy=policy,
            page_hashes=True,
            events=True,
        )
        self.events = EventIndex()

    # ------------------------------------------------------------------ helpers

    def aligned(self, n: int) -> int:
        return n // self.ps * self.ps

    def live(self) -> list[Req]:
        return [r for r in self.reqs if r.live]

    def held_guards(self) -> list[Guard]:
        """Guards the test still has (held, or committed or released and kept around)."""
        return [g for g in self.guards if g.lb is not None]

    def pick(self, data: st.DataObject, items: list[T]) -> T:
        """One of `items`, drawn by index: Hypothesis keeps what it draws for its report,
        and a request or guard it kept could not be garbage-collected."""
        return items[data.draw(st.integers(0, len(items) - 1))]

    def count(self, what: str) -> None:
        """Record an outcome as a Hypothesis event (how often each one comes up shows in
        the statistics of a run of ``HostMachine.TestCase``)."""
        event(what)

    def read(self, pool: str, tier: str, slots: list[int]) -> list[Value | None]:
        mem = self.mem[(pool, tier)]
        return [mem.get(s) for s in slots]

    def write(self, pool: str, tier: str, slots: list[int], values: list[Value | None]) -> None:
        mem = self.mem[(pool, tier)]
        for s, v in zip(slots, values):
            if v is None:
                mem.pop(s, None)
            else:
                mem[s] = v

    def garble(self, pool: str, tier: str, slots: list[int]) -> None:
        self.write(pool, tier, slots, [None] * len(slots))

    def refused(self, before: tuple[object, ...], held: tuple[int, ...], what: str) -> None:
        """A refused allocation took nothing. Under write-back it may have started to
        demote (docs/contract.md rule 11: the slots free when the backups complete), nothing
        else."""
        if snapshot(self.cache) == before:
            return
        assert self.policy == "write_back", f"a refused {what} changed the cache"
        now = self.holdings()
        assert now == held, f"a refused {what} took slots: {held} -> {now}"
        self.take()
        assert any(b.kind == "backup" for b in self.pending.values())

    def holdings(self) -> tuple[int, ...]:
        """What requests, callers and guards hold."""
        s = self.cache.stats()
        keys = ("live_requests", "kv_request_slots", "kv_caller_slots", "mamba_request_slots")
        return (*(s[k] for k in keys), s["load_backs_pending"])

    def check_kv(self, ns: str | None, tokens: list[int], kv: list[int], what: str) -> None:
        assert len(kv) <= len(tokens)
        got = self.read("kv", "device", kv)
        want = [kv_value(ns, tokens, p) for p in range(len(kv))]
        assert got == want, f"{what}: KV slots {kv} hold wrong data for {tokens} (ns={ns})"

    def check_state(self, ns: str | None, tokens: list[int], slot: int, what: str) -> None:
        got = self.mem[("mamba", "device")].get(slot)
        want = state_value(ns, tokens)
        assert got == want, f"{what}: state slot {slot} holds {got}, not {want}"

    def check_request(self, r: Req, what: str) -> None:
        """What a forward step of `r` reads must be right."""
        h = r.handle
        assert h is not None
        kv = ints(h.kv_indices)
        assert len(kv) == len(r.tokens)
        self.check_kv(r.ns, r.tokens, kv, what)
        if not self.hybrid:
            assert h.mamba_slot is None
        elif r.tokens:
            slot = h.mamba_slot
            assert slot is not None, f"{what}: a request with {len(r.tokens)} tokens, no state"
            self.check_state(r.ns, r.tokens, slot, what)

    def check_match(self, ns: str | None, tokens: list[int]) -> rc.Match:
        m = self.cache.match_prefix(tokens, namespace=ns)
        n = m.device_len
        assert n % self.ps == 0
        assert n + m.host_len <= self.aligned(len(tokens))
        assert n <= m.kv_len <= self.aligned(len(tokens))
        kv = ints(m.kv_indices)
        assert len(kv) == n
        self.check_kv(ns, tokens, kv, "match")
        if m.host_len == 0:
            assert m.host_node == m.node
        if not self.hybrid or n == 0:
            assert m.mamba_slot is None
        else:
            assert m.mamba_slot is not None
            self.check_state(ns, tokens[:n], m.mamba_slot, "match")
        if m.host_len > 0:
            self.count("match: a host hit")
        return m

    def remember(self, ns: str | None, tokens: list[int]) -> None:
        if tokens and (ns, tokens) not in self.seen:
            self.seen = [*self.seen[-11:], (ns, list(tokens))]

    def sequence(self, data: st.DataObject) -> tuple[str | None, list[int]]:
        """A namespace and tokens: often a sequence cached before, cut or continued."""
        if self.seen and data.draw(st.integers(0, 3)) < 3:
            ns, base = self.pick(data, self.seen)
            cut = data.draw(st.integers(0, len(base)))
            tail = data.draw(st.lists(st.integers(0, 2), max_size=3))
            return ns, base[: len(base) - cut // 2] + tail
        head = data.draw(st.sampled_from([*SYSTEM, []]))
        head = head[: len(head) - data.draw(st.integers(0, 3))]
        tail = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=4))
        return data.draw(NAMESPACES), head + tail

    # ----------------------------------------------------------------- batches

    def take(self) -> None:
        """Take what the cache emitted (copy-on-write, backups) into the pending list."""
        for b in self.cache.take_batches():
            bid = b.id
            assert bid not in self.ids, "batch ids are never reused"
            self.ids.add(bid)
            moves = [
                Move(c.pool, c.src_tier, c.dst_tier, ints(c.src), ints(c.dst)) for c in b.copies
            ]
            for mv in moves:
                assert len(mv.src) == len(mv.dst)
            sources = [self.read(mv.pool, mv.src_tier, mv.src) for mv in moves]
            if b.kind == "cow":
                assert self.hybrid
                (mv,) = moves
                assert (mv.pool, mv.src_tier, mv.dst_tier) == ("mamba", "device", "device")
                assert len(mv.src) == 1
                if bid in self.admissions:
                    # An admission copy: the cached state of the reused prefix (the request
                    # may be gone already).
                    ns, prefix = self.admissions.pop(bid)
                    self.check_state(ns, prefix, mv.src[0], "copy-on-write source")
                else:
                    # A checkpoint's copy (taken at once): the request's state, for the tree.
                    (r,) = [r for r in self.live() if r.handle and r.handle.mamba_slot in mv.src]
                    self.check_state(r.ns, r.tokens, mv.src[0], "checkpoint copy source")
            else:
                assert b.kind == "backup", f"take_batches gave a {b.kind} batch"
                assert moves, "an empty backup"
                for mv, vals in zip(moves, sources):
                    assert (mv.src_tier, mv.dst_tier) == ("device", "host")
                    assert mv.pool == "kv" or self.hybrid
                    assert None not in vals, f"a backup reads unfilled slots {mv.src}"
            for mv in moves:
                self.garble(mv.pool, mv.dst_tier, mv.dst)
            self.pending[bid] = Batch(bid, b.kind, moves, sources, obj=b)

    def run_readers(self, slot: int | None) -> None:
        """The engine runs every copy reading the state `slot` (before the forward step
        of its request overwrites it): started now, acknowledged later."""
        if slot is None:
            return
        for b in self.pending.values():
            reads = any(
                mv.pool == "mamba" and mv.src_tier == "device" and slot in mv.src for mv in b.moves
            )
            if reads and b.snap is None:
                self.do_start(b)
                b.snap = [self.read(mv.pool, mv.src_tier, mv.src) for mv in b.moves]

    def do_start(self, b: Batch, via_object: bool = False) -> None:
        start = b.obj.start if via_object and b.obj else lambda: self.cache.start(b.bid)
        if b.started:
            # A second start is refused and changes nothing.
            before = snapshot(self.cache)
            with pytest.raises(rc.CacheError, match="was started already"):
                start()
            assert snapshot(self.cache) == before
            return
        start()
        b.started = True

    def do_ack(self, bid: int, how: str, via_object: bool = False) -> None:
        """Start (maybe), then complete or fail a pending batch, and follow its effects:
        by id, or through the batch's object when it has one and `via_object`. `drop`:
        the object of a batch never started is collected, which fails the batch."""
        b = self.pending.pop(bid)
        obj, b.obj = b.obj, None
        via_object = via_object and obj is not None
        if how == "drop":
            assert obj is not None
            assert not b.started
        if how.startswith("start"):
            b.obj = obj
            self.do_start(b, via_object)
            b.obj = None
        ok = how.endswith("complete")
        if ok:
            if via_object and obj is not None:
                obj.complete()
            else:
                self.cache.complete(bid)
            if b.snap is not None:
                values = b.snap
            else:
                values = [self.read(mv.pool, mv.src_tier, mv.src) for mv in b.moves]
                assert values == b.sources, f"a source of batch {bid} changed while it ran"
            for mv, vals in zip(b.moves, values):
                self.write(mv.pool, mv.dst_tier, mv.dst, vals)
        elif how == "drop":
            warned = pytest.warns(ResourceWarning, match=rf"TransferBatch {bid} .*; failed it")
            with warned:
                del obj
                gc.collect()  # in case a cycle (a traceback's frame) still holds it
            for mv in b.moves:
                self.garble(mv.pool, mv.dst_tier, mv.dst)
        else:
            if via_object and obj is not None:
                with pytest.raises(RuntimeError, match="copy kernel"), obj:
                    raise RuntimeError("copy kernel")  # leaving the block fails the batch
                assert obj.outcome == "failed"
                assert obj.reason is not None
                assert "copy kernel" in obj.reason
            else:
                self.cache.fail(bid)
            for mv in b.moves:
                self.garble(mv.pool, mv.dst_tier, mv.dst)
        if b.kind == "cow":
            owner = [r for r in self.live() if r.copy == bid]
            for r in owner:
                r.copy = None
                h = r.handle
                assert h is not None
                assert h.copy_pending is None
                if not ok:
                    # Rule 10: back to nothing reused.
                    view = (h.prefix_len, len(h.tokens), h.mamba_slot)
                    assert view == (0, 0, None)
                    r.tokens = []
        elif b.kind == "load_back":
            g = b.guard
            assert g is not None
            g.acked = "complete" if ok else "fail"
            if g.state == "committed":
                self.settle(g, ok)

    def settle(self, g: Guard, ok: bool) -> None:
        """A committed load's copies were acknowledged (complete or fail)."""
        r = g.req
        self.count("load-back landed" if ok else "load-back failed after commit")
        if r is not None and r.live and r.load is g:
            r.load = None
            h = r.handle
            assert h is not None
            if not ok:
                # A failed load is a miss: the request goes back to what it was.
                r.tokens = list(g.before[0])
                r.host_path = g.before[2]
                assert h.mamba_slot == g.before[1]
            else:
                assert h.mamba_slot == g.req_slot
            assert h.load_pending is None
            assert h.prefix_len == len(r.tokens)
        m = self.check_match(g.ns, g.path)
        if ok and (g.states or not self.hybrid):
            # Visible now, in full: the path is locked or was just unlocked.
            assert m.device_len == len(g.path), "a completed load-back is not visible"

    # --------------------------------------------------------------- load-back

    def load_expectation(
        self, r: Req | None, ns: str | None, path: list[int] | None, kind: str
    ) -> tuple[tuple[type[Exception], str] | None, list[tuple[type[Exception], str]], bool]:
        """What a load_back must do: the documented error it must raise (or None),
        errors that may come or not (the node may be gone, or may have lost its states:
        the test cannot tell), and whether it must load nothing (return None).

        `kind`: "request" (a Request target), "fresh" (a node just matched) or "old" (a
        node handle kept from earlier)."""
        allowed: list[tuple[type[Exception], str]] = []
        if kind == "old":
            allowed.append((rc.StaleNodeError, ""))
        if r is None:
            return None, allowed, False
        h = r.handle
        assert h is not None
        if self.hybrid and kind != "fresh":
            allowed.append((ValueError, "no Mamba state"))
        if r.copy is not None:
            return (rc.CacheError, "state copy"), allowed, False
        if r.load is not None:
            return (rc.CacheError, "load-back"), allowed, False
        if len(r.tokens) != h.prefix_len:
            return (ValueError, "extended past its reused prefix"), allowed, False
        if path is None:
            assert kind == "request"
            return None, allowed, True  # nothing on the host at admission
        # Rule 9: the node must be on the sequence the request was admitted for, in its
        # namespace, on the path through the request's own node (at, below or above it:
        # above it there is nothing to load for the request).
        on_path = path == r.tokens[: len(path)] or r.tokens == path[: len(r.tokens)]
        if ns != r.ns or path != r.admitted[: len(path)] or not on_path:
            error = (ValueError, "not admitted for a sequence through this node")
            if kind == "request":
                # Unless the node is gone: then there is nothing to load.
                allowed.append(error)
                return None, allowed, True
            return error, allowed, False
        above = len(path) < len(r.tokens)
        if not path:
            # A root: nothing to load (or, hybrid, no state to run from).
            allowed.append((ValueError, "no Mamba state"))
            return None, allowed, True
        return None, allowed, above

    def do_load_back(
        self,
        target: rc.Node | rc.Request,
        ns: str | None,
        path: list[int] | None,
        r: Req | None,
        quota: int | None,
        *,
        fresh: bool,
        by_request: bool,
    ) -> Guard | None:
        """load_back, checked: misuse raises and changes nothing; a None result takes
        nothing; a guard reads the right host data and holds fresh destinations."""
        c = self.cache
        before, held = snapshot(c), self.holdings()
        protected = c.protected_size()
        s0 = c.stats()
        view = None
        if r is not None:
            assert r.handle is not None
            view = (ints(r.handle.tokens), r.handle.prefix_len, r.handle.mamba_slot)
        kind = "request" if by_request else "fresh" if fresh else "old"
        expected, allowed, nothing = self.load_expectation(r, ns, path, kind)
        error: Exception | None = None
        lb: rc.LoadBack | None = None
        try:
            if by_request:
                assert r is not None
                assert r.handle is not None
                lb = c.load_back(r.handle, mem_quota=quota)
            else:
                req = r.handle if r is not None else None
                lb = c.load_back(target, mem_quota=quota, request=req)
        except (ValueError, rc.CacheError) as e:
            error = e
        if error is not None:
            assert snapshot(c) == before, "a refused load_back changed the cache"
            message = str(error)
            if expected is not None and type(error) is expected[0]:
                assert re.search(expected[1], message), message
            else:
                ok = any(type(error) is t and re.search(p, message) for t, p in allowed)
                assert ok, f"unexpected {type(error).__name__}: {message} (expected {expected})"
            self.count(f"load_back({kind}): {type(error).__name__}")
            return None
        assert expected is None, f"load_back did not raise {expected}"
        assert lb is None or not nothing, "a load-back with nothing to load for the request"
        if lb is None:
            after = c.stats()
            why = [k for k in after if k.startswith("load_backs_called_off_") and after[k] != s0[k]]
            self.count(f"load_back({kind}): None, {why[-1].rsplit('_', 1)[-1]}")
            self.refused(before, held, "load_back")
            assert after["load_backs_called_off"] == s0["load_backs_called_off"] + 1
            assert len(why) == 1
            if r is not None:
                assert r.handle is not None
                assert r.handle.load_pending is None
            return None
        assert path is not None, "load_back loaded for a request with nothing on the host"
        self.count(f"load_back({kind}): a guard")
        assert lb.held
        assert not lb.committed
        batch = lb.batch
        bid = batch.id
        assert batch.kind == "load_back"
        assert bid not in self.ids, "batch ids are never reused"
        self.ids.add(bid)
        moves = [
            Move(x.pool, x.src_tier, x.dst_tier, ints(x.src), ints(x.dst)) for x in batch.copies
        ]
        for mv in moves:
            assert (mv.src_tier, mv.dst_tier) == ("host", "device")
            assert len(mv.src) == len(mv.dst)
        kv_moves = [mv for mv in moves if mv.pool == "kv"]
        st_moves = [mv for mv in moves if mv.pool == "mamba"]
        kv_n = sum(len(mv.src) for mv in kv_moves)
        assert kv_n == lb.kv_tokens
        assert kv_n % self.ps == 0
        assert kv_n > 0 or st_moves, "a load-back with nothing to load"
        end = len(path)
        assert kv_n <= end
        if quota is not None:
            assert kv_n <= quota + c.protected_size() - protected, "mem_quota exceeded"
        # The host data read must be the path's: the KV of the host-only suffix, and the
        # state at its end.
        src_kv = [s for mv in kv_moves for s in mv.src]
        got = self.read("kv", "host", src_kv)
        want = [kv_value(ns, path, p) for p in range(end - kv_n, end)]
        assert got == want, f"load-back reads wrong host KV {src_kv} for {path}"
        dst_kv = [s for mv in kv_moves for s in mv.dst]
        assert len(set(dst_kv)) == len(dst_kv)
        if not self.hybrid:
            assert not st_moves
        elif r is not None:
            assert len(st_moves) == 2, "a hybrid load for a request takes two state slots"
        else:
            assert len(st_moves) <= 1
        for mv in st_moves:
            assert len(mv.src) == 1
            value = self.mem[("mamba", "host")].get(mv.src[0])
            assert value == state_value(ns, path), f"load-back reads host state {value}"
        req_slot = st_moves[1].dst[0] if len(st_moves) == 2 else None
        if st_moves:
            assert len({mv.dst[0] for mv in st_moves}) == len(st_moves)
        sources = [self.read(mv.pool, mv.src_tier, mv.src) for mv in moves]
        for mv in moves:
            self.garble(mv.pool, mv.dst_tier, mv.dst)
        g = Guard(lb, bid, ns, list(path), kv_n, r, states=len(st_moves))
        if r is not None:
            h = r.handle
            assert h is not None
            assert view is not None
            # Nothing changes for the request until commit (docs/contract.md rule 8: its own
            # slot stays).
            assert (ints(h.tokens), h.prefix_len, h.mamba_slot) == view
            assert h.load_pending == bid
            assert req_slot is None or req_slot != h.mamba_slot
            g.before = (list(r.tokens), h.mamba_slot, r.host_path)
            g.req_slot = req_slot
            r.load = g
        self.pending[bid] = Batch(bid, "load_back", moves, sources, guard=g)
        # Guards that hold nothing any more are kept a while (to commit or release
        # again), then let go.
        done = [x for x in self.guards if x.state != "held"]
        for x in done[: max(0, len(done) - 3)]:
            x.lb = None
            self.guards.remove(x)
        self.guards.append(g)
        return g

    def available(self) -> tuple[int, int]:
        return self.cache.available_kv(), self.cache.available_mamba()

    def forget(self, g: Guard, before: tuple[int, int]) -> None:
        """A guard gave everything back uncommitted (release, with block, commit error,
        garbage collection): at once when its batch never started or was acknowledged
        (an unstarted batch is withdrawn), else when the batch is (it drains).
        `before`: the free device slots before it let go."""
        g.state = "released"
        b = self.pending.get(g.bid)
        if b is not None and not b.started:
            del self.pending[g.bid]
        freed = (g.kv_tokens, g.states) if b is None or not b.started else (0, 0)
        now = self.available()
        got = (now[0] - before[0], now[1] - before[1])
        assert got == freed, f"a called-off load-back freed {got}, not {freed}"
        r = g.req
        if r is not None and r.load is g:
            r.load = None
            if r.live:
                h = r.handle
                assert h is not None
                assert h.load_pending is None
                if r.tokens == g.before[0]:
                    assert h.mamba_slot == g.before[1], "a called-off load changed the state"
                assert h.mamba_slot is None or h.mamba_slot != g.req_slot

    def commit_expectation(self, g: Guard) -> str | None:
        if g.state == "committed":
            return "committed already"
        if g.state == "released":
            return "released already"
        if g.acked == "fail":
            return "copies failed"
        r = g.req
        if r is not None and r.live and r.tokens != g.before[0]:
            return "extended since"
        return None

    def landing(self, g: Guard) -> bool:
        """Whether another committed load-back, its copies not acknowledged yet, put
        pages into nodes on `g`'s path (they are marked loading)."""
        for b in self.pending.values():
            o = b.guard
            if o is None or o is g or o.state != "committed" or o.ns != g.ns:
                continue
            common = 0
            for x, y in zip(o.path, g.path):
                if x != y:
                    break
                common += 1
            if common > len(o.path) - o.kv_tokens:
                return True
        return False

    def do_commit(self, g: Guard) -> None:
        lb = g.lb
        assert lb is not None
        c = self.cache
        expected = self.commit_expectation(g)
        if expected is None and self.landing(g):
            # Committing below a load still landing may be refused (its guard is then
            # released); if it is not, the oracle checks what the two loads publish.
            avail = self.available()
            refusal = ""
            try:
                lb.commit()
            except rc.CacheError as e:
                refusal = str(e)
            if refusal:
                self.count("commit: refused, another load-back is landing")
                assert "still landing" in refusal, refusal
                assert not lb.held
                assert not lb.committed
                self.forget(g, avail)
                return
            self.committed(g)
            return
        if expected is not None:
            before, avail = snapshot(c), self.available()
            with pytest.raises(rc.CacheError, match=expected):
                lb.commit()
            if g.state == "held":
                # The guard is released by the failed commit.
                assert not lb.held
                self.forget(g, avail)
            else:
                assert snapshot(c) == before
            return
        lb.commit()
        self.committed(g)

    def committed(self, g: Guard) -> None:
        """`g` was committed: the request moves to the target."""
        lb = g.lb
        assert lb is not None
        assert lb.committed
        assert not lb.held
        self.count("load-back committed")
        g.state = "committed"
        r = g.req
        if r is not None and r.live:
            h = r.handle
            assert h is not None
            r.tokens = list(g.path)
            r.host_path = None
            assert (ints(h.tokens), h.prefix_len, h.host_len) == (g.path, len(g.path), 0)
            if self.hybrid:
                assert h.mamba_slot == g.req_slot
        else:
            # The request ended meanwhile: the load publishes the nodes only.
            r = None
        if g.acked is not None:
            # Its copies landed already: settled at once.
            assert g.acked == "complete"
            self.settle(g, True)
        elif r is not None:
            assert r.handle is not None
            assert r.handle.load_pending == g.bid

    def release(self, g: Guard, how: str) -> None:
        """release(), or leave the with block by an exception (committing first when
        `how` says so and the commit may succeed)."""
        lb = g.lb
        assert lb is not None
        c = self.cache
        avail = self.available()
        if how == "release":
            before = snapshot(c)
            lb.release()
            if g.state != "held":
                assert snapshot(c) == before, "release after the end changed the cache"
        else:
            commit = how == "with_commit" and self.commit_expectation(g) is None
            with pytest.raises(Boom):
                self.run_and_raise(g, commit)
        assert not lb.held
        if g.state == "held":
            self.forget(g, avail)

    @staticmethod
    def drop(r: Req) -> None:
        """`del` the only reference to a request's handle, and collect."""
        r.handle = None
        gc.collect()

    def run_and_raise(self, g: Guard, commit: bool) -> None:
        """The engine fails inside the guard's with block (after the commit, maybe)."""
        assert g.lb is not None
        with g.lb:
            if commit:
                self.do_commit(g)
            raise Boom

    # -------------------------------------------------------------------- rules

    @precondition(lambda self: len(self.live()) < MAX_LIVE)
    @rule(data=st.data(), load=st.booleans())
    def admit(self, data: st.DataObject, load: bool) -> None:
        """Admit, and maybe start a load-back of what the host has (its guard is left
        to the other rules)."""
        self.do_admit(data, "load" if load else "admit")

    @precondition(lambda self: len(self.live()) < MAX_LIVE)
    @rule(data=st.data(), n=st.integers(1, 3))
    def serve(self, data: st.DataObject, n: int) -> None:
        """Admit and run `n` requests, one after the other, as a scheduler does: the
        copy, a load-back of what the host has (its copies run in the guard's with
        block), the forward over the rest, finish (mostly), and the engine runs what the
        cache emitted."""
        for _ in range(n):
            if len(self.live()) < MAX_LIVE:
                self.do_admit(data, "serve")

    def do_admit(self, data: st.DataObject, plan: str) -> None:
        ns, tokens = self.sequence(data)
        c = self.cache
        s = c.stats()
        h = c.admit(tokens, namespace=ns, priority=priority_of(tokens))
        if h is None:
            # No state slot even after eviction (under write-back, the eviction may have
            # started backups: they hold no lock, the nodes are being evicted; but a
            # backup in flight whose eviction the admission's own lock called off locks
            # that node until it lands).
            assert self.hybrid
            after = c.stats()
            assert after["admits_refused"] == s["admits_refused"] + 1
            assert after["live_requests"] == s["live_requests"]
            new_locks = after["live_locks"] - s["live_locks"]
            assert 0 <= new_locks <= after["batches_in_flight"]
            backups = after["backups"] - s["backups"]
            assert backups == 0 or self.policy == "write_back"
            return
        n, host = h.prefix_len, h.host_len
        assert n % self.ps == 0
        assert host % self.ps == 0
        assert n + host <= self.aligned(len(tokens))
        assert n <= h.branch_len
        assert ints(h.tokens) == tokens[:n]
        self.check_kv(ns, tokens, ints(h.kv_indices), "admit")
        if self.hybrid and n > 0:
            assert h.mamba_slot is not None
            assert h.copy_pending is not None
        else:
            assert h.mamba_slot is None
            assert h.copy_pending is None
        if h.copy_pending is not None:
            self.admissions[h.copy_pending] = (ns, tokens[:n])
            for r in self.live():
                assert r.handle is not None
                assert h.mamba_slot != r.handle.mamba_slot, "a state slot given twice"
        host_path = tokens[: n + host] if host else None
        r = Req(h, ns, tokens[:n], host_path, tokens[: h.branch_len], h.copy_pending)
        del h
        self.reqs.append(r)
        if host:
            self.count("admit: a host hit")
        if plan == "admit":
            return
        self.take()
        if r.copy is not None:
            self.do_ack(r.copy, data.draw(st.sampled_from(["complete", "start_complete"])))
        g: Guard | None = None
        if plan == "load" or (r.host_path is not None and r.copy is None):
            assert r.handle is not None
            quota = data.draw(QUOTAS)
            g = self.do_load_back(r.handle, ns, r.host_path, r, quota, fresh=False, by_request=True)
            if plan == "load":
                return  # the guard is left to the other rules
        if g is not None:
            # The engine runs the copies inside the guard's with block.
            self.do_start(self.pending[g.bid])
            how = data.draw(
                st.sampled_from(["complete", "commit_complete", "commit_fail", "fail", "raise"])
            )
            assert g.lb is not None
            if how == "raise":
                avail = self.available()
                with pytest.raises(Boom):
                    self.run_and_raise(g, commit=False)
                self.forget(g, avail)
            elif how.startswith("commit_"):
                self.do_commit(g)
                if g.bid in self.pending:
                    self.do_ack(g.bid, how.removeprefix("commit_"))
            else:
                self.do_ack(g.bid, how)
                self.do_commit(g)
            g.lb = None  # done with: the guard is committed or released
            self.guards.remove(g)
        rest = tokens[len(r.tokens) :]
        if r.load is None and rest and self.do_extend(r, rest) and data.draw(st.integers(0, 3)):
            self.do_finish(r)
        self.run_engine()

    def run_engine(self) -> None:
        """The engine runs what the cache emitted, and finishes the copies of load-backs
        called off while they ran (the others run through their guards)."""
        self.take()
        for bid in sorted(self.pending):
            g = self.pending[bid].guard
            if g is None or g.state == "released":
                self.do_ack(bid, "start_complete")

    @precondition(lambda self: any(r.live and r.copy is None for r in self.reqs))
    @rule(data=st.data(), more=st.lists(st.integers(0, 2), min_size=1, max_size=4))
    def extend(self, data: st.DataObject, more: list[int]) -> None:
        """The forward step over `more` (a committed load must have landed first)."""
        ready = [
            r for r in self.live() if r.copy is None and (r.load is None or r.load.state == "held")
        ]
        if ready:
            self.do_extend(self.pick(data, ready), more)

    def do_extend(self, r: Req, more: list[int]) -> bool:
        h = r.handle
        assert h is not None
        self.take()
        self.run_readers(h.mamba_slot)
        self.check_request(r, "forward input")
        c = self.cache
        before, held = snapshot(c), self.holdings()
        slot_before = h.mamba_slot
        got = c.extend(h, more)
        if got is None:
            self.refused(before, held, "extend")
            assert (ints(h.tokens), h.mamba_slot) == (r.tokens, slot_before)
            return False
        slots = ints(got)
        assert len(slots) == len(more)
        assert h.mamba_slot is not None or not self.hybrid
        if slot_before is not None:
            assert h.mamba_slot == slot_before
        tokens = r.tokens + more
        start = len(r.tokens)
        self.write(
            "kv", "device", slots, [kv_value(r.ns, tokens, p) for p in range(start, len(tokens))]
        )
        if h.mamba_slot is not None:
            self.write("mamba", "device", [h.mamba_slot], [state_value(r.ns, tokens)])
        r.tokens = tokens
        return True

    @precondition(lambda self: bool(self.live()))
    @rule(data=st.data())
    def checkpoint(self, data: st.DataObject) -> None:
        r = self.pick(data, self.live())
        h = r.handle
        assert h is not None
        c = self.cache
        if r.copy is not None or r.load is not None:
            before = snapshot(c)
            with pytest.raises(rc.CacheError, match=r"not (committed and )?acknowledged"):
                c.checkpoint(h)
            assert snapshot(c) == before
            return
        self.check_request(r, "checkpoint")
        c.checkpoint(h)
        assert ints(h.tokens) == r.tokens
        assert h.prefix_len <= self.aligned(len(r.tokens))
        self.remember(r.ns, r.tokens)
        self.take()

    @precondition(lambda self: bool(self.live()))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        self.do_finish(self.pick(data, self.live()))

    def do_finish(self, r: Req) -> None:
        h = r.handle
        assert h is not None
        c = self.cache
        if r.copy is not None or r.load is not None:
            before = snapshot(c)
            with pytest.raises(rc.CacheError, match=r"not (committed and )?acknowledged"):
                c.finish(h)
            assert snapshot(c) == before
            return
        self.check_request(r, "finish")
        c.finish(h)
        assert not h.live
        r.handle = None
        self.remember(r.ns, r.tokens)
        self.check_match(r.ns, r.tokens)

    @precondition(lambda self: bool(self.live()))
    @rule(data=st.data(), drop=st.booleans())
    def abort(self, data: st.DataObject, drop: bool) -> None:
        """Abort (allowed with a copy or a load pending), or drop the handle."""
        r = self.pick(data, self.live())
        live_before = self.cache.stats()["live_requests"]
        if drop:
            with pytest.warns(ResourceWarning, match="garbage-collected while live"):
                self.drop(r)
        else:
            h = r.handle
            assert h is not None
            self.cache.abort(h)
            assert not h.live
            with pytest.raises(rc.CacheError, match="is not live"):
                self.cache.abort(h)
            r.handle = None
        r.copy = None
        assert self.cache.stats()["live_requests"] == live_before - 1

    @rule(kv=st.integers(0, 16), states=st.integers(0, 2), engine=st.booleans())
    def evict(self, kv: int, states: int, engine: bool) -> None:
        """Evict; or memory pressure as a scheduler sees it: the engine runs every
        backup, the device evicts, and the backups that eviction needs (write-back) run
        too, so that the evicted nodes are demoted to the host."""
        if engine:
            self.run_engine()
        self.do_evict(kv, states)
        if engine:
            self.run_engine()

    def do_evict(self, kv: int, states: int) -> None:
        c = self.cache
        s = c.stats()
        ev = c.evict(kv_tokens=kv, mamba_states=states)
        if ev.kv_tokens < kv:
            assert c.evictable_size() == 0
        after = c.stats()
        if after["demotions"] > s["demotions"]:
            self.count("evict: demoted")
        if after["host_evictions"] > s["host_evictions"]:
            self.count("evict: host eviction")

    @rule(kv=st.integers(0, 16), states=st.integers(0, 2))
    def evict_host(self, kv: int, states: int) -> None:
        """Host eviction: only host-only data goes; the device is untouched."""
        c = self.cache
        before, device = c.stats(), (c.available_kv(), c.available_mamba(), c.total_size())
        ev = c.evict_host(kv_tokens=kv, mamba_states=states)
        after = c.stats()
        assert (c.available_kv(), c.available_mamba(), c.total_size()) == device
        # A slot an in-flight copy still reads drains instead of coming free at once.
        for pool, n in (("kv", ev.kv_tokens), ("mamba", ev.mamba_states)):
            gone = [after[f"host_{pool}_{k}_slots"] - before[f"host_{pool}_{k}_slots"]
                    for k in ("free", "draining")]  # fmt: skip
            assert sum(gone) == n, (pool, gone, ev)
        assert after["host_evicted_tokens"] - before["host_evicted_tokens"] == ev.kv_tokens
        if ev.kv_tokens < kv:
            assert after["host_kv_evictable_tokens"] == 0
        if ev.kv_tokens:
            self.count("evict_host")

    @rule(data=st.data())
    def engine(self, data: st.DataObject) -> None:
        """A scheduler step: take what the cache emitted (the take_batches rule) and run
        it, mostly successfully (load-backs run through their guards)."""
        self.take()
        for bid in sorted(self.pending):
            b = self.pending[bid]
            g = b.guard
            if g is None or g.state == "released":
                hows = ["start_complete"] * 3 + ["fail", "keep"]
                if b.obj is not None and not b.started:
                    hows.append("drop")
                how = data.draw(st.sampled_from(hows))
                if how != "keep":
                    self.do_ack(bid, how, via_object=data.draw(st.booleans()))

    @precondition(lambda self: bool(self.pending))
    @rule(data=st.data())
    def acknowledge(self, data: st.DataObject) -> None:
        """Start, complete or fail any pending batch (a load-back's included)."""
        bid = data.draw(st.sampled_from(sorted(self.pending)))
        how = data.draw(st.sampled_from(["start", "complete", "fail", "start_complete"]))
        if how == "start":
            self.do_start(self.pending[bid])
        else:
            self.do_ack(bid, how)

    @precondition(lambda self: sum(g.state == "held" for g in self.guards) < MAX_GUARDS)
    @rule(data=st.data(), quota=QUOTAS)
    def load_back(self, data: st.DataObject, quota: int | None) -> None:
        """load_back of a request, of a fresh match's host_node (with or without
        request=), or of an older node handle."""
        kind = data.draw(st.sampled_from(["request", "node", "node_request", "old", "host"]))
        live = self.live()
        if kind == "host":
            # What a scheduler probing its queue would find on the host: the first
            # sequence seen before with a host hit (often the same path twice).
            for ns, tokens in self.seen:
                m = self.check_match(ns, tokens)
                if m.host_len > 0:
                    path = tokens[: m.device_len + m.host_len]
                    self.do_load_back(
                        m.host_node, ns, path, None, quota, fresh=True, by_request=False
                    )
                    self.handles = [*self.handles[-7:], (m.host_node, ns, path)]
                    break
            return
        if kind == "request" and live:
            r = self.pick(data, live)
            assert r.handle is not None
            self.do_load_back(r.handle, r.ns, r.host_path, r, quota, fresh=False, by_request=True)
        elif kind == "old" and self.handles:
            node, ns, path = self.pick(data, self.handles)
            self.do_load_back(node, ns, path, None, quota, fresh=False, by_request=False)
        else:
            req: Req | None = None
            if kind == "node_request" and live:
                req = self.pick(data, live)
            how = data.draw(st.sampled_from(["admitted", "extended", "other_ns", "any"]))
            if req is not None and how == "admitted":
                ns, tokens = req.ns, req.admitted[: data.draw(st.integers(0, len(req.admitted)))]
            elif req is not None and how == "extended":
                more = data.draw(st.lists(st.integers(0, 2), max_size=6))
                ns, tokens = req.ns, req.tokens + more
            elif req is not None and how == "other_ns":
                # The same tokens in another namespace: not the request's sequence.
                ns, tokens = ("a" if req.ns is None else None), list(req.admitted)
            else:
                ns, tokens = self.sequence(data)
            m = self.check_match(ns, tokens)
            path = tokens[: m.device_len + m.host_len]
            g = self.do_load_back(m.host_node, ns, path, req, quota, fresh=True, by_request=False)
            if m.host_len == 0:
                assert g is None, "a load-back with nothing on the host"
            self.handles = [*self.handles[-7:], (m.host_node, ns, path)]

    @precondition(lambda self: sum(g.state == "held" for g in self.guards) < MAX_GUARDS - 1)
    @rule(data=st.data())
    def overlap(self, data: st.DataObject) -> None:
        """Two load-backs of one path (or of a path and its prefix), started, committed
        and acknowledged in random orders: the second commit must not publish below, or
        settle as landed, slots the first one's copies still write."""
        for ns, tokens in self.seen:
            m = self.check_match(ns, tokens)
            if m.host_len > 0:
                break
        else:
            return
        end = m.device_len + m.host_len
        cut = self.aligned(data.draw(st.integers(m.device_len + self.ps, end)))
        guards: list[Guard] = []
        for n in (end, cut):
            m = self.check_match(ns, tokens[:n])
            path = tokens[: m.device_len + m.host_len]
            g = self.do_load_back(m.host_node, ns, path, None, None, fresh=True, by_request=False)
            if g is not None:
                guards.append(g)
        if len(guards) < 2:
            return
        self.count("overlap: two guards")
        order = data.draw(st.permutations(range(len(guards) * 3)))
        for k in order:
            g = guards[k % 2]
            step = k // 2
            if step == 0 and g.bid in self.pending and data.draw(st.booleans()):
                self.do_start(self.pending[g.bid])
            elif step == 1 and g.lb is not None:
                self.do_commit(g)
            elif step == 2 and g.bid in self.pending:
                self.do_ack(g.bid, data.draw(st.sampled_from(["complete", "complete", "fail"])))
            self.check_match(ns, tokens)
        for g in guards:
            if g.lb is not None and g.state != "held":
                g.lb = None
                self.guards.remove(g)

    @precondition(lambda self: bool(self.held_guards()))
    @rule(data=st.data())
    def guard(self, data: st.DataObject) -> None:
        g = self.pick(data, self.held_guards())
        assert g.lb is not None
        op = data.draw(
            st.sampled_from(
                ["start", "commit", "release", "with", "with_commit", "complete", "fail", "drop"]
            )
        )
        self.count(f"guard: {op}")
        b = self.pending.get(g.bid)
        if op == "start" or (op in ("complete", "fail") and b is None):
            if b is None:
                before = snapshot(self.cache)
                with pytest.raises(ValueError, match="no batch"):
                    getattr(self.cache, "start" if op == "start" else op)(g.bid)
                assert snapshot(self.cache) == before
            else:
                self.do_start(b)
        elif op in ("complete", "fail"):
            self.do_ack(g.bid, op)
        elif op == "commit":
            self.do_commit(g)
        elif op in ("release", "with", "with_commit"):
            self.release(g, op)
        else:
            held = g.lb.held
            avail = self.available()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                g.lb = None  # the only reference: collected now
                gc.collect()
            found = [w for w in caught if issubclass(w.category, ResourceWarning)]
            if held:
                assert len(found) == 1, "a dropped held guard must warn"
                assert "garbage-collected uncommitted" in str(found[0].message)
                self.forget(g, avail)
            else:
                assert not found, "a guard that holds nothing warned"
        if g.lb is None and g in self.guards:
            self.guards.remove(g)

    @rule(data=st.data())
    def match(self, data: st.DataObject) -> None:
        ns, tokens = self.sequence(data)
        m = self.check_match(ns, tokens)
        self.handles = [*self.handles[-7:], (m.host_node, ns, tokens[: m.device_len + m.host_len])]

    @rule(drain=st.booleans())
    def reset(self, drain: bool) -> None:
        """Reset: refused, changing nothing, while anything holds the tree; after ending
        everything (`drain`) it empties both tiers and every pool is full again."""
        c = self.cache
        if drain:
            for g in self.guards:
                if g.lb is not None and g.state == "held":
                    avail = self.available()
                    g.lb.release()
                    self.forget(g, avail)
            self.drain()
            for r in self.live():
                assert r.handle is not None
                c.abort(r.handle)
                r.handle = None
                r.copy = None
            self.drain()
        s = c.stats()
        outstanding = ("live_requests", "live_locks", "batches_in_flight", "load_backs_pending")
        before = snapshot(c)
        if any(s[k] for k in outstanding):
            with pytest.raises(rc.CacheError, match=r"^reset: the cache is in use: \d+ "):
                c.reset()
            assert snapshot(c) == before
            self.count("reset: refused")
            return
        self.events.check(c)
        c.reset()
        self.count("reset")
        s = c.stats()
        assert s["nodes"] == 0
        assert s["resets"] >= 1
        assert c.available_kv() == self.kv_slots
        assert c.available_mamba() == self.states
        assert s["host_kv_free_slots"] == self.host_kv_slots
        assert s["host_mamba_free_slots"] == self.host_states
        for ns, tokens in self.seen:
            m = c.match_prefix(tokens, namespace=ns)
            assert (m.device_len, m.host_len) == (0, 0)
        events = c.take_events()
        assert [e.kind for e in events] == ["cleared"]
        self.events.pages.clear()
        self.events.states.clear()

    @rule(data=st.data())
    def misuse(self, data: st.DataObject) -> None:
        """Bad targets and batch ids: errors that change nothing."""
        c = self.cache
        before = snapshot(c)
        what = data.draw(st.sampled_from(["type", "quota", "both", "batch"]))
        if what == "type":
            with pytest.raises(TypeError, match=r"^target"):
                c.load_back(data.draw(st.sampled_from([0, "x", None])))  # type: ignore[arg-type]
        elif what == "quota":
            node = c.match_prefix([5]).node
            before = snapshot(c)
            with pytest.raises(ValueError, match=r"^mem_quota"):
                c.load_back(node, mem_quota=-1)
        elif what == "both" and self.live():
            r = self.pick(data, self.live())
            assert r.handle is not None
            with pytest.raises(ValueError, match=r"^request: the target is a Request"):
                c.load_back(r.handle, request=r.handle)
        else:
            self.take()
            before = snapshot(c)
            assert c.stats()["batches_in_flight"] == len(self.pending)
            unknown = max(self.ids, default=0) + 1
            done = sorted(self.ids - set(self.pending))
            bid = data.draw(st.sampled_from([*done, unknown, 12345]))
            op = data.draw(st.sampled_from(["start", "complete", "fail"]))
            with pytest.raises(ValueError, match=rf"^batch_id: no batch {bid} in flight"):
                getattr(c, op)(bid)
        assert snapshot(c) == before

    # -------------------------------------------------------------- invariants

    @invariant()
    def audit_and_oracle(self) -> None:
        if not hasattr(self, "cache"):
            return
        c = self.cache
        assert_pool_sums(c)
        c.audit()
        self.events.check(c)
        s = c.stats()
        live = self.live()
        assert s["live_requests"] == len(live)
        assert s["batches_in_flight"] >= len(self.pending)
        assert s["load_backs_pending"] == sum(
            1 for b in self.pending.values() if b.guard is not None and b.guard.state != "released"
        ) + sum(1 for g in self.guards if g.state == "held" and g.bid not in self.pending)
        for r in live:
            h = r.handle
            assert h is not None
            assert ints(h.tokens) == r.tokens
            assert h.copy_pending == r.copy
            assert h.load_pending == (r.load.bid if r.load is not None else None)
            if r.copy is None and (r.load is None or r.load.state == "held"):
                self.check_request(r, "request")
        for g in self.guards:
            if g.lb is not None:
                assert g.lb.held == (g.state == "held")
                assert g.lb.committed == (g.state == "committed")

    def in_flight(self) -> set[int]:
        """Ids of the batches handed out and not ended, as the cache lists them."""
        return {bid for bid, _, _ in self.cache.pending_batches()}

    def drain(self) -> bool:
        """Complete every batch, including those completing batches emit (a published
        state is backed up in turn). False when there was none."""
        any_batch = False
        for _ in range(100):
            self.take()
            if not self.pending:
                return any_batch
            any_batch = True
            for bid in sorted(self.pending):
                self.do_ack(bid, "complete")
        raise AssertionError("batches keep coming")

    def teardown(self) -> None:
        try:
            if sys.exc_info()[0] is None:
                # (After a failed step, only clean up: the failure is the report.)
                self.checked_teardown()
        finally:
            self.cleanup()

    def cleanup(self) -> None:
        """Release and abort whatever is left (after a failure too): nothing this example
        made may warn when the collector finds it later, in another example."""
        if not hasattr(self, "cache"):
            return
        guards = [*self.guards, *(b.guard for b in self.pending.values() if b.guard)]
        for g in guards:
            if g.lb is not None:
                g.lb.release()
            g.lb = None
            g.req = None
        for b in self.pending.values():
            if b.obj is not None and b.obj.outcome is None and b.bid in self.in_flight():
                b.obj.fail("cleanup")
            b.obj = None
        for r in self.reqs:
            if r.handle is not None and r.handle.live:
                self.cache.abort(r.handle)
            r.handle = None
            r.load = None

    def checked_teardown(self) -> None:
        if not hasattr(self, "cache"):
            return
        c = self.cache
        for g in self.guards:
            if g.lb is not None and g.state == "held":
                avail = self.available()
                g.lb.release()
                self.forget(g, avail)
            g.lb = None
        self.drain()
        for r in self.live():
            assert r.handle is not None
            c.abort(r.handle)
            r.handle = None
        self.drain()
        c.audit()
        s = c.stats()
        for key in (
            "live_requests",
            "live_locks",
            "batches_in_flight",
            "load_backs_pending",
            "kv_request_slots",
            "kv_caller_slots",
            "mamba_request_slots",
            "mamba_caller_slots",
            "mamba_draining_slots",
        ):
            assert s[key] == 0, f"{key} = {s[key]} after teardown"
        assert c.available_kv() + c.total_size() == self.kv_slots
        assert c.available_mamba() + s["mamba_cached_states"] == self.states
        assert s["host_kv_free_slots"] + s["host_kv_cached_tokens"] == self.host_kv_slots
        assert s["host_mamba_free_slots"] + s["host_mamba_cached_states"] == self.host_states
        # Everything evictable: under write-back the eviction backs up first.
        for _ in range(100):
            c.evict(kv_tokens=10**9, mamba_states=10**9)
            if not self.drain():
                break
        c.audit()
        assert c.available_kv() == self.kv_slots
        assert c.available_mamba() == self.states
        for ns, tokens in self.seen:
            assert self.check_match(ns, tokens).device_len == 0
        # Then the host tier: evict_host clears it.
        c.evict_host(kv_tokens=10**9, mamba_states=10**9)
        c.audit()
        s = c.stats()
        assert s["host_kv_free_slots"] == self.host_kv_slots
        assert s["host_mamba_free_slots"] == self.host_states


SETTINGS = settings(
    max_examples=examples(40),
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.mark.parametrize("page_size", [1, 2])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("hybrid", [False, True], ids=["attention", "hybrid"])
def test_host_machine(hybrid: bool, policy: str, page_size: int) -> None:
    class Machine(HostMachine):
        pass

    Machine.hybrid, Machine.policy, Machine.ps = hybrid, policy, page_size
    run_state_machine_as_test(Machine, settings=SETTINGS)
