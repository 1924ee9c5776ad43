"""The GPU as a first-class target (issue 30): training with bf16 autocast and torch.compile that
resumes bit for bit; decoding (cached = recomputed, the KV-cache paths, seeded sampling, the
compiled step); the serve engine's concurrent requests; LoRA on fp32, bf16 and int8 bases; MoE's
grouped experts; quantized layers; parity with HF transformers. Each runs on the device and is
checked against a reference computed in the test (a second code path, the CPU, transformers),
never against stored numbers.

The tests are marked ``cuda`` and take the ``device`` fixture (tests/conftest.py): CUDA, skipped
with the reason where torch sees no GPU. ``LLM_FOUNDRY_TEST_DEVICE=cpu`` (or ``--device cpu``)
runs the same tests on the CPU, to check their logic without a GPU. ``make test-gpu`` runs them;
with the dependencies installed but no .venv, from the repository's root:
``PYTHONPATH=src python3 -m pytest -q -m cuda tests/test_cuda.py``. Nothing here needs the
network, fastapi, openai, llama.cpp or datasets; transformers and peft only where named.

fp32 comparisons run with TF32 off (``exact_fp32``): a TF32 product keeps 10 mantissa bits and
moves logits by ~1e-3 relative, past every tolerance below. The tests that compile
(``fresh_dynamo``) start from an empty dynamo cache, so what ran before cannot use up its
recompile limit and leave them silently eager.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import signal
import string
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_decisive, make_trainer
from test_kv_cache import decision_logits, greedy_recompute

from llm_foundry.generate import generate, generate_batch, stream
from llm_foundry.models import Transformer
from llm_foundry.models.lora import add_lora, fold_lora, lora_layers
from llm_foundry.models.moe import experts_grouped, experts_loop, route
from llm_foundry.models.quant import (
    Int4Linear,
    Int8Linear,
    QuantLinear,
    dequantize_model,
    quantize_model,
)

cuda = pytest.mark.cuda


@pytest.fixture
def exact_fp32():
    """fp32 matrix products in full fp32 on CUDA (no TF32) for the test, the settings restored
    (global flags: set on the CPU too, where they change nothing)."""
    saved = (torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32,
             torch.backends.cudnn.allow_tf32)  # fmt: skip
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved[0])
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[1:]


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model(tiny_config, device, seed: int = 0, **fields) -> Transformer:
    """The tiny model of ``fields`` (eval mode) on ``device``: its weights drawn on the CPU after
    ``torch.manual_seed(seed)``, so the same seed gives the CPU the same model."""
    torch.manual_seed(seed)
    return Transformer(tiny_config(**fields)).to(device).eval()


def _tokens(shape, high: int, seed: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, high, shape, generator=g).to(device)


def _within(got: torch.Tensor, want: torch.Tensor, rel: float, what: str) -> None:
    """max |got - want| <= rel * max(1, max |want|)."""
    err = (got.float() - want.float()).abs().max().item()
    bound = rel * max(1.0, want.float().abs().max().item())
    assert err <= bound, f"{what}: max |diff| {err:.2e} > {bound:.2e}"


# ----------------------------------------------------------------------------------------------
# 1. Training: bf16 autocast + torch.compile, and an exact resume


def _metrics(run) -> tuple[dict, dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return ({r["step"]: r["loss"] for r in rows if "loss" in r},
            {r["step"]: r["val_loss"] for r in rows if "val_loss" in r})  # fmt: skip


@contextlib.contextmanager
def deterministic_algorithms():
    """``torch.use_deterministic_algorithms(True)`` for the block, restored after; yields the
    warnings of ops that have no deterministic kernel (warn_only: they still run)."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield caught
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def _nondeterministic(caught) -> list[str]:
    return sorted({str(w.message).splitlines()[0] for w in caught
                   if "deterministic" in str(w.message)})  # fmt: skip


def _train_config(device) -> dict:
    # auto: bf16 where the GPU multiplies it natively (compute capability >= 8.0); the CPU is
    # told bf16 outright (auto would measure it and may pick fp32)
    return dict(device=device.type, dtype="auto" if device.type == "cuda" else "bf16",
                compile=True, max_steps=6, eval_interval=3, checkpoint_interval=3,
                eval_batches=2, warmup_steps=2)  # fmt: skip


