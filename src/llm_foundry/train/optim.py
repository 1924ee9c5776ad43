"""Muon for the hidden matrices, AdamW for everything else, as one optimizer.

Muon (Jordan et al. 2024) replaces each 2-D hidden weight's momentum update by its nearest
semi-orthogonal matrix (five Newton-Schulz iterations), which the nanoGPT speedruns found to
reach a given loss in fewer steps than AdamW. Embeddings, the output head, norms, biases and
MoE expert banks (3-D) keep AdamW. Both updates are PyTorch's (``torch.optim.Muon``'s step and
Newton-Schulz iteration, ``torch.optim.adamw.adamw``); this class holds the two kinds of parameter
group in one ``state_dict``, so checkpoints, resume and the trainer see one optimizer.

PyTorch runs the Newton-Schulz iteration in bf16. A CPU without native bf16 (AVX2 only) runs those
products ~20-100x slower than fp32, which makes Muon's step several times AdamW's, so a group may
ask for the same iteration in fp32 (``ns_dtype``); the trainer picks fp32 where bf16 is slow.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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
)
from torch.optim.adamw import adamw

if TYPE_CHECKING:
    from llm_foundry.train.config import TrainConfig

OPTIMIZERS = ("adamw", "muon")  # the values ``TrainConfig.optimizer`` accepts
NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}  # Newton-Schulz precision per group


def build_optimizer(
    model: torch.nn.Module,
    tc: TrainConfig,
    device: torch.device,
    sharded: bool = False,
    ns_dtype: str = "bf16",
) -> torch.optim.Optimizer:
    """The optimizer ``tc.optimizer`` names over ``model``'s trainable parameters, as every
    training step takes it: AdamW on the model's decay groups (fused on CUDA and CPU, but not
    over DTensor shards: ``sharded``), or Muon's groups (``muon_groups``, its peak lr as a scale
    of ``tc.lr``, its Newton-Schulz iteration in ``ns_dtype``) with AdamW on the rest. The lr is
    the peak; ``set_lr`` puts each step's on it."""
    betas = (tc.beta1, tc.beta2)
    if tc.optimizer == "muon":
        return MuonWithAdamW(
            muon_groups(
                model,
                tc.weight_decay,
                tc.muon_weight_decay,
                tc.muon_momentum,
                betas,
                tc.muon_lr / tc.lr,
                ns_dtype=ns_dtype,
            )  # fmt: skip
        )
    fused = device.type in ("cuda", "cpu") and not sharded
    return torch.optim.AdamW(
        model.param_groups(tc.weight_decay), lr=tc.lr, betas=betas, fused=fused
    )


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` can skip a step on the device (``step_unless``): fused AdamW, whose
    kernel reads a found-inf flag as PyTorch's grad scaler sets it. Read from the groups: a
    state loaded from a sharded run's save brings its unfused groups."""
    groups = optimizer.param_groups
    return isinstance(optimizer, torch.optim.AdamW) and all(g.get("fused") for g in groups)


def step_unless(optimizer: torch.optim.Optimizer, bad: torch.Tensor) -> None:
    """``optimizer.step()``, skipped on the device where ``bad`` (a 0-d bool tensor) is true:
    parameters, moments and step counts stay as they were, and the host waits for nothing."""
    optimizer.found_inf = bad.to(torch.float32)
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf


# what a run's TrainConfig puts in each parameter group (``build_optimizer``) besides the lr, which
# ``set_lr`` sets every step: betas, weight decay (0 in the undecayed groups), AdamW's eps,
# Muon's momentum and lr_scale (muon_lr / lr)
GROUP_SETTINGS = ("betas", "weight_decay", "eps", "momentum", "lr_scale")


def group_settings(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each parameter group's ``GROUP_SETTINGS`` (those it has), in group order."""
    return [{k: g[k] for k in GROUP_SETTINGS if k in g} for g in optimizer.param_groups]


def apply_group_settings(optimizer: torch.optim.Optimizer, settings: list[dict]) -> None:
    """Put ``settings`` (``group_settings`` of the optimizer as built for this run's config) on
    ``optimizer``'s groups: a loaded state dict brings back the saved run's values, and a
    resumed run trains with those given now (the moments and step counts stay the saved ones)."""
    for group, given in zip(optimizer.param_groups, settings, strict=True):
        group.update(given)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Every group's learning rate for the next step: ``lr`` times the group's ``lr_scale``
    (Muon's peak lr on the same schedule)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


class MuonWithAdamW(torch.optim.Optimizer):
    """Parameter groups with ``kind`` "muon" (2-D, lr, momentum, weight_decay, ``ns_dtype``
    "bf16" as PyTorch or "fp32") or "adamw" (lr, betas, weight_decay). ``lr_scale`` in a group
    multiplies the scheduled lr (the trainer sets ``lr = schedule * lr_scale``), so Muon keeps its
    own peak lr on AdamW's schedule."""

    def __init__(self, groups: list[dict]):
        defaults = dict(lr=1e-3, weight_decay=0.0, betas=(0.9, 0.99), eps=1e-8, momentum=0.95,
                        nesterov=True, kind="adamw", lr_scale=1.0, ns_dtype="bf16")  # fmt: skip
        super().__init__(groups, defaults)
        for g in self.param_groups:
            if g["kind"] not in OPTIMIZERS:
                raise ValueError(f"parameter group kind {g['kind']!r} is not one of {OPTIMIZERS}")
            if g["kind"] == "muon" and any(p.dim() != 2 for p in g["params"]):
                raise ValueError("Muon updates 2-D matrices only")
            if g["ns_dtype"] not in NS_DTYPES:
                raise ValueError(f"ns_dtype {g['ns_dtype']!r} is not one of {', '.join(NS_DTYPES)}")

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        # load_state_dict ends here with the saved groups: those from before ns_dtype ran bf16
        for g in self.param_groups:
            g.setdefault("ns_dtype", "bf16")

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
                for p, grad in zip(params, grads, strict=True):
                    buf = self._state(p, momentum_buffer=torch.zeros_like)["momentum_buffer"]
                    muon_update(p, grad, buf, g)
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


def newton_schulz(g: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """PyTorch Muon's quintic Newton-Schulz orthogonalisation of ``g`` (m, n) -> (m, n), its
    coefficients and 5 steps, computed in ``dtype``: bf16 is PyTorch's own function; fp32 the same
    iteration in fp32. Either leaves the singular values near 1, not at 1 (Jordan et al. 2024)."""
    if dtype == torch.bfloat16:
        return _zeropower_via_newtonschulz(
            g, (DEFAULT_A, DEFAULT_B, DEFAULT_C), DEFAULT_NS_STEPS, EPS
        )
    x = g.to(dtype)
    tall = x.size(0) > x.size(1)
    x = x.T if tall else x  # iterate on the (short, long) side: the Gram matrix is the small one
    x = x / x.norm().clamp(min=EPS)  # Frobenius norm >= spectral norm: singular values <= 1
    for _ in range(DEFAULT_NS_STEPS):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=DEFAULT_B, alpha=DEFAULT_C), x,
                        beta=DEFAULT_A)  # fmt: skip
    return x.T if tall else x


@torch.no_grad()
def muon_update(p: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor, group: dict) -> None:
    """One Muon step on ``p`` (PyTorch's, step for step: Nesterov momentum, Newton-Schulz,
    decoupled weight decay, its shape-adjusted lr). A ``DTensor`` (FSDP2 or tensor-parallel
    shards) keeps its momentum sharded like ``p``; the iteration needs the whole matrix, so every
    rank gathers it, orthogonalises it (the same result everywhere) and keeps its own part."""
    momentum, lr = group["momentum"], group["lr"]
    buf.lerp_(grad, 1 - momentum)
    update = grad.lerp(buf, momentum) if group["nesterov"] else buf
    dtype = NS_DTYPES[group["ns_dtype"]]
    if isinstance(p, DTensor):
        whole = newton_schulz(update.full_tensor(), dtype)
        # every rank holds the same whole matrix: cut out this rank's part without communication
        update = distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None)
    else:
        update = newton_schulz(update, dtype)
    p.mul_(1 - lr * group["weight_decay"])
    p.add_(update, alpha=-_adjust_lr(lr, None, p.shape))


def muon_groups(model: torch.nn.Module, weight_decay: float, muon_weight_decay: float,
                momentum: float, betas: tuple[float, float], lr_scale: float,
                ns_dtype: str = "bf16") -> list[dict]:  # fmt: skip
    """The model's trainable parameters in Muon and AdamW groups: Muon takes the 2-D weights of
    the blocks (attention, MLP, router projections); AdamW decays the other matrices (embeddings,
    output head, 3-D expert banks) and leaves norms and biases undecayed."""
    hidden = muon_params(model)
    ids = {id(p) for p in hidden}
    matrices = [
        p for p in model.parameters() if p.requires_grad and p.dim() >= 2 and id(p) not in ids
    ]
    rest = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [
        {"params": hidden, "kind": "muon", "weight_decay": muon_weight_decay,
         "momentum": momentum, "lr_scale": lr_scale, "ns_dtype": ns_dtype},
        {"params": matrices, "kind": "adamw", "weight_decay": weight_decay, "betas": betas},
        {"params": rest, "kind": "adamw", "weight_decay": 0.0, "betas": betas},
    ]  # fmt: skip


def muon_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The trainable parameters Muon updates: the 2-D weights of the blocks (attention, MLP,
    router projections), not the embeddings nor the output head."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    head = getattr(model, "lm_head", None)
    outside = embeddings | ({id(head.weight)} if head is not None else set())
    return [
        p for p in model.parameters() if p.requires_grad and p.dim() == 2 and id(p) not in outside
    ]
