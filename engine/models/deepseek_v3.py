"""DeepSeek-V3: multi-head latent attention (MLA) and a group-limited sigmoid-routed MoE.

Attention runs in the absorbed form, so the KV cache holds the compressed latent rather than
per-head keys and values: one cache "head" with k = [normed latent ; roped k_pe] and v = the normed
latent. The query is absorbed into the latent space (q_nope @ W_UK per head), and the attention
output is expanded back per head (@ W_UV) before o_proj. Everything else (norms, rotary tables,
dense MLP, fused experts, layer blocks, LM wrapper) is the shared decoder machinery.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.engine.models.context import AttentionContext, KVSpec
from batchgen.engine.models.decoder import DecoderLM, embedding_and_head
from batchgen.engine.models.layers import (
    AttentionBlock,
    DecoderLayer,
    FeedForwardBlock,
    FusedExperts,
    GatedMLP,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    SparseMoE,
)
from batchgen.engine.models.registry import ModelFamily, UnsupportedModelError
from batchgen.kernels import activation_cpu, ops, registry

# transformers builds q_a_layernorm / kv_a_layernorm with the RMSNorm default eps, not rms_norm_eps.
LORA_NORM_EPS = 1e-6


class MLAAttention(nn.Module):
    """Multi-head latent attention; parameter names follow transformers' DeepseekV3Attention."""

    def __init__(
        self,
        layer: int,
        hidden_size: int,
        num_heads: int,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        rotary: RotaryEmbedding,
        rope_interleave: bool,
        scale: float,
        bias: bool = False,
    ):
        super().__init__()
        self.layer = layer
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.rotary = rotary
        self.rope_interleave = rope_interleave
        self.scale = scale
        qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        if q_lora_rank is None:
            self.q_proj = Linear(hidden_size, num_heads * qk_head_dim, bias=False)
        else:
            self.q_a_proj = Linear(hidden_size, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = Linear(q_lora_rank, num_heads * qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.o_proj = Linear(num_heads * v_head_dim, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        tokens = x.shape[0]
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(tokens, self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], -1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], -1)
        latent = self.kv_a_layernorm(latent).unsqueeze(1)  # [T, 1, rank]

        cos, sin = self.rotary.for_context(ctx, x.dtype)
        q_pe = ops.rotary(self._half_split(q_pe), cos, sin)
        k_pe = ops.rotary(self._half_split(k_pe.unsqueeze(1)), cos, sin)

        w_uk, w_uv = self.kv_b_proj.weight.view(self.num_heads, -1, self.kv_lora_rank).split(
            [self.qk_nope_head_dim, self.v_head_dim], dim=1
        )
        q_latent = per_head(q_nope, self._uk_rows(w_uk) if registry.batch_invariant() else w_uk.transpose(1, 2))
        out = ctx.attend(
            self.layer, torch.cat((q_latent, q_pe), -1), torch.cat((latent, k_pe), -1), latent, self.scale
        )
        out = per_head(out, w_uv)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.v_head_dim))

    def _uk_rows(self, w_uk: torch.Tensor) -> torch.Tensor:
        """w_uk [H, n, r] transposed to rows the C linear kernel streams, [H, r, n] contiguous: made once (for a
        batch-invariant engine, whose per-head calls would otherwise copy each head's strided weight every call, and
        every decode recording hold such copies), again only if the weight changes."""
        key = (w_uk.data_ptr(), w_uk._version)
        if getattr(self, "_uk_rows_key", None) != key:
            self._uk_rows_cache = w_uk.transpose(1, 2).contiguous()
            self._uk_rows_key = key
        return self._uk_rows_cache

    def _half_split(self, x: torch.Tensor) -> torch.Tensor:
        """DeepSeek checkpoints pair rotary dims as (0,1),(2,3)...; regrouping evens then odds makes
        that the half-split layout ops.rotary rotates (q and k alike, so scores are unchanged)."""
        if not self.rope_interleave:
            return x
        return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def per_head(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, H, n] times each head's weight [H, o, n] transposed: [T, H, o]. One einsum, whose rounding follows the
    batch's rows (BLAS blocks them); batch-invariant (kernels.registry), one C linear call per head, each row's
    sums in one order."""
    if not registry.batch_invariant():
        return torch.einsum("thn,hon->tho", x, weight)
    return torch.stack([ops.linear(x[:, h], weight[h]) for h in range(weight.shape[0])], dim=1)


class GroupLimitedSigmoidRouter(nn.Module):
    """DeepSeek-V3 routing, in float32 like transformers (its weight is never cast to the model dtype).

    Sigmoid scores; the choice adds e_score_correction_bias, keeps only the `topk_group` best expert
    groups (each scored by its two best experts) and takes the top-k there; the weights are the
    unbiased scores of the chosen experts, optionally renormalised, times routed_scaling_factor.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, num_groups: int, topk_groups: int,
                 normalize: bool, scaling_factor: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32),
                                                    requires_grad=False)
        self.top_k = top_k
        self.num_groups = num_groups
        self.topk_groups = topk_groups
        self.normalize = normalize
        self.scaling_factor = scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> topk_weights [T, K] float32, topk_ids [T, K] int64."""
        if registry.batch_invariant():  # the C linear kernel and the C sigmoid (engine/models/layers.GatedMLP)
            scores = activation_cpu.sigmoid(ops.linear(x.float(), self.weight.float()))
        else:
            scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        tokens, experts = choice.shape
        per_group = experts // self.num_groups
        grouped = choice.view(tokens, self.num_groups, per_group)
        group_scores = grouped.topk(min(2, per_group), dim=-1)[0].sum(-1)
        best_groups = group_scores.topk(self.topk_groups, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        choice = choice.masked_fill(~group_mask.repeat_interleave(per_group, dim=1), float("-inf"))
        ids = choice.topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling_factor, ids

    def _apply(self, fn, recurse=True):
        """Casting the model (model.to(bf16)) moves the router but keeps it float32, like transformers'
        _keep_in_fp32_modules: routing decisions must not change with the activation dtype."""
        return super()._apply(lambda t: fn(t).float() if t.is_floating_point() else fn(t), recurse)


def build_deepseek_v3(hf_config) -> DecoderLM:
    """Our DeepSeek-V3 from a transformers DeepseekV3Config; layers >= first_k_dense_replace are MoE."""
    cfg = hf_config
    _check_config(cfg)
    hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
    rotary = RotaryEmbedding(cfg, cfg.qk_rope_head_dim)
    scale = softmax_scale(cfg)
    first_moe = cfg.first_k_dense_replace or 0
    layers = []
    for index in range(cfg.num_hidden_layers):
        attention = MLAAttention(
            index, hidden, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim, cfg.v_head_dim, rotary, bool(cfg.rope_interleave), scale,
            bias=bool(cfg.attention_bias),
        )
        mlp = _moe(cfg) if index >= first_moe else GatedMLP(hidden, cfg.intermediate_size)
        layers.append(DecoderLayer(
            AttentionBlock(RMSNorm(hidden, eps), attention),
            FeedForwardBlock(RMSNorm(hidden, eps), mlp),
        ))
    embed_tokens, lm_head = embedding_and_head(cfg.vocab_size, hidden, bool(cfg.tie_word_embeddings))
    kv_spec = KVSpec(cfg.num_hidden_layers, 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.kv_lora_rank)
    return DecoderLM(embed_tokens, layers, RMSNorm(hidden, eps), lm_head, kv_spec)


def softmax_scale(cfg) -> float:
    """qk_head_dim ** -0.5, times yarn's mscale(factor, mscale_all_dim) ** 2 when that is set."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    params = cfg.rope_parameters or {}
    mscale_all_dim = params.get("mscale_all_dim") or 0
    factor = params.get("factor") or 1.0
    if params.get("rope_type", "default") != "default" and mscale_all_dim and factor > 1:
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def _moe(cfg) -> SparseMoE:
    router = GroupLimitedSigmoidRouter(
        cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group or 1, cfg.topk_group or 1,
        bool(cfg.norm_topk_prob), float(cfg.routed_scaling_factor),
    )
    shared = cfg.moe_intermediate_size * (cfg.n_shared_experts or 0)
    return SparseMoE(
        router,
        FusedExperts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size),
        shared_expert=GatedMLP(cfg.hidden_size, shared) if shared else None,
    )


def _check_config(cfg) -> None:
    def bad(field: str, why: str) -> UnsupportedModelError:
        return UnsupportedModelError(f"deepseek_v3 config: {field} {why}")

    if cfg.hidden_act != "silu":
        raise bad("hidden_act", f"must be 'silu', got {cfg.hidden_act!r}")
    groups, experts = cfg.n_group or 1, cfg.n_routed_experts
    if experts % groups:
        raise bad("n_group", f"({groups}) must divide n_routed_experts ({experts})")
    if not 1 <= (cfg.topk_group or 1) <= groups:
        raise bad("topk_group", f"must be in [1, n_group={groups}], got {cfg.topk_group}")
    top_k, reachable = cfg.num_experts_per_tok, experts // groups * (cfg.topk_group or 1)
    if top_k > reachable:
        raise bad("num_experts_per_tok", f"({top_k}) exceeds the {reachable} experts in topk_group groups")


# The checkpoint names its shared experts `shared_experts`; SparseMoE calls the module `shared_expert`.
FAMILY = ModelFamily(build_deepseek_v3, ((r"\.mlp\.shared_experts\.", ".mlp.shared_expert."),))
