"""``load_any(model, tokenizer=FILE)`` (``--tokenizer FILE``): a bare HF tokenizer.json kept
apart from its model ends where the model does: its eos is the one the model's
generation_config.json or config.json names, as transformers' ``GenerationConfig`` reads it."""

from __future__ import annotations

import json

import pytest
from conftest import tiny_hf_llama

from llm_foundry.loading import load_any

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")


def _bare_tokenizer(path) -> int:
    """A word-level tokenizer.json with no file beside it naming a special token; returns its
    vocabulary size."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>", "<|end|>", *(f"w{i}" for i in range(20))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>", "<|end|>"])
    tok.save(str(path))
    return tok.get_vocab_size()


@pytest.mark.parametrize("where", ["config", "generation_config"])
def test_a_bare_tokenizer_given_apart_takes_the_models_eos(tmp_path, where):
    (tmp_path / "tok").mkdir()
    vocab = _bare_tokenizer(tmp_path / "tok" / "tokenizer.json")
    model = tmp_path / "model"
    tiny_hf_llama(vocab_size=vocab, bos_token_id=1, eos_token_id=2).save_pretrained(str(model))
    (model / "generation_config.json").unlink(missing_ok=True)
    if where == "generation_config":  # two end ids, as Llama 3 lists end of text and of turn
        (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 2]}))
    if where == "config":  # what transformers derives from config.json when no file says more
        config = transformers.AutoConfig.from_pretrained(str(model))
        want = transformers.GenerationConfig.from_model_config(config).eos_token_id
    else:
        want = transformers.GenerationConfig.from_pretrained(str(model)).eos_token_id
    want = want if isinstance(want, list) else [want]

    _, tok, info = load_any(model, tokenizer=tmp_path / "tok" / "tokenizer.json")
    assert tok.kind == "hf"
    assert (tok.eos_id, info.eos_ids) == (want[0], set(want))
    assert want == ([2] if where == "config" else [3, 2])  # the two cases are not the same
