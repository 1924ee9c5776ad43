"""A reply's text token by token: decoding the whole reply again at every token (quadratic in its
length) against ``serve.detok`` (the new tokens only), two ways:

- in this process, the text of an 8000-token reply given token by token, for a byte-level BPE
  (read from the tokens' bytes) and a sentencepiece-like tokenizer (a window of its decode);
  both give the same text, checked;
- through ``llm-foundry serve`` in its own process: 8 clients at once each streaming a
  4000-token completion of a random model, the server's tokens per second; the older code
  (``--before``, e.g. a ``git worktree``'s src) and this one in turn, round by round.

    python benchmarks/bench_detok.py [--json OUT] [--before DIR] [--rounds N] [--tokens N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_serve_misuse import byte_bpe, serving  # noqa: E402

# characters a 300-id BPE of CORPUS leaves as bytes, so pieces of characters come and go
REPLY = "First Citizen: hear me speak, naïve café 世界 🙂!\n"


def sentencepiece_like():
    """The LLaMA 2 style tokenizer.json the tests check detok with (Metaspace, byte fallback, a
    decoder that strips the first space): read through windows of its decode."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
    from test_serve_pieces import _metaspace_file

    return _metaspace_file().hf


def in_process(tokens: int) -> dict:
    """Seconds to give an ``tokens``-token reply's text token by token, both ways."""
    from llm_foundry.serve.pieces import Pieces
    from llm_foundry.tokenizer import HFTokenizerFile

    out = {}
    for name, hf in (("byte-level BPE", byte_bpe()), ("sentencepiece-like", sentencepiece_like())):
        pieces = Pieces(HFTokenizerFile(hf))
        ids = (pieces.tok.encode(REPLY) * tokens)[:tokens]
        t = time.perf_counter()
        whole = [pieces.text(ids[:k]) for k in range(1, tokens + 1)]
        t_whole = time.perf_counter() - t
        t = time.perf_counter()
        d, text = pieces.detokenizer(), ""
        for i in ids:
            text += d.add(i)
        text += d.end()
        t_new = time.perf_counter() - t
        assert text == whole[-1] == pieces.text(ids)
        out[name] = {"whole_s": round(t_whole, 3), "detok_s": round(t_new, 4),
                     "ratio": round(t_whole / t_new, 1)}  # fmt: skip
    return out


def build(root: Path) -> Path:
    """A random 2-layer model over the byte-level BPE, 4096 positions (no end of text)."""
    import torch

    from llm_foundry.checkpoint import save_checkpoint
    from llm_foundry.models import Transformer
    from llm_foundry.presets import get_preset

    tok = byte_bpe()
    torch.manual_seed(0)
    cfg = get_preset("llama-shakespeare-char", vocab_size=tok.get_vocab_size(), n_layers=2,
                     dim=64, n_heads=4, n_kv_heads=2, max_seq_len=4096)  # fmt: skip
    save_checkpoint(Transformer(cfg), root / "bpe")
    tok.save(str(root / "bpe" / "tokenizer.json"))
    return root / "bpe"


def clients(url: str, n: int, tokens: int) -> dict:
    """``n`` clients at once, each streaming a ``tokens``-token completion: tokens per second."""
    import httpx

    got: list[int] = []

    def one():
        body = {"model": "m", "prompt": "First", "max_tokens": tokens, "stream": True,
                "temperature": 0, "stream_options": {"include_usage": True}}  # fmt: skip
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=900) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and (usage := json.loads(line[6:]).get("usage")):
                    got.append(usage["completion_tokens"])

    start = time.perf_counter()
    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    assert got == [tokens] * n, got
    return {"seconds": round(seconds, 2), "tokens_per_s": round(n * tokens / seconds)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--before", default=None, help="an older commit's src/ directory, measured "
                   "in turn with this checkout's, round by round")  # fmt: skip
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--tokens", type=int, default=4000, help="each client's reply")
    p.add_argument("--clients", type=int, default=8)
    ns = p.parse_args()
    from llm_foundry.bench import cpu_model

    result = {"cpu": cpu_model(), "date": time.strftime("%Y-%m-%d"),
              "in_process_8000": in_process(8000), "served": []}  # fmt: skip
    print(json.dumps(result["in_process_8000"]), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = build(Path(tmp))
        for _ in range(ns.rounds):
            for src in ([ns.before] if ns.before else []) + [None]:
                with serving(checkpoint, src, slots=ns.clients) as url:
                    row = {"src": src or "this checkout", "load": os.getloadavg(),
                           **clients(url, ns.clients, ns.tokens)}  # fmt: skip
                result["served"].append(row)
                print(json.dumps(row), flush=True)
    if ns.json:
        Path(ns.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
