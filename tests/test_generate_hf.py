"""Greedy decoding with the KV cache equals HF transformers ``generate`` on imported weights."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_interop_hf import VOCAB, _hf_model  # noqa: E402

from llm_foundry.generate import generate, generate_batch  # noqa: E402
from llm_foundry.interop.hf import from_hf  # noqa: E402

NEW = 20


def _hf_greedy(hf, idx: torch.Tensor) -> torch.Tensor:
    return hf.generate(
        idx,
        attention_mask=torch.ones_like(idx),
        max_new_tokens=NEW,
        min_new_tokens=NEW,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )


@pytest.mark.parametrize("name", ["llama_gqa_tied", "qwen3", "gpt2", "mistral_window"])
@pytest.mark.parametrize("batch", [1, 2])
@torch.no_grad()
def test_greedy_equals_transformers_generate(name, batch):
    hf = _hf_model(name)
    ours = from_hf(hf)
    idx = torch.randint(0, VOCAB, (batch, 7), generator=torch.Generator().manual_seed(batch))
    assert torch.equal(generate(ours, idx, NEW, temperature=0), _hf_greedy(hf, idx))


@pytest.mark.parametrize("name", ["llama_gqa_tied", "gpt2"])
@torch.no_grad()
def test_ragged_batch_equals_transformers_on_each_prompt(name):
    hf = _hf_model(name)
    ours = from_hf(hf)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (4, 11)]
    batched = generate_batch(ours, prompts, NEW, temperature=0)
    for p, row in zip(prompts, batched, strict=True):
        assert row == _hf_greedy(hf, torch.tensor([p]))[0].tolist()
