"""RMSNorm in plain torch: the reference, and the path of every device and dtype the C kernel does not take."""

import torch


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalises in float32 and scales in the input dtype, like the HF Llama/Qwen/Mixtral norms."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)
