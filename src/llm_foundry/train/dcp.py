"""Sharded checkpoints: ``train.checkpoint_format`` dcp and dcp-async.

With ``full`` a sharded run (FSDP2, TP, both) gathers every tensor to rank 0, which writes them
alone: rank 0 holds the whole model and optimizer state in host memory, and training waits for
one process's writes. With ``dcp`` every rank writes its own shards through
``torch.distributed.checkpoint`` (DCP) and nothing is gathered; ``dcp-async`` copies them to host
memory and writes them in a background thread while training goes on (the copy, model and
optimizer shards, is the memory it costs). Any layout may save either way (one process and DDP
too: DCP then spreads the replicated tensors' writes over the ranks).

A step directory then holds config.json, state.json and tokenizer.json as a full checkpoint does
and, in place of model.safetensors and optimizer.safetensors, ``dcp/``: DCP's ``.metadata`` and a
file per rank, holding ``model.<parameter name>`` and ``optim.<id>.<key>``: the optimizer's
tensors under the integer ids of the single-process layout, so state.json's optimizer entry
(hyper-parameters, values that are not tensors) is a full checkpoint's, and ``convert
--from-dcp`` / ``--to-dcp`` (``dcp_to_full`` / ``full_to_dcp``) only repackage tensors.

Loading goes through DCP's get/set_state_dict: every rank asks for what its own shards hold in the
layout it runs with (any world size, mesh or none), so a run saved on N ranks resumes on M. The
RNG, sampler (global, the same for any world size) and scaler states are rank 0's, in state.json,
as in a full checkpoint: a resume is exact.

Atomic as full checkpoints are: everything is written under ``.tmp-step_N``, DCP writes its
``.metadata`` last (once every rank's files are written, itself under a temporary name), and only
then does rank 0 rename the directory into place and point latest.json at it. A background save
is committed when it completes: looked at every step, waited for before the next save, at the end
of the run and when a run stops on an error. A save whose writes fail on any rank (a full disk)
is ``state.CheckpointNotWritten`` on every rank, as a full checkpoint's, its temporary directory
removed; rank 0 failing to write state.json stops every rank before any shard is written, and
rank 0 failing to put it in place stops every rank where they all next finish a save.
"""

from __future__ import annotations

import datetime
import logging
import shutil
import warnings
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from llm_foundry.checkpoint import (
    CONFIG_FILE,
    DCP_DIR,
    DCP_MODEL,
    WEIGHTS_FILE,
    build,
    check_weights_fit,
    dcp_failure,
    dcp_shapes,
    is_dcp,
    load_checkpoint,
    load_dcp,
    read_config,
    read_dcp_tensors,
    read_lora,
    read_quantization,
    save_checkpoint,
    stored_once,
    write_config,
)
from llm_foundry.durable import usual_mode
from llm_foundry.rundir import STATE, latest_checkpoint, step_name
from llm_foundry.tokenizer_files import METADATA_FILES
from llm_foundry.train.distributed import World, any_rank, with_tied
from llm_foundry.train.state import (
    CheckpointNotWritten,
    begin_checkpoint,
    commit_checkpoint,
    optimizer_from_flat,
    prune_checkpoints,
    temporary_dir,
    write_state,
)

log = logging.getLogger(__name__)

# one process saves without a process group by design (DCP's no_dist): DCP's warning that it
# assumes so is noise. Async saves warn in their thread, which a catch_warnings does not reach.
ALONE = "torch.distributed is disabled"
warnings.filterwarnings("ignore", ALONE, UserWarning)

OPTIM = "optim"  # the optimizer's tensors in dcp/: "optim.<id>.<key>"
OPTIMIZER_FILE = "optimizer.safetensors"  # a full checkpoint's ("<id>.<key>")
TOKENIZER_FILE = "tokenizer.json"


