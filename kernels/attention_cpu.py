"""Paged decode attention for CPU tensors, reading each sequence's pages in place.

The torch path (attention_torch.py) gathers every sequence's pages into padded K/V before attending: a copy of the
whole cache per call, plus padding. This backend is a small C kernel, compiled on first use with the system C compiler
and loaded through ctypes: for each sequence it walks its pages where they lie, one page at a time, with an online
softmax, every query head reusing the page's K/V rows from cache, so every cached K/V byte is read from memory once.
What bounds it is the memory, so the next page (of the sequence, or the next sequence's first) is prefetched row by
row while the current one is computed (the pages lie scattered through the pool), query heads sharing a KV head go
four at a time over each K/V row (their weighted V sums held in vector registers across a page's tokens, 16-64 dims at
a time, or one head's whole row where four heads' blocks would split it), and the softmax's exponentials are a
polynomial the compiler vectorises instead of a libm call each. Sequences are split over up to
`torch.get_num_threads()` threads of the OpenMP pool torch itself runs on (no threads started per call, none spinning
against torch's), one per THREAD_BYTES of K/V read, each taking an equal share of the tokens (not of the sequences).

float32 only (the CPU engine's dtype); caches may be strided views with a dense last dim. Without a C
compiler the backend reports itself unavailable and the registry keeps the torch path.
"""

from __future__ import annotations

import ctypes

import torch

from batchgen.kernels.c_library import EXP_NEG_SOURCE, ROW_MAX_SOURCE, VECTOR_SOURCE, CFunction

THREAD_BYTES = 256 << 10  # of K/V: a team thread wakes in microseconds (2 x 256 tokens: 1 thread 26 us, 2 16 us)

