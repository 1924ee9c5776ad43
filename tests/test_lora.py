"""LoRA: the adapted model starts as its base, merge/unmerge/fold, only adapters train; a frozen base
held in bf16 or int8 computes what fp32 LoRA on the rounded weights does; adapters in PEFT's
format go both ways with the ``peft`` package (ours onto the HF export, peft's onto ours)."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
from conftest import tiny_hf_llama

from llm_foundry.models import Transformer
from llm_foundry.models.lora import (
    BASE_DTYPES,
    FrozenLinear,
    LoRALinear,
    adapters_disabled,
    add_lora,
    dequantize_int8,
    effective_weight,
    fold_lora,
    frozen_base_bytes,
    lora_layers,
    merge_lora,
    quantize_int8,
    unmerge_lora,
)
from llm_foundry.models.nf4 import GRIDS, dequantize_4bit, quantize_4bit

TOL = 1e-4


def _randomise(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for lora in lora_layers(model).values():
            lora.lora_A.copy_(torch.randn(lora.lora_A.shape, generator=g) * 0.3)
            lora.lora_B.copy_(torch.randn(lora.lora_B.shape, generator=g) * 0.3)


def test_an_adapted_model_starts_as_its_base_and_merges_exactly(tiny_config):
    torch.manual_seed(0)
    model = Transformer(tiny_config(n_kv_heads=2)).eval()
    idx = torch.randint(0, 37, (2, 9))
    base = model(idx)[0]
    names = add_lora(model, ("wq", "wv", "w2", "lm_head"), r=4, alpha=8)
    assert len(names) == 2 * 3 + 1
    torch.testing.assert_close(model(idx)[0], base, atol=0, rtol=0)  # B starts at zero
    _randomise(model)
    adapted = model(idx)[0]
    assert (adapted - base).abs().max() > 1e-2
    # by hand for one projection: W x + (alpha / r) B A x
    lora = lora_layers(model)["layers.0.attn.wq"]
    x = torch.randn(3, 32)
    want = x @ lora.base.weight.T + (8 / 4) * (x @ lora.lora_A.T @ lora.lora_B.T)
    torch.testing.assert_close(lora(x), want, atol=1e-5, rtol=1e-5)
    merge_lora(model)
    torch.testing.assert_close(model(idx)[0], adapted, atol=1e-5, rtol=1e-5)
    unmerge_lora(model)
    torch.testing.assert_close(model(idx)[0], adapted, atol=1e-5, rtol=1e-5)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{n}.lora_{ab}" for n in names for ab in "AB"}


def test_adapters_disabled_computes_the_base_alone_and_then_the_adapters_again(tiny_config):
    torch.manual_seed(0)
    model = Transformer(tiny_config()).eval()
    idx = torch.randint(0, 37, (2, 9))
    base = model(idx)[0]
    add_lora(model, ("wq", "w2"), r=2, alpha=4, base_dtype="int8")
    int8_base = model(idx)[0]  # the rounded base (B is zero)
    _randomise(model)
    adapted = model(idx)[0]
    assert (adapted - int8_base).abs().max() > 1e-2
    with adapters_disabled(model):
        torch.testing.assert_close(model(idx)[0], int8_base, atol=0, rtol=0)
        with adapters_disabled(model):  # nested: the outer one still holds after the inner
            pass
        torch.testing.assert_close(model(idx)[0], int8_base, atol=0, rtol=0)
    torch.testing.assert_close(model(idx)[0], adapted, atol=0, rtol=0)
    assert (int8_base - base).abs().max() > 0  # the int8 base is not the fp32 one
    merge_lora(model)
    with pytest.raises(ValueError, match="merged into their base"):
        with adapters_disabled(model):
            pass


def test_training_moves_only_the_adapters(tiny_config):
    torch.manual_seed(0)
    model = Transformer(tiny_config())
    add_lora(model, ("wq", "wk", "wv", "wo"), r=2, alpha=4)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    idx = torch.randint(0, 37, (4, 12))
    for _ in range(3):
        loss = model(idx, idx)[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(".lora_" in n for n in changed)
    assert any(".lora_A" in n for n in changed) and any(".lora_B" in n for n in changed)


def test_bad_lora_settings_are_named(tiny_config):
    with pytest.raises(ValueError, match=r"LoRA targets \['q_proj'\] are not among"):
        add_lora(Transformer(tiny_config()), ("q_proj",))
    with pytest.raises(ValueError, match="lm_head is tied to the token embedding"):
        add_lora(Transformer(tiny_config(tie_embeddings=True)), ("lm_head",))
    with pytest.raises(ValueError, match="rank r=0"):
        add_lora(Transformer(tiny_config()), ("wq",), r=0)
    with pytest.raises(ValueError, match="LoRA base_dtype='fp4' must be one of fp32, bf16, int8, "
                       "nf4, int4"):  # fmt: skip
        add_lora(Transformer(tiny_config()), ("wq",), base_dtype="fp4")


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(lora_r=4, lora_base_dtype="fp4"), "lora_base_dtype='fp4' is not one of fp32, bf16, "
         "int8, nf4, int4"),
        (dict(lora_base_dtype="int8"), "lora_base_dtype='int8' holds the adapted projections' "
         "frozen weights: it needs lora_r > 0"),
        (dict(lora_r=4, lora_base_dtype="bf16", parallel="fsdp"), "lora_base_dtype='bf16' with "
         "parallel='fsdp': FSDP2 shards parameters of one dtype only; use parallel=ddp"),
    ],
)  # fmt: skip
def test_bad_base_dtypes_are_named_in_one_line(fields, message):
    from llm_foundry.config import ConfigError
    from llm_foundry.train.config import TrainConfig

    with pytest.raises(ConfigError, match="1 problem") as e:
        TrainConfig(**fields)
    assert e.value.problems == [e.value.problems[0]] and e.value.problems[0].startswith(message)


# ----------------------------------------------------------------------------------------------
# The frozen base held in bf16 or int8


def _rounded(w: torch.Tensor, base_dtype: str) -> torch.Tensor:
    """``w`` (out, in) as a base held in ``base_dtype`` computes with it, in fp32."""
    if base_dtype == "int8":
        return dequantize_int8(*quantize_int8(w))
    if base_dtype in GRIDS:  # nf4, int4: models/nf4.py (checked against bitsandbytes there)
        return dequantize_4bit(quantize_4bit(w, base_dtype), w.shape, base_dtype)
    return w.to(torch.bfloat16).float() if base_dtype == "bf16" else w


def test_int8_quantization_is_within_half_a_step_of_each_row():
    g = torch.Generator().manual_seed(0)
    # rows of very different sizes, one with an outlier, one all zero
    w = torch.randn(6, 50, generator=g) * torch.tensor([1e-4, 1e-2, 1.0, 30.0, 1.0, 0.0])[:, None]
    w[4, 7] = 25.0
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and q.shape == (6, 50)
    assert scale.dtype == torch.float32 and scale.shape == (6,)
    assert int(q.abs().max()) == 127 and (q[5] == 0).all()  # symmetric: -128 is never used
    torch.testing.assert_close(scale[:5], w[:5].abs().amax(1) / 127, rtol=1e-6, atol=0)
    err = (w - dequantize_int8(q, scale)).abs()
    # half a step, plus fp32 rounding of w / scale and q * scale (~127 ulps of the step)
    bound = scale[:, None] * (0.5 + 1e-5)
    assert (err <= bound).all(), (err / scale[:, None]).max()
    assert (err[2:4] > 0.4 * scale[2:4, None]).any()  # the bound is the real one, not slack


LOW = {"bf16": torch.bfloat16, "int8": torch.int8, "nf4": torch.uint8, "int4": torch.uint8}


@pytest.mark.parametrize("base_dtype", LOW)
def test_a_low_precision_base_computes_what_fp32_lora_on_the_rounded_weight_does(base_dtype):
    """The reference is the same math in fp32: LoRALinear whose base weight is the dequantized
    (int8, nf4, int4) or bf16-rounded weight. Outputs and the gradients of x, A and B agree."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 24, bias=True)
    low = LoRALinear(copy.deepcopy(linear), 4, 8.0, 0.0, False, base_dtype)
    ref = LoRALinear(copy.deepcopy(linear), 4, 8.0, 0.0, False)
    with torch.no_grad():
        low.lora_B.normal_(0.0, 0.3)
        ref.base.weight.copy_(_rounded(linear.weight, base_dtype))
        ref.lora_A.copy_(low.lora_A)
        ref.lora_B.copy_(low.lora_B)
    assert low.base.weight.dtype == LOW[base_dtype]
    assert low.base.bias.dtype == torch.float32
    torch.testing.assert_close(low.base.widened(), ref.base.weight, atol=0, rtol=0)
    x = torch.randn(3, 5, 48, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = low(x), ref(x_ref)
    torch.testing.assert_close(y, y_ref, atol=1e-6, rtol=1e-5)
    (y.square().sum()).backward()
    (y_ref.square().sum()).backward()
    for got, want in ((x.grad, x_ref.grad), (low.lora_A.grad, ref.lora_A.grad),
                      (low.lora_B.grad, ref.lora_B.grad)):  # fmt: skip
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert low.base.weight.grad is None and low.base.bias.grad is None
    # under bf16 autocast it computes in bf16 (the reference's bf16 rounding, ~1e-2 relative)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y16 = low(x)
    assert y16.dtype == torch.bfloat16
    torch.testing.assert_close(y16.float(), y_ref, atol=5e-2, rtol=5e-2)
    # merged: an fp32 weight, exactly widen(W) + s·B A, and the same outputs
    low.merge()
    assert low.base.weight.dtype == torch.float32 and low.base_dtype == "fp32"
    torch.testing.assert_close(low.base.weight, ref.base.weight + ref.delta(), atol=0, rtol=0)
    torch.testing.assert_close(low(x), y_ref, atol=1e-5, rtol=1e-5)
    low.unmerge()
    torch.testing.assert_close(low(x), y_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("base_dtype", BASE_DTYPES)
def test_effective_weight_is_the_weight_each_projection_computes_with(base_dtype):
    """``effective_weight`` of an nn.Linear, a FrozenLinear and a LoRALinear (merged or not) is
    the W with module(x) == x W^T + b: the base widened to fp32 (int8 dequantized) plus s·B A."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 24, bias=True)
    lora = LoRALinear(copy.deepcopy(linear), 4, 8.0, 0.0, False, base_dtype)
    with torch.no_grad():
        lora.lora_B.normal_(0.0, 0.3)
    x = torch.randn(3, 5, 48)
    with torch.no_grad():
        assert effective_weight(linear) is linear.weight
        held = _rounded(linear.weight, base_dtype)
        if base_dtype != "fp32":
            assert isinstance(lora.base, FrozenLinear)
            assert torch.equal(effective_weight(lora.base), held)
            assert effective_weight(lora.base).dtype == torch.float32
        w = effective_weight(lora)
        assert w.dtype == torch.float32 and w.shape == (24, 48)
        torch.testing.assert_close(w, held + lora.delta(), atol=0, rtol=0)
        assert not torch.allclose(w, held, atol=1e-3)  # the update is in it
        want = lora(x)
        torch.testing.assert_close(x @ w.T + linear.bias, want, atol=1e-5, rtol=1e-5)
        lora.merge()
        torch.testing.assert_close(effective_weight(lora), w, atol=1e-6, rtol=0)
        torch.testing.assert_close(x @ effective_weight(lora).T + linear.bias, want,
                                   atol=1e-5, rtol=1e-5)  # fmt: skip
        lora.unmerge()
        torch.testing.assert_close(effective_weight(lora), w, atol=1e-6, rtol=0)


@pytest.mark.parametrize("base_dtype", LOW)
def test_only_the_adapted_projections_are_held_low_and_only_adapters_train(base_dtype, tiny_config):
    torch.manual_seed(0)
    model = Transformer(tiny_config())
    plain = {n: p.detach().clone() for n, p in model.named_parameters()}
    names = add_lora(model, ("wq", "w2"), r=2, alpha=4, base_dtype=base_dtype)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{n}.lora_{ab}" for n in names for ab in "AB"}
    low = {f"{n}.base.weight" for n in names}
    for n, p in model.named_parameters():
        if n in low:
            assert p.dtype == LOW[base_dtype], n
        else:
            assert p.dtype == torch.float32, n
            assert n.endswith(("lora_A", "lora_B")) or torch.equal(
                p, plain[n.replace(".base.", ".")]
            ), n
    assert model.num_params() == sum(p.numel() for p in plain.values()) + sum(
        p.numel() for n, p in model.named_parameters() if p.requires_grad
    )  # the frozen weights are counted whatever they are held in (4-bit: two a byte)
    # one optimizer step moves the adapters only, and the loss goes down on that batch
    _randomise(model)
    idx = torch.randint(0, 37, (4, 12))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    before = model(idx, idx)[1]
    before.backward()
    opt.step()
    assert model(idx, idx)[1] < before


@pytest.mark.heavy  # four fine-tunes, ~2 minutes
def test_a_fine_tune_on_a_low_precision_base_learns_as_fp32_and_holds_less(
    char_data, tmp_path, capsys
):
    """The same fine-tune (adapters on wq, w2 and lm_head) with the base held in fp32, bf16,
    int8 and nf4: every one lowers the validation loss about as much, and the adapted
    projections' frozen weights, measured from the tensors (and printed at the start), take 1/2
    (bf16), ~1/4 (int8, plus one fp32 scale per row) and ~4.127/32 (nf4: 4 bits, one
    8-bit constant per 64 weights, 8 bytes per 256 constants) of fp32's bytes."""
    from conftest import make_trainer

    from llm_foundry.accounting import human
    from llm_foundry.checkpoint import load_checkpoint
    from llm_foundry.cli import main
    from llm_foundry.rundir import latest_checkpoint

    data = char_data(60_000)
    make_trainer(data, tmp_path / "base").run()
    base = latest_checkpoint(tmp_path / "base" / "checkpoints")
    held, val = {}, {}
    for base_dtype in ("fp32", "bf16", "int8", "nf4"):  # int4: nf4's layout, another grid
        capsys.readouterr()
        out = tmp_path / base_dtype
        argv = ["finetune", "--checkpoint", str(base), "--data", str(data), "--out", str(out)]
        argv += ["--train.lora_r", "4", "--train.lora_targets", "wq,w2,lm_head"]
        argv += ["--train.lora_base_dtype", base_dtype, "--train.lr", "1e-2"]
        argv += ["--train.batch_size", "4"]
        argv += ["--train.block_size", "32", "--train.max_steps", "16", "--train.eval_interval",
                 "4", "--train.eval_batches", "4", "--train.warmup_steps", "2",
                 "--train.sample_tokens", "0", "--train.progress", "false"]  # fmt: skip
        assert main(argv) == 0
        printed = capsys.readouterr().out
        model = load_checkpoint(base)
        add_lora(model, ("wq", "w2", "lm_head"), r=4, base_dtype=base_dtype)
        held[base_dtype], fp32 = frozen_base_bytes(model)
        # the fp32 size beside a low-precision base's (an fp32 base's is said once)
        low = f" (fp32: {human(fp32, 'B')})" if base_dtype != "fp32" else ""
        assert f"projections {human(held[base_dtype], 'B')} {base_dtype}{low}\n" in printed
        recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        val[base_dtype] = [r["val_loss"] for r in recs if "val_loss" in r]
    print({k: (v, f"{v / held['fp32']:.3f}") for k, v in held.items()}, val)
    assert all(v[-1] < v[0] - 0.1 for v in val.values()), val  # measured: 3.71 -> 3.43
    assert abs(val["int8"][-1] - val["fp32"][-1]) < 0.05, val  # measured: 8e-4 apart
    assert held["bf16"] * 2 == held["fp32"]
    layers = lora_layers(model).values()
    assert held["int8"] == held["fp32"] // 4 + sum(4 * m.base.out_features for m in layers)
    assert 0.25 < held["int8"] / held["fp32"] < 0.3
    # 4-bit: from the shapes, blocks of 64 weights: 32 bytes of codes + 1 byte of absmax each,
    # an fp32 scale per 256 blocks and one fp32 offset per weight; the biases as they were
    blocks = [-(m.base.in_features * m.base.out_features // -64) for m in layers]
    biases = sum(m.base.bias.nbytes for m in layers if m.base.bias is not None)
    want = sum(33 * b + 4 * -(b // -256) + 4 for b in blocks) + biases
    assert held["nf4"] == want, (held, want)
    assert 0.125 < held["nf4"] / held["fp32"] < 0.135
    assert abs(val["nf4"][-1] - val["int8"][-1]) < 0.05, val


# ----------------------------------------------------------------------------------------------
# Fine-tuning a checkpoint with adapters


def _losses(run):
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs if "loss" in r]


@pytest.mark.parametrize("base_dtype", BASE_DTYPES)
def test_lora_fine_tuning_starts_from_the_checkpoint_trains_adapters_and_resumes(
    base_dtype, char_data, tmp_path
):
    from conftest import make_trainer

    from llm_foundry.checkpoint import load_checkpoint
    from llm_foundry.config import ConfigError
    from llm_foundry.data import BatchSampler, load_split
    from llm_foundry.rundir import latest_checkpoint
    from llm_foundry.train.state import write_json_atomic

    data = char_data(60_000)
    base_run = tmp_path / "base"
    make_trainer(data, base_run).run()
    base = latest_checkpoint(base_run / "checkpoints")
    lora = dict(init_from=str(base), lora_r=4, lora_alpha=8.0, lora_targets="wq,wv,w2",
                lora_base_dtype=base_dtype)  # fmt: skip
    adapted = ("attn.wq", "attn.wv", "mlp.w2")
    tuner = make_trainer(data, tmp_path / "ft", max_steps=8, checkpoint_interval=4, **lora)
    assert {n for n, p in tuner.model.named_parameters() if p.requires_grad} == {
        f"layers.{i}.{m}.lora_{ab}" for i in range(2) for m in adapted for ab in "AB"
    }  # fmt: skip
    # the adapters start at zero: the first step's loss is the base model's on that batch (the
    # sampler's first batch; dropout draws the same masks after the same seed), its adapted
    # projections rounded as the run holds them
    x, y = BatchSampler(load_split(data, "train"), 32, 4, seed=tuner.tc.seed).next()
    reference = load_checkpoint(base).train()
    with torch.no_grad():
        for name, m in reference.named_modules():
            if name.endswith(adapted):
                m.weight.copy_(_rounded(m.weight, base_dtype))
    torch.manual_seed(0)
    tuner.run()
    first = _losses(tmp_path / "ft")[0]
    torch.manual_seed(0)
    assert first == pytest.approx(reference(x, y)[1].item(), abs=1e-5)
    # the base weights are untouched (held as chosen: bf16, or int8 + scales, of the start
    # weights); the saved run loads with its adapters merged
    tuned = load_checkpoint(latest_checkpoint(tmp_path / "ft" / "checkpoints"), merge=False)
    saved = tuned.state_dict()
    for name, p in load_checkpoint(base).state_dict().items():
        if not name.endswith(tuple(f"{m}.weight" for m in adapted)):
            assert torch.equal(saved[name], p), name
        elif base_dtype == "int8":
            q, scale = quantize_int8(p)
            key = name.replace(".weight", ".base.weight")
            assert torch.equal(saved[key], q) and torch.equal(saved[key + "_scale"], scale), name
        elif base_dtype in GRIDS:
            key = name.replace(".weight", ".base.weight")
            packed, codes, scale, offset = quantize_4bit(p, base_dtype)
            assert torch.equal(saved[key], packed), name
            assert torch.equal(saved[key + "_absmax"], codes), name
            assert torch.equal(saved[key + "_absmax_scale"], scale), name
            assert torch.equal(saved[key + "_absmax_offset"], offset), name
        else:
            want = p.to(torch.bfloat16) if base_dtype == "bf16" else p
            assert torch.equal(saved[name.replace(".weight", ".base.weight")], want), name
    assert any(lora.lora_B.abs().max() > 0 for lora in lora_layers(tuned).values())
    # merged (as generate and every export load it): a plain model again, with the names of one
    # that never had adapters, its fp32 weights widen(W) + s·B A
    merged = load_checkpoint(latest_checkpoint(tmp_path / "ft" / "checkpoints"))
    assert not lora_layers(merged)
    assert set(merged.state_dict()) == set(load_checkpoint(base).state_dict())
    for name, m in lora_layers(tuned).items():
        widened = m.base.weight if base_dtype == "fp32" else m.base.widened()
        folded = merged.get_submodule(name)
        assert isinstance(folded, torch.nn.Linear)
        assert folded.weight.dtype == torch.float32
        torch.testing.assert_close(folded.weight, widened + m.delta(), atol=1e-6, rtol=0)
    # a crash after step 4, resumed: the same losses as the uninterrupted fine-tuning
    cut = tmp_path / "cut"
    import shutil

    shutil.copytree(tmp_path / "ft", cut)
    shutil.rmtree(cut / "checkpoints" / "step_000008")
    write_json_atomic(cut / "checkpoints" / "latest.json", {"step": 4, "path": "step_000004"})
    other = "int8" if base_dtype != "int8" else "fp32"
    with pytest.raises(ConfigError, match=f"lora_base_dtype: saved '{base_dtype}', now '{other}'"):
        make_trainer(data, cut, resume=True, **{**lora, "lora_base_dtype": other})
    make_trainer(data, cut, resume=True, max_steps=8, checkpoint_interval=4, **lora).run()
    assert _losses(cut) == _losses(tmp_path / "ft")


# ----------------------------------------------------------------------------------------------
# PEFT's format, checked with the peft package

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from llm_foundry.interop.hf import ConversionError, from_hf  # noqa: E402
from llm_foundry.interop.peft import load_adapter, save_adapter  # noqa: E402


@torch.no_grad()
def _hf_logits(model, x):
    return model(input_ids=x).logits


@pytest.mark.parametrize("rslora", [False, True])
def test_our_adapter_loads_in_peft_with_the_same_logits(rslora, tmp_path):
    hf = tiny_hf_llama()
    ours = from_hf(hf)
    add_lora(ours, ("wq", "wv", "w2", "lm_head"), r=4, alpha=12, rslora=rslora)
    _randomise(ours, seed=1)
    save_adapter(ours, tmp_path / "adapter", base="a random llama")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["down_proj", "lm_head", "q_proj", "v_proj"]
    with_adapter = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
    x = torch.randint(0, 61, (2, 11))
    diff = (_hf_logits(with_adapter, x) - ours(x)[0]).abs().max().item()
    assert diff <= TOL, diff
    assert (_hf_logits(with_adapter, x) - _hf_logits(tiny_hf_llama(), x)).abs().max() > 1e-2


def test_a_peft_adapter_loads_onto_our_model_with_the_same_logits(tmp_path):
    hf = tiny_hf_llama()
    ours = from_hf(hf)
    config = peft.LoraConfig(
        r=3, lora_alpha=7, target_modules=["k_proj", "o_proj", "gate_proj", "up_proj"],
        use_rslora=True, lora_dropout=0.1,
    )  # fmt: skip
    with_adapter = peft.get_peft_model(hf, config)
    with torch.no_grad():
        for name, p in with_adapter.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)
    with_adapter.save_pretrained(str(tmp_path / "adapter"))
    adapted = load_adapter(ours, tmp_path / "adapter")
    assert len(adapted) == 2 * 4
    ours.eval()
    with_adapter.eval()
    x = torch.randint(0, 61, (2, 11))
    diff = (_hf_logits(with_adapter, x) - ours(x)[0]).abs().max().item()
    assert diff <= TOL, diff
    merge_lora(ours)  # merged weights compute the same
    assert (_hf_logits(with_adapter, x) - ours(x)[0]).abs().max().item() <= TOL


def test_adapters_peft_cannot_name_or_that_change_the_math_are_refused(tmp_path):
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=61, n_embd=32, n_layer=1, n_head=2, n_positions=32)
    )
    ours = from_hf(gpt2)
    add_lora(ours, ("wq",), r=2)
    with pytest.raises(
        ConversionError, match=r"layers\.0\.attn\.wq: HF stores this projection fused"
    ):
        save_adapter(ours, tmp_path / "gpt2")
    llama = from_hf(tiny_hf_llama())
    add_lora(llama, ("wq",), r=2)
    save_adapter(llama, tmp_path / "dora")
    file = tmp_path / "dora" / "adapter_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), "use_dora": True}))
    with pytest.raises(ConversionError, match="use_dora=True is not supported"):
        load_adapter(from_hf(tiny_hf_llama()), tmp_path / "dora")


def test_params_lora_view_counts_what_peft_trains(capsys):
    from llm_foundry.accounting import lora_report
    from llm_foundry.cli import main
    from llm_foundry.interop.hf import config_from_hf

    hf = tiny_hf_llama()
    cfg = config_from_hf(hf.config)
    targets = {"wq": "q_proj", "wv": "v_proj", "w2": "down_proj"}
    peft_model = peft.get_peft_model(
        hf, peft.LoraConfig(r=8, target_modules=list(targets.values()))
    )
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    rep = lora_report(cfg, 8, list(targets))
    assert rep["trainable"] == trainable and set(rep["targets"]) == set(targets)
    assert (
        main(["params", "--preset", "llama2-7b", "--lora-r", "8", "--lora-targets", "wq,wv"]) == 0
    )
    out = capsys.readouterr().out  # 32 layers x 2 matrices x r (4096 in + 4096 out)
    assert "LoRA r=8" in out and f"{32 * 2 * 8 * (4096 + 4096):,}  (0.062% of the model)" in out


def test_adapters_on_shared_experts_change_the_output_and_merge_exactly(tiny_config):
    """A mixture of experts' shared MLP is plain linear layers: LoRA adapts it like any MLP."""
    torch.manual_seed(0)
    cfg = tiny_config(n_experts=4, experts_per_token=2, expert_hidden_dim=16, n_shared_experts=1)
    model = Transformer(cfg).eval()
    idx = torch.randint(0, 37, (2, 9))
    base = model(idx)[0]
    names = add_lora(model, ("w1", "w2", "w3"), r=2, alpha=4)
    assert {n.rpartition(".")[0] for n in names} == {
        f"layers.{i}.mlp.shared" for i in range(cfg.n_layers)
    }
    _randomise(model)
    adapted = model(idx)[0]
    assert (adapted - base).abs().max() > 1e-2
    merge_lora(model)
    torch.testing.assert_close(model(idx)[0], adapted, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------
# Adapters that would compute nothing useful are refused before anything is built


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"lora_alpha": float("nan")}, "alpha=nan must be a finite number"),
        ({"lora_alpha": "16"}, "alpha='16' must be a finite number"),
        ({"r": 0}, "rank r=0 must be a positive integer"),
        ({"r": 2.5}, "rank r=2.5 must be a positive integer"),
        ({"lora_dropout": 1.5}, "dropout=1.5 must be in [0, 1)"),
    ],
)
def test_an_adapter_config_out_of_range_is_one_line(change, needle, tmp_path):
    ours = from_hf(tiny_hf_llama())
    add_lora(ours, ("wq",), r=2)
    save_adapter(ours, tmp_path / "adapter")
    file = tmp_path / "adapter" / "adapter_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **change}))
    with pytest.raises(ValueError) as e:
        load_adapter(from_hf(tiny_hf_llama()), tmp_path / "adapter")
    assert needle in str(e.value)
    file.write_text("[1, 2]")
    with pytest.raises(ValueError, match="holds list, not an adapter config object"):
        load_adapter(from_hf(tiny_hf_llama()), tmp_path / "adapter")


