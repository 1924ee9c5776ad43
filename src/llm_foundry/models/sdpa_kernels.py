"""Which fused kernel PyTorch's ``scaled_dot_product_attention`` runs: ``train.sdpa_backend``.

``auto`` lets PyTorch pick per call, by its priority order and what the inputs allow. The others
pin one kernel for a run's forwards and backwards: ``flash`` (FlashAttention-2, Dao 2023; on a
CPU PyTorch's own flash-style kernel), ``efficient`` (memory-efficient attention, Rabe & Staats
2021, xFormers' kernel), ``cudnn`` (NVIDIA cuDNN's fused attention) and ``math`` (the product
spelled out, on every device). Which one is fastest depends on the card, the head width and the
dtype: pinning one is how a run measures it. Whether a kernel can run a model's attention (its
dtype, head width, masks for windows, ALiBi or packed documents, dropout) is found by running
the model itself on a few tokens with the kernel pinned (``model_probe``): a kernel that cannot
is refused before training, in one line naming the ones that can.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

SDPA_BACKENDS = {
    "auto": None,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}
_WHERE = re.compile(r"\s*\(Triggered internally at [^)]*\)\.?")  # PyTorch's source location


def sdpa_backend(name: str):
    """The context in which SDPA runs ``name``'s kernel only (``auto``: no constraint)."""
    backend = SDPA_BACKENDS[name]
    return contextlib.nullcontext() if backend is None else sdpa_kernel([backend])


def _reasons(said: list) -> list[str]:
    """PyTorch's warnings on why a kernel was not used, each one clean line: its source
    location dropped, and lines that only introduce the next ("... not used because:")."""
    out = []
    for w in said:
        for line in _WHERE.sub("", str(w.message)).strip().splitlines():
            line = line.strip()
            if line and not line.endswith(":") and line not in out:
                out.append(line)
    return out


def why_not(name: str, run: Callable[[], None], where: str = "here") -> str | None:
    """None when ``run()`` (work that calls SDPA, e.g. ``model_probe``'s) runs with SDPA pinned
    to ``name``'s kernel; else why not, in one line (PyTorch's own reasons where it gives them)."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        try:
            with sdpa_backend(name):
                run()
        except RuntimeError as e:
            if reasons := _reasons(said):
                return "; ".join(reasons[:2])
            if str(e).startswith(("No viable backend", "No available kernel")):
                return f"PyTorch has no {name} kernel for this attention {where}"
            return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return None


def model_probe(model, device, autocast: Callable, doc: bool = False,
                tokens: int = 16) -> Callable[[], None]:  # fmt: skip
    """A forward and backward of ``model`` (in its mode: dropout as in training) on ``tokens``
    random ids of one row, in ``autocast()``, with document ids where ``doc`` (packed rows: their
    mask); its gradients are dropped and the random number generators left as they were."""
    vocab, T = model.cfg.vocab_size, min(tokens, model.cfg.max_seq_len)

    def run():
        devices = [device] if torch.device(device).type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            x = torch.randint(0, vocab, (1, T), device=device)
            ids = torch.zeros_like(x) if doc else None
            try:
                with autocast():
                    loss = model(x, x, doc=ids)[1]
                loss.backward()
            finally:
                model.zero_grad(set_to_none=True)

    return run


def check_sdpa_backend(name: str, run: Callable[[], None], where: str) -> None:
    """Raise ValueError, in one line, when ``name``'s kernel cannot ``run()`` (``where``: the
    device and model, for the message), naming the kernels that can."""
    why = why_not(name, run, where)
    if why is None:
        return
    runs = [n for n in SDPA_BACKENDS if why_not(n, run, where) is None]
    raise ValueError(
        f"train.sdpa_backend={name!r} cannot run this model's attention {where}: {why}; "
        f"valid here: {', '.join(runs)}"
    )
