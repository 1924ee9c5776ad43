from llm_foundry.models.transformer import Transformer

__all__ = ["Transformer"]
