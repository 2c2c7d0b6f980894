"""Varlen causal prefill attention for float32 CPU tensors, on the unpadded token rows.

The torch path (attention_torch.py) gathers each group of similar-length prompts into padded batches, runs SDPA (~48
GFLOP/s on the dev box's 2 threads at bench-moe's 140-token prompts) and scatters the rows back: a 4,060-token prefill
step spent 12 % of its time there. This kernel takes the rows where they are: an item is (sequence, KV head, CHUNK query
rows); the item's visible keys lie transposed (dims x keys; a thread extends the ones it holds for the sequence and KV
head as its items move down the queries) so four query rows' scores against two vectors of keys are eight vector FMAs
per dim with no horizontal sums, takes the softmax of each row over its visible keys (maximum and exponentials
vectorised), and sums the V rows into four query rows at once, each V row loaded once for the four. Every query head
sharing the KV head (GQA) reuses the transposed keys. Items are handed out dynamically over the OpenMP team torch runs
on (their costs grow with the query position). On an Intel Xeon's 2 threads, 4,096 tokens of 32-256-token prompts: 6.4
ms a layer where a scalar running maximum, one key vector per query broadcast and keys transposed again for each item
took 10.8 ms (bit-identical).

Sequences may continue a cached prefix (fewer queries than keys: query i sees keys up to len_k - len_q + i).
"""

from __future__ import annotations

import ctypes

import torch

from batchgen.kernels.attention_torch import prefill_attention_torch
from batchgen.kernels.c_library import EXP_NEG_SOURCE, ROW_MAX_SOURCE, VECTOR_SOURCE, CFunction

