"""The output head and its cross-entropy in one pass over chunks of rows, never holding the
(N, vocab) logits: ``linear_cross_entropy``, what ``train.fused_loss`` trains with.

The plain head computes logits = x W^T (+ b), (N, V), and F.cross_entropy(logits.float()): at
32 x 1024 tokens and a 50,304-token vocabulary that is 3.3 GB of bf16 logits, 6.6 GB of their
fp32 copy, and their gradients, the largest tensors of a 124M model's step. Here the N rows go
through in chunks of ``chunk_rows``: each chunk's logits (in the matmul dtype: bf16 under bf16
autocast, as the plain head's), their log-sum-exp in fp32, the chunk's rows of the loss and,
while the logits are at hand, their gradient softmax - onehot, which is multiplied into the
chunk's rows of grad x and added into grad W (fp32) at once (Liger-Kernel's
FusedLinearCrossEntropy computes gradients in the forward pass the same way; recomputing the
logits in backward instead would cost a third more of the head's FLOPs). What stays alive from
forward to backward is grad x (N, D) and grad W (V, D), not the logits; backward only scales
them by the incoming gradient. Peak extra memory: one chunk's logits (in the matmul dtype),
their fp32 copy (made into the gradient in place) and its copy in the matmul dtype.

The gradient is kept unnormalised (softmax - onehot, entries in [-1, 1]) through the low-precision
matmuls and divided by the number of targets in fp32 afterwards, so fp16's small values do not
flush to zero (where the plain head relies on the grad scaler for that).

Same numbers as the plain head: loss the mean over targets that are not ``ignore_index`` (NaN
when there are none, gradients then zero, as F.cross_entropy), in fp32; in fp32 equal up to the
order of summation; under bf16 autocast up to bf16 rounding. Plain autograd: it runs under
torch.compile, DDP and FSDP2, and a head tied to the embedding gets its gradient added to the
embedding's as usual.
"""

from __future__ import annotations

import torch
import torch.nn as nn

IGNORE_INDEX = -100
# fp32 logits per chunk (elements): 2**27 x 4 bytes = 512 MiB at most, in chunks of a power of
# two rows (2048 for a 50,304-token vocabulary: 16 chunks at 32 x 1024 tokens). Larger chunks
# mean fewer passes of the grad W accumulation over (V, D); smaller, less memory.
CHUNK_ELEMENTS = 2**27