@cuda
def test_bf16_compiled_training_resumes_bit_for_bit(device, char_data, tmp_path, fresh_dynamo):
    """6 steps straight vs 3 steps stopped by SIGTERM (the checkpoint at step 3), resumed for 3
    more: the same losses, validation losses, weights and optimizer moments, bit for bit (TINY
    has dropout, so the RNG states must come back too).

    Under deterministic algorithms: inductor compiles the embedding's backward to a scatter-add
    with atomic adds (``index_put_(accumulate=True)``; tl.atomic_add on a GPU, threads on a CPU),
    whose order of fp32 additions, and so the last bits of the gradient, changes from run to run
    (measured on the CPU: two uninterrupted compiled runs end with other weights); so do the
    atomics of attention's backward kernels on a GPU. A resumed run can only be compared bit for
    bit in deterministic mode. Any op that still warns of a nondeterministic kernel is named in
    the failure. The trainer builds the RoPE tables before compiling: left to the first compiled
    step, dynamo traces a graph that builds them and a second that reads them, which round the
    bf16 step differently (measured on the CPU: 4.186511 vs 4.186520), and a resumed run would
    start on the first where the straight run is on the second."""
    from torch._dynamo.utils import counters

    data = char_data(60_000)
    cfg = _train_config(device)
    counters.clear()
    with deterministic_algorithms() as caught:
        straight = make_trainer(data, tmp_path / "straight", **cfg)
        assert straight.dtype == "bf16", straight.dtype_reason
        cos = getattr(straight.model.pos, "cos", None)  # RoPE: built for the block, not lazily
        assert cos is None or cos.shape[0] >= straight.tc.block_size
        assert straight.run().step == 6

        cut = make_trainer(data, tmp_path / "cut", **cfg)
        step = cut._train_step

        def stopped_after_the_third(*args, **kwargs):
            out = step(*args, **kwargs)
            if cut.step == 2:  # the third step: the trainer counts it once this returns
                signal.raise_signal(signal.SIGTERM)
            return out

        cut._train_step = stopped_after_the_third
        result = cut.run()
        assert (result.stopped_by, result.step) == ("SIGTERM", 3)
        resumed = make_trainer(data, tmp_path / "cut", resume=True, **cfg)
        assert resumed.step == 3 and resumed.dtype == "bf16"
        assert resumed.run().step == 6
    assert counters["stats"]["unique_graphs"] >= 2, dict(counters["stats"])  # compiled: train, eval
    assert all(p.dtype == torch.float32 and p.device.type == device.type
               for p in resumed.model.parameters())  # fmt: skip
    (loss_a, val_a), (loss_b, val_b) = _metrics(tmp_path / "straight"), _metrics(tmp_path / "cut")
    assert sorted(loss_a) == list(range(1, 7)) and sorted(val_a) == [3, 6]
    differ = []
    for what, a, b in (("train loss", loss_a, loss_b), ("validation loss", val_a, val_b)):
        if at := [k for k in a if a[k] != b.get(k)]:
            differ.append(
                f"{what} at step {at[0]}: {a[at[0]]!r} straight, {b.get(at[0])!r} resumed"
            )
    want, got = straight.model.state_dict(), resumed.model.state_dict()
    if weights := [k for k in want if not torch.equal(want[k], got[k])]:
        differ.append(f"{len(weights)} of {len(want)} weight tensors ({', '.join(weights[:3])}...)")
    opt_a, opt_b = straight.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    moments = [(i, k) for i in opt_a for k in ("exp_avg", "exp_avg_sq")
               if not torch.equal(opt_a[i][k], opt_b[i][k])]  # fmt: skip
    if moments:
        differ.append(f"{len(moments)} of {2 * len(opt_a)} optimizer moments")
    ops = _nondeterministic(caught)
    assert not differ, "; ".join(differ) + f"; ops without a deterministic kernel: {ops}"


