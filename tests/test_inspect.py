"""`llm-foundry inspect`: every sub-command writes a real, non-blank PNG of a known size."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from llm_foundry.checkpoint import save_checkpoint
from llm_foundry.cli.inspect import main
from llm_foundry.config import ConfigError, ModelConfig
from llm_foundry.models import Transformer
from llm_foundry.plots import png_size
from llm_foundry.tokenizer import CharTokenizer
from llm_foundry.train.config import TrainConfig
from llm_foundry.train.schedule import lr_at

TEXT = "To be, or not to be, that is the question."


def assert_png(path, width, height):
    """A readable PNG of width x height pixels whose pixels are not all the same."""
    assert png_size(path) == (width, height)
    with Image.open(path) as im:
        assert im.size == (width, height)
        assert np.asarray(im.convert("RGB"), dtype=np.float32).var() > 0


def run_json(capsys, argv):
    assert main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.manual_seed(0)
    tok = CharTokenizer.train(TEXT)
    cfg = ModelConfig(vocab_size=tok.vocab_size, dim=32, n_layers=2, n_heads=2, max_seq_len=64)
    d = save_checkpoint(Transformer(cfg), tmp_path_factory.mktemp("ckpt"))
    tok.save(d / "tokenizer.json")
    return d


# ----------------------------------------------------------------------------------------------
def test_lr_plot_and_values(tmp_path, capsys):
    out = tmp_path / "lr.png"
    args = ["--train.schedule", "wsd", "--train.max_steps", "500", "--train.warmup_steps", "20"]
    rep = run_json(capsys, ["lr", *args, "--out", str(out)])
    assert_png(out, 800, 450)
    assert rep["path"] == str(out) and (rep["width"], rep["height"]) == (800, 450)
    cfg = TrainConfig(schedule="wsd", max_steps=500, warmup_steps=20)
    lrs = rep["lr"]["wsd"]  # keyed by step as training numbers them: 1..max_steps
    assert list(lrs) == [str(k) for k in range(1, 501)]
    assert lrs["1"] == pytest.approx(lr_at(0, cfg)) and lrs["500"] == pytest.approx(lr_at(499, cfg))
    assert lrs["1"] == pytest.approx(cfg.lr / 20) and lrs["20"] == pytest.approx(cfg.lr)
    assert lrs["500"] == pytest.approx(cfg.min_lr)  # wsd's last step trains at min_lr


def test_lr_compare_and_config_file(tmp_path, capsys):
    conf = tmp_path / "c.yaml"
    conf.write_text("train:\n  schedule: linear\n  max_steps: 50\n  warmup_steps: 0\n")
    out = tmp_path / "lr.png"
    rep = run_json(capsys, ["lr", "--config", str(conf), "--compare", "--out", str(out)])
    assert_png(out, 800, 450)
    assert set(rep["lr"]) == {"cosine", "linear", "constant", "wsd"}
    assert rep["train"]["schedule"] == "linear"
    cfg = TrainConfig(schedule="linear", max_steps=50, warmup_steps=0)
    assert rep["lr"]["linear"]["25"] == pytest.approx(lr_at(24, cfg))
    assert rep["lr"]["constant"]["50"] == pytest.approx(cfg.lr)


def test_lr_invalid_override():
    with pytest.raises(ConfigError, match="schedule='step'"):
        main(["lr", "--train.schedule", "step", "--out", "unused.png"])
    with pytest.raises(ValueError, match="--train.nope"):
        main(["lr", "--train.nope", "1"])


def test_attention_grid(ckpt, tmp_path, capsys):
    out = tmp_path / "att.png"
    argv = ["attention", "--checkpoint", str(ckpt), "--prompt", "to be", "--out", str(out)]
    assert main(argv) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    assert_png(out, 700, 650)  # 2 layers x 2 heads of 3-inch cells, at 100 dpi


def test_attention_one_head_json(ckpt, tmp_path, capsys):
    out = tmp_path / "att.png"
    argv = ["attention", "--checkpoint", str(ckpt), "--prompt", "not to be", "--out", str(out)]
    rep = run_json(capsys, argv + ["--layer", "1", "--head", "0"])
    assert_png(out, 650, 600)
    assert rep["tokens"] == list("not to be") and rep["layers"] == [1] and rep["heads"] == [0]
    w = np.array(rep["weights"])
    assert w.shape == (9, 9)
    assert np.allclose(w.sum(-1), 1, atol=1e-5) and np.allclose(np.triu(w, 1), 0)


def test_attention_errors(ckpt, tmp_path):
    base = ["attention", "--checkpoint", str(ckpt), "--prompt", "to be"]
    with pytest.raises(ValueError, match=r"--layer 2 is out of range.* 2 layers \(0\.\.1\)"):
        main(base + ["--layer", "2"])
    with pytest.raises(ValueError, match=r"--head -1 is out of range.* 2 heads \(0\.\.1\)"):
        main(base + ["--head", "-1"])
    with pytest.raises(FileNotFoundError, match="nowhere"):
        main(["attention", "--checkpoint", str(tmp_path / "nowhere")])
    with pytest.raises(ValueError, match="'z'"):  # not in the char vocabulary
        main(["attention", "--checkpoint", str(ckpt), "--prompt", "zzz"])


def test_attention_random_preset_without_tokenizer(tmp_path, capsys):
    out = tmp_path / "att.png"
    argv = ["attention", "--preset", "gpt2-shakespeare-char", "--model.n_layers", "1"]
    rep = run_json(capsys, argv + ["--prompt", "héllo", "--out", str(out)])
    assert_png(out, 1300, 350)  # 1 layer x all 4 heads
    assert rep["tokens"] == ["h", "\\xc3", "\\xa9", "l", "l", "o"]  # UTF-8 bytes as ids


def test_rope(tmp_path, capsys):
    out = tmp_path / "rope.png"
    argv = ["rope", "--model.head_dim", "16", "--model.rope_theta", "100", "--factor", "4"]
    rep = run_json(capsys, argv + ["--out", str(out)])
    assert_png(out, 1200, 450)
    assert set(rep["inv_freq"]) == {"none", "linear x4", "ntk x4"}
    none, lin = rep["inv_freq"]["none"], rep["inv_freq"]["linear x4"]
    assert len(none) == 8 and none[0] == pytest.approx(1.0) and lin[0] == pytest.approx(0.25)
    assert rep["wavelength"]["none"][1] == pytest.approx(2 * np.pi * 100 ** (2 / 16), rel=1e-5)
    assert rep["inv_freq"]["ntk x4"][0] == pytest.approx(1.0)  # NTK keeps the fastest pair


def test_sinusoidal(tmp_path, capsys):
    out = tmp_path / "sin.png"
    rep = run_json(capsys, ["sinusoidal", "--dim", "32", "--length", "50", "--out", str(out)])
    assert_png(out, 800, 500)
    assert len(rep["wavelength"]) == 16 and rep["wavelength"][0] == pytest.approx(2 * np.pi)
    with pytest.raises(ValueError, match="--dim 7 must be an even number"):
        main(["sinusoidal", "--dim", "7"])


def test_alibi(tmp_path, capsys):
    out = tmp_path / "alibi.png"
    rep = run_json(capsys, ["alibi", "--n-heads", "6", "--length", "10", "--out", str(out)])
    assert_png(out, 1300, 650)  # 4 columns x 2 rows
    assert rep["slopes"][:4] == pytest.approx([2**-2, 2**-4, 2**-6, 2**-8])
    assert rep["slopes"][4:] == pytest.approx([2**-1, 2**-3])


def test_default_out_and_dispatch(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["alibi", "--n-heads", "2", "--length", "4"]) == 0
    assert capsys.readouterr().out.strip() == "wrote inspect_alibi.png"
    assert_png(tmp_path / "inspect_alibi.png", 700, 350)
    assert main(["-h"]) == 0 and "sinusoidal" in capsys.readouterr().out
    with pytest.raises(ValueError, match="unknown inspect sub-command 'heads'; choose one of lr"):
        main(["heads"])


def test_out_gets_png_added_and_other_formats_are_refused(tmp_path, capsys, ckpt):
    rep = run_json(capsys, ["lr", "--out", str(tmp_path / "plain")])
    assert rep["path"] == str(tmp_path / "plain.png") and png_size(tmp_path / "plain.png")
    with pytest.raises(ValueError, match=r"plots are written as PNG; give a name ending in \.png"):
        main(["lr", "--out", str(tmp_path / "lr.svg")])
    with pytest.raises(ValueError, match="--length 0 must be >= 1"):
        main(["rope", "--length", "0", "--out", str(tmp_path / "r.png")])
    bpe = tmp_path / "big.json"  # a tokenizer with ids past the checkpoint's vocabulary
    CharTokenizer.train(TEXT + "".join(chr(c) for c in range(0x4E00, 0x4E40))).save(bpe)
    with pytest.raises(ValueError, match="has 80 tokens but the model's vocab_size is 16"):
        main(["attention", "--checkpoint", str(ckpt), "--tokenizer", str(bpe), "--prompt", "丿"])
    with pytest.raises(ValueError, match="token id 7., past the model's vocab_size 16"):
        main(["attention", "--preset", "llama-shakespeare-char", "--model.vocab_size", "16",
              "--tokenizer", str(bpe), "--prompt", "丿"])  # fmt: skip


def test_attention_of_an_hf_directory_equals_its_source_checkpoint(ckpt, tmp_path, capsys):
    """`inspect attention` reads the directory `convert --to-hf` writes (both given the source's
    character tokenizer with --tokenizer) and draws the same probabilities."""
    from llm_foundry.cli import main as cli

    hf = tmp_path / "hf"
    assert cli(["convert", "--to-hf", str(ckpt), "--out", str(hf)]) == 0
    capsys.readouterr()
    weights = []
    for source in (ckpt, hf):
        argv = ["attention", "--checkpoint", str(source), "--prompt", "not to be"]
        argv += ["--tokenizer", str(ckpt / "tokenizer.json"), "--out", str(tmp_path / "a.png")]
        rep = run_json(capsys, argv + ["--layer", "1", "--head", "1"])
        assert rep["source"] == str(source) and rep["tokens"] == list("not to be")
        weights.append(np.array(rep["weights"]))
    assert weights[0].shape == (9, 9)
    np.testing.assert_allclose(weights[1], weights[0], atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Refusals: one line naming the flag, the value and what is valid


def cli_error(capsys, argv) -> str:
    """The one stderr line of ``llm-foundry inspect ...`` refused with exit status 2."""
    from llm_foundry.cli import main as cli

    assert cli(["inspect", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "usage:" not in err, err
    return err


def test_heatmaps_are_bounded_by_their_cells_with_the_largest_valid_value(
    tmp_path, capsys, monkeypatch
):
    """An ALiBi plot of 100,000 positions would allocate 75 GiB; each heatmap (ALiBi's heads x
    length x length, the sinusoidal table, RoPE's cos table) is refused past MAX_CELLS with the
    largest value that fits, and that value draws. A small cap keeps the drawing fast."""
    import llm_foundry.cli.inspect as inspect_cli

    monkeypatch.setattr(inspect_cli, "MAX_CELLS", 200)
    out = str(tmp_path / "h.png")
    for argv, bound in (
        (["alibi", "--n-heads", "2", "--length", "11"], "at --n-heads 2 give --length at most 10"),
        (["sinusoidal", "--dim", "8", "--length", "26"], "at --dim 8 give --length at most 25"),
        (["sinusoidal", "--dim", "202", "--length", "1"], "give --dim at most 200"),
        (["rope", "--model.head_dim", "16", "--length", "26"], "give --length at most 25"),
    ):
        err = cli_error(capsys, [*argv, "--out", out])
        assert "past the 200 a heatmap draws" in err and err.endswith(bound), err
    for argv in (
        ["alibi", "--n-heads", "2", "--length", "10"],
        ["sinusoidal", "--dim", "8", "--length", "25"],
        ["rope", "--model.head_dim", "16", "--length", "25"],
    ):
        assert main([*argv, "--out", out]) == 0
    assert "--n-heads 129 must be 1..128" in cli_error(capsys, ["alibi", "--n-heads", "129"])


@pytest.mark.parametrize("factor", ["0", "nan", "inf", "-2", "0.5"])
def test_rope_factor_outside_one_to_infinity_is_refused(factor, tmp_path, capsys):
    """0 and NaN used to pass (``or`` took 0 for no factor; NaN fails every comparison) and the
    plot silently lacked its scaling curves."""
    err = cli_error(capsys, ["rope", "--factor", factor, "--out", str(tmp_path / "r.png")])
    assert f"--factor {float(factor):g} must be a finite number >= 1" in err
    assert not (tmp_path / "r.png").exists()


@pytest.mark.parametrize("flag", [["--model.n_layers", "1"], ["--model.n_heads", "3"]])
def test_attention_of_a_checkpoint_refuses_model_flags(ckpt, tmp_path, capsys, flag):
    """The checkpoint's own config (2 layers of 2 heads, dim 32) is what is drawn; a
    --model.* flag is refused, not ignored or checked against the library's defaults."""
    argv = ["attention", "--checkpoint", str(ckpt), *flag, "--out", str(tmp_path / "a.png")]
    err = cli_error(capsys, argv)
    assert err.endswith(
        f"{flag[0]}: --model.* and --config apply to --preset; a checkpoint has its own config"
    )
    assert not (tmp_path / "a.png").exists()


def test_out_and_run_paths_are_refused_naming_the_flag(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "insp").mkdir()
    (tmp_path / "insp" / "afile").write_text("")
    for out, want in (
        ("insp", "--out insp is a directory: give a .png file path"),
        ("insp/", "--out insp/ is a directory: give a .png file path"),
        ("", "--out is empty: give a .png file path"),
        ("insp/afile/x.png", "--out insp/afile/x.png: insp/afile is a file, not a directory"),
    ):
        assert want in cli_error(capsys, ["lr", "--out", out])
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["afile", "insp"]  # nothing written
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    for what in ("dynamics", "experts"):
        err = cli_error(capsys, [what, "--run", "run/metrics.jsonl"])
        assert (
            "--run run/metrics.jsonl is a file: give the run directory that holds it (run)" in err
        )


@pytest.mark.parametrize(
    "argv, want",
    [
        (["sinusoidal", "--dim", "x"], "inspect sinusoidal: argument --dim: invalid int value"),
        (["alibi", "--heads", "2"], "inspect alibi: unrecognized arguments: --heads 2"),
        (["dynamics"], "inspect dynamics: the following arguments are required: --run"),
        (["experts", "--run"], "inspect experts: argument --run: expected one argument"),
        ([], "inspect needs a sub-command: one of lr, attention, rope, sinusoidal, alibi, dyn"),
    ],
)
def test_usage_errors_are_one_line_with_status_2(argv, want, capsys):
    assert want in cli_error(capsys, argv)
