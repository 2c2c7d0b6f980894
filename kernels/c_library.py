"""Small C kernels for CPU tensors: compiled on first use with the system C compiler, cached on disk, loaded
through ctypes. No build step at install time and no Python extension ABI to match: a machine without a C
compiler (or one without OpenMP) simply reports the backend unavailable and the registry keeps the torch path.

The kernels run their threads as an OpenMP team (-fopenmp): the library they need, libgomp.so.1, is the one
torch has already loaded, so their threads are torch's own pool. Threads of their own would find torch's
OpenMP threads still spinning on the cores after each torch op (libgomp's default wait policy), and on a
2-core machine took twice as long per MoE call (bench/RESULTS.md)."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# -fassociative-math and friends let the compiler vectorise float reductions (dot products); the kernels
# do not rely on IEEE summation order
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
         "-fPIC", "-shared", "-fopenmp")


EXP_NEG_SOURCE = r"""
/* e^x for x <= 0 without a libm call, so the loops over it vectorise: 2^(x log2 e) split into the nearest
   integer power (exponent bits) and a degree-6 Taylor polynomial of the rest in [-1/2, 1/2], relative error
   about 1.2e-7; x is clamped at -87 (e^-87 ~ 1.6e-38: nothing next to 1). */
static inline float exp_neg(float x) {
    x = x < -87.f ? -87.f : x;
    float t = x * 1.44269504f, n = rintf(t), f = t - n;
    float p = 1.540353e-4f;
    p = p * f + 1.3333558e-3f; p = p * f + 9.6181291e-3f; p = p * f + 5.5504109e-2f;
    p = p * f + 2.4022651e-1f; p = p * f + 6.9314718e-1f; p = p * f + 1.f;
    union { int32_t i; float f; } scale = {.i = ((int32_t)n + 127) << 23};
    return p * scale.f;
}
"""  # C source both kernels include


def cache_dir() -> Path:
    return Path(os.environ.get("BATCHGEN_CACHE", Path.home() / ".cache" / "batchgen")) / "kernels"


def build(name: str, source: str) -> ctypes.CDLL | str:
    """The library compiled from `source`, or why it cannot be had (no compiler, a failed build). Keyed by
    source, compiler, flags and machine, so a changed kernel or another CPU builds anew."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return "no C compiler (cc/gcc) on PATH"
    key = hashlib.sha256("\n".join([source, compiler, *FLAGS, platform.node(), platform.machine()]).encode())
    target = cache_dir() / f"{name}_{key.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            src, built = Path(tmp) / f"{name}.c", Path(tmp) / f"{name}.so"
            src.write_text(source)
            proc = subprocess.run([compiler, *FLAGS, str(src), "-o", str(built), "-lm"], capture_output=True,
                                  text=True)
            if proc.returncode != 0:
                return f"building the CPU kernel {name} failed: {proc.stderr.strip()[-500:]}"
            os.replace(built, target)  # atomic: concurrent builders (engine actors) never see half a file
    return ctypes.CDLL(str(target))


@dataclass(frozen=True)
class CFunction:
    """One function of a C kernel, compiled and loaded on first use."""

    library: str
    source: str
    name: str
    argtypes: tuple

    @functools.cache  # noqa: B019 (a few module-level instances, alive for the process anyway)
    def _loaded(self) -> Callable | str:
        library = build(self.library, self.source)
        if isinstance(library, str):
            return library
        function = getattr(library, self.name)
        function.restype, function.argtypes = None, list(self.argtypes)
        return function

    def unavailable(self) -> str | None:
        """Why it cannot run here (no compiler, a failed build), or None."""
        loaded = self._loaded()
        return loaded if isinstance(loaded, str) else None

    def __call__(self, *args) -> None:
        loaded = self._loaded()
        if isinstance(loaded, str):
            raise RuntimeError(loaded)
        loaded(*args)