@cuda
def test_each_attention_kernel_trains_as_pytorchs_choice_or_is_refused(device, char_data, tmp_path):
    """train.sdpa_backend on the card, bf16: a kernel that runs trains as PyTorch's own choice
    does (bf16 kernels round differently: 2% of the loss); one that cannot is refused in one
    line naming those that can, "auto" among them."""
    from llm_foundry.models.sdpa_kernels import SDPA_BACKENDS

    data, losses, refused = char_data(60_000), {}, {}
    cfg = dict(_train_config(device), compile=False, max_steps=3)
    for name in SDPA_BACKENDS:
        try:
            t = make_trainer(data, tmp_path / name, model=dict(dropout=0.0), sdpa_backend=name,
                             **cfg)  # fmt: skip
        except ValueError as e:
            refused[name] = str(e)
            continue
        losses[name] = [t._train_step()[0] for _ in range(3)]
        t.release()
    assert "auto" in losses and "math" in losses, refused
    for name, got in losses.items():
        assert got == pytest.approx(losses["auto"], rel=2e-2), name
    for msg in refused.values():
        assert "\n" not in msg and msg.endswith(", ".join(losses)), msg


@cuda
def test_a_non_finite_step_is_skipped_on_the_device_leaving_the_weights(device, char_data,
                                                                         tmp_path):  # fmt: skip
    """Fused AdamW on the card skips a step whose gradient norm is not finite (its found-inf
    flag) without the host looking first: weights, moments and step counts unchanged."""
    t = make_trainer(char_data(60_000), tmp_path / "run", on_nonfinite="skip",
                     **dict(_train_config(device), compile=False))  # fmt: skip
    t._train_step()
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    moments = {i: {k: v.clone() for k, v in st.items()} for i, st in t.optimizer.state.items()}
    first = next(iter(t.model.parameters()))
    real = t.forward

    def poisoned(x, y=None, **kw):
        logits, loss = real(x, y, **kw)
        return logits, loss * float("nan")

    t.forward = poisoned
    loss, norm, applied, _ = t._train_step()
    t.release()
    assert not applied and math.isnan(loss) and first.grad is None
    assert all(torch.equal(before[k], v) for k, v in t.model.state_dict().items())
    for p, st in t.optimizer.state.items():
        assert all(torch.equal(moments[p][k], v) for k, v in st.items())


# ----------------------------------------------------------------------------------------------
# 2. Generation: cached = recomputed, the KV-cache paths, seeded sampling, the compiled step

GREEDY_CASES = [("rope", 2, None), ("alibi", 4, 5), ("learned", 1, None), ("rope", 1, 5)]


@cuda
@pytest.mark.parametrize("pe, kv_heads, window", GREEDY_CASES)
def test_cached_greedy_equals_recompute_and_the_cpu(device, exact_fp32, tiny_config, pe,
                                                    kv_heads, window):  # fmt: skip
    """Greedy decoding through the KV cache picks the tokens that recomputing the whole sequence
    at every step picks, each choice decisive; the CPU, holding the same weights, picks them too."""
    model = _model(tiny_config, device, 1, pos_encoding=pe, n_kv_heads=kv_heads,
                   sliding_window=window)  # fmt: skip
    idx = _tokens((2, 6), 37, 1, device)
    with torch.no_grad():
        ref = greedy_recompute(model, idx, 25)
    assert_decisive(decision_logits(model, ref, 6), f"{pe}, {kv_heads} kv heads, window {window}")
    assert torch.equal(generate(model, idx, 25, temperature=0), ref)
    cpu = copy.deepcopy(model).cpu()
    with torch.no_grad():
        assert torch.equal(greedy_recompute(cpu, idx.cpu(), 25), ref.cpu())


@cuda
@pytest.mark.parametrize("pe, kv_heads, window", GREEDY_CASES)
def test_prefill_then_decode_logits_equal_the_full_forward(device, exact_fp32, tiny_config, pe,
                                                           kv_heads, window):  # fmt: skip
    model = _model(tiny_config, device, 0, pos_encoding=pe, n_kv_heads=kv_heads,
                   sliding_window=window)  # fmt: skip
    idx = _tokens((2, 20), 37, 0, device)
    with torch.no_grad():
        full = model(idx)[0]
        cache = model.new_cache(2, 32)
        assert cache.k[0].device.type == device.type
        parts = [model(idx[:, :7], cache=cache)[0]]  # prefill 7 (longer than the window)
        parts += [model(idx[:, t : t + 1], cache=cache)[0] for t in range(7, 20)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-4, rtol=0)


