"""Parameter accounting: published totals, and equality with transformers on the meta device."""

import json

import pytest
import torch

from llm_foundry.accounting import param_report
from llm_foundry.cli import main
from llm_foundry.presets import get_preset

PUBLISHED = {
    "gpt2": 124_439_808,
    "llama2-7b": 6_738_415_616,
    "qwen3-8b": 8_190_735_360,
    "mixtral-8x7b": 46_702_792_704,
}
# parameters each token uses: Mixtral's model card says 12.9B ("uses only 12.9B parameters per
# token"); Qwen3-30B-A3B's says 3.3B activated: the exact counts their configs imply
ACTIVE = {"mixtral-8x7b": 12_879_925_248, "qwen3-30b-a3b": 3_353_032_704}


def hf_config(name):
    """The transformers config of each real preset, written from its published config.json."""
    t = pytest.importorskip("transformers")
    return {
        "gpt2": lambda: t.GPT2Config(),
        "gpt2-medium": lambda: t.GPT2Config(n_embd=1024, n_layer=24, n_head=16),
        "llama2-7b": lambda: t.LlamaConfig(
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            max_position_embeddings=4096,
        ),
        "tinyllama-1.1b": lambda: t.LlamaConfig(
            vocab_size=32000,
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=22,
            num_attention_heads=32,
            num_key_value_heads=4,
            max_position_embeddings=2048,
        ),
        "mistral-7b": lambda: t.MistralConfig(
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            sliding_window=4096,
        ),
        "qwen3-8b": lambda: t.Qwen3Config(
            vocab_size=151936,
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            tie_word_embeddings=False,
        ),
        "mixtral-8x7b": lambda: t.MixtralConfig(
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            num_local_experts=8,
            num_experts_per_tok=2,
        ),
        "qwen3-30b-a3b": lambda: t.Qwen3MoeConfig(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            tie_word_embeddings=False,
        ),
        "bloom-560m": lambda: t.BloomConfig(
            vocab_size=250880, hidden_size=1024, n_layer=24, n_head=16
        ),
        "falcon-7b": lambda: t.FalconConfig(
            vocab_size=65024,
            hidden_size=4544,
            num_hidden_layers=32,
            num_attention_heads=71,
            multi_query=True,
            parallel_attn=True,
            bias=False,
            new_decoder_architecture=False,
        ),
    }[name]()


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_totals(name):
    assert param_report(get_preset(name))["total"] == PUBLISHED[name]


@pytest.mark.parametrize(
    "name",
    [
        "gpt2",
        "gpt2-medium",
        "llama2-7b",
        "tinyllama-1.1b",
        "mistral-7b",
        "qwen3-8b",
        "bloom-560m",
        "falcon-7b",
        "mixtral-8x7b",
        "qwen3-30b-a3b",
    ],
)
def test_total_equals_transformers(name):
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_config(name))
    hf_total = sum(p.numel() for p in hf.parameters())  # shared tensors counted once
    assert param_report(get_preset(name))["total"] == hf_total


@pytest.mark.parametrize("name", list(ACTIVE))
def test_active_parameters_of_mixtures_of_experts(name, capsys):
    rep = param_report(get_preset(name))
    assert rep["active"] == ACTIVE[name] and rep["total"] > rep["active"]
    assert main(["params", "--preset", name]) == 0
    out = capsys.readouterr().out
    assert f"{ACTIVE[name]:,}" in out and f"{rep['total']:,}" in out  # both totals printed
    dense = param_report(get_preset("llama2-7b"))
    assert dense["active"] == dense["total"]


def test_expert_flops_count_the_active_experts_only():
    """k experts of width H multiply as many weights per token as one MLP of width k * H; the
    router adds dim x n_experts per layer."""
    moe = get_preset("moe-shakespeare-char")
    dense = moe.replace(n_experts=0, hidden_dim=moe.experts_per_token * moe.expert_hidden_dim)
    extra = param_report(moe)["flops_per_token"] - param_report(dense)["flops_per_token"]
    assert extra == 6 * moe.n_layers * moe.dim * moe.n_experts


