"""One GIL policy for every lock of the binding: no thread waits for a lock while holding
the GIL, and nothing holds a lock while it creates Python objects. So a garbage
collection that starts inside a binding call (an allocation can start one) may run
callbacks and finalisers that use the same cache, request or lock, on the same thread or
another, without deadlock. Each case runs in a child interpreter under a watchdog: a
hang fails the test (with the child's stacks) instead of hanging the run."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

#: Seconds before the child dumps its stacks and exits, and before the parent gives up.
WATCHDOG = 60


def run_watched(code: str) -> subprocess.CompletedProcess[str]:
    src = (
        "import faulthandler, gc, sys, threading\n"
        "import radixcache as rc\n"
        f"faulthandler.dump_traceback_later({WATCHDOG}, exit=True)\n"
    ) + textwrap.dedent(code)
    try:
        out = subprocess.run(
            [sys.executable, "-c", src],
            capture_output=True,
            text=True,
            timeout=WATCHDOG + 30,
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the child hung past its watchdog:\n{e.stderr!r}")
    assert "Timeout (0:" not in out.stderr, f"the child hung (deadlock):\n{out.stderr}"
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok"), out.stdout + out.stderr
    return out


def test_a_gc_callback_reading_the_request_whose_arrays_are_being_built() -> None:
    # A collection starts at the first allocation of a read of the request's arrays (the
    # threshold drops to 1 with many allocations counted, and a full dict free list),
    # and its callback reads the same arrays and uses the cache, on the same thread.
    run_watched(
        """
        c = rc.HybridCache(kv_slots=1 << 14, page_size=1, mamba_slots=4)
        r = c.admit([1, 2, 3])
        reads = []

        def touch(phase, info):
            if phase == "start" and r.live:
                reads.append((len(r.tokens), len(r.kv_indices)))
                c.available_kv()
                repr(r)
                repr(r.node)

        gc.callbacks.append(touch)
        for i in range(200):
            c.extend(r, [10 + i])
            if i % 2:
                c.checkpoint(r)  # a new epoch: the arrays are rebuilt
            pad = [{} for _ in range(100)]
            gc.set_threshold(1)
            tokens, kv = r.tokens, r.kv_indices
            # From 3.12 the collection runs at the next call (here) rather than inside
            # the read: the callback still runs, reads, and must find everything free.
            assert len(tokens) == len(kv) == 1 + i
            gc.set_threshold(700)
            del pad
        gc.callbacks.remove(touch)
        assert reads
        assert list(r.tokens) == [10 + i for i in range(200)]
        c.finish(r)
        c.audit()
        print("ok")
        """
    )


def test_gc_callbacks_dropping_handles_while_threads_use_the_cache() -> None:
    # Threads read requests, lock and unlock, and run batches; every collection (one
    # per allocation) drops handles of the same cache from a callback: live requests,
    # held locks, unended batches, each giving back what it holds.
    run_watched(
        """
        import warnings
        warnings.simplefilter("ignore", ResourceWarning)
        sys.setswitchinterval(1e-5)
        c = rc.HybridCache(kv_slots=1 << 15, page_size=1, mamba_slots=64,
                           host_kv_slots=1 << 15, host_mamba_slots=64)
        c.insert(list(range(100, 164)), c.alloc_kv(64), mamba_slot=c.alloc_mamba())
        node = c.match_prefix(list(range(100, 164))).node
        doomed = []

        def drop_some(phase, info):
            if phase == "start":
                doomed.clear()

        def work(k):
            for i in range(150):
                r = c.admit(list(range(100, 164)) + [k, i])
                if r is None:
                    continue
                c.extend(r, [k, i, 7])
                assert len(r.tokens) == len(r.kv_indices) == 67
                held = c.lock(node)
                doomed.extend([r, held, *c.take_batches()])
                other = c.lock(node)
                c.unlock(other)
                if i % 3 == 0:
                    c.finish(r)
                r.live

        gc.callbacks.append(drop_some)
        gc.set_threshold(1)
        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        gc.set_threshold(700)
        gc.callbacks.remove(drop_some)
        doomed.clear()
        gc.collect()
        for b in c.take_batches():
            b.start(); b.complete()
        c.audit()
        s = c.stats()
        assert s["live_locks"] == 0, s
        print("ok")
        """
    )


def test_threads_reading_one_request_get_its_arrays_exactly() -> None:
    # Racing reads of one request's arrays (each may write the shared buffer or replace
    # it) while another thread extends it: every array handed out is a snapshot of the
    # request, and never changes afterwards.
    run_watched(
        """
        sys.setswitchinterval(1e-5)
        c = rc.HybridCache(kv_slots=1 << 14, page_size=1)
        r = c.admit([0])
        seen = []
        done = threading.Event()

        def read():
            while not done.is_set():
                t, kv = r.tokens, r.kv_indices
                seen.append((t, t.copy(), kv, kv.copy()))
                assert list(t) == list(range(len(t)))

        readers = [threading.Thread(target=read) for _ in range(3)]
        for t in readers:
            t.start()
        for i in range(1, 1500):
            c.extend(r, [i])
            if i % 211 == 0:
                c.checkpoint(r)
        done.set()
        for t in readers:
            t.join()
        kv_all = list(r.kv_indices)
        for t, t0, kv, kv0 in seen:
            assert list(t) == list(t0) and list(kv) == list(kv0)
            assert list(kv) == kv_all[: len(kv)]
        c.finish(r)
        c.audit()
        print("ok")
        """
    )
