"""Grouped MoE expert computation in plain torch: the CPU path and the reference for the Triton kernel.

Tokens are sorted by expert so every active expert runs as one dense GEMM over all the rows routed to
it (instead of one GEMV per token), then the weighted results are scattered back.
"""

import torch
import torch.nn.functional as F


def group_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """Flat (token * K + k) indices sorted by expert, and the row count of each expert.

    Ids < 0 mark experts that live on another rank (expert parallelism) and are left out.
    """
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids.clamp(min=-1) + 1, minlength=num_experts + 1)
    skipped = int(counts[0])
    return order[skipped:], counts[1:].tolist()


def fused_moe_torch(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """out[t] = sum_k w[t,k] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = ids[t,k]; see kernels/ops.py."""
    num_experts, two_i, _ = w_gate_up.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    order, counts = group_by_expert(topk_ids, num_experts)
    token_rows = order // top_k
    weights = topk_weights.reshape(-1)[order].to(torch.float32).unsqueeze(1)
    xs = x.index_select(0, token_rows)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        gate_up = F.linear(xs[start:end], w_gate_up[expert])
        hidden = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = F.linear(hidden, w_down[expert])
        # rows are unique within one expert (top-k never repeats an expert), so a plain indexed add
        # is exact; index_add_ is an order of magnitude slower on CPU for these small row counts
        rows = token_rows[start:end]
        out[rows] += y.to(torch.float32) * weights[start:end]
        start = end
    return out.to(x.dtype)
