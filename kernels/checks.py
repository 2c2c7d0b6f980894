"""Shape and dtype checks run by kernels/ops.py before dispatch, so every backend sees valid input.

They look at metadata only (no device synchronisation) and name the offending tensor and field.
"""

import torch

from batchgen.kernels import moe_packed_cpu


def _require(condition: bool, op: str, message) -> None:
    """`message`: a string, or a function making it (only when the check fails: the checks run on every call)."""
    if not condition:
        raise ValueError(f"{op}: {message() if callable(message) else message}")


def _shape(t: torch.Tensor) -> str:
    return str(list(t.shape))


def check_moe_inputs(x, w_gate_up, w_down, topk_weights, topk_ids) -> None:
    op = "fused_moe"
    _require(x.dim() == 2, op, lambda: f"x must be [T, D], got {_shape(x)}")
    _require(w_gate_up.dim() == 3, op, lambda: f"w_gate_up must be [E, 2*I, D], got {_shape(w_gate_up)}")
    num_experts, two_i, dim = w_gate_up.shape
    _require(two_i % 2 == 0, op, lambda: f"w_gate_up dim 1 must be 2*I (gate then up), got {two_i}")
    _require(dim == x.shape[1], op, lambda: f"w_gate_up {_shape(w_gate_up)} does not match x {_shape(x)} in D")
    _require(
        tuple(w_down.shape) == (num_experts, dim, two_i // 2),
        op,
        lambda: f"w_down must be [E, D, I] = {[num_experts, dim, two_i // 2]}, got {_shape(w_down)}",
    )
    _check_routing(op, x, w_gate_up, w_down, topk_weights, topk_ids)


def check_packed_moe_inputs(x, w_gate_up, w_down, topk_weights, topk_ids) -> None:
    op = "fused_moe_packed"
    _require(x.dim() == 2, op, lambda: f"x must be [T, D], got {_shape(x)}")
    gate, wide = moe_packed_cpu.gate_columns(), moe_packed_cpu.down_columns()
    _require(w_gate_up.dim() == 4 and w_gate_up.shape[3] == wide, op,
             lambda: f"w_gate_up must be packed [E, I/{gate}, D, {wide}] on this CPU, got {_shape(w_gate_up)}")
    num_experts, blocks, dim, _ = w_gate_up.shape
    _require(dim == x.shape[1], op, lambda: f"w_gate_up {_shape(w_gate_up)} does not match x {_shape(x)} in D")
    _require(
        dim % wide == 0 and tuple(w_down.shape) == (num_experts, dim // wide, blocks * gate, wide),
        op,
        lambda: f"w_down must be packed [E, D/{wide}, I, {wide}] = {[num_experts, dim // wide, blocks * gate, wide]}, "
                f"got {_shape(w_down)}",
    )
    _require(w_gate_up.is_contiguous() and w_down.is_contiguous(), op, lambda: "packed weights must be contiguous")
    _check_routing(op, x, w_gate_up, w_down, topk_weights, topk_ids)


def _check_routing(op: str, x, w_gate_up, w_down, topk_weights, topk_ids) -> None:
    _require(
        topk_ids.dim() == 2 and topk_ids.shape[0] == x.shape[0],
        op,
        lambda: f"topk_ids must be [T, K] with T = {x.shape[0]}, got {_shape(topk_ids)}",
    )
    _require(
        tuple(topk_weights.shape) == tuple(topk_ids.shape),
        op,
        lambda: f"topk_weights {_shape(topk_weights)} must match topk_ids {_shape(topk_ids)}",
    )
    _require(
        not topk_ids.is_floating_point() and topk_ids.dtype != torch.bool,
        op,
        lambda: f"topk_ids must be an integer tensor, got {topk_ids.dtype}",
    )
    _require(
        x.dtype == w_gate_up.dtype == w_down.dtype,
        op,
        lambda: f"x, w_gate_up, w_down dtypes differ: {x.dtype}, {w_gate_up.dtype}, {w_down.dtype}",
    )


def check_prefill_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k) -> None:
    op = "prefill_attention"
    _require(q.dim() == 3, op, lambda: f"q must be [Tq, H, Dk], got {_shape(q)}")
    _require(k.dim() == 3, op, lambda: f"k must be [Tk, Hkv, Dk], got {_shape(k)}")
    _require(v.dim() == 3, op, lambda: f"v must be [Tk, Hkv, Dv], got {_shape(v)}")
    _require(q.shape[2] == k.shape[2], op, lambda: f"q {_shape(q)} and k {_shape(k)} differ in Dk")
    _require(k.shape[:2] == v.shape[:2], op, lambda: f"k {_shape(k)} and v {_shape(v)} differ in [Tk, Hkv]")
    _require(q.shape[1] % k.shape[1] == 0, op, lambda: f"H = {q.shape[1]} is not a multiple of Hkv = {k.shape[1]}")
    _require(
        cu_seqlens_q.dim() == 1 and cu_seqlens_q.shape == cu_seqlens_k.shape,
        op,
        lambda: f"cu_seqlens_q {_shape(cu_seqlens_q)} and cu_seqlens_k {_shape(cu_seqlens_k)} must both be [B+1]",
    )


def check_decode_inputs(q, k_cache, v_cache, page_table, seq_lens) -> None:
    op = "paged_decode_attention"
    _require(q.dim() == 3, op, lambda: f"q must be [B, H, Dk], got {_shape(q)}")
    _require(k_cache.dim() == 4, op, lambda: f"k_cache must be [pages, page_size, Hkv, Dk], got {_shape(k_cache)}")
    _require(v_cache.dim() == 4, op, lambda: f"v_cache must be [pages, page_size, Hkv, Dv], got {_shape(v_cache)}")
    _require(
        k_cache.shape[:3] == v_cache.shape[:3],
        op,
        lambda: f"k_cache {_shape(k_cache)} and v_cache {_shape(v_cache)} differ in [pages, page_size, Hkv]",
    )
    _require(q.shape[2] == k_cache.shape[3], op, lambda: f"q {_shape(q)} and k_cache {_shape(k_cache)} differ in Dk")
    _require(
        q.shape[1] % k_cache.shape[2] == 0,
        op,
        lambda: f"H = {q.shape[1]} is not a multiple of Hkv = {k_cache.shape[2]}",
    )
    _require(
        q.dtype == k_cache.dtype == v_cache.dtype,
        op,
        lambda: f"q, k_cache, v_cache dtypes differ: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}",
    )
    _require(
        page_table.dim() == 2 and page_table.shape[0] == q.shape[0],
        op,
        lambda: f"page_table must be [B, max_pages] with B = {q.shape[0]}, got {_shape(page_table)}",
    )
    _require(
        tuple(seq_lens.shape) == (q.shape[0],),
        op,
        lambda: f"seq_lens must be [B] = [{q.shape[0]}], got {_shape(seq_lens)}",
    )


def _pages_flat(cache: torch.Tensor) -> bool:
    """True when [pages, page_size] can be viewed as one slot axis (what slot_mapping indexes)."""
    return cache.shape[0] <= 1 or cache.stride(0) == cache.shape[1] * cache.stride(1)


def check_write_kv_inputs(k, v, k_cache, v_cache, slot_mapping) -> None:
    op = "write_kv"
    _require(k.dim() == 3 and v.dim() == 3, op, lambda: f"k, v must be [T, Hkv, D], got {_shape(k)}, {_shape(v)}")
    _require(k.shape[:2] == v.shape[:2], op, lambda: f"k {_shape(k)} and v {_shape(v)} differ in [T, Hkv]")
    _require(
        k_cache.dim() == 4 and tuple(k_cache.shape[2:]) == tuple(k.shape[1:]),
        op,
        lambda: f"k_cache must be [pages, page_size, {k.shape[1]}, {k.shape[2]}], got {_shape(k_cache)}",
    )
    _require(
        v_cache.dim() == 4 and tuple(v_cache.shape[2:]) == tuple(v.shape[1:]),
        op,
        lambda: f"v_cache must be [pages, page_size, {v.shape[1]}, {v.shape[2]}], got {_shape(v_cache)}",
    )
    _require(
        k_cache.shape[:2] == v_cache.shape[:2],
        op,
        lambda: f"k_cache {_shape(k_cache)} and v_cache {_shape(v_cache)} differ in [pages, page_size] (a slot "
                "checked against one would write past the other)",
    )
    _require(
        tuple(slot_mapping.shape) == (k.shape[0],),
        op,
        lambda: f"slot_mapping must be [T] = [{k.shape[0]}], got {_shape(slot_mapping)}",
    )
    _require(
        _pages_flat(k_cache), op, "k_cache pages are not laid out contiguously (slot = page * page_size + i)"
    )
    _require(
        _pages_flat(v_cache), op, "v_cache pages are not laid out contiguously (slot = page * page_size + i)"
    )


def check_linear_inputs(x, weight, bias) -> None:
    op = "linear"
    _require(weight.dim() == 2, op, lambda: f"weight must be [O, D], got {_shape(weight)}")
    _require(x.dim() >= 1 and x.shape[-1] == weight.shape[1], op,
             lambda: f"x {_shape(x)} does not match weight {_shape(weight)} in D")
    _require(bias is None or tuple(bias.shape) == (weight.shape[0],), op,
             lambda: f"bias must be [{weight.shape[0]}], got {_shape(bias)}")


def check_rms_norm_inputs(x, weight) -> None:
    op = "rms_norm"
    _require(weight.dim() == 1, op, lambda: f"weight must be [D], got {_shape(weight)}")
    _require(x.dim() >= 1 and x.shape[-1] == weight.shape[0], op,
             lambda: f"x {_shape(x)} does not match weight {_shape(weight)} in D")


def check_rotary_inputs(x, cos, sin) -> None:
    op = "rotary"
    _require(x.dim() == 3 and x.shape[-1] % 2 == 0, op, lambda: f"x must be [T, H, dim] with dim even, got {_shape(x)}")
    expected = (x.shape[0], x.shape[2])
    _require(tuple(cos.shape) == expected and tuple(sin.shape) == expected, op,
             lambda: f"cos and sin must be [T, dim] = {list(expected)}, got {_shape(cos)} and {_shape(sin)}")


def check_argmax_inputs(logits) -> None:
    op = "argmax"
    _require(logits.dim() == 2 and logits.shape[1] > 0, op, lambda: f"logits must be [R, V] with V >= 1, got "
             f"{_shape(logits)}")
    _require(logits.is_floating_point(), op, lambda: f"logits must be floating point, got {logits.dtype}")


def check_router_inputs(x, weight, top_k) -> None:
    op = "router_topk"
    _require(x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1], op,
             lambda: f"x must be [T, D] and weight [E, D], got {_shape(x)} and {_shape(weight)}")
    _require(1 <= top_k <= weight.shape[0], op, lambda: f"top_k must be in [1, E = {weight.shape[0]}], got {top_k}")
    _require(x.dtype == weight.dtype, op, lambda: f"x ({x.dtype}) and weight ({weight.dtype}) must share a dtype")
