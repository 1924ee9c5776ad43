"""GGUF export checked by llama.cpp itself (through llama-cpp-python): the logits llama.cpp
computes from the file, at every position, against ours in fp32; its tokenizer against ours; the
file's metadata; and the errors for what GGUF cannot hold.

A round trip through the gguf reader alone would prove nothing about the q/k row order, so the
models here have GQA and 32-wide heads, with weights large enough that attention depends on
position: exported without the llama-arch row permutation, llama.cpp's logits are off by ~2.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys

import numpy as np
import pytest
import torch
from conftest import corpus_text

gguf = pytest.importorskip("gguf", reason="GGUF export needs the gguf package: pip install gguf")

from llm_foundry.checkpoint import save_checkpoint  # noqa: E402
from llm_foundry.config import ModelConfig  # noqa: E402
from llm_foundry.export import convert_to_gguf  # noqa: E402
from llm_foundry.interop import gguf as G  # noqa: E402
from llm_foundry.interop.gguf import GGUFError, export_gguf  # noqa: E402
from llm_foundry.models.transformer import Transformer  # noqa: E402
from llm_foundry.package import install_line  # noqa: E402
from llm_foundry.tokenizer import BPETokenizer, CharTokenizer  # noqa: E402

LLAMA_CPP = (
    "llama.cpp checks need llama-cpp-python: scripts/install_llama_cpp.sh .venv/bin/python "
    "(builds it from its sdist once per CPU, ~4 min; `make test` runs it), or pip install "
    "llama-cpp-python"
)
F32 = 0  # GGML_TYPE_F32: llama.cpp's KV cache in f32, so only the weights' type differs
PARAGRAPH = (
    "ROMEO: But soft, what light through yonder window breaks? It's the east,\n"
    "and Juliet is the sun!  Arise, fair sun; we'll kill the envious moon,\n\n"
    "  Who is already sick and pale with grief 1234 times... O, 'tis she!"
)
UNICODE = " Café, naïve 東京 🙂\tend"
TEXT = PARAGRAPH + "\n" + corpus_text(20_000)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Models this small run fastest on one thread (thread hand-offs cost more than the work:
    measured 0.04 s vs 7 s for 32 greedy steps beside a busy core), and a trained model's
    weights then do not depend on the machine's core count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def llama_cpp():
    return pytest.importorskip("llama_cpp", reason=LLAMA_CPP)


@pytest.fixture(scope="module")
def char_tok():
    return CharTokenizer.train(TEXT + "abcdefghijklmnopqrstuvwxyz")


def _llama(llama_cpp, path, n_ctx: int = 128, **kw):
    """llama.cpp on one thread, logits at every position, KV cache in f32."""
    return llama_cpp.Llama(
        model_path=str(path),
        n_ctx=n_ctx,
        logits_all=True,
        type_k=F32,
        type_v=F32,
        n_threads=1,
        n_threads_batch=1,
        verbose=False,
        **kw,
    )


def _llama_logits(llama_cpp, path, ids: list[int]) -> torch.Tensor:
    """llama.cpp's logits (T, vocab) for ``ids``."""
    llm = _llama(llama_cpp, path)
    try:
        llm.eval(ids)
        return torch.tensor(np.array(llm.scores[: len(ids)]))
    finally:
        llm.close()


@torch.no_grad()
def _ours(model: Transformer, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids]))[0][0].float()


def _random_model(cfg: ModelConfig, seed: int = 0, std: float = 0.1) -> Transformer:
    """fp32 weights N(0, std) (q.k large enough that attention depends on position), every
    norm weight and bias perturbed (at init they are ones and zeros, which would hide them)."""
    torch.manual_seed(seed)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, std)
    return model


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def _reader_fields(path) -> dict:
    """The GGUF file's metadata as plain Python values."""
    reader = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in reader.fields.items()}


# ----------------------------------------------------------------------------------------------
# f32: every family, llama.cpp's logits at every position against ours

