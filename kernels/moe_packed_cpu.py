"""Routed experts for float32 CPU tensors, from expert weights repacked once for the kernel's register tiles.

In the checkpoints' layout each weight row is one output column ([2I, D] gate and up rows, [D, I] down rows): a
kernel either sums dot products along rows (horizontal sums at the end: moe_cpu's path for an expert's few rows)
or broadcasts one weight element at a time against token rows transposed into vectors (17 loads to 16 FMAs: on the
dev box ~30 % of the FMA peak in L1). Repacked so that the same input index of 2G neighbouring output columns is two
vectors (G = gate_columns(), one vector register's floats: 16 with AVX-512, 8 with AVX2), a tile of up to ROWS token
rows takes the two weight vectors and one broadcast input per row at each index, 2 x ROWS FMAs into registers: the
register tile of a GEMM micro-kernel, ~95 % of the FMA peak with the weights in L2 (a dev-box C loop: 198 of 208
GFLOP/s a core). ROWS is 12 in AVX-512's 32 registers, 6 in AVX2's 16 (BLIS's 6 x 16 Haswell tile).

Packed layouts (`pack_gate_up`, `pack_down`; in place, the same storage: `pack_in_place`):
- gate_up [E, I / G, D, 2G]: block c of G intermediate columns; at input index k, the gate columns Gc .. Gc + G - 1,
  then the same up columns (one tile's sums give silu(gate) * up of G columns at once);
- down [E, D / 2G, I, 2G]: block b of 2G output columns; at intermediate index i, those columns.
Each block is a contiguous 1-4 KiB-per-index stream, read once per tile of rows (from memory for the first, L2 for
the rest) while the next block is fetched into L2. The layout depends on the CPU, so weights are packed where they
run (at load).

`h` (silu(gate) * up, the down pass's input) of a panel of few rows (decode) is chunk-major, [I / G, rows, G]: a
gate_up block's G columns of all the panel's rows are one contiguous run, and the down pass reads its rows' G indexes
from neighbouring lines, where row-major rows 4 KiB apart scatter the same data over as many pages and cache sets.
Larger panels (prefill) keep it row-major, [rows, I], whose rows stream better there.

Every output element is one accumulator summing its inputs in index order, whichever rows share its tile, and a
token's experts are added into its output row in expert order by the one thread owning those columns: a row's
result does not depend on the rest of the batch (batch invariant by construction, as the engine's option asks).
"""

from __future__ import annotations

import ctypes

import torch

from batchgen.kernels.c_library import (
    DOT_PAIRS_SOURCE,
    EXP_NEG_SOURCE,
    ROUTE_ROWS_SOURCE,
    SILU_SOURCE,
    CFunction,
    vector_lanes,
)

# an expert's rows per panel: as many as make this many bytes of its wider rows (x or h), which then stay in L2 while
# the weights' blocks stream past (a layer of bench-moe's: 192 rows; 1.04-1.16x faster at 512-1024 rows per expert)
PANEL_BYTES = 768 << 10
THREAD_BYTES = 256 << 10  # row copies a thread: less is not worth waking a second
# panels of at most this many rows keep `h` chunk-major (below): bench-moe's six expert layers at 4-32 rows per expert
# ran in 0.87-0.96x the time of row-major `h`, at 128-450 rows (prefill) in 1.04-1.05x (row-major streams better there)
CHUNKED_ROWS = 32

