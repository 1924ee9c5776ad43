"""Two costs one request can put on a server, measured through a real server on a free loopback
port:

- a prompt far past the context (3.9 MB of "a ", under the 4 MiB body limit) sent while another
  client streams: how long until its 400, the streaming client's longest wait between chunks
  meanwhile, and /health's slowest answer (polled every 50 ms);
- logprobs on a 4000-token reply: its time with and without logprobs, whole and streamed.

Random small models (seeded), 4096 positions: a byte-level BPE one (a Hugging Face
``tokenizers`` file, 300 ids, no end-of-text token) for the prompt; it and a character one for
the long replies. Only the public API is used
(the ``serve`` command, in its own process), so the same file runs against an older commit's
``src`` (``--before``, e.g. a ``git worktree``), in turn with this one, round by round.

    python benchmarks/bench_serve_misuse.py [--json OUT] [--src DIR] [--before DIR] [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

CORPUS = "First Citizen:\nBefore we proceed any further, hear me speak.\n" * 40


def byte_bpe():
    """A byte-level BPE (Hugging Face ``tokenizers``, 300 ids) with no special tokens: no end of
    text, so a random model's reply runs to ``max_tokens``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator([CORPUS], trainer)
    return tok


def build(root: Path) -> dict[str, Path]:
    import torch

    from llm_foundry.checkpoint import save_checkpoint
    from llm_foundry.models import Transformer
    from llm_foundry.presets import get_preset
    from llm_foundry.tokenizer import CharTokenizer

    out = {}
    for name, tok in (("bpe", byte_bpe()), ("char", CharTokenizer.train(CORPUS))):
        vocab = tok.get_vocab_size() if name == "bpe" else tok.vocab_size
        torch.manual_seed(0)
        cfg = get_preset("llama-shakespeare-char", vocab_size=vocab, n_layers=2, dim=64,
                         n_heads=4, n_kv_heads=2, max_seq_len=4096)  # fmt: skip
        path = root / name
        save_checkpoint(Transformer(cfg), path)
        (tok.save(str(path / "tokenizer.json")) if name == "bpe"
         else tok.save(path / "tokenizer.json"))  # fmt: skip
        out[name] = path
    return out


@contextmanager
def serving(checkpoint: Path, src: str | None, slots: int = 4):
    """``llm-foundry serve`` of ``checkpoint`` in its own process (a server in this process
    would share the GIL with the clients measuring it), from ``src`` if given."""
    import subprocess

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if src:
        env["PYTHONPATH"] = str(Path(src).resolve())
    code = "import sys; from llm_foundry.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen([sys.executable, "-c", code, "serve", "--checkpoint", str(checkpoint),
                             "--port", str(port), "--slots", str(slots), "--model-name", "m"],
                            env=env, stdout=subprocess.DEVNULL)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def big_prompt(url: str) -> dict:
    """The 3.9 MB prompt while a stream runs: its answer, the stream's longest gap, /health's
    slowest answer."""
    import httpx

    arrivals: list[float] = []
    health: list[float] = []
    done = threading.Event()

    def stream():
        body = {"model": "m", "prompt": "First", "max_tokens": 4000, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    arrivals.append(time.perf_counter())
                if done.is_set():
                    break

    def poll():
        while not done.is_set():
            t = time.perf_counter()
            httpx.get(url + "/health", timeout=60)
            health.append(time.perf_counter() - t)
            time.sleep(0.05)

    threads = [threading.Thread(target=stream), threading.Thread(target=poll)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    body = json.dumps({"model": "m", "prompt": "a " * 1_950_000, "max_tokens": 2})
    start = time.perf_counter()
    r = httpx.post(url + "/v1/completions", content=body, timeout=120,
                   headers={"content-type": "application/json"})  # fmt: skip
    answered = time.perf_counter()
    time.sleep(0.5)
    done.set()
    for t in threads:
        t.join()
    # the waits between chunks that overlap the time the big prompt was in the server
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)
            if b >= start and a <= answered]  # fmt: skip
    return {
        "status": r.status_code,
        "code": r.json()["error"]["code"],
        "answer_s": round(answered - start, 3),
        "stream_longest_gap_s": round(max(gaps, default=float("nan")), 3),
        "health_slowest_s": round(max(health), 3),
    }


def long_replies(url: str) -> dict:
    """Seconds for a 4000-token completion: whole and streamed, with and without logprobs."""
    import httpx

    base = {"model": "m", "prompt": "First", "max_tokens": 4000, "temperature": 0}
    out = {}
    for name, extra in (("whole", {}), ("whole_logprobs_0", {"logprobs": 0}),
                        ("stream", {"stream": True}),
                        ("stream_logprobs_5", {"stream": True, "logprobs": 5})):  # fmt: skip
        t = time.perf_counter()
        r = httpx.post(url + "/v1/completions", json={**base, **extra}, timeout=600)
        assert r.status_code == 200, r.text[:300]
        if not extra.get("stream"):
            assert r.json()["usage"]["completion_tokens"] == 4000
        out[name] = round(time.perf_counter() - t, 2)
    return out


def measure(models: dict[str, Path], src: str | None) -> dict:
    """One round against the code in ``src`` (None: this checkout)."""
    with serving(models["bpe"], src) as url:
        prompt = big_prompt(url)
    replies = {}
    for name in ("char", "bpe"):
        with serving(models[name], src) as url:
            replies[name] = long_replies(url)
    return {"src": src or "this checkout", "load": os.getloadavg(), "big_prompt": prompt,
            "long_replies_s": replies}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--src", default=None, help="the src/ directory of the code to measure")
    p.add_argument("--before", default=None, help="another src/ directory (an older commit's) "
                   "measured in turn with --src, round by round")  # fmt: skip
    p.add_argument("--rounds", type=int, default=1)
    ns = p.parse_args()
    from llm_foundry.bench import cpu_model

    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        models = build(Path(tmp))
        for _ in range(ns.rounds):
            for src in ([ns.before] if ns.before else []) + [ns.src]:
                rounds.append(measure(models, src))
                print(json.dumps(rounds[-1]), flush=True)
    result = {"cpu": cpu_model(), "date": time.strftime("%Y-%m-%d"), "rounds": rounds}
    if ns.json:
        Path(ns.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
