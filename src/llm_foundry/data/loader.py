"""Training batches from prepared directories: random windows or packed documents over every
shard of a split, from one directory or a weighted mixture of several, built ahead in a thread.

Sources (``parse_sources``): ``DIR``, or ``a=0.7,b=0.3``: directories ``prepare`` wrote, each
with a weight > 0 (normalised to shares). A mixture's directories hold text (not SFT rows)
tokenized by one tokenizer (the same tokenizer.json bytes). Each row of a batch comes from one
source, drawn by share from the sampler's generator.

Windows (``train.data_sampling windows``): ``BatchSampler``'s draw over the source's shards: a
window number in [0, the valid starts of all its shards), mapped to (shard, offset) by
``batches.Windows``; a window never crosses a shard's end. With one source nothing else is
drawn, so a one-shard directory gives exactly the batches of a ``BatchSampler`` on its stream.

Packed (``packed``): a row is filled with whole documents (the shards' .idx indexes) one after
another, the last cut at the row's end (the rest of it unused). The documents come in a seeded
order: a permutation of all the source's documents per epoch, drawn from a generator of (seed,
source, epoch), so the position in it is two integers. With ``document_mask`` the row carries
document ids, the model keeps attention inside each document (as for SFT packing: the trainer
passes them as ``doc``), and no position targets the next document's first token.

Ranks: every rank draws and lays out the whole global batch (``batch_size * world_size`` rows)
and reads the tokens of its own rows only. The state (the generator, each source's epoch and
cursor) is the same on every rank and independent of the world size, so a checkpoint resumes on
any number of ranks with the same global batches. ``Prefetch`` builds the next batches in a
background thread; its ``state_dict()`` is that of the batches handed out, not of those built.
"""

from __future__ import annotations

import math
import queue
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from llm_foundry import lock
from llm_foundry.data.batches import (
    BatchSampler,
    Windows,
    check_files,
    data_fingerprint,
    load_meta,
    packed_row,
    tokenizer_sha256,
)
from llm_foundry.data.shards import document_starts, open_shard, split_shards
from llm_foundry.data.sources import DataError
from llm_foundry.messages import shown

SAMPLING = ("windows", "packed")  # what train.data_sampling accepts


# ----------------------------------------------------------------------------------------------
# Sources: one directory or a weighted mixture


@dataclass(frozen=True)
class Source:
    """A prepared directory of a run's data, its ``weight`` as given and a ``name`` for reports."""

    dir: Path
    weight: float = 1.0
    name: str = ""


def parse_sources(spec: str | Path | list) -> list[Source]:
    """The sources ``--data`` names: a directory, ``DIR=WEIGHT,DIR=WEIGHT,...``, or a list of
    ``Source``s or (dir, weight) pairs. An existing directory is one source whatever its name."""
    if isinstance(spec, (list, tuple)):
        pairs = [(s.dir, s.weight) if isinstance(s, Source) else s for s in spec]
        entries = [(str(d), Path(d), w) for d, w in pairs]
    else:
        text = str(spec)
        if not text.strip():
            raise DataError("--data is empty: give a directory `prepare` wrote, or DIR=W,DIR=W")
        if "=" not in text or Path(text).is_dir():
            return [Source(Path(text), 1.0, Path(text).name or text)]
        entries = []
        for entry in text.split(","):
            where, sep, w = entry.rpartition("=")
            if not sep or not where.strip():
                raise DataError(
                    f"--data entry {shown(entry, 200)}: expected DIR=WEIGHT (a mixture gives "
                    "every directory a weight)"
                )
            try:
                weight = float(w)
            except ValueError:
                weight = math.nan
            entries.append((entry, Path(where), weight if math.isfinite(weight) else w))
    if not entries:
        raise DataError("--data names no directory")
    seen: set[Path] = set()
    for entry, where, w in entries:
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not w > 0:
            raise DataError(
                f"--data entry {shown(entry, 200)}: the weight {shown(w)} must be a number > 0"
            )
        if where.resolve() in seen:
            raise DataError(
                f"--data entry {shown(entry, 200)}: {where} is named twice; give it once"
            )
        seen.add(where.resolve())
    names = [where.name or str(where) for _, where, _ in entries]
    if len(set(names)) < len(names):  # two directories of one name: their paths tell them apart
        names = [str(where) for _, where, _ in entries]
    return [Source(where, float(w), n) for (_, where, w), n in zip(entries, names, strict=True)]


