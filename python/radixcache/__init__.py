"""radixcache: a prefix-cache manager for hybrid LLMs with a Rust core.

Everything here is re-exported from the compiled extension ``radixcache._core``; see
``_core.pyi`` for the documented API.
"""

from radixcache._core import (
    CacheError,
    Copy,
    Evicted,
    HybridCache,
    Insert,
    InvariantError,
    LoadBack,
    Lock,
    LockError,
    Match,
    Node,
    Request,
    StaleNodeError,
    TransferBatch,
    __version__,
)

__all__ = [
    "CacheError",
    "Copy",
    "Evicted",
    "HybridCache",
    "Insert",
    "InvariantError",
    "LoadBack",
    "Lock",
    "LockError",
    "Match",
    "Node",
    "Request",
    "StaleNodeError",
    "TransferBatch",
    "__version__",
]
