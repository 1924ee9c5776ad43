"""Mixture-of-experts feed-forward (Shazeer et al. 2017; Switch Transformer, Fedus et al. 2021;
Mixtral, Jiang et al. 2024), used in place of the MLP when ``ModelConfig.n_experts`` > 0.

A router scores E experts for each token; the k best run and their outputs are summed, weighted
by the router's softmax probabilities (renormalised over the k chosen, as Mixtral does, or not,
as Qwen3-MoE configs may say). Parameters grow with E, compute per token with k. Shared experts
(DeepSeek-MoE, Dai et al. 2024) run on every token besides the routed ones.

Shape letters: N tokens (batch x time, flattened), D model width, E experts, k experts per token,
H expert hidden width. Expert weights are stacked per expert in ``nn.Linear``'s (out, in) layout:
w1, w3 (E, H, D) (gate, up), w2 (E, D, H) (down).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from llm_foundry.models.linear import Linear
from llm_foundry.models.mlp import activation, is_gated

if TYPE_CHECKING:
    from llm_foundry.config import ModelConfig


def route(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k experts of each token and their weights. logits: (N, E) -> weights (N, k) in
    fp32 (softmax probabilities, renormalised to sum to 1 when asked) and expert ids (N, k)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = probs.topk(k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def expert_ffn(x, w1, w2, w3, act):
    """One expert on its tokens: w2(act(w1 x) * w3 x), or w2(act(w1 x)) when w3 is None.
    x: (n, D); w1, w3: (H, D); w2: (D, H)."""
    h = act(F.linear(x, w1))
    if w3 is not None:
        h = h * F.linear(x, w3)
    return F.linear(h, w2)


def experts_loop(x, weights, ids, w1, w2, w3, act) -> torch.Tensor:
    """The readable reference: for each expert, gather its tokens, run it, add its weighted output
    back. x: (N, D); weights, ids: (N, k) -> (N, D)."""
    out = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        token, slot = (ids == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        y = expert_ffn(x[token], w1[e], w2[e], None if w3 is None else w3[e], act)
        out.index_add_(0, token, y * weights[token, slot, None].to(y.dtype))
    return out


def _grouped_ok(*mats: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` can take these (it needs 16-byte aligned rows)."""
    return hasattr(torch, "_grouped_mm") and all(
        (m.shape[-1] * m.element_size()) % 16 == 0 and (m.shape[-2] * m.element_size()) % 16 == 0
        for m in mats
    )


