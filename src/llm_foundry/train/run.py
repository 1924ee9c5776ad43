"""A whole training run as the CLI runs it: train, plot, sample, summarise."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from llm_foundry.config import ModelConfig
from llm_foundry.generate import generate
from llm_foundry.plots import plot_losses
from llm_foundry.tokenizer import load_tokenizer
from llm_foundry.train.config import TrainConfig
from llm_foundry.train.trainer import RunResult, Trainer


def sample_text(
    model, tokenizer, n_tokens: int, seed: int, context: int, prompt: str = "\n"
) -> str:
    """A short sample from ``model`` (temperature 0.8, top-k 50), prompt included, seeing at
    most ``context`` tokens (the training block) at a time."""
    try:
        ids = tokenizer.encode(prompt)
    except ValueError:
        ids = [tokenizer.bos_id or 0]
    device = next(model.parameters()).device
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    context = min(context, model.cfg.max_seq_len)
    out = generate(model, idx, n_tokens, temperature=0.8, top_k=50, seed=seed, context=context)
    return tokenizer.decode(out[0].tolist())


def train_and_report(
    model_cfg: ModelConfig, train_cfg: TrainConfig, data: Path, out: Path, resume: bool = False
) -> RunResult:
    trainer = Trainer(model_cfg, train_cfg, data, out, resume=resume)
    # the sample at the end needs the tokenizer: a missing one fails now, not after training
    try:
        tok = load_tokenizer(data / "tokenizer.json") if train_cfg.sample_tokens else None
    except BaseException:
        trainer.release()
        raise
    w = trainer.world
    n = trainer.model.num_params()
    if w.main:
        per_step = train_cfg.batch_size * train_cfg.grad_accum * w.world_size
        print(
            f"model: {n:,} parameters ({trainer.model.num_params(non_embedding=True):,} "
            f"non-embedding) | device {trainer.device} | run dir {out}\n"
            f"global batch: {train_cfg.batch_size} per rank x {train_cfg.grad_accum} accumulation "
            f"x {w.world_size} rank(s) = {per_step} sequences = "
            f"{per_step * train_cfg.block_size:,} tokens/step"
            + (f" | parallel {train_cfg.parallel}" if w.distributed else "")
        )
    result = trainer.run()
    if not w.main:  # rank 0 alone plots, samples and summarises
        return result
    plot_losses(out / "metrics.jsonl", out / "loss.png", title=f"{out.name}: {n / 1e6:.2f}M params")
    summary = dict(
        step=result.step,
        last_train_loss=result.last_train_loss,
        best_val_loss=result.best_val_loss,
        skipped_steps=result.skipped_steps,
        interrupted=result.interrupted,
        checkpoint=str(result.checkpoint) if result.checkpoint else None,
    )
    if train_cfg.sample_tokens and not result.interrupted and not trainer.sharded:
        text = sample_text(
            trainer.model, tok, train_cfg.sample_tokens, train_cfg.seed, train_cfg.block_size
        )
        (out / "sample.txt").write_text(text)
        print("\n--- sample (temperature 0.8, top-k 50) ---" + text + "\n---")
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    best = f"{result.best_val_loss:.4f}" if result.best_val_loss is not None else "n/a"
    print(f"done: step {result.step}, best val loss {best}; curves in {out / 'loss.png'}")
    return result
