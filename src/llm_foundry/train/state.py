"""Training checkpoints that survive a crash and load without unpickling anything.

A checkpoint is a directory ``step_000500/`` holding
  model.safetensors + config.json   the weights and model config (loadable for generation alone)
  optimizer.safetensors             every optimizer tensor (AdamW moments and step counts)
  state.json                        step, configs, optimizer hyper-parameters, RNG and data-sampler
                                    states, best validation loss: plain JSON
  tokenizer.json                    the tokenizer, so the checkpoint can decode its own samples
  tokenizer_config.json, ...        an HF tokenizer's chat template and special tokens, as the
                                    data directory carries them (``tokenizer_files``)
It is written to a hidden temporary directory, every file fsynced, then renamed into place;
``latest.json`` (written the same way) names the newest complete one. A save that fails (a full
disk) removes its temporary directory and says so in one line (``CheckpointNotWritten``); a
crash mid-save leaves only the temporary directory behind, which the next save removes. The names and their readers
(``latest_checkpoint``, ``read_state``) are the run directory's: ``llm_foundry.rundir``.
Sharded checkpoints (``train/dcp.py``) are written and committed by the same steps
(``begin_checkpoint``, ``write_state``, ``commit_checkpoint``), DCP's files in place of the
safetensors ones.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from llm_foundry.checkpoint import load_weights, save_checkpoint
from llm_foundry.config import ConfigError, ModelConfig
from llm_foundry.durable import fsync, fsync_tree, usual_mode
from llm_foundry.messages import one_line
from llm_foundry.rundir import (
    LATEST,
    STATE,
    RunDir,
    latest_checkpoint,
    read_state,
    step_dirs,
    step_name,
)
from llm_foundry.tokenizer_files import METADATA_FILES, copy_tokenizer_files
from llm_foundry.train.config import TrainConfig


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON to ``path`` so that readers see the old file or the new one, never half; a
    write that fails (a full disk) is ``FileNotWritten`` naming ``path``."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync(path.parent)
    except OSError as e:  # a full disk: no half-written file stays behind
        tmp.unlink(missing_ok=True)
        raise FileNotWritten(path, e) from e
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class FileNotWritten(OSError):
    """A file of the run directory (metrics.jsonl, run.json, ...) that could not be written:
    ``path``, why (``reason``, ``no_space``), and where the run stood when it failed (``step``
    reached, ``last`` complete checkpoint: set by ``at`` where they are known)."""

    def __init__(self, path: Path, error: BaseException, step: int | None = None,
                 last: Path | None = None):  # fmt: skip
        self.path, self.error, self.step, self.last = Path(path), error, step, last
        self.reason, self.no_space = failure_reason(error)
        super().__init__(f"could not write {self.path}: {self.reason}")
        self.errno = getattr(error, "errno", None)  # read as the failed write's (failure_reason)

    def at(self, step: int, last: Path | None) -> FileNotWritten:
        """This failure, said at training step ``step`` with ``last`` the last checkpoint."""
        return FileNotWritten(self.path, self.error, step, last)


# ----------------------------------------------------------------------------------------------
# Optimizer and RNG state as tensors + JSON


def optimizer_to_flat(sd: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Split an optimizer state dict into named tensors and a JSON-ready remainder."""
    tensors, scalars = {}, {}
    for pid, st in sd["state"].items():
        for key, value in st.items():
            if torch.is_tensor(value):
                tensors[f"{pid}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{pid}.{key}"] = value
    groups = [
        {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()}
        for g in sd["param_groups"]
    ]
    return tensors, {"param_groups": groups, "scalars": scalars}


def optimizer_from_flat(tensors: dict, meta: dict) -> dict:
    """The optimizer state dict that ``optimizer_to_flat`` split."""
    state: dict[int, dict] = {}
    for name, value in tensors.items():
        pid, key = name.split(".", 1)
        state.setdefault(int(pid), {})[key] = value
    for name, value in meta["scalars"].items():
        pid, key = name.split(".", 1)
        state.setdefault(int(pid), {})[key] = value
    groups = []
    for g in meta["param_groups"]:
        g = dict(g)
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
        groups.append(g)
    return {"state": state, "param_groups": groups}


