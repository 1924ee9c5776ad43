"""Export models to GGUF, llama.cpp's one-file format, so that llama.cpp computes what we compute.

    export_gguf(model, tokenizer, out_path, outtype="f32", chat_template=None, name=None,
                token_ids=None) -> Path
    (``llm_foundry.export.convert_to_gguf``: any checkpoint kind, for ``convert --to-gguf``)

The HF family ``interop.hf.choose_family`` finds for a config decides llama.cpp's architecture:

    llama     -> "llama"     q/k rows re-ordered per head: llama.cpp's llama rotates adjacent pairs
    mistral   -> "llama"     only without a window shorter than max_seq_len (llama.cpp's has none)
    qwen3     -> "qwen3"     QK-norm; llama.cpp runs NeoX RoPE for it (rotate-half, as ours)
    gpt2      -> "gpt2"      q/k/v fused into attn_qkv; llama.cpp's GELU is the tanh one
    mixtral   -> "llama"     experts stacked in ffn_*_exps, router in ffn_gate_inp
    qwen3_moe -> "qwen3moe"  only with the top k renormalised (llama.cpp always does)

Every other family or setting is refused with an error naming the field, its value and what is
supported. Tokenizers: all become byte-level BPE ("gpt2") vocabularies. Our character tokenizer:
one token per character and merges joining the bytes of each character alone, so llama.cpp reads
one id per character; a character outside the vocabulary, which ``encode`` refuses, llama.cpp
drops (``char_vocab`` says why that and not an unk id). Our byte-level BPE and HF ByteLevel BPE
``tokenizer.json`` files: the same tokens and merges with llama.cpp's "gpt-2" pre-tokenizer (the
same regex); other HF tokenizers (SentencePiece ones, byte-level ones with a split regex of their
own: Llama 3's, Qwen's) are refused, naming llama.cpp's own converter as the way.

Outtypes f32, f16, bf16, q8_0, q4_0 apply to 2-D and 3-D tensors; 1-D ones (norms, biases),
routers and GPT-2's position table stay f32 (as llama.cpp's converter keeps them), and a q8_0/q4_0
tensor whose rows are not whole 32-value blocks falls back to f16 (logged).

Known differences, all llama.cpp's: a vocabulary always has a BOS and an EOS id there, so one
without (the character tokenizer) names its last token, after which llama.cpp stops generating
(named none, llama.cpp would take id 11, a common character); a chat template whose turn ends
in text (the built-in template's newline) has no token llama.cpp's chat stops at, so its chat
runs past a turn's end unless given that text as a stop string (``convert_to_gguf`` says so; an
end of turn that is a special token other than eos is written as the eot id, where llama.cpp
stops); for "gpt-2" vocabularies its whole-text detokenize drops the space before , . ! ? 's
(token pieces, as streamed, are exact); characters outside a character vocabulary are dropped,
not refused.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llm_foundry.checkpoint import unwrap
from llm_foundry.config import ModelConfig
from llm_foundry.outputs import new_file

try:
    import gguf
except ImportError as e:  # pragma: no cover - depends on the environment
    from llm_foundry.package import absent, missing_extra

    if not absent(e, "gguf"):
        raise  # installed but broken: its own error
    raise missing_extra("llm_foundry.interop.gguf needs the gguf package", "gguf") from e

log = logging.getLogger(__name__)
Q = gguf.GGMLQuantizationType


class GGUFError(ValueError):
    """A model, tokenizer or setting has no exact GGUF counterpart; the message says which."""


# ----------------------------------------------------------------------------------------------
# Outtypes: name -> (tensor type of matrices and stacked experts, general.file_type)

OUTTYPES: dict[str, tuple[Any, Any]] = {
    "f32": (Q.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (Q.F16, gguf.LlamaFileType.MOSTLY_F16),
    "bf16": (Q.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "q8_0": (Q.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "q4_0": (Q.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
}
QUANTIZED = {Q.Q8_0, Q.Q4_0}  # block formats: rows must be whole blocks
# 2-D tensors kept in f32 at any outtype, as llama.cpp's converter keeps them: small, and a
# router's rounding would change which experts run
ALWAYS_F32 = ("ffn_gate_inp", "position_embd")


def gguf_types(outtype: str) -> tuple[Any, Any]:
    """(tensor type, file type) of an outtype name; an unknown one is refused naming the valid."""
    if outtype not in OUTTYPES:
        raise GGUFError(f"outtype={outtype!r} is not supported; supported: {', '.join(OUTTYPES)}")
    return OUTTYPES[outtype]


def encode_tensor(name: str, data: np.ndarray, qtype: Any) -> tuple[np.ndarray, Any]:
    """(the bytes or values GGUF stores, their type) of float32 tensor ``name``: 1-D tensors and
    ALWAYS_F32 in f32, others in ``qtype``, or f16 where a row (the last axis) is not a whole
    number of blocks."""
    if data.ndim == 1 or any(k in name for k in ALWAYS_F32):
        return data, Q.F32
    if qtype in QUANTIZED and data.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        qtype = Q.F16
    return gguf.quants.quantize(data, qtype), qtype


# ----------------------------------------------------------------------------------------------
# RoPE layout


def interleave_rope_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q or k projection, weight (heads * hd, in) or bias (heads * hd,), from our
    rotate-half order (feature i pairs with i + hd/2) to the adjacent-pair order llama.cpp's
    "llama" arch rotates (2i pairs with 2i + 1): per head, row i -> 2i and i + hd/2 -> 2i + 1."""
    hd = w.shape[0] // heads
    rest = w.shape[1:]
    return w.reshape(heads, 2, hd // 2, *rest).transpose(1, 2).reshape(w.shape)


def ntk_theta(cfg: ModelConfig) -> float:
    """Static NTK scaling is plain RoPE with base theta * factor^(hd / (hd - 2))."""
    hd = cfg.head_size
    return cfg.rope_theta * cfg.rope_factor ** (hd / (hd - 2))


# rope_scaling -> (freq_base, linear factor or None)
ROPE_SCALINGS: dict[str, Callable[[ModelConfig], tuple[float, float | None]]] = {
    "none": lambda c: (c.rope_theta, None),
    "linear": lambda c: (c.rope_theta, c.rope_factor),  # llama.cpp: freq_scale = 1 / factor
    "ntk": lambda c: (ntk_theta(c), None),
}


def _rope_metadata(w: Any, cfg: ModelConfig) -> None:
    hd = cfg.head_size
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    if cfg.rope_scaling not in ROPE_SCALINGS:
        raise GGUFError(
            f"rope_scaling={cfg.rope_scaling!r} is not supported; supported: "
            f"{', '.join(ROPE_SCALINGS)}"
        )
    base, factor = ROPE_SCALINGS[cfg.rope_scaling](cfg)
    w.add_rope_freq_base(float(base))
    if factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(factor))


