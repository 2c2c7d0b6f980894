"""Copies of host weights into device slots, ordered against the computation that reads the slots.

On CUDA the copies run on their own stream: a slot's load waits until the last computation reading its old
contents has been issued and finished (an event recorded at release), and the computation that reads the new
contents waits on the load's event, so loading the next slot overlaps computing with the current one. Timing
events measure both sides: how long the copies took, and how long the computation stalled waiting for one
(the part of the copy time not hidden behind compute). Elsewhere (CPU) a copy is a plain synchronous copy, and
all of its time is exposed.
"""

from __future__ import annotations

import time

import torch

PENDING_LIMIT = 256  # timing event pairs kept before the finished ones are folded into the totals


class SlotCopies:
    def __init__(self, device: torch.device, slots: int):
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda and slots else None
        self._loaded: list[torch.cuda.Event | None] = [None] * slots
        self._released: list[torch.cuda.Event | None] = [None] * slots
        self._copy_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._stall_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.bytes = 0
        self.copies = 0
        self._copy_ms = 0.0
        self._stall_ms = 0.0
        self._sync_seconds = 0.0

    def load(self, slot: int, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each (slot view, host tensor) pair; on CUDA asynchronously, ready for `wait(slot)`."""
        self.copies += 1
        self.bytes += sum(src.numel() * src.element_size() for _, src in pairs)
        if self.stream is None:
            start = time.perf_counter()
            for dst, src in pairs:
                dst.copy_(src)
            self._sync_seconds += time.perf_counter() - start
            return
        with torch.cuda.stream(self.stream):
            if self._released[slot] is not None:
                self.stream.wait_event(self._released[slot])
            begin = _timing_event(self.stream)
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            end = _timing_event(self.stream)
        self._loaded[slot] = end
        self._copy_events.append((begin, end))
        self._fold(finished_only=True)

    def wait(self, slot: int) -> None:
        """The current stream reads `slot` only after its load."""
        if self.stream is not None and self._loaded[slot] is not None:
            compute = torch.cuda.current_stream()
            before = _timing_event(compute)
            compute.wait_event(self._loaded[slot])
            self._stall_events.append((before, _timing_event(compute)))
            self._fold(finished_only=True)  # steps that load nothing (every slot already holds its unit) wait still

    def release(self, slot: int) -> None:
        """The computation issued so far is the last to read `slot` before its next load."""
        if self.stream is not None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream())
            self._released[slot] = event

    def seconds(self) -> tuple[float, float]:
        """(time spent copying, time the computation waited for copies): equal on CPU; on CUDA their
        difference is the copy time hidden behind compute."""
        if self.stream is None:
            return self._sync_seconds, self._sync_seconds
        self._fold(finished_only=False)
        return self._copy_ms / 1e3, self._stall_ms / 1e3

    def _fold(self, finished_only: bool) -> None:
        """Sum the timing event pairs into the totals: all of them (synchronizing), or, once PENDING_LIMIT are
        held, those already finished."""
        for events, total in ((self._copy_events, "_copy_ms"), (self._stall_events, "_stall_ms")):
            if finished_only and len(events) < PENDING_LIMIT:
                continue
            done = 0
            for begin, end in events:
                if finished_only and not end.query():
                    break
                end.synchronize()
                setattr(self, total, getattr(self, total) + begin.elapsed_time(end))
                done += 1
            del events[:done]


def _timing_event(stream: torch.cuda.Stream) -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event
