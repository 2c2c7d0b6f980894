"""Paged decode attention for CPU tensors, reading each sequence's pages in place.

The torch path (attention_torch.py) gathers every sequence's pages into padded K/V before attending:
a copy of the whole cache per call, plus padding. This backend is a small C kernel, compiled on first
use with the system C compiler and loaded through ctypes: for each sequence it walks its pages where
they lie, one page at a time, with an online softmax, every query head reusing the page's K/V rows
from cache, so every cached K/V byte is read from memory once. Sequences are split over
`torch.get_num_threads()` POSIX threads.

float32 only (the CPU engine's dtype); caches may be strided views with a dense last dim. Without a C
compiler the backend reports itself unavailable and the registry keeps the torch path.
"""

from __future__ import annotations

import ctypes

import torch

from batchgen.kernels.c_library import CFunction

_SOURCE = r"""
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

typedef struct {
    const float *q, *k, *v; const int32_t *table, *lens; float *out;
    int batch, heads, kv_heads, dk, dv, page, max_pages; float scale;
    int64_t ks[3], vs[3];  /* element strides of the caches: page, token, head (the last dim is dense) */
    int first, last;  /* sequences [first, last) */
} Job;

/* One sequence, all heads: each page's K/V rows (every KV head side by side) are read from memory
   once and reused from cache by the query heads that share them. */
static void attend(const Job *j, int b, float *scores, float *acc, float *m, float *l) {
    int len = j->lens[b], group = j->heads / j->kv_heads;
    const float *q = j->q + (int64_t)b * j->heads * j->dk;
    for (int x = 0; x < j->heads; x++) { m[x] = -INFINITY; l[x] = 0.f; }
    for (int x = 0; x < j->heads * j->dv; x++) acc[x] = 0.f;
    for (int p = 0; p * j->page < len; p++) {
        int64_t page = j->table[(int64_t)b * j->max_pages + p];
        int n = len - p * j->page < j->page ? len - p * j->page : j->page;
        const float *kp = j->k + page * j->ks[0];
        const float *vp = j->v + page * j->vs[0];
        for (int x = 0; x < j->heads; x++) {
            int h = x / group;
            const float *qx = q + x * j->dk;
            float *sx = scores + x * j->page;
            float best = m[x];
            for (int t = 0; t < n; t++) {
                const float *kt = kp + t * j->ks[1] + h * j->ks[2];
                float s = 0.f;
                for (int d = 0; d < j->dk; d++) s += qx[d] * kt[d];
                s *= j->scale;
                sx[t] = s;
                best = s > best ? s : best;
            }
            float shrink = expf(m[x] - best), total = 0.f;
            for (int t = 0; t < n; t++) { sx[t] = expf(sx[t] - best); total += sx[t]; }
            float *ax = acc + x * j->dv;
            for (int d = 0; d < j->dv; d++) ax[d] *= shrink;
            for (int t = 0; t < n; t++) {
                const float *vt = vp + t * j->vs[1] + h * j->vs[2];
                float w = sx[t];
                for (int d = 0; d < j->dv; d++) ax[d] += w * vt[d];
            }
            l[x] = l[x] * shrink + total;
            m[x] = best;
        }
    }
    float *o = j->out + (int64_t)b * j->heads * j->dv;
    for (int x = 0; x < j->heads; x++)
        for (int d = 0; d < j->dv; d++) o[x * j->dv + d] = l[x] > 0.f ? acc[x * j->dv + d] / l[x] : 0.f;
}

static void *run(void *arg) {
    const Job *j = (const Job *)arg;
    float *scores = malloc(sizeof(float) * j->heads * j->page);
    float *acc = malloc(sizeof(float) * j->heads * j->dv);
    float *m = malloc(sizeof(float) * j->heads), *l = malloc(sizeof(float) * j->heads);
    for (int b = j->first; b < j->last; b++) attend(j, b, scores, acc, m, l);
    free(scores); free(acc); free(m); free(l);
    return NULL;
}

void paged_decode_f32(const float *q, const float *k, const float *v, const int32_t *table,
                      const int32_t *lens, float *out, int batch, int heads, int kv_heads, int dk, int dv,
                      int page, int max_pages, float scale, int threads, const int64_t *ks, const int64_t *vs) {
    int items = batch;
    if (threads > items) threads = items;
    if (threads < 1) threads = 1;
    Job jobs[64];
    pthread_t ids[64];
    if (threads > 64) threads = 64;
    for (int t = 0; t < threads; t++) {
        Job j = {q, k, v, table, lens, out, batch, heads, kv_heads, dk, dv, page, max_pages, scale,
                 {ks[0], ks[1], ks[2]}, {vs[0], vs[1], vs[2]},
                 (int)((int64_t)items * t / threads), (int)((int64_t)items * (t + 1) / threads)};
        jobs[t] = j;
    }
    for (int t = 1; t < threads; t++) pthread_create(&ids[t], NULL, run, &jobs[t]);
    run(&jobs[0]);
    for (int t = 1; t < threads; t++) pthread_join(ids[t], NULL);
}
"""

_KERNEL = CFunction("paged_decode", _SOURCE, "paged_decode_f32",
                    (*[ctypes.c_void_p] * 6, *[ctypes.c_int] * 7, ctypes.c_float, ctypes.c_int,
                     *[ctypes.POINTER(ctypes.c_int64)] * 2))


def unavailable() -> str | None:
    """Why this backend cannot run here, or None (compiles the kernel on first call)."""
    return _KERNEL.unavailable()


def paged_decode_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Same contract as kernels.ops.paged_decode_attention, for float32 CPU tensors."""
    batch, heads, dim_k = q.shape
    _, page_size, kv_heads, _ = k_cache.shape
    dim_v = v_cache.shape[-1]
    q = q.contiguous()
    k_cache, v_cache = (c if c.stride(-1) == 1 else c.contiguous() for c in (k_cache, v_cache))  # views stay views
    table = page_table.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    if batch and int(lens.max()) > table.shape[1] * page_size:
        row = int(lens.argmax())
        raise ValueError(f"paged_decode_attention: seq_lens[{row}] = {int(lens[row])} exceeds page_table capacity "
                         f"{table.shape[1]} pages x {page_size}")
    out = torch.empty(batch, heads, dim_v, dtype=q.dtype)
    _KERNEL(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(), lens.data_ptr(), out.data_ptr(),
            batch, heads, kv_heads, dim_k, dim_v, page_size, table.shape[1], float(scale), torch.get_num_threads(),
            _strides(k_cache), _strides(v_cache))
    return out


def _strides(cache: torch.Tensor) -> ctypes.Array:
    """(page, token, head) element strides of a [pages, page_size, heads, dim] cache."""
    return (ctypes.c_int64 * 3)(*cache.stride()[:3])
