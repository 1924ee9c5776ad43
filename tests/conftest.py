"""Shared fixtures: small character-level corpora prepared once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from llm_foundry.data import prepare

SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"


def corpus_text(n_chars: int) -> str:
    """The first ``n_chars`` of tiny Shakespeare when the shared copy is there, else filler."""
    if SHAKESPEARE.exists():
        return SHAKESPEARE.read_text()[:n_chars]
    # every letter in both cases, so the docs' prompts ("ROMEO: ...") encode
    line = (
        "ROMEO: But soft, what light through yonder window breaks? {}\n"
        "JULIET: The quick brown fox jumps over the lazy dog; to be, or not to be!\n"
        + "THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG.\n"
    )
    return "".join(line.format(i) for i in range(n_chars // len(line) + 1))[:n_chars]


@pytest.fixture(scope="session")
def char_data(tmp_path_factory):
    """``char_data(n_chars)`` -> a prepared directory (train.bin, val.bin, tokenizer, meta)."""
    made: dict[int, Path] = {}

    def make(n_chars: int) -> Path:
        if n_chars not in made:
            root = tmp_path_factory.mktemp(f"char{n_chars}")
            (root / "corpus.txt").write_text(corpus_text(n_chars))
            prepare(
                root / "char", text_files=[root / "corpus.txt"], tokenizer="char", progress=False
            )
            made[n_chars] = root / "char"
        return made[n_chars]

    return make
