"""The static decode step (``llm_foundry.decode_graph``, ``generate(..., cuda_graph=True)``):
fixed shapes, the position in a device tensor, the whole cache read under a mask. On the CPU it
runs eagerly: its logits equal the cached step's and the uncached forward's (fp32, 1e-5
relative) and its greedy tokens theirs, for every position scheme, GQA/MQA, sliding windows,
batch 1 and a left-padded batch of 3. The tests marked ``cuda`` capture it as a CUDA graph: the
replay equals the eager static step bit for bit, greedy tokens equal the default path's in fp32,
bf16 runs, a graph is reused and recaptured when it must be, and two live generations do not
share one."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import assert_decisive

from llm_foundry import decode_graph
from llm_foundry.decode_graph import StaticDecoder
from llm_foundry.generate import generate, generate_batch, stream
from llm_foundry.models import Transformer
from llm_foundry.models.position import RotaryPosition

REL = 1e-5
CASES = {  # name: (pos_encoding, n_kv_heads, sliding_window, other fields)
    "llama_gqa": ("rope", 2, None, {}),
    "llama_window": ("rope", 2, 5, {}),
    "qwen_parallel_mqa": ("rope", 1, None, dict(qk_norm=True, attn_bias=True, parallel_block=True)),
    "gpt2_learned": ("learned", 4, None, dict(norm="layernorm", mlp="gelu")),
    "alibi": ("alibi", 4, None, {}),
    "alibi_window": ("alibi", 4, 5, {}),
    "sinusoidal_mqa": ("sinusoidal", 1, None, {}),
    "nope": ("none", 4, None, {}),
}
PADS = {1: [0], 3: [0, 4, 2]}  # left padding per row of each batch size tried


def _model(tiny_config, name: str, seed: int = 0, device="cpu") -> Transformer:
    pe, kv, window, extra = CASES[name]
    torch.manual_seed(seed)
    cfg = tiny_config(pos_encoding=pe, n_kv_heads=kv, sliding_window=window, **extra)
    return Transformer(cfg).to(device).eval()


def _within(got: torch.Tensor, want: torch.Tensor, what: str, rel: float = REL) -> None:
    """max |got - want| <= rel * max(1, max |want|)."""
    err = (got.float() - want.float()).abs().max().item()
    bound = rel * max(1.0, want.float().abs().max().item())
    assert err <= bound, f"{what}: max |diff| {err:.2e} > {bound:.2e}"


def _quiet(fn, *args, **kw):
    """``fn`` with the CPU's 'no CUDA graphs' note silenced (asserted once, below)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="cuda_graph=True: no CUDA graphs")
        return fn(*args, **kw)


@torch.no_grad()
def _teacher_forced(model, seq, prompt, pad, static: bool) -> torch.Tensor:
    """Logits (B, n, V) predicting seq[:, prompt:] after a prefill of ``prompt`` tokens, fed one
    token a step through the static step or the ordinary cached one."""
    B, total = seq.shape
    if static:
        dec = StaticDecoder(model, B, total)
        out = [dec.prefill(seq[:, :prompt], pad)]
        out += [dec.step(seq[:, t : t + 1]) for t in range(prompt, total - 1)]
    else:
        cache = model.new_cache(B, total)
        cache.pad = pad
        out = [model(seq[:, :prompt], cache=cache, last_only=True)[0][:, -1]]
        for t in range(prompt, total - 1):
            out.append(model(seq[:, t : t + 1], cache=cache, last_only=True)[0][:, -1])
    return torch.stack(out, dim=1)


