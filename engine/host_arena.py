"""Large host buffers, zero-filled by the OS page by page as they are first written.

What the weights and the KV pools of a CPU engine live in. Nothing is written at allocation, so a pool of
gigabytes costs an engine's constructor nothing and memory only as its pages fill. The weights ask for
transparent huge pages: every step sweeps all of them, and 2 MiB pages need 512 times fewer TLB entries than
4 KiB ones. The KV pools do not: they fill during the run, and a huge page's first write costs the OS a 2 MiB
allocation (compaction included; 150 MB took 0.22 s on the dev box against 0.03 s in 4 KiB pages), which would
land in the middle of decode steps. Where the OS gives no huge pages it is plain memory.
"""

from __future__ import annotations

import mmap

import torch

HUGE_PAGE = 2 << 20


def host_arena(nbytes: int, huge_pages: bool = True) -> torch.Tensor:
    """`nbytes` of zero-filled host memory as a uint8 tensor starting on a huge-page boundary, advised for
    transparent huge pages when `huge_pages`; the mapping lives as long as a view of it does."""
    # private: a shared anonymous mapping is shmem, which gets huge pages only where shmem_enabled says so
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):  # Linux; elsewhere the mapping keeps the OS's default pages
        mapping.madvise(mmap.MADV_HUGEPAGE)
    buffer = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -buffer.data_ptr() % HUGE_PAGE
    return buffer[start : start + nbytes]
