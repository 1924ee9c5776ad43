"""More than one process: torch.distributed set-up, DDP / FSDP2 / tensor-parallel wrapping, and
full-state checkpoints that any number of ranks can write and read.

Launched by ``torchrun`` (which sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT); a plain
``python`` run is world size 1 and none of this does anything. Backend: nccl on GPUs, gloo on CPU.
Checkpoints stay in the single-process format (full tensors, parameter ids in optimizer order):
FSDP2 and tensor parallelism gather them to rank 0 to save and every rank reshards them on load,
so a run saved with N ranks (in any layout) resumes with M.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class World:
    """This process's place: ``tp`` consecutive ranks form a tensor-parallel group (they see the
    same batches); the groups are the data-parallel replicas (or FSDP shards)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    tp: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def dp_size(self) -> int:
        return self.world_size // self.tp


SHARDED = ("fsdp", "tp", "fsdp+tp")  # parallel choices whose parameters are DTensor shards


def tp_degree(parallel: str, tp_size: int, world_size: int) -> int:
    """Ranks per tensor-parallel group: all of them for ``tp``, ``tp_size`` for ``fsdp+tp``, 1
    otherwise. A one-line error when the world does not split that way."""
    if world_size == 1 or "tp" not in parallel:
        return 1
    t = tp_size or (world_size if parallel == "tp" else 2)
    if parallel == "tp" and t != world_size:
        raise ValueError(
            f"train.parallel='tp' with train.tp_size={tp_size} on {world_size} processes: plain "
            f"tp uses every rank (tp_size 0 or {world_size}); for fewer use parallel='fsdp+tp'"
        )
    if world_size % t or world_size == t and parallel == "fsdp+tp":
        raise ValueError(
            f"train.parallel='fsdp+tp' with train.tp_size={t}{'' if tp_size else ' (the default)'}"
            f" on {world_size} processes: the world must split into at least 2 groups of tp_size "
            "ranks (a multiple of tp_size, at least twice it)"
        )
    return t


def resolve_device(name: str) -> torch.device:
    """The device ``train.device`` names (auto: CUDA, else MPS, else the CPU); one asked for
    that this machine lacks is refused."""
    available = dict(cuda=torch.cuda.is_available(), mps=torch.backends.mps.is_available())
    if name in available and not available[name]:
        raise ValueError(f"train.device={name}: not available on this machine; use auto or cpu")
    if name != "auto":
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def init_world(
    device: torch.device, parallel: str = "none", tp_size: int = 0
) -> tuple[World, torch.device]:
    """Join the process group torchrun describes (if any); returns the world and this rank's
    device (cuda:LOCAL_RANK on GPUs)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return World(), device
    tp = tp_degree(parallel, tp_size, world_size)
    world = World(int(os.environ["RANK"]), world_size, int(os.environ.get("LOCAL_RANK", "0")), tp)
    if device.type == "cuda":
        torch.cuda.set_device(world.local_rank)
        device = torch.device("cuda", world.local_rank)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        # a dead peer should end the job in minutes, not after the default half hour
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=5))
    return world, device


def wrap(model: nn.Module, parallel: str, world: World, device: torch.device, dtype: str,
         block_size: int | None = None):  # fmt: skip
    """``model`` as DDP, FSDP2 (each block sharded, then the root), tensor-parallel, or FSDP2
    over tensor-parallel groups (a 2-D mesh: dp x tp); unchanged for one process. ``dtype`` is
    resolved (fp32 | bf16 | fp16); ``block_size`` the training sequence length (TP splits it)."""
    if not world.distributed:
        return model
    if parallel == "ddp":
        ids = [device.index] if device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)
    if parallel not in SHARDED:
        raise ValueError(
            f"train.parallel={parallel!r} with {world.world_size} processes: choose one of "
            f"ddp, {', '.join(SHARDED)}"
        )
    from torch.distributed.device_mesh import init_device_mesh

    from llm_foundry.train.tensor_parallel import parallelize

    mesh = init_device_mesh(device.type, (world.dp_size, world.tp), mesh_dim_names=("dp", "tp"))
    if world.tp > 1:
        parallelize(model, mesh["tp"], block_size)
    if parallel == "tp":
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy()
    if dtype == "bf16":  # bf16 compute and all-gathers, fp32 gradient reduction
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"], mp_policy=mp)
    return fully_shard(model, mesh=mesh["dp"], mp_policy=mp)


def sync_gradients(model: nn.Module, parallel: str, last_micro_step: bool):
    """Context for one micro-step's backward: gradient all-reduce only on the last one."""
    if parallel == "ddp" and not last_micro_step and hasattr(model, "no_sync"):
        return model.no_sync()
    if parallel in ("fsdp", "fsdp+tp") and hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(last_micro_step)
    return contextlib.nullcontext()


