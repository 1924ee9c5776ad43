"""Supervised fine-tuning data: rows checked by line, the loss mask covers exactly the completion
/ assistant tokens, whole examples per batch row, and `finetune` on it end to end."""

from __future__ import annotations

import json
import math

import pytest
import torch

from llm_foundry.data import DataError
from llm_foundry.data.sft import IGNORE, SFTSampler, encode_row, prepare_sft, read_rows
from llm_foundry.tokenizer import CharTokenizer

TEXT = "ROMEO: what light? JULIET: ay me!\nUSER: ASSISTANT: SYSTEM: who speaks next\n" * 3
ROWS = [
    {"prompt": "ROMEO: what light", "completion": "? JULIET: ay me!"},
    {"messages": [
        {"role": "system", "content": "who speaks next"},
        {"role": "user", "content": "ROMEO: what light?"},
        {"role": "assistant", "content": "JULIET"},
    ]},
] * 6  # fmt: skip


@pytest.fixture
def sft_dir(tmp_path):
    tok = CharTokenizer.train(TEXT)
    tok.save(tmp_path / "tokenizer.json")
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    prepare_sft(tmp_path / "sft", tmp_path / "rows.jsonl", tmp_path / "tokenizer.json", 0.25)
    return tmp_path / "sft", tok


def test_the_mask_covers_the_completion_and_the_assistant_turns_only():
    tok = CharTokenizer.train(TEXT)
    ids, mask = encode_row(tok, ROWS[0])
    assert tok.decode(ids) == "ROMEO: what light? JULIET: ay me!"
    assert tok.decode([i for i, m in zip(ids, mask, strict=True) if m]) == "? JULIET: ay me!"
    ids, mask = encode_row(tok, ROWS[1])
    assert (
        tok.decode(ids) == "SYSTEM: who speaks next\nUSER: ROMEO: what light?\nASSISTANT: JULIET\n"
    )
    assert tok.decode([i for i, m in zip(ids, mask, strict=True) if m]) == "JULIET\n"


def test_batches_target_exactly_the_masked_tokens(sft_dir):
    data, tok = sft_dir
    meta = json.loads((data / "meta.json").read_text())
    assert meta["kind"] == "sft" and (meta["train_examples"], meta["val_examples"]) == (9, 3)
    sampler = SFTSampler(data, "train", block_size=80, batch_size=4, seed=0)  # no row is cut
    for _ in range(5):
        x, y = sampler.next()
        for row_x, row_y in zip(x.tolist(), y.tolist(), strict=True):
            counted = [t for t in row_y if t != IGNORE]
            text = tok.decode(counted)
            assert text in ("? JULIET: ay me!", "JULIET\n")  # nothing from prompts or padding
            # each target is the token that follows its position
            n = len(tok.encode(tok.decode([t for t in row_x if t])))
            for t in range(n - 1):
                assert row_y[t] in (IGNORE, row_x[t + 1])
    # a window too short for any completion token: such examples are not drawn at all
    short = SFTSampler(data, "train", block_size=20, batch_size=4, seed=0)
    assert short.cut == 9 and short.dropped == 4  # the 5 prompt/completion rows keep targets
    # (the chat rows' assistant turn starts past token 21)
    x, y = short.next()
    assert ((y != IGNORE).sum(1) > 0).all()


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"prompt": "a"}', "line 1: missing or non-string 'completion'"),
        ('{"prompt": "a", "completion": ""}', "line 1: 'completion' is empty"),
        ('{"messages": [{"role": "robot", "content": "x"}]}', "messages[0] needs a 'role'"),
        ('{"messages": [{"role": "user", "content": "x"}]}', "no non-empty assistant message"),
        ("[1, 2]", "line 1: a list, expected an object"),
        ("{oops", "line 1: not JSON"),
    ],
)
def test_bad_rows_are_named_by_line(tmp_path, line, message):
    (tmp_path / "rows.jsonl").write_text(line + "\n")
    with pytest.raises(DataError, match=message.replace("[", r"\[").replace("]", r"\]")):
        read_rows(tmp_path / "rows.jsonl")


