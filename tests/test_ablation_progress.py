"""ablate after each variant trains (measuring it, its loss at longer contexts) and after all
have (timing their steps, interleaved): progress on stderr and one line per context and round,
and a Ctrl-C or SIGTERM there ends with one line naming what is kept; the same command resumes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import llm_foundry.evaluate
from llm_foundry.cli import main as cli

MODEL = "{dim: 32, n_layers: 2, n_heads: 2, n_kv_heads: 2, hidden_dim: 64, max_seq_len: 16}"
TRAIN = ("{max_steps: 12, batch_size: 4, block_size: 16, warmup_steps: 2, eval_interval: 6, "
         "eval_batches: 2, checkpoint_interval: 6, sample_tokens: 0, progress: %s}")  # fmt: skip
STATUS = {"SIGINT": 130, "SIGTERM": 143}


@pytest.fixture(scope="module")
def data_dir(char_data) -> Path:
    return char_data(40_000)


def recipe(tmp_path: Path, progress: bool, speed_rounds: int, extrapolation: bool = True) -> Path:
    """A study of two tiny position encodings, each scored at 1x and 2x its context."""
    path = tmp_path / "tiny.yaml"
    path.write_text(
        "name: tiny\npreset: llama-shakespeare-char\n"
        f"model: {MODEL}\ntrain: {TRAIN % str(progress).lower()}\n"
        "vary:\n  pos_encoding: [rope, alibi]\n"
        + ("extrapolation: [1, 2]\neval_tokens: 512\n" if extrapolation else "")
        + f"speed_rounds: {speed_rounds}\n"
    )
    return path


def test_measuring_and_timing_show_a_bar_and_a_line_each(data_dir, tmp_path, capsys):
    argv = ["ablate", "--recipe", str(recipe(tmp_path, True, 2)), "--data", str(data_dir)]
    assert cli([*argv, "--out", str(tmp_path / "out")]) == 0
    cap = capsys.readouterr()
    for variant in ("rope", "alibi"):
        tag = f"[pos_encoding={variant} seed 0]"
        for ctx, windows in ((16, 32), (32, 16)):  # 512 validation tokens in windows of ctx
            assert f"{tag} eval context {ctx}: " in cap.err  # the bar, as eval draws it
            assert f"/{windows} [" in cap.err.split(f"{tag} eval context {ctx}: ")[1]
            line = next(x for x in cap.out.splitlines() if x.startswith(f"{tag} context {ctx}:"))
            assert line.endswith(f"({windows} windows)")
    assert "/4 [" in cap.err.split("timing steps: ")[1]  # 2 rounds x 2 variants
    rounds = [x for x in cap.out.splitlines() if x.startswith("timing round ")]
    assert [x.split(":")[0] for x in rounds] == ["timing round 1/2", "timing round 2/2"]
    table = json.loads((tmp_path / "out" / "results.json").read_text())
    for row in table["rows"]:
        assert f"{row['variant']} " in rounds[-1]  # each round names every variant's ms/step


def _checkpoint(run: Path) -> Path:
    latest = json.loads((run / "checkpoints" / "latest.json").read_text())
    return run / "checkpoints" / latest["path"]


@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM"])
def test_a_signal_while_measuring_says_what_is_kept_and_a_rerun_resumes(
    data_dir, tmp_path, capsys, monkeypatch, name
):
    """The signal comes while alibi, the second variant, is scored at 2x its context (after
    1x): one line with the exit status of the signal; the rerun reuses rope's result, measures
    alibi from its checkpoint without training it again, and scores 1x as before."""
    out = tmp_path / "out"
    argv = ["ablate", "--recipe", str(recipe(tmp_path, False, 1)), "--data", str(data_dir),
            "--out", str(out)]  # fmt: skip
    scored = llm_foundry.evaluate.evaluate_tokens

    def signalled_at_2x(model, tokens, context, *args, **kwargs):
        if model.cfg.pos_encoding == "alibi" and context == 32:
            os.kill(os.getpid(), getattr(signal, name))
        return scored(model, tokens, context, *args, **kwargs)

    monkeypatch.setattr(llm_foundry.evaluate, "evaluate_tokens", signalled_at_2x)
    try:
        code = cli(argv)
    except KeyboardInterrupt as e:  # would end the whole test session
        pytest.fail(f"the interrupt escaped the command as a traceback: {e}")
    monkeypatch.undo()
    cap = capsys.readouterr()
    alibi = out / "runs" / "pos_encoding=alibi" / "seed0"
    assert code == STATUS[name]
    assert cap.err.splitlines() == [  # train.progress=false: no bar, only the last line
        f"llm-foundry ablate: stopped by {name}: stopped while measuring pos_encoding=alibi seed "
        f"0 after its training; kept: its checkpoint {_checkpoint(alibi)} and every run finished "
        "before it (the rerun measures this one again without training it); rerun the same "
        "command to resume"
    ]
    at_1x = [x for x in cap.out.splitlines() if x.startswith("[pos_encoding=alibi seed 0] context")]
    assert len(at_1x) == 1 and at_1x[0].startswith("[pos_encoding=alibi seed 0] context 16: loss")
    assert (out / "runs" / "pos_encoding=rope" / "seed0" / "result.json").exists()
    assert not (alibi / "result.json").exists() and not list(alibi.glob(".*.tmp"))
    assert not (out / "results.json").exists()

    assert cli(argv) == 0
    again = capsys.readouterr().out
    assert "[pos_encoding=rope seed 0] finished earlier: reusing" in again
    assert at_1x[0] in again.splitlines()  # the same weights scored again
    steps = [r for r in map(json.loads, (alibi / "metrics.jsonl").open()) if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 13))  # trained once
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [e["context"] for e in rows[1]["extrapolation"]] == [16, 32]


def _ablate(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "llm_foundry", "ablate", *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


@pytest.mark.heavy
def test_sigterm_while_timing_steps_ends_in_seconds_and_the_same_command_finishes(
    data_dir, tmp_path
):
    """A real SIGTERM to ``llm-foundry ablate`` once it has said its first timing round (of
    30): it ends within seconds with status 143 and one line naming the results kept; running
    the same command again reuses both runs and finishes the timing."""
    out = tmp_path / "out"
    argv = ["--recipe", str(recipe(tmp_path, False, 30, extrapolation=False)),
            "--data", str(data_dir), "--out", str(out)]  # fmt: skip
    proc = _ablate(argv)
    try:
        said = []
        for line in proc.stdout:  # flushed line by line: the marker comes when it is said
            said.append(line)
            if line.startswith("timing round 1/30:"):
                break
        assert said and said[-1].startswith("timing round 1/30:"), "".join(said)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert took < 10, f"{took:.1f} s from SIGTERM to the end"
    assert err.splitlines() == [
        "llm-foundry ablate: stopped by SIGTERM: stopped while timing every variant's training "
        f"step; kept: the results of all 2 runs under {out / 'runs'} (the rerun reuses them); "
        "rerun the same command to resume"
    ]
    assert not (out / "results.json").exists()

    proc = _ablate(argv)
    again, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "lock" not in err  # the stopped command let its lock go
    for variant in ("rope", "alibi"):
        assert f"[pos_encoding={variant} seed 0] finished earlier: reusing" in again
    assert "timing round 30/30:" in again
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert all(r["ms_per_iter_source"] == "interleaved" and r["ms_per_iter"] > 0 for r in rows)
