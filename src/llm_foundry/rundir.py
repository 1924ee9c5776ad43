"""Training run directories: their layout and every reader of it.

    RUN_DIR/
      run.json          what the run was started with (configs, data, code and machine)
      metrics.jsonl     one record a line (train/metrics.py appends them; ``read_records``)
      checkpoints/      step_N/ directories and latest.json (train/state.py writes them)
        latest.json     {"step": N, "path": "step_00000N"}: the newest complete checkpoint
        step_00000N/    config.json + model.safetensors, optimizer.safetensors, state.json, ...
                        (train.checkpoint_format dcp: dcp/, every rank's shards, in place of the
                        two safetensors files; train/dcp.py)

The training side writes this layout with the names defined here; everything that reads a run
(resume, generate, inspect, ablations) reads it through this module.

``checkpoint_dir`` turns what a user names (a run, its checkpoints/ folder, a checkpoint) into
the checkpoint directory; ``loading.load_any`` reads whatever kind that is. A run that is still
training saves a new step directory, points latest.json at it, then deletes older ones
(train.keep_last): ``read_checkpoint`` reads a run's latest checkpoint through that, resolving
it again when the one it was reading is deleted.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from llm_foundry.messages import shown

log = logging.getLogger(__name__)

RUN_INFO = "run.json"
METRICS = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
LATEST = "latest.json"  # in CHECKPOINTS: names the newest complete step directory
STATE = "state.json"  # in a step directory: step, configs, optimizer, RNG and sampler states


def step_name(step: int) -> str:
    """The directory name of the checkpoint saved at ``step`` (sorts in step order)."""
    return f"step_{step:06d}"


def step_dirs(ckpt_root: Path) -> list[Path]:
    """Every step directory under ``ckpt_root``, oldest first."""
    return sorted(Path(ckpt_root).glob("step_*"))


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    """The step directory ``ckpt_root/latest.json`` names (None without a pointer, or when it
    names a directory that is gone)."""
    path = named_step(ckpt_root)
    return path if path is not None and path.exists() else None


def named_step(ckpt_root: Path) -> Path | None:
    """The step directory ``ckpt_root/latest.json`` names, whether or not it exists (None
    without a pointer)."""
    pointer = Path(ckpt_root) / LATEST
    try:
        name = json.loads(pointer.read_text())["path"]
        if not isinstance(name, str) or "/" in name or name in ("", ".", ".."):
            raise TypeError(f"path {name!r} is not a step directory name")
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise ValueError(
            f"{pointer} is not a valid latest-checkpoint pointer ({e!r}); expected "
            '{"step": N, "path": "step_000N"}'
        ) from None
    return Path(ckpt_root) / name


def read_state(path: Path) -> dict:
    """``path/state.json`` (a training checkpoint's state), with errors naming the file."""
    file = Path(path) / STATE
    try:
        state = json.loads(file.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{file} is missing: {path} is not a training checkpoint") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON ({e}); the checkpoint is damaged") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise ValueError(f"{file} holds no training state (expected an object with a 'step')")
    return state


def trained_block_size(ckpt: str | Path) -> int | None:
    """The window length (train.block_size) checkpoint ``ckpt``'s weights were last trained on,
    from its state.json; None where it records none (an HF directory, a bare or quantized copy,
    a damaged state.json: the weights are still usable, so a reader falls back to max_seq_len)."""
    if not (Path(ckpt) / STATE).is_file():
        return None
    try:
        block = read_state(Path(ckpt))["train_config"]["block_size"]
    except (ValueError, KeyError, TypeError):
        return None
    return block if isinstance(block, int) and not isinstance(block, bool) and block > 0 else None


def read_run_info(run_dir: str | Path) -> dict:
    """``RUN_DIR/run.json``, with errors naming the file ({} when the run wrote none yet)."""
    file = Path(run_dir) / RUN_INFO
    if not file.exists():
        return {}
    try:
        info = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON ({e}); the run directory is damaged") from None
    if not isinstance(info, dict):
        raise ValueError(f"{file} holds {type(info).__name__}, not a run description object")
    return info


def read_records(path: str | Path) -> list[dict]:
    """Every record of a ``metrics.jsonl``, in order. The file is flushed after every record and
    fsynced with every checkpoint, so a crash tears at most its last line: that one is dropped
    with a note. A damaged line anywhere else is an error naming file and line. A record whose
    ``step`` is missing or not a step (a string, a float, NaN, a negative number: an edit by
    hand, another tool) is left out with a warning naming file and line, so it cannot stop a
    run from resuming (a resume rewrites the file without it)."""
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


@dataclass
class RunDir:
    """A training run's directory and what can be read from it."""

    path: Path

    def __post_init__(self) -> None:
        self.path = Path(self.path)

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS

    def latest(self) -> Path | None:
        """The latest complete checkpoint (None before the first save)."""
        return latest_checkpoint(self.checkpoints)

    def info(self) -> dict:
        return read_run_info(self.path)

    def metrics(self) -> list[dict]:
        return read_records(self.path / METRICS)


def checkpoint_dir(path: str | Path, flag: str = "--checkpoint") -> Path:
    """The checkpoint directory ``path`` names: itself (ours or an HF one: it has a
    config.json), or for a training run directory (or its ``checkpoints/`` folder) the step
    directory that ``latest.json`` points at."""
    path = Path(path)
    if path.is_file():
        raise NotADirectoryError(f"{flag} {path} is a file: give a run or checkpoint directory "
                                 "(a run, one of our checkpoints or an HF model directory)")  # fmt: skip
    if not path.is_dir():
        raise FileNotFoundError(f"{flag} {path}: no such directory")
    if (path / "config.json").exists():
        if (path / CHECKPOINTS / LATEST).exists():  # which one was meant is not ours to guess
            raise ValueError(
                f"{flag} {path} holds both a checkpoint (config.json) and a training run "
                f"(checkpoints/): give {path / CHECKPOINTS} for the run, or move the checkpoint "
                "into a directory of its own"
            )
        return path
    for root in (path / CHECKPOINTS, path):
        if (root / LATEST).exists():
            return _pointed_step(root)
    if (path / RUN_INFO).exists():  # a run that has not saved yet (or was killed before it did)
        raise FileNotFoundError(
            f"{flag} {path} is a training run with no checkpoint yet ({CHECKPOINTS}/{LATEST} is "
            "missing): a run saves at train.checkpoint_interval, at each validation that "
            "improves its loss and when it ends or is stopped; one killed before that has none"
        )
    raise FileNotFoundError(
        f"{flag} {path}: no config.json (an llm-foundry checkpoint or an HF transformers "
        "directory) and no checkpoints/latest.json (a training run directory)"
    )


READ_TRIES = 5  # reads of a training run's latest checkpoint before giving up


def _pointed_step(root: Path) -> Path:
    """The complete step directory ``root/latest.json`` names, read again a few times when it
    is missing: a training run that saves the same step twice replaces its directory."""
    for attempt in range(READ_TRIES):
        step = named_step(root)
        if step is not None and (step / "config.json").exists():
            return step
        if attempt < READ_TRIES - 1:
            time.sleep(0.01 * 2**attempt)
    raise FileNotFoundError(f"{root / LATEST} points at a step directory with no config.json")


def replaced(ckpt: Path) -> bool:
    """Whether ``ckpt`` was a step directory of a run (beside a latest.json) and is gone: the
    run is training and deleted it after saving a newer one (train.keep_last)."""
    ckpt = Path(ckpt)
    return not ckpt.exists() and (ckpt.parent / LATEST).exists()


class CheckpointReplaced(FileNotFoundError):
    """A run's step directory deleted while it was read: the run is training."""


def missing_file(file: Path, what: str | None = "an llm-foundry checkpoint") -> FileNotFoundError:
    """The error for checkpoint file ``file`` not found: ``CheckpointReplaced`` when its step
    directory was deleted by the run it belongs to, else that its directory is not ``what``."""
    file = Path(file)
    if replaced(file.parent):
        return CheckpointReplaced(
            f"{file.parent} was deleted while it was read ({file.name}): its run is training and "
            "saved a newer checkpoint (train.keep_last)"
        )
    return FileNotFoundError(
        f"{file} not found" + (f": {file.parent} is not {what}" if what else "")
    )


T = TypeVar("T")


def read_checkpoint(path: str | Path, read: Callable[[Path], T], flag: str = "--checkpoint") -> T:
    """``read(checkpoint_dir(path, flag))``. When ``path`` names a run (or its checkpoints/)
    whose step directory is deleted while ``read`` reads it (the run is training and saved a
    newer one), the run's latest checkpoint is resolved and read again, up to ``READ_TRIES``
    times; then ``CheckpointReplaced``, one line. A step directory named by the user is not
    replaced by another: its deletion is ``CheckpointReplaced`` at once."""
    given = Path(path)
    for _ in range(READ_TRIES):
        ckpt = checkpoint_dir(given, flag)
        try:
            return read(ckpt)
        except Exception:
            if not replaced(ckpt):
                raise
            if ckpt == given:
                raise CheckpointReplaced(
                    f"{flag} {given} was deleted while it was read: its run is training and "
                    "saved a newer checkpoint (train.keep_last); give the run directory to read "
                    "its latest one"
                ) from None
    raise CheckpointReplaced(
        f"{flag} {given}: the run is training and replaced its latest checkpoint while it was "
        f"read, {READ_TRIES} times in a row (last {ckpt.name}); try again, or read a copy of one "
        "of its step directories"
    )