GQA = dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=96, max_seq_len=64)
CASES = {
    "llama_gqa": dict(GQA),
    "llama_mha_tied_bias_linear_rope": dict(
        GQA,
        n_kv_heads=None,
        tie_embeddings=True,
        attn_bias=True,
        mlp_bias=True,
        rope_theta=500.0,
        rope_scaling="linear",
        rope_factor=2.0,
    ),
    "llama_mqa_ntk_rope_head_dim_48": dict(
        GQA, n_kv_heads=1, head_dim=48, rope_scaling="ntk", rope_factor=4.0
    ),
    "mistral_window_at_max_seq_len": dict(GQA, sliding_window=64),
    "qwen3_qk_norm": dict(GQA, qk_norm=True, head_dim=48, rope_theta=1e6, norm_eps=1e-6),
    "gpt2": dict(
        GQA,
        n_kv_heads=None,
        pos_encoding="learned",
        norm="layernorm",
        mlp="gelu",
        gelu_approx="tanh",
        attn_bias=True,
        mlp_bias=True,
        tie_embeddings=True,
    ),
    "mixtral_top2_of_4": dict(GQA, hidden_dim=None, n_experts=4, experts_per_token=2),
    "qwen3moe_top2_of_4_tied": dict(
        GQA,
        hidden_dim=None,
        qk_norm=True,
        n_experts=4,
        experts_per_token=2,
        expert_hidden_dim=64,
        tie_embeddings=True,
    ),
}
CASES["gpt2_untied"] = dict(CASES["gpt2"], tie_embeddings=False)  # its own output head
# the case's name starts with its family -> llama.cpp's architecture
ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "qwen3": "qwen3",
    "gpt2": "gpt2",
    "mixtral": "llama",
    "qwen3moe": "qwen3moe",
}
# llama.cpp's GELU reads a table at fp16-rounded inputs: GPT-2 weights of std 0.05 keep that
# rounding (3e-4) well inside TOL_F32, while q and k swapped in attn_qkv still move logits by 0.2
STD = {"gpt2": 0.05}
# llama.cpp computes in fp32 too, in its own order (measured max 4.6e-6 for the RoPE families)
TOL_F32 = 1e-3


@pytest.mark.parametrize("name", list(CASES))
def test_f32_logits_equal_ours(name, llama_cpp, char_tok, tmp_path):
    family = name.split("_")[0]
    cfg = ModelConfig(vocab_size=char_tok.vocab_size, **CASES[name])
    model = _random_model(cfg, std=STD.get(family, 0.1))
    path = export_gguf(model, char_tok, tmp_path / f"{name}.gguf")
    assert _reader_fields(path)["general.architecture"] == ARCH[family]
    ids = char_tok.encode(PARAGRAPH[:60])
    ours = _ours(model, ids)
    for moe in model.moe_layers():  # no expert choice within rounding of the next one
        k = cfg.experts_per_token
        top = moe.router_logits.topk(k + 1, dim=-1).values
        assert (top[:, k - 1] - top[:, k]).min() > 1e-4, "a routing choice hinges on rounding"
    diff = _max_diff(_llama_logits(llama_cpp, path, ids), ours)
    print(f"\n{name}: llama.cpp f32 max|diff| = {diff:.2e}")
    assert diff <= TOL_F32


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_q_k_row_order_matters(arch, llama_cpp, char_tok, tmp_path, monkeypatch):
    """Flip the permutation: without it the llama arch is far off, with it qwen3 (NeoX RoPE in
    llama.cpp, rotate-half like ours) is: so the f32 parity above checks the row order."""
    cfg = ModelConfig(vocab_size=char_tok.vocab_size, **GQA, qk_norm=arch == "qwen3")
    family = "llama" if arch == "llama" else "qwen3"
    flipped = dataclasses.replace(G.ARCHS[family], interleave_qk=not G.ARCHS[family].interleave_qk)
    monkeypatch.setitem(G.ARCHS, family, flipped)
    model = _random_model(cfg)
    path = export_gguf(model, char_tok, tmp_path / "flipped.gguf")
    ids = char_tok.encode(PARAGRAPH[:60])
    diff = _max_diff(_llama_logits(llama_cpp, path, ids), _ours(model, ids))
    print(f"\n{arch} with the row order flipped: max|diff| = {diff:.2f}")
    assert diff > 0.5  # measured 4.9 (llama), 4.5 (qwen3)


