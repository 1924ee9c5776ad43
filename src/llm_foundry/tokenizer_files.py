"""What travels with a model's ``tokenizer.json``: the files ``transformers`` reads beside it,
written by one copier and read by one reader, so that an HF model's chat template and special
tokens reach every place the model goes (``convert --from-hf``, ``prepare --sft``, DPO rows and
``prepare --input --tokenizer-from``, each training checkpoint, ``quantize``, ``convert --to-hf``
and ``--to-gguf``):

  tokenizer_config.json    the special tokens' texts (bos_token, eos_token, pad_token, unk_token)
                           and maybe ``chat_template``: what ``AutoTokenizer`` reads
  chat_template.jinja      the chat template, where recent transformers write it
  special_tokens_map.json  older transformers' names of the special tokens
  generation_config.json   the ids transformers' ``generate`` stops at (``eos_token_id``: one id
                           or a list, e.g. Llama 3's end of text and end of turn)

``copy_tokenizer_files(src, dst)`` copies those present; ``read_tokenizer_meta(dir, tok)`` reads
them (and the ``*_token_id`` fields of ``config.json``) as a ``TokenizerMeta``: the chat template,
the special tokens' texts (template variables) and ids, and every id that ends a sequence.
``open_tokenizer(file)`` loads a tokenizer with the ids the files beside it name;
``keep_config_ids`` keeps an imported HF config.json's special ids (our checkpoint's config.json
has no place for them) in a generation_config.json. ``chat_format(dir, tok)``: the template a
model's chats are written in, and where a turn ends, for serve and the GGUF export.

Our own tokenizers need none of these files: the BPE one's ids are its own (<bos>, <eos>, <pad>),
the character one has no special token, and both chat in the built-in template
(``chat.BUILTIN_TEMPLATE``).
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from llm_foundry.chat import (
    BUILTIN_TEMPLATE,
    CONFIG_FILE,
    TEMPLATE_FILE,
    ChatTemplate,
    end_of_turn,
    json_object,
    load_chat_template,
    special_tokens,
)

log = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = CONFIG_FILE
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
GENERATION_CONFIG = "generation_config.json"
# the files beside tokenizer.json that carry its metadata, in the order they are read
METADATA_FILES = (TOKENIZER_CONFIG, TEMPLATE_FILE, SPECIAL_TOKENS_MAP, GENERATION_CONFIG)
TOKENIZER_FILES = (TOKENIZER_FILE, *METADATA_FILES)
# named chat templates besides the default one (transformers' chat_templates/NAME.jinja)
NAMED_TEMPLATES_DIR = "chat_templates"
ROLES = ("bos", "eos", "pad")


@dataclass
class TokenizerMeta:
    """What the files beside a tokenizer.json say about it (``read_tokenizer_meta``)."""

    directory: Path
    template: ChatTemplate | None = None  # the Jinja chat template (None: none there)
    tokens: dict[str, str] = field(default_factory=dict)  # bos_token, eos_token, ... -> text
    ids: dict[str, int] = field(default_factory=dict)  # "bos", "eos", "pad" -> id (those known)
    eos_ids: frozenset[int] = frozenset()  # every id that ends a sequence, eos among them

    def hf_config_ids(self) -> dict[str, int]:
        """The ids as an HF config.json's fields (``bos_token_id``, ...): where ``generate``
        stops and what pads."""
        return {f"{role}_token_id": i for role, i in self.ids.items()}


def metadata_files(directory: str | Path) -> list[str]:
    """The names of ``METADATA_FILES`` that ``directory`` holds."""
    return [name for name in METADATA_FILES if (Path(directory) / name).is_file()]


def copy_tokenizer_files(src: str | Path, dst: str | Path, names=TOKENIZER_FILES) -> list[str]:
    """Copy each of ``names`` (by default tokenizer.json and its metadata files) that ``src``
    holds into ``dst``; returns the names copied. Named chat templates besides the default
    (``chat_templates/``) are not carried: a note says so."""
    src, dst = Path(src), Path(dst)
    copied = []
    for name in names:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
            copied.append(name)
    if (src / NAMED_TEMPLATES_DIR).is_dir() and TEMPLATE_FILE in names:
        log.warning(
            f"note: {src / NAMED_TEMPLATES_DIR}/ (named chat templates) is not carried to {dst}: "
            "only the default template is"
        )
    return copied


def _token_ids(value) -> list[int]:
    """The ids of a config's ``*_token_id`` field: one id, a list of them, or none."""
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0]


def model_ids(directory: str | Path, role: str) -> list[int]:
    """The ids a model's configs in ``directory`` name for ``role`` (bos, eos, pad):
    generation_config.json's ``{role}_token_id`` then config.json's (an HF model's, or the copy
    ``quantize`` keeps); the one reader of those fields. A file that is not a JSON object is a
    one-line error naming it."""
    directory = Path(directory)
    field = f"{role}_token_id"
    ids = _token_ids(json_object(directory / GENERATION_CONFIG).get(field))
    return ids + _token_ids(json_object(directory / "config.json").get(field))


