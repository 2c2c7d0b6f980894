"""Grouped MoE experts for float32 CPU tensors: a C kernel for the experts few tokens were routed to.

An expert that gets a handful of rows is a GEMV: its time is the read of its weights. One BLAS call per
projection per expert reads them on one core and pays a call's overhead each (in decode tail steps, at 1-8
rows per expert, 3.5-8x the read of the weights). This kernel reads the weights of all such experts in one
call, split evenly over `torch.get_num_threads()` threads of the OpenMP pool torch runs its own ops on (no
threads started per call, none left spinning against torch's): first every (expert, eight intermediate columns)
item computes silu(gate) * up for the expert's rows, then every item of sixteen output columns sums the down
projection and adds it, weighted, into the token's output row (threads own disjoint output columns, so no two
write the same element and the order of the sum is fixed). An expert of at most `dot_rows` rows takes the
dot-product path (moe_crossover.py measures, per CPU, up to how many rows it wins): eight token rows at a time
against two weight rows (gate and up; two output columns), the sixteen sums in vector registers, so each weight
element is loaded once for the eight; the next weight rows are prefetched meanwhile.
An expert of more rows takes the blocked path: its rows transposed, LANES to a vector (a lane per row), each weight
element broadcast against the vector (eight gate and eight up rows at once, no horizontal sums), so each is loaded
once per LANES rows at 2 FMAs a cycle; a last partial block of at most `dot_rows` rows goes to the dot-product path
instead of a padded block (in the same item, while its weight rows are in cache). On the dev box's 2 threads a
16-expert 512 x 1024 layer at 8 / 16 / 20 / 24 rows per expert on average (random top-2 routing) took 3.2-3.6 /
5.5-5.6 / 5.2-6.2 / 5.8-6.9 ms this way, 3.4-4.5 / 6.6-7.8 / 7.8-9.4 / 9.0-10.0 ms with every partial block padded,
and 4.0 / 7.1 / - / 8.9 ms with the dot path up to 16 rows and oneDNN above. Experts with more rows than SMALL_ROWS
are GEMMs oneDNN (MKL on Intel) runs faster (gemm_onednn.py), a pair of calls per expert (moe_torch.py). The rows are
grouped by expert in C too (route_rows_cpu: a counting sort, torch's order); a call of at most FEW_TOKENS tokens (a
decode step's tail) groups and runs them in one kernel call (all of them on the dot-product path).
"""

from __future__ import annotations

import ctypes
import hashlib

import torch

from batchgen.kernels import gemm_onednn, moe_crossover
from batchgen.kernels.c_library import DOT_PAIRS_SOURCE, EXP_NEG_SOURCE, CFunction
from batchgen.kernels.capture import read_back
from batchgen.kernels.moe_torch import RoutedRows

# rows per expert up to which this kernel beats oneDNN's GEMMs (a layer of 16 512 x 1024 experts, cold, 2 threads of
# the dev box, random top-2 routing: at 48 rows per expert on average 11.0 ms with the blocked path up to 64 rows
# against 14.6 ms with oneDNN above 16)
SMALL_ROWS = 64
LANES = 16  # rows per vector of the blocked path
FEW_TOKENS = 16  # tokens of a call up to which one kernel call groups and runs them (the dot path's row counts)
THREAD_BYTES = 256 << 10  # bytes a pass of glue moves (row copies, silu, scatter): less is not worth a second thread

