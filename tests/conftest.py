"""Shared fixtures: the tiny model most unit tests build, the shared data beside the repository,
small character-level corpora prepared once per test session; a check that greedy tokens
compared across two float32 code paths cannot hinge on rounding.

Tests marked ``heavy`` (torchrun launches, documented commands run end to end, long training
runs) are part of ``make test``; ``make test-fast`` leaves them out.

Tests marked ``cuda`` (tests/test_cuda.py, ``make test-gpu``) run on the device the ``device``
fixture gives: CUDA by default, and where torch sees no GPU they are skipped, with the reason.
``--device cpu`` (or ``LLM_FOUNDRY_TEST_DEVICE=cpu``) runs the very same tests on the CPU, to
check their logic without a GPU; ``--device cuda:N`` picks a GPU. A device named explicitly that
this machine lacks is an error, not a skip."""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path

import pytest
import torch

from llm_foundry.config import ModelConfig
from llm_foundry.data import prepare
from llm_foundry.train.config import TrainConfig
from llm_foundry.train.trainer import Trainer

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
SHAKESPEARE = SHARED_DATA / "tinyshakespeare.txt"
TINY = dict(vocab_size=65, dim=32, n_layers=2, n_heads=2, max_seq_len=32, dropout=0.1)
TINY_MODEL = dict(vocab_size=37, dim=32, n_layers=2, n_heads=4, max_seq_len=64)

# A suite started as a background job of a non-interactive shell (`make test &`) inherits SIGINT
# ignored, and so would every command it runs: the Ctrl-C tests need it answered as a terminal's.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

DEVICE_ENV = "LLM_FOUNDRY_TEST_DEVICE"
_DEVICE = pytest.StashKey[tuple]()  # (the `cuda` tests' device, why they are skipped or None)


def pytest_addoption(parser):
    parser.addoption(
        "--device",
        default=None,
        metavar="DEVICE",
        help="where the `cuda` tests (tests/test_cuda.py) run: cuda (the default: skipped, with "
        "the reason, without a GPU), cuda:N, or cpu (the same tests on the CPU, to check their "
        f"logic); also ${DEVICE_ENV}. A device named here that is missing is an error",
    )


def _test_device(config) -> tuple[torch.device, str | None]:
    """(the device the ``cuda`` tests run on, why they are skipped: None when they run)."""
    given = config.getoption("--device") or os.environ.get(DEVICE_ENV)
    where = "--device" if config.getoption("--device") else DEVICE_ENV
    try:
        device = torch.device(given or "cuda")
    except (RuntimeError, TypeError, ValueError):
        device = None
    if device is None or device.type not in ("cuda", "cpu"):
        raise pytest.UsageError(f"{where} {given!r}: the `cuda` tests run on cuda, cuda:N or cpu")
    why = None
    if device.type == "cuda" and not torch.cuda.is_available():
        why = (f"needs a CUDA GPU: torch {torch.__version__} sees none (torch.cuda.is_available() "
               f"is False); {DEVICE_ENV}=cpu runs these tests on the CPU")  # fmt: skip
    elif device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        why = f"{device}: this machine has CUDA devices 0..{torch.cuda.device_count() - 1}"
    if why and given:  # asked for by name: a missing device is a mistake, not a skip
        raise pytest.UsageError(f"{where} {given}: {why}")
    return device, why


def pytest_configure(config):
    device, why = _test_device(config)
    config.stash[_DEVICE] = device, why
    if device.type == "cuda" and why is None:
        # cuBLAS is deterministic on one stream only with a fixed workspace (read once, at its
        # first use): the bit-for-bit resume test runs with deterministic algorithms
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def pytest_collection_modifyitems(config, items):
    _, why = config.stash[_DEVICE]
    if why is not None:
        skip = pytest.mark.skip(reason=why)
        for item in items:
            if item.get_closest_marker("cuda"):
                item.add_marker(skip)


@pytest.fixture(scope="session")
def device(pytestconfig) -> torch.device:
    """The device the ``cuda`` tests run on (see the module's docstring); CUDA by default."""
    device, why = pytestconfig.stash[_DEVICE]
    if why is not None:  # a test that asks for the device without the marker
        pytest.skip(why)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    return device


@pytest.fixture
def notes():
    """The messages logged on the ``llm_foundry`` logger while the test runs (the command line
    prints them; a command run in-process earlier may have stopped their propagation)."""
    got: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            got.append(record.getMessage())

    log, keep = logging.getLogger("llm_foundry"), Keep()
    level = log.level
    log.addHandler(keep)
    log.setLevel(logging.INFO)
    yield got
    log.removeHandler(keep)
    log.setLevel(level)


@pytest.fixture
def tiny_config():
    """``tiny_config(**fields)`` -> the small ModelConfig unit tests build (37 token ids, 2
    layers of width 32, 4 heads, 64 positions) with ``fields`` changed."""
    return lambda **fields: ModelConfig(**{**TINY_MODEL, **fields})


@pytest.fixture
def shared_data() -> Path:
    """``../shared/data`` beside the repository (tiny Shakespeare); the test is skipped, with
    the reason, where a checkout has no such directory."""
    if not SHAKESPEARE.is_file():
        pytest.skip(f"{SHAKESPEARE} not found: the shared test data lives beside the repository")
    return SHARED_DATA


