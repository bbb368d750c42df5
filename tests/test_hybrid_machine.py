"""Hypothesis state machine over the hybrid cache: requests (admit, extend, checkpoint,
finish, abort, dropped handles), transfer batches acknowledged in random order, and the
low-level state calls (alloc_mamba, free_mamba, insert with a state, evict).

After every step: audit(), conservation of both pools against what the test holds
(requests, caller slots, batches in flight), and a data oracle: every slot carries the
hash of the token prefix it was computed for, and whatever the cache hands out for reuse
(matched KV, matched or copied states, a request's own state) must carry the right one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import radixcache as rc

from conftest import (
    EVICTION_POLICIES,
    GAUGES,
    EventIndex,
    assert_pool_sums,
    examples,
    fingerprint,
    priority_of,
)

pytestmark = pytest.mark.slow

SYSTEM = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]]
NAMESPACES = st.sampled_from([None, "a"])
SEEDS = {None: 11, "a": 13}
MASK = (1 << 61) - 1
GARBAGE = -1


@st.composite
def token_lists(draw: st.DrawFn) -> list[int]:
    head = draw(st.sampled_from([*SYSTEM, []]))
    tail = draw(st.lists(st.integers(0, 3), min_size=1, max_size=6))
    return head[: len(head) - draw(st.integers(0, len(head)))] + tail


def hashes_of(ns: str | None, tokens: list[int]) -> list[int]:
    """hashes[i]: the hash of tokens[:i] in namespace ns (what slot i-1 / a state holds)."""
    h = SEEDS[ns]
    out = [h]
    for t in tokens:
        h = ((h * 1_000_003) ^ (t + 1)) & MASK
        out.append(h)
    return out


def without_state_shares(fp: tuple[object, ...], let_go: int) -> tuple[object, ...]:
    """A `fingerprint` as it was before `let_go` states turned from protected to
    evictable (the gauges moved back)."""
    gauges = dict(zip(GAUGES, fp[5]))  # type: ignore[call-overload]
    gauges["mamba_evictable_states"] -= let_go
    gauges["mamba_protected_states"] += let_go
    return (*fp[:5], tuple(gauges[k] for k in GAUGES), *fp[6:])


@dataclass
class Req:
    handle: rc.Request | None
    ns: str | None
    tokens: list[int] = field(default_factory=list)
    copy: int | None = None  # admission copy batch, until acknowledged
    # What a failed admission copy took from it: held until it ends (KV pages, states).
    retired_pages: int = 0
    retired_states: set[int] = field(default_factory=set)

    @property
    def live(self) -> bool:
        return self.handle is not None


@dataclass
class Batch:
    kind: str  # "admit" | "checkpoint"
    src: int
    dst: int
    #: The object that owns the batch (acknowledged through it or by id).
    obj: rc.TransferBatch | None
    req: Req | None = None
    #: A checkpoint's: the namespace and tokens whose end its state is for.
    end: tuple[str | None, tuple[int, ...]] | None = None


class HybridMachine(RuleBasedStateMachine):
    cache: rc.HybridCache

    def __init__(self) -> None:
        super().__init__()
        self.reqs: list[Req] = []
        self.batches: dict[int, Batch] = {}
        self.caller_kv: set[int] = set()  # pages
        self.caller_mamba: set[int] = set()
        self.next_batch = 0
        self.batch_ids: set[int] = set()
        self.seen: list[tuple[str | None, list[int]]] = []

    @initialize(
        page_size=st.sampled_from([1, 2, 4]),
        pages=st.integers(12, 40),
        states=st.integers(2, 6),
        policy=EVICTION_POLICIES,
    )
    def build(self, page_size: int, pages: int, states: int, policy: str | dict[str, str]) -> None:
        self.ps = page_size
        self.kv_slots = page_size * pages
        self.states = states
        self.cache = rc.HybridCache(
            kv_slots=self.kv_slots,
            page_size=page_size,
            mamba_slots=states,
            eviction_policy=policy,
            page_hashes=True,
            events=True,
        )
        self.events = EventIndex()
        self.kv_mem = np.full(self.kv_slots, GARBAGE, dtype=np.int64)
        self.mamba_mem = np.full(states, GARBAGE, dtype=np.int64)

    # ------------------------------------------------------------------ helpers

    def aligned(self, n: int) -> int:
        return n // self.ps * self.ps

    def live(self) -> list[Req]:
        return [r for r in self.reqs if r.live]

    def check_kv(self, ns: str | None, tokens: list[int], kv: np.ndarray) -> None:
        want = hashes_of(ns, tokens)[1 : len(kv) + 1]
        assert len(kv) <= len(tokens)
        got = self.kv_mem[kv]
        assert list(got) == want, f"KV slots {list(kv)} hold wrong data for {tokens}"

    def take(self) -> list[rc.TransferBatch]:
        """Take new batches and run their copies at once (acknowledged later)."""
        out = self.cache.take_batches()
        for b in out:
            assert b.kind == "cow"
            assert b.id >= self.next_batch, "batch ids are never reused"
            self.next_batch = b.id + 1
            self.batch_ids.add(b.id)
            (cp,) = b.copies
            assert (cp.pool, cp.src_tier, cp.dst_tier) == ("mamba", "device", "device")
            self.mamba_mem[cp.dst] = self.mamba_mem[cp.src]
        return out

    def tree_states(self) -> set[int]:
        text = self.cache.pretty(max_nodes=100_000, max_tokens=0)
        found = [int(s) for s in re.findall(r"state@(\d+)", text)]
        assert len(found) == len(set(found)), "a state slot on two nodes"
        return set(found)

    def pinned(self) -> set[int]:
        """State slots that copies in flight read or write."""
        return {x for b in self.batches.values() for x in (b.src, b.dst)}

    def sequence(self, data: st.DataObject) -> tuple[str | None, list[int]]:
        """A namespace and tokens: fresh, or often a sequence cached before, cut or
        continued (so that requests share prefixes ending at states)."""
        if self.seen and data.draw(st.integers(0, 3)) < 3:
            ns, base = data.draw(st.sampled_from(self.seen))
            cut = data.draw(st.integers(0, len(base)))
            tail = data.draw(st.lists(st.integers(0, 3), max_size=4))
            return ns, base[: len(base) - cut // 2] + tail
        return data.draw(NAMESPACES), data.draw(token_lists())

    def remember(self, ns: str | None, tokens: list[int]) -> None:
        if tokens and (ns, tokens) not in self.seen:
            self.seen = [*self.seen[-15:], (ns, list(tokens))]

    def pick(self, data: st.DataObject) -> Req:
        return data.draw(st.sampled_from(self.live()))

    def reset(self, r: Req) -> None:
        r.tokens = []
        r.copy = None

    # ------------------------------------------------------------------ actions

    def do_admit(self, ns: str | None, tokens: list[int]) -> Req | None:
        handle = self.cache.admit(tokens, namespace=ns, priority=priority_of(tokens))
        if handle is None:
            # Refused only when no state slot could be had even after eviction: every
            # unlocked state left is pinned by a copy in flight, but for the matched one,
            # which admit itself locked while it tried.
            s = self.cache.stats()
            assert s["mamba_free_slots"] == 0
            assert s["mamba_evictable_states"] <= len(self.tree_states() & self.pinned()) + 1
            assert s["admits_refused"] > 0
            assert self.take() == []
            return None
        r = Req(handle=handle, ns=ns)
        n = handle.prefix_len
        assert n % self.ps == 0
        assert n <= handle.branch_len
        assert list(handle.tokens) == tokens[:n]
        self.check_kv(ns, tokens, handle.kv_indices)
        batches = self.take()
        if n == 0:
            assert batches == []
            assert handle.mamba_slot is None
        else:
            (b,) = batches
            (cp,) = b.copies
            assert list(cp.dst) == [handle.mamba_slot]
            src = int(cp.src[0])
            assert src in self.tree_states()
            assert self.mamba_mem[src] == hashes_of(ns, tokens)[n], "cached state is wrong"
            assert handle.copy_pending == b.id
            self.batches[b.id] = Batch("admit", src, int(cp.dst[0]), b, r)
            r.copy = b.id
        r.tokens = tokens[:n]
        self.reqs.append(r)
        return r

    def do_extend(self, r: Req, more: list[int]) -> bool:
        h = r.handle
        assert h is not None
        start = len(r.tokens)
        hashes = hashes_of(r.ns, r.tokens + more)
        if start > 0:
            assert h.mamba_slot is not None
            assert self.mamba_mem[h.mamba_slot] == hashes[start], "request state overwritten"
        before = fingerprint(self.cache)
        refused = self.cache.stats()["extends_refused"]
        slot_before = h.mamba_slot
        got = self.cache.extend(h, more)
        if got is None:
            # A refusal costs nothing: no slot taken, nothing evicted.
            assert fingerprint(self.cache) == before
            assert self.cache.stats()["extends_refused"] == refused + 1
            assert h.mamba_slot == slot_before
            assert list(h.tokens) == r.tokens
            return False
        assert len(got) == len(more)
        assert h.mamba_slot is not None
        if slot_before is not None:
            assert h.mamba_slot == slot_before
        self.kv_mem[got] = hashes[start + 1 :]
        self.mamba_mem[h.mamba_slot] = hashes[-1]
        r.tokens = r.tokens + more
        return True

    def do_checkpoint(self, r: Req) -> None:
        h = r.handle
        assert h is not None
        if r.copy is not None:
            before = fingerprint(self.cache)
            with pytest.raises(rc.CacheError, match="not acknowledged"):
                self.cache.checkpoint(h)
            assert fingerprint(self.cache) == before
            return
        self.cache.checkpoint(h)
        n = len(r.tokens)
        assert h.prefix_len == self.aligned(n)
        assert list(h.tokens) == r.tokens
        self.check_kv(r.ns, r.tokens, h.kv_indices)
        batches = self.take()
        if batches:
            (b,) = batches
            (cp,) = b.copies
            assert n > 0
            assert n == self.aligned(n), "a state copy at no node's end"
            assert list(cp.src) == [h.mamba_slot]
            end = (r.ns, tuple(r.tokens))
            self.batches[b.id] = Batch("checkpoint", int(cp.src[0]), int(cp.dst[0]), b, end=end)

    def do_finish(self, r: Req) -> None:
        h = r.handle
        assert h is not None
        if r.copy is not None:
            before = fingerprint(self.cache)
            with pytest.raises(rc.CacheError, match="not acknowledged"):
                self.cache.finish(h)
            assert fingerprint(self.cache) == before
            return
        self.check_kv(r.ns, r.tokens, h.kv_indices)
        self.remember(r.ns, r.tokens)
        held = h.mamba_slot is not None
        lost = self.cache.stats()["finish_states_lost"]
        self.cache.finish(h)
        assert not h.live
        r.handle = None
        n = len(r.tokens)
        lost = self.cache.stats()["finish_states_lost"] - lost
        self.check_end_state(r, held, bool(lost))
        if n > 0 and n == self.aligned(n):
            # A state sits at the end now: the request's, or the one the node had.
            m = self.cache.match_prefix(r.tokens, namespace=r.ns)
            assert m.device_len == n
            self.check_kv(r.ns, r.tokens, m.kv_indices)
            assert m.mamba_slot is not None
            assert self.mamba_mem[m.mamba_slot] == hashes_of(r.ns, r.tokens)[n]

    def check_end_state(self, r: Req, held: bool, lost: bool) -> None:
        """A finish of `r` (`held`: with its own state) counted `lost` when its length is
        unaligned and no state, nor a checkpoint copy, is where its last whole page ends
        (``finish_states_lost``)."""
        n, aligned = len(r.tokens), self.aligned(len(r.tokens))
        if not held or n == aligned or aligned == 0:
            assert not lost, "finish_states_lost counted a state it could not keep"
            return
        there = self.cache.peek_prefix(r.tokens[:aligned], namespace=r.ns)[0] == aligned
        if lost:
            assert not there, "finish_states_lost counted a state the tree has"
        else:
            end = (r.ns, tuple(r.tokens[:aligned]))
            copying = any(b.end == end for b in self.batches.values())
            assert there or copying, "an end state lost, not counted"

    def do_acknowledge(self, bid: int, how: str, via_object: bool = False) -> None:
        """End batch `bid`: by id through the cache, or through its object; `how` is
        complete, fail, start_complete, start_fail, or drop (its object is collected
        unstarted, which fails it)."""
        b = self.batches.pop(bid)
        obj, b.obj = b.obj, None
        assert obj is not None
        assert obj.id == bid
        if how.startswith("start"):
            obj.start() if via_object else self.cache.start(bid)
        if how.endswith("complete"):
            obj.complete() if via_object else self.cache.complete(bid)
            assert obj.outcome == ("completed" if via_object else None)
            if b.kind == "admit" and b.req is not None and b.req.live:
                b.req.copy = None
                assert b.req.handle is not None
                assert b.req.handle.copy_pending is None
            return
        req = b.req if b.kind == "admit" and b.req is not None and b.req.live else None
        if req is not None:
            h = req.handle
            assert h is not None
            # A failed admission copy takes the request's slots; it keeps them until it
            # ends (a forward pass may have been queued on them).
            req.retired_pages += -(-(len(h.tokens) - h.prefix_len) // self.ps)
            if h.mamba_slot is not None:
                req.retired_states.add(h.mamba_slot)
        if how == "drop":
            with pytest.warns(ResourceWarning, match=rf"TransferBatch {bid} .*; failed it"):
                del obj
        elif via_object:
            obj.fail("test")
            assert (obj.outcome, obj.reason) == ("failed", "test")
        else:
            self.cache.fail(bid)
        self.mamba_mem[b.dst] = GARBAGE
        if req is not None:
            h = req.handle
            assert h is not None
            view = (h.prefix_len, len(h.tokens), len(h.kv_indices), h.mamba_slot, h.copy_pending)
            assert view == (0, 0, 0, None, None), "docs/contract.md rule 10: back to nothing reused"
            self.reset(req)

    # -------------------------------------------------------------------- rules

    @precondition(lambda self: sum(r.live for r in self.reqs) < 4)
    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        """Admit; often acknowledge the copy and extend the rest, as a scheduler does."""
        ns, tokens = self.sequence(data)
        r = self.do_admit(ns, tokens)
        if r is None or not data.draw(st.booleans()):
            return
        if r.copy is not None:
            self.do_acknowledge(r.copy, "complete")
        self.do_extend(r, tokens[len(r.tokens) :])

    @precondition(lambda self: any(r.live for r in self.reqs))
    @rule(data=st.data())
    def serve(self, data: st.DataObject) -> None:
        """One scheduler step for a request: acknowledge its copy, or feed it tokens and
        maybe checkpoint or finish it."""
        r = self.pick(data)
        if r.copy is not None:
            self.do_acknowledge(r.copy, data.draw(st.sampled_from(["complete", "fail"])))
            return
        more = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=6))
        if not self.do_extend(r, more):
            return
        what = data.draw(st.sampled_from(["run", "checkpoint", "finish"]))
        if what == "checkpoint":
            self.do_checkpoint(r)
        elif what == "finish":
            self.do_finish(r)

    @precondition(lambda self: any(r.live for r in self.reqs))
    @rule(data=st.data(), more=st.lists(st.integers(0, 3), max_size=6))
    def extend(self, data: st.DataObject, more: list[int]) -> None:
        self.do_extend(self.pick(data), more)

    @precondition(lambda self: any(r.live for r in self.reqs))
    @rule(data=st.data())
    def decode_step(self, data: st.DataObject) -> None:
        """``extend_batch``: one token each for some live requests, all or nothing."""
        live = [r for r in self.reqs if r.live]
        picked = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=4, unique_by=id))
        toks = data.draw(st.lists(st.integers(0, 3), min_size=len(picked), max_size=len(picked)))
        handles = [r.handle for r in picked]
        before = fingerprint(self.cache)
        refused = self.cache.stats()["extends_refused"]
        slots_before = [h.mamba_slot for h in handles if h is not None]
        got = self.cache.extend_batch(handles, toks)  # type: ignore[arg-type]
        if got is None:
            assert fingerprint(self.cache) == before, "a refused step took or evicted something"
            assert self.cache.stats()["extends_refused"] == refused + 1
            assert [h.mamba_slot for h in handles if h is not None] == slots_before
            return
        assert len(got) == len(picked)
        for r, slot, t, old in zip(picked, got, toks, slots_before):
            h = r.handle
            assert h is not None
            assert h.mamba_slot is not None
            if old is not None:
                assert h.mamba_slot == old
            hashes = hashes_of(r.ns, [*r.tokens, t])
            if r.tokens:
                assert self.mamba_mem[old] == hashes[-2], "request state overwritten"
            self.kv_mem[slot] = hashes[-1]
            self.mamba_mem[h.mamba_slot] = hashes[-1]
            r.tokens = [*r.tokens, t]
            assert list(h.tokens) == r.tokens

    @precondition(lambda self: any(r.live for r in self.reqs))
    @rule(data=st.data())
    def checkpoint(self, data: st.DataObject) -> None:
        self.do_checkpoint(self.pick(data))

    @precondition(lambda self: any(r.live for r in self.reqs))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        self.do_finish(self.pick(data))

    @precondition(lambda self: any(r.live for r in self.reqs))
    @rule(data=st.data(), drop=st.booleans())
    def abort(self, data: st.DataObject, drop: bool) -> None:
        """Abort a request, or drop its handle (collected: aborted with a warning)."""
        r = self.pick(data)
        live_before = self.cache.stats()["live_requests"]
        if drop:
            with pytest.warns(ResourceWarning, match="garbage-collected while live"):
                r.handle = None  # the only reference: the request is collected
        else:
            h = r.handle
            assert h is not None
            self.cache.abort(h)
            assert not h.live
            r.handle = None
        assert self.cache.stats()["live_requests"] == live_before - 1

    @precondition(lambda self: bool(self.batches))
    @rule(data=st.data())
    def acknowledge(self, data: st.DataObject) -> None:
        bid = data.draw(st.sampled_from(sorted(self.batches)))
        how = data.draw(
            st.sampled_from(["complete", "fail", "start_complete", "start_fail", "drop"])
        )
        self.do_acknowledge(bid, how, via_object=data.draw(st.booleans()))

    @rule(data=st.data())
    def misuse(self, data: st.DataObject) -> None:
        """Bad batch ids, bad state slots, ended requests: errors that change nothing."""
        what = data.draw(st.sampled_from(["batch", "slot", "ended"]))
        before = fingerprint(self.cache)
        if what == "batch":
            done = sorted(self.batch_ids - set(self.batches))
            bid = data.draw(st.sampled_from([*done, self.next_batch + 1000, 12345]))
            op = data.draw(st.sampled_from(["start", "complete", "fail"]))
            with pytest.raises(ValueError, match=rf"^batch_id: no batch {bid} in flight"):
                getattr(self.cache, op)(bid)
        elif what == "slot":
            slot = data.draw(
                st.integers(-2, self.states + 1).filter(lambda s: s not in self.caller_mamba)
            )
            with pytest.raises(ValueError, match=rf"^slot: slot {slot} "):
                self.cache.free_mamba(slot)
        else:
            h = self.cache.admit([])  # matches nothing: never needs a state slot
            assert h is not None
            self.cache.abort(h)
            before = fingerprint(self.cache)
            for call in (
                lambda: self.cache.extend(h, [1]),
                lambda: self.cache.checkpoint(h),
                lambda: self.cache.finish(h),
                lambda: self.cache.abort(h),
                lambda: h.tokens,
                lambda: h.mamba_slot,
                lambda: h.prefix_len,
            ):
                with pytest.raises(rc.CacheError, match="is not live"):
                    call()
            assert not h.live
        assert fingerprint(self.cache) == before

    @rule(data=st.data())
    def low_level(self, data: st.DataObject) -> None:
        """evict, alloc_mamba/free_mamba, alloc_kv/free_kv (the test holds a few slots at
        most: more would only starve the requests)."""
        op = data.draw(st.sampled_from(["evict", "state", "kv"]))
        if op == "evict":
            kv = data.draw(st.integers(0, 24))
            states = data.draw(st.integers(0, 3))
            ev = self.cache.evict(kv_tokens=kv, mamba_states=states)
            if ev.kv_tokens < kv:
                assert self.cache.evictable_size() == 0
            if ev.mamba_states < states:
                assert self.cache.stats()["mamba_evictable_states"] == 0
        elif op == "state" and self.caller_mamba:
            self.cache.free_mamba(self.caller_mamba.pop())
        elif op == "state":
            before = fingerprint(self.cache)
            got = self.cache.alloc_mamba()
            if got is None:
                # Nothing to evict but states pinned by copies in flight (evicting one
                # would only drain it): refused, having evicted nothing.
                assert fingerprint(self.cache) == before
                stats = self.cache.stats()
                assert stats["mamba_free_slots"] == 0
                assert stats["mamba_evictable_states"] <= len(self.tree_states() & self.pinned())
                return
            assert 0 <= got < self.states
            assert got not in self.tree_states()
            assert got not in {r.handle.mamba_slot for r in self.live() if r.handle is not None}
            self.caller_mamba.add(got)
            self.mamba_mem[got] = GARBAGE
        elif self.caller_kv and (len(self.caller_kv) >= 3 or data.draw(st.booleans())):
            pages = data.draw(st.sets(st.sampled_from(sorted(self.caller_kv)), min_size=1))
            self.cache.free_kv([p * self.ps + o for p in sorted(pages) for o in range(self.ps)])
            self.caller_kv -= pages
        else:
            n_pages = data.draw(st.integers(0, 3))
            got_kv = self.cache.alloc_kv(n_pages * self.ps)
            if got_kv is None:
                return
            pages = {int(x) // self.ps for x in got_kv}
            assert len(pages) == n_pages
            assert not pages & self.caller_kv
            self.caller_kv |= pages

    @rule(
        data=st.data(),
        reuse=st.booleans(),
        state=st.sampled_from(["new", "held", "none"]),
    )
    def insert(self, data: st.DataObject, reuse: bool, state: str) -> None:
        """A serving engine's low-level insert, optionally with the state at the end."""
        ns, tokens = self.sequence(data)
        self.remember(ns, tokens)
        ps = self.ps
        m = self.cache.match_prefix(tokens, namespace=ns)
        owned_from = m.device_len if reuse else 0
        rest = len(tokens) - owned_from
        got = self.cache.alloc_kv(-(-rest // ps) * ps)
        if got is None:
            return
        # The allocation may have evicted part of the matched prefix: match again.
        m = self.cache.match_prefix(tokens, namespace=ns)
        if m.device_len < owned_from:
            self.cache.free_kv(got)
            return
        kv = [*map(int, m.kv_indices[:owned_from]), *map(int, got[:rest])]
        hashes = hashes_of(ns, tokens)
        self.kv_mem[kv[owned_from:]] = hashes[owned_from + 1 :]
        slot: int | None = None
        if state == "held" and self.caller_mamba:
            slot = min(self.caller_mamba)
        elif state == "new":
            slot = self.cache.alloc_mamba()
            if slot is not None:
                self.caller_mamba.add(slot)
        if slot is not None:
            self.mamba_mem[slot] = hashes[-1]
        # The allocation of a state may have evicted too.
        m = self.cache.match_prefix(tokens, namespace=ns)
        if m.device_len < owned_from:
            self.cache.free_kv(got)
            return
        states_before = self.tree_states()
        free_before = self.cache.available_mamba()
        ins = self.cache.insert(
            tokens,
            kv,
            namespace=ns,
            owned_from=owned_from,
            mamba_slot=slot,
            priority=priority_of(tokens),
        )
        if slot is None:
            assert not ins.mamba_existed
            return
        self.caller_mamba.discard(slot)
        n = len(tokens)
        placed = slot in self.tree_states()
        if n == 0 or n != self.aligned(n):
            assert not placed
            assert not ins.mamba_existed
            assert self.cache.available_mamba() == free_before + 1
        elif ins.mamba_existed:
            assert not placed
            assert self.tree_states() == states_before
        else:
            assert placed
            m = self.cache.match_prefix(tokens, namespace=ns)
            assert (m.device_len, m.mamba_slot) == (n, slot)

    @rule(data=st.data(), n=st.integers(0, 4))
    def expect(self, data: st.DataObject, n: int) -> None:
        """Tell eviction which prompts come next (none: clear the marks): the tree, the
        pools and every gauge stay as they were; later evictions and checkpoints follow
        the marks, and every invariant still holds."""
        prompts = [self.sequence(data) for _ in range(n)]
        before = fingerprint(self.cache)
        shares = self.cache.stats()["mamba_protected_states"]
        marked = self.cache.expect([t for _, t in prompts], namespaces=[ns for ns, _ in prompts])
        assert 0 <= marked <= n
        assert self.cache.stats()["expected_nodes"] == marked
        # Told of a queue, the requests whose admission copy landed let go of the state
        # they matched (docs/contract.md rule 20): those states turn from protected to
        # evictable, and nothing else changes.
        let_go = shares - self.cache.stats()["mamba_protected_states"]
        assert let_go == 0 or (n > 0 and let_go > 0), "expect locked a state"
        assert without_state_shares(fingerprint(self.cache), let_go) == without_state_shares(
            before, 0
        ), "expect changed the cache"

    @rule(data=st.data())
    def match(self, data: st.DataObject) -> None:
        ns, tokens = self.sequence(data)
        peek = self.cache.peek_prefix(tokens, namespace=ns)
        m = self.cache.match_prefix(tokens, namespace=ns)
        assert peek == (m.device_len, m.host_len, m.kv_len)
        assert m.device_len % self.ps == 0
        assert m.device_len <= m.kv_len <= self.aligned(len(tokens))
        assert (m.host_len, m.host_node) == (0, m.node)
        assert len(m.kv_indices) == m.device_len
        self.check_kv(ns, tokens, m.kv_indices)
        if m.device_len > 0:
            assert m.mamba_slot is not None
            assert self.mamba_mem[m.mamba_slot] == hashes_of(ns, tokens)[m.device_len]
        else:
            assert m.mamba_slot is None

    # -------------------------------------------------------------- invariants

    @invariant()
    def audit_and_conservation(self) -> None:
        if not hasattr(self, "cache"):
            return
        c = self.cache
        assert_pool_sums(c)
        c.audit()
        self.events.check(c)
        s = c.stats()
        ps = self.ps
        live = self.live()
        # Requests: what each holds, as the test expects.
        req_pages = 0
        req_states: set[int] = set()
        for r in live:
            h = r.handle
            assert h is not None
            assert list(h.tokens) == r.tokens
            assert h.copy_pending == r.copy
            assert len(h.kv_indices) == len(r.tokens)
            assert h.prefix_len == self.aligned(h.prefix_len) <= len(r.tokens)
            req_pages += -(-(len(r.tokens) - h.prefix_len) // ps) + r.retired_pages
            for slot in [h.mamba_slot, *r.retired_states]:
                if slot is not None:
                    assert slot not in req_states
                    req_states.add(slot)
        retired_pages = sum(r.retired_pages for r in live)
        retired_states = sum(len(r.retired_states) for r in live)
        assert (s["kv_retired_slots"], s["mamba_retired_slots"]) == (
            retired_pages * ps,
            retired_states,
        )
        assert s["live_requests"] == len(live)
        assert s["batches_in_flight"] == len(self.batches)
        # KV: free = capacity - tree - requests - caller.
        assert s["kv_request_slots"] == req_pages * ps
        assert s["kv_caller_slots"] == len(self.caller_kv) * ps
        assert c.available_kv() == (
            self.kv_slots - c.total_size() - req_pages * ps - len(self.caller_kv) * ps
        )
        # States: free = capacity - tree - requests - checkpoint copies - caller - draining.
        tree = self.tree_states()
        assert s["mamba_cached_states"] == len(tree)
        copies = {b.dst for b in self.batches.values() if b.kind == "checkpoint"}
        held = [tree, req_states, copies, self.caller_mamba]
        for i, a in enumerate(held):
            for b in held[i + 1 :]:
                assert not a & b, f"a state slot held twice: {a & b}"
        draining = self.pinned() - tree - req_states - copies - self.caller_mamba
        assert s["mamba_request_slots"] == len(req_states)
        assert s["mamba_caller_slots"] == len(self.caller_mamba)
        # Checkpoint copies are in flight: they count as draining until acknowledged.
        assert s["mamba_draining_slots"] == len(draining) + len(copies)
        assert c.available_mamba() == self.states - sum(len(x) for x in held) - len(draining)

    def teardown(self) -> None:
        if not hasattr(self, "cache"):
            return
        c = self.cache
        for bid in sorted(self.batches):
            c.complete(bid)
        for r in self.live():
            assert r.handle is not None
            c.abort(r.handle)
            r.handle = None
        for s in self.caller_mamba:
            c.free_mamba(s)
        c.free_kv([p * self.ps + o for p in sorted(self.caller_kv) for o in range(self.ps)])
        c.evict(kv_tokens=10**9, mamba_states=10**9)
        c.audit()
        assert c.available_kv() == self.kv_slots
        assert c.available_mamba() == self.states
        s = c.stats()
        assert (s["live_requests"], s["batches_in_flight"], s["live_locks"]) == (0, 0, 0)


HybridMachine.TestCase.settings = settings(
    max_examples=examples(200),
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestHybridMachine = HybridMachine.TestCase