@torch.no_grad()
def _uncached(model, seq, prompt, pads) -> torch.Tensor:
    """The same logits from full forwards, each row alone without its padding."""
    rows = [model(seq[b : b + 1, p:])[0][0, prompt - p - 1 : -1] for b, p in enumerate(pads)]
    return torch.stack(rows)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_static_step_logits_equal_cached_and_uncached(tiny_config, name, batch):
    model = _model(tiny_config, name)
    g = torch.Generator().manual_seed(batch)
    seq = torch.randint(0, 37, (batch, 26), generator=g)  # prompt 8 (longer than a window) + 18
    pads = PADS[batch]
    pad = torch.tensor(pads) if any(pads) else None
    static = _teacher_forced(model, seq, 8, pad, static=True)
    cached = _teacher_forced(model, seq, 8, pad, static=False)
    _within(static, cached, f"{name}: static vs cached step")
    _within(static, _uncached(model, seq, 8, pads), f"{name}: static step vs full forward")


def greedy_recompute(model, idx, n):
    for _ in range(n):
        idx = torch.cat([idx, model(idx)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    return idx


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_equals_cached_and_recompute(tiny_config, name):
    model = _model(tiny_config, name, seed=1)
    idx = torch.randint(0, 37, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = greedy_recompute(model, idx, 25)
        assert_decisive(model(ref[:, :-1])[0][:, 5:], name)
    assert torch.equal(generate(model, idx, 25, temperature=0), ref)
    assert torch.equal(_quiet(generate, model, idx, 25, temperature=0, cuda_graph=True), ref)


@pytest.mark.parametrize("name", ["llama_gqa", "llama_window", "gpt2_learned", "alibi"])
def test_padded_batch_equals_each_prompt_alone(tiny_config, name):
    model = _model(tiny_config, name)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 37, (n,), generator=g).tolist() for n in (3, 9, 6)]
    got = _quiet(generate_batch, model, prompts, 12, temperature=0, cuda_graph=True)
    assert got == generate_batch(model, prompts, 12, temperature=0)
    for p, row in zip(prompts, got, strict=True):
        assert row == generate(model, torch.tensor([p]), 12, temperature=0)[0].tolist()


def test_sampling_penalties_and_eos_act_on_the_static_logits(tiny_config):
    """Sampling stays outside the step: a seed gives the default path's tokens."""
    model = _model(tiny_config, "llama_gqa")
    idx = torch.randint(0, 37, (3, 5), generator=torch.Generator().manual_seed(0))
    kw = dict(temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.3, seed=7, eos_id=3)
    want = generate(model, idx, 30, **kw)
    assert torch.equal(_quiet(generate, model, idx, 30, cuda_graph=True, **kw), want)


def test_moe_static_step_on_cpu_and_refused_under_a_graph(tiny_config):
    torch.manual_seed(0)
    model = Transformer(tiny_config(n_experts=4, experts_per_token=2)).eval()
    idx = torch.randint(0, 37, (2, 5), generator=torch.Generator().manual_seed(0))
    want = generate(model, idx, 10, temperature=0)
    assert torch.equal(_quiet(generate, model, idx, 10, temperature=0, cuda_graph=True), want)
    with pytest.raises(ValueError, match="MoE") as e:
        decode_graph.check_static(model, capture=True)
    assert "\n" not in str(e.value)


def test_cpu_note_refusals_and_default_path_untouched(tiny_config):
    model = _model(tiny_config, "llama_gqa")
    idx = torch.randint(0, 37, (1, 5))
    with pytest.warns(UserWarning, match="no CUDA graphs on cpu; the static decode step runs"):
        generate(model, idx, 3, cuda_graph=True)
    with pytest.raises(ValueError, match="context=N"):
        generate(model, idx, 3, cuda_graph=True, context=8)

    class Shifted(RotaryPosition):  # a scheme the static step does not know
        pass

    model.pos = Shifted(model.cfg)
    with pytest.raises(ValueError, match="knows the built-in position schemes, not Shifted"):
        generate(model, idx, 3, cuda_graph=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no note, no static step: the default path
        generate(model, idx, 3)


def test_cpu_keeps_no_graph_and_sizes_the_cache_exactly(tiny_config):
    model = _model(tiny_config, "llama_gqa")
    _quiet(generate, model, torch.randint(0, 37, (1, 5)), 4, cuda_graph=True)
    assert model not in decode_graph._DECODERS
    assert decode_graph.buffer_length(9, "cpu") == 9
    assert decode_graph.buffer_length(9, "cuda") == decode_graph.BUCKET
    assert decode_graph.buffer_length(257, "cuda") == 2 * decode_graph.BUCKET


def test_static_step_refuses_past_its_buffer(tiny_config):
    model = _model(tiny_config, "llama_gqa")
    dec = StaticDecoder(model, 1, 6)
    with torch.no_grad():
        dec.prefill(torch.randint(0, 37, (1, 5)), None)
        dec.step(torch.tensor([[1]]))
        with pytest.raises(ValueError, match="KV cache full"):
            dec.step(torch.tensor([[2]]))


def test_generate_cli_cuda_graph_flag(tmp_path, capsys):
    from llm_foundry.checkpoint import save_checkpoint
    from llm_foundry.cli import main
    from llm_foundry.config import ModelConfig

    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=37, dim=32, n_layers=2, n_heads=2, max_seq_len=64))
    save_checkpoint(model, tmp_path / "ck")
    args = ["generate", "--checkpoint", str(tmp_path / "ck"), "--prompt-ids", "1,2,3", "--max-new-tokens", "8",
            "--temperature", "0", "--device", "cpu"]  # fmt: skip
    assert main(args) == 0
    plain = capsys.readouterr()
    assert main([*args, "--cuda-graph"]) == 0
    graph = capsys.readouterr()
    assert graph.out == plain.out
    assert "note: cuda_graph=True: no CUDA graphs on cpu" in graph.err
    assert main([*args, "--cuda-graph", "--context", "8"]) == 2
    assert "context" in capsys.readouterr().err


