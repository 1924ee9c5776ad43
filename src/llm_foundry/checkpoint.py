"""llm-foundry's own weights format: a directory with ``model.safetensors`` and ``config.json``.

    config.json          {"format": "llm-foundry", "version": 1, "model": {...ModelConfig fields}}
    model.safetensors    the state dict; a tensor shared by two names (tied embeddings) is stored
                         once and re-tied on load

Nothing is unpickled on load: the config is JSON and the tensors are safetensors. Training
checkpoints (``train/state.py``) add their own files next to these two, so ``load_checkpoint``
reads a training step directory as well.

A sharded training checkpoint (``train.checkpoint_format`` dcp, ``train/dcp.py``) holds
``config.json`` and, in place of ``model.safetensors``, a ``dcp/`` directory written by
``torch.distributed.checkpoint`` (each rank's shards and a ``.metadata`` index); the weights
are ``model.<name>`` there. ``load_checkpoint`` reads it too, with no process group. DCP's
``.metadata`` is a pickle: it is read by an unpickler that builds DCP's own metadata classes
and nothing else (``read_dcp_metadata``), and the tensors by ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import math
import pickle
import re
import warnings
from functools import cache
from pathlib import Path

import torch
from safetensors.torch import load_model, save_model

from llm_foundry.config import ConfigError, ModelConfig
from llm_foundry.durable import usual_mode
from llm_foundry.messages import one_line, shown
from llm_foundry.models.lora import apply_lora_settings, fold_lora, lora_settings
from llm_foundry.models.lora import check_settings as check_lora
from llm_foundry.models.quant import apply_quant_settings, quant_settings, read_settings
from llm_foundry.models.transformer import Transformer
from llm_foundry.rundir import missing_file

FORMAT = "llm-foundry"
VERSION = 1
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
DCP_DIR = "dcp"  # a sharded checkpoint's tensors (torch.distributed.checkpoint) in its directory
DCP_MODEL = "model"  # the weights' prefix in it: "model.<parameter name>"


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The plain module under ``torch.compile`` (``_orig_mod``) and DDP/FSDP (``module``) wrappers,
    whose state-dict names would otherwise carry a prefix."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        if inner is None:
            inner = getattr(model, "module", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def save_checkpoint(model: torch.nn.Module, path: str | Path) -> Path:
    """Write ``model`` (a ``Transformer``, possibly compiled or DDP-wrapped) to the directory
    ``path`` (created if needed; files already there are replaced). Returns the directory."""
    model = unwrap(model)
    cfg = getattr(model, "cfg", None)
    if not isinstance(cfg, ModelConfig):
        raise TypeError(
            f"save_checkpoint needs an llm-foundry Transformer (a module with a ModelConfig at "
            f".cfg); got {type(model).__name__}"
        )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_model(model, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    usual_mode(path / WEIGHTS_FILE)
    write_config(model, path)
    return path


def write_config(model: torch.nn.Module, path: Path) -> None:
    """``path/config.json``: the format, the model config and the LoRA and quantization
    settings loading rebuilds ``model`` (a ``Transformer``, sharded or not) with."""
    model = unwrap(model)
    meta = {"format": FORMAT, "version": VERSION, "model": model.cfg.to_dict()}
    lora = lora_settings(model)
    if lora:  # adapters over a frozen base: loading rebuilds them (and may merge them)
        meta["lora"] = lora
    quant = quant_settings(model)
    if quant:  # which projections hold int8/int4 weights: loading swaps those layers in
        meta["quantization"] = quant
    (path / CONFIG_FILE).write_text(json.dumps(meta, indent=2))


def read_lora(path: str | Path) -> dict | None:
    """The LoRA settings a checkpoint was saved with (None: a plain model), checked."""
    file = Path(path) / CONFIG_FILE
    lora = json.loads(file.read_text()).get("lora")
    if lora is None:
        return None
    if not (isinstance(lora, dict) and {"r", "alpha", "targets"} <= set(lora)):
        raise ValueError(f"{file}: 'lora' is {shown(lora)}; expected r, alpha, targets")
    problems = check_lora(lora)
    if problems:
        raise ValueError(f"{file}: {'; '.join(problems)}")
    return lora


def read_config(path: str | Path) -> ModelConfig:
    """The ``ModelConfig`` stored in checkpoint directory ``path`` (format and version checked)."""
    file = Path(path) / CONFIG_FILE
    if not file.exists():
        raise missing_file(file)
    try:
        meta = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        hint = ""
        if isinstance(meta, dict) and "model_type" in meta:
            hint = (
                f" It looks like a Hugging Face checkpoint (model_type={meta['model_type']!r}): "
                "read it with llm_foundry.interop.hf.from_hf or `llm-foundry convert --from-hf`."
            )
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{file}: format={found!r}, expected {FORMAT!r}.{hint}")
    if meta.get("version") != VERSION:
        raise ValueError(
            f"{file}: version={meta.get('version')!r} is not supported; this code reads "
            f"version {VERSION}"
        )
    fields = meta.get("model")
    if not isinstance(fields, dict):
        raise ValueError(
            f"{file}: 'model' is {fields!r}; expected an object of ModelConfig fields "
            '({"vocab_size": ..., "dim": ..., ...})'
        )
    try:
        return ModelConfig.from_dict(fields)
    except ConfigError as e:
        raise ConfigError(e.problems, f"model config in {file}") from None


# ----------------------------------------------------------------------------------------------
# The weight file's header: every tensor's name, dtype and shape, read without the data

# bytes per element of each safetensors dtype
SAFETENSORS_DTYPES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8,
}  # fmt: skip
MAX_HEADER_BYTES = 100 << 20  # the limit the safetensors library itself sets


def read_safetensors_header(file: str | Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in a ``.safetensors`` file, from its header alone (no tensor data
    is read), after checking that the file is whole: a header that parses and tensor data that
    fits the file. Errors are one line naming the file."""
    file = Path(file)
    if not file.is_file():
        raise missing_file(file, None)
    size = file.stat().st_size
    bad = f"{file} is not a safetensors file ({{}}); the weights are damaged or not weights"
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(bad.format(f"{size} bytes, shorter than the 8-byte header length"))
        n = int.from_bytes(head, "little")
        if n > min(size - 8, MAX_HEADER_BYTES):
            raise ValueError(bad.format(f"header length {n:,} does not fit its {size:,} bytes"))
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(bad.format(f"its header is not JSON: {e}")) from None
    if not isinstance(header, dict):
        raise ValueError(bad.format("its header is not a JSON object"))
    data_bytes, shapes = size - 8 - n, {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            numel = math.prod(shape)
            ok = (
                dtype in SAFETENSORS_DTYPES
                and all(isinstance(d, int) and d >= 0 for d in shape)
                and 0 <= begin <= end <= data_bytes
                and end - begin == numel * SAFETENSORS_DTYPES[dtype]
            )
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(
                bad.format(
                    f"tensor {name!r}: {entry!r} does not describe data within the file's "
                    f"{data_bytes:,} data bytes (truncated?)"
                )
            )
        shapes[name] = tuple(shape)
    return shapes


def layer_indices(names) -> set[int]:
    """The layer numbers in tensor names (``layers.3.attn...``, ``model.layers.3...``,
    ``transformer.h.3...``): the first integer path component of each name."""
    found = set()
    for name in names:
        m = re.search(r"(?:^|\.)(\d+)\.", name)
        if m:
            found.add(int(m.group(1)))
    return found


def check_layer_count(cfg: ModelConfig, names, file: Path, config_file: Path) -> None:
    """Refuse a config whose layer count the weights do not hold, before any module is built:
    building is linear in ``n_layers``, even on the meta device."""
    layers = layer_indices(names)
    if cfg.n_layers != len(layers) or layers != set(range(len(layers))):
        held = f"layers 0..{max(layers)} ({len(layers)} distinct)" if layers else "no layers"
        raise ValueError(
            f"{config_file} says n_layers={cfg.n_layers}, but {file} holds {held}: the config and "
            "the weights do not belong together"
        )


def read_quantization(path: str | Path) -> dict | None:
    """The quantization a checkpoint was saved with (None: full precision)."""
    file = Path(path) / CONFIG_FILE
    return read_settings(json.loads(file.read_text()), file)


def build(cfg: ModelConfig, lora: dict | None = None, quant: dict | None = None) -> Transformer:
    """The model a checkpoint's config, LoRA and quantization settings describe (weights not
    loaded), on the current default device."""
    return apply_quant_settings(apply_lora_settings(Transformer(cfg), lora), quant)


def meta_transformer(
    cfg: ModelConfig, config_file: Path | None = None, weights=None, lora=None, quant=None
):
    """The model with every shape and no storage: free to build at any size that can exist."""
    try:
        with torch.device("meta"):
            return build(cfg, lora, quant)
    except RuntimeError as e:  # e.g. a tensor of more than 2**63 bytes
        where = f"{config_file} describes" if config_file else "the config describes"
        of = f", not the weights in {weights}" if weights else ""
        raise ValueError(f"{where} a model too large to exist{of} ({e})") from None
    except ValueError as e:  # LoRA or quantization settings that do not fit the model
        raise ValueError(f"{config_file or 'the config'}: {e}") from None


def check_weights_fit(
    cfg: ModelConfig,
    shapes: dict[str, tuple[int, ...]],
    path: Path,
    lora: dict | None = None,
    quant: dict | None = None,
    file: Path | None = None,
) -> None:
    """Refuse (one line) weights whose names or shapes differ from what ``cfg`` builds, checked
    on the meta device, so that a config can never make the process allocate more than the
    weights it came with. ``file``: where the weights are (``path/model.safetensors``)."""
    file, config_file = file or path / WEIGHTS_FILE, path / CONFIG_FILE
    check_layer_count(cfg, shapes, file, config_file)
    model = meta_transformer(cfg, config_file, file, lora, quant)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    tied = {"tok_emb.weight", "lm_head.weight"} if cfg.tie_embeddings else set()
    problems = [
        f"{k} is {shapes[k]} in the file, the config builds {s}"
        for k, s in expected.items()
        if k in shapes and shapes[k] != s
    ]
    missing = [k for k in expected if k not in shapes and not (k in tied and tied & set(shapes))]
    problems += [f"{k} {expected[k]} is missing" for k in missing]
    problems += [
        f"{k} is in the file, the config has no such tensor" for k in shapes if k not in expected
    ]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ValueError(f"{file} does not match {config_file}: {'; '.join(problems[:3])}{more}")


def load_weights(model: torch.nn.Module, path: str | Path) -> None:
    """Fill ``model``'s parameters from ``path/model.safetensors`` in place (strict: every
    parameter present, no unknown tensor); tied parameters stay tied. Weights that are not
    finite (NaN/inf) are refused: nothing useful can be computed from them."""
    file = Path(path) / WEIGHTS_FILE
    if not file.exists():
        raise missing_file(file)
    read_safetensors_header(file)  # a damaged file is named here, not deep in the loader
    _load_into(unwrap(model), file)


def _load_into(model: torch.nn.Module, file: Path) -> None:
    first = next(iter(model.parameters()), None)
    device = str(first.device) if first is not None else "cpu"
    try:
        load_model(model, str(file), strict=True, device=device)
    except FileNotFoundError:  # deleted since it was checked: not a mismatch
        raise missing_file(file) from None
    except OSError as e:
        raise OSError(f"{file} could not be read: {one_line(e)}") from None
    except RuntimeError as e:  # names/shapes that don't match the model's config
        msg = " ".join(str(e).split())
        raise ValueError(f"{file} does not match the model its config describes: {msg}") from None
    check_finite(model.state_dict(), file)


# float types the weights may be read in; float8 weights come with scales this project does not read
WEIGHT_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_finite(tensors: dict[str, torch.Tensor], file: Path) -> None:
    """Refuse tensors holding NaN or inf, naming the first such tensor and how many values, and
    tensors of another float type (float8) in one line."""
    for name, t in tensors.items():
        if t.is_floating_point() and t.dtype not in WEIGHT_FLOATS:
            kinds = ", ".join(str(d).removeprefix("torch.") for d in WEIGHT_FLOATS)
            raise ValueError(
                f"{file}: tensor {name} is {str(t.dtype).removeprefix('torch.')}; weights are "
                f"read as {kinds} (an FP8 checkpoint needs its scales: use a bf16 or fp32 copy "
                "of the model)"
            )
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise ValueError(
                f"{file}: tensor {name} holds {bad:,} non-finite values (NaN/inf) of "
                f"{t.numel():,}; the weights are corrupt (a diverged run?): use an earlier "
                "checkpoint"
            )


def load_checkpoint(
    path: str | Path, device: str | torch.device = "cpu", merge: bool = True
) -> Transformer:
    """Build the ``Transformer`` saved in directory ``path`` and load its weights; eval mode.
    The config is checked against the weight file's header on the meta device first, so the
    model is materialised only at the size of the weights that are there. LoRA adapters saved
    with it are rebuilt and, with ``merge``, folded into their base weights (a plain model, as
    exports and ``quantize`` need: ``models.lora.fold_lora``)."""
    path = Path(path)
    cfg = read_config(path)
    lora, quant = read_lora(path), read_quantization(path)
    file = path / WEIGHTS_FILE
    if not file.exists() and is_dcp(path):  # a sharded training checkpoint's weights
        shapes = dcp_shapes(path / DCP_DIR, DCP_MODEL)
        check_weights_fit(cfg, shapes, path, lora, quant, path / DCP_DIR)
        model = build(cfg, lora, quant).to(device)
        # the state dict's tensors share the parameters' storage: DCP fills them in place
        load_dcp(path / DCP_DIR, {DCP_MODEL: stored_once(model, model.state_dict())})
        check_finite(model.state_dict(), path / DCP_DIR)
    else:
        if not file.exists():
            raise missing_file(file)
        check_weights_fit(cfg, read_safetensors_header(file), path, lora, quant)
        model = build(cfg, lora, quant).to(device)
        _load_into(model, file)
    if merge:
        fold_lora(model)
    return model.eval()


# ----------------------------------------------------------------------------------------------
# Sharded checkpoints (torch.distributed.checkpoint): read with or without a process group


def stored_once(model: torch.nn.Module, sd: dict) -> dict:
    """``sd`` without the second names of tied parameters (``lm_head.weight`` when it is
    ``tok_emb.weight``): a shared tensor is stored once, in DCP's files as in safetensors."""
    seen, again = set(), set()
    for name, p in unwrap(model).named_parameters(remove_duplicate=False):
        if id(p) in seen:
            again.add(name)
        seen.add(id(p))
    return {k: v for k, v in sd.items() if k not in again}


def is_dcp(path: str | Path) -> bool:
    """Whether checkpoint directory ``path`` keeps its tensors in DCP's sharded files."""
    return (Path(path) / DCP_DIR).is_dir()


# What DCP's .metadata pickle holds (torch 2.4-2.13): its dataclasses, sizes, dtypes, layouts
# and a path. BytesStorageMetadata is left out on purpose: it makes the loader torch.load an
# entry with weights_only=False, and our checkpoints hold tensors only.
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_METADATA_CLASSES = {
    (_DCP_METADATA, "Metadata"),
    (_DCP_METADATA, "TensorStorageMetadata"),
    (_DCP_METADATA, "ChunkStorageMetadata"),
    (_DCP_METADATA, "TensorProperties"),
    (_DCP_METADATA, "MetadataIndex"),
    (_DCP_METADATA, "StorageMeta"),
    (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in _METADATA_CLASSES or dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def read_dcp_metadata(path: str | Path):
    """DCP's index of the sharded checkpoint directory ``path`` (its ``.metadata``), unpickled
    with DCP's metadata classes alone; errors are one line naming the file."""
    file = Path(path) / ".metadata"
    if not file.is_file():
        raise FileNotFoundError(
            f"{file} is missing: {path} is not a complete sharded (DCP) checkpoint (its writer "
            "stopped before the end?)"
        )
    try:
        with open(file, "rb") as f:
            return _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as e:
        raise ValueError(
            f"{file} refers to {e}, which DCP's checkpoint metadata never does; not loaded (only "
            "DCP's own metadata classes are read from it)"
        ) from None
    except (EOFError, ValueError, TypeError, AttributeError) as e:
        raise ValueError(
            f"{file} is damaged ({one_line(e)}): not DCP checkpoint metadata"
        ) from None


def dcp_shapes(path: str | Path, prefix: str = "") -> dict[str, tuple[int, ...]]:
    """Every whole tensor's shape in the sharded checkpoint ``path``: the names under ``prefix``
    (``prefix.`` dropped), or all of them."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    lead = f"{prefix}." if prefix else ""
    return {
        key[len(lead) :]: tuple(md.size)
        for key, md in read_dcp_metadata(path).state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata) and key.startswith(lead)
    }


@cache
def _reader_class():
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        """DCP's file reader, its metadata read by ``read_dcp_metadata``."""

        def read_metadata(self, *args, **kwargs):
            if kwargs.get("rank") is not None:  # per-rank metadata: a layout we never write
                raise ValueError(f"{self.path}: per-rank DCP metadata is not supported")
            metadata = read_dcp_metadata(self.path)
            if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader does
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader


def load_dcp(path: str | Path, state_dict: dict, process_group=None) -> None:
    """Fill ``state_dict``'s tensors (nested dicts of tensors, DTensor shards included: each
    rank reads what its shards hold) in place from the sharded checkpoint ``path``. Without a
    process group (none initialised) one process reads everything. A tensor missing from the
    checkpoint or of another shape is one line naming it."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    check_dcp_files(path, {str(key).split(".")[0] for key in state_dict})
    reader = _reader_class()(path)
    alone = not (dist.is_available() and dist.is_initialized())
    try:
        with warnings.catch_warnings():  # "torch.distributed is disabled ... single process"
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(state_dict, storage_reader=reader, process_group=process_group,
                     no_dist=alone)  # fmt: skip
    except (CheckpointException, RuntimeError, KeyError, AssertionError) as e:
        raise ValueError(
            f"{path}: the sharded checkpoint does not fit ({dcp_failure(e)})"
        ) from None


def check_dcp_files(path: str | Path, parts: set[str]) -> None:
    """Refuse, in one line naming the file, a sharded checkpoint ``path`` whose data files that
    hold ``parts`` (the first components of names: ``model``, ``optim``) are missing or shorter
    than the data its ``.metadata`` places in them."""
    need: dict[str, int] = {}
    for index, info in read_dcp_metadata(path).storage_data.items():
        if index.fqn.split(".")[0] not in parts:
            continue
        end = info.offset + info.length
        need[info.relative_path] = max(need.get(info.relative_path, 0), end)
    missing = sorted(name for name in need if not (Path(path) / name).is_file())
    if missing:
        raise FileNotFoundError(
            f"{path}: the sharded checkpoint is incomplete: {Path(path) / missing[0]} is missing "
            f"({len(missing)} of the {len(need)} data files it reads from are gone)"
        )
    for name, end in sorted(need.items()):
        size = (Path(path) / name).stat().st_size
        if size < end:
            raise ValueError(
                f"{path}: the sharded checkpoint is incomplete: {Path(path) / name} holds "
                f"{size:,} bytes, its index places data up to byte {end:,} (cut short)"
            )


def dcp_failure(e: BaseException) -> str:
    """What went wrong in a DCP save or load, on one line: each failing rank's error (DCP's own
    exception lists them with tracebacks)."""
    failures = getattr(e, "failures", None)
    if not isinstance(failures, dict):
        return one_line(f"{type(e).__name__}: {e}")
    return "; ".join(
        f"rank {rank}: {one_line(f'{type(exc).__name__}: {exc}')}"
        for rank, (exc, _) in sorted(failures.items())
    )


def read_dcp_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the sharded checkpoint ``path`` whole, on the CPU, by its flat name
    (``model.<name>``, ...): one process, no process group."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    tensors = {
        key: torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for key, md in read_dcp_metadata(path).state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }
    load_dcp(path, tensors)
    return tensors
