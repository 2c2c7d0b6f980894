"""y = x W^T + b for float32 CPU tensors, from a projection's weight repacked once for the register tile the MoE
kernel runs on (c_library.REGISTER_TILE_SOURCE, moe_packed_cpu.py).

A decode step's projections (attention's q, k, v and o, dense MLPs, the LM head) see tens of rows: too many for the
dot-product kernel (linear_cpu.py: each weight row against eight token rows at a time, then horizontal sums) to keep
up with the compute, too few for BLAS's GEMM to amortise its blocking. Packed as [O / 32, D, 32], block b holding
output columns 32b .. 32b + 31 index by index, a tile of up to TILE_ROWS rows takes two weight vectors and one
broadcast input per row at each index: on the dev box (2 threads, weights cold) a 512 x 512 projection at 24-64 rows
took 0.6-0.7x the time of linear_cpu's path, the 4096 x 512 LM head 0.55-0.65x; with 512 rows and more (prefill)
it runs within 5-15 % of MKL.

Layout (`pack_linear`, in place: `pack_linear_in_place`): weight [O, D] -> [O / 32, D, 32]; block b is rows 32b ..
32b + 31 of the weight transposed, so packing in place moves one block at a time. O must be a multiple of 32.
Every output element is one accumulator over the input indexes in order, whichever rows share its tile: a row's
result does not depend on the rest of the batch.
"""

from __future__ import annotations

import ctypes

import torch

from batchgen.kernels.c_library import DOT_PAIRS_SOURCE, REGISTER_TILE_SOURCE, TILE_COLUMNS, TILE_ROWS, CFunction
from batchgen.kernels.moe_packed_cpu import pack_in_place

THREAD_BYTES = 128 << 10  # weight bytes streamed per thread (once per tile of rows) worth waking another thread

_SOURCE = r"""
#include <omp.h>
#include <stdint.h>
#include <string.h>

DOT_PAIRS

REGISTER_TILE

/* out [R, O] = x [R, D] w^T (+ bias [O]) from w packed [O / WIDE, D, WIDE]. Items (panel of rows, block of WIDE
   columns), the panels' rows kept in L2 while each block streams past its tiles, split evenly over the team. */
void packed_linear_f32(const float *x, int64_t rows, const float *w, const float *bias, float *out, int D, int O,
                       int threads) {
    int64_t blocks = O / WIDE, most = PANEL_BYTES / ((int64_t)D * sizeof(float));
    if (most < ROWS) most = ROWS;
    int64_t panels = (rows + most - 1) / most, items = panels * blocks;
    if (threads > items) threads = (int)items;
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads)
    {
        int64_t first, last;
        team_share(items, &first, &last);
        for (int64_t item = first; item < last; item++) {
            int64_t p = item / blocks, b = item % blocks;
            int64_t r0 = rows * p / panels, count = rows * (p + 1) / panels - r0, tiles = tiles_of(count);
            const float *wb = w + b * (int64_t)D * WIDE;
            const float *next = item + 1 < last ? w + ((item + 1) % blocks) * (int64_t)D * WIDE : wb;
            for (int64_t s = 0; s < tiles; s++) {
                int64_t r = tile_start(r0, count, s, tiles), n = tile_start(r0, count, s + 1, tiles) - r;
                v16 sums[2 * ROWS];
                tile_n((int)n, wb, x + r * D, D, D, sums, next, (int)s, (int)tiles);
                v16 b0 = {0}, b1 = {0};
                if (bias) { b0 = load(bias + b * WIDE); b1 = load(bias + b * WIDE + LANES); }
                for (int64_t q = 0; q < n; q++) {
                    store(out + (r + q) * O + b * WIDE, sums[2 * q] + b0);
                    store(out + (r + q) * O + b * WIDE + LANES, sums[2 * q + 1] + b1);
                }
            }
        }
    }
}
""".replace("DOT_PAIRS", DOT_PAIRS_SOURCE).replace("REGISTER_TILE", REGISTER_TILE_SOURCE)

_KERNEL = CFunction("packed_linear", _SOURCE, "packed_linear_f32",
                    (ctypes.c_void_p, ctypes.c_int64, *[ctypes.c_void_p] * 3, *[ctypes.c_int] * 3))


def unavailable() -> str | None:
    """Why this backend cannot run here, or None (compiles the kernel on first call)."""
    return _KERNEL.unavailable()


def packing_refusal(weight: torch.Tensor) -> str | None:
    """Why a projection's `weight` [O, D] cannot be packed, or None."""
    if weight.dim() != 2 or weight.shape[0] % TILE_COLUMNS:
        return f"packed projections need [O, D] weights with O a multiple of {TILE_COLUMNS}, got {list(weight.shape)}"
    return None


def pack_linear(weight: torch.Tensor) -> torch.Tensor:
    """[O, D] -> [O / 32, D, 32] (a new tensor)."""
    out_features, dim = weight.shape
    return weight.reshape(out_features // TILE_COLUMNS, TILE_COLUMNS, dim).transpose(1, 2).contiguous()


def pack_linear_in_place(weight: torch.Tensor) -> torch.Tensor:
    """`pack_linear(weight)` in weight's own storage, a block at a time; weight must be contiguous, and is garbage
    afterwards."""
    out_features, dim = weight.shape
    blocks = weight.view(out_features // TILE_COLUMNS, TILE_COLUMNS, dim)
    return pack_in_place(blocks, lambda block: block.transpose(1, 2))


def linear_packed_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """kernels.ops.linear_packed for float32 CPU tensors: x [..., D], weight packed [O / 32, D, 32]."""
    blocks, dim, _ = weight.shape
    out_features = blocks * TILE_COLUMNS
    rows = x.reshape(-1, dim).contiguous()
    if bias is not None:
        bias = bias.contiguous()  # held here: a temporary's pointer would name freed memory by the call
    out = torch.empty(rows.shape[0], out_features, dtype=torch.float32)
    streamed = weight.numel() * 4 * -(-rows.shape[0] // TILE_ROWS)
    threads = min(torch.get_num_threads(), streamed // THREAD_BYTES) or 1
    _KERNEL(rows.data_ptr(), rows.shape[0], weight.data_ptr(), None if bias is None else bias.data_ptr(),
            out.data_ptr(), dim, out_features, threads)
    return out.view(*x.shape[:-1], out_features)