def sharded_state(model: torch.nn.Module, optimizer) -> tuple[dict, dict]:
    """(what DCP writes: the model's and the optimizer's tensors as this rank holds them, DTensor
    shards under FSDP2/TP; the optimizer's JSON part, as ``state.optimizer_to_flat`` gives it)."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    content = {DCP_MODEL: stored_once(model, get_model_state_dict(model))}
    sd = get_optimizer_state_dict(model, optimizer)  # keyed by parameter name
    names = [name for g in sd["param_groups"] for name in g["params"]]  # the optimizer's order
    ids = {name: str(i) for i, name in enumerate(names)}
    tensors: dict[str, dict] = {}
    scalars = {}
    for name, st in sd["state"].items():
        for key, value in st.items():
            if torch.is_tensor(value):
                tensors.setdefault(ids[name], {})[key] = value
            else:
                scalars[f"{ids[name]}.{key}"] = value
    groups, start = [], 0
    for g in sd["param_groups"]:
        n = len(g["params"])
        plain = {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()}
        groups.append({**plain, "params": list(range(start, start + n))})
        start += n
    content[OPTIM] = tensors
    return content, {"param_groups": groups, "scalars": scalars}


def load_sharded(path: Path, model: torch.nn.Module, optimizer, opt_meta: dict) -> None:
    """Fill ``model`` (plain, DDP, FSDP2, TP or 2-D) and ``optimizer`` from the sharded
    checkpoint ``path`` (``opt_meta``: its state.json's optimizer entry), each rank reading what
    its shards hold: any world size or mesh reads any other's. Collective when distributed."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model_sd = get_model_state_dict(model)  # a tied name shares its tensor: filled with it
    content = {DCP_MODEL: stored_once(model, model_sd)}
    if optimizer is not None:
        # an optimizer with no state yet gets it here (DCP takes one step with zero gradients
        # and lr 0), so that there are tensors of the right shards to read into
        optim_sd = get_optimizer_state_dict(model, optimizer)
        names = [name for g in optim_sd["param_groups"] for name in g["params"]]
        content[OPTIM] = {
            str(i): {k: v for k, v in optim_sd["state"][name].items() if torch.is_tensor(v)}
            for i, name in enumerate(names)
            if name in optim_sd["state"]
        }
    load_dcp(path / DCP_DIR, content)
    set_model_state_dict(model, model_sd)
    if optimizer is None:
        return
    for key, value in opt_meta["scalars"].items():
        pid, k = key.split(".", 1)
        optim_sd["state"][names[int(pid)]][k] = value
    groups = [
        {**g, "params": [names[i] for i in g["params"]]}
        for g in optimizer_from_flat({}, opt_meta)["param_groups"]
    ]
    set_optimizer_state_dict(model, optimizer, {"state": optim_sd["state"], "param_groups": groups})


@dataclass
class _Pending:
    """A save being written in the background, committed once it completes."""

    future: Future
    tmp: Path
    step: int
    keep: set[str] = field(default_factory=set)


class ShardedCheckpoints:
    """The dcp saves of one run into ``root`` (its checkpoints/ directory): every rank writes
    its shards; in the ``background`` at most one save is in flight, the next waiting for it."""

    def __init__(self, root: Path, world: World, background: bool, keep_last: int):
        self.root, self.world, self.background, self.keep_last = root, world, background, keep_last
        self.pending: _Pending | None = None
        # a save started whose outcome the ranks have not agreed on yet (rank 0 alone commits)
        self.unsettled: int | None = None
        self.failed: Exception | None = None  # a background commit's error, said at the agreement
        self.device = torch.device("cpu")
        self.group = None
        if background and world.distributed:
            # the writer thread's collectives (the plan, the metadata gathered at the end) need
            # a group of their own, or they would interleave with training's; gloo, as DCP's
            # async saves want a CPU backend (on GPUs too). The end waits for the slowest
            # rank's writes, hence a timeout longer than the training group's 5 minutes.
            self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=30))

    def save(self, step: int, wrapped: torch.nn.Module, model: torch.nn.Module, optimizer,
             state: dict, tokenizer: Path | None, keep: set[str], blocking: bool = True) -> Path:  # fmt: skip
        """Write step ``step``: ``wrapped`` (the model as trained: DDP, FSDP2, TP) and
        ``optimizer`` by DCP, ``state`` (the trainer's) in state.json; returns the step directory
        it will be. ``blocking``: wait until it is complete even in the background (the run's
        last save). ``keep``: checkpoint names pruning must spare (the best one)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        self.finish()  # one save at a time: the previous one complete and committed first
        content, opt_meta = sharded_state(wrapped, optimizer)
        self.device = _device(wrapped)
        tmp = temporary_dir(self.root, step)
        failed: OSError | None = None
        if self.world.main:
            try:
                begin_checkpoint(self.root, step)
                write_config(model, tmp)
                write_state(tmp, step, state, opt_meta, tokenizer)
            except OSError as e:  # a full disk: said below, on every rank
                failed = e
        # the directory exists, with nothing stale in it, before any writes; when rank 0 could
        # not make it, no rank writes (each would wait for the others in DCP's collectives)
        if any_rank(failed is not None, self.world, _device(wrapped)):
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointNotWritten(self.root, step, failed or OSError(RANK0_FAILED))
        writer = dcp.FileSystemWriter(tmp / DCP_DIR)
        alone = not self.world.distributed
        if self.background:
            future = dcp.async_save(content, storage_writer=writer, process_group=self.group,
                                    no_dist=alone)  # fmt: skip
            self.pending = _Pending(future, tmp, step, keep)
        else:
            future: Future = Future()
            try:
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", ALONE, UserWarning)
                    future.set_result(dcp.save(content, storage_writer=writer, no_dist=alone))
            except CheckpointException as e:  # said in one line by finish(), as in the background
                future.set_exception(e)
            self.pending = _Pending(future, tmp, step, keep)
        self.unsettled = step
        if blocking or not self.background:
            self.finish()  # no rank goes on before the checkpoint is complete (its agreement)
        return self.root / step_name(step)

    def poll(self) -> None:
        """Commit a background save that has completed (cheap when none has). With several
        ranks, no collective: each rank's save completes at its own step, so an error is kept
        for the next ``finish()``, which every rank calls at the same step."""
        if self.pending is not None and self.pending.future.done():
            pending, self.pending = self.pending, None
            try:
                self._commit(pending)
            except Exception as e:
                if not self.world.distributed:
                    raise
                self.failed = e

    def finish(self, quiet: bool = False) -> Path | None:
        """Wait for the save in flight, if any, and (rank 0) put it in place; the error of a
        write or of rank 0's commit is raised here on every rank together (logged instead with
        ``quiet``: the run is ending on an error already, and no collective is risked)."""
        pending, self.pending = self.pending, None
        path = None
        try:
            if pending is not None:
                path = self._commit(pending)
        except Exception as e:
            self.failed = e
        failed, self.failed = self.failed, None
        step, self.unsettled = self.unsettled, None
        if quiet:
            if failed is not None:
                log.warning(f"warning: {failed}")
            return None
        # rank 0 alone commits: every rank learns whether it could, none left waiting in the
        # next step's collectives for a rank that stopped
        if step is not None and any_rank(failed is not None, self.world, self.device):
            if failed is None:  # rank 0's commit failed: it says why
                failed = CheckpointNotWritten(self.root, step, OSError(RANK0_COMMIT_FAILED))
        if failed is not None:
            raise failed
        return path

    def _commit(self, pending: _Pending) -> Path | None:
        """Wait for ``pending``'s writes; rank 0 puts it in place and prunes. A write that failed
        on any rank (a full disk) is ``CheckpointNotWritten``, as a gathered save's, and what
        was written is removed."""
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            try:
                pending.future.result()
            except CheckpointException as e:  # a BaseException, its message a traceback per rank
                cause = write_failure(e)
                if cause is None:  # not a write that failed (a bug): its own words, on one line
                    shutil.rmtree(pending.tmp, ignore_errors=True)
                    raise RuntimeError(f"the checkpoint of step {pending.step} was not written "
                                       f"({pending.tmp}): {dcp_failure(e)}") from e  # fmt: skip
                raise cause from e
            if not self.world.main:
                return None
            path = commit_checkpoint(self.root, pending.tmp, pending.step)
            prune_checkpoints(self.root, self.keep_last, pending.keep | {path.name})
            return path
        except OSError as e:  # its bytes must not stay on a full disk (every rank's, each failed)
            shutil.rmtree(pending.tmp, ignore_errors=True)
            roll_back(self.root, pending.step)
            raise CheckpointNotWritten(self.root, pending.step, e) from e


RANK0_FAILED = "rank 0 could not write the checkpoint's config.json and state.json"
RANK0_COMMIT_FAILED = "rank 0 could not put the checkpoint in place"


def roll_back(root: Path, step: int) -> None:
    """Remove step ``step``'s directory when a commit failed after renaming it into place (its
    latest.json or the directory's fsync not written), unless latest.json names it: the error
    then says truthfully that it was not written, and which checkpoint is the last complete."""
    final = root / step_name(step)
    try:
        last = latest_checkpoint(root)
    except ValueError:  # a damaged pointer names nothing
        last = None
    if final.exists() and last != final:
        shutil.rmtree(final, ignore_errors=True)


def write_failure(e: BaseException) -> OSError | None:
    """The error that stopped a DCP save when every failing rank's is a failed write (an
    OSError: a full disk, a read-only file system): the lowest failing rank's; else None."""
    errors = [exc for _, (exc, _) in sorted(getattr(e, "failures", {}).items())]
    if errors and all(isinstance(exc, OSError) for exc in errors):
        return errors[0]
    return None