_SOURCE = r"""
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define COLUMN_BLOCK 8  /* intermediate columns of a gate/up item: 8 gate + 8 up sums in registers */
#define OUTPUT_BLOCK 16 /* output columns of a down item: 16 sums in registers, one cache line of an output row */
#define SPAN 5          /* int64s per expert in spans */
#define THREAD_BYTES @THREAD_BYTES@  /* moe_cpu.THREAD_BYTES */

typedef struct {
    const float *x;            /* [R, D] rows sorted by expert */
    const int64_t *spans;      /* [A, SPAN] each of the A experts' first row, end row, offset of its h, offset of
                                  its xt (-1: none), rows on the blocked path (the first ones; 0: none) */
    const int64_t *experts;    /* [A] expert ids */
    const float *wgu, *wd;     /* [E, 2I, D], [E, D, I]; rows dense */
    int64_t gu0, gu1, d0, d1;  /* element strides: expert, row */
    float *h;                  /* silu(gate) * up: [blocks, I, LANES] for the blocked rows, then [rows, I] for the
                                  dot-product rows */
    float *xt;                 /* a blocked expert's rows, transposed: [blocks, D, LANES], zero past its last row */
    const int64_t *token;      /* [R] output row of each row */
    const float *weight;       /* [R] routing weight of each row */
    float *out;                /* [T, D] accumulated */
    int A, D, I;
    int64_t first, last;       /* this thread's items */
} Job;

EXP_NEG

DOT_PAIRS

/* exp_neg lane by lane (the same polynomial; the nearest integer power as the truncation of t - 1/2, t <= 0) */
static inline v16 exp_neg_v(v16 x) {
    const v16 zero = {0};
    x = blend(x < zero - 87.f, zero - 87.f, x);
    v16 t = x * 1.44269504f;
    v16i n = __builtin_convertvector(t - 0.5f, v16i);
    v16 f = t - __builtin_convertvector(n, v16);
    v16i bits = (n + 127) << 23;
    v16 scale;
    memcpy(&scale, &bits, sizeof scale);
    return EXP2_TAYLOR(f) * scale;
}

/* silu(g) * u = g * sigmoid(g) * u, sigmoid from e^-|g| (no overflow either side) */
static inline float silu_mul(float g, float u) {
    float e = exp_neg(g < 0.f ? g : -g);
    return g * (g < 0.f ? e : 1.f) / (1.f + e) * u;
}

static inline v16 silu_mul_v(v16 g, v16 u) {
    const v16 zero = {0};
    v16i negative = g < zero;
    v16 e = exp_neg_v(blend(negative, g, zero - g));
    return g * blend(negative, e, zero + 1.f) / (1.f + e) * u;
}

/* The blocked path, for experts of more than a few rows: the rows sit transposed, sixteen to a vector (one lane per
   row), and every weight element is broadcast against the vector: g[c] += wg[c][k] * xt[k], no horizontal sums, each
   weight element loaded once per sixteen rows. n (a constant after inlining) weight rows `stride` apart go at once
   (n gate and n up rows: 2n sums), each prefetched a few cache lines ahead: n streams at a time are more than the
   hardware's stream prefetch follows. */
static inline __attribute__((always_inline)) void outer_pairs(int n, const float *restrict wg,
                                                              const float *restrict wu, int64_t stride,
                                                              const float *restrict xt, int len, v16 *g, v16 *u) {
    /* row c at wg + offset[c]: two moving bases and n fixed offsets keep the 2n streams in general registers */
    int64_t offset[COLUMN_BLOCK];
    for (int c = 0; c < n; c++) { g[c] = (v16){0}; u[c] = (v16){0}; offset[c] = c * stride; }
    for (int k0 = 0; k0 < len; k0 += LANES) {
        for (int c = 0; c < n; c++) {
            __builtin_prefetch(wg + offset[c] + k0 + 4 * LANES, 0, 0);
            __builtin_prefetch(wu + offset[c] + k0 + 4 * LANES, 0, 0);
        }
        int k1 = k0 + LANES < len ? k0 + LANES : len;
        for (int k = k0; k < k1; k++) {
            v16 x = load(xt + (int64_t)k * LANES);
            const float *pg = wg + k, *pu = wu + k;
            for (int c = 0; c < n; c++) { g[c] += pg[offset[c]] * x; u[c] += pu[offset[c]] * x; }
        }
    }
}

/* outer_pairs for n weight rows alone (the down projection): y[c] += w[c][k] * ht[k] */
static inline __attribute__((always_inline)) void outer_rows(int n, const float *restrict w, int64_t stride,
                                                             const float *restrict ht, int len, v16 *y) {
    int64_t offset[8];
    for (int c = 0; c < n; c++) { y[c] = (v16){0}; offset[c] = c * stride; }
    for (int k0 = 0; k0 < len; k0 += LANES) {
        for (int c = 0; c < n; c++) __builtin_prefetch(w + offset[c] + k0 + 4 * LANES, 0, 0);
        int k1 = k0 + LANES < len ? k0 + LANES : len;
        for (int k = k0; k < k1; k++) {
            v16 x = load(ht + (int64_t)k * LANES);
            const float *p = w + k;
            for (int c = 0; c < n; c++) y[c] += p[offset[c]] * x;
        }
    }
}

static void outer_pairs_n(int n, const float *wg, const float *wu, int64_t stride, const float *xt, int len, v16 *g,
                          v16 *u) {
    if (n == COLUMN_BLOCK) outer_pairs(COLUMN_BLOCK, wg, wu, stride, xt, len, g, u);
    else for (int c = 0; c < n; c++) outer_pairs(1, wg + c * stride, wu + c * stride, stride, xt, len, g + c, u + c);
}

/* eight rows at a time: sixteen streams' offsets would not fit the general registers */
static void outer_rows_n(int n, const float *w, int64_t stride, const float *ht, int len, v16 *y) {
    int c = 0;
    for (; c + 8 <= n; c += 8) outer_rows(8, w + c * stride, stride, ht, len, y + c);
    for (; c < n; c++) outer_rows(1, w + c * stride, stride, ht, len, y + c);
}

/* An expert's rows: the first span[4] on the blocked path (in blocks of LANES, the last one zero-padded), the rest
   (at most dot_rows: a block's worth of padding saved) on the dot-product path; a dot expert has span[4] = 0. */
static inline int64_t blocks_of(const int64_t *span) { return (span[4] + LANES - 1) / LANES; }

/* items: the experts; a blocked expert's blocked rows transposed into xt, zero past the last of them */
static void transpose(const Job *j) {
    for (int64_t a = j->first; a < j->last; a++) {
        const int64_t *span = j->spans + SPAN * a;
        for (int64_t b = 0; b < blocks_of(span); b++) {
            float *xt = j->xt + span[3] + b * j->D * LANES;
            for (int r = 0; r < LANES; r++) {
                const float *x = j->x + (span[0] + b * LANES + r) * j->D;
                int valid = b * LANES + r < span[4];
                for (int k = 0; k < j->D; k++) xt[(int64_t)k * LANES + r] = valid ? x[k] : 0.f;
            }
        }
    }
}

/* items: (expert a, block of COLUMN_BLOCK intermediate columns) pairs */
static void gate_up(const Job *j) {
    int64_t per_expert = (j->I + COLUMN_BLOCK - 1) / COLUMN_BLOCK;
    for (int64_t item = j->first; item < j->last; item++) {
        int a = (int)(item / per_expert), c0 = (int)(item % per_expert) * COLUMN_BLOCK;
        int c1 = c0 + COLUMN_BLOCK < j->I ? c0 + COLUMN_BLOCK : j->I;
        const int64_t *span = j->spans + SPAN * a;
        const float *wg0 = j->wgu + j->experts[a] * j->gu0 + (int64_t)c0 * j->gu1;
        const float *wu0 = wg0 + (int64_t)j->I * j->gu1;
        int64_t blocks = blocks_of(span);
        for (int64_t b = 0; b < blocks; b++) {
            v16 g[COLUMN_BLOCK], u[COLUMN_BLOCK];
            outer_pairs_n(c1 - c0, wg0, wu0, j->gu1, j->xt + span[3] + b * j->D * LANES, j->D, g, u);
            float *ht = j->h + span[2] + (b * j->I + c0) * LANES;
            for (int c = 0; c < c1 - c0; c++) store(ht + c * LANES, silu_mul_v(g[c], u[c]));
        }
        /* the dot-product rows, while these columns' weight rows are still in cache */
        int64_t first = span[0] + span[4], rows = span[1] - first;
        float *h0 = j->h + span[2] + blocks * j->I * LANES;  /* their n-th row's column i is h0[n * I + i] */
        float gu[2 * BLOCK];  /* gate sums, then up sums */
        /* the next item's rows, fetched into L2 during this item's first block (its weights' read overlaps the
           compute of this item's later blocks) */
        int64_t next = item + 1 < j->last ? item + 1 : item;
        const float *fg0 = j->wgu + j->experts[next / per_expert] * j->gu0
                         + (int64_t)(next % per_expert) * COLUMN_BLOCK * j->gu1;
        const float *fu0 = fg0 + (int64_t)j->I * j->gu1;
        for (int64_t n = 0; n < rows; n += BLOCK) {  /* a block of rows against every column of the item (as down) */
            int count = rows - n < BLOCK ? (int)(rows - n) : BLOCK;
            for (int i = c0; i < c1; i++) {
                const float *wg = wg0 + (int64_t)(i - c0) * j->gu1, *wu = wu0 + (int64_t)(i - c0) * j->gu1;
                /* next: the next column's rows; after the item's last, its first again for the next block */
                int again = i + 1 == c1 && n + BLOCK < rows;
                const float *ng = again ? wg0 : wg + j->gu1, *nu = again ? wu0 : wu + j->gu1;
                int far = n == 0 && next != item;
                dot_pairs_n(count, wg, wu, j->x + (first + n) * j->D, j->D, j->D, gu, ng, nu,
                            far ? fg0 + (int64_t)(i - c0) * j->gu1 : ng, far ? fu0 + (int64_t)(i - c0) * j->gu1 : nu);
                for (int r = 0; r < count; r++) h0[(n + r) * j->I + i] = silu_mul(gu[r], gu[BLOCK + r]);
            }
        }
    }
}

/* items: blocks of OUTPUT_BLOCK output columns, every expert in order (a token's sum over its experts in a fixed
   order; threads own disjoint columns, so no two write the same element). Experts outermost: an expert's h is read
   for all of this thread's columns while it is in L2 (2-3 % faster than once per column block at 8-24 rows per
   expert, bit-identical) */
static void down(const Job *j) {
    for (int a = 0; a < j->A; a++) {
        const int64_t *span = j->spans + SPAN * a;
        int64_t blocks = blocks_of(span);
        for (int64_t item = j->first; item < j->last; item++) {
            int o0 = (int)item * OUTPUT_BLOCK, o1 = o0 + OUTPUT_BLOCK < j->D ? o0 + OUTPUT_BLOCK : j->D;
            const float *w = j->wd + j->experts[a] * j->d0 + (int64_t)o0 * j->d1;
            for (int64_t b = 0; b < blocks; b++) {
                v16 y[OUTPUT_BLOCK];
                float lanes[LANES];
                outer_rows_n(o1 - o0, w, j->d1, j->h + span[2] + b * j->I * LANES, j->I, y);
                int count = span[4] - b * LANES < LANES ? (int)(span[4] - b * LANES) : LANES;
                for (int c = 0; c < o1 - o0; c++) {
                    store(lanes, y[c]);
                    for (int r = 0; r < count; r++) {
                        int64_t row = span[0] + b * LANES + r;
                        j->out[j->token[row] * j->D + o0 + c] += j->weight[row] * lanes[r];
                    }
                }
            }
            int64_t first = span[0] + span[4], rows = span[1] - first;
            const float *h = j->h + span[2] + blocks * j->I * LANES;  /* the n-th dot row is h + n * I */
            /* a block of rows against every column of the item: the block's h (8 rows of I floats) stays in L1 while
               the item's weight rows come again from L2; h blocks taken in turn per column pair came from L2 */
            float y[2 * BLOCK];  /* column d's sums, then d + 1's */
            /* the next item's rows (this expert's next columns, else the next expert's first ones), into L2 during
               this item's first block */
            const float *fw = item + 1 < j->last ? w + OUTPUT_BLOCK * j->d1
                            : a + 1 < j->A ? j->wd + j->experts[a + 1] * j->d0 + j->first * OUTPUT_BLOCK * j->d1 : NULL;
            for (int64_t n = 0; n < rows; n += BLOCK) {
                int count = rows - n < BLOCK ? (int)(rows - n) : BLOCK;
                for (int d = o0; d < o1; d += 2) {
                    int both = d + 1 < o1;
                    const float *w0 = w + (int64_t)(d - o0) * j->d1, *w1 = both ? w0 + j->d1 : w0;
                    /* next: the next pair of columns; after the item's last, its first again for the next block */
                    const float *n0 = d + 2 < o1 || n + BLOCK >= rows ? w1 + j->d1 : w;
                    const float *f0 = n == 0 && fw ? fw + (int64_t)(d - o0) * j->d1 : n0;
                    dot_pairs_n(count, w0, w1, h + n * j->I, j->I, j->I, y, n0, n0 + j->d1, f0, f0 + j->d1);
                    for (int r = 0; r < count; r++) {
                        float *o = j->out + j->token[first + n + r] * j->D + d, wt = j->weight[first + n + r];
                        o[0] += wt * y[r];
                        if (both) o[1] += wt * y[BLOCK + r];
                    }
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

static void run(Job base, int threads) {
    parallel(transpose, base, base.A, threads);
    parallel(gate_up, base, (int64_t)base.A * ((base.I + COLUMN_BLOCK - 1) / COLUMN_BLOCK), threads);
    parallel(down, base, (base.D + OUTPUT_BLOCK - 1) / OUTPUT_BLOCK, threads);
}

void small_experts_f32(const float *x, const int64_t *spans, const int64_t *experts, int A, const float *wgu,
                       const float *wd, const int64_t *strides, float *h, float *xt, const int64_t *token,
                       const float *weight, float *out, int D, int I, int threads) {
    Job base = {x, spans, experts, wgu, wd, strides[0], strides[1], strides[2], strides[3], h, xt, token, weight,
                out, A, D, I, 0, 0};
    run(base, threads);
}

/* The GEMM path's experts (more than SMALL_ROWS rows: oneDNN's GEMMs) leave two passes to this library instead of
   seven torch ops: h = silu(gate) * up over the gate_up GEMM's rows, and the down GEMM's rows weighted into their
   tokens' output rows. One expert's rows belong to distinct tokens, so rows split over the team without two
   threads writing one row, and a token's sum over its experts runs in expert order, call by call. */
void silu_mul_rows_f32(const float *gate_up, float *h, int64_t rows, int I, int threads) {
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * I, *u = g + I;
        float *o = h + r * I;
        int i = 0;
        for (; i + LANES <= I; i += LANES) store(o + i, silu_mul_v(load(g + i), load(u + i)));
        for (; i < I; i++) o[i] = silu_mul(g[i], u[i]);
    }
}

void scatter_rows_f32(const float *y, const int64_t *token, const float *weight, float *out, int64_t rows, int D,
                      int threads) {
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *restrict o = out + token[r] * D, w = weight[r];
        const float *restrict yr = y + r * D;
        for (int d = 0; d < D; d++) o[d] += w * yr[d];
    }
}

/* The (token, k) pairs grouped by expert, as rows: a stable counting sort by id (the order of the torch path's
   stable argsort, so the same sums in the same order) instead of a handful of torch calls per layer. ids < 0
   (experts on another rank) are skipped, and so is any id past the last expert, so no input writes outside the
   arrays. xs[r] = x[token[r]], copied over the team; starts [E + 1]: expert e's rows are [starts[e], starts[e + 1]).
   Returns the rows. */
int64_t route_rows_f32(const float *x, int64_t T, int K, const int64_t *ids, const float *topk_weight, int E, int D,
                       float *xs, int64_t *token, float *weight, int64_t *starts, int threads) {
    int64_t pairs = T * K, *next = malloc((E + 1) * sizeof(int64_t));
    memset(starts, 0, (E + 1) * sizeof(int64_t));
    for (int64_t p = 0; p < pairs; p++)
        if (ids[p] >= 0 && ids[p] < E) starts[ids[p] + 1]++;
    for (int e = 0; e < E; e++) { starts[e + 1] += starts[e]; next[e] = starts[e]; }
    for (int64_t p = 0; p < pairs; p++) {
        if (ids[p] < 0 || ids[p] >= E) continue;
        int64_t r = next[ids[p]]++;
        token[r] = p / K;
        weight[r] = topk_weight[p];
    }
    free(next);
    int64_t rows = starts[E];
#pragma omp parallel for num_threads(threads) if (threads > 1 && rows * D * 4 >= THREAD_BYTES) schedule(static)
    for (int64_t r = 0; r < rows; r++) memcpy(xs + r * D, x + token[r] * D, D * sizeof(float));
    return rows;
}

/* A few tokens (every expert then has at most T rows: all within this kernel): their rows grouped here, then every
   expert on the dot-product path, in one call; `out` is zeroed here first (a caller's fill would be a torch op more
   per layer, each paying its dispatch and the activations' trip between the cores). */
void few_tokens_f32(const float *x, int64_t T, int K, const int64_t *ids, const float *topk_weight, int E,
                    const float *wgu, const float *wd, int64_t gu0, int64_t gu1, int64_t d0, int64_t d1, float *h,
                    float *out, int D, int I, int threads) {
    int64_t pairs = T * K, *token = malloc((pairs + 1) * sizeof(int64_t)), *starts = malloc((E + 1) * sizeof(int64_t));
    float *xs = malloc((pairs * D + 1) * sizeof(float)), *weight = malloc((pairs + 1) * sizeof(float));
    memset(out, 0, T * D * sizeof(float));
    route_rows_f32(x, T, K, ids, topk_weight, E, D, xs, token, weight, starts, 1);
    int64_t *spans = malloc((SPAN * E + 1) * sizeof(int64_t)), *experts = malloc((E + 1) * sizeof(int64_t));
    int A = 0;
    for (int e = 0; e < E; e++)
        if (starts[e + 1] > starts[e]) {
            spans[SPAN * A] = starts[e];
            spans[SPAN * A + 1] = starts[e + 1];
            spans[SPAN * A + 2] = starts[e] * I;
            spans[SPAN * A + 3] = -1;  /* a few rows: the dot-product path */
            spans[SPAN * A + 4] = 0;
            experts[A++] = e;
        }
    if (A) {
        Job base = {xs, spans, experts, wgu, wd, gu0, gu1, d0, d1, h, NULL, token, weight, out, A, D, I, 0, 0};
        run(base, threads);
    }
    free(token); free(starts); free(spans); free(experts); free(xs); free(weight);
}
""".replace("EXP_NEG", EXP_NEG_SOURCE).replace("DOT_PAIRS", DOT_PAIRS_SOURCE).replace("@THREAD_BYTES@",
                                                                                    str(THREAD_BYTES))


