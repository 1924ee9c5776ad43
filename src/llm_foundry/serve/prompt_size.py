"""How many characters one token can stand for at most, read from a tokenizer's pipeline, so that
a prompt far past the context is refused from its length alone: encoding megabytes of text
takes seconds, a length is free.

    chars_per_token(tok) -> L or None;  a text of N characters encodes to >= ceil(N / L) tokens

The bound holds only where no step of the pipeline can drop characters: a character tokenizer
(L = 1); a Hugging Face BPE whose vocabulary covers every character (every byte of a byte-level
one, or byte-fallback tokens), whose pre-tokenizer keeps every character and whose normalizer
shrinks text by a known factor at most. Elsewhere (WordPiece, Unigram, a normalizer that strips,
a pre-tokenizer that drops spaces) it is None: the prompt is encoded whole, as before.
"""

from __future__ import annotations

import json
import math

# how much each normalizer can shrink a text at most: NFC/NFKC compose at most 4 code points
# into one (Unicode's longest canonical decomposition); the others never shrink it
SHRINK = {"NFD": 1, "NFKD": 1, "NFC": 4, "NFKC": 4, "Lowercase": 1, "Prepend": 1}
# pre-tokenizers that keep every character (ByteLevel and Metaspace only rewrite them)
KEEP = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}
BYTE_FALLBACK = [f"<0x{b:02X}>" for b in range(256)]


def _shrink(spec: dict | None) -> float | None:
    """The most a normalizer ``spec`` (tokenizer.json's) can shrink a text; None: no bound."""
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        factors = [_shrink(s) for s in spec.get("normalizers", [])]
        return None if None in factors else math.prod(factors)
    if kind == "Replace":
        pattern, content = spec.get("pattern", {}), spec.get("content", "")
        if "String" not in pattern or not content:
            return None  # a regex matches any length; nothing for something: no bound
        return max(1, len(pattern["String"]) / len(content))
    return SHRINK.get(kind)


def _keeps(spec: dict | None) -> bool:
    """Whether the pre-tokenizer ``spec`` keeps every character of the text."""
    if spec is None:
        return True
    if spec.get("type") == "Sequence":
        return all(_keeps(s) for s in spec.get("pretokenizers", []))
    return spec.get("type") in KEEP and spec.get("behavior") != "Removed"


def _has_byte_level(spec: dict | None) -> bool:
    if spec is None:
        return False
    if spec.get("type") == "Sequence":
        return any(_has_byte_level(s) for s in spec.get("pretokenizers", []))
    return spec.get("type") == "ByteLevel"


def hf_chars_per_token(hf) -> float | None:
    """``chars_per_token`` of a Hugging Face ``tokenizers.Tokenizer``: the longest token (its
    vocabulary string, or an added token's text) times the normalizer's shrink factor."""
    from tokenizers import pre_tokenizers

    spec = json.loads(hf.to_str())
    model, pre = spec.get("model", {}), spec.get("pre_tokenizer")
    factor = _shrink(spec.get("normalizer"))
    if model.get("type") != "BPE" or factor is None or not _keeps(pre):
        return None
    vocab = hf.get_vocab(with_added_tokens=True)
    if _has_byte_level(pre):  # every character is bytes, each a token of the alphabet
        covered = all(c in vocab for c in pre_tokenizers.ByteLevel.alphabet())
    elif model.get("byte_fallback"):
        covered = all(b in vocab for b in BYTE_FALLBACK)
    else:  # an unknown character is one unknown token, unless runs of them are fused into one
        covered = model.get("unk_token") is not None and not model.get("fuse_unk")
    if not covered:
        return None
    return factor * max(len(token) for token in vocab)


def chars_per_token(tok) -> float | None:
    """The most characters of a text one token of ``tok`` (one of ``tokenizer``'s) stands for,
    where the pipeline bounds it; None where it does not."""
    if getattr(tok, "kind", "") == "char":
        return 1
    hf = getattr(tok, "hf", None)
    return hf_chars_per_token(hf) if hf is not None else None


def min_tokens(chars: int, per_token: float | None) -> int:
    """The fewest tokens a text of ``chars`` characters encodes to (0 when unbounded)."""
    return 0 if per_token is None else math.ceil(chars / per_token)
