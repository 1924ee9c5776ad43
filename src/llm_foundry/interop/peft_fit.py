"""Whether a PEFT adapter's tensors fit a model, and when they do not, the model they were made
for, read from the tensors alone: lora_A is (r, in) and lora_B (out, r), so each adapted
projection gives its two sides (``SIDES`` names which of the config's sizes each is), and the
highest layer index in the tensors' names gives the layer count.
"""

from __future__ import annotations

import re

import torch

# (in, out) of each of our projections, as the config's sizes
SIDES = {
    "wq": ("dim", "n_heads x head_dim"),
    "wk": ("dim", "n_kv_heads x head_dim"),
    "wv": ("dim", "n_kv_heads x head_dim"),
    "wo": ("n_heads x head_dim", "dim"),
    "w1": ("dim", "hidden_dim"),
    "w3": ("dim", "hidden_dim"),
    "w2": ("hidden_dim", "dim"),
    "lm_head": ("dim", "vocab_size"),
}
LAYER = re.compile(r"^layers\.(\d+)\.")  # our block modules' names


def tensor_ranks(modules: dict[str, dict[str, torch.Tensor]]) -> set[int]:
    """The ranks the tensors have: lora_A's rows and lora_B's columns."""
    ranks = set()
    for parts in modules.values():
        if "lora_A" in parts:
            ranks.add(parts["lora_A"].shape[0])
        if "lora_B" in parts and parts["lora_B"].dim() == 2:
            ranks.add(parts["lora_B"].shape[1])
    return ranks


def _locate(ours_of: dict[str, str]) -> list[tuple[re.Pattern, str]]:
    """(pattern of an HF path with its layer index as a group, our name in layer 0) for every
    layer-0 projection: an adapter's path for any layer number is placed by them."""
    out = []
    for hf, ours in ours_of.items():
        m = LAYER.match(ours)
        if m and m.group(1) == "0" and ".0." in f".{hf}.":
            dotted = f".{hf}"
            at = dotted.index(".0.")  # the first number in the HF path is the layer's
            pattern = re.escape(dotted[: at + 1]) + r"(\d+)" + re.escape(dotted[at + 2 :])
            out.append((re.compile(pattern), ours))
    return out


def _where(path: str, ours_of: dict[str, str], located) -> tuple[str, int | None] | None:
    """(our projection's name, its layer or None) of an adapter's HF module ``path``; None for a
    path no projection of the model's kind has (another architecture)."""
    if path in ours_of:
        ours = ours_of[path]
        m = LAYER.match(ours)
        return ours, int(m.group(1)) if m else None
    for pattern, ours in located:
        m = pattern.fullmatch(f".{path}")
        if m:
            return ours, int(m.group(1))
    return None


def other_base(model, ours_of: dict[str, str], modules: dict[str, dict[str, torch.Tensor]],
               wanted: set[str]) -> str | None:  # fmt: skip
    """'made for a model with dim 64 (this one: 32) and 2 layers (this one: 1)' when the
    adapter's tensors (``modules``: HF path -> lora_A / lora_B) were made for another model of
    the same family as ``model`` (``ours_of``: its HF paths -> our names; ``wanted``: the paths
    the config adapts, the model's or not); else None."""
    located = _locate(ours_of)
    sizes: dict[str, tuple[int, int]] = {}  # the config's size -> (there, here)
    deepest = -1
    for path, parts in sorted(modules.items()):
        where = _where(path, ours_of, located)
        if where is None or "lora_A" not in parts or "lora_B" not in parts:
            continue
        ours, layer = where
        deepest = max(deepest, -1 if layer is None else layer)
        here_name = LAYER.sub("layers.0.", ours)  # the same projection in layer 0
        base = model.get_submodule(here_name)
        base = getattr(base, "base", base)  # a LoRA layer already: its frozen projection
        there = (parts["lora_A"].shape[-1], parts["lora_B"].shape[0])
        here = (base.in_features, base.out_features)
        for name, a, b in zip(SIDES.get(ours.rsplit(".", 1)[-1], ("", "")), there, here,
                              strict=True):  # fmt: skip
            if a != b and name:
                sizes.setdefault(name, (a, b))
    n_layers = model.cfg.n_layers
    places = [_where(p, ours_of, located) for p in wanted]
    layers_wanted = {w[1] for w in places if w is not None and w[1] is not None}
    if deepest + 1 > n_layers or (deepest >= 0 and layers_wanted - set(range(deepest + 1))):
        sizes["layers"] = (deepest + 1, n_layers)
    if not sizes:
        return None
    said = [f"{name} {a} (this one: {b})" for name, (a, b) in sizes.items() if name != "layers"]
    if "layers" in sizes:
        a, b = sizes["layers"]
        said.append(f"{a} layer{'s' * (a != 1)} (this one: {b})")
    head = ", ".join(said[:-1])
    return "made for a model with " + (f"{head} and {said[-1]}" if head else said[-1])
