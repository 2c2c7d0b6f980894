"""float32 GEMMs on CPU through oneDNN, on the weight as it is: the projections and experts of many rows; through
MKL instead on Intel's CPUs.

torch's F.linear runs float32 on MKL, which on AMD CPUs takes its AVX2 path: on the dev box's Zen 5 cores ~100
GFLOP/s a core where the cores' AVX-512 FMAs peak at ~260. oneDNN (built into torch as "mkldnn") picks its
kernels by instruction set, not vendor: its linear op, the one inductor's CPU backend calls, reaches 380-450
GFLOP/s on the box's 2 threads at 64-4096 rows (MKL 180-200), reading the plain weight (no packed copy, no memory
kept), on the OpenMP threads torch runs its own ops on. On Intel's own CPUs MKL takes its best path and was the
faster one: on an Intel Xeon (family 6 model 207) bench-moe's prefill steps ran 10-13 % faster through F.linear in an
in-process A/B (4 rounds, bench/RESULTS.md), its decode steps level. So `blas_preferred()` sends the GEMMs to F.linear
where torch's BLAS is MKL and the CPU is Intel's. A row's sums do not depend on the call's other rows, either way.
`unavailable()` says why oneDNN cannot be used (a torch built without oneDNN, or a CPU it refuses), and `linear`
then runs F.linear too.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from batchgen.kernels.cpu_identity import this_vendor


@functools.cache
def unavailable() -> str | None:
    """Why oneDNN's linear cannot run float32 here, or None (checked once, on a small call against F.linear)."""
    if not torch.backends.mkldnn.is_available():
        return "this torch is built without oneDNN (mkldnn)"
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return "this torch's oneDNN has no linear op (mkldnn._linear_pointwise)"
    g = torch.Generator().manual_seed(0)
    x, weight, bias = torch.randn(5, 24, generator=g), torch.randn(7, 24, generator=g), torch.randn(7, generator=g)
    try:
        out = _onednn_linear(x, weight, bias)
    except RuntimeError as exc:
        return f"oneDNN's linear failed: {exc}"
    if not torch.allclose(out, F.linear(x, weight, bias), rtol=1e-4, atol=1e-4):
        return "oneDNN's linear disagrees with F.linear"
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear's contract for float32 CPU tensors (x [..., D], weight [O, D], either may be strided)."""
    if unavailable() is None and not blas_preferred():
        return _onednn_linear(x, weight, bias)
    return F.linear(x, weight, bias)


@functools.cache
def blas_preferred() -> bool:
    """Whether F.linear is the faster GEMM here: torch's BLAS is MKL and the CPU is Intel's."""
    return torch.backends.mkl.is_available() and this_vendor() == "GenuineIntel"


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