@cuda
@pytest.mark.parametrize("pe, window", [("rope", None), ("learned", None), ("rope", 4)])
def test_a_ragged_batch_equals_each_prompt_alone(device, exact_fp32, tiny_config, pe, window):
    """Left-padded rows (pad masks, per-row positions) decode what each prompt decodes alone."""
    model = _model(tiny_config, device, 0, pos_encoding=pe, n_kv_heads=2, sliding_window=window)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 37, (n,), generator=g).tolist() for n in (3, 9, 6)]
    batched = generate_batch(model, prompts, 12, temperature=0)
    for p, row in zip(prompts, batched, strict=True):
        alone = generate(model, torch.tensor([p], device=device), 12, temperature=0)
        assert_decisive(decision_logits(model, alone, len(p)), f"prompt of {len(p)}")
        assert row == alone[0].tolist()


@cuda
def test_seeded_sampling_is_reproducible_on_the_device(device, tiny_config):
    """A seed gives the same samples every time (the generator lives on the device), streamed
    or not, in every row; another seed gives others."""
    model = _model(tiny_config, device, 0)
    idx = _tokens((3, 4), 37, 2, device)
    kw = dict(temperature=0.9, top_k=20, top_p=0.95)
    out = generate(model, idx, 24, seed=5, **kw)
    assert out.device.type == device.type and out.shape == (3, 28)
    assert torch.equal(out[:, :4], idx) and int(out.min()) >= 0 and int(out.max()) < 37
    assert torch.equal(generate(model, idx, 24, seed=5, **kw), out)
    streamed = torch.stack(list(stream(model, idx, 24, seed=5, **kw)), 1)
    assert torch.equal(streamed, out[:, 4:])
    assert not torch.equal(generate(model, idx, 24, seed=6, **kw), out)
    assert len(set(out[:, 4:].flatten().tolist())) > 5, "sampling drew too few tokens to tell"


@cuda
def test_compiled_decoding_equals_eager(device, exact_fp32, tiny_config, fresh_dynamo):
    """The compiled one-token step (dynamic cache length; batch 1 through the fused matvec)
    decodes the eager tokens."""
    model = _model(tiny_config, device, 0, pos_encoding="rope", n_kv_heads=2, attn_bias=True)
    for batch in (1, 2):
        idx = _tokens((batch, 5), 37, batch, device)
        eager = generate(model, idx, 8, temperature=0)
        assert_decisive(decision_logits(model, eager, 5), f"batch {batch}")
        assert torch.equal(generate(model, idx, 8, temperature=0, compile=True), eager)


# ----------------------------------------------------------------------------------------------
# 3. The serve engine: concurrent requests, each what it gets alone

PROMPTS = ["ROMEO:", "JULIET: O", "To be, or not", "First Citizen:\nBefore we", "the", "What",
           "KING:", "Good morrow"]  # fmt: skip
LENGTHS = [40, 12, 30, 25, 8, 50, 17, 33]


