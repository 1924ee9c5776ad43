"""``llm-foundry generate``: sample text from an llm-foundry or HF transformers checkpoint.

llm-foundry generate --checkpoint runs/NAME --prompt "ROMEO:" --stream
llm-foundry generate --checkpoint hf_dir --prompt-ids 1,2,3 --temperature 0
llm-foundry generate --checkpoint runs/NAME --interactive
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from llm_foundry.generate import stream


def resolve_checkpoint(path: Path) -> tuple[Path, str]:
    """(directory, "ours" | "hf"): a run dir resolves to its latest checkpoint."""
    if not path.exists():
        raise FileNotFoundError(f"--checkpoint {path}: no such directory")
    latest = path / "checkpoints" / "latest.json"
    if latest.exists():
        path = path / "checkpoints" / json.loads(latest.read_text())["path"]
    config = path / "config.json"
    if not config.exists():
        raise FileNotFoundError(
            f"--checkpoint {path}: no config.json (expected an llm-foundry checkpoint, a run "
            "directory with checkpoints/latest.json, or an HF transformers directory)"
        )
    meta = json.loads(config.read_text())
    return path, ("hf" if "model_type" in meta else "ours")


def load(path: Path, device: str):
    """(model, tokenizer or None) from a checkpoint directory of either format."""
    from llm_foundry.tokenizer import load_tokenizer

    path, kind = resolve_checkpoint(path)
    if kind == "hf":
        from llm_foundry.interop.hf import from_hf

        model = from_hf(path).to(device)
    else:
        from llm_foundry.checkpoint import load_checkpoint

        model = load_checkpoint(path, device)
    tok = load_tokenizer(path / "tokenizer.json") if (path / "tokenizer.json").exists() else None
    return model, tok


def complete(model, tok, ids: list[int], ns, out=sys.stdout) -> dict:
    """Generate for one prompt; print as it goes with --stream; apply --stop strings."""
    device = next(model.parameters()).device
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    eos = tok.eos_id if tok is not None else None
    new: list[int] = []
    shown, text = 0, ""
    t0 = time.perf_counter()
    for nxt in stream(
        model,
        idx,
        ns.max_new_tokens,
        temperature=ns.temperature,
        top_k=ns.top_k,
        top_p=ns.top_p,
        min_p=ns.min_p,
        repetition_penalty=ns.repetition_penalty,
        eos_id=eos,
        seed=ns.seed,
    ):
        token = int(nxt[0])
        if eos is not None and token == eos:
            break
        new.append(token)
        if tok is None:
            continue
        text = tok.decode(new)  # decode the whole continuation: multi-byte pieces come out whole
        cut = min((text.find(s) for s in ns.stop or [] if s in text), default=-1)
        if cut >= 0:
            text = text[:cut]
        if ns.stream and not ns.json:
            out.write(text[shown:])
            out.flush()
            shown = len(text)
        if cut >= 0:
            break
    dt = time.perf_counter() - t0
    return dict(
        prompt=tok.decode(ids) if tok is not None else None,
        completion=text if tok is not None else None,
        tokens=ids + new,
        new_tokens=len(new),
        tokens_per_s=round(len(new) / dt, 1) if dt > 0 else None,
    )


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="llm-foundry generate", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, help="checkpoint, run or HF directory")
    p.add_argument("--prompt", default="\n", help="text prompt (needs a tokenizer.json)")
    p.add_argument("--prompt-ids", default=None, help="comma-separated token ids instead")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", nargs="+", default=None, help="stop when one of these appears")
    p.add_argument("--stream", action="store_true", help="print text as it is produced")
    p.add_argument("--interactive", action="store_true", help="a prompt loop on stdin")
    p.add_argument("--device", default="cpu", help="cpu | cuda | mps")
    p.add_argument("--json", action="store_true")
    ns = p.parse_args(argv)
    model, tok = load(Path(ns.checkpoint), ns.device)

    def encode(prompt: str) -> list[int]:
        if tok is None:
            raise ValueError(
                f"{ns.checkpoint} has no tokenizer.json: pass --prompt-ids 1,2,3 instead of text"
            )
        return tok.encode(prompt)

    def run(ids: list[int]) -> None:
        r = complete(model, tok, ids, ns)
        if ns.json:
            print(json.dumps(r))
        elif tok is None:
            print(" ".join(map(str, r["tokens"])))
        elif ns.stream:
            print()
        else:
            print(r["prompt"] + r["completion"])

    if ns.interactive:
        while True:
            sys.stdout.write("> ")
            sys.stdout.flush()
            line = sys.stdin.readline()
            if not line or line.strip() in ("", "exit", "quit"):
                return 0
            ids = encode(line.rstrip("\n"))
            if ns.stream and not ns.json:
                sys.stdout.write(line.rstrip("\n"))
            run(ids)
    if ns.prompt_ids:
        ids = [int(i) for i in ns.prompt_ids.split(",")]
    else:
        ids = encode(ns.prompt)
    if ns.stream and not ns.json and tok is not None:
        sys.stdout.write(tok.decode(ids))
    run(ids)
    return 0