# pos_encoding -> what the architecture metadata says about positions (learned: a tensor)
POSITION_METADATA: dict[str, Callable[[Any, ModelConfig], None]] = {
    "rope": _rope_metadata,
    "learned": lambda w, cfg: None,
}
NORM_EPS: dict[str, str] = {"rmsnorm": "add_layer_norm_rms_eps", "layernorm": "add_layer_norm_eps"}


def _write_hparams(w: Any, cfg: ModelConfig) -> None:
    """The ``{arch}.*`` keys llama.cpp reads to build the graph."""
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.dim)
    w.add_block_count(cfg.n_layers)
    w.add_feed_forward_length(cfg.expert_ffn_dim if cfg.n_experts else cfg.ffn_dim)
    if cfg.n_experts:  # llama.cpp's MoE graphs always renormalise the top k (checked: Arch.needs)
        w.add_expert_count(cfg.n_experts)
        w.add_expert_used_count(cfg.experts_per_token)
        w.add_expert_feed_forward_length(cfg.expert_ffn_dim)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.kv_heads)
    w.add_vocab_size(cfg.vocab_size)
    getattr(w, NORM_EPS[cfg.norm])(float(cfg.norm_eps))
    POSITION_METADATA[cfg.pos_encoding](w, cfg)


# ----------------------------------------------------------------------------------------------
# Architectures: GGUF tensor name -> our tensor(s), concatenated along rows ({i}: the layer)


def _wb(gguf_name: str, ours: str) -> dict[str, tuple[str, ...]]:
    """Weight and bias of one module (a bias absent from the model is skipped)."""
    return {f"{gguf_name}.weight": (f"{ours}.weight",), f"{gguf_name}.bias": (f"{ours}.bias",)}


