"""NF4 and double quantization (models/nf4.py): the table is the QLoRA paper's definition, and
codes, constants and dequantized weights are bitsandbytes' (``quantize_4bit(...,
quant_type="nf4", compress_statistics=True)``) where it runs on this CPU; the double
quantization is also checked by hand against its definition."""

from __future__ import annotations

import pytest
import torch

from llm_foundry.models.nf4 import (
    ABSMAX_BLOCK,
    BLOCK,
    DYNAMIC,
    GRIDS,
    Quantized4bit,
    dequantize_4bit,
    dequantize_absmax,
    normal_quantile_table,
    pack_nibbles,
    quantize_4bit,
    quantize_blockwise,
    unpack_nibbles,
)


@pytest.fixture(scope="module")
def bnb():
    """bitsandbytes.functional, skipped (with the reason) where it is absent or cannot quantize
    on this CPU."""
    functional = pytest.importorskip("bitsandbytes.functional", reason="bitsandbytes absent")
    try:
        functional.quantize_4bit(torch.randn(64), quant_type="nf4", compress_statistics=True)
    except Exception as e:  # a build without a CPU path raises here
        pytest.skip(f"bitsandbytes cannot quantize on this CPU: {type(e).__name__}: {e}")
    return functional


def _weight(shape, seed=0):
    """A weight whose rows differ in size by 100x, with one all-zero block and an outlier."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.logspace(-3, -1, shape[0])[:, None]
    w.view(-1)[:BLOCK] = 0
    w.view(-1)[5 * BLOCK + 3] = 0.9
    return w


def _midpoint_distance(v: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """How far each of v lies from the nearest boundary between two neighbouring codes."""
    bounds = (table[:-1] + table[1:]) / 2
    return (v[:, None] - bounds[None, :]).abs().amin(dim=1)


def test_the_nf4_table_is_the_papers_definition():
    """Quantiles of N(0, 1) normalised to [-1, 1]: 7 negative, an exact zero, 8 positive. The
    stored values (the paper's Appendix E, computed in fp32) agree with an fp64 derivation to a
    few fp32 ulps; the gaps between them are ~0.08 or more, so this pins every value."""
    table = GRIDS["nf4"]
    assert table.dtype == torch.float32 and table.shape == (16,)
    assert torch.equal(table, table.sort().values)
    assert (table < 0).sum() == 7 and (table == 0).sum() == 1 and (table > 0).sum() == 8
    assert table[0] == -1 and table[-1] == 1
    derived = normal_quantile_table()
    torch.testing.assert_close(table.double(), derived, atol=5e-7, rtol=0)
    assert table.diff().min() > 0.07


def test_the_int4_grid_is_uniform_and_symmetric():
    grid = GRIDS["int4"]
    assert grid.shape == (15,) and grid[7] == 0
    torch.testing.assert_close(grid, -grid.flip(0), atol=0, rtol=0)
    torch.testing.assert_close(grid.diff(), torch.full((14,), 1 / 7), atol=1e-7, rtol=0)


def test_the_tables_are_bitsandbytes(bnb):
    assert torch.equal(GRIDS["nf4"], bnb.get_4bit_type("nf4", device="cpu"))
    assert torch.equal(DYNAMIC, bnb.create_dynamic_map())


@pytest.mark.parametrize("shape", [(96, 640), (33, 70), (7, 64)])
def test_nf4_codes_and_constants_are_bitsandbytes(bnb, shape):
    """First level: the absmax constants are bitsandbytes' exactly, and so is every code except
    where w / absmax lies within 1e-6 of a boundary (bitsandbytes multiplies by 1 / absmax, we
    divide). Second level: the same offset (the mean) and scales; an absmax code may differ
    where bitsandbytes' CPU search does not return the nearest 8-bit value (measured: ~0.2% of
    codes), and there ours is the nearer one, one step away."""
    w = _weight(shape)
    n = w.numel()
    q = quantize_4bit(w)
    codes, absmax = quantize_blockwise(w, GRIDS["nf4"], BLOCK)
    ref_packed, ref_plain = bnb.quantize_4bit(w, blocksize=BLOCK, quant_type="nf4")
    torch.testing.assert_close(absmax, ref_plain.absmax, atol=0, rtol=0)
    ours, theirs = unpack_nibbles(q.packed)[:n], unpack_nibbles(ref_packed.flatten())[:n]
    assert torch.equal(ours, codes[:n])
    scaled = w.flatten() / absmax.clamp(min=1e-38).repeat_interleave(BLOCK)[:n]
    differ = ours != theirs
    assert (_midpoint_distance(scaled[differ], GRIDS["nf4"]) < 1e-6).all()
    assert differ.sum() <= n // 1000
    if n % 2 == 0 and not differ.any():  # the same bytes: the first code in the high nibble
        assert torch.equal(q.packed[: n // 2], ref_packed.flatten())

    _, ref = bnb.quantize_4bit(w, blocksize=BLOCK, quant_type="nf4", compress_statistics=True)
    torch.testing.assert_close(q.absmax_offset, ref.offset.reshape(1), atol=0, rtol=0)
    torch.testing.assert_close(q.absmax_scale, ref.state2.absmax, atol=0, rtol=0)
    assert ref.state2.blocksize == ABSMAX_BLOCK and q.absmax_codes.shape == ref.absmax.shape
    v = (absmax - q.absmax_offset) / q.absmax_scale.repeat_interleave(ABSMAX_BLOCK)[: len(absmax)]
    mine, bnbs = q.absmax_codes.long(), ref.absmax.long()
    differ = mine != bnbs
    assert differ.sum() <= max(1, len(absmax) // 100), differ.sum()
    assert ((mine - bnbs)[differ].abs() == 1).all()
    assert ((v - DYNAMIC[mine]).abs() <= (v - DYNAMIC[bnbs]).abs()).all()


@pytest.mark.parametrize("shape", [(96, 640), (4, 2048)])
def test_dequantizing_bitsandbytes_tensors_gives_bitsandbytes_weights(bnb, shape):
    """bitsandbytes' packed codes, absmax codes, scales and offset read by our dequantize: its
    own dequantize_4bit's weights, bit for bit."""
    w = _weight(shape, seed=1)
    packed, st = bnb.quantize_4bit(w, blocksize=BLOCK, quant_type="nf4", compress_statistics=True)
    theirs = Quantized4bit(packed.flatten(), st.absmax, st.state2.absmax, st.offset.reshape(1))
    got = dequantize_4bit(theirs, w.shape)
    torch.testing.assert_close(got, bnb.dequantize_4bit(packed, st), atol=0, rtol=0)
    # and ours round-trips at least as close to w as bitsandbytes' (the nearer absmax codes)
    mine = dequantize_4bit(quantize_4bit(w), w.shape)
    assert (mine - w).abs().mean() <= (got - w).abs().mean() * 1.001


