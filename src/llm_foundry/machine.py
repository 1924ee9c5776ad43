"""How much memory a device has and has left: what a setting that sizes an allocation (a training
run, a KV cache) is checked against before anything is allocated, so that a mistyped size is a
one-line refusal rather than an allocator's traceback or the kernel's OOM killer.

On the CPU a container's memory limit (cgroup v2 or v1) counts as well as the machine's RAM; the
page cache the kernel can drop (what was read from disk) counts as free, as MemAvailable does.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

CGROUP = Path("/sys/fs/cgroup")
# (limit, usage, stat file, its key for the page cache the kernel can drop): cgroup v2, then v1
CGROUP_FILES = (
    ("memory.max", "memory.current", "memory.stat", "inactive_file"),
    ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat",
     "total_inactive_file"),
)  # fmt: skip
NO_LIMIT = 2**60  # cgroup v1 writes "no limit" as a number near 2**63


def memory_total(device: torch.device | str = "cpu") -> tuple[int, str] | None:
    """(bytes, what they are) of the memory ``device`` computes in: a CUDA device's own, else
    the machine's RAM or a smaller container limit; None where it cannot be read."""
    device = torch.device(device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return props.total_memory, f"memory on {props.name}"
    try:
        ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows), or no such name
        ram = 0
    limit = _cgroup()
    if limit is not None and (ram <= 0 or limit[0] < ram):
        return limit[0], "the container's memory limit"
    return (ram, "RAM") if ram > 0 else None


def memory_left(device: torch.device | str = "cpu") -> int | None:
    """Bytes that can still be allocated on ``device``: CUDA's free memory plus what its caching
    allocator holds unused; on the CPU the host's MemAvailable, or less where a container's limit
    leaves less; None when unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            host = int(next(x for x in f if x.startswith("MemAvailable:")).split()[1]) * 1024
    except (OSError, StopIteration, ValueError, IndexError):
        total = memory_total(device)
        return total[0] if total else None
    limit = _cgroup()
    return host if limit is None else min(host, limit[0] - limit[1])


def _cgroup() -> tuple[int, int] | None:
    """(limit, bytes in use less the page cache it can drop) of this process's memory cgroup,
    when it has a limit."""
    for limit_file, usage_file, stat_file, cache_key in CGROUP_FILES:
        try:
            limit = (CGROUP / limit_file).read_text().strip()
            used = int((CGROUP / usage_file).read_text())
        except (OSError, ValueError):
            continue
        if not limit.isdigit() or int(limit) >= NO_LIMIT:  # "max": no limit
            return None
        try:
            stat = (line.split() for line in (CGROUP / stat_file).read_text().splitlines())
            cache = int({k: v for k, v in stat}.get(cache_key, 0))
        except (OSError, ValueError):
            cache = 0
        return int(limit), max(0, used - cache)
    return None


def cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), which benchmark reports must state."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