def rng_state() -> dict:
    """Python, numpy-global and torch (CPU and CUDA) generator states as JSON data."""
    version, internal, gauss = random.getstate()
    st = {
        "python": [version, list(internal), gauss],
        "torch_cpu": torch.get_rng_state().tolist(),
    }
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    st["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    if torch.cuda.is_available():
        st["torch_cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return st


def set_rng_state(st: dict) -> None:
    version, internal, gauss = st["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(torch.tensor(st["torch_cpu"], dtype=torch.uint8))
    kind, keys, pos, has_gauss, cached = st["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "torch_cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in st["torch_cuda"]])


# ----------------------------------------------------------------------------------------------
# Save / load / prune


def save_train_checkpoint(
    ckpt_root: Path,
    step: int,
    model: torch.nn.Module,
    optimizer_state: dict,
    state: dict,
    tokenizer_path: Path | None = None,
) -> Path:
    """Write ``ckpt_root/step_{step:06d}`` atomically and point ``latest.json`` at it.
    ``optimizer_state`` is an ``optimizer.state_dict()`` (single-process layout). A save that
    fails (a full disk, say) removes what it wrote and raises ``CheckpointNotWritten``."""
    tmp = temporary_dir(ckpt_root, step)
    try:
        begin_checkpoint(ckpt_root, step)
        save_checkpoint(model, tmp)
        tensors, opt_meta = optimizer_to_flat(optimizer_state)
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        usual_mode(tmp / "optimizer.safetensors")
        write_state(tmp, step, state, opt_meta, tokenizer_path)
        return commit_checkpoint(ckpt_root, tmp, step)
    except (OSError, SafetensorError) as e:  # a write that failed; a bug is not reworded
        raise CheckpointNotWritten(ckpt_root, step, e) from e
    finally:  # gone once committed; after a failure its bytes must not stay on a full disk
        shutil.rmtree(tmp, ignore_errors=True)


class CheckpointNotWritten(OSError):
    """A checkpoint that could not be written; what it had written is removed and latest.json
    still names the last complete one (``last``: None when there is none)."""

    def __init__(self, ckpt_root: Path, step: int, error: BaseException):
        self.path = Path(ckpt_root) / step_name(step)
        self.reason, self.no_space = failure_reason(error)
        try:
            self.last = latest_checkpoint(ckpt_root)
        except ValueError:  # a damaged pointer: no complete checkpoint to name
            self.last = None
        last = self.last or "none (the run has saved none yet)"
        super().__init__(
            f"could not write checkpoint {self.path}: {self.reason}; the last complete "
            f"checkpoint is {last}"
        )


def failure_reason(error: BaseException) -> tuple[str, bool]:
    """(why ``error`` stopped a write, on one line; whether the disk is full). The errno of an
    OSError, or the "os error N" that safetensors' writer puts in its message."""
    code = getattr(error, "errno", None)
    if code is None:
        found = re.search(r"os error (\d+)|code: (\d+)", str(error))
        code = int(found.group(1) or found.group(2)) if found else None
    if code:
        text = os.strerror(code)
        return text[0].lower() + text[1:], code in (errno.ENOSPC, errno.EDQUOT)
    return one_line(f"{type(error).__name__}: {error}"), False


def begin_checkpoint(ckpt_root: Path, step: int) -> Path:
    """The hidden directory ``step``'s checkpoint is written into, new and empty; temporary
    directories a crashed save left behind are removed first."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    for stale in ckpt_root.glob(".tmp-*"):  # left by a save that crashed
        shutil.rmtree(stale, ignore_errors=True)
    tmp = temporary_dir(ckpt_root, step)
    tmp.mkdir()
    return tmp


def temporary_dir(ckpt_root: Path, step: int) -> Path:
    """Where ``step``'s checkpoint is written before it is complete (``begin_checkpoint``)."""
    return ckpt_root / f".tmp-{step_name(step)}"


def write_state(
    tmp: Path, step: int, state: dict, opt_meta: dict, tokenizer_path: Path | None = None
) -> None:
    """``state.json`` (the trainer's ``state``, the step, the optimizer's JSON part and this
    process's RNG states) and a copy of the tokenizer and its metadata files
    (``tokenizer_files``), in checkpoint directory ``tmp``."""
    with open(tmp / STATE, "w") as f:
        json.dump({**state, "step": step, "optimizer": opt_meta, "rng": rng_state()}, f)
    if tokenizer_path is not None and Path(tokenizer_path).exists():
        shutil.copyfile(tokenizer_path, tmp / "tokenizer.json")
        # with the chat template and special tokens the files beside it carry
        copy_tokenizer_files(Path(tokenizer_path).parent, tmp, METADATA_FILES)


def commit_checkpoint(ckpt_root: Path, tmp: Path, step: int) -> Path:
    """Make the checkpoint written in ``tmp`` the step directory of ``step``: every file and
    directory in it fsynced, renamed into place, then named by ``latest.json``."""
    fsync_tree(tmp)
    final = ckpt_root / step_name(step)
    if final.exists():  # the same step saved again (e.g. a signal right after a periodic save)
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync(ckpt_root)
    write_json_atomic(ckpt_root / LATEST, {"step": step, "path": final.name})
    return final


def load_train_checkpoint(path: Path, model: torch.nn.Module, optimizer=None) -> dict:
    """Restore weights (and optimizer, RNG states) from ``path``; returns state.json's content."""
    state = read_state(path)
    load_weights(model, path)
    if optimizer is not None:
        tensors = load_file(str(path / "optimizer.safetensors"))
        optimizer.load_state_dict(optimizer_from_flat(tensors, state["optimizer"]))
    set_rng_state(state["rng"])
    return state


def read_train_checkpoint(path: Path) -> tuple[dict, dict, dict]:
    """(model tensors, optimizer state dict, state.json) of ``path``, RNG states restored: for
    callers that place the tensors themselves (FSDP shards them)."""
    state = read_state(path)
    model_sd = load_file(str(path / "model.safetensors"))
    optim_sd = optimizer_from_flat(
        load_file(str(path / "optimizer.safetensors")), state["optimizer"]
    )
    set_rng_state(state["rng"])
    return model_sd, optim_sd, state


def prune_checkpoints(ckpt_root: Path, keep_last: int, keep: set[str]) -> None:
    """Delete all but the newest ``keep_last`` step directories and those named in ``keep``."""
    steps = step_dirs(ckpt_root)
    for old in steps[: max(0, len(steps) - keep_last)]:
        if old.name not in keep:
            shutil.rmtree(old, ignore_errors=True)


# ----------------------------------------------------------------------------------------------
# Resuming


def resume_point(run_dir: str | Path) -> tuple[Path, ModelConfig, TrainConfig, str | None] | None:
    """(checkpoint, model config, train config, data dir or None) of the latest checkpoint of
    ``run_dir``, from its state.json and run.json; None when there is no checkpoint to resume."""
    run = RunDir(run_dir)
    ckpt = run.latest()
    if ckpt is None:
        return None
    state = read_state(ckpt)
    data = (run.info().get("data") or {}).get("dir")
    model = ModelConfig.from_dict(state["model_config"])
    return ckpt, model, TrainConfig.from_dict(state["train_config"]), data


# the LoRA settings a checkpoint's adapters were built with: their shapes (r, targets), their
# scale (alpha, rslora), how the frozen base is held. lora_dropout, a regulariser of training
# alone, may change on resume like the learning rate.
LORA_BUILT = ("lora_r", "lora_targets", "lora_alpha", "lora_rslora", "lora_base_dtype")


def lora_changes(saved: dict, tc: TrainConfig) -> dict[str, tuple]:
    """field -> (saved, now) for each of ``LORA_BUILT`` on which ``tc`` differs from a run's
    saved train config ``saved`` (lora_targets as a set; settings of adapters neither side has
    are not compared)."""
    default = TrainConfig()
    was = {k: saved.get(k, getattr(default, k)) for k in LORA_BUILT}
    now = {k: getattr(tc, k) for k in LORA_BUILT}
    if not was["lora_r"] and not now["lora_r"]:  # no adapters then or now
        return {}
    out = {}
    for k in LORA_BUILT:
        same = (set(was[k].split(",")) == set(now[k].split(","))
                if k == "lora_targets" else was[k] == now[k])  # fmt: skip
        if not same:
            out[k] = (was[k], now[k])
    return out


def _flag(value) -> str:
    """A setting's value as a command-line flag takes it."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def check_resumable(
    state: dict, path: Path, mc: ModelConfig, tc: TrainConfig, data_id: dict, data_dir: str | Path
) -> list[str]:
    """Refuse (ConfigError, ValueError) resuming checkpoint ``path`` (its ``state``) as a run of
    ``mc`` and ``tc`` on the data ``data_id`` fingerprints when the saved state would not fit:
    another architecture, optimizer, starting model (init_from), other LoRA adapters
    (``LORA_BUILT``), other data. Returns the settings that differ from the saved run's ("name
    old -> new"; allowed: e.g. a larger max_steps, a dropout: ``model.dropout 0.0 -> 0.1``)."""
    # data of another tokenizer first: its vocabulary would otherwise show as another model
    saved_data = state.get("data")  # absent in checkpoints written before it was recorded
    tokenizer = "tokenizer_sha256"
    if saved_data is not None and saved_data.get(tokenizer) != data_id.get(tokenizer):
        raise ConfigError(
            [f"{tokenizer}: saved {saved_data.get(tokenizer)!r}, now {data_id.get(tokenizer)!r}"],
            f"resume: {path} was trained on tokens of another tokenizer than {data_dir}'s; a "
            "run resumes on data tokenized as it started: pass that --data, or start a new run "
            "with --out",
        )
    refused, model_changed = model_changes(state["model_config"], mc)
    if refused:
        raise ConfigError(
            [f"{k}: saved {was!r}, now {now!r}" for k, (was, now) in refused.items()],
            f"resume: {path} holds a model with other settings; a run resumes with the "
            "architecture it was started with, drop or fix these --model flags (or a --config "
            "file's model: section)",
        )
    saved_tc = state["train_config"]
    refuse_other_optimizer(saved_tc.get("optimizer", "adamw"), tc.optimizer, path)
    refuse_other_start(saved_tc.get("init_from"), tc.init_from, path)
    changed = lora_changes(saved_tc, tc)
    if changed:
        flags = " ".join(f"--train.{k} {_flag(v)}" for k, (v, _) in changed.items())
        raise ConfigError(
            ["; ".join(f"{k}: saved {was!r}, now {now!r}" for k, (was, now) in changed.items())],
            f"resume: {path} holds the adapters its run built (their shapes, scale and frozen "
            f"base are the run's); a resumed run keeps them: resume with {flags}, or start a new "
            "run with --out",
        )
    if saved_data is not None and saved_data != data_id:
        raise ConfigError(
            [
                f"{k}: saved {saved_data.get(k)!r}, now {v!r}"
                for k, v in data_id.items()
                if saved_data.get(k) != v
            ],
            f"resume: {path} was trained on other data than {data_dir}; a run resumes "
            "on the data it started with: pass that --data, or start a new run with --out",
        )
    now = json.loads(json.dumps(tc.to_dict()))
    trained = [f"{k} {saved_tc.get(k)!r} -> {v!r}" for k, v in now.items() if saved_tc.get(k) != v]
    return trained + [f"model.{k} {was!r} -> {now!r}" for k, (was, now) in model_changed.items()]


# model fields a resumed run may change: those no weight depends on (``ModelConfig.WEIGHT_FREE``:
# dropout, the attention kernel, MoE dispatch and loss weights, the std of initial weights that
# the checkpoint's replace)
RESUME_FREE = ModelConfig.WEIGHT_FREE


def model_changes(saved: dict, mc: ModelConfig) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """(the architecture fields on which ``mc`` differs from a run's saved model config
    ``saved``, those of ``RESUME_FREE`` on which it differs), each field -> (saved, now)."""
    # fields added since a run was saved take their defaults; runs saved before n_kv_heads
    # could stay unset hold the effective count: compare that
    was = ModelConfig.from_dict(saved).to_dict()
    now = json.loads(json.dumps(mc.to_dict()))  # tuples as JSON lists, like the saved one
    was["n_kv_heads"] = was["n_kv_heads"] or was["n_heads"]
    now["n_kv_heads"] = mc.kv_heads
    differ = {k: (was.get(k), v) for k, v in now.items() if was.get(k) != v}
    free = {k: v for k, v in differ.items() if k in RESUME_FREE}
    return {k: v for k, v in differ.items() if k not in free}, free


def refuse_other_optimizer(saved: str, now: str, path: Path) -> None:
    """Refuse, in one line, resuming checkpoint ``path`` (of an ``saved`` optimizer) with
    train.optimizer ``now``: the saved moments and parameter groups are that optimizer's."""
    if saved == now:
        return
    run = path.parent.parent
    raise ValueError(
        f"resume: train.optimizer is {now!r}, but {path} holds the state of {saved!r} (its "
        f"moments and parameter groups), which a resumed run goes on with: resume with "
        f"--train.optimizer {saved}, or start a new run from its weights: --train.init_from "
        f"{run} --train.optimizer {now} --out NEW_DIR"
    )


def refuse_other_start(saved: str | None, now: str | None, path: Path) -> None:
    """Refuse, in one line, a train.init_from ``now`` other than the one the run started from
    (``saved``; None: from scratch): a resumed run's weights are its checkpoint's ``path``."""
    if saved == now or (saved and now and Path(saved).resolve() == Path(now).resolve()):
        return
    started = f"started from {saved}" if saved else "was trained from scratch"
    other = f"start a new run from {now} with another --out" if now else "start a new run"
    raise ValueError(
        f"resume: train.init_from {now!r}, but the run {started}, and a resumed run's weights "
        f"are its own checkpoint's ({path}), never another model's: drop --train.init_from, "
        f"or {other}"
    )
