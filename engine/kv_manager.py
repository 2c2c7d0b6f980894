"""Where each sequence's KV lives, and the MIGRATE primitive between device pages and host store.

The device pool is bounded by the user's KV budget; the host pool is the overflow where
YIELDed sequences keep their KV. In coroutine mode a slice of the device budget becomes a
one-layer staging pool through which host-resident sequences keep decoding (offloaded COMBINE).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.engine.kv_pool import KVPool, PoolGeometry, copy_pages, slot_mapping
from batchgen.engine.models.context import KVSpec
from batchgen.engine.sequence import KVLocation, Sequence


@dataclass
class KVBudget:
    device_bytes: int
    host_bytes: int
    staging_bytes: int  # part of device_bytes, 0 when host sequences do not decode (lockstep)


class KVManager:
    def __init__(self, spec: KVSpec, page_size: int, dtype: torch.dtype, budget: KVBudget,
                 device: torch.device, stream_host: bool, reserve_pages: int = 2):
        self.geometry = PoolGeometry(spec, page_size, dtype)
        self.page_size = page_size
        self.reserve_pages = reserve_pages
        resident_bytes = budget.device_bytes - budget.staging_bytes
        self.device = KVPool(self.geometry, self.geometry.pages_in_budget(resident_bytes), device)
        self.host = KVPool(self.geometry, self.geometry.pages_in_budget(budget.host_bytes),
                           torch.device("cpu"), pin=True)
        stage_geometry = PoolGeometry(KVSpec(1, spec.num_kv_heads, spec.k_dim, spec.v_dim), page_size, dtype)
        self.stage = KVPool(stage_geometry, stage_geometry.pages_in_budget(budget.staging_bytes), device)
        self.stream_host = stream_host  # host-resident KV decodes through `stage` (else on host pages in place)
        self.bytes_moved = 0
        self.migrations = {"to_host": 0, "to_device": 0}

    @property
    def host_decode_pages(self) -> int:
        """Most pages host-resident sequences can decode over in one micro-batch."""
        return self.stage.num_pages if self.stream_host else self.host.num_pages

    def pool(self, location: KVLocation) -> KVPool:
        return self.device if location is KVLocation.DEVICE else self.host

    def pages_needed(self, num_tokens: int) -> int:
        return self.geometry.pages_for(num_tokens)

    def fits(self, location: KVLocation, num_tokens: int, reserve: bool = True) -> bool:
        extra = self.reserve_pages if reserve and location is KVLocation.DEVICE else 0
        return self.pool(location).free_pages >= self.pages_needed(num_tokens) + extra

    def allocate(self, seq: Sequence, location: KVLocation, num_tokens: int) -> None:
        pages = self.pool(location).allocate(self.pages_needed(num_tokens))
        seq.kv_location = location
        self._set_pages(seq, location, pages)

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Make room for `num_tokens` KV entries, taking up to `reserve_pages` ahead on the device."""
        pages = self.pages_of(seq)
        missing = self.pages_needed(num_tokens) - len(pages)
        if missing <= 0:
            return True
        pool = self.pool(seq.kv_location)
        if pool.free_pages < missing:
            return False
        ahead = self.reserve_pages if seq.kv_location is KVLocation.DEVICE else 1
        pages.extend(pool.allocate(min(pool.free_pages, max(missing, ahead))))
        return True

    def free(self, seq: Sequence) -> None:
        if seq.kv_location is not KVLocation.NONE:
            self.pool(seq.kv_location).release(self.pages_of(seq))
        seq.device_pages, seq.host_pages = [], []
        seq.kv_location = KVLocation.NONE

    def migrate(self, seq: Sequence, to: KVLocation) -> int:
        """MIGRATE a sequence's KV between tiers (YIELD checkpoints to host, COMBINE restores)."""
        src_loc = seq.kv_location
        if src_loc is to:
            return 0
        count = self.pages_needed(seq.kv_len)
        src_pages = self.pages_of(seq)
        dst_pages = self.pool(to).allocate(max(count, 1))
        moved = copy_pages(self.pool(src_loc), src_pages[:count], self.pool(to), dst_pages[:count])
        self.pool(src_loc).release(src_pages)
        self._set_pages(seq, src_loc, [])
        self._set_pages(seq, to, dst_pages)
        seq.kv_location = to
        self.bytes_moved += moved
        self.migrations["to_host" if to is KVLocation.HOST else "to_device"] += 1
        return moved

    def fork(self, parent: Sequence, child: Sequence, location: KVLocation) -> None:
        """Give an n > 1 sample its own copy of the shared prompt KV."""
        count = self.pages_needed(parent.kv_len)
        self.allocate(child, location, parent.kv_len)
        child.kv_len = parent.kv_len
        self.bytes_moved += copy_pages(self.pool(parent.kv_location), self.pages_of(parent)[:count],
                                       self.pool(location), self.pages_of(child)[:count])

    def slots(self, seq: Sequence, start: int, count: int) -> list[int]:
        return slot_mapping(self.pages_of(seq), start, count, self.page_size)

    def export(self, seq: Sequence, packed: torch.Tensor) -> None:
        """Write the sequence's KV into `packed` (a uint8 host buffer of geometry.packed_nbytes(kv_len)
        bytes) for the prefill/decode split: one gather from the pages, the hand-off's one host copy."""
        pool = self.pool(seq.kv_location)
        slots = torch.tensor(self.slots(seq, 0, seq.kv_len), device=pool.device)
        for pages, out in zip((pool.k, pool.v), self.geometry.packed_views(packed, seq.kv_len)):
            flat = pages.view(pages.shape[0], -1, *pages.shape[3:])
            if flat.device == out.device:
                torch.index_select(flat, 1, slots, out=out)
            else:
                out.copy_(flat.index_select(1, slots))

    def load(self, seq: Sequence, location: KVLocation, packed: torch.Tensor, num_tokens: int) -> None:
        """Inverse of `export`: place packed KV into freshly allocated pages."""
        k, v = self.geometry.packed_views(packed, num_tokens)
        self.allocate(seq, location, num_tokens)
        seq.kv_len = num_tokens
        pool = self.pool(location)
        slots = torch.tensor(self.slots(seq, 0, num_tokens), device=pool.device)
        flat_k = pool.k.view(pool.k.shape[0], -1, *pool.k.shape[3:])
        flat_v = pool.v.view(pool.v.shape[0], -1, *pool.v.shape[3:])
        flat_k[:, slots] = k.to(pool.device)
        flat_v[:, slots] = v.to(pool.device)
        self.bytes_moved += packed.numel()

    def pages_of(self, seq: Sequence) -> list[int]:
        """The page ids of the tier the sequence's KV is in."""
        return seq.device_pages if seq.kv_location is KVLocation.DEVICE else seq.host_pages

    @staticmethod
    def _set_pages(seq: Sequence, location: KVLocation, pages: list[int]) -> None:
        if location is KVLocation.DEVICE:
            seq.device_pages = pages
        elif location is KVLocation.HOST:
            seq.host_pages = pages
