"""Prefill stage: tokenized rows -> each prompt's KV and first token(s), carried in the block.

Its own actor pool (compute-bound: scale it for prompt tokens). The engine gathers every prompt's
KV from its pages into one host buffer per batch, and the block's KV column is a view of that
buffer (operators/stage_columns.py), so the hand-off to decode makes one host copy of the pages
before Ray stores the block. Its rows arrive as token ids; the tokenizer is loaded for the grammar
of structured outputs, which constrains the first token too. A prompt the engine rejects (over the
context length, a token outside the vocabulary, a schema that does not compile) gets its `error` here.
A sync UDF: `PrefillExporter.prefill` runs a batch to completion, there is no loop to keep fed.
"""

from __future__ import annotations

import time
from typing import Any

import pyarrow as pa

from batchgen.engine import EngineConfig, PrefillExporter, PrefillOutput
from batchgen.operators import stage_columns as sc
from batchgen.operators.actor_ready import announce_ready
from batchgen.operators.blocks import Block, column_values, num_rows, to_block, with_columns
from batchgen.operators.columns import ERROR
from batchgen.operators.engine_actor import prepare_engine_process
from batchgen.operators.engine_factory import load_engine
from batchgen.operators.thread_lending import lend_threads


class Prefill:
    def __init__(self, model: str, *, storage_options: dict[str, Any] | None = None, progress: Any = None,
                 **engine_options: Any) -> None:
        """progress: the job's tracker, told when this actor is ready (operators/engine_actor.py)."""
        init_started = time.perf_counter()
        if EngineConfig.from_kwargs(**engine_options).ranks > 1:
            raise ValueError("the prefill stage runs one rank per engine actor: an engine over several ranks "
                             "(ep_size or tp_size > 1) serves BatchGen, and Decode with ep_size")
        self.lending = lend_threads(prepare_engine_process(), engine_options)
        self.exporter = PrefillExporter(load_engine(model, storage_options, **engine_options))
        announce_ready(progress, "Prefill", init_started, self.exporter.engine)

    def __call__(self, batch: Any) -> Block:
        block = to_block(batch)
        errors = column_values(block, ERROR)
        requests = sc.requests(block)
        todo = [i for i, (request, error) in enumerate(zip(requests, errors)) if request is not None and error is None]
        busy = self.lending.busy if self.lending else None
        try:
            exported = self.exporter.prefill([requests[i] for i in todo], before_step=busy)
        finally:
            if self.lending:
                self.lending.idle()
        outputs: list[PrefillOutput | None] = [None] * num_rows(block)
        for i, out in zip(todo, exported.outputs):
            if isinstance(out, PrefillOutput):
                outputs[i] = out
            else:
                errors[i] = out.error
        return with_columns(block, {**sc.prefill_columns(outputs, exported), ERROR: pa.array(errors, pa.string())})
