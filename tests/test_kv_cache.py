"""KV cache: cached decoding equals recomputing the whole sequence, for every variant."""

import itertools

import pytest
import torch
from conftest import assert_decisive

from llm_foundry.generate import generate
from llm_foundry.models import Transformer
from llm_foundry.models.position import POSITION_NAMES

POSITIONS = list(POSITION_NAMES)  # every registered encoding, read at collection time
KV_HEADS = {"mha": 4, "gqa": 2, "mqa": 1}


def greedy_recompute(model, idx, n):
    """Reference decoding: run the full sequence through the model at every step."""
    for _ in range(n):
        nxt = model(idx)[0][:, -1].argmax(-1, keepdim=True)
        idx = torch.cat([idx, nxt], dim=1)
    return idx


@torch.no_grad()
def decision_logits(model, seq, prompt_len):
    """The full forward's logits at each greedy decision that produced seq[:, prompt_len:]."""
    return model(seq[:, :-1])[0][:, prompt_len - 1 :]


CASES = [
    (pe, kind, window)
    for pe, kind in itertools.product(POSITIONS, KV_HEADS)
    for window in ([None, 5] if pe in ("rope", "alibi") else [None])
]


@pytest.mark.parametrize("pe, kind, window", CASES)
def test_cached_logits_equal_full_forward(tiny_config, pe, kind, window):
    torch.manual_seed(0)
    model = Transformer(
        tiny_config(pos_encoding=pe, n_kv_heads=KV_HEADS[kind], sliding_window=window)
    )
    model.eval()
    idx = torch.randint(0, 37, (2, 20))
    full = model(idx)[0]
    cache = model.new_cache(2, 32)
    parts = [model(idx[:, :7], cache=cache)[0]]  # prefill 7 (longer than the window)
    parts += [model(idx[:, t : t + 1], cache=cache)[0] for t in range(7, 20)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-4, rtol=0)


@pytest.mark.parametrize("pe, kind, window", CASES)
def test_cached_greedy_equals_recompute(tiny_config, pe, kind, window):
    torch.manual_seed(1)
    model = Transformer(
        tiny_config(pos_encoding=pe, n_kv_heads=KV_HEADS[kind], sliding_window=window)
    )
    model.eval()
    idx = torch.randint(0, 37, (2, 6))
    ref = greedy_recompute(model, idx, 25)
    assert_decisive(decision_logits(model, ref, 6), f"{pe}, {kind}, window {window}")
    assert torch.equal(generate(model, idx, 25, temperature=0), ref)


def test_cache_bytes_follow_kv_heads(tiny_config):
    sizes = {}
    for kind, n_kv in KV_HEADS.items():
        model = Transformer(tiny_config(n_kv_heads=n_kv))
        sizes[kind] = model.new_cache(1, 64).nbytes
        assert sizes[kind] == model.kv_cache_bytes_per_token(4) * 64
    assert sizes["mha"] == 2 * sizes["gqa"] == 4 * sizes["mqa"]


def test_sliding_window_cache_keeps_only_the_window(tiny_config):
    model = Transformer(tiny_config(sliding_window=5))
    cache = model.new_cache(1, 64)
    assert cache.k[0].shape[2] == 5
    model(torch.randint(0, 37, (1, 12)), cache=cache)
    assert sorted(cache.slot_pos.tolist()) == [7, 8, 9, 10, 11]


def test_cache_overflow_message(tiny_config):
    model = Transformer(tiny_config())
    cache = model.new_cache(1, 8)
    with pytest.raises(ValueError, match="KV cache full"):
        model(torch.randint(0, 37, (1, 9)), cache=cache)


