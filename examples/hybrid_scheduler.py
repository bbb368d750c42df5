"""Serve a chat workload for a hybrid (attention + Mamba) model through the request API.

A small scheduler drives radixcache the way a serving engine does, and a stand-in
"model" makes every answer checkable: the KV entry of position p is a hash of
(token, p), and the Mamba state of a sequence is a hash chain over all its tokens. radixcache's
`TransferEngine` runs the cache's transfer batches (copy-on-write of states, backups to
the host tier, load-backs from it) on an `rc.Storage` (numpy arrays on a CPU-only
machine, two layers of K, V, conv and SSM state). If
any request ever read a KV slot or a state that did not hold exactly its own prefix's
data, the check after each step would count a mismatch: the run prints 0 mismatches and
a passing audit, or says what went wrong.

Per request: admit (reuse the cached prefix, copy its state), run the copy batch, load
back what only the host still has (a guard: called off or failed, it gives everything
back), extend with the rest of the prompt, checkpoint at the branch point (so the next
request sharing this prompt reuses it), decode a few tokens, finish (cache it all,
donate the state). Device pools are deliberately small, so nodes are demoted to the
host tier and loaded back. `--inject-failures R` makes each copy batch fail with
probability R, exercising every failure path.

    python examples/hybrid_scheduler.py [--requests N] [--seed S] [--mamba-slots N]
        [--kv-slots N] [--host-kv-slots N] [--host-mamba-slots N]
        [--write-policy P] [--inject-failures R]
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


class CopyFailed(RuntimeError):
    """An injected failure of a transfer batch (a CUDA error, a lost host page)."""


class FaultyEngine(rc.TransferEngine):
    """radixcache's transfer engine, failing each batch's copies with a given probability.

    The engine fails the batch (a failed copy is a miss: the cache undoes it and a
    request recomputes); `run` then returns False.
    """

    def __init__(
        self, cache: rc.HybridCache, storage: rc.Storage, failure_rate: float, seed: int
    ) -> None:
        super().__init__(cache, storage)
        self.failure_rate = failure_rate
        self.rng = random.Random(seed)

    def copy_batch(self, batch: rc.TransferBatch) -> None:
        if self.rng.random() < self.failure_rate:
            raise CopyFailed(f"injected failure of batch {batch.id} ({batch.kind})")
        super().copy_batch(batch)


def checksum_storage(cache: rc.HybridCache) -> rc.Storage:
    """Storage for the stand-in model: two layers of K, V, conv and SSM, one int64 each."""
    return rc.Storage.for_cache(
        cache,
        layers=2,
        kv_heads=1,
        head_dim=1,
        conv_shape=(1,),
        ssm_shape=(1,),
        dtype="int64",
        ssm_dtype="int64",
    )


class Model:
    """A stand-in hybrid model writing checkable values into every layer of the storage.

    KV: K holds kv_entry(token, position) and V its complement, in every layer. State: the
    hash chain over the sequence in every layer of conv, and its complement in SSM.
    """

    def __init__(self, engine: rc.TransferEngine) -> None:
        self.engine = engine
        self.cache = engine.cache
        self.k, self.v = engine.storage.kv["device"]
        self.conv, self.ssm = engine.storage.mamba["device"]
        self.reused = 0

    def run_batches(self) -> None:
        """Run every batch the cache emitted (copy-on-write, backups) and acknowledge it."""
        self.engine.run_pending()

    def extend(self, req: rc.Request, tokens: list[int]) -> np.ndarray | None:
        """Slots for `tokens`; under write-back, runs the backups of evicted nodes (whose
        slots free only when they complete) and retries once before giving up."""
        slots = self.cache.extend(req, tokens)
        if slots is None:
            self.run_batches()
            slots = self.cache.extend(req, tokens)
        return slots

    def forward(self, req: rc.Request, slots: np.ndarray, tokens: list[int]) -> None:
        """Feed `tokens` (already given `slots` by extend): write their KV, step the state."""
        start = len(req.tokens) - len(tokens)
        entries = np.array([kv_entry(t, start + i) for i, t in enumerate(tokens)])
        self.k[:, slots, 0, 0] = entries
        self.v[:, slots, 0, 0] = ~entries
        slot = req.mamba_slot
        assert slot is not None
        state = int(self.conv[0, slot, 0]) if start > 0 else 0
        for t in tokens:
            state = step_state(state, t)
        self.conv[:, slot, 0] = state
        self.ssm[:, slot, 0] = ~state

    def check(self, req: rc.Request) -> int:
        """Mismatches between what the request reads and what its prefix must hold."""
        toks = [int(t) for t in req.tokens]
        want = np.array([kv_entry(t, p) for p, t in enumerate(toks)], dtype=np.int64)
        kv = req.kv_indices
        bad = int(np.count_nonzero((self.k[:, kv, 0, 0] != want).any(axis=0)))
        bad += int(np.count_nonzero((self.v[:, kv, 0, 0] != ~want).any(axis=0)))
        if toks and req.mamba_slot is not None:
            state = 0
            for t in toks:
                state = step_state(state, t)
            slot = req.mamba_slot
            bad += int((self.conv[:, slot, 0] != state).any())
            bad += int((self.ssm[:, slot, 0] != ~state).any())
        return bad


def workload(n: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, answer): shared system prompts and growing conversations.

    The answer is what the model "generates" (decided here so that runs repeat); the
    next turn of a conversation is its previous prompt, the answer and a new message.
    """
    rng = random.Random(seed)

    def tokens(lo: int, hi: int) -> list[int]:
        return [rng.randrange(32_000) for _ in range(rng.randint(lo, hi))]

    systems = [tokens(48, 96) for _ in range(3)]
    chats: list[list[int]] = []
    out = []
    for _ in range(n):
        if chats and rng.random() < 0.5:
            i = rng.randrange(len(chats))
            chats[i] = chats[i] + tokens(4, 24)
        else:
            chats.append(rng.choice(systems) + tokens(8, 8))
            i = len(chats) - 1
        answer = tokens(2, 8)
        out.append((chats[i], answer))
        chats[i] = chats[i] + answer
        if len(chats) > 24:
            chats.pop(0)
    return out


