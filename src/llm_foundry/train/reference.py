"""The frozen reference of preference tuning (train/dpo.py): the log-probabilities the starting
weights give each sequence, scored batch by batch or precomputed once.

    model        LoRA: the policy itself with its adapters left out (its base is the start);
                 full fine-tuning: a frozen copy of ``train.init_from``'s weights
    precomputed  the same, run once over every pair of both splits before training (under DDP
                 each rank scores its share and the ranks gather the table); the table
                 (pairs, 2) of each split is kept in the run directory (REFERENCE_FILE), so a
                 resumed run reads it instead of scoring again, and the frozen copy is let go

A stale reference is refused, never used: the table records what its values depend on besides
the run's own starting weights (``table_key``: the data, block_size, the precision) and a resume
that differs is refused; a frozen copy scored per batch is read from ``train.init_from`` again on
resume, so the run records those files' identity (``weights_id``) and a resume whose
``init_from`` now holds other weights is refused.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from llm_foundry.data.batches import file_check
from llm_foundry.durable import usual_mode
from llm_foundry.models import Transformer
from llm_foundry.models.lora import adapters_disabled
from llm_foundry.train.dpo import sequence_logps

REFERENCE_FILE = "reference_logps.safetensors"


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
            adapters_disabled(self.model)
            if self.frozen is None
            else contextlib.nullcontext(self.frozen)
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
    load_initial_weights(model, Path(init_from), say=False)  # the trained copy said it
    return model.eval().requires_grad_(False)


def score_all(reference: ModelReference, samplers: dict, batch_size: int, device,
              world=None) -> dict:  # fmt: skip
    """split -> (pairs, 2) fp32: every pair of each split's PreferenceSampler scored in batches
    of ``batch_size`` in order. With a distributed ``world`` (train/distributed.py) rank r scores
    batches r, r + W, ... and the ranks gather the table: each batch is the one a single process
    scores, so the table is the same bit for bit."""
    rank, size = (world.rank, world.world_size) if world is not None else (0, 1)
    table = {}
    for split, sampler in samplers.items():
        out = torch.zeros(sampler.pairs, 2)
        starts = range(0, sampler.pairs, batch_size)
        for start in starts[rank::size]:
            pairs = np.arange(start, min(start + batch_size, sampler.pairs))
            x, y = (t.to(device) for t in sampler.rows(pairs))
            chosen, rejected = reference.logps(x, y).float().cpu().chunk(2)
            out[pairs] = torch.stack([chosen, rejected], dim=1)
        table[split] = out if size == 1 else _gathered(out, batch_size, size, device)
    return table


def _gathered(mine: torch.Tensor, batch_size: int, size: int, device) -> torch.Tensor:
    """mine (pairs, 2): this rank's batches filled in -> the table whose batch b is rank
    (b mod size)'s (copied, never summed: a -0.0 stays -0.0)."""
    import torch.distributed as dist

    parts = [torch.empty_like(mine, device=device) for _ in range(size)]
    dist.all_gather(parts, mine.to(device))
    owner = torch.arange(len(mine)) // batch_size % size  # (pairs,): the rank that scored it
    return torch.stack([p.cpu() for p in parts])[owner, torch.arange(len(mine))]


def table_key(data_id: dict, block_size: int, dtype: str) -> dict:
    """What a precomputed table's values depend on besides the starting weights: the pairs (the
    data's fingerprint), where their sequences are cut (block_size), the precision scored in."""
    return {"data": data_id, "block_size": block_size, "dtype": dtype}


def save_table(path: Path, table: dict[str, torch.Tensor], key: dict) -> None:
    """Write the table with its ``table_key`` under a temporary name, then rename it into place."""
    tmp = path.with_name(f".{path.name}.tmp")
    meta = {"key": json.dumps(key, sort_keys=True)}
    save_file({k: v.contiguous() for k, v in table.items()}, str(tmp), metadata=meta)
    usual_mode(tmp)
    tmp.replace(path)


def load_table(path: Path, key: dict) -> dict[str, torch.Tensor]:
    """The table a resumed run stored; refused in one line when it is missing or was scored for
    another ``table_key`` (the sequences or their precision changed since)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the run's precomputed reference "
                                "log-probabilities (train.dpo_reference=precomputed); resume "
                                "with --train.dpo_reference model, or start a new run with "
                                "--out")  # fmt: skip
    with safe_open(str(path), "pt") as f:
        saved = json.loads((f.metadata() or {}).get("key", "{}"))
    if saved != json.loads(json.dumps(key, sort_keys=True)):
        diff = [f"{k} {saved.get(k)!r} -> {v!r}" if k != "data" else "other data"
                for k, v in key.items() if saved.get(k) != json.loads(json.dumps(v))]  # fmt: skip
        diff = diff if saved else []  # a table written with no key
        raise ValueError(f"{path} was scored for other sequences than this run's ("
                         f"{'; '.join(diff) or 'no record of them'}): resume with the settings "
                         "the run started with, or start a new run with --out")  # fmt: skip
    return load_file(str(path))


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def weights_id(init_from: str | Path) -> dict:
    """The identity of the weights ``init_from`` names: the checkpoint directory it resolves to
    and the ``file_check`` digest of each weights file there (a few reads, whatever the size)."""
    from llm_foundry.rundir import checkpoint_dir

    ckpt = checkpoint_dir(init_from, "train.init_from")
    files = sorted(
        p
        for p in ckpt.iterdir()
        if p.suffix in WEIGHT_SUFFIXES and p.is_file() and not p.name.startswith("optimizer")
    )  # a run's step: its weights alone
    return {"checkpoint": str(ckpt.resolve()), "files": {p.name: file_check(p) for p in files}}


def check_same_weights(saved: dict | None, now: dict | None, init_from, checkpoint) -> None:
    """Refuse resuming ``checkpoint`` when the reference ``init_from`` now names is not the one
    the run started with (``weights_id`` then: ``saved``; None: not recorded, nothing to check)."""
    if saved is None or now is None or saved == now:
        return
    now_at = "" if saved["checkpoint"] == now["checkpoint"] else f" ({now['checkpoint']})"
    raise ValueError(f"resume: the DPO reference train.init_from={init_from}{now_at} holds other "
                     f"weights than {checkpoint}'s run started from ({saved['checkpoint']}); the "
                     "reference must stay the starting weights: resume with --train.init_from "
                     "naming them, or start a new run with --out")  # fmt: skip


class CountedReference:
    """A reference scorer that moves ``bar`` on by the pairs of each batch it scores (each of
    ``ranks`` ranks scores its share: the bar counts them all)."""

    def __init__(self, reference, bar, ranks: int):
        self.reference, self.bar, self.ranks = reference, bar, ranks
        self.done = 0  # pairs scored (a disabled bar counts none)

    def logps(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.reference.logps(x, y)
        self.done += len(x) // 2 * self.ranks  # x: B chosen rows, then B rejected
        self.bar.update(len(x) // 2 * self.ranks)
        return out
