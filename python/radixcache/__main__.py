"""The ``radixcache`` command's entry point (also ``python -m radixcache``).

It handles Ctrl-C from its first line: the command line (`radixcache.cli`), the extension
and NumPy load inside `main`, with SIGINT held off until they are loaded (NumPy turns an
interrupt inside its import into an `ImportError`), so that an interrupt at any moment
ends the command with ``interrupted`` and status 130, never a traceback. Before this
module runs there is only the interpreter's own start (and ``radixcache/__init__.py``,
which loads nothing: its names load on first use).
"""

import sys

TYPE_CHECKING = False  # not typing's: see radixcache/__init__.py
if TYPE_CHECKING:
    import signal as _signal
    from collections.abc import Callable
else:
    # The C module behind `signal`, which the interpreter has loaded already: importing
    # `signal` (and its `enum`) would take milliseconds in which Ctrl-C prints a traceback.
    import _signal


def _load_cli() -> "Callable[[], int] | None":
    """Import `radixcache.cli` with SIGINT held off; its ``main``, or None if interrupted."""
    held: list[int] = []
    previous = _signal.getsignal(_signal.SIGINT)
    if previous is _signal.default_int_handler:  # else ignored, or the caller's own
        _signal.signal(_signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        from radixcache.cli import main
    finally:
        if previous is _signal.default_int_handler:
            _signal.signal(_signal.SIGINT, previous)
    return None if held else main


def main() -> int:
    """Run the command line (`radixcache.cli.main`); 130 when interrupted."""
    try:
        run = _load_cli()
        if run is not None:
            return run()
    except KeyboardInterrupt:
        pass
    print("interrupted", file=sys.stderr)
    return 130


if __name__ == "__main__":
    sys.exit(main())
