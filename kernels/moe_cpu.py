"""Grouped MoE experts for float32 CPU tensors: a C kernel for the experts few tokens were routed to.

An expert that gets a handful of rows is a GEMV: its time is the read of its weights. One BLAS call per
projection per expert reads them on one core and pays a call's overhead each (in decode tail steps, at 1-8
rows per expert, 3.5-8x the read of the weights). This kernel reads the weights of all such experts in one
call, split evenly over `torch.get_num_threads()` threads of the OpenMP pool torch runs its own ops on (no
threads started per call, none left spinning against torch's): first every (expert, intermediate column) pair
computes silu(gate) * up for the expert's rows, then every pair of output columns sums the down
projection and adds it, weighted, into the token's output row (threads own disjoint output columns, so no two
write the same element and the order of the sum is fixed). The dot products run eight token rows at a time
against two weight rows (gate and up; two output columns), the sixteen sums in vector registers, so each
weight element is loaded once for the eight; the next weight rows are prefetched meanwhile. Experts with more
rows than SMALL_ROWS are GEMMs oneDNN runs faster (gemm_onednn.py), a pair of calls per expert (moe_torch.py). A call
of at most FEW_TOKENS tokens (a decode step's tail) leaves the grouping of its rows by expert to the kernel as well.
"""

from __future__ import annotations

import ctypes

import torch

from batchgen.kernels import gemm_onednn
from batchgen.kernels.c_library import DOT_PAIRS_SOURCE, EXP_NEG_SOURCE, CFunction
from batchgen.kernels.moe_torch import accumulate_experts, route_rows

# rows per expert up to which this kernel beats oneDNN's GEMMs (a layer of 16 512 x 1024 experts, cold, 2 threads of
# the dev box, random top-2 routing: at 16 rows per expert on average 5.9 ms all in the kernel, 6.9 all in oneDNN; at
# 24, 7.3 ms with the experts above 16 rows left to oneDNN, 10.0 all in the kernel, 9.2 all in oneDNN)
SMALL_ROWS = 16
FEW_TOKENS = 16  # tokens of a call up to which the kernel groups them by expert too (torch's sort wins above)

