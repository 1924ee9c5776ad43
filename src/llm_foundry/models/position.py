"""Position encodings, chosen by ``ModelConfig.pos_encoding``. Each kind acts at one of three
places (embedding, q/k rotation, attention bias); the base class makes the other two no-ops, so
the model calls all three unconditionally and never branches on the config.

Shape letters: B batch, T query length, S key length, D model width, H query heads, K key/value
heads, hd head width.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

if TYPE_CHECKING:
    from llm_foundry.config import ModelConfig


def sinusoidal_table(pos: torch.Tensor, dim: int) -> torch.Tensor:
    """Fixed sin/cos positions (Vaswani et al. 2017): even features sin, odd cos. pos: (T,) -> (T, D)."""
    inv_freq = torch.exp(torch.arange(0, dim, 2, device=pos.device) * (-math.log(10000.0) / dim))
    angles = pos.float()[:, None] * inv_freq[None, :]  # (T, D/2)
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)  # interleave sin, cos


ROPE_SCALINGS = ("none", "linear", "ntk")  # the values ``ModelConfig.rope_scaling`` accepts


def rope_inv_freq(head_dim: int, theta: float, scaling: str = "none", factor: float = 1.0):
    """RoPE rotation speeds theta^(-2i/hd), i < hd/2 (Su et al. 2021), optionally rescaled.

    linear: divide every speed by ``factor`` (position interpolation, Chen et al. 2023).
    ntk: raise the base to theta * factor^(hd/(hd-2)) (NTK-aware scaling, bloc97 2023), which
    stretches slow dimensions and leaves the fastest almost untouched. Returns (hd/2,).
    """
    if scaling == "ntk":
        theta = theta * factor ** (head_dim / (head_dim - 2))
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling == "linear":
        inv_freq = inv_freq / factor
    return inv_freq.float()


def rope_cos_sin(pos: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles in rotate-half layout. pos: (T,) -> two (T, hd)."""
    angles = pos.to(inv_freq.dtype)[:, None] * inv_freq[None, :]  # (T, hd/2)
    angles = torch.cat((angles, angles), dim=-1)  # feature i pairs with i + hd/2 (HF LLaMA layout)
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (i, i + hd/2) feature pair by its angle. x: (B, H, T, hd); cos, sin: (T, hd),
    or (B, 1, T, hd) when each row has its own positions."""
    return (x * cos + rotate_half(x) * sin).type_as(x)


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """ALiBi head slopes (Press et al. 2022): 2^(-8/n), 2^(-16/n), ... for n a power of two.

    Other counts take the slopes of the nearest lower power of two, then every other slope of the
    next power of two, as the paper prescribes. Returns (H,).
    """

    def geometric(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    low = 2 ** math.floor(math.log2(n_heads))
    slopes = geometric(low) + geometric(2 * low)[0::2][: n_heads - low]
    return torch.tensor(slopes)


class NoPosition(nn.Module):
    """No explicit positions (NoPE): the causal mask alone tells tokens apart.

    The new tokens' positions arrive as a Python int ``start`` (the first of T contiguous ones),
    so nothing is read back from a tensor and ``torch.compile`` sees no graph break.
    """

    # what the rest of the project asks of a scheme (``position_traits``), never its name
    has_bias = False  # whether ``bias`` returns a tensor (a per-head bias on the scores)
    absolute = False  # added to the embeddings: a token's position is its slot in the row
    trained_rows = False  # a trained table of max_seq_len rows: the weights fix the context
    max_positions: int | None = None  # positions it can encode; None: any

    def embed(self, x: torch.Tensor, start: int, pad: torch.Tensor | None = None) -> torch.Tensor:
        """Add absolute positions start..start+T-1 to the embeddings x: (B, T, D); row b counts
        from its first real token when ``pad`` (B,) says it has pad[b] left-padding tokens."""
        return x

    def rotate(self, q: torch.Tensor, k: torch.Tensor, start: int, pad=None):
        """Rotate q: (B, H, T, hd) and k: (B, K, T, hd) at positions start..start+T-1, each row
        counted from its first real token when ``pad`` (B,) is given (as ``embed``)."""
        return q, k

    def bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
        """Additive attention bias (H, T, S) for query positions (T,) and key positions (S,)."""
        return None

    def reserve(self, length: int) -> None:
        """Prepare for positions 0..length-1 ahead of use (a compiled decode step then never
        rebuilds a cache)."""

    def init_weights(self, std: float) -> None:
        """Initialise trained position parameters, if any."""


def _row_positions(start: int, T: int, pad: torch.Tensor, limit: int | None = None):
    """Per-row positions (B, T) of left-padded rows: slot start + t of row b is position
    start + t - pad[b] (pads clamp to 0; they are masked out anyway)."""
    pos = (torch.arange(start, start + T, device=pad.device)[None] - pad[:, None]).clamp(min=0)
    # slots inside the table need no read-back of pad (a graph break under torch.compile)
    if limit is not None and start + T > limit and start + T - int(pad.min()) > limit:
        raise ValueError(
            f"position {start + T - 1 - int(pad.min())} is past max_seq_len={limit}: learned "
            "absolute positions have no row beyond it; use a shorter input or rope/alibi"
        )
    return pos


class LearnedPosition(NoPosition):
    """A trained table of max_seq_len position vectors (GPT-2); it has no row past the end."""

    absolute = trained_rows = True

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.max_positions = cfg.max_seq_len  # one trained row per position
        self.emb = nn.Embedding(cfg.max_seq_len, cfg.dim)

    def init_weights(self, std):
        nn.init.normal_(self.emb.weight, mean=0.0, std=std)

    def embed(self, x, start, pad=None):
        end = start + x.shape[1]
        if pad is not None:
            return x + self.emb(_row_positions(start, x.shape[1], pad, self.max_positions))
        if end > self.max_positions:
            raise ValueError(
                f"position {end - 1} is past max_seq_len={self.max_positions}: learned absolute "
                f"positions are a table with one trained row per position 0..{self.max_positions - 1} "
                "and nothing beyond it. Use a shorter input, or a model with pos_encoding='rope' "
                "or 'alibi' (relative positions that run past the training length)."
            )
        return x + self.emb(torch.arange(start, end, device=x.device))


class SinusoidalPosition(NoPosition):
    """Fixed sin/cos table added to the embeddings; defined for any position, nothing to train."""

    absolute = True

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dim = cfg.dim

    def embed(self, x, start, pad=None):
        if pad is not None:
            pos = _row_positions(start, x.shape[1], pad)  # (B, T)
            table = sinusoidal_table(pos.flatten(), self.dim).view(*pos.shape, self.dim)
            return x + table.to(x.dtype)
        pos = torch.arange(start, start + x.shape[1], device=x.device)
        return x + sinusoidal_table(pos, self.dim).to(x.dtype)


ROPE_BLOCK = 64  # positions whose cos/sin are computed together


class RotaryPosition(NoPosition):
    """RoPE: rotate q and k by position-dependent angles so q_m . k_n depends on m - n only."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        inv_freq = rope_inv_freq(cfg.head_size, cfg.rope_theta, cfg.rope_scaling, cfg.rope_factor)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)

    def _grow(self, length: int) -> None:
        """Extend the cos/sin cache to cover positions 0..length-1, doubling, in blocks of
        ``ROPE_BLOCK`` positions: sized by use, not by max_seq_len, and a position's values never
        depend on the cache size (each block is one same-shaped computation, never redone)."""
        have = self.cos.shape[0] if self.cos.device == self.inv_freq.device else 0
        n = max(length, 2 * have)
        n = -(-n // ROPE_BLOCK) * ROPE_BLOCK
        dev = self.inv_freq.device
        new = [
            rope_cos_sin(torch.arange(s, s + ROPE_BLOCK, device=dev), self.inv_freq)
            for s in range(have, n, ROPE_BLOCK)
        ]
        self.cos = torch.cat([self.cos[:have].to(dev)] + [c for c, _ in new])
        self.sin = torch.cat([self.sin[:have].to(dev)] + [s for _, s in new])

    def reserve(self, length: int) -> None:
        if self.cos.shape[0] < length or self.cos.device != self.inv_freq.device:
            self._grow(length)

    def rotate(self, q, k, start, pad=None):
        end = start + q.shape[2]
        if self.cos.shape[0] < end or self.cos.device != q.device:
            self._grow(end)
        if pad is None:
            cos, sin = self.cos[start:end].to(q.dtype), self.sin[start:end].to(q.dtype)
        else:  # each row at its own positions: its keys do not depend on where its slots lie
            pos = _row_positions(start, q.shape[2], pad)  # (B, T)
            cos, sin = self.cos[pos][:, None].to(q.dtype), self.sin[pos][:, None].to(q.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


class AlibiPosition(NoPosition):
    """ALiBi: no embedding; each head adds slope * (key_pos - query_pos) to its attention scores."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # on the meta device (shape checks) the values are not needed: skip the per-head loop
        meta = torch.empty(0).is_meta
        slopes = torch.empty(cfg.n_heads) if meta else alibi_slopes(cfg.n_heads)
        self.register_buffer("slopes", slopes, persistent=False)

    has_bias = True

    def bias(self, q_pos, k_pos):
        distance = (k_pos[None, :] - q_pos[:, None]).to(self.slopes.dtype)  # (T, S), <= 0: past
        return self.slopes[:, None, None] * distance[None]  # (H, T, S)


POSITIONS = {
    "learned": LearnedPosition,
    "sinusoidal": SinusoidalPosition,
    "rope": RotaryPosition,
    "alibi": AlibiPosition,
    "none": lambda cfg: NoPosition(),
}
POSITION_NAMES = (
    POSITIONS.keys()
)  # ``ModelConfig.pos_encoding``'s values (live: a name added later counts)


def position_traits(cfg: ModelConfig) -> type[NoPosition]:
    """The class of the scheme ``cfg.pos_encoding`` names, whose class attributes (has_bias,
    absolute, trained_rows) answer what other modules ask of it; a registry entry that is a
    factory is built once on the meta device to find its class."""
    entry = POSITIONS[cfg.pos_encoding]
    if isinstance(entry, type):
        return entry
    with torch.device("meta"):
        return type(entry(cfg))


def build_position(cfg: ModelConfig) -> NoPosition:
    """The position scheme named by ``cfg.pos_encoding``."""
    return POSITIONS[cfg.pos_encoding](cfg)
