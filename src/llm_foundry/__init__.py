"""llm-foundry: decoder-only Transformer variants, each architecture choice one config field."""

__version__ = "0.1.0"
