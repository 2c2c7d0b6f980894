"""Grouped MoE experts for float32 CPU tensors: a C kernel for the experts few tokens were routed to.

An expert that gets a handful of rows is a GEMV: its time is the read of its weights. One BLAS call per
projection per expert reads them on one core and pays a call's overhead each (in decode tail steps, at 1-8
rows per expert, 3.5-8x the read of the weights). This kernel reads the weights of all such experts in one
call, split evenly over `torch.get_num_threads()` POSIX threads: first every (expert, intermediate column)
pair computes silu(gate) * up for the expert's rows, then every output column sums the down projection
and adds it, weighted, into the token's output row (threads own disjoint output columns, so no two write
the same element and the order of the sum is fixed). Experts with more rows than SMALL_ROWS are
compute-bound GEMMs and go through the torch path's BLAS calls (moe_torch.py).
"""

from __future__ import annotations

import ctypes

import torch

from batchgen.kernels.c_library import CFunction
from batchgen.kernels.moe_torch import accumulate_experts, route_rows

SMALL_ROWS = 8  # rows per expert up to which this kernel beats BLAS (here: 3-4x at 1-4 rows, level at 8)

_SOURCE = r"""
#include <math.h>
#include <pthread.h>
#include <stdint.h>

typedef struct {
    const float *x;            /* [R, D] rows sorted by expert */
    const int64_t *spans;      /* [A, 3] each of the A experts' first row, end row, first row of h */
    const int64_t *experts;    /* [A] expert ids */
    const float *wgu, *wd;     /* [E, 2I, D], [E, D, I]; rows dense */
    int64_t gu0, gu1, d0, d1;  /* element strides: expert, row */
    float *h;                  /* [rows of the A experts, I] silu(gate) * up */
    const int64_t *token;      /* [R] output row of each row */
    const float *weight;       /* [R] routing weight of each row */
    float *out;                /* [T, D] accumulated */
    int A, D, I;
    int64_t first, last;       /* this thread's items */
} Job;

static inline float dot(const float *a, const float *b, int n) {
    float s = 0.f;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* four rows against one weight row: the weight row is loaded once for the four */
static inline void dot4(const float *w, const float *x, int64_t stride, int n, float *out) {
    float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
    const float *x0 = x, *x1 = x + stride, *x2 = x + 2 * stride, *x3 = x + 3 * stride;
    for (int i = 0; i < n; i++) {
        float wi = w[i];
        a0 += wi * x0[i]; a1 += wi * x1[i]; a2 += wi * x2[i]; a3 += wi * x3[i];
    }
    out[0] = a0; out[1] = a1; out[2] = a2; out[3] = a3;
}

static inline float silu_mul(float g, float u) { return g / (1.f + expf(-g)) * u; }

/* items: (expert a, intermediate column i) pairs */
static void *gate_up(void *arg) {
    const Job *j = (const Job *)arg;
    for (int64_t item = j->first; item < j->last; item++) {
        int a = (int)(item / j->I), i = (int)(item % j->I);
        const float *wg = j->wgu + j->experts[a] * j->gu0 + (int64_t)i * j->gu1;
        const float *wu = wg + (int64_t)j->I * j->gu1;
        const int64_t *span = j->spans + 3 * a;
        float *h = j->h + span[2] * j->I + i;  /* the expert's n-th row's column i is h[n * I] */
        int64_t n = 0, rows = span[1] - span[0];
        for (; n + 4 <= rows; n += 4) {
            float g[4], u[4];
            dot4(wg, j->x + (span[0] + n) * j->D, j->D, j->D, g);
            dot4(wu, j->x + (span[0] + n) * j->D, j->D, j->D, u);
            for (int k = 0; k < 4; k++) h[(n + k) * j->I] = silu_mul(g[k], u[k]);
        }
        for (; n < rows; n++) {
            const float *xr = j->x + (span[0] + n) * j->D;
            h[n * j->I] = silu_mul(dot(xr, wg, j->D), dot(xr, wu, j->D));
        }
    }
    return 0;
}

/* items: output columns, every expert in order */
static void *down(void *arg) {
    const Job *j = (const Job *)arg;
    for (int a = 0; a < j->A; a++) {
        const float *we = j->wd + j->experts[a] * j->d0;
        const int64_t *span = j->spans + 3 * a;
        const float *h = j->h + span[2] * j->I;  /* the expert's n-th row is h + n * I */
        const int64_t *token = j->token + span[0];
        const float *weight = j->weight + span[0];
        int64_t rows = span[1] - span[0];
        for (int64_t d = j->first; d < j->last; d++) {
            const float *wr = we + d * j->d1;
            int64_t n = 0;
            for (; n + 4 <= rows; n += 4) {
                float y[4];
                dot4(wr, h + n * j->I, j->I, j->I, y);
                for (int k = 0; k < 4; k++) j->out[token[n + k] * j->D + d] += weight[n + k] * y[k];
            }
            for (; n < rows; n++) j->out[token[n] * j->D + d] += weight[n] * dot(h + n * j->I, wr, j->I);
        }
    }
    return 0;
}

static void parallel(void *(*fn)(void *), Job base, int64_t items, int threads) {
    Job jobs[64];
    pthread_t ids[64];
    if (threads > items) threads = (int)items;
    if (threads > 64) threads = 64;
    if (threads < 1) threads = 1;
    for (int t = 0; t < threads; t++) {
        jobs[t] = base;
        jobs[t].first = items * t / threads;
        jobs[t].last = items * (t + 1) / threads;
    }
    for (int t = 1; t < threads; t++) pthread_create(&ids[t], 0, fn, &jobs[t]);
    fn(&jobs[0]);
    for (int t = 1; t < threads; t++) pthread_join(ids[t], 0);
}

void small_experts_f32(const float *x, const int64_t *spans, const int64_t *experts, int A, const float *wgu,
                       const float *wd, const int64_t *strides, float *h, const int64_t *token,
                       const float *weight, float *out, int D, int I, int threads) {
    Job base = {x, spans, experts, wgu, wd, strides[0], strides[1], strides[2], strides[3], h, token, weight,
                out, A, D, I, 0, 0};
    parallel(gate_up, base, (int64_t)A * I, threads);
    parallel(down, base, D, threads);
}
"""


