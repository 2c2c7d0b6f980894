"""End to end on a real local Ray runtime: map_batches(BatchGen), the split pipeline, crashes, resume."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
from crash_injection import crashing, read_marker
from pipeline_helpers import ENGINE, SAMPLING, engine_outputs, read_output, workload, write_input

import batchgen.pipelines.pipeline
from batchgen.connectors.checkpoint import load_model
from batchgen.connectors.checkpoint_files import load_tokenizer
from batchgen.engine import Request, SamplingParams
from batchgen.engine.reference import ReferenceRunner
from batchgen.operators import BatchGen, Decode, Prefill
from batchgen.operators.engine_factory import load_engine
from batchgen.pipelines.cli import summary_text
from batchgen.pipelines.output_lease import LEASE
from batchgen.pipelines.pipeline import JobConfig, run_job

pytestmark = pytest.mark.slow  # end to end on a Ray runtime

ROWS = 20


@pytest.fixture(scope="module")
def prompts():
    return workload(ROWS)


@pytest.fixture(scope="module")
def expected(tiny_moe_dir, prompts):
    """The engine alone, checked once against the reference runner."""
    outputs = engine_outputs(tiny_moe_dir, prompts)
    ids = [load_tokenizer(tiny_moe_dir).encode(p) for p in prompts]
    assert ReferenceRunner(load_model(tiny_moe_dir).model).generate(ids, SAMPLING["max_tokens"]) == outputs
    return outputs


@pytest.fixture(scope="module")
def input_dir(tmp_path_factory, prompts):
    path = tmp_path_factory.mktemp("input")
    write_input(str(path), prompts, files=3, row_group_size=2)
    return str(path)


@pytest.fixture()
def preserve_order(monkeypatch):
    """Ray Data's process-wide ordered execution, for this test only (the pipeline runs without it)."""
    monkeypatch.setattr(ray.data.DataContext.get_current().execution_options, "preserve_order", True)


def assert_one_worker_died(marker: Path, stage: str) -> None:
    """The marker says `stage`'s worker crashed, and that process is really gone."""
    assert marker.exists(), f"no {stage} worker reached its crash batch: the fault injection never fired"
    crash = read_marker(marker)
    assert crash["stage"] == stage, crash
    pid, crashed_at = int(crash["pid"]), marker.stat().st_mtime
    assert pid != os.getpid()
    try:  # gone, not yet reaped, or its pid already reused by a process started after the crash
        process = psutil.Process(pid)
        assert process.status() == psutil.STATUS_ZOMBIE or process.create_time() >= crashed_at, process
    except psutil.NoSuchProcess:
        pass


def test_map_batches_two_actors_order_and_outputs_survive_an_actor_crash(
        ray_cluster, preserve_order, tiny_moe_dir, input_dir, expected, tmp_path):
    marker = tmp_path / "crashed"
    ds = ray.data.read_parquet(input_dir).repartition(10)  # small files read as one block: split it
    ds = ds.map_batches(crashing(BatchGen, after_batches=2, marker=marker), batch_size=2,
                        batch_format="pyarrow", num_cpus=0.5, compute=ray.data.ActorPoolStrategy(size=2),
                        fn_constructor_kwargs={"model": tiny_moe_dir, "sampling_params": SAMPLING, **ENGINE})
    rows = ds.take_all()
    assert_one_worker_died(marker, "BatchGen")
    assert [r["id"] for r in rows] == list(range(ROWS))  # every row once, in input order
    assert [list(r["generated_token_ids"]) for r in rows] == expected
    assert all(r["error"] is None for r in rows)


