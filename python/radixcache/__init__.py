"""radixcache: a prefix-cache manager for hybrid LLMs with a Rust core.

The cache is re-exported from the compiled extension ``radixcache._core`` (see
``_core.pyi`` for its documented API); `Storage` and `TransferEngine` move the bytes;
`ObjectStore` is the L3 tier's store (Redis, Redis Cluster or files), `Breaker` its
circuit breaker.

The names are loaded on first use (PEP 562): ``import radixcache`` runs nothing else, so
that the ``radixcache`` command handles Ctrl-C from its first moment (the extension and
NumPy load inside it, where an interrupt ends it with ``interrupted``).
"""

# Not `typing.TYPE_CHECKING`: importing typing would cost the command a few milliseconds
# in which Ctrl-C prints a traceback. Type checkers take any name TYPE_CHECKING as true.
TYPE_CHECKING = False
if TYPE_CHECKING:
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

#: The module of each name of `__all__` that is not the extension's.
_HOMES = {"TransferEngine": "radixcache.engine", "Storage": "radixcache.storage"}

if not TYPE_CHECKING:  # type checkers see the imports above, never a module __getattr__

    def __getattr__(name):
        """Load a public name on first use (then it is an ordinary attribute)."""
        if name not in __all__:
            raise AttributeError(f"module 'radixcache' has no attribute {name!r}")
        import importlib

        value = getattr(importlib.import_module(_HOMES.get(name, "radixcache._core")), name)
        globals()[name] = value
        return value

    def __dir__():
        return sorted({*globals(), *__all__})
