"""A LLaMA-style language model in a single file, meant to be read from top to bottom.

This is the teaching twin of ``llm_foundry.models.Transformer``: the same mathematics, with every
option the library offers stripped away except the one LLaMA-family models use. It needs only
PyTorch. Parameter names equal the library's state-dict names, so a checkpoint of the library
model (built with rope / rmsnorm / swiglu / pre-norm, no biases) loads here unchanged, and
``tests/test_tutorial.py`` checks that both produce the same logits.

The whole model, for token ids ``idx`` of shape (B, T):

    x = tok_emb[idx]                                   (B, T, dim)     look up one vector per token
    for each of n_layers blocks:
        x = x + Attention(RMSNorm(x))                  (B, T, dim)     tokens exchange information
        x = x + SwiGLU(RMSNorm(x))                     (B, T, dim)     each token is processed alone
    logits = lm_head(RMSNorm(x))                       (B, T, vocab)   a score for every next token

Shape letters used in the comments: B batch size, T sequence length, D model width (``dim``),
H query heads, K key/value heads, hd width of one head (D / H), V vocabulary size.

Run ``python tutorials/model.py`` for a demo: a tiny model, its parameter count part by part, and
one forward pass with the shape of every intermediate tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

# ------------------------------------------------------------------------------------------------
# 1. Configuration


@dataclass
class Config:
    dim: int = 256  # width of the residual stream: every token is a vector of this size
    n_layers: int = 4  # how many Transformer blocks are stacked
    n_heads: int = 8  # query heads; each one attends with its own hd = dim / n_heads features
    n_kv_heads: int = 4  # key/value heads shared by groups of query heads (see section 4)
    vocab_size: int = 8192  # number of distinct token ids
    hidden_dim: int | None = None  # MLP width; None derives LLaMA's 2/3 * 4 * dim (section 5)
    max_seq_len: int = 256  # longest sequence; RoPE tables are precomputed up to here
    rope_theta: float = 10000.0  # RoPE base: larger means slower rotations, longer reach
    norm_eps: float = 1e-5  # keeps RMSNorm from dividing by zero
    tie_embeddings: bool = False  # share one matrix between the input embedding and output head

    def __post_init__(self) -> None:
        if self.hidden_dim is None:
            # A plain MLP is 4 * dim wide with two matrices. SwiGLU has three, so LLaMA shrinks
            # the width to 2/3 of that, which keeps the MLP's parameter count (almost) unchanged.
            self.hidden_dim = int(2 * int(4 * self.dim) / 3)
        assert self.dim % self.n_heads == 0, "dim must split evenly into n_heads heads"
        assert self.n_heads % self.n_kv_heads == 0, "n_kv_heads must divide n_heads"
        assert self.head_dim % 2 == 0, "RoPE rotates pairs of features: head_dim must be even"

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


# ------------------------------------------------------------------------------------------------
# 2. RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization")
#
# LayerNorm subtracts the mean, divides by the standard deviation, then applies a gain and a bias.
# RMSNorm keeps only the rescaling: divide by the root mean square of the features and multiply by
# a learned gain. It is cheaper (one statistic instead of two, no bias) and works as well in
# practice, because it is the control of the vector's scale, not its centring, that stabilises
# training.


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))  # the learned gain g, one per feature

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., D)
        # Square, average and take 1/sqrt in float32: in fp16 the squares can overflow, and in
        # bf16 the mean loses too many digits. Only the result goes back to the input dtype.
        x32 = x.float()
        inv_rms = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)  # (..., 1)
        return self.weight * (x32 * inv_rms).type_as(x)  # (..., D), every row now has RMS ~ g


# ------------------------------------------------------------------------------------------------
# 3. Rotary position embedding, RoPE (Su et al. 2021, "RoFormer")
#
# Attention by itself has no idea of order: shuffle the tokens and each one sees the same set.
# RoPE injects position by *rotating* queries and keys. The hd features of a head form hd/2
# pairs; pair i at position m turns by the angle m * theta_i, where theta_i = base^(-2i/hd)
# (fast rotations for the first pairs, very slow ones for the last). Rotating q by angle m*t and
# k by n*t leaves their dot product depending only on (m - n)*t: attention sees *relative*
# distance, and nothing needs to be learned.
#
# Which features form a pair is a convention. We use the "rotate-half" layout of the Hugging Face
# LLaMA code: feature i pairs with feature i + hd/2. (The paper pairs neighbours 2i and 2i+1; the
# two are equivalent up to a fixed permutation of the q/k projection rows, but checkpoints are
# stored in one layout and must be read in that layout.)


def rope_tables(head_dim: int, max_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every rotation angle, each of shape (max_len, head_dim)."""
    # theta_i = base^(-2i/hd) for i = 0 .. hd/2 - 1; computed in float64, stored in float32
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim  # (hd/2,)
    inv_freq = (1.0 / theta**exponents).float()  # (hd/2,)
    positions = torch.arange(max_len, dtype=torch.float32)  # (T,)
    angles = positions[:, None] * inv_freq[None, :]  # (T, hd/2): angle of pair i at position m
    angles = torch.cat((angles, angles), dim=-1)  # (T, hd): features i and i + hd/2 share angle i
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Split the last dimension into halves (a, b) and return (-b, a)."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (i, i + hd/2) feature pair of x: (B, heads, T, hd); cos, sin: (T, hd).

    For one pair (a, b) and angle t this is the 2-D rotation (a cos t - b sin t, b cos t + a sin t):
    the first half of the output gets a*cos - b*sin, the second half b*cos + a*sin.
    """
    return x * cos + rotate_half(x) * sin


# ------------------------------------------------------------------------------------------------
# 4. Causal self-attention with grouped-query attention, GQA (Ainslie et al. 2023)
#
# Each query head compares its query with the keys of all earlier tokens and averages their values.
# In classic multi-head attention (MHA) each of the H query heads has its own key and value head.
# During generation the keys and values of every past token are cached, and that cache, not the
# arithmetic, limits speed and batch size. GQA lets groups of H/K query heads share one K/V head:
# the cache shrinks by H/K with little loss in quality. K = H is MHA; K = 1 is multi-query
# attention (MQA, Shazeer 2019). Query head h reads K/V head h // (H/K).


class Attention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        # LLaMA uses no biases anywhere in its linear layers.
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)  # D -> H * hd
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)  # D -> K * hd
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)  # D -> K * hd
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)  # H * hd -> D

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape  # x: (B, T, D), already normalised by the block

        # Project, then split the feature axis into heads.
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)  # (B, T, H, hd)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)  # (B, T, K, hd)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)  # (B, T, K, hd)
        # Move heads before time so each head is an independent (T, hd) matrix.
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H|K, T, hd)

        # Positions enter here, and only here: rotate queries and keys (never values).
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        # GQA: copy each K/V head to the H/K query heads of its group. repeat_interleave gives the
        # order [kv0, kv0, kv1, kv1, ...], so query head h lines up with K/V head h // group.
        # (Fused kernels avoid this copy; here it keeps the arithmetic visible.)
        group = self.n_heads // self.n_kv_heads
        k = k.repeat_interleave(group, dim=1)  # (B, H, T, hd)
        v = v.repeat_interleave(group, dim=1)  # (B, H, T, hd)

        # Scaled dot-product attention (Vaswani et al. 2017), written out by hand.
        # Why divide by sqrt(hd)? A dot product of two hd-dimensional vectors with roughly unit,
        # independent entries has variance hd. Unscaled, the scores grow with the head width,
        # softmax saturates into a near one-hot choice and its gradients all but vanish. Dividing
        # by sqrt(hd) brings the scores back to unit variance whatever the head size.
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)  # (B, H, T, T)

        # Causal mask: token t may look at tokens 0..t only, never at the future it must predict.
        # Future positions get -inf, which softmax turns into exactly zero weight.
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()  # (T, T), True = seen
        scores = scores.masked_fill(~causal, float("-inf"))

        # Each row becomes a probability distribution over the visible keys (float32 for accuracy).
        weights = torch.softmax(scores.float(), dim=-1).type_as(q)  # (B, H, T, T)
        out = weights @ v  # (B, H, T, hd): a weighted average of the values

        # Glue the heads back side by side and mix them with the output projection.
        out = out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, H * hd)
        return self.wo(out)  # (B, T, D)


# ------------------------------------------------------------------------------------------------
# 5. SwiGLU feed-forward network (Shazeer 2020, "GLU Variants Improve Transformer")
#
# After attention has mixed information *between* tokens, the MLP transforms each token on its
# own. A gated MLP computes two projections of x: one passes through SiLU (x * sigmoid(x)) and
# acts as a gate that scales the other element by element. Shazeer found such gated units give
# lower loss than ReLU/GELU MLPs at equal cost. The third matrix is paid for with a narrower
# hidden layer (2/3 of the usual 4 * dim, see Config).


class SwiGLU(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)  # gate projection, D -> F
        self.w3 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)  # "up" projection, D -> F
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)  # "down" projection, F -> D

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, D)
        gate = F.silu(self.w1(x))  # (B, T, F)
        return self.w2(gate * self.w3(x))  # (B, T, F) -> (B, T, D)


# ------------------------------------------------------------------------------------------------
# 6. The pre-norm block (Xiong et al. 2020, "On Layer Normalization in the Transformer
#    Architecture")
#
# The original Transformer normalised *after* adding the residual ("post-norm"). Pre-norm
# normalises only the input of each sub-layer and adds its output to an untouched residual
# stream. The stream is then a clean identity path from the last layer to the first, gradients
# reach early layers without shrinking, and deep stacks train stably without a long warm-up.


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)  # (B, T, D): read, attend, add back
        x = x + self.mlp(self.mlp_norm(x))  # (B, T, D): read, transform, add back
        return x


# ------------------------------------------------------------------------------------------------
# 7. The full model


class Transformer(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)  # (V, D): row i is token i's vector
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        # Pre-norm blocks leave the stream un-normalised, so one last norm precedes the head.
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)  # D -> V
        if cfg.tie_embeddings:
            # Weight tying (Press & Wolf 2017): the same (V, D) matrix maps ids to vectors and
            # vectors to scores, saving V * D parameters; common in small models.
            self.lm_head.weight = self.tok_emb.weight
        # The RoPE tables are derived, not learned: buffers with persistent=False stay out of the
        # state dict, so checkpoints hold weights only.
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)  # (max_seq_len, hd)
        self.register_buffer("rope_sin", sin, persistent=False)  # (max_seq_len, hd)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # Small random matrices (GPT-2's std 0.02); RMSNorm gains already start at 1.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx: (B, T) token ids -> logits (B, T, V), and the cross-entropy loss given targets."""
        B, T = idx.shape
        assert T <= self.cfg.max_seq_len, f"sequence of {T} tokens > max_seq_len"
        x = self.tok_emb(idx)  # (B, T, D); no position is added here, RoPE acts inside attention
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]  # (T, hd) each, positions 0..T-1
        for layer in self.layers:
            x = layer(x, cos, sin)  # (B, T, D)
        logits = self.lm_head(self.norm(x))  # (B, T, V): unnormalised next-token scores
        loss = None
        if targets is not None:  # targets[b, t] is the token that follows idx[b, t]
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        return logits, loss


