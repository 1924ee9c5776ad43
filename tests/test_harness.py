"""The lm-eval wrapper: on the same weights it gives what the harness's own ``hf`` backend gives
(every request, every metric), its rolling log-likelihood is ``llm-foundry eval``'s, and the
local tasks are what their builder makes from the corpus."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from llm_foundry.checkpoint import save_checkpoint
from llm_foundry.cli import main
from llm_foundry.models import Transformer
from llm_foundry.package import install_line
from llm_foundry.presets import get_preset
from llm_foundry.tokenizer import BPETokenizer, CharTokenizer

lm_eval = pytest.importorskip("lm_eval")
harness = pytest.importorskip("llm_foundry.harness")

from conftest import assert_decisive, corpus_text  # noqa: E402

from llm_foundry.tasks import TASKS_DIR  # noqa: E402

LOCAL = ["shakespeare_next_line", "shakespeare_passages", "shakespeare_next_speaker"]


def _checkpoint(path, tok, seed=0, **model):
    torch.manual_seed(seed)
    cfg = get_preset(
        "llama-shakespeare-char",
        vocab_size=tok.vocab_size,
        **{"n_layers": 2, "dim": 64, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 128, **model},
    )
    save_checkpoint(Transformer(cfg), path)
    tok.save(path / "tokenizer.json")
    return path


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A random Llama exported to an HF directory with our BPE tokenizer (AutoTokenizer reads
    its special tokens from the tokenizer_config.json the export writes)."""
    from llm_foundry.export import convert_to_hf

    root = tmp_path_factory.mktemp("harness")
    tok = BPETokenizer.train(corpus_text(100_000), 400)
    return convert_to_hf(_checkpoint(root / "ours", tok), root / "hf")


def _run(model, args, limit, batch_size):
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(TASKS_DIR))
    return lm_eval.simple_evaluate(
        model=model,
        model_args=args,
        tasks=LOCAL,
        task_manager=manager,
        limit=limit,
        batch_size=batch_size,
        device="cpu",
        log_samples=True,
    )


@pytest.mark.heavy
def test_every_request_and_metric_equals_the_harness_hf_backend(hf_dir):
    ours = _run("llm-foundry", f"checkpoint={hf_dir}", 8, 5)
    theirs = _run("hf", f"pretrained={hf_dir},dtype=float32", 8, 3)
    for task in LOCAL:
        mine, ref = ours["samples"][task], theirs["samples"][task]
        assert len(mine) == len(ref) == 8
        for a, b in zip(mine, ref, strict=True):
            assert a["arguments"] == b["arguments"]  # the same requests
            if task == "shakespeare_next_speaker":
                assert a["resps"] == b["resps"]  # the same greedy text
                continue
            # multiple choice: (log p, greedy?) per choice; rolling: log p of the passage
            for got, want in zip(a["resps"], b["resps"], strict=True):
                got, want = got[0], want[0]
                if isinstance(want, float):
                    got, want = (got, None), (want, None)
                assert got[0] == pytest.approx(want[0], rel=1e-5, abs=1e-4)
                assert got[1] == want[1]
            if task == "shakespeare_next_line":  # acc and acc_norm compare choices: no near-tie
                lls = [r[0][0] for r in a["resps"]]
                lengths = [len(c.encode()) for c in a["doc"]["choices"]]
                for scores in (lls, [ll / n for ll, n in zip(lls, lengths, strict=True)]):
                    best, second = sorted(scores)[-2:][::-1]
                    assert best - second > 1e-3, "a choice won within rounding"
        for metric, value in theirs["results"][task].items():
            if isinstance(value, float) and "stderr" not in metric:
                got = ours["results"][task][metric]
                assert got == pytest.approx(value, rel=1e-5), (task, metric)
    # the generations compared above hinge on no near-tie: each greedy choice wins clearly
    lm = harness.FoundryLM(str(hf_dir))
    for sample in ours["samples"]["shakespeare_next_speaker"]:
        ids = lm.tok_encode(sample["arguments"][0][0])
        for _ in range(len(lm.tok_encode(sample["resps"][0][0])) + 1):
            with torch.no_grad():
                logits = lm.model(torch.tensor([ids]))[0][0, -1]
            assert_decisive(logits, "next speaker")
            ids.append(int(logits.argmax()))


