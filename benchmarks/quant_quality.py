"""What int8 and int4 weights cost in quality: perplexity on the tiny Shakespeare validation split
and greedy continuations, full precision against each quantization, for two trained models.

1. a character-level LLaMA-style model trained here on tiny Shakespeare (the first 90%);
2. a byte-level BPE model trained here the same way, exported to an HF transformers directory
   (`to_hf`) and read back through the HF importer: the path an imported model takes, scored on
   its own tokenization of the validation text (no model hub is reachable here, so the imported
   model is one of ours).

Each is scored fp32, int8 (per channel), int4 with groups of 32, 64 and 128: loss and perplexity
over every non-overlapping window of the validation split (prompt path: fp32 activations), and
greedy continuations of three validation prompts decoded token by token through the KV cache
(decode path: the kernels, bf16 activations for int4): how many tokens agree with fp32 before
the first difference. Writes docs/results/quantization/{results.json,results.md}.

    python benchmarks/quant_quality.py [--steps 1500] [--out docs/results/quantization]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from llm_foundry.bench import cpu_model
from llm_foundry.config import ModelConfig
from llm_foundry.data import prepare
from llm_foundry.evaluate import evaluate_tokens
from llm_foundry.generate import generate
from llm_foundry.loading import load_any
from llm_foundry.train.config import TrainConfig
from llm_foundry.train.trainer import Trainer

CORPUS = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"
SCHEMES = [("fp32", None, None), ("int8", "int8", None)] + [
    (f"int4 g{g}", "int4", g) for g in (32, 64, 128)
]
MODEL = dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, hidden_dim=384, max_seq_len=128)


def train(data: Path, out: Path, steps: int, vocab: int) -> Path:
    cfg = ModelConfig(vocab_size=vocab, **MODEL)
    tc = TrainConfig(max_steps=steps, batch_size=16, block_size=128, lr=2e-3, min_lr=2e-4,
                     warmup_steps=100, eval_interval=steps, eval_batches=10,
                     checkpoint_interval=steps, sample_tokens=0, progress=False)  # fmt: skip
    Trainer(cfg, tc, data, out).run()
    return out


def continuation(model, prompt: list[int], new: int) -> list[int]:
    idx = torch.tensor([prompt])
    return generate(model, idx, new, temperature=0)[0, len(prompt) :].tolist()


def agree(a: list[int], b: list[int]) -> int:
    """Tokens equal before the first difference."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def score(source: Path, val: np.ndarray, tok, new: int) -> list[dict]:
    prompts = [val[i : i + 32].tolist() for i in (len(val) // 10, len(val) // 2, len(val) * 4 // 5)]
    rows, reference = [], None
    for name, scheme, group in SCHEMES:
        model = load_any(source, quantize=scheme, group_size=group or 64).model
        ev = evaluate_tokens(model, val, context=MODEL["max_seq_len"], batch_size=16)
        conts = [continuation(model, p, new) for p in prompts]
        reference = reference or conts
        from llm_foundry.models.quant import weight_bytes

        rows.append(
            dict(
                weights=name,
                loss=round(ev["loss"], 4),
                ppl=round(ev["ppl"], 3),
                scored_tokens=ev["scored_tokens"],
                weight_bytes=weight_bytes(model),
                greedy_agreement=[agree(c, r) for c, r in zip(conts, reference, strict=True)],
                sample=tok.decode(prompts[0] + conts[0]) if tok is not None else None,
            )
        )
        print(f"  {name:<9} loss {ev['loss']:.4f} ppl {ev['ppl']:.3f}  agree {rows[-1]['greedy_agreement']}", flush=True)  # fmt: skip
    base = rows[0]["ppl"]
    for r in rows:
        r["ppl_vs_fp32"] = f"{(r['ppl'] / base - 1) * 100:+.2f}%"
    return rows


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [
        "# Weight-only quantization: what it costs in quality",
        "",
        f"`{report['command']}` ({report['date']}, {m['cpu']}, torch {m['torch']}; "
        f"{report['minutes']} min). Two models trained here for {report['steps']} steps "
        f"({MODEL['dim']} wide, {MODEL['n_layers']} layers, GQA {MODEL['n_heads']}/"
        f"{MODEL['n_kv_heads']} heads, context {MODEL['max_seq_len']}) on the first 90% of tiny "
        "Shakespeare; scored on the last 10%. The BPE model is exported to an HF directory and "
        "read back through the importer, so it is scored as an imported model on its own "
        "tokenization.",
        "",
        "Perplexity: every non-overlapping window of the validation split (the prompt path, fp32 "
        "activations). Greedy agreement: tokens of three 32-token validation prompts' greedy "
        f"continuations ({report['new_tokens']} tokens, KV-cache decoding through the quantized "
        "kernels) equal to fp32's before the first difference.",
    ]
    for model in report["models"]:
        lines += [
            "",
            f"## {model['name']}",
            "",
            "| weights | bytes read per token | val loss | perplexity | vs fp32 | greedy agreement |",
            "|---|---:|---:|---:|---:|---|",
        ]
        for r in model["rows"]:
            lines.append(
                f"| {r['weights']} | {r['weight_bytes'] / 2**20:.2f} MiB | {r['loss']:.4f} | "
                f"{r['ppl']:.3f} | {r['ppl_vs_fp32']} | "
                f"{' / '.join(str(a) for a in r['greedy_agreement'])} of {report['new_tokens']} |"
            )
        first = model["rows"]
        lines += ["", "First continuation, fp32 and int4 g32:", "", "```", first[0]["sample"] or "",
                  "```", "", "```", first[2]["sample"] or "", "```"]  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--new", type=int, default=96, help="greedy tokens per continuation")
    ap.add_argument("--out", default="docs/results/quantization")
    args = ap.parse_args()
    if not CORPUS.exists():
        raise SystemExit(f"{CORPUS} not found: the shared test data lives beside the repository")
    from llm_foundry.interop.hf import to_hf

    start = time.time()
    models = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name, kind, vocab in (("character model", "char", None), ("BPE model, imported from HF", "bpe", 512)):  # fmt: skip
            data = tmp / f"data-{kind}"
            meta = prepare(data, text_files=[CORPUS], tokenizer=kind, vocab_size=vocab,
                           progress=False)  # fmt: skip
            print(f"{name}: training {args.steps} steps", flush=True)
            run = train(data, tmp / f"run-{kind}", args.steps, meta["vocab_size"])
            source = run
            if kind == "bpe":
                source = to_hf(load_any(run).model, tmp / "hf")
                (source / "tokenizer.json").write_bytes((data / "tokenizer.json").read_bytes())
            dtype = np.uint16 if meta["vocab_size"] < 2**16 else np.uint32
            val = np.fromfile(data / "val.bin", dtype=dtype).astype(np.int64)
            tok = load_any(source).tokenizer
            models.append(dict(name=name, source_kind=load_any(source).info.kind,
                               rows=score(source, val, tok, args.new)))  # fmt: skip
    report = dict(
        date=time.strftime("%Y-%m-%d"),
        command="python benchmarks/quant_quality.py " + " ".join(sys.argv[1:]),
        machine=dict(cpu=cpu_model(), threads=torch.get_num_threads(), torch=torch.__version__),
        steps=args.steps,
        new_tokens=args.new,
        minutes=round((time.time() - start) / 60, 1),
        models=models,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "results.md").write_text(markdown(report))
    print(f"wrote {out / 'results.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
