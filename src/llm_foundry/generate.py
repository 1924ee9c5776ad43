"""Text generation: prefill the prompt into a KV cache in one forward, then one token a step."""

from __future__ import annotations

import numbers
import warnings
import weakref
from collections.abc import Iterator

import torch

from llm_foundry.messages import shown
from llm_foundry.sampling import apply_repetition_penalty, check_sampling, sample_next

SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes


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
    context: int | None = None,
    pad: torch.Tensor | None = None,
    compile: bool = False,
    cuda_graph: bool = False,
) -> Iterator[torch.Tensor]:
    """Yield the next tokens (B,) one step at a time for prompts ``idx`` (B, T).

    ``compile=True`` runs the one-token decode step through ``torch.compile`` (compiled once per
    model, with a dynamic cache length): it fuses the many small kernels between the matrix
    multiplies. The first call pays the compilation.

    ``cuda_graph=True`` decodes with a static step (``llm_foundry.decode_graph``): a preallocated
    cache read whole under a mask, the position in a device tensor, the same shapes every step,
    captured once as a CUDA graph and replayed each token (one launch instead of hundreds: small
    batches on a GPU are bound by launches); with ``compile=True`` the compiled step is
    captured. Off CUDA the static step runs eagerly, with a warning. Not with ``context``.

    ``pad`` (B,): row b of ``idx`` starts with pad[b] left-padding tokens, which are masked out
    and do not count as positions (see ``generate_batch``).

    ``context=N`` feeds only the last N tokens each step, recomputed without a cache (as
    nanoGPT samples): slower, but a model never sees more context than it was trained on.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
    check_sampling(temperature, top_k, top_p, min_p, repetition_penalty)
    check_seed(seed)
    if cuda_graph and context is not None:
        raise ValueError(
            "cuda_graph=True decodes over a KV cache; context=N (cropped, uncached decoding) "
            "has none: give one or the other"
        )
    if context is None:
        next_logits = _cached_step(model, idx, max_new_tokens, pad, compile, cuda_graph)
    else:
        next_logits = _cropped_step(model, context, pad)
    was_training = model.training
    model.eval()
    generator = None
    if seed is not None:
        generator = torch.Generator(device=idx.device).manual_seed(seed)
    done = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
    seen = idx  # every token so far (pads stand in the row's first real token)
    if pad is not None:
        slot = torch.arange(idx.shape[1], device=idx.device)[None]
        seen = torch.where(slot < pad[:, None], idx.gather(1, pad[:, None]), idx)
    new = None  # nothing generated yet: the first step reads the whole prompt
    try:
        for step in range(max_new_tokens):
            logits = next_logits(seen, new)  # (B, V)
            if repetition_penalty is not None and repetition_penalty != 1.0:
                logits = apply_repetition_penalty(logits, seen, repetition_penalty)
            try:
                nxt = sample_next(
                    logits,
                    temperature=temperature,
                    top_k=top_k,
                    top_p=top_p,
                    min_p=min_p,
                    generator=generator,
                )
            except ValueError as e:  # non-finite logits: say which step
                raise ValueError(f"new token {step + 1} of {max_new_tokens}: {e}") from None
            if eos_id is not None:
                nxt = nxt.masked_fill(done, eos_id)  # finished rows keep emitting eos
                done |= nxt == eos_id
            new = nxt[:, None]
            seen = torch.cat([seen, new], dim=1)
            yield nxt
            if eos_id is not None and bool(done.all()):
                break
    finally:
        model.train(was_training)


def check_seed(seed: int | None) -> None:
    """Raise ValueError unless ``seed`` is None or an integer a torch generator takes."""
    if seed is None:
        return
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not (
        SEED_RANGE[0] <= seed <= SEED_RANGE[1]
    ):  # fmt: skip
        raise ValueError(f"seed={shown(seed)} must be an integer in [-2**63, 2**64 - 1]")


def _cached_step(model, idx, max_new_tokens, pad, compile, cuda_graph=False):
    """next_logits(seen, new) over a KV cache: prefill the prompt once, then one token a step
    (``cuda_graph``: the static step of ``llm_foundry.decode_graph``)."""
    total = idx.shape[1] + max_new_tokens
    longest = total - (int(pad.min()) if pad is not None else 0)  # positions the longest row uses
    past = longest > model.cfg.max_seq_len
    if past and model.pos.max_positions is not None:
        raise ValueError(
            f"prompt ({longest - max_new_tokens} tokens) + max_new_tokens ({max_new_tokens}) "
            f"= {longest} is past max_seq_len={model.cfg.max_seq_len}, and learned positions "
            "have no row beyond it: shorten the prompt or max_new_tokens"
        )
    size = total
    if cuda_graph:
        from llm_foundry import decode_graph

        size = decode_graph.buffer_length(total, idx.device)
    _check_cache_fits(model, idx.shape[0], size, max_new_tokens)  # before the notes below
    if past:
        warnings.warn(
            f"generating {longest} tokens past the trained context {model.cfg.max_seq_len} "
            f"({model.cfg.pos_encoding} positions run on, but quality may drop)",
            stacklevel=3,
        )
    if cuda_graph:
        decode_graph.check_static(model, capture=decode_graph.captures(idx.device))
        if not decode_graph.captures(idx.device):
            warnings.warn(
                f"cuda_graph=True: no CUDA graphs on {idx.device.type}; the static decode step "
                "runs eagerly (the same tokens, no faster)",
                stacklevel=3,
            )
        model.pos.reserve(longest)
        return decode_graph.static_next_logits(model, idx, pad, size, compile)
    cache = model.new_cache(idx.shape[0], total)
    cache.pad = pad
    model.pos.reserve(longest)  # position tables built now, not inside a compiled decode step
    decode = _compiled(model) if compile else model

    def next_logits(seen, new):
        if new is None:  # prefill eager: its shape is seen once
            return model(idx, cache=cache, last_only=True)[0][:, -1, :]
        return decode(new, cache=cache, last_only=True)[0][:, -1, :]

    return next_logits


def _check_cache_fits(model, rows: int, total: int, max_new_tokens: int) -> None:
    """Refuse, before allocating, a KV cache of ``rows`` x ``total`` positions larger than the
    memory left on the model's device."""
    from llm_foundry.accounting import human
    from llm_foundry.machine import memory_left
    from llm_foundry.models.kv_cache import cache_bytes

    w = model.tok_emb.weight
    need = cache_bytes(model.cfg, rows, total, w.dtype)
    have = memory_left(w.device)
    if have is not None and need > have:
        raise ValueError(
            f"prompt + max_new_tokens ({max_new_tokens}) = {total} positions: their KV cache "
            f"would take {human(need, 'B')}, more than the {human(have, 'B')} of memory left on "
            f"{w.device}; ask for fewer new tokens (or feed a window of the last N tokens, "
            "context=N, which needs no cache)"
        )


