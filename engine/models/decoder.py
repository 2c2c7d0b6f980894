"""The generic decoder-only LM: embed -> (attention block, feed-forward block) x L -> norm -> lm_head.

Llama, Qwen2, Qwen3, Mixtral, Qwen2-MoE and Qwen3-MoE are all `build_decoder(DecoderConfig)`;
they differ only in the switches of DecoderConfig (see registry.py for each family's settings).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from batchgen.engine.models.context import AttentionContext, KVSpec
from batchgen.engine.models.layers import (
    AttentionBlock,
    DecoderLayer,
    FeedForwardBlock,
    FusedExperts,
    GatedMLP,
    GQAAttention,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    SoftmaxTopKRouter,
    SparseMoE,
)


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int
    normalize_topk: bool  # renormalise the k chosen probabilities to sum to 1
    round_weights_to_model_dtype: bool
    shared_expert_size: int = 0  # 0: no shared expert
    shared_expert_gated: bool = False  # sigmoid(Linear(D, 1)) gate on the shared expert (Qwen2-MoE)


@dataclass(frozen=True)
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense layers
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    moe: MoEConfig | None = None
    moe_layers: tuple[int, ...] = ()  # indices of the layers whose MLP is the sparse MoE block


class DecoderLM(nn.Module):
    """A causal LM over flat token batches; the engine drives embed / layers[i].attn / .ffn / head itself."""

    def __init__(self, embed_tokens: nn.Embedding, layers: list[DecoderLayer], norm: RMSNorm,
                 lm_head: nn.Linear, kv_spec: KVSpec):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.lm_head = lm_head
        self.vocab_size = embed_tokens.num_embeddings
        self._kv_spec = kv_spec
        # set when lm_head holds this rank's slice of the vocabulary: the ranks' logits side by side
        self.gather_vocab: Callable[[torch.Tensor], torch.Tensor] | None = None

    def kv_spec(self) -> KVSpec:
        return self._kv_spec

    def observe_routing(self, observer: Callable[[torch.Tensor, int], None]) -> None:
        """Have every sparse MoE block report its routing (topk_ids [T, K], number of experts)."""
        for module in self.modules():
            if isinstance(module, SparseMoE):
                module.on_route = lambda ids, experts=module.num_experts: observer(ids, experts)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Rows of the table, looked up where it lives (host memory in memory-constrained mode)."""
        table = self.embed_tokens.weight
        if table.device == input_ids.device:
            return self.embed_tokens(input_ids)
        return self.embed_tokens(input_ids.to(table.device)).to(input_ids.device)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.norm(hidden))
        return logits if self.gather_vocab is None else self.gather_vocab(logits)

    def forward(self, input_ids: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """input_ids [T] -> logits [T, V]."""
        hidden = self.embed(input_ids)
        for layer in self.layers:
            hidden = layer(hidden, ctx)
        return self.head(hidden)


def embedding_and_head(vocab_size: int, hidden_size: int, tied: bool) -> tuple[nn.Embedding, nn.Linear]:
    embed_tokens = nn.Embedding(vocab_size, hidden_size)
    lm_head = Linear(hidden_size, vocab_size, bias=False)
    if tied:
        lm_head.weight = embed_tokens.weight
    return embed_tokens, lm_head


def build_decoder(cfg: DecoderConfig, hf_config) -> DecoderLM:
    """`hf_config` supplies the rope parameters (read by transformers' rope init functions)."""
    rotary = RotaryEmbedding(hf_config, cfg.head_dim)
    layers = []
    for index in range(cfg.num_layers):
        attention = GQAAttention(
            index, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, rotary,
            qkv_bias=cfg.qkv_bias, o_bias=cfg.o_bias, qk_norm_eps=cfg.rms_norm_eps if cfg.qk_norm else None,
        )
        if index in cfg.moe_layers:
            mlp = _sparse_moe(cfg.hidden_size, cfg.moe)
        else:
            mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        layers.append(DecoderLayer(
            AttentionBlock(RMSNorm(cfg.hidden_size, cfg.rms_norm_eps), attention),
            FeedForwardBlock(RMSNorm(cfg.hidden_size, cfg.rms_norm_eps), mlp),
        ))
    embed_tokens, lm_head = embedding_and_head(cfg.vocab_size, cfg.hidden_size, cfg.tie_word_embeddings)
    kv_spec = KVSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim)
    return DecoderLM(embed_tokens, layers, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps), lm_head, kv_spec)


def _sparse_moe(hidden_size: int, moe: MoEConfig) -> SparseMoE:
    shared = GatedMLP(hidden_size, moe.shared_expert_size) if moe.shared_expert_size else None
    return SparseMoE(
        SoftmaxTopKRouter(hidden_size, moe.num_experts, moe.top_k, moe.normalize_topk,
                          moe.round_weights_to_model_dtype),
        FusedExperts(moe.num_experts, hidden_size, moe.intermediate_size),
        shared_expert=shared,
        shared_expert_gate=nn.Linear(hidden_size, 1, bias=False) if shared and moe.shared_expert_gated else None,
    )
