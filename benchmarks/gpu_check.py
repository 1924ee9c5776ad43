"""The five-minute GPU check (issue 30): llm-foundry against nanoGPT and HF transformers on one
card, side by side in one process, written to JSON with the card, the software and the commit.

Sections (``--sections``, run in the order given, by default this one; each is timed, budgeted and fenced: an error or a
timeout is recorded and the next section goes on; what a budget leaves out is named under
``skipped``; the JSON is rewritten after every section):

  matmul   an 8192^3 bf16 matrix product (the median of 3 trials of 20 after 20 warm-ups): the
           card's reachable peak, the second MFU denominator
  train    124M GPT-2 (vocab 50304, block 1024), batch 16x1024, bf16 autocast, torch.compile
           (each model compiled once, static shapes), fused AdamW, clip 1.0, random tokens
           already on the GPU: nanoGPT's GPT (model.py from --nanogpt; its train.py's step),
           llm-foundry's Transformer built and stepped as the trainer does (train.build.
           build_model, optim.build_optimizer, precision.choose_precision, Trainer._train_step's
           order: the optimizer step queued, a non-finite one skipped on the device, then one
           host sync for the loss and gradient norm), each TrainConfig speed option this
           checkout has (fused_loss; sdpa_backend=cudnn on a GPU; dtype=fp8 on FP8
           cards) as its own model, and HF's GPT2LMHeadModel (sdpa, compiled;
           last, as time allows: the issue's table has it at 32). Timed rounds interleaved;
           ms/iter is the median round. MFU = FLOPs per token (the project's accounting,
           Transformer.flops_per_token: 6 per weight plus 12 * L * H * Q * T for attention;
           nanoGPT's 6N + 12LHQT is recorded beside it) x tokens/s, over 989 TFLOP/s (H100 SXM
           bf16 dense) and over the measured matmul rate. Peak memory per model: the peak
           allocated during its first timed round, less what was allocated before it, plus its
           own weights and optimizer state (what it would hold alone).
  loader   the fraction of that compiled 124M step spent waiting for data (issue 29): the
           project's Loader over a one-shard uint16 directory (prepare, char tokenizer, 5M
           generated characters) read through Prefetch(depth 2) as the trainer reads it, against
           the same step fed from the GPU
  decode   batch-1 greedy decoding of a random 124M Llama (768 wide, 12 layers, 12 heads, 4 KV
           heads, MLP 2048, vocab 32000; 16-token prompt, 256 new tokens) in fp32 and bf16: HF
           generate (default cache) vs llm-foundry's generate eager, with each CUDA-graph option
           its signature offers (cuda_graph), compile=True and both; HF's static cache (which HF
           compiles) last, as time allows. Tokens/s and whether the greedy tokens equal HF's and
           our eager ones
  serve    the same model in bf16 served in-process at 1/8/32 concurrent clients (a client sends
           its next request when the last one ends; random prompts of 16-48 tokens, 64 new
           tokens each, greedy): llm-foundry's engine (serve/engine.py) driven by its own step
           loop in this thread, as `llm-foundry serve` runs it, vs transformers' continuous
           batching (init_continuous_batching, what `transformers serve --continuous-batching`
           starts, its cache bounded to 256 blocks); tokens/s, ratios at 32 clients over 1 and
           against transformers, and whether the tokens equal the engine's 1-client run. Then, as
           time allows, the engine with --compile (1 client) and any CUDA-graph option it has
  train32  the train section at batch 32x1024 (last: it runs as the time budget allows)

    python benchmarks/gpu_check.py --nanogpt .nanogpt --out gpu_check.json
    python benchmarks/gpu_check.py --device cpu --quick   # tiny sizes, a dry run

On a CPU every size is tiny, one thread, and nothing is compiled unless ``--compile on``.
``--quick``: fewer rounds and requests, no HF static cache, no train32. ``--budget`` (default
290 s, under five minutes) bounds the whole run; a later section gets what is left of it, each at
most its own budget (``--section-budget NAME=SECONDS``). The script imports the project from the
``src/`` beside it, so a lent machine needs no install.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import hashlib
import importlib.util
import inspect
import json
import math
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
# the checkout this script sits in is the one measured, installed or not (a lent GPU has no venv)
sys.path.insert(0, str(ROOT / "src"))
SECTIONS = ("matmul", "train", "loader", "decode", "serve", "train32")
PEAK_TFLOPS = 989.0  # H100 SXM bf16 dense (NVIDIA's datasheet; the H200 has the same)
# seconds each section may take on a GPU; the total is capped by --budget as well
BUDGETS = dict(matmul=10, train=85, loader=20, decode=90, serve=100, train32=200)
# TrainConfig speed options timed as contenders, each where this checkout and card have it
TRAIN_OPTIONS = (("fused_loss", True), ("sdpa_backend", "cudnn"), ("dtype", "fp8"))
GRACE_S = 45  # past its budget a section is interrupted (a compile that hangs, say)

LLAMA_124M = dict(vocab_size=32000, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                  num_key_value_heads=4, intermediate_size=2048,
                  max_position_embeddings=1024)  # fmt: skip
LLAMA_TINY = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128,
                  max_position_embeddings=256)  # fmt: skip
GPT_124M = dict(vocab=50304, layers=12, heads=12, dim=768, block=1024)
GPT_TINY = dict(vocab=512, layers=2, heads=2, dim=64, block=64)

T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[gpu_check {time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def short(e: BaseException) -> str:
    """``e`` in one line: its type and its message's first lines (no library boilerplate)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    lines = [ln for ln in lines if not ln.startswith(("Set TORCHDYNAMO_VERBOSE", "For even more"))]
    return f"{type(e).__name__}: {' | '.join(lines)}"[:400]


class SectionTimeout(BaseException):
    """Raised in the main thread when a section runs past its budget and grace (a
    BaseException, so that no library's ``except Exception`` swallows it)."""


@contextlib.contextmanager
def watchdog(seconds: float):
    """Interrupt the block with SectionTimeout after ``seconds`` (SIGALRM; main thread)."""
    if not hasattr(signal, "setitimer"):
        yield
        return

    def fire(signum, frame):
        raise SectionTimeout(f"interrupted after {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(1.0, seconds))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class Ctx:
    """The run's settings, its device and what sections hand on to later ones (``shared``)."""

    def __init__(self, args):
        self.args = args
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.tiny = args.tiny if args.tiny is not None else not self.cuda
        self.compile = {"on": True, "off": False, "auto": self.cuda}[args.compile]
        self.quick = args.quick
        self.shared: dict = {}
        self.end = T0 + args.budget  # the whole run's deadline

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def left(self, deadline: float) -> float:
        return min(deadline, self.end) - time.monotonic()


# ----------------------------------------------------------------------------------------------
# The environment


def git_commit() -> dict:
    """The commit and whether the tree differs from it (``--commit`` when there is no .git)."""
    out = {}
    try:
        run = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True,
                                        timeout=10)  # fmt: skip
        head = run("rev-parse", "HEAD")
        if head.returncode == 0:
            out["commit"] = head.stdout.strip()
            status = run("status", "--porcelain", "--untracked-files=no")
            out["modified_files"] = len(status.stdout.splitlines())
    except (OSError, subprocess.SubprocessError):
        pass
    if "commit" not in out:
        head = ROOT / ".git" / "HEAD"
        try:
            ref = head.read_text().strip()
            if ref.startswith("ref: "):
                ref = (ROOT / ".git" / ref[5:]).read_text().strip()
            out["commit"] = ref
        except OSError:
            out["commit"] = None
    return out


def sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def environment(ctx: Ctx) -> dict:
    env = dict(
        date=time.strftime("%Y-%m-%d"),
        time=time.strftime("%H:%M:%S %Z"),
        python=platform.python_version(),
        platform=platform.platform(),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        device=str(ctx.device),
        cpu_threads=torch.get_num_threads(),
        tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
        float32_matmul_precision=torch.get_float32_matmul_precision(),
        **git_commit(),
    )
    if ctx.args.commit:
        env["commit"] = ctx.args.commit
    for name in ("transformers", "triton", "numpy", "tokenizers", "accelerate"):
        try:
            env[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - a missing package is a fact to record
            env[name] = None
    if ctx.cuda:
        p = torch.cuda.get_device_properties(ctx.device)
        env.update(
            card=torch.cuda.get_device_name(ctx.device),
            capability=f"{p.major}.{p.minor}",
            sms=p.multi_processor_count,
            memory_gib=round(p.total_memory / 2**30, 1),
            cudnn=torch.backends.cudnn.version(),
        )
        try:
            q = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,power.limit",
                 "--format=csv,noheader"], capture_output=True, text=True, timeout=15,
            )  # fmt: skip
            env["nvidia_smi"] = q.stdout.strip() or q.stderr.strip()[-200:]
        except (OSError, subprocess.SubprocessError) as e:
            env["nvidia_smi"] = f"unavailable: {e}"
    else:
        env["card"] = platform.processor() or platform.machine()
    if ctx.args.nanogpt:
        env["nanogpt_model_py_sha256"] = sha256(Path(ctx.args.nanogpt) / "model.py")
    return env


def safe_environment(ctx: Ctx) -> dict:
    try:
        return environment(ctx)
    except Exception as e:  # noqa: BLE001 - the checks still run
        return dict(date=time.strftime("%Y-%m-%d"), torch=torch.__version__,
                    cuda=torch.version.cuda, commit=ctx.args.commit, error=short(e))  # fmt: skip


# ----------------------------------------------------------------------------------------------
# matmul


def section_matmul(ctx: Ctx, res: dict, deadline: float) -> None:
    """The mean of ``reps`` products per trial after warm-ups long enough to raise the clocks;
    the median of three trials (and the best) in TFLOP/s."""
    n, dtype = (8192, torch.bfloat16) if not ctx.tiny else (512, torch.float32)
    a = torch.randn(n, n, device=ctx.device, dtype=dtype)
    b = torch.randn(n, n, device=ctx.device, dtype=dtype)
    reps = 20 if ctx.cuda else 3
    for _ in range(reps):
        a @ b
    trials = []
    for _ in range(3):
        ctx.sync()
        t = time.perf_counter()
        for _ in range(reps):
            a @ b
        ctx.sync()
        trials.append((time.perf_counter() - t) / reps)
    flops = lambda s: float(f"{2 * n**3 / s / 1e12:.4g}")
    s = statistics.median(trials)
    res.update(n=n, dtype=str(dtype), reps=reps, ms=round(s * 1e3, 3), tflops=flops(s),
               tflops_best=flops(min(trials)))  # fmt: skip
    ctx.shared["matmul_tflops"] = res["tflops"]
    log(f"matmul {n}^3 {dtype}: {res['tflops']} TFLOP/s (best {res['tflops_best']})")


# ----------------------------------------------------------------------------------------------
# train: nanoGPT vs llm-foundry vs HF, one step each, interleaved


