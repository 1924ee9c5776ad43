"""Our character tokenizer in an HF export: ``convert --to-hf`` writes its HF equivalent
(``CharTokenizer.to_hf``) as tokenizer.json, which transformers' ``AutoTokenizer`` reads and which
encodes and decodes as ``CharTokenizer`` does (tiny Shakespeare whole, unusual characters, the
characters it lacks); a model exported with it generates the same greedy text in transformers as
in ``llm-foundry generate``; and ``convert --from-hf`` brings it back as a ``CharTokenizer``."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_decisive, corpus_text
from tokenizers import normalizers

transformers = pytest.importorskip("transformers")

from llm_foundry.checkpoint import save_checkpoint  # noqa: E402
from llm_foundry.cli import main  # noqa: E402
from llm_foundry.config import ModelConfig  # noqa: E402
from llm_foundry.interop.hf import copy_tokenizer, name_special_tokens  # noqa: E402
from llm_foundry.models import Transformer  # noqa: E402
from llm_foundry.tokenizer import (  # noqa: E402
    CharTokenizer,
    HFTokenizerFile,
    load_any_tokenizer,
    load_tokenizer,
)

# every kind of character a corpus may hold: whitespace of each sort, a combining accent, a
# zero-width joiner inside an emoji, NUL, U+2581 and "Ġ" (other tokenizers' space marks), a
# private-use code point, the markers HF tokenizers treat specially, spaces before punctuation
# (transformers' clean-up would remove them) and leading/trailing spaces
ODD = (
    "  lead\r\n\ttab\u00a0nbsp\u2028line\x00nul e\u0301 👩\u200d💻 ▁Ġ \ue000 <unk> [UNK] <s></s>\n"
    "a , b . c ! d ? e 's f n't g 'm h 've i 're j ' k \u3000  \n\n"
)


def _export_tokenizer(tok: CharTokenizer, tmp_path):
    """``tok`` through the export's own steps (copy_tokenizer, name_special_tokens) into an HF
    directory; transformers' AutoTokenizer on it."""
    src, out = tmp_path / "ours", tmp_path / "hf"
    src.mkdir()
    out.mkdir()
    tok.save(src / "tokenizer.json")
    copy_tokenizer(src, out)
    name_special_tokens(out)
    return out, transformers.AutoTokenizer.from_pretrained(str(out))


def test_hf_form_encodes_tiny_shakespeare_as_ours(shared_data, tmp_path):
    text = (shared_data / "tinyshakespeare.txt").read_text(encoding="utf-8")
    tok = CharTokenizer.train(text)
    out, auto = _export_tokenizer(tok, tmp_path)
    ids = tok.encode(text)
    assert len(ids) == len(text) > 1_000_000 and tok.vocab_size == 65
    hf = auto.backend_tokenizer
    assert hf.encode(text).ids == ids  # the file's own tokenizer, every character
    assert hf.decode(ids) == text
    part = text[:200_000]  # transformers' own calls, on a slice (they copy more per call)
    assert auto(part)["input_ids"] == ids[:200_000]
    assert auto.decode(ids[:200_000]) == part
    assert auto.bos_token_id is auto.eos_token_id is auto.pad_token_id is None
    assert len(auto) == tok.vocab_size  # no special token added to the vocabulary


def test_unusual_characters_encode_and_decode_as_ours(tmp_path):
    tok = CharTokenizer.train(ODD)
    _, auto = _export_tokenizer(tok, tmp_path)
    ids = tok.encode(ODD)
    assert len(ids) == len(ODD)  # one id a code point: "👩\u200d💻" is three, "e\u0301" two
    assert auto(ODD)["input_ids"] == auto.encode(ODD) == ids
    assert auto.decode(ids) == tok.decode(ids) == ODD
    assert auto.convert_ids_to_tokens(ids[:4]) == [" ", " ", "l", "e"]
    for piece in ("<unk>", "[UNK]", "<s>", " , ", "\r\n"):
        assert auto(piece)["input_ids"] == tok.encode(piece), piece


