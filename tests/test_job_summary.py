"""The job summary reads completion times from the output's part files one file at a time: its quantiles
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
        sink.write([pa.table({ROW_INDEX: rows, "completion_time_s": pa.array(times[rows], mask=errors[rows])})], None)
    config = JobConfig(model="tiny-moe", input="unused", output=str(tmp_path))
    summary = _summarise(config, Progress(total_rows=ROWS, skipped_rows=0))
    assert summary.files == 5
    timed = np.sort(times[~errors])
    for q, value in ((0.5, summary.completion_time_p50_s), (0.99, summary.completion_time_p99_s)):
        exact = timed[int(q * len(timed))]
        assert value == pytest.approx(exact, rel=RELATIVE_ERROR * (1 + 1e-9)), q
    with pytest.raises(JobError, match="of 3001 rows"):
        _summarise(config, Progress(total_rows=ROWS + 1, skipped_rows=0))
