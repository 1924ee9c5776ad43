"""The single-file tutorial model (tutorials/model.py) must equal the library model exactly.

It is imported by file path (``tutorials`` is not a package), loaded with the weights of a library
``Transformer`` in its LLaMA configuration, and compared on random tokens.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from llm_foundry.config import ModelConfig
from llm_foundry.models import Transformer

TUTORIAL_PATH = Path(__file__).resolve().parents[1] / "tutorials" / "model.py"


def _load_tutorial():
    spec = importlib.util.spec_from_file_location("llm_foundry_tutorial_model", TUTORIAL_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up while building the class
    spec.loader.exec_module(module)
    return module


tut = _load_tutorial()

# (n_kv_heads, tie_embeddings, rope_theta): MHA, GQA, MQA, each tied and untied
CASES = [
    pytest.param(4, False, 10000.0, id="mha-untied"),
    pytest.param(4, True, 10000.0, id="mha-tied"),
    pytest.param(2, False, 10000.0, id="gqa-untied"),
    pytest.param(2, True, 1e6, id="gqa-tied-theta1e6"),
    pytest.param(1, False, 10000.0, id="mqa-untied"),
    pytest.param(1, True, 500000.0, id="mqa-tied-theta5e5"),
]


def _pair(n_kv_heads: int, tie: bool, theta: float, seed: int = 0):
    """A library model with random weights and a tutorial model holding the same weights."""
    torch.manual_seed(seed)
    size = dict(vocab_size=97, dim=64, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads)
    size.update(hidden_dim=160, max_seq_len=32, rope_theta=theta, norm_eps=1e-5)
    lib_cfg = ModelConfig(
        **size,
        pos_encoding="rope",
        norm="rmsnorm",
        mlp="swiglu",
        norm_position="pre",
        attn_bias=False,
        mlp_bias=False,
        tie_embeddings=tie,
    )
    lib = Transformer(lib_cfg).eval()
    # Norm gains start at exactly 1; perturb them so that a swapped or skipped norm would show.
    with torch.no_grad():
        for name, p in lib.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    model = tut.Transformer(tut.Config(**size, tie_embeddings=tie)).eval()
    # Same state-dict names on both sides: a strict load proves that no key is missing or extra.
    model.load_state_dict(lib.state_dict(), strict=True)
    return lib, model


@pytest.mark.parametrize(("n_kv_heads", "tie", "theta"), CASES)
def test_same_logits_and_loss(n_kv_heads, tie, theta):
    lib, model = _pair(n_kv_heads, tie, theta)
    idx = torch.randint(0, 97, (3, 32))  # full max_seq_len: every RoPE row is used
    targets = torch.randint(0, 97, (3, 32))
    with torch.no_grad():
        lib_logits, lib_loss = lib(idx, targets)
        tut_logits, tut_loss = model(idx, targets)
        short_lib, _ = lib(idx[:, :7])
        short_tut, _ = model(idx[:, :7])
    assert tut_logits.shape == lib_logits.shape == (3, 32, 97)
    assert (tut_logits - lib_logits).abs().max().item() <= 1e-5
    assert (short_tut - short_lib).abs().max().item() <= 1e-5
    assert abs(tut_loss.item() - lib_loss.item()) <= 1e-5


@pytest.mark.parametrize(("n_kv_heads", "tie", "theta"), CASES)
def test_same_parameter_count(n_kv_heads, tie, theta):
    lib, model = _pair(n_kv_heads, tie, theta)
    n_tut = sum(p.numel() for p in model.parameters())
    assert n_tut == lib.num_params()
    assert sum(tut.param_breakdown(model).values()) == n_tut
    assert (model.lm_head.weight is model.tok_emb.weight) == tie
    # the names and shapes of the learned tensors agree one to one
    lib_shapes = {k: v.shape for k, v in lib.state_dict().items()}
    assert {k: v.shape for k, v in model.state_dict().items()} == lib_shapes


def test_default_hidden_dim_matches_library():
    for dim in (64, 96, 256, 4096):
        lib_cfg = ModelConfig(dim=dim, n_heads=4, mlp="swiglu")
        assert tut.Config(dim=dim, n_heads=4, n_kv_heads=4).hidden_dim == lib_cfg.ffn_dim


def test_attention_is_causal():
    torch.manual_seed(0)
    cfg = tut.Config(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=50, max_seq_len=16)
    model = tut.Transformer(cfg).eval()
    idx = torch.randint(0, 50, (1, 16))
    changed = idx.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 50  # alter only the future of position 9
    with torch.no_grad():
        a, _ = model(idx)
        b, _ = model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_imports_only_torch_and_stdlib():
    tree = ast.parse(TUTORIAL_PATH.read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            roots.add((node.module or "").split(".")[0])
    assert roots - set(sys.stdlib_module_names) <= {"torch"}


def test_demo_runs(capsys):
    tut.demo()
    out = capsys.readouterr().out
    assert "total" in out and "logits (2, 10, 100)" in out