def test_interleave_rope_rows_pairs_halves_per_head():
    """Row i of each head goes to 2i and row i + hd/2 to 2i + 1, biases alike."""
    heads, hd = 3, 4
    w = torch.arange(heads * hd * 2, dtype=torch.float32).reshape(heads * hd, 2)
    out = G.interleave_rope_rows(w, heads)
    for h in range(heads):
        for i in range(hd // 2):
            assert torch.equal(out[h * hd + 2 * i], w[h * hd + i])
            assert torch.equal(out[h * hd + 2 * i + 1], w[h * hd + i + hd // 2])
    bias = torch.arange(heads * hd, dtype=torch.float32)
    assert torch.equal(G.interleave_rope_rows(bias, heads), out[:, 0] / 2)


def test_metadata_and_tensor_types(char_tok, tmp_path):
    cfg = ModelConfig(vocab_size=char_tok.vocab_size, **CASES["qwen3_qk_norm"])
    path = export_gguf(_random_model(cfg), char_tok, tmp_path / "m.gguf", "q8_0", name="tiny")
    f = _reader_fields(path)
    want = {
        "general.name": "tiny",
        "general.file_type": int(gguf.LlamaFileType.MOSTLY_Q8_0),
        "qwen3.context_length": 64,
        "qwen3.embedding_length": 128,
        "qwen3.block_count": 2,
        "qwen3.feed_forward_length": 96,
        "qwen3.attention.head_count": 4,
        "qwen3.attention.head_count_kv": 2,
        "qwen3.attention.key_length": 48,
        "qwen3.attention.value_length": 48,
        "qwen3.rope.dimension_count": 48,
        "qwen3.rope.freq_base": 1e6,
        "qwen3.vocab_size": char_tok.vocab_size,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.add_bos_token": False,
    }
    assert {k: f.get(k) for k in want} == want
    assert f["qwen3.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(str(path)).tensors}
    assert types["blk.0.attn_q_norm.weight"] == gguf.GGMLQuantizationType.F32
    assert types["output_norm.weight"] == gguf.GGMLQuantizationType.F32
    assert types["blk.1.attn_q.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert types["blk.1.ffn_down.weight"] == gguf.GGMLQuantizationType.Q8_0  # rows of 96
    assert "output.weight" in types  # untied: llama.cpp reads it; tied models omit it


def test_experts_routers_and_positions(char_tok, tmp_path):
    """Stacked experts take the outtype; routers and GPT-2's position table stay f32, as
    llama.cpp's own converter keeps them."""
    cfg = ModelConfig(vocab_size=char_tok.vocab_size, **CASES["mixtral_top2_of_4"])
    path = export_gguf(_random_model(cfg), char_tok, tmp_path / "moe.gguf", "q4_0")
    f = _reader_fields(path)
    assert (f["llama.expert_count"], f["llama.expert_used_count"]) == (4, 2)
    assert f["llama.feed_forward_length"] == cfg.expert_ffn_dim
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(str(path)).tensors}
    assert types["blk.0.ffn_gate_inp.weight"] == gguf.GGMLQuantizationType.F32
    assert types["blk.0.ffn_gate_exps.weight"] == gguf.GGMLQuantizationType.Q4_0
    assert types["blk.0.ffn_down_exps.weight"] == gguf.GGMLQuantizationType.F16  # rows of 341
    cfg = ModelConfig(vocab_size=char_tok.vocab_size, **CASES["gpt2"])
    path = export_gguf(_random_model(cfg), char_tok, tmp_path / "gpt2.gguf", "q8_0")
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(str(path)).tensors}
    assert types["position_embd.weight"] == gguf.GGMLQuantizationType.F32
    assert types["blk.0.attn_qkv.weight"] == gguf.GGMLQuantizationType.Q8_0


def test_rows_that_are_not_whole_blocks_fall_back_to_f16(llama_cpp, char_tok, tmp_path, caplog):
    """dim 48: rows of 48 are not whole 32-value q8_0 blocks, so those tensors go f16 (named in
    the log); w2's rows (hidden_dim 64) stay q8_0. llama.cpp runs the mixed file."""
    cfg = ModelConfig(vocab_size=char_tok.vocab_size, dim=48, n_layers=2, n_heads=3, hidden_dim=64)
    model = _random_model(cfg, std=0.05)
    with caplog.at_level("WARNING", logger="llm_foundry"):
        path = export_gguf(model, char_tok, tmp_path / "m.gguf", "q8_0")
    assert "stored as f16" in caplog.text and "blk.0.attn_q.weight" in caplog.text
    assert "ffn_down" not in caplog.text
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(str(path)).tensors}
    assert types["token_embd.weight"] == gguf.GGMLQuantizationType.F16
    assert types["blk.0.ffn_down.weight"] == gguf.GGMLQuantizationType.Q8_0
    ids = char_tok.encode(PARAGRAPH[:40])
    diff = _max_diff(_llama_logits(llama_cpp, path, ids), _ours(model, ids))
    assert diff <= 0.05  # measured 8e-3: f16 and q8_0 weights, f16/q8_0 activations


# ----------------------------------------------------------------------------------------------
# Outtypes on a trained model

STEPS, BATCH, BLOCK, LR = 200, 16, 64, 5e-3
PROMPT, NEW = "ROMEO:\nBut soft, what light", 32


@pytest.fixture(scope="module")
def trained():
    """A 2-layer LLaMA-style char model (GQA, 32-wide heads, every row whole q8_0/q4_0 blocks)
    trained for 200 steps on tiny Shakespeare (~8 s on one thread, ``one_thread``)."""
    text = corpus_text(300_000)
    tok = CharTokenizer.train(text)
    data = torch.tensor(tok.encode(text))
    cfg = ModelConfig(
        vocab_size=tok.vocab_size,
        dim=128,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        hidden_dim=320,
        max_seq_len=128,
    )
    torch.manual_seed(0)
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        starts = torch.randint(0, len(data) - BLOCK - 1, (BATCH,), generator=g)
        x = torch.stack([data[s : s + BLOCK] for s in starts])
        y = torch.stack([data[s + 1 : s + BLOCK + 1] for s in starts])
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval(), tok


@torch.no_grad()
def _greedy(model: Transformer, ids: list[int], n: int) -> list[int]:
    ids = list(ids)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]))[0][0, -1].argmax()))
    return ids


