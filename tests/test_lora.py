"""LoRA: the adapted model starts as its base, merge/unmerge, only adapters train; adapters in
PEFT's format go both ways with the ``peft`` package (ours onto the HF export, peft's onto ours)."""

from __future__ import annotations

import json

import pytest
import torch

from llm_foundry.models import Transformer
from llm_foundry.models.lora import add_lora, lora_layers, merge_lora, unmerge_lora

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


# ----------------------------------------------------------------------------------------------
# PEFT's format, checked with the peft package

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from llm_foundry.interop.hf import ConversionError, from_hf  # noqa: E402
from llm_foundry.interop.peft import load_adapter, save_adapter  # noqa: E402


def _hf_llama(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=61, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).eval()


@torch.no_grad()
def _hf_logits(model, x):
    return model(input_ids=x).logits


@pytest.mark.parametrize("rslora", [False, True])
def test_our_adapter_loads_in_peft_with_the_same_logits(rslora, tmp_path):
    hf = _hf_llama()
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
    assert (_hf_logits(with_adapter, x) - _hf_logits(_hf_llama(), x)).abs().max() > 1e-2


def test_a_peft_adapter_loads_onto_our_model_with_the_same_logits(tmp_path):
    hf = _hf_llama()
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
    llama = from_hf(_hf_llama())
    add_lora(llama, ("wq",), r=2)
    save_adapter(llama, tmp_path / "dora")
    file = tmp_path / "dora" / "adapter_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), "use_dora": True}))
    with pytest.raises(ConversionError, match="use_dora=True is not supported"):
        load_adapter(from_hf(_hf_llama()), tmp_path / "dora")


# ----------------------------------------------------------------------------------------------
# Fine-tuning a checkpoint with adapters


def _losses(run):
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs if "loss" in r]


def test_lora_fine_tuning_starts_from_the_checkpoint_trains_adapters_and_resumes(
    char_data, tmp_path
):
    from conftest import make_trainer

    from llm_foundry.checkpoint import load_checkpoint
    from llm_foundry.data import BatchSampler, load_split
    from llm_foundry.train.state import latest_checkpoint, write_json_atomic

    data = char_data(60_000)
    base_run = tmp_path / "base"
    make_trainer(data, base_run).run()
    base = latest_checkpoint(base_run / "checkpoints")
    lora = dict(init_from=str(base), lora_r=4, lora_alpha=8.0, lora_targets="wq,wv,w2")
    tuner = make_trainer(data, tmp_path / "ft", max_steps=8, checkpoint_interval=4, **lora)
    assert {n for n, p in tuner.model.named_parameters() if p.requires_grad} == {
        f"layers.{i}.{m}.lora_{ab}" for i in range(2) for m in ("attn.wq", "attn.wv", "mlp.w2")
        for ab in "AB"
    }  # fmt: skip
    # the adapters start at zero: the first step's loss is the base model's on that batch (the
    # sampler's first batch; dropout draws the same masks after the same seed)
    x, y = BatchSampler(load_split(data, "train"), 32, 4, seed=tuner.tc.seed).next()
    reference = load_checkpoint(base).train()
    torch.manual_seed(0)
    tuner.run()
    first = _losses(tmp_path / "ft")[0]
    torch.manual_seed(0)
    assert first == pytest.approx(reference(x, y)[1].item(), abs=1e-5)
    # the base weights are untouched; the saved run loads with its adapters merged
    tuned = load_checkpoint(latest_checkpoint(tmp_path / "ft" / "checkpoints"), merge=False)
    for name, p in load_checkpoint(base).state_dict().items():
        key = (
            name.replace(".weight", ".base.weight")
            if any(name.endswith(f"{m}.weight") for m in ("attn.wq", "attn.wv", "mlp.w2"))
            else name
        )
        assert torch.equal(tuned.state_dict()[key], p), name
    assert any(lora.lora_B.abs().max() > 0 for lora in lora_layers(tuned).values())
    # a crash after step 4, resumed: the same losses as the uninterrupted fine-tuning
    cut = tmp_path / "cut"
    import shutil

    shutil.copytree(tmp_path / "ft", cut)
    shutil.rmtree(cut / "checkpoints" / "step_000008")
    write_json_atomic(cut / "checkpoints" / "latest.json", {"step": 4, "path": "step_000004"})
    make_trainer(data, cut, resume=True, max_steps=8, checkpoint_interval=4, **lora).run()
    assert _losses(cut) == _losses(tmp_path / "ft")


def test_params_lora_view_counts_what_peft_trains(capsys):
    from llm_foundry.accounting import lora_report
    from llm_foundry.cli import main
    from llm_foundry.interop.hf import config_from_hf

    hf = _hf_llama()
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


def test_an_adapter_for_another_base_is_refused_naming_the_tensor(tmp_path):
    ours = from_hf(_hf_llama())
    add_lora(ours, ("wq", "w1"), r=4)
    save_adapter(ours, tmp_path / "adapter")
    wider = transformers.LlamaConfig(
        vocab_size=61, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    with pytest.raises(ConversionError, match=r"layers\.0\.attn\.wq\.lora_A: shape \(4, 48\)"):
        load_adapter(from_hf(transformers.LlamaForCausalLM(wider)), tmp_path / "adapter")
    one_layer = transformers.LlamaConfig(
        vocab_size=61, hidden_size=48, intermediate_size=80, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    with pytest.raises(ConversionError, match=r"adapter tensors with no module in the model"):
        load_adapter(from_hf(transformers.LlamaForCausalLM(one_layer)), tmp_path / "adapter")


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
