"""What each process of a torchrun job prints.

Under torchrun (``WORLD_SIZE`` > 1) every rank runs the same command line, so a message that
follows from it alone (a usage or configuration error, a signal that stopped the job, advice on
how to go on) would be printed once per rank: rank 0 prints it, the others stay silent
(``rank0_only``). A message that may differ between ranks (a file one rank could not read, a
disk one rank filled) is printed by each, prefixed with its rank (``per_rank``). An error of
the first kind raised by one rank alone (data only it read) would then be said by none:
``rank_alone`` asks rank 0, while the ranks can still talk, whether it raised the same.
"""

from __future__ import annotations

import contextlib
import datetime
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


def rank_alone(error: BaseException, wait_s: float = 10.0) -> bool:
    """Whether ``error``, raised on this rank while the process group is up, is this rank's own
    (rank 0 did not raise the same within ``wait_s``): then it is said by this rank, with its
    rank, not dropped as one every rank says alike. Rank 0 posts its message for the others
    (in the job's store, which outlives the ranks under torchrun) and is never alone."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return False
    key, said = "llm_foundry/error/rank0", str(error)
    try:
        store = dist.distributed_c10d._get_default_store()
        if dist.get_rank() == 0:
            store.set(key, said)
            return False
        store.wait([key], datetime.timedelta(seconds=wait_s))
        return store.get(key).decode() != said
    except Exception:  # rank 0 silent (stuck in a collective) or the store gone: say it here
        return dist.get_rank() != 0
