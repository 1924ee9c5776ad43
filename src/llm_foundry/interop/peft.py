"""LoRA adapters in PEFT's format, both ways: ``adapter_config.json`` + ``adapter_model.safetensors``
with PEFT's tensor names, so ``peft.PeftModel.from_pretrained`` puts our adapter on the HF export
of the base model, and an adapter trained with ``peft`` loads onto our model.

A PEFT adapter names the HF module it adapts (``base_model.model.model.layers.0.self_attn.q_proj``
+ ``.lora_A.weight`` / ``.lora_B.weight``); the HF family's weight table gives the name of each of
our projections. Only projections HF stores as one separate ``nn.Linear`` can carry an adapter
both sides agree on (not GPT-2's Conv1D, BLOOM's or Falcon's fused q/k/v, or stacked experts):
the others are refused by name. Pickled adapters (``adapter_model.bin``) are never read.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from llm_foundry.checkpoint import check_finite, read_safetensors_header
from llm_foundry.interop.hf import choose_family, expand, fail
from llm_foundry.messages import shown
from llm_foundry.models.lora import add_lora, lora_layers
from llm_foundry.models.lora import check_settings as check_lora

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
# adapter_config.json settings whose non-default values change what the adapter computes
UNSUPPORTED = {
    "bias": "none",
    "use_dora": False,
    "fan_in_fan_out": False,
    "modules_to_save": None,
    "layers_to_transform": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "lora_bias": False,
}


def module_names(cfg, family: str | None = None) -> tuple[str, dict[str, str]]:
    """(HF family name, our module name -> HF module name) for every projection HF stores as
    one plain linear layer."""
    fam = choose_family(cfg, family)
    out = {}
    for hf, rule in expand(fam.table(cfg), cfg).items():
        (ours,) = rule.ours if len(rule.ours) == 1 else (None,)
        plain = not (rule.conv1d or rule.groups or rule.expert is not None or rule.dim)
        if ours and plain and ours.endswith(".weight") and hf.endswith(".weight"):
            out[ours.removesuffix(".weight")] = hf.removesuffix(".weight")
    return fam.model_type, out


def save_adapter(model, out_dir: str | Path, family: str | None = None, base: str = "") -> Path:
    """Write ``model``'s LoRAs as a PEFT adapter for the HF export of its base (``to_hf``)."""
    layers = lora_layers(model)
    if not layers:
        raise ValueError("the model has no LoRA adapters to save (add them with add_lora)")
    settings = {(m.r, m.alpha, m.dropout, m.rslora) for m in layers.values()}
    if len(settings) > 1:
        raise ValueError(f"PEFT's format holds one r/alpha/dropout for all; got {sorted(settings)}")
    (r, alpha, dropout, rslora) = settings.pop()
    _, names = module_names(model.cfg, family)
    tensors, targets = {}, set()
    for ours, lora in layers.items():
        if ours not in names:
            fail(
                [f"{ours}: HF stores this projection fused or transposed, so a PEFT adapter "
                 "cannot name it; adapt another projection"],
                "cannot save a PEFT adapter",
            )  # fmt: skip
        hf = names[ours]
        tensors[f"{PREFIX}{hf}.lora_A.weight"] = lora.lora_A.detach().cpu().contiguous()
        tensors[f"{PREFIX}{hf}.lora_B.weight"] = lora.lora_B.detach().cpu().contiguous()
        targets.add(hf.rsplit(".", 1)[-1])
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": r,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "use_rslora": rslora,
        "target_modules": sorted(targets),
        "init_lora_weights": True,
        "inference_mode": True,
        **UNSUPPORTED,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    return out


def load_adapter(model, adapter_dir: str | Path, family: str | None = None) -> list[str]:
    """Put the PEFT LoRA adapter in ``adapter_dir`` on ``model`` (freezing the base); returns
    the adapted modules. Every adapter tensor must find its module, and every module its two."""
    path = Path(adapter_dir)
    config_file, weights_file = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not weights_file.exists():
        pickled = (
            " (adapter_model.bin is a pickle and is never read)"
            if (path / "adapter_model.bin").exists()
            else ""
        )
        raise FileNotFoundError(f"{weights_file} not found{pickled}")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{config_file}: not a readable adapter config ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(
            f"{config_file} holds {type(config).__name__}, not an adapter config object"
        )
    problems = []
    if config.get("peft_type") != "LORA":
        problems.append(f"peft_type={config.get('peft_type')!r} is not 'LORA'")
    for key, default in UNSUPPORTED.items():
        if config.get(key, default) not in (default, None, {}, False, "none"):
            problems.append(f"{key}={shown(config[key])} is not supported (only {default!r})")
    settings = dict(r=config.get("r"), alpha=config.get("lora_alpha"),
                    dropout=config.get("lora_dropout") or 0.0,
                    rslora=config.get("use_rslora") or False, targets=["wq"])  # fmt: skip
    problems += [p.replace("LoRA ", f"{config_file.name}: ", 1) for p in check_lora(settings)]
    fail(problems, f"cannot load the adapter in {path}")
    _, names = module_names(model.cfg, family)
    ours_of = {hf: ours for ours, hf in names.items()}
    read_safetensors_header(weights_file)  # a damaged file is named, not met inside the reader
    tensors = load_file(str(weights_file))
    check_finite(tensors, weights_file)  # NaN/inf would make every output NaN
    by_module: dict[str, dict[str, torch.Tensor]] = {}
    unknown = []
    for key, t in tensors.items():
        name = key.removeprefix(PREFIX)
        for part in ("lora_A", "lora_B"):
            suffix = f".{part}.weight"
            if name.endswith(suffix) and name.removesuffix(suffix) in ours_of:
                by_module.setdefault(ours_of[name.removesuffix(suffix)], {})[part] = t
                break
        else:
            unknown.append(key)
    if unknown or not by_module:
        fail(
            [f"adapter tensors with no module in the model: {sorted(unknown)[:4]}"]
            if unknown else [f"{weights_file} holds no LoRA tensors"],
            f"cannot load the adapter in {path}",
        )  # fmt: skip
    r = settings["r"]
    problems = []
    for name, parts in sorted(by_module.items()):
        base = model.get_submodule(name)
        want = {"lora_A": (r, base.in_features), "lora_B": (base.out_features, r)}
        for part, shape in want.items():
            got = tuple(parts[part].shape) if part in parts else None
            if got != shape:
                problems.append(f"{name}.{part}: {'missing' if got is None else f'shape {got}'}, "
                                f"the model needs {shape} (r={r})")  # fmt: skip
    fail(problems, f"cannot load the adapter in {path}")
    leaves = sorted({m.rsplit(".", 1)[-1] for m in by_module})
    adapted = add_lora(model, leaves, **{k: v for k, v in settings.items() if k != "targets"})
    missing = sorted(set(adapted) - set(by_module))
    fail(
        [f"no adapter tensors for {missing[:4]}"] if missing else [],
        f"cannot load the adapter in {path}",
    )
    layers = lora_layers(model)
    with torch.no_grad():
        for name, parts in by_module.items():
            for part, t in parts.items():
                getattr(layers[name], part).copy_(t)
    return adapted
