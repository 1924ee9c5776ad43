"""What is published is on disk first: every file of a prepared directory (text stream, SFT rows,
preference pairs) and of an export is fsynced under its temporary name before the rename (or
link) that publishes it, and the directory after it, so that a power loss never leaves a name
(meta.json above all) pointing at bytes that were still in memory. Watched at the system calls:
``os.fsync`` (the path behind each descriptor, from /proc) and the renames and links."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from llm_foundry.data import prepare
from llm_foundry.data.preference import prepare_preference
from llm_foundry.data.sft import prepare_sft
from llm_foundry.outputs import new_directory, new_file
from llm_foundry.tokenizer import CharTokenizer

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/fd").is_dir(), reason="reads the path behind a descriptor in /proc"
)

TEXT = "ROMEO: what light through yonder window breaks?\nJULIET: ay me!\n" * 40


@pytest.fixture
def disk(monkeypatch) -> list[tuple]:
    """The fsyncs ("fsync", path), publishing steps ("rename", src, dst) and deletions
    ("unlink", path) this process makes, in order (each still done)."""
    events: list[tuple] = []
    real = {name: getattr(os, name) for name in ("fsync", "replace", "rename", "link", "unlink")}

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real["fsync"](fd)

    def moved(name):
        def call(src, dst, *args, **kwargs):
            events.append(("rename", os.path.abspath(src), os.path.abspath(dst)))
            return real[name](src, dst, *args, **kwargs)

        return call

    def unlink(path, *args, **kwargs):
        events.append(("unlink", os.path.abspath(path)))
        return real["unlink"](path, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "unlink", unlink)
    for name in ("replace", "rename", "link"):
        monkeypatch.setattr(os, name, moved(name))
    return events


def assert_published_durably(events: list[tuple], published: list[Path]) -> None:
    """Each path of ``published`` was put in place by a rename (or link) of a temporary that
    was fsynced before it (a directory: with every file in it), and its directory was fsynced
    after the last of them."""
    synced: list[str] = []
    placed: dict[str, int] = {}
    for i, event in enumerate(events):
        if event[0] == "fsync":
            synced.append(event[1])
        elif event[0] == "rename":
            _, src, dst = event
            under = [p for p in synced if p == src or p.startswith(src + os.sep)]
            placed[dst] = i if src in synced else -1
            if Path(dst).is_dir():  # its files too, each under the temporary's name
                names = {str(f.relative_to(dst)) for f in Path(dst).rglob("*")}
                done = {os.path.relpath(p, src) for p in under}
                assert names <= done, f"{dst}: {sorted(names - done)} not fsynced before"
    for path in published:
        key = str(path.resolve())
        assert placed.get(key, -1) >= 0, f"{path} was not fsynced before it was put in place"
        later = [e for e in events[placed[key] + 1 :] if e == ("fsync", str(path.parent.resolve()))]
        assert later, f"{path.parent} was not fsynced after {path.name} was put in place"


def test_a_prepared_text_stream_is_on_disk_before_it_is_published(tmp_path, disk):
    (tmp_path / "corpus.txt").write_text(TEXT)
    out = tmp_path / "data"
    prepare(out, text_files=[tmp_path / "corpus.txt"], tokenizer="char", progress=False)
    names = ["train.bin", "val.bin", "tokenizer.json", "meta.json"]
    assert_published_durably(disk, [out / n for n in names])


def test_prepared_sft_rows_and_preference_pairs_are_on_disk_before_they_are_published(
    tmp_path, disk
):
    tok = CharTokenizer.train(TEXT + "abcdefghijklmnopqrstuvwxyzUSERASSISTANT")
    tok.save(tmp_path / "tokenizer.json")
    sft = [{"prompt": "ROMEO: what light", "completion": " through yonder window"}] * 8
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft))
    pairs = [{"prompt": "ROMEO:", "chosen": " ay me", "rejected": " what"}] * 8
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
    prepare_sft(tmp_path / "sft", tmp_path / "sft.jsonl", tmp_path / "tokenizer.json", 0.25)
    prepare_preference(tmp_path / "pref", tmp_path / "pairs.jsonl", tmp_path / "tokenizer.json")
    for out in (tmp_path / "sft", tmp_path / "pref"):
        names = [f"{s}{x}" for s in ("train", "val") for x in (".bin", ".mask.bin", ".offsets.bin")]
        names += ["tokenizer.json", "meta.json"]
        assert_published_durably(disk, [out / n for n in names])


def test_an_export_is_on_disk_before_it_is_published(tmp_path, disk):
    with new_directory(tmp_path / "hf") as tmp:
        (tmp / "config.json").write_text("{}")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "weights.bin").write_bytes(b"\0" * 1000)
    with new_file(tmp_path / "model.gguf") as tmp:
        tmp.write_bytes(b"GGUF" * 100)
    assert_published_durably(disk, [tmp_path / "hf", tmp_path / "model.gguf"])
    assert (tmp_path / "hf" / "sub" / "weights.bin").stat().st_size == 1000


def test_an_earlier_tokenizers_metadata_is_removed_only_once_meta_json_is_gone(tmp_path, disk):
    """A second prepare --sft into the same directory with a tokenizer that has no
    generation_config.json: meta.json is unlinked and the directory fsynced before the earlier
    file is deleted (a reader or a crash in between never sees a meta.json naming a missing
    file), and that before any file is renamed into place; meta.json comes last."""
    tok = CharTokenizer.train(TEXT + "abcdefghijklmnopqrstuvwxyz")
    rows = [{"prompt": "ROMEO: what light", "completion": " through yonder window"}] * 8
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name in ("with", "without"):
        (tmp_path / name).mkdir()
        tok.save(tmp_path / name / "tokenizer.json")
    (tmp_path / "with" / "generation_config.json").write_text('{"eos_token_id": 1}\n')
    out = tmp_path / "sft"
    prepare_sft(out, tmp_path / "sft.jsonl", tmp_path / "with" / "tokenizer.json", 0.25)
    assert (out / "generation_config.json").is_file()
    disk.clear()
    prepare_sft(out, tmp_path / "sft.jsonl", tmp_path / "without" / "tokenizer.json", 0.25,
                restart=True)  # fmt: skip
    assert not (out / "generation_config.json").exists()
    assert "generation_config.json" not in json.loads((out / "meta.json").read_text())["files"]

    at = {event: i for i, event in reversed(list(enumerate(disk)))}  # first occurrence
    meta, stale = (
        str((out / "meta.json").resolve()),
        str((out / "generation_config.json").resolve()),
    )
    gone, deleted = at[("unlink", meta)], at[("unlink", stale)]
    into_out = [
        i for i, e in enumerate(disk) if e[0] == "rename" and Path(e[2]).parent == out.resolve()
    ]
    synced = [i for i, e in enumerate(disk) if e == ("fsync", str(out.resolve()))]
    assert any(gone < i < deleted for i in synced), "the directory was not fsynced between"
    assert deleted < min(into_out), "an earlier file was deleted after files were renamed in"
    assert disk[max(into_out)][2] == meta, "meta.json was not the last file put in place"