class _ReplayEagerly:
    """Stands in for a CUDA graph on the CPU: its replay runs the static step."""

    captured = 0

    def __init__(self, dec):
        self.dec = dec
        type(self).captured += 1

    def replay(self):
        self.dec.logits = self.dec._run(self.dec._model())


@pytest.fixture
def fake_graphs(monkeypatch):
    """Static decodes on the CPU 'captured': kept, reused and claimed as on CUDA."""
    monkeypatch.setattr(decode_graph, "captures", lambda device: True)
    monkeypatch.setattr(StaticDecoder, "_capture", lambda d: setattr(d, "graph", _ReplayEagerly(d)))
    _ReplayEagerly.captured = 0


def test_graphs_are_kept_reused_claimed_and_recaptured(fake_graphs, tiny_config):
    model = _model(tiny_config, "llama_gqa")
    idx = torch.randint(0, 37, (1, 6), generator=torch.Generator().manual_seed(0))
    first = generate(model, idx, 20, temperature=0, cuda_graph=True)
    assert torch.equal(first, generate(model, idx, 20, temperature=0))
    kept = decode_graph._DECODERS[model]
    assert kept.length == decode_graph.BUCKET and _ReplayEagerly.captured == 1
    again = generate(model, idx, 20, temperature=0, cuda_graph=True)
    longer = generate(model, idx[:, :3], 40, temperature=0, cuda_graph=True)  # same bucket
    assert torch.equal(again, first)
    assert torch.equal(longer, generate(model, idx[:, :3], 40, temperature=0))
    assert decode_graph._DECODERS[model] is kept and _ReplayEagerly.captured == 1
    # a live generation keeps its decoder: one alongside it gets a graph of its own, not kept
    live = stream(model, idx, 20, temperature=0, cuda_graph=True)
    head = [next(live) for _ in range(5)]
    other = generate(model, idx[:, :4], 20, temperature=0, cuda_graph=True)
    assert torch.equal(other, generate(model, idx[:, :4], 20, temperature=0))
    assert torch.equal(torch.cat([idx, torch.stack(head + list(live), 1)], 1), first)
    assert decode_graph._DECODERS[model] is kept and _ReplayEagerly.captured == 2
    # another batch size, or weights in new memory: a new graph in its place
    two = generate(model, idx.repeat(2, 1), 20, temperature=0, cuda_graph=True)
    assert torch.equal(two, first.repeat(2, 1)) and _ReplayEagerly.captured == 3
    model.to(torch.float64).to(torch.float32)
    assert torch.equal(generate(model, idx, 20, temperature=0, cuda_graph=True), first)
    assert decode_graph._DECODERS[model] is not kept and _ReplayEagerly.captured == 4
    decode_graph.release(model)
    assert model not in decode_graph._DECODERS


