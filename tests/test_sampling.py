"""Sampling filters and the generate API."""

import warnings

import pytest
import torch
from conftest import assert_decisive

from llm_foundry.config import ModelConfig
from llm_foundry.generate import generate, stream
from llm_foundry.models import Transformer
from llm_foundry.sampling import (
    apply_repetition_penalty,
    check_sampling,
    min_p_filter,
    sample_next,
    top_k_filter,
    top_p_filter,
)


def test_top_k_keeps_k_largest():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0]])
    kept = torch.isfinite(top_k_filter(logits, 2))
    assert kept.tolist() == [[False, True, False, True]]


def test_top_p_keeps_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = torch.isfinite(top_p_filter(probs.log(), 0.75))
    assert kept.tolist() == [[True, True, False, False]]  # 0.5 + 0.3 >= 0.75
    kept = torch.isfinite(top_p_filter(probs.log(), 0.1))
    assert kept.tolist() == [[True, False, False, False]]  # the top token always stays


def test_min_p_is_relative_to_top_token():
    probs = torch.tensor([[0.6, 0.3, 0.08, 0.02]])
    kept = torch.isfinite(min_p_filter(probs.log(), 0.1))  # threshold 0.06
    assert kept.tolist() == [[True, True, True, False]]


def test_repetition_penalty():
    logits = torch.tensor([[2.0, -1.0, 0.5]])
    out = apply_repetition_penalty(logits, torch.tensor([[0, 1]]), 2.0)
    assert out.tolist() == [[1.0, -2.0, 0.5]]


def test_temperature_zero_is_argmax_and_seed_reproduces():
    logits = torch.randn(4, 50)
    assert torch.equal(sample_next(logits, temperature=0), logits.argmax(-1))
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    a = sample_next(logits, temperature=1.0, top_k=10, generator=g1)
    b = sample_next(logits, temperature=1.0, top_k=10, generator=g2)
    assert torch.equal(a, b)


def model_for(pe="rope", max_seq_len=32):
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=23, dim=32, n_layers=2, n_heads=4, max_seq_len=max_seq_len, pos_encoding=pe
    )
    return Transformer(cfg).eval()


def test_generate_shapes_seed_and_stream():
    model = model_for()
    idx = torch.randint(0, 23, (3, 4))
    out = generate(model, idx, 10, temperature=0.9, top_p=0.9, seed=5)
    assert out.shape == (3, 14) and torch.equal(out[:, :4], idx)
    assert torch.equal(out, generate(model, idx, 10, temperature=0.9, top_p=0.9, seed=5))
    streamed = torch.stack(list(stream(model, idx, 10, temperature=0.9, top_p=0.9, seed=5)), 1)
    assert torch.equal(streamed, out[:, 4:])


def test_eos_stops_generation():
    model = model_for()
    idx = torch.randint(0, 23, (1, 4))
    first = generate(model, idx, 1, temperature=0)[0, -1].item()
    out = generate(model, idx, 10, temperature=0, eos_id=first)
    assert out.shape == (1, 5)


def test_past_max_seq_len():
    model = model_for("rope", max_seq_len=8)
    with pytest.warns(UserWarning, match="past the trained context 8"):
        out = generate(model, torch.zeros(1, 4, dtype=torch.long), 10, temperature=0)
    assert out.shape == (1, 14)
    learned = model_for("learned", max_seq_len=8)
    with pytest.raises(ValueError, match="past max_seq_len=8"):
        generate(learned, torch.zeros(1, 4, dtype=torch.long), 10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        generate(learned, torch.zeros(1, 4, dtype=torch.long), 4)  # fits: no warning


def test_cropped_context_equals_recompute_on_the_last_tokens():
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=40, dim=32, n_layers=2, n_heads=4, max_seq_len=16, pos_encoding="learned"
    )
    model = Transformer(cfg).eval()
    idx = torch.randint(0, 40, (2, 5))
    # 35 tokens with a 16-row position table: each window must restart at position 0
    out = generate(model, idx, 30, temperature=0, context=8)
    ref, decisions = idx, []
    for _ in range(30):
        logits = model(ref[:, -8:])[0][:, -1]  # all 8 rows; generate computes only the last
        decisions.append(logits)
        ref = torch.cat([ref, logits.argmax(-1, keepdim=True)], dim=1)
    assert_decisive(torch.stack(decisions, 1))
    assert torch.equal(out, ref)
    with pytest.raises(ValueError, match="context=17 must be in"):
        generate(model, idx, 2, context=17)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(temperature=-1), "temperature=-1 must be >= 0"),
        (dict(top_k=0), "top_k=0 must be an integer >= 1"),
        (dict(top_p=0.0), "top_p=0.0 must be in"),
        (dict(top_p=1.5), "top_p=1.5 must be in"),
        (dict(min_p=2.0), "min_p=2.0 must be in"),
        (dict(repetition_penalty=0.0), "repetition_penalty=0.0 must be > 0"),
        (dict(temperature=float("inf")), "temperature=inf must be >= 0 and finite"),
        (dict(temperature=float("nan")), "temperature=nan must be >= 0 and finite"),
        (dict(temperature=10**400), "temperature=1000.* must be >= 0 and finite"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty=inf must be > 0 and finite"),
        (dict(seed=2**64), r"seed=18446744073709551616 must be an integer in \[-2\*\*63"),
        (dict(seed=-(2**63) - 1), "seed=-9223372036854775809 must be an integer"),
    ],
)
def test_sampling_settings_out_of_range_are_refused_by_name(kw, message):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=40, dim=32, n_layers=1, n_heads=4, max_seq_len=16))
    with pytest.raises(ValueError, match=message):
        generate(model, torch.zeros(1, 3, dtype=torch.long), 2, **kw)
    check_sampling(top_k=1, top_p=1.0, min_p=0.0, repetition_penalty=1.0)  # edges are valid


