"""The job summary reads completion times and errors from the output's part files one file at a time: its quantiles
are those of every row, within the sketch's relative error, with no Ray and no engine needed."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from batchgen.connectors.indexed_parquet import ROW_INDEX, OrderedParquetSink
from batchgen.engine.quantile_sketch import RELATIVE_ERROR
from batchgen.pipelines.pipeline import JobConfig, JobError, _summarise
from batchgen.pipelines.progress import Progress

ROWS = 3_000


def test_completion_time_quantiles_are_those_of_every_row_in_the_output(tmp_path):
    times = np.random.default_rng(2).exponential(0.4, ROWS)
    errors = np.arange(ROWS) % 97 == 0  # rows with an error have no completion time
    sink = OrderedParquetSink(str(tmp_path))
    for start in range(0, ROWS, 700):  # several part files, as several write tasks leave them
        rows = np.arange(start, min(ROWS, start + 700))
        sink.write([pa.table({ROW_INDEX: rows, "completion_time_s": pa.array(times[rows], mask=errors[rows]),
                              "error": pa.array(["failed"] * len(rows), mask=~errors[rows])})], None)
    config = JobConfig(model="tiny-moe", input="unused", output=str(tmp_path))
    summary = _summarise(config, Progress(total_rows=ROWS, skipped_rows=0))
    assert summary.files == 5 and summary.error_rows == int(errors.sum()) == 31  # every file's, whichever run wrote it
    timed = np.sort(times[~errors])
    for q, value in ((0.5, summary.completion_time_p50_s), (0.99, summary.completion_time_p99_s)):
        exact = timed[int(q * len(timed))]
        assert value == pytest.approx(exact, rel=RELATIVE_ERROR * (1 + 1e-9)), q
    with pytest.raises(JobError, match="of 3001 rows"):
        _summarise(config, Progress(total_rows=ROWS + 1, skipped_rows=0))


def test_engines_are_ready_when_the_last_first_started_actor_of_any_stage_is():
    """It was the first actor ready of each stage: four BatchGen actors ready at 10, 12, 30 and 31 s gave 10 s. An
    actor restarted after a crash (its constructor started after the stage's first actor was ready) is left out."""
    from batchgen.operators.actor_ready import EngineActorReady
    from batchgen.pipelines.pipeline import JobSummary

    actors = [EngineActorReady("BatchGen", "node", 100.0 + ready, init_s=ready - 1) for ready in (10, 12, 30, 31)]
    actors.append(EngineActorReady("BatchGen", "node", 190.0, init_s=20.0))  # restarted at 170 s
    summary = JobSummary.__new__(JobSummary)
    summary.engine_actors, summary.started_at = actors, 100.0
    assert summary.engines_ready_s == 31.0
