"""What a study is: its base, variants, grid, seeds and extras, read from YAML recipes."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from llm_foundry.config import ModelConfig, load_yaml
from llm_foundry.settings import parse_assignment, resolve
from llm_foundry.train.config import TrainConfig

RECIPES_DIR = Path(__file__).parent.parent / "recipes"


PROBES = ("init_grad_norms", "norm_speed")


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
    def from_dict(cls, d: dict) -> Study:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown study field(s) {unknown}; valid: {sorted(known)}")
        d = dict(d)
        d["variants"] = [
            v if isinstance(v, Variant) else Variant(**v) for v in d.get("variants", [])
        ]
        study = cls(**d)
        bad = [p for p in study.probes if p not in PROBES]
        if bad:
            raise ValueError(f"unknown probe(s) {bad}; valid: {', '.join(PROBES)}")
        if study.compare not in ("first", "previous"):
            raise ValueError(f"compare={study.compare!r}: valid values are 'first', 'previous'")
        if not isinstance(study.seeds, int) or study.seeds < 1:
            raise ValueError(f"seeds={study.seeds!r} must be a positive integer")
        t = study.target_loss
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0):
            raise ValueError(
                f"target_loss={t!r} must be a positive number (a validation loss) or null"
            )
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
    if not path.exists():
        raise FileNotFoundError(
            f"no recipe or study file {str(source)!r}; built-in recipes: {', '.join(recipe_names())}"
        )
    try:
        data = load_yaml(path.read_text())
    except (UnicodeDecodeError, yaml.YAMLError) as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        problem = getattr(e, "problem", None) or e
        raise ValueError(f"{path} is not a valid YAML study{at}: {problem}") from None
    return Study.from_dict(data or {})


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
        raise ValueError(f"variant names must be unique; got {names}")
    return out


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
