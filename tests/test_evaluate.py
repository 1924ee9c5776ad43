"""Perplexity evaluation: windows, sliding strides, learned-position limits, RoPE scaling."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from llm_foundry.checkpoint import save_checkpoint
from llm_foundry.cli.eval import main
from llm_foundry.config import ModelConfig
from llm_foundry.data import DataError
from llm_foundry.evaluate import evaluate_tokens, windows, with_rope_scaling
from llm_foundry.models import Transformer
from llm_foundry.tokenizer import CharTokenizer


def _model(**kw) -> Transformer:
    torch.manual_seed(0)
    base = dict(vocab_size=23, dim=32, n_layers=2, n_heads=4, max_seq_len=16)
    return Transformer(ModelConfig(**{**base, **kw})).eval()


def _tokens(n: int = 200) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 23, n)


@pytest.mark.parametrize("n", [100, 97, 33])  # 97 = 6 windows of 16 + the seam token: no rest
def test_windows_cover_every_target_once(n):
    ctx = 16
    for stride in (None, 16, 5, 1):
        scored = []
        for start, skip in windows(n, ctx, stride):
            assert 0 <= start and start + ctx + 1 <= n
            scored += list(range(start + 1 + skip, start + ctx + 1))
        assert scored == list(range(1, n)), stride  # every target once, in order


def test_bad_context_batch_or_window_limits_are_refused():
    model, toks = _model(), _tokens()
    for kw in (dict(context=0), dict(context=-3), dict(context=16, batch_size=0)):
        with pytest.raises(ValueError, match="must be"):
            evaluate_tokens(model, toks, **kw)
    with pytest.raises(ValueError, match="max_windows=0"):
        evaluate_tokens(model, toks, 16, max_windows=0)


def test_non_overlapping_loss_equals_a_manual_computation():
    model, toks = _model(pos_encoding="rope"), _tokens()
    r = evaluate_tokens(model, toks, 16, batch_size=3)
    t = torch.as_tensor(toks)
    losses = []
    for s in range(0, len(toks) - 16, 16):
        logits = model(t[None, s : s + 16])[0][0]
        losses.append(F.cross_entropy(logits, t[s + 1 : s + 17], reduction="none"))
    # 200 tokens: 12 whole windows score targets 1..192; one more at the end scores 193..199
    logits = model(t[None, 183:199])[0][0][-7:]
    losses.append(F.cross_entropy(logits, t[193:200], reduction="none"))
    ref = torch.cat(losses).mean().item()
    assert r["loss"] == pytest.approx(ref, rel=1e-5) and r["ppl"] == pytest.approx(math.exp(ref))
    assert r["scored_tokens"] == len(toks) - 1 and r["windows"] == 13
    # stride = context: the same windows and scored tokens (compared exactly), in batches of 8,
    # not 3: other GEMM shapes and float32 sums, so the losses agree to ~1e-7, not bit for bit
    same_windows = evaluate_tokens(model, toks, 16, stride=16)
    assert same_windows["loss"] == pytest.approx(r["loss"], rel=1e-5)
    assert same_windows["scored_tokens"] == r["scored_tokens"] and same_windows["windows"] == 13


def test_sliding_windows_score_each_token_with_long_history():
    model, toks = _model(pos_encoding="alibi"), _tokens()
    r = evaluate_tokens(model, toks, 16, stride=4)
    t = torch.as_tensor(toks)
    first = F.cross_entropy(model(t[None, :16])[0][0], t[1:17], reduction="none")
    parts = [first]
    for s in range(4, len(toks) - 16, 4):
        logits = model(t[None, s : s + 16])[0][0][-4:]
        parts.append(F.cross_entropy(logits, t[s + 13 : s + 17], reduction="none"))
    logits = model(t[None, 183:199])[0][0][-3:]  # the last window: targets 197..199 left over
    parts.append(F.cross_entropy(logits, t[197:200], reduction="none"))
    assert r["scored_tokens"] == len(toks) - 1
    assert r["loss"] == pytest.approx(torch.cat(parts).mean().item(), rel=1e-5)


def test_learned_positions_past_their_table_cannot_run():
    r = evaluate_tokens(_model(pos_encoding="learned"), _tokens(), 32)
    assert r["status"] == "cannot run" and "16 rows" in r["reason"]
    assert "loss" in evaluate_tokens(_model(pos_encoding="learned"), _tokens(), 16)


def test_rope_scaling_keeps_weights_and_changes_long_context_only_as_configured():
    # init_std 0.2 (not 0.02): attention scores of order 1, so what a token attends to depends on
    # the RoPE angles. At 0.02 attention is near uniform and rescaling RoPE moves the logits by
    # ~1e-4 and the loss by ~1e-7, within float32 rounding of one CPU's kernels versus another's.
    model, toks = _model(pos_encoding="rope", init_std=0.2), _tokens(400)
    x = torch.as_tensor(toks[None, :32])  # twice the trained context (max_seq_len 16)
    with torch.no_grad():
        ref = model(x)[0][0]  # (32, vocab)

    def same_weights(m):
        a, b = m.state_dict(), model.state_dict()
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # linear by 1.0 is no scaling: same weights, same rotation speeds, same logits and loss
    same = with_rope_scaling(model, "linear", 1.0)
    assert same_weights(same) and torch.equal(same.pos.inv_freq, model.pos.inv_freq)
    with torch.no_grad():
        torch.testing.assert_close(same(x)[0][0], ref, rtol=0, atol=1e-5)
    assert evaluate_tokens(same, toks, 32)["loss"] == pytest.approx(
        evaluate_tokens(model, toks, 32)["loss"], rel=1e-6
    )
    # NTK by 4: same weights, slower rotations (the fastest one, 1 rad/position, untouched)
    scaled = with_rope_scaling(model, "ntk", 4.0)
    assert scaled.cfg.rope_scaling == "ntk" and scaled.cfg.rope_factor == 4.0
    assert model.cfg.rope_scaling == "none"  # the original model is left as it was
    assert same_weights(scaled)
    assert scaled.pos.inv_freq[0] == model.pos.inv_freq[0] == 1.0
    assert (scaled.pos.inv_freq[1:] < model.pos.inv_freq[1:]).all()
    with torch.no_grad():
        diff = (scaled(x)[0][0] - ref).abs().amax(-1)  # (32,): per position
    # position 0 is rotated by angle 0 under any scaling and sees only itself: unchanged
    assert diff[0] < 1e-5, diff[0]
    # every position past the trained context sees other angles; float32 rounding is ~1e-6 here
    assert diff[16:].min() > 0.1, diff
    loss, scaled_loss = (evaluate_tokens(m, toks, 32)["loss"] for m in (model, scaled))
    assert abs(scaled_loss - loss) > 1e-3, (scaled_loss, loss)
    with pytest.raises(ValueError, match="pos_encoding='rope'"):
        with_rope_scaling(_model(pos_encoding="alibi"), "linear", 2.0)


def test_errors():
    with pytest.raises(ValueError, match="fewer than one window"):
        evaluate_tokens(_model(), _tokens(10), 16)
    with pytest.raises(ValueError, match="stride=20"):
        evaluate_tokens(_model(), _tokens(), 16, stride=20)


def test_cli_table_and_json(tmp_path, capsys):
    text = "the quick brown fox jumps over the lazy dog. " * 20
    tok = CharTokenizer.train(text)
    model = _model(vocab_size=tok.vocab_size, pos_encoding="learned")
    save_checkpoint(model, tmp_path / "ck")
    tok.save(tmp_path / "ck" / "tokenizer.json")
    (tmp_path / "t.txt").write_text(text)
    args = ["--checkpoint", str(tmp_path / "ck"), "--text", str(tmp_path / "t.txt")]
    assert main([*args, "--context", "8,16,32", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert [r["context"] for r in rep["results"]] == [8, 16, 32]
    assert rep["results"][2]["status"] == "cannot run" and rep["results"][0]["ppl"] > 1
    assert main([*args, "--context", "8", "--stride", "4"]) == 0
    assert "cannot run" not in capsys.readouterr().out


def test_cli_refuses_what_no_run_takes_before_scoring_anything(tmp_path, capsys, monkeypatch):
    """A bad --context among several, a --stride past the shortest context, --rope-factor < 1,
    RoPE scaling of learned positions, and flags of the other kind of evaluation: one line each,
    before any window is scored (and a learned-position context past its table gets no
    extrapolation note: its row says it cannot run)."""
    import llm_foundry.cli.eval as eval_cli
    from llm_foundry.cli import main as cli

    text = "the quick brown fox jumps over the lazy dog. " * 20
    tok = CharTokenizer.train(text)
    save_checkpoint(_model(vocab_size=tok.vocab_size, pos_encoding="learned"), tmp_path / "ck")
    tok.save(tmp_path / "ck" / "tokenizer.json")
    (tmp_path / "t.txt").write_text(text)
    args = ["--checkpoint", str(tmp_path / "ck"), "--text", str(tmp_path / "t.txt")]
    scored = []
    monkeypatch.setattr(eval_cli, "evaluate_tokens", lambda *a, **k: scored.append(a))
    for extra, said in [
        (["--context", "16,0"], "--context 16,0: 0 is not a context; each must be >= 1"),
        (["--context", "16,8", "--stride", "12"], "--stride 12 is longer than --context 8"),
        (["--rope-scaling", "ntk", "--rope-factor", "0.5"], "--rope-factor 0.5 must be >= 1"),
        (["--rope-scaling", "ntk", "--rope-factor", "2"],
         "--rope-scaling ntk: " + str(tmp_path / "ck") + " has learned positions; only a RoPE"),
        (["--out", "r.json", "--limit", "3"], "--limit, --out apply to --tasks (lm-eval) only"),
    ]:  # fmt: skip
        assert cli(["eval", *args, *extra]) != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and said in err[0], (extra, err)
    tasks = ["--checkpoint", str(tmp_path / "ck"), "--tasks", "shakespeare", "--context", "8"]
    assert cli(["eval", *tasks]) != 0
    assert "--context apply to --data / --text" in capsys.readouterr().err
    assert scored == []
    monkeypatch.undo()
    assert main([*args, "--context", "16,32", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["results"][1]["status"] == "cannot run" and report["notes"] == []


def test_cli_refuses_data_from_another_tokenizer(tmp_path):
    model = _model(vocab_size=20)
    save_checkpoint(model, tmp_path / "ck")
    data = tmp_path / "data"
    data.mkdir()
    np.arange(100, dtype=np.uint16).tofile(data / "val.bin")  # ids up to 99 > vocab 20
    meta = dict(dtype="uint16", vocab_size=100, train_tokens=0, val_tokens=100)
    (data / "meta.json").write_text(json.dumps(meta))
    args = ["--checkpoint", str(tmp_path / "ck")]
    with pytest.raises(ValueError, match="holds token id 99, past the model's vocab_size 20"):
        main([*args, "--data", str(data / "val.bin"), "--context", "8"])
    with pytest.raises(ValueError, match="--rope-factor needs --rope-scaling"):
        main([*args, "--data", str(data / "val.bin"), "--rope-factor", "2"])
    CharTokenizer.train("abc").save(tmp_path / "ck" / "tokenizer.json")
    with pytest.raises(FileNotFoundError, match="--text .*nope.txt: no such file"):
        main([*args, "--text", str(tmp_path / "nope.txt")])


def test_cli_data_directory_is_its_validation_split_every_shard_in_order(tmp_path, capsys):
    """``--data DIR`` evaluates DIR's validation split: its shards joined in order, each read
    alone as a token file; a directory from before shards reads its val.bin."""
    from sharded import write_sharded

    from llm_foundry.data import load_meta, open_tokens

    save_checkpoint(_model(pos_encoding="rope"), tmp_path / "ck")
    docs = [list(_tokens(300)[i : i + 50]) for i in range(0, 300, 50)]
    data = write_sharded(tmp_path / "sharded", [docs[:2]], [docs[2:4], docs[4:]], vocab_size=23)
    args = ["--checkpoint", str(tmp_path / "ck"), "--context", "16", "--json"]
    shards = [data / s["file"] for s in load_meta(data)["shards"]["val"]]
    joined = np.concatenate([open_tokens(f, "uint16") for f in shards])
    (old := tmp_path / "legacy").mkdir()
    joined.tofile(old / "val.bin")
    (old / "meta.json").write_text(json.dumps(dict(dtype="uint16", vocab_size=23,
                                                   train_tokens=0, val_tokens=len(joined))))  # fmt: skip
    reports = []
    for where in (data, old, old / "val.bin"):
        assert main([*args, "--data", str(where)]) == 0
        reports.append(json.loads(capsys.readouterr().out)["results"][0])
    want = evaluate_tokens(_model(pos_encoding="rope"), joined, 16)
    assert len(shards) == 2 and reports[0]["scored_tokens"] == len(joined) - 1
    for r in reports:
        assert r["loss"] == pytest.approx(want["loss"], abs=1e-6)
    one = main([*args, "--data", str(shards[1])])
    assert one == 0 and json.loads(capsys.readouterr().out)["results"][0]["scored_tokens"] == 99
    # a file of the directory that holds no tokens is refused, not read as tokens
    with pytest.raises(DataError, match=r"legacy/meta.json is a file, not a directory"):
        main([*args, "--data", str(old / "meta.json")])


def test_cli_evaluates_an_hf_directory_as_its_source_checkpoint(tmp_path, capsys):
    """The directory `convert --to-hf` writes is evaluated like the checkpoint it came from."""
    from llm_foundry.cli import main as cli

    save_checkpoint(_model(pos_encoding="rope", n_kv_heads=2), tmp_path / "ck")
    data = tmp_path / "data"
    data.mkdir()
    _tokens(300).astype(np.uint16).tofile(data / "val.bin")
    meta = dict(dtype="uint16", vocab_size=23, train_tokens=0, val_tokens=300)
    (data / "meta.json").write_text(json.dumps(meta))
    assert cli(["convert", "--to-hf", str(tmp_path / "ck"), "--out", str(tmp_path / "hf")]) == 0
    assert "model_type" in json.loads((tmp_path / "hf" / "config.json").read_text())
    capsys.readouterr()
    reports = []
    for source in ("ck", "hf"):
        args = ["--checkpoint", str(tmp_path / source), "--data", str(data / "val.bin")]
        assert main([*args, "--context", "8,16", "--json"]) == 0
        reports.append(json.loads(capsys.readouterr().out))
    ours, hf = ([r["loss"] for r in rep["results"]] for rep in reports)
    assert reports[1]["checkpoint"] == str(tmp_path / "hf")
    assert hf == pytest.approx(ours, abs=1e-5) and len(ours) == 2


def _legacy_data(where, tokens: np.ndarray) -> None:
    """A prepared directory from before shards: val.bin and a meta.json without a tokenizer."""
    where.mkdir()
    tokens.astype(np.uint16).tofile(where / "val.bin")
    meta = dict(dtype="uint16", vocab_size=23, train_tokens=0, val_tokens=len(tokens))
    (where / "meta.json").write_text(json.dumps(meta))


def test_cli_refuses_data_of_another_tokenizer_naming_both(tmp_path, capsys):
    """``--data`` tokenized with another tokenizer than the checkpoint's is refused in one line
    naming both, its token files too; the model's own tokenizer re-saved in another format (by
    transformers) is the same tokenizer, and a checkpoint without one gets a note, not a refusal."""
    import shutil

    from transformers import PreTrainedTokenizerFast

    from llm_foundry.data import prepare
    from llm_foundry.tokenizer import load_tokenizer

    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog, said Jo. " * 60)
    char = prepare(tmp_path / "char", text_files=[text], tokenizer="char", progress=False)
    prepare(tmp_path / "bpe", text_files=[text], tokenizer="bpe", vocab_size=270, progress=False)
    bpe = load_tokenizer(tmp_path / "bpe" / "tokenizer.json")
    ck = tmp_path / "ck"
    save_checkpoint(_model(vocab_size=bpe.vocab_size, pos_encoding="rope"), ck)
    args = ["--checkpoint", str(ck), "--context", "8", "--json"]
    # no tokenizer in the checkpoint: nothing to compare, said in a note; the loss is given
    assert main([*args, "--data", str(tmp_path / "char")]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert "loss" in rep["results"][0] and len(rep["notes"]) == 1
    assert f"{ck / 'tokenizer.json'} does not exist" in rep["notes"][0]
    shutil.copyfile(tmp_path / "bpe" / "tokenizer.json", ck / "tokenizer.json")  # as training does
    # character ids (all < the BPE vocabulary): only the tokenizers tell the data is not the model's
    assert char["vocab_size"] < bpe.vocab_size
    for where in (tmp_path / "char", tmp_path / "char" / "val.bin"):
        want = (rf"^--data {where}: tokenized with {tmp_path / 'char' / 'tokenizer.json'} "
                rf"\(char, {char['vocab_size']} tokens\), not the model's {ck / 'tokenizer.json'} "
                rf"\(bpe, {bpe.vocab_size} tokens\); ")  # fmt: skip
        with pytest.raises(ValueError, match=want) as refused:
            main([*args, "--data", str(where)])
        assert "\n" not in str(refused.value)
    # another BPE of the same size, trained on other text: same kind and size, other ids
    other = tmp_path / "other.txt"
    other.write_text("Pack my box with five dozen liquor jugs; how vexingly quick! " * 60)
    prepare(tmp_path / "bpe2", text_files=[other], tokenizer="bpe", vocab_size=270, progress=False)
    with pytest.raises(ValueError, match=rf"\(bpe, {bpe.vocab_size} tokens\), not the model's"):
        main([*args, "--data", str(tmp_path / "bpe2")])
    assert main([*args, "--data", str(tmp_path / "bpe")]) == 0  # its own data
    ours = json.loads(capsys.readouterr().out)
    assert ours["notes"] == [] and ours["results"][0]["scored_tokens"] > 8
    # the same tokenizer in transformers' format: other bytes, the same vocabulary and encoding
    PreTrainedTokenizerFast(tokenizer_file=str(ck / "tokenizer.json")).save_pretrained(tmp_path)
    resaved = (tmp_path / "tokenizer.json").read_bytes()
    assert resaved != (ck / "tokenizer.json").read_bytes()
    (ck / "tokenizer.json").write_bytes(resaved)
    assert main([*args, "--data", str(tmp_path / "bpe")]) == 0
    assert json.loads(capsys.readouterr().out)["results"] == ours["results"]


def test_cli_default_context_is_the_models_max_seq_len(tmp_path, capsys):
    """Without --context the model is evaluated at its max_seq_len, as the header says; a context
    given past it still runs (relative positions extrapolate)."""
    save_checkpoint(_model(pos_encoding="rope"), tmp_path / "ck")  # max_seq_len 16
    _legacy_data(tmp_path / "data", _tokens(400))
    args = ["--checkpoint", str(tmp_path / "ck"), "--data", str(tmp_path / "data")]
    assert main([*args, "--json"]) == 0
    default = json.loads(capsys.readouterr().out)
    assert main([*args, "--json", "--context", "16,32"]) == 0
    given = json.loads(capsys.readouterr().out)
    assert [r["context"] for r in default["results"]] == [16]
    assert default["results"][0] == given["results"][0]
    assert default["trained_context"] == 16 and default["context_default"] is True
    assert given["context_default"] is False
    assert given["results"][1]["context"] == 32 and "loss" in given["results"][1]
    assert main(args) == 0
    assert "context 16 by default (the model's max_seq_len)" in capsys.readouterr().out


def test_cli_data_path_errors_name_the_path_given(tmp_path, capsys):
    """A --data path that does not exist, or is not prepared data, is named as given."""
    from llm_foundry.cli import main as cli

    save_checkpoint(_model(), tmp_path / "ck")
    args = ["--checkpoint", str(tmp_path / "ck"), "--data"]
    nope = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=rf"^--data {nope}: no such file or directory$"):
        main([*args, str(nope)])
    (plain := tmp_path / "plain").mkdir()
    np.zeros(50, np.uint16).tofile(plain / "val.bin")
    for given in (plain, plain / "val.bin"):
        want = rf"^--data {given}: no {plain / 'meta.json'}: .*`llm-foundry prepare`"
        with pytest.raises(ValueError, match=want):
            main([*args, str(given)])
    (plain / ".progress.json").write_text("{}")  # what an interrupted prepare leaves
    with pytest.raises(ValueError, match=rf"^--data {plain}: no {plain / 'meta.json'}: its "
                       "`llm-foundry prepare` was interrupted; run the same prepare command "
                       "again to finish it$"):  # fmt: skip
        main([*args, str(plain)])
    (corpus := tmp_path / "corpus.jsonl").write_text('{"text": "abc"}\n')
    want = (rf"^--data {corpus} is a file of documents, .*`llm-foundry prepare --input {corpus} "
            r"--tokenizer-from CHECKPOINT --out DIR`$")  # fmt: skip
    with pytest.raises(ValueError, match=want):
        main([*args, str(corpus)])
    (rows := tmp_path / "rows.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    with pytest.raises(ValueError, match=rf"^--data {rows} is a file of fine-tuning rows \(prompt, "
                       rf"completion\), .*`llm-foundry prepare --sft {rows} --tokenizer-from "
                       "CHECKPOINT --out DIR`"):  # fmt: skip
        main([*args, str(rows)])
    (text := tmp_path / "held-out.txt").write_text("abc")
    with pytest.raises(ValueError, match=rf"^--data {text} is a text file, .*give it as --text"):
        main([*args, str(text)])
    assert cli(["eval", *args, str(nope)]) == 2  # one line on stderr
    assert capsys.readouterr().err == (
        f"llm-foundry eval: error: --data {nope}: no such file or directory\n"
    )


def test_progress_is_told_every_batch_and_a_context_past_max_seq_len_gets_a_note(tmp_path,
                                                                                 capsys):  # fmt: skip
    model, seen = _model(pos_encoding="rope"), []
    out = evaluate_tokens(model, _tokens(200), 16, batch_size=4,
                          progress=lambda done, total: seen.append((done, total)))  # fmt: skip
    total = out["windows"]
    assert seen == [(min(i + 4, total), total) for i in range(0, total, 4)]
    save_checkpoint(model, tmp_path / "ck")
    CharTokenizer.train("abcdefghijklmnopqrstuvw").save(tmp_path / "ck" / "tokenizer.json")
    (tmp_path / "t.txt").write_text("abcdefghijklmnopqrstuvw" * 20)
    args = ["--checkpoint", str(tmp_path / "ck"), "--text", str(tmp_path / "t.txt")]
    assert main([*args, "--context", "16,32", "--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert notes == ["note: context 32 is past the model's max_seq_len 16: positions it was never "
                     "trained at (extrapolation)"]  # fmt: skip
    assert main([*args, "--context", "16"]) == 0
    assert "past the model's max_seq_len" not in capsys.readouterr().out


def test_cli_default_context_is_the_trained_block_size_and_past_it_gets_a_note(char_data,
                                                                               tmp_path, capsys):  # fmt: skip
    """A run trained on windows of 16 with 64 learned positions: eval scores windows of 16 by
    default (what its val loss measured; rows 16..63 of the table never trained), as --context
    16 does, and a longer context given gets a note."""
    from conftest import make_trainer

    data = char_data(3000)
    trainer = make_trainer(data, tmp_path / "run", model=dict(pos_encoding="learned",
                           max_seq_len=64), block_size=16, max_steps=2, eval_interval=2,
                           checkpoint_interval=2)  # fmt: skip
    trainer.run()
    capsys.readouterr()
    args = ["--checkpoint", str(tmp_path / "run"), "--data", str(data), "--json"]
    assert main(args) == 0
    default = json.loads(capsys.readouterr().out)
    assert [r["context"] for r in default["results"]] == [16]
    assert default["trained_block_size"] == 16 and default["trained_context"] == 64
    assert default["context_default"] is True and default["notes"] == []
    assert main([*args, "--context", "16,64"]) == 0
    given = json.loads(capsys.readouterr().out)
    assert given["results"][0] == default["results"][0]
    assert given["notes"] == ["note: context 64 is past the trained context 16 (the model was "
                              "trained on windows of 16 tokens): rows of its learned position "
                              "table 16..63 were never trained, and quality may drop"]  # fmt: skip
    assert main(args[:-1]) == 0
    assert "context 16 by default (the windows it was trained on)" in capsys.readouterr().out

    # the library's reader (rundir.trained_block_size), which eval uses
    from llm_foundry.rundir import checkpoint_dir, trained_block_size

    ckpt = checkpoint_dir(tmp_path / "run")
    assert trained_block_size(ckpt) == 16 and trained_block_size(tmp_path) is None
    (ckpt / "state.json").write_text("{")  # damaged: the weights are still evaluated
    assert trained_block_size(ckpt) is None
    assert main(args) == 0
    assert [r["context"] for r in json.loads(capsys.readouterr().out)["results"]] == [64]


def test_eval_on_fine_tuning_examples_says_it_scores_them_as_a_stream(tmp_path, capsys):
    """An SFT data directory (prompts and completions, masked in training) is scored as one
    token stream all the same, with a note that it is not the fine-tune's val loss."""
    from llm_foundry.data.sft import prepare_sft

    text = "the quick brown fox jumps over the lazy dog. "
    tok = CharTokenizer.train(text)
    save_checkpoint(_model(vocab_size=tok.vocab_size), tmp_path / "ck")
    tok.save(tmp_path / "ck" / "tokenizer.json")
    rows = [{"prompt": text[: 5 + i], "completion": text[5 + i : 30 + i]} for i in range(12)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepare_sft(tmp_path / "sft", tmp_path / "rows.jsonl", tmp_path / "ck" / "tokenizer.json",
                val_fraction=0.5)  # fmt: skip
    args = ["--checkpoint", str(tmp_path / "ck"), "--data", str(tmp_path / "sft"), "--context", "8"]
    assert main([*args, "--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert any("holds fine-tuning examples (prompts and completions): eval scores its tokens as "
               "one stream" in n for n in notes), notes  # fmt: skip


def test_the_eval_command_shows_its_progress_off_a_terminal_too(tmp_path, capsys):
    """A held-out split of a real corpus takes minutes to score: the bar of windows scored goes
    to stderr in a log as in a terminal (stdout keeps the JSON alone)."""
    text = "".join(chr(97 + (i * 7) % 26) for i in range(3000))
    tok = CharTokenizer.train(text)
    cfg = ModelConfig(vocab_size=tok.vocab_size, dim=32, n_layers=1, n_heads=2, max_seq_len=64)
    save_checkpoint(Transformer(cfg), tmp_path / "ckpt")
    tok.save(tmp_path / "ckpt" / "tokenizer.json")
    (tmp_path / "held-out.txt").write_text(text)
    capsys.readouterr()
    main(["--checkpoint", str(tmp_path / "ckpt"), "--text", str(tmp_path / "held-out.txt"),
          "--context", "64", "--json"])  # fmt: skip
    out, err = capsys.readouterr()
    windows_scored = json.loads(out)["results"][0]["windows"]
    # drawn at its start at least (a fast run may clear it before its next refresh)
    assert "eval context 64:" in err and f"/{windows_scored} [" in err
