"""Varlen prefill attention through flash-attn (imported here only, so its absence costs nothing).

flash-attn >= 2.1 aligns the causal mask bottom-right when queries are fewer than keys, which is the
prefix-cached prefill contract. It needs equal head sizes for q/k and v: the smaller side is zero-padded
(zeros add nothing to q.k, and padded value columns are cut off). Its kernels take head sizes up to
MAX_HEAD_DIM: wider heads (DeepSeek's absorbed MLA attends with 576-wide q/k and 512-wide v) run torch's SDPA.
"""

import torch
import torch.nn.functional as F
from flash_attn import flash_attn_varlen_func

from batchgen.kernels.attention_torch import prefill_attention_torch

MAX_HEAD_DIM = 256


def prefill_attention_flash(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Same contract as kernels.ops.prefill_attention."""
    dim_k, dim_v = q.shape[-1], v.shape[-1]
    if max(dim_k, dim_v) > MAX_HEAD_DIM:
        return prefill_attention_torch(q, k, v, cu_seqlens_q, cu_seqlens_k, scale)
    if dim_v < dim_k:
        v = F.pad(v, (0, dim_k - dim_v))
    elif dim_k < dim_v:
        q, k = F.pad(q, (0, dim_v - dim_k)), F.pad(k, (0, dim_v - dim_k))
    cu_q = cu_seqlens_q.to(torch.int32)
    cu_k = cu_seqlens_k.to(torch.int32)
    max_q = int((cu_q[1:] - cu_q[:-1]).max()) if cu_q.numel() > 1 else 0
    max_k = int((cu_k[1:] - cu_k[:-1]).max()) if cu_k.numel() > 1 else 0
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=True)
    return out if out.shape[-1] == dim_v else out[..., :dim_v].contiguous()
