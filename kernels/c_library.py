"""Small C kernels for CPU tensors: compiled on first use with the system C compiler, cached on disk, loaded
through ctypes. No build step at install time and no Python extension ABI to match: a machine without a C
compiler (or one without OpenMP) simply reports the backend unavailable and the registry keeps the torch path.

The kernels run their threads as an OpenMP team (-fopenmp): the library they need, libgomp.so.1, is the one
torch has already loaded, so their threads are torch's own pool. Threads of their own would find torch's
OpenMP threads still spinning on the cores after each torch op (libgomp's default wait policy), and on a
2-core machine took twice as long per MoE call (bench/RESULTS.md)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from batchgen.kernels.calibration import cache_root
from batchgen.kernels.cpu_identity import this_cpu

# -fassociative-math and friends let the compiler vectorise float reductions (dot products); the kernels
# do not rely on IEEE summation order
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
         "-fPIC", "-shared", "-fopenmp")


EXP_NEG_SOURCE = r"""
/* e^x for x <= 0 without a libm call, so the loops over it vectorise: 2^(x log2 e) split into the nearest
   integer power (exponent bits) and a degree-6 Taylor polynomial of the rest in [-1/2, 1/2], relative error
   about 1.2e-7; x is clamped at -87 (e^-87 ~ 1.6e-38: nothing next to 1). */
/* 2^f for f in [-1/2, 1/2], a float or a vector of them */
#define EXP2_TAYLOR(f) ((((((1.540353e-4f * (f) + 1.3333558e-3f) * (f) + 9.6181291e-3f) * (f) + 5.5504109e-2f) \
                           * (f) + 2.4022651e-1f) * (f) + 6.9314718e-1f) * (f) + 1.f)
static inline float exp_neg(float x) {
    x = x < -87.f ? -87.f : x;
    float t = x * 1.44269504f, n = rintf(t), f = t - n;
    union { int32_t i; float f; } scale = {.i = ((int32_t)n + 127) << 23};
    return EXP2_TAYLOR(f) * scale.f;
}
"""  # C source every kernel includes


VECTOR_SOURCE = r"""
/* One vector register of floats: AVX-512's sixteen, else AVX2's eight. A vector wider than the target's registers
   is no machine type to GCC: it lives in memory and every operation goes through the stack (the packed MoE kernel
   ran at 4 GFLOP/s on an AVX2 AMD EPYC with AVX-512-wide vectors). REGISTERS is how many the target has, which sizes
   the kernels' register tiles. */
#if defined(__AVX512F__)
#define LANES 16
#define REGISTERS 32
#else
#define LANES 8
#define REGISTERS 16
#endif
typedef float vec __attribute__((vector_size(4 * LANES)));
/* vectors of one V row that four query rows' (or heads') weighted sums keep in registers: 4 x 4 sums + 4 operands +
   a broadcast of AVX-512's 32 registers, 4 x 2 + 2 + 1 of AVX2's 16 */
#define ROW_VECS (REGISTERS / 8)

static inline vec load(const float *p) { vec v; memcpy(&v, p, sizeof v); return v; }
static inline void store(float *p, vec v) { memcpy(p, &v, sizeof v); }

typedef int32_t veci __attribute__((vector_size(4 * LANES)));  /* a comparison's lanes: all ones where true */

/* a where mask, else b, lane by lane */
static inline vec blend(veci mask, vec a, vec b) {
    veci ai, bi, r;
    memcpy(&ai, &a, sizeof ai);
    memcpy(&bi, &b, sizeof bi);
    r = (ai & mask) | (bi & ~mask);
    vec out;
    memcpy(&out, &r, sizeof out);
    return out;
}

/* lanes of two vectors picked by index (0 to LANES - 1 the first's, then the second's); GCC before 12 has only
   __builtin_shuffle, which takes the indices as a vector */
#if defined(__clang__) || __GNUC__ >= 12
#define SHUFFLE __builtin_shufflevector
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (veci){__VA_ARGS__})
#endif

/* Pins a vector to a register: a value two FMAs use is otherwise folded into each as a memory operand, loaded
   twice, and the loop runs out of load slots before FMA slots. */
#if defined(__AVX512F__)
#define IN_REGISTER(v) __asm__("" : "+v"(v))
#elif defined(__AVX__)
#define IN_REGISTER(v) __asm__("" : "+x"(v))
#else
#define IN_REGISTER(v) ((void)0)
#endif
"""  # C source of register-wide float vectors, their loads and stores, blends and shuffles (needs string.h, stdint.h)


ROW_MAX_SOURCE = r"""
/* the largest of s[0, n): a running maximum per lane, then the lanes' by halves; lane by lane the maximum is a chain
   of dependent compares (~30 % of the prefill attention kernel's time) */
