"""bench/offload.py --json end to end on tiny-moe (in this process): the report's keys, both systems' tokens
equal to the resident engine's, and a budget the baseline cannot run at reported with its reason."""

import json

from bench_helpers import import_bench


def test_json_report(monkeypatch, capsys, tiny_moe_dir):
    offload = import_bench(monkeypatch, "offload")
    offload.main(["--json", "--model", tiny_moe_dir, "--num-prompts", "8", "--prompt-tokens", "16",
                  "--max-tokens", "8", "--budgets", "0.5", "0.15"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["outputs_match"] is True
    assert set(report["budgets"]) == {"0.5", "0.15"}
    half = report["budgets"]["0.5"]
    for system in ("batchgen", "flexgen_style"):
        assert half["tokens_per_s"][system] > 0
        run = half["runs"][system]
        assert run["outputs_match"] is True
        assert run["device_memory"]["peak_bytes"] <= half["device_memory_bytes"]
        assert half["bytes_streamed_per_token"][system] > 0
    # the baseline's whole-layer slot does not fit 15 % of the weights; expert by expert does
    tight = report["budgets"]["0.15"]
    assert tight["tokens_per_s"]["flexgen_style"] is None and tight["speedup"] is None
    assert "below this model's minimum" in tight["runs"]["flexgen_style"]["error"]
    assert tight["tokens_per_s"]["batchgen"] > 0 and tight["runs"]["batchgen"]["outputs_match"] is True
