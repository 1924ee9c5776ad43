"""What every HF family is made of: the ``Family`` record, weight-name ``Rule``s, the checks a
config goes through both ways, and ``ConversionError``. No family lives here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llm_foundry.config import ModelConfig

try:
    import transformers
except ImportError as e:  # pragma: no cover - depends on the environment
    from llm_foundry.package import absent, missing_extra

    if not absent(e, "transformers"):
        raise  # installed but broken: its own error
    raise missing_extra("llm_foundry.interop.hf needs the transformers package", "hf") from e

# transformers 5 keeps rope_theta and the scaling in one ``rope_parameters`` dict
HF_V5 = int(transformers.__version__.split(".")[0]) >= 5


class ConversionError(ValueError):
    """A config or checkpoint cannot be converted exactly; the message says what and why."""

    def __init__(self, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = problems or [message]


def fail(problems: list[str], what: str) -> None:
    """Raise one ``ConversionError`` listing every problem, if there is any: one line for one."""
    if len(problems) == 1:
        raise ConversionError(f"{what}: {problems[0]}", problems)
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ConversionError(f"{what} ({len(problems)} problem(s)):\n{lines}", problems)


# ----------------------------------------------------------------------------------------------
# Weight names: HF tensor name (as in *ForCausalLM.state_dict()) -> ours


@dataclass(frozen=True)
class Rule:
    """How one HF tensor maps to ours: our tensors concatenated along ``dim`` (several for a
    fused q/k/v or gate/up projection), transposed first where HF stores a GPT-2 Conv1D weight
    as (in, out) instead of nn.Linear's (out, in). A name with ``{e}`` is one expert's slice
    ``expert`` of our stacked expert tensor."""

    ours: tuple[str, ...]
    conv1d: bool = False
    dim: int = 0
    expert: int | None = None
    # a fused q/k/v stored group by group (BLOOM: per head; Falcon: per key/value head): the
    # rows are G groups of [q, k, v] slices; "heads" or "kv_heads" names G, set per model
    groups: str | int | None = None


Table = dict[str, str | Rule]


def weight_bias(hf: str, ours: str) -> dict[str, str]:
    """Weight and bias of one module under the same suffixes."""
    return {f"{hf}.weight": f"{ours}.weight", f"{hf}.bias": f"{ours}.bias"}


def expand(weights: Table, cfg: ModelConfig) -> dict[str, Rule]:
    """The name table with ``{i}`` expanded for every layer and ``{e}`` for every expert: full
    HF name -> Rule."""
    out: dict[str, Rule] = {}
    for hf, ours in weights.items():
        rule = ours if isinstance(ours, Rule) else Rule((ours,))
        for i in range(cfg.n_layers) if "{i}" in hf else (0,):
            for e in range(cfg.n_experts) if "{e}" in hf else (None,):
                names = tuple(o.format(i=i) for o in rule.ours)
                groups = {"heads": cfg.n_heads, "kv_heads": cfg.kv_heads}.get(rule.groups)
                out[hf.format(i=i, e=e)] = Rule(names, rule.conv1d, rule.dim, e, groups)
    return out


# ----------------------------------------------------------------------------------------------
# Checks: HF settings read, our fields written


# (HF attribute, supported values, value when absent, why others cannot be represented)
Setting = tuple[str, tuple, Any, str]
# what a config must satisfy to be exported: (field, test, what is needed)
Need = tuple[str, Callable[[ModelConfig], bool], str]


def check_settings(c: Any, settings: list[Setting], problems: list[str]) -> None:
    for attr, allowed, absent, why in settings:
        value = getattr(c, attr, absent)
        if value not in allowed:
            problems.append(
                f"{attr}={value!r} is not supported ({why}); supported: "
                f"{', '.join(map(repr, allowed))}"
            )


def lookup(c: Any, attr: str, table: dict[str, Any], problems: list[str]) -> Any:
    """``table[c.attr]``, or a problem naming the value and the supported ones."""
    value = getattr(c, attr, None)
    if value not in table:
        problems.append(
            f"{attr}={value!r} is not supported for {c.model_type}; supported: "
            f"{', '.join(map(repr, table))}"
        )
        return next(iter(table.values()))
    return table[value]


def unmet(cfg: ModelConfig, needs: list[Need]) -> list[str]:
    return [
        f"{field}={getattr(cfg, field)!r} blocks export (needs {need})"
        for field, ok, need in needs
        if not ok(cfg)
    ]


SEQUENTIAL: list[Need] = [  # what every family but BLOOM (embed_norm) and Falcon (parallel) has
    ("parallel_block", lambda c: not c.parallel_block, "False (only Falcon has parallel blocks)"),
    ("embed_norm", lambda c: not c.embed_norm, "False (only BLOOM normalises the embeddings)"),
]
DENSE: Need = (
    "n_experts",
    lambda c: c.n_experts == 0,
    "0 (a dense MLP; Mixtral, Qwen3-MoE: experts)",
)


# ----------------------------------------------------------------------------------------------
# Families


@dataclass(frozen=True)
class Family:
    """One HF architecture: its classes, weight names and config translations."""

    model_type: str
    title: str  # as people write it, in messages
    config_class: str
    model_class: str
    pos_encoding: str  # our position scheme it exports: export tries only these families
    # the layout written on export (and read); a function of the config where it depends on it
    weights: Table | Callable[[ModelConfig], Table]
    ignored: tuple[str, ...]  # regexes of HF tensors skipped knowingly
    prefix: str  # base-model prefix, absent from some older checkpoints' tensor names
    from_hf: Callable[[Any, list[str]], dict[str, Any]]
    to_hf: Callable[[ModelConfig], dict[str, Any]]
    needs: list[Need]
    also_reads: Table = field(default_factory=dict)  # other layouts in the wild
    # tiny variants, HF config kwargs but vocab_size: what the parity tests build and compare
    examples: dict[str, dict[str, Any]] = field(default_factory=dict)

    def table(self, cfg: ModelConfig) -> Table:
        """The weight-name table written for ``cfg``."""
        return self.weights(cfg) if callable(self.weights) else self.weights