def sources_text(sources: list[Source]) -> str:
    """``sources`` as ``--data`` takes them (what run.json records and a resume reads back)."""
    if len(sources) == 1:
        return str(sources[0].dir)
    return ",".join(f"{s.dir}={s.weight!r}" for s in sources)


def source_shares(sources: list[Source]) -> list[float]:
    """The sources' weights normalised to sum to 1."""
    total = sum(s.weight for s in sources)
    return [s.weight / total for s in sources]


def source_metas(sources: list[Source]) -> list[dict]:
    """Each source's meta.json; a mixture of directories holding fine-tuning rows or tokenized
    by different tokenizers is refused."""
    metas = [load_meta(s.dir) for s in sources]
    if len(sources) == 1:
        return metas
    for s, meta in zip(sources, metas, strict=True):
        if meta.get("kind") == "sft":
            raise DataError(
                f"--data: {s.dir} holds fine-tuning rows (prepare --sft); a mixture is of text "
                "directories: fine-tune on one directory"
            )
    shas = [tokenizer_sha256(s.dir, m) for s, m in zip(sources, metas, strict=True)]
    for s, sha in zip(sources[1:], shas[1:], strict=True):
        if sha != shas[0]:
            raise DataError(
                f"--data: {sources[0].dir} and {s.dir} were prepared with different tokenizers "
                f"(tokenizer.json sha256 {str(shas[0])[:12]} and {str(sha)[:12]}); a mixture's "
                "directories must share one tokenizer: prepare them with the same one"
            )
    return metas


def sources_fingerprint(sources: list[Source]) -> dict:
    """What identifies a run's data: ``batches.data_fingerprint`` of its one directory, or, for a
    mixture, the one tokenizer and each directory's fingerprint with its weight."""
    if len(sources) == 1:
        return data_fingerprint(sources[0].dir)
    prints = [data_fingerprint(s.dir) for s in sources]
    common = ("tokenizer_sha256", "vocab_size")
    return {
        **{k: prints[0][k] for k in common},
        "sources": [
            {**{k: v for k, v in p.items() if k not in common}, "weight": s.weight}
            for s, p in zip(sources, prints, strict=True)
        ],
    }


# ----------------------------------------------------------------------------------------------
# One split of one directory


class PreparedSplit:
    """One split of a prepared directory: its shards memory-mapped read-only, each checked
    against meta.json (size and digest) with the tokenizer; ``documents()`` reads where each
    document starts (for packing)."""

    def __init__(self, data_dir: str | Path, split: str):
        self.dir, self.split = Path(data_dir), split
        with lock.sharing(self.dir):  # meta.json and the files it names: of one prepare
            self.meta = load_meta(self.dir)
            check_files(self.dir, self.meta, [self.meta.get("tokenizer_file", "tokenizer.json")])
            self.shards = split_shards(self.dir, split, self.meta)
            self.tokens = [open_shard(self.dir, s, self.meta) for s in self.shards]
        one = len(self.shards) == 1  # named as BatchSampler names a token file
        self.name = f"token file {self.shards[0].path}" if one else f"{self.dir} ({split})"
        self._documents: Documents | None = None

    def documents(self) -> Documents:
        """Every document of the split, shard after shard (read once, then kept)."""
        if self._documents is None:
            starts = [document_starts(self.dir, s, self.meta) for s in self.shards]
            self._documents = Documents(starts)
            if len(self._documents) == 0:
                raise DataError(f"{self.name} holds no documents; prepare the corpus again")
        return self._documents


def split_stream(data_dir: str | Path, split: str) -> np.ndarray:
    """``split``'s tokens as one stream, shard after shard: the memmap itself where there is one
    shard (a directory from before shards too), else the shards joined in memory, a copy: for
    evaluating a validation split, not for reading a training corpus (``Loader`` reads that)."""
    tokens = PreparedSplit(data_dir, split).tokens
    return tokens[0] if len(tokens) == 1 else np.concatenate(tokens)


class Documents:
    """The documents of a corpus's shards: document i is ``length[i]`` tokens of shard
    ``shard[i]`` from ``start[i]``."""

    def __init__(self, starts: list[np.ndarray]):
        self.shard = np.concatenate(
            [np.full(len(s) - 1, k, np.int32) for k, s in enumerate(starts)]
        )
        self.start = np.concatenate([s[:-1] for s in starts])
        self.length = np.concatenate([np.diff(s) for s in starts])

    def __len__(self) -> int:
        return len(self.start)


# ----------------------------------------------------------------------------------------------
# The sampler