_SOURCE = r"""
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const float *q, *k, *v; const int32_t *table, *lens; float *out;
    int batch, heads, kv_heads, dk, dv, page, max_pages; float scale;
    int64_t ks[3], vs[3];  /* element strides of the caches: page, token, head (the last dim is dense) */
    int first, last;  /* sequences [first, last) */
} Job;

EXP_NEG

/* a row of `floats` floats fetched into L1, a cache line at a time */
static inline void fetch_row(const char *row, int floats) {
    for (int o = 0; o < floats * 4; o += 64) __builtin_prefetch(row + o, 0, 3);
}

/* Scores of `c` (4 or 1) query heads sharing one KV head against n cached K rows: each K row is read once
   for all c heads. */
static void scores_of(int c, const float *restrict q, int dk, const float *restrict kh, int64_t kstride, int n,
                      float scale, float *restrict s, int page, const char *next, int next_n) {
    for (int t = 0; t < n; t++) {
        const float *restrict kt = kh + t * kstride;
        if (t < next_n)
            fetch_row(next + t * kstride * 4, dk);
        if (c == 4) {
            float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
            for (int d = 0; d < dk; d++) {
                float kd = kt[d];
                s0 += q[d] * kd; s1 += q[dk + d] * kd; s2 += q[2 * dk + d] * kd; s3 += q[3 * dk + d] * kd;
            }
            s[t] = s0 * scale; s[page + t] = s1 * scale; s[2 * page + t] = s2 * scale; s[3 * page + t] = s3 * scale;
        } else {
            float s0 = 0.f;
            for (int d = 0; d < dk; d++) s0 += q[d] * kt[d];
            s[t] = s0 * scale;
        }
    }
}

VECTORS

ROW_MAX

/* a V row's dims whose sums one head holds in registers over a page's tokens (8 vectors), where four heads' do not
   fit: 64 with AVX2, 128 with AVX-512 */
#define WHOLE_ROW (8 * LANES)

/* acc[x] += sum_t w[x][t] V[t] for the same c heads: each V row read from memory once for all of them. Four heads
   take the output dims ROW_VECS vectors at a time (64 with AVX-512, 16 with AVX2), their sums held in registers over
   the page's tokens (kept in memory, each FMA cost a load and a store of its sum: the kernel's hottest loop). Where
   that splits a row of WHOLE_ROW dims into passes (AVX2's 16 dims of 64), the heads go one at a time over whole rows
   instead, the page's rows of this KV head staying in L1 for the four: the cache holds KV heads interleaved, so a
   pass over 16 dims of each row reads one line every 512 bytes and misses L1 row after row, where a whole row is
   four lines in order (8-16 % less time a call on an AVX2 EPYC, bench/RESULTS.md; not measured with AVX-512's
   128-dim rows). The same sums in the same order either way. */
static void accumulate(int c, const float *restrict w, int page, const float *restrict vh, int64_t vstride, int n,
                       int dv, float *restrict acc, const char *next, int next_n) {
    int d0 = 0;
    if (c == 4 && dv == WHOLE_ROW && ROW_VECS * LANES < WHOLE_ROW) {
        for (int x = 0; x < 4; x++) {
            vec a[WHOLE_ROW / LANES];  /* a constant count: the sums stay in registers, each a chain over the tokens */
            for (int j = 0; j < WHOLE_ROW / LANES; j++) a[j] = load(acc + x * dv + LANES * j);
            for (int t = 0; t < n; t++) {
                const float *restrict vt = vh + t * vstride;
                if (x == 0 && t < next_n)  /* the next page's rows, fetched while this one is summed */
                    fetch_row(next + t * vstride * 4, dv);
                float wx = w[x * page + t];
                for (int j = 0; j < WHOLE_ROW / LANES; j++) a[j] += wx * load(vt + LANES * j);
            }
            for (int j = 0; j < WHOLE_ROW / LANES; j++) store(acc + x * dv + LANES * j, a[j]);
        }
        d0 = dv;
    }
    if (c == 4) {
        for (; d0 + ROW_VECS * LANES <= dv; d0 += ROW_VECS * LANES) {
            vec a[4][ROW_VECS];
            for (int x = 0; x < 4; x++)
                for (int j = 0; j < ROW_VECS; j++) a[x][j] = load(acc + x * dv + d0 + LANES * j);
            for (int t = 0; t < n; t++) {
                const float *restrict vt = vh + t * vstride + d0;
                if (d0 == 0 && t < next_n)  /* the next page's rows, fetched while this one is summed */
                    fetch_row(next + t * vstride * 4, dv);
                vec vc[ROW_VECS];
                for (int j = 0; j < ROW_VECS; j++) vc[j] = load(vt + LANES * j);
                for (int x = 0; x < 4; x++) {
                    float wx = w[x * page + t];
                    for (int j = 0; j < ROW_VECS; j++) a[x][j] += wx * vc[j];
                }
            }
            for (int x = 0; x < 4; x++)
                for (int j = 0; j < ROW_VECS; j++) store(acc + x * dv + d0 + LANES * j, a[x][j]);
        }
    }
    for (int t = 0; t < n && d0 < dv; t++) {  /* what the blocks left: other head counts, dims past the last 64 */
        const float *restrict vt = vh + t * vstride;
        if (d0 == 0 && t < next_n)
            fetch_row(next + t * vstride * 4, dv);
        if (c == 4) {
            float w0 = w[t], w1 = w[page + t], w2 = w[2 * page + t], w3 = w[3 * page + t];
            float *restrict a0 = acc, *restrict a1 = acc + dv, *restrict a2 = acc + 2 * dv, *restrict a3 = acc + 3 * dv;
            for (int d = d0; d < dv; d++) {
                float vd = vt[d];
                a0[d] += w0 * vd; a1[d] += w1 * vd; a2[d] += w2 * vd; a3[d] += w3 * vd;
            }
        } else {
            float w0 = w[t];
            for (int d = 0; d < dv; d++) acc[d] += w0 * vt[d];
        }
    }
}

/* One sequence, all heads, page by page with an online softmax. Query heads go four at a time where four
   share a KV head (GQA), so each cached K/V row is read from memory once and from L1 by the four. */
static void attend(const Job *j, int b, float *scores, float *acc, float *m, float *l) {
    int len = j->lens[b], heads = j->heads, group = heads / j->kv_heads, page = j->page;
    const float *q = j->q + (int64_t)b * heads * j->dk;
    const int32_t *pages = j->table + (int64_t)b * j->max_pages;
    for (int x = 0; x < heads; x++) { m[x] = -INFINITY; l[x] = 0.f; }
    for (int x = 0; x < heads * j->dv; x++) acc[x] = 0.f;
    for (int p = 0; p * page < len; p++) {
        int n = len - p * page < page ? len - p * page : page;
        /* the next page's rows (this sequence's, else the next sequence's first) are fetched while this page's
           are computed: pages lie scattered in the pool */
        int rest = len - (p + 1) * page, next_n = rest <= 0 ? 0 : rest < page ? rest : page;
        int64_t next = next_n ? pages[p + 1] : pages[p];
        if (!next_n && b + 1 < j->last && j->lens[b + 1] > 0) {
            next = pages[j->max_pages];
            next_n = j->lens[b + 1] < page ? j->lens[b + 1] : page;
        }
        const float *kp = j->k + pages[p] * j->ks[0], *vp = j->v + pages[p] * j->vs[0];
        for (int x = 0; x < heads;) {
            int c = x % group + 4 <= group ? 4 : 1, h = x / group;
            float *sx = scores + x * page;
            /* the first head of each KV head's group fetches the next page's rows of that KV head */
            int fetch = x % group == 0 ? next_n : 0;
            scores_of(c, q + x * j->dk, j->dk, kp + h * j->ks[2], j->ks[1], n, j->scale, sx, page,
                      (const char *)(j->k + next * j->ks[0] + h * j->ks[2]), fetch);
            for (int i = x; i < x + c; i++) {
                float *si = scores + i * page, best = row_max(si, n), total = 0.f;
                best = best > m[i] ? best : m[i];
                float shrink = exp_neg(m[i] - best);
                for (int t = 0; t < n; t++) { si[t] = exp_neg(si[t] - best); total += si[t]; }
                float *ai = acc + i * j->dv;
                for (int d = 0; d < j->dv; d++) ai[d] *= shrink;
                l[i] = l[i] * shrink + total;
                m[i] = best;
            }
            accumulate(c, sx, page, vp + h * j->vs[2], j->vs[1], n, j->dv, acc + x * j->dv,
                       (const char *)(j->v + next * j->vs[0] + h * j->vs[2]), fetch);
            x += c;
        }
    }
    float *o = j->out + (int64_t)b * heads * j->dv;
    for (int x = 0; x < heads; x++)  /* (a NaN score makes l NaN: the output NaN, as torch's) */
        for (int d = 0; d < j->dv; d++) o[x * j->dv + d] = len > 0 ? acc[x * j->dv + d] / l[x] : 0.f;
}

/* 0, or -1 when this thread's buffers cannot be allocated (nothing computed then) */
static int run(const Job *j) {
    float *scores = malloc(sizeof(float) * j->heads * j->page);
    float *acc = malloc(sizeof(float) * j->heads * j->dv);
    float *m = malloc(sizeof(float) * j->heads), *l = malloc(sizeof(float) * j->heads);
    int ok = scores && acc && m && l;
    if (ok)
        for (int b = j->first; b < j->last; b++) attend(j, b, scores, acc, m, l);
    free(scores); free(acc); free(m); free(l);
    return ok ? 0 : -1;
}

/* The first sequence whose tokens start at or after `share` of all `total` tokens: a thread's boundary, so
   threads read about the same K/V bytes whatever the lengths. */
static int split_at(const int32_t *lens, int batch, int64_t total, int t, int n) {
    if (t == n) return batch;  /* the last thread's share ends with the batch, empty sequences after it included */
    int64_t share = total * t / n, seen = 0;
    int b = 0;
    while (b < batch && seen < share) seen += lens[b++];
    return b;
}

/* Threads worth waking for a call reading `bytes` of K/V, of `available`: each must have THREAD_BYTES to read, or
   waking and joining it costs more than it saves. */
int paged_decode_threads(int64_t bytes, int available) {
    int64_t threads = bytes / @THREAD_BYTES@;
    return threads < 1 ? 1 : threads > available ? available : (int)threads;
}

/* Returns -1; or b >= 0, the first sequence whose length exceeds its page-table row; or -2 - b, the first whose
   pages (those its length reads) are not all in [0, num_pages): nothing computed then; or -2 - batch when a thread's
   buffers could not be allocated (the output incomplete). The threads are chosen here,
   from the lengths (`token_bytes` of K/V a token), so the caller reads nothing back. */
int paged_decode_f32(const float *q, const float *k, const float *v, const int32_t *table,
                     const int32_t *lens, float *out, int batch, int heads, int kv_heads, int dk, int dv,
                     int page, int max_pages, int num_pages, float scale, int available, int64_t token_bytes,
                     const int64_t *ks, const int64_t *vs) {
    int64_t total = 0;
    for (int b = 0; b < batch; b++) {
        if (lens[b] > (int64_t)max_pages * page) return b;
        const int32_t *row = table + (int64_t)b * max_pages;
        for (int p = 0; p * page < lens[b]; p++)
            if (row[p] < 0 || row[p] >= num_pages) return -2 - b;
        total += lens[b];
    }
    int threads = paged_decode_threads(total * token_bytes, available);
    if (threads > batch) threads = batch;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)  /* the OpenMP pool torch runs its own ops on */
    {
        int t = omp_get_thread_num(), n = omp_get_num_threads();
        Job j = {q, k, v, table, lens, out, batch, heads, kv_heads, dk, dv, page, max_pages, scale,
                 {ks[0], ks[1], ks[2]}, {vs[0], vs[1], vs[2]},
                 split_at(lens, batch, total, t, n), split_at(lens, batch, total, t + 1, n)};
        failed |= run(&j) != 0;
    }
    return failed ? -2 - batch : -1;
}
""".replace("EXP_NEG", EXP_NEG_SOURCE).replace("VECTORS", VECTOR_SOURCE).replace(
    "ROW_MAX", ROW_MAX_SOURCE).replace("@THREAD_BYTES@", str(THREAD_BYTES))

