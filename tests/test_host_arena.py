"""Host arenas: zero-filled, page-aligned, and from a huge page's size on 2 MiB-aligned and advised for transparent
huge pages (what the weights and KV pools of a CPU engine live in)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from batchgen.engine.host_arena import HUGE_PAGE, host_arena


def _transparent_huge_pages() -> bool:
    """Whether this kernel has transparent huge pages a mapping can be advised for ("[never]" or absent: no)."""
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return path.exists() and "[never]" not in path.read_text()


def _vm_flags(tensor: torch.Tensor) -> set[str]:
    """The VmFlags of the mapping holding `tensor` ("hg": advised for huge pages), from /proc/self/smaps."""
    address, inside = tensor.data_ptr(), False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):
                low, high = (int(x, 16) for x in fields[0].split("-"))
                inside = low <= address < high
            elif inside and fields[0] == "VmFlags:":
                return set(fields[1:])
    raise AssertionError("no mapping holds the tensor")


@pytest.mark.skipif(not _transparent_huge_pages(), reason="this kernel has no transparent huge pages")
def test_an_arena_of_huge_pages_is_aligned_to_one_and_advised():
    arena = host_arena(2 * HUGE_PAGE + 4096)
    assert arena.numel() == 2 * HUGE_PAGE + 4096
    assert arena.data_ptr() % HUGE_PAGE == 0
    assert "hg" in _vm_flags(arena)
    assert int(arena[-1]) == 0 and int(arena[0]) == 0
    arena[-1] = 7  # the whole length is writable
    assert int(arena[-1]) == 7


def test_a_small_arena_stays_in_ordinary_pages():
    """Under a huge page's size an advised mapping would commit 2 MiB for a few KiB."""
    arena = host_arena(64 << 10)
    assert arena.numel() == 64 << 10
    assert arena.data_ptr() % 4096 == 0
    assert "hg" not in _vm_flags(arena)
    assert not arena.any()
