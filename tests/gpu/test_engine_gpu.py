"""TransferEngine on a GPU: every batch kind on CUDA storage (device arrays, pinned mapped
host arrays) moves exactly the bytes the NumPy reference says, for a small fixture and a
large model's state shapes, through the kernel and the DMA path, for scattered and
contiguous slot sets; copies wait for the compute step they are ordered after.
Skipped without CuPy or without a CUDA device."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import radixcache as rc
from radixcache import _kernels

from conftest import cuda

cp, _why_not = cuda()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cp is None, reason=_why_not or "no GPU")]

#: (mamba layers, conv_shape, ssm_shape): a small fixture and a large model's states.
SHAPES = {
    "small": (18, (288, 3), (2, 16, 16)),
    "large": (36, (8192, 3), (32, 128, 128)),
}


def setup(shape: str) -> tuple[rc.HybridCache, rc.Storage, rc.TransferEngine]:
    layers, conv, ssm = SHAPES[shape]
    c = rc.HybridCache(
        kv_slots=64, page_size=2, mamba_slots=6, host_kv_slots=64, host_mamba_slots=4
    )
    s = rc.Storage.for_cache(
        c,
        layers=4,
        kv_heads=2,
        head_dim=64,
        mamba_layers=layers,
        conv_shape=conv,
        ssm_shape=ssm,
        dtype="bfloat16",
        device="cuda",
    )
    assert s.on_gpu
    return c, s, rc.TransferEngine(c, s)


def arrays(s: rc.Storage) -> dict[tuple[str, str, int], Any]:
    out = {}
    for pool, per_tier in (("kv", s.kv), ("mamba", s.mamba), ("swa", s.swa)):
        for tier, arrs in per_tier.items():
            for i, a in enumerate(arrs):
                out[pool, tier, i] = a
    return out


def stamp(s: rc.Storage, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for a in arrays(s).values():
        data = rng.integers(0, 256, size=a.nbytes, dtype=np.uint8)
        if isinstance(a, np.ndarray):
            a.view(np.uint8).reshape(-1)[:] = data
        else:
            a.view(cp.uint8).reshape(-1)[:] = cp.asarray(data)
    cp.cuda.Device().synchronize()


def snapshot(s: rc.Storage) -> dict[tuple[str, str, int], np.ndarray]:
    return {
        k: (a.copy() if isinstance(a, np.ndarray) else cp.asnumpy(a)) for k, a in arrays(s).items()
    }


def expect(before: dict[tuple[str, str, int], np.ndarray], copies: list[Any]) -> dict[Any, Any]:
    want = {k: v.copy() for k, v in before.items()}
    for c in copies:
        for i in range(2):
            want[c.pool, c.dst_tier, i][:, c.dst] = before[c.pool, c.src_tier, i][:, c.src]
    return want


def assert_same(s: rc.Storage, want: dict[Any, np.ndarray]) -> None:
    got = snapshot(s)
    for k, w in want.items():
        assert got[k].view(np.uint8).tobytes() == w.view(np.uint8).tobytes(), f"{k} differs"


def run_checked(e: rc.TransferEngine, batch: rc.TransferBatch) -> None:
    before = snapshot(e.storage)
    want = expect(before, list(batch.copies))
    assert e.run(batch), e.last_error
    assert_same(e.storage, want)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_batch_kind_matches_the_numpy_reference_on_cuda_storage(shape: str) -> None:
    c, s, e = setup(shape)
    stamp(s)
    slots = c.alloc_kv(6)
    assert slots is not None
    c.insert([1, 2, 3, 4, 5, 6], slots, mamba_slot=c.alloc_mamba())
    for b in c.take_batches():  # backup
        run_checked(e, b)
    r = c.admit([1, 2, 3, 4, 5, 6, 7, 8])
    assert r is not None
    for b in c.take_batches():  # copy-on-write at admission
        run_checked(e, b)
    assert c.extend(r, [7, 8]) is not None
    c.checkpoint(r)
    for b in c.take_batches():  # copy-on-write at checkpoint, its backup
        run_checked(e, b)
    c.finish(r)
    for b in c.take_batches():
        run_checked(e, b)
    c.evict(kv_tokens=64, mamba_states=6)
    for b in c.take_batches():
        run_checked(e, b)
    r2 = c.admit([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert r2 is not None
    assert r2.host_len > 0
    lb = c.load_back(r2)
    assert lb is not None
    with lb:
        run_checked(e, lb.batch)  # load-back
        lb.commit()
    c.abort(r2)
    c.audit()
    assert c.pending_batches() == []
    assert e.stats()["kernel_launches"] + e.stats()["dma_copies"] > 0


@pytest.mark.parametrize("path", ["kernel", "dma"])
def test_swa_backups_and_load_backs_match_the_numpy_reference_on_cuda_storage(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The SWA pool's copies (pool "swa"), device to pinned host and back, on each path."""
    monkeypatch.setattr(_kernels, "choose_path", lambda *_: path)
    c = rc.HybridCache(
        kv_slots=64, page_size=2, swa_slots=32, swa_window=4, host_kv_slots=64, host_swa_slots=32
    )
    s = rc.Storage.for_cache(
        c, layers=2, swa_layers=3, kv_heads=2, head_dim=64, dtype="bfloat16", device="cuda"
    )
    e = rc.TransferEngine(c, s)
    stamp(s)
    slots = c.alloc_kv(8)
    assert slots is not None
    c.insert(list(range(1, 9)), slots)
    batches = c.take_batches()  # the backup, its SWA pages with it
    assert any(cp_.pool == "swa" for b in batches for cp_ in b.copies)
    for b in batches:
        run_checked(e, b)
    c.evict(kv_tokens=64)
    r = c.admit(list(range(1, 11)))
    assert r is not None
    lb = c.load_back(r)
    assert lb is not None
    with lb:
        assert any(cp_.pool == "swa" for cp_ in lb.batch.copies)
        run_checked(e, lb.batch)
        lb.commit()
    c.abort(r)
    c.audit()
    used = "kernel_launches" if path == "kernel" else "dma_copies"
    assert e.stats()[used] > 0


