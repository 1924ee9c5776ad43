"""Build the local tasks' JSONL files from tiny Shakespeare's validation part (its last 10%, the
split ``prepare`` holds out), so a model trained on the rest is evaluated on text it never saw;
and the preference rows of ``finetune --task dpo``'s demonstration from the training part (the
evaluation tasks stay unseen by it too).

    python -m llm_foundry.tasks.build path/to/tinyshakespeare.txt

The rows are drawn with a fixed seed: the same corpus always gives the same files.
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

from llm_foundry.data.sft_demo import speeches

FILES = {
    "next_line": "next_line.jsonl",
    "passages": "passages.jsonl",
    "next_speaker": "next_speaker.jsonl",
    "prefer_next_line": "prefer_next_line.jsonl",
}
VAL_FRACTION = 0.1  # prepare's split: the last 10% of the text


def training_part(text: str) -> str:
    """The part of ``text`` a model prepared from it trains on (all but the last 10%)."""
    return text[: int(len(text) * (1 - VAL_FRACTION))]


def held_out(text: str) -> str:
    """The validation part of ``text``, from its first paragraph start (no cut speech)."""
    tail = text[int(len(text) * (1 - VAL_FRACTION)) :]
    return tail[tail.find("\n\n") + 2 :]


def next_line_rows(text: str, n: int = 200, seed: int = 0) -> list[dict]:
    """Multiple choice: a speaker and the speech's first line; the real second line among three
    second lines of other speeches."""
    found = [s for s in speeches(text) if len(s[1]) >= 2]
    rng = random.Random(seed)
    rows = []
    for i in rng.sample(range(len(found)), min(n, len(found))):
        speaker, lines = found[i]
        others = [found[j][1][1] for j in rng.sample(range(len(found)), 8) if j != i]
        wrong = [line for line in dict.fromkeys(others) if line != lines[1]][:3]
        choices = [*wrong, lines[1]]
        rng.shuffle(choices)
        rows.append(
            {
                "context": f"{speaker}:\n{lines[0]}\n",
                "choices": choices,
                "label": choices.index(lines[1]),
            }
        )
    return rows


def passage_rows(text: str, n: int = 50, min_chars: int = 600) -> list[dict]:
    """Consecutive whole paragraphs, at least ``min_chars`` each passage, in corpus order."""
    rows, current = [], []
    for block in re.split(r"\n\s*\n", text.strip()):
        current.append(block.strip())
        if sum(len(b) for b in current) >= min_chars:
            rows.append({"text": "\n\n".join(current) + "\n"})
            current = []
        if len(rows) == n:
            break
    return rows


def next_speaker_rows(text: str, n: int = 100, seed: int = 0) -> list[dict]:
    """Generation: a whole speech, then the name of whoever speaks next (another character)."""
    found = speeches(text)
    pairs = [(a, b) for a, b in zip(found, found[1:], strict=False) if a[0] != b[0]]
    rng = random.Random(seed)
    return [
        {"context": f"{a[0]}:\n" + "\n".join(a[1]) + "\n\n", "speaker": b[0]}
        for a, b in rng.sample(pairs, min(n, len(pairs)))
    ]


def prefer_next_line_rows(text: str, n: int = 1000, seed: int = 0) -> list[dict]:
    """Preference pairs: a speaker and the speech's first line; chosen, the speech's real second
    line; rejected, the same words in a shuffled order (second lines of at least 4 words)."""
    found = [s for s in speeches(text) if len(s[1]) >= 2 and len(set(s[1][1].split())) >= 4]
    rng = random.Random(seed)
    rows = []
    for i in rng.sample(range(len(found)), min(n, len(found))):
        speaker, lines = found[i]
        words = lines[1].split()
        shuffled = words[:]
        while shuffled == words:
            rng.shuffle(shuffled)
        rows.append(
            {
                "prompt": f"{speaker}:\n{lines[0]}\n",
                "chosen": f"{lines[1]}\n",
                "rejected": " ".join(shuffled) + "\n",
            }
        )
    return rows


def build(corpus: str | Path, out: str | Path) -> dict[str, int]:
    """Write the JSONL files into ``out``; returns rows per file."""
    whole = Path(corpus).read_text(encoding="utf-8")
    text = held_out(whole)
    made = {
        "next_line": next_line_rows(text),
        "passages": passage_rows(text),
        "next_speaker": next_speaker_rows(text),
        "prefer_next_line": prefer_next_line_rows(training_part(whole)),
    }
    for name, rows in made.items():
        lines = [json.dumps(r, ensure_ascii=False) for r in rows]
        (Path(out) / FILES[name]).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return {name: len(rows) for name, rows in made.items()}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m llm_foundry.tasks.build path/to/tinyshakespeare.txt")
    counts = build(sys.argv[1], Path(__file__).parent)
    print(", ".join(f"{FILES[k]}: {v} rows" for k, v in counts.items()))
