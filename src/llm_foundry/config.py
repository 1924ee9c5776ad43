"""Model configuration: one dataclass holds every architecture knob.

Every variant that separates GPT-2 from LLaMA, Mistral, Qwen3, BLOOM and Falcon is one field here.
Validation runs in ``__post_init__`` and reports *every* problem at once. Presets are data: see
``llm_foundry.presets``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

# each component module owns its registry; the valid names come from there
from llm_foundry.messages import shown
from llm_foundry.models.attention import ATTENTION_IMPL_NAMES
from llm_foundry.models.block import NORM_POSITION_NAMES
from llm_foundry.models.mlp import MLP_NAMES, is_gated
from llm_foundry.models.moe import MOE_DISPATCH_NAMES
from llm_foundry.models.norm import NORM_NAMES
from llm_foundry.models.position import POSITION_NAMES, ROPE_SCALINGS

GELU_APPROX = ("none", "tanh")  # F.gelu's own two flavours

# the largest integer a size, step count or seed may be: torch and numpy hold them in 64 bits
INT_MAX = 2**63 - 1
INT_MAX_TEXT = "2**63 - 1"


class ConfigError(ValueError):
    """A configuration has one or more invalid fields; the message lists them all."""

    def __init__(self, problems: list[str], name: str = "ModelConfig"):
        self.problems = problems
        if len(problems) == 1:  # one problem, one line
            super().__init__(f"invalid {name} (1 problem): {problems[0]}")
            return
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"invalid {name} ({len(problems)} problem(s)):\n{lines}")


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads ``1e-3`` (no dot) as a string; read it as the number everyone means."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` that also reads ``1e-3`` and ``3E5`` as floats."""
    return yaml.load(text, Loader=_Loader)


def one_of(problems: list[str], name: str, value: Any, allowed: Iterable[str]) -> None:
    """Add a problem naming ``name``, its ``value`` and the ``allowed`` ones when it is not one."""
    if not isinstance(value, str) or value not in allowed:
        problems.append(f"{name}={shown(value)} is not one of {', '.join(allowed)}")


