"""What a study is: its base, variants, grid, seeds and extras, read from YAML recipes."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from llm_foundry.config import ConfigError, ModelConfig, is_count, is_number, load_yaml
from llm_foundry.messages import shown
from llm_foundry.presets import preset_names
from llm_foundry.settings import parse_assignment, resolve, scalar, split_target
from llm_foundry.train.config import SEED_MAX, TrainConfig

RECIPES_DIR = Path(__file__).parent.parent / "recipes"


PROBES = ("init_grad_norms", "norm_speed")

# fields whose one value is itself a comma list (train's --train.lora_targets wq,wv): a --set
# keeps its commas, and a --vary axis over one separates its values with LIST_AXIS_SEPARATOR
LIST_FIELDS = {("train", "lora_targets")}
LIST_AXIS_SEPARATOR = "/"


@dataclass
class Variant:
    name: str
    model: dict = field(default_factory=dict)  # overrides of the base model config
    train: dict = field(default_factory=dict)  # overrides of the base train config
    preset: str | None = None  # this variant's base preset (default: the study's)


@dataclass
class Study:
    """What to train and compare; a recipe is a YAML file of these fields."""

    name: str = "ablation"
    description: str = ""
    claim: str = ""  # the claim under test, as the design documents state it
    preset: str | None = "llama-shakespeare-char"
    model: dict = field(default_factory=dict)
    train: dict = field(default_factory=dict)
    variants: list[Variant] = field(default_factory=list)
    vary: dict[str, list] = field(default_factory=dict)  # grid: field -> values
    seeds: int = 1
    extrapolation: list[float] = field(default_factory=list)  # eval contexts, x block_size
    eval_tokens: int = 32768  # validation tokens scored per extrapolation context
    probes: list[str] = field(default_factory=list)
    speed_rounds: int = 5  # interleaved timing rounds of every variant's training step
    compare: str = "first"  # verdicts against the first variant, or "previous" (one change a step)
    # a validation loss to reach: the report gives each run's first evaluation at or below it
    # (step, tokens, training seconds); None leaves that table out
    target_loss: float | None = None

    @classmethod
    def from_dict(cls, d: Mapping) -> Study:
        """A validated study: every field's type and range, each variant's settings (with the
        first and the last seed) and the run directories its names become, all checked before
        anything trains. Problems are one line (ValueError), each naming its field."""
        problems = _problems(d)
        if problems:
            raise ValueError("; ".join(problems))
        d = dict(d)
        for key in ("description", "claim"):
            d[key] = d.get(key) or ""
        for key in ("model", "train", "vary"):
            d[key] = dict(d.get(key) or {})
        d["variants"] = [
            v if isinstance(v, Variant) else Variant(**{**v, "model": dict(v.get("model") or {}),
                                                        "train": dict(v.get("train") or {})})
            for v in d.get("variants") or []
        ]  # fmt: skip
        study = cls(**d)
        problems = _variant_problems(study)
        if problems:
            raise ValueError("; ".join(problems))
        return study

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def recipe_names() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def load_study(source: str | Path) -> Study:
    """A built-in recipe by name, or a YAML/JSON study file."""
    path = RECIPES_DIR / f"{source}.yaml"
    if not path.exists():
        path = Path(source)
    if not path.is_file():
        what = "a directory, not a study file" if path.is_dir() else "no such file"
        raise FileNotFoundError(
            f"--recipe {source}: {what}, nor a built-in recipe (YAML study files; built-in: "
            f"{', '.join(recipe_names())})"
        )
    try:
        data = load_yaml(path.read_text())
    except (UnicodeDecodeError, yaml.YAMLError) as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        problem = getattr(e, "problem", None) or e
        raise ValueError(f"{path} is not a valid YAML study{at}: {problem}") from None
    try:
        return Study.from_dict({} if data is None else data)
    except ValueError as e:  # the file, then each problem with its key
        raise ValueError(f"{path}: {e}") from None


def parse_override(item: str, axis: bool = False) -> tuple[str, str, list]:
    """A --set 'FIELD=V' (``axis`` False) or a --vary 'FIELD=V1,V2' (True) as (section, field,
    values), each typed as ``settings.scalar`` types a field flag. Values are split at commas,
    except those of a field in LIST_FIELDS, whose one value holds commas: --set takes the whole
    text, --vary splits it at '/' ('train.lora_targets=wq,wv/w1,w2,w3': two values). An empty
    value ('a,', 'wq/'), which YAML would read as null, is refused: a null is written 'null'."""
    section, name, values = parse_assignment(item)  # the field checked, commas split
    key, text = item.partition("=")[0].strip(), item.partition("=")[2]
    listed = (section, name) in LIST_FIELDS
    separator = LIST_AXIS_SEPARATOR if listed else ","
    parts = text.split(separator) if axis or not listed else [text]
    if any(not p.strip() for p in parts):
        raise ValueError(
            f"{key}: {shown(text)} holds an empty value (values are separated by "
            f"'{separator}'; write null for none)"
        )
    if not listed:
        return section, name, values
    try:
        return section, name, [scalar(v) for v in parts]
    except ValueError as e:
        raise ValueError(f"{key}: {e}") from None


def expand(study: Study) -> list[Variant]:
    """The study's variants times its ``vary`` grid (every combination), uniquely named."""
    base = study.variants or [Variant(name="")]
    axes = [(parse_assignment(f"{k}=x")[:2], list(v)) for k, v in study.vary.items()]
    out = []
    for v in base:
        for combo in itertools.product(*[vals for _, vals in axes]) if axes else [()]:
            model, train, parts = dict(v.model), dict(v.train), [v.name] if v.name else []
            for ((section, name), _), value in zip(axes, combo, strict=True):
                (model if section == "model" else train)[name] = value
                parts.append(f"{name}={value}")
            out.append(Variant(",".join(parts) or "base", model, train, v.preset))
    names = [v.name for v in out]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"variant names must be unique; {shown(twice)} appear more than once")
    dirs: dict[str, str] = {}
    for name in names:  # names that differ only where a directory name cannot
        other = dirs.setdefault(run_dir_name(name), name)
        if other != name:
            raise ValueError(
                f"variants {shown(other)} and {shown(name)} would train in one directory "
                f"(runs/{run_dir_name(name)}): rename one"
            )
    return out


