"""What a verified replay (benches/_sglang_side.py, ``verify=True``) checks in SGLang's pools.

Two checks, both outside the timed calls:

- **Bytes** (`Checksums`): a stand-in for the model that writes SGLang's real pool tensors.
  For every token it computes, it writes into the KV pool's key buffer (first full-attention
  layer) a value derived from the request's namespace and the token prefix up to it; for
  every state it computes (the request's live state after each chunk and each decode step,
  and the tracked state SGLang's ``extra_buffer`` strategy keeps at a checkpoint length),
  it fills the Mamba pool's temporal state of that slot, every layer, with a value derived
  from the prefix the state covers (0 for no tokens: a cleared slot). Before each chunk it
  reads back the request's ``req_to_token`` row up to the matched (or checkpointed) prefix
  and the state in its slot (the copy-on-write destination, once SGLang's model-runner step
  has copied the matched state there); before each release or retraction, the whole row.
  A value that is not what was computed for that position or length is a mismatch.
- **Pools** (`Invariants`): SGLang's own ``SchedulerInvariantChecker`` and
  ``SchedulerPoolStatsObserver`` after every step: the KV pool's
  ``available + evictable + protected + what running requests hold == size`` (the busy
  check), and the same equation for the Mamba pool with the state slots the running
  requests hold (``kv_mamba_slots``); with nothing running, the idle checks (every pool,
  and the request-row pool).

The value of a prefix is a rolling hash of it, folded below ``2**24`` so that float32
holds it exactly; two different prefixes share a value with probability about ``2**-24``.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

#: Values are in [1, _SPAN]: exact in float32, and never 0 (a cleared state's value).
_SPAN = (1 << 24) - 1
_MOD = (1 << 61) - 1
#: Mismatches and pool-equation breaks described in the result, at most.
_KEEP = 5


def prefix_values(tokens: Sequence[int], namespace: str | None) -> tuple[list[float], list[float]]:
    """Return the values the model computes for `tokens` under `namespace`: ``(kv, state)``.

    ``kv[p]``: the token at position p (from ``tokens[:p + 1]``); ``state[n]``: the state
    after the first n tokens (``state[0] == 0``, a cleared slot).
    """
    h = zlib.crc32(namespace.encode()) if namespace is not None else 0
    kv: list[float] = []
    state: list[float] = [0.0]
    for t in tokens:
        h = (h * 1_000_003 + t + 1) % _MOD
        kv.append(float(1 + h % _SPAN))
        state.append(float(1 + (h >> 24) % _SPAN))
    return kv, state


class Checksums:
    """The model's writes into SGLang's KV and Mamba pool tensors, and the checking reads.

    The module docstring says what is written and read, and when.
    """

    def __init__(self, torch: Any, kv_buffer: Any, req_to_token_pool: Any, hybrid: bool) -> None:
        self.torch = torch
        self.kv = kv_buffer.view(kv_buffer.shape[0], -1)[:, 0]
        self.rows = req_to_token_pool
        self.temporal = req_to_token_pool.mamba_pool.mamba_cache.temporal if hybrid else None
        self.kv_tokens_checked = 0
        self.kv_mismatches = 0
        self.states_checked = 0
        self.state_mismatches = 0
        self.examples: list[str] = []

    def _slots(self, req: Any, start: int, end: int) -> Any:
        return self.rows.req_to_token[req.kv.req_pool_idx, start:end].to(self.torch.int64)

    def _physical(self, slots: list[int]) -> Any:
        index = self.torch.tensor(slots, dtype=self.torch.int64)
        return self.rows.translate_mamba_indices(index)

    def _note(self, what: str) -> None:
        if len(self.examples) < _KEEP:
            self.examples.append(what)

    def check_kv(self, req: Any, expected: Any, n: int, where: str) -> None:
        """Check that the first n positions of the request's row hold their values."""
        if n == 0:
            return
        got = self.kv[self._slots(req, 0, n)]
        bad = int((got != expected[:n]).sum())
        self.kv_tokens_checked += n
        if bad:
            self.kv_mismatches += bad
            first = int((got != expected[:n]).nonzero()[0])
            self._note(f"request {req.rid}, {where}: {bad} of {n} KV positions (first {first})")

    def write_kv(self, req: Any, expected: Any, start: int, end: int) -> None:
        if end > start:
            self.kv[self._slots(req, start, end)] = expected[start:end]

    def write_kv_at(self, rows: list[int], positions: list[int], values: list[float]) -> None:
        """Write one token's value per request: position ``positions[i]`` of row ``rows[i]``."""
        torch = self.torch
        slots = self.rows.req_to_token[torch.tensor(rows), torch.tensor(positions)]
        self.kv[slots.to(torch.int64)] = torch.tensor(values, dtype=self.kv.dtype)

    def check_states(
        self, slots: list[int], values: list[float], rids: list[str], where: str
    ) -> None:
        """Check that the state in each slot (every layer, every element) is its value."""
        assert self.temporal is not None
        torch = self.torch
        got = self.temporal[:, self._physical(slots)].transpose(0, 1).reshape(len(slots), -1)
        want = torch.tensor(values, dtype=got.dtype).unsqueeze(1)
        ok = (got == want).all(dim=1)
        self.states_checked += len(slots)
        if not bool(ok.all()):
            for i in (~ok).nonzero().flatten().tolist():
                self.state_mismatches += 1
                self._note(f"request {rids[i]}, {where}: state slot {slots[i]} is not its prefix's")

    def write_states(self, slots: list[int], values: list[float]) -> None:
        """Fill each slot's state (every layer, every element) with its value."""
        assert self.temporal is not None
        if not slots:
            return
        torch = self.torch
        index = self._physical(slots)
        shape = [1, len(slots)] + [1] * (self.temporal.dim() - 2)
        value = torch.tensor(values, dtype=self.temporal.dtype).view(shape)
        self.temporal[:, index] = value.expand(self.temporal[:, index].shape)

    def result(self) -> dict[str, Any]:
        return {
            "kv_tokens_checked": self.kv_tokens_checked,
            "kv_mismatches": self.kv_mismatches,
            "states_checked": self.states_checked,
            "state_mismatches": self.state_mismatches,
            "mismatch_examples": self.examples,
        }


