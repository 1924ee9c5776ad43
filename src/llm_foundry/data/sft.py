"""Supervised fine-tuning data: JSONL rows -> token ids with a loss mask, and batches of whole
examples in which only the response tokens are targets.

Rows (one JSON object a line):

    {"prompt": "...", "completion": "..."}
    {"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}

An HF tokenizer's own Jinja chat template renders chat rows when the tokenizer comes from an HF
directory (``llm_foundry.chat``); otherwise the built-in template (for this project's char and
BPE tokenizers) writes a prompt/completion row
as ``prompt + completion`` and a chat as one ``ROLE: content`` line per message; the loss covers
the completion, or every assistant message's content and the newline that ends it. Each piece is
encoded on its own, so a mask boundary is also a token boundary. ``prepare_sft`` writes

  train.bin, val.bin                  the examples' tokens, one after another
  train.mask.bin, val.mask.bin        uint8, 1 where the token is a target of the loss
  train.offsets.bin, val.offsets.bin  int64, where each example starts (and one past the end)
  tokenizer.json, meta.json           the tokenizer used; meta.json with "kind": "sft"

``SFTSampler`` draws whole examples (seeded, resumable like ``BatchSampler``), cut to
block_size + 1 tokens and padded; padding and prompt tokens get the target -100 (ignored).
Examples cut so that no target is left are not drawn (``cut`` and ``dropped`` count them).
With ``pack`` a row holds several whole examples one after another, with a document id per
position (the model keeps attention inside each document) and no target across a boundary.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import torch

from llm_foundry.chat import load_chat_template, response_spans
from llm_foundry.data.batches import BatchSampler, open_tokens
from llm_foundry.data.encode import token_dtype
from llm_foundry.data.sources import DataError, write_atomic
from llm_foundry.tokenizer import load_any_tokenizer

ROLES = ("system", "user", "assistant")
IGNORE = -100  # the target of positions that do not count (the model's ignore_index)


def read_rows(path: str | Path) -> list[dict]:
    """Every row of a JSONL file, checked: a JSON object with a non-empty ``prompt`` and
    ``completion``, or ``messages`` with known roles, string contents and an assistant turn."""
    path = Path(path)
    rows = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}, line {i}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise DataError(f"{where}: a {type(row).__name__}, expected an object")
        _check_row(row, where)
        rows.append(row)
    if not rows:
        raise DataError(f"{path} holds no rows; expected JSON objects, one a line")
    return rows


def _check_row(row: dict, where: str) -> None:
    if "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise DataError(f"{where}: 'messages' must be a non-empty list")
        for j, m in enumerate(msgs):
            if not isinstance(m, dict) or m.get("role") not in ROLES:
                raise DataError(
                    f"{where}: messages[{j}] needs a 'role' of {', '.join(ROLES)}; got {m!r}"[:300]
                )
            if not isinstance(m.get("content"), str):
                raise DataError(f"{where}: messages[{j}].content must be a string")
        if not any(m["role"] == "assistant" and m["content"] for m in msgs):
            raise DataError(f"{where}: no non-empty assistant message: nothing to learn from")
        return
    for field in ("prompt", "completion"):
        if not isinstance(row.get(field), str):
            raise DataError(
                f"{where}: missing or non-string {field!r}; a row is "
                '{"prompt": ..., "completion": ...} or {"messages": [...]}'
            )
    if not row["completion"]:
        raise DataError(f"{where}: 'completion' is empty: nothing to learn from")


def segments(row: dict) -> list[tuple[str, bool]]:
    """The row as text pieces in the built-in template, each marked True if it is a target."""
    if "messages" not in row:
        return [(row["prompt"], False), (row["completion"], True)]
    out = []
    for m in row["messages"]:
        trained = m["role"] == "assistant"
        out += [(f"{m['role'].upper()}: ", False), (m["content"] + "\n", trained)]
    return out


def encode_row(tokenizer, row: dict) -> tuple[list[int], list[int]]:
    """(ids, mask) of one row: each piece encoded alone, mask 1 on target tokens; the tokenizer's
    end-of-sequence id, if it has one, ends the example as a target."""
    ids, mask = [], []
    for text, trained in segments(row):
        piece = tokenizer.encode(text) if text else []
        ids += piece
        mask += [int(trained)] * len(piece)
    if getattr(tokenizer, "eos_id", None) is not None:
        ids.append(tokenizer.eos_id)
        mask.append(1)
    return ids, mask


def encode_chat(tokenizer, template: str, specials: dict, row: dict) -> tuple[list, list]:
    """(ids, mask) of a chat row under an HF tokenizer's Jinja template: the rendered text
    tokenized as ``apply_chat_template`` does; mask 1 on the tokens of every assistant reply (the
    characters each reply adds to the rendering). A prompt/completion row is its two pieces."""
    if "messages" not in row:
        prompt = tokenizer.encode(row["prompt"], add_special_tokens=False) if row["prompt"] else []
        completion = tokenizer.encode(row["completion"], add_special_tokens=False)
        eos = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
        return prompt + completion + eos, [0] * len(prompt) + [1] * (len(completion) + len(eos))
    text, spans = response_spans(template, row["messages"], **specials)
    enc = tokenizer.hf.encode(text, add_special_tokens=False)
    mask = [int(any(a <= start < b for a, b in spans)) for start, _ in enc.offsets]
    return list(enc.ids), mask


def prepare_sft(
    out_dir: str | Path, jsonl: str | Path, tokenizer_file: str | Path, val_fraction: float = 0.1
) -> dict:
    """Tokenize the rows of ``jsonl`` with the tokenizer in ``tokenizer_file`` (the model's own;
    an HF tokenizer's chat template beside it, in ``tokenizer_config.json``, renders the chats)
    into ``out_dir``; the last ``val_fraction`` of the rows (at least one) are validation."""
    out, jsonl = Path(out_dir), Path(jsonl)
    tok = load_any_tokenizer(tokenizer_file)
    template, specials = (None, {})
    if getattr(tok, "kind", "") == "hf":
        template, specials = load_chat_template(Path(tokenizer_file).parent)
        if tok.eos_id is None and "eos_token" in specials:
            tok.eos_id = tok.hf.token_to_id(specials["eos_token"])
        if template is None and any("messages" in r for r in read_rows(jsonl)):
            raise DataError(
                f"{Path(tokenizer_file).parent} has no chat template (tokenizer_config.json "
                "chat_template or chat_template.jinja) to render the chat rows with"
            )
    rows = read_rows(jsonl)
    if len(rows) < 2:
        raise DataError(f"{jsonl} has {len(rows)} row; at least 2 are needed (train and val)")
    encoded = []
    for i, row in enumerate(rows, start=1):
        try:
            if template is not None or getattr(tok, "kind", "") == "hf":
                encoded.append(encode_chat(tok, template, specials, row))
            else:
                encoded.append(encode_row(tok, row))
        except (KeyError, ValueError) as e:
            raise DataError(
                f"{jsonl}, row {i}: cannot be encoded by {tokenizer_file}: {e}"
            ) from None
    n_val = max(1, int(round(len(rows) * val_fraction)))
    splits = {"train": encoded[:-n_val], "val": encoded[-n_val:]}
    dtype = token_dtype(tok.vocab_size)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(
        kind="sft",
        source=str(jsonl.resolve()),
        sha256=hashlib.sha256(jsonl.read_bytes()).hexdigest(),
        dtype=np.dtype(dtype).name,
        vocab_size=tok.vocab_size,
        tokenizer_file="tokenizer.json",
    )
    for split, examples in splits.items():
        ids = np.array([t for e, _ in examples for t in e], dtype=dtype)
        mask = np.array([m for _, ms in examples for m in ms], dtype=np.uint8)
        offsets = np.cumsum([0] + [len(e) for e, _ in examples]).astype(np.int64)
        ids.tofile(out / f"{split}.bin")
        mask.tofile(out / f"{split}.mask.bin")
        offsets.tofile(out / f"{split}.offsets.bin")
        meta[f"{split}_tokens"] = int(len(ids))
        meta[f"{split}_examples"] = len(examples)
        meta[f"{split}_targets"] = int(mask.sum())
    if Path(tokenizer_file).resolve() != (out / "tokenizer.json").resolve():
        shutil.copyfile(tokenizer_file, out / "tokenizer.json")
    write_atomic(out / "meta.json", json.dumps(meta, indent=2) + "\n")
    return meta


class SFTSampler(BatchSampler):
    """Batches of whole examples: x, y (batch_size, block_size), y = IGNORE where the next token
    is prompt, template or padding; examples longer than block_size + 1 tokens are cut. With
    ``pack``: rows of several examples and their document ids (batch_size, block_size)."""

    def __init__(self, data_dir: str | Path, split: str, block_size: int, batch_size: int,
                 seed: int = 0, *, rank: int = 0, world_size: int = 1,
                 pack: bool = False):  # fmt: skip
        data_dir = Path(data_dir)
        meta = json.loads((data_dir / "meta.json").read_text())
        tokens = open_tokens(data_dir / f"{split}.bin", meta["dtype"], meta[f"{split}_tokens"])
        super().__init__(tokens, 1, batch_size, seed, rank=rank, world_size=world_size)
        self.block_size = block_size
        self.mask = open_tokens(data_dir / f"{split}.mask.bin", np.uint8, meta[f"{split}_tokens"])
        n = meta[f"{split}_examples"]
        self.offsets = np.asarray(open_tokens(data_dir / f"{split}.offsets.bin", np.int64, n + 1))
        self.pad_id = 0
        self.pack = pack
        # examples longer than a window are cut; one whose targets all lie past the cut is left
        # out (it would be a batch row with nothing to learn)
        starts, ends = self.offsets[:-1], self.offsets[1:]
        csum = np.concatenate([[0], np.cumsum(np.asarray(self.mask, dtype=np.int64))])
        kept_end = np.minimum(ends, starts + block_size + 1)
        self.eligible = np.flatnonzero(csum[kept_end] - csum[starts + 1] > 0)
        self.cut = int(np.sum(ends - starts > block_size + 1))
        self.dropped = n - len(self.eligible)
        if len(self.eligible) == 0:
            raise DataError(
                f"{data_dir} ({split}): no example has a target within block_size + 1 = "
                f"{block_size + 1} tokens; raise train.block_size or shorten the prompts"
            )

    def next(self):
        """x, y (B, T); with packing also doc (B, T), the document each position belongs to."""
        if self.pack:
            return self._packed()
        B, T = self.batch_size, self.block_size
        draws = self.rng.integers(0, len(self.eligible), size=B * self.world_size)
        picks = self.eligible[draws[self.rank * B : (self.rank + 1) * B]]
        x = np.full((B, T), self.pad_id, dtype=np.int64)
        y = np.full((B, T), IGNORE, dtype=np.int64)
        for b, i in enumerate(picks):
            start, end = int(self.offsets[i]), int(self.offsets[i + 1])
            end = min(end, start + T + 1)
            ids = np.asarray(self.data[start:end], dtype=np.int64)
            trained = np.asarray(self.mask[start + 1 : end], dtype=bool)
            x[b, : len(ids) - 1] = ids[:-1]
            y[b, : len(ids) - 1] = np.where(trained, ids[1:], IGNORE)
        self.batches += 1
        return torch.from_numpy(x), torch.from_numpy(y)

    def _packed(self):
        """Rows filled with whole examples one after another (the last one cut at the row's
        end); a position never targets the next document's first token."""
        B, T = self.batch_size, self.block_size
        rows = []
        for _ in range(B * self.world_size):
            ids, mask, doc = [], [], []
            while len(ids) < T + 1:
                i = self.eligible[self.rng.integers(0, len(self.eligible))]
                start, end = int(self.offsets[i]), int(self.offsets[i + 1])
                ids += np.asarray(self.data[start:end], dtype=np.int64).tolist()
                mask += np.asarray(self.mask[start:end]).tolist()
                doc += [len(set(doc))] * (end - start)
            rows.append((ids[: T + 1], mask[: T + 1], doc[: T + 1]))
        x = np.zeros((B, T), dtype=np.int64)
        y = np.full((B, T), IGNORE, dtype=np.int64)
        d = np.zeros((B, T), dtype=np.int64)
        for b, (ids, mask, doc) in enumerate(rows[self.rank * B : (self.rank + 1) * B]):
            ids, mask, doc = np.array(ids), np.array(mask, dtype=bool), np.array(doc)
            x[b], d[b] = ids[:-1], doc[:-1]
            keep = mask[1:] & (doc[1:] == doc[:-1])  # a target inside the same document
            y[b] = np.where(keep, ids[1:], IGNORE)
        self.batches += 1
        return torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(d)

    __next__ = next
