"""Building blocks shared by every decoder family (and reused by DeepSeek-V3).

Modules see flat token batches [T, D] without padding. Parameter names inside the blocks follow
the transformers-5 names (q_proj, gate_up_proj, shared_expert, ...) so checkpoint mapping stays a
prefix rewrite. Weights always come from a checkpoint: the loader builds models on the meta device
and fills them, so modules do no random initialisation of their own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from batchgen.engine.models.context import AttentionContext
from batchgen.kernels import activation_cpu, capture, moe_packed_cpu, ops, registry
from batchgen.kernels.expert_parallel import LocalDispatcher

# Rope types whose frequencies depend only on the config. "dynamic" and "longrope" re-derive them from
# the longest sequence in the batch, which makes a token's output depend on its batch neighbours.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class RMSNorm(nn.Module):
    """Normalises in float32 and scales in the input dtype, like the HF Llama/Qwen/Mixtral norms (kernels.ops.rms_norm:
    on float32 CPU tensors one C call instead of seven torch ops)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class Linear(nn.Linear):
    """nn.Linear computed by kernels.ops.linear: on CPU a decode step's few rows go through a C kernel that reads the
    weight at memory speed (BLAS runs such GEMVs far slower)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)


class RotaryEmbedding:
    """cos/sin tables per position, from the config's rope parameters (transformers' own init functions,
    so linear / llama3 / yarn scaling match exactly). `dim` is the rotated head dimension.

    Not an nn.Module: it holds no weights, and its float32 frequencies must survive the loader's
    meta-device construction and dtype casts untouched.
    """

    def __init__(self, config, dim: int):
        params = config.rope_parameters
        rope_type = params.get("rope_type", "default")
        if rope_type not in STATIC_ROPE_TYPES:
            raise ValueError(
                f"rope_type {rope_type!r} is not supported (supported: {', '.join(STATIC_ROPE_TYPES)})"
            )
        with torch.device("cpu"):
            if rope_type == "default":  # every head dim rotated: these families' default RoPE ignores a
                # partial_rotary_factor in the config, as transformers' does
                exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
                inv_freq, scaling = 1.0 / (params["rope_theta"] ** exponents), 1.0
            else:
                inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        if inv_freq.numel() * 2 != dim:
            raise ValueError(f"rope parameters give {inv_freq.numel() * 2} rotary dims, the model uses {dim}")
        self.inv_freq = inv_freq
        self.scaling = float(scaling)

    def for_context(self, ctx, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of `ctx.positions`, computed once per attention context: every layer of a forward asks for
        the same tables (kept on the context, which lives for one micro-batch of one step)."""
        tables = ctx.__dict__.setdefault("_rotary_tables", {})
        key = (id(self), dtype)
        if key not in tables:
            tables[key] = self(ctx.positions, dtype)
        return tables[key]

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, dim] in `dtype` (computed in float32 like transformers)."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


class GQAAttention(nn.Module):
    """Grouped-query attention; the KV cache and the attention itself belong to the context."""

    def __init__(
        self,
        layer: int,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm_eps: float | None = None,
    ):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.rotary = rotary
        self.q_proj = Linear(hidden_size, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = Linear(num_heads * head_dim, hidden_size, bias=o_bias)
        # Qwen3: per-head RMSNorm on q and k before rotary.
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None

    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = self.rotary.for_context(ctx, x.dtype)
        q, k = ops.rotary(q, cos, sin), ops.rotary(k, cos, sin)
        out = ctx.attend(self.layer, q, k, v, self.scale)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)): dense layers, Qwen shared experts, DeepSeek shared experts."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if registry.batch_invariant():  # torch's silu rounds the elements its threads' scalar tails take apart
            return self.down_proj(activation_cpu.silu_mul(gate, up))
        return self.down_proj(F.silu(gate) * up)


class SoftmaxTopKRouter(nn.Module):
    """Softmax over all experts (in float32), then top-k; optionally renormalised over the k chosen.

    `round_to_model_dtype`: Qwen rounds the weights to the activation dtype, Mixtral keeps float32.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, normalize: bool,
                 round_to_model_dtype: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.top_k = top_k
        self.normalize = normalize
        self.round_to_model_dtype = round_to_model_dtype

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> topk_weights [T, K], topk_ids [T, K] int64."""
        weights, ids = ops.router_topk(x, self.weight, self.top_k, self.normalize)
        if self.round_to_model_dtype:
            weights = weights.to(x.dtype)
        return weights, ids


