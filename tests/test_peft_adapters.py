"""PEFT adapters put on our model as peft puts them on the HF one: the modules adapter_config.json's
target_modules / exclude_modules choose (a list, a regular expression, "all-linear"), checked by
the logits of ``peft.PeftModel.from_pretrained`` on the same random Llama; and an adapter that
does not fit refused in one line saying how (another base's sizes and layer count, read from its
tensors; a config whose r is not its tensors' rank)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from conftest import tiny_hf_llama

from llm_foundry.models.lora import add_lora, lora_layers

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from llm_foundry.interop.hf import ConversionError, from_hf  # noqa: E402
from llm_foundry.interop.peft import load_adapter, save_adapter  # noqa: E402

TOL = 1e-4  # of logits of size ~1, fp32 on both sides
ALL = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")


def _adapter(tmp_path, targets=("wq", "wv", "w2"), r=4, seed=1, **hf_fields):
    """An adapter (random A and B) on ``targets`` of the tiny Llama with ``hf_fields``."""
    ours = from_hf(tiny_hf_llama(**hf_fields))
    add_lora(ours, targets, r=r, alpha=2 * r)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for lora in lora_layers(ours).values():
            lora.lora_A.copy_(torch.randn(lora.lora_A.shape, generator=g) * 0.3)
            lora.lora_B.copy_(torch.randn(lora.lora_B.shape, generator=g) * 0.3)
    out = tmp_path / "adapter"
    save_adapter(ours, out)
    return out


def _edit(adapter, **changes):
    file = adapter / "adapter_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))


@pytest.mark.parametrize(
    "targets, changes, applied",
    [
        (("wq", "wv", "w2"), dict(target_modules=["q_proj"]), {"wq"}),
        (("wq", "wv", "w2"), dict(target_modules=["self_attn.v_proj", "mlp.down_proj"]),
         {"wv", "w2"}),
        (("wq", "wv", "w2"), dict(target_modules=r".*\.layers\.1\..*(q_proj|down_proj)"),
         {"wq", "w2"}),
        (ALL, dict(target_modules="all-linear", exclude_modules=["v_proj", "gate_proj"]),
         set(ALL) - {"wv", "w1"}),
        (("wq", "wv", "w2"), dict(exclude_modules=r"model\.layers\.0\.self_attn\.q_proj"),
         {"wq", "wv", "w2"}),
        # layers_to_transform keeps what a name's end matched in those layers only; an exact
        # path is kept wherever it is
        (("wq", "wv", "w2"), dict(layers_to_transform=[1]), {"wq", "wv", "w2"}),
        (("wq", "wv", "w2"), dict(target_modules=["q_proj", "down_proj"], layers_to_transform=0,
                                  layers_pattern="layers"), {"wq", "w2"}),
        (("wq", "wv", "w2"), dict(target_modules=["model.layers.0.self_attn.q_proj", "v_proj"],
                                  layers_to_transform=[1], layers_pattern=["h", "layers"]),
         {"wq", "wv"}),
    ],
)  # fmt: skip
def test_target_modules_choose_the_adapted_modules_as_peft_does(
    targets, changes, applied, tmp_path, caplog
):
    adapter = _adapter(tmp_path, targets)
    _edit(adapter, **changes)
    with_peft = peft.PeftModel.from_pretrained(tiny_hf_llama(), str(adapter)).eval()
    ours = from_hf(tiny_hf_llama())
    with caplog.at_level(logging.WARNING, logger="llm_foundry"):
        adapted = load_adapter(ours, adapter)
    peft_adapted = {n.removeprefix("base_model.model.").removesuffix(".lora_A")
                    for n, _ in with_peft.named_modules() if n.endswith(".lora_A")}  # fmt: skip
    assert len(adapted) == len(peft_adapted)
    assert {n.rsplit(".", 1)[-1] for n in adapted} == applied
    x = torch.randint(0, 61, (2, 11))
    with torch.no_grad():
        want, got = with_peft(input_ids=x).logits, ours.eval()(x)[0]
        base = tiny_hf_llama()(input_ids=x).logits
    assert (got - want).abs().max().item() <= TOL
    assert (got - base).abs().max().item() > 1e-2  # the adapter does change the output
    left = 2 * len(targets) - len(adapted)  # 2 layers: what the file holds and peft leaves out
    notes = [r.getMessage() for r in caplog.records if "leaves out" in r.getMessage()]
    if left:
        assert len(notes) == 1 and f"leaves out {left} module(s)" in notes[0], notes
        assert "adapter_config.json target_modules=" in notes[0]
    else:
        assert not notes


def _refusal(adapter, **hf_fields) -> str:
    with pytest.raises(ConversionError) as e:
        load_adapter(from_hf(tiny_hf_llama(**hf_fields)), adapter)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"cannot load the adapter in {adapter}: ")
    return message.split(": ", 1)[1]


def test_an_adapter_for_another_base_says_in_one_line_how_that_base_differs(tmp_path):
    # dim 48, hidden 80, 2 layers on a model of dim 64 / 2 layers, 48 / 1 layer, 48 / 3 layers
    adapter = _adapter(tmp_path, ("wq", "w2"))
    why = _refusal(adapter, hidden_size=64)
    assert why == ("made for a model with dim 48 (this one: 64) and n_heads x head_dim 48 "
                   "(this one: 64)"), why  # fmt: skip
    assert _refusal(adapter, num_hidden_layers=1) == "made for a model with 2 layers (this one: 1)"
    assert _refusal(adapter, num_hidden_layers=3) == "made for a model with 2 layers (this one: 3)"
    why = _refusal(adapter, intermediate_size=96, num_hidden_layers=1)
    assert why == "made for a model with hidden_dim 80 (this one: 96) and 2 layers (this one: 1)"


def test_a_config_whose_r_is_not_its_tensors_rank_is_one_line(tmp_path):
    adapter = _adapter(tmp_path, r=8)
    _edit(adapter, r=4)
    assert _refusal(adapter) == "adapter_config.json says r=4 but its tensors have rank 8"


def test_what_the_config_chooses_but_the_file_lacks_starts_as_peft_starts_it(tmp_path, caplog):
    """A chosen module with no tensors: peft gives it a zero lora_B (it changes nothing) and
    warns; so here, with a note, the logits equal peft's. Where peft would draw it at random
    (init_lora_weights not true) it is refused, naming the modules."""
    adapter = _adapter(tmp_path, ("wq",))
    _edit(adapter, target_modules=["q_proj", "k_proj"])
    with_peft = peft.PeftModel.from_pretrained(tiny_hf_llama(), str(adapter)).eval()
    ours = from_hf(tiny_hf_llama())
    with caplog.at_level(logging.WARNING, logger="llm_foundry"):
        adapted = load_adapter(ours, adapter)
    assert len(adapted) == 4  # wq and wk of both layers, as peft puts them
    notes = [r.getMessage() for r in caplog.records if "holds no tensors for" in r.getMessage()]
    assert len(notes) == 1 and "chooses 2 module(s)" in notes[0], notes
    x = torch.randint(0, 61, (2, 11))
    with torch.no_grad():
        assert (ours.eval()(x)[0] - with_peft(input_ids=x).logits).abs().max().item() <= TOL
    _edit(adapter, init_lora_weights="gaussian")
    why = _refusal(adapter)
    assert "chooses layers.0.attn.wk, layers.1.attn.wk, which adapter_model.safetensors holds " \
           "no lora_A and lora_B for" in why, why  # fmt: skip
    _edit(adapter, init_lora_weights=True)
    _edit(adapter, target_modules=["o_proj"])
    assert "chooses none of the modules adapter_model.safetensors holds tensors for" in \
           _refusal(adapter)  # fmt: skip
    _edit(adapter, target_modules=["q_proj"], layers_to_transform=[0], layers_pattern="blocks")
    why = _refusal(adapter)
    assert "layers_to_transform=[0] layers_pattern='blocks' chooses none of the modules" in why
    for changes, said in [  # the first two: what peft's LoraConfig refuses too
        (dict(target_modules=".*q_proj", layers_pattern=None),
         "layers_to_transform is for a list of target_modules, not a regular expression"),
        (dict(layers_to_transform=None, layers_pattern="layers"),
         "layers_pattern is given without layers_to_transform"),
        (dict(layers_to_transform="0", layers_pattern=None),
         "layers_to_transform='0' must be a layer index or a list of them"),
    ]:  # fmt: skip
        _edit(adapter, **{"target_modules": ["q_proj"], **changes})
        if "given" in said or "regular" in said:
            with pytest.raises(ValueError):
                peft.LoraConfig.from_pretrained(str(adapter))
        assert said in _refusal(adapter)
    _edit(adapter, target_modules=["q_proj"], layers_to_transform=None, exclude_modules="(")
    assert "exclude_modules='(' is not a regular expression" in _refusal(adapter)
    _edit(adapter, exclude_modules=None, target_modules=None)
    assert "target_modules is not set" in _refusal(adapter)


@pytest.mark.parametrize(
    "family, targets, said",
    [
        ("gpt2", ["c_attn"], "fan_in_fan_out=true: the adapter is on Conv1D modules (GPT-2's"),
        ("bloom", ["query_key_value"], "which bloom stores and llm-foundry keeps as separate"),
    ],
)
def test_an_adapter_on_a_module_hf_fuses_says_why_it_cannot_be_carried(
    tmp_path, family, targets, said
):
    """peft puts GPT-2's adapters on Conv1D (it sets fan_in_fan_out itself) and BLOOM's on the
    fused q/k/v: refused naming that, and the families whose adapters do carry over."""
    from llm_foundry.interop.hf import FAMILIES

    fam = FAMILIES[family]
    kwargs = next(iter(fam.examples.values()))

    def base():
        config = getattr(transformers, fam.config_class)(vocab_size=61, **kwargs)
        return getattr(transformers, fam.model_class)(config)

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets)
    peft.get_peft_model(base(), config).save_pretrained(tmp_path / "adapter")
    with pytest.raises(ConversionError) as e:
        load_adapter(from_hf(base()), tmp_path / "adapter")
    message = str(e.value)
    assert "\n" not in message and said in message
    assert message.endswith("(llama, mistral, qwen3, mixtral, qwen3_moe), or fine-tune here "
                            "with finetune --lora and export it")  # fmt: skip


def test_convert_to_peft_names_a_relative_peft_base_by_its_absolute_path(
    tmp_path, monkeypatch, capsys
):
    """``convert --to-peft CKPT --peft-base hf-base`` typed from the base's parent directory:
    adapter_config.json names the base by its absolute path, so AutoPeftModelForCausalLM loads
    it from any other directory (a relative name would be read from there, or taken for a Hub
    id), with the checkpoint's logits; a name that is no directory, a Hub id, is kept as given."""
    from llm_foundry.checkpoint import save_checkpoint
    from llm_foundry.cli import main
    from llm_foundry.loading import load_any

    tiny_hf_llama().save_pretrained(tmp_path / "hf-base")
    ours = from_hf(tiny_hf_llama())
    add_lora(ours, ("wq", "wv", "w2"), r=4, alpha=8)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # B is zero at init: an adapter that changes nothing would prove little
        for lora in lora_layers(ours).values():
            lora.lora_B.copy_(torch.randn(lora.lora_B.shape, generator=g) * 0.3)
    save_checkpoint(ours, tmp_path / "tuned")
    monkeypatch.chdir(tmp_path)
    argv = ["convert", "--to-peft", "tuned", "--out", "adapter", "--peft-base", "hf-base"]
    assert main(argv) == 0
    base = (tmp_path / "hf-base").resolve()
    assert f"for the base {base}" in capsys.readouterr().out
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    loaded = peft.AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "adapter")).eval()
    x = torch.randint(0, 61, (1, 12))
    with torch.no_grad():
        want = load_any(tmp_path / "tuned").model(x)[0]
        assert (loaded(input_ids=x).logits - want).abs().max().item() <= TOL
    save_adapter(ours, tmp_path / "hub", base="some-org/some-model")
    config = json.loads((tmp_path / "hub" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "some-org/some-model"