def load_nanogpt(checkout: Path):
    """nanoGPT's ``model.py`` from ``checkout`` (as bench_shakespeare loads it)."""
    path = Path(checkout) / "model.py"
    if not path.is_file():
        raise FileNotFoundError(f"--nanogpt {checkout}: no model.py there")
    spec = importlib.util.spec_from_file_location("nanogpt_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def state_bytes(model, opt) -> int:
    """Bytes of ``model``'s weights and ``opt``'s state tensors (what stays between steps)."""
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    for st in opt.state.values():
        n += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
    return n


class Contender:
    """A model, its optimizer and its training step ``step(x, y) -> loss (float or tensor)``."""

    def __init__(self, name, model, opt, step, note=""):
        self.name, self.model, self.opt, self.step, self.note = name, model, opt, step, note
        self.params = sum(p.numel() for p in model.parameters())
        self.times: list[float] = []
        self.warmup_s = self.first_loss = self.peak_gib = None


def gpt_sizes(ctx: Ctx, batch: int) -> dict:
    s = dict(GPT_TINY if ctx.tiny else GPT_124M)
    s["batch"] = batch if not ctx.tiny else max(2, batch // 4)
    return s


def nanogpt_contender(ctx, s, autocast) -> Contender:
    module = load_nanogpt(Path(ctx.args.nanogpt))
    torch.manual_seed(0)
    cfg = module.GPTConfig(block_size=s["block"], vocab_size=s["vocab"], n_layer=s["layers"],
                           n_head=s["heads"], n_embd=s["dim"], dropout=0.0, bias=True)  # fmt: skip
    with contextlib.redirect_stdout(sys.stderr):  # it prints its parameter count and groups
        model = module.GPT(cfg).to(ctx.device)
        opt = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), ctx.device.type)
    fwd = torch.compile(model) if ctx.compile else model

    def step(x, y):  # nanoGPT's train.py, one micro-step, log_interval 1
        with autocast():
            _, loss = fwd(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return Contender("nanoGPT", model, opt, step, "its train.py step; loss.item() at the end")


def train_options(ctx: Ctx) -> list[tuple[str, object]]:
    """The speed options of TrainConfig (``TRAIN_OPTIONS``) this checkout has: fields it knows,
    fp8 only on a GPU with FP8 tensor cores (compute capability 8.9+)."""
    import dataclasses

    from llm_foundry.train.config import TrainConfig

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    fp8 = ctx.cuda and torch.cuda.get_device_capability(ctx.device) >= (8, 9)
    return [(k, v) for k, v in TRAIN_OPTIONS
            if k in fields and (v != "fp8" or fp8) and (v != "cudnn" or ctx.cuda)]  # fmt: skip


def ours_contenders(ctx, s, autocast, options: dict | None = None) -> list[Contender]:
    """llm-foundry's model, optimizer and precision from the project's builders, stepped as
    ``Trainer._train_step`` steps one process (grad_accum 1, bf16: no grad scaler); with
    ``options`` (TrainConfig fields), that one contender only."""
    from llm_foundry.presets import get_preset
    from llm_foundry.train.build import build_model
    from llm_foundry.train.config import TrainConfig
    from llm_foundry.train.distributed import World
    from llm_foundry.train.optim import build_optimizer, set_lr, skips_on_device, step_unless
    from llm_foundry.train.precision import choose_precision
    from llm_foundry.train.schedule import lr_at

    mc = get_preset("gpt2", vocab_size=s["vocab"], dim=s["dim"], n_layers=s["layers"],
                    n_heads=s["heads"], max_seq_len=s["block"])  # fmt: skip
    settings = dict(batch_size=s["batch"], block_size=s["block"], lr=6e-4, min_lr=6e-5,
                    warmup_steps=10, max_steps=10000, beta1=0.9, beta2=0.95, weight_decay=0.1,
                    grad_clip=1.0, dtype="bf16", compile=ctx.compile, device=ctx.device.type,
                    seed=0)  # fmt: skip
    tc = TrainConfig(**{**settings, **(options or {})})
    model = build_model(mc, tc, ctx.device)
    precision = choose_precision(tc, ctx.device, World())
    opt = build_optimizer(model, tc, ctx.device, False, precision.ns_dtype)
    fwd = torch.compile(model) if tc.compile else model
    count = [0]
    kernels = contextlib.nullcontext
    if getattr(tc, "sdpa_backend", "auto") != "auto":  # the attention kernel the trainer pins
        from llm_foundry.models.sdpa_kernels import check_sdpa_backend, model_probe, sdpa_backend

        probe = model_probe(model, ctx.device, lambda: precision.autocast(ctx.device.type))
        check_sdpa_backend(tc.sdpa_backend, probe, f"on {ctx.device}")
        kernels = lambda: sdpa_backend(tc.sdpa_backend)  # noqa: E731

    def trainer_step(x, y):
        set_lr(opt, lr_at(count[0], tc))
        count[0] += 1
        loss_sum = torch.zeros((), device=ctx.device)
        with precision.autocast(ctx.device.type), kernels():
            loss = fwd(x, y, doc=None)[1]
            loss = loss / tc.grad_accum
            aux = model.aux_loss()
            (loss if aux is None else loss + aux).backward()
        loss_sum += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        on_device = skips_on_device(opt)  # fused AdamW: a bad step is skipped on the device
        if on_device:
            step_unless(opt, ~(torch.isfinite(loss_sum) & torch.isfinite(grad_norm)))
        value, norm = loss_sum.item(), grad_norm.item()  # the trainer's one host sync per step
        if not on_device and math.isfinite(value) and math.isfinite(norm):
            opt.step()
        opt.zero_grad(set_to_none=True)
        return value

    what = f"build_model + build_optimizer ({type(opt).__name__}, fused) + {precision.dtype}"
    if options:
        shown = ", ".join(f"{k}={v}" for k, v in options.items())
        return [Contender(f"llm-foundry, {shown}", model, opt, trainer_step,
                          f"{what}, TrainConfig({shown}); Trainer._train_step")]  # fmt: skip
    return [Contender("llm-foundry", model, opt, trainer_step,
                      f"{what}; Trainer._train_step (the one sync after the optimizer step)")]  # fmt: skip


def hf_contender(ctx, s, autocast) -> Contender:
    import transformers

    from llm_foundry.interop.hf import config_to_hf
    from llm_foundry.presets import get_preset

    transformers.logging.set_verbosity_error()
    mc = get_preset("gpt2", vocab_size=s["vocab"], dim=s["dim"], n_layers=s["layers"],
                    n_heads=s["heads"], max_seq_len=s["block"])  # fmt: skip
    torch.manual_seed(0)
    hf_cfg = config_to_hf(mc)
    try:
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa")
    except (TypeError, ValueError):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
        model.config._attn_implementation = "sdpa"
    model = model.to(ctx.device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=ctx.cuda)  # fmt: skip
    fwd = torch.compile(model) if ctx.compile else model

    def step(x, y):
        with autocast():
            logits = fwd(input_ids=x, use_cache=False).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return Contender("HF transformers", model, opt, step,
                     f"GPT2LMHeadModel ({model.config._attn_implementation}), torch AdamW "
                     f"fused={ctx.cuda}, loss = F.cross_entropy(fp32 logits)")  # fmt: skip


def peak_gib(ctx, c: Contender, run) -> None:
    """Run ``run()`` and set ``c.peak_gib`` to what the contender alone would hold at its peak."""
    if not ctx.cuda:
        run()
        return
    ctx.sync()
    base = torch.cuda.memory_allocated(ctx.device)
    torch.cuda.reset_peak_memory_stats(ctx.device)
    run()
    ctx.sync()
    extra = torch.cuda.max_memory_allocated(ctx.device) - base
    c.peak_gib = round((extra + state_bytes(c.model, c.opt)) / 2**30, 2)


def train(ctx: Ctx, res: dict, deadline: float, batch: int) -> None:
    s = gpt_sizes(ctx, batch)
    B, T, V = s["batch"], s["block"], s["vocab"]
    steps = 3 if ctx.tiny else 10  # per timed round
    rounds = 2 if ctx.tiny or ctx.quick else 3
    warmup = 1 if ctx.tiny else 3
    amp = torch.bfloat16
    autocast = lambda: torch.autocast(ctx.device.type, dtype=amp)
    res.update(batch=f"{B}x{T}", vocab=V, layers=s["layers"], dim=s["dim"], compile=ctx.compile,
               dtype="bf16 autocast", steps_per_round=steps, warmup_steps=warmup,
               rows=[], skipped=[])  # fmt: skip
    from llm_foundry.accounting import meta_model
    from llm_foundry.presets import get_preset

    mc = get_preset("gpt2", vocab_size=V, dim=s["dim"], n_layers=s["layers"], n_heads=s["heads"],
                    max_seq_len=T)  # fmt: skip
    meta = meta_model(mc)
    fpt = meta.flops_per_token(T)
    n_nonemb = meta.num_params() - mc.max_seq_len * mc.dim  # nanoGPT's count: all but wpe
    fpt_nanogpt = 6 * n_nonemb + 12 * s["layers"] * s["heads"] * (s["dim"] // s["heads"]) * T
    res.update(flops_per_token=fpt, flops_source="llm_foundry Transformer.flops_per_token",
               flops_per_token_nanogpt_estimate=fpt_nanogpt)  # fmt: skip
    torch._dynamo.reset()  # fresh: no shape seen by an earlier section makes a dimension dynamic
    g = torch.Generator(device=ctx.device).manual_seed(0)
    batches = [
        tuple(torch.randint(0, V, (2, B, T), device=ctx.device, generator=g)) for _ in range(steps)
    ]
    makers = [("llm-foundry", ours_contenders)]
    for k, v in train_options(ctx):  # each its own model and compile
        makers.append((f"llm-foundry, {k}={v}",
                       lambda ctx, s, a, o={k: v}: ours_contenders(ctx, s, a, o)))  # fmt: skip
    makers.append(("HF transformers", hf_contender))  # last: measured at 32 on the H100 already
    if ctx.args.nanogpt:
        makers.insert(0, ("nanoGPT", nanogpt_contender))
    else:
        res["skipped"].append("nanoGPT: no --nanogpt DIR")
    contenders: list[Contender] = []
    compile_guess = 20.0 if ctx.compile and ctx.cuda else 2.0
    # the kernel profile says why a speed goal is missed: its time is kept from later contenders
    reserve = 30.0 if ctx.args.profile and ctx.cuda else 0.0
    for name, make in makers:
        if ctx.left(deadline) < compile_guess + 10 + (reserve if contenders else 0.0):
            res["skipped"].append(f"{name}: out of time before its warm-up")
            log(f"train {B}x{T}: {name} skipped, out of time")
            continue
        try:
            made = make(ctx, s, autocast)
        except Exception as e:  # noqa: BLE001 - the others still run
            res["skipped"].append(f"{name}: {short(e)}")
            log(f"train {B}x{T}: {name} failed to build: {short(e)}")
            continue
        made = made if isinstance(made, list) else [made]
        for c in made:
            try:
                t = time.perf_counter()
                c.first_loss = c.step(*batches[0])
                for x, y in batches[1:warmup]:
                    c.step(x, y)
                ctx.sync()
                c.warmup_s = round(time.perf_counter() - t, 1)
                log(f"train {B}x{T}: {c.name} warmed up in {c.warmup_s} s, "
                    f"first loss {c.first_loss:.3f}")  # fmt: skip
                contenders.append(c)
            except Exception as e:  # noqa: BLE001
                res["skipped"].append(f"{c.name}: {short(e)}")
                log(f"train {B}x{T}: {c.name} failed in warm-up: {short(e)}")
    measured = ctx.shared.get("matmul_tflops")

    def rows():  # from the rounds so far: a timeout keeps what was measured
        res["rows"] = []
        for c in contenders:
            if not c.times:
                continue
            sec = statistics.median(c.times)
            flops = fpt * B * T / sec
            res["rows"].append(dict(
                name=c.name, params=c.params, ms_per_iter=round(sec * 1e3, 2),
                ms_rounds=[round(t * 1e3, 2) for t in c.times],
                tokens_per_s=round(B * T / sec), tflops=round(flops / 1e12, 1),
                mfu_989=round(flops / (PEAK_TFLOPS * 1e12), 3),
                mfu_measured=round(flops / (measured * 1e12), 3) if measured else None,
                warmup_s=c.warmup_s, peak_mem_gib=c.peak_gib,
                first_loss=round(c.first_loss, 3), note=c.note,
            ))  # fmt: skip

    last_round = 0.0
    for r in range(rounds):
        if r and ctx.left(deadline) < last_round + 2 + reserve:
            res["rounds_cut"] = f"{r} of {rounds} rounds (time budget)"
            break
        t_round = time.perf_counter()
        for c in list(contenders):

            def run(c=c):
                ctx.sync()
                t = time.perf_counter()
                for x, y in batches:
                    c.step(x, y)
                ctx.sync()
                c.times.append((time.perf_counter() - t) / len(batches))

            try:
                if r == 0:
                    peak_gib(ctx, c, run)
                else:
                    run()
            except Exception as e:  # noqa: BLE001 - out of memory, say: the others go on
                res["skipped"].append(f"{c.name} in round {r + 1}: {short(e)}")
                log(f"train {B}x{T}: {c.name} failed in round {r + 1}: {short(e)}")
                contenders.remove(c)
                if ctx.cuda:
                    torch.cuda.empty_cache()
        last_round = time.perf_counter() - t_round
        rows()
        log(f"train {B}x{T}: round {r + 1}: " + ", ".join(
            f"{c.name} {c.times[-1] * 1e3:.2f} ms" for c in contenders))  # fmt: skip
    res["matmul_tflops"] = measured
    if ctx.args.profile and contenders and ctx.left(deadline) > 10:
        res["profile"] = {}
        for c in contenders:  # the fastest two: where their step's time goes
            if c.name in ("nanoGPT", "llm-foundry") or c is min(contenders, key=step_time):
                if ctx.left(deadline) < 5:
                    break
                try:
                    res["profile"][c.name] = profile_kernels(ctx, c, batches[:3])
                    log(f"train {B}x{T}: {c.name} profile: " + ", ".join(
                        f"{k} {v['ms_per_step']} ms" for k, v in
                        res["profile"][c.name]["buckets"].items()))  # fmt: skip
                except Exception as e:  # noqa: BLE001 - a profile is a courtesy
                    res["profile"][c.name] = dict(error=short(e))
    if batch == 16 and "loader" in ctx.args.sections:
        ours = [c for c in contenders if c.name == "llm-foundry"]
        if ours:  # the loader section times this same compiled step
            ctx.shared["train_ours"] = (ours[0], s)


def step_time(c: Contender) -> float:
    return statistics.median(c.times) if c.times else float("inf")


# what each device kernel (or, on a CPU, each ATen op) of a step is, by its name
KERNEL_BUCKETS = (
    ("attention", ("flash", "fmha", "attention", "scaled_dot_product", "sdpa", "efficient")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "aten::mm", "aten::addmm",
                "aten::bmm", "_scaled_mm")),
    ("optimizer", ("adam", "multi_tensor", "foreach", "vector_norm", "clip")),
    ("loss", ("cross_entropy", "nll_loss", "log_softmax")),
    ("fused (compiled)", ("triton", "graph_", "cpp_fused")),
    ("copies and fills", ("memcpy", "memset", "copy_", "fill_", "elementwise_kernel")),
)  # fmt: skip


def kernel_bucket(name: str) -> str:
    low = name.lower()
    for bucket, keys in KERNEL_BUCKETS:
        if any(k in low for k in keys):
            return bucket
    return "other"


def profile_kernels(ctx: Ctx, c: Contender, batches, top: int = 12) -> dict:
    """torch.profiler over ``len(batches)`` steps of ``c``: device time per step by kernel
    bucket, the top kernels, and how much of the wall time the device was busy (on a CPU, the
    ATen ops' own CPU time stands in for the kernels)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    n = len(batches)
    ctx.sync()
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        for x, y in batches:
            c.step(x, y)
        ctx.sync()
        wall = (time.perf_counter() - t) / n
    events = []
    for e in prof.key_averages():
        if ctx.cuda:
            us = getattr(e, "self_device_time_total", None)
            us = getattr(e, "self_cuda_time_total", 0) if us is None else us
            is_kernel = us > 0 and getattr(e, "device_type", None) != torch.autograd.DeviceType.CPU
        else:
            us, is_kernel = e.self_cpu_time_total, e.key.startswith("aten::")
        if is_kernel:
            events.append((e.key, us / 1e3 / n, e.count / n))
    events.sort(key=lambda r: -r[1])
    buckets: dict = {}
    for name, ms, calls in events:
        b = buckets.setdefault(kernel_bucket(name), dict(ms_per_step=0.0, kernels_per_step=0.0))
        b["ms_per_step"] += ms
        b["kernels_per_step"] += calls
    busy = sum(ms for _, ms, _ in events)
    return dict(
        steps=n, wall_ms_per_step=round(wall * 1e3, 2), device_busy_ms_per_step=round(busy, 2),
        device_busy_fraction=round(busy / (wall * 1e3), 3) if wall else None,
        kernels_per_step=round(sum(c for *_, c in events)),
        buckets={k: dict(ms_per_step=round(v["ms_per_step"], 2),
                         share=round(v["ms_per_step"] / busy, 3) if busy else None,
                         kernels_per_step=round(v["kernels_per_step"]))
                 for k, v in sorted(buckets.items(), key=lambda kv: -kv[1]["ms_per_step"])},
        top=[dict(name=name[:120], ms_per_step=round(ms, 3), calls_per_step=round(calls, 1),
                  bucket=kernel_bucket(name)) for name, ms, calls in events[:top]],
    )  # fmt: skip


def section_train(ctx, res, deadline):
    train(ctx, res, deadline, 16)


def section_train32(ctx, res, deadline):
    train(ctx, res, deadline, 32)


# ----------------------------------------------------------------------------------------------
# loader: the fraction of a step spent waiting for data


def section_loader(ctx: Ctx, res: dict, deadline: float) -> None:
    import numpy as np

    from llm_foundry.data import Loader, Prefetch, PreparedSplit, prepare

    if "train_ours" in ctx.shared:
        c, s = ctx.shared["train_ours"]
        res["model"] = "the train section's compiled llm-foundry step"
    else:
        s = gpt_sizes(ctx, 16)
        c = ours_contenders(ctx, s, None)[0]
        res["model"] = "llm-foundry, built here (the train section did not leave one)"
    B, T = s["batch"], s["block"]
    steps = 4 if ctx.tiny else 20
    tmp = tempfile.TemporaryDirectory(prefix="gpu_check_data_")
    try:
        t = time.perf_counter()
        n_chars = 200_000 if ctx.tiny else 5_000_000
        rng = np.random.default_rng(0)
        alphabet = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz  \n,.ETAOINS", dtype=np.uint8)
        text = Path(tmp.name) / "corpus.txt"
        text.write_bytes(alphabet[rng.integers(0, len(alphabet), n_chars)].tobytes())
        out = Path(tmp.name) / "data"
        meta = prepare(out, text_files=[text], tokenizer="char", progress=False)
        res.update(corpus_chars=n_chars, dtype=meta["dtype"], train_tokens=meta["train_tokens"],
                   prepare_s=round(time.perf_counter() - t, 1), batch=f"{B}x{T}",
                   prefetch=2)  # fmt: skip
        log(f"loader: prepared {meta['train_tokens']} tokens in {res['prepare_s']} s")
        g = torch.Generator(device=ctx.device).manual_seed(1)
        on_device = [
            tuple(torch.randint(0, 32, (2, B, T), device=ctx.device, generator=g))
            for _ in range(steps)
        ]
        for x, y in on_device[:2]:  # warm (compiles, where the train section left no step)
            c.step(x, y)
        loader = Loader([PreparedSplit(out, "train")], None, T, B, seed=0)
        feed = Prefetch(loader, 2)
        waits, copies, fed, resident = [], [], [], []
        try:
            for _ in range(2):
                ctx.sync()
                t = time.perf_counter()
                for x, y in on_device:
                    c.step(x, y)
                ctx.sync()
                resident.append((time.perf_counter() - t) / steps)
                ctx.sync()
                t = time.perf_counter()
                for _ in range(steps):
                    t1 = time.perf_counter()
                    batch = feed.next()
                    t2 = time.perf_counter()
                    x, y = (b.to(ctx.device, non_blocking=True) for b in batch)
                    t3 = time.perf_counter()
                    waits.append(t2 - t1)
                    copies.append(t3 - t2)
                    c.step(x, y)
                ctx.sync()
                fed.append((time.perf_counter() - t) / steps)
                if ctx.left(deadline) < 3:
                    break
        finally:
            feed.close()
        step_fed, step_res = statistics.median(fed), statistics.median(resident)
        res.update(
            ms_per_step_loader=round(step_fed * 1e3, 2),
            ms_per_step_on_device=round(step_res * 1e3, 2),
            wait_ms_median=round(statistics.median(waits) * 1e3, 3),
            wait_ms_max=round(max(waits) * 1e3, 3),
            copy_ms_median=round(statistics.median(copies) * 1e3, 3),
            wait_fraction=round(sum(waits) / (step_fed * len(waits)), 4),
            wait_and_copy_fraction=round((sum(waits) + sum(copies)) / (step_fed * len(waits)), 4),
            slowdown=round(step_fed / step_res - 1, 4),
        )
        log(f"loader: {res['ms_per_step_loader']} ms/step fed vs {res['ms_per_step_on_device']} "
            f"on the device; waiting {res['wait_fraction'] * 100:.2f}% of the step")  # fmt: skip
    finally:
        tmp.cleanup()


# ----------------------------------------------------------------------------------------------
# decode: batch-1 greedy decoding, HF generate vs ours


def llama_in(ctx: Ctx, dtype) -> dict:
    """A random 124M HF Llama (seed 0) and ours with its weights (``interop.hf.from_hf``) in
    ``dtype`` on the device: the fp32 pair built once, other dtypes copies of it; shared by
    decode and serve."""
    models = ctx.shared.setdefault("llama", {})
    if torch.float32 not in models:
        import transformers

        from llm_foundry.interop.hf import from_hf

        transformers.logging.set_verbosity_error()
        cfg = LLAMA_TINY if ctx.tiny else LLAMA_124M
        torch.manual_seed(0)
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()
        ours = from_hf(hf).eval()
        models[torch.float32] = dict(hf=hf.to(ctx.device), ours=ours.to(ctx.device), cfg=cfg)
    if dtype not in models:
        base = models[torch.float32]
        models[dtype] = dict(hf=copy.deepcopy(base["hf"]).to(dtype),
                             ours=copy.deepcopy(base["ours"]).to(dtype), cfg=base["cfg"])  # fmt: skip
    return models[dtype]


KNOWN_STREAM_ARGS = {"model", "idx", "max_new_tokens", "temperature", "top_k", "top_p", "min_p",
                     "repetition_penalty", "eos_id", "seed", "context", "pad",
                     "compile"}  # fmt: skip


def generate_options() -> tuple[dict, dict]:
    """(the keyword options of llm_foundry.generate.stream this script does not know, by name
    -> default; the ones that look like CUDA-graph decoding, with the value that turns them on)."""
    from llm_foundry import generate as G

    extra = {
        n: (p.default if p.default is not inspect.Parameter.empty else None)
        for n, p in inspect.signature(G.stream).parameters.items()
        if n not in KNOWN_STREAM_ARGS and p.kind is not inspect.Parameter.VAR_KEYWORD
    }
    graphs = {}
    for n, d in extra.items():
        if any(k in n.lower() for k in ("graph", "cuda", "static")) and isinstance(d, bool | None):
            graphs[n] = True
    return {n: repr(d) for n, d in extra.items()}, graphs


def hf_generate_fn(hf, idx, new, static=False):
    kw = dict(cache_implementation="static") if static else {}
    return lambda: hf.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=new,
                               min_new_tokens=new, do_sample=False, pad_token_id=0,
                               eos_token_id=None, **kw)  # fmt: skip


def section_decode(ctx: Ctx, res: dict, deadline: float) -> None:
    new = 16 if ctx.tiny else 256
    prompt = 8 if ctx.tiny else 16
    extra, graphs = generate_options()
    res.update(new_tokens=new, prompt_tokens=prompt, batch=1, greedy=True,
               generate_extra_options=extra, graph_options_used=sorted(graphs),
               rows=[], skipped=[])  # fmt: skip
    cfg = llama_in(ctx, torch.float32)["cfg"]
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg["vocab_size"], (1, prompt), generator=g).to(ctx.device)
    fns = decode_contenders(ctx, idx, new, graphs)
    outputs, ready, warm = {}, {}, {}
    for key, (fn, guess) in fns.items():  # first calls (compiles, captures), in priority order
        dname, name = key
        if ctx.left(deadline) < guess + 5:
            res["skipped"].append(f"{dname} {name}: out of time")
            continue
        try:
            t = time.perf_counter()
            with torch.no_grad():
                outputs[key] = fn().cpu()
            ctx.sync()
            warm[key] = round(time.perf_counter() - t, 1)
            ready[key] = fn
            log(f"decode {dname}: {name} first call {warm[key]} s")
        except Exception as e:  # noqa: BLE001
            res["skipped"].append(f"{dname} {name}: {short(e)}")
            log(f"decode {dname}: {name} failed: {short(e)}")
    times: dict = {key: [] for key in ready}
    for _ in range(2):  # timed rounds, interleaved (the first calls are not counted)
        t_round = time.perf_counter()
        for key, fn in ready.items():
            ctx.sync()
            t = time.perf_counter()
            with torch.no_grad():
                fn()
            ctx.sync()
            times[key].append(time.perf_counter() - t)
        if ctx.left(deadline) < time.perf_counter() - t_round:
            break
    for dname in ("fp32", "bf16"):
        ref, ref32 = outputs.get((dname, "HF generate")), outputs.get(("fp32", "HF generate"))
        eager = outputs.get((dname, "llm-foundry generate, eager"))
        hf_times = times.get((dname, "HF generate"))
        hf_tps = new / statistics.median(hf_times) if hf_times else None
        ours = llama_in(ctx, DTYPES[dname])["ours"]
        wbytes = sum(p.numel() * p.element_size() for p in ours.parameters())
        for (d, name), ts in times.items():
            if d != dname:
                continue
            tps = new / statistics.median(ts)
            out = outputs[(d, name)]
            row = dict(dtype=dname, name=name, tokens_per_s=round(tps, 1),
                       vs_hf=round(tps / hf_tps, 2) if hf_tps else None,
                       first_call_s=warm[(d, name)], rounds=len(ts),
                       weight_gb_per_s=round(wbytes * tps / 1e9, 1))  # fmt: skip
            if ref is not None:
                row["same_tokens_as_hf"] = bool(torch.equal(out, ref))
                row["tokens_agreeing_with_hf"] = agreeing(out, ref, prompt)
            if name.startswith("llm-foundry") and eager is not None:
                row["same_tokens_as_eager"] = bool(torch.equal(out, eager))
            if dname == "bf16" and ref32 is not None:
                row["tokens_agreeing_with_hf_fp32"] = agreeing(out, ref32, prompt)
            res["rows"].append(row)
        shown = [f"{r['name']} {r['tokens_per_s']}" for r in res["rows"] if r["dtype"] == dname]
        log(f"decode {dname} tok/s: " + ", ".join(shown))


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def decode_contenders(ctx, idx, new, graphs) -> dict:
    """(dtype, name) -> (a function decoding ``new`` greedy tokens after ``idx``, its first call's
    guessed seconds), in the order they are warmed up, so that what the time budget leaves out is
    the least needed: bf16 (the speed goal: HF, eager, the CUDA-graph step, then compiled with
    it), then fp32 (exactness against HF: HF, eager, the CUDA-graph step), then bf16 compiled
    without graphs, HF's static cache (compiled by HF) and fp32's compiled steps."""
    from llm_foundry.generate import generate

    def ours_fn(dname, **kw):
        ours = llama_in(ctx, DTYPES[dname])["ours"]
        return lambda: generate(ours, idx, new, temperature=0, **kw)

    def hf_fn(dname, **kw):
        return hf_generate_fn(llama_in(ctx, DTYPES[dname])["hf"], idx, new, **kw)

    g = {f"{n}={v}": {n: v} for n, v in graphs.items()}
    fns = {}
    for dname in ("bf16", "fp32"):
        fns[(dname, "HF generate")] = (hf_fn(dname), 3.0)
        fns[(dname, "llm-foundry generate, eager")] = (ours_fn(dname), 3.0)
        for shown, kw in g.items():  # the static step captured eagerly: no compile
            fns[(dname, f"llm-foundry generate, {shown}")] = (ours_fn(dname, **kw), 10.0)
        if ctx.compile and dname == "bf16":
            for shown, kw in g.items():
                key = (dname, f"llm-foundry generate, compile=True, {shown}")
                fns[key] = (ours_fn(dname, compile=True, **kw), 35.0)
    if ctx.compile:
        fns[("bf16", "llm-foundry generate, compile=True")] = (ours_fn("bf16", compile=True), 35.0)
    if ctx.cuda and not ctx.quick:  # HF compiles its static-cache step (CUDA graphs)
        fns[("bf16", "HF generate, static cache (compiled by HF)")] = (
            hf_fn("bf16", static=True), 60.0)  # fmt: skip
    if ctx.compile:
        fns[("fp32", "llm-foundry generate, compile=True")] = (ours_fn("fp32", compile=True), 35.0)
        for shown, kw in g.items():
            key = ("fp32", f"llm-foundry generate, compile=True, {shown}")
            fns[key] = (ours_fn("fp32", compile=True, **kw), 35.0)
    return fns


def agreeing(a: torch.Tensor, b: torch.Tensor, prompt: int) -> int:
    """How many generated tokens of ``a`` equal ``b``'s before the first difference."""
    from llm_foundry.data.sft import common_prefix

    return common_prefix(a[0, prompt:].tolist(), b[0, prompt:].tolist())


# ----------------------------------------------------------------------------------------------
# serve: continuous batching in-process, ours vs transformers'


class CharDecoder:
    """The engine's tokenizer: any id is one character (random weights: speed only)."""

    def decode(self, ids) -> str:
        return "".join(chr(0x4E00 + i % 20000) for i in ids)


def serve_prompts(vocab: int, n: int, tiny: bool) -> list[list[int]]:
    rng = random.Random(0)
    lo, hi = (4, 12) if tiny else (16, 48)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def drive_ours(engine, prompts, clients: int, requests: int, new: int) -> dict:
    """``clients`` in flight, each sending its next request when the last ends; the engine's own
    step loop in this thread (as ``Engine.run``)."""
    from llm_foundry.serve.engine import Params, Sequence

    done, errors = [], []
    todo = list(range(requests))

    def submit():
        i = todo.pop(0)

        def emit(kind, payload, i=i):
            if kind == "done":
                done.append(i)
                if str(payload).startswith("error"):
                    errors.append(str(payload)[:300])

        seq = Sequence(prompts[i % len(prompts)], Params(max_tokens=new, temperature=0.0), emit)
        seq.index = i
        engine.submit([seq])
        return seq

    seqs = []
    t = time.perf_counter()
    while todo and len(seqs) - len(done) < clients:
        seqs.append(submit())
    while len(done) < requests:
        engine.step()
        while todo and len(seqs) - len(done) < clients:
            seqs.append(submit())
    wall = time.perf_counter() - t
    tokens = sum(len(s.tokens) for s in seqs)
    return dict(clients=clients, requests=requests, tokens=tokens, wall_s=round(wall, 3),
                tokens_per_s=round(tokens / wall, 1), errors=errors[:3],
                outputs={s.index % len(prompts): list(s.tokens) for s in seqs})  # fmt: skip


def drive_hf(manager, prompts, clients: int, requests: int, new: int, tag: str) -> dict:
    """The same load on transformers' continuous batching manager (its own background thread)."""
    todo = list(range(requests))
    in_flight, tokens, errors, finished, outputs = 0, 0, [], 0, {}
    t = time.perf_counter()
    idle_since = time.monotonic()
    while finished < requests:
        while todo and in_flight < clients:
            i = todo.pop(0)
            manager.add_request(prompts[i % len(prompts)], request_id=f"{tag}-{i}",
                                max_new_tokens=new)  # fmt: skip
            in_flight += 1
        result = manager.get_result(timeout=0.5)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers' generation thread stopped")
            if time.monotonic() - idle_since > 60:
                raise TimeoutError("no result from transformers' manager for 60 s")
            continue
        idle_since = time.monotonic()
        if not result.is_finished():
            continue
        finished += 1
        in_flight -= 1
        tokens += len(result.generated_tokens)
        i = int(str(result.request_id).rsplit("-", 1)[1])
        outputs[i % len(prompts)] = list(result.generated_tokens)
        if getattr(result, "error", None):
            errors.append(str(result.error)[:300])
    wall = time.perf_counter() - t
    return dict(clients=clients, requests=requests, tokens=tokens, wall_s=round(wall, 3),
                tokens_per_s=round(tokens / wall, 1), errors=errors[:3],
                outputs=outputs)  # fmt: skip


def drive_hf_padded(hf, prompts, clients: int, requests: int, new: int, device) -> dict:
    """The fallback reference: ``generate`` on left-padded batches of ``clients`` prompts."""
    t = time.perf_counter()
    tokens = 0
    for start in range(0, requests, clients):
        batch = [prompts[i % len(prompts)] for i in range(start, min(requests, start + clients))]
        longest = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (longest - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in batch],
                            device=device)  # fmt: skip
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                              do_sample=False, pad_token_id=0, eos_token_id=None)  # fmt: skip
        tokens += (out.shape[1] - longest) * len(batch)
    wall = time.perf_counter() - t
    return dict(clients=clients, requests=requests, tokens=tokens, wall_s=round(wall, 3),
                tokens_per_s=round(tokens / wall, 1), errors=[])  # fmt: skip


