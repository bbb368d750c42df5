"""An exception leaving code that holds batches, requests, locks or load-backs arrives
unchanged: their finalisers (which give back what the objects own and warn) run while it
is being raised, and must neither lose it, replace it (`SystemError: error return without
exception set`) nor crash the interpreter. Each case runs in a child interpreter, so that
a regression fails a test instead of killing the test run."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

#: The issue's setup: a cached prompt and a request whose admission copy is pending.
SETUP = """
import radixcache as rc
cache = rc.HybridCache(
    kv_slots=4096, page_size=16, mamba_slots=8, host_kv_slots=8192, host_mamba_slots=16
)
p = list(range(64))
r = cache.admit(p); cache.extend(r, p); cache.finish(r)
r2 = cache.admit(p + [1, 2, 3])
"""

#: A cache with a node on the host only and a request admitted over it (ready to load).
HOST_ONLY = """
import radixcache as rc

def host_only_request():
    c = rc.HybridCache(kv_slots=64, mamba_slots=4, host_kv_slots=64, host_mamba_slots=4)
    c.insert([1, 2, 3, 4], c.alloc_kv(4), mamba_slot=c.alloc_mamba())
    for b in c.take_batches():
        b.start(); b.complete()
    c.evict(kv_tokens=4)
    request = c.admit([1, 2, 3, 4, 5])
    for b in c.take_batches():
        b.start(); b.complete()
    return c, request
"""

#: Everything that warns when collected: a live request, a held lock, an uncommitted
#: load-back and unended batches, as locals of `hold()`, which raises `exc`.
HOLD_ALL = (
    HOST_ONLY
    + """
def hold(exc):
    c, request = host_only_request()
    lb = c.load_back(request)
    c.insert([7, 8], c.alloc_kv(2))
    lock = c.lock(c.match_prefix([7, 8]).node)
    batches = c.take_batches()
    assert request.live and lock.held and lb.held and batches
    raise exc
"""
)

#: Ways to leave a loop over batches with an exception (`{exc}`), by where it runs.
LOOPS = {
    "module": """
        for batch in cache.take_batches():
            raise {exc}
    """,
    "function": """
        def step():
            for batch in cache.take_batches():
                raise {exc}
        step()
    """,
    "generator": """
        def batches():
            for batch in cache.take_batches():
                yield batch
                raise {exc}
        for b in batches():
            pass
    """,
    "suspended generator": """
        def batches():
            yield from cache.take_batches()
        for b in batches():
            raise {exc}
    """,
    "with batch": """
        for batch in cache.take_batches():
            with batch:
                batch.start()
                raise {exc}
    """,
    "drops while unwinding": """
        {hold}
        hold({exc})
    """,
    "with load-back": """
        {hold_lb}
        hold_lb({exc})
    """,
}

HOLD_LB = (
    HOST_ONLY
    + """
def hold_lb(exc):
    c, request = host_only_request()
    with c.load_back(request) as lb:
        batch = lb.batch
        batch.start()
        raise exc
"""
)

#: Warnings filters: the default (ResourceWarning ignored), shown, and made errors.
FILTERS = {
    "default": [],
    "always": ["-W", "always::ResourceWarning"],
    "error": ["-W", "error::ResourceWarning"],
}


def child(body: str, flags: list[str]) -> subprocess.CompletedProcess[str]:
    src = SETUP + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, *flags, "-c", src],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def loop(where: str, exc: str) -> str:
    body = textwrap.dedent(LOOPS[where])
    return body.format(exc=exc, hold=HOLD_ALL, hold_lb=HOLD_LB)


def assert_arrived(out: subprocess.CompletedProcess[str], returncode: int, last_line: str) -> None:
    """The child died of the user's exception, reported as Python reports it."""
    assert out.returncode not in (139, -signal.SIGSEGV, -signal.SIGABRT), out.stderr
    assert "SystemError" not in out.stderr, out.stderr
    assert "Fatal Python error" not in out.stderr, out.stderr
    assert "panicked" not in out.stderr, out.stderr
    assert out.returncode == returncode, out.stderr
    assert "Traceback (most recent call last)" in out.stderr
    assert out.stderr.rstrip().splitlines()[-1] == last_line, out.stderr


