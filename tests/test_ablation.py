"""The ablation runner: grids, equal budgets, resumability, seeds, the table and the plots."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import pytest

from llm_foundry import ablation
from llm_foundry.ablation import Study, Variant, expand, load_study, parse_assignment, recipe_names
from llm_foundry.cli import main as cli
from llm_foundry.data import PreparedSplit, load_meta, split_stream
from llm_foundry.train.trainer import Trainer

TINY_MODEL = dict(dim=32, n_layers=2, n_heads=2, n_kv_heads=2, hidden_dim=64, max_seq_len=16)
TINY_TRAIN = dict(
    max_steps=12,
    batch_size=4,
    block_size=16,
    warmup_steps=2,
    eval_interval=6,
    eval_batches=2,
    checkpoint_interval=6,
    sample_tokens=0,
    progress=False,
)


@pytest.fixture(scope="module")
def data_dir(char_data) -> Path:
    """A small character-level corpus (Shakespeare when the shared copy is there)."""
    return char_data(40_000)


def tiny_study(**kw) -> Study:
    d = dict(
        name="tiny",
        preset="llama-shakespeare-char",
        model=dict(TINY_MODEL),
        train=dict(TINY_TRAIN),
        speed_rounds=1,
    )
    d.update(kw)
    return Study.from_dict(d)


def test_grid_expands_every_combination_and_routes_train_fields():
    study = tiny_study(vary={"norm": ["layernorm", "rmsnorm"], "train.lr": [1e-3, 3e-3]})
    variants = expand(study)
    assert [v.name for v in variants] == [
        "norm=layernorm,lr=0.001",
        "norm=layernorm,lr=0.003",
        "norm=rmsnorm,lr=0.001",
        "norm=rmsnorm,lr=0.003",
    ]
    assert variants[1].model == {"norm": "layernorm"} and variants[1].train == {"lr": 0.003}
    mc, tc = ablation.configs(study, variants[3], seed_index=2)
    assert mc.norm == "rmsnorm" and tc.lr == 0.003 and tc.seed == TINY_TRAIN.get("seed", 1337) + 2


def test_assignments_are_typed_and_bad_fields_are_named():
    assert parse_assignment("n_kv_heads=4,2,1") == ("model", "n_kv_heads", [4, 2, 1])
    assert parse_assignment("train.lr=1e-3") == ("train", "lr", [1e-3])
    with pytest.raises(ValueError, match="no field 'nrom'"):
        parse_assignment("nrom=layernorm")
    with pytest.raises(ValueError, match="FIELD=VALUE"):
        parse_assignment("norm")
    with pytest.raises(ValueError, match="unknown probe"):
        tiny_study(probes=["nope"])
    with pytest.raises(ValueError, match="'first', 'previous'"):
        tiny_study(compare="last")


def test_compare_previous_judges_each_row_against_the_one_before():
    run = lambda name, v: dict(
        val_loss=v,
        train_loss=v,
        params=1,
        train_ms_per_iter=1.0,
        peak_mem_bytes=1,
        decode_tokens_per_s=1.0,
        kv_bytes_per_token=1,
    )
    vs = [Variant("a"), Variant("b"), Variant("c")]
    runs = {
        "a": [run("a", 2.0), run("a", 2.01)],
        "b": [run("b", 1.5), run("b", 1.51)],
        "c": [run("c", 1.5), run("c", 1.52)],
    }
    rows = ablation.summarise(vs, runs, {}, 768, compare="previous")
    assert [round(r["delta_val"], 3) for r in rows] == [0.0, -0.5, 0.005]
    assert rows[1]["verdict"].startswith("better") and rows[2]["verdict"].startswith("within")
    first = ablation.summarise(vs, runs, {}, 768, compare="first")
    assert round(first[2]["delta_val"], 3) == -0.495


def test_first_crossing_is_the_first_evaluation_at_or_below_the_target():
    curve = [(25, 2.5, 1.0), (50, 1.9, 2.0), (75, 1.886, 3.0), (100, 1.7, 4.0), (125, 1.95, 5.0)]
    assert ablation.first_crossing(curve, 1.886) == (75, 1.886, 3.0)  # equal counts as reached
    assert ablation.first_crossing(curve, 2.0)[0] == 50
    assert ablation.first_crossing(curve, 1.5) is None
    assert ablation.first_crossing([], 1.886) is None
    assert ablation.first_crossing([(10, None), (20, 1.0)], 1.5) == (20, 1.0)
    # each step's own time is tokens_per_step / tokens_per_s; the sum skips nothing else
    records = [dict(step=i, tokens_per_s=768 / dt) for i, dt in [(1, 0.5), (2, 0.1), (3, 0.2)]]
    secs = ablation.training_seconds(records, 768)
    assert list(secs) == [1, 2, 3]
    assert [round(v, 9) for v in secs.values()] == [0.5, 0.6, 0.8]


def test_target_loss_reports_steps_tokens_and_training_seconds_per_seed():
    def run(curve, times):
        return dict(val_loss=curve[-1][1], train_loss=1.0, params=1, train_ms_per_iter=50.0,
                    peak_mem_bytes=1, decode_tokens_per_s=1.0, kv_bytes_per_token=1,
                    val_curve=curve, val_curve_train_s=times)  # fmt: skip

    vs = [Variant("adamw"), Variant("muon")]
    runs = {
        "adamw": [run([(25, 2.2), (50, 1.9), (75, 1.8)], [1.0, 2.0, 3.0]),
                  run([(25, 2.1), (50, 1.95), (75, 1.89)], [1.1, 2.1, 3.1])],
        "muon": [run([(25, 1.95), (50, 1.85), (75, 1.7)], [1.2, 2.4, 3.6]),
                 run([(25, 1.88), (50, 1.8), (75, 1.7)], [1.3, 2.5, 3.7])],
    }  # fmt: skip
    rows = ablation.summarise(vs, runs, {"adamw": 40.0, "muon": 48.0}, 768, target_loss=1.886)
    a, m = (r["to_target"] for r in rows)
    assert a["steps"] == [75, None] and a["reached"] == 1 and a["mean_steps"] is None
    assert a["tokens"] == [75 * 768, None] and a["train_s"] == [3.0, None]
    assert a["projected_s"] is None  # not every seed got there
    assert m["steps"] == [50, 25] and m["train_s"] == [2.4, 1.3] and m["reached"] == 2
    assert m["mean_steps"] == 37.5 and m["projected_s"] == pytest.approx(37.5 * 48.0 / 1e3)
    # a run saved before training seconds were recorded still gives its step
    del runs["muon"][0]["val_curve_train_s"]
    again = ablation.summarise(vs, runs, {}, 768, target_loss=1.886)[1]["to_target"]
    assert again["steps"] == [50, 25] and again["train_s"] == [None, 1.3]
    assert "to_target" not in ablation.summarise(vs, runs, {}, 768)[0]
    for bad in (0, -1.0, "1.9", True):
        with pytest.raises(ValueError, match="target_loss"):
            tiny_study(target_loss=bad)


def test_every_builtin_recipe_loads_and_its_variants_are_valid():
    assert len(recipe_names()) >= 6
    for name in recipe_names():
        study = load_study(name)
        variants = expand(study)
        assert len(variants) >= 2, name
        for v in variants:
            ablation.configs(study, v, 0)  # validates both configs
        assert study.claim, f"recipe {name} states no claim"


def test_a_study_file_reads_exponent_floats_as_numbers(tmp_path):
    """PyYAML (YAML 1.1) would hand ``lr: 1e-3`` over as the string '1e-3'."""
    f = tmp_path / "study.yaml"
    f.write_text(
        "preset: gpt2-shakespeare-char\nvary: {pos_encoding: [learned, rope]}\n"
        "model: {norm_eps: 1e-6}\ntrain: {lr: 3e-4, min_lr: 3E-5, max_steps: 5}\n"
    )
    study = load_study(f)
    assert study.train == {"lr": 3e-4, "min_lr": 3e-5, "max_steps": 5}
    model, train = ablation.configs(study, expand(study)[1], 0)
    assert (model.norm_eps, model.pos_encoding, train.lr) == (1e-6, "rope", 3e-4)


@pytest.mark.heavy
def test_study_trains_every_variant_and_seed_then_resumes_without_retraining(
    data_dir, tmp_path, monkeypatch
):
    study = tiny_study(
        variants=[Variant("mha", {"n_kv_heads": 2}), Variant("mqa", {"n_kv_heads": 1})], seeds=2
    )
    report = ablation.run_study(study, data_dir, tmp_path)
    rows = {r["variant"]: r for r in report["rows"]}
    assert set(rows) == {"mha", "mqa"}
    for r in rows.values():
        assert r["seeds"] == 2 and r["val_loss_std"] is not None
        assert 0 < r["val_loss"] < 10 and r["ms_per_iter"] > 0 and r["tokens_per_s"] > 0
        assert r["peak_mem_mib"] > 0 and r["decode_tokens_per_s"] > 0
    assert rows["mha"]["kv_bytes_per_token"] == 2 * rows["mqa"]["kv_bytes_per_token"]
    assert rows["mha"]["params"] > rows["mqa"]["params"]
    assert rows["mha"]["verdict"] == "reference"
    assert rows["mqa"]["verdict"].startswith(("within seed noise", "better", "worse"))
    # the two seeds saw different batches; each variant's seed i saw the same ones
    for name in ("mha", "mqa"):
        assert sorted(r["seed"] for r in report["runs"][name]) == [1337, 1338]
    md = (tmp_path / "results.md").read_text()
    assert "| mha |" in md and "| mqa |" in md and "±" in md
    assert json.loads((tmp_path / "results.json").read_text())["rows"][0]["variant"] == "mha"
    img = mpimg.imread(tmp_path / "val_loss.png")
    assert img.shape[0] == 550 and img.shape[1] == 900

    # rerun: nothing is trained again
    def boom(*a, **k):
        raise AssertionError("a finished variant was trained again")

    monkeypatch.setattr("llm_foundry.train.trainer.Trainer.run", boom)
    again = ablation.run_study(study, data_dir, tmp_path)
    assert again["rows"][0]["val_loss"] == report["rows"][0]["val_loss"]


@pytest.mark.heavy
def test_a_study_with_a_target_tables_when_each_run_reached_it(data_dir, tmp_path):
    study = tiny_study(
        variants=[Variant("base"), Variant("mqa", {"n_kv_heads": 1})], target_loss=100.0
    )  # reached at the first evaluation
    report = ablation.run_study(study, data_dir, tmp_path)
    run, row = report["runs"]["base"][0], report["rows"][0]
    first_eval = TINY_TRAIN["eval_interval"]
    assert [s for s, _ in run["val_curve"]] == [first_eval, 2 * first_eval]
    times = run["val_curve_train_s"]
    assert 0 < times[0] < times[1] <= run["train_wall_s"]
    t = row["to_target"]
    assert t["steps"] == [first_eval] and t["train_s"] == [times[0]] and t["reached"] == 1
    assert t["tokens"] == [first_eval * TINY_TRAIN["batch_size"] * TINY_TRAIN["block_size"]]
    md = (tmp_path / "results.md").read_text()
    assert "## Steps and training time to val loss <= 100" in md
    assert f"| base | 1/1 | {first_eval} |" in md
    never = ablation.summarise(expand(study), report["runs"], {}, 64, target_loss=1e-3)
    assert never[0]["to_target"]["steps"] == [None]
    assert "not reached" in ablation.markdown(dict(report, rows=never))


def test_changed_settings_refuse_to_reuse_a_finished_run(data_dir, tmp_path):
    model = {**TINY_MODEL, "n_kv_heads": None}  # None: one per query head
    study = tiny_study(model=model, variants=[Variant("a"), Variant("b", {"norm": "layernorm"})])
    ablation.run_study(study, data_dir, tmp_path)
    results = sorted((tmp_path / "runs").glob("*/seed0/result.json"))
    written = [r.stat().st_mtime_ns for r in results]
    # n_kv_heads spelled out as n_heads is the same model: the results are reused, not rewritten
    study.model["n_kv_heads"] = ablation.configs(study, Variant("a"), 0)[0].n_heads
    ablation.run_study(study, data_dir, tmp_path)
    assert len(results) == 2 and [r.stat().st_mtime_ns for r in results] == written
    study.train["lr"] = 5e-3
    with pytest.raises(ValueError, match=r"train\.lr"):
        ablation.run_study(study, data_dir, tmp_path)


def test_an_interrupted_variant_resumes_and_matches_an_uninterrupted_study(
    data_dir, tmp_path, monkeypatch
):
    study = tiny_study(variants=[Variant("a"), Variant("b", {"mlp": "gelu"})])
    full = ablation.run_study(study, data_dir, tmp_path / "full")
    original = Trainer._train_step

    def sigterm_in_variant_b(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if self.mc.mlp == "gelu" and self.step == 6:  # the 7th step of variant b
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(Trainer, "_train_step", sigterm_in_variant_b)
    with pytest.raises(KeyboardInterrupt, match="rerun to resume"):
        ablation.run_study(study, data_dir, tmp_path / "cut")
    monkeypatch.undo()
    assert not (tmp_path / "cut" / "runs" / "b" / "seed0" / "result.json").exists()
    resumed = ablation.run_study(study, data_dir, tmp_path / "cut")

    def losses(root: Path) -> list[float]:
        lines = (root / "runs" / "b" / "seed0" / "metrics.jsonl").read_text().splitlines()
        return [json.loads(x)["loss"] for x in lines if '"loss"' in x]

    assert len(losses(tmp_path / "cut")) == TINY_TRAIN["max_steps"]
    assert losses(tmp_path / "cut") == losses(tmp_path / "full")
    assert resumed["rows"][1]["val_loss"] == full["rows"][1]["val_loss"]


def test_extrapolation_reports_cannot_run_for_learned_positions(data_dir, tmp_path):
    study = tiny_study(vary={"pos_encoding": ["learned", "alibi"]}, extrapolation=[1, 2])
    report = ablation.run_study(study, data_dir, tmp_path)
    learned, alibi = report["rows"]
    assert "loss" in learned["extrapolation"][0]
    assert learned["extrapolation"][1]["status"] == "cannot run"
    assert [e["context"] for e in alibi["extrapolation"]] == [16, 32]
    assert all(e["loss"] > 0 for e in alibi["extrapolation"])
    md = (tmp_path / "results.md").read_text()
    assert "cannot run" in md
    assert mpimg.imread(tmp_path / "extrapolation.png").shape[:2] == (500, 800)
    (tmp_path / "results.md").unlink()
    assert cli(["ablate", "--report", str(tmp_path)]) == 0  # rebuilt without training
    assert (tmp_path / "results.md").read_text() == md


def test_cli_runs_a_grid_and_prints_the_table(data_dir, tmp_path, capsys):
    sets = [f"--set=train.{k}={v}" for k, v in TINY_TRAIN.items()]
    sets += [x for k, v in TINY_MODEL.items() for x in (f"--model.{k}", str(v))]  # train's way
    code = cli(
        ["ablate", "--vary", "mlp=gelu,swiglu", "--data", str(data_dir), "--out", str(tmp_path)]
        + sets
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "| mlp=gelu |" in out and "| mlp=swiglu |" in out
    study = json.loads((tmp_path / "results.json").read_text())["study"]
    assert {k: study["model"][k] for k in TINY_MODEL} == TINY_MODEL  # --model.F V took
    assert cli(["ablate", "--data", str(data_dir), "--out", str(tmp_path / "x")]) == 2
    assert "nothing to compare" in capsys.readouterr().err


def test_trains_spelling_of_an_override_is_read_as_set():
    from llm_foundry.cli.ablate import as_set_flags

    argv = ["--vary", "mlp=gelu,swiglu", "--model.dim", "64", "--train.lr=3e-3",
            "--train.max_steps", "10", "--model.norm=layernorm", "--data", "d"]  # fmt: skip
    assert as_set_flags(argv) == ["--vary", "mlp=gelu,swiglu", "--set", "dim=64", "--set",
                                  "train.lr=3e-3", "--set", "train.max_steps=10", "--set",
                                  "norm=layernorm", "--data", "d"]  # fmt: skip
    with pytest.raises(ValueError, match=r"--model.dim needs a value \(--model.dim V, or"):
        as_set_flags(["--model.dim"])


def test_overrides_split_at_commas_but_a_comma_list_field_keeps_its_list():
    import dataclasses

    from llm_foundry.ablation.spec import LIST_FIELDS, parse_override
    from llm_foundry.settings import SECTIONS

    assert parse_override("train.lr=1e-3,2e-3") == ("train", "lr", [1e-3, 2e-3])
    assert parse_override("n_kv_heads=4,2,1", axis=True) == ("model", "n_kv_heads", [4, 2, 1])
    assert parse_override("train.lora_targets=wq,wv") == ("train", "lora_targets", ["wq,wv"])
    assert parse_override("train.lora_targets=wq,wv/w1", axis=True)[2] == ["wq,wv", "w1"]
    with pytest.raises(ValueError, match=r"^train.lora_targets: '\{' is not a valid value"):
        parse_override("train.lora_targets={")
    # an empty value is refused, not read as null (a variant without the setting)
    for item, sep in [("train.lora_targets=wq,wv/", "/"), ("train.lora_targets=/wq", "/"),
                      ("train.lora_targets=wq//wv", "/"), ("train.lr=1e-3,", ",")]:  # fmt: skip
        value = re.escape(repr(item.partition("=")[2]))
        want = rf"^{re.escape(item.partition('=')[0])}: {value} holds an empty value .*'{sep}'"
        with pytest.raises(ValueError, match=want):
            parse_override(item, axis=True)
    with pytest.raises(ValueError, match=r"^train.lr: '1e-3, ' holds an empty value"):
        parse_override("train.lr=1e-3, ")  # --set
    assert parse_override("train.lr=null,1e-3", axis=True)[2] == [None, 1e-3]
    # the registry names every field whose default is a comma list (a new one is not missed)
    commas = {
        (section, f.name)
        for section, cls in SECTIONS.items()
        for f in dataclasses.fields(cls)
        if isinstance(f.default, str) and "," in f.default
    }
    assert commas == LIST_FIELDS


def test_a_comma_list_field_takes_its_whole_list_as_train_does(data_dir, tmp_path, monkeypatch):
    """train.lora_targets holds a comma list: train's --train.lora_targets wq,wv and --set take
    it whole (as `llm-foundry train` reads it); a --vary axis over it separates its values with
    '/'. Any other field's comma in a --set is still refused (one value per --set)."""
    import llm_foundry.cli.ablate as ablate_cli
    from llm_foundry.cli.options import flag_value

    class Ran(Exception):
        pass

    studies = []

    def capture(study, data, out):  # the study as it would train, not trained
        studies.append(study)
        raise Ran

    monkeypatch.setattr(ablate_cli, "run_study", capture)
    base = ["ablate", "--data", str(data_dir), "--out", str(tmp_path), "--train.lora_r", "2"]
    grid = ["--vary", "norm=layernorm,rmsnorm"]
    for argv in (
        [*grid, "--train.lora_targets", "wq,wk,wv,wo"],
        [*grid, "--train.lora_targets=wq,wk,wv,wo"],
        [*grid, "--set", "train.lora_targets=wq,wk,wv,wo"],
        ["--vary", "train.lora_targets=wq,wv/w1,w2,w3"],
    ):
        with pytest.raises(Ran):
            cli([*base, *argv])
    *whole, axis = studies
    for study in whole:
        assert study.train["lora_targets"] == flag_value("wq,wk,wv,wo")  # train's reading
        tcs = [ablation.configs(study, v, 0)[1] for v in expand(study)]
        assert [tc.lora_targets for tc in tcs] == ["wq,wk,wv,wo"] * 2
    variants = expand(axis)
    assert [ablation.configs(axis, v, 0)[1].lora_targets for v in variants] == ["wq,wv", "w1,w2,w3"]
    assert [v.name for v in variants] == ["lora_targets=wq,wv", "lora_targets=w1,w2,w3"]
    assert cli([*base, *grid, "--set", "train.lr=1e-3,2e-3"]) == 2  # a scalar field: refused
    assert len(studies) == 4


