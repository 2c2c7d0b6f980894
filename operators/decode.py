"""Decode stage: KV refs -> generated token ids, one engine per actor kept over-subscribed.

Fetches each row's PrefillOutput from the hand-off store and adopts it into the engine
(`add_prefilled`), with every in-flight batch feeding the same engine loop as in BatchGen. A ref
whose KV is gone (its owner died, or this task is a retry after the KV was already released) is
not an error: the row's prompt ids travel with it, so the engine prefills it again here. The KV
is deleted from the store once the row's result exists. Text is left to the detokenize stage;
where a stop string cut a sample, its cut position travels along.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pyarrow as pa

from batchgen.connectors.handoff_store import HandoffStore
from batchgen.engine import Engine, EngineLoop, PrefillOutput, Request, Result
from batchgen.operators import stage_columns as sc
from batchgen.operators.blocks import Block, column_values, num_rows, to_block, with_columns
from batchgen.operators.columns import ERROR
from batchgen.operators.engine_actor import prepare_engine_process
from batchgen.operators.engine_factory import load_engine


class Decode:
    def __init__(self, model: str, handoff_store: HandoffStore, *, storage_options: dict[str, Any] | None = None,
                 progress: Any = None, **engine_options: Any) -> None:
        """progress: as for BatchGen, an actor told about every batch of rows leaving the engine."""
        prepare_engine_process()
        self.loop = EngineLoop(lambda: load_engine(model, storage_options, **engine_options))
        self.engine = self.loop.engine
        self.store = handoff_store
        self.progress = progress

    async def __call__(self, batch: Any) -> Block:
        block = to_block(batch)
        errors = column_values(block, ERROR)
        refs = column_values(block, sc.KV_REF)
        todo = [i for i, (ref, error) in enumerate(zip(refs, errors)) if error is None and ref is not None]
        # the store's calls block on Ray; keep them off the event loop other batches are awaiting on
        payloads = await asyncio.to_thread(self.store.get_many, [refs[i] for i in todo])
        prefilled = [None if p is None else PrefillOutput(**p) for p in payloads]
        ids, sampling = column_values(block, sc.PROMPT_IDS), column_values(block, sc.SAMPLING)
        recompute = {i: Request(refs[i].rsplit("/", 1)[-1], ids[i],
                                sampling=sc.sampling_from_json(sampling[i]))
                     for i, p in zip(todo, prefilled) if p is None}

        def admit(engine: Engine) -> None:
            for i, p in zip(todo, prefilled):
                if p is None:
                    engine.add_request(recompute[i])
                else:
                    engine.add_prefilled(p)

        request_ids = [recompute[i].request_id if p is None else p.request.request_id
                       for i, p in zip(todo, prefilled)]
        results = await self.loop.run(request_ids, admit)
        await asyncio.to_thread(self.store.delete_many, [refs[i] for i in todo])
        if self.progress is not None:  # fire and forget
            self.progress.add_finished.remote(num_rows(block), sum(len(c.token_ids) for r in results
                                                                    for c in r.outputs))
        by_row: dict[int, Result] = dict(zip(todo, results))
        generated, reasons, text_ends, seconds = ([None] * num_rows(block) for _ in range(4))
        for i, result in by_row.items():
            if result.error is not None:
                errors[i] = result.error
                continue
            params = sc.sampling_from_json(sampling[i])
            generated[i] = [c.token_ids for c in result.outputs]
            reasons[i] = [c.finish_reason for c in result.outputs]
            text_ends[i] = [len(c.text) if params.stop and c.finish_reason == "stop" else None
                            for c in result.outputs]
            seconds[i] = result.completion_time
        return with_columns(block, {
            sc.GENERATED_IDS: sc.column(sc.GENERATED_IDS, generated),
            sc.FINISH_REASONS: sc.column(sc.FINISH_REASONS, reasons),
            sc.TEXT_ENDS: sc.column(sc.TEXT_ENDS, text_ends),
            sc.COMPLETION_S: sc.column(sc.COMPLETION_S, seconds),
            ERROR: pa.array(errors, pa.string()),
        })
