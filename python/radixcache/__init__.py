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

#: The modules ``import radixcache`` loaded before its names were loaded on first use.
_MODULES = ("_core", "_kernels", "engine", "storage")

if not TYPE_CHECKING:  # type checkers see the imports above, never a module __getattr__

    def __getattr__(name):
        """Load the package on first use of a name (then they are ordinary attributes).

        A module it used to load (``rc._core``) loads alone. The first public name
        loads what ``import radixcache`` used to: the extension, the engine and storage
        modules, and NumPy with them, so that nothing later (the extension building an
        array under its lock) is the first to import NumPy.
        """
        import importlib

        if name in _MODULES:  # `from radixcache import _core` asks here first
            return importlib.import_module(f"radixcache.{name}")
        if name not in __all__:
            raise AttributeError(f"module 'radixcache' has no attribute {name!r}")
        core = importlib.import_module("radixcache._core")
        homes = {
            "TransferEngine": importlib.import_module("radixcache.engine"),
            "Storage": importlib.import_module("radixcache.storage"),
        }
        for public in __all__:
            globals()[public] = getattr(homes.get(public, core), public)
        return globals()[name]

    def __dir__():
        return sorted({*globals(), *__all__})
