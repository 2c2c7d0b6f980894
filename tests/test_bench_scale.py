"""bench/scale.py --quick --json end to end (in this process; each `batchgen run` is a subprocess with its
own Ray runtime, as the bench measures it; the passthrough runs on the session's runtime): every row of
both sizes comes out of the engine alone, the pipeline and the passthrough, and the process accounts find
the driver and the engine actor."""

import json

import pytest
from bench_helpers import import_bench

ROWS = 20


@pytest.mark.slow
def test_quick_json_report(ray_cluster, monkeypatch, capsys):
    bench = import_bench(monkeypatch, "scale")
    bench.main(["--quick", "--json", "--rows", str(ROWS)])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    sizes = [str(ROWS), str(bench.SCALE * ROWS)]
    assert report["workload"]["rows"] == [ROWS, bench.SCALE * ROWS]
    for kind in ("engine", "pipeline", "passthrough"):
        assert list(report["rows_per_s"][kind]) == sizes
        assert all(rate > 0 for rate in report["rows_per_s"][kind].values())
    for size in sizes:
        assert report["runs"]["engine"][size]["generated_tokens"] == int(size) * bench.SAMPLING["max_tokens"]
        assert report["runs"]["pipeline"][size]["errors"] == 0
    # the driver (the `batchgen run` process) and the engine actor were found and measured at both sizes
    for process in ("driver", "MapWorker(MapBatches(BatchGen))"):
        assert all(report["peak_rss_mb"][process][size] > 0 for size in sizes), process
        assert report["peak_rss_ratio"][process] > 0
    assert set(report["goals"]) >= {"rss_met", "rows_per_s_met", "worst_rss_ratio", "pipeline_over_engine"}