_SOURCE = r"""
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

EXP_NEG

DOT_PAIRS

/* silu(g) * u = g * sigmoid(g) * u, sigmoid from e^-|g| (no overflow either side) */
static inline float silu_mul(float g, float u) {
    float e = exp_neg(g < 0.f ? g : -g);
    return g * (g < 0.f ? e : 1.f) / (1.f + e) * u;
}

/* items: (expert a, intermediate column i) pairs; the expert's rows BLOCK at a time */
static void gate_up(const Job *j) {
    float g[BLOCK], u[BLOCK];
    for (int64_t item = j->first; item < j->last; item++) {
        int a = (int)(item / j->I), i = (int)(item % j->I);
        const float *wg = j->wgu + j->experts[a] * j->gu0 + (int64_t)i * j->gu1;
        const float *wu = wg + (int64_t)j->I * j->gu1;
        const int64_t *span = j->spans + 3 * a;
        float *h = j->h + span[2] * j->I + i;  /* the expert's n-th row's column i is h[n * I] */
        for (int64_t n = 0, rows = span[1] - span[0]; n < rows; n += BLOCK) {
            int count = rows - n < BLOCK ? (int)(rows - n) : BLOCK;
            /* next: this column's rows again for the next block, else the next column's */
            int last = n + BLOCK >= rows;
            dot_pairs_n(count, wg, wu, j->x + (span[0] + n) * j->D, j->D, j->D, g, u, last ? wg + j->gu1 : wg,
                        last ? wu + j->gu1 : wu);
            for (int r = 0; r < count; r++) h[(n + r) * j->I] = silu_mul(g[r], u[r]);
        }
    }
}

/* items: pairs of output columns (the last one alone when D is odd), every expert in order */
static void down(const Job *j) {
    float y0[BLOCK], y1[BLOCK];
    for (int64_t item = j->first; item < j->last; item++) {
        int64_t d = 2 * item;
        int both = d + 1 < j->D;
        for (int a = 0; a < j->A; a++) {
            const float *w0 = j->wd + j->experts[a] * j->d0 + d * j->d1, *w1 = both ? w0 + j->d1 : w0;
            const int64_t *span = j->spans + 3 * a;
            const float *h = j->h + span[2] * j->I;  /* the expert's n-th row is h + n * I */
            /* next: the next expert's rows of these columns (the first expert's of the next pair at the end) */
            const float *n0 = a + 1 < j->A ? j->wd + j->experts[a + 1] * j->d0 + d * j->d1
                                           : j->wd + j->experts[0] * j->d0 + (d + 2) * j->d1;
            for (int64_t n = 0, rows = span[1] - span[0]; n < rows; n += BLOCK) {
                int count = rows - n < BLOCK ? (int)(rows - n) : BLOCK;
                dot_pairs_n(count, w0, w1, h + n * j->I, j->I, j->I, y0, y1, n0, n0 + j->d1);
                for (int r = 0; r < count; r++) {
                    float *o = j->out + j->token[span[0] + n + r] * j->D + d, w = j->weight[span[0] + n + r];
                    o[0] += w * y0[r];
                    if (both) o[1] += w * y1[r];
                }
            }
        }
    }
}

/* fn over items [0, items) split evenly over `threads` threads of the OpenMP pool torch runs its own ops on */
static void parallel(void (*fn)(const Job *), Job base, int64_t items, int threads) {
    if (threads > items) threads = (int)items;
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads)
    {
        Job job = base;
        team_share(items, &job.first, &job.last);
        fn(&job);
    }
}

void small_experts_f32(const float *x, const int64_t *spans, const int64_t *experts, int A, const float *wgu,
                       const float *wd, const int64_t *strides, float *h, const int64_t *token,
                       const float *weight, float *out, int D, int I, int threads) {
    Job base = {x, spans, experts, wgu, wd, strides[0], strides[1], strides[2], strides[3], h, token, weight,
                out, A, D, I, 0, 0};
    parallel(gate_up, base, (int64_t)A * I, threads);
    parallel(down, base, (D + 1) / 2, threads);
}

/* A few tokens (every expert then has at most T rows: all within this kernel): their (token, k) pairs grouped by
   expert here, by a stable counting sort (the order of the torch path's stable argsort, so the same sums in the
   same order), instead of by a handful of torch calls per layer. ids < 0 (experts on another rank) are skipped,
   and so is any id past the last expert, so no input writes outside this function's arrays. */
void few_tokens_f32(const float *x, int64_t T, int K, const int64_t *ids, const float *topk_weight, int E,
                    const float *wgu, const float *wd, int64_t gu0, int64_t gu1, int64_t d0, int64_t d1, float *h,
                    float *out, int D, int I, int threads) {
    int64_t pairs = T * K, *first = calloc(E + 1, sizeof(int64_t)), *next = malloc(E * sizeof(int64_t));
    int A = 0;
    for (int64_t p = 0; p < pairs; p++)
        if (ids[p] >= 0 && ids[p] < E) first[ids[p] + 1]++;
    for (int e = 0; e < E; e++) { A += first[e + 1] > 0; first[e + 1] += first[e]; next[e] = first[e]; }
    int64_t rows = first[E], *token = malloc((rows + 1) * sizeof(int64_t));
    int64_t *spans = malloc((3 * A + 1) * sizeof(int64_t)), *experts = malloc((A + 1) * sizeof(int64_t));
    float *xs = malloc((rows * D + 1) * sizeof(float)), *weight = malloc((rows + 1) * sizeof(float));
    for (int64_t p = 0; p < pairs; p++) {
        if (ids[p] < 0 || ids[p] >= E) continue;
        int64_t r = next[ids[p]]++;
        token[r] = p / K;
        weight[r] = topk_weight[p];
        memcpy(xs + r * D, x + token[r] * D, D * sizeof(float));
    }
    for (int e = 0, a = 0; e < E; e++)
        if (first[e + 1] > first[e]) {
            spans[3 * a] = spans[3 * a + 2] = first[e];
            spans[3 * a + 1] = first[e + 1];
            experts[a++] = e;
        }
    if (A) {
        Job base = {xs, spans, experts, wgu, wd, gu0, gu1, d0, d1, h, token, weight, out, A, D, I, 0, 0};
        parallel(gate_up, base, (int64_t)A * I, threads);
        parallel(down, base, (D + 1) / 2, threads);
    }
    free(first); free(next); free(token); free(spans); free(experts); free(xs); free(weight);
}
""".replace("EXP_NEG", EXP_NEG_SOURCE).replace("DOT_PAIRS", DOT_PAIRS_SOURCE)


_KERNEL = CFunction("small_experts", _SOURCE, "small_experts_f32",
                    (*[ctypes.c_void_p] * 3, ctypes.c_int, *[ctypes.c_void_p] * 7, *[ctypes.c_int] * 3))
_FEW_TOKENS = CFunction("small_experts", _SOURCE, "few_tokens_f32",
                        (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, *[ctypes.c_void_p] * 2, ctypes.c_int,
                         *[ctypes.c_void_p] * 2, *[ctypes.c_int64] * 4, *[ctypes.c_void_p] * 2, *[ctypes.c_int] * 3))


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
    if x.shape[0] <= FEW_TOKENS:  # no expert can get more rows than there are tokens: all of them the kernel's
        return _few_tokens(x, w_gate_up, w_down, topk_weights, topk_ids)
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
                       w_down, gemm_onednn.linear)
    return out.to(x.dtype)


def _few_tokens(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
    """fused_moe_cpu for at most FEW_TOKENS tokens: the routing's grouping by expert done by the kernel too."""
    tokens, top_k = topk_ids.shape
    x = x.contiguous()
    ids = topk_ids.to(torch.int64).contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    out = torch.zeros(x.shape, dtype=torch.float32)
    h = torch.empty(tokens * top_k, w_down.shape[2], dtype=torch.float32)
    _FEW_TOKENS(x.data_ptr(), tokens, top_k, ids.data_ptr(), weights.data_ptr(), w_gate_up.shape[0],
                w_gate_up.data_ptr(), w_down.data_ptr(), *w_gate_up.stride()[:2], *w_down.stride()[:2], h.data_ptr(),
                out.data_ptr(), x.shape[1], w_down.shape[2], torch.get_num_threads())
    return out.to(x.dtype)
