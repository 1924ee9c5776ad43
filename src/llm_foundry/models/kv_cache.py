"""A key/value cache of plain preallocated tensors, one pair per layer.

Each layer's keys and values are stored as (B, n_kv_heads, L, head_dim): GQA and MQA models
store n_heads / n_kv_heads times fewer bytes than MHA. With a sliding window (Mistral) the cache
holds only the last ``window`` positions, as a ring: position p lives in slot p % window.

``cache_bytes`` is a cache's size before it is built: what callers check against the memory
their device has left (``llm_foundry.machine``) before they allocate one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from llm_foundry.config import ModelConfig

EMPTY = 2**62  # position recorded for an unused ring slot: "in the future", so always masked


def bytes_per_position(cfg: ModelConfig, bytes_per_value: int) -> int:
    """Bytes of K and V one position takes across all layers: 2 * n_layers * n_kv_heads * hd."""
    return 2 * cfg.n_layers * cfg.kv_heads * cfg.head_size * bytes_per_value


def cache_bytes(cfg: ModelConfig, batch_size: int, max_len: int, dtype=torch.float32) -> int:
    """Bytes a ``KVCache(cfg, batch_size, max_len, dtype=dtype)`` holds (keys and values of
    every layer; a sliding window stores at most ``window`` positions)."""
    size = min(max_len, cfg.sliding_window) if cfg.sliding_window else max_len
    return batch_size * size * bytes_per_position(cfg, dtype.itemsize)


class KVCache:
    def __init__(
        self,
        cfg: ModelConfig,
        batch_size: int,
        max_len: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        self.window = cfg.sliding_window
        self.max_len = max_len
        self.size = min(max_len, self.window) if self.window else max_len
        shape = (batch_size, cfg.kv_heads, self.size, cfg.head_size)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.slot_pos = torch.full((self.size,), EMPTY, dtype=torch.long, device=device)
        self.length = 0  # tokens cached so far: the position of the next token
        self.pad: torch.Tensor | None = None  # (B,) left-padding tokens per row of a ragged batch

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def key_positions(self, start: int, T: int) -> torch.Tensor:
        """Positions (S,) of the keys that queries start..start+T-1 attend over, in the order
        ``update`` returns them."""
        device = self.slot_pos.device
        if self.window is None:
            return torch.arange(start + T, device=device)
        return torch.cat([self.slot_pos, torch.arange(start, start + T, device=device)])

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int):
        """Store new k, v (B, K, T, hd) at positions start..; return everything to attend over."""
        T = k.shape[2]
        if self.window is None:
            if start + T > self.size:
                raise ValueError(
                    f"KV cache full: positions up to {start + T - 1} do not fit its "
                    f"max_len={self.max_len}; allocate a longer cache"
                )
            self.k[layer][:, :, start : start + T] = k
            self.v[layer][:, :, start : start + T] = v
            return self.k[layer][:, :, : start + T], self.v[layer][:, :, : start + T]
        k_all = torch.cat([self.k[layer], k], dim=2)  # ring (older keys) + the new ones
        v_all = torch.cat([self.v[layer], v], dim=2)
        keep = min(T, self.size)
        slots = torch.arange(start + T - keep, start + T, device=k.device) % self.size
        self.k[layer][:, :, slots] = k[:, :, T - keep :]
        self.v[layer][:, :, slots] = v[:, :, T - keep :]
        return k_all, v_all

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor):
        """Store k, v (B, K, T, hd) at buffer slots ``index`` (T,), a device tensor, and return
        the whole buffers (B, K, size, hd): fixed shapes and nothing read back to the host, so a
        decode step built on it can be captured in a CUDA graph (``llm_foundry.decode_graph``).
        The caller masks the slots that hold no position yet and keeps ``length``."""
        self.k[layer].index_copy_(2, index, k.to(self.k[layer].dtype))
        self.v[layer].index_copy_(2, index, v.to(self.v[layer].dtype))
        return self.k[layer], self.v[layer]

    def advance(self, start: int, T: int) -> None:
        """Record that positions start..start+T-1 are now cached (after all layers ran)."""
        self.length = start + T
        if self.window is not None:
            keep = min(T, self.size)
            pos = torch.arange(start + T - keep, start + T, device=self.slot_pos.device)
            self.slot_pos[pos % self.size] = pos

    def rows(self, n: int) -> KVCache:
        """A cache over the first ``n`` rows of this one, sharing its memory (a batch smaller
        than the allocation reads and writes the same tensors)."""
        view = object.__new__(KVCache)
        view.__dict__.update(self.__dict__)
        view.k, view.v = [k[:n] for k in self.k], [v[:n] for v in self.v]
        view.pad = None
        return view

    def reset(self) -> None:
        self.length = 0
        self.slot_pos.fill_(EMPTY)
