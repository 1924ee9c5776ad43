"""How long the trainer waits for data: the Loader of ``data/loader.py`` at the 124M config.

What: a sharded corpus as ``prepare --input`` lays it out (uint16 shards of GPT-2-vocabulary
ids with their document indexes, written by ``data/shard_writer.SplitWriter``; random ids,
documents of lognormal length, ~1,000 tokens on average), read by the Loader the trainer builds
(``train.build.build_sampler`` with block 1024 and 16 or 32 rows) in each sampling mode:
random windows, packed documents, packed with ``document_mask``. For each:

- the loader alone: ms per batch of ``next()`` called back to back (page cache warm: the
  shards were just written);
- a training loop that does what ``Trainer.run``/``_train_step`` do with the feed (``Prefetch``
  of the sampler when ``train.prefetch`` > 0, the sampler itself at 0; each batch's tensors
  ``.to(device, non_blocking=True)``), with the model's step replaced by a fake step of fixed
  length or work (``FakeStep``): ``sleep`` (the host idle while a GPU works), ``launch`` (the
  host thread busy with tiny torch ops, as an eager GPU step launching kernels) or ``matmul``
  (fp32 products on torch's threads: a CPU step, the cores busy). Reported: the fraction of the
  loop's time spent in ``next()`` (the data wait), and how much longer a step is than the fake
  step timed alone (what the loader costs the step in all, the prefetch thread's competition
  for the GIL or the cores included).

Memory: bytes per document of what packing keeps (``loader.Documents``: shard, start, length;
and the epoch's order), measured with tracemalloc on this corpus and on a synthetic index of
10M documents.

The 124M step is ~14 TFLOP at 16 rows of 1024 tokens (6 x 124M x 16,384 + attention): ~30 ms
on an H100 at 45% MFU, ~60 ms at 32 rows. The default fake step, 10 ms, is 3-6x shorter: a
harsh test of the goal (data wait < 1% of step time with prefetch).

    python benchmarks/bench_loader.py [--tokens 100e6] [--batch 16,32] [--step-ms 10]
        [--steps 300] [--fake sleep,launch,matmul] [--device cpu|cuda] [--json FILE] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from llm_foundry.bench import cpu_model  # noqa: E402
from llm_foundry.data.loader import Documents, Prefetch, PreparedSplit, parse_sources  # noqa: E402
from llm_foundry.data.shard_writer import SplitWriter  # noqa: E402
from llm_foundry.train.build import build_sampler  # noqa: E402
from llm_foundry.train.config import TrainConfig  # noqa: E402

VOCAB = 50304  # GPT-2's 50257 padded, the 124M config's
EOT = 50256
BLOCK = 1024
MODES = {  # name -> (train.data_sampling, train.document_mask)
    "windows": ("windows", True),
    "packed": ("packed", False),
    "packed+document_mask": ("packed", True),
}


# ----------------------------------------------------------------------------------------------
# The corpus


def write_corpus(out: Path, tokens: int, shard_tokens: int, seed: int = 0) -> dict:
    """A prepared directory of random uint16 ids: ``tokens`` training tokens in shards of
    ``shard_tokens`` (closed at a document boundary, as prepare does) and 1% as val."""
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    writers = {}
    eot = np.array([EOT], np.uint16)
    for split, total in (("train", tokens), ("val", max(tokens // 100, 4 * BLOCK))):
        w = SplitWriter(out, split, np.dtype(np.uint16), shard_tokens)
        written = 0
        while written < total:
            # a chunk of documents at a time: ids drawn in bulk, then cut into documents
            lengths = np.maximum(rng.lognormal(6.4, 1.0, 4096).astype(np.int64), 16)
            ids = rng.integers(0, EOT, int(lengths.sum()), dtype=np.uint16)
            start = 0
            for n in lengths.tolist():
                w.begin()
                w.write(ids[start : start + n - 1])  # the document, then its end-of-text id
                w.end(eot)
                start += n
                written += n
                if written >= total:
                    break
        w.close()
        writers[split] = w
    files = {k: v for w in writers.values() for k, v in w.files.items()}
    meta = {
        "kind": "documents",
        "tokenizer": "none (random ids)",
        "vocab_size": VOCAB,
        "eos_id": EOT,
        "eot_id": EOT,
        "dtype": "uint16",
        "train_tokens": writers["train"].total_tokens,
        "val_tokens": writers["val"].total_tokens,
        "train_documents": writers["train"].total_documents,
        "val_documents": writers["val"].total_documents,
        "shards": {s: w.done for s, w in writers.items()},
        "files": files,
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    return {
        "train_tokens": meta["train_tokens"],
        "train_documents": meta["train_documents"],
        "train_shards": len(writers["train"].done),
        "mean_document_tokens": round(meta["train_tokens"] / meta["train_documents"], 1),
        "disk_mb": round(sum(f.stat().st_size for f in out.iterdir()) / 1e6, 1),
        "seconds": round(time.perf_counter() - t0, 1),
    }


# ----------------------------------------------------------------------------------------------
# Memory per document


def _traced(build, order_of) -> dict:
    """Bytes per document of ``build()`` (a ``Documents``) and ``order_of(documents)`` (the
    epoch's order), by tracemalloc (numpy reports its allocations to it)."""
    tracemalloc.start()
    docs = build()
    after, peak = tracemalloc.get_traced_memory()
    order = order_of(docs)
    _, peak2 = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    n = len(docs)
    return {
        "documents": n,
        "index_bytes_per_doc": (docs.shard.nbytes + docs.start.nbytes + docs.length.nbytes) / n,
        "epoch_order_bytes_per_doc": order.nbytes / n,
        "traced_after_build_bytes_per_doc": round(after / n, 2),
        "traced_peak_bytes_per_doc": round(max(peak, peak2) / n, 2),
    }


def document_memory(data: Path) -> dict:
    """Bytes per document that packing keeps: ``loader.Documents`` (shard int32, start and
    length int64) and the epoch's order (a permutation, int64), and the peak while they are
    made. On this corpus through ``PreparedSplit.documents()`` (reading the .idx files) and the
    order a Loader draws for its first batch; and on a synthetic index of 10M documents in 100
    shards, their starts given as ``shards.document_starts`` returns them (int64, 8 more bytes
    per document while the index is read, outside the peak measured here)."""
    corpus = PreparedSplit(data, "train")
    tc = TrainConfig(block_size=BLOCK, batch_size=16, data_sampling="packed", prefetch=0)

    def order_of(docs: Documents) -> np.ndarray:
        loader = build_sampler(parse_sources(str(data)), "train", tc, 0, corpora=[corpus])
        loader.next()
        return loader._orders[0][1]

    out = {"corpus": _traced(corpus.documents, order_of)}
    rng = np.random.default_rng(0)
    lengths = np.maximum(rng.lognormal(6.4, 1.0, 10_000_000).astype(np.int64), 16)
    starts = [np.concatenate([[0], np.cumsum(part)]) for part in np.array_split(lengths, 100)]
    del lengths
    # the order as Loader._order draws it: a permutation from a generator of (seed, source, epoch)
    out["synthetic_10M"] = _traced(
        lambda: Documents(starts),
        lambda docs: np.random.Generator(np.random.PCG64([0, 0, 0])).permutation(len(docs)),
    )
    return out


# ----------------------------------------------------------------------------------------------
# The fake step


class FakeStep:
    """A step of about ``ms`` milliseconds, of one of three kinds:

    - ``sleep``: the host thread idle (the GIL and the cores free), as while a GPU runs a step
      the host has already launched (GPU-bound, or compiled with few launches);
    - ``launch``: tiny torch ops on ``device`` one after another, each releasing and taking back
      the GIL in torch's dispatch, as an eager step's host thread launching kernels (host-bound):
      the prefetch thread's Python work competes with it for the GIL;
    - ``matmul``: 512 x 512 fp32 products on ``device`` with torch's threads, then a host sync
      (the trainer reads the loss back once a step): a CPU step, the cores busy.

    ``launch`` and ``matmul`` are fixed work, counted once here to take ``ms`` alone, so that
    a step slowed by the loader shows as a longer step."""

    def __init__(self, kind: str, ms: float, device: torch.device):
        if kind not in ("sleep", "launch", "matmul"):
            raise SystemExit(f"unknown fake step {kind!r}: sleep, launch or matmul")
        self.kind, self.ms, self.device = kind, ms, device
        self.reps = 1
        if kind == "launch":
            self.x, self.reps = torch.zeros(8, device=device), 1000
        if kind == "matmul":
            g = torch.Generator().manual_seed(0)
            self.a = torch.randn(512, 512, generator=g).to(device)
            self.b = torch.randn(512, 512, generator=g).to(device) / 512**0.5
        if kind != "sleep":
            for _ in range(3):  # calibrate: the fastest of 5 at the current count
                per = min(self._timed() for _ in range(5)) / self.reps
                self.reps = max(1, round(ms / 1e3 / per))

    def _timed(self) -> float:
        t = time.perf_counter()
        self()
        return time.perf_counter() - t

    def __call__(self, batch=None) -> None:
        if self.kind == "sleep":
            time.sleep(self.ms / 1e3)
            return
        if self.kind == "launch":
            for _ in range(self.reps):
                self.x.add_(1.0)
            self.x[0].item()  # the step's one host sync
            return
        c = self.a
        for _ in range(self.reps):
            c = torch.tanh(c @ self.b)
        c[0, 0].item()  # the step's one host sync

    def alone(self, steps: int) -> float:
        """Median seconds of the step with no data."""
        return statistics.median(self._timed() for _ in range(steps))


# ----------------------------------------------------------------------------------------------
# Timing


def _busy_seconds() -> float:
    """CPU seconds the whole machine has been busy (all processes, /proc/stat)."""
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq = map(int, f.readline().split()[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


class OtherLoad:
    """The share of the machine that other processes used between ``start()`` and ``stop()``
    (they disturb sub-millisecond timings: every result records it)."""

    def start(self) -> OtherLoad:
        self.t, self.busy, self.own = time.perf_counter(), _busy_seconds(), time.process_time()
        return self

    def stop(self) -> float:
        wall = time.perf_counter() - self.t
        other = _busy_seconds() - self.busy - (time.process_time() - self.own)
        return round(max(0.0, other) / (wall * os.cpu_count()), 3)


def loader_alone(data: Path, mode: str, batch: int, steps: int) -> dict:
    """ms per batch of the sampler's ``next()`` back to back (no prefetch, no step)."""
    sampling, mask = MODES[mode]
    tc = TrainConfig(block_size=BLOCK, batch_size=batch, data_sampling=sampling,
                     document_mask=mask, prefetch=0)  # fmt: skip
    t0 = time.perf_counter()
    sampler = build_sampler(parse_sources(str(data)), "train", tc, tc.seed)
    build = time.perf_counter() - t0
    for _ in range(5):
        sampler.next()
    times = []
    other = OtherLoad().start()
    for _ in range(steps):
        t = time.perf_counter()
        sampler.next()
        times.append(time.perf_counter() - t)
    other_load = other.stop()
    return {
        "build_s": round(build, 3),
        "ms_per_batch_median": round(1e3 * statistics.median(times), 3),
        "ms_per_batch_mean": round(1e3 * statistics.fmean(times), 3),
        "ms_per_batch_p99": round(1e3 * float(np.percentile(times, 99)), 3),
        "tokens_per_s": round(batch * BLOCK / statistics.fmean(times)),
        "other_load": other_load,
    }


def train_loop(data: Path, mode: str, batch: int, prefetch: int, step: FakeStep, steps: int,
               device: torch.device) -> dict:  # fmt: skip
    """The trainer's use of the feed around a fake step: the share of the time in ``next()``."""
    sampling, mask = MODES[mode]
    tc = TrainConfig(block_size=BLOCK, batch_size=batch, data_sampling=sampling,
                     document_mask=mask, prefetch=prefetch)  # fmt: skip
    sampler = build_sampler(parse_sources(str(data)), "train", tc, tc.seed)
    feed = Prefetch(sampler, tc.prefetch) if tc.prefetch else sampler  # as Trainer.run
    waits, totals = [], []
    other = OtherLoad()
    try:
        for i in range(steps + 10):  # 10 to warm up (and fill the prefetch queue)
            if i == 10:
                other.start()
            t0 = time.perf_counter()
            tensors = [t.to(device, non_blocking=True) for t in feed.next()]  # as _train_step
            t1 = time.perf_counter()
            step(tensors)
            t2 = time.perf_counter()
            if i >= 10:
                waits.append(t1 - t0)
                totals.append(t2 - t0)
        other_load = other.stop()
    finally:
        if feed is not sampler:
            feed.close()
    total = sum(totals)
    return {
        "wait_fraction": round(sum(waits) / total, 5),
        "wait_ms_mean": round(1e3 * statistics.fmean(waits), 3),
        "wait_ms_median": round(1e3 * statistics.median(waits), 4),
        "wait_ms_max": round(1e3 * max(waits), 3),
        "step_ms_mean": round(1e3 * total / len(totals), 3),
        "other_load": other_load,
    }


# ----------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=float, default=100e6, help="training tokens (100e6)")
    ap.add_argument("--shard-tokens", type=float, default=25e6, help="per shard (25e6)")
    ap.add_argument("--batch", default="16,32", help="rows per batch, comma list (16,32)")
    ap.add_argument("--step-ms", type=float, default=10.0, help="the fake step (10 ms)")
    ap.add_argument("--steps", type=int, default=300, help="timed steps per run (300)")
    ap.add_argument(
        "--fake", default="sleep,launch,matmul", help="fake steps to run (sleep,launch,matmul)"
    )
    ap.add_argument("--device", default="cpu", help="cpu or cuda (where the batches go)")
    ap.add_argument("--quick", action="store_true", help="4M tokens, 60 steps: a smoke run")
    ap.add_argument("--json", metavar="FILE", help="write the results here")
    ap.add_argument("--work", metavar="DIR", help="work directory, kept (default: a temp dir)")
    ns = ap.parse_args()
    tokens, shard_tokens, steps = int(ns.tokens), int(ns.shard_tokens), ns.steps
    if ns.quick:
        tokens, shard_tokens, steps = 4_000_000, 1_000_000, 60
    device = torch.device(ns.device)
    batches = [int(b) for b in ns.batch.split(",")]
    fakes = ns.fake.split(",")
    report: dict = {
        "date": datetime.date.today().isoformat(),
        "cpu": cpu_model(),
        "cpus": len(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": str(device)
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        "block_size": BLOCK,
        "vocab_size": VOCAB,
        "step_ms": ns.step_ms,
        "steps": steps,
    }

    def say(*a) -> None:
        print(*a, file=sys.stderr, flush=True)
        if ns.json:
            Path(ns.json).write_text(json.dumps(report, indent=1) + "\n")

    work = Path(ns.work) if ns.work else Path(tempfile.mkdtemp(prefix="bench-loader-"))
    data = work / f"corpus-{tokens}"
    try:
        if not (data / "meta.json").is_file():
            shutil.rmtree(data, ignore_errors=True)
            report["corpus"] = write_corpus(data, tokens, shard_tokens)
        else:
            meta = json.loads((data / "meta.json").read_text())
            report["corpus"] = {"train_tokens": meta["train_tokens"],
                                "train_documents": meta["train_documents"],
                                "train_shards": len(meta["shards"]["train"])}  # fmt: skip
        say("corpus", report["corpus"])
        report["memory"] = document_memory(data)
        say("memory", report["memory"])
        report["alone"], report["loop"] = [], []
        for batch in batches:
            for mode in MODES:
                r = {"batch": batch, "mode": mode, **loader_alone(data, mode, batch, steps)}
                report["alone"].append(r)
                say(f"loader alone  B={batch} {mode:21s} {r['ms_per_batch_median']:7.3f} ms/batch"
                    f" (mean {r['ms_per_batch_mean']:.3f}, "
                    f"p99 {r['ms_per_batch_p99']:.3f})")  # fmt: skip
        report["fake_step"] = {}
        for kind in fakes:
            step = FakeStep(kind, ns.step_ms, device)
            alone = 1e3 * step.alone(50)  # just before its runs, on the machine as it is then
            report["fake_step"][kind] = {"reps": step.reps, "ms_alone": round(alone, 3)}
            say(f"fake step {kind}: {alone:.3f} ms alone ({step.reps} reps)")
            for batch in batches:
                for mode in MODES:
                    for prefetch in (0, 2):
                        r = train_loop(data, mode, batch, prefetch, step, steps, device)
                        r = {"fake": kind, "batch": batch, "mode": mode, "prefetch": prefetch,
                             **r, "fake_step_ms_alone": round(alone, 3)}  # fmt: skip
                        r["step_over_fake_alone"] = round(r["step_ms_mean"] / alone, 3)
                        report["loop"].append(r)
                        say(f"{kind:6s} B={batch} {mode:21s} prefetch {prefetch}: wait "
                            f"{r['wait_fraction']:7.2%} of the step ({r['wait_ms_mean']:.3f} ms), "
                            f"step {r['step_ms_mean']:.2f} ms = {r['step_over_fake_alone']:.3f}x "
                            f"the fake step alone; other load {r['other_load']:.0%}")  # fmt: skip
    finally:
        if not ns.work:
            shutil.rmtree(work, ignore_errors=True)
    if ns.json:
        Path(ns.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