@torch.library.custom_op("llm_foundry::accumulate_mm_", mutates_args=("acc",))
def accumulate_mm_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b (acc fp32, a and b in the matmul dtype), one op: under torch.compile the
    chunks' (V, D) products are made and added one at a time. Written as plain ``add_``, Inductor
    fuses the chain of additions into one kernel reading every chunk's product, all alive at
    once (measured: 32 chunks of a 50k x 768 head held 2.4 GB)."""
    acc.add_(a @ b)


@accumulate_mm_.register_fake
def _(acc, a, b) -> None:
    return None


def default_chunk_rows(n: int, vocab: int) -> int:
    """Rows per chunk: the largest power of two whose fp32 logits fit ``CHUNK_ELEMENTS`` (at
    least 1, at most ``n``)."""
    rows = max(1, CHUNK_ELEMENTS // max(vocab, 1))
    return max(1, min(n, 1 << (rows.bit_length() - 1)))


def compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmul runs in: autocast's where it is on for x's device (what
    F.linear would use), else the inputs' common dtype."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return torch.promote_types(x.dtype, weight.dtype)


def _chunks(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    ignore_index: int,
    chunk_rows: int,
    dtype: torch.dtype,
    grads: tuple[bool, bool, bool],
):
    """(loss, grad x, grad W, grad b) for a unit incoming gradient; a gradient not asked for in
    ``grads`` (x, W, b) is None. No autograd inside: the caller holds what backward needs."""
    n = x.shape[0]
    w = weight.to(dtype)
    b = bias.to(dtype) if bias is not None else None
    want_x, want_w, want_b = grads
    acc = torch.promote_types(dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
    gx = [] if want_x else None  # each chunk's rows, concatenated at the end
    gw = torch.zeros(weight.shape, dtype=acc, device=x.device) if want_w else None
    gb = torch.zeros(weight.shape[0], dtype=acc, device=x.device) if want_b else None
    valid_all = targets != ignore_index
    count = valid_all.sum()
    # gradients of the mean; with no target at all they are zero (every row is masked), and the
    # loss 0/0 = NaN, as F.cross_entropy's
    inv = 1.0 / count.clamp(min=1).to(acc)
    total = torch.zeros((), dtype=acc, device=x.device)
    for s in range(0, n, chunk_rows):
        e = min(s + chunk_rows, n)
        xc = x[s:e].to(dtype)
        t = targets[s:e]
        valid = valid_all[s:e]
        safe = torch.where(valid, t, 0).unsqueeze(1)
        logits = xc @ w.t() if b is None else torch.addmm(b, xc, w.t())  # (rows, V), dtype
        z = logits.to(acc)
        lse = torch.logsumexp(z, dim=1)
        picked = z.gather(1, safe).squeeze(1)
        total = total + torch.where(valid, lse - picked, 0.0).sum()
        if not (want_x or want_w or want_b):
            continue
        # d loss_row / d logits = softmax - onehot (zero rows where ignored), scaled by 1/count
        # below, in fp32, after the low-precision matmuls
        # in place: one chunk-sized buffer (z is the logits themselves in fp32)
        g = z.sub_(lse.unsqueeze(1)).exp_()
        g.scatter_add_(1, safe, torch.full_like(lse, -1.0).unsqueeze(1))
        g.mul_(valid.unsqueeze(1))
        if want_b:
            gb.add_(g.sum(0))
        g = g.to(dtype)
        if want_x:
            gx.append((g @ w).to(acc) * inv)
        if want_w:
            accumulate_mm_(gw, g.t(), xc)  # fp32 += dtype: added in fp32
    loss = total / count.to(acc)
    return (
        loss,
        torch.cat(gx) if want_x else None,
        gw * inv if want_w else None,
        gb * inv if want_b else None,
    )


class _LinearCrossEntropy(torch.autograd.Function):
    """loss = CE(x W^T + b, targets); gradients computed in forward, scaled in backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, targets, ignore_index, chunk_rows, dtype, grads):
        loss, gx, gw, gb = _chunks(x, weight, bias, targets, ignore_index, chunk_rows, dtype, grads)
        ctx.save_for_backward(gx, gw, gb)
        ctx.dtypes = (x.dtype, weight.dtype, bias.dtype if bias is not None else None)
        return loss

    @staticmethod
    def backward(ctx, grad):
        gx, gw, gb = ctx.saved_tensors
        dx, dw, db = ctx.dtypes
        return (
            None if gx is None else (gx * grad).to(dx),
            None if gw is None else (gw * grad).to(dw),
            None if gb is None else (gb * grad).to(db),
            None,
            None,
            None,
            None,
            None,
        )


def linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = IGNORE_INDEX,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of the logits x W^T + b against ``targets``, over the targets that are
    not ``ignore_index``, computed ``chunk_rows`` rows at a time (``default_chunk_rows`` when
    None): F.cross_entropy(F.linear(x, weight, bias).float(), targets) without the (N, V)
    logits. x (..., D); weight (V, D); bias (V,) or None; targets (...) int64. Returns an fp32
    scalar. Under autocast the matmuls run in autocast's dtype, as F.linear's would."""
    x2 = x.reshape(-1, x.shape[-1])
    t = targets.reshape(-1)
    if t.shape[0] != x2.shape[0]:
        raise ValueError(f"targets {tuple(targets.shape)} do not match x {tuple(x.shape)}")
    rows = chunk_rows or default_chunk_rows(x2.shape[0], weight.shape[0])
    if rows < 1:
        raise ValueError(f"chunk_rows={chunk_rows} must be positive")
    dtype = compute_dtype(x2, weight)
    on = torch.is_grad_enabled()
    grads = (
        on and x2.requires_grad,
        on and weight.requires_grad,
        on and bias is not None and bias.requires_grad,
    )
    if not any(grads):  # evaluation: the loss alone, nothing kept
        return _chunks(x2, weight, bias, t, ignore_index, rows, dtype, grads)[0]
    return _LinearCrossEntropy.apply(x2, weight, bias, t, ignore_index, rows, dtype, grads)


def head_loss(
    head: nn.Module,
    x: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """``linear_cross_entropy`` of a model's output head ``head`` (an ``nn.Linear``) on hidden
    states x (..., D). A head that is not a plain linear layer (LoRA adapters, quantized weights)
    is refused: its logits are not x W^T + b."""
    if not isinstance(head, nn.Linear):
        raise TypeError(
            f"the fused loss needs a plain linear output head, not {type(head).__name__} "
            "(LoRA on lm_head or a quantized head): set train.fused_loss=false"
        )
    return linear_cross_entropy(
        x, head.weight, targets, head.bias, ignore_index=ignore_index, chunk_rows=chunk_rows
    )
