"""Ctrl-C and SIGTERM stop ``prepare`` within a moment while it trains its BPE tokenizer: HF
tokenizers merges pairs in Rust, which holds the calling thread (tokenizer.run_interruptibly)."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.heavy  # subprocesses, each a few seconds

SRC = Path(__file__).resolve().parents[1] / "src"
LINES, LINE_CHARS = 800, 10_000  # 8 MB of DNA, one 10,000-letter word a line
VOCAB = 8000  # merges of long words: about a minute of training on a 2-core CPU
MERGING = b"merging pairs"  # what the train BPE bar says once the trainer has read its text
STOPPED_WITHIN_S = 10.0  # about 1 s here; the old code took 39 s (a margin for a loaded CI machine)
MAIN = "import sys; from llm_foundry.cli import main; sys.exit(main(sys.argv[1:]))"


def _dna_lines(seed: int) -> list[str]:
    letters = np.frombuffer(b"ACGT", dtype=np.uint8)
    rng = np.random.default_rng(seed)
    picks = letters[rng.integers(0, 4, size=(LINES, LINE_CHARS))]
    return [row.tobytes().decode("ascii") for row in picks]


def _stop_while_training(argv: list[str], sig: signal.Signals) -> tuple[int, float, str]:
    """Run ``prepare argv``, send ``sig`` once its train BPE bar says the trainer merges pairs;
    (exit status, seconds from the signal to the exit, stderr)."""
    env = dict(os.environ, PYTHONPATH=str(SRC))
    proc = subprocess.Popen(
        [sys.executable, "-c", MAIN, "prepare", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    err = b""
    try:
        deadline = time.monotonic() + 120
        while MERGING not in err:
            assert proc.poll() is None, err.decode(errors="replace")[-2000:]
            assert time.monotonic() < deadline, "the trainer never started merging"
            if select.select([proc.stderr], [], [], 0.05)[0]:
                err += os.read(proc.stderr.fileno(), 1 << 16)
        time.sleep(0.5)  # well into the merges
        sent = time.monotonic()
        proc.send_signal(sig)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"prepare still ran 60 s after {sig.name}")
        took = time.monotonic() - sent
        err += proc.stderr.read()
        return proc.returncode, took, err.decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _stops_at_once(argv: list[str], sig: signal.Signals, out: Path) -> None:
    status, took, err = _stop_while_training(argv, sig)
    assert status == 128 + sig.value, err[-2000:]
    line = f"llm-foundry prepare: stopped by {sig.name}: nothing was written"
    assert err.splitlines()[-1] == line
    assert took < STOPPED_WITHIN_S, f"exited {took:.1f} s after {sig.name}"
    assert not out.exists()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_a_text_streams_bpe_trains_stops_prepare_at_once(tmp_path, sig):
    text = tmp_path / "dna.txt"
    text.write_text("\n".join(_dna_lines(0)) + "\n")
    out = tmp_path / "d"
    argv = ["--text", str(text), "--tokenizer", "bpe", "--vocab-size", str(VOCAB), "--out",
            str(out)]  # fmt: skip
    _stops_at_once(argv, sig, out)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_a_document_corpus_bpe_trains_stops_prepare_at_once(tmp_path, sig):
    rows = tmp_path / "dna.jsonl"
    rows.write_text("".join(json.dumps({"text": line}) + "\n" for line in _dna_lines(1)))
    val = tmp_path / "val.txt"
    val.write_text("ACGT" * 100)
    out = tmp_path / "d"
    argv = ["--input", str(rows), "--val-source", str(val), "--vocab-size", str(VOCAB),
            "--out", str(out)]  # fmt: skip
    _stops_at_once(argv, sig, out)
