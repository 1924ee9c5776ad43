"""Decode speed: llm-foundry's KV-cache generation vs HF transformers `generate`, same weights.

For two LLaMA-style sizes (the `llama-shakespeare` preset, 9.5M, and a 124.7M config: 768 dim,
12 layers, 12 heads, 4 KV heads, vocab 32000, MLP 2048), a random HF `LlamaForCausalLM` is built
and imported with `interop.hf.from_hf`, so both sides hold identical weights. Greedy, fp32, a
16-token prompt, 128 new tokens, batch 1 and 8; contenders interleaved round by round and the
median kept. Tokens are checked equal to HF's.

Next to each number: the physical bound at batch 1, bytes read per decoded token (fp32 weights +
the KV cache at mean context) over this machine's memory bandwidth, measured here two ways: a
streaming reduction (`tensor.sum()` over 1 GiB) and what a matrix-vector product actually streams
(`F.linear` of one vector with 100 distinct weight matrices). Then KV-cache bytes for MHA, GQA
and MQA at the same size and context.

Bit widths (batch 1, the 124.7M config and a 0.6B Qwen3-class config, `--bits`): ours at fp32,
bf16, int8 and int4 (groups of 64; compiled decode step), HF `generate` fp32, and llama.cpp
(llama-cpp-python, the same threads) running our GGUF export of the same weights at f32, f16,
q8_0 and q4_0 (a placeholder vocabulary of single characters: random weights, speed only). Each
row: tokens/s, the weight + KV bytes one token reads, and that over the streaming-read bandwidth
as the bound (llama.cpp's gemv streams faster than BLAS's, so the gemv figure is no bound).

    python benchmarks/bench_generate.py [--json] [--rounds 3] [--new 128] [--quick] [--bits]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers

from llm_foundry.bench import cpu_model
from llm_foundry.generate import generate
from llm_foundry.interop.hf import from_hf
from llm_foundry.models import Transformer
from llm_foundry.presets import get_preset

SIZES = {
    "llama-shakespeare (9.5M)": dict(
        vocab_size=65,
        hidden_size=384,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=2,
        intermediate_size=1024,
        max_position_embeddings=256,
    ),
    "llama-124M": dict(
        vocab_size=32000,
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        intermediate_size=2048,
        max_position_embeddings=1024,
    ),
}
PROMPT = 16
# Qwen3-0.6B's shape (Qwen team 2025): the 0.5-1B class, tied embeddings, 151,936 ids
QWEN3_06B = dict(
    vocab_size=151936,
    hidden_size=1024,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=3072,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
)


def bandwidth() -> dict:
    """Bytes/s of a streaming read (sum) and of gemv over weights that do not fit in cache."""
    x = torch.randn(256 * 1024 * 1024)  # 1 GiB fp32
    x.sum()
    t = time.perf_counter()
    for _ in range(5):
        x.sum()
    read = x.numel() * 4 * 5 / (time.perf_counter() - t)
    del x
    ws = [torch.randn(1024, 768) for _ in range(100)]  # 315 MB
    v = torch.randn(1, 768)
    for w in ws:
        F.linear(v, w)
    t = time.perf_counter()
    for _ in range(3):
        for w in ws:
            F.linear(v, w)
    gemv = sum(w.numel() for w in ws) * 4 * 3 / (time.perf_counter() - t)
    return dict(sum_gb_s=round(read / 1e9, 1), gemv_gb_s=round(gemv / 1e9, 1))


def hf_generate(hf, idx, new):
    """HF ``generate`` of exactly ``new`` greedy tokens (no end-of-sequence stop)."""
    return lambda: hf.generate(
        idx,
        attention_mask=torch.ones_like(idx),
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )


def contenders(hf, ours, idx, new):
    return {
        "HF transformers generate": hf_generate(hf, idx, new),
        "llm-foundry generate (eager)": lambda: generate(ours, idx, new, temperature=0),
        "llm-foundry generate (compiled decode)": lambda: generate(
            ours, idx, new, temperature=0, compile=True
        ),
    }


@torch.no_grad()
def measure(size: str, hf_cfg: dict, batch: int, new: int, rounds: int) -> dict:
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_cfg)).eval()
    ours = from_hf(hf)
    idx = torch.randint(0, hf_cfg["vocab_size"], (batch, PROMPT))
    fns = contenders(hf, ours, idx, new)
    outputs, warm = {}, {}
    for name, fn in fns.items():  # warm-up; compiles the decode step once
        t = time.perf_counter()
        outputs[name] = fn()
        warm[name] = time.perf_counter() - t
    reference = outputs["HF transformers generate"]
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    hf_tps = batch * new / statistics.median(times["HF transformers generate"])
    rows = []
    for name in fns:
        tps = batch * new / statistics.median(times[name])
        rows.append(
            dict(
                name=name,
                tokens_per_s=round(tps, 1),
                vs_hf=round(tps / hf_tps, 2),
                same_tokens_as_hf=bool(torch.equal(outputs[name], reference)),
                first_call_s=round(warm[name], 1),
            )
        )
    params = sum(p.numel() for p in ours.parameters())
    mean_ctx = PROMPT + new / 2
    kv = ours.kv_cache_bytes_per_token(4) * mean_ctx
    return dict(
        size=size,
        batch=batch,
        params=params,
        bytes_per_token_b1=int(params * 4 + kv),
        rows=rows,
    )


def placeholder_tokenizer(n: int):
    """A character vocabulary of ``n`` distinct code points (no surrogates), for the GGUF file."""
    from llm_foundry.tokenizer import CharTokenizer

    chars = (chr(c) for c in range(0x4E00, 0x4E00 + n + 2048) if not 0xD800 <= c < 0xE000)
    return CharTokenizer([next(chars) for _ in range(n)])


def llama_cpp_decode(path: Path, prompt: list[int], new: int, threads: int):
    """A function decoding ``new`` greedy tokens after ``prompt`` in llama.cpp, one at a time."""
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(prompt) + new + 8, n_threads=threads,
                          n_threads_batch=threads, verbose=False)  # fmt: skip

    def run():
        llm.reset()
        llm.eval(prompt)
        out = []
        for _ in range(new):
            out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval([out[-1]])
        return out

    return llm, run


GGUF_BYTES = {"f32": 4.0, "f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}  # per weight, with scales


@torch.no_grad()
def bit_widths(size: str, hf_cls, hf_cfg: dict, new: int, rounds: int, read_gb_s: float) -> dict:
    """Batch-1 decode at each bit width, ours and llama.cpp's, on the same random weights."""
    from llm_foundry.interop.gguf import export_gguf
    from llm_foundry.models.quant import quantize_model, weight_bytes

    torch.manual_seed(0)
    hf = hf_cls(getattr(transformers, hf_cls.__name__.replace("ForCausalLM", "Config"))(**hf_cfg))
    hf = hf.eval()
    ours = from_hf(hf)
    idx = torch.randint(0, hf_cfg["vocab_size"], (1, PROMPT))
    mean_ctx = PROMPT + new / 2
    kv = ours.kv_cache_bytes_per_token(4) * mean_ctx
    models = {"fp32": ours, "bf16": copy.deepcopy(ours).to(torch.bfloat16)}
    for scheme in ("int8", "int4"):
        models[scheme] = copy.deepcopy(ours)
        quantize_model(models[scheme], scheme, 64)
    fns = {
        "HF transformers generate fp32": (
            hf_generate(hf, idx, new),
            weight_bytes(ours) + kv,
        )
    }
    for name, m in models.items():
        fns[f"llm-foundry {name} (compiled decode)"] = (
            lambda m=m: generate(m, idx, new, temperature=0, compile=True),
            weight_bytes(m) + kv * (0.5 if name == "bf16" else 1),
        )
    tmp = tempfile.TemporaryDirectory()
    tok = placeholder_tokenizer(hf_cfg["vocab_size"])
    held = []
    try:
        import llama_cpp  # noqa: F401

        n_weights = sum(p.numel() for n, p in ours.named_parameters() if "tok_emb" not in n)
        if ours.cfg.tie_embeddings:
            n_weights += ours.tok_emb.weight.numel()  # llama.cpp reads it as the output head
        for outtype in ("f32", "f16", "q8_0", "q4_0"):
            path = export_gguf(ours, tok, Path(tmp.name) / f"{outtype}.gguf", outtype)
            llm, fn = llama_cpp_decode(path, idx[0].tolist(), new, torch.get_num_threads())
            held.append(llm)
            kv_llama = ours.kv_cache_bytes_per_token(2) * mean_ctx  # llama.cpp's f16 KV cache
            fns[f"llama.cpp {outtype} (our GGUF)"] = (
                fn,
                n_weights * GGUF_BYTES[outtype] + kv_llama,
            )
    except ImportError:
        fns["llama.cpp"] = (None, "llama-cpp-python not installed: scripts/install_llama_cpp.sh")
    warm, times = {}, {name: [] for name, (fn, _) in fns.items() if fn is not None}
    for name in times:
        t = time.perf_counter()
        fns[name][0]()
        warm[name] = time.perf_counter() - t
    for _ in range(rounds):
        for name in times:
            t = time.perf_counter()
            fns[name][0]()
            times[name].append(time.perf_counter() - t)
    rows = []
    for name, (fn, nbytes) in fns.items():
        if fn is None:
            rows.append(dict(name=name, note=nbytes))
            continue
        tps = new / statistics.median(times[name])
        bound = read_gb_s * 1e9 / nbytes
        rows.append(dict(name=name, tokens_per_s=round(tps, 1), mib_per_token=round(nbytes / 2**20, 1),
                         bound_tokens_per_s=round(bound, 1), of_bound=round(tps / bound, 2),
                         first_call_s=round(warm[name], 1)))  # fmt: skip
    del held
    tmp.cleanup()
    params = sum(p.numel() for p in ours.parameters())
    return dict(size=size, params=params, new_tokens=new, rows=rows)


