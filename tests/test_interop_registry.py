"""Adding an HF family is one module and one ``register`` call: Phi-3 (transformers'
``Phi3ForCausalLM``: q/k/v fused in ``qkv_proj``, gate and up fused in ``gate_up_proj``, RoPE,
RMSNorm, SwiGLU) defined here and registered by a pytest plugin runs through the existing
parity tests of tests/test_interop_hf.py without editing them, and a broken one fails them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from llm_foundry.config import ModelConfig  # noqa: E402
from llm_foundry.interop.hf import (  # noqa: E402
    FAMILIES,
    ConversionError,
    config_from_hf,
    config_to_hf,
)

ROOT = Path(__file__).resolve().parents[1]

# Phi-3 is LLaMA with two fused projections and no biases: its q/k/v rows are [q, k, v] (as
# Phi3Attention slices them) and its gate_up rows [gate, up] (as Phi3MLP chunks them)
PHI3 = """
from llm_foundry.interop.hf import Family, Rule, register
from llm_foundry.interop.hf.core import DENSE
from llm_foundry.interop.hf.llama import (
    LLAMA_IGNORED, ROPE_NEEDS, TINY, llama_fields, llama_fields_to_hf,
)

QKV = ("layers.{i}.attn.wq.weight", "layers.{i}.attn.wk.weight", "layers.{i}.attn.wv.weight")
GATE_UP = ("layers.{i}.mlp.w1.weight", "layers.{i}.mlp.w3.weight")
WEIGHTS = {
    "model.embed_tokens.weight": "tok_emb.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
    "model.layers.{i}.input_layernorm.weight": "layers.{i}.attn_norm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.mlp_norm.weight",
    "model.layers.{i}.self_attn.qkv_proj.weight": Rule(QKV),
    "model.layers.{i}.self_attn.o_proj.weight": "layers.{i}.attn.wo.weight",
    "model.layers.{i}.mlp.gate_up_proj.weight": Rule(GATE_UP),
    "model.layers.{i}.mlp.down_proj.weight": "layers.{i}.mlp.w2.weight",
}


def from_hf(c, problems):
    # llama_fields refuses partial_rotary_factor != 1 and RoPE types other than default/linear
    # (Phi-3's longrope); Phi-3 has no biases and one window on every layer (None: none)
    fields = llama_fields(c, problems)
    return {**fields, "attn_bias": False, "mlp_bias": False, "sliding_window": c.sliding_window}


def to_hf(cfg):
    return {**llama_fields_to_hf(cfg), "sliding_window": cfg.sliding_window}


NEEDS = [
    *ROPE_NEEDS,
    DENSE,
    ("qk_norm", lambda c: not c.qk_norm, "False"),
    ("attn_bias", lambda c: not c.attn_bias, "False (Phi-3's projections have no bias)"),
    ("mlp_bias", lambda c: not c.mlp_bias, "False (Phi-3's projections have no bias)"),
]
NO_TOKENS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
register(
    Family(
        model_type="phi3",
        title="Phi-3",
        config_class="Phi3Config",
        model_class="Phi3ForCausalLM",
        pos_encoding="rope",
        weights=WEIGHTS,
        ignored=LLAMA_IGNORED,
        prefix="model.",
        from_hf=from_hf,
        to_hf=to_hf,
        needs=NEEDS,
        examples={
            "phi3_gqa": dict(TINY, **NO_TOKENS, num_attention_heads=4, num_key_value_heads=2),
            "phi3_mqa_tied_window_theta": dict(
                TINY, **NO_TOKENS, num_attention_heads=4, num_key_value_heads=1,
                tie_word_embeddings=True, sliding_window=5, rope_theta=500.0,
            ),
        },
    )
)
"""
# the same family with gate and up swapped in gate_up_proj: shapes fit, the function differs
BROKEN_PHI3 = PHI3.replace(
    'GATE_UP = ("layers.{i}.mlp.w1.weight", "layers.{i}.mlp.w3.weight")',
    'GATE_UP = ("layers.{i}.mlp.w3.weight", "layers.{i}.mlp.w1.weight")',
)
assert BROKEN_PHI3 != PHI3

PARAMETRIZED = [  # the tests of tests/test_interop_hf.py that take every registered family
    "test_from_hf_to_hf_parity",
    "test_export_picks_the_first_family_that_fits",
]


def run_interop_tests_with(plugin: str, tmp_path: Path) -> tuple[int, dict[str, str]]:
    """Run tests/test_interop_hf.py with ``plugin`` registering Phi-3, keeping only its cases;
    returns pytest's exit code and {test id: outcome}."""
    (tmp_path / "scratch_family.py").write_text(plugin)
    path = [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "pytest", "-p", "scratch_family", "-q", "-rA", "-k", "phi3"]
    cmd += ["-p", "no:cacheprovider", "tests/test_interop_hf.py"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    outcomes = dict(
        (test, outcome)
        for outcome, test in re.findall(r"^(PASSED|FAILED|ERROR) (\S+)", r.stdout, re.M)
    )
    return r.returncode, outcomes


@pytest.mark.heavy
def test_a_registered_family_runs_through_the_parity_tests(tmp_path):
    code, outcomes = run_interop_tests_with(PHI3, tmp_path)
    assert code == 0, outcomes
    for test in PARAMETRIZED:
        cases = [t for t in outcomes if f"::{test}[phi3" in t]
        assert len(cases) == 2 and all(outcomes[t] == "PASSED" for t in cases), (test, outcomes)


@pytest.mark.heavy
def test_a_broken_registered_family_fails_them(tmp_path):
    code, outcomes = run_interop_tests_with(BROKEN_PHI3, tmp_path)
    assert code == 1, outcomes
    parity = [t for t in outcomes if "::test_from_hf_to_hf_parity[phi3" in t]
    assert len(parity) == 2 and all(outcomes[t] == "FAILED" for t in parity), outcomes


@pytest.fixture
def phi3():
    """Phi-3 registered for one test, as the plugin registers it; the registry restored after."""
    before = dict(FAMILIES)
    exec(PHI3, {})
    yield FAMILIES["phi3"]
    FAMILIES.clear()
    FAMILIES.update(before)


def _phi3_config(**kw):
    sizes = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2)
    tokens = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return transformers.Phi3Config(**sizes, **tokens, num_attention_heads=4, **kw)


