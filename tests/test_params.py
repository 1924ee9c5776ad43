"""Parameter accounting: published totals, and equality with transformers on the meta device."""

import json

import pytest
import torch

from llm_foundry.accounting import (
    activation_bytes,
    layer_activation_bytes,
    meta_model,
    param_report,
)
from llm_foundry.cli import main
from llm_foundry.presets import get_preset
from llm_foundry.train.memory import STRATEGIES, GiB, memory_report

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


# ----------------------------------------------------------------------------------------------
# Memory per device: DDP, FSDP, TP, FSDP+TP

LLAMA2_7B = 6_738_415_616


def _numel(cfg, keep) -> int:
    """An independent count: the meta model's parameters whose name ``keep`` accepts."""
    return sum(p.numel() for n, p in meta_model(cfg).named_parameters() if keep(n))


def _readme_memory_rows() -> list[str]:
    """The README's table rows, recomputed: 8 devices, AdamW, fp32, 1 x 4096 tokens, fsdp+tp 2x4."""
    rows = []
    parts = {
        "model states": ("weights", "working_weights", "gradients", "optimizer"),
        "activations": ("activations",),
        "total": ("total",),
    }
    for name, tp in (("llama2-7b", 4), ("mistral-7b", 4), ("qwen3-8b", 4), ("falcon-7b", 1)):
        rep = memory_report(get_preset(name), 8, tp, seq_len=4096)
        for label, keys in parts.items():
            cells = []
            for s in STRATEGIES:
                row = rep["strategies"].get(s)
                if row is None or (s == "fsdp+tp" and tp == 1):  # 8x1 would only repeat fsdp
                    cells.append("—")
                else:
                    cells.append(f"{sum(row[k] for k in keys) / GiB:.1f}")
            rows.append(f"| {name} | {label} | " + " | ".join(cells) + " |")
    return rows


def test_readme_memory_table_is_what_memory_report_computes():
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    header = "| preset | GiB per device | DDP | FSDP | TP | FSDP+TP |\n|---|---|---|---|---|---|\n"
    assert header in readme
    shown = readme.split(header, 1)[1].split("\n\n", 1)[0].splitlines()
    assert shown == _readme_memory_rows()
    for name, tp in (("llama2-7b", 4), ("mistral-7b", 4), ("qwen3-8b", 4), ("falcon-7b", 1)):
        assert f"llm-foundry params --preset {name} --memory 8 --tp {tp} --seq-len 4096" in readme


def test_ddp_holds_weights_gradients_and_adamw_state_whole():
    cfg = get_preset("llama2-7b")
    ddp = memory_report(cfg, 8, 4)["strategies"]["ddp"]
    assert _numel(cfg, lambda n: True) == LLAMA2_7B
    assert ddp["weights"] == ddp["gradients"] == 4 * LLAMA2_7B
    assert ddp["optimizer"] == 8 * LLAMA2_7B and ddp["working_weights"] == 0  # fp32: no copies
    assert (ddp["data"], ddp["tensor"]) == (8, 1)


def test_fsdp_is_ddp_states_over_n_plus_the_gathered_root_and_one_block():
    cfg = get_preset("llama2-7b")
    rep = memory_report(cfg, 8, 4)
    ddp, fsdp = rep["strategies"]["ddp"], rep["strategies"]["fsdp"]
    for key in ("weights", "gradients", "optimizer"):
        assert fsdp[key] * 8 == ddp[key]  # every llama2-7b dim 0 divides by 8: no padding
    # FSDP2 keeps the root (embedding, final norm, head) gathered from forward to backward
    gathered = _numel(cfg, lambda n: not n.startswith("layers.") or n.startswith("layers.0."))
    assert gathered == 2 * 32000 * 4096 + 4096 + rep["params"]["per_block"]
    assert fsdp["working_weights"] == 4 * gathered
    states = ddp["weights"] + ddp["gradients"] + ddp["optimizer"]
    assert fsdp["total"] == states // 8 + 4 * gathered + fsdp["activations"]
    assert fsdp["activations"] == ddp["activations"]  # data parallelism splits no activation
    bf16 = memory_report(cfg, 8, 4, dtype="bf16")["strategies"]
    assert bf16["fsdp"]["working_weights"] == 2 * gathered  # FSDP's bf16 all-gather
    assert bf16["fsdp"]["weights"] == fsdp["weights"]  # autocast: fp32 master weights
    # DDP under autocast: bf16 copies of every matmul weight (all 2-D ones but the embedding)
    matmul = _numel(cfg, lambda n: n != "tok_emb.weight" and "norm" not in n)
    assert bf16["ddp"]["working_weights"] == 2 * matmul


