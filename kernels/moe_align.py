"""Align routed (token, k) pairs into per-expert blocks of BLOCK_M rows for the grouped GEMM kernel.

Each block holds rows of one expert only; experts are padded up to a multiple of BLOCK_M with the
sentinel T*K. Everything stays on the device (no host sync): buffers are sized by an upper bound and
the kernel stops at `num_padded`.
"""

from dataclasses import dataclass

import torch


@dataclass
class ExpertBlocks:
    sorted_ids: torch.Tensor  # [max_padded] int32 flat (t * K + k) indices grouped by expert, sentinel T*K
    expert_ids: torch.Tensor  # [max_padded // block_m] int32 expert of each block (num_experts past the end)
    num_padded: torch.Tensor  # [1] int32 rows of sorted_ids in use (a multiple of block_m)
    block_m: int

    @property
    def max_padded(self) -> int:
        return self.sorted_ids.numel()


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows needed in the worst case: every active expert wastes at most block_m - 1 rows."""
    active = min(num_pairs, num_experts)
    return -(-(num_pairs + active * (block_m - 1)) // block_m) * block_m


def align_to_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """Group the flat routing of topk_ids [T, K] by expert; ids < 0 (remote experts) are dropped."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    device = flat.device
    bucket = torch.where(flat < 0, num_experts, flat)
    order = torch.argsort(bucket, stable=True)
    sorted_bucket = bucket[order]
    # each expert's first row in the sorted order; counts as differences (torch.bincount would synchronise
    # with a GPU to size its output)
    count_bounds = torch.searchsorted(sorted_bucket, torch.arange(num_experts + 1, device=device))
    count_start = count_bounds[:-1]
    counts = count_bounds[1:] - count_start
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded

    local = sorted_bucket < num_experts
    expert_of = sorted_bucket.clamp(max=num_experts - 1)
    rank_in_expert = torch.arange(num_pairs, device=device) - count_start[expert_of]
    max_padded = max_padded_rows(num_pairs, num_experts, block_m)
    # Remote pairs go to a spare trailing slot that is cut off.
    position = torch.where(local, padded_start[expert_of] + rank_in_expert, max_padded)
    sorted_ids = torch.full((max_padded + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, position, order.to(torch.int32))

    block_starts = torch.arange(0, max_padded, block_m, device=device)
    expert_ids = torch.searchsorted(padded_end, block_starts, right=True).to(torch.int32)
    num_padded = padded_end[-1:].to(torch.int32)
    return ExpertBlocks(sorted_ids[:max_padded], expert_ids, num_padded, block_m)
