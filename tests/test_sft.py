"""Supervised fine-tuning data: rows checked by line, the loss mask covers exactly the completion
/ assistant tokens, whole examples per batch row, and `finetune` on it end to end."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from conftest import cli_status

from llm_foundry.data import DataError
from llm_foundry.data.batches import IGNORE
from llm_foundry.data.sft import SFTSampler, encode_row, prepare_sft, read_rows
from llm_foundry.tokenizer import CharTokenizer, load_tokenizer

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
        # a DPO row: the command that takes it
        (
            '{"prompt": "a", "chosen": "b", "rejected": "c"}',
            "line 1: a preference row .* DPO takes the file as it is .*finetune --task dpo",
        ),
        ("{oops", "line 1: not JSON"),
        # both formats in one row: one of them would be dropped
        (
            '{"prompt": "a", "completion": "b", "messages": [{"role": "assistant", "content": "c"}]}',
            "line 1: has both 'messages' and 'prompt' and 'completion'",
        ),
        (
            '{"completion": "b", "messages": [{"role": "assistant", "content": "c"}]}',
            "line 1: has both 'messages' and 'completion'",
        ),
        # a key given twice: JSON readers keep one of the two silently
        (
            '{"prompt": "a", "completion": "b", "completion": "c"}',
            "line 1: the key 'completion' is given twice",
        ),
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


@pytest.mark.parametrize("context", [96, pytest.param(40, marks=pytest.mark.heavy)])
def test_a_fine_tune_given_no_block_size_takes_its_longest_example_within_the_context(
    sft_dir, tmp_path, capsys, context
):
    """Left out, train.block_size is the longest training example's length - 1 (the prepared
    offsets say it), never past the model's context; given, it is kept; on text it is the
    model's context."""
    from llm_foundry.checkpoint import save_checkpoint
    from llm_foundry.config import ModelConfig
    from llm_foundry.data import prepare
    from llm_foundry.models import Transformer

    data, tok = sft_dir
    cfg = ModelConfig(vocab_size=tok.vocab_size, dim=16, n_layers=1, n_heads=2, max_seq_len=context)
    base = save_checkpoint(Transformer(cfg), tmp_path / "base")
    tok.save(base / "tokenizer.json")
    lengths = [len(encode_row(tok, r)[0]) for r in ROWS[: int(len(ROWS) * 0.75)]]
    want = min(max(lengths) - 1, context)
    steps = ["--train.max_steps", "1", "--train.batch_size", "2", "--train.eval_interval", "1",
             "--train.eval_batches", "1", "--train.sample_tokens", "0", "--train.progress", "false"]  # fmt: skip

    def block(run, *flags, data=data):
        """(train.block_size the run used, what the command printed)"""
        from llm_foundry.cli import main

        argv = ["finetune", "--checkpoint", str(base), "--data", str(data), "--out", str(run)]
        capsys.readouterr()
        assert main([*argv, *steps, *flags]) == 0
        info = json.loads((run / "run.json").read_text())
        return info["train"]["block_size"], capsys.readouterr().out

    used, out = block(tmp_path / "a")
    assert used == want
    longest = f"the longest training sequence holds {max(lengths)} tokens"
    assert f"note: train.block_size {want} ({longest}" in out
    assert ("the model's context is 40" in out) == (context == 40)
    used, out = block(tmp_path / "b", "--train.block_size", "24")
    assert used == 24 and "note: train.block_size" not in out
    (tmp_path / "t.txt").write_text(TEXT * 20)
    prepare(tmp_path / "text", text_files=[tmp_path / "t.txt"], tokenizer="char", progress=False)
    assert block(tmp_path / "c", data=tmp_path / "text")[0] == context


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
    from llm_foundry.rundir import latest_checkpoint
    from llm_foundry.train.config import TrainConfig
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


# ----------------------------------------------------------------------------------------------
# Misuse: what a re-prepare leaves, what a running fine-tune sees, memory, odd bytes and flags


