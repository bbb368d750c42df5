"""Write the seeds of the `store` fuzz target into ``fuzz/corpus/store``.

Each seed is a mode byte (`fuzz_targets/store.rs`: 0 data replies, 1 topology replies,
2 a `GET` pipeline's heads and values, 3 a raw frame, 4 a frame round trip) and the bytes
a store might send: every reply kind, the hostile ones the tests send (a huge or
negative length, a line without its end), a `CLUSTER SLOTS` answer, frames. Run it again
(and commit what changed) when the target's input format changes:

    python fuzz/seeds/store.py
"""

from __future__ import annotations

import hashlib
from pathlib import Path

REPLIES = [
    b"+OK\r\n",
    b"+PONG\r\n",
    b"-ERR unknown command\r\n",
    b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n",
    b"-MOVED 3999 127.0.0.1:6381\r\n",
    b":1\r\n:0\r\n:-7\r\n",
    b"$5\r\nhello\r\n$0\r\n\r\n$-1\r\n",
    b"$9000000000000000000\r\n",
    b"$-2\r\n",
    b"*-3\r\n",
    b"$3\r\nabcde",
    b"+" + b"a" * 300,
    b":12x\r\n",
    b"*2\r\n$1\r\na\r\n:1\r\n",
]

#: A `CLUSTER SLOTS` answer: three masters, one with a replica.
SLOTS = (
    b"*3\r\n"
    b"*3\r\n:0\r\n:5460\r\n*3\r\n$9\r\n127.0.0.1\r\n:7000\r\n$2\r\nid\r\n"
    b"*4\r\n:5461\r\n:10922\r\n*3\r\n$0\r\n\r\n:7001\r\n$2\r\nid\r\n"
    b"*3\r\n$9\r\n127.0.0.1\r\n:7004\r\n$2\r\nid\r\n"
    b"*3\r\n:10923\r\n:16383\r\n*2\r\n$1\r\n?\r\n:7002\r\n"
)


def frame_input(payload: bytes) -> bytes:
    """Return a round-trip input (mode 4): hash, position, mask, payload."""
    return bytes(range(32)) + (17).to_bytes(4, "little") + b"\x01" + payload


def seeds() -> list[bytes]:
    """Return every seed, its mode byte first."""
    out = [bytes([0]) + r for r in REPLIES]
    out += [bytes([1]) + SLOTS, bytes([1]) + b"*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n:1\r\n"]
    out += [bytes([2]) + b"$5\r\nhello\r\n$-1\r\n$3\r\nabc\r\n-WRONGTYPE x\r\n"]
    out += [bytes([2]) + b"$100000\r\n" + b"x" * 1000]
    # Raw frames: a header's worth of bytes with the magic, and less.
    header = b"RCL3" + (1).to_bytes(2, "little") + bytes(2) + (4).to_bytes(8, "little")
    out += [bytes([3]) + bytes(32) + (4).to_bytes(4, "little") + header + bytes(40) + b"page"]
    out += [bytes([3]) + b"short"]
    out += [bytes([4]) + frame_input(b""), bytes([4]) + frame_input(b"a page of bytes" * 20)]
    return out


def main() -> None:
    """Write the seeds, each named by its SHA-1 as libFuzzer names its inputs."""
    corpus = Path(__file__).resolve().parent.parent / "corpus" / "store"
    corpus.mkdir(parents=True, exist_ok=True)
    for seed in seeds():
        (corpus / hashlib.sha1(seed).hexdigest()).write_bytes(seed)


if __name__ == "__main__":
    main()
