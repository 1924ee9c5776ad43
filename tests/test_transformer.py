"""The assembled model: shapes, loss, block forms, initialisation, parameter groups."""

import math

import pytest
import torch
import torch.nn.functional as F

from llm_foundry.config import ModelConfig
from llm_foundry.models import Transformer
from llm_foundry.models.block import NORM_POSITION_NAMES, Block, ParallelBlock, PostNormBlock
from llm_foundry.models.mlp import MLP_NAMES, is_gated
from llm_foundry.presets import PRESETS, get_preset


def test_forward_shapes_and_loss(tiny_config):
    torch.manual_seed(0)
    model = Transformer(tiny_config())
    idx = torch.randint(0, 37, (3, 10))
    logits, loss = model(idx)
    assert logits.shape == (3, 10, 37) and loss is None
    logits, loss = model(idx, idx)
    torch.testing.assert_close(loss, F.cross_entropy(logits.view(-1, 37), idx.view(-1)))
    assert abs(loss.item() - math.log(37)) < 0.3  # small init: close to uniform


def test_ignore_index(tiny_config):
    model = Transformer(tiny_config())
    idx = torch.randint(0, 37, (2, 8))
    targets = idx.clone()
    targets[:, :4] = -100
    logits, loss = model(idx, targets)
    expected = F.cross_entropy(logits[:, 4:].reshape(-1, 37), idx[:, 4:].reshape(-1))
    torch.testing.assert_close(loss, expected)


def test_block_forms_from_factory(tiny_config):
    assert all(type(b) is Block for b in Transformer(tiny_config()).layers)
    post = Transformer(tiny_config(norm_position="post", norm="layernorm"))
    assert all(type(b) is PostNormBlock for b in post.layers)
    assert isinstance(post.norm, torch.nn.Identity)  # post-norm blocks already end in a norm
    par = Transformer(tiny_config(parallel_block=True))
    assert all(type(b) is ParallelBlock for b in par.layers)
    assert not hasattr(par.layers[0], "mlp_norm")  # one shared norm (GPT-J, Falcon-7B)


def test_parallel_block_formula(tiny_config):
    torch.manual_seed(0)
    block = Transformer(tiny_config(parallel_block=True, n_layers=1)).layers[0]
    x = torch.randn(2, 5, 32)
    from llm_foundry.models.position import NoPosition

    h = block.attn_norm(x)
    a, _ = block.attn(h, NoPosition(), 0, None)
    torch.testing.assert_close(block(x, NoPosition(), 0, None)[0], x + a + block.mlp(h))


@pytest.mark.parametrize("norm_position", NORM_POSITION_NAMES)
def test_residual_false_keeps_only_the_branches(tiny_config, norm_position):
    from llm_foundry.models.position import NoPosition

    torch.manual_seed(0)
    cfg = tiny_config(n_layers=1, norm_position=norm_position, norm="layernorm")
    with_skip = Transformer(cfg).layers[0]
    without = Transformer(cfg.replace(residual=False)).layers[0]
    without.load_state_dict(with_skip.state_dict())
    x, pos = torch.randn(2, 5, 32), NoPosition()
    if norm_position == "pre":
        a = without.attn(without.attn_norm(x), pos, 0, None)[0]
        expected = without.mlp(without.mlp_norm(a))
    else:
        a = without.attn_norm(without.attn(x, pos, 0, None)[0])
        expected = without.mlp_norm(without.mlp(a))
    torch.testing.assert_close(without(x, pos, 0, None)[0], expected)
    assert not torch.allclose(with_skip(x, pos, 0, None)[0], expected)


@pytest.mark.parametrize("mlp, n_mats", [(m, 3 if is_gated(m) else 2) for m in MLP_NAMES])
def test_mlp_variants(tiny_config, mlp, n_mats):
    model = Transformer(tiny_config(mlp=mlp))
    mats = [n for n, _ in model.layers[0].mlp.named_parameters() if n.endswith("weight")]
    assert len(mats) == n_mats
    assert model(torch.randint(0, 37, (1, 6)), torch.randint(0, 37, (1, 6)))[1].isfinite()


