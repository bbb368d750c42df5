"""radixcache: a prefix-cache manager for hybrid LLMs with a Rust core.

The cache is re-exported from the compiled extension ``radixcache._core`` (see
``_core.pyi`` for its documented API); `Storage` and `TransferEngine` move the bytes;
`ObjectStore` is the L3 tier's store (Redis, Redis Cluster or files), `Breaker` its
circuit breaker.
"""

from radixcache._core import (
    Breaker,
    CacheError,
    Copy,
    Evicted,
    HybridCache,
    Insert,
    InvariantError,
    KvEvent,
    L3Error,
    LoadBack,
    Lock,
    LockError,
    Match,
    Node,
    ObjectStore,
    Request,
    StaleNodeError,
    TransferBatch,
    __version__,
    chain_hashes,
)
from radixcache.engine import TransferEngine
from radixcache.storage import Storage

__all__ = [
    "Breaker",
    "CacheError",
    "Copy",
    "Evicted",
    "HybridCache",
    "Insert",
    "InvariantError",
    "KvEvent",
    "L3Error",
    "LoadBack",
    "Lock",
    "LockError",
    "Match",
    "Node",
    "ObjectStore",
    "Request",
    "StaleNodeError",
    "Storage",
    "TransferBatch",
    "TransferEngine",
    "__version__",
    "chain_hashes",
]
