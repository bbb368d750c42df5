"""radixcache as SGLang's prefix cache: ``--radix-cache-backend radixcache``.

Installing ``radixcache[sglang]`` registers the plugin ``radixcache`` in SGLang's
entry-point group ``sglang.srt.plugins``. SGLang runs `register` when its processes
load their plugins; `register` adds the backend name ``radixcache`` to SGLang's
radix-cache registry, so ``--radix-cache-backend radixcache`` builds a
`radixcache.sglang.backend.RadixCacheBackend` (a ``BasePrefixCache``) over SGLang's own
allocators. See docs/sglang.md.

This module imports SGLang only when `register` runs, and the backend module (torch,
SGLang) only when the factory builds a cache.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BACKEND_NAME", "create_backend", "register"]

#: The name ``--radix-cache-backend`` selects.
BACKEND_NAME = "radixcache"


def create_backend(ctx: Any) -> Any:
    """Build the backend from SGLang's ``TreeCacheBuildContext`` (the registry's factory).

    Raises:
        ValueError: the server asks for something the backend does not support; the
            message names the flag (see `radixcache.sglang.backend.create_backend`).
    """
    from radixcache.sglang.backend import create_backend as create

    return create(ctx)


def register() -> None:
    """Register `BACKEND_NAME` with SGLang's radix-cache registry (idempotent).

    Raises:
        ValueError: another factory is registered under the name already.
    """
    from sglang.srt.mem_cache.registry import (
        get_radix_cache_factory,
        register_radix_cache_backend,
    )

    existing = get_radix_cache_factory(BACKEND_NAME)
    if existing is create_backend:
        return
    register_radix_cache_backend(BACKEND_NAME, create_backend)
