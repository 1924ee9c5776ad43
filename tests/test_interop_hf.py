"""Parity with Hugging Face ``transformers``: from_hf / to_hf give the same logits and the same
greedy continuations as the HF model, for every registered family's tiny variants
(``Family.examples``): LLaMA (MHA, GQA, MQA, tied, untied, biases), Mistral (sliding window
shorter than the sequence), Qwen3 (QK-norm, explicit head_dim), GPT-2, BLOOM, Falcon, Mixtral
and Qwen3-MoE (top-k renormalised or not, both expert layouts on disk).

Every model is tiny, fp32, CPU and built in-process from a config (no hub access). HF initialises
norms to one and biases to zero, which would hide swapped or dropped norm/bias tensors, so every
1-D parameter is perturbed before comparing.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_decisive

transformers = pytest.importorskip("transformers")

from llm_foundry.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from llm_foundry.config import ModelConfig  # noqa: E402
from llm_foundry.export import convert_from_hf, convert_to_hf  # noqa: E402
from llm_foundry.interop.hf import (  # noqa: E402
    FAMILIES,
    ConversionError,
    config_from_hf,
    config_to_hf,
    export_order,
    from_hf,
    to_hf,
)
from llm_foundry.models.transformer import Transformer  # noqa: E402
from llm_foundry.presets import get_preset  # noqa: E402

VOCAB, B, T, NEW = 97, 2, 17, 10
TOL = 1e-4
LLAMA_SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
)


def _build(name: str, **changes):
    """The HF model of example ``name`` (its family's classes), with ``changes`` to its config."""
    family, kwargs = CASES[name]
    config = getattr(transformers, family.config_class)(vocab_size=VOCAB, **kwargs, **changes)
    return getattr(transformers, family.model_class)(config)


# every registered family's tiny variants: a family registered later (a plugin) is tested too
CASES = {name: (f, kw) for f in FAMILIES.values() for name, kw in f.examples.items()}


def _hf_model(name: str):
    """The HF model of case ``name``: seeded, eager attention, every 1-D parameter perturbed."""
    torch.manual_seed(sum(map(ord, name)))
    model = _build(name)
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:  # norm weights (ones) and biases (zeros) at init
                p.add_(0.2 * torch.randn_like(p))
            elif p.ndim == 3:  # stacked experts: as large as a dense MLP's, so experts differ
                p.normal_(0.0, 0.1)
    return model.eval()


def _tokens(seed: int = 0, length: int = T) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _ours_logits(model: Transformer, x: torch.Tensor) -> torch.Tensor:
    return model(x)[0]


@torch.no_grad()
def _hf_logits(model, x: torch.Tensor) -> torch.Tensor:
    return model(input_ids=x).logits


@torch.no_grad()
def _greedy(model: Transformer, x: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy decoding that recomputes the whole sequence at every step (no cache)."""
    for _ in range(n):
        nxt = model(x)[0][:, -1].argmax(-1, keepdim=True)
        x = torch.cat([x, nxt], dim=1)
    return x


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


def _load_hf_dir(path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), output_loading_info=True, attn_implementation="eager"
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    return model.eval()


# ----------------------------------------------------------------------------------------------
# Parity


@pytest.mark.parametrize("name", list(CASES))
def test_from_hf_to_hf_parity(name, tmp_path):
    hf = _hf_model(name)
    ours = from_hf(hf)
    assert not ours.training
    x = _tokens()
    ref = _hf_logits(hf, x)
    diff = _max_diff(_ours_logits(ours, x), ref)
    print(f"\n{name}: from_hf max|diff| = {diff:.2e}")
    assert diff <= TOL

    # greedy continuation: HF generate (with its KV cache) vs our full recompute
    want = hf.generate(
        x,
        attention_mask=torch.ones_like(x),
        do_sample=False,
        max_new_tokens=NEW,
        min_new_tokens=NEW,
    )
    assert_decisive(_hf_logits(hf, want[:, :-1])[:, T - 1 :], name)  # no choice within rounding
    assert torch.equal(_greedy(ours, x, NEW), want)

    # our model -> HF directory of the same family -> AutoModelForCausalLM: same logits
    to_hf(ours, tmp_path / "hf", family=hf.config.model_type)
    back = _load_hf_dir(tmp_path / "hf")
    assert type(back).__name__ == type(hf).__name__
    diff = _max_diff(_hf_logits(back, x), ref)
    print(f"{name}: to_hf -> from_pretrained max|diff| = {diff:.2e}")
    assert diff <= TOL

    # the directory form of from_hf
    again = from_hf(tmp_path / "hf")
    assert again.cfg == ours.cfg
    assert _max_diff(_ours_logits(again, x), _ours_logits(ours, x)) == 0.0


@pytest.mark.parametrize("name", list(CASES))
def test_export_picks_the_first_family_that_fits(name):
    """Without a family, export takes the first registered family of the config's position
    scheme that holds it exactly (the source's own, or one tried before it): same config back."""
    family, kwargs = CASES[name]
    cfg = config_from_hf(getattr(transformers, family.config_class)(vocab_size=VOCAB, **kwargs))
    auto = config_to_hf(cfg)
    order = export_order(cfg.pos_encoding)
    assert auto.model_type in order[: order.index(family.model_type) + 1]
    assert config_from_hf(auto) == cfg
    if family.from_hf.__module__.startswith("llm_foundry.interop.hf."):  # a built-in family
        assert auto.model_type == family.model_type  # each exports as itself


def test_every_family_brings_its_examples():
    assert all(f.examples for f in FAMILIES.values()), "a family the parity tests cannot build"
    assert len(CASES) == sum(len(f.examples) for f in FAMILIES.values()), "a name used twice"


def test_mistral_window_matters():
    """The window (5) is shorter than the sequence (17): removing it must change the logits, so
    the parity above really checks that HF's and our window masks agree."""
    ours = from_hf(_hf_model("mistral_window"))
    assert ours.cfg.sliding_window == 5
    full = Transformer(ours.cfg.replace(sliding_window=None)).eval()
    full.load_state_dict(ours.state_dict())
    x = _tokens()
    assert _max_diff(_ours_logits(full, x), _ours_logits(ours, x)) > 1e-3


def test_configs_map_fields():
    gpt2 = config_from_hf(_hf_model("gpt2").config)
    assert (gpt2.pos_encoding, gpt2.norm, gpt2.mlp, gpt2.gelu_approx) == (
        "learned",
        "layernorm",
        "gelu",
        "tanh",
    )
    assert gpt2.attn_bias and gpt2.mlp_bias and gpt2.tie_embeddings and gpt2.hidden_dim == 256
    qwen = config_from_hf(_hf_model("qwen3").config)
    assert qwen.qk_norm and qwen.head_dim == 24 and qwen.rope_theta == 1e6
    assert qwen.norm_eps == 1e-6 and qwen.tie_embeddings and qwen.sliding_window is None
    assert config_from_hf(_hf_model("qwen3_window").config).sliding_window == 6
    mqa = config_from_hf(_hf_model("llama_mqa").config)
    assert mqa.n_kv_heads == 1 and not mqa.tie_embeddings and mqa.head_dim is None
    lin = config_from_hf(_hf_model("llama_bias_geglu_linear_rope").config)
    assert (lin.rope_scaling, lin.rope_factor, lin.mlp, lin.gelu_approx) == (
        "linear",
        2.0,
        "geglu",
        "tanh",
    )


def test_sharded_checkpoint_directory(tmp_path):
    hf = _hf_model("llama_gqa_tied")
    hf.save_pretrained(str(tmp_path), max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    x = _tokens(1)
    assert _max_diff(_ours_logits(from_hf(tmp_path), x), _hf_logits(hf, x)) <= TOL


def test_gpt2_legacy_names_and_mask_buffers(tmp_path):
    """Checkpoints from the hub name GPT-2 tensors without ``transformer.`` and carry causal-mask
    buffers ``attn.bias`` / ``attn.masked_bias``: the prefix is optional, the buffers ignored."""
    from safetensors.torch import save_file

    hf = _hf_model("gpt2")
    sd = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items()}
    sd.pop("lm_head.weight")
    sd["h.0.attn.bias"] = torch.ones(1, 1, 64, 64).tril()
    sd["h.0.attn.masked_bias"] = torch.tensor(-1e4)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "model.safetensors"))
    hf.config.save_pretrained(str(tmp_path))
    x = _tokens(2)
    assert _max_diff(_ours_logits(from_hf(tmp_path), x), _hf_logits(hf, x)) <= TOL


@pytest.mark.parametrize("preset", ["llama-shakespeare", "gpt2-shakespeare"])
def test_export_preset_and_back(preset, tmp_path):
    torch.manual_seed(0)
    cfg = get_preset(preset, n_layers=2)
    ours = Transformer(cfg).eval()
    with torch.no_grad():
        for p in ours.parameters():
            if p.ndim == 1:
                p.add_(0.2 * torch.randn_like(p))
    x = torch.randint(0, cfg.vocab_size, (B, 33), generator=torch.Generator().manual_seed(3))
    to_hf(ours, tmp_path)
    diff = _max_diff(_hf_logits(_load_hf_dir(tmp_path), x), _ours_logits(ours, x))
    print(f"\n{preset}: to_hf -> from_pretrained max|diff| = {diff:.2e}")
    assert diff <= TOL
    back = from_hf(tmp_path)
    assert _max_diff(_ours_logits(back, x), _ours_logits(ours, x)) == 0.0


def test_export_ntk_rope_folds_into_theta(tmp_path):
    """Static NTK scaling is RoPE with base theta * factor^(hd/(hd-2)): exported exactly."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=VOCAB,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        hidden_dim=96,
        max_seq_len=64,
        rope_scaling="ntk",
        rope_factor=4.0,
    )
    ours = Transformer(cfg).eval()
    to_hf(ours, tmp_path)
    x = _tokens(4, length=40)
    assert _max_diff(_hf_logits(_load_hf_dir(tmp_path), x), _ours_logits(ours, x)) <= TOL
    back = config_from_hf(transformers.AutoConfig.from_pretrained(str(tmp_path)))
    assert back.rope_scaling == "none" and back.rope_theta == pytest.approx(10000 * 4 ** (16 / 14))


# ----------------------------------------------------------------------------------------------
# Our checkpoint format


@pytest.mark.parametrize("name", ["gpt2", "llama_mha"])
def test_checkpoint_round_trip(name, tmp_path):
    ours = from_hf(_hf_model(name))
    save_checkpoint(ours, tmp_path / "ckpt")
    meta = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert meta["format"] == "llm-foundry" and meta["version"] == 1
    assert ModelConfig.from_dict(meta["model"]) == ours.cfg
    loaded = load_checkpoint(tmp_path / "ckpt")
    assert not loaded.training
    if ours.cfg.tie_embeddings:
        assert loaded.lm_head.weight is loaded.tok_emb.weight
    x = _tokens(5)
    assert _max_diff(_ours_logits(loaded, x), _ours_logits(ours, x)) == 0.0


def test_convert_functions(tmp_path):
    hf = _hf_model("qwen3")
    hf.save_pretrained(str(tmp_path / "hf"))
    convert_from_hf(tmp_path / "hf", tmp_path / "ckpt")
    convert_to_hf(tmp_path / "ckpt", tmp_path / "hf2")
    x = _tokens(6)
    ref = _hf_logits(hf, x)
    assert _max_diff(_ours_logits(load_checkpoint(tmp_path / "ckpt"), x), ref) <= TOL
    assert _max_diff(_hf_logits(_load_hf_dir(tmp_path / "hf2"), x), ref) <= TOL


def test_convert_cli_both_ways(tmp_path, capsys):
    from llm_foundry.cli import main

    hf = _hf_model("gpt2")
    hf.save_pretrained(str(tmp_path / "hf"))
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ck")]) == 0
    args = ["convert", "--to-hf", str(tmp_path / "ck"), "--out", str(tmp_path / "hf2"), "--json"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out.split("\n", 1)[1])
    assert report["format"] == "hf" and "model.safetensors" in report["files"]
    x = _tokens(7)
    ref = _hf_logits(hf, x)
    assert _max_diff(_ours_logits(load_checkpoint(tmp_path / "ck"), x), ref) <= TOL
    assert _max_diff(_hf_logits(_load_hf_dir(tmp_path / "hf2"), x), ref) <= TOL


def test_convert_cli_reports_missing_directory(tmp_path, capsys):
    from llm_foundry.cli import main

    assert main(["convert", "--from-hf", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert "config.json" in capsys.readouterr().err


def test_load_checkpoint_refuses_hf_directory(tmp_path):
    _hf_model("llama_mha").save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="Hugging Face checkpoint"):
        load_checkpoint(tmp_path)


# ----------------------------------------------------------------------------------------------
# Refusals: each names the setting and its value


@pytest.mark.parametrize(
    "hf_config, needle",
    [
        (
            transformers.GPT2Config(scale_attn_by_inverse_layer_idx=True),
            "scale_attn_by_inverse_layer_idx=True",
        ),
        (transformers.GPT2Config(reorder_and_upcast_attn=True), "reorder_and_upcast_attn=True"),
        (transformers.GPT2Config(activation_function="tanh"), "activation_function='tanh'"),
        (transformers.LlamaConfig(**LLAMA_SIZES, hidden_act="relu"), "hidden_act='relu'"),
        (
            transformers.LlamaConfig(
                **LLAMA_SIZES, rope_scaling={"rope_type": "dynamic", "factor": 2.0}
            ),
            "rope_type='dynamic'",
        ),
        (
            transformers.Qwen3Config(
                **LLAMA_SIZES, use_sliding_window=True, sliding_window=4, max_window_layers=1
            ),
            "max_window_layers=1",
        ),
        (transformers.BertConfig(), "model_type='bert'"),
    ],
)
def test_unsupported_hf_setting_is_refused(hf_config, needle):
    with pytest.raises(ConversionError) as err:
        config_from_hf(hf_config)
    assert needle in str(err.value)


def test_export_refuses_what_no_family_has():
    # ALiBi exports as BLOOM only with BLOOM's other traits (here: no LayerNorm after embedding)
    alibi = get_preset("bloom-560m", n_layers=1, vocab_size=VOCAB, dim=64, n_heads=4)
    with pytest.raises(ConversionError, match="bloom: embed_norm=False blocks export"):
        config_to_hf(alibi.replace(embed_norm=False))
    post = ModelConfig(vocab_size=VOCAB, dim=64, n_layers=1, n_heads=4, norm_position="post")
    with pytest.raises(ConversionError, match="norm_position='post' blocks export"):
        to_hf(Transformer(post), "unused-dir")
    qk_bias = ModelConfig(
        vocab_size=VOCAB, dim=64, n_layers=1, n_heads=4, qk_norm=True, mlp_bias=True
    )
    with pytest.raises(ConversionError, match="qwen3: mlp_bias=True blocks export"):
        config_to_hf(qk_bias)


def test_unexpected_hf_tensor_is_refused(tmp_path):
    hf = _hf_model("llama_mha")
    hf.save_pretrained(str(tmp_path))
    from safetensors.torch import load_file, save_file

    sd = load_file(str(tmp_path / "model.safetensors"))
    sd["model.layers.0.self_attn.extra.weight"] = torch.zeros(3)
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConversionError, match="extra.weight"):
        from_hf(tmp_path)


def test_directory_without_safetensors_is_refused(tmp_path):
    transformers.LlamaConfig(**LLAMA_SIZES).save_pretrained(str(tmp_path))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        from_hf(tmp_path)


def test_to_hf_takes_a_run_directory_and_carries_either_tokenizer(tmp_path, capsys):
    """Both our tokenizers go with the export as files AutoTokenizer reads (the character one as
    its HF equivalent), each encoding as ours does; our loader reads them back as the same kind."""
    from transformers import AutoTokenizer

    from llm_foundry.cli import main
    from llm_foundry.tokenizer import BPETokenizer, CharTokenizer, load_tokenizer
    from llm_foundry.train.state import LATEST

    text = "to be or not to be, that is the question\n" * 20
    for kind, tok in (("char", CharTokenizer.train(text)), ("bpe", BPETokenizer.train(text, 280))):
        run = tmp_path / kind
        cfg = get_preset("llama-shakespeare-char", vocab_size=tok.vocab_size, n_layers=1)
        save_checkpoint(Transformer(cfg), run / "checkpoints" / "step_000001")
        tok.save(run / "checkpoints" / "step_000001" / "tokenizer.json")
        (run / "checkpoints" / LATEST).write_text(json.dumps({"path": "step_000001"}))
        out = tmp_path / f"hf-{kind}"
        assert main(["convert", "--to-hf", str(run), "--out", str(out)]) == 0
        assert "not copied" not in capsys.readouterr().err
        hf_tok = AutoTokenizer.from_pretrained(str(out))
        assert hf_tok("to be,\nor")["input_ids"] == tok.encode("to be,\nor"), kind
        back = load_tokenizer(out / "tokenizer.json")
        assert back.kind == kind and back.encode(text) == tok.encode(text)


def test_weights_that_do_not_match_config_json_are_named(tmp_path):
    save_checkpoint(Transformer(get_preset("llama-shakespeare-char", n_layers=1)), tmp_path)
    meta = json.loads((tmp_path / "config.json").read_text())
    meta["model"]["dim"] = 64
    (tmp_path / "config.json").write_text(json.dumps(meta))
    with pytest.raises(
        ValueError,
        match=r"model.safetensors does not match .*config.json: tok_emb.weight is "
        r"\(65, 128\) in the file, the config builds \(65, 64\)",
    ):
        load_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="is an llm-foundry checkpoint already; --to-hf"):
        convert_from_hf(tmp_path, tmp_path / "again")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        load_checkpoint(tmp_path)


# ----------------------------------------------------------------------------------------------
# Experts


def test_fused_expert_layout_on_disk_reads_like_the_per_expert_one(tmp_path):
    """Checkpoints written from transformers 5's in-memory layout hold each layer's experts as
    two fused tensors (gate_up_proj, down_proj); save_pretrained writes one tensor per expert."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    hf = _hf_model("mixtral")
    hf.save_pretrained(str(tmp_path / "per_expert"))
    with safe_open(str(tmp_path / "per_expert" / "model.safetensors"), "pt") as f:
        assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in f.keys()
    hf.config.save_pretrained(str(tmp_path / "fused"))
    fused = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused
    save_file(fused, str(tmp_path / "fused" / "model.safetensors"), metadata={"format": "pt"})
    x = _tokens()
    ref = _ours_logits(from_hf(tmp_path / "per_expert"), x)
    assert _max_diff(_ours_logits(from_hf(tmp_path / "fused"), x), ref) == 0.0
    assert _max_diff(ref, _hf_logits(hf, x)) <= TOL


def test_a_checkpoint_missing_an_expert_is_refused_naming_it(tmp_path):
    from safetensors.torch import load_file, save_file

    _hf_model("mixtral").save_pretrained(str(tmp_path))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        ConversionError, match=r"layers\.1\.mlp\.w3: no HF tensor for expert\(s\) \[2\]"
    ):
        from_hf(tmp_path)


