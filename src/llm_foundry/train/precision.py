"""Does this device run bf16 matrix products fast? And what ``train.dtype auto`` becomes.

bf16 autocast only pays where the hardware multiplies bf16 natively. On x86 CPUs that means the
``avx512_bf16`` or ``amx_bf16`` instructions (an AVX2-only CPU falls back to scalar code that runs
bf16 matmuls ~100x slower than fp32); on CUDA GPUs compute capability 8.0 (Ampere) or later.

On a CPU the answer takes both the flags in /proc/cpuinfo and a measurement: one bf16 and one fp32
matrix product of ``MATMUL_N`` square, timed a few times (~0.1 s on fast hardware, at most ~0.3 s
on slow), once per process. ``decide_cpu`` is the pure decision, testable on any machine.
``resolve_dtype`` turns ``auto`` into ``bf16`` or ``fp32``; ``choose_precision`` makes a run's
whole decision (its dtype, autocast, Muon's Newton-Schulz precision), once, the same on every rank.
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from llm_foundry.rundir import RUN_INFO
from llm_foundry.train import distributed as D
from llm_foundry.train.config import TrainConfig

# bf16 must multiply at least as fast as fp32: autocast adds a cast of every weight and
# activation per step, so a bf16 matmul that is merely as fast makes the step no faster, and a
# slower one makes it slower (12-17x on an AVX2 CPU). At parity bf16 still halves activation
# memory, so parity is the line.
FAST_RATIO = 1.0
# x86: AVX512-BF16 (Cooper Lake, Zen 4+) and AMX (Sapphire Rapids+); aarch64: the bf16 extension
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
MATMUL_N = 256  # big enough that a fast kernel beats the call overhead, small enough to be quick
MATMUL_REPS = 5  # interleaved bf16/fp32 pairs; the fastest of each is kept (noise only slows)
SLOW_BUDGET_S = 0.2  # stop repeating once bf16 has taken this long: it is clearly slow


@dataclass(frozen=True)
class Bf16Support:
    """Whether bf16 autocast is the fast path on a device, and why, in one line."""

    fast: bool
    reason: str
    ratio: float | None = None  # fp32 matmul time / bf16 matmul time (None: not measured)


def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str] | None:
    """The CPU's feature flags (x86 ``flags``, aarch64 ``Features``); None where unreadable."""
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return None


def decide_cpu(
    flags: frozenset[str] | None, capability: str, t_fp32: float, t_bf16: float
) -> Bf16Support:
    """The pure decision: fast when a bf16 flag is present (or flags are unknown) and the measured
    bf16 matmul is at least ``FAST_RATIO`` times fp32's speed. ``capability`` is torch's
    ``get_cpu_capability()`` ("AVX2", "AVX512", ...), only for the reason's wording."""
    ratio = t_fp32 / t_bf16 if t_bf16 > 0 else float("inf")
    speed = f"bf16 matmul {ratio:.2g}x fp32's speed"
    if flags is None:
        has = "CPU flags unreadable"
    else:
        present = [f for f in BF16_FLAGS if f in flags]
        if not present:
            return Bf16Support(
                False, f"{capability} without avx512_bf16/amx_bf16 flag: {speed}", ratio
            )
        has = "+".join(f.upper() for f in present) + " in /proc/cpuinfo"
    if ratio < FAST_RATIO:
        return Bf16Support(False, f"{has}, but {speed} (< {FAST_RATIO:g}x)", ratio)
    return Bf16Support(True, f"{has}; {speed}", ratio)


def time_matmuls(n: int = MATMUL_N, reps: int = MATMUL_REPS) -> tuple[float, float]:
    """Fastest seconds of one fp32 and one bf16 ``n x n`` matmul on the CPU, timed in turns."""
    g = torch.Generator().manual_seed(0)
    a32, b32 = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    a16, b16 = a32.bfloat16(), b32.bfloat16()
    best = {torch.float32: float("inf"), torch.bfloat16: float("inf")}
    spent = 0.0
    for i in range(reps + 1):  # the first pair warms the kernels up and is not counted
        for a, b in ((a32, b32), (a16, b16)):
            t0 = time.perf_counter()
            a @ b
            dt = time.perf_counter() - t0
            if i:
                best[a.dtype] = min(best[a.dtype], dt)
            if a.dtype == torch.bfloat16:
                spent += dt
        if i and spent > SLOW_BUDGET_S:
            break
    return best[torch.float32], best[torch.bfloat16]


@functools.cache
def _cpu_support() -> Bf16Support:
    """``decide_cpu`` on this machine, measured once per process."""
    t_fp32, t_bf16 = time_matmuls()
    return decide_cpu(cpu_flags(), torch.backends.cpu.get_cpu_capability(), t_fp32, t_bf16)


