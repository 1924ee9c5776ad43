"""Console streams that outlive their reader, for commands whose product is files, not text.

``llm-foundry train ... | head -2`` closes the pipe after two lines; the next write then fails
with EPIPE (Python ignores SIGPIPE, so it is a ``BrokenPipeError``). A short command may end
there; a training run keeps going with its output sent to ``os.devnull``:

- its product is the run directory (checkpoints, metrics.jsonl, summary.json), which the console
  only shows: a reader gone (``| head``, a ``| tee`` that crashed) must neither end a run that
  may take days nor cut it short of its checkpoint;
- ending it instead, as on SIGINT, would need a ``--resume`` to get the rest of what was asked;
  a user who does want it to end still has Ctrl-C, which saves a checkpoint and stops.

When stdout goes and stderr is still read (``train | head``, stderr on the terminal), one line
on stderr says so.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Callable, Iterator


class Outliving:
    """A text stream that, once its reader is gone, sends what is written to ``os.devnull``
    (its file descriptor too, so C code and the flush at exit write there as well) and says so
    once through ``gone(name)``. Everything else is the wrapped stream's."""

    def __init__(self, stream, name: str, gone: Callable[[str], None]):
        self._stream, self._name, self._gone = stream, name, gone
        self.reader_gone = False

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._drop()
            return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._drop()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)

    def _drop(self) -> None:
        null = open(os.devnull, "w")  # noqa: SIM115 - the stream's for the rest of the process
        with contextlib.suppress(AttributeError, OSError, io.UnsupportedOperation):
            os.dup2(null.fileno(), self._stream.fileno())  # its buffer flushes there at exit
        self._stream, self.reader_gone = null, True
        self._gone(self._name)


@contextlib.contextmanager
def outliving_reader(prog: str) -> Iterator[tuple[Outliving, Outliving]]:
    """``sys.stdout`` and ``sys.stderr`` as ``Outliving`` streams while the block runs."""
    saved = sys.stdout, sys.stderr

    def gone(name: str) -> None:
        if name == "stdout":  # stderr gone too: this line goes to os.devnull
            print(f"{prog}: stdout was closed (its reader exited); the run goes on and its "
                  "output is discarded (Ctrl-C saves a checkpoint and stops)", file=sys.stderr,
                  flush=True)  # fmt: skip

    out, err = Outliving(saved[0], "stdout", gone), Outliving(saved[1], "stderr", gone)
    sys.stdout, sys.stderr = out, err
    try:
        yield out, err
    finally:
        sys.stdout, sys.stderr = saved