def run_dir_name(name: str) -> str:
    """The directory under ``OUT/runs`` a variant trains in: its name with every character
    other than letters, digits and - _ . = replaced by _, at most 120 characters. Never '.' or
    '..' (a user's name may not be one; a grid's names hold '=')."""
    slug = "".join(c if c.isalnum() or c in "-_.=" else "_" for c in name)[:120] or "base"
    return slug if slug.strip(".") else slug.replace(".", "_")


def configs(study: Study, variant: Variant, seed_index: int) -> tuple[ModelConfig, TrainConfig]:
    """The configs of ``variant``'s run with seed index ``seed_index``: the study's preset,
    then the study's overrides, then the variant's; seed i trains with ``train.seed + i``."""
    s = resolve(
        preset=variant.preset or study.preset,
        overrides={
            "model": {**study.model, **variant.model},
            "train": {**study.train, **variant.train},
        },
    )
    return s.model, dataclasses.replace(s.train, seed=s.train.seed + seed_index)


VARIANT_KEYS = ("name", "model", "train", "preset")
NAME_RULE = "a name without / or \\ or control characters, not '.' or '..'"


def path_name_problem(key: str, value: Any) -> str | None:
    """Why ``value`` cannot be a name that becomes a directory (None: it can): it must stay
    one directory below where it is put, whatever the operating system."""
    if not isinstance(value, str) or not value.strip():
        return f"{key}={shown(value)} must be {NAME_RULE}"
    if value.strip() in (".", "..") or any(
        c in "/\\" or ord(c) < 32 or ord(c) == 127 for c in value
    ):
        return f"{key}={shown(value)} would be a path, not a name: it must be {NAME_RULE}"
    return None


def _preset_problem(key: str, value: Any) -> str | None:
    if value is None or (isinstance(value, str) and value in preset_names()):
        return None
    return f"{key}={shown(value)} is not a preset; valid: {', '.join(preset_names())} or null"


def _overrides_problems(key: str, value: Any) -> list[str]:
    """A model:/train: section: a mapping of that section's fields (or null)."""
    if value is None:
        return []
    if not isinstance(value, Mapping):
        return [f"{key}={shown(value)} must be a mapping of {key.rsplit('.', 1)[-1]} fields"]
    section = key.rsplit(".", 1)[-1]
    out = []
    for name in value:
        try:
            split_target(f"{section}.{name}")
        except ValueError as e:
            out.append(f"{key}: {e}")
    return out


