"""The sequence-coroutine primitives, vectorized over micro-batches.

A coroutine is a sequence's walk through the module program embed -> (attn, ffn) x L -> head.
It yields at every module exit; its resumable state is its program point plus the hidden state
of the last module (and its KV, owned by the KV manager). Thousands of coroutines are not
thousands of Python generators: suspended coroutines at the same program point are held
together as rows of one `CoroutineBatch`, so YIELD is returning the batch, COMBINE is a
concatenation and resuming is one module call on the combined rows.

PARTITION and cross-worker MIGRATE act on the same state: a batch's rows can be re-split into
any groups (`partition`) and its KV moved by `KVManager.migrate`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from batchgen.engine.models.context import AttentionContext
from batchgen.engine.sequence import Sequence


@dataclass(frozen=True)
class ProgramPoint:
    """Where in the module program a coroutine stands; only equal points COMBINE."""

    layer: int = 0
    module: str = "attn"  # attn -> ffn -> (next layer's attn) ... -> head


@dataclass
class CoroutineBatch:
    seqs: list[Sequence]
    hidden: torch.Tensor  # [T, D]: the checkpoint every row yielded with
    point: ProgramPoint
    ctx: AttentionContext | None = None  # attention modules need one; MoE/MLP do not

    @property
    def num_tokens(self) -> int:
        return self.hidden.shape[0]


def next_point(point: ProgramPoint, num_layers: int) -> ProgramPoint:
    if point.module == "attn":
        return ProgramPoint(point.layer, "ffn")
    if point.layer + 1 < num_layers:
        return ProgramPoint(point.layer + 1, "attn")
    return ProgramPoint(num_layers, "head")


def resume(model: torch.nn.Module, batch: CoroutineBatch) -> CoroutineBatch:
    """Run the module at the batch's program point, then YIELD at its exit."""
    layer = model.layers[batch.point.layer]
    if batch.point.module == "attn":
        if batch.ctx is None:
            raise ValueError("an attention module needs an AttentionContext")
        hidden = layer.attn(batch.hidden, batch.ctx)
    else:
        hidden = layer.ffn(batch.hidden)
    return CoroutineBatch(batch.seqs, hidden, next_point(batch.point, len(model.layers)), batch.ctx)


def combine(batches: list[CoroutineBatch]) -> CoroutineBatch:
    """COMBINE suspended coroutines that stand at the same program point into one batch."""
    point = batches[0].point
    if any(b.point != point for b in batches):
        raise ValueError(f"cannot combine coroutines at different program points: {[b.point for b in batches]}")
    if len(batches) == 1:
        return CoroutineBatch(batches[0].seqs, batches[0].hidden, point)
    seqs = [s for b in batches for s in b.seqs]
    return CoroutineBatch(seqs, torch.cat([b.hidden for b in batches]), point)


def partition(batch: CoroutineBatch, groups: list[tuple[list[Sequence], int, AttentionContext | None]]
              ) -> list[CoroutineBatch]:
    """Split a batch's rows into groups of (sequences, token count, context), in row order."""
    sizes = [n for _, n, _ in groups]
    if sum(sizes) != batch.num_tokens:
        raise ValueError(f"partition sizes {sizes} do not cover {batch.num_tokens} rows")
    parts = torch.split(batch.hidden, sizes)
    return [CoroutineBatch(seqs, h, batch.point, ctx) for (seqs, _, ctx), h in zip(groups, parts)]


def run_layers(model: torch.nn.Module, micro_batches: list[CoroutineBatch], max_moe_tokens: int,
               on_ffn: Callable[[int], None] | None = None) -> torch.Tensor:
    """Drive micro-batches through every layer: attention per micro-batch, then COMBINE them into
    feed-forward batches of at most `max_moe_tokens` tokens. Returns the final hidden rows."""
    groups = [(b.seqs, b.num_tokens, b.ctx) for b in micro_batches]
    for _ in range(len(model.layers)):
        micro_batches = [resume(model, b) for b in micro_batches]
        merged = combine(micro_batches)
        outputs = []
        for rows in torch.split(merged.hidden, max_moe_tokens):
            if on_ffn is not None:
                on_ffn(rows.shape[0])
            outputs.append(resume(model, CoroutineBatch(merged.seqs, rows, merged.point)).hidden)
        point = next_point(merged.point, len(model.layers))
        merged = CoroutineBatch(merged.seqs, torch.cat(outputs) if len(outputs) > 1 else outputs[0], point)
        micro_batches = partition(merged, groups)
    return torch.cat([b.hidden for b in micro_batches]) if len(micro_batches) > 1 else micro_batches[0].hidden