def serve_levels(ctx) -> list[int]:
    return [int(c) for c in ctx.args.clients.split(",")] if not ctx.tiny else [1, 2, 4]


def section_serve(ctx: Ctx, res: dict, deadline: float) -> None:
    from llm_foundry.serve.engine import Engine

    dtype = torch.bfloat16 if (ctx.cuda or ctx.args.serve_dtype == "bf16") else torch.float32
    pair = llama_in(ctx, dtype)
    hf, ours, cfg = pair["hf"], pair["ours"], pair["cfg"]
    new = 8 if ctx.tiny else 64  # tokens/s, side by side: 64 leave time for every contender
    levels = serve_levels(ctx)
    prompts = serve_prompts(cfg["vocab_size"], 256, ctx.tiny)
    n_req = lambda c: max(3, 2 * c) if not ctx.quick else max(2, c)
    res.update(dtype=str(dtype), new_tokens=new, levels=levels, prompts="random ids, 16-48 tokens"
               if not ctx.tiny else "random ids, 4-12 tokens", runs={}, skipped=[])  # fmt: skip
    # ours: the engine as `llm-foundry serve` builds it (slots = the most clients), eager; then
    # transformers'; then, as time allows, a CUDA-graph option of the engine if it has one (every
    # level) and --compile (its one-row decode step compiled, the rest eager: 1 client only)
    variants = [
        (f"llm-foundry engine, {o}=True", {o: True}, levels) for o in engine_graph_options()
    ]
    if ctx.compile:
        variants.append(("llm-foundry engine --compile", dict(compile=True), levels[:1]))
    res["engine_variants"] = ["llm-foundry engine"] + [n for n, _, _ in variants]
    outputs: dict = {}  # (who, clients) -> {prompt index: tokens}

    def engine_runs(name, kw, at):
        if ctx.left(deadline) < (30 if kw else 10):
            res["skipped"].append(f"{name}: out of time")
            return
        engine = None
        try:
            engine = Engine(ours, CharDecoder(), slots=max(levels), max_queue=4 * max(levels), **kw)
            t = time.perf_counter()
            engine.warm_up()
            drive_ours(engine, prompts, 2, 2, min(new, 8))
            log(f"serve: {name} warmed up in {time.perf_counter() - t:.1f} s")
            rows = res["runs"].setdefault(name, [])
            for c in at:
                if ctx.left(deadline) < 5:
                    res["skipped"].append(f"{name} at {c} clients: out of time")
                    break
                row = drive_ours(engine, prompts, c, n_req(c), new)
                outputs[(name, c)] = row.pop("outputs")
                rows.append(row)
                log(f"serve: {name} {c:3d} clients {row['tokens_per_s']:9.1f} tok/s")
            if not kw and ctx.args.profile and ctx.left(deadline) > 10:
                res["profile_1_client"] = p = profile_engine(ctx, engine, prompts, min(new, 32))
                busy = (
                    f", the device busy {p['device_busy_ms_per_token']} ms of it"
                    if ctx.cuda
                    else ""
                )
                log(f"serve: {name}, 1 client profiled: {p['wall_ms_per_token']} ms a token{busy}; "
                    "host waits " + ", ".join(f"{k} x{v['calls_per_token']}"
                                              for k, v in p["host_waits"].items()))  # fmt: skip
        except Exception as e:  # noqa: BLE001 - the other engines and transformers still run
            res["skipped"].append(f"{name}: {short(e)}")
            log(f"serve: {name} failed: {short(e)}")
        finally:
            del engine

    engine_runs("llm-foundry engine", {}, levels)
    hf_rows = res["runs"].setdefault("transformers continuous batching", [])
    try:
        hf_continuous(ctx, res, hf, prompts, levels, new, n_req, hf_rows, outputs, deadline)
    except Exception as e:  # noqa: BLE001 - the fallback reference below
        res["transformers_error"] = short(e)
        log(f"serve: transformers continuous batching failed: {short(e)}; padded generate instead")
        rows = res["runs"].setdefault("transformers generate, padded batches (fallback)", [])
        for c in levels:
            if ctx.left(deadline) < 10:
                break
            rows.append(drive_hf_padded(hf, prompts, c, n_req(c), new, ctx.device))
            rows[-1].pop("outputs", None)
            log(f"serve: HF padded generate {c:3d} clients {rows[-1]['tokens_per_s']:9.1f} tok/s")
    for name, kw, at in variants:
        engine_runs(name, kw, at)
    summary = {}
    for name, rows in res["runs"].items():
        by = {r["clients"]: r["tokens_per_s"] for r in rows}
        if 1 in by and max(levels) in by:
            summary[f"{name}: {max(levels)} clients / 1"] = round(by[max(levels)] / by[1], 2)
    refs = ("transformers continuous batching", "transformers generate, padded batches (fallback)")
    for ref in refs:
        theirs = {r["clients"]: r["tokens_per_s"] for r in res["runs"].get(ref, [])}
        for name, rows in res["runs"].items():
            if name in refs:
                continue
            for r in rows:
                if theirs.get(r["clients"]):
                    key = f"{name} / {ref} at {r['clients']}"
                    summary[key] = round(r["tokens_per_s"] / theirs[r["clients"]], 2)
    res["summary"] = summary
    res["same_tokens_as_engine_solo"] = same_tokens(outputs, ("llm-foundry engine", 1))


