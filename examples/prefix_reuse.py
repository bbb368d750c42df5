"""Drive a radixcache the way a serving engine's scheduler does, and say what happened.

A synthetic chat workload (a few shared system prompts, multi-turn conversations that
grow turn by turn, and some unrelated one-off prompts) runs through a deliberately
small KV cache, so that prefixes are reused, nodes split and old conversations are
evicted. For every request the scheduler:

1. matches the prompt against the cache and locks what it reuses,
2. allocates KV slots for the uncached rest and the answer (evicting if short),
3. "runs the model" (nothing here: this example moves no tensors),
4. inserts prompt + answer, handing its slots to the cache, and unlocks.

It prints the hit rate, what was evicted, the final tree's size and the audit result.

    python examples/prefix_reuse.py [--requests N] [--seed S] [--kv-slots N] [--page-size P]
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import numpy as np

import radixcache as rc


def workload(n: int, seed: int) -> list[list[int]]:
    """Prompts: shared system prompts, growing conversations, unrelated prompts."""
    rng = random.Random(seed)
    vocab = 32_000

    def text(k: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(k)]

    systems = [text(rng.randint(200, 400)) for _ in range(4)]
    chats: list[list[int]] = []
    prompts = []
    for _ in range(n):
        roll = rng.random()
        if roll < 0.5 and chats:  # the next turn of a running conversation
            i = rng.randrange(len(chats))
            chats[i] = chats[i] + text(rng.randint(20, 120))
            prompts.append(chats[i])
        elif roll < 0.85:  # a new conversation under a system prompt
            chats.append(rng.choice(systems) + text(rng.randint(20, 100)))
            prompts.append(chats[-1])
        else:  # an unrelated prompt
            prompts.append(text(rng.randint(50, 300)))
    return prompts


def serve(cache: rc.HybridCache, prompt: list[int], answer_len: int) -> tuple[int, bool]:
    """One request through the low-level API; returns (reused tokens, served?)."""
    ps = cache.page_size
    m = cache.match_prefix(prompt)
    with cache.lock(m.node):  # keep the reused prefix while we allocate
        need = len(prompt) - m.device_len + answer_len
        slots = cache.alloc_kv(-(-need // ps) * ps)
        if slots is None:
            return m.device_len, False  # no room even after eviction: retry later
        # ... the model runs here, reading m.kv_indices and writing `slots` ...
        tokens = prompt + [1] * answer_len
        kv = np.concatenate([m.kv_indices, slots[:need]])
        cache.insert(tokens, kv, owned_from=m.device_len)
    return m.device_len, True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-slots", type=int, default=65_536)
    ap.add_argument("--page-size", type=int, default=16)
    args = ap.parse_args(argv)

    cache = rc.HybridCache(kv_slots=args.kv_slots, page_size=args.page_size)
    prompts = workload(args.requests, args.seed)
    total = reused = refused = 0
    start = time.perf_counter()
    for i, prompt in enumerate(prompts, 1):
        hit, ok = serve(cache, prompt, answer_len=32)
        total += len(prompt)
        reused += hit
        refused += not ok
        if i % 500 == 0 or i == len(prompts):
            print(
                f"  {i:>6}/{len(prompts)} requests  hit rate {reused / total:6.1%}",
                file=sys.stderr,
            )
    seconds = time.perf_counter() - start
    cache.audit()
    s = cache.stats()
    print(f"requests            {len(prompts)} ({refused} refused for lack of room)")
    print(f"prompt tokens       {total}")
    print(f"reused from cache   {reused} ({reused / total:.1%})")
    print(f"evicted             {s['evicted_kv_tokens']} tokens in {s['evicted_nodes']} nodes")
    print(f"cached now          {cache.total_size()} tokens in {s['nodes']} nodes")
    print(f"free slots          {cache.available_kv()} of {args.kv_slots}")
    print(f"cache time          {seconds * 1e6 / len(prompts):.1f} us per request (incl. Python)")
    print("audit               pass")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
