"""Document corpora (``prepare --input``): every format reads back the documents written, the
shards decode back to them (each followed by the end-of-text id), the same bytes whatever the
number of workers, resumption after an interruption to the bytes of an uninterrupted run, whole
validation documents (by fraction and by source), and one-line errors for bad inputs."""

from __future__ import annotations

import gzip
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import cli_status

from llm_foundry.data import DataError
from llm_foundry.data import corpus as corpus_mod
from llm_foundry.data import documents as documents_mod
from llm_foundry.data.batches import load_meta
from llm_foundry.data.corpus import draw_sample, read_records, resolve_inputs
from llm_foundry.data.documents import prepare_documents
from llm_foundry.data.shard_writer import AlreadyPrepared
from llm_foundry.data.shards import document_starts, open_shard, split_shards
from llm_foundry.tokenizer import CHAT_TOKENS, BPETokenizer, load_tokenizer

WORDS = (
    "the of and to in is was he for it with as his on be at by had but not are this which "
    "they from or one all were we when there can an been has more if will would its who "
    "café naïve 東京 🙂 Ωmega <eos> <|im_start|>"
).split()


def make_docs(n: int, seed: int = 0, longest: int = 120) -> list[str]:
    """``n`` documents of 1..``longest`` words, some over several lines, some with UTF-8 of
    2 to 4 bytes and special tokens' names written as text."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(1, longest))]
        for k in range(0, len(words), 17):
            words[k] = words[k] + rng.choice(["", ",", ".\n", "\n\n", "  "])
        docs.append(" ".join(words))
    return docs


def write(path: Path, docs: list[str], fmt: str, field: str = "text") -> Path:
    """``docs`` written as ``fmt``: txt (a directory, one file each), jsonl, jsonl.gz,
    jsonl.zst, parquet (row groups of 7 rows), datasets (a saved Dataset), datasetdict."""
    rows = "".join(json.dumps({"id": i, field: d}) + "\n" for i, d in enumerate(docs))
    if fmt == "txt":
        path.mkdir(parents=True)
        for i, d in enumerate(docs):
            (path / f"doc{i:04d}.txt").write_text(d, encoding="utf-8")
    elif fmt == "jsonl":
        path.write_text(rows, encoding="utf-8")
    elif fmt == "jsonl.gz":
        path.write_bytes(gzip.compress(rows.encode()))
    elif fmt == "jsonl.zst":
        import zstandard

        path.write_bytes(zstandard.ZstdCompressor().compress(rows.encode()))
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(
            pa.table({"id": list(range(len(docs))), field: docs}), path, row_group_size=7
        )
    else:
        import datasets

        ds = datasets.Dataset.from_dict({"id": list(range(len(docs))), field: docs})
        if fmt == "datasetdict":
            ds = datasets.DatasetDict({"train": ds.select(range(3)), "other": ds})
        ds.save_to_disk(str(path))
    return path


NAMES = {"txt": "docs", "jsonl": "a.jsonl", "jsonl.gz": "a.jsonl.gz", "jsonl.zst": "a.jsonl.zst",
         "parquet": "a.parquet", "datasets": "saved", "datasetdict": "saved_dict"}  # fmt: skip


def texts(groups, start=(0, 0), **kw) -> list[str]:
    return [r.text for r in read_records(groups, start, **kw) if r.kind == "doc"]


@pytest.mark.parametrize("fmt", list(NAMES))
def test_every_format_reads_back_the_documents_written(tmp_path, fmt):
    docs = make_docs(23, seed=1)
    path = write(tmp_path / NAMES[fmt], docs, fmt)
    split = "other" if fmt == "datasetdict" else None
    groups = resolve_inputs([path], split=split)
    assert texts(groups) == docs
    # from any record on: what an interrupted prepare reads when it resumes
    files = [f for g in groups for f in g.files]
    if fmt == "txt":
        assert len(files) == 23 and texts(groups, (5, 0)) == docs[5:]
    else:
        assert len(files) == 1 and texts(groups, (0, 9)) == docs[9:]
    if fmt == "datasetdict":  # its train split by default
        assert texts(resolve_inputs([path])) == docs[:3]


def test_globs_and_directories_read_in_name_order(tmp_path):
    docs = make_docs(9, seed=2)
    write(tmp_path / "b.jsonl", docs[3:6], "jsonl")
    write(tmp_path / "a.jsonl", docs[:3], "jsonl")
    sub = tmp_path / "sub"
    write(sub, docs[6:], "txt")
    (sub / "README.md").write_text("not read")
    (sub / ".hidden.txt").write_text("not read either")
    groups = resolve_inputs([str(tmp_path / "*.jsonl"), sub])
    assert texts(groups) == docs
    with pytest.raises(DataError, match=r"is named twice \(by .*\*\.jsonl' and .*a\.jsonl'\)"):
        resolve_inputs([str(tmp_path / "*.jsonl"), str(tmp_path / "a.jsonl")])


# ----------------------------------------------------------------------------------------------
# Shards


def read_back(out: Path) -> dict[str, list[list[int]]]:
    """Every document of each split as ids, through data/shards.py's reader."""
    meta = load_meta(out)
    docs = {}
    for split in ("train", "val"):
        docs[split] = []
        for shard in split_shards(out, split, meta):
            tokens = open_shard(out, shard, meta)
            starts = document_starts(out, shard, meta)
            docs[split] += [list(tokens[a:b]) for a, b in zip(starts[:-1], starts[1:], strict=True)]
    return docs


def is_val(i: int, f: float = 0.1) -> bool:
    from fractions import Fraction

    f = Fraction(repr(f))
    return (i + 1) * f // 1 > i * f // 1


