"""A character tokenizer exported to GGUF: its tokens spelled as Hugging Face's byte-level BPE
spells them, and llama.cpp (llama-cpp-python, in a subprocess, so that an abort fails the test
instead of killing pytest) given a prompt with characters outside the vocabulary: it drops them,
tokenizing and generating as we do on the prompt without them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

gguf = pytest.importorskip("gguf", reason="GGUF export needs the gguf package: pip install gguf")

from llm_foundry.config import ModelConfig  # noqa: E402
from llm_foundry.interop import gguf as G  # noqa: E402
from llm_foundry.interop.gguf import export_gguf  # noqa: E402
from llm_foundry.models.transformer import Transformer  # noqa: E402
from llm_foundry.tokenizer import CharTokenizer  # noqa: E402

ALPHABET = (
    "ROMEO: But soft, what light through yonder window breaks? It's the east,\n"
    "and Juliet is the sun!  Arise, fair sun; Café naïve 東京 🙂\t\x00"
)
# outside ALPHABET: 1- to 4-byte UTF-8, è and U+6772 sharing their first bytes with é and 東
UNSEEN = "Z—è\u6772🙃x"
PROMPT = "ROMEO: Zsoft—è é 東\u6772京,\tfair🙃 sun\x00 🙂x\n"
STEPS = 24
TOL_F32 = 1e-3  # llama.cpp's f32 logits against ours (tests/test_gguf.py)


def _model(vocab_size: int) -> Transformer:
    cfg = ModelConfig(vocab_size=vocab_size, dim=64, n_layers=2, n_heads=4, n_kv_heads=2)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1) if p.ndim > 1 else p.add_(0.2 * torch.randn_like(p))
    return model


def test_tokens_are_spelled_as_hugging_face_byte_level_spells_them(tmp_path):
    from tokenizers import pre_tokenizers

    assert set(G.byte_symbols()) == set(pre_tokenizers.ByteLevel.alphabet())
    spell = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    # every 1- and 2-byte lead and continuation byte, and 3- and 4-byte characters
    tok = CharTokenizer.train("".join(map(chr, range(0x800))) + ALPHABET + "\u2581Ġ")
    vocab = G.char_vocab(tok, {})
    assert vocab.tokens == [spell.pre_tokenize_str(c)[0][0] for c in tok.chars]
    # merges join a character's bytes only: each one spells the first 2, 3 or 4 bytes of a token
    wholes = {t[:i] for t in vocab.tokens for i in range(2, len(t) + 1)}
    assert {m.replace(" ", "") for m in vocab.merges} == wholes


def test_a_vocabulary_holding_sentencepiece_space_mark_exports(tmp_path):
    """U+2581 is a character like any other in a byte-level vocabulary."""
    tok = CharTokenizer("a \u2581")
    path = export_gguf(_model(3), tok, tmp_path / "t.gguf")
    fields = {k: f.contents() for k, f in gguf.GGUFReader(str(path)).fields.items()}
    assert fields["tokenizer.ggml.model"] == "gpt2"
    assert fields["tokenizer.ggml.tokens"] == ["a", "Ġ", "âĸģ"]


# llama.cpp in its own process: tokenize, greedy steps by its logits, and a completion at
# temperature 0 through its sampler; printed as JSON
LLAMA_CPP_RUN = """
import json, sys
import numpy as np
import llama_cpp
path, prompt, steps = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
llm = llama_cpp.Llama(model_path=path, n_ctx=128, logits_all=True, type_k=0, type_v=0,
                      n_threads=1, n_threads_batch=1, verbose=False)
ids = llm.tokenize(prompt.encode(), add_bos=False, special=False)
llm.eval(ids)
greedy = []
for _ in range(steps):
    greedy.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
    llm.eval(greedy[-1:])
llm.reset()
text = llm.create_completion(prompt, max_tokens=steps, temperature=0.0)["choices"][0]["text"]
print(json.dumps({"ids": ids, "greedy": greedy, "text": text}))
"""


def _llama_cpp(path, prompt: str) -> dict:
    pytest.importorskip("llama_cpp", reason="needs llama-cpp-python: scripts/install_llama_cpp.sh")
    run = subprocess.run(
        [sys.executable, "-c", LLAMA_CPP_RUN, str(path), json.dumps(prompt), str(STEPS)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    why = [line for line in run.stderr.splitlines() if "what()" in line or "Error" in line]
    assert run.returncode == 0, f"llama.cpp exited with {run.returncode}: {why[-3:]}"
    return json.loads(run.stdout.strip().splitlines()[-1])


@torch.no_grad()
def _our_greedy(model: Transformer, ids: list[int], steps: int) -> tuple[list[int], float]:
    """Our greedy continuation of ``ids`` and the smallest margin of a choice."""
    out, gap = list(ids), float("inf")
    for _ in range(steps):
        logits = model(torch.tensor([out]))[0][0, -1]
        top = logits.topk(2).values
        gap = min(gap, (top[0] - top[1]).item())
        out.append(int(logits.argmax()))
    return out[len(ids) :], gap


def test_llama_cpp_drops_characters_outside_the_vocabulary(tmp_path):
    tok = CharTokenizer.train(ALPHABET)
    assert all(c not in tok.chars and c in PROMPT for c in UNSEEN)
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tok.encode(PROMPT)  # ours refuses the prompt; llama.cpp cannot refuse, it drops
    known = "".join(c for c in PROMPT if c in tok.chars)
    model = _model(tok.vocab_size)
    path = export_gguf(model, tok, tmp_path / "char.gguf")

    theirs = _llama_cpp(path, PROMPT)
    assert theirs["ids"] == tok.encode(known)
    ours, gap = _our_greedy(model, tok.encode(known), STEPS)
    assert gap > 2 * TOL_F32, f"a greedy choice is won by {gap:.1e} only, within llama.cpp's error"
    assert theirs["greedy"] == ours
    # llama.cpp's completion stops before its eos (the last id: the vocabulary has none)
    eos = tok.vocab_size - 1
    assert theirs["text"] == tok.decode(ours[: ours.index(eos)] if eos in ours else ours)
    # inside the alphabet the same prompt is tokenized alike: no characters lost
    assert _llama_cpp(path, known)["ids"] == tok.encode(known)