LLAMA_TENSORS: dict[str, tuple[str, ...]] = {
    "token_embd.weight": ("tok_emb.weight",),
    "output_norm.weight": ("norm.weight",),
    "output.weight": ("lm_head.weight",),
    "blk.{i}.attn_norm.weight": ("layers.{i}.attn_norm.weight",),
    **_wb("blk.{i}.attn_q", "layers.{i}.attn.wq"),
    **_wb("blk.{i}.attn_k", "layers.{i}.attn.wk"),
    **_wb("blk.{i}.attn_v", "layers.{i}.attn.wv"),
    **_wb("blk.{i}.attn_output", "layers.{i}.attn.wo"),
    "blk.{i}.ffn_norm.weight": ("layers.{i}.mlp_norm.weight",),
    **_wb("blk.{i}.ffn_gate", "layers.{i}.mlp.w1"),
    **_wb("blk.{i}.ffn_up", "layers.{i}.mlp.w3"),
    **_wb("blk.{i}.ffn_down", "layers.{i}.mlp.w2"),
}
QWEN3_TENSORS: dict[str, tuple[str, ...]] = {
    **LLAMA_TENSORS,
    "blk.{i}.attn_q_norm.weight": ("layers.{i}.attn.q_norm.weight",),
    "blk.{i}.attn_k_norm.weight": ("layers.{i}.attn.k_norm.weight",),
}
# experts stacked (E, out, in) as ours are: ggml's {in, out, E}
EXPERT_TENSORS: dict[str, tuple[str, ...]] = {
    "blk.{i}.ffn_gate_inp.weight": ("layers.{i}.mlp.router.weight",),
    "blk.{i}.ffn_gate_exps.weight": ("layers.{i}.mlp.w1",),
    "blk.{i}.ffn_up_exps.weight": ("layers.{i}.mlp.w3",),
    "blk.{i}.ffn_down_exps.weight": ("layers.{i}.mlp.w2",),
}
DENSE_MLP = ("ffn_gate", "ffn_up", "ffn_down")
MIXTRAL_TENSORS = {
    **{k: v for k, v in LLAMA_TENSORS.items() if k.split(".")[-2] not in DENSE_MLP},
    **EXPERT_TENSORS,
}
QWEN3_MOE_TENSORS = {
    **{k: v for k, v in QWEN3_TENSORS.items() if k.split(".")[-2] not in DENSE_MLP},
    **EXPERT_TENSORS,
}
GPT2_TENSORS: dict[str, tuple[str, ...]] = {
    "token_embd.weight": ("tok_emb.weight",),
    "position_embd.weight": ("pos.emb.weight",),
    **_wb("output_norm", "norm"),
    "output.weight": ("lm_head.weight",),
    **_wb("blk.{i}.attn_norm", "layers.{i}.attn_norm"),
    "blk.{i}.attn_qkv.weight": tuple(f"layers.{{i}}.attn.w{x}.weight" for x in "qkv"),
    "blk.{i}.attn_qkv.bias": tuple(f"layers.{{i}}.attn.w{x}.bias" for x in "qkv"),
    **_wb("blk.{i}.attn_output", "layers.{i}.attn.wo"),
    **_wb("blk.{i}.ffn_norm", "layers.{i}.mlp_norm"),
    **_wb("blk.{i}.ffn_up", "layers.{i}.mlp.w1"),
    **_wb("blk.{i}.ffn_down", "layers.{i}.mlp.w2"),
}

# (field, test, what llama.cpp's graph computes): needs beyond those of the HF family
Need = tuple[str, Callable[[ModelConfig], bool], str]
SWIGLU: Need = ("mlp", lambda c: c.mlp == "swiglu", "'swiglu' (llama.cpp gates with SiLU here)")
NO_WINDOW: Need = (
    "sliding_window",
    lambda c: c.sliding_window is None or c.sliding_window >= c.max_seq_len,
    "None or >= max_seq_len (llama.cpp's llama and qwen3 archs attend to every position)",
)
NO_O_BIAS: Need = (
    "attn_bias",
    lambda c: not c.attn_bias,
    "False (llama.cpp's qwen3 has no o bias)",
)
RENORMALIZED: Need = (
    "moe_renormalize",
    lambda c: c.moe_renormalize,
    "True (llama.cpp's MoE graphs renormalise the top-k router weights)",
)


