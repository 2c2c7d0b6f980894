"""Prefill stage: tokenized rows -> each prompt's KV and first token(s) in the host KV store.

Its own actor pool (compute-bound: scale it for prompt tokens), writing each sequence's
PrefillOutput to the KVStore and passing only the store's ref downstream. A prompt the engine
rejects (over the context length, a token outside the vocabulary) gets its `error` here.
A sync UDF: `engine.prefill` runs a batch to completion, there is no loop to keep fed.
"""

from __future__ import annotations

import uuid
from typing import Any

import pyarrow as pa
from batchgen.connectors.kv_store import KVStore
from batchgen.engine import Engine, PrefillOutput, Request
from batchgen.operators import stage_columns as sc
from batchgen.operators.batches import as_table, column_values, with_columns
from batchgen.operators.columns import ERROR
from batchgen.operators.fault_injection import crash_injector


class Prefill:
    def __init__(self, model: str, kv_store: KVStore, *, storage_options: dict[str, Any] | None = None,
                 crash_after: dict | None = None, **engine_options: Any) -> None:
        self.engine = Engine(model, storage_options=storage_options, **engine_options)
        self.store = kv_store
        self._crash = crash_injector(crash_after)

    def __call__(self, batch: Any) -> pa.Table:
        if self._crash is not None:
            self._crash.on_batch()
        table = as_table(batch)
        errors = column_values(table, ERROR)
        todo = [(i, Request(uuid.uuid4().hex, ids, sampling=sc.sampling_from_json(sampling)))
                for i, (ids, sampling, error) in enumerate(zip(column_values(table, sc.PROMPT_IDS),
                                                               column_values(table, sc.SAMPLING), errors))
                if error is None]
        refs: list[str | None] = [None] * table.num_rows
        outputs = self.engine.prefill([r for _, r in todo])
        done = [(i, out) for (i, _), out in zip(todo, outputs) if isinstance(out, PrefillOutput)]
        for (i, _), out in zip(todo, outputs):
            if not isinstance(out, PrefillOutput):
                errors[i] = out.error
        stored = self.store.put_many([o.request.request_id for _, o in done], [o for _, o in done])
        for (i, _), ref in zip(done, stored):
            refs[i] = ref
        return with_columns(table, {sc.KV_REF: sc.column(sc.KV_REF, refs),
                                    ERROR: pa.array(errors, pa.string())})
