"""Paged KV storage: one pool of fixed-size pages per memory tier (device or host).

Pages are shared by all layers (a page id names the same slot in every layer's tensor), so a
sequence has one page list per tier. Moving a sequence between tiers is one indexed copy per
tensor, whatever the number of layers. Where the host tier is the device's own memory (a CPU engine),
both tiers are page ranges of one storage (`tiers_in_one_storage`): a page id then names one slot
whichever pool holds it, and one page table can mix sequences of both tiers. A GPU attends on a host pool's pinned
pages in place through a view of them (`KVPool.viewed_from`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from batchgen.engine.host_arena import host_arena
from batchgen.engine.host_view import device_view
from batchgen.engine.models.context import KVSpec
from batchgen.engine.page_cache import PageCache


class OutOfPagesError(RuntimeError):
    """The pool cannot hold what was asked; the scheduler must evict first."""


@dataclass(frozen=True)
class PoolGeometry:
    spec: KVSpec
    page_size: int
    dtype: torch.dtype

    @property
    def page_bytes(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        per_token = self.spec.num_kv_heads * (self.spec.k_dim + self.spec.v_dim) * elem
        return self.spec.num_layers * self.page_size * per_token

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def pages_in_budget(self, budget_bytes: int) -> int:
        return max(0, budget_bytes // self.page_bytes)

    def packed_nbytes(self, num_tokens: int) -> int:
        """Bytes of one sequence's KV packed for a hand-off: k [L, T, Hkv, Dk] then v [L, T, Hkv, Dv]."""
        return self.page_bytes // self.page_size * num_tokens

    @property
    def layout(self) -> str:
        """What a packed token of KV is: a hand-off's KV must be this engine's (equal sizes can be other dtypes)."""
        spec = self.spec
        return (f"{self.dtype} [{spec.num_layers} layers, {spec.num_kv_heads} KV heads, head dims "
                f"{spec.k_dim}/{spec.v_dim}]")

    def packed_views(self, packed: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) views of a packed uint8 buffer of `packed_nbytes(num_tokens)` bytes, in this dtype."""
        spec = self.spec
        if packed.dtype != torch.uint8 or packed.numel() != self.packed_nbytes(num_tokens):
            raise ValueError(f"packed KV of {num_tokens} tokens needs {self.packed_nbytes(num_tokens)} bytes of "
                             f"{self.layout}, got {packed.numel()} {packed.dtype} values")
        k_bytes = packed.numel() * spec.k_dim // (spec.k_dim + spec.v_dim)
        k = packed[:k_bytes].view(self.dtype).view(spec.num_layers, num_tokens, spec.num_kv_heads, spec.k_dim)
        v = packed[k_bytes:].view(self.dtype).view(spec.num_layers, num_tokens, spec.num_kv_heads, spec.v_dim)
        return k, v


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, pin: bool = False) -> torch.Tensor:
    """torch.zeros, except in plain host memory: a host arena (engine/host_arena.py), whose
    pages the OS zeroes as they are first written, so the engine's constructor writes none of a pool's
    gigabytes."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or pin or not nbytes:
        return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)
    return host_arena(nbytes).view(dtype).view(shape)


@dataclass(frozen=True)
class PoolView:
    """A pool's k/v as another device's kernels address them (KVPool.viewed_from): what attention reads."""

    k: torch.Tensor
    v: torch.Tensor


