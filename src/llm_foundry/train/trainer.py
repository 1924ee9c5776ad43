"""The training loop: AdamW, schedule, clipping, evaluation, crash-safe checkpoints, exact resume.

One step = ``grad_accum`` micro-batches, one clip, one optimizer update; on fine-tuning (SFT) data
the step's loss is the mean over all its target tokens, whatever the ranks and micro-batches.
Everything a resumed run needs to continue bit for bit (weights, optimizer moments, RNG and
data-sampler states: those of the batches trained on, not of those the prefetch thread built
ahead) goes into each checkpoint; ``metrics.jsonl`` is cut back to the checkpoint's step on
resume, and its ``time`` (seconds trained) goes on from the checkpoint's. Settings given on resume
are the ones trained with: the optimizer's group settings (betas, weight decay, Muon's) are put
back on the loaded groups (``optim.apply_group_settings``). A subclass ends a run before
``max_steps`` by overriding ``should_stop`` (e.g. at a target loss): that step's checkpoint is the
last, and records why. With ``monitor_interval`` set, ``llm_foundry.train.monitor`` adds a
training-dynamics record every N steps. With ``task=dpo`` a micro-batch is B preference pairs and
its loss is DPO's (``train.dpo``) against a frozen reference (``train.reference``); the rewards
and margins are logged with each step and validation.
"""

from __future__ import annotations

import contextlib
import logging
import math
import platform
import signal
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import torch
from tqdm import tqdm

import llm_foundry
from llm_foundry import lock
from llm_foundry.checkpoint import is_dcp
from llm_foundry.config import ModelConfig
from llm_foundry.data import load_split
from llm_foundry.data.batches import IGNORE
from llm_foundry.data.loader import (
    Prefetch,
    PreparedSplit,
    parse_sources,
    source_metas,
    source_shares,
    sources_fingerprint,
    sources_text,
)
from llm_foundry.data.preference import PreferenceSampler, is_preference
from llm_foundry.models import Transformer
from llm_foundry.models.lora import apply_lora_settings, lora_settings
from llm_foundry.models.sdpa_kernels import check_sdpa_backend, model_probe, sdpa_backend
from llm_foundry.rundir import (
    METRICS,
    RUN_INFO,
    RunDir,
    latest_checkpoint,
    read_run_info,
    read_state,
    step_name,
)
from llm_foundry.train import distributed as D
from llm_foundry.train import tensor_parallel as TP
from llm_foundry.train.build import build_model, build_sampler, is_sft, model_config_for_data
from llm_foundry.train.config import TrainConfig
from llm_foundry.train.dcp import ShardedCheckpoints, load_sharded
from llm_foundry.train.dpo import STAT_NAMES, completion_lengths, preference_loss, sequence_logps
from llm_foundry.train.launch import launch_record
from llm_foundry.train.memory import check_training_memory
from llm_foundry.train.metrics import MetricsLog, tb_write, tensorboard
from llm_foundry.train.monitor import ExpertLoad, Monitor, layer_grad_norms, rest_grad_norm
from llm_foundry.train.notes import batch_note, dpo_shown, nonfinite, schedule_note, skipped_text
from llm_foundry.train.optim import (
    apply_group_settings,
    build_optimizer,
    group_settings,
    set_lr,
    skips_on_device,
    step_unless,
)
from llm_foundry.train.precision import choose_precision, recorded_dtype
from llm_foundry.train.reference import (
    REFERENCE_FILE,
    CountedReference,
    ModelReference,
    StoredReference,
    check_same_weights,
    frozen_copy,
    load_table,
    save_table,
    score_all,
    table_key,
    weights_id,
)
from llm_foundry.train.schedule import lr_at
from llm_foundry.train.state import (
    FileNotWritten,
    check_resumable,
    load_train_checkpoint,
    prune_checkpoints,
    read_train_checkpoint,
    save_train_checkpoint,
    set_rng_state,
    write_json_atomic,
)

log = logging.getLogger(__name__)


class TrainingDiverged(RuntimeError):
    """The loss or gradient norm became NaN/inf."""


@dataclass
class RunResult:
    step: int
    last_train_loss: float | None
    best_val_loss: float | None
    val_history: list = field(default_factory=list)
    interrupted: bool = False
    stopped_by: str | None = None  # the signal that stopped the run ("SIGINT", "SIGTERM")
    stopped_early: str | None = None  # why should_stop ended the run before max_steps
    skipped_steps: int = 0
    checkpoint: Path | None = None


