"""KV events for cache-aware routers: page hashes, wire encoders, a publisher and a subscriber.

A router that knows which prompt prefixes each worker holds can send a returning
conversation to the worker that has its cache. SGLang and vLLM tell routers through *KV
events*: batches of "these pages were stored / removed / everything was cleared",
msgpack-encoded and published on a ZMQ PUB socket with a sequence number, with a ROUTER
socket that replays recent batches to a subscriber that joined late or lost some.
This package speaks both wire formats (``format="sglang"``, SGLang 0.5.23's, or
``format="vllm"``) so that existing routers index a radixcache worker unchanged, and adds
what neither engine publishes: where a hybrid model's recurrent (Mamba) state exists, the
only places a hybrid prefix hit is usable (docs/events.md, "State availability").

- `page_hashes` and `sglang_namespace_seed` (`radixcache.events.chain`): the page hash
  chain (SGLang HiCache's), pure Python, so that a router computes a prompt's hashes
  itself; `wire_hash`, the integer that stands for a page hash on the wire.
- `encode_batch` / `decode_batch` (`radixcache.events.codec`): one batch of events to and
  from the wire bytes.
- `RouterIndex` (`radixcache.events.index`): the reference consumer's view of a worker:
  per tier, which pages are present and which carry a state; `RouterIndex.usable_prefix`
  answers how much of a prompt a worker would reuse.
- `KvEventPublisher` (`radixcache.events.publisher`): the PUB socket, sequence numbers,
  the replay buffer and socket; `KvEventSubscriber` (`radixcache.events.subscriber`): the
  SUB socket that keeps a `RouterIndex` up to date, with replays on join and on gaps. The
  sockets and frames they share: `radixcache.events.transport`.

The publisher and the subscriber need the optional dependencies pyzmq and msgpack
(``pip install "radixcache[events]"``); they are imported only when used, so importing
this package (and `radixcache`) needs neither.
"""

# FORMATS, HASH_LEN and logger were public names of the module before it became this
# package, though not in __all__: they stay (`as`: re-exported for type checkers too).
from .chain import FORMATS as FORMATS
from .chain import HASH_LEN as HASH_LEN
from .chain import Format, page_hashes, sglang_namespace_seed, wire_hash
from .codec import (
    KINDS,
    MEDIA,
    STATE_HASHES_KEY,
    STATE_KEY,
    CacheEvent,
    DecodedBatch,
    DecodedEvent,
    EventDecodeError,
    decode_batch,
    encode_batch,
)
from .index import RouterIndex, SequenceGap
from .publisher import KvEventPublisher
from .subscriber import KvEventSubscriber
from .transport import logger as logger

__all__ = [
    "KINDS",
    "MEDIA",
    "STATE_HASHES_KEY",
    "STATE_KEY",
    "CacheEvent",
    "DecodedBatch",
    "DecodedEvent",
    "EventDecodeError",
    "Format",
    "KvEventPublisher",
    "KvEventSubscriber",
    "RouterIndex",
    "SequenceGap",
    "decode_batch",
    "encode_batch",
    "page_hashes",
    "sglang_namespace_seed",
    "wire_hash",
]
