"""bench/bct.py --quick --json end to end (in this process: no second interpreter to start): report keys,
BatchGen's greedy tokens equal lockstep's and transformers', and the KV budget really constrains."""

import json

import pytest
from bench_helpers import import_bench
from transformers.utils import logging as hf_logging

SYSTEMS = {"batchgen", "lockstep", "transformers"}
PROMPTS = 8


@pytest.mark.slow
def test_quick_json_report(monkeypatch, capsys):
    bct = import_bench(monkeypatch, "bct")
    progress_bars = hf_logging.is_progress_bar_enabled()
    try:
        # half the --quick workload, with a KV budget of 4 mean contexts: still 2x over-subscribed
        bct.main(["--quick", "--json", "--num-prompts", str(PROMPTS), "--budget-seqs", "4", "--repeats", "2"])
    finally:
        if progress_bars:  # the bench turns transformers' progress bars off process-wide: put them back
            hf_logging.enable_progress_bar()
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    assert report["workload"]["num_prompts"] == PROMPTS
    for name in ("unconstrained", "kv_budget"):
        scenario = report["scenarios"][name]
        for key in ("bct_s", "tokens_per_s", "mean_expert_batch", "completion_time_s"):
            assert set(scenario[key]) == SYSTEMS, (name, key)
        assert set(scenario["scheduler_share"]) == {"batchgen", "lockstep"}
        # both engine modes planned for the bench's 8 prompts: every prompt admitted at once
        assert min(s["max_num_seqs"] for s in scenario["engine_settings"].values()) >= PROMPTS, scenario

        runs = scenario["bct_runs_s"]  # each engine mode twice, interleaved; the lower one reported
        assert set(runs) == {"batchgen", "lockstep"} and all(len(r) == 2 for r in runs.values()), runs
        assert all(scenario["bct_s"][name] == min(r) for name, r in runs.items()), (scenario["bct_s"], runs)
        # BatchGen and lockstep share one implementation: greedy tokens must be identical; transformers
        # runs the same weights (float32, greedy) through its own model code and must agree too
        for pair in ("batchgen_vs_lockstep", "batchgen_vs_hf"):
            match = scenario["match"][pair]
            assert scenario["outputs_match"][pair] is True, (name, pair, match)
            assert match["exact"] == match["total"] == PROMPTS, (name, pair, match)
    assert report["outputs_match"] == {"batchgen_vs_lockstep": True, "batchgen_vs_hf": True}
    constrained = report["scenarios"]["kv_budget"]
    assert constrained["kv_budget_bytes"] < report["scenarios"]["unconstrained"]["kv_budget_bytes"]
    # the budget holds half the sequences: BatchGen must have moved KV off the device to run them all
    assert constrained["engine"]["batchgen"]["peak_suspended"] > 0


def test_an_engine_mode_reports_its_median_run_and_must_repeat_its_tokens(monkeypatch):
    bct = import_bench(monkeypatch, "bct")

    def run(seconds, tokens=((1, 2), (3,))):
        return bct.SystemRun(tokens=[list(t) for t in tokens], bct_s=seconds, completion_times=[],
                             mean_expert_batch=1.0)

    assert bct.median_run("batchgen", [run(3.0), run(1.0), run(2.0)]).bct_s == 2.0
    assert bct.median_run("batchgen", [run(3.0), run(1.0)]).bct_s == 1.0
    with pytest.raises(RuntimeError, match="lockstep: run 3 generated other tokens than run 1"):
        bct.median_run("lockstep", [run(1.0), run(2.0), run(3.0, ((1, 2), (4,)))])
