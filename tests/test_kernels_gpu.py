"""Kernels on a real GPU at model-sized shapes (run with `-m gpu` on a CUDA host)."""

import importlib.util

import pytest
import torch

from batchgen.kernels import ops, registry
from batchgen.kernels.attention_torch import paged_decode_attention_torch, prefill_attention_torch
from batchgen.kernels.moe_torch import fused_moe_torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
needs_flash_attn = pytest.mark.skipif(
    importlib.util.find_spec("flash_attn") is None, reason="flash-attn missing"
)


def test_auto_backends_on_cuda():
    assert registry.resolve("fused_moe", "cuda", torch.bfloat16)[0] == "triton"
    assert registry.resolve("paged_decode_attention", "cuda", torch.bfloat16)[0] == "triton"
    assert registry.resolve("write_kv", "cuda", torch.bfloat16)[0] == "triton"
    expected_prefill = "flash_attn" if importlib.util.find_spec("flash_attn") else "torch"
    assert registry.resolve("prefill_attention", "cuda", torch.bfloat16)[0] == expected_prefill
    assert registry.resolve("prefill_attention", "cuda", torch.float32)[0] == "torch"


@pytest.mark.parametrize(
    "tokens,top_k,dtype", [(1, 2, torch.bfloat16), (300, 2, torch.bfloat16), (64, 8, torch.float16)]
)
def test_fused_moe_triton_cuda(tokens, top_k, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    experts, dim, inter = 16, 1024, 512
    x = torch.randn(tokens, dim, device="cuda", generator=g).to(dtype)
    w_gate_up = (torch.randn(experts, 2 * inter, dim, device="cuda", generator=g) / dim**0.5).to(dtype)
    w_down = (torch.randn(experts, dim, inter, device="cuda", generator=g) / inter**0.5).to(dtype)
    topk_weights, topk_ids = torch.randn(tokens, experts, device="cuda", generator=g).softmax(-1).topk(top_k)
    out = ops.fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids)
    assert registry.last_used("fused_moe") == "triton"
    ref = fused_moe_torch(x.float(), w_gate_up.float(), w_down.float(), topk_weights, topk_ids)
    torch.testing.assert_close(out.float(), ref, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("heads,kv_heads,dim_k,dim_v", [(32, 8, 128, 128), (16, 1, 576, 512), (128, 1, 576, 512)])
def test_paged_decode_triton_cuda(heads, kv_heads, dim_k, dim_v):
    g = torch.Generator(device="cuda").manual_seed(0)
    page_size, lens = 64, [1, 63, 64, 65, 2000, 4097]
    pages = [-(-n // page_size) for n in lens]
    k_cache = torch.randn(sum(pages) + 3, page_size, kv_heads, dim_k, device="cuda", generator=g).bfloat16()
    v_cache = torch.randn(sum(pages) + 3, page_size, kv_heads, dim_v, device="cuda", generator=g).bfloat16()
    order = torch.randperm(sum(pages) + 3, device="cuda", generator=g).int()
    table = torch.full((len(lens), max(pages)), -1, dtype=torch.int32, device="cuda")
    start = 0
    for b, n in enumerate(pages):
        table[b, :n] = order[start : start + n]
        start += n
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(len(lens), heads, dim_k, device="cuda", generator=g).bfloat16()
    out = ops.paged_decode_attention(q, k_cache, v_cache, table, seq_lens, dim_k**-0.5)
    assert registry.last_used("paged_decode_attention") == "triton"
    ref = paged_decode_attention_torch(
        q.float(), k_cache.float(), v_cache.float(), table, seq_lens, dim_k**-0.5
    )
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


@needs_flash_attn
@pytest.mark.parametrize("dim_k,dim_v", [(128, 128), (192, 128), (576, 512)])  # 576 / 512: MLA, past flash-attn
def test_flash_prefill_matches_torch(dim_k, dim_v):
    g = torch.Generator(device="cuda").manual_seed(0)
    lens_q, lens_k = [17, 1, 300], [17, 40, 812]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens_q), 16, dim_k, device="cuda", generator=g).bfloat16()
    k = torch.randn(sum(lens_k), 4, dim_k, device="cuda", generator=g).bfloat16()
    v = torch.randn(sum(lens_k), 4, dim_v, device="cuda", generator=g).bfloat16()
    out = ops.prefill_attention(q, k, v, cu_q, cu_k, dim_k**-0.5)
    assert registry.last_used("prefill_attention") == "flash_attn"
    ref = prefill_attention_torch(q.float(), k.float(), v.float(), cu_q, cu_k, dim_k**-0.5)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
