"""The pretrain-124m recipes (``src/llm_foundry/configs/``): at their own sizes they are GPT-2
small and its LLaMA-style twin, counted by transformers; shrunk, they run the README's chain on
a generated parquet corpus through the command line: prepare --input into several shards, train
with --config NAME, resume, generate."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import cli_status

from llm_foundry.accounting import param_report
from llm_foundry.cli import main
from llm_foundry.presets import get_preset
from llm_foundry.rundir import METRICS, read_records, read_run_info
from llm_foundry.settings import config_names, resolve

RECIPES = ("pretrain-124m-gpt2", "pretrain-124m-llama")
# GPT-2 small with its vocabulary padded to 50,304 (nanoGPT's train_gpt2: 124.48M)
GPT2_PADDED = 124_475_904
# what each recipe must keep when the test shrinks it: the architecture, not the sizes
ARCHITECTURE = ("pos_encoding", "norm", "norm_position", "mlp", "gelu_approx", "attn_bias",
                "mlp_bias", "tie_embeddings", "max_seq_len", "n_kv_heads")  # fmt: skip
SHRINK = ["--model.n_layers", "2", "--model.dim", "64", "--model.n_heads", "4",
          "--model.hidden_dim", "172", "--model.vocab_size", "512",
          "--train.block_size", "64", "--train.batch_size", "4", "--train.grad_accum", "1",
          "--train.max_steps", "10", "--train.warmup_steps", "2", "--train.eval_interval", "5",
          "--train.eval_batches", "2", "--train.checkpoint_interval", "5",
          "--train.compile", "false", "--train.device", "cpu", "--train.dtype", "fp32",
          "--train.progress", "false", "--train.sample_tokens", "0"]  # fmt: skip
WORDS = ("the river the mountain a lantern the old sailor a quiet village the northern road "
         "a letter the harbour the tall tower a grey horse the market").split(" ")  # fmt: skip
VERBS = ("sees", "remembers", "follows", "carries", "leaves", "finds", "passes")


def _cli(capsys, *argv: str) -> str:
    """The stdout of ``llm-foundry ARGV`` run in this process, which must succeed."""
    capsys.readouterr()
    assert main(list(argv)) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def hf_model(name: str):
    """transformers' own model of each recipe's size, on the meta device (no memory)."""
    t = pytest.importorskip("transformers")
    if name == "pretrain-124m-gpt2":
        config = t.GPT2Config(vocab_size=50304, n_positions=1024, n_embd=768, n_layer=12,
                              n_head=12)  # fmt: skip
    else:
        config = t.LlamaConfig(vocab_size=50304, hidden_size=768, intermediate_size=2048,
                               num_hidden_layers=12, num_attention_heads=12,
                               num_key_value_heads=12, max_position_embeddings=1024,
                               tie_word_embeddings=True)  # fmt: skip
    with torch.device("meta"):
        return t.AutoModelForCausalLM.from_config(config)


def test_the_recipes_ship_by_name():
    assert set(RECIPES) <= set(config_names())


@pytest.mark.parametrize("name", RECIPES)
def test_each_recipe_is_124m_as_transformers_counts_it(name):
    """As `train --config NAME` resolves it (over the default preset, which a file describing a
    model replaces: none of its fields, such as 2 KV heads, leak in) and `params` counts it."""
    from llm_foundry.cli.train import DEFAULT_PRESET

    settings = resolve(files=[name], default_preset=DEFAULT_PRESET)
    assert settings.model == resolve(files=[name]).model
    model, train = settings.model, settings.train
    hf_total = sum(p.numel() for p in hf_model(name).parameters())  # tied: counted once
    assert param_report(model)["total"] == hf_total
    if name == "pretrain-124m-gpt2":  # the gpt2 preset itself, its vocabulary padded
        assert model == get_preset("gpt2", vocab_size=50304)
        assert hf_total == GPT2_PADDED
    else:  # the LLaMA style at the same size: 0.9M fewer (no positions, biases or norm biases)
        assert hf_total == 123_587_328
    # block 1024 and GPT-3's 0.5M-token step on one GPU
    assert train.block_size == model.max_seq_len == 1024
    assert train.batch_size * train.grad_accum * train.block_size == 2**19


def test_a_config_name_not_shipped_is_one_line_naming_the_valid_ones(capsys):
    rc, err = cli_status(["params", "--config", "pretrain-124m-gtp2"], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "--config pretrain-124m-gtp2: no such file" in err
    assert all(name in err for name in RECIPES)


def write_corpus(root, files: int = 3, documents: int = 1200) -> str:
    """``files`` parquet files of generated documents (a title, then 2-6 sentences); the glob."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rng = random.Random(0)
    docs = []
    for i in range(documents):
        sentences = [
            f"{rng.choice(WORDS).capitalize()} {rng.choice(VERBS)} {rng.choice(WORDS)}."
            for _ in range(rng.randint(2, 6))
        ]
        docs.append(f"Story {i}\n" + " ".join(sentences) + "\n")
    root.mkdir()
    for k in range(files):
        part = docs[k::files]
        table = pa.table({"id": list(range(len(part))), "text": part})
        pq.write_table(table, root / f"part-{k:05d}.parquet")
    return str(root / "*.parquet")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The generated corpus prepared as the README prepares FineWeb-edu, at small sizes."""
    root = tmp_path_factory.mktemp("recipes")
    data = root / "data"
    status = main(["prepare", "--input", write_corpus(root / "parquet"), "--text-column", "text",
                   "--workers", "2", "--vocab-size", "512", "--shard-tokens", "5000",
                   "--out", str(data)])  # fmt: skip
    assert status == 0
    assert len(json.loads((data / "meta.json").read_text())["shards"]["train"]) >= 3
    return data


@pytest.mark.heavy
@pytest.mark.parametrize("name", RECIPES)
def test_the_recipe_trains_resumes_and_generates(name, corpus, tmp_path, capsys):
    run = tmp_path / "run"
    _cli(capsys, "train", "--config", name, "--data", str(corpus), "--out", str(run), *SHRINK)
    losses = [r["loss"] for r in read_records(run / METRICS) if "loss" in r]
    assert len(losses) == 10 and all(map(torch.isfinite, torch.tensor(losses)))
    val = [r["val_loss"] for r in read_records(run / METRICS) if "val_loss" in r]
    assert val[-1] < losses[0] - 0.3  # learning at the recipe's lr (measured: 0.5 nat lower)

    # the run recorded the recipe's architecture and training settings, with the overrides
    recipe, info = resolve(files=[name]), read_run_info(run)
    for field in ARCHITECTURE:
        assert info["model"][field] == getattr(recipe.model, field), field
    assert info["model"]["dim"] == 64 and info["model"]["vocab_size"] == 512
    assert info["train"]["block_size"] == 64
    for field in ("lr", "min_lr", "beta2", "weight_decay", "schedule", "parallel"):
        assert info["train"][field] == getattr(recipe.train, field), field

    # resume as the README says: the run directory alone, training on past its first end
    _cli(capsys, "train", "--out", str(run), "--resume", "--train.max_steps", "12")
    assert [r["step"] for r in read_records(run / METRICS) if "loss" in r][-2:] == [11, 12]

    text = _cli(capsys, "generate", "--checkpoint", str(run), "--prompt", "Story 7\nThe",
                "--max-new-tokens", "24", "--seed", "0")  # fmt: skip
    assert text.startswith("Story 7\nThe") and len(text) > len("Story 7\nThe") + 10, text
