"""TrainConfig: every training knob. Defaults are nanoGPT's documented CPU recipe for
tinyshakespeare (block 64, batch 12, lr 1e-3 cosine to 1e-4 over 2000 steps, 100 warmup,
AdamW betas (0.9, 0.99), weight decay 0.1, clip 1.0)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from llm_foundry.config import ConfigError, count_problem, from_fields, is_int, is_number, one_of
from llm_foundry.data.loader import SAMPLING
from llm_foundry.messages import shown
from llm_foundry.models.lora import BASE_DTYPES as LORA_BASE_DTYPES
from llm_foundry.models.lora import TARGETS as LORA_TARGETS
from llm_foundry.models.sdpa_kernels import SDPA_BACKENDS
from llm_foundry.train.dpo import LOSSES as DPO_LOSSES
from llm_foundry.train.optim import OPTIMIZERS
from llm_foundry.train.schedule import SCHEDULES
from llm_foundry.train.tensor_parallel import settings_problems

DTYPES = ("fp32", "bf16", "fp16", "fp8", "auto")
DEVICES = ("auto", "cpu", "cuda", "mps")
ON_NONFINITE = ("stop", "skip")
PARALLEL = ("none", "ddp", "fsdp", "tp", "fsdp+tp")
CHECKPOINT_FORMATS = ("full", "dcp", "dcp-async")
TASKS = ("lm", "dpo")  # next-token loss (text, SFT rows) | preference pairs (train/dpo.py)
DPO_REFERENCES = ("model", "precomputed")


# seeds torch and numpy accept, with room for the offsets added to them (an ablation's seed
# index, the validation sampler's + 1)
SEED_MAX = 2**62


def fused_loss_problems(tc) -> list[str]:
    """Why ``fused_loss`` cannot run with the rest of ``tc`` (fields of any type), one line each:
    it needs the head's whole weight (tensor parallelism splits it by vocabulary and computes
    the loss on its shards) and a plain linear head (not LoRA-adapted)."""
    p = []
    if isinstance(tc.parallel, str) and "tp" in tc.parallel:
        p.append(f"fused_loss=true with parallel={tc.parallel!r}: tensor parallelism computes the "
                 "loss on vocabulary shards already; use fused_loss=false, or ddp / fsdp")  # fmt: skip
    targets = tc.lora_targets.split(",") if isinstance(tc.lora_targets, str) else []
    if is_int(tc.lora_r) and tc.lora_r > 0 and "lm_head" in targets:
        p.append("fused_loss=true with lm_head in lora_targets: the fused loss needs a plain "
                 "linear head; leave lm_head out of lora_targets, or fused_loss=false")  # fmt: skip
    return p


def dpo_problems(tc) -> list[str]:
    """What is wrong with ``tc``'s task and DPO settings (fields of any type), one line each."""
    p: list[str] = []
    one_of(p, "task", tc.task, TASKS)
    one_of(p, "dpo_loss", tc.dpo_loss, tuple(DPO_LOSSES))
    one_of(p, "dpo_reference", tc.dpo_reference, DPO_REFERENCES)
    if not is_number(tc.dpo_beta) or not 0 < tc.dpo_beta < math.inf:
        p.append(f"dpo_beta={shown(tc.dpo_beta)} must be a number > 0")
    eps = tc.dpo_label_smoothing
    if not is_number(eps) or not 0 <= eps < 0.5:
        p.append(f"dpo_label_smoothing={shown(eps)} must be a number in [0, 0.5)")
    elif eps and tc.dpo_loss == "ipo":
        p.append(f"dpo_label_smoothing={eps} with dpo_loss='ipo': IPO has no label smoothing; "
                 "use sigmoid (conservative DPO) or robust, or dpo_label_smoothing=0")  # fmt: skip
    if tc.task != "dpo":
        return p
    if tc.parallel not in ("none", "ddp"):
        p.append(f"task='dpo' with parallel={shown(tc.parallel)}: the reference model is whole "
                 "on every rank; use parallel=ddp or none")  # fmt: skip
    if tc.fused_loss is True:
        p.append("task='dpo' with fused_loss=true: DPO sums each sequence's log-probabilities "
                 "from the logits; use fused_loss=false")  # fmt: skip
    if tc.sft_packing is True or tc.data_sampling == "packed":
        p.append("task='dpo' with packed rows: each row is one prompt and completion; set "
                 "sft_packing=false and data_sampling=windows")  # fmt: skip
    return p