def _cropped_step(model, context, pad):
    """next_logits(seen, new) recomputing the last ``context`` tokens, no cache (as nanoGPT)."""
    if pad is not None:
        raise ValueError("context=N (cropped, uncached decoding) does not take padded batches")
    if not 0 < context <= model.cfg.max_seq_len:
        raise ValueError(f"context={context} must be in [1, max_seq_len={model.cfg.max_seq_len}]")
    return lambda seen, new: model(seen[:, -context:], last_only=True)[0][:, -1, :]


_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _compiled(model):
    """``torch.compile(model)`` made once per model and kept while the model lives."""
    if model not in _COMPILED:
        _COMPILED[model] = torch.compile(model, dynamic=True)
    return _COMPILED[model]


def generate(model, idx: torch.Tensor, max_new_tokens: int, **kwargs) -> torch.Tensor:
    """Prompt and continuation (B, T + new); ``temperature=0`` is greedy. See ``stream``."""
    new = list(stream(model, idx, max_new_tokens, **kwargs))
    return torch.cat([idx, torch.stack(new, dim=1)], dim=1) if new else idx


def stream_batch(
    model, prompts: list[list[int]], max_new_tokens: int, **kwargs
) -> Iterator[torch.Tensor]:
    """``stream`` for prompts of different lengths in one batch: left-padded, the pads masked
    out and skipped by the positions, so each row's tokens equal generating that prompt alone
    (greedy). Yields the next tokens (B,) one step at a time."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("a batch needs at least one prompt and no empty prompt")
    device = next(model.parameters()).device
    longest = max(len(p) for p in prompts)
    pad = torch.tensor([longest - len(p) for p in prompts], device=device)
    idx = torch.tensor([[0] * (longest - len(p)) + list(p) for p in prompts], device=device)
    return stream(model, idx, max_new_tokens, pad=pad, **kwargs)


def generate_batch(
    model, prompts: list[list[int]], max_new_tokens: int, **kwargs
) -> list[list[int]]:
    """Prompts of different lengths in one batch (``stream_batch``); returns each prompt
    followed by its continuation (cut after ``eos_id`` if given)."""
    steps = list(stream_batch(model, prompts, max_new_tokens, **kwargs))
    new = torch.stack(steps, dim=1).tolist() if steps else [[] for _ in prompts]
    eos = kwargs.get("eos_id")
    out = []
    for p, row in zip(prompts, new, strict=True):
        if eos is not None and eos in row:
            row = row[: row.index(eos) + 1]
        out.append(list(p) + row)
    return out


def sample_text(
    model, tokenizer, n_tokens: int, seed: int, context: int, prompt: str = "\n"
) -> str:
    """A short sample from ``model`` (temperature 0.8, top-k 50), prompt included, seeing at
    most ``context`` tokens (the training block) at a time."""
    try:
        ids = tokenizer.encode(prompt)
    except ValueError:
        ids = [tokenizer.bos_id or 0]
    device = next(model.parameters()).device
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    context = min(context, model.cfg.max_seq_len)
    out = generate(model, idx, n_tokens, temperature=0.8, top_k=50, seed=seed, context=context)
    return tokenizer.decode(out[0].tolist())
