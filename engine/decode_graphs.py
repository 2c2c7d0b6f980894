"""Decode steps replayed from a recording of their forward (kernels/capture.py) when their shape repeats.

In the tail of a batch a few sequences decode step after step at one batch size with nearly the same page table, and
the forward's Python (module calls, input checks, backend dispatch, kernel arguments) repeats unchanged: ~4.5 ms of
every bench-moe decode step on the dev box, a quarter of a step of three sequences (bench/RESULTS.md). A pure decode
step of one resident micro-batch records its forward at its shape (rows, page-table width rounded up to a power of
two, KV pool); the later steps of that shape copy their inputs (token ids, positions, KV slots, page table, lengths)
into the recorded tensors and replay it.

A batch shrinks by a sequence or a few every few steps, so it would rarely meet its own size again: its rows are
padded up to the next power of two up to SMALL_BATCH rows, to a multiple of PAD_ROWS above, and the steps of a batch
shrinking from 128 sequences to one replay ~18 recordings (bench-moe). A padding row is a copy of the first sequence
that costs little: it writes no KV (slot -1), attends to one key (length 1) and joins no expert (the MoE masks its
routing through capture.padding(), which each replay marks): every expert sees the real rows only, as in an eager
step, and so do the counters a replay feeds (kernels/capture.py's effects).

What a recording refuses runs eagerly, and no batch of that size or larger is recorded again: the paths that read
values back to the host (a MoE expert of more rows than the C kernel takes, the torch attention) are the larger
batches' or another backend's, and so is a recording holding more memory than MAX_BYTES alone (the recordings kept
stay within it, the least recently replayed dropped first). A replay whose kernel reports an error runs the step
again eagerly, which raises the error with its message. A change of kernel backends (registry.set_backend,
BATCHGEN_KERNELS) drops every recording. On a GPU the same steps are captured as CUDA graphs (kernels/cuda_graph.py:
the kernels run on a stream a CPU recording does not see), with the same shapes, padding and bounds.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from batchgen.engine.attention_context import DecodeContext
from batchgen.engine.coroutine import CoroutineGroup
from batchgen.engine.metrics import EngineMetrics
from batchgen.kernels import capture, cuda_graph, registry

logger = logging.getLogger(__name__)

CAPACITY = 32  # recordings kept (least recently replayed dropped first)
# memory the recordings may hold (their activations and logits, ~160 KB a row on bench-moe, tens of MB a row on a
# large model): a recording past it alone is not kept, nor is any larger batch recorded again
MAX_BYTES = 256 << 20
SMALL_BATCH = 16  # batches of up to this many sequences are padded to the next power of two
PAD_ROWS = 8  # larger ones to a multiple of this many rows


@dataclass
class DecodeGraph:
    batch: CoroutineGroup  # the recorded inputs: token ids as `hidden`, the DecodeContext's tensors
    recording: capture.Recording | cuda_graph.CudaGraphRecording
    logits: torch.Tensor  # the recorded output, rewritten by every replay


def record_on_cpu(fn: Callable[[], torch.Tensor], rows: int, real_rows: int,
                  device: torch.device) -> tuple[capture.Recording, torch.Tensor, torch.Tensor]:
    """kernels/capture.py's recording of `fn` on the CPU `device`: (recording, the output its replays rewrite, this
    run's output)."""
    with capture.record(rows=rows, real_rows=real_rows) as recording:
        logits = fn()
    return recording, logits, logits


RECORDERS = {"cpu": record_on_cpu, "cuda": cuda_graph.record}  # by device type