def _rows_file(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


# the same shape as ROWS (every example as long, so every file the same size), other letters
SWAPPED = [json.loads(json.dumps(r).replace("ROMEO", "JULIE")) for r in ROWS]


def test_an_interrupted_re_prepare_is_refused_by_fine_tuning_not_trained_on(sft_dir, monkeypatch):
    """The second prepare is cut short before it writes meta.json: the directory must not pass
    for the old data (meta.json beside new token files of the same sizes)."""
    import llm_foundry.data.sft as sft_module
    import llm_foundry.data.sources as sources

    data, tok = sft_dir
    rows = _rows_file(data.parent / "swapped.jsonl", SWAPPED)

    def cut(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(sources, "write_atomic", cut)
    monkeypatch.setattr(sft_module, "write_atomic", cut, raising=False)
    with pytest.raises(KeyboardInterrupt):
        prepare_sft(data, rows, data.parent / "tokenizer.json", 0.25, restart=True)
    monkeypatch.undo()
    with pytest.raises(DataError, match=r"meta.json is missing.*interrupted"):
        SFTSampler(data, "train", block_size=80, batch_size=2)
    assert not [p.name for p in data.iterdir() if p.name.endswith(".tmp")]  # no temporaries left


@pytest.mark.parametrize("name", ["train.bin", "train.mask.bin", "train.offsets.bin"])
def test_token_files_that_meta_json_does_not_record_are_refused(tmp_path, name):
    """A file of the right size from another prepare (interrupted, concurrent, copied in) is
    told apart from the one meta.json was written with."""
    import shutil

    tok = CharTokenizer.train(TEXT)
    tok.save(tmp_path / "tokenizer.json")
    # the same training examples in another order: every file as large, none the same
    for d, rows in (("a", ROWS), ("b", ROWS[1:9] + ROWS[:1] + ROWS[9:])):
        _rows_file(tmp_path / f"{d}.jsonl", rows)
        prepare_sft(tmp_path / d, tmp_path / f"{d}.jsonl", tmp_path / "tokenizer.json", 0.25)
    a, b = tmp_path / "a" / name, tmp_path / "b" / name
    assert a.stat().st_size == b.stat().st_size and a.read_bytes() != b.read_bytes()
    shutil.copyfile(b, a)
    with pytest.raises(DataError, match=rf"a/{name} is not the file .*meta.json records"):
        SFTSampler(tmp_path / "a", "train", block_size=80, batch_size=2)


def test_a_running_fine_tune_keeps_the_files_it_maps_whole(sft_dir):
    """This process maps the data (as a fine-tune does) and prepares the directory again: the
    new files are new inodes, so what it had mapped does not change under it."""
    data, tok = sft_dir
    old = SFTSampler(data, "train", block_size=80, batch_size=2)
    before = np.array(old.data), np.array(old.mask), np.array(old.offsets)
    rows = _rows_file(data.parent / "swapped.jsonl", SWAPPED)
    prepare_sft(data, rows, data.parent / "tokenizer.json", 0.25, restart=True)
    for was, now in zip(before, (old.data, old.mask, old.offsets), strict=True):
        np.testing.assert_array_equal(np.asarray(now), was)
    new = SFTSampler(data, "train", block_size=80, batch_size=2)
    assert "JULIE" in tok.decode(np.asarray(new.data)) and "ROMEO" in tok.decode(before[0])


FINE_TUNE_READER = """
import sys, time
from llm_foundry.data.sft import SFTSampler
sampler = SFTSampler(sys.argv[1], "train", block_size=80, batch_size=2)
print("reading", flush=True)
time.sleep(60)
"""


def test_prepare_is_refused_a_directory_a_fine_tune_is_reading_or_another_prepare_holds(
    sft_dir, tmp_path
):
    import subprocess
    import sys

    from llm_foundry import lock
    from llm_foundry.cli import main

    data, _ = sft_dir
    rows = _rows_file(tmp_path / "swapped.jsonl", SWAPPED)

    def files():  # a killed reader leaves its empty lock file, .readers
        return {p.name: p.read_bytes() for p in data.iterdir() if not p.name.startswith(".")}

    before = files()
    reader = subprocess.Popen(
        [sys.executable, "-c", FINE_TUNE_READER, str(data)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert reader.stdout.readline().strip() == "reading"
        with pytest.raises(lock.DirectoryBusy, match=rf"being read by process {reader.pid}"):
            prepare_sft(data, rows, tmp_path / "tokenizer.json", 0.25)
        argv = ["prepare", "--sft", str(rows), "--tokenizer-from", str(tmp_path / "tokenizer.json")]
        assert main([*argv, "--out", str(data)]) == 1
    finally:
        reader.kill()
        reader.wait()
    assert files() == before  # nothing was replaced
    # a writer holding the directory (another prepare) keeps this one out too
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from llm_foundry import lock; "
         "lock.acquire(sys.argv[1]); print('held', flush=True); time.sleep(60)", str(data)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(lock.DirectoryBusy, match=rf"in use by process {holder.pid}"):
            prepare_sft(data, rows, tmp_path / "tokenizer.json", 0.25)
    finally:
        holder.kill()
        holder.wait()
    assert files() == before


def test_prepare_never_writes_over_its_input(tmp_path):
    tok = CharTokenizer.train(TEXT)
    tok.save(tmp_path / "tokenizer.json")
    out = tmp_path / "sft"
    out.mkdir()
    rows = _rows_file(out / "val.bin", ROWS)  # rows under the name of an output
    with pytest.raises(
        DataError, match=r"rows file .*val.bin is val.bin, one of the files written"
    ):
        prepare_sft(out, rows, tmp_path / "tokenizer.json", 0.25)
    assert read_rows(rows) == ROWS and sorted(p.name for p in out.iterdir()) == ["val.bin"]
    # the model's tokenizer may be the one already in the directory: it is kept as it is
    meta = prepare_sft(
        tmp_path, _rows_file(tmp_path / "r.jsonl", ROWS), tmp_path / "tokenizer.json"
    )
    assert meta["train_examples"] + meta["val_examples"] == len(ROWS)
    assert (
        CharTokenizer.train(TEXT).chars
        == json.loads((tmp_path / "tokenizer.json").read_text())["chars"]
    )


MEASURE = """
import os, sys
from llm_foundry.data.sft import prepare_sft
meta = prepare_sft(sys.argv[1], sys.argv[2], sys.argv[3])
print(meta["train_examples"] + meta["val_examples"], meta["train_tokens"] + meta["val_tokens"])
"""


def _peak_rss(tmp_path, rows, name):
    """(peak resident memory in bytes, output lines) of a fresh process preparing ``rows``."""
    import os
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-c", MEASURE, str(tmp_path / f"out-{name}"), str(rows),
         str(tmp_path / "tokenizer.json")],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    assert status == 0, out
    return usage.ru_maxrss * 1024, out.split()  # ru_maxrss is in KiB on Linux


def test_prepare_sft_streams_in_flat_memory(tmp_path):
    """A 24 MB JSONL: the peak memory of a process preparing it is that of one preparing a few
    rows, within a fraction of the file's size (reading it whole, with its tokens as Python
    lists, took about 26x the file)."""
    import random

    alphabet = "abcdefghij klmnopqrst uvwxyz,.!?\n"
    CharTokenizer.train(alphabet + "USERASSISTANT: ").save(tmp_path / "tokenizer.json")
    rng = random.Random(0)
    pool = "".join(rng.choice(alphabet) for _ in range(10_000))
    lines, n_bytes, n_tokens = [], 0, 0
    while n_bytes < 24_000_000:
        i = rng.randrange(9_000)
        p, c = pool[i : i + 200], pool[i + 300 : i + 500]
        if len(lines) % 2:
            row = {"prompt": p, "completion": c}
            n_tokens += len(p) + len(c)
        else:
            row = {
                "messages": [{"role": "user", "content": p}, {"role": "assistant", "content": c}]
            }
            n_tokens += len("USER: ") + len(p) + 1 + len("ASSISTANT: ") + len(c) + 1
        lines.append(json.dumps(row) + "\n")
        n_bytes += len(lines[-1])
    big = tmp_path / "big.jsonl"
    big.write_text("".join(lines))
    small = tmp_path / "small.jsonl"
    small.write_text("".join(lines[:10]))
    base, _ = _peak_rss(tmp_path, small, "small")
    peak, counts = _peak_rss(tmp_path, big, "big")
    assert counts == [str(len(lines)), str(n_tokens)]  # every row, every token
    size = big.stat().st_size
    assert peak - base < 0.25 * size, (
        f"peak {peak / 2**20:.0f} MiB, {base / 2**20:.0f} MiB for 10 rows, file {size / 2**20:.0f} MiB"
    )


def test_rows_with_unicode_line_separators_in_their_strings_are_read(tmp_path):
    """U+2028, U+2029 and U+0085 are text inside a JSON string; only \\n ends a JSONL line."""
    text = "who\u2028speaks\u0085next\u2029?"
    rows = [{"prompt": text, "completion": "JULIET\u2028"}, {"messages": [
        {"role": "user", "content": text}, {"role": "assistant", "content": "ROMEO\x85"}]}]  # fmt: skip
    path = _rows_file(tmp_path / "rows.jsonl", rows)
    assert "\u2028" in path.read_text(encoding="utf-8")  # written raw, not escaped
    assert read_rows(path) == rows
    tok = CharTokenizer.train(TEXT + text + "JULIETROMEO\x85\u2028")
    tok.save(tmp_path / "tokenizer.json")
    meta = prepare_sft(tmp_path / "sft", path, tmp_path / "tokenizer.json", 0.5)
    assert meta["train_examples"] == meta["val_examples"] == 1
    val = SFTSampler(tmp_path / "sft", "val", block_size=80, batch_size=1)
    assert tok.decode(np.asarray(val.data)) == f"USER: {text}\nASSISTANT: ROMEO\x85\n"


def test_the_local_tasks_read_their_rows_with_line_separators_in_strings(tmp_path):
    from llm_foundry.tasks import data as task_data

    rows = [{"context": "a\u2028b", "speaker": "c\x85"}, {"context": "d", "speaker": "e"}]
    _rows_file(tmp_path / "t.jsonl", rows)
    assert task_data.rows(tmp_path / "t.jsonl") == rows


def test_bytes_that_are_not_utf8_are_named_by_file_and_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(
        b'{"prompt": "a", "completion": "b"}\n{"prompt": "caf\xe9", "completion": "b"}\n'
    )
    with pytest.raises(
        DataError, match=r"rows.jsonl, line 2: not UTF-8 \(byte 0xe9 at column 16\)"
    ):
        read_rows(path)


def test_ctrl_c_during_prepare_sft_is_one_line_and_exit_130(sft_dir, monkeypatch, capsys):
    import llm_foundry.data.sft as sft_module

    data, tok = sft_dir
    before = SFTSampler(data, "train", block_size=80, batch_size=2)
    old = np.array(before.data)
    del before
    rows = _rows_file(data.parent / "swapped.jsonl", SWAPPED)
    calls = []

    def ctrl_c(tokenizer, row):
        calls.append(row)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return sft_module.encode_row.__wrapped__(tokenizer, row)

    ctrl_c.__wrapped__ = sft_module.encode_row
    monkeypatch.setattr(sft_module, "encode_row", ctrl_c)
    argv = ["prepare", "--sft", str(rows), "--tokenizer-from", str(data.parent / "tokenizer.json")]
    rc, err = cli_status([*argv, "--out", str(data), "--restart"], capsys)
    assert rc == 130
    assert err.count("\n") == 1 and err.startswith("llm-foundry prepare: stopped by SIGINT: ")
    # cut short while encoding: the old data is still there, whole and checked
    assert "is complete" in err
    np.testing.assert_array_equal(SFTSampler(data, "train", block_size=80, batch_size=2).data, old)
    assert not [p.name for p in data.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--rows", "-5"], "--rows -5: must be at least 2"),
        (["--rows", "1"], "--rows 1: must be at least 2"),
        (["--val-fraction", "1.5"], "--val-fraction 1.5: must be strictly between 0 and 1"),
        (["--val-fraction", "0"], "--val-fraction 0.0: must be strictly between 0 and 1"),
        (["--vocab-size", "512"], "--vocab-size does not apply to --sft"),
        (["--tokenizer", "bpe"], "--tokenizer does not apply to --sft"),
    ],
)
def test_out_of_range_demo_flags_are_one_line(tmp_path, capsys, flags, message):
    (tmp_path / "play.txt").write_text(
        "ROMEO:\nWhat light?\nIt is the east.\n\nJULIET:\nAy me!\nO Romeo.\n\n" * 4
    )
    CharTokenizer.train(TEXT + "WhatlighIseayO.?!\nwk").save(tmp_path / "tokenizer.json")
    argv = ["prepare", "--text", str(tmp_path / "play.txt"), "--sft-demo", "--tokenizer-from"]
    argv += [str(tmp_path / "tokenizer.json"), "--out", str(tmp_path / "out"), *flags]
    rc, err = cli_status(argv, capsys)
    assert rc == 2 and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "out").exists()


def test_prepare_sft_again_is_nothing_to_do_or_refused_as_text_prepares_are(sft_dir, capsys):
    """The same rows and settings again: nothing to do. Other rows or settings, or a directory
    that holds a text corpus (--sft or --sft-demo): refused, naming what differs and --restart,
    nothing written. A training run's directory: refused."""
    data, _ = sft_dir
    root, tok = data.parent, str(data.parent / "tokenizer.json")
    stamps = lambda d: {p.name: p.stat().st_mtime_ns for p in d.iterdir()}  # noqa: E731
    before = stamps(data)
    argv = ["prepare", "--sft", str(root / "rows.jsonl"), "--tokenizer-from", tok, "--out",
            str(data), "--val-fraction", "0.25"]  # fmt: skip
    assert cli_status(argv, capsys) == (0, "")
    assert stamps(data) == before
    swapped = _rows_file(root / "swapped.jsonl", SWAPPED)
    rc, err = cli_status([*argv[:2], str(swapped), *argv[3:]], capsys)
    assert rc == 2 and "is already prepared from other rows or settings (the rows' sha256: " in err
    assert err.endswith("add --restart to prepare it again from scratch, or write to another "
                        "--out\n")  # fmt: skip
    rc, err = cli_status([*argv[:-1], "0.5"], capsys)
    assert rc == 2 and "(settings.val_fraction: 0.25 then, 0.5 now)" in err
    assert stamps(data) == before
    assert cli_status([*argv[:2], str(swapped), *argv[3:], "--restart"], capsys)[0] == 0
    assert "JULIE" in load_tokenizer(data / "tokenizer.json").decode(
        np.asarray(SFTSampler(data, "train", block_size=80, batch_size=2).data)
    )

    # a text corpus there: neither --sft nor --sft-demo writes into it
    (root / "play.txt").write_text("ROMEO:\nWhat light?\n\nJULIET:\nAy me!\n\n" * 20)
    text = root / "text"
    assert cli_status(["prepare", "--text", str(root / "play.txt"), "--out", str(text)],
                      capsys)[0] == 0  # fmt: skip
    before = stamps(text)
    for flags in (["--sft", str(root / "rows.jsonl")], ["--text", str(root / "play.txt"),
                                                       "--sft-demo"]):  # fmt: skip
        rc, err = cli_status(["prepare", *flags, "--tokenizer-from", tok, "--out", str(text)],
                             capsys)  # fmt: skip
        assert rc == 2 and f"{text} already holds " in err and "--restart" in err, err
        assert stamps(text) == before  # no rows.jsonl, nothing replaced
    run = root / "run"
    (run / "checkpoints").mkdir(parents=True)
    rc, err = cli_status([*argv[:-3], str(run)], capsys)
    assert rc == 2 and "is a training run's directory (run.json, checkpoints/)" in err
    assert list(run.iterdir()) == [run / "checkpoints"]


def test_text_rows_are_tokenized_as_trl_tokenizes_them():
    """A prompt/completion row with a Llama 2 style tokenizer (it puts <s> first and a space
    before every text it encodes): prompt + completion encoded whole, as transformers' tokenizer
    (and so TRL) encodes it, the completion from where the prompt's ids part; its first target
    the completion's first word, not a lone space."""
    transformers = pytest.importorskip("transformers")
    from test_serve_pieces import _llama2_file

    from llm_foundry.data.sft import encode_row, prompt_completion

    tok = _llama2_file()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.hf)
    prompt, completion = "héllo wörld,", " naïve café"
    whole, alone = hf(prompt + completion).input_ids, hf(prompt).input_ids
    n = next(i for i, (a, b) in enumerate(zip(alone + [-1], whole, strict=False)) if a != b)
    ids, mask = encode_row(tok, {"prompt": prompt, "completion": completion})
    assert ids == whole + [tok.eos_id] and ids[0] == 1  # <s> first, </s> last
    assert mask == [0] * n + [1] * (len(whole) - n + 1)
    assert hf.convert_ids_to_tokens(ids[n]) == "▁naïve"
    pair = prompt_completion(tok, prompt, [completion, " café naïve"])
    assert pair[0] == (ids, mask) and pair[1][0][:n] == ids[:n]  # one prompt for both