def test_shards_decode_back_to_the_documents_each_ended_by_eot(tmp_path):
    docs = make_docs(200, seed=3)
    write(tmp_path / "a.jsonl.gz", docs[:120], "jsonl.gz")
    write(tmp_path / "b.parquet", docs[120:], "parquet")
    out = tmp_path / "d"
    meta = prepare_documents(out, [tmp_path / "a.jsonl.gz", tmp_path / "b.parquet"],
                             vocab_size=400, shard_tokens=3000, progress=False)  # fmt: skip
    tok = load_tokenizer(out / "tokenizer.json")
    assert meta["eot_id"] == tok.eos_id == 1 and meta["eot"] == "<eos>"
    assert meta["special_ids"] == {"<bos>": 0, "<eos>": 1, "<pad>": 2, CHAT_TOKENS[0]: 3,
                                   CHAT_TOKENS[1]: 4}  # fmt: skip
    got = read_back(out)
    want = {"train": [d for i, d in enumerate(docs) if not is_val(i)],
            "val": [d for i, d in enumerate(docs) if is_val(i)]}  # fmt: skip
    assert len(want["val"]) == 20  # documents 9, 19, ..., 199: spread evenly
    for split in ("train", "val"):
        assert [ids[-1] for ids in got[split]] == [tok.eos_id] * len(want[split])
        # special tokens' names in the text stay text: the only eot is the last id
        assert all(tok.eos_id not in ids[:-1] for ids in got[split])
        assert [tok.decode(ids[:-1]) for ids in got[split]] == want[split]
        assert [ids[:-1] for ids in got[split]] == [tok.encode(d) for d in want[split]]
    assert len(meta["shards"]["train"]) > 3
    assert all(e["tokens"] >= 3000 for e in meta["shards"]["train"][:-1])  # closed past the size
    assert meta["train_documents"] == 180 and meta["val_documents"] == 20
    sources = meta["sources"]
    assert [(s["documents"], s["bad_utf8"], s["empty"], s["split"]) for s in sources] == [
        (120, 0, 0, "train+val"),
        (80, 0, 0, "train+val"),
    ]
    assert sum(s["tokens"] for s in sources) == meta["train_tokens"] + meta["val_tokens"]
    assert sources[0]["bytes"] == (tmp_path / "a.jsonl.gz").stat().st_size
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []
    # a sample of the whole corpus was smaller than the budget: all of it
    assert meta["tokenizer_sample_bytes"] == meta["tokenizer_corpus_bytes"]


def without_timing(path: Path) -> dict:
    meta = json.loads(path.read_text())
    meta.pop("timing")
    return meta


def all_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name != "meta.json"}


def test_the_same_inputs_give_the_same_bytes_whatever_the_number_of_workers(tmp_path):
    docs = make_docs(600, seed=4)
    write(tmp_path / "a.jsonl", docs[:300], "jsonl")
    write(tmp_path / "b", docs[300:400], "txt")
    write(tmp_path / "c.jsonl.zst", docs[400:], "jsonl.zst")
    inputs = [tmp_path / "a.jsonl", tmp_path / "b", tmp_path / "c.jsonl.zst"]
    runs = {}
    for workers in (1, 2, 3):
        out = tmp_path / f"w{workers}"
        meta = prepare_documents(out, inputs, vocab_size=420, shard_tokens=4000,
                                 workers=workers, progress=False)  # fmt: skip
        assert meta["timing"]["workers"] == workers
        runs[workers] = (all_bytes(out), without_timing(out / "meta.json"))
    assert len(runs[1][1]["shards"]["train"]) >= 5
    assert runs[2] == runs[1] and runs[3] == runs[1]
    # and a small batch size (many batches in flight) changes nothing either
    documents_mod.BATCH_PIECES, before = 3, documents_mod.BATCH_PIECES
    try:
        prepare_documents(tmp_path / "small", inputs, vocab_size=420, shard_tokens=4000,
                          workers=2, progress=False)  # fmt: skip
    finally:
        documents_mod.BATCH_PIECES = before
    assert all_bytes(tmp_path / "small") == runs[1][0]


def test_long_documents_tokenized_in_pieces_give_the_ids_of_the_whole(tmp_path, monkeypatch):
    docs = [" ".join(make_docs(30, seed=5)), "short one", " ".join(make_docs(25, seed=6))]
    write(tmp_path / "t", docs, "txt")
    kw = dict(vocab_size=400, shard_tokens=10**6, val_fraction=0.34, progress=False)
    prepare_documents(tmp_path / "whole", [tmp_path / "t"], **kw)
    # documents past 64 characters cut in pieces, text files past 500 bytes streamed in blocks
    monkeypatch.setattr(documents_mod, "PIECE_CHARS", 64)
    monkeypatch.setattr(corpus_mod, "LONG_TEXT_BYTES", 500)
    monkeypatch.setattr(corpus_mod, "READ_BYTES", 100)
    records = list(read_records(resolve_inputs([tmp_path / "t"])))
    assert [type(r.text).__name__ for r in records] == ["LongText", "str", "LongText"]
    assert len(list(documents_mod._pieces(records[0].text, cut=True))) > 20
    assert len(list(documents_mod._pieces(docs[0], cut=True))) > 20
    prepare_documents(tmp_path / "cut", [tmp_path / "t"], **kw)
    assert all_bytes(tmp_path / "cut") == all_bytes(tmp_path / "whole")
    assert (
        without_timing(tmp_path / "cut" / "meta.json")["shards"]
        == without_timing(tmp_path / "whole" / "meta.json")["shards"]
    )


def test_a_tokenizer_that_marks_where_a_text_starts_encodes_long_documents_whole():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from llm_foundry.tokenizer import BatchEncoder

    ours = BPETokenizer.train(make_docs(50), 300).hf.to_str()
    assert documents_mod.cut_safe(BatchEncoder(ours, "uint16"))
    sp = Tokenizer(models.BPE())  # SentencePiece's way: a space mark before every text
    sp.pre_tokenizer, sp.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    sp.train_from_iterator(make_docs(50), trainers.BpeTrainer(vocab_size=300, show_progress=False))
    assert not documents_mod.cut_safe(BatchEncoder(sp.to_str(), "uint16"))


# ----------------------------------------------------------------------------------------------
# Interrupted and resumed


def interrupt_after_shards(monkeypatch, n: int, error=KeyboardInterrupt, recorded=True):
    """The next prepare stops (``error``) right after recording its ``n``-th closed shard (not
    ``recorded``: after closing it, before the record says so)."""
    save, calls = documents_mod.save_progress, []

    def save_then_stop(out, record):
        calls.append(1)
        stop = len(calls) == n + 1  # the first record is the one written before any shard
        if recorded or not stop:
            save(out, record)
        if stop:
            raise error

    monkeypatch.setattr(documents_mod, "save_progress", save_then_stop)


@pytest.fixture
def corpus(tmp_path):
    docs = make_docs(400, seed=7)
    write(tmp_path / "a.jsonl", docs[:250], "jsonl")
    write(tmp_path / "b.parquet", docs[250:], "parquet")
    return [tmp_path / "a.jsonl", tmp_path / "b.parquet"]


KW = dict(vocab_size=400, shard_tokens=3000, progress=False)


