"""The files of an HF checkpoint directory: safetensors weights (one file or shards with an
index; pickles never read) and the tokenizer files written beside an export."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from llm_foundry.checkpoint import read_safetensors_header
from llm_foundry.interop.hf.core import ConversionError
from llm_foundry.tokenizer import SPECIAL_TOKENS

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"


def _weight_files(path: Path) -> tuple[list[str], dict[str, str]]:
    """The safetensors files of an HF checkpoint directory (``model.safetensors``, or the shards
    named by ``model.safetensors.index.json``) and the index's weight map (empty without one)."""
    index = path / INDEX_FILE
    weight_map: dict[str, str] = {}
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ConversionError(
                f"{index} is not a valid shard index ({e!r}); expected "
                '{"weight_map": {"tensor name": "shard file", ...}}'
            ) from None
    elif (path / WEIGHTS_FILE).exists():
        files = [WEIGHTS_FILE]
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
    tensors: dict[str, torch.Tensor] = {}
    for file in _weight_files(path)[0]:
        tensors.update(load_file(str(path / file)))
    return tensors


def read_tokenizer(src: Path):
    """``src``'s tokenizer.json loaded once for an export (None: none there, or unreadable)."""
    from llm_foundry.tokenizer import load_tokenizer

    file = src / TOKENIZER_FILE
    try:
        return load_tokenizer(file) if file.exists() else None
    except ValueError:
        return None


def copy_tokenizer(src: Path, dst: Path, tok=None) -> None:
    """Bring ``tokenizer.json`` along when there is one, as a file both HF and we read: our BPE
    file is an HF tokenizers file already; our character tokenizer's file is written as its HF
    equivalent (``CharTokenizer.to_hf``), which ``load_tokenizer`` reads back as the same
    ``CharTokenizer``."""
    from llm_foundry.tokenizer import load_tokenizer

    file = src / TOKENIZER_FILE
    if not file.exists():
        return
    if "model" in json.loads(file.read_text(encoding="utf-8")):
        shutil.copyfile(file, dst / TOKENIZER_FILE)
        return
    tok = tok if tok is not None else load_tokenizer(file)
    (dst / TOKENIZER_FILE).write_text(tok.to_hf().to_str(), encoding="utf-8")


def special_token_ids(src: Path, tok=None) -> dict[str, int]:
    """The bos/eos/pad ids of ``src``'s tokenizer.json as HF config fields (``eos_token_id``: where
    ``generate`` stops); none where there is no readable tokenizer, or it has no such token."""
    from llm_foundry.tokenizer import load_tokenizer

    file = src / TOKENIZER_FILE
    try:
        tok = tok if tok is not None else load_tokenizer(file) if file.exists() else None
    except ValueError:
        return {}
    ids = {name: getattr(tok, f"{name}_id", None) for name in ("bos", "eos", "pad")}
    return {f"{name}_token_id": i for name, i in ids.items() if i is not None}


# tokenizer kind -> the tokenizer_config.json fields naming its special tokens
SPECIAL_TOKEN_NAMES = {
    "bpe": dict(zip(("bos_token", "eos_token", "pad_token"), SPECIAL_TOKENS, strict=True)),
    "char": {},  # no special tokens
}


def name_special_tokens(out: Path, tok=None) -> None:
    """Our tokenizer exported: tokenizer_config.json names its specials, so AutoTokenizer (and
    tools built on it, such as lm-eval's hf backend) knows BOS, EOS and padding; it loads as the
    plain PreTrainedTokenizerFast (a model's own class would add its specials) and decodes
    without transformers' clean-up of spaces before punctuation."""
    from llm_foundry.tokenizer import load_tokenizer

    file = out / TOKENIZER_FILE
    try:
        tok = tok if tok is not None else load_tokenizer(file) if file.exists() else None
    except ValueError:
        return
    names = SPECIAL_TOKEN_NAMES.get(getattr(tok, "kind", None))
    if names is None:
        return
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                **names,
                "add_bos_token": False,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
    )
