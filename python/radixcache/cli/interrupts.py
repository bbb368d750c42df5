"""Ctrl-C during a command: noted, and acted on between two scheduler steps."""

from __future__ import annotations

import signal
import threading
from typing import Any, Callable


class _Interrupts:
    """Ctrl-C during a run stops it between two scheduler steps, not inside a cache call.

    The first SIGINT is noted, and raised as `KeyboardInterrupt` after the scheduler step
    under way (`between`), or when the run ends (its last phases, the audit, clearing
    the cache and the attention-only replay, take seconds); a second one is raised at
    once. SIGINT is left alone outside the main thread or when Python's own handler is
    not the one installed (it is ignored, or the caller has its own).
    """

    def __init__(self) -> None:
        self.pending = False
        self._previous: Any = None

    def __enter__(self) -> _Interrupts:
        if (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        ):
            self._previous = signal.signal(signal.SIGINT, self._note)
        return self

    def _note(self, signum: int, frame: Any) -> None:
        if self.pending:
            raise KeyboardInterrupt
        self.pending = True

    def check(self) -> None:
        """Raise `KeyboardInterrupt` if Ctrl-C was pressed."""
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt

    def between(self, bar: Any, task: Any) -> Callable[[int], None]:
        """Return the scheduler's progress callback: update the bar, then `check`."""

        def progress(done: int) -> None:
            bar.update(task, completed=done)
            self.check()

        return progress

    def __exit__(self, kind: object, value: object, tb: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        if kind is None:
            self.check()