def from_main(value, world: World):
    """``value`` as rank 0 holds it, on every rank (picklable; a no-op for one process): one
    decision for all where each rank's own could differ (a timing, say)."""
    if not world.distributed:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def mean(value: torch.Tensor, world: World) -> torch.Tensor:
    """Average a tensor over ranks (a no-op for one process)."""
    if world.distributed:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= world.world_size
    return value


def any_rank(flag: bool, world: World, device: torch.device) -> bool:
    """True on every rank when it is true on any (e.g. a stop signal seen by one)."""
    return any_ranks([flag], world, device)[0]


def any_ranks(flags: list[bool], world: World, device: torch.device) -> list[bool]:
    """``any_rank`` of several flags in one all-reduce (one round trip per step, not one each)."""
    if not world.distributed:
        return list(flags)
    t = torch.tensor([float(f) for f in flags], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(v) for v in t.tolist()]


# ----------------------------------------------------------------------------------------------
# Full state dicts: the same tensors whatever the wrapping


def is_sharded(parallel: str, world: World) -> bool:
    """Whether the parameters are DTensor shards: a sharded layout over several processes."""
    return parallel in SHARDED and world.distributed


def full_model_state(model: nn.Module, parallel: str, world: World) -> dict[str, torch.Tensor]:
    """The whole model's tensors on CPU (collective under FSDP; empty off rank 0 there)."""
    if is_sharded(parallel, world):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(model, options=opts)
    from llm_foundry.checkpoint import unwrap

    return unwrap(model).state_dict()


def full_optimizer_state(model: nn.Module, optimizer, parallel: str, world: World) -> dict:
    """The optimizer state dict in the single-process layout (integer parameter ids)."""
    if not is_sharded(parallel, world):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    sd = get_optimizer_state_dict(model, optimizer, options=opts)
    if not world.main:
        return {}
    order = [name for g in sd["param_groups"] for name in g["params"]]
    ids = {name: i for i, name in enumerate(order)}
    groups, start = [], 0
    for g in sd["param_groups"]:
        n = len(g["params"])
        groups.append({**g, "params": list(range(start, start + n))})
        start += n
    return {"state": {ids[k]: v for k, v in sd["state"].items()}, "param_groups": groups}


def load_full_state(model: nn.Module, optimizer, model_sd: dict, optim_sd: dict, parallel, world):
    """Load full (single-process layout) state into a plain, DDP or FSDP2 model + optimizer."""
    from llm_foundry.checkpoint import unwrap

    if not is_sharded(parallel, world):
        unwrap(model).load_state_dict(model_sd)
        if optimizer is not None:
            optimizer.load_state_dict(optim_sd)
        return
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, with_tied(model, model_sd), options=opts)
    if optimizer is not None:
        names = [n for n, _ in _named_in_optimizer_order(model, optimizer)]
        groups = [
            {**g, "params": [names[i] for i in g["params"]]} for g in optim_sd["param_groups"]
        ]
        state = {names[i]: v for i, v in optim_sd["state"].items()}
        set_optimizer_state_dict(
            model, optimizer, {"state": state, "param_groups": groups}, options=opts
        )


def with_tied(model: nn.Module, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``sd`` plus the names of tied parameters it holds under one name only (safetensors and
    gathered state dicts keep a shared tensor once; load_state_dict wants every name)."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    sd = dict(sd)
    for names in groups.values():
        have = [n for n in names if n in sd]
        for n in names:
            if have and n not in sd:
                sd[n] = sd[have[0]]
    return sd


def _named_in_optimizer_order(model: nn.Module, optimizer):
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [(by_id[id(p)], p) for g in optimizer.param_groups for p in g["params"]]


def stopping_reason(reason: str | None, world: World) -> str:
    """The lowest stopping rank's ``reason`` (this rank's, None when it goes on), named
    "rank N: REASON" unless N is 0, the same on every rank. Collective: called by every rank at a
    step some rank's should_stop ends."""
    import torch.distributed as dist

    reasons: list[str | None] = [None] * world.world_size
    dist.all_gather_object(reasons, reason)
    rank, why = next((r, why) for r, why in enumerate(reasons) if why is not None)
    return why if rank == 0 else f"rank {rank}: {why}"