def test_graphs_refuse_moe_in_one_line(fake_graphs, tiny_config):
    torch.manual_seed(0)
    model = Transformer(tiny_config(n_experts=4)).eval()
    with pytest.raises(ValueError, match="MoE") as e:
        generate(model, torch.zeros(1, 3, dtype=torch.long), 4, cuda_graph=True)
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------------------------
# On CUDA: the captured graph


@pytest.fixture
def gpu(request) -> torch.device:
    """The ``cuda`` tests' device (conftest's ``device`` fixture: LLM_FOUNDRY_TEST_DEVICE=cpu
    runs these on the CPU, without a graph), or CUDA, or a skip."""
    try:
        return request.getfixturevalue("device")
    except pytest.FixtureLookupError:
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU")
        return torch.device("cuda")


@pytest.fixture
def no_tf32():
    """fp32 matrix products in full fp32 (no TF32) for the test, the settings restored."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _captured(model) -> StaticDecoder | None:
    dec = decode_graph._DECODERS.get(model)
    assert dec is None or dec.graph is not None
    return dec


def _decisive(model, idx, n: int) -> torch.Tensor:
    """The default path's greedy tokens, none of them within rounding of a tie."""
    out = generate(model, idx, n, temperature=0)
    with torch.no_grad():
        assert_decisive(model(out[:, :-1])[0][:, idx.shape[1] - 1 :])
    return out


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["llama_gqa", "gpt2_learned", "alibi_window"])
def test_cuda_graph_greedy_equals_eager_fp32(gpu, no_tf32, tiny_config, name):
    model = _model(tiny_config, name, seed=1, device=gpu)
    idx = torch.randint(0, 37, (1, 6), generator=torch.Generator().manual_seed(1)).to(gpu)
    eager = _decisive(model, idx, 40)
    assert torch.equal(_quiet(generate, model, idx, 40, temperature=0, cuda_graph=True), eager)
    assert gpu.type != "cuda" or _captured(model) is not None
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 37, (n,), generator=g).tolist() for n in (3, 9, 6)]
    got = _quiet(generate_batch, model, prompts, 20, temperature=0, cuda_graph=True)
    for p, row in zip(prompts, got, strict=True):
        assert row == _decisive(model, torch.tensor([p], device=gpu), 20)[0].tolist()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_replay_equals_the_eager_static_step(gpu, no_tf32, tiny_config, dtype):
    """The graph replays the eager static step's kernels: the same logits (to the bit, very
    likely; to rounding, asserted), bf16 too."""
    model = _model(tiny_config, "llama_gqa", device=gpu).to(dtype)
    seq = torch.randint(0, 37, (3, 30), generator=torch.Generator().manual_seed(0)).to(gpu)
    pad = torch.tensor([0, 4, 2], device=gpu)
    runs = []
    for capture in (False, gpu.type == "cuda"):
        dec = StaticDecoder(model, 3, 64, capture=capture)
        with torch.no_grad():
            out = [dec.prefill(seq[:, :8], pad)]
            out += [dec.step(seq[:, t : t + 1]) for t in range(8, 29)]
        assert (dec.graph is not None) == capture
        runs.append(torch.stack(out, dim=1))
    assert runs[0].dtype == dtype and torch.isfinite(runs[0]).all()
    _within(
        runs[1], runs[0], "replay vs eager static step", REL if dtype == torch.float32 else 2e-2
    )


