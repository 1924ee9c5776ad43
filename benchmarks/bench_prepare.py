"""Throughput and memory of ``llm-foundry prepare --input`` against HF tokenizers' raw
``encode_batch`` on the same text, the same tokenizer and the same cores.

The corpus is generated (seeded) as JSONL files of ~64 MB in a work directory: documents of
pseudo-English (English function words and ~50k made-up words drawn by a Zipf law, capitalised
sentences, commas, paragraphs, a few accented words and numbers), ~3.3 KB each on average,
lognormal in length. A 32k byte-level BPE (ours: ``BPETokenizer.train``, the chat markers
reserved) is trained once on the first ~16 MB and given to prepare as ``--tokenizer-from``.

Contenders, each a subprocess of its own, pinned with sched_setaffinity:

- ``raw``: the text read (JSON parsed, untimed) in batches of the size prepare sends (1 MiB of
  text), timing only the calls: ``encode_batch`` and ``encode_batch_fast`` (no offsets; what
  prepare calls), on 1 core (``TOKENIZERS_PARALLELISM=false``: serial) and on 2 (rayon,
  ``RAYON_NUM_THREADS=2``).
- ``prepare``: the CLI, ``python -c "from llm_foundry.cli import main; main()" prepare --input
  FILES --tokenizer-from tok.json --workers N`` (what the ``llm-foundry`` script runs), the wall
  time of the whole command: 1 worker on 1 core, 2 workers on 2 cores, and 1 worker on 2 cores
  (with one worker prepare encodes in its own process, where rayon uses both cores). meta.json's
  ``encode_seconds`` is also kept: the tokenizing phase (reading, encoding, writing) without the
  command's start (imports, tokenizer, worker processes).

Throughput: ``--rounds`` rounds on the corpus's first file(s) (``--slice-mb``), every contender
once a round, the order rotated each round; the fastest run of each contender (the least
disturbed by other processes on the machine) and the median over rounds of the per-round ratios
are reported. Memory: prepare with 1 and 2 workers on the whole corpus and on its first quarter,
the process tree (the command, the forkserver, the workers) sampled every 0.1 s: the peak of the
summed RSS (an upper bound: shared pages count once per process) and, every 0.5 s, of the
summed PSS. Every run also records the share of the machine other processes used meanwhile.

    python benchmarks/bench_prepare.py [--size-mb 1000] [--rounds 5] [--slice-mb 64]
        [--quick] [--json FILE] [--work DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from llm_foundry.bench import cpu_model  # noqa: E402

FILE_MB = 64  # each JSONL file of the corpus
VOCAB = 32768
SAMPLE_MB = 16  # what the BPE is trained on
BATCH_CHARS = 1 << 20  # as data/documents.py sends to a worker
FUNCTION_WORDS = (
    "the of and to a in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there one all we their has been if more when will "
    "would who so no can its into than some other what time only also"
).split()


# ----------------------------------------------------------------------------------------------
# The corpus


def _words(rng: np.random.Generator, n: int) -> list[str]:
    """``n`` distinct made-up words, shorter ones first (they take the frequent ranks)."""
    onsets = list("bcdfghjklmnprstvwz") + ["th", "st", "ch", "sh", "tr", "pl", "gr", "br", "qu"]
    vowels = list("aeiouaeioy") + ["ea", "ou", "ai", "é", "ü"]
    codas = ["", "", "", "n", "s", "t", "r", "l", "nd", "ng", "ck", "st"]
    words: set[str] = set(FUNCTION_WORDS)
    out: list[str] = []
    while len(out) < n:
        k = 1 + min(int(rng.geometric(0.45)), 5)
        w = "".join(onsets[rng.integers(len(onsets))] + vowels[rng.integers(len(vowels))]
                    for _ in range(k)) + codas[rng.integers(len(codas))]  # fmt: skip
        if w not in words:
            words.add(w)
            out.append(w)
    out.sort(key=len)
    return FUNCTION_WORDS + out


class Writer:
    """Seeded documents of pseudo-English."""

    def __init__(self, seed: int = 0, words: int = 50_000):
        self.rng = np.random.default_rng(seed)
        w = _words(self.rng, words)
        p = 1.0 / np.arange(1, len(w) + 1) ** 1.05
        self.cdf = np.cumsum(p / p.sum())
        self.plain = np.array(w, dtype=object)
        self.capital = np.array([x[:1].upper() + x[1:] for x in w], dtype=object)
        self.stop = np.array([x + "." for x in w], dtype=object)
        self.comma = np.array([x + "," for x in w], dtype=object)
        self.para = np.array([x + ".\n\n" for x in w], dtype=object)

    def document(self) -> str:
        rng = self.rng
        n = int(rng.lognormal(6.0, 0.9)) + 8
        idx = np.minimum(np.searchsorted(self.cdf, rng.random(n)), len(self.cdf) - 1)
        u = rng.random(n)
        end = u < 1 / 14
        para = u < 1 / 90
        comma = (u > 0.9) & (u < 0.97)
        toks = self.plain[idx]
        starts = np.concatenate([[True], end[:-1]])
        toks = np.where(starts, self.capital[idx], toks)
        toks = np.where(comma, self.comma[idx], toks)
        toks = np.where(end, self.stop[idx], toks)
        toks = np.where(para, self.para[idx], toks)
        numbers = np.flatnonzero(rng.random(n) < 0.01)
        toks[numbers] = [str(v) for v in rng.integers(0, 3000, len(numbers))]
        text = " ".join(toks.tolist()).replace("\n\n ", "\n\n")
        return text if text.endswith(".") else text + "."


def write_corpus(directory: Path, size_mb: int, seed: int = 0) -> dict:
    """JSONL files of ``FILE_MB`` each (the last smaller) until ``size_mb`` MB are written."""
    directory.mkdir(parents=True, exist_ok=True)
    writer = Writer(seed)
    total = documents = 0
    files = []
    t0 = time.perf_counter()
    while total < size_mb * 1e6:
        path = directory / f"part_{len(files):04d}.jsonl"
        written = 0
        with open(path, "w", encoding="utf-8") as f:
            while written < FILE_MB * 1e6 and total + written < size_mb * 1e6:
                line = json.dumps({"id": documents, "text": writer.document()}, ensure_ascii=False)
                written += f.write(line + "\n")  # characters; the sizes are taken from disk
                documents += 1
        total += path.stat().st_size
        files.append(path.name)
    return {"files": files, "bytes": total, "documents": documents,
            "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip


def train_tokenizer(corpus: Path, out: Path) -> dict:
    from llm_foundry.tokenizer import BPETokenizer

    texts, size = [], 0
    for path in sorted(corpus.glob("*.jsonl")):
        with open(path, encoding="utf-8") as f:
            for line in f:
                texts.append(json.loads(line)["text"])
                size += len(texts[-1])
                if size >= SAMPLE_MB * 1e6:
                    break
        if size >= SAMPLE_MB * 1e6:
            break
    t0 = time.perf_counter()
    tok = BPETokenizer.train(texts, VOCAB, chat_tokens=True)
    out.write_text(tok.hf.to_str(), encoding="utf-8")
    return {"vocab_size": tok.vocab_size, "sample_chars": size,
            "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Contenders (each in a subprocess)

RAW = textwrap.dedent(
    """
    import json, sys, time
    from tokenizers import Tokenizer
    tok, method, batch_chars, files = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
    hf = Tokenizer.from_file(tok)
    hf.encode_special_tokens = True
    encode = getattr(hf, method)
    spent = cpu = 0.0
    tokens = documents = chars = 0
    def run(batch):
        global spent, cpu, tokens
        t, c = time.perf_counter(), time.process_time()
        out = encode(batch, add_special_tokens=False)
        spent += time.perf_counter() - t
        cpu += time.process_time() - c
        tokens += sum(len(e) for e in out)
    for path in files:
        batch, size = [], 0
        with open(path, encoding="utf-8") as f:
            for line in f:
                text = json.loads(line)["text"]
                batch.append(text)
                size += len(text)
                documents += 1
                chars += len(text)
                if size >= batch_chars:
                    run(batch)
                    batch, size = [], 0
        if batch:
            run(batch)
    print(json.dumps({"seconds": spent, "encode_cpu_seconds": cpu, "tokens": tokens,
                      "documents": documents, "chars": chars}))
    """
)


def _pin(cores: int):
    """A preexec_fn restricting the child (and what it starts) to ``cores`` CPUs."""
    cpus = sorted(os.sched_getaffinity(0))[:cores]
    return lambda: os.sched_setaffinity(0, cpus)


def _env(cores: int) -> dict:
    env = dict(os.environ, RAYON_NUM_THREADS=str(cores), PYTHONPATH=str(ROOT / "src"))
    env["TOKENIZERS_PARALLELISM"] = "false" if cores == 1 else "true"
    return env


def _busy_seconds() -> float:
    """CPU seconds the whole machine has been busy (all processes, /proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


class TreeSampler:
    """A process and its descendants, sampled every 0.1 s: peak summed RSS, peak summed PSS
    (every 0.5 s), their CPU seconds (each process's last reading), and the CPU seconds the
    rest of the machine used meanwhile (another user's load skews a timing: it is reported)."""

    def __init__(self, pid: int):
        self.root = psutil.Process(pid)
        self.peak_rss = self.peak_pss = self.peak_parent_rss = self.peak_worker_rss = 0
        self.worker_threads = 0
        self.processes = 1
        self.cpu: dict[int, float] = {}
        self.busy0, self.t0 = _busy_seconds(), time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        n = 0
        while not self._stop.is_set():
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            rss = pss = 0
            for k, p in enumerate(procs):
                try:
                    m = p.memory_full_info() if n % 5 == 0 else p.memory_info()
                    t = p.cpu_times()
                    self.cpu[p.pid] = t.user + t.system
                    rss += m.rss
                    pss += getattr(m, "pss", 0)
                    if k == 0:
                        self.peak_parent_rss = max(self.peak_parent_rss, m.rss)
                    elif p.ppid() != self.root.pid:  # forked by the forkserver: a worker
                        self.peak_worker_rss = max(self.peak_worker_rss, m.rss)
                        self.worker_threads = max(self.worker_threads, p.num_threads())
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
            self.peak_rss = max(self.peak_rss, rss)
            self.peak_pss = max(self.peak_pss, pss)
            self.processes = max(self.processes, len(procs))
            n += 1
            self._stop.wait(0.1)

    def stop(self) -> dict:
        wall = time.perf_counter() - self.t0
        busy = _busy_seconds() - self.busy0
        self._stop.set()
        self._thread.join()
        mib = 1 << 20
        own = sum(self.cpu.values())
        cpus = len(os.sched_getaffinity(0))
        return {"peak_tree_rss_mib": round(self.peak_rss / mib, 1),
                "peak_tree_pss_mib": round(self.peak_pss / mib, 1),
                "peak_parent_rss_mib": round(self.peak_parent_rss / mib, 1),
                "peak_worker_rss_mib": round(self.peak_worker_rss / mib, 1),
                "max_worker_threads": self.worker_threads,
                "max_processes": self.processes,
                "cpu_seconds": round(own, 2),
                "other_load": round(max(0.0, busy - own) / (wall * cpus), 3)}  # fmt: skip


def run_tree(cmd: list[str], cores: int) -> tuple[str, float, dict]:
    """Run ``cmd`` pinned to ``cores`` CPUs, sampling its process tree: (stdout, wall, stats)."""
    t0, own0 = time.perf_counter(), time.process_time()
    proc = subprocess.Popen(cmd, env=_env(cores), preexec_fn=_pin(cores),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    sampler = TreeSampler(proc.pid)
    stdout, stderr = proc.communicate()
    wall = time.perf_counter() - t0
    stats = sampler.stop()
    # this process (the sampler) is no other user's load
    mine = (time.process_time() - own0) / (wall * len(os.sched_getaffinity(0)))
    stats["other_load"] = round(max(0.0, stats["other_load"] - mine), 3)
    if proc.returncode:
        raise SystemExit(f"{cmd[:4]}... failed ({proc.returncode}):\n{stderr[-3000:]}")
    return stdout, wall, stats


def run_raw(files: list[Path], tok: Path, method: str, cores: int) -> dict:
    cmd = [sys.executable, "-c", RAW, str(tok), method, str(BATCH_CHARS), *map(str, files)]
    stdout, wall, stats = run_tree(cmd, cores)
    r = json.loads(stdout)
    nbytes = sum(p.stat().st_size for p in files)
    r.update(contender=f"raw {method} {cores}c", method=method, cores=cores, input_bytes=nbytes,
             wall=wall, mb_per_s=nbytes / 1e6 / r["seconds"],
             tokens_per_s=r["tokens"] / r["seconds"], other_load=stats["other_load"],
             cpu_seconds=stats["cpu_seconds"])  # fmt: skip
    return r


def run_prepare(inputs: list[Path], tok: Path, workers: int, cores: int, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    # the console script's code (``llm-foundry``): ``-m llm_foundry`` would import torch first
    cli = "import sys; from llm_foundry.cli import main; sys.exit(main())"
    cmd = [sys.executable, "-c", cli, "prepare", "--input", *map(str, inputs), "--out", str(out),
           "--tokenizer-from", str(tok), "--workers", str(workers)]  # fmt: skip
    _, wall, stats = run_tree(cmd, cores)
    meta = json.loads((out / "meta.json").read_text())
    nbytes = sum(p.stat().st_size for p in inputs)
    tokens = meta["train_tokens"] + meta["val_tokens"]
    documents = meta["train_documents"] + meta["val_documents"]
    shutil.rmtree(out, ignore_errors=True)
    return {"contender": f"prepare {workers}w {cores}c", "workers": workers, "cores": cores,
            "input_bytes": nbytes, "seconds": wall,
            "encode_seconds": meta["timing"]["encode_seconds"], "tokens": tokens,
            "documents": documents, "tokens_without_eot": tokens - documents,
            "mb_per_s": nbytes / 1e6 / wall,
            "encode_phase_mb_per_s": nbytes / 1e6 / meta["timing"]["encode_seconds"],
            "tokens_per_s": tokens / wall, **stats}  # fmt: skip


# ----------------------------------------------------------------------------------------------

# (kind, method or workers, cores), in the order of the first round
CONTENDERS = [("raw", "encode_batch", 1), ("raw", "encode_batch_fast", 1), ("prepare", 1, 1),
              ("raw", "encode_batch", 2), ("raw", "encode_batch_fast", 2), ("prepare", 2, 2),
              ("prepare", 1, 2)]  # fmt: skip


def best(runs: list[dict], key: str = "seconds") -> dict:
    """The least disturbed of a contender's runs: the fastest."""
    return min(runs, key=lambda r: r[key])


def summarize(report: dict) -> dict:
    """Ratios from each contender's fastest run on the slice, the median of the same ratios
    taken round by round, and the peak memory on the whole corpus and its quarter."""
    by: dict[str, list[dict]] = {}
    for r in report["rounds"]:
        by.setdefault(r["contender"], []).append(r)
    s: dict = {"slice_mb": round(report["rounds"][0]["input_bytes"] / 1e6, 1),
               "best_mb_per_s": {}, "median_mb_per_s": {}}  # fmt: skip
    for name, runs in by.items():
        s["best_mb_per_s"][name] = round(best(runs)["mb_per_s"], 3)
        s["median_mb_per_s"][name] = round(statistics.median(r["mb_per_s"] for r in runs), 3)
        if name.startswith("prepare"):
            s["best_mb_per_s"][name + " encode phase"] = round(
                best(runs, "encode_seconds")["encode_phase_mb_per_s"], 3
            )
    tokens = {r["tokens"] for r in report["rounds"] if r["contender"].startswith("raw")}
    tokens |= {r["tokens_without_eot"] for r in report["rounds"] if "workers" in r}
    assert len(tokens) == 1, f"token counts differ: {tokens}"
    rounds = max(r["round"] for r in report["rounds"]) + 1
    at = {(r["round"], r["contender"]): r for r in report["rounds"]}
    ratios = {}
    for w, n in ((1, 1), (2, 2), (1, 2)):
        for m in ("encode_batch", "encode_batch_fast"):
            for phase, key in (("", "seconds"), (" encode phase", "encode_seconds")):
                p, raw = f"prepare {w}w {n}c", f"raw {m} {n}c"
                name = f"{p}{phase} / {raw}"
                ratios[name] = {
                    "best": round(best(by[raw])["seconds"] / best(by[p], key)[key], 3),
                    "median_of_rounds": round(statistics.median(
                        at[i, raw]["seconds"] / at[i, p][key] for i in range(rounds)), 3),
                }  # fmt: skip
    s["prepare_over_raw"] = ratios
    s["scaling_1_to_2"] = {
        name: round(best(by[one])["seconds"] / best(by[two])["seconds"], 3)
        for name, one, two in (
            ("prepare 1w 1c -> 2w 2c", "prepare 1w 1c", "prepare 2w 2c"),
            ("prepare 1w 1c -> 1w 2c", "prepare 1w 1c", "prepare 1w 2c"),
            ("raw encode_batch 1c -> 2c", "raw encode_batch 1c", "raw encode_batch 2c"),
            ("raw encode_batch_fast 1c -> 2c", "raw encode_batch_fast 1c",
             "raw encode_batch_fast 2c"),
        )
    }  # fmt: skip
    s["memory"] = [
        {
            k: r[k]
            for k in (
                "contender",
                "input_bytes",
                "mb_per_s",
                "peak_tree_rss_mib",
                "peak_tree_pss_mib",
                "peak_parent_rss_mib",
                "peak_worker_rss_mib",
                "other_load",
            )
        }  # fmt: skip
        for r in report["whole"]
    ]
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=int, default=1000, help="corpus size (default 1000)")
    ap.add_argument("--slice-mb", type=int, default=64,
                    help="the timed rounds' part of the corpus: its first files, this many MB "
                    "or more (default 64: one file)")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (default 5)")
    ap.add_argument("--quick", action="store_true", help="a 24 MB corpus, 2 rounds: a smoke run")
    ap.add_argument("--json", metavar="FILE", help="write the results here")
    ap.add_argument("--work", metavar="DIR", help="work directory, kept (default: a temp dir)")
    ns = ap.parse_args()
    size, rounds = (24, 2) if ns.quick else (ns.size_mb, ns.rounds)
    work = Path(ns.work) if ns.work else Path(tempfile.mkdtemp(prefix="bench-prepare-"))
    corpus, tok, out = work / f"corpus-{size}mb", work / "tokenizer.json", work / "out"
    report: dict = {"date": datetime.date.today().isoformat(), "cpu": cpu_model(),
                    "cpus": len(os.sched_getaffinity(0)), "python": platform.python_version(),
                    "tokenizers": __import__("tokenizers").__version__,
                    "size_mb": size}  # fmt: skip

    def say(*a):
        print(*a, file=sys.stderr, flush=True)
        if ns.json:  # what is measured so far, should a later contender fail
            Path(ns.json).write_text(json.dumps(report, indent=1) + "\n")

    try:
        if not (corpus / "done").is_file():
            shutil.rmtree(corpus, ignore_errors=True)
            report["corpus"] = write_corpus(corpus, size)
            (corpus / "done").write_text(json.dumps(report["corpus"]))
        else:
            report["corpus"] = json.loads((corpus / "done").read_text())
        say("corpus", report["corpus"])
        info = work / "tokenizer-info.json"
        if not (tok.is_file() and info.is_file()):
            info.write_text(json.dumps(train_tokenizer(corpus, tok)))
        report["tokenizer"] = json.loads(info.read_text())
        say("tokenizer", report["tokenizer"])
        files = sorted(corpus.glob("*.jsonl"))
        part = []
        while not part or (sum(p.stat().st_size for p in part) < ns.slice_mb * 1e6
                           and len(part) < len(files)):  # fmt: skip
            part.append(files[len(part)])
        # 1. throughput: every contender once a round on the slice, the order rotated
        report["rounds"] = []
        for i in range(rounds):
            k = i % len(CONTENDERS)
            for kind, what, cores in CONTENDERS[k:] + CONTENDERS[:k]:
                if kind == "raw":
                    r = run_raw(part, tok, what, cores)
                else:
                    r = run_prepare(part, tok, what, cores, out)
                r["round"] = i
                report["rounds"].append(r)
                say(f"round {i} {r['contender']:27s} {r['mb_per_s']:6.2f} MB/s "
                    f"{r['tokens_per_s'] / 1e6:6.3f} Mtok/s, "
                    f"other load {r['other_load']:.0%}")  # fmt: skip
        # 2. memory (and throughput at scale): prepare on the whole corpus and on its quarter
        report["whole"] = []
        quarter = files[: max(1, len(files) // 4)]
        for inputs in (files, quarter):
            for workers in (1, 2):
                r = run_prepare(inputs, tok, workers, workers, out)
                report["whole"].append(r)
                say(f"{r['contender']} on {r['input_bytes'] / 1e6:.0f} MB: "
                    f"{r['mb_per_s']:.2f} MB/s, peak tree RSS {r['peak_tree_rss_mib']} MiB, "
                    f"PSS {r['peak_tree_pss_mib']} MiB, "
                    f"other load {r['other_load']:.0%}")  # fmt: skip
    finally:
        if not ns.work:
            shutil.rmtree(work, ignore_errors=True)
    report["summary"] = summarize(report)
    say(json.dumps(report["summary"], indent=1))


if __name__ == "__main__":
    main()
