"""Grouped MoE experts for float32 CPU tensors: a C kernel for the experts few tokens were routed to.

An expert that gets a handful of rows is a GEMV: its time is the read of its weights. One BLAS call per projection per
expert reads them on one core and pays a call's overhead each (in decode tail steps, at 1-8 rows per expert, 3.5-8x the
read of the weights). This kernel reads the weights of all such experts in one call, split evenly over
`torch.get_num_threads()` threads of the OpenMP pool torch runs its own ops on (no threads started per call, none left
spinning against torch's): first every (expert, COLUMN_BLOCK intermediate columns) item computes silu(gate) * up for the
expert's rows, then every item of sixteen output columns sums the down projection and adds it, weighted, into the
token's output row (threads own disjoint output columns, so no two write the same element and the order of the sum is
fixed). An expert of at most `dot_rows` rows takes the dot-product path (moe_crossover.py measures, per CPU, up to how
many rows it wins): BLOCK token rows at a time (half a vector register's floats: 8 with AVX-512, 4 with AVX2) against
two weight rows (gate and up; two output columns), the sums in vector registers, so each weight element is loaded once
for the BLOCK; the next weight rows are prefetched meanwhile. An expert of more rows takes the blocked path: its rows
transposed, LANES to a vector (a lane per row), each weight element broadcast against the vector (COLUMN_BLOCK gate and
as many up rows at once, no horizontal sums), so each is loaded once per LANES rows at 2 FMAs a cycle; a last partial
block of at most `dot_rows` rows goes to the dot-product path instead of a padded block (in the same item, while its
weight rows are in cache). On the dev box's 2 threads (an AVX-512 Intel Xeon) a 16-expert 512 x 1024 layer at 8 / 16 /
20 / 24 rows per expert on average (random top-2 routing) took 3.2-3.6 / 5.5-5.6 / 5.2-6.2 / 5.8-6.9 ms this way,
3.4-4.5 / 6.6-7.8 / 7.8-9.4 / 9.0-10.0 ms with every partial block padded, and 4.0 / 7.1 / - / 8.9 ms with the dot path
up to 16 rows and oneDNN above. Experts with more rows than SMALL_ROWS are GEMMs oneDNN (MKL on Intel) runs faster
(gemm_onednn.py), a pair of calls per expert (moe_torch.py). The kernel groups a call's rows by expert itself (a
counting sort, torch's order) and runs the small experts in the same call, so a call reads nothing back to the host
unless an expert got more than SMALL_ROWS rows: a decode step's forward of any batch size can be recorded and replayed
(kernels/capture.py). A call of at most FEW_TOKENS tokens (a decode step's tail) runs every expert on the dot-product
path.
"""

from __future__ import annotations

import ctypes
import hashlib
from dataclasses import dataclass

import torch

from batchgen.kernels import gemm_onednn, moe_crossover, registry
from batchgen.kernels.c_library import DOT_PAIRS_SOURCE, EXP_NEG_SOURCE, ROUTE_ROWS_SOURCE, SILU_SOURCE, CFunction
from batchgen.kernels.capture import read_back
from batchgen.kernels.moe_torch import RoutedRows

# rows per expert up to which this kernel beats oneDNN's GEMMs (a layer of 16 512 x 1024 experts, cold, 2 threads of
# the dev box, random top-2 routing: at 48 rows per expert on average 11.0 ms with the blocked path up to 64 rows
# against 14.6 ms with oneDNN above 16)
SMALL_ROWS = 64
FEW_TOKENS = 16  # tokens of a call up to which one kernel call groups and runs them (the dot path's row counts)
THREAD_BYTES = 256 << 10  # bytes a pass of glue moves (row copies, silu, scatter): less is not worth a second thread
INVARIANT_ROWS = 1 << 30  # batch-invariant calls: every expert's rows on the dot-product path, however many