def test_phi3_maps_to_the_fields_that_compute_it(phi3):
    cfg = config_from_hf(_phi3_config(num_key_value_heads=2, sliding_window=7))
    assert (cfg.pos_encoding, cfg.norm, cfg.mlp, cfg.n_kv_heads) == ("rope", "rmsnorm", "swiglu", 2)
    assert cfg.sliding_window == 7 and not (cfg.attn_bias or cfg.mlp_bias or cfg.qk_norm)
    # an attention_bias Phi-3 ignores is ignored here too
    assert not config_from_hf(_phi3_config(attention_bias=True)).attn_bias


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
        (
            dict(
                max_position_embeddings=128,
                original_max_position_embeddings=64,
                rope_parameters={
                    "rope_type": "longrope",
                    "rope_theta": 10000.0,
                    "short_factor": [1.0] * 8,
                    "long_factor": [2.0] * 8,
                },
            ),
            "rope_type='longrope'",
        ),
        (dict(hidden_act="relu"), "hidden_act='relu'"),
    ],
)
def test_phi3_settings_without_an_exact_counterpart_are_refused(phi3, kw, needle):
    with pytest.raises(ConversionError, match=re.escape(needle)):
        config_from_hf(_phi3_config(**kw))


def test_phi3_is_chosen_by_name_and_refuses_what_it_lacks(phi3):
    cfg = ModelConfig(vocab_size=97, dim=64, n_layers=1, n_heads=4, hidden_dim=96)
    assert type(config_to_hf(cfg)).__name__ == "LlamaConfig"  # registered first, fits first
    assert type(config_to_hf(cfg, family="phi3")).__name__ == "Phi3Config"
    with pytest.raises(ConversionError, match=r"as phi3: attn_bias=True blocks export"):
        config_to_hf(cfg.replace(attn_bias=True), family="phi3")


def _exports_as(cfg: ModelConfig, family: str) -> bool:
    try:
        config_to_hf(cfg, family=family)
    except ConversionError:
        return False
    return True


def test_a_family_asked_for_that_cannot_represent_the_model_says_why_and_which_can():
    """A family asked for by name (convert --family) that cannot represent the config is named
    with what blocks it and the families that can (each checked to export), not called "no
    family"; with none that can, it says so."""
    from llm_foundry.presets import get_preset

    cfg = ModelConfig(vocab_size=97, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=96)
    can = [name for name in FAMILIES if _exports_as(cfg, name)]
    assert "llama" in can and "qwen3" not in can
    with pytest.raises(ConversionError) as e:
        config_to_hf(cfg, family="qwen3")
    assert str(e.value) == (
        "cannot export to Hugging Face as qwen3: qk_norm=False blocks export (needs True (Qwen3 "
        f"always normalises q and k)); {', '.join(can)} can represent this config exactly"
    )
    with pytest.raises(ConversionError) as e:  # several problems: one line each, under the head
        config_to_hf(cfg, family="gpt2")
    head, *lines = str(e.value).split("\n")
    assert head == (f"cannot export to Hugging Face as gpt2 ({len(lines)} problems; "
                    f"{', '.join(can)} can represent this config exactly):")  # fmt: skip
    assert len(lines) > 1 and "  - pos_encoding='rope' blocks export (needs 'learned')" in lines
    shared = get_preset("moe-shakespeare-char", n_shared_experts=1)
    assert not any(_exports_as(shared, name) for name in FAMILIES)
    with pytest.raises(ConversionError) as e:
        config_to_hf(shared, family="mixtral")
    assert str(e.value).startswith("cannot export to Hugging Face as mixtral: n_shared_experts=1")
    assert str(e.value).endswith("; no other family can represent this config exactly either")
