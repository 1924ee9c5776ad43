"""Training on 2 CPU processes (torchrun, gloo): DDP and FSDP2 give one process's losses (text,
sharded text packed into documents, experts, SFT rows with and without LoRA), and checkpoints
move between world sizes: full ones, and sharded (DCP) ones that each rank writes (2 -> 4 -> 1
ranks). Each rank runs one thread."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import corpus_text, reversal_sft
from sharded import sharded_text

from llm_foundry.presets import get_preset
from llm_foundry.train.config import TrainConfig
from llm_foundry.train.trainer import Trainer

pytestmark = pytest.mark.heavy  # subprocesses: left out of `make test-fast`

MODEL = dict(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, hidden_dim=64, max_seq_len=16)
# a constant schedule, so a run resumed with a larger max_steps follows the uninterrupted one
TRAIN = dict(
    block_size=16,
    schedule="constant",
    warmup_steps=2,
    eval_interval=5,
    eval_batches=2,
    checkpoint_interval=5,
    keep_last=3,
    sample_tokens=0,
    progress=False,
)
GLOBAL_BATCH = 8


@pytest.fixture(scope="module")
def data_dir(char_data) -> Path:
    """A small character-level corpus (Shakespeare when the shared copy is there)."""
    return char_data(30_000)


def _flags(**train) -> list[str]:
    out = ["--preset", "llama-shakespeare-char"]
    out += [f"--model.{k}={v}" for k, v in MODEL.items()]
    out += [f"--train.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in train.items()]
    return out


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    return env


def torchrun(args: list[str], nproc: int = 2, script: str | None = None, timeout: int = 240):
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    launch += [f"--nproc-per-node={nproc}"]
    launch += [script] if script else ["-m", "llm_foundry"]
    return subprocess.run(
        launch + args, env=_env(), capture_output=True, text=True, timeout=timeout
    )


def one_process(data_dir: Path, out: Path, resume: bool = False, model: dict | None = None,
                **train) -> None:  # fmt: skip
    """The reference: one process (in this one) at the whole global batch (``model``: fields
    changed from MODEL's)."""
    cfg = get_preset("llama-shakespeare-char", **{**MODEL, **(model or {})})
    tc = TrainConfig(**{**TRAIN, "batch_size": GLOBAL_BATCH, **train})
    Trainer(cfg, tc, data_dir, out, resume=resume).run()


def losses(run: Path) -> dict[int, float]:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


def grad_norms(run: Path) -> dict[int, float]:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["grad_norm"] for r in recs if "grad_norm" in r}


def val_losses(run: Path) -> dict[int, float]:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["val_loss"] for r in recs if "val_loss" in r}


def assert_close(a: dict[int, float], b: dict[int, float], tol: float = 2e-4) -> None:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    worst = max(abs(a[k] - b[k]) for k in a)
    print(f"max |loss difference| over {len(a)} steps: {worst:.2e}")
    assert worst < tol, f"max |loss difference| {worst:.2e} over steps {sorted(a)}"


