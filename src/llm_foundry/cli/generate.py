"""``llm-foundry generate``: text from an llm-foundry checkpoint, a training run directory or an
HF transformers directory; streaming, stop strings, an interactive loop, JSON output."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from llm_foundry.cli.options import add_quantize_flags, quantize_choice
from llm_foundry.messages import shown
from llm_foundry.stops import settle


def _parse_ids(text: str, vocab_size: int) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise ValueError(f"--prompt-ids {shown(text)}: expected integers like 1,2,3") from None
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"prompt id {bad[0]} is out of range for vocab_size={vocab_size}")
    return ids


def _context(model, n_prompt: int, ns) -> tuple[int | None, list[str]]:
    """How many tokens each step sees (None: all of them, through the KV cache), and the notes
    on it, which the caller prints once every other check has passed too."""
    longest, limit = n_prompt + ns.max_new_tokens, model.cfg.max_seq_len
    if ns.context == 0 or (ns.context is None and longest <= limit):
        return None, []
    if ns.cuda_graph:
        what = f"--context {ns.context}"
        if not ns.context:
            what = (f"prompt + new tokens ({longest}) past max_seq_len ({limit}), which feed each "
                    f"step the last {limit} tokens without a cache")  # fmt: skip
        raise ValueError(f"--cuda-graph decodes over a KV cache: it does not take {what}")
    positions = model.pos.max_positions
    if ns.context is not None and positions is not None and ns.context > positions:
        raise ValueError(f"--context {ns.context} is past the {positions} learned positions")
    notes = []
    if getattr(ns, "compile", False):  # what it compiles is the cached step
        notes.append("note: --compile compiles the cached decode step; cropped decoding (each "
                     "step recomputed over the last tokens) runs eager (--context 0: cached, "
                     "compiled)")  # fmt: skip
    if ns.context is None:
        notes.append(
            f"note: prompt + new tokens ({longest}) exceed the model's max_seq_len ({limit}): "
            f"each step sees the last {limit} tokens (--context 0 to feed them all)"
        )
        return limit, notes
    return ns.context, notes


def _chat(ns, model, tok, info, eos_ids: set[int]) -> int:
    """--chat: one reply to --prompt, or a conversation read from stdin (--interactive)."""
    from llm_foundry.chat import render_chat
    from llm_foundry.tokenizer_files import chat_format

    if tok is None or ns.prompt_ids is not None:
        raise ValueError("--chat needs a tokenizer and text prompts (--prompt or --interactive)")
    hf = getattr(tok, "kind", "") == "hf"
    chat = chat_format(info.checkpoint, tok)
    _say([chat.note] if chat.note else [])  # the built-in template stands in for a missing one
    template, specials = chat.template, chat.variables
    if chat.end_id is not None:
        eos_ids.add(chat.end_id)  # a special token: generation ends on its id
    elif chat.end not in ns.stop:
        ns.stop = [*ns.stop, chat.end]  # plain text: a stop string
    messages: list[dict] = []

    def reply(user: str) -> None:
        messages.append({"role": "user", "content": user})
        text = render_chat(template, messages, add_generation_prompt=True, **specials)
        ids = tok.encode(text, add_special_tokens=False) if hf else tok.encode(text)
        emit = (lambda piece: print(piece, end="", flush=True)) if ns.stream else None
        rec = _complete(model, tok, ids, ns, eos_ids, emit)
        if ns.json:
            print(json.dumps(rec, ensure_ascii=False))
        else:
            print("" if ns.stream else rec["completion"], flush=True)
        messages.append({"role": "assistant", "content": rec["completion"].strip()})

    if ns.prompt is not None:
        reply(ns.prompt)
    if ns.interactive:
        while True:
            print("> ", end="", file=sys.stderr, flush=True)
            line = sys.stdin.readline()
            if not line or not line.strip() or line.strip() in ("exit", "quit"):
                break
            try:
                reply(line.rstrip("\r\n"))
            except ValueError as e:
                messages.pop()
                print(f"error: {e}", file=sys.stderr)
    return 0


def _complete(model, tok, ids: list[int], ns, eos_ids: set[int], emit=None) -> dict:
    """Generate a continuation of ``ids``; ``emit(piece)`` receives the text (or, without a
    tokenizer, ``" ID"`` pieces) as it is produced. Returns the --json record: the prompt and
    the completion as text (ids without a tokenizer), ``prompt_ids`` and ``new_ids`` (every
    generated id: the eos that ended it, the tokens up to a stop string's end) and their
    counts ``prompt_tokens`` and ``new_tokens``."""
    import time

    import torch

    from llm_foundry.generate import stream

    if not ids:
        if tok is None or tok.bos_id is None:
            raise ValueError("the prompt is empty (it encodes to no tokens)")
        ids = [tok.bos_id]
    device = next(model.parameters()).device
    context, notes = _context(model, len(ids), ns)
    steps = stream(
        model,
        torch.tensor([ids], device=device),
        ns.max_new_tokens,
        temperature=ns.temperature,
        top_k=ns.top_k,
        top_p=ns.top_p,
        min_p=ns.min_p,
        repetition_penalty=ns.repetition_penalty,
        seed=ns.seed,
        context=context,
        compile=ns.compile,
        cuda_graph=ns.cuda_graph,
    )
    # the continuation is the decoded whole sequence past the decoded prompt: decoding the new
    # ids alone could drop a leading space (SentencePiece-style decoders) or split a character
    prefix = tok.decode(ids) if tok is not None else ""
    new: list[int] = []  # every generated id (the eos that ended it included)
    body: list[int] = []  # the continuation's ids (no eos)
    text, shown, reason = "", 0, "length"
    start = time.perf_counter()
    try:
        for nxt in steps:
            notes = _say(notes)  # the stream checked every option before its first step
            t = int(nxt[0])
            new.append(t)
            if t in eos_ids:
                reason = "eos"
                break
            body.append(t)
            if tok is None:
                if emit:
                    emit(f" {t}")
                continue
            full = tok.decode(ids + body)
            text = full[len(prefix) :] if full.startswith(prefix) else tok.decode(body)
            end, stopped = settle(text, ns.stop, released=shown)
            if stopped:
                text, reason = text[:end], "stop"
                break
            if emit and end > shown:
                emit(text[shown:end])
                shown = end
    finally:
        steps.close()
    _say(notes)  # no step taken (--max-new-tokens 0): checked all the same
    elapsed = time.perf_counter() - start
    if emit and tok is not None and len(text) > shown:
        emit(text[shown:])
    return {
        "prompt": ids if tok is None else prefix,
        "completion": body if tok is None else text,
        "prompt_ids": ids,
        "new_ids": new,
        "prompt_tokens": len(ids),
        "new_tokens": len(new),
        "stop_reason": reason,
        "tokens_per_s": round(len(new) / elapsed, 2) if elapsed > 0 else None,
    }


def _say(notes: list[str]) -> list[str]:
    """Print ``notes`` on stderr (stdout holds the text alone); none are left to print."""
    for note in notes:
        print(note, file=sys.stderr)
    return []


def _ids_text(ids: list[int]) -> str:
    return " ".join(map(str, ids))


def main(argv: list[str]) -> int:
    import warnings

    with warnings.catch_warnings():  # a warning is a one-line note here, not a source listing
        warnings.showwarning = lambda message, *a, **k: print(f"note: {message}", file=sys.stderr)
        return _main(argv)


def _main(argv: list[str]) -> int:
    import torch

    p = argparse.ArgumentParser(
        prog="llm-foundry generate",
        allow_abbrev=False,  # exact option names: a prefix could mean another option
        description="Generate text from an llm-foundry checkpoint, a training run directory (its "
        "latest checkpoint) or an HF transformers directory (config.json + safetensors). The "
        "tokenizer is DIR/tokenizer.json; without one, give --prompt-ids and read ids back.",
    )
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="checkpoint/run/HF dir")
    p.add_argument("--adapter", default=None, metavar="DIR", help="a LoRA adapter to merge into "
                   "the model first: a PEFT adapter directory, or a LoRA run of ours")  # fmt: skip
    p.add_argument("--prompt", default=None, help="prompt text")
    p.add_argument("--prompt-ids", default=None, metavar="IDS", help="prompt token ids: 1,2,3")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible output)")
    p.add_argument(
        "--stop",
        nargs="+",
        action="extend",
        default=[],
        metavar="STR",
        help="end at any of these (cut from output; repeat the flag or list several)",
    )
    p.add_argument(
        "--context",
        type=int,
        default=None,
        metavar="N",
        help="each step sees only the last N tokens (as nanoGPT samples; no KV cache); 0 = the "
        "whole sequence. Default: the whole sequence while it fits the model's max_seq_len, "
        "else max_seq_len",
    )
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past eos")
    p.add_argument("--stream", action="store_true", help="print the text as it is generated")
    p.add_argument(
        "--interactive",
        action="store_true",
        help="read prompts from stdin, one a line, until EOF, an empty line or 'exit'",
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="each prompt is a user message: render the conversation with the model's chat "
        "template (an HF tokenizer's own, else USER:/ASSISTANT: lines) and stop at the end of "
        "the reply; with --interactive the conversation is kept",
    )
    p.add_argument("--json", action="store_true", help="print a JSON line per prompt: prompt "
                   "and completion (text; ids without a tokenizer), prompt_ids, new_ids (the "
                   "generated ids, an eos that ended them included), prompt_tokens, "
                   "new_tokens, stop_reason, tokens_per_s")  # fmt: skip
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--compile", action="store_true", help="compile the one-token decode step "
                   "(faster decoding on CPU after ~20 s of compilation)")  # fmt: skip
    p.add_argument("--cuda-graph", action="store_true", help="decode with a static KV cache, "
                   "one step captured as a CUDA graph and replayed each token (small batches on "
                   "a GPU are bound by kernel launches); with --compile the compiled step; on "
                   "CPU the static step runs eagerly, with a note")  # fmt: skip
    add_quantize_flags(p)
    ns = p.parse_args(argv)

    if ns.prompt is not None and ns.prompt_ids is not None:
        raise ValueError("give --prompt or --prompt-ids, not both")
    if ns.prompt is None and ns.prompt_ids is None and not ns.interactive:
        raise ValueError("give --prompt TEXT, --prompt-ids IDS or --interactive")
    if ns.stream and ns.json:
        raise ValueError("--stream and --json do not mix: --json prints one record when done")
    if ns.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0; got {ns.max_new_tokens}")
    if ns.context is not None and ns.context < 0:
        raise ValueError(f"--context must be >= 0 (0 = the whole sequence); got {ns.context}")
    from llm_foundry.sampling import check_sampling

    check_sampling(ns.temperature, ns.top_k, ns.top_p, ns.min_p, ns.repetition_penalty)
    if any(s == "" for s in ns.stop):
        raise ValueError("--stop strings must not be empty")
    device = ns.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: CUDA is not available (use --device cpu)")

    from llm_foundry.loading import load_any

    scheme, group = quantize_choice(ns.quantize, ns.group_size)
    model, tok, info = load_any(ns.checkpoint, device, quantize=scheme, group_size=group,
                            adapter=ns.adapter)  # fmt: skip
    if info.merged_note():  # on stderr: stdout holds the text alone
        print(info.merged_note(), file=sys.stderr)
    eos_ids = set(info.eos_ids)
    if ns.ignore_eos:
        eos_ids = set()
    if tok is None and ns.prompt is not None:
        raise ValueError(
            f"{Path(ns.checkpoint)} has no tokenizer.json: give the prompt as --prompt-ids 1,2,3 "
            "(the output is then token ids)"
        )
    if tok is None and ns.stop:
        raise ValueError("--stop needs a tokenizer (the checkpoint has no tokenizer.json)")
    vocab = model.cfg.vocab_size

    def run(ids: list[int], echo: bool) -> None:
        """Generate for one prompt and print it (echo: the prompt first, then the text)."""
        if not ns.stream:
            rec = _complete(model, tok, ids, ns, eos_ids)
            if ns.json:
                print(json.dumps(rec, ensure_ascii=False))  # one line a prompt (JSON Lines)
            elif tok is None:
                print(_ids_text((rec["prompt"] if echo else []) + rec["completion"]))
            else:
                print((rec["prompt"] if echo else "") + rec["completion"])
            return
        started = False

        def emit(piece: str) -> None:
            nonlocal started
            if not started:  # at the first token: a refusal leaves nothing half printed
                started = True
                if tok is None:
                    piece = _ids_text(ids) + piece if echo else piece[1:]
                elif echo:
                    piece = tok.decode(ids) + piece
            print(piece, end="", flush=True)

        rec = _complete(model, tok, ids, ns, eos_ids, emit)
        if not started and echo:
            print(_ids_text(rec["prompt"]) if tok is None else rec["prompt"], end="")
        print(flush=True)

    def encode(line: str) -> list[int]:
        return _parse_ids(line, vocab) if tok is None else tok.encode(line)

    if ns.chat:
        return _chat(ns, model, tok, info, eos_ids)

    if ns.prompt_ids is not None:
        run(_parse_ids(ns.prompt_ids, vocab), echo=True)
    elif ns.prompt is not None:
        run(tok.encode(ns.prompt), echo=True)
    if ns.interactive:
        while True:
            print("> ", end="", file=sys.stderr, flush=True)
            line = sys.stdin.readline()
            if not line:  # EOF
                print(file=sys.stderr)
                break
            line = line.rstrip("\r\n")
            if not line.strip() or line.strip() in ("exit", "quit"):
                break
            try:
                run(encode(line), echo=False)
            except ValueError as e:  # e.g. a character the tokenizer lacks: say so, keep going
                print(f"error: {e}", file=sys.stderr)
    return 0