def test_expert_configs_without_an_exact_counterpart_are_refused():
    dense_layers = transformers.Qwen3MoeConfig(
        **LLAMA_SIZES, num_attention_heads=4, moe_intermediate_size=48, num_experts=4,
        mlp_only_layers=[1],
    )  # fmt: skip
    with pytest.raises(ConversionError, match=r"mlp_only_layers=\[1\]"):
        config_from_hf(dense_layers)
    no_experts = transformers.MixtralConfig(**LLAMA_SIZES, num_local_experts=2)
    no_experts.num_experts_per_tok = 3
    with pytest.raises(ConversionError, match=r"num_local_experts=2, num_experts_per_tok=3"):
        config_from_hf(no_experts)
    shared = get_preset("moe-shakespeare-char", n_shared_experts=1)
    with pytest.raises(ConversionError, match=r"n_shared_experts=1 blocks export"):
        config_to_hf(shared)
    # a model with experts never exports as a dense family (the experts would be dropped)
    with pytest.raises(ConversionError, match=r"n_experts=4 blocks export"):
        config_to_hf(get_preset("moe-shakespeare-char"), family="llama")
    assert type(config_to_hf(get_preset("moe-shakespeare-char"))).__name__ == "MixtralConfig"


@pytest.mark.parametrize(
    "preset, family",
    [
        ("bloom-560m", "BloomConfig"),
        ("falcon-7b", "FalconConfig"),
        ("mixtral-8x7b", "MixtralConfig"),
        ("qwen3-30b-a3b", "Qwen3MoeConfig"),
    ],
)
def test_every_family_preset_maps_to_its_hf_config_and_back(preset, family):
    cfg = get_preset(preset)
    hf_config = config_to_hf(cfg)
    assert type(hf_config).__name__ == family
    back = config_from_hf(hf_config)

    def resolved(c):  # derived sizes in place of "not given"
        return c.replace(
            hidden_dim=c.ffn_dim,
            expert_hidden_dim=c.expert_ffn_dim if c.n_experts else None,
            n_kv_heads=c.kv_heads,
            head_dim=c.head_size,
            init_std=0.02,
        )

    assert resolved(back) == resolved(cfg)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: _build("falcon_7b_layout_mqa", alibi=True), r"alibi=True is not supported"),
        (
            lambda: _build("bloom_tied", apply_residual_connection_post_layernorm=True),
            r"apply_residual_connection_post_layernorm=True is not supported",
        ),
    ],
)
def test_family_settings_without_an_exact_counterpart_are_refused(make, message):
    with pytest.raises(ConversionError, match=message):
        config_from_hf(make().config)


@pytest.mark.parametrize(
    "name", ["bloom_6_heads_untied", "falcon_40b_layout_gqa_two_norms", "qwen3_moe_tied"]
)
def test_convert_command_round_trips_the_new_families(name, tmp_path, capsys):
    from llm_foundry.cli import main

    hf = _hf_model(name)
    hf.save_pretrained(str(tmp_path / "hf"))
    assert (
        main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ours")]) == 0
    )
    assert (
        main(["convert", "--to-hf", str(tmp_path / "ours"), "--out", str(tmp_path / "back")]) == 0
    )
    x = _tokens()
    back = _load_hf_dir(tmp_path / "back")
    assert type(back).__name__ == type(hf).__name__
    assert _max_diff(_hf_logits(back, x), _hf_logits(hf, x)) <= TOL