@pytest.mark.parametrize("stage,decode_actors", [(Prefill, 1), (Decode, 2)], ids=["Prefill", "Decode"])
def test_split_pipeline_writes_every_row_once_in_order_despite_an_engine_crash(
        ray_cluster, tiny_moe_dir, input_dir, expected, tmp_path, monkeypatch, stage, decode_actors):
    # one engine actor of `stage` dies mid-run (the prefill actor, or one of two decode actors) while
    # the other stage's actors live on; the pipeline refers to its stage classes by module-level name
    marker = tmp_path / "crashed"
    monkeypatch.setattr(batchgen.pipelines.pipeline, stage.__name__, crashing(stage, after_batches=3, marker=marker))
    output = str(tmp_path / "out")
    config = JobConfig(model=tiny_moe_dir, input=input_dir, output=output, mode="disaggregated",
                       sampling_params=SAMPLING, engine=ENGINE, batch_size=2, rows_per_block=2,
                       prefill_concurrency=1, decode_concurrency=decode_actors)
    summary = run_job(config)
    assert_one_worker_died(marker, stage.__name__)
    table = read_output(output)
    assert table.column("row_index").to_pylist() == list(range(ROWS))
    assert table.column("id").to_pylist() == list(range(ROWS))
    assert table.column("generated_token_ids").to_pylist() == expected
    assert not any(name.startswith("__batchgen") for name in table.column_names)
    assert summary.progress.rows == ROWS and summary.progress.errors == 0
    assert summary.progress.generated_tokens == ROWS * SAMPLING["max_tokens"]
    # the decode stage reported its rows as they left the engines, a crashed task's retried rows once
    assert summary.progress.finished_rows == ROWS and summary.progress.finished_tokens == ROWS * SAMPLING["max_tokens"]
    # two decode actors share a balancer (one actor, none), which the summary reports: busy time for each
    # engine actor that reported (the crashed one and its restart included)
    assert (summary.balancing is not None) == (decode_actors > 1)
    if summary.balancing is not None:
        assert len(summary.balancing.busy_s) >= 2 and sum(summary.balancing.busy_s.values()) > 0
        assert "engine busy" in summary_text(summary) and "migrated" in summary_text(summary)


def test_engine_actor_killed_holding_rows_of_two_tasks_loses_and_repeats_nothing(
        ray_cluster, tiny_moe_dir, input_dir, expected, tmp_path, monkeypatch):
    marker = tmp_path / "crashed"
    monkeypatch.setattr(batchgen.pipelines.pipeline, "BatchGen",
                        crashing(BatchGen, after_batches=1, marker=marker, min_in_flight=2))
    output = str(tmp_path / "out")
    config = JobConfig(model=tiny_moe_dir, input=input_dir, output=output, mode="single", sampling_params=SAMPLING,
                       engine=ENGINE, batch_size=2, rows_per_block=2, concurrency=1)
    summary = run_job(config)
    assert_one_worker_died(marker, "BatchGen")
    # batch_size == rows_per_block: each batch is a whole block, one Ray Data task; the engine held the rows
    # of at least two of them when it died
    assert int(read_marker(marker)["in_flight"]) >= 2
    table = read_output(output)
    assert table.column("row_index").to_pylist() == list(range(ROWS))
    assert table.column("generated_token_ids").to_pylist() == expected
    assert summary.progress.rows == ROWS and summary.progress.errors == 0
    assert [a.stage for a in summary.engine_actors] == ["BatchGen", "BatchGen"]  # the restarted actor too


def test_killed_driver_resumes_without_redoing_or_duplicating_rows(ray_cluster, tiny_moe_dir, tmp_path):
    prompts = workload(24, seed=11)
    input_dir, output = str(tmp_path / "in"), tmp_path / "out"
    write_input(input_dir, prompts, files=2, row_group_size=2)
    sampling = {**SAMPLING, "max_tokens": 12}
    # an engine running two sequences at a time: the kill lands between the first file and the last
    args = ["--model", tiny_moe_dir, "--input", input_dir, "--output", str(output), "--mode", "single",
            "--concurrency", "1", "--batch-size", "2", "--rows-per-block", "2",
            "--sampling-params", json.dumps(sampling), "--engine", json.dumps({**ENGINE, "max_num_seqs": 2})]
    log = tmp_path / "driver.log"
    with open(log, "w") as stderr:
        driver = subprocess.Popen([sys.executable, "-m", "batchgen.pipelines.cli", "run", *args,
                                   "--ray-address", ray_cluster, "--no-progress"],
                                  stdout=subprocess.DEVNULL, stderr=stderr)
    deadline = time.monotonic() + 180
    while not list(output.glob("part-*.parquet")) and driver.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    first_run = settled_parts(output)  # Ray reaps the dead driver's workers; a write in flight may land
    done = sum(t.num_rows for _, t in first_run.values())
    assert 0 < done < len(prompts), f"the kill did not land mid-run ({done} rows written): {log.read_text()}"

    config = JobConfig(model=tiny_moe_dir, input=input_dir, output=str(output), mode="single",
                       sampling_params=sampling, engine=ENGINE, batch_size=4, rows_per_block=4)
    summary = run_job(config)
    assert summary.progress.skipped_rows == done
    assert summary.progress.rows == len(prompts) - done  # nothing redone
    assert summary.progress.finished_rows == len(prompts) - done  # BatchGen reported each row as it finished
    assert [a.stage for a in summary.engine_actors] == ["BatchGen"] and summary.engines_ready_s > 0
    for name, (mtime, _) in first_run.items():  # nothing rewritten
        assert (output / name).stat().st_mtime_ns == mtime
    table = read_output(str(output))
    assert table.column("row_index").to_pylist() == list(range(len(prompts)))
    assert table.column("generated_token_ids").to_pylist() == engine_outputs(tiny_moe_dir, prompts, sampling)
    assert not any(name.startswith(".") for name in os.listdir(output))  # no leftover temporary files
    assert not (output / LEASE).exists()  # the killed driver's lease taken over (its process is gone), then released


