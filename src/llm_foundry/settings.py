"""Model and training settings from every source, resolved in one place:

    preset  <  config files (their model: and train: sections)  <  overrides (model.FIELD=V)

Every command and every ablation variant goes through ``resolve``, which returns the configs and
the fields that were given explicitly, so a preset or a resumed run changes only where asked.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from llm_foundry.config import ConfigError, ModelConfig, load_yaml, suggest
from llm_foundry.messages import shown
from llm_foundry.presets import get_preset
from llm_foundry.train.config import TrainConfig

SECTIONS: dict[str, type] = {"model": ModelConfig, "train": TrainConfig}
# config files the package ships (recipes such as pretrain-124m-gpt2), named without a path
CONFIGS_DIR = Path(__file__).parent / "configs"


@dataclass
class Settings:
    """What ``resolve`` returns: the configs, and where they came from."""

    model: ModelConfig
    train: TrainConfig
    preset: str | None = None  # the preset the model started from (None: a base or defaults)
    given: dict[str, dict[str, Any]] = field(default_factory=dict)  # section -> fields set
    extra: dict[str, Any] = field(default_factory=dict)  # config files' other top-level keys


def field_names(section: str) -> list[str]:
    return [f.name for f in dataclasses.fields(SECTIONS[section])]


def split_target(key: str) -> tuple[str, str]:
    """'train.lr' -> ('train', 'lr'); 'norm' or 'model.norm' -> ('model', 'norm')."""
    section, _, name = key.rpartition(".")
    section = section or "model"
    if section not in SECTIONS:
        raise ValueError(f"{key!r}: prefix must be model. or train.; got {section!r}")
    known = field_names(section)
    if name not in known:
        raise ValueError(
            f"{key!r}: {section} has no field {name!r}{suggest(name, set(known))}; valid: "
            f"{', '.join(sorted(known))}"
        )
    return section, name


def scalar(text: str) -> Any:
    """'4' -> 4, '1e-3' -> 0.001 (YAML 1.1 would keep it a string), 'true' -> True,
    'null' -> None, else the string."""
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    try:
        return load_yaml(text)
    except yaml.YAMLError as e:  # '{', '[1,': refused in one line, not a parser's traceback
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ValueError(f"{shown(text)} is not a valid value ({problem})") from None


def parse_assignment(item: str) -> tuple[str, str, list]:
    """'field=a,b' -> (section, field, [a, b]) with YAML scalar typing (1e-3 -> float)."""
    key, eq, values = item.partition("=")
    if not eq or not values:
        raise ValueError(f"expected FIELD=VALUE[,VALUE...], got {shown(item)}")
    section, name = split_target(key.strip())
    try:
        return section, name, [scalar(v) for v in values.split(",")]
    except ValueError as e:
        raise ValueError(f"{key.strip()}: {e}") from None


def config_names() -> list[str]:
    """The config files the package ships, by the name ``--config`` takes."""
    return sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml"))


def config_path(name: str | Path) -> Path:
    """``name`` as a file: the path itself when it is one, else the shipped config of that name
    (a file the user has wins over a built-in name)."""
    path = Path(name)
    if path.is_file():
        return path
    if str(name) in config_names():
        return CONFIGS_DIR / f"{name}.yaml"
    if path.is_dir():
        raise FileNotFoundError(f"--config {name} is a directory: give a YAML/JSON settings file, "
                                f"or a built-in config ({', '.join(config_names())})")  # fmt: skip
    raise FileNotFoundError(
        f"--config {name}: no such file, nor a built-in config (built-in: "
        f"{', '.join(config_names())})"
    )


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A YAML/JSON settings file, or a shipped config by name: ``model:`` and ``train:``
    mappings plus top-level keys (such as ``out``); errors name the file, the key and what is
    valid."""
    path = config_path(path)
    try:
        conf = load_yaml(path.read_text())
    except (UnicodeDecodeError, yaml.YAMLError) as e:
        raise ValueError(f"{path} is not YAML/JSON text: {e}") from None
    if conf is None:
        return {}
    if not isinstance(conf, dict):
        raise ConfigError([f"{path} must hold a mapping (model:, train:, ...), got {shown(conf)}"],
                          "config file")  # fmt: skip
    for section in SECTIONS:
        value = conf.get(section)
        if value is not None and not isinstance(value, dict):
            raise ConfigError(
                [f"{path}: the {section} section must be a mapping of fields, got {shown(value)}"],
                "config file",
            )
        known = set(field_names(section))
        unknown = sorted(set(value or {}) - known)
        if unknown:
            raise ConfigError(
                [f"{path}: {section}.{k} is not a field{suggest(k, known)}" for k in unknown],
                "config file",
            )
    return conf


def _as_changes(overrides) -> dict[str, dict[str, Any]]:
    """Overrides as {section: {field: value}}, from a mapping of that shape or from
    (section, field, value) triples."""
    changes: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    if isinstance(overrides, Mapping):
        for section, fields in overrides.items():
            if fields is not None and not isinstance(fields, Mapping):
                raise ValueError(
                    f"{section} overrides must be a mapping of fields, got {shown(fields)}"
                )
            for name, value in (fields or {}).items():
                split_target(f"{section}.{name}")
                changes[section][name] = value
    else:
        for section, name, value in overrides:
            split_target(f"{section}.{name}")
            changes[section][name] = value
    return changes


def resolve(
    preset: str | None = None,
    files: Iterable[str | Path] = (),
    overrides: Mapping | Iterable[tuple[str, str, Any]] = (),
    base_model: ModelConfig | None = None,
    base_train: TrainConfig | None = None,
    default_preset: str | None = None,
) -> Settings:
    """Resolve the settings of one run.

    The model starts from ``preset`` (given here or as a config file's ``preset:``), else
    ``base_model`` (e.g. a resumed run's), else ``default_preset`` unless a config file describes
    a model (its fields left out keep ``ModelConfig``'s defaults, as ``params`` counts them, not
    the default preset's), else ``ModelConfig()``;
    training starts from ``base_train`` or ``TrainConfig()``. Then each config file's sections
    apply in order, then ``overrides``. Only the fields given change: ``n_kv_heads`` left out
    keeps a multi-head base multi-head when ``n_heads`` changes.
    """
    given: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    extra: dict[str, Any] = {}
    for file in files:
        conf = read_config_file(file)
        if conf.get("model"):  # the file is the model: nothing of the default preset leaks in
            default_preset = None
        for section in SECTIONS:
            given[section].update(conf.get(section) or {})
        extra.update({k: v for k, v in conf.items() if k not in SECTIONS})
    for section, fields in _as_changes(overrides).items():
        given[section].update(fields)
    file_preset = extra.pop("preset", None)  # --preset on the command line wins
    preset = preset or file_preset
    if preset:
        model_base = get_preset(preset)
    elif base_model is not None:
        model_base = base_model
    elif default_preset:
        preset, model_base = default_preset, get_preset(default_preset)
    else:
        model_base = ModelConfig()
    with _named("model"):
        model = model_base.replace(**given["model"])
    train_base = base_train or TrainConfig()
    with _named("train"):
        train = TrainConfig.from_dict({**train_base.to_dict(), **given["train"]})
    return Settings(model, train, preset, given, extra)


@contextmanager
def _named(section: str):
    """Problems that start with a field name get their section: 'model.n_layers=0 ...'."""
    try:
        yield
    except ConfigError as e:
        known = set(field_names(section))
        problems = [
            f"{section}.{p}" if (m := re.match(r"\w+", p)) and m[0] in known else p
            for p in e.problems
        ]
        raise ConfigError(problems, name=f"{section} settings") from None
