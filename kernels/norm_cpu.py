"""RMSNorm for float32 CPU tensors in one C call.

In torch the norm is seven ops (a float copy, square, mean, add, rsqrt and two multiplies), each a dispatch and a
pass over the rows; a decode step runs 2L + 1 norms over a handful of rows, where those dispatches are most of the
norm's time (bench-moe, one row: ~20 us a norm, 13 a step). This kernel makes one pass per row, rows split over the
OpenMP team torch runs on when there are enough of them to be worth a second thread (a prefill step's thousands).
"""

from __future__ import annotations

import ctypes

import torch

from batchgen.kernels.c_library import CFunction
from batchgen.kernels.norm_torch import rms_norm_torch

THREAD_BYTES = 256 << 10  # of rows: below, waking a second thread costs more than it saves

_SOURCE = r"""
#include <math.h>
#include <omp.h>
#include <stdint.h>

static void norm_row(const float *restrict x, const float *restrict w, float *restrict out, int D, float eps) {
    float sum = 0.f;
    for (int d = 0; d < D; d++) sum += x[d] * x[d];
    float inv = 1.f / sqrtf(sum / D + eps);
    for (int d = 0; d < D; d++) out[d] = w[d] * (x[d] * inv);
}

void rms_norm_f32(const float *x, const float *w, float *out, int64_t rows, int D, float eps, int threads) {
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) norm_row(x + r * D, w, out + r * D, D, eps);
}
"""

_KERNEL = CFunction("rms_norm", _SOURCE, "rms_norm_f32",
                    (*[ctypes.c_void_p] * 3, ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_int))


def unavailable() -> str | None:
    """Why this backend cannot run here, or None (compiles the kernel on first call)."""
    return _KERNEL.unavailable()


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as kernels.ops.rms_norm, for float32 CPU tensors (a weight of another dtype: the torch path)."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        return rms_norm_torch(x, weight, eps)
    x = x.contiguous()
    weight = weight.contiguous()
    out = torch.empty_like(x)
    dim = x.shape[-1]
    rows = x.numel() // dim if dim else 0
    threads = max(1, min(torch.get_num_threads(), x.numel() * 4 // THREAD_BYTES))
    _KERNEL(x.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, dim, float(eps), threads)
    return out
