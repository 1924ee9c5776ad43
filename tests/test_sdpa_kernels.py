"""``train.sdpa_backend``: the pinned kernel is the one a training step runs, forward, backward
and activation recomputation; results equal PyTorch's own choice; one that cannot run here is
refused before training, naming those that can."""

from __future__ import annotations

import pytest
import torch
from conftest import make_trainer

from llm_foundry.models.sdpa_kernels import SDPA_BACKENDS, check_sdpa_backend, why_not
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
    assert why_not("math", "cpu", torch.float32, 4, 2, 16, masked=True, dropout=0.1) is None
    assert why_not("flash", "cpu", torch.bfloat16, 4, 2, 16, masked=False) is None
    for name in ("cudnn", "efficient"):
        why = why_not(name, "cpu", torch.float32, 4, 2, 16, masked=False)
        assert why == f"PyTorch has no {name} kernel for these inputs on cpu"
    with pytest.raises(ValueError) as e:
        _trainer(data_dir, tmp_path / "run", sdpa_backend="cudnn")
    msg = str(e.value)
    assert msg.startswith("train.sdpa_backend='cudnn' cannot run this model's attention here")
    assert msg.endswith("valid here: auto, flash, math") and "\n" not in msg
    assert "(cpu, float32, 2 heads of 16)" in msg
    with pytest.raises(ValueError, match=r"dropout 0.1\): .*dropout.*valid here: auto, math$"):
        make_trainer(data_dir, tmp_path / "dropout", sdpa_backend="flash")  # TINY: dropout 0.1
    assert not (tmp_path / "run" / "checkpoints").exists()
    check_sdpa_backend("auto", "cpu", torch.float32, 4, 2, 16, masked=True)  # never refused
    assert list(SDPA_BACKENDS) == ["auto", "flash", "efficient", "cudnn", "math"]
