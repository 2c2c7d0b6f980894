"""Prefill KV offload: a prompt prefilled straight into the host store leaves each layer's KV for its host pages
right after that layer's attention.

The KV goes as one copy per run of consecutive slots (a prompt's pages are mostly consecutive), straight into
the host pages: no gather on the device, no scatter on the host. On CUDA the copies run on a side stream once
the layer's attention has been issued, and the device K/V tensors are reclaimed by the allocator when their
copy completes; a new layer's copies wait until at most LAYERS_IN_FLIGHT - 1 earlier ones are still in flight,
so the device holds at most two layers' worth of an offloaded prefill's KV while the computation runs ahead.
Where host and device are the same memory (a CPU engine) the runs are plain copies. Readers of the host pages
(a later chunk of the same prompt, the next step's staged decode, a MIGRATE) come after `flush()`.
"""

from __future__ import annotations

from collections import deque

import torch

from batchgen.engine.kv_pool import KVPool

LAYERS_IN_FLIGHT = 2


def slot_runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(first token, first slot, length) of each run of consecutive slots in `slots`, in token order."""
    runs: list[tuple[int, int, int]] = []
    for token, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            first, start, length = runs[-1]
            runs[-1] = (first, start, length + 1)
        else:
            runs.append((token, slot, 1))
    return runs


class PrefillOffload:
    """Writes prefill K/V computed on `device` into the pages of the host pool `host`."""

    def __init__(self, host: KVPool, device: torch.device):
        self.host = host
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" and host.device.type == "cpu" else None
        self._in_flight: deque[torch.cuda.Event] = deque()
        self.layers = 0  # layer writes (one per layer per prefill micro-batch offloaded)
        self.copies = 0  # copies issued: one per run of consecutive slots, K and V apart
        self.bytes = 0
        self.max_in_flight = 0  # most layer writes outstanding at once (always 0 when copies are synchronous)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, runs: list[tuple[int, int, int]]) -> None:
        """k [T, Hkv, Dk] / v [T, Hkv, Dv] of one layer into the host slots `runs` describe (slot_runs)."""
        self.layers += 1
        self.copies += 2 * len(runs)
        self.bytes += k.numel() * k.element_size() + v.numel() * v.element_size()
        pairs = ((self.host.k[layer].flatten(0, 1), k), (self.host.v[layer].flatten(0, 1), v))
        if self.stream is None:
            for pages, new in pairs:
                for token, slot, length in runs:
                    pages[slot : slot + length].copy_(new[token : token + length])
            return
        while len(self._in_flight) >= LAYERS_IN_FLIGHT:
            self._in_flight.popleft().synchronize()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for pages, new in pairs:
                for token, slot, length in runs:
                    pages[slot : slot + length].copy_(new[token : token + length], non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        k.record_stream(self.stream)  # the allocator reuses their memory only once the copies are done
        v.record_stream(self.stream)
        self._in_flight.append(done)
        self.max_in_flight = max(self.max_in_flight, len(self._in_flight))

    def flush(self) -> None:
        """Every copy issued so far has landed in the host pages."""
        while self._in_flight:
            self._in_flight.popleft().synchronize()

    def summary(self) -> dict:
        return {"layer_writes": self.layers, "copies": self.copies, "bytes": self.bytes,
                "max_layers_in_flight": self.max_in_flight}