@cuda
@pytest.mark.parametrize("cuda_graph", [False, True], ids=["eager", "cuda_graph"])
def test_the_engine_serves_concurrent_requests_each_as_alone(device, exact_fp32, cuda_graph):
    """The engine itself (no HTTP: serve/engine.py in this process, its loop in its own thread)
    with 4 slots and 8 requests from 8 threads: rows join, decode together, leave and are
    refilled; every greedy continuation equals ``generate`` of that prompt alone on the device.
    With ``cuda_graph`` every step is a replayed graph, one captured per batch size."""
    from llm_foundry.presets import get_preset
    from llm_foundry.serve.engine import Engine, Params, Sequence
    from llm_foundry.tokenizer import CharTokenizer

    tok = CharTokenizer.train(" \n" + string.ascii_letters + string.punctuation)
    torch.manual_seed(0)
    cfg = get_preset("llama-shakespeare-char", vocab_size=tok.vocab_size, n_layers=2, dim=64,
                     n_heads=4, n_kv_heads=2, max_seq_len=128)  # fmt: skip
    model = Transformer(cfg).to(device).eval()
    want = []
    for prompt, n in zip(PROMPTS, LENGTHS, strict=True):
        ids = torch.tensor([tok.encode(prompt)], device=device)
        out = generate(model, ids, n, temperature=0)
        assert_decisive(decision_logits(model, out, ids.shape[1]), f"{prompt!r} alone")
        want.append(out[0, ids.shape[1] :].tolist())

    engine = Engine(model, tok, slots=4, cuda_graph=cuda_graph)
    engine.warm_up()
    if cuda_graph and device.type == "cuda":  # elsewhere the static step runs uncaptured
        assert sorted(engine.static) == [1, 2, 4]
        assert all(d.graph is not None for d in engine.static.values())
    engine.start()

    def ask(i: int) -> tuple[list[int], str]:
        done, reason = threading.Event(), []

        def emit(kind, payload):
            if kind == "done":
                reason.append(payload)
                done.set()

        seq = Sequence(tok.encode(PROMPTS[i]), Params(max_tokens=LENGTHS[i], temperature=0), emit)
        engine.submit([seq])
        assert done.wait(300), f"request {i} unanswered"
        return seq.tokens, reason[0]

    try:
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(ask, range(8)))
    finally:
        engine.stop()
    assert [r for _, r in got] == ["length"] * 8
    for i, (tokens, _) in enumerate(got):
        assert tokens == want[i], f"request {i} ({PROMPTS[i]!r})"
    assert engine.stats.busy_slot_steps > engine.stats.decode_steps  # rows decoded together
    assert engine.busy() == 0 and engine.cache.k[0].device.type == device.type


# ----------------------------------------------------------------------------------------------
# 4. LoRA on fp32, bf16 and int8 bases

LORA_TARGETS = ("wq", "wv", "w2", "lm_head")


def _adapted(tiny_config, device, base_dtype: str) -> Transformer:
    from test_lora import _randomise

    model = _model(tiny_config, device, 0, n_kv_heads=2)
    add_lora(model, LORA_TARGETS, r=4, alpha=8, base_dtype=base_dtype)
    _randomise(model)  # B starts at zero: adapters that change the function
    return model


@cuda
@pytest.mark.parametrize("base_dtype", ["fp32", "bf16", "int8"])
def test_lora_on_the_device_equals_its_fold_and_the_cpu_and_learns(device, exact_fp32,
                                                                   tiny_config, base_dtype):  # fmt: skip
    model = _adapted(tiny_config, device, base_dtype)
    tensors = [*model.parameters(), *model.buffers()]
    assert all(t.device.type == device.type for t in tensors)
    held = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}[base_dtype]
    assert all(m.base.weight.dtype == held for m in lora_layers(model).values())
    idx = _tokens((2, 12), 37, 0, device)
    with torch.no_grad():
        adapted = model(idx)[0]
        folded = copy.deepcopy(model)
        assert len(fold_lora(folded)) == 2 * 3 + 1 and not lora_layers(folded)
        torch.testing.assert_close(folded(idx)[0], adapted, atol=1e-5, rtol=1e-5)
        # the same adapted model built on the CPU: the same frozen codes, the same function
        cpu = _adapted(tiny_config, "cpu", base_dtype)
        here = {k: v.cpu() for k, v in model.state_dict().items()}
        assert [k for k, v in cpu.state_dict().items() if not torch.equal(v, here[k])] == []
        torch.testing.assert_close(cpu(idx.cpu())[0], adapted.cpu(), atol=1e-5, rtol=1e-5)

    # a few steps under bf16 autocast move the adapters only and lower the loss
    model.train()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x, y = _tokens((4, 16), 37, 1, device), _tokens((4, 16), 37, 2, device)
    losses = []
    for _ in range(6):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(x, y)[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]) and p.dtype == frozen[n].dtype, n


