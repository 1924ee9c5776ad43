"""Greedy decoding with our KV cache equals HF transformers ``generate`` token for token, on
weights imported from small random HF models: Llama (GQA, tied), Qwen3 (QK-norm, explicit
head_dim), GPT-2 (learned positions, LayerNorm biases) and Mistral (a sliding window shorter than
the sequence). Norms and biases are perturbed (see ``test_interop_hf._hf_model``) so that a
dropped or swapped one would show, and the matrices scaled up: at HF's initialisation (std 0.02)
greedy decoding repeats one token, which would hide a wrong position or cache entry."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))
from conftest import assert_decisive  # noqa: E402
from test_interop_hf import VOCAB, _hf_model  # noqa: E402

from llm_foundry.generate import generate, generate_batch, stream  # noqa: E402
from llm_foundry.interop.hf import from_hf  # noqa: E402

NEW = 20
NAMES = ["llama_gqa_tied", "qwen3", "gpt2", "mistral_window"]


def _lively(name: str):
    """``_hf_model(name)`` with every matrix scaled by 8: varied greedy continuations whose
    top-two logits stay well apart (>= 1e-3 here; ``_hf_greedy`` checks every choice), so fp32
    rounding cannot flip an argmax."""
    hf = _hf_model(name)
    with torch.no_grad():
        for p in hf.parameters():
            if p.ndim == 2:
                p.mul_(8.0)
    return hf


def _prompts(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _hf_greedy(hf, idx: torch.Tensor, n: int = NEW, **kw) -> torch.Tensor:
    """HF greedy decoding (its own KV cache) for ``n`` tokens; no eos unless given in ``kw``."""
    kw = {"eos_token_id": None, "min_new_tokens": n, **kw}
    out = hf.generate(
        idx,
        attention_mask=torch.ones_like(idx),
        max_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
        **kw,
    )
    # HF's choices, read from its full forward: none within rounding of a tie
    assert_decisive(hf(input_ids=out[:, :-1]).logits[:, idx.shape[1] - 1 :], "HF greedy")
    return out


@pytest.fixture(scope="module", params=NAMES)
def pair(request):
    hf = _lively(request.param)
    return request.param, hf, from_hf(hf)


@pytest.mark.parametrize("batch", [1, 2])
def test_greedy_equals_transformers_generate(pair, batch):
    name, hf, ours = pair
    idx = _prompts(batch, 7, seed=batch)
    want = _hf_greedy(hf, idx)
    got = generate(ours, idx, NEW, temperature=0)
    assert got.shape == (batch, 7 + NEW)
    assert torch.equal(got, want), f"{name}: first difference at {_first_diff(got, want)}"
    assert len(set(want[:, 7:].flatten().tolist())) > 2, "degenerate continuation proves little"


def test_ragged_batch_equals_transformers_on_each_prompt(pair):
    """generate_batch left-pads; each row must equal HF generating that prompt alone."""
    name, hf, ours = pair
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (4, 11, 7)]
    batched = generate_batch(ours, prompts, NEW, temperature=0)
    for p, row in zip(prompts, batched, strict=True):
        want = _hf_greedy(hf, torch.tensor([p]))[0].tolist()
        assert row == want, f"{name}, prompt of {len(p)}: ours {row} vs HF {want}"


@pytest.mark.parametrize("name", ["llama_gqa_tied", "gpt2"])
def test_eos_stops_like_transformers(name):
    """An eos id that the greedy continuation produces mid-way ends both at the same place."""
    hf = _lively(name)
    ours = from_hf(hf)
    idx = _prompts(1, 7, seed=9)
    free = _hf_greedy(hf, idx)[0, 7:].tolist()
    eos = free[8]
    want = _hf_greedy(hf, idx, eos_token_id=eos, min_new_tokens=0)[0].tolist()
    assert want[7:] == free[: free.index(eos) + 1]
    assert generate_batch(ours, [idx[0].tolist()], NEW, temperature=0, eos_id=eos)[0] == want
    steps = [int(t[0]) for t in stream(ours, idx, NEW, temperature=0, eos_id=eos)]
    assert steps == want[7:]


def _first_diff(a: torch.Tensor, b: torch.Tensor):
    diff = (a != b).nonzero()
    return tuple(diff[0].tolist()) if len(diff) else None
