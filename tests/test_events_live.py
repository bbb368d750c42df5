"""KV events end to end: a cache's `take_events()` published through a real ZMQ socket
(`KvEventPublisher`, msgpack, SGLang's and vLLM's wire formats) and an index rebuilt by a
subscriber from the wire alone (`KvEventSubscriber`), compared with what the cache holds
per tier, pages and states, after every step of a random run and of a replay, a
subscriber that joins late catching up through the replay socket."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("zmq", reason="the events extra (pyzmq) is not installed")
pytest.importorskip("msgpack", reason="the events extra (msgpack) is not installed")

import radixcache as rc
from radixcache import events as ev
from radixcache.events import KvEventPublisher, KvEventSubscriber, wire_hash
from radixcache.events import publisher as ev_publisher
from radixcache.serving import workloads
from radixcache.serving.harness import ReplayConfig, Server

MEDIA = ("GPU", "CPU_PINNED")


def expected(cache: rc.HybridCache, fmt: Any) -> dict[str, tuple[frozenset[int], frozenset[int]]]:
    """What the cache holds, per tier, as the index keeps it (wire hashes)."""
    pages, states = cache._event_contents()
    out = {}
    for medium in MEDIA:
        p = frozenset(wire_hash(h, fmt) for m, _, h in pages if m == medium)
        s = frozenset(wire_hash(h, fmt) for m, _, h in states if m == medium)
        if p or s:
            out[medium] = (p, s)
    return out


def seen(sub: KvEventSubscriber) -> dict[str, tuple[frozenset[int], frozenset[int]]]:
    """The subscriber's index, device and host tiers (the L3 tier is the fleet's)."""
    return {m: v for m, v in sub.index.snapshot().items() if m in MEDIA}


class Wire:
    """A publisher and a subscriber joined now, on free loopback ports."""

    def __init__(self, fmt: Any) -> None:
        self.fmt = fmt
        self.pub = KvEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", format=fmt)
        self.subs = [self.join()]

    def join(self) -> KvEventSubscriber:
        """A subscriber joining now: subscribed first, then caught up from the replay."""
        sub = KvEventSubscriber(self.pub.endpoint, self.pub.replay_endpoint, format=self.fmt)
        sub.catch_up()
        return sub

    def send(self, cache: rc.HybridCache) -> None:
        """Publish the cache's new events; wait until every subscriber applied them."""
        self.pub.publish(cache.take_events())
        for sub in self.subs:
            for _ in range(200):
                if sub.index.next_seq >= self.pub.next_seq:
                    break
                sub.poll(timeout=0.05)
            assert sub.index.next_seq == self.pub.next_seq, "a batch did not arrive"
            assert seen(sub) == expected(cache, self.fmt)

    def close(self) -> None:
        for sub in self.subs:
            sub.close()
        self.pub.close()


@pytest.fixture(params=["sglang", "vllm"])
def wire(request: pytest.FixtureRequest) -> Iterator[Wire]:
    w = Wire(request.param)
    yield w
    w.close()


PROMPTS = [[1, 2, 3, 4], [1, 2, 5, 6, 7, 8], [9, 9, 8, 8]]


def hybrid_cache() -> rc.HybridCache:
    return rc.HybridCache(
        kv_slots=64,
        page_size=2,
        mamba_slots=4,
        host_kv_slots=96,
        host_mamba_slots=4,
        page_hashes=True,
        events=True,
    )