# ----------------------------------------------------------------------------------------------
# 5. MoE: grouped experts equal the loop


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("D, H", [(32, 16), (6, 10)])  # one grouped product; the per-expert split
def test_grouped_experts_equal_the_loop_on_the_device(device, exact_fp32, dtype, D, H):
    """Outputs and gradients (x and every expert weight); expert 3 gets no token, which both
    paths must skip (an empty group of the grouped product). bf16 (the GPU's grouped kernel):
    both paths round products to bf16, so they agree to a few bf16 steps, not to fp32's."""
    g = torch.Generator().manual_seed(0)
    E, k, N = 5, 2, 23

    def leaf(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype).requires_grad_()

    x, w1, w2, w3 = leaf(N, D), leaf(E, H, D), leaf(E, D, H), leaf(E, H, D)
    logits = torch.randn(N, E, generator=g).to(device)
    logits[:, 3] = -50
    weights, ids = route(logits, k, True)
    assert not (ids == 3).any()
    probe = torch.linspace(-1, 1, N * D, device=device).view(N, D).to(dtype)
    outs, grads = [], []
    for path in (experts_loop, experts_grouped):
        y = path(x, weights, ids, w1, w2, w3, F.silu)
        assert y.dtype == dtype and y.device.type == device.type
        grads.append(torch.autograd.grad((y * probe).float().sum(), (x, w1, w2, w3)))
        outs.append(y.detach())
    # bf16: a product rounded one step otherwise moves y by ~1e-3 of its largest value
    rel_out, rel_grad = (1e-5, 1e-4) if dtype == torch.float32 else (2e-2, 5e-2)
    _within(outs[1], outs[0], rel_out, "grouped vs loop output")
    for name, a, b in zip(("x", "w1", "w2", "w3"), *grads, strict=True):
        _within(b, a, rel_grad, f"grouped vs loop gradient of {name}")


@cuda
def test_a_moe_model_computes_the_same_with_either_dispatch(device, exact_fp32, tiny_config):
    """``moe_dispatch`` grouped vs loop on one model's weights: logits, loss and gradients."""
    moe = dict(n_experts=4, experts_per_token=2, expert_hidden_dim=16, n_shared_experts=1)
    models = {d: _model(tiny_config, device, 0, moe_dispatch=d, **moe) for d in ("loop", "grouped")}
    assert all(torch.equal(a, b) for a, b in zip(*(m.state_dict().values() for m in
                                                   models.values()), strict=True))  # fmt: skip
    x, y = _tokens((2, 24), 37, 0, device), _tokens((2, 24), 37, 1, device)
    out = {}
    for d, model in models.items():
        logits, loss = model(x, y)
        loss.backward()
        out[d] = logits.detach(), loss.detach(), {n: p.grad for n, p in model.named_parameters()}
    _within(out["grouped"][0], out["loop"][0], 1e-5, "logits")
    _within(out["grouped"][1], out["loop"][1], 1e-5, "loss")
    for n, grad in out["loop"][2].items():
        _within(out["grouped"][2][n], grad, 1e-4, f"gradient of {n}")


# ----------------------------------------------------------------------------------------------
# 6. Quantized layers: on a GPU they compute with the widened weight (the CPU kernels are
# CPU-only and are not called there)


def _quant_model(device) -> Transformer:
    """A GPT-2-like model (biases on every projection, which the quantized layers hold too)."""
    from llm_foundry.config import ModelConfig

    cfg = ModelConfig(vocab_size=50, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64,
                      hidden_dim=192, attn_bias=True, mlp_bias=True)  # fmt: skip
    torch.manual_seed(0)
    return Transformer(cfg).to(device).eval()


