"""bench/bct.py --quick --json end to end (in this process: no second interpreter to start): report keys,
BatchGen's greedy tokens equal lockstep's and transformers', and the KV budget really constrains."""

import gc
import json

import pytest
from bench_helpers import import_bench
from transformers.utils import logging as hf_logging

SYSTEMS = {"batchgen", "lockstep", "transformers"}
PROMPTS = 8
EXPERTS = 4


@pytest.mark.slow
def test_quick_json_report(monkeypatch, capsys):
    bct = import_bench(monkeypatch, "bct")
    progress_bars = hf_logging.is_progress_bar_enabled()
    frozen = gc.get_freeze_count()
    try:
        # half the --quick workload, with a KV budget of 4 mean contexts: still 2x over-subscribed; bench-moe with
        # 4 experts (--experts): the same code paths as its 16, a quarter of the weights to build and read
        bct.main(["--quick", "--json", "--num-prompts", str(PROMPTS), "--budget-seqs", "4", "--repeats", "2",
                  "--experts", str(EXPERTS)])
    finally:
        if progress_bars:  # the bench turns transformers' progress bars off process-wide: put them back
            hf_logging.enable_progress_bar()
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # the bench froze the heap for its runs and thawed it: this process's later tests collect as before
    assert gc.get_freeze_count() == frozen

    assert report["workload"]["num_prompts"] == PROMPTS and report["decode_graphs"] is True
    # the peaks sampled at the start and after each scenario, every bound priced at each peak's best of them
    samples, machine = report["machine"]["peak_samples"], report["machine"]
    assert len(samples) == 3
    for peak in ("matmul_flops", "read_bandwidth", "copy_bandwidth"):
        assert machine[peak] == max(sample[peak] for sample in samples), peak
    assert report["workload"]["experts"] == EXPERTS
    for name in ("unconstrained", "kv_budget"):
        scenario = report["scenarios"][name]
        for key in ("bct_s", "tokens_per_s", "mean_expert_batch", "completion_time_s"):
            assert set(scenario[key]) == SYSTEMS, (name, key)
        assert set(scenario["scheduler_share"]) == {"batchgen", "lockstep"}
        # each engine mode's schedule as observed step by step: every step once (a mixed one in both counts)
        for mode, engine in scenario["engine"].items():
            assert engine["frozen_objects"] > 0, (name, mode)  # run in a frozen heap, as in an engine actor
            assert engine["decode_graph_replays"] > 0, (name, mode)  # decode graphs on, as without --eager
            steps = engine["prefill_steps"] + engine["decode_steps"] - engine["mixed_steps"]
            assert scenario["schedule_steps"][mode] == steps, (name, mode, engine)
            assert scenario["schedule_bound_s"][mode] > 0
            # the same steps by class: every step in one class, their wall time within the run's
            classes = scenario["step_classes"][mode]
            assert sum(c["steps"] for c in classes.values()) == steps and "prefill" in classes, classes
            assert 0 < sum(c["seconds"] for c in classes.values()) <= scenario["bct_s"][mode] + 1e-9
            assert sum(c["bound_s"] for c in classes.values()) == pytest.approx(scenario["schedule_bound_s"][mode])
        assert scenario["speedup_vs_lockstep_at_bounds"] == pytest.approx(
            scenario["schedule_bound_s"]["lockstep"] / scenario["schedule_bound_s"]["batchgen"])
        # both engine modes planned for the bench's 8 prompts: every prompt admitted at once
        assert min(s["max_num_seqs"] for s in scenario["engine_settings"].values()) >= PROMPTS, scenario

        runs = scenario["bct_runs_s"]  # each engine mode twice, interleaved, transformers once; the lower one reported
        assert {name: len(r) for name, r in runs.items()} == {"batchgen": 2, "lockstep": 2, "transformers": 1}, runs
        assert all(scenario["bct_s"][name] == min(r) for name, r in runs.items()), (scenario["bct_s"], runs)
        # BatchGen and lockstep share one implementation: greedy tokens must be identical; transformers
        # runs the same weights (float32, greedy) through its own model code and must agree too
        for pair in ("batchgen_vs_lockstep", "batchgen_vs_hf"):
            match = scenario["match"][pair]
            assert scenario["outputs_match_by_pair"][pair] is True, (name, pair, match)
            assert match["exact"] == match["total"] == PROMPTS, (name, pair, match)
        assert scenario["outputs_match"] is True
    assert report["outputs_match"] is True
    assert report["outputs_match_by_pair"] == {"batchgen_vs_lockstep": True, "batchgen_vs_hf": True}
    constrained = report["scenarios"]["kv_budget"]
    assert constrained["kv_budget_bytes"] < report["scenarios"]["unconstrained"]["kv_budget_bytes"]
    # the budget holds half the sequences: BatchGen must have moved KV off the device to run them all
    assert constrained["engine"]["batchgen"]["peak_suspended"] > 0