@pytest.mark.parametrize("path", ["kernel", "dma"])
@pytest.mark.parametrize("slots", ["contiguous", "scattered"])
@pytest.mark.parametrize(
    ("src_tier", "dst_tier"), [("device", "host"), ("host", "device"), ("device", "device")]
)
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_each_path_and_slot_set_copies_exactly(
    shape: str,
    path: str,
    slots: str,
    src_tier: str,
    dst_tier: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, s, e = setup(shape)
    stamp(s, seed=1)
    monkeypatch.setattr(_kernels, "choose_path", lambda *_: path)
    src, dst = ([0, 1, 2], [1, 2, 3]) if slots == "contiguous" else ([3, 0, 2], [0, 3, 1])
    if src_tier == dst_tier:
        src, dst = [0, 1], [2, 3]  # distinct sources and destinations on one tier
    copy = SimpleNamespace(
        pool="mamba", src_tier=src_tier, dst_tier=dst_tier, src=np.array(src), dst=np.array(dst)
    )
    before = snapshot(s)
    want = expect(before, [copy])
    e._copy(copy)  # type: ignore[arg-type]  # one copy of a batch, without the cache
    e._copy_stream().synchronize()
    assert_same(s, want)
    used = "kernel_launches" if path == "kernel" else "dma_copies"
    assert e.stats()[used] == 1


def test_everything_a_kernel_reads_is_uploaded_on_the_copy_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The buffer tables and slot indices go up on the stream the kernel runs on, so
    stream order puts each upload before the kernel reading it."""
    _, _, e = setup("small")
    monkeypatch.setattr(_kernels, "choose_path", lambda *_: "kernel")
    streams: list[int] = []
    asarray = cp.asarray

    def spy(*args: Any, **kwargs: Any) -> Any:
        streams.append(int(cp.cuda.get_current_stream().ptr))
        return asarray(*args, **kwargs)

    monkeypatch.setattr(cp, "asarray", spy)
    copy = SimpleNamespace(
        pool="mamba", src_tier="device", dst_tier="host", src=np.array([0]), dst=np.array([1])
    )
    e._copy(copy)  # type: ignore[arg-type]  # one copy of a batch, without the cache
    e._copy_stream().synchronize()
    assert e.stats()["kernel_launches"] == 1
    assert len(streams) >= 7  # five buffer tables, then the two index arrays
    assert set(streams) == {int(e._copy_stream().ptr)}


def test_a_backup_waits_for_the_compute_step_it_is_ordered_after() -> None:
    c, s, e = setup("large")
    _conv, ssm = s.mamba["device"]
    slots = c.alloc_kv(2)
    slot = c.alloc_mamba()
    assert slots is not None
    assert slot is not None
    compute = cp.cuda.Stream(non_blocking=True)
    with compute:
        ssm[:, slot] = 0
        for _ in range(200):  # a long compute step that ends by writing the state
            ssm[:, slot] += 1
    done = compute.record()
    e.after_compute(done)
    c.insert([1, 2], slots, mamba_slot=slot)
    (b,) = c.take_batches()
    e.submit(b)
    assert [x.id for x in e.synchronize()] == [b.id]
    host_slot = int(b.copies[-1].dst[0]) if b.copies[-1].pool == "mamba" else None
    assert host_slot is not None
    host_ssm = s.mamba["host"][1]
    assert np.all(host_ssm[:, host_slot] == 200), "the backup read the state mid-compute"
