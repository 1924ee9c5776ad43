"""Low-rank adapters (LoRA, Hu et al. 2021) on the model's projections.

    y = W x + s · B (A dropout(x))        W (out, in) frozen; A (r, in); B (out, r)
    s = alpha / r, or alpha / sqrt(r) with rsLoRA (Kalajdzievski 2023)

A starts as nn.Linear's default (Kaiming-uniform, a = sqrt(5)) and B at zero, so an adapted
model starts equal to its base. Merging adds s · B A into W (one matrix again, no extra cost at
inference); unmerging subtracts it. Shapes: x (..., in) -> (..., out).

The frozen W may be held in less memory (``base_dtype``; QLoRA, Dettmers et al. 2023): bf16;
int8 with one absmax scale per output channel; nf4 (the paper's NormalFloat) or int4 (a uniform
symmetric grid) in blocks of 64 with double-quantized constants, 4.127 bits a weight
(models/nf4.py). The stored tensors are widened to the activations' dtype in forward and again
in backward (no widened copy is kept between them). Merging into such a base gives an fp32
weight: widen(W) + s · B A.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from llm_foundry.messages import shown
from llm_foundry.models.nf4 import Quantized4bit, dequantize_4bit, quantize_4bit
from llm_foundry.models.quant import dequantize_int8, quantize_int8

# our projection names (the last part of a module's name) a LoRA can target
TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3", "lm_head")


@dataclass(frozen=True)
class BaseFormat:
    """How a frozen weight is held. ``hold``: the weight (out, in) -> its stored tensors by name
    (``weight`` first; the rest become buffers); ``widen``: those tensors, in that order, the
    weight's shape and a dtype -> the weight (out, in) the layer computes with."""

    hold: Callable[[torch.Tensor], dict[str, torch.Tensor]]
    widen: Callable[[tuple[torch.Tensor, ...], torch.Size, torch.dtype], torch.Tensor]


def _four_bit(grid: str) -> BaseFormat:
    names = ("weight", "weight_absmax", "weight_absmax_scale", "weight_absmax_offset")
    return BaseFormat(
        hold=lambda w: dict(zip(names, quantize_4bit(w, grid), strict=True)),
        widen=lambda t, shape, dtype: dequantize_4bit(Quantized4bit(*t), shape, grid).to(dtype),
    )


# how an adapted projection's frozen weight is held (fp32: as trained, an nn.Linear)
BASE_FORMATS = {
    "bf16": BaseFormat(
        hold=lambda w: {"weight": w.detach().to(torch.bfloat16)},
        widen=lambda t, shape, dtype: t[0].to(dtype),
    ),
    "int8": BaseFormat(
        hold=lambda w: dict(zip(("weight", "weight_scale"), quantize_int8(w), strict=True)),
        widen=lambda t, shape, dtype: dequantize_int8(*t).to(dtype),
    ),
    "nf4": _four_bit("nf4"),
    "int4": _four_bit("int4"),
}
BASE_DTYPES = ("fp32", *BASE_FORMATS)


class _WidenedMatmul(torch.autograd.Function):
    """x (..., in) @ fmt.widen(stored).T -> (..., out), a gradient for x only. Backward widens
    the weight again instead of saving the widened copy: between forward and backward only the
    low-precision tensors stay alive, which is where the memory goes with many layers."""

    @staticmethod
    def forward(ctx, x, fmt, shape, *stored):
        ctx.fmt, ctx.shape = fmt, shape
        ctx.save_for_backward(*stored)
        return F.linear(x, fmt.widen(stored, shape, x.dtype))  # under autocast: cast again inside

    @staticmethod
    def backward(ctx, grad):
        stored = ctx.saved_tensors
        none = (None,) * (2 + len(stored))
        if not ctx.needs_input_grad[0]:
            return None, *none
        return grad @ ctx.fmt.widen(stored, ctx.shape, grad.dtype), *none


