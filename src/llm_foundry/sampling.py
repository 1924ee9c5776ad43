"""Sampling strategies as pure functions on logits (B, V) -> logits (B, V) or token ids (B,)."""

from __future__ import annotations

import math

import torch

PENALTY_RANGE = (1e-30, 1e30)  # a repetition penalty beyond these acts as these (finite products)


def _finite(value) -> bool:
    """A number a float holds, not inf or NaN (an int past float's range is not)."""
    try:
        return math.isfinite(float(value))
    except (OverflowError, TypeError, ValueError):
        return False


def check_sampling(
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
) -> None:
    """Raise ValueError naming the first sampling setting out of its range (None = off)."""
    rules = (
        (
            "temperature",
            temperature,
            _finite(temperature) and temperature >= 0,
            ">= 0 and finite (0 = greedy)",
        ),
        ("top_k", top_k, top_k is None or top_k >= 1, "an integer >= 1"),
        ("top_p", top_p, top_p is None or 0 < top_p <= 1, "in (0, 1]"),
        ("min_p", min_p, min_p is None or 0 <= min_p <= 1, "in [0, 1]"),
        (
            "repetition_penalty",
            repetition_penalty,
            repetition_penalty is None or (_finite(repetition_penalty) and repetition_penalty > 0),
            "> 0 and finite (1 = off)",
        ),
    )
    for name, value, ok, valid in rules:
        if not ok:
            raise ValueError(f"{name}={value!r} must be {valid}")


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float):
    """Make tokens already in ``seen`` (B, T) less likely (Keskar et al. 2019, CTRL): divide
    positive logits by ``penalty``, multiply negative ones by it. An extreme penalty (1e-40,
    1e40) saturates at the dtype's largest finite logit instead of overflowing to inf: the seen
    tokens become as good as certain, or as good as banned, never NaN."""
    penalty = min(max(float(penalty), PENALTY_RANGE[0]), PENALTY_RANGE[1])
    picked = logits.gather(1, seen)
    scaled = torch.where(picked > 0, picked / penalty, picked * penalty)
    big = torch.finfo(logits.dtype).max
    scaled = torch.where(torch.isfinite(picked), scaled.clamp(-big, big), picked)
    return logits.scatter(1, seen, scaled)


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of each row."""
    k = min(k, logits.shape[-1])
    kth = torch.topk(logits, k, dim=-1).values[:, -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus sampling (Holtzman et al. 2020): keep the smallest set of tokens whose
    probabilities add up to at least p."""
    sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
    cum = sorted_logits.softmax(-1).cumsum(-1)
    drop = cum - sorted_logits.softmax(-1) >= p  # mass before this token already reaches p
    drop[:, 0] = False
    return logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Keep tokens whose probability is at least min_p times the top token's (Nguyen et al. 2024)."""
    probs = logits.softmax(-1)
    threshold = min_p * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


def check_finite_logits(logits: torch.Tensor) -> None:
    """Raise ValueError unless every row of ``logits`` (B, V) has a finite maximum: no NaN, no
    +inf, not all -inf. One reduction and one read-back per step."""
    # max propagates NaN, so one (B,) reduction sees NaN, +inf and all -inf rows alike
    if bool(torch.isfinite(logits.amax(-1)).all()):
        return
    peak = logits.amax(-1)
    rows = torch.nonzero(~torch.isfinite(peak)).flatten().tolist()
    what = sorted(
        {"NaN" if peak[r].isnan() else "+inf" if peak[r] > 0 else "only -inf" for r in rows}
    )
    raise ValueError(
        f"the model produced non-finite logits ({', '.join(what)}) for batch row(s) {rows[:8]}: "
        "its weights are likely corrupt or diverged (or overflowed in half precision); check the "
        "checkpoint for NaN/inf, load an earlier one, or run in float32"
    )


def sample_next(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Pick one token per row of ``logits`` (B, V); temperature 0 is greedy. Returns (B,).

    A row holding NaN or +inf, or nothing but -inf, has no distribution to sample (nor a
    meaningful argmax): ValueError. -inf entries elsewhere (tokens masked out) are fine.

    The logits are scaled after subtracting each row's maximum, so every row keeps a 0 (its top
    token) and nothing else above it: a tiny temperature (1e-40) sends the others to -inf and
    tends to greedy, a huge one sends them to 0 (uniform); neither gives inf or NaN.
    """
    check_finite_logits(logits)
    if temperature == 0:
        return logits.argmax(-1)
    x = logits.float()
    x = x - x.amax(-1, keepdim=True)
    # 0 (the top) and -inf (masked) stay as they are: 0 / a temperature that is 0 in float32,
    # and -inf / one that is inf, would be NaN
    logits = torch.where(torch.isfinite(x) & (x != 0), x / float(temperature), x)
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    if top_p is not None:
        logits = top_p_filter(logits, top_p)
    if min_p is not None:
        logits = min_p_filter(logits, min_p)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)