class Loader(BatchSampler):
    """Batches of the split that ``corpora`` (one per source) hold: random windows, or rows of
    packed documents (``packed``; with ``document_mask`` also their document ids), each row's
    source drawn by ``weights``. ``next()`` -> x, y (batch_size, block_size) int64 [, doc].
    ``main_rank``: this process logs the notes (``BatchSampler``)."""

    def __init__(
        self,
        corpora: list[PreparedSplit],
        weights: list[float] | None,
        block_size: int,
        batch_size: int,
        seed: int = 0,
        *,
        rank: int = 0,
        world_size: int = 1,
        packed: bool = False,
        document_mask: bool = True,
        main_rank: bool = True,
    ):
        if not corpora:
            raise ValueError("a Loader needs at least one corpus")
        weights = [1.0] * len(corpora) if weights is None else list(weights)
        if len(weights) != len(corpora) or not all(w > 0 for w in weights):
            raise ValueError(f"need one weight > 0 per corpus; got {weights} for {len(corpora)}")
        self._start(block_size, batch_size, seed, rank, world_size)  # BatchSampler's
        self.corpora, self.packed, self.document_mask = corpora, packed, document_mask
        total = sum(weights)
        self.cumulative = np.cumsum([w / total for w in weights])
        if packed:
            self.documents = [c.documents() for c in corpora]
            self.epoch, self.cursor = [0] * len(corpora), [0] * len(corpora)
            self.order_seed = seed  # kept in the state: a resume continues the same orders
            self._orders: dict[int, tuple[int, np.ndarray]] = {}
        else:  # BatchSampler.next draws the first source's windows
            self.tables = [Windows(c.tokens, block_size, c.name, main_rank) for c in corpora]
            self.windows = self.tables[0]

    def next(self) -> tuple[torch.Tensor, ...]:
        """x, y (batch_size, block_size); packed with document_mask: also doc, the document
        each position belongs to."""
        if self.packed:
            return self._packed()
        if len(self.corpora) == 1:  # exactly BatchSampler's draw
            return super().next()
        B, n = self.batch_size, self.batch_size * self.world_size
        src = self._row_sources(n)
        starts = np.zeros(n, dtype=np.int64)
        for k, table in enumerate(self.tables):
            rows = np.flatnonzero(src == k)
            starts[rows] = self.rng.integers(0, table.count, size=len(rows))
        mine = slice(self.rank * B, (self.rank + 1) * B)
        w = np.empty((B, self.block_size + 1), dtype=np.int64)
        for k in np.unique(src[mine]):
            rows = src[mine] == k
            w[rows] = self.tables[k].read(starts[mine][rows])
        self.batches += 1
        w = torch.from_numpy(w)
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    __next__ = next

    def _row_sources(self, n: int) -> np.ndarray:
        """The source of each of ``n`` rows, drawn by weight (nothing drawn for one source)."""
        if len(self.corpora) == 1:
            return np.zeros(n, dtype=np.int64)
        u = self.rng.random(n)
        return np.minimum(np.searchsorted(self.cumulative, u, side="right"), len(self.corpora) - 1)

    # packing ----------------------------------------------------------------------------------
    def _order(self, k: int) -> np.ndarray:
        """Source ``k``'s documents in the order of its current epoch."""
        epoch = self.epoch[k]
        if k not in self._orders or self._orders[k][0] != epoch:
            gen = np.random.Generator(np.random.PCG64([self.order_seed, k, epoch]))
            self._orders[k] = (epoch, gen.permutation(len(self.documents[k])))
        return self._orders[k][1]

    def _fill(self, k: int) -> list[tuple[int, int, int]]:
        """One row: (shard, start, length) pieces of source ``k``'s next documents, block_size + 1
        tokens in all (the last document cut), the cursor moved past them."""
        docs, need, pieces = self.documents[k], self.block_size + 1, []
        while need > 0:
            order, pos = self._order(k), self.cursor[k]
            ids = order[pos : pos + need]  # every document has a token: no more are needed
            cum = np.cumsum(docs.length[ids])
            j = int(np.searchsorted(cum, need))  # the document that fills the row, if here
            taken = ids[: j + 1]
            lengths = docs.length[taken].copy()
            if j < len(ids):
                lengths[-1] -= int(cum[j]) - need  # cut at the row's end
                self.cursor[k] = pos + j + 1
                need = 0
            else:
                need -= int(cum[-1]) if len(cum) else 0
                self.cursor[k] = pos + len(ids)
            pieces += zip(docs.shard[taken].tolist(), docs.start[taken].tolist(),
                          lengths.tolist(), strict=True)  # fmt: skip
            if self.cursor[k] >= len(order):  # the epoch is done: the next order begins
                self.epoch[k], self.cursor[k] = self.epoch[k] + 1, 0
        return pieces

    def _packed(self) -> tuple[torch.Tensor, ...]:
        B, T = self.batch_size, self.block_size
        src = self._row_sources(B * self.world_size)
        rows = [(k, self._fill(int(k))) for k in src]  # every rank lays out every row
        x = np.empty((B, T), dtype=np.int64)
        y = np.empty((B, T), dtype=np.int64)
        d = np.empty((B, T), dtype=np.int64)
        for b, (k, pieces) in enumerate(rows[self.rank * B : (self.rank + 1) * B]):
            tokens = self.corpora[k].tokens
            ids = np.concatenate([tokens[s][a : a + n] for s, a, n in pieces]).astype(np.int64)
            doc = np.repeat(np.arange(len(pieces)), [n for _, _, n in pieces])
            if self.document_mask:
                x[b], y[b], d[b] = packed_row(ids, doc)
            else:  # one stream, as windows would read it
                x[b], y[b] = ids[:-1], ids[1:]
        self.batches += 1
        if not self.document_mask:
            return torch.from_numpy(x), torch.from_numpy(y)
        return torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(d)

    # state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The generator's state (``BatchSampler.state_dict``); packed, also each source's
        [epoch, cursor] in its document order, and the seed of those orders."""
        state = super().state_dict()
        if self.packed:
            state["documents"] = [[e, c] for e, c in zip(self.epoch, self.cursor, strict=True)]
            state["order_seed"] = str(self.order_seed)  # a string, as the generator's state
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if not self.packed:
            return
        where = state.get("documents")
        if where is None:  # saved by a run that drew windows: its documents start at the top
            where = [[0, 0]] * len(self.corpora)
        if len(where) != len(self.corpora):
            raise DataError(
                f"sampler state holds document positions of {len(where)} source(s); this run "
                f"reads {len(self.corpora)}"
            )
        for k, (epoch, cursor) in enumerate(where):
            if not (isinstance(epoch, int) and epoch >= 0 and 0 <= cursor < len(self.documents[k])):
                raise DataError(
                    f"sampler state: document position {[epoch, cursor]} is outside "
                    f"{self.corpora[k].name}'s {len(self.documents[k]):,} documents"
                )
        self.epoch = [int(e) for e, _ in where]
        self.cursor = [int(c) for _, c in where]
        self.order_seed = int(state.get("order_seed", self.seed))


# ----------------------------------------------------------------------------------------------
# Prefetch


class Prefetch:
    """``sampler``'s batches built ahead (``depth`` of them) by a background thread, handed out in
    order by ``next()``. ``state_dict()`` is the sampler's state after the last batch handed out;
    ``close()`` stops the thread and puts the sampler back to that state. An error in the thread
    is raised by the ``next()`` that would have returned its batch."""

    def __init__(self, sampler: BatchSampler, depth: int = 2):
        self.sampler = sampler
        self.consumed = sampler.state_dict()
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, name="llm-foundry-prefetch",
                                        daemon=True)  # fmt: skip
        self._thread.start()

    def _work(self) -> None:
        while not self._stop.is_set():
            try:
                item = (self.sampler.next(), self.sampler.state_dict(), None)
            except BaseException as e:  # handed to the consumer, which raises it
                item = (None, None, e)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.05)
                    break
                except queue.Full:
                    continue
            if item[2] is not None:
                return

    def next(self) -> tuple[torch.Tensor, ...]:
        while True:
            try:
                batch, state, error = self._queue.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive():  # it may have put its error just now
                    try:
                        batch, state, error = self._queue.get_nowait()
                        break
                    except queue.Empty:
                        raise RuntimeError("the prefetch thread stopped") from None
        if error is not None:
            raise error
        self.consumed = state
        return batch

    __next__ = next

    def state_dict(self) -> dict:
        return self.consumed

    def close(self) -> None:
        """Stop the thread (it finishes the batch it is building) and rewind the sampler to the
        batches handed out."""
        self._stop.set()
        self._thread.join()
        while not self._queue.empty():
            self._queue.get_nowait()
        self.sampler.load_state_dict(self.consumed)

    def __enter__(self) -> Prefetch:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