@dataclass
class TrainConfig:
    """Optimisation, evaluation, checkpointing and runtime settings of one training run."""

    batch_size: int = 12  # sequences per micro-batch (per rank when distributed)
    block_size: int = 64  # tokens per sequence
    grad_accum: int = 1  # micro-batches per optimizer step
    max_steps: int = 2000  # optimizer steps
    lr: float = 1e-3  # peak learning rate
    min_lr: float = 1e-4  # floor of the decay
    warmup_steps: int = 100  # linear warmup from 0 to lr
    schedule: str = "cosine"  # cosine | linear | constant | wsd (warmup-stable-decay)
    decay_frac: float = 0.2  # wsd: fraction of max_steps spent decaying at the end
    # AdamW's decoupled decay: on weight matrices, not embedding tables, norms or biases (with
    # optimizer muon, its AdamW group decays the embedding tables too)
    weight_decay: float = 0.1
    optimizer: str = "adamw"  # adamw | muon (Muon on the blocks' 2-D weights, AdamW on the rest)
    muon_lr: float = 0.02  # Muon's peak lr, on the same schedule as lr
    muon_momentum: float = 0.95
    muon_weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    eval_interval: int = 250  # steps between validation passes
    eval_batches: int = 20  # global batches (batch_size x grad_accum x ranks) per validation pass
    # steps between checkpoints; one at the end too, and one at each evaluation that improves
    # the best validation loss (the best weights are always on disk)
    checkpoint_interval: int = 500
    keep_last: int = 2  # checkpoints kept besides the best-by-validation one
    # full: whole tensors in safetensors (sharded runs gather them to rank 0) | dcp: each rank
    # writes its own shards (torch.distributed.checkpoint, train/dcp.py) | dcp-async: dcp
    # written in the background while training goes on. Any layout resumes from either.
    checkpoint_format: str = "full"
    seed: int = 1337
    # fp32 | bf16 (autocast) | fp16 (autocast + scaler) | fp8 (bf16 autocast, the blocks' linear
    # layers multiplying in float8: GPUs of compute capability 8.9+, models/fp8.py) | auto: bf16
    # if fast
    dtype: str = "fp32"
    compile: bool = False  # torch.compile the model
    # with torchrun: ddp (replicas) | fsdp (FSDP2 shards) | tp (each matrix split over all
    # ranks) | fsdp+tp (FSDP2 across groups of tp_size tensor-parallel ranks); batch_size is per
    # data-parallel rank (a tensor-parallel group shares its batch)
    parallel: str = "none"
    tp_size: int = 0  # ranks per tensor-parallel group; 0: every rank (tp), 2 (fsdp+tp)
    activation_checkpointing: bool = False  # recompute each block's activations in backward
    # the output head and cross-entropy in chunks of rows, gradients taken as it goes
    # (models/loss.py): the (tokens, vocab) logits are never held; training and validation only
    fused_loss: bool = False
    # the kernel attention runs in training: auto (PyTorch picks) | flash | efficient | cudnn |
    # math, for measuring which is fastest on a card (models/sdpa_kernels.py)
    sdpa_backend: str = "auto"
    device: str = "auto"  # auto | cpu | cuda | mps
    on_nonfinite: str = "stop"  # stop (with a message) | skip the step and count it
    sample_tokens: int = 300  # characters/tokens of sample text printed at the end (0: none)
    tensorboard: bool = False  # also log metrics to TensorBoard (needs the tensorboard extra)
    progress: bool = True  # show a progress bar
    # training dynamics (llm_foundry.train.monitor; plot them with `llm-foundry inspect dynamics`)
    monitor_interval: int = 0  # record entropy/ranks/grad norms every N steps and at step 1; 0 off
    # Warn when a head's mean attention entropy (nats) falls below this; 0 never warns. 0.1 nats
    # is a head putting ~98% of every row on one key, i.e. entropy collapse (Zhai et al. 2023):
    # uniform causal attention over a 64-token block is ~3.2 nats, and even a sharp healthy
    # head (previous token) keeps some mass elsewhere, so it rarely fires on a working run.
    monitor_entropy_min: float = 0.1
    # Warn when an effective rank (W_q, W_k, hidden states) falls below this fraction of its full
    # rank; 0 never warns. A random square init sits at ~0.8, so 0.1 means real collapse.
    monitor_rank_frac: float = 0.1
    # fine-tuning: start from a checkpoint's weights, and train low-rank adapters only (LoRA)
    init_from: str | None = None  # run, checkpoint or HF directory whose weights start training
    lora_r: int = 0  # adapter rank; 0 trains every weight
    lora_alpha: float = 16.0  # adapter scale alpha / r (alpha / sqrt(r) with lora_rslora)
    lora_dropout: float = 0.0  # dropout on the adapters' input
    lora_targets: str = "wq,wv"  # comma list of projections: wq, wk, wv, wo, w1, w2, w3, lm_head
    lora_rslora: bool = False  # rank-stabilised scale (Kalajdzievski 2023)
    # the adapted projections' frozen weights: fp32 | bf16 | int8 | int4 | nf4 (QLoRA's 4-bit
    # NormalFloat, models/nf4.py); models/lora.py BASE_DTYPES
    lora_base_dtype: str = "fp32"
    sft_packing: bool = False  # SFT data: fill rows with whole examples, attention kept in each
    # text data (llm_foundry.data.loader): random windows of the shards, or rows packed with
    # whole documents in a seeded order (the row's last one cut; needs the shards' .idx indexes)
    data_sampling: str = "windows"  # windows | packed
    document_mask: bool = True  # packed rows: attention and targets kept inside each document
    prefetch: int = 2  # batches built ahead in a background thread; 0 builds each in the step
    # preference tuning (train/dpo.py): dpo trains on preference pairs against a frozen reference
    task: str = "lm"  # lm: next-token loss (text or SFT rows) | dpo: preference pairs
    dpo_beta: float = 0.1  # how far from the reference the policy may go (higher: less)
    dpo_loss: str = "sigmoid"  # sigmoid (DPO) | robust (rDPO) | ipo (IPO)
    dpo_label_smoothing: float = 0.0  # sigmoid: conservative DPO's eps; robust: the flip rate
    # model: the starting weights (LoRA: adapters off) score every batch | precomputed: their
    # log-probs computed once for every pair and stored in the run directory
    dpo_reference: str = "model"

    def __post_init__(self) -> None:
        p: list[str] = []
        for name in ("batch_size", "block_size", "grad_accum", "max_steps", "eval_batches"):
            count_problem(p, name, getattr(self, name), "a positive integer")
        for name in (
            "warmup_steps",
            "eval_interval",
            "checkpoint_interval",
            "keep_last",
            "monitor_interval",
            "sample_tokens",
            "lora_r",
            "tp_size",
            "prefetch",
        ):
            count_problem(p, name, getattr(self, name), "a non-negative integer", low=0)
        seed = self.seed
        if not (is_int(seed) and 0 <= seed <= SEED_MAX):
            p.append(f"seed={shown(seed)} must be an integer in [0, 2**62]")
        for f in dataclasses.fields(self):
            if f.type == "bool" and not isinstance(getattr(self, f.name), bool):
                p.append(f"{f.name}={shown(getattr(self, f.name))} must be true or false")
        one_of(p, "schedule", self.schedule, SCHEDULES)
        one_of(p, "dtype", self.dtype, DTYPES)
        one_of(p, "device", self.device, DEVICES)
        one_of(p, "on_nonfinite", self.on_nonfinite, ON_NONFINITE)
        one_of(p, "parallel", self.parallel, PARALLEL)
        one_of(p, "checkpoint_format", self.checkpoint_format, CHECKPOINT_FORMATS)
        one_of(p, "optimizer", self.optimizer, OPTIMIZERS)
        one_of(p, "sdpa_backend", self.sdpa_backend, tuple(SDPA_BACKENDS))
        one_of(p, "data_sampling", self.data_sampling, SAMPLING)
        if self.data_sampling == "packed" and self.sft_packing is True:
            p.append("data_sampling='packed' with sft_packing=true: data_sampling is for text "
                     "and sft_packing for fine-tuning rows; set the one your data needs")  # fmt: skip
        parallel = self.parallel if self.parallel in PARALLEL else "none"  # named above if not
        p += settings_problems(self, parallel)  # what tensor parallelism cannot train with
        if self.optimizer == "muon" and self.dtype == "fp16":
            p.append("optimizer='muon' with dtype='fp16': the fp16 grad scaler steps AdamW only; "
                     "use dtype=bf16 or fp32")  # fmt: skip
        # (field, allowed range as a test, the range in words)
        ranges = (
            ("lr", lambda v: v > 0, "> 0"),
            (
                "min_lr",
                lambda v: 0 <= v <= self.lr if is_number(self.lr) else v >= 0,
                f"in [0, lr={self.lr}]",
            ),
            ("decay_frac", lambda v: 0 < v <= 1, "in (0, 1]"),
            ("beta1", lambda v: 0 <= v < 1, "in [0, 1)"),
            ("beta2", lambda v: 0 <= v < 1, "in [0, 1)"),
            ("weight_decay", lambda v: v >= 0, ">= 0"),
            ("muon_lr", lambda v: v > 0, "> 0"),
            ("muon_momentum", lambda v: 0 <= v < 1, "in [0, 1)"),
            ("muon_weight_decay", lambda v: v >= 0, ">= 0"),
            ("grad_clip", lambda v: v >= 0, ">= 0 (0 disables clipping)"),
            ("monitor_entropy_min", lambda v: 0 <= v < math.inf, "in [0, inf) nats"),
            ("monitor_rank_frac", lambda v: 0 <= v <= 1, "in [0, 1]"),
            ("lora_alpha", lambda v: v > 0, "> 0"),
            ("lora_dropout", lambda v: 0 <= v < 1, "in [0, 1)"),
        )
        for name, ok, valid in ranges:
            v = getattr(self, name)
            if not is_number(v) or not ok(v):
                p.append(f"{name}={shown(v)} must be a number {valid}")
        targets = self.lora_targets.split(",") if isinstance(self.lora_targets, str) else None
        if targets is None or not all(t in LORA_TARGETS for t in targets):
            p.append(
                f"lora_targets={shown(self.lora_targets)} must be a comma list of "
                f"{', '.join(LORA_TARGETS)}"
            )
        one_of(p, "lora_base_dtype", self.lora_base_dtype, LORA_BASE_DTYPES)
        low = self.lora_base_dtype != "fp32"  # held in less memory than trained
        if low and self.lora_r == 0:
            p.append(
                f"lora_base_dtype={self.lora_base_dtype!r} holds the adapted projections' frozen "
                "weights: it needs lora_r > 0 (set lora_r, or leave lora_base_dtype at fp32)"
            )
        if low and self.parallel == "fsdp":
            p.append(
                f"lora_base_dtype={self.lora_base_dtype!r} with parallel='fsdp': FSDP2 shards "
                "parameters of one dtype only; use parallel=ddp (or lora_base_dtype=fp32)"
            )
        if self.fused_loss is True:
            p += fused_loss_problems(self)
        if self.dtype == "fp8" and isinstance(self.parallel, str) and "tp" in self.parallel:
            p.append(f"dtype='fp8' with parallel={self.parallel!r}: the fp8 products take whole "
                     "weights, not tensor-parallel shards; use bf16, or ddp / fsdp")  # fmt: skip
        p += dpo_problems(self)
        if self.init_from is not None and not (isinstance(self.init_from, str) and self.init_from):
            p.append(f"init_from={shown(self.init_from)} must be a directory path or null")
        if p:
            raise ConfigError(p, name="TrainConfig")

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.block_size * self.grad_accum

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        """Build from a mapping; unknown keys are an error (a typo must not pass silently)."""
        return from_fields(cls, d)