# host-side calls that copy to or from the device or wait for it (each a possible stall)
HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "cudaMemcpy",
              "aten::item", "aten::_local_scalar_dense", "aten::nonzero")  # fmt: skip


def profile_engine(ctx: Ctx, engine, prompts, new: int, top: int = 10) -> dict:
    """torch.profiler over one request served alone (1 client, ``new`` tokens): per token, the
    wall time, the device's busy time (CUDA kernels), the host's copies and waits
    (``HOST_WAITS``) and the ops with the most CPU time of their own: what paces a lone row."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    ctx.sync()
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        row = drive_ours(engine, prompts, 1, 1, new)
        ctx.sync()
        wall = time.perf_counter() - t
    n = max(1, row["tokens"])
    busy, waits, cpu = 0.0, {}, []
    for e in prof.key_averages():
        dev = getattr(e, "self_device_time_total", None)
        dev = getattr(e, "self_cuda_time_total", 0) if dev is None else dev
        if (
            ctx.cuda
            and dev > 0
            and getattr(e, "device_type", None) != torch.autograd.DeviceType.CPU
        ):
            busy += dev / 1e3
        if e.key in HOST_WAITS:
            waits[e.key] = dict(calls_per_token=round(e.count / n, 2),
                                ms_per_token=round(e.cpu_time_total / 1e3 / n, 3))  # fmt: skip
        cpu.append((e.key, e.self_cpu_time_total / 1e3 / n, e.count / n))
    cpu.sort(key=lambda r: -r[1])
    return dict(
        tokens=n, wall_ms_per_token=round(wall * 1e3 / n, 2),
        device_busy_ms_per_token=round(busy / n, 3) if ctx.cuda else None,
        device_busy_fraction=round(busy / (wall * 1e3), 3) if ctx.cuda else None,
        host_waits=waits,
        top_cpu_ops=[dict(name=k[:100], self_ms_per_token=round(ms, 3), calls_per_token=round(c, 2))
                     for k, ms, c in cpu[:top]],
    )  # fmt: skip


def same_tokens(outputs: dict, ref_key) -> dict:
    """Per run, the fraction of requests whose tokens equal those the reference run gave for the
    same prompt (greedy; in bf16 the batch shapes may change the last bits, and so a token)."""
    ref = outputs.get(ref_key)
    if not ref:
        return {}
    out = {}
    for (who, c), got in outputs.items():
        common = [i for i in got if i in ref]
        if common and (who, c) != ref_key:
            out[f"{who} at {c}"] = round(sum(got[i] == ref[i] for i in common) / len(common), 3)
    return out


def engine_graph_options() -> list[str]:
    """The engine's boolean keyword options that look like CUDA-graph decoding, if any."""
    from llm_foundry.serve.engine import Engine

    return [
        n for n, p in inspect.signature(Engine.__init__).parameters.items()
        if any(k in n.lower() for k in ("graph", "cuda")) and isinstance(p.default, bool)
    ]  # fmt: skip


