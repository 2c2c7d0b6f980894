"""Write new K/V rows into their cache slots for float32 CPU tensors in one C call.

The torch path is a validity mask, a synchronising `all()`, a dtype cast and an `index_copy_` per cache: at a
decode step's few rows, dispatches rather than bytes (bench-moe, one row: ~15 us a layer). The kernel copies each
(token, KV head) row to its slot, skipping negative slots (padding) and reporting a slot past the cache.
"""

from __future__ import annotations

import ctypes

import torch

from batchgen.kernels.attention_torch import write_kv_torch
from batchgen.kernels.c_library import CFunction

_SOURCE = r"""
#include <stdint.h>
#include <string.h>

/* strides in elements: s[0] token (row) of k / v, s[1] head of k / v, s[2] slot of the cache, s[3] head of the
   cache; the last dim dense everywhere. Returns the first token whose slot lies past the cache, or -1. */
int64_t write_kv_f32(const float *k, const float *v, float *k_cache, float *v_cache, const int64_t *slots, int64_t T,
                     int H, int dk, int dv, int64_t capacity, const int64_t *ks, const int64_t *vs,
                     const int64_t *kcs, const int64_t *vcs) {
    for (int64_t t = 0; t < T; t++)
        if (slots[t] >= capacity) return t;
    for (int64_t t = 0; t < T; t++) {
        int64_t slot = slots[t];
        if (slot < 0) continue;
        for (int h = 0; h < H; h++) {
            memcpy(k_cache + slot * kcs[0] + h * kcs[1], k + t * ks[0] + h * ks[1], dk * sizeof(float));
            memcpy(v_cache + slot * vcs[0] + h * vcs[1], v + t * vs[0] + h * vs[1], dv * sizeof(float));
        }
    }
    return -1;
}
"""

_STRIDES = ctypes.POINTER(ctypes.c_int64)
_KERNEL = CFunction("write_kv", _SOURCE, "write_kv_f32",
                    (*[ctypes.c_void_p] * 5, ctypes.c_int64, *[ctypes.c_int] * 3, ctypes.c_int64, *[_STRIDES] * 4),
                    restype=ctypes.c_int64)


def unavailable() -> str | None:
    """Why this backend cannot run here, or None (compiles the kernel on first call)."""
    return _KERNEL.unavailable()


def write_kv_cpu(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Same contract as kernels.ops.write_kv, for float32 CPU caches (rows of another dtype: the torch path, which
    casts them)."""
    if not all(t.dtype == torch.float32 and t.stride(-1) == 1 for t in (k, v, k_cache, v_cache)):
        write_kv_torch(k, v, k_cache, v_cache, slot_mapping)
        return
    slots = slot_mapping.to(torch.int64).contiguous()
    tokens, heads, dim_k = k.shape
    capacity = k_cache.shape[0] * k_cache.shape[1]
    bad = _KERNEL(k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), tokens,
                  heads, dim_k, v.shape[-1], capacity, _strides(k, 0), _strides(v, 0), _strides(k_cache, 1),
                  _strides(v_cache, 1))
    if bad >= 0:
        raise IndexError(f"write_kv: slot_mapping[{bad}] = {int(slots[bad])} is past the cache's {capacity} slots")


def _strides(t: torch.Tensor, first: int) -> ctypes.Array:
    """(row, head) element strides: dims `first` and `first + 1`."""
    return (ctypes.c_int64 * 2)(t.stride(first), t.stride(first + 1))
