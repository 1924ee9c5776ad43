"""Weight-only int8/int4 quantization (models/quant.py, quantize.py, `llm-foundry quantize`).

The reference of a quantized layer is the fp32 layer holding its dequantized weight: the layer
must compute what that weight computes (exactly up to summation order where activations stay
fp32, within bf16 rounding of the activations where the CPU kernels take bf16), and the
quantized weight must be within half a step of the original."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import SHAKESPEARE, assert_decisive, make_trainer, tiny_hf_llama

from llm_foundry.checkpoint import read_safetensors_header
from llm_foundry.cli import main
from llm_foundry.config import ModelConfig
from llm_foundry.loading import load_any
from llm_foundry.models import Transformer
from llm_foundry.models.linear import Linear
from llm_foundry.models.quant import (
    KERNEL_ROWS,
    Int4Linear,
    Int8Linear,
    QuantLinear,
    dequantize_int4,
    dequantize_model,
    quantize_int4,
    quantize_int8,
    quantize_model,
    unpack_int4,
    weight_bytes,
)

# bf16 keeps 8 significant bits: activations rounded on the way into a kernel (and its bf16
# output) move a product by at most ~2^-8 of the sum of |x_i w_i|; a margin of 4 on that
BF16_REL = 4 * 2**-8

# the one refusal of a `quantize` output wherever full-precision weights are needed
QUANTIZED = "is quantized already (int8 weights, written by `llm-foundry quantize`); give the full"


def _linear(n_in: int, n_out: int, bias: bool = False, seed: int = 0) -> Linear:
    torch.manual_seed(seed)
    lin = Linear(n_in, n_out, bias=bias)
    lin.init_weights(0.05)
    if bias:
        torch.nn.init.normal_(lin.bias, std=0.1)
    return lin


def test_int4_stays_within_half_a_step_of_each_weight():
    torch.manual_seed(0)
    w = torch.randn(48, 256) * torch.rand(48, 1) * 3  # rows of very different ranges
    for group in (32, 64, 128):
        packed, scale, zero = quantize_int4(w, group)
        assert packed.dtype == torch.uint8 and packed.shape == (48, 128)
        assert scale.dtype == zero.dtype == torch.bfloat16 and scale.shape == (48, 256 // group)
        err = (w - dequantize_int4(packed, scale, zero)).reshape(48, -1, group).abs().amax(-1)
        # half a step, plus what rounding the grid's zero and step to bf16 can shift its ends by
        bound = scale.float() / 2 * (1 + 2**-7) + zero.float().abs() * 2**-8 + 16 * 2**-8 * scale
        assert (err <= bound).all(), f"group {group}: {(err - bound).max():.2e} over"
        # a 4-bit grid over each group's range: the error is ~1/30 of the range, not less
        assert err.max() > scale.float().max() / 4


def test_scales_are_true_quotients_so_every_device_gets_the_same_codes():
    """absmax / 127 and (max - min) / 15 rounded once, as float64 division rounded to fp32 gives:
    a product with the reciprocal (what CUDA computes for a Python divisor) is an ulp off for a
    few percent of rows, and the device's codes then differ from the CPU's."""
    torch.manual_seed(0)
    w = torch.randn(4096, 64) * torch.rand(4096, 1) * 3
    _, scale = quantize_int8(w)
    absmax = w.abs().amax(1).double()
    assert torch.equal(scale, (absmax / 127).float())
    assert not torch.equal(scale, absmax.float() * (1 / 127))  # the rows it decides exist here
    _, scale4, _ = quantize_int4(w, 32)
    g = w.double().reshape(4096, 2, 32)
    assert torch.equal(scale4, ((g.amax(-1) - g.amin(-1)).float() / 15).to(torch.bfloat16))


def test_int4_codes_are_two_per_byte_in_input_order():
    codes = torch.randint(0, 16, (16, 64), dtype=torch.int32)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    assert torch.equal(unpack_int4(packed), codes)
    assert packed[0, 0] == codes[0, 0] + 16 * codes[0, 1]


# 170 inputs: torch 2.13's int8 kernel reads garbage past the last multiple of 16 unless padded
@pytest.mark.parametrize("cls, n_in", [(Int8Linear, 128), (Int8Linear, 170), (Int4Linear, 128)])
@pytest.mark.parametrize("rows", [1, 3, 20, KERNEL_ROWS])
def test_a_quantized_projection_computes_with_its_dequantized_weight(cls, n_in, rows):
    lin = _linear(n_in, 80, bias=True)  # 80 rows: int4 pads them to the kernel's block of 16
    q = cls.from_linear(lin, 32)
    torch.manual_seed(1)
    x = torch.randn(2, rows, n_in) if rows > 1 else torch.randn(1, 1, n_in)
    deq = q.dequantized()
    with torch.no_grad():
        y = q(x)
        for _ in range(10):  # the unpadded kernel went wrong in ~1 call of 3
            assert torch.equal(q(x), y)
        exact = F.linear(x, deq, lin.bias)
        scale = (x.abs() @ deq.abs().T).max().item()  # sum of |x_i w_i|: what rounding scales with
        if x.shape[:-1].numel() >= KERNEL_ROWS:  # fp32 activations: summation order only
            assert (y - exact).abs().max().item() <= 1e-5 * scale
        else:  # the CPU kernels: activations rounded to bf16
            assert (y - exact).abs().max().item() <= BF16_REL * scale
            rounded = F.linear(x.bfloat16().float(), deq, lin.bias)
            assert (y - rounded).abs().max() < (y - exact).abs().max() + BF16_REL * scale
    assert y.shape == (*x.shape[:-1], 80)
    # and the weight itself is the original to within half a step of its scale
    err = (deq - lin.weight).abs().max().item()
    assert err <= (lin.weight.abs().max().item() / (127 if cls is Int8Linear else 7.5)) * 0.51


def test_quantized_layers_hold_a_quarter_and_an_eighth_of_the_bytes():
    lin = _linear(256, 512)
    fp32 = lin.weight.numel() * 4
    assert Int8Linear.from_linear(lin).weight_bytes() == lin.weight.numel() + 512 * 4
    for group in (32, 64, 128):  # 4 bits per weight plus a bf16 scale and zero per group
        assert Int4Linear.from_linear(lin, group).weight_bytes() == fp32 / 8 * (1 + 8 / group)


def _model(**fields) -> Transformer:
    cfg = dict(vocab_size=50, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64,
               hidden_dim=192)  # fmt: skip
    torch.manual_seed(0)
    return Transformer(ModelConfig(**{**cfg, **fields})).eval()


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("tied", [False, True])
def test_a_quantized_model_computes_what_its_dequantized_weights_compute(scheme, tied):
    """Prompt (fp32 rows) and KV-cache decoding (kernel rows) against the fp32 model holding the
    dequantized weights, token by token (teacher-forced: no greedy choice involved)."""
    model = _model(tie_embeddings=tied)
    settings = quantize_model(model, scheme, 32)
    assert "lm_head" in settings["layers"] and not settings["kept_fp32"]
    assert all(isinstance(model.get_submodule(n), QuantLinear) for n in settings["layers"])
    ref = dequantize_model(copy.deepcopy(model))
    assert not any(isinstance(m, QuantLinear) for m in ref.modules())
    idx = torch.randint(0, 50, (2, 40))  # 80 rows: the prompt path widens the weights
    with torch.no_grad():
        want = ref(idx)[0]
        assert (model(idx)[0] - want).abs().max().item() <= 1e-5 * (1 + want.abs().max().item())
        cache = model.new_cache(2, 64)
        model(idx[:, :20], cache=cache)
        steps = torch.cat([model(idx[:, t : t + 1], cache=cache)[0] for t in range(20, 40)], 1)
    err = (steps - want[:, 20:]).abs().max().item()
    assert 0 < err <= 0.02 * want.abs().max().item(), err  # bf16 activations while decoding


def test_routers_and_embeddings_stay_fp32_experts_too():
    model = _model(n_experts=4, experts_per_token=2)
    settings = quantize_model(model, "int8")
    assert not any("router" in n for n in settings["layers"])
    assert isinstance(model.tok_emb.weight, torch.nn.Parameter)
    assert model.tok_emb.weight.dtype == torch.float32
    moe = next(m for n, m in model.named_modules() if n.endswith("mlp"))
    assert moe.w1.dtype == torch.float32


def test_a_quantized_checkpoint_is_safetensors_marked_in_config_and_loads_exactly(tmp_path):
    from llm_foundry.checkpoint import load_checkpoint, save_checkpoint

    idx = torch.randint(0, 50, (1, 12))
    for scheme, dtype in (("int8", "I8"), ("int4", "U8")):
        model = _model()
        full = weight_bytes(model)
        quantize_model(model, scheme, 64)
        out = save_checkpoint(model, tmp_path / scheme)
        meta = json.loads((out / "config.json").read_text())
        assert meta["quantization"]["scheme"] == scheme
        assert len(meta["quantization"]["layers"]) == 2 * 7 + 1
        header = json.loads(
            (out / "model.safetensors").read_bytes()[8 : 8 + int.from_bytes(
                (out / "model.safetensors").read_bytes()[:8], "little")]
        )  # fmt: skip
        assert header["layers.0.attn.wq.qweight"]["dtype"] == dtype
        assert "layers.0.attn.wq.weight" not in header
        assert set(read_safetensors_header(out / "model.safetensors")) == set(model.state_dict())
        back = load_checkpoint(out)
        with torch.no_grad():
            assert torch.equal(back(idx)[0], model(idx)[0])
        ratio = full / weight_bytes(back)
        assert ratio > (3.5 if scheme == "int8" else 6), ratio


def test_a_bad_quantization_entry_is_named(tmp_path):
    from llm_foundry.checkpoint import load_checkpoint, save_checkpoint

    model = _model()
    quantize_model(model, "int4", 64)
    out = save_checkpoint(model, tmp_path / "q")
    meta = json.loads((out / "config.json").read_text())
    for bad in ({**meta["quantization"], "scheme": "int3"}, {**meta["quantization"], "group_size": 48}, "int8"):  # fmt: skip
        (out / "config.json").write_text(json.dumps({**meta, "quantization": bad}))
        with pytest.raises(ValueError, match="'quantization' is") as e:
            load_checkpoint(out)
        assert "\n" not in str(e.value) and "config.json" in str(e.value)


def test_bad_requests_are_refused():
    model = _model()
    with pytest.raises(ValueError, match="int3.*int8, int4"):
        quantize_model(model, "int3")
    with pytest.raises(ValueError, match="group size 48"):
        quantize_model(model, "int4", 48)
    quantize_model(model, "int8")
    with pytest.raises(ValueError, match="quantized already"):
        quantize_model(model, "int4")
    # a projection whose inputs are not whole groups stays fp32, and is listed
    settings = quantize_model(_model(hidden_dim=170), "int4", 32)
    assert settings["kept_fp32"] == ["layers.0.mlp.w2", "layers.1.mlp.w2"]


# ----------------------------------------------------------------------------------------------
# A trained model: quality, the command line, compiled decoding


@pytest.fixture(scope="module")
def trained(tmp_path_factory, char_data):
    """A small char model trained on tiny Shakespeare (val loss ~2.2 after 300 steps)."""
    from llm_foundry.train.config import TrainConfig
    from llm_foundry.train.trainer import Trainer

    out = tmp_path_factory.mktemp("trained") / "run"
    model = ModelConfig(vocab_size=65, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                        hidden_dim=192, max_seq_len=64)  # fmt: skip
    train = TrainConfig(max_steps=300, batch_size=16, block_size=32, lr=3e-3, eval_interval=300,
                        eval_batches=4, checkpoint_interval=300, warmup_steps=20,
                        sample_tokens=0, progress=False)  # fmt: skip
    Trainer(model, train, char_data(300_000), out).run()
    return out


def _val_loss(model, data_dir) -> float:
    import numpy as np

    ids = torch.from_numpy(
        np.fromfile(data_dir / "val.bin", dtype=np.uint16)[:4097].astype("int64")
    )
    windows = ids[: 4096 // 32 * 32 + 1]
    x, y = windows[:-1].reshape(-1, 32), windows[1:].reshape(-1, 32)
    with torch.no_grad():
        return model(x, y)[1].item()


def test_quantized_perplexity_is_close_to_fp32_on_a_trained_model(trained, char_data):
    if not SHAKESPEARE.exists():
        pytest.skip(f"{SHAKESPEARE} not found")
    data = char_data(300_000)
    full = load_any(trained).model
    base = _val_loss(full, data)
    assert base < 2.6  # it learned something: uniform over 65 chars is 4.17
    for scheme, rel in (("int8", 0.005), ("int4", 0.05)):
        q = load_any(trained, quantize=scheme, group_size=32).model
        loss = _val_loss(q, data)
        assert abs(math.exp(loss) / math.exp(base) - 1) < rel, (scheme, loss, base)


def test_quantize_command_writes_a_checkpoint_generate_reads(trained, tmp_path, capsys):
    out = tmp_path / "q8"
    assert main(["quantize", "--checkpoint", str(trained), "--to", "int8", "--out", str(out), "--json"]) == 0  # fmt: skip
    done = json.loads(capsys.readouterr().out)
    assert (
        done["scheme"] == "int8"
        and done["file_bytes"] == (out / "model.safetensors").stat().st_size
    )
    assert done["weight_bytes_per_token"]["before"] / done["weight_bytes_per_token"]["after"] > 3
    assert (out / "tokenizer.json").exists()
    args = ["--prompt", "ROMEO:", "--max-new-tokens", "20", "--temperature", "0", "--json"]
    assert main(["generate", "--checkpoint", str(out), *args]) == 0
    from_file = json.loads(capsys.readouterr().out)
    assert main(["generate", "--checkpoint", str(trained), "--quantize", "int8", *args]) == 0
    in_memory = json.loads(capsys.readouterr().out)
    assert from_file["new_ids"] == in_memory["new_ids"] and from_file["new_tokens"] == 20
    # a quantized checkpoint is not exported to HF, not quantized again, and not trained
    assert main(["convert", "--to-hf", str(out), "--out", str(tmp_path / "hf")]) == 2
    assert "convert --to-hf: " in (err := capsys.readouterr().err) and QUANTIZED in err
    assert main(["quantize", "--checkpoint", str(out), "--to", "int4", "--out", str(tmp_path / "x")]) == 2  # fmt: skip
    assert "quantize: " in (err := capsys.readouterr().err) and QUANTIZED in err


def test_a_quantized_checkpoint_cannot_start_training(trained, tmp_path, char_data):
    out = tmp_path / "q4"
    main(["quantize", "--checkpoint", str(trained), "--to", "int4", "--out", str(out)])
    with pytest.raises(
        ValueError, match="train.init_from: .* is quantized already \\(int4 weights"
    ):
        make_trainer(char_data(300_000), tmp_path / "ft", init_from=str(out))


def test_an_hf_model_quantized_keeps_its_tokenizer_and_end_of_sequence(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    hf = tiny_hf_llama(vocab_size=64, hidden_size=64, intermediate_size=128, eos_token_id=3,
                       max_position_embeddings=2048)  # fmt: skip
    hf.save_pretrained(tmp_path / "hf")
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(64)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "hf" / "tokenizer.json"))
    out = tmp_path / "q4"
    assert main(["quantize", "--checkpoint", str(tmp_path / "hf"), "--to", "int4", "--group-size", "32", "--out", str(out)]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "15 projections quantized" in printed and "less" in printed
    loaded = load_any(out)
    assert loaded.info.kind == "llm-foundry" and 3 in loaded.info.eos_ids
    assert loaded.tokenizer.encode("w5 w7") == [5, 7]
    ref = dequantize_model(copy.deepcopy(loaded.model))
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    idx = torch.randint(0, 64, (4, 24))  # 96 rows: the prompt path, fp32 activations
    with torch.no_grad():  # the quantized model is its dequantized weights, and near the original
        got, want, orig = loaded.model(idx)[0], ref(idx)[0], hf(idx).logits
    assert (got - want).abs().max() <= 1e-5 * (1 + want.abs().max())
    assert (got - orig).abs().max() < 0.2 * orig.abs().max()


@pytest.mark.heavy
def test_compiled_int8_decoding_reads_fp32_activations(trained):
    """The compiled one-token step takes the fused int8 path with fp32 activations: its greedy
    tokens are those of the fp32 model holding the dequantized weights (each choice decisive)."""
    from llm_foundry.generate import generate

    model = load_any(trained, quantize="int8").model
    ref = dequantize_model(copy.deepcopy(model))
    idx = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    want = generate(ref, idx, 24, temperature=0)
    with torch.no_grad():
        assert_decisive(ref(want[:, :-1])[0][:, idx.shape[1] - 1 :], "dequantized reference")
    got = generate(model, idx, 24, temperature=0, compile=True)
    assert torch.equal(got, want)


def test_misused_flags_are_refused_before_anything_is_written(trained, tmp_path, capsys):
    """An --out that holds anything (the source itself, above all) is never written into, and a
    flag that would be ignored is refused instead."""
    before = {p: p.stat().st_mtime_ns for p in trained.rglob("*") if p.is_file()}
    for argv, message in [
        (["quantize", "--checkpoint", str(trained), "--to", "int8", "--out", str(trained)],
         "is not empty; give a new directory"),
        (["quantize", "--checkpoint", str(trained), "--to", "int8", "--group-size", "32",
          "--out", str(tmp_path / "q")], "--group-size 32 applies to --to int4 only"),
        (["generate", "--checkpoint", str(trained), "--group-size", "32", "--prompt", "R"],
         "--group-size 32 applies to --quantize int4 only"),
        (["convert", "--from-hf", str(trained), "--out", str(tmp_path / "x"), "--outtype", "q8_0"],
         "--outtype q8_0 applies to --to-gguf only"),
    ]:  # fmt: skip
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    assert {p: p.stat().st_mtime_ns for p in trained.rglob("*") if p.is_file()} == before
    assert not (tmp_path / "q").exists()