@pytest.mark.cuda
def test_cuda_graph_bf16_generates(gpu, tiny_config):
    model = _model(tiny_config, "llama_gqa", device=gpu).to(torch.bfloat16)
    idx = torch.randint(0, 37, (2, 6), generator=torch.Generator().manual_seed(0)).to(gpu)
    out = _quiet(generate, model, idx, 50, temperature=0, cuda_graph=True)
    assert out.shape == (2, 56) and int(out.max()) < 37
    again = _quiet(generate, model, idx, 50, temperature=0, cuda_graph=True)
    assert torch.equal(out, again)  # the kept graph replayed: the same tokens
    sampled = _quiet(generate, model, idx, 50, temperature=0.9, top_p=0.9, seed=1, cuda_graph=True)
    assert sampled.shape == (2, 56)


@pytest.mark.cuda
def test_cuda_graph_is_kept_reused_and_recaptured(gpu, no_tf32, tiny_config):
    if gpu.type != "cuda":
        pytest.skip("graphs are kept on CUDA only")
    model = _model(tiny_config, "llama_gqa", device=gpu)
    idx = torch.randint(0, 37, (1, 6), generator=torch.Generator().manual_seed(0)).to(gpu)
    first = generate(model, idx, 20, temperature=0, cuda_graph=True)
    assert torch.equal(first, _decisive(model, idx, 20))
    kept = _captured(model)
    graph = kept.graph
    assert torch.equal(generate(model, idx, 20, temperature=0, cuda_graph=True), first)
    longer = generate(model, idx[:, :3], 30, temperature=0, cuda_graph=True)  # same bucket
    assert _captured(model) is kept and kept.graph is graph
    assert torch.equal(longer, _decisive(model, idx[:, :3], 30))
    # a live generation keeps its decoder: a second one alongside gets its own graph
    live = stream(model, idx, 20, temperature=0, cuda_graph=True)
    head = [next(live) for _ in range(5)]
    other = generate(model, idx[:, :4], 20, temperature=0, cuda_graph=True)
    rest = list(live)
    assert torch.equal(torch.cat([idx, torch.stack(head + rest, 1)], 1), first)
    assert torch.equal(other, _decisive(model, idx[:, :4], 20))
    # weights moved to new memory: a new graph (the old one read the old memory)
    model.to(torch.float64).to(torch.float32)
    assert torch.equal(generate(model, idx, 20, temperature=0, cuda_graph=True), first)
    assert _captured(model) is not kept
    decode_graph.release(model)
    assert model not in decode_graph._DECODERS


@pytest.mark.cuda
def test_cuda_graph_of_the_compiled_step(gpu, no_tf32, tiny_config):
    torch._dynamo.reset()
    model = _model(tiny_config, "llama_gqa", seed=1, device=gpu)
    idx = torch.randint(0, 37, (1, 6), generator=torch.Generator().manual_seed(1)).to(gpu)
    eager = _decisive(model, idx, 30)  # fused kernels round otherwise
    got = _quiet(generate, model, idx, 30, temperature=0, cuda_graph=True, compile=True)
    assert torch.equal(got, eager)
    torch._dynamo.reset()


@pytest.mark.cuda
def test_cuda_graph_refuses_moe_in_one_line(gpu, tiny_config):
    if gpu.type != "cuda":
        pytest.skip("the CPU runs MoE's static step eagerly (tested above)")
    torch.manual_seed(0)
    model = Transformer(tiny_config(n_experts=4)).to(gpu).eval()
    with pytest.raises(ValueError, match="MoE"):
        generate(model, torch.zeros(1, 3, dtype=torch.long, device=gpu), 4, cuda_graph=True)
