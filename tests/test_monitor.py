"""Training-dynamics monitors: the math (entropy, effective rank, per-layer gradient norms), the
probe (no RNG drawn, mode restored), the trainer's records and warnings, exact resume with
monitors on, and ``inspect dynamics``."""

from __future__ import annotations

import json
import math
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_trainer
from PIL import Image

from llm_foundry.checkpoint import load_checkpoint
from llm_foundry.cli import main as cli_main
from llm_foundry.cli.inspect import main as inspect_main
from llm_foundry.config import ConfigError, ModelConfig
from llm_foundry.models import Transformer
from llm_foundry.models.lora import LoRALinear
from llm_foundry.plots import plot_losses, png_size, read_metrics
from llm_foundry.rundir import latest_checkpoint
from llm_foundry.train.config import TrainConfig
from llm_foundry.train.monitor import (
    attention_entropy,
    effective_rank,
    layer_grad_norms,
    probe,
    read_monitor,
    rest_grad_norm,
    uniform_entropy,
)
from llm_foundry.train.trainer import Trainer

MONITORED = [1, 4, 8, 12]  # 12 steps, monitor_interval 4: step 1 (initialisation), then every 4


@pytest.fixture(scope="module")
def data_dir(char_data) -> Path:
    """A small character-level corpus (Shakespeare when the shared copy is there)."""
    return char_data(60_000)


def _trainer(data_dir, out, resume=False, **train) -> Trainer:
    return make_trainer(data_dir, out, resume, **{"monitor_interval": 4, **train})


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _rows(run) if "loss" in r}


