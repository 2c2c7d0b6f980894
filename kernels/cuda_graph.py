"""A forward captured as a CUDA graph and replayed: on a GPU, what kernels/capture.py's recordings are on a CPU.

A decode step of a small model on a GPU is host-bound: its kernels take microseconds and their launches (Triton's
launcher, torch's dispatch, the Python between them) take the step's milliseconds (session 19 of bench/RESULTS.md:
a bench-moe decode step 16 ms on an H200, 8,022 Triton launches at ~60 us each a run). A CUDA graph launches the
whole forward at once. `record` runs the function once eagerly at the shape it will capture (every Triton kernel
compiled and every library handle made before the capture, which may not load modules or allocate outside its
pool), then captures it; a replay runs the captured kernels on whatever the captured input tensors hold and writes
the captured output tensor. Host side effects (engine counters) go through `capture.effect`: kept while capturing
and run after each replay, as a CPU recording does. A capture that fails (an op that waits for the device, reads a
value back or is not capturable) raises CaptureRefused: the caller runs the work eagerly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from batchgen.kernels import capture


@dataclass
class CudaGraphRecording:
    graph: torch.cuda.CUDAGraph
    effects: capture.Recording  # the host side effects (its `effects` only), run after each replay
    nbytes: int  # device memory the graph's private pool took while capturing (its activations and output)

    def replay(self, rows: int | None = None) -> None:
        """The captured kernels on the captured inputs' current values (the rows past the first `rows` marked as
        padding first), then the effects on the first `rows` rows (capture.Recording.replay)."""
        capture.mark_padding(self.effects.padding, rows)
        self.graph.replay()
        self.effects.run_effects(rows)


def record(fn: Callable[[], torch.Tensor], rows: int | None, real_rows: int | None,
           device: torch.device) -> tuple[CudaGraphRecording, torch.Tensor, torch.Tensor]:
    """Run `fn` (a forward on `device`'s tensors) eagerly, then capture it. Returns the recording, the tensor its
    replays write (the captured run's output) and this run's output (the eager one: a capture computes nothing).
    `rows` and `real_rows` as for capture.record: the eager run's effects see its `real_rows` real rows."""
    with torch.cuda.device(device):
        padding = capture.padding_mask(rows, real_rows, device)  # outside the capture: its replays mark it
        return _record(fn, rows, real_rows, padding, _capture_stream(torch.cuda.current_device()))


def _record(fn: Callable[[], torch.Tensor], rows: int | None, real_rows: int | None, padding: torch.Tensor | None,
            stream: torch.cuda.Stream) -> tuple[CudaGraphRecording, torch.Tensor, torch.Tensor]:
    # the warm-up on the capture's stream: what a library sets up per stream (cuBLAS's workspace) exists before it
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream), capture.collect_effects(rows, padding) as warm_up:
            result = fn()
    finally:
        # a refused warm-up too: the eager run its caller makes instead (on this stream) must not overtake the
        # kernels the warm-up queued before the refusal (writes into the same KV pages)
        torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the pool's growth below is then this capture's
    reserved = torch.cuda.memory_reserved()
    graph = torch.cuda.CUDAGraph()
    try:
        # thread_local: another thread's CUDA calls (a KV copy, a Ray worker's) do not invalidate the capture
        with (capture.collect_effects(rows, padding) as effects,
              torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local")):
            output = fn()
    except capture.CaptureRefused:  # a value read back while capturing
        raise
    except RuntimeError as exc:
        raise capture.CaptureRefused(f"the CUDA graph capture failed: {exc}") from exc
    warm_up.run_effects(real_rows)
    return CudaGraphRecording(graph, effects, torch.cuda.memory_reserved() - reserved), output, result


@functools.cache
def _capture_stream(device: int) -> torch.cuda.Stream:
    """The side stream every capture on `device` runs on (a capture cannot run on the default stream)."""
    return torch.cuda.Stream(device)
