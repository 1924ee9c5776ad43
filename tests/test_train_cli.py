"""``llm-foundry train`` as a command: a reader of its output that goes away (``| head``) costs
the run nothing (it trains on silently to its checkpoint and summary.json, exit 0), and
summary.json says why a run ended early."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from llm_foundry.cli import main
from llm_foundry.train.trainer import Trainer

STEPS = 6


def _argv(data, out) -> list[str]:
    """A run of a few seconds that saves at step 3 and at the end, and says so on stdout."""
    return ["train", "--data", str(data), "--out", str(out), "--model.dim", "16",
            "--model.n_layers", "1", "--model.n_heads", "2", "--model.max_seq_len", "32",
            "--train.block_size", "16", "--train.batch_size", "2", "--train.max_steps",
            str(STEPS), "--train.eval_interval", "3", "--train.eval_batches", "1",
            "--train.warmup_steps", "1", "--train.sample_tokens", "20"]  # fmt: skip


def _finished(out) -> dict:
    """The run in ``out`` trained to the end: its summary, checkpoint and every record kept."""
    summary = json.loads((out / "summary.json").read_text())
    assert summary["step"] == STEPS and summary["interrupted"] is False
    assert (out / "checkpoints" / f"step_{STEPS:06d}" / "model.safetensors").is_file()
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sorted(set(steps)) == list(range(1, STEPS + 1))
    assert summary["stopped_early"] is None  # max_steps reached: no early stop
    return summary


def test_a_closed_stdout_does_not_stop_training(char_data, tmp_path, monkeypatch):
    """stdout a pipe whose reader exited before the first line: the run trains to the end, its
    output discarded, and says so once on stderr (still read)."""
    read, write = os.pipe()
    os.close(read)  # every write to the pipe now fails with EPIPE
    with os.fdopen(write, "w", buffering=1) as closed:
        err = io.StringIO()
        monkeypatch.setattr(sys, "stdout", closed)
        monkeypatch.setattr(sys, "stderr", err)
        out = tmp_path / "run"
        assert main(_argv(char_data(3000), out)) == 0
        monkeypatch.undo()
    _finished(out)
    said = [line for line in err.getvalue().splitlines() if "stdout was closed" in line]
    assert len(said) == 1 and said[0].startswith("llm-foundry train: "), err.getvalue()


GATED = """
import os, sys, time
from llm_foundry.train import trainer

run = trainer.Trainer.run


def gated(self):  # training starts once the reader has gone (no race with the test)
    while not os.path.exists({gate!r}):
        time.sleep(0.01)
    return run(self)


trainer.Trainer.run = gated
from llm_foundry.cli import main

sys.exit(main({argv!r}))
"""


@pytest.mark.heavy
def test_train_piped_to_head_trains_to_its_checkpoint(char_data, tmp_path):
    """``llm-foundry train ... 2>&1 | head -1``: the reader exits after the first line, before
    the first step; the run trains to max_steps silently and exits 0 with every file a run
    writes (before: exit 0 with only run.json and metrics.jsonl)."""
    out, gate = tmp_path / "run", tmp_path / "gate"
    code = textwrap.dedent(GATED).format(gate=str(gate), argv=_argv(char_data(3000), out))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, env=env)  # fmt: skip
    first = child.stdout.readline()
    child.stdout.close()  # what `head -1` does after its line
    gate.write_text("")
    start = time.monotonic()
    rc = child.wait(timeout=300)
    assert first, "no first line"
    assert rc == 0, f"exit {rc} after {time.monotonic() - start:.0f} s"
    _finished(out)
    assert (out / "sample.txt").is_file() and (out / "loss.png").is_file()


def test_summary_records_why_should_stop_ended_the_run(char_data, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(Trainer, "should_stop", lambda self: "goal met" if self.step == 2 else None)
    out = tmp_path / "run"
    assert main(_argv(char_data(3000), out)) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["step"] == 2 and summary["stopped_early"] == "goal met"
    assert summary["checkpoint"] == str((out / "checkpoints" / "step_000002").resolve())


def test_the_end_sample_reads_a_hugging_face_tokenizer(tmp_path, capsys):
    """Data prepared with a model's own tokenizer (a plain HF byte-level BPE, no <bos>/<eos>/<pad>
    of ours): the run's closing sample decodes with it (the sample's reader took our files only
    and refused it before training, so fine-tuning an imported model needed --train.sample_tokens
    0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    text = "the king and the queen sing of a horse at night\n" * 200
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    bpe = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator([text], bpe)
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "docs").mkdir()
    for i in range(10):
        (tmp_path / "docs" / f"{i}.txt").write_text(text[: 500 * (i + 1)])
    data, out = tmp_path / "data", tmp_path / "run"
    argv = ["prepare", "--input", str(tmp_path / "docs"), "--tokenizer-from",
            str(tmp_path / "tokenizer.json"), "--out", str(data)]  # fmt: skip
    assert main(argv) == 0
    capsys.readouterr()
    argv = _argv(data, out)
    argv[argv.index("--model.dim") : argv.index("--model.dim")] = ["--model.vocab_size", "300"]
    assert main(argv) == 0, capsys.readouterr().err
    _finished(out)
    # the sample is the run's draw decoded by the tokenizers library itself
    import torch

    from llm_foundry.checkpoint import load_checkpoint
    from llm_foundry.generate import generate

    model = load_checkpoint(out / "checkpoints" / f"step_{STEPS:06d}")
    prompt = torch.tensor([tok.encode("\n").ids])
    ids = generate(model, prompt, 20, temperature=0.8, top_k=50, seed=1337, context=16)
    assert (out / "sample.txt").read_text() == tok.decode(ids[0].tolist())