@pytest.mark.parametrize("flags", FILTERS.values(), ids=FILTERS.keys())
@pytest.mark.parametrize("where", LOOPS)
def test_an_exception_leaving_code_that_holds_batches_arrives_unchanged(
    where: str, flags: list[str]
) -> None:
    out = child(loop(where, 'ValueError("engine error")'), flags)
    assert_arrived(out, 1, "ValueError: engine error")


@pytest.mark.parametrize("flags", FILTERS.values(), ids=FILTERS.keys())
@pytest.mark.parametrize("where", LOOPS)
def test_a_keyboard_interrupt_leaving_code_that_holds_batches_arrives_unchanged(
    where: str, flags: list[str]
) -> None:
    out = child(loop(where, "KeyboardInterrupt"), flags)
    # An uncaught KeyboardInterrupt ends the interpreter by SIGINT, as Ctrl-C would.
    assert_arrived(out, -signal.SIGINT, "KeyboardInterrupt")


@pytest.mark.parametrize("where", LOOPS)
def test_system_exit_keeps_its_code(where: str) -> None:
    out = child(loop(where, "SystemExit(3)"), FILTERS["error"])
    assert out.returncode == 3, out.stderr
    assert "SystemError" not in out.stderr


@pytest.mark.parametrize("flags", FILTERS.values(), ids=FILTERS.keys())
@pytest.mark.parametrize("where", LOOPS)
def test_an_exception_caught_around_it_is_the_users(where: str, flags: list[str]) -> None:
    body = "try:\n" + textwrap.indent(loop(where, 'ValueError("engine error")'), "    ")
    body += "except ValueError as e:\n    print('caught', repr(e))\n"
    out = child(body, flags)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "caught ValueError('engine error')\n", out.stderr
    assert "SystemError" not in out.stderr


#: `hold()`'s exception caught; the cycle it makes with `hold()`'s frame (the exception is
#: a local there) collected.
CATCH = """
import gc
try:
    hold(ValueError("x"))
except ValueError:
    pass
gc.collect()
"""


def test_the_warnings_still_say_what_was_given_back() -> None:
    out = child(HOLD_ALL + CATCH, FILTERS["always"])
    assert out.returncode == 0, out.stderr
    for what in (
        "was garbage-collected while live; aborted it",
        "was garbage-collected while held; released it",
        "was garbage-collected uncommitted; released what it took",
        "was garbage-collected before it ended; failed it",
    ):
        assert what in out.stderr, out.stderr


def test_a_warning_made_an_error_is_reported_as_unraisable_naming_the_class() -> None:
    out = child(HOLD_ALL + CATCH, FILTERS["error"])
    assert out.returncode == 0, out.stderr
    for cls in ("Request", "Lock", "LoadBack", "TransferBatch"):
        assert f"Exception ignored in: <class 'radixcache._core.{cls}'>" in out.stderr, out.stderr


@pytest.mark.parametrize("flags", FILTERS.values(), ids=FILTERS.keys())
def test_objects_still_held_at_exit_are_given_back_quietly(flags: list[str]) -> None:
    body = HOST_ONLY + textwrap.dedent("""
        import atexit
        c, request = host_only_request()
        lb = c.load_back(request)
        c.insert([7, 8], c.alloc_kv(2))
        lock = c.lock(c.match_prefix([7, 8]).node)
        batches = c.take_batches() + cache.take_batches()
        started = batches[0]
        started.start()
        # A cycle, collected only by the interpreter's last collection.
        cycle = [request, lock, lb, batches]
        cycle.append(cycle)
        print("done")
    """)
    out = child(body, flags)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "done\n"
    assert out.stderr == ""
