"""The memory check before a run builds its model: the estimate against the accounting it comes
from, the refusal's one line, and that nothing is allocated before it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TINY

from llm_foundry.accounting import meta_model
from llm_foundry.cli import main
from llm_foundry.config import ModelConfig
from llm_foundry.models import Transformer
from llm_foundry.presets import get_preset
from llm_foundry.train.config import TrainConfig
from llm_foundry.train.memory import memory_report
from llm_foundry.train.trainer import Trainer

CPU = torch.device("cpu")
ROWS = ("weights", "working_weights", "gradients", "optimizer", "activations")


@pytest.fixture(scope="module")
def data_dir(char_data) -> Path:
    return char_data(20_000)


@pytest.mark.parametrize(
    "model, train",
    [
        (ModelConfig(**TINY), TrainConfig()),
        (get_preset("gpt2-shakespeare-char"), TrainConfig(dtype="bf16", optimizer="muon")),
        (
            get_preset("llama-shakespeare-char").replace(n_layers=5, n_experts=4),
            TrainConfig(activation_checkpointing=True, batch_size=3, block_size=48),
        ),
    ],
)
def test_the_estimate_is_the_accountings_for_the_whole_model(model, train):
    """Built from one and two blocks, extended to n_layers: every row equals memory_report's
    for the whole model, plus the step's token ids."""
    from llm_foundry.train.memory import training_bytes

    got = training_bytes(model, train)
    dtype = "fp32" if train.dtype == "fp32" else "bf16"
    ref = memory_report(model, 1, 1, train.optimizer, dtype, train.batch_size, train.block_size,
                        train.activation_checkpointing)  # fmt: skip
    assert {k: got[k] for k in ROWS} == {k: ref["strategies"]["ddp"][k] for k in ROWS}
    assert got["params"] == ref["params"]["total"] == meta_model(model).num_params()
    assert got["batches"] == 16 * train.grad_accum * train.batch_size * train.block_size
    assert got["total"] == sum(got[k] for k in (*ROWS, "batches"))


@pytest.mark.parametrize("base_dtype", ["fp32", "bf16", "int8"])
def test_a_lora_run_counts_its_frozen_base_as_it_is_held(base_dtype):
    """No gradients or optimizer state for the frozen base, whose adapted projections weigh
    what the built model's tensors weigh (bf16, or int8 + scales), not fp32."""
    from llm_foundry.models.lora import add_lora
    from llm_foundry.train.memory import training_bytes

    model = get_preset("llama-shakespeare-char")
    tc = TrainConfig(lora_r=4, lora_targets="wq,wv,w2", lora_base_dtype=base_dtype)
    full, lora = training_bytes(model, TrainConfig()), training_bytes(model, tc)
    assert lora["gradients"] == lora["optimizer"] == 0
    torch.manual_seed(0)
    built = Transformer(model)
    plain = sum(t.nbytes for t in [*built.parameters(), *built.buffers()])
    add_lora(built, ("wq", "wv", "w2"), r=4, base_dtype=base_dtype)
    frozen = [t for n, t in [*built.named_parameters(), *built.named_buffers()] if "lora_" not in n]
    held = sum(t.nbytes for t in frozen)
    assert full["weights"] - lora["weights"] == plain - held
    assert (held < plain) == (base_dtype != "fp32")


def test_the_refusal_is_one_line_at_exactly_the_memory_there_is():
    from llm_foundry.train.memory import check_training_memory, training_bytes

    mc, tc = ModelConfig(**TINY), TrainConfig(batch_size=4, block_size=32)
    need = training_bytes(mc, tc)["total"]
    assert check_training_memory(mc, tc, CPU, available=(need, "RAM"))["total"] == need
    with pytest.raises(ValueError) as e:
        check_training_memory(mc, tc, CPU, available=(need - 1, "RAM"))
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"training this model ({training_bytes(mc, tc)['params']:,} parameters)")
    assert f"needs an estimated {need:,} bytes" in msg
    assert f"but this machine has {need - 1:,} bytes" in msg and "of RAM: lower" in msg


def _never_built(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was built before the memory check")

    monkeypatch.setattr("llm_foundry.train.build.Transformer", refuse)


@pytest.mark.parametrize(
    "model, train, lower",
    [
        ({"dim": 2**20, "n_heads": 2}, {}, "model's size (model.dim"),  # ~400 TiB of weights
        ({"n_layers": 10**8}, {}, "model.n_layers"),  # cheap to check: not 10**8 blocks built
        ({}, {"batch_size": 10**9}, "micro-batch (train.batch_size"),
        ({}, {"grad_accum": 10**10}, "train.grad_accum"),
    ],
)
def test_a_run_that_cannot_fit_is_refused_before_the_model_is_built(
    data_dir, tmp_path, monkeypatch, model, train, lower
):
    _never_built(monkeypatch)
    mc = ModelConfig(**{**TINY, **model})
    tc = TrainConfig(**{"batch_size": 4, "block_size": 32, "progress": False, **train})
    with pytest.raises(ValueError) as e:
        Trainer(mc, tc, data_dir, tmp_path / "run")
    msg = str(e.value)
    assert msg.startswith("training this model (") and "\n" not in msg
    assert "bytes" in msg and "this machine has" in msg and lower in msg
    assert not (tmp_path / "run").exists()


def test_train_refuses_it_on_one_line_naming_the_bytes(data_dir, tmp_path, monkeypatch, capsys):
    _never_built(monkeypatch)
    argv = ["train", "--data", str(data_dir), "--out", str(tmp_path / "run")]
    assert main([*argv, "--model.dim", str(10**7)]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("llm-foundry train: error: training this model (") and err.count("\n") == 1
    )
    assert "needs an estimated" in err and "bytes" in err and "this machine has" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_model_too_large_to_exist_is_named(data_dir, tmp_path, monkeypatch):
    _never_built(monkeypatch)
    mc = ModelConfig(**{**TINY, "dim": 2**62, "n_heads": 2})
    with pytest.raises(ValueError, match=r"^the config describes a model too large to exist \("):
        Trainer(mc, TrainConfig(batch_size=4, block_size=32), data_dir, tmp_path / "run")