_SOURCE = r"""
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

EXP_NEG

VECTORS

ROW_MAX

#define CHUNK 32 /* query rows of an item */
#define ROWS 4   /* query rows sharing each load of the transposed keys and of a V row */

typedef struct {
    const float *q, *k, *v;
    float *out;                              /* [Tq, H, dv] dense */
    const int32_t *cuq, *cuk;
    int64_t qs[2], ks[2], vs[2];             /* element strides: token, head (the last dim dense) */
    int heads, kv_heads, dk, dv;
    float scale;
} Args;

static inline int64_t padded(int64_t n) { return (n + LANES - 1) / LANES * LANES; }

/* rows q[r] (r < n) against the transposed keys kt [dk, stride] up to `keys` (a multiple of LANES): s[r][j]. Two
   vectors of keys at a time: each broadcast query element feeds two FMAs from a register */
static void scores(int n, const float *const *q, const float *restrict kt, int64_t stride, int dk, int64_t keys,
                   float scale, float *restrict s) {
    int64_t j = 0;
    for (; j + 2 * LANES <= keys; j += 2 * LANES) {
        vec a0[ROWS] = {{0}}, a1[ROWS] = {{0}};
        for (int d = 0; d < dk; d++) {
            vec k0 = load(kt + d * stride + j), k1 = load(kt + d * stride + j + LANES);
            for (int r = 0; r < ROWS; r++) {
                vec qv = (vec){0} + q[r < n ? r : 0][d];
                IN_REGISTER(qv);
                a0[r] += qv * k0;
                a1[r] += qv * k1;
            }
        }
        for (int r = 0; r < n; r++) {
            store(s + r * stride + j, a0[r] * scale);
            store(s + r * stride + j + LANES, a1[r] * scale);
        }
    }
    for (; j < keys; j += LANES) {
        vec acc[ROWS] = {{0}};
        for (int d = 0; d < dk; d++) {
            vec kv = load(kt + d * stride + j);
            for (int r = 0; r < ROWS; r++) acc[r] += q[r < n ? r : 0][d] * kv;
        }
        for (int r = 0; r < n; r++) store(s + r * stride + j, acc[r] * scale);
    }
}

/* o[r] = sum_j p[r][j] v_j over j < keys for the n rows (p zero past each row's visible keys): ROW_VECS vectors of
   a V row at a time, so each broadcast weight feeds as many FMAs from a register */
static void weighted_values(int n, const float *restrict p, int64_t stride, const float *restrict v, int64_t vstride,
                            int64_t keys, int dv, float *const *o) {
    int d0 = 0;
    for (; d0 + ROW_VECS * LANES <= dv; d0 += ROW_VECS * LANES) {
        vec acc[ROWS][ROW_VECS] = {{{0}}};
        for (int64_t j = 0; j < keys; j++) {
            const float *vj = v + j * vstride + d0;
            vec vc[ROW_VECS];
            for (int c = 0; c < ROW_VECS; c++) vc[c] = load(vj + c * LANES);
            for (int r = 0; r < ROWS; r++) {
                vec pv = (vec){0} + p[(r < n ? r : 0) * stride + j];
                IN_REGISTER(pv);
                for (int c = 0; c < ROW_VECS; c++) acc[r][c] += pv * vc[c];
            }
        }
        for (int r = 0; r < n; r++)
            for (int c = 0; c < ROW_VECS; c++) store(o[r] + d0 + c * LANES, acc[r][c]);
    }
    for (; d0 + LANES <= dv; d0 += LANES) {
        vec acc[ROWS] = {{0}};
        for (int64_t j = 0; j < keys; j++) {
            vec vj = load(v + j * vstride + d0);
            for (int r = 0; r < ROWS; r++) acc[r] += p[(r < n ? r : 0) * stride + j] * vj;
        }
        for (int r = 0; r < n; r++) store(o[r] + d0, acc[r]);
    }
    for (int r = 0; r < n; r++)
        for (int d = d0; d < dv; d++) {
            float sum = 0.f;
            for (int64_t j = 0; j < keys; j++) sum += p[r * stride + j] * v[j * vstride + d];
            o[r][d] = sum;
        }
}

/* the keys a thread holds transposed: sequence b's KV head g, [0, have) */
typedef struct {
    int b, g;
    int64_t have;
} Held;

/* item: sequence b, KV head g, query rows [r0, r0 + CHUNK) of the sequence */
static void item(const Args *a, int b, int g, int64_t r0, float *kt, Held *held, float *s) {
    int64_t q0 = a->cuq[b], k0 = a->cuk[b], lq = a->cuq[b + 1] - q0, lk = a->cuk[b + 1] - k0, off = lk - lq;
    int64_t r1 = r0 + CHUNK < lq ? r0 + CHUNK : lq, visible = off + r1, stride = padded(lk);
    const float *kh = a->k + k0 * a->ks[0] + g * a->ks[1], *vh = a->v + k0 * a->vs[0] + g * a->vs[1];
    /* a thread's items of one sequence and KV head come in query order: it extends the keys it holds up to the
       visible ones (zero past the last key) instead of transposing them all again for each item */
    if (held->b != b || held->g != g) *held = (Held){b, g, 0};
    for (int64_t j0 = held->have; j0 < padded(visible); j0 += LANES)  /* a cache line of kt at a time */
        for (int d = 0; d < a->dk; d++)
            for (int64_t j = j0; j < j0 + LANES; j++) kt[d * stride + j] = j < lk ? kh[j * a->ks[0] + d] : 0.f;
    held->have = padded(visible) > held->have ? padded(visible) : held->have;
    int group = a->heads / a->kv_heads;
    for (int h = g * group; h < (g + 1) * group; h++)
        for (int64_t i0 = r0; i0 < r1; i0 += ROWS) {
            int n = r1 - i0 < ROWS ? (int)(r1 - i0) : ROWS;
            const float *q[ROWS];
            float *o[ROWS];
            for (int r = 0; r < n; r++) {
                q[r] = a->q + (q0 + i0 + r) * a->qs[0] + h * a->qs[1];
                o[r] = a->out + ((q0 + i0 + r) * a->heads + h) * a->dv;
            }
            int64_t keys = off + i0 + n; /* visible to the last of the n rows */
            scores(n, q, kt, stride, a->dk, padded(keys), a->scale, s);
            for (int r = 0; r < n; r++) {
                int64_t seen = off + i0 + r + 1;
                float *sr = s + r * stride, best = row_max(sr, seen), total = 0.f;
                for (int64_t j = 0; j < seen; j++) { sr[j] = exp_neg(sr[j] - best); total += sr[j]; }
                float inv = 1.f / total;
                for (int64_t j = 0; j < seen; j++) sr[j] *= inv;
                for (int64_t j = seen; j < keys; j++) sr[j] = 0.f;
            }
            weighted_values(n, s, stride, vh, a->vs[0], keys, a->dv, o);
        }
}

/* 0, or -1 when its buffers cannot be allocated (the output then incomplete) */
int prefill_attention_f32(Args a, int batch, int threads) {
    int64_t items = 0, longest = 0;
    for (int b = 0; b < batch; b++) {
        int64_t lq = a.cuq[b + 1] - a.cuq[b], lk = a.cuk[b + 1] - a.cuk[b];
        items += (lq + CHUNK - 1) / CHUNK * a.kv_heads;
        longest = lk > longest ? lk : longest;
    }
    int64_t *list = malloc(sizeof(int64_t) * 3 * (items + 1)), n = 0;
    if (!list) return -1;
    for (int b = 0; b < batch; b++)
        for (int g = 0; g < a.kv_heads; g++)
            for (int64_t r0 = 0; r0 < a.cuq[b + 1] - a.cuq[b]; r0 += CHUNK) {
                list[3 * n] = b; list[3 * n + 1] = g; list[3 * n + 2] = r0; n++;
            }
    if (threads > items) threads = (int)items;
    if (threads < 1) threads = 1;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *kt = malloc(sizeof(float) * (a.dk * padded(longest) + 1));
        float *s = malloc(sizeof(float) * (ROWS * padded(longest) + 1));
        Held held = {-1, -1, 0};
        failed = !kt || !s;
#pragma omp for schedule(dynamic, 1)
        for (int64_t x = 0; x < items; x++)
            if (kt && s) item(&a, (int)list[3 * x], (int)list[3 * x + 1], list[3 * x + 2], kt, &held, s);
        free(kt);
        free(s);
    }
    free(list);
    return failed ? -1 : 0;
}
""".replace("EXP_NEG", EXP_NEG_SOURCE).replace("VECTORS", VECTOR_SOURCE).replace(
    "ROW_MAX", ROW_MAX_SOURCE)


