"""How a command answers a signal, with the standard library alone (so it works while a heavy
import such as torch is half done): the one line and exit status of a stopped command
(``stopped``), and Ctrl-C held back while a command's modules load (``held_interrupt``).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading


def stopped(prog: str, signal_name: str | None, what: str) -> int:
    """Say on stderr (one line) that a signal stopped the command, and return the exit status
    a shell gives a process its signal ended: 128 + the signal's number (SIGINT 130, SIGTERM
    143)."""
    sig = signal.Signals[signal_name] if signal_name in signal.Signals.__members__ else None
    sig = sig or signal.SIGINT
    print(f"{prog}: stopped by {sig.name}: {what}", file=sys.stderr, flush=True)
    return 128 + sig.value


@contextlib.contextmanager
def held_interrupt():
    """Within it, a Ctrl-C (SIGINT) is recorded, not raised: a KeyboardInterrupt in the middle
    of importing torch leaves it half-loaded (a traceback from the handler's own imports, or
    a C++ abort), so it is raised once the block ends. Yields a list that holds a True then.
    Only where SIGINT raises KeyboardInterrupt (not ignored, not handled otherwise)."""
    asked: list[bool] = []
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield asked
        return
    signal.signal(signal.SIGINT, lambda *_: asked.append(True))
    try:
        yield asked
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if asked:
        raise KeyboardInterrupt


@contextlib.contextmanager
def terminate_as_interrupt():
    """Within it, SIGTERM (a scheduler's preemption, ``kill``) ends the work as Ctrl-C does: a
    KeyboardInterrupt, so the same cleanup runs and the same line is said. Yields a list that
    names the signal that stopped it ("SIGTERM"; empty for a Ctrl-C)."""
    got: list[str] = []
    if threading.current_thread() is not threading.main_thread():
        yield got
        return

    def interrupt(*_):
        got.append("SIGTERM")
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield got
    finally:
        signal.signal(signal.SIGTERM, old)
