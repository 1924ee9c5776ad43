"""A variant whose training diverges (non-finite loss or gradient norm) is a result of the study:
recorded with its step and the trainer's message, the other variants still trained and compared,
the report written (exit 1 says not every variant trained), and a rerun does not train it again."""

from __future__ import annotations

import json
import math

import pytest

from llm_foundry.ablation import Variant, markdown, summarise
from llm_foundry.ablation.report import diverged_text
from llm_foundry.cli import main as cli
from llm_foundry.rundir import METRICS

MODEL = dict(dim=32, n_layers=2, n_heads=2, n_kv_heads=2, hidden_dim=64, max_seq_len=16)
TRAIN = dict(max_steps=6, batch_size=4, block_size=16, warmup_steps=0, grad_clip=0.0, min_lr=0.0,
             eval_interval=1, eval_batches=1, checkpoint_interval=3, sample_tokens=0,
             progress=False)  # fmt: skip


def ablate(data, out, *extra) -> list[str]:
    sets = [f"--set=train.{k}={v}" for k, v in TRAIN.items()]
    sets += [f"--set={k}={v}" for k, v in MODEL.items()]
    argv = ["ablate", "--vary", "train.lr=1e-3,1e6", "--data", str(data), "--out", str(out)]
    return argv + sets + list(extra)


def test_a_diverging_variant_is_reported_and_the_study_goes_on(char_data, tmp_path, capsys,
                                                               monkeypatch):  # fmt: skip
    data, out = char_data(20_000), tmp_path / "study"
    # lr 1e6 without warmup or clipping: the first update blows the weights up
    assert cli(ablate(data, out)) == 1
    captured = capsys.readouterr()
    result = json.loads((out / "runs" / "lr=1000000.0" / "seed0" / "result.json").read_text())
    step = result["diverged"]["step"]
    assert 1 <= step <= TRAIN["max_steps"]
    # the step the trainer refused: the last it logged is the one before
    records = (out / "runs" / "lr=1000000.0" / "seed0" / METRICS).read_text().splitlines()
    logged = [json.loads(x)["step"] for x in records if '"loss"' in x]
    assert max(logged, default=0) == step - 1
    assert result["diverged"]["message"].startswith("non-finite ")
    assert f"at step {step}" in result["diverged"]["message"]
    # the table: the finished variant measured and the reference, the other diverged at N
    md = (out / "results.md").read_text()
    first = json.loads((out / "results.json").read_text())
    rows = first["rows"]
    assert [r["variant"] for r in rows] == ["lr=0.001", "lr=1000000.0"]
    assert rows[0]["verdict"] == "reference" and math.isfinite(rows[0]["val_loss"])
    assert rows[1]["verdict"] == f"diverged at step {step}" and rows[1]["val_loss"] is None
    assert f"| lr=1000000.0 | {rows[1]['params']:,} | n/a | diverged at step {step} | n/a |" in md
    assert f"- lr=1000000.0, seed 1337: {result['diverged']['message']}" in md
    assert (out / "val_loss.png").stat().st_size > 0
    # said on stderr after the table, one line: how many and where the report is
    last = captured.err.strip().splitlines()[-1]
    assert last == (f"llm-foundry ablate: 1 of 2 variants diverged (lr=1000000.0 diverged at "
                    f"step {step}): see {out / 'results.md'}")  # fmt: skip
    assert "| lr=0.001 |" in captured.out

    # a rerun trains nothing: the divergence is a result, reused as a finished run is
    def boom(*a, **k):
        raise AssertionError("a variant was trained again")

    monkeypatch.setattr("llm_foundry.train.trainer.Trainer.run", boom)
    (out / "results.md").unlink()
    assert cli(ablate(data, out)) == 1
    again = json.loads((out / "results.json").read_text())
    assert again["runs"] == first["runs"]  # every run's result as it was
    assert again["rows"][1]["verdict"] == rows[1]["verdict"]  # (step times are measured anew)
    assert again["rows"][0]["val_loss"] == rows[0]["val_loss"]
    # other settings: refused as any result made from other inputs is
    assert cli(ablate(data, out, "--set=train.grad_clip=1.0")) == 2
    assert "train.grad_clip" in capsys.readouterr().err


def run(variant: str, seed: int, val: float | None = None, diverged: int | None = None) -> dict:
    """A run's result as run_one writes it (a diverged one has no losses or timings)."""
    base = dict(variant=variant, seed=seed, params=1000, active_params=1000, kv_bytes_per_token=64)
    if diverged is not None:
        return dict(base, diverged=dict(step=diverged, message="non-finite loss (nan) at step "
                                        f"{diverged}"), val_curve=[[1, 3.0]])  # fmt: skip
    return dict(base, val_loss=val, train_loss=val, val_curve=[[1, 3.0], [2, val]],
                train_ms_per_iter=10.0, peak_mem_bytes=2**20, decode_tokens_per_s=100.0)  # fmt: skip


@pytest.mark.parametrize("compare", ["first", "previous"])
def test_a_row_compared_with_a_diverged_one_has_no_verdict(compare):
    variants = [Variant("a"), Variant("b"), Variant("c")]
    runs = {"a": [run("a", 0, diverged=3)], "b": [run("b", 0, 2.0)], "c": [run("c", 0, 2.1)]}
    rows = summarise(variants, runs, {"a": 5.0, "b": 5.0, "c": 5.0}, 64, compare)
    assert rows[0]["verdict"] == "diverged at step 3" and rows[0]["ms_per_iter"] == 5.0
    assert rows[1]["verdict"] == "no comparison: a diverged" and rows[1]["delta_val"] is None
    if compare == "previous":  # c against b, both trained
        assert rows[2]["delta_val"] == pytest.approx(0.1)
    else:
        assert rows[2]["verdict"] == "no comparison: a diverged"
    report = dict(study=dict(name="s", description="", claim="", seeds=1, compare=compare,
                             speed_rounds=1, model={}, train={}, vary={}),
                  rows=rows, runs=runs, machine=dict(cpu="c", threads=1, cuda=None, torch="t",
                                                     date="d"))  # fmt: skip
    md = markdown(report)
    assert "| a | 1,000 | n/a | diverged at step 3 | n/a | diverged | 5.0 |" in md
    assert "| b | 1,000 | 2.0000 | 2.0000 | n/a | no comparison: a diverged |" in md


def test_the_status_names_each_diverged_seed_of_several():
    rs = [run("a", 1337, 2.0), run("a", 1338, diverged=4), run("a", 1339, diverged=9)]
    assert diverged_text(rs) == "diverged at steps 4, 9 (seeds 1338, 1339; 2 of 3 seeds)"
    assert diverged_text([run("a", 1337, diverged=2)]) == "diverged at step 2"
