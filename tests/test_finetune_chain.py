"""A LoRA fine-tune leaves the project, through the command line alone: prepare --sft, finetune
(LoRA on an int8 base), then convert --to-hf (transformers computes the run's logits),
convert --to-peft (peft puts the adapter on the HF base as generate/eval --adapter put it on
ours), quantize int8 and generate, and convert --to-gguf (llama.cpp computes the run's logits)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import assert_decisive, corpus_text

from llm_foundry.cli import main
from llm_foundry.loading import load_any

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

ROWS = [
    {"prompt": "ROMEO: what light", "completion": " through yonder window breaks?"},
    {"messages": [
        {"role": "user", "content": "ROMEO: But soft, who speaks next?"},
        {"role": "assistant", "content": "JULIET"},
    ]},
] * 8  # fmt: skip
PROMPT = "ROMEO: But soft, what light"
SMALL = ["--model.n_layers", "2", "--model.dim", "48", "--model.n_heads", "4",
         "--model.n_kv_heads", "2", "--model.max_seq_len", "96"]  # fmt: skip
STEPS = ["--train.batch_size", "4", "--train.eval_batches", "2", "--train.sample_tokens", "0",
         "--train.progress", "false", "--train.eval_interval", "10"]  # fmt: skip


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to 1 + max |b|: float32 paths summing in other orders agree to
    ~1e-6 of it here."""
    return ((a - b).abs().max() / (1 + b.abs().max())).item()


@torch.no_grad()
def _ours(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids]))[0][0]


@torch.no_grad()
def _theirs(model, ids: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([ids])).logits[0]


def _cli(capsys, *argv: str) -> str:
    assert main(list(argv)) == 0, capsys.readouterr().err
    return capsys.readouterr().out