_SOURCE = r"""
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* token rows per register tile: 2 x ROWS accumulators, 2 weight vectors and a broadcast in the registers (12 in
   AVX-512's 32, 6 in AVX2's 16) */
#define ROWS (REGISTERS == 32 ? 12 : 6)
#define GATE LANES          /* intermediate columns per gate_up block (gate_columns()) */
#define WIDE (2 * LANES)    /* floats a block holds per input index: a gate_up block's gate and up columns, a down
                               block's output columns */
#define PANEL 3             /* int64s per panel */
#define PANEL_BYTES @PANEL_BYTES@  /* moe_packed_cpu.PANEL_BYTES */
#define CHUNKED_ROWS @CHUNKED_ROWS@  /* moe_packed_cpu.CHUNKED_ROWS */
#define TILE_ROWS_COST 8     /* an item's weight in a thread's share: its rows plus the compute reading a block's
                                weights from memory is worth (rows are the compute, the block's read is fixed) */
#define THREAD_BYTES @THREAD_BYTES@

EXP_NEG

DOT_PAIRS

SILU

ROUTE_ROWS

typedef struct {
    const float *x;            /* [R, D] rows sorted by expert */
    const int64_t *panels;     /* [P, PANEL] each panel's expert, first row, end row: an expert's rows in order */
    const float *wgu, *wd;     /* packed: [E, I / GATE, D, WIDE], [E, D / WIDE, I, WIDE] */
    float *h;                  /* [R, I] silu(gate) * up: a panel's rows from h + first row * I, chunked or not */
    const int64_t *token;      /* [R] output row of each row */
    const float *weight;       /* [R] routing weight of each row */
    float *out;                /* [T, D] accumulated */
    int64_t P;
    int D, I;
} Job;

/* sums[2r], sums[2r + 1] = x_r . w[:, 0:LANES], x_r . w[:, LANES:WIDE] for the n (a constant after inlining) rows
   x_r, over the len indexes of the block w ([len, WIDE]): each sum one accumulator, in index order. Rows are
   x + r * stride, or with `chunked` (a constant too) chunk-major: index k of row r at
   x + (k / GATE) * stride + r * GATE + k % GATE.
   Meanwhile share `part` of `parts` of the next block (`next`, as long) is fetched into L2: a block's tiles of rows
   fetch it in turn, so the memory reads go on through all of them. */
static inline __attribute__((always_inline)) void tile(int n, int chunked, const float *restrict w,
                                                       const float *restrict x, int64_t stride, int len, vec *sums,
                                                       const float *next, int part, int parts) {
    vec acc[2 * ROWS];
    for (int i = 0; i < 2 * n; i++) acc[i] = (vec){0};
    /* (part * len + k) / parts without a division per index: times 2^32 / parts, rounded up (exact while
       part * len + k < 2^32 / parts) */
    uint64_t inverse = ((1ull << 32) + parts - 1) / parts, from = (uint64_t)part * len;
    for (int k = 0; k < len; k++) {
        int64_t ahead = (int64_t)(((from + k) * inverse) >> 32) * WIDE;
        __builtin_prefetch(next + ahead, 0, 2);
#if WIDE > 16  /* AVX-512: an index's floats span two cache lines, and a tile of few rows fetches the block's indexes
                  16 ahead into L1 too. Not with AVX2 (an index one line), where that fetch cost more than it saved:
                  1-27 % of a call at 1-16 tokens per expert on an AMD EPYC (bench/RESULTS.md) */
        __builtin_prefetch(next + ahead + 16, 0, 2);
        if (n <= 8) {
            __builtin_prefetch(w + (int64_t)(k + 16) * WIDE, 0, 3);
            __builtin_prefetch(w + (int64_t)(k + 16) * WIDE + 16, 0, 3);
        }
#endif
        vec w0 = load(w + (int64_t)k * WIDE), w1 = load(w + (int64_t)k * WIDE + LANES);
        for (int r = 0; r < n; r++) {
            float xr = chunked ? x[(k / GATE) * stride + r * GATE + k % GATE] : x[r * stride + k];
            acc[2 * r] += xr * w0;
            acc[2 * r + 1] += xr * w1;
        }
    }
    for (int i = 0; i < 2 * n; i++) sums[i] = acc[i];
}

/* tile with n and chunked compile-time constants in every case, so each keeps its sums in registers */
static inline __attribute__((always_inline)) void tile_rows(int n, int chunked, const float *w, const float *x,
                                                            int64_t stride, int len, vec *sums, const float *next,
                                                            int part, int parts) {
    switch (n) {
        case 1: tile(1, chunked, w, x, stride, len, sums, next, part, parts); break;
        case 2: tile(2, chunked, w, x, stride, len, sums, next, part, parts); break;
        case 3: tile(3, chunked, w, x, stride, len, sums, next, part, parts); break;
        case 4: tile(4, chunked, w, x, stride, len, sums, next, part, parts); break;
        case 5: tile(5, chunked, w, x, stride, len, sums, next, part, parts); break;
#if REGISTERS == 32
        case 6: tile(6, chunked, w, x, stride, len, sums, next, part, parts); break;
        case 7: tile(7, chunked, w, x, stride, len, sums, next, part, parts); break;
        case 8: tile(8, chunked, w, x, stride, len, sums, next, part, parts); break;
        case 9: tile(9, chunked, w, x, stride, len, sums, next, part, parts); break;
        case 10: tile(10, chunked, w, x, stride, len, sums, next, part, parts); break;
        case 11: tile(11, chunked, w, x, stride, len, sums, next, part, parts); break;
#endif
        default: tile(ROWS, chunked, w, x, stride, len, sums, next, part, parts); break;
    }
}
static void tile_n(int n, int chunked, const float *w, const float *x, int64_t stride, int len, vec *sums,
                   const float *next, int part, int parts) {
    if (chunked) tile_rows(n, 1, w, x, stride, len, sums, next, part, parts);
    else tile_rows(n, 0, w, x, stride, len, sums, next, part, parts);
}

/* A panel's rows in tiles of at most ROWS, as even as they divide: tile t is [first + rows * t / tiles, ...) */
static inline int64_t tiles_of(int64_t rows) { return (rows + ROWS - 1) / ROWS; }
static inline int64_t tile_start(int64_t first, int64_t rows, int64_t t, int64_t tiles) {
    return first + rows * t / tiles;
}

static inline int64_t panel_rows(const Job *j, int64_t q) {
    return j->panels[PANEL * q + 2] - j->panels[PANEL * q + 1];
}

/* A panel's h: chunk-major up to CHUNKED_ROWS rows, else row-major. Row r (from the panel's first) holds the GATE
   columns of block c at h_offset; the tile steps by h_stride (a chunk of GATE indexes, or a row) */
static inline int h_chunked(int64_t rows) { return rows <= CHUNKED_ROWS; }
static inline int64_t h_offset(int64_t rows, int64_t I, int64_t r, int64_t c) {
    return h_chunked(rows) ? (c * rows + r) * GATE : r * I + c * GATE;
}
static inline int64_t h_stride(int64_t rows, int64_t I) { return h_chunked(rows) ? rows * GATE : I; }

/* The first of the P * blocks (panel, block) items whose items before weigh at least `target`, an item of panel q
   weighing its rows + TILE_ROWS_COST */
static int64_t weighted_item(const Job *j, int64_t blocks, int64_t target) {
    int64_t before = 0;
    for (int64_t q = 0; q < j->P; q++) {
        int64_t each = panel_rows(j, q) + TILE_ROWS_COST;
        if (before + blocks * each >= target) {
            int64_t m = (target - before + each - 1) / each;
            return q * blocks + (m < 0 ? 0 : m);
        }
        before += blocks * each;
    }
    return j->P * blocks;
}

/* items: (panel, block of GATE intermediate columns), split over the team by weight (panels' rows vary) */
static void gate_up(const Job *j) {
    int64_t blocks = j->I / GATE, total = 0;
    for (int64_t q = 0; q < j->P; q++) total += blocks * (panel_rows(j, q) + TILE_ROWS_COST);
    int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
    int64_t first = weighted_item(j, blocks, total * t / n);
    int64_t last = t + 1 == n ? j->P * blocks : weighted_item(j, blocks, total * (t + 1) / n);
    for (int64_t item = first; item < last; item++) {
        const int64_t *panel = j->panels + PANEL * (item / blocks);
        int64_t c = item % blocks, r0 = panel[1], rows = panel[2] - panel[1], tiles = tiles_of(rows);
        const float *w = j->wgu + (panel[0] * blocks + c) * j->D * WIDE;
        int64_t after = item + 1 < last ? item + 1 : item;
        const float *next = j->wgu + (j->panels[PANEL * (after / blocks)] * blocks + after % blocks) * j->D * WIDE;
        for (int64_t s = 0; s < tiles; s++) {
            int64_t r = tile_start(r0, rows, s, tiles), count = tile_start(r0, rows, s + 1, tiles) - r;
            vec sums[2 * ROWS];
            tile_n((int)count, 0, w, j->x + r * j->D, j->D, j->D, sums, next, (int)s, (int)tiles);
            for (int64_t q = 0; q < count; q++)
                store(j->h + r0 * j->I + h_offset(rows, j->I, r + q - r0, c), silu_mul_v(sums[2 * q], sums[2 * q + 1]));
        }
    }
}

/* items: blocks of WIDE output columns, every panel (so every expert) in order: a token's sum over its experts in a
   fixed order; threads own disjoint columns, so no two write the same element */
static void down(const Job *j) {
    int64_t blocks = j->D / WIDE, t = omp_get_thread_num(), n = omp_get_num_threads();
    int64_t first = blocks * t / n, last = blocks * (t + 1) / n;
    for (int64_t p = 0; p < j->P; p++) {
        const int64_t *panel = j->panels + PANEL * p;
        int64_t r0 = panel[1], rows = panel[2] - panel[1], tiles = tiles_of(rows);
        int chunked = h_chunked(rows);
        for (int64_t b = first; b < last; b++) {
            const float *w = j->wd + (panel[0] * blocks + b) * j->I * WIDE;
            /* the next item: this panel's next block, else the next panel's first of this thread's */
            const float *next = b + 1 < last ? w + (int64_t)j->I * WIDE
                              : p + 1 < j->P ? j->wd + (panel[PANEL] * blocks + first) * j->I * WIDE : w;
            for (int64_t s = 0; s < tiles; s++) {
                int64_t r = tile_start(r0, rows, s, tiles), count = tile_start(r0, rows, s + 1, tiles) - r;
                vec sums[2 * ROWS];
                tile_n((int)count, chunked, w, j->h + r0 * j->I + h_offset(rows, j->I, r - r0, 0),
                       h_stride(rows, j->I), j->I, sums, next, (int)s, (int)tiles);
                for (int64_t q = 0; q < count; q++) {
                    float *o = j->out + j->token[r + q] * j->D + b * WIDE, wt = j->weight[r + q];
                    store(o, load(o) + wt * sums[2 * q]);
                    store(o + LANES, load(o + LANES) + wt * sums[2 * q + 1]);
                }
            }
        }
    }
}

/* The calling thread's buffer of at least `floats` floats (the rows grouped by expert, then `h`), kept from call to
   call: a prefill's (over the 32 MiB glibc serves from its heap, engine/process_heap.py) would be a fresh mapping,
   faulted in page by page on every call (5-10 % of a call of 3-8 thousand tokens on the dev box). It keeps the largest
   call's size until the thread ends (an engine's step thread: the engine's life). NULL when it cannot be had. */
typedef struct {
    float *data;
    int64_t floats;
} Scratch;
static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;
static void scratch_free(void *held) {
    free(((Scratch *)held)->data);
    free(held);
}
static void scratch_key_make(void) { pthread_key_create(&scratch_key, scratch_free); }
static float *scratch(int64_t floats) {
    pthread_once(&scratch_once, scratch_key_make);
    Scratch *held = pthread_getspecific(scratch_key);
    if (!held) {
        if (!(held = calloc(1, sizeof *held))) return NULL;
        if (pthread_setspecific(scratch_key, held)) {
            free(held);
            return NULL;
        }
    }
    if (floats + 1 > held->floats) {
        free(held->data);
        held->data = malloc((floats + 1) * sizeof(float));
        held->floats = held->data ? floats + 1 : 0;
    }
    return held->data;
}

/* A whole MoE call on packed weights: the (token, k) pairs grouped by expert (route_rows_f32), then every expert with
   rows, in panels of at most PANEL_BYTES of rows, gate_up then down, over `threads` threads of the OpenMP pool torch
   runs its own ops on; `out` is zeroed first. Nothing is read back to the host, so a recorded forward
   (kernels/capture.py) can replay a call of any size. I a multiple of GATE, D of WIDE. Returns -1 when its buffers
   cannot be allocated, else 0. */
int packed_experts_f32(const float *x, int64_t T, int K, const int64_t *ids, const float *topk_weight, int E,
                        const float *wgu, const float *wd, int64_t *token, float *weight, int64_t *starts,
                        float *out, int D, int I, int threads) {
    memset(out, 0, T * D * sizeof(float));
    float *xs = scratch(T * K * (int64_t)(D + I));
    if (!xs || route_rows_f32(x, T, K, ids, topk_weight, E, D, xs, token, weight, starts, threads)) return -1;
    if (!starts[E]) return 0;
    int64_t most = PANEL_BYTES / ((int64_t)(D > I ? D : I) * sizeof(float));  /* rows a panel takes */
    if (most < ROWS) most = ROWS;
    int64_t P = 0, *panels = malloc((E + starts[E] / most + 1) * PANEL * sizeof(int64_t));
    float *h = xs + starts[E] * (int64_t)D;
    if (!panels) return -1;
    for (int e = 0; e < E; e++) {
        int64_t rows = starts[e + 1] - starts[e], count = (rows + most - 1) / most;
        for (int64_t q = 0; q < count; q++, P++) {
            panels[PANEL * P] = e;
            panels[PANEL * P + 1] = starts[e] + rows * q / count;
            panels[PANEL * P + 2] = starts[e] + rows * (q + 1) / count;
        }
    }
    Job job = {xs, panels, wgu, wd, h, token, weight, out, P, D, I};
    int team = threads < 1 ? 1 : threads;
#pragma omp parallel num_threads(team)
    {
        gate_up(&job);
#pragma omp barrier
        down(&job);
    }
    free(panels);
    return 0;
}
""".replace("EXP_NEG", EXP_NEG_SOURCE).replace("DOT_PAIRS", DOT_PAIRS_SOURCE).replace("SILU", SILU_SOURCE).replace(
    "ROUTE_ROWS", ROUTE_ROWS_SOURCE).replace(
    "@PANEL_BYTES@", str(PANEL_BYTES)).replace("@THREAD_BYTES@", str(THREAD_BYTES)).replace(
    "@CHUNKED_ROWS@", str(CHUNKED_ROWS))

