"""The C kernels as an AVX2 CPU builds them, on whichever x86 CPU runs the tests.

The kernels are built with `-march=native`: a machine with AVX-512 only ever builds and tests their 16-float vectors
and 12-row tiles, and the AVX2 build (8-float vectors, 6-row tiles, the packed expert layout that follows them) went
untested there, while an AVX2 CPU ran kernels shaped for AVX-512 at a 25th of their speed (bench/RESULTS.md, session
45). Here the kernels' tests run again in a subprocess whose kernels are built for x86-64-v3 (AVX2 and FMA), which
every x86 CPU of that level or later runs."""

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from batchgen.kernels import c_library
from batchgen.kernels.cpu_identity import cpuinfo, first_processor

SCRIPT = """
import sys
from batchgen.kernels import c_library
c_library.FLAGS = tuple("-march=x86-64-v3" if flag == "-march=native" else flag for flag in c_library.FLAGS)
import pytest
code = pytest.main(sys.argv[1:])
print("vector lanes", c_library.vector_lanes())
sys.exit(code)
"""
# the C kernels' own tests, against torch or a naive reference, in both layouts' paths (the engine-level ones, which
# load checkpoints, stay with the native build)
TESTS = ("tests/test_kernels_moe_packed.py", "tests/test_kernels_moe.py", "tests/test_kernels_attention.py",
         "tests/test_kernels_linear.py", "tests/test_kernels_argmax.py", "tests/test_kernels_activation.py",
         "tests/test_kernels_router.py")
SELECT = ("(cpu_c or packed or c_kernel or blocked or cpu_argmax or c_activations or ties or prefill_matches) "
          "and not engine")


def _has_avx2() -> bool:
    flags = first_processor(cpuinfo()).get("flags", "").split()
    return "avx2" in flags and "fma" in flags


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or not _has_avx2(),
                    reason="needs an x86 CPU with AVX2")
@pytest.mark.skipif(c_library.compiler() is None, reason="no C compiler: the torch paths run, no kernel is built")
@pytest.mark.skipif(c_library.compiler() is not None and c_library.vector_lanes() == 8,
                    reason="the native build is already AVX2's shape (8-float vectors, 16 registers): the kernels' own "
                           "tests in this run test it")
def test_the_avx2_build_of_the_cpu_kernels_passes_their_tests():
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-c", SCRIPT, "-q", "-p", "no:cacheprovider", "-k", SELECT, *TESTS],
                          cwd=root, capture_output=True, text=True, env=dict(os.environ), timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "vector lanes 8" in proc.stdout  # the kernels really were the AVX2 build
    passed = int(proc.stdout.rsplit(" passed", 1)[0].split()[-1])
    assert passed >= 100, proc.stdout[-2000:]