@pytest.mark.parametrize("temperature", [0, 1.0])
@pytest.mark.parametrize(
    "bad, what",
    [
        ([0.5, float("nan"), 1.0], "NaN"),
        ([float("inf"), 0.0, 1.0], r"\+inf"),
        ([float("-inf")] * 3, "only -inf"),  # nothing left to sample (argmax would say 0)
    ],
)
def test_sample_next_refuses_non_finite_logits(bad, what, temperature):
    logits = torch.tensor([[0.0, 2.0, 1.0], bad])
    with pytest.raises(ValueError, match=rf"non-finite logits \({what}\) for batch row\(s\) \[1\]"):
        sample_next(logits, temperature=temperature)
    masked = torch.tensor([[0.0, float("-inf"), 1.0]])  # some -inf (top-k, a ban): still fine
    assert sample_next(masked, temperature=temperature, top_k=2).tolist() in ([0], [2])


@pytest.mark.parametrize("kw", [dict(temperature=0), dict(temperature=0.8, top_k=5, top_p=0.9)])
def test_generate_with_nan_weights_is_refused(kw):
    model = model_for()
    with torch.no_grad():
        model.layers[1].attn.wo.weight[3, 5] = float("nan")  # one corrupt entry, late layer
    idx = torch.randint(0, 23, (2, 4))
    message = (
        r"new token 1 of 5: the model produced non-finite logits \(NaN\) for batch row\(s\) "
        r"\[0, 1\]: its weights are likely corrupt or diverged"
    )
    with pytest.raises(ValueError, match=message):
        generate(model, idx, 5, seed=0, **kw)


def _distinct_logits(rows: int = 4, vocab: int = 50) -> torch.Tensor:
    """Logits with no ties in any precision (a permutation of integers) and a masked token."""
    torch.manual_seed(0)
    logits = torch.stack([torch.randperm(vocab) for _ in range(rows)]).float() - vocab / 2
    logits[1, :10] = float("-inf")  # masked out (a ban): stays out
    return logits


@pytest.mark.parametrize("temperature", [1e-40, 5e-324, 1e-300])
def test_a_tiny_temperature_tends_to_greedy_instead_of_nan(temperature):
    """logits / 1e-40 overflow to inf (softmax: NaN); scaled after subtracting the row's max,
    every token but the top one goes to -inf: the argmax, in any dtype, with any filter."""
    logits = _distinct_logits()
    g = torch.Generator().manual_seed(0)
    for kw in ({}, {"top_k": 10**12}, {"top_p": 1e-300}, {"min_p": 1.0}, {"top_k": 3}):
        got = sample_next(logits, temperature=temperature, generator=g, **kw)
        assert torch.equal(got, logits.argmax(-1)), kw
    for dtype in (torch.bfloat16, torch.float16):
        low = logits.to(dtype)
        assert torch.equal(sample_next(low, temperature=temperature, generator=g), low.argmax(-1))


def test_a_huge_temperature_is_uniform_over_the_unmasked_tokens():
    """1e300 sends every finite logit to 0 and keeps -inf out: 4000 draws over the 40 allowed
    tokens of a row reach every one of them (each is missed with probability (39/40)^4000) and
    never a masked one."""
    logits = _distinct_logits()[1:2].expand(4000, -1)
    got = sample_next(logits, temperature=1e300, generator=torch.Generator().manual_seed(1))
    assert set(got.tolist()) == set(range(10, 50))


@pytest.mark.parametrize("penalty", [1e-40, 1e40, 1e300])
def test_an_extreme_repetition_penalty_saturates_instead_of_overflowing(penalty):
    """2 / 1e-40 or -1 * 1e300 overflow float32 to inf (and 0 * inf is NaN): the penalty acts
    at most as 1e30 and the result is clamped to the largest finite float: a seen positive
    logit becomes as good as certain (penalty < 1) or about 0 (> 1), a seen negative one about
    0 or far below, never inf or NaN."""
    inf = float("inf")
    logits = torch.tensor([[2.0, -1.0, 0.0, 0.5, -inf]])
    out = apply_repetition_penalty(logits, torch.tensor([[0, 1, 2, 4]]), penalty)
    assert torch.isfinite(out[0, :4]).all() and out[0, 4] == -inf
    assert out[0, 2] == 0 and out[0, 3] == 0.5  # zero stays zero; unseen tokens untouched
    if penalty < 1:
        assert out[0, 0] > 1e29 and -1e-29 < out[0, 1] < 0
    else:
        assert 0 < out[0, 0] < 1e-29 and out[0, 1] < -1e29
    g = torch.Generator().manual_seed(0)
    if penalty < 1:  # the others are e^-1e30 as likely: 0
        assert sample_next(out, temperature=0.7, generator=g).item() == 0
    else:
        assert sample_next(out, temperature=0).item() == 3
        assert sample_next(out, temperature=0.7, generator=g).item() in (0, 2, 3)
