"""Write the L3 tier's seeds of the `ops` fuzz target into ``fuzz/corpus/ops``.

Each seed is an input that reaches the L3 paths in a few operations, which random
mutation finds only rarely: a put that lands (on backup, or on host eviction), the
pages gone from both tiers, then a fetch that lands and is loaded back; host room on
its way (fetches called off while an eviction put drains); the store's faults. The
bytes follow the target's input format (`fuzz_targets/ops.rs`, decoded by the
`arbitrary` crate): the configuration's ten bytes, then each operation after a
continue byte (odd), its kind's byte (weighted as `WEIGHTS`) and its fields; vectors
hold their elements the same way and end with an even byte. Run it again (and commit
what changed) when that format changes:

    python fuzz/seeds/l3.py
"""

from __future__ import annotations

import hashlib
from pathlib import Path

#: `WEIGHTS` of ops.rs, in its order: an operation's kind byte is its offset here.
WEIGHTS = [
    ("Match", 5),
    ("Insert", 10),
    ("AllocKv", 2),
    ("FreeKv", 2),
    ("AllocMamba", 1),
    ("FreeMamba", 1),
    ("Lock", 2),
    ("Unlock", 2),
    ("DropReceipt", 1),
    ("Evict", 5),
    ("EvictHost", 1),
    ("Admit", 5),
    ("Extend", 5),
    ("Checkpoint", 2),
    ("Finish", 3),
    ("Abort", 1),
    ("Take", 1),
    ("Engine", 3),
    ("Batch", 3),
    ("LoadBack", 6),
    ("Commit", 3),
    ("Cancel", 1),
    ("DropLoad", 1),
    ("Reap", 1),
    ("Report", 1),
    ("Foreign", 1),
    ("ExtendBatch", 3),
    ("L3Fetch", 4),
    ("L3Ack", 1),
]
KIND = {}
_at = 0
for _name, _w in WEIGHTS:
    KIND[_name] = _at
    _at += _w


def toks(base: int, tail: list[int], cut: int = 1) -> list[int]:
    """Return a `Toks`: `base` (0: none), `cut` (not a multiple of 4: no cut), the tail."""
    out = [base, cut]
    for b in tail:
        out += [1, b]
    return [*out, 0]


def insert(t: list[int], state: int = 0) -> list[int]:
    """Return an insert in the default namespace, fresh slots (`state` 2: with a state)."""
    return [KIND["Insert"], 0, *t, 0, 1, state, 0, 0, 0, 0, 0]


def engine() -> list[int]:
    """Return an engine step: take every batch and complete it."""
    return [KIND["Engine"], 0, 0]


def evict(kv: int = 255, states: int = 255) -> list[int]:
    """Return a device eviction (255: everything)."""
    return [KIND["Evict"], kv, states]


def evict_host(kv: int = 255, states: int = 255) -> list[int]:
    """Return a host eviction (`kv` and `states` as counts)."""
    return [KIND["EvictHost"], kv, states]


def fetch(t: list[int], end: int) -> list[int]:
    """Return an `L3Fetch`: (end // 8) % 8 is how it ends (2: now, 5: held); bit 7: claim less."""
    return [KIND["L3Fetch"], 0, *t, end]


def ack(fail: int = 0) -> list[int]:
    """Return an acknowledgement of the first fetch held."""
    return [KIND["L3Ack"], 0, fail]


def load_back(t: list[int]) -> list[int]:
    """Return a load-back of the host part of a match of `t`, committed at once."""
    return [KIND["LoadBack"], 0, 0, *t, 0, 0, 2]


def cfg(
    *, mamba: int = 0, host: int = 65, host_mamba: int = 0, l3: int = 0xC0, engine: int = 1
) -> list[int]:
    """Return a configuration: pages of 1 token, 32 device slots.

    `host` odd: (host // 2) host slots; `l3`: the `threshold` byte (0xc0: the L3 tier,
    | 0x20: written on host eviction, | 0x18: faults); `engine` 1: every batch completes
    after every operation, 0: only when told.
    """
    return [0, 28, mamba, host, host_mamba, 0, l3, 0, 0, engine]


def encode(config: list[int], ops: list[list[int]]) -> bytes:
    """Return the input's bytes."""
    out = list(config)
    for op in ops:
        out += [1, *op]
    return bytes([*out, 0])


A = toks(1, [1, 2])  # a system prompt and a tail: 10 tokens
B = toks(3, [0])
P1, P2, P3 = toks(0, [1, 2, 3]), toks(0, [2, 3, 1]), toks(0, [3, 1, 2])

SEEDS = {
    # Written once backed up; gone from both tiers; fetched and loaded back.
    "backup": encode(
        cfg(),
        [insert(A), engine(), engine(), evict(), evict_host(), fetch(A, 16), load_back(A)],
    ),
    # Hybrid, written on host eviction (pages and state drain under the put), fetched whole.
    "host_eviction_hybrid": encode(
        cfg(mamba=9, host_mamba=4, l3=0xE0),
        [insert(A, 2), engine(), evict(), evict_host(), engine(), fetch(A, 16), load_back(A)],
    ),
    # Eight host slots: an insert's backup evicts a prompt whose put drains (the backup
    # waits a round), fetches are called off while the room is on its way, then land;
    # held fetches acknowledged later, one claiming less than landed.
    "host_room": encode(
        cfg(host=17, l3=0xE0, engine=0),
        [
            insert(P1),
            engine(),
            insert(P2),
            engine(),
            evict(),
            engine(),
            insert(P3),
            engine(),
            insert(P3),
            engine(),
            fetch(P1, 16),
            fetch(P1, 40),
            engine(),
            fetch(P2, 40),
            ack(),
            fetch(P1, 16 | 0x80),
            engine(),
            evict(),
            evict_host(),
            engine(),
            fetch(P3, 40 | 0x40),
            ack(1),
        ],
    ),
    # Failed calls, lost and corrupt objects: partial and failed fetches.
    "faults_backup": encode(
        cfg(l3=0xD8),
        [
            insert(A),
            engine(),
            engine(),
            insert(B),
            engine(),
            engine(),
            evict(),
            evict_host(),
            fetch(A, 16),
            fetch(B, 16),
            fetch(A, 24),
            fetch(B, 8),
            fetch(A, 32 | 0x40),
            engine(),
        ],
    ),
    "faults_host_eviction_hybrid": encode(
        cfg(mamba=9, host_mamba=4, l3=0xF8, host=129),
        [
            insert(A, 2),
            engine(),
            insert(B, 2),
            engine(),
            evict(),
            evict_host(),
            engine(),
            fetch(A, 16),
            fetch(B, 16 | 0x40),
            fetch(A, 40),
            engine(),
            ack(),
        ],
    ),
}


def main() -> None:
    """Write each seed under its SHA-1, as libFuzzer names corpus files."""
    corpus = Path(__file__).resolve().parent.parent / "corpus" / "ops"
    for name, data in SEEDS.items():
        path = corpus / hashlib.sha1(data).hexdigest()
        path.write_bytes(data)
        print(f"{name}: {path.name}")


if __name__ == "__main__":
    main()
