"""Which modules a PEFT LoRA config adapts, by peft's own rules (``check_target_module_exists``
in ``peft.tuners.tuners_utils``, peft 0.17 to 0.21). A module is named by its path in the HF
model, ``model.layers.0.self_attn.q_proj``:

    target_modules, a list     the path is an entry, or ends in "." + an entry ("q_proj")
    target_modules, a string   a regular expression the whole path matches; "all-linear" (any
                               case): every linear layer but the output head
    exclude_modules            a list or a regular expression, by the same rules: its matches
                               are taken back out

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


def target_problems(config: dict) -> list[str]:
    """What in ``config``'s target_modules / exclude_modules peft could not read, one line each."""
    problems = []
    if config.get("target_modules") is None:
        problems.append("target_modules is not set (give the modules the adapter adapts)")
    else:
        problems.append(_pattern_problem("target_modules", config["target_modules"]))
    if config.get("exclude_modules") not in (None, [], ""):
        problems.append(_pattern_problem("exclude_modules", config["exclude_modules"]))
    return [p for p in problems if p]


def _matches(rule, path: str) -> bool:
    """Whether ``path`` matches one target rule: a regular expression, or a list of names."""
    if isinstance(rule, str):
        return re.fullmatch(rule, path) is not None
    return path in rule or any(path.endswith(f".{name}") for name in rule)


def targeted(config: dict, paths: Iterable[str], head: str | None) -> set[str]:
    """The ``paths`` (HF module paths) ``config`` adapts; ``head``: the output head's path,
    which "all-linear" leaves out. ``config`` passed ``target_problems``."""
    rule, exclude = config["target_modules"], config.get("exclude_modules") or None
    if isinstance(rule, str) and rule.lower() == ALL_LINEAR:
        chosen = {p for p in paths if p != head}
    else:
        chosen = {p for p in paths if _matches(rule, p)}
    return {p for p in chosen if exclude is None or not _matches(exclude, p)}
