"""``train.optimizer muon``: Muon on the hidden matrices, AdamW on the rest, in one optimizer
(train/optim.py) checked against PyTorch's own ``Muon`` and ``AdamW`` step for step, then in
the trainer (exact resume) and the config (what it refuses)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import make_trainer

from llm_foundry.config import ConfigError
from llm_foundry.train.config import TrainConfig
from llm_foundry.train.optim import MuonWithAdamW, muon_groups, newton_schulz


def _steps(params, step, n=5):
    """n updates of ``params`` by ``step()`` on a fixed sequence of losses."""
    for i in range(n):
        gen = torch.Generator().manual_seed(i)
        loss = (params[0] @ torch.randn(8, 3, generator=gen)).square().sum() + params[1].pow(
            3
        ).sum()
        loss.backward()
        step()
        for p in params:
            p.grad = None


def test_each_group_is_updated_as_pytorchs_muon_and_adamw_update_it():
    torch.manual_seed(0)
    start = [torch.nn.Parameter(torch.randn(16, 8)), torch.nn.Parameter(torch.randn(8))]
    ours = copy.deepcopy(start)
    opt = MuonWithAdamW([
        {"params": [ours[0]], "kind": "muon", "lr": 0.02, "weight_decay": 0.01, "momentum": 0.95},
        {"params": [ours[1]], "kind": "adamw", "lr": 1e-2, "weight_decay": 0.1, "betas": (0.9, 0.99)},
    ])  # fmt: skip
    _steps(ours, opt.step)
    ref = copy.deepcopy(start)
    m = torch.optim.Muon([ref[0]], lr=0.02, weight_decay=0.01, momentum=0.95)
    a = torch.optim.AdamW([ref[1]], lr=1e-2, weight_decay=0.1, betas=(0.9, 0.99), foreach=False)
    _steps(ref, lambda: (m.step(), a.step()))
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])
    assert not torch.equal(ours[0], start[0])
    # the fp32 iteration: PyTorch's steps to bf16's rounding of each update (lr 0.02 x 5 steps)
    fp32 = copy.deepcopy(start)
    _steps(fp32, MuonWithAdamW([{"params": [fp32[0]], "kind": "muon", "lr": 0.02,
                                 "weight_decay": 0.01, "ns_dtype": "fp32"}]).step)  # fmt: skip
    # bf16 rounds each of the iteration's 15 products to 8 bits: at 16 x 8 the two paths' updates
    # differ by a few percent, in the same direction
    a, b = (fp32[0] - start[0]).flatten(), (ref[0] - start[0]).flatten()
    assert (a - b).norm() < 0.15 * b.norm() and torch.cosine_similarity(a, b, dim=0) > 0.99
    with pytest.raises(ValueError, match="ns_dtype 'fp16' is not one of bf16, fp32"):
        MuonWithAdamW([{"params": [fp32[0]], "kind": "muon", "ns_dtype": "fp16"}])
    # its state dict round-trips into a fresh optimizer that continues identically
    again = copy.deepcopy(ours)
    opt2 = MuonWithAdamW([{"params": [again[0]], "kind": "muon", "lr": 0.02, "weight_decay": 0.01},
                          {"params": [again[1]], "kind": "adamw", "lr": 1e-2, "weight_decay": 0.1,
                           "betas": (0.9, 0.99)}])  # fmt: skip
    saved = copy.deepcopy(opt.state_dict())
    for g in saved["param_groups"]:  # as checkpoints from before ns_dtype hold them
        del g["ns_dtype"]
    opt2.load_state_dict(saved)
    assert [g["ns_dtype"] for g in opt2.param_groups] == ["bf16", "bf16"]
    _steps(ours, opt.step, 2)
    _steps(again, opt2.step, 2)
    assert torch.equal(ours[0], again[0]) and torch.equal(ours[1], again[1])


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest(tiny_config):
    from llm_foundry.models import Transformer

    model = Transformer(tiny_config(tie_embeddings=False))
    hidden, matrices, rest = muon_groups(model, 0.1, 0.0, 0.95, (0.9, 0.99), 20.0)
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)].rsplit(".", 2)[-2] for p in hidden["params"]} == {
        "wq", "wk", "wv", "wo", "w1", "w2", "w3"
    }  # fmt: skip
    assert sorted(names[id(p)] for p in matrices["params"]) == ["lm_head.weight", "tok_emb.weight"]
    assert all(p.dim() == 1 for p in rest["params"]) and rest["weight_decay"] == 0.0
    assert hidden["lr_scale"] == 20.0 and hidden["kind"] == "muon"
    with pytest.raises(ValueError, match="2-D matrices only"):
        MuonWithAdamW([{"params": rest["params"], "kind": "muon"}])


def test_newton_schulz_in_bf16_is_pytorchs_and_in_fp32_the_same_to_bf16_rounding():
    from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _zeropower_via_newtonschulz

    g = torch.randn(48, 16, generator=torch.Generator().manual_seed(0))
    bf16 = newton_schulz(g, torch.bfloat16)
    assert torch.equal(
        bf16, _zeropower_via_newtonschulz(g, (DEFAULT_A, DEFAULT_B, DEFAULT_C), 5, EPS)
    )
    for m in (g, g.T):  # tall and wide
        fp32 = newton_schulz(m, torch.float32)
        assert fp32.dtype == torch.float32 and fp32.shape == m.shape
        ref = newton_schulz(m, torch.bfloat16).float()
        # measured 1.5%; nudging g by one bf16 step moves the bf16 result 2%, one iteration
        # more or less moves it 37%: 6% is bf16's noise with room, far from a wrong iteration
        assert (fp32 - ref).norm() / ref.norm() < 0.06
        # both orthogonalise: every singular value pulled from g's spread towards 1
        s = torch.linalg.svdvals(fp32)
        assert 0.5 < s.min() and s.max() < 1.5, s
    assert torch.linalg.svdvals(g).max() / torch.linalg.svdvals(g).min() > 3


@pytest.mark.parametrize("ns_dtype", ["bf16", "fp32"])
def test_training_with_muon_learns_and_resumes_exactly(char_data, tmp_path, monkeypatch, ns_dtype):
    """A crash after step 4, resumed: the same losses as the uninterrupted run, with the
    Newton-Schulz iteration in bf16 (a CPU with native bf16) or fp32 (one without)."""
    import shutil

    from llm_foundry.train import precision
    from llm_foundry.train.precision import Bf16Support
    from llm_foundry.train.state import write_json_atomic

    monkeypatch.setattr(
        precision, "bf16_support", lambda d: Bf16Support(ns_dtype == "bf16", "test")
    )
    data = char_data(50_000)
    muon = dict(optimizer="muon", muon_lr=0.02, max_steps=8, checkpoint_interval=4)
    whole = make_trainer(data, tmp_path / "whole", **muon)
    whole.run()
    assert isinstance(whole.optimizer, MuonWithAdamW)
    assert json.loads((tmp_path / "whole" / "run.json").read_text())["muon_ns_dtype"] == ns_dtype
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "whole", cut)
    shutil.rmtree(cut / "checkpoints" / "step_000008")
    write_json_atomic(cut / "checkpoints" / "latest.json", {"step": 4, "path": "step_000004"})
    # resumed on a machine that would choose the other precision: the checkpoint's is kept
    other = Bf16Support(ns_dtype != "bf16", "test")
    monkeypatch.setattr(precision, "bf16_support", lambda d: other)
    make_trainer(data, cut, resume=True, **muon).run()
    assert json.loads((cut / "run.json").read_text())["muon_ns_dtype"] == ns_dtype

    def losses(run):
        lines = (run / "metrics.jsonl").read_text().splitlines()
        return [r["loss"] for r in map(json.loads, lines) if "loss" in r]

    assert losses(cut) == losses(tmp_path / "whole") and len(losses(cut)) == 8
    assert losses(cut)[-1] < losses(cut)[0]
    if ns_dtype == "fp32":
        return
    # and Muon moved the hidden matrices differently from AdamW
    adamw = make_trainer(data, tmp_path / "adamw", max_steps=8, checkpoint_interval=4)
    adamw.run()
    assert losses(tmp_path / "adamw")[1:] != losses(cut)[1:]


def test_bad_optimizer_settings_are_named():
    with pytest.raises(ConfigError, match="optimizer='sgd' is not one of adamw, muon"):
        TrainConfig(optimizer="sgd")
    with pytest.raises(ConfigError, match="muon_lr=0 must be a number > 0"):
        TrainConfig(optimizer="muon", muon_lr=0)
    with pytest.raises(ConfigError, match="optimizer='muon' with dtype='fp16'"):
        TrainConfig(optimizer="muon", dtype="fp16")