SOURCE_DIGEST = hashlib.sha256(_SOURCE.encode()).hexdigest()[:16]  # measurements of this kernel name its source
_KERNEL = CFunction("small_experts", _SOURCE, "small_experts_f32",
                    (*[ctypes.c_void_p] * 3, ctypes.c_int, *[ctypes.c_void_p] * 8, *[ctypes.c_int] * 3))
_FEW_TOKENS = CFunction("small_experts", _SOURCE, "few_tokens_f32",
                        (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, *[ctypes.c_void_p] * 2, ctypes.c_int,
                         *[ctypes.c_void_p] * 2, *[ctypes.c_int64] * 4, *[ctypes.c_void_p] * 2, *[ctypes.c_int] * 3))


_ROUTE_ROWS = CFunction("small_experts", _SOURCE, "route_rows_f32",
                        (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, *[ctypes.c_void_p] * 2, *[ctypes.c_int] * 2,
                         *[ctypes.c_void_p] * 4, ctypes.c_int), restype=ctypes.c_int64)
_SILU_MUL = CFunction("small_experts", _SOURCE, "silu_mul_rows_f32",
                      (*[ctypes.c_void_p] * 2, ctypes.c_int64, *[ctypes.c_int] * 2))
_SCATTER = CFunction("small_experts", _SOURCE, "scatter_rows_f32",
                     (*[ctypes.c_void_p] * 4, ctypes.c_int64, *[ctypes.c_int] * 2))