def serve(engine: Model, prompt: list[int], answer: list[int]) -> int:
    """One request end to end; returns the mismatches seen (0 when all is well)."""
    cache = engine.cache
    req = cache.admit(prompt)
    while req is None:  # no state slot for its copy: let the cache evict and retry
        cache.evict(mamba_states=1)
        engine.run_batches()  # under write-back, evicted slots free once backed up
        req = cache.admit(prompt)
    engine.run_batches()  # the copy-on-write of the reused state, before any compute
    if req.host_len > 0:  # the rest of the cached prefix is on the host: load it back
        lb = cache.load_back(req, mem_quota=4096)
        if lb is None:  # under write-back, room frees once backups complete: retry once
            engine.run_batches()
            lb = cache.load_back(req, mem_quota=4096)
        if lb is not None:
            with lb:  # leaving the block uncommitted gives every slot back
                if engine.engine.run(lb.batch):
                    lb.commit()
                # else: the request keeps what it had and recomputes the rest
    bad = engine.check(req)
    engine.reused += req.prefix_len
    # Prefill up to the branch point, checkpoint there, then the rest of the prompt.
    cut = req.branch_len if req.prefix_len < req.branch_len < len(prompt) else len(prompt)
    for chunk in (prompt[req.prefix_len : cut], prompt[cut:]):
        if not chunk:
            continue
        slots = engine.extend(req, chunk)
        if slots is None:
            cache.abort(req)
            return bad
        engine.forward(req, slots, chunk)
        if len(req.tokens) == cut < len(prompt):
            cache.checkpoint(req)
            engine.run_batches()
            bad += engine.check(req)
    for t in answer:  # decode
        token = [t]
        slots = engine.extend(req, token)
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
    ap.add_argument("--kv-slots", type=int, default=4096)
    ap.add_argument("--mamba-slots", type=int, default=16)
    ap.add_argument("--host-kv-slots", type=int, default=16_384)
    ap.add_argument("--host-mamba-slots", type=int, default=128)
    ap.add_argument(
        "--write-policy",
        default="write_through",
        choices=["write_through", "write_through_selective", "write_back"],
    )
    ap.add_argument("--inject-failures", type=float, default=0.0, metavar="RATE")
    args = ap.parse_args(argv)

    cache = rc.HybridCache(
        kv_slots=args.kv_slots,
        mamba_slots=args.mamba_slots,
        host_kv_slots=args.host_kv_slots,
        host_mamba_slots=args.host_mamba_slots if args.host_kv_slots else 0,
        write_policy=args.write_policy,
    )
    storage = checksum_storage(cache)
    transfers = FaultyEngine(cache, storage, args.inject_failures, args.seed + 2)
    engine = Model(transfers)
    jobs = workload(args.requests, args.seed)
    mismatches = prompt_tokens = 0
    start = time.perf_counter()
    for i, (prompt, answer) in enumerate(jobs, 1):
        mismatches += serve(engine, prompt, answer)
        prompt_tokens += len(prompt)
        if i % 250 == 0 or i == len(jobs):
            s = cache.stats()
            print(
                f"  {i:>6}/{len(jobs)} requests  state hits {s['state_hits']}  "
                f"load-backs {s['load_backs_committed']}  mismatches {mismatches}",
                file=sys.stderr,
            )
    seconds = time.perf_counter() - start
    try:
        cache.audit()
        audit = "pass"
    except rc.InvariantError as e:
        audit = f"FAIL: {e}"
    s = cache.stats()
    # Drain: evict everything. Under write-back an evicted node is backed up first and
    # freed when its backup completes; only then is its parent a leaf: repeat.
    while cache.evict(kv_tokens=args.kv_slots, mamba_states=args.mamba_slots).kv_tokens:
        engine.run_batches()
    full = cache.available_kv() == args.kv_slots and cache.available_mamba() == args.mamba_slots
    print(f"requests            {len(jobs)} ({s['aborts']} aborted for lack of room)")
    print(f"prompt tokens       {prompt_tokens}")
    print(f"reused tokens       {engine.reused} ({s['state_hits']} state hits)")
    print(f"host hits           {s['host_hit_tokens']} tokens found on the host tier")
    print(
        f"load-backs          {s['load_backs_committed']} committed "
        f"({s['loaded_tokens']} tokens), {s['load_backs_called_off']} called off, "
        f"{s['load_backs_failed']} failed"
    )
    print(
        f"backups             {s['backups_done']} done, {s['backups_failed']} failed, "
        f"{s['backups_skipped']} nodes skipped; {s['demotions']} demotions, "
        f"{s['host_evictions']} host evictions"
    )
    e = transfers.stats()
    print(
        f"copies              {e['slots_copied']} slots, {e['bytes_copied']} bytes in "
        f"{e['batches_completed']} batches ({e['batches_failed']} failed)"
    )
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
