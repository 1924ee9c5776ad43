"""Shards shorter than a window are never sampled: a note names them and what they hold
(data/batches.py ``Windows``)."""

from __future__ import annotations

import json

import numpy as np

from llm_foundry.data.batches import Windows
from llm_foundry.data.documents import prepare_documents
from llm_foundry.data.loader import Loader, PreparedSplit


def shard(path, n: int) -> np.memmap:
    np.arange(n, dtype=np.uint16).tofile(path)
    return np.memmap(path, dtype=np.uint16, mode="r")


def test_a_shard_shorter_than_a_window_is_named_in_one_note(tmp_path, notes):
    arrays = [shard(tmp_path / "train_00000.bin", 100), shard(tmp_path / "train_00001.bin", 16)]
    w = Windows(arrays, 16, "d (train)")  # windows of 17 tokens
    assert w.count == 100 - 16 and w.unused == [("train_00001.bin", 16)]
    assert set(w.locate(np.arange(w.count))[0]) == {0}  # no window starts in the short one
    assert notes == [
        "note: d (train): shard train_00001.bin (16 tokens) is shorter than a window of "
        "block_size + 1 = 17 tokens, so never sampled"
    ]
    notes.clear()
    Windows(arrays, 15, "d (train)")  # 16 tokens hold one window of 16: sampled
    assert notes == []
    more = arrays + [shard(tmp_path / f"train_0000{k}.bin", k) for k in (2, 3, 4, 5)]
    Windows(more, 16, "d (train)")
    assert notes == [
        "note: d (train): 5 shards (30 tokens in all: train_00001.bin (16), train_00002.bin (2), "
        "train_00003.bin (3), and 2 more) are shorter than a window of block_size + 1 = 17 "
        "tokens, so never sampled"
    ]


def test_the_note_is_said_by_the_main_rank_only_and_returned_on_every_rank(
    tmp_path, notes, monkeypatch
):
    """Whether to log is the caller's word, not the environment's: an empty RANK (int('')
    raised) changes nothing."""
    arrays = [shard(tmp_path / "a.bin", 100), shard(tmp_path / "b.bin", 3)]
    monkeypatch.setenv("RANK", "")
    quiet = Windows(arrays, 16, "d (train)", main_rank=False)
    assert quiet.unused == [("b.bin", 3)] and notes == []
    assert quiet.note.startswith("note: d (train): shard b.bin (3 tokens) is shorter")
    Windows(arrays, 16, "d (train)")
    assert notes == [quiet.note]


def test_a_prepared_corpus_whose_last_shard_is_short_says_so_when_a_loader_opens_it(
    tmp_path, notes
):
    rows = "".join(
        json.dumps({"text": f"document {i}: " + "some words again and again " * (i % 9 + 1)}) + "\n"
        for i in range(300)
    )
    (tmp_path / "a.jsonl").write_text(rows)
    prepare_documents(tmp_path / "d", [tmp_path / "a.jsonl"], vocab_size=300,
                      shard_tokens=4000, progress=False)  # fmt: skip
    split = PreparedSplit(tmp_path / "d", "train")
    sizes = [len(t) for t in split.tokens]
    assert len(sizes) > 2 and sizes[-1] < min(sizes[:-1])  # closed at the end, not at 4000
    block = sizes[-1]  # the last shard is one token short of a window
    Loader([split], None, block, 2, main_rank=False)  # another torchrun rank: silent
    assert notes == []
    Loader([split], None, block, 2)
    assert notes == [
        f"note: {tmp_path / 'd'} (train): shard {split.shards[-1].path.name} ({sizes[-1]:,} "
        f"tokens) is shorter than a window of block_size + 1 = {block + 1:,} tokens, so never "
        "sampled"
    ]

    # through the trainer's builder: only world rank 0 says it (under TP, ranks 0 and 1 share
    # data-parallel rank 0, so the data-parallel rank cannot decide)
    from dataclasses import replace

    from llm_foundry.data.loader import Source
    from llm_foundry.train.build import build_sampler
    from llm_foundry.train.config import TrainConfig
    from llm_foundry.train.distributed import World

    notes.clear()
    tc = replace(TrainConfig(), block_size=block, batch_size=2)
    sources = [Source(tmp_path / "d", 1.0)]
    build_sampler(sources, "train", tc, 0, World(rank=1, world_size=2, tp=2), corpora=[split])
    assert notes == []
    build_sampler(sources, "train", tc, 0, World(rank=0, world_size=2, tp=2), corpora=[split])
    assert len(notes) == 1 and "is shorter than a window" in notes[0]