def test_tied_embeddings_share_storage(tiny_config):
    model = Transformer(tiny_config(tie_embeddings=True))
    assert model.lm_head.weight is model.tok_emb.weight
    untied = Transformer(tiny_config(tie_embeddings=False))
    assert model.num_params() == untied.num_params() - 37 * 32


def test_init_statistics():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=1000, dim=256, n_layers=8, n_heads=4, attn_bias=True)
    model = Transformer(cfg)
    assert model.tok_emb.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.layers[0].attn.wq.weight.std().item() == pytest.approx(0.02, rel=0.05)
    residual = 0.02 / math.sqrt(2 * 8)
    assert model.layers[3].attn.wo.weight.std().item() == pytest.approx(residual, rel=0.05)
    assert model.layers[3].mlp.w2.weight.std().item() == pytest.approx(residual, rel=0.05)
    assert (model.layers[0].attn.wq.bias == 0).all()
    assert (model.layers[0].attn_norm.weight == 1).all()


def test_param_groups_exclude_norms_biases_embeddings(tiny_config):
    model = Transformer(tiny_config(pos_encoding="learned", attn_bias=True, norm="layernorm"))
    decay, no_decay = model.param_groups(0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    decay_ids = {id(p) for p in decay["params"]}
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(p.dim() == 2 for p in decay["params"])
    assert id(model.tok_emb.weight) not in decay_ids
    assert id(model.pos.emb.weight) not in decay_ids
    assert {names[i] for i in decay_ids} >= {"layers.0.attn.wq.weight", "layers.1.mlp.w2.weight"}
    total = sum(p.numel() for g in (decay, no_decay) for p in g["params"])
    assert total == model.num_params()


def test_num_params_non_embedding(tiny_config):
    model = Transformer(tiny_config(pos_encoding="learned", tie_embeddings=True))
    assert model.num_params(non_embedding=True) == model.num_params() - 37 * 32 - 64 * 32


def test_dropout_is_off_in_eval(tiny_config):
    model = Transformer(tiny_config(dropout=0.5))
    idx = torch.randint(0, 37, (1, 8))
    model.train()
    assert not torch.equal(model(idx)[0], model(idx)[0])
    model.eval()
    assert torch.equal(model(idx)[0], model(idx)[0])


def test_every_family_trains_one_step():
    """A shrunken copy of every preset runs forward and backward with finite gradients."""
    for name in PRESETS:
        big = PRESETS[name]
        kv = big.get("n_kv_heads", big["n_heads"])
        shrink = dict(
            vocab_size=50,
            dim=32,
            n_layers=2,
            n_heads=4,
            hidden_dim=64,
            max_seq_len=64,
            n_kv_heads=4 if kv == big["n_heads"] else (1 if kv == 1 else 2),
            head_dim=16 if big.get("head_dim") else None,
            sliding_window=8 if big.get("sliding_window") else None,
        )
        cfg = get_preset(name, **shrink)
        model = Transformer(cfg)
        idx = torch.randint(0, 50, (2, 16))
        _, loss = model(idx, idx)
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        assert all(g is not None and g.isfinite().all() for g in grads), name


def test_activation_checkpointing_gives_the_same_loss_and_gradients(tiny_config):
    torch.manual_seed(0)
    model = Transformer(tiny_config(n_kv_heads=2))
    idx = torch.randint(0, 37, (2, 12))
    grads, calls = [], []
    model.layers[0].register_forward_pre_hook(lambda *a: calls.append(1))
    for recompute in (False, True):
        model.activation_checkpointing = recompute
        model.zero_grad()
        calls.clear()
        loss = model(idx, idx)[1]
        loss.backward()
        grads.append((loss.item(), [p.grad.clone() for p in model.parameters()], len(calls)))
    assert grads[0][0] == grads[1][0]
    assert (grads[0][2], grads[1][2]) == (1, 2)  # the block ran again in backward
    for a, b in zip(grads[0][1], grads[1][1], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
