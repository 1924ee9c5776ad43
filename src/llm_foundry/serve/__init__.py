"""``llm-foundry serve``: an OpenAI-compatible HTTP server over any checkpoint kind, with
continuous batching (``engine.py``: the model loop; ``app.py``: the HTTP API)."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)


def check_device(device: str) -> None:
    """Raise ValueError (one line, naming --device) unless ``device`` is a device this machine
    has: a string torch parses, of a kind that is present (cuda, cuda:N, mps) or cpu."""
    import torch

    from llm_foundry.messages import shown

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(
            f"--device {shown(device)} is not a device: use cpu, cuda, cuda:N or mps"
        ) from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: CUDA is not available here (use --device cpu)")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"--device {device}: this machine has CUDA devices 0..{count - 1}")
    elif dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"--device {device}: MPS is not available here (use --device cpu)")
    elif dev.type != "cpu":
        raise ValueError(f"--device {device}: the server runs on cpu, cuda, cuda:N or mps")


def load_served(checkpoint: str | Path, slots: int = 8, max_queue: int = 64,
                name: str | None = None, device: str = "cpu", compile: bool = False,
                quantize: str | None = None, group_size: int = 64,
                max_context: int | None = None,
                adapters: dict[str, str | Path] | None = None,
                cuda_graph: bool = False):  # fmt: skip
    """The model of ``checkpoint`` behind an engine, with its tokenizer and chat template, as
    ``app.Served`` (the engine not yet started). ``max_context`` caps the tokens (prompt and
    reply) a request may use, and with it the KV cache (default: the model's max_seq_len; a
    cache larger than the memory left is refused before it is allocated). ``adapters`` (name ->
    directory: a PEFT adapter or a LoRA run of ours) are put over the model unmerged, each
    served under its name (``serve.adapters``). ``cuda_graph``: every decode step a CUDA
    graph (``Engine``)."""
    check_device(device)
    name = name or Path(checkpoint).resolve().name
    adapters = dict(adapters or {})
    if name in adapters:
        raise ValueError(f"--adapter {name}=...: '{name}' is the base model's name; give the "
                         "adapter another (or the base another with --model-name)")  # fmt: skip
    if adapters and quantize:
        raise ValueError(f"--adapter with --quantize {quantize}: adapters are served over the "
                         "full-precision base only; leave out --quantize")  # fmt: skip
    from llm_foundry.loading import load_any
    from llm_foundry.serve.app import Served
    from llm_foundry.serve.engine import Engine
    from llm_foundry.serve.pieces import Pieces
    from llm_foundry.tokenizer_files import chat_format

    model, tok, info = load_any(checkpoint, device, quantize=quantize, group_size=group_size)
    if info.lora:  # as every command that reads a LoRA run says it (adapters go over them)
        log.info(info.merged_note())
    rows = None
    if adapters:
        from llm_foundry.serve.adapters import load_adapters

        rows = load_adapters(model, adapters)
    if tok is None:
        raise FileNotFoundError(f"{info.checkpoint} has no tokenizer.json: the server needs one")
    chat = chat_format(info.checkpoint, tok)
    if chat.note:
        log.warning(chat.note)
    eos = set(info.eos_ids)
    if chat.end_id is not None:
        eos.add(chat.end_id)  # a special token ends the reply by its id
    pieces = Pieces(tok)  # the reply's text without special tokens; each token's bytes
    engine = Engine(model, tok, slots=slots, max_queue=max_queue, eos_ids=eos, compile=compile,
                    max_context=max_context, adapters=rows, cuda_graph=cuda_graph,
                    detokenizer=pieces.detokenizer)  # fmt: skip
    served = Served(engine, tok, name, chat.template, chat.variables, adapters=list(adapters),
                    pieces=pieces)  # fmt: skip
    served.chat_stop = () if chat.end_id is not None else (chat.end,)  # a plain-text end of turn
    return served
