"""The fused head and loss (models/loss.py, ``train.fused_loss``): the loss and gradients of
F.cross_entropy on the materialised logits (fp64 to rounding, fp32 to 1e-6, bf16 autocast as
close as the plain path), in the model, compiled, in training steps, on two ranks, and in less
memory than the logits take."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import make_trainer

from llm_foundry.config import ConfigError
from llm_foundry.models import Transformer
from llm_foundry.models.lora import add_lora
from llm_foundry.models.loss import default_chunk_rows, head_loss, linear_cross_entropy
from llm_foundry.train.config import TrainConfig

IGNORE = -100
N, D, V = 37, 16, 50  # 37 rows: no chunk size below divides it


def _inputs(dtype=torch.float32, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g, dtype=dtype).requires_grad_()
    w = (torch.randn(V, D, generator=g, dtype=dtype) * 0.5).requires_grad_()
    b = (torch.randn(V, generator=g, dtype=dtype) * 0.1).requires_grad_() if bias else None
    t = torch.randint(0, V, (N,), generator=g)
    t[::5] = IGNORE  # scattered ignored rows
    t[8:16] = IGNORE  # and, with chunks of 8 rows, one chunk with no target at all
    return x, w, b, t


def _params(x, w, b):
    return [p for p in (x, w, b) if p is not None]


def _reference(x, w, b, t, float_logits=True):
    """F.cross_entropy on the whole logits, as the plain head computes it; (loss, grads)."""
    logits = F.linear(x, w, b)
    loss = F.cross_entropy(logits.float() if float_logits else logits, t, ignore_index=IGNORE)
    return loss, torch.autograd.grad(loss, _params(x, w, b))


def _fused(x, w, b, t, chunk_rows):
    loss = linear_cross_entropy(x, w, t, b, ignore_index=IGNORE, chunk_rows=chunk_rows)
    return loss, torch.autograd.grad(loss, _params(x, w, b))


@pytest.mark.parametrize("chunk_rows", [1, 8, 10, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_fp64_equals_cross_entropy_on_the_logits_to_rounding(chunk_rows, bias):
    x, w, b, t = _inputs(torch.float64, bias)
    ref, ref_grads = _reference(x, w, b, t, float_logits=False)
    loss, grads = _fused(x, w, b, t, chunk_rows)
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=0)
    for g, r in zip(grads, ref_grads, strict=True):
        assert g.dtype == r.dtype
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("chunk_rows", [8, 10, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_equals_cross_entropy_on_the_logits_within_1e_6(chunk_rows, bias):
    x, w, b, t = _inputs(torch.float32, bias)
    ref, ref_grads = _reference(x, w, b, t)
    loss, grads = _fused(x, w, b, t, chunk_rows)
    assert loss.dtype == torch.float32
    assert abs(loss.item() - ref.item()) <= 1e-6 * abs(ref.item())
    for g, r in zip(grads, ref_grads, strict=True):
        # relative to the gradient's scale: a sum in another order, not an approximation
        assert (g - r).abs().max() <= 1e-6 * r.abs().max(), (g - r).abs().max()


def test_no_target_at_all_gives_nan_and_zero_gradients_as_cross_entropy():
    x, w, b, _ = _inputs()
    t = torch.full((N,), IGNORE)
    ref, ref_grads = _reference(x, w, b, t)
    loss, grads = _fused(x, w, b, t, 8)
    assert ref.isnan() and loss.isnan()
    for g, r in zip(grads, ref_grads, strict=True):
        assert (g == 0).all() and (r == 0).all()


def test_backward_scales_by_the_incoming_gradient_and_accumulates():
    """loss x 3.5 (a grad-accumulation share, a grad scaler) gives 3.5 x the gradients, and two
    backward passes add up in .grad as autograd's do."""
    x, w, b, t = _inputs()
    _, (gx, gw, gb) = _fused(x, w, b, t, 8)
    (3.5 * linear_cross_entropy(x, w, t, b, chunk_rows=8)).backward()
    linear_cross_entropy(x, w, t, b, chunk_rows=8).backward()
    for p, g in ((x, gx), (w, gw), (b, gb)):
        torch.testing.assert_close(p.grad, 4.5 * g, rtol=1e-6, atol=1e-9)