def settled_parts(output: Path) -> dict[str, tuple[int, object]]:
    """The part files once no file has changed for a second: {name: (mtime, table)}."""
    def snapshot():
        return {p.name: p.stat().st_mtime_ns for p in output.glob("part-*.parquet")}

    before = snapshot()
    while True:
        time.sleep(1.0)
        now = snapshot()
        if now == before:
            return {name: (mtime, pq.read_table(output / name)) for name, mtime in now.items()}
        before = now


def test_structured_rows_follow_their_spec_through_map_batches_and_the_split_pipeline(
        ray_cluster, tiny_moe_dir, prompts, tmp_path, monkeypatch):
    """Per-row `sampling_params.structured_outputs` (a Parquet struct) through map_batches(BatchGen) and the
    disaggregated job, on prompts sharing a long prefix (cached in every engine, sent once a batch to
    decode): the same tokens as the engine alone without prefix caching, every output follows its spec,
    and a schema that does not compile is that row's error."""
    specs = [{"json": json.dumps({"type": "object", "additionalProperties": False, "required": ["ok", "n"],
                                  "properties": {"ok": {"type": "boolean"},
                                                 "n": {"type": "integer", "minimum": 0, "maximum": 9}}}),
              "disable_any_whitespace": True},
             {"regex": "[a-z]{3}-[0-9]{2}"}, {"choice": ["red", "green", "blue"]}, None,
             {"json": json.dumps({"type": "strnig"})}]
    rows = [{"max_tokens": 60, "seed": i, "temperature": 0.0 if i % 2 else 0.9, "structured_outputs": specs[i % 5]}
            for i in range(10)]
    shared = " ".join(prompts[10:])[:500]
    prompts = [f"{shared} {p}" for p in prompts[:10]]
    table = pa.table({"id": list(range(10)), "prompt": prompts, "sampling_params": rows})
    input_dir = tmp_path / "input"
    input_dir.mkdir()
    pq.write_table(table, input_dir / "part-0.parquet", row_group_size=3)
    engine = load_engine(tiny_moe_dir, **ENGINE, prefix_caching=False)
    results = engine.generate([Request(str(i), prompt=p, sampling=SamplingParams.from_dict(
        {k: v for k, v in r.items() if v is not None}, SamplingParams.from_dict(SAMPLING)))
        for i, (p, r) in enumerate(zip(prompts, rows))])
    expected = [r.outputs[0].token_ids if r.error is None else None for r in results]
    assert [e is None for e in expected] == [i % 5 == 4 for i in range(10)]

    ds = ray.data.read_parquet(str(input_dir)).map_batches(
        BatchGen, batch_size=3, batch_format="pyarrow", num_cpus=0.5, compute=ray.data.ActorPoolStrategy(size=1),
        fn_constructor_kwargs={"model": tiny_moe_dir, "sampling_params": SAMPLING, **ENGINE})
    mapped = sorted(ds.take_all(), key=lambda r: r["id"])
    output = str(tmp_path / "out")
    # the split pipeline as `batchgen run --engine-actors 2` runs it: the planner sets the engine settings ENGINE
    # leaves out, for this input, in a task placed like an engine actor, and splits the two actors
    planning = []
    plan_stages = batchgen.pipelines.pipeline.plan_stages
    monkeypatch.setattr(batchgen.pipelines.pipeline, "plan_stages",
                        lambda config: planning.append(time.time()) or plan_stages(config))
    summary = run_job(JobConfig(model=tiny_moe_dir, input=str(input_dir), output=output, mode="disaggregated",
                                sampling_params=SAMPLING, engine=ENGINE, batch_size=3, rows_per_block=3,
                                engine_actors=2))
    assert (summary.stage_split.prefill_actors, summary.stage_split.decode_actors) == (1, 1)
    assert summary.started_at <= planning[0]  # the BCT counts the plan's model load and profile: the job's own
    assert sorted(a.stage for a in summary.engine_actors) == ["Decode", "Prefill"]
    assert "stages       planned 1 prefill + 1 decode engine actors" in summary_text(summary)
    split = read_output(output).to_pylist()
    for out in (mapped, split):
        assert [r["id"] for r in out] == list(range(10))
        assert [None if r["error"] else list(r["generated_token_ids"]) for r in out] == expected
        assert all("does not compile" in r["error"] for r in out[4::5])
        texts = [r["generated_text"] for r in out]
        assert all(isinstance(json.loads(t)["ok"], bool) for t in texts[0::5])
        assert all(re.fullmatch("[a-z]{3}-[0-9]{2}", t) for t in texts[1::5])
        assert all(t in ("red", "green", "blue") for t in texts[2::5])

    def no_planning(config):
        raise AssertionError("a finished job planned its stages: a model loaded and profiled for nothing")

    monkeypatch.setattr(batchgen.pipelines.pipeline, "plan_stages", no_planning)
    again = run_job(JobConfig(model=tiny_moe_dir, input=str(input_dir), output=output, mode="disaggregated",
                              sampling_params=SAMPLING, engine=ENGINE, batch_size=3, rows_per_block=3,
                              engine_actors=2))
    assert again.progress.skipped_rows == 10 and again.progress.rows == 0 and again.stage_split is None


