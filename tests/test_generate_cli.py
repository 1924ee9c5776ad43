"""``llm-foundry generate``: greedy text equal to the Python API, streaming equal to the finished
text (stop strings and multi-byte characters included), seeds, the interactive loop on stdin,
--json, training run directories, HF directories (with and without a tokenizer) and errors."""

from __future__ import annotations

import io
import json

import pytest
import torch
from conftest import assert_decisive, tiny_hf_llama

from llm_foundry.checkpoint import save_checkpoint
from llm_foundry.cli import main
from llm_foundry.config import ModelConfig
from llm_foundry.generate import generate
from llm_foundry.models import Transformer
from llm_foundry.tokenizer import BPETokenizer, CharTokenizer

TEXT = "to be or not to be, that is the question. whether tis nobler in the mind\n" * 5


def _save(path, tok, seed: int = 0, **kw) -> Transformer:
    """A tiny random model over ``tok``'s vocabulary, saved with the tokenizer at ``path``."""
    torch.manual_seed(seed)
    cfg = dict(vocab_size=tok.vocab_size, dim=32, n_layers=2, n_heads=2, max_seq_len=64)
    model = Transformer(ModelConfig(**{**cfg, **kw})).eval()
    save_checkpoint(model, path)
    tok.save(path / "tokenizer.json")
    return model


@pytest.fixture()
def ckpt(tmp_path):
    tok = CharTokenizer.train(TEXT)
    model = _save(tmp_path / "ck", tok)
    return tmp_path / "ck", model, tok


def _run(capsys, *args) -> str:
    assert main(["generate", *args]) == 0
    return capsys.readouterr().out


