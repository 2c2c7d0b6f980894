"""Large host buffers, zero-filled by the OS page by page as they are first written, in transparent huge pages.

What the weights and the KV pools of a CPU engine live in. Nothing is written at allocation, so a pool of
gigabytes costs an engine's constructor nothing and memory only as its pages fill. An arena of a huge page or more
is aligned to one and advised for transparent huge pages: every decode step sweeps the weights, and on a VM each
4 KiB page's TLB miss walks two page tables. On the dev box's KVM guest a sum over 608 MiB read 29 GB/s in huge pages
against 22.5 GB/s in 4 KiB ones, and bench-moe's BCT fell 5-10 % (bench/RESULTS.md, "Session 37"). The price is each
huge page's first write: the kernel zeroes 2 MiB at a time, and a VM that hands free memory back to its host backs
each anew (0.9 s for 608 MiB on the KVM guest, 2.4-5 s on an earlier Firecracker VM, "Session 16"): the weights pay it
once at load, a KV pool as its pages first fill (inside the steps that fill them).
"""

from __future__ import annotations

import mmap
from pathlib import Path

import torch


def _huge_page_bytes() -> int:
    """The kernel's transparent huge page size (2 MiB on x86-64 and on arm64 with 4 KiB pages), 2 MiB if unknown."""
    try:
        return int(Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return 2 << 20


HUGE_PAGE = _huge_page_bytes()


def host_arena(nbytes: int) -> torch.Tensor:
    """`nbytes` of zero-filled host memory as a page-aligned uint8 tensor (aligned to a huge page and in huge pages
    where the kernel has them, from HUGE_PAGE bytes on); the mapping lives as long as a view of it does."""
    huge = nbytes >= HUGE_PAGE
    mapping = mmap.mmap(-1, max(nbytes, 1) + (HUGE_PAGE if huge else 0), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    if not huge:
        return whole[:nbytes]
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):  # no MADV_HUGEPAGE here, or a kernel without transparent huge pages
        pass
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]
