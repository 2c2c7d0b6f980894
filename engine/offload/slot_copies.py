"""Copies of host weights into device slots, ordered against the computation that reads the slots.

On CUDA the copies run on their own stream: a slot's load waits until the last computation reading its old
contents has been issued and finished (an event recorded at release), and the computation that reads the new
contents waits on the load's event, so loading the next slot overlaps computing with the current one. Elsewhere
(CPU) a copy is a plain synchronous copy, and its time is what the streaming costs.
"""

from __future__ import annotations

import time

import torch


class SlotCopies:
    def __init__(self, device: torch.device, slots: int):
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda and slots else None
        self._loaded: list[torch.cuda.Event | None] = [None] * slots
        self._released: list[torch.cuda.Event | None] = [None] * slots
        self.bytes = 0
        self.copies = 0
        self.seconds = 0.0  # time spent copying where copies are synchronous (CPU); 0 on CUDA, where they overlap

    def load(self, slot: int, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each (slot view, host tensor) pair; on CUDA asynchronously, ready for `wait(slot)`."""
        self.copies += 1
        self.bytes += sum(src.numel() * src.element_size() for _, src in pairs)
        if self.stream is None:
            start = time.perf_counter()
            for dst, src in pairs:
                dst.copy_(src)
            self.seconds += time.perf_counter() - start
            return
        with torch.cuda.stream(self.stream):
            if self._released[slot] is not None:
                self.stream.wait_event(self._released[slot])
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self._loaded[slot] = event

    def wait(self, slot: int) -> None:
        """The current stream reads `slot` only after its load."""
        if self.stream is not None and self._loaded[slot] is not None:
            torch.cuda.current_stream().wait_event(self._loaded[slot])

    def release(self, slot: int) -> None:
        """The computation issued so far is the last to read `slot` before its next load."""
        if self.stream is not None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream())
            self._released[slot] = event
