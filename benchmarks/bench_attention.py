"""Attention kernels: manual_attention (materialises the (B, H, T, T) scores) vs PyTorch SDPA.

Forward and forward+backward time, peak memory and agreement for MHA, GQA and MQA at
T = 256..4096 (12 query heads of 64, batch 1 by default); on CUDA also SDPA held to each backend
(flash, memory-efficient, math). The logic, options and the exact memory method are in
``llm_foundry.bench.attention`` (options: ``llm_foundry.cli.bench``); ``--out DIR`` writes attention_bench.md, .json and .png there.

    python benchmarks/bench_attention.py [--out DIR] [--json] [--seq-lens 256,512,1024,2048,4096]
        [--kv-heads 12,4,1] [--heads 12] [--head-dim 64] [--batch 1] [--device auto|cpu|cuda]
        [--dtype fp32|bf16|fp16] [--impls manual,sdpa,...] [--repeats 5] [--warmup 1]
        [--max-mem-gib GIB]
"""

from __future__ import annotations

import sys

from llm_foundry.cli.bench import attention_main as main

if __name__ == "__main__":  # the guard matters: CPU memory is measured in worker processes
    sys.exit(main())
