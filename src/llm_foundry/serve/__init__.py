"""``llm-foundry serve``: an OpenAI-compatible HTTP server over any checkpoint kind, with
continuous batching (``engine.py``: the model loop; ``app.py``: the HTTP API)."""

from __future__ import annotations

from pathlib import Path


def load_served(checkpoint: str | Path, slots: int = 8, max_queue: int = 64,
                name: str | None = None, device: str = "cpu", compile: bool = False,
                quantize: str | None = None, group_size: int = 64):  # fmt: skip
    """The model of ``checkpoint`` behind an engine, with its tokenizer and chat template, as
    ``app.Served`` (the engine not yet started)."""
    from llm_foundry.chat import BUILTIN_TEMPLATE, end_of_turn, load_chat_template
    from llm_foundry.rundir import load
    from llm_foundry.serve.app import Served
    from llm_foundry.serve.engine import Engine

    model, tok, info = load(checkpoint, device, quantize=quantize, group_size=group_size)
    if tok is None:
        raise FileNotFoundError(f"{info.checkpoint} has no tokenizer.json: the server needs one")
    hf = getattr(tok, "kind", "") == "hf"
    template, specials = load_chat_template(info.checkpoint) if hf else (None, {})
    template = template or BUILTIN_TEMPLATE
    eos = set(info.eos_ids)
    eot = end_of_turn(template, **specials)
    eot_id = tok.hf.token_to_id(eot) if hf else None
    if eot_id is not None:
        eos.add(eot_id)  # a special token ends the reply by its id
    engine = Engine(model, tok, slots=slots, max_queue=max_queue, eos_ids=eos, compile=compile)
    served = Served(engine, tok, name or Path(checkpoint).resolve().name, template, specials)
    served.chat_stop = () if eot_id is not None else (eot,)  # a plain-text end of turn
    return served
