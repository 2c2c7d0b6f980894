"""Rotary position embedding (half-split layout) for float32 CPU tensors in one C call.

In torch the rotation is six ops (two slices negated and concatenated, two multiplies, an add), run for q and k of
every layer: at a decode step's few rows those dispatches, not the arithmetic, are its time. The kernel writes each
(token, head) row's two halves in one pass; rows split over the OpenMP team torch runs on when there are enough of
them (a prefill step).
"""

from __future__ import annotations

import ctypes

import torch

from batchgen.kernels.c_library import CFunction
from batchgen.kernels.rotary_torch import rotary_torch

THREAD_BYTES = 256 << 10  # of x: below, waking a second thread costs more than it saves

_SOURCE = r"""
#pragma GCC optimize("fp-contract=off") /* products rounded before the sum, as torch's separate ops round them */
#include <omp.h>
#include <stdint.h>

/* out[t, h] = x[t, h] * cos[t] + rotate_half(x[t, h]) * sin[t]; x rows `ts` (token) and `hs` (head) apart, dense
   within; cos, sin [T, dim] and out [T, H, dim] dense */
void rotary_f32(const float *x, int64_t ts, int64_t hs, const float *cos, const float *sin, float *out, int64_t T,
                int H, int dim, int threads) {
    int half = dim / 2;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t item = 0; item < T * H; item++) {
        int64_t t = item / H;
        const float *restrict xr = x + t * ts + (item % H) * hs;
        const float *restrict c = cos + t * dim, *restrict s = sin + t * dim;
        float *restrict o = out + item * dim;
        for (int i = 0; i < half; i++) o[i] = xr[i] * c[i] - xr[i + half] * s[i];
        for (int i = half; i < dim; i++) o[i] = xr[i] * c[i] + xr[i - half] * s[i];
    }
}
"""

_KERNEL = CFunction("rotary", _SOURCE, "rotary_f32",
                    (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, *[ctypes.c_void_p] * 3, ctypes.c_int64,
                     *[ctypes.c_int] * 3))


def unavailable() -> str | None:
    """Why this backend cannot run here, or None (compiles the kernel on first call)."""
    return _KERNEL.unavailable()


def rotary_cpu(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Same contract as kernels.ops.rotary, for float32 CPU tensors (tables of another dtype: the torch path)."""
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        return rotary_torch(x, cos, sin)
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    tokens, heads, dim = x.shape
    out = torch.empty(tokens, heads, dim, dtype=torch.float32)
    threads = max(1, min(torch.get_num_threads(), x.numel() * 4 // THREAD_BYTES))
    _KERNEL(x.data_ptr(), x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), tokens, heads,
            dim, threads)
    return out
