"""Softmax top-k routing for float32 CPU tensors in one C call: a MoE layer's router.

In torch the router is five ops (the logits' linear, softmax, topk, and the renormalisation's sum and division), each
a dispatch; in a decode step, right after the experts' weights have streamed through the caches, they took 46 us a
layer for three tokens (bench-moe, an Intel Xeon), where their arithmetic takes well under one. This kernel makes one
pass per token: the logits as dot products, the softmax, the top_k by repeated maximum (the largest first, the lower
expert on a tie; a NaN logit leaves its token's weights NaN, as torch's softmax does, and its ids distinct experts)
and the renormalisation; tokens split over the OpenMP team torch runs on when there are enough of them (a prefill
step's thousands).
"""

from __future__ import annotations

import ctypes

import torch

from batchgen.kernels.c_library import CFunction
from batchgen.kernels.router_torch import router_topk_torch

THREAD_BYTES = 256 << 10  # of token rows: below, waking a second thread costs more than it saves

_SOURCE = r"""
#include <math.h>
#include <omp.h>
#include <stdint.h>

static void route_token(const float *restrict x, const float *restrict w, int D, int E, int K, int normalize,
                        float *restrict weights, int64_t *restrict ids, float *restrict p, char *restrict taken) {
    float top = -INFINITY;
    for (int e = 0; e < E; e++) {
        const float *restrict we = w + (int64_t)e * D;
        float s = 0.f;
        for (int d = 0; d < D; d++) s += x[d] * we[d];
        p[e] = s;
        top = s > top ? s : top;
        taken[e] = 0;
    }
    float sum = 0.f;
    for (int e = 0; e < E; e++) { p[e] = expf(p[e] - top); sum += p[e]; }
    float kept = 0.f;
    for (int k = 0; k < K; k++) {
        int best = -1;
        for (int e = 0; e < E; e++)
            if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
        taken[best] = 1;
        ids[k] = best;
        weights[k] = p[best] / sum;
        kept += weights[k];
    }
    if (normalize)
        for (int k = 0; k < K; k++) weights[k] /= kept;
}

void router_topk_f32(const float *x, int64_t T, int D, const float *w, int E, int K, int normalize, float *weights,
                     int64_t *ids, int threads) {
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float p[E];  /* a thread's scratch on its stack: E is a model's expert count (hundreds at most) */
        char taken[E];
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++)
            route_token(x + t * D, w, D, E, K, normalize, weights + t * K, ids + t * K, p, taken);
    }
}
"""

_KERNEL = CFunction("router_topk", _SOURCE, "router_topk_f32",
                    (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, *[ctypes.c_int] * 3,
                     *[ctypes.c_void_p] * 2, ctypes.c_int))


def unavailable() -> str | None:
    """Why this backend cannot run here, or None (compiles the kernel on first call)."""
    return _KERNEL.unavailable()


def router_topk_cpu(x: torch.Tensor, weight: torch.Tensor, top_k: int, normalize: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as kernels.ops.router_topk, for float32 CPU tensors (a weight of another dtype or device: the
    torch path)."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        return router_topk_torch(x, weight, top_k, normalize)
    x, weight = x.contiguous(), weight.contiguous()
    tokens, dim = x.shape
    weights = torch.empty(tokens, top_k, dtype=torch.float32)
    ids = torch.empty(tokens, top_k, dtype=torch.int64)
    threads = max(1, min(torch.get_num_threads(), x.numel() * 4 // THREAD_BYTES))
    _KERNEL(x.data_ptr(), tokens, dim, weight.data_ptr(), weight.shape[0], top_k, int(normalize), weights.data_ptr(),
            ids.data_ptr(), threads)
    return weights, ids