@pytest.fixture(scope="module")
def monitored_run(data_dir, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("monitored") / "run"
    _trainer(data_dir, run).run()
    return run


# ----------------------------------------------------------------------------------------------
# The math


def test_attention_entropy_of_uniform_causal_rows_is_mean_log_keys():
    B, H, T = 2, 3, 10
    causal = torch.ones(T, T).tril()  # row t sees keys 0..t
    w = (causal / causal.sum(-1, keepdim=True)).expand(B, H, T, T)  # masked keys exactly 0
    expected = sum(math.log(t + 1) for t in range(T)) / T
    ent = attention_entropy(w)
    assert ent.shape == (H,)
    assert torch.allclose(ent, torch.full((H,), expected), atol=1e-6)
    assert uniform_entropy(T) == pytest.approx(expected)
    assert uniform_entropy(T, window=3) == pytest.approx(
        sum(math.log(min(t + 1, 3)) for t in range(T)) / T
    )
    full = torch.full((1, 1, 4, 8), 1 / 8)  # no mask: every row log(S)
    assert attention_entropy(full).item() == pytest.approx(math.log(8))


def test_attention_entropy_of_one_hot_rows_is_zero():
    T = 6
    w = torch.zeros(2, 4, T, T)
    w[..., torch.arange(T), torch.randint(0, T, (T,)).clamp(max=torch.arange(T))] = 1.0
    assert torch.equal(attention_entropy(w), torch.zeros(4))


def test_effective_rank_of_identity_and_rank_one():
    for n in (1, 5, 32):
        assert effective_rank(torch.eye(n)) == pytest.approx(n, rel=1e-6)
    torch.manual_seed(0)
    u, v = torch.randn(40, 1), torch.randn(1, 24)
    assert effective_rank(u @ v) == pytest.approx(1.0, abs=1e-3)
    assert effective_rank(torch.diag(torch.tensor([1.0, 1.0, 0.0]))) == pytest.approx(2.0)
    assert effective_rank(torch.zeros(3, 4)) == 0.0
    assert 1 < effective_rank(torch.randn(64, 64)) < 64


def test_layer_grad_norms_squares_sum_to_the_total():
    torch.manual_seed(0)
    for tie in (False, True):
        cfg = ModelConfig(vocab_size=50, dim=32, n_layers=3, n_heads=4, tie_embeddings=tie)
        model = Transformer(cfg)
        x = torch.randint(0, 50, (2, 16))
        model(x, x)[1].backward()
        layers, rest = layer_grad_norms(model), rest_grad_norm(model)
        assert len(layers) == 3 and all(v > 0 for v in layers) and rest > 0
        total = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
        assert sum(v**2 for v in layers) + rest**2 == pytest.approx(total**2, rel=1e-5)
        block0 = torch.cat([p.grad.flatten() for p in model.layers[0].parameters()])
        assert layers[0] == pytest.approx(block0.norm().item(), rel=1e-5)


def test_probe_shapes_draws_no_random_numbers_and_restores_the_mode():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, dropout=0.1)
    model = Transformer(cfg).train()
    x = torch.randint(0, 50, (3, 16))
    before = [p.clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    stats = probe(model, x)
    assert torch.equal(torch.get_rng_state(), rng)  # dropout was off: nothing drawn
    assert model.training and all(m.training for m in model.modules())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert not any(m._forward_hooks for m in model.modules())  # hooks removed
    for key in ("attn_entropy", "rank_wq", "rank_wk", "rank_hidden", "act_rms"):
        assert len(stats[key]) == 3
    assert all(len(h) == 4 for h in stats["attn_entropy"])
    assert stats["full_rank"] == dict(wq=32, wk=16, hidden=32)  # GQA: W_k is (2 * 8, 32)
    assert stats["entropy_uniform"] == pytest.approx(uniform_entropy(16))
    # the same numbers as the model's own attention weights and hidden states
    model.eval()
    weights = model.attention_weights(x)
    for i, w in enumerate(weights):
        assert stats["attn_entropy"][i] == pytest.approx(attention_entropy(w).tolist(), rel=1e-5)
        assert stats["rank_wq"][i] == pytest.approx(effective_rank(model.layers[i].attn.wq.weight))
    h = model.drop(model.emb_norm(model.pos.embed(model.tok_emb(x), 0)))
    for i, layer in enumerate(model.layers):
        h, _ = layer(h, model.pos, 0, None)
        assert stats["act_rms"][i] == pytest.approx(h.pow(2).mean().sqrt().item(), rel=1e-5)
        assert stats["rank_hidden"][i] == pytest.approx(effective_rank(h.flatten(0, 1)), rel=1e-5)


def test_config_fields_are_validated():
    cfg = TrainConfig()
    assert cfg.monitor_interval == 0 and cfg.monitor_entropy_min > 0 and 0 < cfg.monitor_rank_frac
    with pytest.raises(ConfigError, match=r"monitor_interval=-1 must be a non-negative integer"):
        TrainConfig(monitor_interval=-1)
    with pytest.raises(
        ConfigError, match=r"monitor_entropy_min=-0.5 must be a number in \[0, inf\)"
    ):
        TrainConfig(monitor_entropy_min=-0.5)
    with pytest.raises(ConfigError, match=r"monitor_rank_frac=1.5 must be a number in \[0, 1\]"):
        TrainConfig(monitor_rank_frac=1.5)


# ----------------------------------------------------------------------------------------------
# The trainer


def test_trainer_writes_one_record_per_monitored_step(monitored_run, tmp_path):
    rows = _rows(monitored_run)
    records = [r for r in rows if "monitor" in r]
    assert [r["step"] for r in records] == MONITORED
    assert all(set(r) == {"step", "monitor"} for r in records)
    for r in records:
        m = r["monitor"]
        for key in ("rank_wq", "rank_wk", "rank_hidden", "act_rms", "grad_norm"):
            assert len(m[key]) == 2, key
        assert [len(h) for h in m["attn_entropy"]] == [2, 2]
        assert m["full_rank"] == dict(wq=32, wk=32, hidden=32)
        # the per-layer norms split the pre-clipping grad_norm of the same step's line
        line = next(x for x in rows if x["step"] == r["step"] and "loss" in x)
        split = sum(v**2 for v in m["grad_norm"]) + m["grad_norm_rest"] ** 2
        assert split == pytest.approx(line["grad_norm"] ** 2, rel=1e-4)
    # step 1 is the model at initialisation: near-uniform attention
    first = records[0]["monitor"]
    assert min(min(h) for h in first["attn_entropy"]) > 0.8 * first["entropy_uniform"]
    # the other readers of metrics.jsonl see exactly the lines they saw before
    train, evals = read_metrics(monitored_run / "metrics.jsonl")
    assert [r["step"] for r in train] == list(range(1, 13))
    assert [r["step"] for r in evals] == [4, 8, 12]
    png = plot_losses(monitored_run / "metrics.jsonl", tmp_path / "loss.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert read_monitor(monitored_run / "metrics.jsonl") == records


def test_no_warning_on_a_healthy_run_and_one_per_layer_and_kind_when_thresholds_are_impossible(
    data_dir, tmp_path, capsys
):
    t = _trainer(data_dir, tmp_path / "quiet", max_steps=4, eval_interval=0)
    t.run()
    assert "warning: monitor" not in capsys.readouterr().out
    t = _trainer(
        data_dir,
        tmp_path / "loud",
        eval_interval=0,
        monitor_entropy_min=100.0,
        monitor_rank_frac=1.0,
    )
    t.run()
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("warning: monitor")]
    # 4 monitored steps x 2 layers x (entropy, W_q, W_k, hidden): once each, never more
    assert len(lines) == 4 * 2 * 4
    for step in MONITORED:
        for layer in (0, 1):
            mine = [ln for ln in lines if f"step {step}: layer {layer} " in ln]
            assert len(mine) == 4
            entropy = [ln for ln in mine if "attention entropy" in ln]
            assert len(entropy) == 1 and "head " in entropy[0]
            assert "< monitor_entropy_min 100" in entropy[0] and "2 of 2 heads below" in entropy[0]
            for label in ("W_q", "W_k", "hidden states"):
                assert sum(f"{label} effective rank" in ln for ln in mine) == 1
    head_value = lines[0].split("attention entropy ")[1].split(" nats")[0]
    assert 0 < float(head_value) < 100


def test_monitors_change_no_loss_and_resume_stays_exact(data_dir, tmp_path, monitored_run):
    """Monitors on vs off: the same losses bit for bit (the probe draws no random number and
    changes nothing; dropout is on, so an extra draw would show). Then interrupt a monitored run
    at step 6 (SIGTERM, in-process) and resume it: same losses and the same monitor records."""
    off = tmp_path / "off"
    _trainer(data_dir, off, monitor_interval=0).run()
    assert not any("monitor" in r for r in _rows(off))
    full = _losses(monitored_run)
    assert sorted(full) == list(range(1, 13))
    assert [full[s] for s in full] == [_losses(off)[s] for s in full]

    run = tmp_path / "stopped"
    t = _trainer(data_dir, run)
    real = t.forward

    def forward(x, y=None, **kw):  # ask to stop during step 6: it finishes, saves, and exits
        if y is not None and t.model.training and t.step + 1 == 6:
            signal.raise_signal(signal.SIGTERM)
        return real(x, y, **kw)

    t.forward = forward
    result = t.run()
    assert result.interrupted and result.step == 6
    resumed = _trainer(data_dir, run, resume=True)
    assert resumed.step == 6
    resumed.run()
    b = _losses(run)
    assert sorted(b) == list(range(1, 13))
    assert [full[s] for s in full] == [b[s] for s in full]  # bit for bit, every step
    assert read_monitor(run / "metrics.jsonl") == read_monitor(monitored_run / "metrics.jsonl")


@pytest.mark.parametrize("base_dtype", ["fp32", "int8"])
def test_a_lora_fine_tune_is_monitored_on_the_weights_it_computes_with(
    base_dtype, data_dir, monitored_run, tmp_path
):
    """A LoRA fine-tune (adapters on wq and wv, the frozen base held in fp32 or int8) with
    monitors on: W_q's effective rank in each record is that of widen(base) + s·B A, worked out
    by hand from the saved tensors (int8 dequantized), and W_k's (not adapted) that of its plain
    weight. Step 5's record is the model after 4 updates: the step-4 checkpoint."""
    base = latest_checkpoint(monitored_run / "checkpoints")
    run = tmp_path / "ft"
    lora = dict(init_from=str(base), lora_r=4, lora_alpha=8.0, lora_targets="wq,wv",
                lora_base_dtype=base_dtype, lr=1e-2)  # fmt: skip
    _trainer(data_dir, run, max_steps=5, monitor_interval=5, eval_interval=0, **lora).run()
    records = {r["step"]: r["monitor"] for r in read_monitor(run / "metrics.jsonl")}
    assert sorted(records) == [1, 5]
    tuned = load_checkpoint(run / "checkpoints" / "step_000004", merge=False)
    for i, layer in enumerate(tuned.layers):
        wq = layer.attn.wq
        assert isinstance(wq, LoRALinear) and wq.base_dtype == base_dtype
        with torch.no_grad():
            held = wq.base.weight
            if base_dtype == "int8":
                held = held.float() * wq.base.weight_scale[:, None]
            by_hand = held + wq.scale * (wq.lora_B @ wq.lora_A)
        assert records[1]["rank_wq"][i] == pytest.approx(effective_rank(held), rel=1e-6)
        assert records[5]["rank_wq"][i] == pytest.approx(effective_rank(by_hand), rel=1e-6)
        assert records[5]["rank_wq"][i] != pytest.approx(effective_rank(held), rel=1e-4)
        assert records[5]["rank_wk"][i] == pytest.approx(effective_rank(layer.attn.wk.weight))
        assert records[5]["full_rank"] == dict(wq=32, wk=32, hidden=32)


# ----------------------------------------------------------------------------------------------
# inspect dynamics


def test_inspect_dynamics_writes_a_png(monitored_run, tmp_path, capsys):
    out = tmp_path / "dyn.png"
    assert inspect_main(["dynamics", "--run", str(monitored_run), "--out", str(out), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["steps"] == MONITORED and rep["layers"] == 2 and len(rep["monitor"]) == 4
    assert png_size(out) == (1600, 900) == (rep["width"], rep["height"])
    with Image.open(out) as im:
        assert im.size == (1600, 900)
        assert np.asarray(im.convert("RGB"), dtype=np.float32).var() > 0
    out2 = tmp_path / "cli.png"
    assert cli_main(["inspect", "dynamics", "--run", str(monitored_run), "--out", str(out2)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out2}"
    assert png_size(out2) == (1600, 900)


def test_inspect_dynamics_errors_without_monitor_records(tmp_path, capsys):
    run = tmp_path / "plain"
    run.mkdir()
    lines = [dict(step=1, loss=4.0, lr=1e-3), dict(step=1, val_loss=4.1, val_ppl=60.3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    with pytest.raises(ValueError, match=r"no monitor records.*--train.monitor_interval N"):
        inspect_main(["dynamics", "--run", str(run), "--out", str(tmp_path / "x.png")])
    assert not (tmp_path / "x.png").exists()
    assert cli_main(["inspect", "dynamics", "--run", str(run)]) == 2
    assert "--train.monitor_interval" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="nowhere: no such directory"):
        inspect_main(["dynamics", "--run", str(tmp_path / "nowhere")])