class FusedExperts(nn.Module):
    """The routed experts' weights in the transformers-5 fused layout, computed by kernels.ops.fused_moe.

    gate_up_proj [E, 2I, D] (gate rows, then up rows); down_proj [E, D, I], or both packed for the CPU kernel
    (`pack_for_cpu`, kernels/moe_packed_cpu.py), which kernels.ops.fused_moe_packed computes. Under expert
    parallelism a rank keeps only experts [first_expert, first_expert + E / ranks) (`keep_shard`, before the weights
    load) and its dispatcher sends each token to the ranks holding its experts and sums their results back; on one
    rank the dispatcher is the identity.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts = num_experts
        self.first_expert = 0
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.dispatcher = LocalDispatcher(num_experts)
        # memory-constrained mode: computes the experts from weights streamed into device slots (engine/offload)
        self.streamed: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    @property
    def packed(self) -> bool:
        """Whether the weights are in moe_packed_cpu's layout (4-D), not the checkpoint's."""
        return self.gate_up_proj.dim() == 4

    @property
    def moe(self) -> Callable[..., torch.Tensor]:
        """The op computing these experts from weights in their layout (each expert's, also a slot of them)."""
        return ops.fused_moe_packed if self.packed else ops.fused_moe

    @property
    def num_local_experts(self) -> int:
        return self.gate_up_proj.shape[0]

    def keep_shard(self, rank: int, ranks: int) -> None:
        """Hold only rank `rank`'s contiguous share of the experts (the parameters are re-made empty)."""
        if self.num_experts % ranks:
            raise ValueError(f"expert parallel: {self.num_experts} experts do not split evenly over {ranks} ranks")
        local = self.num_experts // ranks
        self.first_expert = rank * local
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(self, name)
            setattr(self, name, nn.Parameter(full.new_empty((local, *full.shape[1:])), requires_grad=False))

    def pack_for_cpu(self) -> None:
        """Repack the weights, in their own storage, into the CPU kernel's layout (kernels/moe_packed_cpu.py)."""
        if self.packed:
            return
        if not (self.gate_up_proj.is_contiguous() and self.down_proj.is_contiguous()):
            raise ValueError("expert weights to pack in place must be contiguous")  # before either is packed
        self.gate_up_proj = nn.Parameter(moe_packed_cpu.pack_in_place(self.gate_up_proj.data,
                                                                      moe_packed_cpu.pack_gate_up), requires_grad=False)
        self.down_proj = nn.Parameter(moe_packed_cpu.pack_in_place(self.down_proj.data, moe_packed_cpu.pack_down),
                                      requires_grad=False)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        sent = self.dispatcher.dispatch(x, topk_ids, topk_weights)
        if self.streamed is not None:
            y = self.streamed(sent.x, sent.topk_weights, sent.topk_ids)
        else:
            y = self.moe(sent.x, self.gate_up_proj, self.down_proj, sent.topk_weights, sent.topk_ids)
        return self.dispatcher.combine(y, sent)


class SparseMoE(nn.Module):
    """Router + routed experts (+ optional shared expert, optionally sigmoid-gated as in Qwen2-MoE).

    The router is any module mapping x [T, D] to (topk_weights, topk_ids), so a DeepSeek-style
    sigmoid / group-limited router plugs in unchanged. `on_route`, when set, sees every routing decision
    (topk_ids [T, K]) so the engine can count tokens per expert.
    """

    def __init__(self, gate: nn.Module, experts: FusedExperts, shared_expert: nn.Module | None = None,
                 shared_expert_gate: nn.Linear | None = None):
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_expert_gate
        self.on_route: Callable[[torch.Tensor], None] | None = None

    @property
    def num_experts(self) -> int:
        return self.experts.num_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(x)
        padding = capture.padding()
        if padding is not None and padding.shape[0] == topk_ids.shape[0]:
            topk_ids.masked_fill_(padding, -1)  # a replay's padding rows join no expert (an id < 0 is skipped)
        if self.on_route is not None:
            capture.effect(self.on_route, topk_ids)  # counted again when a recorded forward replays
        out = self.experts(x, topk_weights, topk_ids)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = self._gate(x) * shared
            out = out + shared
        return out

    def _gate(self, x: torch.Tensor) -> torch.Tensor:
        """sigmoid(gate(x)), one value a row. Batch-invariant (kernels.registry): the C linear kernel and the C sigmoid
        (torch's rounds the rows its vector loop's scalar tail takes apart)."""
        if not registry.batch_invariant():
            return torch.sigmoid(self.shared_expert_gate(x))
        return activation_cpu.sigmoid(ops.linear(x, self.shared_expert_gate.weight, self.shared_expert_gate.bias))


class AttentionBlock(nn.Module):
    """x + attention(norm(x)): the engine's first yield point of a layer sits at its exit. Under tensor
    parallelism the attention yields this rank's partial sum, which `sum_over_ranks` all-reduces."""

    def __init__(self, input_layernorm: RMSNorm, self_attn: nn.Module):
        super().__init__()
        self.input_layernorm = input_layernorm
        self.self_attn = self_attn
        self.sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        out = self.self_attn(self.input_layernorm(x), ctx)
        return x + (out if self.sum_over_ranks is None else self.sum_over_ranks(out))


class FeedForwardBlock(nn.Module):
    """x + mlp(norm(x)), the mlp being dense or sparse (MoE); a partial sum under tensor parallelism."""

    def __init__(self, post_attention_layernorm: RMSNorm, mlp: nn.Module):
        super().__init__()
        self.post_attention_layernorm = post_attention_layernorm
        self.mlp = mlp
        self.sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.mlp(self.post_attention_layernorm(x))
        return x + (out if self.sum_over_ranks is None else self.sum_over_ranks(out))


class DecoderLayer(nn.Module):
    """One transformer layer as two separately callable blocks (the engine runs them apart)."""

    def __init__(self, attn: AttentionBlock, ffn: FeedForwardBlock):
        super().__init__()
        self.attn = attn
        self.ffn = ffn
        self.is_moe = isinstance(ffn.mlp, SparseMoE)

    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        return self.ffn(self.attn(x, ctx))
