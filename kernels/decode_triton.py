"""Paged decode attention in Triton, split over the KV length (flash-decoding).

Stage 1: one program per (sequence, KV head, split) reads its slice of the sequence's pages through the
page table and computes, for all the query heads of that KV head (GQA), a partial output normalised
within the split plus its log-sum-exp. Stage 2 merges the splits with the log-sum-exp weights.
Dk may differ from Dv (MLA latent KV: Hkv = 1, Dk = rank + rope_dim, Dv = rank); Dk is walked in chunks,
so non-power-of-two sizes such as 576 cost no padding to 1024. A program holds at most ACC_ELEMENTS of output
sums (its registers): the query heads of a KV head are taken in blocks (16 at a time at Dv 512, MLA's 128 heads in
8 programs, each reading the same pages from L2).

A sequence's splits follow from its own length alone (at least min_keys_per_split keys each, at most MAX_SPLITS),
and the merge always reduces MAX_SPLITS slots: its output does not depend on the other sequences of the batch
(the page table's width, a decode graph's padding), bit for bit.
"""

import torch
import triton
import triton.language as tl

BLOCK_N = 32  # keys per inner step
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 16
ACC_ELEMENTS = 8192  # BLOCK_H x BLOCK_DV float32 sums a program holds


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    page_table_ptr,
    seq_lens_ptr,
    partial_ptr,
    lse_ptr,
    scale,
    group_size,
    head_blocks,
    dim_k,
    dim_v,
    page_size,
    min_keys_per_split,
    stride_qb,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_pt,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1) // head_blocks
    head_block = tl.program_id(1) % head_blocks
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    splits = tl.maximum(1, tl.minimum(MAX_SPLITS, tl.cdiv(seq_len, min_keys_per_split)))
    keys_per_split = tl.cdiv(tl.cdiv(seq_len, splits), BLOCK_N) * BLOCK_N
    start = split * keys_per_split
    end = tl.minimum(start + keys_per_split, seq_len)

    offs_h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = offs_h < group_size
    heads = kv_head * group_size + offs_h
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_mask = offs_dv < dim_v
    q_rows = q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh

    m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_DV), dtype=tl.float32)
    for n_start in range(start, end, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        page = tl.load(
            page_table_ptr + seq.to(tl.int64) * stride_pt + offs_n // page_size, mask=n_mask, other=0
        )
        page = page.to(tl.int64)
        in_page = (offs_n % page_size).to(tl.int64)
        k_rows = k_ptr + page * stride_kp + in_page * stride_ks + kv_head * stride_kh
        scores = tl.zeros((BLOCK_H, BLOCK_N), dtype=tl.float32)
        for d_start in range(0, dim_k, BLOCK_DK):
            offs_d = d_start + tl.arange(0, BLOCK_DK)
            d_mask = offs_d < dim_k
            q = tl.load(q_rows + offs_d[None, :], mask=head_mask[:, None] & d_mask[None, :], other=0.0)
            k = tl.load(k_rows[None, :] + offs_d[:, None], mask=d_mask[:, None] & n_mask[None, :], other=0.0)
            scores = tl.dot(q, k, scores, input_precision=DOT_PRECISION)
        scores = tl.where(n_mask[None, :], scores * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_rows = v_ptr + page * stride_vp + in_page * stride_vs + kv_head * stride_vh
        v = tl.load(v_rows[:, None] + offs_dv[None, :], mask=n_mask[:, None] & dv_mask[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    o_ptrs = partial_ptr + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + split * stride_os
    tl.store(o_ptrs + offs_dv[None, :], out, mask=head_mask[:, None] & dv_mask[None, :])
    tl.store(lse_ptr + seq.to(tl.int64) * stride_lb + heads * stride_lh + split, lse, mask=head_mask)


@triton.jit
def _merge_splits_kernel(
    partial_ptr,
    lse_ptr,
    out_ptr,
    num_splits,
    dim_v,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    BLOCK_S: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < num_splits
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_mask = offs_dv < dim_v
    lse = tl.load(lse_ptr + seq * stride_lb + head * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
    top = tl.max(lse, axis=0)
    weights = tl.exp(lse - tl.where(top == float("-inf"), 0.0, top))  # no keys at all (length 0): zeros, not NaN
    total = tl.sum(weights, axis=0)
    weights = weights / tl.where(total > 0, total, 1.0)
    parts = tl.load(
        partial_ptr + seq * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps + offs_dv[None, :],
        mask=s_mask[:, None] & dv_mask[None, :],
        other=0.0,
    )
    out = tl.sum(parts * weights[:, None], axis=0)
    tl.store(
        out_ptr + seq * stride_ob + head * stride_oh + offs_dv, out.to(out_ptr.dtype.element_ty), mask=dv_mask
    )


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    min_keys_per_split: int = MIN_KEYS_PER_SPLIT,
) -> torch.Tensor:
    """Same contract as kernels.ops.paged_decode_attention; a sequence is split into pieces of at least
    `min_keys_per_split` keys."""
    batch, heads, dim_k = q.shape
    _, page_size, kv_heads, _ = k_cache.shape
    dim_v = v_cache.shape[-1]
    group_size = heads // kv_heads
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("paged_decode_attention (triton): q, k_cache and v_cache need a unit stride in D")
    # the most splits any sequence of the table can have: the others' programs past their last split store nothing
    num_splits = max(1, min(MAX_SPLITS, triton.cdiv(page_table.shape[1] * page_size, min_keys_per_split)))
    out = torch.empty(batch, heads, dim_v, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    partial = torch.empty(batch, heads, num_splits, dim_v, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=q.device)
    block_dv = triton.next_power_of_2(dim_v)
    block_h = max(16, min(triton.next_power_of_2(group_size), ACC_ELEMENTS // max(16, block_dv)))
    head_blocks = triton.cdiv(group_size, block_h)
    dot_precision = "ieee" if q.dtype == torch.float32 else None  # exact fp32, default otherwise
    _decode_split_kernel[(batch, kv_heads * head_blocks, num_splits)](
        q,
        k_cache,
        v_cache,
        page_table,
        seq_lens,
        partial,
        lse,
        scale,
        group_size,
        head_blocks,
        dim_k,
        dim_v,
        page_size,
        min_keys_per_split,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        page_table.stride(0),
        partial.stride(0),
        partial.stride(1),
        partial.stride(2),
        lse.stride(0),
        lse.stride(1),
        BLOCK_H=block_h,
        BLOCK_N=BLOCK_N,
        BLOCK_DK=min(64, max(16, triton.next_power_of_2(dim_k))),
        BLOCK_DV=max(16, block_dv),
        MAX_SPLITS=MAX_SPLITS,
        DOT_PRECISION=dot_precision,
    )
    _merge_splits_kernel[(batch, heads)](
        partial,
        lse,
        out,
        num_splits,
        dim_v,
        partial.stride(0),
        partial.stride(1),
        partial.stride(2),
        lse.stride(0),
        lse.stride(1),
        out.stride(0),
        out.stride(1),
        BLOCK_S=MAX_SPLITS,  # one reduction order whatever the grid's split count
        BLOCK_DV=block_dv,
    )
    return out
