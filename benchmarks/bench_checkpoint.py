"""How long a checkpoint save stops training: gathered full vs DCP vs async DCP (issue 30).

A 124M-parameter GPT-2 (the ``gpt2`` preset) sharded by FSDP2 over ``--nproc`` gloo ranks on the
CPU, its AdamW state in place after one step. Each save is timed on every rank from the moment
training asks for it until training may go on, and the slowest rank counts; ``--repeats`` saves
of each kind, the kinds in turns:

  full       ``train.checkpoint_format full`` as ``Trainer.save`` does it: model and optimizer
             gathered to rank 0 (``distributed.full_model_state`` / ``full_optimizer_state``),
             a plain copy of the model filled there, rank 0 writes the safetensors step
             directory (``state.save_train_checkpoint``, fsynced), then a barrier.
  dcp        ``train/dcp.py::ShardedCheckpoints``: every rank writes its shards (``dcp.save``,
             fsynced), rank 0 commits the directory.
  dcp-async  the same in the background (``dcp.async_save``): training waits for the copy of
             its shards into host memory only. Training steps then go on while it is written;
             the time until it is complete and committed, and those steps' times (the writer
             thread shares the CPU with them), are reported too.

    python benchmarks/bench_checkpoint.py [--json] [--repeats 3] [--nproc 2] [--threads 1]

It starts torchrun itself (``--nproc`` ranks of ``--threads`` threads). With ``--json`` the
report is also written to benchmarks/results_checkpoint_DATE.json.
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
import time
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
KINDS = ("full", "dcp", "dcp-async")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="write results_checkpoint_DATE.json")
    p.add_argument("--repeats", type=int, default=3, help="saves of each kind")
    p.add_argument("--nproc", type=int, default=2, help="FSDP2 ranks (gloo, CPU)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--preset", default="gpt2", help="model preset (default: GPT-2 124M)")
    p.add_argument("--batch", type=int, default=1, help="rows per rank of a training step")
    p.add_argument("--block", type=int, default=128, help="tokens per row of a training step")
    p.add_argument("--out", default=None, help="directory for the checkpoints (default: a temp)")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse(argv)
    if "WORLD_SIZE" not in os.environ:  # this process launches the ranks
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        src = str(HERE.parent / "src")
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                  f"--nproc-per-node={args.nproc}", __file__, *argv]  # fmt: skip
        return subprocess.call(launch, env=env)
    return rank_main(args, argv)


def rank_main(args: argparse.Namespace, argv: list[str]) -> int:
    from llm_foundry.bench import cpu_model
    from llm_foundry.models import Transformer
    from llm_foundry.presets import get_preset
    from llm_foundry.train import distributed as D
    from llm_foundry.train.config import TrainConfig
    from llm_foundry.train.dcp import ShardedCheckpoints
    from llm_foundry.train.optim import build_optimizer

    torch.set_num_threads(args.threads)
    world, device = D.init_world(torch.device("cpu"), "fsdp")
    cfg = get_preset(args.preset)
    torch.manual_seed(0)
    model = Transformer(cfg)
    params = model.num_params()
    wrapped = D.wrap(model, "fsdp", world, device, "fp32")
    optimizer = build_optimizer(model, TrainConfig(parallel="fsdp"), device, sharded=True)
    gen = torch.Generator().manual_seed(world.rank)
    block = min(args.block, cfg.max_seq_len)

    def step() -> float:
        t0 = time.perf_counter()
        x = torch.randint(0, cfg.vocab_size, (args.batch, block + 1), generator=gen)
        loss = wrapped(x[:, :-1], x[:, 1:])[1]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    def slowest(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    step()  # the optimizer's state exists from here on
    baseline = [slowest(step()) for _ in range(3)]
    root = Path(args.out or (tempfile.mkdtemp(prefix="bench_ckpt_") if world.main else ""))
    root = Path(D.from_main(str(root), world))
    state = {"note": "benchmark"}  # the trainer's JSON state is small next to the tensors

    def save_full(ckpt: Path, n: int) -> None:  # Trainer.save with checkpoint_format full
        from llm_foundry.train.state import prune_checkpoints, save_train_checkpoint

        model_sd = D.full_model_state(wrapped, "fsdp", world)
        optim_sd = D.full_optimizer_state(wrapped, optimizer, "fsdp", world)
        if world.main:
            plain = Transformer(cfg)
            plain.load_state_dict(D.with_tied(plain, model_sd))
            path = save_train_checkpoint(ckpt, n, plain, optim_sd, state)
            prune_checkpoints(ckpt, 1, {path.name})
        dist.barrier()

    savers = {
        kind: ShardedCheckpoints(root / kind, world, kind == "dcp-async", keep_last=1)
        for kind in KINDS[1:]
    }
    rows: dict[str, list[dict]] = {kind: [] for kind in KINDS}
    for n in range(1, args.repeats + 1):
        for kind in KINDS:
            dist.barrier()
            t0 = time.perf_counter()
            if kind == "full":
                save_full(root / kind, n)
            else:
                savers[kind].save(n, wrapped, model, optimizer, state, None, set(),
                                  blocking=False)  # fmt: skip
            row = {"blocked_s": slowest(time.perf_counter() - t0)}
            if kind == "dcp-async":  # train on until every rank's writes are done, then commit
                steps = []
                while True:
                    steps.append(slowest(step()))
                    done = savers[kind].pending.future.done()
                    if not D.any_rank(not done, world, device):
                        break
                savers[kind].finish()
                dist.barrier()
                row["complete_s"] = slowest(time.perf_counter() - t0)
                row["steps_while_writing"] = len(steps)
                row["step_s_while_writing"] = statistics.mean(steps)
            rows[kind].append(row)
            if world.main:
                print(f"{kind:9s} save {n}: {json.dumps(row)}", flush=True)
    after = [slowest(step()) for _ in range(3)]
    if world.main:
        sizes = {k: du(root / k) for k in KINDS}
        report = {
            "date": datetime.date.today().isoformat(),
            "command": "python benchmarks/bench_checkpoint.py " + " ".join(argv),
            "machine": {
                "cpu": cpu_model(),
                "cores": os.cpu_count(),
                "torch": torch.__version__,
                "python": platform.python_version(),
                "ranks": world.world_size,
                "backend": "gloo",
                "threads_per_rank": args.threads,
                "load_average_1m": os.getloadavg()[0],  # other work on the machine meanwhile
            },
            "model": dict(preset=args.preset, params=params, parallel="fsdp", optimizer="adamw"),
            "train_step": dict(
                batch_per_rank=args.batch, block=block, step_s=statistics.median(baseline + after)
            ),
            "checkpoint_bytes": sizes,
            "saves": rows,
            "summary": {kind: summary(rows[kind]) for kind in KINDS},
        }
        print(json.dumps(report["summary"], indent=2))
        if args.json:
            out = HERE / f"results_checkpoint_{report['date']}.json"
            out.write_text(json.dumps(report, indent=1) + "\n")
            print(f"wrote {out}")
        if args.out is None:
            shutil.rmtree(root, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def summary(rows: list[dict]) -> dict:
    """The median of each timing over the repeats."""
    return {f"median_{k}": statistics.median(r[k] for r in rows) for k in rows[0]}


def du(path: Path) -> int:
    """Bytes of the files under ``path`` (the kept checkpoint)."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