def test_characters_outside_the_alphabet_are_refused_by_both(tmp_path):
    """A character the vocabulary lacks: ours raises naming it, HF's raises too (its WordLevel
    vocabulary holds no unknown token). An id past the vocabulary: ours raises, HF's decode
    skips it, as it does for any tokenizer."""
    tok = CharTokenizer.train("abc \n")
    _, auto = _export_tokenizer(tok, tmp_path)
    with pytest.raises(ValueError, match="character 'z' at position 2 is not in the vocabulary"):
        tok.encode("abz")
    with pytest.raises(Exception, match=r"Missing \[UNK\] token from the vocabulary"):
        auto("abz")
    with pytest.raises(Exception, match=r"Missing \[UNK\] token from the vocabulary"):
        auto.backend_tokenizer.encode("é")
    with pytest.raises(ValueError, match="token id 9 is out of range for a vocabulary of 5"):
        tok.decode([0, 9, 1])
    assert auto.decode([0, 9, 1]) == tok.decode([0, 1])


def test_our_loader_reads_the_hf_form_back_as_the_char_tokenizer(tmp_path):
    tok = CharTokenizer.train(ODD)
    out, _ = _export_tokenizer(tok, tmp_path)
    back = load_tokenizer(out / "tokenizer.json")
    assert isinstance(back, CharTokenizer) and back.chars == tok.chars
    assert load_any_tokenizer(out / "tokenizer.json").chars == tok.chars
    # another WordLevel file is an HF tokenizer of its own, not taken for ours
    hf = tok.to_hf()
    hf.normalizer = normalizers.Lowercase()
    hf.save(str(tmp_path / "lower.json"))
    with pytest.raises(ValueError, match=r"\): its 'normalizer' is \{'type': 'Lowercase'\}"):
        load_tokenizer(tmp_path / "lower.json")
    assert isinstance(load_any_tokenizer(tmp_path / "lower.json"), HFTokenizerFile)
    data = json.loads(tok.to_hf().to_str())
    data["model"]["vocab"]["ab"] = len(tok.chars)
    (tmp_path / "words.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"words\.json .*'model.vocab' is not single characters"):
        load_tokenizer(tmp_path / "words.json")


@torch.no_grad()
def test_an_exported_char_model_generates_our_text_in_transformers(tmp_path, capsys):
    """A random character model (its head scaled so that greedy choices are clear), exported with
    ``convert --to-hf``: AutoTokenizer + AutoModelForCausalLM greedy text from a prompt equals
    ``llm-foundry generate``'s; the HF directory and its ``convert --from-hf`` copy generate it too."""
    tok = CharTokenizer.train(corpus_text(20_000))
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tok.vocab_size, dim=48, n_layers=2, n_heads=4, max_seq_len=128)
    model = Transformer(cfg).eval()
    model.lm_head.weight.mul_(20.0)  # logits of a few units: choices vary with the context
    save_checkpoint(model, tmp_path / "ck")
    tok.save(tmp_path / "ck" / "tokenizer.json")
    assert main(["convert", "--to-hf", str(tmp_path / "ck"), "--out", str(tmp_path / "hf")]) == 0

    prompt, n = "ROMEO:\nBut soft, what light", 32
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    ids = auto(prompt, return_tensors="pt")["input_ids"]
    assert ids[0].tolist() == tok.encode(prompt)
    out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    assert_decisive(hf(input_ids=out[:, :-1]).logits[:, ids.shape[1] - 1 :], "HF greedy")
    hf_text = auto.decode(out[0, ids.shape[1] :])
    assert len(hf_text) == n and len(set(hf_text)) > 3  # not one character repeated

    convert = ["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back")]
    assert main(convert) == 0
    assert isinstance(load_tokenizer(tmp_path / "back" / "tokenizer.json"), CharTokenizer)
    capsys.readouterr()
    for source in ("ck", "hf", "back"):
        argv = ["generate", "--checkpoint", str(tmp_path / source), "--prompt", prompt]
        assert main(argv + ["--max-new-tokens", str(n), "--temperature", "0", "--json"]) == 0
        rec = json.loads(capsys.readouterr().out)
        assert rec["completion"] == hf_text, source
