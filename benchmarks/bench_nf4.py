"""LoRA over a frozen base held in fp32, bf16, int8 or nf4 (QLoRA, Dettmers et al. 2023).

Three parts, each on its own flag (all by default):
  memory   Llama-2-7B (preset llama2-7b: 4096 dim, 32 layers, 11008 MLP, 32000 vocab) with r=8
           on every linear layer, built on the meta device: the bytes of the adapted
           projections' frozen tensors as each base holds them (``frozen_base_bytes``, from the
           tensors), beside the 4-bit layout's bytes worked out from the shapes alone.
  speed    ms per LoRA training step (forward, backward, AdamW on the adapters) of the same
           model and batches on each base, interleaved round-robin so that machine noise hits
           every base alike; the demo model (llama-shakespeare-char) and a wider one.
  quality  the README's fine-tune demo (``--sft-demo`` rows, LoRA on a ``make demo``-style base
           run) on an int8 and an nf4 base, 2 seeds each, through ``llm-foundry finetune``: val
           loss at the end and its best, nf4 vs int8 beside the spread between seeds.

    python benchmarks/bench_nf4.py [--memory] [--speed] [--quality] [--threads N] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from llm_foundry.checkpoint import meta_transformer
from llm_foundry.models import Transformer
from llm_foundry.models.lora import TARGETS, add_lora, frozen_base_bytes, lora_layers
from llm_foundry.models.nf4 import ABSMAX_BLOCK, BLOCK
from llm_foundry.presets import get_preset

BASES = ("fp32", "bf16", "int8", "nf4")
SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"


def four_bit_bytes(numel: int) -> int:
    """Bytes of one weight of ``numel`` values in models/nf4.py's layout, from its shape: 4 bits
    a weight, 1 byte per block of 64, an fp32 scale per 256 blocks, one fp32 offset."""
    blocks = -(numel // -BLOCK)
    return blocks * BLOCK // 2 + blocks + 4 * -(blocks // -ABSMAX_BLOCK) + 4


def memory() -> dict:
    cfg = get_preset("llama2-7b")
    settings = dict(targets=list(TARGETS), r=8, alpha=16.0, dropout=0.0, rslora=False)
    rows = {}
    for base in (*BASES, "int4"):
        model = meta_transformer(cfg, lora={**settings, "base_dtype": base})
        held, fp32 = frozen_base_bytes(model)
        layers = lora_layers(model).values()
        adapters = sum(m.lora_A.nbytes + m.lora_B.nbytes for m in layers)
        rest = sum(
            t.nbytes
            for n, t in [*model.named_parameters(), *model.named_buffers()]
            if ".base." not in n and ".lora_" not in n
        )
        weights = sum(m.base.in_features * m.base.out_features for m in layers)
        rows[base] = dict(
            frozen_bytes=held, frozen_gib=held / 2**30, vs_fp32=held / fp32,
            bits_per_weight=8 * held / weights, adapters_bytes=adapters, rest_bytes=rest,
            model_gib=(held + adapters + rest) / 2**30, adapted_weights=weights,
            layers=len(layers),
        )  # fmt: skip
        if base in ("nf4", "int4"):
            shapes = sum(four_bit_bytes(m.base.in_features * m.base.out_features) for m in layers)
            rows[base]["from_shapes_bytes"] = shapes
            assert shapes == held, (base, shapes, held)
    return rows


def speed(rounds: int, steps: int) -> list[dict]:
    sizes = {
        "demo (llama-shakespeare-char, 0.8M)": (get_preset("llama-shakespeare-char",
                                                           max_seq_len=128), 12, 128),
        "wide (dim 512, 4 layers, 11M)": (get_preset("llama-shakespeare-char", dim=512,
                                                     n_heads=8, n_kv_heads=8, hidden_dim=1408,
                                                     max_seq_len=128), 8, 128),
    }  # fmt: skip
    results = []
    for name, (cfg, batch, block) in sizes.items():
        torch.manual_seed(0)
        plain = Transformer(cfg)
        contenders = {}
        for base in BASES:
            model = Transformer(cfg)
            model.load_state_dict(plain.state_dict())
            targets = [t for t in TARGETS if not (t == "lm_head" and cfg.tie_embeddings)]
            add_lora(model, targets, r=8, alpha=16.0, base_dtype=base)
            opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
            contenders[base] = (model.train(), opt)
        g = torch.Generator().manual_seed(0)
        batches = [torch.randint(0, cfg.vocab_size, (2, batch, block), generator=g)
                   for _ in range(steps)]  # fmt: skip
        times = {base: [] for base in BASES}

        def step(model, opt, xy):
            loss = model(xy[0], xy[1])[1]
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for model, opt in contenders.values():  # warm-up
            for xy in batches[:2]:
                step(model, opt, xy)
        load = []
        for _ in range(rounds):
            load.append(os.getloadavg()[0])
            for base, (model, opt) in contenders.items():
                t = time.perf_counter()
                for xy in batches:
                    step(model, opt, xy)
                times[base].append((time.perf_counter() - t) / len(batches))
        fp32 = times["fp32"]
        row = dict(model=name, batch=batch, block=block, rounds=rounds, steps=steps,
                   load_avg=load)  # fmt: skip
        for base in BASES:
            row[base] = dict(
                ms_median=1e3 * statistics.median(times[base]),
                ms_all=[1e3 * t for t in times[base]],
                vs_fp32_median=statistics.median(
                    t / f for t, f in zip(times[base], fp32, strict=True)
                ),
            )
        results.append(row)
        print(json.dumps({k: (v["ms_median"], v["vs_fp32_median"]) if isinstance(v, dict) else v
                          for k, v in row.items() if k in BASES or k == "model"}))  # fmt: skip
    return results


def quality(work: Path, base_steps: int, seeds: tuple[int, ...]) -> dict:
    from llm_foundry.cli import main

    if SHAKESPEARE.is_file():
        os.environ.setdefault("LLM_FOUNDRY_SHAKESPEARE", str(SHAKESPEARE))
    data, base, sft = work / "data", work / "base", work / "sft"
    assert main(["prepare", "--dataset", "shakespeare", "--out", str(data)]) == 0
    t = time.perf_counter()
    argv = ["train", "--data", str(data), "--out", str(base), "--train.max_steps", str(base_steps)]
    assert main([*argv, "--train.progress", "false"]) == 0
    base_s = time.perf_counter() - t
    argv = ["prepare", "--dataset", "shakespeare", "--sft-demo", "--tokenizer-from", str(base)]
    assert main([*argv, "--out", str(sft)]) == 0
    runs = {}
    for base_dtype in ("int8", "nf4"):
        for seed in seeds:
            out = work / f"ft-{base_dtype}-{seed}"
            argv = ["finetune", "--checkpoint", str(base), "--data", str(sft), "--out", str(out)]
            argv += ["--train.lora_r", "8", "--train.lora_targets", "wq,wv,w1,w2,w3",
                     "--train.max_steps", "300", "--train.block_size", "128",
                     "--model.max_seq_len", "128", "--train.lr", "3e-3",
                     "--train.warmup_steps", "20", "--train.progress", "false",
                     "--train.lora_base_dtype", base_dtype, "--train.seed", str(seed)]  # fmt: skip
            t = time.perf_counter()
            assert main(argv) == 0
            recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
            val = [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]
            runs[f"{base_dtype} seed {seed}"] = dict(
                base_dtype=base_dtype, seed=seed, val=val, final=val[-1][1],
                best=min(v for _, v in val), seconds=time.perf_counter() - t,
            )  # fmt: skip
    summary = {}
    for base_dtype in ("int8", "nf4"):
        finals = [r["final"] for r in runs.values() if r["base_dtype"] == base_dtype]
        summary[base_dtype] = dict(finals=finals, mean=statistics.mean(finals),
                                   seed_spread=max(finals) - min(finals))  # fmt: skip
    summary["nf4_minus_int8"] = summary["nf4"]["mean"] - summary["int8"]["mean"]
    return dict(base_steps=base_steps, base_seconds=base_s, runs=runs, summary=summary)


def main_() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--memory", action="store_true")
    p.add_argument("--speed", action="store_true")
    p.add_argument("--quality", action="store_true")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=5, help="timed steps per base per round")
    p.add_argument("--base-steps", type=int, default=2000, help="the base run (make demo: 2000)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", type=Path, default=None)
    ns = p.parse_args()
    if ns.threads:  # one thread: steadier timings where other work shares the cores
        torch.set_num_threads(ns.threads)
    every = not (ns.memory or ns.speed or ns.quality)
    # a file that exists keeps the parts this run does not redo; each part says how it was run
    out = json.loads(ns.json.read_text()) if ns.json and ns.json.is_file() else {}
    out.update(
        cpu=next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                  if ln.startswith("model name")), platform.processor()),
        torch=torch.__version__,
    )  # fmt: skip
    parts = {
        "memory": lambda: memory(),
        "speed": lambda: speed(ns.rounds, ns.steps),
        "quality": lambda: quality_in_temp(ns.base_steps),
    }
    for name, run in parts.items():
        if not (getattr(ns, name) or every):
            continue
        started = dict(date=time.strftime("%Y-%m-%d %H:%M"), threads=torch.get_num_threads(),
                       load_start=os.getloadavg())  # fmt: skip
        result = run()
        out[name] = dict(command=" ".join(["python", *sys.argv]), **started,
                         load_end=os.getloadavg(), result=result)  # fmt: skip
        print(json.dumps({name: result if name != "speed" else "see the table above"})[:2000])
    if ns.json:
        ns.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


def quality_in_temp(base_steps: int) -> dict:
    with tempfile.TemporaryDirectory() as work:
        return quality(Path(work), base_steps, (1337, 1338))


if __name__ == "__main__":
    sys.exit(main_())
