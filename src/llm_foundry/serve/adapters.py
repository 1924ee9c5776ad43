"""The LoRA adapters ``serve --adapter NAME=DIR`` puts over one base model, unmerged: each read
from its directory (a PEFT adapter, or a LoRA run or checkpoint of ours), checked against the
served model, and stacked into ``models.multi_lora`` layers so that every request picks its own.
An adapter that does not fit the model (another base's shapes or config, projections the model
lacks or cannot adapt, settings that change the math) is refused at startup in one line naming
its directory and what differs."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from llm_foundry.models.multi_lora import AdapterRows, LoRAWeights, add_adapters

log = logging.getLogger(__name__)


def _taken(model) -> dict[str, LoRAWeights]:
    """The LoRAs now on ``model`` as weights (copies), each projection put back as it was."""
    from llm_foundry.models.lora import lora_layers

    taken = {}
    for name, layer in lora_layers(model).items():
        taken[name] = LoRAWeights(layer.lora_A.detach().clone(), layer.lora_B.detach().clone(),
                                  float(layer.scale))  # fmt: skip
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, layer.base)
    return taken


def _from_run(model, path: Path, notes: list[str]) -> dict[str, LoRAWeights]:
    """The adapters of a LoRA run or checkpoint of ours, refused if trained on another model;
    ``notes`` gets what differs from the base they were fitted over (its rounding, its weights:
    the words a merge's line uses, ``models.lora``)."""
    from llm_foundry.checkpoint import load_checkpoint, read_config, read_lora
    from llm_foundry.loading import checkpoint_kind
    from llm_foundry.messages import first_few
    from llm_foundry.models.lora import base_differences
    from llm_foundry.rundir import checkpoint_dir

    neither = ValueError("neither a PEFT adapter (adapter_config.json) nor a LoRA run or "
                         "checkpoint of ours (config.json with 'lora')")  # fmt: skip
    try:
        ckpt = checkpoint_dir(path)
    except FileNotFoundError:
        raise neither from None
    if checkpoint_kind(ckpt)[0] != "llm-foundry" or read_lora(ckpt) is None:
        raise neither
    diff = model.cfg.weight_differences(read_config(ckpt))
    if diff:
        raise ValueError(f"trained on another model ({'; '.join(diff[:3])})")
    tuned = load_checkpoint(ckpt, merge=False)
    over = read_lora(ckpt).get("base_dtype", "fp32")
    if over != "fp32":  # fitted to the rounded weights, served over these
        notes.append(f"trained over the {over}-rounded base, put on this one")
    differ, compared = base_differences(model, tuned)
    if differ:
        notes.append(f"trained over other base weights than these ({len(differ)} of {compared} "
                     f"tensors differ: {first_few(differ)}): give --checkpoint the base they were "
                     "fine-tuned from")  # fmt: skip
    return _taken(tuned)


def read_adapter(model, path: str | Path, notes: list[str] | None = None) -> dict[str, LoRAWeights]:
    """Module name -> the LoRA weights the adapter in directory ``path`` puts on ``model``
    (which is left as it was). Raises ValueError (one line, without the directory) when the
    adapter does not fit the model; ``notes`` gets what is worth saying of one that does."""
    notes = [] if notes is None else notes
    from llm_foundry.interop.hf import ConversionError
    from llm_foundry.interop.peft import CONFIG_FILE, WEIGHTS_FILE, load_adapter

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError("no such directory")
    if not ((path / CONFIG_FILE).exists() or (path / WEIGHTS_FILE).exists()):
        return _from_run(model, path, notes)
    try:
        load_adapter(model, path, merged=False)  # served unmerged: a tied lm_head may take one
    except ConversionError as e:
        raise ValueError("; ".join(e.problems)) from None
    finally:
        taken = _taken(model)  # put back whatever load_adapter wrapped, even when it failed
    return taken


def load_adapters(model, adapters: dict[str, str | Path]) -> AdapterRows:
    """Put the adapters ``adapters`` (name -> directory) over ``model``, unmerged, in that
    order (indices 1..N; 0 is the bare base). Returns the rows selector the engine sets."""
    from llm_foundry.models.quant import QuantLinear

    if any(isinstance(m, QuantLinear) for m in model.modules()):
        raise ValueError("--adapter: the served model's weights are quantized (a `quantize` "
                         "output); serve adapters over the full-precision checkpoint it was made "
                         "from")  # fmt: skip
    weights = {}
    for name, directory in adapters.items():
        notes: list[str] = []
        try:
            weights[name] = read_adapter(model, directory, notes)
        except (ValueError, OSError) as e:
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ValueError(f"--adapter {name}={directory}: {why}") from None
        for note in notes:
            log.warning(f"note: --adapter {name}={directory}: {note}")
    with torch.no_grad():
        return add_adapters(model, weights)
