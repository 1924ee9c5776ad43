"""The decoder-only Transformer, assembled from its components according to a ``ModelConfig``.

    idx (B, T) ─ tok_emb ─ pos.embed ─ emb_norm ─ dropout ─ [block] x n_layers ─ norm ─ lm_head
                                                               │
                      positions act here too: pos.rotate (RoPE) and pos.bias (ALiBi) in attention

Notable choices: GPT-2-style initialisation (std 0.02, residual projections scaled by
1/sqrt(2 n_layers); each component says which of its projections are residual outputs) and
costs summed from what each component reports; no weight decay on norms, biases and embeddings; a single attention mask
built once per forward and shared by all layers.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from llm_foundry.models.attention import attention_mask, document_mask, padding_mask
from llm_foundry.models.block import build_block
from llm_foundry.models.kv_cache import KVCache, bytes_per_position
from llm_foundry.models.linear import Linear
from llm_foundry.models.loss import head_loss
from llm_foundry.models.moe import MoE, load_balancing_loss, router_z_loss
from llm_foundry.models.norm import build_norm, init_norm
from llm_foundry.models.position import build_position

if TYPE_CHECKING:
    from llm_foundry.config import ModelConfig

IGNORE_INDEX = -100


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos = build_position(cfg)
        self.emb_norm = build_norm(cfg) if cfg.embed_norm else nn.Identity()
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(build_block(cfg) for _ in range(cfg.n_layers))
        # post-norm blocks already end in a norm; pre-norm stacks need one before the head
        self.norm = build_norm(cfg) if cfg.norm_position == "pre" else nn.Identity()
        self.lm_head = Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight  # one matrix reads and writes tokens
        # a mask tensor is needed only when attention is more than "causal": a window or a bias
        self.needs_mask = cfg.sliding_window is not None or self.pos.has_bias
        # trade compute for memory: keep only block inputs, recompute the rest in backward
        self.activation_checkpointing = False
        # with targets, the head and loss in chunks (models/loss.py): forward returns no logits
        self.fused_loss = False
        self.init_weights()

    # ------------------------------------------------------------------------------------------
    def init_weights(self) -> None:
        """GPT-2 initialisation: N(0, init_std) for matrices and embeddings, zero biases, unit
        norms; projections that write into the residual stream (each component names its own)
        get std / sqrt(2 n_layers), so the stream's variance stays O(1) with depth."""
        std = self.cfg.init_std
        residual_std = std / math.sqrt(2 * self.cfg.n_layers)
        nn.init.normal_(self.tok_emb.weight, mean=0.0, std=std)
        self.pos.init_weights(std)
        init_norm(self.emb_norm)
        for layer in self.layers:
            layer.init_weights(std, residual_std)
        init_norm(self.norm)
        # when tied this redraws the shared matrix: a seed gives the weights it always gave
        self.lm_head.init_weights(std)

    # ------------------------------------------------------------------------------------------
    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        ignore_index: int = IGNORE_INDEX,
        cache: KVCache | None = None,
        last_only: bool = False,
        doc: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """idx, targets: (B, T) token ids -> logits (B, T, vocab) and the mean cross-entropy over
        targets that are not ``ignore_index`` (None without targets). With ``fused_loss`` set
        and targets given: (None, the loss), computed by ``loss.head_loss`` without the logits.

        With a ``cache`` the T tokens continue the cached ones (positions cache.length..), and
        their keys/values are added to it. ``last_only`` computes logits of the last position
        only (B, 1, vocab): all that decoding needs. ``doc`` (B, T) numbers the documents packed
        into each row: attention stays inside each (with relative positions, RoPE or ALiBi, a
        packed document then computes what it computes alone).
        """
        x, _ = self._trunk(idx, need_weights=False, cache=cache, doc=doc)
        if last_only:
            x = x[:, -1:]
        if targets is not None and self.fused_loss:  # head and loss by chunks: no logits
            return None, head_loss(self.lm_head, x, targets, ignore_index)
        logits = self.lm_head(x)  # (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                logits.flatten(0, 1).float(), targets.flatten(), ignore_index=ignore_index
            )
        return logits, loss

    @torch.no_grad()
    def attention_weights(self, idx: torch.Tensor) -> list[torch.Tensor]:
        """Attention probabilities of every layer for ``idx`` (B, T): a list of (B, H, T, T)."""
        _, weights = self._trunk(idx, need_weights=True)
        return weights

    def new_cache(self, batch_size: int, max_len: int | None = None, dtype=None) -> KVCache:
        """An empty KV cache for ``batch_size`` sequences of up to ``max_len`` tokens."""
        w = self.tok_emb.weight
        return KVCache(
            self.cfg, batch_size, max_len or self.cfg.max_seq_len, w.device, dtype or w.dtype
        )

    def _trunk(self, idx: torch.Tensor, need_weights: bool, cache: KVCache | None = None, doc=None):
        """Embeddings and blocks: idx (B, T) -> final hidden states (B, T, D), attention weights."""
        T = idx.shape[1]
        start = cache.length if cache is not None else 0
        pad = cache.pad if cache is not None else None  # left padding of batched prompts
        x = self.drop(self.emb_norm(self.pos.embed(self.tok_emb(idx), start, pad)))
        mask = None  # plain causal over the T tokens alone: SDPA's own causal kernel
        if self.needs_mask or cache is not None or doc is not None:
            q_pos = torch.arange(start, start + T, device=idx.device)
            k_pos = cache.key_positions(start, T) if cache is not None else q_pos
            mask = attention_mask(
                q_pos, k_pos, self.cfg.sliding_window, self.pos.bias(q_pos, k_pos)
            )
            if pad is not None:
                mask = mask + padding_mask(q_pos, k_pos, pad)
            if doc is not None:
                mask = mask + document_mask(doc)
        weights = []
        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for i, layer in enumerate(self.layers):
            kv = (cache, i) if cache is not None else None
            if recompute:
                x, w = checkpoint(
                    layer, x, self.pos, start, mask, need_weights, kv, use_reentrant=False
                )
            else:
                x, w = layer(x, self.pos, start, mask, need_weights, kv)
            weights.append(w)
        if cache is not None:
            cache.advance(start, T)
        return self.norm(x), weights

    # ------------------------------------------------------------------------------------------
    # Mixture of experts
    def moe_layers(self) -> list[MoE]:
        """The blocks' expert layers (empty for a dense model)."""
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, MoE)]

    def routing_losses(self) -> dict[str, torch.Tensor]:
        """The last forward's balancing loss and router z-loss over all expert layers, unweighted
        (empty for a dense model); ``aux_loss`` weighs them."""
        moes = self.moe_layers()
        if not moes or any(m.router_logits is None for m in moes):
            return {}
        logits = [m.router_logits for m in moes]
        return {
            "balance_loss": load_balancing_loss(logits, self.cfg.experts_per_token),
            "z_loss": router_z_loss(logits),
        }

    def aux_loss(self) -> torch.Tensor | None:
        """What training adds to the cross-entropy for the last forward: moe_aux_loss_coef x the
        balancing loss + router_z_loss_coef x the z-loss (None for a dense model)."""
        losses = self.routing_losses()
        if not losses:
            return None
        c = self.cfg
        return (
            c.moe_aux_loss_coef * losses["balance_loss"] + c.router_z_loss_coef * losses["z_loss"]
        )

    # ------------------------------------------------------------------------------------------
    # Costs
    def num_params(self, non_embedding: bool = False) -> int:
        """Parameters, each shared tensor once. ``non_embedding`` leaves out the token-embedding
        and learned-position tables (lookups, not compute); an untied output head stays in."""
        held: dict[int, int] = {}  # each tensor once; a module holding weights packed counts them
        for m in self.modules():
            count = getattr(m, "weights_in", None)
            for p in m.parameters(recurse=False):
                held.setdefault(id(p), count(p) if count else p.numel())
        n = sum(held.values())
        if non_embedding:
            n -= self.tok_emb.weight.numel()
            n -= sum(m.weight.numel() for m in self.pos.modules() if isinstance(m, nn.Embedding))
        return n

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token at context ``seq_len`` (forward + backward = 3x forward,
        Kaplan et al. 2020): what each block reports (6 per active matrix weight, plus attention
        scores and weighted sum, 12 * n_heads * head_dim * seq_len; PaLM, Chowdhery 2022) and
        the output head."""
        T = seq_len or self.cfg.max_seq_len
        return (
            sum(layer.flops_per_token(T) for layer in self.layers) + self.lm_head.flops_per_token()
        )

    def active_params(self) -> int:
        """Parameters each token passes through: all of them in a dense model; a layer whose
        parts are not all used per token (experts) reports fewer."""
        idle = sum(
            sum(p.numel() for p in layer.parameters()) - layer.active_params()
            for layer in self.layers
        )
        return self.num_params() - idle

    def kv_cache_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        """Bytes of K and V cached per token across all layers: 2 * n_layers * n_kv_heads * hd."""
        return bytes_per_position(self.cfg, bytes_per_value)

    def param_groups(self, weight_decay: float) -> list[dict]:
        """AdamW groups: decay matrices; no decay for norms, biases and embedding tables."""
        no_decay_ids = {id(m.weight) for m in self.modules() if isinstance(m, nn.Embedding)}
        decay, no_decay = [], []
        for p in self.parameters():
            if not p.requires_grad:
                continue
            (decay if p.dim() >= 2 and id(p) not in no_decay_ids else no_decay).append(p)
        return [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