_PACKED = CFunction("packed_experts", _SOURCE, "packed_experts_f32",
                    (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, *[ctypes.c_void_p] * 2, ctypes.c_int,
                     *[ctypes.c_void_p] * 6, *[ctypes.c_int] * 3), restype=ctypes.c_int)


def unavailable() -> str | None:
    """Why this backend cannot run here, or None (compiles the kernel on first call)."""
    return _PACKED.unavailable()


def gate_columns() -> int:
    """Intermediate columns per gate_up block: one vector register's floats on this CPU (c_library.vector_lanes)."""
    return vector_lanes()


def down_columns() -> int:
    """Output columns per down block: as many floats an index as a gate_up block (its gate and up columns)."""
    return 2 * vector_lanes()


def packing_refusal(dim: int, inter: int) -> str | None:
    """Why experts of hidden size `dim` and intermediate size `inter` cannot be packed, or None."""
    if inter % gate_columns() or dim % down_columns():
        return (f"packed experts need the intermediate size a multiple of {gate_columns()} and the hidden size one of "
                f"{down_columns()} on this CPU, got {inter} and {dim}")
    return None


def pack_gate_up(w: torch.Tensor) -> torch.Tensor:
    """[E, 2I, D] (gate rows, then up rows) -> [E, I / G, D, 2G] (a new tensor; G = gate_columns())."""
    experts, two_i, dim = w.shape
    gate = gate_columns()
    blocks = two_i // 2 // gate
    return w.reshape(experts, 2, blocks, gate, dim).permute(0, 2, 4, 1, 3).reshape(
        experts, blocks, dim, 2 * gate).contiguous()