class FrozenLinear(nn.Module):
    """A frozen ``nn.Linear`` whose weight is held as ``BASE_FORMATS[kind]`` says: ``weight``
    (bf16 (out, in); int8 (out, in) with fp32 ``weight_scale`` (out,); nf4/int4 packed codes
    uint8 (ceil(out·in/64)·32,) with ``weight_absmax*``, models/nf4.py); the bias, if any,
    stays as it was. x (..., in) -> (..., out)."""

    def __init__(self, base: nn.Linear, kind: str):
        super().__init__()
        if kind not in BASE_FORMATS:
            raise ValueError(f"FrozenLinear kind={kind!r} must be one of {', '.join(BASE_FORMATS)}")
        self.kind, self.in_features, self.out_features = kind, base.in_features, base.out_features
        self.linear_cls = type(base)  # what merging turns it back into
        stored = BASE_FORMATS[kind].hold(base.weight)
        self.weight = nn.Parameter(stored.pop("weight"), requires_grad=False)
        self.stored_names = ("weight", *stored)
        for name, t in stored.items():
            self.register_buffer(name, t)
        self.bias = base.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)

    def weights_in(self, p: torch.Tensor) -> int:
        """How many weights the parameter ``p`` of this layer holds (4-bit codes: two a byte)."""
        return self.in_features * self.out_features if p is self.weight else p.numel()

    def stored(self) -> tuple[torch.Tensor, ...]:
        """The tensors the weight is held in, ``weight`` first."""
        return tuple(getattr(self, name) for name in self.stored_names)

    def widened(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the layer computes with: (out, in) as ``dtype``."""
        shape = torch.Size((self.out_features, self.in_features))
        return BASE_FORMATS[self.kind].widen(self.stored(), shape, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = torch.Size((self.out_features, self.in_features))
        y = _WidenedMatmul.apply(x, BASE_FORMATS[self.kind], shape, *self.stored())
        return y if self.bias is None else y + self.bias.to(y.dtype)

    @torch.no_grad()
    def to_linear(self) -> nn.Linear:
        """An fp32 linear layer (of the class it was made from) holding ``widened()``."""
        linear = torch.nn.utils.skip_init(
            self.linear_cls, self.in_features, self.out_features,
            bias=self.bias is not None, device=self.weight.device,
        )  # fmt: skip
        linear.weight.copy_(self.widened())
        if self.bias is not None:
            linear.bias.copy_(self.bias)
        return linear.requires_grad_(False)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}"


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update."""

    def __init__(
        self,
        base: nn.Linear,
        r: int,
        alpha: float,
        dropout: float,
        rslora: bool,
        base_dtype: str = "fp32",
    ):
        super().__init__()
        for p in base.parameters():
            p.requires_grad_(False)
        self.base = base if base_dtype == "fp32" else FrozenLinear(base, base_dtype)
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features, device=base.weight.device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r, device=base.weight.device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.r, self.alpha, self.dropout, self.rslora = r, alpha, dropout, rslora
        self.scale = alpha / (math.sqrt(r) if rslora else r)
        self.drop = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.merged = False
        self.enabled = True  # False: the base alone (adapters_disabled)

    @property
    def base_dtype(self) -> str:
        """How the frozen weight is held now: one of ``BASE_DTYPES`` (fp32 again once merged)."""
        return getattr(self.base, "kind", "fp32")

    def flops_per_token(self) -> int:
        """Training FLOPs per token: the frozen weight's forward and input gradient (4 per
        weight, no weight gradient) plus the adapters' 6 per weight."""
        frozen = self.base.in_features * self.base.out_features  # not the packed codes' count
        return 4 * frozen + 6 * (self.lora_A.numel() + self.lora_B.numel())

    def delta(self) -> torch.Tensor:
        """The update s · B A this adapter adds to the base weight: (out, in)."""
        return self.scale * (self.lora_B @ self.lora_A)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.merged or not self.enabled:  # merged: the update is inside base.weight already
            return y
        return y + self.scale * F.linear(F.linear(self.drop(x), self.lora_A), self.lora_B)

    @torch.no_grad()
    def merge(self) -> None:
        """Fold s · B A into the base weight; a bf16/int8/nf4/int4 base becomes fp32 first
        (widen(W) + s · B A: rounding the sum back would lose the update) and stays fp32."""
        if not self.merged:
            if isinstance(self.base, FrozenLinear):
                self.base = self.base.to_linear()
            self.base.weight += self.delta().to(self.base.weight.dtype)
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        if self.merged:
            self.base.weight -= self.delta().to(self.base.weight.dtype)
            self.merged = False


def effective_weight(module: nn.Module) -> torch.Tensor:
    """The weight (out, in) a projection computes with, whatever LoRA made of it: an
    ``nn.Linear``'s own weight; a ``FrozenLinear``'s widened to fp32 (int8, nf4, int4
    dequantized, bf16 cast); a ``LoRALinear``'s base weight so read plus its update s · B A unless merged (then
    the base holds it already). ``module(x) == x @ effective_weight(module).T + bias``, to
    rounding. Gradients reach the adapters; call it under ``torch.no_grad()`` to only read."""
    if isinstance(module, LoRALinear):
        w = effective_weight(module.base)
        return w if module.merged else w + module.delta()
    if isinstance(module, FrozenLinear):
        return module.widened()
    return module.weight


def add_lora(
    model: nn.Module,
    targets: Iterable[str] = ("wq", "wv"),
    r: int = 8,
    alpha: float = 16.0,
    dropout: float = 0.0,
    rslora: bool = False,
    base_dtype: str = "fp32",
) -> list[str]:
    """Freeze ``model`` and put a LoRA on every linear layer whose name ends in one of
    ``targets`` (of ``TARGETS``), its frozen weight held as ``base_dtype`` (of ``BASE_DTYPES``;
    the rest of the model is left as it is). Returns the adapted modules' names, in model
    order."""
    targets = tuple(targets)
    problems = check_settings(dict(targets=targets, r=r, alpha=alpha, dropout=dropout,
                                   rslora=rslora, base_dtype=base_dtype))  # fmt: skip
    if problems:
        raise ValueError("; ".join(problems))
    names = [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name.split(".")[-1] in targets
    ]
    if not names:
        raise ValueError(f"the model has no linear layer named {', '.join(targets)}")
    return add_lora_at(model, names, r, alpha, dropout, rslora, base_dtype)


def add_lora_at(
    model: nn.Module,
    names: Iterable[str],
    r: int = 8,
    alpha: float = 16.0,
    dropout: float = 0.0,
    rslora: bool = False,
    base_dtype: str = "fp32",
    fitted: bool = False,
    merged: bool = True,
) -> list[str]:
    """``add_lora`` on exactly the linear layers ``names`` (full module names: a PEFT adapter
    may adapt some layers' projections and not others'). Returns ``names``. ``fitted``: the
    adapters' weights exist (an adapter loaded), so a rank above a layer's is theirs, not a
    typo; ``merged`` false: they stay beside the weights (serve), so a tied lm_head may take
    one without changing the embedding."""
    names = list(names)
    targets = sorted({name.split(".")[-1] for name in names})
    problems = check_settings(dict(targets=targets, r=r, alpha=alpha, dropout=dropout,
                                   rslora=rslora, base_dtype=base_dtype))  # fmt: skip
    plain = [n for n in names if not isinstance(model.get_submodule(n), nn.Linear)]
    if plain:
        problems.append(f"{plain[0]} is not a linear layer")
    if problems:
        raise ValueError("; ".join(problems))
    cfg = getattr(model, "cfg", None)
    if merged and "lm_head" in targets and getattr(cfg, "tie_embeddings", False):
        raise ValueError(
            "lm_head is tied to the token embedding: a LoRA merged into it would change the "
            "embedding too; leave lm_head out of the targets, or untie the model"
        )
    for p in model.parameters():
        p.requires_grad_(False)
    # a rank above min(in, out) adds parameters but no rank: refused before anything is allocated
    # (so a mistyped r cannot take the machine's memory)
    smallest = min(names, key=lambda n: min(model.get_submodule(n).weight.shape))
    limit = min(model.get_submodule(smallest).weight.shape)
    if r > limit and not fitted:
        out_f, in_f = model.get_submodule(smallest).weight.shape
        raise ValueError(
            f"LoRA rank r={r:,} exceeds the rank {limit} of {smallest} ({out_f}x{in_f}); "
            f"use r <= {limit}"
        )
    for name in names:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        base = getattr(parent, leaf)
        setattr(parent, leaf, LoRALinear(base, r, alpha, dropout, rslora, base_dtype))
    return names


def check_settings(settings: dict) -> list[str]:
    """Problems with LoRA settings (``add_lora``'s arguments, a checkpoint's ``lora`` entry or a
    PEFT adapter's config), empty when fine: a value that would build adapters computing NaN, or
    nothing, is named here rather than found in the outputs."""
    r, alpha, dropout = settings.get("r"), settings.get("alpha"), settings.get("dropout", 0.0)
    targets, base_dtype = settings.get("targets"), settings.get("base_dtype", "fp32")
    problems = []
    if not isinstance(targets, list | tuple) or not targets:
        problems.append(
            f"LoRA targets={shown(targets)} must be a non-empty list of {', '.join(TARGETS)}"
        )
    elif unknown := sorted({str(t) for t in targets} - set(TARGETS)):
        problems.append(f"LoRA targets {shown(unknown)} are not among {', '.join(TARGETS)}")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        problems.append(f"LoRA rank r={shown(r)} must be a positive integer")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        problems.append(f"LoRA alpha={shown(alpha)} must be a finite number")
    if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0 <= dropout < 1:
        problems.append(f"LoRA dropout={shown(dropout)} must be in [0, 1)")
    if not isinstance(settings.get("rslora", False), bool):
        problems.append(f"LoRA rslora={shown(settings['rslora'])} must be true or false")
    if base_dtype not in BASE_DTYPES:
        problems.append(
            f"LoRA base_dtype={shown(base_dtype)} must be one of {', '.join(BASE_DTYPES)}"
        )
    return problems


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """name -> adapter, for every LoRA in ``model``."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """``model`` computing as its base alone for the duration (a DPO reference, say): every
    adapter's update left out, no weight touched. Merged adapters are refused: their update is
    inside the base weight."""
    layers = lora_layers(model)
    merged = [n for n, m in layers.items() if m.merged]
    if merged:
        raise ValueError(f"adapters merged into their base ({merged[0]}, ...): unmerge them first")
    before = {n: m.enabled for n, m in layers.items()}
    for m in layers.values():
        m.enabled = False
    try:
        yield model
    finally:
        for n, m in layers.items():
            m.enabled = before[n]


def merge_lora(model: nn.Module) -> None:
    """Fold every adapter into its base weight (the model computes the same, one matrix each)."""
    for m in lora_layers(model).values():
        m.merge()


def fold_lora(model: nn.Module) -> list[str]:
    """Merge every adapter and put its base layer, now holding widen(W) + s · B A in fp32, in
    its place: a plain model again, with the state-dict names of one that never had adapters
    (what every export and ``quantize`` read). Returns the folded modules' names."""
    layers = lora_layers(model)
    for name, lora in layers.items():
        lora.merge()
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, lora.base)
    return list(layers)


