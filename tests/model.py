"""A naive reference model of the KV cache, for the property tests only.

It keeps the cached content as a flat set of page prefixes: for each namespace and each
cached prefix that ends at a page boundary, the slot page holding that last page. It
predicts matches, inserts, lock sizes and pool counts exactly; eviction choices (LRU
order) it does not predict, but it checks that what the cache evicted was legal and
then takes the cache's word for which prefixes are left.
"""

from __future__ import annotations

from dataclasses import dataclass, field

Prefix = tuple[int, ...]
Key = tuple[object, Prefix]  # (namespace, prefix)


@dataclass
class Model:
    kv_slots: int
    page_size: int
    #: (namespace, prefix ending at a page boundary) -> page number of its last page
    pages: dict[Key, int] = field(default_factory=dict)
    #: receipt id -> (namespace, locked prefix)
    locks: dict[int, Key] = field(default_factory=dict)
    #: pages the caller holds (from alloc, not yet inserted or freed)
    caller: set[int] = field(default_factory=set)

    def aligned(self, n: int) -> int:
        return n // self.page_size * self.page_size

    def match(self, ns: object, tokens: list[int]) -> tuple[int, list[int]]:
        """(device_len, kv_indices) the cache must answer."""
        ps = self.page_size
        slots: list[int] = []
        n = 0
        while n + ps <= len(tokens):
            page = self.pages.get((ns, tuple(tokens[: n + ps])))
            if page is None:
                break
            slots.extend(range(page * ps, page * ps + ps))
            n += ps
        return n, slots

    def lock_count(self, key: Key) -> int:
        ns, prefix = key
        return sum(
            1 for lns, lp in self.locks.values() if lns == ns and lp[: len(prefix)] == prefix
        )

    def protected(self) -> int:
        return sum(self.page_size for k in self.pages if self.lock_count(k) > 0)

    def evictable(self) -> int:
        return sum(self.page_size for k in self.pages if self.lock_count(k) == 0)

    def total(self) -> int:
        return len(self.pages) * self.page_size

    def available(self) -> int:
        return self.kv_slots - self.total() - len(self.caller) * self.page_size

    def insert(
        self, ns: object, tokens: list[int], kv: list[int], owned_from: int
    ) -> tuple[int, set[int]]:
        """Apply a valid insert; returns (prefix_len, pages freed by the cache)."""
        ps = self.page_size
        aligned = self.aligned(len(tokens))
        matched, _ = self.match(ns, tokens[:aligned])
        handed = {kv[i] // ps for i in range(owned_from, len(kv), ps)}
        kept: set[int] = set()
        for start in range(matched, aligned, ps):
            page = kv[start] // ps
            self.pages[(ns, tuple(tokens[: start + ps]))] = page
            kept.add(page)
        freed = handed - kept
        self.caller -= handed
        return matched, freed

    def sync_after_eviction(self, still_cached: set[Key]) -> list[Key]:
        """Checks an eviction was legal, adopts the cache's content, returns what went."""
        gone = [k for k in self.pages if k not in still_cached]
        for key in gone:
            assert self.lock_count(key) == 0, f"evicted a locked prefix {key}"
        gone_set = set(gone)
        for ns, prefix in self.pages:
            for cut in range(self.page_size, len(prefix), self.page_size):
                if (ns, prefix[:cut]) in gone_set:
                    assert (ns, prefix) in gone_set, (
                        f"{prefix[:cut]} was evicted but its extension {prefix} was kept"
                    )
        for key in gone:
            del self.pages[key]
        return gone
