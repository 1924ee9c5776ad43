"""Preference data for DPO: JSONL rows -> token ids with a loss mask, two sequences per pair, and
batches of pairs.

Rows (one JSON object a line), TRL's preference formats:

    {"prompt": "...", "chosen": "...", "rejected": "..."}
    {"prompt": [{"role": "user", "content": "..."}, ...],
     "chosen": [{"role": "assistant", "content": "..."}], "rejected": [...]}

(in the chat form ``chosen`` / ``rejected`` may also be one message object). A sequence is the
prompt then the completion, encoded as SFT rows are (``data.sft``: each piece alone, the built-in
template or an HF tokenizer's own chat template); the loss mask covers the completion alone (its
text and end-of-sequence token, or the content of its assistant messages). ``prepare_preference``
writes the SFT layout with pair i's chosen sequence as example 2i and its rejected one as 2i + 1:

  train.bin, train.mask.bin, train.offsets.bin, val.* (see data/sft.py), tokenizer.json (and
  its metadata files, as SFT rows), meta.json with "kind": "preference", "train_pairs" and
  "val_pairs"

The rows are encoded in memory (preference sets are small next to pretraining text).
``PreferenceSampler`` draws pairs (seeded, resumable like ``BatchSampler``), each sequence cut to
block_size + 1 tokens; a pair either of whose sequences keeps no target is not drawn.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

from llm_foundry import lock
from llm_foundry.chat import response_spans
from llm_foundry.data.batches import (
    IGNORE,
    BatchSampler,
    check_files,
    load_meta,
    open_tokens,
    prepared_kind,
)
from llm_foundry.data.encode import token_dtype
from llm_foundry.data.rows import iter_objects
from llm_foundry.data.sft import (
    check_messages,
    prompt_completion,
    publish_prepared,
    segments,
    temporaries,
)
from llm_foundry.data.sources import DataError
from llm_foundry.messages import shown
from llm_foundry.tokenizer_files import METADATA_FILES, open_tokenizer

KIND = "preference"
FIELDS = ("prompt", "chosen", "rejected")


def _messages(value, field: str, where: str) -> list[dict]:
    """A message list (or one message object) checked: known roles, string contents."""
    msgs = [value] if isinstance(value, dict) else value
    if not isinstance(msgs, list) or not msgs:
        raise DataError(f"{where}: {field!r} must be a non-empty list of messages (or one message)")
    check_messages(msgs, field, where)
    return msgs


def check_row(row, where: str) -> dict:
    """The row with its chat fields as message lists; a DataError naming ``where`` (file and
    line) and the field otherwise."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: a {type(row).__name__}, expected an object")
    for field in FIELDS:
        if field not in row:
            raise DataError(
                f"{where}: no {field!r}; a row is "
                '{"prompt": ..., "chosen": ..., "rejected": ...} (text or messages)'
            )
    prompt = row["prompt"]
    if isinstance(prompt, str):
        for field in FIELDS:
            if not isinstance(row[field], str) or not row[field]:
                raise DataError(
                    f"{where}: {field!r} must be a non-empty string (the prompt is text), "
                    f"got {shown(row[field])}"
                )
        return row
    out = {"prompt": _messages(prompt, "prompt", where)}
    for field in ("chosen", "rejected"):
        if isinstance(row[field], str):
            raise DataError(
                f"{where}: {field!r} is a string but 'prompt' is messages: give "
                f'{field} as messages too ([{{"role": "assistant", "content": ...}}])'
            )
        out[field] = _messages(row[field], field, where)
        if not any(m["role"] == "assistant" and m["content"] for m in out[field]):
            raise DataError(f"{where}: {field!r} has no non-empty assistant message")
    return out


def read_rows(path: str | Path) -> list[tuple[int, dict]]:
    """(line number, row) of every row of a JSONL preference file, read as SFT rows are
    (``rows.iter_objects``) and checked (``check_row``)."""
    rows = [(i, check_row(row, where)) for i, row, where in iter_objects(path, "preference rows")]
    if len(rows) < 2:
        raise DataError(f"{path} has {len(rows)} row(s); at least 2 are needed (train and val)")
    return rows


