"""``finetune --checkpoint RUN`` of a run that is still training: the step directory it resolved
is deleted (train.keep_last) before or while finetune reads it. The weights and the tokenizer
are read through ``rundir.read_checkpoint``, which resolves the run's latest checkpoint again;
the fine-tune starts from the newer one. The run is simulated as tests/test_rundir.py does."""

from __future__ import annotations

import argparse
import json

import torch
from safetensors.torch import load_file
from test_rundir import TEXT, TrainingRun, saves_while_reading

import llm_foundry.checkpoint as ckpt_module
import llm_foundry.data.preference as preference
import llm_foundry.loading as loading
from llm_foundry.cli import main
from llm_foundry.cli.finetune import DATA_DIR, _prepare
from llm_foundry.data import prepare


def test_finetune_starts_from_the_newer_checkpoint_when_training_deletes_the_one_it_resolved(
    tmp_path, monkeypatch, capsys
):
    run = TrainingRun(tmp_path / "run")  # step 10
    (tmp_path / "text.txt").write_text(TEXT * 40)
    prepare(tmp_path / "data", text_files=[tmp_path / "text.txt"], tokenizer="char",
            progress=False)  # fmt: skip
    resolve = loading.model_config_at

    def resolved_then_saved(checkpoint):  # finetune knows step 10; the run saves 20 and prunes
        found = resolve(checkpoint)
        run.save()
        return found

    monkeypatch.setattr(loading, "model_config_at", resolved_then_saved)
    # and while the weights of step 20 are read, the run saves 30 and deletes 20
    saves_while_reading(monkeypatch, run, ckpt_module, "load_model", times=1)
    out = tmp_path / "tuned"
    argv = ["finetune", "--checkpoint", str(run.path), "--data", str(tmp_path / "data"),
            "--out", str(out), "--train.max_steps", "1", "--train.lora_r", "2",
            "--train.batch_size", "2", "--train.block_size", "16", "--train.eval_batches", "1",
            "--train.sample_tokens", "0", "--train.progress", "false"]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    assert run.step == 30 and not (run.root / "step_000020").exists()
    # LoRA: the frozen base saved after one step is the one it started from, step 30's
    tuned = load_file(str(out / "checkpoints" / "step_000001" / "model.safetensors"))
    start = run.models[30].state_dict()
    base = tuned.keys() & start.keys()
    assert "tok_emb.weight" in base and all(torch.equal(tuned[k], start[k]) for k in base)
    info = json.loads((out / "run.json").read_text())
    assert info["train"]["init_from"] == str(run.path)  # the run, resolved when read


def test_dpo_rows_are_tokenized_with_the_newer_checkpoint_when_training_deletes_the_one_read(
    tmp_path, monkeypatch, capsys
):
    run = TrainingRun(tmp_path / "run")  # step 10
    rows = tmp_path / "rows.jsonl"
    pair = {"prompt": "to be", "chosen": " or not to be", "rejected": " that is the"}
    rows.write_text("".join(json.dumps(pair) + "\n" for _ in range(8)))
    # the run saves step 20 (deleting 10) as the tokenizer of step 10 is about to be read
    saves_while_reading(monkeypatch, run, preference, "open_tokenizer", times=1)
    ns = argparse.Namespace(data=str(rows), out=str(tmp_path / "dpo"), checkpoint=str(run.path))
    _prepare(ns)
    data = tmp_path / "dpo" / DATA_DIR
    assert ns.data == str(data) and run.step == 20
    meta = json.loads((data / "meta.json").read_text())
    assert meta["train_pairs"] + meta["val_pairs"] == 8
    assert (data / "tokenizer.json").read_bytes() == run.tok_file.read_bytes()
    assert f"(tokenizer {run.root / 'step_000020' / 'tokenizer.json'})" in capsys.readouterr().out


def test_a_fine_tune_records_its_base_as_an_absolute_path(tmp_path, monkeypatch, capsys):
    """--checkpoint given relative to the working directory: run.json's train.init_from and an
    exported adapter's base_model_name_or_path name the directory from anywhere (a relative name
    reads as a hub id elsewhere, and a DPO run reads its reference from it again on resume)."""
    run = TrainingRun(tmp_path / "run")
    (tmp_path / "text.txt").write_text(TEXT * 40)
    prepare(tmp_path / "data", text_files=[tmp_path / "text.txt"], tokenizer="char",
            progress=False)  # fmt: skip
    monkeypatch.chdir(tmp_path)
    argv = ["finetune", "--checkpoint", "run", "--data", "data", "--out", "tuned",
            "--train.max_steps", "1", "--train.lora_r", "2", "--train.batch_size", "2",
            "--train.block_size", "16", "--train.eval_batches", "1", "--train.sample_tokens", "0",
            "--train.progress", "false"]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    recorded = json.loads((tmp_path / "tuned" / "run.json").read_text())["train"]["init_from"]
    assert recorded == str(run.path.resolve())
    assert main(["convert", "--to-peft", "tuned", "--out", "adapter"]) == 0
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(run.path.resolve())
