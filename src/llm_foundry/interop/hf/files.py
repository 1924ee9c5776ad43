"""The files of an HF checkpoint directory: safetensors weights (one file or shards with an
index; pickles never read) and the tokenizer files written beside an export."""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from llm_foundry.checkpoint import read_safetensors_header
from llm_foundry.interop.hf.core import ConversionError
from llm_foundry.tokenizer import SPECIAL_TOKENS

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
# bytes per value of each safetensors dtype
DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "BF16": 2, "F16": 2,
               "I16": 2, "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}  # fmt: skip


def _weight_files(path: Path) -> tuple[list[str], dict[str, str]]:
    """The safetensors files of an HF checkpoint directory (``model.safetensors``, else the
    shards named by ``model.safetensors.index.json``: transformers' order) and the index's
    weight map (empty without one)."""
    index = path / INDEX_FILE
    weight_map: dict[str, str] = {}
    if (path / WEIGHTS_FILE).exists():
        files = [WEIGHTS_FILE]
    elif index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ConversionError(
                f"{index} is not a valid shard index ({e!r}); expected "
                '{"weight_map": {"tensor name": "shard file", ...}}'
            ) from None
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors file in {path}; only safetensors checkpoints are read "
            "(pytorch_model.bin is a pickle and is never loaded: re-save the model with "
            "transformers' save_pretrained, which writes safetensors)"
        )
    return files, weight_map


def read_safetensors_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in an HF checkpoint directory, from the file headers alone (no
    tensor data read); each file checked to be whole, each tensor in exactly one shard."""
    path = Path(path)
    files, weight_map = _weight_files(path)
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        part = read_safetensors_header(path / file)
        twice = sorted(shapes.keys() & part.keys())
        if twice:
            raise ConversionError(f"{path}: tensors {twice} appear in more than one shard")
        shapes.update(part)
    absent = sorted(set(weight_map) - set(shapes))
    if absent:
        raise ConversionError(f"{path / INDEX_FILE} lists tensors that no shard holds: {absent}")
    return shapes


def read_safetensors_dir(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF checkpoint directory (see ``read_safetensors_shapes``, which checks
    the files first). Pickle files (``pytorch_model.bin``) are never read."""
    path = Path(path)
    read_safetensors_shapes(path)
    if (path / WEIGHTS_FILE).exists() and (path / INDEX_FILE).exists():
        log.warning(f"note: {path} holds both {WEIGHTS_FILE} and {INDEX_FILE}: {WEIGHTS_FILE} "
                    "read, as transformers reads it (the shards are left alone)")  # fmt: skip
    tensors: dict[str, torch.Tensor] = {}
    for file in _weight_files(path)[0]:
        tensors.update(load_file(str(path / file)))
    return tensors


def stored_bytes(path: str | Path) -> dict[str, int]:
    """Bytes of tensor data per stored dtype (safetensors' names: "BF16", "F32", ...) in the
    weight files of an HF checkpoint directory (those ``read_safetensors_dir`` reads)."""
    path = Path(path)
    out: dict[str, int] = {}
    for file in _weight_files(path)[0]:
        with safe_open(str(path / file), "pt") as f:
            for name in f.keys():
                t = f.get_slice(name)
                size = math.prod(t.get_shape()) * DTYPE_BYTES.get(t.get_dtype(), 0)
                out[t.get_dtype()] = out.get(t.get_dtype(), 0) + size
    return out


def copy_tokenizer(src: Path, dst: Path, tok=None) -> None:
    """Bring ``tokenizer.json`` along when there is one, as a file both HF and we read: our BPE
    file is an HF tokenizers file already; our character tokenizer's file is written as its HF
    equivalent (``CharTokenizer.to_hf``), which ``load_tokenizer`` reads back as the same
    ``CharTokenizer``. The files beside it that carry an HF tokenizer's chat template and
    special tokens come too (``tokenizer_files.copy_tokenizer_files``)."""
    from llm_foundry.tokenizer import load_tokenizer
    from llm_foundry.tokenizer_files import METADATA_FILES, copy_tokenizer_files

    file = src / TOKENIZER_FILE
    if not file.exists():
        return
    copy_tokenizer_files(src, dst, METADATA_FILES)
    if "model" in json.loads(file.read_text(encoding="utf-8")):
        shutil.copyfile(file, dst / TOKENIZER_FILE)
        return
    tok = tok if tok is not None else load_tokenizer(file)
    (dst / TOKENIZER_FILE).write_text(tok.to_hf().to_str(), encoding="utf-8")


# tokenizer kind -> the tokenizer_config.json fields naming its special tokens
SPECIAL_TOKEN_NAMES = {
    "bpe": dict(zip(("bos_token", "eos_token", "pad_token"), SPECIAL_TOKENS, strict=True)),
    "char": {},  # no special tokens
}


def name_special_tokens(out: Path, tok=None, ids: dict[str, int] | None = None) -> None:
    """An exported tokenizer's tokenizer_config.json, naming its specials so that AutoTokenizer
    (and tools built on it, such as lm-eval's hf backend) knows BOS, EOS and padding: ours by
    their fixed names; an HF tokenizer by the texts of ``ids`` ("bos", "eos", "pad" -> id, as
    ``tokenizer_files.read_tokenizer_meta`` found them). It loads as the plain
    PreTrainedTokenizerFast (a model's own class would add its specials) and decodes without
    transformers' clean-up of spaces before punctuation. A tokenizer_config.json carried from
    an HF model is its own already: kept as it is."""
    from llm_foundry.tokenizer import load_tokenizer

    file = out / TOKENIZER_FILE
    if (out / "tokenizer_config.json").exists():
        return
    try:
        tok = tok if tok is not None else load_tokenizer(file) if file.exists() else None
    except ValueError:
        return
    kind = getattr(tok, "kind", None)
    if kind == "hf":
        names = {f"{role}_token": tok.hf.id_to_token(i) for role, i in (ids or {}).items()}
        names = {k: v for k, v in names.items() if v is not None}
    else:
        names = SPECIAL_TOKEN_NAMES.get(kind)
    if names is None or (kind == "hf" and not names):
        return
    # ours add no BOS; an HF tokenizer.json's post-processor says what it adds
    adds = {} if kind == "hf" else {"add_bos_token": False}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **names, **adds}
    config["clean_up_tokenization_spaces"] = False
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
