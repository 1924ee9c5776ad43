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
  tokenizer.json, meta.json           the tokenizer used; meta.json with "kind": "sft" and
                                      each file's size and check digest ("files")
  tokenizer_config.json, ...          an HF tokenizer's chat template and special tokens, as
                                      they were beside it (``tokenizer_files``): checkpoints
                                      trained on the rows carry them on

It streams: the rows are read one line at a time (twice: checked and counted, then encoded) and
the tokens written as they come, so memory stays flat whatever the file's size. Lines end at
``\n`` only (a U+2028 or U+0085 inside a string is text). A row that holds both formats, a key
twice, or bytes that are not UTF-8 is refused with its file and line. The output appears as text
``prepare``'s does (``llm_foundry.data.encode``): written under temporary names, meta.json removed,
the files renamed into place, meta.json written last; the directory is locked while it is
written and refused while a fine-tune reads it.

``SFTSampler`` draws whole examples (seeded, resumable like ``BatchSampler``), cut to
block_size + 1 tokens and padded; padding and prompt tokens get the target -100 (ignored).
Examples cut so that no target is left are not drawn (``cut`` and ``dropped`` count them).
With ``pack`` a row holds several whole examples one after another, with a document id per
position (the model keeps attention inside each document) and no target across a boundary.
"""

from __future__ import annotations

import hashlib
import json
import numbers
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from llm_foundry import lock
from llm_foundry.chat import response_spans
from llm_foundry.data.batches import (
    IGNORE,
    BatchSampler,
    check_files,
    file_entry,
    load_meta,
    open_tokens,
    packed_row,
)
from llm_foundry.data.encode import token_dtype
from llm_foundry.data.rows import iter_objects
from llm_foundry.data.shard_writer import prepared_before, same_or_refused
from llm_foundry.data.sources import (
    DataError,
    publish,
    refuse_overwriting_inputs,
    remove_temporaries,
    temporary,
)
from llm_foundry.messages import shown
from llm_foundry.tokenizer_files import METADATA_FILES, metadata_files, open_tokenizer

ROLES = ("system", "user", "assistant")
TOKEN_FILES = tuple(f"{s}.{k}bin" for s in ("train", "val") for k in ("", "mask.", "offsets."))
OUTPUTS = (*TOKEN_FILES, "tokenizer.json", "meta.json")
FLUSH_TOKENS = 1 << 16  # tokens buffered per split before they are written

# what to do about chat rows for a tokenizer without a template (serve and generate --chat fall
# back to a plain 'ROLE: content' one, which a fine-tune would then not have been trained on)
NO_TEMPLATE = ("add the model's chat template as chat_template.jinja beside tokenizer.json "
               "(serve and generate --chat use it too), or write the rows as prompt/completion "
               "text")  # fmt: skip


def iter_rows(path: str | Path, digest=None) -> Iterator[tuple[int, dict]]:
    """(line number, row) of every row of a JSONL file of SFT rows, checked (see ``read_rows``);
    ``digest`` (a hashlib object) is fed every byte read."""
    for i, row, where in iter_objects(path, "SFT rows", digest):
        _check_row(row, where)
        yield i, row


def read_rows(path: str | Path) -> list[dict]:
    """Every row of a JSONL file, checked: a JSON object with a non-empty ``prompt`` and
    ``completion``, or ``messages`` with known roles, string contents and an assistant turn
    (not both)."""
    rows = [row for _, row in iter_rows(path)]
    if not rows:
        raise DataError(f"{path} holds no rows; expected JSON objects, one a line")
    return rows


def _check_row(row: dict, where: str) -> None:
    both = [k for k in ("prompt", "completion") if k in row]
    if "messages" in row and both:
        raise DataError(
            f"{where}: has both 'messages' and {' and '.join(map(repr, both))}; a row is "
            '{"prompt": ..., "completion": ...} or {"messages": [...]}, not both (one would be '
            "dropped): split it into two rows"
        )
    if "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise DataError(f"{where}: 'messages' must be a non-empty list")
        check_messages(msgs, "messages", where)
        if not any(m["role"] == "assistant" and m["content"] for m in msgs):
            raise DataError(f"{where}: no non-empty assistant message: nothing to learn from")
        return
    if "completion" not in row and {"chosen", "rejected"} <= set(row):
        raise DataError(f"{where}: a preference row (prompt, chosen, rejected), not a fine-tuning "
                        "row: DPO takes the file as it is (`llm-foundry finetune --task dpo "
                        "--data FILE`)")  # fmt: skip
    for field in ("prompt", "completion"):
        if not isinstance(row.get(field), str):
            raise DataError(
                f"{where}: missing or non-string {field!r}; a row is "
                '{"prompt": ..., "completion": ...} or {"messages": [...]}'
            )
    if not row["completion"]:
        raise DataError(f"{where}: 'completion' is empty: nothing to learn from")


def check_messages(msgs: list, field: str, where: str) -> None:
    """Each message of ``msgs`` (the row's ``field``) an object with a role of ``ROLES`` and
    string content; a DataError naming ``where`` and the message otherwise."""
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise DataError(
                f"{where}: {field}[{j}] needs a 'role' of {', '.join(ROLES)}; got {shown(m)}"
            )
        if not isinstance(m.get("content"), str):
            raise DataError(f"{where}: {field}[{j}].content must be a string")


def segments(row: dict) -> list[tuple[str, bool]]:
    """The row as text pieces in the built-in template, each marked True if it is a target."""
    if "messages" not in row:
        return [(row["prompt"], False), (row["completion"], True)]
    out = []
    for m in row["messages"]:
        trained = m["role"] == "assistant"
        out += [(f"{m['role'].upper()}: ", False), (m["content"] + "\n", trained)]
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def prompt_completion(tokenizer, prompt: str, completions: list[str]) -> list[tuple[list, list]]:
    """(ids, mask) of ``prompt`` followed by each of ``completions``, as TRL tokenizes text rows:
    prompt and prompt + completion each encoded whole, as ``generate`` encodes a prompt (an HF
    tokenizer's BOS included), the completion starting where the two part (the prompt's ids
    shared by every completion); the tokenizer's end-of-sequence id, if it has one, ends each as
    a target. (Encoded alone, a completion would start with a token running text never has: a
    sentencepiece tokenizer puts a space before every text it encodes.)"""
    p = tokenizer.encode(prompt) if prompt else []
    wholes = [tokenizer.encode(prompt + c) for c in completions]
    n = min(common_prefix(p, w) for w in wholes)
    eos = [tokenizer.eos_id] if getattr(tokenizer, "eos_id", None) is not None else []
    return [(w + eos, [0] * n + [1] * (len(w) - n + len(eos))) for w in wholes]


def encode_row(tokenizer, row: dict) -> tuple[list[int], list[int]]:
    """(ids, mask) of one row: a prompt/completion row as ``prompt_completion`` encodes it; a
    chat row's pieces each encoded alone, mask 1 on target tokens; the tokenizer's
    end-of-sequence id, if it has one, ends the example as a target."""
    if "messages" not in row:
        return prompt_completion(tokenizer, row["prompt"], [row["completion"]])[0]
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
    characters each reply adds to the rendering). A prompt/completion row as TRL tokenizes it
    (``prompt_completion``)."""
    if "messages" not in row:
        return prompt_completion(tokenizer, row["prompt"], [row["completion"]])[0]
    text, spans = response_spans(template, row["messages"], **specials)
    enc = tokenizer.hf.encode(text, add_special_tokens=False)
    mask = [int(any(a <= start < b for a, b in spans)) for start, _ in enc.offsets]
    return list(enc.ids), mask


class _SplitWriter:
    """One split's three files, written as the examples come (tokens buffered a little)."""

    def __init__(self, paths: dict[str, Path], dtype: np.dtype):
        self.files = {k: open(p, "wb") for k, p in paths.items()}  # noqa: SIM115 - closed by close
        self.dtype = dtype
        self.ids: list[int] = []
        self.mask = bytearray()
        self.offsets = [0]
        self.tokens = self.examples = self.targets = 0

    def add(self, ids: list[int], mask: list[int]) -> None:
        self.ids += ids
        self.mask += bytes(mask)
        self.tokens += len(ids)
        self.examples += 1
        self.targets += sum(mask)
        self.offsets.append(self.tokens)
        if len(self.ids) >= FLUSH_TOKENS:
            self.flush()

    def flush(self) -> None:
        np.asarray(self.ids, dtype=self.dtype).tofile(self.files["tokens"])
        self.files["mask"].write(self.mask)
        np.asarray(self.offsets, dtype=np.int64).tofile(self.files["offsets"])
        self.ids, self.mask, self.offsets = [], bytearray(), []

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def sft_settings(tokenizer_file: str | Path, val_fraction: float) -> dict:
    """What besides its rows makes a prepared SFT directory what it is (meta.json's
    ``settings``): the validation fraction and the tokenizer's files, by digest."""
    tokenizer_file = Path(tokenizer_file)
    files = [
        tokenizer_file,
        *(tokenizer_file.parent / n for n in metadata_files(tokenizer_file.parent)),
    ]
    return {
        "val_fraction": val_fraction,
        "tokenizer": {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files},
    }


def check_sft_prepared(out: Path, rows_sha256: str, settings: dict) -> None:
    """Before SFT rows are prepared in ``out``: ``AlreadyPrepared`` when it holds a complete
    prepare of the same rows (their bytes' sha256) and ``settings``; a one-line DataError
    naming what differs and --restart when it holds another (of any kind); nothing when none."""
    meta = prepared_before(Path(out), "sft", "settings", "the settings it was prepared with")
    if meta is not None:
        same_or_refused(out, meta, rows_sha256, settings, "the rows'", "other rows")


def prepare_sft(
    out_dir: str | Path,
    jsonl: str | Path,
    tokenizer_file: str | Path,
    val_fraction: float = 0.1,
    restart: bool = False,
) -> dict:
    """Tokenize the rows of ``jsonl`` with the tokenizer in ``tokenizer_file`` (the model's own;
    an HF tokenizer's chat template beside it, in ``tokenizer_config.json``, renders the chats)
    into ``out_dir``; the last ``val_fraction`` of the rows (at least one) are validation. A
    directory that holds a complete prepare already: the same rows and settings are nothing to
    do (``AlreadyPrepared``), others refused (``restart``: prepared anew)."""
    if (
        isinstance(val_fraction, bool)
        or not isinstance(val_fraction, numbers.Real)
        or not 0 < val_fraction < 1
    ):
        raise ValueError(
            f"val_fraction must be strictly between 0 and 1; got {shown(val_fraction)}"
        )
    if not str(out_dir).strip():
        raise ValueError("the output directory (--out) is empty: give a directory to write")
    out, jsonl, tokenizer_file = Path(out_dir), Path(jsonl), Path(tokenizer_file)
    if out.exists() and not out.is_dir():
        raise ValueError(f"output directory {out} is a file; give a directory to write")
    refuse_overwriting_inputs([("the SFT rows file", jsonl)], out, OUTPUTS)
    # the model's tokenizer may be the one already there (it is then kept as it is)
    refuse_overwriting_inputs(
        [("the tokenizer file", tokenizer_file)], out, [o for o in OUTPUTS if o != "tokenizer.json"]
    )
    # an HF tokenizer's chat template and special tokens: the files beside it (tokenizer_files)
    tok, carried = open_tokenizer(tokenizer_file)
    hf = getattr(tok, "kind", "") == "hf"
    template, specials = (carried.template, carried.tokens) if hf else (None, {})
    # first pass: every row checked and counted before anything is written
    digest, n_rows, chats = hashlib.sha256(), 0, False
    for _, row in iter_rows(jsonl, digest):
        n_rows += 1
        chats = chats or "messages" in row
    if n_rows < 2:
        raise DataError(f"{jsonl} has {n_rows} row(s); at least 2 are needed (train and val)")
    if hf and template is None and chats:
        raise DataError(
            f"{tokenizer_file.parent} has no chat template (tokenizer_config.json "
            f"chat_template or chat_template.jinja) to render the chat rows with: {NO_TEMPLATE}"
        )
    n_val = max(1, int(round(n_rows * val_fraction)))
    if n_val >= n_rows:
        raise DataError(
            f"{jsonl} has {n_rows} rows: val_fraction={val_fraction} leaves none to train on; "
            "use a smaller val_fraction or more rows"
        )

    def encode(row):
        if hf:
            return encode_chat(tok, template, specials, row)
        return encode_row(tok, row)

    settings = sft_settings(tokenizer_file, val_fraction)
    created = not out.exists()
    with lock.hold(out, "data directory", readers=True):
        if not restart:  # under the lock: one may have completed since
            check_sft_prepared(out, digest.hexdigest(), settings)
        try:
            return _write_sft(out, jsonl, tokenizer_file, tok, encode, n_rows - n_val, digest,
                              settings)  # fmt: skip
        except BaseException:
            if created:  # leave no directory behind a refused input
                shutil.rmtree(out, ignore_errors=True)
            raise


def _write_sft(out, jsonl, tokenizer_file, tok, encode, n_train, first_digest, settings) -> dict:
    """The second pass, under the directory's lock: rows encoded into temporary files, then
    published (``sources.publish``)."""
    dtype = token_dtype(tok.vocab_size)
    written, copy_tokenizer = temporaries(out, tokenizer_file)
    writers = {}
    try:
        for split in ("train", "val"):
            paths = {k: written[f"{split}.{k}bin"] for k in ("", "mask.", "offsets.")}
            writers[split] = _SplitWriter(
                {"tokens": paths[""], "mask": paths["mask."], "offsets": paths["offsets."]}, dtype
            )
        digest, n = hashlib.sha256(), 0
        for line, row in iter_rows(jsonl, digest):
            try:
                ids, mask = encode(row)
            except (KeyError, ValueError) as e:
                raise DataError(
                    f"{jsonl}, line {line}: cannot be encoded by {tokenizer_file}: {e}"
                ) from None
            writers["train" if n < n_train else "val"].add(ids, mask)
            n += 1
        if digest.hexdigest() != first_digest.hexdigest():
            raise DataError(f"{jsonl} changed while it was being read; run prepare again")
        for w in writers.values():
            w.flush()
            w.close()
        meta = dict(
            kind="sft",
            source=str(jsonl.resolve()),
            sha256=digest.hexdigest(),
            dtype=np.dtype(dtype).name,
            vocab_size=tok.vocab_size,
            tokenizer_file="tokenizer.json",
            settings=settings,
        )
        for split, w in writers.items():
            meta[f"{split}_tokens"] = w.tokens
            meta[f"{split}_examples"] = w.examples
            meta[f"{split}_targets"] = w.targets
        return publish_prepared(out, written, meta, tokenizer_file, copy_tokenizer)
    finally:
        for w in writers.values():
            w.close()
        for tmp in written.values():
            tmp.unlink(missing_ok=True)


def temporaries(out: Path, tokenizer_file: Path) -> tuple[dict, bool]:
    """(name -> temporary path of each file a prepared directory gets, whether the tokenizer is
    copied in: not when it is ``out``'s own already); earlier runs' leftovers removed first.
    The tokenizer comes with the files beside it that carry its chat template and special
    tokens (``tokenizer_files``), so that a model fine-tuned on the rows chats as they read."""
    remove_temporaries(out, [*OUTPUTS, *METADATA_FILES])
    written = {name: temporary(out / name) for name in TOKEN_FILES}
    copy_tokenizer = tokenizer_file.resolve() != (out / "tokenizer.json").resolve()
    if copy_tokenizer:
        for name in ("tokenizer.json", *metadata_files(tokenizer_file.parent)):
            written[name] = temporary(out / name)
    return written, copy_tokenizer


def publish_prepared(out: Path, written: dict, meta: dict, tokenizer_file: Path,
                     copy_tokenizer: bool) -> dict:  # fmt: skip
    """The tokenizer and its metadata files copied in (unless they are ``out``'s already; an
    earlier tokenizer's metadata removed by ``publish``, once meta.json is gone), every file's
    size and digest recorded in ``meta``, the directory published (meta.json last); returns
    ``meta``."""
    kept = [] if copy_tokenizer else ["tokenizer.json", *metadata_files(out)]
    stale = []  # another tokenizer's, from an earlier prepare into ``out``
    if copy_tokenizer:
        shutil.copyfile(tokenizer_file, written["tokenizer.json"])
        for name in METADATA_FILES:
            if name in written:
                shutil.copyfile(tokenizer_file.parent / name, written[name])
            else:
                stale.append(name)
    meta["files"] = {name: file_entry(tmp) for name, tmp in written.items()}
    meta["files"].update({name: file_entry(out / name) for name in kept})
    publish(out, written, json.dumps(meta, indent=2) + "\n", removed=stale)
    return meta


def longest_sequence(data_dir: str | Path, split: str = "train") -> int | None:
    """Tokens in the longest sequence of ``split`` in a directory of examples (kind 'sft') or
    of preference pairs (kind 'preference': the same offsets file); None for other data."""
    data_dir = Path(data_dir)
    meta = load_meta(data_dir)
    if meta.get("kind") not in ("sft", "preference"):
        return None
    with lock.sharing(data_dir):
        check_files(data_dir, meta, [f"{split}.offsets.bin"])
        offsets = np.fromfile(data_dir / f"{split}.offsets.bin", dtype=np.int64)
    return int(np.diff(offsets).max()) if len(offsets) > 1 else None


class SFTSampler(BatchSampler):
    """Batches of whole examples: x, y (batch_size, block_size), y = IGNORE where the next token
    is prompt, template or padding; examples longer than block_size + 1 tokens are cut. With
    ``pack``: rows of several examples and their document ids (batch_size, block_size)."""

    def __init__(self, data_dir: str | Path, split: str, block_size: int, batch_size: int,
                 seed: int = 0, *, rank: int = 0, world_size: int = 1,
                 pack: bool = False):  # fmt: skip
        data_dir = Path(data_dir)
        with lock.sharing(data_dir):  # meta.json and the files it names: of one prepare
            meta = load_meta(data_dir)
            need = [f"{split}_tokens", f"{split}_examples"]
            if meta.get("kind") != "sft" or any(not isinstance(meta.get(k), int) for k in need):
                raise DataError(
                    f"{data_dir / 'meta.json'} is not fine-tuning data (kind 'sft' with {need}); "
                    "prepare it with `llm-foundry prepare --sft`"
                )
            names = [f"{split}{k}.bin" for k in ("", ".mask", ".offsets")]
            names += ["tokenizer.json", *METADATA_FILES]
            check_files(data_dir, meta, names)
            n_tokens, n = meta[f"{split}_tokens"], meta[f"{split}_examples"]
            tokens = open_tokens(data_dir / f"{split}.bin", meta["dtype"], n_tokens)
            self.mask = open_tokens(data_dir / f"{split}.mask.bin", np.uint8, n_tokens)
            offsets = open_tokens(data_dir / f"{split}.offsets.bin", np.int64, n + 1)
        super().__init__(tokens, 1, batch_size, seed, rank=rank, world_size=world_size)
        self.block_size = block_size
        self.offsets = np.asarray(offsets)
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
            x[b], y[b], d[b] = packed_row(np.array(ids), np.array(doc), np.array(mask, dtype=bool))
        self.batches += 1
        return torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(d)

    __next__ = next
