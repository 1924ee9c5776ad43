"""Training-dynamics monitors: attention entropy, effective rank, per-layer gradient norms and
activation scale, recorded every ``train.monitor_interval`` steps into ``metrics.jsonl``.

The math is in pure functions (shapes in each docstring). ``probe`` runs one no-grad forward in
eval mode through the model's ``need_weights`` (manual attention) path on a fixed batch, reading
each block's output with forward hooks; it changes no weight, draws no random number and restores
the train/eval mode it found, so a run with monitors has the same losses as one without.
``Monitor`` is what the trainer calls: when a step is due, which batch to probe, what to warn about.

Record written for a monitored step k (the same k as that step's ``loss`` line; every list has
one entry per layer)::

    {"step": k, "monitor": {"attn_entropy": [[nats per head], ...], "entropy_uniform": nats,
     "rank_wq": [...], "rank_wk": [...], "rank_hidden": [...], "full_rank": {"wq": n, ...},
     "act_rms": [...], "grad_norm": [...], "grad_norm_rest": float}}

Everything in it describes the weights that step k's forward and backward saw (after k - 1
updates), like the ``loss`` and ``grad_norm`` of the step-k line: the record at step 1 is the
model at initialisation, and the squares of ``grad_norm`` plus ``grad_norm_rest`` squared sum to
that line's (pre-clipping) ``grad_norm`` squared.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.nn as nn

from llm_foundry.models.lora import effective_weight

PROBE_SEQUENCES = 8  # at most this many sequences in the probe batch (SVD cost ~ B*T*D^2)
RANK_KINDS = {"wq": "W_q", "wk": "W_k", "hidden": "hidden states"}

# ----------------------------------------------------------------------------------------------
# Pure functions


def attention_entropy(weights: torch.Tensor) -> torch.Tensor:
    """Mean entropy (nats) of each head's attention rows. weights: (B, H, T, S) -> (H,).

    Row entropy -sum_s p log p, with 0 log 0 = 0, so masked (exactly zero) keys add nothing; a
    row spread uniformly over its n visible keys scores log n, a one-hot row 0. Averaged over
    the batch and the T query rows.
    """
    p = weights.float()
    return -torch.special.xlogy(p, p).sum(-1).mean(dim=(0, 2))


def uniform_entropy(T: int, window: int | None = None) -> float:
    """Mean row entropy of uniform causal attention over T queries: mean_t log(n_t), where
    query t sees n_t = t + 1 keys (at most ``window``). The ceiling ``attention_entropy`` can
    reach on a (., ., T, T) causal pattern."""
    return sum(math.log(min(t + 1, window or t + 1)) for t in range(T)) / T


def effective_rank(matrix: torch.Tensor) -> float:
    """exp(Shannon entropy of the singular values normalised to sum 1). matrix: (m, n) -> float
    in [1, min(m, n)] (0 for an all-zero matrix): n for an orthogonal n x n, 1 for rank one."""
    # Roy & Vetterli 2007, "The effective rank: a measure of effective dimensionality"
    s = torch.linalg.svdvals(matrix.detach().float()).double()  # (min(m, n),)
    total = s.sum()
    if total <= 0:
        return 0.0
    p = s / total
    return math.exp(-torch.special.xlogy(p, p).sum().item())


def _grad_norm(params: Iterable[nn.Parameter]) -> torch.Tensor:
    """L2 norm over the gradients of ``params`` (0-d tensor; 0 when none has a gradient)."""
    norms = [
        torch.linalg.vector_norm(p.grad.detach().float()) for p in params if p.grad is not None
    ]
    return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())


def layer_grad_norms(model: nn.Module) -> list[float]:
    """L2 norm of the gradients of each block's parameters: ``model.layers`` -> n_layers floats.
    Call it after ``backward`` (and after the grad scaler's ``unscale_``) and before clipping."""
    return [_grad_norm(layer.parameters()).item() for layer in model.layers]


def rest_grad_norm(model: nn.Module) -> float:
    """L2 norm of the gradients of every parameter outside the blocks: embeddings, the final norm
    and the output head (a tied head counted once). With ``layer_grad_norms`` it covers all:
    sum(layer_grad_norms**2) + rest_grad_norm**2 == total gradient norm**2."""
    inside = {id(p) for p in model.layers.parameters()}
    return _grad_norm(p for p in model.parameters() if id(p) not in inside).item()


@torch.no_grad()
def probe(model: nn.Module, x: torch.Tensor) -> dict:
    """Per-layer statistics of one eval-mode forward of ``x`` (B, T) token ids.

    Returns lists with one entry per layer: ``attn_entropy`` (H floats per layer, nats),
    ``rank_wq`` / ``rank_wk`` (effective rank of the attention's wq / wk weight: the one it
    computes with, ``effective_weight``, so a LoRA's frozen base widened plus its update),
    ``rank_hidden`` (effective rank of the block's output flattened to (B*T, D), not centred)
    and ``act_rms`` (RMS of that output); plus ``full_rank`` (the largest rank of each kind) and
    ``entropy_uniform`` (``uniform_entropy`` of the batch, for scale).
    """
    n = len(model.layers)
    entropy, rank_hidden, rms = [None] * n, [None] * n, [None] * n

    def hook(i: int):
        def read(module, inputs, output):
            h, w = output  # (B, T, D), (B, H, T, T)
            entropy[i] = attention_entropy(w).tolist()
            rank_hidden[i] = effective_rank(h.flatten(0, 1))  # (B*T, D)
            rms[i] = h.float().pow(2).mean().sqrt().item()
            return h, None  # drop the weights now: all layers' (B, H, T, T) never coexist

        return read

    handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(model.layers)]
    was_training = model.training
    model.eval()  # no dropout: deterministic, and no random numbers drawn
    try:
        model.attention_weights(x)  # the need_weights path: manual attention in every layer
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    # the weights the forward computes with: a LoRA's base (int8/bf16 widened) plus its update
    wq = [effective_weight(layer.attn.wq) for layer in model.layers]  # (H*hd, D)
    wk = [effective_weight(layer.attn.wk) for layer in model.layers]  # (K*hd, D)
    B, T = x.shape
    return dict(
        attn_entropy=entropy,
        entropy_uniform=uniform_entropy(T, getattr(model.cfg, "sliding_window", None)),
        rank_wq=[effective_rank(w) for w in wq],
        rank_wk=[effective_rank(w) for w in wk],
        rank_hidden=rank_hidden,
        full_rank=dict(wq=min(wq[0].shape), wk=min(wk[0].shape), hidden=min(B * T, model.cfg.dim)),
        act_rms=rms,
    )