def unavailable() -> str | None:
    """Why this backend cannot run here, or None (compiles the kernel on first call)."""
    return _KERNEL.unavailable()


def expert_spans(starts: list[int], experts: list[int], inter: int, dim: int,
                 dot_rows: int) -> tuple[list[tuple], int, int]:
    """Per expert (rows `starts[e]` to `starts[e + 1]`): (first row, end row, offset of its h, offset of its
    transposed rows or -1, rows on the blocked path), and the floats of h and of the transposed rows. An expert of
    more than `dot_rows` rows puts them in blocks of LANES, except a last partial block of at most `dot_rows` rows,
    which goes to the dot-product path (a padded block would cost a whole one); its h is [blocks, inter, LANES], then
    [dot-product rows, inter]."""
    spans, h_size, xt_size = [], 0, 0
    for e in experts:
        count = starts[e + 1] - starts[e]
        whole, rest = divmod(count, LANES)
        blocked = 0 if count <= dot_rows else count if rest > dot_rows or whole == 0 else whole * LANES
        padded = -(-blocked // LANES) * LANES
        spans.append((starts[e], starts[e + 1], h_size, xt_size if blocked else -1, blocked))
        h_size += (padded + count - blocked) * inter
        xt_size += padded * dim
    return spans, h_size, xt_size


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
    rows = route_rows_cpu(x, topk_weights, topk_ids, num_experts)
    out = torch.zeros(x.shape, dtype=torch.float32)
    small = [e for e, count in enumerate(rows.counts) if 0 < count <= SMALL_ROWS]
    if small:
        small_experts(out, rows, small, w_gate_up, w_down, moe_crossover.dot_rows(dim, inter))
    large_experts(out, rows, [e for e, count in enumerate(rows.counts) if count > SMALL_ROWS], w_gate_up, w_down)
    return out.to(x.dtype)


def route_rows_cpu(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int
                   ) -> RoutedRows:
    """moe_torch.route_rows for float32 CPU tensors, in one C pass (a counting sort, then the rows copied): the
    same rows in the same order, without the torch path's sort, count and gather calls per layer."""
    tokens, top_k = topk_ids.shape
    dim = x.shape[1]
    x, weights, ids = _routing_arrays(x, topk_weights, topk_ids)
    xs = torch.empty(tokens * top_k, dim, dtype=torch.float32)
    token_rows = torch.empty(tokens * top_k, dtype=torch.int64)
    row_weights = torch.empty(tokens * top_k, dtype=torch.float32)
    starts = torch.empty(num_experts + 1, dtype=torch.int64)
    rows = _ROUTE_ROWS(x.data_ptr(), tokens, top_k, ids.data_ptr(), weights.data_ptr(), num_experts, dim,
                       xs.data_ptr(), token_rows.data_ptr(), row_weights.data_ptr(), starts.data_ptr(),
                       torch.get_num_threads())
    bounds = read_back(starts)
    return RoutedRows(xs[:rows], token_rows[:rows], row_weights[:rows], [b - a for a, b in zip(bounds, bounds[1:])],
                      bounds)


def small_experts(out: torch.Tensor, rows: RoutedRows, experts: list[int], w_gate_up: torch.Tensor,
                  w_down: torch.Tensor, dot_rows: int) -> None:
    """out[token] += weight * expert(x) for the rows of each of `experts` (at most SMALL_ROWS each) in the C kernel:
    experts of at most `dot_rows` rows on the dot-product path, the others blocked."""
    inter, dim = w_down.shape[2], w_down.shape[1]
    spans, h_size, xt_size = expert_spans(rows.starts, experts, inter, dim, dot_rows)
    spans_t, ids = torch.tensor(spans, dtype=torch.int64), torch.tensor(experts, dtype=torch.int64)
    strides = torch.tensor([w_gate_up.stride(0), w_gate_up.stride(1), w_down.stride(0), w_down.stride(1)],
                           dtype=torch.int64)
    h, xt = torch.empty(h_size, dtype=torch.float32), torch.empty(max(xt_size, 1), dtype=torch.float32)
    xs, token_rows, weights = (t.contiguous() for t in (rows.xs, rows.token_rows, rows.weights))
    _KERNEL(xs.data_ptr(), spans_t.data_ptr(), ids.data_ptr(), len(experts),
            w_gate_up.data_ptr(), w_down.data_ptr(), strides.data_ptr(), h.data_ptr(), xt.data_ptr(),
            token_rows.data_ptr(), weights.data_ptr(), out.data_ptr(), dim, inter, torch.get_num_threads())


def large_experts(out: torch.Tensor, rows: RoutedRows, experts: list[int], w_gate_up: torch.Tensor,
                  w_down: torch.Tensor) -> None:
    """out[token] += weight * expert(x) for the rows of each of `experts`: oneDNN's GEMM pair per expert, the silu
    and the weighted scatter in C (moe_torch.accumulate_experts' sums, in one pass each)."""
    inter, dim = w_down.shape[2], w_down.shape[1]
    token_rows, weights = rows.token_rows.contiguous(), rows.weights.contiguous()
    available = torch.get_num_threads()
    for expert in experts:
        start, end = rows.starts[expert], rows.starts[expert + 1]
        count = end - start
        gate_up = gemm_onednn.linear(rows.xs[start:end], w_gate_up[expert]).contiguous()
        hidden = torch.empty(count, inter, dtype=torch.float32)
        _SILU_MUL(gate_up.data_ptr(), hidden.data_ptr(), count, inter, _threads(count * 2 * inter * 4, available))
        y = gemm_onednn.linear(hidden, w_down[expert]).contiguous()
        _SCATTER(y.data_ptr(), token_rows[start:].data_ptr(), weights[start:].data_ptr(), out.data_ptr(), count, dim,
                 _threads(count * dim * 8, available))


def _threads(nbytes: int, available: int) -> int:
    return max(1, min(available, nbytes // THREAD_BYTES))


def _few_tokens(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
    """fused_moe_cpu for at most FEW_TOKENS tokens: the routing's grouping by expert done by the kernel too."""
    tokens, top_k = topk_ids.shape
    x, weights, ids = _routing_arrays(x, topk_weights, topk_ids)
    out = torch.empty(x.shape, dtype=torch.float32)
    h = torch.empty(tokens * top_k, w_down.shape[2], dtype=torch.float32)
    _FEW_TOKENS(x.data_ptr(), tokens, top_k, ids.data_ptr(), weights.data_ptr(), w_gate_up.shape[0],
                w_gate_up.data_ptr(), w_down.data_ptr(), *w_gate_up.stride()[:2], *w_down.stride()[:2], h.data_ptr(),
                out.data_ptr(), x.shape[1], w_down.shape[2], torch.get_num_threads())
    return out.to(x.dtype)


def _routing_arrays(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, float32 routing weights and int64 expert ids, each dense, as the C grouping reads them."""
    return x.contiguous(), topk_weights.to(torch.float32).contiguous(), topk_ids.to(torch.int64).contiguous()
