"""y = x W^T + b for float32 CPU tensors with a few rows of x: the decode step's projections.

With a handful of token rows a projection is a GEMV: its time is the read of W. BLAS (MKL here) runs such a call
at a fraction of the read bandwidth, worst on CPUs it has no tuned path for (AMD EPYC, 512 x 512 warm in cache:
49 us at 4 rows where the read takes ~10 us), and a decode step makes ~4 such calls per layer plus the router and
the LM head. This kernel streams W's rows once for all the token rows, two output columns at a time against
eight token rows (the dot products the MoE kernel uses, moe_cpu.py), split over threads of the OpenMP pool torch
runs on; with tens of rows the same blocks keep each weight row in registers for eight token rows, still ahead of
BLAS's skinny GEMMs. Calls with more than SMALL_ROWS rows are GEMMs oneDNN (MKL on Intel) runs faster (gemm_onednn.py).
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from batchgen.kernels import gemm_onednn, registry
from batchgen.kernels.c_library import DOT_PAIRS_SOURCE, CFunction

# rows up to which this kernel beats oneDNN's GEMM (2 threads of the dev box, weights warm in cache: 512 x 512 52
# against 80 us at 16 rows, level at 32; 4096 x 512 330 / 465 us at 16, 555 / 428 at 24; cold weights favour oneDNN
# earlier: bench-moe's BCT 7.7-7.9 s at 16 against 8.3-8.5 s at 8 rows in an in-process A/B)
SMALL_ROWS = 16
THREAD_BYTES = 128 << 10  # weight bytes worth a thread of their own: below, waking a second costs more than it saves
MIN_WEIGHT_BYTES = 64 << 10  # below, the weight sits in cache and BLAS's shorter call wins (a router: 32 KiB)

_SOURCE = r"""
#include <omp.h>
#include <stdint.h>
#include <string.h>

DOT_PAIRS

typedef struct {
    const float *x, *w, *bias;  /* x [R, D] dense; w [O, D] rows `ws` apart, dense within; bias [O] or NULL */
    float *out;                 /* [R, O] */
    int64_t rows, ws;
    int D, O;
    int64_t first, last;        /* this thread's pairs of output columns */
} Job;

static void columns(const Job *j) {
    float y[2 * BLOCK];
    for (int64_t item = j->first; item < j->last; item++) {
        int64_t o = 2 * item;
        int both = o + 1 < j->O;
        const float *w0 = j->w + o * j->ws, *w1 = both ? w0 + j->ws : w0;
        /* next: these rows again for the next block of token rows, else the next pair's; far: the pair after
           that, into L2 (a projection's few rows leave its weights' read exposed: 6 layers' projections and an LM
           head, evicted by the experts' weights, 0.85x the time of the near fetch alone at 3-8 rows) */
        const float *n0 = item + 1 < j->last ? w0 + 2 * j->ws : w0, *n1 = item + 1 < j->last ? w1 + 2 * j->ws : w1;
        const float *f0 = item + 2 < j->last ? w0 + 4 * j->ws : n0;
        float b0 = j->bias ? j->bias[o] : 0.f, b1 = j->bias && both ? j->bias[o + 1] : 0.f;
        for (int64_t n = 0; n < j->rows; n += BLOCK) {
            int count = j->rows - n < BLOCK ? (int)(j->rows - n) : BLOCK;
            int last = n + BLOCK >= j->rows;
            dot_pairs_n(count, w0, w1, j->x + n * j->D, j->D, j->D, y, last ? n0 : w0, last ? n1 : w1, f0, f0 + j->ws);
            for (int r = 0; r < count; r++) {
                float *out = j->out + (n + r) * j->O + o;
                out[0] = y[r] + b0;
                if (both) out[1] = y[BLOCK + r] + b1;
            }
        }
    }
}

void small_linear_f32(const float *x, int64_t rows, const float *w, int64_t ws, const float *bias, float *out,
                      int D, int O, int threads) {
    int64_t items = (O + 1) / 2;
    if (threads > items) threads = (int)items;
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads)
    {
        Job job = {x, w, bias, out, rows, ws, D, O, 0, 0};
        team_share(items, &job.first, &job.last);
        columns(&job);
    }
}
""".replace("DOT_PAIRS", DOT_PAIRS_SOURCE)

_KERNEL = CFunction("small_linear", _SOURCE, "small_linear_f32",
                    (ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                     ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int))


def unavailable() -> str | None:
    """Why this backend cannot run here, or None (compiles the kernel on first call)."""
    return _KERNEL.unavailable()


def linear_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as kernels.ops.linear, for float32 CPU tensors."""
    out_features, dim = weight.shape
    rows = x if x.dim() == 2 else x.reshape(-1, dim)
    count = rows.shape[0]
    weight_bytes = out_features * dim * 4
    if count == 0 or not _float32_cpu(x, weight, bias):
        return F.linear(x, weight, bias)  # (another dtype or device: F.linear names the mismatch)
    if not registry.batch_invariant():  # else this kernel for any rows: each row's dot products in one order
        if count > SMALL_ROWS:
            return gemm_onednn.linear(x, weight, bias)
        if weight_bytes < MIN_WEIGHT_BYTES:
            return F.linear(x, weight, bias)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()  # held here: a temporary's pointer would name freed memory by the call
    out = torch.empty(count, out_features, dtype=torch.float32)
    threads = min(torch.get_num_threads(), weight_bytes // THREAD_BYTES) or 1
    _KERNEL(rows.data_ptr(), count, weight.data_ptr(), weight.stride(0),
            None if bias is None else bias.data_ptr(), out.data_ptr(), dim, out_features, threads)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out_features)


def _float32_cpu(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or (t.dtype == torch.float32 and t.device.type == "cpu") for t in tensors)