@pytest.fixture(scope="module")
def reference(data_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ref")
    one_process(data_dir, out, max_steps=10)
    return out


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_give_the_losses_of_one_process(parallel, data_dir, reference, tmp_path):
    run = tmp_path / parallel
    args = ["train", "--data", str(data_dir), "--out", str(run)]
    args += _flags(**TRAIN, batch_size=GLOBAL_BATCH // 2, max_steps=10, parallel=parallel)
    r = torchrun(args)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert_close(losses(run), losses(reference))
    assert_close(val_losses(run), val_losses(reference))
    # only rank 0 prints, and it states the global batch
    assert r.stdout.count("global batch: 4 per rank x 1 accumulation x 2 rank(s) = 8") == 1
    info = json.loads((run / "run.json").read_text())
    assert info["world_size"] == 2 and info["parallel"] == parallel


@pytest.mark.parametrize("parallel", ["ddp", "fsdp", "tp"])
def test_muon_on_two_ranks_gives_the_losses_of_one_process(parallel, data_dir, tmp_path):
    """DDP hands Muon whole, averaged gradients; under FSDP2 and tensor parallelism each rank
    gathers the whole momentum matrix to orthogonalise it: the updates are one process's."""
    ref = tmp_path / "one"
    one_process(data_dir, ref, max_steps=10, optimizer="muon")
    run = tmp_path / parallel
    batch = GLOBAL_BATCH if parallel == "tp" else GLOBAL_BATCH // 2  # a tp pair shares a batch
    args = ["train", "--data", str(data_dir), "--out", str(run)]
    args += _flags(**TRAIN, batch_size=batch, max_steps=10, parallel=parallel, optimizer="muon")
    r = torchrun(args)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert_close(losses(run), losses(ref))


def test_gradient_accumulation_with_ddp_matches_one_process(data_dir, reference, tmp_path):
    run = tmp_path / "accum"
    args = ["train", "--data", str(data_dir), "--out", str(run)]
    args += _flags(**TRAIN, batch_size=2, grad_accum=2, max_steps=10, parallel="ddp")
    r = torchrun(args)
    assert r.returncode == 0, r.stderr[-3000:]
    # 2 ranks x 2 micro-batches of 2 = the same 8 windows a step (the sampler draws in order),
    # and the gradient only synchronised on the second micro-batch; validation too scores
    # global batches of 8
    assert_close(losses(run), losses(reference))
    assert_close(val_losses(run), val_losses(reference))


def test_monitor_on_two_ddp_ranks_records_what_one_process_does(data_dir, tmp_path):
    """The dynamics monitor probes a batch sized by the global batch (not a rank's share), and
    per-layer gradient norms of the averaged gradient: its records are one process's."""
    ref, run = tmp_path / "one", tmp_path / "ddp"
    one_process(data_dir, ref, max_steps=4, monitor_interval=2)
    args = ["train", "--data", str(data_dir), "--out", str(run)]
    args += _flags(**TRAIN, batch_size=GLOBAL_BATCH // 2, max_steps=4, parallel="ddp",
                   monitor_interval=2)  # fmt: skip
    r = torchrun(args)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]

    def records(out: Path) -> list[dict]:
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        return [row for row in rows if "monitor" in row]

    def flat(value) -> list[float]:
        if isinstance(value, dict):
            return [x for k in sorted(value) for x in flat(value[k])]
        return [x for v in value for x in flat(v)] if isinstance(value, list) else [value]

    ours, theirs = records(run), records(ref)
    assert [x["step"] for x in ours] == [x["step"] for x in theirs] == [1, 2, 4]
    for a, b in zip(ours, theirs, strict=True):
        assert a["monitor"].keys() == b["monitor"].keys()
        assert flat(a["monitor"]) == pytest.approx(flat(b["monitor"]), rel=1e-4, abs=1e-6)


def test_two_ranks_checkpoint_validates_alike_in_one_process_with_accumulation(data_dir,
                                                                              reference, tmp_path):  # fmt: skip
    """A checkpoint of 2 DDP ranks at batch 4, resumed in one process at batch 4 x 2
    micro-batches (what the resume note advises): the same weights get the same val loss, and
    the run goes on with the uninterrupted run's train and val losses."""
    run = tmp_path / "run"
    args = ["train", "--data", str(data_dir), "--out", str(run)]
    r = torchrun(args + _flags(**TRAIN, batch_size=GLOBAL_BATCH // 2, max_steps=5, parallel="ddp"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    cfg = get_preset("llama-shakespeare-char", **MODEL)
    tc = TrainConfig(**{**TRAIN, "batch_size": GLOBAL_BATCH // 2, "grad_accum": 2, "max_steps": 10})
    trainer = Trainer(cfg, tc, data_dir, run, resume=True)
    try:
        val = trainer.evaluate()  # the step-5 weights, as the 2 ranks validated them
    except BaseException:
        trainer.release()
        raise
    assert_close({5: val}, {5: val_losses(run)[5]})
    trainer.run()
    assert_close(losses(run), losses(reference))
    assert_close(val_losses(run), val_losses(reference))


def _per_rank_batch(parallel: str, nproc: int) -> int:
    """The per-rank batch that keeps GLOBAL_BATCH: tensor-parallel groups of 2 share theirs."""
    return GLOBAL_BATCH // (nproc // (2 if parallel in ("tp", "fsdp+tp") else 1))


@pytest.mark.parametrize("parallel,nproc", [("ddp", 2), ("fsdp", 2), ("tp", 2), ("fsdp+tp", 4)])
def test_save_with_many_ranks_resume_with_one(parallel, nproc, data_dir, tmp_path):
    full = tmp_path / "full"
    one_process(data_dir, full, max_steps=10)
    run = tmp_path / "run"
    args = ["train", "--data", str(data_dir), "--out", str(run)]
    batch = _per_rank_batch(parallel, nproc)
    r = torchrun(args + _flags(**TRAIN, batch_size=batch, max_steps=5, parallel=parallel),
                 nproc=nproc, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    one_process(data_dir, run, resume=True, max_steps=10)
    assert_close(losses(run), losses(full))


@pytest.mark.parametrize("parallel", ["fsdp", "tp"])
def test_save_with_one_process_resume_with_two_ranks(parallel, data_dir, tmp_path):
    full = tmp_path / "full"
    one_process(data_dir, full, max_steps=10)
    run = tmp_path / "run"
    one_process(data_dir, run, max_steps=5)
    args = ["train", "--data", str(data_dir), "--out", str(run), "--resume"]
    batch = _per_rank_batch(parallel, 2)
    r = torchrun(args + _flags(**TRAIN, batch_size=batch, max_steps=10, parallel=parallel))
    assert r.returncode == 0, r.stderr[-3000:]
    assert_close(losses(run), losses(full))


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory) -> Path:
    """The corpus's paragraphs as documents in 3 train shards (tests/sharded.py)."""
    return sharded_text(tmp_path_factory.mktemp("shards") / "d", corpus_text(30_000), 3, 2)


def test_sharded_packed_corpus_on_two_ranks_then_one_process(sharded_dir, tmp_path):
    """Rows packed with whole documents of several shards: 2 DDP ranks give one process's
    losses; their checkpoint (step 5), resumed by one process, gives the uninterrupted run's."""
    packed = dict(data_sampling="packed", document_mask=True)
    full = tmp_path / "full"
    one_process(sharded_dir, full, max_steps=10, **packed)
    run = tmp_path / "run"
    args = ["train", "--data", str(sharded_dir), "--out", str(run)]
    args += _flags(**TRAIN, batch_size=GLOBAL_BATCH // 2, max_steps=5, parallel="ddp", **packed)
    r = torchrun(args)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert_close(losses(run), {k: v for k, v in losses(full).items() if k <= 5})
    one_process(sharded_dir, run, resume=True, max_steps=10, **packed)
    assert_close(losses(run), losses(full))
    assert_close(val_losses(run), val_losses(full))


def test_a_failing_rank_stops_the_job_with_its_error(data_dir, tmp_path):
    script = tmp_path / "fail_on_rank1.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys
            from torch.distributed.elastic.multiprocessing.errors import record
            from llm_foundry.cli import main
            from llm_foundry.train.trainer import Trainer

            original = Trainer._train_step

            def step(self, *args, **kwargs):
                if self.world.rank == 1 and self.step == 3:
                    raise RuntimeError("disk on fire on rank 1 at step 3")
                return original(self, *args, **kwargs)

            Trainer._train_step = step
            sys.exit(record(main)())
            """
        )
    )
    args = ["train", "--data", str(data_dir), "--out", str(tmp_path / "run")]
    r = torchrun(
        args + _flags(**TRAIN, batch_size=4, max_steps=10, parallel="ddp"),
        script=str(script),
        timeout=180,
    )
    assert r.returncode != 0
    assert "disk on fire on rank 1 at step 3" in r.stdout + r.stderr


def test_more_than_one_process_needs_a_parallel_mode(data_dir, tmp_path):
    args = ["train", "--data", str(data_dir), "--out", str(tmp_path / "run")]
    r = torchrun(args + _flags(**TRAIN, batch_size=4, max_steps=2))
    assert r.returncode != 0
    msg = "train.parallel='none' with 2 processes: choose one of ddp, fsdp, tp, fsdp+tp"
    assert msg in r.stdout + r.stderr


EXPERTS = dict(n_experts=4, experts_per_token=2, expert_hidden_dim=32, moe_aux_loss_coef=0.0)


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_experts_train_across_ranks_as_in_one_process(parallel, data_dir, tmp_path):
    """A mixture of experts (its balancing loss off: a per-rank balance is not the global one)
    gives one process's losses; the expert-load records count every rank's tokens."""
    one = tmp_path / "one"
    cfg = get_preset("llama-shakespeare-char", **MODEL, **EXPERTS)
    tc = TrainConfig(**{**TRAIN, "batch_size": GLOBAL_BATCH, "max_steps": 10})
    Trainer(cfg, tc, data_dir, one).run()
    run = tmp_path / parallel
    args = ["train", "--data", str(data_dir), "--out", str(run)]
    args += [f"--model.{k}={v}" for k, v in EXPERTS.items()]
    args += _flags(**TRAIN, batch_size=GLOBAL_BATCH // 2, max_steps=10, parallel=parallel)
    r = torchrun(args)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert_close(losses(run), losses(one))

    def load(path):
        recs = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
        return [x for r in recs if "experts" in r for row in r["experts"]["load"] for x in row]

    assert len(load(run)) == len(load(one)) == 2 * 2 * 4  # 2 records x 2 layers x 4 experts
    assert max(abs(a - b) for a, b in zip(load(run), load(one), strict=True)) < 0.02


# ----------------------------------------------------------------------------------------------
# Supervised fine-tuning: rows with different numbers of completion tokens on each rank


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory) -> Path:
    """Prompt/completion rows of 3-14 characters: each batch row holds 1-7 target tokens, so
    the ranks' halves of a global batch hold different numbers of them."""
    return reversal_sft(tmp_path_factory.mktemp("sft"), 60, 0.2)


@pytest.mark.parametrize("base", [None, "int8", "nf4"], ids=["full", "lora-int8", "lora-nf4"])
def test_sft_on_two_ddp_ranks_gives_the_losses_of_one_process(base, sft_dir, tmp_path):
    """The loss is the mean over the global batch's completion tokens: each rank weighs its
    mean by its share of them, as one process at the whole batch does. With LoRA only the
    adapters have gradients (DDP reduces those) and the int8 or nf4 base (codes and constants)
    is broadcast like any other."""
    adapters = dict(lora_r=2, lora_targets="wq,wv,w2", lora_base_dtype=base) if base else {}
    one = tmp_path / "one"
    one_process(sft_dir, one, max_steps=6, **adapters)
    run = tmp_path / "ddp"
    args = ["train", "--data", str(sft_dir), "--out", str(run)]
    args += _flags(**TRAIN, batch_size=GLOBAL_BATCH // 2, max_steps=6, parallel="ddp", **adapters)
    r = torchrun(args)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert_close(losses(run), losses(one), tol=1e-5 * max(losses(one).values()))
    assert_close(val_losses(run), val_losses(one), tol=1e-5 * max(val_losses(one).values()))


# ----------------------------------------------------------------------------------------------
# Tensor parallelism: each matrix split over the ranks of a group (tp), and FSDP2 across groups
# (fsdp+tp, a 2-D mesh on 4 processes). MODEL is MQA (n_heads=2, n_kv_heads=1): K/V replicated.

GRADS_SCRIPT = """
import json, sys
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from llm_foundry.presets import get_preset
from llm_foundry.models import Transformer
from llm_foundry.train import distributed as D
from llm_foundry.train import tensor_parallel as TP

parallel = sys.argv[1]
small = dict(vocab_size=65, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_seq_len=16)
variants = {
    "llama-gqa-qknorm": ("llama-shakespeare-char", dict(n_kv_heads=2, qk_norm=True)),
    "llama-mqa-tied": ("llama-shakespeare-char", dict(n_kv_heads=1, tie_embeddings=True)),
    "gpt2-learned-pos": ("gpt2-shakespeare-char", {}),
    "falcon-parallel-block": ("llama-shakespeare-char", dict(parallel_block=True, n_kv_heads=1)),
    "post-norm-sliding-window": ("llama-shakespeare-char", dict(norm_position="post", sliding_window=5)),
}
world = None
out = {}
for name, (preset, kw) in variants.items():
    torch.manual_seed(0)
    cfg = get_preset(preset, **small, **kw)
    model, one = Transformer(cfg), Transformer(cfg)
    one.load_state_dict(model.state_dict())
    x, y = torch.randint(0, 65, (4, 16)), torch.randint(0, 65, (4, 16))
    one(x, y)[1].backward()  # the reference: one process, the whole batch
    if world is None:
        world, _ = D.init_world(torch.device("cpu"), parallel, 2)
    wrapped = D.wrap(model, parallel, world, torch.device("cpu"), "fp32")
    rows = slice(world.dp_rank * 4 // world.dp_size, (world.dp_rank + 1) * 4 // world.dp_size)
    with TP.loss_context():
        loss = TP.local(wrapped(x[rows], y[rows])[1])
        loss.backward()
    TP.settle_grads(model)
    worst = 0.0
    for (n, p), (_, q) in zip(model.named_parameters(), one.named_parameters(), strict=True):
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        worst = max(worst, ((g - q.grad).abs().max() / q.grad.abs().max()).item())
    out[name] = dict(loss=D.mean(loss.detach(), world).item(), one_loss=one(x, y)[1].item(),
                     worst=worst, split=[n for n, p in model.named_parameters()
                                         if isinstance(p, DTensor) and p.to_local().numel() < p.numel()])
if world.main:
    print("RESULT " + json.dumps(out))
dist.destroy_process_group()
"""


@pytest.mark.parametrize("parallel,nproc", [("tp", 2), ("fsdp+tp", 4)])
def test_tensor_parallel_gives_the_loss_and_gradients_of_one_process(parallel, nproc, tmp_path):
    """Every parameter's gradient, gathered, equals one process's on the whole batch (fp32
    tolerance), for GQA with QK-norm, MQA with tied embeddings, GPT-2's learned positions,
    Falcon's parallel block and post-norm with a sliding window."""
    script = tmp_path / "grads.py"
    script.write_text(GRADS_SCRIPT)
    r = torchrun([parallel], nproc=nproc, script=str(script), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    results = json.loads(r.stdout.split("RESULT ", 1)[1].splitlines()[0])
    assert len(results) == 5
    for name, res in results.items():
        assert abs(res["loss"] - res["one_loss"]) < 1e-5, (name, res)
        assert res["worst"] < 1e-5, (name, res["worst"])
        # the matrices really are split: attention and MLP projections, vocab rows
        for split in ("layers.0.attn.wq.weight", "layers.1.mlp.w2.weight", "tok_emb.weight"):
            assert split in res["split"], (name, res["split"])


@pytest.mark.parametrize("parallel,nproc", [("tp", 2), ("fsdp+tp", 4)])
def test_tensor_parallel_trains_as_one_process(parallel, nproc, data_dir, reference, tmp_path):
    """10 steps: losses, gradient norms and validation losses of one process at the same global
    batch (tp: both ranks read the same 8 rows; fsdp+tp: 2 groups of 4)."""
    run = tmp_path / parallel
    groups = nproc // 2
    args = ["train", "--data", str(data_dir), "--out", str(run)]
    args += _flags(**TRAIN, batch_size=GLOBAL_BATCH // groups, max_steps=10, parallel=parallel)
    r = torchrun(args, nproc=nproc, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert_close(losses(run), losses(reference))
    assert_close(grad_norms(run), grad_norms(reference))
    assert_close(val_losses(run), val_losses(reference))
    assert f"x {groups} data-parallel group(s) = {GLOBAL_BATCH} sequences" in r.stdout
    assert "(2-way tensor parallel in each group)" in r.stdout
    info = json.loads((run / "run.json").read_text())
    assert info["world_size"] == nproc and info["tensor_parallel"] == 2


def test_tensor_parallelism_refuses_heads_and_sequences_that_do_not_split(data_dir, tmp_path):
    args = ["train", "--data", str(data_dir), "--out", str(tmp_path / "run")]
    args += _flags(**{**TRAIN, "block_size": 15}, batch_size=4, max_steps=2, parallel="tp")
    args += ["--model.dim=48", "--model.n_heads=3", "--model.n_kv_heads=3"]
    r = torchrun(args)
    assert r.returncode != 0
    err = r.stdout + r.stderr
    assert err.count("llm-foundry train: error:") == 1, err  # the same on every rank: said once
    assert "model.n_heads=3 must divide by the tensor-parallel degree 2" in err
    assert "model.n_kv_heads=3 must divide by the tensor-parallel degree 2" in err
    assert "train.block_size=15 must divide by the tensor-parallel degree 2" in err


# ----------------------------------------------------------------------------------------------
# Sharded checkpoints (train.checkpoint_format dcp): every rank writes its own shards, and a run
# resumes from them on any number of ranks, in any layout


DCP_FLAGS = dict(parallel="fsdp", checkpoint_format="dcp-async", batch_size=GLOBAL_BATCH // 2)
TIED = ["--model.tie_embeddings=true"]  # a tensor under two names: stored once, loaded into both


@pytest.fixture(scope="module")
def dcp_run(data_dir, tmp_path_factory) -> Path:
    """10 steps on 2 FSDP2 ranks saving dcp-async checkpoints: the one of step 5 written in the
    background while training went on, the last one waited for. Tied embeddings."""
    run = tmp_path_factory.mktemp("dcp") / "run"
    args = ["train", "--data", str(data_dir), "--out", str(run), *TIED]
    r = torchrun(args + _flags(**TRAIN, **DCP_FLAGS, max_steps=10))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return run


def _stopped_at_5(run: Path, to: Path) -> Path:
    """A copy of ``run`` as a run stopped after its step-5 checkpoint would have left it."""
    import shutil

    shutil.copytree(run, to)
    shutil.rmtree(to / "checkpoints" / "step_000010")
    (to / "checkpoints" / "latest.json").write_text('{"step": 5, "path": "step_000005"}')
    return to


def test_dcp_resume_on_the_same_ranks_is_exact(data_dir, dcp_run, tmp_path):
    """Resumed from step 5 on 2 FSDP2 ranks, the run gives the uninterrupted one's losses bit
    for bit. Each checkpoint is every rank's shards and DCP's index, nothing gathered."""
    run = _stopped_at_5(dcp_run, tmp_path / "run")
    args = ["train", "--data", str(data_dir), "--out", str(run), "--resume", *TIED]
    r = torchrun(args + _flags(**TRAIN, **DCP_FLAGS, max_steps=10))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert losses(run) == losses(dcp_run) and len(losses(run)) == 10
    assert val_losses(run) == val_losses(dcp_run)
    for ckpt in ("step_000005", "step_000010"):
        files = sorted(p.name for p in (dcp_run / "checkpoints" / ckpt).iterdir())
        assert files == ["config.json", "dcp", "state.json", "tokenizer.json"]
        shards = sorted(p.name for p in (dcp_run / "checkpoints" / ckpt / "dcp").iterdir())
        assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not list((dcp_run / "checkpoints").glob(".tmp-*"))
    latest = json.loads((dcp_run / "checkpoints" / "latest.json").read_text())
    assert latest == {"step": 10, "path": "step_000010"}


def test_dcp_reshards_from_2_ranks_to_a_2d_mesh_of_4_then_one_process(data_dir, dcp_run,
                                                                        tmp_path):  # fmt: skip
    """Saved by 2 FSDP2 ranks (step 5), resumed on 4 as a 2 x 2 FSDP x TP mesh (to step 10,
    saved there as dcp), then by one process (to 15, saved as full): one process's losses all
    the way (the data position is global, the same for any world size). The 2-D mesh's
    checkpoint converts to safetensors and back to the same tensors."""
    from llm_foundry.checkpoint import DCP_DIR, load_checkpoint, read_dcp_tensors
    from llm_foundry.cli import main

    ref = tmp_path / "ref"
    one_process(data_dir, ref, max_steps=15, model=dict(tie_embeddings=True))
    run = _stopped_at_5(dcp_run, tmp_path / "run")
    args = ["train", "--data", str(data_dir), "--out", str(run), "--resume", *TIED]
    flags = {**DCP_FLAGS, "parallel": "fsdp+tp", "checkpoint_format": "dcp"}
    r = torchrun(args + _flags(**TRAIN, **flags, max_steps=10), nproc=4, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ckpt = run / "checkpoints" / "step_000010"
    assert len(list((ckpt / DCP_DIR).glob("*.distcp"))) == 4
    one_process(data_dir, run, resume=True, max_steps=15, model=dict(tie_embeddings=True))
    assert_close(losses(run), losses(ref))
    assert_close(val_losses(run), val_losses(ref))
    full, back = tmp_path / "full", tmp_path / "back"
    assert main(["convert", "--from-dcp", str(ckpt), "--out", str(full)]) == 0
    assert main(["convert", "--to-dcp", str(full), "--out", str(back)]) == 0
    a, b = read_dcp_tensors(ckpt / DCP_DIR), read_dcp_tensors(back / DCP_DIR)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    sharded, whole = load_checkpoint(ckpt).state_dict(), load_checkpoint(full).state_dict()
    assert all(torch.equal(sharded[k], whole[k]) for k in whole)
