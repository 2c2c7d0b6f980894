"""Decode steps replayed from a recording of their forward (kernels/capture.py) when their shape repeats.

In the tail of a batch a few sequences decode step after step at one batch size with nearly the same page table, and
the forward's Python (module calls, input checks, backend dispatch, kernel arguments) repeats unchanged: ~4.5 ms of
every bench-moe decode step on the dev box, a quarter of a step of three sequences (bench/RESULTS.md). A pure decode
step of one resident micro-batch whose shape (sequences, page-table width rounded up to a power of two, KV pool) is
the previous step's records its forward; the later steps of that shape copy their inputs (token ids, positions, KV
slots, page table, lengths) into the recorded tensors and replay it. A shape seen once runs eagerly, so steps whose
batch shrinks every step (sequences finishing all the time) record nothing.

What a recording refuses runs eagerly, and no batch of that size or larger is recorded again: the paths that read
values back to the host (the MoE's grouping of more than a few tokens by expert, the torch attention) are the
larger batches' or another backend's. A replay whose kernel reports an error runs the step again eagerly, which
raises the error with its message. A change of kernel backends (registry.set_backend, BATCHGEN_KERNELS) drops every
recording. CPU only: on a GPU the kernels run on a stream a recording does not see (a CUDA graph is the GPU's
counterpart).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from batchgen.engine.attention_context import DecodeContext
from batchgen.engine.coroutine import CoroutineGroup
from batchgen.engine.metrics import EngineMetrics
from batchgen.kernels import capture, registry

logger = logging.getLogger(__name__)

CAPACITY = 32  # recordings kept (least recently replayed dropped first); a few sequences' activations each


@dataclass
class DecodeGraph:
    batch: CoroutineGroup  # the recorded inputs: token ids as `hidden`, the DecodeContext's tensors
    recording: capture.Recording
    logits: torch.Tensor  # the recorded output, rewritten by every replay


class DecodeGraphs:
    def __init__(self, stats: EngineMetrics, capacity: int = CAPACITY):
        self.stats = stats  # counts captures, replays and refusals
        self.capacity = capacity
        self._graphs: OrderedDict[tuple, DecodeGraph] = OrderedDict()
        self._previous: tuple | None = None  # the last step's shape
        self._refused_from: int | None = None  # the smallest batch size whose recording was refused
        self._configuration = registry.configuration()

    def forward(self, batch: CoroutineGroup, run: Callable[[CoroutineGroup], torch.Tensor]) -> torch.Tensor:
        """`run(batch)`'s logits for a pure decode micro-batch: replayed, recorded, or run eagerly."""
        if not isinstance(batch.ctx, DecodeContext):
            raise ValueError(f"decode graphs replay resident decode micro-batches, got {type(batch.ctx).__name__}")
        configuration = registry.configuration()
        if configuration != self._configuration:
            self._graphs.clear()
            self._refused_from, self._configuration = None, configuration
        size, ctx = len(batch.seqs), batch.ctx
        key = (size, _bucket(ctx.page_table.shape[1]), ctx.pool.k.data_ptr())
        graph = self._graphs.get(key)
        if graph is not None:
            return self._replay(key, graph, batch, run)
        repeated, self._previous = key == self._previous, key
        if not repeated or (self._refused_from is not None and size >= self._refused_from):
            return run(batch)
        ctx.page_table = _widened(ctx.page_table, key[1])
        try:
            with capture.record() as recording:
                logits = run(batch)
        except capture.CaptureRefused as refused:
            self._refused_from = min(size, self._refused_from or size)
            self.stats.decode_graph_refusals += 1
            logger.debug("decode step of %d sequences runs eagerly: %s", size, refused)
            return run(batch)
        self._graphs[key] = DecodeGraph(batch, recording, logits)
        if len(self._graphs) > self.capacity:
            self._graphs.popitem(last=False)
        self.stats.decode_graph_captures += 1
        return logits.clone()

    def _replay(self, key: tuple, graph: DecodeGraph, batch: CoroutineGroup,
                run: Callable[[CoroutineGroup], torch.Tensor]) -> torch.Tensor:
        self._graphs.move_to_end(key)
        recorded, new = graph.batch.ctx, batch.ctx
        graph.batch.hidden.copy_(batch.hidden)
        recorded.positions.copy_(new.positions)
        recorded.slots.copy_(new.slots)
        recorded.seq_lens.copy_(new.seq_lens)
        recorded.page_table[:, : new.page_table.shape[1]].copy_(new.page_table)
        try:
            graph.recording.replay()
        except capture.ReplayDiverged:
            del self._graphs[key]
            return run(batch)
        self.stats.decode_graph_replays += 1
        return graph.logits.clone()


def _bucket(width: int) -> int:
    """Page-table widths recorded: powers of two (a sequence's table grows by one page every page_size tokens)."""
    return 1 << max(width - 1, 0).bit_length()


def _widened(table: torch.Tensor, width: int) -> torch.Tensor:
    """`table` right-padded with page 0 to `width` columns (the kernels read no page past a row's length)."""
    if table.shape[1] == width:
        return table
    wide = table.new_zeros(table.shape[0], width)
    wide[:, : table.shape[1]] = table
    return wide
