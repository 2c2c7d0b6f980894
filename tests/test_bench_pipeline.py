"""bench/pipeline.py --quick --json end to end: both pipeline shapes give the engine's greedy tokens, and the
overhead figures add up (start-up + steady state) from a real Ray timeline."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "pipeline.py"
SHAPES = ("single", "disaggregated")


@pytest.mark.slow
def test_quick_json_report():
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--json"], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])

    workload = report["workload"]
    assert workload["num_prompts"] == 16
    assert set(report["bct_s"]) == set(report["tokens_per_s"]) == {"engine", *SHAPES}
    assert report["outputs_match"] == {shape: True for shape in SHAPES}
    for shape in SHAPES:
        run = report["pipelines"][shape]
        assert run["match"]["exact"] == run["match"]["total"] == 16, run["match"]
        assert run["rows_with_errors"] == 0
        assert run["generated_tokens_reported"] == workload["output_tokens"]
        assert run["tokens_per_s"] == pytest.approx(workload["output_tokens"] / run["bct_s"])
        assert run["overhead"] == pytest.approx(1 - report["bct_s"]["engine"] / run["bct_s"])
        assert run["overhead"] == pytest.approx(run["overhead_startup"] + run["overhead_steady"])
        # the timeline is ordered: engines constructed, then their tasks, all before the job returned
        assert 0 < run["startup_s"] <= run["last_engine_task_end_s"] <= run["bct_s"]
        actors = run["actors"]
        assert set(actors) == ({"BatchGen"} if shape == "single" else {"Prefill", "Decode"})
        for actor in actors.values():
            assert actor["constructions"] == 1 and actor["tasks"] >= 1
            assert actor["init_s"] > 0 and actor["ready_s"] <= actor["first_task_s"]
        assert run["cpu_s"]["engine_actors"] > 0