def pack_down(w: torch.Tensor) -> torch.Tensor:
    """[E, D, I] -> [E, D / W, I, W] (a new tensor; W = down_columns())."""
    experts, dim, inter = w.shape
    wide = down_columns()
    return w.reshape(experts, dim // wide, wide, inter).permute(0, 1, 3, 2).contiguous()


def pack_in_place(w: torch.Tensor, pack) -> torch.Tensor:
    """`pack(w)` in w's own storage, one expert at a time (a buffer of one expert's weights, not a second copy of
    them all); returns the packed view. w must be contiguous, and is garbage afterwards."""
    if not w.is_contiguous():
        raise ValueError("expert weights to pack in place must be contiguous")
    flat = w.view(w.shape[0], -1)
    shape = None
    for expert in range(w.shape[0]):
        packed = pack(w[expert:expert + 1])
        shape = packed.shape[1:]
        flat[expert].copy_(packed.reshape(-1))
    return w.view(w.shape[0], *shape)


def fused_moe_packed_cpu(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor) -> torch.Tensor:
    """kernels.ops.fused_moe on packed weights (pack_gate_up's, pack_down's), float32 CPU tensors."""
    tokens, top_k = topk_ids.shape
    num_experts, blocks, dim, _ = w_gate_up.shape
    x, weights, ids = x.contiguous(), topk_weights.to(torch.float32).contiguous(), topk_ids.to(torch.int64).contiguous()
    out = torch.empty(tokens, dim, dtype=torch.float32)
    token_rows = torch.empty(tokens * top_k, dtype=torch.int64)
    row_weights = torch.empty(tokens * top_k, dtype=torch.float32)
    starts = torch.empty(num_experts + 1, dtype=torch.int64)
    failed = _PACKED(x.data_ptr(), tokens, top_k, ids.data_ptr(), weights.data_ptr(), num_experts, w_gate_up.data_ptr(),
            w_down.data_ptr(), token_rows.data_ptr(), row_weights.data_ptr(), starts.data_ptr(),
            out.data_ptr(), dim, blocks * gate_columns(), torch.get_num_threads())
    if failed:
        raise MemoryError(f"fused_moe_packed: no memory for the buffers of {tokens * top_k} routed rows")
    return out