def hf_continuous(ctx, res, hf, prompts, levels, new, n_req, rows, outputs, deadline):
    import transformers

    gen = transformers.GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1,
                                        pad_token_id=0)  # fmt: skip
    cb = None
    bound = dict(num_blocks=256, max_batch_tokens=8192)  # `transformers serve --cb-num-blocks`..
    if hasattr(transformers, "ContinuousBatchingConfig"):
        try:
            cb = transformers.ContinuousBatchingConfig(**bound)
            res["transformers_cb_config"] = bound
        except TypeError as e:
            res["transformers_cb_config"] = f"defaults ({e})"
    kwargs = dict(generation_config=gen)
    if cb is not None:
        kwargs["continuous_batching_config"] = cb
    attn = hf.config._attn_implementation
    t = time.perf_counter()
    manager = hf.init_continuous_batching(**kwargs)
    manager.start()
    try:
        drive_hf(manager, prompts, 2, 2, min(new, 8), "warm")
        res["transformers_attn"] = f"{attn} -> {hf.config._attn_implementation}"
        log(f"serve: transformers continuous batching warmed up in {time.perf_counter() - t:.1f} s "
            f"(attention {res['transformers_attn']})")  # fmt: skip
        for c in levels:
            if ctx.left(deadline) < 8:
                res["skipped"].append(f"transformers at {c} clients: out of time")
                break
            rows.append(drive_hf(manager, prompts, c, n_req(c), new, f"c{c}"))
            outputs[("transformers continuous batching", c)] = rows[-1].pop("outputs")
            log(f"serve: transformers CB {c:3d} clients {rows[-1]['tokens_per_s']:9.1f} tok/s")
    finally:
        try:
            manager.stop(block=True, timeout=10)
        finally:
            if hasattr(manager, "destroy"):
                manager.destroy()


