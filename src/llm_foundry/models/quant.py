"""Weight-only quantization of the model's projections for CPU decoding.

Decoding one token reads every weight once, so on a CPU its speed is memory bandwidth over the
bytes of the weights: fewer bytes per weight is the only way past the fp32 bound. Activations stay
floating point; only the stored weights shrink.

    int8   w ≈ q · scale[row]                     q int8 (out, in), one fp32 scale per output row
    int4   w ≈ (q - 8) · scale[row, g] + zero[row, g]
                                                  q in 0..15, two per byte, per group of ``group``
                                                  inputs a bf16 scale and zero (the value at q = 8)

Kernels (measured in benchmarks/bench_quant_kernels.py), by how many rows a call carries:
- one row in a compiled step, int8: a fused multiply-and-sum over the int8 bytes, fp32 activations;
- fewer than ``KERNEL_ROWS`` rows otherwise (eager decoding, a batch of sequences): PyTorch's
  ``_weight_int8pack_mm`` / ``_weight_int4pack_mm_for_cpu``, whose fast paths take bf16
  activations (so these rows are rounded to bf16 on the way in; ~2x / ~4x faster than fp32);
- ``KERNEL_ROWS`` rows or more (a prompt, an evaluation window): the weight widened to fp32 once
  and one fp32 matrix product, exact and as fast as the kernels when the widening is shared by
  many rows. int4 and eager int8 thus round activations only while decoding.
- off the CPU (a GPU): always the widened weight (the kernels above are CPU-only): the logits of
  the dequantized weights, the weights held in a quarter / an eighth of the memory, no faster.

Files hold the portable layout above (safetensors: ``qweight``, ``scales``, ``zeros``); the int4
kernel's own packed layout is built from it at load. Token embeddings stay fp32 (a lookup reads
one row per token) and so do MoE experts; the output head is quantized (when tied, a quantized
copy of the embedding matrix).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from llm_foundry.messages import shown
from llm_foundry.models.linear import Linear, matvec

GROUP_SIZES = (32, 64, 128)  # int4 groups the CPU kernel takes (it needs in % group == 0)
INT4_ROWS = 16  # the int4 CPU kernel packs output rows in blocks of 16 (fewer are padded)
INT8_COLS = 16  # _weight_int8pack_mm misreads inputs beyond the last multiple of 16 (torch 2.13)
KERNEL_ROWS = 64  # from this many rows on, widening the weight once is as fast as the kernels


def by(t: torch.Tensor, n: float) -> torch.Tensor:
    """``n`` as a tensor like ``t``, to divide by: CUDA divides by a Python number as a product with
    its reciprocal, one ulp off the CPU's quotient at times; by a tensor, exactly, as the CPU."""
    return torch.full_like(t, n)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax int8, one scale per output channel: w (out, in) -> q int8 (out, in),
    scale fp32 (out,), with w ≈ q · scale[:, None] and |w - q · scale| <= scale / 2 in each row
    (an all-zero row gets scale 1 and q = 0)."""
    w = w.detach().float()
    absmax = w.abs().amax(dim=1)  # (out,)
    scale = torch.where(absmax > 0, absmax / by(absmax, 127), torch.ones_like(absmax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127)  # -128 unused: symmetric
    return q.to(torch.int8), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q int8 (out, in), scale (out,) -> fp32 (out, in): q · scale[:, None]."""
    return q.float() * scale[:, None]