class Invariants:
    """SGLang's scheduler invariant checks, run on this replay's pools (module docstring)."""

    def __init__(
        self,
        sg: SimpleNamespace,
        tree: Any,
        allocator: Any,
        req_to_token_pool: Any,
        *,
        hybrid: bool,
        page_size: int,
        kv_slots: int,
    ) -> None:
        self.hybrid = hybrid
        self.running: list[Any] = []
        self.observer = sg.SchedulerPoolStatsObserver(
            tree_cache=tree,
            token_to_kv_pool_allocator=allocator,
            req_to_token_pool=req_to_token_pool,
            session_controller=None,
            hisparse_coordinator=None,
            is_hybrid_swa=False,
            is_hybrid_ssm=hybrid,
            enable_hisparse=False,
            full_tokens_per_layer=None,
            swa_tokens_per_layer=None,
            max_total_num_tokens=kv_slots,
        )
        batch = SimpleNamespace(reqs=self.running)
        self.checker = sg.SchedulerInvariantChecker(
            is_hybrid_swa=False,
            is_hybrid_ssm=hybrid,
            disaggregation_mode=sg.DisaggregationMode.NULL,
            page_size=page_size,
            full_tokens_per_layer=None,
            swa_tokens_per_layer=None,
            max_total_num_tokens=kv_slots,
            tree_cache=tree,
            token_to_kv_pool_allocator=allocator,
            req_to_token_pool=req_to_token_pool,
            pool_stats_observer=self.observer,
            get_last_batch=lambda: batch,
            get_running_batch=lambda: batch,
            scheduler_stage_metrics=None,
        )
        self.kv_mamba_slots = sg.kv_mamba_slots
        self.mamba_size = req_to_token_pool.mamba_pool.size if hybrid else 0
        self.tree = tree
        self.steps = 0
        self.breaks = 0
        self.examples: list[str] = []

    def _fail(self, message: str) -> None:
        self.breaks += 1
        if len(self.examples) < _KEEP:
            self.examples.append(f"step {self.steps}: {message}")

    def check(self, running: Sequence[Any]) -> None:
        """Check the pools with `running` (the requests holding rows) as the busy set."""
        self.steps += 1
        self.running[:] = running
        checker = self.checker
        stats = self.observer.get_pool_stats()
        if not running:
            leak, messages = checker._check_all_pools(stats)
            if leak:
                self._fail("; ".join(messages))
            warned = checker.count_req_pool_leak_warnings
            checker._check_req_pool()
            if checker.count_req_pool_leak_warnings != warned:
                self._fail("a request row is not back in its pool")
            return
        full, _ = checker._get_total_uncached_sizes()
        leak, message = checker._check_full_pool(stats, uncached=full)
        if leak:
            self._fail(message)
        if self.hybrid:
            held = sum(self.kv_mamba_slots(req.kv) for req in running)
            leak, message = checker._check_pool_invariant(
                "mamba",
                stats.mamba_available_size,
                stats.mamba_evictable_size,
                self.tree.mamba_protected_size(),
                0,
                self.mamba_size,
                held,
            )
            if leak:
                self._fail(message)

    def result(self) -> dict[str, Any]:
        return {
            "invariant_steps": self.steps,
            "invariant_breaks": self.breaks,
            "invariant_examples": self.examples,
        }
