"""Attention and KV-cache writes in plain torch: the CPU path and the reference for the GPU kernels."""

import torch
import torch.nn.functional as F

from batchgen.kernels.capture import read_back

# Upper bound on gathered K+V elements per decode chunk, so long contexts x large batches stay in memory.
DECODE_GATHER_BUDGET = 1 << 24


def bottom_right_causal_mask(len_q: int, len_k: int, device: torch.device) -> torch.Tensor:
    """Query i (the (len_k - len_q + i)-th position) sees keys 0 .. len_k - len_q + i."""
    return torch.ones(len_q, len_k, dtype=torch.bool, device=device).tril(diagonal=len_k - len_q)


# A prefill group pads every sequence to its longest: a sequence joins only if that wastes at most this share.
PREFILL_PAD_SLACK = 0.25


def prefill_attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Varlen causal attention. Whole-prompt sequences (len_q == len_k) run as a few padded batched SDPA
    calls over groups of similar length; sequences continuing a cached prefix run one call each."""
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    bounds_q, bounds_k = read_back(cu_seqlens_q), read_back(cu_seqlens_k)
    whole, continued = [], []
    for b in range(len(bounds_q) - 1):
        len_q, len_k = bounds_q[b + 1] - bounds_q[b], bounds_k[b + 1] - bounds_k[b]
        if len_q > len_k:
            raise ValueError(f"prefill_attention: sequence {b} has {len_q} queries but only {len_k} keys")
        if len_q:
            (whole if len_q == len_k else continued).append(b)
    for group in _similar_length_groups(whole, bounds_q):
        _padded_causal_attention(q, k, v, out, [bounds_q[b] for b in group], [bounds_k[b] for b in group],
                                 [bounds_q[b + 1] - bounds_q[b] for b in group], scale)
    for b in continued:
        q_start, q_end, k_start, k_end = bounds_q[b], bounds_q[b + 1], bounds_k[b], bounds_k[b + 1]
        mask = bottom_right_causal_mask(q_end - q_start, k_end - k_start, q.device)
        out[q_start:q_end] = F.scaled_dot_product_attention(
            q[q_start:q_end].transpose(0, 1), k[k_start:k_end].transpose(0, 1), v[k_start:k_end].transpose(0, 1),
            attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
        ).transpose(0, 1)
    return out


def _similar_length_groups(seqs: list[int], bounds: list[int]) -> list[list[int]]:
    """Sequences sorted longest first, cut so each group's padding stays within PREFILL_PAD_SLACK."""
    order = sorted(seqs, key=lambda b: bounds[b + 1] - bounds[b], reverse=True)
    groups: list[list[int]] = []
    longest = 0
    for b in order:
        length = bounds[b + 1] - bounds[b]
        if not groups or length < longest * (1 - PREFILL_PAD_SLACK):
            groups.append([])
            longest = length
        groups[-1].append(b)
    return groups


def _padded_causal_attention(q, k, v, out, starts_q: list[int], starts_k: list[int], lengths: list[int],
                             scale: float) -> None:
    """One SDPA over sequences right-padded to the longest. Causal masking keeps every real query off
    the padding (which repeats the sequence's last token and is never written back)."""
    device = q.device
    span = torch.arange(max(lengths), device=device)
    lens = torch.tensor(lengths, device=device)
    offsets = torch.minimum(span[None, :], lens[:, None] - 1)
    rows_q = torch.tensor(starts_q, device=device)[:, None] + offsets
    rows_k = torch.tensor(starts_k, device=device)[:, None] + offsets
    attended = F.scaled_dot_product_attention(
        q[rows_q].transpose(1, 2), k[rows_k].transpose(1, 2), v[rows_k].transpose(1, 2),
        is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
    ).transpose(1, 2)
    real = span[None, :] < lens[:, None]
    out[rows_q[real]] = attended[real]


def decode_chunks(seq_lens: list[int], row_cost: int, budget: int):
    """Consecutive (start, end, max_len) row ranges whose padded gather stays under budget elements."""
    start, longest = 0, 0
    for row, length in enumerate(seq_lens):
        grown = max(longest, length)
        if row > start and (row + 1 - start) * grown * row_cost > budget:
            yield start, row, longest
            start, grown = row, length
        longest = grown
    if start < len(seq_lens):
        yield start, len(seq_lens), longest


def paged_decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Gather each chunk of sequences' pages into padded K/V and run one masked SDPA per chunk."""
    batch, heads, _ = q.shape
    _, page_size, kv_heads, dim_k = k_cache.shape
    dim_v = v_cache.shape[-1]
    out = q.new_empty(batch, heads, dim_v)
    lens = seq_lens.to(device=q.device, dtype=torch.long)
    lengths = read_back(seq_lens)
    if lengths and max(lengths) > page_table.shape[1] * page_size:
        row = max(range(batch), key=lengths.__getitem__)
        raise ValueError(
            f"paged_decode_attention: seq_lens[{row}] = {lengths[row]} exceeds page_table capacity "
            f"{page_table.shape[1]} pages x {page_size}"
        )
    for start, end, max_len in decode_chunks(lengths, kv_heads * (dim_k + dim_v), DECODE_GATHER_BUDGET):
        num_pages = -(-max_len // page_size)
        rows = end - start
        page_ids = torch.arange(num_pages, device=q.device)
        live_page = page_ids * page_size < lens[start:end, None]
        table = torch.where(live_page, page_table[start:end, :num_pages].long(), 0)
        keys = k_cache[table].reshape(rows, num_pages * page_size, kv_heads, dim_k).transpose(1, 2)
        values = v_cache[table].reshape(rows, num_pages * page_size, kv_heads, dim_v).transpose(1, 2)
        positions = torch.arange(num_pages * page_size, device=q.device)
        valid = (positions < lens[start:end, None])[:, None, None, :]
        out[start:end] = F.scaled_dot_product_attention(
            q[start:end].unsqueeze(2),
            keys,
            values,
            attn_mask=valid,
            scale=scale,
            enable_gqa=heads != kv_heads,
        ).squeeze(2)
    return out


def write_kv_torch(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter token rows into their cache slots; negative slots (padding tokens) are skipped."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    slots = slot_mapping.long()
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))