@pytest.mark.heavy
def test_a_lora_fine_tune_through_every_export(tmp_path, capsys):
    torch.manual_seed(0)
    (tmp_path / "corpus.txt").write_text(corpus_text(60_000))
    data, base, tuned = tmp_path / "data", tmp_path / "base", tmp_path / "tuned"
    _cli(capsys, "prepare", "--text", str(tmp_path / "corpus.txt"), "--tokenizer", "bpe",
         "--vocab-size", "300", "--out", str(data))  # fmt: skip
    _cli(capsys, "train", "--data", str(data), "--out", str(base), *SMALL, *STEPS,
         "--train.block_size", "64", "--train.max_steps", "20")  # fmt: skip
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    _cli(capsys, "prepare", "--sft", str(tmp_path / "rows.jsonl"), "--tokenizer-from", str(base),
         "--out", str(tmp_path / "sft"))  # fmt: skip
    _cli(capsys, "finetune", "--checkpoint", str(base), "--data", str(tmp_path / "sft"), "--out",
         str(tuned), *STEPS, "--train.block_size", "48", "--train.max_steps", "30",
         "--train.lr", "1e-2", "--train.lora_r", "4", "--train.lora_targets", "wq,wv,w2",
         "--train.lora_base_dtype", "int8")  # fmt: skip
    run, tok, _ = load_any(tuned)
    ids = tok.encode(PROMPT)
    want = _ours(run, ids)
    base_logits = _ours(load_any(base).model, ids)
    assert _rel(want, base_logits) > 1e-2  # the fine-tune changed the model

    # convert --to-hf: the merged model, which transformers runs to the run's logits
    out = _cli(capsys, "convert", "--to-hf", str(tuned), "--out", str(tmp_path / "hf"))
    assert "merged the LoRA adapters" in out and "int8 base widened to fp32" in out
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert _rel(_theirs(hf, ids), want) <= 1e-5
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")(PROMPT)["input_ids"] == ids
    # its config names the tokenizer's specials: transformers' generate stops where ours does
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (hf_config["bos_token_id"], hf_config["eos_token_id"]) == (tok.bos_id, tok.eos_id)
    assert tok.eos_id is not None and hf.generation_config.eos_token_id == tok.eos_id
    argv = ["generate", "--checkpoint", str(tuned), "--prompt", PROMPT, "--temperature", "0",
            "--max-new-tokens", "40", "--json"]  # fmt: skip
    rec = json.loads(_cli(capsys, *argv).strip().splitlines()[-1])
    theirs_ids = hf.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False)[0].tolist()
    # both keep the eos that ended them: ours reaching it, HF stops there too
    assert theirs_ids == rec["prompt_ids"] + rec["new_ids"]

    # convert --to-peft: the adapter alone; peft on the HF base equals --adapter on ours
    out = _cli(capsys, "convert", "--to-peft", str(tuned), "--out", str(tmp_path / "adapter"))
    assert "trained over the int8-rounded base" in out
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"].startswith(str(base))
    _cli(capsys, "convert", "--to-hf", str(base), "--out", str(tmp_path / "hf-base"))
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf-base")
    with_adapter = peft.PeftModel.from_pretrained(hf_base, str(tmp_path / "adapter")).eval()
    theirs = _theirs(with_adapter, ids)
    ours_adapter = load_any(base, adapter=tmp_path / "adapter").model
    assert _rel(_ours(ours_adapter, ids), theirs) <= 1e-5
    # our run as the adapter source gives the same model as its PEFT export
    assert _rel(_ours(load_any(base, adapter=tuned).model, ids), theirs) <= 1e-5
    # on the fp32 base rather than the int8-rounded one it trained over, the adapter computes
    # what the run does up to that rounding: nearer the run than the base is
    assert _rel(theirs, want) < _rel(base_logits, want) / 4

    # generate --adapter: peft's greedy tokens
    argv = ["generate", "--checkpoint", str(base), "--adapter", str(tmp_path / "adapter")]
    argv += ["--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", "8", "--ignore-eos"]
    rec = json.loads(_cli(capsys, *argv, "--json").strip().splitlines()[-1])
    seq = list(ids)
    for _ in range(8):
        logits = _theirs(with_adapter, seq)[-1]
        assert_decisive(logits, "peft's greedy step")
        seq.append(int(logits.argmax()))
    assert rec["prompt_ids"] + rec["new_ids"] == seq
    # eval --adapter: the loss of peft's own merged model, read from its HF directory
    (tmp_path / "text.txt").write_text(corpus_text(3_000))
    merged = tmp_path / "hf-peft-merged"
    with_adapter.merge_and_unload().save_pretrained(merged)
    (merged / "tokenizer.json").write_bytes((tmp_path / "hf" / "tokenizer.json").read_bytes())
    argv = ["eval", "--text", str(tmp_path / "text.txt"), "--context", "64", "--json"]
    theirs_eval = json.loads(_cli(capsys, *argv, "--checkpoint", str(merged)))
    ours_eval = json.loads(
        _cli(capsys, *argv, "--checkpoint", str(base), "--adapter", str(tmp_path / "adapter"))
    )
    assert "merged the LoRA adapters" in ours_eval["merged"]
    loss = [r["loss"] for r in (ours_eval["results"][0], theirs_eval["results"][0])]
    assert loss[0] == pytest.approx(loss[1], rel=1e-5)

    # quantize: the merged model in int8, which generate reads as --quantize int8 makes it
    out = _cli(capsys, "quantize", "--checkpoint", str(tuned), "--to", "int8",
               "--out", str(tmp_path / "q"))  # fmt: skip
    assert "merged the LoRA adapters" in out
    q = _ours(load_any(tmp_path / "q").model, ids)
    assert _rel(q, want) < _rel(base_logits, want) / 4
    argv = ["generate", "--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", "8", "--json"]
    from_file = json.loads(_cli(capsys, *argv, "--checkpoint", str(tmp_path / "q")))
    in_memory = json.loads(
        _cli(capsys, *argv, "--checkpoint", str(tuned), "--quantize", "int8").splitlines()[-1]
    )
    assert from_file["new_ids"] == in_memory["new_ids"]
    # quantize --adapter: the base with the PEFT adapter merged, as generate --adapter reads it
    out = _cli(capsys, "quantize", "--checkpoint", str(base), "--adapter", str(tmp_path / "adapter"),
               "--to", "int8", "--out", str(tmp_path / "qa"))  # fmt: skip
    assert "merged the LoRA adapters" in out
    from_file = json.loads(_cli(capsys, *argv, "--checkpoint", str(tmp_path / "qa")))
    in_memory = _cli(capsys, *argv, "--checkpoint", str(base), "--adapter",
                     str(tmp_path / "adapter"), "--quantize", "int8")  # fmt: skip
    assert from_file["new_ids"] == json.loads(in_memory.splitlines()[-1])["new_ids"]
    assert _rel(_ours(load_any(tmp_path / "qa").model, ids), theirs) < _rel(base_logits, theirs) / 4

    # convert --to-gguf: llama.cpp's f32 logits are the run's
    llama_cpp = pytest.importorskip("llama_cpp")
    out = _cli(capsys, "convert", "--to-gguf", str(tuned), "--out", str(tmp_path / "t.gguf"))
    assert "merged the LoRA adapters" in out
    llm = llama_cpp.Llama(model_path=str(tmp_path / "t.gguf"), n_ctx=96, logits_all=True,
                          type_k=0, type_v=0, n_threads=1, verbose=False)  # fmt: skip
    try:
        llm.eval(ids)
        gguf = torch.tensor(np.array(llm.scores[: len(ids)]))
    finally:
        llm.close()
    assert _rel(gguf, want) <= 1e-4
