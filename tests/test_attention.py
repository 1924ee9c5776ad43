"""Attention: SDPA == manual, GQA/MQA semantics, causality for every variant, sliding window."""

import itertools
import math

import pytest
import torch

from llm_foundry.models import Transformer
from llm_foundry.models.attention import (
    ATTENTION_IMPL_NAMES,
    attention_mask,
    manual_attention,
    sdpa_attention,
)
from llm_foundry.models.position import POSITION_NAMES

# every registered position encoding and attention implementation, read at collection time
POSITIONS = list(POSITION_NAMES)
KV_HEADS = {"mha": 4, "gqa": 2, "mqa": 1}


def reference_attention(q, k, v, window=None):
    """Textbook causal attention, one head at a time, for checking the library's paths."""
    B, H, T, hd = q.shape
    group = H // k.shape[1]
    out = torch.empty_like(q)
    for h in range(H):
        kh, vh = k[:, h // group], v[:, h // group]
        s = q[:, h] @ kh.transpose(-1, -2) / math.sqrt(hd)
        i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
        allowed = (j <= i) & ((i - j < window) if window else True)
        out[:, h] = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ vh
    return out


@pytest.mark.parametrize("n_kv", [4, 2, 1])
@pytest.mark.parametrize("window", [None, 3])
def test_paths_match_reference(n_kv, window):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 9, 8)
    k, v = torch.randn(2, n_kv, 9, 8), torch.randn(2, n_kv, 9, 8)
    mask = attention_mask(torch.arange(9), torch.arange(9), window)
    expected = reference_attention(q, k, v, window)
    out_m, w = manual_attention(q, k, v, mask)
    out_s, _ = sdpa_attention(q, k, v, mask)
    torch.testing.assert_close(out_m, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_s, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 9))
    assert (w.triu(1) == 0).all()  # nothing from the future


@pytest.mark.parametrize("pe, kind", list(itertools.product(POSITIONS, KV_HEADS)))
def test_sdpa_model_equals_manual_model(tiny_config, pe, kind):
    torch.manual_seed(0)
    idx = torch.randint(0, 37, (2, 13))
    cfg = tiny_config(pos_encoding=pe, n_kv_heads=KV_HEADS[kind])
    sdpa = Transformer(cfg).eval()
    manual = Transformer(cfg.replace(attn_impl="manual")).eval()
    manual.load_state_dict(sdpa.state_dict())
    torch.testing.assert_close(sdpa(idx)[0], manual(idx)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "pe, kind, impl, window",
    [
        (pe, kind, impl, window)
        for pe, kind, impl in itertools.product(POSITIONS, KV_HEADS, ATTENTION_IMPL_NAMES)
        for window in ([None, 4] if pe == "rope" else [None])
    ],
)
def test_causality(tiny_config, pe, kind, impl, window):
    """Changing a future token changes no earlier logit, for every position and attention kind."""
    torch.manual_seed(0)
    cfg = tiny_config(
        pos_encoding=pe, n_kv_heads=KV_HEADS[kind], attn_impl=impl, sliding_window=window
    )
    model = Transformer(cfg).eval()
    idx = torch.randint(0, 37, (1, 16))
    t = 9
    changed = idx.clone()
    changed[0, t] = (idx[0, t] + 1) % 37
    a, b = model(idx)[0], model(changed)[0]
    torch.testing.assert_close(a[:, :t], b[:, :t], atol=0, rtol=0)
    assert not torch.allclose(a[:, t:], b[:, t:])  # the change is seen from t on


def test_sdpa_without_a_mask_is_causal_like_the_per_head_reference():
    """mask=None takes SDPA's own causal path; it agrees with the per-head reference loop."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 7, 8) for _ in range(3))
    torch.testing.assert_close(sdpa_attention(q, k, v, None)[0], reference_attention(q, k, v))


def test_gqa_equals_mha_with_shared_kv_heads(tiny_config):
    """A GQA model equals the MHA model whose K/V projections repeat each KV head per group."""
    torch.manual_seed(0)
    gqa = Transformer(tiny_config(n_kv_heads=2)).eval()
    mha = Transformer(tiny_config(n_kv_heads=4)).eval()
    state = gqa.state_dict()
    for name, w in list(state.items()):
        if name.endswith(("attn.wk.weight", "attn.wv.weight")):  # (K*hd, D) -> (H*hd, D)
            state[name] = w.view(2, 8, 32).repeat_interleave(2, dim=0).reshape(32, 32)
    mha.load_state_dict(state)
    idx = torch.randint(0, 37, (2, 11))
    torch.testing.assert_close(gqa(idx)[0], mha(idx)[0], atol=1e-5, rtol=1e-5)


def test_sliding_window_mask(tiny_config):
    allowed = attention_mask(torch.arange(6), torch.arange(6), window=3)[0] == 0
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [0, 1, 1, 1, 0, 0],
            [0, 0, 1, 1, 1, 0],
            [0, 0, 0, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(allowed, expected)
    assert not Transformer(tiny_config()).needs_mask  # plain causal: SDPA's own causal kernel
    assert Transformer(tiny_config(sliding_window=3)).needs_mask
    assert Transformer(tiny_config(pos_encoding="alibi")).needs_mask


def test_sliding_window_hides_tokens_outside_it(tiny_config):
    torch.manual_seed(0)
    model = Transformer(tiny_config(n_layers=1, sliding_window=4, pos_encoding="rope")).eval()
    idx = torch.randint(0, 37, (1, 12))
    changed = idx.clone()
    changed[0, 2] = (idx[0, 2] + 1) % 37
    a, b = model(idx)[0], model(changed)[0]
    assert not torch.allclose(a[0, 5], b[0, 5])  # 5 - 2 = 3 < 4: inside the window
    torch.testing.assert_close(a[0, 6:], b[0, 6:], atol=0, rtol=0)  # 6 - 2 = 4: outside


def test_attention_weights_api(tiny_config):
    model = Transformer(tiny_config(pos_encoding="alibi")).eval()
    weights = model.attention_weights(torch.randint(0, 37, (2, 10)))
    assert len(weights) == 2 and weights[0].shape == (2, 4, 10, 10)
    torch.testing.assert_close(weights[1].sum(-1), torch.ones(2, 4, 10))


def test_mask_for_queries_after_a_prefix():
    """Queries at positions 4..5 against keys 0..5 (decoding after a cached prefix), and keys
    stored out of order (a ring buffer)."""
    allowed = attention_mask(torch.arange(4, 6), torch.arange(6))[0] == 0
    expected = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(allowed, expected)
    windowed = attention_mask(torch.arange(4, 6), torch.arange(6), window=2)[0] == 0
    assert torch.equal(windowed[1], torch.tensor([0, 0, 0, 0, 1, 1], dtype=torch.bool))
    ring = attention_mask(torch.tensor([5]), torch.tensor([4, 5, 2, 3]), window=3)[0] == 0
    assert torch.equal(ring[0], torch.tensor([1, 1, 0, 1], dtype=torch.bool))