def test_only_the_gradients_asked_for_are_computed():
    x, w, b, t = _inputs()
    ref, (rx, _, rb) = _reference(x, w, b, t)
    w.requires_grad_(False)
    loss = linear_cross_entropy(x, w, t, b, chunk_rows=8)
    gx, gb = torch.autograd.grad(loss, (x, b))
    torch.testing.assert_close(gx, rx, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gb, rb, rtol=1e-5, atol=1e-7)
    with torch.no_grad():  # evaluation: the loss alone, no graph
        loss = linear_cross_entropy(x, w, t, b, chunk_rows=8)
    assert loss.grad_fn is None
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-6, atol=0)


def _worst(grads, truth):
    return max(
        ((g.double() - r).abs().max() / r.abs().max()).item()
        for g, r in zip(grads, truth, strict=True)
    )


@pytest.mark.parametrize("amp", [torch.bfloat16, torch.float16])
def test_low_precision_autocast_is_as_close_as_the_plain_head(amp):
    """Under autocast both paths multiply in bf16/fp16 and take the softmax in fp32: the fused
    loss and gradients are as far from the fp64 truth as the plain head's (bf16 rounding), and
    come back in fp32, the parameters' dtype."""
    x, w, b, t = _inputs(bias=False)
    truth_loss, truth = _reference(x.double(), w.double(), None, t)
    truth = [g.detach() for g in truth]
    with torch.autocast("cpu", dtype=amp):
        ref, ref_grads = _reference(x, w, None, t)
        loss, grads = _fused(x, w, None, t, 8)
    assert loss.dtype == torch.float32 and [g.dtype for g in grads] == [torch.float32] * 2
    eps = 2**-8 if amp == torch.bfloat16 else 2**-11
    plain = abs(ref.item() - truth_loss.item())
    assert abs(loss.item() - truth_loss.item()) <= 2 * plain + eps * abs(truth_loss.item())
    assert _worst(grads, truth) <= 2 * _worst(ref_grads, truth) + eps


def _relative(grads, truth) -> list[float]:
    return [((g.double() - r).norm() / r.norm()).item() for g, r in zip(grads, truth, strict=True)]


def test_fp16_small_gradients_do_not_flush_to_zero():
    """Gradients of a mean over many rows are tiny (~1 / (rows x vocab) = 6e-8 here, fp16's
    smallest subnormal): under fp16 the plain head keeps them only with a grad scaler; the fused
    one multiplies softmax - onehot unscaled and divides in fp32, so they stay accurate."""
    g = torch.Generator().manual_seed(1)
    n, v = 16384, 1024
    x = torch.randn(n, D, generator=g).requires_grad_()
    w = (torch.randn(v, D, generator=g) * 0.1).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g)
    _, truth = _reference(x.double(), w.double(), None, t)
    truth = [g.detach() for g in truth]
    with torch.autocast("cpu", dtype=torch.float16):
        _, plain = _reference(x, w, None, t)
        _, fused = _fused(x, w, None, t, 1024)
    assert max(_relative(plain, truth)) > 1e-2  # what the test is about: fp16 loses them
    assert max(_relative(fused, truth)) < 1e-3


def test_default_chunks_are_powers_of_two_within_the_budget():
    assert default_chunk_rows(32 * 1024, 50304) == 2048
    assert default_chunk_rows(100, 50304) == 100  # never more rows than there are
    assert default_chunk_rows(10**6, 2**40) == 1


# ----------------------------------------------------------------------------------------------
# In the model


def _model(tiny_config, **fields):
    torch.manual_seed(0)
    return Transformer(tiny_config(**fields))


def _step(model, idx, y):
    model.zero_grad(set_to_none=True)
    logits, loss = model(idx, y)
    loss.backward()
    return logits, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [True, False])
