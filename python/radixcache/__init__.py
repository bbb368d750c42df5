"""radixcache: a prefix-cache manager for hybrid LLMs with a Rust core.

Everything here is re-exported from the compiled extension ``radixcache._core``; see
``_core.pyi`` for the documented API.
"""

from radixcache._core import (
    CacheError,
    Evicted,
    HybridCache,
    Insert,
    InvariantError,
    Lock,
    LockError,
    Match,
    Node,
    StaleNodeError,
    __version__,
)

__all__ = [
    "CacheError",
    "Evicted",
    "HybridCache",
    "Insert",
    "InvariantError",
    "Lock",
    "LockError",
    "Match",
    "Node",
    "StaleNodeError",
    "__version__",
]
