"""Greedy picks in plain torch: the reference, and the path of every device and dtype the C kernel does not take."""

import torch


def argmax_torch(logits: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest value (the first on ties; a NaN counts as the largest)."""
    return logits.argmax(dim=-1)
