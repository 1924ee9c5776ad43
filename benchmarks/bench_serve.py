"""Serving throughput: `llm-foundry serve` (continuous batching) at 1, 4, 8 and 16 concurrent
clients, against the same server taking requests one at a time (1 client) and against
`transformers serve --continuous-batching` on the same weights, in the same run.

Two LLaMA-style sizes with random weights (seeded): the `llama-shakespeare` preset (9.5M) and a
124.7M config (768 dim, 12 layers, 12 heads, 4 KV heads, MLP 2048, vocab 32000). Each is written
once as an HF directory with a character-level HF tokenizer (tiny Shakespeare's characters,
padded with filler tokens to the vocabulary), which both servers load. Every client (an
asyncio stream of one load-generator process, aiohttp) sends /v1/completions requests back to
back (streamed, greedy, a line of Shakespeare as the prompt, a fixed max_tokens); aggregate
tokens/s = completion tokens (from `usage`) over wall time, time to first
token = first non-empty text chunk. Servers run one at a time, each as its own process.

    python benchmarks/bench_serve.py [--json] [--quick] [--requests 24] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from llm_foundry.bench import cpu_model

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
SIZES = {
    "llama-shakespeare (9.5M)": dict(preset="llama-shakespeare"),
    "llama-124M": dict(
        preset="llama-shakespeare",
        vocab_size=32000,
        dim=768,
        n_layers=12,
        n_heads=12,
        n_kv_heads=4,
        hidden_dim=2048,
        max_seq_len=1024,
    ),  # fmt: skip
}


def write_model(size: dict, out: Path, text: str) -> Path:
    """A random model of ``size`` as an HF directory, with a character tokenizer."""
    from tokenizers import Tokenizer, decoders, models

    from llm_foundry.interop.hf import to_hf
    from llm_foundry.models import Transformer
    from llm_foundry.presets import get_preset

    chars = sorted(set(text))
    overrides = {k: v for k, v in size.items() if k != "preset"}
    vocab_size = overrides.pop("vocab_size", len(chars) + 1)
    vocab = {c: i for i, c in enumerate(chars)}
    vocab["<eos>"] = len(vocab)
    vocab.update({f"<x{i}>": i for i in range(len(vocab), vocab_size)})  # fillers to the vocab
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.Fuse()
    torch.manual_seed(0)
    cfg = get_preset(size["preset"], vocab_size=vocab_size, **overrides)
    to_hf(Transformer(cfg), out)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>",
         "clean_up_tokenization_spaces": False}))  # fmt: skip
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(kind: str, model_dir: Path, port: int, slots: int) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if kind.startswith("ours"):
        cmd = [sys.executable, "-m", "llm_foundry", "serve", "--checkpoint", str(model_dir),
               "--port", str(port), "--slots", str(slots), "--model-name", "m"]  # fmt: skip
        cmd += ["--compile"] if kind == "ours-compiled" else []
    else:
        exe = Path(sys.executable).parent / "transformers"
        cmd = [str(exe), "serve", "--continuous-batching", "--device", "cpu", "--dtype",
               "float32", "--port", str(port), str(model_dir)]  # fmt: skip
    return launch(cmd, env, port, f"{kind} server", 180)


def launch(cmd: list[str], env: dict, port: int, what: str, seconds: float) -> subprocess.Popen:
    """``cmd`` started, returned once its /health on ``port`` answers 200 (``what`` names it in
    the error when it exits or does not answer within ``seconds``)."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"{what} did not start in {seconds:.0f} s")