@pytest.mark.heavy
def test_finetune_a_run_with_lora_on_sft_rows(char_data, tmp_path, capsys):
    from llm_foundry.cli import main

    base = tmp_path / "base"
    small = ["--model.n_layers", "1", "--model.dim", "32", "--model.n_heads", "2"]
    small += ["--model.max_seq_len", "96"]
    steps = ["--train.batch_size", "4", "--train.eval_batches", "2", "--train.sample_tokens", "0"]
    steps += ["--train.progress", "false", "--train.block_size", "32"]
    argv = ["train", "--data", str(char_data(60_000)), "--out", str(base), *small, *steps]
    assert main([*argv, "--train.max_steps", "20", "--train.eval_interval", "10"]) == 0
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert main(["prepare", "--sft", str(tmp_path / "rows.jsonl"), "--tokenizer-from", str(base),
                 "--out", str(tmp_path / "sft")]) == 0  # fmt: skip
    tuned = tmp_path / "tuned"
    argv = ["finetune", "--checkpoint", str(base), "--data", str(tmp_path / "sft")]
    argv += ["--out", str(tuned), "--train.lora_r", "4", "--train.lr", "1e-2", *steps]
    argv += ["--train.block_size", "80"]  # the longest row (67 tokens) whole
    assert main([*argv, "--train.max_steps", "30", "--train.eval_interval", "10"]) == 0
    records = [json.loads(x) for x in (tuned / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert losses[-1] < losses[0]  # it learns the completions
    info = json.loads((tuned / "run.json").read_text())
    assert info["train"]["init_from"].startswith(str(base)) and info["train"]["lora_r"] == 4
    assert "LoRA r=4 on wq,wv: 512 trainable parameters" in capsys.readouterr().out  # 2 x (A + B)
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(tuned), "--prompt", "ROMEO: what light",
                 "--max-new-tokens", "5", "--seed", "0"]) == 0  # fmt: skip
    assert capsys.readouterr().out.strip()
    # a chat turn in the built-in format; the reply ends at its line's end
    argv = ["generate", "--checkpoint", str(tuned), "--chat", "--prompt", "ROMEO: what light?"]
    assert main([*argv, "--max-new-tokens", "40", "--seed", "0", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["prompt"] == "USER: ROMEO: what light?\nASSISTANT: "
    assert "\n" not in rec["completion"]
    torch.manual_seed(0)


def test_demo_rows_come_from_both_play_formats():
    from llm_foundry.data.sft_demo import demo_rows, speeches

    tiny = "First Citizen:\nSpeak, speak.\nWe are resolved.\n\nAll:\nResolved.\n\n"
    plays = "HELENA.\nAnd you, monarch!\nAnd no.\n\nPAROLLES.\nNo.\n\n"
    assert speeches(tiny) == [("First Citizen", ["Speak, speak.", "We are resolved."]),
                              ("All", ["Resolved."])]  # fmt: skip
    assert speeches(plays)[1] == ("PAROLLES", ["No."])
    rows = demo_rows(tiny + plays, n=10, seed=0)
    assert {"prompt": "HELENA:\nAnd you, monarch!\n", "completion": "And no.\n"} in rows
    who = [r["messages"] for r in rows if "messages" in r]
    assert [{"role": "user", "content": "First Citizen: Speak, speak. Who speaks next?"},
            {"role": "assistant", "content": "All"}] in who  # fmt: skip
    for row in rows:  # every character comes from the corpus: a char tokenizer of it encodes them
        encode_row(CharTokenizer.train(tiny + plays + "USER: ASSISTANT: Who speaks next?"), row)


def test_init_from_refuses_another_architecture_but_allows_a_longer_context(char_data, tmp_path):
    from conftest import make_trainer

    from llm_foundry.config import ConfigError, ModelConfig
    from llm_foundry.train.config import TrainConfig
    from llm_foundry.train.state import latest_checkpoint
    from llm_foundry.train.trainer import Trainer

    data = char_data(60_000)
    make_trainer(data, tmp_path / "base", max_steps=4).run()
    base = str(latest_checkpoint(tmp_path / "base" / "checkpoints"))
    train = TrainConfig(batch_size=4, block_size=32, max_steps=2, sample_tokens=0, progress=False,
                        init_from=base)  # fmt: skip
    tiny = dict(vocab_size=65, dim=32, n_layers=2, n_heads=2, max_seq_len=32, dropout=0.1)
    with pytest.raises(ConfigError, match="dim: 32 there, 64 here"):
        Trainer(ModelConfig(**{**tiny, "dim": 64}), train, data, tmp_path / "wide")
    longer = Trainer(ModelConfig(**{**tiny, "max_seq_len": 128}), train, data, tmp_path / "long")
    longer.release()


def test_training_on_sft_rows_resumes_exactly(sft_dir, tmp_path):
    import shutil

    from conftest import make_trainer

    from llm_foundry.train.state import write_json_atomic

    data, _ = sft_dir

    def losses(run):
        recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in recs if "loss" in r]

    make_trainer(data, tmp_path / "full", max_steps=8).run()
    shutil.copytree(tmp_path / "full", tmp_path / "cut")
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "step_000008")
    write_json_atomic(
        tmp_path / "cut" / "checkpoints" / "latest.json", {"step": 4, "path": "step_000004"}
    )
    make_trainer(data, tmp_path / "cut", resume=True, max_steps=8).run()
    assert losses(tmp_path / "cut") == losses(tmp_path / "full")
    assert all(math.isfinite(x) for x in losses(tmp_path / "full"))  # every batch had targets


