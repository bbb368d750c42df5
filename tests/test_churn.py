"""Heavy churn through the request API, driven like a serving scheduler, on a hybrid cache
with a small state pool; with a data oracle that checks every reused slot's content.

The "engine" keeps what each KV slot and each state slot would hold: a hash of the token
prefix it was computed for. Forward passes write it, copy-on-write batches copy it (at
once, before the next forward, as an engine does; the acknowledgement comes later and
in any order), failed copies leave garbage. Every reuse is checked against it: the
prefix slots a request is admitted with, the state a copy reads, the state a request
continues from, every KV slot a request holds when it finishes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import pytest

import radixcache as rc

pytestmark = pytest.mark.slow

KV_SLOTS = 4096
VOCAB = 50_000
MASK = (1 << 61) - 1
GARBAGE = -1
CHUNK = 128  # prefill chunk (a multiple of every page size tested)


def chain(h: int, tokens: list[int]) -> list[int]:
    """Hashes of the prefixes ending at each of `tokens`, continuing from `h`."""
    out = []
    for t in tokens:
        h = ((h * 1_000_003) ^ (t + 1)) & MASK
        out.append(h)
    return out


@dataclass
class Conversation:
    namespace: str | None
    tokens: list[int]
    #: hashes[i] is the hash of tokens[:i] (hashes[0] seeds the namespace)
    hashes: list[int]


@dataclass
class Job:
    conv: Conversation
    prompt: list[int]
    hashes: list[int]
    decode: int
    req: rc.Request | None = None
    output: list[int] = field(default_factory=list)


@dataclass
class Engine:
    """The device memory the cache hands out, as prefix hashes."""

    kv: np.ndarray
    mamba: np.ndarray
    pending: dict[int, rc.TransferBatch] = field(default_factory=dict)

    def run(self, cache: rc.HybridCache) -> None:
        """Runs every new batch's copies now (acknowledged later)."""
        for b in cache.take_batches():
            assert b.kind == "cow"
            for cp in b.copies:
                assert (cp.pool, cp.src_tier, cp.dst_tier) == ("mamba", "device", "device")
                self.mamba[cp.dst] = self.mamba[cp.src]
            self.pending[b.id] = b

    def acknowledge(self, cache: rc.HybridCache, rng: random.Random, p: float) -> None:
        for bid in list(self.pending):
            if rng.random() >= p:
                continue
            b = self.pending.pop(bid)
            if rng.random() < 0.3:
                cache.start(bid)
            if rng.random() < 0.05:
                for cp in b.copies:
                    self.mamba[cp.dst] = GARBAGE
                cache.fail(bid)
            else:
                cache.complete(bid)