def test_rows_add_up_and_breakdown():
    rep = param_report(get_preset("llama2-7b"))
    rows = {r["component"]: r["count"] for r in rep["rows"]}
    assert rows["tok_emb.weight"] == 32000 * 4096
    assert rows["block.attn.wk.weight"] == 4096 * 4096
    assert rows["block.mlp.w1.weight"] == 4096 * 11008
    assert rows["blocks x 32"] == 32 * rep["per_block"]
    outside_blocks = sum(c for k, c in rows.items() if not k.startswith("block."))
    assert outside_blocks == rep["total"]
    assert rep["non_embedding"] == rep["total"] - 32000 * 4096
    # 2 (K and V) x 32 layers x 32 heads x 128 dims x 2 bytes
    assert rep["kv_cache"]["bf16_per_token"] == 2 * 32 * 32 * 128 * 2


def test_gqa_shrinks_kv_cache_and_tied_head_is_free():
    mistral = param_report(get_preset("mistral-7b"))["kv_cache"]["bf16_per_token"]
    assert mistral == 2 * 32 * 8 * 128 * 2  # 8 KV heads instead of 32: a quarter of LLaMA-2's
    gpt2 = param_report(get_preset("gpt2"))
    head = next(r for r in gpt2["rows"] if r["component"] == "lm_head.weight")
    assert head["count"] == 0 and "shared" in head["formula"]


def test_flops_per_token_formula():
    rep = param_report(get_preset("gpt2"))
    matmul = 12 * (768 * 3 * 768 + 768 * 768 + 2 * 768 * 3072) + 768 * 50257
    assert rep["flops_per_token"] == 6 * matmul + 12 * 12 * 12 * 64 * 1024


def test_matmul_flops_counted_by_the_profiler_equal_the_formula():
    """benchmarks/profile_step.py: the profiler's own count of matrix-multiply FLOPs in a training
    step (forward + backward) equals 6 x matrix weights x tokens, the formula's matmul part."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    from profile_step import profile_step

    r = profile_step("gpt2-shakespeare-char", batch=2, block=16, compile=False, steps=2)
    matmul = 4 * (4 * 128 * 128 + 2 * 128 * 512) + 65 * 128  # q, k, v, o; fc, proj; head
    assert r["matmul_flop_per_step"] == 6 * matmul * 2 * 16
    # each of the 6 buckets and the total is rounded to 0.1 ms
    assert sum(r["buckets"].values()) == pytest.approx(r["ms_per_step"], abs=0.35)
    assert r["top_ops"] and r["top_ops"][0]["ms_per_step"] > 0


def test_cli_params_json(capsys):
    assert main(["params", "--preset", "llama2-7b", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["total"] == 6_738_415_616
    assert out["non_embedding"] == 6_738_415_616 - 32000 * 4096


def test_cli_params_overrides_and_config_file(tmp_path, capsys):
    assert main(["params", "--preset", "llama2-7b", "--model.n_kv_heads", "8", "--json"]) == 0
    gqa = json.loads(capsys.readouterr().out)
    assert gqa["total"] == 6_738_415_616 - 32 * 2 * (4096 * 4096 - 4096 * 1024)
    cfg = tmp_path / "m.yaml"
    cfg.write_text(
        "model:\n"
        + "".join(f"  {k}: {json.dumps(v)}\n" for k, v in get_preset("gpt2").to_dict().items())
    )
    assert main(["params", "--config", str(cfg), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["total"] == 124_439_808


def test_cli_params_table_and_errors(capsys):
    assert main(["params", "--preset", "gpt2"]) == 0
    out = capsys.readouterr().out
    assert "124,439,808" in out and "KV cache per token" in out
    assert main(["params", "--preset", "gpt5"]) == 2
    assert "unknown preset 'gpt5'" in capsys.readouterr().err
    assert main(["params", "--preset", "gpt2", "--model.n_kv_heads", "5"]) == 2
    assert "n_heads=12 is not divisible by n_kv_heads=5" in capsys.readouterr().err
