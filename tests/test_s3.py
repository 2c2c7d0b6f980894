"""Model, input and output all on s3://, served by a moto server on localhost."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import s3fs
from pipeline_helpers import ENGINE, SAMPLING, engine_outputs, read_output, workload, write_input

from batchgen.pipelines.pipeline import JobConfig, JobError, run_job


@pytest.fixture(scope="module")
def s3_options():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                pytest.fail("the moto server did not start")
            time.sleep(0.1)
    yield {"key": "testing", "secret": "testing", "endpoint_url": f"http://127.0.0.1:{port}"}
    server.kill()
    server.wait()


def test_model_input_and_output_on_s3(ray_cluster, tiny_moe_dir, s3_options):
    fs = s3fs.S3FileSystem(**s3_options)
    for bucket in ("models", "data"):
        fs.mkdir(bucket)
    for path in Path(tiny_moe_dir).iterdir():
        fs.put_file(str(path), f"models/tiny-moe/{path.name}")
    prompts = workload(8, seed=5)
    write_input("s3://data/in", prompts, files=2, row_group_size=2, storage_options=s3_options)

    config = JobConfig(model="s3://models/tiny-moe", input="s3://data/in", output="s3://data/out", mode="single",
                       sampling_params=SAMPLING, engine=ENGINE, storage_options=s3_options, batch_size=2,
                       rows_per_block=2)
    summary = run_job(config)
    assert summary.progress.rows == len(prompts) and summary.progress.errors == 0
    table = read_output("s3://data/out", s3_options)
    assert table.column("row_index").to_pylist() == list(range(len(prompts)))
    assert table.column("id").to_pylist() == list(range(len(prompts)))
    assert table.column("generated_token_ids").to_pylist() == engine_outputs(tiny_moe_dir, prompts)

    # a finished job run again writes nothing, and a different job may not reuse the output
    again = run_job(config)
    assert again.progress.skipped_rows == len(prompts) and again.progress.rows == 0
    other = JobConfig(**{**config.__dict__, "sampling_params": {**SAMPLING, "max_tokens": 3}})
    with pytest.raises(JobError, match="holds results of a different job"):
        run_job(other)
    with pytest.raises(JobError, match="is not readable"):
        run_job(JobConfig(**{**config.__dict__, "model": "s3://models/missing"}))
