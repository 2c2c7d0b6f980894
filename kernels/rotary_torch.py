"""Rotary position embedding in plain torch: the reference, and the path of every device and dtype the C kernel
does not take."""

import torch


def rotary_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, dim] rotated in the half-split (GPT-NeoX) layout; cos/sin [T, dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
