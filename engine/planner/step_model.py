"""The predicted time of one engine step, from its shape and the cost curves.

A step is the scheduler's plan cut the way the model runner cuts it: prefill chunks and resident
decoding sequences in attention micro-batches of at most `b_attn`, host-resident groups as the
scheduler formed them, every layer's micro-batches COMBINE-d into feed-forward calls of at most `b_moe`
tokens. One layer is priced by its DAG's critical path and repeated for every layer; the LM head, the
KV migrations the scheduler did and the host's own per-step work are added.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchgen.engine.planner.cost_curves import CostCurves
from batchgen.engine.planner.layer_dag import LayerDag


@dataclass(frozen=True)
class StepShape:
    prefill: tuple[tuple[int, int], ...]  # each chunk's (start, end) prompt positions
    resident: tuple[int, ...]  # decoding sequences in device pages: KV tokens each reads
    staged: tuple[tuple[int, ...], ...]  # host-resident groups: KV tokens each sequence reads
    completed: int  # prompts whose prefill completes: their last position gets logits
    migrated_bytes: int  # KV the scheduler moved between tiers before this step
    streams_host: bool  # staged groups copy their KV through the staging pool (else attend in place)

    @property
    def decoding(self) -> int:
        return len(self.resident) + sum(map(len, self.staged))


def layer_dag(shape: StepShape, curves: CostCurves, b_attn: int, b_moe: int) -> LayerDag:
    dag = LayerDag()
    attention = []
    for i in range(0, len(shape.prefill), b_attn):
        chunks = shape.prefill[i : i + b_attn]
        tokens = sum(end - start for start, end in chunks)
        pairs = sum((end - start) * (start + end + 1) / 2 for start, end in chunks)
        attention.append(dag.add("prefill_attention", curves.prefill_attention.seconds(
            calls=1, seqs=len(chunks), tokens=tokens, pairs=pairs), "compute"))
    for i in range(0, len(shape.resident), b_attn):
        attention.append(_decode_node(dag, shape.resident[i : i + b_attn], curves, ()))
    layer_kv_bytes = curves.kv_bytes_per_token / curves.num_layers
    for group in shape.staged:
        after, link = (), sum(group) * layer_kv_bytes / curves.copy_bytes_per_s
        if shape.streams_host:
            after = (dag.add("kv_copy", link, "copy"),)
        # in place on a GPU the kernel reads the host pages over the host link (on a CPU they are its own memory)
        floor = link if not shape.streams_host and curves.device_type != "cpu" else 0.0
        attention.append(_decode_node(dag, group, curves, after, floor))
    tokens = sum(end - start for start, end in shape.prefill) + shape.decoding
    previous = tuple(attention)
    for start in range(0, tokens, b_moe):  # the COMBINE: every micro-batch's attention is done first
        previous = (dag.add("feed_forward", curves.ffn_seconds(min(b_moe, tokens - start)), "compute", previous),)
    return dag


def _decode_node(dag: LayerDag, lens: tuple[int, ...], curves: CostCurves, after: tuple[int, ...],
                 floor: float = 0.0) -> int:
    cost = curves.decode_attention.seconds(calls=1, seqs=len(lens), kv_tokens=sum(lens))
    return dag.add("decode_attention", max(cost, floor), "compute", after)


def step_seconds(shape: StepShape, curves: CostCurves, b_attn: int, b_moe: int) -> float:
    dag = layer_dag(shape, curves, b_attn, b_moe)
    layer, _ = dag.critical_path()
    rows = shape.completed + shape.decoding
    head = curves.head.seconds(calls=1, rows=rows) if rows else 0.0
    micro_batches = sum(name.endswith("attention") for name in dag.names)
    host = curves.host.seconds(calls=1, seqs=shape.decoding + len(shape.prefill), micro_batches=micro_batches)
    return curves.num_layers * layer + head + host + shape.migrated_bytes / curves.copy_bytes_per_s
