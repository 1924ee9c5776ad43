"""Convert models between llm-foundry and Hugging Face ``transformers``, exactly or not at all.

Every HF setting is either mapped to the ``ModelConfig`` field that computes the same function,
or refused with a ``ConversionError`` naming the setting, its value and what is supported;
nothing is approximated silently.

    config_from_hf(hf_config) -> ModelConfig         config_to_hf(cfg) -> PretrainedConfig
    from_hf(model_or_dir) -> Transformer             to_hf(model, out_dir) -> out_dir

Each family is one module that registers a ``Family`` (``registry.register``): its config
mapping both ways, its weight-name table (HF name -> ours, ``{i}`` the layer index, ``{e}`` the
expert), the layouts it fuses and what it refuses. ``llama`` (LLaMA, Mistral, Qwen3), ``moe``
(Mixtral, Qwen3-MoE), ``gpt2``, ``bloom``, ``falcon``. The machinery they share: ``core``
(Family, Rule, checks, errors), ``registry``, ``rope``, ``weights`` (tensors renamed and
re-laid both ways), ``files`` (safetensors directories, never pickle; tokenizer files) and
``convert`` (the functions above). Training-time dropout is not carried over from HF.
"""

from llm_foundry.interop.hf.convert import config_from_hf, config_to_hf, from_hf, to_hf
from llm_foundry.interop.hf.core import ConversionError, Family, Rule, expand, fail, transformers
from llm_foundry.interop.hf.files import copy_tokenizer, name_special_tokens
from llm_foundry.interop.hf.registry import FAMILIES, choose_family, export_order, register

# isort: off
# the families register as they are imported, and export tries them in that order
from llm_foundry.interop.hf import llama, moe, bloom, falcon, gpt2  # noqa: E402, F401
# isort: on

__all__ = [
    "FAMILIES",
    "ConversionError",
    "Family",
    "Rule",
    "choose_family",
    "config_from_hf",
    "config_to_hf",
    "copy_tokenizer",
    "expand",
    "export_order",
    "fail",
    "from_hf",
    "name_special_tokens",
    "register",
    "to_hf",
    "transformers",
]