def test_an_interrupted_prepare_resumes_to_the_bytes_of_an_uninterrupted_one(
    tmp_path, corpus, monkeypatch
):
    whole = prepare_documents(tmp_path / "whole", corpus, **KW)
    out = tmp_path / "d"
    interrupt_after_shards(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        prepare_documents(out, corpus, workers=2, **KW)
    monkeypatch.undo()
    assert not (out / "meta.json").exists()  # nothing that looks complete
    assert (out / "train_00002.bin").exists() and not (out / "train_00003.bin").exists()
    assert any(p.name.endswith(".partial") for p in out.iterdir())
    record = json.loads((out / ".progress.json").read_text())
    assert len(record["splits"]["train"]["done"]) == 3 and record["position"] != [0, 0]
    resumed = prepare_documents(out, corpus, **KW)
    assert resumed["timing"]["resumed"] and not whole["timing"]["resumed"]
    assert all_bytes(out) == all_bytes(tmp_path / "whole")
    assert without_timing(out / "meta.json") == without_timing(tmp_path / "whole" / "meta.json")
    assert not (out / ".progress.json").exists()


def test_stopped_between_closing_a_shard_and_recording_it_resumes_all_the_same(
    tmp_path, corpus, monkeypatch
):
    prepare_documents(tmp_path / "whole", corpus, **KW)
    out = tmp_path / "d"
    interrupt_after_shards(monkeypatch, 2, recorded=False)
    with pytest.raises(KeyboardInterrupt):
        prepare_documents(out, corpus, **KW)
    monkeypatch.undo()
    assert (out / "train_00001.bin").exists()  # renamed, but the record names one shard
    assert len(json.loads((out / ".progress.json").read_text())["splits"]["train"]["done"]) == 1
    prepare_documents(out, corpus, **KW)
    assert all_bytes(out) == all_bytes(tmp_path / "whole")


def test_a_text_stream_prepared_over_a_document_corpus_leaves_no_shard(tmp_path, corpus):
    from llm_foundry.data import load_split, prepare

    out = tmp_path / "d"
    prepare_documents(out, corpus, **KW)
    (tmp_path / "t.txt").write_text("a small text stream " * 50)
    with pytest.raises(DataError, match=r"d already holds a document corpus .*add --restart"):
        prepare(out, text_files=[tmp_path / "t.txt"], progress=False)
    assert len(split_shards(out, "train")) > 1  # refused: the corpus is as it was
    prepare(out, text_files=[tmp_path / "t.txt"], progress=False, restart=True)
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "meta.json", "tokenizer.json", "train.bin", "val.bin"]  # fmt: skip
    assert len(split_shards(out, "train")) == 1 and len(load_split(out, "train")) == 900


@pytest.mark.parametrize("sig, status", [("SIGINT", 130), ("SIGTERM", 143)])
def test_ctrl_c_or_sigterm_is_one_line_and_the_same_command_resumes(
    tmp_path, corpus, monkeypatch, capsys, sig, status
):
    """Ctrl-C, or SIGTERM (a scheduler's preemption), after the first shard: one line, the
    shell's status for the signal, and the same command resumes to the bytes of a whole run."""
    argv = ["prepare", "--input", *map(str, corpus), "--vocab-size", "400", "--shard-tokens",
            "3000", "--out", str(tmp_path / "d")]  # fmt: skip
    save = documents_mod.save_progress

    def signal_then(out, record):  # the signal itself, delivered to this process
        save(out, record)
        if record["splits"]:
            os.kill(os.getpid(), getattr(signal, sig))

    monkeypatch.setattr(documents_mod, "save_progress", signal_then)
    rc, err = cli_status(argv, capsys)
    monkeypatch.undo()
    assert rc == status and err.count("\n") == 1, err
    assert f"stopped by {sig}" in err and "run the same command again to resume" in err
    rc, err = cli_status(argv, capsys)
    assert rc == 0, err
    prepare_documents(tmp_path / "whole", corpus, **KW)
    assert all_bytes(tmp_path / "d") == all_bytes(tmp_path / "whole")


def test_a_changed_input_or_setting_refuses_to_resume_until_restart(tmp_path, corpus, monkeypatch):
    out = tmp_path / "d"
    interrupt_after_shards(monkeypatch, 1, error=RuntimeError("crash"))
    with pytest.raises(RuntimeError):
        prepare_documents(out, corpus, **KW)
    monkeypatch.undo()
    with pytest.raises(DataError) as e:
        prepare_documents(out, corpus, **{**KW, "shard_tokens": 5000})
    assert str(e.value).count("\n") == 0
    assert "other inputs or settings" in str(e.value) and "shard_tokens: 3000 then, 5000" in str(
        e.value
    )
    size = corpus[0].stat().st_size
    with corpus[0].open("a") as f:  # one row more
        f.write(json.dumps({"text": "a late addition"}) + "\n")
    with pytest.raises(DataError) as e:
        prepare_documents(out, corpus, **KW)
    assert str(e.value) == (
        f"{out / '.progress.json'}: an interrupted prepare of other inputs or settings is there "
        f"({corpus[0]} changed ({size:,} bytes then, {size + 28:,} now)); run it again with the "
        "same ones to resume it, or add --restart to discard it and prepare from the start"
    )
    meta = prepare_documents(out, corpus, restart=True, **KW)
    assert not meta["timing"]["resumed"] and meta["sources"][0]["documents"] == 251


def stamps(out: Path) -> dict[str, int]:
    """Every file of ``out`` (hidden ones too, but for the locks' files) and its modification
    time in nanoseconds."""
    from llm_foundry import lock

    locks = (lock.LOCK_FILE, lock.READERS_FILE)  # a reader killed in a test leaves its file
    # a file written again is a new inode (renamed into place) with a later mtime
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted(out.iterdir())
            if p.name not in locks}  # fmt: skip


