"""bench/host_overhead.py end to end at a small level (its own process: it freezes its heap, as engine actors do)."""

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "host_overhead.py"


def test_a_profiled_level_reports_runs_the_profiler_did_not_slow():
    """With --profile and one repeat, the profiled run was the one reported."""
    done = subprocess.run([sys.executable, str(BENCH), "--seqs", "2", "4", "--repeats", "1", "--profile", "--json"],
                          capture_output=True, text=True, timeout=300, check=True)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(report["host_share"]) == set(report["host_us_per_seq"]) == {"2", "4"}
    for level in ("2", "4"):
        run = report["runs"][level]
        assert len(run["host_share_runs"]) == 1 and "profile" not in run
        assert 0 < run["host_share"] < 1 and run["host_us_per_seq"] > 0
    assert "function calls" in done.stdout  # the largest level's profile, printed
    profiled = report["profiled"]
    assert profiled["seqs"] == 4 and profiled["wall_s"] != report["runs"]["4"]["wall_s"]