def _round_trip(x: np.ndarray, qtype) -> np.ndarray:
    """What ``qtype`` keeps of float32 ``x``, blocks along the last axis."""
    return gguf.quants.dequantize(gguf.quants.quantize(x, qtype), qtype).reshape(x.shape)


def _as_llama_cpp_computes(model: Transformer, qtype) -> Transformer:
    """``model`` with each 2-D weight as ``qtype`` stores it and each matrix product's input
    rounded to q8_0 blocks, as llama.cpp's CPU kernels round activations for q8_0/q4_0 weights.
    Blocks run along rows, which the q/k permutation only reorders: these are the file's weights
    in our layout."""
    state = {
        k: torch.from_numpy(_round_trip(v.numpy(), qtype).copy()) if v.ndim == 2 else v
        for k, v in model.state_dict().items()
    }
    ref = Transformer(model.cfg).eval()
    ref.load_state_dict(state)
    q8 = gguf.GGMLQuantizationType.Q8_0
    for module in ref.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(
                lambda m, args: (torch.from_numpy(_round_trip(args[0].numpy(), q8).copy()),)
            )
    return ref


# outtype -> max |llama.cpp - ours fp32| allowed, relative to 1 + max |logit|: errors scale with
# the logits. Measured on the model trained on tiny Shakespeare (max |logit| ~8): f16 3e-3,
# bf16 2.6e-2, q8_0 4e-2 .. 7e-2, q4_0 0.75 .. 0.86 (models trained apart); on the filler
# corpus (no shared data, max |logit| 17.9): f16 8e-3, bf16 5.9e-2, q8_0 0.19, q4_0 3.4.
# llama.cpp also rounds each matrix product's input to the weights' kind (f16, bf16, q8_0)
TOL_VS_FP32 = {"f16": 1e-3, "bf16": 1e-2, "q8_0": 3e-2, "q4_0": 0.25}
# max |llama.cpp - _as_llama_cpp_computes|, relative as above (measured 2.9e-6 for q8_0 and
# 8.7e-3 for q4_0 on the Shakespeare model, 5.3e-2 and 2.1e-2 on the filler one: llama.cpp's
# kernels scale activations in another order, so a few values round to the next step)
TOL_EMULATED = 5e-3


def _scale(logits: torch.Tensor) -> float:
    """1 + max |logit|: what a tolerance relative to the logits multiplies."""
    return 1 + logits.abs().max().item()