def _device(module: torch.nn.Module) -> torch.device:
    """Where ``module``'s parameters live (a DTensor's: its local shard's), for a collective."""
    return next(module.parameters()).device


# ----------------------------------------------------------------------------------------------
# convert --from-dcp / --to-dcp: one process, no process group


def dcp_to_full(src: Path, out: Path) -> None:
    """Write the sharded checkpoint directory ``src`` into the empty directory ``out`` as a full
    one: config.json + model.safetensors (a model checkpoint), and for a training checkpoint
    optimizer.safetensors and state.json as a single-process run writes them (resumable)."""
    cfg, lora, quant = read_config(src), read_lora(src), read_quantization(src)
    # names and shapes checked against the config before anything is allocated
    check_weights_fit(cfg, dcp_shapes(src / DCP_DIR, DCP_MODEL), src, lora, quant, src / DCP_DIR)
    tensors = read_dcp_tensors(src / DCP_DIR)
    lead = f"{DCP_MODEL}."
    weights = {k[len(lead) :]: v for k, v in tensors.items() if k.startswith(lead)}
    with torch.device("meta"):
        model = build(cfg, lora, quant)
    model = _empty_on_cpu(model)  # no initial weights drawn: every one is loaded next
    model.load_state_dict(with_tied(model, weights))  # strict: the checkpoint holds them all
    save_checkpoint(model, out)
    lead = f"{OPTIM}."
    optim = {k[len(lead) :]: v for k, v in tensors.items() if k.startswith(lead)}
    _copy_rest(src, out)
    if optim:  # the names a full checkpoint gives them: "<id>.<key>"
        save_file(optim, str(out / OPTIMIZER_FILE))
        usual_mode(out / OPTIMIZER_FILE)