def test_chat_rows_for_a_tokenizer_without_a_template_say_how_to_give_one(tmp_path):
    """Most base models have no chat template: chat rows are refused saying what to add (a
    chat_template.jinja beside tokenizer.json, which then prepares them) or to write text rows."""
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=None))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["hello there, how are you? fine, thanks."] * 20, trainer)
    (base := tmp_path / "base").mkdir()
    tok.save(str(base / "tokenizer.json"))
    rows = tmp_path / "rows.jsonl"
    chat = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "fine"}]
    rows.write_text("".join(json.dumps({"messages": chat}) + "\n" for _ in range(4)))
    with pytest.raises(DataError) as e:
        prepare_sft(tmp_path / "sft", rows, base / "tokenizer.json", 0.25)
    assert str(e.value) == (
        f"{base} has no chat template (tokenizer_config.json chat_template or chat_template.jinja)"
        " to render the chat rows with: add the model's chat template as chat_template.jinja "
        "beside tokenizer.json (serve and generate --chat use it too), or write the rows as "
        "prompt/completion text"
    )
    (base / "chat_template.jinja").write_text(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    )
    meta = prepare_sft(tmp_path / "sft", rows, base / "tokenizer.json", 0.25)
    assert meta["train_examples"] + meta["val_examples"] == 4
