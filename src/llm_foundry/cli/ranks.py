"""What each process of a torchrun job prints.

Under torchrun (``WORLD_SIZE`` > 1) every rank runs the same command line, so a message that
follows from it alone (a usage or configuration error, a signal that stopped the job, advice on
how to go on) would be printed once per rank: rank 0 prints it, the others stay silent
(``rank0_only``). A message that may differ between ranks (a file one rank could not read, a
disk one rank filled) is printed by each, prefixed with its rank (``per_rank``).
"""

from __future__ import annotations

import contextlib
import io
import os


def rank_and_world() -> tuple[int, int]:
    """(this process's rank, the number of processes) as torchrun sets them; (0, 1) alone."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def rank0_only():
    """A context in which what is written to stderr is dropped on every rank but rank 0 (for
    lines every rank would write alike)."""
    rank, world = rank_and_world()
    if world > 1 and rank > 0:
        return contextlib.redirect_stderr(io.StringIO())
    return contextlib.nullcontext()


def per_rank(line: str) -> str:
    """``line`` as a rank says it: ``rank N: line`` under torchrun, else unchanged."""
    rank, world = rank_and_world()
    return f"rank {rank}: {line}" if world > 1 else line
