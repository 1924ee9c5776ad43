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
import logging
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from llm_foundry.checkpoint import check_finite, read_safetensors_header
from llm_foundry.durable import usual_mode
from llm_foundry.interop.hf import ConversionError, choose_family, expand, fail
from llm_foundry.interop.peft_fit import other_base, tensor_ranks
from llm_foundry.interop.peft_targets import target_problems, targeted
from llm_foundry.messages import first_few, shown
from llm_foundry.models.lora import TARGETS, add_lora_at, lora_layers
from llm_foundry.models.lora import check_settings as check_lora

log = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
LORA_NAME = re.compile(re.escape(PREFIX) + r"(.+)\.(lora_A|lora_B)\.weight")
# why an adapter on a module HF stores fused or transposed cannot be carried over
FUSED_WHY = ("llm-foundry keeps as separate projections, so a LoRA on HF's fused or transposed "
             "matrix has no place here; adapt a family whose projections are separate linear "
             "layers (llama, mistral, qwen3, mixtral, qwen3_moe), or fine-tune here with "
             "finetune --lora and export it")  # fmt: skip
# adapter_config.json settings whose non-default values change what the adapter computes
UNSUPPORTED = {
    "bias": "none",
    "use_dora": False,
    "fan_in_fan_out": False,
    "modules_to_save": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "lora_bias": False,
    "target_parameters": None,
    "trainable_token_indices": None,
    "layer_replication": None,
    "alora_invocation_tokens": None,
}


def module_names(cfg, family: str | None = None) -> tuple[str, dict[str, str]]:
    """(HF family name, our module name -> HF module name) for every projection HF stores as
    one plain linear layer."""
    fam, out, _ = _modules(cfg, family)
    return fam.model_type, out


def _modules(cfg, family: str | None):
    """(the HF family, ``module_names``' map, the HF modules stored fused, transposed (Conv1D)
    or stacked, which no adapter of ours can name)."""
    fam = choose_family(cfg, family)
    out, other = {}, set()
    for hf, rule in expand(fam.table(cfg), cfg).items():
        (ours,) = rule.ours if len(rule.ours) == 1 else (None,)
        plain = not (rule.conv1d or rule.groups or rule.expert is not None or rule.dim)
        if ours and plain and ours.endswith(".weight") and hf.endswith(".weight"):
            out[ours.removesuffix(".weight")] = hf.removesuffix(".weight")
        elif hf.endswith(".weight"):
            other.add(hf.removesuffix(".weight"))
    return fam, out, other


def base_reference(base: str) -> str:
    """``base`` as adapter_config.json's base_model_name_or_path records it: a local directory as
    its absolute path (a relative one would be read from wherever the adapter is loaded, or
    taken for a Hub id), anything else (a Hub id, "") as given."""
    return str(Path(base).resolve()) if base and Path(base).is_dir() else base


def save_adapter(model, out_dir: str | Path, family: str | None = None, base: str = "") -> Path:
    """Write ``model``'s LoRAs as a PEFT adapter for the HF export of its base (``to_hf``),
    named by ``base`` (``base_reference``)."""
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
        "base_model_name_or_path": base_reference(base),
        "r": r,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "use_rslora": rslora,
        "target_modules": sorted(targets),
        "init_lora_weights": True,
        "inference_mode": True,
        "layers_to_transform": None,
        **UNSUPPORTED,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    usual_mode(out / WEIGHTS_FILE)
    return out


