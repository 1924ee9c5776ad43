"""Reading a run directory while its run is training: the trainer saves a new step directory,
points latest.json at it and deletes the older ones (train.keep_last), so a reader can find the
step directory it resolved gone midway. Readers resolve the run's latest checkpoint again; a
file that vanished is never reported as weights that do not fit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import llm_foundry.checkpoint as ckpt_module
import llm_foundry.loading as loading
from llm_foundry.cli import main
from llm_foundry.config import ModelConfig
from llm_foundry.generate import generate
from llm_foundry.models import Transformer
from llm_foundry.rundir import READ_TRIES, CheckpointReplaced, step_name
from llm_foundry.tokenizer import CharTokenizer
from llm_foundry.train.state import prune_checkpoints, save_train_checkpoint

TEXT = "to be or not to be, that is the question\n" * 3


class TrainingRun:
    """A run directory written as the trainer writes it, saving with keep_last=1: each ``save``
    commits a new step directory (latest.json names it), then deletes the older ones."""

    def __init__(self, path):
        self.path, self.root = path, path / "checkpoints"
        self.tok = CharTokenizer.train(TEXT)
        self.tok_file = path / "tokenizer.json"
        path.mkdir()
        self.tok.save(self.tok_file)
        self.step, self.models = 0, {}
        self.save()

    def save(self) -> None:
        self.step += 10
        torch.manual_seed(self.step)
        cfg = ModelConfig(vocab_size=self.tok.vocab_size, dim=32, n_layers=2, n_heads=2,
                          max_seq_len=64)  # fmt: skip
        model = Transformer(cfg).eval()
        opt = torch.optim.AdamW(model.parameters())
        save_train_checkpoint(self.root, self.step, model, opt.state_dict(), {}, self.tok_file)
        prune_checkpoints(self.root, 1, {step_name(self.step)})
        self.models[self.step] = model

    def greedy(self, step: int, prompt: str = "to", n: int = 8) -> str:
        out = generate(self.models[step], torch.tensor([self.tok.encode(prompt)]), n,
                       temperature=0)  # fmt: skip
        return self.tok.decode(out[0].tolist())


def saves_while_reading(monkeypatch, run: TrainingRun, module, name: str, times: int) -> None:
    """Make ``module.name`` (a step of reading a checkpoint) first let ``run`` save ``times``
    times in all (each save deleting the directory being read), then do its work."""
    original, left = getattr(module, name), [times]

    def racing(*args, **kwargs):
        if left[0] > 0:
            left[0] -= 1
            run.save()
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, racing)


# every step of reading a checkpoint, in order: config.json, the weights' header, the weights,
# then the tokenizer (read after the weights: a deletion there must not pass for "no tokenizer")
READ_STEPS = [
    (loading, "checkpoint_kind"),
    (ckpt_module, "read_config"),
    (ckpt_module, "read_safetensors_header"),
    (ckpt_module, "load_model"),
    (ckpt_module, "fold_lora"),
]


@pytest.mark.parametrize("module,name", READ_STEPS, ids=[n for _, n in READ_STEPS])
def test_generate_reads_the_newer_checkpoint_when_training_deletes_the_one_it_reads(
    tmp_path, capsys, monkeypatch, module, name
):
    run = TrainingRun(tmp_path / "run")
    saves_while_reading(monkeypatch, run, module, name, times=1)
    args = ["generate", "--checkpoint", str(run.path), "--prompt", "to", "--temperature", "0"]
    assert main([*args, "--max-new-tokens", "8"]) == 0, capsys.readouterr().err
    assert run.step == 20 and not (run.root / "step_000010").exists()
    assert capsys.readouterr().out == run.greedy(20) + "\n"
    assert run.greedy(20) != run.greedy(10)  # the output says which checkpoint was read


def test_a_run_that_replaces_its_checkpoint_at_every_read_is_one_line(tmp_path, capsys,
                                                                      monkeypatch):  # fmt: skip
    run = TrainingRun(tmp_path / "run")
    saves_while_reading(monkeypatch, run, ckpt_module, "load_model", times=100)
    assert main(["generate", "--checkpoint", str(run.path), "--prompt", "to"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"llm-foundry generate: error: --checkpoint {run.path}: the run is "
                          "training and replaced its latest checkpoint")  # fmt: skip
    assert "does not match" not in err and run.step == 10 * (READ_TRIES + 1)


def test_a_step_directory_deleted_while_it_is_read_is_named_as_such(tmp_path, monkeypatch):
    """A step directory given by name is not swapped for another, and its deletion is said as
    such, not as weights that do not match their config."""
    run = TrainingRun(tmp_path / "run")
    step = run.root / "step_000010"
    saves_while_reading(monkeypatch, run, ckpt_module, "load_model", times=1)
    with pytest.raises(CheckpointReplaced, match=r"step_000010 was deleted while it was read.*"
                       "run is training") as e:  # fmt: skip
        loading.load_any(step)
    assert "does not match" not in str(e.value)
    monkeypatch.undo()
    saves_while_reading(monkeypatch, run, ckpt_module, "load_model", times=1)
    with pytest.raises(CheckpointReplaced, match=r"step_000020 was deleted while it was read "
                       r"\(model.safetensors\): its run is training"):  # fmt: skip
        ckpt_module.load_checkpoint(run.root / "step_000020")


def test_convert_to_hf_of_a_run_in_training_exports_its_newer_checkpoint(tmp_path, capsys,
                                                                          monkeypatch):  # fmt: skip
    from llm_foundry.interop.hf import from_hf

    run = TrainingRun(tmp_path / "run")
    saves_while_reading(monkeypatch, run, ckpt_module, "load_model", times=1)
    out = tmp_path / "hf"
    assert main(["convert", "--to-hf", str(run.path), "--out", str(out)]) == 0, capsys.readouterr()
    exported = from_hf(out).eval()
    x = torch.tensor([run.tok.encode("to be")])
    torch.testing.assert_close(exported(x)[0], run.models[20](x)[0])
    assert (out / "tokenizer.json").exists()


def test_convert_to_gguf_of_a_run_in_training_exports_its_newer_checkpoint(
    tmp_path, capsys, monkeypatch
):
    gguf = pytest.importorskip("gguf")
    run = TrainingRun(tmp_path / "run")
    saves_while_reading(monkeypatch, run, ckpt_module, "load_model", times=1)
    out = tmp_path / "run.gguf"
    assert main(["convert", "--to-gguf", str(run.path), "--out", str(out)]) == 0, (
        capsys.readouterr()
    )
    reader = gguf.GGUFReader(out)
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    want = run.models[20].state_dict()["tok_emb.weight"].numpy()
    np.testing.assert_array_equal(np.asarray(embed.data).reshape(want.shape), want)
    assert run.path.name in str(reader.get_field("general.name").contents())  # the run's name


def test_convert_to_peft_of_a_run_in_training_reads_its_newer_checkpoint(tmp_path, capsys,
                                                                         monkeypatch):  # fmt: skip
    """The step read when the run saves again is the newer one (this run has no adapters: the
    refusal names the step it read)."""
    run = TrainingRun(tmp_path / "run")
    saves_while_reading(monkeypatch, run, ckpt_module, "read_lora", times=1)
    assert main(["convert", "--to-peft", str(run.path), "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert "step_000020 has no LoRA adapters" in err and "Traceback" not in err, err


def test_finetune_from_a_run_in_training_reads_its_newer_checkpoint(tmp_path, monkeypatch):
    from llm_foundry.loading import model_config_at

    run = TrainingRun(tmp_path / "run")
    saves_while_reading(monkeypatch, run, ckpt_module, "read_config", times=1)
    ckpt, cfg = model_config_at(str(run.path))
    assert ckpt == run.root / "step_000020" and cfg == run.models[20].cfg


@pytest.mark.parametrize("command", ["eval", "generate"])
def test_a_run_with_no_checkpoint_yet_is_said_to_be_one(tmp_path, capsys, command):
    """A run killed (or still training) before its first save: the readers say it is a run
    with no checkpoint yet, not that the directory is no run."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text("{}")
    (run / "metrics.jsonl").write_text("")
    what = ["--data", str(tmp_path)] if command == "eval" else ["--prompt", "hi"]
    assert main([command, "--checkpoint", str(run), *what]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--checkpoint {run} is a training run with no checkpoint yet" \
        in err[0], err  # fmt: skip