def _empty_on_cpu(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` (on the meta device) given CPU storage, uninitialised, its tied parameters
    tied again (``to_empty`` gives each name a tensor of its own)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    model = model.to_empty(device="cpu")
    for first, *others in names.values():
        for name in others:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, model.get_parameter(first))
    return model


def full_to_dcp(src: Path, out: Path) -> None:
    """Write our checkpoint directory ``src`` (a model checkpoint, or a training one with its
    optimizer and state) into the empty directory ``out`` as a sharded one, ``dcp/`` in place of
    the safetensors files: what a dcp run saves, readable by any world size."""
    import torch.distributed.checkpoint as dcp

    model = load_checkpoint(src, merge=False)  # LoRA adapters stay adapters, as trained
    content: dict = {DCP_MODEL: stored_once(model, model.state_dict())}
    if (src / OPTIMIZER_FILE).exists():
        optim: dict[str, dict] = {}
        for name, t in load_file(str(src / OPTIMIZER_FILE)).items():
            pid, key = name.split(".", 1)
            optim.setdefault(pid, {})[key] = t
        content[OPTIM] = optim
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ALONE, UserWarning)
        dcp.save(content, storage_writer=dcp.FileSystemWriter(out / DCP_DIR), no_dist=True)
    write_config(model, out)
    _copy_rest(src, out)


def _copy_rest(src: Path, out: Path) -> None:
    """state.json, tokenizer.json and its metadata files, when ``src`` has them."""
    for name in (STATE, TOKENIZER_FILE, *METADATA_FILES):
        if (src / name).exists():
            shutil.copyfile(src / name, out / name)


def convertible(src: Path, to_dcp: bool) -> None:
    """Refuse (one line) a checkpoint directory that is not of the kind being converted from."""
    flag = "--to-dcp" if to_dcp else "--from-dcp"
    if not (src / CONFIG_FILE).exists():
        raise FileNotFoundError(f"{flag} {src}: no {CONFIG_FILE}, not an llm-foundry checkpoint")
    sharded = is_dcp(src) and not (src / WEIGHTS_FILE).exists()
    if to_dcp and sharded:
        raise ValueError(f"--to-dcp {src} is a sharded (DCP) checkpoint already; --from-dcp "
                         "writes it as safetensors")  # fmt: skip
    if not to_dcp and not sharded:
        raise ValueError(f"--from-dcp {src} holds {WEIGHTS_FILE}, not a {DCP_DIR}/ directory: "
                         "it is a full checkpoint already; --to-dcp shards one")  # fmt: skip