def grouped_linear(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows of x grouped by expert (counts[e] rows for expert e, in order) times each expert's
    weight: x (M, in), w (E, out, in) -> (M, out). One grouped product where the build has it."""
    if _grouped_ok(x, w):
        offs = counts.cumsum(0).to(torch.int32)
        return torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
    parts = [F.linear(rows, w[e]) for e, rows in enumerate(x.split(counts.tolist()))]
    return torch.cat(parts)


def experts_grouped(x, weights, ids, w1, w2, w3, act) -> torch.Tensor:
    """The fast path: sort the (token, expert) pairs by expert, run every expert on its
    contiguous rows, scatter the weighted rows back. Equal to ``experts_loop`` to rounding (each
    token's expert outputs are added in the same order; the products may use other kernels). x: (N, D); weights, ids: (N, k) -> (N, D)."""
    k = ids.shape[1]
    order = ids.flatten().argsort(stable=True)  # pairs grouped by expert, tokens in order
    token = order // k
    counts = torch.bincount(ids.flatten(), minlength=w1.shape[0])
    rows = x[token]  # (N*k, D)
    h = act(grouped_linear(rows, w1, counts))
    if w3 is not None:
        h = h * grouped_linear(rows, w3, counts)
    y = grouped_linear(h, w2, counts)
    y = y * weights.flatten()[order, None].to(y.dtype)
    return torch.zeros_like(x).index_add_(0, token, y)


DISPATCH = {"grouped": experts_grouped, "loop": experts_loop}
MOE_DISPATCH_NAMES = DISPATCH.keys()  # the values ``ModelConfig.moe_dispatch`` accepts


def load_balancing_loss(router_logits: list[torch.Tensor], k: int) -> torch.Tensor:
    """Switch Transformer's balancing loss (Fedus et al. 2021, eqs. 4-6) over every layer's
    tokens together, as ``transformers``' ``load_balancing_loss_func``: E * sum_e f_e * P_e, with
    f_e the share of (token, slot) assignments that go to expert e (summed over the k slots) and
    P_e its mean router probability. k when perfectly balanced, up to k * E when the same k take
    all. router_logits: one (N, E) tensor per layer."""
    logits = torch.cat(router_logits).float()
    n_experts = logits.shape[-1]
    probs = torch.softmax(logits, dim=-1)
    ids = probs.topk(k, dim=-1).indices
    share = F.one_hot(ids, n_experts).float().sum(1).mean(0)  # (E,): f_e
    return n_experts * (share * probs.mean(0)).sum()


def router_z_loss(router_logits: list[torch.Tensor]) -> torch.Tensor:
    """ST-MoE's router z-loss (Zoph et al. 2022): the mean of logsumexp(logits)^2 over every
    layer's tokens; keeps router logits small so the softmax stays out of fp saturation."""
    logits = torch.cat(router_logits).float()
    return torch.logsumexp(logits, dim=-1).pow(2).mean()


class MoE(nn.Module):
    """Top-k routed experts (each an MLP of ``ModelConfig.mlp``'s kind), plus shared ones."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, D, H = cfg.n_experts, cfg.dim, cfg.expert_ffn_dim
        self.k, self.renormalize = cfg.experts_per_token, cfg.moe_renormalize
        self.jitter = cfg.router_jitter
        self.router = Linear(D, E, bias=False)
        self.w1 = nn.Parameter(torch.empty(E, H, D))
        self.w2 = nn.Parameter(torch.empty(E, D, H))
        gated = is_gated(cfg.mlp)
        self.w3 = nn.Parameter(torch.empty(E, H, D)) if gated else None
        self.act: Callable = activation(cfg)
        self.dispatch = DISPATCH[cfg.moe_dispatch]
        self.shared = None
        if cfg.n_shared_experts:  # one MLP as wide as all shared experts together (same sums)
            Hs = cfg.n_shared_experts * H
            self.shared = nn.ModuleDict(
                {
                    "w1": Linear(D, Hs, bias=False),
                    "w2": Linear(Hs, D, bias=False),
                    **({"w3": Linear(D, Hs, bias=False)} if gated else {}),
                }
            )
        # what the last forward routed: the trainer's balancing losses and expert-load metrics
        self.router_logits: torch.Tensor | None = None
        self.expert_ids: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T, D) -> (B, T, D)."""
        B, T, D = x.shape
        flat = x.reshape(B * T, D)
        if self.training and self.jitter > 0:  # multiplicative noise on the router's input
            noise = torch.empty_like(flat).uniform_(1.0 - self.jitter, 1.0 + self.jitter)
            logits = self.router(flat * noise)
        else:
            logits = self.router(flat)
        weights, ids = route(logits, self.k, self.renormalize)
        self.router_logits, self.expert_ids = logits, ids
        out = self.dispatch(flat, weights, ids, self.w1, self.w2, self.w3, self.act)
        if self.shared is not None:
            s = self.shared  # through the modules, so LoRA-wrapped projections work too
            h = self.act(s["w1"](flat))
            out = out + s["w2"](h * s["w3"](flat) if "w3" in s else h)
        return out.view(B, T, D)

    def init_weights(self, std: float, residual_std: float) -> None:
        """Router and expert inputs ~ N(0, std); the down projections (w2) write into the residual
        stream, so N(0, residual_std)."""
        self.router.init_weights(std)
        nn.init.normal_(self.w1, mean=0.0, std=std)
        if self.w3 is not None:
            nn.init.normal_(self.w3, mean=0.0, std=std)
        nn.init.normal_(self.w2, mean=0.0, std=residual_std)
        if self.shared is not None:
            self.shared["w1"].init_weights(std)
            if "w3" in self.shared:
                self.shared["w3"].init_weights(std)
            self.shared["w2"].init_weights(residual_std)

    def _expert_params(self) -> int:
        """Parameters of one routed expert."""
        return sum(w[0].numel() for w in (self.w1, self.w2, self.w3) if w is not None)

    def active_params(self) -> int:
        """Parameters each token uses: the router, k routed experts and the shared ones."""
        shared = sum(p.numel() for p in self.shared.parameters()) if self.shared else 0
        return self.router.weight.numel() + self.k * self._expert_params() + shared

    def flops_per_token(self, context: int) -> int:
        """Training FLOPs per token (6 per active weight): the router, the k experts that run and
        the shared experts; the E - k idle experts cost nothing."""
        shared = sum(p.numel() for p in self.shared.parameters()) if self.shared else 0
        return 6 * (self.router.weight.numel() + self.k * self._expert_params() + shared)