def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 per group of ``group`` inputs: w (out, in) -> packed uint8 (out, in/2)
    (input 2j in the low nibble, 2j+1 in the high), scales and zeros bf16 (out, in/group).
    The grid spans each group's min..max; q is rounded against the bf16-rounded scale and zero
    that are stored, so |w - dequantized| <= scale / 2 wherever the grid reaches."""
    out, n_in = w.shape
    g = w.detach().float().reshape(out, n_in // group, group)
    lo, hi = g.amin(-1), g.amax(-1)  # (out, groups)
    scale = ((hi - lo) / by(lo, 15)).clamp(min=1e-8).to(torch.bfloat16)
    zero = (lo + 8 * scale.float()).to(torch.bfloat16)
    q = torch.round((g - zero.float()[..., None]) / scale.float()[..., None] + 8).clamp_(0, 15)
    q = q.to(torch.uint8).reshape(out, n_in)
    return q[:, 0::2] | (q[:, 1::2] << 4), scale, zero


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 (out, in/2) -> the 4-bit codes as int32 (out, in), inputs in order."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2).to(torch.int32)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The fp32 weight (out, in) of ``quantize_int4``'s output: (q - 8) · scale + zero."""
    q = unpack_int4(packed).float()
    out, n_in = q.shape
    groups = scale.shape[1]
    q = q.reshape(out, groups, n_in // groups)
    return ((q - 8) * scale.float()[..., None] + zero.float()[..., None]).reshape(out, n_in)


class QuantLinear(nn.Module):
    """A projection holding quantized weights; subclasses know one scheme each."""

    scheme = ""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self._kernel: tuple[torch.Tensor, torch.Tensor] | None = None
        # the kernel's layout is made as soon as codes arrive, so a compiled step only reads it
        self.register_load_state_dict_post_hook(_prepare_after_load)

    def dequantized(self) -> torch.Tensor:
        """The fp32 weight (out, in) this layer computes with."""
        raise NotImplementedError

    def kernel_weights(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The stored codes and scales in the CPU kernel's layout, built once (None off the CPU:
        the widened weight is used there)."""
        if self.qweight.device.type != "cpu":
            return None
        if self._kernel is None:
            self._kernel = self._kernel_layout()
        return self._kernel

    def _kernel_layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def flops_per_token(self) -> int:
        return 6 * self.in_features * self.out_features

    def weight_bytes(self) -> int:
        """Bytes one forward reads for the weight (what bounds decoding)."""
        return sum(b.numel() * b.element_size() for b in self.buffers() if b is not None)

    def _add_bias(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"{self.scheme}, in={self.in_features}, out={self.out_features}"


def _prepare_after_load(module: QuantLinear, incompatible_keys) -> None:
    module._kernel = None  # new codes: a new kernel layout
    module.kernel_weights()


class Int8Linear(QuantLinear):
    scheme = "int8"

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, out_features, bias)
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.ones(out_features))

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: int | None = None) -> Int8Linear:
        with torch.device(linear.weight.device):  # the bias too, beside the codes (a GPU's)
            m = cls(linear.in_features, linear.out_features, linear.bias is not None)
        m.qweight, m.scales = quantize_int8(linear.weight)
        if linear.bias is not None:
            m.bias.data.copy_(linear.bias.detach())
        m.kernel_weights()
        return m

    def dequantized(self) -> torch.Tensor:
        return dequantize_int8(self.qweight, self.scales)

    def _kernel_layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(``qweight`` with zero columns up to a multiple of 16, the scales in bf16)."""
        return F.pad(self.qweight, (0, -self.in_features % INT8_COLS)), self.scales.bfloat16()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[:-1].numel()
        if x.device.type != "cpu" or rows >= KERNEL_ROWS:
            return F.linear(x, self.dequantized().to(x.dtype), self.bias)
        if torch.compiler.is_compiling() and rows == 1:
            # compiled one-token step: one fused pass over the int8 bytes, fp32 activations
            return self._add_bias(matvec(x, self.qweight) * self.scales)
        q, scales = self.kernel_weights()
        # zero columns against the padded ones: the kernel then reads only ours
        flat = F.pad(x.reshape(-1, self.in_features).bfloat16(), (0, q.shape[1] - self.in_features))
        y = torch._weight_int8pack_mm(flat, q, scales)
        return self._add_bias(y.to(x.dtype).reshape(*x.shape[:-1], self.out_features))


class Int4Linear(QuantLinear):
    scheme = "int4"

    def __init__(self, in_features: int, out_features: int, bias: bool = False, group: int = 64):
        super().__init__(in_features, out_features, bias)
        self.group = group
        groups = in_features // group
        self.register_buffer(
            "qweight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8)
        )
        self.register_buffer("scales", torch.ones(out_features, groups, dtype=torch.bfloat16))
        self.register_buffer("zeros", torch.zeros(out_features, groups, dtype=torch.bfloat16))

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: int | None = 64) -> Int4Linear:
        with torch.device(linear.weight.device):
            m = cls(linear.in_features, linear.out_features, linear.bias is not None, group)
        m.qweight, m.scales, m.zeros = quantize_int4(linear.weight, group)
        if linear.bias is not None:
            m.bias.data.copy_(linear.bias.detach())
        m.kernel_weights()
        return m

    def dequantized(self) -> torch.Tensor:
        return dequantize_int4(self.qweight, self.scales, self.zeros)

    def _kernel_layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the CPU kernel's packed codes, scales-and-zeros (groups, out, 2) bf16)."""
        pad = -self.out_features % INT4_ROWS  # zero rows: code 8, scale and zero 0
        codes = F.pad(unpack_int4(self.qweight), (0, 0, 0, pad), value=8)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
        sz = torch.stack((self.scales, self.zeros), dim=-1)  # (out, groups, 2)
        return packed, F.pad(sz, (0, 0, 0, 0, 0, pad)).transpose(0, 1).contiguous()

    def weight_bytes(self) -> int:
        return self.qweight.numel() + 2 * self.scales.numel() * self.scales.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or x.shape[:-1].numel() >= KERNEL_ROWS:
            return F.linear(x, self.dequantized().to(x.dtype), self.bias)
        packed, sz = self.kernel_weights()
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, packed, self.group, sz)
        y = y[:, : self.out_features]  # rows padded to the kernel's block of 16
        return self._add_bias(y.to(x.dtype).reshape(*x.shape[:-1], self.out_features))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group={self.group}"