def _fails(capsys, *args) -> str:
    assert main(["generate", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("llm-foundry generate: error: ")
    return err


def _greedy_text(model, tok, prompt: str, n: int) -> str:
    out = generate(model, torch.tensor([tok.encode(prompt)]), n, temperature=0)
    return tok.decode(out[0].tolist())


# ----------------------------------------------------------------------------------------------


def test_greedy_equals_the_python_api(ckpt, capsys):
    path, model, tok = ckpt
    args = ["--checkpoint", str(path), "--prompt", "to be", "--temperature", "0"]
    out = _run(capsys, *args, "--max-new-tokens", "20")
    assert out == _greedy_text(model, tok, "to be", 20) + "\n"
    # sampling filters are ignored at temperature 0
    assert _run(capsys, *args, "--max-new-tokens", "20", "--top-k", "3", "--top-p", "0.5") == out


@pytest.mark.parametrize(
    "extra",
    [
        ["--temperature", "0"],
        ["--temperature", "1.0", "--seed", "3", "--top-p", "0.9"],
        ["--temperature", "0.7", "--seed", "5", "--min-p", "0.05", "--repetition-penalty", "1.3"],
    ],
)
def test_stream_prints_the_same_text(ckpt, capsys, extra):
    path, _, _ = ckpt
    args = ["--checkpoint", str(path), "--prompt", "whether", "--max-new-tokens", "30", *extra]
    assert _run(capsys, *args, "--stream") == _run(capsys, *args)


def test_stop_string_cuts_the_continuation(ckpt, capsys):
    path, _, _ = ckpt
    base = ["--checkpoint", str(path), "--prompt", "t", "--max-new-tokens", "40"]
    base += ["--temperature", "1.0", "--seed", "1"]  # varied text (greedy repeats itself)
    full = json.loads(_run(capsys, *base, "--json"))["completion"]
    assert len(full) == 40
    # a stop string whose first character shows up before the stop string does: streaming must
    # hold that character back until it knows whether the stop string follows
    i = next(i for i in range(1, 38) if full.find(full[i]) < full.find(full[i : i + 2]))
    stop = full[i : i + 2]
    rec = json.loads(_run(capsys, *base, "--stop", stop, "zz", "--json"))
    assert rec["completion"] == full[: full.find(stop)] and stop not in rec["completion"]
    # the flag given once per string is the same list (argparse kept only the last one)
    twice = json.loads(_run(capsys, *base, "--stop", stop, "--stop", "zz", "--json"))
    twice.pop("tokens_per_s"), rec.pop("tokens_per_s")  # timings differ between runs
    assert twice == rec
    assert rec["stop_reason"] == "stop" and rec["new_tokens"] == full.find(stop) + 2
    text = _run(capsys, *base, "--stop", stop, "zz")
    assert text == "t" + full[: full.find(stop)] + "\n"
    assert _run(capsys, *base, "--stop", stop, "zz", "--stream") == text
    # stop strings that never complete change nothing, streamed or not
    never = [full[3] + "~", full[-1] + "#"]
    whole = "t" + full + "\n"
    assert _run(capsys, *base, "--stop", *never) == whole
    assert _run(capsys, *base, "--stop", *never, "--stream") == whole


def test_seed_reproducible(ckpt, capsys):
    path, _, _ = ckpt
    base = ["--checkpoint", str(path), "--prompt", "to", "--max-new-tokens", "16"]
    base += ["--temperature", "1.0", "--json"]

    def tokens(seed: str) -> list[int]:
        return json.loads(_run(capsys, *base, "--seed", seed))["new_ids"]

    assert tokens("7") == tokens("7")
    assert tokens("7") != tokens("8")


def test_json_fields(ckpt, capsys):
    path, model, tok = ckpt
    args = ["--checkpoint", str(path), "--prompt", "to be", "--temperature", "0", "--json"]
    rec = json.loads(_run(capsys, *args, "--max-new-tokens", "12"))
    assert set(rec) == {"prompt", "completion", "prompt_ids", "new_ids", "prompt_tokens",
                        "new_tokens", "stop_reason", "tokens_per_s"}  # fmt: skip
    ref = generate(model, torch.tensor([tok.encode("to be")]), 12, temperature=0)[0].tolist()
    # each text beside its ids: the prompt's, then the generated ones alone, each counted
    assert rec["prompt_ids"] == ref[:5] and rec["new_ids"] == ref[5:]
    assert rec["prompt_tokens"] == 5 and rec["new_tokens"] == 12
    assert rec["prompt"] == tok.decode(rec["prompt_ids"]) == "to be"
    assert rec["completion"] == tok.decode(rec["new_ids"])
    assert rec["stop_reason"] == "length" and rec["tokens_per_s"] > 0


def test_interactive_loop_on_stdin(ckpt, capsys, monkeypatch):
    path, model, tok = ckpt
    args = ["--checkpoint", str(path), "--interactive", "--temperature", "0"]
    args += ["--max-new-tokens", "8"]
    want = [_greedy_text(model, tok, p, 8)[len(p) :] for p in ("to be", "the q")]
    for ending in ("\n\nnot read\n", "\nexit\nnot read\n", "\n"):  # empty line, exit, EOF
        monkeypatch.setattr("sys.stdin", io.StringIO("to be\nthe q" + ending))
        assert main(["generate", *args]) == 0
        cap = capsys.readouterr()
        assert cap.out == "".join(w + "\n" for w in want)
        assert cap.err.count("> ") == 3
    monkeypatch.setattr("sys.stdin", io.StringIO("to be\nthe q\n"))
    assert _run(capsys, *args, "--stream") == "".join(w + "\n" for w in want)
    monkeypatch.setattr("sys.stdin", io.StringIO("to be\nthe q\n"))
    recs = [json.loads(line) for line in _run(capsys, *args, "--json").splitlines()]
    assert len(recs) == 2
    assert [r["completion"] for r in recs] == want and recs[1]["prompt"] == "the q"


def test_run_directory_resolves_the_latest_checkpoint(tmp_path, capsys):
    from llm_foundry.train.state import save_train_checkpoint

    tok = CharTokenizer.train(TEXT)
    tok.save(tmp_path / "tokenizer.json")
    root = tmp_path / "run" / "checkpoints"
    models = []
    for step in (10, 20):
        torch.manual_seed(step)
        cfg = ModelConfig(vocab_size=tok.vocab_size, dim=32, n_layers=2, n_heads=2, max_seq_len=64)
        model = Transformer(cfg).eval()
        opt = torch.optim.AdamW(model.parameters())
        save_train_checkpoint(
            root, step, model, opt.state_dict(), {}, tokenizer_path=tmp_path / "tokenizer.json"
        )
        models.append(model)
    want = _greedy_text(models[1], tok, "to", 10) + "\n"
    assert want != _greedy_text(models[0], tok, "to", 10) + "\n"
    for where in (tmp_path / "run", root, root / "step_000020"):
        args = ["--checkpoint", str(where), "--prompt", "to", "--temperature", "0"]
        assert _run(capsys, *args, "--max-new-tokens", "10") == want
    args = ["--checkpoint", str(root / "step_000010"), "--prompt", "to", "--temperature", "0"]
    assert _run(capsys, *args, "--max-new-tokens", "10") != want


def test_multibyte_characters_stream_whole(tmp_path, capsys, monkeypatch):
    """Byte-level BPE with no merges: every non-ASCII character spans several tokens. The model's
    tokens are scripted so the output is known; eos ends the text."""
    import llm_foundry.generate as gen

    tok = BPETokenizer.train("héllo ☃ wörld", vocab_size=259)
    path = tmp_path / "bpe"
    _save(path, tok)
    script = tok.encode("é ☃ ö!") + [tok.eos_id] + tok.encode("never")

    def scripted(model, idx, max_new_tokens, **kw):
        for t in script[:max_new_tokens]:
            yield torch.tensor([t])

    monkeypatch.setattr(gen, "stream", scripted)
    args = ["--checkpoint", str(path), "--prompt", "h", "--max-new-tokens", "50"]
    out = _run(capsys, *args, "--stream")
    assert out == "hé ☃ ö!\n" and _run(capsys, *args) == out
    rec = json.loads(_run(capsys, *args, "--json"))
    assert rec["completion"] == "é ☃ ö!" and rec["stop_reason"] == "eos"
    assert rec["new_ids"] == tok.encode("é ☃ ö!") + [tok.eos_id]  # the eos that ended it too
    assert rec["new_tokens"] == len(rec["new_ids"]) and rec["prompt_ids"] == tok.encode("h")
    assert _run(capsys, *args, "--stream", "--stop", "☃") == "hé \n"
    assert _run(capsys, *args, "--stream", "--ignore-eos").startswith("hé ☃ ö!<eos>never")


# ----------------------------------------------------------------------------------------------
# HF transformers directories


def _hf_llama(tmp_path):
    hf = tiny_hf_llama(vocab_size=50, hidden_size=32, intermediate_size=64)
    hf.save_pretrained(str(tmp_path / "hf"))
    return hf, tmp_path / "hf"


@torch.no_grad()
def _hf_generate(hf, ids: list[int], n: int, **kw) -> list[int]:
    """HF greedy decoding of ``n`` tokens after ``ids``, whose every choice (read from HF's full
    forward) is clear of a tie by more than rounding: our decoding must then pick the same."""
    out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0, **kw)
    assert_decisive(hf(input_ids=out[:, :-1]).logits[:, len(ids) - 1 :], "HF greedy")
    return out[0].tolist()


def test_hf_directory_with_prompt_ids(tmp_path, capsys):
    hf, path = _hf_llama(tmp_path)
    base = ["--checkpoint", str(path), "--prompt-ids", "1,2,3", "--temperature", "0"]
    out = _run(capsys, *base, "--max-new-tokens", "12", "--ignore-eos")
    ref = _hf_generate(hf, [1, 2, 3], 12, min_new_tokens=12, eos_token_id=None)
    assert out.split() == [str(t) for t in ref]
    assert _run(capsys, *base, "--max-new-tokens", "12", "--ignore-eos", "--stream") == out
    # config.json's eos_token_id (2) ends generation the way HF's generate does
    eos = hf.config.eos_token_id
    rec = json.loads(_run(capsys, *base, "--max-new-tokens", "40", "--json"))
    assert rec["prompt"] == rec["prompt_ids"] == [1, 2, 3]  # no tokenizer: the text is ids
    assert rec["prompt_ids"] + rec["new_ids"] == _hf_generate(hf, [1, 2, 3], 40)
    assert rec["stop_reason"] == ("eos" if eos in rec["new_ids"] else "length")
    assert rec["completion"] == [t for t in rec["new_ids"] if t != eos]
    err = _fails(capsys, "--checkpoint", str(path), "--prompt", "hello")
    assert "no tokenizer.json" in err and "--prompt-ids" in err
    assert "out of range" in _fails(capsys, "--checkpoint", str(path), "--prompt-ids", "1,50")


def test_hf_directory_with_its_own_tokenizer_file(tmp_path, capsys):
    """A tokenizer.json that is not one of ours (a word-level HF tokenizers file) is used as is."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    hf, path = _hf_llama(tmp_path)
    words = ["[UNK]"] + sorted(set(TEXT.replace(",", " ").replace(".", " ").split()))
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece()  # joins words with spaces
    tk.save(str(path / "tokenizer.json"))
    args = ["--checkpoint", str(path), "--prompt", "to be or", "--temperature", "0"]
    args += ["--max-new-tokens", "6", "--ignore-eos"]
    ids = tk.encode("to be or").ids
    ref = _hf_generate(hf, ids, 6, min_new_tokens=6)
    rec = json.loads(_run(capsys, *args, "--json"))
    assert rec["prompt_ids"] + rec["new_ids"] == ref and rec["prompt"] == "to be or"
    assert rec["prompt"] + rec["completion"] == tk.decode(ref)
    assert _run(capsys, *args, "--stream") == _run(capsys, *args) == tk.decode(ref) + "\n"


# ----------------------------------------------------------------------------------------------
# Errors: exit status 2 and a message naming the problem


def test_errors(ckpt, tmp_path, capsys):
    path, _, _ = ckpt
    missing = tmp_path / "nope"
    err = _fails(capsys, "--checkpoint", str(missing), "--prompt", "to")
    assert str(missing) in err and "no such directory" in err
    (tmp_path / "empty").mkdir()
    err = _fails(capsys, "--checkpoint", str(tmp_path / "empty"), "--prompt", "to")
    assert str(tmp_path / "empty") in err and "latest.json" in err
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text("{}")
    assert "neither" in _fails(capsys, "--checkpoint", str(tmp_path / "odd"), "--prompt", "to")
    assert "not in the vocabulary" in _fails(capsys, "--checkpoint", str(path), "--prompt", "Z")
    assert "--interactive" in _fails(capsys, "--checkpoint", str(path))
    for flag, value in (("--top-k", "0"), ("--top-p", "1.5"), ("--min-p", "2")):
        err = _fails(capsys, "--checkpoint", str(path), "--prompt", "to", flag, value)
        assert f"{flag[2:].replace('-', '_')}={value}" in err and "must be" in err
    err = _fails(capsys, "--checkpoint", str(path), "--prompt", "to", "--repetition-penalty", "0")
    assert "repetition_penalty=0.0 must be > 0" in err


def test_a_refused_command_prints_no_note_first(tmp_path, capsys):
    """The notes on how a command would run (--compile with cropped decoding, the context cropped
    to max_seq_len) follow every check: a refusal is the one line printed."""
    tok = CharTokenizer.train(TEXT)
    _save(tmp_path / "learned", tok, pos_encoding="learned")
    _save(tmp_path / "rope", tok)
    for model, extra in (
        ("learned", ["--context", "65"]),  # past the learned positions
        ("learned", ["--seed", str(2**70)]),  # a seed no generator takes
        ("rope", ["--context", "65"]),  # a window past max_seq_len
        ("rope", ["--context", "65", "--stream"]),
    ):
        args = ["--checkpoint", str(tmp_path / model), "--prompt", TEXT[:60]]
        err = _fails(capsys, *args, "--max-new-tokens", "10", "--compile", *extra)
        assert "note:" not in err and err.count("\n") == 1, err
    # accepted, the same command says both notes
    assert main(["generate", *args, "--max-new-tokens", "10", "--compile"]) == 0
    err = capsys.readouterr().err
    assert "note: --compile compiles the cached decode step" in err and "max_seq_len (64)" in err


def test_past_max_seq_len(tmp_path, capsys):
    tok = CharTokenizer.train(TEXT)
    learned = _save(tmp_path / "learned", tok, pos_encoding="learned")
    prompt = TEXT[:60]
    args = ["--checkpoint", str(tmp_path / "learned"), "--prompt", prompt, "--temperature", "0"]
    # by default the context is cropped to max_seq_len, as nanoGPT samples, with a note
    assert main(["generate", *args, "--max-new-tokens", "10"]) == 0
    cap = capsys.readouterr()
    assert "(70) exceed the model's max_seq_len (64)" in cap.err and "last 64 tokens" in cap.err
    assert "--compile" not in cap.err
    ref = generate(learned, torch.tensor([tok.encode(prompt)]), 10, temperature=0, context=64)
    assert cap.out == tok.decode(ref[0].tolist()) + "\n"
    # --compile compiles the cached step, which cropped decoding does not take: said, not silent
    assert main(["generate", *args, "--max-new-tokens", "10", "--compile"]) == 0
    cap = capsys.readouterr()
    assert "note: --compile compiles the cached decode step; cropped decoding" in cap.err
    assert cap.out == tok.decode(ref[0].tolist()) + "\n"
    for mode in ([], ["--stream"]):  # --context 0: the whole sequence, which cannot fit
        err = _fails(capsys, *args, "--max-new-tokens", "5", "--context", "0", *mode)
        assert "= 65 is past max_seq_len=64" in err and "learned positions" in err
    err = _fails(capsys, *args, "--context", "65")
    assert "--context 65 is past the 64 learned positions" in err
    assert "--context must be >= 0" in _fails(capsys, *args, "--context", "-1")
    assert _run(capsys, *args, "--max-new-tokens", "4").startswith(prompt)  # 60 + 4 = 64 fits
    # RoPE runs on past the trained context with --context 0, and says so in one line
    _save(tmp_path / "rope", tok)
    args[1] = str(tmp_path / "rope")
    assert main(["generate", *args, "--max-new-tokens", "8", "--context", "0"]) == 0
    cap = capsys.readouterr()
    assert len(cap.out) == 60 + 8 + 1
    assert cap.err == (
        "note: generating 68 tokens past the trained context 64 (rope positions run on, but "
        "quality may drop)\n"
    )


def test_interactive_reports_a_bad_line_and_goes_on(ckpt, capsys, monkeypatch):
    path, model, tok = ckpt
    monkeypatch.setattr("sys.stdin", io.StringIO("Z\nto be\n"))  # 'Z' is not in the vocabulary
    args = ["--checkpoint", str(path), "--interactive", "--temperature", "0"]
    assert main(["generate", *args, "--max-new-tokens", "8"]) == 0
    cap = capsys.readouterr()
    assert "error: character 'Z'" in cap.err
    assert cap.out == _greedy_text(model, tok, "to be", 8)[len("to be") :] + "\n"


@pytest.mark.parametrize(
    "flags",
    [
        ["--temperature", "1e-40"],
        ["--temperature", "5e-324", "--top-k", str(10**30)],
        ["--temperature", "1e-300", "--top-p", "1e-300", "--stream"],
    ],
)
def test_a_tiny_temperature_generates_the_greedy_text(ckpt, capsys, flags):
    """logits / 1e-40 used to overflow (softmax NaN, a multinomial traceback); a tiny positive
    temperature is greedy in the limit, and that is what it prints."""
    path, model, tok = ckpt
    ids = torch.tensor([tok.encode("to be")])
    out = generate(model, ids, 20, temperature=0)
    with torch.no_grad():
        assert_decisive(model(out[:, :-1])[0][0, ids.shape[1] - 1 :], "greedy 'to be'")
    args = ["--checkpoint", str(path), "--prompt", "to be", "--max-new-tokens", "20"]
    assert _run(capsys, *args, "--seed", "1", *flags) == tok.decode(out[0].tolist()) + "\n"


def test_an_extreme_repetition_penalty_generates(ckpt, capsys):
    """--repetition-penalty 1e-40 used to turn seen logits into inf ("non-finite logits"): it
    saturates instead, and the command prints what the Python API generates."""
    path, model, tok = ckpt
    args = ["--checkpoint", str(path), "--prompt", "to be", "--max-new-tokens", "12"]
    for penalty in ("1e-40", "1e40"):
        ref = generate(model, torch.tensor([tok.encode("to be")]), 12, temperature=0,
                       repetition_penalty=float(penalty))  # fmt: skip
        out = _run(capsys, *args, "--temperature", "0", "--repetition-penalty", penalty)
        assert out == tok.decode(ref[0].tolist()) + "\n"


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--temperature", "inf"], "temperature=inf must be"),
        (["--temperature", "nan"], "temperature=nan must be"),
        (["--repetition-penalty", "inf"], "repetition_penalty=inf must be"),
        (["--seed", str(2**70), "--max-new-tokens", "5"], "seed=1180591620717411303424 must be"),
        (["--max-new-tokens", str(10**15), "--context", "0"], "KV cache would take"),
    ],
)
def test_extreme_flag_values_are_one_line_refusals(ckpt, capsys, flags, named):
    path, _, _ = ckpt
    err = _fails(capsys, "--checkpoint", str(path), "--prompt", "to be", *flags)
    assert named in err and err.count("\n") == 1, err


def test_a_long_bad_prompt_ids_value_is_cut_in_its_error(ckpt, capsys):
    err = _fails(capsys, "--checkpoint", str(ckpt[0]), "--prompt-ids", "x," * 10_000)
    assert len(err) < 300 and "(20,000 characters)" in err, err


def test_ctrl_c_in_any_command_is_one_line_and_exit_130(ckpt, capsys, monkeypatch):
    import llm_foundry.loading

    def interrupted(*args, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(llm_foundry.loading, "load_any", interrupted)
    assert main(["generate", "--checkpoint", str(ckpt[0]), "--prompt", "to"]) == 130
    assert (
        capsys.readouterr().err == "llm-foundry generate: stopped by SIGINT: before it finished\n"
    )
