"""A static decode step, and its CUDA graph: ``generate(..., cuda_graph=True)``.

Decoding one token at a time at batch 1 on a GPU is bound by kernel launches: a step of a 124M
model is a few hundred tiny kernels, each launched from Python. A CUDA graph records them once
and replays them with one launch, but only for a step whose shapes, memory and control flow are
the same every time. The ordinary cached step (``generate._cached_step``) is not: it slices the
cache to the current length and passes the position as a Python int. The static step is:

- its token ids are read from a (B, 1) buffer, the position it writes (its *slot*, counted in
  the padded batch's columns) from a (1,) long tensor, each row's left padding from a (B,) one;
- each row's position (slot - pad) drives the positions from device tensors: RoPE's cos/sin rows
  by ``index_select`` from a table built for the whole buffer beforehand, learned positions by
  lookup, sinusoidal ones computed, ALiBi's bias from the key positions;
- the new keys/values go into the preallocated cache with ``index_copy_`` (``KVCache.write``)
  and attention reads the whole buffer, a mask hiding slots past the step's position, each row's
  left padding and keys outside a sliding window (whose ring records its slots' positions in a
  tensor, written by the step itself).

The prompt is prefilled by the model's ordinary forward into the same cache; each decode step
then runs the static step, eagerly or as a replay of the graph captured at the first step (after
warm-up on a side stream; with ``compile=True`` the compiled step is what is captured). Sampling
stays outside, on the logits. A captured graph is kept per model and reused by later
generations with the same batch size, rounded cache length and weights (``release`` drops it and
its cache). Off CUDA the static step runs eagerly: the same numbers as on CUDA, no graph.

Refused: expert routing (MoE; its shapes depend on the data) under a graph, and position schemes
the static step does not know (registered beyond the built-in five).
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

from llm_foundry.models.attention import attention_mask, padding_mask
from llm_foundry.models.position import (
    AlibiPosition,
    LearnedPosition,
    NoPosition,
    RotaryPosition,
    SinusoidalPosition,
    apply_rope,
    sinusoidal_table,
)

BUCKET = 256  # a captured cache's length is rounded up to a multiple: one graph serves many
WARMUP = 3  # eager runs on a side stream before capture (cuBLAS handles, compilation)
STATIC_POSITIONS = (NoPosition, LearnedPosition, SinusoidalPosition, RotaryPosition, AlibiPosition)


def captures(device) -> bool:
    """Whether a static decode on ``device`` is captured as a CUDA graph (else it runs eagerly)."""
    return torch.device(device).type == "cuda"


def buffer_length(total: int, device) -> int:
    """The cache length a static decode of ``total`` positions allocates: ``total`` rounded up to
    a multiple of ``BUCKET`` where a graph is captured (later lengths reuse it; fused attention
    wants an aligned mask), ``total`` itself elsewhere."""
    return -(-total // BUCKET) * BUCKET if captures(device) else total


def check_static(model, capture: bool) -> None:
    """Raise ValueError, in one line, for a model the static step (``capture``: a CUDA graph of
    it) cannot run."""
    if type(model.pos) not in STATIC_POSITIONS:
        raise ValueError(
            f"cuda_graph=True: the static decode step knows the built-in position schemes, not "
            f"{type(model.pos).__name__} (pos_encoding={model.cfg.pos_encoding!r}); decode "
            "without cuda_graph"
        )
    if capture and model.moe_layers():
        raise ValueError(
            "cuda_graph=True: expert routing (MoE) picks data-dependent shapes a CUDA graph "
            "cannot hold; decode without cuda_graph (compile=True still fuses the step)"
        )


class Step(NamedTuple):
    """What the static step hands the blocks in place of ``start``: the buffer slot (1,) the
    new keys/values go to, and RoPE's cos/sin (B, 1, 1, hd) at each row's position (or None)."""

    index: torch.Tensor
    cos: torch.Tensor | None
    sin: torch.Tensor | None


class _StepPositions:
    """Stands in for ``model.pos`` inside the blocks: rotates q, k by the step's cos/sin."""

    @staticmethod
    def rotate(q, k, step: Step, pad=None):
        if step.cos is None:
            return q, k
        cos, sin = step.cos.to(q.dtype), step.sin.to(q.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


class _StepCache:
    """Stands in for the cache inside the blocks: writes at the step's slot (``KVCache.write``)."""

    pad = None  # each row's positions are in the Step already

    def __init__(self, cache):
        self.cache = cache

    def update(self, layer, k, v, step: Step):
        return self.cache.write(layer, k, v, step.index)


class StaticDecoder:
    """The static one-token step of ``model`` for ``batch`` rows over a cache of ``length``
    positions, with its inputs in fixed buffers; ``capture=True`` replays it as a CUDA graph
    recorded at the first step."""

    def __init__(self, model, batch: int, length: int, *, compile: bool = False,
                 capture: bool = False, cache=None):  # fmt: skip
        check_static(model, capture)
        self._model = weakref.ref(model)  # kept per model in a weak map: no reference back
        dev = model.tok_emb.weight.device
        # ``cache``: rows of a cache someone else owns (the serving engine's), written in place
        self.cache = cache if cache is not None else model.new_cache(batch, length)
        self.length = length
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=dev)
        self.slot = torch.zeros(1, dtype=torch.long, device=dev)
        self.pad = torch.zeros(batch, dtype=torch.long, device=dev)
        self.key_pos = torch.arange(self.cache.size, device=dev)  # what each slot holds (no ring)
        self.rope = isinstance(model.pos, RotaryPosition)
        if self.rope:  # the table for every position the buffer can hold, kept: a later growth
            model.pos.reserve(length)  # of model.pos's table reallocates it, not this one
            self.cos, self.sin = model.pos.cos, model.pos.sin
        self.capture = capture
        self.fn = torch.compile(type(self)._forward, dynamic=False) if compile else None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None  # the graph's output buffer
        self.owner = None  # weakref to the generation using it (its next_logits)
        self.key = None
        self.used = False

    def _forward(self, model) -> torch.Tensor:
        """One token per row at position ``self.slot``: logits (B, V); writes the cache."""
        cache, slot, pad = self.cache, self.slot, self.pad
        pos = (slot - pad).clamp(min=0)  # (B,) each row's position, counted from its first token
        x = model.tok_emb(self.tokens)  # (B, 1, D)
        if type(model.pos) is LearnedPosition:
            x = x + model.pos.emb(pos)[:, None]
        elif type(model.pos) is SinusoidalPosition:
            x = x + sinusoidal_table(pos, model.pos.dim).to(x.dtype)[:, None]
        x = model.drop(model.emb_norm(x))
        index = slot % cache.size
        if cache.window is None:
            k_pos = self.key_pos
        else:  # the ring records which position each slot holds; the step writes its own first
            cache.slot_pos.index_copy_(0, index, slot)
            k_pos = cache.slot_pos
        mask = attention_mask(slot, k_pos, cache.window, model.pos.bias(slot, k_pos))
        mask = mask + padding_mask(slot, k_pos, pad)  # (B, 1|H, 1, S)
        cos = sin = None
        if self.rope:
            cos = self.cos.index_select(0, pos)[:, None, None]
            sin = self.sin.index_select(0, pos)[:, None, None]
        step, positions, kv = Step(index, cos, sin), _StepPositions(), _StepCache(cache)
        for i, layer in enumerate(model.layers):
            x, _ = layer(x, positions, step, mask, False, (kv, i))
        return model.lm_head(model.norm(x))[:, -1]

    def _run(self, model) -> torch.Tensor:
        return self.fn(self, model) if self.fn is not None else self._forward(model)

    # ------------------------------------------------------------------------------------------
    def free(self) -> bool:
        return self.owner is None or self.owner() is None

    def prefill(self, idx: torch.Tensor, pad: torch.Tensor | None) -> torch.Tensor:
        """Start a generation: the prompts ``idx`` (B, T), left-padded by ``pad`` (B,) or not,
        through the model's ordinary forward into the cache. Returns the last logits (B, V)."""
        model = self._model()
        if self.used:  # a reused buffer: what the last generation left is masked, but zero it
            for t in self.cache.k + self.cache.v:
                t.zero_()
        self.used = True
        self.cache.reset()
        self.cache.pad = pad
        if pad is None:
            self.pad.zero_()
        else:
            self.pad.copy_(pad)
        return model(idx, cache=self.cache, last_only=True)[0][:, -1, :]

    def step(self, new: torch.Tensor) -> torch.Tensor:
        """Feed one token per row ``new`` (B, 1) at the next position: logits (B, V)."""
        at = self.cache.length
        logits = self.decode(new, at)
        self.cache.length = at + 1
        return logits

    def decode(self, new: torch.Tensor, at: int, pad: torch.Tensor | None = None) -> torch.Tensor:
        """Feed one token per row ``new`` (B, 1) at buffer slot ``at``, each row left-padded by
        ``pad`` (B,) (None: as at prefill): logits (B, V). The caller keeps the cache's length."""
        if at >= self.length:
            raise ValueError(f"KV cache full: position {at} does not fit its max_len={self.length}")
        self.tokens.copy_(new, non_blocking=True)
        self.slot.fill_(at)
        if pad is not None:
            self.pad.copy_(pad, non_blocking=True)
        if self.capture and self.graph is None:
            self._capture()
        if self.graph is not None:
            self.graph.replay()
            return self.logits.clone()  # the buffer is overwritten by the next replay
        return self._run(self._model())

    def _capture(self) -> None:
        """Warm up on a side stream, then record one step. Its inputs are the first step's, in
        place already: the warm-up and capture runs write what that step writes."""
        model = self._model()
        dev = self.tokens.device
        try:
            with torch.cuda.device(dev):
                side = torch.cuda.Stream(dev)
                side.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(side):
                    for _ in range(WARMUP):
                        self._run(model)
                torch.cuda.current_stream(dev).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    self.logits = self._run(model)
        except RuntimeError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(
                f"cuda_graph=True: capturing the decode step failed ({first}); decode without "
                "cuda_graph"
            ) from e
        self.graph = graph


_DECODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its last graph


def _weights_key(model) -> tuple:
    """Where the model's parameters live: a graph reads that memory, so a moved, cast or
    replaced parameter needs a new one (weights changed in place do not)."""
    return tuple((p.data_ptr(), p.dtype, p.shape) for p in model.parameters())


def decoder(model, batch: int, length: int, *, compile: bool = False) -> StaticDecoder:
    """A free ``StaticDecoder`` for ``model``: on CUDA the one kept from an earlier generation
    when batch, length, compile and the weights' memory match (its graph is replayed, not
    captured again), else a new one, kept in its place unless that one is still in use."""
    if not captures(model.tok_emb.weight.device):
        return StaticDecoder(model, batch, length, compile=compile)
    key = (batch, length, compile, _weights_key(model))
    kept = _DECODERS.get(model)
    if kept is not None and kept.key == key and kept.free():
        return kept
    dec = StaticDecoder(model, batch, length, compile=compile, capture=True)
    dec.key = key
    if kept is None or kept.free():
        _DECODERS[model] = dec
    return dec


def release(model) -> None:
    """Drop the graph and KV cache kept for ``model`` (their memory is freed with them)."""
    _DECODERS.pop(model, None)


def static_next_logits(model, idx: torch.Tensor, pad: torch.Tensor | None, length: int,
                       compile: bool = False):  # fmt: skip
    """``next_logits(seen, new)`` for ``generate.stream``: the prompt prefilled by the ordinary
    forward, then the static step (a CUDA graph's replay on CUDA) once a token."""
    dec = decoder(model, idx.shape[0], length, compile=compile)

    def next_logits(seen, new):
        return dec.prefill(idx, pad) if new is None else dec.step(new)

    dec.owner = weakref.ref(next_logits)  # busy while this generation lives
    return next_logits
