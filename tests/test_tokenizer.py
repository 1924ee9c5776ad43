"""Tokenizers: exact round trips, clear errors, one-file save/load, vocabulary sizes."""

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_foundry.tokenizer import (
    CHAT_TOKENS,
    BPETokenizer,
    CharTokenizer,
    build_tokenizer,
    load_tokenizer,
)

# a few KB of mixed text: prose, verse, code, digits and some non-ASCII
CORPUS = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\n"
    "All:\nSpeak, speak.\n\n"
    "First Citizen:\nYou are all resolved rather to die than to famish?\n\n"
    "def encode(text):\n    return [stoi[c] for c in text]  # 42 ids, 3.14 each\n\n"
    "Café, naïve, über, señor; 東京 and 北京; emoji 🙂 and ✓.\n"
) * 12


@pytest.fixture(scope="module")
def bpe():
    return BPETokenizer.train([CORPUS], vocab_size=300)


# ----------------------------------------------------------------------------------------------
# char


def test_char_round_trip_and_sorted_vocabulary():
    tok = CharTokenizer.train("hello world")
    assert tok.chars == " dehlorw"  # sorted, as nanoGPT's shakespeare_char
    assert tok.vocab_size == 8
    ids = tok.encode("old hero")
    assert ids == [tok.chars.index(c) for c in "old hero"]
    assert tok.decode(ids) == "old hero"
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (None, None, None)


def test_char_unseen_character_names_it_and_its_position():
    tok = CharTokenizer.train("abc def")
    with pytest.raises(ValueError, match=r"character 'é' at position 4 is not in the vocabulary"):
        tok.encode("abc é")
    with pytest.raises(ValueError, match=r"'\\n' at position 3 .*\(7 characters"):
        tok.encode("abc\n")


def test_char_decode_rejects_out_of_range_ids():
    tok = CharTokenizer.train("ab")
    with pytest.raises(ValueError, match="token id 2 is out of range for a vocabulary of 2"):
        tok.decode([0, 1, 2])
    with pytest.raises(ValueError, match="token id -1"):
        tok.decode([-1])


def test_char_train_on_empty_text_fails():
    with pytest.raises(ValueError, match="empty text"):
        CharTokenizer.train("")


def test_char_save_load(tmp_path):
    tok = CharTokenizer.train("To be, or not to be: that is the question.\n")
    path = tmp_path / "tokenizer.json"
    tok.save(path)
    assert json.loads(path.read_text()) == {"type": "char", "chars": tok.chars}
    loaded = load_tokenizer(path)
    assert isinstance(loaded, CharTokenizer)
    text = "not to be, that is the question"
    assert loaded.encode(text) == tok.encode(text)


# ----------------------------------------------------------------------------------------------
# BPE


@settings(max_examples=150, deadline=None)
@given(st.text())
def test_bpe_round_trips_any_unicode_text(bpe, text):
    assert bpe.decode(bpe.encode(text)) == text


def test_bpe_round_trips_corpus_and_unseen_scripts(bpe):
    for text in (CORPUS, "Ελληνικά, русский, العربية, \x00\t\r\n, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢", ""):
        assert bpe.decode(bpe.encode(text)) == text


def test_bpe_vocab_size_honoured():
    for size in (259, 280, 300):
        assert BPETokenizer.train([CORPUS], vocab_size=size).vocab_size == size


def test_a_vocabulary_the_corpus_cannot_fill_is_a_logged_note_not_a_python_warning():
    import logging
    import warnings

    got = []

    class Keep(logging.Handler):
        def emit(self, record):
            got.append((record.name, record.levelno, record.getMessage()))

    log, keep = logging.getLogger("llm_foundry"), Keep()
    log.addHandler(keep)  # the logger the command line prints (propagating or not)
    try:
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            tok = BPETokenizer.train([CORPUS], vocab_size=5000)
    finally:
        log.removeHandler(keep)
    assert warned == [] and tok.vocab_size < 5000
    assert got == [
        ("llm_foundry.tokenizer", logging.WARNING, f"note: BPE training stopped at "
         f"{tok.vocab_size:,} ids (asked for 5,000): the corpus has no more pairs to merge")
    ]  # fmt: skip


def test_bpe_vocab_size_below_bytes_plus_specials_rejected():
    with pytest.raises(ValueError, match=r">= 259 .*got 258"):
        BPETokenizer.train([CORPUS], vocab_size=258)


def test_bpe_merges_shorten_the_text(bpe):
    bytes_only = BPETokenizer.train([CORPUS], vocab_size=259)  # no merges: one id per byte
    assert len(bytes_only.encode(CORPUS)) == len(CORPUS.encode("utf-8"))
    assert len(bpe.encode(CORPUS)) < 0.75 * len(CORPUS.encode("utf-8"))