@cuda
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_models_run_on_the_device_as_their_dequantized_weights(device, exact_fp32,
                                                                         scheme, tmp_path):  # fmt: skip
    """Quantized on the CPU and moved, or quantized on the device (``--quantize`` with
    ``--device cuda``): the same codes, everything on the device, the logits of the fp32 model
    holding the dequantized weights, a prompt and KV-cache decoding alike; saved and loaded back
    onto the device, the same."""
    from llm_foundry.checkpoint import load_checkpoint, save_checkpoint

    on_cpu = _quant_model("cpu")
    quantize_model(on_cpu, scheme, 32)
    here = _quant_model(device)
    settings = quantize_model(here, scheme, 32)
    assert "lm_head" in settings["layers"] and not settings["kept_fp32"]
    assert all(t.device.type == device.type for t in [*here.parameters(), *here.buffers()])
    codes = {k: v.cpu() for k, v in here.state_dict().items()}
    assert [k for k, v in on_cpu.state_dict().items() if not torch.equal(v, codes[k])] == []
    moved = copy.deepcopy(on_cpu).to(device)
    ref = dequantize_model(copy.deepcopy(here))
    assert not any(isinstance(m, QuantLinear) for m in ref.modules())
    idx = _tokens((2, 40), 50, 0, device)
    with torch.no_grad():
        want = ref(idx)[0]
        for model, what in ((here, "quantized here"), (moved, "quantized on the CPU, moved")):
            _within(model(idx)[0], want, 1e-5, f"{scheme} {what}")
        # the CPU: a prompt of 80 rows widens the weights there too
        _within(on_cpu(idx.cpu())[0], want.cpu(), 1e-5, f"{scheme} on the CPU")
        cache = here.new_cache(2, 64)
        here(idx[:, :20], cache=cache)
        steps = torch.cat([here(idx[:, t : t + 1], cache=cache)[0] for t in range(20, 40)], 1)
        # a GPU decodes with fp32 activations (the widened weight); the CPU's kernels take bf16
        # (cached vs full forward: 1e-4, as tests/test_kv_cache.py)
        _within(steps, want[:, 20:], 1e-4 if device.type == "cuda" else 0.02, f"{scheme} decode")
        save_checkpoint(here, tmp_path / "q")
        loaded = load_checkpoint(tmp_path / "q", device)
        assert any(isinstance(m, QuantLinear) for m in loaded.modules())
        assert torch.equal(loaded(idx)[0], here(idx)[0])


@pytest.mark.parametrize("cls", [Int8Linear, Int4Linear])
def test_a_quantized_layer_is_made_on_the_device_of_the_layer_it_replaces(cls):
    """No GPU needed: on the meta device, every tensor of the quantized layer (its bias too, made
    on the CPU before, which failed the first forward on a GPU) and of its dequantized
    replacement is where the original layer's weight is."""
    from llm_foundry.models.linear import Linear

    q = cls.from_linear(Linear(64, 32, bias=True, device="meta"), 32)
    assert {t.device.type for t in [*q.parameters(), *q.buffers()]} == {"meta"}
    model = torch.nn.Sequential(q)
    dequantize_model(model)
    assert type(model[0]) is Linear and {p.device.type for p in model.parameters()} == {"meta"}


# ----------------------------------------------------------------------------------------------
# 7. Parity with HF transformers in fp32 on the device

HF_NAMES = ["llama_gqa_tied", "gpt2"]


@cuda
@pytest.mark.parametrize("name", HF_NAMES)
def test_hf_parity_on_the_device(device, exact_fp32, name):
    """A tiny random HF model (Llama with GQA and tied embeddings; GPT-2), imported with
    ``from_hf`` as the CPU tests do, both moved to the device: logits within 1e-4 relative;
    greedy decoding through our KV cache equals HF ``generate`` on the device, each choice
    decisive."""
    pytest.importorskip("transformers")
    from test_generate import _hf_greedy, _lively
    from test_interop_hf import VOCAB, _hf_model

    from llm_foundry.interop.hf import from_hf

    hf = _hf_model(name)
    ours = from_hf(hf).to(device)
    hf = hf.to(device)
    x = _tokens((2, 17), VOCAB, 0, device)
    with torch.no_grad():
        want = hf(input_ids=x).logits
        _within(ours(x)[0], want, 1e-4, f"{name} logits")
    lively = _lively(name)  # matrices x 8: varied continuations, decisive choices
    ours = from_hf(lively).to(device)
    idx = _tokens((2, 7), VOCAB, 1, device)
    want = _hf_greedy(lively.to(device), idx)
    got = generate(ours, idx, want.shape[1] - 7, temperature=0)
    assert torch.equal(got, want), name
    assert len(set(want[:, 7:].flatten().tolist())) > 2, "a degenerate continuation proves little"
