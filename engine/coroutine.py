"""The sequence-coroutine primitives, vectorized over micro-batches.

A coroutine is a sequence's walk through the module program embed -> (attn, ffn) x L -> head.
It yields at every module exit; its resumable state is its program point plus the hidden state
of the last module (and its KV, owned by the KV manager). Thousands of coroutines are not
thousands of Python generators: suspended coroutines at the same program point are held
together as rows of one `CoroutineGroup`, so YIELD is returning the group, COMBINE is a
concatenation and resuming is one module call on the combined rows. `partition` re-splits a
group's rows, which is how attention micro-batches come apart again after a COMBINE-d MoE call.
(MIGRATE and data-parallel PARTITION across engine actors are operators/work_balancer.py's;
tensor-parallel PARTITION across devices is not implemented yet.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from batchgen.engine.models.context import AttentionContext
from batchgen.engine.sequence import Sequence
from batchgen.kernels.capture import effect


@dataclass(frozen=True)
class ProgramPoint:
    """Where in the module program a coroutine stands; only equal points COMBINE."""

    layer: int = 0
    module: str = "attn"  # embed -> attn -> ffn -> (next layer's attn) ... -> head


@dataclass
class CoroutineGroup:
    """Suspended coroutines at one program point: row i of `hidden` is the checkpoint of `seqs`' i-th
    token (one row per sequence in decode, one per prompt token in prefill)."""

    seqs: list[Sequence]
    hidden: torch.Tensor  # [T, D]: the checkpoint every row yielded with ([T] token ids at the embed point)
    point: ProgramPoint
    ctx: AttentionContext | None = None  # attention modules need one; MoE/MLP do not

    @property
    def num_tokens(self) -> int:
        return self.hidden.shape[0]


def next_point(point: ProgramPoint, num_layers: int) -> ProgramPoint:
    if point.module == "embed":
        return ProgramPoint(0, "attn")
    if point.module == "attn":
        return ProgramPoint(point.layer, "ffn")
    if point.layer + 1 < num_layers:
        return ProgramPoint(point.layer + 1, "attn")
    return ProgramPoint(num_layers, "head")


def resume(model: torch.nn.Module, batch: CoroutineGroup) -> CoroutineGroup:
    """Run the module at the batch's program point, then YIELD at its exit."""
    layer = model.layers[batch.point.layer]
    if batch.point.module == "attn":
        if batch.ctx is None:
            raise ValueError("an attention module needs an AttentionContext")
        hidden = layer.attn(batch.hidden, batch.ctx)
    else:
        hidden = layer.ffn(batch.hidden)
    return CoroutineGroup(batch.seqs, hidden, next_point(batch.point, len(model.layers)), batch.ctx)


def combine(batches: list[CoroutineGroup]) -> CoroutineGroup:
    """COMBINE suspended coroutines that stand at the same program point into one batch."""
    point = batches[0].point
    if any(b.point != point for b in batches):
        raise ValueError(f"cannot combine coroutines at different program points: {[b.point for b in batches]}")
    if len(batches) == 1:
        return CoroutineGroup(batches[0].seqs, batches[0].hidden, point)
    seqs = [s for b in batches for s in b.seqs]
    return CoroutineGroup(seqs, torch.cat([b.hidden for b in batches]), point)


def partition(batch: CoroutineGroup, groups: list[tuple[list[Sequence], int, AttentionContext | None]]
              ) -> list[CoroutineGroup]:
    """Split a batch's rows into groups of (sequences, token count, context), in row order."""
    sizes = [n for _, n, _ in groups]
    if sum(sizes) != batch.num_tokens:
        raise ValueError(f"partition sizes {sizes} do not cover {batch.num_tokens} rows")
    parts = torch.split(batch.hidden, sizes) if len(groups) > 1 else [batch.hidden]
    return [CoroutineGroup(seqs, h, batch.point, ctx) for (seqs, _, ctx), h in zip(groups, parts)]


def run_layers(model: torch.nn.Module, micro_batches: list[CoroutineGroup], max_moe_tokens: int,
               on_ffn: Callable[[int], None], ffn_calls: int = 0) -> torch.Tensor:
    """All micro-batches walk the layers together. In each layer every micro-batch runs its own
    attention (its own KV context, at most b_attn sequences), then all of them are COMBINE-d into
    feed-forward/MoE calls of at most `max_moe_tokens` tokens, so the experts see the whole step's
    tokens at once; the rows are PARTITIONed back into the micro-batches for the next layer's
    attention. Returns the hidden rows after the last layer, in micro-batch order.

    `ffn_calls`: under expert parallelism every rank of the engine makes the same number of feed-forward
    calls per layer (each is a collective), so a rank with fewer rows pads with empty calls up to it."""
    groups = [(b.seqs, b.num_tokens, b.ctx) for b in micro_batches]
    if micro_batches[0].point.module == "embed":  # one embedding lookup for every micro-batch's token ids
        merged = combine(micro_batches)
        micro_batches = partition(CoroutineGroup(merged.seqs, model.embed(merged.hidden), ProgramPoint(0, "attn")),
                                  groups)
    for _ in range(len(model.layers)):
        micro_batches = [resume(model, b) for b in micro_batches]
        merged = combine(micro_batches)
        tokens = merged.hidden.shape[0]
        parts = list(torch.split(merged.hidden, max_moe_tokens)) if tokens > max_moe_tokens else [merged.hidden]
        parts += [merged.hidden[:0]] * (ffn_calls - len(parts))
        outputs = []
        for rows in parts:
            effect(on_ffn, rows.shape[0])  # counted again when a recorded forward replays
            outputs.append(resume(model, CoroutineGroup(merged.seqs, rows, merged.point)).hidden)
        point = next_point(merged.point, len(model.layers))
        merged = CoroutineGroup(merged.seqs, torch.cat(outputs) if len(outputs) > 1 else outputs[0], point)
        micro_batches = partition(merged, groups)
    return torch.cat([b.hidden for b in micro_batches]) if len(micro_batches) > 1 else micro_batches[0].hidden


def run_idle_layers(model: torch.nn.Module, ffn_calls: int, empty: torch.Tensor) -> None:
    """A rank with no rows this step still makes the step's MoE calls (on `empty` [0, D] rows): under expert
    parallelism its experts serve the other ranks' tokens."""
    for layer in model.layers:
        if layer.is_moe:
            for _ in range(ffn_calls):
                layer.ffn(empty)