def test_steps_fall_in_classes_by_what_they_run(monkeypatch):
    bct = import_bench(monkeypatch, "bct")
    import roofline

    decode = [roofline.StepShape(decoded=n, decode_kv=10 * n) for n in (1, 8, 9, 16, 17, 100, 128, 129)]
    assert [bct.step_class(s) for s in decode] == ["decode_1_8", "decode_1_8", "decode_9_16", "decode_9_16",
                                                   "decode_17_32", "decode_65_128", "decode_65_128",
                                                   "decode_129_256"]
    assert bct.step_class(roofline.StepShape(prompt_tokens=30, decoded=200)) == "prefill"
    shape = roofline.MoEShape(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, experts=4, top_k=2,
                              intermediate=64, dtype_bytes=4)
    peaks = roofline.MachinePeaks(matmul_flops=1e9, read_bandwidth=1e9, copy_bandwidth=1e9)
    steps = [decode[5], roofline.StepShape(prompt_tokens=30), decode[0], decode[1]]
    classes = bct.step_classes(shape, steps, [0.5, 2.0, 0.25, 0.25], peaks)
    assert list(classes) == ["prefill", "decode_1_8", "decode_65_128"]
    assert classes["decode_1_8"]["steps"] == 2 and classes["decode_1_8"]["seconds"] == 0.5
    bound = sum(roofline.step_seconds(shape, s, peaks)[0] for s in steps[2:])
    assert classes["decode_1_8"]["bound_s"] == pytest.approx(bound)
    assert classes["decode_1_8"]["over_bound"] == pytest.approx(0.5 / bound)


def test_an_engine_mode_reports_its_median_run_and_must_repeat_its_tokens(monkeypatch):
    bct = import_bench(monkeypatch, "bct")

    def run(seconds, tokens=((1, 2), (3,))):
        return bct.SystemRun(tokens=[list(t) for t in tokens], bct_s=seconds, completion_times=[],
                             mean_expert_batch=1.0)

    assert bct.median_run("batchgen", [run(3.0), run(1.0), run(2.0)]).bct_s == 2.0
    assert bct.median_run("batchgen", [run(3.0), run(1.0)]).bct_s == 1.0
    with pytest.raises(RuntimeError, match="lockstep: run 3 generated other tokens than run 1"):
        bct.median_run("lockstep", [run(1.0), run(2.0), run(3.0, ((1, 2), (4,)))])


def test_a_schedule_bound_adds_its_steps_and_a_mixed_step_reads_the_weights_once(monkeypatch):
    import_bench(monkeypatch, "bct")
    import roofline

    shape = roofline.MoEShape(vocab=4096, hidden=512, layers=6, heads=8, kv_heads=2, head_dim=64, experts=16,
                              top_k=2, intermediate=1024, dtype_bytes=4)
    peaks = roofline.MachinePeaks(matmul_flops=300e9, read_bandwidth=25e9, copy_bandwidth=20e9)
    prompts, outputs = [40, 100, 7], [5, 1, 3]
    best = roofline.workload_bound(shape, prompts, outputs, peaks)
    # the workload's own bound is the bound of its ideal schedule: one prefill, then one step per output position
    ideal = [roofline.StepShape(prompt_tokens=147, prompt_attended=sum(n * (n + 1) // 2 for n in prompts),
                                prompts_completed=3)]
    ideal += [roofline.StepShape(decoded=2, decode_kv=40 + 7 + 2 * step) for step in (1, 2)]
    ideal += [roofline.StepShape(decoded=1, decode_kv=40 + step) for step in (3, 4)]
    assert best.decode_steps == 4
    assert roofline.schedule_bound(shape, ideal, peaks) == pytest.approx(best.seconds)
    # prompts prefilled one per step take longer: the weights are read in each step
    apart = [roofline.StepShape(prompt_tokens=n, prompt_attended=n * (n + 1) // 2, prompts_completed=1)
             for n in prompts]
    assert roofline.schedule_bound(shape, apart + ideal[1:], peaks) > best.seconds
    # a decode step COMBINE-d with a prefill chunk costs less than the two apart (one read of the weights)
    chunk, decode = roofline.StepShape(prompt_tokens=64, prompt_attended=2080), ideal[3]
    mixed = roofline.StepShape(prompt_tokens=64, prompt_attended=2080, decoded=1, decode_kv=43)
    apart_seconds = sum(roofline.step_seconds(shape, s, peaks)[0] for s in (chunk, decode))
    assert roofline.step_seconds(shape, mixed, peaks)[0] < apart_seconds