def test_bpe_special_tokens_distinct_and_never_read_from_text(bpe):
    specials = (bpe.bos_id, bpe.eos_id, bpe.pad_id)
    assert specials == (0, 1, 2)
    assert bpe.decode(list(specials)) == "<bos><eos><pad>"
    ids = bpe.encode("a <bos> b <eos> <pad>")  # written text, not control tokens
    assert not set(ids) & set(specials)


def test_bpe_for_documents_reserves_the_chat_markers_after_the_specials(bpe, tmp_path):
    chat = BPETokenizer.train([CORPUS], vocab_size=300, chat_tokens=True)
    assert CHAT_TOKENS == ("<|im_start|>", "<|im_end|>")
    assert chat.special_ids == {"<bos>": 0, "<eos>": 1, "<pad>": 2, "<|im_start|>": 3,
                                "<|im_end|>": 4}  # fmt: skip
    assert chat.vocab_size == 300 and chat.decode([3, 4]) == "<|im_start|><|im_end|>"
    assert not set(chat.encode("<|im_start|>user hi<|im_end|>")) & {3, 4}  # text stays text
    chat.save(tmp_path / "chat.json")
    assert load_tokenizer(tmp_path / "chat.json").chat_ids == {"<|im_start|>": 3, "<|im_end|>": 4}
    # a tokenizer trained without them (all saved before) still loads, with none
    bpe.save(tmp_path / "plain.json")
    plain = load_tokenizer(tmp_path / "plain.json")
    assert plain.chat_ids == {} and plain.special_ids == {"<bos>": 0, "<eos>": 1, "<pad>": 2}
    with pytest.raises(ValueError, match=r">= 261 \(256 bytes \+ 5 special tokens\); got 260"):
        BPETokenizer.train([CORPUS], vocab_size=260, chat_tokens=True)


def test_bpe_save_load_identical_encodings(bpe, tmp_path):
    path = tmp_path / "tokenizer.json"
    bpe.save(path)
    loaded = load_tokenizer(path)
    assert isinstance(loaded, BPETokenizer)
    assert loaded.vocab_size == bpe.vocab_size
    assert (loaded.bos_id, loaded.eos_id, loaded.pad_id) == (bpe.bos_id, bpe.eos_id, bpe.pad_id)
    for text in (CORPUS, "unseen words: zyxwvut, 日本語, <eos>"):
        assert loaded.encode(text) == bpe.encode(text)


def test_bpe_file_is_a_hugging_face_tokenizer_json(bpe, tmp_path):
    from tokenizers import Tokenizer

    path = tmp_path / "tokenizer.json"
    bpe.save(path)
    hf = Tokenizer.from_file(str(path))
    assert hf.encode("speak, speak", add_special_tokens=False).ids == bpe.encode("speak, speak")


def test_bpe_decode_rejects_out_of_range_ids(bpe):
    with pytest.raises(ValueError, match=f"token id {bpe.vocab_size} is out of range"):
        bpe.decode([5, bpe.vocab_size])


# ----------------------------------------------------------------------------------------------
# build / load


def test_build_tokenizer_kinds():
    assert isinstance(build_tokenizer("char", CORPUS), CharTokenizer)
    assert isinstance(build_tokenizer("char", [CORPUS[:50], CORPUS[50:]]), CharTokenizer)
    assert build_tokenizer("bpe", [CORPUS], vocab_size=270).vocab_size == 270


def test_build_tokenizer_unknown_kind_names_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown tokenizer kind 'wordpiece'.*char, bpe"):
        build_tokenizer("wordpiece", CORPUS)


def test_build_char_tokenizer_rejects_vocab_size():
    with pytest.raises(ValueError, match="vocab_size must be None, got 100"):
        build_tokenizer("char", CORPUS, vocab_size=100)


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing.json does not exist"):
        load_tokenizer(tmp_path / "nothing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json is not valid JSON"):
        load_tokenizer(bad)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"type": "wordpiece"}))
    with pytest.raises(ValueError, match=r"other.json is neither .* keys: \['type'\]"):
        load_tokenizer(other)


# ----------------------------------------------------------------------------------------------
# damaged tokenizer files: one line naming the file, what was wrong and what was expected


def _load_error(path) -> str:
    with pytest.raises(ValueError) as err:
        load_tokenizer(path)
    message = str(err.value)
    assert "\n" not in message and str(path) in message
    return message