static inline float row_max(const float *restrict s, int64_t n) {
    vec m = (vec){0} - INFINITY;
    int64_t j = 0;
    for (; j + LANES <= n; j += LANES) {
        vec x = load(s + j);
        m = blend(x > m, x, m);
    }
#if LANES == 16
    vec h = SHUFFLE(m, m, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    m = blend(h > m, h, m);
    h = SHUFFLE(m, m, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    m = blend(h > m, h, m);
    h = SHUFFLE(m, m, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
#else
    vec h = SHUFFLE(m, m, 4, 5, 6, 7, 0, 1, 2, 3);
    m = blend(h > m, h, m);
    h = SHUFFLE(m, m, 2, 3, 0, 1, 6, 7, 4, 5);
#endif
    m = blend(h > m, h, m);
    float best = m[0] > m[1] ? m[0] : m[1];
    for (; j < n; j++) best = s[j] > best ? s[j] : best;
    return best;
}
"""  # C source of the attention kernels' softmax maximum (after VECTOR_SOURCE; needs math.h)


DOT_PAIRS_SOURCE = VECTOR_SOURCE + r"""
/* token rows per register block: 2 x BLOCK accumulators + 3 operands fit the registers (2 x 8 + 3 of AVX-512's 32,
   2 x 4 + 3 of AVX2's 16), and the 2 x BLOCK sums are LANES vectors, one lane_sums */
#define BLOCK (LANES / 2)

/* s[i] = the sum of v[i]'s lanes, for LANES vectors at once: each level adds lanes j and j + LANES / 2 (then / 4 ...)
   of two vectors into one, so LANES - 1 vector adds do the work of LANES horizontal sums. The association is the same
   for every lane and every vector (the halves tree: ((l0 + l8) + (l4 + l12)) ... ), whichever rows are filled. */
#if LANES == 16
static inline void lane_sums(const vec *v, float *s) {
    vec w[8], x[4], y[2], z;
    for (int i = 0; i < 8; i++)
        w[i] = SHUFFLE(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + SHUFFLE(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)  /* lanes 4m + j: vector 4i + m's sum of lanes j, j + 4, j + 8, j + 12 */
        x[i] = SHUFFLE(w[2 * i], w[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
             + SHUFFLE(w[2 * i], w[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)  /* lanes 2m + k: vector 8i + m's lanes k mod 2 */
        y[i] = SHUFFLE(x[2 * i], x[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
             + SHUFFLE(x[2 * i], x[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    z = SHUFFLE(y[0], y[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
      + SHUFFLE(y[0], y[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    store(s, z);
}
#else
static inline void lane_sums(const vec *v, float *s) {
    vec w[4], x[2], z;
    for (int i = 0; i < 4; i++)  /* lanes 0-3: vector 2i's lanes j and j + 4 added, lanes 4-7: vector 2i + 1's */
        w[i] = SHUFFLE(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11)
             + SHUFFLE(v[2 * i], v[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++)  /* lanes 2m + k: vector 4i + m's lanes k mod 2 */
        x[i] = SHUFFLE(w[2 * i], w[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13)
             + SHUFFLE(w[2 * i], w[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    z = SHUFFLE(x[0], x[1], 0, 2, 4, 6, 8, 10, 12, 14) + SHUFFLE(x[0], x[1], 1, 3, 5, 7, 9, 11, 13, 15);
    store(s, z);
}
#endif

/* s[r] = wa . x_r and s[BLOCK + r] = wb . x_r for the n (a constant after inlining, <= BLOCK) rows x_r = x + r * stride
   (s[r] past n: anything):
   each weight element is loaded once for the n rows, and the 2n sums stay in registers, leaving in one vector store
   (a caller reading eight sums back as one vector from eight scalar stores stalls on the store forwarding). The next
   two weight rows (na, nb: the next item's) are fetched into L1 meanwhile, a cache line per step: the hardware's
   stream prefetch stops at every 4 KiB page, and weight rows are 2-4 KiB. Two rows further ahead (fa, fb: a caller's
   next work item's) are fetched into L2 the same way, so a read from memory overlaps a whole item's compute, not one
   row's: a MoE layer at 16-32 rows per expert took 0.60-0.71x the time of the near fetch alone on an Intel Xeon. */
static inline __attribute__((always_inline)) void dot_pairs(int n, const float *restrict wa,
                                                            const float *restrict wb, const float *restrict x,
                                                            int64_t stride, int len, float *s,
                                                            const float *na, const float *nb,
                                                            const float *fa, const float *fb) {
    vec acc[2 * BLOCK], *va = acc, *vb = acc + BLOCK;
    int e = 0;
    if (len < LANES) {
        for (int r = 0; r < n; r++) va[r] = vb[r] = (vec){0};
    } else {  /* the first products start the sums: zeroing them all first compiles to a memset on the stack */
        vec ka = load(wa), kb = load(wb);
        for (int r = 0; r < n; r++) {
            vec xr = load(x + r * stride);
            va[r] = ka * xr;
            vb[r] = kb * xr;
        }
        e = LANES;
    }
    for (; e + LANES <= len; e += LANES) {
        __builtin_prefetch(na + e, 0, 3);
        __builtin_prefetch(nb + e, 0, 3);
        __builtin_prefetch(fa + e, 0, 2);
        __builtin_prefetch(fb + e, 0, 2);
        vec ka = load(wa + e), kb = load(wb + e);
        for (int r = 0; r < n; r++) {
            vec xr = load(x + r * stride + e);
            IN_REGISTER(xr);  /* one load for its two FMAs (an Intel Xeon's gate/up and down passes 15-20 % faster) */
            va[r] += ka * xr;
            vb[r] += kb * xr;
        }
    }
    for (int r = n; r < BLOCK; r++) { va[r] = va[0]; vb[r] = vb[0]; }  /* rows past n: sums nobody reads */
    lane_sums(acc, s);
    for (int r = 0; r < n; r++)
        for (int t = e; t < len; t++) { s[r] += wa[t] * x[r * stride + t]; s[BLOCK + r] += wb[t] * x[r * stride + t]; }
}

/* dot_pairs with n a compile-time constant in every case, so each one keeps its sums in registers */
static void dot_pairs_n(int n, const float *wa, const float *wb, const float *x, int64_t stride, int len,
                        float *s, const float *na, const float *nb, const float *fa, const float *fb) {
    switch (n) {
        case 1: dot_pairs(1, wa, wb, x, stride, len, s, na, nb, fa, fb); break;
        case 2: dot_pairs(2, wa, wb, x, stride, len, s, na, nb, fa, fb); break;
        case 3: dot_pairs(3, wa, wb, x, stride, len, s, na, nb, fa, fb); break;
#if BLOCK == 8
        case 4: dot_pairs(4, wa, wb, x, stride, len, s, na, nb, fa, fb); break;
        case 5: dot_pairs(5, wa, wb, x, stride, len, s, na, nb, fa, fb); break;
        case 6: dot_pairs(6, wa, wb, x, stride, len, s, na, nb, fa, fb); break;
        case 7: dot_pairs(7, wa, wb, x, stride, len, s, na, nb, fa, fb); break;
#endif
        default: dot_pairs(BLOCK, wa, wb, x, stride, len, s, na, nb, fa, fb); break;
    }
}

/* [first, last) of `items` for this thread of the OpenMP team running the call */
static inline void team_share(int64_t items, int64_t *first, int64_t *last) {
    int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
    *first = items * t / n;
    *last = items * (t + 1) / n;
}
"""  # C source of the kernels that stream weight rows against a few token rows (needs string.h, omp.h, stdint.h)


SILU_SOURCE = r"""
/* exp_neg lane by lane (the same polynomial; the nearest integer power as the truncation of t - 1/2, t <= 0) */
static inline vec exp_neg_v(vec x) {
    const vec zero = {0};
    x = blend(x < zero - 87.f, zero - 87.f, x);
    vec t = x * 1.44269504f;
    veci n = __builtin_convertvector(t - 0.5f, veci);
    vec f = t - __builtin_convertvector(n, vec);
    veci bits = (n + 127) << 23;
    vec scale;
    memcpy(&scale, &bits, sizeof scale);
    return EXP2_TAYLOR(f) * scale;
}

/* silu(g) * u = g * sigmoid(g) * u, sigmoid from e^-|g| (no overflow either side) */
static inline float silu_mul(float g, float u) {
    float e = exp_neg(g < 0.f ? g : -g);
    return g * (g < 0.f ? e : 1.f) / (1.f + e) * u;
}

static inline vec silu_mul_v(vec g, vec u) {
    const vec zero = {0};
    veci negative = g < zero;
    vec e = exp_neg_v(blend(negative, g, zero - g));
    return g * blend(negative, e, zero + 1.f) / (1.f + e) * u;
}
"""  # C source of the experts' silu(gate) * up, a float or a vector (after EXP_NEG_SOURCE and VECTOR_SOURCE)


ROUTE_ROWS_SOURCE = r"""
/* The (token, k) pairs grouped by expert, as rows: a stable counting sort by id (the order of the torch path's
   stable argsort, so the same sums in the same order) instead of a handful of torch calls per layer. ids < 0
   (experts on another rank) are skipped, and so is any id past the last expert, so no input writes outside the
   arrays. xs[r] = x[token[r]], copied over the team (THREAD_BYTES of copies a thread); starts [E + 1]: expert e's rows
   are [starts[e], starts[e + 1]). Returns -1 when it cannot allocate its counters, else 0. */
static int route_rows_f32(const float *x, int64_t T, int K, const int64_t *ids, const float *topk_weight, int E, int D,
                          float *xs, int64_t *token, float *weight, int64_t *starts, int threads) {
    int64_t pairs = T * K, *next = malloc((E + 1) * sizeof(int64_t));
    if (!next) return -1;
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
    return 0;
}
"""  # C source of the MoE kernels' grouping of rows by expert (needs stdlib.h, string.h, omp.h, THREAD_BYTES)


def cache_dir() -> Path:
    return cache_root() / "kernels"


def compiler() -> str | None:
    """The C compiler kernels are built with ($CC, else cc or gcc on PATH), or None."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(name: str, source: str) -> ctypes.CDLL | str:
    """The library compiled from `source`, or why it cannot be had (no compiler, a failed build). Keyed by
    source, compiler, flags, host and CPU (`-march=native`), so a changed kernel or another CPU builds anew."""
    compiler_path = compiler()
    if compiler_path is None:
        return "no C compiler (cc/gcc) on PATH"
    key = hashlib.sha256("\n".join([source, compiler_path, *FLAGS, platform.node(), this_cpu()]).encode())
    target = cache_dir() / f"{name}_{key.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            src, built = Path(tmp) / f"{name}.c", Path(tmp) / f"{name}.so"
            src.write_text(source)
            proc = subprocess.run([compiler_path, *FLAGS, str(src), "-o", str(built), "-lm"], capture_output=True,
                                  text=True)
            if proc.returncode != 0:
                errors = [line for line in proc.stderr.splitlines() if "error" in line]
                return f"building the CPU kernel {name} failed: {' | '.join(errors[:3]) or proc.stderr[-500:]}"
            os.replace(built, target)  # atomic: concurrent builders (engine actors) never see half a file
    return ctypes.CDLL(str(target))


@dataclass(frozen=True)
class CFunction:
    """One function of a C kernel, compiled and loaded on first use."""

    library: str
    source: str
    name: str
    argtypes: tuple
    restype: type | None = None  # a ctypes type, for a kernel that reports something (an error's index)

    @functools.cache  # noqa: B019 (a few module-level instances, alive for the process anyway)
    def _loaded(self) -> Callable | str:
        library = build(self.library, self.source)
        if isinstance(library, str):
            return library
        function = getattr(library, self.name)
        function.restype, function.argtypes = self.restype, list(self.argtypes)
        return function

    def unavailable(self) -> str | None:
        """Why it cannot run here (no compiler, a failed build), or None."""
        loaded = self._loaded()
        return loaded if isinstance(loaded, str) else None

    def __call__(self, *args):
        loaded = self._loaded()
        if isinstance(loaded, str):
            raise RuntimeError(loaded)
        result = loaded(*args)
        observer = getattr(_observers, "observer", None)
        if observer is not None:
            observer(loaded, args, result)
        return result


_LANES = CFunction("vector_lanes", "#include <stdint.h>\n#include <string.h>\n" + VECTOR_SOURCE
                   + "int vector_lanes(void) { return LANES; }\n", "vector_lanes", (), ctypes.c_int)


@functools.cache
def vector_lanes() -> int:
    """Floats in one of the kernels' vectors, as the compiler targets this CPU (16 with AVX-512, else 8): layouts
    packed for a kernel's register tiles (moe_packed_cpu) must agree with it. 16 where no kernel builds."""
    return 16 if _LANES.unavailable() else _LANES()


_observers = threading.local()  # `observer`: told of every kernel call on this thread (kernels/capture.py)


@contextlib.contextmanager
def observe_calls(observer: Callable[[Callable, tuple, object], None]) -> Iterator[None]:
    """Inside the block, `observer(function, args, result)` sees every kernel call this thread makes."""
    previous = getattr(_observers, "observer", None)
    _observers.observer = observer
    try:
        yield
    finally:
        _observers.observer = previous