class _Args(ctypes.Structure):
    _fields_ = [("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("out", ctypes.c_void_p),
                ("cuq", ctypes.c_void_p), ("cuk", ctypes.c_void_p), ("qs", ctypes.c_int64 * 2),
                ("ks", ctypes.c_int64 * 2), ("vs", ctypes.c_int64 * 2), ("heads", ctypes.c_int),
                ("kv_heads", ctypes.c_int), ("dk", ctypes.c_int), ("dv", ctypes.c_int), ("scale", ctypes.c_float)]


_KERNEL = CFunction("prefill_attention", _SOURCE, "prefill_attention_f32", (_Args, ctypes.c_int, ctypes.c_int),
                    restype=ctypes.c_int)


def unavailable() -> str | None:
    """Why this backend cannot run here, or None (compiles the kernel on first call)."""
    return _KERNEL.unavailable()


def prefill_attention_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Same contract as kernels.ops.prefill_attention, for float32 CPU tensors (others: the torch path)."""
    if not all(t.dtype == torch.float32 for t in (q, k, v)):
        return prefill_attention_torch(q, k, v, cu_seqlens_q, cu_seqlens_k, scale)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    cuq, cuk = (c.to(torch.int32).contiguous() for c in (cu_seqlens_q, cu_seqlens_k))
    lens_q, lens_k = (c[1:] - c[:-1] for c in (cuq, cuk))
    for name, cu, rows in (("cu_seqlens_q", cuq, q.shape[0]), ("cu_seqlens_k", cuk, min(k.shape[0], v.shape[0]))):
        if int(cu[0]) < 0 or bool((cu[1:] < cu[:-1]).any()) or int(cu[-1]) > rows:  # the kernel would run past them
            raise ValueError(f"prefill_attention: {name} must rise from 0 or more to at most the {rows} rows given, "
                             f"got {cu.tolist()}")
    if bool((lens_q > lens_k).any()):
        b = int((lens_q > lens_k).nonzero()[0])
        raise ValueError(f"prefill_attention: sequence {b} has {int(lens_q[b])} queries but only {int(lens_k[b])} "
                         "keys")
    heads, dim_v = q.shape[1], v.shape[2]
    out = torch.empty(q.shape[0], heads, dim_v, dtype=torch.float32)
    args = _Args(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), cuq.data_ptr(), cuk.data_ptr(),
                 (ctypes.c_int64 * 2)(*q.stride()[:2]), (ctypes.c_int64 * 2)(*k.stride()[:2]),
                 (ctypes.c_int64 * 2)(*v.stride()[:2]), heads, k.shape[1], q.shape[2], dim_v, float(scale))
    if _KERNEL(args, cuq.shape[0] - 1, torch.get_num_threads()):
        raise MemoryError(f"prefill_attention: no memory for the working buffers of sequences up to "
                          f"{int(lens_k.max())} keys")
    return out
