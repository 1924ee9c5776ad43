"""``train.sdpa_backend``: the pinned kernel is the one a training step runs, forward, backward
and activation recomputation; results equal PyTorch's own choice; one that cannot run here is
refused before training, naming those that can."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_trainer

from llm_foundry.models.sdpa_kernels import SDPA_BACKENDS, model_probe, why_not
from llm_foundry.train.trainer import Trainer

# what names each CPU kernel's aten ops (forward; flash's backward too)
CPU_KERNELS = {"math": "attention_math", "flash": "flash_attention_for_cpu"}


@pytest.fixture(scope="module")
def data_dir(char_data):
    return char_data(20_000)


def _trainer(data_dir, out, **train) -> Trainer:
    """make_trainer's run of a dropout-free model (the CPU's flash kernel has no dropout)."""
    return make_trainer(data_dir, out, model=dict(dropout=0.0), max_steps=4, **train)


def _step_ops(trainer) -> set[str]:
    """The names of the ops one training step of ``trainer`` runs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer._train_step()
    return {e.key for e in prof.key_averages()}


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("name", ["math", "flash"])
def test_the_pinned_kernel_runs_every_attention_of_a_step(data_dir, tmp_path, name, checkpointing):
    t = _trainer(data_dir, tmp_path / "run", sdpa_backend=name,
                 activation_checkpointing=checkpointing)  # fmt: skip
    ops = {o for o in _step_ops(t) if "scaled_dot_product" in o}
    t.release()
    other = next(n for n in CPU_KERNELS if n != name)
    assert any(CPU_KERNELS[name] in o for o in ops), ops
    assert not any(CPU_KERNELS[other] in o for o in ops), ops
    if name == "flash":  # a kernel of its own backward (math's is autograd's)
        assert any("flash" in o and "backward" in o for o in ops), ops


def test_pinned_kernels_train_as_pytorchs_own_choice(data_dir, tmp_path):
    losses = {}
    for name in ("auto", "math", "flash"):
        t = _trainer(data_dir, tmp_path / name, sdpa_backend=name)
        losses[name] = [t._train_step()[0] for _ in range(4)]
        t.release()
    for name in ("math", "flash"):
        assert losses[name] == pytest.approx(losses["auto"], rel=1e-5), name


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusals are the CPU's")
def test_a_kernel_that_cannot_run_here_is_refused_naming_those_that_can(data_dir, tmp_path):
    with pytest.raises(ValueError) as e:
        _trainer(data_dir, tmp_path / "run", sdpa_backend="cudnn")
    msg = str(e.value)
    assert msg == ("train.sdpa_backend='cudnn' cannot run this model's attention on cpu in "
                   "float32: PyTorch has no cudnn kernel for this attention on cpu in float32; "
                   "valid here: auto, flash, math")  # fmt: skip
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert list(SDPA_BACKENDS) == ["auto", "flash", "efficient", "cudnn", "math"]


# what the CPU's flash kernel cannot run: dropout, ALiBi's per-head bias, a sliding window's
# mask; each refused before training, PyTorch's reason in one clean line
CANNOT = {
    "dropout": dict(dropout=0.1),
    "alibi": dict(dropout=0.0, pos_encoding="alibi"),
    "window": dict(dropout=0.0, sliding_window=8),
}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusals are the CPU's")
@pytest.mark.parametrize("case", list(CANNOT))
def test_what_the_flash_kernel_cannot_run_is_refused_before_training(data_dir, tmp_path, case):
    model = CANNOT[case]
    t = make_trainer(data_dir, tmp_path / "ok", model=model, max_steps=2)
    assert math.isfinite(t._train_step()[0])  # the model trains with PyTorch's own choice
    t.release()
    with pytest.raises(ValueError) as e:
        make_trainer(data_dir, tmp_path / "run", model=model, sdpa_backend="flash", max_steps=2)
    msg = str(e.value)
    assert msg.startswith("train.sdpa_backend='flash' cannot run this model's attention on cpu")
    assert msg.endswith("valid here: auto, math") and "\n" not in msg
    assert "Triggered internally" not in msg and "because:" not in msg


def test_packed_documents_train_under_a_pinned_kernel_as_pytorchs_choice(tmp_path):
    """Their mask (one per row) is one the CPU's flash kernel takes: the probe passes it, and
    the steps equal PyTorch's own choice."""
    from conftest import corpus_text
    from sharded import sharded_text

    data = sharded_text(tmp_path / "data", corpus_text(20_000))
    losses = {}
    for name in ("auto", "flash", "math"):
        t = make_trainer(data, tmp_path / name, model=dict(dropout=0.0), sdpa_backend=name,
                         data_sampling="packed", document_mask=True)  # fmt: skip
        losses[name] = [t._train_step()[0] for _ in range(3)]
        t.release()
    assert losses["flash"] == pytest.approx(losses["auto"], rel=1e-5)
    assert losses["math"] == pytest.approx(losses["auto"], rel=1e-5)


def test_a_pinned_kernel_is_refused_for_attention_that_does_not_call_sdpa(data_dir, tmp_path):
    with pytest.raises(ValueError, match=r"model.attn_impl='manual' does not call; use attn_impl"):
        make_trainer(data_dir, tmp_path / "run", model=dict(attn_impl="manual"),
                     sdpa_backend="math")  # fmt: skip


def test_the_probe_leaves_no_gradient_and_the_random_state_as_it_was():
    import contextlib

    from llm_foundry.config import ModelConfig
    from llm_foundry.models import Transformer

    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=11, dim=16, n_layers=1, n_heads=2, dropout=0.1))
    state = torch.get_rng_state()
    model_probe(model, "cpu", contextlib.nullcontext)()
    assert torch.equal(torch.get_rng_state(), state)
    assert all(p.grad is None for p in model.parameters())
    assert why_not("flash", model_probe(model, "cpu", contextlib.nullcontext)) is not None
    assert why_not("math", model_probe(model, "cpu", contextlib.nullcontext)) is None