def test_batches_do_not_change_the_answers(hf_dir):
    lm = harness.FoundryLM(str(hf_dir), batch_size=1)
    rows = [([5, 9, 30, 41], [7, 8]), ([3], [100, 200, 300]), ([11, 12, 13, 14, 15, 16], [2])]
    alone = harness.score(lm.model, rows, lm.max_length, batch_size=1)
    together = harness.score(lm.model, rows, lm.max_length, batch_size=3)
    for (a, ga), (b, gb) in zip(alone, together, strict=True):
        assert a == pytest.approx(b, abs=1e-5) and ga == gb
    # by hand: the continuation's log-probabilities from one forward of context + continuation
    ids = rows[1][0] + rows[1][1]
    with torch.no_grad():
        logp = torch.log_softmax(lm.model(torch.tensor([ids[:-1]]))[0][0], -1)
    want = sum(logp[i - 1, ids[i]].item() for i in range(1, len(ids)))
    assert alone[1][0] == pytest.approx(want, abs=1e-5)


def test_rolling_loglikelihood_is_llm_foundry_evals_loss(tmp_path, capsys):
    """A character model has no BOS: both score every token after the first, in the same
    windows of the trained context."""
    text = corpus_text(3000)
    ckpt = _checkpoint(tmp_path / "char", CharTokenizer.train(text), max_seq_len=64)
    (tmp_path / "doc.txt").write_text(text[:1000])
    assert main(["eval", "--checkpoint", str(ckpt), "--text", str(tmp_path / "doc.txt"),
                 "--context", "64", "--json"]) == 0  # fmt: skip
    row = json.loads(capsys.readouterr().out)["results"][0]
    lm = harness.FoundryLM(str(ckpt), batch_size=4)

    class Request:  # the one field of lm-eval's Instance the wrapper reads
        args = (text[:1000],)

    (total,) = lm.loglikelihood_rolling([Request()], disable_tqdm=True)
    assert row["scored_tokens"] == 999
    assert -total / row["scored_tokens"] == pytest.approx(row["loss"], rel=1e-5)


def test_default_max_length_is_the_trained_block_size_as_in_eval(char_data, tmp_path, capsys):
    """A run trained on windows of 16 with 64 positions: the wrapper's default windows are eval's
    default (16, what the val loss measured), not max_seq_len; max_length=64 is still taken."""
    from conftest import make_trainer

    data = char_data(3000)
    make_trainer(data, tmp_path / "run", model=dict(max_seq_len=64), block_size=16,
                 max_steps=2, eval_interval=2, checkpoint_interval=2).run()  # fmt: skip
    text = corpus_text(400)
    (tmp_path / "doc.txt").write_text(text)
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(tmp_path / "run"), "--text",
                 str(tmp_path / "doc.txt"), "--json"]) == 0  # fmt: skip
    row = json.loads(capsys.readouterr().out)["results"][0]
    assert row["context"] == 16

    class Request:
        args = (text,)

    lm = harness.FoundryLM(str(tmp_path / "run"), batch_size=4)
    (total,) = lm.loglikelihood_rolling([Request()], disable_tqdm=True)
    assert lm.max_length == 16
    assert -total / row["scored_tokens"] == pytest.approx(row["loss"], rel=1e-5)
    assert harness.FoundryLM(str(tmp_path / "run"), max_length=64).max_length == 64


def _task_text() -> str:
    """Every string of the local tasks' rows (a character tokenizer must cover them)."""
    rows = [json.loads(x) for f in TASKS_DIR.glob("*.jsonl") for x in f.read_text().splitlines()]
    values = [v for r in rows for v in r.values()]
    return "".join(v for v in values if isinstance(v, str)) + "".join(
        "".join(v) for v in values if isinstance(v, list)
    )


