"""A run of more than ``RUN_CHARS`` characters with no space or newline between words (base64,
DNA, minified code) is trained on and tokenized in pieces of ``RUN_CHARS`` characters: BPE
training on one such word takes time that grows with the square of its length (hours for a few
MB). Other text keeps the ids of its whole encoding."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_corpus import is_val, make_docs, read_back

from llm_foundry.data.encode import _CUT, RUN_CHARS, LongRuns, split_pieces, split_text

SRC = Path(__file__).resolve().parents[1] / "src"
MAIN = "import sys; from llm_foundry.cli import main; sys.exit(main(sys.argv[1:]))"
RUN = 1_500_000  # letters of DNA: one word to the BPE trainer, unless cut
IN_SECONDS = 60  # was hours: the trainer's merges over a 1.5M-letter word


def _dna(n: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    return np.frombuffer(b"ACGT", np.uint8)[rng.integers(0, 4, n)].tobytes().decode("ascii")


def _prepare(argv: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ, PYTHONPATH=str(SRC))
    start = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-c", MAIN, "prepare", *argv], capture_output=True,
                              text=True, env=env, timeout=2 * IN_SECONDS)  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail(f"prepare still ran after {2 * IN_SECONDS} s")
    return done, time.monotonic() - start


def _hf(path: Path):
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(path))
    hf.encode_special_tokens = True  # as prepare encodes: special tokens' names are text
    return hf


def _ids(hf, text: str) -> list[int]:
    return hf.encode(text, add_special_tokens=False).ids


@pytest.mark.heavy  # a subprocess prepare of 2 MB: seconds
def test_a_document_with_a_long_run_prepares_in_seconds_counted_and_the_others_exact(tmp_path):
    docs = make_docs(40, seed=11)
    long_at = 5  # a training document (is_val picks 9, 19, ...)
    docs.insert(long_at, _dna(RUN))
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    out = tmp_path / "d"
    done, took = _prepare(["--input", str(rows), "--vocab-size", "400", "--out", str(out)])
    assert done.returncode == 0, done.stderr[-3000:]
    assert took < IN_SECONDS, f"took {took:.0f} s"
    assert "tokenize: 100%" in done.stderr  # the bar of a long tokenizing phase
    assert done.stdout.splitlines()[-1] == (
        f"note: 1 document held a run of more than {RUN_CHARS:,} characters with no space or "
        f"newline between words (base64, DNA, minified code?; first: {rows} line {long_at + 1}): "
        f"tokenized in pieces of {RUN_CHARS:,} characters, a token may break at each cut"
    )
    meta = json.loads((out / "meta.json").read_text())
    assert [s["long_runs"] for s in meta["sources"]] == [1]
    hf = _hf(out / "tokenizer.json")
    eot = [meta["eot_id"]]
    want = {"train": [], "val": []}
    for i, d in enumerate(docs):
        if i == long_at:  # its pieces of RUN_CHARS letters, each encoded on its own
            ids = [t for k in range(0, RUN, RUN_CHARS) for t in _ids(hf, d[k : k + RUN_CHARS])]
        else:  # the ids of the whole document
            ids = _ids(hf, d)
        want["val" if is_val(i) else "train"].append(ids + eot)
    got = read_back(out)
    assert got == want
    assert hf.decode(got["train"][long_at][:-1]) == docs[long_at]


@pytest.mark.heavy  # a subprocess prepare of 1.6 MB: seconds
def test_a_text_with_a_long_run_prepares_in_seconds_counted_and_the_rest_exact(tmp_path):
    words = "\n".join(make_docs(60, seed=12))
    run = _dna(RUN, seed=1)
    text = f"{words}\n{run}\n{words}\n"
    path = tmp_path / "t.txt"
    path.write_text(text, encoding="utf-8")
    out = tmp_path / "d"
    argv = ["--text", str(path), "--tokenizer", "bpe", "--vocab-size", "400", "--out", str(out)]
    done, took = _prepare(argv)
    assert done.returncode == 0, done.stderr[-3000:]
    assert took < IN_SECONDS, f"took {took:.0f} s"
    assert "encode: 100%" in done.stderr
    assert done.stdout.splitlines()[-1].startswith(
        f"note: the text held 1 run of more than {RUN_CHARS:,} characters with no space"
    )
    meta = json.loads((out / "meta.json").read_text())
    # the run begins at the newline before it (the last exact cut), and is cut every RUN_CHARS
    begin = len(words)
    cuts = list(range(begin + RUN_CHARS, begin + 1 + RUN, RUN_CHARS))
    assert meta["long_runs"] == {"runs": 1, "cuts": len(cuts)}
    hf = _hf(out / "tokenizer.json")
    bounds = [0, begin, *cuts, len(text)]
    want = [t for a, b in zip(bounds[:-1], bounds[1:], strict=True) for t in _ids(hf, text[a:b])]
    got = np.concatenate([np.fromfile(out / f"{s}.bin", dtype=meta["dtype"]) for s in ("train",
                          "val")])  # fmt: skip
    assert got.tolist() == want
    assert hf.decode(want) == text


# ----------------------------------------------------------------------------------------------
# split_pieces: exact cuts where it can, a cut every run_chars in a longer stretch without one


@settings(max_examples=200, deadline=None)
@given(
    st.text(alphabet="ab1_ \n\t.é\u0301东🙂", max_size=200),
    st.integers(0, 300),
    st.integers(1, 50),
    st.integers(1, 60),
    st.lists(st.integers(0, 600), max_size=5),
)
def test_split_pieces_cuts_a_stretch_without_an_exact_cut_every_run_chars(
    text, run, chunk_chars, run_chars, reads
):
    text = text[: len(text) // 2] + "x" * run + text[len(text) // 2 :]
    ends = sorted({min(r, len(text)) for r in reads})
    stream = [
        text[a:b] for a, b in zip([0, *ends], [*ends, len(text)], strict=True)
    ]  # as read in blocks
    runs = LongRuns()
    pieces = list(split_pieces(stream, chunk_chars, run_chars, runs))
    assert "".join(pieces) == text and all(pieces)
    cuts = np.cumsum([len(p) for p in pieces])[:-1].tolist()
    forced = [c for c in cuts if not _CUT.match(text, c)]
    assert len(forced) == runs.cuts
    # between two exact places (or the text's ends), at most run_chars characters uncut
    places = sorted({0, len(text), *cuts, *(m.start() for m in _CUT.finditer(text))})
    assert (
        max((b - a for a, b in zip(places[:-1], places[1:], strict=True)), default=0) <= run_chars
    )
    # a forced cut comes run_chars after the exact place or cut before it
    for c in forced:
        assert c - max(p for p in places if p < c) == run_chars


def test_text_with_no_long_run_is_cut_as_before_and_only_where_exact():
    text = " ".join(make_docs(400, seed=13))
    runs = LongRuns()
    pieces = list(split_pieces([text[:70_000], text[70_000:]], 1 << 12, runs=runs))
    assert "".join(pieces) == text and runs.cuts == 0
    assert all(_CUT.match(text, c) for c in np.cumsum([len(p) for p in pieces])[:-1])
    assert list(split_text("x" * (2 * RUN_CHARS + 1))) == ["x" * RUN_CHARS] * 2 + ["x"]