def test_model_with_the_fused_loss_gives_the_loss_and_gradients_of_the_plain_head(
    tiny_config, tied
):
    """Tied: the head's gradient is added to the embedding's, as with the plain head."""
    model = _model(tiny_config, tie_embeddings=tied)
    idx = torch.randint(0, 37, (3, 20))
    y = torch.randint(0, 37, (3, 20))
    y[0, :7] = IGNORE
    logits, ref, ref_grads = _step(model, idx, y)
    assert logits.shape == (3, 20, 37)
    model.fused_loss = True
    none, loss, grads = _step(model, idx, y)
    assert none is None  # no logits: the point
    assert abs(loss.item() - ref.item()) <= 1e-6 * ref.item()
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        r = ref_grads[name]
        assert (g - r).abs().max() <= 1e-5 * r.abs().max() + 1e-9, name
    # without targets the model still returns logits (generation, evaluation, the harness)
    torch.testing.assert_close(model(idx)[0], logits)


def test_experts_routing_losses_are_unchanged_by_the_fused_loss(tiny_config):
    """The balancing and router z-losses come from the blocks, beside the head: the same."""
    model = _model(tiny_config, n_experts=4, moe_aux_loss_coef=0.01, router_z_loss_coef=0.001)
    idx = torch.randint(0, 37, (2, 12))
    out = {}
    for fused in (False, True):
        model.fused_loss = fused
        model.zero_grad(set_to_none=True)
        loss = model(idx, idx)[1]
        aux = model.aux_loss()
        (loss + aux).backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        out[fused] = (loss.item(), aux.item(), grads)
    assert out[True][1] == out[False][1]
    assert abs(out[True][0] - out[False][0]) <= 1e-6 * out[False][0]
    for g, r in zip(out[True][2], out[False][2], strict=True):
        assert (g - r).abs().max() <= 1e-5 * r.abs().max() + 1e-9


def test_an_adapted_head_is_refused_in_the_model_and_in_the_config(tiny_config):
    model = _model(tiny_config)
    add_lora(model, ["lm_head"], r=2, alpha=4, dropout=0.0, rslora=False)
    model.fused_loss = True
    with pytest.raises(TypeError, match="plain linear output head, not LoRALinear"):
        model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ConfigError, match="fused_loss=true with lm_head in lora_targets"):
        TrainConfig(fused_loss=True, lora_r=2, lora_targets="wq,lm_head")
    with pytest.raises(ConfigError, match="fused_loss=true with parallel='tp'"):
        TrainConfig(fused_loss=True, parallel="tp")
    with pytest.raises(ConfigError, match="fused_loss=true with parallel='fsdp\\+tp'"):
        TrainConfig(fused_loss=True, parallel="fsdp+tp", tp_size=2)
    assert TrainConfig(fused_loss=True, lora_r=2, parallel="fsdp").fused_loss


def test_the_setting_reaches_the_model_a_run_builds(tiny_config):
    from llm_foundry.train.build import build_model

    cpu = torch.device("cpu")
    assert build_model(tiny_config(), TrainConfig(fused_loss=True), cpu).fused_loss is True
    assert build_model(tiny_config(), TrainConfig(), cpu).fused_loss is False


def test_head_loss_reads_the_models_head(tiny_config):
    model = _model(tiny_config)
    x = torch.randn(2, 5, 32)
    t = torch.randint(0, 37, (2, 5))
    ref = F.cross_entropy(model.lm_head(x).flatten(0, 1), t.flatten())
    torch.testing.assert_close(head_loss(model.lm_head, x, t), ref, rtol=1e-6, atol=0)