def test_tp_splits_projections_and_vocabulary_and_replicates_norms():
    cfg = get_preset("llama2-7b")
    rep = memory_report(cfg, 8, 4)
    projections = (
        "wq.weight",
        "wk.weight",
        "wv.weight",
        "wo.weight",
        "w1.weight",
        "w2.weight",
        "w3.weight",
    )
    split = _numel(
        cfg, lambda n: n.endswith(projections) or n in ("tok_emb.weight", "lm_head.weight")
    )
    replicated = _numel(cfg, lambda n: "norm" in n)
    assert (rep["params"]["tp_split"], rep["params"]["tp_replicated"]) == (split, replicated)
    assert replicated == (2 * 32 + 1) * 4096 and split + replicated == LLAMA2_7B
    tp = rep["strategies"]["tp"]  # one TP group of all 8 devices
    assert (tp["data"], tp["tensor"]) == (1, 8)
    assert tp["weights"] * 8 == 4 * split + 4 * replicated * 8
    assert tp["optimizer"] * 8 == 8 * split + 8 * replicated * 8
    both = rep["strategies"]["fsdp+tp"]  # 2 x 4: FSDP over 2, TP over 4
    assert (both["data"], both["tensor"]) == (2, 4)
    assert both["weights"] * 8 == 4 * split + 4 * replicated * 4
    # the gathered copies under fsdp+tp are TP shards: the root and one block, split 4 ways
    root_and_block = _numel(cfg, lambda n: not n.startswith("layers.") or n.startswith("layers.0."))
    norms_gathered = 4096 + 2 * 4096  # final norm and block 0's two norms stay whole
    assert both["working_weights"] == 4 * ((root_and_block - norms_gathered) // 4 + norms_gathered)


def test_mqa_keeps_one_kv_head_whole_and_moe_gets_no_tensor_parallelism():
    cfg = get_preset("llama2-7b", n_kv_heads=1)  # MQA: K/V cannot split, so every rank holds them
    rep = memory_report(cfg, 8, 8)
    kv = 32 * 2 * 4096 * 128
    assert rep["params"]["tp_replicated"] == (2 * 32 + 1) * 4096 + kv
    split = rep["params"]["tp_split"]
    assert rep["strategies"]["tp"]["weights"] * 8 == 4 * split + 4 * 8 * (65 * 4096 + kv)
    moe = memory_report(get_preset("mixtral-8x7b"), 8, 2, seq_len=1024)
    assert set(moe["strategies"]) == {"ddp", "fsdp"}
    assert "expert banks" in moe["unavailable"]["tp"] and "fsdp+tp" in moe["unavailable"]
    assert moe["strategies"]["ddp"]["weights"] == 4 * PUBLISHED["mixtral-8x7b"]


def test_muon_state_is_adamw_state_less_the_hidden_matrices_second_moment():
    cfg = get_preset("llama2-7b")
    adamw = memory_report(cfg, 8, 4)["strategies"]["ddp"]["optimizer"]
    rep = memory_report(cfg, 8, 4, optimizer="muon")
    hidden = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)  # the blocks' 2-D weights
    assert rep["params"]["muon"] == hidden
    assert rep["strategies"]["ddp"]["optimizer"] == adamw - 4 * hidden
    # the momentum is sharded like the weights (each update matrix is gathered only in turn)
    assert rep["strategies"]["fsdp"]["optimizer"] * 8 == adamw - 4 * hidden