class Encoder:
    """(ids, mask) of one sequence, prompt then completion, with a tokenizer: the built-in
    template, or an HF tokenizer's chat template (``template``, ``specials``)."""

    def __init__(self, tokenizer, template: str | None = None, specials: dict | None = None):
        self.tok, self.template, self.specials = tokenizer, template, specials or {}
        self.hf = getattr(tokenizer, "kind", "") == "hf"

    def _encode(self, text: str) -> list[int]:
        if not text:
            return []
        return self.tok.encode(text, add_special_tokens=False) if self.hf else self.tok.encode(text)

    def encodes(self, value) -> bool:
        """Whether the field ``value`` (a text or messages) encodes alone (which one a row's
        error is in)."""
        try:
            for text in [value] if isinstance(value, str) else [m["content"] for m in value]:
                self._encode(text)
        except (KeyError, ValueError):
            return False
        return True

    def pair(self, prompt, chosen, rejected) -> list[tuple[list[int], list[int]]]:
        """The (ids, mask) of the chosen and the rejected sequence: text rows as TRL tokenizes
        them (``sft.prompt_completion``: one prompt, where both part from it), message lists
        each as ``sequence``."""
        if isinstance(prompt, str):
            return prompt_completion(self.tok, prompt, [chosen, rejected])
        return [self.sequence(prompt, chosen), self.sequence(prompt, rejected)]

    def sequence(self, prompt, completion) -> tuple[list[int], list[int]]:
        """``prompt`` and ``completion`` both text or both message lists -> (ids, mask)."""
        if isinstance(prompt, str):
            return prompt_completion(self.tok, prompt, [completion])[0]
        if self.hf:
            return self._chat(prompt, completion)
        pieces = [(t, False) for t, _ in segments({"messages": prompt})]
        pieces += segments({"messages": completion})
        ids, mask = [], []
        for text, trained in pieces:
            piece = self._encode(text)
            ids += piece
            mask += [int(trained)] * len(piece)
        return ids, mask

    def _chat(self, prompt: list, completion: list) -> tuple[list[int], list[int]]:
        """Under the HF template: mask 1 on the completion's assistant replies alone."""
        if self.template is None:
            from llm_foundry.data.sft import NO_TEMPLATE

            raise ValueError(f"the tokenizer has no chat template to render messages with: "
                             f"{NO_TEMPLATE}")  # fmt: skip
        text, spans = response_spans(self.template, prompt + completion, **self.specials)
        spans = spans[sum(m["role"] == "assistant" for m in prompt) :]  # the completion's
        enc = self.tok.hf.encode(text, add_special_tokens=False)
        mask = [int(any(a <= start < b for a, b in spans)) for start, _ in enc.offsets]
        return list(enc.ids), mask


def prepare_preference(
    out_dir: str | Path, jsonl: str | Path, tokenizer_file: str | Path, val_fraction: float = 0.1
) -> dict:
    """Tokenize the preference rows of ``jsonl`` with the tokenizer in ``tokenizer_file`` (the
    model's own; an HF tokenizer's chat template beside it renders chat rows) into ``out_dir``;
    the last ``val_fraction`` of the pairs (at least one) are validation. Returns meta.json."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be strictly between 0 and 1; got {val_fraction}")
    out, jsonl, tokenizer_file = Path(out_dir), Path(jsonl), Path(tokenizer_file)
    rows = read_rows(jsonl)
    n_val = max(1, int(round(len(rows) * val_fraction)))
    if n_val >= len(rows):
        raise DataError(f"{jsonl} has {len(rows)} rows: val_fraction={val_fraction} leaves none "
                        "to train on; use a smaller val_fraction or more rows")  # fmt: skip
    # an HF tokenizer's chat template and special tokens: the files beside it (tokenizer_files)
    tok, carried = open_tokenizer(tokenizer_file)
    hf = getattr(tok, "kind", "") == "hf"
    template, specials = (carried.template, carried.tokens) if hf else (None, {})
    enc = Encoder(tok, template, specials)
    splits = {"train": rows[: len(rows) - n_val], "val": rows[len(rows) - n_val :]}
    encoded = {}
    for split, part in splits.items():
        seqs = []
        for line, row in part:
            try:
                seqs += enc.pair(row["prompt"], row["chosen"], row["rejected"])
            except (KeyError, ValueError) as e:
                field = next((f for f in ("prompt", "chosen", "rejected")
                              if not enc.encodes(row[f])), "prompt")  # fmt: skip
                raise DataError(f"{jsonl}, line {line}: {field!r} cannot be encoded by "
                                f"{tokenizer_file}: {e}") from None  # fmt: skip
        encoded[split] = seqs
    out.mkdir(parents=True, exist_ok=True)
    with lock.hold(out, "data directory", readers=True):
        return _write(out, jsonl, tokenizer_file, tok, encoded)


def _write(out: Path, jsonl: Path, tokenizer_file: Path, tok, encoded: dict) -> dict:
    """The encoded splits written under temporary names, then published with meta.json last."""
    dtype = token_dtype(tok.vocab_size)
    written, copy_tokenizer = temporaries(out, tokenizer_file)
    meta = dict(
        kind=KIND,
        source=str(jsonl.resolve()),
        sha256=hashlib.sha256(jsonl.read_bytes()).hexdigest(),
        dtype=np.dtype(dtype).name,
        vocab_size=tok.vocab_size,
        tokenizer_file="tokenizer.json",
    )
    try:
        for split, seqs in encoded.items():
            ids = [i for s, _ in seqs for i in s]
            np.asarray(ids, dtype=dtype).tofile(written[f"{split}.bin"])
            np.asarray([m for _, mk in seqs for m in mk], np.uint8).tofile(
                written[f"{split}.mask.bin"]
            )
            offsets = np.cumsum([0] + [len(s) for s, _ in seqs]).astype(np.int64)
            offsets.tofile(written[f"{split}.offsets.bin"])
            meta[f"{split}_tokens"], meta[f"{split}_pairs"] = len(ids), len(seqs) // 2
        return publish_prepared(out, written, meta, tokenizer_file, copy_tokenizer)
    finally:
        for tmp in written.values():
            tmp.unlink(missing_ok=True)


def is_preference(meta: dict) -> bool:
    """Whether a prepared directory's meta.json describes preference pairs."""
    return meta.get("kind") == KIND