_SOURCE = r"""
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define COLUMN_BLOCK (REGISTERS / 4)  /* intermediate columns of a gate/up item: their gate and up sums, an operand
                                        and a broadcast in registers (8 + 8 + 2 of AVX-512's 32, 4 + 4 + 2 of AVX2's) */
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

SILU

/* The blocked path, for experts of more than a few rows: the rows sit transposed, LANES to a vector (one lane per
   row), and every weight element is broadcast against the vector: g[c] += wg[c][k] * xt[k], no horizontal sums, each
   weight element loaded once per LANES rows. n (a constant after inlining) weight rows `stride` apart go at once
   (n gate and n up rows: 2n sums), each prefetched a few cache lines ahead: n streams at a time are more than the
   hardware's stream prefetch follows. */
static inline __attribute__((always_inline)) void outer_pairs(int n, const float *restrict wg,
                                                              const float *restrict wu, int64_t stride,
                                                              const float *restrict xt, int len, vec *g, vec *u) {
    /* row c at wg + offset[c]: two moving bases and n fixed offsets keep the 2n streams in general registers */
    int64_t offset[COLUMN_BLOCK];
    for (int c = 0; c < n; c++) { g[c] = (vec){0}; u[c] = (vec){0}; offset[c] = c * stride; }
    for (int k0 = 0; k0 < len; k0 += LANES) {
        for (int c = 0; c < n; c++) {
            __builtin_prefetch(wg + offset[c] + k0 + 4 * LANES, 0, 0);
            __builtin_prefetch(wu + offset[c] + k0 + 4 * LANES, 0, 0);
        }
        int k1 = k0 + LANES < len ? k0 + LANES : len;
        for (int k = k0; k < k1; k++) {
            vec x = load(xt + (int64_t)k * LANES);
            const float *pg = wg + k, *pu = wu + k;
            for (int c = 0; c < n; c++) { g[c] += pg[offset[c]] * x; u[c] += pu[offset[c]] * x; }
        }
    }
}

/* outer_pairs for n weight rows alone (the down projection): y[c] += w[c][k] * ht[k] */
static inline __attribute__((always_inline)) void outer_rows(int n, const float *restrict w, int64_t stride,
                                                             const float *restrict ht, int len, vec *y) {
    int64_t offset[8];
    for (int c = 0; c < n; c++) { y[c] = (vec){0}; offset[c] = c * stride; }
    for (int k0 = 0; k0 < len; k0 += LANES) {
        for (int c = 0; c < n; c++) __builtin_prefetch(w + offset[c] + k0 + 4 * LANES, 0, 0);
        int k1 = k0 + LANES < len ? k0 + LANES : len;
        for (int k = k0; k < k1; k++) {
            vec x = load(ht + (int64_t)k * LANES);
            const float *p = w + k;
            for (int c = 0; c < n; c++) y[c] += p[offset[c]] * x;
        }
    }
}

static void outer_pairs_n(int n, const float *wg, const float *wu, int64_t stride, const float *xt, int len, vec *g,
                          vec *u) {
    if (n == COLUMN_BLOCK) outer_pairs(COLUMN_BLOCK, wg, wu, stride, xt, len, g, u);
    else for (int c = 0; c < n; c++) outer_pairs(1, wg + c * stride, wu + c * stride, stride, xt, len, g + c, u + c);
}

/* eight rows at a time: sixteen streams' offsets would not fit the general registers */
static void outer_rows_n(int n, const float *w, int64_t stride, const float *ht, int len, vec *y) {
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
            vec g[COLUMN_BLOCK], u[COLUMN_BLOCK];
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
                vec y[OUTPUT_BLOCK];
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

ROUTE_ROWS

/* An expert's rows on the blocked path: none up to dot_rows; past it whole blocks of LANES, and a last partial block
   too unless it has at most dot_rows rows (those take the dot-product path while the weights are in cache: a padded
   block would cost a whole one). */
static int64_t blocked_rows(int64_t count, int dot_rows) {
    int64_t whole = count / LANES, rest = count % LANES;
    if (count <= dot_rows) return 0;
    return rest > dot_rows || whole == 0 ? count : whole * LANES;
}

/* A whole MoE call: the (token, k) pairs grouped by expert (route_rows_f32), then every expert of at most small_rows
   rows computed here, in one call; `out` is zeroed first (a caller's fill would be a torch op more per layer, each
   paying its dispatch and the activations' trip between the cores). Nothing is read back to the host in between, so
   a recorded forward (kernels/capture.py) can replay a call of any size. Returns how many experts got more rows than
   small_rows: the GEMM path's, left for the caller in xs, token, weight and starts. spans [E, SPAN] and experts [E]
   receive the layout of the experts run here (experts[a] = -1 past the last). -1: its buffers could not be
   allocated. */
int64_t grouped_experts_f32(const float *x, int64_t T, int K, const int64_t *ids, const float *topk_weight, int E,
                            const float *wgu, const float *wd, const int64_t *strides, int dot_rows, int small_rows,
                            float *xs, int64_t *token, float *weight, int64_t *starts, int64_t *spans,
                            int64_t *experts, float *out, int D, int I, int threads) {
    memset(out, 0, T * D * sizeof(float));
    if (route_rows_f32(x, T, K, ids, topk_weight, E, D, xs, token, weight, starts, threads)) return -1;
    int64_t h_size = 0, xt_size = 0, large = 0;
    int A = 0;
    for (int e = 0; e < E; e++) {
        int64_t count = starts[e + 1] - starts[e];
        if (count > small_rows) large++;
        if (count == 0 || count > small_rows) continue;
        int64_t blocked = blocked_rows(count, dot_rows), padded = (blocked + LANES - 1) / LANES * LANES;
        int64_t *span = spans + SPAN * A;
        span[0] = starts[e];
        span[1] = starts[e + 1];
        span[2] = h_size;
        span[3] = blocked ? xt_size : -1;
        span[4] = blocked;
        h_size += (padded + count - blocked) * I;
        xt_size += padded * D;
        experts[A++] = e;
    }
    for (int a = A; a < E; a++) experts[a] = -1;
    if (A) {
        float *h = malloc((h_size + 1) * sizeof(float)), *xt = malloc((xt_size + 1) * sizeof(float));
        if (!h || !xt) {
            free(h);
            free(xt);
            return -1;
        }
        Job base = {xs, spans, experts, wgu, wd, strides[0], strides[1], strides[2], strides[3], h, xt, token, weight,
                    out, A, D, I, 0, 0};
        run(base, threads);
        free(h);
        free(xt);
    }
    return large;
}
""".replace("EXP_NEG", EXP_NEG_SOURCE).replace("DOT_PAIRS", DOT_PAIRS_SOURCE).replace("SILU", SILU_SOURCE).replace(
    "ROUTE_ROWS", ROUTE_ROWS_SOURCE).replace("@THREAD_BYTES@",
                                                                                    str(THREAD_BYTES))