def bf16_support(device: torch.device | str) -> Bf16Support:
    """Whether bf16 autocast is the fast path on ``device`` (cpu: flags and a measured matmul;
    cuda: native bf16, compute capability >= 8.0; mps: not claimed, see the reason)."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        major, minor = torch.cuda.get_device_capability(device)
        # emulated bf16 (older GPUs) runs, but without tensor-core speed
        native = torch.cuda.is_bf16_supported(including_emulation=False)
        what = "native bf16" if native else "no native bf16"
        return Bf16Support(native, f"{name} (compute capability {major}.{minor}): {what}")
    if device.type == "mps":
        # bf16 on Apple GPUs needs macOS 14 and its speed was never measured here: not assumed
        return Bf16Support(False, "MPS: bf16 speed not measured on Apple GPUs; fp32 kept")
    if device.type != "cpu":
        return Bf16Support(False, f"{device.type}: no bf16 check for this device; fp32 kept")
    return _cpu_support()


def recorded_dtype(run_dir: str | Path) -> str | None:
    """The resolved dtype an earlier start of the run in ``run_dir`` wrote to its run.json."""
    file = Path(run_dir) / RUN_INFO
    try:
        return json.loads(file.read_text()).get("dtype")
    except (OSError, ValueError, AttributeError):
        return None  # no run info yet, or one from before the dtype was recorded


def resolve_dtype(
    requested: str,
    device: torch.device | str,
    recorded: str | None = None,
    support: Bf16Support | None = None,
) -> tuple[str, str]:
    """``(dtype, why)``: ``requested`` itself unless it is ``auto``, which becomes ``bf16`` where
    bf16 is fast and ``fp32`` elsewhere. A resumed ``auto`` run keeps ``recorded`` (the dtype it
    started with), even on another machine: its checkpoints and loss curve belong to that path.
    ``support``: ``bf16_support(device)`` measured already (by rank 0 for all ranks)."""
    if requested != "auto":
        return requested, f"dtype {requested} (as configured)"
    support = support or bf16_support(device)
    here = "bf16" if support.fast else "fp32"
    if recorded in ("fp32", "bf16", "fp16"):
        note = (
            "" if recorded == here else f"; this machine alone would pick {here}: {support.reason}"
        )
        return recorded, f"dtype auto -> {recorded}, kept from the run's start{note}"
    return here, f"dtype auto -> {here}: {support.reason}"


# fp8: bf16 autocast around the blocks' float8 linear layers (models/fp8.py)
AUTOCAST_DTYPES = {
    "fp32": None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.bfloat16,
}
# FP8 tensor cores (torch._scaled_mm through cuBLAS): Ada (8.9), Hopper (9.0) and later
FP8_CAPABILITY = (8, 9)


def fp8_support(device: torch.device | str) -> tuple[bool, str]:
    """(whether ``device`` multiplies float8 in hardware, what it is in words)."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        cap = torch.cuda.get_device_capability(device)
        return cap >= FP8_CAPABILITY, f"{name} (compute capability {cap[0]}.{cap[1]})"
    if device.type == "cpu":
        from llm_foundry.machine import cpu_model

        return False, f"the CPU ({cpu_model()})"
    return False, device.type


def check_fp8(device: torch.device | str) -> None:
    """Refuse ``train.dtype fp8`` in one line where ``device`` has no FP8 tensor cores."""
    ok, what = fp8_support(device)
    if not ok:
        raise ValueError(
            f"train.dtype=fp8 needs FP8 tensor cores, an NVIDIA GPU of compute capability "
            f"{FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]}+ (Ada; Hopper: H100, H200; Blackwell); this "
            f"run is on {what}: use train.dtype bf16 (or auto)"
        )


@dataclass(frozen=True)
class Precision:
    """The arithmetic of one run, decided before its model is wrapped."""

    dtype: str  # fp32 | bf16 | fp16 | fp8: train.dtype resolved (auto -> bf16 | fp32)
    reason: str  # why, in one line
    support: Bf16Support | None = None  # bf16's speed on this machine, where it was asked
    ns_dtype: str | None = None  # Muon's Newton-Schulz precision here (None: not asked)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return AUTOCAST_DTYPES[self.dtype]

    def autocast(self, device_type: str):
        """The context a forward runs in: autocast to bf16 (fp8 too) or fp16, nothing for fp32."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=self.autocast_dtype)


def choose_precision(
    tc: TrainConfig, device: torch.device, world: D.World, recorded: str | None = None
) -> Precision:
    """``tc.dtype`` resolved on ``device`` (``resolve_dtype``; ``recorded``: the dtype a resumed
    run started with), and where ``auto`` or Muon ask whether bf16 is fast here, the answer:
    measured on rank 0 and broadcast, so every rank takes the same path. Muon's Newton-Schulz
    iteration runs in bf16 where that is fast, in fp32 elsewhere (AVX2 CPUs). ``fp8`` is refused
    (``check_fp8``) on a device without FP8 tensor cores."""
    if tc.dtype == "fp8":
        check_fp8(device)
    needs = tc.dtype == "auto" or tc.optimizer == "muon"
    support = None
    if needs:
        support = D.from_main(bf16_support(device) if world.main else None, world)
    ns_dtype = ("bf16" if support.fast else "fp32") if needs else None
    dtype, reason = resolve_dtype(tc.dtype, device, recorded, support)
    return Precision(dtype, reason, support, ns_dtype)
