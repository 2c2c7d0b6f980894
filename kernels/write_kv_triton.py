"""Write new K/V rows into their cache pages in Triton: one program per (token, KV head)."""

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    dim_k,
    dim_v,
    page_size,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcp,
    stride_kcs,
    stride_kch,
    stride_vcp,
    stride_vcs,
    stride_vch,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    page = slot // page_size
    in_page = slot % page_size
    offs_k = tl.arange(0, BLOCK_DK)
    k_mask = offs_k < dim_k
    k_row = tl.load(k_ptr + token * stride_kt + head * stride_kh + offs_k, mask=k_mask)
    k_dst = k_cache_ptr + page * stride_kcp + in_page * stride_kcs + head * stride_kch + offs_k
    tl.store(k_dst, k_row.to(k_cache_ptr.dtype.element_ty), mask=k_mask)
    offs_v = tl.arange(0, BLOCK_DV)
    v_mask = offs_v < dim_v
    v_row = tl.load(v_ptr + token * stride_vt + head * stride_vh + offs_v, mask=v_mask)
    v_dst = v_cache_ptr + page * stride_vcp + in_page * stride_vcs + head * stride_vch + offs_v
    tl.store(v_dst, v_row.to(v_cache_ptr.dtype.element_ty), mask=v_mask)


def write_kv_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Same contract as kernels.ops.write_kv (negative slots skipped)."""
    num_tokens, kv_heads, dim_k = k.shape
    dim_v = v.shape[2]
    if num_tokens == 0:
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("write_kv (triton): k, v and the caches need a unit stride in D")
    _write_kv_kernel[(num_tokens, kv_heads)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        dim_k,
        dim_v,
        k_cache.shape[1],
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        BLOCK_DK=triton.next_power_of_2(dim_k),
        BLOCK_DV=triton.next_power_of_2(dim_v),
    )