SOURCE_DIGEST = hashlib.sha256(_SOURCE.encode()).hexdigest()[:16]  # measurements of this kernel name its source
SPAN = 5  # int64s per expert in a GroupedCall's layout (the C source's SPAN)
_GROUPED = CFunction("small_experts", _SOURCE, "grouped_experts_f32",
                     (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, *[ctypes.c_void_p] * 2, ctypes.c_int,
                      *[ctypes.c_void_p] * 3, *[ctypes.c_int] * 2, *[ctypes.c_void_p] * 7, *[ctypes.c_int] * 3),
                     restype=ctypes.c_int64)
_SILU_MUL = CFunction("small_experts", _SOURCE, "silu_mul_rows_f32",
                      (*[ctypes.c_void_p] * 2, ctypes.c_int64, *[ctypes.c_int] * 2))
_SCATTER = CFunction("small_experts", _SOURCE, "scatter_rows_f32",
                     (*[ctypes.c_void_p] * 4, ctypes.c_int64, *[ctypes.c_int] * 2))


def unavailable() -> str | None:
    """Why this backend cannot run here, or None (compiles the kernel on first call)."""
    return _GROUPED.unavailable()


@dataclass
class GroupedCall:
    """One call of the kernel: its output (the experts of at most SMALL_ROWS rows summed in), the rows it grouped by
    expert, and the layout it ran them in."""

    out: torch.Tensor  # [T, D]
    xs: torch.Tensor  # [T * K, D] the routed rows, by expert (the first starts[E] of them)
    token_rows: torch.Tensor  # [T * K] int64 output row of each
    weights: torch.Tensor  # [T * K] float32 routing weight of each
    starts: torch.Tensor  # [E + 1] int64: expert e's rows are [starts[e], starts[e + 1])
    # [E, SPAN] per expert run here: first row, end row, offset of its h, offset of its transposed rows (-1: none),
    # rows on the blocked path; `experts` [E] their ids, -1 past the last
    layout: torch.Tensor
    experts: torch.Tensor
    large: int  # experts of more than SMALL_ROWS rows, left out

    def routed(self) -> RoutedRows:
        """The grouped rows as moe_torch.route_rows gives them (read back to the host)."""
        bounds = read_back(self.starts)
        rows = bounds[-1]
        return RoutedRows(self.xs[:rows], self.token_rows[:rows], self.weights[:rows],
                          [b - a for a, b in zip(bounds, bounds[1:])], bounds)


