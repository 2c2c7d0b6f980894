"""Prefill stage: tokenized rows -> each prompt's KV and first token(s) in the hand-off store.

Its own actor pool (compute-bound: scale it for prompt tokens), writing each prompt's
PrefillOutput to the hand-off store and passing only the store's ref downstream. A prompt the
engine rejects (over the context length, a token outside the vocabulary) gets its `error` here.
A sync UDF: `PrefillExporter.prefill` runs a batch to completion, there is no loop to keep fed.
"""

from __future__ import annotations

import uuid
from typing import Any

import pyarrow as pa

from batchgen.connectors.handoff_store import HandoffStore
from batchgen.engine import PrefillExporter, PrefillOutput, Request
from batchgen.operators import stage_columns as sc
from batchgen.operators.blocks import Block, column_values, num_rows, to_block, with_columns
from batchgen.operators.columns import ERROR
from batchgen.operators.engine_actor import prepare_engine_process
from batchgen.operators.engine_factory import load_engine


class Prefill:
    def __init__(self, model: str, handoff_store: HandoffStore, *, storage_options: dict[str, Any] | None = None,
                 **engine_options: Any) -> None:
        prepare_engine_process()
        self.exporter = PrefillExporter(load_engine(model, storage_options, **engine_options))
        self.store = handoff_store

    def __call__(self, batch: Any) -> Block:
        block = to_block(batch)
        errors = column_values(block, ERROR)
        todo = [(i, Request(uuid.uuid4().hex, ids, sampling=sc.sampling_from_json(sampling)))
                for i, (ids, sampling, error) in enumerate(zip(column_values(block, sc.PROMPT_IDS),
                                                               column_values(block, sc.SAMPLING), errors))
                if error is None]
        done: list[tuple[int, PrefillOutput]] = []
        for (i, _), out in zip(todo, self.exporter.prefill([r for _, r in todo])):
            if isinstance(out, PrefillOutput):
                done.append((i, out))
            else:
                errors[i] = out.error
        refs: list[str | None] = [None] * num_rows(block)
        stored = self.store.put_many([out.request.request_id for _, out in done], [vars(out) for _, out in done])
        for (i, _), ref in zip(done, stored):
            refs[i] = ref
        return with_columns(block, {sc.KV_REF: sc.column(sc.KV_REF, refs),
                                    ERROR: pa.array(errors, pa.string())})
