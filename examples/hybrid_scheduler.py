"""Serve a chat workload for a hybrid (attention + Mamba) model through the request API.

A small scheduler drives radixcache the way a serving engine does, and a stand-in
"model" makes every answer checkable: the KV entry of position p is a hash of
(token, p), and the Mamba state of a sequence is a hash chain over all its tokens. The
engine runs the cache's transfer batches (copy-on-write of states) on numpy arrays. If
any request ever read a KV slot or a state that did not hold exactly its own prefix's
data, the check after each step would count a mismatch: the run prints 0 mismatches and
a passing audit, or says what went wrong.

Per request: admit (reuse the cached prefix, copy its state), run the copy batch,
extend with the rest of the prompt, checkpoint at the branch point (so the next request
sharing this prompt reuses it), decode a few tokens, finish (cache it all, donate the
state). The state pool is deliberately small, so states are evicted and tombstoned.

    python examples/hybrid_scheduler.py [--requests N] [--seed S] [--mamba-slots N]
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import numpy as np

import radixcache as rc

MASK = (1 << 63) - 1


def kv_entry(token: int, pos: int) -> int:
    """What the model writes into the KV slot of `token` at position `pos`."""
    return (token * 1_000_003 + pos * 7_919 + 17) & MASK


def step_state(state: int, token: int) -> int:
    """One recurrent step of the stand-in Mamba layer."""
    return (state * 6_364_136_223_846_793_005 + token + 1) & MASK


class Engine:
    """Device memory and a model that writes checkable values into it."""

    def __init__(self, cache: rc.HybridCache) -> None:
        self.cache = cache
        self.kv = np.zeros(cache.kv_slots, dtype=np.int64)
        self.states = np.zeros(cache.mamba_slots, dtype=np.int64)
        self.copies = 0

    def run_batches(self) -> None:
        """Run every batch the cache emitted and acknowledge it."""
        for batch in self.cache.take_batches():
            self.cache.start(batch.id)
            for copy in batch.copies:
                assert copy.pool == "mamba"
                assert copy.src_tier == copy.dst_tier == "device"
                self.states[copy.dst] = self.states[copy.src]
                self.copies += len(copy.src)
            self.cache.complete(batch.id)

    def forward(self, req: rc.Request, slots: np.ndarray, tokens: list[int]) -> None:
        """Feed `tokens` (already given `slots` by extend): write their KV, step the state."""
        start = len(req.tokens) - len(tokens)
        self.kv[slots] = [kv_entry(t, start + i) for i, t in enumerate(tokens)]
        slot = req.mamba_slot
        assert slot is not None
        state = int(self.states[slot]) if start > 0 else 0
        for t in tokens:
            state = step_state(state, t)
        self.states[slot] = state

    def check(self, req: rc.Request) -> int:
        """Mismatches between what the request reads and what its prefix must hold."""
        toks = [int(t) for t in req.tokens]
        want_kv = [kv_entry(t, p) for p, t in enumerate(toks)]
        bad = int(np.count_nonzero(self.kv[req.kv_indices] != want_kv))
        if toks and req.mamba_slot is not None:
            state = 0
            for t in toks:
                state = step_state(state, t)
            bad += int(self.states[req.mamba_slot] != state)
        return bad


def workload(n: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt, answer length): shared system prompts and growing conversations."""
    rng = random.Random(seed)
    systems = [[rng.randrange(32_000) for _ in range(rng.randint(48, 96))] for _ in range(3)]
    chats: list[list[int]] = []
    out = []
    for _ in range(n):
        if chats and rng.random() < 0.5:
            i = rng.randrange(len(chats))
            chats[i] = chats[i] + [rng.randrange(32_000) for _ in range(rng.randint(4, 24))]
            out.append((chats[i], rng.randint(2, 8)))
        else:
            chats.append(rng.choice(systems) + [rng.randrange(32_000) for _ in range(8)])
            out.append((chats[-1], rng.randint(2, 8)))
        chats = chats[-12:]
    return out


def serve(engine: Engine, prompt: list[int], answer_len: int, rng: random.Random) -> int:
    """One request end to end; returns the mismatches seen (0 when all is well)."""
    cache = engine.cache
    req = cache.admit(prompt)
    while req is None:  # no state slot for its copy: let the cache evict and retry
        cache.evict(mamba_states=1)
        req = cache.admit(prompt)
    engine.run_batches()  # the copy-on-write of the reused state, before any compute
    bad = engine.check(req)
    # Prefill up to the branch point, checkpoint there, then the rest of the prompt.
    cut = req.branch_len if req.prefix_len < req.branch_len < len(prompt) else len(prompt)
    for chunk in (prompt[req.prefix_len : cut], prompt[cut:]):
        if not chunk:
            continue
        slots = cache.extend(req, chunk)
        if slots is None:
            cache.abort(req)
            return bad
        engine.forward(req, slots, chunk)
        if len(req.tokens) == cut < len(prompt):
            cache.checkpoint(req)
            engine.run_batches()
            bad += engine.check(req)
    for _ in range(answer_len):  # decode
        token = [rng.randrange(32_000)]
        slots = cache.extend(req, token)
        if slots is None:
            cache.abort(req)
            return bad
        engine.forward(req, slots, token)
    bad += engine.check(req)
    cache.finish(req)
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-slots", type=int, default=16_384)
    ap.add_argument("--mamba-slots", type=int, default=16)
    args = ap.parse_args(argv)

    cache = rc.HybridCache(kv_slots=args.kv_slots, mamba_slots=args.mamba_slots)
    engine = Engine(cache)
    rng = random.Random(args.seed + 1)
    jobs = workload(args.requests, args.seed)
    mismatches = prompt_tokens = 0
    start = time.perf_counter()
    for i, (prompt, answer_len) in enumerate(jobs, 1):
        mismatches += serve(engine, prompt, answer_len, rng)
        prompt_tokens += len(prompt)
        if i % 250 == 0 or i == len(jobs):
            s = cache.stats()
            print(
                f"  {i:>6}/{len(jobs)} requests  state hits {s['state_hits']}  "
                f"mismatches {mismatches}",
                file=sys.stderr,
            )
    seconds = time.perf_counter() - start
    try:
        cache.audit()
        audit = "pass"
    except rc.InvariantError as e:
        audit = f"FAIL: {e}"
    s = cache.stats()
    cache.evict(kv_tokens=args.kv_slots, mamba_states=args.mamba_slots)
    full = cache.available_kv() == args.kv_slots and cache.available_mamba() == args.mamba_slots
    print(f"requests            {len(jobs)} ({s['aborts']} aborted for lack of room)")
    print(f"prompt tokens       {prompt_tokens}")
    print(f"reused tokens       {s['hit_tokens']} ({s['state_hits']} state hits)")
    print(f"state copies        {engine.copies} (copy-on-write and checkpoints)")
    print(
        f"evicted             {s['evicted_kv_tokens']} KV tokens, "
        f"{s['evicted_mamba_states']} states ({s['tombstones']} tombstones)"
    )
    print(f"oracle mismatches   {mismatches}")
    print(f"audit               {audit}")
    print(f"pools full at end   {full}")
    print(f"time                {seconds * 1e6 / len(jobs):.0f} us per request (incl. the model)")
    return 0 if mismatches == 0 and audit == "pass" and full else 1


if __name__ == "__main__":
    raise SystemExit(main())
