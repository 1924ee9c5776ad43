"""Muon for the hidden matrices, AdamW for everything else, as one optimizer.

Muon (Jordan et al. 2024) replaces each 2-D hidden weight's momentum update by its nearest
semi-orthogonal matrix (five Newton-Schulz iterations), which the nanoGPT speedruns found to
reach a given loss in fewer steps than AdamW. Embeddings, the output head, norms, biases and
MoE expert banks (3-D) keep AdamW. Both updates are PyTorch's own (``torch.optim.Muon``'s
``muon`` and ``torch.optim.adamw.adamw``); this class only holds the two kinds of parameter
group in one ``state_dict``, so checkpoints, resume and the trainer see one optimizer.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim._muon import (
    DEFAULT_A,
    DEFAULT_B,
    DEFAULT_C,
    DEFAULT_NS_STEPS,
    EPS,
    _adjust_lr,
    _zeropower_via_newtonschulz,
    muon,
)
from torch.optim.adamw import adamw

OPTIMIZERS = ("adamw", "muon")  # the values ``TrainConfig.optimizer`` accepts


class MuonWithAdamW(torch.optim.Optimizer):
    """Parameter groups with ``kind`` "muon" (2-D, lr, momentum, weight_decay) or "adamw"
    (lr, betas, weight_decay). ``lr_scale`` in a group multiplies the scheduled lr (the trainer
    sets ``lr = schedule * lr_scale``), so Muon keeps its own peak lr on AdamW's schedule."""

    def __init__(self, groups: list[dict]):
        defaults = dict(lr=1e-3, weight_decay=0.0, betas=(0.9, 0.99), eps=1e-8, momentum=0.95,
                        nesterov=True, kind="adamw", lr_scale=1.0)  # fmt: skip
        super().__init__(groups, defaults)
        for g in self.param_groups:
            if g["kind"] not in OPTIMIZERS:
                raise ValueError(f"parameter group kind {g['kind']!r} is not one of {OPTIMIZERS}")
            if g["kind"] == "muon" and any(p.dim() != 2 for p in g["params"]):
                raise ValueError("Muon updates 2-D matrices only")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for g in self.param_groups:
            params = [p for p in g["params"] if p.grad is not None]
            grads = [p.grad for p in params]
            if not params:
                continue
            if g["kind"] == "muon":
                bufs = [self._state(p, momentum_buffer=torch.zeros_like) for p in params]
                if isinstance(params[0], DTensor):  # FSDP2 / tensor-parallel shards
                    for p, grad, b in zip(params, grads, bufs, strict=True):
                        sharded_muon(p, grad, b["momentum_buffer"], g)
                    continue
                muon(params, grads, [b["momentum_buffer"] for b in bufs], lr=g["lr"],
                     weight_decay=g["weight_decay"], momentum=g["momentum"],
                     nesterov=g["nesterov"], ns_coefficients=(DEFAULT_A, DEFAULT_B, DEFAULT_C),
                     eps=EPS, ns_steps=DEFAULT_NS_STEPS, adjust_lr_fn=None,
                     has_complex=False)  # fmt: skip
                continue
            states = [
                self._state(
                    p,
                    step=lambda _: torch.tensor(0.0),
                    exp_avg=torch.zeros_like,
                    exp_avg_sq=torch.zeros_like,
                )  # fmt: skip
                for p in params
            ]
            adamw(params, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                  [], [s["step"] for s in states], foreach=False, amsgrad=False,
                  beta1=g["betas"][0], beta2=g["betas"][1], lr=g["lr"],
                  weight_decay=g["weight_decay"], eps=g["eps"], maximize=False)  # fmt: skip
        return loss

    def _state(self, p: torch.Tensor, **init) -> dict:
        """The state of ``p``, its entries made by ``init`` (name -> fn(p)) on first use."""
        state = self.state[p]
        for name, make in init.items():
            if name not in state:
                state[name] = make(p)
        return state


@torch.no_grad()
def sharded_muon(p: DTensor, grad: DTensor, buf: DTensor, group: dict) -> None:
    """Muon's update (torch's, step for step) for a parameter split over ranks: the momentum
    stays sharded like ``p``; the Newton-Schulz iteration needs the whole matrix, so every rank
    gathers it, orthogonalises it (the same result everywhere) and keeps its own part."""
    momentum, lr = group["momentum"], group["lr"]
    buf.lerp_(grad, 1 - momentum)
    update = grad.lerp(buf, momentum) if group["nesterov"] else buf
    whole = _zeropower_via_newtonschulz(
        update.full_tensor(), (DEFAULT_A, DEFAULT_B, DEFAULT_C), DEFAULT_NS_STEPS, EPS
    )
    # every rank holds the same whole matrix: cut out this rank's part without communication
    update = distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None)
    p.mul_(1 - lr * group["weight_decay"])
    p.add_(update, alpha=-_adjust_lr(lr, None, p.shape))


def muon_groups(model: torch.nn.Module, weight_decay: float, muon_weight_decay: float,
                momentum: float, betas: tuple[float, float], lr_scale: float) -> list[dict]:  # fmt: skip
    """The model's trainable parameters in Muon and AdamW groups: Muon takes the 2-D weights of
    the blocks (attention, MLP, router projections); AdamW decays the other matrices (embeddings,
    output head, 3-D expert banks) and leaves norms and biases undecayed."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    head = getattr(model, "lm_head", None)
    outside = embeddings | ({id(head.weight)} if head is not None else set())
    hidden, matrices, rest = [], [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.dim() == 2 and id(p) not in outside:
            hidden.append(p)
        elif p.dim() >= 2:
            matrices.append(p)
        else:
            rest.append(p)
    return [
        {"params": hidden, "kind": "muon", "weight_decay": muon_weight_decay,
         "momentum": momentum, "lr_scale": lr_scale},
        {"params": matrices, "kind": "adamw", "weight_decay": weight_decay, "betas": betas},
        {"params": rest, "kind": "adamw", "weight_decay": 0.0, "betas": betas},
    ]  # fmt: skip
