"""Grouped MoE expert computation in plain torch: the CPU path and the reference for the Triton kernel.

Tokens are sorted by expert so every active expert runs as one dense GEMM over all the rows routed to
it (instead of one GEMV per token), then the weighted results are scattered back.
"""

from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F

from batchgen.kernels.capture import read_back


def group_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """Flat (token * K + k) indices sorted by expert, and the row count of each expert.

    Ids < 0 mark experts that live on another rank (expert parallelism) and are left out.
    """
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids.clamp(min=-1) + 1, minlength=num_experts + 1)
    skipped = int(counts[0])
    return order[skipped:], read_back(counts[1:])


@dataclass
class RoutedRows:
    """Every (token, k) pair routed to an expert of this rank, as rows sorted by expert."""

    xs: torch.Tensor  # [R, D] the token's hidden state, once per routed pair
    token_rows: torch.Tensor  # [R] int64 output row of each
    weights: torch.Tensor  # [R] float32 routing weight of each
    counts: list[int]  # rows per expert
    starts: list[int]  # expert e's rows are [starts[e], starts[e + 1])


def route_rows(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int) -> RoutedRows:
    order, counts = group_by_expert(topk_ids, num_experts)
    token_rows = order // topk_ids.shape[1]
    return RoutedRows(x.index_select(0, token_rows), token_rows,
                      topk_weights.reshape(-1)[order].to(torch.float32), counts, list(accumulate(counts, initial=0)))


def fused_moe_torch(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """out[t] = sum_k w[t,k] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = ids[t,k]; see kernels/ops.py."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    accumulate_moe(out, x, w_gate_up, w_down, topk_weights, topk_ids)
    return out.to(x.dtype)


def accumulate_moe(out: torch.Tensor, x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> None:
    """fused_moe_torch's sum added to `out` (float32) before it is rounded to x's dtype: calls over parts of the
    experts (a streamed layer's windows) summed here round once, as one call over all of them does."""
    rows = route_rows(x, topk_weights, topk_ids, w_gate_up.shape[0])
    accumulate_experts(out, rows, [e for e, count in enumerate(rows.counts) if count], w_gate_up, w_down)


def accumulate_experts(out: torch.Tensor, rows: RoutedRows, experts: list[int], w_gate_up: torch.Tensor,
                       w_down: torch.Tensor) -> None:
    """out[token] += weight * expert(x) for the rows of each of `experts`: one dense GEMM pair per expert."""
    inter = w_gate_up.shape[1] // 2
    for expert in experts:
        start, end = rows.starts[expert], rows.starts[expert + 1]
        gate_up = F.linear(rows.xs[start:end], w_gate_up[expert])
        hidden = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = F.linear(hidden, w_down[expert])
        # rows are unique within one expert (top-k never repeats an expert), so a plain indexed add
        # is exact; index_add_ is an order of magnitude slower on CPU for these small row counts
        out[rows.token_rows[start:end]] += y.to(torch.float32) * rows.weights[start:end].unsqueeze(1)