def test_an_adapter_with_non_finite_tensors_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    ours = from_hf(tiny_hf_llama())
    add_lora(ours, ("wq", "wv"), r=2)
    save_adapter(ours, tmp_path / "adapter")
    file = tmp_path / "adapter" / "adapter_model.safetensors"
    tensors = load_file(str(file))
    key = sorted(k for k in tensors if "lora_B" in k)[0]
    tensors[key][0, 0] = float("inf")
    save_file(tensors, str(file))
    with pytest.raises(ValueError, match=rf"tensor {re.escape(key)} holds 1 non-finite"):
        load_adapter(from_hf(tiny_hf_llama()), tmp_path / "adapter")


def test_a_rank_above_the_projections_rank_is_refused_before_allocating(tiny_config):
    model = Transformer(tiny_config())
    with pytest.raises(ValueError, match=r"r=1,000,000 exceeds the rank 32 of layers\.0\.attn"):
        add_lora(model, ("wq", "wv"), r=1_000_000)
    assert not lora_layers(model)  # nothing was built
    assert len(add_lora(model, ("wq", "wv"), r=32)) == 2 * 2  # min(in, out) itself is fine


def test_finetune_with_an_absurd_rank_is_one_line_before_allocating(char_data, tmp_path, capsys):
    from llm_foundry.cli import main

    small = ["--model.n_layers", "1", "--model.dim", "32", "--model.n_heads", "2"]
    steps = ["--train.batch_size", "2", "--train.block_size", "16", "--train.eval_batches", "1",
             "--train.sample_tokens", "0", "--train.progress", "false"]  # fmt: skip
    base = tmp_path / "base"
    argv = ["train", "--data", str(char_data(20_000)), "--out", str(base), *small, *steps]
    assert main([*argv, "--train.max_steps", "1"]) == 0
    argv = ["finetune", "--checkpoint", str(base), "--data", str(char_data(20_000)),
            "--out", str(tmp_path / "ft"), *steps, "--train.max_steps", "1"]  # fmt: skip
    capsys.readouterr()
    assert main([*argv, "--train.lora_r", "1000000"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "r=1,000,000 exceeds the rank 32" in err, err


def test_folding_gives_a_plain_model_computing_the_merged_function(tiny_config):
    torch.manual_seed(0)
    model = Transformer(tiny_config()).eval()
    plain_names = set(model.state_dict())
    add_lora(model, ("wq", "w2"), r=4, base_dtype="int8")
    _randomise(model, seed=3)
    idx = torch.randint(0, 37, (2, 9))
    adapted = model(idx)[0]
    folded = fold_lora(model)
    assert len(folded) == 2 * 2 and not lora_layers(model)
    assert set(model.state_dict()) == plain_names  # what every export reads
    torch.testing.assert_close(model(idx)[0], adapted, atol=1e-5, rtol=1e-5)


def _loads_as_tuned(tuned, base, adapter):
    """Save ``tuned`` (a LoRA model) at ``adapter``: ``load_any(base, adapter=adapter)`` must
    compute what it computes. Returns what was loaded (model, tokenizer, info)."""
    from llm_foundry.checkpoint import save_checkpoint
    from llm_foundry.loading import load_any

    save_checkpoint(tuned, adapter)
    idx = torch.randint(0, 37, (2, 9))
    with torch.no_grad():
        want = tuned(idx)[0]
        loaded = load_any(base, adapter=adapter)
        torch.testing.assert_close(loaded.model(idx)[0], want, atol=1e-5, rtol=1e-5)
    return loaded


def test_a_lora_checkpoint_as_adapter_goes_on_its_base_and_no_other(tiny_config, tmp_path):
    from llm_foundry.checkpoint import save_checkpoint
    from llm_foundry.loading import load_any

    torch.manual_seed(0)
    base = Transformer(tiny_config()).eval()
    save_checkpoint(base, tmp_path / "base")
    tuned = copy.deepcopy(base)
    add_lora(tuned, ("wq", "w3"), r=4, alpha=8)
    _randomise(tuned, seed=2)
    model, _, info = _loads_as_tuned(tuned, tmp_path / "base", tmp_path / "tuned")
    assert not lora_layers(model) and "of " + str(tmp_path / "tuned") in info.merged_note()
    assert "rounded" not in info.merged_note()
    # adapters fitted to an nf4-rounded base go on the full-precision one, and the line says so
    on_nf4 = copy.deepcopy(base)
    add_lora(on_nf4, ("wq", "w3"), r=4, alpha=8, base_dtype="nf4")
    _randomise(on_nf4, seed=3)
    save_checkpoint(on_nf4, tmp_path / "on-nf4")
    _, _, info = load_any(tmp_path / "base", adapter=tmp_path / "on-nf4")
    assert "(trained over the nf4-rounded base, put on this one)" in info.merged_note()
    save_checkpoint(Transformer(tiny_config(dim=64)), tmp_path / "wider")
    with pytest.raises(ValueError, match=r"trained on another model \(dim: 32 there, 64 here"):
        load_any(tmp_path / "wider", adapter=tmp_path / "tuned")
    # a LoRA run's adapters over itself merged: over other weights than their base, said so
    _, _, info = load_any(tmp_path / "tuned", adapter=tmp_path / "tuned")
    note = info.merged_note()
    assert note.startswith(f"merged the LoRA adapters of {tmp_path / 'tuned'} (r=4")
    assert "; then merged the LoRA adapters of" in note and "other base weights" in note
    with pytest.raises(ValueError, match="neither a PEFT adapter"):
        load_any(tmp_path / "base", adapter=tmp_path / "base")


def test_an_adapter_trained_over_a_lora_run_goes_over_its_merged_adapters(tiny_config, tmp_path,
                                                                          caplog):  # fmt: skip
    """SFT then DPO, each with LoRA: the second run starts from the first (its adapters merged)
    and its adapters go back over that run as they were trained, said in one line for both; a
    run started from a LoRA run says it merged them, as every reader of one does."""
    import logging

    from llm_foundry.checkpoint import save_checkpoint
    from llm_foundry.train.build import load_initial_weights

    torch.manual_seed(0)
    sft = Transformer(tiny_config()).eval()
    add_lora(sft, ("wq", "wv"), r=4, alpha=8)
    _randomise(sft, seed=4)
    save_checkpoint(sft, tmp_path / "sft")
    dpo = Transformer(tiny_config()).eval()
    with caplog.at_level(logging.INFO, logger="llm_foundry"):
        load_initial_weights(dpo, tmp_path / "sft")  # as finetune --checkpoint sft starts
    said = [r.getMessage() for r in caplog.records if "merged the LoRA" in r.getMessage()]
    assert said == ["merged the LoRA adapters (r=4, alpha=8, on wq, wv) into the base weights: "
                    "widen(W) + s·B·A"]  # fmt: skip
    add_lora(dpo, ("wo", "w1"), r=2, alpha=4)
    _randomise(dpo, seed=5)
    _, _, info = _loads_as_tuned(dpo, tmp_path / "sft", tmp_path / "dpo")
    note = info.merged_note()
    assert note.startswith(f"merged the LoRA adapters of {tmp_path / 'sft'} (r=4, alpha=8, on ")
    assert f"; then merged the LoRA adapters of {tmp_path / 'dpo'} (r=2, alpha=4, on " in note
    assert "other base" not in note and "\n" not in note


@pytest.mark.parametrize("base_dtype", ["fp32", "bf16", "int8"])
def test_a_lora_run_put_on_other_base_weights_of_its_shape_says_so(base_dtype, tiny_config,
                                                                    tmp_path):  # fmt: skip
    from llm_foundry.checkpoint import save_checkpoint
    from llm_foundry.loading import load_any

    torch.manual_seed(0)
    base = Transformer(tiny_config()).eval()
    save_checkpoint(base, tmp_path / "base")
    tuned = copy.deepcopy(base)
    add_lora(tuned, ("wq", "w3"), r=4, alpha=8, base_dtype=base_dtype)
    _randomise(tuned, seed=2)
    save_checkpoint(tuned, tmp_path / "tuned")
    _, _, info = load_any(tmp_path / "base", adapter=tmp_path / "tuned")
    assert "note:" not in info.merged_note()  # its own base: nothing to say
    # the same base trained on: a norm and an adapted projection moved
    for changed in ("layers.1.mlp_norm.weight", "layers.0.attn.wq.weight"):
        other = copy.deepcopy(base)
        with torch.no_grad():
            other.get_parameter(changed).add_(0.5)
        save_checkpoint(other, tmp_path / changed)
        _, _, info = load_any(tmp_path / changed, adapter=tmp_path / "tuned")
        # every base tensor, but the int8-held projections' (2 targets in 2 layers)
        compared = len(base.state_dict()) - (2 * 2 if base_dtype == "int8" else 0)
        seen = changed in info.merged_note()
        assert seen == (base_dtype != "int8" or "norm" in changed), info.merged_note()
        if seen:
            assert (f"; note: they were trained over other base weights than these (1 of "
                    f"{compared} tensors differ: {changed}): give --checkpoint the base they "
                    "were fine-tuned from") in info.merged_note()  # fmt: skip
