"""Peak memory of one operation, read honestly on CPU and CUDA, and process isolation.

CUDA: the caching allocator's peak. CPU has no allocator statistics, so the peak resident set
size (Linux VmHWM, reset through /proc/self/clear_refs) of a fresh worker process is read, with
glibc told to map every allocation of 64 KiB or more on its own so RSS follows live buffers.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import multiprocessing as mp
import os
import signal
import statistics
import time
import traceback

import torch


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _proc_status_bytes(field: str) -> int:
    """A memory line of /proc/self/status (VmRSS, VmHWM), in bytes."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024  # the kernel reports kB


def _malloc_trim() -> None:
    """Give memory that glibc's malloc keeps after free back to the OS, so RSS counts live data."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def _reset_peak(device: str) -> int:
    """Start a peak measurement; returns the memory in use now (the baseline)."""
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    _malloc_trim()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
    return _proc_status_bytes("VmRSS")


def _read_peak(device: str) -> int:
    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    return _proc_status_bytes("VmHWM")


def peak_bytes(op, device: str) -> int | None:
    """Extra memory ``op`` needs above what is in use before it; None where it cannot be read."""
    try:
        base = _reset_peak(device)
    except OSError:  # no /proc/self/clear_refs (not Linux): no honest CPU peak to report
        return None
    op()  # the result is dropped only after the call returns, so it counts
    _sync(device)
    return _read_peak(device) - base


def median_ms(op, device: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        op()
        _sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def _worker(fn, args: tuple, conn) -> None:
    """Run ``fn(*args)`` with every allocation >= 64 KiB in its own mapping, unmapped when
    freed, so RSS follows the live buffers rather than the high-water mark of malloc's heap.
    Ctrl-C and SIGTERM are the parent's to answer (it ends this process): the worker, in the
    parent's process group, gets them too and ignores them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        if hasattr(libc, "mallopt"):
            libc.mallopt(M_MMAP_THRESHOLD, 64 * 1024)
        answer = ("ok", fn(*args))
    except Exception:
        answer = ("error", traceback.format_exc())
    with contextlib.suppress(OSError):  # the parent stopped listening (it was interrupted)
        conn.send(answer)


def run_isolated(fn, *args, preload: str):
    """``fn(*args)`` (a module-level function returning a dict) in a fresh process forked from
    a server that has only imported ``preload``, so its peak RSS belongs to this call alone; a
    SIGKILL (the OOM killer) becomes a status. An interrupt here (Ctrl-C) ends the worker before
    it is raised. The calling script needs the ``if __name__ == "__main__"`` guard."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([preload])  # workers start with torch loaded
    receiver, sender = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_worker, args=(fn, args, sender))
    try:
        proc.start()
        sender.close()
        try:
            kind, payload = receiver.recv()
        except EOFError:  # the worker died without answering
            kind, payload = "died", None
        proc.join()
    finally:
        if proc.is_alive():  # interrupted while it ran: it must not outlive the benchmark
            proc.kill()
            proc.join()
        receiver.close()
    what = f"{fn.__name__}{args}"
    if kind == "error":
        raise RuntimeError(f"{what} failed in its worker process:\n{payload}")
    if kind == "died" and proc.exitcode == -9:
        return {"status": "out of memory (worker killed by SIGKILL, likely the OOM killer)"}
    if kind == "died":
        raise RuntimeError(f"the worker running {what} exited with code {proc.exitcode}")
    return payload


def memory_budget(device: str) -> int:
    """80% of the memory free now: CUDA's free device memory, or the host's MemAvailable."""
    if device == "cuda":
        return int(0.8 * torch.cuda.mem_get_info()[0])
    try:
        return int(0.8 * _meminfo_available())
    except (OSError, StopIteration):
        return int(0.8 * os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def _meminfo_available() -> int:
    with open("/proc/meminfo") as f:
        return int(next(line for line in f if line.startswith("MemAvailable:")).split()[1]) * 1024


def _is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "not enough memory" in str(err)
