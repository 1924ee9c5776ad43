"""Text generation: prefill the prompt into a KV cache in one forward, then one token a step."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import torch

from llm_foundry.sampling import apply_repetition_penalty, sample_next


@torch.no_grad()
def stream(
    model,
    idx: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    eos_id: int | None = None,
    seed: int | None = None,
) -> Iterator[torch.Tensor]:
    """Yield the next tokens (B,) one step at a time for prompts ``idx`` (B, T)."""
    total = idx.shape[1] + max_new_tokens
    if total > model.cfg.max_seq_len:
        if model.cfg.pos_encoding == "learned":
            raise ValueError(
                f"prompt ({idx.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) = {total} is "
                f"past max_seq_len={model.cfg.max_seq_len}, and learned positions have no row "
                "beyond it: shorten the prompt or max_new_tokens"
            )
        warnings.warn(
            f"generating {total} tokens past the trained context {model.cfg.max_seq_len} "
            f"({model.cfg.pos_encoding} positions run on, but quality may drop)",
            stacklevel=2,
        )
    was_training = model.training
    model.eval()
    generator = None
    if seed is not None:
        generator = torch.Generator(device=idx.device).manual_seed(seed)
    done = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
    cache = model.new_cache(idx.shape[0], total)
    seen = idx
    step_input = idx  # the whole prompt first (prefill), then one new token a step
    try:
        for _ in range(max_new_tokens):
            logits = model(step_input, cache=cache, last_only=True)[0][:, -1, :]  # (B, V)
            if repetition_penalty is not None and repetition_penalty != 1.0:
                logits = apply_repetition_penalty(logits, seen, repetition_penalty)
            nxt = sample_next(
                logits,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                min_p=min_p,
                generator=generator,
            )
            if eos_id is not None:
                nxt = nxt.masked_fill(done, eos_id)  # finished rows keep emitting eos
                done |= nxt == eos_id
            step_input = nxt[:, None]
            if repetition_penalty is not None:
                seen = torch.cat([seen, step_input], dim=1)
            yield nxt
            if eos_id is not None and bool(done.all()):
                break
    finally:
        model.train(was_training)


def generate(model, idx: torch.Tensor, max_new_tokens: int, **kwargs) -> torch.Tensor:
    """Prompt and continuation (B, T + new); ``temperature=0`` is greedy. See ``stream``."""
    new = list(stream(model, idx, max_new_tokens, **kwargs))
    return torch.cat([idx, torch.stack(new, dim=1)], dim=1) if new else idx