def _id_of(tok, text: str | None) -> int | None:
    """The id of the special token spelled ``text`` in ``tok``'s vocabulary (None: not there)."""
    hf = getattr(tok, "hf", None)
    if text is None or hf is None:
        return None
    return hf.token_to_id(text)


def read_tokenizer_meta(directory: str | Path, tok=None) -> TokenizerMeta:
    """What ``directory``'s tokenizer files say: the chat template (``chat.load_chat_template``),
    the special tokens' texts (tokenizer_config.json, else special_tokens_map.json) and their
    ids in ``tok``. Each of bos/eos/pad is, first found: the id of the text the tokenizer
    config names; the tokenizer's own (ours); generation_config.json's; config.json's (an HF
    model's, or the copy ``quantize`` keeps). ``eos_ids``: that eos and every id the two
    configs list. A file that is not a JSON object is a one-line error naming it."""
    directory = Path(directory)
    template, tokens = load_chat_template(directory)
    legacy = special_tokens(json_object(directory / SPECIAL_TOKENS_MAP))
    tokens = {**legacy, **tokens}
    configs = {role: model_ids(directory, role) for role in ROLES}
    ids: dict[str, int] = {}
    for role in ROLES:
        found = [_id_of(tok, tokens.get(f"{role}_token")), getattr(tok, f"{role}_id", None)]
        first = next((i for i in [*found, *configs[role][:1]] if i is not None), None)
        if first is not None:
            ids[role] = first
    eos = [ids["eos"]] if "eos" in ids else []
    return TokenizerMeta(directory, template, tokens, ids, frozenset(eos + configs["eos"]))


def open_tokenizer(file: str | Path):
    """(the tokenizer in ``file`` (``tokenizer.load_any_tokenizer``), what the files beside it
    say (``read_tokenizer_meta``)); an HF tokenizer's bos/eos/pad ids are set from the latter
    (ours have their own)."""
    from llm_foundry.tokenizer import load_any_tokenizer

    file = Path(file)
    tok = load_any_tokenizer(file)
    meta = read_tokenizer_meta(file.parent, tok)
    if getattr(tok, "kind", "") == "hf":
        tok.bos_id, tok.eos_id, tok.pad_id = (meta.ids.get(role) for role in ROLES)
    return tok, meta


def keep_config_ids(src: str | Path, dst: str | Path) -> dict[str, list[int]]:
    """An HF model imported (``src`` -> ``dst``) without a generation_config.json: the special ids
    its config.json names (which our checkpoint's config.json does not hold) written to
    ``dst``'s generation_config.json, as transformers derives one from a config. Returns them."""
    src, dst = Path(src), Path(dst)
    if (src / GENERATION_CONFIG).is_file():
        return {}
    ids = {f"{role}_token_id": model_ids(src, role) for role in ROLES}  # config.json's
    ids = {key: found for key, found in ids.items() if found}
    if ids:
        fields = {key: found[0] if len(found) == 1 else found for key, found in ids.items()}
        (dst / GENERATION_CONFIG).write_text(json.dumps(fields, indent=2) + "\n")
    return ids


@dataclass(frozen=True)
class ChatFormat:
    """How a model's chats are written (``chat_format``)."""

    template: str  # the Jinja template
    variables: dict[str, str]  # its variables: the special tokens' texts
    end: str  # what ends an assistant turn (``end_of_turn``)
    end_id: int | None  # that end's id when it is a special token (``special_id``), else None
    note: str | None = None  # one line: the built-in template stands in for a missing one


def chat_format(directory: str | Path, tok) -> ChatFormat:
    """The chat format of the model whose tokenizer ``tok`` was read from ``directory``: an HF
    tokenizer's own template and special tokens, from the files beside it
    (``read_tokenizer_meta``); our char and BPE tokenizers' built-in template.
    An HF tokenizer without a template gets the built-in one, with a ``note`` saying so."""
    hf = getattr(tok, "kind", "") == "hf"
    template, variables, note = BUILTIN_TEMPLATE, {}, None
    if hf:
        meta = read_tokenizer_meta(directory, tok)
        variables = meta.tokens
        if meta.template is not None:
            template = meta.template
        else:
            note = (
                f"note: {directory} has no chat template ({TOKENIZER_CONFIG}'s chat_template or "
                f"{TEMPLATE_FILE} beside tokenizer.json): chats are written in the built-in "
                "'ROLE: content' template, which the model may not have been tuned on"
            )
    end = end_of_turn(template, **variables)
    return ChatFormat(template, variables, end, special_id(tok, end), note)


def special_id(tok, text: str) -> int | None:
    """The id of ``text`` in HF tokenizer ``tok`` when it is one of its special added tokens
    (``special`` in tokenizer.json's added_tokens, as transformers' ``added_tokens_decoder``
    reads it), else None: an ordinary vocabulary entry ("\n", "###") may be generated as
    other pieces too, so it ends a turn only as a stop string."""
    hf = getattr(tok, "hf", None)
    if hf is None or getattr(tok, "kind", "") != "hf":
        return None
    found = [i for i, t in hf.get_added_tokens_decoder().items() if t.special and t.content == text]
    return found[0] if found else None