@pytest.mark.heavy
def test_eval_tasks_runs_the_local_group_and_names_unknown_tasks(tmp_path, capfd, monkeypatch):
    monkeypatch.chdir(tmp_path)  # outside a git repository, as an installed package's user is
    tok = CharTokenizer.train(_task_text())
    ckpt = _checkpoint(tmp_path / "char", tok, max_seq_len=64)
    out = tmp_path / "results.json"
    args = ["eval", "--checkpoint", str(ckpt), "--tasks", "shakespeare", "--limit", "3"]
    assert main([*args, "--json", "--out", str(out)]) == 0
    said = capfd.readouterr()
    assert "fatal: not a git repository" not in said.err  # the harness's own git call, quiet
    shown = json.loads(said.out)["results"]
    assert set(LOCAL) <= set(shown)
    assert 0 <= shown["shakespeare_next_line"]["acc,none"] <= 1
    assert math.isfinite(shown["shakespeare_passages"]["bits_per_byte,none"])
    assert json.loads(out.read_text())["results"] == shown
    assert main(["eval", "--checkpoint", str(ckpt), "--tasks", "shakespear"]) == 2
    assert "unknown task(s) shakespear: the local ones are" in capfd.readouterr().err


def test_a_negative_few_shot_count_is_one_line(tmp_path, capsys):
    ckpt = _checkpoint(tmp_path / "char", CharTokenizer.train(_task_text()), max_seq_len=64)
    argv = ["eval", "--checkpoint", str(ckpt), "--tasks", "shakespeare", "--num-fewshot", "-1"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--num-fewshot -1 must be >= 0" in err, err


def test_without_the_harness_the_install_line_is_given(tmp_path, monkeypatch, capsys):
    for name in [m for m in sys.modules if m == "lm_eval" or m.startswith("lm_eval.")]:
        monkeypatch.setitem(sys.modules, name, None)  # importing it now fails
    monkeypatch.delitem(sys.modules, "llm_foundry.harness")
    assert main(["eval", "--checkpoint", str(tmp_path), "--tasks", "shakespeare"]) == 2
    err = capsys.readouterr().err  # one line, as every usage error: no traceback
    assert err.count("\n") == 1 and err.startswith("llm-foundry eval: error: "), err
    assert install_line("eval") in err


def test_the_shipped_tasks_are_what_the_builder_makes_from_the_corpus(shared_data, tmp_path):
    from llm_foundry.tasks.build import FILES, build

    counts = build(shared_data / "tinyshakespeare.txt", tmp_path)
    assert counts == {
        "next_line": 200,
        "passages": 50,
        "next_speaker": 100,
        "prefer_next_line": 1000,
    }
    for name in FILES.values():
        assert (tmp_path / name).read_bytes() == (TASKS_DIR / name).read_bytes(), name
    # held out: no passage occurs in the training part of the corpus
    text = (shared_data / "tinyshakespeare.txt").read_text()
    train = text[: int(len(text) * 0.9)]
    rows = [json.loads(x) for x in (TASKS_DIR / "passages.jsonl").read_text().splitlines()]
    assert not any(r["text"][:200] in train for r in rows)


@pytest.mark.heavy
def test_the_harness_command_line_runs_our_model(tmp_path):
    """lm-eval's own CLI, with --model llm-foundry registered by our launcher."""
    ckpt = _checkpoint(tmp_path / "char", CharTokenizer.train(_task_text()), max_seq_len=64)
    cmd = [sys.executable, "-m", "llm_foundry.harness", "run", "--model", "llm-foundry",
           "--model_args", f"checkpoint={ckpt}", "--tasks", "shakespeare_next_line",
           "--include_path", str(TASKS_DIR), "--limit", "4", "--device", "cpu"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "shakespeare_next_line" in done.stdout and "acc" in done.stdout
    assert "fatal: not a git repository" not in done.stderr  # run outside one


def test_a_tokenizer_config_that_is_not_an_object_is_one_line(tmp_path):
    """The special tokens' ids come from tokenizer_config.json: a config that is a list is
    named, not an AttributeError."""
    from tokenizers import Tokenizer, models

    from llm_foundry.export import convert_to_hf

    vocab = {c: i for i, c in enumerate(sorted(set(_task_text())))}
    tok = CharTokenizer.train(_task_text())
    hf = convert_to_hf(_checkpoint(tmp_path / "ours", tok), tmp_path / "hf")
    Tokenizer(models.WordLevel(vocab, unk_token=None)).save(str(hf / "tokenizer.json"))
    (hf / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"tokenizer_config\.json holds a list, not a JSON object"):
        harness.FoundryLM(str(hf))