@pytest.mark.heavy  # two torch.compile builds on the CPU, ~1 minute
def test_compiled_fused_loss_gives_the_eager_plain_heads_loss_and_gradients(tiny_config):
    model = _model(tiny_config, tie_embeddings=True, n_layers=1)
    idx = torch.randint(0, 37, (3, 20))
    y = torch.randint(0, 37, (3, 20))
    y[1, 3:9] = IGNORE
    _, ref, ref_grads = _step(model, idx, y)
    fused = copy.deepcopy(model)
    fused.fused_loss = True
    compiled = torch.compile(fused, fullgraph=True)  # no graph break around the Function
    for amp in (None, torch.bfloat16):
        with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
            none, loss = compiled(idx, y)
        fused.zero_grad(set_to_none=True)
        loss.backward()
        assert none is None
        tol = 1e-5 if amp is None else 3e-2  # bf16: to rounding of the bf16 matmuls
        assert abs(loss.item() - ref.item()) <= tol * ref.item()
        for name, p in fused.named_parameters():
            r = ref_grads[name]
            assert (p.grad - r).abs().max() <= tol * r.abs().max() + 1e-9, (amp, name)


# ----------------------------------------------------------------------------------------------
# Training


@pytest.fixture(scope="module")
def data_dir(char_data) -> Path:
    return char_data(30_000)


def _losses(run: Path) -> dict[str, list[float]]:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {k: [r[k] for r in recs if k in r] for k in ("loss", "val_loss")}


@pytest.mark.parametrize("dtype,tol", [("fp32", 1e-5), ("bf16", 2e-2)])
def test_training_steps_with_the_fused_loss_follow_the_plain_head(data_dir, tmp_path, dtype, tol):
    """6 steps (validation at 3 and 6): the same losses, fp32 to rounding, bf16 closely."""
    runs = {}
    for fused in (False, True):
        out = tmp_path / f"fused-{fused}"
        make_trainer(data_dir, out, dtype=dtype, fused_loss=fused, max_steps=6, eval_interval=3,
                     checkpoint_interval=3).run()  # fmt: skip
        runs[fused] = _losses(out)
    assert len(runs[True]["loss"]) == 6 and len(runs[True]["val_loss"]) == 2
    for key in ("loss", "val_loss"):
        for a, b in zip(runs[True][key], runs[False][key], strict=True):
            assert abs(a - b) <= tol * b, (key, runs)


def test_lora_training_with_a_frozen_head_and_the_fused_loss(data_dir, tmp_path):
    """LoRA on the blocks freezes the head: its gradient is not computed, the run trains."""
    for fused in (False, True):
        make_trainer(data_dir, tmp_path / f"{fused}", max_steps=4, lora_r=2, fused_loss=fused).run()
    a, b = _losses(tmp_path / "True")["loss"], _losses(tmp_path / "False")["loss"]
    assert len(a) == 4
    for x, y in zip(a, b, strict=True):
        assert abs(x - y) <= 1e-5 * y


# ----------------------------------------------------------------------------------------------
# Memory: the peak resident memory of the head's forward + backward, each path in its own process

MEASURE = textwrap.dedent(
    """
    import json, sys
    import torch, torch.nn.functional as F
    from llm_foundry.models.loss import linear_cross_entropy
    torch.set_num_threads(1)
    kind = sys.argv[1]
    fused = kind != "plain"
    # compiled: 32 chunks of 64 rows under bf16 autocast, unrolled in one graph (Inductor once
    # fused the fp32 additions of their bf16 grad W products into one kernel that held all 32
    # products at once)
    step = linear_cross_entropy
    if kind == "compiled":
        step = torch.compile(linear_cross_entropy, fullgraph=True)
    rows = 64 if kind == "compiled" else 128
    size = (2048, 64, 16384) if kind == "compiled" else (2048, 64, 8192)
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=kind == "compiled")
    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    def run(n, d, v):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(n, d, generator=g).requires_grad_()
        w = (torch.randn(v, d, generator=g) * 0.02).requires_grad_()
        t = torch.randint(0, v, (n,), generator=g)
        with amp:
            if fused:
                loss = step(x, w, t, chunk_rows=rows)
            else:
                loss = F.cross_entropy(F.linear(x, w).float(), t)
        loss.backward()
    # kernels, thread pools (and the compiled code, for the same shapes) set up
    run(*(size if kind == "compiled" else (256, 64, 256)))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from what is resident now
    before = status("VmRSS")
    run(*size)
    print(json.dumps(status("VmHWM") - before))
    """
)