# ----------------------------------------------------------------------------------------------
# the run


FNS = dict(matmul=section_matmul, train=section_train, loader=section_loader,
           decode=section_decode, serve=section_serve, train32=section_train32)  # fmt: skip


def free(ctx: Ctx, keep: tuple = ()) -> None:
    for k in [k for k in ctx.shared if k not in keep]:
        if k not in ("matmul_tflops",):
            ctx.shared.pop(k)
    gc.collect()
    if ctx.cuda:
        torch.cuda.empty_cache()


def write(report: dict, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def table(report: dict) -> str:
    lines = []
    env = report["env"]
    lines.append(f"{env.get('card')} | torch {env.get('torch')} | CUDA {env.get('cuda')} | "
                 f"transformers {env.get('transformers')} | commit {str(env.get('commit'))[:10]} "
                 f"| {env.get('date')}")  # fmt: skip
    for name, sec in report["sections"].items():
        head = f"\n== {name}: {sec['status']} in {sec.get('seconds')} s"
        lines.append(head + (f" ({sec['error']})" if sec.get("error") else ""))
        if name == "matmul" and "tflops" in sec:
            lines.append(f"  {sec['n']}^3 {sec['dtype']}: {sec['tflops']} TFLOP/s")
        if name.startswith("train") and sec.get("rows"):
            lines.append(f"  batch {sec['batch']}, {sec['flops_per_token']:,} FLOPs/token")
            lines.append(f"  {'model':28} {'ms/iter':>8} {'tok/s':>9} {'MFU989':>7} "
                         f"{'MFUmeas':>7} {'peak GiB':>8} {'warm s':>6} {'loss0':>7}")  # fmt: skip
            for r in sec["rows"]:
                lines.append(f"  {r['name']:28} {r['ms_per_iter']:8.2f} {r['tokens_per_s']:9d} "
                             f"{r['mfu_989']:7.3f} {r['mfu_measured'] or 0:7.3f} "
                             f"{r['peak_mem_gib'] or 0:8.2f} {r['warmup_s']:6.1f} "
                             f"{r['first_loss']:7.3f}")  # fmt: skip
        if name == "loader" and "wait_fraction" in sec:
            lines.append(f"  {sec['batch']}: {sec['ms_per_step_loader']} ms/step fed by the "
                         f"Loader vs {sec['ms_per_step_on_device']} from the device; waiting "
                         f"{sec['wait_fraction'] * 100:.2f}% (with the copy "
                         f"{sec['wait_and_copy_fraction'] * 100:.2f}%)")  # fmt: skip
        if name == "decode" and sec.get("rows"):
            lines.append(f"  {'dtype':5} {'contender':52} {'tok/s':>8} {'vs HF':>6} "
                         f"{'=HF':>5} {'=eager':>6} {'first s':>7}")  # fmt: skip
            yn = {True: "yes", False: "no", None: "-"}
            for r in sec["rows"]:
                lines.append(f"  {r['dtype']:5} {r['name']:52} {r['tokens_per_s']:8.1f} "
                             f"{r['vs_hf'] or 0:6.2f} {yn[r.get('same_tokens_as_hf')]:>5} "
                             f"{yn[r.get('same_tokens_as_eager')]:>6} "
                             f"{r['first_call_s']:7.1f}")  # fmt: skip
        if name == "serve" and sec.get("runs"):
            for who, rows in sec["runs"].items():
                shown = ", ".join(f"{r['clients']}: {r['tokens_per_s']:.0f}" for r in rows)
                lines.append(f"  {who}: tok/s by clients {shown}")
            for k, v in sec.get("summary", {}).items():
                lines.append(f"  {k}: {v}x")
            for k, v in sec.get("same_tokens_as_engine_solo", {}).items():
                lines.append(f"  same tokens as the engine's 1-client run: {k}: {v:.0%}")
        for s in sec.get("skipped", []) or []:
            lines.append(f"  skipped: {s}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"run in the order given, of {', '.join(SECTIONS)}",
    )
    ap.add_argument(
        "--out", default="gpu_check.json", help="the JSON report (rewritten per section)"
    )
    ap.add_argument("--nanogpt", default=None, help="a nanoGPT checkout (its model.py)")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="fewer rounds and requests, no HF static cache, no train32",
    )
    ap.add_argument("--budget", type=float, default=290, help="seconds for the whole run")
    ap.add_argument(
        "--compile",
        choices=("auto", "on", "off"),
        default="auto",
        help="torch.compile (auto: on CUDA only)",
    )
    ap.add_argument(
        "--tiny",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="tiny models (default: on a CPU)",
    )
    ap.add_argument("--clients", default="1,8,32", help="serve: concurrency levels")
    ap.add_argument(
        "--serve-dtype",
        choices=("bf16", "fp32"),
        default="fp32",
        help="serve dtype on a CPU (a GPU always serves bf16)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch CPU threads (default: as torch sets them; 1 for a tiny CPU run)",
    )
    ap.add_argument(
        "--profile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="train: profile the kernels of nanoGPT's, ours and the fastest step",
    )
    ap.add_argument("--commit", default=None, help="the commit, where the tree has no .git")
    ap.add_argument(
        "--section-budget",
        action="append",
        default=[],
        metavar="NAME=SECONDS",
        help="a section's own budget on a GPU (default: "
        + ", ".join(f"{k} {v}" for k, v in BUDGETS.items())
        + ")",
    )
    args = ap.parse_args()
    for item in args.section_budget:
        name, _, sec = item.partition("=")
        if name not in BUDGETS or not sec.replace(".", "", 1).isdigit():
            ap.error(
                f"--section-budget {item!r}: expected NAME=SECONDS, NAME one of {', '.join(BUDGETS)}"
            )
        BUDGETS[name] = float(sec)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown:
        ap.error(f"--sections: unknown {unknown}; valid: {', '.join(SECTIONS)}")
    if args.quick and "train32" in args.sections and "--sections" not in " ".join(sys.argv):
        args.sections.remove("train32")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda: CUDA is not available here (use --device cpu)")
    ctx = Ctx(args)
    if args.threads or (ctx.tiny and not ctx.cuda):
        # a dry run on a shared CPU: one thread, or every op waits for a second busy core
        torch.set_num_threads(args.threads or 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = dict(
        schema="gpu_check/1",
        command="python benchmarks/gpu_check.py " + " ".join(sys.argv[1:]),
        env=safe_environment(ctx),
        settings=dict(device=str(ctx.device), tiny=ctx.tiny, compile=ctx.compile, quick=ctx.quick,
                      sections=args.sections, budget_s=args.budget, peak_tflops=PEAK_TFLOPS,
                      section_budgets_s=BUDGETS if ctx.cuda else 120),
        sections={},
    )  # fmt: skip
    log(f"{report['env'].get('card')}, torch {torch.__version__}, CUDA {torch.version.cuda}; "
        f"sections {', '.join(args.sections)}")  # fmt: skip
    write(report, out)
    for name in args.sections:  # in the order given
        sec = report["sections"][name] = dict(status="running")
        budget = BUDGETS[name] if ctx.cuda else 120
        left = ctx.end - time.monotonic()
        if left < 5:
            sec.update(status="skipped", error="out of the run's time budget")
            log(f"{name}: skipped, out of time")
            write(report, out)
            continue
        deadline = time.monotonic() + min(budget, left)
        log(f"{name}: start (budget {min(budget, left):.0f} s)")
        t = time.monotonic()
        try:
            with watchdog(min(budget, left) + GRACE_S):
                FNS[name](ctx, sec, deadline)
            sec["status"] = "ok"
        except SectionTimeout as e:
            sec.update(status="timeout", error=str(e))
        except Exception as e:  # noqa: BLE001 - recorded; the next section goes on
            sec.update(status="error", error=short(e),
                       traceback=traceback.format_exc()[-3000:])  # fmt: skip
        sec["seconds"] = round(time.monotonic() - t, 1)
        log(f"{name}: {sec['status']} in {sec['seconds']} s"
            + (f": {sec['error']}" if sec.get("error") else ""))  # fmt: skip
        if sec.get("traceback"):
            print(sec["traceback"], file=sys.stderr, flush=True)
        try:  # the models of a finished stage go, with their compiled code
            later = args.sections[args.sections.index(name) + 1 :]
            if name != "train" or "loader" not in later:  # loader reuses train's model
                free(ctx)
                torch._dynamo.reset()
            if ctx.cuda:  # what the caching allocator still holds (a leak shows here)
                sec["memory_reserved_after_gib"] = round(torch.cuda.memory_reserved() / 2**30, 1)
        except Exception as e:  # noqa: BLE001
            sec["cleanup_error"] = short(e)
        write(report, out)
    report["total_s"] = round(time.monotonic() - T0, 1)
    write(report, out)
    try:
        print(table(report), flush=True)
    except Exception as e:  # noqa: BLE001 - the JSON is written; the table is a courtesy
        print(f"(no table: {short(e)})", flush=True)
    log(f"wrote {out} ({report['total_s']} s)")
    bad = [n for n, s in report["sections"].items() if s["status"] in ("error", "timeout")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