@pytest.mark.heavy
@pytest.mark.parametrize("outtype", ["f16", "bf16"])
def test_float_outtypes(outtype, trained, llama_cpp, tmp_path):
    model, tok = trained
    path = export_gguf(model, tok, tmp_path / f"m-{outtype}.gguf", outtype)
    ids = _greedy(model, tok.encode(PROMPT), NEW)
    ours = _ours(model, ids)
    diff = _max_diff(_llama_logits(llama_cpp, path, ids), ours)
    print(
        f"\n{outtype}: max|llama.cpp - ours fp32| = {diff:.2e}, max |logit| {_scale(ours) - 1:.1f}"
    )
    assert diff <= TOL_VS_FP32[outtype] * _scale(ours)


@pytest.mark.heavy
@pytest.mark.parametrize("outtype", ["q8_0", "q4_0"])
def test_quantized_outtypes_keep_greedy_tokens(outtype, trained, llama_cpp, tmp_path):
    """Greedy tokens are compared with what llama.cpp computes in exact arithmetic from the
    file (``_as_llama_cpp_computes``): the fp32 model's choices may differ from any q4_0
    model's where its top two logits are closer than quantization moves them, which says
    nothing about the export. Each reference choice wins by more than twice the tolerance, so
    llama.cpp (within it) must make the same 32 choices on any CPU: no rounding luck."""
    model, tok = trained
    path = export_gguf(model, tok, tmp_path / f"m-{outtype}.gguf", outtype)
    ref = _as_llama_cpp_computes(model, G.OUTTYPES[outtype][0])
    prompt = tok.encode(PROMPT)
    ids = _greedy(ref, prompt, NEW)
    theirs, want = _llama_logits(llama_cpp, path, ids), _ours(ref, ids)
    fp32 = _ours(model, ids)
    diff_ref, diff_fp32 = _max_diff(theirs, want), _max_diff(theirs, fp32)
    print(f"\n{outtype}: max|llama.cpp - emulated| {diff_ref:.2e}, - ours fp32 {diff_fp32:.2e}, "
          f"max |logit| {_scale(fp32) - 1:.1f}")  # fmt: skip
    tol = TOL_EMULATED * _scale(want)
    assert diff_ref <= tol
    assert diff_fp32 <= TOL_VS_FP32[outtype] * _scale(fp32)
    steps = slice(len(prompt) - 1, len(ids) - 1)  # the logits each greedy choice was read from
    top = want[steps].topk(2, dim=-1).values
    gap = (top[:, 0] - top[:, 1]).min().item()
    assert gap > 2 * tol, f"a reference choice is won by {gap:.3f} only"
    assert theirs[steps].argmax(-1).tolist() == ids[len(prompt) :]
    print(f"{outtype}: 32 greedy tokens equal, each won by >= {gap:.2f}: {tok.decode(ids)!r}")


# ----------------------------------------------------------------------------------------------
# Tokenizers: llama.cpp's tokenize and detokenize against ours


