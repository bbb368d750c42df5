"""What the L3 tier's tests share: one cache with its storage, tier and engine, and a store
whose reads (and writes) wait for the test."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from radixcache import Breaker, HybridCache, Storage
from radixcache.engine import TransferEngine
from radixcache.l3 import L3Tier

#: The model identity of the tests' tiers (one model unless a test says otherwise).
MODEL = "test-model@1"


class L3Cache:
    """One cache with its storage, L3 tier and engine.

    Args:
        store: The tier's store client.
        hybrid: With Mamba states (4 on each tier).
        page_size, kv_slots, host_kv: The cache's page size and KV pools.
        l3_write: The cache's ``l3_write``.
        events: The cache's ``events``.
        small: One layer of one head of 2 (else 2 layers of 2 heads of 4).
        breaker: The tier's circuit breaker (its default when None).
        model: The tier's model identity.
        tp_rank, tp_size: The tier's tensor-parallel rank and size.
    """

    def __init__(
        self,
        store: Any,
        *,
        hybrid: bool,
        page_size: int = 4,
        kv_slots: int = 64,
        host_kv: int = 128,
        l3_write: str = "backup",
        events: bool = False,
        small: bool = False,
        breaker: Breaker | None = None,
        model: str = MODEL,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        self.cache = HybridCache(
            kv_slots=kv_slots,
            page_size=page_size,
            mamba_slots=4 if hybrid else 0,
            host_kv_slots=host_kv,
            host_mamba_slots=4 if hybrid else 0,
            page_hashes=True,
            l3=True,
            l3_write=l3_write,  # type: ignore[arg-type]
            events=events,
        )
        n, width = (1, 2) if small else (2, 4)
        self.storage = Storage.for_cache(
            self.cache,
            layers=n,
            mamba_layers=n,
            kv_heads=n,
            head_dim=width,
            conv_shape=(width - 1,),
            ssm_shape=(2, n),
            dtype="float32",
            device="cpu",
        )
        self.tier = L3Tier(
            self.cache,
            self.storage,
            store,
            model=model,
            tp_rank=tp_rank,
            tp_size=tp_size,
            min_tokens=0,
            breaker=breaker,
        )
        self.engine = TransferEngine(self.cache, self.storage, l3=self.tier)

    def compute(self, tokens: list[int], rng: np.random.Generator) -> dict[str, np.ndarray]:
        """Cache `tokens` with random KV (and a random state); return what was written."""
        cache = self.cache
        slots = np.asarray(cache.alloc_kv(len(tokens)), dtype=np.int64)
        k, v = self.storage.kv["device"]
        k[:, slots] = rng.standard_normal(k[:, slots].shape)
        v[:, slots] = rng.standard_normal(v[:, slots].shape)
        wrote = {"k": k[:, slots].copy(), "v": v[:, slots].copy()}
        state = None
        if cache.mamba_slots:
            state = cache.alloc_mamba()
            conv, ssm = self.storage.mamba["device"]
            conv[:, state] = rng.standard_normal(conv[:, state].shape)
            ssm[:, state] = rng.standard_normal(ssm[:, state].shape)
            wrote["conv"], wrote["ssm"] = conv[:, state].copy(), ssm[:, state].copy()
        cache.insert(tokens, slots, mamba_slot=state)
        return wrote

    def settle(self) -> None:
        """Run every batch, twice: backups, then the l3_puts their landing emits."""
        self.engine.run_pending()
        self.engine.run_pending()

    def loaded(self, tokens: list[int]) -> dict[str, np.ndarray]:
        """Load `tokens` back to the device; what the device then holds for them."""
        m = self.cache.match_prefix(tokens)
        assert (m.device_len, m.host_len) == (0, len(tokens))
        lb = self.cache.load_back(m.host_node)
        assert lb is not None
        with lb:
            assert self.engine.run(lb.batch)
            lb.commit()
        m = self.cache.match_prefix(tokens)
        assert m.device_len == len(tokens)
        k, v = self.storage.kv["device"]
        out = {"k": k[:, m.kv_indices], "v": v[:, m.kv_indices]}
        if self.cache.mamba_slots:
            conv, ssm = self.storage.mamba["device"]
            out["conv"], out["ssm"] = conv[:, m.mamba_slot], ssm[:, m.mamba_slot]
        return out


class Gated:
    """A real store whose ``get_into`` (and, with `puts`, ``put``) waits for the test.

    It holds a fetch's read (or a put's write) in flight for as long as a test needs: the
    store itself is the real one; only the timing is the test's.
    """

    def __init__(self, store: Any, *, puts: bool = False) -> None:
        self.store = store
        self.gate = threading.Event()
        self.reading = threading.Event()
        self.writing = threading.Event()
        self.puts = puts

    def exists(self, keys: Any) -> Any:
        return self.store.exists(keys)

    def put(self, keys: Any, hashes: Any, data: Any, **label: Any) -> Any:
        if self.puts:
            self.writing.set()
            assert self.gate.wait(30), "the test never opened the gate"
        return self.store.put(keys, hashes, data, **label)

    def get_into(self, keys: Any, hashes: Any, out: Any, **label: Any) -> Any:
        self.reading.set()
        assert self.gate.wait(30), "the test never opened the gate"
        return self.store.get_into(keys, hashes, out, **label)


class PageHashKeys:
    """A real store reached through keys that name the page alone (kind and hash).

    What a store shared with a client that leaves the model out of its keys looks like:
    every identity's objects land under the same names, so only the frame tells them
    apart.
    """

    def __init__(self, store: Any) -> None:
        self.store = store
        self.url = store.url

    @staticmethod
    def _keys(keys: list[bytes]) -> list[bytes]:
        return [k.split(b":", 2)[2] for k in keys]  # rc2:{identity}:{kind}:{hash} -> kind:hash

    def exists(self, keys: list[bytes]) -> list[bool]:
        return self.store.exists(self._keys(keys))

    def put(self, keys: list[bytes], hashes: Any, data: Any, **label: Any) -> list[bool]:
        return self.store.put(self._keys(keys), hashes, data, **label)

    def get_into(self, keys: list[bytes], hashes: Any, out: Any, **label: Any) -> Any:
        return self.store.get_into(self._keys(keys), hashes, out, **label)
