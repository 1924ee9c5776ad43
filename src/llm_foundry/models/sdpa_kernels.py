"""Which fused kernel PyTorch's ``scaled_dot_product_attention`` runs: ``train.sdpa_backend``.

``auto`` lets PyTorch pick per call, by its priority order and what the inputs allow. The others
pin one kernel for a run's forwards and backwards: ``flash`` (FlashAttention-2, Dao 2023; on a
CPU PyTorch's own flash-style kernel), ``efficient`` (memory-efficient attention, Rabe & Staats
2021, xFormers' kernel), ``cudnn`` (NVIDIA cuDNN's fused attention) and ``math`` (the product
spelled out, on every device). Which one is fastest depends on the card, the head width and the
dtype: pinning one is how a run measures it. A kernel that cannot run the run's attention on its
device is refused before training, in one line naming the ones that can.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SDPA_BACKENDS = {
    "auto": None,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}


def sdpa_backend(name: str):
    """The context in which SDPA runs ``name``'s kernel only (``auto``: no constraint)."""
    backend = SDPA_BACKENDS[name]
    return contextlib.nullcontext() if backend is None else sdpa_kernel([backend])


def why_not(name: str, device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
            masked: bool, dropout: float = 0.0) -> str | None:  # fmt: skip
    """None when ``name``'s kernel runs a causal attention of ``heads`` query and ``kv_heads``
    key/value heads of width ``head_dim`` in ``dtype`` on ``device``, forward and backward (with
    an additive mask where ``masked``: sliding windows, ALiBi, packed documents; with attention
    ``dropout``); else why not, in one line (PyTorch's own reasons where it gives them)."""
    q = torch.randn(1, heads, 16, head_dim, device=device, dtype=dtype, requires_grad=True)
    kv = torch.randn(1, kv_heads, 16, head_dim, device=device, dtype=dtype)
    mask = torch.zeros(16, 16, device=device, dtype=dtype) if masked else None
    if masked:
        mask = mask.masked_fill(~torch.ones(16, 16, dtype=torch.bool, device=device).tril(),
                                float("-inf"))  # fmt: skip
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        try:
            with sdpa_backend(name):
                out = F.scaled_dot_product_attention(q, kv, kv, attn_mask=mask,
                                                     dropout_p=dropout, is_causal=mask is None,
                                                     enable_gqa=heads != kv_heads)  # fmt: skip
                out.sum().backward()
        except RuntimeError as e:
            reasons = [str(w.message).strip().splitlines()[0] for w in said if str(w.message)]
            if reasons:
                return "; ".join(reasons[:2])
            if str(e).startswith("No viable backend"):  # PyTorch gives no reason of its own
                return f"PyTorch has no {name} kernel for these inputs on {q.device.type}"
            return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return None


def check_sdpa_backend(name: str, device, dtype: torch.dtype, heads: int, kv_heads: int,
                       head_dim: int, masked: bool, dropout: float = 0.0) -> None:  # fmt: skip
    """Raise ValueError, in one line, when ``name``'s kernel cannot run the attention ``why_not``
    describes, naming the kernels that can."""
    shape = (device, dtype, heads, kv_heads, head_dim, masked, dropout)
    why = why_not(name, *shape)
    if why is None:
        return
    runs = [n for n in SDPA_BACKENDS if why_not(n, *shape) is None]
    what = f"{torch.device(device).type}, {str(dtype).removeprefix('torch.')}, {heads} heads of {head_dim}"
    raise ValueError(
        f"train.sdpa_backend={name!r} cannot run this model's attention here ({what}"
        f"{', masked' if masked else ''}{f', dropout {dropout}' if dropout else ''}): {why}; "
        f"valid here: {', '.join(runs)}"
    )
