"""Storage and TransferEngine on CPU: exact bytes for every batch kind, failure paths,
ownership of batches between take_batches() and their end, and the example's oracle."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import radixcache as rc
import radixcache.serving as sv

from conftest import examples

ROOT = Path(__file__).resolve().parents[1]
PS = 2  # page size


def cache(
    policy: str = "write_through", *, kv_slots: int = 32, mamba_slots: int = 6
) -> rc.HybridCache:
    return rc.HybridCache(
        kv_slots=kv_slots,
        page_size=PS,
        mamba_slots=mamba_slots,
        host_kv_slots=32,
        host_mamba_slots=4,
        write_policy=policy,
    )


def storage(c: rc.HybridCache, **kw: Any) -> rc.Storage:
    """Three attention and two Mamba layers, each array with its own dtype and row size."""
    return rc.Storage.for_cache(
        c,
        layers=3,
        kv_heads=2,
        head_dim=4,
        mamba_layers=2,
        conv_shape=(6, 3),
        ssm_shape=(2, 4, 4),
        dtype="float16",
        conv_dtype="bfloat16",
        **kw,
    )


def stamp(s: rc.Storage, seed: int = 0) -> None:
    """A distinct random byte pattern in every row of every array of every pool."""
    rng = np.random.default_rng(seed)
    for tier_arrays in (*s.kv.values(), *s.mamba.values()):
        for a in tier_arrays:
            raw = a.view(np.uint8)
            raw[...] = rng.integers(0, 256, size=raw.shape, dtype=np.uint8)


def snapshot(s: rc.Storage) -> dict[tuple[str, str, int], np.ndarray]:
    out = {}
    for pool, per_tier in (("kv", s.kv), ("mamba", s.mamba)):
        for tier, arrays in per_tier.items():
            for i, a in enumerate(arrays):
                out[pool, tier, i] = a.copy()
    return out


def expect_after(
    s: rc.Storage, before: dict[tuple[str, str, int], np.ndarray], batch: rc.TransferBatch
) -> dict[tuple[str, str, int], np.ndarray]:
    """What every array must hold after `batch`'s copies: each destination row is its
    source row (as it was before), every other row is unchanged."""
    want = {k: v.copy() for k, v in before.items()}
    for c in batch.copies:
        n = len(s.kv["device"]) if c.pool == "kv" else len(s.mamba["device"])
        for i in range(n):
            want[c.pool, c.dst_tier, i][:, c.dst] = before[c.pool, c.src_tier, i][:, c.src]
    return want


def assert_bytes(s: rc.Storage, want: dict[tuple[str, str, int], np.ndarray]) -> None:
    got = snapshot(s)
    for key, w in want.items():
        g = got[key]
        assert g.view(np.uint8).tobytes() == w.view(np.uint8).tobytes(), f"{key} differs"


def fill(c: rc.HybridCache, tokens: list[int]) -> rc.Insert:
    slots = c.alloc_kv(len(tokens))
    assert slots is not None
    return c.insert(tokens, slots, mamba_slot=c.alloc_mamba())


def run_checked(e: rc.TransferEngine, batch: rc.TransferBatch) -> None:
    before = snapshot(e.storage)
    want = expect_after(e.storage, before, batch)
    assert e.run(batch), e.last_error
    assert_bytes(e.storage, want)


def settled(c: rc.HybridCache) -> None:
    """Nothing in flight, nothing draining; the audit passes."""
    c.audit()
    assert c.pending_batches() == []
    st = c.stats()
    assert st["batches_in_flight"] == 0
    assert st["kv_draining_slots"] == st["mamba_draining_slots"] == 0


# ---------------------------------------------------------------- bytes, every batch kind


def test_every_batch_kind_moves_exactly_the_right_bytes() -> None:
    c = cache()
    s = storage(c)
    e = rc.TransferEngine(c, s)
    stamp(s)
    seen: set[tuple[str, str, str, str]] = set()

    def take_and_run() -> None:
        for b in c.take_batches():
            seen.update((b.kind, cp.pool, cp.src_tier, cp.dst_tier) for cp in b.copies)
            run_checked(e, b)

    # Backup (write-through): KV and the state, device to host.
    fill(c, [1, 2, 3, 4, 5, 6])
    take_and_run()
    # Copy-on-write at admission: the cached state into the request's slot.
    r = c.admit([1, 2, 3, 4, 5, 6, 7, 8])
    assert r is not None
    assert r.copy_pending is not None
    take_and_run()
    # Copy-on-write at checkpoint: the request's state into a slot for the tree.
    got = c.extend(r, [7, 8])
    assert got is not None
    c.checkpoint(r)
    take_and_run()
    c.finish(r)
    take_and_run()
    # Load-back: demote, then load KV and state host to device.
    c.evict(kv_tokens=c.kv_slots, mamba_states=c.mamba_slots)
    take_and_run()
    r2 = c.admit([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert r2 is not None
    assert r2.host_len > 0
    lb = c.load_back(r2)
    assert lb is not None
    with lb:
        seen.update(("load_back", cp.pool, cp.src_tier, cp.dst_tier) for cp in lb.batch.copies)
        run_checked(e, lb.batch)
        lb.commit()
    assert r2.prefix_len == 8
    c.abort(r2)
    assert {
        ("backup", "kv", "device", "host"),
        ("backup", "mamba", "device", "host"),
        ("cow", "mamba", "device", "device"),
        ("load_back", "kv", "host", "device"),
        ("load_back", "mamba", "host", "device"),
    } <= seen
    settled(c)
    assert e.stats()["batches_failed"] == 0


def test_storage_reports_its_layout_and_sizes() -> None:
    c = cache()
    s = storage(c)
    k, v = s.kv["device"]
    conv, ssm = s.mamba["host"]
    assert k.shape == v.shape == (3, 32, 2, 4)
    assert k.dtype == np.float16
    assert conv.shape == (2, 4, 6, 3)
    assert conv.dtype == np.uint16
    assert ssm.shape == (2, 4, 2, 4, 4)
    assert ssm.dtype == np.float32
    assert s.kv_bytes_per_token == 2 * 3 * 2 * 4 * 2
    assert s.bytes_per_state == 2 * (6 * 3 * 2 + 2 * 4 * 4 * 4)
    assert not s.on_gpu
    assert "kv[device]: 32 slots" in repr(s)


# ---------------------------------------------------------------- engine API and failures


def test_run_pending_submit_poll_and_synchronize_on_cpu() -> None:
    c = cache()
    e = rc.TransferEngine(c, storage(c))
    fill(c, [1, 2, 3, 4])
    assert e.run_pending() == 1
    fill(c, [5, 6])
    (b,) = c.take_batches()
    e.submit(b)
    assert e.in_flight == 1
    assert c.pending_batches() == [(b.id, "backup", True)]
    assert e.poll() == [b]
    assert b.outcome == "completed"
    fill(c, [7, 8])
    (b2,) = c.take_batches()
    e.submit(b2)
    assert e.synchronize() == [b2]
    assert e.in_flight == 0
    st = e.stats()
    assert (st["batches_completed"], st["batches_failed"], st["copies"]) == (3, 0, 6)
    assert st["bytes_copied"] > 0
    assert st["kernel_launches"] == 0
    settled(c)


class Breaking(rc.TransferEngine):
    """Raises after `copies_ok` copies of a batch (0: before any)."""

    def __init__(self, c: rc.HybridCache, s: rc.Storage, copies_ok: int) -> None:
        super().__init__(c, s)
        self.copies_ok = copies_ok

    def copy_batch(self, batch: rc.TransferBatch) -> None:
        for i, cp in enumerate(batch.copies):
            if i == self.copies_ok:
                raise RuntimeError("CUDA error: an illegal memory access")
            self._copy(cp)


@pytest.mark.parametrize("copies_ok", [0, 1])
def test_a_copy_that_raises_fails_the_batch_with_its_cause(copies_ok: int) -> None:
    c = cache()
    e = Breaking(c, storage(c), copies_ok)
    fill(c, [1, 2, 3, 4])
    (b,) = c.take_batches()
    assert e.run(b) is False
    assert b.outcome == "failed"
    assert b.reason == "RuntimeError: CUDA error: an illegal memory access"
    assert e.last_error is not None
    assert "illegal memory access" in e.last_error
    assert e.stats()["batches_failed"] == 1
    assert c.stats()["backups_failed"] == 1
    settled(c)


def test_a_bad_slot_index_fails_the_batch_not_the_process() -> None:
    c = cache()
    e = rc.TransferEngine(c, storage(c))
    # Storage swapped after the engine checked it: too small for the cache's slots.
    e.storage = rc.Storage.for_model(
        kv_slots=4, mamba_slots=6, host_kv_slots=32, host_mamba_slots=4, layers=1
    )
    fill(c, list(range(1, 11)))
    (b,) = c.take_batches()
    assert e.run(b) is False
    assert e.last_error is not None
    assert "IndexError: src: slot out of range for the kv pool on the device (4 slots)" in (
        e.last_error
    )
    settled(c)


def test_storage_that_does_not_fit_the_cache_is_refused_naming_the_argument() -> None:
    c = cache()
    with pytest.raises(ValueError, match=r"^host_kv_slots: the cache has 32, the storage kv"):
        rc.TransferEngine(
            c,
            rc.Storage.for_model(
                kv_slots=32, mamba_slots=6, host_kv_slots=16, host_mamba_slots=4, layers=1
            ),
        )
    with pytest.raises(ValueError, match=r"^mamba_slots: the cache has 6, the storage has no"):
        rc.TransferEngine(c, rc.Storage.for_model(kv_slots=32, host_kv_slots=32, layers=1))
    with pytest.raises(ValueError, match=r"^kv_heads: expected a count >= 1"):
        rc.Storage.for_model(kv_slots=32, layers=1, kv_heads=-1)
    with pytest.raises(ValueError, match=r"^device: expected 'cpu' or 'cuda'"):
        rc.Storage.for_model(kv_slots=32, layers=1, device="tpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^dtype: unknown dtype"):
        rc.Storage.for_model(kv_slots=32, layers=1, dtype="float5")
    k = np.zeros((2, 8, 4), dtype=np.float16)
    with pytest.raises(ValueError, match=r"^kv\['device'\]: the arrays disagree on the slot"):
        rc.Storage(kv={"device": (k, np.zeros((2, 9, 4), dtype=np.float16))})
    with pytest.raises(ValueError, match=r"^kv\['device'\]\[0\]: one slot's row in a layer"):
        rc.Storage(kv={"device": (k[:, :, ::2], k[:, :, ::2])})
    with pytest.raises(ValueError, match=r"^kv: unknown tier 'disk'"):
        rc.Storage(kv={"disk": (k, k)})
    with pytest.raises(TypeError, match=r"^mamba\['host'\]\[1\]: expected a numpy array"):
        rc.Storage(mamba={"host": (k, [1, 2])})
    with pytest.raises(ValueError, match=r"^kv_slots: taken from the cache, not given"):
        rc.Storage.for_cache(c, kv_slots=8, layers=1)
    with pytest.raises(ValueError, match=r"^pool: this storage has no mamba pool on the host"):
        rc.Storage(kv={"device": (k, k.copy())}).pool("mamba", "host")


def test_arrays_of_the_wrong_layout_are_refused_naming_the_argument() -> None:
    k = np.zeros((2, 8, 4), dtype=np.float16)
    with pytest.raises(ValueError, match=r"^mamba\['device'\]: expected two arrays"):
        rc.Storage(mamba={"device": (k,)})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"^kv\['host'\]\[1\]: expected \[layers, slots, ...\]"):
        rc.Storage(kv={"host": (k, np.zeros(8))})
    # Slots overlapping: a stride along the slot axis shorter than one slot's row.
    overlapping = np.lib.stride_tricks.as_strided(k, shape=(2, 8, 4), strides=(64, 2, 2))
    with pytest.raises(ValueError, match=r"^kv\['device'\]\[0\]: slots overlap"):
        rc.Storage(kv={"device": (overlapping, k)})


# ------------------------------------------------- an exception anywhere leaves pools whole


POINTS = [
    "after take, before start (collected)",
    "after take, in a with block before start",
    "after start, in a with block",
    "inside the engine's copy",
    "after the copies, before complete, in a with block",
    "submitted, then the engine raises",
]


@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("kind", ["backup", "cow"])
def test_an_exception_between_take_and_the_end_of_a_batch_leaves_every_pool_whole(
    point: str, kind: str
) -> None:
    c = cache()
    s = storage(c)
    e = rc.TransferEngine(c, s)
    fill(c, [1, 2, 3, 4])
    r = None
    if kind == "cow":
        e.run_pending()  # the backup, out of the way
        r = c.admit([1, 2, 3, 4, 5])
        assert r is not None
    (b,) = c.take_batches()
    assert b.kind == kind
    with pytest.raises(RuntimeError, match="scheduler bug"):  # noqa: PT012
        if point == "after take, before start (collected)":
            with pytest.warns(ResourceWarning, match="before it ended; failed it"):
                del b
            raise RuntimeError("scheduler bug")
        if point == "inside the engine's copy":
            broken = Breaking(c, s, 0)
            assert broken.run(b) is False
            raise RuntimeError("scheduler bug")
        if point == "submitted, then the engine raises":
            e.submit(b)
            e.synchronize()
            raise RuntimeError("scheduler bug")
        with b:
            if point != "after take, in a with block before start":
                b.start()
            if point == "after the copies, before complete, in a with block":
                e.copy_batch(b)
            raise RuntimeError("scheduler bug")
    settled(c)
    if r is not None:
        if point == "submitted, then the engine raises":
            assert r.prefix_len == 4  # the copy had completed before the exception
        else:
            # Failed copy-on-write: back to nothing reused (docs/contract.md rule 10).
            assert (r.prefix_len, r.mamba_slot) == (0, None)
        c.abort(r)
    # Everything is back: evicting the tree frees every device and host slot.
    c.evict(kv_tokens=c.kv_slots, mamba_states=c.mamba_slots)
    e.run_pending()
    assert (c.available_kv(), c.available_mamba()) == (c.kv_slots, c.mamba_slots)
    settled(c)


def test_a_started_batch_collected_before_it_ended_stays_in_flight_until_acknowledged() -> None:
    c = cache()
    fill(c, [1, 2, 3, 4])
    (b,) = c.take_batches()
    bid = b.id
    b.start()
    with pytest.warns(ResourceWarning, match="stays in flight until acknowledged by id"):
        del b
    # Its copies may still run: it holds its slots and is listed, marked started.
    assert c.pending_batches() == [(bid, "backup", True)]
    assert c.stats()["batches_draining"] == 1
    c.audit()
    c.complete(bid)  # the engine says the copies are over: it fails either way
    assert c.stats()["backups_failed"] == 1
    assert c.stats()["batches_abandoned"] == 1
    settled(c)


def test_batch_methods_refuse_a_batch_that_ended() -> None:
    c = cache()
    fill(c, [1, 2])
    (b,) = c.take_batches()
    b.complete()
    for call in (b.start, b.complete, b.fail):
        with pytest.raises(ValueError, match=rf"^batch_id: no batch {b.id} in flight"):
            call()
    b.start  # noqa: B018  (attribute access is harmless)
    with b:  # leaving the block after the end changes nothing
        pass
    assert b.outcome == "completed"
    assert "completed" in repr(b)
    settled(c)


def test_leaving_a_with_block_before_the_batch_ended_fails_it() -> None:
    c = cache()
    fill(c, [1, 2])
    (b,) = c.take_batches()
    with b:
        b.start()
    assert (b.outcome, b.reason) == ("failed", "left its with block before it ended")
    assert c.stats()["backups_failed"] == 1
    settled(c)


# --------------------------------------------------- torch tensors through DLPack (optional)


def test_torch_tensors_are_wrapped_without_a_copy() -> None:
    torch = pytest.importorskip("torch")
    c = rc.HybridCache(kv_slots=8, page_size=PS, mamba_slots=2, host_kv_slots=8, host_mamba_slots=2)
    k = torch.zeros((2, 8, 1, 4), dtype=torch.bfloat16)
    conv = torch.zeros((1, 2, 3), dtype=torch.bfloat16)
    ssm = torch.zeros((1, 2, 4), dtype=torch.float32)
    s = rc.Storage(
        kv={"device": (k, k.clone()), "host": (k.clone(), k.clone())},
        mamba={"device": (conv, ssm), "host": (conv.clone(), ssm.clone())},
    )
    e = rc.TransferEngine(c, s)
    k[:, :4] = 1.5
    ssm[0, 0] = 2.0
    slots = c.alloc_kv(4)
    assert slots is not None
    c.insert([1, 2, 3, 4], slots, mamba_slot=c.alloc_mamba())
    e.run_pending()
    host_k = torch.from_dlpack(s.kv["host"][0]).view(torch.bfloat16)
    assert bool((host_k[:, :4] == 1.5).all()), "the backup reached the torch tensor"


# ------------------------------------- random interleavings: storage agrees with the tree

OPS = st.lists(
    st.tuples(
        st.sampled_from(["serve", "admit", "extend", "checkpoint", "finish", "abort", "evict"]),
        st.integers(0, 7),  # which prompt / request
        st.integers(1, 6),  # how many tokens
    ),
    min_size=5,
    max_size=40,
)


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=OPS,
    policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
    failure_rate=st.sampled_from([0.0, 0.2, 0.5]),
    seed=st.integers(0, 2**16),
)
def test_random_interleavings_keep_storage_consistent_with_the_tree(
    ops: list[tuple[str, int, int]], policy: str, failure_rate: float, seed: int
) -> None:
    """Cache operations, engine runs and injected copy failures in any order: whatever
    the tree says holds prefix P (a match's KV slots and state, a request's) holds P's
    bytes in the storage, and the audit passes, after every step."""
    c = cache(policy, kv_slots=24, mamba_slots=5)
    s = sv.ChecksumModel.storage_for(c)
    model = sv.ChecksumModel(c, s)
    engine = sv.FaultyEngine(c, s, failure_rate, seed)
    ref = model.ref
    prompts = [[1 + i % 3, 7, 7, 2 + i] for i in range(8)]
    live: list[rc.Request] = []
    seen: list[list[int]] = []

    def run(batch: rc.TransferBatch) -> bool:
        try:
            return engine.run(batch)
        except sv.Refused:
            if batch.outcome is None:
                batch.fail("refused")
            return False

    def run_batches() -> None:
        for b in c.take_batches():
            run(b)

    def extend(r: rc.Request, toks: list[int]) -> Any:
        slots = c.extend(r, toks)
        if slots is None:  # under write-back, room frees once backups complete
            run_batches()
            slots = c.extend(r, toks)
        return slots

    def forward(r: rc.Request, slots: Any, toks: list[int]) -> None:
        model.forward(len(r.tokens) - len(toks), toks, slots, r.mamba_slot)
        model.stream.synchronize()

    def holds(seq: list[int], kv: Any, state: int | None) -> bool:
        """Whether slots `kv` (and `state`) hold `seq`'s bytes in every layer."""
        h = ref.kv_hash(np.array(seq, dtype=np.uint64), 0)
        ok = bool((model.k[:, kv] == h[None, :] ^ ref.salt_k[:, None]).all())
        ok &= bool((model.v[:, kv] == h[None, :] ^ ref.salt_v[:, None]).all())
        if state is not None and seq:
            conv, ssm = ref.advance(ref.conv0, ref.ssm0, np.array(seq, dtype=np.uint64))
            ok &= bool((model.conv[:, state] == conv).all() and (model.ssm[:, state] == ssm).all())
        return ok

    def check() -> None:
        c.audit()
        for r in live:
            toks = [int(t) for t in r.tokens]
            assert holds(toks, r.kv_indices, r.mamba_slot), f"request {r} reads wrong bytes"
        for seq in seen:
            m = c.match_prefix(seq)
            assert holds(seq[: m.device_len], m.kv_indices, m.mamba_slot), seq

    for op, i, n in ops:
        if op in ("serve", "admit") and len(live) < 3:
            prompt = prompts[i] + [i] * n
            r = c.admit(prompt)
            if r is None:
                continue
            run_batches()
            if r.host_len:
                lb = c.load_back(r)
                if lb is not None:
                    with lb:
                        if run(lb.batch):
                            lb.commit()
            rest = prompt[r.prefix_len :]
            slots = extend(r, rest) if rest else None
            if rest and slots is None:
                c.abort(r)
            else:
                if slots is not None:
                    forward(r, slots, rest)
                live.append(r)
                seen.append(prompt)
        elif op == "extend" and live:
            r = live[i % len(live)]
            more = [i + 10] * n
            slots = extend(r, more)
            if slots is not None:
                forward(r, slots, more)
        elif op == "checkpoint" and live:
            r = live[i % len(live)]
            if r.copy_pending is None and r.load_pending is None:
                c.checkpoint(r)
                seen.append([int(t) for t in r.tokens])
        elif op in ("finish", "abort") and live:
            r = live.pop(i % len(live))
            if op == "finish" and r.copy_pending is None and r.load_pending is None:
                seen.append([int(t) for t in r.tokens])
                c.finish(r)
            else:
                c.abort(r)
        elif op == "evict":
            c.evict(kv_tokens=n * PS, mamba_states=1)
        run_batches()
        check()
    for r in live:
        c.abort(r)
    run_batches()
    settled(c)