def _hf_byte_level(bos: bool = False):
    """An HF tokenizer.json as GPT-2's is made (ByteLevel pre-tokenizer, decoder and
    post-processor, one special token <|endoftext|>), trained here; ``bos`` adds a
    TemplateProcessing that puts <s> first, as Llama-style files do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from llm_foundry.tokenizer import HFTokenizerFile

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<s>"] if bos else ["<|endoftext|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator([TEXT], trainer=trainer)
    if bos:
        hf.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", hf.token_to_id("<s>"))]
        )
    else:
        hf.post_processor = processors.ByteLevel(trim_offsets=False)
    return HFTokenizerFile(hf, eos_id=hf.token_to_id("<|endoftext|>"))


def _tokenizers():
    return {
        "char": lambda: CharTokenizer.train(TEXT + UNICODE),
        "bpe": lambda: BPETokenizer.train(TEXT, 400),
        "hf_gpt2": lambda: _hf_byte_level(),
        "hf_with_bos": lambda: _hf_byte_level(bos=True),
    }


def _tiny_model(vocab_size: int) -> Transformer:
    return _random_model(ModelConfig(vocab_size=vocab_size, dim=32, n_layers=1, n_heads=2))


@pytest.mark.parametrize("kind", list(_tokenizers()))
def test_llama_cpp_tokenizes_as_we_do(kind, llama_cpp, tmp_path):
    tok = _tokenizers()[kind]()
    path = export_gguf(_tiny_model(tok.vocab_size), tok, tmp_path / "t.gguf")
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        text = PARAGRAPH + UNICODE
        plain = tok.encode(text, add_special_tokens=False) if kind.startswith("hf") else None
        ids = plain if plain is not None else tok.encode(text)
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == ids
        assert llm.detokenize(ids).decode() == tok.decode(ids) == text  # token by token
        assert _detokenize_whole(llama_cpp, llm, ids) == text
        # what encode adds (a BOS only for the Llama-style HF file) is what llama.cpp adds
        assert llm.tokenize(text.encode(), add_bos=True, special=False) == tok.encode(text)
        assert llm.token_eos() == (tok.eos_id if tok.eos_id is not None else tok.vocab_size - 1)
        if kind == "bpe":
            assert (llm.token_bos(), llm.token_eos()) == (tok.bos_id, tok.eos_id)
    finally:
        llm.close()


def _detokenize_whole(llama_cpp, llm, ids: list[int]) -> str:
    """llama.cpp's whole-sequence detokenize (llama-server's), not token by token."""
    import ctypes

    buf = ctypes.create_string_buffer(8 * len(ids) + 64)
    tokens = (llama_cpp.llama_token * len(ids))(*ids)
    n = llama_cpp.llama_detokenize(llm._model.vocab, tokens, len(ids), buf, len(buf), False, False)
    return buf.raw[:n].decode()


def test_whole_sequence_detokenize_cleans_spaces_for_gpt2_vocabularies(llama_cpp, tmp_path):
    """A known difference, kept in view: for the "gpt-2" pre-tokenizer llama.cpp's whole-text
    detokenize drops the space before , . ! ? and 's (as HF's clean_up_tokenization_spaces);
    our decode and llama.cpp's token pieces keep it. No llama.cpp name for GPT-2's regex
    turns that off."""
    tok = BPETokenizer.train(TEXT, 400)
    path = export_gguf(_tiny_model(tok.vocab_size), tok, tmp_path / "t.gguf")
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        ids = tok.encode("Hello , world . it 's")
        assert llm.detokenize(ids).decode() == tok.decode(ids) == "Hello , world . it 's"
        assert _detokenize_whole(llama_cpp, llm, ids) == "Hello, world. it's"
    finally:
        llm.close()


def test_char_vocabulary_names_its_last_character_bos_and_eos(char_tok, tmp_path):
    """Spelled in GPT-2's byte symbols (tests/test_gguf_char_vocab.py); no bos/eos in a character
    vocabulary: llama.cpp gets the last character for both, and no unk (its BPE reads none)."""
    path = export_gguf(_tiny_model(char_tok.vocab_size), char_tok, tmp_path / "t.gguf")
    f = _reader_fields(path)
    assert f["tokenizer.ggml.model"] == "gpt2"
    assert f["tokenizer.ggml.tokens"][char_tok.encode(" ")[0]] == "\u0120"
    assert f["tokenizer.ggml.tokens"][char_tok.encode("\n")[0]] == "\u010a"
    last = char_tok.vocab_size - 1
    assert f["tokenizer.ggml.eos_token_id"] == f["tokenizer.ggml.bos_token_id"] == last
    assert "tokenizer.ggml.unknown_token_id" not in f


def test_model_vocabulary_larger_than_the_tokenizer_is_padded(llama_cpp, char_tok, tmp_path):
    model = _random_model(ModelConfig(vocab_size=char_tok.vocab_size + 5, **GQA))
    path = export_gguf(model, char_tok, tmp_path / "pad.gguf")
    f = _reader_fields(path)
    assert f["tokenizer.ggml.tokens"][-1] == f"[PAD{char_tok.vocab_size + 4}]"
    ids = char_tok.encode(PARAGRAPH[:30])
    assert _max_diff(_llama_logits(llama_cpp, path, ids), _ours(model, ids)) <= TOL_F32


# ----------------------------------------------------------------------------------------------
# Checkpoints, chat templates, the command


def _run_dir(root, model, tok):
    """A training run directory holding ``model`` as its latest checkpoint."""
    from llm_foundry.train.state import LATEST

    step = root / "checkpoints" / "step_000001"
    save_checkpoint(model, step)
    tok.save(step / "tokenizer.json")
    (root / "checkpoints" / LATEST).write_text(json.dumps({"path": "step_000001"}))
    return root


def test_chat_templates(llama_cpp, tmp_path):
    """Our tokenizers get the built-in template our chat commands use (llama-cpp-python's chat
    formatter renders it as we do); an HF directory its own (tokenizer_config.json), with the
    special ids of its config.json."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    from llm_foundry.chat import BUILTIN_TEMPLATE, render_chat
    from llm_foundry.interop.hf import to_hf

    tok = BPETokenizer.train(TEXT, 400)
    model = _tiny_model(tok.vocab_size)
    path, _ = convert_to_gguf(_run_dir(tmp_path / "run", model, tok), tmp_path / "ours.gguf")
    stored = _reader_fields(path)["tokenizer.chat_template"]
    assert stored == BUILTIN_TEMPLATE
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    chat.append({"role": "user", "content": "Who art thou?"})
    theirs = Jinja2ChatFormatter(stored, eos_token="<eos>", bos_token="<bos>")(messages=chat)
    assert theirs.prompt == render_chat(BUILTIN_TEMPLATE, chat, add_generation_prompt=True)

    hf_tok = _hf_byte_level()
    template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
    eot = hf_tok.hf.token_to_id("<|endoftext|>")
    hf_dir = to_hf(_tiny_model(hf_tok.vocab_size), tmp_path / "hf", eos_token_id=eot)
    hf_tok.hf.save(str(hf_dir / "tokenizer.json"))
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    path, _ = convert_to_gguf(hf_dir, tmp_path / "hf.gguf")
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        assert llm.metadata["tokenizer.chat_template"] == template
        assert llm.token_eos() == eot
    finally:
        llm.close()


