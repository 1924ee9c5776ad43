"""Mixture of experts: routing, the fast path against the reference, the balancing loss against
transformers', a whole MoE layer against Mixtral's and Qwen3-MoE's, decoding with a cache,
training (auxiliary losses, expert load, dead experts, exact resume) and bad configs."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from conftest import assert_decisive

from llm_foundry.config import ConfigError, ModelConfig
from llm_foundry.generate import generate
from llm_foundry.models import Transformer
from llm_foundry.models.moe import (
    MoE,
    experts_grouped,
    experts_loop,
    load_balancing_loss,
    route,
    router_z_loss,
)
from llm_foundry.train.monitor import ExpertLoad
from llm_foundry.train.state import write_json_atomic

MOE = dict(n_experts=4, experts_per_token=2, expert_hidden_dim=16)


def test_route_picks_the_top_k_and_renormalises_only_when_asked():
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0], [0.0, 3.0, 0.0, 3.0]])
    probs = torch.softmax(logits, -1)
    w, ids = route(logits, 2, renormalize=False)
    assert ids[0].tolist() == [0, 2] and sorted(ids[1].tolist()) == [1, 3]
    torch.testing.assert_close(w, probs.gather(1, ids))
    w, _ = route(logits, 2, renormalize=True)
    torch.testing.assert_close(w.sum(-1), torch.ones(2))


@pytest.mark.parametrize("D, H", [(32, 16), (6, 10)])  # grouped product, and the per-expert split
@pytest.mark.parametrize("gated", [True, False])
def test_grouped_experts_equal_the_loop_with_gradients(D, H, gated):
    torch.manual_seed(0)
    E, k, N = 5, 2, 23
    x = torch.randn(N, D, requires_grad=True)
    w1, w2 = torch.randn(E, H, D, requires_grad=True), torch.randn(E, D, H, requires_grad=True)
    w3 = torch.randn(E, H, D, requires_grad=True) if gated else None
    logits = torch.randn(N, E)
    logits[:, 3] = -50  # expert 3 receives no token: both paths must skip it
    weights, ids = route(logits, k, True)
    assert not (ids == 3).any()
    params = [t for t in (x, w1, w2, w3) if t is not None]
    outs, grads = [], []
    for path in (experts_loop, experts_grouped):
        y = path(x, weights, ids, w1, w2, w3, torch.nn.functional.silu)
        g = torch.autograd.grad((y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum(), params)
        outs.append(y.detach())
        grads.append(g)
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("k, layers", [(1, 1), (2, 3), (4, 2)])
def test_balancing_loss_equals_transformers(k, layers):
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    torch.manual_seed(k)
    logits = [torch.randn(37, 8) * 2 for _ in range(layers)]
    ours = load_balancing_loss(logits, k)
    theirs = mixtral.load_balancing_loss_func(tuple(logits), num_experts=8, top_k=k)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)
    # perfectly balanced routing scores k: every expert gets k/E of the assignments, P_e = 1/E
    uniform = [torch.eye(8).repeat(4, 1) * 10]
    torch.testing.assert_close(
        load_balancing_loss(uniform, 1), torch.tensor(1.0), atol=1e-4, rtol=0
    )


def test_router_z_loss_is_the_mean_squared_logsumexp():
    logits = [torch.tensor([[0.0, 0.0], [1.0, 3.0]])]
    expected = (math.log(2) ** 2 + math.log(math.e + math.e**3) ** 2) / 2
    assert router_z_loss(logits).item() == pytest.approx(expected, rel=1e-6)


def _hf_block(kind: str, renormalize: bool):
    """A random HF sparse-MoE block and our layer holding the same weights."""
    t = pytest.importorskip("transformers")
    torch.manual_seed(3)
    D, H, E, k = 32, 24, 6, 2
    if kind == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        hf_cfg = t.MixtralConfig(
            hidden_size=D, intermediate_size=H, num_local_experts=E, num_experts_per_tok=k
        )
        block = MixtralSparseMoeBlock(hf_cfg)
    else:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        hf_cfg = t.Qwen3MoeConfig(
            hidden_size=D,
            moe_intermediate_size=H,
            num_experts=E,
            num_experts_per_tok=k,
            norm_topk_prob=renormalize,
        )
        block = Qwen3MoeSparseMoeBlock(hf_cfg)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    cfg = ModelConfig(
        dim=D, n_heads=4, n_experts=E, experts_per_token=k, expert_hidden_dim=H,
        moe_renormalize=renormalize,
    )  # fmt: skip
    ours = MoE(cfg)
    gate_up, down = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
    with torch.no_grad():
        ours.router.weight.copy_(block.gate.weight)
        ours.w1.copy_(gate_up[:, :H])
        ours.w3.copy_(gate_up[:, H:])
        ours.w2.copy_(down)
    return block.eval(), ours.eval()


@pytest.mark.parametrize(
    "kind, renormalize", [("mixtral", True), ("qwen3_moe", True), ("qwen3_moe", False)]
)
def test_a_moe_layer_equals_transformers(kind, renormalize):
    block, ours = _hf_block(kind, renormalize)
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        theirs = block(x)
        theirs = theirs[0] if isinstance(theirs, tuple) else theirs
        torch.testing.assert_close(ours(x), theirs, atol=1e-5, rtol=1e-5)


def test_cached_decoding_with_experts_equals_recomputing(tiny_config):
    torch.manual_seed(0)
    model = Transformer(tiny_config(**MOE, n_kv_heads=2)).eval()
    idx = torch.randint(0, 37, (2, 20))
    full = model(idx)[0]
    cache = model.new_cache(2, 32)
    parts = [model(idx[:, :7], cache=cache)[0]]
    parts += [model(idx[:, t : t + 1], cache=cache)[0] for t in range(7, 20)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-4, rtol=0)
    prompt = idx[:, :6]
    ref = prompt
    for _ in range(12):
        ref = torch.cat([ref, model(ref)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    assert_decisive(model(ref[:, :-1])[0][:, 5:], "experts")
    assert torch.equal(generate(model, prompt, 12, temperature=0), ref)


def test_costs_count_active_experts(tiny_config):
    cfg = tiny_config(**MOE, n_shared_experts=1)
    model = Transformer(cfg)
    moe = model.layers[0].mlp
    expert = 3 * cfg.dim * cfg.expert_hidden_dim  # w1, w3, w2 of one expert
    idle = (cfg.n_experts - cfg.experts_per_token) * expert * cfg.n_layers
    assert model.num_params() - model.active_params() == idle
    shared = 3 * cfg.dim * cfg.expert_hidden_dim
    assert moe.flops_per_token(64) == 6 * (cfg.dim * cfg.n_experts + 2 * expert + shared)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(n_experts=4, experts_per_token=5), "experts_per_token=5 is more than n_experts=4"),
        (dict(n_experts=-1), "n_experts=-1 must be an integer >= 0"),
        (dict(n_experts=4, experts_per_token=0), "experts_per_token=0 must be a positive"),
        (dict(n_experts=4, moe_dispatch="fast"), "moe_dispatch='fast' is not one of grouped"),
        (dict(n_experts=4, router_jitter=1.5), "router_jitter=1.5 must be in [0, 1)"),
        (dict(n_experts=4, moe_aux_loss_coef=-0.1), "moe_aux_loss_coef=-0.1 must be a number"),
    ],
)
def test_bad_expert_settings_are_named(fields, message):
    with pytest.raises(ConfigError) as e:
        ModelConfig(**fields)
    assert message in str(e.value)


class _OneRank:
    distributed, main = False, True


def test_dead_experts_are_named_in_the_record_and_warned_about(tiny_config):
    model = Transformer(tiny_config(**MOE))
    load = ExpertLoad(model, 2, _OneRank(), torch.device("cpu"))
    for moe in model.moe_layers():
        moe.expert_ids = torch.tensor([[0, 1], [0, 2], [1, 2]])  # expert 3 never chosen
    warnings: list[str] = []
    for _ in range(2):
        load.count(model)
        rec = load.step_record(torch.tensor(0.5))
    assert rec["aux_loss"] == 0.5 and len(rec["expert_cv"]) == 2
    assert rec["expert_cv"][0] == pytest.approx(torch.tensor([2.0, 2, 2, 0]).std(False) / 1.5)
    out = load.interval_record(2, warnings.append)
    assert out["experts"]["dead"] == [[0, 3], [1, 3]]
    assert out["experts"]["load"][0] == pytest.approx([1 / 3, 1 / 3, 1 / 3, 0.0])
    assert len(warnings) == 1 and "layer 0 expert 3, layer 1 expert 3" in warnings[0]


def _moe_trainer(data_dir, out, resume=False, **train):
    from llm_foundry.train.config import TrainConfig
    from llm_foundry.train.trainer import Trainer

    cfg = dict(
        batch_size=4, block_size=32, max_steps=12, eval_interval=4, eval_batches=2,
        warmup_steps=2, checkpoint_interval=4, sample_tokens=0, progress=False,
    )  # fmt: skip
    cfg.update(train)
    model = ModelConfig(
        vocab_size=65, dim=32, n_layers=2, n_heads=2, max_seq_len=32, **MOE, router_z_loss_coef=0.01
    )
    return Trainer(model, TrainConfig(**cfg), data_dir, out, resume=resume)


def _records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_training_adds_the_routing_losses_and_resumes_exactly(char_data, tmp_path):
    data = char_data(60_000)
    _moe_trainer(data, tmp_path / "full", checkpoint_interval=6, keep_last=10).run()
    full = _records(tmp_path / "full")
    steps = [r for r in full if "loss" in r]
    assert all(r["aux_loss"] > 0 and len(r["expert_cv"]) == 2 for r in steps)
    load = [r["experts"] for r in full if "experts" in r]
    assert len(load) == 3 and all(
        math.isclose(sum(row), 1.0, abs_tol=1e-5) for e in load for row in e["load"]
    )
    # a crash right after step 6 (the run's checkpoint at 6 is its latest), resumed: the same
    # records (losses, routing, expert load) as the uninterrupted run, bit for bit; the expert
    # counts of steps 5-6 travel in that checkpoint
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "full", cut)
    for step in (8, 12):
        shutil.rmtree(cut / "checkpoints" / f"step_{step:06d}")
    write_json_atomic(cut / "checkpoints" / "latest.json", {"step": 6, "path": "step_000006"})
    _moe_trainer(data, cut, resume=True, checkpoint_interval=6, keep_last=10).run()
    timing = ("tokens_per_s", "flops_per_s", "time")

    def strip(records):
        return [{k: v for k, v in r.items() if k not in timing} for r in records]

    assert strip(_records(cut)) == strip(full)


def test_the_balancing_loss_changes_the_router_gradient(tiny_config):
    torch.manual_seed(0)
    idx = torch.randint(0, 37, (2, 16))
    grads = []
    for coef in (0.0, 1.0):
        torch.manual_seed(0)
        model = Transformer(tiny_config(**MOE, moe_aux_loss_coef=coef))
        loss = model(idx, idx)[1] + model.aux_loss()
        loss.backward()
        grads.append(model.layers[0].mlp.router.weight.grad.clone())
    assert not torch.allclose(grads[0], grads[1])


def test_inspect_experts_plots_the_load_records(char_data, tmp_path, capsys):
    from llm_foundry.cli import main

    run = tmp_path / "run"
    _moe_trainer(char_data(60_000), run, max_steps=8).run()
    capsys.readouterr()
    out = tmp_path / "experts.png"
    assert main(["inspect", "experts", "--run", str(run), "--out", str(out), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    records = [r["experts"] for r in _records(run) if "experts" in r]
    assert shown["steps"] == [4, 8] and shown["final_cv"] == records[-1]["cv"]
    assert shown["width"] > 0 and out.stat().st_size > 0
    dense = tmp_path / "dense"
    (dense).mkdir()
    (dense / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    assert main(["inspect", "experts", "--run", str(dense)]) == 2
    assert "no expert-load records" in capsys.readouterr().err