_KERNEL = CFunction("paged_decode", _SOURCE, "paged_decode_f32",
                    (*[ctypes.c_void_p] * 6, *[ctypes.c_int] * 8, ctypes.c_float, ctypes.c_int, ctypes.c_int64,
                     *[ctypes.POINTER(ctypes.c_int64)] * 2), restype=ctypes.c_int)
_THREADS = CFunction("paged_decode", _SOURCE, "paged_decode_threads", (ctypes.c_int64, ctypes.c_int),
                     restype=ctypes.c_int)


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
    """Same contract as kernels.ops.paged_decode_attention, for float32 CPU tensors. The kernel itself checks the
    lengths against the page table (a decode step calls this once per layer: each torch op here costs a few
    microseconds against tens of the kernel)."""
    batch, heads, dim_k = q.shape
    _, page_size, kv_heads, _ = k_cache.shape
    dim_v = v_cache.shape[-1]
    q = q.contiguous()
    k_cache, v_cache = (c if c.stride(-1) == 1 else c.contiguous() for c in (k_cache, v_cache))  # views stay views
    table = page_table.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty(batch, heads, dim_v, dtype=q.dtype)
    pages = min(k_cache.shape[0], v_cache.shape[0])
    bad = _KERNEL(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(), lens.data_ptr(),
                  out.data_ptr(), batch, heads, kv_heads, dim_k, dim_v, page_size, table.shape[1], pages,
                  float(scale), torch.get_num_threads(), kv_heads * (dim_k + dim_v) * k_cache.element_size(),
                  _strides(k_cache), _strides(v_cache))
    if bad == -2 - batch:
        raise MemoryError(f"paged_decode_attention: no memory for the working buffers of {heads} query heads")
    if bad >= 0:
        raise ValueError(f"paged_decode_attention: seq_lens[{bad}] = {int(lens[bad])} exceeds page_table capacity "
                         f"{table.shape[1]} pages x {page_size}")
    if bad <= -2:
        b = -2 - bad
        read = table[b, : -(-int(lens[b]) // page_size)].tolist()
        raise ValueError(f"paged_decode_attention: sequence {b} reads pages {read}, not all in [0, {pages}) (the "
                         "cache's pages)")
    return out


def threads_for(kv_bytes: int, available: int) -> int:
    """Threads the kernel wakes for a call reading `kv_bytes` of K/V: each must have THREAD_BYTES to read, or waking
    and joining it costs more than it saves."""
    return _THREADS(kv_bytes, available)


def _strides(cache: torch.Tensor) -> ctypes.Array:
    """(page, token, head) element strides of a [pages, page_size, heads, dim] cache."""
    return (ctypes.c_int64 * 3)(*cache.stride()[:3])
