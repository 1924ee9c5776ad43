"""Perplexity per context length, with non-overlapping or sliding windows.

Non-overlapping (``stride=None``): the token stream is cut into windows of ``context + 1`` tokens
sharing one token at each seam; every target is scored once, each seeing 0..context-1 tokens
before it (a last window, ending at the last token, scores the few targets left over).
Sliding (``stride=S``): windows start every S tokens and only their last S targets are scored
(the first window scores all), so every scored token sees at least ``context - S`` tokens of
history: closer to what the model does at its full context, at context/S times the compute.

``with_rope_scaling`` rebuilds a RoPE model with position interpolation or NTK-aware scaling
(same weights, no retraining), to evaluate past the trained context.

``check_data_tokenizer`` refuses prepared data whose tokenizer is not the checkpoint's: its ids
would be scored as other tokens, a loss that means nothing but looks like one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from llm_foundry.models.transformer import IGNORE_INDEX, Transformer


def windows(n_tokens: int, context: int, stride: int | None) -> list[tuple[int, int]]:
    """(start, first scored target offset) of every window over a stream of n_tokens.

    A window covers tokens start..start+context (context inputs, context targets); targets
    before the offset are context only (not scored)."""
    step = stride or context
    out, start = [], 0
    while start + context + 1 <= n_tokens:
        out.append((start, 0 if (start == 0 or stride is None) else context - step))
        start += step
    if out and out[-1][0] + context + 1 < n_tokens:  # targets left over: one window at the end
        last = n_tokens - context - 1  # scores only what the previous windows did not
        out.append((last, out[-1][0] + context - last))
    return out


@torch.no_grad()
def evaluate_tokens(
    model: Transformer,
    tokens: np.ndarray | torch.Tensor,
    context: int,
    stride: int | None = None,
    batch_size: int = 8,
    max_windows: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """Mean next-token loss and perplexity of ``model`` on ``tokens`` (1-D) at ``context``;
    ``progress(done, total)`` is told the windows scored after each batch.

    Returns {"context", "stride", "loss", "ppl", "scored_tokens", "windows"}, or, when the model
    cannot run at this length (learned positions past their table), {"status": "cannot run",
    "reason": ...}."""
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise ValueError(f"context={context!r} must be an integer >= 1")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    if max_windows is not None and max_windows < 1:
        raise ValueError(f"max_windows={max_windows} must be >= 1 (or None: all windows)")
    if stride is not None and not 0 < stride <= context:
        raise ValueError(f"stride={stride} must be in [1, context={context}]")
    cfg = model.cfg
    limit = model.pos.max_positions
    if limit is not None and context > limit:
        return dict(
            context=context,
            stride=stride,
            status="cannot run",
            reason=f"{cfg.pos_encoding} positions have {limit} rows; context {context} needs more",
        )
    data = torch.as_tensor(np.asarray(tokens, dtype=np.int64))
    spans = windows(len(data), context, stride)
    if max_windows is not None:
        spans = spans[:max_windows]
    if not spans:
        raise ValueError(
            f"{len(data):,} tokens are fewer than one window of context + 1 = {context + 1}"
        )
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    offsets = torch.arange(context + 1)
    for i in range(0, len(spans), batch_size):
        chunk = spans[i : i + batch_size]
        starts = torch.tensor([s for s, _ in chunk])
        w = data[starts[:, None] + offsets]  # (b, context + 1)
        x, y = w[:, :-1].clone(), w[:, 1:].clone()
        for row, (_, skip) in enumerate(chunk):
            y[row, :skip] = IGNORE_INDEX  # history only
        logits, _ = model(x.to(device))
        losses = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(),
            y.flatten().to(device),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        total += losses.item()
        count += int((y != IGNORE_INDEX).sum())
        if progress is not None:
            progress(i + len(chunk), len(spans))
    model.train(was_training)
    loss = total / count
    return dict(
        context=context,
        stride=stride,
        loss=loss,
        ppl=math.exp(loss),
        scored_tokens=count,
        windows=len(spans),
    )


def with_rope_scaling(model: Transformer, scaling: str, factor: float) -> Transformer:
    """The same weights in a model whose RoPE uses ``scaling`` (linear | ntk) by ``factor``
    instead of its own (the config refuses scaling on a model without RoPE)."""
    cfg = model.cfg.replace(rope_scaling=scaling, rope_factor=factor)
    scaled = Transformer(cfg).to(next(model.parameters()).device)
    scaled.load_state_dict(model.state_dict())
    return scaled.eval()


def rope_scaling_note(cfg, scaling: str, factor: float) -> str | None:
    """The note on ``with_rope_scaling(model, scaling, factor)`` for a model whose config scales
    its RoPE already (an HF model's rope_scaling): the new scaling replaces that one, it is not
    applied on top; linear factors compose by multiplying. None: the model has no scaling."""
    if cfg.rope_scaling == "none":
        return None
    own = f"rope_scaling={cfg.rope_scaling} x{cfg.rope_factor:g}"
    more = ""
    if cfg.rope_scaling == scaling == "linear":  # positions divided by a, then by b: by a * b
        more = (f"; x{factor:g} on top of it is --rope-scaling linear --rope-factor "
                f"{cfg.rope_factor * factor:g}")  # fmt: skip
    return (f"note: --rope-scaling {scaling} --rope-factor {factor:g} replaces the model's own "
            f"{own} (the two are not composed){more}")  # fmt: skip


# what BPE tokenizers may split differently: spaces, a tab, newlines, digits, 2- to 4-byte UTF-8
PROBE_TEXT = (
    "Hello, world!  12 + 34\n\tTabs\n\nand  spaces; cafe\u0301 \u00e9 \u6771\u4eac \U0001f642 ok."
)


def _vocabulary(tok) -> dict[str, int]:
    """token -> id of a loaded tokenizer: a Hugging Face one's (ours: BPE) or a character one's."""
    hf = getattr(tok, "hf", None)
    return hf.get_vocab() if hf is not None else {c: i for i, c in enumerate(tok.chars)}


def same_ids(a, b) -> bool:
    """Whether two loaded tokenizers give text the same ids, whatever their files' format: the
    same vocabulary and, for BPE ones (merges, pre-tokenizer), the same ids for ``PROBE_TEXT``."""
    if _vocabulary(a) != _vocabulary(b):
        return False
    ha, hb = getattr(a, "hf", None), getattr(b, "hf", None)
    if (ha is None) != (hb is None):
        return False
    if ha is None:  # character tokenizers: the vocabulary is the whole of the encoding
        return True
    return (
        ha.encode(PROBE_TEXT, add_special_tokens=False).ids
        == hb.encode(PROBE_TEXT, add_special_tokens=False).ids
    )


def check_data_tokenizer(
    label: str, data_dir: str | Path, meta: dict, checkpoint: str | Path, tok, vocab_size: int
) -> str | None:
    """Refuse (ValueError, naming ``label``) the prepared directory ``data_dir`` (its ``meta``)
    when its tokenizer is not ``tok``, the one read from ``checkpoint/tokenizer.json`` (None: it
    has none) for a model of ``vocab_size``. The same file (the sha256 training compares on
    resume) passes; files that differ are loaded and compared (``same_ids``): a tokenizer
    re-saved in another format passes. Returns a note when one side has no tokenizer, so nothing
    can be compared; else None."""
    from llm_foundry.data.batches import tokenizer_sha256
    from llm_foundry.tokenizer import load_any_tokenizer

    data_dir, checkpoint = Path(data_dir), Path(checkpoint)
    data_file = data_dir / meta.get("tokenizer_file", "tokenizer.json")
    model_file = checkpoint / "tokenizer.json"
    data_sha = tokenizer_sha256(data_dir, meta)
    if data_sha is None or tok is None:
        missing = model_file if tok is None else data_file
        return (
            f"note: {missing} does not exist: cannot check that {label} was tokenized with the "
            f"model's tokenizer (vocab_size: the data's {meta['vocab_size']:,}, the model's "
            f"{vocab_size:,})"
        )
    if data_sha == tokenizer_sha256(checkpoint, {}):
        return None
    data_tok = load_any_tokenizer(data_file)
    if same_ids(data_tok, tok):
        return None
    raise ValueError(
        f"{label}: tokenized with {data_file} ({data_tok.kind}, {data_tok.vocab_size:,} tokens), "
        f"not the model's {model_file} ({tok.kind}, {tok.vocab_size:,} tokens); its ids would be "
        "scored as other tokens: evaluate data prepared with the model's tokenizer, or the text "
        "itself with --text FILE"
    )
