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
from batchgen.operators.batches import Block, column_values, num_rows, to_block, with_columns
from batchgen.operators.columns import ERROR
from batchgen.operators.fault_injection import crash_injector


class Prefill:
    def __init__(self, model: str, kv_store: KVStore, *, storage_options: dict[str, Any] | None = None,
                 crash_after: dict | None = None, **engine_options: Any) -> None:
        self.engine = Engine(model, storage_options=storage_options, **engine_options)
        self.store = kv_store
        self._crash = crash_injector(crash_after)

    def __call__(self, batch: Any) -> Block:
        if self._crash is not None:
            self._crash.on_batch()
        block = to_block(batch)
        errors = column_values(block, ERROR)
        todo = [(i, Request(uuid.uuid4().hex, ids, sampling=sc.sampling_from_json(sampling)))
                for i, (ids, sampling, error) in enumerate(zip(column_values(block, sc.PROMPT_IDS),
                                                               column_values(block, sc.SAMPLING), errors))
                if error is None]
        done: list[tuple[int, PrefillOutput]] = []
        for (i, _), out in zip(todo, self.engine.prefill([r for _, r in todo])):
            if isinstance(out, PrefillOutput):
                done.append((i, out))
            else:
                errors[i] = out.error
        refs: list[str | None] = [None] * num_rows(block)
        stored = self.store.put_many([out.request.request_id for _, out in done], [out for _, out in done])
        for (i, _), ref in zip(done, stored):
            refs[i] = ref
        return with_columns(block, {sc.KV_REF: sc.column(sc.KV_REF, refs),
                                    ERROR: pa.array(errors, pa.string())})