def is_int(value: Any) -> bool:
    """An int, not a bool (which Python counts as one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_count(value: Any, low: int) -> bool:
    """An int (not a bool) in [low, INT_MAX]."""
    return is_int(value) and low <= value <= INT_MAX


def count_problem(problems: list[str], name: str, value: Any, what: str, low: int = 1) -> None:
    """Add a problem naming ``name`` unless ``value`` is an int (not a bool) in [low, INT_MAX];
    ``what`` says what is valid (e.g. 'a positive integer')."""
    if is_count(value, low):
        return
    if isinstance(value, int) and not isinstance(value, bool) and value > INT_MAX:
        problems.append(f"{name}={shown(value)} is too large: at most {INT_MAX_TEXT}")
    else:
        problems.append(f"{name}={shown(value)} must be {what}")


def is_number(value: Any) -> bool:
    """A finite int or float (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return isinstance(value, int) or math.isfinite(value)  # an int is finite at any size


@dataclass
class ModelConfig:
    """Every architecture knob of a decoder-only Transformer, with defaults of a small LLaMA."""

    # --- sizes
    vocab_size: int = 32000  # number of token ids
    dim: int = 512  # residual stream width (d_model)
    n_layers: int = 8  # number of Transformer blocks
    n_heads: int = 8  # query heads
    n_kv_heads: int | None = None  # key/value heads: None/n_heads MHA, 1 < g < n_heads GQA, 1 MQA
    head_dim: int | None = None  # per-head width; default dim // n_heads (Qwen3 sets it)
    hidden_dim: int | None = None  # MLP width; default mlp_ratio*dim (x 2/3 for gated MLPs)
    mlp_ratio: float = 4.0  # MLP width multiplier when hidden_dim is not given
    multiple_of: int = 1  # round the derived hidden_dim up to a multiple of this (LLaMA: 256)
    max_seq_len: int = 2048  # context the model is built for (learned positions stop here)

    # --- positions
    pos_encoding: str = "rope"  # learned | sinusoidal | rope | alibi | none
    rope_theta: float = 10000.0  # RoPE base (Qwen3 uses 1e6 for long context)
    rope_scaling: str = "none"  # none | linear (position interpolation) | ntk (NTK-aware)
    rope_factor: float = 1.0  # context extension factor for rope_scaling

    # --- normalisation
    norm: str = "rmsnorm"  # layernorm | rmsnorm
    norm_position: str = "pre"  # pre (GPT-2, LLaMA) | post (original Transformer)
    norm_eps: float = 1e-5
    embed_norm: bool = False  # LayerNorm right after the token embedding (BLOOM)

    # --- blocks
    mlp: str = "swiglu"  # gelu | relu | swiglu | geglu
    gelu_approx: str = "none"  # GELU flavour: none (exact erf) | tanh (GPT-2, BLOOM)
    attn_bias: bool = False  # bias on q/k/v/o projections (GPT-2, BLOOM)
    mlp_bias: bool = False  # bias on MLP projections
    norm_bias: bool = True  # bias in LayerNorm (RMSNorm never has one)
    tie_embeddings: bool = False  # output head shares the token-embedding matrix
    parallel_block: bool = False  # attention and MLP read one normed input (GPT-J, Falcon)
    parallel_norms: int = 1  # parallel blocks: 1 norm shared (Falcon-7B), 2 separate (Falcon-40B)
    residual: bool = True  # skip connections; False only to study gradient flow without them
    qk_norm: bool = False  # RMSNorm on each query/key head before RoPE (Qwen3)
    sliding_window: int | None = None  # attend only to the last N positions (Mistral)
    attn_impl: str = "sdpa"  # sdpa (fused kernels) | manual (can return attention weights)

    # --- mixture of experts (n_experts > 0: every block's MLP becomes routed experts)
    n_experts: int = 0  # routed experts per block; 0 = a dense MLP (Mixtral 8, Qwen3-30B-A3B 128)
    experts_per_token: int = 2  # k experts each token runs (Mixtral 2, Qwen3-MoE 8)
    expert_hidden_dim: int | None = None  # one expert's MLP width; default the dense ffn_dim
    n_shared_experts: int = 0  # experts every token runs besides the routed ones (DeepSeek-MoE)
    moe_renormalize: bool = True  # rescale the k chosen probabilities to sum 1 (Mixtral: yes)
    router_jitter: float = 0.0  # multiplicative noise on the router input while training
    moe_aux_loss_coef: float = 0.01  # weight of the load-balancing loss (Switch Transformer)
    router_z_loss_coef: float = 0.0  # weight of the router z-loss (ST-MoE: 0.001)
    moe_dispatch: str = "grouped"  # grouped (tokens sorted by expert) | loop (the reference)

    # --- training-time
    dropout: float = 0.0
    init_std: float = 0.02

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ConfigError(problems)

    # --- derived sizes
    @property
    def kv_heads(self) -> int:
        """Key/value heads actually used: ``n_kv_heads``, or ``n_heads`` (MHA) when not given."""
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def head_size(self) -> int:
        """Per-head width actually used."""
        return self.head_dim if self.head_dim is not None else self.dim // self.n_heads

    @property
    def ffn_dim(self) -> int:
        """MLP hidden width actually used (LLaMA: int(2 * 4 * dim / 3) rounded up to multiple_of)."""
        if self.hidden_dim is not None:
            return self.hidden_dim
        hidden = int(self.mlp_ratio * self.dim)
        if is_gated(self.mlp):
            hidden = int(2 * hidden / 3)  # three matrices instead of two: keep parameters equal
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    @property
    def expert_ffn_dim(self) -> int:
        """One expert's MLP width: ``expert_hidden_dim``, else the dense ``ffn_dim``."""
        return self.expert_hidden_dim if self.expert_hidden_dim is not None else self.ffn_dim

    @property
    def gated(self) -> bool:
        return is_gated(self.mlp)

    def problems(self) -> list[str]:
        """Every problem with this config, each naming the field, the value and what is valid."""
        p: list[str] = []
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len", "multiple_of"):
            count_problem(p, name, getattr(self, name), "a positive integer")
        for name in ("n_kv_heads", "head_dim", "hidden_dim", "sliding_window", "expert_hidden_dim"):
            if getattr(self, name) is not None:
                count_problem(p, name, getattr(self, name), "a positive integer or null")
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type == "bool" and not isinstance(v, bool):
                p.append(f"{f.name}={shown(v)} must be true or false")
        one_of(p, "pos_encoding", self.pos_encoding, POSITION_NAMES)
        one_of(p, "rope_scaling", self.rope_scaling, ROPE_SCALINGS)
        one_of(p, "norm", self.norm, NORM_NAMES)
        one_of(p, "norm_position", self.norm_position, NORM_POSITION_NAMES)
        one_of(p, "mlp", self.mlp, MLP_NAMES)
        one_of(p, "gelu_approx", self.gelu_approx, GELU_APPROX)
        one_of(p, "attn_impl", self.attn_impl, ATTENTION_IMPL_NAMES)
        p += self._moe_problems()
        ints_ok = all(
            isinstance(getattr(self, n), int) and getattr(self, n) >= 1
            for n in ("dim", "n_heads", "kv_heads")
        )
        if ints_ok:
            if self.n_heads % self.kv_heads:
                p.append(
                    f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads} "
                    f"(valid n_kv_heads: {', '.join(str(d) for d in _divisors(self.n_heads))})"
                )
            if self.head_dim is None and self.dim % self.n_heads:
                p.append(
                    f"dim={self.dim} is not divisible by n_heads={self.n_heads}; "
                    "set head_dim explicitly or pick n_heads dividing dim"
                )
            elif self.pos_encoding == "rope" and self.head_size % 2:
                p.append(f"head_dim={self.head_size} must be even for pos_encoding='rope'")
            if self.pos_encoding == "sinusoidal" and self.dim % 2:
                p.append(f"dim={self.dim} must be even for pos_encoding='sinusoidal'")
        if self.rope_scaling != "none" and self.pos_encoding != "rope":
            p.append(
                f"rope_scaling={self.rope_scaling!r} needs pos_encoding='rope' "
                f"(got {self.pos_encoding!r})"
            )
        if not (is_number(self.rope_factor) and self.rope_factor >= 1.0):
            p.append(f"rope_factor={shown(self.rope_factor)} must be a number >= 1.0")
        if not (is_number(self.rope_theta) and self.rope_theta > 1.0):
            p.append(f"rope_theta={shown(self.rope_theta)} must be a number > 1")
        if not (is_number(self.norm_eps) and 0 < self.norm_eps < 1):
            p.append(f"norm_eps={shown(self.norm_eps)} must be in (0, 1)")
        if not (is_number(self.dropout) and 0.0 <= self.dropout < 1.0):
            p.append(f"dropout={shown(self.dropout)} must be in [0, 1)")
        if not (is_number(self.init_std) and self.init_std > 0):
            p.append(f"init_std={shown(self.init_std)} must be > 0")
        if not (is_number(self.mlp_ratio) and self.mlp_ratio > 0):
            p.append(f"mlp_ratio={shown(self.mlp_ratio)} must be > 0")
        if isinstance(self.parallel_norms, bool) or self.parallel_norms not in (1, 2):
            p.append(f"parallel_norms={shown(self.parallel_norms)} is not one of 1, 2")
        elif self.parallel_norms == 2 and not self.parallel_block:
            p.append(
                "parallel_norms=2 needs parallel_block=True (a norm each for attention and MLP)"
            )
        if self.parallel_block and self.norm_position == "post":
            p.append(
                "parallel_block=True needs norm_position='pre' "
                "(attention and MLP share one pre-norm input)"
            )
        if self.qk_norm and self.norm != "rmsnorm":
            p.append(
                f"qk_norm=True is implemented with RMSNorm; set norm='rmsnorm' (got {self.norm!r})"
            )
        return p

    def _moe_problems(self) -> list[str]:
        p: list[str] = []
        for name in ("n_experts", "n_shared_experts"):
            count_problem(p, name, getattr(self, name), "an integer >= 0 (0: none)", low=0)
        for name in ("moe_aux_loss_coef", "router_z_loss_coef"):
            v = getattr(self, name)
            if not is_number(v) or not v >= 0:
                p.append(f"{name}={shown(v)} must be a number >= 0")
        if not (is_number(self.router_jitter) and 0 <= self.router_jitter < 1):
            p.append(f"router_jitter={shown(self.router_jitter)} must be in [0, 1)")
        one_of(p, "moe_dispatch", self.moe_dispatch, MOE_DISPATCH_NAMES)
        k, n = self.experts_per_token, self.n_experts
        if not is_count(k, 1):
            count_problem(p, "experts_per_token", k, "a positive integer")
        elif isinstance(n, int) and n > 0 and k > n:
            p.append(f"experts_per_token={k} is more than n_experts={n}; valid: 1..{n}")
        return p

    # --- comparison
    # fields no weight depends on: weights saved under one value load under another (init_std
    # draws weights that loaded ones replace)
    WEIGHT_FREE = ("dropout", "attn_impl", "moe_dispatch", "moe_aux_loss_coef",
                   "router_z_loss_coef", "router_jitter", "init_std")  # fmt: skip

    def weight_differences(self, other: ModelConfig) -> list[str]:
        """'field: A there, B here' (there = ``other``) for every field on which the two configs
        would not compute the same function with the same weights; empty when ``other``'s
        weights fit this model (max_seq_len may differ unless positions are learned)."""
        from llm_foundry.models.position import position_traits

        sized = position_traits(self).trained_rows  # max_seq_len sizes a weight
        free = set(self.WEIGHT_FREE) | (set() if sized else {"max_seq_len"})
        there, here = other.to_dict(), self.to_dict()
        there["n_kv_heads"], here["n_kv_heads"] = other.kv_heads, self.kv_heads
        return [f"{k}: {v!r} there, {here[k]!r} here" for k, v in there.items()
                if here[k] != v and k not in free]  # fmt: skip

    # --- serialisation
    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a mapping; unknown keys are an error (a typo must not pass silently)."""
        return from_fields(cls, d)

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with ``changes`` (validated; unknown fields refused)."""
        return ModelConfig.from_dict({**self.to_dict(), **changes})

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def load(cls, path: str | Path) -> ModelConfig:
        """Read a .json, .yaml or .yml file (a top-level ``model:`` section is accepted)."""
        text = Path(path).read_text()
        d = json.loads(text) if str(path).endswith(".json") else load_yaml(text)
        if isinstance(d, dict) and isinstance(d.get("model"), dict):
            d = d["model"]
        if not isinstance(d, dict):
            raise ConfigError([f"{path} does not hold a mapping of config fields"])
        return cls.from_dict(d)

    def save(self, path: str | Path) -> None:
        text = self.to_json() if str(path).endswith(".json") else self.to_yaml()
        Path(path).write_text(text)


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]  # O(sqrt n): n may be huge
    return sorted(set(small + [n // d for d in small]))


def from_fields(cls: type, d: dict[str, Any]) -> Any:
    """``cls(**d)`` for a config dataclass, every key of ``d`` that is not one of its fields
    refused first, in one ConfigError naming each with the field it may have meant."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ConfigError(
            [f"unknown field {k!r}{suggest(k, known)}" for k in unknown], cls.__name__
        )
    return cls(**d)


# what nanoGPT, HF transformers / Trainer and litgpt call fields of ours (their name -> ours)
OTHER_NAMES = {
    "learning_rate": "lr", "min_learning_rate": "min_lr", "max_iters": "max_steps",
    "warmup_iters": "warmup_steps", "lr_decay_iters": "max_steps", "eval_iters": "eval_batches",
    "gradient_accumulation_steps": "grad_accum", "micro_batch_size": "batch_size",
    "per_device_train_batch_size": "batch_size", "max_grad_norm": "grad_clip",
    "adam_beta1": "beta1", "adam_beta2": "beta2", "lr_scheduler_type": "schedule",
    "n_embd": "dim", "hidden_size": "dim", "n_embed": "dim", "n_layer": "n_layers",
    "num_hidden_layers": "n_layers", "n_head": "n_heads", "num_attention_heads": "n_heads",
    "num_key_value_heads": "n_kv_heads", "n_query_groups": "n_kv_heads",
    "intermediate_size": "hidden_dim", "max_position_embeddings": "max_seq_len",
    "tie_word_embeddings": "tie_embeddings", "rms_norm_eps": "norm_eps",
    "layer_norm_epsilon": "norm_eps", "num_local_experts": "n_experts",
    "num_experts_per_tok": "experts_per_token",
}  # fmt: skip


def suggest(key: str, known: set[str]) -> str:
    """' (did you mean ...?)' for the field of ``known`` another project names ``key``, or the
    closest to a mistyped ``key``, else ''."""
    import difflib

    if OTHER_NAMES.get(key) in known:
        return f" (did you mean {OTHER_NAMES[key]!r}?)"
    close = difflib.get_close_matches(key, sorted(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
