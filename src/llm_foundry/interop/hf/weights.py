"""Weights both ways through a family's name table: HF tensors renamed, split (fused q/k/v,
gate/up, grouped rows, experts) and transposed (Conv1D) into our state dict, and back."""

from __future__ import annotations

import re
from typing import Any

import torch

from llm_foundry.checkpoint import meta_transformer
from llm_foundry.config import ModelConfig
from llm_foundry.interop.hf.core import Family, expand, fail, transformers


def _ungroup(t: torch.Tensor, sizes: list[int], groups: int) -> list[torch.Tensor]:
    """Rows stored as ``groups`` groups of [part 0, part 1, ...] slices (each part's rows split
    evenly over the groups) -> each part's rows in order. t: (sum(sizes), ...)."""
    per = [s // groups for s in sizes]
    g = t.reshape(groups, sum(per), *t.shape[1:])
    return [p.reshape(s, *t.shape[1:]) for p, s in zip(g.split(per, dim=1), sizes, strict=True)]


def _regroup(parts: list[torch.Tensor], groups: int) -> torch.Tensor:
    """The inverse of ``_ungroup``: parts (s_i, ...) -> rows in ``groups`` interleaved groups."""
    rest = parts[0].shape[1:]
    g = torch.cat([p.reshape(groups, -1, *rest) for p in parts], dim=1)
    return g.reshape(-1, *rest)


def hf_to_ours(
    hf_tensors: dict[str, torch.Tensor], cfg: ModelConfig, family: Family, shapes: dict
) -> dict[str, torch.Tensor]:
    """Rename and re-lay HF tensors into our state dict (``shapes``: our name -> shape).
    Strict: every one of our tensors filled, every HF tensor used or knowingly ignored."""
    rules = expand({**family.also_reads, **family.table(cfg)}, cfg)
    ours: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}  # stacked tensor -> its experts' slices
    unexpected: list[str] = []
    problems: list[str] = []
    for name, tensor in hf_tensors.items():
        key = name if name in rules else family.prefix + name
        if key not in rules or not all(n in shapes for n in rules[key].ours):
            if not any(re.search(p, name) for p in family.ignored):
                unexpected.append(name)
            continue
        rule = rules[key]
        t = tensor.t() if rule.conv1d else tensor
        want = [shapes[n] if rule.expert is None else shapes[n][1:] for n in rule.ours]
        d = rule.dim
        fused = (*want[0][:d], sum(s[d] for s in want), *want[0][d + 1 :])
        if tuple(t.shape) != fused:
            problems.append(f"{name}: shape {tuple(tensor.shape)} does not fit {rule.ours} {want}")
            continue
        sizes = [s[d] for s in want]
        parts = _ungroup(t, sizes, rule.groups) if rule.groups else t.split(sizes, dim=d)
        for n, part in zip(rule.ours, parts, strict=True):
            if rule.expert is None:
                ours[n] = part.contiguous()
            else:
                experts.setdefault(n, {})[rule.expert] = part
    for n, parts in experts.items():
        absent = sorted(set(range(cfg.n_experts)) - set(parts))
        if absent:
            problems.append(f"{n}: no HF tensor for expert(s) {absent} of {cfg.n_experts}")
        else:
            ours[n] = torch.stack([parts[e] for e in range(cfg.n_experts)]).contiguous()
    if cfg.tie_embeddings:  # one tensor; a head stored without an embedding is both (as in HF)
        shared = ours.get("tok_emb.weight", ours.get("lm_head.weight"))
        if shared is not None:
            ours["tok_emb.weight"] = ours["lm_head.weight"] = shared
    missing = sorted(set(shapes) - set(ours))
    if missing:
        problems.append(f"no HF tensor for our {missing}")
    if unexpected:
        problems.append(f"HF tensors with no place in the model: {sorted(unexpected)}")
    fail(problems, f"cannot load {family.model_class} weights")
    return ours


def _stored(hf_tensors: dict[str, torch.Tensor], family: Family, name: str) -> torch.Tensor | None:
    """The HF tensor stored under ``name`` (with or without the family's base-model prefix)."""
    bare = name.removeprefix(family.prefix)
    return hf_tensors.get(name, hf_tensors.get(bare, hf_tensors.get(family.prefix + bare)))


def untie_stored_head(
    hf_tensors: dict[str, torch.Tensor], cfg: ModelConfig, family: Family
) -> tuple[ModelConfig, bool]:
    """``cfg`` untied when its config ties the head to the embedding but the checkpoint stores
    a head with other values: transformers 5 then loads both as stored, untied
    (``PreTrainedModel.tie_weights`` during ``from_pretrained``). Returns (cfg, whether it was
    untied)."""
    if not cfg.tie_embeddings:
        return cfg, False
    names = {rule.ours: hf for hf, rule in expand(family.table(cfg), cfg).items()}
    emb = _stored(hf_tensors, family, names.get(("tok_emb.weight",), ""))
    head = _stored(hf_tensors, family, names.get(("lm_head.weight",), ""))
    if emb is None or head is None or emb.is_meta or torch.equal(emb, head):
        return cfg, False
    return cfg.replace(tie_embeddings=False), True


def ours_to_hf(
    state: dict[str, torch.Tensor], cfg: ModelConfig, family: Family
) -> dict[str, torch.Tensor]:
    """Our state dict as HF tensors (CPU, contiguous); a tied head is stored once, as HF does."""
    rules = expand(family.table(cfg), cfg)
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    if cfg.tie_embeddings:
        used.add("lm_head.weight")
        rules.pop("lm_head.weight")
    for key, rule in rules.items():
        if not all(n in state for n in rule.ours):
            continue
        parts = [state[n].detach() for n in rule.ours]
        if rule.expert is not None:
            parts = [p[rule.expert] for p in parts]
        t = _regroup(parts, rule.groups) if rule.groups else torch.cat(parts, dim=rule.dim)
        out[key] = (t.t() if rule.conv1d else t).to("cpu").contiguous()
        used.update(rule.ours)
    left = sorted(set(state) - used)
    fail([f"no {family.model_class} tensor for our {left}"] if left else [], "cannot export")
    return out


def check_against_hf(
    tensors: dict[str, torch.Tensor], hf_config: Any, family: Family, cfg: ModelConfig
) -> None:
    """Compare names and shapes with those of the HF model built on the meta device (no memory):
    what ``from_pretrained`` will expect."""
    with torch.device("meta"):
        reference = getattr(transformers, family.model_class)(hf_config)
    if family.also_reads:  # its experts live fused in memory, per expert on disk: both must
        # map onto every one of our tensors and leave nothing over
        ours = {k: tuple(v.shape) for k, v in meta_transformer(cfg).state_dict().items()}
        for what in (reference.state_dict(), tensors):
            hf_to_ours({k: v.to("meta") for k, v in what.items()}, cfg, family, ours)
        return
    expected = {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    if getattr(hf_config, "tie_word_embeddings", False):
        expected.pop("lm_head.weight", None)
    got = {k: tuple(v.shape) for k, v in tensors.items()}
    problems = [f"missing {k} {s}" for k, s in sorted(expected.items()) if k not in got]
    problems += [f"unexpected {k}" for k in sorted(set(got) - set(expected))]
    problems += [
        f"{k}: shape {got[k]}, {family.model_class} expects {s}"
        for k, s in sorted(expected.items())
        if k in got and got[k] != s
    ]
    fail(problems, f"exported tensors do not match {family.model_class}")
