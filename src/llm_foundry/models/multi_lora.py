"""Several LoRA adapters over one frozen base, each row of a batch computed with its own.

Every adapted projection holds the A and B of all N adapters stacked, padded with zeros to the
largest rank r (a zero row of A and column of B add nothing, so padding is exact), with each
adapter's scale folded into its B; stack entry 0 is all zeros: the bare base. A per-row index
(B,) picks the entry of each row:

    y[b] = base(x[b]) + (x[b] · A[i_b]ᵀ) · B[i_b]ᵀ          x (B, T, in), i (B,) in 0..N

Rows of different adapters take one of two kernels (``KERNELS``), chosen per projection by cost:

    gather   the rows' A and B gathered, two batched matmuls: O(r) per row, the layout of S-LoRA
             (Sheng et al. 2023) and Punica (Chen et al. 2023) without their custom kernels
    masked   x times every adapter's A at once (one matmul, N·r wide), each row's block kept by
             a 0/1 mask, times every B: O(N·r) per row but plain matmuls, which on a CPU beat
             small batched ones (and never stall on a busy machine's threads as bmm did here)

When every row uses one adapter it is two plain matmuls; when every row is the bare base, the
base alone.

One ``AdapterRows`` is shared by all the adapted projections of a model: whoever runs the model
sets the rows' adapters (``select``) before each forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class LoRAWeights:
    """One adapter's update to one projection: y += scale · (x Aᵀ) Bᵀ; A (r, in), B (out, r)."""

    A: torch.Tensor
    B: torch.Tensor
    scale: float