def _peak_bytes(kind: str, tmp_path: Path) -> int:
    script = tmp_path / "measure.py"
    script.write_text(MEASURE)
    src = str(Path(__file__).resolve().parents[1] / "src")
    # every allocation above 64 KiB its own mapping, returned when freed: the peak is what was
    # alive at once, not what the allocator kept
    env = dict(os.environ, PYTHONPATH=src, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
    r = subprocess.run([sys.executable, str(script), kind], env=env, capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc")
def test_the_fused_loss_peaks_far_below_the_logits(tmp_path):
    """2048 rows x 8192 vocabulary: the plain head's fp32 logits alone are 64 MiB (and it holds
    them, their softmax and their gradient); the fused head's chunks of 128 rows are 4 MiB, plus
    its inputs and gradients (x, W: 2.5 MiB each). Each path in a fresh process, its peak resident
    memory reset (Linux's clear_refs) after a small warm-up run."""
    logits = 2048 * 8192 * 4
    plain = _peak_bytes("plain", tmp_path)
    fused = _peak_bytes("fused", tmp_path)
    print(f"peak growth: plain {plain / 2**20:.1f} MiB, fused {fused / 2**20:.1f} MiB")
    assert plain >= 2 * logits  # the measurement sees the logits and their softmax
    assert 0 < fused <= logits / 2


@pytest.mark.heavy  # a torch.compile build of 32 unrolled chunks
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc")
def test_the_compiled_fused_loss_holds_one_chunk_at_a_time(tmp_path):
    """2048 rows, vocabulary 16384, bf16: 32 chunks' (16384, 64) bf16 products of grad W would
    be 64 MiB alive at once; one chunk's logits, fp32 copy and gradient are 8 MiB."""
    compiled = _peak_bytes("compiled", tmp_path)
    print(f"peak growth: compiled fused {compiled / 2**20:.1f} MiB")
    assert 0 < compiled <= 2048 * 16384 * 4 / 4  # a quarter of the fp32 logits: 32 MiB


# ----------------------------------------------------------------------------------------------
# Two ranks (torchrun, gloo): the fused loss's gradients reach DDP's all-reduce and FSDP2's
# reduce-scatter as the plain head's do, the tied head's added to the embedding's

RANKS_MODEL = dict(dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_seq_len=16)
RANKS_TRAIN = dict(block_size=16, max_steps=6, warmup_steps=2, eval_interval=3, eval_batches=2,
                   checkpoint_interval=6, sample_tokens=0, progress=False)  # fmt: skip


@pytest.mark.heavy  # torchrun launches
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_with_the_fused_loss_give_one_plain_processs_losses(parallel, data_dir, tmp_path):
    from llm_foundry.presets import get_preset
    from llm_foundry.train.trainer import Trainer

    preset = "gpt2-shakespeare-char"  # tied embeddings
    assert get_preset(preset).tie_embeddings
    ref = tmp_path / "one"
    tc = TrainConfig(**RANKS_TRAIN, batch_size=8)
    Trainer(get_preset(preset, **RANKS_MODEL), tc, data_dir, ref).run()
    run = tmp_path / parallel
    flags = ["--preset", preset] + [f"--model.{k}={v}" for k, v in RANKS_MODEL.items()]
    train = {**RANKS_TRAIN, "batch_size": 4, "parallel": parallel, "fused_loss": True}
    flags += [
        f"--train.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in train.items()
    ]
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=src)
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    r = subprocess.run(launch + ["-m", "llm_foundry", "train", "--data", str(data_dir), "--out",
                                 str(run), *flags],
                       env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    got, want = _losses(run), _losses(ref)
    assert len(got["loss"]) == 6 and len(got["val_loss"]) == 2
    for key in ("loss", "val_loss"):
        for a, b in zip(got[key], want[key], strict=True):
            assert abs(a - b) <= 2e-4, (key, got, want)
