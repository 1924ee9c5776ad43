"""What a fine-tune's neighbouring commands print and write for people and for peft: sizes in a
unit that shows the number (a tiny model's are KiB, not "0.0 MiB"), the LoRA line's fp32 size
said once, and ``convert --to-peft``'s adapter_config.json naming a base that
``AutoPeftModelForCausalLM`` loads (the run's HF base, or --peft-base), else saying what to set."""

from __future__ import annotations

import json
import re

import pytest
import torch

from llm_foundry.cli import main

TINY = ["--model.dim", "16", "--model.n_layers", "1", "--model.n_heads", "2",
        "--model.max_seq_len", "32"]  # fmt: skip
QUIET = ["--train.block_size", "16", "--train.batch_size", "2", "--train.eval_batches", "1",
         "--train.warmup_steps", "1", "--train.sample_tokens", "0", "--train.progress", "false"]  # fmt: skip


@pytest.fixture(scope="module")
def base(char_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("readouts")
    argv = ["train", "--data", str(char_data(20_000)), "--out", str(root / "base"), *TINY,
            *QUIET, "--train.max_steps", "2"]  # fmt: skip
    assert main(argv) == 0
    return root / "base"


def _out(capsys, *argv) -> str:
    capsys.readouterr()
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def _kib(text: str) -> float:
    return float(text.removesuffix(" KiB"))


def test_size_readouts_use_a_unit_that_shows_the_number(base, char_data, tmp_path, capsys):
    out = _out(capsys, "quantize", "--checkpoint", str(base), "--to", "int8", "--out",
               str(tmp_path / "q"))  # fmt: skip
    said = re.search(r"weights read per token (\S+ KiB) -> (\S+ KiB) \(", out)
    assert said, out
    done = json.loads(_out(capsys, "quantize", "--checkpoint", str(base), "--to", "int8",
                           "--out", str(tmp_path / "q2"), "--json"))  # fmt: skip
    b = done["weight_bytes_per_token"]
    assert _kib(said[1]) == pytest.approx(b["before"] / 1024, abs=0.005)
    assert _kib(said[2]) == pytest.approx(b["after"] / 1024, abs=0.005)
    for dtype in ("fp32", "int8"):
        out = _out(capsys, "finetune", "--checkpoint", str(base), "--data",
                   str(char_data(20_000)), "--out", str(tmp_path / dtype), *QUIET,
                   "--train.max_steps", "1", "--train.lora_r", "2", "--train.lora_base_dtype",
                   dtype)  # fmt: skip
        line = next(x for x in out.splitlines() if x.startswith("LoRA r=2"))
        held = re.search(r"frozen weights of the adapted projections \d\S* (B|KiB) (\w+)", line)
        assert held and held[2] == dtype, line
        assert ("(fp32: " in line) == (dtype != "fp32"), line  # fp32 said once
    pytest.importorskip("gguf")
    gguf = tmp_path / "m.gguf"
    out = _out(capsys, "convert", "--to-gguf", str(base), "--out", str(gguf))
    said = re.search(r"\((\S+ KiB)\)", out)
    assert said and _kib(said[1]) == pytest.approx(gguf.stat().st_size / 1024, abs=0.005), out


def test_convert_to_peft_names_a_base_autopeftmodel_loads(base, char_data, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from llm_foundry.loading import load_any

    hf_base = tmp_path / "hf-base"
    _out(capsys, "convert", "--to-hf", str(base), "--out", str(hf_base))
    lora = [*QUIET, "--train.max_steps", "2", "--train.lora_r", "2", "--train.lr", "3e-2"]
    for start in (hf_base, base):  # an HF base, then our run
        _out(capsys, "finetune", "--checkpoint", str(start), "--data", str(char_data(20_000)),
             "--out", str(tmp_path / f"tuned-{start.name}"), *lora)  # fmt: skip
    x = torch.randint(0, 30, (1, 12))

    def peft_logits(adapter):
        model = peft.AutoPeftModelForCausalLM.from_pretrained(str(adapter)).eval()
        with torch.no_grad():
            return model(input_ids=x).logits

    def ours(tuned):
        with torch.no_grad():
            return load_any(tuned).model(x)[0]

    # tuned from the HF directory: named as it is, and AutoPeftModel loads it
    tuned = tmp_path / "tuned-hf-base"
    out = _out(capsys, "convert", "--to-peft", str(tuned), "--out", str(tmp_path / "a1"))
    assert "note:" not in out
    config = json.loads((tmp_path / "a1" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(hf_base)
    assert (peft_logits(tmp_path / "a1") - ours(tuned)).abs().max().item() <= 1e-4
    # tuned from our run: the output says what to set; --peft-base sets it
    tuned = tmp_path / "tuned-base"
    out = _out(capsys, "convert", "--to-peft", str(tuned), "--out", str(tmp_path / "a2"))
    assert (f"note: adapter_config.json's base_model_name_or_path is {base}, which transformers "
            "cannot load") in out and "--peft-base HF_DIR" in out  # fmt: skip
    with pytest.raises((OSError, ValueError)):
        peft_logits(tmp_path / "a2")
    out = _out(capsys, "convert", "--to-peft", str(tuned), "--out", str(tmp_path / "a3"),
               "--peft-base", str(hf_base))  # fmt: skip
    assert "note:" not in out and f"for the base {hf_base}" in out
    assert (peft_logits(tmp_path / "a3") - ours(tuned)).abs().max().item() <= 1e-4
    wider = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2))  # fmt: skip
    wider.save_pretrained(tmp_path / "wider")
    capsys.readouterr()
    argv = ["convert", "--to-peft", str(tuned), "--out", str(tmp_path / "a4"), "--peft-base",
            str(tmp_path / "wider")]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is another model than the adapters were trained on" in err
    assert not (tmp_path / "a4").exists()