def test_convert_command(llama_cpp, char_tok, tmp_path, capsys):
    from llm_foundry.cli import main

    model = _random_model(ModelConfig(vocab_size=char_tok.vocab_size, **GQA))
    run = _run_dir(tmp_path / "run", model, char_tok)
    out = tmp_path / "model.gguf"
    assert main(["convert", "--to-gguf", str(run), "--out", str(out), "--outtype", "f32"]) == 0
    assert f"wrote gguf f32 file to {out}" in capsys.readouterr().out
    ids = char_tok.encode(PARAGRAPH[:50])
    assert _max_diff(_llama_logits(llama_cpp, out, ids), _ours(model, ids)) <= TOL_F32
    argv = ["convert", "--to-gguf", str(run), "--out", str(tmp_path / "q.gguf"), "--json"]
    assert main([*argv, "--outtype", "q8_0"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["format"], report["outtype"]) == ("gguf", "q8_0")
    assert main([*argv, "--outtype", "q5_k"]) == 2  # argparse: not one of the choices
    with pytest.raises(SystemExit):  # one source at a time
        main(["convert", "--to-gguf", str(run), "--to-hf", str(run), "--out", str(out)])


# ----------------------------------------------------------------------------------------------
# Refusals: one line each, naming the field, its value and what is supported


def _refusal(fn, *args, **kw) -> str:
    with pytest.raises(GGUFError) as e:
        fn(*args, **kw)
    message = str(e.value)
    assert "\n" not in message, message
    return message


BASE = dict(vocab_size=40, dim=64, n_layers=1, n_heads=4, max_seq_len=64)


@pytest.mark.parametrize(
    "fields, needles",
    [
        (dict(mlp="geglu"), ["mlp='geglu'", "'swiglu'"]),
        (dict(sliding_window=16), ["sliding_window=16", ">= max_seq_len"]),
        (dict(qk_norm=True, attn_bias=True), ["attn_bias=True", "qwen3"]),
        (
            dict(qk_norm=True, n_experts=4, moe_renormalize=False),
            ["moe_renormalize=False", "renormalise"],
        ),
        (dict(pos_encoding="alibi"), ["pos_encoding='alibi'", "'rope', 'learned'"]),
        (dict(norm="layernorm", mlp="gelu", parallel_block=True), ["falcon", "norm='layernorm'"]),
        (dict(norm_position="post"), ["norm_position='post'"]),
        (
            dict(
                pos_encoding="learned", norm="layernorm", mlp="gelu", attn_bias=True, mlp_bias=True
            ),
            ["gelu_approx='none'", "'tanh'"],
        ),
    ],
)
def test_unsupported_configs_are_refused(fields, needles, char_tok, tmp_path):
    cfg = ModelConfig(**{**BASE, "vocab_size": char_tok.vocab_size, **fields})
    message = _refusal(export_gguf, Transformer(cfg), char_tok, tmp_path / "x.gguf")
    assert all(n in message for n in needles), message
    assert not (tmp_path / "x.gguf").exists()


def test_bad_inputs_are_refused(char_tok, tmp_path):
    model = Transformer(ModelConfig(**{**BASE, "vocab_size": char_tok.vocab_size}))
    message = _refusal(export_gguf, model, char_tok, tmp_path / "x.gguf", "q5_k")
    assert "outtype='q5_k'" in message and "f32, f16, bf16, q8_0, q4_0" in message
    assert "no tokenizer" in _refusal(export_gguf, model, None, tmp_path / "x.gguf")
    small = CharTokenizer("ab")
    wide = Transformer(ModelConfig(**{**BASE, "vocab_size": 1}))
    assert "more than the model's vocab_size=1" in _refusal(
        export_gguf, wide, small, tmp_path / "x"
    )


def test_a_quantized_model_is_refused(char_tok, tmp_path):
    """An int8 model (``llm-foundry quantize``) is refused, saved or in memory: GGUF quantizes
    from the full-precision weights."""
    from llm_foundry.models.quant import quantize_model

    model = Transformer(ModelConfig(**{**BASE, "vocab_size": char_tok.vocab_size}))
    quantize_model(model, "int8")
    ckpt = save_checkpoint(model, tmp_path / "ckpt")
    char_tok.save(ckpt / "tokenizer.json")
    with pytest.raises(ValueError, match="convert --to-gguf: .* is quantized already") as e:
        convert_to_gguf(ckpt, tmp_path / "x.gguf")
    assert "give the full-precision checkpoint it was made from" in str(e.value)
    assert "\n" not in str(e.value)
    message = _refusal(export_gguf, model, char_tok, tmp_path / "x.gguf", "q8_0")
    assert "torch.int8" in message and "export from the full-precision checkpoint" in message
    assert not list(tmp_path.glob("x.gguf*"))


def test_an_hf_tokenizer_without_an_exact_counterpart_is_refused(tmp_path):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    from llm_foundry.tokenizer import HFTokenizerFile

    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tok = HFTokenizerFile(wordpiece)
    model = _tiny_model(2)
    assert "model.type='WordPiece'" in _refusal(export_gguf, model, tok, tmp_path / "x.gguf")
    bpe = _hf_byte_level()
    bpe.hf.normalizer = normalizers.NFC()
    message = _refusal(export_gguf, _tiny_model(bpe.vocab_size), bpe, tmp_path / "x.gguf")
    assert "normalizer 'NFC'" in message
    bpe.hf.normalizer = None
    bpe.hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    message = _refusal(export_gguf, _tiny_model(bpe.vocab_size), bpe, tmp_path / "x.gguf")
    assert "add_prefix_space=True" in message


def test_without_the_gguf_package_the_install_line_is_given(tmp_path, monkeypatch, capsys):
    import sys

    from llm_foundry.cli import main

    monkeypatch.setitem(sys.modules, "gguf", None)
    assert main(["convert", "--to-gguf", str(tmp_path), "--out", str(tmp_path / "x.gguf")]) == 2
    err = capsys.readouterr().err
    assert install_line("gguf") in err
    assert err.startswith("llm-foundry convert: error: ") and err.count("\n") == 1


def test_convert_help_works_without_transformers(monkeypatch, capsys):
    """``convert --help`` (and its dcp conversions) need no [hf] extra: the HF families are read
    for --family's choices only when transformers is there (the import failed before argparse)."""
    from llm_foundry.cli import main

    monkeypatch.setitem(sys.modules, "transformers", None)
    for name in [m for m in sys.modules if m.startswith("llm_foundry.interop.hf")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ImportError, match=re.escape(install_line("hf"))):
        import llm_foundry.interop.hf  # noqa: F401  (the absence is simulated)
    with pytest.raises(SystemExit) as done:
        main(["convert", "--help"])
    assert done.value.code == 0 and "--from-dcp" in capsys.readouterr().out


def test_an_out_that_is_a_directory_is_refused(tmp_path):
    from llm_foundry.cli import main

    (tmp_path / "dir").mkdir()
    with pytest.raises(ValueError, match="is a directory; give the file to write"):
        convert_to_gguf(tmp_path, tmp_path / "dir")
    assert main(["convert", "--to-gguf", str(tmp_path), "--out", str(tmp_path / "dir")]) == 2
