"""What ``prepare --input`` makes of the inputs a real corpus holds: files changed while they are
read, directory entries it does not read, empty files, links, byte order marks, null texts, bytes
that are not UTF-8, and the notes it prints about them (data/corpus.py, data/documents.py)."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest
from conftest import cli_status
from test_corpus import interrupt_after_shards

from llm_foundry.data import DataError
from llm_foundry.data import corpus as corpus_mod
from llm_foundry.data import documents as documents_mod
from llm_foundry.data.corpus import (
    InputChanged,
    check_unchanged,
    read_records,
    resolve_inputs,
    skipped_note,
)
from llm_foundry.data.documents import prepare_documents
from llm_foundry.data.shard_writer import AlreadyPrepared

KW = dict(vocab_size=300, progress=False)


def rows(path: Path, texts: list, prefix: bytes = b"") -> Path:
    path.write_bytes(prefix + "".join(json.dumps({"text": t}) + "\n" for t in texts).encode())
    return path


def docs(n: int, tag: str = "doc") -> list[str]:
    return [f"{tag} {i}: the quick brown fox jumps over the lazy dog {i * 7}" for i in range(n)]


def kinds(groups, **kw) -> list[tuple[str, str | None]]:
    return [(r.kind, r.text) for r in read_records(groups, **kw)]


# ----------------------------------------------------------------------------------------------
# A file changed while it is prepared


def change_after_read(monkeypatch, path: Path, read: int, target: Path | None = None,
                      touch: bool = False):  # fmt: skip
    """Once the ``read``-th reading of the JSONL file ``path`` has yielded its last record (1:
    the tokenizer's sample, 2: tokenizing), append a row to ``target`` (default ``path``), or
    (``touch``) give it a new modification time only."""
    real, count = corpus_mod._jsonl_records, [0]
    target = target or path

    def reading(f, *args):
        yield from real(f, *args)
        if f.path == str(path.resolve()):
            count[0] += 1
            if count[0] == read and touch:
                st = target.stat()
                os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
            elif count[0] == read:
                with target.open("a") as file:
                    file.write(json.dumps({"text": "a row written meanwhile"}) + "\n")

    monkeypatch.setattr(corpus_mod, "_jsonl_records", reading)


@pytest.mark.parametrize(
    "read, changed", [(1, "a"), (2, "a"), (2, "b")], ids=["sample", "tokenizing", "read-before"]
)
def test_a_file_changed_while_it_is_prepared_stops_with_one_line_and_nothing_to_resume(
    tmp_path, monkeypatch, read, changed
):
    a = rows(tmp_path / "a.jsonl", docs(30, "a"))
    b = rows(tmp_path / "b.jsonl", docs(30, "b"))
    target = a if changed == "a" else b
    # "read-before": b.jsonl is changed after its own read, while a.jsonl is tokenized
    change_after_read(monkeypatch, a, read, target)
    size = target.stat().st_size
    out = tmp_path / "d"
    with pytest.raises(InputChanged) as e:
        prepare_documents(out, [b, a] if changed == "b" else [a, b], **KW)
    assert str(e.value) == (
        f"{target.resolve()} changed while it was being prepared ({size:,} bytes then, "
        f"{target.stat().st_size:,} now): what was written from these inputs in {out} is "
        "removed (part of it came from the file as it was); run again to prepare it anew"
    )
    assert not out.exists()  # created by that call: nothing in it can be resumed
    monkeypatch.undo()
    meta = prepare_documents(out, [b, a] if changed == "b" else [a, b], **KW)  # the same call
    st = target.stat()
    stamp = next(f[2] for g in meta["inputs"] for f in g[2] if f[0] == str(target.resolve()))
    assert stamp == [st.st_size, st.st_mtime_ns]
    assert meta["train_documents"] + meta["val_documents"] == 61


@pytest.mark.parametrize("read, changed", [(2, "a"), (2, "b")], ids=["tokenizing", "read-before"])
def test_a_touched_file_is_no_change(tmp_path, monkeypatch, read, changed):
    """A new modification time on the same bytes (`touch`, a save of the same text) while the
    file is prepared or after it was read: compared by content, the prepare goes on, and its
    output is the bytes of an untouched prepare."""
    a = rows(tmp_path / "a.jsonl", docs(30, "a"))
    b = rows(tmp_path / "b.jsonl", docs(30, "b"))
    order = [b, a] if changed == "b" else [a, b]
    reference = prepare_documents(tmp_path / "ref", order, **KW)
    change_after_read(monkeypatch, a, read, a if changed == "a" else b, touch=True)
    meta = prepare_documents(tmp_path / "d", order, **KW)
    assert meta["sha256"] == reference["sha256"]
    assert meta["train_documents"] + meta["val_documents"] == 60


def test_a_change_during_a_resume_leaves_the_directory_clean_for_the_same_command(
    tmp_path, monkeypatch
):
    a = rows(tmp_path / "a.jsonl", docs(200, "a"))
    b = rows(tmp_path / "b.jsonl", docs(200, "b"))
    out, kw = tmp_path / "d", dict(KW, shard_tokens=2000)
    save, calls = documents_mod.save_progress, []

    def save_then_stop(where, record):  # stopped after the first closed shard
        save(where, record)
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(documents_mod, "save_progress", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        prepare_documents(out, [a, b], **kw)
    monkeypatch.undo()
    assert (out / ".progress.json").is_file()
    change_after_read(monkeypatch, b, 1)  # the resume reads b.jsonl once
    with pytest.raises(InputChanged, match=r"b\.jsonl changed while it was being prepared"):
        prepare_documents(out, [a, b], **kw)
    monkeypatch.undo()
    left = [p.name for p in out.iterdir() if not p.name.startswith(".lock")]
    assert not [n for n in left if n.endswith((".bin", ".json", ".partial"))], left
    meta = prepare_documents(out, [a, b], **kw)
    assert not meta["timing"]["resumed"]
    assert meta["train_documents"] + meta["val_documents"] == 401


def test_a_file_replaced_by_another_of_the_same_size_and_time_is_a_change(tmp_path):
    a = rows(tmp_path / "a.jsonl", ["one", "two"])
    (f,) = resolve_inputs([a])[0].files
    check_unchanged(f)  # as it was: nothing to say
    st = a.stat()
    rows(tmp_path / "new.jsonl", ["six", "ten"])  # the same bytes long
    os.utime(tmp_path / "new.jsonl", ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(tmp_path / "new.jsonl", a)
    assert [a.stat().st_size, a.stat().st_mtime_ns] == f.stamp
    with pytest.raises(InputChanged, match=r"a\.jsonl changed .*\(replaced by another file\)"):
        check_unchanged(f)
    a.unlink()
    with pytest.raises(InputChanged, match=r"a\.jsonl changed .*\(removed\); run again$"):
        check_unchanged(f)


# ----------------------------------------------------------------------------------------------
# What a directory holds besides documents


def junk_directory(tmp_path: Path) -> Path:
    junk = tmp_path / "junk"
    junk.mkdir()
    for i, d in enumerate(docs(12)):
        (junk / f"d{i:02d}.txt").write_text(d)
    rows(junk / "more.jsonl", docs(12, "row"))
    (junk / "doc.txt.gz").write_bytes(gzip.compress(b"compressed text"))
    (junk / "notes.md").write_text("# notes")
    (junk / "data.csv").write_text("a,b\n1,2\n")
    (junk / ".hidden.txt").write_text("hidden")
    (junk / ".git").mkdir()
    (junk / ".git" / "HEAD.txt").write_text("not walked into")
    (junk / "gone.txt").symlink_to(tmp_path / "nowhere.txt")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "far.txt").write_text("a document elsewhere")
    (junk / "linked").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    return junk


def test_a_directory_notes_and_counts_what_it_leaves_out(tmp_path, notes):
    junk = junk_directory(tmp_path)
    (group,) = resolve_inputs([junk])
    assert [Path(f.path).name for f in group.files] == [f"d{i:02d}.txt" for i in range(12)] + [
        "more.jsonl"
    ]
    assert skipped_note(group) == (
        f"note: --input {junk}: skipped 7 entries: 3 of other types (.csv x1, .md x1, .txt.gz "
        f"x1), 2 hidden ({junk}/.git, {junk}/.hidden.txt), 1 broken link ({junk}/gone.txt), 1 "
        f"linked directory, not followed ({junk}/linked)"
    )
    meta = prepare_documents(tmp_path / "d", [junk], **KW)
    assert skipped_note(group) in notes
    assert meta["sources"][0]["skipped"] == {
        "type": 3, "hidden": 2, "broken_link": 1, "linked_directory": 1, "duplicate_link": 0}  # fmt: skip


def test_a_pattern_leaves_out_what_a_directory_would_and_says_so(tmp_path, notes):
    """`junk/*` takes the files a walk of junk/ takes (and walks the folders it matches) and
    leaves out the same entries, with the same note and counts: other types and a broken link
    skipped, not fatal nor silent, and a linked folder not followed; a hidden name it matched
    was asked for."""
    junk = junk_directory(tmp_path)
    pattern = f"{junk}/*"
    (group,) = resolve_inputs([pattern])
    assert [Path(f.path).name for f in group.files] == [f"d{i:02d}.txt" for i in range(12)] + [
        "more.jsonl"
    ]
    assert skipped_note(group) == (
        f"note: --input {pattern}: skipped 5 entries: 3 of other types (.csv x1, .md x1, .txt.gz "
        f"x1), 1 broken link ({junk}/gone.txt), 1 linked directory, not followed ({junk}/linked)"
    )
    (hidden,) = resolve_inputs([f"{junk}/.h*"])
    assert [Path(f.path).name for f in hidden.files] == [".hidden.txt"]


def test_a_directory_of_nothing_readable_says_what_it_skipped_and_a_gz_text_is_refused_alike(
    tmp_path,
):
    only = tmp_path / "only"
    only.mkdir()
    (only / "doc.txt.gz").write_bytes(gzip.compress(b"text"))
    (only / "notes.md").write_text("x")
    with pytest.raises(DataError) as e:
        resolve_inputs([only])
    assert str(e.value).endswith(
        "(nor a saved datasets directory); skipped 2 entries: 2 of other types (.md x1, .txt.gz x1)"
    )
    with pytest.raises(DataError, match=r"doc\.txt\.gz: not a file type prepare reads"):
        resolve_inputs([only / "doc.txt.gz"])


def test_a_link_to_a_file_read_already_is_skipped_with_a_note_or_named_when_given_twice(
    tmp_path, notes
):
    sym = tmp_path / "sym"
    sym.mkdir()
    for i, d in enumerate(docs(12)):
        (sym / f"small{i}.txt").write_text(d)
    (sym / "dup.txt").symlink_to("small0.txt")  # sorts first: the file itself is kept
    (group,) = resolve_inputs([sym])
    names = [Path(f.path).name for f in group.files]
    assert names == sorted(f"small{i}.txt" for i in range(12))
    assert skipped_note(group) == (
        f"note: --input {sym}: skipped 1 entry: 1 link to a file read already ({sym}/dup.txt -> "
        f"{sym}/small0.txt)"
    )
    meta = prepare_documents(tmp_path / "d", [sym], **KW)
    assert meta["sources"][0]["skipped"]["duplicate_link"] == 1 and skipped_note(group) in notes
    with pytest.raises(DataError) as e:
        resolve_inputs([sym / "dup.txt", sym / "small0.txt"])
    assert str(e.value) == (
        f"{sym}/dup.txt is a link to {(sym / 'small0.txt').resolve()}, so that file is named twice "
        f"(by '{sym}/dup.txt' and '{sym}/small0.txt'); name each input once"
    )


# ----------------------------------------------------------------------------------------------
# Empty files, null texts, byte order marks


def test_empty_files_are_counted_and_named_like_empty_rows(tmp_path, notes):
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path / "in"
    d.mkdir()
    rows(d / "a.jsonl", docs(20))
    (d / "b_empty.jsonl").write_bytes(b"")
    (d / "c_empty.txt").write_bytes(b"")
    (d / "d_blank.jsonl").write_text("\n  \n\n")
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), d / "e_none.parquet")
    meta = prepare_documents(tmp_path / "out", [d], **KW)
    src = meta["sources"][0]
    assert (src["documents"], src["empty_files"], src["files"]) == (20, 4, 5)
    first = [str((d / n).resolve()) for n in ("b_empty.jsonl", "c_empty.txt", "d_blank.jsonl")]
    assert src["empty_files_first"] == first
    assert (
        f"note: left out 4 empty input files (0 bytes, or no row): {', '.join(first)}, and 1 more"
    ) in notes
    with pytest.raises(DataError) as e:  # nothing else: one line
        prepare_documents(tmp_path / "out2", [d / "b_empty.jsonl", d / "c_empty.txt"], **KW)
    assert str(e.value) == "the inputs hold no training document (2 empty files)"


def test_null_texts_are_left_out_as_empty_and_other_values_name_the_file_row_and_field(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = docs(20)
    lines = [json.dumps({"text": t}) for t in texts]
    lines[3] = '{"text": null}'
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
    pq.write_table(pa.table({"text": texts[:5] + [None] + texts[5:]}), tmp_path / "b.parquet")
    groups = resolve_inputs([tmp_path / "a.jsonl", tmp_path / "b.parquet"])
    got = kinds(groups)
    assert got[3] == ("empty", "") and got[20 + 5] == ("empty", "")
    assert [t for k, t in got if k == "doc"] == texts[:3] + texts[4:] + texts
    meta = prepare_documents(tmp_path / "d", [tmp_path / "a.jsonl", tmp_path / "b.parquet"], **KW)
    assert [(s["documents"], s["empty"]) for s in meta["sources"]] == [(19, 1), (20, 1)]
    lines[7] = '{"text": 12.5}'
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as e:
        kinds(resolve_inputs([tmp_path / "a.jsonl"]))
    assert str(e.value) == (
        f"{tmp_path / 'a.jsonl'} line 8: field 'text' is 12.5; expected a string (or null, left "
        "out as an empty text); fix the row, or pass --on-bad-row skip to leave such rows out "
        "(they are counted)"
    )


def test_a_byte_order_mark_opening_a_file_is_dropped(tmp_path, monkeypatch):
    texts = docs(6)
    bom = b"\xef\xbb\xbf"
    rows(tmp_path / "a.jsonl", texts, bom)
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress((tmp_path / "a.jsonl").read_bytes()))
    (tmp_path / "c.txt").write_bytes(bom + texts[0].encode())
    (tmp_path / "d.txt").write_bytes(bom)  # a mark and nothing else: an empty document
    inputs = [tmp_path / n for n in ("a.jsonl", "b.jsonl.gz", "c.txt", "d.txt")]
    assert kinds(resolve_inputs(inputs)) == [("doc", t) for t in texts * 2] + [
        ("doc", texts[0]), ("empty", "")]  # fmt: skip
    monkeypatch.setattr(corpus_mod, "LONG_TEXT_BYTES", 8)  # c.txt read in pieces
    (r,) = [r for r in read_records(resolve_inputs([tmp_path / "c.txt"]))]
    assert "".join(r.text.pieces()) == texts[0]


# ----------------------------------------------------------------------------------------------
# Bytes that are not UTF-8: one wording


def test_bad_utf8_is_said_alike_in_a_text_file_small_or_large_and_in_a_row(tmp_path, monkeypatch):
    (tmp_path / "t.txt").write_bytes(b"fine text, then \xff here")
    (tmp_path / "r.jsonl").write_bytes(b'{"text": "fine text, then \xff here"}\n')
    said = {}
    for size in ("small", "large"):
        if size == "large":
            monkeypatch.setattr(corpus_mod, "LONG_TEXT_BYTES", 4)
        with pytest.raises(DataError) as e:
            kinds(resolve_inputs([tmp_path / "t.txt"]))
        said[size] = str(e.value)
        (r,) = read_records(resolve_inputs([tmp_path / "t.txt"]), on_bad_utf8="skip")
        said[size + " skip"] = r.where
    with pytest.raises(DataError) as e:
        kinds(resolve_inputs([tmp_path / "r.jsonl"]))
    where = f"{tmp_path / 't.txt'}: byte 0xff at offset 16 is not UTF-8"
    fix = "; convert the input to UTF-8, or pass --on-bad-utf8 skip to leave such documents out"
    assert said == {"small": f"{where}{fix} (they are counted)", "large": said["small"],
                    "small skip": where, "large skip": where}  # fmt: skip
    assert str(e.value) == f"{tmp_path / 'r.jsonl'} line 1: byte 0xff at offset 26 is not UTF-8" + (
        f"{fix} (they are counted)"
    )


# ----------------------------------------------------------------------------------------------
# Notes a user sees: a resume, and a vocabulary the corpus cannot fill


def test_a_resume_says_what_it_keeps_and_where_it_goes_on(tmp_path, monkeypatch, notes):
    a = rows(tmp_path / "a.jsonl", docs(150, "a"))
    b = rows(tmp_path / "b.jsonl", docs(150, "b"))
    out, kw = tmp_path / "d", dict(KW, shard_tokens=1000)
    interrupt_after_shards(monkeypatch, 4)  # the record before any shard, then four shards
    with pytest.raises(KeyboardInterrupt):
        prepare_documents(out, [a, b], **kw)
    monkeypatch.undo()
    record = json.loads((out / ".progress.json").read_text())
    (file, row), shards = record["position"], sum(len(s["done"]) for s in record["splits"].values())
    assert shards == 4 and row > 0
    assert not [n for n in notes if n.startswith("note: resuming")]
    prepare_documents(out, [a, b], **kw)
    path = (a if file == 0 else b).resolve()
    assert [n for n in notes if n.startswith("note: resuming")] == [
        f"note: resuming {out}: {file} of 2 input files already written (4 shards kept); going "
        f"on from {path} after its first {row:,} lines"
    ]


def test_a_resume_after_a_text_file_counts_it_written(tmp_path, monkeypatch, notes):
    """A .txt file is one record: once its document is written the file is done, and the resume
    goes on from the next file (it said "k of N written; going on from file k after its record
    1" before, file k being written already)."""
    texts = [tmp_path / f"{i}.txt" for i in range(6)]
    for i, t in enumerate(texts):
        t.write_text(" ".join(docs(40, f"t{i}")))
    out, kw = tmp_path / "d", dict(KW, shard_tokens=1000, val_fraction=0.25)
    interrupt_after_shards(monkeypatch, 1)  # the record before any shard, then one shard
    with pytest.raises(KeyboardInterrupt):
        prepare_documents(out, texts, **kw)
    monkeypatch.undo()
    record = json.loads((out / ".progress.json").read_text())
    (file, row), shards = record["position"], sum(len(s["done"]) for s in record["splits"].values())
    assert row == 1 and file + 1 < len(texts) and shards == 1
    prepare_documents(out, texts, **kw)
    assert [n for n in notes if n.startswith("note: resuming")] == [
        f"note: resuming {out}: {file + 1} of 6 input files already written (1 shards kept); "
        f"going on from {texts[file + 1].resolve()}"
    ]


def test_notes_name_the_first_few_and_count_the_rest_alike(tmp_path):
    """A walk's skipped entries and the empty input files: the first three named, then "and N
    more" with N written as every count is (1,234)."""
    from llm_foundry.data.corpus import Group
    from llm_foundry.data.documents import _empty_files_note

    names = [f"f{i}" for i in range(1237)]
    hidden = skipped_note(Group("dir", "train", skipped={"hidden": names}))
    empty = _empty_files_note([{"empty_files": 1237, "empty_files_first": names[:3]}])
    assert (
        hidden
        == "note: --input dir: skipped 1237 entries: 1237 hidden (f0, f1, f2, and 1,234 more)"
    )
    assert empty.endswith(": f0, f1, f2, and 1,234 more")


def test_a_vocabulary_the_corpus_cannot_fill_is_a_plain_note_on_the_command_line(tmp_path, capsys):
    rows(tmp_path / "a.jsonl", docs(30))
    argv = ["prepare", "--input", str(tmp_path / "a.jsonl"), "--vocab-size", "3000", "--out",
            str(tmp_path / "d")]  # fmt: skip
    rc, err = cli_status(argv, capsys)
    assert rc == 0, err
    lines = [line for line in err.splitlines() if "BPE training stopped" in line]
    assert len(lines) == 1 and lines[0].startswith("note: BPE training stopped at "), err
    assert lines[0].endswith("(asked for 3,000): the corpus has no more pairs to merge")
    assert "Warning" not in err and "warn" not in err


def test_the_same_inputs_spelled_another_way_are_the_same_inputs(tmp_path, monkeypatch):
    """`big`, `./big/` and its absolute path name the same files: a complete prepare is not
    redone, an interrupted one resumes; another order is refused naming both spellings."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "big").mkdir()
    rows(tmp_path / "big" / "a.jsonl", docs(200, "a"))
    rows(tmp_path / "big" / "b.jsonl", docs(200, "b"))
    rows(tmp_path / "c.jsonl", docs(20, "c"))
    kw = dict(KW, shard_tokens=2000)
    interrupt_after_shards(monkeypatch, 1)
    with pytest.raises(KeyboardInterrupt):
        prepare_documents(tmp_path / "d", ["big", "c.jsonl"], **kw)
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    resumed = prepare_documents(tmp_path / "d", [str(tmp_path / "big"), "./c.jsonl"], **kw)
    assert resumed["timing"]["resumed"]
    whole = prepare_documents(tmp_path / "ref", ["big", "c.jsonl"], **kw)
    assert resumed["sha256"] == whole["sha256"]
    with pytest.raises(AlreadyPrepared):  # complete: nothing to do
        prepare_documents(tmp_path / "d", ["./big/", str(tmp_path / "c.jsonl")], **kw)
    with pytest.raises(DataError) as e:
        prepare_documents(tmp_path / "d", ["c.jsonl", "big"], **kw)
    assert ("(the inputs are given in another order or grouping: " + str(tmp_path / "big")
            + " ./c.jsonl then, c.jsonl big now)") in str(e.value)  # fmt: skip