def warnings_for(
    step: int, stats: dict, entropy_min: float, rank_frac: float
) -> list[tuple[str, int, str]]:
    """(kind, layer, message) for each layer whose lowest head entropy is below ``entropy_min``
    or whose effective rank of a kind is below ``rank_frac`` x its full rank: at most one per
    layer and kind (``attn_entropy``, ``wq``, ``wk``, ``hidden``)."""
    out = []
    for layer, heads in enumerate(stats["attn_entropy"]):
        low = [h for h, e in enumerate(heads) if e < entropy_min]
        if low:
            h = min(low, key=lambda i: heads[i])
            out.append(
                (
                    "attn_entropy",
                    layer,
                    f"monitor step {step}: layer {layer} head {h} attention entropy "
                    f"{heads[h]:.3f} nats < monitor_entropy_min {entropy_min:g} "
                    f"({len(low)} of {len(heads)} heads below)",
                )
            )
        for kind, label in RANK_KINDS.items():
            full, rank = stats["full_rank"][kind], stats[f"rank_{kind}"][layer]
            if rank < rank_frac * full:
                out.append(
                    (
                        kind,
                        layer,
                        f"monitor step {step}: layer {layer} {label} effective rank {rank:.2f} "
                        f"< monitor_rank_frac {rank_frac:g} x full rank {full}",
                    )
                )
    return out


def read_monitor(metrics_path: str | Path) -> list[dict]:
    """The monitor records ``{"step": k, "monitor": {...}}`` of a ``metrics.jsonl``, in order."""
    from llm_foundry.rundir import read_records

    return [rec for rec in read_records(metrics_path) if "monitor" in rec]


# ----------------------------------------------------------------------------------------------
# What the trainer calls


class Monitor:
    """Probes ``model`` on a fixed batch every ``interval`` steps (and at step 1) and warns.

    The trainer asks ``due(k)`` before step k, calls ``probe()`` then (before the step's forward,
    so the probe sees the weights its backward sees), collects ``layer_grad_norms`` between
    unscaling and clipping, and writes what ``record`` returns after the step.
    """

    def __init__(
        self,
        model: nn.Module,
        probe_x: torch.Tensor,
        interval: int,
        entropy_min: float,
        rank_frac: float,
        write: Callable[[str], None] = print,
    ):
        self.model, self.probe_x, self.interval = model, probe_x, interval
        self.entropy_min, self.rank_frac, self.write = entropy_min, rank_frac, write

    @classmethod
    def for_run(cls, model, val_data, train_cfg, device, write=print, ranks: int = 1) -> Monitor:
        """A monitor on a fixed probe batch of the validation split, drawn from its own seeded
        generator (numpy; neither torch's RNG nor the training sampler's is touched). Its size
        follows the global batch (``ranks`` data-parallel ranks), so a run split over ranks or
        micro-batches probes what it does in one process."""
        from llm_foundry.data import BatchSampler

        step = train_cfg.batch_size * train_cfg.grad_accum * ranks  # sequences per step
        batch = min(step, PROBE_SEQUENCES)
        sampler = BatchSampler(val_data, train_cfg.block_size, batch, seed=train_cfg.seed + 2)
        x, _ = sampler.next()  # (B, T)
        return cls(
            model,
            x.to(device),
            train_cfg.monitor_interval,
            train_cfg.monitor_entropy_min,
            train_cfg.monitor_rank_frac,
            write,
        )

    def due(self, step: int) -> bool:
        """Whether optimizer step ``step`` (1-based) is monitored: the first, and every interval."""
        return self.interval > 0 and (step == 1 or step % self.interval == 0)

    def probe(self) -> dict:
        return probe(self.model, self.probe_x)

    def record(self, step: int, stats: dict, grads: list[float], grad_rest: float) -> dict:
        """The metrics.jsonl record of ``step``; prints a warning per layer and kind in trouble."""
        for _, _, message in warnings_for(step, stats, self.entropy_min, self.rank_frac):
            self.write(f"warning: {message}")
        return dict(step=step, monitor=dict(stats, grad_norm=grads, grad_norm_rest=grad_rest))


