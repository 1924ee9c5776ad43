"""The frozen reference of preference tuning (train/dpo.py): the log-probabilities the starting
weights give each sequence, scored batch by batch or precomputed once.

    model        LoRA: the policy itself with its adapters left out (its base is the start);
                 full fine-tuning: a frozen copy of ``train.init_from``'s weights
    precomputed  the same, run once over every pair of both splits before training; the table
                 (pairs, 2) of each split is kept in the run directory (REFERENCE_FILE), so a
                 resumed run reads it instead of scoring again, and the frozen copy is let go
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from llm_foundry.models import Transformer
from llm_foundry.models.lora import lora_layers
from llm_foundry.train.dpo import sequence_logps

REFERENCE_FILE = "reference_logps.safetensors"


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module):
    """``model`` computing as its base: each unmerged LoRA layer marked merged for the duration,
    which makes its forward return the base projection alone (no weight is touched)."""
    layers = [m for m in lora_layers(model).values() if not m.merged]
    for m in layers:
        m.merged = True
    try:
        yield model
    finally:
        for m in layers:
            m.merged = False


class ModelReference:
    """Scores each batch with the starting weights: ``frozen`` (a copy), or ``model`` with its
    adapters off when ``frozen`` is None."""

    def __init__(self, model: torch.nn.Module, frozen: Transformer | None, autocast):
        self.model, self.frozen, self.autocast = model, frozen, autocast

    @torch.no_grad()
    def logps(self, x: torch.Tensor, y: torch.Tensor, pairs=None, split=None) -> torch.Tensor:
        """x, y (2B, T) -> (2B,) fp32 summed completion log-probabilities (``pairs``, ``split``:
        unused, the stored reference's keys)."""
        use = (
            adapters_off(self.model) if self.frozen is None else contextlib.nullcontext(self.frozen)
        )
        with use as net, self.autocast():
            was = net.training
            net.eval()  # no dropout in the reference
            try:
                return sequence_logps(net(x)[0], y)
            finally:
                net.train(was)


class StoredReference:
    """The reference log-probabilities of every pair, looked up: ``table[split]`` (pairs, 2),
    chosen then rejected, fp32 on the CPU."""

    def __init__(self, table: dict[str, torch.Tensor]):
        self.table = table

    def logps(self, x: torch.Tensor, y: torch.Tensor, pairs: torch.Tensor, split: str):
        """(2B,) on x's device: the B chosen sequences' values, then the B rejected ones."""
        rows = self.table[split][pairs.cpu()]  # (B, 2)
        return torch.cat([rows[:, 0], rows[:, 1]]).to(x.device)


def frozen_copy(model_cfg, init_from: str | Path, device: torch.device) -> Transformer:
    """The starting weights as a model of their own, frozen, in eval mode."""
    from llm_foundry.train.build import load_initial_weights

    model = Transformer(model_cfg).to(device)
    load_initial_weights(model, Path(init_from))
    return model.eval().requires_grad_(False)


def score_all(reference: ModelReference, samplers: dict, batch_size: int, device) -> dict:
    """split -> (pairs, 2) fp32: every pair of each split's PreferenceSampler scored in order."""
    table = {}
    for split, sampler in samplers.items():
        out = torch.zeros(sampler.pairs, 2)
        for start in range(0, sampler.pairs, batch_size):
            pairs = np.arange(start, min(start + batch_size, sampler.pairs))
            x, y = (t.to(device) for t in sampler.rows(pairs))
            chosen, rejected = reference.logps(x, y).float().cpu().chunk(2)
            out[pairs] = torch.stack([chosen, rejected], dim=1)
        table[split] = out
    return table


def save_table(path: Path, table: dict[str, torch.Tensor]) -> None:
    """Write the table under a temporary name, then rename it into place."""
    tmp = path.with_name(f".{path.name}.tmp")
    save_file({k: v.contiguous() for k, v in table.items()}, str(tmp))
    tmp.replace(path)


def load_table(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the run's precomputed reference "
                                "log-probabilities (train.dpo_reference=precomputed); start the "
                                "run again without --resume")  # fmt: skip
    return load_file(str(path))
