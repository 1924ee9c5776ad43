"""JSON lines of rows (fine-tuning, preference): each line one JSON object, read one line at a
time with errors naming the file and line (``iter_objects``); and what to say of such a file
given where a prepared directory was expected (``rows_advice``)."""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from pathlib import Path

from llm_foundry.data.sources import DataError
from llm_foundry.messages import shown

JSON_SPACE = " \t\r\n"  # what JSON counts as whitespace (str.strip would take U+2028 too)


class _RepeatedKey(ValueError):
    pass


def _object(pairs: list) -> dict:
    """A JSON object that names a key given twice (json.loads would keep the last silently)."""
    row = {}
    for key, value in pairs:
        if key in row:
            raise _RepeatedKey(key)
        row[key] = value
    return row


def iter_objects(path: str | Path, what: str, digest=None) -> Iterator[tuple[int, dict, str]]:
    """(line number, object, where) of every line of a JSONL file, read one line at a time: UTF-8
    (a byte-order mark allowed), blank lines skipped, each other line one JSON object naming each
    key once; a DataError naming the file and line otherwise (``what`` names the file when it is
    missing). ``digest`` (a hashlib object) is fed every byte read."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{what} file {path} does not exist (or is not a file)")
    with open(path, "rb") as f:
        for i, raw in enumerate(f, start=1):  # binary lines end at b"\n" only
            if digest is not None:
                digest.update(raw)
            where = f"{path}, line {i}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{where}: not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                    "convert the file to UTF-8"
                ) from None
            if i == 1:
                line = line.removeprefix("\ufeff")  # a byte-order mark some editors write
            if not line.strip(JSON_SPACE):
                continue
            try:
                row = json.loads(line, object_pairs_hook=_object)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not JSON ({e.msg}, column {e.colno})") from None
            except _RepeatedKey as e:
                raise DataError(
                    f"{where}: the key {shown(e.args[0])} is given twice in one object; give "
                    "it once (JSON readers keep only one of them)"
                ) from None
            if not isinstance(row, dict):
                raise DataError(f"{where}: a {type(row).__name__}, expected an object")
            yield i, row, where


def rows_advice(path: Path, model: str = "MODEL") -> str | None:
    """What to say of a JSONL file of fine-tuning or preference rows given where a directory
    ``prepare`` wrote was expected: the command that takes them (``model``: the checkpoint a
    fine-tune starts from, as typed); None for any other file."""
    try:
        first = next(iter_objects(path, "rows"), None)
    except DataError:  # not JSONL: not rows
        return None
    keys = set(first[1]) if first else set()
    file, model = shlex.quote(str(path)), shlex.quote(model) if model != "MODEL" else model
    if {"chosen", "rejected"} <= keys:
        return (f"is a file of preference rows (prompt, chosen, rejected): `llm-foundry finetune "
                f"--task dpo --checkpoint {model} --data {file} --out RUN` tokenizes and trains "
                "on it as it is")  # fmt: skip
    if "messages" in keys or {"prompt", "completion"} <= keys:
        fields = "messages" if "messages" in keys else "prompt, completion"
        return (f"is a file of fine-tuning rows ({fields}), not a directory `prepare` wrote: make "
                f"one with `llm-foundry prepare --sft {file} --tokenizer-from {model} --out DIR`, "
                "then --data DIR")  # fmt: skip
    return None
