"""`ds.map_batches(BatchGen, ...)`: generation inside Ray Data, one engine per actor.

    ds.map_batches(BatchGen, fn_constructor_kwargs={"model": "s3://bucket/model",
                   "sampling_params": {"temperature": 0, "max_tokens": 256}, "max_num_seqs": 512},
                   batch_size=256, compute=engine_actor_pool(4), num_gpus=1)

Constructor keywords other than those named below are EngineConfig fields. Rows follow the column
contract in `batchgen.operators.columns`; a bad row gets an `error` and the batch carries on.

`__call__` is async: Ray Data keeps several batches of one task in flight per actor (4 by default,
RAY_DATA_DEFAULT_ASYNC_BATCH_UDF_MAX_CONCURRENCY), and with `compute=engine_actor_pool(n)` several
tasks (blocks) per actor, all feeding the one engine through its loop thread: the engine refills
from the next blocks while the last one's long tail drains, and the loop's admission bound applies
back-pressure. Each batch's rows come back in that batch's order.

Actor deaths are Ray Data's to handle: its actor pools restart dead actors and resubmit their
unfinished tasks (max_restarts=-1, max_task_retries=-1 by default), and a task's rows are only
emitted when the whole task finished, so a crash redoes rows without emitting any twice.
"""

from __future__ import annotations

import hashlib
import itertools
import time
import uuid
from typing import Any

from batchgen.connectors.indexed_parquet import ROW_INDEX
from batchgen.engine import Engine, EngineLoop, Request, SamplingParams
from batchgen.engine.chat import check_chat_template
from batchgen.operators.actor_ready import announce_ready
from batchgen.operators.balancing import BalancingAgent, run_requests
from batchgen.operators.blocks import Block, column_values, names, num_rows, rows, to_block, with_columns
from batchgen.operators.columns import (
    INPUT_COLUMNS,
    ParsedRow,
    RowOutcome,
    RowParser,
    check_input_columns,
    lists_outputs,
    output_columns,
    report_finished,
)
from batchgen.operators.engine_actor import prepare_engine_process
from batchgen.operators.engine_factory import load_engine
from batchgen.operators.thread_lending import lend_threads


def numbered_request_id(row_index: Any, parsed: ParsedRow) -> str:
    """A numbered row's request id: the same when its task runs again (its checkpoint is found, its request running
    on another actor is joined), another for a different row under the same number. A dataset's own `row_index`
    need not number its rows uniquely: keyed by the number alone, such a row was refused as a duplicate, or given the
    other row's checkpoint or output."""
    content = repr((parsed.prompt_token_ids, parsed.sampling)).encode()
    return f"row-{row_index}-{hashlib.blake2b(content, digest_size=8).hexdigest()}"


class BatchGen:
    def __init__(self, model: str, sampling_params: dict[str, Any] | None = None, *,
                 storage_options: dict[str, Any] | None = None, list_outputs: bool | None = None,
                 chat_template: str | None = None, progress: Any = None, balancer: Any = None,
                 **engine_options: Any) -> None:
        """
        model: a local checkpoint directory, an fsspec URI (s3://...) or a preset name ("tiny-moe").
        sampling_params: defaults for every row (SamplingParams fields); a row's own override them.
        list_outputs: one list entry per sample in the output columns (default: when n > 1).
        chat_template: the Jinja template `messages` rows are rendered with (default: the tokenizer's own).
        progress: the job's tracker (pipelines/progress.py): told when this actor is ready
        (`actor_ready`) and about every batch as it leaves the engine (`add_finished(rows, tokens)`: how
        `batchgen run` shows progress before rows are written).
        balancer: the job's WorkBalancer (operators/work_balancer.py), to MIGRATE requests between the
        engine actors of the pool and recover them from checkpoints (None: each actor keeps its own).
        """
        init_started = time.perf_counter()
        self.lending = lend_threads(prepare_engine_process(), engine_options)
        defaults = SamplingParams.from_dict(sampling_params)
        if chat_template is not None:
            check_chat_template(chat_template)  # before the model loads
        self.list_outputs = lists_outputs(list_outputs, defaults)
        self.loop = EngineLoop(lambda: load_engine(model, storage_options, **engine_options),
                               on_work=self.lending and self.lending.on_work)
        self.engine = self.loop.engine
        self.parser = RowParser(self.engine.normalizer.with_chat_template(chat_template), defaults, self.list_outputs)
        prefix = uuid.uuid4().hex[:12]  # once per actor: a uuid per row costs an os.urandom call
        self._ids = (f"{prefix}-{i}" for i in itertools.count())
        self.progress = progress
        self.agent = None if balancer is None else BalancingAgent(balancer, self.loop)
        announce_ready(progress, "BatchGen", init_started, self.engine)

    async def __call__(self, batch: Any) -> Block:
        block = to_block(batch)
        check_input_columns(names(block), "a batch given to BatchGen")  # as `batchgen run` checks its input
        outcomes = [RowOutcome() for _ in range(num_rows(block))]
        requests: list[tuple[int, Request]] = []
        # a numbered row has the same request id when its task runs again: its checkpoint is found
        numbered = column_values(block, ROW_INDEX)  # all None without the column
        for i, row in enumerate(rows(block, INPUT_COLUMNS)):
            parsed = self.parser.parse(row)
            if isinstance(parsed, str):
                outcomes[i].error = parsed
                continue
            outcomes[i].num_prompt_tokens = len(parsed.prompt_token_ids)
            rid = next(self._ids) if numbered[i] is None else numbered_request_id(numbered[i], parsed)
            requests.append((i, Request(rid, parsed.prompt_token_ids, sampling=parsed.sampling)))

        def add(engine: Engine, i: int) -> None:
            engine.add_request(requests[i][1])

        results = await run_requests(self.loop, self.agent, [r.request_id for _, r in requests], add)
        for (i, _), result in zip(requests, results):
            outcomes[i].result = result
        report_finished(self.progress, outcomes, numbered)
        return with_columns(block, output_columns(outcomes, self.list_outputs))