_KERNEL = CFunction("small_experts", _SOURCE, "small_experts_f32",
                    (*[ctypes.c_void_p] * 3, ctypes.c_int, *[ctypes.c_void_p] * 7, *[ctypes.c_int] * 3))


def unavailable() -> str | None:
    """Why this backend cannot run here, or None (compiles the kernel on first call)."""
    return _KERNEL.unavailable()


def fused_moe_cpu(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Same contract as kernels.ops.fused_moe, for float32 CPU tensors."""
    num_experts, two_i, dim = w_gate_up.shape
    inter = two_i // 2
    w_gate_up, w_down = (w if w.stride(-1) == 1 else w.contiguous() for w in (w_gate_up, w_down))
    rows = route_rows(x, topk_weights, topk_ids, num_experts)
    out = torch.zeros(x.shape, dtype=torch.float32)
    small = [e for e, count in enumerate(rows.counts) if 0 < count <= SMALL_ROWS]
    if small:
        spans, total = [], 0
        for e in small:  # rows of h are the small experts' rows, packed
            spans.append((rows.starts[e], rows.starts[e + 1], total))
            total += rows.counts[e]
        spans_t, experts = torch.tensor(spans, dtype=torch.int64), torch.tensor(small, dtype=torch.int64)
        strides = torch.tensor([w_gate_up.stride(0), w_gate_up.stride(1), w_down.stride(0), w_down.stride(1)],
                               dtype=torch.int64)
        h = torch.empty(total, inter, dtype=torch.float32)
        xs, token_rows, weights = (t.contiguous() for t in (rows.xs, rows.token_rows, rows.weights))
        _KERNEL(xs.data_ptr(), spans_t.data_ptr(), experts.data_ptr(), len(small),
                w_gate_up.data_ptr(), w_down.data_ptr(), strides.data_ptr(), h.data_ptr(), token_rows.data_ptr(),
                weights.data_ptr(), out.data_ptr(), dim, inter, torch.get_num_threads())
    accumulate_experts(out, rows, [e for e, count in enumerate(rows.counts) if count > SMALL_ROWS], w_gate_up,
                       w_down)
    return out.to(x.dtype)
