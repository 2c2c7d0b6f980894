"""Host memory for a model's weights: one anonymous mapping, aligned to and advised for transparent huge pages.

The weights of a CPU engine, and the host copy a memory-constrained engine streams to its device from
(engine/offload), are read in long sequential sweeps every step; on 2 MiB pages a 4 GB model spans 2,000 TLB
entries instead of a million 4 KiB ones. One allocation for all of them also means one region to pin or to
register with a device. Where the OS gives no huge pages (transparent huge pages "never") it is plain memory.
"""

from __future__ import annotations

import mmap
import re

import torch

HUGE_PAGE = 2 << 20
_SMAPS_RANGE = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) ")


def host_arena(nbytes: int) -> torch.Tensor:
    """`nbytes` of zero-filled host memory as a uint8 tensor starting on a huge-page boundary; the mapping lives
    as long as a view of it does."""
    # private: a shared anonymous mapping is shmem, which gets huge pages only where shmem_enabled says so
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux; elsewhere the mapping keeps the OS's default pages
        mapping.madvise(mmap.MADV_HUGEPAGE)
    buffer = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -buffer.data_ptr() % HUGE_PAGE
    return buffer[start : start + nbytes]


def place_in_arena(module: torch.nn.Module) -> torch.Tensor | None:
    """Give every parameter of `module` (built on the meta device, in the dtypes it will hold) zeroed storage in
    one host arena, each 64-byte aligned; a parameter registered under several names (tied) stays one. Buffers
    get plain host memory. Returns the arena (None for a model without parameters)."""
    unique = {id(p): p for p in module.parameters()}
    offsets, total = {}, 0
    for key, param in unique.items():
        offsets[key] = total
        total += -(-param.numel() * param.element_size() // 64) * 64
    if not total:
        return None
    arena = host_arena(total)
    placed = {key: torch.nn.Parameter(arena[offsets[key] : offsets[key] + p.numel() * p.element_size()]
                                      .view(p.dtype).view(p.shape), requires_grad=False)
              for key, p in unique.items()}
    for sub in module.modules():
        for name, param in sub._parameters.items():
            if param is not None:
                sub._parameters[name] = placed[id(param)]
        for name, buf in sub._buffers.items():
            if buf is not None:
                sub._buffers[name] = torch.empty_like(buf, device="cpu")
    return arena


def huge_page_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the mapping holding `tensor` that the OS backs with transparent huge pages now (Linux; 0
    elsewhere)."""
    address = tensor.data_ptr()
    try:
        with open("/proc/self/smaps") as smaps:
            inside = False
            for line in smaps:
                bounds = _SMAPS_RANGE.match(line)
                if bounds:
                    inside = int(bounds[1], 16) <= address < int(bounds[2], 16)
                elif inside and line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
