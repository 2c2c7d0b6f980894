"""The per-layer ops of the CPU path (RMSNorm, rotary embedding, KV writes): the C kernels against their torch
references, their input checks, and the engine running them (and the C prefill attention) end to end with the torch
path's greedy tokens."""

from __future__ import annotations

import pytest
import torch
from tiny_models import engine_greedy_tokens, save_tiny_checkpoint

from batchgen.kernels import norm_cpu, ops, prefill_cpu, registry, rotary_cpu, write_kv_cpu
from batchgen.kernels.norm_torch import rms_norm_torch
from batchgen.kernels.rotary_torch import rotary_torch

LAYER_OPS = ("rms_norm", "rotary", "write_kv", "prefill_attention")


def needs(module) -> None:
    if module.unavailable():
        pytest.skip(module.unavailable())


@pytest.mark.parametrize("threads", [1, 3], indirect=True)
@pytest.mark.parametrize("shape", [(1, 512), (3, 5, 64), (700, 96)])  # a decode row, per-head q/k norms, prefill
def test_rms_norm_cpu_matches_torch(shape, threads):
    needs(norm_cpu)
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(*shape, generator=g) * 3, torch.randn(shape[-1], generator=g)
    strided = torch.randn(shape[0], 2 * shape[-1], generator=g)[:, ::2]  # rows not dense: copied first
    with registry.use_backend("rms_norm", "cpu_c"):
        out, out_strided = ops.rms_norm(x, weight, 1e-6), ops.rms_norm(strided, weight, 1e-5)
    assert registry.last_used("rms_norm") == "cpu_c"
    assert out.shape == x.shape and out_strided.shape == strided.shape
    torch.testing.assert_close(out, rms_norm_torch(x, weight, 1e-6), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out_strided, rms_norm_torch(strided, weight, 1e-5), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("threads", [1, 3], indirect=True)
@pytest.mark.parametrize("tokens,heads,dim", [(1, 8, 64), (600, 4, 32), (3, 1, 128)])
def test_rotary_cpu_equals_torch_bit_for_bit(tokens, heads, dim, threads):
    """The products rounded before the sums, as torch's separate ops round them: the same floats exactly, also for
    heads that are a strided view (k of a fused projection)."""
    needs(rotary_cpu)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, 2 * heads, dim, generator=g)[:, ::2]
    cos, sin = torch.randn(tokens, dim, generator=g), torch.randn(tokens, dim, generator=g)
    with registry.use_backend("rotary", "cpu_c"):
        out = ops.rotary(x, cos, sin)
    assert registry.last_used("rotary") == "cpu_c"
    assert torch.equal(out, rotary_torch(x, cos, sin))


def test_write_kv_cpu_names_a_slot_past_the_cache():
    needs(write_kv_cpu)
    cache = torch.zeros(2, 4, 1, 8)
    with registry.use_backend("write_kv", "cpu_c"), pytest.raises(IndexError, match=r"slot_mapping\[1\] = 8 is past"):
        ops.write_kv(torch.ones(2, 1, 8), torch.ones(2, 1, 8), cache, cache.clone(), torch.tensor([3, 8]))
    assert cache.eq(0).all()  # checked before anything is written


@pytest.mark.parametrize("backend", ["torch", "cpu_c"])
def test_write_kv_refuses_caches_of_different_sizes(backend):
    """The C kernel checks a slot against k_cache's size: a smaller v_cache was written past its end."""
    if backend == "cpu_c":
        needs(write_kv_cpu)
    small = torch.zeros(1, 4, 1, 8)
    message = r"write_kv: k_cache \[2, 4, 1, 8\] and v_cache \[1, 4, 1, 8\] differ in \[pages, page_size\]"
    with registry.use_backend("write_kv", backend), pytest.raises(ValueError, match=message):
        ops.write_kv(torch.ones(1, 1, 8), torch.ones(1, 1, 8), torch.zeros(2, 4, 1, 8), small, torch.tensor([6]))
    assert small.eq(0).all()


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: ops.rms_norm(torch.zeros(2, 8), torch.ones(6), 1e-6), r"rms_norm: x \[2, 8\] does not match weight"),
        (lambda: ops.rms_norm(torch.zeros(2, 8), torch.ones(2, 4), 1e-6), r"rms_norm: weight must be \[D\]"),
        (lambda: ops.rotary(torch.zeros(2, 3, 7), torch.zeros(2, 7), torch.zeros(2, 7)), r"rotary: x must be .* even"),
        (lambda: ops.rotary(torch.zeros(2, 3, 8), torch.zeros(3, 8), torch.zeros(2, 8)),
         r"rotary: cos and sin must be \[T, dim\] = \[2, 8\], got \[3, 8\] and \[2, 8\]"),
    ],
)
def test_layer_ops_name_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("arch", ["qwen3", "deepseek_v3"])  # per-head q/k norms; MLA's latent norms and rope
def test_engine_runs_the_c_layer_ops_with_the_torch_paths_greedy_tokens(arch, tmp_path):
    for module in (norm_cpu, rotary_cpu, write_kv_cpu, prefill_cpu):
        needs(module)
    save_tiny_checkpoint(arch, tmp_path)
    expected = engine_greedy_tokens(tmp_path, dict.fromkeys(LAYER_OPS, "torch"))
    registry.reset_usage()
    assert engine_greedy_tokens(tmp_path, dict.fromkeys(LAYER_OPS, "cpu_c")) == expected
    counts = registry.usage_counts()
    for op in LAYER_OPS:
        assert counts.get((op, "cpu_c"), 0) > 0 and counts.get((op, "torch"), 0) == 0, (op, counts)
