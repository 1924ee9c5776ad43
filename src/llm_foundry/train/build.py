"""A training run's model and data, built as the trainer, the ablation runner and the benchmarks
build them: plain functions of the configs.

The other pieces of a run have their own builders, in the module that owns each concern:
``optim.build_optimizer`` (AdamW or Muon's groups, and ``set_lr``), ``precision.choose_precision``
(the dtype, autocast and Newton-Schulz precision, one decision for all ranks),
``distributed.init_world`` and ``distributed.wrap`` (processes and DDP / FSDP2 / TP), and
``memory.check_training_memory`` (the refusal of a run that cannot fit, before the model exists).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from llm_foundry.config import ConfigError, ModelConfig
from llm_foundry.data.loader import Loader, PreparedSplit, Source
from llm_foundry.data.sft import SFTSampler
from llm_foundry.loading import load_any
from llm_foundry.models import Transformer
from llm_foundry.models.fp8 import convert_to_fp8
from llm_foundry.models.lora import add_lora
from llm_foundry.models.position import position_traits
from llm_foundry.rundir import checkpoint_dir
from llm_foundry.train.config import TrainConfig
from llm_foundry.train.distributed import World

log = logging.getLogger(__name__)


def model_config_for_data(mc: ModelConfig, tc: TrainConfig, meta: dict, data_dir: Path):
    """``mc`` as it trains on the data ``meta`` describes: its vocabulary the tokenizer's (with a
    note when the config said otherwise). Refuses a ``tc.block_size`` past ``mc.max_seq_len``, and
    packed fine-tuning rows where the data is plain text, packed text rows where it is fine-tuning
    rows, and either with document masking where the positions are absolute."""
    if tc.block_size > mc.max_seq_len:
        raise ValueError(
            f"train.block_size={tc.block_size} is past model.max_seq_len={mc.max_seq_len} (the "
            "context the model is built for): lower train.block_size or raise model.max_seq_len"
        )
    if mc.vocab_size != meta["vocab_size"]:
        # said once, not by every torchrun rank; not over init_from's weights, whose vocabulary
        # the data must have (load_initial_weights refuses it, naming both)
        if int(os.environ.get("RANK", "0")) == 0 and not tc.init_from:
            log.info(
                f"note: model.vocab_size set to {meta['vocab_size']} "
                f"(the tokenizer in {data_dir}; the config said {mc.vocab_size})"
            )
        mc = mc.replace(vocab_size=meta["vocab_size"])
    if tc.sft_packing and not is_sft(meta):
        raise ValueError(
            f"train.sft_packing needs fine-tuning data (prepare --sft); {data_dir} is text"
        )
    packed = tc.data_sampling == "packed"
    if packed and is_sft(meta):
        raise ValueError(
            f"train.data_sampling=packed packs text documents; {data_dir} holds fine-tuning rows: "
            "use train.sft_packing=true"
        )
    masked = tc.sft_packing or (packed and tc.document_mask)
    if masked and position_traits(mc).absolute:
        field = "train.sft_packing" if tc.sft_packing else "train.document_mask"
        raise ConfigError(
            [f"pos_encoding={mc.pos_encoding!r}: packed documents would see absolute "
             "positions past their start; packing needs rope, alibi or none"
             + ("" if tc.sft_packing else " (or train.document_mask=false)")],
            field,
        )  # fmt: skip
    return mc


def is_sft(meta: dict) -> bool:
    """Whether the data is fine-tuning rows (whole examples, prompts masked) rather than text."""
    return meta.get("kind") == "sft"


def build_model(
    mc: ModelConfig,
    tc: TrainConfig,
    device: torch.device,
    init_from: bool = True,
    tokenizer: Path | None = None,
) -> Transformer:
    """The model a run of ``tc`` trains, on ``device``: initial weights drawn after seeding
    ``tc.seed`` (every rank builds the same), then ``tc.init_from``'s weights unless
    ``init_from`` is false (a resumed run takes its checkpoint's; ``tokenizer``: the data's
    tokenizer file, which must be the model's), then LoRA adapters on the frozen base
    (``tc.lora_r``), activation checkpointing, the fused loss and fp8 products as ``tc`` asks."""
    torch.manual_seed(tc.seed)
    model = Transformer(mc).to(device)
    if tc.init_from and init_from:
        load_initial_weights(model, Path(tc.init_from), tokenizer)
    if tc.lora_r:  # the base frozen: only the adapters train
        add_lora(model, tc.lora_targets.split(","), r=tc.lora_r, alpha=tc.lora_alpha,
                 dropout=tc.lora_dropout, rslora=tc.lora_rslora,
                 base_dtype=tc.lora_base_dtype)  # fmt: skip
    model.activation_checkpointing = tc.activation_checkpointing
    model.fused_loss = tc.fused_loss
    if tc.dtype == "fp8":  # the blocks' linear layers multiply in float8 (models/fp8.py)
        convert_to_fp8(model)
    return model


PREPARE_WITH = ("prepare --input FILES --tokenizer-from MODEL (chat/SFT rows: prepare --sft ROWS "
                "--tokenizer-from MODEL)")  # fmt: skip


def load_initial_weights(model: Transformer, path: Path, tokenizer: Path | None = None,
                         say: bool = True) -> None:  # fmt: skip
    """Put the weights in ``path`` on ``model``: a run, one of our checkpoints (LoRA adapters
    merged) or an HF transformers directory, read by the one loader (``loading.load_any``). The
    model must be the one they were saved from, up to settings no weight depends on (a longer
    context for relative positions), and the data's ``tokenizer`` file (when given) the one the
    weights were trained with (``same_tokenizer``); quantized weights cannot be trained. A LoRA
    run's adapters are merged, said in a line unless not ``say`` (a second copy)."""
    checkpoint_dir(path, "train.init_from")  # a path that names no checkpoint: said as such
    # a run is read through its latest checkpoint, resolved again if training replaces it
    loaded = load_any(path, full_precision="train.init_from")
    source = loaded.model
    diff = model.cfg.weight_differences(source.cfg)
    if diff:
        hint = ""
        if source.cfg.vocab_size != model.cfg.vocab_size:
            how = PREPARE_WITH.replace("MODEL", str(path))
            hint = f"; the data must be tokenized with that model's tokenizer: {how}"
        raise ConfigError(diff, f"train.init_from {path} holds another model{hint}")
    theirs = loaded.info.checkpoint / "tokenizer.json"
    if tokenizer is not None and not same_tokenizer(theirs, loaded.tokenizer, Path(tokenizer)):
        char = getattr(loaded.tokenizer, "kind", None) == "char"
        how = ("a character model's ids number the characters of its training text: prepare "
               "text of that same set of characters" if char
               else "tokenize the data with the model's tokenizer: "
                    + PREPARE_WITH.replace("MODEL", str(path)))  # fmt: skip
        raise ValueError(
            f"train.init_from {path}: its tokenizer ({theirs}) is not the one "
            f"{Path(tokenizer).parent} was prepared with, though both have "
            f"{model.cfg.vocab_size:,} ids: the same id would stand for another token; {how}"
        )
    with torch.no_grad():
        model.load_state_dict(source.state_dict())
    if say and loaded.info.lora:  # a LoRA run starts this one with its adapters merged
        log.info(loaded.info.merged_note())


def same_tokenizer(file: Path, tok, data_file: Path) -> bool:
    """Whether the tokenizer of a model (its ``file``, loaded as ``tok``; None: it has none)
    is the one in ``data_file``: byte for byte (the copy ``prepare --tokenizer-from`` keeps),
    else by what it maps: a character tokenizer's alphabet (ours, or the HF form ``convert
    --to-hf`` writes), an HF tokenizers file's canonical JSON. Where either side has no
    tokenizer file there is nothing to tell them apart: True."""
    if tok is None or not file.is_file() or not data_file.is_file():
        return True
    from llm_foundry.tokenizer import load_any_tokenizer

    try:
        if file.read_bytes() == data_file.read_bytes():
            return True
        theirs = load_any_tokenizer(data_file)
    except (OSError, ValueError):  # gone (a run's pruned step) or unreadable: said elsewhere
        return True
    return tokenizer_identity(tok) == tokenizer_identity(theirs)


def tokenizer_identity(tok) -> tuple:
    """What a tokenizer maps, comparable across its file formats: (kind, alphabet) of a
    character tokenizer, ("tokenizers", canonical JSON) of a byte-level BPE or HF one."""
    if getattr(tok, "kind", None) == "char":
        return "char", tok.chars
    return "tokenizers", tok.hf.to_str()


def build_sampler(
    sources: list[Source],
    split: str,
    tc: TrainConfig,
    seed: int,
    world: World | None = None,
    sft: bool = False,
    corpora: list[PreparedSplit] | None = None,
) -> Loader | SFTSampler:
    """The batches of ``split``, seeded by ``seed``, this data-parallel rank's share of them:
    random windows or packed documents of the sources' shards, each row's source drawn by weight
    (``corpora``: their ``split`` already opened), or whole fine-tuning examples of the one
    source (``sft``; packed as ``tc.sft_packing`` says)."""
    rank, size = (world.dp_rank, world.dp_size) if world is not None else (0, 1)
    if sft:
        return SFTSampler(sources[0].dir, split, tc.block_size, tc.batch_size, seed,
                          rank=rank, world_size=size, pack=tc.sft_packing)  # fmt: skip
    corpora = corpora if corpora is not None else [PreparedSplit(s.dir, split) for s in sources]
    return Loader(corpora, [s.weight for s in sources], tc.block_size, tc.batch_size, seed,
                  rank=rank, world_size=size, packed=tc.data_sampling == "packed",
                  document_mask=tc.document_mask,
                  main_rank=world is None or world.main)  # rank 0 notes (dp_rank 0 is many under TP)  # fmt: skip