SCHEMES: dict[str, type[QuantLinear]] = {"int8": Int8Linear, "int4": Int4Linear}


def fits(scheme: str, linear: nn.Module, group: int) -> bool:
    """Whether ``scheme``'s kernel takes this projection's shape (int4: in % group == 0; int8
    takes any)."""
    return scheme != "int4" or linear.in_features % group == 0


def _projections(model: nn.Module) -> dict[str, nn.Linear]:
    """Every dense projection (nn.Linear) by module name. MoE expert banks are not Linear, and
    routers stay fp32: a rounded router logit can send a token to another expert."""
    return {
        n: m
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and n and not n.endswith("router")
    }


def check_settings(scheme: str, group: int | None) -> list[str]:
    """Problems with a quantization request (empty when fine)."""
    problems = []
    if scheme not in SCHEMES:
        problems.append(f"quantization scheme {scheme!r} is not one of {', '.join(SCHEMES)}")
    if scheme == "int4" and group not in GROUP_SIZES:
        problems.append(f"int4 group size {group!r} is not one of {GROUP_SIZES}")
    return problems


def refuse_no_fit(scheme: str, group: int, projections: dict, name: str, flag: str) -> None:
    """One line when ``scheme`` fits none of ``projections`` (int4 groups wider than every
    input width or not dividing it): the group size, the input widths and the group sizes that
    would fit, else ``flag`` int8 (the option that picks the scheme). ``name``: the model."""
    if not projections or any(fits(scheme, m, group) for m in projections.values()):
        return
    widths = sorted({m.in_features for m in projections.values()})
    fit = [g for g in GROUP_SIZES if any(w % g == 0 for w in widths)]
    hint = (
        f"--group-size {' or '.join(map(str, fit))} fits" if fit else f"{flag} int8 takes any width"
    )
    raise ValueError(
        f"{name}: int4 in groups of {group} inputs quantizes none of its {len(projections)} "
        f"projections: their input widths ({', '.join(map(str, widths))}) are not multiples of "
        f"{group}; {hint}"
    )