class KVPool:
    """k/v tensors [L, P, page, Hkv, D] on one device, a free list of page ids and each page's holder count.

    A page may be held by several sequences (a shared prompt prefix, an n > 1 fork's prompt pages) and
    is free once none holds it; with a `PageCache`, a freed page that caches a prefix stays readable
    (idle) until an allocation needs it back.
    """

    def __init__(self, geometry: PoolGeometry, num_pages: int, device: torch.device, pin: bool = False,
                 cache: bool = False, storage: tuple[torch.Tensor, torch.Tensor] | None = None, first_page: int = 0):
        """`storage`: k/v tensors this pool shares with another, its pages being [first_page, first_page +
        num_pages) of them (tiers_in_one_storage); by default a storage of its own."""
        self.geometry = geometry
        self.num_pages = num_pages
        self.device = device
        if storage is None:
            pin = pin and device.type == "cpu" and torch.cuda.is_available()
            storage = _storage(geometry, num_pages, device, pin)
        self.k, self.v = storage
        self._free = list(range(first_page + num_pages - 1, first_page - 1, -1))
        self.holders = [0] * (first_page + num_pages)
        self.cache = PageCache() if cache else None

    def viewed_from(self, device: torch.device) -> KVPool | PoolView:
        """This pool's pages as kernels on `device` address them: the pool itself on its own device, else a view of
        its pinned host pages in the device's address space (engine/host_view.py)."""
        if device == self.device:
            return self
        return PoolView(device_view(self.k, device), device_view(self.v, device))

    def release_storage(self) -> None:
        """Give back the pages' memory, keeping the pool's geometry (for a scratch pool whose contents do not
        outlive a step: the staging pool; engine/offload/phase_switch.py)."""
        self.k, self.v = self.k.new_empty((0, *self.k.shape[1:])), self.v.new_empty((0, *self.v.shape[1:]))

    def restore_storage(self) -> None:
        """Pages again after `release_storage`, contents undefined."""
        spec = self.geometry.spec
        shape = (spec.num_layers, self.num_pages, self.geometry.page_size, spec.num_kv_heads)
        self.k = self.k.new_empty((*shape, spec.k_dim))
        self.v = self.v.new_empty((*shape, spec.v_dim))

    @property
    def free_pages(self) -> int:
        """Pages an allocation can take: never held, or held no more (idle cached pages included)."""
        return len(self._free) + (len(self.cache.idle) if self.cache is not None else 0)

    def allocate(self, count: int) -> list[int]:
        if count > self.free_pages:
            raise OutOfPagesError(f"need {count} pages, {self.free_pages} free of {self.num_pages}")
        while len(self._free) < count:
            self._free.extend(reversed(self.cache.evict()))
        pages = [self._free.pop() for _ in range(count)]
        for page in pages:
            self.holders[page] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """One more holder for each of `pages` (an idle cached page is taken back into use)."""
        for page in pages:
            if self.holders[page] == 0:
                del self.cache.idle[page]
            self.holders[page] += 1

    def release(self, pages: list[int]) -> None:
        """One holder less for each of `pages`; a page nobody holds is free, or idle if it caches a prefix.
        Pages go last first, so a prefix's tail is taken back before its head."""
        for page in reversed(pages):
            self.holders[page] -= 1
            if self.holders[page]:
                continue
            if self.cache is not None and self.cache.cached(page):
                self.cache.idle[page] = None
            else:
                self._free.append(page)

    def nbytes(self, num_pages: int) -> int:
        return num_pages * self.geometry.page_bytes


def tiers_in_one_storage(geometry: PoolGeometry, device_pages: int, host_pages: int, device: torch.device,
                         cache: bool) -> tuple[KVPool, KVPool]:
    """A device pool and a host pool that are two page ranges of one storage, for host pages in the device's own
    memory: the tiers keep their budgets and free lists, and a decode micro-batch attends over sequences of
    both at once (engine/model_runner.py)."""
    storage = _storage(geometry, device_pages + host_pages, device, pin=False)
    return (KVPool(geometry, device_pages, device, cache=cache, storage=storage),
            KVPool(geometry, host_pages, device, cache=cache, storage=storage, first_page=device_pages))


def _storage(geometry: PoolGeometry, num_pages: int, device: torch.device, pin: bool
             ) -> tuple[torch.Tensor, torch.Tensor]:
    spec = geometry.spec
    shape = (spec.num_layers, num_pages, geometry.page_size, spec.num_kv_heads)
    return (zeroed((*shape, spec.k_dim), geometry.dtype, device, pin),
            zeroed((*shape, spec.v_dim), geometry.dtype, device, pin))


def copy_pages(src: KVPool, src_pages: list[int], dst: KVPool, dst_pages: list[int]) -> int:
    """Copy whole pages between pools (any tiers); returns bytes moved."""
    if not src_pages:
        return 0
    s = torch.tensor(src_pages, dtype=torch.long, device=src.device)
    d = torch.tensor(dst_pages, dtype=torch.long, device=dst.device)
    # Host -> device may be queued (the host rows are read when the copy is issued); device -> host must not:
    # the indexed store into the host pool reads the copy's result on the CPU at once.
    non_blocking = src.device.type == "cpu" and dst.device.type != "cpu"
    dst.k[:, d] = src.k[:, s].to(dst.device, non_blocking=non_blocking)
    dst.v[:, d] = src.v[:, s].to(dst.device, non_blocking=non_blocking)
    return src.nbytes(len(src_pages))


def slot_mapping(pages: list[int], start: int, count: int, page_size: int) -> list[int]:
    """Flat slots (page * page_size + offset) of token positions [start, start + count): a range per page."""
    slots: list[int] = []
    end = start + count
    while start < end:
        page, offset = divmod(start, page_size)
        take = min(page_size - offset, end - start)
        first = pages[page] * page_size + offset
        slots.extend(range(first, first + take))
        start += take
    return slots