class PreferenceSampler(BatchSampler):
    """Batches of preference pairs: x, y (2B, block_size), the B chosen sequences then the B
    rejected ones, y = IGNORE outside the completions (and on padding); and the pairs' indices in
    the split (B,), to look precomputed reference log-probabilities up by."""

    def __init__(self, data_dir: str | Path, split: str, block_size: int, batch_size: int,
                 seed: int = 0, *, rank: int = 0, world_size: int = 1):  # fmt: skip
        data_dir = Path(data_dir)
        with lock.sharing(data_dir):  # meta.json and the files it names: of one prepare
            meta = load_meta(data_dir)
            if not is_preference(meta):
                raise DataError(f"{data_dir} holds {prepared_kind(meta)}, not preference pairs "
                                f"(kind '{KIND}'); `finetune --task dpo --data ROWS.jsonl` "
                                "prepares them")  # fmt: skip
            if not isinstance(meta.get(f"{split}_pairs"), int):
                raise DataError(f"{data_dir / 'meta.json'} holds preference pairs without an "
                                f"integer '{split}_pairs' ({shown(meta.get(f'{split}_pairs'))}); "
                                "prepare them again")  # fmt: skip
            names = [f"{split}{k}.bin" for k in ("", ".mask", ".offsets")]
            names += ["tokenizer.json", *METADATA_FILES]
            check_files(data_dir, meta, names)
            n_tokens, self.pairs = meta[f"{split}_tokens"], meta[f"{split}_pairs"]
            tokens = open_tokens(data_dir / f"{split}.bin", meta["dtype"], n_tokens)
            self.mask = open_tokens(data_dir / f"{split}.mask.bin", np.uint8, n_tokens)
            offsets = open_tokens(data_dir / f"{split}.offsets.bin", np.int64, 2 * self.pairs + 1)
        super().__init__(tokens, 1, batch_size, seed, rank=rank, world_size=world_size)
        self.block_size, self.offsets, self.pad_id = block_size, np.asarray(offsets), 0
        # a sequence cut at block_size + 1 tokens must keep a target; else its pair is left out
        starts, ends = self.offsets[:-1], self.offsets[1:]
        csum = np.concatenate([[0], np.cumsum(np.asarray(self.mask, dtype=np.int64))])
        kept = csum[np.minimum(ends, starts + block_size + 1)] - csum[starts + 1] > 0  # (2P,)
        self.eligible = np.flatnonzero(kept[0::2] & kept[1::2])  # pair indices
        self.cut = int(np.sum(ends - starts > block_size + 1))
        self.dropped = self.pairs - len(self.eligible)
        if len(self.eligible) == 0:
            raise DataError(f"{data_dir} ({split}): no pair keeps a target in both sequences "
                            f"within block_size + 1 = {block_size + 1} tokens; raise "
                            "train.block_size or shorten the prompts")  # fmt: skip

    def rows(self, pairs: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """x, y (2 len(pairs), block_size) of ``pairs`` (pair indices): chosen rows, then
        rejected."""
        T = self.block_size
        seqs = [2 * int(i) for i in pairs] + [2 * int(i) + 1 for i in pairs]
        x = np.full((len(seqs), T), self.pad_id, dtype=np.int64)
        y = np.full((len(seqs), T), IGNORE, dtype=np.int64)
        for b, s in enumerate(seqs):
            start = int(self.offsets[s])
            end = min(int(self.offsets[s + 1]), start + T + 1)
            ids = np.asarray(self.data[start:end], dtype=np.int64)
            trained = np.asarray(self.mask[start + 1 : end], dtype=bool)
            x[b, : len(ids) - 1] = ids[:-1]
            y[b, : len(ids) - 1] = np.where(trained, ids[1:], IGNORE)
        return torch.from_numpy(x), torch.from_numpy(y)

    def next(self):
        """x, y (2B, T) and the pairs' indices (B,)."""
        B = self.batch_size
        draws = self.rng.integers(0, len(self.eligible), size=B * self.world_size)
        picks = self.eligible[draws[self.rank * B : (self.rank + 1) * B]]  # (B,)
        self.batches += 1
        return *self.rows(picks), torch.from_numpy(picks.astype(np.int64))

    __next__ = next
