"""Which modules a PEFT LoRA config adapts, by peft's own rules (``check_target_module_exists``
in ``peft.tuners.tuners_utils``, peft 0.17 to 0.21). A module is named by its path in the HF
model, ``model.layers.0.self_attn.q_proj``:

    target_modules, a list     the path is an entry, or ends in "." + an entry ("q_proj")
    target_modules, a string   a regular expression the whole path matches; "all-linear" (any
                               case): every linear layer but the output head
    exclude_modules            a list or a regular expression, by the same rules: its matches
                               are taken back out
    layers_to_transform        with a list of names: a path matched by its end ("q_proj", not
                               the whole path) is kept only where its first number after a
                               layers_pattern name ("layers", "h"; any name if none) is one of
                               these layer indices (an int: that one)

peft reads the weights file only for the modules so chosen: a tensor of another module is left
out, whatever the file holds.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from llm_foundry.messages import shown

ALL_LINEAR = "all-linear"


def _pattern_problem(field: str, value) -> str | None:
    """Why ``value`` is not a target list or pattern peft reads (None: it is one)."""
    if isinstance(value, str):
        try:
            re.compile(value)
        except re.error as e:
            return f"{field}={shown(value)} is not a regular expression ({e})"
        return None
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return None
    return f"{field}={shown(value)} must be a list of module names or a regular expression"


def _layers_problem(config: dict) -> str | None:
    """Why layers_to_transform / layers_pattern are not what peft's LoraConfig takes (None: they
    are, or are not set)."""
    layers, pattern = config.get("layers_to_transform"), config.get("layers_pattern")
    if layers is None:
        return "layers_pattern is given without layers_to_transform" if pattern else None
    if isinstance(config.get("target_modules"), str):
        return "layers_to_transform is for a list of target_modules, not a regular expression"
    if isinstance(layers, bool) or not (isinstance(layers, int) or (
            isinstance(layers, list) and all(type(i) is int for i in layers))):  # fmt: skip
        return f"layers_to_transform={shown(layers)} must be a layer index or a list of them"
    if pattern is not None and not (isinstance(pattern, str) or (
            isinstance(pattern, list) and all(isinstance(x, str) for x in pattern))):  # fmt: skip
        return f"layers_pattern={shown(pattern)} must be a name or a list of names"
    return None


def target_problems(config: dict) -> list[str]:
    """What in ``config``'s target_modules / exclude_modules / layers_to_transform peft could not
    read, one line each."""
    problems = []
    if config.get("target_modules") is None:
        problems.append("target_modules is not set (give the modules the adapter adapts)")
    else:
        problems.append(_pattern_problem("target_modules", config["target_modules"]))
    if config.get("exclude_modules") not in (None, [], ""):
        problems.append(_pattern_problem("exclude_modules", config["exclude_modules"]))
    problems.append(_layers_problem(config))
    return [p for p in problems if p]


def layer_index(path: str, patterns) -> int | None:
    """The layer a module path is in: its first number after one of ``patterns`` (a name or
    names; any name where None or empty), as in ``model.layers.3.mlp.up_proj`` -> 3."""
    if not patterns:
        m = re.match(r".*?\.[^.]*\.(\d+)\.", path)
    else:
        for pattern in [patterns] if isinstance(patterns, str) else patterns:
            if m := re.match(rf"(?:^|.*?\.){pattern}\.(\d+)\.", path):
                break
    return int(m.group(1)) if m else None


def _in_layers(config: dict, path: str) -> bool:
    """Whether a path its end matched is in layers_to_transform (all layers where unset)."""
    layers = config.get("layers_to_transform")
    if layers is None or layers == []:
        return True
    at = layer_index(path, config.get("layers_pattern"))
    return at is not None and (at == layers if isinstance(layers, int) else at in layers)


def _matches(rule, path: str, config: dict | None = None) -> bool:
    """Whether ``path`` matches one target rule: a regular expression, or a list of names (a
    match by its end then in ``config``'s layers_to_transform, where given)."""
    if isinstance(rule, str):
        return re.fullmatch(rule, path) is not None
    if path in rule:
        return True
    ends = any(path.endswith(f".{name}") for name in rule)
    return ends and (config is None or _in_layers(config, path))


def targeted(config: dict, paths: Iterable[str], head: str | None) -> set[str]:
    """The ``paths`` (HF module paths) ``config`` adapts; ``head``: the output head's path,
    which "all-linear" leaves out. ``config`` passed ``target_problems``."""
    rule, exclude = config["target_modules"], config.get("exclude_modules") or None
    if isinstance(rule, str) and rule.lower() == ALL_LINEAR:
        chosen = {p for p in paths if p != head}
    else:
        chosen = {p for p in paths if _matches(rule, p, config)}
    return {p for p in chosen if exclude is None or not _matches(exclude, p)}