async def one_request(session, url: str, model: str, prompt: str, max_tokens: int):
    """(time to first token in s, completion tokens) of one streamed greedy completion; only
    the first text chunk and the usage chunk are parsed (the load generator stays light)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    first, tokens = None, 0
    async with session.post(url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for raw in r.content:
            if not raw.startswith(b"data: {"):
                continue
            if first is None:
                chunk = json.loads(raw[6:])
                if any(c.get("text") for c in chunk.get("choices", [])):
                    first = time.perf_counter() - t0
            if b'"usage"' in raw:
                tokens = json.loads(raw[6:])["usage"]["completion_tokens"]
    return first if first is not None else float("nan"), tokens


def load_test(url, model, prompts, clients: int, requests: int, max_tokens: int) -> dict:
    """``clients`` concurrent streams (asyncio, one thread) send ``requests`` in all, back to
    back."""
    import asyncio

    import aiohttp

    async def run():
        todo = list(range(requests))
        ttft, tokens = [], []
        timeout = aiohttp.ClientTimeout(total=None)
        async with aiohttp.ClientSession(timeout=timeout) as session:

            async def worker():
                while todo:
                    i = todo.pop()
                    f, n = await one_request(session, url, model, prompts[i % len(prompts)],
                                             max_tokens)  # fmt: skip
                    ttft.append(f)
                    tokens.append(n)

            t0 = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(clients)))
            return time.perf_counter() - t0, ttft, tokens

    wall, ttft, tokens = asyncio.run(run())
    return dict(clients=clients, requests=requests, tokens=sum(tokens), wall_s=wall,
                tokens_per_s=sum(tokens) / wall, ttft_median_s=statistics.median(ttft),
                ttft_max_s=max(ttft))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true", help="the 9.5M model only, fewer requests")
    ap.add_argument("--requests", type=int, default=32, help="requests per measurement")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", default="1,4,8,16")
    ap.add_argument("--no-transformers", action="store_true")
    ns = ap.parse_args()
    text = CORPUS.read_text() if CORPUS.exists() else "ROMEO: But soft, what light?\n" * 100
    prompts = [line for line in text.splitlines() if len(line) > 20][:200]
    levels = [int(c) for c in ns.concurrency.split(",")]
    sizes = dict(list(SIZES.items())[:1]) if ns.quick else SIZES
    report = dict(
        date=time.strftime("%Y-%m-%d"), machine=platform.processor() or platform.machine(),
        cpu=cpu_model(), threads=torch.get_num_threads(), torch=torch.__version__,
        max_tokens=ns.max_tokens, requests=ns.requests, results={},
    )  # fmt: skip
    servers = ["ours", "ours-compiled"] + ([] if ns.no_transformers else ["transformers"])
    with tempfile.TemporaryDirectory() as tmp:
        for name, size in sizes.items():
            model_dir = write_model(size, Path(tmp) / name.split()[0], text)
            rows = report["results"].setdefault(name, {})
            for kind in servers:
                port = free_port()
                proc = start(kind, model_dir, port, slots=max(levels))
                url = f"http://127.0.0.1:{port}"
                model = "m" if kind.startswith("ours") else str(model_dir)
                try:
                    load_test(url, model, prompts, 2, 4, 8)  # warm-up
                    for c in levels:
                        n = ns.requests if ns.quick is False else max(8, ns.requests // 2)
                        r = load_test(url, model, prompts, c, max(n, c), ns.max_tokens)
                        rows.setdefault(kind, []).append(r)
                        print(f"{name:26} {kind:13} {c:3} clients: {r['tokens_per_s']:8.1f} "
                              f"tok/s, ttft median {r['ttft_median_s'] * 1e3:7.1f} ms",
                              file=sys.stderr, flush=True)  # fmt: skip
                finally:
                    proc.terminate()
                    proc.wait(timeout=30)
            for kind in ("ours", "ours-compiled"):
                ours = {r["clients"]: r["tokens_per_s"] for r in rows[kind]}
                rows[f"{kind}_over_one_at_a_time"] = {c: v / ours[1] for c, v in ours.items()}
                if "transformers" in rows:
                    theirs = {r["clients"]: r["tokens_per_s"] for r in rows["transformers"]}
                    rows[f"{kind}_over_transformers"] = {c: ours[c] / theirs[c] for c in ours}
    if ns.json:
        print(json.dumps(report, indent=1))
    else:
        for name, rows in report["results"].items():
            for key, ratios in rows.items():
                if key.endswith(("_one_at_a_time", "_transformers")):
                    shown = ", ".join(f"{c}: {v:.2f}x" for c, v in ratios.items())
                    print(f"{name}: {key.replace('_', ' ')}: {shown}")


if __name__ == "__main__":
    main()
