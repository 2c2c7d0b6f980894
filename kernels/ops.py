"""The kernel ops models call. Each checks its input, then runs the backend the registry picks for the
tensors' device and dtype (Triton / flash-attn on CUDA, torch on CPU; see kernels/registry.py)."""

import torch

from batchgen.kernels import registry
from batchgen.kernels.checks import (
    check_argmax_inputs,
    check_decode_inputs,
    check_linear_inputs,
    check_moe_inputs,
    check_packed_moe_inputs,
    check_prefill_inputs,
    check_rms_norm_inputs,
    check_rotary_inputs,
    check_router_inputs,
    check_write_kv_inputs,
)


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """out[t] = sum_k w[t,k] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t,k].

    x [T, D]; w_gate_up [E, 2*I, D] (gate rows first, then up); w_down [E, D, I];
    topk_weights [T, K] float; topk_ids [T, K] int64 (an id < 0 means "expert on another rank": skipped).
    Returns [T, D] in x.dtype.
    """
    check_moe_inputs(x, w_gate_up, w_down, topk_weights, topk_ids)
    return registry.dispatch("fused_moe", x)(x, w_gate_up, w_down, topk_weights, topk_ids)


def fused_moe_packed(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """fused_moe on expert weights packed by kernels/moe_packed_cpu.py (float32 CPU tensors):
    w_gate_up [E, I/16, D, 32]; w_down [E, D/32, I, 32]; the rest as fused_moe."""
    check_packed_moe_inputs(x, w_gate_up, w_down, topk_weights, topk_ids)
    return registry.dispatch("fused_moe_packed", x)(x, w_gate_up, w_down, topk_weights, topk_ids)


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Varlen causal attention; the queries of sequence b are the last len_q of its len_k positions.

    q [Tq, H, Dk]; k [Tk, Hkv, Dk]; v [Tk, Hkv, Dv]; cu_seqlens_* int32 [B+1]. Returns [Tq, H, Dv].
    """
    check_prefill_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k)
    return registry.dispatch("prefill_attention", q)(q, k, v, cu_seqlens_q, cu_seqlens_k, scale)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence against its paged KV.

    q [B, H, Dk]; k_cache [pages, page_size, Hkv, Dk]; v_cache [pages, page_size, Hkv, Dv];
    page_table [B, max_pages] int32; seq_lens [B] int32 (valid keys, current token included).
    Returns [B, H, Dv]. MLA (absorbed, latent KV) is Hkv = 1 with Dk = rank + rope_dim, Dv = rank.
    """
    check_decode_inputs(q, k_cache, v_cache, page_table, seq_lens)
    return registry.dispatch("paged_decode_attention", q)(q, k_cache, v_cache, page_table, seq_lens, scale)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k_cache/v_cache slot slot_mapping[t] (= page * page_size + offset) <- k[t]/v[t], in place.

    k [T, Hkv, Dk]; v [T, Hkv, Dv]; slot_mapping [T] int64; a negative slot (padding) is skipped.
    """
    check_write_kv_inputs(k, v, k_cache, v_cache, slot_mapping)
    registry.dispatch("write_kv", k_cache)(k, v, k_cache, v_cache, slot_mapping)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias, as torch.nn.functional.linear: x [..., D]; weight [O, D]; bias [O] or None.
    Returns [..., O] in x.dtype."""
    check_linear_inputs(x, weight, bias)
    return registry.dispatch("linear", x)(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last dim, normalised in float32 and scaled in x.dtype (the HF
    Llama/Qwen/Mixtral norm): x [..., D]; weight [D]."""
    check_rms_norm_inputs(x, weight)
    return registry.dispatch("rms_norm", x)(x, weight, eps)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x rotated in the half-split (GPT-NeoX) layout: x * cos + cat(-x2, x1) * sin, x = [x1 | x2].
    x [T, H, dim]; cos, sin [T, dim] in x.dtype. Returns a new [T, H, dim] tensor."""
    check_rotary_inputs(x, cos, sin)
    return registry.dispatch("rotary", x)(x, cos, sin)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest value, as torch.argmax(logits, dim=-1): the first on ties, a NaN counting
    as the largest. logits [R, V], V >= 1. Returns [R] int64."""
    check_argmax_inputs(logits)
    return registry.dispatch("argmax", logits)(logits)


def router_topk(x: torch.Tensor, weight: torch.Tensor, top_k: int, normalize: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """A softmax router: softmax (in float32) of x @ weight.T over the experts, then the top_k, largest first;
    `normalize` rescales the k weights to sum to one. x [T, D]; weight [E, D]; 1 <= top_k <= E. Returns float32
    weights and int64 ids, [T, top_k] each."""
    check_router_inputs(x, weight, top_k)
    return registry.dispatch("router_topk", x)(x, weight, top_k, normalize)
