"""Softmax top-k routing in plain torch: the reference, and the path of every device and dtype the C kernel does not
take."""

import torch
import torch.nn.functional as F


def router_topk_torch(x: torch.Tensor, weight: torch.Tensor, top_k: int, normalize: bool
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax (in float32) of x's router logits over all experts, then the top_k; optionally renormalised over
    them. Returns float32 weights and int64 ids, [T, top_k] each, largest first."""
    probs = torch.softmax(F.linear(x, weight).float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