def quantize_model(
    model: nn.Module,
    scheme: str,
    group: int = 64,
    name: str = "the model",
    flag: str = "--quantize",
) -> dict:
    """Replace the projections of ``model`` (in place) by ``scheme``'s quantized layers; returns
    the settings a checkpoint records: scheme, group (int4), the layers quantized and those kept
    in fp32 because the kernel does not take their shape. A scheme that fits none of them is
    refused before any is replaced (``refuse_no_fit``: ``name`` the model, ``flag`` the option
    that picks the scheme, for the hint)."""
    problems = check_settings(scheme, group)
    if problems:
        raise ValueError("; ".join(problems))
    if any(isinstance(m, QuantLinear) for m in model.modules()):
        raise ValueError("the model is quantized already")
    # by name: models/lora.py imports this module (its int8 base), not the other way round
    if any(type(m).__name__ == "LoRALinear" for m in model.modules()):
        raise ValueError("the model has unmerged LoRA adapters: merge them before quantizing")
    cls, projections = SCHEMES[scheme], _projections(model)
    refuse_no_fit(scheme, group, projections, name, flag)
    done, kept = [], []
    with torch.no_grad():
        for layer, linear in projections.items():
            if not fits(scheme, linear, group):
                kept.append(layer)
                continue
            parent, _, attr = layer.rpartition(".")
            setattr(model.get_submodule(parent), attr, cls.from_linear(linear, group))
            done.append(layer)
    settings = {"scheme": scheme, "layers": done, "kept_fp32": kept}
    if scheme == "int4":
        settings["group_size"] = group
    return settings


def apply_quant_settings(model: nn.Module, settings: dict | None) -> nn.Module:
    """Swap in empty quantized layers where ``settings`` (a checkpoint's ``quantization``) says,
    so that its weights load into them."""
    if not settings:
        return model
    cls, group = SCHEMES[settings["scheme"]], settings.get("group_size")
    layers = _projections(model)
    unknown = [n for n in settings["layers"] if n not in layers]
    if unknown:  # a config edited by hand, or written for another model
        raise ValueError(
            f"'quantization' lists {len(unknown)} layer(s) the model has no projection for: "
            f"{shown(unknown)} (its projections are named like {next(iter(layers), 'none')})"
        )
    for name in settings["layers"]:
        linear = layers[name]
        kwargs = {"group": group} if group else {}
        with torch.device(linear.weight.device):
            q = cls(linear.in_features, linear.out_features, linear.bias is not None, **kwargs)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, q)
    return model


def read_settings(meta: dict, file) -> dict | None:
    """A checkpoint config's ``quantization`` entry, checked (None: a full-precision model)."""
    q = meta.get("quantization")
    if q is None:
        return None
    ok = isinstance(q, dict) and isinstance(q.get("layers"), list)
    problems = check_settings(q.get("scheme"), q.get("group_size")) if ok else ["not an object"]
    if not ok or problems:
        raise ValueError(
            f"{file}: 'quantization' is {shown(q)} ({'; '.join(problems) or 'no layers list'}); "
            f"expected scheme one of {', '.join(SCHEMES)}, group_size (int4) and layers"
        )
    return q


def dequantize_model(model: nn.Module) -> nn.Module:
    """Replace quantized layers by fp32 ``Linear`` layers holding the weights they compute with
    (the reference a quantized model is checked against)."""
    for name, q in [(n, m) for n, m in model.named_modules() if isinstance(m, QuantLinear)]:
        with torch.device(q.qweight.device):
            lin = Linear(q.in_features, q.out_features, bias=q.bias is not None)
        with torch.no_grad():
            lin.weight.copy_(q.dequantized())
            if q.bias is not None:
                lin.bias.copy_(q.bias)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, lin)
    return model


def quant_settings(model: nn.Module) -> dict | None:
    """What a checkpoint records of a quantized model (None: no quantized layer)."""
    layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    if not layers:
        return None
    first = next(iter(layers.values()))
    settings = {"scheme": first.scheme, "layers": list(layers)}
    if isinstance(first, Int4Linear):
        settings["group_size"] = first.group
    return settings


def weight_bytes(model: nn.Module) -> int:
    """Bytes a one-token forward reads for weights: every parameter and quantized buffer except
    the embedding tables (a lookup reads one row)."""
    total = 0
    for m in model.modules():
        if isinstance(m, QuantLinear):
            total += m.weight_bytes()
            continue
        if isinstance(m, nn.Embedding):
            continue
        total += sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
    return total
