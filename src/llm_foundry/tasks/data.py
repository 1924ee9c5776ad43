"""The local tasks' datasets, read from the JSONL files beside this file. The harness loads this
file by its path (the YAMLs name ``!function data.NAME``), so it imports nothing of the project."""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).parent


def rows(path: Path) -> list[dict]:
    """The JSON rows of a JSONL file; lines end at "\\n" only (a U+2028 or U+0085 in a string
    is text, which ``str.splitlines`` would cut at)."""
    lines = path.read_text(encoding="utf-8").split("\n")
    return [json.loads(x) for x in lines if x.strip(" \t\r")]


def _split(name: str, **_):
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows(HERE / name))})


def next_line(**kwargs):
    return _split("next_line.jsonl")


def passages(**kwargs):
    return _split("passages.jsonl")


def next_speaker(**kwargs):
    return _split("next_speaker.jsonl")