@pytest.mark.parametrize(
    "chars, wrong",
    [
        (5, r"'chars' is a number \(5\); expected a string of distinct characters"),
        (["a", "b"], r"'chars' is a list; expected a string"),
        (None, r"'chars' is null; expected a string"),
        ("", r"'chars' is empty; expected at least one character"),
        ("abca", r"'chars' holds 'a' twice \(at 0 and 3\); expected distinct characters"),
    ],
)
def test_char_file_with_bad_chars_is_named(tmp_path, chars, wrong):
    path = tmp_path / "tok.json"
    path.write_text(json.dumps({"type": "char", "chars": chars}))
    assert re.search(r"tok\.json \(a char tokenizer\): " + wrong, _load_error(path))


def test_char_file_without_chars_is_named(tmp_path):
    path = tmp_path / "tok.json"
    path.write_text(json.dumps({"type": "char"}))
    assert "tok.json (a char tokenizer) has no 'chars'; expected 'chars'" in _load_error(path)


def _drop_special(data, token="<eos>"):
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] != token]
    del data["model"]["vocab"][token]


def _no_bytes(data):
    data["model"]["vocab"], data["model"]["merges"] = {}, []


BAD_BPE = {
    "no vocab": (
        lambda d: d["model"].pop("vocab"),
        r"'model\.vocab' is missing; expected an object of token -> id",
    ),
    "vocab a list": (
        lambda d: d["model"].update(vocab=["a", "b"]),
        r"'model\.vocab' is a list; expected an object",
    ),
    "vocab id a string": (
        lambda d: d["model"]["vocab"].update(a="x"),
        r"'model\.vocab' gives 'a' the id 'x'; expected ids that are integers >= 0",
    ),
    "no merges": (
        lambda d: d["model"].pop("merges"),
        r"'model\.merges' is missing; expected a list of merges \(empty for a vocabulary of bytes",
    ),
    "merges null": (
        lambda d: d["model"].update(merges=None),
        r"'model\.merges' is null; expected a list",
    ),
    "merge of unknown tokens": (  # left to tokenizers: its error rewrapped, file named
        lambda d: d["model"].update(merges=[["zzq", "qqz"]]),
        r"cannot be read by Hugging Face tokenizers \(Token `zzq` out of vocabulary at line 1 "
        r"column \d+\); expected a file saved by BPETokenizer\.save",
    ),
    "no <eos>": (
        _drop_special,
        r"lacks the special tokens \['<eos>'\]; expected all of \['<bos>', '<eos>', '<pad>'\]",
    ),
    "no byte tokens": (  # loads in tokenizers, then encodes every text to []
        _no_bytes,
        r"'model\.vocab' lacks 256 of the 256 byte-level symbols .* so encode would drop text",
    ),
    "no pre-tokenizer": (  # loads in tokenizers, then drops every space and newline
        lambda d: d.update(pre_tokenizer=None),
        r"does not give text back: .* decodes as 'Hithere,.*'; expected a byte-level BPE",
    ),
}


@pytest.mark.parametrize("case", BAD_BPE)
def test_bpe_file_with_bad_fields_is_named(bpe, tmp_path, case):
    damage, wrong = BAD_BPE[case]
    path = tmp_path / "tokenizer.json"
    bpe.save(path)
    data = json.loads(path.read_text())
    damage(data)
    path.write_text(json.dumps(data))
    message = _load_error(path)
    assert re.search(r"tokenizer\.json \(a BPE tokenizer\.json\).* " + wrong, message), message


def test_bpe_file_with_empty_merges_loads_as_bytes_only(tmp_path):
    """An empty merges list is what training to 259 ids writes (no merges): a valid tokenizer;
    a merges field that is absent is not (tokenizers itself refuses it)."""
    path = tmp_path / "tokenizer.json"
    BPETokenizer.train([CORPUS], vocab_size=259).save(path)
    data = json.loads(path.read_text())
    assert data["model"]["merges"] == []
    tok = load_tokenizer(path)
    assert tok.decode(tok.encode(CORPUS)) == CORPUS
    del data["model"]["merges"]
    path.write_text(json.dumps(data))
    assert "'model.merges' is missing; expected a list of merges" in _load_error(path)


def test_truncated_empty_and_non_utf8_files_are_named(bpe, tmp_path):
    path = tmp_path / "tokenizer.json"
    bpe.save(path)
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    assert re.search(
        r"tokenizer\.json is not valid JSON \(.*: line \d+ column \d+\); expected a tokenizer "
        r"saved by llm-foundry",
        _load_error(path),
    )
    for blank in ("", " \n"):
        path.write_text(blank)
        assert "tokenizer.json is empty; expected a tokenizer saved by" in _load_error(path)
    path.write_bytes('{"type": "char", "chars": "café"}'.encode("latin-1"))
    assert "tokenizer.json is not UTF-8 text (byte 0xe9 at offset 30); expected" in _load_error(
        path
    )