@pytest.mark.parametrize("name", ["llama2-7b", "gpt2", "falcon-7b", "moe-shakespeare-char"])
def test_memory_report_gives_muon_what_the_trainer_does(name):
    from llm_foundry.train.optim import muon_groups

    cfg = get_preset(name)
    muon = muon_groups(meta_model(cfg), 0.1, 0.0, 0.95, (0.9, 0.99), 1.0)[0]["params"]
    expected = sum(p.numel() for p in muon)
    assert memory_report(cfg, 1, 1, optimizer="muon")["params"]["muon"] == expected > 0


def test_activation_formula_against_korthikanti():
    """Korthikanti et al. 2022: 34*s*b*h bytes per GPT layer in 16-bit (flash attention: no s^2
    term), of which 2*s*b*h are dropout masks this model has not. TP with sequence parallelism:
    the norm inputs (4) and the rest (24) split t ways, the projections' gathered inputs (4) not."""
    cfg = get_preset("gpt2")
    s, b, h = 1024, 2, 768
    assert layer_activation_bytes(cfg, 1, b, s, 2, 2) == 32 * s * b * h
    assert layer_activation_bytes(cfg, 4, b, s, 2, 2) == s * b * h * (4 + 28 // 4)
    full = activation_bytes(cfg, 1, b, s, "bf16")
    ckpt = activation_bytes(cfg, 1, b, s, "bf16", activation_checkpointing=True)
    layer = layer_activation_bytes(cfg, 1, b, s, 2, 4)  # bf16 tensors, fp32 residual stream
    head = s * b * (4 * h + 2 * h + 50257 * (2 + 4))  # norm and head inputs, logits + log-probs
    assert full == 12 * layer + head
    assert ckpt == 12 * s * b * 4 * h + layer + head  # block inputs plus one recomputed block


MISTRAL_BY_3 = (
    "model.n_heads=32 must divide by the tensor-parallel degree 3; model.n_kv_heads=8 must "
    "divide by the tensor-parallel degree 3 (or be 1: MQA's one K/V head is replicated)"
)


def test_invalid_tp_degree_names_the_fields(capsys):
    with pytest.raises(ValueError) as e:
        memory_report(get_preset("mistral-7b"), 6, 3)
    assert str(e.value) == MISTRAL_BY_3
    with pytest.raises(ValueError, match="devices=8 is not a multiple of the TP degree 3"):
        memory_report(get_preset("llama2-7b"), 8, 3)
    with pytest.raises(ValueError) as e:
        memory_report(get_preset("falcon-7b"), 8, 2)  # MQA: its one K/V head is no problem
    assert str(e.value) == "model.n_heads=71 must divide by the tensor-parallel degree 2"
    falcon = memory_report(get_preset("falcon-7b"), 8, 1)  # DDP and FSDP still apply
    assert "n_heads=71" in falcon["unavailable"]["tp"] and "fsdp" in falcon["strategies"]
    assert main(["params", "--preset", "mistral-7b", "--memory", "6", "--tp", "3"]) == 2
    err = capsys.readouterr().err
    assert MISTRAL_BY_3 in err
    assert len(err.strip().splitlines()) == 1
    assert main(["params", "--preset", "gpt2", "--tp", "2"]) == 2
    assert "--tp needs --memory" in capsys.readouterr().err
    # heads that do not split are named for models tensor parallelism refuses anyway (experts,
    # ALiBi), as for any other
    for name, tp in (("moe-shakespeare-char", 4), ("bloom-560m", 3)):
        with pytest.raises(ValueError, match="must divide by the tensor-parallel degree"):
            memory_report(get_preset(name), 12, tp)
    assert main(["params", "--preset", "bloom-560m", "--memory", "6", "--tp", "3"]) == 2
    assert "model.n_heads=16 must divide" in capsys.readouterr().err


@pytest.mark.parametrize(
    "name, devices, tp, over",
    [
        ("llama2-7b", 8, 4, {}),  # splits every way
        ("falcon-7b", 8, 1, {}),  # 71 heads: no TP group of 8
        ("llama2-7b", 6, 2, {"n_kv_heads": 1}),  # MQA: 32 heads split 2 ways, not 6
        ("mixtral-8x7b", 8, 2, {}),  # experts: no tensor parallelism at all
        ("bloom-560m", 4, 2, {}),  # ALiBi's per-head bias: none either
        ("moe-shakespeare-char", 4, 1, {"pos_encoding": "alibi"}),  # both reasons
    ],
)
def test_the_reports_unavailable_layouts_are_tensor_parallelisms_own_refusals(
    name, devices, tp, over
):
    """One owner of what tensor parallelism splits: the report gives tp (all devices in one
    group) and fsdp+tp (groups of tp) exactly for the models tp_problems accepts, with its
    reasons, so a change to the plan's refusals shows in the report unedited."""
    from llm_foundry.train.tensor_parallel import tp_problems

    cfg = get_preset(name, **over)
    rep = memory_report(cfg, devices, tp)
    want = {}
    for layout, degree in (("tp", devices), ("fsdp+tp", tp)):
        if tp_problems(cfg, degree):
            want[layout] = "; ".join(tp_problems(cfg, degree))
    assert rep["unavailable"] == want
    assert set(rep["strategies"]) == set(STRATEGIES) - set(want)


def test_cli_params_memory_table_and_json(capsys):
    argv = ["params", "--preset", "llama2-7b", "--memory", "8", "--tp", "4", "--seq-len", "4096"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    rep = memory_report(get_preset("llama2-7b"), 8, 4, seq_len=4096)
    assert "8 devices, AdamW, fp32, batch 1 x 4096 tokens" in out
    total = "".join(f"{rep['strategies'][s]['total'] / GiB:>10.2f}" for s in STRATEGIES)
    assert f"{'total':<18}{total}" in out and "2x4" in out
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["memory"] == rep


def test_cli_memory_of_a_config_recipe_is_its_training_settings(capsys):
    """--config pretrain-124m-gpt2: the table is the recipe's batch 32 x 1024, bf16 (its dtype
    auto on a GPU), as memory_report computes them; a flag given still wins."""
    from llm_foundry.settings import resolve

    argv = ["params", "--config", "pretrain-124m-gpt2", "--memory", "1", "--json"]
    assert main(argv) == 0
    cfg = resolve(files=["pretrain-124m-gpt2"]).model
    rep = memory_report(cfg, 1, 1, dtype="bf16", batch_size=32, seq_len=1024)
    assert json.loads(capsys.readouterr().out)["memory"] == rep
    assert main([*argv, "--batch-size", "4"]) == 0
    rep = memory_report(cfg, 1, 1, dtype="bf16", batch_size=4, seq_len=1024)
    assert json.loads(capsys.readouterr().out)["memory"] == rep


@pytest.mark.parametrize("devices", ["0", "-2"])
def test_cli_memory_on_no_devices_is_refused_not_ignored(devices, capsys):
    assert main(["params", "--preset", "gpt2", "--memory", devices]) == 2
    assert f"argument --memory: {devices} must be at least 1" in capsys.readouterr().err
    with pytest.raises(ValueError, match=f"devices must be at least 1, got {devices}"):
        memory_report(get_preset("gpt2"), int(devices), 1)


def params_error(capsys, argv) -> str:
    """The one stderr line of ``llm-foundry params ...`` refused with exit status 2."""
    assert main(["params", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "usage:" not in err, err
    return err


def test_seq_len_drives_the_flops_and_kv_cache_lines(capsys):
    """--seq-len S is the context of the FLOPs and KV-cache figures (it was read by the memory
    table only): the model's own counts at S, in the table and the JSON."""
    cfg = get_preset("llama-shakespeare-char")
    model = meta_model(cfg)
    argv = ["params", "--preset", "llama-shakespeare-char", "--seq-len", "24"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"training FLOPs per token at seq_len 24: {model.flops_per_token(24):,} " in out
    assert model.flops_per_token(24) != model.flops_per_token(cfg.max_seq_len)
    assert "per 24-token sequence" in out
    assert main([*argv, "--json", "--memory", "2"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["flops_per_token"] == model.flops_per_token(24) and rep["flops_seq_len"] == 24
    kv = rep["kv_cache"]
    assert kv["seq_len"] == 24 and kv["bf16_per_sequence"] == 24 * kv["bf16_per_token"]
    assert rep["memory"] == memory_report(cfg, 2, 2, seq_len=24)


@pytest.mark.parametrize("seq_len", ["0", "-5"])
def test_seq_len_below_one_is_refused_at_parse_time(seq_len, capsys):
    err = params_error(capsys, ["--preset", "llama-shakespeare-char", "--seq-len", seq_len])
    assert err.endswith(f"argument --seq-len: {seq_len} must be at least 1")


def test_seq_len_past_the_models_context(capsys):
    """Counted with a note where positions have no weight per position (RoPE: the figures are
    those of the model with max_seq_len raised, as the README's falcon-7b row at 4096 tokens);
    refused for learned positions, which have no row past it."""
    preset = "llama-shakespeare-char"
    argv = ["params", "--preset", preset, "--seq-len", "100", "--memory", "2", "--json"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    rep = json.loads(captured.out)
    raised = get_preset(preset, max_seq_len=100)
    assert rep["flops_per_token"] == meta_model(raised).flops_per_token()
    assert rep["kv_cache"] == param_report(raised)["kv_cache"]
    assert rep["memory"] == memory_report(raised, 2, 2)
    assert captured.err.startswith(
        "note: --seq-len 100 is past model.max_seq_len=64: counted as with --model.max_seq_len 100"
    )
    err = params_error(capsys, ["--preset", "gpt2-shakespeare-char", "--seq-len", "65"])
    assert "learned positions have no row beyond it: give 1..64" in err
    assert main(["params", "--preset", "gpt2-shakespeare-char", "--seq-len", "64"]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "flags",
    [
        ["--optimizer", "muon"],
        ["--dtype", "bf16"],
        ["--batch-size", "7"],
        ["--activation-checkpointing"],
        ["--tp", "2"],
    ],
)
def test_memory_flags_without_memory_are_refused_not_ignored(flags, capsys):
    err = params_error(capsys, ["--preset", "llama-shakespeare-char", *flags])
    assert err.endswith(f"{flags[0]} needs --memory DEVICES (only the memory table uses it)")
    assert main(["params", "--preset", "llama-shakespeare-char", *flags, "--memory", "2"]) == 0


def test_lora_targets_without_a_rank_are_refused(capsys):
    err = params_error(capsys, ["--preset", "llama-shakespeare-char", "--lora-targets", "wq"])
    assert err.endswith("--lora-targets wq needs --lora-r R (the LoRA view)")
    assert "argument --lora-r: 0 must be at least 1" in params_error(capsys, ["--lora-r", "0"])


def test_memory_values_are_refused_naming_the_flag(capsys):
    base = ["--preset", "llama-shakespeare-char", "--memory"]
    err = params_error(capsys, [*base, "1", "--batch-size", "0"])
    assert err.endswith("argument --batch-size: 0 must be at least 1")
    assert params_error(capsys, [*base, "4", "--tp", "0"]).endswith(
        "argument --tp: 0 must be at least 1"
    )
    err = params_error(capsys, [*base, "4", "--tp", "3"])
    assert "--tp 3 must divide --memory 4" in err and err.endswith("give one of 1, 2, 4")
    # the library names its own argument, and only the one that is wrong
    cfg = get_preset("llama-shakespeare-char")
    with pytest.raises(ValueError, match=r"^batch_size=0 must be at least 1$"):
        memory_report(cfg, 1, 1, batch_size=0)
    with pytest.raises(ValueError, match=r"^seq_len=-1 must be at least 1$"):
        memory_report(cfg, 1, 1, seq_len=-1)
    with pytest.raises(ValueError, match=r"^the TP degree must be at least 1, got 0$"):
        memory_report(cfg, 4, 0)
    with pytest.raises(ValueError, match=r"TP degree 3: give one of 1, 2, 4$"):
        memory_report(cfg, 4, 3)
