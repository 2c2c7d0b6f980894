"""Decode stage: prefilled rows -> generated text, one engine per actor kept over-subscribed.

Adopts each row's prefill output (its KV read from the block without a copy, operators/
stage_columns.py) into the engine (`add_prefilled`), with every in-flight batch feeding the same
engine loop as in BatchGen. The engine decodes the text once, as it does for BatchGen (it holds the
tokenizer for stop strings anyway), and the stage emits the output columns of `operators.columns`,
dropping the hand-off columns.
"""

from __future__ import annotations

import time
from typing import Any

from batchgen.connectors.indexed_parquet import ROW_INDEX
from batchgen.engine import Engine, EngineConfig, EngineLoop, InvalidRequestError, PrefillOutput
from batchgen.operators import stage_columns as sc
from batchgen.operators.actor_ready import announce_ready
from batchgen.operators.balancing import BalancingAgent, run_requests
from batchgen.operators.blocks import Block, column_values, to_block, with_columns, without_columns
from batchgen.operators.columns import ERROR, RowOutcome, output_columns, report_finished
from batchgen.operators.engine_actor import prepare_engine_process
from batchgen.operators.engine_factory import load_engine
from batchgen.operators.thread_lending import lend_threads


class Decode:
    def __init__(self, model: str, *, storage_options: dict[str, Any] | None = None, list_outputs: bool = False,
                 progress: Any = None, balancer: Any = None, **engine_options: Any) -> None:
        """list_outputs, progress, balancer: as for BatchGen."""
        init_started = time.perf_counter()
        if EngineConfig.from_kwargs(**engine_options).tp_size > 1:
            raise ValueError("the decode stage adopts prefilled KV of whole heads: tp_size > 1 serves BatchGen only "
                             "(ep_size serves Decode)")
        self.lending = lend_threads(prepare_engine_process(), engine_options)
        self.list_outputs = list_outputs
        self.loop = EngineLoop(lambda: load_engine(model, storage_options, **engine_options),
                               on_work=self.lending and self.lending.on_work)
        self.engine = self.loop.engine
        self.progress = progress
        self.agent = None if balancer is None else BalancingAgent(balancer, self.loop)
        announce_ready(progress, "Decode", init_started, self.loop.engine)

    async def __call__(self, batch: Any) -> Block:
        block = to_block(batch)
        outcomes = [RowOutcome(error=error, num_prompt_tokens=length)
                    for error, length in zip(column_values(block, ERROR), sc.prompt_lengths(block))]
        todo: list[tuple[int, PrefillOutput]] = []
        for i, prefilled in enumerate(sc.prefilled(block)):
            if outcomes[i].error is not None:
                continue
            try:
                if prefilled is None:
                    raise InvalidRequestError("the row reached decode without a prefill output")
                n = prefilled.request.sampling.n
                if n > 1 and not self.list_outputs:  # the schema has room for one sample: the rest would be lost
                    raise InvalidRequestError(f"sampling_params: n={n} needs list outputs; build Decode with "
                                              "list_outputs=True (as Tokenize decided for this job)")
                todo.append((i, prefilled))  # the engine checks it, on its own thread (add_prefilled)
            except InvalidRequestError as exc:
                outcomes[i].error = str(exc)

        def add(engine: Engine, i: int) -> None:
            engine.add_prefilled(todo[i][1])

        results = await run_requests(self.loop, self.agent, [p.request.request_id for _, p in todo], add)
        for (i, _), result in zip(todo, results):
            outcomes[i].result = result
        report_finished(self.progress, outcomes, column_values(block, ROW_INDEX))
        return with_columns(without_columns(block, (*sc.ALL, ERROR)), output_columns(outcomes, self.list_outputs))