def kv_table(context: int = 1024) -> list[dict]:
    """KV-cache bytes of the 124M config with 12 (MHA), 4 (GQA) and 1 (MQA) KV heads."""
    out = []
    for name, kv in (("MHA", 12), ("GQA", 4), ("MQA", 1)):
        cfg = get_preset("llama-shakespeare", vocab_size=32000, dim=768, n_layers=12, n_heads=12)
        cfg = cfg.replace(n_kv_heads=kv, hidden_dim=2048, max_seq_len=context)
        with torch.device("meta"):
            model = Transformer(cfg)
        per_token = model.kv_cache_bytes_per_token(2)
        out.append(
            dict(
                attention=name,
                n_kv_heads=kv,
                bytes_per_token_bf16=per_token,
                mib_per_sequence_bf16=round(per_token * context / 2**20, 1),
                mib_per_sequence_fp32=round(2 * per_token * context / 2**20, 1),
            )
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new", type=int, default=128, help="new tokens per generation")
    ap.add_argument("--quick", action="store_true", help="small model only, 2 rounds, 32 tokens")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--bits", action="store_true", help="only the bit-width rows (batch 1)")
    ap.add_argument("--big-new", type=int, default=32, help="new tokens for the 0.6B config")
    args = ap.parse_args()
    sizes = dict(list(SIZES.items())[:1]) if args.quick else SIZES
    if args.quick:
        args.rounds, args.new = 2, 32
    bw = bandwidth()
    results = [
        measure(size, cfg, batch, args.new, args.rounds)
        for size, cfg in ({} if args.bits else sizes).items()
        for batch in (1, 8)
    ]
    bits = [bit_widths("llama-124M", transformers.LlamaForCausalLM, SIZES["llama-124M"], args.new,
                       args.rounds, bw["sum_gb_s"])]  # fmt: skip
    if not args.quick:
        bits.append(bit_widths("qwen3-0.6B-class", transformers.Qwen3ForCausalLM, QWEN3_06B,
                               args.big_new, max(1, args.rounds - 1), bw["sum_gb_s"]))  # fmt: skip
    for r in results:
        r["bound_tokens_per_s_sum_bw"] = round(bw["sum_gb_s"] * 1e9 / r["bytes_per_token_b1"], 1)
        r["bound_tokens_per_s_gemv_bw"] = round(bw["gemv_gb_s"] * 1e9 / r["bytes_per_token_b1"], 1)
    report = dict(
        date=time.strftime("%Y-%m-%d"),
        command="python benchmarks/bench_generate.py " + " ".join(sys.argv[1:]),
        machine=dict(
            cpu=cpu_model(),
            threads=torch.get_num_threads(),
            torch=torch.__version__,
            transformers=transformers.__version__,
        ),
        bandwidth=bw,
        results=results,
        bit_widths=bits,
        kv_cache_124m_ctx1024=kv_table(),
    )
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"{report['date']}  torch {torch.__version__}  transformers {transformers.__version__}; "
        f"bandwidth: sum {bw['sum_gb_s']} GB/s, gemv {bw['gemv_gb_s']} GB/s"
    )
    for r in results:
        print(
            f"\n{r['size']}, batch {r['batch']} ({r['params']:,} params; batch-1 bound "
            f"{r['bound_tokens_per_s_sum_bw']} tok/s at sum bandwidth, "
            f"{r['bound_tokens_per_s_gemv_bw']} at gemv bandwidth)"
        )
        for row in r["rows"]:
            print(
                f"  {row['name']:<42}{row['tokens_per_s']:>9} tok/s  {row['vs_hf']:>5}x HF"
                f"  same tokens: {row['same_tokens_as_hf']}"
            )
    for b in bits:
        print(f"\n{b['size']} ({b['params']:,} params), batch 1, {b['new_tokens']} new tokens:")
        for row in b["rows"]:
            if "note" in row:
                print(f"  {row['name']:<42} {row['note']}")
                continue
            print(
                f"  {row['name']:<42}{row['tokens_per_s']:>8} tok/s  {row['mib_per_token']:>7} MiB"
                f"/token  bound {row['bound_tokens_per_s']:>7}  {row['of_bound']:>5} of it"
            )
    print("\nKV cache, 124M config at context 1024:")
    for k in report["kv_cache_124m_ctx1024"]:
        print(
            f"  {k['attention']} ({k['n_kv_heads']} KV heads): {k['bytes_per_token_bf16']:,} B/token"
            f" bf16, {k['mib_per_sequence_bf16']} MiB/sequence bf16, "
            f"{k['mib_per_sequence_fp32']} MiB fp32"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
