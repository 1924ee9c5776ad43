"""``metrics.jsonl``: one JSON record a line, appended as training goes; its one reader.

The file is flushed after every record and fsynced with every checkpoint, so a crash can lose at
most the records written since the last checkpoint, and tear at most the last line: readers drop
a torn final record with a note. A damaged line anywhere else is an error naming file and line.
A record whose ``step`` is missing or not a step (a string, a float, NaN, a negative number: an
edit by hand, another tool) is left out with a warning naming file and line, so it cannot stop a
run from resuming (a resume rewrites the file without it).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from llm_foundry.messages import shown

log = logging.getLogger(__name__)


def read_records(path: str | Path) -> list[dict]:
    """Every record of ``path``, in order; a final line cut short by a crash is dropped (with a
    note on stderr), and so is a record without a usable step (a warning naming the line)."""
    path = Path(path)
    # lines end at '\n' only: a JSON string may hold U+2028 and other characters that
    # str.splitlines() would take for line ends
    lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    if lines and not lines[-1].strip():
        lines.pop()
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict):
                raise ValueError(f"a {type(rec).__name__}, not an object")
        except ValueError as e:
            if i == len(lines) - 1:  # torn by a crash mid-write
                log.warning(f"note: {path}: dropped a torn last record (line {i + 1})")
                break
            raise ValueError(
                f"{path}, line {i + 1}: not a JSON record ({e}); the file is damaged"
            ) from None
        step = rec.get("step")
        if not (isinstance(step, int) and not isinstance(step, bool) and step >= 0):
            what = "no step" if "step" not in rec else f"step={shown(step)}"
            log.warning(
                f"warning: {path}, line {i + 1}: left out a record with {what} (a step is an "
                "integer >= 0)"
            )
            continue
        records.append(rec)
    return records


class MetricsLog:
    """Appends records to ``metrics.jsonl``. A resumed run keeps the records up to its
    checkpoint's step and drops the rest (they are trained again)."""

    def __init__(self, path: Path, resume_step: int | None, enabled: bool = True):
        self.path, self.file = path, None
        if not enabled:  # ranks other than 0 write nothing
            return
        if resume_step is not None and path.exists():
            kept = [r for r in read_records(path) if r["step"] <= resume_step]
            path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        elif resume_step is None:
            path.write_text("")
        self.file = open(path, "a")  # noqa: SIM115 - open for the whole run

    def write(self, record: dict) -> None:
        if self.file is None:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def sync(self) -> None:
        """Make what was written durable (called with every checkpoint)."""
        if self.file is not None:
            self.file.flush()
            os.fsync(self.file.fileno())

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
