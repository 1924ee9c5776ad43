"""Training checkpoints that survive a crash and load without unpickling anything.

A checkpoint is a directory ``step_000500/`` holding
  model.safetensors + config.json   the weights and model config (loadable for generation alone)
  optimizer.safetensors             every optimizer tensor (AdamW moments and step counts)
  state.json                        step, configs, optimizer hyper-parameters, RNG and data-sampler
                                    states, best validation loss: plain JSON
  tokenizer.json                    the tokenizer, so the checkpoint can decode its own samples
It is written to a hidden temporary directory, every file fsynced, then renamed into place;
``latest.json`` (written the same way) names the newest complete one. A crash mid-save leaves
only a temporary directory behind, which the next save removes.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from llm_foundry.checkpoint import load_weights, save_checkpoint

LATEST = "latest.json"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON to ``path`` so that readers see the old file or the new one, never half."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


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
    ``optimizer_state`` is an ``optimizer.state_dict()`` (single-process layout)."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    for stale in ckpt_root.glob(".tmp-*"):  # left by a save that crashed
        shutil.rmtree(stale, ignore_errors=True)
    final = ckpt_root / f"step_{step:06d}"
    tmp = ckpt_root / f".tmp-step_{step:06d}"
    tmp.mkdir()
    save_checkpoint(model, tmp)
    tensors, opt_meta = optimizer_to_flat(optimizer_state)
    save_file(tensors, str(tmp / "optimizer.safetensors"))
    with open(tmp / "state.json", "w") as f:
        json.dump({**state, "step": step, "optimizer": opt_meta, "rng": rng_state()}, f)
    if tokenizer_path is not None and Path(tokenizer_path).exists():
        shutil.copyfile(tokenizer_path, tmp / "tokenizer.json")
    for file in tmp.iterdir():
        with open(file, "rb") as fh:
            os.fsync(fh.fileno())
    _fsync_dir(tmp)
    if final.exists():  # the same step saved again (e.g. a signal right after a periodic save)
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(ckpt_root)
    write_json_atomic(ckpt_root / LATEST, {"step": step, "path": final.name})
    return final


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    """The step directory ``ckpt_root/latest.json`` names (None without a pointer, or when it
    names a directory that is gone)."""
    pointer = ckpt_root / LATEST
    if not pointer.exists():
        return None
    try:
        name = json.loads(pointer.read_text())["path"]
        if not isinstance(name, str) or "/" in name or name in ("", ".", ".."):
            raise TypeError(f"path {name!r} is not a step directory name")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise ValueError(
            f"{pointer} is not a valid latest-checkpoint pointer ({e!r}); expected "
            '{"step": N, "path": "step_000N"}'
        ) from None
    path = ckpt_root / name
    return path if path.exists() else None


def read_state(path: Path) -> dict:
    """``path/state.json`` (a training checkpoint's state), with errors naming the file."""
    file = Path(path) / "state.json"
    try:
        state = json.loads(file.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{file} is missing: {path} is not a training checkpoint") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON ({e}); the checkpoint is damaged") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise ValueError(f"{file} holds no training state (expected an object with a 'step')")
    return state


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
    steps = sorted(ckpt_root.glob("step_*"))
    for old in steps[: max(0, len(steps) - keep_last)]:
        if old.name not in keep:
            shutil.rmtree(old, ignore_errors=True)
