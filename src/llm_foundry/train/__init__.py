"""Training: configuration, learning-rate schedules, checkpoints and the training loop."""

from llm_foundry.train.config import TrainConfig
from llm_foundry.train.schedule import lr_at

__all__ = ["TrainConfig", "lr_at"]