def unmerge_lora(model: nn.Module) -> None:
    """Take every merged update out again (a low-precision base merged into fp32 stays fp32)."""
    for m in lora_layers(model).values():
        m.unmerge()


def frozen_base_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes the adapted projections' frozen tensors hold now: weights, their scales or
    absmax constants, biases; bytes the same weights and biases hold in fp32), from the tensors
    themselves."""
    fp32_size = torch.finfo(torch.float32).bits // 8
    held = fp32 = 0
    for m in lora_layers(model).values():
        base = m.base
        stored = base.stored() if isinstance(base, FrozenLinear) else (base.weight,)
        bias = () if base.bias is None else (base.bias,)
        held += sum(t.nbytes for t in (*stored, *bias))
        fp32 += (base.in_features * base.out_features + sum(b.numel() for b in bias)) * fp32_size
    return held, fp32


def lora_settings(model: nn.Module) -> dict | None:
    """What ``add_lora`` was given, read back from the model (None without adapters): saved with
    a checkpoint so that loading rebuilds the same adapters."""
    layers = lora_layers(model)
    if not layers:
        return None
    first = next(iter(layers.values()))
    targets = sorted({name.split(".")[-1] for name in layers})
    settings = dict(
        r=first.r, alpha=first.alpha, dropout=first.dropout, rslora=first.rslora, targets=targets
    )
    if first.base_dtype != "fp32":  # the stored base weights: bf16, int8 + scales, 4-bit codes
        settings["base_dtype"] = first.base_dtype
    return settings


def base_differences(model: nn.Module, tuned: nn.Module) -> tuple[list[str], int]:
    """(names of ``tuned``'s frozen-base tensors that differ from ``model``'s, how many were
    compared): ``tuned`` a LoRA model (adapters not merged), ``model`` a plain one of the same
    architecture. Compared where the base is held exactly: every tensor outside the adapted
    projections, and their weights where held in fp32 or bf16 (int8 and 4-bit codes are not
    recomputed)."""
    mine, differ, compared = model.state_dict(), [], 0
    layers = lora_layers(tuned)
    for name, t in tuned.state_dict().items():
        owner, _, leaf = name.rpartition(".")
        if leaf in ("lora_A", "lora_B"):
            continue
        if owner.endswith(".base") and owner.removesuffix(".base") in layers:
            layer = layers[owner.removesuffix(".base")]
            if layer.base_dtype not in ("fp32", "bf16") or leaf not in ("weight", "bias"):
                continue
            name = f"{owner.removesuffix('.base')}.{leaf}"
        if name not in mine:
            continue
        compared += 1
        if not torch.equal(mine[name].to(t.dtype), t):
            differ.append(name)
    return differ, compared


def describe_merge(settings: dict, source: str | None = None) -> str:
    """One line saying that adapters with ``settings`` (``lora_settings``) were merged into the
    base weights, and from where."""
    base = settings.get("base_dtype", "fp32")
    widened = f", the {base} base widened to fp32" if base != "fp32" else ""
    where = f" of {source}" if source else ""
    over = settings.get("trained_over")  # an --adapter run fitted to a rounded base
    trained = f" (trained over the {over}-rounded base, put on this one)" if over else ""
    other = settings.get("other_base")  # a LoRA run put on a base unlike its frozen one
    note = (
        f"; note: they were trained over other base weights than these ({other}): give "
        "--checkpoint the base they were fine-tuned from"
        if other
        else ""
    )
    return (
        f"merged the LoRA adapters{where}{trained} (r={settings['r']}, alpha={settings['alpha']}, "
        f"on {', '.join(settings['targets'])}) into the base weights: widen(W) + s·B·A{widened}"
        f"{note}"
    )


def apply_lora_settings(model: nn.Module, settings: dict | None) -> nn.Module:
    """``add_lora`` with settings from ``lora_settings`` (a no-op for None); returns ``model``."""
    if settings:
        add_lora(
            model,
            settings["targets"],
            r=settings["r"],
            alpha=settings["alpha"],
            dropout=settings["dropout"],
            rslora=settings["rslora"],
            base_dtype=settings.get("base_dtype", "fp32"),
        )
    return model
