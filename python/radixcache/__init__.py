"""radixcache: a prefix-cache manager for hybrid LLMs with a Rust core.

The cache is re-exported from the compiled extension ``radixcache._core`` (see
``_core.pyi`` for its documented API); `Storage` and `TransferEngine` move the bytes.
"""

from radixcache._core import (
    CacheError,
    Copy,
    Evicted,
    HybridCache,
    Insert,
    InvariantError,
    KvEvent,
    LoadBack,
    Lock,
    LockError,
    Match,
    Node,
    Request,
    StaleNodeError,
    TransferBatch,
    __version__,
    chain_hashes,
)
from radixcache.engine import TransferEngine
from radixcache.storage import Storage

__all__ = [
    "CacheError",
    "Copy",
    "Evicted",
    "HybridCache",
    "Insert",
    "InvariantError",
    "KvEvent",
    "LoadBack",
    "Lock",
    "LockError",
    "Match",
    "Node",
    "Request",
    "StaleNodeError",
    "Storage",
    "TransferBatch",
    "TransferEngine",
    "__version__",
    "chain_hashes",
]