def make_trainer(data_dir: Path, out: Path, resume: bool = False, model: dict | None = None,
                 **train) -> Trainer:  # fmt: skip
    """An in-process trainer of the TINY model (``model``: fields changed): 12 steps of 4 x 32,
    eval and save every 4."""
    cfg = dict(
        batch_size=4,
        block_size=32,
        max_steps=12,
        eval_interval=4,
        eval_batches=2,
        warmup_steps=2,
        checkpoint_interval=4,
        sample_tokens=0,
        progress=False,
    )
    cfg.update(train)
    mc = ModelConfig(**{**TINY, **(model or {})})
    return Trainer(mc, TrainConfig(**cfg), data_dir, out, resume=resume)


# Two float32 paths to the same logits (KV cache vs recompute, batched vs alone, compiled vs
# eager, ours vs transformers) sum in other orders, on other CPUs with other SIMD kernels: they
# differ by up to ~n * eps32 * |logits| for reductions of length n <= ~100 here, ~1e-5 relative
# (measured: <= 1e-6). A greedy choice whose top two logits are closer than that could go either
# way, so a token-for-token comparison would pass on one machine and fail on another.
DECISIVE_REL = 1e-5


def assert_decisive(logits: torch.Tensor, what: str = "") -> None:
    """Every greedy choice read from ``logits`` (..., vocab), the reference path's logits at each
    decision, wins by more than DECISIVE_REL * (1 + max |logit|): then two paths that agree to
    rounding pick the same tokens on any CPU, and a seed whose continuation hinges on rounding
    fails here, on every machine, instead of as a token mismatch on some."""
    top = logits.detach().float().topk(2, dim=-1).values
    gap = (top[..., 0] - top[..., 1]).min().item()
    tol = DECISIVE_REL * (1 + logits.detach().abs().max().item())
    assert gap > tol, f"{what}: a greedy choice is won by {gap:.1e} <= {tol:.1e}, within rounding"


def corpus_text(n_chars: int) -> str:
    """The first ``n_chars`` of tiny Shakespeare when the shared copy is there, else filler."""
    if SHAKESPEARE.exists():
        return SHAKESPEARE.read_text()[:n_chars]
    # every letter in both cases, so the docs' prompts ("ROMEO: ...") encode
    line = (
        "ROMEO: But soft, what light through yonder window breaks? {}\n"
        "JULIET: The quick brown fox jumps over the lazy dog; to be, or not to be!\n"
        + "THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG.\n"
    )
    return "".join(line.format(i) for i in range(n_chars // len(line) + 1))[:n_chars]


@pytest.fixture(scope="session")
def char_data(tmp_path_factory):
    """``char_data(n_chars)`` -> a prepared directory (train.bin, val.bin, tokenizer, meta)."""
    made: dict[int, Path] = {}

    def make(n_chars: int) -> Path:
        if n_chars not in made:
            root = tmp_path_factory.mktemp(f"char{n_chars}")
            (root / "corpus.txt").write_text(corpus_text(n_chars))
            prepare(
                root / "char", text_files=[root / "corpus.txt"], tokenizer="char", progress=False
            )
            made[n_chars] = root / "char"
        return made[n_chars]

    return make


def cli_status(argv: list[str], capsys) -> tuple[int | str, str]:
    """(exit status, stderr) of ``llm-foundry ARGV`` run in this process; a KeyboardInterrupt
    that gets out of the command is reported as such, not passed on to end the test session."""
    from llm_foundry.cli import main

    capsys.readouterr()
    try:
        rc = main(argv)
    except KeyboardInterrupt:
        rc = "KeyboardInterrupt escaped"
    return rc, capsys.readouterr().err


# the small HF Llama tests compare against (transformers' own model, random weights)
TINY_HF_LLAMA = dict(vocab_size=61, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip


def reversal_sft(root: Path, rows: int, val_fraction: float) -> Path:
    """Prepared prompt/completion rows (ROOT/data): a prompt of 2-7 letters then '=', its
    reversal cut to 1-7 characters; rows hold different numbers of target tokens, so means over
    micro-batches or ranks must be weighed by them."""
    import random

    from llm_foundry.data.sft import prepare_sft
    from llm_foundry.tokenizer import CharTokenizer

    rng = random.Random(0)
    letters = "abcdefghij"
    lines = []
    for _ in range(rows):
        prompt = "".join(rng.choice(letters) for _ in range(rng.randint(2, 7)))
        row = {"prompt": prompt + "=", "completion": prompt[::-1][: rng.randint(1, 7)]}
        lines.append(json.dumps(row) + "\n")
    CharTokenizer.train(letters + "=").save(root / "tokenizer.json")
    (root / "rows.jsonl").write_text("".join(lines))
    prepare_sft(root / "data", root / "rows.jsonl", root / "tokenizer.json", val_fraction)
    return root / "data"


def tiny_hf_llama(seed: int = 0, **fields):
    """A random ``transformers.LlamaForCausalLM`` (eval mode) of TINY_HF_LLAMA with ``fields``
    changed, its weights drawn after ``torch.manual_seed(seed)``; the test is skipped without
    transformers."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**{**TINY_HF_LLAMA, **fields})
    return transformers.LlamaForCausalLM(config).eval()
