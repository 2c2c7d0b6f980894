"""kernels/activation_cpu.py against torch (F.silu(gate) * up, torch.sigmoid), and the property it exists for: a row's
result the same bits computed alone or inside any batch, at any thread count (torch's own differ at 3-4 threads)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchgen.kernels import activation_cpu

pytestmark = pytest.mark.skipif(activation_cpu.unavailable() is not None, reason=str(activation_cpu.unavailable()))

OPS = {
    "silu_mul": (lambda g, u: activation_cpu.silu_mul(g, u), lambda g, u: F.silu(g) * u),
    "sigmoid": (lambda x, _: activation_cpu.sigmoid(x), lambda x, _: torch.sigmoid(x)),
}


@pytest.fixture
def threads():
    """Sets torch's thread count for the test (more than this box's cores is fine: results, not speed), then back."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (301, 256), (64, 48), (1000, 37)])
def test_the_c_activations_match_torch(op, shape):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(shape, generator=g) * 6, torch.randn(shape, generator=g)
    ours, reference = OPS[op]
    torch.testing.assert_close(ours(a, b), reference(a, b), rtol=2e-6, atol=1e-7)


def test_extremes_saturate_as_torch_does():
    """Far below zero e^x stops at e^-87 (~1.6e-38) where torch's reaches 0: differences of that size, times x."""
    x = torch.tensor([-1e4, -90.0, -30.0, 0.0, 30.0, 1e4])
    torch.testing.assert_close(activation_cpu.sigmoid(x), torch.sigmoid(x), rtol=2e-6, atol=2e-38)
    torch.testing.assert_close(activation_cpu.silu_mul(x, torch.ones_like(x)), F.silu(x), rtol=2e-6, atol=2e-34)


@pytest.mark.parametrize("count", [1, 2, 3, 4])
def test_a_rows_result_does_not_depend_on_the_batch_or_the_threads(threads, count):
    threads(count)
    g = torch.Generator().manual_seed(1)
    for rows, width in ((301, 256), (500, 256), (1001, 48), (333, 7)):
        a, b = torch.randn(rows, width, generator=g), torch.randn(rows, width, generator=g)
        for op, (ours, _) in OPS.items():
            batch = ours(a, b)
            alone = [r for r in range(rows) if not torch.equal(ours(a[r:r + 1], b[r:r + 1])[0], batch[r])]
            assert alone == [], (op, count, rows, width)


def test_torchs_own_activations_are_not_batch_invariant_at_three_threads(threads):
    """The control: with torch's silu and sigmoid some rows come out otherwise inside a batch than alone (why the
    kernels exist; if a torch release fixes it, they can go)."""
    threads(3)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(301, 256, generator=g), torch.randn(301, 256, generator=g)
    differ = {op: [r for r in range(301) if not torch.equal(reference(a[r:r + 1], b[r:r + 1])[0],
                                                            reference(a, b)[r])]
              for op, (_, reference) in OPS.items()}
    assert any(differ.values()), differ


def test_other_inputs_are_refused_with_their_fault():
    with pytest.raises(ValueError, match="float32 CPU tensors, got torch.float64"):
        activation_cpu.sigmoid(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"gate and up of one shape, got \(2, 3\) and \(3, 2\)"):
        activation_cpu.silu_mul(torch.zeros(2, 3), torch.zeros(3, 2))
