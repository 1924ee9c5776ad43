"""Interoperability with other libraries' model formats (Hugging Face ``transformers``: ``hf``)."""
