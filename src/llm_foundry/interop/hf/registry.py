"""The HF families, keyed by ``model_type``: a family module calls ``register`` once. Reading
picks the family by the HF config's ``model_type``; export tries the families of the config's
position scheme in the order they registered and takes the first that represents it exactly."""

from __future__ import annotations

from typing import Any

from llm_foundry.config import ModelConfig
from llm_foundry.interop.hf.core import ConversionError, Family, Need, fail, unmet

FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add ``family`` under its ``model_type``; a name registered twice is a mistake."""
    if family.model_type in FAMILIES:
        raise ValueError(f"HF family {family.model_type!r} is registered already")
    FAMILIES[family.model_type] = family
    return family


def export_order(pos_encoding: str) -> list[str]:
    """The families export tries for a config with this position scheme, in order."""
    return [name for name, f in FAMILIES.items() if f.pos_encoding == pos_encoding]


def _positions() -> str:
    """Each exportable position scheme with its families' titles, for the refusal."""
    titles: dict[str, list[str]] = {}
    for f in FAMILIES.values():
        titles.setdefault(f.pos_encoding, []).append(f.title)
    shown = [f"{pos!r} ({', '.join(t)})" for pos, t in titles.items()]
    return " or ".join([", ".join(shown[:-1]), shown[-1]] if len(shown) > 1 else shown)


def common_needs() -> list[Need]:
    """What no registered family has."""
    return [
        ("norm_position", lambda c: c.norm_position == "pre", "'pre': every family is pre-norm"),
        ("residual", lambda c: c.residual, "True: every family has residual connections"),
        ("pos_encoding", lambda c: bool(export_order(c.pos_encoding)), _positions()),
    ]


def family_of(hf_config: Any) -> Family:
    """The family of an HF config, by its ``model_type``."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in FAMILIES:
        raise ConversionError(
            f"model_type={model_type!r} is not supported; supported: {', '.join(FAMILIES)}"
        )
    return FAMILIES[model_type]


def _fitting(cfg: ModelConfig) -> list[str]:
    """The families that represent ``cfg`` exactly, in export order."""
    return [n for n in export_order(cfg.pos_encoding) if not unmet(cfg, FAMILIES[n].needs)]


def choose_family(cfg: ModelConfig, family: str | None = None) -> Family:
    """The HF family that represents ``cfg`` exactly (``family`` forces one, by model_type);
    ``ConversionError`` naming each field that blocks export (and, for a family asked for,
    the families that can)."""
    fail(unmet(cfg, common_needs()), "cannot export to Hugging Face")
    if family is not None and family not in FAMILIES:
        raise ConversionError(f"family={family!r} is not one of {', '.join(FAMILIES)}")
    if family is not None:
        _refuse_asked(cfg, family)
        return FAMILIES[family]
    problems: list[str] = []
    for name in export_order(cfg.pos_encoding):
        blocked = unmet(cfg, FAMILIES[name].needs)
        if not blocked:
            return FAMILIES[name]
        problems += [f"{name}: {u}" for u in blocked]
    fail(problems, "cannot export to Hugging Face: no family represents this config exactly")
    raise AssertionError("unreachable")


def _refuse_asked(cfg: ModelConfig, family: str) -> None:
    """Raise, if the family asked for cannot represent ``cfg``: why, and which families can."""
    blocked = unmet(cfg, FAMILIES[family].needs)
    if not blocked:
        return
    can = _fitting(cfg)
    others = (f"{', '.join(can)} can represent this config exactly" if can
              else "no other family can represent this config exactly either")  # fmt: skip
    what = f"cannot export to Hugging Face as {family}"
    if len(blocked) == 1:
        raise ConversionError(f"{what}: {blocked[0]}; {others}", blocked)
    lines = "\n".join(f"  - {b}" for b in blocked)
    raise ConversionError(f"{what} ({len(blocked)} problems; {others}):\n{lines}", blocked)
