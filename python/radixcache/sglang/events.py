"""KV cache events for SGLang's own publisher (``--kv-events-config``).

SGLang's scheduler takes a tree cache's events with ``take_events()`` and publishes them
as ``KVEventBatch`` es of its msgspec structs (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``) to the routers that follow it. `SglangEvents` turns the radixcache
core's events (``HybridCache(events=True)``) into exactly what SGLang 0.5.23's own radix
cache records for the same tree changes:

- the block hashes: in the default namespace, the first 8 bytes of each page's SHA-256
  chain hash as a signed int64 (the cache's page hashes are SGLang's chain byte for
  byte); in a namespace (``extra_key``, ``cache_salt``), SGLang's event chain (from no
  prior, or from the cache salt's seed) and its namespacing of the published hash by the
  LoRA name table or, with ``--kv-events-dynamo-format``, by both keys;
- one ``BlockStored`` per page, coalesced with the one before when it continues its
  chain, by SGLang's own recorder (``KVCacheEventRecorder``), and one ``BlockRemoved``
  per node, coalesced likewise; medium ``GPU``;
- ``AllBlocksCleared`` at every reset, the first one when the cache is built.

Mamba state events have no SGLang struct, so they are not published here; the
radixcache publisher (`radixcache.events`) carries them.
"""

from __future__ import annotations

import ast
import hashlib
from collections.abc import Iterable
from typing import Any

from sglang.srt.disaggregation.kv_events import (
    BlockRemoved,
    BlockStored,
    StorageMedium,
    kv_event_namespace_seed,
    namespaced_block_hash,
)
from sglang.srt.mem_cache.events import KVCacheEventRecorder

from radixcache import KvEvent, chain_hashes

__all__ = ["SglangEvents", "wire_int64"]


def wire_int64(page_hash: bytes) -> int:
    """SGLang's event hash of a SHA-256 page hash: its first 8 bytes, signed big-endian."""
    return int.from_bytes(page_hash[:8], "big", signed=True)


def _salt_seed(cache_salt: str) -> bytes:
    """Where SGLang's event chain of a salted namespace starts."""
    return hashlib.sha256(b"sglang-cache-salt-v1\0" + cache_salt.encode("utf-8")).digest()


class SglangEvents:
    """SGLang's KV events for one radixcache tree (see the module docs).

    Args:
        params: SGLang's ``CacheInitParams`` (``dynamo_kv_event_format``,
            ``kv_event_lora_names``).
        page_size: tokens per page.
    """

    def __init__(self, params: Any, page_size: int) -> None:
        self.page_size = page_size
        self.dynamo = bool(getattr(params, "dynamo_kv_event_format", False))
        self.recorder = KVCacheEventRecorder(
            enabled=True,
            page_size=page_size,
            dynamo_format=self.dynamo,
            lora_names=getattr(params, "kv_event_lora_names", None),
        )
        #: Per page of a named namespace on the device: the cache's page hash -> SGLang's
        #: event chain hash and the published int64 (the default namespace needs none).
        self._named: dict[bytes, tuple[bytes, int]] = {}
        self._keys: dict[str, tuple[str | None, str | None]] = {}

    def cleared(self) -> None:
        """Record ``AllBlocksCleared`` (the tree was emptied or replaced)."""
        self.recorder.record_all_cleared()
        self._named.clear()

    def add(self, events: Iterable[KvEvent]) -> None:
        """Record the core's events, oldest first."""
        for e in events:
            if e.kind == "cleared":
                self.cleared()
            elif e.kind == "stored" and e.medium == "GPU":
                self._stored(e)
            elif e.kind == "removed" and e.medium == "GPU":
                self._removed(e)

    def take(self) -> list[Any]:
        """Return the recorded events, oldest first, and forget them."""
        events: list[Any] = self.recorder.take()
        return events

    # ------------------------------------------------------------------ conversion

    def _key(self, namespace: str) -> tuple[str | None, str | None]:
        """Return the (extra_key, cache_salt) a backend namespace stands for."""
        key = self._keys.get(namespace)
        if key is None:
            key = self._keys[namespace] = ast.literal_eval(namespace)
        return key

    def _seed(self, extra_key: str | None, cache_salt: str | None) -> bytes | None:
        """SGLang's namespacing seed of the published hashes (its recorder's rule)."""
        seed: bytes | None
        if self.dynamo:
            seed = kv_event_namespace_seed(extra_key=extra_key, cache_salt=cache_salt)
        else:
            named = extra_key if self.recorder.lora_names.get(extra_key) is not None else None
            seed = kv_event_namespace_seed(extra_key=named, cache_salt=None)
        return seed

    def _lora_name(self, extra_key: str | None) -> str | None:
        names = self.recorder.lora_names
        name: str | None = names.resolve(extra_key) if self.dynamo else names.get(extra_key)
        return name

    def _stored(self, e: KvEvent) -> None:
        ps = self.page_size
        tokens = list(e.token_ids)
        if e.namespace is None:
            published = [wire_int64(h) for h in e.hashes]
            parent = None if e.parent_hash is None else wire_int64(e.parent_hash)
            extra_key = cache_salt = lora_name = None
        else:
            extra_key, cache_salt = self._key(e.namespace)
            seed = self._seed(extra_key, cache_salt)
            if e.parent_hash is None:
                prior = None if cache_salt is None else _salt_seed(cache_salt)
                parent = None
            else:
                prior, parent = self._named[e.parent_hash]
            chain = chain_hashes(tokens, ps, prior)
            published = [namespaced_block_hash(wire_int64(h), namespace_seed=seed) for h in chain]
            for ours, theirs, value in zip(e.hashes, chain, published):
                self._named[ours] = (theirs, value)
            lora_name = self._lora_name(extra_key)
        for i, block in enumerate(published):
            self.recorder.enqueue(
                BlockStored(
                    block_hashes=[block],
                    parent_block_hash=parent,
                    token_ids=tokens[i * ps : (i + 1) * ps],
                    block_size=ps,
                    lora_id=None,
                    medium=StorageMedium.GPU,
                    cache_salt=cache_salt,
                    session_id=None,
                    lora_name=lora_name,
                )
            )
            parent = block

    def _removed(self, e: KvEvent) -> None:
        if e.namespace is None:
            blocks = [wire_int64(h) for h in e.hashes]
        else:
            blocks = [self._named.pop(h)[1] for h in e.hashes]
        if blocks:
            self.recorder.enqueue(BlockRemoved(block_hashes=blocks, medium=StorageMedium.GPU))
