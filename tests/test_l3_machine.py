"""Hypothesis state machine over the L3 tier from Python, background fetches included.

Two caches (attention-only or hybrid, written to the store once backed up or only on
host eviction) share one file store through `L3Tier`, each over its own client, which
may fail calls and lose or corrupt objects (`ObjectStore.faulty`). Small pools, pages
of 2 tokens and a small alphabet with shared prefixes, so that backups, puts, host
eviction, fetches and load-backs interleave.

Rules: compute a prompt (its KV and state written into the device slots, then
inserted), run the engine (backups, then the puts their landing emits; or the puts
submitted, written in the background and ended by a later poll), evict from the
device or the host tier, fetch a prompt and wait (`L3Tier.fetch`), start a background
fetch (`start_fetch`), poll one (without waiting, or briefly), call one off
(`cancel`), and serve a prompt: match it, load back what the host holds and read what
the device then holds.

The data oracle: every KV slot written for token `p` of a prompt holds a value derived
from the prompt's first `p + 1` tokens, and every state slot one derived from its
prefix, in both caches alike, so one cache's objects are right for the other. Whatever
a match hands out, before and after a load-back of pages that came from the store,
must hold exactly those values. Sometimes a third cache, of another model (its values
derived with a salt of its own), shares the store, and sometimes every client keys
objects by page alone (`PageHashKeys`), as a client that leaves the model out of its
keys would: then the other model's objects sit under the very keys the two caches read,
and only their frames tell them apart; the oracle holds all the same. After every
step: `audit()` on every cache. At the end: every fetch ends (`close`), everything is
evicted, and every pool of every cache is full again.
"""

from __future__ import annotations

import shutil
import tempfile
import zlib
from typing import Any

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
    run_state_machine_as_test,
)

from radixcache import Breaker, ObjectStore
from radixcache.l3 import L3Fetch

from conftest import examples
from l3_common import MODEL, L3Cache, PageHashKeys

pytestmark = pytest.mark.slow

PS = 2
SYSTEM = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 7, 7, 7], [9, 9, 8, 8]]
MAX_FETCHES = 4


def code(tokens: list[int], salt: bytes = b"") -> float:
    """A value for a prefix, exact in float32 (an integer under 2^20)."""
    return float(zlib.crc32(salt + np.asarray(tokens, dtype=np.uint32).tobytes()) & 0xFFFFF)


class Side(L3Cache):
    """One cache with its storage, L3 tier and engine, and its background fetches.

    `salt` derives its model's values: caches of one model share a salt.
    """

    def __init__(
        self, store: Any, hybrid: bool, l3_write: str, *, model: str = MODEL, salt: bytes = b""
    ) -> None:
        # A breaker that never opens: the faults are drawn per call, not a dead store.
        breaker = Breaker(threshold=1 << 30, cooldown_ms=0)
        super().__init__(
            store,
            hybrid=hybrid,
            page_size=PS,
            kv_slots=24,
            host_kv=32,
            l3_write=l3_write,
            small=True,
            breaker=breaker,
            model=model,
        )
        self.salt = salt
        self.fetches: list[L3Fetch] = []