@pytest.mark.parametrize("pe", ["rope", "alibi", "none"])
def test_packed_examples_compute_what_they_compute_alone(sft_dir, pe, tiny_config):
    """Rows packed with whole examples, attention kept inside each: every example's logits and
    its summed loss equal those of the example run by itself (relative positions)."""
    from llm_foundry.models import Transformer

    data, tok = sft_dir
    torch.manual_seed(0)
    model = Transformer(tiny_config(vocab_size=tok.vocab_size, pos_encoding=pe, max_seq_len=96))
    model.eval()
    x, y, doc = SFTSampler(data, "train", block_size=90, batch_size=3, seed=0, pack=True).next()
    assert (doc[:, 1:] >= doc[:, :-1]).all() and (doc.max(1).values >= 1).all()  # >= 2 per row
    logits = model(x, doc=doc)[0]
    packed_sum = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE, reduction="sum"
    )
    alone_sum = torch.zeros(())
    for b in range(x.shape[0]):
        for k in doc[b].unique():
            where = (doc[b] == k).nonzero().flatten()
            s, e = int(where[0]), int(where[-1]) + 1
            alone = model(x[b : b + 1, s:e])[0][0]
            torch.testing.assert_close(alone, logits[b, s:e], atol=1e-4, rtol=1e-4)
            alone_sum += torch.nn.functional.cross_entropy(
                alone, y[b, s:e], ignore_index=IGNORE, reduction="sum"
            )
    torch.testing.assert_close(packed_sum, alone_sum, atol=1e-3, rtol=1e-5)
    # no position targets the first token of the next document
    boundary = (doc[:, 1:] != doc[:, :-1]).nonzero()
    assert all(y[b, t] == IGNORE for b, t in boundary.tolist())


def test_packing_is_refused_for_absolute_positions(sft_dir, tmp_path):
    from llm_foundry.config import ConfigError, ModelConfig
    from llm_foundry.train.config import TrainConfig
    from llm_foundry.train.trainer import Trainer

    data, tok = sft_dir
    model = ModelConfig(vocab_size=tok.vocab_size, dim=32, n_layers=1, n_heads=2,
                        max_seq_len=64, pos_encoding="learned")  # fmt: skip
    train = TrainConfig(batch_size=2, block_size=64, sft_packing=True, progress=False)
    with pytest.raises(ConfigError, match="pos_encoding='learned': packed documents"):
        Trainer(model, train, data, tmp_path / "run")


def test_training_with_packing_runs_and_resumes_exactly(sft_dir, tmp_path):
    import shutil

    from conftest import make_trainer

    from llm_foundry.train.state import write_json_atomic

    data, _ = sft_dir

    def losses(run):
        recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in recs if "loss" in r]

    make_trainer(data, tmp_path / "full", max_steps=8, sft_packing=True).run()
    shutil.copytree(tmp_path / "full", tmp_path / "cut")
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "step_000008")
    write_json_atomic(
        tmp_path / "cut" / "checkpoints" / "latest.json", {"step": 4, "path": "step_000004"}
    )
    make_trainer(data, tmp_path / "cut", resume=True, max_steps=8, sft_packing=True).run()
    assert losses(tmp_path / "cut") == losses(tmp_path / "full")
    assert all(math.isfinite(x) for x in losses(tmp_path / "full"))


def test_the_loss_is_the_mean_over_the_steps_target_tokens_whatever_the_micro_batches(
    sft_dir, tmp_path
):
    """Rows hold different numbers of completion tokens: 2 micro-batches of 2 rows weigh each
    by its share of the step's targets, so they train as one batch of 4 does (not as the mean
    of two per-batch means). The same weighting makes DDP ranks agree with one process
    (tests/test_distributed.py)."""
    from conftest import TINY

    from llm_foundry.config import ModelConfig
    from llm_foundry.train.config import TrainConfig
    from llm_foundry.train.trainer import Trainer

    data, _ = sft_dir
    # no dropout masks drawn per micro-batch shape; whole rows: 16 or 7 targets each
    model = ModelConfig(**{**TINY, "dropout": 0.0, "max_seq_len": 80})

    def losses(run, **train):
        cfg = dict(block_size=80, max_steps=6, eval_interval=3, eval_batches=2, warmup_steps=2,
                   sample_tokens=0, progress=False)  # fmt: skip
        Trainer(model, TrainConfig(**cfg, **train), data, tmp_path / run).run()
        recs = [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in recs if "loss" in r]

    whole, accum = losses("whole", batch_size=4), losses("accum", batch_size=2, grad_accum=2)
    assert max(abs(a - b) for a, b in zip(whole, accum, strict=True)) < 1e-5 * max(whole)