def test_cli_lists_recipes(capsys):
    assert cli(["ablate", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == recipe_names()
    for name, line in zip(recipe_names(), lines, strict=True):
        study = load_study(name)
        words = line.removesuffix(" [GPU]").removesuffix(" …").split()[1:]
        # the description's first words, never a line's end cut mid-phrase without a mark
        assert " ".join(study.description.split()).startswith(" ".join(words))
        assert line.endswith(" [GPU]") == (study.train.get("device") == "cuda")
        assert len(line) <= 21 + 90 + len(" [GPU]")


def test_a_recipe_that_is_a_directory_or_empty_is_named_as_such(tmp_path, capsys):
    assert cli(["ablate", "--recipe", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"--recipe {tmp_path}: a directory, not a study file, nor a built-in recipe" in err
    (tmp_path / "empty.yaml").write_text("")
    assert cli(["ablate", "--recipe", str(tmp_path / "empty.yaml")]) == 2
    assert f"--recipe {tmp_path / 'empty.yaml'} defines nothing to compare" in (
        capsys.readouterr().err
    )
    assert cli(["params", "--config", str(tmp_path)]) == 2
    assert f"--config {tmp_path} is a directory" in capsys.readouterr().err


def test_init_grad_norm_probe_measures_with_and_without_residuals(data_dir):
    study = tiny_study(model={**TINY_MODEL, "n_layers": 4}, variants=[Variant("pre")])
    study.model["vocab_size"] = load_meta(data_dir)["vocab_size"]
    norms = ablation.probe_init_grad_norms(study, expand(study), data_dir)
    assert set(norms) == {"pre, residual=True", "pre, residual=False"}
    assert all(len(v) == 4 and all(g > 0 for g in v) for v in norms.values())
    assert norms["pre, residual=True"] != norms["pre, residual=False"]


@pytest.mark.heavy
def test_norm_speed_probe_times_both_norms_eager_and_compiled(monkeypatch, tmp_path):
    monkeypatch.setattr("llm_foundry.ablation.runner.NORM_SPEED_SHAPES", [(8, 16)])
    rows = ablation.probe_norm_speed(tiny_study(), [], tmp_path)["rows"]
    keys = {(r["norm"], r["compiled"], r["op"]) for r in rows}
    assert len(keys) == 8 and all(r["ms"] > 0 and r["shape"] == [8, 16] for r in rows)


def test_a_finished_run_on_other_data_is_not_reused(data_dir, tmp_path):
    from llm_foundry.data import prepare

    # the same characters backwards: same vocabulary and tokenizer file, other text
    (tmp_path / "rev.txt").write_text((data_dir.parent / "corpus.txt").read_text()[::-1])
    other = tmp_path / "rev"
    prepare(other, text_files=[tmp_path / "rev.txt"], progress=False)
    assert (other / "tokenizer.json").read_bytes() == (data_dir / "tokenizer.json").read_bytes()
    study = tiny_study(variants=[Variant("a")])
    ablation.run_study(study, data_dir, tmp_path / "out")
    with pytest.raises(ValueError, match=r"other inputs \(data\.text_sha256 differ\)"):
        ablation.run_study(study, other, tmp_path / "out")
    done = json.loads((tmp_path / "out" / "runs" / "a" / "seed0" / "result.json").read_text())
    assert done["fingerprint"]["code"]["llm_foundry"]  # the code version is part of it too


def test_a_listing_cut_short_by_its_reader_ends_quietly():
    """`llm-foundry ablate --list | head -1`: the closed pipe is not an error."""
    import subprocess
    import sys

    cmd = f"{sys.executable} -m llm_foundry ablate --list | head -1"
    r = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.startswith(recipe_names()[0])


# ----------------------------------------------------------------------------------------------
# misuse: names that would be paths, wrong types, checks that came only after training


def _recipe(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "study.yaml"
    path.write_text(text)
    return path


BASE_RECIPE = "name: ok\nvariants:\n  - name: a\n  - name: b\n    model: {norm: layernorm}\n"


@pytest.mark.parametrize(
    "text, key",
    [
        ("name: ../../escaped\nvary: {norm: [layernorm, rmsnorm]}\n", "name="),
        ("name: a/b\nvary: {norm: [layernorm, rmsnorm]}\n", "name="),
        ("name: ..\nvary: {norm: [layernorm, rmsnorm]}\n", "name="),
        ("name: ''\nvary: {norm: [layernorm, rmsnorm]}\n", "name="),
        ("variants:\n  - name: ..\n  - name: b\n", "variants[0].name="),
        ("variants:\n  - name: a\n  - name: ../../b\n", "variants[1].name="),
        ("variants:\n  - name: 'a\\\\b'\n", "variants[0].name="),
        ('variants:\n  - name: "a\\nb"\n', "variants[0].name="),
        ("variants:\n  - name: .\n", "variants[0].name="),
    ],
)
def test_a_name_that_would_be_a_path_is_refused_in_one_line(tmp_path, text, key):
    path = _recipe(tmp_path, text)
    with pytest.raises(ValueError) as e:
        load_study(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: {key}") and "\n" not in msg, msg
    assert "would be a path, not a name" in msg or "must be a name" in msg


def test_names_that_differ_only_in_characters_a_directory_cannot_hold_are_refused():
    with pytest.raises(ValueError, match=r"variants 'a b' and 'a_b' would train in one directory"):
        tiny_study(variants=[Variant("a b"), Variant("a_b")])
    assert ablation.spec.run_dir_name("norm=a/b..") == "norm=a_b.."  # a grid value's slash


def test_a_path_name_given_in_code_is_refused_before_anything_is_written(data_dir, tmp_path):
    study = tiny_study(variants=[Variant("a")])
    study.variants.append(Variant(".."))  # changed after it was built: run_study checks again
    with pytest.raises(ValueError, match=r"variants\[1\]\.name='\.\.' would be a path"):
        ablation.run_study(study, data_dir, tmp_path / "out" / "deeper")
    assert not (tmp_path / "out").exists()


def test_ablate_refuses_a_recipe_named_as_a_path_and_writes_nothing(
    data_dir, tmp_path, capsys, monkeypatch
):
    path = _recipe(tmp_path, "name: ../../escaped\nvary: {norm: [layernorm, rmsnorm]}\n")
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)  # the default --out is runs/ablate-NAME, relative to here
    assert cli(["ablate", "--recipe", str(path), "--data", str(data_dir)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{path}: name='../../escaped' would be a path" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cwd", "study.yaml"]
    assert list(work.iterdir()) == []


@pytest.mark.parametrize(
    "text, key",
    [
        ("seeds: two\n", "seeds='two' must be a positive integer"),
        ("seeds: true\n", "seeds=True must be a positive integer"),
        ("variants: 5\n", "variants=5 must be a list"),
        ("variants: [5]\n", "variants[0]=5 must be a mapping"),
        ("variants: [{model: {dim: 64}}]\n", "variants[0] has no name"),
        ("variants: [{name: a, modle: {}}]\n", "variants[0]: unknown key(s) ['modle']"),
        ("variants: [{name: a, train: [1]}]\n", "variants[0].train=[1] must be a mapping"),
        ("variants: [{name: a, preset: gpt5}]\n", "variants[0].preset='gpt5' is not a preset"),
        ("train: {max_steps: '100'}\n", "train.max_steps='100' must be a positive integer"),
        ("train: {max_steps: 1e23}\n", "train.max_steps=1e+23 must be a positive integer"),
        ("train: {seed: 4611686018427387904}\nseeds: 2\n", "reaches seed 4611686018427387905"),
        ("model: [1]\n", "model=[1] must be a mapping"),
        ("model: {dimm: 3}\n", "model: 'model.dimm': model has no field 'dimm'"),
        ("target_loss: low\n", "target_loss='low' must be a positive number"),
        ("target_loss: .nan\n", "target_loss=nan must be a positive number"),
        ("speed_rounds: five\n", "speed_rounds='five' must be an integer >= 0"),
        ("extrapolation: [two]\n", "extrapolation=['two'] must be a list of positive numbers"),
        ("extrapolation: 2\n", "extrapolation=2 must be a list of positive numbers"),
        ("extrapolation: [0.001]\n", "extrapolation factor(s) [0.001] x block_size 64"),
        ("eval_tokens: 1.5\n", "eval_tokens=1.5 must be a positive integer"),
        ("description: 5\n", "description=5 must be text"),
        ("claim: [a]\n", "claim=['a'] must be text"),
        ("probes: init_grad_norms\n", "probes='init_grad_norms' must be a list"),
        ("compare: 1\n", "compare=1: valid values are 'first', 'previous'"),
        ("preset: gpt5\n", "preset='gpt5' is not a preset"),
        ("vary: {norm: layernorm}\n", "vary.norm='layernorm' must be a non-empty list"),
        ("vary: {nrom: [a, b]}\n", "vary: 'nrom': model has no field 'nrom'"),
        ("vary: [norm]\n", "vary=['norm'] must be a mapping"),
        ("vary: {dim: [[1, 2]]}\n", "vary.dim=[[1, 2]] must list plain values"),
        (
            "vary: {dim: [64, 1e23]}\n",
            "variant 'dim=1e+23': model.dim=1e+23 must be a positive integer",
        ),
        ("sedes: 2\n", "unknown study field(s) ['sedes']"),
    ],
)
def test_a_recipe_field_of_the_wrong_type_is_one_line_naming_the_file_and_key(tmp_path, text, key):
    """Every field, report and target fields included, is checked when the recipe is read:
    before any variant trains, not after all of them did."""
    base = "" if text.startswith(("variants:", "vary:")) else BASE_RECIPE
    path = _recipe(tmp_path, base + text)
    with pytest.raises(ValueError) as e:
        load_study(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: ") and "\n" not in msg, msg
    assert key in msg, msg


def test_a_recipe_that_is_not_a_mapping_is_named(tmp_path):
    path = _recipe(tmp_path, "- name: a\n- name: b\n")
    with pytest.raises(
        ValueError, match=r"study\.yaml: a study must be a mapping of fields, got \["
    ):
        load_study(path)


@pytest.mark.parametrize(
    "field", ["speed_rounds: five", "description: 5", "extrapolation: [two]", "target_loss: low"]
)
def test_ablate_checks_report_fields_before_training_anything(data_dir, tmp_path, capsys, field):
    model = "{" + ", ".join(f"{k}: {v}" for k, v in TINY_MODEL.items()) + "}"
    train = "{" + ", ".join(f"{k}: {json.dumps(v)}" for k, v in TINY_TRAIN.items()) + "}"
    path = _recipe(tmp_path, f"{BASE_RECIPE}model: {model}\ntrain: {train}\n{field}\n")
    out = tmp_path / "out"
    assert cli(["ablate", "--recipe", str(path), "--data", str(data_dir), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"llm-foundry ablate: error: {path}: {field.split(':')[0]}=")
    assert err.count("\n") == 1 and not out.exists()


def test_a_variant_too_large_for_the_machine_is_refused_before_any_variant_trains(
    data_dir, tmp_path, monkeypatch
):
    def never(*args, **kwargs):
        raise AssertionError("a variant trained before the study was checked")

    monkeypatch.setattr(Trainer, "run", never)
    huge = {"dim": 2**20, "hidden_dim": 2**20, "n_heads": 2, "n_kv_heads": 2}
    study = tiny_study(variants=[Variant("small"), Variant("huge", huge)])
    with pytest.raises(ValueError) as e:
        ablation.run_study(study, data_dir, tmp_path / "out")
    msg = str(e.value)
    assert msg.startswith("variant 'huge': training this model (") and "\n" not in msg
    assert "bytes" in msg and "this machine has" in msg
    assert not (tmp_path / "out" / "runs").exists()


def test_a_missing_tensorboard_is_refused_before_any_variant_trains(
    data_dir, tmp_path, monkeypatch
):
    import re
    import sys

    from llm_foundry.package import MissingExtra, install_line

    def never(*args, **kwargs):
        raise AssertionError("a variant trained before the study was checked")

    monkeypatch.setattr(Trainer, "run", never)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # the extra's absence
    study = tiny_study(variants=[Variant("a"), Variant("b", train={"tensorboard": True})])
    with pytest.raises(MissingExtra, match=re.escape(install_line("tensorboard"))):
        ablation.run_study(study, data_dir, tmp_path / "out")
    assert not (tmp_path / "out" / "runs").exists()


def test_an_extrapolation_longer_than_the_validation_split_is_refused_up_front(data_dir, tmp_path):
    val = len(split_stream(data_dir, "val"))
    factor = (val // TINY_TRAIN["block_size"]) + 1
    study = tiny_study(vary={"pos_encoding": ["rope", "alibi"]}, extrapolation=[1, factor])
    with pytest.raises(
        ValueError, match=rf"extrapolation factor {factor} x block_size 16 .*has {val:,}"
    ):
        ablation.run_study(study, data_dir, tmp_path / "out")
    assert not (tmp_path / "out" / "runs").exists()


@pytest.mark.heavy
def test_a_sharded_corpus_is_studied_with_its_whole_validation_split(tmp_path):
    """A directory of shards (as ``prepare --input`` writes): the variants train, the probe
    reads a batch, the extrapolation evaluates every validation shard in order, and the up-front
    check counts the tokens of all of them."""
    from conftest import corpus_text
    from sharded import sharded_text

    data = sharded_text(tmp_path / "data", corpus_text(40_000), train_shards=3, val_shards=2)
    shards = PreparedSplit(data, "val").tokens
    total = sum(len(t) for t in shards)
    assert len(shards) == 2 and len(split_stream(data, "val")) == total > len(shards[0])
    assert (split_stream(data, "val") == np.concatenate([np.asarray(t) for t in shards])).all()
    too_long = total // TINY_TRAIN["block_size"] + 1
    study = tiny_study(vary={"pos_encoding": ["rope", "alibi"]}, extrapolation=[1, too_long])
    with pytest.raises(ValueError, match=rf"has {total:,}"):
        ablation.run_study(study, data, tmp_path / "refused")
    study = tiny_study(vary={"pos_encoding": ["rope", "alibi"]}, extrapolation=[1, 2])
    report = ablation.run_study(study, data, tmp_path / "out")
    for row in report["rows"]:
        assert [e["context"] for e in row["extrapolation"]] == [16, 32]
        assert all(e["loss"] > 0 for e in row["extrapolation"])
    study.model["vocab_size"] = load_meta(data)["vocab_size"]
    norms = ablation.probe_init_grad_norms(study, expand(study)[:1], data)
    assert all(g > 0 for v in norms.values() for g in v)


def test_a_seed_out_of_range_and_bad_seeds_flags_are_one_line(data_dir, tmp_path, capsys):
    argv = ["ablate", "--vary", "norm=layernorm,rmsnorm", "--data", str(data_dir)]
    argv += ["--out", str(tmp_path / "out")]
    for extra, expected in [
        (["--seeds", "0"], "argument --seeds: 0 must be at least 1"),
        (["--seeds", "1e23"], "argument --seeds: '1e23' is not a whole number"),
        (["--seeds", "-3"], "argument --seeds: -3 must be at least 1"),
        # exact names: argparse would take --seed for --seeds (or train.seed, meant or not)
        (["--seed", "3"], "unrecognized arguments: --seed 3 (did you mean --seeds?)"),
        (["--set", "train.seed=1e23"], "train.seed=1e+23 must be an integer in [0, 2**62]"),
        (["--set", "train.seed=-1"], "train.seed=-1 must be an integer in [0, 2**62]"),
        (["--set", "train.seed=100000000000000000000000"], "train.seed=100000000000000000000000"),
        (
            ["--set", "train.seed=4611686018427387904", "--seeds", "2"],
            "reaches seed 4611686018427387905",
        ),
        (["--set", "train.lr=1e-3,2e-3"], "one value per --set"),
    ]:
        assert cli(argv + extra) == 2
        err = capsys.readouterr().err
        assert err.startswith("llm-foundry ablate: error: ") and err.count("\n") == 1, err
        assert expected in err, err
    assert not (tmp_path / "out").exists()


def test_ablate_stopped_by_a_signal_exits_with_its_status_on_one_line(
    data_dir, tmp_path, capsys, monkeypatch
):
    original = Trainer._train_step

    def sigint_at_step_3(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if self.step == 2:  # the third step
            os.kill(os.getpid(), signal.SIGINT)
        return out

    monkeypatch.setattr(Trainer, "_train_step", sigint_at_step_3)
    sets = [f"--set=train.{k}={v}" for k, v in TINY_TRAIN.items()]
    sets += [f"--set={k}={v}" for k, v in TINY_MODEL.items()]
    argv = ["ablate", "--vary", "mlp=gelu,swiglu", "--data", str(data_dir)]
    try:
        code = cli([*argv, "--out", str(tmp_path), *sets])
    except KeyboardInterrupt as e:  # would end the whole test session
        pytest.fail(f"the interrupt escaped the command as a traceback: {e}")
    assert code == 130
    cap = capsys.readouterr()
    err = cap.err.strip().splitlines()
    assert err == [
        "llm-foundry ablate: stopped by SIGINT: mlp=gelu seed 0 interrupted; rerun to resume"
    ]
    assert "SIGINT: saved" in cap.out and "--resume" not in cap.out  # ablate has no --resume
    assert (tmp_path / "runs" / "mlp=gelu" / "seed0" / "checkpoints" / "latest.json").exists()


# ----------------------------------------------------------------------------------------------
# seeds-full-size: the design documents' GPT-2-vs-LLaMA experiment as it was measured on a GPU

# the command line that produced docs/results/seeds-full-size (one NVIDIA H200, 2026-11-26; its
# README in ../shared/data/gpu-2026-11-26/), given once per arm
MEASURED_FLAGS = (
    "--model.dropout 0.2 --train.batch_size 64 --train.block_size 256 --train.lr 1e-3 "
    "--train.min_lr 1e-4 --train.warmup_steps 100 --train.max_steps 5000 --train.beta2 0.99 "
    "--train.eval_interval 250 --train.eval_batches 200 --train.device cuda --train.dtype auto "
    "--train.compile true"
)
MEASURED_ARMS = {
    "gpt2-style (pre-LN)": "--preset gpt2-shakespeare",
    "llama-style": "--preset llama-shakespeare",
    "gpt2-style (post-LN)": "--preset gpt2-shakespeare --model.norm_position post",
}


def _train_settings(flags: str):
    """The settings `llm-foundry train FLAGS` resolves."""
    from llm_foundry.cli.options import settings_from
    from llm_foundry.cli.train import SECTIONS, parser

    return settings_from(parser().parse_args(flags.split()), SECTIONS)


def test_seeds_full_size_recipe_is_the_measured_gpu_run():
    study = load_study("seeds-full-size")
    variants = expand(study)
    assert [v.name for v in variants] == list(MEASURED_ARMS)
    assert study.seeds == 2 and study.speed_rounds == 0  # a CPU timing says nothing of a GPU
    for v in variants:
        measured = _train_settings(f"{MEASURED_ARMS[v.name]} {MEASURED_FLAGS}")
        for i in range(study.seeds):
            mc, tc = ablation.configs(study, v, i)
            assert mc == measured.model, v.name
            assert tc.to_dict() == {**measured.train.to_dict(), "seed": 1337 + i}, v.name
        # the numbers themselves: nanoGPT's shakespeare_char recipe
        assert (mc.n_layers, mc.n_heads, mc.dim, mc.max_seq_len) == (6, 6, 384, 256)
        assert mc.dropout == 0.2
        assert (tc.batch_size, tc.block_size, tc.lr, tc.min_lr, tc.schedule) == (
            64, 256, 1e-3, 1e-4, "cosine")  # fmt: skip
        assert (tc.warmup_steps, tc.beta2, tc.max_steps) == (100, 0.99, 5000)
        assert (tc.eval_interval, tc.eval_batches) == (250, 200)
        assert (tc.device, tc.dtype, tc.compile) == ("cuda", "auto", True)
    models = {v.name: ablation.configs(study, v, 0)[0] for v in variants}
    assert models["gpt2-style (pre-LN)"].norm_position == "pre"
    assert models["gpt2-style (post-LN)"].norm_position == "post"
    llama = models["llama-style"]
    assert (llama.pos_encoding, llama.norm, llama.mlp, llama.kv_heads) == (
        "rope", "rmsnorm", "swiglu", 2)  # fmt: skip


def test_seeds_full_size_without_cuda_is_one_line_naming_the_cpu_override(
    data_dir, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr(Trainer, "run", lambda *a, **k: pytest.fail("trained without a GPU"))
    out = tmp_path / "out"
    argv = ["ablate", "--recipe", "seeds-full-size", "--data", str(data_dir), "--out", str(out)]
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "variant 'gpt2-style (pre-LN)': train.device=cuda: not available" in err
    assert "--set train.device=cpu runs it here anyway: 6 run(s) of 5,000 steps x 16,384" in err
    assert not (out / "runs").exists()


@pytest.mark.heavy
def test_seeds_full_size_shrunk_by_set_flags_trains_on_cpu(data_dir, tmp_path):
    shrink = dict(device="cpu", compile="false", dtype="fp32", max_steps=6, warmup_steps=1,
                  batch_size=2, block_size=16, eval_interval=2, eval_batches=1,
                  checkpoint_interval=6, sample_tokens=0, progress="false")  # fmt: skip
    model = dict(dim=24, n_layers=1, n_heads=2, hidden_dim=32, max_seq_len=16)
    sets = [f"--set=train.{k}={v}" for k, v in shrink.items()]
    sets += [f"--set={k}={v}" for k, v in model.items()]
    out = tmp_path / "out"
    argv = ["ablate", "--recipe", "seeds-full-size", "--seeds", "1", "--data", str(data_dir)]
    assert cli([*argv, "--out", str(out), *sets]) == 0
    report = json.loads((out / "results.json").read_text())
    assert [r["variant"] for r in report["rows"]] == list(MEASURED_ARMS)
    for name, (run,) in report["runs"].items():
        assert [s for s, _ in run["val_curve"]] == [2, 4, 6]
        fp = run["fingerprint"]
        assert fp["model"]["dropout"] == 0.2 and fp["train"]["beta2"] == 0.99  # the recipe's
        assert fp["model"]["norm_position"] == ("post" if "post" in name else "pre")
        assert fp["model"]["pos_encoding"] == ("rope" if name == "llama-style" else "learned")
    for row in report["rows"]:
        curve = report["runs"][row["variant"]][0]["val_curve"]
        assert row["best_val_loss"] == min(v for _, v in curve)
        assert row["best_val_steps"] == [min(curve, key=lambda p: p[1])[0]]
        assert row["ms_per_iter_source"] == "training"  # speed_rounds 0: no CPU timing
    md = (out / "results.md").read_text()
    assert "(speed_rounds 0: no round-robin timing)" in md
    # what ran, beside what the recipe says: the command line's changes
    assert "Run with changes to the recipe: --set train.device=cpu, " in md
    assert (
        "--set n_layers=1, --set n_heads=2, --set hidden_dim=32, --set max_seq_len=16, --seeds 1."
        in md
    )
    assert (out / "val_loss.png").exists()


def test_the_best_evaluation_is_tabled_when_a_run_overfits():
    def run(curve):
        return dict(val_loss=curve[-1][1], train_loss=1.0, params=1, train_ms_per_iter=1.0,
                    peak_mem_bytes=1, decode_tokens_per_s=1.0, kv_bytes_per_token=1,
                    val_curve=curve)  # fmt: skip

    vs = [Variant("gpt2"), Variant("llama")]
    runs = {  # llama learns faster and overfits sooner: worse at the end, level at its best
        "gpt2": [run([(250, 2.06), (500, 1.47), (750, 1.73)]),
                 run([(250, 2.07), (500, 1.48), (750, 1.74)])],
        "llama": [run([(250, 1.66), (500, 1.47), (750, 1.84)]),
                  run([(250, 1.67), (500, 1.49), (750, 1.83)])],
    }  # fmt: skip
    rows = ablation.summarise(vs, runs, {}, 768)
    g, m = rows
    assert m["verdict"].startswith("worse")  # the final evaluation
    assert g["best_val_loss"] == pytest.approx(1.475) and g["best_val_steps"] == [500, 500]
    assert m["best_val_loss"] == pytest.approx(1.48) and m["delta_best_val"] == pytest.approx(0.005)
    assert g["best_verdict"] == "reference" and m["best_verdict"].startswith("within seed noise")
    study = tiny_study(variants=vs).to_dict()
    machine = dict(cpu="x", threads=1, cuda=None, torch="t", date="d")
    md = ablation.markdown(dict(study=study, rows=rows, machine=machine))
    assert "## Best validation loss" in md
    assert "| llama | 1.4800 ± 0.0141 | 500 / 500 | +0.0050 | within seed noise" in md
    # no run rose after its best: no such table
    steady = {k: [run(r["val_curve"][:2]) for r in v] for k, v in runs.items()}
    md = ablation.markdown(dict(study=study, rows=ablation.summarise(vs, steady, {}, 768),
                                machine=machine))  # fmt: skip
    assert "Best validation loss" not in md


def test_report_of_a_directory_without_results_names_what_to_give(tmp_path, capsys):
    assert cli(["ablate", "--report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"--report {tmp_path}: no {tmp_path / 'results.json'}; give the directory" in err
    assert "Errno" not in err