def test_the_split_pipelines_decode_stage_alone_takes_the_stage_plans_kv_budgets(ray_cluster, tiny_moe_dir,
                                                                                 input_dir, tmp_path):
    """The KV budgets a stage plan sized on a decode node reach the decode actors only; the prefill actors get the
    shared settings and size their own budgets where they run."""
    from batchgen.connectors.indexed_parquet import IndexedParquetSource
    from batchgen.pipelines.pipeline import build_dataset

    config = JobConfig(model=tiny_moe_dir, input=input_dir, output=str(tmp_path / "out"), mode="disaggregated",
                       engine={"max_num_seqs": 8})
    budgets = {"kv_budget_bytes": 3 << 20, "host_kv_budget_bytes": 5 << 20}
    ds = build_dataset(config, IndexedParquetSource(input_dir, {}), decode_engine=budgets)
    stages, op = {}, ds._logical_plan.dag
    while op.input_dependencies:
        stages[getattr(op, "fn", None)] = op.fn_constructor_kwargs
        op = op.input_dependencies[0]
    assert {name: stages[Decode][name] for name in budgets} == budgets
    assert not set(budgets) & set(stages[Prefill]) and stages[Prefill]["max_num_seqs"] == 8


class Recorded:
    """Stands for an actor class or factory in the pipeline module: what it makes, kept for the test."""

    def __init__(self, make):
        self.make, self.made = make, []

    def remote(self, *args, **kwargs):
        self.made.append(self.make(*args, **kwargs))
        return self.made[-1]

    def __call__(self, *args, **kwargs):
        return self.remote(*args, **kwargs)


def test_a_failed_job_ends_its_progress_tracker_and_work_balancer(ray_cluster, tiny_moe_dir, input_dir, tmp_path,
                                                                   monkeypatch):
    """They ended only with a successful job: a serving process (the Batch API) kept two actors of every job that
    failed or was cancelled."""
    pipeline = batchgen.pipelines.pipeline
    trackers = Recorded(pipeline.ProgressTracker.remote)
    balancers = Recorded(pipeline.start_work_balancer)
    monkeypatch.setattr(pipeline, "ProgressTracker", trackers)
    monkeypatch.setattr(pipeline, "start_work_balancer", balancers)

    def failing_write(*args, **kwargs):
        raise RuntimeError("the object store is unreachable")

    monkeypatch.setattr(pipeline, "_run_with_progress", failing_write)
    config = JobConfig(model=tiny_moe_dir, input=input_dir, output=str(tmp_path / "out"), mode="single",
                       sampling_params=SAMPLING, engine=ENGINE, concurrency=2)
    with pytest.raises(RuntimeError, match="unreachable"):
        run_job(config)
    assert len(trackers.made) == 1 and len(balancers.made) == 1
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(trackers.made[0].snapshot.remote(), timeout=60)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(balancers.made[0].summary.remote(), timeout=60)
