"""The terms of the ``radixcache replay`` and ``bench`` reports, explained once.

`SECTIONS` holds the text; ``radixcache glossary`` prints `markdown()`, and
docs/glossary.md is that output (a test keeps them equal), so the wheel and the
repository read the same words. Every row the reports print is a term here (a test
checks that too); the JSON keys are docs/serving.md's.
"""

from __future__ import annotations

__all__ = ["SECTIONS", "markdown", "terms"]

#: ``(section title, ((term, explanation), ...))``, in the order of the reports.
SECTIONS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    (
        "Requests and tokens",
        (
            ("requests", "Requests served (finished). The note counts two kinds of trouble."),
            (
                "retractions",
                "Running requests sent back to the queue to free memory for others; "
                "their tokens are computed again when they come back.",
            ),
            (
                "rejected",
                "Requests that could not be served even alone (too big for a pool). Any "
                "rejection fails the run (exit 1).",
            ),
            ("prompt tokens", "Tokens of every request's prompt: what hit rates divide by."),
            (
                "computed",
                "Prompt tokens the model computed (`prefill_tokens`): those no tier held, "
                "and those a retracted request computes again.",
            ),
            ("output tokens", "Tokens decoded (the workload's recorded outputs, fed back)."),
            (
                "model",
                "The model's layers: `hybrid` (full attention + Mamba states), `attention`, "
                "`swa` (sliding-window + full attention), `swa-hybrid` (all three); an SWA "
                "model's note gives its window.",
            ),
        ),
    ),
    (
        "Hits, by tier",
        (
            (
                "device hit tokens",
                "Prompt tokens whose KV a request found on the device at admission and could "
                "use: in a hybrid model only up to the deepest cached state (a state is "
                "valid only at its own position). The note is their share of the prompt "
                "tokens, the device hit rate (`device_hit_rate`).",
            ),
            (
                "host hit tokens",
                "Prompt tokens loaded back from the host tier (KV, and the state at their "
                "end) instead of computed.",
            ),
            (
                "restored hit tokens",
                "Prompt tokens whose KV was still on the device but whose state was not: a "
                "load-back copied only the state from the host, and the device KV became "
                "usable. Counted apart from the device and host hits.",
            ),
            (
                "L3 hit tokens",
                "Prompt tokens fetched from the L3 store into the host tier, then loaded "
                "back (with `--l3`).",
            ),
            (
                "hit rate, all tiers",
                "Device, host and L3 hit tokens over prompt tokens (`hit_rate`); the "
                "restored hits are their own row.",
            ),
            (
                "device hit rate",
                "(`bench`) Device hit tokens over prompt tokens: no model runs, so nothing "
                "is loaded back.",
            ),
        ),
    ),
    (
        "Comparisons",
        (
            (
                "attention-only device hit rate",
                "The device hit rate of the same replay with the states turned off (an "
                "attention-only model, whose every cached KV prefix is usable): same "
                "workload, pools and scheduler. The note divides this model's device hit "
                "rate by it (`hit_rate_ratio`). Device hits only: host, restored and L3 "
                "hits are in neither figure.",
            ),
            (
                "full-attention device hit rate",
                "SWA models: the device hit rate with the SWA layers as full attention "
                "(every token's KV kept); the note divides this model's device hit rate by "
                "it.",
            ),
            (
                "compute saved",
                "The share of the prefill compute (FLOPs, by the model's cost: attention "
                "grows with the position) that hits of every tier saved, restored ones "
                "included; the attention-only replay's beside it.",
            ),
            (
                "offline bound",
                "With `--offline-bound`: the device hit rate the best eviction order "
                "(Belady's rule, knowing the future) would get from the same state slots; "
                "the LRU model is the same model under least-recently-used eviction.",
            ),
        ),
    ),
    (
        "Scheduling",
        (
            (
                "eviction policy",
                "Which cached data goes first when memory is short (`lru`, `lfu`, "
                "`priority`, `state-value`). The value is the states' policy in a model "
                "with states, else the KV's; the note names the other components' where "
                "they differ.",
            ),
            (
                "schedule policy",
                "The admission order: `fcfs` (arrival) or `lpm` (longest cached prefix "
                "first, within a window of waiting requests, with at most a number of "
                "overtakes each); the note counts the scheduler steps (forward passes).",
            ),
            (
                "queue cuts",
                "With `--lookahead`: prefills stopped, and a state kept, where a waiting "
                "request's prompt leaves the prompt being computed.",
            ),
            (
                "queue wait",
                "Scheduler steps a request waited from its arrival to its first admission "
                "(mean; p99 and max in the note).",
            ),
            (
                "overtaken",
                "How many requests that arrived after a request were admitted before it "
                "(0 under `fcfs`; `lpm` bounds it with `--max-overtakes`).",
            ),
        ),
    ),
    (
        "What the cache did",
        (
            (
                "copy-on-write copies",
                "State copies: a request resuming from a cached state gets its own copy "
                "to advance, and the tree keeps the original.",
            ),
            (
                "checkpoints",
                "States the tree kept mid-prompt: at the end of prefill chunks and where "
                "prompts branch, so that later requests can resume there.",
            ),
            (
                "backups",
                "Copies of device KV (and states) to the host tier, by the write policy; "
                "failed ones are counted.",
            ),
            (
                "demotions",
                "Device evictions that kept the data on the host: the node lives on in "
                "the host tier and a later match loads it back (a host hit).",
            ),
            (
                "load-backs committed",
                "Copies from the host tier to the device that a request used; the note "
                "counts their KV tokens.",
            ),
            (
                "load-backs called off",
                "Load-backs not made: nothing to load, part of the path already on its "
                "way (busy), over the memory quota, no device room (room, state, swa), or "
                "released unused; the note counts each reason.",
            ),
            (
                "load-backs failed",
                "Load-back copies that failed after they were committed: the request "
                "computes those tokens instead.",
            ),
            (
                "evicted",
                "Device KV tokens and states evicted; a state used by a match had helped "
                "a request before it went (many of those: the state pool is short).",
            ),
            ("host evicted", "KV tokens deleted from the host tier to make room there."),
            (
                "SWA pages freed",
                "SWA models: SWA KV pages given back because their tokens left every "
                "window, or evicted; a tombstone is a cached node that kept its full KV "
                "but lost its SWA KV, and a revived page got it back.",
            ),
            (
                "injected failures",
                "With `--inject-failures`: transfer batches refused or failed on purpose, "
                "per point of failure; the run must stay correct.",
            ),
            (
                "throughput",
                "Requests and tokens per second of the whole replay, the stand-in model "
                "included: not a serving speed.",
            ),
        ),
    ),
    (
        "The L3 store",
        (
            (
                "L3 store",
                "With `--l3`: bytes fetched and stored and their speed; corrupt objects "
                "(failed their checks: deleted, and a miss); foreign objects (intact, but "
                "of another model, rank, layout or kind: deleted, and a miss); missing "
                "objects (announced, then gone).",
            ),
            (
                "L3 errors",
                "With `--l3`: store calls that failed, by cause (connection refused, "
                "authentication failed, timeout, protocol error, ...), and the breaker "
                "(`closed`: calls go to the store; `open`: after errors in a row the "
                "store is skipped for a while; `half_open`: one call tries it again). The "
                "first error of each cause is also printed on stderr when it happens.",
            ),
            (
                "L3 prefetches",
                "With `--l3-prefetch`: fetches started in the background while the "
                "request waited, those called off at the timeout, and the steps waited.",
            ),
            (
                "fleet hit rate",
                "With `--servers N`: the fleet's hit rate, all tiers (device, host and L3 "
                "in the note).",
            ),
            (
                "one server, every request",
                "The same workload on one server with the same pools, all tiers: what a "
                "router that always picks the same server would get.",
            ),
            ("fleet without L3", "The same fleet with no L3 store, all tiers."),
        ),
    ),
    (
        "Checks",
        (
            (
                "oracle mismatches",
                "Sampled outputs that differ from the no-cache reference: a cache that "
                "served a wrong byte makes them non-zero. Must be 0.",
            ),
            ("audit", "The cache's own check of its books after the run. Must pass."),
            (
                "pools full at end",
                "Every pool is whole again once the cache is cleared: nothing leaked. Must "
                "be True.",
            ),
        ),
    ),
    (
        "bench",
        (
            ("tokens passed as", "Lists or NumPy arrays (`--numpy`)."),
            (
                "cache time per request",
                "Time in cache calls per request (median; p99 and mean in the note).",
            ),
            ("per prompt token", "Cache time per prompt token."),
            (
                "cache time in all",
                "All the time spent in cache calls, beside the whole run's (the rest is "
                "the scheduler).",
            ),
            ("memory", "Growth of the process's resident memory over the run, and its peak."),
            (
                "operation",
                "A cache method the scheduler called: its calls, median (p50) and p99 "
                "time in microseconds, and its share of the cache time.",
            ),
        ),
    ),
)


def terms() -> dict[str, str]:
    """Return every term and its explanation."""
    return {term: text for _, entries in SECTIONS for term, text in entries}


def markdown() -> str:
    """Return the glossary as Markdown (what ``radixcache glossary`` prints)."""
    lines = [
        "# Glossary: the reports of `radixcache replay` and `bench`",
        "",
        "What each row and note of the reports means, once. This is `radixcache glossary`'s",
        "output (the text lives in `python/radixcache/glossary.py`); the JSON keys are listed",
        'in docs/serving.md, "The report".',
    ]
    for title, entries in SECTIONS:
        lines += ["", f"## {title}", ""]
        lines += [f"- **{term}**: {text}" for term, text in entries]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