def random_step(cache: rc.HybridCache, rng: random.Random) -> None:
    """One step of an engine: an insert, copies acknowledged, evictions, a load-back."""
    op = rng.randrange(6)
    if op <= 1:  # insert a prompt with a tail, with a state at its end
        toks = rng.choice(PROMPTS) + [rng.randrange(4) for _ in range(rng.randrange(6))]
        m = cache.match_prefix(toks)
        with cache.lock(m.node):
            kv = cache.alloc_kv(-(-(len(toks) - m.device_len) // 2) * 2)
            state = cache.alloc_mamba()
            if kv is None or state is None:
                if kv is not None:
                    cache.free_kv(kv)
                if state is not None:
                    cache.free_mamba(state)
                return
            slots = list(m.kv_indices) + list(kv)
            # The insert frees the unaligned tail's page, spare slots included.
            cache.insert(toks, slots[: len(toks)], owned_from=m.device_len, mamba_slot=state)
    elif op == 2:  # the engine acknowledges the batches, some failed
        for b in cache.take_batches():
            b.start()
            b.complete() if rng.random() < 0.8 else b.fail("injected")
    elif op == 3:
        cache.evict(kv_tokens=rng.randrange(1, 16), mamba_states=1)
    elif op == 4:
        cache.evict_host(kv_tokens=rng.randrange(1, 16), mamba_states=1)
    else:  # a load-back of what a match finds on the host
        m = cache.match_prefix([*rng.choice(PROMPTS), 0, 1])
        if m.host_len:
            lb = cache.load_back(m.host_node)
            if lb is not None:
                with lb:
                    lb.batch.start()
                    lb.commit()
                    lb.batch.complete() if rng.random() < 0.8 else lb.batch.fail("x")


def test_a_random_run_is_mirrored_by_the_subscribers_after_every_step(wire: Wire) -> None:
    rng = random.Random(5)
    cache = hybrid_cache()
    for step in range(300):
        random_step(cache, rng)
        if step == 150:
            wire.subs.append(wire.join())  # a late joiner, through the replay socket
        wire.send(cache)
        cache.audit()
    assert len(wire.subs) == 2
    assert [sub.publisher_restarts for sub in wire.subs] == [0, 0], "no restart made up"
    assert wire.pub.next_seq > 150, "most steps changed what a router is told"
    assert wire.subs[1].replayed_batches > 0
    assert any(expected(cache, wire.fmt).values()), "the run ended holding something"


def test_after_a_batch_it_cannot_decode_the_index_never_claims_what_the_cache_lost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 33, item 9, with a real cache's events: one batch that removed pages goes out
    damaged. The subscribers (one live, one joining later through the replay) skip it and
    go on; from then on their index is within what the cache holds after every step (it
    under-claims, never over-claims), and a reset of the cache makes it exact again."""
    wire = Wire("sglang")
    try:
        rng = random.Random(11)
        cache = hybrid_cache()
        lost: int | None = None
        for step in range(200):
            random_step(cache, rng)
            events = cache.take_events()
            if lost is None and step >= 60 and any(e.kind == "removed" for e in events):
                damaged = ev.encode_batch(events)[:-3]
                with monkeypatch.context() as patch:
                    patch.setattr(ev_publisher, "encode_batch", lambda *_, bad=damaged, **__: bad)
                    lost = wire.pub.publish(events)
            else:
                wire.pub.publish(events)
            if step == 150:
                wire.subs.append(wire.join())
            for sub in wire.subs:
                while sub.index.next_seq < wire.pub.next_seq:
                    assert sub.poll(5.0) or sub.index.next_seq == wire.pub.next_seq, "stuck"
                if lost is not None:
                    truth = expected(cache, "sglang")
                    for medium, (pages, states) in seen(sub).items():
                        held = truth.get(medium, (frozenset(), frozenset()))
                        assert pages <= held[0], f"step {step}: {medium} pages over-claimed"
                        assert states <= held[1], f"step {step}: {medium} states over-claimed"
        assert lost is not None, "no step removed pages"
        for sub in wire.subs:
            assert sub.skipped_seqs == (lost,)
            assert sub.decode_errors == 1
            assert seen(sub), "later batches applied"
        while batches := cache.take_batches():  # the cache idle, so that it may reset
            for b in batches:
                b.start()
                b.complete()
        cache.reset()
        wire.send(cache)  # a clear: exact again (and empty)
    finally:
        wire.close()


def test_after_its_worker_restarts_the_index_follows_the_new_workers_cache_exactly() -> None:
    """Issue 33, item 9: a restarted worker (its publisher numbering from 0 again, its cache
    empty) left the subscriber taking every batch for a duplicate, its index stuck on the
    old worker's cache until the router called resync() itself. The subscriber finds the
    restart on its own; from then on its index equals the new worker's cache after every
    step, and a batch that arrives twice (replay, then live) is still ignored."""
    wire = Wire("sglang")
    try:
        rng = random.Random(7)
        cache = hybrid_cache()
        for _ in range(60):
            random_step(cache, rng)
            wire.send(cache)
        assert any(expected(cache, "sglang").values())
        sub = wire.subs[0]
        old = wire.pub
        old.close()
        wire.pub = KvEventPublisher(old.endpoint, old.replay_endpoint, format="sglang")
        cache = hybrid_cache()  # the new worker's, empty
        deadline = time.monotonic() + 20
        while sub.publisher_restarts == 0:
            assert time.monotonic() < deadline, "the restart was never noticed"
            random_step(cache, rng)
            wire.pub.publish(cache.take_events())
            sub.poll(0.05)
        assert seen(sub) == expected(cache, "sglang")
        for step in range(60):
            random_step(cache, rng)
            if step % 10 == 0 and (events := cache.take_events()):
                wire.pub.publish(events)
                assert sub.catch_up() == 1  # the replay brings it first ...
                before = sub.duplicates
                while sub.duplicates == before:  # ... then it comes live: a duplicate
                    assert time.monotonic() < deadline
                    sub.poll(0.05)
            wire.send(cache)
            cache.audit()
        assert sub.publisher_restarts == 1
        assert sub.duplicates > 0
    finally:
        wire.close()


def test_a_replay_is_mirrored_after_every_scheduler_step(tmp_path: Path) -> None:
    wire = Wire("sglang")
    try:
        config = ReplayConfig(events=True, l3=f"file://{tmp_path}", attention_only=False)
        server = Server(config)
        server.sched.add(workloads.WORKLOADS["multiturn"](48, 0))
        steps = 0
        while server.sched.waiting or server.sched.running:
            server.sched.step()
            steps += 1
            wire.send(server.cache)
            if steps == 40:
                wire.subs.append(wire.join())
        server.sched.drain()
        wire.send(server.cache)
        assert server.model is not None
        assert server.model.mismatches == 0
        # The L3 tier's puts were announced on EXTERNAL, for the fleet's routers.
        external = wire.subs[0].index.pages("EXTERNAL")
        assert 0 < len(external) <= server.cache.stats()["l3_put_pages"]
    finally:
        wire.close()