# ------------------------------------------------------------------------------------------------
# 8. Where the parameters are


def param_breakdown(model: Transformer) -> dict[str, int]:
    """Parameter count of each part; a tied head adds nothing since it reuses tok_emb."""
    count = lambda *modules: sum(p.numel() for m in modules for p in m.parameters())
    blocks = list(model.layers)
    head = 0 if model.cfg.tie_embeddings else model.lm_head.weight.numel()
    parts = {
        "token embedding (V * D)": count(model.tok_emb),
        "attention q, k, v, o (2*D*H*hd + 2*D*K*hd per layer)": count(*(b.attn for b in blocks)),
        "SwiGLU MLP w1, w2, w3 (3 * D * F per layer)": count(*(b.mlp for b in blocks)),
        "RMSNorm gains (2 * D per layer, + D final)": count(
            *(b.attn_norm for b in blocks), *(b.mlp_norm for b in blocks), model.norm
        ),
        "output head (D * V, or 0 when tied)": head,
    }
    # model.parameters() yields a shared tensor once, so the total counts a tied matrix once.
    assert sum(parts.values()) == count(model)
    return parts


def demo() -> None:
    torch.manual_seed(0)
    cfg = Config(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=100, max_seq_len=32)
    model = Transformer(cfg).eval()
    print(cfg)
    print(f"head_dim={cfg.head_dim}, hidden_dim={cfg.hidden_dim}")

    print("\nparameters:")
    parts = param_breakdown(model)
    for name, n in parts.items():
        print(f"  {name:<55} {n:>9,}")
    print(f"  {'total':<55} {sum(parts.values()):>9,}")

    # Print the output shape of every sub-module on one forward pass.
    def show(name: str):
        return lambda module, inputs, output: print(f"  {name:<22} -> {tuple(output.shape)}")

    modules = dict(model.named_modules())
    watched = ["tok_emb", "layers.0.attn_norm", "layers.0.attn.wq", "layers.0.attn.wk"]
    watched += ["layers.0.attn", "layers.0.mlp.w1", "layers.0.mlp", "layers.0", "layers.1"]
    for name in watched + ["norm", "lm_head"]:
        modules[name].register_forward_hook(show(name))

    idx = torch.randint(0, cfg.vocab_size, (2, 11))  # a batch of 2 sequences of 11 tokens
    inputs, targets = idx[:, :-1], idx[:, 1:]  # predict token t+1 from tokens 0..t
    B, T = inputs.shape
    H, K, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    print(f"\nforward pass on inputs {(B, T)}; inner shapes shown for layer 0:")
    with torch.no_grad():
        logits, loss = model(inputs, targets)
    print(f"  inside attention: q {(B, H, T, hd)}, k and v {(B, K, T, hd)} repeated to")
    print(f"  {(B, H, T, hd)}, scores and weights {(B, H, T, T)}")
    print(f"logits {tuple(logits.shape)}, loss {loss.item():.3f} (ln V = {math.log(100):.3f})")


if __name__ == "__main__":
    demo()
