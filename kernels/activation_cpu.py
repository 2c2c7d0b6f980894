"""silu(gate) * up and sigmoid for float32 CPU tensors, every element through one vector formula: batch invariant.

torch computes a transcendental elementwise op in a vector loop and a scalar tail that round apart, and splits a large
tensor over its threads at offsets that depend on the element count and thread count: which rows land in a share's
scalar tail depends on the rest of the batch (3 threads, a [301, 256] silu: rows 100, 200 and 300 differed from the
same rows computed alone). Here each element's result depends on its own inputs alone: sixteen lanes at a time, the
last few through a padded vector, the threads splitting the vectors as they like. The formula is the vector one of
c_library.SILU_SOURCE (e^-|x| from a degree-6 polynomial, ~1e-7 relative error), the packed MoE kernel's.
"""

from __future__ import annotations

import ctypes

import torch

from batchgen.kernels.c_library import EXP_NEG_SOURCE, SILU_SOURCE, VECTOR_SOURCE, CFunction

THREAD_BYTES = 256 << 10  # of input: below, waking a second thread costs more than it saves

_SOURCE = r"""
#include <omp.h>
#include <stdint.h>
#include <string.h>

EXP_NEG

VECTORS

SILU

/* 1 / (1 + e^-x) from e^-|x| (no overflow either side) */
static inline vec sigmoid_v(vec x) {
    const vec zero = {0};
    veci negative = x < zero;
    vec e = exp_neg_v(blend(negative, x, zero - x));
    return blend(negative, e, zero + 1.f) / (1.f + e);
}

/* the `rest` (< LANES) elements from `from` as one vector, zero-padded: they take the same lanes' arithmetic as
   any other element, whatever their position */
static inline vec padded(const float *from, int64_t rest) {
    float lanes[LANES] = {0};
    memcpy(lanes, from, rest * sizeof(float));
    return load(lanes);
}
static inline void store_part(float *to, vec v, int64_t rest) {
    float lanes[LANES];
    store(lanes, v);
    memcpy(to, lanes, rest * sizeof(float));
}

/* whole vectors over the team, then the last n % LANES elements through a padded vector */
void silu_mul_f32(const float *gate, const float *up, float *out, int64_t n, int threads) {
    int64_t vectors = n / LANES, done = vectors * LANES;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t v = 0; v < vectors; v++)
        store(out + v * LANES, silu_mul_v(load(gate + v * LANES), load(up + v * LANES)));
    if (n > done) store_part(out + done, silu_mul_v(padded(gate + done, n - done), padded(up + done, n - done)),
                             n - done);
}

void sigmoid_f32(const float *x, float *out, int64_t n, int threads) {
    int64_t vectors = n / LANES, done = vectors * LANES;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t v = 0; v < vectors; v++) store(out + v * LANES, sigmoid_v(load(x + v * LANES)));
    if (n > done) store_part(out + done, sigmoid_v(padded(x + done, n - done)), n - done);
}
""".replace("EXP_NEG", EXP_NEG_SOURCE).replace("VECTORS", VECTOR_SOURCE).replace("SILU", SILU_SOURCE)

_SILU_MUL = CFunction("activation", _SOURCE, "silu_mul_f32",
                      (*[ctypes.c_void_p] * 3, ctypes.c_int64, ctypes.c_int))
_SIGMOID = CFunction("activation", _SOURCE, "sigmoid_f32", (*[ctypes.c_void_p] * 2, ctypes.c_int64, ctypes.c_int))


def unavailable() -> str | None:
    """Why these kernels cannot run here, or None (compiles them on first call)."""
    return _SILU_MUL.unavailable()


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up (F.silu(gate) * up to ~1e-7 relative), for float32 CPU tensors of one shape."""
    _check(gate, up)
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    _SILU_MUL(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel(), _threads(gate))
    return out


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """torch.sigmoid(x) to ~1e-7 relative (e^-87 for anything below -87), for a float32 CPU tensor."""
    _check(x, x)
    x = x.contiguous()
    out = torch.empty_like(x)
    _SIGMOID(x.data_ptr(), out.data_ptr(), x.numel(), _threads(x))
    return out


def _check(a: torch.Tensor, b: torch.Tensor) -> None:
    for t in (a, b):
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise ValueError(f"the C activations take float32 CPU tensors, got {t.dtype} on {t.device}")
    if a.shape != b.shape:
        raise ValueError(f"silu_mul takes gate and up of one shape, got {tuple(a.shape)} and {tuple(b.shape)}")


def _threads(x: torch.Tensor) -> int:
    return max(1, min(torch.get_num_threads(), x.numel() * 4 // THREAD_BYTES))