class DecodeGraphs:
    def __init__(self, stats: EngineMetrics):
        self.stats = stats  # counts captures, replays and refusals
        self._graphs: OrderedDict[tuple, DecodeGraph] = OrderedDict()
        self._refused_from: int | None = None  # the smallest batch size whose recording was refused
        self._configuration = registry.configuration()

    def forward(self, batch: CoroutineGroup, run: Callable[[CoroutineGroup], torch.Tensor],
                max_rows: int) -> torch.Tensor:
        """`run(batch)`'s logits for a pure decode micro-batch: replayed, recorded, or run eagerly. `run` computes
        every row in one feed-forward call up to `max_rows` rows: padding stops there."""
        if not isinstance(batch.ctx, DecodeContext):
            raise ValueError(f"decode graphs replay resident decode micro-batches, got {type(batch.ctx).__name__}")
        configuration = registry.configuration()
        if configuration != self._configuration:
            self._graphs.clear()
            self._refused_from, self._configuration = None, configuration
        size, ctx = len(batch.seqs), batch.ctx
        rows = padded_rows(size, max_rows)
        # the kernels' thread counts are in the recording: one recorded while borrowing a peer's threads (operators/
        # thread_lending.py) would go on computing on the peer's cores after they were given back
        key = (rows, _bucket(ctx.page_table.shape[1]), ctx.pool.k.data_ptr(), torch.get_num_threads())
        graph = self._graphs.get(key)
        if graph is not None:
            return self._replay(key, graph, batch, run)
        if self._refused_from is not None and rows >= self._refused_from:
            return run(batch)
        padded = _padded(batch, rows, key[1])
        try:
            device = batch.hidden.device
            # each run on a context object of its own (the same tensors): what one run caches on its context (the
            # rotary tables) must be computed inside the recorded run, not read from a run before it (CUDA's warm-up)
            recording, recorded, logits = RECORDERS[device.type](lambda: run(_own_context(padded)), rows, size, device)
        except capture.CaptureRefused as refused:
            self._refuse(rows, size, str(refused))
            return run(batch)
        if recording.nbytes > MAX_BYTES:
            self._refuse(rows, size, f"its recording holds {recording.nbytes} bytes, over {MAX_BYTES}")
            return logits[:size].clone()
        self._graphs[key] = DecodeGraph(padded, recording, recorded)
        while len(self._graphs) > CAPACITY or self.held_bytes() > MAX_BYTES:
            self._graphs.popitem(last=False)
        self.stats.decode_graph_captures += 1
        return logits[:size].clone()

    def held_bytes(self) -> int:
        """Memory the kept recordings hold."""
        return sum(graph.recording.nbytes for graph in self._graphs.values())

    def _refuse(self, rows: int, size: int, reason: str) -> None:
        self._refused_from = min(rows, self._refused_from or rows)
        self.stats.decode_graph_refusals += 1
        logger.debug("decode step of %d sequences runs eagerly: %s", size, reason)

    def _replay(self, key: tuple, graph: DecodeGraph, batch: CoroutineGroup,
                run: Callable[[CoroutineGroup], torch.Tensor]) -> torch.Tensor:
        self._graphs.move_to_end(key)
        recorded, new = graph.batch.ctx, batch.ctx
        size = len(batch.seqs)
        _fill(graph.batch.hidden, batch.hidden)
        _fill(recorded.positions, new.positions)
        _fill(recorded.slots, new.slots, padding=-1)
        _fill(recorded.seq_lens, new.seq_lens, padding=1)
        _fill(recorded.page_table[:, : new.page_table.shape[1]], new.page_table)
        try:
            graph.recording.replay(rows=size)
        except capture.ReplayDiverged:
            del self._graphs[key]
            return run(batch)
        self.stats.decode_graph_replays += 1
        return graph.logits[:size].clone()


def padded_rows(size: int, max_rows: int) -> int:
    """The rows a batch of `size` sequences is recorded and replayed at."""
    rows = 1 << max(size - 1, 0).bit_length() if size <= SMALL_BATCH else -(-size // PAD_ROWS) * PAD_ROWS
    return max(size, min(rows, max_rows))


def _fill(recorded: torch.Tensor, new: torch.Tensor, padding: int | None = None) -> None:
    """`new`'s rows into the first rows of `recorded`, and into the rest (the padding) its first row, or `padding`."""
    recorded[: new.shape[0]].copy_(new)
    if padding is None:
        recorded[new.shape[0] :].copy_(new[:1])
    else:
        recorded[new.shape[0] :].fill_(padding)


def _padded(batch: CoroutineGroup, rows: int, width: int) -> CoroutineGroup:
    """The batch as a recording takes it: its page table `width` columns wide, its rows padded to `rows` with copies
    of the first that write no KV (slot -1) and attend to one key."""
    ctx = batch.ctx
    padding = rows - len(batch.seqs)
    index = torch.cat([torch.arange(len(batch.seqs)), torch.zeros(padding, dtype=torch.int64)])
    index = index.to(batch.hidden.device)
    slots = torch.cat([ctx.slots, ctx.slots.new_full((padding,), -1)])
    seq_lens = torch.cat([ctx.seq_lens, ctx.seq_lens.new_ones(padding)])
    padded_ctx = dataclasses.replace(ctx, positions=ctx.positions[index], slots=slots, seq_lens=seq_lens,
                                     page_table=_widened(ctx.page_table[index], width))
    seqs = batch.seqs + [batch.seqs[0]] * padding
    return CoroutineGroup(seqs, batch.hidden[index], batch.point, padded_ctx)


def _own_context(batch: CoroutineGroup) -> CoroutineGroup:
    """The batch on a copy of its context: the same tensors, nothing derived from them cached yet."""
    return CoroutineGroup(batch.seqs, batch.hidden, batch.point, dataclasses.replace(batch.ctx))


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