class Trainer:
    """One training run in ``out_dir``: its pieces built from the configs (``train.build``,
    ``optim``, ``precision``, ``distributed``), then ``run`` steps, evaluates and checkpoints.
    ``data_dir``: a prepared directory, or a mixture ``a=0.7,b=0.3`` (``loader.parse_sources``)."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        train_cfg: TrainConfig,
        data_dir: str | Path,
        out_dir: str | Path,
        resume: bool = False,
    ):
        tc = self.tc = train_cfg
        self.sources = parse_sources(data_dir)
        # the first source's meta.json and tokenizer stand for all (a mixture has one tokenizer)
        self.data_dir, self.out = self.sources[0].dir, Path(out_dir)
        self.ckpt_root = RunDir(self.out).checkpoints
        self.meta = source_metas(self.sources)[0]
        self.mc = model_config_for_data(model_cfg, tc, self.meta, self.data_dir)
        self.sft = is_sft(self.meta)  # whole examples with masked prompts
        self.preference = is_preference(self.meta)  # pairs of completions (train.task=dpo)
        self._check_task(len(self.sources))
        # rows whose targets are partly ignored: a step's loss is weighed by targets, not rows
        self.weighted = self.sft or (tc.data_sampling == "packed" and tc.document_mask)
        self.world, self.device = D.init_world(D.resolve_device(tc.device), tc.parallel, tc.tp_size)
        if tc.parallel in D.SHARDED and not self.world.distributed:  # nothing to split it over
            log.info(f"note: train.parallel={tc.parallel} splits the model over the processes "
                     "torchrun starts (torchrun --nproc-per-node N -m llm_foundry train ...); "
                     "this one process holds and trains it whole")  # fmt: skip
        # a config that cannot fit is refused here, before the model is built
        check_training_memory(self.mc, tc, self.device, self.world)
        # a resumed run's weights come from its checkpoint, not init_from
        tokenizer = self.data_dir / self.meta.get("tokenizer_file", "tokenizer.json")
        self.model = build_model(self.mc, tc, self.device, init_from=not resume,
                                 tokenizer=tokenizer)  # fmt: skip
        # auto becomes bf16 or fp32 once, here; a resumed run keeps the dtype it started with
        recorded = recorded_dtype(self.out) if resume else None
        self.precision = choose_precision(tc, self.device, self.world, recorded)
        self.dtype, self.dtype_reason = self.precision.dtype, self.precision.reason
        self.amp_dtype = self.precision.autocast_dtype
        if tc.dtype == "auto" and self.world.main:
            log.info(self.dtype_reason)
        # RoPE tables built now, not on the first compiled step: that would trace a graph which
        # builds them and then a second that reads them, and a resumed run starts on the first
        self.model.pos.reserve(tc.block_size)
        if tc.sdpa_backend != "auto":  # a kernel that cannot run here is refused before training
            self._check_sdpa_backend()
        self.wrapped = D.wrap(self.model, tc.parallel, self.world, self.device, self.dtype,
                              tc.block_size)  # fmt: skip
        self.sharded = D.is_sharded(tc.parallel, self.world)
        # tensor parallelism: the loss is computed on vocabulary shards, forward and backward
        self.loss_context = TP.loss_context if self.world.tp > 1 else contextlib.nullcontext
        self.forward = torch.compile(self.wrapped) if tc.compile else self.wrapped
        self.optimizer = build_optimizer(self.model, tc, self.device, self.sharded,
                                         self.precision.ns_dtype)  # fmt: skip
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.dtype == "fp16")
        # fused AdamW may skip a non-finite step on the device (not under fp16's scaler, which
        # skips on its own): the host then reads the loss after queuing the step
        self.device_skip = not self.scaler.is_enabled()
        # dcp / dcp-async: every rank writes its own shards (train/dcp.py); full: rank 0 all
        self.dcp = None if tc.checkpoint_format == "full" else ShardedCheckpoints(
            self.ckpt_root, self.world, tc.checkpoint_format == "dcp-async", tc.keep_last
        )  # fmt: skip
        # text: every source's splits mapped once (shards checked); SFT rows: SFTSampler's own
        self.corpora = {} if self.sft or self.preference else {
            split: [PreparedSplit(s.dir, split) for s in self.sources] for split in ("train", "val")
        }  # fmt: skip
        self.val_data = (
            load_split(self.data_dir, "val")
            if self.sft or self.preference
            else self.corpora["val"][0].tokens
        )
        self.sampler = self._sampler("train", tc.seed)
        self.feed = self.sampler  # run() reads through a Prefetch of it
        # the validation split must hold a window too: fail now, not at the first evaluation
        val = [self._sampler("val", tc.seed + 1, k) for k in range(len(self.sources))]
        if (self.sft or self.preference) and self.world.main:
            self._say_cut(self.sampler, "training")
            self._say_cut(val[0], "validation")
        self.val_by_source: dict[str, float] = {}  # a mixture's last validation, per source
        if tc.monitor_interval and self.sharded:
            raise ValueError("train.monitor_interval needs whole weights: use parallel=ddp or none")
        self.monitor = None
        if tc.monitor_interval:  # its probe batch sized by the global batch
            self.monitor = Monitor.for_run(self.model, self.val_data, tc, self.device,
                                           write=tqdm.write, ranks=self.world.dp_size)  # fmt: skip
        interval = tc.monitor_interval or tc.eval_interval or tc.max_steps
        self.experts = ExpertLoad(self.model, interval, self.world, self.device)
        self.last_aux: torch.Tensor | None = None
        self.step = 0
        self.best_val = math.inf
        self.best_name: str | None = None
        self.skipped = 0
        # seconds the run trained before this process (a resumed run's, from its checkpoint)
        # and when this process's training began: metrics.jsonl's time runs on across resumes
        self.elapsed_before = 0.0
        self.t_start: float | None = None
        self.resumed_from: Path | None = None
        self.stopped_early: dict | None = None  # {step, reason} once should_stop ends the run
        # the signal that asked run() to stop: a second one is the same request (the command
        # holds it back while the checkpoint and summary are written)
        self.stop_signal: str | None = None
        self.data_id = sources_fingerprint(self.sources)
        # the loss of one micro-batch, by task: (loss, its statistics to log) (train/dpo.py)
        self.batch_loss = {"lm": self._lm_loss, "dpo": self._dpo_loss}[tc.task]
        self.last_stats: dict[str, float] = {}  # the last step's DPO statistics
        self.val_stats: dict[str, float] = {}  # the last validation's
        self.reference_weights: dict | None = None  # DPO's frozen copy: its weights_id
        if self.world.main:  # the run directory is this process's until run() ends
            lock.acquire(self.out, "run directory")
        try:
            self.reference = self._reference(resume) if tc.task == "dpo" else None
            if resume:
                self._resume()
            if self.world.main:
                self._write_run_info()
                self._say_muon_precision()
        except FileNotWritten as e:  # run.json: said with where the run stands
            self.release()
            raise e.at(self.step, self.resumed_from) from e
        except BaseException:
            self.release()
            raise

    def _check_task(self, n_sources: int) -> None:
        """train.task and the data must agree: DPO trains on one directory of preference pairs,
        from a starting model; the next-token loss on text or SFT rows."""
        where, tc = self.data_dir, self.tc
        if tc.task == "dpo" and (not self.preference or n_sources > 1):
            raise ValueError(f"train.task=dpo needs one directory of preference pairs; {where} "
                             "is not: `finetune --task dpo --data ROWS.jsonl` prepares the "
                             "rows")  # fmt: skip
        if tc.task != "dpo" and self.preference:
            raise ValueError(f"{where} holds preference pairs: train them with train.task=dpo "
                             "(finetune --task dpo)")  # fmt: skip
        if tc.task == "dpo" and not tc.init_from:
            raise ValueError("train.task=dpo needs the model to start from (and to stay near): "
                             "finetune --checkpoint DIR (train.init_from)")  # fmt: skip

    def _say_cut(self, s, split: str) -> None:
        """How many of the ``split`` sampler ``s``'s sequences are cut at block_size + 1 tokens,
        and how many examples or pairs that leaves with no target."""
        kind = "pairs" if self.preference else "examples"
        if s.cut or s.dropped:
            total = s.pairs if self.preference else len(s.offsets) - 1
            log.info(
                f"note: {s.cut} {split} sequences are longer than block_size + 1 = "
                f"{self.tc.block_size + 1} tokens and are cut; {s.dropped} of {total} {kind} keep "
                "no target and are left out"
            )

    def _reference(self, resume: bool):
        """The frozen reference of train.dpo_reference (train/reference.py): with LoRA the
        policy with its adapters off, else a frozen copy of the starting weights; precomputed:
        every pair scored now (a resumed run reads the table it stored)."""
        tc, path = self.tc, self.out / REFERENCE_FILE
        key = table_key(self.data_id, tc.block_size, self.dtype)
        if tc.dpo_reference == "precomputed" and resume:
            return StoredReference(load_table(path, key))
        frozen = None if tc.lora_r else frozen_copy(self.mc, tc.init_from, self.device)
        # a frozen copy is read from init_from again on resume: which weights those were
        self.reference_weights = weights_id(tc.init_from) if frozen is not None else None
        scorer = ModelReference(self.model, frozen, self._autocast)
        if tc.dpo_reference == "model":
            return scorer
        samplers = {split: self._sampler(split, tc.seed) for split in ("train", "val")}
        pairs = sum(s.pairs for s in samplers.values())
        with tqdm(total=pairs, desc="DPO reference", unit="pair", dynamic_ncols=True,
                  disable=not (tc.progress and self.world.main)) as bar:  # fmt: skip
            counted = CountedReference(scorer, bar, self.world.world_size)
            try:
                table = score_all(counted, samplers, tc.batch_size, self.device, world=self.world)
            except KeyboardInterrupt:  # nothing is kept of a partial table
                raise KeyboardInterrupt(
                    f"while precomputing the DPO reference log-probabilities ({counted.done:,} of "
                    f"{pairs:,} pairs scored; train.dpo_reference=precomputed): nothing was "
                    f"trained or saved; run the command again (the scoring starts over)"
                ) from None
        if self.world.main:
            save_table(path, table, key)
        return StoredReference(table)

    def release(self) -> None:
        """Give up the run directory (``run`` does this when it ends)."""
        if self.world.main:
            lock.release(self.out)

    # ------------------------------------------------------------------------------------------
    def _resume(self) -> None:
        path = latest_checkpoint(self.ckpt_root)
        if path is None:
            raise FileNotFoundError(
                f"--resume: no checkpoint in {self.ckpt_root} (latest.json missing); "
                "start without --resume"
            )
        state = read_state(path)
        changed = check_resumable(
            state, path, self.mc, self.tc, self.data_id, sources_text(self.sources)
        )
        check_same_weights(state.get("reference_weights"), self.reference_weights,
                           self.tc.init_from, path)  # fmt: skip
        if changed and self.world.main:
            log.info("resuming with changed training settings: " + ", ".join(changed))
        for note in (batch_note(state, self.tc, self.world.dp_size), schedule_note(state, self.tc)):
            if note and self.world.main:
                log.info(note)
        given = group_settings(self.optimizer)  # this config's, put back on the loaded groups
        if is_dcp(path):  # each rank reads what its shards hold, in whatever layout it runs
            load_sharded(path, self.wrapped, self.optimizer, state["optimizer"])
            set_rng_state(state["rng"])
        elif self.sharded:  # every rank reads the full tensors and keeps its shard
            model_sd, optim_sd, state = read_train_checkpoint(path)
            D.load_full_state(
                self.model, self.optimizer, model_sd, optim_sd, self.tc.parallel, self.world
            )
        else:
            state = load_train_checkpoint(path, self.model, self.optimizer)
        apply_group_settings(self.optimizer, given)
        self.sampler.load_state_dict(state["sampler"])
        self.experts.load_state_dict(state.get("expert_counts"))
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.step = state["step"]
        best = state.get("best_val")  # None: saved before any evaluation
        self.best_val = math.inf if best is None else best
        self.best_name = state.get("best_name")
        self.skipped = state.get("skipped", 0)
        self.elapsed_before = state.get("elapsed", 0.0)  # absent before it was saved: from 0
        self.resumed_from = path
        if self.world.main:
            log.info(f"resumed from {path} at step {self.step}")
            early = state.get("stopped_early")
            if early and self.step < self.tc.max_steps:  # the caller's policy, not the run's end
                log.info(f"note: the run stopped early at step {self.step} ({early['reason']}); "
                         f"resuming trains it on to max_steps={self.tc.max_steps}")  # fmt: skip

    def _sampler(self, split: str, seed: int, source: int | None = None):
        """Random windows or packed documents of every source (``source``: of that one alone),
        whole fine-tuning examples (SFT data), or preference pairs."""
        pick = slice(None) if source is None else slice(source, source + 1)
        if self.preference:
            w = self.world
            return PreferenceSampler(self.data_dir, split, self.tc.block_size, self.tc.batch_size,
                                     seed, rank=w.dp_rank, world_size=w.dp_size)  # fmt: skip
        corpora = None if self.sft else self.corpora[split][pick]
        return build_sampler(self.sources[pick], split, self.tc, seed, self.world, self.sft,
                             corpora)  # fmt: skip

    def _say_muon_precision(self) -> None:
        """Log the precision of Muon's Newton-Schulz iteration, and why (after a resume: the
        checkpoint's)."""
        ns, here = self.muon_ns_dtype(), self.precision.ns_dtype
        if ns:
            reason = self.precision.support.reason
            why = (reason if ns == here else "kept from the checkpoint; "
                   f"this machine alone would use {here}: {reason}")  # fmt: skip
            log.info(f"muon: Newton-Schulz in {ns} ({why})")

    def muon_ns_dtype(self) -> str | None:
        """The precision of Muon's Newton-Schulz iteration ("bf16" or "fp32"); None without Muon."""
        groups = self.optimizer.param_groups
        return next((g["ns_dtype"] for g in groups if g.get("kind") == "muon"), None)

    def _write_run_info(self) -> None:
        """run.json: what the run trains with now, the command that started it (``argv``) and
        every command that started or resumed it, with its time and how it was launched
        (``commands``: ``launch``, train/launch.py)."""
        resumed = str(self.resumed_from.resolve()) if self.resumed_from else None
        now = dict(argv=sys.argv, launch=launch_record(),
                   time=datetime.now().astimezone().isoformat(timespec="seconds"),
                   resumed_from=resumed)  # fmt: skip
        before = read_run_info(self.out) if self.resumed_from else {}
        commands = before.get("commands")
        if not isinstance(commands, list):  # written before commands were kept: its one command
            commands = [dict(argv=before["argv"], time=None)] if "argv" in before else []
        info = dict(
            model=self.mc.to_dict(),
            train=self.tc.to_dict(),
            data=dict(dir=sources_text(self.sources), meta=self.meta),
            llm_foundry=llm_foundry.__version__,
            torch=torch.__version__,
            python=platform.python_version(),
            device=str(self.device),
            device_name=torch.cuda.get_device_name()
            if self.device.type == "cuda"
            else platform.processor() or platform.machine(),
            threads=torch.get_num_threads(),
            world_size=self.world.world_size,
            parallel=self.tc.parallel if self.world.distributed else "none",
            tensor_parallel=self.world.tp,  # ranks per tensor-parallel group
            argv=before.get("argv", sys.argv),  # the command that started the run
            commands=[*commands, now],
            params=self.model.num_params(),
            dtype=self.dtype,  # train.dtype resolved (auto -> bf16 | fp32); a resume keeps it
            dtype_reason=self.dtype_reason,
            muon_ns_dtype=self.muon_ns_dtype(),  # a resumed run keeps its optimizer state's
            resumed_from=resumed,
        )
        if len(self.sources) > 1:  # a mixture: each directory, its weight and share of the rows
            info["data"]["sources"] = [
                dict(dir=str(s.dir), name=s.name, weight=s.weight, share=share)
                for s, share in zip(self.sources, source_shares(self.sources), strict=True)
            ]
        write_json_atomic(self.out / RUN_INFO, info)

    # ------------------------------------------------------------------------------------------
    def _check_sdpa_backend(self) -> None:
        """Refuse, in one line, a train.sdpa_backend the model's attention does not call or that
        kernel cannot run here (found by running the model on a few tokens with it pinned)."""
        tc, mc = self.tc, self.mc
        if mc.attn_impl != "sdpa":
            raise ValueError(f"train.sdpa_backend={tc.sdpa_backend!r} pins a kernel of SDPA, which "
                             f"model.attn_impl={mc.attn_impl!r} does not call; use attn_impl=sdpa, "
                             "or leave sdpa_backend at auto")  # fmt: skip
        packed = tc.data_sampling == "packed" and tc.document_mask
        autocast = lambda: self.precision.autocast(self.device.type)  # noqa: E731
        dtype = str(self.amp_dtype or torch.float32).removeprefix("torch.")
        where = f"on {self.device.type} in {dtype}"
        check_sdpa_backend(tc.sdpa_backend, model_probe(self.model, self.device, autocast, packed),
                           where)  # fmt: skip

    @contextlib.contextmanager
    def _autocast(self):
        """The context a forward and its backward run in: autocast, and the attention kernel
        train.sdpa_backend pins."""
        with self.precision.autocast(self.device.type), sdpa_backend(self.tc.sdpa_backend):
            yield

    def should_stop(self) -> str | None:
        """Why to end the run after this step (a one-line reason), or None to go on: called at
        the end of every step before the last, after its evaluation when one is due. The default
        never stops; a subclass overrides it (a target loss, a time budget). A stop saves the
        step's checkpoint as the last one is saved and records the reason there and in the
        ``RunResult``; resuming the run trains on to max_steps. With several ranks the run stops
        when any rank's says so, every rank recording the lowest stopping rank's reason
        ("rank N: REASON", the reason alone when it is rank 0's)."""
        return None

    def evaluate(self) -> float:
        """Mean loss over ``eval_batches`` fixed validation batches (the same ones every time),
        each a global batch: batch_size x grad_accum x data-parallel ranks sequences, so the same
        weights score the same sequences and loss however the global batch is split between
        ranks and accumulation. A mixture: each source's own batches, and the mean of their
        losses weighted by the sources' shares (each one's in ``val_by_source``)."""
        if len(self.sources) == 1:
            return self._evaluate()
        losses = [self._evaluate(k) for k in range(len(self.sources))]
        self.val_by_source = {s.name: v for s, v in zip(self.sources, losses, strict=True)}
        return sum(w * v for w, v in zip(source_shares(self.sources), losses, strict=True))

    @torch.no_grad()
    def _evaluate(self, source: int | None = None) -> float:
        """The mean loss of ``source``'s validation batches (None: the run's sampler over all
        sources); each rank scores its share of every global batch in ``grad_accum``
        micro-batches of ``batch_size`` (a training step's memory), weighed as a step's are."""
        self.model.eval()
        w, tc = self.world, self.tc
        sampler = self._sampler("val", tc.seed + 1, source)
        total = torch.zeros((), device=self.device)
        stats = torch.zeros(len(STAT_NAMES), device=self.device)
        for _ in range(tc.eval_batches):
            batches = [[t.to(self.device) for t in sampler.next()] for _ in range(tc.grad_accum)]
            shares = self._target_shares([b[1] for b in batches]) if self.weighted else None
            for micro, batch in enumerate(batches):
                with self.loss_context(), self._autocast():
                    loss, st = self.batch_loss(batch, "val")
                    share = 1 / tc.grad_accum if shares is None else shares[micro]
                    total += loss.float() * share
                if st:
                    stats += torch.stack([st[k] for k in STAT_NAMES]) / tc.grad_accum
        self.model.train()
        if self.reference is not None:  # DPO: the rewards of the validation pairs too
            means = (D.mean(stats, w) / tc.eval_batches).tolist()
            self.val_stats = {f"val_{k}": v for k, v in zip(STAT_NAMES, means, strict=True)}
        return D.mean(total, w).item() / tc.eval_batches

    def _lm_loss(self, batch: list[torch.Tensor], split: str):
        """x, y (B, T) [, doc (B, T)] -> (the mean next-token loss over y's targets, {})."""
        x, y, *doc = batch
        return TP.local(self.forward(x, y, doc=doc[0] if doc else None)[1]), {}

    def _dpo_loss(self, batch: list[torch.Tensor], split: str):
        """x, y (2B, T), pairs (B,) of ``split`` -> (the mean DPO loss over the B pairs, its
        statistics: means over the pairs, detached)."""
        x, y, pairs = batch
        policy = sequence_logps(self.forward(x)[0], y)  # (2B,)
        reference = self.reference.logps(x, y, pairs, split)  # (2B,)
        tc = self.tc
        return preference_loss(policy, reference, completion_lengths(y), tc.dpo_loss,
                               tc.dpo_beta, tc.dpo_label_smoothing)  # fmt: skip

    def elapsed(self) -> float:
        """Seconds the run has trained: before this process (a resumed run's) and since
        ``run`` began here."""
        here = time.perf_counter() - self.t_start if self.t_start is not None else 0.0
        return self.elapsed_before + here

    def save(self, blocking: bool = True) -> Path:
        """Checkpoint the run at this step; a dcp-async save returns at once unless
        ``blocking`` (it is complete and named by latest.json once ``self.dcp`` commits it)."""
        state = dict(
            elapsed=self.elapsed(),  # metrics.jsonl's time of a resumed run goes on from it
            sampler=self.feed.state_dict(),  # the batches trained on
            scaler=self.scaler.state_dict() if self.scaler.is_enabled() else None,
            best_val=self.best_val if math.isfinite(self.best_val) else None,
            best_name=self.best_name,
            skipped=self.skipped,
            model_config=self.mc.to_dict(),
            train_config=self.tc.to_dict(),
            data=self.data_id,
            expert_counts=self.experts.state_dict() if self.experts.layers else None,
            reference_weights=self.reference_weights,  # DPO's frozen copy: checked on resume
            data_parallel=self.world.dp_size,  # ranks sharing the global batch (said on resume)
            stopped_early=self.stopped_early,  # the checkpoint should_stop ended the run at
        )
        tok = self.data_dir / "tokenizer.json"
        if self.dcp is not None:
            keep = {self.best_name or ""}
            return self.dcp.save(self.step, self.wrapped, self.model, self.optimizer, state, tok,
                                 keep, blocking)  # fmt: skip
        parallel, w = self.tc.parallel, self.world
        model_sd = D.full_model_state(self.wrapped, parallel, w)  # collective under FSDP
        optim_sd = D.full_optimizer_state(self.wrapped, self.optimizer, parallel, w)
        path = self.ckpt_root / step_name(self.step)
        if w.main:
            model = self.model
            if self.sharded:  # a plain CPU copy holding the gathered tensors
                model = apply_lora_settings(Transformer(self.mc), lora_settings(self.model))
                model.load_state_dict(D.with_tied(model, model_sd))
            path = save_train_checkpoint(self.ckpt_root, self.step, model, optim_sd, state, tok)
            prune_checkpoints(self.ckpt_root, self.tc.keep_last, {self.best_name or "", path.name})
        if w.distributed:
            torch.distributed.barrier()  # no rank goes on before the checkpoint is complete
        return path

    def _target_shares(self, ys: list[torch.Tensor]) -> torch.Tensor:
        """What each of this rank's micro-batch mean losses is multiplied by so that the step's
        loss is the mean over every target token of the global batch: n_i x world / N (N the
        targets of all micro-batches on all ranks; DDP then averages over ranks). SFT rows hold
        different numbers of targets (prompts and padding are masked), so a plain average of
        per-batch means would weigh tokens unequally and depend on the world size. One process,
        one micro-batch: exactly 1 (packed text rows with document masks: the same). Returns (micro-batches,) fp32, on the device (no host sync)."""
        n = torch.stack([(y != IGNORE).sum() for y in ys]).double()  # (micro-batches,)
        total = D.mean(n.sum(), self.world) * self.world.world_size  # all ranks' targets
        return (n * self.world.world_size / total).float()

    def _train_step(self, layer_norms: bool = False):
        """One optimizer step; returns (loss, grad_norm, applied, norms), where ``norms`` is
        (per-layer gradient norms, the rest's norm) before clipping when ``layer_norms``, else
        None."""
        tc = self.tc
        set_lr(self.optimizer, lr_at(self.step, tc))
        loss_sum = torch.zeros((), device=self.device)
        aux_sum = torch.zeros((), device=self.device)
        stats_sum = torch.zeros(len(STAT_NAMES), device=self.device)
        batches = [
            [t.to(self.device, non_blocking=True) for t in self.feed.next()]
            for _ in range(tc.grad_accum)
        ]
        shares = self._target_shares([b[1] for b in batches]) if self.weighted else None
        for micro, batch in enumerate(batches):
            last = micro == tc.grad_accum - 1
            sync = D.sync_gradients(self.wrapped, tc.parallel, last)
            with sync, self.loss_context(), self._autocast():
                loss, stats = self.batch_loss(batch, "train")
                loss = loss / tc.grad_accum if shares is None else loss * shares[micro]
                aux = self.model.aux_loss()  # experts' balancing losses (None: dense)
                total = loss if aux is None else loss + aux / tc.grad_accum
                self.scaler.scale(total).backward()
            loss_sum += loss.detach()
            if stats:
                stats_sum += torch.stack([stats[k] for k in STAT_NAMES]) / tc.grad_accum
            if aux is not None:
                aux_sum += aux.detach() / tc.grad_accum
                self.experts.count(self.model)
        loss_sum = D.mean(loss_sum, self.world)  # the global batch's loss on every rank
        self.last_aux = D.mean(aux_sum, self.world) if self.experts.layers else None
        self.scaler.unscale_(self.optimizer)
        if self.world.tp > 1:  # partial sums left by tensor parallelism, reduced once
            TP.settle_grads(self.model)
        norms = None
        if layer_norms:
            norms = layer_grad_norms(self.model), rest_grad_norm(self.model)
        max_norm = tc.grad_clip if tc.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor holding the global norm
            grad_norm = grad_norm.full_tensor()
        on_device = self.device_skip and skips_on_device(self.optimizer)
        if on_device:  # the step is queued before the host waits for its numbers
            bad = ~(torch.isfinite(loss_sum) & torch.isfinite(grad_norm))
            step_unless(self.optimizer, bad)
        loss_value, norm_value = loss_sum.item(), grad_norm.item()  # the one host sync per step
        if self.reference is not None:  # computed by now: no further wait
            means = D.mean(stats_sum, self.world).tolist()
            self.last_stats = dict(zip(STAT_NAMES, means, strict=True))
        # fp16's grad scaler skips overflowing steps itself; only a bad loss is fatal there
        bad_norm = not math.isfinite(norm_value) and not self.scaler.is_enabled()
        applied = math.isfinite(loss_value) and not bad_norm
        if applied and not on_device:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_value, norm_value, applied, norms

    # ------------------------------------------------------------------------------------------
    def run(self) -> RunResult:
        tc = self.tc
        main = self.world.main
        if tc.warmup_steps >= tc.max_steps > self.step and main:  # likely a shortened run
            log.warning(f"note: warmup_steps={tc.warmup_steps} >= max_steps={tc.max_steps}: the "
                        f"learning rate rises all run and never decays (lower "
                        f"--train.warmup_steps)")  # fmt: skip
        try:
            metrics = MetricsLog(
                self.out / METRICS, self.step if self.resumed_from else None, enabled=main
            )
        except FileNotWritten as e:  # said with where the run stands
            self.release()
            raise e.at(self.step, self.resumed_from) from e
        stop = {"signal": None}

        def request_stop(signum, frame):
            stop["signal"] = self.stop_signal = signal.Signals(signum).name

        # a resumed run hides what the interrupted one logged after its checkpoint, as in
        # metrics.jsonl
        purge = self.step + 1 if self.resumed_from else None
        tb = tensorboard(self.out, purge) if tc.tensorboard and main else None
        last_loss, last_ckpt, val_history = None, self.resumed_from, []
        if tc.compile and main and self.step < tc.max_steps:  # else the bar sits at its start
            log.info("compiling the model (train.compile): the first step waits for it, seconds "
                     "to minutes, and its tokens/s counts it")  # fmt: skip
        bar = tqdm(
            total=tc.max_steps,
            initial=self.step,
            disable=not (tc.progress and main),
            dynamic_ncols=True,
            desc="train",
        )
        say = bar.write if main else (lambda msg: None)  # only rank 0 prints
        flops_per_token = self.model.flops_per_token(tc.block_size)
        # a DPO micro-batch is B pairs: 2B sequences
        tokens_per_step = tc.tokens_per_step * self.world.dp_size * (1 + self.preference)
        self.t_start = time.perf_counter()
        self.model.train()
        # the next batches built while this step runs; saved states are those of batches trained
        self.feed = self.sampler
        # installed last before the loop's try: what raises before it leaves no handler behind
        old = {s: signal.signal(s, request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.feed = Prefetch(self.sampler, tc.prefetch) if tc.prefetch else self.sampler
            while self.step < tc.max_steps:
                watch = self.monitor is not None and self.monitor.due(self.step + 1)
                # probed before the step: the weights this step's forward and backward see
                probe = self.monitor.probe() if watch else None
                t0 = time.perf_counter()
                loss, grad_norm, applied, norms = self._train_step(layer_norms=watch)
                if self.dcp is not None:  # a background save that has completed is put in place
                    self.dcp.poll()
                if not applied:
                    if tc.on_nonfinite == "stop":
                        where = last_ckpt or "none saved yet"
                        raise TrainingDiverged(
                            f"{nonfinite(loss, grad_norm)} at step {self.step + 1}; the update "
                            f"was not applied and no checkpoint was written. Last good "
                            f"checkpoint: {where}. Lower train.lr, raise train.warmup_steps, or "
                            "set train.on_nonfinite=skip."
                        )
                    self.skipped += 1
                self.step += 1
                dt = time.perf_counter() - t0
                tps = tokens_per_step / dt
                last_loss = loss
                rec = dict(
                    step=self.step,
                    loss=loss,
                    **self.experts.step_record(self.last_aux),
                    lr=lr_at(self.step - 1, tc),
                    grad_norm=grad_norm,
                    **self.last_stats,
                    tokens_per_s=tps,
                    flops_per_s=tps * flops_per_token,
                    time=self.elapsed(),
                )
                metrics.write(rec)
                if watch:
                    metrics.write(self.monitor.record(self.step, probe, *norms))
                if tb:
                    tb_write(tb, "train", rec)
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4f}", **dpo_shown(self.last_stats),
                                lr=f"{rec['lr']:.2e}", tok_s=f"{tps:,.0f}")  # fmt: skip
                final = self.step == tc.max_steps
                if self.experts.due(self.step) or (final and self.experts.layers):
                    metrics.write(self.experts.interval_record(self.step, say))
                save_now = (
                    tc.checkpoint_interval and self.step % tc.checkpoint_interval == 0
                ) or final
                if (tc.eval_interval and self.step % tc.eval_interval == 0) or final:
                    val = self.evaluate()
                    val_history.append((self.step, val))
                    # DPO: the validation pairs' rewards (a perplexity of its loss means nothing)
                    more = self.val_stats if self.reference else dict(val_ppl=math.exp(val))
                    ev = dict(step=self.step, val_loss=val, **more)
                    ev.update({f"val_loss/{k}": v for k, v in self.val_by_source.items()})
                    metrics.write(ev)
                    if tb:
                        tb_write(tb, "val", ev)
                    each = ", ".join(f"{k} {v:.4f}" for k, v in self.val_by_source.items())
                    dpo = "".join(
                        f", val {k} {v}" for k, v in dpo_shown(self.val_stats, "val_").items()
                    )
                    # steps train.on_nonfinite=skip left out so far: a frozen run shows here
                    skips = f"; {skipped_text(self.skipped, self.step)}" if self.skipped else ""
                    say(f"step {self.step}: train loss {loss:.4f}, val loss {val:.4f}{dpo}"
                        + (f" (weighted mean of {each})" if each else "") + skips)  # fmt: skip
                    if val < self.best_val:  # the best model is always on disk
                        self.best_val, self.best_name = val, step_name(self.step)
                        save_now = True
                # a subclass's reason to end here; a bare True (not a reason) still stops
                early = None if final else self.should_stop()
                early = (early if isinstance(early, str) else "should_stop()") if early else None
                if self.world.distributed:  # a signal or stop on one rank stops all here
                    signalled, stopping = D.any_ranks(
                        [stop["signal"] is not None, early is not None], self.world, self.device
                    )
                    if signalled:
                        stop["signal"] = self.stop_signal = stop["signal"] or "SIGTERM"
                    if stopping:
                        early = D.stopping_reason(early, self.world)  # only at a stop: rare
                if early is not None:  # saved in this step's checkpoint
                    self.stopped_early = dict(step=self.step, reason=early)
                ends = final or stop["signal"] is not None or early is not None
                if save_now or ends:
                    metrics.sync()  # the records up to a checkpoint survive whatever follows
                    # the last save and one before stopping are complete when run() returns
                    last_ckpt = self.save(blocking=ends)
                if stop["signal"]:
                    # how to go on is the command's to say (train: --resume; ablate: rerun)
                    say(f"{stop['signal']}: saved {last_ckpt} at step {self.step}")
                    break
                if early is not None:
                    say(f"stopped at step {self.step} of {tc.max_steps}: {early}; saved "
                        f"{last_ckpt}")  # fmt: skip
                    break
        except FileNotWritten as e:  # metrics.jsonl: said with where the run stands
            raise e.at(self.step, last_ckpt) from e
        finally:
            try:
                if self.dcp is not None:  # after an error: a save in flight completes first
                    self.dcp.finish(quiet=True)
                if self.feed is not self.sampler:  # the sampler back at the batches trained
                    self.feed.close()
                    self.feed = self.sampler
            finally:  # whatever closing the feed raised, the run's resources are let go
                bar.close()
                metrics.close()
                self.release()
                if tb:
                    tb.close()
                for s, handler in old.items():
                    signal.signal(s, handler)
        return RunResult(
            step=self.step,
            last_train_loss=last_loss,
            best_val_loss=self.best_val if math.isfinite(self.best_val) else None,
            val_history=val_history,
            interrupted=stop["signal"] is not None,
            stopped_by=stop["signal"],
            stopped_early=self.stopped_early["reason"] if self.stopped_early else None,
            skipped_steps=self.skipped,
            checkpoint=last_ckpt,
        )