def run_churn(page_size: int, mamba_slots: int, n_requests: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    cache = rc.HybridCache(kv_slots=KV_SLOTS, page_size=page_size, mamba_slots=mamba_slots)
    eng = Engine(
        kv=np.full(KV_SLOTS, GARBAGE, dtype=np.int64),
        mamba=np.full(mamba_slots, GARBAGE, dtype=np.int64),
    )
    systems = [[rng.randrange(VOCAB) for _ in range(rng.randint(40, 300))] for _ in range(4)]
    seeds = {None: 17, "lora": 23}
    convs: list[Conversation] = []
    concurrency = max(2, mamba_slots - 2)
    queue: list[Job] = []
    running: list[Job] = []
    made = finished = aborted = dropped = retracted = 0
    since_audit = 0

    def new_job() -> Job:
        if len(convs) < 60 or rng.random() < 0.1:
            ns = "lora" if rng.random() < 0.15 else None
            sys_prompt = rng.choice(systems)
            conv = Conversation(ns, list(sys_prompt), [seeds[ns], *chain(seeds[ns], sys_prompt)])
            convs.append(conv)
        else:
            conv = rng.choice(convs)
            if len(conv.tokens) > 1200:  # start over from the system prompt
                n = next(len(s) for s in systems if conv.tokens[: len(s)] == s)
                conv.tokens, conv.hashes = conv.tokens[:n], conv.hashes[: n + 1]
        msg = [rng.randrange(VOCAB) for _ in range(rng.randint(5, 80))]
        return Job(
            conv=conv,
            prompt=conv.tokens + msg,
            hashes=conv.hashes + chain(conv.hashes[-1], msg),
            decode=rng.randint(1, 8),
        )

    def check_kv(job: Job, req: rc.Request) -> None:
        n = len(req.tokens)
        np.testing.assert_array_equal(req.tokens, (job.prompt + job.output)[:n])
        np.testing.assert_array_equal(eng.kv[req.kv_indices], job.hashes[1 : n + 1])

    def admit(job: Job) -> bool:
        req = cache.admit(job.prompt, namespace=job.conv.namespace)
        if req is None:
            return False
        n = req.prefix_len
        assert n % page_size == 0
        assert n <= req.branch_len
        check_kv(job, req)
        eng.run(cache)
        if req.copy_pending is not None:
            # The copy ran: the request's state must be the cached state of its prefix.
            assert eng.mamba[req.mamba_slot] == job.hashes[n], "cached state has wrong data"
        else:
            assert n == 0
        job.req = req
        return True

    def extend(job: Job, req: rc.Request, tokens: list[int]) -> bool:
        start = len(req.tokens)
        if start > 0:
            assert req.mamba_slot is not None
            assert eng.mamba[req.mamba_slot] == job.hashes[start], "request state overwritten"
        slots = cache.extend(req, tokens)
        if slots is None:
            return False
        assert req.mamba_slot is not None
        end = start + len(tokens)
        eng.kv[slots] = job.hashes[start + 1 : end + 1]
        eng.mamba[req.mamba_slot] = job.hashes[end]
        return True

    def step(job: Job) -> str:
        """Advances one job by one scheduler step; returns what became of it."""
        req = job.req
        assert req is not None
        if req.copy_pending is not None:
            return "drop" if rng.random() < 0.01 else "wait"
        have = len(req.tokens)
        if have < len(job.prompt):
            end = min(len(job.prompt), have + CHUNK)
            checkpoint = rng.random() < 0.15 and end < len(job.prompt)
            if have < req.branch_len < end:
                end, checkpoint = req.branch_len, True  # checkpoint at the branch point
            if not extend(job, req, job.prompt[have:end]):
                return "retract"
            if checkpoint:
                cache.checkpoint(req)
                assert req.prefix_len == end // page_size * page_size
                eng.run(cache)
                check_kv(job, req)
            return "abort" if rng.random() < 0.01 else "run"
        if len(job.output) < job.decode:
            tok = rng.randrange(VOCAB)
            job.output.append(tok)
            job.hashes.append(chain(job.hashes[-1], [tok])[0])
            if not extend(job, req, [tok]):
                job.output.pop()
                job.hashes.pop()
                return "retract"
            return "run"
        u = rng.random()
        if u < 0.04:
            return "abort"
        if u < 0.06:
            return "drop"
        check_kv(job, req)
        cache.finish(req)
        assert not req.live
        job.conv.tokens = job.prompt + job.output
        job.conv.hashes = job.hashes
        return "done"

    while finished + aborted + dropped < n_requests:
        # Admission, oldest first; a refused admission waits for slots to come back.
        while len(running) < concurrency:
            if not queue:
                if made == n_requests:
                    break
                queue.append(new_job())
                made += 1
            if not admit(queue[0]):
                break
            running.append(queue.pop(0))
        eng.acknowledge(cache, rng, p=0.6)
        for job in list(running):
            what = step(job)
            if what in ("run", "wait"):
                continue
            running.remove(job)
            if what == "done":
                finished += 1
            elif what == "abort":
                assert job.req is not None
                cache.abort(job.req)
                aborted += 1
            elif what == "drop":
                with pytest.warns(ResourceWarning, match="garbage-collected while live"):
                    job.req = None  # the scheduler lost its only reference
                dropped += 1
            else:  # retract: give everything back and run it again later
                assert job.req is not None
                cache.abort(job.req)
                job.req = None
                job.output.clear()
                job.hashes = job.hashes[: len(job.prompt) + 1]
                queue.append(job)
                retracted += 1
            since_audit += 1
            if since_audit >= 150:
                cache.audit()
                since_audit = 0
        eng.run(cache)
    assert not running
    assert not queue
    # Acknowledge what is still in flight, then everything must come back.
    eng.acknowledge(cache, rng, p=1.0)
    cache.audit()
    stats = cache.stats()
    assert stats["live_requests"] == 0
    assert stats["live_locks"] == 0
    assert stats["batches_in_flight"] == 0
    assert stats["kv_request_slots"] == 0
    assert stats["mamba_request_slots"] == 0
    assert stats["mamba_draining_slots"] == 0
    assert stats["requests_dropped"] == dropped
    huge = 10**9
    cache.evict(kv_tokens=huge, mamba_states=huge)
    cache.audit()
    assert cache.available_kv() == KV_SLOTS
    assert cache.available_mamba() == mamba_slots
    assert cache.total_size() == 0
    assert cache.stats()["nodes"] == 0
    stats.update(
        finished=finished, aborted=aborted, dropped=dropped, retracted=retracted, made=made
    )
    return stats


@pytest.mark.parametrize(
    ("page_size", "mamba_slots", "seed"), [(1, 4, 1), (1, 8, 2), (16, 8, 3), (16, 5, 4)]
)
def test_churn_returns_every_slot_and_hits_states(
    page_size: int, mamba_slots: int, seed: int
) -> None:
    s = run_churn(page_size, mamba_slots, n_requests=2000, seed=seed)
    assert s["state_hits"] > 0
    assert s["hit_tokens"] > 0
    assert s["finished"] > 1500
    assert s["aborted"] > 0
    assert s["dropped"] > 0
    assert s["cow_copies"] > 0
    assert s["batches_failed"] > 0
    assert s["checkpoints"] > 0
    assert s["evicted_mamba_states"] > 0
    assert s["tombstones"] > 0