def stack_adapters(
    adapters: list[LoRAWeights | None], in_features: int, out_features: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(A (N+1, r, in), B (N+1, out, r)): entry 0 zeros (the base), entry k adapter k-1 with
    its scale folded into B, every rank padded with zeros to the largest r; an adapter that
    does not adapt this projection (None) is zeros too."""
    given = [a for a in adapters if a is not None]
    r = max(a.A.shape[0] for a in given)
    like = given[0].A
    A = torch.zeros(len(adapters) + 1, r, in_features, dtype=like.dtype, device=like.device)
    B = torch.zeros(len(adapters) + 1, out_features, r, dtype=like.dtype, device=like.device)
    for k, a in enumerate(adapters, start=1):
        if a is not None:
            A[k, : a.A.shape[0]] = a.A
            B[k, :, : a.B.shape[1]] = a.scale * a.B
    return A, B


def lora_rows_gather(x: torch.Tensor, index: torch.Tensor, A: torch.Tensor, B: torch.Tensor):
    """Each row's low-rank update: x (B, T, in), index (B,) into the stacks A (N+1, r, in) and
    B (N+1, out, r) -> (B, T, out) = (x[b] · A[i_b]ᵀ) · B[i_b]ᵀ, by gather + bmm."""
    h = torch.bmm(x, A[index].transpose(1, 2))  # (B, T, r)
    return torch.bmm(h, B[index].transpose(1, 2))  # (B, T, out)


def side_by_side(B: torch.Tensor) -> torch.Tensor:
    """The adapters' B (N+1, out, r) as one matrix (out, N·r), adapter 1 first (no base)."""
    return B[1:].permute(1, 0, 2).reshape(B.shape[1], -1)


def lora_rows_masked(x: torch.Tensor, index: torch.Tensor, A: torch.Tensor, B: torch.Tensor):
    """``lora_rows_gather``'s result by plain matmuls: x (B, T, in) times all N adapters' A
    (N+1, r, in) at once, each row keeping the r columns of its adapter (none for index 0),
    times all B side by side (out, N·r: ``side_by_side``) -> (B, T, out)."""
    n, r = A.shape[0] - 1, A.shape[1]
    h = F.linear(x, A[1:].reshape(n * r, -1))  # (B, T, N·r)
    keep = F.one_hot(index, n + 1)[:, 1:].repeat_interleave(r, dim=1).to(h.dtype)  # (B, N·r)
    return F.linear(h * keep[:, None, :], B)  # (B, T, out)


KERNELS = {"gather": lora_rows_gather, "masked": lora_rows_masked}


def choose_kernel(n: int, r: int, in_features: int, out_features: int) -> str:
    """masked while all N adapters' r·(in + out) multiply-adds per row stay within the base
    projection's in·out (there it measured faster than gather + bmm: benchmarks/README.md,
    bench_serve_adapters), gather past that (many adapters, where O(N·r) per row grows)."""
    masked = n * r * (in_features + out_features) <= in_features * out_features
    return "masked" if masked else "gather"


class AdapterRows:
    """Which adapter each row of the next forward uses, shared by every ``MultiLoRALinear`` of
    a model. ``names[k - 1]`` is adapter k; 0 is the bare base."""

    def __init__(self, names: list[str], device: torch.device | str = "cpu"):
        self.names = list(names)
        self.device = torch.device(device)
        self.index = torch.zeros(1, dtype=torch.long, device=self.device)
        self.first = 0  # the first row's adapter, as a Python int
        self.mode = "base"  # base: every row is the base; one: all rows one adapter; mixed

    def select(self, adapters: list[int]) -> None:
        """Set the adapter (0..N) of each row of the next forward, in batch order."""
        bad = [a for a in adapters if not 0 <= a <= len(self.names)]
        if bad or not adapters:
            raise ValueError(f"adapter indices {adapters} must be in 0..{len(self.names)}")
        first = self.first = adapters[0]
        self.mode = "mixed" if any(a != first for a in adapters) else "one" if first else "base"
        self.index = torch.tensor(adapters, dtype=torch.long, device=self.device)


class MultiLoRALinear(nn.Module):
    """A frozen projection (``base``, any module mapping (..., in) -> (..., out)) plus the
    stacked adapters ``A`` (N+1, r, in) and ``B`` (N+1, out, r) of ``stack_adapters``, each row
    updated by the adapter ``rows`` names for it. x (B, T, in) -> (B, T, out)."""

    def __init__(self, base: nn.Module, A: torch.Tensor, B: torch.Tensor, rows: AdapterRows,
                 kernel: str | None = None):  # fmt: skip
        super().__init__()
        self.base, self.rows = base, rows
        self.in_features, self.out_features = A.shape[2], B.shape[1]
        self.register_buffer("A", A)
        self.register_buffer("B", B)
        n, r = A.shape[0] - 1, A.shape[1]
        self.kernel = kernel or choose_kernel(n, r, self.in_features, self.out_features)
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel={self.kernel!r} must be one of {', '.join(KERNELS)}")
        # the B the mixed-rows kernel reads: stacked, or side by side (made once, not per step)
        self.register_buffer("B_mixed", B if self.kernel == "gather" else side_by_side(B))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        mode, index = self.rows.mode, self.rows.index
        if mode == "base":
            return y
        x = x.to(self.A.dtype)
        if mode == "one":  # every row one adapter: plain matmuls, no per-row copies
            if torch.compiler.is_compiling():  # a tensor index: one graph for every adapter
                a, b = self.A[index[:1]][0], self.B[index[:1]][0]
            else:  # views: no copy, and fewer ops per step than the gather above
                a, b = self.A[self.rows.first], self.B[self.rows.first]
            return y + F.linear(F.linear(x, a), b).to(y.dtype)
        return y + KERNELS[self.kernel](x, index, self.A, self.B_mixed).to(y.dtype)

    def extra_repr(self) -> str:
        n, r = self.A.shape[0] - 1, self.A.shape[1]
        sizes = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{sizes}, {n} adapters, r={r}, {self.kernel}"


def add_adapters(model: nn.Module, adapters: dict[str, dict[str, LoRAWeights]]) -> AdapterRows:
    """Wrap every projection of ``model`` that some adapter adapts in a ``MultiLoRALinear``.
    ``adapters``: name -> {module name -> its weights}, in the order their indices (1..N)
    follow. Returns the rows selector the wrappers share (every row on the base to start)."""
    names = list(adapters)
    modules = sorted({m for weights in adapters.values() for m in weights})
    device = next(model.parameters()).device
    rows = AdapterRows(names, device)
    for module in modules:
        parent_name, _, leaf = module.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        base = getattr(parent, leaf)
        A, B = stack_adapters([adapters[n].get(module) for n in names], base.in_features,
                              base.out_features)  # fmt: skip
        setattr(parent, leaf, MultiLoRALinear(base, A.to(device), B.to(device), rows))
    return rows
