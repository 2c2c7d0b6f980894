"""Greedy picks: the C argmax against torch.argmax (first maximum on ties, NaN as the largest), its input checks, and
the sampler taking it."""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels import argmax_cpu, ops, registry


def needs_kernel() -> None:
    if argmax_cpu.unavailable():
        pytest.skip(argmax_cpu.unavailable())


@pytest.mark.parametrize("threads", [1, 3], indirect=True)
@pytest.mark.parametrize("shape", [(1, 1), (3, 15), (5, 16), (4, 33), (700, 2048), (2, 40_000)])
def test_cpu_argmax_matches_torch(shape, threads):
    needs_kernel()
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(*shape, generator=g)
    assert torch.equal(argmax_cpu.argmax_cpu(logits), logits.argmax(dim=-1))


def test_ties_nans_infinities_and_strided_rows_as_torch():
    needs_kernel()
    rows = torch.full((8, 70), -1.0)
    rows[0, [5, 21, 69]] = 3.0  # ties in different lanes and the tail: the first wins
    rows[1, [37, 21]] = 3.0  # a later lane holds the earlier index
    rows[2] = float("-inf")  # nothing larger than -inf: index 0
    rows[3, 40], rows[3, 50] = float("inf"), float("nan")  # a NaN is the largest
    rows[4, 66], rows[4, 3] = float("nan"), float("nan")
    rows[5, 68] = float("nan")  # in the scalar tail
    rows[6, 17], rows[6, 1] = float("inf"), float("inf")
    rows[7, 0] = 2.0
    assert torch.equal(argmax_cpu.argmax_cpu(rows), rows.argmax(dim=-1))
    wide = torch.randn(6, 300)
    view = wide[:, 7:250]  # rows `stride` apart, dense within
    assert torch.equal(argmax_cpu.argmax_cpu(view), view.argmax(dim=-1))
    assert torch.equal(argmax_cpu.argmax_cpu(wide.t()), wide.t().argmax(dim=-1))  # not dense within: torch's path


def test_ops_argmax_dispatches_the_c_kernel_and_checks_its_input():
    needs_kernel()
    logits = torch.randn(4, 100)
    assert torch.equal(ops.argmax(logits), logits.argmax(dim=-1))
    assert registry.last_used("argmax") == "cpu_c"
    with registry.use_backend("argmax", "torch"):
        assert torch.equal(ops.argmax(logits.double()), logits.double().argmax(dim=-1))
    assert registry.last_used("argmax") == "torch"
    with pytest.raises(ValueError, match=r"argmax: logits must be \[R, V\] with V >= 1, got \[4, 0\]"):
        ops.argmax(torch.randn(4, 0))
    with pytest.raises(ValueError, match="argmax: logits must be floating point, got torch.int64"):
        ops.argmax(torch.zeros(2, 3, dtype=torch.int64))
