"""bench/bct.py --quick --json end to end: report keys, and BatchGen's greedy tokens equal lockstep's."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bct.py"
SYSTEMS = {"batchgen", "lockstep", "transformers"}


@pytest.mark.slow
def test_quick_json_report():
    # timings do not matter here; passive OpenMP waits keep the run fast when other jobs share the cores
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--json"], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])

    assert report["workload"]["num_prompts"] == 16
    assert report["roofline"]["seconds"] > 0 and report["machine"]["matmul_flops"] > 0
    for name in ("unconstrained", "kv_budget"):
        scenario = report["scenarios"][name]
        for key in ("bct_s", "tokens_per_s", "mean_expert_batch", "completion_time_s"):
            assert set(scenario[key]) == SYSTEMS, (name, key)
        assert all(v > 0 for v in scenario["bct_s"].values())
        assert set(scenario["scheduler_share"]) == {"batchgen", "lockstep"}
        for key in ("speedup_vs_hf", "speedup_vs_lockstep", "bct_over_roofline"):
            assert scenario[key] > 0, (name, key)
        # BatchGen and lockstep share one implementation: greedy tokens must be identical
        match = scenario["match"]["batchgen_vs_lockstep"]
        assert scenario["outputs_match"]["batchgen_vs_lockstep"] is True, match
        assert match["exact"] == match["total"] == 16
    assert report["outputs_match"]["batchgen_vs_lockstep"] is True
    constrained = report["scenarios"]["kv_budget"]
    assert constrained["kv_budget_bytes"] < report["scenarios"]["unconstrained"]["kv_budget_bytes"]
    # the budget holds 8 of 16 sequences: BatchGen must have moved KV off the device to run them all
    assert constrained["engine"]["batchgen"]["peak_suspended"] > 0