class L3Machine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="radixcache-l3-machine-")
        self.sides: list[Side] = []

    @initialize(
        hybrid=st.booleans(),
        l3_write=st.sampled_from(["backup", "host_eviction"]),
        faulty=st.booleans(),
        seed=st.integers(0, 1 << 16),
        stranger=st.booleans(),
        page_keys=st.booleans(),
    )
    def build(
        self,
        hybrid: bool,
        l3_write: str,
        faulty: bool,
        seed: int,
        stranger: bool = False,
        page_keys: bool = False,
    ) -> None:
        url = f"file://{self.dir}"
        rates = {"fail": 0.1, "lose": 0.1, "corrupt": 0.1} if faulty else {}
        self.hybrid = hybrid

        def client(k: int) -> Any:
            store = ObjectStore.faulty(url, seed=seed + k, **rates)
            return PageHashKeys(store) if page_keys else store

        self.sides = [Side(client(k), hybrid, l3_write) for k in range(2)]
        if stranger:
            self.sides.append(
                Side(client(2), hybrid, l3_write, model="another-model", salt=b"another")
            )

    def teardown(self) -> None:
        try:
            for side in self.sides:
                side.engine.synchronize()
                side.tier.close()
                assert not side.tier._live, "a fetch outlived close()"
                side.settle()
                cache = side.cache
                for _ in range(8):
                    cache.evict(kv_tokens=1 << 20, mamba_states=1 << 20)
                    side.settle()
                    cache.evict_host(kv_tokens=1 << 20, mamba_states=1 << 20)
                    side.settle()
                cache.audit()
                s = cache.stats()
                for pool in ("kv", "host_kv", "mamba", "host_mamba"):
                    assert s[f"{pool}_free_slots"] == s[f"{pool}_capacity_slots"], (pool, s)
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------------ helpers

    def side(self, data: st.DataObject) -> Side:
        return self.sides[data.draw(st.integers(0, len(self.sides) - 1), label="cache")]

    @staticmethod
    def prompt(data: st.DataObject) -> list[int]:
        system = data.draw(st.sampled_from(SYSTEM), label="system")
        tail = data.draw(st.lists(st.integers(0, 1), max_size=6), label="tail")
        return system + tail[: len(tail) // PS * PS]  # whole pages

    def check(self, side: Side, tokens: list[int]) -> None:
        """What a match hands out holds the prompt's values (KV, and the state)."""
        m = side.cache.match_prefix(tokens)
        k, v = side.storage.kv["device"]
        for p, slot in enumerate(np.asarray(m.kv_indices)[: m.device_len]):
            want = code(tokens[: p + 1], side.salt)
            assert np.all(k[:, slot] == want), f"device K of token {p} of {tokens}"
            assert np.all(v[:, slot] == want + 0.5), f"device V of token {p} of {tokens}"
        if self.hybrid and m.mamba_slot is not None and m.device_len:
            conv, ssm = side.storage.mamba["device"]
            want = code(tokens[: m.device_len], side.salt + b"s")
            assert np.all(conv[:, m.mamba_slot] == want), f"state at {m.device_len}"
            assert np.all(ssm[:, m.mamba_slot] == want + 0.5), f"state at {m.device_len}"

    # ------------------------------------------------------------------ rules

    @rule(data=st.data(), settle=st.booleans())
    def compute(self, data: st.DataObject, settle: bool) -> None:
        """Compute a prompt and insert it; `settle`: run its backup and put too."""
        side, tokens = self.side(data), self.prompt(data)
        self.do_compute(side, tokens)
        if settle:
            side.settle()

    def do_compute(self, side: Side, tokens: list[int]) -> None:
        cache = side.cache
        got = cache.alloc_kv(len(tokens))
        if got is None:
            return
        slots = np.asarray(got, dtype=np.int64)
        k, v = side.storage.kv["device"]
        for p, slot in enumerate(slots):
            k[:, slot] = code(tokens[: p + 1], side.salt)
            v[:, slot] = code(tokens[: p + 1], side.salt) + 0.5
        state = None
        if self.hybrid:
            state = cache.alloc_mamba()
            if state is None:
                cache.free_kv(slots)
                return
            conv, ssm = side.storage.mamba["device"]
            conv[:, state] = code(tokens, side.salt + b"s")
            ssm[:, state] = code(tokens, side.salt + b"s") + 0.5
        cache.insert(tokens, slots, mamba_slot=state)

    @precondition(lambda self: sum(len(s.fetches) for s in self.sides) < MAX_FETCHES)
    @rule(data=st.data(), background=st.booleans(), forget=st.booleans())
    def hand_over(self, data: st.DataObject, background: bool, forget: bool) -> None:
        """One cache computes a prompt and writes it; another fetches it.

        `forget`: the reader first evicts what it can of both tiers, so that the fetch
        has pages to bring (else the reader often holds the shared prefixes already).
        """
        writer = self.side(data)
        reader = data.draw(st.sampled_from([s for s in self.sides if s is not writer]))
        tokens = self.prompt(data)
        self.do_compute(writer, tokens)
        writer.settle()
        if forget:
            reader.cache.evict(kv_tokens=1 << 20, mamba_states=1 << 20)
            reader.settle()
            reader.cache.evict_host(kv_tokens=1 << 20, mamba_states=1 << 20)
            reader.settle()
        if background:
            fetch = reader.tier.start_fetch(tokens)
            if fetch is not None:
                reader.fetches.append(fetch)
        else:
            reader.tier.fetch(tokens)
            self.serve_tokens(reader, tokens)

    @rule(data=st.data())
    def run_engine(self, data: st.DataObject) -> None:
        self.side(data).settle()

    @rule(data=st.data())
    def submit_puts(self, data: st.DataObject) -> None:
        """Run the batches, the puts in the background (ended by a later poll)."""
        side = self.side(data)
        for b in side.cache.take_batches():
            if b.kind == "l3_put":
                side.engine.submit(b)
            else:
                side.engine.run(b)

    @rule(data=st.data())
    def poll_engine(self, data: st.DataObject) -> None:
        for b in self.side(data).engine.poll():
            assert b.outcome in ("completed", "failed")

    @rule(data=st.data(), kv=st.integers(1, 16), states=st.integers(0, 2))
    def evict(self, data: st.DataObject, kv: int, states: int) -> None:
        side = self.side(data)
        side.cache.evict(kv_tokens=kv, mamba_states=states)
        side.settle()

    @rule(data=st.data(), kv=st.integers(1, 16), states=st.integers(0, 2))
    def evict_host(self, data: st.DataObject, kv: int, states: int) -> None:
        side = self.side(data)
        side.cache.evict_host(kv_tokens=kv, mamba_states=states)
        side.settle()

    @rule(data=st.data())
    def fetch(self, data: st.DataObject) -> None:
        side, tokens = self.side(data), self.prompt(data)
        landed = side.tier.fetch(tokens)
        assert landed % PS == 0
        side.cache.audit()

    @precondition(lambda self: sum(len(s.fetches) for s in self.sides) < MAX_FETCHES)
    @rule(data=st.data())
    def start_fetch(self, data: st.DataObject) -> None:
        side, tokens = self.side(data), self.prompt(data)
        fetch = side.tier.start_fetch(tokens)
        if fetch is not None:
            side.fetches.append(fetch)

    def pick_fetch(self, data: st.DataObject) -> tuple[Side, L3Fetch]:
        side = data.draw(st.sampled_from([s for s in self.sides if s.fetches]), label="cache")
        return side, data.draw(st.sampled_from(side.fetches), label="fetch")

    @precondition(lambda self: any(s.fetches for s in self.sides))
    @rule(data=st.data())
    def poll(self, data: st.DataObject) -> None:
        """Advance a fetch as far as the store answered, without waiting (how far that
        is depends on the worker thread; the fetch stays listed until `finish`)."""
        side, fetch = self.pick_fetch(data)
        side.tier.poll(fetch)

    @precondition(lambda self: any(s.fetches for s in self.sides))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        """Wait for a fetch to end."""
        side, fetch = self.pick_fetch(data)
        assert side.tier.poll(fetch, timeout=30)
        side.fetches.remove(fetch)
        assert fetch.tokens_landed % PS == 0
        assert fetch.tokens_landed <= len(fetch.tokens)

    @precondition(lambda self: any(s.fetches for s in self.sides))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        side, fetch = self.pick_fetch(data)
        landed = fetch.done and not fetch.cancelled  # a poll may have ended it already
        side.tier.cancel(fetch)
        side.fetches.remove(fetch)
        assert fetch.done
        assert landed or fetch.tokens_landed == 0

    @rule(data=st.data())
    def serve(self, data: st.DataObject) -> None:
        """Match a prompt, load back what the host holds of it, read what is handed out."""
        self.serve_tokens(self.side(data), self.prompt(data))

    def serve_tokens(self, side: Side, tokens: list[int]) -> None:
        self.check(side, tokens)
        m = side.cache.match_prefix(tokens)
        if m.host_len == 0:
            return
        lb = side.cache.load_back(m.host_node)
        if lb is None:
            return
        with lb:
            if side.engine.run(lb.batch):
                lb.commit()
        side.settle()
        self.check(side, tokens)

    @invariant()
    def audited(self) -> None:
        for side in self.sides:
            side.cache.audit()


def test_l3_machine_fetches_in_the_background_serve_the_right_bytes_and_leak_nothing() -> None:
    run_state_machine_as_test(
        L3Machine,
        settings=settings(
            max_examples=examples(100),
            stateful_step_count=50,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


def test_the_oracle_catches_a_wrong_byte() -> None:
    """The check reads the slots: a value changed behind the cache's back is caught."""
    machine = L3Machine()
    machine.build(hybrid=False, l3_write="backup", faulty=False, seed=0)
    side = machine.sides[0]
    tokens = SYSTEM[0]
    slots = np.asarray(side.cache.alloc_kv(len(tokens)), dtype=np.int64)
    k, v = side.storage.kv["device"]
    for p, slot in enumerate(slots):
        k[:, slot] = code(tokens[: p + 1])
        v[:, slot] = code(tokens[: p + 1]) + 0.5
    side.cache.insert(tokens, slots)
    machine.check(side, tokens)
    k[:, slots[3]] += 1
    with pytest.raises(AssertionError, match="device K of token 3"):
        machine.check(side, tokens)
    machine.teardown()
