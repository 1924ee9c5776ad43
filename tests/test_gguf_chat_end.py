"""Where llama.cpp ends a reply in a GGUF export, checked by llama.cpp itself (llama-cpp-python,
the vocabulary alone): a character model has no end-of-text token, so the GGUF names a stand-in
eos and both notes say what that means (llama.cpp stops after that character; its chat does not
stop at the built-in template's end of turn, a newline); an HF template whose turn ends with a
special token other than eos gets that token as llama.cpp's eot, where llama.cpp stops."""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("gguf", reason="GGUF export needs the gguf package: pip install gguf")
llama_cpp = pytest.importorskip("llama_cpp", reason="llama.cpp checks need llama-cpp-python")

from llm_foundry.checkpoint import save_checkpoint  # noqa: E402
from llm_foundry.cli import main  # noqa: E402
from llm_foundry.config import ModelConfig  # noqa: E402
from llm_foundry.models import Transformer  # noqa: E402
from llm_foundry.tokenizer import CharTokenizer  # noqa: E402

# the end of turn is a token of its own that llama.cpp does not know by its name (it stops at
# <|im_end|>, <|eot_id|>, ... whatever the GGUF says)
TURN_END = "<|turn_over|>"
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}" + TURN_END + "{% endfor %}"


def _vocab(path):
    """llama.cpp's view of a GGUF file: (the model, is_eog(id) for an id)."""
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    return llm, lambda i: bool(llama_cpp.llama_vocab_is_eog(llm._model.vocab, i))


def _convert(capsys, src, out) -> list[str]:
    assert main(["convert", "--to-gguf", str(src), "--out", str(out)]) == 0
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]


def test_a_character_model_names_a_stand_in_eos_and_says_what_chat_lacks(tmp_path, capsys):
    tok = CharTokenizer.train("ROMEO: But soft, what light?\nJULIET: Ay me!\n")
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tok.vocab_size, dim=32, n_layers=1, n_heads=2, max_seq_len=32)
    ckpt = save_checkpoint(Transformer(cfg), tmp_path / "ckpt")
    tok.save(ckpt / "tokenizer.json")
    notes = _convert(capsys, ckpt, tmp_path / "char.gguf")
    assert len(notes) == 2, notes
    chat_note, eos_note = sorted(notes, key=lambda n: "chat template" not in n)
    named = re.search(r"names id (\d+) \('(.)'\): llama\.cpp stops generating after it", eos_note)
    assert named and "has no bos/eos token" in eos_note, eos_note
    assert chat_note.startswith("note: the chat template ends a turn with '\\n'")
    assert "stop=['\\n']" in chat_note
    llm, is_eog = _vocab(tmp_path / "char.gguf")
    try:  # what the notes say is what llama.cpp does
        stand_in = int(named.group(1))
        assert llm.token_eos() == stand_in and tok.chars[stand_in] == named.group(2)
        assert is_eog(stand_in) and not is_eog(tok.encode("\n")[0])
    finally:
        llm.close()


def test_an_hf_end_of_turn_token_is_llama_cpps_eot(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from conftest import tiny_hf_llama
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    hf_tok = Tokenizer(models.BPE())
    hf_tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf_tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", TURN_END], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    hf_tok.train_from_iterator(["user: hello there assistant: hi"] * 10, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=hf_tok, eos_token="<|endoftext|>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(str(tmp_path / "hf"))
    tiny_hf_llama(vocab_size=len(fast), eos_token_id=fast.eos_token_id).save_pretrained(
        str(tmp_path / "hf")
    )
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ck")]) == 0
    for src in ("hf", "ck"):  # the HF directory and our checkpoint of it alike
        assert not _convert(capsys, tmp_path / src, tmp_path / f"{src}.gguf")
        llm, is_eog = _vocab(tmp_path / f"{src}.gguf")
        try:
            end = fast.convert_tokens_to_ids(TURN_END)
            assert llm.token_eos() == fast.eos_token_id and is_eog(end)
            assert llm.metadata["tokenizer.chat_template"] == TEMPLATE
            assert json.loads(llm.metadata["tokenizer.ggml.eot_token_id"]) == end
        finally:
            llm.close()
