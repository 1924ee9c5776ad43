"""`inspect lr` numbers its steps as training does: the value it plots and reports at step k is the
lr metrics.jsonl records for step k of a real run (the k-th update, 1..max_steps)."""

from __future__ import annotations

import json

import pytest
from conftest import make_trainer

from llm_foundry import plots
from llm_foundry.cli import main
from llm_foundry.rundir import METRICS


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_inspect_lr_equals_the_lr_a_run_logs_at_every_step(
    schedule, char_data, tmp_path, monkeypatch, capsys
):
    knobs = dict(schedule=schedule, max_steps=12, warmup_steps=3, lr=1e-3, min_lr=1e-4)
    run = tmp_path / "run"
    make_trainer(char_data(20_000), run, **knobs, decay_frac=0.25).run()
    records = [json.loads(line) for line in (run / METRICS).read_text().splitlines()]
    logged = {r["step"]: r["lr"] for r in records if "loss" in r and "lr" in r}
    assert sorted(logged) == list(range(1, 13))

    capsys.readouterr()  # what training printed
    figures = []
    save = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or save(fig, path))
    flags = [f"--train.{k}={v}" for k, v in {**knobs, "decay_frac": 0.25}.items()]
    assert main(["inspect", "lr", *flags, "--json", "--out", str(tmp_path / "lr.png")]) == 0
    reported = json.loads(capsys.readouterr().out)["lr"][schedule]
    assert {int(k): v for k, v in reported.items()} == pytest.approx(logged, rel=1e-12)

    (line,) = figures[0].axes[0].get_lines()[:1]  # the schedule's curve, then the warmup line
    assert dict(zip(line.get_xdata(), line.get_ydata(), strict=True)) == pytest.approx(logged)
    warmup_end = figures[0].axes[0].get_lines()[1].get_xdata()[0]
    assert warmup_end == 3 and logged[3] == pytest.approx(1e-3)  # the first step at the peak