def load_adapter(model, adapter_dir: str | Path, family: str | None = None,
                 merged: bool = True) -> list[str]:  # fmt: skip
    """Put the PEFT LoRA adapter in ``adapter_dir`` on ``model`` (freezing the base); returns
    the adapted modules. The modules adapted are those adapter_config.json's target_modules
    chooses, by peft's rules (``peft_targets``); a tensor of a module it does not choose is left
    out, as peft leaves it, with a note. Every chosen module must find its two tensors, of the
    config's rank and the model's shapes; what does not fit is refused in one line
    (``ConversionError``), an adapter made for another model naming how it differs. ``merged``
    false: the adapter stays unmerged (serve), so a tied lm_head may take one, as in peft."""
    path = Path(adapter_dir)
    config_file, weights_file = path / CONFIG_FILE, path / WEIGHTS_FILE
    config, settings = read_config(path)
    family_of, names, fused = _modules(model.cfg, family)
    fam = family_of.model_type
    # the projections a LoRA can adapt (not the norms or embeddings the table names too)
    ours_of = {hf: ours for ours, hf in names.items() if ours.rsplit(".", 1)[-1] in TARGETS}
    read_safetensors_header(weights_file)  # a damaged file is named, not met inside the reader
    tensors = load_file(str(weights_file))
    check_finite(tensors, weights_file)  # NaN/inf would make every output NaN
    modules, strays = {}, []  # HF module path -> {"lora_A": t, "lora_B": t}; other names
    for key, t in tensors.items():
        m = LORA_NAME.fullmatch(key)
        if m:
            modules.setdefault(m.group(1), {})[m.group(2)] = t
        else:
            strays.append(key)
    if strays or not modules:
        _refuse(path, [f"{WEIGHTS_FILE} holds tensors that are not LoRA weights of a module "
                       f"(base_model.model.PATH.lora_A.weight / .lora_B.weight): "
                       f"{first_few(sorted(strays))}" if strays
                       else f"{WEIGHTS_FILE} holds no LoRA tensors"])  # fmt: skip
    wanted = targeted(config, set(modules) | set(ours_of), head=names.get("lm_head"))
    left_out = sorted(set(modules) - wanted)
    modules = {k: v for k, v in modules.items() if k in wanted}
    if not modules:
        _refuse(path, [f"{CONFIG_FILE} {_choice(config)} chooses none of the modules "
                       f"{WEIGHTS_FILE} holds tensors for ({first_few(left_out)})"])  # fmt: skip
    ranks = tensor_ranks(modules)
    if ranks != {settings["r"]}:
        held = " and ".join(map(str, sorted(ranks)))
        _refuse(path, [f"{CONFIG_FILE} says r={settings['r']} but its tensors have rank "
                       f"{held}{'' if len(ranks) == 1 else ' (one rank for all is supported)'}"])  # fmt: skip
    mine = [hf for hf in ours_of if hf in wanted]  # in model order
    unknown = sorted(set(modules) - set(ours_of))
    whole = {hf for hf, parts in modules.items() if set(parts) == {"lora_A", "lora_B"}}
    missing = [ours_of[hf] for hf in mine if hf not in whole]
    shapes = [ours_of[hf] for hf in mine if hf in whole and not _fits(model, ours_of[hf],
                                                                      modules[hf])]  # fmt: skip
    # a chosen module with no tensor at all starts as peft starts it: with init_lora_weights true
    # its lora_B is zero, so it changes nothing (peft warns of the keys it misses)
    absent = [ours_of[hf] for hf in mine if hf not in modules]
    zero = config.get("init_lora_weights", True) is True
    if missing and missing == absent and zero and not (unknown or shapes):
        why = other_base(model, ours_of, modules, wanted)
        if why is not None:
            _refuse(path, [why])
        log.warning(f"note: {config_file} {_choice(config)} chooses {len(absent)} module(s) "
                    f"{weights_file} holds no tensors for ({first_few(absent)}): they start as "
                    "peft starts them, lora_B zero, and change nothing")  # fmt: skip
        missing = []
    if unknown or missing or shapes:
        why = other_base(model, ours_of, modules, wanted)
        if why is None and unknown and set(unknown) <= fused:
            why = f"its tensors adapt {first_few(unknown)}, which {fam} stores and {FUSED_WHY}"
        if why is None and unknown:
            why = (f"its tensors adapt modules this {fam} model does not have (or that are not "
                   f"one plain linear layer here): {first_few(unknown)}")  # fmt: skip
        if why is None and shapes:
            why = f"the tensors of {first_few(shapes)} do not have this model's shapes"
        if why is None:
            why = (f"{CONFIG_FILE} {_choice(config)} chooses {first_few(missing)}"
                   f", which {WEIGHTS_FILE} holds no lora_A and lora_B for")  # fmt: skip
        _refuse(path, [why])
    if left_out:  # peft reads only the chosen modules' tensors
        log.warning(f"note: {config_file} {_choice(config)} leaves out"
                 f" {len(left_out)} module(s) {weights_file} holds tensors for, as peft does: "
                 f"{first_few(left_out)}")  # fmt: skip
    adapted = add_lora_at(model, [ours_of[hf] for hf in mine], fitted=True, merged=merged,
                          **{k: v for k, v in settings.items() if k != "targets"})  # fmt: skip
    layers = lora_layers(model)
    with torch.no_grad():
        for hf in mine:
            for part, t in modules.get(hf, {}).items():
                getattr(layers[ours_of[hf]], part).copy_(t)
    return adapted


def _choice(config: dict) -> str:
    """The settings of ``config`` that choose the adapted modules, as they are written."""
    words = [f"target_modules={shown(config['target_modules'])}"]
    for key in ("exclude_modules", "layers_to_transform", "layers_pattern"):
        if config.get(key) not in (None, [], ""):
            words.append(f"{key}={shown(config[key])}")
    return " ".join(words)


def _fits(model, name: str, parts: dict[str, torch.Tensor]) -> bool:
    """Whether lora_A (r, in) and lora_B (out, r) fit the projection ``name`` of ``model``."""
    base = model.get_submodule(name)
    base = getattr(base, "base", base)
    a, b = parts["lora_A"], parts["lora_B"]
    return a.shape[-1] == base.in_features and b.shape[0] == base.out_features


def _refuse(path: Path, problems: list[str]) -> None:
    """Raise the one-line ``ConversionError`` of an adapter that cannot be loaded."""
    raise ConversionError(f"cannot load the adapter in {path}: {'; '.join(problems)}", problems)


def read_config(path: Path) -> tuple[dict, dict]:
    """(adapter_config.json of the adapter directory ``path``, the LoRA settings it gives:
    ``add_lora``'s arguments); refused in one line when peft's reading of it is not ours."""
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
        if config.get(key, default) in (default, None, {}, False, "none"):
            continue
        if key == "fan_in_fan_out":  # peft sets it for Conv1D modules, not the user
            problems.append(f"fan_in_fan_out=true: the adapter is on Conv1D modules (GPT-2's "
                            f"c_attn, c_fc, c_proj), which {FUSED_WHY}")  # fmt: skip
        else:
            problems.append(f"{key}={shown(config[key])} is not supported (only {default!r})")
    settings = dict(r=config.get("r"), alpha=config.get("lora_alpha"),
                    dropout=config.get("lora_dropout") or 0.0,
                    rslora=config.get("use_rslora") or False, targets=["wq"])  # fmt: skip
    problems += [p.replace("LoRA ", f"{config_file.name}: ", 1) for p in check_lora(settings)]
    problems += [f"{config_file.name}: {p}" for p in target_problems(config)]
    if problems:
        _refuse(path, problems)
    return config, settings