@pytest.mark.parametrize(
    "pe,kind,window",
    [
        ("rope", "gqa", None),
        ("alibi", "mha", None),
        ("learned", "mha", None),
        ("sinusoidal", "mqa", None),
        ("none", "mha", None),
        ("rope", "gqa", 4),
    ],
)
def test_batched_ragged_prompts_equal_each_alone(tiny_config, pe, kind, window):
    from llm_foundry.generate import generate_batch

    torch.manual_seed(0)
    model = Transformer(
        tiny_config(pos_encoding=pe, n_kv_heads=KV_HEADS[kind], sliding_window=window)
    )
    model.eval()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 37, (n,), generator=g).tolist() for n in (3, 9, 6)]
    batched = generate_batch(model, prompts, 12, temperature=0)
    for p, row in zip(prompts, batched, strict=True):
        alone = generate(model, torch.tensor([p]), 12, temperature=0)
        assert_decisive(decision_logits(model, alone, len(p)), f"prompt of {len(p)}")
        assert row == alone[0].tolist()


@pytest.mark.heavy
@pytest.mark.parametrize("batch", [1, 2])  # batch 1 decodes through the fused matvec
def test_compiled_decode_equals_eager(tiny_config, batch):
    torch.manual_seed(0)
    model = Transformer(tiny_config(pos_encoding="rope", n_kv_heads=2, attn_bias=True)).eval()
    idx = torch.randint(0, 37, (batch, 5))
    eager = generate(model, idx, 8, temperature=0)
    assert_decisive(decision_logits(model, eager, 5))  # fused kernels round otherwise
    assert torch.equal(generate(model, idx, 8, temperature=0, compile=True), eager)


def test_linear_matvec_equals_linear():
    from llm_foundry.models.linear import Linear, matvec

    layer = Linear(24, 40, bias=True)
    x = torch.randn(1, 1, 24)
    assert torch.allclose(matvec(x, layer.weight) + layer.bias, layer(x), atol=1e-5)
    compiled = torch.compile(layer)
    assert torch.allclose(compiled(x), layer(x), atol=1e-5)


def test_batched_repetition_penalty_ignores_padding(tiny_config):
    from llm_foundry.generate import generate_batch
    from llm_foundry.sampling import apply_repetition_penalty

    torch.manual_seed(0)
    model = Transformer(tiny_config(vocab_size=6)).eval()
    prompts = [[1, 2], [3, 4, 5, 1, 2, 3, 4]]
    rows = generate_batch(model, prompts, 10, temperature=0, repetition_penalty=1.5)
    for p, row in zip(prompts, rows, strict=True):
        alone = generate(model, torch.tensor([p]), 10, temperature=0, repetition_penalty=1.5)
        logits = decision_logits(model, alone, len(p))
        penalised = [  # what each greedy step chose from: seen tokens penalised
            apply_repetition_penalty(logits[:, t], alone[:, : len(p) + t], 1.5)
            for t in range(logits.shape[1])
        ]
        assert_decisive(torch.stack(penalised, 1), f"prompt of {len(p)}")
        assert row == alone[0].tolist()
    with pytest.raises(ValueError, match="padded"):
        generate_batch(model, prompts, 3, context=4)


@pytest.mark.heavy
def test_compiled_batch_with_learned_positions_has_no_graph_break(tiny_config):
    """generate_batch(compile=True) on a GPT-2-style model: one graph, no warnings, eager tokens."""
    import logging
    import warnings

    from torch._dynamo.utils import counters

    from llm_foundry.generate import generate_batch

    torch.manual_seed(0)
    model = Transformer(tiny_config(pos_encoding="learned")).eval()
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    eager = generate_batch(model, prompts, 4, temperature=0)
    for p, row in zip(prompts, eager, strict=True):
        assert_decisive(decision_logits(model, torch.tensor([row]), len(p)))
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # dynamo logs graph breaks here, once per process
    dynamo_log = logging.getLogger("torch._dynamo")
    dynamo_log.addHandler(handler)
    counters.clear()  # the count, unlike the log, does not depend on what ran before
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compiled = generate_batch(model, prompts, 4, temperature=0, compile=True)
    finally:
        dynamo_log.removeHandler(handler)
    assert compiled == eager
    assert not dict(counters["graph_break"])
    assert not [r.getMessage() for r in records]
    assert not [w for w in caught if "graph break" in str(w.message).lower()]