def test_double_quantization_by_hand():
    """The paper's double quantization, element by element: offset the mean of the absmax
    constants; per block of 256 of them, the scale their largest distance from it; each code
    the nearest of the 256 dynamic values (ties aside) to (absmax - offset) / scale; and the
    constants read back as dynamic[code] · scale + offset."""
    w = _weight((40, 1024), seed=2)  # 640 blocks: three blocks of constants, the last partial
    q = quantize_4bit(w)
    _, absmax = quantize_blockwise(w, GRIDS["nf4"], BLOCK)
    assert len(absmax) == 640 and q.absmax_scale.shape == (3,) and q.absmax_codes.shape == (640,)
    assert q.absmax_offset.item() == pytest.approx(absmax.double().mean().item(), rel=1e-6)
    back = dequantize_absmax(q.absmax_codes, q.absmax_scale, q.absmax_offset)
    for i, a in enumerate(absmax.tolist()):
        block = i // ABSMAX_BLOCK
        part = absmax[block * ABSMAX_BLOCK : (block + 1) * ABSMAX_BLOCK]
        scale = (part - q.absmax_offset).abs().max().item()
        assert q.absmax_scale[block].item() == pytest.approx(scale, rel=1e-7)
        v = (a - q.absmax_offset.item()) / scale
        dist = (DYNAMIC.double() - v).abs()
        code = int(q.absmax_codes[i])
        assert dist[code] <= dist.min() + 1e-7, (i, code, int(dist.argmin()))
        want = DYNAMIC[code].item() * q.absmax_scale[block].item() + q.absmax_offset.item()
        assert back[i].item() == pytest.approx(want, rel=1e-6)
    # the constants come back within 1% (the dynamic grid's steps near 1 are ~1.4% of scale)
    assert ((back - absmax).abs() <= 0.01 * absmax.max()).all()


