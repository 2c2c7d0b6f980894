"""Fused MoE in Triton: align -> gate/up grouped GEMM (row gather + SiLU-and-mul fused) -> down grouped
GEMM (routing weight fused) -> sum over top-k.

Each program computes one BLOCK_M x BLOCK_N tile of one expert: its rows are gathered straight from
x through the aligned sorted ids, so no permuted copy of the activations is ever materialised.
"""

import torch
import triton
import triton.language as tl

from batchgen.kernels.moe_align import ExpertBlocks, align_to_blocks
from batchgen.kernels.moe_config import moe_config

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    weights_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_padded_ptr,
    N,
    K,
    max_padded,
    num_pairs,
    up_offset,
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    ROWS_PER_TOKEN: tl.constexpr,
    GATED: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
):
    """C[pair] = act(A[pair // ROWS_PER_TOKEN] @ B[expert].T) for the pairs of one aligned block.

    GATED: B holds gate rows [0, N) and up rows [N, 2N) (offset up_offset); C = silu(gate) * up.
    MUL_WEIGHT: C rows are scaled by the routing weight of their pair.
    """
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(max_padded, BLOCK_SIZE_M)
    num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
    pids_in_group = GROUP_SIZE_M * num_pid_n
    first_pid_m = (pid // pids_in_group) * GROUP_SIZE_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_SIZE_M)
    pid_m = first_pid_m + (pid % pids_in_group) % group_size_m
    pid_n = (pid % pids_in_group) // group_size_m

    num_padded = tl.load(num_padded_ptr)
    if pid_m * BLOCK_SIZE_M >= num_padded:
        return

    offs_m = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
    pair_ids = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)
    row_mask = pair_ids < num_pairs
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_SIZE_K)

    a_ptrs = a_ptr + (pair_ids // ROWS_PER_TOKEN)[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for k_block in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
        k_mask = offs_k < K - k_block * BLOCK_SIZE_K
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if GATED:
            b_up = tl.load(b_ptrs + up_offset, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_SIZE_K * stride_ak
        b_ptrs += BLOCK_SIZE_K * stride_bk

    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up
    if MUL_WEIGHT:
        weight = tl.load(weights_ptr + pair_ids, mask=row_mask, other=0.0).to(tl.float32)
        acc = acc * weight[:, None]
    c_ptrs = c_ptr + pair_ids[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


def grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    blocks: ExpertBlocks,
    config: dict[str, int],
    rows_per_token: int,
    gated: bool,
    weights: torch.Tensor | None = None,
) -> None:
    """Launch one grouped GEMM over the aligned blocks: c [pairs, N] <- a rows x b [E, N(*2), K]."""
    n_out = b.shape[1] // 2 if gated else b.shape[1]
    k_in = b.shape[2]
    grid = (triton.cdiv(blocks.max_padded, blocks.block_m) * triton.cdiv(n_out, config["BLOCK_SIZE_N"]),)
    _grouped_gemm_kernel[grid](
        a,
        b,
        c,
        weights if weights is not None else c,
        blocks.sorted_ids,
        blocks.expert_ids,
        blocks.num_padded,
        n_out,
        k_in,
        blocks.max_padded,
        c.shape[0],
        n_out * b.stride(1),
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        c.stride(0),
        c.stride(1),
        ROWS_PER_TOKEN=rows_per_token,
        GATED=gated,
        MUL_WEIGHT=weights is not None,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else None,
        BLOCK_SIZE_M=blocks.block_m,
        BLOCK_SIZE_N=config["BLOCK_SIZE_N"],
        BLOCK_SIZE_K=config["BLOCK_SIZE_K"],
        GROUP_SIZE_M=config["GROUP_SIZE_M"],
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )


def fused_moe_triton(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """Same contract as kernels.ops.fused_moe; `config` overrides the tuned/default block sizes."""
    if x.dtype not in _TL_DTYPES:
        raise ValueError(f"fused_moe (triton): unsupported dtype {x.dtype}")
    num_tokens, dim = x.shape
    num_experts, two_i, _ = w_gate_up.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    if num_tokens == 0:
        return torch.zeros_like(x)
    config = config or moe_config(num_tokens, num_experts, inter, x.device)
    blocks = align_to_blocks(topk_ids, num_experts, config["BLOCK_SIZE_M"])
    num_pairs = num_tokens * top_k
    hidden = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    grouped_gemm(x, w_gate_up, hidden, blocks, config, rows_per_token=top_k, gated=True)
    # Pairs routed to remote experts (id < 0) are never written: start from zeros.
    per_pair = torch.zeros(num_pairs, dim, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).contiguous()
    grouped_gemm(hidden, w_down, per_pair, blocks, config, rows_per_token=1, gated=False, weights=weights)
    return per_pair.view(num_tokens, top_k, dim).sum(dim=1)