# ----------------------------------------------------------------------------------------------
# Expert load (mixture-of-experts models)


class ExpertLoad:
    """How many tokens each expert of each MoE layer receives. Every training step adds
    ``aux_loss`` and the per-layer coefficient of variation of that step's load (``expert_cv``)
    to the step's record; every ``interval`` steps and at the last step a record holds each
    expert's share of the assignments since the previous record and names the experts that received none (dead experts), with a
    warning. The counts are global over ranks and travel in checkpoints, so a resumed run writes
    the records an uninterrupted one would. Inert for a dense model."""

    def __init__(self, model, interval: int, world, device: torch.device):
        self.layers = len(model.moe_layers())
        n = model.cfg.n_experts if self.layers else 0
        self.world, self.interval = world, max(1, interval)
        self.counts = torch.zeros(self.layers, n, device=device)  # since the last record
        self.step_counts = torch.zeros_like(self.counts)  # this step's

    def count(self, model) -> None:
        """Add the last forward's routing (every micro-batch of a step calls this)."""
        for i, moe in enumerate(model.moe_layers()):
            ids = moe.expert_ids.flatten()
            self.step_counts[i] += torch.bincount(ids, minlength=self.counts.shape[1])

    def step_record(self, aux: torch.Tensor | None) -> dict:
        """``aux_loss`` and ``expert_cv`` of the step just taken ({} for a dense model)."""
        if not self.layers:
            return {}
        step = self._global(self.step_counts)
        self.counts += self.step_counts
        self.step_counts.zero_()
        cv = [coefficient_of_variation(row) for row in step]
        return {"aux_loss": float(aux), "expert_cv": cv}

    def due(self, step: int) -> bool:
        return self.layers > 0 and step % self.interval == 0

    def interval_record(self, step: int, warn: Callable[[str], None]) -> dict:
        """Each expert's share of the interval's assignments per layer, their coefficient of
        variation, and the dead experts (warned about); starts the next interval."""
        counts = self._global(self.counts)
        self.counts.zero_()
        share = counts / counts.sum(dim=1, keepdim=True).clamp(min=1)
        dead = [[i, e] for i, e in (counts == 0).nonzero().tolist()]
        if dead:
            where = ", ".join(f"layer {i} expert {e}" for i, e in dead)
            since = (step - 1) // self.interval * self.interval  # the previous record's step
            warn(
                f"warning: step {step}: {len(dead)} expert(s) received no tokens in steps "
                f"{since + 1}-{step} ({where}); raise model.moe_aux_loss_coef to rebalance"
            )
        return {
            "step": step,
            "experts": {
                "load": [[round(v, 6) for v in row] for row in share.tolist()],
                "cv": [coefficient_of_variation(row) for row in counts],
                "dead": dead,
            },
        }

    def _global(self, counts: torch.Tensor) -> torch.Tensor:
        """A copy of ``counts`` summed over ranks."""
        counts = counts.clone()
        if self.world.distributed:
            torch.distributed.all_reduce(counts)
        return counts

    def state_dict(self) -> list[list[float]]:
        """The counts since the last record, summed over ranks (collective: call on every rank;
        afterwards rank 0 holds the sum and the others zero, so the total is unchanged)."""
        total = self._global(self.counts)
        self.counts.copy_(total if self.world.main else torch.zeros_like(total))
        return total.tolist()

    def load_state_dict(self, counts: list[list[float]] | None) -> None:
        if counts is not None and self.world.main:
            self.counts.copy_(torch.tensor(counts, device=self.counts.device))


def coefficient_of_variation(counts: torch.Tensor) -> float:
    """std / mean of per-expert counts: 0 when every expert gets the same, larger when skewed."""
    mean = counts.float().mean().item()
    return counts.float().std(unbiased=False).item() / mean if mean > 0 else 0.0