@pytest.mark.parametrize("grid", ["nf4", "int4"])
def test_each_weight_is_the_nearest_grid_value_of_its_block(grid):
    """Dequantized weights against the definition: w ≈ grid[code] · absmax'; within half the
    widest gap of the grid times the block's reconstructed absmax, plus its double-quantization
    error; an all-zero block stays zero, the largest magnitude of a block comes back as ±absmax'."""
    w = _weight((24, 256), seed=3)
    q = quantize_4bit(w, grid)
    back = dequantize_4bit(q, w.shape, grid)
    assert back.shape == w.shape and back.dtype == torch.float32
    absmax = w.reshape(-1, BLOCK).abs().amax(1)
    approx = dequantize_absmax(q.absmax_codes, q.absmax_scale, q.absmax_offset)
    half_gap = GRIDS[grid].diff().max() / 2
    bound = half_gap * approx + (approx - absmax).abs() + 1e-7
    err = (back - w).reshape(-1, BLOCK).abs()
    assert (err <= bound[:, None]).all()
    assert (err > 0.3 * half_gap * absmax[:, None]).any()  # the bound is the real one
    assert (back.view(-1)[:BLOCK] == 0).all()
    peak = w.reshape(-1, BLOCK).abs().argmax(1)
    got = back.reshape(-1, BLOCK).gather(1, peak[:, None]).squeeze(1).abs()
    torch.testing.assert_close(got[1:], approx[1:], atol=0, rtol=1e-6)


def test_packing_two_codes_per_byte():
    codes = torch.tensor([1, 2, 15, 0, 7, 8], dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.tolist() == [0x12, 0xF0, 0x78]
    assert torch.equal(unpack_nibbles(packed), codes)
    q = quantize_4bit(torch.randn(3, 50))  # 150 weights: 3 blocks, the last padded with zeros
    assert q.packed.shape == (96,) and q.absmax_codes.shape == (3,)
    assert q.absmax_scale.shape == (1,) and q.absmax_offset.shape == (1,)


@pytest.mark.parametrize("grid", ["nf4", "int4"])
def test_a_4bit_base_compiles_in_one_graph_without_warnings(grid):
    """torch.compile (dynamo, eager backend: the tracing is what differs) of an adapted layer
    on a 4-bit base: one graph, no warning printed, the eager output and gradients."""
    import warnings

    from llm_foundry.models.lora import LoRALinear

    torch.manual_seed(0)
    torch._dynamo.reset()
    layer = LoRALinear(torch.nn.Linear(70, 9), 4, 8.0, 0.0, False, grid)  # 630 weights: padded
    with torch.no_grad():
        layer.lora_B.normal_()
    x = torch.randn(2, 3, 70)
    want = layer(x)
    want.square().sum().backward()
    grads = layer.lora_A.grad.clone(), layer.lora_B.grad.clone()
    layer.zero_grad()
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = compiled(x)
        got.square().sum().backward()
    assert [str(w.message) for w in caught] == []
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close((layer.lora_A.grad, layer.lora_B.grad), grads, atol=0, rtol=0)


@pytest.mark.parametrize("grid", ["nf4", "int4"])
def test_a_value_half_way_between_two_grid_values_takes_the_lower_code(grid):
    """The tie rule the module states: block absmax 1 (so w / absmax is w exactly), the other
    weights each on a midpoint of two neighbouring grid values (computed in fp32, as the
    quantizer computes its boundaries)."""
    table = GRIDS[grid]
    mids = (table[:-1] + table[1:]) / 2
    w = torch.cat((torch.ones(1), mids, torch.zeros(BLOCK - 1 - len(mids))))
    codes, absmax = quantize_blockwise(w, table, BLOCK)
    assert absmax.tolist() == [1.0]
    assert codes[1 : len(table)].tolist() == list(range(len(table) - 1))


def test_bitsandbytes_breaks_ties_as_we_do(bnb):
    mids = (GRIDS["nf4"][:-1] + GRIDS["nf4"][1:]) / 2
    w = torch.cat((torch.ones(1), mids, torch.zeros(BLOCK - 16)))
    packed, _ = bnb.quantize_4bit(w, blocksize=BLOCK, quant_type="nf4")
    assert torch.equal(
        unpack_nibbles(packed.flatten()), quantize_blockwise(w, GRIDS["nf4"], BLOCK)[0]
    )
