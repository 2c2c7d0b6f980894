"""Softmax top-k routing: the C router against the torch reference (ids exactly, weights to float32 rounding; ties to
the lower expert, a NaN logit NaN weights), its input checks, and MoE models routing through it with the torch path's
greedy tokens."""

from __future__ import annotations

import pytest
import torch
from tiny_models import engine_greedy_tokens, save_tiny_checkpoint

from batchgen.kernels import ops, registry, router_cpu
from batchgen.kernels.router_torch import router_topk_torch


def needs_kernel() -> None:
    if router_cpu.unavailable():
        pytest.skip(router_cpu.unavailable())


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("tokens,dim,experts,top_k,normalize",
                         [(1, 16, 4, 1, False), (7, 40, 8, 2, True), (300, 512, 16, 2, True), (5, 33, 60, 4, False),
                          (900, 96, 64, 8, True)])
def test_cpu_router_matches_torch(tokens, dim, experts, top_k, normalize, threads):
    needs_kernel()
    g = torch.Generator().manual_seed(tokens)
    x, weight = torch.randn(tokens, dim, generator=g), torch.randn(experts, dim, generator=g) / dim**0.5
    weights, ids = router_cpu.router_topk_cpu(x, weight, top_k, normalize)
    expected_weights, expected_ids = router_topk_torch(x, weight, top_k, normalize)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-5, atol=1e-6)
    if normalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(tokens))


def test_ties_go_to_the_lower_expert_and_a_nan_leaves_nan_weights():
    needs_kernel()
    weight = torch.eye(6)
    x = torch.tensor([[0.0, 2.0, 2.0, 1.0, 2.0, 0.0],  # a three-way tie at the top
                      [1.0, 0.0, float("nan"), 3.0, 0.0, 0.0]])
    weights, ids = router_cpu.router_topk_cpu(x, weight, 3, normalize=False)
    assert ids[0].tolist() == [1, 2, 4]
    assert weights[1].isnan().all() and sorted(set(ids[1].tolist())) == ids[1].sort().values.tolist()
    assert 0 <= ids[1].min() and ids[1].max() < 6
    torch.testing.assert_close(weights[0], torch.full((3,), weights[0, 0].item()))


def test_ops_router_dispatches_the_c_kernel_and_checks_its_input():
    needs_kernel()
    x, weight = torch.randn(3, 8), torch.randn(5, 8)
    weights, ids = ops.router_topk(x, weight, 2, True)
    assert registry.last_used("router_topk") == "cpu_c"
    with registry.use_backend("router_topk", "torch"):
        torch_weights, torch_ids = ops.router_topk(x, weight, 2, True)
    assert registry.last_used("router_topk") == "torch"
    assert torch.equal(ids, torch_ids)
    torch.testing.assert_close(weights, torch_weights)
    with pytest.raises(ValueError, match=r"router_topk: top_k must be in \[1, E = 5\], got 6"):
        ops.router_topk(x, weight, 6, True)
    with pytest.raises(ValueError, match=r"router_topk: x must be \[T, D\] and weight \[E, D\], got \[3, 8\] and "
                                         r"\[5, 7\]"):
        ops.router_topk(x, torch.randn(5, 7), 2, True)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])  # Mixtral's weights in float32, Qwen's rounded
def test_moe_models_route_through_the_c_router_with_the_torch_paths_tokens(arch, tmp_path):
    needs_kernel()
    save_tiny_checkpoint(arch, tmp_path)
    expected = engine_greedy_tokens(tmp_path, {"router_topk": "torch"})
    registry.reset_usage()
    assert engine_greedy_tokens(tmp_path, {"router_topk": "cpu_c"}) == expected
    counts = registry.usage_counts()
    assert counts.get(("router_topk", "cpu_c"), 0) > 0 and counts.get(("router_topk", "torch"), 0) == 0