def _problems(d: Any) -> list[str]:
    """Problems with the study's own fields (its variants' settings are checked once built)."""
    if not isinstance(d, Mapping):
        return [f"a study must be a mapping of fields, got {shown(d)}"]
    known = [f.name for f in dataclasses.fields(Study)]
    unknown = sorted(str(k) for k in d if k not in known)
    if unknown:
        return [f"unknown study field(s) {shown(unknown)}; valid: {', '.join(known)}"]
    p: list[str] = []

    def check(ok: bool, key: str, valid: str) -> None:
        if not ok:
            p.append(f"{key}={shown(d[key])} must be {valid}")

    if "name" in d and (why := path_name_problem("name", d["name"])):
        p.append(why)
    for key in ("description", "claim"):
        if key in d:
            check(d[key] is None or isinstance(d[key], str), key, "text")
    if "preset" in d and (why := _preset_problem("preset", d["preset"])):
        p.append(why)
    for key in ("model", "train"):
        p += _overrides_problems(key, d.get(key))
    p += _variants_problems(d.get("variants"))
    vary = d.get("vary")
    if vary is not None and not isinstance(vary, Mapping):
        p.append(f"vary={shown(vary)} must be a mapping of field -> list of values")
    for k, values in vary.items() if isinstance(vary, Mapping) else ():
        try:
            split_target(str(k))
        except ValueError as e:
            p.append(f"vary: {e}")
        if not isinstance(values, list) or not values:
            p.append(f"vary.{k}={shown(values)} must be a non-empty list of values")
        elif any(isinstance(v, (Mapping, list)) for v in values):
            p.append(f"vary.{k}={shown(values)} must list plain values (numbers, text, true/false)")
    if "seeds" in d:
        check(is_count(d["seeds"], 1), "seeds", "a positive integer")
    if "extrapolation" in d:
        f = d["extrapolation"]
        check(isinstance(f, list) and all(is_number(x) and x > 0 for x in f), "extrapolation",
              "a list of positive numbers (evaluation contexts as multiples of block_size)")  # fmt: skip
    if "eval_tokens" in d:
        check(is_count(d["eval_tokens"], 1), "eval_tokens", "a positive integer")
    if "probes" in d:
        probes = d["probes"]
        if not isinstance(probes, list):
            p.append(f"probes={shown(probes)} must be a list of {', '.join(PROBES)}")
        elif bad := [x for x in probes if not (isinstance(x, str) and x in PROBES)]:
            p.append(f"unknown probe(s) {shown(bad)}; valid: {', '.join(PROBES)}")
    if "speed_rounds" in d:
        check(is_count(d["speed_rounds"], 0), "speed_rounds", "an integer >= 0 (0: no timing)")
    if "compare" in d and d["compare"] not in ("first", "previous"):
        p.append(f"compare={shown(d['compare'])}: valid values are 'first', 'previous'")
    if "target_loss" in d:
        t = d["target_loss"]
        check(t is None or (is_number(t) and t > 0), "target_loss",
              "a positive number (a validation loss) or null")  # fmt: skip
    return p


def _variants_problems(variants: Any) -> list[str]:
    if variants is None:
        return []
    if not isinstance(variants, list):
        return [f"variants={shown(variants)} must be a list of variants (name:, model:, train:)"]
    p = []
    for i, v in enumerate(variants):
        key = f"variants[{i}]"
        if isinstance(v, Variant):
            v = dataclasses.asdict(v)
        if not isinstance(v, Mapping):
            p.append(f"{key}={shown(v)} must be a mapping with name: and model:/train: overrides")
            continue
        unknown = sorted(str(k) for k in v if k not in VARIANT_KEYS)
        if unknown:
            p.append(f"{key}: unknown key(s) {shown(unknown)}; valid: {', '.join(VARIANT_KEYS)}")
        if "name" not in v:
            p.append(f"{key} has no name:")
        elif why := path_name_problem(f"{key}.name", v["name"]):
            p.append(why)
        for section in ("model", "train"):
            p += _overrides_problems(f"{key}.{section}", v.get(section))
        if why := _preset_problem(f"{key}.preset", v.get("preset")):
            p.append(why)
    return p


def _variant_problems(study: Study) -> list[str]:
    """Each variant's settings and seeds (names and directories: ``expand``)."""
    try:
        variants = expand(study)
    except ValueError as e:
        return [str(e)]
    p = []
    for v in variants:
        try:
            tc = configs(study, v, 0)[1]
        except ConfigError as e:
            p.append(f"variant {shown(v.name)}: {'; '.join(e.problems)}")
            continue
        last = tc.seed + study.seeds - 1  # seed i trains with train.seed + i
        if last > SEED_MAX:
            p.append(f"variant {shown(v.name)}: train.seed={tc.seed} with seeds={study.seeds} "
                     f"reaches seed {last}, past the largest, 2**62")  # fmt: skip
        small = [f for f in study.extrapolation if round(f * tc.block_size) < 1]
        if small:
            p.append(f"variant {shown(v.name)}: extrapolation factor(s) {shown(small)} x "
                     f"block_size {tc.block_size} is a context under one token")  # fmt: skip
    return p
