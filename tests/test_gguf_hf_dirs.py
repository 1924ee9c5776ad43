"""GGUF export of HF directories, checked in llama.cpp against transformers and AutoTokenizer:
a byte-level tokenizer with no merges at all (bytes and special tokens only) loads and computes
transformers' logits; a tokenizer GGUF cannot hold is refused naming its file and the way to
convert it instead."""

from __future__ import annotations

import pytest
import torch
from conftest import cli_status

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf", reason="GGUF export needs the gguf package: pip install gguf")

from test_gguf import LLAMA_CPP, TOL_F32, _llama_logits  # noqa: E402

from llm_foundry.export import convert_to_gguf  # noqa: E402
from llm_foundry.interop.gguf import GGUFError  # noqa: E402

TEXT = "The model reads: café 東京!"
SPECIALS = ["<s>", "</s>", "<pad>"]


def _bytes_only(normalizer=None):
    """A Llama-style byte-level BPE: the 256 byte symbols and three specials, no merges; encode
    puts <s> first. As AutoTokenizer saves it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(SPECIALS + symbols)}
    hf = Tokenizer(models.BPE(vocab, []))
    hf.add_special_tokens(SPECIALS)
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    if normalizer is not None:
        hf.normalizer = normalizer
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=hf, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def _hf_dir(path, tok):
    """A random HF Llama (32-wide heads, GQA) over ``tok`` with ``tok`` saved beside it."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        bos_token_id=0, eos_token_id=1, pad_token_id=2,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)  # logits far from 0, attention that depends on position
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return model


def test_a_byte_level_tokenizer_without_merges_exports_as_llama_cpp_runs_it(tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp", reason=LLAMA_CPP)
    tok = _bytes_only()
    model = _hf_dir(tmp_path / "hf", tok)
    path, _ = convert_to_gguf(tmp_path / "hf", tmp_path / "m.gguf")
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    ids = auto(TEXT).input_ids
    assert ids[0] == 0 and len(ids) == 1 + len(TEXT.encode())  # <s>, then one id per byte
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        assert llm.tokenize(TEXT.encode(), add_bos=True, special=False) == ids
        assert llm.detokenize(ids[1:]).decode() == TEXT
        assert (llm.token_bos(), llm.token_eos()) == (0, 1)
    finally:
        llm.close()
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0]
    diff = (_llama_logits(llama_cpp, path, ids) - theirs).abs().max().item()
    print(f"llama.cpp vs transformers: max |logit diff| {diff:.2e} over {len(ids)} positions")
    assert diff <= TOL_F32


def test_a_tokenizer_gguf_cannot_hold_is_refused_naming_its_file_and_the_way(
    tmp_path, capsys, notes
):
    """Qwen-style (NFC): refused in one line naming DIR/tokenizer.json and llama.cpp's own
    converter, before any note about the chat template (of a file never written)."""
    from tokenizers import normalizers

    _hf_dir(tmp_path / "hf", _bytes_only(normalizers.NFC()))
    with pytest.raises(GGUFError) as e:
        convert_to_gguf(tmp_path / "hf", tmp_path / "m.gguf")
    message = str(e.value)
    assert message.startswith(f"{tmp_path / 'hf' / 'tokenizer.json'}: normalizer 'NFC'")
    assert "convert_hf_to_gguf.py" in message and "\n" not in message
    assert not [n for n in notes if "chat template" in n]
    rc, err = cli_status(["convert", "--to-gguf", str(tmp_path / "hf"), "--out",
                          str(tmp_path / "m.gguf")], capsys)  # fmt: skip
    assert rc == 2 and err.count("\n") == 1 and "convert_hf_to_gguf.py" in err
    assert not (tmp_path / "m.gguf").exists()
