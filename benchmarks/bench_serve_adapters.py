"""Serving LoRA adapters unmerged (`serve --adapter NAME=DIR`) against one merged model: tokens/s
at a few client counts with the requests spread over 1, 2 or 4 adapters, and the same load on a
server of the first adapter merged into the base (`--checkpoint MERGED`), side by side.

A random LLaMA-style model (seeded; bench_serve's sizes) is written as an HF directory with a
character-level HF tokenizer; four PEFT adapters (r=16 on all seven projections, random B) are
made for it with our add_lora + save_adapter, and the first is merged (`load_any(adapter=...)`,
our fold) and written as a second HF directory. Two servers run at once as their own processes:
the base with the four adapters, and the merged model. The measurements are interleaved: each
round goes through the client counts, and at each count through merged, 1, 2 and 4 adapters,
so that the machine's drift falls on all of them alike; the ratio (adapters over merged) is taken
per round and its median reported. A request for adapter k of n goes to the k-th name in turn
(client i's j-th request: adapter (i + j) mod n), so rows of different adapters share decode
steps. Clients, requests and token counting are bench_serve's (asyncio streams, greedy, streamed
/v1/completions, completion tokens from `usage` over wall time).

    python benchmarks/bench_serve_adapters.py [--json] [--size small|124m] [--rounds 3]
        [--requests 16] [--max-tokens 64] [--concurrency 1,4,8,16] [--rank 16] [--in-process]
        [--threads N]

``--in-process`` measures the two engines in this process instead, without HTTP: at each client
count, ``c`` greedy requests submitted at once and stepped to the end, merged and adapters in
turn, for ``--rounds`` short rounds; on a machine shared with other work its ratios hold up
better than the servers' (each measurement is a second or two, alternated).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import CORPUS, SIZES, free_port, launch, one_request, write_model  # noqa: E402

from llm_foundry.bench import cpu_model  # noqa: E402

TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
N_ADAPTERS = 4


def write_adapters(model_dir: Path, out: Path, rank: int) -> tuple[list[Path], Path]:
    """(N_ADAPTERS PEFT adapter directories for the model in ``model_dir``, an HF directory of
    the first merged into it)."""
    import shutil

    from llm_foundry.interop.hf import to_hf
    from llm_foundry.interop.peft import save_adapter
    from llm_foundry.loading import load_any
    from llm_foundry.models.lora import add_lora, lora_layers

    adapters = []
    for k in range(N_ADAPTERS):
        model = load_any(model_dir).model
        add_lora(model, TARGETS, r=rank, alpha=2 * rank)
        g = torch.Generator().manual_seed(100 + k)
        with torch.no_grad():
            for layer in lora_layers(model).values():
                layer.lora_B.normal_(0.0, 0.02, generator=g)
        adapters.append(save_adapter(model, out / f"adapter{k}"))
    merged = out / "merged"
    to_hf(load_any(model_dir, adapter=adapters[0]).model, merged)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, merged / name)
    return adapters, merged


def start(args: list[str], port: int) -> subprocess.Popen:
    """``llm-foundry serve ARGS`` on ``port``, once /health answers."""
    cmd = [sys.executable, "-m", "llm_foundry", "serve", "--port", str(port), *args]
    return launch(cmd, {**os.environ, "HF_HUB_OFFLINE": "1"}, port, f"serve {args}", 300)


def spread_load(url, names: list[str], prompts, clients: int, requests: int, max_tokens: int):
    """bench_serve's load test with the requests spread over the model ``names``: client i's
    j-th request asks for names[(i + j) % len(names)]."""
    import asyncio

    import aiohttp

    async def run():
        todo = list(range(requests))
        ttft, tokens = [], []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:

            async def worker(i):
                j = 0
                while todo:
                    r = todo.pop()
                    name = names[(i + j) % len(names)]
                    f, n = await one_request(session, url, name, prompts[r % len(prompts)],
                                             max_tokens)  # fmt: skip
                    ttft.append(f)
                    tokens.append(n)
                    j += 1

            t0 = time.perf_counter()
            await asyncio.gather(*(worker(i) for i in range(clients)))
            return time.perf_counter() - t0, ttft, tokens

    wall, ttft, tokens = asyncio.run(run())
    return dict(clients=clients, requests=requests, tokens=sum(tokens), wall_s=wall,
                tokens_per_s=sum(tokens) / wall, ttft_median_s=statistics.median(ttft))  # fmt: skip


def engine_load(engine, names: list[str], prompts, clients: int, max_tokens: int) -> dict:
    """``clients`` greedy requests (request i for names[i % len(names)]) stepped to the end."""
    from llm_foundry.serve.engine import Params, Sequence

    seqs = [Sequence(engine.tok.encode(prompts[i % len(prompts)], add_special_tokens=False),
                     Params(max_tokens=max_tokens, temperature=0), lambda kind, payload: None,
                     adapter=int(names[i % len(names)][1:]) + 1 if names != ["m"] else 0)
            for i in range(clients)]  # fmt: skip
    t0 = time.perf_counter()
    engine.submit(seqs)
    while any(not s.finished for s in seqs):
        engine.step()
    wall = time.perf_counter() - t0
    tokens = sum(len(s.tokens) for s in seqs)
    return dict(clients=clients, tokens=tokens, wall_s=wall, tokens_per_s=tokens / wall)


def load_average() -> float:
    """The 1-minute load average (other work on the machine while measuring)."""
    return os.getloadavg()[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--size", choices=["small", "124m"], default="small",
                    help="small: llama-shakespeare (9.5M); 124m: bench_serve's 124.7M config")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=16, help="requests per measurement")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", default="1,4,8,16")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--in-process", action="store_true", help="the engines, without HTTP")
    ap.add_argument("--threads", type=int, default=None, help="torch threads of the model "
                    "(servers: OMP_NUM_THREADS); on a machine others load, 1 stalls less")  # fmt: skip
    ns = ap.parse_args()
    if ns.threads:
        torch.set_num_threads(ns.threads)
        os.environ["OMP_NUM_THREADS"] = str(ns.threads)  # the servers' too
    text = CORPUS.read_text() if CORPUS.exists() else "ROMEO: But soft, what light?\n" * 100
    prompts = [line for line in text.splitlines() if len(line) > 20][:200]
    levels = [int(c) for c in ns.concurrency.split(",")]
    name, size = list(SIZES.items())[0 if ns.size == "small" else 1]
    report = dict(
        date=time.strftime("%Y-%m-%d"), machine=platform.processor() or platform.machine(),
        cpu=cpu_model(), threads=torch.get_num_threads(), torch=torch.__version__, model=name,
        rank=ns.rank, targets=list(TARGETS), max_tokens=ns.max_tokens, requests=ns.requests,
        rounds=ns.rounds, command=" ".join(["python", *sys.argv]), runs=[],
        in_process=ns.in_process,
    )  # fmt: skip
    configs = {"merged": ["m"], **{f"{k} adapters": [f"a{i}" for i in range(k)] for k in (1, 2, 4)}}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(size, Path(tmp) / "base", text)
        adapters, merged = write_adapters(model_dir, Path(tmp), ns.rank)
        slots = str(max(levels))
        if ns.in_process:
            from llm_foundry.serve import load_served

            engines = {"merged": load_served(merged, int(slots), name="m").engine,
                       "adapters": load_served(model_dir, int(slots), name="base",
                                               adapters={f"a{i}": a for i, a in
                                                         enumerate(adapters)}).engine}  # fmt: skip
            for config, names in configs.items():  # warm-up
                engine_load(engines["merged" if config == "merged" else "adapters"], names,
                            prompts, 2, 8)  # fmt: skip
            for rnd in range(ns.rounds):
                for c in levels:
                    for config, names in configs.items():
                        load = load_average()
                        engine = engines["merged" if config == "merged" else "adapters"]
                        r = engine_load(engine, names, prompts, c, ns.max_tokens)
                        r.update(round=rnd, config=config, load_before=load)
                        report["runs"].append(r)
                        print(f"round {rnd} {c:3} clients {config:11}: {r['tokens_per_s']:8.1f} "
                              f"tok/s (load {load:.1f})", file=sys.stderr, flush=True)  # fmt: skip
        specs = [x for i, a in enumerate(adapters) for x in ("--adapter", f"a{i}={a}")]
        ports = {"merged": free_port(), "adapters": free_port()}
        procs = [] if ns.in_process else [
            start(["--checkpoint", str(merged), "--model-name", "m", "--slots", slots],
                  ports["merged"]),
            start(["--checkpoint", str(model_dir), "--model-name", "base", "--slots", slots,
                   *specs], ports["adapters"]),
        ]  # fmt: skip
        try:
            for config, names in configs.items() if procs else ():  # warm-up
                url = f"http://127.0.0.1:{ports['merged' if config == 'merged' else 'adapters']}"
                spread_load(url, names, prompts, 2, 4, 8)
            for rnd in range(ns.rounds if procs else 0):
                for c in levels:
                    for config, names in configs.items():
                        server = "merged" if config == "merged" else "adapters"
                        url = f"http://127.0.0.1:{ports[server]}"
                        load = load_average()
                        r = spread_load(url, names, prompts, c, max(ns.requests, c),
                                        ns.max_tokens)  # fmt: skip
                        r.update(round=rnd, config=config, load_before=load)
                        report["runs"].append(r)
                        print(f"round {rnd} {c:3} clients {config:11}: {r['tokens_per_s']:8.1f} "
                              f"tok/s (load {load:.1f})", file=sys.stderr, flush=True)  # fmt: skip
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(timeout=30)
    summary = {}
    for c in levels:
        per = {}
        for config in configs:
            per[config] = [r["tokens_per_s"] for r in report["runs"]
                           if r["clients"] == c and r["config"] == config]  # fmt: skip
        row = {"merged_tokens_per_s": statistics.median(per["merged"])}
        for config in list(configs)[1:]:
            ratios = [a / m for a, m in zip(per[config], per["merged"], strict=True)]
            row[config] = dict(tokens_per_s=statistics.median(per[config]),
                               over_merged=statistics.median(ratios),
                               over_merged_range=[min(ratios), max(ratios)])  # fmt: skip
        summary[c] = row
    report["summary"] = summary
    if ns.json:
        print(json.dumps(report, indent=1))
    for c, row in summary.items():
        cells = ", ".join(f"{k}: {v['tokens_per_s']:.1f} tok/s = {v['over_merged']:.2f}x "
                          f"({v['over_merged_range'][0]:.2f}-{v['over_merged_range'][1]:.2f})"
                          for k, v in row.items() if k != "merged_tokens_per_s")  # fmt: skip
        print(f"{c:3} clients: merged {row['merged_tokens_per_s']:.1f} tok/s; {cells}",
              file=sys.stderr)  # fmt: skip


if __name__ == "__main__":
    main()
