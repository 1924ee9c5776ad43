"""A key/value cache of plain preallocated tensors, one pair per layer.

Each layer's keys and values are stored as (B, n_kv_heads, L, head_dim): GQA and MQA models
store n_heads / n_kv_heads times fewer bytes than MHA. With a sliding window (Mistral) the cache
holds only the last ``window`` positions, as a ring: position p lives in slot p % window.

A cache larger than the memory its device has left is refused before anything is allocated
(``cache_bytes``, ``available_memory``): a ValueError saying how much it would take, not an
allocator's traceback or the host's OOM killer.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from llm_foundry.config import ModelConfig

EMPTY = 2**62  # position recorded for an unused ring slot: "in the future", so always masked


def cache_bytes(cfg: ModelConfig, batch_size: int, max_len: int, dtype=torch.float32) -> int:
    """Bytes a ``KVCache(cfg, batch_size, max_len, dtype=dtype)`` holds (keys and values of
    every layer; a sliding window stores at most ``window`` positions)."""
    size = min(max_len, cfg.sliding_window) if cfg.sliding_window else max_len
    per_position = 2 * cfg.n_layers * cfg.kv_heads * cfg.head_size * dtype.itemsize
    return batch_size * size * per_position


def available_memory(device: torch.device | str | None = None) -> int | None:
    """Bytes that can still be allocated on ``device``: CUDA's free memory plus what its caching
    allocator holds unused; the host's MemAvailable for the CPU; None when unknown."""
    device = torch.device(device if device is not None else "cpu")
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            line = next(x for x in f if x.startswith("MemAvailable:"))
        host = int(line.split()[1]) * 1024
    except (OSError, StopIteration, ValueError):
        try:
            host = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, AttributeError):
            return None
    room = _cgroup_room()
    return host if room is None else min(host, room)


def _cgroup_room() -> int | None:
    """What this process's memory cgroup (a container's limit) has left, when it has a limit."""
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                          "/sys/fs/cgroup/memory/memory.usage_in_bytes")):  # fmt: skip
        try:
            with open(limit) as f, open(usage) as g:
                cap, used = f.read().strip(), int(g.read().strip())
        except (OSError, ValueError):
            continue
        if cap.isdigit() and int(cap) < 2**60:  # "max" or a huge number: no limit
            return max(0, int(cap) - used)
        return None
    return None


def size_text(n: float) -> str:
    """Bytes in the unit a reader takes in at once: '3.2 GB', '512 KB' (powers of 1000)."""
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


class KVCache:
    def __init__(
        self,
        cfg: ModelConfig,
        batch_size: int,
        max_len: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        need = cache_bytes(cfg, batch_size, max_len, dtype)
        have = available_memory(device)
        if have is not None and need > have:
            raise ValueError(
                f"a KV cache of {batch_size} x {max_len} positions would take {size_text(need)}, "
                f"more than the {size_text(have)} of memory left on {torch.device(device or 'cpu')}"
                ": ask for fewer positions (a shorter prompt or fewer new tokens) or fewer rows"
            )
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
