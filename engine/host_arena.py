"""Large host buffers, zero-filled by the OS page by page as they are first written.

What the weights and the KV pools of a CPU engine live in. Nothing is written at allocation, so a pool of
gigabytes costs an engine's constructor nothing and memory only as its pages fill. Ordinary pages, not
transparent huge pages: on a VM that hands free memory back to its host (free page reporting, as the dev box's
Firecracker VM does) a huge page's first write waits for the host to back 2 MiB again, 5-10 ms each: bench-moe's
608 MiB of weights took 2.4-5 s to copy in against 0.2-0.5 s in 4 KiB pages, while decode steps sweeping those
weights ran level in either (bench/RESULTS.md, "Session 16").
"""

from __future__ import annotations

import mmap

import torch


def host_arena(nbytes: int) -> torch.Tensor:
    """`nbytes` of zero-filled host memory as a page-aligned uint8 tensor; the mapping lives as long as a view of
    it does."""
    mapping = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=torch.uint8)[:nbytes]
