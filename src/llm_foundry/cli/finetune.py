"""``llm-foundry finetune``: a training run that starts from a checkpoint's weights (optionally
training LoRA adapters only), on plain text or supervised fine-tuning data."""

from __future__ import annotations

from llm_foundry.cli.train import main as train_main


def main(argv: list[str]) -> int:
    return train_main(argv, finetune=True)