def grouped_experts(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, dot_rows: int, small_rows: int | None = None) -> GroupedCall:
    """The C kernel on a whole call: the routing's rows grouped by expert and every expert of at most `small_rows`
    rows (None: SMALL_ROWS) computed (those of at most `dot_rows` on the dot-product path, the others blocked), in one
    call that reads nothing back to the host."""
    tokens, top_k = topk_ids.shape
    num_experts, dim, inter = w_gate_up.shape[0], x.shape[1], w_down.shape[2]
    x, weights, ids = x.contiguous(), topk_weights.to(torch.float32).contiguous(), topk_ids.to(torch.int64).contiguous()
    strides = torch.tensor([*w_gate_up.stride()[:2], *w_down.stride()[:2]], dtype=torch.int64)
    call = GroupedCall(out=torch.empty(tokens, dim, dtype=torch.float32),
                       xs=torch.empty(tokens * top_k, dim, dtype=torch.float32),
                       token_rows=torch.empty(tokens * top_k, dtype=torch.int64),
                       weights=torch.empty(tokens * top_k, dtype=torch.float32),
                       starts=torch.empty(num_experts + 1, dtype=torch.int64),
                       layout=torch.empty(num_experts, SPAN, dtype=torch.int64),
                       experts=torch.empty(num_experts, dtype=torch.int64), large=0)
    call.large = _GROUPED(x.data_ptr(), tokens, top_k, ids.data_ptr(), weights.data_ptr(), num_experts,
                          w_gate_up.data_ptr(), w_down.data_ptr(), strides.data_ptr(), dot_rows,
                          SMALL_ROWS if small_rows is None else small_rows,
                          call.xs.data_ptr(), call.token_rows.data_ptr(), call.weights.data_ptr(),
                          call.starts.data_ptr(), call.layout.data_ptr(), call.experts.data_ptr(), call.out.data_ptr(),
                          dim, inter, torch.get_num_threads())
    if call.large < 0:
        raise MemoryError(f"fused_moe: no memory for the buffers of {tokens * top_k} routed rows")
    return call


def fused_moe_cpu(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Same contract as kernels.ops.fused_moe, for float32 CPU tensors."""
    dim, inter = w_down.shape[1], w_down.shape[2]
    w_gate_up, w_down = (w if w.stride(-1) == 1 else w.contiguous() for w in (w_gate_up, w_down))
    if registry.batch_invariant():  # every expert on the dot-product path: each row's sums in one order
        call = grouped_experts(x, w_gate_up, w_down, topk_weights, topk_ids, INVARIANT_ROWS, INVARIANT_ROWS)
        return call.out.to(x.dtype)
    # a few tokens: no expert can get more rows than there are tokens, all of them on the dot-product path
    dot_rows = SMALL_ROWS if x.shape[0] <= FEW_TOKENS else moe_crossover.dot_rows(dim, inter)
    call = grouped_experts(x, w_gate_up, w_down, topk_weights, topk_ids, dot_rows)
    if call.large:
        rows = call.routed()
        large_experts(call.out, rows, [e for e, count in enumerate(rows.counts) if count > SMALL_ROWS], w_gate_up,
                      w_down)
    return call.out.to(x.dtype)


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
