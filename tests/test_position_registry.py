"""Adding a variant is one class and one name in its component's registry: a position encoding
defined here and registered by a pytest plugin runs through the existing parametrized attention,
KV-cache and causality tests without editing them, and a broken one fails them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llm_foundry.config import ConfigError, ModelConfig
from llm_foundry.models import Transformer
from llm_foundry.models.position import POSITION_NAMES, POSITIONS

ROOT = Path(__file__).resolve().parents[1]

# "reverse-linear": ALiBi turned around, each head adds +slope * (query_pos - key_pos), so
# farther keys score higher; a bias like ALiBi's, so it works with the KV cache and windows
REVERSE_LINEAR = """
import pytest
import torch
from llm_foundry.models.position import POSITIONS, NoPosition


class ReverseLinearBias(NoPosition):
    has_bias = True

    def __init__(self, cfg):
        super().__init__()
        self.register_buffer("slopes", torch.linspace(0.05, 0.2, cfg.n_heads), persistent=False)

    def bias(self, q_pos, k_pos):
        distance = (q_pos[:, None] - k_pos[None, :]).to(self.slopes.dtype)  # (T, S), >= 0: past
        return self.slopes[:, None, None] * distance[None]  # (H, T, S)


POSITIONS["reverse-linear"] = ReverseLinearBias
"""

# "future-leak": adds the mean of all the input's embeddings to each one, so a position sees
# tokens after it; the parametrized tests must catch that
FUTURE_LEAK = """
from llm_foundry.models.position import POSITIONS, NoPosition


class FutureLeak(NoPosition):
    def embed(self, x, start, pad=None):
        return x + x.mean(dim=1, keepdim=True)


POSITIONS["future-leak"] = lambda cfg: FutureLeak()
"""

SUITES = ["tests/test_attention.py", "tests/test_kv_cache.py"]
PARAMETRIZED = [  # the tests that take every registered position encoding
    "test_sdpa_model_equals_manual_model",
    "test_causality",
    "test_cached_logits_equal_full_forward",
    "test_cached_greedy_equals_recompute",
]


def run_suites_with(plugin: str, name: str, tmp_path: Path) -> tuple[int, dict[str, str]]:
    """Run the attention and KV-cache test files with ``plugin`` registering ``name``, keeping
    only the cases of that name; returns pytest's exit code and {test id: outcome}."""
    (tmp_path / "scratch_position.py").write_text(plugin)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "pytest", "-p", "scratch_position", "-q", "-rA", "-k", name]
    cmd += ["-p", "no:cacheprovider", *SUITES]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    outcomes = dict(
        (test, outcome)
        for outcome, test in re.findall(r"^(PASSED|FAILED|ERROR) (\S+)", r.stdout, re.M)
    )
    return r.returncode, outcomes


@pytest.mark.heavy
def test_a_registered_position_runs_through_the_existing_tests(tmp_path):
    code, outcomes = run_suites_with(REVERSE_LINEAR, "reverse-linear", tmp_path)
    assert code == 0, outcomes
    for test in PARAMETRIZED:
        cases = [t for t in outcomes if f"::{test}[" in t]
        assert cases and all(outcomes[t] == "PASSED" for t in cases), (test, outcomes)
    assert len(outcomes) >= 3 * len(PARAMETRIZED)  # MHA, GQA and MQA of each


@pytest.mark.heavy
def test_a_broken_registered_position_fails_them(tmp_path):
    code, outcomes = run_suites_with(FUTURE_LEAK, "future-leak", tmp_path)
    assert code == 1, outcomes
    failed = {t.split("::")[1].split("[")[0] for t, o in outcomes.items() if o == "FAILED"}
    assert {"test_causality", "test_cached_logits_equal_full_forward"} <= failed, outcomes


def test_config_accepts_exactly_the_registered_names(monkeypatch):
    assert "reverse-linear" not in POSITION_NAMES
    try:
        ModelConfig(pos_encoding="reverse-linear")
    except ConfigError as e:
        assert "is not one of learned, sinusoidal, rope, alibi, none" in str(e)
    else:
        raise AssertionError("an unregistered name was accepted")
    monkeypatch.setitem(POSITIONS, "reverse-linear", None)  # removed again after the test
    exec(REVERSE_LINEAR, {})  # registers the class, as the plugin does
    assert "reverse-linear" in POSITION_NAMES
    cfg = ModelConfig(vocab_size=11, dim=16, n_layers=1, n_heads=2, pos_encoding="reverse-linear")
    model = Transformer(cfg)
    assert type(model.pos).__name__ == "ReverseLinearBias" and model.needs_mask
    assert torch.isfinite(model(torch.randint(0, 11, (1, 5)))[0]).all()


def test_what_is_asked_of_a_position_kind_comes_from_its_class(monkeypatch):
    """Other modules ask a scheme's traits, never its name: a new kind with a per-head bias is
    refused by tensor parallelism and left out of the memory report's tp rows, with no edit
    outside its own file; trained rows fix max_seq_len for an init_from."""
    from llm_foundry.models.position import position_traits
    from llm_foundry.train.memory import memory_report
    from llm_foundry.train.tensor_parallel import tp_problems

    monkeypatch.setitem(POSITIONS, "reverse-linear", None)
    exec(REVERSE_LINEAR, {})
    cfg = ModelConfig(vocab_size=11, dim=16, n_layers=1, n_heads=2, pos_encoding="reverse-linear")
    assert position_traits(cfg).has_bias
    assert any("'reverse-linear': its per-head bias" in p for p in tp_problems(cfg, 2))
    assert "tp" in memory_report(cfg, 2, 2)["unavailable"]
    learned, rope = (cfg.replace(pos_encoding=k) for k in ("learned", "rope"))
    assert position_traits(learned).trained_rows and position_traits(learned).absolute
    assert not position_traits(rope).trained_rows
    longer = {"max_seq_len": cfg.max_seq_len * 2}
    assert learned.weight_differences(learned.replace(**longer))  # a bigger table
    assert not rope.weight_differences(rope.replace(**longer))
    monkeypatch.setitem(POSITIONS, "none-factory", lambda c: POSITIONS["none"](c))
    assert position_traits(cfg.replace(pos_encoding="none-factory")).__name__ == "NoPosition"