@dataclass(frozen=True)
class Arch:
    """How one HF family is written for llama.cpp."""

    name: str  # general.architecture
    tensors: dict[str, tuple[str, ...]]
    needs: list[Need] = field(default_factory=list)
    # llama.cpp's RoPE for this arch rotates adjacent pairs ("norm" type): re-order q/k rows
    interleave_qk: bool = False


ARCHS: dict[str, Arch] = {
    "llama": Arch("llama", LLAMA_TENSORS, [SWIGLU], interleave_qk=True),
    "mistral": Arch("llama", LLAMA_TENSORS, [SWIGLU, NO_WINDOW], interleave_qk=True),
    "qwen3": Arch("qwen3", QWEN3_TENSORS, [SWIGLU, NO_WINDOW, NO_O_BIAS]),
    "mixtral": Arch("llama", MIXTRAL_TENSORS, [NO_WINDOW], interleave_qk=True),
    "qwen3_moe": Arch("qwen3moe", QWEN3_MOE_TENSORS, [NO_WINDOW, NO_O_BIAS, RENORMALIZED]),
    "gpt2": Arch(
        "gpt2",
        GPT2_TENSORS,
        [
            ("mlp", lambda c: c.mlp == "gelu", "'gelu' (llama.cpp's gpt2 MLP)"),
            ("gelu_approx", lambda c: c.gelu_approx == "tanh", "'tanh' (llama.cpp's GELU)"),
        ],
    ),
}
# families interop.hf can write that no GGUF arch here takes: the fields that make them so
NOT_YET: dict[str, tuple[str, ...]] = {"falcon": ("norm", "parallel_block")}


def choose_arch(cfg: ModelConfig) -> Arch:
    """The llama.cpp architecture computing what ``cfg`` computes; ``GGUFError`` (one line)
    naming each field that blocks it."""
    from llm_foundry.interop.hf import ConversionError, choose_family

    supported = f"supported: {', '.join(ARCHS)} models"
    if cfg.pos_encoding not in POSITION_METADATA:
        raise GGUFError(
            f"cannot export pos_encoding={cfg.pos_encoding!r} to GGUF; supported: "
            f"{', '.join(map(repr, POSITION_METADATA))} ({supported})"
        )
    try:
        family = choose_family(cfg).model_type
    except ConversionError as e:
        raise GGUFError(f"cannot export to GGUF: {'; '.join(e.problems)}; {supported}") from None
    if family not in ARCHS:
        fields = ", ".join(f"{f}={getattr(cfg, f)!r}" for f in NOT_YET.get(family, ()))
        raise GGUFError(f"cannot export a {family} model ({fields}) to GGUF; {supported}")
    arch = ARCHS[family]
    unmet = [f"{f}={getattr(cfg, f)!r} (needs {need})" for f, ok, need in arch.needs if not ok(cfg)]
    if unmet:
        raise GGUFError(f"cannot export to GGUF's {arch.name} arch: {'; '.join(unmet)}")
    return arch


