"""Validation scores global batches: ``eval_batches`` x (batch_size x grad_accum x ranks)
sequences, so the same weights get the same val loss however the global batch is split between
ranks and accumulation. The reference is the mean token loss of those sequences, computed here
in one forward pass per global batch from the model's logits and torch's cross-entropy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import make_trainer, reversal_sft

from llm_foundry.data.batches import IGNORE
from llm_foundry.data.loader import Loader, PreparedSplit
from llm_foundry.data.sft import SFTSampler

GLOBAL = 8  # sequences per validation batch
EVAL_BATCHES = 3


@pytest.fixture(scope="module")
def text_dir(char_data) -> Path:
    return char_data(30_000)


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory) -> Path:
    """Prompt/completion rows with 1-7 completion characters: micro-batches hold different
    numbers of targets, so their means must be weighed by them."""
    return reversal_sft(tmp_path_factory.mktemp("sft"), 80, 0.3)


def reference_loss(model, sampler, batches: int) -> float:
    """The mean over ``batches`` global batches of the mean loss over each one's targets."""
    model.eval()
    means = []
    with torch.no_grad():
        for _ in range(batches):
            x, y = sampler.next()
            logits = model(x)[0]  # (B, T, V)
            flat = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE,
                                   reduction="sum")  # fmt: skip
            means.append(flat.item() / (y != IGNORE).sum().item())
    return sum(means) / len(means)


@pytest.mark.parametrize("kind", ["text", "sft"])
def test_val_loss_is_that_of_the_global_batch_whatever_the_accumulation(kind, text_dir, sft_dir,
                                                                        tmp_path):  # fmt: skip
    data = text_dir if kind == "text" else sft_dir
    block = 32 if kind == "text" else 16
    settings = dict(block_size=block, eval_batches=EVAL_BATCHES, seed=3)
    model = dict(max_seq_len=block, dropout=0.0)
    whole = make_trainer(data, tmp_path / "whole", model=model, batch_size=GLOBAL, **settings)
    split = make_trainer(data, tmp_path / "split", model=model, batch_size=GLOBAL // 4,
                         grad_accum=4, **settings)  # fmt: skip
    try:
        split.model.load_state_dict(whole.model.state_dict())  # the same weights
        if kind == "text":
            sampler = Loader([PreparedSplit(data, "val")], None, block, GLOBAL, seed=4)
        else:
            sampler = SFTSampler(data, "val", block, GLOBAL, seed=4)
        want = reference_loss(whole.model, sampler, EVAL_BATCHES)
        got_whole, got_split = whole.evaluate(), split.evaluate()
    finally:
        whole.release()
        split.release()
    print(f"{kind}: reference {want:.6f}, batch 8 {got_whole:.6f}, 4 micro-batches of 2 "
          f"{got_split:.6f}")  # fmt: skip
    assert got_whole == pytest.approx(want, rel=1e-5)
    assert got_split == pytest.approx(want, rel=1e-5)
