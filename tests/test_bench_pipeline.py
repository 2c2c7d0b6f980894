"""bench/pipeline.py --quick --json end to end, in this process on the session's Ray runtime (no second
interpreter, no second Ray start): both pipeline shapes give the engine's greedy tokens for every row, and
Ray's timeline and CPU accounts find the engine actors."""

import json

import pytest
import ray
from bench_helpers import import_bench

SHAPES = ("single", "disaggregated")
PROMPTS = 4
EXPERTS = 4  # bench-moe with 4 experts (--experts), as test_bench_bct.py runs it: a quarter of the weights to load


@pytest.mark.slow
def test_quick_json_report(ray_cluster, monkeypatch, capsys):
    bench = import_bench(monkeypatch, "pipeline")
    data_context = ray.data.DataContext.get_current()
    progress_bars = data_context.enable_progress_bars
    bench.main(["--quick", "--json", "--num-prompts", str(PROMPTS), "--experts", str(EXPERTS)])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    workload = report["workload"]
    assert workload["num_prompts"] == PROMPTS and workload["experts"] == EXPERTS
    assert set(report["bct_s"]) == set(report["tokens_per_s"]) == {"engine", *SHAPES}
    assert report["outputs_match"] is True and report["outputs_match_by_shape"] == {shape: True for shape in SHAPES}
    for shape in SHAPES:
        run = report["pipelines"][shape]
        assert run["match"]["exact"] == run["match"]["total"] == PROMPTS, run["match"]
        assert run["rows_with_errors"] == 0
        assert run["generated_tokens_reported"] == workload["output_tokens"]
        # the timeline is ordered: engines constructed, then their tasks, all before the job returned
        assert run["startup_s"] <= run["last_engine_task_end_s"] <= run["bct_s"]
        actors = run["actors"]
        assert set(actors) == ({"BatchGen"} if shape == "single" else {"Prefill", "Decode"})
        for actor in actors.values():
            assert actor["constructions"] == 1  # no actor died and was rebuilt
            assert actor["ready_s"] <= actor["first_task_s"]
        # the CPU account tells the engine actors' processes apart by their titles
        assert run["cpu_s"]["engine_actors"] > 0
    # the bench put back the process-wide Ray Data setting it changed
    assert ray.data.DataContext.get_current() is data_context
    assert data_context.enable_progress_bars == progress_bars