def gguf_tensors(
    state: dict[str, torch.Tensor], cfg: ModelConfig, arch: Arch
) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array) of every tensor llama.cpp reads, in our (out, in) layout (GGUF
    stores dims reversed, as ggml's {in, out}). Strict: every tensor of ``state`` is used."""
    bad = [k for k, t in state.items() if not t.is_floating_point()]
    if bad:
        raise GGUFError(
            f"the model holds non-float tensors ({bad[0]}: {state[bad[0]].dtype}): a quantized "
            "model; export from the full-precision checkpoint"
        )
    used: set[str] = set()
    if cfg.tie_embeddings:
        used.add("lm_head.weight")  # llama.cpp reads the head from token_embd when output is absent
    heads = {"attn_q": cfg.n_heads, "attn_k": cfg.kv_heads}
    for name, ours in arch.tensors.items():
        for i in range(cfg.n_layers) if "{i}" in name else (0,):
            full, parts = name.format(i=i), [o.format(i=i) for o in ours]
            if not all(p in state for p in parts) or (
                cfg.tie_embeddings and full == "output.weight"
            ):
                continue
            t = torch.cat([state[p].detach().to("cpu", torch.float32) for p in parts])
            module = full.split(".")[-2]
            if arch.interleave_qk and module in heads:
                t = interleave_rope_rows(t, heads[module])
            used.update(parts)
            yield full, t.contiguous().numpy()
    left = sorted(set(state) - used)
    if left:
        raise GGUFError(
            f"tensors with no place in GGUF's {arch.name} arch: {left[:3]}"
            f"{' ...' if len(left) > 3 else ''} (a LoRA adapter not merged, or a changed model?)"
        )


# ----------------------------------------------------------------------------------------------
# Vocabularies


@dataclass
class Vocab:
    """What the ``tokenizer.ggml.*`` keys say."""

    model: str  # "gpt2": byte-level BPE
    tokens: list[str]
    types: list[int]  # gguf.TokenType per token
    special: dict[str, int]  # "bos", "eos", "unk", "pad", "eot" -> id
    add_bos: bool = False
    add_eos: bool = False
    pre: str | None = None  # the pre-tokenizer, by llama.cpp's name
    merges: list[str] | None = None  # "left right", highest priority first


def _stop_id(tokens: list[str], missing: list[str], what: str) -> int:
    """An id for llama.cpp's bos/eos when the tokenizer has none: llama.cpp always has both and
    would otherwise take id 11 (its BPE default), a real token (for a character vocabulary a
    common letter). The last token: for a character vocabulary the highest code point, for BPE
    the last merge learned, both rare. As eos it ends llama.cpp's generation wherever the model
    writes it: the note says so (a bos alone is never added: add_bos_token is false)."""
    i = len(tokens) - 1
    after = (
        ": llama.cpp stops generating after it"
        if "eos" in missing
        else " (llama.cpp adds no bos to a prompt: add_bos_token is false)"
    )
    log.warning(
        f"note: the {what} has no {'/'.join(missing)} token; llama.cpp needs one, so the GGUF "
        f"names id {i} ({tokens[i]!r}){after}"
    )
    return i


def byte_symbols() -> list[str]:
    """The printable character GPT-2's byte-level BPE spells each byte 0..255 with (Radford et al.
    2019, "Language Models are Unsupervised Multitask Learners", sec. 2.2): the printable Latin-1
    bytes stand for themselves, the other 68 take the code points 256, 257, ... in byte order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    others = (chr(0x100 + i) for i in range(256 - len(printable)))
    return [chr(b) if b in printable else next(others) for b in range(256)]


# the pre-tokenizer named for a character vocabulary: merges join only the bytes of one character,
# so any split gives the same ids; this one (unlike "gpt-2") leaves spaces as written on decode
CHAR_PRE = "qwen2"
# llama.cpp refuses a "gpt2" vocabulary without merges and gguf writes no empty list: one of two
# 0xFF bytes, which UTF-8 text never holds, for a vocabulary that merges nothing
NO_MERGE = "\u00ff \u00ff"


def char_vocab(tok: Any, token_ids: dict[str, int], where: str | None = None) -> Vocab:
    """Our character tokenizer as a byte-level BPE ("gpt2") vocabulary: each character one token,
    spelled in GPT-2's byte symbols, and merges that join the bytes of each multi-byte character
    (a lead byte, then its continuation bytes) and nothing else, so llama.cpp reads one id per
    character, as ``CharTokenizer.encode`` does.

    Characters outside the vocabulary: ``encode`` refuses them; llama.cpp's BPE tokenizer, for a
    piece that is no token, looks up each of its bytes alone and drops those that are none, so it
    drops the character and tokenizes the rest as ``encode`` tokenizes the text without it. Not a
    SentencePiece-style ("llama") vocabulary: llama.cpp reads an unknown character there as
    ``<0xXX>`` byte tokens, never the unk id, and aborts without them (256 more tokens would need
    256 embedding rows the model does not have); nor a unigram ("t5") one, which maps unknown
    characters to the unk id but fuses runs of that id, so a real character named unk would lose
    its repeats. (``where``, the file's name in errors, is unused: nothing here is refused.)"""
    symbols = byte_symbols()
    tokens = ["".join(symbols[b] for b in c.encode("utf-8")) for c in tok.chars]
    # one symbol per byte: merge the first i bytes of a character with its (i + 1)-th
    merges = list(dict.fromkeys(f"{t[:i]} {t[i]}" for t in tokens for i in range(1, len(t))))
    special = dict(token_ids)
    missing = [k for k in ("bos", "eos") if k not in special]
    if missing:
        stop = _stop_id(list(tok.chars), missing, "character tokenizer")
        special.update(dict.fromkeys(missing, stop))
    normal = int(gguf.TokenType.NORMAL)
    types = [normal] * len(tokens)
    return Vocab("gpt2", tokens, types, special, pre=CHAR_PRE, merges=merges or [NO_MERGE])


# HF pre-tokenizer (type, add_prefix_space, use_regex) -> llama.cpp's name for the same split
BYTE_LEVEL_PRE: dict[tuple, str] = {("ByteLevel", False, True): "gpt-2"}
# HF BPE model options and the values llama.cpp's BPE reproduces
BPE_OPTIONS: dict[str, tuple] = {
    "dropout": (None, 0.0),
    "unk_token": (None,),
    "continuing_subword_prefix": (None, ""),
    "end_of_word_suffix": (None, ""),
    "fuse_unk": (False, None),
    "byte_fallback": (False, None),
    "ignore_merges": (False, None),
}


def _post_processor_specials(pp: dict | None, ids: dict[str, int], where: str) -> dict[str, int]:
    """{"bos": id} / {"eos": id} for the special tokens a TemplateProcessing post-processor puts
    around a single sequence (what ``encode`` adds by default); {} for none or ByteLevel."""
    if pp is None or pp.get("type") == "ByteLevel":
        return {}
    if pp.get("type") != "TemplateProcessing":
        raise GGUFError(
            f"{where}: post_processor {pp.get('type')!r} is not supported; supported: none, "
            "ByteLevel, TemplateProcessing"
        )
    single = pp.get("single", [])
    kinds = ["Sequence" if "Sequence" in piece else "SpecialToken" for piece in single]
    if kinds.count("Sequence") != 1 or len(single) > 3:
        raise GGUFError(f"{where}: post_processor template {single} is not [BOS?] $A [EOS?]")
    out: dict[str, int] = {}
    at = kinds.index("Sequence")
    specials = pp.get("special_tokens", {})
    for key, piece in (("bos", single[:at]), ("eos", single[at + 1 :])):
        if piece:
            name = piece[0]["SpecialToken"]["id"]
            token_ids = specials.get(name, {}).get("ids") or [ids.get(name)]
            if len(token_ids) != 1 or token_ids[0] is None:
                raise GGUFError(f"{where}: post_processor adds {name!r}, not one known token")
            out[key] = token_ids[0]
    return out


def byte_level_vocab(hf_json: dict, where: str, token_ids: dict[str, int], adds: bool) -> Vocab:
    """A Hugging Face byte-level BPE ``tokenizer.json`` (parsed) as a "gpt2" vocabulary: the
    same tokens, merges and regex; added special tokens as control tokens. ``adds``: whether
    our ``encode`` adds the post-processor's special tokens (HF files) or never (ours)."""
    model = hf_json.get("model") or {}
    if model.get("type") != "BPE":
        raise GGUFError(f"{where}: model.type={model.get('type')!r}; supported: 'BPE'")
    for option, allowed in BPE_OPTIONS.items():
        if model.get(option) not in allowed:
            raise GGUFError(
                f"{where}: model.{option}={model.get(option)!r} is not supported; supported: "
                f"{' or '.join(map(repr, allowed))}"
            )
    if hf_json.get("normalizer") is not None:
        kind = hf_json["normalizer"].get("type")
        raise GGUFError(f"{where}: normalizer {kind!r} is not supported; supported: none")
    pre = hf_json.get("pre_tokenizer") or {}
    key = (pre.get("type"), pre.get("add_prefix_space"), pre.get("use_regex", True))
    if key not in BYTE_LEVEL_PRE:
        raise GGUFError(
            f"{where}: pre_tokenizer {pre.get('type')!r} (add_prefix_space="
            f"{pre.get('add_prefix_space')!r}) is not supported; supported: ByteLevel with "
            "add_prefix_space=False and GPT-2's regex"
        )
    if (hf_json.get("decoder") or {}).get("type") != "ByteLevel":
        kind = (hf_json.get("decoder") or {}).get("type")
        raise GGUFError(f"{where}: decoder {kind!r} is not supported; supported: 'ByteLevel'")
    ids = dict(model["vocab"])
    added = {a["id"]: a for a in hf_json.get("added_tokens", [])}
    ids.update({a["content"]: i for i, a in added.items()})
    n = max(ids.values()) + 1
    tokens: list[str | None] = [None] * n
    for text, i in ids.items():
        tokens[i] = text
    holes = [i for i, t in enumerate(tokens) if t is None]
    if holes:
        raise GGUFError(f"{where}: ids {holes[:5]} have no token; GGUF needs ids 0..{n - 1}")
    types = [int(gguf.TokenType.NORMAL)] * n
    for i, a in added.items():
        if a.get("lstrip") or a.get("rstrip") or a.get("single_word"):
            raise GGUFError(
                f"{where}: added token {a['content']!r} strips spaces or matches single words; "
                "supported: added tokens matched as written"
            )
        types[i] = int(gguf.TokenType.CONTROL if a.get("special") else gguf.TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    added_by_encode = _post_processor_specials(hf_json.get("post_processor"), ids, where)
    special = {**(added_by_encode if adds else {}), **token_ids}
    controls = [i for i, t in enumerate(types) if t == int(gguf.TokenType.CONTROL)]
    for role in ("bos", "eos"):
        if role not in special:  # the one special token (GPT-2's <|endoftext|>) does both jobs
            special[role] = controls[0] if len(controls) == 1 else None
    missing = [k for k, v in special.items() if v is None]
    if missing:
        stop = _stop_id(tokens, missing, "tokenizer")
        special.update(dict.fromkeys(missing, stop))
    return Vocab(
        "gpt2",
        tokens,
        types,
        special,
        add_bos=adds and "bos" in added_by_encode,
        add_eos=adds and "eos" in added_by_encode,
        pre=BYTE_LEVEL_PRE[key],
        merges=merges or [NO_MERGE],  # bytes only: HF's BPE then merges nothing, nor llama.cpp's
    )


def bpe_vocab(tok: Any, token_ids: dict[str, int], where: str | None = None) -> Vocab:
    """Our byte-level BPE: its ``tokenizer.json``; encode adds no special token."""
    ours = {"bos": tok.bos_id, "eos": tok.eos_id, "pad": tok.pad_id}
    ids = {**{k: v for k, v in ours.items() if v is not None}, **token_ids}
    hf_json = json.loads(tok.hf.to_str())
    return byte_level_vocab(hf_json, where or "the BPE tokenizer", ids, adds=False)


# what an HF tokenizer that is refused can do instead, said after the reason
HF_TOKENIZERS_EXPORTED = (
    "GGUF export writes byte-level BPE tokenizers only (GPT-2's: ByteLevel pre-tokenizer without "
    "prefix space, no normalizer; and llm-foundry's own), not SentencePiece ones (Llama 2, "
    "Mistral) nor byte-level ones with a split of their own (Llama 3, Qwen2/3): write this "
    "model's GGUF with llama.cpp's convert_hf_to_gguf.py from its HF directory (for one of our "
    "checkpoints, `llm-foundry convert --to-hf` first)"
)


def hf_vocab(tok: Any, token_ids: dict[str, int], where: str | None = None) -> Vocab:
    """An HF ``tokenizer.json`` of an imported model; encode adds what its post-processor adds.
    A tokenizer GGUF cannot hold as one is refused with what to do instead."""
    ids = dict(token_ids)
    if tok.eos_id is not None:
        ids.setdefault("eos", tok.eos_id)
    try:
        return byte_level_vocab(json.loads(tok.hf.to_str()), where or "tokenizer.json", ids, True)
    except GGUFError as e:
        raise GGUFError(f"{e}. {HF_TOKENIZERS_EXPORTED}") from None


# tokenizer kind -> its vocabulary (tokenizer, special ids, the file named in errors)
VOCABS: dict[str, Callable[[Any, dict[str, int], str | None], Vocab]] = {
    "char": char_vocab,
    "bpe": bpe_vocab,
    "hf": hf_vocab,
}


def build_vocab(
    tokenizer: Any,
    vocab_size: int,
    token_ids: dict[str, int] | None = None,
    where: str | None = None,
) -> Vocab:
    """The GGUF vocabulary of ``tokenizer`` (read from file ``where``, named in errors), padded
    with unused tokens up to the model's ``vocab_size`` rows (llama.cpp sizes the embedding by
    the token list)."""
    kind = getattr(tokenizer, "kind", None)
    if kind not in VOCABS:
        raise GGUFError(
            f"tokenizer kind {kind!r} is not supported for GGUF; supported: {', '.join(VOCABS)}"
        )
    vocab = VOCABS[kind](tokenizer, dict(token_ids or {}), where)
    n = len(vocab.tokens)
    if n > vocab_size:
        raise GGUFError(
            f"the tokenizer has {n} tokens, more than the model's vocab_size={vocab_size}"
        )
    pad = [f"[PAD{i}]" for i in range(n, vocab_size)]
    vocab.tokens += pad
    vocab.types += [int(gguf.TokenType.UNUSED)] * len(pad)
    return vocab


SPECIAL_KEYS = {
    "bos": "add_bos_token_id",
    "eos": "add_eos_token_id",
    "unk": "add_unk_token_id",
    "pad": "add_pad_token_id",
    "eot": "add_eot_token_id",  # a chat template's end of turn: llama.cpp stops there too
}


def _write_vocab(w: Any, v: Vocab) -> None:
    w.add_tokenizer_model(v.model)
    if v.pre is not None:
        w.add_tokenizer_pre(v.pre)
    w.add_token_list(v.tokens)
    w.add_token_types(v.types)
    if v.merges is not None:
        w.add_token_merges(v.merges)
    for key, value in v.special.items():
        getattr(w, SPECIAL_KEYS[key])(int(value))
    w.add_add_bos_token(v.add_bos)
    w.add_add_eos_token(v.add_eos)


# ----------------------------------------------------------------------------------------------
# Export


def export_gguf(
    model: torch.nn.Module,
    tokenizer: Any,
    out_path: str | Path,
    outtype: str = "f32",
    chat_template: str | None = None,
    name: str | None = None,
    token_ids: dict[str, int] | None = None,
    tokenizer_file: str | Path | None = None,
) -> Path:
    """Write ``model`` (our ``Transformer``) with ``tokenizer`` as one GGUF file llama.cpp runs.
    ``outtype``: f32, f16, bf16, q8_0 or q4_0 for the 2-D weights; ``token_ids`` ("bos", "eos",
    "pad", "eot" -> id) adds special ids the tokenizer does not know (an HF model's);
    ``tokenizer_file``: where the tokenizer was read from, named in errors. Written as
    ``outputs.new_file`` writes: never over a file that exists, nor one another process wrote
    meanwhile."""
    qtype, file_type = gguf_types(outtype)
    model = unwrap(model)
    cfg = getattr(model, "cfg", None)
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"export_gguf needs an llm-foundry Transformer; got {type(model).__name__}")
    if tokenizer is None:
        raise GGUFError("GGUF files carry their tokenizer: the model has none (no tokenizer.json)")
    arch = choose_arch(cfg)
    where = str(tokenizer_file) if tokenizer_file is not None else None
    vocab = build_vocab(tokenizer, cfg.vocab_size, token_ids, where)
    tensors, fell_back = [], []
    for key, data in gguf_tensors(model.state_dict(), cfg, arch):
        stored, used = encode_tensor(key, data, qtype)
        tensors.append((key, stored, used))
        if used == Q.F16 != qtype:
            fell_back.append(key)
    if fell_back:
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        log.warning(
            f"note: {len(fell_back)} tensor(s) stored as f16, their rows not multiples of "
            f"{block} ({outtype} blocks): {', '.join(fell_back)}"
        )
    with new_file(out_path) as partial:  # a failed or raced write leaves no half-written .gguf
        w = gguf.GGUFWriter(str(partial), arch.name)
        try:
            w.add_name(name or Path(out_path).stem)
            w.add_file_type(int(file_type))
            if qtype in QUANTIZED:
                w.add_quantization_version(gguf.GGML_QUANT_VERSION)
            _write_hparams(w, cfg)
            _write_vocab(w, vocab)
            if chat_template:
                w.add_chat_template(chat_template)
            for key, stored, used in tensors:
                w.add_tensor(key, stored, raw_dtype=used)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file(progress=sum(t.size for _, t, _ in tensors) > 5e7)
        finally:
            w.close()
    return Path(out_path)
