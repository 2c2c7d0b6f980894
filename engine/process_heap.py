"""An engine process's heaps: Python's cyclic collector, and the C heap torch's CPU tensors live in.

Python's collector. torch, transformers and Ray leave ~200k container objects behind at import, and every
collection of the oldest generation walks them all (~50 ms on the dev box): in an engine process it lands in the
middle of a step (one such pause was a quarter of the host time of 512 sequences' 0.4 s run in
bench/host_overhead.py). gc.freeze() moves what exists now into a permanent generation the collector skips. For a
process that holds one engine for its life (an engine actor), called once the imports are in. Frozen objects are
still freed by reference counting; only cycles among them are never collected, so a process that builds and drops
engines (tests) should not call it.

The C heap. torch allocates a CPU tensor with malloc and frees it as soon as the step is done with it. glibc serves
a block above its mmap threshold (dynamic, from 128 KiB) with a fresh mapping and unmaps it on free, and hands the
free top of its heap back to the kernel past its trim threshold, so every step's activations (a 4,000-token prefill
step's are 1-32 MiB each) land on pages the kernel must fault in and zero again: 230k-400k minor faults per bench-moe
run (bench/bct.py). `keep_freed_memory` raises the mmap threshold to glibc's ceiling and the trim threshold to
1 GiB, so freed blocks go back to the heap and the next step reuses pages that are already mapped (55k-130k faults a
run). Any process that hosts an engine calls it; it holds on to at most the trim threshold of freed memory.
"""

from __future__ import annotations

import ctypes
import gc

M_TRIM_THRESHOLD = -1  # mallopt parameters (glibc's malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_CEILING = 32 * 2**20  # the largest mmap threshold glibc accepts on 64-bit
KEPT_FREE_BYTES = 2**30  # freed heap top kept for the next step instead of handed back


def freeze_heap() -> int:
    """Collect, then move every surviving object into the permanent generation; returns how many it holds."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def keep_freed_memory() -> bool:
    """Serve blocks up to 32 MiB from the C heap and keep up to 1 GiB of its freed top mapped (glibc's mallopt);
    returns whether the C library took both settings (False where it has no mallopt, e.g. macOS, or ignores it)."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_CEILING)) & bool(mallopt(M_TRIM_THRESHOLD, KEPT_FREE_BYTES))
