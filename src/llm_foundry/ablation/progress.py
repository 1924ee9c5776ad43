"""What a study shows while it measures trained variants and times their steps (a bar on stderr
where ``train.progress`` is on), and how a signal in those phases becomes a ``StudyInterrupted``
naming what is kept."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator


class StudyInterrupted(KeyboardInterrupt):
    """A signal stopped the study; the message says what is kept and how to go on."""

    def __init__(self, signal_name: str | None, message: str):
        super().__init__(message)
        self.signal_name = signal_name  # None: the command knows which signal it was


@contextlib.contextmanager
def bar(desc: str, unit: str, enabled: bool) -> Iterator[Callable[[int, int], None] | None]:
    """A callback ``update(done, total)`` drawing a bar on stderr (None where ``enabled`` is
    off), as ``eval`` draws one; the bar is wiped at the end, also when a signal ends the block,
    so that the command's last line starts a line of its own."""
    if not enabled:
        yield None
        return
    from tqdm import tqdm

    drawn = []

    def update(done: int, total: int) -> None:
        if not drawn:
            drawn.append(tqdm(total=total, desc=desc, unit=unit, leave=False, file=sys.stderr))
        drawn[0].update(done - drawn[0].n)

    try:
        yield update
    finally:
        if drawn:
            drawn[0].close()


@contextlib.contextmanager
def kept_on_interrupt(stopped_while: str, kept: str) -> Iterator[None]:
    """A Ctrl-C or SIGTERM (raised as KeyboardInterrupt by the command) within the block
    becomes one ``StudyInterrupted`` saying what it stopped, what is kept, and that rerunning
    the same command resumes from there."""
    try:
        yield
    except StudyInterrupted:
        raise
    except KeyboardInterrupt:
        raise StudyInterrupted(
            None, f"stopped while {stopped_while}; kept: {kept}; rerun the same command to resume"
        ) from None