def test_a_complete_directory_prepared_again_from_the_same_inputs_is_left_as_it_is(
    tmp_path, corpus, capsys
):
    from llm_foundry.cli import main

    out = tmp_path / "d"
    argv = ["prepare", "--input", *map(str, corpus), "--vocab-size", "400", "--shard-tokens",
            "3000", "--out", str(out)]  # fmt: skip
    rc, err = cli_status(argv, capsys)
    assert rc == 0, err
    before = stamps(out)
    assert len([n for n in before if n.startswith("train_")]) > 2  # several shards
    time.sleep(0.01)  # a file written again would get a later mtime
    capsys.readouterr()
    rc = main(argv)
    printed = capsys.readouterr()
    assert rc == 0 and printed.err == ""
    assert printed.out == (
        f"{out} is already prepared from these inputs with these settings: nothing to do\n"
    )
    assert stamps(out) == before
    # --json: meta.json as it is on stdout, the line on stderr
    assert main([*argv, "--json"]) == 0
    printed = capsys.readouterr()
    assert json.loads(printed.out) == json.loads((out / "meta.json").read_text())
    assert printed.err.endswith("nothing to do\n") and stamps(out) == before
    # the library says so with the directory's meta.json, while a training reads it too
    from test_lock import SHARE

    reader = subprocess.Popen([sys.executable, "-c", SHARE, str(out)], stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    try:
        assert reader.stdout.readline().strip() == "reading"
        with pytest.raises(AlreadyPrepared) as e:
            prepare_documents(out, corpus, **KW)
    finally:
        reader.kill()
        reader.wait()
    assert e.value.meta == json.loads((out / "meta.json").read_text())
    assert stamps(out) == before


def test_a_complete_directory_with_other_inputs_or_settings_is_refused_until_restart(
    tmp_path, corpus, capsys
):
    out = tmp_path / "d"
    prepare_documents(out, corpus, **KW)
    before = stamps(out)
    argv = ["prepare", "--input", *map(str, corpus), "--out", str(out)]
    # no --shard-tokens (nor --vocab-size): the defaults differ from what prepared it
    rc, err = cli_status(argv, capsys)
    assert rc == 2 and err == (
        f"llm-foundry prepare: error: {out} is already prepared from other inputs or settings "
        "(settings.vocab_size: 400 then, 4096 now; settings.shard_tokens: 3000 then, 100000000 "
        "now); add --restart to prepare it again from scratch, or write to another --out\n"
    )
    # a changed input comes first, then settings: three differences at most
    size = corpus[0].stat().st_size
    with corpus[0].open("a") as f:
        f.write(json.dumps({"text": "a late addition"}) + "\n")
    rc, err = cli_status([*argv, "--val-fraction", "0.2"], capsys)
    assert rc == 2 and err.count("\n") == 1
    assert (
        f"({corpus[0]} changed ({size:,} bytes then, {size + 28:,} now); settings.vocab_size: 400 "
        "then, 4096 now; settings.val_fraction: 0.1 then, 0.2 now); add --restart" in err
    )
    assert stamps(out) == before
    # a directory holding another kind of prepared data is refused all the same
    text = tmp_path / "stream"
    (tmp_path / "t.txt").write_text("a small text stream " * 50)
    from llm_foundry.data import prepare

    prepare(text, text_files=[tmp_path / "t.txt"], progress=False)
    with pytest.raises(DataError) as e:
        prepare_documents(text, corpus, **KW)
    assert str(e.value) == (
        f"{text} already holds a text stream (train.bin/val.bin, no kind); add --restart to "
        "prepare it again from scratch, or write to another --out"
    )
    # --restart prepares it again
    rc, err = cli_status([*argv, "--restart"], capsys)
    assert rc == 0, err
    meta = load_meta(out)
    assert meta["settings"]["shard_tokens"] == 100_000_000 and len(meta["shards"]["train"]) == 1
    assert meta["sources"][0]["documents"] == 251


def test_a_complete_directory_whose_files_no_longer_match_is_prepared_again(tmp_path, corpus):
    out = tmp_path / "d"
    first = prepare_documents(out, corpus, **KW)
    (out / "train_00001.bin").unlink()
    again = prepare_documents(out, corpus, **KW)
    assert again["shards"] == first["shards"] and (out / "train_00001.bin").is_file()


def test_a_text_flag_for_none_of_the_inputs_formats_is_refused(tmp_path, capsys):
    docs = make_docs(30, seed=3)
    write(tmp_path / "a.jsonl", docs, "jsonl", field="body")
    write(tmp_path / "b.parquet", docs, "parquet", field="body")
    write(tmp_path / "t", docs, "txt")
    out = tmp_path / "d"
    cases = [
        ([tmp_path / "a.jsonl"], "--text-column", "--text-column 'body' applies to parquet and "
         "datasets inputs, and the inputs are jsonl: choose their text with --text-field"),
        ([tmp_path / "b.parquet"], "--text-field", "--text-field 'body' applies to JSONL inputs, "
         "and the inputs are parquet: choose their text with --text-column"),
        ([tmp_path / "t"], "--text-field", "--text-field 'body' applies to JSONL inputs, and the "
         "inputs are txt: a text file is one whole document, with no field or column to choose"),
    ]  # fmt: skip
    for inputs, flag, message in cases:
        argv = ["prepare", "--input", *map(str, inputs), flag, "body", "--out", str(out)]
        rc, err = cli_status(argv, capsys)
        assert rc == 2 and err == f"llm-foundry prepare: error: {message}\n"
        assert not out.exists()
    with pytest.raises(DataError, match="--text-column 'body' applies to parquet and datasets"):
        prepare_documents(out, [tmp_path / "a.jsonl"], text_column="body", **KW)
    # each flag applies to the inputs of its format among others
    meta = prepare_documents(out, [tmp_path / "a.jsonl", tmp_path / "b.parquet"],
                             text_field="body", text_column="body", **KW)  # fmt: skip
    assert meta["train_documents"] + meta["val_documents"] == 60


def test_training_the_bpe_shows_a_bar_and_json_stays_json(tmp_path, corpus, monkeypatch, capsys):
    from llm_foundry.cli import main

    monkeypatch.setattr(documents_mod, "PROGRESS_MIN_CHARS", 0)  # a bar for this small corpus
    argv = ["prepare", "--input", *map(str, corpus), "--vocab-size", "400", "--out",
            str(tmp_path / "d"), "--json"]  # fmt: skip
    capsys.readouterr()
    assert main(argv) == 0
    printed = capsys.readouterr()
    assert json.loads(printed.out)["kind"] == "documents"  # nothing else on stdout
    bars = printed.err.replace("\r", "\n")
    sample = json.loads(printed.out)["tokenizer_sample_bytes"]
    train = [line for line in bars.splitlines() if line.startswith("train BPE: 100%")]
    assert train, printed.err
    assert "merging pairs" in train[-1]  # still running after it read the sample
    assert f"{sample / 1e3:.1f}k/{sample / 1e3:.1f}k" in train[-1]  # the sample's size
    assert bars.index("read sample") < bars.index("train BPE") < bars.index("tokenize")


@pytest.mark.heavy
def test_a_killed_prepare_resumes_to_the_same_bytes(tmp_path):
    """SIGKILL (nothing runs after it) once the first shard is recorded, then the same command."""
    docs = make_docs(3000, seed=8, longest=300)
    write(tmp_path / "a.jsonl", docs, "jsonl")
    tok = tmp_path / "tok" / "tokenizer.json"
    tok.parent.mkdir()
    BPETokenizer.train(docs[:300], 300).save(tok)
    argv = [sys.executable, "-m", "llm_foundry", "prepare", "--input", str(tmp_path / "a.jsonl"),
            "--tokenizer-from", str(tok), "--shard-tokens", "2000", "--workers", "2"]  # fmt: skip
    out = tmp_path / "d"
    proc = subprocess.Popen([*argv, "--out", str(out)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    record = out / ".progress.json"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if record.is_file() and '"train_00000.bin"' in record.read_text():
            break
        time.sleep(0.005)
    assert proc.poll() is None, "the prepare finished before it could be killed"
    psutil = pytest.importorskip("psutil")  # accelerate's and peft's dependency
    tree = psutil.Process(proc.pid).children(recursive=True)  # the forkserver and its workers
    assert len(tree) >= 3, [p.cmdline() for p in tree]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    _, alive = psutil.wait_procs(tree, timeout=30)  # workers notice their parent is gone
    assert not alive, f"left running after the prepare was killed: {[p.cmdline() for p in alive]}"
    assert not (out / "meta.json").exists()
    subprocess.run([*argv, "--out", str(out)], check=True, capture_output=True)
    subprocess.run([*argv, "--out", str(tmp_path / "whole"), "--workers", "1"], check=True,
                   capture_output=True)  # fmt: skip
    assert json.loads((out / "meta.json").read_text())["timing"]["resumed"]
    assert all_bytes(out) == all_bytes(tmp_path / "whole")


# ----------------------------------------------------------------------------------------------
# Validation documents


def test_val_documents_from_a_source(tmp_path):
    docs = make_docs(60, seed=9)
    write(tmp_path / "train.jsonl", docs[:50], "jsonl")
    write(tmp_path / "val", docs[50:], "txt")
    out = tmp_path / "d"
    meta = prepare_documents(out, [tmp_path / "train.jsonl"], val_sources=[tmp_path / "val"],
                             vocab_size=300, shard_tokens=500, progress=False)  # fmt: skip
    tok = load_tokenizer(out / "tokenizer.json")
    got = read_back(out)
    assert [tok.decode(ids[:-1]) for ids in got["train"]] == docs[:50]
    assert [tok.decode(ids[:-1]) for ids in got["val"]] == docs[50:]
    assert [s["split"] for s in meta["sources"]] == ["train", "val"]
    assert meta["val_fraction"] is None and meta["val_source"] == [str(tmp_path / "val")]
    with pytest.raises(ValueError, match="give --val-fraction or --val-source, not both"):
        prepare_documents(out, [tmp_path / "train.jsonl"], val_sources=[tmp_path / "val"],
                          val_fraction=0.2, progress=False)  # fmt: skip
    with pytest.raises(DataError, match="is named twice"):
        prepare_documents(out, [tmp_path / "train.jsonl"],
                          val_sources=[tmp_path / "train.jsonl"], progress=False)  # fmt: skip


def test_val_fraction_takes_documents_spread_evenly_and_refuses_too_few(tmp_path):
    docs = make_docs(30, seed=10)
    write(tmp_path / "a.jsonl", docs, "jsonl")
    out = tmp_path / "d"
    prepare_documents(out, [tmp_path / "a.jsonl"], val_fraction=0.25, vocab_size=300,
                      progress=False)  # fmt: skip
    tok = load_tokenizer(out / "tokenizer.json")
    val = [tok.decode(ids[:-1]) for ids in read_back(out)["val"]]
    assert val == [docs[i] for i in (3, 7, 11, 15, 19, 23, 27)]  # floor((i+1)/4) > floor(i/4)
    with pytest.raises(DataError, match=r"--val-fraction 0.01 picks none of 30 documents"):
        prepare_documents(tmp_path / "e", [tmp_path / "a.jsonl"], val_fraction=0.01,
                          progress=False)  # fmt: skip
    assert not (tmp_path / "e").exists()  # refused before anything was written


def test_too_few_val_documents_found_only_after_tokenizing_leave_nothing_behind(tmp_path):
    """With --tokenizer-from no pass counts the documents before they are tokenized: the refusal
    comes at the end, and it leaves no shard or progress record to resume into a run that can
    never complete."""
    model = gpt2_like(tmp_path / "gpt2")
    write(tmp_path / "a.jsonl", make_docs(30, seed=10), "jsonl")
    out = tmp_path / "e"
    with pytest.raises(DataError, match=r"--val-fraction 0.01 picks none of 30 documents"):
        prepare_documents(out, [tmp_path / "a.jsonl"], tokenizer_from=model, val_fraction=0.01,
                          progress=False)  # fmt: skip
    assert not out.exists()


# ----------------------------------------------------------------------------------------------
# Tokenizers


def test_the_tokenizer_sample_is_bounded_spread_over_the_corpus_and_deterministic():
    pieces = [f"piece {i:05d} " + "x" * (i % 50) for i in range(5000)]
    total = sum(len(p) for p in pieces)
    sample, kept, seen = draw_sample(iter(pieces), total // 10)
    assert seen == total and kept == sum(len(p) for p in sample) <= total // 10
    assert kept > total // 10 - 60  # filled to within a piece
    positions = [int(p.split()[1]) for p in sample]
    assert positions == sorted(positions)  # in corpus order
    # drawn across the whole corpus: every tenth of it contributes about a tenth
    per_tenth = np.bincount(np.array(positions) * 10 // len(pieces), minlength=10)
    assert per_tenth.min() > 0.6 * per_tenth.mean()
    assert draw_sample(iter(pieces), total // 10) == (sample, kept, seen)
    assert draw_sample(iter(pieces), 10 * total)[0] == pieces  # all of a small corpus


def test_a_small_tokenizer_sample_trains_on_documents_from_all_of_the_corpus(tmp_path):
    # the first half of the corpus uses one alphabet, the second another: a sample of the first
    # documents alone would learn no merge of the second
    docs = ["alpha beta gamma " * 20] * 100 + ["ωμέγα ψψψ ζζζ " * 20] * 100
    write(tmp_path / "a.jsonl", docs, "jsonl")
    meta = prepare_documents(tmp_path / "d", [tmp_path / "a.jsonl"], vocab_size=300,
                             tokenizer_sample=20_000, progress=False)  # fmt: skip
    assert 15_000 < meta["tokenizer_sample_bytes"] <= 20_000 < meta["tokenizer_corpus_bytes"]
    tok = load_tokenizer(tmp_path / "d" / "tokenizer.json")
    assert len(tok.encode(" gamma")) == 1 and len(tok.encode(" ψψψ")) == 1


def gpt2_like(directory: Path, extra: int = 0) -> Path:
    """An HF tokenizer directory as GPT-2's: byte-level BPE with <|endoftext|> (its id in
    config.json), plus ``extra`` added tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)  # fmt: skip
    hf.train_from_iterator(make_docs(50), trainer=trainer)
    if extra:
        hf.add_tokens([f"tok{i}" for i in range(extra)])
    directory.mkdir(parents=True)
    hf.save(str(directory / "tokenizer.json"))
    eot = hf.token_to_id("<|endoftext|>")
    (directory / "config.json").write_text(json.dumps({"model_type": "gpt2", "eos_token_id": eot}))
    return directory


def test_tokenizer_from_a_model_directory_ends_documents_with_its_eos(tmp_path):
    from tokenizers import Tokenizer

    model = gpt2_like(tmp_path / "gpt2")
    docs = make_docs(40, seed=11)
    write(tmp_path / "a.jsonl", docs, "jsonl")
    out = tmp_path / "d"
    meta = prepare_documents(out, [tmp_path / "a.jsonl"], tokenizer_from=model, progress=False)
    hf = Tokenizer.from_file(str(model / "tokenizer.json"))
    assert meta["tokenizer"] == "hf" and meta["eot"] == "<|endoftext|>"
    assert meta["eot_id"] == hf.token_to_id("<|endoftext|>") == meta["eos_id"]
    assert (out / "tokenizer.json").read_bytes() == (model / "tokenizer.json").read_bytes()
    assert meta["tokenizer_sample_bytes"] is None
    got = read_back(out)
    train = [d for i, d in enumerate(docs) if not is_val(i)]
    assert [ids[-1] for ids in got["train"]] == [meta["eot_id"]] * len(train)
    assert [hf.decode(ids[:-1]) for ids in got["train"]] == train


def test_tokenizer_from_one_of_ours_and_a_char_tokenizer_refused(tmp_path):
    from llm_foundry.tokenizer import CharTokenizer

    docs = make_docs(30, seed=19)
    write(tmp_path / "a.jsonl", docs, "jsonl")
    BPETokenizer.train(docs, 300).save(tmp_path / "ours.json")  # no chat markers: still fine
    meta = prepare_documents(tmp_path / "d", [tmp_path / "a.jsonl"],
                             tokenizer_from=tmp_path / "ours.json", progress=False)  # fmt: skip
    assert (meta["tokenizer"], meta["eot_id"], meta["special_ids"]) == (
        "bpe", 1, {"<bos>": 0, "<eos>": 1, "<pad>": 2})  # fmt: skip
    CharTokenizer.train("abc").save(tmp_path / "char.json")
    with pytest.raises(DataError, match=r"char\.json is a character tokenizer, which has no "
                       "end-of-text token"):  # fmt: skip
        prepare_documents(tmp_path / "e", [tmp_path / "a.jsonl"],
                          tokenizer_from=tmp_path / "char.json", progress=False)  # fmt: skip


def test_dtype_uint16_refuses_a_vocabulary_past_65536_and_auto_takes_uint32(tmp_path):
    model = gpt2_like(tmp_path / "big", extra=66_000)
    docs = make_docs(20, seed=12) + ["tok65999 tok12"]
    write(tmp_path / "a.jsonl", docs, "jsonl")
    with pytest.raises(DataError) as e:
        prepare_documents(tmp_path / "d", [tmp_path / "a.jsonl"], tokenizer_from=model,
                          dtype="uint16", progress=False)  # fmt: skip
    assert str(e.value) == (
        "--dtype uint16 cannot hold the tokenizer's ids (vocabulary of 66,300: ids up to "
        "66,299 > 65,535); use --dtype uint32 or auto"
    )
    assert not (tmp_path / "d").exists()
    meta = prepare_documents(tmp_path / "d", [tmp_path / "a.jsonl"], tokenizer_from=model,
                             progress=False)  # fmt: skip
    assert meta["dtype"] == "uint32"
    assert max(max(ids) for ids in read_back(tmp_path / "d")["train"]) > 65_535


# ----------------------------------------------------------------------------------------------
# Bad input: one line naming the file and row


def test_missing_text_field_or_column_names_the_file_and_row(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    with pytest.raises(DataError) as e:
        prepare_documents(tmp_path / "d", [tmp_path / "a.jsonl"], progress=False)
    skip = "; fix the row, or pass --on-bad-row skip to leave such rows out (they are counted)"
    assert str(e.value) == (
        f"{tmp_path / 'a.jsonl'} line 2 has no field 'text'; its fields: ['body'] (choose with "
        f"--text-field){skip}"
    )
    (tmp_path / "b.jsonl").write_text('{"text": "fine"}\n{"text": ["a", "list"]}\n')
    with pytest.raises(DataError) as e:
        prepare_documents(tmp_path / "d", [tmp_path / "b.jsonl"], progress=False)
    assert str(e.value) == (
        f"{tmp_path / 'b.jsonl'} line 2: field 'text' is ['a', 'list']; expected a string (or "
        f"null, left out as an empty text){skip}"
    )
    (tmp_path / "c.jsonl").write_text('{"text": "fine"}\n{"text": "broken"\n')
    with pytest.raises(DataError, match=r"c\.jsonl line 2 is not JSON"):
        prepare_documents(tmp_path / "d", [tmp_path / "c.jsonl"], progress=False)
    (tmp_path / "e.jsonl").write_bytes(b'{"text": "a\tb"}\n')  # a raw tab inside a string
    with pytest.raises(DataError) as e:
        prepare_documents(tmp_path / "d", [tmp_path / "e.jsonl"], progress=False)
    assert str(e.value).endswith(
        f"e.jsonl line 1 is not JSON (Invalid control character, column 12){skip}"
    )
    write(tmp_path / "a.parquet", ["x", "y"], "parquet", field="content")
    with pytest.raises(DataError) as e:
        prepare_documents(tmp_path / "d", [tmp_path / "a.parquet"], progress=False)
    assert str(e.value) == (
        f"{tmp_path / 'a.parquet'} has no column 'text'; its columns: ['id', 'content'] (choose "
        "with --text-column)"
    )
    write(tmp_path / "saved", ["x", "y"], "datasets", field="content")
    with pytest.raises(DataError, match=r"saved has no column 'text'; its columns: \['id', 'c"):
        prepare_documents(tmp_path / "d", [tmp_path / "saved"], progress=False)
    assert not (tmp_path / "d").exists()


def test_bad_rows_are_left_out_and_counted_with_on_bad_row_skip(tmp_path, capsys):
    """A line cut short (a writer that crashed), a row without the field, a row whose text is
    not a string: --on-bad-row skip leaves each out and counts it, the first named; the good
    rows make the same shards as a file holding them alone."""
    from llm_foundry.cli import main

    good = [f"document {i} " * 20 for i in range(40)]
    lines = [json.dumps({"text": t}) for t in good]
    bad = (
        lines[:10] + ['{"id": 3}'] + lines[10:30] + ['{"text": 5}'] + lines[30:] + ['{"text": "cut']
    )
    (tmp_path / "bad.jsonl").write_text("\n".join(bad) + "\n")
    (tmp_path / "good.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"bad\.jsonl line 11 has no field 'text'"):
        prepare_documents(tmp_path / "f", [tmp_path / "bad.jsonl"], vocab_size=300, progress=False)
    args = ["--vocab-size", "300", "--val-fraction", "0.25"]
    assert main(["prepare", "--input", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "d"),
                 "--on-bad-row", "skip", *args]) == 0  # fmt: skip
    said = capsys.readouterr().out
    assert f"left out 3 bad rows (first: {tmp_path / 'bad.jsonl'} line 11 has no field" in said
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())
    (source,) = meta["sources"]
    assert (source["documents"], source["bad_rows"]) == (40, 3)
    assert meta["settings"]["on_bad_row"] == "skip"
    assert main(["prepare", "--input", str(tmp_path / "good.jsonl"), "--out", str(tmp_path / "g"),
                 *args]) == 0  # fmt: skip
    good_meta = json.loads((tmp_path / "g" / "meta.json").read_text())
    assert "on_bad_row" not in good_meta["settings"]  # the default: as before it was a setting
    assert meta["sha256"] == good_meta["sha256"]


def test_empty_files_and_inputs_that_name_nothing_are_one_line(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.jsonl").write_text("\n\n")
    (tmp_path / "notes.md").write_text("x")
    none = r"the inputs hold no training document \(2 empty files\)"
    cases = [
        ([tmp_path / "empty.txt", tmp_path / "blank.jsonl"], none),
        ([tmp_path / "notes.md"], r"notes\.md: not a file type prepare reads; valid: \.jsonl"),
        ([str(tmp_path / "*.parquet")], r"--input '.*\*\.parquet' matches no file"),
        ([tmp_path / "nowhere"], r"--input .*nowhere: no such file or directory"),
    ]
    for inputs, message in cases:
        with pytest.raises(DataError, match=message) as e:
            prepare_documents(tmp_path / "d", inputs, progress=False)
        assert "\n" not in str(e.value)
    assert not (tmp_path / "d").exists()


def test_bytes_that_are_not_utf8_fail_with_file_and_row_or_are_skipped_and_counted(tmp_path):
    docs = make_docs(40, seed=13)
    lines = [json.dumps({"text": d}).encode() for d in docs]
    lines[5] = b'{"text": "caf\xe9 latin-1"}'
    lines[17] = b'{"text": "lone \\ud800 surrogate"}'
    (tmp_path / "a.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    write(tmp_path / "t", ["good text", "more"], "txt")
    (tmp_path / "t" / "doc0002.txt").write_bytes(b"bad \xff\xfe here")
    inputs = [tmp_path / "a.jsonl", tmp_path / "t"]
    with pytest.raises(DataError) as e:
        prepare_documents(tmp_path / "d", inputs, progress=False)
    assert str(e.value).startswith(
        f"{tmp_path / 'a.jsonl'} line 6: byte 0xe9 at offset 13 is not UTF-8; convert the input "
        "to UTF-8, or pass --on-bad-utf8 skip"
    )
    meta = prepare_documents(tmp_path / "d", inputs, on_bad_utf8="skip", vocab_size=300,
                             progress=False)  # fmt: skip
    a, t = meta["sources"]
    assert (a["documents"], a["bad_utf8"], t["documents"], t["bad_utf8"]) == (38, 2, 2, 1)
    assert a["bad_utf8_first"].endswith("a.jsonl line 6: byte 0xe9 at offset 13 is not UTF-8")
    tok = load_tokenizer(tmp_path / "d" / "tokenizer.json")
    kept = [d for i, d in enumerate(docs) if i not in (5, 17)] + ["good text", "more"]
    got = read_back(tmp_path / "d")
    assert sorted(tok.decode(ids[:-1]) for s in got.values() for ids in s) == sorted(kept)


def test_empty_documents_are_left_out_and_counted(tmp_path):
    docs = make_docs(30, seed=14)
    docs[3] = docs[20] = ""
    write(tmp_path / "a.jsonl", docs, "jsonl")
    meta = prepare_documents(tmp_path / "d", [tmp_path / "a.jsonl"], vocab_size=300,
                             progress=False)  # fmt: skip
    assert (meta["sources"][0]["documents"], meta["sources"][0]["empty"]) == (28, 2)
    assert meta["train_documents"] + meta["val_documents"] == 28


def test_a_long_run_of_empty_records_is_sent_in_bounded_batches(monkeypatch, tmp_path):
    """Records that give no text (empty, or skipped for bad bytes) still pass through the
    batches that carry their positions: a corpus of mostly empty rows must not pile them up."""
    monkeypatch.setattr(documents_mod, "BATCH_OPS", 16)
    docs = make_docs(20, seed=15)
    rows = [""] * 100 + docs[:10] + [""] * 50 + docs[10:]
    write(tmp_path / "a.jsonl", rows, "jsonl")
    sizes = []
    batches = documents_mod._batches

    def recorded(*args, **kwargs):
        for pieces, ops in batches(*args, **kwargs):
            sizes.append(len(ops))
            yield pieces, ops

    monkeypatch.setattr(documents_mod, "_batches", recorded)
    meta = prepare_documents(tmp_path / "d", [tmp_path / "a.jsonl"], vocab_size=300,
                             progress=False)  # fmt: skip
    assert max(sizes) <= 16 + 2 and len(sizes) >= 150 // 16  # the bound, then one record's ops
    assert (meta["sources"][0]["documents"], meta["sources"][0]["empty"]) == (20, 150)
    tok = load_tokenizer(tmp_path / "d" / "tokenizer.json")
    got = read_back(tmp_path / "d")
    assert sorted(tok.decode(ids[:-1]) for ids in got["train"] + got["val"]) == sorted(docs)


def test_a_shard_truncated_on_disk_is_refused_by_the_reader(tmp_path):
    write(tmp_path / "a.jsonl", make_docs(100, seed=15), "jsonl")
    out = tmp_path / "d"
    prepare_documents(out, [tmp_path / "a.jsonl"], vocab_size=300, shard_tokens=1000,
                      progress=False)  # fmt: skip
    meta = load_meta(out)
    shard = split_shards(out, "train", meta)[1]
    with open(shard.path, "r+b") as f:
        f.truncate(shard.path.stat().st_size - 2)
    with pytest.raises(DataError, match=r"train_00001\.bin has .* bytes; .*meta\.json records"):
        open_shard(out, shard, meta)
    index = split_shards(out, "train", meta)[2].index
    index.write_bytes(index.read_bytes()[:-8])
    with pytest.raises(DataError, match=r"train_00002\.idx has .* bytes; .*meta\.json records"):
        document_starts(out, split_shards(out, "train", meta)[2], meta)


def test_missing_zstandard_names_the_install_line(tmp_path, monkeypatch):
    write(tmp_path / "a.jsonl.zst", ["x y"] * 30, "jsonl.zst")
    monkeypatch.setitem(sys.modules, "zstandard", None)  # `import zstandard` fails
    with pytest.raises(DataError) as e:
        prepare_documents(tmp_path / "d", [tmp_path / "a.jsonl.zst"], progress=False)
    assert str(e.value).startswith(f"reading {tmp_path / 'a.jsonl.zst'} needs the zstandard")
    assert "pip install" in str(e.value) and "[data]" in str(e.value)


def test_an_unreachable_hub_is_one_line(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf")}  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "llm_foundry", "prepare", "--hf-dataset", "someone/corpus",
         "--out", str(tmp_path / "d")],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(
        "llm-foundry prepare: error: --hf-dataset someone/corpus: not a directory, and the "
        "Hugging Face hub could not give the dataset (ConnectionError:"
    )
    assert "save the dataset with save_to_disk elsewhere and pass its directory" in proc.stderr
    assert not (tmp_path / "d").exists()


# ----------------------------------------------------------------------------------------------
# The command


def test_prepare_cli_documents(tmp_path, capsys):
    from llm_foundry.cli import main

    write(tmp_path / "a.jsonl", make_docs(50, seed=16), "jsonl")
    write(tmp_path / "t", make_docs(10, seed=17), "txt")
    out = tmp_path / "d"
    argv = ["prepare", "--input", str(tmp_path / "a.jsonl"), str(tmp_path / "t"),
            "--vocab-size", "300", "--shard-tokens", "1K", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    meta = load_meta(out)
    assert printed == (
        f"wrote {out}: {len(meta['shards']['train'])} train shards ({meta['train_tokens']:,} "
        f"tokens, 54 documents) + 1 val shard ({meta['val_tokens']:,} tokens, 6 documents), "
        "uint16; bpe tokenizer with 300 entries, documents ended by <eos> (1); 2 input(s)\n"
    )
    assert meta["settings"]["shard_tokens"] == 1000


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--tokenizer", "char"], "--tokenizer char is for a text stream (--text, --dataset)"),
        (["--vocab-size", "260"], "--vocab-size 260: must be at least 261"),
        (["--tokenizer-from", "m", "--vocab-size", "300"], "--vocab-size trains a tokenizer"),
        (["--val-source", "v.txt", "--val-fraction", "0.2"], "give --val-fraction or --val-s"),
        (["--workers", "0"], "--workers 0: must be at least 1"),
        (["--shard-tokens", "1.5"], "--shard-tokens '1.5': must be a whole number >= 1"),
        (["--tokenizer-sample", "lots"], "--tokenizer-sample 'lots': not a count (e.g. 5000, 1"),
    ],
)
def test_document_flags_out_of_range_or_out_of_place_are_one_line(tmp_path, capsys, flags, message):
    (tmp_path / "a.txt").write_text("some text")
    argv = ["prepare", "--input", str(tmp_path / "a.txt"), "--out", str(tmp_path / "d"), *flags]
    rc, err = cli_status(argv, capsys)
    assert rc == 2 and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "d").exists()


def test_workers_without_documents_is_one_line(tmp_path, capsys):
    rc, err = cli_status(["prepare", "--workers", "2", "--out", str(tmp_path / "d")], capsys)
    assert rc == 2 and err == (
        "llm-foundry prepare: error: --workers needs the documents: --input PATH... or "
        "--hf-dataset NAME\n"
    )
    # a document flag given with its default value, or 0, counts as given
    (tmp_path / "t.txt").write_text("some text")
    for n in ("1", "0"):
        argv = ["prepare", "--text", str(tmp_path / "t.txt"), "--workers", n]
        rc, err = cli_status([*argv, "--out", str(tmp_path / "d")], capsys)
        assert rc == 2 and "--workers is for a document corpus" in err, err


def test_counts_are_exact_whatever_their_size():
    from llm_foundry.cli.prepare import count

    assert count("--shard-tokens", "9007199254740993") == 2**53 + 1  # past float precision
    assert count("--shard-tokens", "1.5K") == 1500 and count("--shard-tokens", "100M") == 10**8


RSS_SCRIPT = """
import sys
from pathlib import Path
from llm_foundry.data.documents import prepare_documents

def high_water():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM"))

def resident():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS"))

if __name__ == "__main__":
    tok, corpus, out = sys.argv[1:4]
    kw = dict(tokenizer_from=tok, shard_tokens=1_000_000, progress=False)
    # a first small run loads what prepare imports lazily; then the high-water mark restarts
    small = Path(out + ".warm.jsonl")
    with open(corpus, "rb") as f:
        small.write_bytes(b"".join(f.readline() for _ in range(200)))
    prepare_documents(out + ".warm", [small], **kw)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = resident()
    meta = prepare_documents(out, [corpus], **kw)
    print(meta["train_tokens"] + meta["val_tokens"], high_water() - base)
"""


def _growth(tmp_path: Path, tok: Path, n_bytes: int) -> tuple[int, int]:
    """(tokens, bytes of peak-RSS growth) of preparing an ``n_bytes`` JSONL corpus in a fresh
    process."""
    corpus = tmp_path / f"c{n_bytes}.jsonl"
    rows = [json.dumps({"text": d}) + "\n" for d in make_docs(2000, seed=18, longest=400)]
    with open(corpus, "w") as f:
        for row in itertools.cycle(rows):
            if f.tell() >= n_bytes:
                break
            f.write(row)
    proc = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(tok), str(corpus),
                           str(tmp_path / f"d{n_bytes}")], capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    if proc.returncode != 0 and "clear_refs" in proc.stderr:
        pytest.skip("/proc/self/clear_refs is not writable here: no reset of the peak RSS")
    assert proc.returncode == 0, proc.stderr
    tokens, grew = map(int, proc.stdout.split())
    return tokens, grew


@pytest.mark.heavy
def test_prepare_documents_memory_does_not_grow_with_the_corpus(tmp_path):
    mib = 1 << 20
    tok = tmp_path / "tok.json"
    BPETokenizer.train(make_docs(300), 400, chat_tokens=True).save(tok)
    small_tokens, small = _growth(tmp_path, tok, 4 * mib)
    big_tokens, big = _growth(tmp_path, tok, 16 * mib)
    assert big_tokens > 3.5 * small_tokens
    # documents streamed, batches bounded: 12 MiB more corpus moves the peak by little
    assert big - small < 8 * mib, f"{small / mib:.1f} MiB -> {big / mib:.1f} MiB"
    assert big < 64 * mib, f"peak RSS grew by {big / mib:.1f} MiB"
