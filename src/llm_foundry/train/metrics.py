"""``metrics.jsonl``'s writer: one JSON record a line, appended as training goes (and mirrored to
TensorBoard when asked).

The file is flushed after every record and fsynced with every checkpoint, so a crash can lose at
most the records written since the last checkpoint, and tear at most the last line. A write that
fails (a full disk) is ``state.FileNotWritten`` naming the file. Its one reader is the run
directory's (``llm_foundry.rundir.read_records``).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from llm_foundry.rundir import read_records
from llm_foundry.train.state import FileNotWritten


class MetricsLog:
    """Appends records to ``metrics.jsonl``. A resumed run keeps the records up to its
    checkpoint's step and drops the rest (they are trained again)."""

    def __init__(self, path: Path, resume_step: int | None, enabled: bool = True):
        self.path, self.file = path, None
        self.failed = False  # a write failed: what is left in the buffer is not written again
        if not enabled:  # ranks other than 0 write nothing
            return
        kept = None  # None: the file as it is (a resume with none yet: made by the open)
        if resume_step is not None and path.exists():
            kept = [r for r in read_records(path) if r["step"] <= resume_step]
        elif resume_step is None:
            kept = []
        with self._writing():
            if kept is not None:
                path.write_text("".join(json.dumps(r) + "\n" for r in kept))
            self.file = open(path, "a")  # noqa: SIM115 - open for the whole run

    def write(self, record: dict) -> None:
        if self.file is None:
            return
        with self._writing():
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def sync(self) -> None:
        """Make what was written durable (called with every checkpoint)."""
        if self.file is not None:
            with self._writing():
                self.file.flush()
                os.fsync(self.file.fileno())

    def close(self) -> None:
        if self.file is None:
            return
        try:
            self.file.close()
        except OSError:
            if not self.failed:  # after a failed write the error has been raised already
                raise

    @contextlib.contextmanager
    def _writing(self):
        """An OSError of the writes within as ``FileNotWritten`` naming the file."""
        try:
            yield
        except OSError as e:
            self.failed = True
            raise FileNotWritten(self.path, e) from e


def require_tensorboard():
    """TensorBoard's ``SummaryWriter`` class; ``MissingExtra`` with the install line when the
    [tensorboard] extra is missing (a command checks this before it creates the run directory)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        from llm_foundry.package import absent, missing_extra

        if not absent(e, "tensorboard", "torch.utils.tensorboard"):
            raise  # installed but broken: its own error
        raise missing_extra("train.tensorboard=true needs TensorBoard", "tensorboard") from e
    return SummaryWriter


def tensorboard(out: Path, purge_step: int | None):
    """A TensorBoard writer in ``out/tensorboard``; events past ``purge_step`` (those a resumed
    run trains again) hidden."""
    return require_tensorboard()(str(out / "tensorboard"), purge_step=purge_step)


def tb_write(tb, group: str, rec: dict) -> None:
    """One metrics.jsonl record as TensorBoard scalars named ``group/key`` at its step."""
    for k, v in rec.items():
        if k != "step":
            tb.add_scalar(f"{group}/{k}", v, rec["step"])
